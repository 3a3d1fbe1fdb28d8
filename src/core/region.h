/*
 * Memory regions: memory a node exposes to peers by (id, key), with bounds checks and refcounts.
 *
 * A region is either shared (ferry_alloc: a memfd that same-host peers map, or memory the ctx's
 * first transport provides instead, see fr_region_mem) or registered (ferry_register: caller
 * memory that peers reach through the owner). A shared region's memfd
 * starts with one header page (magic, layout version, id, size, state) so a peer that mapped it
 * can tell when the owner has freed it; the data follows at FR_SHM_HEADER_BYTES.
 */
#ifndef FR_REGION_H
#define FR_REGION_H

#include "core/cuda.h"
#include "ferry.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#define FR_SHM_MAGIC 0x4d48535952524546ull /* "FERRYSHM" */
#define FR_SHM_LAYOUT_VERSION 2u /* 2: region_id checked at each access (memfds are reused) */
#define FR_SHM_HEADER_BYTES 4096u

/* CLOSED: freed because its owner's ctx closed (the owner is gone, not just the region).
 * CACHED: freed, its memfd kept by the owner for a later region (a peer keeps its mapping);
 * FREED after that means the memfd is gone for good (a peer may unmap it). */
enum { FR_SHM_ALIVE = 1, FR_SHM_FREED = 2, FR_SHM_CLOSED = 3, FR_SHM_CACHED = 4 };

/* Trust: every peer that maps the region can write this page. Peers only compare its words
 * (magic, version, id, size when they map it; state with FR_SHM_ALIVE and region_id with the
 * region they read at each access: a cached memfd comes back as another region, region_id first,
 * then state ALIVE (release), then a full fence before its new bytes): the size
 * they bound accesses by is the one the owner sent in its MAP response, checked against the
 * memfd itself, which the owner sealed against shrinking (transport/shm.c map_segment). The
 * owner never reads the header back. */
typedef struct fr_shm_header {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t header_bytes;
  uint64_t region_id;
  uint64_t data_bytes;
  uint32_t state; /* FR_SHM_ALIVE / FREED / CLOSED / CACHED, atomic */
  uint32_t reserved;
  /* The region's access key: whoever maps the memfd can read and write all of it anyway, so a
   * peer that maps it for an earlier region checks a later region's key here instead of asking
   * the owner again (transport/shm.c, find_map). */
  uint64_t region_key;
} fr_shm_header;
_Static_assert(sizeof(fr_shm_header) == 48, "shm header layout is part of the protocol");

/* A region id is its memory's lineage (a memfd, or a registration) and the how-many-th region
 * that memory serves: (lineage << FR_REGION_INC_BITS) | incarnation. Ids are never reused; a
 * peer that maps a lineage's memfd knows a later region of it by the id alone. */
#define FR_REGION_INC_BITS 20
#define FR_REGION_INC_MAX ((1ull << FR_REGION_INC_BITS) - 1)
static inline uint64_t fr_region_lineage(uint64_t id) { return id >> FR_REGION_INC_BITS; }
_Static_assert(sizeof(fr_shm_header) <= FR_SHM_HEADER_BYTES, "header fits its page");

/* Memory for a shared region that a transport provides instead of a memfd (ucx: memory UCX
 * allocates, which its shared-memory transports let peers map): page-aligned and zeroed;
 * release(handle) frees it. */
typedef struct fr_region_mem {
  void *addr;
  void (*release)(void *handle);
  void *handle;
} fr_region_mem;
typedef int (*fr_region_mem_alloc)(void *arg, size_t bytes, fr_region_mem *out);

typedef struct fr_region {
  uint64_t id;
  uint64_t key;
  uint64_t lineage, incarnation; /* id's parts (FR_REGION_INC_BITS) */
  uint8_t *data;                 /* first data byte */
  uint64_t size;                 /* data bytes */
  int memfd;                     /* -1 for registered memory and transport memory */
  void *map; /* header + data (memfd mapping or transport memory), NULL when registered */
  size_t map_bytes;
  fr_region_mem mem; /* transport memory (release NULL: none) */
  int refs;          /* atomic; the table holds one while the region is listed */
  /* Registered memory only: threads of this process touching its bytes right now
   * (fr_region_use_begin), with FR_REGION_GONE set once it is deregistered; atomic. */
  uint32_t users;
  void *copy_event; /* CUDA: recorded after each staged copy out of it (fr_cuda_gate) */
  /* Registered CUDA memory (kind FERRY_MEM_CUDA): data is a device address, never touched by
   * the CPU. Peers on this host map it through a CUDA IPC handle, made at the first MAP request
   * under the table's lock (ipc_ready); others get its bytes staged through host memory. */
  ferry_mem_kind kind;
  int device;
  bool ipc_ready;
  fr_cuda_ipc ipc;
} fr_region;

/* Freed memfd regions kept for reuse (FERRY_ALLOC_CACHE_BYTES in all): a new allocation of about
 * their size takes one back, with a new id and key, so its pages stay mapped here and in every
 * peer that mapped it before (transport/shm.c maps a memfd once, whatever region it serves).
 * A first touch of fresh pages costs a page fault each, through every mapping (on some virtual
 * machines several microseconds: docs/PERFORMANCE.md); a warm page costs nothing. A freed region
 * is cached even while a serving thread still holds a reference to it (the end of a read it
 * answers), and taken back only once nobody but the cache does (no server thread is mid-copy of
 * it). A MAP answer drops its reference before it goes out (transport/link_rx.c), so a free
 * right after a peer's read through its mapping is taken back by the very next allocation. */
typedef struct fr_region_cache {
  fr_region **items; /* oldest first */
  size_t count, cap;
  uint64_t bytes; /* map_bytes of the items */
} fr_region_cache;

typedef struct fr_region_table {
  pthread_mutex_t lock;
  fr_region **items;
  size_t count, cap;
  uint64_t next_lineage;
  fr_region_cache cache; /* under lock */
} fr_region_table;

void fr_region_table_init(fr_region_table *t);
/* Removes and releases every region. */
void fr_region_table_fini(fr_region_table *t);

/* A shared region: a freed memfd region of about that size taken back from the cache (zeroed
 * unless `uninit`), a memfd, or (alloc non-NULL) the memory alloc(arg, ...) provides, falling
 * back to a memfd when it fails. */
int fr_region_alloc_shared(fr_region_table *t, size_t bytes, bool uninit, fr_region_mem_alloc alloc,
                           void *arg, fr_region **out);
/* Caller memory, host or CUDA (told apart here: a CUDA range must lie inside one allocation). */
int fr_region_add_registered(fr_region_table *t, void *ptr, size_t len, fr_region **out);
/* The IPC handle of a CUDA region, made on first use. */
int fr_region_cuda_ipc(fr_region_table *t, fr_region *r, fr_cuda_ipc *out);
/* Unlists a region (by id, or by its data pointer when id == 0) and drops the table's ref;
 * a shared region's header is marked freed first. Registered memory: it also waits until no
 * thread of this process touches its bytes (fr_region_use_begin); every such use is short by
 * construction (a copy of a chunk, queuing one for CUDA memory, a non-blocking receive, never a
 * send to a peer), so the wait is too; then for the device copies queued from it to finish.
 * FERRY_ETIMEDOUT when a use is still on after FR_REGION_DRAIN_MS (a hung device copy): the region
 * is unlisted all the same, but its memory must not be freed. */
int fr_region_remove(fr_region_table *t, uint64_t id, const void *data);

/* The bytes of registered memory belong to its caller, who may free them as soon as
 * ferry_deregister returned; a reference (fr_region_acquire) keeps only the record. A thread
 * touches them between fr_region_use_begin (false, FERRY_ENOTFOUND set, once deregistered) and
 * fr_region_use_end, and never holds that across anything a peer paces (a send, a blocking
 * receive): it copies a chunk out (or a received chunk in) and lets go. Shared regions need no
 * use: their memory lives until their last reference is dropped (begin is always true). */
#define FR_REGION_GONE 0x80000000u
#define FR_REGION_DRAIN_MS 10000
bool fr_region_use_begin(fr_region *r);
void fr_region_use_end(fr_region *r);
/* Whether r is caller memory (ferry_register): its bytes are reached between use_begin/end. */
static inline bool fr_region_is_registered(const fr_region *r) { return r->map == NULL; }
/* Test hooks (NULL in production): called by fr_region_remove when it starts waiting for a use
 * of r to end; by a server thread once it took a staged read of r, before any byte of it; and by
 * a staged read inside a use of r, before it copies a chunk. */
extern void (*fr_region_test_draining)(const fr_region *r);
extern void (*fr_region_test_serving)(const fr_region *r);
extern void (*fr_region_test_copying)(const fr_region *r);
/* ... and by a link's receive of a peer's write into r, before it writes a chunk of it. */
extern void (*fr_region_test_receiving)(const fr_region *r);

/* Looks a region up for a peer's access: checks the key and that [off, off+len) lies inside.
 * FERRY_ENOTFOUND, FERRY_EACCES or FERRY_ERANGE; on success *out holds a reference. */
int fr_region_acquire(fr_region_table *t, uint64_t id, uint64_t key, uint64_t off, uint64_t len,
                      fr_region **out);
void fr_region_release(fr_region *r);
/* The region containing [ptr, ptr+len), with a reference. */
int fr_region_find(fr_region_table *t, const void *ptr, size_t len, fr_region **out);

/* Checks that [off, off+len) lies within size, without overflow. */
static inline bool fr_range_ok(uint64_t off, uint64_t len, uint64_t size) {
  return off <= size && len <= size - off;
}

#endif
