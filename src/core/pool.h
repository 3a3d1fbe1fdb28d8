/*
 * fr_pool: a first-fit sub-allocator of offsets in [0, capacity), in granules (a power of two),
 * over a sorted, coalesced free list. It knows nothing of memory: offsets in, offsets out. Its
 * users are few and their blocks large (the store's objects, mq's payloads in flight), so a
 * linear list is simpler and as fast as anything cleverer here.
 *
 * Memory model (who may touch what):
 * - The struct and its free list live in the owner's private heap, never in shared memory. A
 *   peer that maps the region the offsets address (the store's pool, mq's pool: both
 *   ferry_alloc'd and mapped by same-host peers) can write the bytes of any block, but cannot
 *   see or change which blocks are free: the allocator's state is out of its reach.
 * - Not thread-safe: every call on one pool runs under its owner's one lock (the store's
 *   s->lock, mq's mq->lock); nothing here is read without it (a metrics scrape reads `used`
 *   and `capacity` under that lock too, or as a relaxed snapshot that may be stale).
 * - fr_pool_free trusts its arguments: an offset or length that a peer sent (an mq release
 *   token, a store key) must first be checked against the owner's own record of the block it
 *   handed out (mq's block table, the store's object table), never passed through as given.
 *   Freeing what was not allocated would hand the same bytes out twice.
 */
#ifndef FR_POOL_H
#define FR_POOL_H

#include <stddef.h>
#include <stdint.h>

typedef struct fr_pool_block {
  uint64_t off, len;
} fr_pool_block;

typedef struct fr_pool {
  uint64_t capacity, used; /* granule multiples; used: allocated bytes, rounded */
  uint64_t granule;
  fr_pool_block *free; /* sorted by offset, coalesced */
  size_t nfree, cap;
} fr_pool;

/* capacity is rounded down to the granule (a power of two); FERRY_ENOMEM with a detail. */
int fr_pool_init(fr_pool *p, uint64_t capacity, uint64_t granule);
void fr_pool_fini(fr_pool *p); /* also on a zeroed, never initialised pool */
/* First fit for bytes (rounded up to the granule, 0 counts as 1) among the free extents, ending
 * at most at `limit` (capacity: anywhere). 0, or FERRY_ECAPACITY without a detail: a full pool
 * is routine for some callers (mq then sends inline), so each says what did not fit where. */
int fr_pool_alloc(fr_pool *p, uint64_t bytes, uint64_t limit, uint64_t *off);
/* Gives back a block fr_pool_alloc returned, with the bytes it was asked for. */
void fr_pool_free(fr_pool *p, uint64_t off, uint64_t bytes);
uint64_t fr_pool_largest(const fr_pool *p);
/* bytes rounded up to the pool's granule. */
uint64_t fr_pool_round(const fr_pool *p, uint64_t bytes);

#endif
