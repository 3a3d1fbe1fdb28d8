/*
 * Publishing: credit, the frames, and the shared-memory pool for large payloads.
 *
 * Credit: each subscriber grants each publisher `window` bytes (FERRY_MQ_QUEUE_BYTES on the
 * subscriber). A message is charged its length plus a little (capped at half the window, so any
 * one message fits once the subscriber has freed what it held); the subscriber returns credit as
 * the application frees messages. A publish first waits until every subscriber of the topic has
 * credit for it (taking credit off the channel meanwhile), so it either reaches all of them or,
 * at the deadline, none, naming the subscriber whose queue stayed full. Nothing is dropped.
 *
 * The pool: payloads over FERRY_MQ_INLINE_BYTES to subscribers on shm links are copied once into
 * one ferry_alloc'd region (mapped once by each subscriber) and the frame carries its place; the
 * subscriber hands the application a pointer into the pool and releases the block (with its
 * credit) when the message is freed. A block is reused once every subscriber released it or was
 * dropped. When the pool has no room the payload goes inline instead (never a wait).
 *
 * Loans: ferry_mq_loan lends the application a pool block to build a message in (waiting for
 * room); ferry_mq_publish_loan then sends it with no copy at all (the block's holders are the
 * loan, dropped after the sends, and each shm subscriber). A payload in CUDA memory is copied
 * device to host once, into a block lent the same way (loan.c), and sent from there.
 *
 * Batches: a publish that follows the previous one closely (a stream) appends small inline
 * messages to a per-subscriber batch instead of writing each one to the link; the batch goes out
 * when it is full, before anything else is sent to that subscriber, before this node waits for
 * anything (credit, a message, subscribers), and otherwise within FERRY_MQ_FLUSH_US, sent by the
 * mq's thread. So a stream of small messages costs one link write per 32 KiB, while an
 * isolated publish (or a ping-pong) is written at once. A publish in a stream that goes to the
 * subscribers the previous one went to, each with a pending batch and credit, takes no mq->lock
 * at all (fast_reserve): the batches hold those subscribers, and publish_lock the batches.
 */
#include "mq/mq.h"
#include "mq/publish.h"

#include "core/channels.h"
#include "core/stats.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Takes in what already arrived in the shm rings, without waiting (lock held, as it returns):
 * what the epoll brings is dispatched as it comes, but nobody may have driven a ring since its
 * peer wrote (pool releases, which a publisher wants before it picks a block). */
void fr_mq_drain(ferry_mq *mq) {
  pthread_mutex_unlock(&mq->lock); /* on_msg takes it, on this thread or the one draining */
  fr_ctx_poll_links(mq->ctx);
  pthread_mutex_lock(&mq->lock);
}

static void build(ferry_mq *mq, fr_mq_frames *fr, const char *topic, const ferry_tensor_desc *desc,
                  uint64_t len, uint64_t seq, uint64_t off) {
  fr_mq_frame f; /* the fields encode reads, one by one: zeroing the whole frame is a rep stos */
  f.type = FR_MQ_DATA;
  f.flags = 0;
  f.seq = seq;
  f.len = len;
  f.value = 0; /* the charge, set per subscriber */
  f.topic = topic;
  f.topic_len = strlen(topic);
  f.nrelease = 0;
  if (desc) {
    f.flags = FR_MQ_F_TENSOR;
    f.desc = *desc;
  }
  fr->data_len = fr_mq_encode(&f, fr->data);
  if (fr->token) {
    f.type = FR_MQ_SHM;
    f.ref = mq->pool_ref;
    f.offset = off;
    f.token = fr->token;
    fr->shm_len = fr_mq_encode(&f, fr->shm);
  }
}

/* Sends or batches the message to every target; `now` is the publish's time, stream whether it
 * batches. */
static void send_all(ferry_mq *mq, fr_mq_frames *fr, fr_mq_target *v, size_t n, const void *data,
                     size_t len, uint64_t deadline, uint64_t now, bool stream) {
  for (size_t i = 0; i < n; i++) {
    bool shm = v[i].shm && fr->token;
    uint8_t *head = shm ? fr->shm : fr->data;
    fr_mq_set_value(head, v[i].charge);
    size_t hl = shm ? fr->shm_len : fr->data_len;
    if (!shm && stream && hl + len <= FR_MQ_BATCH_BYTES / 4 &&
        fr_mq_batch_add(mq, v[i].p, head, hl, data, len, now))
      continue;
    fr_mq_flush_peer(mq, v[i].p); /* what was batched goes first */
    struct iovec iov[2] = {{head, hl}, {(void *)data, len}};
    int ms = fr_ms_left(deadline);
    v[i].rc = ferry_send(v[i].p->link, FR_CHANNEL_MQ, iov, shm || len == 0 ? 1 : 2, ms ? ms : 1);
    if (v[i].rc != 0)
      fr_debug("mq '%s': send to '%s': %s", mq->name, v[i].p->name, ferry_last_error());
  }
}

/* After the sends (lock held): pool holds, dead subscribers; the error for the caller. */
static int settle(ferry_mq *mq, fr_mq_frames *fr, fr_mq_target *v, size_t n, const char *topic) {
  char dead[512];
  dead[0] = '\0';
  size_t used = 0, ndead = 0;
  for (size_t i = 0; i < n; i++) {
    fr_mq_peer *p = v[i].p;
    bool shm = v[i].shm && fr->token;
    if (v[i].rc == 0 && p->batch_rc) { /* an earlier batch to it failed */
      v[i].rc = p->batch_rc;
      p->batch_rc = 0;
    }
    if (shm && !v[i].held) /* not sent, or not recorded: its reference goes now */
      fr_mq_pool_release(mq, fr->token);
    /* else a failed send drops the peer below (or a BYE did), which releases what it held */
    if (v[i].rc != 0 && !p->dead) {
      used +=
          (size_t)snprintf(dead + used, sizeof dead - used, "%s'%s'", ndead ? ", " : "", p->name);
      used = used < sizeof dead ? used : sizeof dead - 1;
      ndead++;
      fr_mq_peer_drop(mq, p, ferry_strerror(v[i].rc));
    }
    if (v[i].ref)
      fr_mq_peer_unref(mq, p);
  }
  if (ndead)
    return fr_err(FERRY_EPEER,
                  "publish '%s': subscriber%s %s gone and dropped; every other subscriber got "
                  "the message",
                  topic, ndead > 1 ? "s" : "", dead);
  return 0;
}

/* Whether settle has nothing to do (no pool block, no error to report, no reference to drop),
 * so the publish skips its lock round: the common case of a stream. publish_lock held. */
static bool settle_quiet(const fr_mq_frames *fr, const fr_mq_target *v, size_t n) {
  if (fr->token)
    return false;
  for (size_t i = 0; i < n; i++)
    if (v[i].rc || v[i].ref || v[i].p->batch_rc)
      return false;
  return true;
}

/* The first half of a publish, under mq->lock: the topic, credit (waiting for it), the
 * sequence number and the pool block. */
static int prepare(ferry_mq *mq, const char *topic, uint64_t len, int ms, uint64_t loan,
                   fr_mq_pub *u) {
  int rc = 0;
  pthread_mutex_lock(&mq->lock);
  fr_mq_topic *t = fr_mq_topic_get(mq, topic);
  if (t && !t->advertised) { /* the first publish on the topic: a directory round trip */
    pthread_mutex_unlock(&mq->lock);
    rc = fr_mq_advertise(mq, topic, ms);
    pthread_mutex_lock(&mq->lock);
    u->waited = true;
  }
  if (rc == 0 && !t)
    rc = fr_err(FERRY_ENOMEM, "publish '%s'", topic);
  fr_mq_pub_wait w = {t, len};
  bool ready = rc == 0 && mq->ndirty && fr_mq_credit_ready(mq, &w);
  if (rc == 0 && mq->ndirty && !ready) {
    pthread_mutex_unlock(&mq->lock); /* what the subscribers wait for must not sit here */
    fr_mq_flush_locked(mq);
    pthread_mutex_lock(&mq->lock);
    u->waited = true;
  }
  bool credit_waited = false;
  u->t = t;
  if (rc == 0)
    rc = fr_mq_reserve(mq, t, len, u->deadline, ms, ready, u->local, &u->v, &u->n, &credit_waited);
  u->waited |= credit_waited;
  if (rc == 0) {
    u->seq = ++mq->seq;
    int nshm = 0;
    for (size_t i = 0; i < u->n; i++)
      nshm += u->v[i].shm;
    u->fr.token = fr_mq_take_block(mq, len, nshm, loan, u->deadline, &u->off, &u->fresh);
    for (size_t i = 0; i < u->n; i++) { /* before the sends: see fr_mq_target.held */
      fr_mq_target *v = &u->v[i];
      v->held = v->shm && u->fr.token && !v->p->dead && fr_mq_peer_hold(v->p, u->fr.token) == 0;
    }
    fr_mq_fast_remember(mq, t, u, loan);
  }
  pthread_mutex_unlock(&mq->lock);
  return rc;
}

/* The second half: the sends (or batches), then what they leave to settle. */
static int deliver(ferry_mq *mq, const char *topic, const ferry_tensor_desc *desc, const void *data,
                   size_t len, uint64_t start, uint64_t loan, fr_mq_pub *u) {
  if (u->fr.token && !loan)
    fr_mq_pool_copy(mq, u->off, data, len, u->fresh);
  build(mq, &u->fr, topic, desc, len, u->seq, u->off);
  uint64_t now = u->fr.token || u->waited ? fr_now_ns() : start; /* after a wait or a copy */
  uint64_t last = __atomic_load_n(&mq->last_publish_ns, __ATOMIC_RELAXED); /* stream_end: 0 */
  bool stream = now < last + mq->stream_gap_ns; /* or before it: TSC vs clock */
  __atomic_store_n(&mq->last_publish_ns, now, __ATOMIC_RELAXED);
  send_all(mq, &u->fr, u->v, u->n, data, len, u->deadline, now, stream);
  bool wake = fr_mq_batch_due_moved(mq, now);
  if (!wake && settle_quiet(&u->fr, u->v, u->n))
    return 0;
  pthread_mutex_lock(&mq->lock);
  int rc = settle(mq, &u->fr, u->v, u->n, topic);
  if (wake) {
    __atomic_store_n(&mq->batch_since_ns, fr_mq_oldest_batch(mq, now), __ATOMIC_RELEASE);
    fr_mq_kick(mq); /* the thread sends it if nobody does */
  }
  pthread_mutex_unlock(&mq->lock);
  return rc;
}

/* Publishes data (in the pool block `loan` when not 0: then it is not copied). */
int fr_mq_publish_msg(ferry_mq *mq, const char *topic, const ferry_tensor_desc *desc,
                      const void *data, size_t len, int timeout_ms, uint64_t loan) {
  int ms = fr_timeout(timeout_ms);
  pthread_mutex_lock(&mq->publish_lock);
  uint64_t start = fr_mq_publish_now(mq); /* the one time read of a publish that does not wait */
  fr_mq_pub u;
  u.v = NULL;
  u.n = 0;
  u.fr.token = 0;
  u.off = u.seq = 0;
  u.fresh = u.waited = false;
  u.t = NULL;
  u.deadline = start + (uint64_t)ms * 1000000ull;
  int rc = 0;
  if (loan || !fr_mq_fast_reserve(mq, topic, len, &u))
    rc = prepare(mq, topic, len, ms, loan, &u);
  if (rc == 0)
    rc = deliver(mq, topic, desc, data, len, start, loan, &u);
  if (rc == 0 && u.t) { /* publish_lock: one writer; a scrape reads them relaxed */
    __atomic_store_n(&u.t->published, u.t->published + 1, __ATOMIC_RELAXED);
    __atomic_store_n(&u.t->published_bytes, u.t->published_bytes + len, __ATOMIC_RELAXED);
  } else if (rc != 0) {
    fr_count(&mq->publish_errors, 1);
  }
  pthread_mutex_unlock(&mq->publish_lock);
  if (u.v != u.local)
    free(u.v);
  return rc;
}

/* A publish of the caller's data: classified once (one atomic load without a driver; one driver
 * call with one), and staged through host memory when it lies on a device, whose allocation must
 * hold all len bytes. */
static int publish_from(ferry_mq *mq, const char *topic, const ferry_tensor_desc *desc,
                        const void *data, size_t len, int timeout_ms) {
  fr_mem_where w = len > 0 ? fr_cuda_where(data) : (fr_mem_where){.kind = FERRY_MEM_HOST};
  if (w.kind != FERRY_MEM_CUDA)
    return fr_mq_publish_msg(mq, topic, desc, data, len, timeout_ms, 0);
  size_t room = fr_cuda_room(&w, data);
  if (len > room)
    return fr_err(FERRY_ERANGE,
                  "publish '%s': %zu bytes run past the end of the CUDA allocation at %p (device "
                  "%d: %zu bytes from there)",
                  topic, len, data, w.device, room);
  return fr_mq_publish_device(mq, topic, desc, data, len, w.device, timeout_ms);
}

int ferry_mq_publish(ferry_mq *mq, const char *topic, const void *data, size_t len,
                     int timeout_ms) {
  if (!mq || (!data && len))
    return fr_err(FERRY_EINVAL, "ferry_mq_publish: NULL argument");
  int rc = fr_mq_topic_check(topic);
  return rc ? rc : publish_from(mq, topic, NULL, data, len, timeout_ms);
}

int ferry_mq_publish_tensor(ferry_mq *mq, const char *topic, const ferry_tensor_desc *desc,
                            const void *data, int timeout_ms) {
  uint64_t len = 0;
  if (!mq || !desc)
    return fr_err(FERRY_EINVAL, "ferry_mq_publish_tensor: NULL argument");
  int rc = fr_mq_topic_check(topic);
  if (rc == 0)
    rc = ferry_tensor_nbytes(desc, &len);
  if (rc == 0 && !data && len)
    rc = fr_err(FERRY_EINVAL, "ferry_mq_publish_tensor: NULL data");
  if (rc == 0 && len > SIZE_MAX)
    rc = fr_err(FERRY_EOVERFLOW, "ferry_mq_publish_tensor: %llu bytes", (unsigned long long)len);
  if (rc != 0)
    return rc;
  ferry_tensor_desc d = *desc;
  for (uint32_t i = d.ndim; i < FERRY_MAX_DIMS; i++)
    d.shape[i] = 0;
  return publish_from(mq, topic, &d, data, (size_t)len, timeout_ms);
}
