/*
 * `ferry bench gpu`'s bounce rows (issue 37, item 3): a CUDA buffer read over a link that has no
 * device path (tcp), so its bytes come through host memory a chunk at a time
 * (fr_link_read_bounced). The baseline is FERRY_CUDA_BOUNCE=malloc, the way before session 19 (a
 * pageable buffer malloc'd per read, each chunk read, then copied host to device); the other row
 * is the default, pinned (the reading thread's two staging buffers, pinned once and reused, one
 * chunk's copy under the next chunk's read). Both in this process: an owner context registers the
 * bytes in host memory, a reader context reads them over loopback tcp into device memory, so the
 * rows differ only in how the bytes cross into the device. Each mode's first read is untimed (the
 * pinned mode pins then) and its last is checked. Not yet measured on a device.
 */
#include "bench_gpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BOUNCE_MAX (256ull << 20) /* through loopback tcp: a quarter GiB is plenty */

static ferry_ctx *tcp_ctx(const char *name, int *rc) {
  ferry_ctx_opts o = {.size = sizeof o, .name = name, .transports = "tcp"};
  ferry_ctx *c = NULL;
  if (*rc == 0)
    *rc = ferry_ctx_open(&o, &c);
  return c;
}

/* reps timed whole reads of the region into dev under FERRY_CUDA_BOUNCE=mode (one untimed
 * first), dev cleared before and checked after. */
static int time_reads(ferry_link *l, const ferry_region_ref *ref, void *dev, uint64_t bytes,
                      int reps, const char *mode, bench_samples *b) {
  setenv("FERRY_CUDA_BOUNCE", mode, 1);
  int rc = bench_gpu_fill(dev, bytes, 0);
  for (int i = 0; i <= reps && rc == 0; i++) {
    double t = bench_now();
    rc = ferry_read(l, ref, 0, dev, bytes, 60000);
    if (rc == 0 && i > 0)
      bench_add(b, bench_now() - t);
  }
  if (rc == 0 && !bench_gpu_holds(dev, bytes, 0x5a)) {
    fprintf(stderr, "ferry bench gpu: bounce (%s): the bytes read are wrong\n", mode);
    rc = FERRY_EPROTO;
  }
  return rc;
}

int bench_gpu_bounce(const bench_opts *o, uint64_t bytes, int reps) {
  bytes = bytes < BOUNCE_MAX ? bytes : BOUNCE_MAX;
  const char *was = getenv("FERRY_CUDA_BOUNCE");
  char *saved = was ? strdup(was) : NULL;
  int rc = 0;
  ferry_ctx *owner = tcp_ctx("bench-bounce-owner", &rc);
  ferry_ctx *reader = tcp_ctx("bench-bounce-reader", &rc);
  uint8_t *host = rc == 0 ? malloc(bytes) : NULL;
  void *dev = rc == 0 && host ? bench_gpu_alloc(bytes, &rc) : NULL;
  ferry_region_ref ref;
  ferry_link *l = NULL;
  if (rc == 0 && !host)
    rc = FERRY_ENOMEM;
  if (rc == 0) {
    memset(host, 0x5a, bytes);
    rc = ferry_register(owner, host, bytes, &ref);
  }
  if (rc == 0)
    rc = ferry_connect(reader, ferry_ctx_address(owner), 10000, &l);
  bench_samples by_malloc = {0}, pinned = {0};
  if (rc == 0)
    rc = time_reads(l, &ref, dev, bytes, reps, "malloc", &by_malloc);
  if (rc == 0)
    rc = time_reads(l, &ref, dev, bytes, reps, "pinned", &pinned);
  if (rc == 0) {
    char label[64], sz[32];
    snprintf(label, sizeof label, "bounce-%s", bench_size_name(bytes, sz, sizeof sz));
    bench_row(o, "gpu", label, "ferry-read-malloc", bytes, &by_malloc, true);
    bench_row(o, "gpu", label, "ferry-read-pinned", bytes, &pinned, false);
  } else {
    fprintf(stderr, "ferry bench gpu: bounce: %s: %s\n", ferry_strerror(rc), ferry_last_error());
  }
  if (saved)
    setenv("FERRY_CUDA_BOUNCE", saved, 1);
  else
    unsetenv("FERRY_CUDA_BOUNCE");
  free(saved);
  if (l)
    ferry_link_close(l);
  if (dev)
    ferry_cuda_free(dev);
  ferry_ctx_close(reader);
  ferry_ctx_close(owner);
  free(host);
  bench_free(&by_malloc), bench_free(&pinned);
  return rc;
}
