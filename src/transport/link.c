/*
 * A link over a byte stream (tcp, or shm's unix socket): the handshake, the receive state machine
 * that the ctx's leader drives (leader.c: a waiting caller, else the progress thread; a spinner
 * drains a pollable link itself), request/response pairing for one-sided reads and writes, and
 * sending. Payloads move without intermediate buffers: a read response is received straight into
 * the requester's destination, a write straight into the owner's region, and sends are one
 * sendmsg of header + caller iovecs; a read response of registered memory excepted, whose bytes
 * its caller may free once deregistered: copied out a chunk at a time (core/region.h).
 *
 * This file makes and ends links, sends frames, and pairs requests (user threads) with their
 * answers; the handshake is in link_handshake.c, the receive state machine and the requests it
 * serves in link_rx.c, and link_impl.h holds what they share.
 */
#include "transport/link_impl.h"

#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

ferry_link *fr_link_new(ferry_ctx *ctx, const fr_transport_ops *ops, int fd, bool accepted) {
  ferry_link *l = calloc(1, sizeof *l);
  if (!l)
    return NULL;
  l->poller.fd = fd;
  l->poller.on_event = fr_link_on_event;
  l->ctx = ctx;
  l->ops = ops;
  l->refs = 1;
  l->accepted = accepted;
  l->created_ns = fr_now_ns();
  l->state = FR_LINK_HELLO;
  l->rx_phase = FR_RX_HEADER;
  l->rx_want = FR_FRAME_BYTES;
  pthread_mutex_init(&l->lock, NULL);
  pthread_mutex_init(&l->send_lock, NULL);
  pthread_mutex_init(&l->rx_lock, NULL);
  fr_cond_init_monotonic(&l->cond);
  if (ops->setup)
    ops->setup(fd);
  return l;
}

void fr_link_ref(ferry_link *l) { __atomic_add_fetch(&l->refs, 1, __ATOMIC_RELAXED); }

void fr_link_unref(ferry_link *l) {
  if (!l || __atomic_sub_fetch(&l->refs, 1, __ATOMIC_ACQ_REL) != 0)
    return;
  if (l->ops->link_fini)
    l->ops->link_fini(l);
  for (int i = 0; i < l->rx_nfds; i++)
    close(l->rx_fds[i]);
  if (l->rx_msg) {
    l->rx_msg->link = NULL; /* its reference is taken only on delivery */
    ferry_msg_free(l->rx_msg);
  }
  fr_region_release(l->rx_region);
  close(l->poller.fd);
  pthread_mutex_destroy(&l->lock);
  pthread_mutex_destroy(&l->send_lock);
  pthread_mutex_destroy(&l->rx_lock);
  pthread_cond_destroy(&l->cond);
  free(l);
}

/* ctx->links holds the links that are cheap to poll (shm rings) first, then the others: the
 * walks that want only the cheap ones (spin.c) stop at the first other link. A directory with a
 * thousand tcp links walked them all before each answer (issue 36's bench: 57% of its CPU).
 * Under links_lock. */
static void links_insert(ferry_ctx *ctx, ferry_link *l) {
  ferry_link **at = &ctx->links;
  if (!l->ops->poll_is_cheap)
    while (*at && (*at)->ops->poll_is_cheap)
      at = &(*at)->next;
  l->next = *at;
  *at = l;
}

int fr_link_start(ferry_link *l) {
  int rc = fr_sock_set_nonblock(l->poller.fd, true);
  if (rc != 0)
    return rc;
  ferry_ctx *ctx = l->ctx;
  fr_link_ref(l);
  pthread_mutex_lock(&ctx->links_lock);
  links_insert(ctx, l);
  for (size_t i = 0; i < ctx->norder; i++)
    if (ctx->order[i] == l->ops)
      ctx->link_totals[i].opened++;
  pthread_mutex_unlock(&ctx->links_lock);
  struct epoll_event ev = {.events = link_events(l), .data.ptr = &l->poller};
  if (epoll_ctl(ctx->epfd, EPOLL_CTL_ADD, l->poller.fd, &ev) < 0) {
    rc = fr_err_errno(FERRY_ESYS, "epoll_ctl");
    fr_link_fail(l, rc, "cannot watch the socket");
    return rc;
  }
  return 0;
}

void fr_link_fail(ferry_link *l, int status, const char *why) {
  pthread_mutex_lock(&l->lock);
  if (link_state(l) == FR_LINK_DEAD) {
    pthread_mutex_unlock(&l->lock);
    return;
  }
  bool was_open = link_state(l) == FR_LINK_OPEN;
  l->dead_status = status;
  if (status < 0 && -status < 32)
    fr_count(&l->ctx->link_errors[-status], 1);
  __atomic_store_n(&l->state, FR_LINK_DEAD, __ATOMIC_RELEASE);
  for (fr_pending *p = l->pending; p; p = p->next)
    if (!p->claimed && !p->done) {
      p->status = status;
      __atomic_store_n(&p->done, true, __ATOMIC_RELEASE);
    }
  pthread_cond_broadcast(&l->cond);
  pthread_mutex_unlock(&l->lock);
  /* The ctx's leader sees the hang-up, unregisters the link and drops its reference. */
  shutdown(l->poller.fd, SHUT_RDWR);
  /* A peer that went away, or this node closing, is routine (every short-lived client does it),
   * and the jobs say what it meant (a receiver gone, a subscriber dropped): debug. A link that
   * failed otherwise (a timeout, a bad frame, no memory) is worth an operator's look. */
  if (status == FERRY_EPEER || status == FERRY_ECLOSED) {
    if (was_open || status != FERRY_ECLOSED)
      fr_debug("link %s '%s' closed: %s (%s)", l->ops->name, l->peer, why, ferry_strerror(status));
  } else {
    fr_info_limited("link %s '%s' closed: %s (%s)", l->ops->name, l->peer, why,
                    ferry_strerror(status));
  }
}

/* ---- sending ---- */

typedef struct staged_send {
  ferry_link *l;
  uint64_t deadline_ns;
} staged_send;

static int send_staged_chunk(void *arg, const void *buf, size_t len) {
  staged_send *s = arg;
  struct iovec v = {(void *)buf, len};
  return s->l->ops->sendv(s->l, &v, 1, -1, s->deadline_ns);
}

static int gate_enter(void *arg) {
  if (!fr_region_use_begin(arg))
    return FERRY_ENOTFOUND;
  if (fr_region_test_copying)
    fr_region_test_copying(arg);
  return 0;
}
static void gate_leave(void *arg) { fr_region_use_end(arg); }

/* [src, src+n) of the stage's region out, a chunk at a time: each copied into host memory
 * while the region's bytes are in use (fr_region_use_begin: its owner may free them once
 * deregistered), sent after. */
static int send_staged(const fr_link_stage *st, const uint8_t *src, size_t n, staged_send *ss) {
  fr_cuda_gate gate = {gate_enter, gate_leave, st->region, &st->region->copy_event};
  if (st->region->kind == FERRY_MEM_CUDA)
    return fr_cuda_stage_out_gated(st->stager, st->region->device, src, n, &gate, send_staged_chunk,
                                   ss);
  int rc = 0;
  for (size_t off = 0; off < n && rc == 0; off += st->chunk) {
    size_t len = n - off < st->chunk ? n - off : st->chunk;
    if ((rc = gate_enter(st->region)) != 0)
      break;
    FR_ONE_SIDED_READ_BEGIN(); /* the owner may be rewriting them (core.h) */
    memcpy(st->buf, src + off, len);
    FR_ONE_SIDED_READ_END();
    gate_leave(st->region);
    rc = send_staged_chunk(ss, st->buf, len);
  }
  return rc;
}

static int send_frame(ferry_link *l, const fr_frame *f, const struct iovec *iov, int iovcnt,
                      int fd_out, uint64_t deadline_ns, bool quiet, const fr_link_stage *staged) {
  uint8_t hdr[FR_FRAME_BYTES];
  fr_frame_encode(f, hdr);
  int inline_cnt = staged ? 0 : iovcnt; /* a staged payload follows the header by itself */
  struct iovec local[9], *v = local;
  if (inline_cnt > 8 && !(v = malloc(sizeof *v * (size_t)(inline_cnt + 1))))
    return fr_err(FERRY_ENOMEM, "send: iovec");
  v[0] = (struct iovec){hdr, sizeof hdr};
  for (int i = 0; i < inline_cnt; i++)
    v[i + 1] = iov[i];

  if (pthread_mutex_trylock(&l->send_lock) != 0) {
    fr_ctx_lead_early_drop(); /* another send may take long */
    pthread_mutex_lock(&l->send_lock);
  }
  l->quiet = quiet;
  int rc =
      __atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == FR_LINK_DEAD
          ? fr_err(l->dead_status ? l->dead_status : FERRY_EPEER, "link to '%s' is closed", l->peer)
          : l->ops->sendv(l, v, inline_cnt + 1, fd_out, deadline_ns);
  staged_send ss = {l, deadline_ns};
  for (int i = 0; staged && i < iovcnt && rc == 0; i++)
    rc = send_staged(staged, iov[i].iov_base, iov[i].iov_len, &ss);
  l->quiet = false;
  if (rc == 0) { /* plain stores under send_lock; a snapshot reads them relaxed */
    __atomic_store_n(&l->tx_bytes, l->tx_bytes + FR_FRAME_BYTES + f->len, __ATOMIC_RELAXED);
    __atomic_store_n(&l->tx_frames, l->tx_frames + 1, __ATOMIC_RELAXED);
  }
  pthread_mutex_unlock(&l->send_lock);
  if (v != local)
    free(v);
  if (rc != 0 && link_state(l) != FR_LINK_DEAD) /* a half-sent frame leaves the stream unusable */
    fr_link_fail(l, rc, ferry_last_error());
  return rc;
}

int fr_link_send_frame(ferry_link *l, const fr_frame *f, const struct iovec *iov, int iovcnt,
                       int fd_out, uint64_t deadline_ns) {
  return send_frame(l, f, iov, iovcnt, fd_out, deadline_ns, false, NULL);
}

int fr_link_send_frame_staged(ferry_link *l, const fr_frame *f, const struct iovec *iov, int iovcnt,
                              const fr_link_stage *stage, uint64_t deadline_ns) {
  return send_frame(l, f, iov, iovcnt, -1, deadline_ns, false, stage);
}

int fr_link_send_frame_quiet(ferry_link *l, const fr_frame *f, const struct iovec *iov, int iovcnt,
                             uint64_t deadline_ns) {
  return send_frame(l, f, iov, iovcnt, -1, deadline_ns, true, NULL);
}

int fr_link_sock_sendv(ferry_link *l, struct iovec *iov, int iovcnt, int fd_out,
                       uint64_t deadline_ns) {
  return fr_sock_sendv(l->poller.fd, iov, iovcnt, fd_out, (uint64_t)l->ctx->spin_us * 1000u,
                       deadline_ns);
}

ssize_t fr_link_sock_recv(ferry_link *l, void *dst, size_t len) {
  int *fds = l->ops->passes_fds ? l->rx_fds : NULL;
  return fr_sock_recv_some(l->poller.fd, dst, len, fds, &l->rx_nfds, FR_MAX_RX_FDS);
}

int fr_link_send_status(ferry_link *l, uint8_t type, uint64_t req_id, int status) {
  fr_frame f = {.type = type, .status = status, .req_id = req_id};
  return fr_link_send_frame(l, &f, NULL, 0, -1, fr_deadline_ns(l->ctx->timeout_ms));
}

/* ---- pending requests (user threads) ---- */

static int pending_add(ferry_link *l, fr_pending *p) {
  pthread_mutex_lock(&l->lock);
  int state = link_state(l);
  if (state != FR_LINK_OPEN) {
    int st = l->dead_status ? l->dead_status : FERRY_EPEER;
    pthread_mutex_unlock(&l->lock);
    return fr_err(st, "link to '%s' is closed", l->peer);
  }
  p->id = __atomic_add_fetch(&l->ctx->next_req_id, 1, __ATOMIC_RELAXED);
  p->fd = -1;
  p->next = l->pending;
  l->pending = p;
  pthread_mutex_unlock(&l->lock);
  return 0;
}

static void pending_unlink_locked(ferry_link *l, fr_pending *p) {
  for (fr_pending **pp = &l->pending; *pp; pp = &(*pp)->next)
    if (*pp == p) {
      *pp = p->next;
      return;
    }
}

/* Waits for a response. On timeout an unclaimed request is simply forgotten; a claimed one (its
 * payload is arriving into the caller's buffer) can only be stopped by closing the link. */

static bool pending_ready(void *arg) {
  return __atomic_load_n(&((fr_pending *)arg)->done, __ATOMIC_ACQUIRE);
}

/* Waits for a response: spins first where the link is cheap to poll (shm), then leads the
 * ctx's epoll so the response wakes this thread (ctx.c), or sleeps until whoever leads signals. */
static int pending_wait(ferry_link *l, fr_pending *p, uint64_t deadline_ns, const char *what) {
  ferry_ctx *ctx = l->ctx;
  if (!ctx->users_may_lead || (l->ops->pollable && l->ops->pollable(l)))
    fr_spin_until(l, &p->done, ctx->spin_us);
  fr_ctx_wait(ctx, FR_CTX_WAIT_REPLY, pending_ready, p, &l->lock, &l->cond, deadline_ns);
  pthread_mutex_lock(&l->lock);
  bool timed_out = !p->done;
  if (timed_out && p->claimed) {
    pthread_mutex_unlock(&l->lock);
    fr_link_fail(l, FERRY_ETIMEDOUT, "a transfer did not finish in time");
    /* Whoever drives the link ends the transfer now that the link is dead. */
    fr_ctx_wait(ctx, FR_CTX_WAIT_REPLY, pending_ready, p, &l->lock, &l->cond,
                fr_deadline_ns(ctx->timeout_ms));
    pthread_mutex_lock(&l->lock);
    while (!p->done)
      pthread_cond_wait(&l->cond, &l->lock);
  }
  pending_unlink_locked(l, p);
  pthread_mutex_unlock(&l->lock);
  if (timed_out)
    return fr_err(FERRY_ETIMEDOUT, "%s from '%s': no answer in time", what, l->peer);
  if (p->status != 0)
    return p->status == FERRY_EPEER || p->status == FERRY_ECLOSED || p->status == FERRY_ETIMEDOUT
               ? fr_err(p->status, "%s from '%s': link lost", what, l->peer)
               : fr_err(p->status, "%s from '%s': refused by the owner (%s)", what, l->peer,
                        ferry_strerror(p->status));
  return 0;
}

/* Registers p and sends its request; the response is then waited for with pending_wait(). */
static int request_send(ferry_link *l, fr_pending *p, uint8_t type, uint32_t channel,
                        const struct iovec *iov, int iovcnt, uint64_t deadline, bool quiet) {
  int rc = pending_add(l, p);
  if (rc != 0)
    return rc;
  uint64_t len = 0;
  for (int i = 0; i < iovcnt; i++)
    len += iov[i].iov_len;
  fr_frame f = {.type = type, .channel = channel, .req_id = p->id, .len = len};
  rc = send_frame(l, &f, iov, iovcnt, -1, deadline, quiet, NULL);
  if (rc != 0) {
    pthread_mutex_lock(&l->lock);
    pending_unlink_locked(l, p);
    pthread_mutex_unlock(&l->lock);
  }
  return rc;
}

/* A request the socket takes whole at once (no wait for the peer to read): leading the ctx
 * while it is sent stalls no one. */
#define FR_EARLY_LEAD_MAX 4096u

static int request(ferry_link *l, fr_pending *p, uint8_t type, uint32_t channel,
                   const struct iovec *iov, int iovcnt, int timeout_ms, const char *what) {
  uint64_t deadline = fr_deadline_ns(timeout_ms), len = 0;
  for (int i = 0; i < iovcnt; i++)
    len += iov[i].iov_len;
  /* Where the caller will lead the epoll for the answer (not a link it spins on, shm), it takes
   * the epoll before the request goes out (fr_ctx_lead_early). */
  bool early = len <= FR_EARLY_LEAD_MAX && !(l->ops->pollable && l->ops->pollable(l)) &&
               fr_ctx_lead_early(l->ctx);
  int rc = request_send(l, p, type, channel, iov, iovcnt, deadline, false);
  if (rc == 0)
    rc = pending_wait(l, p, deadline, what);
  if (early)
    fr_ctx_lead_early_end(l->ctx);
  return rc;
}

int fr_link_rma_read(ferry_link *l, const ferry_region_ref *r, uint64_t off, void *dst, size_t len,
                     int timeout_ms) {
  uint8_t body[FR_RMA_BYTES];
  fr_rma_encode(&(fr_rma){r->id, r->key, off, len}, body);
  struct iovec iov = {body, sizeof body};
  fr_pending p = {.expect = FR_READ_RESP, .dst = dst, .len = len};
  return request(l, &p, FR_READ, 0, &iov, 1, timeout_ms, "read");
}

int fr_link_rma_readv(ferry_link *l, const ferry_region_ref *r, const ferry_read_run *runs,
                      size_t n, void *dst, int timeout_ms) {
  size_t groups = (n + FR_READV_MAX_RUNS - 1) / FR_READV_MAX_RUNS, posted = 0;
  fr_pending *ps = calloc(groups ? groups : 1, sizeof *ps);
  uint8_t *body = malloc(FR_READV_HEAD_BYTES + FR_READV_RUN_BYTES * FR_READV_MAX_RUNS);
  int rc = ps && body ? 0 : fr_err(FERRY_ENOMEM, "readv of %zu runs", n);
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  uint8_t *at = dst;
  for (size_t g = 0; g < groups && rc == 0; g++) {
    size_t first = g * FR_READV_MAX_RUNS,
           k = n - first < FR_READV_MAX_RUNS ? n - first : FR_READV_MAX_RUNS;
    uint64_t len = 0;
    fr_readv_encode_head(r->id, r->key, (uint32_t)k, body);
    for (size_t i = 0; i < k; i++) {
      fr_rma_run run = {runs[first + i].offset, runs[first + i].len};
      fr_readv_encode_run(&run, body + FR_READV_HEAD_BYTES + i * FR_READV_RUN_BYTES);
      len += run.length;
    }
    struct iovec iov = {body, FR_READV_HEAD_BYTES + k * FR_READV_RUN_BYTES};
    ps[g] = (fr_pending){.expect = FR_READ_RESP, .dst = at, .len = len};
    rc = request_send(l, &ps[g], FR_READV, 0, &iov, 1, deadline, false);
    posted += rc == 0;
    at += len;
  }
  for (size_t g = 0; g < posted;
       g++) { /* every posted request is collected, even after a failure */
    int w = pending_wait(l, &ps[g], deadline, "read");
    rc = rc ? rc : w;
  }
  free(body);
  free(ps);
  return rc;
}

int fr_link_rma_write(ferry_link *l, const ferry_region_ref *r, uint64_t off, const void *src,
                      size_t len, int timeout_ms) {
  uint8_t body[FR_RMA_BYTES];
  fr_rma_encode(&(fr_rma){r->id, r->key, off, len}, body);
  struct iovec iov[2] = {{body, sizeof body}, {(void *)src, len}};
  fr_pending p = {.expect = FR_WRITE_RESP};
  return request(l, &p, FR_WRITE, 0, iov, 2, timeout_ms, "write");
}

int fr_link_call(ferry_link *l, uint32_t channel, const struct iovec *iov, int iovcnt,
                 ferry_msg **reply, int timeout_ms) {
  fr_pending p = {.expect = FR_REPLY};
  int rc = request(l, &p, FR_CALL, channel, iov, iovcnt, timeout_ms, "call");
  if (rc == 0)
    *reply = p.reply;
  else
    ferry_msg_free(p.reply);
  return rc;
}

int fr_link_call_post(ferry_link *l, uint32_t channel, const struct iovec *iov, int iovcnt,
                      int timeout_ms, bool quiet, fr_pending **out) {
  fr_pending *p = malloc(sizeof *p); /* the caller holds it opaque (linkcalls.h) */
  if (!p)
    return fr_err(FERRY_ENOMEM, "call to '%s': out of memory", l->peer);
  *p = (fr_pending){.expect = FR_REPLY};
  int rc = request_send(l, p, FR_CALL, channel, iov, iovcnt, fr_deadline_ns(timeout_ms), quiet);
  if (rc != 0) {
    free(p);
    return rc;
  }
  *out = p;
  return 0;
}

bool fr_link_is_open(const ferry_link *l) { return link_state(l) == FR_LINK_OPEN; }

uint64_t fr_link_flush_deadline(const ferry_ctx *ctx) {
  uint64_t bound = (uint64_t)ctx->timeout_ms * 1000000ull;
  return fr_now_ns() + (bound < FR_LINK_FLUSH_NS ? bound : FR_LINK_FLUSH_NS);
}

void fr_link_flush(ferry_link *l, uint64_t deadline_ns) {
  if (l->ops->flush && fr_link_is_open(l)) /* frames whose send returned 0 still go */
    l->ops->flush(l, deadline_ns);
}

bool fr_link_call_ready(const fr_pending *p) { return pending_ready((void *)p); }

void fr_link_ring(ferry_link *l) {
  if (!l->ops->ring)
    return;
  pthread_mutex_lock(&l->send_lock); /* a doorbell among the frames, as a sender's */
  l->ops->ring(l);
  pthread_mutex_unlock(&l->send_lock);
}

int fr_link_call_collect(ferry_link *l, fr_pending *p, ferry_msg **reply, int timeout_ms) {
  int rc = pending_wait(l, p, fr_deadline_ns(timeout_ms), "call");
  if (rc == 0)
    *reply = p->reply;
  else
    ferry_msg_free(p->reply);
  free(p);
  return rc;
}

int fr_link_map_request(ferry_link *l, const ferry_region_ref *r, int timeout_ms, int *fd,
                        uint64_t *size, fr_cuda_ipc *ipc, bool *cuda) {
  uint8_t body[FR_MAP_BYTES];
  fr_map_encode(&(fr_map){r->id, r->key}, body);
  struct iovec iov = {body, sizeof body};
  fr_pending p = {.expect = FR_MAP_RESP, .ipc = ipc};
  int rc = request(l, &p, FR_MAP, 0, &iov, 1, timeout_ms, "map");
  if (rc == 0) {
    *fd = p.fd;
    *size = p.size;
    *cuda = p.cuda;
  } else if (p.fd >= 0) {
    close(p.fd);
  }
  return rc;
}

/* Chunks of a caller's CUDA buffer through host memory: FERRY_CUDA_CHUNK_BYTES at a time. */
static size_t bounce_chunk(size_t len) {
  size_t chunk = fr_cuda_chunk_bytes();
  return len < chunk ? len : chunk;
}

/* A caller's CUDA buffer through a host bounce buffer malloc'd for the call, a chunk at a time:
 * read, then copied to the device; or copied from the device, then written
 * (FERRY_CUDA_BOUNCE=malloc, and a thread already staging). */
static int bounced_by_malloc(ferry_link *l, const ferry_region_ref *r, uint64_t off, uint8_t *dev,
                             size_t len, int device, int timeout_ms, bool write) {
  size_t chunk = bounce_chunk(len);
  uint8_t *host = malloc(chunk ? chunk : 1);
  int rc = host ? 0
                : fr_err(FERRY_ENOMEM, "%s CUDA memory: %zu bytes of host memory",
                         write ? "write from" : "read into", chunk);
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  for (size_t done = 0; done < len && rc == 0; done += chunk) {
    size_t n = len - done < chunk ? len - done : chunk;
    if (write && (rc = fr_cuda_copy_on(device, host, dev + done, n)) == 0)
      rc = l->ops->write(l, r, off + done, host, n, fr_ms_left(deadline));
    else if (!write && (rc = l->ops->read(l, r, off + done, host, n, fr_ms_left(deadline))) == 0)
      rc = fr_cuda_copy_on(device, dev + done, host, n);
  }
  free(host);
  return rc;
}

/* The link side of a staged transfer: each chunk read from, or written to, the region in turn. */
typedef struct bounce_io {
  ferry_link *l;
  const ferry_region_ref *r;
  uint64_t off, deadline;
} bounce_io;

static int bounce_fill(void *arg, void *buf, size_t len) {
  bounce_io *b = arg;
  int rc = b->l->ops->read(b->l, b->r, b->off, buf, len, fr_ms_left(b->deadline));
  b->off += len;
  return rc;
}

static int bounce_use(void *arg, const void *buf, size_t len) {
  bounce_io *b = arg;
  int rc = b->l->ops->write(b->l, b->r, b->off, buf, len, fr_ms_left(b->deadline));
  b->off += len;
  return rc;
}

/* FERRY_CUDA_BOUNCE=malloc, the default; any value but malloc and pinned is warned of (once) and
 * taken as malloc. */
static bool bounce_by_malloc(void) {
  static bool warned;
  const char *mode = fr_config_str("FERRY_CUDA_BOUNCE");
  if (strcmp(mode, "pinned") == 0)
    return false;
  if (strcmp(mode, "malloc") != 0 && !__atomic_exchange_n(&warned, true, __ATOMIC_RELAXED))
    fr_warn("FERRY_CUDA_BOUNCE=%s: expected malloc or pinned; taken as malloc", mode);
  return true;
}

/* A caller's CUDA buffer through this thread's stager (FERRY_CUDA_BOUNCE=pinned; malloc, the
 * default, until a device shows pinned is faster):
 * two host buffers pinned once and reused call after call, the device copy of one chunk under
 * the link transfer of the next (fr_cuda_stage_in, fr_cuda_stage_out). */
static int bounced(ferry_link *l, const ferry_region_ref *r, uint64_t off, uint8_t *dev, size_t len,
                   int device, int timeout_ms, bool write) {
  fr_cuda_stager *s = NULL;
  int rc = bounce_by_malloc() ? FERRY_EBUSY : fr_cuda_thread_stager_take(&s);
  if (rc == FERRY_EBUSY) /* malloc chosen, or this thread stages already (a read inside a read) */
    return bounced_by_malloc(l, r, off, dev, len, device, timeout_ms, write);
  if (rc != 0)
    return rc;
  bounce_io b = {l, r, off, fr_deadline_ns(timeout_ms)};
  rc = write ? fr_cuda_stage_out(s, device, dev, len, bounce_use, &b)
             : fr_cuda_stage_in(s, device, dev, len, bounce_fill, &b);
  fr_cuda_thread_stager_give();
  return rc;
}

int fr_link_read_bounced(ferry_link *l, const ferry_region_ref *r, uint64_t off, void *dst,
                         size_t len, int device, int timeout_ms) {
  return bounced(l, r, off, dst, len, device, timeout_ms, false);
}

int fr_link_write_bounced(ferry_link *l, const ferry_region_ref *r, uint64_t off, const void *src,
                          size_t len, int device, int timeout_ms) {
  return bounced(l, r, off, (uint8_t *)src, len, device, timeout_ms, true);
}
