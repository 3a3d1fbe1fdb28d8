/*
 * The store pool's sub-allocator: first fit over a sorted, coalesced free list of 64-byte
 * granules. Objects are few (thousands) and large, so a linear list is simpler and as fast as
 * anything cleverer here. It knows nothing of memory: offsets in, offsets out.
 */
#include "store/store.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GRANULE 64u

static uint64_t round_up(uint64_t v) { return (v + GRANULE - 1) / GRANULE * GRANULE; }

int fr_pool_init(fr_pool *p, uint64_t capacity) {
  memset(p, 0, sizeof *p);
  p->capacity = capacity / GRANULE * GRANULE;
  p->cap = 16;
  p->free = malloc(p->cap * sizeof *p->free);
  if (!p->free)
    return fr_err(FERRY_ENOMEM, "store pool");
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

int fr_pool_alloc(fr_pool *p, uint64_t bytes, uint64_t *off) {
  uint64_t need = round_up(bytes ? bytes : 1);
  for (size_t i = 0; bytes <= p->capacity && i < p->nfree; i++) {
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
  return fr_err(FERRY_ECAPACITY,
                "%llu bytes do not fit the store pool: capacity %llu, in use %llu, largest free "
                "block %llu (raise FERRY_STORE_CAPACITY or delete objects)",
                (unsigned long long)bytes, (unsigned long long)p->capacity,
                (unsigned long long)p->used, (unsigned long long)fr_pool_largest(p));
}

static bool grow(fr_pool *p) { return FR_GROW(p->free, p->cap, p->nfree + 1, 16) == 0; }

void fr_pool_free(fr_pool *p, uint64_t off, uint64_t bytes) {
  uint64_t len = round_up(bytes ? bytes : 1);
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
    fr_warn("store pool: lost %llu bytes (out of memory)", (unsigned long long)len);
  }
}
