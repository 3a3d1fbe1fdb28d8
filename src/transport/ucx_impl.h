/*
 * What the ucx transport's files share (ucx.c: the context, its regions and the ops table;
 * ucx_ep.c: a link's worker, endpoint and byte stream; ucx_am.c: active messages, the owner's
 * answers and the requests that wait for them; ucx_rma.c: one-sided reads and writes of a
 * peer's region): the wire sizes, the state records, and the calls one file makes into another.
 * Private to src/transport/ucx*.c.
 */
#ifndef FR_UCX_IMPL_H
#define FR_UCX_IMPL_H

#include "transport/transport.h"

#include <stdbool.h>
#include <stdint.h>
#include <ucp/api/ucp.h>

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

/* UCX synchronizes what passes through it in code TSan does not see (core.h): handing anything
 * to UCX releases, progressing it acquires. */
extern char fr_ucx_channel;
#define HB_HAND_OVER() FR_HB_RELEASE(&fr_ucx_channel)
#define HB_TAKE() FR_HB_ACQUIRE(&fr_ucx_channel)

static inline ucx_link *ucx_of(ferry_link *l) { return l->tdata; }

/* ucx.c: the per-ctx state and the mappings of this side's regions */
ucx_ctx *fr_ucx_ctx_of(ferry_ctx *ctx);
void fr_ucx_mapping_unref_locked(ucx_ctx *uc, ucx_mapping *m);
int fr_ucx_mapping_for(ucx_link *u, fr_region *reg, ucx_mapping **out);
int fr_ucx_check_memory(const ucx_link *u, const void *p, const char *what);

/* ucx_ep.c: small helpers, waiting, the link's worker and endpoint, the byte stream */
int fr_ucx_err(int code, ucs_status_t st, const char *what, const ferry_link *l);
int fr_ucx_link_status(const ferry_link *l);
void fr_ucx_op_issued(ucx_op *op, ucs_status_ptr_t sp);
ucp_request_param_t fr_ucx_op_param(ucx_op *op);
void fr_ucx_release(ucx_link *u, int epfd);
int fr_ucx_ep_check(const ucx_link *u);
void fr_ucx_settle_locked(ucx_link *u, const bool *done);
int fr_ucx_wait_locked(ucx_link *u, const bool *done, uint64_t deadline_ns);
int fr_ucx_wait_ready_locked(ucx_link *u, uint64_t deadline_ns);
int fr_ucx_dial(const char *where, int timeout_ms, int *fd);
void fr_ucx_setup(int fd);
int fr_ucx_offer(ferry_link *l, int *fd);
int fr_ucx_accept_offer(ferry_link *l, int fd);
void fr_ucx_opened(ferry_link *l);
int fr_ucx_readable(ferry_link *l);
ssize_t fr_ucx_recv(ferry_link *l, void *dst, size_t len);
bool fr_ucx_idle(ferry_link *l);
int fr_ucx_sendv(ferry_link *l, struct iovec *iov, int iovcnt, int fd_out, uint64_t deadline_ns);
void fr_ucx_flush(ferry_link *l, uint64_t end);
void fr_ucx_retire(ferry_link *l);
void fr_ucx_link_fini(ferry_link *l);

/* ucx_am.c: active messages */
int fr_ucx_set_handlers(ucx_link *u);
int fr_ucx_request_locked(ucx_link *u, ucx_req *r, unsigned am, const uint8_t *hdr, size_t len,
                          uint64_t deadline_ns);
int fr_ucx_answer_error(ferry_link *l, int rc, const char *what, uint64_t id);
int fr_ucx_am_read_locked(ucx_link *u, const ferry_region_ref *ref, uint64_t off, void *dst,
                          size_t len, uint64_t deadline_ns);

/* ucx_rma.c: one-sided reads and writes */
void fr_ucx_region_hint(ferry_link *l, const uint8_t *bytes, size_t len);
int fr_ucx_read(ferry_link *l, const ferry_region_ref *r, uint64_t off, void *dst, size_t len,
                int timeout_ms);
int fr_ucx_readv(ferry_link *l, const ferry_region_ref *r, const ferry_read_run *runs, size_t n,
                 void *dst, int timeout_ms);
int fr_ucx_write(ferry_link *l, const ferry_region_ref *r, uint64_t off, const void *src,
                 size_t len, int timeout_ms);

#endif
