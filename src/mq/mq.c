/*
 * The mq handle: open and close, the background thread, and the pump.
 *
 * Everything an mq receives arrives on the context's FR_CHANNEL_MQ queue. One thread at a time
 * "pumps": takes a message off that queue and dispatches it (a message goes to the mq's own
 * queue; SUB, UNSUB, CREDIT and BYE change the publisher's or subscriber's state). Whichever
 * thread needs something to arrive pumps itself: an application thread waiting in recv, in a
 * publish short of credit or in wait_subscribers, so the thread that wants a message is the one
 * that spins on the shm ring for it (no hand-off, no wake-up). When no application thread has
 * pumped for a while, the background thread pumps instead, so that requests from new
 * subscribers and credit are answered while the application computes; it also renews the
 * node's directory lease and runs the callback, when one is installed.
 */
#include "mq/mq.h"
#include "core/channels.h"
#include "transport/ctxcalls.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The timing (settings, mq.h): waits re-check dead links every check_ns; the background thread
 * pumps after app_idle_ns (5 checks) without an application thread pumping, for half of that
 * at a time; a pending batch goes out after flush_ns at the latest. */
static uint64_t app_idle_ns(const ferry_mq *mq) { return mq->check_ns * 5; }

void fr_mq_detail(char *buf, size_t cap) { snprintf(buf, cap, "%s", ferry_last_error()); }

static void timed_wait(pthread_cond_t *c, ferry_mq *mq, uint64_t until_ns) {
  struct timespec ts = fr_timespec(until_ns);
  pthread_cond_timedwait(c, &mq->lock, &ts);
}

void fr_mq_keep_link(ferry_mq *mq, ferry_link *l) {
  for (size_t i = 0; i < mq->nlinks; i++)
    if (mq->links[i].link == l)
      return;
  if (FR_GROW(mq->links, mq->caplinks, mq->nlinks + 1, 8) != 0)
    return; /* the link still works; close just cannot say BYE on it */
  mq->links[mq->nlinks++] = (struct fr_mq_link){ferry_link_retain(l)};
}

/* ---- dispatch ---- */

static void reply_status(ferry_msg *m, int rc) {
  if (!ferry_msg_is_call(m))
    return;
  uint8_t b[4] = {(uint8_t)rc, (uint8_t)(rc >> 8), (uint8_t)(rc >> 16), (uint8_t)(rc >> 24)};
  struct iovec iov = {b, sizeof b};
  if (ferry_reply(m, &iov, 1, 2000) != 0)
    fr_debug("mq: reply to '%s' failed: %s", ferry_link_peer(m->link), ferry_last_error());
}

/* A peer's mq is closing: stop sending to it, forget what we owed it. */
static void on_bye(ferry_mq *mq, ferry_link *l) {
  pthread_mutex_lock(&mq->lock);
  fr_mq_peer *p = fr_mq_peer_by_link(mq, l);
  if (p)
    fr_mq_peer_drop(mq, p, NULL);
  for (fr_mq_session *s = mq->sessions; s; s = s->next)
    if (s->link == l)
      s->gone = true;
  pthread_cond_broadcast(&mq->cond);
  pthread_mutex_unlock(&mq->lock);
}

void fr_mq_dispatch(ferry_mq *mq, ferry_msg *m) {
  fr_mq_frame f;
  int rc = fr_mq_decode(m->data, m->len, &f);
  if (rc != 0) {
    pthread_mutex_lock(&mq->lock);
    mq->malformed++;
    pthread_mutex_unlock(&mq->lock);
    fr_warn_limited("mq '%s': dropped a frame from '%s': %s", mq->name, ferry_link_peer(m->link),
                    ferry_last_error());
    reply_status(m, rc);
    ferry_msg_free(m);
    return;
  }
  switch (f.type) {
  case FR_MQ_DATA:
  case FR_MQ_SHM:
    fr_mq_deliver(mq, m, &f); /* takes m */
    return;
  case FR_MQ_BATCH:
    fr_mq_deliver_batch(mq, m, &f); /* takes m */
    return;
  case FR_MQ_SUB:
    rc = fr_mq_add_subscriber(mq, f.topic, ferry_link_peer(m->link), m->link, f.value, 0);
    reply_status(m, rc);
    break;
  case FR_MQ_UNSUB:
    fr_mq_remove_subscriber(mq, f.topic, ferry_link_peer(m->link));
    break;
  case FR_MQ_CREDIT:
    fr_mq_on_credit(mq, m->link, &f);
    break;
  default: /* FR_MQ_BYE */
    on_bye(mq, m->link);
  }
  ferry_msg_free(m);
}

/* The mq whose background thread this is (NULL on any other thread): set by the thread itself,
 * so that telling it apart needs no field that the opening thread writes after starting it. */
static _Thread_local const ferry_mq *own_thread_of;

bool fr_mq_on_own_thread(const ferry_mq *mq) { return own_thread_of == mq; }

/* The mq's own thread pumps as an idle wait (it waits for requests all the time: an application
 * thread waiting for its message leads instead), an application thread as a caller. */
void fr_mq_pump(ferry_mq *mq, int ms) {
  ferry_msg *m = NULL;
  if (fr_mq_on_own_thread(mq)) {
    if (fr_ctx_await_idle(mq->ctx, FR_CHANNEL_MQ, ms) && (m = fr_ctx_take(mq->ctx, FR_CHANNEL_MQ)))
      fr_mq_dispatch(mq, m);
  } else if (ferry_recv(mq->ctx, FR_CHANNEL_MQ, &m, ms) == 0) {
    fr_mq_dispatch(mq, m);
  }
}

int fr_mq_wait(ferry_mq *mq, bool (*ready)(ferry_mq *, void *), void *arg, uint64_t deadline_ns) {
  bool tried = false;
  bool app = !fr_mq_on_own_thread(mq);
  for (;;) {
    if (ready(mq, arg))
      return 0;
    if (mq->closing)
      return FERRY_ECLOSED;
    uint64_t now = fr_now_ns();
    if (now >= deadline_ns && (tried || mq->pumping))
      return FERRY_ETIMEDOUT;
    uint64_t slice = now + mq->check_ns < deadline_ns ? now + mq->check_ns : deadline_ns;
    /* An application thread waiting counts as pumping even while it waits on the background
     * thread's pump: otherwise, once the background thread pumps, the application never does
     * again (it finds it pumping each time) and every message costs a hand-off. */
    if (app)
      mq->app_pump_ns = now;
    if (mq->pumping) {
      timed_wait(&mq->cond, mq, slice);
      continue;
    }
    mq->pumping = true;
    pthread_mutex_unlock(&mq->lock);
    fr_mq_pump(mq, fr_ms_left(slice));
    pthread_mutex_lock(&mq->lock);
    mq->pumping = false;
    tried = true;
    pthread_cond_broadcast(&mq->cond);
  }
}

/* ---- the background thread ---- */

static bool callback_ready(ferry_mq *mq, void *arg) {
  return mq->head || !mq->callback || mq->closing;
}

/* lock held; returns with it held. */
static void run_callback(ferry_mq *mq) {
  fr_mq_rmsg *r = mq->head;
  if (!(mq->head = r->next))
    mq->tail = NULL;
  mq->queued--;
  r->next = NULL;
  ferry_mq_fn fn = mq->callback;
  void *arg = mq->callback_arg;
  mq->in_callback = true;
  pthread_mutex_unlock(&mq->lock);
  fn(mq, &r->pub, arg);
  pthread_mutex_lock(&mq->lock);
  mq->in_callback = false;
  pthread_cond_broadcast(&mq->cond);
}

static void background_step(ferry_mq *mq, uint64_t now) {
  uint64_t renew = fr_dir_lease_next(&mq->lease);
  uint64_t until = now + app_idle_ns(mq) < renew ? now + app_idle_ns(mq) : renew;
  uint64_t batch = __atomic_load_n(&mq->batch_since_ns, __ATOMIC_ACQUIRE);
  if (batch && batch + mq->flush_ns <= now) {
    pthread_mutex_unlock(&mq->lock);
    fr_mq_flush(mq);
    pthread_mutex_lock(&mq->lock);
    if (__atomic_load_n(&mq->batch_since_ns, __ATOMIC_ACQUIRE) == batch)
      timed_wait(&mq->bg_cond, mq, now + mq->flush_ns); /* a publish holds it and sends it */
    return;
  }
  if (batch && batch + mq->flush_ns < until)
    until = batch + mq->flush_ns;
  if (mq->callback && mq->head) {
    run_callback(mq);
  } else if (mq->callback) {
    fr_mq_wait(mq, callback_ready, NULL, until);
  } else if (!mq->pumping && mq->waiters == 0 && now - mq->app_pump_ns > app_idle_ns(mq)) {
    mq->pumping = true;
    pthread_mutex_unlock(&mq->lock);
    fr_mq_pump(mq, (int)(app_idle_ns(mq) / 2000000));
    pthread_mutex_lock(&mq->lock);
    mq->pumping = false;
    pthread_cond_broadcast(&mq->cond);
  } else { /* its own condition: deliveries to the application do not wake it */
    timed_wait(&mq->bg_cond, mq, until);
  }
}

static void *background(void *arg) {
  pthread_setname_np(pthread_self(), "ferry-mq"); /* for top -H, perf, gdb */
  ferry_mq *mq = arg;
  own_thread_of = mq;
  pthread_mutex_lock(&mq->lock);
  while (!mq->closing) {
    uint64_t now = fr_now_ns();
    if (fr_dir_lease_due(&mq->lease)) {
      pthread_mutex_unlock(&mq->lock);
      fr_mq_renew(mq);
      pthread_mutex_lock(&mq->lock);
      continue;
    }
    background_step(mq, now);
  }
  pthread_mutex_unlock(&mq->lock);
  return NULL;
}

/* Another job of the context's node registered it again: the thread publishes our records
 * again (fr_dir_lease_due is then true). */
static void wake_background(void *arg) {
  ferry_mq *mq = arg;
  pthread_mutex_lock(&mq->lock);
  pthread_cond_signal(&mq->bg_cond);
  pthread_mutex_unlock(&mq->lock);
}

/* ---- open / close ---- */

/* A duration setting in nanoseconds, given its unit in them (1000: microseconds); at least 1. */
static uint64_t config_ns(const char *name, uint64_t unit) {
  int64_t v = fr_config_int(name);
  return v > 0 ? (uint64_t)v * unit : 1;
}

static ferry_mq *mq_new(ferry_ctx *ctx, const ferry_mq_opts *o) {
  ferry_mq *mq = calloc(1, sizeof *mq);
  if (!mq)
    return NULL;
  mq->ctx = ctx;
  snprintf(mq->name, sizeof mq->name, "%s", ferry_ctx_name(ctx));
  int64_t w = o->queue_bytes ? (int64_t)o->queue_bytes : fr_config_int("FERRY_MQ_QUEUE_BYTES");
  mq->window = w < 4096 ? 4096 : (uint64_t)w;
  int64_t inl = fr_config_int("FERRY_MQ_INLINE_BYTES");
  mq->inline_bytes = inl < 0 ? 0 : (uint64_t)inl;
  int64_t stall = fr_config_int("FERRY_MQ_STALL_LOG_MS");
  mq->stall_log_ns = (uint64_t)(stall < 0 ? 0 : stall) * 1000000ull;
  int64_t pool = fr_config_int("FERRY_MQ_POOL_BYTES");
  mq->pool_bytes = pool < 0 ? 0 : (uint64_t)pool;
  mq->flush_ns = config_ns("FERRY_MQ_FLUSH_US", 1000);
  mq->stream_gap_ns = config_ns("FERRY_MQ_STREAM_GAP_US", 1000);
  mq->warm_wait_ns = config_ns("FERRY_MQ_WARM_WAIT_US", 1000);
  mq->check_ns = config_ns("FERRY_MQ_CHECK_MS", 1000000);
  pthread_mutex_init(&mq->lock, NULL);
  pthread_mutex_init(&mq->publish_lock, NULL);
  fr_cond_init_monotonic(&mq->cond);
  fr_cond_init_monotonic(&mq->bg_cond);
  return mq;
}

static int mq_start(ferry_mq *mq, const ferry_mq_opts *o) {
  const char *name = ferry_ctx_name(mq->ctx);
  if (strlen(name) > FR_DIR_NAME_MAX)
    return fr_err(FERRY_EINVAL, "mq: node name '%s' is longer than %d bytes", name,
                  FR_DIR_NAME_MAX);
  int rc;
  if (o->flags & FERRY_MQ_HOST_DIRECTORY) {
    rc = fr_dir_host(mq->ctx, &mq->dir);
  } else {
    rc = fr_dir_open(mq->ctx, o->directory, fr_timeout(-1), &mq->dir);
  }
  if (rc == 0)
    fr_peers_init(&mq->dialled, mq->dir, mq->ctx);
  if (rc == 0) {
    char who[96];
    snprintf(who, sizeof who, "mq '%s'", name);
    rc = fr_dir_lease_init(&mq->lease, mq->dir, mq->ctx, "mq", name, who);
  }
  if (rc == 0) {
    if (o->lease_ms > 0)
      mq->lease.lease_ms = o->lease_ms;
    if (mq->lease.lease_ms < 300)
      mq->lease.lease_ms = 300;
    rc = fr_mq_register(mq, true, fr_timeout(-1));
  }
  if (rc == 0 && pthread_create(&mq->thread, NULL, background, mq) != 0)
    rc = fr_err(FERRY_ESYS, "mq: cannot start its thread");
  if (rc == 0) {
    mq->thread_started = true;
    fr_dir_lease_set_wake(&mq->lease, wake_background, mq); /* the lease leaves at close */
  }
  return rc;
}

int ferry_mq_open(ferry_ctx *ctx, const ferry_mq_opts *opts, ferry_mq **out) {
  if (!ctx || !out)
    return fr_err(FERRY_EINVAL, "ferry_mq_open: NULL argument");
  int rc = FR_OPTS_CHECK(opts, "ferry_mq_open");
  if (rc != 0)
    return rc;
  ferry_mq_opts o = {.size = sizeof o,
                     .directory = FR_OPT(opts, directory, NULL),
                     .queue_bytes = FR_OPT(opts, queue_bytes, 0),
                     .lease_ms = FR_OPT(opts, lease_ms, 0),
                     .flags = FR_OPT(opts, flags, 0)};
  ferry_mq *mq = mq_new(ctx, &o);
  if (!mq)
    return fr_err(FERRY_ENOMEM, "ferry_mq_open");
  rc = mq_start(mq, &o);
  if (rc == 0 && (rc = fr_mq_stats_start(mq)) != 0)
    fr_mq_stats_stop(mq);
  if (rc != 0) {
    char detail[512];
    fr_mq_detail(detail, sizeof detail);
    ferry_mq_close(mq);
    return fr_err(rc, "%s", detail);
  }
  *out = mq;
  return 0;
}

static void say_bye(ferry_mq *mq) {
  fr_mq_frame f = {.type = FR_MQ_BYE};
  uint8_t head[FR_MQ_HEAD_MAX];
  struct iovec iov = {head, fr_mq_encode(&f, head)};
  for (size_t i = 0; i < mq->nlinks; i++)
    if (ferry_link_status(mq->links[i].link) == 0)
      ferry_send(mq->links[i].link, FR_CHANNEL_MQ, &iov, 1, 500);
}

static void free_state(ferry_mq *mq) {
  for (fr_mq_rmsg *r = mq->head, *next; r; r = next) {
    next = r->next;
    fr_mq_session_unref(r->sess);
    if (!r->batch) {
      ferry_msg_free(r->raw);
      free(r);
    } else if (--r->batch->refs == 0) {
      ferry_msg_free(r->raw);
      free(r->batch);
    }
  }
  mq->head = mq->tail = NULL;
  while (mq->peers)
    fr_mq_peer_drop(mq, mq->peers, NULL);
  for (fr_mq_topic *t = mq->topics, *next; t; t = next) {
    next = t->next;
    free(t->name);
    free(t->subs);
    free(t);
  }
  for (fr_mq_session *s = mq->sessions, *next; s; s = next) {
    next = s->next;
    s->next = NULL;
    fr_mq_session_unref(s);
  }
  for (size_t i = 0; i < mq->nsubscribed; i++)
    free(mq->subscribed[i]);
  free(mq->subscribed);
  fr_mq_stats_free(mq);
}

void ferry_mq_close(ferry_mq *mq) {
  if (!mq)
    return;
  fr_mq_stats_stop(mq);
  pthread_mutex_lock(&mq->publish_lock);
  fr_mq_flush_locked(mq);
  pthread_mutex_unlock(&mq->publish_lock);
  pthread_mutex_lock(&mq->lock);
  mq->closing = true;
  pthread_cond_broadcast(&mq->cond);
  pthread_cond_signal(&mq->bg_cond);
  pthread_mutex_unlock(&mq->lock);
  if (mq->thread_started)
    pthread_join(mq->thread, NULL);
  say_bye(mq);
  if (mq->dir)
    fr_mq_unregister(mq);
  pthread_mutex_lock(&mq->lock);
  free_state(mq);
  pthread_mutex_unlock(&mq->lock);
  for (size_t i = 0; i < mq->nlinks; i++)
    ferry_link_release(mq->links[i].link);
  free(mq->links);
  fr_peers_close(&mq->dialled); /* closes the links this mq dialled */
  fr_mq_pool_fini(mq);
  fr_dir_close(mq->dir);
  pthread_mutex_destroy(&mq->lock);
  pthread_mutex_destroy(&mq->publish_lock);
  pthread_cond_destroy(&mq->cond);
  pthread_cond_destroy(&mq->bg_cond);
  free(mq);
}

int ferry_mq_set_callback(ferry_mq *mq, ferry_mq_fn fn, void *arg) {
  if (!mq)
    return fr_err(FERRY_EINVAL, "ferry_mq_set_callback: NULL mq");
  pthread_mutex_lock(&mq->lock);
  mq->callback = fn;
  mq->callback_arg = arg;
  pthread_cond_broadcast(&mq->cond);
  pthread_cond_signal(&mq->bg_cond);
  /* a call of the previous callback may be running: wait for it, unless it is the caller */
  bool own = fr_mq_on_own_thread(mq);
  while (mq->in_callback && !own)
    pthread_cond_wait(&mq->cond, &mq->lock);
  pthread_mutex_unlock(&mq->lock);
  return 0;
}
