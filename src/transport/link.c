/*
 * A link over a byte stream (tcp, or shm's unix socket): the handshake, the receive state machine
 * that the ctx's leader drives (leader.c: a waiting caller, else the progress thread; a spinner
 * drains a pollable link itself), request/response pairing for one-sided reads and writes, and
 * sending. Payloads move without intermediate buffers: a read response is received straight into
 * the requester's destination, a write straight into the owner's region, and sends are one
 * sendmsg of header + caller iovecs.
 */
#include "transport/transport.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#define FR_INLINE_RESPONSE_MAX (64u * 1024u) /* larger read responses go to the server thread */

static void link_on_event(fr_poller *p, uint32_t events);

static int link_state(const ferry_link *l) { return __atomic_load_n(&l->state, __ATOMIC_ACQUIRE); }

ferry_link *fr_link_new(ferry_ctx *ctx, const fr_transport_ops *ops, int fd, bool accepted) {
  ferry_link *l = calloc(1, sizeof *l);
  if (!l)
    return NULL;
  l->poller.fd = fd;
  l->poller.on_event = link_on_event;
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

/* Edge-triggered where the transport allows: a drained socket is not polled again by the next
 * epoll_wait (the leader then drains until the socket has nothing, see rx_drain). */
static uint32_t link_events(const ferry_link *l) {
  return EPOLLIN | EPOLLRDHUP | (l->ops->edge_triggered ? EPOLLET : 0);
}

int fr_link_start(ferry_link *l) {
  int rc = fr_sock_set_nonblock(l->poller.fd, true);
  if (rc != 0)
    return rc;
  ferry_ctx *ctx = l->ctx;
  fr_link_ref(l);
  pthread_mutex_lock(&ctx->links_lock);
  l->next = ctx->links;
  ctx->links = l;
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

/* A payload of CUDA memory: sent through host memory by the stager, chunk by chunk. */
typedef struct staged_payload {
  int device;
  fr_cuda_stager *stager;
} staged_payload;

typedef struct staged_send {
  ferry_link *l;
  uint64_t deadline_ns;
} staged_send;

static int send_staged_chunk(void *arg, const void *buf, size_t len) {
  staged_send *s = arg;
  struct iovec v = {(void *)buf, len};
  return s->l->ops->sendv(s->l, &v, 1, -1, s->deadline_ns);
}

static int send_frame(ferry_link *l, const fr_frame *f, const struct iovec *iov, int iovcnt,
                      int fd_out, uint64_t deadline_ns, bool quiet, const staged_payload *staged) {
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
    rc = fr_cuda_stage_out(staged->stager, staged->device, iov[i].iov_base, iov[i].iov_len,
                           send_staged_chunk, &ss);
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

int fr_link_send_frame_device(ferry_link *l, const fr_frame *f, const struct iovec *iov, int iovcnt,
                              int device, fr_cuda_stager *stager, uint64_t deadline_ns) {
  staged_payload staged = {device, stager};
  return send_frame(l, f, iov, iovcnt, -1, deadline_ns, false, &staged);
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

static int send_status(ferry_link *l, uint8_t type, uint64_t req_id, int status) {
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

static fr_pending *pending_find_locked(ferry_link *l, uint64_t id) {
  for (fr_pending *p = l->pending; p; p = p->next)
    if (p->id == id && !p->done)
      return p;
  return NULL;
}

/* Waits for a response. On timeout an unclaimed request is simply forgotten; a claimed one (its
 * payload is arriving into the caller's buffer) can only be stopped by closing the link. */
static int rx_drain(ferry_link *l);

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

/* A caller's CUDA buffer through a host bounce buffer, a chunk at a time: read, then copied to
 * the device; or copied from the device, then written. */
static int bounced(ferry_link *l, const ferry_region_ref *r, uint64_t off, uint8_t *dev, size_t len,
                   int device, int timeout_ms, bool write) {
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

int fr_link_read_bounced(ferry_link *l, const ferry_region_ref *r, uint64_t off, void *dst,
                         size_t len, int device, int timeout_ms) {
  return bounced(l, r, off, dst, len, device, timeout_ms, false);
}

int fr_link_write_bounced(ferry_link *l, const ferry_region_ref *r, uint64_t off, const void *src,
                          size_t len, int device, int timeout_ms) {
  return bounced(l, r, off, (uint8_t *)src, len, device, timeout_ms, true);
}

/* ---- handshake ---- */

static void mac_for(const ferry_ctx *ctx, const char *label, const uint8_t a[FR_NONCE_BYTES],
                    const uint8_t b[FR_NONCE_BYTES], uint8_t out[FR_MAC_BYTES]) {
  uint8_t msg[32 + 2 * FR_NONCE_BYTES] = {0};
  size_t n = strlen(label);
  memcpy(msg, label, n);
  memcpy(msg + 32, a, FR_NONCE_BYTES);
  memcpy(msg + 32 + FR_NONCE_BYTES, b, FR_NONCE_BYTES);
  fr_hmac_sha256(ctx->token, strlen(ctx->token), msg, sizeof msg, out);
}

static int recv_frame_sync(ferry_link *l, uint8_t type, void *body, size_t body_len,
                           uint64_t deadline, int *fds, int *nfds, int *status) {
  uint8_t hdr[FR_FRAME_BYTES];
  fr_frame f;
  int rc = fr_sock_recv_all(l->poller.fd, hdr, sizeof hdr, deadline, fds, nfds);
  if (rc == 0)
    rc = fr_frame_decode(hdr, l->ctx->max_payload, &f);
  if (rc == 0 && f.type != type)
    rc = fr_err(FERRY_EPROTO, "handshake: expected frame %u, got %u", type, f.type);
  if (rc == 0 && f.len > 0)
    rc = fr_sock_recv_all(l->poller.fd, body, f.len <= body_len ? f.len : 0, deadline, fds, nfds);
  if (rc == 0)
    *status = f.status;
  return rc;
}

/* A ctx that proves this user's own secret (no explicit token) links with this user's processes
 * only. Where the kernel tells who is at the other end (shm's unix socket, which any local user
 * may reach: abstract sockets have no file permissions), another uid is refused before a byte of
 * its is parsed; the token would refuse it too, a round trip later. An explicit token is how a
 * fleet spans users. */
static int check_peer_user(ferry_link *l) {
  if (l->ctx->token_explicit || !l->ops->peer_uid)
    return 0;
  uid_t uid = 0;
  int rc = l->ops->peer_uid(l->poller.fd, &uid);
  if (rc != 0)
    return fr_err_wrap(FERRY_EAUTH, "%s link: cannot tell the peer's user", l->ops->name);
  if (uid != geteuid())
    return fr_err(FERRY_EAUTH,
                  "%s link: the peer runs as uid %u, not this user (uid %u); processes of "
                  "different users share a fleet only with an explicit FERRY_TOKEN",
                  l->ops->name, (unsigned)uid, (unsigned)geteuid());
  return 0;
}

int fr_link_handshake(ferry_link *l, int timeout_ms) {
  ferry_ctx *ctx = l->ctx;
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  int rc = check_peer_user(l);
  if (rc != 0)
    return rc;
  fr_hello hello;
  memset(&hello, 0, sizeof hello);
  fr_random_bytes(hello.nonce, sizeof hello.nonce);
  fr_str_copy(hello.name, sizeof hello.name, ctx->name);
  uint8_t buf[FR_HELLO_ACK_BYTES];
  fr_hello_encode(&hello, buf);
  struct iovec iov = {buf, FR_HELLO_BYTES};
  fr_frame f = {.type = FR_HELLO, .len = FR_HELLO_BYTES};
  rc = fr_link_send_frame(l, &f, &iov, 1, -1, deadline);
  int fds[FR_MAX_RX_FDS], nfds = 0, status = 0;
  fr_hello_ack ack;
  if (rc == 0)
    rc = recv_frame_sync(l, FR_HELLO_ACK, buf, sizeof buf, deadline, fds, &nfds, &status);
  if (rc == 0)
    rc = status
             ? fr_err(status, "the peer refused the handshake (%s)%s", ferry_strerror(status),
                      status == FERRY_EAUTH ? ": another user's node, or another fleet token" : "")
             : fr_hello_ack_decode(buf, sizeof buf, &ack);
  uint8_t expect[FR_MAC_BYTES];
  if (rc == 0) {
    mac_for(ctx, "ferry-acceptor", hello.nonce, ack.nonce, expect);
    if (!fr_memeq_const(expect, ack.mac, FR_MAC_BYTES))
      rc =
          fr_err(FERRY_EAUTH, "peer '%s' does not know this fleet's token (FERRY_TOKEN)", ack.name);
  }
  fr_auth auth;
  memset(&auth, 0, sizeof auth);
  if (rc == 0 && l->ops->passes_fds) {
    /* Same host proven: we can read the peer's memory segment. */
    if (nfds < 1 || pread(fds[0], auth.proof, FR_NONCE_BYTES, 0) != FR_NONCE_BYTES)
      rc = fr_err(FERRY_ECONNECT, "peer did not share a readable memory segment");
  }
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  int offer_fd = -1;
  if (rc == 0 && l->ops->offer)
    rc = l->ops->offer(l, &offer_fd);
  if (rc == 0) {
    mac_for(ctx, "ferry-connector", ack.nonce, hello.nonce, auth.mac);
    fr_auth_encode(&auth, buf);
    iov = (struct iovec){buf, FR_AUTH_BYTES};
    f = (fr_frame){.type = FR_AUTH, .len = FR_AUTH_BYTES};
    rc = fr_link_send_frame(l, &f, &iov, 1, offer_fd, deadline);
  }
  nfds = 0;
  if (rc == 0)
    rc = recv_frame_sync(l, FR_AUTH_ACK, buf, 0, deadline, fds, &nfds, &status);
  if (rc == 0 && status != 0)
    rc = fr_err(status, "peer '%s' refused the link (%s)", ack.name,
                status == FERRY_EAUTH ? "fleet token mismatch" : ferry_strerror(status));
  if (rc == 0) {
    memcpy(l->peer, ack.name, sizeof l->peer);
    l->state = FR_LINK_OPEN;
    if (l->ops->opened)
      l->ops->opened(l);
  }
  return rc;
}

static int on_hello(ferry_link *l) {
  fr_hello h;
  int rc = check_peer_user(l);
  if (rc != 0) {
    fr_warn_limited("refusing a link: %s", ferry_last_error());
    send_status(l, FR_HELLO_ACK, 0, rc);
    return rc;
  }
  if ((rc = fr_hello_decode(l->rx_body, l->rx_frame.len, &h)) != 0) {
    send_status(l, FR_HELLO_ACK, 0, rc); /* the peer hears why; the error detail is escaped */
    return rc;
  }
  memcpy(l->peer, h.name, sizeof l->peer);
  memcpy(l->nonce_peer, h.nonce, FR_NONCE_BYTES);
  fr_hello_ack ack;
  memset(&ack, 0, sizeof ack);
  fr_random_bytes(l->nonce_self, FR_NONCE_BYTES);
  memcpy(ack.nonce, l->nonce_self, FR_NONCE_BYTES);
  mac_for(l->ctx, "ferry-acceptor", l->nonce_peer, l->nonce_self, ack.mac);
  fr_str_copy(ack.name, sizeof ack.name, l->ctx->name);
  int proof_fd = -1;
  if (l->ops->passes_fds) {
    fr_random_bytes(l->proof, FR_NONCE_BYTES);
    proof_fd = memfd_create("ferry-proof", MFD_CLOEXEC);
    if (proof_fd < 0 || fchmod(proof_fd, 0600) != 0 ||
        pwrite(proof_fd, l->proof, FR_NONCE_BYTES, 0) != FR_NONCE_BYTES) {
      rc = fr_err_errno(FERRY_ESYS, "handshake: proof segment");
      if (proof_fd >= 0)
        close(proof_fd);
      return rc;
    }
  }
  uint8_t buf[FR_HELLO_ACK_BYTES];
  fr_hello_ack_encode(&ack, buf);
  struct iovec iov = {buf, sizeof buf};
  fr_frame f = {.type = FR_HELLO_ACK, .len = sizeof buf};
  __atomic_store_n(&l->state, FR_LINK_AUTH, __ATOMIC_RELEASE);
  rc = fr_link_send_frame(l, &f, &iov, 1, proof_fd, fr_deadline_ns(l->ctx->timeout_ms));
  if (proof_fd >= 0)
    close(proof_fd);
  return rc;
}

static int on_auth(ferry_link *l) {
  fr_auth a;
  int rc = fr_auth_decode(l->rx_body, l->rx_frame.len, &a);
  if (rc != 0)
    return rc;
  uint8_t expect[FR_MAC_BYTES];
  mac_for(l->ctx, "ferry-connector", l->nonce_self, l->nonce_peer, expect);
  int status = 0;
  if (!fr_memeq_const(expect, a.mac, FR_MAC_BYTES))
    status = fr_err(FERRY_EAUTH, "'%s' does not know this fleet's token", l->peer);
  else if (l->ops->passes_fds && !fr_memeq_const(l->proof, a.proof, FR_NONCE_BYTES))
    status = fr_err(FERRY_EAUTH, "'%s' could not read our memory segment", l->peer);
  if (status == 0 && l->ops->accept_offer)
    status = l->ops->accept_offer(l, fr_link_take_fd(l));
  if (status == 0 && l->rx_stage_pos < l->rx_stage_len)
    status = fr_err(FERRY_EPROTO, "'%s' sent frames before the link was open", l->peer);
  if (status != 0) {
    fr_warn_limited("refusing link from '%s': %s", l->peer, ferry_last_error());
    send_status(l, FR_AUTH_ACK, 0, status);
    return status;
  }
  rc = send_status(l, FR_AUTH_ACK, 0, 0);
  if (rc != 0)
    return rc;
  __atomic_store_n(&l->state, FR_LINK_OPEN, __ATOMIC_RELEASE);
  if (l->ops->opened)
    l->ops->opened(l);
  fr_debug("link %s from '%s' open", l->ops->name, l->peer);
  return 0;
}

/* ---- serving requests (the receive machine's thread; large responses: server.c) ---- */

static int on_read_request(ferry_link *l) {
  fr_rma r;
  int rc = fr_rma_decode(l->rx_body, l->rx_frame.len, &r);
  if (rc != 0)
    return rc;
  fr_region *reg = NULL;
  int status = r.length > l->ctx->max_payload
                   ? fr_err(FERRY_ERANGE, "read of %llu bytes exceeds FERRY_MAX_MESSAGE",
                            (unsigned long long)r.length)
                   : fr_region_acquire(&l->ctx->regions, r.region, r.key, r.offset, r.length, &reg);
  if (status != 0) {
    fr_debug("refused read from '%s': %s", l->peer, ferry_last_error());
    fr_frame f = {.type = FR_READ_RESP, .status = status, .req_id = l->rx_frame.req_id};
    return fr_link_send_frame(l, &f, NULL, 0, -1, fr_deadline_ns(l->ctx->timeout_ms));
  }
  if (r.length > FR_INLINE_RESPONSE_MAX || reg->kind == FERRY_MEM_CUDA) { /* staged: not here */
    fr_link_ref(l);
    fr_ctx_serve_later(l->ctx, l, l->rx_frame.req_id, reg, r.offset, r.length);
    return 0;
  }
  fr_frame f = {.type = FR_READ_RESP, .req_id = l->rx_frame.req_id, .len = r.length};
  struct iovec iov = {reg->data + r.offset, r.length};
  FR_ONE_SIDED_READ_BEGIN(); /* the owner may be rewriting them (core.h) */
  rc = fr_link_send_frame(l, &f, &iov, 1, -1, fr_deadline_ns(l->ctx->timeout_ms));
  FR_ONE_SIDED_READ_END();
  fr_region_release(reg);
  return rc;
}

/* A READV: its runs, one after another, in one READ_RESP. */
static int on_readv_request(ferry_link *l, const uint8_t *body, size_t len) {
  fr_readv h;
  fr_rma_run *runs = malloc(FR_READV_MAX_RUNS * sizeof *runs);
  if (!runs)
    return fr_err(FERRY_ENOMEM, "readv request");
  int rc = fr_readv_decode(body, len, &h, runs);
  if (rc != 0) {
    free(runs);
    return rc;
  }
  fr_region *reg = NULL;
  int status = h.total > l->ctx->max_payload
                   ? fr_err(FERRY_ERANGE, "readv of %llu bytes exceeds FERRY_MAX_MESSAGE",
                            (unsigned long long)h.total)
                   : fr_region_acquire(&l->ctx->regions, h.region, h.key, h.lo, h.hi - h.lo, &reg);
  fr_frame f = {.type = FR_READ_RESP, .req_id = l->rx_frame.req_id, .status = status};
  if (status != 0) {
    free(runs);
    fr_debug("refused readv from '%s': %s", l->peer, ferry_last_error());
    return fr_link_send_frame(l, &f, NULL, 0, -1, fr_deadline_ns(l->ctx->timeout_ms));
  }
  if (h.total > FR_INLINE_RESPONSE_MAX || reg->kind == FERRY_MEM_CUDA) {
    fr_link_ref(l);
    fr_ctx_serve_later_v(l->ctx, l, l->rx_frame.req_id, reg, runs, h.count, h.total);
    return 0;
  }
  struct iovec iov[FR_READV_MAX_RUNS];
  for (uint32_t i = 0; i < h.count; i++)
    iov[i] = (struct iovec){reg->data + runs[i].offset, runs[i].length};
  f.len = h.total;
  FR_ONE_SIDED_READ_BEGIN(); /* the owner may be rewriting them (core.h) */
  rc = fr_link_send_frame(l, &f, iov, (int)h.count, -1, fr_deadline_ns(l->ctx->timeout_ms));
  FR_ONE_SIDED_READ_END();
  fr_region_release(reg);
  free(runs);
  return rc;
}

static int on_map_request(ferry_link *l) {
  fr_map m;
  int rc = fr_map_decode(l->rx_body, l->rx_frame.len, &m);
  if (rc != 0)
    return rc;
  fr_region *reg = NULL;
  int status = fr_region_acquire(&l->ctx->regions, m.region, m.key, 0, 0, &reg);
  fr_cuda_ipc ipc;
  bool cuda = status == 0 && reg->kind == FERRY_MEM_CUDA;
  if (cuda && (!l->ops->passes_fds || fr_region_cuda_ipc(&l->ctx->regions, reg, &ipc) != 0)) {
    fr_debug("region %llu: no CUDA IPC handle for '%s': %s", (unsigned long long)m.region, l->peer,
             l->ops->passes_fds ? ferry_last_error() : "not a same-host link");
    status = FERRY_ENOTSUP; /* the peer falls back to read requests, staged here */
  } else if (status == 0 && !cuda && (reg->memfd < 0 || !l->ops->passes_fds)) {
    status = FERRY_ENOTSUP; /* registered memory: the peer falls back to read requests */
  }
  if (status != 0 && reg)
    fr_region_release(reg);
  fr_frame f = {.type = FR_MAP_RESP, .status = status, .req_id = l->rx_frame.req_id};
  if (status != 0)
    return fr_link_send_frame(l, &f, NULL, 0, -1, fr_deadline_ns(l->ctx->timeout_ms));
  uint8_t body[FR_MAP_RESP_CUDA_BYTES];
  fr_put_u64(body, reg->size);
  if (cuda)
    fr_cuda_ipc_encode(&ipc, body + FR_MAP_RESP_BYTES);
  struct iovec iov = {body, cuda ? FR_MAP_RESP_CUDA_BYTES : FR_MAP_RESP_BYTES};
  f.len = iov.iov_len;
  rc = fr_link_send_frame(l, &f, &iov, 1, cuda ? -1 : reg->memfd,
                          fr_deadline_ns(l->ctx->timeout_ms));
  fr_region_release(reg);
  return rc;
}

/* ---- the receive state machine (the ctx's leader, or a spinner; under rx_lock) ---- */

static void rx_expect(ferry_link *l, int phase, size_t want) {
  l->rx_phase = phase;
  l->rx_have = 0;
  l->rx_want = want;
}

static void rx_payload(ferry_link *l, void *dst, uint64_t len) {
  l->rx_phase = FR_RX_PAYLOAD;
  l->rx_dst = dst;
  l->rx_left = len;
}

int fr_link_take_fd(ferry_link *l) {
  if (l->rx_nfds == 0)
    return -1;
  int fd = l->rx_fds[0];
  memmove(l->rx_fds, l->rx_fds + 1, sizeof(int) * (size_t)--l->rx_nfds);
  return fd;
}

/* Completes the pending request a response names; unknown ids (timed out) are ignored. */
static void complete(ferry_link *l, int status, uint64_t size, int fd) {
  pthread_mutex_lock(&l->lock);
  fr_pending *p = pending_find_locked(l, l->rx_frame.req_id);
  if (p && p->expect == l->rx_frame.type) {
    p->status = status;
    p->size = size;
    p->fd = fd;
    fd = -1;
    __atomic_store_n(&p->done, true, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&l->cond);
  }
  pthread_mutex_unlock(&l->lock);
  if (fd >= 0)
    close(fd);
  fr_ctx_poke(l->ctx, FR_CTX_WAIT_REPLY);
}

/* A MAP response with a CUDA region's IPC handle, into the asker's pending record. */
static void complete_map_cuda(ferry_link *l) {
  int fd = fr_link_take_fd(l); /* nothing rides along a handle: a peer's fd is not kept */
  if (fd >= 0)
    close(fd);
  pthread_mutex_lock(&l->lock);
  fr_pending *p = pending_find_locked(l, l->rx_frame.req_id);
  bool taken = p && p->expect == FR_MAP_RESP && p->ipc; /* decided under the lock: the asker's
                                                           record may be gone after it */
  if (taken) {
    fr_cuda_ipc_decode(l->rx_body + FR_MAP_RESP_BYTES, p->ipc);
    p->cuda = true;
  }
  pthread_mutex_unlock(&l->lock);
  complete(l, taken ? 0 : FERRY_EPROTO, fr_get_u64(l->rx_body), -1);
}

static bool allowed(const ferry_link *l, uint8_t type) {
  int state = link_state(l);
  if (state == FR_LINK_HELLO)
    return type == FR_HELLO && l->accepted;
  if (state == FR_LINK_AUTH)
    return type == FR_AUTH && l->accepted;
  return type >= FR_MSG;
}

/* A REPLY: its payload goes into a new message for the caller waiting on it. */
static int reply_begin(ferry_link *l) {
  fr_frame *f = &l->rx_frame;
  pthread_mutex_lock(&l->lock);
  fr_pending *p = pending_find_locked(l, f->req_id);
  bool take = p && p->expect == FR_REPLY && f->status == 0;
  if (take)
    p->claimed = true;
  pthread_mutex_unlock(&l->lock);
  if (p && !take)
    complete(l, f->status ? f->status : FERRY_EPROTO, 0, -1);
  if (!take) {
    rx_payload(l, NULL, f->len);
    return 0;
  }
  ferry_msg *m = fr_msg_alloc(f->len);
  if (!m)
    return fr_err(FERRY_ENOMEM, "reply of %llu bytes", (unsigned long long)f->len);
  m->link = l;
  l->rx_req = p;
  l->rx_msg = m;
  rx_payload(l, m->data, f->len);
  return 0;
}

/* A complete header arrived: decide where its payload goes. */
static int frame_begin(ferry_link *l) {
  fr_frame *f = &l->rx_frame;
  int rc = fr_frame_decode(l->rx_header, l->ctx->max_payload, f);
  if (rc != 0)
    return rc;
  __atomic_store_n(&l->rx_frames, l->rx_frames + 1, __ATOMIC_RELAXED);
  if (!allowed(l, f->type))
    return fr_err(FERRY_EPROTO, "frame type %u not allowed in link state %d", f->type,
                  link_state(l));
  switch ((fr_frame_type)f->type) {
  case FR_MSG:
  case FR_CALL: {
    ferry_msg *m = fr_msg_alloc(f->len);
    if (!m)
      return fr_err(FERRY_ENOMEM, "message of %llu bytes", (unsigned long long)f->len);
    m->link = l;
    m->channel = f->channel;
    fr_msg_node_of(m)->call_id = f->type == FR_CALL ? f->req_id : 0;
    l->rx_msg = m;
    rx_payload(l, m->data, f->len);
    return 0;
  }
  case FR_REPLY:
    return reply_begin(l);
  case FR_READV: { /* its body may exceed rx_body: it lands in a message buffer */
    ferry_msg *m = fr_msg_alloc(f->len);
    if (!m)
      return fr_err(FERRY_ENOMEM, "readv request of %llu bytes", (unsigned long long)f->len);
    m->link = NULL;
    l->rx_msg = m;
    rx_payload(l, m->data, f->len);
    return 0;
  }
  case FR_READ_RESP: {
    pthread_mutex_lock(&l->lock);
    fr_pending *p = pending_find_locked(l, f->req_id);
    bool take = p && p->expect == FR_READ_RESP && f->status == 0 && f->len == p->len;
    if (take)
      p->claimed = true;
    pthread_mutex_unlock(&l->lock);
    l->rx_req = take ? p : NULL;
    if (f->len == 0 || !take) {
      if (p && !take)
        complete(l, f->status ? f->status : FERRY_EPROTO, 0, -1);
      rx_payload(l, NULL, f->len);
    } else {
      rx_payload(l, p->dst, f->len);
    }
    return 0;
  }
  case FR_WRITE:
    rx_expect(l, FR_RX_BODY, FR_RMA_BYTES);
    return 0;
  case FR_AUTH_ACK:
  case FR_WRITE_RESP:
    complete(l, f->status, 0, -1);
    rx_expect(l, FR_RX_HEADER, FR_FRAME_BYTES);
    return 0;
  case FR_MAP_RESP:
    if (f->status != 0) {
      complete(l, f->status, 0, -1);
      rx_expect(l, FR_RX_HEADER, FR_FRAME_BYTES);
      return 0;
    }
    __attribute__((fallthrough));
  default:
    rx_expect(l, FR_RX_BODY, f->len);
    return 0;
  }
}

static int body_done(ferry_link *l) {
  fr_frame *f = &l->rx_frame;
  int rc = 0;
  switch ((fr_frame_type)f->type) {
  case FR_HELLO:
    rc = on_hello(l);
    break;
  case FR_AUTH:
    rc = on_auth(l);
    break;
  case FR_READ:
    rc = on_read_request(l);
    break;
  case FR_MAP:
    rc = on_map_request(l);
    break;
  case FR_MAP_RESP: {
    if (f->len == FR_MAP_RESP_CUDA_BYTES) { /* a CUDA region: its IPC handle, no fd */
      complete_map_cuda(l);
      break;
    }
    int fd = fr_link_take_fd(l);
    if (fd < 0 && l->ops->fetch_fd)
      l->ops->fetch_fd(l, fr_deadline_ns(l->ctx->timeout_ms), &fd);
    complete(l, fd < 0 ? FERRY_EPROTO : 0, fr_get_u64(l->rx_body), fd);
    break;
  }
  case FR_WRITE: {
    if ((rc = fr_rma_decode(l->rx_body, FR_RMA_BYTES, &l->rx_rma)) != 0)
      return rc;
    if (l->rx_rma.length != f->len - FR_RMA_BYTES)
      return fr_err(FERRY_EPROTO, "write: header says %llu bytes, frame carries %llu",
                    (unsigned long long)l->rx_rma.length,
                    (unsigned long long)(f->len - FR_RMA_BYTES));
    fr_region *r = NULL;
    int st = fr_region_acquire(&l->ctx->regions, l->rx_rma.region, l->rx_rma.key, l->rx_rma.offset,
                               l->rx_rma.length, &r);
    if (st == 0 && r->kind == FERRY_MEM_CUDA) { /* the bytes would land in device memory */
      st = fr_err(FERRY_ENOTSUP, "a write over the stream into CUDA region %llu",
                  (unsigned long long)r->id);
      fr_region_release(r);
      r = NULL;
    }
    l->rx_region = r;
    l->rx_req = NULL;
    f->status = st; /* remembered for the response */
    rx_payload(l, r ? r->data + l->rx_rma.offset : NULL, l->rx_rma.length);
    return 0;
  }
  default:
    break;
  }
  rx_expect(l, FR_RX_HEADER, FR_FRAME_BYTES);
  return rc;
}

static int payload_done(ferry_link *l) {
  fr_frame *f = &l->rx_frame;
  int rc = 0;
  if (f->type == FR_MSG || f->type == FR_CALL) {
    ferry_msg *m = l->rx_msg;
    l->rx_msg = NULL;
    ((uint8_t *)m->data)[m->len] = 0; /* a NUL after the bytes, for text payloads */
    fr_ctx_deliver(l->ctx, m);
  } else if (f->type == FR_REPLY && l->rx_req) {
    ferry_msg *m = l->rx_msg;
    l->rx_msg = NULL;
    ((uint8_t *)m->data)[m->len] = 0;
    fr_link_ref(l);
    pthread_mutex_lock(&l->lock);
    l->rx_req->reply = m;
    pthread_mutex_unlock(&l->lock);
    l->rx_req = NULL;
    complete(l, 0, 0, -1);
  } else if (f->type == FR_READV) {
    ferry_msg *m = l->rx_msg;
    l->rx_msg = NULL;
    rc = on_readv_request(l, m->data, m->len);
    ferry_msg_free(m);
  } else if (f->type == FR_READ_RESP && l->rx_req) {
    l->rx_req = NULL;
    complete(l, 0, 0, -1);
  } else if (f->type == FR_WRITE) {
    fr_region_release(l->rx_region);
    l->rx_region = NULL;
    rc = send_status(l, FR_WRITE_RESP, f->req_id, f->status);
  }
  rx_expect(l, FR_RX_HEADER, FR_FRAME_BYTES);
  return rc;
}

static _Thread_local uint8_t discard_buf[64 * 1024];

/* Runs the handlers of every unit (header, body, payload) that is complete, until the state
 * machine waits for bytes again. */
static int rx_advance(ferry_link *l) {
  for (;;) {
    int rc;
    if (l->rx_phase == FR_RX_HEADER) {
      if (l->rx_have < FR_FRAME_BYTES)
        return 0;
      rc = frame_begin(l);
    } else if (l->rx_phase == FR_RX_BODY) {
      if (l->rx_have < l->rx_want)
        return 0;
      rc = body_done(l);
    } else {
      if (l->rx_left > 0)
        return 0;
      rc = payload_done(l);
    }
    if (rc != 0)
      return rc;
  }
}

/* Feeds staged bytes to the state machine. */
static int rx_take_staged(ferry_link *l) {
  while (l->rx_stage_pos < l->rx_stage_len) {
    const uint8_t *src = l->rx_stage + l->rx_stage_pos;
    size_t avail = l->rx_stage_len - l->rx_stage_pos, n;
    if (l->rx_phase == FR_RX_PAYLOAD) {
      n = avail < l->rx_left ? avail : (size_t)l->rx_left;
      if (l->rx_dst) {
        memcpy(l->rx_dst, src, n);
        l->rx_dst += n;
      }
      l->rx_left -= n;
    } else {
      uint8_t *dst = l->rx_phase == FR_RX_HEADER ? l->rx_header : l->rx_body;
      n = l->rx_want - l->rx_have < avail ? l->rx_want - l->rx_have : avail;
      memcpy(dst + l->rx_have, src, n);
      l->rx_have += n;
    }
    l->rx_stage_pos += n;
    int rc = rx_advance(l);
    if (rc != 0)
      return rc;
  }
  return 0;
}

static int recv_status(ssize_t n) {
  if (n == 0)
    return fr_err(FERRY_EPEER, "peer closed the connection");
  errno = (int)-n;
  return fr_err_errno(FERRY_EPEER, "recv");
}

/* Receives what the socket has: small frames through the stage (one recv for many frames),
 * large payloads straight into their destination. Returns 0 when drained (a short read or
 * EAGAIN: the socket had nothing more), or a status; after 256 receives it stops for fairness
 * and sets rx_more. */
static int rx_drain(ferry_link *l) {
  l->rx_more = false;
  for (int round = 0; round < 256; round++) {
    int rc = rx_take_staged(l);
    if (rc != 0)
      return rc;
    bool direct = l->rx_phase == FR_RX_PAYLOAD && l->rx_left >= sizeof l->rx_stage;
    uint8_t *dst = direct ? (l->rx_dst ? l->rx_dst : discard_buf) : l->rx_stage;
    size_t want = direct ? (size_t)l->rx_left : sizeof l->rx_stage;
    if (direct && !l->rx_dst && want > sizeof discard_buf)
      want = sizeof discard_buf;
    ssize_t n = l->ops->recv(l, dst, want);
    if (n == -EAGAIN || n == -EWOULDBLOCK)
      return 0;
    if (n <= 0)
      return recv_status(n);
    __atomic_store_n(&l->rx_bytes, l->rx_bytes + (uint64_t)n, __ATOMIC_RELAXED);
    if (direct) {
      if (l->rx_dst)
        l->rx_dst += n;
      l->rx_left -= (uint64_t)n;
      if ((rc = rx_advance(l)) != 0)
        return rc;
    } else {
      l->rx_stage_pos = 0;
      l->rx_stage_len = (size_t)n;
    }
    if ((size_t)n < want) /* the socket is drained; epoll tells us when more comes */
      return rx_take_staged(l);
  }
  l->rx_more = true;
  return rx_take_staged(l);
}

/* Unregisters a dead link (the ctx's leader); the ctx's reference is dropped at the end of the
 * event batch. */
static void link_retire(ferry_link *l, int status, const char *why) {
  if (status == FERRY_EPROTO)
    fr_warn_limited("link %s '%s': closing after a bad frame: %s", l->ops->name, l->peer, why);
  fr_link_fail(l, status, why);
  pthread_mutex_lock(&l->lock);
  if (l->rx_req) {
    l->rx_req->status = status;
    __atomic_store_n(&l->rx_req->done, true, __ATOMIC_RELEASE);
    l->rx_req = NULL;
    pthread_cond_broadcast(&l->cond);
  }
  pthread_mutex_unlock(&l->lock);
  ferry_ctx *ctx = l->ctx;
  epoll_ctl(ctx->epfd, EPOLL_CTL_DEL, l->poller.fd, NULL);
  l->poller.on_event = NULL; /* later events of this batch are ignored */
  if (l->ops->retire)
    l->ops->retire(l);
  pthread_mutex_lock(&ctx->links_lock);
  for (ferry_link **pp = &ctx->links; *pp; pp = &(*pp)->next)
    if (*pp == l) {
      *pp = l->next;
      fr_link_stats_fold(l);
      break;
    }
  pthread_mutex_unlock(&ctx->links_lock);
  fr_ctx_link_down(ctx, l); /* owners waiting on this peer (an mq publish short of its credit) */
}

/* How long the frames a peer sent before its end may keep the ctx's leader (rx_last): they
 * are normally all there at once, this only stops a peer that keeps writing after its end. */
#define FR_END_DRAIN_NS (1000ull * 1000000ull)

/* The peer's end (its socket's end of stream, as ops->readable saw it) can come while what it
 * sent before waits beside the socket: in shm's ring (mapped here until the link is freed), in
 * UCX's stream. Takes that in and dispatches its complete frames, until nothing more is there
 * (or FR_END_DRAIN_NS), then returns the end's status; a frame the end cut short is dropped. */
static int rx_last(ferry_link *l, int end) {
  char why[256];
  fr_str_copy(why, sizeof why, ferry_last_error());
  uint64_t deadline = fr_now_ns() + FR_END_DRAIN_NS;
  int rc;
  do
    rc = rx_drain(l);
  while (rc == 0 && (l->rx_more || (l->ops->idle && !l->ops->idle(l))) && fr_now_ns() < deadline);
  if (rc != 0) /* a bad frame or ring among the last bytes says so itself */
    return rc;
  if (l->rx_phase != FR_RX_HEADER)
    fr_debug("link %s '%s': the peer's end cut a frame short (type %u, %llu bytes): dropped",
             l->ops->name, l->peer, l->rx_frame.type, (unsigned long long)l->rx_frame.len);
  else if (l->rx_have > 0)
    fr_debug("link %s '%s': the peer's end cut a frame short (%zu bytes of its header): dropped",
             l->ops->name, l->peer, l->rx_have);
  return fr_err(end, "%s", why);
}

/* Drains the link; the ctx's leader (the epoll handler) also lets the transport consume what
 * comes beside the stream first, and arms it before going back to its epoll. The peer's end
 * reported there is taken after what the peer sent before it (rx_last), unless this node ended
 * the link itself (closed it, or gave up on it: a timeout, a bad frame). */
static int rx_progress(ferry_link *l) {
  int rc = l->ops->readable ? l->ops->readable(l) : 0;
  if (rc == FERRY_EPEER && (link_state(l) != FR_LINK_DEAD || l->dead_status == FERRY_EPEER))
    return rx_last(l, rc);
  if (rc == 0)
    rc = rx_drain(l);
  while (rc == 0 && l->ops->idle && !l->ops->idle(l))
    rc = rx_drain(l);
  return rc;
}

/* A draining poll (`wait`: a spinner's last look, fr_ctx_poll_links) also re-arms the link's
 * wake-up (ops->idle), as the epoll handler does: a spinner that took the bytes a doorbell was
 * rung for leaves the ring marked awake otherwise, and the peer's next message then rings no
 * doorbell and waits in the ring for a caller's timeout (seen with `ferry put`/`get` racing on
 * one `ferry serve`: replies stranded 10 s). */
void fr_link_poll(ferry_link *l, bool wait) {
  if (!l->ops->pollable || !l->ops->pollable(l) || link_state(l) != FR_LINK_OPEN)
    return;
  if (wait)
    pthread_mutex_lock(&l->rx_lock);
  else if (pthread_mutex_trylock(&l->rx_lock) != 0)
    return;
  int rc = rx_drain(l);
  while (wait && rc == 0 && l->ops->idle && !l->ops->idle(l))
    rc = rx_drain(l);
  pthread_mutex_unlock(&l->rx_lock);
  if (rc < 0)
    fr_link_fail(l, rc, ferry_last_error());
}

static void link_on_event(fr_poller *p, uint32_t events) {
  ferry_link *l = (ferry_link *)p;
  pthread_mutex_lock(&l->rx_lock);
  int rc = rx_progress(l);
  /* Edge-triggered: an end that came with the bytes just read raises no new edge, and rx_drain
   * stops at the short read before it, so the link looks again (and retires) at once. */
  bool more = l->rx_more || (events & (EPOLLRDHUP | EPOLLHUP));
  pthread_mutex_unlock(&l->rx_lock);
  if (rc == 0 && more && l->ops->edge_triggered) { /* no new edge will come for what is left */
    struct epoll_event ev = {.events = link_events(l), .data.ptr = &l->poller};
    epoll_ctl(l->ctx->epfd, EPOLL_CTL_MOD, l->poller.fd, &ev);
  }
  if (rc < 0) {
    const char *why = ferry_last_error();
    link_retire(l, rc, *why ? why : "connection lost");
    fr_ctx_bury(l->ctx, l);
  } else if (rc == 0 && (events & (EPOLLHUP | EPOLLERR)) && link_state(l) == FR_LINK_DEAD) {
    link_retire(l, l->dead_status, "closed");
    fr_ctx_bury(l->ctx, l);
  }
}

void fr_link_reap_stale(ferry_ctx *ctx) {
  uint64_t limit = (uint64_t)ctx->timeout_ms * 1000000ull, now = fr_now_ns();
  pthread_mutex_lock(&ctx->links_lock);
  for (ferry_link *l = ctx->links; l; l = l->next) {
    int state = link_state(l);
    if (state != FR_LINK_OPEN && state != FR_LINK_DEAD && now - l->created_ns > limit) {
      fr_warn_limited("dropping a link from '%s' that did not finish its handshake", l->peer);
      shutdown(l->poller.fd, SHUT_RDWR);
    }
  }
  pthread_mutex_unlock(&ctx->links_lock);
}
