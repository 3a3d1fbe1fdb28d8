/*
 * What the parts of the context share, inside src/transport only: ctx.c opens and closes it,
 * leader.c drives it (the progress thread and callers that lead its epoll), chanq.c queues the
 * messages per channel, spin.c lets waiters poll, server.c sends large read responses,
 * accept.c takes new links in, msgcache.c keeps message buffers, inbox.c queues an owned
 * channel's messages for its job's thread. The struct itself and the calls
 * links make are in transport.h.
 */
#ifndef FR_CTX_IMPL_H
#define FR_CTX_IMPL_H

#include "transport/transport.h"

static inline bool fr_ctx_stopping(const ferry_ctx *ctx) {
  return __atomic_load_n(&ctx->stopping, __ATOMIC_ACQUIRE);
}

/* leader.c */
void *fr_ctx_progress_main(void *arg);              /* the progress thread */
void fr_ctx_on_wake(fr_poller *p, uint32_t events); /* the ctx's wake-up eventfd's handler */
/* Makes the thread that leads the epoll return from its wait. */
void fr_ctx_wake_progress(ferry_ctx *ctx);
/* Makes the progress thread return and see that the ctx is stopping. */
void fr_ctx_stop_progress(ferry_ctx *ctx);
/* fr_ctx_wait for a service loop's requests (inbox.c): an idle wait, which leads the epoll only
 * when no caller has lately, steps down when a caller wants it, never polls without sleeping
 * and sleeps without a slice (see leader.c's top). */
bool fr_ctx_wait_idle(ferry_ctx *ctx, int waits_for, bool (*ready)(void *), void *arg,
                      pthread_mutex_t *mutex, pthread_cond_t *cond, uint64_t deadline_ns);

/* spin.c: spins on a channel until it has a message or ctx->spin_us pass (see fr_ctx_await). */
void fr_ctx_spin_channel(ferry_ctx *ctx, fr_channel *c);

/* server.c: the server thread, and the calls for the ctx's metrics it answers (takes msg) */
void *fr_ctx_server_main(void *arg);
void fr_ctx_serve_stats(ferry_ctx *ctx, ferry_msg *msg);
/* How many read responses and calls for the metrics wait for the server thread (tests). */
void fr_ctx_serve_pending(ferry_ctx *ctx, size_t *reads, size_t *stats);

/* accept.c: the listeners' handler, and the descriptor kept in reserve for it */
void fr_ctx_on_accept(fr_poller *p, uint32_t events);
void fr_ctx_spare_take(void);

#endif
