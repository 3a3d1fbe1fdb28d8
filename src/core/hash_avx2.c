/*
 * XXH3 compiled for AVX2 from the header-only form of Debian's xxhash (XXH_INLINE_ALL). This
 * file alone is built with -mavx2; hash.c calls it only on CPUs that have AVX2.
 */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "core/hash.h"

static uint64_t oneshot(const void *data, size_t len) { return XXH3_64bits(data, len); }

static void *begin(void) {
  XXH3_state_t *s = XXH3_createState();
  if (s)
    XXH3_64bits_reset(s);
  return s;
}

static void update(void *s, const void *data, size_t len) { XXH3_64bits_update(s, data, len); }

static uint64_t end(void *s) {
  uint64_t v = XXH3_64bits_digest(s);
  XXH3_freeState(s);
  return v;
}

const fr_hash_impl fr_hash_avx2 = {"xxh3-avx2", oneshot, begin, update, end};
