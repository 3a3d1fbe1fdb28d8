/*
 * The CUDA driver API, loaded at run time: the one place ferry calls CUDA (see cuda.h for the
 * rules callers rely on). No CUDA header or library exists at build time (Debian packages
 * none), so the few types and entry points used are declared here from the driver's stable C
 * ABI, each resolved by its exported name (the _v2 names where the driver versioned a call).
 * FERRY_CUDA_LIB names another library with the same entry points: the tests' stand-in
 * (tests/cudastub) makes every CUDA path of ferry run on a machine without a GPU.
 *
 * Each call that touches a device saves the calling thread's current context, makes that
 * device's primary context current, and restores the saved one before returning: ferry runs on
 * its callers' threads, and PyTorch reads its current device from the current context.
 */
#include "core/cuda.h"
#include "core/core.h"
#include "core/stats.h"

#include <dlfcn.h>
#include <pthread.h>
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
  CUDA_SUCCESS = 0,
  CUDA_ERROR_NOT_READY = 600,
  CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
  CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
  CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
  CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,
  CU_MEMORYTYPE_DEVICE = 2,
  CU_STREAM_NON_BLOCKING = 1,
  CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1,
  CU_MEMHOSTREGISTER_PORTABLE = 1,
  CU_EVENT_DISABLE_TIMING = 2,
};

/* field, exported name, signature */
#define FR_CUDA_CALLS(X)                                                                           \
  X(cuInit, "cuInit", (unsigned))                                                                  \
  X(cuDriverGetVersion, "cuDriverGetVersion", (int *))                                             \
  X(cuDeviceGetCount, "cuDeviceGetCount", (int *))                                                 \
  X(cuDeviceGet, "cuDeviceGet", (CUdevice *, int))                                                 \
  X(cuDeviceGetName, "cuDeviceGetName", (char *, int, CUdevice))                                   \
  X(cuDeviceTotalMem, "cuDeviceTotalMem_v2", (size_t *, CUdevice))                                 \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", (CUcontext *, CUdevice))                 \
  X(cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext))                                               \
  X(cuCtxGetCurrent, "cuCtxGetCurrent", (CUcontext *))                                             \
  X(cuGetErrorString, "cuGetErrorString", (CUresult, const char **))                               \
  X(cuPointerGetAttribute, "cuPointerGetAttribute", (void *, int, CUdeviceptr))                    \
  X(cuMemAlloc, "cuMemAlloc_v2", (CUdeviceptr *, size_t))                                          \
  X(cuMemFree, "cuMemFree_v2", (CUdeviceptr))                                                      \
  X(cuMemHostRegister, "cuMemHostRegister_v2", (void *, size_t, unsigned))                         \
  X(cuMemHostUnregister, "cuMemHostUnregister", (void *))                                          \
  X(cuMemcpyAsync, "cuMemcpyAsync", (CUdeviceptr, CUdeviceptr, size_t, CUstream))                  \
  X(cuStreamCreate, "cuStreamCreate", (CUstream *, unsigned))                                      \
  X(cuStreamDestroy, "cuStreamDestroy_v2", (CUstream))                                             \
  X(cuStreamSynchronize, "cuStreamSynchronize", (CUstream))                                        \
  X(cuEventCreate, "cuEventCreate", (CUevent *, unsigned))                                         \
  X(cuEventRecord, "cuEventRecord", (CUevent, CUstream))                                           \
  X(cuEventSynchronize, "cuEventSynchronize", (CUevent))                                           \
  X(cuEventQuery, "cuEventQuery", (CUevent))                                                       \
  X(cuEventDestroy, "cuEventDestroy_v2", (CUevent))                                                \
  X(cuIpcGetMemHandle, "cuIpcGetMemHandle", (CUipcMemHandle *, CUdeviceptr))                       \
  X(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2", (CUdeviceptr *, CUipcMemHandle, unsigned))        \
  X(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", (CUdeviceptr))

static struct {
#define FR_CUDA_FIELD(field, name, args) CUresult(*field) args;
  FR_CUDA_CALLS(FR_CUDA_FIELD)
#undef FR_CUDA_FIELD
} cu;

static struct {
  pthread_once_t once;
  bool loaded; /* written once, before `once` completes */
  int driver_version, devices;
  char library[256], detail[400];
  pthread_mutex_t lock; /* primary */
  CUcontext primary[FR_CUDA_MAX_DEVICES];
} drv = {.once = PTHREAD_ONCE_INIT, .lock = PTHREAD_MUTEX_INITIALIZER};

static const char *cu_error(CUresult r) {
  const char *s = NULL;
  if (!cu.cuGetErrorString || cu.cuGetErrorString(r, &s) != CUDA_SUCCESS || !s)
    s = "unknown error";
  return s;
}

static int cu_fail(CUresult r, const char *call) {
  return fr_err(FERRY_EDEVICE, "cuda: %s: %s (error %d)", call, cu_error(r), r);
}

/* Resolves every entry point; the name of the first one missing, or NULL. */
static const char *resolve(void *lib) {
#define FR_CUDA_RESOLVE(field, name, args)                                                         \
  if (!(*(void **)&cu.field = dlsym(lib, name)))                                                   \
    return name;
  FR_CUDA_CALLS(FR_CUDA_RESOLVE)
#undef FR_CUDA_RESOLVE
  return NULL;
}

static void load_once(void) {
  const char *mode = fr_config_str("FERRY_CUDA");
  const char *path = fr_config_str("FERRY_CUDA_LIB");
  fr_str_copy(drv.library, sizeof drv.library, *path ? path : "libcuda.so.1");
  if (strcmp(mode, "off") == 0) {
    snprintf(drv.detail, sizeof drv.detail, "FERRY_CUDA=off");
    return;
  }
  if (strcmp(mode, "auto") != 0)
    fr_warn("FERRY_CUDA=%s: expected auto or off; taken as auto", mode);
  void *lib = dlopen(drv.library, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fr_str_copy(drv.detail, sizeof drv.detail, dlerror());
    return;
  }
  const char *missing = resolve(lib);
  CUresult r = CUDA_SUCCESS;
  if (missing)
    snprintf(drv.detail, sizeof drv.detail, "%s has no %s", drv.library, missing);
  else if ((r = cu.cuInit(0)) != CUDA_SUCCESS ||
           (r = cu.cuDriverGetVersion(&drv.driver_version)) != CUDA_SUCCESS ||
           (r = cu.cuDeviceGetCount(&drv.devices)) != CUDA_SUCCESS)
    snprintf(drv.detail, sizeof drv.detail, "cuInit: %s (error %d)", cu_error(r), r);
  if (missing || r != CUDA_SUCCESS) {
    memset(&cu, 0, sizeof cu);
    dlclose(lib);
    return;
  }
  if (drv.devices > FR_CUDA_MAX_DEVICES)
    drv.devices = FR_CUDA_MAX_DEVICES;
  __atomic_store_n(&drv.loaded, true, __ATOMIC_RELEASE);
}

int fr_cuda_load(void) {
  pthread_once(&drv.once, load_once);
  if (!drv.loaded)
    return fr_err(FERRY_ENOTSUP, "no CUDA driver: %s", drv.detail);
  return 0;
}

bool fr_cuda_loaded(void) { return __atomic_load_n(&drv.loaded, __ATOMIC_ACQUIRE); }

/* Makes `device`'s primary context current on this thread; *saved gets the one it replaces. */
static int enter(int device, CUcontext *saved) {
  int rc = fr_cuda_load();
  if (rc != 0)
    return rc;
  if (device < 0 || device >= drv.devices)
    return fr_err(FERRY_ERANGE, "cuda: no device %d (%d found)", device, drv.devices);
  pthread_mutex_lock(&drv.lock);
  CUcontext ctx = drv.primary[device];
  CUresult r = CUDA_SUCCESS;
  if (!ctx) {
    CUdevice dev;
    if ((r = cu.cuDeviceGet(&dev, device)) == CUDA_SUCCESS &&
        (r = cu.cuDevicePrimaryCtxRetain(&ctx, dev)) == CUDA_SUCCESS)
      drv.primary[device] = ctx;
  }
  pthread_mutex_unlock(&drv.lock);
  if (r != CUDA_SUCCESS)
    return cu_fail(r, "cuDevicePrimaryCtxRetain");
  if ((r = cu.cuCtxGetCurrent(saved)) != CUDA_SUCCESS)
    return cu_fail(r, "cuCtxGetCurrent");
  if (*saved != ctx && (r = cu.cuCtxSetCurrent(ctx)) != CUDA_SUCCESS)
    return cu_fail(r, "cuCtxSetCurrent");
  return 0;
}

static void leave(CUcontext saved) {
  CUcontext now = NULL;
  if (cu.cuCtxGetCurrent(&now) == CUDA_SUCCESS && now != saved)
    cu.cuCtxSetCurrent(saved);
}

fr_mem_where fr_cuda_where(const void *ptr) {
  fr_mem_where w = {.kind = FERRY_MEM_HOST, .device = -1};
  unsigned type = 0;
  int ordinal = -1;
  CUdeviceptr start = 0;
  size_t size = 0;
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)ptr;
  if (ptr)
    pthread_once(&drv.once, load_once); /* no error formatted: being host memory is no failure */
  if (!ptr || !fr_cuda_loaded() ||
      cu.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p) != CUDA_SUCCESS ||
      type != CU_MEMORYTYPE_DEVICE ||
      cu.cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p) != CUDA_SUCCESS ||
      cu.cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p) != CUDA_SUCCESS ||
      cu.cuPointerGetAttribute(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, p) != CUDA_SUCCESS)
    return w;
  w.kind = FERRY_MEM_CUDA;
  w.device = ordinal;
  w.base = (uintptr_t)start;
  w.size = size;
  return w;
}

/* Each thread's copy streams, one per device, destroyed with the thread. */
typedef struct thread_streams {
  CUstream s[FR_CUDA_MAX_DEVICES];
} thread_streams;
static pthread_key_t streams_key;
static pthread_once_t streams_once = PTHREAD_ONCE_INIT;

static void streams_free(void *arg) {
  thread_streams *t = arg;
  for (int d = 0; d < FR_CUDA_MAX_DEVICES; d++) {
    CUcontext saved;
    if (t->s[d] && enter(d, &saved) == 0) {
      cu.cuStreamDestroy(t->s[d]);
      leave(saved);
    }
  }
  free(t);
}

static void streams_key_make(void) { pthread_key_create(&streams_key, streams_free); }

/* This thread's stream for `device`, whose context is current. */
static int thread_stream(int device, CUstream *out) {
  pthread_once(&streams_once, streams_key_make);
  thread_streams *t = pthread_getspecific(streams_key);
  if (!t) {
    if (!(t = calloc(1, sizeof *t)))
      return fr_err(FERRY_ENOMEM, "cuda: stream table");
    pthread_setspecific(streams_key, t);
  }
  CUresult r;
  if (!t->s[device] && (r = cu.cuStreamCreate(&t->s[device], CU_STREAM_NON_BLOCKING)) != 0)
    return cu_fail(r, "cuStreamCreate");
  *out = t->s[device];
  return 0;
}

/* Every copy fr_cuda_copy_on ran (process-wide, relaxed adds): how many, their bytes, and the
 * time spent issuing them (until cuMemcpyAsync returned) and then waiting for them
 * (cuStreamSynchronize). Two clock reads a copy, against a driver call of microseconds: always
 * on. `ferry bench gpu` splits a refit's time with them (issue 37). */
static uint64_t copies_n, copies_bytes, copies_issue_ns, copies_sync_ns;

void fr_cuda_collect(fr_stats_out *out) {
  uint64_t n = fr_counted(&copies_n);
  if (n == 0) /* no device copy in this process: no series */
    return;
  fr_stat_counter(out, "ferry_cuda_copies_total", "Copies through the CUDA copy engines", (double)n,
                  NULL);
  fr_stat_counter(out, "ferry_cuda_copy_bytes_total", "Bytes of those copies",
                  (double)fr_counted(&copies_bytes), NULL);
  fr_stat_counter(out, "ferry_cuda_copy_issue_seconds_total",
                  "Time spent issuing them (cuMemcpyAsync)",
                  (double)fr_counted(&copies_issue_ns) * 1e-9, NULL);
  fr_stat_counter(out, "ferry_cuda_copy_sync_seconds_total",
                  "Time spent waiting for them to finish (cuStreamSynchronize)",
                  (double)fr_counted(&copies_sync_ns) * 1e-9, NULL);
}

int fr_cuda_copy_on(int device_hint, void *dst, const void *src, size_t n) {
  int device = device_hint;
  if (device < 0) {
    fr_mem_where s = fr_cuda_where(src), d = fr_cuda_where(dst);
    device = s.kind == FERRY_MEM_CUDA ? s.device : d.device;
  }
  if (device < 0) {
    memcpy(dst, src, n);
    return 0;
  }
  if (n == 0)
    return 0;
  CUcontext saved;
  CUstream stream = NULL;
  int rc = enter(device, &saved);
  if (rc != 0)
    return rc;
  CUresult r;
  if ((rc = thread_stream(device, &stream)) == 0) {
    uint64_t t0 = fr_now_ns();
    if ((r = cu.cuMemcpyAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, n,
                              stream)) != CUDA_SUCCESS)
      rc = cu_fail(r, "cuMemcpyAsync");
    uint64_t t1 = fr_now_ns();
    if ((r = cu.cuStreamSynchronize(stream)) != CUDA_SUCCESS && rc == 0)
      rc = cu_fail(r, "cuStreamSynchronize");
    fr_count(&copies_n, 1);
    fr_count(&copies_bytes, n);
    fr_count(&copies_issue_ns, t1 - t0);
    fr_count(&copies_sync_ns, fr_now_ns() - t1);
  }
  leave(saved);
  return rc;
}

int fr_cuda_copy_async(int device, void *dst, const void *src, size_t n) {
  CUcontext saved;
  CUstream stream = NULL;
  int rc = n == 0 ? 0 : enter(device, &saved);
  if (n == 0 || rc != 0)
    return rc;
  if ((rc = thread_stream(device, &stream)) == 0) {
    uint64_t t0 = fr_now_ns();
    CUresult r =
        cu.cuMemcpyAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, n, stream);
    rc = r == CUDA_SUCCESS ? 0 : cu_fail(r, "cuMemcpyAsync");
    fr_count(&copies_n, 1);
    fr_count(&copies_bytes, n);
    fr_count(&copies_issue_ns, fr_now_ns() - t0);
  }
  leave(saved);
  return rc;
}

int fr_cuda_sync(int device) {
  CUcontext saved;
  CUstream stream = NULL;
  int rc = enter(device, &saved);
  if (rc != 0)
    return rc;
  if ((rc = thread_stream(device, &stream)) == 0) {
    uint64_t t0 = fr_now_ns();
    CUresult r = cu.cuStreamSynchronize(stream);
    rc = r == CUDA_SUCCESS ? 0 : cu_fail(r, "cuStreamSynchronize");
    fr_count(&copies_sync_ns, fr_now_ns() - t0);
  }
  leave(saved);
  return rc;
}

int fr_cuda_copy(void *dst, const void *src, size_t n) { return fr_cuda_copy_on(-1, dst, src, n); }

/* ---- staging: device bytes out through host memory, the next chunk's copy under this one's use */

struct fr_cuda_stager {
  size_t chunk;
  uint8_t *buf[2]; /* pinned when the driver allows it */
  bool pinned[2];
  CUevent done[2];
  int device; /* whose context made the events; -1 before the first use */
};

size_t fr_cuda_chunk_bytes(void) {
  int64_t v = fr_config_int("FERRY_CUDA_CHUNK_BYTES");
  return v < 4096 ? 4096 : (size_t)v;
}

int fr_cuda_stager_open(size_t chunk, fr_cuda_stager **out) {
  chunk = chunk < 4096 ? 4096 : chunk;
  fr_cuda_stager *s = calloc(1, sizeof *s);
  if (!s)
    return fr_err(FERRY_ENOMEM, "cuda staging buffers");
  s->chunk = chunk;
  s->device = -1;
  for (int i = 0; i < 2; i++)
    if (!(s->buf[i] = aligned_alloc(4096, (chunk + 4095) / 4096 * 4096))) {
      fr_cuda_stager_close(s);
      return fr_err(FERRY_ENOMEM, "cuda staging buffers of %zu bytes", chunk);
    }
  *out = s;
  return 0;
}

void fr_cuda_stager_close(fr_cuda_stager *s) {
  if (!s)
    return;
  CUcontext saved;
  bool in = s->device >= 0 && enter(s->device, &saved) == 0;
  for (int i = 0; i < 2; i++) {
    if (in && s->done[i])
      cu.cuEventDestroy(s->done[i]);
    if (in && s->pinned[i])
      cu.cuMemHostUnregister(s->buf[i]);
    free(s->buf[i]);
  }
  if (in)
    leave(saved);
  free(s);
}

/* Events in `device`'s context (made again when the stager moves to another device). */
static int stager_events(fr_cuda_stager *s, int device) {
  if (s->device == device)
    return 0;
  CUcontext saved;
  if (s->device >= 0 && enter(s->device, &saved) == 0) { /* the old events, in their context */
    cu.cuEventDestroy(s->done[0]);
    cu.cuEventDestroy(s->done[1]);
    leave(saved);
  }
  s->done[0] = s->done[1] = NULL;
  s->device = -1; /* until both events of `device` exist */
  for (int i = 0; i < 2; i++) {
    CUresult r = cu.cuEventCreate(&s->done[i], CU_EVENT_DISABLE_TIMING);
    if (r != CUDA_SUCCESS) {
      if (i == 1)
        cu.cuEventDestroy(s->done[0]);
      s->done[0] = s->done[1] = NULL;
      return cu_fail(r, "cuEventCreate");
    }
    if (!s->pinned[i])
      s->pinned[i] = cu.cuMemHostRegister(s->buf[i], s->chunk, CU_MEMHOSTREGISTER_PORTABLE) == 0;
  }
  s->device = device;
  return 0;
}

/* A staging pass's start: device's context entered (*saved to leave), the stager's events made
 * there, and the thread's stream of that device. */
static int stage_begin(fr_cuda_stager *s, int device, CUcontext *saved, CUstream *stream) {
  int rc = enter(device, saved);
  if (rc != 0)
    return rc;
  if ((rc = stager_events(s, device)) != 0 || (rc = thread_stream(device, stream)) != 0)
    leave(*saved);
  return rc;
}

/* Queues chunk [off, off+len) of src into buf with the stager's event `done` recorded after it;
 * with a gate, inside it, and the gate's own event (made at its first copy) recorded too. */
static int gated_copy(const fr_cuda_gate *gate, CUstream stream, uint8_t *buf, const uint8_t *src,
                      size_t len, CUevent done) {
  int rc = gate ? gate->enter(gate->arg) : 0;
  if (rc != 0)
    return rc;
  CUresult r =
      cu.cuMemcpyAsync((CUdeviceptr)(uintptr_t)buf, (CUdeviceptr)(uintptr_t)src, len, stream);
  if (r == CUDA_SUCCESS)
    r = cu.cuEventRecord(done, stream);
  if (gate && r == CUDA_SUCCESS && !*gate->event)
    r = cu.cuEventCreate((CUevent *)gate->event, CU_EVENT_DISABLE_TIMING);
  if (gate && r == CUDA_SUCCESS)
    r = cu.cuEventRecord(*gate->event, stream);
  if (gate)
    gate->leave(gate->arg);
  return r == CUDA_SUCCESS ? 0 : cu_fail(r, "cuMemcpyAsync (staging)");
}

int fr_cuda_stage_out_gated(fr_cuda_stager *s, int device, const void *src, size_t n,
                            const fr_cuda_gate *gate,
                            int (*use)(void *arg, const void *buf, size_t len), void *arg) {
  CUcontext saved;
  CUstream stream = NULL;
  int rc = stage_begin(s, device, &saved, &stream);
  if (rc != 0)
    return rc;
  size_t chunks = (n + s->chunk - 1) / s->chunk;
  /* Copy i+1 is queued before chunk i is used, into the other buffer, whose previous chunk
   * (i-1) was used already: the copy engine and `use` (a socket send) overlap. */
  for (size_t i = 0; i <= chunks && rc == 0; i++) {
    if (i < chunks) {
      size_t off = i * s->chunk, len = n - off < s->chunk ? n - off : s->chunk;
      rc = gated_copy(gate, stream, s->buf[i % 2], (const uint8_t *)src + off, len, s->done[i % 2]);
    }
    if (i > 0 && rc == 0) {
      size_t j = i - 1, off = j * s->chunk, len = n - off < s->chunk ? n - off : s->chunk;
      CUresult r = cu.cuEventSynchronize(s->done[j % 2]);
      rc = r != CUDA_SUCCESS ? cu_fail(r, "cuEventSynchronize (staging)")
                             : use(arg, s->buf[j % 2], len);
    }
  }
  if (rc != 0)
    cu.cuStreamSynchronize(stream); /* nothing of ours still writes the buffers */
  leave(saved);
  return rc;
}

int fr_cuda_stage_out(fr_cuda_stager *s, int device, const void *src, size_t n,
                      int (*use)(void *arg, const void *buf, size_t len), void *arg) {
  return fr_cuda_stage_out_gated(s, device, src, n, NULL, use, arg);
}

int fr_cuda_gate_event_finish(int device, void *event, uint64_t deadline_ns) {
  CUcontext saved;
  if (!event || enter(device, &saved) != 0)
    return 0;
  CUresult r;
  /* polled, not cuEventSynchronize: a hung copy must not hold its caller past the deadline */
  while ((r = cu.cuEventQuery((CUevent)event)) == CUDA_ERROR_NOT_READY && fr_now_ns() < deadline_ns)
    usleep(100);
  if (r != CUDA_ERROR_NOT_READY)
    cu.cuEventDestroy((CUevent)event);
  leave(saved);
  return r == CUDA_ERROR_NOT_READY
             ? fr_err(FERRY_ETIMEDOUT, "a device copy still runs at the deadline")
             : 0;
}

int fr_cuda_stage_in(fr_cuda_stager *s, int device, void *dst, size_t n,
                     int (*fill)(void *arg, void *buf, size_t len), void *arg) {
  CUcontext saved;
  CUstream stream = NULL;
  int rc = stage_begin(s, device, &saved, &stream);
  if (rc != 0)
    return rc;
  CUresult r = CUDA_SUCCESS;
  /* Chunk i is filled into buffer i % 2 once that buffer's copy (chunk i-2) finished, and its
   * copy queued: the copy engine moves chunk i while `fill` (a link read) brings chunk i+1. */
  for (size_t off = 0, i = 0; off < n && rc == 0; off += s->chunk, i++) {
    size_t len = n - off < s->chunk ? n - off : s->chunk;
    uint8_t *buf = s->buf[i % 2];
    if (i >= 2 && (r = cu.cuEventSynchronize(s->done[i % 2])) != CUDA_SUCCESS)
      rc = cu_fail(r, "cuEventSynchronize (staging)");
    else if ((rc = fill(arg, buf, len)) == 0 &&
             ((r = cu.cuMemcpyAsync((CUdeviceptr)(uintptr_t)((uint8_t *)dst + off),
                                    (CUdeviceptr)(uintptr_t)buf, len, stream)) != CUDA_SUCCESS ||
              (r = cu.cuEventRecord(s->done[i % 2], stream)) != CUDA_SUCCESS))
      rc = cu_fail(r, "cuMemcpyAsync (staging)");
  }
  /* every copy done (or, on an error, nothing of ours still reads the buffers) */
  if ((r = cu.cuStreamSynchronize(stream)) != CUDA_SUCCESS && rc == 0)
    rc = cu_fail(r, "cuStreamSynchronize (staging)");
  leave(saved);
  return rc;
}

/* Each thread's stager, closed with the thread (fr_cuda_thread_stager_take). */
static pthread_key_t stager_key;
static _Thread_local bool stager_taken;
static int stager_key_err; /* pthread_key_create's, set once */
static pthread_once_t stager_once = PTHREAD_ONCE_INIT;

static void thread_stager_free(void *s) { fr_cuda_stager_close(s); }
static void stager_key_make(void) {
  stager_key_err = pthread_key_create(&stager_key, thread_stager_free);
}

int fr_cuda_thread_stager_take(fr_cuda_stager **out) {
  if (stager_taken)
    return FERRY_EBUSY;
  pthread_once(&stager_once, stager_key_make);
  if (stager_key_err != 0)
    return fr_err(FERRY_ESYS, "a thread's staging buffers: pthread_key_create: %s",
                  strerror(stager_key_err));
  fr_cuda_stager *s = pthread_getspecific(stager_key);
  if (!s) {
    int rc = fr_cuda_stager_open(fr_cuda_chunk_bytes(), &s);
    if (rc != 0)
      return rc;
    if ((rc = pthread_setspecific(stager_key, s)) != 0) {
      fr_cuda_stager_close(s);
      return fr_err(FERRY_ESYS, "a thread's staging buffers: pthread_setspecific: %s",
                    strerror(rc));
    }
  }
  *out = s;
  stager_taken = true;
  return 0;
}

void fr_cuda_thread_stager_give(void) { stager_taken = false; }

/* Pinned memory is the driver's, not a device's: any context registers it (portable: every
 * context sees it pinned). The device's whose copies the buffer serves, so that pinning never
 * makes a context on a device the process does not use (a primary context costs device memory). */
int fr_cuda_pin(int device, void *p, size_t n) {
  CUcontext saved;
  int rc = enter(device, &saved);
  if (rc != 0)
    return rc;
  CUresult r = cu.cuMemHostRegister(p, n, CU_MEMHOSTREGISTER_PORTABLE);
  leave(saved);
  return r == CUDA_SUCCESS ? 0 : cu_fail(r, "cuMemHostRegister");
}

int fr_cuda_unpin(int device, void *p) {
  CUcontext saved;
  int rc = enter(device, &saved);
  if (rc != 0)
    return rc;
  CUresult r = cu.cuMemHostUnregister(p);
  leave(saved);
  return r == CUDA_SUCCESS ? 0 : cu_fail(r, "cuMemHostUnregister");
}

int fr_cuda_alloc(int device, size_t n, void **out) {
  CUcontext saved;
  int rc = enter(device, &saved);
  if (rc != 0)
    return rc;
  CUdeviceptr p = 0;
  CUresult r = cu.cuMemAlloc(&p, n ? n : 1);
  leave(saved);
  if (r != CUDA_SUCCESS)
    return cu_fail(r, "cuMemAlloc");
  *out = (void *)(uintptr_t)p;
  return 0;
}

int fr_cuda_free(void *p) {
  fr_mem_where w = fr_cuda_where(p);
  if (w.kind != FERRY_MEM_CUDA)
    return fr_err(FERRY_EINVAL, "cuda free: %p is not device memory", p);
  CUcontext saved;
  int rc = enter(w.device, &saved);
  if (rc != 0)
    return rc;
  CUresult r = cu.cuMemFree((CUdeviceptr)(uintptr_t)p);
  leave(saved);
  return r == CUDA_SUCCESS ? 0 : cu_fail(r, "cuMemFree");
}

int fr_cuda_ipc_export(const void *ptr, fr_cuda_ipc *out) {
  fr_mem_where w = fr_cuda_where(ptr);
  if (w.kind != FERRY_MEM_CUDA)
    return fr_err(FERRY_EINVAL, "cuda ipc: %p is not device memory", ptr);
  CUcontext saved;
  int rc = enter(w.device, &saved);
  if (rc != 0)
    return rc;
  CUipcMemHandle h;
  CUresult r = cu.cuIpcGetMemHandle(&h, (CUdeviceptr)w.base);
  leave(saved);
  if (r != CUDA_SUCCESS)
    return cu_fail(r, "cuIpcGetMemHandle");
  memset(out, 0, sizeof *out);
  memcpy(out->handle, &h, sizeof h);
  out->offset = (uint64_t)((uintptr_t)ptr - w.base);
  out->alloc_bytes = w.size;
  out->device = w.device;
  return 0;
}

int fr_cuda_ipc_open(const fr_cuda_ipc *h, int device, void **base) {
  int rc = fr_cuda_load();
  if (rc != 0)
    return rc;
  if (device < 0)
    device = h->device >= 0 && h->device < drv.devices ? h->device : 0;
  CUcontext saved;
  if ((rc = enter(device, &saved)) != 0)
    return rc;
  CUipcMemHandle handle;
  memcpy(&handle, h->handle, sizeof handle);
  CUdeviceptr p = 0;
  CUresult r = cu.cuIpcOpenMemHandle(&p, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  leave(saved);
  if (r != CUDA_SUCCESS)
    return cu_fail(r, "cuIpcOpenMemHandle");
  /* The peer's word for the size is not trusted: bounds come from the mapping itself. */
  fr_mem_where w = fr_cuda_where((void *)(uintptr_t)p);
  if (w.kind != FERRY_MEM_CUDA || w.base != (uintptr_t)p || w.size < h->alloc_bytes) {
    fr_cuda_ipc_close((void *)(uintptr_t)p);
    return fr_err(FERRY_EPROTO, "cuda ipc: the mapped allocation is %zu bytes, not the %llu sent",
                  w.size, (unsigned long long)h->alloc_bytes);
  }
  *base = (void *)(uintptr_t)p;
  return 0;
}

int fr_cuda_ipc_close(void *base) {
  fr_mem_where w = fr_cuda_where(base);
  CUcontext saved;
  int rc = enter(w.device >= 0 ? w.device : 0, &saved);
  if (rc != 0)
    return rc;
  CUresult r = cu.cuIpcCloseMemHandle((CUdeviceptr)(uintptr_t)base);
  leave(saved);
  return r == CUDA_SUCCESS ? 0 : cu_fail(r, "cuIpcCloseMemHandle");
}

/* ---- the public calls (ferry.h) ---- */

int ferry_cuda_info_get(ferry_cuda_info *out) {
  if (!out || out->size < sizeof *out || out->size > FR_OPTS_MAX)
    return fr_err(FERRY_EINVAL, "ferry_cuda_info_get: size must be sizeof(ferry_cuda_info)");
  size_t size = out->size;
  memset(out, 0, sizeof *out);
  out->size = size;
  bool found = fr_cuda_load() == 0;
  fr_err_clear();
  out->found = found;
  out->driver_version = drv.driver_version;
  out->devices = drv.devices;
  fr_str_copy(out->library, sizeof out->library, drv.library);
  snprintf(out->detail, sizeof out->detail, "%.255s", found ? "" : drv.detail);
  return 0;
}

int ferry_cuda_device(int device, char *name, size_t name_len, uint64_t *total_bytes) {
  int rc = fr_cuda_load();
  if (rc != 0)
    return rc;
  if (device < 0 || device >= drv.devices)
    return fr_err(FERRY_ERANGE, "cuda: no device %d (%d found)", device, drv.devices);
  CUdevice dev;
  CUresult r = cu.cuDeviceGet(&dev, device);
  if (r != CUDA_SUCCESS)
    return cu_fail(r, "cuDeviceGet");
  if (name && name_len && (r = cu.cuDeviceGetName(name, (int)name_len, dev)) != CUDA_SUCCESS)
    return cu_fail(r, "cuDeviceGetName");
  size_t total = 0;
  if (total_bytes && (r = cu.cuDeviceTotalMem(&total, dev)) != CUDA_SUCCESS)
    return cu_fail(r, "cuDeviceTotalMem");
  if (total_bytes)
    *total_bytes = total;
  return 0;
}

ferry_mem_kind ferry_mem_where(const void *ptr, int *device) {
  fr_mem_where w = fr_cuda_where(ptr);
  if (device)
    *device = w.device;
  return w.kind;
}

int ferry_mem_copy(void *dst, const void *src, size_t n) {
  if (n && (!dst || !src))
    return fr_err(FERRY_EINVAL, "ferry_mem_copy: NULL buffer");
  return fr_cuda_copy(dst, src, n);
}

int ferry_cuda_alloc(int device, size_t n, void **out) {
  if (!out)
    return fr_err(FERRY_EINVAL, "ferry_cuda_alloc: out is NULL");
  return fr_cuda_alloc(device, n, out);
}

int ferry_cuda_free(void *ptr) { return fr_cuda_free(ptr); }
