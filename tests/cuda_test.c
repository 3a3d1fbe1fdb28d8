/*
 * The CUDA driver as ferry loads it (src/core/cuda.c): finding it or saying why not, pointer
 * kinds, copies in every direction, IPC handles opened by another process, and a process's
 * registered CUDA memory read and written by its peers: over shm through IPC, over tcp staged
 * through host memory in chunks, into host or CUDA buffers. Runs against the in-tree stand-in
 * driver, or the real one under FERRY_TEST_CUDA=driver (tu_cuda_use); device bytes are only ever
 * reached through ferry_mem_copy, as on a GPU.
 */
// ferry-test: cuda
#include "testutil.h"

#include "core/core.h"
#include "core/cuda.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static bool have_cuda;

static int group_setup(void **state) {
  (void)state;
  have_cuda = tu_cuda_use();
  return 0;
}

#define NEED_CUDA()                                                                                \
  do {                                                                                             \
    if (!have_cuda)                                                                                \
      skip();                                                                                      \
  } while (0)

static void fill(uint8_t *p, size_t n, uint8_t seed) {
  for (size_t i = 0; i < n; i++)
    p[i] = (uint8_t)(seed + i * 7);
}

static void test_info(void **state) {
  NEED_CUDA();
  ferry_cuda_info ci = {.size = sizeof ci};
  assert_int_equal(ferry_cuda_info_get(&ci), 0);
  assert_int_equal(ci.found, 1);
  assert_true(ci.devices >= 1);
  assert_true(ci.driver_version > 0);
  assert_string_equal(ci.detail, "");
  char name[128] = "";
  uint64_t total = 0;
  assert_int_equal(ferry_cuda_device(0, name, sizeof name, &total), 0);
  assert_true(strlen(name) > 0);
  assert_true(total > 0);
  assert_int_equal(ferry_cuda_device(ci.devices, name, sizeof name, &total), FERRY_ERANGE);
  ferry_cuda_info small = {.size = 8};
  assert_int_equal(ferry_cuda_info_get(&small), FERRY_EINVAL);
}

static void test_kinds_and_copies(void **state) {
  NEED_CUDA();
  const size_t n = 1 << 20;
  uint8_t *host = malloc(n), *back = malloc(n);
  void *dev = NULL, *dev2 = NULL;
  assert_int_equal(ferry_cuda_alloc(0, n, &dev), 0);
  assert_int_equal(ferry_cuda_alloc(0, n, &dev2), 0);
  int device = 7;
  assert_int_equal(ferry_mem_where(host, &device), FERRY_MEM_HOST);
  assert_int_equal(device, -1);
  assert_int_equal(ferry_mem_where((uint8_t *)dev + 4096, &device), FERRY_MEM_CUDA);
  assert_int_equal(device, 0);
  fr_mem_where w = fr_cuda_where((uint8_t *)dev + 4096);
  assert_int_equal(w.base, (uintptr_t)dev);
  assert_true(w.size >= n);

  fill(host, n, 3);
  assert_int_equal(ferry_mem_copy(dev, host, n), 0);                     /* host to device */
  assert_int_equal(ferry_mem_copy(dev2, dev, n), 0);                     /* device to device */
  assert_int_equal(ferry_mem_copy(back, (uint8_t *)dev2 + 1, n - 1), 0); /* device to host */
  assert_memory_equal(back, host + 1, n - 1);
  memset(back, 0, n);
  assert_int_equal(ferry_mem_copy(back, host, n), 0); /* both host: a memcpy */
  assert_memory_equal(back, host, n);
  assert_int_equal(ferry_mem_copy(back, dev, 0), 0);

  assert_int_equal(ferry_cuda_free(dev), 0);
  assert_int_equal(ferry_cuda_free(dev2), 0);
  assert_int_equal(ferry_cuda_free(host), FERRY_EINVAL);
  assert_int_equal(ferry_cuda_alloc(-1, 16, &dev), FERRY_ERANGE);
  free(host);
  free(back);
}

/* A copy beyond the allocation is the driver's error, reported, not a crash. Only against the
 * stand-in: a real GPU may take it as an illegal address, which spoils the context for the
 * rest of the run. */
static void test_copy_out_of_range(void **state) {
  NEED_CUDA();
  const char *mode = getenv("FERRY_TEST_CUDA");
  if (mode && strcmp(mode, "driver") == 0)
    skip();
  void *dev = NULL;
  uint8_t host[64] = {0};
  assert_int_equal(ferry_cuda_alloc(0, 4096, &dev), 0);
  fr_mem_where w = fr_cuda_where(dev);
  int rc = ferry_mem_copy(host, (uint8_t *)dev + w.size - 16, sizeof host);
  assert_int_equal(rc, FERRY_EDEVICE);
  assert_non_null(strstr(ferry_last_error(), "cuMemcpyAsync"));
  assert_int_equal(ferry_cuda_free(dev), 0);
}

/* Pinning ferry's own host memory, and pinning it twice is the driver's refusal. */
static void test_pin(void **state) {
  NEED_CUDA();
  size_t n = 1 << 16;
  void *p = aligned_alloc(4096, n);
  assert_int_equal(fr_cuda_pin(0, p, n), 0);
  assert_int_equal(fr_cuda_pin(0, p, n), FERRY_EDEVICE);
  assert_int_equal(fr_cuda_unpin(0, p), 0);
  assert_int_equal(fr_cuda_unpin(0, p), FERRY_EDEVICE);
  assert_int_equal(fr_cuda_pin(-1, p, n), FERRY_ERANGE); /* no such device */
  free(p);
}

/* Two allocations that lie end to end are still two: the real driver refuses a copy that runs
 * from one into the next (CUDA_ERROR_INVALID_VALUE; 088e316 merged such copies and failed on an
 * H200), and the stand-in hands out addresses end to end as the driver does, and refuses it too.
 * Whether the driver placed them so is its choice: the refusal is checked when it did. */
static void test_copy_across_allocations(void **state) {
  NEED_CUDA();
  size_t n = 1 << 20; /* a multiple of 256 bytes: end to end in the stand-in */
  uint8_t *a = NULL, *b = NULL, *src = NULL;
  assert_int_equal(ferry_cuda_alloc(0, n, (void **)&a), 0);
  assert_int_equal(ferry_cuda_alloc(0, n, (void **)&b), 0);
  assert_int_equal(ferry_cuda_alloc(0, 2 * n, (void **)&src), 0);
  if (!getenv("FERRY_TEST_CUDA") || strcmp(getenv("FERRY_TEST_CUDA"), "driver") != 0)
    assert_ptr_equal(b, a + n); /* the stand-in: ascending, end to end */
  assert_int_equal(fr_cuda_copy_on(0, a, src, n), 0);
  assert_int_equal(fr_cuda_copy_on(0, b, src + n, n), 0);
  if (b == a + n)
    assert_int_equal(fr_cuda_copy_on(0, a, src, 2 * n), FERRY_EDEVICE);
  ferry_cuda_free(src);
  ferry_cuda_free(b);
  ferry_cuda_free(a);
}

static void to_hex(const void *p, size_t n, char *out) {
  for (size_t i = 0; i < n; i++)
    sprintf(out + 2 * i, "%02x", ((const uint8_t *)p)[i]);
}

static int from_hex(const char *s, void *p, size_t n) {
  if (strlen(s) != 2 * n)
    return -1;
  for (size_t i = 0; i < n; i++) {
    unsigned v;
    if (sscanf(s + 2 * i, "%2x", &v) != 1)
      return -1;
    ((uint8_t *)p)[i] = (uint8_t)v;
  }
  return 0;
}

/* The other process of test_ipc: opens the handle, checks the parent's pattern, writes its own
 * and exits 0, or exits with the step that failed. */
static int ipc_child(const char *hex) {
  fr_cuda_ipc h;
  if (from_hex(hex, &h, sizeof h) != 0)
    return 10;
  void *base = NULL;
  if (fr_cuda_ipc_open(&h, -1, &base) != 0) {
    fprintf(stderr, "ipc child: %s\n", ferry_last_error());
    return 11;
  }
  size_t n = 1 << 16;
  uint8_t *want = malloc(n), *got = malloc(n);
  fill(want, n, 42);
  if (ferry_mem_copy(got, (uint8_t *)base + h.offset, n) != 0 || memcmp(got, want, n) != 0)
    return 12;
  fill(want, n, 99);
  if (ferry_mem_copy((uint8_t *)base + h.offset, want, n) != 0)
    return 13;
  fr_cuda_ipc h2 = h; /* a handle whose size claim exceeds the mapping is refused (EPROTO; a
                       * driver that does not open a handle twice refuses it earlier) */
  h2.alloc_bytes = h.alloc_bytes * 4;
  void *again = NULL;
  int rc = fr_cuda_ipc_open(&h2, -1, &again);
  if (rc != FERRY_EPROTO && rc != FERRY_EDEVICE)
    return 14;
  if (fr_cuda_ipc_close(base) != 0)
    return 15;
  return 0;
}

static void test_ipc(void **state) {
  NEED_CUDA();
  size_t n = 1 << 16, alloc = 1 << 20;
  void *dev = NULL;
  assert_int_equal(ferry_cuda_alloc(0, alloc, &dev), 0);
  uint8_t *host = malloc(n);
  fill(host, n, 42);
  uint8_t *at = (uint8_t *)dev + 8192;
  assert_int_equal(ferry_mem_copy(at, host, n), 0);
  fr_cuda_ipc h;
  assert_int_equal(fr_cuda_ipc_export(at, &h), 0);
  assert_int_equal(h.offset, 8192);
  assert_int_equal(h.device, 0);
  assert_true(h.alloc_bytes >= alloc);
  void *self = NULL; /* this process's own handle: the driver refuses it */
  assert_int_equal(fr_cuda_ipc_open(&h, -1, &self), FERRY_EDEVICE);
  assert_int_equal(fr_cuda_ipc_export(host, &h), FERRY_EINVAL);
  assert_int_equal(fr_cuda_ipc_export(at, &h), 0);

  char hex[2 * sizeof h + 1];
  to_hex(&h, sizeof h, hex);
  pid_t pid = tu_fork();
  if (pid == 0) {
    execl("/proc/self/exe", "cuda_test", "ipc-child", hex, (char *)NULL);
    _exit(127);
  }
  int status = 0;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
  uint8_t *want = malloc(n);
  fill(want, n, 99);
  assert_int_equal(ferry_mem_copy(host, at, n), 0);
  assert_memory_equal(host, want, n);
  assert_int_equal(ferry_cuda_free(dev), 0);
  free(host);
  free(want);
}

/* ---- a peer's CUDA region over links ---- */

#define REGION_BYTES (3u << 20) /* several staging chunks at the chunk size the owner is given */

typedef struct owner_info {
  char address[512];
  ferry_region_ref ref;
} owner_info;

/* The other process: registers CUDA memory holding fill(.., 5) and serves it until its stdin
 * closes. */
static int device_owner(void) {
  ferry_ctx_opts o = {.size = sizeof o, .name = "cuda-owner", .transports = "shm,tcp"};
  ferry_ctx *ctx = NULL;
  void *dev = NULL;
  uint8_t *host = malloc(REGION_BYTES);
  owner_info info = {0};
  fill(host, REGION_BYTES, 5);
  if (ferry_ctx_open(&o, &ctx) != 0 || ferry_cuda_alloc(0, REGION_BYTES + 4096, &dev) != 0 ||
      ferry_mem_copy((uint8_t *)dev + 4096, host, REGION_BYTES) != 0 ||
      ferry_register(ctx, (uint8_t *)dev + 4096, REGION_BYTES, &info.ref) != 0) {
    fprintf(stderr, "device owner: %s\n", ferry_last_error());
    return 1;
  }
  snprintf(info.address, sizeof info.address, "%s", ferry_ctx_address(ctx));
  if (write(1, &info, sizeof info) != (ssize_t)sizeof info)
    return 2;
  char c;
  while (read(0, &c, 1) > 0)
    ;
  ferry_ctx_close(ctx);
  return 0;
}

typedef struct owner_proc {
  pid_t pid;
  int to, from;
  owner_info info;
} owner_proc;

static void owner_start(owner_proc *p) {
  int in[2], out[2];
  assert_int_equal(pipe2(in, O_CLOEXEC), 0); /* the owner keeps no write end of its stdin */
  assert_int_equal(pipe2(out, O_CLOEXEC), 0);
  p->pid = tu_fork();
  if (p->pid == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    setenv("FERRY_CUDA_CHUNK_BYTES", "262144", 1); /* many chunks: the double buffering runs */
    execl("/proc/self/exe", "cuda_test", "device-owner", (char *)NULL);
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  p->to = in[1];
  p->from = out[0];
  assert_int_equal(read(p->from, &p->info, sizeof p->info), (ssize_t)sizeof p->info);
}

static void owner_stop(owner_proc *p) {
  close(p->to);
  int status = 0;
  assert_int_equal(waitpid(p->pid, &status, 0), p->pid);
  close(p->from);
  assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* Reads and writes of the owner's CUDA region over one transport, into host and CUDA buffers. */
static void region_over(const owner_proc *p, const char *transports) {
  ferry_ctx_opts o = {.size = sizeof o, .name = "cuda-reader", .transports = transports};
  ferry_ctx *ctx = NULL;
  ferry_link *l = NULL;
  assert_int_equal(ferry_ctx_open(&o, &ctx), 0);
  assert_int_equal(ferry_connect(ctx, p->info.address, 5000, &l), 0);
  bool shm = strcmp(ferry_link_transport(l), "shm") == 0;
  int rc;
  size_t n = REGION_BYTES;
  uint8_t *want = malloc(n), *got = malloc(n);
  void *dev = NULL;
  assert_int_equal(ferry_cuda_alloc(0, n, &dev), 0);
  fill(want, n, 5);

  memset(got, 0, n); /* into host memory, whole and a piece */
  assert_int_equal(ferry_read(l, &p->info.ref, 0, got, n, 5000), 0);
  assert_memory_equal(got, want, n);
  assert_int_equal(ferry_read(l, &p->info.ref, 12345, got, 1000, 5000), 0);
  assert_memory_equal(got, want + 12345, 1000);

  assert_int_equal(ferry_read(l, &p->info.ref, 0, dev, n, 5000), 0); /* into CUDA memory */
  memset(got, 0, n);
  assert_int_equal(ferry_mem_copy(got, dev, n), 0);
  assert_memory_equal(got, want, n);

  ferry_read_run runs[2] = {{.offset = 7, .len = 100}, {.offset = n - 300, .len = 300}};
  assert_int_equal(ferry_readv(l, &p->info.ref, runs, 2, dev, 5000), 0);
  assert_int_equal(ferry_mem_copy(got, dev, 400), 0);
  assert_memory_equal(got, want + 7, 100);
  assert_memory_equal(got + 100, want + n - 300, 300);

  assert_int_equal(ferry_read(l, &p->info.ref, n - 10, got, 11, 5000), FERRY_ERANGE);
  const void *view = NULL; /* never a CPU view; over shm a device address of the IPC mapping */
  assert_int_equal(ferry_view(l, &p->info.ref, 64, 16, &view), FERRY_ENOTSUP);
  rc = ferry_view_device(l, &p->info.ref, 64, 16, &view);
  if (shm) {
    assert_int_equal(rc, 0);
    int device = -1;
    assert_int_equal(ferry_mem_where(view, &device), FERRY_MEM_CUDA);
    assert_int_equal(ferry_mem_copy(got, view, 16), 0);
    assert_memory_equal(got, want + 64, 16);
  } else {
    assert_int_equal(rc, FERRY_ENOTSUP);
  }

  /* Writes: over shm through the IPC mapping, from host and from CUDA memory; over tcp the
   * owner refuses to receive a stream into device memory. */
  uint8_t patch[4096];
  fill(patch, sizeof patch, 77);
  rc = ferry_write(l, &p->info.ref, 4096, patch, sizeof patch, 5000);
  if (shm) {
    assert_int_equal(rc, 0);
    assert_int_equal(ferry_mem_copy(dev, patch, sizeof patch), 0);
    assert_int_equal(ferry_write(l, &p->info.ref, 3 * 4096, dev, sizeof patch, 5000), 0);
    assert_int_equal(ferry_read(l, &p->info.ref, 0, got, 4 * 4096, 5000), 0);
    assert_memory_equal(got + 4096, patch, sizeof patch);
    assert_memory_equal(got + 3 * 4096, patch, sizeof patch);
    assert_int_equal(ferry_write(l, &p->info.ref, 4096, want + 4096, sizeof patch, 5000), 0);
    assert_int_equal(ferry_write(l, &p->info.ref, 3 * 4096, want + 3 * 4096, sizeof patch, 5000),
                     0);
  } else {
    assert_int_equal(rc, FERRY_ENOTSUP);
    assert_int_equal(ferry_link_status(l), 0); /* refused, and the link goes on */
    assert_int_equal(ferry_read(l, &p->info.ref, 0, got, 64, 5000), 0);
    assert_memory_equal(got, want, 64);
  }
  assert_int_equal(ferry_cuda_free(dev), 0);
  free(want);
  free(got);
  ferry_link_close(l);
  ferry_ctx_close(ctx);
}

static void test_region_over_links(void **state) {
  NEED_CUDA();
  owner_proc p;
  owner_start(&p);
  region_over(&p, "shm");
  region_over(&p, "tcp");
  owner_stop(&p);
}

/* ---- a CUDA buffer over a link without a device path (fr_link_read_bounced, FERRY_CUDA_BOUNCE) */

/* The stand-in's pinning counts (cuStubPinCounts): [0] registrations made, [1] alive now, [2]
 * copies with a pinned host side. False on the real driver, which has none. */
static bool pin_counts(unsigned long long out[3]) {
  const char *lib = getenv("FERRY_CUDA_LIB");
  void *h = lib && *lib ? dlopen(lib, RTLD_NOW | RTLD_NOLOAD) : NULL;
  void (*counts)(unsigned long long *) =
      h ? (void (*)(unsigned long long *))dlsym(h, "cuStubPinCounts") : NULL;
  if (counts)
    counts(out);
  if (h)
    dlclose(h);
  return counts != NULL;
}

typedef struct bounce_run {
  const owner_proc *owner;
  ferry_link *link, *host_link; /* to the owner; to a host region's owner (host, host_ref) */
  ferry_region_ref host_ref;
  uint8_t *host;
  void *dev;
  unsigned long long before[3], after[3]; /* pin counts around the reads */
} bounce_run;

/* Three whole reads of the owner's region into a CUDA buffer, each checked, then a write of the
 * buffer into a host region, on a thread of their own (whose staging buffers, if any, are its
 * own and go with it). */
static void *bounce_reads(void *arg) {
  bounce_run *b = arg;
  uint8_t *want = malloc(REGION_BYTES), *got = malloc(REGION_BYTES);
  fill(want, REGION_BYTES, 5);
  pin_counts(b->before);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(ferry_mem_copy(b->dev, want + 1, 4096), 0); /* stale bytes first */
    assert_int_equal(ferry_read(b->link, &b->owner->info.ref, 0, b->dev, REGION_BYTES, 5000), 0);
    memset(got, 0, REGION_BYTES);
    assert_int_equal(ferry_mem_copy(got, b->dev, REGION_BYTES), 0);
    assert_memory_equal(got, want, REGION_BYTES);
  }
  memset(b->host, 0, REGION_BYTES);
  assert_int_equal(ferry_write(b->host_link, &b->host_ref, 0, b->dev, REGION_BYTES, 5000), 0);
  assert_memory_equal(b->host, want, REGION_BYTES);
  pin_counts(b->after);
  free(want);
  free(got);
  return NULL;
}

/* Over tcp a read into CUDA memory, or a write from it, goes through host memory,
 * FERRY_CUDA_CHUNK_BYTES at a time: by default through the thread's two staging buffers, pinned
 * once (two registrations for three reads and a write) and unpinned when the thread ends, every
 * chunk's copy between them and the device; with FERRY_CUDA_BOUNCE=malloc through a fresh
 * pageable buffer per call (no pinning). Either way the right bytes arrive. */
static void test_bounce_staging(void **state) {
  NEED_CUDA();
  unsigned long long c[3];
  if (!pin_counts(c))
    skip(); /* the real driver: no counts to check */
  owner_proc p;
  owner_start(&p);
  ferry_ctx_opts o = {.size = sizeof o, .name = "cuda-reader", .transports = "tcp"};
  ferry_ctx *ctx = NULL;
  assert_int_equal(ferry_ctx_open(&o, &ctx), 0);
  bounce_run b = {.owner = &p, .host = malloc(REGION_BYTES)};
  assert_int_equal(ferry_connect(ctx, p.info.address, 5000, &b.link), 0);
  ferry_ctx_opts ho = {.size = sizeof ho, .name = "cuda-host-owner", .transports = "tcp"};
  ferry_ctx *host_owner = NULL; /* a host region in this process, written over tcp */
  assert_int_equal(ferry_ctx_open(&ho, &host_owner), 0);
  assert_int_equal(ferry_register(host_owner, b.host, REGION_BYTES, &b.host_ref), 0);
  assert_int_equal(ferry_connect(ctx, ferry_ctx_address(host_owner), 5000, &b.host_link), 0);
  assert_int_equal(ferry_cuda_alloc(0, REGION_BYTES, &b.dev), 0);
  setenv("FERRY_CUDA_CHUNK_BYTES", "262144", 1);                 /* 12 chunks a read */
  const unsigned long long chunks = 4 * (REGION_BYTES / 262144); /* 3 reads, 1 write */
  static const char *modes[] = {"malloc", "pinned"};
  for (int m = 0; m < 2; m++) {
    setenv("FERRY_CUDA_BOUNCE", modes[m], 1);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, bounce_reads, &b), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    unsigned long long end[3];
    pin_counts(end);
    bool pinned = m == 1;
    assert_int_equal(b.after[0] - b.before[0], pinned ? 2 : 0);      /* pinned once, not per call */
    assert_int_equal(b.after[2] - b.before[2], pinned ? chunks : 0); /* every chunk from them */
    assert_int_equal(end[1], b.before[1]); /* unpinned when the thread ended */
  }
  unsetenv("FERRY_CUDA_BOUNCE");
  unsetenv("FERRY_CUDA_CHUNK_BYTES");
  assert_int_equal(ferry_cuda_free(b.dev), 0);
  ferry_link_close(b.link);
  ferry_link_close(b.host_link);
  ferry_ctx_close(ctx);
  ferry_ctx_close(host_owner);
  free(b.host);
  owner_stop(&p);
}

/* `ferry info --json` of a process with the settings given: its "cuda" object. */
static json_t *cli_cuda(const char *env) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "env %s FERRY_DIRECTORY=ferry://127.0.0.1:1 %s info --json", env,
           getenv("FERRY_CLI"));
  FILE *f = popen(cmd, "r");
  assert_non_null(f);
  json_error_t err;
  json_t *all = json_loadf(f, 0, &err);
  pclose(f);
  assert_non_null(all);
  json_t *cuda = json_incref(json_object_get(all, "cuda"));
  json_decref(all);
  assert_non_null(cuda);
  return cuda;
}

/* Without a driver ferry says why, and every pointer is host memory; with one, info lists it. */
static void test_no_driver(void **state) {
  (void)state;
  if (!getenv("FERRY_CLI"))
    skip();
  json_t *c = cli_cuda("FERRY_CUDA=off");
  assert_false(json_is_true(json_object_get(c, "found")));
  assert_string_equal(json_string_value(json_object_get(c, "error")), "FERRY_CUDA=off");
  json_decref(c);
  c = cli_cuda("FERRY_CUDA_LIB=/nonexistent/libcuda.so.1");
  assert_false(json_is_true(json_object_get(c, "found")));
  assert_non_null(strstr(json_string_value(json_object_get(c, "error")), "/nonexistent"));
  json_decref(c);
  c = cli_cuda("FERRY_CUDA_LIB=libc.so.6"); /* a library without the entry points */
  assert_non_null(strstr(json_string_value(json_object_get(c, "error")), "has no cu"));
  json_decref(c);
  if (have_cuda) {
    char env[600];
    snprintf(env, sizeof env, "FERRY_CUDA_LIB=%s",
             getenv("FERRY_CUDA_LIB") ? getenv("FERRY_CUDA_LIB") : "libcuda.so.1");
    c = cli_cuda(env);
    assert_true(json_is_true(json_object_get(c, "found")));
    assert_true(json_array_size(json_object_get(c, "devices")) >= 1);
    json_decref(c);
  }
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "ipc-child") == 0)
    return ipc_child(argv[2]);
  if (argc == 2 && strcmp(argv[1], "device-owner") == 0)
    return device_owner();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_info),
      cmocka_unit_test(test_kinds_and_copies),
      cmocka_unit_test(test_copy_out_of_range),
      cmocka_unit_test(test_pin),
      cmocka_unit_test(test_copy_across_allocations),
      cmocka_unit_test(test_ipc),
      cmocka_unit_test(test_region_over_links),
      cmocka_unit_test(test_bounce_staging),
      cmocka_unit_test(test_no_driver),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, group_setup, NULL);
}
