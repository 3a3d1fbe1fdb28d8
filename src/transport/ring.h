/*
 * A single-producer, single-consumer byte ring in shared memory: the data path of a shm link.
 * Two processes map the same segment (two rings, one per direction). Positions only grow; the
 * producer owns `head`, the consumer owns `tail`, each on its own cache line.
 *
 * Wake-ups: a consumer that goes to sleep (its progress thread back in epoll) sets `sleeping`;
 * a producer that published bytes and finds it set (and nobody polling) sends one doorbell byte
 * on the link's socket. Threads that spin on a ring announce themselves in `pollers`, so while
 * someone spins, no doorbell (and no system call) is needed at all. A producer that finds the
 * ring full sleeps on a futex that the consumer wakes when it frees space.
 *
 * Trust: the peer can write every byte of the segment at any time. So each side keeps its own
 * position in process memory (fr_ring.pos) and only publishes it; it reads nothing back but the
 * peer's position, and checks that against its own before using it (ready or used bytes ≤ size).
 * A position that fails the check marks the ring corrupt for good: it copies nothing more, and
 * the link closes (shm.c). The flags (sleeping, pollers, producer_waiting, space_seq) only decide
 * whether to wake or wait, so any value in them costs a wake-up or a wait slice, never memory.
 */
#ifndef FR_RING_H
#define FR_RING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define FR_RING_MAGIC 0x474e495259525246ull /* "FRRYRING" */
#define FR_RING_LAYOUT_VERSION 1u

typedef struct fr_ring_hdr {
  /* producer's line */
  _Alignas(64) uint64_t head;
  uint32_t space_seq;        /* futex: bumped by the consumer when a waiting producer may go on */
  uint32_t producer_waiting; /* a producer sleeps on space_seq */
  /* consumer's line */
  _Alignas(64) uint64_t tail;
  uint32_t sleeping; /* the consumer waits for a doorbell */
  uint32_t pollers;  /* threads spinning on this ring */
  /* constant */
  _Alignas(64) uint64_t magic;
  uint32_t layout_version;
  uint32_t reserved;
  uint64_t size; /* data bytes, a power of two */
} fr_ring_hdr;
_Static_assert(sizeof(fr_ring_hdr) == 192, "ring header layout is shared between processes");

typedef struct fr_ring {
  fr_ring_hdr *h;
  uint8_t *data;
  uint64_t mask;
  uint64_t pos;  /* this side's position (head for the producer, tail for the consumer) */
  bool corrupt;  /* the peer's position was out of range once: nothing more is copied */
  uint64_t seen; /* the peer's position that failed the check (for the error message) */
} fr_ring;

/*
 * A peer's memfd (a ring segment, a region) is mapped only when the kernel promises that it stays
 * as large as we map it: sealed against shrinking (F_SEAL_SHRINK), with at least `bytes`. A
 * mapping past the end of its file raises SIGBUS on the first touch, and an unsealed memfd can
 * be truncated by its owner at any moment after we checked its size, so a size read from the
 * peer (a MAP response, a header) is never enough. FERRY_EPROTO naming `what` otherwise (also
 * for something that is not a sealable memfd at all). Our own memfds are sealed when made
 * (fr_shm_seal here, memfd_map in core/region.c).
 */
int fr_shm_segment_check(int fd, uint64_t bytes, const char *what);
/* Seals a memfd made with MFD_ALLOW_SEALING at its present size: no shrinking, no growing, no
 * further seals. */
int fr_shm_seal(int fd, const char *what);

/* A segment holding two rings of `ring_bytes` each (a power of two): creates the memfd. */
int fr_ring_segment_create(uint64_t ring_bytes, int *fd, void **map, size_t *map_len);
/* Maps a peer's segment and validates both headers; *ring_bytes: the validated ring size. */
int fr_ring_segment_map(int fd, void **map, size_t *map_len, uint64_t *ring_bytes);
/* Ring `index` (0: connector → acceptor, 1: acceptor → connector) of a mapped segment whose
 * rings hold ring_bytes each (as created, or as fr_ring_segment_map validated it: never re-read
 * from the segment, which the peer may have changed since). */
void fr_ring_attach(void *map, int index, uint64_t ring_bytes, fr_ring *r);
/* The peer wrote a position out of range: the ring is unusable (see the trust note above). */
bool fr_ring_corrupt(const fr_ring *r);

/* Producer: copies up to len bytes (what fits) and publishes them; returns the count (0 also
 * when the ring is corrupt). */
size_t fr_ring_write(fr_ring *r, const void *src, size_t len);
/* Producer: true when the consumer needs a doorbell for what was just published. */
bool fr_ring_needs_doorbell(fr_ring *r);
/* Producer: waits until the ring has space or the deadline passes (false then). It first
 * yields for up to spin_ns until min(want, a quarter ring) is free: a full ring's consumer is
 * usually reading on another core, and a futex sleep per message read cost a stream of
 * 16 KiB messages 10x (the consumer's wake-up each time). Then it sleeps until any space. */
bool fr_ring_wait_space(fr_ring *r, uint64_t want, uint64_t spin_ns, uint64_t deadline_ns);

/* Consumer: bytes ready to read (more than the ring holds when the ring is corrupt: read it to
 * find out). */
uint64_t fr_ring_ready(const fr_ring *r);
/* Consumer: copies up to len ready bytes to dst (NULL: discards them); returns the count (0
 * also when the ring is corrupt). */
size_t fr_ring_read(fr_ring *r, void *dst, size_t len);
/* Consumer: marks itself asleep; returns false if bytes arrived meanwhile (stay awake). */
bool fr_ring_sleep(fr_ring *r);
void fr_ring_wake(fr_ring *r);
/* A spinning thread announces itself so producers skip the doorbell. */
void fr_ring_poll_begin(fr_ring *r);
void fr_ring_poll_end(fr_ring *r);

#endif
