/*
 * The refit receiver's CUDA destinations: where a bound destination lives (its device, checked
 * to fit its allocation, once, when bound), the stage a bucket passes through (page-aligned so
 * that it can be pinned, and pinned in a device's context once a destination is device memory),
 * and the host→device copies out of it: a shard run's device found among the device targets'
 * sorted ranges, and runs that continue one another merged into one copy. Shared with the
 * receiver's other files through receiver_impl.h.
 */
#include "refit/receiver_impl.h"

#include <stdlib.h>
#include <string.h>

/* Where a destination of `bytes` lives: its CUDA device, or -1 for host memory. FERRY_EINVAL
 * when device memory does not hold all of it (the copies are bounded by the allocation). Not
 * under a lock: the first call may load the driver. */
int fr_refit_rx_where_bound(const char *name, const void *dst, const ferry_tensor_desc *desc,
                            int *device) {
  fr_mem_where w = fr_cuda_where(dst);
  *device = w.kind == FERRY_MEM_CUDA ? w.device : -1;
  uint64_t bytes = 0;
  if (*device < 0 || ferry_tensor_nbytes(desc, &bytes) != 0)
    return 0; /* a bad desc is reported with the binding's other checks */
  if (bytes > fr_cuda_room(&w, dst))
    return fr_err(FERRY_EINVAL,
                  "refit: '%s' (%llu bytes) runs past the end of its CUDA allocation on device %d",
                  name, (unsigned long long)bytes, *device);
  return 0;
}

/* The flat buffer and alias mode hold every tensor themselves: a device destination beside
 * them would never be written. */
int fr_refit_rx_host_only(const ferry_refit_receiver *r, const char *name) {
  return fr_err(FERRY_ENOTSUP,
                "refit: '%s' is CUDA memory, but this receiver is bound to %s, which holds every "
                "tensor itself; bind device tensors with ferry_refit_bind alone (or use the "
                "alias views: device memory when the sender keeps its buffer on a device)",
                name,
                r->flat ? "a flat buffer (ferry_refit_bind_flat)" : "the sender's buffer (alias)");
}

/* The stage a bucket passes through: page-aligned and page-sized, so that it can be pinned. */
static uint64_t stage_bytes(uint64_t bucket) { return (bucket + 4095) & ~(uint64_t)4095; }
uint8_t *fr_refit_rx_stage_alloc(uint64_t bucket) {
  return aligned_alloc(4096, stage_bytes(bucket));
}
void fr_refit_rx_stage_free(uint8_t *stage, int pinned_on) {
  if (pinned_on >= 0)
    fr_cuda_unpin(pinned_on, stage);
  free(stage);
}

/* A device this receiver copies to: a bound tensor's or a shard target's (-1: none). */
static int some_device(const ferry_refit_receiver *r) {
  for (uint32_t i = 0; r->bound_dev && i < r->plan.count; i++)
    if (r->bound_dev[i] >= 0)
      return r->bound_dev[i];
  for (uint32_t i = 0; i < r->ntargets; i++)
    if (r->targets[i].name && r->targets[i].device >= 0)
      return r->targets[i].device;
  return -1;
}

/* Once a destination is device memory the stage is pinned, in that device's context, so that
 * the host→device copies from it run at the copy engine's speed (a failure only costs that).
 * bind_lock held. */
void fr_refit_rx_pin_stage(ferry_refit_receiver *r) {
  int device = some_device(r);
  if (r->stage_pin >= 0 || !r->stage || device < 0)
    return;
  if (fr_cuda_pin(device, r->stage, stage_bytes(r->plan.bucket_bytes)) == 0)
    r->stage_pin = device;
  else
    fr_warn("refit: receive stage not pinned, device copies run slower: %s", ferry_last_error());
}

/* A shard run's destination: the device range (a device target's memory) holding it, or NULL
 * (host memory). */
static const struct dev_range *run_range(const ferry_refit_receiver *r, const uint8_t *dst) {
  size_t lo = 0, hi = r->ndev_ranges;
  uintptr_t a = (uintptr_t)dst;
  while (lo < hi) { /* the ranges are disjoint and sorted: the first that ends past a */
    size_t mid = lo + (hi - lo) / 2;
    if (r->dev_ranges[mid].hi <= a)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < r->ndev_ranges && r->dev_ranges[lo].lo <= a ? &r->dev_ranges[lo] : NULL;
}

int fr_refit_rx_copy_done(rx_copy *c) {
  int rc = c->len ? fr_cuda_copy_on(c->device, c->dst, c->src, c->len) : 0;
  c->len = 0;
  return rc ? fr_err_wrap(rc, "refit: a shard into CUDA device %d", c->device) : 0;
}

int fr_refit_rx_put_run(const ferry_refit_receiver *r, rx_copy *c, uint8_t *dst, const uint8_t *src,
                        uint64_t len) {
  const struct dev_range *range = r->ndev_ranges ? run_range(r, dst) : NULL;
  if (!range) {
    memcpy(dst, src, len);
    return 0;
  }
  if (c->len && c->device == range->device && c->dst + c->len == dst && c->src + c->len == src &&
      (uintptr_t)dst + len <= c->end) {
    c->len += len;
    return 0;
  }
  int rc = fr_refit_rx_copy_done(c);
  *c = (rx_copy){dst, src, len, range->device, range->hi};
  return rc;
}

static int range_cmp(const void *a, const void *b) {
  const struct dev_range *x = a, *y = b;
  return (x->lo > y->lo) - (x->lo < y->lo);
}

/* The device targets' memory, sorted and merged (two targets may share bytes), for run_range.
 * bind_lock held. */
int fr_refit_rx_build_dev_ranges(ferry_refit_receiver *r) {
  free(r->dev_ranges);
  r->dev_ranges = NULL;
  r->ndev_ranges = 0;
  size_t n = 0, k = 0;
  for (uint32_t i = 0; i < r->ntargets; i++)
    n += r->targets[i].name && r->targets[i].device >= 0;
  if (n == 0)
    return 0;
  struct dev_range *v = malloc(n * sizeof *v);
  if (!v)
    return fr_err(FERRY_ENOMEM, "refit: %zu device targets", n);
  n = 0;
  for (uint32_t i = 0; i < r->ntargets; i++) {
    const struct rx_target *t = &r->targets[i];
    uint64_t bytes = 0;
    if (t->name && t->device >= 0 && ferry_tensor_nbytes(&t->desc, &bytes) == 0)
      v[n++] = (struct dev_range){(uintptr_t)t->t.dst, (uintptr_t)t->t.dst + bytes, t->device};
  }
  qsort(v, n, sizeof *v, range_cmp);
  for (size_t i = 0; i < n; i++) {
    if (k && v[i].lo < v[k - 1].hi)
      v[k - 1].hi = v[i].hi > v[k - 1].hi ? v[i].hi : v[k - 1].hi;
    else
      v[k++] = v[i];
  }
  r->dev_ranges = v;
  r->ndev_ranges = k;
  return 0;
}
