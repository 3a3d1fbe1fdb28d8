/*
 * Batches: a publish in a stream appends small inline messages to a per-subscriber batch; a
 * batch goes out when full, before anything else to that subscriber, before this node waits,
 * or within FERRY_MQ_FLUSH_US (the mq's thread). What is due when is told here.
 */
#include "mq/publish.h"

#include "core/channels.h"

#include <stdlib.h>
#include <string.h>

void fr_mq_flush_peer(ferry_mq *mq, fr_mq_peer *p) {
  if (!p->batch_len)
    return;
  fr_mq_frame f = {.type = FR_MQ_BATCH, .len = p->batch_len};
  uint8_t head[FR_MQ_HEAD_MAX];
  struct iovec iov[2] = {{head, fr_mq_encode(&f, head)}, {p->batch, p->batch_len}};
  int rc = ferry_send(p->link, FR_CHANNEL_MQ, iov, 2, fr_timeout(-1));
  if (rc != 0) /* the next publish to it reports it; a flush by the thread or close has no caller */
    fr_warn_limited("mq '%s': a batch of %zu bytes to '%s' was not sent: %s", mq->name,
                    p->batch_len, p->name, ferry_last_error());
  if (rc != 0 && !p->batch_rc)
    p->batch_rc = rc;
  p->batch_len = 0;
}

void fr_mq_flush_locked(ferry_mq *mq) {
  for (size_t i = 0; i < mq->ndirty; i++) {
    fr_mq_flush_peer(mq, mq->dirty[i]);
    mq->dirty[i]->dirty = false;
  }
  if (mq->ndirty) {
    pthread_mutex_lock(&mq->lock);
    for (size_t i = 0; i < mq->ndirty; i++)
      fr_mq_peer_unref(mq, mq->dirty[i]);
    pthread_mutex_unlock(&mq->lock);
  }
  mq->ndirty = 0;
  __atomic_store_n(&mq->batch_since_ns, 0, __ATOMIC_RELEASE);
}

/* Flushes the pending batches unless a publish is running (it flushes before it waits, the
 * mq's thread after); `end_stream` also makes the next publish an isolated one. */
static void flush_unless_publishing(ferry_mq *mq, bool end_stream) {
  bool stream = end_stream && __atomic_load_n(&mq->last_publish_ns, __ATOMIC_RELAXED);
  if (!stream && !__atomic_load_n(&mq->batch_since_ns, __ATOMIC_ACQUIRE))
    return; /* nothing to do: a subscriber that never publishes takes no lock per receive */
  if (pthread_mutex_trylock(&mq->publish_lock) != 0)
    return;
  if (end_stream)
    __atomic_store_n(&mq->last_publish_ns, 0, __ATOMIC_RELAXED);
  if (__atomic_load_n(&mq->batch_since_ns, __ATOMIC_ACQUIRE))
    fr_mq_flush_locked(mq);
  pthread_mutex_unlock(&mq->publish_lock);
}

void fr_mq_flush(ferry_mq *mq) { flush_unless_publishing(mq, false); }

/* A receive ends a stream: the next publish is an answer (a ping-pong, a relay), written at
 * once. Batching it would only cost a batch of one, flushed by the next receive, and a wake-up
 * of the mq's thread per message (which starts every batch's flush clock). */
void fr_mq_stream_end(ferry_mq *mq) { flush_unless_publishing(mq, true); }

/* Appends a frame, published at `now`, to p's batch (publish_lock held); false when it does
 * not fit at all. */
bool fr_mq_batch_add(ferry_mq *mq, fr_mq_peer *p, const uint8_t *head, size_t hl, const void *data,
                     size_t len, uint64_t now) {
  size_t at = (p->batch_len + FR_MQ_ALIGN - 1) / FR_MQ_ALIGN * FR_MQ_ALIGN;
  if (at + hl + len > FR_MQ_BATCH_BYTES - FR_MQ_ALIGN) {
    fr_mq_flush_peer(mq, p);
    at = 0;
  }
  if (at == 0)
    p->batch_ns = now; /* its oldest message: the mq's thread sends it flush_ns after */
  if (!p->batch && !(p->batch = malloc(FR_MQ_BATCH_BYTES)))
    return false;
  if (!p->dirty && FR_GROW(mq->dirty, mq->capdirty, mq->ndirty + 1, 8) != 0)
    return false;
  if (!p->dirty) {
    pthread_mutex_lock(&mq->lock);
    p->refs++;
    pthread_mutex_unlock(&mq->lock);
    mq->dirty[mq->ndirty++] = p;
    p->dirty = true;
  }
  memset(p->batch + p->batch_len, 0, at - p->batch_len);
  memcpy(p->batch + at, head, hl);
  if (len)
    memcpy(p->batch + at + hl, data, len);
  p->batch_len = at + hl + len;
  return true;
}

/* When the oldest message of the pending batches was published (publish_lock held; 0: none).
 * A peer listed dirty whose batch went out already counts as pending from `now`, so the
 * mq's thread's flush drops its reference soon. */
uint64_t fr_mq_oldest_batch(const ferry_mq *mq, uint64_t now) {
  uint64_t oldest = 0;
  for (size_t i = 0; i < mq->ndirty; i++) {
    const fr_mq_peer *p = mq->dirty[i];
    uint64_t t = p->batch_len ? p->batch_ns : now;
    oldest = oldest && oldest < t ? oldest : t;
  }
  return oldest;
}

/* After the sends: tells the mq's thread when the pending batches are due. A batch sent
 * because it was full moves the time on, so a stream's batches go out full and the mq
 * thread sends none. True when the mq's thread must be woken (lock held by the caller
 * then). */
bool fr_mq_batch_due_moved(ferry_mq *mq, uint64_t now) {
  uint64_t oldest = fr_mq_oldest_batch(mq, now);
  uint64_t since = __atomic_load_n(&mq->batch_since_ns, __ATOMIC_ACQUIRE);
  if (!oldest || oldest == since)
    return false;
  if (!since)
    return true; /* the mq's thread may sleep for long: store and signal under the lock */
  /* It only moves later (but for the publish clock's error, well under flush_ns): the
   * mq's thread, sleeping until the earlier time, wakes early at worst. */
  __atomic_store_n(&mq->batch_since_ns, oldest, __ATOMIC_RELEASE);
  return false;
}
