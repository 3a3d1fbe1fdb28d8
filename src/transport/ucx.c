/*
 * The ucx transport: links over UCX's UCP layer, ferry's road to RDMA fabrics and GPU memory,
 * tested here over UCX's own tcp and shared-memory transports.
 *
 * A link keeps a tcp socket, as in tcp.c: it carries the handshake, and afterwards only
 * liveness (its end of stream means the peer is gone). Once the link is open each side sends
 * its UCP worker address on that socket (the preamble) and makes an endpoint to the peer's; the
 * link's byte stream then runs over the UCP stream API. Every link has its own worker, so its
 * two endpoints always pair with each other and no link waits behind another. The worker's
 * event fd sits in the ctx's epoll beside the socket: the progress thread drains the stream
 * when UCX has something and sleeps when it has not. Other threads progress the worker while
 * they wait for their own operations; when that leaves stream data or unarmed events behind,
 * they kick the progress thread through an eventfd.
 *
 * One-sided reads and writes of a peer's ferry_alloc'd region are UCP get/put with the region's
 * packed rkey, which the owner hands out once per region and link after checking the key (as
 * shm hands out memfds); later accesses check bounds here and read the region's state word with
 * one more small get, so a freed region reads as gone. The owner keeps a region mapped, and its
 * memory alive, while a link that was given its rkey lives. Where UCX only emulates RMA (its tcp
 * transport, where an emulated get is far slower than an active message) or the region is
 * registered caller memory, a read is an active message the owner answers after checking key
 * and bounds, and the bytes land in the destination through UCX's rendezvous; writes then go as
 * stream requests (link.c), which the owner checks the same way.
 */
#include "transport/ucx.h"
#include "transport/transport.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>
#include <uct/api/uct.h>
#include <unistd.h>

extern const fr_transport_ops fr_tcp_transport;
extern const fr_transport_ops fr_ucx_transport;

#define PREAMBLE_MAGIC 0x58555246u /* "FRUX" */
#define PREAMBLE_BYTES 8           /* magic, address length */
#define ADDRESS_MAX (64u * 1024u)

/* Active messages: a request names its waiter by id; the answer carries it back. */
enum { AM_RKEY_REQ = 1, AM_RKEY_RESP = 2, AM_READ_REQ = 3, AM_READ_RESP = 4 };
#define RKEY_REQ_BYTES 24  /* id, region, key */
#define RKEY_RESP_BYTES 32 /* id, status, base, size; the packed rkey is the data */
#define READ_REQ_BYTES 40  /* id, region, key, offset, length */
#define READ_RESP_BYTES 16 /* id, status; the bytes are the data */
#define BLOB_HDR_BYTES 32  /* a published rkey: id, key, base, size; the packed rkey follows */

enum { RMA_AUTO, RMA_GET, RMA_AM };

/* Owner side: a shared region mapped for peers' gets, alive while a link holds its rkey. */
typedef struct ucx_mapping {
  fr_region *region; /* a reference */
  ucp_mem_h memh;
  bool own_memh; /* made for the mapping (a memfd region), not the region's own (UCX memory) */
  void *rkey;
  size_t rkey_len;
  int refs;       /* links given the rkey, and its publication; under ucx_ctx.lock */
  bool published; /* packed into a record (region_pack): kept until the ctx closes */
  struct ucx_mapping *next;
} ucx_mapping;

typedef struct ucx_given {
  ucx_mapping *m;
  struct ucx_given *next;
} ucx_given;

/* Reader side: a peer region's rkey (NULL: reach it with read requests), and where UCX mapped
 * the region here when its transports can (ptr: its header; NULL: not mapped). */
typedef struct ucx_remote {
  uint64_t id, key, base, size;
  ucp_rkey_h rkey;
  void *ptr;
  void *packed; /* from a record (region_hint), unpacked on first use, when the endpoint is up */
  size_t packed_len;
  struct ucx_remote *next;
} ucx_remote;

typedef struct ucx_ctx {
  ucp_context_h context;
  bool cuda; /* UCX was built with CUDA memory support */
  int rma;   /* RMA_* */
  int refs;  /* atomic: the ctx's, and one per region of UCX memory (they outlive the ctx's) */
  pthread_mutex_t lock;
  struct ucx_link *links;
  ucx_mapping *maps;
} ucx_ctx;

/* A request waiting for the peer's answer, on its waiter's stack, listed in ucx_link.reqs. */
typedef struct ucx_req {
  uint64_t id;
  int answer; /* AM_RKEY_RESP or AM_READ_RESP */
  void *dst;
  uint64_t len;
  int status;
  bool done;
  bool claimed;        /* the bytes are arriving into dst: only their completion finishes it */
  uint64_t base, size; /* RKEY_RESP */
  void *rkey;
  size_t rkey_len;
  struct ucx_req *next;
} ucx_req;

/* One UCP operation's completion, written by its callback under the link's lock. */
typedef struct ucx_op {
  ucs_status_t status;
  bool done;
} ucx_op;

typedef struct ucx_link {
  ferry_link *link;
  ucx_ctx *uc; /* NULL once the ctx has closed */
  /* Recursive: held around every UCP call on this worker (callbacks run under it and may send);
   * guards everything below. */
  pthread_mutex_t lock;
  pthread_cond_t cond; /* endpoint ready, requests answered */
  ucp_worker_h worker;
  ucp_ep_h ep;
  int efd, kick;
  bool watched;   /* efd and kick are in the ctx's epoll */
  bool stream_on; /* the link is open: its byte stream runs over UCP */
  bool ready;     /* the endpoint exists */
  bool gone;      /* the endpoint was closed */
  bool use_get;
  bool try_ptr; /* the endpoint has shared-memory lanes: peer regions of UCX memory may map */
  uint8_t pre_hdr[PREAMBLE_BYTES];
  uint8_t *pre; /* the peer's worker address */
  size_t pre_have, pre_want;
  void *chunk; /* stream data UCX handed over, partly consumed */
  size_t chunk_len, chunk_pos;
  ucs_status_t stream_error;
  ucx_req *reqs;
  ucx_remote *remotes;
  ucx_given *given;
  struct ucx_link *next;
} ucx_link;

static _Thread_local bool tl_progress_thread; /* set on the ctx's progress thread */

/* UCX synchronizes what passes through it in code TSan does not see (core.h): handing anything
 * to UCX releases, progressing it acquires. */
static char ucx_channel;
#define HB_HAND_OVER() FR_HB_RELEASE(&ucx_channel)
#define HB_TAKE() FR_HB_ACQUIRE(&ucx_channel)

/* ---- small helpers ---- */

static int ucs_err(int code, ucs_status_t st, const char *what, const ferry_link *l) {
  return fr_err(code, "ucx %s%s%s: %s", what, l ? " with " : "", l ? l->peer : "",
                ucs_status_string(st));
}

static int link_status(const ferry_link *l) {
  int st = __atomic_load_n(&l->state, __ATOMIC_ACQUIRE);
  if (st != FR_LINK_DEAD)
    return 0;
  return l->dead_status && l->dead_status != FERRY_ECLOSED ? l->dead_status : FERRY_EPEER;
}

static void op_done(ucx_op *op, ucs_status_t st) {
  op->status = st;
  op->done = true;
}

/* Callbacks free their request: a request freed before it completes gets no callback. */
static void op_send_cb(void *request, ucs_status_t st, void *arg) {
  op_done(arg, st);
  ucp_request_free(request);
}

/* Takes what a *_nbx call returned: completes op at once, or leaves it to the callback. */
static void op_issued(ucx_op *op, ucs_status_ptr_t sp) {
  if (sp == NULL)
    op_done(op, UCS_OK);
  else if (UCS_PTR_IS_ERR(sp))
    op_done(op, UCS_PTR_STATUS(sp));
}

static ucp_request_param_t op_param(ucx_op *op) {
  HB_HAND_OVER(); /* every operation's parameters are made just before it is issued */
  return (ucp_request_param_t){.op_attr_mask =
                                   UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                               .cb.send = op_send_cb,
                               .user_data = op};
}

static ucx_link *ucx_of(ferry_link *l) { return l->tdata; }

/* ---- device memory ---- */

/* CUDA pointers are told apart by core/cuda.c (the driver loaded at run time). Debian's UCX has
 * no CUDA support: ferry_read/ferry_write bring a caller's CUDA buffer through host memory before
 * it gets here (api.c), and a CUDA region is refused to peers' requests. A UCX built with CUDA
 * (uc->cuda) takes device memory itself: the seam for GPUDirect (docs/UCX.md). */
static int check_memory(const ucx_link *u, const void *p, const char *what) {
  if (!p || !fr_cuda_is_device(p) || (u->uc && u->uc->cuda))
    return 0;
  return fr_err(FERRY_ENOTSUP,
                "ucx %s: %p is device (CUDA) memory: not supported in this build (UCX has no "
                "CUDA memory support; see docs/UCX.md)",
                what, p);
}

/* ---- the per-ctx state ---- */

static ucx_ctx *uctx_of(ferry_ctx *ctx) {
  void **slot = fr_ctx_tstate(ctx, &fr_ucx_transport);
  return slot ? *slot : NULL;
}

static int parse_rma_mode(int *out) {
  const char *m = fr_config_str("FERRY_UCX_RMA");
  *out = strcmp(m, "get") == 0 ? RMA_GET : strcmp(m, "am") == 0 ? RMA_AM : RMA_AUTO;
  if (*out == RMA_AUTO && strcmp(m, "auto") != 0)
    return fr_err(FERRY_EINVAL, "FERRY_UCX_RMA='%s': get, am or auto", m);
  return 0;
}

/* Whether UCX may open its tcp transport: UCX_TLS and UCX_NET_DEVICES allow it (a setting that
 * no transport takes draws a warning from UCX). Network devices are named `eth0`, RDMA ports
 * `mlx5_0:1`. */
static bool tcp_may_run(void) {
  const char *tls = getenv("UCX_TLS"), *dev = getenv("UCX_NET_DEVICES");
  bool tls_ok = !tls || !*tls ||
                (tls[0] == '^' ? !strstr(tls, "tcp") : strstr(tls, "tcp") || strstr(tls, "all"));
  if (!tls_ok || !dev || !*dev || strstr(dev, "all"))
    return tls_ok;
  char *list = strdup(dev), *save = NULL;
  bool netdev = !list;
  for (char *d = list ? strtok_r(list, ",", &save) : NULL; d && !netdev;
       d = strtok_r(NULL, ",", &save))
    netdev = !strchr(d, ':');
  free(list);
  return netdev;
}

/* ferry's defaults for UCX settings the user left unset (the variable in the environment wins):
 * - RNDV_SCHEME=get_zcopy: reads pull, so a large read over shared memory is one cma copy.
 * - TCP_TX_SEG_SIZE, TCP_RX_SEG_SIZE=2M where tcp may run (UCX's own: 8K, 64K): UCX's tcp
 *   sends the answer to a read in fragments of one segment, each its own send, receive, copy
 *   and progress call, and answers up to one segment go eager, without a rendezvous round trip
 *   (docs/UCX.md; 2M reads 64 MiB faster than 512K, 8M no faster). UCP takes transport
 *   settings by their name within the transport (TX_SEG_SIZE: tcp's alone). */
static void config_defaults(ucp_config_t *config) {
  static const char *const defaults[][3] = {{"UCX_RNDV_SCHEME", "RNDV_SCHEME", "get_zcopy"},
                                            {"UCX_TCP_TX_SEG_SIZE", "TX_SEG_SIZE", "2M"},
                                            {"UCX_TCP_RX_SEG_SIZE", "RX_SEG_SIZE", "2M"}};
  size_t n = tcp_may_run() ? sizeof defaults / sizeof defaults[0] : 1;
  for (size_t i = 0; i < n; i++)
    if (!getenv(defaults[i][0]) &&
        ucp_config_modify(config, defaults[i][1], defaults[i][2]) != UCS_OK)
      fr_debug("ucx: could not set %s=%s", defaults[i][0], defaults[i][2]);
}

static int uctx_open(ferry_ctx *ctx, ucx_ctx **out) {
  ucx_ctx *uc = calloc(1, sizeof *uc);
  if (!uc)
    return fr_err(FERRY_ENOMEM, "ucx: ctx state");
  pthread_mutex_init(&uc->lock, NULL);
  int rc = parse_rma_mode(&uc->rma);
  ucp_config_t *config = NULL;
  ucs_status_t st = rc == 0 ? ucp_config_read(NULL, NULL, &config) : UCS_OK;
  if (st == UCS_OK && rc == 0)
    config_defaults(config);
  if (st == UCS_OK && rc == 0) {
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                                    UCP_PARAM_FIELD_NAME,
                      .features = UCP_FEATURE_STREAM | UCP_FEATURE_RMA | UCP_FEATURE_AM |
                                  UCP_FEATURE_WAKEUP,
                      .mt_workers_shared = 1,
                      .name = "ferry"};
    st = ucp_init(&p, config, &uc->context);
    ucp_config_release(config);
  }
  if (rc == 0 && st != UCS_OK)
    rc = ucs_err(FERRY_ENOTSUP, st, "init (check UCX_TLS / UCX_NET_DEVICES)", NULL);
  if (rc != 0) {
    pthread_mutex_destroy(&uc->lock);
    free(uc);
    return rc;
  }
  uc->refs = 1;
  ucp_context_attr_t attr = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
  if (ucp_context_query(uc->context, &attr) == UCS_OK)
    uc->cuda = attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA);
  *out = uc;
  return 0;
}

static void mapping_unref_locked(ucx_ctx *uc, ucx_mapping *m) {
  if (--m->refs > 0)
    return;
  for (ucx_mapping **pp = &uc->maps; *pp; pp = &(*pp)->next)
    if (*pp == m) {
      *pp = m->next;
      break;
    }
  ucp_rkey_buffer_release(m->rkey);
  if (m->own_memh)
    ucp_mem_unmap(uc->context, m->memh);
  fr_region_release(m->region);
  free(m);
}

/* ---- the link's worker ---- */

static void fail_reqs_locked(ucx_link *u, int status) {
  for (ucx_req *r = u->reqs; r; r = r->next)
    if (!r->done && !r->claimed) {
      r->status = status;
      r->done = true;
    }
  pthread_cond_broadcast(&u->cond);
}

static void kick(ucx_link *u) {
  uint64_t one = 1;
  if (u->watched && write(u->kick, &one, sizeof one) < 0 && errno != EAGAIN)
    fr_debug("ucx kick: %s", strerror(errno));
}

static void stream_peek_locked(ucx_link *u) {
  if (u->chunk || !u->ep || u->gone)
    return;
  size_t len = 0;
  ucs_status_ptr_t p = ucp_stream_recv_data_nb(u->ep, &len);
  HB_TAKE();
  if (UCS_PTR_IS_ERR(p)) {
    u->stream_error = UCS_PTR_STATUS(p);
  } else if (p) {
    u->chunk = p;
    u->chunk_len = len;
    u->chunk_pos = 0;
  }
}

/* Runs the worker until it has nothing more to do. A thread other than the progress thread
 * then leaves the worker armed, or kicks the progress thread when stream data or events are
 * waiting, so nothing it pulled in stays unnoticed. */
static unsigned progress_locked(ucx_link *u) {
  unsigned n = 0, k;
  HB_HAND_OVER();
  while ((k = ucp_worker_progress(u->worker)) > 0)
    n += k;
  HB_TAKE();
  HB_HAND_OVER(); /* what progress sent (answers) */
  if (n > 0) {
    pthread_cond_broadcast(&u->cond);
    if (!tl_progress_thread && u->watched) {
      stream_peek_locked(u);
      if (u->chunk || ucp_worker_arm(u->worker) == UCS_ERR_BUSY)
        kick(u);
    }
  }
  return n;
}

/* Closes the endpoint at once: every operation in flight on it ends (cancelled). */
static void ep_close_locked(ucx_link *u, int status) {
  if (!u->ep)
    return;
  if (u->chunk) {
    ucp_stream_data_release(u->ep, u->chunk);
    u->chunk = NULL;
  }
  for (ucx_remote *r = u->remotes; r; r = r->next)
    if (r->rkey) {
      ucp_rkey_destroy(r->rkey);
      r->rkey = NULL;
      r->ptr = NULL;
    }
  ucx_op op = {0};
  ucp_request_param_t p = op_param(&op);
  p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  op_issued(&op, ucp_ep_close_nbx(u->ep, &p));
  u->ep = NULL;
  u->gone = true;
  for (uint64_t end = fr_now_ns() + 2000000000ull; !op.done && fr_now_ns() < end;)
    ucp_worker_progress(u->worker);
  fail_reqs_locked(u, status);
}

static void unwatch_locked(ucx_link *u, int epfd) {
  if (!u->watched)
    return;
  epoll_ctl(epfd, EPOLL_CTL_DEL, u->efd, NULL);
  epoll_ctl(epfd, EPOLL_CTL_DEL, u->kick, NULL);
  u->watched = false;
}

/* Events on the worker's fd and on the kick eventfd drive the link like its socket does. */
static int watch_locked(ucx_link *u) {
  ferry_link *l = u->link;
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &l->poller};
  if (epoll_ctl(l->ctx->epfd, EPOLL_CTL_ADD, u->efd, &ev) < 0)
    return fr_err_errno(FERRY_ESYS, "ucx: epoll_ctl (worker fd)");
  if (epoll_ctl(l->ctx->epfd, EPOLL_CTL_ADD, u->kick, &ev) < 0) {
    epoll_ctl(l->ctx->epfd, EPOLL_CTL_DEL, u->efd, NULL);
    return fr_err_errno(FERRY_ESYS, "ucx: epoll_ctl (kick fd)");
  }
  u->watched = true;
  return 0;
}

/* Frees everything UCX holds for a link that left the ctx's list (the ctx's UCX state must
 * still exist). Takes the link's lock, then the ctx's, never both: callbacks running under the
 * link's lock take the ctx's. */
static void release_ucx(ucx_link *u, int epfd) {
  pthread_mutex_lock(&u->lock);
  unwatch_locked(u, epfd);
  ep_close_locked(u, FERRY_ECLOSED);
  if (u->worker)
    ucp_worker_destroy(u->worker);
  u->worker = NULL;
  ucx_given *given = u->given;
  u->given = NULL;
  pthread_mutex_unlock(&u->lock);
  pthread_mutex_lock(&u->uc->lock);
  for (ucx_given *g = given, *next; g; g = next) {
    next = g->next;
    mapping_unref_locked(u->uc, g->m);
    free(g);
  }
  pthread_mutex_unlock(&u->uc->lock);
}

/* ---- active messages: the owner's side ---- */

typedef struct ucx_reply {
  uint8_t hdr[RKEY_RESP_BYTES];
  fr_region *region; /* READ_RESP: the bytes being sent */
} ucx_reply;

static void reply_done(void *request, ucs_status_t st, void *arg) {
  ucx_reply *r = arg;
  fr_region_release(r->region);
  free(r);
  if (request)
    ucp_request_free(request);
}

static void send_reply(ucx_link *u, unsigned id, ucx_reply *r, size_t hdr_len, const void *data,
                       size_t len) {
  if (!u->ep) {
    reply_done(NULL, UCS_OK, r);
    return;
  }
  ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                           .cb.send = reply_done,
                           .user_data = r};
  HB_HAND_OVER();
  ucs_status_ptr_t sp = ucp_am_send_nbx(u->ep, id, r->hdr, hdr_len, data, len, &p);
  if (sp == NULL || UCS_PTR_IS_ERR(sp))
    reply_done(NULL, UCS_OK, r);
}

/* ---- regions of UCX memory (ferry_alloc in a ctx that lists ucx first) ---- */

typedef struct ucx_memory {
  ucx_ctx *uc; /* a reference */
  ucp_mem_h memh;
} ucx_memory;

static void uctx_unref(ucx_ctx *uc) {
  if (__atomic_sub_fetch(&uc->refs, 1, __ATOMIC_ACQ_REL) > 0)
    return;
  ucp_cleanup(uc->context);
  pthread_mutex_destroy(&uc->lock);
  free(uc);
}

static void memory_release(void *handle) {
  ucx_memory *mem = handle;
  ucp_mem_unmap(mem->uc->context, mem->memh);
  uctx_unref(mem->uc);
  free(mem);
}

/* Memory UCX allocates (its first choice is shared memory, sysv or posix, whose rkeys a peer on
 * the host maps: a read is then one memcpy, where a memfd region is copied by cma). */
static int ucx_alloc_region(ferry_ctx *ctx, size_t bytes, fr_region_mem *out) {
  ucx_ctx *uc = uctx_of(ctx);
  ucx_memory *mem = uc ? calloc(1, sizeof *mem) : NULL;
  if (!mem)
    return fr_err(uc ? FERRY_ENOMEM : FERRY_EINVAL, "ucx: memory record");
  ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                                           UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                           UCP_MEM_MAP_PARAM_FIELD_FLAGS,
                             .address = NULL,
                             .length = bytes,
                             .flags = UCP_MEM_MAP_ALLOCATE};
  ucs_status_t st = ucp_mem_map(uc->context, &mp, &mem->memh);
  ucp_mem_attr_t a = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH};
  if (st == UCS_OK && (st = ucp_mem_query(mem->memh, &a)) == UCS_OK &&
      ((uintptr_t)a.address % FR_SHM_HEADER_BYTES != 0 || a.length < bytes))
    st = UCS_ERR_UNSUPPORTED; /* heap memory: neither page-aligned nor zeroed */
  if (st != UCS_OK) {
    if (mem->memh)
      ucp_mem_unmap(uc->context, mem->memh);
    free(mem);
    return ucs_err(FERRY_ENOSHM, st, "mem_map (allocate)", NULL);
  }
  mem->uc = uc;
  __atomic_add_fetch(&uc->refs, 1, __ATOMIC_RELAXED);
  *out = (fr_region_mem){.addr = a.address, .release = memory_release, .handle = mem};
  return 0;
}

/* A region's UCX registration: UCX memory's own, or a new one of a memfd's mapping (*own). */
static ucs_status_t region_memh(ucx_ctx *uc, const fr_region *reg, ucp_mem_h *memh, bool *own) {
  *own = reg->mem.release != memory_release;
  if (!*own) {
    *memh = ((const ucx_memory *)reg->mem.handle)->memh;
    return UCS_OK;
  }
  ucp_mem_map_params_t mp = {.field_mask =
                                 UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                             .address = reg->map,
                             .length = reg->map_bytes};
  return ucp_mem_map(uc->context, &mp, memh);
}

/* The mapping of a shared region, found or made (refs 0 when new: the caller takes one). */
static int mapping_get_locked(ucx_ctx *uc, fr_region *reg, ucx_mapping **out) {
  ucx_mapping *m = uc->maps;
  while (m && m->region != reg)
    m = m->next;
  if (m) {
    *out = m;
    return 0;
  }
  if (!(m = calloc(1, sizeof *m)))
    return fr_err(FERRY_ENOMEM, "ucx: mapping record");
  ucs_status_t st = region_memh(uc, reg, &m->memh, &m->own_memh);
  if (st == UCS_OK &&
      (st = ucp_rkey_pack(uc->context, m->memh, &m->rkey, &m->rkey_len)) != UCS_OK && m->own_memh)
    ucp_mem_unmap(uc->context, m->memh);
  if (st != UCS_OK) {
    free(m);
    return ucs_err(FERRY_ESYS, st, "mem_map", NULL);
  }
  __atomic_add_fetch(&reg->refs, 1, __ATOMIC_RELAXED);
  m->region = reg;
  m->next = uc->maps;
  uc->maps = m;
  *out = m;
  return 0;
}

/* Drops a mapping that mapping_get_locked made and nobody took. */
static void mapping_drop_unused_locked(ucx_ctx *uc, ucx_mapping *m) {
  if (m->refs == 0) {
    m->refs = 1;
    mapping_unref_locked(uc, m);
  }
}

/* The mapping of a shared region, made on first use; the link holds a reference. */
static int mapping_for(ucx_link *u, fr_region *reg, ucx_mapping **out) {
  ucx_ctx *uc = u->uc;
  pthread_mutex_lock(&uc->lock);
  ucx_mapping *m = NULL;
  int rc = mapping_get_locked(uc, reg, &m);
  bool given = false;
  for (ucx_given *g = u->given; rc == 0 && g && !given; g = g->next)
    given = g->m == m;
  ucx_given *g = rc == 0 && !given ? calloc(1, sizeof *g) : NULL;
  if (g) {
    g->m = m;
    g->next = u->given;
    u->given = g;
    m->refs++;
  } else if (rc == 0 && !given) {
    rc = fr_err(FERRY_ENOMEM, "ucx: mapping record");
    mapping_drop_unused_locked(uc, m);
  }
  pthread_mutex_unlock(&uc->lock);
  if (rc == 0)
    *out = m;
  return rc;
}

/* A peer asks for a region's rkey: key checked here; registered memory is refused (ENOTSUP)
 * since the caller may free it after ferry_deregister, so peers read it with requests. */
static ucs_status_t on_rkey_req(void *arg, const void *header, size_t header_len, void *data,
                                size_t len, const ucp_am_recv_param_t *param) {
  ucx_link *u = arg;
  if (header_len != RKEY_REQ_BYTES || !u->uc)
    return UCS_OK;
  const uint8_t *h = header;
  fr_region *reg = NULL;
  ucx_mapping *m = NULL;
  int status =
      fr_region_acquire(&u->link->ctx->regions, fr_get_u64(h + 8), fr_get_u64(h + 16), 0, 0, &reg);
  if (status == 0 && !reg->map)
    status = FERRY_ENOTSUP;
  if (status == 0)
    status = mapping_for(u, reg, &m);
  fr_region_release(reg);
  ucx_reply *r = calloc(1, sizeof *r);
  if (!r)
    return UCS_OK; /* the peer times out */
  fr_put_u64(r->hdr, fr_get_u64(h));
  fr_put_u64(r->hdr + 8, (uint64_t)(int64_t)status);
  fr_put_u64(r->hdr + 16, status == 0 ? (uint64_t)(uintptr_t)m->region->map : 0);
  fr_put_u64(r->hdr + 24, status == 0 ? m->region->size : 0);
  send_reply(u, AM_RKEY_RESP, r, RKEY_RESP_BYTES, status == 0 ? m->rkey : NULL,
             status == 0 ? m->rkey_len : 0);
  return UCS_OK;
}

/* Publishes a shared region's rkey for records (access.h): BLOB_HDR_BYTES, then the packed rkey.
 * The mapping stays until the ctx closes, since the owner
 * cannot know who read the record (a region freed meanwhile keeps its memory until then, and its
 * state word says it was freed). Registered memory is not published: peers ask, and are told to
 * use read requests. */
static int ucx_region_pack(ferry_ctx *ctx, fr_region *reg, uint8_t *buf, size_t cap, size_t *len) {
  ucx_ctx *uc = uctx_of(ctx);
  *len = 0;
  if (!uc || !reg->map)
    return 0;
  pthread_mutex_lock(&uc->lock);
  ucx_mapping *m = NULL;
  int rc = mapping_get_locked(uc, reg, &m);
  if (rc == 0 && BLOB_HDR_BYTES + m->rkey_len > cap) {
    rc = fr_err(FERRY_ERANGE, "ucx: packed rkey of %zu bytes", m->rkey_len);
    mapping_drop_unused_locked(uc, m);
  } else if (rc == 0) {
    if (!m->published)
      m->refs++;
    m->published = true;
    fr_put_u64(buf, reg->id);
    fr_put_u64(buf + 8, reg->key);
    fr_put_u64(buf + 16, (uint64_t)(uintptr_t)reg->map);
    fr_put_u64(buf + 24, reg->size);
    memcpy(buf + BLOB_HDR_BYTES, m->rkey, m->rkey_len);
    *len = BLOB_HDR_BYTES + m->rkey_len;
  }
  pthread_mutex_unlock(&uc->lock);
  return rc;
}

/* A peer asks for bytes: key and bounds checked here, then the bytes go from the region. */
static ucs_status_t on_read_req(void *arg, const void *header, size_t header_len, void *data,
                                size_t len, const ucp_am_recv_param_t *param) {
  ucx_link *u = arg;
  if (header_len != READ_REQ_BYTES)
    return UCS_OK;
  const uint8_t *h = header;
  uint64_t off = fr_get_u64(h + 24), n = fr_get_u64(h + 32);
  fr_region *reg = NULL;
  int status = n > u->link->ctx->max_payload
                   ? FERRY_ERANGE
                   : fr_region_acquire(&u->link->ctx->regions, fr_get_u64(h + 8),
                                       fr_get_u64(h + 16), off, n, &reg);
  if (status == 0 && check_memory(u, reg->data, "read") != 0)
    status = FERRY_ENOTSUP;
  ucx_reply *r = calloc(1, sizeof *r);
  if (!r) {
    fr_region_release(reg);
    return UCS_OK;
  }
  r->region = status == 0 ? reg : NULL;
  if (status != 0)
    fr_region_release(reg);
  fr_put_u64(r->hdr, fr_get_u64(h));
  fr_put_u64(r->hdr + 8, (uint64_t)(int64_t)status);
  send_reply(u, AM_READ_RESP, r, READ_RESP_BYTES, status == 0 ? reg->data + off : NULL,
             status == 0 ? n : 0);
  return UCS_OK;
}

/* ---- active messages: the requester's side ---- */

static ucx_req *req_find_locked(ucx_link *u, uint64_t id, int answer) {
  for (ucx_req *r = u->reqs; r; r = r->next)
    if (r->id == id && r->answer == answer && !r->done && !r->claimed)
      return r;
  return NULL;
}

static void req_finish(ucx_req *r, int status) {
  r->status = status;
  r->done = true;
}

static void read_data_cb(void *request, ucs_status_t st, size_t len, void *arg) {
  req_finish(arg, st == UCS_OK ? 0 : FERRY_EPEER);
  ucp_request_free(request);
}

static ucs_status_t on_rkey_resp(void *arg, const void *header, size_t header_len, void *data,
                                 size_t len, const ucp_am_recv_param_t *param) {
  ucx_link *u = arg;
  if (header_len != RKEY_RESP_BYTES || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV))
    return UCS_OK;
  const uint8_t *h = header;
  ucx_req *r = req_find_locked(u, fr_get_u64(h), AM_RKEY_RESP);
  if (!r)
    return UCS_OK;
  int status = (int)(int64_t)fr_get_u64(h + 8);
  r->base = fr_get_u64(h + 16);
  r->size = fr_get_u64(h + 24);
  if (status == 0 && (len == 0 || !(r->rkey = malloc(len))))
    status = len == 0 ? FERRY_EPROTO : FERRY_ENOMEM;
  if (status == 0) {
    memcpy(r->rkey, data, len);
    r->rkey_len = len;
  }
  req_finish(r, status > 0 ? FERRY_EPROTO : status);
  return UCS_OK;
}

static ucs_status_t on_read_resp(void *arg, const void *header, size_t header_len, void *data,
                                 size_t len, const ucp_am_recv_param_t *param) {
  ucx_link *u = arg;
  if (header_len != READ_RESP_BYTES)
    return UCS_OK;
  const uint8_t *h = header;
  ucx_req *r = req_find_locked(u, fr_get_u64(h), AM_READ_RESP);
  if (!r)
    return UCS_OK; /* timed out: dropped (a rendezvous sender completes) */
  int status = (int)(int64_t)fr_get_u64(h + 8);
  if (status == 0 && len != r->len)
    status = FERRY_EPROTO;
  if (status != 0 || len == 0) {
    req_finish(r, status > 0 ? FERRY_EPROTO : status);
    return UCS_OK;
  }
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    memcpy(r->dst, data, len);
    req_finish(r, 0);
    return UCS_OK;
  }
  ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                           .cb.recv_am = read_data_cb,
                           .user_data = r};
  r->claimed = true;
  ucs_status_ptr_t sp = ucp_am_recv_data_nbx(u->worker, data, r->dst, len, &p);
  if (sp == NULL)
    req_finish(r, 0);
  else if (UCS_PTR_IS_ERR(sp))
    req_finish(r, FERRY_EPEER);
  return UCS_OK;
}

static int set_handlers(ucx_link *u) {
  static const struct {
    unsigned id;
    ucp_am_recv_callback_t cb;
  } handlers[] = {{AM_RKEY_REQ, on_rkey_req},
                  {AM_RKEY_RESP, on_rkey_resp},
                  {AM_READ_REQ, on_read_req},
                  {AM_READ_RESP, on_read_resp}};
  for (size_t i = 0; i < sizeof handlers / sizeof handlers[0]; i++) {
    ucp_am_handler_param_t p = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
        .id = handlers[i].id,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
        .cb = handlers[i].cb,
        .arg = u};
    ucs_status_t st = ucp_worker_set_am_recv_handler(u->worker, &p);
    if (st != UCS_OK)
      return ucs_err(FERRY_ESYS, st, "am handler", NULL);
  }
  return 0;
}

/* ---- waiting ---- */

static int ep_check(const ucx_link *u) {
  return u->ep && !u->gone ? 0 : fr_err(FERRY_EPEER, "ucx link with '%s' is closed", u->link->peer);
}

static int wait_status(ucx_link *u, uint64_t deadline_ns) {
  int st = link_status(u->link);
  if (st == 0 && u->gone)
    st = FERRY_EPEER;
  if (st == 0 && fr_now_ns() >= deadline_ns)
    st = FERRY_ETIMEDOUT;
  return st;
}

/* Sleeps on the worker's fd, as the progress thread does (the progress thread may take the
 * event first: the sleep is bounded). */
static void sleep_locked(ucx_link *u, uint64_t deadline_ns) {
  if (ucp_worker_arm(u->worker) == UCS_ERR_BUSY)
    return;
  int ms = fr_ms_left(deadline_ns);
  struct pollfd p = {.fd = u->efd, .events = POLLIN};
  pthread_mutex_unlock(&u->lock);
  poll(&p, 1, ms < 1 ? ms : 1);
  pthread_mutex_lock(&u->lock);
}

/* Lets cancelled operations complete (their callbacks run in progress) before the memory they
 * name is given back. UCX completes them when the endpoint closes; the bound is a last resort. */
static void settle_locked(ucx_link *u, const bool *done) {
  for (uint64_t end = fr_now_ns() + 10000000000ull; !*done;) {
    if (u->worker)
      ucp_worker_progress(u->worker);
    if (*done || fr_now_ns() > end)
      break;
    sched_yield();
  }
  if (!*done)
    fr_warn("ucx link with '%s': an operation did not end after its endpoint closed",
            u->link->peer);
}

/* Waits with the link's lock held until *done: spins progressing the worker, then sleeps until
 * the progress thread signals. On timeout or a dead link it closes the endpoint, so nothing in
 * flight still writes to the caller's memory when it returns. */
static int wait_locked(ucx_link *u, const bool *done, uint64_t deadline_ns) {
  uint64_t spin_end = fr_now_ns() + (uint64_t)u->link->ctx->spin_us * 1000u;
  int rc = 0;
  while (!*done && (rc = wait_status(u, deadline_ns)) == 0) {
    if (progress_locked(u) > 0 || *done)
      continue;
    if (fr_now_ns() < spin_end) {
      pthread_mutex_unlock(&u->lock);
      sched_yield();
      pthread_mutex_lock(&u->lock);
    } else {
      sleep_locked(u, deadline_ns);
    }
  }
  if (*done)
    return 0;
  if (rc == FERRY_ETIMEDOUT)
    fr_link_fail(u->link, rc, "a ucx transfer did not finish in time");
  ep_close_locked(u, rc);
  settle_locked(u, done);
  return rc;
}

/* ---- the preamble and the endpoint ---- */

static void ep_failed(void *arg, ucp_ep_h ep, ucs_status_t st) {
  ucx_link *u = arg;
  char why[160];
  snprintf(why, sizeof why, "ucx endpoint failed: %s", ucs_status_string(st));
  fr_link_fail(u->link, FERRY_EPEER, why);
}

/* What the endpoint's lanes offer: plain RMA that is not UCP's tcp emulation (`lane[..] ...
 * rma#N`; on shared memory, gets of memory UCX did not allocate are emulated through the owner
 * too), and shared-memory lanes (sysv, posix: peer regions of UCX memory map here). */
static void lanes_probe(ucp_ep_h ep, bool *real_get, bool *shm) {
  char *text = NULL;
  size_t size = 0;
  FILE *f = open_memstream(&text, &size);
  *real_get = *shm = false;
  if (!f)
    return;
  ucp_ep_print_info(ep, f);
  fclose(f);
  char *save = NULL;
  for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
    if (!strstr(line, "lane["))
      continue;
    *real_get |= strstr(line, " rma#") && !strstr(line, "tcp/");
    *shm |= strstr(line, "sysv/") || strstr(line, "posix/");
  }
  free(text);
}

/* An endpoint with `mode`; UCX's complaint about a mode its transports lack is kept quiet
 * unless the user set UCX_LOG_LEVEL (ferry falls back, see ep_create_locked). */
static ucs_status_t ep_create_quiet(ucx_link *u, ucp_ep_params_t *p, ucp_err_handling_mode_t mode) {
  static pthread_mutex_t quiet = PTHREAD_MUTEX_INITIALIZER;
  p->err_mode = mode;
  if (getenv("UCX_LOG_LEVEL"))
    return ucp_ep_create(u->worker, p, &u->ep);
  pthread_mutex_lock(&quiet);
  ucs_log_level_t level = ucs_global_opts.log_component.log_level;
  ucs_global_opts.log_component.log_level = UCS_LOG_LEVEL_FATAL;
  ucs_status_t st = ucp_ep_create(u->worker, p, &u->ep);
  ucs_global_opts.log_component.log_level = level;
  pthread_mutex_unlock(&quiet);
  return st;
}

/* UCX reports a dead peer (err_mode PEER) where its transports can; its shared-memory ones
 * cannot, and there the link's socket alone tells (its end closes the endpoint). Every link
 * tries PEER first, then NONE, whatever earlier links learned: UCP pairs a link's two endpoints
 * by how many each worker created before, so both sides must make the same tries (a ctx that
 * skipped the failing try because an earlier link had failed it left a fresh peer's messages
 * on an endpoint nobody read). */
static int ep_create_locked(ucx_link *u) {
  ucp_ep_params_t p = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                     UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                     UCP_EP_PARAM_FIELD_ERR_HANDLER,
                       .address = (const ucp_address_t *)u->pre,
                       .err_handler = {.cb = ep_failed, .arg = u}};
  ucs_status_t st = ep_create_quiet(u, &p, UCP_ERR_HANDLING_MODE_PEER);
  if (st != UCS_OK) {
    p.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    st = ucp_ep_create(u->worker, &p, &u->ep);
  }
  if (st != UCS_OK)
    return ucs_err(FERRY_ECONNECT, st, "endpoint", u->link);
  int mode = u->uc ? u->uc->rma : RMA_AM;
  bool real_get, shm;
  lanes_probe(u->ep, &real_get, &shm);
  u->use_get = mode == RMA_GET || (mode == RMA_AUTO && real_get);
  u->try_ptr = mode != RMA_AM && shm;
  int rc = watch_locked(u);
  if (rc != 0)
    return rc;
  u->ready = true;
  pthread_cond_broadcast(&u->cond);
  fr_debug("ucx link with '%s': endpoint up, one-sided reads by %s%s", u->link->peer,
           u->use_get ? "get" : "active message",
           u->try_ptr ? " (memcpy where the peer's region is UCX memory)" : "");
  return 0;
}

/* Reads the peer's preamble from the socket; creates the endpoint once it is whole. */
static int preamble_take(ucx_link *u, const uint8_t *p, size_t n) {
  while (n > 0) {
    if (u->pre_have < PREAMBLE_BYTES) {
      size_t k = PREAMBLE_BYTES - u->pre_have < n ? PREAMBLE_BYTES - u->pre_have : n;
      memcpy(u->pre_hdr + u->pre_have, p, k);
      u->pre_have += k, p += k, n -= k;
      if (u->pre_have < PREAMBLE_BYTES)
        return 0;
      u->pre_want = fr_get_u32(u->pre_hdr + 4);
      if (fr_get_u32(u->pre_hdr) != PREAMBLE_MAGIC || u->pre_want == 0 || u->pre_want > ADDRESS_MAX)
        return fr_err(FERRY_EPROTO, "ucx: '%s' sent a bad preamble", u->link->peer);
      if (!(u->pre = malloc(u->pre_want)))
        return fr_err(FERRY_ENOMEM, "ucx: preamble");
      continue;
    }
    size_t have = u->pre_have - PREAMBLE_BYTES;
    if (have == u->pre_want)
      return fr_err(FERRY_EPROTO, "ucx: '%s' sent bytes on the socket after its preamble",
                    u->link->peer);
    size_t k = u->pre_want - have < n ? u->pre_want - have : n;
    memcpy(u->pre + have, p, k);
    u->pre_have += k, p += k, n -= k;
    if (have + k == u->pre_want) {
      pthread_mutex_lock(&u->lock);
      int rc = ep_create_locked(u);
      pthread_mutex_unlock(&u->lock);
      if (rc != 0)
        return rc;
    }
  }
  return 0;
}

static int send_preamble(ucx_link *u) {
  ucp_address_t *addr = NULL;
  size_t len = 0;
  pthread_mutex_lock(&u->lock);
  ucs_status_t st = ucp_worker_get_address(u->worker, &addr, &len);
  pthread_mutex_unlock(&u->lock);
  if (st != UCS_OK)
    return ucs_err(FERRY_ESYS, st, "worker address", NULL);
  uint8_t hdr[PREAMBLE_BYTES];
  fr_put_u32(hdr, PREAMBLE_MAGIC);
  fr_put_u32(hdr + 4, (uint32_t)len);
  struct iovec iov[2] = {{hdr, sizeof hdr}, {addr, len}};
  int rc =
      fr_sock_sendv(u->link->poller.fd, iov, 2, -1, 0, fr_deadline_ns(u->link->ctx->timeout_ms));
  pthread_mutex_lock(&u->lock);
  ucp_worker_release_address(u->worker, addr);
  pthread_mutex_unlock(&u->lock);
  return rc;
}

/* ---- link state ---- */

static int worker_create(ucx_link *u) {
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SERIALIZED};
  ucs_status_t st = ucp_worker_create(u->uc->context, &wp, &u->worker);
  if (st != UCS_OK)
    return ucs_err(FERRY_ESYS, st, "worker", NULL);
  if ((st = ucp_worker_get_efd(u->worker, &u->efd)) != UCS_OK)
    return ucs_err(FERRY_ESYS, st, "worker event fd", NULL);
  if ((u->kick = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
    return fr_err_errno(FERRY_ESYS, "ucx: eventfd");
  return set_handlers(u);
}

static int link_state_new(ferry_link *l) {
  ucx_ctx *uc = uctx_of(l->ctx);
  ucx_link *u = calloc(1, sizeof *u);
  if (!uc || !u) {
    free(u);
    return fr_err(uc ? FERRY_ENOMEM : FERRY_EINVAL, "ucx: link state");
  }
  u->link = l;
  u->uc = uc;
  u->efd = u->kick = -1;
  pthread_mutexattr_t ma;
  pthread_mutexattr_init(&ma);
  pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_RECURSIVE);
  pthread_mutex_init(&u->lock, &ma);
  pthread_mutexattr_destroy(&ma);
  fr_cond_init_monotonic(&u->cond);
  pthread_mutex_lock(&uc->lock);
  u->next = uc->links;
  uc->links = u;
  pthread_mutex_unlock(&uc->lock);
  l->tdata = u; /* freed by link_fini even when the worker cannot be made */
  return worker_create(u);
}

static void ucx_link_fini(ferry_link *l) {
  ucx_link *u = l->tdata;
  if (!u)
    return;
  ucx_ctx *uc = u->uc;
  if (uc) {
    pthread_mutex_lock(&uc->lock);
    for (ucx_link **pp = &uc->links; *pp; pp = &(*pp)->next)
      if (*pp == u) {
        *pp = u->next;
        break;
      }
    pthread_mutex_unlock(&uc->lock);
    release_ucx(u, l->ctx->epfd);
  }
  for (ucx_remote *r = u->remotes, *next; r; r = next) {
    next = r->next;
    free(r->packed);
    free(r);
  }
  if (u->kick >= 0)
    close(u->kick);
  free(u->pre);
  pthread_mutex_destroy(&u->lock);
  pthread_cond_destroy(&u->cond);
  free(u);
}

/* ---- ops: listen, dial and the handshake hooks ---- */

static int ucx_listen(ferry_ctx *ctx, int *fd, char *url, size_t url_len) {
  ucx_ctx *uc = NULL;
  int rc = uctx_open(ctx, &uc);
  if (rc != 0)
    return rc;
  *fr_ctx_tstate(ctx, &fr_ucx_transport) = uc;
  char where[256];
  const char *cfg = fr_config_str("FERRY_UCX_LISTEN");
  if (*cfg) {
    fr_str_copy(where, sizeof where, cfg);
  } else { /* the tcp listener's host, any port */
    const char *colon = strrchr(ctx->tcp_listen, ':');
    int n = colon ? (int)(colon - ctx->tcp_listen) : (int)strlen(ctx->tcp_listen);
    snprintf(where, sizeof where, "%.*s:0", n, ctx->tcp_listen);
  }
  char *saved = ctx->tcp_listen; /* tcp's listen reads it; the ctx is not running yet */
  ctx->tcp_listen = where;
  rc = fr_tcp_transport.listen(ctx, fd, url, url_len);
  ctx->tcp_listen = saved;
  if (rc == 0 && strncmp(url, "tcp://", 6) == 0)
    memcpy(url, "ucx", 3);
  return rc;
}

static int ucx_dial(const char *where, int timeout_ms, int *fd) {
  return fr_tcp_transport.dial(where, timeout_ms, fd);
}

static void ucx_setup(int fd) { fr_tcp_transport.setup(fd); }

static int ucx_offer(ferry_link *l, int *fd) {
  *fd = -1;
  return link_state_new(l);
}

static int ucx_accept_offer(ferry_link *l, int fd) {
  if (fd >= 0)
    close(fd);
  return link_state_new(l);
}

static void ucx_opened(ferry_link *l) {
  ucx_link *u = ucx_of(l);
  __atomic_store_n(&u->stream_on, true, __ATOMIC_RELEASE);
  int rc = send_preamble(u);
  if (rc != 0)
    fr_link_fail(l, rc, ferry_last_error());
}

static bool stream_on(ferry_link *l) {
  ucx_link *u = ucx_of(l);
  return u && __atomic_load_n(&u->stream_on, __ATOMIC_ACQUIRE);
}

/* ---- ops: the byte stream ---- */

/* The socket: the peer's preamble, then only its end. Also the worker's events. */
static int ucx_readable(ferry_link *l) {
  if (!stream_on(l))
    return 0;
  tl_progress_thread = true;
  ucx_link *u = ucx_of(l);
  uint64_t v;
  if (u->kick >= 0 && read(u->kick, &v, sizeof v) < 0 && errno != EAGAIN)
    fr_debug("ucx kick: %s", strerror(errno));
  uint8_t buf[4096];
  for (;;) {
    ssize_t n = fr_link_sock_recv(l, buf, sizeof buf);
    if (n == -EAGAIN || n == -EWOULDBLOCK)
      break;
    if (n == 0)
      return fr_err(FERRY_EPEER, "peer closed the connection");
    if (n < 0) {
      errno = (int)-n;
      return fr_err_errno(FERRY_EPEER, "recv");
    }
    int rc = preamble_take(u, buf, (size_t)n);
    if (rc != 0)
      return rc;
  }
  int rc = link_status(l);
  if (rc != 0)
    return fr_err(rc, "link closed");
  pthread_mutex_lock(&u->lock);
  if (u->worker)
    progress_locked(u);
  pthread_mutex_unlock(&u->lock);
  return 0;
}

static size_t chunk_copy_locked(ucx_link *u, uint8_t *dst, size_t len) {
  size_t n = u->chunk_len - u->chunk_pos < len ? u->chunk_len - u->chunk_pos : len;
  if (dst)
    memcpy(dst, (uint8_t *)u->chunk + u->chunk_pos, n);
  u->chunk_pos += n;
  if (u->chunk_pos == u->chunk_len) {
    ucp_stream_data_release(u->ep, u->chunk);
    u->chunk = NULL;
  }
  return n;
}

/* Stream bytes (progress thread): what UCX has, across its chunks, without waiting. */
static ssize_t ucx_recv(ferry_link *l, void *dst, size_t len) {
  if (!stream_on(l))
    return fr_link_sock_recv(l, dst, len);
  ucx_link *u = ucx_of(l);
  pthread_mutex_lock(&u->lock);
  size_t got = 0;
  bool progressed = false;
  while (u->ready && !u->gone && got < len) {
    stream_peek_locked(u);
    if (!u->chunk && !progressed && !u->stream_error) {
      progress_locked(u);
      progressed = true;
      continue;
    }
    if (!u->chunk)
      break;
    got += chunk_copy_locked(u, dst ? (uint8_t *)dst + got : NULL, len - got);
  }
  ucs_status_t err = u->stream_error;
  pthread_mutex_unlock(&u->lock);
  if (got > 0)
    return (ssize_t)got;
  if (err != UCS_OK) {
    fr_err(FERRY_EPEER, "ucx stream: %s", ucs_status_string(err));
    return -EPIPE;
  }
  return -EAGAIN;
}

/* Before the progress thread sleeps: false while stream data waits or the worker has events. */
static bool ucx_idle(ferry_link *l) {
  if (!stream_on(l))
    return true;
  ucx_link *u = ucx_of(l);
  pthread_mutex_lock(&u->lock);
  bool more = false;
  if (u->ready && !u->gone) {
    stream_peek_locked(u);
    more = u->chunk || ucp_worker_arm(u->worker) == UCS_ERR_BUSY;
  }
  pthread_mutex_unlock(&u->lock);
  return !more;
}

static int wait_ready_locked(ucx_link *u, uint64_t deadline_ns) {
  while (!u->ready) {
    int rc = wait_status(u, deadline_ns);
    if (rc != 0)
      return fr_err(rc, "ucx link with '%s': no endpoint", u->link->peer);
    uint64_t until = fr_now_ns() + 10000000ull;
    until = until < deadline_ns ? until : deadline_ns;
    struct timespec ts = fr_timespec(until);
    pthread_cond_timedwait(&u->cond, &u->lock, &ts);
  }
  return u->gone ? fr_err(FERRY_EPEER, "ucx link with '%s' is closed", u->link->peer) : 0;
}

static int ucx_sendv(ferry_link *l, struct iovec *iov, int iovcnt, int fd_out,
                     uint64_t deadline_ns) {
  if (!stream_on(l))
    return fr_link_sock_sendv(l, iov, iovcnt, fd_out, deadline_ns);
  ucx_link *u = ucx_of(l);
  ucp_dt_iov_t local[16], *v = local;
  if (iovcnt > 16 && !(v = malloc(sizeof *v * (size_t)iovcnt)))
    return fr_err(FERRY_ENOMEM, "ucx send: iovec");
  size_t n = 0;
  for (int i = 0; i < iovcnt; i++)
    if (iov[i].iov_len > 0)
      v[n++] = (ucp_dt_iov_t){iov[i].iov_base, iov[i].iov_len};
  pthread_mutex_lock(&u->lock);
  int rc = wait_ready_locked(u, deadline_ns);
  if (rc == 0 && n > 0) {
    ucx_op op = {0};
    ucp_request_param_t p = op_param(&op);
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    p.datatype = ucp_dt_make_iov();
    op_issued(&op, ucp_stream_send_nbx(u->ep, v, n, &p));
    rc = wait_locked(u, &op.done, deadline_ns);
    if (rc == 0 && op.status != UCS_OK)
      rc = ucs_err(FERRY_EPEER, op.status, "send", l);
    else if (rc != 0)
      rc = fr_err(rc, "ucx send to '%s': %s", l->peer, ferry_strerror(rc));
  }
  pthread_mutex_unlock(&u->lock);
  if (v != local)
    free(v);
  return rc;
}

/* Waits for the peer's end on the socket (its shutdown, seen without taking bytes) or `end`. */
static void wait_peer_end(ferry_link *l, uint64_t end) {
  for (;;) {
    int ms = fr_ms_left(end);
    struct pollfd p = {.fd = l->poller.fd, .events = POLLRDHUP};
    int n = ms > 0 ? poll(&p, 1, ms) : 0;
    if (n >= 0 || errno != EINTR)
      return;
  }
}

/* A completed stream send only means UCX took the bytes: they may still wait in a transport's
 * send buffer, and the close that follows (ep_close_locked, FORCE) would cancel them. Nor may
 * the endpoint close as soon as they left: the peer's UCX drops the stream data it has not
 * handed over yet when it sees the endpoint fail. So a graceful close flushes the endpoint, ends
 * the socket (the peer then takes in the stream, link.c's rx_last, and ends its side) and waits
 * for the peer's end before the link goes on to close the endpoint; until `end` at most
 * (fr_link_flush_deadline). A flush that does not end in time is cancelled with the endpoint. */
static void ucx_flush(ferry_link *l, uint64_t end) {
  ucx_link *u = ucx_of(l);
  if (!stream_on(l) || link_status(l) != 0)
    return;
  bool flushed = false;
  pthread_mutex_lock(&u->lock);
  if (u->ready && u->ep && !u->gone) {
    ucx_op op = {0};
    ucp_request_param_t p = op_param(&op);
    op_issued(&op, ucp_ep_flush_nbx(u->ep, &p));
    while (!op.done && fr_now_ns() < end)
      if (progress_locked(u) == 0 && !op.done)
        sleep_locked(u, end);
    flushed = op.done && op.status == UCS_OK;
    if (!op.done) {
      fr_debug("ucx link with '%s': its flush did not end in time; closing", l->peer);
      ep_close_locked(u, FERRY_ECLOSED);
      settle_locked(u, &op.done);
    } else if (op.status != UCS_OK) {
      fr_debug("ucx link with '%s': flush: %s", l->peer, ucs_status_string(op.status));
    }
  }
  pthread_mutex_unlock(&u->lock);
  if (!flushed)
    return;
  shutdown(l->poller.fd, SHUT_WR);
  wait_peer_end(l, end);
}

static void ucx_retire(ferry_link *l) {
  ucx_link *u = ucx_of(l);
  if (!u)
    return;
  pthread_mutex_lock(&u->lock);
  unwatch_locked(u, l->ctx->epfd);
  ep_close_locked(u, link_status(l) ? link_status(l) : FERRY_EPEER);
  pthread_mutex_unlock(&u->lock);
}

/* ---- ops: one-sided reads and writes ---- */

static int request_locked(ucx_link *u, ucx_req *r, unsigned am, const uint8_t *hdr, size_t len,
                          uint64_t deadline_ns) {
  int rc = wait_ready_locked(u, deadline_ns);
  if (rc != 0)
    return rc;
  r->id = __atomic_add_fetch(&u->link->ctx->next_req_id, 1, __ATOMIC_RELAXED);
  uint8_t h[READ_REQ_BYTES];
  memcpy(h, hdr, len);
  fr_put_u64(h, r->id);
  r->next = u->reqs;
  u->reqs = r;
  ucx_op op = {0};
  ucp_request_param_t p = op_param(&op);
  op_issued(&op, ucp_am_send_nbx(u->ep, am, h, len, NULL, 0, &p));
  rc = wait_locked(u, &op.done, deadline_ns);
  if (rc == 0 && op.status != UCS_OK)
    rc = FERRY_EPEER;
  if (rc == 0)
    rc = wait_locked(u, &r->done, deadline_ns);
  if (r->claimed)
    settle_locked(u, &r->done);
  for (ucx_req **pp = &u->reqs; *pp; pp = &(*pp)->next)
    if (*pp == r) {
      *pp = r->next;
      break;
    }
  return rc ? rc : r->status;
}

static int answer_error(ferry_link *l, int rc, const char *what, uint64_t id) {
  if (rc == FERRY_EPEER || rc == FERRY_ECLOSED || rc == FERRY_ETIMEDOUT)
    return fr_err(rc, "%s of region %llu from '%s': %s", what, (unsigned long long)id, l->peer,
                  rc == FERRY_ETIMEDOUT ? "no answer in time" : "link lost");
  return fr_err(rc, "%s of region %llu from '%s': refused by the owner (%s)", what,
                (unsigned long long)id, l->peer, ferry_strerror(rc));
}

/* How a one-sided access reaches a peer's region (rem: its rkey, when asked for). */
enum { BY_REQUEST, BY_RMA, BY_PTR };
static int access_mode(const ucx_link *u, const ucx_remote *rem) {
  if (!rem || !rem->rkey)
    return BY_REQUEST;
  return rem->ptr ? BY_PTR : u->use_get ? BY_RMA : BY_REQUEST;
}

/* Makes a remote's rkey usable on the endpoint, and maps the region here where UCX can (its
 * header must then name the region, and hold its bytes). */
static int remote_unpack_locked(ucx_link *u, ucx_remote *rem, const void *packed) {
  ucs_status_t st = ucp_ep_rkey_unpack(u->ep, packed, &rem->rkey);
  if (st != UCS_OK)
    return ucs_err(FERRY_EPROTO, st, "rkey unpack", u->link);
  if (!u->try_ptr || ucp_rkey_ptr(rem->rkey, rem->base, &rem->ptr) != UCS_OK) {
    rem->ptr = NULL; /* not UCX memory, or not mappable here */
    return 0;
  }
  const fr_shm_header *h = rem->ptr;
  if (h->magic != FR_SHM_MAGIC || h->region_id != rem->id || h->data_bytes < rem->size)
    rem->ptr = NULL;
  return 0;
}

/* A record's rkey (region_hint, access.h): kept, unpacked on first use. Bytes that do not
 * parse, or a region the link already knows, change nothing. */
static void ucx_region_hint(ferry_link *l, const uint8_t *bytes, size_t len) {
  ucx_link *u = ucx_of(l);
  if (!u || len <= BLOB_HDR_BYTES)
    return;
  ucx_remote *rem = calloc(1, sizeof *rem);
  void *packed = rem ? malloc(len - BLOB_HDR_BYTES) : NULL;
  if (!packed) {
    free(rem);
    return;
  }
  memcpy(packed, bytes + BLOB_HDR_BYTES, len - BLOB_HDR_BYTES);
  *rem = (ucx_remote){.id = fr_get_u64(bytes),
                      .key = fr_get_u64(bytes + 8),
                      .base = fr_get_u64(bytes + 16),
                      .size = fr_get_u64(bytes + 24),
                      .packed = packed,
                      .packed_len = len - BLOB_HDR_BYTES};
  pthread_mutex_lock(&u->lock);
  bool known = false;
  for (ucx_remote *r = u->remotes; r && !known; r = r->next)
    known = r->id == rem->id && r->key == rem->key;
  if (!known) {
    rem->next = u->remotes;
    u->remotes = rem;
  }
  pthread_mutex_unlock(&u->lock);
  if (known) {
    free(packed);
    free(rem);
  }
}

static void remote_unlink_locked(ucx_link *u, ucx_remote *rem) {
  for (ucx_remote **pp = &u->remotes; *pp; pp = &(*pp)->next)
    if (*pp == rem) {
      *pp = rem->next;
      break;
    }
  free(rem->packed);
  free(rem);
}

/* A remote known on this link: one whose rkey came from a record is unpacked now; if that
 * fails, it is forgotten and the owner is asked, as for a region never seen. */
static ucx_remote *remote_known_locked(ucx_link *u, const ferry_region_ref *ref) {
  ucx_remote *r = u->remotes;
  while (r && (r->id != ref->id || r->key != ref->key))
    r = r->next;
  if (!r || !r->packed)
    return r;
  int rc = u->ep ? remote_unpack_locked(u, r, r->packed) : FERRY_EPEER;
  free(r->packed);
  r->packed = NULL;
  if (rc == 0) {
    fr_debug("ucx: region %llu of '%s' by %s, its rkey from a record", (unsigned long long)r->id,
             u->link->peer,
             r->ptr       ? "memcpy (mapped here)"
             : u->use_get ? "get"
                          : "request");
    return r;
  }
  fr_err_clear();
  remote_unlink_locked(u, r);
  return NULL;
}

/* The rkey of a peer's region: from a record, or asked for once per link (the owner checks the
 * key). */
static int remote_for(ucx_link *u, const ferry_region_ref *ref, uint64_t deadline_ns,
                      ucx_remote **out) {
  if ((*out = remote_known_locked(u, ref)) != NULL)
    return 0;
  uint8_t hdr[RKEY_REQ_BYTES] = {0};
  fr_put_u64(hdr + 8, ref->id);
  fr_put_u64(hdr + 16, ref->key);
  ucx_req req = {.answer = AM_RKEY_RESP};
  int rc = request_locked(u, &req, AM_RKEY_REQ, hdr, sizeof hdr, deadline_ns);
  ucx_remote *rem = NULL;
  if ((rc == 0 || rc == FERRY_ENOTSUP) && !(rem = calloc(1, sizeof *rem)))
    rc = fr_err(FERRY_ENOMEM, "ucx: remote region");
  else if (rc != 0 && rc != FERRY_ENOTSUP)
    rc = answer_error(u->link, rc, "rkey", ref->id);
  if (rem)
    *rem = (ucx_remote){.id = ref->id, .key = ref->key, .base = req.base, .size = req.size};
  if (rc == 0 && u->ep)
    rc = remote_unpack_locked(u, rem, req.rkey);
  free(req.rkey);
  if (rem && (rc == 0 || rc == FERRY_ENOTSUP)) {
    fr_debug("ucx: region %llu of '%s' by %s", (unsigned long long)ref->id, u->link->peer,
             access_mode(u, rem) == BY_PTR   ? "memcpy (mapped here)"
             : access_mode(u, rem) == BY_RMA ? "get"
                                             : "request");
    rem->next = u->remotes;
    u->remotes = rem;
    *out = rem;
    return 0;
  }
  free(rem);
  return rc;
}

static int am_read_locked(ucx_link *u, const ferry_region_ref *ref, uint64_t off, void *dst,
                          size_t len, uint64_t deadline_ns) {
  uint8_t hdr[READ_REQ_BYTES] = {0};
  fr_put_u64(hdr + 8, ref->id);
  fr_put_u64(hdr + 16, ref->key);
  fr_put_u64(hdr + 24, off);
  fr_put_u64(hdr + 32, len);
  ucx_req req = {.answer = AM_READ_RESP, .dst = dst, .len = len};
  int rc = request_locked(u, &req, AM_READ_REQ, hdr, sizeof hdr, deadline_ns);
  return rc ? answer_error(u->link, rc, "read", ref->id) : 0;
}

/* What a peer region's state word says: alive, freed, or gone with its owner's ctx (before the
 * link's end may have been noticed). */
static int state_check(const ucx_link *u, const ucx_remote *rem, uint32_t state) {
  if (state == FR_SHM_ALIVE)
    return 0;
  if (state == FR_SHM_CLOSED)
    return fr_err(FERRY_EPEER, "'%s' closed its ctx (region %llu)", u->link->peer,
                  (unsigned long long)rem->id);
  return fr_err(FERRY_ENOTFOUND, "region %llu of '%s' was freed", (unsigned long long)rem->id,
                u->link->peer);
}

/* The region's state word tells a freed region from a live one (the memory itself stays). */
static int rma_locked(ucx_link *u, const ucx_remote *rem, uint64_t off, void *buf, size_t len,
                      bool put, uint64_t deadline_ns) {
  int rc = ep_check(u);
  if (rc != 0)
    return rc;
  uint64_t data = rem->base + FR_SHM_HEADER_BYTES + off;
  uint32_t state = 0;
  ucx_op ops[3] = {{0}};
  ucp_request_param_t p0 = op_param(&ops[0]), p1 = op_param(&ops[1]), p2 = op_param(&ops[2]);
  op_issued(&ops[0], put ? ucp_put_nbx(u->ep, buf, len, data, rem->rkey, &p0)
                         : ucp_get_nbx(u->ep, buf, len, data, rem->rkey, &p0));
  op_issued(&ops[1], ucp_get_nbx(u->ep, &state, sizeof state,
                                 rem->base + offsetof(fr_shm_header, state), rem->rkey, &p1));
  if (put) /* remote completion of the put */
    op_issued(&ops[2], ucp_ep_flush_nbx(u->ep, &p2));
  else
    ops[2].done = true;
  for (int i = 0; i < 3; i++) { /* all of them: none may outlive this frame */
    int w = rc == 0 ? wait_locked(u, &ops[i].done, deadline_ns) : 0;
    settle_locked(u, &ops[i].done);
    rc = rc ? rc : w;
  }
  for (int i = 0; i < 3 && rc == 0; i++)
    if (ops[i].status != UCS_OK)
      rc = ucs_err(FERRY_EPEER, ops[i].status, put ? "put" : "get", u->link);
  return rc ? rc : state_check(u, rem, __atomic_load_n(&state, __ATOMIC_ACQUIRE));
}

/* A peer region of UCX memory mapped here: one memcpy, then its state word, as rma_locked. */
static int ptr_copy_locked(ucx_link *u, const ucx_remote *rem, uint64_t off, void *buf, size_t len,
                           bool put) {
  int rc = ep_check(u);
  if (rc != 0)
    return rc;
  uint8_t *data = (uint8_t *)rem->ptr + FR_SHM_HEADER_BYTES + off;
  if (put)
    memcpy(data, buf, len);
  else
    memcpy(buf, data, len);
  const fr_shm_header *h = rem->ptr;
  return state_check(u, rem, __atomic_load_n(&h->state, __ATOMIC_ACQUIRE));
}

static int ucx_read(ferry_link *l, const ferry_region_ref *r, uint64_t off, void *dst, size_t len,
                    int timeout_ms) {
  ucx_link *u = ucx_of(l);
  int rc = u ? check_memory(u, dst, "read") : fr_err(FERRY_EPEER, "ucx link is not open");
  if (rc != 0)
    return rc;
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  pthread_mutex_lock(&u->lock);
  ucx_remote *rem = NULL;
  if ((rc = wait_ready_locked(u, deadline)) == 0 && (u->use_get || u->try_ptr))
    rc = remote_for(u, r, deadline, &rem);
  int mode = access_mode(u, rem);
  if (rc == 0 && mode == BY_REQUEST)
    rc = am_read_locked(u, r, off, dst, len, deadline);
  else if (rc == 0 && !fr_range_ok(off, len, rem->size))
    rc = fr_err(FERRY_ERANGE, "region %llu of '%s': bytes [%llu, +%zu) outside its %llu bytes",
                (unsigned long long)r->id, l->peer, (unsigned long long)off, len,
                (unsigned long long)rem->size);
  else if (rc == 0)
    rc = mode == BY_PTR ? ptr_copy_locked(u, rem, off, dst, len, false)
                        : rma_locked(u, rem, off, dst, len, false, deadline);
  pthread_mutex_unlock(&u->lock);
  return rc;
}

/* A vectored read by RMA: every get issued before any is waited for, then the region's state
 * word after them, as rma_locked does for one. */
static int gets_locked(ucx_link *u, const ucx_remote *rem, const ferry_read_run *runs, size_t n,
                       uint8_t *dst, uint64_t deadline_ns) {
  int rc = ep_check(u);
  ucx_op *ops = rc == 0 ? calloc(n + 1, sizeof *ops) : NULL;
  if (rc != 0 || !ops)
    return rc ? rc : fr_err(FERRY_ENOMEM, "ucx readv of %zu runs", n);
  uint32_t state = 0;
  for (size_t i = 0; i < n; dst += runs[i++].len) {
    ucp_request_param_t p = op_param(&ops[i]);
    op_issued(&ops[i],
              ucp_get_nbx(u->ep, dst, runs[i].len, rem->base + FR_SHM_HEADER_BYTES + runs[i].offset,
                          rem->rkey, &p));
  }
  ucp_request_param_t ps = op_param(&ops[n]);
  op_issued(&ops[n], ucp_get_nbx(u->ep, &state, sizeof state,
                                 rem->base + offsetof(fr_shm_header, state), rem->rkey, &ps));
  for (size_t i = 0; i <= n; i++) { /* all of them: none may outlive this frame */
    int w = rc == 0 ? wait_locked(u, &ops[i].done, deadline_ns) : 0;
    settle_locked(u, &ops[i].done);
    rc = rc ? rc : w;
  }
  for (size_t i = 0; i <= n && rc == 0; i++)
    if (ops[i].status != UCS_OK)
      rc = ucs_err(FERRY_EPEER, ops[i].status, "get", u->link);
  free(ops);
  return rc ? rc : state_check(u, rem, __atomic_load_n(&state, __ATOMIC_ACQUIRE));
}

/* Runs of one region: mapped here, one memcpy each; by RMA, all gets in flight at once; else one
 * read request per run. */
static int ucx_readv(ferry_link *l, const ferry_region_ref *r, const ferry_read_run *runs, size_t n,
                     void *dst, int timeout_ms) {
  ucx_link *u = ucx_of(l);
  int rc = u ? check_memory(u, dst, "read") : fr_err(FERRY_EPEER, "ucx link is not open");
  if (rc != 0)
    return rc;
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  pthread_mutex_lock(&u->lock);
  ucx_remote *rem = NULL;
  if ((rc = wait_ready_locked(u, deadline)) == 0 && (u->use_get || u->try_ptr))
    rc = remote_for(u, r, deadline, &rem);
  int mode = access_mode(u, rem);
  for (size_t i = 0; rc == 0 && mode != BY_REQUEST && i < n; i++)
    if (!fr_range_ok(runs[i].offset, runs[i].len, rem->size))
      rc = fr_err(FERRY_ERANGE, "region %llu of '%s': bytes [%llu, +%llu) outside its %llu bytes",
                  (unsigned long long)r->id, l->peer, (unsigned long long)runs[i].offset,
                  (unsigned long long)runs[i].len, (unsigned long long)rem->size);
  uint8_t *at = dst;
  if (rc == 0 && mode == BY_RMA)
    rc = gets_locked(u, rem, runs, n, at, deadline);
  else
    for (size_t i = 0; rc == 0 && i < n; at += runs[i++].len)
      rc = mode == BY_PTR ? ptr_copy_locked(u, rem, runs[i].offset, at, runs[i].len, false)
                          : am_read_locked(u, r, runs[i].offset, at, runs[i].len, deadline);
  pthread_mutex_unlock(&u->lock);
  return rc;
}

static int ucx_write(ferry_link *l, const ferry_region_ref *r, uint64_t off, const void *src,
                     size_t len, int timeout_ms) {
  ucx_link *u = ucx_of(l);
  int rc = u ? check_memory(u, src, "write") : fr_err(FERRY_EPEER, "ucx link is not open");
  if (rc != 0)
    return rc;
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  pthread_mutex_lock(&u->lock);
  ucx_remote *rem = NULL;
  if ((rc = wait_ready_locked(u, deadline)) == 0 && (u->use_get || u->try_ptr))
    rc = remote_for(u, r, deadline, &rem);
  int mode = access_mode(u, rem);
  bool by_stream = rc == 0 && mode == BY_REQUEST;
  if (rc == 0 && !by_stream && !fr_range_ok(off, len, rem->size))
    rc = fr_err(FERRY_ERANGE, "region %llu of '%s': bytes [%llu, +%zu) outside its %llu bytes",
                (unsigned long long)r->id, l->peer, (unsigned long long)off, len,
                (unsigned long long)rem->size);
  else if (rc == 0 && !by_stream)
    rc = mode == BY_PTR ? ptr_copy_locked(u, rem, off, (void *)src, len, true)
                        : rma_locked(u, rem, off, (void *)src, len, true, deadline);
  pthread_mutex_unlock(&u->lock);
  return by_stream ? fr_link_rma_write(l, r, off, src, len, timeout_ms) : rc;
}

/* ---- the ctx ---- */

static void ucx_ctx_fini(ferry_ctx *ctx) {
  void **slot = fr_ctx_tstate(ctx, &fr_ucx_transport);
  ucx_ctx *uc = slot ? *slot : NULL;
  if (!uc)
    return;
  pthread_mutex_lock(&uc->lock);
  ucx_link *held = uc->links; /* links the application still holds */
  uc->links = NULL;
  pthread_mutex_unlock(&uc->lock);
  for (ucx_link *u = held; u; u = u->next) {
    release_ucx(u, ctx->epfd);
    u->uc = NULL;
  }
  pthread_mutex_lock(&uc->lock);
  while (uc->maps) {
    uc->maps->refs = 1;
    mapping_unref_locked(uc, uc->maps);
  }
  pthread_mutex_unlock(&uc->lock);
  *slot = NULL;
  uctx_unref(uc); /* regions of UCX memory may hold it a little longer (the region table) */
}

/* ---- ferry info ---- */

static void describe_md(uct_component_h comp, const char *md_name, FILE *out) {
  uct_md_config_t *cfg = NULL;
  uct_md_h md = NULL;
  uct_tl_resource_desc_t *res = NULL;
  unsigned n = 0;
  if (uct_md_config_read(comp, NULL, NULL, &cfg) != UCS_OK)
    return;
  if (uct_md_open(comp, md_name, cfg, &md) == UCS_OK) {
    if (uct_md_query_tl_resources(md, &res, &n) == UCS_OK) {
      for (unsigned i = 0; i < n; i++)
        fprintf(out, " %s/%s", res[i].tl_name, res[i].dev_name);
      uct_release_tl_resource_list(res);
    }
    uct_md_close(md);
  }
  uct_config_release(cfg);
}

void fr_ucx_describe(FILE *out) {
  fprintf(out, "ucx:        UCX %s; transports/devices:", ucp_get_version_string());
  uct_component_h *comps = NULL;
  unsigned ncomps = 0;
  if (uct_query_components(&comps, &ncomps) == UCS_OK) {
    for (unsigned c = 0; c < ncomps; c++) {
      uct_component_attr_t a = {.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT};
      if (uct_component_query(comps[c], &a) != UCS_OK || a.md_resource_count == 0)
        continue;
      uct_md_resource_desc_t *mds = calloc(a.md_resource_count, sizeof *mds);
      a.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
      a.md_resources = mds;
      if (mds && uct_component_query(comps[c], &a) == UCS_OK)
        for (unsigned m = 0; m < a.md_resource_count; m++)
          describe_md(comps[c], mds[m].md_name, out);
      free(mds);
    }
    uct_release_component_list(comps);
  }
  const char *tls = getenv("UCX_TLS");
  fprintf(out, "\n            UCX_TLS=%s (UCX's own variables pass through)\n",
          tls ? tls : "(all)");
}

const fr_transport_ops fr_ucx_transport = {
    .name = "ucx",
    .scheme = "ucx://",
    .passes_fds = false,
    .listen = ucx_listen,
    .dial = ucx_dial,
    .setup = ucx_setup,
    .sendv = ucx_sendv,
    .recv = ucx_recv,
    .readable = ucx_readable,
    .flush = ucx_flush,
    .idle = ucx_idle,
    .offer = ucx_offer,
    .accept_offer = ucx_accept_offer,
    .opened = ucx_opened,
    .read = ucx_read,
    .readv = ucx_readv,
    .write = ucx_write,
    .link_fini = ucx_link_fini,
    .retire = ucx_retire,
    .alloc_region = ucx_alloc_region,
    .region_pack = ucx_region_pack,
    .region_hint = ucx_region_hint,
    .ctx_fini = ucx_ctx_fini,
};
