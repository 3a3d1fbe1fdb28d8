/*
 * The shared-memory byte ring (see ring.h for the protocol). The doorbell decision is a
 * Dekker-style handshake: the producer publishes head and then reads sleeping/pollers, the
 * consumer publishes sleeping (or leaves pollers) and then re-reads head, all sequentially
 * consistent, so at least one of them sees the other and no byte is ever stranded.
 */
#include "transport/ring.h"
#include "core/core.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define HDR_BYTES 4096u

/* What TSan takes for the head store/load pair (core.h): one object for every ring. */
static char ring_channel;

int fr_shm_segment_check(int fd, uint64_t bytes, const char *what) {
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK))
    return fr_err(FERRY_EPROTO, "%s: the peer's memory is not a memfd sealed against shrinking",
                  what);
  struct stat st;
  if (fstat(fd, &st) != 0)
    return fr_err_errno(FERRY_EPROTO, "%s: cannot stat the peer's memory", what);
  if (st.st_size < 0 || (uint64_t)st.st_size < bytes)
    return fr_err(FERRY_EPROTO, "%s: the peer's memory holds %lld bytes, it claims %llu", what,
                  (long long)st.st_size, (unsigned long long)bytes);
  return 0;
}

int fr_shm_seal(int fd, const char *what) {
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    return fr_err_errno(FERRY_ESYS, "%s: cannot seal its memfd", what);
  return 0;
}

int fr_ring_segment_create(uint64_t ring_bytes, int *fd_out, void **map_out, size_t *len_out) {
  size_t len = 2 * (HDR_BYTES + (size_t)ring_bytes);
  int fd = memfd_create("ferry-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    return fr_err_errno(FERRY_ESYS, "shm ring: memfd_create");
  fchmod(fd, 0600); /* reached only through the fd we pass; 0600 as every region (region.c) */
  if (ftruncate(fd, (off_t)len) != 0) {
    close(fd);
    return fr_err_errno(FERRY_ENOSHM, "shm ring: %zu bytes", len);
  }
  int rc = fr_shm_seal(fd, "shm ring"); /* the peer maps it only sealed */
  if (rc != 0) {
    close(fd);
    return rc;
  }
  void *map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    close(fd);
    return fr_err_errno(FERRY_ENOSHM, "shm ring: mmap");
  }
  for (int i = 0; i < 2; i++) {
    fr_ring_hdr *h = (fr_ring_hdr *)((uint8_t *)map + (size_t)i * (HDR_BYTES + ring_bytes));
    h->magic = FR_RING_MAGIC;
    h->layout_version = FR_RING_LAYOUT_VERSION;
    h->size = ring_bytes;
    h->sleeping = 1; /* nobody is reading yet: the first bytes ring the doorbell */
  }
  *fd_out = fd;
  *map_out = map;
  *len_out = len;
  return 0;
}

int fr_ring_segment_map(int fd, void **map_out, size_t *len_out, uint64_t *ring_bytes) {
  fr_ring_hdr first;
  if (pread(fd, &first, sizeof first, 0) != (ssize_t)sizeof first)
    return fr_err_errno(FERRY_EPROTO, "shm ring: cannot read the segment header");
  uint64_t size = first.size;
  if (first.magic != FR_RING_MAGIC || first.layout_version != FR_RING_LAYOUT_VERSION ||
      size < 4096 || size > (1ull << 30) || (size & (size - 1)))
    return fr_err(FERRY_EPROTO, "shm ring: foreign or corrupt segment header");
  size_t len = 2 * (HDR_BYTES + (size_t)size);
  int rc = fr_shm_segment_check(fd, len, "shm ring");
  if (rc != 0)
    return rc;
  void *map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED)
    return fr_err_errno(FERRY_ESYS, "shm ring: mmap");
  fr_ring_hdr *second = (fr_ring_hdr *)((uint8_t *)map + HDR_BYTES + size);
  if (second->magic != FR_RING_MAGIC || second->size != size) {
    munmap(map, len);
    return fr_err(FERRY_EPROTO, "shm ring: second ring header is corrupt");
  }
  *map_out = map;
  *len_out = len;
  *ring_bytes = size;
  return 0;
}

void fr_ring_attach(void *map, int index, uint64_t ring_bytes, fr_ring *r) {
  uint8_t *base = (uint8_t *)map + (size_t)index * (HDR_BYTES + ring_bytes);
  /* positions start at 0 on both sides: nothing is written before both have attached */
  *r = (fr_ring){.h = (fr_ring_hdr *)base, .data = base + HDR_BYTES, .mask = ring_bytes - 1};
}

bool fr_ring_corrupt(const fr_ring *r) { return r->corrupt; }

/* `span` bytes lie between the two positions: more than the ring holds means the peer wrote a
 * position it never had. */
static bool span_ok(fr_ring *r, uint64_t span, uint64_t peer_pos) {
  if (span <= r->mask + 1 && !r->corrupt)
    return true;
  if (!r->corrupt)
    r->seen = peer_pos;
  r->corrupt = true;
  return false;
}

static void futex_wake(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE, 1, NULL, NULL, 0); }

static void futex_wait(uint32_t *word, uint32_t seen, uint64_t deadline_ns) {
  uint64_t now = fr_now_ns();
  if (now >= deadline_ns)
    return;
  uint64_t left = deadline_ns - now;
  struct timespec ts = fr_timespec(left);
  syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, NULL, 0);
}

size_t fr_ring_write(fr_ring *r, const void *src, size_t len) {
  uint64_t head = r->pos;
  uint64_t tail = __atomic_load_n(&r->h->tail, __ATOMIC_ACQUIRE);
  if (!span_ok(r, head - tail, tail))
    return 0;
  uint64_t space = r->mask + 1 - (head - tail);
  size_t n = len < space ? len : (size_t)space;
  if (n == 0)
    return 0;
  size_t at = (size_t)(head & r->mask);
  size_t first = n < r->mask + 1 - at ? n : (size_t)(r->mask + 1 - at);
  memcpy(r->data + at, src, first);
  memcpy(r->data, (const uint8_t *)src + first, n - first);
  FR_HB_RELEASE(&ring_channel);
  r->pos = head + n;
  __atomic_store_n(&r->h->head, r->pos, __ATOMIC_SEQ_CST);
  return n;
}

bool fr_ring_needs_doorbell(fr_ring *r) {
  if (__atomic_load_n(&r->h->pollers, __ATOMIC_SEQ_CST) != 0)
    return false;
  return __atomic_exchange_n(&r->h->sleeping, 0, __ATOMIC_SEQ_CST) != 0;
}

/* Free bytes for the producer; a corrupt tail counts as room, so the next write finds out. */
static uint64_t ring_free(const fr_ring *r) {
  uint64_t used = r->pos - __atomic_load_n(&r->h->tail, __ATOMIC_ACQUIRE);
  return used > r->mask + 1 ? r->mask + 1 : r->mask + 1 - used;
}

bool fr_ring_wait_space(fr_ring *r, uint64_t want, uint64_t spin_ns, uint64_t deadline_ns) {
  uint64_t enough = want < (r->mask + 1) / 4 ? want : (r->mask + 1) / 4;
  fr_spin spin;
  fr_spin_begin(&spin, spin_ns);
  spin.end = spin.end < deadline_ns ? spin.end : deadline_ns;
  while (ring_free(r) < enough && fr_spin_pause(&spin))
    ; /* the consumer is likely reading now: no futex round trip */
  while (fr_now_ns() < deadline_ns) {
    uint32_t seq = __atomic_load_n(&r->h->space_seq, __ATOMIC_SEQ_CST);
    __atomic_store_n(&r->h->producer_waiting, 1, __ATOMIC_SEQ_CST);
    uint64_t used = r->pos - __atomic_load_n(&r->h->tail, __ATOMIC_SEQ_CST);
    if (used <= r->mask || used > r->mask + 1) /* room, or corrupt: the write will say */
      return true;
    futex_wait(&r->h->space_seq, seq, deadline_ns);
  }
  return ring_free(r) > 0;
}

uint64_t fr_ring_ready(const fr_ring *r) {
  return __atomic_load_n(&r->h->head, __ATOMIC_SEQ_CST) -
         __atomic_load_n(&r->pos, __ATOMIC_RELAXED);
}

size_t fr_ring_read(fr_ring *r, void *dst, size_t len) {
  uint64_t tail = r->pos;
  uint64_t head = __atomic_load_n(&r->h->head, __ATOMIC_SEQ_CST);
  if (!span_ok(r, head - tail, head))
    return 0;
  uint64_t ready = head - tail;
  size_t n = len < ready ? len : (size_t)ready;
  if (n == 0)
    return 0;
  FR_HB_ACQUIRE(&ring_channel);
  if (dst) {
    size_t at = (size_t)(tail & r->mask);
    size_t first = n < r->mask + 1 - at ? n : (size_t)(r->mask + 1 - at);
    memcpy(dst, r->data + at, first);
    memcpy((uint8_t *)dst + first, r->data, n - first);
  }
  __atomic_store_n(&r->pos, tail + n, __ATOMIC_RELAXED);
  __atomic_store_n(&r->h->tail, tail + n, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&r->h->producer_waiting, __ATOMIC_SEQ_CST)) {
    __atomic_store_n(&r->h->producer_waiting, 0, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&r->h->space_seq, 1, __ATOMIC_SEQ_CST);
    futex_wake(&r->h->space_seq);
  }
  return n;
}

bool fr_ring_sleep(fr_ring *r) {
  __atomic_store_n(&r->h->sleeping, 1, __ATOMIC_SEQ_CST);
  if (fr_ring_ready(r) == 0)
    return true;
  __atomic_store_n(&r->h->sleeping, 0, __ATOMIC_SEQ_CST);
  return false;
}

void fr_ring_wake(fr_ring *r) { __atomic_store_n(&r->h->sleeping, 0, __ATOMIC_SEQ_CST); }

void fr_ring_poll_begin(fr_ring *r) { __atomic_add_fetch(&r->h->pollers, 1, __ATOMIC_SEQ_CST); }

void fr_ring_poll_end(fr_ring *r) { __atomic_sub_fetch(&r->h->pollers, 1, __ATOMIC_SEQ_CST); }
