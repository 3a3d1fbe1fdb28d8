/*
 * Who drives a context: its progress thread, which runs every link's receive state machine
 * while no other thread does, or a caller that takes that role over while it waits.
 *
 * Two epolls. The ctx's own (ctx->epfd: every link, listener and the wake eventfd) is led by
 * one thread at a time, holding ctx->lead, which waits in it and runs the handlers. The
 * progress thread sleeps in a second one (ctx->outer_epfd) that holds the ctx's epoll itself
 * (nested: readable when one of its fds is) and a stop eventfd. A thread that leads takes the
 * ctx's epoll out of the outer one (EPOLL_CTL_MOD with no events: the sleeping progress thread
 * is not woken) and puts it back as it leaves (EPOLL_CTL_MOD with EPOLLIN: the progress thread
 * wakes then only if something arrived meanwhile that nobody handled). So a caller about to
 * sleep on its own response or message leads without asking anyone to step down, the bytes it
 * waits for wake it directly, and a round trip costs one wake-up per side, as a blocking socket
 * does: two epoll_ctl (about a microsecond) where handing the lead over cost two wake-ups in
 * series (~20 us each after a pause), and the progress thread needs no grace timer nor a
 * nudge, since it never holds the lead while it sleeps. It wakes only for what arrives while
 * nobody leads, and takes the lead for one batch then (an epoll_wait that does not sleep).
 * A leader polls without sleeping while events keep coming (a large tcp message arrives in
 * many socket-buffer pieces), and sleeps in the epoll after FERRY_SPIN_US without one, or as
 * soon as one of its yields (core/spin.c) lets another thread run on its core.
 *
 * Two kinds of wait, told apart by the call, not by the thread: a caller's (fr_ctx_wait: an
 * answer, a message it asked for) and an idle one (fr_ctx_wait_idle: a service loop waiting for
 * requests all the time, such as the embedded directory's, through its inbox). An idle wait
 * leads only when no caller has lately, and never polls without sleeping: on a small machine
 * that takes the core an application thread needs (a publisher's directory thread polling after
 * each of its subscriber's releases halved the subscriber's share of its core, in 5 us turns).
 * A caller that finds the epoll led by an idle wait (or the progress thread in a batch) asks it
 * to step down and takes over, so that the message it waits for wakes it rather than being
 * handed over by another thread. A caller that finds another caller leading sleeps on its
 * condition: whoever leads next, or the progress thread once nobody does, signals it.
 * The same service thread, once it serves a request, waits for the answers it needs as a
 * caller does.
 */
#include "transport/ctx_impl.h"

#include <errno.h>
#include <sched.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

void fr_ctx_bury(ferry_ctx *ctx, ferry_link *l) { ctx->grave[ctx->ngrave++] = l; }

void fr_ctx_on_wake(fr_poller *p, uint32_t events) {
  uint64_t v;
  if (read(p->fd, &v, sizeof v) < 0 && errno != EAGAIN)
    fr_warn("wake eventfd: %s", strerror(errno));
}

#define FR_MAX_EVENTS 64
/* The timing of leadership, settings read when the ctx opens (config.c, struct ferry_ctx):
 * - follow_ns (FERRY_LEAD_FOLLOW_US): a caller's wait for the lead it asked an idle leader
 *   for; how long idle waits leave the epoll to callers after one led.
 * - sleeper_slice_ns (FERRY_SLEEPER_SLICE_MS): a caller that does not lead sleeps this long at
 *   most before it looks again: whoever leads, or the progress thread, wakes it with its
 *   message; the slice only bounds a wake-up that went wrong. */

void fr_ctx_wake_progress(ferry_ctx *ctx) {
  uint64_t one = 1;
  if (write(ctx->wake.fd, &one, sizeof one) < 0)
    fr_warn("wake eventfd: %s", strerror(errno));
}

void fr_ctx_stop_progress(ferry_ctx *ctx) {
  uint64_t one = 1;
  fr_ctx_wake_progress(ctx); /* where the progress thread leads the ctx's epoll itself (ucx) */
  if (write(ctx->outer_wake, &one, sizeof one) < 0)
    fr_warn("progress stop eventfd: %s", strerror(errno));
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
    fr_ctx_wake_progress(ctx);
}

/* Lends the ctx's epoll to the progress thread's (events EPOLLIN: it wakes when one of the
 * ctx's fds is ready, at once if one is now) or takes it back (no events: it sleeps on). A
 * failure (no memory in the kernel) is only logged: the sleeper slices and the progress
 * thread's timeout bound what it costs. */
static void lend_epoll(ferry_ctx *ctx, bool lend) {
  struct epoll_event ev = {.events = lend ? EPOLLIN : 0, .data.u64 = 0};
  if (epoll_ctl(ctx->outer_epfd, EPOLL_CTL_MOD, ctx->epfd, &ev) < 0)
    fr_warn_limited("epoll_ctl (progress epoll): %s", strerror(errno));
}

/* The progress thread where callers may lead: sleeps in the outer epoll, and runs one batch
 * (without sleeping in it) each time the ctx's epoll has something nobody handled. The timeout
 * only lets it reap handshakes that never finished (run_batch) on an otherwise quiet node.
 * Finding the lead taken, it looks again after a yield: the holder is between taking the lead
 * and taking the epoll out of this one (then this thread sleeps in it next), or between putting
 * it back and letting go (then the next try takes the lead). Waiting for the mutex instead
 * made each such race cost the next caller a hand-off, and that caller's lead the next race:
 * back to back, half the round trips paid it. Should the epoll stay lent under a leader all the
 * same (its epoll_ctl failed), it waits for the mutex after a few tries rather than spin. */
static void progress_loop(ferry_ctx *ctx) {
  int busy = 0;
  while (!fr_ctx_stopping(ctx)) {
    struct epoll_event evs[2];
    int n = epoll_wait(ctx->outer_epfd, evs, 2, busy ? 0 : 1000);
    if (fr_ctx_stopping(ctx))
      return;
    bool work = false, reap = n == 0 && !busy;
    for (int i = 0; i < n; i++)
      work |= evs[i].data.u64 == 0;
    if (!work && !reap) {
      busy = 0; /* the leader took the epoll out: sleep */
      continue;
    }
    if (pthread_mutex_trylock(&ctx->lead) != 0) {
      if (reap)
        continue;
      if (++busy <= 64) {
        sched_yield();
        continue;
      }
      pthread_mutex_lock(&ctx->lead);
    }
    busy = 0;
    __atomic_store_n(&ctx->lead_brief, true, __ATOMIC_RELEASE);
    if (!fr_ctx_stopping(ctx))
      run_batch(ctx, 0);
    __atomic_store_n(&ctx->lead_brief, false, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&ctx->lead);
  }
}

void *fr_ctx_progress_main(void *arg) {
  ferry_ctx *ctx = arg;
  if (ctx->users_may_lead) {
    progress_loop(ctx);
    return NULL;
  }
  __atomic_store_n(&ctx->lead_idle, true, __ATOMIC_RELEASE); /* nobody else leads (ucx) */
  while (!fr_ctx_stopping(ctx)) {
    pthread_mutex_lock(&ctx->lead);
    if (!fr_ctx_stopping(ctx))
      run_batch(ctx, 1000);
    pthread_mutex_unlock(&ctx->lead);
  }
  return NULL;
}

enum { LED, BUSY, NO_LEAD };

/* An idle leader's cue to leave the epoll to a caller. */
static bool claimed(ferry_ctx *ctx, bool idle) {
  return idle && __atomic_load_n(&ctx->lead_claimed, __ATOMIC_ACQUIRE);
}

/* A leader polls the epoll without sleeping until FERRY_SPIN_US pass without an event: the
 * answer it waits for then finds it awake, which saves the wake-up a blocking wait pays on
 * every round trip (the difference between a tcp round trip and a plain blocking socket's).
 * While bytes keep flowing without being the whole answer (a large transfer arrives in pieces
 * of the socket buffer), each event starts the window again: the next piece comes within
 * microseconds, and sleeping between pieces cost a wake-up per piece, many per message. It
 * yields between polls (core/spin.c), so on a busy machine the threads it waits for get the core;
 * when a yield took long (FERRY_SHARED_CORE_US: another thread ran on this core, often the peer
 * process it waits for), it stops polling and sleeps: polling on a shared core only takes turns
 * with that thread, a process switch per round. */

static void poll_briefly(ferry_ctx *ctx, bool (*ready)(void *), void *arg, uint64_t deadline_ns) {
  uint64_t window = (uint64_t)ctx->spin_us * 1000u;
  fr_spin spin;
  fr_spin_begin(&spin, window);
  for (;;) { /* at least one batch: a zero timeout still takes in what the sockets hold */
    if (run_batch(ctx, 0) > 0)
      spin.end = fr_now_ns() + window;
    spin.end = spin.end < deadline_ns ? spin.end : deadline_ns;
    if (ready(arg) || fr_ctx_stopping(ctx) || !fr_spin_pause(&spin))
      return;
    if (spin.yield_ns > ctx->shared_core_ns)
      return; /* another thread ran on this core: likely the one we wait for, so sleep */
  }
}

/* The lead held by an idle wait or the progress thread: asks it to step down (an idle wait's
 * epoll_wait returns at the wake-up; the progress thread's batch does not sleep, so it is only
 * waited for) and takes the lead within follow_ns. */
static bool take_from_idle(ferry_ctx *ctx) {
  bool brief = __atomic_load_n(&ctx->lead_brief, __ATOMIC_ACQUIRE);
  if (!brief && !__atomic_load_n(&ctx->lead_idle, __ATOMIC_ACQUIRE))
    return false;
  __atomic_store_n(&ctx->lead_claimed, true, __ATOMIC_RELEASE);
  if (!brief)
    fr_ctx_wake_progress(ctx);
  bool got = fr_mutex_lock_until(&ctx->lead, fr_now_ns() + ctx->follow_ns) == 0;
  __atomic_store_n(&ctx->lead_claimed, false, __ATOMIC_RELEASE);
  return got;
}

/* The ctx whose lead this thread took before sending its request (fr_ctx_lead_early). */
static _Thread_local ferry_ctx *early_lead;

bool fr_ctx_lead_early(ferry_ctx *ctx) {
  if (!ctx->users_may_lead || fr_ctx_stopping(ctx) || leading(ctx) || early_lead ||
      pthread_mutex_trylock(&ctx->lead) != 0)
    return false;
  __atomic_store_n(&ctx->lead_idle, false, __ATOMIC_RELEASE);
  lend_epoll(ctx, false);
  early_lead = ctx;
  return true;
}

void fr_ctx_lead_early_end(ferry_ctx *ctx) {
  if (early_lead != ctx)
    return;
  early_lead = NULL;
  lend_epoll(ctx, true);
  pthread_mutex_unlock(&ctx->lead);
}

void fr_ctx_lead_early_drop(void) {
  if (early_lead)
    fr_ctx_lead_early_end(early_lead);
}

/* When a caller (not an idle wait) last led or wanted to: idle waits leave the epoll to callers
 * for follow_ns after that. */
static void mark_caller(ferry_ctx *ctx, bool idle) {
  if (!idle)
    __atomic_store_n(&ctx->caller_led_ns, fr_now_ns(), __ATOMIC_SEQ_CST);
}

/* Leads the ctx's epoll until ready(arg) or the deadline, with it taken out of the progress
 * thread's for that time (lend_epoll). BUSY: another caller leads; it (or the progress thread
 * once nobody leads) signals the caller's condition. */
static int lead(ferry_ctx *ctx, bool idle, int waits_for, bool (*ready)(void *), void *arg,
                uint64_t deadline_ns) {
  if (!ctx->users_may_lead || fr_ctx_stopping(ctx) || leading(ctx)) {
    fr_ctx_lead_early_end(ctx); /* a wait that cannot lead must not keep the epoll from others */
    return NO_LEAD;
  }
  if (idle &&
      (fr_now_ns() - __atomic_load_n(&ctx->caller_led_ns, __ATOMIC_SEQ_CST) < ctx->follow_ns ||
       __atomic_load_n(&ctx->lead_claimed, __ATOMIC_SEQ_CST)))
    return NO_LEAD; /* callers lead: they hand over what this thread waits for */
  mark_caller(ctx, idle);
  bool early = !idle && early_lead == ctx; /* taken before the request went out */
  if (!early && pthread_mutex_trylock(&ctx->lead) != 0 && (idle || !take_from_idle(ctx)))
    return BUSY;
  early_lead = early ? NULL : early_lead;
  __atomic_store_n(&ctx->lead_idle, idle, __ATOMIC_RELEASE);
  __atomic_store_n(&ctx->lead_waits_for, waits_for, __ATOMIC_SEQ_CST);
  __atomic_store_n(&ctx->user_leading, true, __ATOMIC_SEQ_CST);
  if (!early)
    lend_epoll(ctx, false);
  if (!idle) /* idle waits never poll without sleeping (see the top) */
    poll_briefly(ctx, ready, arg, deadline_ns);
  while (!ready(arg) && !fr_ctx_stopping(ctx) && fr_now_ns() < deadline_ns && !claimed(ctx, idle)) {
    int ms = fr_ms_left(deadline_ns);
    run_batch(ctx, ms < 1000 ? ms : 1000);
  }
  __atomic_store_n(&ctx->user_leading, false, __ATOMIC_SEQ_CST);
  __atomic_store_n(&ctx->lead_idle, false, __ATOMIC_RELEASE); /* nobody to claim it from now */
  lend_epoll(ctx, true); /* wakes the progress thread if something came meanwhile */
  pthread_mutex_unlock(&ctx->lead);
  mark_caller(ctx, idle);
  return LED;
}

static bool wait_as(ferry_ctx *ctx, bool idle, int waits_for, bool (*ready)(void *), void *arg,
                    pthread_mutex_t *mutex, pthread_cond_t *cond, uint64_t deadline_ns) {
  for (;;) {
    if (ready(arg))
      return true;
    if (fr_now_ns() >= deadline_ns)
      return false; /* a wait of 0 (a publish taking pool releases in) takes no lead over */
    int r = lead(ctx, idle, waits_for, ready, arg, deadline_ns);
    if (r == LED && ready(arg))
      return true;
    uint64_t now = fr_now_ns();
    if (r != LED && now < deadline_ns) {
      /* Someone else leads and signals us, or the progress thread does once nobody leads. An
       * idle wait is for its channel's messages, which whoever drives the links signals, and
       * where callers never lead (ucx) the progress thread always does: no slice. */
      bool no_slice = idle || !ctx->users_may_lead;
      uint64_t until = no_slice ? deadline_ns : now + ctx->sleeper_slice_ns;
      until = until < deadline_ns ? until : deadline_ns;
      struct timespec ts = fr_timespec(until);
      pthread_mutex_lock(mutex);
      if (!ready(arg))
        pthread_cond_timedwait(cond, mutex, &ts);
      pthread_mutex_unlock(mutex);
      now = fr_now_ns();
    }
    if (now >= deadline_ns)
      return ready(arg);
  }
}

bool fr_ctx_wait(ferry_ctx *ctx, int waits_for, bool (*ready)(void *), void *arg,
                 pthread_mutex_t *mutex, pthread_cond_t *cond, uint64_t deadline_ns) {
  return wait_as(ctx, false, waits_for, ready, arg, mutex, cond, deadline_ns);
}

bool fr_ctx_wait_idle(ferry_ctx *ctx, int waits_for, bool (*ready)(void *), void *arg,
                      pthread_mutex_t *mutex, pthread_cond_t *cond, uint64_t deadline_ns) {
  return wait_as(ctx, true, waits_for, ready, arg, mutex, cond, deadline_ns);
}
