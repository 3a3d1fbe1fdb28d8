/*
 * A job's queue of messages: what the owner of a channel (fr_ctx_channel_open) hands from its
 * on_msg, which must not block, to its own service thread, which may (it answers calls, reads
 * buckets). The thread waits through the context's one wait as an idle wait (fr_ctx_wait_idle),
 * so an idle service sleeps until a message or a kick comes, and a caller that wants the
 * epoll gets it. Each message is queued once, here; the context keeps no queue of its own for
 * an owned channel.
 */
#include "transport/ctx_impl.h"

#include <stdlib.h>

void fr_inbox_init(fr_inbox *q) {
  *q = (fr_inbox){0};
  pthread_mutex_init(&q->lock, NULL);
  fr_cond_init_monotonic(&q->cond);
}

void fr_inbox_fini(fr_inbox *q) {
  fr_msg_fifo_free(&q->head, &q->tail);
  pthread_mutex_destroy(&q->lock);
  pthread_cond_destroy(&q->cond);
}

void fr_inbox_put(fr_inbox *q, ferry_msg *msg) {
  pthread_mutex_lock(&q->lock);
  fr_msg_fifo_push(&q->head, &q->tail, fr_msg_node_of(msg));
  __atomic_add_fetch(&q->count, 1, __ATOMIC_SEQ_CST);
  pthread_cond_signal(&q->cond);
  pthread_mutex_unlock(&q->lock);
}

static void inbox_on_msg(void *arg, ferry_link *link, ferry_msg *msg) {
  (void)link;
  fr_inbox_put(arg, msg);
}

const fr_channel_ops fr_inbox_ops = {.on_msg = inbox_on_msg};

/* Seq_cst against the leader's publication of what it waits for (leader.c fr_ctx_poke). */
static bool inbox_ready(void *arg) {
  fr_inbox *q = arg;
  return __atomic_load_n(&q->count, __ATOMIC_SEQ_CST) != 0 ||
         __atomic_load_n(&q->kicked, __ATOMIC_SEQ_CST);
}

ferry_msg *fr_inbox_take(fr_inbox *q) {
  if (__atomic_load_n(&q->count, __ATOMIC_SEQ_CST) == 0)
    return NULL;
  pthread_mutex_lock(&q->lock);
  fr_msg_node *n = fr_msg_fifo_pop(&q->head, &q->tail);
  if (n)
    __atomic_sub_fetch(&q->count, 1, __ATOMIC_SEQ_CST);
  pthread_mutex_unlock(&q->lock);
  return n ? &n->msg : NULL;
}

bool fr_inbox_await(ferry_ctx *ctx, uint32_t channel, fr_inbox *q, uint64_t deadline_ns) {
  /* A wait whose deadline has passed still sees everything that has arrived, queued or not: it
   * drains the shm rings that no thread may have driven since (the directory server's fence
   * relies on it: a posted put still in a ring would be missed) */
  if (deadline_ns <= fr_now_ns())
    fr_ctx_poll_links(ctx);
  if (!inbox_ready(q))
    fr_ctx_wait_idle(ctx, (int)channel, inbox_ready, q, &q->lock, &q->cond, deadline_ns);
  if (__atomic_load_n(&q->kicked, __ATOMIC_SEQ_CST)) /* seen; no store when there was none */
    __atomic_store_n(&q->kicked, false, __ATOMIC_SEQ_CST);
  return __atomic_load_n(&q->count, __ATOMIC_SEQ_CST) != 0;
}

ferry_msg *fr_inbox_wait(ferry_ctx *ctx, uint32_t channel, fr_inbox *q, uint64_t deadline_ns) {
  return fr_inbox_await(ctx, channel, q, deadline_ns) ? fr_inbox_take(q) : NULL;
}

void fr_inbox_kick(ferry_ctx *ctx, uint32_t channel, fr_inbox *q) {
  pthread_mutex_lock(&q->lock);
  __atomic_store_n(&q->kicked, true, __ATOMIC_SEQ_CST);
  pthread_cond_broadcast(&q->cond);
  pthread_mutex_unlock(&q->lock);
  fr_ctx_poke(ctx, (int)channel); /* a waiter that leads the epoll */
}
