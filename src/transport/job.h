/*
 * A job: one thread of a context that owns one channel and serves it (the store's service, the
 * embedded directory server, mq's thread, the refit sender's and receiver's services), or that
 * owns no channel and serves only what another job's channel table hands it (FR_JOB_NO_CHANNEL:
 * a refit group's sub-receivers, one thread per sender rank behind one channel). The
 * runtime does what each of them used to write by hand: it opens the channel with an inbox,
 * starts one named thread that sleeps until a message, a wake or its next timer, calls the
 * job's callbacks, and at stop ends the thread, closes the channel and frees the queue in the
 * one right order, also when a callback stops its own job.
 *
 * Threads: every callback of fr_job_ops runs on the job's thread, one at a time, never under a
 * lock of the runtime, so it may block, send, call and wait. Only a channel table of the job's
 * own (ops->channel) runs on the transport's threads, under that channel's rules (ctxcalls.h).
 * Ownership: a message handed to on_msg is the callback's to free; arg stays the caller's.
 */
#ifndef FR_JOB_H
#define FR_JOB_H

#include "transport/ctxcalls.h"

typedef struct fr_job fr_job;

typedef struct fr_job_ops {
  /* The channel's next message (taken: the callback frees it with ferry_msg_free). NULL: the
   * job takes its messages itself with fr_job_take in on_timer (under a lock of its own: the
   * directory server's fence must find every message either queued or served). */
  void (*on_msg)(void *arg, ferry_msg *msg);
  /* After every wake-up of the thread (a message, a wake, a link's death, the deadline it
   * returned last) and once as the thread starts: does what is due and returns the next
   * deadline (CLOCK_MONOTONIC ns; UINT64_MAX: none; one already past: look again at once, not
   * sleeping). NULL: no timers. */
  uint64_t (*on_timer)(void *arg);
  /* Optional: a link of the context died since the last call (which one is not said: it may
   * be gone by now). For a job whose waiters depend on a peer being alive. */
  void (*on_link_down)(void *arg);
  /* Optional: the bits of the fr_job_wake calls since the last call, ORed. */
  void (*on_wake)(void *arg, unsigned bits);
  /* Optional: the job was stopped from its own thread (a callback closing its owner): called
   * on that thread once the callback returned, the loop ended and the channel closed, to free
   * what arg holds; the runtime then frees the job and detaches the thread. */
  void (*on_reap)(void *arg);
  /* Optional: the owner's own channel table (its on_msg dispatches on the transport's threads
   * and hands what the thread must serve to fr_job_put). NULL: every message goes to the inbox,
   * and a link's death to on_link_down. */
  const fr_channel_ops *channel;
  /* Sleep on the inbox's own condition, never in the context's wait: for a thread that needs
   * nothing from the epoll (mq: its on_msg hands it what it serves). Else the wait is an idle
   * one (fr_inbox_wait): it may lead the epoll when no caller does. */
  bool quiet;
  /* Messages still queued when the job stops go to on_msg on the stopping thread, after the
   * channel closed (mq: a peer's BYE is answered), instead of being freed unanswered. */
  bool drain_at_stop;
} fr_job_ops;

/* A job that owns no channel: fed only by fr_job_put (and woken by fr_job_wake), it sleeps on
 * its inbox's own condition (as a quiet job does) and never hears of a link's death
 * (on_link_down is not called: whoever feeds it tells it, by a wake). */
#define FR_JOB_NO_CHANNEL UINT32_MAX

/* Owns `channel` (FERRY_EBUSY: it has an owner; FR_JOB_NO_CHANNEL: none) with an inbox, and
 * starts the thread, named `name` (at most 15 bytes: top -H, perf, gdb). ops and name must
 * outlive the job. */
int fr_job_start(ferry_ctx *ctx, uint32_t channel, const fr_job_ops *ops, void *arg,
                 const char *name, fr_job **out);
/* fr_job_start in two steps, for an owner that must hold the channel before it can serve (a
 * refit receiver attaches with it held), or whose callbacks use *out from the first one (which
 * fr_job_start writes only once the thread runs): messages queue until fr_job_run starts the
 * thread. fr_job_open writes *out before the channel is owned, since an owner's own channel
 * table may fr_job_put at once (messages that came before the owner), and NULL on failure.
 * fr_job_stop closes a job that never ran. */
int fr_job_open(ferry_ctx *ctx, uint32_t channel, const fr_job_ops *ops, void *arg,
                const char *name, fr_job **out);
int fr_job_run(fr_job *job);

/* Wakes the thread: `bits` (ORed with those not yet seen) go to on_wake, then on_timer runs.
 * Any thread, any lock: takes only the inbox's lock. 0: only look at the timers again. */
void fr_job_wake(fr_job *job, unsigned bits);
/* For an owner's own channel table (ops->channel), or whoever feeds a job of no channel: queues
 * msg (taken) for on_msg. */
void fr_job_put(fr_job *job, ferry_msg *msg);
/* The next queued message without waiting (NULL: none): for on_msg == NULL, or a callback that
 * serves what queued while it waited. */
ferry_msg *fr_job_take(fr_job *job);
/* Whether a message is queued (one atomic load). */
bool fr_job_queued(const fr_job *job);
/* Whether the caller runs on the job's thread (known by a thread-local the thread sets). */
bool fr_job_on_thread(const fr_job *job);

/* Stops the job: ends its thread (after the callback running now), closes the channel (no
 * message reaches the owner after it), frees or drains (drain_at_stop) what is queued, and
 * frees the job; true then. Called on the job's own thread (from a callback) it cannot wait
 * for itself: it marks the job to reap and returns false at once; the owner must then leave
 * arg alone, which on_reap frees later on that thread. NULL: true. */
bool fr_job_stop(fr_job *job);

#endif
