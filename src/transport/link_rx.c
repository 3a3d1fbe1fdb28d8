/*
 * A link's receive state machine (link.c has the overview), driven by the thread that leads the
 * ctx's epoll or by a spinner's poll: headers, bodies and payloads, each payload straight into its
 * destination (a message, the requester's buffer, the owner's region); the requests it serves
 * (reads, vectored reads, maps); and the link's end, after what the peer sent before it.
 */
#include "transport/link_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define FR_INLINE_RESPONSE_MAX (64u * 1024u) /* larger read responses go to the server thread */

/* Where a payload nobody wants is received, and where an inline read response of registered
 * memory is copied before it goes out (inline_bytes): never holding anything between calls. */
static _Thread_local uint8_t scratch[FR_INLINE_RESPONSE_MAX];

/* The iovecs of an inline read response (at most FR_INLINE_RESPONSE_MAX bytes in all). A shared
 * region's bytes live as long as the reference: sent from where they are. Registered memory's
 * caller may free them once deregistered (core/region.h), and a send may wait for the peer: they
 * are copied into scratch while in use, and sent from there. FERRY_ENOTFOUND once deregistered. */
static int inline_bytes(fr_region *reg, struct iovec *iov, uint32_t n) {
  if (!fr_region_is_registered(reg))
    return 0;
  if (!fr_region_use_begin(reg))
    return FERRY_ENOTFOUND;
  uint8_t *at = scratch;
  FR_ONE_SIDED_READ_BEGIN(); /* the owner may be rewriting them (core.h) */
  for (uint32_t i = 0; i < n; i++) {
    memcpy(at, iov[i].iov_base, iov[i].iov_len);
    iov[i].iov_base = at;
    at += iov[i].iov_len;
  }
  FR_ONE_SIDED_READ_END();
  fr_region_use_end(reg);
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
  if ((f.status = inline_bytes(reg, &iov, 1)) != 0)
    f.len = 0;
  FR_ONE_SIDED_READ_BEGIN(); /* the owner may be rewriting them (core.h) */
  rc = fr_link_send_frame(l, &f, &iov, f.len ? 1 : 0, -1, fr_deadline_ns(l->ctx->timeout_ms));
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
  f.status = inline_bytes(reg, iov, h.count);
  f.len = f.status ? 0 : h.total;
  FR_ONE_SIDED_READ_BEGIN(); /* the owner may be rewriting them (core.h) */
  rc = fr_link_send_frame(l, &f, iov, f.len ? (int)h.count : 0, -1,
                          fr_deadline_ns(l->ctx->timeout_ms));
  FR_ONE_SIDED_READ_END();
  fr_region_release(reg);
  free(runs);
  return rc;
}

/* The MAP answer's fd: a duplicate of the region's memfd, so that the answer can go out after the
 * region's reference is dropped (on_map_request); -1 when the process has no descriptor left. */
static int map_answer_fd(ferry_link *l, const fr_region *reg) {
  int fd = fcntl(reg->memfd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0)
    fr_debug("region %llu: no descriptor to pass to '%s' (%s); it reads through this node",
             (unsigned long long)reg->id, l->peer, strerror(errno));
  return fd;
}

/* A MAP: the region's memfd (or CUDA IPC handle) and size. The region's reference is dropped
 * before the answer goes out: once the peer has it, its read may return and its owner free the
 * region, which a reference still held here would keep from the cache (core/region.h: only a
 * region nobody holds is cached), so the next ferry_alloc would not take it back. */
static int on_map_request(ferry_link *l) {
  fr_map m;
  int rc = fr_map_decode(l->rx_body, l->rx_frame.len, &m);
  if (rc != 0)
    return rc;
  fr_region *reg = NULL;
  int status = fr_region_acquire(&l->ctx->regions, m.region, m.key, 0, 0, &reg);
  fr_cuda_ipc ipc;
  bool cuda = status == 0 && reg->kind == FERRY_MEM_CUDA;
  int fd = -1;
  if (cuda && (!l->ops->passes_fds || fr_region_cuda_ipc(&l->ctx->regions, reg, &ipc) != 0)) {
    fr_debug("region %llu: no CUDA IPC handle for '%s': %s", (unsigned long long)m.region, l->peer,
             l->ops->passes_fds ? ferry_last_error() : "not a same-host link");
    status = FERRY_ENOTSUP; /* the peer falls back to read requests, staged here */
  } else if (status == 0 && !cuda && (reg->memfd < 0 || !l->ops->passes_fds)) {
    status = FERRY_ENOTSUP; /* registered memory: the peer falls back to read requests */
  } else if (status == 0 && !cuda && (fd = map_answer_fd(l, reg)) < 0) {
    status = FERRY_ENOTSUP; /* read requests need no descriptor */
  }
  uint8_t body[FR_MAP_RESP_CUDA_BYTES];
  if (status == 0)
    fr_put_u64(body, reg->size);
  if (status == 0 && cuda)
    fr_cuda_ipc_encode(&ipc, body + FR_MAP_RESP_BYTES);
  fr_region_release(reg);
  fr_frame f = {.type = FR_MAP_RESP, .status = status, .req_id = l->rx_frame.req_id};
  struct iovec iov = {body, cuda ? FR_MAP_RESP_CUDA_BYTES : FR_MAP_RESP_BYTES};
  f.len = status == 0 ? iov.iov_len : 0;
  rc = fr_link_send_frame(l, &f, status == 0 ? &iov : NULL, status == 0 ? 1 : 0, fd,
                          fr_deadline_ns(l->ctx->timeout_ms));
  if (fd >= 0)
    close(fd);
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

static fr_pending *pending_find_locked(ferry_link *l, uint64_t id) {
  for (fr_pending *p = l->pending; p; p = p->next)
    if (p->id == id && !p->done)
      return p;
  return NULL;
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
    rc = fr_link_on_hello(l);
    break;
  case FR_AUTH:
    rc = fr_link_on_auth(l);
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
    rc = fr_link_send_status(l, FR_WRITE_RESP, f->req_id, f->status);
  }
  rx_expect(l, FR_RX_HEADER, FR_FRAME_BYTES);
  return rc;
}

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

/* Begins writing a payload into its destination: one in registered memory (a peer's write) is
 * written while in use (fr_region_use_begin, a non-blocking receive or a copy at a time); once
 * deregistered, the rest of it is discarded and the writer told FERRY_ENOTFOUND. Returns
 * whether fr_region_use_end is owed. */
static bool rx_dst_begin(ferry_link *l) {
  if (!l->rx_region || !l->rx_dst || l->rx_phase != FR_RX_PAYLOAD)
    return false;
  if (fr_region_test_receiving)
    fr_region_test_receiving(l->rx_region);
  if (fr_region_use_begin(l->rx_region))
    return true;
  l->rx_dst = NULL;
  l->rx_frame.status = FERRY_ENOTFOUND;
  return false;
}

/* Feeds staged bytes to the state machine. */
static int rx_take_staged(ferry_link *l) {
  while (l->rx_stage_pos < l->rx_stage_len) {
    const uint8_t *src = l->rx_stage + l->rx_stage_pos;
    size_t avail = l->rx_stage_len - l->rx_stage_pos, n;
    if (l->rx_phase == FR_RX_PAYLOAD) {
      n = avail < l->rx_left ? avail : (size_t)l->rx_left;
      bool in_use = rx_dst_begin(l);
      if (l->rx_dst) {
        memcpy(l->rx_dst, src, n);
        l->rx_dst += n;
      }
      if (in_use)
        fr_region_use_end(l->rx_region);
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
    bool in_use = direct && rx_dst_begin(l);
    uint8_t *dst = direct ? (l->rx_dst ? l->rx_dst : scratch) : l->rx_stage;
    size_t want = direct ? (size_t)l->rx_left : sizeof l->rx_stage;
    if (direct && !l->rx_dst && want > sizeof scratch)
      want = sizeof scratch;
    ssize_t n = l->ops->recv(l, dst, want);
    if (in_use)
      fr_region_use_end(l->rx_region);
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
  fr_err_keep why;
  fr_err_save(&why, end);
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
  return fr_err_restore(&why);
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

void fr_link_on_event(fr_poller *p, uint32_t events) {
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
