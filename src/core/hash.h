/*
 * XXH3-64, the checksum of every bucket and object ferry verifies, with an AVX2 build picked at
 * run time where the CPU has it (about twice the speed of the distribution's generic library
 * here: hashing as fast as copying matters for refit, which hashes every byte on both sides).
 * One-shot (ferry_checksum) and streaming, both giving the same value as XXH3_64bits().
 */
#ifndef FR_HASH_H
#define FR_HASH_H

#include <stddef.h>
#include <stdint.h>

typedef struct fr_hash fr_hash;

/* A streaming hash; NULL when out of memory. fr_hash_end returns the value and frees it. */
fr_hash *fr_hash_begin(void);
void fr_hash_update(fr_hash *h, const void *data, size_t len);
uint64_t fr_hash_end(fr_hash *h);

/* The implementations (hash.c picks one). */
typedef struct fr_hash_impl {
  const char *name;
  uint64_t (*oneshot)(const void *data, size_t len);
  void *(*begin)(void);
  void (*update)(void *state, const void *data, size_t len);
  uint64_t (*end)(void *state);
} fr_hash_impl;
extern const fr_hash_impl fr_hash_generic, fr_hash_avx2;
const fr_hash_impl *fr_hash_current(void);

#endif
