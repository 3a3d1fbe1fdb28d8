/*
 * ferry.h — the one public header of libferry.
 *
 * ferry moves tensors between the trainer and the inference engines of RL post-training. This
 * header is the contract: every prototype says who owns what and for how long.
 *
 * Rules that hold for every call unless its comment says otherwise:
 *   - It returns 0 on success or a negative FERRY_E* code. ferry_strerror() names the code and
 *     ferry_last_error() (thread-local) says what failed and where.
 *   - Output parameters are written only on success.
 *   - Handles are opaque; every open/create has a close, and close(NULL) is a no-op.
 *   - Strings passed in are copied when kept; strings returned are owned by ferry and stay valid
 *     for the lifetime of the handle they came from (or forever, for static tables).
 *   - Options structs (ferry_*_opts, ferry_ctl_handlers) start with `size`: set it to sizeof the
 *     struct, or pass NULL for every default. They only grow at their end, and a field beyond
 *     the caller's `size` takes its default, so a program built against an older ferry.h (or a
 *     binding that declares only the first fields) keeps working. A `size` that does not cover
 *     the `size` field itself (it was never set) or exceeds 4096 is FERRY_EINVAL. Bytes beyond
 *     the struct this library knows must be zero: a program built against a newer ferry.h that
 *     sets a field this library lacks gets FERRY_ENOTSUP rather than having it ignored.
 *     Output structs with a `size` (ferry_ctl_status, ferry_store_info, ...) get at most `size`
 *     bytes written.
 *   - Timeouts are in milliseconds; a negative timeout means the configured default
 *     (FERRY_TIMEOUT_MS) and 0 means "do not wait".
 */
#ifndef FERRY_H
#define FERRY_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define FERRY_API __attribute__((visibility("default")))
#else
#define FERRY_API
#endif

/* ---------------------------------------------------------------------------------------------
 * Version
 * ------------------------------------------------------------------------------------------- */
#define FERRY_VERSION_MAJOR 0
#define FERRY_VERSION_MINOR 1
#define FERRY_VERSION_PATCH 0
#define FERRY_VERSION_STRING "0.1.0"
/* The library's version, e.g. "0.1.0" (static string). May differ from the header's version
 * when an application runs against a newer shared library. */
FERRY_API const char *ferry_version(void);

/* ---------------------------------------------------------------------------------------------
 * Status codes: one X-macro table, names and messages together.
 * ------------------------------------------------------------------------------------------- */
#define FERRY_STATUS_TABLE(X)                                                                      \
  X(OK, 0, "success")                                                                              \
  X(EINVAL, -1, "invalid argument")                                                                \
  X(ENOMEM, -2, "out of memory")                                                                   \
  X(ENOSHM, -3, "out of shared memory")                                                            \
  X(ETIMEDOUT, -4, "timed out")                                                                    \
  X(ENOTFOUND, -5, "not found")                                                                    \
  X(EEXIST, -6, "already exists")                                                                  \
  X(EACCES, -7, "access denied")                                                                   \
  X(ERANGE, -8, "out of bounds")                                                                   \
  X(EPEER, -9, "peer gone")                                                                        \
  X(EPROTO, -10, "protocol error")                                                                 \
  X(ECONNECT, -11, "cannot connect")                                                               \
  X(EAUTH, -12, "authentication failed")                                                           \
  X(EDTYPE, -13, "invalid or mismatched dtype")                                                    \
  X(ESHAPE, -14, "invalid or mismatched shape")                                                    \
  X(EOVERFLOW, -15, "size overflow")                                                               \
  X(ECLOSED, -16, "closed")                                                                        \
  X(EBUSY, -17, "busy")                                                                            \
  X(ECAPACITY, -18, "capacity exceeded")                                                           \
  X(ESYS, -19, "system call failed")                                                               \
  X(ENOTSUP, -20, "not supported")                                                                 \
  X(ESTATE, -21, "invalid state transition")                                                       \
  X(ECHECKSUM, -22, "checksum mismatch")                                                           \
  X(ESTALE, -23, "stale data")                                                                     \
  X(EFREED, -24, "freed by its owner")                                                             \
  X(EDEVICE, -25, "CUDA device error")

enum ferry_status {
#define FERRY_STATUS_ENUM_(name, code, msg) FERRY_##name = (code),
  FERRY_STATUS_TABLE(FERRY_STATUS_ENUM_)
#undef FERRY_STATUS_ENUM_
};

/* Message for a status code (static string); "unknown status" for codes not in the table. */
FERRY_API const char *ferry_strerror(int status);
/* Symbolic name of a status code, e.g. "FERRY_EPEER" (static string). */
FERRY_API const char *ferry_status_name(int status);
/* The calling thread's detail message for its last failed call, e.g.
 * "read region 7 of 'rollout-3': offset 4096 + 64 beyond size 4096". Valid until the thread's
 * next ferry call; "" when there is none. */
FERRY_API const char *ferry_last_error(void);

/* ---------------------------------------------------------------------------------------------
 * Logging. Level from FERRY_LOG (error|warn|info|debug|trace; default warn), to stderr unless a
 * callback is installed.
 * ------------------------------------------------------------------------------------------- */
typedef enum ferry_log_level {
  FERRY_LOG_ERROR = 0,
  FERRY_LOG_WARN = 1,
  FERRY_LOG_INFO = 2,
  FERRY_LOG_DEBUG = 3,
  FERRY_LOG_TRACE = 4,
} ferry_log_level;

/* Called with one formatted line (no trailing newline); may be called from any ferry thread,
 * concurrently, so it must be thread-safe. `msg` is valid only during the call. */
typedef void (*ferry_log_fn)(ferry_log_level level, const char *msg, void *arg);
/* Installs (or, with fn == NULL, removes) the process-wide log callback. */
FERRY_API void ferry_log_set_callback(ferry_log_fn fn, void *arg);
FERRY_API void ferry_log_set_level(ferry_log_level level);
FERRY_API ferry_log_level ferry_log_get_level(void);

/* ---------------------------------------------------------------------------------------------
 * Configuration: one declarative table of FERRY_* environment variables.
 * ------------------------------------------------------------------------------------------- */
typedef struct ferry_config_item {
  const char *name;          /* e.g. "FERRY_TIMEOUT_MS" */
  const char *default_value; /* as text */
  const char *doc;           /* one line */
} ferry_config_item;

/* Number of settings, and the i-th (static; NULL when i is out of range). */
FERRY_API size_t ferry_config_count(void);
FERRY_API const ferry_config_item *ferry_config_at(size_t i);
/* The current value of a setting: the environment's if set, else the default. Static or
 * environment storage; NULL for a name not in the table. */
FERRY_API const char *ferry_config_get(const char *name);

/* ---------------------------------------------------------------------------------------------
 * Checksums: XXH3-64.
 * ------------------------------------------------------------------------------------------- */
FERRY_API uint64_t ferry_checksum(const void *data, size_t len);

/* ---------------------------------------------------------------------------------------------
 * Tensors: dtype, shape, byte size.
 * ------------------------------------------------------------------------------------------- */
#define FERRY_DTYPE_TABLE(X)                                                                       \
  X(BOOL, 1, 1, "bool")                                                                            \
  X(U8, 2, 1, "uint8")                                                                             \
  X(U16, 3, 2, "uint16")                                                                           \
  X(U32, 4, 4, "uint32")                                                                           \
  X(U64, 5, 8, "uint64")                                                                           \
  X(I8, 6, 1, "int8")                                                                              \
  X(I16, 7, 2, "int16")                                                                            \
  X(I32, 8, 4, "int32")                                                                            \
  X(I64, 9, 8, "int64")                                                                            \
  X(F16, 10, 2, "float16")                                                                         \
  X(BF16, 11, 2, "bfloat16")                                                                       \
  X(F32, 12, 4, "float32")                                                                         \
  X(F64, 13, 8, "float64")                                                                         \
  X(F8E4M3, 14, 1, "float8_e4m3")                                                                  \
  X(F8E5M2, 15, 1, "float8_e5m2")

typedef enum ferry_dtype {
  FERRY_DTYPE_INVALID = 0,
#define FERRY_DTYPE_ENUM_(name, code, size, str) FERRY_DTYPE_##name = (code),
  FERRY_DTYPE_TABLE(FERRY_DTYPE_ENUM_)
#undef FERRY_DTYPE_ENUM_
} ferry_dtype;

#define FERRY_MAX_DIMS 8

typedef struct ferry_tensor_desc {
  ferry_dtype dtype;
  uint32_t ndim;                  /* 0 (a scalar) .. FERRY_MAX_DIMS */
  uint64_t shape[FERRY_MAX_DIMS]; /* entries past ndim are ignored */
} ferry_tensor_desc;

/* Element size in bytes; 0 for an invalid dtype. */
FERRY_API size_t ferry_dtype_size(ferry_dtype dtype);
/* Canonical name ("uint8", "bfloat16", ...); NULL for an invalid dtype. */
FERRY_API const char *ferry_dtype_name(ferry_dtype dtype);
/* Parses a name: canonical names plus short aliases (u8, i32, f32, bf16, fp8_e4m3, ...). */
FERRY_API int ferry_dtype_parse(const char *name, ferry_dtype *out);
/* Validates a descriptor and computes its byte size without overflow:
 * FERRY_EDTYPE, FERRY_ESHAPE (ndim > FERRY_MAX_DIMS) or FERRY_EOVERFLOW. */
FERRY_API int ferry_tensor_nbytes(const ferry_tensor_desc *desc, uint64_t *out);
/* Parses "45,32768,8" into desc->shape/ndim (dtype untouched). */
FERRY_API int ferry_shape_parse(const char *text, ferry_tensor_desc *desc);
/* Formats "[45, 32768, 8]" into buf (always NUL-terminated); returns buf. */
FERRY_API char *ferry_shape_format(const ferry_tensor_desc *desc, char *buf, size_t len);

/* ---------------------------------------------------------------------------------------------
 * Context: one per process (or per node); owns a progress thread, listeners, links and regions.
 * ------------------------------------------------------------------------------------------- */
typedef struct ferry_ctx ferry_ctx;
typedef struct ferry_link ferry_link;

/* Like every options struct: `size` first, NULL for the defaults (the rule at the top). */
typedef struct ferry_ctx_opts {
  size_t size;            /* sizeof(ferry_ctx_opts) */
  const char *name;       /* node name (copied); NULL: "<hostname>-<pid>" */
  const char *tcp_listen; /* "HOST:PORT" for the tcp listener; NULL: FERRY_TCP_LISTEN */
  const char *transports; /* order to try, "shm,tcp"; NULL: FERRY_TRANSPORTS */
  /* Fleet token, which every link must prove it knows (an HMAC challenge; it never crosses the
   * wire). NULL or "": FERRY_TOKEN, and when that is empty too, this user's own secret (the file
   * FERRY_TOKEN_FILE, else ~/.ferry/token, made 0600 by the first process that needs it), so
   * that every process of one user connects to the others with no configuration and another
   * user's cannot. There is no way to turn authentication off. Only an explicit token (here or
   * FERRY_TOKEN) lets a ctx listen beyond loopback or take shm links from another user; a
   * fleet across users or hosts shares one (docs/SECURITY.md). */
  const char *token;
} ferry_ctx_opts;

/* Opens a context: starts its listeners and progress thread. Close with ferry_ctx_close(),
 * which closes every link, fails every pending operation with FERRY_ECLOSED and frees every
 * region the context still holds. */
FERRY_API int ferry_ctx_open(const ferry_ctx_opts *opts, ferry_ctx **out);
FERRY_API void ferry_ctx_close(ferry_ctx *ctx);
/* The node name (owned by ctx). */
FERRY_API const char *ferry_ctx_name(const ferry_ctx *ctx);
/* The address peers connect to: a comma-separated list of transport URLs, e.g.
 * "shm://@ferry-1f2e...,tcp://127.0.0.1:40123" (owned by ctx). */
FERRY_API const char *ferry_ctx_address(const ferry_ctx *ctx);

/* ---------------------------------------------------------------------------------------------
 * Metrics: counters, gauges and histograms the library keeps per context (links, store, refit,
 * mq) and per process (control), read as a snapshot. docs/OPERATIONS.md lists every metric.
 * ------------------------------------------------------------------------------------------- */
typedef enum ferry_stat_kind {
  FERRY_STAT_COUNTER = 0,  /* only grows while its object lives */
  FERRY_STAT_GAUGE = 1,    /* a level: goes up and down */
  FERRY_STAT_HISTOGRAM = 2 /* observations in buckets */
} ferry_stat_kind;

/* One sample (a series): every pointer is owned by the library and valid only during the
 * callback that receives it; copy what you keep. Values are in base units (seconds, bytes). */
typedef struct ferry_stat {
  const char *name; /* "ferry_link_bytes_sent_total": Prometheus naming, ferry_ prefix */
  const char *help; /* one line */
  ferry_stat_kind kind;
  size_t nlabels; /* label pairs, e.g. node="n1", transport="shm" */
  const char *const *label_names;
  const char *const *label_values;
  double value;                  /* counter or gauge; for a histogram the sum of its observations */
  uint64_t count;                /* histogram: how many observations (0 otherwise) */
  size_t nbuckets;               /* histogram: finite upper bounds (the +Inf bucket is `count`) */
  const double *bucket_le;       /* nbuckets upper bounds, ascending */
  const uint64_t *bucket_counts; /* nbuckets cumulative counts (observations <= bound) */
} ferry_stat;

/* Return non-zero to stop the iteration (ferry_stats_each then returns that value). */
typedef int (*ferry_stat_fn)(const ferry_stat *stat, void *arg);
/* Calls fn for every sample of ctx's objects and the process's (control), grouped by name; a
 * NULL ctx gives the process's only. Each sample carries a node label (ctx's name). Safe from
 * any thread, concurrently with traffic; it takes no lock a hot path takes. */
FERRY_API int ferry_stats_each(ferry_ctx *ctx, ferry_stat_fn fn, void *arg);
/* The same samples in the Prometheus text format 0.0.4 (*text: NUL-terminated, *len bytes
 * without the NUL; free with ferry_stats_text_free()). */
FERRY_API int ferry_stats_prometheus(ferry_ctx *ctx, char **text, size_t *len);
FERRY_API void ferry_stats_text_free(char *text);
/* Readiness as /readyz reports it: 0 when every directory lease of ctx's jobs is held and its
 * directory answers (a ctx with no directory is ready), else a status, with a one-line reason
 * in why (may be NULL). */
FERRY_API int ferry_stats_ready(ferry_ctx *ctx, char *why, size_t len);

/* An HTTP server for a ctx's metrics (Prometheus text at /metrics, /healthz, /readyz), on
 * libmicrohttpd's thread. listen: "HOST:PORT" (port 0: any free; ferry_metrics_server_address
 * says which). Every ctx opened with FERRY_METRICS_LISTEN set starts one itself. ctx may be
 * NULL (process metrics only); it must outlive the server. */
typedef struct ferry_metrics_server ferry_metrics_server;
FERRY_API int ferry_metrics_serve(ferry_ctx *ctx, const char *listen, ferry_metrics_server **out);
/* "HOST:PORT" where it listens (owned by the server). */
FERRY_API const char *ferry_metrics_server_address(const ferry_metrics_server *server);
FERRY_API void ferry_metrics_server_close(ferry_metrics_server *server);

/* ---------------------------------------------------------------------------------------------
 * Memory kinds: host memory, or a CUDA device's. ferry loads the CUDA driver API at run time
 * (FERRY_CUDA_LIB, else libcuda.so.1; FERRY_CUDA=off never loads it) the first time a call
 * needs to know; one build serves CPU-only and GPU machines. Without a driver every pointer is
 * host memory. Device bytes are never touched from the CPU: ferry moves them with the copy
 * engines, on streams of its own, and a call that reads or writes them returns only when its
 * copies are done. It does not wait for the caller's streams: synchronize the stream that wrote
 * a tensor before handing it to ferry (docs/GPU.md).
 * ------------------------------------------------------------------------------------------- */
typedef enum ferry_mem_kind { FERRY_MEM_HOST = 0, FERRY_MEM_CUDA = 1 } ferry_mem_kind;

/* The CUDA driver as this process sees it. */
typedef struct ferry_cuda_info {
  size_t size;        /* sizeof(ferry_cuda_info) (FR_OPT rule) */
  int found;          /* 1 when a driver is loaded */
  int driver_version; /* e.g. 12080 for 12.8 */
  int devices;        /* device count */
  char library[256];  /* the library loaded, or the one that was tried */
  char detail[256];   /* why none was loaded (found == 0), else empty */
} ferry_cuda_info;

/* Loads the driver if it is not yet and describes it. Never fails for want of a driver (found is
 * 0 then, with the reason in detail); FERRY_EINVAL for a bad size. */
FERRY_API int ferry_cuda_info_get(ferry_cuda_info *out);
/* Name and memory of CUDA device `device` (0..devices-1). FERRY_ENOTSUP without a driver,
 * FERRY_ERANGE for no such device. */
FERRY_API int ferry_cuda_device(int device, char *name, size_t name_len, uint64_t *total_bytes);
/* Where ptr lives: FERRY_MEM_CUDA (and its device ordinal in *device, when not NULL) or
 * FERRY_MEM_HOST (*device = -1). Never fails. */
FERRY_API ferry_mem_kind ferry_mem_where(const void *ptr, int *device);
/* Copies n bytes between any two of host and CUDA memory; the copy is complete on return (a plain
 * memcpy when both are host memory). FERRY_EDEVICE with the driver's error in the detail. */
FERRY_API int ferry_mem_copy(void *dst, const void *src, size_t n);
/* Device memory of ferry's own (cuMemAlloc on `device`), for callers without an allocator of
 * theirs (a tensor made on a named device); ferry_cuda_free releases it. */
FERRY_API int ferry_cuda_alloc(int device, size_t n, void **out);
FERRY_API int ferry_cuda_free(void *ptr);

/* ---------------------------------------------------------------------------------------------
 * Memory regions: memory that peers may read and write by (region id, access key), always
 * bounds-checked by its owner.
 * ------------------------------------------------------------------------------------------- */
typedef struct ferry_region_ref {
  uint64_t id;  /* unique within its ctx, never reused */
  uint64_t key; /* random access key; a peer must present it */
  uint64_t size;
} ferry_region_ref;

/* Allocates `bytes` of shared-memory-backed, page-aligned, zeroed memory as a new region that
 * same-host peers map directly (zero-copy). The memory is owned by ctx until ferry_free().
 * FERRY_ENOSHM when the shared-memory file system is full. In a ctx whose first transport is
 * ucx the memory comes from UCX (peers on UCX shared-memory links map it; shm links then reach
 * it through its owner, like ferry_register'd memory, and cannot view it). */
FERRY_API int ferry_alloc(ferry_ctx *ctx, size_t bytes, void **out);
/* ferry_alloc without the zeroing: memory freed earlier in this ctx (kept for reuse, see
 * ferry_free) comes back with the bytes it had, as malloc's would (numpy's empty). */
FERRY_API int ferry_alloc_uninit(ferry_ctx *ctx, size_t bytes, void **out);
/* Frees memory from ferry_alloc (ptr must be the pointer it returned). Peers that still read
 * it get FERRY_ENOTFOUND or FERRY_ESTALE; their mappings stay valid, so nobody crashes.
 * Up to FERRY_ALLOC_CACHE_BYTES of freed memory stays mapped for the ctx's next allocations
 * of about its size (at most an eighth smaller), which reuse it as a new region (new id and
 * key): its pages are warm here and in the peers that mapped it, so nobody pays page faults
 * again. A peer that mapped it before could read what the memory holds next: the key protects
 * regions within one fleet's trust (its token), not between the fleet's own processes. */
FERRY_API int ferry_free(ferry_ctx *ctx, void *ptr);
/* Makes caller memory [ptr, ptr+len) readable and writable by peers as a region. The caller
 * keeps ownership and must keep the memory alive until ferry_deregister(). Peers reach it
 * through the owner (one copy over the link), not by mapping. CUDA memory may be registered
 * (the range must lie inside one allocation, else FERRY_ERANGE): peers on this host then map it
 * through a CUDA IPC handle (cuMemAlloc'd memory; others are served through the owner). A peer
 * that mapped it does not see its deregistration: free it only when readers are done. The IPC
 * handle maps the whole allocation (for PyTorch, a whole caching-allocator segment, with other
 * tensors in it): ferry's peers bound every access by the registered range, but a same-host
 * process holding the key can map it all, so register such memory only for peers of your own
 * fleet (docs/GPU.md). */
FERRY_API int ferry_register(ferry_ctx *ctx, void *ptr, size_t len, ferry_region_ref *out);
/* Ends a registration: new accesses by peers fail (FERRY_ENOTFOUND), and once it returns no
 * thread of this process reads or writes the memory any more (it waits for the copies under way:
 * a read staged out to a tcp peer, a peer's write landing in it, a device copy queued from it;
 * each a chunk at most, never a wait for a peer, whose transfer then fails), so the caller may
 * free it. A same-host peer that mapped CUDA memory through IPC is not stopped (see
 * ferry_register). FERRY_ETIMEDOUT when a copy still ran after 10 s (a hung device): the
 * registration is gone all the same, but do not free the memory. */
FERRY_API int ferry_deregister(ferry_ctx *ctx, uint64_t region_id);
/* Finds the region that contains [ptr, ptr+len): its reference and ptr's offset in it.
 * FERRY_ENOTFOUND when the bytes are not (wholly) inside one region. */
FERRY_API int ferry_region_find(ferry_ctx *ctx, const void *ptr, size_t len, ferry_region_ref *out,
                                uint64_t *offset);

/* ---------------------------------------------------------------------------------------------
 * Links: a connection to a peer over the best transport both share (shm on one host, proven by
 * opening each other's memory; tcp otherwise). Links are refcounted: ferry_connect() returns
 * one reference, ferry_link_close() drops it.
 * ------------------------------------------------------------------------------------------- */

/* Connects to a peer's ferry_ctx_address(), trying transports in the ctx's order.
 * FERRY_ECONNECT (nothing answered within the timeout), FERRY_EAUTH (token mismatch). */
FERRY_API int ferry_connect(ferry_ctx *ctx, const char *address, int timeout_ms, ferry_link **out);
FERRY_API void ferry_link_close(ferry_link *link);
/* Takes another reference to a link (e.g. one a message came on, to keep answering it);
 * ferry_link_release() drops it without closing the connection. Returns link. */
FERRY_API ferry_link *ferry_link_retain(ferry_link *link);
FERRY_API void ferry_link_release(ferry_link *link);
/* 0 while the link is open, else the status it closed with (FERRY_EPEER, FERRY_ECLOSED, ...). */
FERRY_API int ferry_link_status(const ferry_link *link);
/* "shm" or "tcp" (static string). */
FERRY_API const char *ferry_link_transport(const ferry_link *link);
/* The peer's node name (owned by link). */
FERRY_API const char *ferry_link_peer(const ferry_link *link);

/* Sends one message (the concatenation of iov) on `channel` (0..47; 48..63 are ferry's own).
 * Reliable and ordered per link and channel. The bytes are written from iov directly; they may
 * be reused when the call returns. */
#define FERRY_MAX_CHANNELS 64
FERRY_API int ferry_send(ferry_link *link, uint32_t channel, const struct iovec *iov, int iovcnt,
                         int timeout_ms);

typedef struct ferry_msg {
  ferry_link *link; /* the link it came on (a reference owned by the message) */
  uint32_t channel;
  void *data;
  size_t len;
} ferry_msg;

/* Receives the next message on `channel` from any link. The message is owned by the caller
 * until ferry_msg_free(). FERRY_ETIMEDOUT when none arrived in time. A timeout of 0 does not
 * wait, yet returns any message that has arrived (over shm, whether or not a thread has
 * driven the link since). */
FERRY_API int ferry_recv(ferry_ctx *ctx, uint32_t channel, ferry_msg **out, int timeout_ms);
FERRY_API void ferry_msg_free(ferry_msg *msg);

/* Request/response: sends a message on `channel` that the peer receives with ferry_recv() like
 * any other (ferry_msg_is_call() tells it apart) and answers with ferry_reply(). Waits for that
 * reply, which the caller owns (ferry_msg_free). FERRY_ETIMEDOUT when no reply came in time;
 * FERRY_EPEER when the link died first. Many calls may be in flight on one link at once. */
FERRY_API int ferry_call(ferry_link *link, uint32_t channel, const struct iovec *iov, int iovcnt,
                         ferry_msg **reply, int timeout_ms);
/* Answers a message received from ferry_call(); the request stays owned by the caller.
 * FERRY_EINVAL when `request` was not a call. Each call is answered at most once. */
FERRY_API int ferry_reply(ferry_msg *request, const struct iovec *iov, int iovcnt, int timeout_ms);
/* 1 when the message came from ferry_call() and still awaits its reply, else 0. */
FERRY_API int ferry_msg_is_call(const ferry_msg *msg);

/* One-sided read of [offset, offset+len) of the peer's region into dst (one copy: over shm a
 * memcpy from the peer's pages, over tcp a recv straight into dst). FERRY_EACCES (wrong key),
 * FERRY_ERANGE (outside the region), FERRY_ENOTFOUND (no such region), FERRY_EPEER (the peer
 * died), FERRY_ETIMEDOUT. On failure the contents of dst are unspecified.
 * CUDA memory (see "Memory kinds"): dst may be a device buffer, and the peer's region may be
 * registered CUDA memory. Over shm the copy engines copy straight from the peer's pages, or from
 * its CUDA region mapped through a CUDA IPC handle (device to device); over tcp and ucx the bytes
 * come through host memory, FERRY_CUDA_CHUNK_BYTES at a time, and the owner stages a CUDA
 * region's bytes out through pinned host buffers, the next chunk's copy overlapping the send. */
FERRY_API int ferry_read(ferry_link *link, const ferry_region_ref *remote, uint64_t offset,
                         void *dst, size_t len, int timeout_ms);
/* One run of a vectored read: [offset, offset+len) of the peer's region (len > 0). */
typedef struct ferry_read_run {
  uint64_t offset, len;
} ferry_read_run;
/* Reads runs[0..n) of the peer's region one after another into dst (the sum of their lengths,
 * at most FERRY_MAX_MESSAGE): over shm one memcpy per run; over tcp one request per 256 runs,
 * all in flight at once; over ucx every get in flight at once (by RMA; else a request per run).
 * Errors as ferry_read (FERRY_EINVAL for an empty run). A strided slice (a run of columns in every
 * row) is one call. */
FERRY_API int ferry_readv(ferry_link *link, const ferry_region_ref *remote,
                          const ferry_read_run *runs, size_t n, void *dst, int timeout_ms);
/* One-sided write of src into [offset, offset+len) of the peer's region. Same errors. src may
 * be CUDA memory; a peer's CUDA region takes writes over shm only (elsewhere FERRY_ENOTSUP). */
FERRY_API int ferry_write(ferry_link *link, const ferry_region_ref *remote, uint64_t offset,
                          const void *src, size_t len, int timeout_ms);
/* Zero-copy view of a peer's shared-memory region (shm links and ferry_alloc'd regions only,
 * else FERRY_ENOTSUP; a peer's CUDA region too: see ferry_view_device). *out
 * stays mapped while the link is open; it may change under the reader if the owner writes, and
 * ferry_view_valid() says whether the owner has freed it since. */
FERRY_API int ferry_view(ferry_link *link, const ferry_region_ref *remote, uint64_t offset,
                         size_t len, const void **out);
/* Zero-copy view of a peer's registered CUDA region through its CUDA IPC mapping (shm links):
 * *out is a device address in this process (ferry_mem_where says so), for the copy engines and
 * kernels, never for the CPU; it stays mapped while the link is open. FERRY_ENOTSUP for host
 * memory (ferry_view), for a region its IPC handle could not map here (another process's only:
 * a process cannot map its own handles; VMM memory), or over other transports. The owner's
 * deregistration is not seen here. */
FERRY_API int ferry_view_device(ferry_link *link, const ferry_region_ref *remote, uint64_t offset,
                                size_t len, const void **out);
FERRY_API int ferry_view_valid(ferry_link *link, const ferry_region_ref *remote);

/* ---------------------------------------------------------------------------------------------
 * Control: the weight lifecycle of an inference engine (see the control section of DESIGN.md).
 * ------------------------------------------------------------------------------------------- */
/* A cell is a small shared-memory file (FERRY_CTL_DIR/ferry-ctl-NAME, mode 0600) through which
 * one engine's R ranks and any number of controllers agree on the engine's weight state. The
 * command word is written only by controllers, each rank's line only by that rank; nobody writes
 * back a value it read, so no command can be lost. Waits use futexes.
 *
 * Lifecycle: SERVING -clear-> CLEARING -> CLEARED -update-> UPDATING -> SERVING. A rank that
 * fails reports FAILED with an error; `clear` is the way back from FAILED. `abort` supersedes a
 * command still in flight (its controller died or gave up): every rank reports the state it can
 * vouch for. Names are 1-64 characters of [A-Za-z0-9._-], not starting with '.'. */
typedef struct ferry_ctl_cell ferry_ctl_cell; /* the engine's ownership of its cell */
typedef struct ferry_ctl ferry_ctl;           /* a controller's handle on a cell */
typedef struct ferry_ctl_rank ferry_ctl_rank; /* one rank's handle on a cell */

typedef enum ferry_ctl_state {
  FERRY_CTL_ABSENT = 0, /* rank slot not attached (rank status only) */
  FERRY_CTL_SERVING = 1,
  FERRY_CTL_CLEARING = 2,
  FERRY_CTL_CLEARED = 3,
  FERRY_CTL_UPDATING = 4,
  FERRY_CTL_FAILED = 5,
} ferry_ctl_state;

typedef enum ferry_ctl_cmd {
  FERRY_CTL_NONE = 0, /* no command issued yet */
  FERRY_CTL_CLEAR = 1,
  FERRY_CTL_UPDATE = 2,
  FERRY_CTL_ABORT = 3,
} ferry_ctl_cmd;

#define FERRY_CTL_MAX_RANKS 1024
#define FERRY_CTL_MESSAGE_MAX 32 /* a rank's failure message, NUL included */

/* "serving", "clearing", ... and "clear", "update", "abort", "none" (static strings; "?" for
 * values out of range). ferry_ctl_cmd_parse accepts the command names; FERRY_EINVAL otherwise. */
FERRY_API const char *ferry_ctl_state_name(ferry_ctl_state state);
FERRY_API const char *ferry_ctl_cmd_name(ferry_ctl_cmd cmd);
FERRY_API int ferry_ctl_cmd_parse(const char *name, ferry_ctl_cmd *out);

/* -- engine side: the cell -- */
typedef struct ferry_ctl_cell_opts {
  size_t size;       /* sizeof(ferry_ctl_cell_opts) */
  int fail_if_stale; /* 0: a cell left by a dead engine is replaced (next incarnation);
                        1: fail with FERRY_ESTALE instead */
} ferry_ctl_cell_opts;

/* Creates the cell for `nranks` ranks (1..FERRY_CTL_MAX_RANKS), published atomically (never
 * half-initialized). The calling process is the engine: the cell is live while it lives and
 * until ferry_ctl_cell_close(). FERRY_EEXIST when a live engine owns the name (the detail names
 * its pid); FERRY_ESTALE for a dead engine's cell when opts->fail_if_stale; FERRY_EPROTO when
 * the file is not a ferry cell. The handle is owned by the caller. */
FERRY_API int ferry_ctl_cell_create(const char *name, uint32_t nranks,
                                    const ferry_ctl_cell_opts *opts, ferry_ctl_cell **out);
/* Removes the cell's name and unmaps it; ranks and controllers still attached see it gone
 * (their calls fail with FERRY_ENOTFOUND or FERRY_ESTALE). */
FERRY_API void ferry_ctl_cell_close(ferry_ctl_cell *cell);
/* The cell's incarnation: 1 for a fresh name, one more than the stale cell it replaced. */
FERRY_API uint64_t ferry_ctl_cell_incarnation(const ferry_ctl_cell *cell);

/* Reclaims what killed engines left in FERRY_CTL_DIR: cells whose engine is dead (a name that no
 * engine takes over again would keep its file for good) and half-made cells of dead processes.
 * Under the directory lock that engines take to replace a stale cell, so a live engine's cell is
 * never removed; files that are not ferry cells are left alone. `each` (may be NULL) is called
 * for each file removed (with dry_run: that would be) with its path and why. Returns how many,
 * or a negative status when the directory cannot be read. `ferry gc` runs it. */
typedef void (*ferry_ctl_gc_fn)(const char *path, const char *why, void *arg);
FERRY_API int ferry_ctl_gc(int dry_run, ferry_ctl_gc_fn each, void *arg);

/* -- rank side -- */
typedef struct ferry_ctl_rank_opts {
  size_t size;                   /* sizeof(ferry_ctl_rank_opts) */
  ferry_ctl_state initial_state; /* 0: SERVING; or CLEARED for a rank that starts empty */
} ferry_ctl_rank_opts;

typedef struct ferry_ctl_command {
  uint64_t seq;      /* strictly increasing per cell; the same for every rank */
  ferry_ctl_cmd cmd; /* CLEAR, UPDATE or ABORT */
} ferry_ctl_command;

/* Attaches as rank `rank` (0..nranks-1) of the cell `name`. FERRY_ENOTFOUND (no cell),
 * FERRY_ERANGE (rank out of range), FERRY_EBUSY (a live process holds that rank). The rank can
 * write only its own line: the command word is mapped read-only. Not thread-safe: one thread
 * drives a rank handle. Owned by the caller until ferry_ctl_rank_close(), which detaches. */
FERRY_API int ferry_ctl_rank_open(const char *name, uint32_t rank, const ferry_ctl_rank_opts *opts,
                                  ferry_ctl_rank **out);
FERRY_API void ferry_ctl_rank_close(ferry_ctl_rank *rank);
/* Waits for a command newer than the last one this rank took, and returns the latest (a rank
 * that lagged behind several commands gets only the newest). Taking CLEAR or UPDATE publishes
 * CLEARING or UPDATING for this rank. FERRY_ETIMEDOUT when none came in time (0: just look). */
FERRY_API int ferry_ctl_wait_command(ferry_ctl_rank *rank, int timeout_ms, ferry_ctl_command *out);
/* Acknowledges the command `seq` (the last one taken) with the rank's resulting state: CLEAR
 * acks CLEARED, UPDATE acks SERVING, ABORT acks SERVING, CLEARED or FAILED; any command may ack
 * FAILED with `error` < 0 and a message (copied, truncated to FERRY_CTL_MESSAGE_MAX - 1; may be
 * NULL). FERRY_ESTATE for a state the command cannot end in, FERRY_EINVAL for another seq. */
FERRY_API int ferry_ctl_ack(ferry_ctl_rank *rank, uint64_t seq, ferry_ctl_state state, int error,
                            const char *message);

/* What a rank does per command. Handlers run on the calling thread; they return 0 or a FERRY_E*
 * code (its ferry_last_error() becomes the rank's message). `update` is the commit step: return
 * 0 only once the new weights are complete and verified (e.g. a refit receiver's commit), so the
 * rank returns to SERVING only with a verified version. NULL handlers succeed at once. */
typedef struct ferry_ctl_handlers {
  size_t size;                         /* sizeof(ferry_ctl_handlers) */
  int (*clear)(void *arg);             /* drop weights (and KV cache) */
  int (*update)(void *arg);            /* receive, verify and commit new weights */
  ferry_ctl_state (*abort)(void *arg); /* the state to report on abort; NULL: the last one */
  void *arg;
} ferry_ctl_handlers;
/* One step of a rank's loop: waits for a command (as ferry_ctl_wait_command), runs its handler
 * and acks the result. A CLEAR while already CLEARED acks at once. Returns 0 once a command was
 * handled (a handler's failure is reported to the controller as FAILED, not returned here),
 * FERRY_ETIMEDOUT when none came. *handled (may be NULL) is set to the command handled. */
FERRY_API int ferry_ctl_rank_step(ferry_ctl_rank *rank, const ferry_ctl_handlers *handlers,
                                  int timeout_ms, ferry_ctl_command *handled);

/* -- controller side -- */
/* Opens the cell `name` as a controller. FERRY_ENOTFOUND (no cell), FERRY_EPROTO (not a ferry
 * cell or another layout version). A dead engine's cell opens (status shows it) but requests
 * fail with FERRY_ESTALE. The handle is thread-safe and owned by the caller. */
FERRY_API int ferry_ctl_open(const char *name, ferry_ctl **out);
FERRY_API void ferry_ctl_close(ferry_ctl *ctl);
/* Issues `cmd` and waits until every rank acked it. Errors (the detail names the ranks):
 *   FERRY_ESTATE    invalid transition (update needs CLEARED) — nothing was issued;
 *   FERRY_EBUSY     another command is in flight or another controller won the race — nothing
 *                   was issued; retry later (ABORT is never refused for an in-flight command);
 *   FERRY_ETIMEDOUT ranks did not all ack in time (the command stays issued; they may finish);
 *   FERRY_EPEER     a rank is dead or detached;
 *   FERRY_ECLOSED   the command was superseded by an ABORT before all ranks acked;
 *   FERRY_ESTALE    the engine is dead or its cell was replaced (reopen);
 *   FERRY_ENOTFOUND the engine closed the cell;
 *   a rank's error  when ranks acked FAILED (the first failing rank's code).
 * CLEAR while every rank is CLEARED succeeds at once without issuing anything. */
FERRY_API int ferry_ctl_request(ferry_ctl *ctl, ferry_ctl_cmd cmd, int timeout_ms);

typedef struct ferry_ctl_status {
  size_t size; /* sizeof(ferry_ctl_status); only that many bytes are written */
  uint64_t incarnation;
  uint32_t nranks;
  int32_t engine_pid;
  int engine_alive;      /* 0: the cell is stale (its engine died) */
  uint64_t seq;          /* the latest command's sequence number (0: none yet) */
  ferry_ctl_cmd cmd;     /* the latest command */
  int in_flight;         /* some rank has not acked the latest command */
  ferry_ctl_state state; /* the engine's state: CLEARING/UPDATING while one is in flight, the
                            ranks' common state when they agree, FAILED otherwise */
  int agreed;            /* every rank acked the latest command with the same state */
} ferry_ctl_status;
typedef struct ferry_ctl_rank_status {
  size_t size; /* sizeof(ferry_ctl_rank_status) */
  uint32_t rank;
  int32_t pid;
  int alive;
  uint64_t seq; /* the latest command this rank took or acked */
  ferry_ctl_state state;
  uint64_t fail_seq; /* the last command this rank failed (0: none); error and message are its */
  int error;
  char message[FERRY_CTL_MESSAGE_MAX];
} ferry_ctl_rank_status;
/* A consistent snapshot of the cell / of one rank's line (out->size must be set). */
FERRY_API int ferry_ctl_status_get(ferry_ctl *ctl, ferry_ctl_status *out);
FERRY_API int ferry_ctl_rank_status_get(ferry_ctl *ctl, uint32_t rank, ferry_ctl_rank_status *out);

/* ---------------------------------------------------------------------------------------------
 * Store: the peer-to-peer tensor store.
 * ------------------------------------------------------------------------------------------- */
/* A store publishes tensors under keys (1..FERRY_STORE_KEY_MAX bytes, no control characters)
 * where they were made, and lets any node of the fleet read them straight from their owner: one
 * memcpy from the owner's pages on one host, one stream over tcp across hosts. Keys are looked
 * up in the fleet's directory: FERRY_DIRECTORY, ferry://HOST:PORT (the embedded directory that
 * `ferry serve` runs) or redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] (the password goes to Redis'
 * AUTH and is printed nowhere: messages show it as ***; a refused one is FERRY_EAUTH). A node that
 * registers (a store that is not FERRY_STORE_DELEGATE, mq, a published refit sender) in a
 * directory on another host must listen where that host's peers can reach it: with loopback-only
 * addresses (FERRY_TCP_LISTEN's default) the open fails, FERRY_EINVAL naming FERRY_TCP_LISTEN.
 *
 * A put of a tensor that lies in ferry memory (ferry_alloc) publishes it in place, without a
 * copy; any other tensor is copied once into the node's shared-memory pool (FERRY_STORE_CAPACITY
 * bytes). Memory published in place must stay allocated and unmodified until the key is deleted,
 * replaced or the store closed (write a new version into another buffer and put that); a reader
 * of one its owner freed meanwhile fails at once with FERRY_EFREED naming the owner.
 *
 * A get never returns torn data: the owner bumps the object's generation word when it replaces or
 * deletes it, and the reader checks that word after its copy; when it changed, the get looks the
 * key up again and reads again (backing off) until it has one whole version or its timeout
 * passes (then FERRY_ESTALE). A replaced pool copy stays readable for a while (up to a second,
 * or until its space is needed), so readers racing a re-put rarely need a second read. Objects
 * live as long as their owner's store: when it closes they are removed; when it dies, gets fail
 * with FERRY_EPEER (within the timeout, never a hang) until its directory lease
 * (FERRY_LEASE_MS) lapses and the records vanish (then FERRY_ENOTFOUND).
 *
 * A node's name (its ctx name) is held by one store at a time: opening a store under a name a
 * live node holds fails with FERRY_EEXIST naming it; the name of a node whose lease lapsed, or
 * that is proven dead (nothing answers at its address), is taken over.
 *
 * One store per context. Every call is thread-safe. */
typedef struct ferry_store ferry_store;

#define FERRY_STORE_KEY_MAX 255 /* bytes of a key, NUL not included */
#define FERRY_STORE_NAME_MAX 63 /* bytes of a node name */

/* ferry_store_opts.flags */
#define FERRY_STORE_HOST_DIRECTORY                                                                 \
  1u                          /* also run the embedded directory in this node; peers               \
                                 reach it at ferry://<this ctx's tcp listener> */
#define FERRY_STORE_HOLDER 2u /* hold objects put by short-lived nodes (`ferry serve`) */
#define FERRY_STORE_DELEGATE                                                                       \
  4u /* this node is short-lived (a CLI): each put is copied to a                                  \
        holder node, where it outlives this node */

typedef struct ferry_store_opts {
  size_t size;           /* sizeof(ferry_store_opts) */
  const char *directory; /* directory URL (copied); NULL: FERRY_DIRECTORY; ignored with
                            FERRY_STORE_HOST_DIRECTORY */
  uint64_t capacity;     /* pool bytes; 0: FERRY_STORE_CAPACITY */
  int lease_ms;          /* directory lease; 0: FERRY_LEASE_MS */
  uint32_t flags;        /* FERRY_STORE_* */
  /* Bytes of the device pool (0: FERRY_STORE_DEVICE_POOL_BYTES, whose default 0 is off). With a
   * device pool, a put from CUDA memory copies device to device into one CUDA allocation of this
   * node's (made with the first such put, on that put's device; freed by ferry_store_close once
   * no read of it is being staged out: ferry_deregister), and
   * its bytes never pass through host memory: a get into device memory on this host copies them
   * device to device (a peer's pool mapped once per link through CUDA IPC), a get into host
   * memory copies device to host, and a node on another host reads them staged through its
   * owner's pinned buffers. ferry_store_get_alloc and ferry_store_get_view of such an object
   * return host memory: a private copy (one device-to-host copy; a view of it is always valid).
   * A put from another device than the pool's, or one that does not fit beside the objects
   * there (replaced copies lingering there go first, oldest first), is copied into the host pool
   * as without a device pool: a full device pool never fails a put (one from another device is
   * warned about once). If making the pool fails (no driver, out of device memory), puts use the
   * host pool, a warning says why, and a later put tries again (after 1 s, doubled per failure up
   * to a minute). Deletes,
   * re-puts and lingering replaced copies behave as in the host pool. */
  uint64_t device_pool_bytes;
} ferry_store_opts;

/* Opens the store of `ctx`: connects to the directory, registers the node under its ctx name and
 * reserves the pool. ctx must outlive the store. The handle is owned by the caller until
 * ferry_store_close(), which removes this node's objects from the directory and frees the pool.
 * FERRY_ECONNECT when no directory answers (the detail says how to start `ferry serve`),
 * FERRY_EEXIST when a live node holds this ctx's name, FERRY_ENOSHM when the pool cannot be
 * reserved. */
FERRY_API int ferry_store_open(ferry_ctx *ctx, const ferry_store_opts *opts, ferry_store **out);
FERRY_API void ferry_store_close(ferry_store *store);

/* ferry_store_put flags */
#define FERRY_STORE_PUT_COPY 1u /* copy into the pool even when data lies in ferry memory */

/* Publishes the tensor (desc, data) under key, replacing any object of that key atomically (a
 * reader gets the old or the new tensor, never a mix). data is read during the call only, unless
 * it lies in ferry memory: then it is published in place and must stay valid and unmodified
 * until the key is deleted or replaced. data in CUDA memory is copied device to host into the
 * pool (never published in place), or device to device into the device pool when the store has
 * one (ferry_store_opts.device_pool_bytes). desc is copied. Errors: FERRY_EINVAL (bad key, NULL
 * data), FERRY_EDTYPE / FERRY_ESHAPE / FERRY_EOVERFLOW (bad desc), FERRY_ECAPACITY (the pool or
 * the object table is full; the detail gives the sizes), FERRY_ERANGE (CUDA data whose
 * allocation ends before the tensor does), FERRY_EDEVICE (the copy from the device failed),
 * FERRY_ECONNECT (directory). Once it
 * returns, a get from any node finds the object. With the embedded directory on this host
 * (ferry://, reached over shm) the put returns as soon as its record is queued in the
 * directory's ring, which applies it before it answers anything sent later; a refusal that only
 * the directory can see (its table full) is then logged, not returned. */
FERRY_API int ferry_store_put(ferry_store *store, const char *key, const ferry_tensor_desc *desc,
                              const void *data, uint32_t flags, int timeout_ms);

/* One tensor of a batch put: key, desc and data are inputs, as for ferry_store_put (owned by
 * the caller); status is an output, set for every item. */
typedef struct ferry_store_put_item {
  const char *key;
  const ferry_tensor_desc *desc;
  const void *data;
  int status; /* 0 or the item's FERRY_E* code, as ferry_store_put would return it */
} ferry_store_put_item;
/* Publishes many tensors as ferry_store_put would, one by one in order (a key that appears twice
 * ends up with the later tensor), with one directory round trip for all of them (an engine's 45
 * per-layer tensors of a request: one round trip instead of 45); items in CUDA memory are copied
 * device to host as ferry_store_put copies them. Returns 0 when every item
 * succeeded, else the status of the first that failed (each item has its own; the others are
 * published). */
FERRY_API int ferry_store_put_batch(ferry_store *store, ferry_store_put_item *items, size_t n,
                                    uint32_t flags, int timeout_ms);

/* What the directory says about an object. */
typedef struct ferry_store_info {
  size_t size; /* sizeof(ferry_store_info), set by the caller; only that many bytes are written */
  char key[FERRY_STORE_KEY_MAX + 1];
  char owner[FERRY_STORE_NAME_MAX + 1]; /* the node that holds the bytes */
  ferry_tensor_desc desc;
  uint64_t bytes;
  uint64_t generation; /* changes with every put of the key */
} ferry_store_info;

/* Reads the object under key into dst (cap bytes, owned by the caller). `expect` (may be NULL;
 * ignored when its dtype is FERRY_DTYPE_INVALID) must match the stored dtype and shape, else
 * FERRY_EDTYPE / FERRY_ESHAPE. info (may be NULL) receives the object's description. A dst in
 * CUDA memory is written host to device (over tcp through a bounded host buffer, a chunk at a
 * time), or device to device from an object in a device pool on this host (through CUDA IPC),
 * and must hold the object within its allocation too. Errors:
 * FERRY_ENOTFOUND (no such key), FERRY_ERANGE (cap too small; the detail says how many bytes),
 * FERRY_EPEER (the owner is gone), FERRY_ESTALE (replaced during every read until the timeout
 * passed), FERRY_EFREED (at once: the owner freed memory it still publishes in place; the detail
 * names the owner), FERRY_ETIMEDOUT. On failure dst's contents are unspecified. */
FERRY_API int ferry_store_get(ferry_store *store, const char *key, const ferry_tensor_desc *expect,
                              void *dst, size_t cap, ferry_store_info *info, int timeout_ms);
/* As ferry_store_get, into a buffer it allocates: *out is owned by the caller (free() it). The
 * buffer is always host memory (copy it to a device with ferry_mem_copy, or get into one). */
FERRY_API int ferry_store_get_alloc(ferry_store *store, const char *key, void **out,
                                    ferry_store_info *info, int timeout_ms);

/* A zero-copy get: *data points at the object's bytes where its owner keeps them (the owner's
 * shared memory on this host; cost independent of size), pinned until ferry_store_view_release().
 * A view is always of host memory (there is no device view). Across hosts, and of an object
 * held in a device pool (ferry_store_opts.device_pool_bytes), it points at a private copy (one
 * read, as ferry_store_get). The bytes are
 * read-only and *data is valid until the release, whatever happens to the key meanwhile:
 * - a re-put or delete of a pool copy (a tensor put from ordinary memory) publishes the new
 *   version, while the pinned old one stays intact, counted against the owner's capacity;
 * - a re-put or delete of memory published in place, made by its owner, waits up to its own
 *   timeout for the views of the old version to be released (the caller gets that memory back);
 *   after that it returns anyway and those views may see the bytes change:
 *   ferry_store_view_valid() says 0. A delete that another node asks for does not wait (the
 *   owner's service thread must not stall): its views say 0 at once;
 * - the owner's store closing or the owner dying keeps the mapping (no crash), and the bytes of
 *   a pool copy stay as they were.
 * Release every view: an unreleased one keeps its bytes from being reused for as long as the
 * owner runs. info (may be NULL) describes the object. Errors as ferry_store_get. */
typedef struct ferry_store_view ferry_store_view;
FERRY_API int ferry_store_get_view(ferry_store *store, const char *key, const void **data,
                                   ferry_store_info *info, ferry_store_view **view, int timeout_ms);
/* 1 while the view's bytes are the version it pinned, 0 once its owner gave them back to their
 * (in-place) owner (see above), or a negative FERRY_E* code. */
FERRY_API int ferry_store_view_valid(const ferry_store_view *view);
/* Drops the pin; NULL is a no-op. Only then may the owner reuse the bytes. */
FERRY_API void ferry_store_view_release(ferry_store_view *view);

/* One key of a batch get: key, dst and cap are inputs (owned by the caller); status and bytes
 * are outputs, set for every item. */
typedef struct ferry_store_item {
  const char *key;
  void *dst;
  size_t cap;
  int status;     /* 0 or the item's FERRY_E* code, as ferry_store_get would return it */
  uint64_t bytes; /* bytes read */
} ferry_store_item;
/* Reads many objects with their reads in flight together (one directory round trip, then
 * FERRY_STORE_THREADS reads at a time); an item's dst may be CUDA memory, written as
 * ferry_store_get writes it. Returns 0 when every item succeeded, else the status of
 * the first item that failed (each item has its own). */
FERRY_API int ferry_store_get_batch(ferry_store *store, ferry_store_item *items, size_t n,
                                    int timeout_ms);

/* Deletes key wherever it lives (its owner frees the bytes; a dead owner's record is removed
 * from the directory). FERRY_ENOTFOUND when there is no such key. */
FERRY_API int ferry_store_delete(ferry_store *store, const char *key, int timeout_ms);
/* Deletes every key that starts with prefix; *deleted (may be NULL) receives how many. */
FERRY_API int ferry_store_delete_prefix(ferry_store *store, const char *prefix, size_t *deleted,
                                        int timeout_ms);
/* Deletes every object of the fleet (ferry_store_delete_prefix with ""). */
FERRY_API int ferry_store_clear(ferry_store *store, size_t *deleted, int timeout_ms);
/* Every object whose key starts with prefix ("" or NULL: all), sorted by key. *out is an array
 * of *n entries owned by the caller (ferry_store_list_free), each with size set. */
FERRY_API int ferry_store_list(ferry_store *store, const char *prefix, ferry_store_info **out,
                               size_t *n, int timeout_ms);
FERRY_API void ferry_store_list_free(ferry_store_info *list);
/* The objects this node published in place (a put of ferry_alloc'd memory) that were deleted
 * since the last call, by this node or another, and not put again: their memory is the
 * caller's again, to reuse or free (a producer that frees it lets its next ferry_alloc take the
 * pages back warm). *out is an array of *n entries owned by the caller (ferry_store_list_free;
 * NULL when none). Kept only from the first call on, so a caller that never asks holds
 * nothing. */
FERRY_API int ferry_store_released(ferry_store *store, ferry_store_info **out, size_t *n);
/* 1 when key exists, 0 when it does not, or a negative FERRY_E* code. */
FERRY_API int ferry_store_exists(ferry_store *store, const char *key, int timeout_ms);
/* Describes the object under key (out->size must be set). FERRY_ENOTFOUND when there is none. */
FERRY_API int ferry_store_stat(ferry_store *store, const char *key, ferry_store_info *out,
                               int timeout_ms);

/* ---------------------------------------------------------------------------------------------
 * Refit: push each weight version from a trainer (the sender) to every inference engine (the
 * receivers). The sender declares its tensors once and seals: ferry lays them out in one flat
 * wire buffer cut into buckets under a byte budget (the plan) and hands that manifest to each
 * receiver once, when it attaches. A push then only moves bytes: bucket i+1 is packed while
 * bucket i moves, each bucket carries an XXH3 checksum, and a receiver commits a version only
 * when every bucket of it arrived and verified. One sender and one receiver per ferry_ctx.
 * ------------------------------------------------------------------------------------------- */
typedef struct ferry_refit_sender ferry_refit_sender;
typedef struct ferry_refit_receiver ferry_refit_receiver;
typedef struct ferry_refit_piece ferry_refit_piece; /* a slice of a tensor: see bind_pieces */

typedef struct ferry_refit_opts {
  size_t size;           /* sizeof(ferry_refit_opts) */
  uint64_t bucket_bytes; /* 0: FERRY_REFIT_BUFFER_BYTES, or FERRY_REFIT_BUFFER_RATIO of free
                            memory when that is set; two buckets are allocated */
  int alias;   /* keep the whole wire buffer (every bucket) in shared memory instead of two
                  buckets, so receivers on this host may use it in place (ferry_refit_bind_alias);
                  with every tensor on one CUDA device and no cast, the buffer is that device's
                  memory, which receivers on this host map through CUDA IPC */
  int publish; /* register the sender under its name in the directory, so receivers can open
                  it by name; FERRY_EEXIST when another live sender has that name */
  const char *directory; /* with publish: the directory URL (NULL: FERRY_DIRECTORY) */
  int no_retain; /* keep two buckets instead of the whole latest version: less shared memory,
                    but a receiver that attaches late gets nothing until the next push (by
                    default the sender packs every bucket in place in one buffer and a late
                    receiver catches up from it at once) */
  /* With every tensor on one CUDA device and none cast: two bucket slots in that device's memory
   * (not the whole version: late joiners wait for the next push), packed device to device. When
   * every receiver of a push is on this host (shm, reading whole buckets), a bucket is not hashed:
   * receivers copy it device to device through CUDA IPC straight into their bound tensors,
   * unverified, as alias mode's readers are; a push with any other receiver hashes each bucket
   * through pinned host memory as usual. Ignored otherwise (docs/GPU.md). */
  int device_buckets;
  /* Sharded senders (docs/REFIT.md, Sharded senders): `world` processes that hold one model
   * together (the ranks of a trainer: FSDP, Megatron TP/PP/EP) each open a sender under the same
   * name with their own `rank` in [0, world), declare the tensors they hold (whole, or pieces of
   * global tensors: ferry_refit_declare_piece), seal, and all push every version. Receivers open
   * the name and see one global manifest; each reads every rank's part straight from that rank.
   * 0 or 1: this sender holds the whole model (rank must be 0). A group needs `publish` (its
   * receivers find the ranks by name): FERRY_EINVAL without it, or for a rank outside the world. */
  int rank;
  int world;
} ferry_refit_opts;

/* Opens a sender on ctx; receivers attach to ferry_ctx_address(ctx), or by `name` when it is
 * published (opts->publish). `name` (copied) also names it in errors and logs. FERRY_EBUSY when
 * ctx already has a sender. */
FERRY_API int ferry_refit_sender_open(ferry_ctx *ctx, const char *name,
                                      const ferry_refit_opts *opts, ferry_refit_sender **out);
/* Detaches every receiver and frees the buckets; the declared tensors stay the caller's. */
FERRY_API void ferry_refit_sender_close(ferry_refit_sender *sender);
/* Declares a tensor: its name (copied; unique), dtype and shape, and where its bytes live (the
 * caller keeps them valid and may change them between pushes). `send_as` casts on the sender:
 * FERRY_DTYPE_INVALID sends as is; float32→bfloat16/float16, and float32 or bfloat16→
 * float8_e4m3 with a per-tensor scale (max |x| / 448 when sealed) that the manifest carries.
 * `data` may be CUDA memory (told apart once, here): each push copies it device→host into the
 * sender's bucket buffers (pinned then), where casts and checksums run, so host and device
 * tensors mix freely in one sender and receivers see no difference. A push reads device tensors
 * on ferry's own streams: synchronize the stream that wrote them before pushing (docs/GPU.md).
 * FERRY_EEXIST for a second tensor of the same name, FERRY_EDTYPE for a cast ferry lacks,
 * FERRY_EINVAL for device memory that ends before the tensor does. */
FERRY_API int ferry_refit_declare(ferry_refit_sender *sender, const char *name,
                                  const ferry_tensor_desc *desc, const void *data,
                                  ferry_dtype send_as);
/* Sharded senders: declares a local tensor (as ferry_refit_declare does) that is one piece of a
 * global tensor: the slice [of->start, of->stop) along dim of->dim of the global tensor named
 * of->source, whose shape is this tensor's with that dim as long as the largest stop any rank
 * declares. Receivers see the global tensor only (this tensor's own `name` names it in this
 * sender's errors). A tensor declared with ferry_refit_declare is whole under its own name;
 * several ranks may each hold one whole (replicated: norms, a tied embedding), and receivers
 * then read it from one of them, spread over the holders. The ranks' pieces of a global tensor
 * must cut the same dim, tile it with no gap or overlap, agree on dtype and on every other dim;
 * a receiver refuses a group that does not, with an error naming the tensor and the ranks.
 * FERRY_EINVAL for a slice that does not fit desc, FERRY_EDTYPE for an fp8 cast of a piece (its
 * scale would differ per rank). */
FERRY_API int ferry_refit_declare_piece(ferry_refit_sender *sender, const char *name,
                                        const ferry_tensor_desc *desc, const void *data,
                                        ferry_dtype send_as, const ferry_refit_piece *of);
/* Builds the manifest and bucket plan. Sealing again after declaring more (or re-declaring a
 * tensor with another dtype or shape) starts a new manifest generation that receivers pick up
 * with the next push. */
FERRY_API int ferry_refit_seal(ferry_refit_sender *sender);

/* How buckets reach receivers. DIRECT: every receiver reads each bucket from the sender. CHAIN:
 * receivers form a chain (in attach order); each reads a bucket from its predecessor while its
 * successor reads the previous one, so the sender sends each byte once whatever K is. AUTO (the
 * default): receivers on this host (shm links) read directly, all at once; the others chain. */
typedef enum ferry_refit_route {
  FERRY_REFIT_ROUTE_AUTO = 0,
  FERRY_REFIT_ROUTE_DIRECT = 1,
  FERRY_REFIT_ROUTE_CHAIN = 2,
} ferry_refit_route;

/* Streaming pushes (docs/REFIT.md, Streaming pushes): a version sent in parts, for a trainer
 * whose tensors exist a few at a time (a generator of gathered or converted tensors). The caller
 * points each declared tensor at its bytes as they come (ferry_refit_set_data) and pushes a part
 * with FERRY_REFIT_PART_MORE whenever it wants memory back: the part sends every bucket of the
 * version not sent yet whose tensors were all given (pointed at since the last version ended),
 * returns once each receiver of the version verified them, and commits nothing. Once
 * ferry_refit_part_sent() says so, a tensor's memory is not read again. FERRY_REFIT_PART_LAST
 * sends the rest and commits the version: a receiver commits it only when it verified every
 * bucket of the version over its parts, so one that lost the sender (killed between parts)
 * never reports it; FERRY_ESTATE, naming a tensor, when a bucket holds one that was not given
 * (the version is then abandoned). FERRY_REFIT_PART_ABORT abandons the open version (0 when none
 * is open; the tensors given are forgotten either way): its receivers fail it (FERRY_ECLOSED)
 * and none reports it. The first part fixes who
 * is in the version: receivers that attach later, or that fail a part, are left out of the rest
 * (the failures are named by the last part's error) and catch up from the retained copy after the
 * last part. The version number is spent by its first part, committed or not: the next must be
 * greater. While a version is open, a push of another version or of no part is FERRY_ESTATE.
 * skip_unchanged applies per bucket as in a whole push (decided by the first part); `only` is
 * FERRY_EINVAL with a part; FERRY_ENOTSUP for a rank of a group (world > 1) and for a sender
 * whose buffers are device memory (alias or device_buckets on one CUDA device). */
typedef enum ferry_refit_part {
  FERRY_REFIT_PART_NONE = 0,  /* a whole version (the default) */
  FERRY_REFIT_PART_MORE = 1,  /* one part of `version`; more follow */
  FERRY_REFIT_PART_LAST = 2,  /* its last part: commits it */
  FERRY_REFIT_PART_ABORT = 3, /* abandons it */
} ferry_refit_part;

typedef struct ferry_refit_push_opts {
  size_t size;             /* sizeof(ferry_refit_push_opts) */
  const char *const *only; /* push only these tensors (NULL: all) */
  size_t n_only;
  int skip_unchanged; /* skip buckets whose checksum equals the last push's */
  int timeout_ms;     /* a receiver that acknowledges nothing for this long fails (negative:
                         FERRY_TIMEOUT_MS); a big push may take longer as a whole */
  ferry_refit_route route;
  ferry_refit_part part; /* streaming pushes (above); NONE: the whole version */
} ferry_refit_push_opts;

/* Points declared tensor `name` at new bytes of the dtype and shape it was declared with, with
 * no seal: the next push (or part) reads it there, and the caller keeps `data` valid until then
 * (until ferry_refit_part_sent() says 1, in a version sent in parts). Host or CUDA memory, told
 * apart here as ferry_refit_declare does (a host sender's first device tensor pins its buffers
 * then). It also marks the tensor given for the version being sent in parts (or the next one).
 * FERRY_ENOTFOUND for a name not declared; FERRY_EINVAL for device memory that ends before the
 * tensor does, or for memory other than the one CUDA device of a sender whose buffers are that
 * device's memory. */
FERRY_API int ferry_refit_set_data(ferry_refit_sender *sender, const char *name, const void *data);
/* 1 when every bucket holding tensor `name` was sent in the version open in parts (its memory
 * is not read again; also for a tensor of no bytes), 0 when not (or no version is open),
 * FERRY_ENOTFOUND for a name not declared. */
FERRY_API int ferry_refit_part_sent(ferry_refit_sender *sender, const char *name);

/* Pushes the declared tensors' current bytes as `version` (greater than the last) to every
 * attached receiver (or one part of it: opts->part, above) and returns when each one committed
 * it (0), or when each one either
 * committed it or failed. Receivers that fail (FERRY_EPEER: died; FERRY_ETIMEDOUT: owed an
 * acknowledgement for longer than timeout_ms, e.g. stopped; FERRY_ECHECKSUM ...) are named in
 * ferry_last_error() and the call returns the first one's status; every receiver not named there
 * committed `version` before the call returned (in a chain, the receivers behind a failed one
 * get the buckets they miss straight from the sender). A receiver that timed out is dropped:
 * later pushes neither include nor wait for it until it attaches again (its own thread does so
 * once it runs again), and then it gets every bucket. With no receiver attached it returns 0 at
 * once. FERRY_ETIMEDOUT with nothing pushed when the sender's service thread was still sending
 * catch-up frames to late joiners (they go first), or hashing the buffer for one, after
 * timeout_ms. */
FERRY_API int ferry_refit_push(ferry_refit_sender *sender, uint64_t version,
                               const ferry_refit_push_opts *opts);
/* How many receivers are attached now (a dropped one counts again once it attached again; one
 * whose link is gone does not count, and a push leaves it out). */
FERRY_API size_t ferry_refit_receivers(ferry_refit_sender *sender);

/* Attaches to the sender at `address` (its ctx address, "shm://...,tcp://..."), or to the one
 * published under that name when it has no "://" (looked up in FERRY_DIRECTORY), and receives
 * its manifest. FERRY_ENOTFOUND when no sender of that name is published; FERRY_EBUSY when ctx
 * already has a receiver. */
FERRY_API int ferry_refit_receiver_open(ferry_ctx *ctx, const char *address, int timeout_ms,
                                        ferry_refit_receiver **out);
/* Detaches and frees the receiver. Allowed from its own callbacks (on_bucket, on_commit, a log
 * callback on its thread: a finalizer may run there): the close is then deferred, and the
 * receiver's thread frees it once that callback has returned (no further callback comes); keep
 * its ctx open until then, which such a caller cannot know: close the ctx from elsewhere, later. */
FERRY_API void ferry_refit_receiver_close(ferry_refit_receiver *receiver);
/* The manifest: how many tensors, and each one's name (owned by the receiver, valid until the
 * sender re-seals) and descriptor as it arrives (the wire dtype, after the sender's cast). */
FERRY_API size_t ferry_refit_tensor_count(ferry_refit_receiver *receiver);
FERRY_API int ferry_refit_tensor_info(ferry_refit_receiver *receiver, size_t i, const char **name,
                                      ferry_tensor_desc *desc);
/* The i-th tensor's fp8 scale: a tensor the sender casts to float8_e4m3 arrives as x / scale
 * (scale = max |x| / 448, fixed when the sender sealed), so x ≈ value * scale; 1.0 for every
 * other tensor. FERRY_ENOTFOUND when i is out of range. */
FERRY_API int ferry_refit_tensor_scale(ferry_refit_receiver *receiver, size_t i, float *scale);
/* Binds a tensor to the caller's memory (kept valid by the caller until close or rebind).
 * FERRY_ENOTFOUND, or FERRY_EDTYPE / FERRY_ESHAPE naming the tensor when desc does not match
 * what the sender sends. Tensors left unbound are not stored. A destination bound (here or by
 * ferry_refit_bind_flat) after a version committed does not hold it: committed() is 0 until the
 * next wait caught up; one bound after a bucket of its bytes landed fails that version here.
 * Bind before the pushes begin. `dst` may be CUDA memory (told apart once, here), over shm or
 * tcp alike: each bucket reaches this process in host memory (a pinned stage), is verified
 * there, and is copied host→device, complete before the bucket is acknowledged; wait()'s commit
 * then means every device tensor holds the version. FERRY_EINVAL for device memory that ends
 * before the tensor does; FERRY_ENOTSUP for device memory on a receiver bound with
 * ferry_refit_bind_flat or _bind_alias (those are host memory). */
FERRY_API int ferry_refit_bind(ferry_refit_receiver *receiver, const char *name, void *dst,
                               const ferry_tensor_desc *desc);
/* Instead of binding: one flat buffer (ferry shared memory, owned by the receiver) that receives
 * every tensor in place; ferry_refit_view() gives a tensor's address in it. It is host memory:
 * FERRY_ENOTSUP when a tensor is bound to CUDA memory (bind each one instead).
 * When the sender re-seals, the receiver takes the new manifest with the next push: bindings
 * that still fit (same name, dtype, shape) carry over, one that does not fails that version with
 * FERRY_EDTYPE/FERRY_ESHAPE naming the tensor (bind it again), and the flat buffer is laid out
 * anew (fetch views again). */
FERRY_API int ferry_refit_bind_flat(ferry_refit_receiver *receiver);
/* Alias mode, for an engine on the sender's host whose sender was opened with `alias`: nothing
 * is copied; ferry_refit_view() gives addresses in the sender's own shared wire buffer (read
 * only). The sender writes a new version there in place while it pushes, so the engine must not
 * read its weights between the start of a push and the commit (the control lifecycle's
 * clear → update does exactly that). A commit then means the sender finished writing and
 * checksumming that version. When the sender's tensors are all on one CUDA device and sent
 * without a cast, its buffer is that device's memory: this receiver maps it through a CUDA IPC
 * handle and the views are device addresses (ferry_mem_where); the sender packs it device to
 * device and takes each bucket's checksum through pinned host memory (for copying receivers).
 * FERRY_ENOTSUP when the sender keeps no such buffer or the link is not shm, or when a tensor
 * is bound to CUDA memory beside it. ferry_refit_view() gives addresses in the flat buffer or
 * the alias buffer only. */
FERRY_API int ferry_refit_bind_alias(ferry_refit_receiver *receiver);
FERRY_API int ferry_refit_view(ferry_refit_receiver *receiver, const char *name, void **out);
/* Shards, for a tensor-parallel rank that keeps a slice of each tensor: a piece is the elements
 * of tensor `source` whose index along `dim` lies in [start, stop) (dim 0: contiguous rows; dim
 * 1: a run of columns in every row; any dim of the source works). */
struct ferry_refit_piece {
  const char *source;
  int dim;
  int64_t start, stop;
};
/* Binds `target` (a name of the caller's: an engine's tensor, e.g. a fused qkv_proj shard) to
 * dst, described by dst_desc, which receives pieces[0..n) one after another along its dim 0, each
 * in row-major order: a single slice is n = 1; a fused projection lists its sources in order.
 * Each piece's shape (the source's, with `dim` cut to stop - start) must match dst_desc on every
 * dim but 0, their dim-0 sizes must add up to dst_desc's, and their wire dtype must be its dtype;
 * FERRY_ENOTFOUND, FERRY_ESHAPE or FERRY_EDTYPE otherwise, the error naming the target and the
 * piece that does not fit. Binding a target again replaces it. From the first shard binding on,
 * the receiver reads from the sender only the bytes of its targets (tensors bound with
 * ferry_refit_bind count as whole targets): a bucket holding none of them is acknowledged
 * without a read, and each byte read is verified against a sum the sender computes for exactly
 * those bytes (docs/REFIT.md, Shards). The sender has taken the target when this returns (the
 * next push covers it). As with ferry_refit_bind, a target bound after a version committed does
 * not hold it (committed() is 0 until the next wait caught up, reading only the targets' bytes).
 * Not with bind_flat or bind_alias (FERRY_ESTATE). FERRY_ECAPACITY when the sender refuses it:
 * this receiver's targets together pass its per-receiver limits (docs/REFIT.md, Shards); the
 * target stays bound and this receiver then reads whole buckets. `dst` may be CUDA memory, as
 * with ferry_refit_bind: the runs read are verified in host memory, then copied to the device
 * (runs that continue one another, such as the rows of a dim-1 slice, in one copy). */
FERRY_API int ferry_refit_bind_pieces(ferry_refit_receiver *receiver, const char *target, void *dst,
                                      const ferry_tensor_desc *dst_desc,
                                      const ferry_refit_piece *pieces, size_t n);
/* How many sender ranks this receiver reads from: the group's world (ferry_refit_opts.world),
 * 1 for a single sender. */
FERRY_API size_t ferry_refit_ranks(ferry_refit_receiver *receiver);
/* Bytes this receiver has read from its sender (or a chain predecessor) since it opened: about
 * 1/world of the model per push for a tensor-parallel rank that binds its shards. */
FERRY_API uint64_t ferry_refit_bytes_read(ferry_refit_receiver *receiver);
/* Called on the receiver's thread after each bucket verified and landed (engines that load
 * while buckets arrive). Bucket indices refer to the manifest's plan. A bucket a push skipped
 * (unchanged, or outside `only`) is not reported: its bytes are already this version's. Setting
 * fn (NULL: none) is safe while buckets land; a call already under way may still end after it.
 * The callback must not block: the receiver acknowledges the bucket only after it returns. */
typedef void (*ferry_refit_bucket_fn)(ferry_refit_receiver *receiver, uint64_t version,
                                      uint32_t bucket, void *arg);
FERRY_API void ferry_refit_on_bucket(ferry_refit_receiver *receiver, ferry_refit_bucket_fn fn,
                                     void *arg);
/* Called on the receiver's thread when a version ends here: status 0 when it committed (every
 * bucket verified), else why not, as soon as it cannot commit (a bucket failed: FERRY_ECHECKSUM,
 * FERRY_EDTYPE, ...; FERRY_ETIMEDOUT when the sender dropped this receiver for a stall), with
 * `why` saying so (NULL on success; valid during the call); a failed version may be reported
 * twice. Same rules as on_bucket. */
typedef void (*ferry_refit_commit_fn)(ferry_refit_receiver *receiver, uint64_t version, int status,
                                      const char *why, void *arg);
FERRY_API void ferry_refit_on_commit(ferry_refit_receiver *receiver, ferry_refit_commit_fn fn,
                                     void *arg);
/* The buckets that carry the i-th tensor of the manifest: *count of them from *first (0 for a
 * tensor of no bytes). A tensor has landed once each of them was reported by on_bucket. */
FERRY_API int ferry_refit_tensor_buckets(ferry_refit_receiver *receiver, size_t i, uint32_t *first,
                                         uint32_t *count);
/* Waits until the committed version is at least `version` (0: the latest version the sender
 * has pushed, as far as this receiver knows, and at least one) and writes it to *committed.
 * FERRY_ETIMEDOUT otherwise, or FERRY_EPEER as soon as the sender is gone, with *committed
 * (when not NULL) set to ferry_refit_committed(): 0 when the bytes are torn, and the error
 * then says so. */
FERRY_API int ferry_refit_wait(ferry_refit_receiver *receiver, uint64_t version, int timeout_ms,
                               uint64_t *committed);
/* The version the receiver's bytes (bound tensors, flat buffer, alias views) hold: 0 when none
 * yet, or when they are torn: from the moment the first byte of a newer version lands (in place,
 * over the old one) until that version commits. A push that fails for this receiver (its own
 * stall or checksum failure, the sender's death) leaves it at 0 until a complete push lands; it
 * never reports a version whose bytes it does not hold. An engine serves weights only when this
 * is the version it expects. */
FERRY_API uint64_t ferry_refit_committed(ferry_refit_receiver *receiver);

/* ---------------------------------------------------------------------------------------------
 * MQ: reliable publish/subscribe between the nodes of a fleet (see docs/MQ.md).
 * ------------------------------------------------------------------------------------------- */
/* Nodes publish messages (bytes, or a tensor with its dtype and shape) on topics; every node
 * subscribed to a topic receives each one. Nodes find each other through the fleet's directory
 * (FERRY_DIRECTORY, as the store does) and may join and leave at any time; messages travel over
 * ferry links (shm on one host, tcp or ucx across).
 *
 * Guarantees: every message reaches every subscriber the publisher knows when it publishes, once,
 * in publish order per publisher (for all of its topics), or the publish fails and says which
 * subscriber did not get it. Nothing is dropped silently: each subscriber grants each publisher a
 * bounded queue (FERRY_MQ_QUEUE_BYTES of credit); a publish to a subscriber whose queue is full
 * waits up to its timeout and then fails with FERRY_ETIMEDOUT naming that subscriber (and then no
 * subscriber got the message). A subscriber that dies is dropped by its publishers: the publish
 * that finds it dead delivers to every other subscriber and returns FERRY_EPEER naming it.
 * A node does not receive its own messages. Small messages published in quick succession are
 * batched per subscriber (sent when 32 KiB gather, before this node waits for anything, and
 * otherwise within 50 us); a subscriber lost while its batch was pending is reported by the
 * next publish.
 *
 * Payloads up to FERRY_MQ_INLINE_BYTES travel inside the frame; larger ones, to a subscriber on
 * the same host, are copied once into the publisher's shared-memory pool (FERRY_MQ_POOL_BYTES)
 * and the subscriber reads them in place (ferry_mq_msg.data points into that pool until the
 * message is freed). One mq per context; every call is thread-safe. */
typedef struct ferry_mq ferry_mq;

#define FERRY_MQ_TOPIC_MAX 128 /* bytes of a topic, NUL not included */

/* A received message. Owned by the caller until ferry_mq_msg_free(); every pointer in it stays
 * valid until then. The payload is read-only and 16-byte aligned (64 within the frame). */
typedef struct ferry_mq_msg {
  const char *topic;      /* NUL-terminated */
  const char *publisher;  /* the publishing node's ctx name */
  const void *data;       /* the payload */
  size_t len;             /* payload bytes */
  uint64_t seq;           /* the publisher's message number: increases with each publish */
  int is_tensor;          /* 1: published with ferry_mq_publish_tensor; desc describes data */
  ferry_tensor_desc desc; /* dtype INVALID unless is_tensor */
} ferry_mq_msg;

/* ferry_mq_opts.flags */
/* Also run the embedded directory in this node (at ferry://<this ctx's tcp listener>); not with
 * a store on the same ctx that hosts one too. */
#define FERRY_MQ_HOST_DIRECTORY 1u

typedef struct ferry_mq_opts {
  size_t size;           /* sizeof(ferry_mq_opts) */
  const char *directory; /* directory URL (copied); NULL: FERRY_DIRECTORY */
  uint64_t queue_bytes;  /* credit this node grants each publisher; 0: FERRY_MQ_QUEUE_BYTES */
  int lease_ms;          /* directory lease; 0: FERRY_LEASE_MS */
  uint32_t flags;        /* FERRY_MQ_* */
} ferry_mq_opts;

/* Opens the mq of `ctx` (which must outlive it; its name, at most 60 bytes, names this node to
 * subscribers) and registers the node in the directory. One mq per context: a second is
 * FERRY_EBUSY. Starts one thread of its own (lease renewal, callbacks, answering subscribers),
 * asleep while there is nothing to do. The handle is owned by the caller until
 * ferry_mq_close(), which sends what is batched, tells peers this node leaves and waits (at most
 * FERRY_TIMEOUT_MS) until each has taken in what was sent to it, removes its records and frees
 * its pool; every message must be freed before. FERRY_ECONNECT when no directory answers. */
FERRY_API int ferry_mq_open(ferry_ctx *ctx, const ferry_mq_opts *opts, ferry_mq **out);
FERRY_API void ferry_mq_close(ferry_mq *mq);

/* Subscribes to a topic (1..FERRY_MQ_TOPIC_MAX bytes, no control characters): records it in the
 * directory and tells every current publisher of the topic, so that when the call returns every
 * later publish of those publishers reaches this node (publishers that appear later find the
 * record themselves). Subscribing twice is a no-op. A publisher that does not answer within the
 * timeout is skipped (logged): it finds the record when it publishes next. */
FERRY_API int ferry_mq_subscribe(ferry_mq *mq, const char *topic, int timeout_ms);
/* Removes the subscription; messages of the topic already queued are still received, later ones
 * are discarded. FERRY_ENOTFOUND when not subscribed. */
FERRY_API int ferry_mq_unsubscribe(ferry_mq *mq, const char *topic, int timeout_ms);

/* Publishes `len` bytes of data (read during the call only) to every subscriber of topic. data
 * in CUDA memory is copied device to host once (into the pool when the payload goes there) and
 * sent from there; its allocation must hold all len bytes (else FERRY_ERANGE). The
 * first publish of a topic (or ferry_mq_wait_subscribers) advertises this node as a publisher.
 * Returns once every subscriber has the message in its queue, its link or its batch. Errors:
 * FERRY_ETIMEDOUT (a subscriber's queue stayed full; nobody got the message; the detail names
 * the subscriber), FERRY_EPEER (subscribers died and were dropped — named in the detail — and
 * every other subscriber got the message), FERRY_EINVAL (bad topic). With no subscriber it
 * returns 0 at once: the message goes nowhere. */
FERRY_API int ferry_mq_publish(ferry_mq *mq, const char *topic, const void *data, size_t len,
                               int timeout_ms);
/* The same for a tensor (data in CUDA memory too): its dtype and shape travel in a fixed binary
 * header and arrive in ferry_mq_msg.desc. FERRY_EDTYPE / FERRY_ESHAPE / FERRY_EOVERFLOW for a bad
 * desc. */
FERRY_API int ferry_mq_publish_tensor(ferry_mq *mq, const char *topic,
                                      const ferry_tensor_desc *desc, const void *data,
                                      int timeout_ms);
/* Zero-copy publish: build the message in the publisher's shared-memory pool. ferry_mq_loan
 * lends the caller `len` bytes (1..FERRY_MQ_POOL_BYTES) of the pool (host memory), 64-byte
 * aligned, at *buf;
 * when the pool is full it waits (taking releases from subscribers) up to the timeout:
 * FERRY_ETIMEDOUT, FERRY_ENOSHM without a pool, FERRY_EINVAL for a bad len. The loan belongs to
 * the caller until it hands it back with exactly one of:
 * - ferry_mq_publish_loan: publishes the first `len` bytes of the loan (at most what was lent),
 *   as bytes, or as a tensor when desc is not NULL (then len must be its size). Subscribers on
 *   shm links read the block in place (no copy anywhere: their ferry_mq_msg.data points into
 *   it); others receive it inline, sent from the block. Same results and errors as
 *   ferry_mq_publish. Whatever it returns, the loan is the mq's again: the caller must not touch
 *   buf afterwards (the block is reused once every subscriber freed the message). FERRY_EINVAL
 *   when buf is not a live loan of this mq.
 * - ferry_mq_loan_free: gives it back unpublished (ignores what is not a live loan).
 * Loans end with ferry_mq_close (the pool is unmapped). */
FERRY_API int ferry_mq_loan(ferry_mq *mq, size_t len, void **buf, int timeout_ms);
FERRY_API int ferry_mq_publish_loan(ferry_mq *mq, const char *topic, const ferry_tensor_desc *desc,
                                    void *buf, size_t len, int timeout_ms);
FERRY_API void ferry_mq_loan_free(ferry_mq *mq, void *buf);
/* Waits until at least n subscribers of topic are known to this node (advertising it as a
 * publisher). No polling: it wakes when a subscriber's request arrives. FERRY_ETIMEDOUT. */
FERRY_API int ferry_mq_wait_subscribers(ferry_mq *mq, const char *topic, size_t n, int timeout_ms);
/* The number of subscribers of topic known to this node now (0 for a topic it never published). */
FERRY_API size_t ferry_mq_subscribers(ferry_mq *mq, const char *topic);

/* Takes the next message (any topic, in arrival order; per publisher in publish order). The
 * message is owned by the caller until ferry_mq_msg_free(), which returns its credit to the
 * publisher: holding messages holds back their publishers. FERRY_ETIMEDOUT when none arrived in
 * time; FERRY_EBUSY while a callback is installed. */
FERRY_API int ferry_mq_recv(ferry_mq *mq, ferry_mq_msg **out, int timeout_ms);
FERRY_API void ferry_mq_msg_free(ferry_mq_msg *msg);
/* Copies the message's payload (msg->len bytes; msg->data is always host memory) into dst, host
 * or CUDA memory (host to device, complete on return). FERRY_ERANGE when it does not fit cap, or
 * the CUDA allocation at dst (nothing is written then); FERRY_EDEVICE when the copy fails. */
FERRY_API int ferry_mq_msg_copy(const ferry_mq_msg *msg, void *dst, size_t cap);

/* Called with each message, instead of ferry_mq_recv, on the mq's background thread (one
 * thread: calls never overlap, and come in arrival order). The callback owns the message and
 * must free it (it may keep it and free it later from any thread). It may publish, subscribe
 * and unsubscribe, but not close the mq. fn == NULL removes the callback (after the call that
 * may be running); messages then queue for ferry_mq_recv again. */
typedef void (*ferry_mq_fn)(ferry_mq *mq, ferry_mq_msg *msg, void *arg);
FERRY_API int ferry_mq_set_callback(ferry_mq *mq, ferry_mq_fn fn, void *arg);

#ifdef __cplusplus
}
#endif
#endif /* FERRY_H */
