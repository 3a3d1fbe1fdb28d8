/*
 * libferry_cudastub.so: a stand-in for the CUDA driver (libcuda.so.1) that the tests load through
 * FERRY_CUDA_LIB on machines without a GPU. It exports the driver entry points ferry uses, with
 * the driver's signatures and error codes, over host memory: a device allocation is a memfd
 * mapped twice, once PROT_NONE at the address handed out (so host code that touches "device"
 * memory directly faults, as it would on a GPU) and once read-write for the stub's own copies.
 * Work on a stream waits in a queue until something synchronizes it, so a missing
 * synchronization shows up as stale bytes; IPC handles name the owner's memfd, which another
 * process opens through /proc. Its whole value is to make tests fail where ferry would misuse
 * the real driver, so it refuses what the driver refuses. Only the cu* entry points are exported
 * (cuStubCopyCounts and cuStubPinCounts, the stand-in's counts of copies and pinning, are for
 * tests); everything else is static. It may read its own settings from the environment: it is a
 * test library, not part of ferry. FERRY_CUDASTUB_DEVICES (default 2) and FERRY_CUDASTUB_MEM_MB
 * (default 4096, a limit per device, page-rounded allocations counted) are read by cuInit.
 *
 * Where it is stricter than, or chooses between readings of, the driver: every stream behaves as
 * CU_STREAM_NON_BLOCKING (nothing but its own synchronization runs its queue, and the NULL stream
 * runs work at once); cuMemcpyHtoD/DtoH/DtoD refuse a device side that is not in an allocation
 * (cuMemcpy and cuMemcpyAsync take any mix); ranges are checked against the size asked for, not
 * the rounded mapping, and cuMemAlloc places allocations ascending and end to end (256 bytes),
 * so that a copy running from one into the next is refused as the driver refuses it; the last
 * cuDevicePrimaryCtxRelease resets the context (its memory, streams and registrations go);
 * cuIpcGetMemHandle of IPC-opened memory is refused. As in the driver, cuDriverGetVersion and the
 * error strings need no cuInit.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
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
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_MAP_FAILED = 205,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
  CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
  CUDA_ERROR_NOT_SUPPORTED = 801,
};
enum {
  ATTR_CONTEXT = 1,
  ATTR_MEMORY_TYPE = 2,
  ATTR_DEVICE_POINTER = 3,
  ATTR_HOST_POINTER = 4,
  ATTR_DEVICE_ORDINAL = 9,
  ATTR_RANGE_START_ADDR = 11,
  ATTR_RANGE_SIZE = 12,
  ATTR_MAPPED = 13,
};
enum { MEMTYPE_HOST = 1, MEMTYPE_DEVICE = 2 };
enum { STREAM_NON_BLOCKING = 1, IPC_LAZY_PEER = 1, HOSTREGISTER_PORTABLE = 1 };

#define MAX_DEVICES 64
#define IPC_MAGIC 0x6275747361647563ull /* "cudastub" */
#define DRIVER_VERSION 12080

struct CUctx_st {
  int device;
  int refs; /* primary-context retains; 0 = reset, unusable */
};

/* A device allocation, made here or opened from another process's IPC handle. `size` is what
 * the caller asked for (ranges are checked against it), `maplen` the page-rounded mapping. */
struct alloc {
  uint64_t dptr;
  char *backing;
  size_t size, maplen;
  int fd, device;
  bool ipc;
  bool arena; /* dptr is an address in the arena, not a mapping (map_device) */
  int refs;   /* IPC opens of the same handle in this process */
  int32_t owner;
  uint64_t id;
};

struct reg {
  uintptr_t base;
  size_t size;
  int device;
};

/* A queued operation: a copy between two (device or host) addresses, or a wait for another
 * stream to have run its first `target` operations (cuStreamWaitEvent). */
struct op {
  bool wait;
  uint64_t dst, src, n;
  uint64_t stream_id, target;
};

struct CUstream_st {
  uint64_t id;
  int device;
  struct op *ops;
  size_t cap;
  uint64_t queued, done; /* ops[i] for done <= i < queued is pending */
  CUresult err;          /* a queued copy whose memory was gone when it ran */
  struct CUstream_st *next;
};

struct CUevent_st {
  bool recorded;
  uint64_t stream_id, target; /* stream 0: the NULL stream, complete at once */
  struct CUevent_st *next;
};

/* One lock for everything: the stub is for correctness, not speed, and queued copies run under
 * it so they never race a free. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static bool initialized;
static int ndevices;
static size_t device_mem;
static struct CUctx_st contexts[MAX_DEVICES];
static size_t device_used[MAX_DEVICES];
static struct alloc *allocs;
static size_t nallocs, cap_allocs;
static struct reg *regs;
static size_t nregs, cap_regs;
static struct CUstream_st *streams;
static struct CUevent_st *events;
static uint64_t next_id = 1;
static _Thread_local struct CUctx_st *current;

static int grow(void **arr, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap)
    return 0;
  size_t n = *cap ? *cap * 2 : 16;
  while (n < need)
    n *= 2;
  void *p = realloc(*arr, n * elem);
  if (!p)
    return -1;
  *arr = p;
  *cap = n;
  return 0;
}

/* A setting: unset gives the default, anything but a whole number in [0, max] is refused. */
static int setting(const char *name, long dflt, long max, long *out) {
  const char *s = getenv(name);
  if (!s || !*s) {
    *out = dflt;
    return 0;
  }
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end || v < 0 || v > max) {
    fprintf(stderr, "cudastub: %s='%s': want a whole number from 0 to %ld\n", name, s, max);
    return -1;
  }
  *out = v;
  return 0;
}

/* The calling thread's usable context, or NULL (none set, or reset by its last release). */
static struct CUctx_st *ctx_now(void) { return current && current->refs > 0 ? current : NULL; }

/* Entry checks every call starts with; the lock is held when they pass. */
#define ENTER_INIT()                                                                               \
  pthread_mutex_lock(&lock);                                                                       \
  if (!initialized)                                                                                \
    return unlock_rc(CUDA_ERROR_NOT_INITIALIZED);
#define ENTER_CTX()                                                                                \
  ENTER_INIT();                                                                                    \
  if (!ctx_now())                                                                                  \
    return unlock_rc(CUDA_ERROR_INVALID_CONTEXT);

static CUresult unlock_rc(CUresult rc) {
  pthread_mutex_unlock(&lock);
  return rc;
}

static size_t page_round(size_t n) {
  size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  return (n + pg - 1) / pg * pg;
}

/* The allocation that holds address a (within the size asked for), or NULL. */
static struct alloc *find_alloc(uint64_t a) {
  for (size_t i = 0; i < nallocs; i++)
    if (a >= allocs[i].dptr && a - allocs[i].dptr < allocs[i].size)
      return &allocs[i];
  return NULL;
}

static struct reg *find_reg(uintptr_t a) {
  for (size_t i = 0; i < nregs; i++)
    if (a >= regs[i].base && a - regs[i].base < regs[i].size)
      return &regs[i];
  return NULL;
}

/* Where the stub reads or writes n bytes at address a: the backing of a device allocation, or
 * the host address itself. A device range that leaves its allocation, or a host range that runs
 * into a device mapping, is refused rather than faulted on. */
static CUresult translate(uint64_t a, uint64_t n, char **out) {
  struct alloc *al = find_alloc(a);
  if (al) {
    if (n > al->size - (a - al->dptr))
      return CUDA_ERROR_INVALID_VALUE;
    *out = al->backing + (a - al->dptr);
    return CUDA_SUCCESS;
  }
  if (a == 0 || a + n < a)
    return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < nallocs; i++)
    if (a < allocs[i].dptr + allocs[i].maplen && allocs[i].dptr < a + n)
      return CUDA_ERROR_INVALID_VALUE;
  *out = (char *)(uintptr_t)a;
  return CUDA_SUCCESS;
}

/* The copies made, by kind (cuStubCopyCounts): host to device, device to host, device to
 * device, and device to device with a side opened through IPC. Under lock. */
enum { COUNT_HTOD, COUNT_DTOH, COUNT_DTOD, COUNT_DTOD_IPC, COUNT_KINDS };
static unsigned long long copy_counts[COUNT_KINDS];
/* cuStubPinCounts: successful cuMemHostRegister calls, and host/device copies whose host side
 * was registered (pinned) memory. Under lock. */
static unsigned long long pin_calls, pinned_copies;

static void count_copy(uint64_t dst, uint64_t src) {
  struct alloc *d = find_alloc(dst), *s = find_alloc(src);
  if (d && s)
    copy_counts[d->ipc || s->ipc ? COUNT_DTOD_IPC : COUNT_DTOD]++;
  else if (d || s)
    copy_counts[d ? COUNT_HTOD : COUNT_DTOH]++;
  if ((d || s) && !(d && s) && find_reg(d ? src : dst))
    pinned_copies++;
}

static CUresult copy_now(uint64_t dst, uint64_t src, uint64_t n) {
  if (n == 0)
    return CUDA_SUCCESS;
  char *d, *s;
  CUresult rc = translate(dst, n, &d);
  if (rc == CUDA_SUCCESS)
    rc = translate(src, n, &s);
  if (rc == CUDA_SUCCESS) {
    count_copy(dst, src);
    memmove(d, s, n);
  }
  return rc;
}

static struct CUstream_st *find_stream(uint64_t id) {
  for (struct CUstream_st *s = streams; s; s = s->next)
    if (s->id == id)
      return s;
  return NULL;
}

static bool stream_valid(CUstream st) {
  for (struct CUstream_st *s = streams; s; s = s->next)
    if (s == st)
      return true;
  return false;
}

static bool event_valid(CUevent ev) {
  for (struct CUevent_st *e = events; e; e = e->next)
    if (e == ev)
      return true;
  return false;
}

/* Runs stream s's queued operations up to (not including) number `target`. Waits can only name
 * operations queued before them, so the recursion ends; the head moves before an op runs. */
static void run_stream(struct CUstream_st *s, uint64_t target) {
  while (s->done < target && s->done < s->queued) {
    struct op o = s->ops[s->done % s->cap];
    s->done++;
    if (o.wait) {
      struct CUstream_st *other = find_stream(o.stream_id);
      if (other)
        run_stream(other, o.target);
    } else if (copy_now(o.dst, o.src, o.n) != CUDA_SUCCESS && s->err == CUDA_SUCCESS) {
      fprintf(stderr, "cudastub: a queued copy's memory was gone when it ran\n");
      s->err = CUDA_ERROR_INVALID_VALUE;
    }
  }
}

/* The driver finishes outstanding work before memory goes away (cuMemFree synchronizes). */
static void run_all(void) {
  for (struct CUstream_st *s = streams; s; s = s->next)
    run_stream(s, s->queued);
}

/* Queues an op on s: a ring of ops[done..queued), grown by re-laying it out in order. */
static CUresult enqueue(struct CUstream_st *s, struct op o) {
  if (s->queued - s->done == s->cap) {
    size_t ncap = s->cap ? s->cap * 2 : 16;
    struct op *n = malloc(ncap * sizeof *n);
    if (!n)
      return CUDA_ERROR_OUT_OF_MEMORY;
    for (uint64_t i = s->done; i < s->queued; i++)
      n[i % ncap] = s->ops[i % s->cap];
    free(s->ops);
    s->ops = n;
    s->cap = ncap;
  }
  s->ops[s->queued % s->cap] = o;
  s->queued++;
  return CUDA_SUCCESS;
}

static void drop_alloc(struct alloc *al) {
  if (!al->arena)
    munmap((void *)(uintptr_t)al->dptr, al->maplen);
  munmap(al->backing, al->maplen);
  close(al->fd);
  if (!al->ipc)
    device_used[al->device] -= al->maplen;
  *al = allocs[--nallocs];
}

/* Maps memfd fd the two ways: PROT_NONE where the caller sees it, read-write for the stub. */
static CUresult map_twice(int fd, size_t maplen, uint64_t *dptr, char **backing) {
  void *dev = mmap(NULL, maplen, PROT_NONE, MAP_SHARED, fd, 0);
  if (dev == MAP_FAILED)
    return CUDA_ERROR_MAP_FAILED;
  void *rw = mmap(NULL, maplen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (rw == MAP_FAILED) {
    munmap(dev, maplen);
    return CUDA_ERROR_MAP_FAILED;
  }
  *dptr = (uintptr_t)dev;
  *backing = rw;
  return CUDA_SUCCESS;
}

/* The memfd's name says whose allocation it is, so an IPC handle can be checked against it. */
static void memfd_name(char *buf, size_t len, int32_t pid, uint64_t id, uint64_t size) {
  snprintf(buf, len, "ferry-cudastub-%d-%llu-%llu", (int)pid, (unsigned long long)id,
           (unsigned long long)size);
}

/* --- initialization, devices, contexts --------------------------------------------------- */

CUresult cuInit(unsigned flags) {
  if (flags != 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&lock);
  if (!initialized) {
    long n, mb;
    if (setting("FERRY_CUDASTUB_DEVICES", 2, MAX_DEVICES, &n) ||
        setting("FERRY_CUDASTUB_MEM_MB", 4096, 1L << 24, &mb))
      return unlock_rc(CUDA_ERROR_INVALID_VALUE);
    ndevices = (int)n;
    device_mem = (size_t)mb << 20;
    for (int i = 0; i < MAX_DEVICES; i++)
      contexts[i].device = i;
    initialized = true;
  }
  return unlock_rc(CUDA_SUCCESS);
}

/* Like the driver, the version and the error strings need no cuInit. */
CUresult cuDriverGetVersion(int *v) {
  if (!v)
    return CUDA_ERROR_INVALID_VALUE;
  *v = DRIVER_VERSION;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
  ENTER_INIT();
  if (!count)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  *count = ndevices;
  return unlock_rc(CUDA_SUCCESS);
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
  ENTER_INIT();
  if (!dev)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  if (ordinal < 0 || ordinal >= ndevices)
    return unlock_rc(CUDA_ERROR_INVALID_DEVICE);
  *dev = ordinal;
  return unlock_rc(CUDA_SUCCESS);
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
  ENTER_INIT();
  if (!name || len <= 0)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  if (dev < 0 || dev >= ndevices)
    return unlock_rc(CUDA_ERROR_INVALID_DEVICE);
  snprintf(name, (size_t)len, "ferry cudastub device %d", dev);
  return unlock_rc(CUDA_SUCCESS);
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
  ENTER_INIT();
  if (!bytes)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  if (dev < 0 || dev >= ndevices)
    return unlock_rc(CUDA_ERROR_INVALID_DEVICE);
  *bytes = device_mem;
  return unlock_rc(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
  ENTER_INIT();
  if (!ctx)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  if (dev < 0 || dev >= ndevices)
    return unlock_rc(CUDA_ERROR_INVALID_DEVICE);
  contexts[dev].refs++;
  *ctx = &contexts[dev];
  return unlock_rc(CUDA_SUCCESS);
}

/* The last release resets the primary context as the driver does: its streams, events and
 * memory are gone, and a thread that still has it current gets CUDA_ERROR_INVALID_CONTEXT. */
static void reset_context(int dev) {
  run_all();
  for (struct CUstream_st **p = &streams; *p;) {
    struct CUstream_st *s = *p;
    if (s->device == dev) {
      *p = s->next;
      free(s->ops);
      free(s);
    } else {
      p = &s->next;
    }
  }
  for (size_t i = nallocs; i-- > 0;)
    if (allocs[i].device == dev)
      drop_alloc(&allocs[i]);
  for (size_t i = nregs; i-- > 0;)
    if (regs[i].device == dev)
      regs[i] = regs[--nregs];
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  ENTER_INIT();
  if (dev < 0 || dev >= ndevices)
    return unlock_rc(CUDA_ERROR_INVALID_DEVICE);
  if (contexts[dev].refs == 0)
    return unlock_rc(CUDA_ERROR_INVALID_CONTEXT);
  if (--contexts[dev].refs == 0)
    reset_context(dev);
  return unlock_rc(CUDA_SUCCESS);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
  ENTER_INIT();
  if (ctx && (ctx < contexts || ctx >= contexts + ndevices || ctx->refs == 0))
    return unlock_rc(CUDA_ERROR_INVALID_CONTEXT);
  current = ctx;
  return unlock_rc(CUDA_SUCCESS);
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
  ENTER_INIT();
  if (!ctx)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  *ctx = current;
  return unlock_rc(CUDA_SUCCESS);
}

CUresult cuCtxGetDevice(CUdevice *dev) {
  ENTER_CTX();
  if (!dev)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  *dev = current->device;
  return unlock_rc(CUDA_SUCCESS);
}

/* --- errors -------------------------------------------------------------------------------- */

#define ERRORS(X)                                                                                  \
  X(CUDA_SUCCESS, "no error")                                                                      \
  X(CUDA_ERROR_INVALID_VALUE, "invalid argument")                                                  \
  X(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")                                                     \
  X(CUDA_ERROR_NOT_INITIALIZED, "initialization error")                                            \
  X(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected")                                    \
  X(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal")                                           \
  X(CUDA_ERROR_INVALID_CONTEXT, "invalid device context")                                          \
  X(CUDA_ERROR_MAP_FAILED, "mapping of buffer object failed")                                      \
  X(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle")                                          \
  X(CUDA_ERROR_NOT_READY, "device not ready")                                                      \
  X(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,                                                     \
    "part or all of the requested memory range is already mapped")                                 \
  X(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "pointer does not correspond to a registered memory "   \
                                           "region")                                               \
  X(CUDA_ERROR_NOT_SUPPORTED, "operation not supported")

CUresult cuGetErrorString(CUresult rc, const char **str) {
  if (!str)
    return CUDA_ERROR_INVALID_VALUE;
#define S_(code, text)                                                                             \
  if (rc == code) {                                                                                \
    *str = text;                                                                                   \
    return CUDA_SUCCESS;                                                                           \
  }
  ERRORS(S_)
#undef S_
  *str = NULL;
  return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult rc, const char **str) {
  if (!str)
    return CUDA_ERROR_INVALID_VALUE;
#define N_(code, text)                                                                             \
  if (rc == code) {                                                                                \
    *str = #code;                                                                                  \
    return CUDA_SUCCESS;                                                                           \
  }
  ERRORS(N_)
#undef N_
  *str = NULL;
  return CUDA_ERROR_INVALID_VALUE;
}

/* --- pointers ------------------------------------------------------------------------------ */

static CUresult device_attribute(void *data, int attr, struct alloc *al, CUdeviceptr p) {
  switch (attr) {
  case ATTR_CONTEXT:
    *(CUcontext *)data = &contexts[al->device];
    return CUDA_SUCCESS;
  case ATTR_MEMORY_TYPE:
    *(unsigned *)data = MEMTYPE_DEVICE;
    return CUDA_SUCCESS;
  case ATTR_DEVICE_POINTER:
    *(CUdeviceptr *)data = p;
    return CUDA_SUCCESS;
  case ATTR_DEVICE_ORDINAL:
    *(int *)data = al->device;
    return CUDA_SUCCESS;
  case ATTR_RANGE_START_ADDR:
    *(CUdeviceptr *)data = al->dptr;
    return CUDA_SUCCESS;
  case ATTR_RANGE_SIZE:
    *(size_t *)data = al->size;
    return CUDA_SUCCESS;
  case ATTR_MAPPED:
    *(bool *)data = true;
    return CUDA_SUCCESS;
  default:
    return CUDA_ERROR_INVALID_VALUE; /* HOST_POINTER too: device memory has none */
  }
}

static CUresult host_attribute(void *data, int attr, struct reg *r, CUdeviceptr p) {
  switch (attr) {
  case ATTR_CONTEXT:
    *(CUcontext *)data = &contexts[r->device];
    return CUDA_SUCCESS;
  case ATTR_MEMORY_TYPE:
    *(unsigned *)data = MEMTYPE_HOST;
    return CUDA_SUCCESS;
  case ATTR_DEVICE_POINTER:
    *(CUdeviceptr *)data = p;
    return CUDA_SUCCESS;
  case ATTR_HOST_POINTER:
    *(void **)data = (void *)(uintptr_t)p;
    return CUDA_SUCCESS;
  case ATTR_DEVICE_ORDINAL:
    *(int *)data = r->device;
    return CUDA_SUCCESS;
  case ATTR_RANGE_START_ADDR:
    *(CUdeviceptr *)data = r->base;
    return CUDA_SUCCESS;
  case ATTR_RANGE_SIZE:
    *(size_t *)data = r->size;
    return CUDA_SUCCESS;
  case ATTR_MAPPED:
    *(bool *)data = true;
    return CUDA_SUCCESS;
  default:
    return CUDA_ERROR_INVALID_VALUE;
  }
}

CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
  ENTER_INIT();
  if (!data)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  struct alloc *al = find_alloc(p);
  if (al)
    return unlock_rc(device_attribute(data, attr, al, p));
  struct reg *r = find_reg((uintptr_t)p);
  if (r)
    return unlock_rc(host_attribute(data, attr, r, p));
  return unlock_rc(CUDA_ERROR_INVALID_VALUE);
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
  ENTER_INIT();
  struct alloc *al = find_alloc(p);
  if (!al)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  if (base)
    *base = al->dptr;
  if (size)
    *size = al->size;
  return unlock_rc(CUDA_SUCCESS);
}

/* --- memory -------------------------------------------------------------------------------- */

/* Device addresses of cuMemAlloc, as the driver hands them out: ascending, each allocation right
 * after the one before (256-byte aligned, as cuMemAlloc's are), so that two allocations may lie end
 * to end and a copy that runs from one into the next is refused (translate), as the real driver
 * refuses it (CUDA_ERROR_INVALID_VALUE: 088e316, found on an H200). The addresses are numbers in a
 * PROT_NONE reservation of ARENA_BYTES (a CPU access faults, as device memory does), never reused;
 * the stub reads and writes the memfd's own mapping. Without the reservation, or past its end,
 * the memfd is mapped PROT_NONE where the kernel places it (map_twice). */
#define ARENA_BYTES (1ull << 40)
static uint64_t arena_next, arena_end;

static CUresult map_device(int fd, size_t size, size_t maplen, struct alloc *al) {
  if (!arena_end) {
    void *r =
        mmap(NULL, ARENA_BYTES, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    arena_next = r == MAP_FAILED ? 1 : (uintptr_t)r;
    arena_end = r == MAP_FAILED ? 1 : arena_next + ARENA_BYTES;
  }
  size_t span = (size + 255) & ~(size_t)255;
  if (arena_end - arena_next < span)
    return map_twice(fd, maplen, &al->dptr, &al->backing);
  void *rw = mmap(NULL, maplen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (rw == MAP_FAILED)
    return CUDA_ERROR_MAP_FAILED;
  al->dptr = arena_next;
  al->backing = rw;
  al->arena = true;
  arena_next += span;
  return CUDA_SUCCESS;
}

static CUresult alloc_locked(CUdeviceptr *out, size_t size) {
  int dev = current->device;
  size_t maplen = page_round(size);
  if (maplen < size || maplen > device_mem - device_used[dev])
    return CUDA_ERROR_OUT_OF_MEMORY;
  if (grow((void **)&allocs, &cap_allocs, nallocs + 1, sizeof *allocs))
    return CUDA_ERROR_OUT_OF_MEMORY;
  uint64_t id = next_id++;
  char name[64];
  memfd_name(name, sizeof name, getpid(), id, size);
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0)
    return CUDA_ERROR_OUT_OF_MEMORY;
  struct alloc al = {
      .size = size, .maplen = maplen, .fd = fd, .device = dev, .owner = getpid(), .id = id};
  CUresult rc =
      ftruncate(fd, (off_t)maplen) ? CUDA_ERROR_OUT_OF_MEMORY : map_device(fd, size, maplen, &al);
  if (rc != CUDA_SUCCESS) {
    close(fd);
    return rc == CUDA_ERROR_MAP_FAILED ? CUDA_ERROR_OUT_OF_MEMORY : rc;
  }
  allocs[nallocs++] = al;
  device_used[dev] += maplen;
  *out = al.dptr;
  return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t size) {
  ENTER_CTX();
  if (!out || size == 0)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  return unlock_rc(alloc_locked(out, size));
}

CUresult cuMemFree_v2(CUdeviceptr p) {
  ENTER_CTX();
  struct alloc *al = find_alloc(p);
  if (!al || al->dptr != p || al->ipc)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  run_all();
  drop_alloc(al);
  return unlock_rc(CUDA_SUCCESS);
}

CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned flags) {
  ENTER_CTX();
  uintptr_t a = (uintptr_t)p;
  if (!p || size == 0 || a + size < a || (flags & ~(unsigned)HOSTREGISTER_PORTABLE))
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  for (size_t i = 0; i < nregs; i++)
    if (a < regs[i].base + regs[i].size && regs[i].base < a + size)
      return unlock_rc(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  char *check;
  if (translate(a, size, &check) != CUDA_SUCCESS || find_alloc(a))
    return unlock_rc(CUDA_ERROR_INVALID_VALUE); /* device memory is not host memory */
  if (grow((void **)&regs, &cap_regs, nregs + 1, sizeof *regs))
    return unlock_rc(CUDA_ERROR_OUT_OF_MEMORY);
  regs[nregs++] = (struct reg){.base = a, .size = size, .device = current->device};
  pin_calls++;
  return unlock_rc(CUDA_SUCCESS);
}

CUresult cuMemHostUnregister(void *p) {
  ENTER_CTX();
  for (size_t i = 0; i < nregs; i++)
    if (regs[i].base == (uintptr_t)p) {
      regs[i] = regs[--nregs];
      return unlock_rc(CUDA_SUCCESS);
    }
  return unlock_rc(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
}

/* The synchronous copies run at once and leave every stream's queue alone, as a
 * CU_STREAM_NON_BLOCKING stream's work is not ordered after them. The flavours that name a side
 * as device memory refuse an address that is not in an allocation (a freed one, say) rather than
 * reading it as host memory. */
static CUresult copy_sync(uint64_t dst, uint64_t src, size_t n, bool dst_dev, bool src_dev) {
  ENTER_CTX();
  if ((dst_dev && !find_alloc(dst)) || (src_dev && !find_alloc(src)))
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  return unlock_rc(copy_now(dst, src, n));
}

CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  return copy_sync(dst, src, n, false, false);
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
  return copy_sync(dst, (uintptr_t)src, n, true, false);
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
  return copy_sync((uintptr_t)dst, src, n, false, true);
}

CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  return copy_sync(dst, src, n, true, true);
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream st) {
  ENTER_CTX();
  if (!st)
    return unlock_rc(copy_now(dst, src, n));
  if (!stream_valid(st))
    return unlock_rc(CUDA_ERROR_INVALID_HANDLE);
  char *d, *s;
  CUresult rc = translate(dst, n, &d);
  if (rc == CUDA_SUCCESS)
    rc = translate(src, n, &s);
  if (rc == CUDA_SUCCESS && n > 0)
    rc = enqueue(st, (struct op){.dst = dst, .src = src, .n = n});
  return unlock_rc(rc);
}

CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) {
  ENTER_CTX();
  if (n == 0)
    return unlock_rc(CUDA_SUCCESS);
  char *d;
  if (!find_alloc(p) || translate(p, n, &d) != CUDA_SUCCESS)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  memset(d, v, n);
  return unlock_rc(CUDA_SUCCESS);
}

/* --- streams and events -------------------------------------------------------------------- */

CUresult cuStreamCreate(CUstream *out, unsigned flags) {
  ENTER_CTX();
  if (!out || (flags & ~(unsigned)STREAM_NON_BLOCKING))
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  struct CUstream_st *s = calloc(1, sizeof *s);
  if (!s)
    return unlock_rc(CUDA_ERROR_OUT_OF_MEMORY);
  s->id = next_id++;
  s->device = current->device;
  s->next = streams;
  streams = s;
  *out = s;
  return unlock_rc(CUDA_SUCCESS);
}

/* Pending work completes before the stream goes, as on the device. */
CUresult cuStreamDestroy_v2(CUstream st) {
  ENTER_CTX();
  if (!st || !stream_valid(st))
    return unlock_rc(CUDA_ERROR_INVALID_HANDLE);
  run_stream(st, st->queued);
  for (struct CUstream_st **p = &streams; *p; p = &(*p)->next)
    if (*p == st) {
      *p = st->next;
      break;
    }
  free(st->ops);
  free(st);
  return unlock_rc(CUDA_SUCCESS);
}

/* The NULL stream's work ran when it was issued, and non-blocking streams do not wait for it. */
CUresult cuStreamSynchronize(CUstream st) {
  ENTER_CTX();
  if (!st)
    return unlock_rc(CUDA_SUCCESS);
  if (!stream_valid(st))
    return unlock_rc(CUDA_ERROR_INVALID_HANDLE);
  run_stream(st, st->queued);
  return unlock_rc(st->err);
}

CUresult cuEventCreate(CUevent *out, unsigned flags) {
  ENTER_CTX();
  if (!out || flags > 0xf)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  struct CUevent_st *e = calloc(1, sizeof *e);
  if (!e)
    return unlock_rc(CUDA_ERROR_OUT_OF_MEMORY);
  e->next = events;
  events = e;
  *out = e;
  return unlock_rc(CUDA_SUCCESS);
}

CUresult cuEventRecord(CUevent ev, CUstream st) {
  ENTER_CTX();
  if (!ev || !event_valid(ev) || (st && !stream_valid(st)))
    return unlock_rc(CUDA_ERROR_INVALID_HANDLE);
  ev->recorded = true;
  ev->stream_id = st ? st->id : 0;
  ev->target = st ? st->queued : 0;
  return unlock_rc(CUDA_SUCCESS);
}

/* The stream an event waits on, or NULL when the event is complete (never recorded, recorded
 * on the NULL stream, or its stream gone, which ran its work first). */
static struct CUstream_st *event_stream(CUevent ev) {
  if (!ev->recorded || ev->stream_id == 0)
    return NULL;
  return find_stream(ev->stream_id);
}

CUresult cuEventSynchronize(CUevent ev) {
  ENTER_CTX();
  if (!ev || !event_valid(ev))
    return unlock_rc(CUDA_ERROR_INVALID_HANDLE);
  struct CUstream_st *s = event_stream(ev);
  if (s)
    run_stream(s, ev->target);
  return unlock_rc(CUDA_SUCCESS);
}

CUresult cuEventQuery(CUevent ev) {
  ENTER_CTX();
  if (!ev || !event_valid(ev))
    return unlock_rc(CUDA_ERROR_INVALID_HANDLE);
  struct CUstream_st *s = event_stream(ev);
  return unlock_rc(s && s->done < ev->target ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS);
}

CUresult cuEventDestroy_v2(CUevent ev) {
  ENTER_CTX();
  for (struct CUevent_st **p = &events; *p; p = &(*p)->next)
    if (*p == ev) {
      *p = ev->next;
      free(ev);
      return unlock_rc(CUDA_SUCCESS);
    }
  return unlock_rc(CUDA_ERROR_INVALID_HANDLE);
}

/* The wait names the event's latest record as of now; the NULL stream waits at once. */
CUresult cuStreamWaitEvent(CUstream st, CUevent ev, unsigned flags) {
  ENTER_CTX();
  if (flags != 0)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  if (!ev || !event_valid(ev) || (st && !stream_valid(st)))
    return unlock_rc(CUDA_ERROR_INVALID_HANDLE);
  struct CUstream_st *other = event_stream(ev);
  if (!other || other->done >= ev->target)
    return unlock_rc(CUDA_SUCCESS);
  if (!st) {
    run_stream(other, ev->target);
    return unlock_rc(CUDA_SUCCESS);
  }
  return unlock_rc(
      enqueue(st, (struct op){.wait = true, .stream_id = other->id, .target = ev->target}));
}

/* --- IPC ----------------------------------------------------------------------------------- */

/* The 64 bytes of a CUipcMemHandle, as the stub lays them out (tests/cudastub_test.c forges
 * them by these offsets: magic 0, pid 8, fd 12, size 16, device 24, id 32). */
struct ipc_handle {
  uint64_t magic;
  int32_t pid, fd;
  uint64_t size;
  int32_t device, pad;
  uint64_t id;
};
_Static_assert(sizeof(struct ipc_handle) <= sizeof(CUipcMemHandle), "handle fits");

CUresult cuIpcGetMemHandle(CUipcMemHandle *out, CUdeviceptr p) {
  ENTER_CTX();
  struct alloc *al = find_alloc(p);
  if (!out || !al || al->ipc)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  struct ipc_handle h = {.magic = IPC_MAGIC,
                         .pid = al->owner,
                         .fd = al->fd,
                         .size = al->size,
                         .device = al->device,
                         .id = al->id};
  memset(out, 0, sizeof *out);
  memcpy(out, &h, sizeof h);
  return unlock_rc(CUDA_SUCCESS);
}

/* Opens the owner's memfd through /proc and checks it is the allocation the handle names: its
 * name carries the owner's pid, the allocation id and size, its length the rounded size. */
static CUresult open_owner_fd(const struct ipc_handle *h, size_t maplen, int *out) {
  char path[64], want[128], got[128];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)h->pid, (int)h->fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0)
    return CUDA_ERROR_INVALID_HANDLE; /* owner gone, or the fd closed by its cuMemFree */
  char name[80];
  memfd_name(name, sizeof name, h->pid, h->id, h->size);
  snprintf(want, sizeof want, "/memfd:%s (deleted)", name);
  ssize_t n = readlink(path, got, sizeof got - 1);
  struct stat st;
  if (n < 0 || (size_t)n != strlen(want) || memcmp(got, want, (size_t)n) != 0 || fstat(fd, &st) ||
      (size_t)st.st_size != maplen) {
    close(fd);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  *out = fd;
  return CUDA_SUCCESS;
}

static CUresult ipc_open_locked(CUdeviceptr *out, const struct ipc_handle *h) {
  if (h->magic != IPC_MAGIC || h->size == 0 || h->pid <= 0 || h->fd < 0)
    return CUDA_ERROR_INVALID_HANDLE;
  if (h->pid == getpid())
    return CUDA_ERROR_INVALID_CONTEXT; /* the driver refuses a process its own handle */
  for (size_t i = 0; i < nallocs; i++)
    if (allocs[i].ipc && allocs[i].owner == h->pid && allocs[i].id == h->id) {
      allocs[i].refs++;
      *out = allocs[i].dptr;
      return CUDA_SUCCESS;
    }
  size_t maplen = page_round(h->size);
  if (maplen < h->size)
    return CUDA_ERROR_INVALID_HANDLE;
  if (grow((void **)&allocs, &cap_allocs, nallocs + 1, sizeof *allocs))
    return CUDA_ERROR_OUT_OF_MEMORY;
  int fd;
  CUresult rc = open_owner_fd(h, maplen, &fd);
  if (rc != CUDA_SUCCESS)
    return rc;
  struct alloc al = {.size = h->size,
                     .maplen = maplen,
                     .fd = fd,
                     .device = current->device,
                     .ipc = true,
                     .refs = 1,
                     .owner = h->pid,
                     .id = h->id};
  rc = map_twice(fd, maplen, &al.dptr, &al.backing);
  if (rc != CUDA_SUCCESS) {
    close(fd);
    return rc;
  }
  allocs[nallocs++] = al;
  *out = al.dptr;
  return CUDA_SUCCESS;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *out, CUipcMemHandle handle, unsigned flags) {
  ENTER_CTX();
  if (!out || (flags & ~(unsigned)IPC_LAZY_PEER))
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  struct ipc_handle h;
  memcpy(&h, &handle, sizeof h);
  return unlock_rc(ipc_open_locked(out, &h));
}

CUresult cuIpcOpenMemHandle(CUdeviceptr *out, CUipcMemHandle handle, unsigned flags) {
  return cuIpcOpenMemHandle_v2(out, handle, flags);
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
  ENTER_CTX();
  struct alloc *al = find_alloc(p);
  if (!al || !al->ipc || al->dptr != p)
    return unlock_rc(CUDA_ERROR_INVALID_VALUE);
  if (--al->refs == 0) {
    run_all();
    drop_alloc(al);
  }
  return unlock_rc(CUDA_SUCCESS);
}

/* Not a driver entry point: the stand-in's own, for tests (found with dlsym; the real driver has
 * none, so a test skips what it checks with it there). The copies this process made so far, by
 * kind: [0] host to device, [1] device to host, [2] device to device, [3] device to device with
 * one side opened through IPC (a host bounce shows as [0] and [1]). */
void cuStubCopyCounts(unsigned long long out[4]) {
  pthread_mutex_lock(&lock);
  memcpy(out, copy_counts, sizeof copy_counts);
  pthread_mutex_unlock(&lock);
}

/* Not a driver entry point either: [0] successful cuMemHostRegister calls so far, [1] host
 * ranges registered now, [2] copies between host and device memory whose host side was
 * registered (pinned) when the copy ran. */
void cuStubPinCounts(unsigned long long out[3]) {
  pthread_mutex_lock(&lock);
  out[0] = pin_calls;
  out[1] = nregs;
  out[2] = pinned_copies;
  pthread_mutex_unlock(&lock);
}
