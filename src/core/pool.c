/*
 * The one pool sub-allocator (pool.h): first fit over a sorted, coalesced free list of
 * granules, used by the store's object pool and mq's payload pool. The memory model is stated
 * in pool.h.
 */
#include "core/pool.h"
#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

uint64_t fr_pool_round(const fr_pool *p, uint64_t v) {
  return (v + p->granule - 1) / p->granule * p->granule;
}

int fr_pool_init(fr_pool *p, uint64_t capacity, uint64_t granule) {
  memset(p, 0, sizeof *p);
  p->granule = granule ? granule : 1;
  p->capacity = capacity / p->granule * p->granule;
  p->cap = 16;
  p->free = malloc(p->cap * sizeof *p->free);
  if (!p->free)
    return fr_err(FERRY_ENOMEM, "pool of %llu bytes: its free list", (unsigned long long)capacity);
  if (p->capacity)
    p->free[p->nfree++] = (fr_pool_block){0, p->capacity};
  return 0;
}

void fr_pool_fini(fr_pool *p) {
  free(p->free);
  memset(p, 0, sizeof *p);
}

uint64_t fr_pool_largest(const fr_pool *p) {
  uint64_t m = 0;
  for (size_t i = 0; i < p->nfree; i++)
    if (p->free[i].len > m)
      m = p->free[i].len;
  return m;
}

int fr_pool_alloc(fr_pool *p, uint64_t bytes, uint64_t limit, uint64_t *off) {
  if (bytes > p->capacity) /* and rounding it cannot overflow */
    return FERRY_ECAPACITY;
  limit = limit < p->capacity ? limit : p->capacity;
  uint64_t need = fr_pool_round(p, bytes ? bytes : 1);
  for (size_t i = 0; i < p->nfree && p->free[i].off + need <= limit; i++) {
    fr_pool_block *b = &p->free[i];
    if (b->len < need)
      continue;
    *off = b->off;
    b->off += need;
    b->len -= need;
    if (b->len == 0) {
      memmove(b, b + 1, (p->nfree - i - 1) * sizeof *b);
      p->nfree--;
    }
    p->used += need;
    return 0;
  }
  return FERRY_ECAPACITY;
}

static bool grow(fr_pool *p) { return FR_GROW(p->free, p->cap, p->nfree + 1, 16) == 0; }

void fr_pool_free(fr_pool *p, uint64_t off, uint64_t bytes) {
  uint64_t len = fr_pool_round(p, bytes ? bytes : 1);
  size_t i = 0;
  while (i < p->nfree && p->free[i].off < off)
    i++;
  p->used -= len;
  bool left = i > 0 && p->free[i - 1].off + p->free[i - 1].len == off;
  bool right = i < p->nfree && off + len == p->free[i].off;
  if (left && right) {
    p->free[i - 1].len += len + p->free[i].len;
    memmove(&p->free[i], &p->free[i + 1], (p->nfree - i - 1) * sizeof *p->free);
    p->nfree--;
  } else if (left) {
    p->free[i - 1].len += len;
  } else if (right) {
    p->free[i].off = off;
    p->free[i].len += len;
  } else if (grow(p)) {
    memmove(&p->free[i + 1], &p->free[i], (p->nfree - i) * sizeof *p->free);
    p->free[i] = (fr_pool_block){off, len};
    p->nfree++;
  } else { /* out of memory for the free list: the block is lost, not corrupted */
    fr_warn_limited("pool: lost %llu bytes (out of memory)", (unsigned long long)len);
  }
}
