/*
 * Regions and the per-context region table. Shared regions are memfds (never visible in the file
 * system, so nothing leaks when a process is killed, and only a peer we hand the fd to can map
 * them: the equivalent of mode 0600 with no name to guess), or memory a transport provides. Every
 * peer access goes through fr_region_acquire(), which checks key and bounds before a byte moves.
 * A freed memfd region may be kept (the cache, region.h) and taken back by a later allocation as
 * a new region of the same lineage: its pages stay mapped, here and in the peers.
 */
#include "core/region.h"
#include "core/core.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

void fr_region_table_init(fr_region_table *t) {
  memset(t, 0, sizeof *t);
  pthread_mutex_init(&t->lock, NULL);
  t->next_lineage = 1;
}

static void region_destroy(fr_region *r) {
  uint32_t cached = FR_SHM_CACHED; /* gone for good now: peers may unmap it */
  if (r->map)
    __atomic_compare_exchange_n(&((fr_shm_header *)r->map)->state, &cached, FR_SHM_FREED, false,
                                __ATOMIC_RELEASE, __ATOMIC_RELAXED);
  if (r->mem.release)
    r->mem.release(r->mem.handle);
  else if (r->map)
    munmap(r->map, r->map_bytes);
  if (r->memfd >= 0)
    close(r->memfd);
  free(r);
}

void fr_region_release(fr_region *r) {
  if (r && __atomic_sub_fetch(&r->refs, 1, __ATOMIC_ACQ_REL) == 0)
    region_destroy(r);
}

static int table_add(fr_region_table *t, fr_region *r) {
  pthread_mutex_lock(&t->lock);
  if (FR_GROW(t->items, t->cap, t->count + 1, 16) != 0) {
    pthread_mutex_unlock(&t->lock);
    return fr_err(FERRY_ENOMEM, "region table: cannot grow beyond %zu entries", t->cap);
  }
  if (r->lineage == 0)
    r->lineage = t->next_lineage++;
  r->id = r->lineage << FR_REGION_INC_BITS | r->incarnation;
  r->key = fr_random_u64();
  r->refs = 1;
  t->items[t->count++] = r;
  pthread_mutex_unlock(&t->lock);
  return 0;
}

/* Memory the kernel says it can still give (MemAvailable); shared memory is taken from it. */
static uint64_t memory_available(void) {
  FILE *f = fopen("/proc/meminfo", "r");
  unsigned long long kb = 0;
  char line[128];
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1)
      break;
  if (f)
    fclose(f);
  return kb ? (uint64_t)kb * 1024 : UINT64_MAX;
}

/* A memfd of map_bytes, reserved and mapped. */
static int memfd_map(size_t map_bytes, int *fd_out, void **map_out) {
  int fd = memfd_create("ferry-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    return fr_err_errno(FERRY_ESYS, "ferry_alloc: memfd_create");
  fchmod(fd, 0600);
  /* fallocate reserves the pages now, so running out of shared memory is an error here rather
   * than a SIGBUS on first touch. */
  int rc = posix_fallocate(fd, 0, (off_t)map_bytes);
  if (rc != 0) {
    close(fd);
    errno = rc;
    return fr_err_errno(FERRY_ENOSHM, "ferry_alloc: cannot reserve %zu bytes of shared memory",
                        map_bytes - FR_SHM_HEADER_BYTES);
  }
  /* peers map it only sealed (transport/ring.h, fr_shm_segment_check): a memfd that could
   * shrink would let whoever holds it raise SIGBUS in every process that maps it */
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    close(fd);
    return fr_err_errno(FERRY_ESYS, "ferry_alloc: cannot seal the region's memfd");
  }
  void *map = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    close(fd);
    return fr_err_errno(FERRY_ENOSHM, "ferry_alloc: mmap of %zu bytes",
                        map_bytes - FR_SHM_HEADER_BYTES);
  }
  *fd_out = fd;
  *map_out = map;
  return 0;
}

/* The region's memory: the transport's when it gives some, else a memfd. */
static int region_memory(fr_region *r, fr_region_mem_alloc alloc, void *arg) {
  if (alloc) {
    int rc = alloc(arg, r->map_bytes, &r->mem);
    if (rc == 0) {
      r->map = r->mem.addr;
      return 0;
    }
    fr_debug("ferry_alloc: transport memory unavailable (%s); using a memfd", ferry_last_error());
    r->mem = (fr_region_mem){0};
  }
  return memfd_map(r->map_bytes, &r->memfd, &r->map);
}

/* A new region's memory: transport memory or a memfd of map_bytes. */
static int region_new(size_t bytes, size_t map_bytes, fr_region_mem_alloc alloc, void *arg,
                      fr_region **out) {
  /* Reserving more than the machine has would wake the OOM killer, not return an error. */
  uint64_t avail = memory_available();
  if (bytes > avail)
    return fr_err(FERRY_ENOSHM,
                  "ferry_alloc: cannot reserve %zu bytes of shared memory: %llu available", bytes,
                  (unsigned long long)avail);
  fr_region *r = calloc(1, sizeof *r);
  if (!r)
    return fr_err(FERRY_ENOMEM, "ferry_alloc: region record");
  r->memfd = -1;
  r->map_bytes = map_bytes;
  int rc = region_memory(r, alloc, arg);
  if (rc != 0) {
    free(r);
    return rc;
  }
  r->data = (uint8_t *)r->map + FR_SHM_HEADER_BYTES;
  r->size = bytes;
  *out = r;
  return 0;
}

/* Writes the header of a new region, or of a cached memfd taken back as a new region: the id
 * first, then ALIVE, then a full fence, so that a peer that still maps it as the region it was
 * sees the new id (and fails its access) before any of the new bytes. */
static void header_publish(fr_region *r) {
  fr_shm_header *h = r->map;
  h->magic = FR_SHM_MAGIC;
  h->layout_version = FR_SHM_LAYOUT_VERSION;
  h->header_bytes = FR_SHM_HEADER_BYTES;
  __atomic_store_n(&h->region_id, r->id, __ATOMIC_RELAXED); /* a reused header: peers read */
  __atomic_store_n(&h->region_key, r->key, __ATOMIC_RELAXED);
  __atomic_store_n(&h->data_bytes, r->size, __ATOMIC_RELAXED);
  __atomic_store_n(&h->state, FR_SHM_ALIVE, __ATOMIC_RELEASE);
  FR_FENCE(__ATOMIC_SEQ_CST);
}

/* The cached memfd region that fits `bytes` best: its data at least that long and at most an
 * eighth longer (so a cache of one size does not hold memory for much smaller requests), and
 * nobody but the cache holds it (a thread that served it when it was freed may still be copying
 * its bytes; a cached region is unlisted, so nobody takes a new reference). Taken out of the
 * cache; lock held. */
static fr_region *cache_take(fr_region_cache *c, size_t map_bytes) {
  size_t best = c->count;
  for (size_t i = 0; i < c->count; i++) {
    size_t have = c->items[i]->map_bytes;
    if (have >= map_bytes && have - map_bytes <= map_bytes / 8 &&
        __atomic_load_n(&c->items[i]->refs, __ATOMIC_ACQUIRE) == 1 &&
        (best == c->count || have < c->items[best]->map_bytes))
      best = i;
  }
  if (best == c->count)
    return NULL;
  fr_region *r = c->items[best];
  memmove(&c->items[best], &c->items[best + 1], (c->count - best - 1) * sizeof *c->items);
  c->count--;
  c->bytes -= r->map_bytes;
  return r;
}

/* A cached region as a new one: new id and key (the table's lock held). */
static fr_region *reuse_cached(fr_region_table *t, size_t bytes, size_t map_bytes) {
  pthread_mutex_lock(&t->lock);
  fr_region *r = cache_take(&t->cache, map_bytes);
  pthread_mutex_unlock(&t->lock);
  if (r) {
    r->size = bytes;
    r->incarnation++;
  }
  return r;
}

int fr_region_alloc_shared(fr_region_table *t, size_t bytes, bool uninit, fr_region_mem_alloc alloc,
                           void *arg, fr_region **out) {
  if (bytes == 0)
    return fr_err(FERRY_EINVAL, "ferry_alloc: zero bytes");
  size_t map_bytes;
  if (__builtin_add_overflow(bytes, (size_t)FR_SHM_HEADER_BYTES, &map_bytes) ||
      map_bytes > (size_t)INT64_MAX)
    return fr_err(FERRY_EOVERFLOW, "ferry_alloc: %zu bytes is too large", bytes);
  fr_region *r = reuse_cached(t, bytes, map_bytes);
  if (r) {
    if (!uninit)
      memset(r->data, 0, bytes);
  } else {
    int rc = region_new(bytes, map_bytes, alloc, arg, &r);
    if (rc != 0)
      return rc;
  }
  int rc = table_add(t, r);
  if (rc != 0) {
    region_destroy(r);
    return rc;
  }
  header_publish(r);
  *out = r;
  return 0;
}

int fr_region_add_registered(fr_region_table *t, void *ptr, size_t len, fr_region **out) {
  if (!ptr || len == 0)
    return fr_err(FERRY_EINVAL, "ferry_register: empty memory range");
  if ((uintptr_t)ptr + len < (uintptr_t)ptr)
    return fr_err(FERRY_EOVERFLOW, "ferry_register: range wraps the address space");
  fr_mem_where w = fr_cuda_where(ptr);
  if (len > fr_cuda_room(&w, ptr))
    return fr_err(FERRY_ERANGE, "ferry_register: [%p, +%zu) runs past its CUDA allocation's end",
                  ptr, len);
  fr_region *r = calloc(1, sizeof *r);
  if (!r)
    return fr_err(FERRY_ENOMEM, "ferry_register: region record");
  r->memfd = -1;
  r->data = ptr;
  r->size = len;
  r->kind = w.kind;
  r->device = w.device;
  int rc = table_add(t, r);
  if (rc != 0) {
    free(r);
    return rc;
  }
  *out = r;
  return 0;
}

int fr_region_cuda_ipc(fr_region_table *t, fr_region *r, fr_cuda_ipc *out) {
  if (r->kind != FERRY_MEM_CUDA)
    return fr_err(FERRY_EINVAL, "region %llu is host memory", (unsigned long long)r->id);
  pthread_mutex_lock(&t->lock);
  int rc = r->ipc_ready ? 0 : fr_cuda_ipc_export(r->data, &r->ipc);
  r->ipc_ready = rc == 0;
  if (rc == 0)
    *out = r->ipc;
  pthread_mutex_unlock(&t->lock);
  return rc;
}

static ssize_t table_index(fr_region_table *t, uint64_t id, const void *data) {
  for (size_t i = 0; i < t->count; i++)
    if (id ? t->items[i]->id == id : t->items[i]->data == data)
      return (ssize_t)i;
  return -1;
}

/* Keeps a freed memfd region for reuse when the cache has room for it (dropping its oldest
 * items for it); returns whether it did. The cache takes over the table's reference: a region
 * that a serving thread still holds is kept too, and taken back only once that thread let go
 * (cache_take), so a free racing a read's last step still caches it. Lock held. */
static bool cache_keep(fr_region_table *t, fr_region *r) {
  uint64_t limit = (uint64_t)fr_config_int("FERRY_ALLOC_CACHE_BYTES");
  if (r->memfd < 0 || r->mem.release || r->map_bytes > limit || r->incarnation == FR_REGION_INC_MAX)
    return false;
  fr_region_cache *c = &t->cache;
  if (FR_GROW(c->items, c->cap, c->count + 1, 8) != 0)
    return false;
  while (c->count > 0 && c->bytes + r->map_bytes > limit) {
    fr_region *oldest = c->items[0];
    c->bytes -= oldest->map_bytes;
    memmove(&c->items[0], &c->items[1], --c->count * sizeof *c->items);
    fr_region_release(oldest); /* the cache's reference: a holder's release destroys it */
  }
  c->items[c->count++] = r;
  c->bytes += r->map_bytes;
  __atomic_store_n(&((fr_shm_header *)r->map)->state, FR_SHM_CACHED, __ATOMIC_RELEASE);
  return true;
}

void (*fr_region_test_draining)(const fr_region *r);
void (*fr_region_test_serving)(const fr_region *r);
void (*fr_region_test_copying)(const fr_region *r);
void (*fr_region_test_receiving)(const fr_region *r);

/* Wakes a deregistration waiting for the last use of a region's bytes to end (wait_uses). */
static pthread_mutex_t drain_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t drain_cond; /* CLOCK_MONOTONIC deadlines (drain_init) */
static pthread_once_t drain_once = PTHREAD_ONCE_INIT;
static void drain_init(void) { fr_cond_init_monotonic(&drain_cond); }

bool fr_region_use_begin(fr_region *r) {
  if (!fr_region_is_registered(r))
    return true;
  uint32_t now = __atomic_load_n(&r->users, __ATOMIC_RELAXED);
  do
    if (now & FR_REGION_GONE) {
      fr_err(FERRY_ENOTFOUND, "region %llu was deregistered", (unsigned long long)r->id);
      return false;
    }
  while (!__atomic_compare_exchange_n(&r->users, &now, now + 1, true, __ATOMIC_ACQUIRE,
                                      __ATOMIC_RELAXED));
  return true;
}

void fr_region_use_end(fr_region *r) {
  if (!fr_region_is_registered(r))
    return;
  if (__atomic_sub_fetch(&r->users, 1, __ATOMIC_RELEASE) == FR_REGION_GONE) {
    pthread_mutex_lock(&drain_lock); /* the waiter checks under it: no wake-up is lost */
    pthread_cond_broadcast(&drain_cond);
    pthread_mutex_unlock(&drain_lock);
  }
}

/* Marks registered memory gone (no use begins any more) and waits for the uses on to end. */
static int wait_uses(fr_region *r, uint64_t deadline_ns) {
  pthread_once(&drain_once, drain_init); /* before GONE: a use_end broadcasts only after it */
  if (__atomic_fetch_or(&r->users, FR_REGION_GONE, __ATOMIC_ACQ_REL) == 0)
    return 0;
  if (fr_region_test_draining)
    fr_region_test_draining(r);
  struct timespec until = fr_timespec(deadline_ns);
  int rc = 0;
  pthread_mutex_lock(&drain_lock);
  while (rc == 0 && __atomic_load_n(&r->users, __ATOMIC_ACQUIRE) != FR_REGION_GONE)
    rc = pthread_cond_timedwait(&drain_cond, &drain_lock, &until);
  pthread_mutex_unlock(&drain_lock);
  if (__atomic_load_n(&r->users, __ATOMIC_ACQUIRE) == FR_REGION_GONE)
    return 0;
  fr_warn("region %llu: a copy of its bytes still runs %d ms after its deregistration began; "
          "its memory must not be freed",
          (unsigned long long)r->id, FR_REGION_DRAIN_MS);
  return fr_err(FERRY_ETIMEDOUT,
                "region %llu deregistered, but a copy of its bytes still runs: do not free them",
                (unsigned long long)r->id);
}

/* Marks registered memory gone (no use begins any more) and waits for the uses on to end, then
 * for the device copies they queued (fr_cuda_gate: none is queued after). */
static int drain_uses(fr_region *r) {
  uint64_t deadline = fr_now_ns() + FR_REGION_DRAIN_MS * 1000000ull;
  int rc = wait_uses(r, deadline);
  if (rc == 0 && r->copy_event) {
    rc = fr_cuda_gate_event_finish(r->device, r->copy_event, deadline);
    if (rc == 0)
      r->copy_event = NULL;
    else
      fr_warn("region %llu: a device copy from it still runs %d ms after its deregistration "
              "began; its memory must not be freed",
              (unsigned long long)r->id, FR_REGION_DRAIN_MS);
    if (rc != 0)
      rc = fr_err(FERRY_ETIMEDOUT,
                  "region %llu deregistered, but a device copy from it still runs %d ms later: "
                  "do not free its memory",
                  (unsigned long long)r->id, FR_REGION_DRAIN_MS);
  }
  return rc;
}

int fr_region_remove(fr_region_table *t, uint64_t id, const void *data) {
  pthread_mutex_lock(&t->lock);
  ssize_t i = table_index(t, id, data);
  if (i < 0) {
    pthread_mutex_unlock(&t->lock);
    return id ? fr_err(FERRY_ENOTFOUND, "no region %llu", (unsigned long long)id)
              : fr_err(FERRY_ENOTFOUND, "%p is not memory from ferry_alloc", data);
  }
  fr_region *r = t->items[i];
  t->items[i] = t->items[--t->count];
  uint32_t alive = FR_SHM_ALIVE; /* CLOSED stays */
  if (r->map)
    __atomic_compare_exchange_n(&((fr_shm_header *)r->map)->state, &alive, FR_SHM_FREED, false,
                                __ATOMIC_RELEASE, __ATOMIC_RELAXED);
  bool kept = alive == FR_SHM_ALIVE && cache_keep(t, r);
  /* decided under the lock: once a kept region's lock is let go, the cache may free it */
  bool registered = fr_region_is_registered(r);
  pthread_mutex_unlock(&t->lock);
  int rc = registered ? drain_uses(r) : 0; /* registered: never kept, the table's ref is ours */
  if (!kept)
    fr_region_release(r);
  return rc;
}

int fr_region_acquire(fr_region_table *t, uint64_t id, uint64_t key, uint64_t off, uint64_t len,
                      fr_region **out) {
  pthread_mutex_lock(&t->lock);
  ssize_t i = table_index(t, id, NULL);
  if (i < 0 || id == 0) {
    pthread_mutex_unlock(&t->lock);
    return fr_err(FERRY_ENOTFOUND, "no region %llu", (unsigned long long)id);
  }
  fr_region *r = t->items[i];
  int rc = 0;
  if (r->key != key)
    rc = fr_err(FERRY_EACCES, "region %llu: wrong access key", (unsigned long long)id);
  else if (!fr_range_ok(off, len, r->size))
    rc = fr_err(FERRY_ERANGE, "region %llu: bytes [%llu, +%llu) outside its %llu bytes",
                (unsigned long long)id, (unsigned long long)off, (unsigned long long)len,
                (unsigned long long)r->size);
  else
    __atomic_add_fetch(&r->refs, 1, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&t->lock);
  if (rc == 0)
    *out = r;
  return rc;
}

int fr_region_find(fr_region_table *t, const void *ptr, size_t len, fr_region **out) {
  uintptr_t p = (uintptr_t)ptr;
  pthread_mutex_lock(&t->lock);
  for (size_t i = 0; i < t->count; i++) {
    fr_region *r = t->items[i];
    uintptr_t base = (uintptr_t)r->data;
    if (p >= base && fr_range_ok(p - base, len, r->size)) {
      __atomic_add_fetch(&r->refs, 1, __ATOMIC_RELAXED);
      pthread_mutex_unlock(&t->lock);
      *out = r;
      return 0;
    }
  }
  pthread_mutex_unlock(&t->lock);
  return fr_err(FERRY_ENOTFOUND, "[%p, +%zu) is not inside a ferry region", ptr, len);
}

void fr_region_table_fini(fr_region_table *t) {
  for (size_t i = 0; i < t->count; i++)
    if (t->items[i]->map)
      __atomic_store_n(&((fr_shm_header *)t->items[i]->map)->state, FR_SHM_CLOSED,
                       __ATOMIC_RELEASE);
  while (t->count > 0)
    fr_region_remove(t, t->items[t->count - 1]->id, NULL);
  for (size_t i = 0; i < t->cache.count; i++)
    fr_region_release(t->cache.items[i]); /* a thread may still hold one */
  free(t->cache.items);
  free(t->items);
  pthread_mutex_destroy(&t->lock);
}
