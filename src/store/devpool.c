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
 * pool's slots, so readers check them as for any object. Every call but open and close runs under
 * the store's lock.
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
}

/* Allocates and registers the pool on `device` (lock held; a cuMemAlloc, once per store). */
static int devpool_make(ferry_store *s, int device) {
  void *mem = NULL;
  int rc = fr_cuda_alloc(device, (size_t)s->dev.want, &mem);
  if (rc == 0 && (rc = ferry_register(s->ctx, mem, (size_t)s->dev.want, &s->dev.ref)) != 0)
    fr_cuda_free(mem);
  if (rc == 0 && (rc = fr_pool_init(&s->dev.pool, s->dev.want, DEVPOOL_GRANULE)) != 0) {
    ferry_deregister(s->ctx, s->dev.ref.id);
    fr_cuda_free(mem);
  }
  if (rc != 0) {
    fr_warn("store '%s': no device pool of %llu bytes on CUDA device %d (puts from device memory "
            "go to the host pool): %s",
            s->name, (unsigned long long)s->dev.want, device, ferry_last_error());
    fr_err_clear();
    s->dev.failed = true;
    return FERRY_ENOTSUP;
  }
  s->dev.mem = mem;
  s->dev.device = device;
  fr_debug("store '%s': device pool of %llu bytes on CUDA device %d", s->name,
           (unsigned long long)s->dev.want, device);
  return 0;
}

int fr_store_devpool_alloc(ferry_store *s, int device, uint64_t bytes, uint64_t *off) {
  if (s->dev.want == 0 || s->dev.failed || (s->dev.mem && s->dev.device != device))
    return FERRY_ENOTSUP;
  if (!s->dev.mem && devpool_make(s, device) != 0)
    return FERRY_ENOTSUP;
  return fr_pool_alloc(&s->dev.pool, bytes, s->dev.pool.capacity, off);
}

void fr_store_devpool_free(ferry_store *s, uint64_t off, uint64_t bytes) {
  fr_pool_free(&s->dev.pool, off, bytes);
}

void fr_store_devpool_close(ferry_store *s) {
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
