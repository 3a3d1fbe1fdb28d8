/*
 * libFuzzer target for the shm ring (transport/ring.c) against a peer that writes anything into
 * the shared segment. The input is a program of operations on one 4 KiB ring: write n bytes,
 * read n bytes, or overwrite a shared word (head, tail, size, the flags) with a value from the
 * input, as a hostile peer would. Checked after every step:
 * - a read or write never returns more than asked, and never touches memory outside the ring
 *   (the segment is followed by an inaccessible page, so a stray copy faults);
 * - while no position was forged, the bytes read are exactly the bytes written, in order;
 * - once a forged position was seen, the ring says corrupt and copies nothing more.
 */
#include "transport/ring.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define RING 4096u

static uint8_t *segment(size_t *len) {
  int fd;
  void *map;
  if (fr_ring_segment_create(RING, &fd, &map, len) != 0)
    abort();
  munmap(map, *len);
  /* mapped again into a reservation one page longer, which stays inaccessible: reading or
   * writing past the segment faults */
  uint8_t *at = mmap(NULL, *len + 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (at == MAP_FAILED ||
      mmap(at, *len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) != at)
    abort();
  close(fd);
  return at;
}

static uint64_t take(const uint8_t **p, const uint8_t *end, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n && *p < end; i++)
    v |= (uint64_t) * (*p)++ << (8 * i);
  return v;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static uint8_t *seg;
  static size_t seg_len;
  if (!seg)
    seg = segment(&seg_len);
  memset(seg, 0, seg_len);
  /* a clean header for both rings, as fr_ring_segment_create writes it */
  for (int i = 0; i < 2; i++) {
    fr_ring_hdr *h = (fr_ring_hdr *)(seg + (size_t)i * (4096 + RING));
    h->magic = FR_RING_MAGIC;
    h->layout_version = FR_RING_LAYOUT_VERSION;
    h->size = RING;
    h->sleeping = 1;
  }
  /* ring 1 is the last one in the segment: its overruns hit the guard page */
  fr_ring tx, rx;
  fr_ring_attach(seg, 1, RING, &tx);
  fr_ring_attach(seg, 1, RING, &rx);
  static uint8_t model[1 << 16], buf[1 << 16];
  uint64_t written = 0, read = 0; /* stream positions of the honest model */
  bool forged = false;
  const uint8_t *p = data, *end = data + size;
  while (p < end) {
    uint8_t op = *p++;
    size_t n = (size_t)take(&p, end, 2);
    switch (op % 4) {
    case 0: { /* write n bytes of a pattern */
      for (size_t i = 0; i < n; i++)
        buf[i] = (uint8_t)(written + i);
      size_t w = fr_ring_write(&tx, buf, n);
      assert(w <= n);
      if (fr_ring_corrupt(&tx))
        assert(w == 0 && forged);
      for (size_t i = 0; i < w; i++)
        model[(written + i) % sizeof model] = (uint8_t)(written + i);
      written += w;
      break;
    }
    case 1: { /* read up to n bytes */
      size_t r = fr_ring_read(&rx, buf, n);
      assert(r <= n);
      if (fr_ring_corrupt(&rx))
        assert(r == 0 && forged);
      if (!forged)
        for (size_t i = 0; i < r; i++)
          assert(buf[i] == model[(read + i) % sizeof model]);
      read += r;
      break;
    }
    case 2: { /* the peer overwrites a position */
      uint64_t v = take(&p, end, 8);
      uint64_t *word = n % 2 ? &tx.h->head : &tx.h->tail;
      forged |= *word != v;
      *word = v;
      break;
    }
    default: /* the peer overwrites a header word that only steers wake-ups, or the size */
      tx.h->sleeping = (uint32_t)take(&p, end, 4);
      tx.h->pollers = (uint32_t)n;
      tx.h->producer_waiting = (uint32_t)(n >> 1);
      tx.h->size = take(&p, end, 8);
      break;
    }
    if (!forged)
      assert(!fr_ring_corrupt(&tx) && !fr_ring_corrupt(&rx));
    if (fr_ring_corrupt(&tx) || fr_ring_corrupt(&rx)) {
      assert(fr_ring_write(&tx, buf, 16) == 0 || !fr_ring_corrupt(&tx));
      assert(fr_ring_read(&rx, buf, 16) == 0 || !fr_ring_corrupt(&rx));
    }
  }
  return 0;
}
