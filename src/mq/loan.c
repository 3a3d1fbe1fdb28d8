/*
 * Loans: ferry_mq_loan lends the application a pool block to build a message in;
 * ferry_mq_publish_loan sends it with no copy at all. A publish from CUDA memory lends itself a
 * block the same way, so that its one device-to-host copy lands where shm subscribers read it.
 */
#include "mq/publish.h"

#include <stdlib.h>

/* The pool, opened; FERRY_ENOSHM / FERRY_EINVAL when no loan of len bytes can ever be made. */
static int loan_pool(ferry_mq *mq, size_t len) {
  if (!mq->pool && (mq->pool_bytes == 0 || fr_mq_pool_open(mq) != 0))
    return fr_err(FERRY_ENOSHM, "ferry_mq_loan: no shared-memory pool (FERRY_MQ_POOL_BYTES)");
  if (len == 0 || len > mq->pool_bytes)
    return fr_err(FERRY_EINVAL, "ferry_mq_loan: %zu bytes (the pool holds %llu)", len,
                  (unsigned long long)mq->pool_bytes);
  return 0;
}

typedef struct loan_wait {
  uint64_t len, off, token;
} loan_wait;

static bool loan_ready(ferry_mq *mq, void *arg) { /* allocates as soon as there is room */
  loan_wait *w = arg;
  if (!w->token)
    w->token = fr_mq_block_alloc(mq, w->len, 1, true, &w->off);
  return w->token != 0;
}

int ferry_mq_loan(ferry_mq *mq, size_t len, void **buf, int timeout_ms) {
  if (!mq || !buf)
    return fr_err(FERRY_EINVAL, "ferry_mq_loan: NULL argument");
  int ms = fr_timeout(timeout_ms);
  uint64_t deadline = fr_deadline_ns(ms);
  fr_mq_flush(mq); /* before this node waits: what we batched may be what frees the pool */
  pthread_mutex_lock(&mq->lock);
  int rc = loan_pool(mq, len);
  loan_wait w = {len, 0, 0};
  if (rc == 0) {
    fr_mq_drain(mq); /* releases first: reuse the blocks still warm in the cache */
    rc = fr_mq_wait(mq, loan_ready, &w, deadline);
    if (rc != 0)
      rc = fr_err(rc,
                  rc == FERRY_ETIMEDOUT
                      ? "ferry_mq_loan: no %zu bytes free in the pool within %d ms "
                        "(subscribers still hold the messages published from it)"
                      : "ferry_mq_loan: mq closing",
                  len, ms);
  }
  if (rc == 0) {
    mq->blocks[(w.token & 0xffffffffu) - 1].lent = true;
    *buf = mq->pool + w.off;
  }
  pthread_mutex_unlock(&mq->lock);
  return rc;
}

/* The token of the lent block at buf, no longer lent (lock held); 0 when buf is not a loan. */
static uint64_t loan_take(ferry_mq *mq, const void *buf, size_t *cap) {
  const uint8_t *p = buf;
  if (!mq->pool || p < mq->pool || p >= mq->pool + mq->pool_bytes)
    return 0;
  uint64_t off = (uint64_t)(p - mq->pool);
  for (size_t i = 0; i < mq->nblocks; i++) {
    fr_mq_block *b = &mq->blocks[i];
    if (b->refs > 0 && b->lent && b->off == off) {
      b->lent = false;
      *cap = (size_t)b->len;
      return (uint64_t)b->gen << 32 | (uint64_t)(i + 1);
    }
  }
  return 0;
}

void ferry_mq_loan_free(ferry_mq *mq, void *buf) {
  size_t cap = 0;
  if (!mq || !buf)
    return;
  pthread_mutex_lock(&mq->lock);
  uint64_t token = loan_take(mq, buf, &cap);
  if (token)
    fr_mq_pool_release(mq, token);
  pthread_mutex_unlock(&mq->lock);
}

/* A host home for a device payload (lock held): a pool block with one holder (this publish),
 * when the payload would not go inline and the pool has room now (taking a block never waits,
 * as a host publish's does not), else NULL. */
static void *device_block(ferry_mq *mq, size_t len, uint64_t *token) {
  uint64_t off = 0;
  *token = 0;
  if (len <= mq->inline_bytes || len > mq->pool_bytes)
    return NULL;
  fr_mq_drain(mq); /* the releases that came in: reuse warm blocks */
  *token = fr_mq_block_alloc(mq, len, 1, true, &off);
  return *token ? mq->pool + off : NULL;
}

int fr_mq_publish_device(ferry_mq *mq, const char *topic, const ferry_tensor_desc *desc,
                         const void *data, size_t len, int device, int timeout_ms) {
  uint64_t token = 0;
  pthread_mutex_lock(&mq->lock);
  void *buf = device_block(mq, len, &token);
  pthread_mutex_unlock(&mq->lock);
  fr_err_clear(); /* no pool is not a failure: the payload is staged below */
  if (!buf && !(buf = malloc(len)))
    return fr_err(FERRY_ENOMEM, "publish '%s': %zu bytes to stage from CUDA device %d", topic, len,
                  device);
  int rc = fr_cuda_copy_on(device, buf, data, len);
  if (rc != 0)
    rc = fr_err_wrap(rc, "publish '%s': from CUDA device %d", topic, device);
  else
    rc = fr_mq_publish_msg(mq, topic, desc, buf, len, timeout_ms, token);
  if (!token) {
    free(buf);
    return rc;
  }
  pthread_mutex_lock(&mq->lock);
  fr_mq_pool_release(mq, token); /* this publish's hold; subscribers keep theirs */
  pthread_mutex_unlock(&mq->lock);
  return rc;
}

/* What publish_loan checks before it sends (the loan is taken already). */
static int loan_check(const char *topic, const ferry_tensor_desc *desc, size_t len, size_t cap) {
  uint64_t n = len;
  int rc = fr_mq_topic_check(topic);
  if (rc == 0 && desc && (rc = ferry_tensor_nbytes(desc, &n)) == 0 && n != len)
    rc = fr_err(FERRY_EINVAL, "ferry_mq_publish_loan: the tensor holds %llu bytes, not %zu",
                (unsigned long long)n, len);
  if (rc == 0 && len > cap)
    rc = fr_err(FERRY_EINVAL, "ferry_mq_publish_loan: %zu bytes in a loan of %zu", len, cap);
  return rc;
}

int ferry_mq_publish_loan(ferry_mq *mq, const char *topic, const ferry_tensor_desc *desc, void *buf,
                          size_t len, int timeout_ms) {
  size_t cap = 0;
  if (!mq || !buf)
    return fr_err(FERRY_EINVAL, "ferry_mq_publish_loan: NULL argument");
  pthread_mutex_lock(&mq->lock);
  uint64_t token = loan_take(mq, buf, &cap);
  pthread_mutex_unlock(&mq->lock);
  if (!token)
    return fr_err(FERRY_EINVAL,
                  "ferry_mq_publish_loan: %p is not a loan of this mq (or was "
                  "published or freed already)",
                  buf);
  ferry_tensor_desc d;
  int rc = loan_check(topic, desc, len, cap);
  if (rc == 0 && desc) {
    d = *desc;
    for (uint32_t i = d.ndim; i < FERRY_MAX_DIMS; i++)
      d.shape[i] = 0;
  }
  if (rc == 0)
    rc = fr_mq_publish_msg(mq, topic, desc ? &d : NULL, buf, len, timeout_ms, token);
  pthread_mutex_lock(&mq->lock);
  fr_mq_pool_release(mq, token); /* the loan's own hold; subscribers keep theirs */
  pthread_mutex_unlock(&mq->lock);
  return rc;
}
