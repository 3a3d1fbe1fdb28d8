/*
 * mq's pool: one ferry_alloc'd region that large payloads to shm subscribers are copied into
 * once, its space sub-allocated by core/pool.c. The block table tracks each block in flight (its
 * holders, a generation for its token); the warm working set decides whether a publish reuses a
 * block or grows the pool.
 */
#include "mq/publish.h"

#include <stdlib.h>
#include <string.h>

#define POOL_ALIGN 4096u

int fr_mq_pool_open(ferry_mq *mq) {
  void *mem = NULL;
  if (mq->pool_bytes < POOL_ALIGN)
    return FERRY_ENOSHM;
  mq->pool_bytes = mq->pool_bytes / POOL_ALIGN * POOL_ALIGN;
  int rc = ferry_alloc(mq->ctx, mq->pool_bytes, &mem);
  if (rc == 0)
    rc = ferry_region_find(mq->ctx, mem, mq->pool_bytes, &mq->pool_ref, NULL);
  if (rc == 0)
    rc = fr_pool_init(&mq->space, mq->pool_bytes, POOL_ALIGN);
  if (rc != 0) {
    fr_warn("mq '%s': no pool (%s); large payloads go inline", mq->name, ferry_last_error());
    if (mem)
      ferry_free(mq->ctx, mem);
    mq->pool_bytes = 0;
    return rc;
  }
  mq->pool = mem;
  return 0;
}

/* A block of len bytes with `refs` holders: its token (slot + 1 and a generation), or 0. Below
 * the high-water mark only, unless `grow`. */
uint64_t fr_mq_block_alloc(ferry_mq *mq, uint64_t len, int refs, bool grow, uint64_t *off) {
  if (!mq->pool && (mq->pool_bytes == 0 || fr_mq_pool_open(mq) != 0))
    return 0;
  uint64_t want = (len + POOL_ALIGN - 1) / POOL_ALIGN * POOL_ALIGN;
  size_t slot = 0;
  while (slot < mq->nblocks && mq->blocks[slot].refs > 0)
    slot++;
  if (slot == mq->nblocks && FR_GROW(mq->blocks, mq->capblocks, slot + 1, 64) != 0)
    return 0;
  if (fr_pool_alloc(&mq->space, want, grow ? mq->pool_bytes : mq->pool_hwm, off) != 0)
    return 0;
  if (*off + want > mq->pool_hwm)
    mq->pool_hwm = *off + want;
  if (slot == mq->nblocks)
    mq->blocks[mq->nblocks++] = (fr_mq_block){0};
  fr_mq_block *b = &mq->blocks[slot];
  b->off = *off;
  b->len = want;
  b->refs = refs;
  b->lent = false;
  b->gen++;
  return (uint64_t)b->gen << 32 | (uint64_t)(slot + 1);
}

void fr_mq_pool_release(ferry_mq *mq, uint64_t token) {
  size_t slot = (size_t)(token & 0xffffffffu);
  if (slot == 0 || slot > mq->nblocks)
    return;
  fr_mq_block *b = &mq->blocks[slot - 1];
  if (b->refs <= 0 || b->gen != (uint32_t)(token >> 32))
    return;
  if (--b->refs == 0) {
    fr_pool_free(&mq->space, b->off, b->len);
    fr_mq_changed(mq); /* a loan or a large publish may wait for room */
  }
}

void fr_mq_pool_fini(ferry_mq *mq) {
  if (mq->pool)
    ferry_free(mq->ctx, mq->pool);
  mq->pool = NULL;
  free(mq->blocks);
  fr_pool_fini(&mq->space);
  free(mq->dirty);
}

int fr_mq_peer_hold(fr_mq_peer *p, uint64_t token) {
  if (FR_GROW(p->tokens, p->captokens, p->ntokens + 1, 16) != 0)
    return -1;
  p->tokens[p->ntokens++] = token;
  return 0;
}

/* Memory not written lately can cost far more to write than a copy into a block reused while
 * it is warm (page faults; on some VMs, the host backing the page: 5-7 ms per MiB measured on
 * the project's VM against 0.08 for a warm block). So the pool keeps a small warm working set:
 * - a stream of messages up to a sixteenth of the pool gets two blocks of its size at once
 *   (one the subscriber reads, one the publisher copies the next message into), so a copy
 *   does not wait for the previous message's release; larger ones reuse one block, where the
 *   wait is small beside the copy and a second block would cost more fresh memory;
 * - beyond that, a copy goes into a block below the pool's high-water mark, and when none is
 *   free the publisher waits for a subscriber to release one for as long as writing fresh
 *   memory of that size would take (FERRY_MQ_WARM_WAIT_US, 2 ms, plus the cost per byte
 *   measured on this pool's fresh copies, 1 ns until measured) before it grows the pool. */
#define WARM_BLOCKS 2
#define FRESH_PS_DEFAULT 1000u /* picoseconds per byte of fresh memory until measured */
#define FRESH_MEASURE_MIN (1u << 20)

typedef struct warm_wait {
  uint64_t len;
  int refs;
  uint64_t off, token;
} warm_wait;

static bool warm_ready(ferry_mq *mq, void *arg) {
  warm_wait *w = arg;
  if (!w->token)
    w->token = fr_mq_block_alloc(mq, w->len, w->refs, false, &w->off);
  return w->token != 0;
}

static bool pool_busy(const ferry_mq *mq) { /* blocks held by subscribers: releases to come */
  for (size_t i = 0; i < mq->nblocks; i++)
    if (mq->blocks[i].refs > 0)
      return true;
  return false;
}

static uint64_t fresh_wait_ns(const ferry_mq *mq, uint64_t len) {
  uint64_t ps = mq->fresh_ps_per_byte ? mq->fresh_ps_per_byte : FRESH_PS_DEFAULT;
  return mq->warm_wait_ns + len / 1000 * ps;
}

/* The pool block the payload goes out in to nshm subscribers (lock held): the loan it was
 * built in, or a new block that the caller copies it into; 0 when none (inline instead).
 * *fresh: the block reaches above the memory written so far. */
uint64_t fr_mq_take_block(ferry_mq *mq, uint64_t len, int nshm, uint64_t loan, uint64_t deadline,
                          uint64_t *off, bool *fresh) {
  *fresh = false;
  if (nshm == 0)
    return 0;
  if (loan) {
    fr_mq_block *b = &mq->blocks[(loan & 0xffffffffu) - 1];
    b->refs += nshm;
    *off = b->off;
    return loan;
  }
  fr_mq_drain(mq); /* take the releases in: the pool stays small and warm */
  warm_wait w = {len, nshm, 0, 0};
  uint64_t want = (len + POOL_ALIGN - 1) / POOL_ALIGN * POOL_ALIGN;
  bool small = want <= mq->pool_bytes / 16 && mq->pool_hwm < WARM_BLOCKS * want;
  if (!warm_ready(mq, &w) && !small && pool_busy(mq)) {
    uint64_t until = fr_now_ns() + fresh_wait_ns(mq, len);
    fr_mq_wait(mq, warm_ready, &w, until < deadline ? until : deadline);
  }
  *off = w.off;
  if (w.token)
    return w.token;
  uint64_t hwm = mq->pool_hwm;
  uint64_t token = fr_mq_block_alloc(mq, len, nshm, true, off);
  *fresh = token && *off + want > hwm;
  return token;
}

typedef struct pool_copy_args {
  ferry_mq *mq;
  uint64_t off;
  const void *data;
  size_t len;
  bool fresh;
} pool_copy_args;

static void pool_copy_work(void *arg) {
  pool_copy_args *a = arg;
  uint64_t t0 = a->fresh && a->len >= FRESH_MEASURE_MIN ? fr_now_ns() : 0;
  memcpy(a->mq->pool + a->off, a->data, a->len);
  if (t0) { /* publish_lock held: the only writer */
    uint64_t ps = (fr_now_ns() - t0) * 1000 / a->len;
    ferry_mq *mq = a->mq;
    mq->fresh_ps_per_byte = mq->fresh_ps_per_byte ? (mq->fresh_ps_per_byte + ps) / 2 : ps;
  }
}

/* Copies a payload into its pool block; a copy into fresh memory is timed to learn what
 * growing the pool costs here. The copy counts as polling the shm rings: the releases that the
 * subscribers send meanwhile (of the blocks the next publishes need) then ring no doorbell and
 * wake no thread of this process; a wake-up per message, on a core the copy needs, cost a
 * large stream a third of its speed. */
void fr_mq_pool_copy(ferry_mq *mq, uint64_t off, const void *data, size_t len, bool fresh) {
  pool_copy_args a = {mq, off, data, len, fresh};
  fr_ctx_work_polling(mq->ctx, pool_copy_work, &a);
}
