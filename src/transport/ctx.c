/*
 * The context: one per node. It owns the listeners, the links, the regions, the message queues
 * (one per channel) and two threads: the progress thread, which waits in epoll and drives every
 * link's receive state machine, and the server thread, which sends large read responses so the
 * progress thread never blocks on a slow reader, and answers calls for the ctx's metrics
 * (FR_CHANNEL_STATS), which a collector's locks must not make the progress thread wait for.
 *
 * Leading: one thread at a time waits in the ctx's epoll and runs the handlers. A caller about
 * to sleep on its own response or message takes that role itself when it can (and the ctx's
 * transports allow it), so the bytes it waits for wake it directly: a round trip then costs one
 * wake-up per side, as a blocking socket does, instead of the progress thread's plus a hand-off.
 * While callers keep leading, the progress thread sleeps; it takes the epoll back when no caller
 * leads and none has for PROGRESS_GRACE_NS, or at once when a leaving caller leaves others asleep
 * behind it. A leader polls without sleeping while events keep coming (a large tcp message
 * arrives in many socket-buffer pieces), and sleeps in the epoll after FERRY_SPIN_US without
 * one, or as soon as its yield lets another thread run on its core.
 * Background threads (service loops that wait for requests all the time, such as the embedded
 * directory's) lead only as the progress thread does, and never poll without sleeping: on a
 * small machine that takes the core an application thread needs (a publisher's directory thread
 * polling after each of its subscriber's releases halved the subscriber's share of its core, in
 * 5 us turns). A caller that finds the epoll led by one of them (or by the progress thread)
 * asks it to step down and takes over, so that the message it waits for wakes it rather than
 * being handed over by another thread.
 */
#include "transport/transport.h"
#include "core/channels.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

struct fr_serve_job {
  ferry_link *link;
  uint64_t req_id;
  fr_region *region;
  uint64_t off, len;
  ferry_msg *stats; /* a call on FR_CHANNEL_STATS to answer (then region is NULL) */
  fr_serve_job *next;
  fr_rma_run *runs; /* a READV's runs (owned), sent one after another; NULL: [off, off+len) */
  uint32_t nruns;
};

static bool stopping(const ferry_ctx *ctx) {
  return __atomic_load_n(&ctx->stopping, __ATOMIC_ACQUIRE);
}

/* Marks the links as polled by this thread: their peers send without a doorbell meanwhile. */
static void polling_begin(ferry_link **links, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (links[i]->ops->poll_begin)
      links[i]->ops->poll_begin(links[i]);
}

/* Ends polling_begin and drains the links: what arrived as polling stopped is not stranded. */
static void polling_end(ferry_link **links, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (links[i]->ops->poll_end)
      links[i]->ops->poll_end(links[i]);
    fr_link_poll(links[i], true);
  }
}

/* Spinning keeps a waiter on its core for the next microseconds instead of paying a wake-up
 * (tens of microseconds here). While it spins it drives the links it waits on itself, so a
 * shm round trip needs no wake-up and no system call at all. It yields each round so that on a
 * busy machine the thread it waits for gets the core. */
static bool spin(ferry_link **links, size_t n, const void *word, size_t width, int spin_us) {
#define SPIN_READY                                                                                 \
  (width == 1 ? __atomic_load_n((const bool *)word, __ATOMIC_ACQUIRE)                              \
              : __atomic_load_n((const int *)word, __ATOMIC_ACQUIRE) != 0)
  if (SPIN_READY)
    return true;
  polling_begin(links, n);
  uint64_t end = fr_now_ns() + (uint64_t)spin_us * 1000u;
  bool ready = false;
  while (!(ready = SPIN_READY) && fr_now_ns() < end) {
    for (size_t i = 0; i < n; i++)
      fr_link_poll(links[i], false);
    if (!(ready = SPIN_READY))
      sched_yield();
  }
  polling_end(links, n);
  return ready || SPIN_READY;
#undef SPIN_READY
}

bool fr_spin_until(ferry_link *link, const bool *flag, int spin_us) {
  bool pollable = link && link->ops->pollable && link->ops->pollable(link);
  return spin(&link, pollable ? 1 : 0, flag, 1, spin_us);
}

/* The links of the context that are cheap to poll (shm rings), up to cap, a reference each. */
static size_t cheap_links(ferry_ctx *ctx, ferry_link **links, size_t cap) {
  size_t n = 0;
  pthread_mutex_lock(&ctx->links_lock);
  for (ferry_link *l = ctx->links; l && n < cap; l = l->next)
    if (l->ops->poll_is_cheap && l->ops->pollable(l)) {
      fr_link_ref(l);
      links[n++] = l;
    }
  pthread_mutex_unlock(&ctx->links_lock);
  return n;
}

void fr_ctx_work_polling(ferry_ctx *ctx, void (*work)(void *), void *arg) {
  ferry_link *links[16];
  size_t n = cheap_links(ctx, links, 16);
  polling_begin(links, n);
  work(arg);
  polling_end(links, n);
  for (size_t i = 0; i < n; i++)
    fr_link_unref(links[i]);
}

/* Spins on a channel, driving every link of the context that is cheap to poll (shm rings);
 * the others keep their messages coming through the progress thread. Where callers lead the
 * epoll, spinning without such a link is pointless: the caller leads at once instead. */
static void spin_channel(ferry_ctx *ctx, fr_channel *c) {
  ferry_link *links[16];
  size_t n = cheap_links(ctx, links, 16);
  if (n > 0 || !ctx->users_may_lead)
    spin(links, n, &c->count, sizeof c->count, ctx->spin_us);
  for (size_t i = 0; i < n; i++)
    fr_link_unref(links[i]);
}

/* Drains every link of the context that is cheap to poll (shm rings), waiting for one that
 * another thread is draining right now: whatever such a link's peer had sent before this call
 * is then in the channel queues. */
void fr_ctx_poll_links(ferry_ctx *ctx) {
  pthread_mutex_lock(&ctx->links_lock);
  size_t n = 0;
  for (ferry_link *l = ctx->links; l; l = l->next)
    n++;
  ferry_link **links = malloc((n ? n : 1) * sizeof *links);
  n = 0;
  for (ferry_link *l = links ? ctx->links : NULL; l; l = l->next)
    if (l->ops->poll_is_cheap && l->ops->pollable(l)) {
      fr_link_ref(l);
      links[n++] = l;
    }
  pthread_mutex_unlock(&ctx->links_lock);
  if (!links) {
    fr_warn("poll links: out of memory");
    return;
  }
  for (size_t i = 0; i < n; i++) {
    fr_link_poll(links[i], true);
    fr_link_unref(links[i]);
  }
  free(links);
}

/* ---- messages ---- */

/* Received-message buffers are kept for reuse per process, in sizes of four steps per doubling
 * (1, 1.25, 1.5, 1.75, 2 KiB, ... 128 MiB: at most a quarter wasted), one free list per size.
 * glibc gives freed memory back to the kernel (a MiB block at once; smaller ones when a queue
 * that grew drains: per-thread arenas shrink their heaps), and fresh memory costs a page fault
 * per 4 KiB (5-7 ms a MiB on the project's VM): a stream of 16 KiB messages over shm took 35-60
 * us a message with fresh buffers and 2-4 with kept ones, and 16-64 MiB tcp messages were
 * received at 0.2 GB/s. The budget, MSG_KEEP_BYTES, covers a subscriber that fell a whole mq
 * queue (FERRY_MQ_QUEUE_BYTES, 64 MiB by default) behind plus the messages in flight. A full
 * budget makes room by freeing buffers of other sizes (the sizes in use now are the ones worth
 * keeping: after a stream of 1 KiB messages had filled it, a 16 KiB stream faulted every
 * buffer in again), and the buffers of a size not used for MSG_KEEP_IDLE_NS go back to the
 * system (fr_msg_keep_trim, from each ctx's reap once a second), so an idle process holds none. */
#define MSG_CLASS_MIN (1u << 10) /* the smallest class; messages over half of it get one */
#define MSG_CLASSES (18 * 4)     /* eighteen doublings, four steps each: up to 128 MiB */
#define MSG_KEEP_BYTES (160ull << 20)
#define MSG_KEEP_IDLE_NS 2000000000ull
static pthread_mutex_t msg_keep_lock = PTHREAD_MUTEX_INITIALIZER;
static fr_msg_node *msg_class[MSG_CLASSES]; /* newest first */
static size_t msg_class_bytes;

static size_t msg_class_size(int i) {
  size_t base = (size_t)MSG_CLASS_MIN << (i / 4);
  return base + (size_t)(i % 4) * (base / 4);
}

/* The class of len (its index in msg_class), or -1 when len gets none. */
static int msg_class_of(size_t len) {
  if (len <= MSG_CLASS_MIN / 2 || len > msg_class_size(MSG_CLASSES - 1))
    return -1;
  if (len <= MSG_CLASS_MIN)
    return 0;
  int d = 63 - __builtin_clzll((unsigned long long)(len - 1)); /* 2^d < len <= 2^(d+1) */
  size_t base = (size_t)1 << d, quarter = base / 4;
  size_t step = (len - base + quarter - 1) / quarter; /* 1..4: base + step quarters */
  return (d - 10) * 4 + (int)step;
}

/* A kept buffer of class i, taken; NULL when none. */
static fr_msg_node *msg_class_take(int i) {
  pthread_mutex_lock(&msg_keep_lock);
  fr_msg_node *n = msg_class[i];
  if (n) {
    msg_class[i] = n->next;
    msg_class_bytes -= n->cap;
  }
  pthread_mutex_unlock(&msg_keep_lock);
  return n;
}

static void msg_free_all(fr_msg_node *n) {
  for (fr_msg_node *next; n; n = next) {
    next = n->next;
    free(n);
  }
}

/* Keeps n (its cap a class size), making room from the other classes; false: the caller frees
 * it (a buffer larger than the budget). */
static bool msg_class_keep(fr_msg_node *n, int i) {
  fr_msg_node *evicted = NULL;
  pthread_mutex_lock(&msg_keep_lock);
  for (int j = 0; j < MSG_CLASSES && msg_class_bytes + n->cap > MSG_KEEP_BYTES; j++)
    while (j != i && msg_class[j] && msg_class_bytes + n->cap > MSG_KEEP_BYTES) {
      fr_msg_node *e = msg_class[j];
      msg_class[j] = e->next;
      msg_class_bytes -= e->cap;
      e->next = evicted;
      evicted = e;
    }
  bool kept = msg_class_bytes + n->cap <= MSG_KEEP_BYTES;
  if (kept) {
    n->kept_ns = fr_now_ns();
    n->next = msg_class[i];
    msg_class[i] = n;
    msg_class_bytes += n->cap;
  }
  pthread_mutex_unlock(&msg_keep_lock);
  msg_free_all(evicted);
  return kept;
}

/* A size whose newest kept buffer is older than MSG_KEEP_IDLE_NS is not in use: all its
 * buffers go (a size in use keeps its own, within the budget; looking at the heads only keeps
 * this a few dozen loads under the lock, once a second). */
void fr_msg_keep_trim(uint64_t now_ns) {
  fr_msg_node *idle[MSG_CLASSES];
  int nidle = 0;
  pthread_mutex_lock(&msg_keep_lock);
  for (int i = 0; i < MSG_CLASSES; i++)
    if (msg_class[i] && msg_class[i]->kept_ns + MSG_KEEP_IDLE_NS <= now_ns) {
      for (fr_msg_node *n = msg_class[i]; n; n = n->next)
        msg_class_bytes -= n->cap;
      idle[nidle++] = msg_class[i];
      msg_class[i] = NULL;
    }
  pthread_mutex_unlock(&msg_keep_lock);
  for (int i = 0; i < nidle; i++)
    msg_free_all(idle[i]);
}

size_t fr_msg_kept_bytes(uint64_t len) {
  int class = msg_class_of((size_t)len);
  size_t bytes = 0;
  pthread_mutex_lock(&msg_keep_lock);
  for (fr_msg_node *n = class >= 0 ? msg_class[class] : NULL; n; n = n->next)
    bytes += n->cap;
  pthread_mutex_unlock(&msg_keep_lock);
  return bytes;
}

ferry_msg *fr_msg_alloc(uint64_t len) {
  if (len > SIZE_MAX - sizeof(fr_msg_node) - 1)
    return NULL;
  int class = msg_class_of((size_t)len);
  size_t cap = class >= 0 ? msg_class_size(class) : (size_t)len;
  fr_msg_node *n = class >= 0 ? msg_class_take(class) : NULL;
  if (!n && (n = malloc(sizeof *n + cap + 1)))
    n->cap = cap;
  if (!n)
    return NULL;
  n->next = NULL;
  n->call_id = 0;
  n->msg = (ferry_msg){.data = n + 1, .len = (size_t)len};
  return &n->msg;
}

void ferry_msg_free(ferry_msg *msg) {
  if (!msg)
    return;
  fr_msg_node *n = fr_msg_node_of(msg);
  if (msg->link)
    fr_link_unref(msg->link);
  int class = msg_class_of(n->cap);
  if (class < 0 || msg_class_size(class) != n->cap || !msg_class_keep(n, class))
    free(n);
}

static void serve_job(ferry_ctx *ctx, fr_serve_job *j);

void fr_ctx_deliver(ferry_ctx *ctx, ferry_msg *msg) {
  fr_link_ref(msg->link);
  if (msg->channel == FR_CHANNEL_STATS) { /* the ctx's own service, not an application's */
    fr_serve_job *j = malloc(sizeof *j);
    if (!j || !fr_msg_node_of(msg)->call_id) {
      free(j);
      ferry_msg_free(msg);
      return;
    }
    *j = (fr_serve_job){.link = msg->link, .stats = msg};
    serve_job(ctx, j);
    return;
  }
  fr_msg_node *n = fr_msg_node_of(msg);
  int channel = (int)msg->channel; /* once queued, msg is its taker's to free */
  fr_channel *c = &ctx->channels[channel];
  pthread_mutex_lock(&c->lock);
  if (c->tail)
    c->tail->next = n;
  else
    c->head = n;
  c->tail = n;
  __atomic_add_fetch(&c->count, 1, __ATOMIC_RELEASE);
  __atomic_store_n(&c->last_costly, !msg->link->ops->poll_is_cheap, __ATOMIC_RELAXED);
  pthread_cond_signal(&c->cond);
  pthread_mutex_unlock(&c->lock);
  fr_ctx_poke(ctx, channel);
}

/* Set in the service loops' threads (fr_ctx_background_thread): they wait for requests all the
 * time, and neither spin nor lead before callers (see the top). */
static _Thread_local bool background_thread;

typedef struct channel_wait {
  ferry_ctx *ctx;
  fr_channel *c;
} channel_wait;

static bool channel_ready(void *arg) {
  channel_wait *w = arg;
  return __atomic_load_n(&w->c->count, __ATOMIC_ACQUIRE) != 0 || stopping(w->ctx);
}

bool fr_ctx_await(ferry_ctx *ctx, uint32_t channel, int timeout_ms) {
  fr_channel *c = &ctx->channels[channel];
  if (timeout_ms > 0 && !background_thread && !__atomic_load_n(&c->last_costly, __ATOMIC_RELAXED))
    spin_channel(ctx, c); /* its messages came over shm lately (a service loop never spins) */
  channel_wait w = {ctx, c};
  fr_ctx_wait(ctx, (int)channel, channel_ready, &w, &c->lock, &c->cond, fr_deadline_ns(timeout_ms));
  return __atomic_load_n(&c->count, __ATOMIC_ACQUIRE) != 0;
}

ferry_msg *fr_ctx_take(ferry_ctx *ctx, uint32_t channel) {
  fr_channel *c = &ctx->channels[channel];
  pthread_mutex_lock(&c->lock);
  fr_msg_node *n = c->head;
  if (n) {
    c->head = n->next;
    if (!c->head)
      c->tail = NULL;
    __atomic_sub_fetch(&c->count, 1, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&c->lock);
  if (!n)
    return NULL;
  n->next = NULL;
  return &n->msg;
}

int ferry_recv(ferry_ctx *ctx, uint32_t channel, ferry_msg **out, int timeout_ms) {
  if (!ctx || !out || channel >= FERRY_MAX_CHANNELS)
    return fr_err(FERRY_EINVAL, "recv: bad arguments (channel %u)", channel);
  int ms = fr_ctx_timeout(ctx, timeout_ms);
  fr_ctx_await(ctx, channel, ms);
  ferry_msg *m = fr_ctx_take(ctx, channel);
  if (!m)
    return stopping(ctx)
               ? fr_err(FERRY_ECLOSED, "recv: context closing")
               : fr_err(FERRY_ETIMEDOUT, "recv on channel %u: nothing within %d ms", channel, ms);
  *out = m;
  return 0;
}

/* ---- the server thread ---- */

void fr_ctx_serve_later(ferry_ctx *ctx, ferry_link *l, uint64_t req_id, fr_region *r, uint64_t off,
                        uint64_t len) {
  fr_serve_job *j = malloc(sizeof *j);
  if (!j) {
    fr_region_release(r);
    fr_link_fail(l, FERRY_ENOMEM, "cannot queue a read response");
    fr_link_unref(l);
    return;
  }
  *j = (fr_serve_job){.link = l, .req_id = req_id, .region = r, .off = off, .len = len};
  serve_job(ctx, j);
}

void fr_ctx_serve_later_v(ferry_ctx *ctx, ferry_link *l, uint64_t req_id, fr_region *r,
                          fr_rma_run *runs, uint32_t nruns, uint64_t total) {
  fr_serve_job *j = malloc(sizeof *j);
  if (!j) {
    free(runs);
    fr_region_release(r);
    fr_link_fail(l, FERRY_ENOMEM, "cannot queue a read response");
    fr_link_unref(l);
    return;
  }
  *j = (fr_serve_job){
      .link = l, .req_id = req_id, .region = r, .len = total, .runs = runs, .nruns = nruns};
  serve_job(ctx, j);
}

static void serve_job(ferry_ctx *ctx, fr_serve_job *j) {
  pthread_mutex_lock(&ctx->serve_lock);
  if (ctx->serve_tail)
    ctx->serve_tail->next = j;
  else
    ctx->serve_head = j;
  ctx->serve_tail = j;
  pthread_cond_signal(&ctx->serve_cond);
  pthread_mutex_unlock(&ctx->serve_lock);
}

/* A peer asked for this ctx's metrics: the Prometheus text, or an empty reply when it cannot be
 * made (the asker then says the node's metrics are unknown). */
static void answer_stats(ferry_ctx *ctx, ferry_msg *req) {
  char *text = NULL;
  size_t len = 0;
  if (!stopping(ctx)) {
    if (ferry_stats_prometheus(ctx, &text, &len) != 0)
      len = 0;
    struct iovec iov = {text, len};
    fr_link_reply(req, &iov, 1, -1, false);
  }
  ferry_stats_text_free(text);
  ferry_msg_free(req);
}

static void *server_main(void *arg) {
  pthread_setname_np(pthread_self(), "ferry-server"); /* for top -H, perf, gdb */
  ferry_ctx *ctx = arg;
  for (;;) {
    pthread_mutex_lock(&ctx->serve_lock);
    while (!ctx->serve_head && !stopping(ctx))
      pthread_cond_wait(&ctx->serve_cond, &ctx->serve_lock);
    fr_serve_job *j = ctx->serve_head;
    if (j && !(ctx->serve_head = j->next))
      ctx->serve_tail = NULL;
    pthread_mutex_unlock(&ctx->serve_lock);
    if (!j)
      return NULL;
    if (j->stats) {
      answer_stats(ctx, j->stats);
      free(j);
      continue;
    }
    if (!stopping(ctx)) {
      fr_frame f = {.type = FR_READ_RESP, .req_id = j->req_id, .len = j->len};
      struct iovec iov[FR_READV_MAX_RUNS] = {{j->region->data + j->off, j->len}};
      for (uint32_t i = 0; i < j->nruns; i++)
        iov[i] = (struct iovec){j->region->data + j->runs[i].offset, j->runs[i].length};
      fr_link_send_frame(j->link, &f, iov, j->runs ? (int)j->nruns : 1, -1,
                         fr_deadline_ns(ctx->timeout_ms));
    }
    free(j->runs);
    fr_region_release(j->region);
    fr_link_unref(j->link);
    free(j);
  }
}

/* ---- the progress thread ---- */

void fr_ctx_bury(ferry_ctx *ctx, ferry_link *l) { ctx->grave[ctx->ngrave++] = l; }

static void on_wake(fr_poller *p, uint32_t events) {
  uint64_t v;
  if (read(p->fd, &v, sizeof v) < 0 && errno != EAGAIN)
    fr_warn("wake eventfd: %s", strerror(errno));
}

/* Out of descriptors (EMFILE, ENFILE), a connection stays pending and the level-triggered
 * listener reports it again at once: the leader spun on it and logged each time. As libuv does,
 * the process keeps one descriptor in reserve; it is given up to accept each pending connection
 * and close it at once (the peer sees the link closed and may retry), then taken back. The
 * warning is said at most once a second, with how many connections were turned away. */
static int spare_fd = -1;

static void spare_take(void) {
  int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  int none = -1;
  if (fd >= 0 &&
      !__atomic_compare_exchange_n(&spare_fd, &none, fd, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
    close(fd); /* another thread keeps one already */
}

static void refuse_pending(fr_listener *ls, int err) {
  static uint64_t last_warn_ns, refused;
  int spare = __atomic_exchange_n(&spare_fd, -1, __ATOMIC_ACQ_REL);
  if (spare >= 0)
    close(spare);
  for (int fd; (fd = accept4(ls->poller.fd, NULL, NULL, SOCK_CLOEXEC)) >= 0;) {
    close(fd);
    __atomic_add_fetch(&refused, 1, __ATOMIC_RELAXED);
  }
  spare_take();
  uint64_t now = fr_now_ns(), last = __atomic_load_n(&last_warn_ns, __ATOMIC_RELAXED);
  if (now - last < 1000000000ull ||
      !__atomic_compare_exchange_n(&last_warn_ns, &last, now, false, __ATOMIC_RELAXED,
                                   __ATOMIC_RELAXED))
    return;
  uint64_t n = __atomic_exchange_n(&refused, 0, __ATOMIC_RELAXED);
  fr_warn("%s listener: accept: %s: %llu connection%s closed unserved (raise `ulimit -n`)",
          ls->ops->name, strerror(err), (unsigned long long)n, n == 1 ? "" : "s");
}

static void on_accept(fr_poller *p, uint32_t events) {
  fr_listener *ls = (fr_listener *)p;
  for (;;) {
    int fd = accept4(p->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED)
        continue;
      if (errno == EMFILE || errno == ENFILE)
        refuse_pending(ls, errno);
      else if (errno != EAGAIN)
        fr_warn("%s listener: accept: %s", ls->ops->name, strerror(errno));
      return;
    }
    ferry_link *l = fr_link_new(ls->ctx, ls->ops, fd, true);
    if (!l) {
      close(fd);
      continue;
    }
    if (fr_link_start(l) != 0)
      fr_warn("%s listener: %s", ls->ops->name, ferry_last_error());
    fr_link_unref(l); /* the ctx holds it while it lives */
  }
}

#define FR_MAX_EVENTS 64
/* A caller's wait for the lead it asked a background leader for; background threads' grace
 * while callers lead. */
#define FOLLOW_NS 1000000ull
/* The progress thread's grace while callers lead: it checks this often whether they still do.
 * At 1 ms, its wake-ups (one per process per millisecond, each on the core the application's
 * other thread needed on the 2-core VM) were a good part of a 1 MiB stream's stalls. */
#define PROGRESS_GRACE_NS 4000000ull
/* A waiter that does not lead sleeps this long at most: whoever leads wakes it with its message,
 * and a leaving caller hands the epoll to the progress thread when waiters sleep. */
#define SLEEPER_SLICE_NS 100000000ull

static void wake_progress(ferry_ctx *ctx) {
  uint64_t one = 1;
  if (write(ctx->wake.fd, &one, sizeof one) < 0)
    fr_warn("wake eventfd: %s", strerror(errno));
}

/* One epoll_wait and its handlers, by the thread that holds ctx->lead; returns the events. */
static int run_batch(ferry_ctx *ctx, int timeout_ms) {
  struct epoll_event evs[FR_MAX_EVENTS];
  __atomic_store_n(&ctx->leader, (unsigned long)pthread_self(), __ATOMIC_RELAXED);
  int n = epoll_wait(ctx->epfd, evs, FR_MAX_EVENTS, timeout_ms);
  for (int i = 0; i < n; i++) {
    fr_poller *p = evs[i].data.ptr;
    if (p->on_event)
      p->on_event(p, evs[i].events);
  }
  for (size_t i = 0; i < ctx->ngrave; i++)
    fr_link_unref(ctx->grave[i]);
  ctx->ngrave = 0;
  if (fr_now_ns() > ctx->next_reap) {
    fr_link_reap_stale(ctx);
    fr_msg_keep_trim(fr_now_ns());
    ctx->next_reap = fr_now_ns() + 1000000000ull;
  }
  __atomic_store_n(&ctx->leader, 0, __ATOMIC_RELAXED);
  return n;
}

static bool leading(ferry_ctx *ctx) {
  return __atomic_load_n(&ctx->leader, __ATOMIC_RELAXED) == (unsigned long)pthread_self();
}

/* Seq_cst against lead(): the leader publishes what it waits for before it checks ready(), and
 * a deliverer queues before it reads that, so either the leader sees the message or is woken. */
void fr_ctx_poke(ferry_ctx *ctx, int what) {
  if (__atomic_load_n(&ctx->user_leading, __ATOMIC_SEQ_CST) && !leading(ctx) &&
      __atomic_load_n(&ctx->lead_waits_for, __ATOMIC_SEQ_CST) == what)
    wake_progress(ctx);
}

/* The progress thread stays out of the epoll while callers lead: while one leads now (however
 * long it has waited: a large message under load takes milliseconds), and for PROGRESS_GRACE_NS
 * after one last did. Were it to queue on the lead mutex behind a caller that leads for long, it
 * would take the epoll as that caller leaves, and the caller's next wait would cost two
 * hand-offs (asking it to step down, then the mutex). A caller that asked it to step down
 * counts as leading: were the progress thread to take the mutex straight back (glibc's mutex is
 * not fair, and the woken claimant needs a core first), it would spin lock/unlock for the
 * claimant's whole FOLLOW_NS while the claimant sleeps, then make it wait as a sleeper too (seen
 * as 1-4 ms stalls of 1 MiB shm ping-pongs on the 2-core VM). */
static bool caller_leads(ferry_ctx *ctx) { /* or is taking the lead over (take_from_background) */
  return __atomic_load_n(&ctx->user_leading, __ATOMIC_SEQ_CST) ||
         __atomic_load_n(&ctx->lead_claimed, __ATOMIC_SEQ_CST);
}

static void follow(ferry_ctx *ctx) {
  pthread_mutex_lock(&ctx->idle_lock);
  while (!stopping(ctx) && !ctx->lead_wanted) {
    uint64_t now = fr_now_ns();
    uint64_t until = __atomic_load_n(&ctx->user_led_ns, __ATOMIC_SEQ_CST) + PROGRESS_GRACE_NS;
    if (caller_leads(ctx) && until <= now)
      until = now + PROGRESS_GRACE_NS;
    else if (now >= until)
      break;
    struct timespec ts = fr_timespec(until);
    pthread_cond_timedwait(&ctx->idle_cond, &ctx->idle_lock, &ts);
  }
  ctx->lead_wanted = false;
  pthread_mutex_unlock(&ctx->idle_lock);
}

static void *progress_main(void *arg) {
  pthread_setname_np(pthread_self(), "ferry-progress"); /* for top -H, perf, gdb */
  ferry_ctx *ctx = arg;
  while (!stopping(ctx)) {
    if (ctx->users_may_lead)
      follow(ctx);
    pthread_mutex_lock(&ctx->lead);
    __atomic_store_n(&ctx->lead_background, true, __ATOMIC_RELEASE);
    if (!stopping(ctx) && !__atomic_load_n(&ctx->lead_claimed, __ATOMIC_ACQUIRE))
      run_batch(ctx, 1000);
    pthread_mutex_unlock(&ctx->lead);
  }
  return NULL;
}

static void hand_to_progress(ferry_ctx *ctx) {
  pthread_mutex_lock(&ctx->idle_lock);
  ctx->lead_wanted = true;
  pthread_cond_signal(&ctx->idle_cond);
  pthread_mutex_unlock(&ctx->idle_lock);
}

enum { LED, BUSY, NO_LEAD };

void fr_ctx_background_thread(void) { background_thread = true; }

/* A background leader's cue to leave the epoll to a caller. */
static bool claimed(ferry_ctx *ctx) {
  return background_thread && __atomic_load_n(&ctx->lead_claimed, __ATOMIC_ACQUIRE);
}

/* A leader polls the epoll without sleeping until FERRY_SPIN_US pass without an event: the
 * answer it waits for then finds it awake, which saves the wake-up a blocking wait pays on
 * every round trip (the difference between a tcp round trip and a plain blocking socket's).
 * While bytes keep flowing without being the whole answer (a large transfer arrives in pieces
 * of the socket buffer), each event starts the window again: the next piece comes within
 * microseconds, and sleeping between pieces cost a wake-up per piece, many per message. It
 * yields each round, so on a busy machine the threads it waits for get the core; when a yield
 * took long (another thread ran on this core, often the peer process it waits for), it stops
 * polling and sleeps: polling on a shared core only takes turns with that thread, a process
 * switch per round. */
#define SHARED_CORE_NS 20000ull /* a yield this long ran another thread on this core */

static void poll_briefly(ferry_ctx *ctx, bool (*ready)(void *), void *arg, uint64_t deadline_ns) {
  uint64_t window = (uint64_t)ctx->spin_us * 1000u;
  uint64_t end = fr_now_ns() + window;
  for (;;) { /* at least one batch: a zero timeout still takes in what the sockets hold */
    bool events = run_batch(ctx, 0) > 0;
    uint64_t now = fr_now_ns();
    if (events)
      end = now + window;
    if (ready(arg) || stopping(ctx) || now >= end || now >= deadline_ns || claimed(ctx))
      return;
    sched_yield();
    if (fr_now_ns() - now > SHARED_CORE_NS)
      return; /* another thread ran on this core: likely the one we wait for, so sleep */
  }
}

/* The lead held by a background thread or the progress thread: asks it to step down (its
 * epoll_wait returns at the wake-up) and takes the lead within FOLLOW_NS. */
static bool take_from_background(ferry_ctx *ctx) {
  if (!__atomic_load_n(&ctx->lead_background, __ATOMIC_ACQUIRE))
    return false;
  __atomic_store_n(&ctx->lead_claimed, true, __ATOMIC_RELEASE);
  wake_progress(ctx);
  bool got = fr_mutex_lock_until(&ctx->lead, fr_now_ns() + FOLLOW_NS) == 0;
  __atomic_store_n(&ctx->lead_claimed, false, __ATOMIC_RELEASE);
  return got;
}

/* When this caller led or wanted to: the progress thread follows every caller, background
 * threads follow the others. */
static void mark_led(ferry_ctx *ctx, bool bg) {
  uint64_t now = fr_now_ns();
  __atomic_store_n(&ctx->user_led_ns, now, __ATOMIC_SEQ_CST);
  if (!bg)
    __atomic_store_n(&ctx->fg_led_ns, now, __ATOMIC_SEQ_CST);
}

/* Leads the epoll until ready(arg) or the deadline. BUSY: another thread
 * leads, and the caller is counted among the sleepers until it calls back. */
static int lead(ferry_ctx *ctx, int waits_for, bool (*ready)(void *), void *arg,
                uint64_t deadline_ns) {
  if (!ctx->users_may_lead || stopping(ctx) || leading(ctx))
    return NO_LEAD;
  bool bg = background_thread;
  if (bg && (fr_now_ns() - __atomic_load_n(&ctx->fg_led_ns, __ATOMIC_SEQ_CST) < FOLLOW_NS ||
             __atomic_load_n(&ctx->lead_claimed, __ATOMIC_SEQ_CST)))
    return NO_LEAD; /* callers lead: they hand over what this thread waits for */
  __atomic_add_fetch(&ctx->sleepers, 1, __ATOMIC_SEQ_CST);
  if (pthread_mutex_trylock(&ctx->lead) != 0 && (bg || !take_from_background(ctx))) {
    mark_led(ctx, bg); /* the progress thread leaves the epoll to us after its current batch */
    return BUSY;
  }
  __atomic_store_n(&ctx->lead_background, bg, __ATOMIC_RELEASE);
  __atomic_sub_fetch(&ctx->sleepers, 1, __ATOMIC_SEQ_CST);
  mark_led(ctx, bg);
  __atomic_store_n(&ctx->lead_waits_for, waits_for, __ATOMIC_SEQ_CST);
  __atomic_store_n(&ctx->user_leading, true, __ATOMIC_SEQ_CST);
  if (!bg) /* background threads never poll without sleeping (see the top) */
    poll_briefly(ctx, ready, arg, deadline_ns);
  while (!ready(arg) && !stopping(ctx) && fr_now_ns() < deadline_ns && !claimed(ctx)) {
    int ms = fr_ms_left(deadline_ns);
    run_batch(ctx, ms < 1000 ? ms : 1000);
  }
  bool handed = claimed(ctx); /* the claimant leads next and wakes the sleepers */
  __atomic_store_n(&ctx->user_leading, false, __ATOMIC_SEQ_CST);
  pthread_mutex_unlock(&ctx->lead);
  mark_led(ctx, bg);
  if (!handed && __atomic_load_n(&ctx->sleepers, __ATOMIC_SEQ_CST) > 0)
    hand_to_progress(ctx); /* they sleep on the leader we were */
  return LED;
}

bool fr_ctx_wait(ferry_ctx *ctx, int waits_for, bool (*ready)(void *), void *arg,
                 pthread_mutex_t *mutex, pthread_cond_t *cond, uint64_t deadline_ns) {
  for (;;) {
    if (ready(arg))
      return true;
    if (fr_now_ns() >= deadline_ns)
      return false; /* a wait of 0 (a publish taking pool releases in) takes no lead over */
    int r = lead(ctx, waits_for, ready, arg, deadline_ns);
    if (r == LED && ready(arg))
      return true;
    uint64_t now = fr_now_ns();
    if (r != LED && now < deadline_ns) {
      /* Someone else leads and signals us (or hands the epoll on as it leaves). */
      uint64_t until = now + SLEEPER_SLICE_NS;
      until = until < deadline_ns ? until : deadline_ns;
      struct timespec ts = fr_timespec(until);
      pthread_mutex_lock(mutex);
      if (!ready(arg))
        pthread_cond_timedwait(cond, mutex, &ts);
      pthread_mutex_unlock(mutex);
      now = fr_now_ns();
    }
    if (r == BUSY)
      __atomic_sub_fetch(&ctx->sleepers, 1, __ATOMIC_SEQ_CST);
    if (now >= deadline_ns)
      return ready(arg);
  }
}

/* ---- open / close ---- */

static int parse_transports(ferry_ctx *ctx, const char *list) {
  char buf[128];
  snprintf(buf, sizeof buf, "%s", list);
  char *save = NULL;
  for (char *t = strtok_r(buf, ", ", &save); t; t = strtok_r(NULL, ", ", &save)) {
    const fr_transport_ops *ops = fr_transport_find(t);
    if (!ops)
      return fr_err(FERRY_EINVAL, "FERRY_TRANSPORTS: unknown transport '%s'", t);
    if (ctx->norder < FR_MAX_LISTENERS)
      ctx->order[ctx->norder++] = ops;
  }
  if (ctx->norder == 0)
    return fr_err(FERRY_EINVAL, "FERRY_TRANSPORTS: no transport in '%s'", list);
  ctx->users_may_lead = true;
  for (size_t i = 0; i < ctx->norder; i++)
    ctx->users_may_lead &= ctx->order[i]->any_thread_events;
  return 0;
}

static int add_poller(ferry_ctx *ctx, fr_poller *p) {
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = p};
  if (epoll_ctl(ctx->epfd, EPOLL_CTL_ADD, p->fd, &ev) < 0)
    return fr_err_errno(FERRY_ESYS, "epoll_ctl");
  return 0;
}

static int start_listeners(ferry_ctx *ctx) {
  size_t used = 0;
  for (size_t i = 0; i < ctx->norder; i++) {
    fr_listener *ls = &ctx->listeners[ctx->nlisteners];
    char url[160];
    int rc = ctx->order[i]->listen(ctx, &ls->poller.fd, url, sizeof url);
    if (rc != 0)
      return rc;
    ls->poller.on_event = on_accept;
    spare_take();
    ls->ctx = ctx;
    ls->ops = ctx->order[i];
    ctx->nlisteners++;
    if ((rc = add_poller(ctx, &ls->poller)) != 0)
      return rc;
    used += (size_t)snprintf(ctx->address + used, sizeof ctx->address - used, "%s%s",
                             used ? "," : "", url);
  }
  return 0;
}

static void fini_transports(ferry_ctx *ctx) {
  for (size_t i = 0; i < ctx->norder; i++)
    if (ctx->order[i]->ctx_fini)
      ctx->order[i]->ctx_fini(ctx);
}

static char *default_name(void) {
  char host[64] = "node", buf[96];
  gethostname(host, sizeof host - 1);
  snprintf(buf, sizeof buf, "%s-%d", host, (int)getpid());
  return strdup(buf);
}

static void ctx_init_sync(ferry_ctx *ctx) {
  pthread_mutex_init(&ctx->links_lock, NULL);
  pthread_mutex_init(&ctx->serve_lock, NULL);
  pthread_cond_init(&ctx->serve_cond, NULL);
  pthread_mutex_init(&ctx->lead, NULL);
  pthread_mutex_init(&ctx->idle_lock, NULL);
  fr_cond_init_monotonic(&ctx->idle_cond);
  for (int i = 0; i < FERRY_MAX_CHANNELS; i++) {
    pthread_mutex_init(&ctx->channels[i].lock, NULL);
    fr_cond_init_monotonic(&ctx->channels[i].cond);
  }
  fr_region_table_init(&ctx->regions);
  fr_stats_init(&ctx->stats);
}

/* FERRY_METRICS_LISTEN: a bad address fails the ctx (the operator asked for it); a port already
 * taken (a second ctx of this process) only warns, since the first one serves. */
static int start_metrics(ferry_ctx *ctx) {
  int rc = fr_stats_add(&ctx->stats, fr_link_stats_collect, NULL, ctx);
  const char *listen = fr_config_str("FERRY_METRICS_LISTEN");
  if (rc != 0 || !*listen)
    return rc;
  rc = ferry_metrics_serve(ctx, listen, &ctx->metrics);
  if (rc == FERRY_ESYS) {
    fr_warn("ctx '%s': %s; not serving metrics", ctx->name, ferry_last_error());
    rc = 0;
  }
  return rc;
}

/* The token the ctx's links prove: the caller's, else FERRY_TOKEN, else this user's secret. ""
 * counts as none given, so there is no way to turn authentication off: a ctx that passed "" to
 * mean "no token" still talks to every process of its user, and to nothing else. */
static int ctx_token(ferry_ctx *ctx, const ferry_ctx_opts *o) {
  const char *given = o && o->token && *o->token ? o->token : fr_config_str("FERRY_TOKEN");
  if (!*given)
    return fr_user_token(&ctx->token);
  ctx->token_explicit = true;
  ctx->token = strdup(given);
  return ctx->token ? 0 : fr_err(FERRY_ENOMEM, "ctx: token");
}

static int ctx_configure(ferry_ctx *ctx, const ferry_ctx_opts *o) {
  const char *name = o && o->name ? o->name : NULL;
  if (name && (strlen(name) == 0 || strlen(name) >= FR_NAME_BYTES))
    return fr_err(FERRY_EINVAL, "node name must be 1..%d bytes", FR_NAME_BYTES - 1);
  ctx->name = name ? strdup(name) : default_name();
  ctx->tcp_listen = strdup(o && o->tcp_listen ? o->tcp_listen : fr_config_str("FERRY_TCP_LISTEN"));
  ctx->max_payload = (uint64_t)fr_config_int("FERRY_MAX_MESSAGE");
  ctx->spin_us = (int)fr_config_int("FERRY_SPIN_US");
  ctx->timeout_ms = fr_timeout(-1);
  if (!ctx->name || !ctx->tcp_listen)
    return fr_err(FERRY_ENOMEM, "ctx: names");
  int rc = ctx_token(ctx, o);
  if (rc != 0)
    return rc;
  return parse_transports(ctx,
                          o && o->transports ? o->transports : fr_config_str("FERRY_TRANSPORTS"));
}

int ferry_ctx_open(const ferry_ctx_opts *opts, ferry_ctx **out) {
  if (!out)
    return fr_err(FERRY_EINVAL, "ferry_ctx_open: out is NULL");
  int rc = FR_OPTS_CHECK(opts, "ferry_ctx_open");
  if (rc != 0)
    return rc;
  ferry_ctx_opts o = {.size = sizeof o,
                      .name = FR_OPT(opts, name, NULL),
                      .tcp_listen = FR_OPT(opts, tcp_listen, NULL),
                      .transports = FR_OPT(opts, transports, NULL),
                      .token = FR_OPT(opts, token, NULL)};
  ferry_ctx *ctx = calloc(1, sizeof *ctx);
  if (!ctx)
    return fr_err(FERRY_ENOMEM, "ferry_ctx_open");
  ctx->epfd = ctx->wake.fd = -1;
  ctx->next_reap = fr_now_ns() + 1000000000ull;
  ctx_init_sync(ctx);
  rc = ctx_configure(ctx, &o);
  if (rc == 0) /* before the threads start, so that their lines carry it too */
    ctx->log_node = fr_log_set_node(ctx->name);
  if (rc == 0 && (ctx->epfd = epoll_create1(EPOLL_CLOEXEC)) < 0)
    rc = fr_err_errno(FERRY_ESYS, "epoll_create1");
  if (rc == 0 && (ctx->wake.fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
    rc = fr_err_errno(FERRY_ESYS, "eventfd");
  ctx->wake.on_event = on_wake;
  if (rc == 0)
    rc = add_poller(ctx, &ctx->wake);
  if (rc == 0)
    rc = start_listeners(ctx);
  if (rc == 0)
    rc = start_metrics(ctx);
  if (rc == 0 && pthread_create(&ctx->server, NULL, server_main, ctx) != 0)
    rc = fr_err(FERRY_ESYS, "cannot start the server thread");
  if (rc == 0 && pthread_create(&ctx->progress, NULL, progress_main, ctx) != 0) {
    ctx->stopping = true;
    pthread_cond_signal(&ctx->serve_cond);
    pthread_join(ctx->server, NULL);
    rc = fr_err(FERRY_ESYS, "cannot start the progress thread");
  }
  if (rc != 0) {
    int saved = rc;
    char detail[512];
    snprintf(detail, sizeof detail, "%s", ferry_last_error());
    for (size_t i = 0; i < ctx->nlisteners; i++)
      close(ctx->listeners[i].poller.fd);
    ctx->nlisteners = 0;
    fini_transports(ctx);
    if (ctx->epfd >= 0)
      close(ctx->epfd);
    if (ctx->wake.fd >= 0)
      close(ctx->wake.fd);
    fr_region_table_fini(&ctx->regions);
    ferry_metrics_server_close(ctx->metrics);
    fr_stats_fini(&ctx->stats);
    if (ctx->log_node)
      fr_log_set_node(NULL);
    free(ctx->name);
    free(ctx->token);
    free(ctx->tcp_listen);
    free(ctx);
    return fr_err(saved, "%s", detail);
  }
  fr_debug("ctx '%s' listening at %s", ctx->name, ctx->address);
  *out = ctx;
  return 0;
}

static void close_links(ferry_ctx *ctx) {
  pthread_mutex_lock(&ctx->links_lock);
  ferry_link *all = ctx->links;
  ctx->links = NULL;
  pthread_mutex_unlock(&ctx->links_lock);
  while (all) {
    ferry_link *next = all->next;
    fr_link_fail(all, FERRY_ECLOSED, "context closed");
    fr_link_unref(all);
    all = next;
  }
}

void ferry_ctx_close(ferry_ctx *ctx) {
  if (!ctx)
    return;
  ferry_metrics_server_close(ctx->metrics); /* its scrapes read the ctx */
  ctx->metrics = NULL;
  __atomic_store_n(&ctx->stopping, true, __ATOMIC_RELEASE);
  wake_progress(ctx);
  hand_to_progress(ctx);
  pthread_join(ctx->progress, NULL);
  for (size_t i = 0; i < ctx->ngrave; i++)
    fr_link_unref(ctx->grave[i]);
  pthread_mutex_lock(&ctx->serve_lock);
  pthread_cond_broadcast(&ctx->serve_cond);
  pthread_mutex_unlock(&ctx->serve_lock);
  pthread_join(ctx->server, NULL);
  close_links(ctx);
  for (int i = 0; i < FERRY_MAX_CHANNELS; i++) {
    fr_channel *c = &ctx->channels[i];
    pthread_mutex_lock(&c->lock);
    pthread_cond_broadcast(&c->cond);
    for (fr_msg_node *n = c->head, *next; n; n = next) {
      next = n->next;
      ferry_msg_free(&n->msg);
    }
    c->head = c->tail = NULL;
    pthread_mutex_unlock(&c->lock);
  }
  fini_transports(ctx);
  for (size_t i = 0; i < ctx->nlisteners; i++)
    close(ctx->listeners[i].poller.fd);
  close(ctx->epfd);
  close(ctx->wake.fd);
  fr_region_table_fini(&ctx->regions);
  fr_stats_fini(&ctx->stats);
  if (ctx->log_node)
    fr_log_set_node(NULL);
  free(ctx->name);
  free(ctx->token);
  free(ctx->tcp_listen);
  free(ctx);
}

const char *ferry_ctx_name(const ferry_ctx *ctx) { return ctx ? ctx->name : NULL; }
const char *ferry_ctx_address(const ferry_ctx *ctx) { return ctx ? ctx->address : NULL; }
