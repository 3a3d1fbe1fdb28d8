/*
 * The few context calls jobs make beyond ferry.h, without seeing the transport's structs
 * (transport.h): a job owns a channel (its messages go to its callback, not to ferry_recv's
 * queue), keeps what it must handle on a thread of its own in an inbox, and waits through the
 * one context wait; a service loop is woken out of a long wait.
 */
#ifndef FR_CTXCALLS_H
#define FR_CTXCALLS_H

#include "ferry.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

/* ---- channels with an owner (chanq.c) ---- */
typedef struct fr_channel_ops {
  /* A message for the channel, called on whichever thread drives the context (its epoll's
   * leader, or a waiter draining a shm ring), with the channel's lock held: it must not block,
   * nor open or close a channel. It updates state or queues the message on the job's own queue
   * (fr_inbox_put); msg (and its reference to link) is the owner's, freed with ferry_msg_free. */
  void (*on_msg)(void *arg, ferry_link *link, ferry_msg *msg);
  /* Optional: a link of the context died (failed, closed, its peer gone), called once per link
   * on the thread that retires it, with the channel's lock held and the same rules as on_msg.
   * For an owner whose waits depend on its peers being alive (a publish waiting for a
   * subscriber's credit), so that it need not poll their state. */
  void (*on_link_down)(void *arg, ferry_link *link);
} fr_channel_ops;

/* Makes ops/arg the channel's owner: from now on its messages go to on_msg, never to
 * ferry_recv (which refuses the channel); messages queued before are handed over first.
 * FERRY_EBUSY when the channel has an owner already; FERRY_EINVAL for a bad channel. */
int fr_ctx_channel_open(ferry_ctx *ctx, uint32_t channel, const fr_channel_ops *ops, void *arg);
/* Gives the channel up: once it returns, on_msg runs no more and arg may be freed. Messages
 * that arrive later are queued for ferry_recv as on a channel without an owner. */
void fr_ctx_channel_close(ferry_ctx *ctx, uint32_t channel);

/* ---- the one wait (leader.c) ---- */
/* Waits until ready(arg) or the deadline (CLOCK_MONOTONIC ns; UINT64_MAX: none): leads the
 * ctx's epoll when it can, else sleeps on cond (a CLOCK_MONOTONIC condition under mutex, which
 * whoever makes it ready signals). Returns ready(arg). With the deadline already past it only
 * checks, leading nothing: a lead taken for no wait would cost two epoll_ctl calls, and one
 * held by an idle wait would be asked to step down (a wake-up, and up to FERRY_LEAD_FOLLOW_US
 * waiting for it). A caller that must see what has arrived drains the shm rings first
 * (fr_ctx_poll_links, as fr_ctx_await does); a leader takes in the rest. `waits_for`: the
 * channel whose messages make it ready, or FR_CTX_WAIT_REPLY (a response on a link); a leader is
 * woken (fr_ctx_poke, fr_ctx_kick) only for that. */
#define FR_CTX_WAIT_REPLY (-1)
bool fr_ctx_wait(ferry_ctx *ctx, int waits_for, bool (*ready)(void *), void *arg,
                 pthread_mutex_t *mutex, pthread_cond_t *cond, uint64_t deadline_ns);

/* ---- a job's queue of messages (inbox.c) ----
 * What a channel's owner hands to its service thread: on_msg puts (fr_inbox_ops does only
 * that), the thread waits and takes. Only the inbox's own fields are shared, under its lock. */
typedef struct fr_inbox {
  pthread_mutex_t lock;
  pthread_cond_t cond; /* CLOCK_MONOTONIC */
  struct fr_msg_node *head, *tail;
  size_t count; /* atomic: read by the waiter's ready() */
  bool kicked;  /* atomic: fr_inbox_kick, not yet seen by a wait */
} fr_inbox;
void fr_inbox_init(fr_inbox *q);
/* Frees the messages still queued. */
void fr_inbox_fini(fr_inbox *q);
/* Appends msg (taken) and wakes the waiter; never blocks beyond the inbox's lock. */
void fr_inbox_put(fr_inbox *q, ferry_msg *msg);
/* Channel ops whose on_msg puts every message in the inbox given as arg. */
extern const fr_channel_ops fr_inbox_ops;
/* The next message, waiting for one until the deadline (UINT64_MAX: none) as a service loop
 * does: an idle wait, which never spins and leaves the epoll to callers that want it (the same
 * thread's other waits, for the answers a request needs, are a caller's); `channel` is the one
 * whose messages fill q. NULL when the deadline passed or the inbox was kicked. */
ferry_msg *fr_inbox_wait(ferry_ctx *ctx, uint32_t channel, fr_inbox *q, uint64_t deadline_ns);
/* fr_inbox_wait in two steps, for a thread that must take under a lock of its own (the
 * directory server: a caller's fence must find every message either in the inbox or served):
 * waits the same way, and says whether a message is queued. */
bool fr_inbox_await(ferry_ctx *ctx, uint32_t channel, fr_inbox *q, uint64_t deadline_ns);
/* The next message if one is queued, without waiting; NULL otherwise. */
ferry_msg *fr_inbox_take(fr_inbox *q);
/* Ends the current or next fr_inbox_wait early, once, without a message: the owner sets its
 * stop flag (or moves a timer) first, then kicks. */
void fr_inbox_kick(ferry_ctx *ctx, uint32_t channel, fr_inbox *q);

/* Ends the channel's current or next wait (fr_ctx_await, ferry_recv) early, once, as a message
 * would: a service loop that waits for long is told to stop, or to look at its timers, without
 * polling. */
void fr_ctx_kick(ferry_ctx *ctx, uint32_t channel);

/* ---- what else jobs need of a context (link calls: linkcalls.h): waiting and taking in two
 * steps, seeing the ctx close, a long copy that lets shm peers answer without a doorbell, and
 * routes on a metrics server. ---- */
/* ferry_recv() in two steps: waits (as ferry_recv does) until the channel has a message or the
 * timeout passed, and returns whether it has one (no error set; a closing ctx or a kick end the
 * wait early), then takes one without waiting (NULL: none). A wait of 0 never blocks on a
 * message, yet sees every message that has arrived: with the channel empty, it drains the ctx's
 * shm links itself (waiting only for a drain another thread is doing right then). So never
 * from code the transport runs while it delivers (a message callback): that drain holds the
 * link, and the wait would be for itself. */
bool fr_ctx_await(ferry_ctx *ctx, uint32_t channel, int timeout_ms);
/* Spins for ready(arg) for up to FERRY_SPIN_US, driving every link of the context that is cheap
 * to poll (shm rings) meanwhile, so that what they bring is delivered (to an owner's on_msg) by
 * this thread, with no wake-up: what an owned channel's waiter does before fr_ctx_wait when its
 * messages come over shm. Returns ready(arg); false at once when no link is worth spinning on. */
bool fr_ctx_spin(ferry_ctx *ctx, bool (*ready)(void *), void *arg);
/* Drains every link of the context that is cheap to poll (shm rings), waiting for a drain
 * another thread is doing: what their peers sent before the call has been delivered when it
 * returns. For a wait whose deadline has passed (an owned channel has no queue to look at). */
void fr_ctx_poll_links(ferry_ctx *ctx);
/* Something a caller may wait on changed outside the ctx's leader (a spinning waiter drove a
 * link; a channel's owner changed its state on another thread): a message on `what` (a channel)
 * or a response (FR_CTX_WAIT_REPLY). Wakes a caller that leads the epoll waiting for that, so it
 * sees it; a leader waiting for something else (the embedded directory's thread, for its
 * requests) sleeps on. Takes no lock: one atomic load when nobody leads for `what`. */
void fr_ctx_poke(ferry_ctx *ctx, int what);
ferry_msg *fr_ctx_take(ferry_ctx *ctx, uint32_t channel);
/* Whether ferry_ctx_close has begun: a service loop whose wait ended empty stops. */
bool fr_ctx_closing(const ferry_ctx *ctx);
/* Runs work(arg) as a spinning waiter would wait: marked as polling every link of the context
 * that is cheap to poll (shm rings), so their peers send without a doorbell meanwhile, then
 * drains them. For work that takes long enough for an answer to come (a publish copying a large
 * payload while its subscribers release blocks): the answer then wakes no thread. */
void fr_ctx_work_polling(ferry_ctx *ctx, void (*work)(void *), void *arg);
/* A route added to a metrics server beside /metrics, /healthz and /readyz (ferry serve's status
 * page and /v1/fleet). fn runs on the server's thread for a GET of exactly `path`: it sets *body
 * (malloc'd; NULL: out of memory), *len and *type (a static string) and returns the HTTP
 * status. */
typedef unsigned (*fr_http_route_fn)(void *arg, char **body, size_t *len, const char **type);
int fr_metrics_route(ferry_metrics_server *s, const char *path, fr_http_route_fn fn, void *arg);

#endif
