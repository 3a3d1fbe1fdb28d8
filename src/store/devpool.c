/*
 * The store's device pool (issue 37): puts from CUDA memory keep their bytes in device memory, so
 * that a get into device memory on the same host is one device-to-device copy instead of a trip
 * through host memory. The pool is one CUDA allocation of this node's
 * (FERRY_STORE_DEVICE_POOL_BYTES, ferry_store_opts.device_pool_bytes; 0: none), made at the first
 * put from device memory on that put's device, registered as a region (ferry_register), and
 * sub-allocated by core/pool.c as the host pool is. Nothing here reaches a peer by itself: a record
 * names the region and an offset, and readers go through their link's region map as for any
 * registered CUDA region (a same-host peer maps the allocation once per link through its CUDA IPC
 * handle and bounds every copy by the registered size; another host's reader is served staged by
 * the owner's server thread; docs/ARCHITECTURE.md 8.2). The generation words stay in the host
 * pool's slots, so readers check them as for any object. The pool is made outside the store's
 * lock (fr_store_devpool_prepare, before a put takes it), tried again after a failure with a
 * backoff; every other call but open and close runs under the store's lock.
 */
#include "store/store.h"

#include <stdio.h>
#include <string.h>

/* cuMemAlloc's alignment: every block starts aligned as the driver's allocations do. */
#define DEVPOOL_GRANULE 256

void fr_store_devpool_open(ferry_store *s, uint64_t bytes) {
  int64_t setting = fr_config_int("FERRY_STORE_DEVICE_POOL_BYTES");
  s->dev.want = bytes ? bytes : setting > 0 ? (uint64_t)setting : 0;
  s->dev.want = s->dev.want / DEVPOOL_GRANULE * DEVPOOL_GRANULE;
  s->dev.device = -1;
  s->dev.make_lock_ok = pthread_mutex_init(&s->dev.make_lock, NULL) == 0;
}

/* The wait before the next try after `failures` failed ones: 1 s, doubled, a minute at most. */
static uint64_t retry_wait_ns(uint32_t failures) {
  uint64_t seconds = failures > 6 ? 60 : 1ull << (failures - 1);
  return seconds * 1000000000ull;
}

/* Allocates and registers the pool on `device` (make_lock held, the store's lock not: a
 * cuMemAlloc), then hands it to the store under its lock. */
static int devpool_make(ferry_store *s, int device) {
  void *mem = NULL;
  fr_pool pool = {0};
  ferry_region_ref ref;
  int rc = fr_cuda_alloc(device, (size_t)s->dev.want, &mem);
  if (rc == 0 && (rc = ferry_register(s->ctx, mem, (size_t)s->dev.want, &ref)) != 0)
    fr_cuda_free(mem);
  if (rc == 0 && (rc = fr_pool_init(&pool, s->dev.want, DEVPOOL_GRANULE)) != 0) {
    ferry_deregister(s->ctx, ref.id);
    fr_cuda_free(mem);
  }
  if (rc != 0) {
    s->dev.failures++;
    uint64_t wait = retry_wait_ns(s->dev.failures);
    s->dev.retry_ns = fr_now_ns() + wait;
    fr_warn("store '%s': no device pool of %llu bytes on CUDA device %d (puts from device memory "
            "go to the host pool; tried again in %llu s): %s",
            s->name, (unsigned long long)s->dev.want, device,
            (unsigned long long)(wait / 1000000000ull), ferry_last_error());
    fr_err_clear();
    return FERRY_ENOTSUP;
  }
  pthread_mutex_lock(&s->lock);
  s->dev.pool = pool;
  s->dev.ref = ref;
  s->dev.device = device;
  __atomic_store_n(&s->dev.mem, (uint8_t *)mem, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&s->lock);
  fr_debug("store '%s': device pool of %llu bytes on CUDA device %d", s->name,
           (unsigned long long)s->dev.want, device);
  return 0;
}

void fr_store_devpool_prepare(ferry_store *s, int device) {
  if (s->dev.want == 0 || !s->dev.make_lock_ok || __atomic_load_n(&s->dev.mem, __ATOMIC_ACQUIRE))
    return;
  pthread_mutex_lock(&s->dev.make_lock);
  if (!__atomic_load_n(&s->dev.mem, __ATOMIC_ACQUIRE) && fr_now_ns() >= s->dev.retry_ns)
    devpool_make(s, device);
  pthread_mutex_unlock(&s->dev.make_lock);
}

int fr_store_devpool_alloc(ferry_store *s, int device, uint64_t bytes, uint64_t *off) {
  if (!s->dev.mem)
    return FERRY_ENOTSUP;
  if (s->dev.device != device) {
    if (!s->dev.other_warned)
      fr_warn("store '%s': a put from CUDA device %d goes to the host pool: the device pool is on "
              "device %d (said once)",
              s->name, device, s->dev.device);
    s->dev.other_warned = true;
    return FERRY_ENOTSUP;
  }
  return fr_pool_alloc(&s->dev.pool, bytes, s->dev.pool.capacity, off);
}

void fr_store_devpool_free(ferry_store *s, uint64_t off, uint64_t bytes) {
  fr_pool_free(&s->dev.pool, off, bytes);
}

void fr_store_devpool_close(ferry_store *s) {
  if (s->dev.make_lock_ok)
    pthread_mutex_destroy(&s->dev.make_lock);
  s->dev.make_lock_ok = false;
  if (!s->dev.mem)
    return;
  /* ferry_deregister returns once no thread of this process copies from it any more (a tcp
   * reader's staged read: core/region.h); should a copy hang, the pool is left allocated */
  if (ferry_deregister(s->ctx, s->dev.ref.id) != 0)
    fr_warn("store '%s': the device pool stays allocated: %s", s->name, ferry_last_error());
  else if (fr_cuda_free(s->dev.mem) != 0)
    fr_warn("store '%s': freeing the device pool: %s", s->name, ferry_last_error());
  fr_pool_fini(&s->dev.pool);
  s->dev.mem = NULL;
}
