/*
 * The few context calls jobs make beyond ferry.h, without seeing the transport's structs
 * (transport.h): a service loop marks its thread, and is woken out of a long wait.
 */
#ifndef FR_CTXCALLS_H
#define FR_CTXCALLS_H

#include "ferry.h"

#include <stdbool.h>
#include <stdint.h>

/* Ends the channel's current or next wait (fr_ctx_await, ferry_recv) early, once, as a message
 * would: a service loop that waits for long is told to stop, or to look at its timers, without
 * polling. */
void fr_ctx_kick(ferry_ctx *ctx, uint32_t channel);
/* Marks the calling thread as a background one (a service loop such as the embedded
 * directory's): it leads the ctx's epoll only while no other caller has led for a while, and
 * steps down when one wants to, as the progress thread does. */
void fr_ctx_background_thread(void);

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
