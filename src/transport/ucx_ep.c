/*
 * The ucx transport's links (overview in ucx.c): each link's UCP worker and its wake-ups in the
 * ctx's epoll, the preamble that trades worker addresses over the link's socket and the
 * endpoint made from it, waiting for an operation with the link's lock held, and the ops of the
 * handshake and the byte stream, which runs over the UCP stream API once the link is open.
 */
#include "transport/ucx_impl.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucs/config/global_opts.h>
#include <unistd.h>

static _Thread_local bool tl_progress_thread; /* set on the ctx's progress thread */

char fr_ucx_channel; /* ucx_impl.h, HB_* */

/* ---- small helpers ---- */

int fr_ucx_err(int code, ucs_status_t st, const char *what, const ferry_link *l) {
  return fr_err(code, "ucx %s%s%s: %s", what, l ? " with " : "", l ? l->peer : "",
                ucs_status_string(st));
}

int fr_ucx_link_status(const ferry_link *l) {
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
void fr_ucx_op_issued(ucx_op *op, ucs_status_ptr_t sp) {
  if (sp == NULL)
    op_done(op, UCS_OK);
  else if (UCS_PTR_IS_ERR(sp))
    op_done(op, UCS_PTR_STATUS(sp));
}

ucp_request_param_t fr_ucx_op_param(ucx_op *op) {
  HB_HAND_OVER(); /* every operation's parameters are made just before it is issued */
  return (ucp_request_param_t){.op_attr_mask =
                                   UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                               .cb.send = op_send_cb,
                               .user_data = op};
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
  ucp_request_param_t p = fr_ucx_op_param(&op);
  p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  fr_ucx_op_issued(&op, ucp_ep_close_nbx(u->ep, &p));
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
void fr_ucx_release(ucx_link *u, int epfd) {
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
    fr_ucx_mapping_unref_locked(u->uc, g->m);
    free(g);
  }
  pthread_mutex_unlock(&u->uc->lock);
}

/* ---- waiting ---- */

int fr_ucx_ep_check(const ucx_link *u) {
  return u->ep && !u->gone ? 0 : fr_err(FERRY_EPEER, "ucx link with '%s' is closed", u->link->peer);
}

static int wait_status(ucx_link *u, uint64_t deadline_ns) {
  int st = fr_ucx_link_status(u->link);
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
void fr_ucx_settle_locked(ucx_link *u, const bool *done) {
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
int fr_ucx_wait_locked(ucx_link *u, const bool *done, uint64_t deadline_ns) {
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
  fr_ucx_settle_locked(u, done);
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
    return fr_ucx_err(FERRY_ECONNECT, st, "endpoint", u->link);
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
    return fr_ucx_err(FERRY_ESYS, st, "worker address", NULL);
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
    return fr_ucx_err(FERRY_ESYS, st, "worker", NULL);
  if ((st = ucp_worker_get_efd(u->worker, &u->efd)) != UCS_OK)
    return fr_ucx_err(FERRY_ESYS, st, "worker event fd", NULL);
  if ((u->kick = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
    return fr_err_errno(FERRY_ESYS, "ucx: eventfd");
  return fr_ucx_set_handlers(u);
}

static int link_state_new(ferry_link *l) {
  ucx_ctx *uc = fr_ucx_ctx_of(l->ctx);
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

void fr_ucx_link_fini(ferry_link *l) {
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
    fr_ucx_release(u, l->ctx->epfd);
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

/* ---- ops: dial and the handshake hooks ---- */

int fr_ucx_dial(const char *where, int timeout_ms, int *fd) {
  return fr_tcp_transport.dial(where, timeout_ms, fd);
}

void fr_ucx_setup(int fd) { fr_tcp_transport.setup(fd); }

int fr_ucx_offer(ferry_link *l, int *fd) {
  *fd = -1;
  return link_state_new(l);
}

int fr_ucx_accept_offer(ferry_link *l, int fd) {
  if (fd >= 0)
    close(fd);
  return link_state_new(l);
}

void fr_ucx_opened(ferry_link *l) {
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
int fr_ucx_readable(ferry_link *l) {
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
  int rc = fr_ucx_link_status(l);
  if (rc != 0)
    return fr_err(rc, "link closed");
  /* Not before the endpoint exists: the worker would take in the connection the peer's endpoint
   * made to it, ucp_ep_create would then take that connection over, and UCX 1.13 aborts the
   * process when the peer dies right then (docs/UCX.md, "A peer that dies during wire-up"). */
  pthread_mutex_lock(&u->lock);
  if (u->worker && u->ready)
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
ssize_t fr_ucx_recv(ferry_link *l, void *dst, size_t len) {
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
bool fr_ucx_idle(ferry_link *l) {
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

int fr_ucx_wait_ready_locked(ucx_link *u, uint64_t deadline_ns) {
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

int fr_ucx_sendv(ferry_link *l, struct iovec *iov, int iovcnt, int fd_out, uint64_t deadline_ns) {
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
  int rc = fr_ucx_wait_ready_locked(u, deadline_ns);
  if (rc == 0 && n > 0) {
    ucx_op op = {0};
    ucp_request_param_t p = fr_ucx_op_param(&op);
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    p.datatype = ucp_dt_make_iov();
    fr_ucx_op_issued(&op, ucp_stream_send_nbx(u->ep, v, n, &p));
    rc = fr_ucx_wait_locked(u, &op.done, deadline_ns);
    if (rc == 0 && op.status != UCS_OK)
      rc = fr_ucx_err(FERRY_EPEER, op.status, "send", l);
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
 * the socket (the peer then takes in the stream, link_rx.c's rx_last, and ends its side) and waits
 * for the peer's end before the link goes on to close the endpoint; until `end` at most
 * (fr_link_flush_deadline). A flush that does not end in time is cancelled with the endpoint. */
void fr_ucx_flush(ferry_link *l, uint64_t end) {
  ucx_link *u = ucx_of(l);
  if (!stream_on(l) || fr_ucx_link_status(l) != 0)
    return;
  bool flushed = false;
  pthread_mutex_lock(&u->lock);
  if (u->ready && u->ep && !u->gone) {
    ucx_op op = {0};
    ucp_request_param_t p = fr_ucx_op_param(&op);
    fr_ucx_op_issued(&op, ucp_ep_flush_nbx(u->ep, &p));
    while (!op.done && fr_now_ns() < end)
      if (progress_locked(u) == 0 && !op.done)
        sleep_locked(u, end);
    flushed = op.done && op.status == UCS_OK;
    if (!op.done) {
      fr_debug("ucx link with '%s': its flush did not end in time; closing", l->peer);
      ep_close_locked(u, FERRY_ECLOSED);
      fr_ucx_settle_locked(u, &op.done);
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

void fr_ucx_retire(ferry_link *l) {
  ucx_link *u = ucx_of(l);
  if (!u)
    return;
  pthread_mutex_lock(&u->lock);
  unwatch_locked(u, l->ctx->epfd);
  ep_close_locked(u, fr_ucx_link_status(l) ? fr_ucx_link_status(l) : FERRY_EPEER);
  pthread_mutex_unlock(&u->lock);
}
