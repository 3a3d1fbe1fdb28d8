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
#define FR_SHM_LAYOUT_VERSION 1u
#define FR_SHM_HEADER_BYTES 4096u

/* CLOSED: freed because its owner's ctx closed (the owner is gone, not just the region). */
enum { FR_SHM_ALIVE = 1, FR_SHM_FREED = 2, FR_SHM_CLOSED = 3 };

/* Trust: every peer that maps the region can write this page. Peers only compare its words
 * (magic, version, id, size when they map it; state with FR_SHM_ALIVE at each access): the size
 * they bound accesses by is the one the owner sent in its MAP response, checked against the
 * memfd itself, which the owner sealed against shrinking (transport/shm.c map_segment). The
 * owner never reads the header back. */
typedef struct fr_shm_header {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t header_bytes;
  uint64_t region_id;
  uint64_t data_bytes;
  uint32_t state; /* FR_SHM_ALIVE / FR_SHM_FREED / FR_SHM_CLOSED, atomic */
  uint32_t reserved;
} fr_shm_header;
_Static_assert(sizeof(fr_shm_header) == 40, "shm header layout is part of the protocol");
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
  uint8_t *data; /* first data byte */
  uint64_t size; /* data bytes */
  int memfd;     /* -1 for registered memory and transport memory */
  void *map;     /* header + data (memfd mapping or transport memory), NULL when registered */
  size_t map_bytes;
  fr_region_mem mem; /* transport memory (release NULL: none) */
  int refs;          /* atomic; the table holds one while the region is listed */
  /* Registered CUDA memory (kind FERRY_MEM_CUDA): data is a device address, never touched by
   * the CPU. Peers on this host map it through a CUDA IPC handle, made at the first MAP request
   * under the table's lock (ipc_ready); others get its bytes staged through host memory. */
  ferry_mem_kind kind;
  int device;
  bool ipc_ready;
  fr_cuda_ipc ipc;
} fr_region;

typedef struct fr_region_table {
  pthread_mutex_t lock;
  fr_region **items;
  size_t count, cap;
  uint64_t next_id;
} fr_region_table;

void fr_region_table_init(fr_region_table *t);
/* Removes and releases every region. */
void fr_region_table_fini(fr_region_table *t);

/* A shared region: a memfd, or (alloc non-NULL) the memory alloc(arg, ...) provides, falling
 * back to a memfd when it fails. */
int fr_region_alloc_shared(fr_region_table *t, size_t bytes, fr_region_mem_alloc alloc, void *arg,
                           fr_region **out);
/* Caller memory, host or CUDA (told apart here: a CUDA range must lie inside one allocation). */
int fr_region_add_registered(fr_region_table *t, void *ptr, size_t len, fr_region **out);
/* The IPC handle of a CUDA region, made on first use. */
int fr_region_cuda_ipc(fr_region_table *t, fr_region *r, fr_cuda_ipc *out);
/* Unlists a region (by id, or by its data pointer when id == 0) and drops the table's ref;
 * a shared region's header is marked freed first. */
int fr_region_remove(fr_region_table *t, uint64_t id, const void *data);

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
