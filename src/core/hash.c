/*
 * Checksums: XXH3-64 through the distribution's libxxhash, or its AVX2 build (hash_avx2.c) when
 * the CPU has AVX2. Both give the same values; the choice is made once.
 */
#include "core/hash.h"
#include "core/core.h"

#include <stdlib.h>
#include <xxhash.h>

static uint64_t generic_oneshot(const void *data, size_t len) { return XXH3_64bits(data, len); }

static void *generic_begin(void) {
  XXH3_state_t *s = XXH3_createState();
  if (s)
    XXH3_64bits_reset(s);
  return s;
}

static void generic_update(void *s, const void *data, size_t len) {
  XXH3_64bits_update(s, data, len);
}

static uint64_t generic_end(void *s) {
  uint64_t v = XXH3_64bits_digest(s);
  XXH3_freeState(s);
  return v;
}

const fr_hash_impl fr_hash_generic = {"xxh3", generic_oneshot, generic_begin, generic_update,
                                      generic_end};

const fr_hash_impl *fr_hash_current(void) {
  static const fr_hash_impl *chosen;
  const fr_hash_impl *c = __atomic_load_n(&chosen, __ATOMIC_ACQUIRE);
  if (!c) {
    __builtin_cpu_init();
    c = __builtin_cpu_supports("avx2") ? &fr_hash_avx2 : &fr_hash_generic;
    __atomic_store_n(&chosen, c, __ATOMIC_RELEASE);
  }
  return c;
}

uint64_t ferry_checksum(const void *data, size_t len) {
  return fr_hash_current()->oneshot(data, len);
}

fr_hash *fr_hash_begin(void) { return fr_hash_current()->begin(); }

void fr_hash_update(fr_hash *h, const void *data, size_t len) {
  fr_hash_current()->update(h, data, len);
}

uint64_t fr_hash_end(fr_hash *h) { return fr_hash_current()->end(h); }
