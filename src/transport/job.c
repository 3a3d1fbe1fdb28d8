/*
 * The job runtime (job.h): one thread that owns a channel of its context and serves it, written
 * once for every service of the layers above. The thread sleeps on the channel's inbox until a
 * message, a wake (fr_job_wake), a link's death or the deadline its on_timer returned, then
 * hands what came to the job's callbacks. Stopping is one call that ends the thread, closes the
 * channel and frees the queue in that order (the order every service used to get right by
 * hand); a callback that stops its own job cannot join its own thread, so the job is marked and
 * the thread reaps it as its loop ends. A job of no channel (FR_JOB_NO_CHANNEL) is the same thread
 * and inbox with nothing opened or closed on the context: it always waits quietly.
 */
#include "transport/job.h"
#include "core/core.h"
#include "core/task.h"

#include <pthread.h>
#include <stdlib.h>

struct fr_job {
  ferry_ctx *ctx;
  uint32_t channel;
  const fr_job_ops *ops;
  void *arg;
  const char *name;
  fr_inbox inbox;
  pthread_t thread;
  bool running;   /* the thread was started (written before it starts, by the opener) */
  bool stop;      /* atomic: fr_job_stop asks the thread to end (then kicks the inbox) */
  bool reap;      /* stopped from its own thread: the thread frees the job (written there) */
  bool link_down; /* atomic: a link of the context died since the thread looked */
  unsigned wakes; /* atomic: fr_job_wake's bits not yet handed to on_wake */
};

/* The job whose thread this is (NULL on any other thread): set by the thread itself. */
static _Thread_local const fr_job *current;

/* A quiet job, or one of no channel, sleeps on its inbox's condition, never in the context's
 * wait (which waits for a channel's messages). */
static bool waits_quietly(const fr_job *j) {
  return j->ops->quiet || j->channel == FR_JOB_NO_CHANNEL;
}

/* Ends the thread's current or next wait. A quiet job's thread never leads the epoll: waking
 * it needs no poke of a leader (which, waiting for the same channel, would wake for nothing). */
static void kick(fr_job *j) {
  if (!waits_quietly(j)) {
    fr_inbox_kick(j->ctx, j->channel, &j->inbox);
    return;
  }
  pthread_mutex_lock(&j->inbox.lock);
  __atomic_store_n(&j->inbox.kicked, true, __ATOMIC_SEQ_CST);
  pthread_cond_broadcast(&j->inbox.cond);
  pthread_mutex_unlock(&j->inbox.lock);
}

/* ---- the channel: messages to the inbox, a link's death to the thread ---- */

static void job_on_msg(void *arg, ferry_link *link, ferry_msg *msg) {
  (void)link;
  fr_inbox_put(&((fr_job *)arg)->inbox, msg);
}

static void job_on_link_down(void *arg, ferry_link *link) {
  (void)link; /* any link: the thread is told that one died, not which (it may be gone by then) */
  fr_job *j = arg;
  if (!j->ops->on_link_down)
    return;
  __atomic_store_n(&j->link_down, true, __ATOMIC_SEQ_CST); /* before the kick: a wait that */
  kick(j);                                                 /* returns a message sees it too */
}

static const fr_channel_ops job_channel = {.on_msg = job_on_msg, .on_link_down = job_on_link_down};

/* ---- the thread ---- */

/* A quiet job's wait: on the inbox's own condition, never in the context's (job.h `quiet`). */
static bool sleep_quietly(fr_inbox *q, uint64_t deadline_ns) {
  struct timespec ts =
      fr_timespec(deadline_ns == UINT64_MAX ? fr_now_ns() + 3600000000000ull : deadline_ns);
  pthread_mutex_lock(&q->lock);
  if (!__atomic_load_n(&q->count, __ATOMIC_SEQ_CST) &&
      !__atomic_load_n(&q->kicked, __ATOMIC_SEQ_CST))
    pthread_cond_timedwait(&q->cond, &q->lock, &ts);
  __atomic_store_n(&q->kicked, false, __ATOMIC_SEQ_CST);
  pthread_mutex_unlock(&q->lock);
  return __atomic_load_n(&q->count, __ATOMIC_SEQ_CST) != 0;
}

/* Sleeps until something comes or the deadline; says whether a message is queued. A deadline
 * already past is not waited for (on_timer asked to look again at once). */
static bool wait_turn(fr_job *j, uint64_t deadline_ns) {
  if (deadline_ns <= fr_now_ns())
    return fr_job_queued(j);
  if (waits_quietly(j))
    return sleep_quietly(&j->inbox, deadline_ns);
  return fr_inbox_await(j->ctx, j->channel, &j->inbox, deadline_ns);
}

/* One turn's callbacks; says whether anything came (a message, a wake, a link's death). */
static bool serve_turn(fr_job *j, bool queued) {
  const fr_job_ops *o = j->ops;
  bool down = __atomic_load_n(&j->link_down, __ATOMIC_SEQ_CST) &&
              __atomic_exchange_n(&j->link_down, false, __ATOMIC_SEQ_CST);
  unsigned bits = __atomic_exchange_n(&j->wakes, 0, __ATOMIC_SEQ_CST);
  if (down)
    o->on_link_down(j->arg);
  if (bits && o->on_wake)
    o->on_wake(j->arg, bits);
  ferry_msg *m = queued && o->on_msg ? fr_inbox_take(&j->inbox) : NULL;
  if (m)
    o->on_msg(j->arg, m);
  return queued || down || bits;
}

static void job_free(fr_job *j);

static void *job_main(void *arg) {
  fr_job *j = arg;
  current = j;
  uint64_t deadline = j->ops->on_timer ? j->ops->on_timer(j->arg) : UINT64_MAX;
  while (!__atomic_load_n(&j->stop, __ATOMIC_SEQ_CST)) {
    bool waited = deadline > fr_now_ns();
    bool came = serve_turn(j, wait_turn(j, deadline));
    if (waited && !came && fr_ctx_closing(j->ctx))
      break; /* the context closes under the job: nothing more will come (it is still stopped) */
    deadline = j->ops->on_timer ? j->ops->on_timer(j->arg) : UINT64_MAX;
  }
  if (j->reap) { /* a callback stopped its own job: nobody joins this thread */
    pthread_detach(pthread_self());
    job_free(j);
  }
  current = NULL;
  return NULL;
}

/* ---- open, run, stop ---- */

int fr_job_open(ferry_ctx *ctx, uint32_t channel, const fr_job_ops *ops, void *arg,
                const char *name, fr_job **out) {
  fr_job *j = calloc(1, sizeof *j);
  if (!j)
    return fr_err(FERRY_ENOMEM, "job '%s'", name);
  *j = (fr_job){.ctx = ctx, .channel = channel, .ops = ops, .arg = arg, .name = name};
  fr_inbox_init(&j->inbox);
  *out = j; /* before the channel is ours: an owner's table may fr_job_put at once */
  if (channel == FR_JOB_NO_CHANNEL)
    return 0;
  const fr_channel_ops *ch = ops->channel ? ops->channel : &job_channel;
  int rc = fr_ctx_channel_open(ctx, channel, ch, ops->channel ? arg : j);
  if (rc != 0) {
    *out = NULL;
    fr_inbox_fini(&j->inbox);
    free(j);
  }
  return rc;
}

int fr_job_run(fr_job *j) {
  j->running = true; /* before the thread: it may stop itself at once */
  int rc = fr_thread_start(&j->thread, j->name, job_main, j, false);
  if (rc != 0)
    j->running = false;
  return rc;
}

int fr_job_start(ferry_ctx *ctx, uint32_t channel, const fr_job_ops *ops, void *arg,
                 const char *name, fr_job **out) {
  fr_job *j;
  int rc = fr_job_open(ctx, channel, ops, arg, name, &j);
  if (rc == 0 && (rc = fr_job_run(j)) != 0)
    fr_job_stop(j);
  if (rc == 0)
    *out = j;
  return rc;
}

void fr_job_wake(fr_job *j, unsigned bits) {
  if (bits)
    __atomic_or_fetch(&j->wakes, bits, __ATOMIC_SEQ_CST);
  kick(j);
}

void fr_job_put(fr_job *j, ferry_msg *msg) { fr_inbox_put(&j->inbox, msg); }

ferry_msg *fr_job_take(fr_job *j) { return fr_inbox_take(&j->inbox); }

bool fr_job_queued(const fr_job *j) { return __atomic_load_n(&j->inbox.count, __ATOMIC_SEQ_CST); }

bool fr_job_on_thread(const fr_job *j) { return j && current == j; }

/* After the thread: the channel closes (no callback of the owner runs after it), then what is
 * still queued is served (drain_at_stop) or freed (its callers time out). */
static void job_free(fr_job *j) {
  if (j->channel != FR_JOB_NO_CHANNEL)
    fr_ctx_channel_close(j->ctx, j->channel);
  for (ferry_msg *m; j->ops->drain_at_stop && j->ops->on_msg && (m = fr_inbox_take(&j->inbox));)
    j->ops->on_msg(j->arg, m);
  fr_inbox_fini(&j->inbox);
  if (j->reap && j->ops->on_reap)
    j->ops->on_reap(j->arg);
  free(j);
}

bool fr_job_stop(fr_job *j) {
  if (!j)
    return true;
  __atomic_store_n(&j->stop, true, __ATOMIC_SEQ_CST); /* then the kick: the wait sees it */
  if (j->running && current == j) {
    j->reap = true; /* read by this same thread as its loop ends */
    return false;
  }
  if (j->running) {
    kick(j);
    pthread_join(j->thread, NULL);
  }
  job_free(j);
  return true;
}
