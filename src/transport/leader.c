/*
 * Who drives a context: its progress thread, which waits in the ctx's epoll and runs every
 * link's receive state machine, or a caller that takes that role over while it waits.
 *
 * Leading: one thread at a time waits in the ctx's epoll and runs the handlers. A caller about
 * to sleep on its own response or message takes that role itself when it can (and the ctx's
 * transports allow it), so the bytes it waits for wake it directly: a round trip then costs one
 * wake-up per side, as a blocking socket does, instead of the progress thread's plus a hand-off.
 * While callers keep leading, the progress thread sleeps; it takes the epoll back when no caller
 * leads and none has for its grace (FERRY_PROGRESS_GRACE_US), or at once when a leaving caller
 * leaves others asleep behind it. A leader polls without sleeping while events keep coming (a large
 * tcp message arrives in many socket-buffer pieces), and sleeps in the epoll after FERRY_SPIN_US
 * without one, or as soon as its yield lets another thread run on its core.
 *
 * Two kinds of wait, told apart by the call, not by the thread: a caller's (fr_ctx_wait: an
 * answer, a message it asked for) and an idle one (fr_ctx_wait_idle: a service loop waiting for
 * requests all the time, such as the embedded directory's, through its inbox). An idle wait
 * leads only as the progress thread does, and never polls without sleeping: on a small machine
 * that takes the core an application thread needs (a publisher's directory thread polling after
 * each of its subscriber's releases halved the subscriber's share of its core, in 5 us turns).
 * A caller that finds the epoll led by an idle wait (or by the progress thread) asks it to step
 * down and takes over, so that the message it waits for wakes it rather than being handed over
 * by another thread. While the lead is held past the grace (an idle wait, or a caller blocked
 * in a long wait), the progress thread sleeps without a deadline until it is left (the leaver
 * nudges it then), and an idle wait that finds another leading sleeps until its message comes:
 * a node whose threads all wait sleeps.
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
 *   for; idle waits' grace while callers lead.
 * - grace_ns (FERRY_PROGRESS_GRACE_US): the progress thread's grace while callers lead:
 *   it checks this often whether they still do. Each check is a wake-up on a core that an
 *   application thread may need: at 1 ms they were a good part of a 1 MiB stream's stalls when
 *   the machine had no core to spare.
 * - sleeper_slice_ns (FERRY_SLEEPER_SLICE_MS): a caller that does not lead sleeps this long at
 *   most: whoever leads wakes it with its message, and a leaving caller hands the epoll to the
 *   progress thread when callers sleep; the slice only bounds a hand-off that went wrong. */

void fr_ctx_wake_progress(ferry_ctx *ctx) {
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
    fr_ctx_wake_progress(ctx);
}

/* The progress thread stays out of the epoll while callers lead: while one leads now (however
 * long it has waited: a large message under load takes milliseconds), and for grace_ns
 * after one last did. Were it to queue on the lead mutex behind a caller that leads for long, it
 * would take the epoll as that caller leaves, and the caller's next wait would cost two
 * hand-offs (asking it to step down, then the mutex). A caller that asked it to step down
 * counts as leading: were the progress thread to take the mutex straight back (glibc's mutex is
 * not fair, and the woken claimant needs a core first), it would spin lock/unlock for the
 * claimant's whole follow_ns while the claimant sleeps, then make it wait as a sleeper too (seen
 * as 1-4 ms stalls of 1 MiB shm ping-pongs on a machine with no core to spare). */
static bool caller_leads(ferry_ctx *ctx) { /* or is taking the lead over (take_from_idle) */
  return __atomic_load_n(&ctx->user_leading, __ATOMIC_SEQ_CST) ||
         __atomic_load_n(&ctx->lead_claimed, __ATOMIC_SEQ_CST);
}

/* The lead has been held past the grace without a claim pending: by an idle wait (a service
 * loop waiting for requests) or by a caller blocked in its wait (an application thread in a long
 * ferry_recv). The progress thread then parks without a deadline, and whoever leaves the lead
 * nudges it (the end of lead()): checking every grace_ns made an idle node wake hundreds of times a
 * second, and a process with a thread blocked in recv 250 times. Callers that lead back to back
 * (each for microseconds) never hold it that long, so they never pay the nudge. */
static bool lead_held_long(ferry_ctx *ctx, uint64_t until, uint64_t now) {
  return until <= now && __atomic_load_n(&ctx->user_leading, __ATOMIC_SEQ_CST) &&
         !__atomic_load_n(&ctx->lead_claimed, __ATOMIC_SEQ_CST);
}

/* idle_lock held. Parked is published before the lead is looked at again, and a leaver clears
 * user_leading before it looks at parked (both seq_cst): one of the two sees the other's store,
 * and the nudge, under idle_lock, cannot fall between the check and the wait. */
static void park(ferry_ctx *ctx) {
  __atomic_store_n(&ctx->progress_parked, true, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&ctx->user_leading, __ATOMIC_SEQ_CST))
    pthread_cond_wait(&ctx->idle_cond, &ctx->idle_lock);
  __atomic_store_n(&ctx->progress_parked, false, __ATOMIC_SEQ_CST);
}

static void follow(ferry_ctx *ctx) {
  pthread_mutex_lock(&ctx->idle_lock);
  while (!fr_ctx_stopping(ctx) && !ctx->lead_wanted) {
    uint64_t now = fr_now_ns();
    uint64_t until = __atomic_load_n(&ctx->user_led_ns, __ATOMIC_SEQ_CST) + ctx->grace_ns;
    if (lead_held_long(ctx, until, now)) {
      park(ctx);
      continue;
    }
    if (caller_leads(ctx) && until <= now)
      until = now + ctx->grace_ns; /* a claim under way: it ends within follow_ns */
    else if (now >= until)
      break;
    struct timespec ts = fr_timespec(until);
    pthread_cond_timedwait(&ctx->idle_cond, &ctx->idle_lock, &ts);
  }
  ctx->lead_wanted = false;
  pthread_mutex_unlock(&ctx->idle_lock);
}

void *fr_ctx_progress_main(void *arg) {
  pthread_setname_np(pthread_self(), "ferry-progress"); /* for top -H, perf, gdb */
  ferry_ctx *ctx = arg;
  while (!fr_ctx_stopping(ctx)) {
    if (ctx->users_may_lead)
      follow(ctx);
    pthread_mutex_lock(&ctx->lead);
    __atomic_store_n(&ctx->lead_idle, true, __ATOMIC_RELEASE);
    if (!fr_ctx_stopping(ctx) && !__atomic_load_n(&ctx->lead_claimed, __ATOMIC_ACQUIRE))
      run_batch(ctx, 1000);
    pthread_mutex_unlock(&ctx->lead);
  }
  return NULL;
}

/* Makes the progress thread look again whether callers lead (see lead_held_long). */
static void nudge_progress(ferry_ctx *ctx) {
  pthread_mutex_lock(&ctx->idle_lock);
  pthread_cond_signal(&ctx->idle_cond);
  pthread_mutex_unlock(&ctx->idle_lock);
}

void fr_ctx_hand_to_progress(ferry_ctx *ctx) {
  pthread_mutex_lock(&ctx->idle_lock);
  ctx->lead_wanted = true;
  pthread_cond_signal(&ctx->idle_cond);
  pthread_mutex_unlock(&ctx->idle_lock);
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
 * yields each round, so on a busy machine the threads it waits for get the core; when a yield
 * took long (FERRY_SHARED_CORE_US: another thread ran on this core, often the peer process it
 * waits for), it stops
 * polling and sleeps: polling on a shared core only takes turns with that thread, a process
 * switch per round. */

static void poll_briefly(ferry_ctx *ctx, bool (*ready)(void *), void *arg, uint64_t deadline_ns) {
  uint64_t window = (uint64_t)ctx->spin_us * 1000u;
  uint64_t end = fr_now_ns() + window;
  for (;;) { /* at least one batch: a zero timeout still takes in what the sockets hold */
    bool events = run_batch(ctx, 0) > 0;
    uint64_t now = fr_now_ns();
    if (events)
      end = now + window;
    if (ready(arg) || fr_ctx_stopping(ctx) || now >= end || now >= deadline_ns)
      return;
    sched_yield();
    if (fr_now_ns() - now > ctx->shared_core_ns)
      return; /* another thread ran on this core: likely the one we wait for, so sleep */
  }
}

/* The lead held by an idle wait or the progress thread: asks it to step down (its epoll_wait
 * returns at the wake-up) and takes the lead within follow_ns. */
static bool take_from_idle(ferry_ctx *ctx) {
  if (!__atomic_load_n(&ctx->lead_idle, __ATOMIC_ACQUIRE))
    return false;
  __atomic_store_n(&ctx->lead_claimed, true, __ATOMIC_RELEASE);
  fr_ctx_wake_progress(ctx);
  bool got = fr_mutex_lock_until(&ctx->lead, fr_now_ns() + ctx->follow_ns) == 0;
  __atomic_store_n(&ctx->lead_claimed, false, __ATOMIC_RELEASE);
  return got;
}

/* When this wait led or wanted to: the progress thread follows every wait, idle waits follow
 * the callers'. */
static void mark_led(ferry_ctx *ctx, bool idle) {
  uint64_t now = fr_now_ns();
  __atomic_store_n(&ctx->user_led_ns, now, __ATOMIC_SEQ_CST);
  if (!idle)
    __atomic_store_n(&ctx->caller_led_ns, now, __ATOMIC_SEQ_CST);
}

/* Leads the epoll until ready(arg) or the deadline. BUSY: another thread
 * leads, and the caller is counted among the sleepers until it calls back. */
static int lead(ferry_ctx *ctx, bool idle, int waits_for, bool (*ready)(void *), void *arg,
                uint64_t deadline_ns) {
  if (!ctx->users_may_lead || fr_ctx_stopping(ctx) || leading(ctx))
    return NO_LEAD;
  if (idle &&
      (fr_now_ns() - __atomic_load_n(&ctx->caller_led_ns, __ATOMIC_SEQ_CST) < ctx->follow_ns ||
       __atomic_load_n(&ctx->lead_claimed, __ATOMIC_SEQ_CST)))
    return NO_LEAD; /* callers lead: they hand over what this thread waits for */
  __atomic_add_fetch(&ctx->sleepers, 1, __ATOMIC_SEQ_CST);
  if (pthread_mutex_trylock(&ctx->lead) != 0 && (idle || !take_from_idle(ctx))) {
    mark_led(ctx, idle); /* the progress thread leaves the epoll to us after its current batch */
    return BUSY;
  }
  __atomic_store_n(&ctx->lead_idle, idle, __ATOMIC_RELEASE);
  __atomic_sub_fetch(&ctx->sleepers, 1, __ATOMIC_SEQ_CST);
  mark_led(ctx, idle);
  __atomic_store_n(&ctx->lead_waits_for, waits_for, __ATOMIC_SEQ_CST);
  __atomic_store_n(&ctx->user_leading, true, __ATOMIC_SEQ_CST);
  if (!idle) /* idle waits never poll without sleeping (see the top) */
    poll_briefly(ctx, ready, arg, deadline_ns);
  while (!ready(arg) && !fr_ctx_stopping(ctx) && fr_now_ns() < deadline_ns && !claimed(ctx, idle)) {
    int ms = fr_ms_left(deadline_ns);
    run_batch(ctx, ms < 1000 ? ms : 1000);
  }
  bool handed = claimed(ctx, idle); /* the claimant leads next and wakes the sleepers */
  __atomic_store_n(&ctx->user_leading, false, __ATOMIC_SEQ_CST);
  pthread_mutex_unlock(&ctx->lead);
  mark_led(ctx, idle);
  if (!handed && __atomic_load_n(&ctx->sleepers, __ATOMIC_SEQ_CST) > 0)
    fr_ctx_hand_to_progress(ctx); /* they sleep on the leader we were */
  else if (__atomic_load_n(&ctx->progress_parked, __ATOMIC_SEQ_CST))
    nudge_progress(ctx); /* it sleeps on us without a deadline (park) */
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
      /* Someone else leads and signals us (or hands the epoll on as it leaves). An idle wait
       * is for its channel's messages, which whoever leads signals, and where callers never
       * lead (ucx) the progress thread always does, with no hand-off to go wrong: no slice. */
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
    if (r == BUSY)
      __atomic_sub_fetch(&ctx->sleepers, 1, __ATOMIC_SEQ_CST);
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
