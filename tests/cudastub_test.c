/*
 * The stand-in CUDA driver (tests/cudastub/cudastub.c), loaded the way ferry loads libcuda: dlopen
 * of the path in FERRY_CUDASTUB, every entry point by its driver symbol name. Checks the rules
 * that make it worth testing against: nothing before cuInit, no memory work without a current
 * context, device memory that faults when host code touches it, ranges checked against their
 * allocation, pointer attributes as the driver reports them, async copies that land only when
 * something synchronizes, IPC handles opened by another process (an exec'd helper mode of this
 * binary, which shares nothing with the parent but the handle), and the per-device memory limit.
 */
// ferry-test: threaded
#include "testutil.h"

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct {
  char reserved[64];
} CUipcMemHandle;

enum {
  OK = 0,
  INVALID_VALUE = 1,
  OUT_OF_MEMORY = 2,
  NOT_INITIALIZED = 3,
  INVALID_DEVICE = 101,
  INVALID_CONTEXT = 201,
  MAP_FAILED_ = 205,
  INVALID_HANDLE = 400,
  NOT_READY = 600,
  ALREADY_REGISTERED = 712,
  NOT_REGISTERED = 713,
};
enum { A_CONTEXT = 1, A_MEMTYPE = 2, A_DEVPTR = 3, A_HOSTPTR = 4, A_ORDINAL = 9 };
enum { A_START = 11, A_SIZE = 12, A_MAPPED = 13, MEM_HOST = 1, MEM_DEVICE = 2 };

/* The settings this binary gives the stub (helper processes inherit them). */
#define DEVICES 3
#define MEM_MB 64

#define ENTRY_POINTS(X)                                                                            \
  X(cuInit, (unsigned))                                                                            \
  X(cuDriverGetVersion, (int *))                                                                   \
  X(cuDeviceGetCount, (int *))                                                                     \
  X(cuDeviceGet, (CUdevice *, int))                                                                \
  X(cuDeviceGetName, (char *, int, CUdevice))                                                      \
  X(cuDeviceTotalMem_v2, (size_t *, CUdevice))                                                     \
  X(cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice))                                             \
  X(cuDevicePrimaryCtxRelease_v2, (CUdevice))                                                      \
  X(cuCtxSetCurrent, (CUcontext))                                                                  \
  X(cuCtxGetCurrent, (CUcontext *))                                                                \
  X(cuCtxGetDevice, (CUdevice *))                                                                  \
  X(cuGetErrorString, (CUresult, const char **))                                                   \
  X(cuGetErrorName, (CUresult, const char **))                                                     \
  X(cuPointerGetAttribute, (void *, int, CUdeviceptr))                                             \
  X(cuMemGetAddressRange_v2, (CUdeviceptr *, size_t *, CUdeviceptr))                               \
  X(cuMemAlloc_v2, (CUdeviceptr *, size_t))                                                        \
  X(cuMemFree_v2, (CUdeviceptr))                                                                   \
  X(cuMemHostRegister_v2, (void *, size_t, unsigned))                                              \
  X(cuMemHostUnregister, (void *))                                                                 \
  X(cuMemcpy, (CUdeviceptr, CUdeviceptr, size_t))                                                  \
  X(cuMemcpyAsync, (CUdeviceptr, CUdeviceptr, size_t, CUstream))                                   \
  X(cuMemcpyHtoD_v2, (CUdeviceptr, const void *, size_t))                                          \
  X(cuMemcpyDtoH_v2, (void *, CUdeviceptr, size_t))                                                \
  X(cuMemcpyDtoD_v2, (CUdeviceptr, CUdeviceptr, size_t))                                           \
  X(cuMemsetD8_v2, (CUdeviceptr, unsigned char, size_t))                                           \
  X(cuStreamCreate, (CUstream *, unsigned))                                                        \
  X(cuStreamDestroy_v2, (CUstream))                                                                \
  X(cuStreamSynchronize, (CUstream))                                                               \
  X(cuEventCreate, (CUevent *, unsigned))                                                          \
  X(cuEventRecord, (CUevent, CUstream))                                                            \
  X(cuEventSynchronize, (CUevent))                                                                 \
  X(cuEventQuery, (CUevent))                                                                       \
  X(cuEventDestroy_v2, (CUevent))                                                                  \
  X(cuStreamWaitEvent, (CUstream, CUevent, unsigned))                                              \
  X(cuIpcGetMemHandle, (CUipcMemHandle *, CUdeviceptr))                                            \
  X(cuIpcOpenMemHandle_v2, (CUdeviceptr *, CUipcMemHandle, unsigned))                              \
  X(cuIpcOpenMemHandle, (CUdeviceptr *, CUipcMemHandle, unsigned))                                 \
  X(cuIpcCloseMemHandle, (CUdeviceptr))

static struct {
#define F_(name, args) CUresult(*name) args;
  ENTRY_POINTS(F_)
#undef F_
} cu;

/* Loads the stub and every entry point; NULL, or what was missing. */
static const char *load(void) {
  static char why[256];
  const char *path = getenv("FERRY_CUDASTUB");
  if (!path || !*path)
    return "FERRY_CUDASTUB is not set";
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    snprintf(why, sizeof why, "dlopen: %s", dlerror());
    return why;
  }
#define L_(name, args)                                                                             \
  if (!(*(void **)&cu.name = dlsym(h, #name))) {                                                   \
    snprintf(why, sizeof why, "no symbol %s", #name);                                              \
    return why;                                                                                    \
  }
  ENTRY_POINTS(L_)
#undef L_
  return NULL;
}

/* Makes device dev's primary context current on this thread (retained: release it after). */
static CUresult use_device(int dev) {
  CUcontext ctx;
  CUresult rc = cu.cuInit(0);
  if (rc == OK)
    rc = cu.cuDevicePrimaryCtxRetain(&ctx, dev);
  if (rc == OK)
    rc = cu.cuCtxSetCurrent(ctx);
  return rc;
}

static int setup(void **state) {
  assert_int_equal(use_device(0), OK);
  return 0;
}

/* The last release resets the context, which frees whatever a failed case left allocated. */
static int teardown(void **state) {
  assert_int_equal(cu.cuDevicePrimaryCtxRelease_v2(0), OK);
  return 0;
}

static CUdeviceptr alloc(size_t n) {
  CUdeviceptr d = 0;
  assert_int_equal(cu.cuMemAlloc_v2(&d, n), OK);
  assert_true(d != 0);
  return d;
}

static void put_pattern(CUdeviceptr d, size_t n, uint64_t seed) {
  char *buf = malloc(n);
  tu_fill(buf, n, seed);
  assert_int_equal(cu.cuMemcpyHtoD_v2(d, buf, n), OK);
  free(buf);
}

/* Whether device memory at d holds the pattern of seed. */
static bool has_pattern(CUdeviceptr d, size_t n, uint64_t seed) {
  char *want = malloc(n), *got = malloc(n);
  tu_fill(want, n, seed);
  bool same = cu.cuMemcpyDtoH_v2(got, d, n) == OK && memcmp(want, got, n) == 0;
  free(want);
  free(got);
  return same;
}

/* --- helper processes (argv[1] names the mode) --------------------------------------------- */

static int child_uninitialized(void) {
  CUdeviceptr d;
  int n;
  unsigned t;
  if (cu.cuDeviceGetCount(&n) != NOT_INITIALIZED || cu.cuMemAlloc_v2(&d, 64) != NOT_INITIALIZED)
    return 1;
  if (cu.cuPointerGetAttribute(&t, A_MEMTYPE, 4096) != NOT_INITIALIZED)
    return 2;
  if (cu.cuCtxSetCurrent(NULL) != NOT_INITIALIZED || cu.cuInit(0) != OK)
    return 3;
  return cu.cuDeviceGetCount(&n) == OK && n == DEVICES ? 0 : 4;
}

static void to_hex(const CUipcMemHandle *h, char out[129]) {
  for (size_t i = 0; i < sizeof h->reserved; i++)
    sprintf(out + 2 * i, "%02x", (unsigned char)h->reserved[i]);
}

static int from_hex(const char *s, CUipcMemHandle *h) {
  if (strlen(s) != 2 * sizeof h->reserved)
    return -1;
  for (size_t i = 0; i < sizeof h->reserved; i++) {
    unsigned v;
    if (sscanf(s + 2 * i, "%2x", &v) != 1)
      return -1;
    h->reserved[i] = (char)v;
  }
  return 0;
}

/* ipc-open HANDLE WANT_RC SIZE SEED: opens the handle and expects WANT_RC; on success checks the
 * memory holds SEED's pattern over SIZE bytes, opens it again (the same address), writes the
 * pattern of SEED+1 for the parent, and closes both opens. */
static int child_ipc_open(char **argv) {
  CUipcMemHandle h;
  int want = atoi(argv[3]);
  size_t size = strtoull(argv[4], NULL, 10);
  uint64_t seed = strtoull(argv[5], NULL, 10);
  if (from_hex(argv[2], &h) || use_device(1) != OK)
    return 20;
  CUdeviceptr d = 0, d2 = 0, base = 0;
  CUresult rc = cu.cuIpcOpenMemHandle_v2(&d, h, 1);
  if (rc != want)
    return 21;
  if (rc != OK)
    return 0;
  size_t got = 0;
  int ordinal = -1;
  if (cu.cuMemGetAddressRange_v2(&base, &got, d + 1) != OK || base != d || got != size)
    return 22;
  if (cu.cuPointerGetAttribute(&ordinal, A_ORDINAL, d) != OK || ordinal != 1)
    return 23;
  if (!has_pattern(d, size, seed))
    return 24;
  if (cu.cuIpcOpenMemHandle(&d2, h, 1) != OK || d2 != d)
    return 25;
  char *reply = malloc(size);
  tu_fill(reply, size, seed + 1);
  rc = cu.cuMemcpyHtoD_v2(d, reply, size);
  free(reply);
  if (rc != OK || cu.cuMemFree_v2(d) != INVALID_VALUE)
    return 26;
  if (cu.cuIpcCloseMemHandle(d) != OK || cu.cuIpcCloseMemHandle(d) != OK)
    return 27;
  return cu.cuIpcCloseMemHandle(d) == INVALID_VALUE ? 0 : 28;
}

static int run_ipc_child(const CUipcMemHandle *h, int want, size_t size, uint64_t seed) {
  char hex[129], w[16], sz[32], sd[32];
  to_hex(h, hex);
  snprintf(w, sizeof w, "%d", want);
  snprintf(sz, sizeof sz, "%zu", size);
  snprintf(sd, sizeof sd, "%llu", (unsigned long long)seed);
  return tu_wait(tu_spawn_exec("ipc-open", hex, w, sz, sd, NULL));
}

/* --- cases --------------------------------------------------------------------------------- */

static void test_uninitialized(void **state) {
  assert_int_equal(tu_wait(tu_spawn_exec("uninitialized", NULL)), 0);
}

static void test_devices(void **state) {
  int n = 0, v = 0;
  CUdevice dev = -1;
  char name[64];
  size_t mem = 0;
  assert_int_equal(cu.cuDeviceGetCount(&n), OK);
  assert_int_equal(n, DEVICES);
  assert_int_equal(cu.cuDeviceGet(&dev, DEVICES - 1), OK);
  assert_int_equal(dev, DEVICES - 1);
  assert_int_equal(cu.cuDeviceGet(&dev, DEVICES), INVALID_DEVICE);
  assert_int_equal(cu.cuDeviceGetName(name, sizeof name, 1), OK);
  assert_string_equal(name, "ferry cudastub device 1");
  assert_int_equal(cu.cuDeviceTotalMem_v2(&mem, 0), OK);
  assert_int_equal(mem, (size_t)MEM_MB << 20);
  assert_int_equal(cu.cuDriverGetVersion(&v), OK);
  assert_int_equal(v, 12080);
  const char *s = NULL;
  assert_int_equal(cu.cuGetErrorName(INVALID_CONTEXT, &s), OK);
  assert_string_equal(s, "CUDA_ERROR_INVALID_CONTEXT");
  assert_int_equal(cu.cuGetErrorString(NOT_READY, &s), OK);
  assert_string_equal(s, "device not ready");
  assert_int_equal(cu.cuGetErrorName(12345, &s), INVALID_VALUE);
  CUdevice cur = -1;
  assert_int_equal(cu.cuCtxGetDevice(&cur), OK);
  assert_int_equal(cur, 0);
}

static void *thread_alloc(void *arg) {
  CUdeviceptr d;
  *(CUresult *)arg = cu.cuMemAlloc_v2(&d, 64);
  return NULL;
}

static void test_context_rules(void **state) {
  CUdeviceptr d = alloc(256);
  /* another thread has no current context */
  CUresult in_thread = OK;
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, thread_alloc, &in_thread), 0);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(in_thread, INVALID_CONTEXT);

  CUcontext mine = NULL, none = (CUcontext)1;
  CUstream s;
  char buf[16];
  assert_int_equal(cu.cuCtxGetCurrent(&mine), OK);
  assert_int_equal(cu.cuCtxSetCurrent(NULL), OK);
  assert_int_equal(cu.cuCtxGetCurrent(&none), OK);
  assert_null(none);
  CUdeviceptr d2;
  assert_int_equal(cu.cuMemAlloc_v2(&d2, 64), INVALID_CONTEXT);
  assert_int_equal(cu.cuMemcpyDtoH_v2(buf, d, sizeof buf), INVALID_CONTEXT);
  assert_int_equal(cu.cuMemsetD8_v2(d, 1, 8), INVALID_CONTEXT);
  assert_int_equal(cu.cuStreamCreate(&s, 1), INVALID_CONTEXT);
  assert_int_equal(cu.cuMemHostRegister_v2(buf, sizeof buf, 0), INVALID_CONTEXT);
  unsigned type = 0;
  assert_int_equal(cu.cuPointerGetAttribute(&type, A_MEMTYPE, d), OK); /* needs no context */
  assert_int_equal(type, MEM_DEVICE);
  assert_int_equal(cu.cuCtxSetCurrent(mine), OK);
  assert_int_equal(cu.cuMemFree_v2(d), OK);

  /* the last release resets a context: its memory goes, and it is no longer usable */
  assert_int_equal(use_device(2), OK);
  d = alloc(64);
  assert_int_equal(cu.cuDevicePrimaryCtxRelease_v2(2), OK);
  assert_int_equal(cu.cuMemAlloc_v2(&d2, 64), INVALID_CONTEXT);
  assert_int_equal(cu.cuPointerGetAttribute(&type, A_MEMTYPE, d), INVALID_VALUE);
  assert_int_equal(cu.cuDevicePrimaryCtxRelease_v2(2), INVALID_CONTEXT);
  assert_int_equal(cu.cuCtxSetCurrent(mine), OK);
}

static int touch_read(void *arg) {
  signal(SIGSEGV, SIG_DFL); /* a sanitizer's handler would turn the fault into an exit */
  char buf[16];
  memcpy(buf, (void *)(uintptr_t) * (CUdeviceptr *)arg, sizeof buf);
  return buf[0] == 1 ? 1 : 2;
}

static int touch_write(void *arg) {
  signal(SIGSEGV, SIG_DFL);
  memset((void *)(uintptr_t) * (CUdeviceptr *)arg, 7, 16);
  return 1;
}

static void test_device_memory_faults(void **state) {
  CUdeviceptr d = alloc(4096);
  assert_int_equal(cu.cuMemsetD8_v2(d, 1, 4096), OK);
  assert_int_equal(tu_wait(tu_spawn(touch_read, &d)), 128 + SIGSEGV);
  assert_int_equal(tu_wait(tu_spawn(touch_write, &d)), 128 + SIGSEGV);
  unsigned char b = 0;
  assert_int_equal(cu.cuMemcpyDtoH_v2(&b, d + 4095, 1), OK);
  assert_int_equal(b, 1);
  assert_int_equal(cu.cuMemFree_v2(d), OK);
}

static void test_round_trip(void **state) {
  const size_t n = 100000; /* not a whole number of pages */
  CUdeviceptr a = alloc(n), b = alloc(n);
  put_pattern(a, n, 42);
  assert_true(has_pattern(a, n, 42));
  assert_int_equal(cu.cuMemcpyDtoD_v2(b, a, n), OK);
  assert_true(has_pattern(b, n, 42));
  assert_int_equal(cu.cuMemsetD8_v2(a, 0xab, n), OK);
  assert_false(has_pattern(a, n, 42));
  /* cuMemcpy takes any mix (unified addressing), and addresses inside an allocation */
  char *host = malloc(n), *want = malloc(n);
  assert_int_equal(cu.cuMemcpy((uintptr_t)host, b, n), OK);
  tu_fill(want, n, 42);
  assert_memory_equal(host, want, n);
  assert_int_equal(cu.cuMemcpy(a + 10, (uintptr_t)host, 100), OK);
  unsigned char c[3];
  assert_int_equal(cu.cuMemcpyDtoH_v2(c, a + 9, 3), OK);
  assert_int_equal(c[0], 0xab);
  assert_memory_equal(c + 1, want, 2);
  free(host);
  free(want);
  assert_int_equal(cu.cuMemFree_v2(a), OK);
  assert_int_equal(cu.cuMemFree_v2(b), OK);
}

static void test_ranges(void **state) {
  const size_t n = 1000;
  CUdeviceptr d = alloc(n);
  char buf[2 * 4096];
  assert_int_equal(cu.cuMemcpyHtoD_v2(d, buf, n + 1), INVALID_VALUE);
  assert_int_equal(cu.cuMemcpyDtoH_v2(buf, d + 1, n), INVALID_VALUE);
  assert_int_equal(cu.cuMemcpyDtoH_v2(buf, d + n - 1, 1), OK);
  assert_int_equal(cu.cuMemsetD8_v2(d + 500, 0, 501), INVALID_VALUE);
  assert_int_equal(cu.cuMemsetD8_v2((uintptr_t)buf, 0, 8), INVALID_VALUE);
  /* past the size asked for, in the page-rounded mapping: not the allocation, and not host */
  assert_int_equal(cu.cuMemcpyDtoH_v2(buf, d + n, 1), INVALID_VALUE);
  assert_int_equal(cu.cuMemcpyHtoD_v2(d, (void *)(uintptr_t)(d + n), 1), INVALID_VALUE);
  assert_int_equal(cu.cuMemcpyDtoH_v2(NULL, d, 1), INVALID_VALUE);
  CUdeviceptr base = 0;
  size_t size = 0;
  assert_int_equal(cu.cuMemGetAddressRange_v2(&base, &size, d + 999), OK);
  assert_true(base == d);
  assert_int_equal(size, n);
  assert_int_equal(cu.cuMemGetAddressRange_v2(&base, &size, d + n), INVALID_VALUE);
  assert_int_equal(cu.cuMemGetAddressRange_v2(&base, &size, (uintptr_t)buf), INVALID_VALUE);
  assert_int_equal(cu.cuMemFree_v2(d + 1), INVALID_VALUE);
  assert_int_equal(cu.cuMemFree_v2((uintptr_t)buf), INVALID_VALUE);
  assert_int_equal(cu.cuMemFree_v2(d), OK);
  assert_int_equal(cu.cuMemFree_v2(d), INVALID_VALUE);
  assert_int_equal(cu.cuMemcpyDtoH_v2(buf, d, 1), INVALID_VALUE); /* freed: unmapped, refused */
}

static void test_pointer_attributes(void **state) {
  CUdeviceptr d = alloc(5000), p = 0;
  unsigned type = 0;
  int ordinal = -1;
  size_t size = 0;
  bool mapped = false;
  CUcontext ctx = NULL, mine = NULL;
  assert_int_equal(cu.cuCtxGetCurrent(&mine), OK);
  assert_int_equal(cu.cuPointerGetAttribute(&type, A_MEMTYPE, d + 4999), OK);
  assert_int_equal(type, MEM_DEVICE);
  assert_int_equal(cu.cuPointerGetAttribute(&ordinal, A_ORDINAL, d), OK);
  assert_int_equal(ordinal, 0);
  assert_int_equal(cu.cuPointerGetAttribute(&p, A_START, d + 17), OK);
  assert_true(p == d);
  assert_int_equal(cu.cuPointerGetAttribute(&size, A_SIZE, d + 17), OK);
  assert_int_equal(size, 5000);
  assert_int_equal(cu.cuPointerGetAttribute(&p, A_DEVPTR, d + 17), OK);
  assert_true(p == d + 17);
  assert_int_equal(cu.cuPointerGetAttribute(&mapped, A_MAPPED, d), OK);
  assert_true(mapped);
  assert_int_equal(cu.cuPointerGetAttribute(&ctx, A_CONTEXT, d), OK);
  assert_ptr_equal(ctx, mine);
  void *hp;
  assert_int_equal(cu.cuPointerGetAttribute(&hp, A_HOSTPTR, d), INVALID_VALUE);

  /* plain pageable host memory is unknown to the driver */
  char *host = malloc(8192);
  assert_int_equal(cu.cuPointerGetAttribute(&type, A_MEMTYPE, (uintptr_t)host), INVALID_VALUE);
  assert_int_equal(cu.cuPointerGetAttribute(&type, A_MEMTYPE, d + 5000), INVALID_VALUE);
  /* registered host memory is host memory of the registering context's device */
  assert_int_equal(use_device(1), OK);
  assert_int_equal(cu.cuMemHostRegister_v2(host, 8192, 1), OK);
  assert_int_equal(cu.cuPointerGetAttribute(&type, A_MEMTYPE, (uintptr_t)host + 100), OK);
  assert_int_equal(type, MEM_HOST);
  assert_int_equal(cu.cuPointerGetAttribute(&ordinal, A_ORDINAL, (uintptr_t)host), OK);
  assert_int_equal(ordinal, 1);
  assert_int_equal(cu.cuPointerGetAttribute(&hp, A_HOSTPTR, (uintptr_t)host + 8), OK);
  assert_ptr_equal(hp, host + 8);
  assert_int_equal(cu.cuMemHostRegister_v2(host + 4096, 10, 0), ALREADY_REGISTERED);
  assert_int_equal(cu.cuMemHostUnregister(host + 1), NOT_REGISTERED);
  assert_int_equal(cu.cuMemHostRegister_v2((void *)(uintptr_t)d, 64, 0), INVALID_VALUE);
  assert_int_equal(cu.cuMemHostUnregister(host), OK);
  assert_int_equal(cu.cuMemHostUnregister(host), NOT_REGISTERED);
  assert_int_equal(cu.cuPointerGetAttribute(&type, A_MEMTYPE, (uintptr_t)host), INVALID_VALUE);
  assert_int_equal(cu.cuDevicePrimaryCtxRelease_v2(1), OK);
  assert_int_equal(cu.cuCtxSetCurrent(mine), OK);
  free(host);
  assert_int_equal(cu.cuMemFree_v2(d), OK);
}

/* A device buffer holding seed's pattern and a zeroed host buffer for it to come back into. */
struct async_case {
  size_t n;
  CUdeviceptr d;
  char *host, *want, *zero;
  CUstream s;
};

static void async_open(struct async_case *c, uint64_t seed) {
  c->n = 65536;
  c->d = alloc(c->n);
  put_pattern(c->d, c->n, seed);
  c->host = calloc(1, c->n);
  c->zero = calloc(1, c->n);
  c->want = malloc(c->n);
  tu_fill(c->want, c->n, seed);
  assert_int_equal(cu.cuStreamCreate(&c->s, 1), OK);
  assert_int_equal(cu.cuMemcpyAsync((uintptr_t)c->host, c->d, c->n, c->s), OK);
  assert_memory_equal(c->host, c->zero, c->n); /* not yet */
}

static void async_close(struct async_case *c) {
  assert_int_equal(cu.cuStreamDestroy_v2(c->s), OK);
  assert_int_equal(cu.cuMemFree_v2(c->d), OK);
  free(c->host);
  free(c->zero);
  free(c->want);
}

static void test_async_stream_sync(void **state) {
  struct async_case c;
  async_open(&c, 7);
  /* synchronous work and other streams do not flush it */
  char b;
  assert_int_equal(cu.cuMemcpyDtoH_v2(&b, c.d, 1), OK);
  CUstream other;
  assert_int_equal(cu.cuStreamCreate(&other, 1), OK);
  assert_int_equal(cu.cuStreamSynchronize(other), OK);
  assert_int_equal(cu.cuStreamSynchronize(NULL), OK);
  assert_memory_equal(c.host, c.zero, c.n);
  assert_int_equal(cu.cuStreamSynchronize(c.s), OK);
  assert_memory_equal(c.host, c.want, c.n);
  assert_int_equal(cu.cuStreamDestroy_v2(other), OK);
  assert_int_equal(cu.cuStreamSynchronize(other), INVALID_HANDLE);
  async_close(&c);
}

static void test_async_events(void **state) {
  struct async_case c;
  async_open(&c, 8);
  CUevent e, e2;
  assert_int_equal(cu.cuEventCreate(&e, 0), OK);
  assert_int_equal(cu.cuEventCreate(&e2, 0), OK);
  assert_int_equal(cu.cuEventQuery(e2), OK); /* never recorded: complete */
  assert_int_equal(cu.cuEventRecord(e, c.s), OK);
  /* work queued after the event is not part of it */
  char *late = calloc(1, c.n);
  assert_int_equal(cu.cuMemcpyAsync((uintptr_t)late, c.d, c.n, c.s), OK);
  assert_int_equal(cu.cuEventRecord(e2, c.s), OK);
  assert_int_equal(cu.cuEventQuery(e), NOT_READY);
  assert_memory_equal(c.host, c.zero, c.n); /* a query runs nothing */
  assert_int_equal(cu.cuEventSynchronize(e), OK);
  assert_int_equal(cu.cuEventQuery(e), OK);
  assert_memory_equal(c.host, c.want, c.n);
  assert_int_equal(cu.cuEventQuery(e2), NOT_READY);
  assert_memory_equal(late, c.zero, c.n);
  assert_int_equal(cu.cuEventSynchronize(e2), OK);
  assert_memory_equal(late, c.want, c.n);
  assert_int_equal(cu.cuEventDestroy_v2(e), OK);
  assert_int_equal(cu.cuEventDestroy_v2(e2), OK);
  assert_int_equal(cu.cuEventDestroy_v2(e), INVALID_HANDLE);
  free(late);
  async_close(&c);
}

static void test_stream_wait_event(void **state) {
  struct async_case c;
  async_open(&c, 9);
  CUstream waiter;
  CUevent e;
  assert_int_equal(cu.cuStreamCreate(&waiter, 1), OK);
  assert_int_equal(cu.cuEventCreate(&e, 0), OK);
  assert_int_equal(cu.cuEventRecord(e, c.s), OK);
  assert_int_equal(cu.cuStreamWaitEvent(waiter, e, 0), OK);
  assert_memory_equal(c.host, c.zero, c.n);
  assert_int_equal(cu.cuStreamSynchronize(waiter), OK);
  assert_memory_equal(c.host, c.want, c.n);
  assert_int_equal(cu.cuEventQuery(e), OK);
  assert_int_equal(cu.cuStreamDestroy_v2(waiter), OK);
  assert_int_equal(cu.cuEventDestroy_v2(e), OK);
  async_close(&c);
}

static void test_async_edges(void **state) {
  struct async_case c;
  async_open(&c, 10);
  /* destroying a stream completes its work */
  assert_int_equal(cu.cuStreamDestroy_v2(c.s), OK);
  assert_memory_equal(c.host, c.want, c.n);
  /* the NULL stream runs at once */
  memset(c.host, 0, c.n);
  assert_int_equal(cu.cuMemcpyAsync((uintptr_t)c.host, c.d, c.n, NULL), OK);
  assert_memory_equal(c.host, c.want, c.n);
  /* a bad range is refused when issued, not when it runs */
  assert_int_equal(cu.cuStreamCreate(&c.s, 1), OK);
  assert_int_equal(cu.cuMemcpyAsync((uintptr_t)c.host, c.d + 1, c.n, c.s), INVALID_VALUE);
  assert_int_equal(cu.cuStreamSynchronize(c.s), OK);
  assert_int_equal(cu.cuStreamCreate(&c.s, 2), INVALID_VALUE);
  async_close(&c);
}

static void test_ipc(void **state) {
  const size_t n = 3 * 4096 + 5;
  CUdeviceptr d = alloc(n), got = 0;
  put_pattern(d, n, 77);
  CUipcMemHandle h;
  /* any address in the allocation names all of it */
  assert_int_equal(cu.cuIpcGetMemHandle(&h, d + 4096), OK);
  assert_int_equal(run_ipc_child(&h, OK, n, 77), 0);
  assert_true(has_pattern(d, n, 78)); /* the child's reply */
  /* a process cannot open its own handle */
  assert_int_equal(cu.cuIpcOpenMemHandle_v2(&got, h, 1), INVALID_CONTEXT);
  assert_int_equal(cu.cuIpcGetMemHandle(&h, d + n), INVALID_VALUE);
  assert_int_equal(cu.cuMemFree_v2(d), OK);
  /* once freed, the handle is stale */
  assert_int_equal(run_ipc_child(&h, INVALID_HANDLE, n, 77), 0);
}

static void test_ipc_forged(void **state) {
  const size_t n = 4096;
  CUdeviceptr d = alloc(n), got;
  CUipcMemHandle h, f;
  assert_int_equal(cu.cuIpcGetMemHandle(&h, d), OK);
  memset(&f, 0, sizeof f);
  assert_int_equal(cu.cuIpcOpenMemHandle_v2(&got, f, 1), INVALID_HANDLE);
  assert_int_equal(run_ipc_child(&f, INVALID_HANDLE, n, 0), 0);
  /* a change to any field that names the allocation (the stub's layout: magic at 0, pid at 8,
   * fd at 12, size at 16, id at 32); the pid's top byte, so it names no process at all */
  const size_t fields[] = {0, 11, 12, 16, 32};
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
    f = h;
    f.reserved[fields[i]] ^= 0x5a;
    assert_int_equal(run_ipc_child(&f, INVALID_HANDLE, n, 0), 0);
  }
  /* the size's low byte only: the same pages, but not the allocation the handle came from */
  f = h;
  f.reserved[16] ^= 1;
  assert_int_equal(run_ipc_child(&f, INVALID_HANDLE, n, 0), 0);
  put_pattern(d, n, 5);
  assert_int_equal(run_ipc_child(&h, OK, n, 5), 0); /* and the real one opens */
  assert_int_equal(cu.cuMemFree_v2(d), OK);
}

static int owner_then_exit(void *arg) {
  tu_pipe *p = arg;
  CUdeviceptr d;
  CUipcMemHandle h;
  if (cu.cuMemAlloc_v2(&d, 4096) != OK || cu.cuIpcGetMemHandle(&h, d) != OK)
    return 1;
  tu_pipe_put(p, &h, sizeof h);
  return 0;
}

static void test_ipc_owner_dead(void **state) {
  tu_pipe p;
  tu_pipe_open(&p);
  pid_t pid = tu_spawn(owner_then_exit, &p);
  CUipcMemHandle h;
  assert_int_equal(tu_pipe_get(&p, &h, sizeof h, 10000), 0);
  assert_int_equal(tu_wait(pid), 0);
  tu_pipe_close(&p);
  CUdeviceptr got = 0;
  CUresult rc = cu.cuIpcOpenMemHandle_v2(&got, h, 1);
  assert_true(rc == INVALID_HANDLE || rc == MAP_FAILED_);
}

/* Threads each with their own context, stream and memory, all at once (the lock under TSan). */
static void *thread_work(void *arg) {
  intptr_t i = (intptr_t)arg, bad = 0;
  CUstream s;
  if (use_device((int)(i % DEVICES)) != OK || cu.cuStreamCreate(&s, 1) != OK)
    return (void *)1;
  char host[4096], back[4096];
  for (int round = 0; round < 200 && !bad; round++) {
    CUdeviceptr d;
    tu_fill(host, sizeof host, (uint64_t)(i * 1000 + round));
    memset(back, 0, sizeof back);
    bad = cu.cuMemAlloc_v2(&d, sizeof host) != OK ||
          cu.cuMemcpyAsync(d, (uintptr_t)host, sizeof host, s) != OK ||
          cu.cuMemcpyAsync((uintptr_t)back, d, sizeof back, s) != OK ||
          cu.cuStreamSynchronize(s) != OK || memcmp(host, back, sizeof host) != 0 ||
          cu.cuMemFree_v2(d) != OK;
  }
  if (cu.cuStreamDestroy_v2(s) != OK || cu.cuDevicePrimaryCtxRelease_v2((int)(i % DEVICES)))
    bad = 1;
  return (void *)bad;
}

static void test_threads(void **state) {
  pthread_t t[6];
  for (intptr_t i = 0; i < 6; i++)
    assert_int_equal(pthread_create(&t[i], NULL, thread_work, (void *)i), 0);
  for (int i = 0; i < 6; i++) {
    void *bad = (void *)1;
    assert_int_equal(pthread_join(t[i], &bad), 0);
    assert_null(bad);
  }
}

static void test_memory_limit(void **state) {
  const size_t all = (size_t)MEM_MB << 20;
  CUdeviceptr d = alloc(all), e;
  assert_int_equal(cu.cuMemAlloc_v2(&e, 1), OUT_OF_MEMORY);
  assert_int_equal(cu.cuMemAlloc_v2(&e, 0), INVALID_VALUE);
  /* the limit is per device */
  CUcontext mine;
  assert_int_equal(cu.cuCtxGetCurrent(&mine), OK);
  assert_int_equal(use_device(1), OK);
  e = alloc(all / 2);
  assert_int_equal(cu.cuMemFree_v2(e), OK);
  assert_int_equal(cu.cuDevicePrimaryCtxRelease_v2(1), OK);
  assert_int_equal(cu.cuCtxSetCurrent(mine), OK);
  assert_int_equal(cu.cuMemFree_v2(d), OK);
  d = alloc(all - 4096);
  assert_int_equal(cu.cuMemAlloc_v2(&e, 4097), OUT_OF_MEMORY);
  e = alloc(4096);
  assert_int_equal(cu.cuMemFree_v2(e), OK);
  assert_int_equal(cu.cuMemFree_v2(d), OK);
}

int main(int argc, char **argv) {
  setenv("FERRY_CUDASTUB_DEVICES", "3", 1);
  setenv("FERRY_CUDASTUB_MEM_MB", "64", 1);
  const char *why = load();
  if (why) {
    fprintf(stderr, "cudastub_test: %s\n", why);
    return 1;
  }
  if (argc > 1 && strcmp(argv[1], "uninitialized") == 0)
    return child_uninitialized();
  if (argc > 5 && strcmp(argv[1], "ipc-open") == 0)
    return child_ipc_open(argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_uninitialized),
      cmocka_unit_test_setup_teardown(test_devices, setup, teardown),
      cmocka_unit_test_setup_teardown(test_context_rules, setup, teardown),
      cmocka_unit_test_setup_teardown(test_device_memory_faults, setup, teardown),
      cmocka_unit_test_setup_teardown(test_round_trip, setup, teardown),
      cmocka_unit_test_setup_teardown(test_ranges, setup, teardown),
      cmocka_unit_test_setup_teardown(test_pointer_attributes, setup, teardown),
      cmocka_unit_test_setup_teardown(test_async_stream_sync, setup, teardown),
      cmocka_unit_test_setup_teardown(test_async_events, setup, teardown),
      cmocka_unit_test_setup_teardown(test_stream_wait_event, setup, teardown),
      cmocka_unit_test_setup_teardown(test_async_edges, setup, teardown),
      cmocka_unit_test_setup_teardown(test_ipc, setup, teardown),
      cmocka_unit_test_setup_teardown(test_ipc_forged, setup, teardown),
      cmocka_unit_test_setup_teardown(test_ipc_owner_dead, setup, teardown),
      cmocka_unit_test_setup_teardown(test_memory_limit, setup, teardown),
      cmocka_unit_test_setup_teardown(test_threads, setup, teardown),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, NULL, NULL);
}
