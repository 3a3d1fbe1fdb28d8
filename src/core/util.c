/*
 * Small process-wide helpers: the library version, monotonic time, random bytes, the check of a
 * caller's options struct, the one growable array every layer uses, and the allocation of large
 * buffers that a caller frees with free().
 */
#include "core/core.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>

const char *ferry_version(void) { return FERRY_VERSION_STRING; }

void fr_cond_init_monotonic(pthread_cond_t *cond) {
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(cond, &ca);
  pthread_condattr_destroy(&ca);
}

uint64_t fr_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int fr_ms_left(uint64_t deadline_ns) {
  uint64_t now = fr_now_ns();
  if (now >= deadline_ns)
    return 0;
  uint64_t ms = (deadline_ns - now + 999999) / 1000000;
  return ms > 0x7fffffff ? 0x7fffffff : (int)ms;
}

int fr_random_bytes(void *buf, size_t len) {
  uint8_t *p = buf;
  while (len > 0) {
    ssize_t n = getrandom(p, len, 0);
    if (n < 0)
      return fr_err_errno(FERRY_ESYS, "getrandom");
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

uint64_t fr_random_u64(void) {
  uint64_t v = 0;
  if (fr_random_bytes(&v, sizeof v) != 0)
    abort(); /* getrandom cannot fail for 8 bytes on a sane kernel */
  return v;
}

int fr_mutex_lock_until(pthread_mutex_t *m, uint64_t deadline_ns) {
  uint64_t now = fr_now_ns(), left = deadline_ns > now ? deadline_ns - now : 0;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t at = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec + left;
  ts = fr_timespec(at);
  return pthread_mutex_timedlock(m, &ts);
}

size_t fr_str_copy(char *dst, size_t cap, const char *src) {
  if (!src)
    src = "";
  size_t len = strlen(src);
  if (cap > 0) {
    size_t n = len < cap ? len : cap - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
  }
  return len;
}

/* Length of the well-formed UTF-8 sequence at p (1..4 bytes), or 0 when p does not start one
 * (a stray continuation byte, an overlong form, a surrogate, beyond U+10FFFF, cut short). */
size_t fr_utf8_seq(const unsigned char *p, size_t left) {
  unsigned c = p[0];
  size_t n;
  uint32_t cp, min;
  if (c < 0x80)
    return 1;
  if (c >= 0xc2 && c <= 0xdf)
    n = 2, cp = c & 0x1f, min = 0x80;
  else if ((c & 0xf0) == 0xe0)
    n = 3, cp = c & 0x0f, min = 0x800;
  else if (c >= 0xf0 && c <= 0xf4)
    n = 4, cp = c & 0x07, min = 0x10000;
  else
    return 0;
  if (left < n)
    return 0;
  for (size_t i = 1; i < n; i++) {
    if ((p[i] & 0xc0) != 0x80)
      return 0;
    cp = cp << 6 | (p[i] & 0x3f);
  }
  return cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff) ? 0 : n;
}

int fr_opts_check(const void *opts, size_t known, const char *what) {
  if (!opts)
    return 0;
  size_t size;
  memcpy(&size, opts, sizeof size);
  if (size < sizeof size || size > FR_OPTS_MAX)
    return fr_err(FERRY_EINVAL, "%s: opts->size is %zu: set it to sizeof the struct, or pass NULL",
                  what, size);
  const unsigned char *bytes = opts;
  for (size_t i = known; i < size; i++)
    if (bytes[i])
      return fr_err(FERRY_ENOTSUP,
                    "%s: opts sets byte %zu, beyond the %zu bytes of the struct libferry %s knows "
                    "(a newer ferry.h?)",
                    what, i, known, FERRY_VERSION_STRING);
  return 0;
}

int fr_grow(void **items, size_t *cap, size_t need, size_t elem, size_t first) {
  if (need <= *cap)
    return 0;
  size_t c = *cap ? *cap : (first ? first : 1);
  while (c < need) {
    if (c > SIZE_MAX / 2)
      return FERRY_ENOMEM;
    c *= 2;
  }
  if (elem && c > SIZE_MAX / elem)
    return FERRY_ENOMEM; /* more than memory can hold */
  void *p = realloc(*items, c * elem);
  if (!p)
    return FERRY_ENOMEM;
  *items = p;
  *cap = c;
  return 0;
}

/* Large buffers (a get into new memory) are malloc's, which reuses memory a free() gave back
 * (warm pages: nothing to fault), and their huge-page-aligned interior is marked MADV_HUGEPAGE
 * (anonymous THP is usually `madvise` only): where malloc maps new memory, its first touch then
 * takes one fault per 2 MiB instead of one per 4 KiB, which is what a fresh 11 MiB buffer costs
 * most (docs/PERFORMANCE.md). Where THP is off, madvise fails and nothing changes. */
#define HUGE_PAGE ((uintptr_t)2 << 20)
void *fr_malloc_large(size_t n) {
  void *p = malloc(n ? n : 1);
  if (p && n >= 2 * HUGE_PAGE) {
    uintptr_t lo = ((uintptr_t)p + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    uintptr_t hi = ((uintptr_t)p + n) & ~(HUGE_PAGE - 1);
    if (hi > lo)
      madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
  }
  return p;
}
