/*
 * The mq handle: open and close, the dispatch of what arrives, the one wait, and the mq's
 * thread.
 *
 * The mq owns its context's FR_CHANNEL_MQ (fr_ctx_channel_open). Each frame is dispatched by
 * on_msg as it arrives, on whichever thread drives the context: the one leading its epoll, or
 * one spinning on its shm rings. A message goes straight onto the mq's queue, which
 * ferry_mq_recv takes from (queued once); CREDIT updates the publisher's state. Every one of
 * them wakes the waiters (fr_mq_changed). on_msg never blocks, so what may goes into an inbox
 * that the mq's thread serves in arrival order: SUB, UNSUB and BYE (SUB and BYE are calls it
 * answers; UNSUB must not overtake the SUB before it), a malformed call's answer, and data
 * whose publisher's pool must be mapped before it can be read (and the data behind it).
 *
 * Close sends what is batched, then says BYE to every peer still there and waits for the
 * answers before the links close (say_bye): a peer answers once everything before the BYE on
 * that link has reached its on_msg.
 *
 * Whoever waits (recv, a publish short of credit or pool room, wait_subscribers, a loan) waits
 * through the context's one wait (fr_mq_wait → fr_ctx_wait): a waiter that leads the epoll, or
 * spins on the shm rings before, dispatches the message it waits for itself (no hand-off, no
 * wake-up). A link that dies wakes the waiters too (on_link_down): a publish waiting for a
 * subscriber's credit needs no periodic check for its death.
 *
 * The mq's thread sleeps until it has something to do: a pending batch's flush deadline, a callback
 * to run (ferry_mq_set_callback, messages queued), credit on_msg could not send, or an inbox
 * message. It never drives the context itself.
 */
#include "mq/mq.h"
#include "core/channels.h"
#include "transport/linkcalls.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void fr_mq_keep_link(ferry_mq *mq, ferry_link *l) {
  for (size_t i = 0; i < mq->nlinks; i++)
    if (mq->links[i].link == l)
      return;
  if (FR_GROW(mq->links, mq->caplinks, mq->nlinks + 1, 8) != 0)
    return; /* the link still works; close just cannot say BYE on it */
  mq->links[mq->nlinks++] = (struct fr_mq_link){ferry_link_retain(l), false};
}

/* Whether this is the mq's thread (the job knows its thread by a thread-local it sets). */
static bool on_thread(const ferry_mq *mq) { return fr_job_on_thread(mq->job); }

/* ---- dispatch: on_msg (never blocks) and the inbox (the thread's) ---- */

static void reply_status(ferry_msg *m, int rc) {
  if (!ferry_msg_is_call(m))
    return;
  uint8_t b[4] = {(uint8_t)rc, (uint8_t)(rc >> 8), (uint8_t)(rc >> 16), (uint8_t)(rc >> 24)};
  struct iovec iov = {b, sizeof b};
  if (ferry_reply(m, &iov, 1, 2000) != 0)
    fr_debug("mq: reply to '%s' failed: %s", ferry_link_peer(m->link), ferry_last_error());
}

/* A peer's mq is closing: stop sending to it, forget what we owed it, and do not say BYE back
 * (it would wait for an answer nobody gives). */
static void on_bye(ferry_mq *mq, ferry_link *l) {
  pthread_mutex_lock(&mq->lock);
  for (size_t i = 0; i < mq->nlinks; i++)
    if (mq->links[i].link == l)
      mq->links[i].bye = true;
  fr_mq_peer *p = fr_mq_peer_by_link(mq, l);
  if (p)
    fr_mq_peer_drop(mq, p, NULL);
  for (fr_mq_session *s = mq->sessions; s; s = s->next)
    if (s->link == l)
      s->gone = true;
  fr_mq_changed(mq);
  pthread_mutex_unlock(&mq->lock);
}

/* Leaves m to the thread (takes it); `data`: a data frame, which later ones queue behind. */
static void to_thread(ferry_mq *mq, ferry_msg *m, bool data) {
  pthread_mutex_lock(&mq->lock);
  mq->deferred += data;
  fr_job_put(mq->job, m); /* wakes the thread */
  fr_mq_changed(mq);      /* the thread may wait in a callback's publish (fr_mq_wait serves it) */
  pthread_mutex_unlock(&mq->lock);
}

static void malformed(ferry_mq *mq, ferry_msg *m) {
  pthread_mutex_lock(&mq->lock);
  mq->malformed++;
  pthread_mutex_unlock(&mq->lock);
  fr_warn_limited("mq '%s': dropped a frame from '%s': %s", mq->name, ferry_link_peer(m->link),
                  ferry_last_error());
}

static void credit_due(ferry_mq *mq) {
  pthread_mutex_lock(&mq->lock);
  fr_mq_kick(mq);
  pthread_mutex_unlock(&mq->lock);
}

/* Where an SHM frame's payload lies in its publisher's pool, when that is mapped already (a
 * first view maps it, which asks the publisher: a call, for the thread). *payload NULL: lost. */
static bool view_now(ferry_mq *mq, ferry_msg *m, const fr_mq_frame *f, const void **payload) {
  *payload = f->payload;
  if (f->type != FR_MQ_SHM)
    return true;
  if (ferry_view_valid(m->link, &f->ref) != 0)
    return false;
  if (ferry_view(m->link, &f->ref, f->offset, f->len, payload) != 0) {
    fr_warn_limited("mq '%s': message %llu on '%s' from '%s' lost: %s", mq->name,
                    (unsigned long long)f->seq, f->topic, ferry_link_peer(m->link),
                    ferry_last_error());
    *payload = NULL;
  }
  return true;
}

/* A data frame on the thread: maps the pool if need be, then queues it. */
static void deliver_late(ferry_mq *mq, ferry_msg *m, const fr_mq_frame *f) {
  bool due = false;
  const void *payload = f->payload;
  if (f->type == FR_MQ_SHM && ferry_view(m->link, &f->ref, f->offset, f->len, &payload) != 0) {
    fr_warn_limited("mq '%s': message %llu on '%s' from '%s' lost: %s", mq->name,
                    (unsigned long long)f->seq, f->topic, ferry_link_peer(m->link),
                    ferry_last_error());
    payload = NULL;
  }
  if (f->type == FR_MQ_BATCH)
    due = fr_mq_deliver_batch(mq, m, f);
  else
    due = fr_mq_deliver(mq, m, f, payload);
  pthread_mutex_lock(&mq->lock);
  mq->deferred--; /* after it is queued: what on_msg queues next comes after it */
  pthread_mutex_unlock(&mq->lock);
  if (due)
    fr_mq_credit_send_due(mq);
}

/* A data frame in on_msg: queued now, unless it must wait for the thread. */
static void on_data(ferry_mq *mq, ferry_msg *m, const fr_mq_frame *f) {
  pthread_mutex_lock(&mq->lock);
  bool behind = mq->deferred > 0;
  pthread_mutex_unlock(&mq->lock); /* only on_msg adds to it, and on_msg runs one at a time */
  const void *payload = NULL;
  if (behind || !view_now(mq, m, f, &payload)) {
    to_thread(mq, m, true);
    return;
  }
  bool due =
      f->type == FR_MQ_BATCH ? fr_mq_deliver_batch(mq, m, f) : fr_mq_deliver(mq, m, f, payload);
  if (due)
    credit_due(mq);
}

/* The channel's on_msg: called with the channel's lock held, on whichever thread drives the
 * context. Takes m. */
static void on_msg(void *arg, ferry_link *link, ferry_msg *m) {
  ferry_mq *mq = arg;
  bool costly = strcmp(ferry_link_transport(link), "shm") != 0;
  if (__atomic_load_n(&mq->rx_costly, __ATOMIC_RELAXED) != costly)
    __atomic_store_n(&mq->rx_costly, costly, __ATOMIC_RELAXED);
  fr_mq_frame f;
  if (fr_mq_decode(m->data, m->len, &f) != 0) {
    malformed(mq, m);
    if (ferry_msg_is_call(m)) /* its answer may block: the thread's */
      to_thread(mq, m, false);
    else
      ferry_msg_free(m);
    return;
  }
  switch (f.type) {
  case FR_MQ_DATA:
  case FR_MQ_SHM:
  case FR_MQ_BATCH:
    on_data(mq, m, &f); /* takes m */
    return;
  case FR_MQ_CREDIT:
    fr_mq_on_credit(mq, link, &f);
    ferry_msg_free(m);
    return;
  default: /* SUB and BYE answer (calls), UNSUB may follow a SUB not served yet: the thread
            * applies all three in the order they came */
    to_thread(mq, m, false);
  }
}

/* A link died: a waiter whose readiness depends on that peer (credit from a subscriber, a count
 * of live subscribers) looks again. */
static void on_link_down(void *arg, ferry_link *link) {
  ferry_mq *mq = arg;
  pthread_mutex_lock(&mq->lock);
  fr_mq_changed(mq);
  pthread_mutex_unlock(&mq->lock);
}

static const fr_channel_ops mq_channel_ops = {.on_msg = on_msg, .on_link_down = on_link_down};

/* An inbox message, on the thread (takes m). */
static void serve(ferry_mq *mq, ferry_msg *m) {
  fr_mq_frame f;
  int rc = fr_mq_decode(m->data, m->len, &f);
  if (rc != 0) {
    reply_status(m, rc); /* counted and logged by on_msg */
    ferry_msg_free(m);
    return;
  }
  switch (f.type) {
  case FR_MQ_SUB:
    pthread_mutex_lock(&mq->lock);
    rc = mq->closing ? FERRY_ECLOSED : 0; /* served by close, after the thread */
    pthread_mutex_unlock(&mq->lock);
    if (rc == 0)
      rc = fr_mq_add_subscriber(mq, f.topic, ferry_link_peer(m->link), m->link, f.value, 0);
    reply_status(m, rc);
    break;
  case FR_MQ_UNSUB:
    fr_mq_remove_subscriber(mq, f.topic, ferry_link_peer(m->link));
    break;
  case FR_MQ_BYE: /* every frame before it on this link has been taken in: say so */
    on_bye(mq, m->link);
    reply_status(m, 0);
    break;
  default:                   /* data */
    deliver_late(mq, m, &f); /* takes m */
    return;
  }
  ferry_msg_free(m);
}

static void serve_inbox(ferry_mq *mq) {
  ferry_msg *m;
  while ((m = fr_job_take(mq->job)))
    serve(mq, m);
}

/* ---- the one wait ---- */

typedef struct mq_waiter {
  ferry_mq *mq;
  uint64_t events; /* mq->events when it looked last */
} mq_waiter;

/* Read without the lock, by the context's wait and spinners: any change wakes the waiter,
 * which looks at its own condition under the lock. Seq_cst against fr_mq_changed. */
static bool changed(void *arg) {
  mq_waiter *w = arg;
  return __atomic_load_n(&w->mq->events, __ATOMIC_SEQ_CST) != w->events;
}

int fr_mq_wait(ferry_mq *mq, bool (*ready)(ferry_mq *, void *), void *arg, uint64_t deadline_ns) {
  bool tried = false, thread = on_thread(mq);
  for (;;) {
    if (thread && fr_job_queued(mq->job)) {
      pthread_mutex_unlock(&mq->lock); /* in a callback: SUBs, maps, late data are this one's */
      serve_inbox(mq);
      pthread_mutex_lock(&mq->lock);
    }
    if (ready(mq, arg))
      return 0;
    if (mq->closing)
      return FERRY_ECLOSED;
    bool late = fr_now_ns() >= deadline_ns;
    if (late && tried)
      return FERRY_ETIMEDOUT;
    mq_waiter w = {mq, mq->events};
    pthread_mutex_unlock(&mq->lock);
    if (late) /* a wait of 0 still sees what is in the shm rings */
      fr_ctx_poll_links(mq->ctx);
    else if (__atomic_load_n(&mq->rx_costly, __ATOMIC_RELAXED) || /* its frames come over shm: */
             !fr_ctx_spin(mq->ctx, changed, &w))                  /* spin on the rings first */
      fr_ctx_wait(mq->ctx, FR_CHANNEL_MQ, changed, &w, &mq->lock, &mq->cond, deadline_ns);
    tried = true;
    pthread_mutex_lock(&mq->lock);
  }
}

/* ---- the mq's thread ---- */

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
  fr_mq_changed(mq);
}

/* A pending batch that is due (lock held; returns with it held). Returns when the thread should
 * look again: the batch's deadline, or a flush_ns later when a publish holds the batches (it
 * sends them, or they are due again then). */
static uint64_t batch_step(ferry_mq *mq, uint64_t now) {
  uint64_t since = __atomic_load_n(&mq->batch_since_ns, __ATOMIC_ACQUIRE);
  if (!since)
    return UINT64_MAX;
  if (since + mq->flush_ns > now)
    return since + mq->flush_ns;
  pthread_mutex_unlock(&mq->lock);
  fr_mq_flush(mq);
  pthread_mutex_lock(&mq->lock);
  return __atomic_load_n(&mq->batch_since_ns, __ATOMIC_ACQUIRE) == since ? now + mq->flush_ns : now;
}

/* One round of the thread's work (lock held; returns with it held): when it is next due. */
static uint64_t thread_step(ferry_mq *mq) {
  if (fr_job_queued(mq->job)) {
    pthread_mutex_unlock(&mq->lock);
    serve_inbox(mq);
    pthread_mutex_lock(&mq->lock);
  }
  pthread_mutex_unlock(&mq->lock);
  fr_mq_credit_send_due(mq);
  pthread_mutex_lock(&mq->lock);
  while (mq->callback && mq->head && !mq->closing)
    run_callback(mq);
  return batch_step(mq, fr_now_ns());
}

/* The job's callbacks (transport/job.h). The thread sleeps on its inbox's own condition, not in
 * the context's wait (`quiet`): it needs nothing from the epoll (on_msg hands it what it serves,
 * and fr_mq_kick wakes it). What is still queued at close is served after the channel closed
 * (`drain_at_stop`: a BYE sent as ours is answered). */
static void thread_msg(void *arg, ferry_msg *m) { serve(arg, m); }

static uint64_t thread_turn(void *arg) {
  ferry_mq *mq = arg;
  pthread_mutex_lock(&mq->lock);
  uint64_t next = thread_step(mq);
  if (mq->callback && mq->head && !mq->closing)
    next = 0; /* came while the callback ran: at once */
  pthread_mutex_unlock(&mq->lock);
  return next;
}

static const fr_job_ops thread_ops = {.on_msg = thread_msg,
                                      .on_timer = thread_turn,
                                      .channel = &mq_channel_ops,
                                      .quiet = true,
                                      .drain_at_stop = true};

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
  fr_str_copy(mq->name, sizeof mq->name, ferry_ctx_name(ctx));
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
  pthread_mutex_init(&mq->lock, NULL);
  pthread_mutex_init(&mq->publish_lock, NULL);
  fr_cond_init_monotonic(&mq->cond);
  return mq;
}

static int mq_start(ferry_mq *mq, const ferry_mq_opts *o) {
  const char *name = ferry_ctx_name(mq->ctx);
  if (strlen(name) > FR_DIR_NAME_MAX)
    return fr_err(FERRY_EINVAL, "mq: node name '%s' is longer than %d bytes", name,
                  FR_DIR_NAME_MAX);
  /* the mq's frames are its own from now on: a second mq on this ctx is FERRY_EBUSY */
  int rc = fr_job_open(mq->ctx, FR_CHANNEL_MQ, &thread_ops, mq, "ferry-mq", &mq->job);
  if (rc != 0)
    return rc == FERRY_EBUSY ? fr_err(rc, "mq: context '%s' has an mq already", name) : rc;
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
  if (rc == 0)
    rc = fr_job_run(mq->job);
  if (rc == 0) {
    mq->thread_started = true;
    fr_mq_republish_by_timer(mq, true); /* cleared at close */
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
    fr_err_keep keep;
    fr_err_save(&keep, rc);
    ferry_mq_close(mq);
    return fr_err_restore(&keep);
  }
  *out = mq;
  return 0;
}

/* Collects a BYE's answer (takes p). */
static void bye_answer(ferry_mq *mq, ferry_link *l, fr_pending *p, uint64_t deadline) {
  ferry_msg *reply = NULL;
  int rc = fr_link_call_collect(l, p, &reply, fr_ms_left(deadline));
  if (rc == FERRY_ETIMEDOUT) /* what we sent it last may not have arrived */
    fr_warn("mq '%s': '%s' did not answer our BYE: %s", mq->name, ferry_link_peer(l),
            ferry_last_error());
  else if (rc != 0) /* its link died: it is gone */
    fr_debug("mq '%s': BYE to '%s': %s", mq->name, ferry_link_peer(l), ferry_last_error());
  ferry_msg_free(reply);
}

/* Says BYE on every link whose peer is still there, as a call, and waits for the answers (at
 * most the context's timeout): a peer answers once it has taken in every frame sent before the
 * BYE on that link, so the links may close after. Closing at once lost frames: over shm and ucx
 * a link's end (its socket's) could reach the peer before what was sent ahead of it (in the
 * ring, in UCX), and the peer dropped the link with them unread. The transport now drains a
 * link after its end too, within bounds; the answer holds whatever they are. Runs while the
 * mq's thread still answers the BYEs of peers closing at the same time. */
static void say_bye(ferry_mq *mq) {
  fr_mq_frame f = {.type = FR_MQ_BYE};
  uint8_t head[FR_MQ_HEAD_MAX];
  struct iovec iov = {head, fr_mq_encode(&f, head)};
  /* one deadline for every post and answer: stopped peers cost close one timeout in all */
  uint64_t deadline = fr_deadline_ns(fr_timeout(-1));
  pthread_mutex_lock(&mq->lock); /* on_msg may add links (a session's) meanwhile */
  size_t n = 0;
  ferry_link **links = calloc(mq->nlinks ? mq->nlinks : 1, sizeof *links);
  for (size_t i = 0; links && i < mq->nlinks; i++)
    if (!mq->links[i].bye)
      links[n++] = ferry_link_retain(mq->links[i].link);
  pthread_mutex_unlock(&mq->lock);
  fr_pending **calls = calloc(n ? n : 1, sizeof *calls);
  for (size_t i = 0; calls && i < n; i++)
    if (ferry_link_status(links[i]) == 0 &&
        fr_link_call_post(links[i], FR_CHANNEL_MQ, &iov, 1, fr_ms_left(deadline), false,
                          &calls[i]) != 0) {
      fr_debug("mq '%s': BYE to '%s': %s", mq->name, ferry_link_peer(links[i]), ferry_last_error());
      calls[i] = NULL;
    }
  for (size_t i = 0; i < n; i++) {
    if (calls && calls[i])
      bye_answer(mq, links[i], calls[i], deadline);
    ferry_link_release(links[i]);
  }
  if (!links || !calls)
    fr_warn("mq '%s': out of memory saying BYE", mq->name);
  free(calls);
  free(links);
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
  if (mq->thread_started) /* after the batches, on their links; before the thread stops */
    say_bye(mq);
  pthread_mutex_lock(&mq->lock);
  mq->closing = true;
  fr_mq_changed(mq);
  pthread_mutex_unlock(&mq->lock);
  if (mq->thread_started)
    fr_mq_republish_by_timer(mq, false); /* before the job goes */
  /* the thread ends, the channel closes (no on_msg after this: the state below may go), and
   * what came after the thread stopped is served (a BYE sent as ours is answered) */
  fr_job_stop(mq->job);
  mq->job = NULL;
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
  free(mq);
}

int ferry_mq_set_callback(ferry_mq *mq, ferry_mq_fn fn, void *arg) {
  if (!mq)
    return fr_err(FERRY_EINVAL, "ferry_mq_set_callback: NULL mq");
  pthread_mutex_lock(&mq->lock);
  mq->callback = fn;
  mq->callback_arg = arg;
  fr_mq_changed(mq); /* a recv waiting returns FERRY_EBUSY */
  fr_mq_kick(mq);    /* messages queued already go to the callback */
  /* a call of the previous callback may be running: wait for it, unless it is the caller */
  bool own = on_thread(mq);
  while (mq->in_callback && !own)
    pthread_cond_wait(&mq->cond, &mq->lock);
  pthread_mutex_unlock(&mq->lock);
  return 0;
}
