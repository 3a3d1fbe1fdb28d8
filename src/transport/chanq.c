/*
 * Where a context's received messages go, by channel. A channel with an owner (a job that opened
 * it with fr_ctx_channel_open) has its messages handed to the owner's on_msg by whichever thread
 * drives the links (fr_ctx_deliver), under the channel's lock, so that closing the channel is a
 * clean cut: after fr_ctx_channel_close returns no callback runs. A channel without an owner
 * (an application's, 0..FR_CHANNEL_APP_MAX) keeps one FIFO, emptied by ferry_recv: a waiter
 * spins briefly when the channel's messages came over shm lately, then waits through the
 * context's leadership (leader.c), so the message it waits for wakes it directly. A receive
 * that does not wait drains the shm rings itself, so it sees every message that has arrived.
 */
#include "transport/ctx_impl.h"
#include "core/channels.h"

#include <stdlib.h>

void fr_ctx_deliver(ferry_ctx *ctx, ferry_msg *msg) {
  fr_link_ref(msg->link);
  if (msg->channel == FR_CHANNEL_STATS) { /* the ctx's own service, not an application's */
    fr_ctx_serve_stats(ctx, msg);
    return;
  }
  fr_msg_node *n = fr_msg_node_of(msg);
  int channel = (int)msg->channel; /* once queued, msg is its taker's to free */
  fr_channel *c = &ctx->channels[channel];
  pthread_mutex_lock(&c->lock);
  if (c->ops) {
    c->ops->on_msg(c->arg, msg->link, msg);
    pthread_mutex_unlock(&c->lock);
    fr_ctx_poke(ctx, channel); /* its owner may lead the epoll waiting for it */
    return;
  }
  fr_msg_fifo_push(&c->head, &c->tail, n);
  __atomic_add_fetch(&c->count, 1, __ATOMIC_RELEASE);
  __atomic_store_n(&c->last_costly, !msg->link->ops->poll_is_cheap, __ATOMIC_RELAXED);
  pthread_cond_signal(&c->cond);
  pthread_mutex_unlock(&c->lock);
  fr_ctx_poke(ctx, channel);
}

void fr_ctx_link_down(ferry_ctx *ctx, ferry_link *l) {
  for (int i = 0; i < FERRY_MAX_CHANNELS; i++) {
    fr_channel *c = &ctx->channels[i];
    if (!__atomic_load_n(&c->ops, __ATOMIC_ACQUIRE))
      continue;
    pthread_mutex_lock(&c->lock);
    if (c->ops && c->ops->on_link_down)
      c->ops->on_link_down(c->arg, l);
    pthread_mutex_unlock(&c->lock);
  }
}

typedef struct channel_wait {
  ferry_ctx *ctx;
  fr_channel *c;
} channel_wait;

static bool channel_ready(void *arg) {
  channel_wait *w = arg;
  return __atomic_load_n(&w->c->count, __ATOMIC_ACQUIRE) != 0 || fr_ctx_stopping(w->ctx) ||
         __atomic_load_n(&w->c->kicked, __ATOMIC_ACQUIRE);
}

bool fr_ctx_await(ferry_ctx *ctx, uint32_t channel, int timeout_ms) {
  fr_channel *c = &ctx->channels[channel];
  /* A wait of 0 leads nothing and spins not, yet must see what has arrived: messages may sit in
   * shm rings that no thread has driven since (the leader is asleep, or busy elsewhere). Drain
   * those links here, as a spinner would; links the epoll drives (tcp) are left to the leader. */
  if (timeout_ms == 0 && __atomic_load_n(&c->count, __ATOMIC_ACQUIRE) == 0)
    fr_ctx_poll_links(ctx);
  if (timeout_ms > 0 && !__atomic_load_n(&c->last_costly, __ATOMIC_RELAXED))
    fr_ctx_spin_channel(ctx, c); /* its messages came over shm lately */
  channel_wait w = {ctx, c};
  fr_ctx_wait(ctx, (int)channel, channel_ready, &w, &c->lock, &c->cond, fr_deadline_ns(timeout_ms));
  if (__atomic_load_n(&c->kicked, __ATOMIC_ACQUIRE)) /* seen; no store when there was none */
    __atomic_store_n(&c->kicked, false, __ATOMIC_RELEASE);
  return __atomic_load_n(&c->count, __ATOMIC_ACQUIRE) != 0;
}

void fr_ctx_kick(ferry_ctx *ctx, uint32_t channel) {
  fr_channel *c = &ctx->channels[channel];
  pthread_mutex_lock(&c->lock);
  __atomic_store_n(&c->kicked, true, __ATOMIC_SEQ_CST);
  pthread_cond_broadcast(&c->cond);
  pthread_mutex_unlock(&c->lock);
  fr_ctx_poke(ctx, (int)channel); /* a waiter that leads the epoll */
}

ferry_msg *fr_ctx_take(ferry_ctx *ctx, uint32_t channel) {
  fr_channel *c = &ctx->channels[channel];
  pthread_mutex_lock(&c->lock);
  fr_msg_node *n = fr_msg_fifo_pop(&c->head, &c->tail);
  if (n)
    __atomic_sub_fetch(&c->count, 1, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&c->lock);
  return n ? &n->msg : NULL;
}

int fr_ctx_channel_open(ferry_ctx *ctx, uint32_t channel, const fr_channel_ops *ops, void *arg) {
  if (!ctx || !ops || !ops->on_msg || channel >= FERRY_MAX_CHANNELS)
    return fr_err(FERRY_EINVAL, "channel open: bad arguments (channel %u)", channel);
  fr_channel *c = &ctx->channels[channel];
  pthread_mutex_lock(&c->lock);
  if (c->ops) {
    pthread_mutex_unlock(&c->lock);
    return fr_err(FERRY_EBUSY, "channel %u of context '%s' has an owner already", channel,
                  ctx->name);
  }
  __atomic_store_n(&c->ops, ops, __ATOMIC_RELEASE);
  c->arg = arg;
  fr_msg_node *head = c->head, *tail = c->tail, *n; /* what came before the owner: its own */
  c->head = c->tail = NULL;
  __atomic_store_n(&c->count, 0, __ATOMIC_RELEASE);
  while ((n = fr_msg_fifo_pop(&head, &tail))) /* in order */
    ops->on_msg(arg, n->msg.link, &n->msg);
  pthread_mutex_unlock(&c->lock);
  return 0;
}

void fr_ctx_channel_close(ferry_ctx *ctx, uint32_t channel) {
  if (!ctx || channel >= FERRY_MAX_CHANNELS)
    return;
  fr_channel *c = &ctx->channels[channel];
  pthread_mutex_lock(&c->lock);
  __atomic_store_n(&c->ops, NULL, __ATOMIC_RELEASE);
  c->arg = NULL;
  pthread_mutex_unlock(&c->lock);
}

int ferry_recv(ferry_ctx *ctx, uint32_t channel, ferry_msg **out, int timeout_ms) {
  if (!ctx || !out || channel >= FERRY_MAX_CHANNELS)
    return fr_err(FERRY_EINVAL, "recv: bad arguments (channel %u)", channel);
  if (__atomic_load_n(&ctx->channels[channel].ops, __ATOMIC_ACQUIRE))
    return fr_err(FERRY_EBUSY, "recv: channel %u belongs to one of ferry's jobs", channel);
  int ms = fr_ctx_timeout(ctx, timeout_ms);
  fr_ctx_await(ctx, channel, ms);
  ferry_msg *m = fr_ctx_take(ctx, channel);
  if (!m)
    return fr_ctx_stopping(ctx)
               ? fr_err(FERRY_ECLOSED, "recv: context closing")
               : fr_err(FERRY_ETIMEDOUT, "recv on channel %u: nothing within %d ms", channel, ms);
  *out = m;
  return 0;
}
