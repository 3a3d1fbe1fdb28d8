/*
 * How a waiter spins: between two polls of what it waits for it pauses the CPU, and it gives its
 * core away (sched_yield) only now and then. Every polling wait of the transport goes through
 * here (a leader polling the epoll, a shm ring's reader and writer).
 *
 * Why not a yield per poll, as before: a sched_yield is a system call and a pass through the
 * scheduler even when nothing else is runnable, ~0.5 us here against ~0.15 us for a poll of the
 * epoll and a few ns for a ring's, so most of a spinning waiter's reaction time was its own
 * yields. Why yield at all: the thread it waits for may be waiting for this very core (more
 * runnable threads than cores, or the scheduler has not spread them yet), and then every
 * microsecond spent polling delays the answer by as much.
 *
 * So a wait polls for twice what a yield costs before its first yield (the first gap: twice the
 * quickest yield this process has seen, measured when its first wait begins; or
 * FERRY_SPIN_YIELD_NS), so yields take at most a third of a spinning wait, and the gap adapts. A
 * yield four times as long as the quickest ran another thread: the core is shared, and the thread
 * yields after every poll, as before, until one of its yields comes back at once, in this wait
 * or a later one (a thread's core stays shared a while). Each yield that comes back at once
 * (nobody else wanted the core) doubles the gap, up to 8x the first. Two waiters on separate
 * cores then seldom yield (a shm round trip ends before the first one: 1.4 -> 0.8 us here), and
 * two sharing one core hand it over at every poll, as before (3.8-5.8 us either way).
 *
 * That is FERRY_SPIN_YIELD_NS=auto, and not the default: after a pause the scheduler often wakes
 * the two on one core, where a yield may come back at once while the other thread still waits
 * for the core, and the gap then delays every hand-over (`ferry bench link` after its paced rows:
 * shm round trip 0.8-5.3 us, median 2.8, against 1.3-2.5 with a yield per poll). Keeping a core
 * "shared" for 10 ms after a yield that ran another thread lost the gain on separate cores too.
 * So by default (0) a spinner yields after every poll, as before; the helper is still the one way
 * to spin.
 */
#include "core/core.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#define GAP_GROWTH_MAX 8  /* the longest gap, in first gaps */
#define YIELDS_MEASURED 8 /* yields timed as the process's first wait begins */
#define FIRST_GAP 2       /* auto: the first gap, in quickest yields */
#define RAN_ANOTHER 4     /* a yield this many times the quickest ran another thread */

static uint64_t bare_yield_ns = UINT64_MAX; /* atomic: the quickest yield seen */
static uint64_t fixed_gap_ns = UINT64_MAX;  /* FERRY_SPIN_YIELD_NS; MAX: auto */
static pthread_once_t gap_once = PTHREAD_ONCE_INIT;
static _Thread_local bool thread_shared; /* this thread's last yield ran another thread */

static uint64_t timed_yield(void) {
  uint64_t t = fr_now_ns();
  sched_yield();
  return fr_now_ns() - t;
}

static void note_yield(uint64_t ns) {
  if (ns < __atomic_load_n(&bare_yield_ns, __ATOMIC_RELAXED))
    __atomic_store_n(&bare_yield_ns, ns, __ATOMIC_RELAXED); /* a lost race keeps a near value */
}

static void load_gap(void) {
  const char *v = fr_config_str("FERRY_SPIN_YIELD_NS");
  char *end = NULL;
  long long ns = strtoll(v, &end, 10);
  if (end != v && *end == '\0' && ns >= 0)
    fixed_gap_ns = (uint64_t)ns;
  else if (strcmp(v, "auto") != 0)
    fr_warn("FERRY_SPIN_YIELD_NS=%s is neither auto nor a count of nanoseconds; using auto", v);
  for (int i = 0; fixed_gap_ns == UINT64_MAX && i < YIELDS_MEASURED; i++)
    note_yield(timed_yield()); /* auto needs what a yield costs */
}

static uint64_t first_gap(void) {
  return fixed_gap_ns != UINT64_MAX ? fixed_gap_ns
                                    : FIRST_GAP * __atomic_load_n(&bare_yield_ns, __ATOMIC_RELAXED);
}

void fr_spin_begin(fr_spin *s, uint64_t window_ns) {
  pthread_once(&gap_once, load_gap);
  uint64_t now = fr_now_ns();
  s->end = now + window_ns;
  s->gap = thread_shared ? 0 : first_gap();
  s->next_yield = now + s->gap;
  s->yield_ns = 0;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* Whether a yield that took yield_ns ran another thread: RAN_ANOTHER times the quickest (two
 * context switches and the other thread's turn; a bare yield's own jitter stays below). */
static bool ran_another(uint64_t yield_ns) {
  note_yield(yield_ns);
  uint64_t bare = __atomic_load_n(&bare_yield_ns, __ATOMIC_RELAXED);
  return yield_ns > RAN_ANOTHER * bare;
}

/* The gap after a yield: none when it ran another thread, else the first gap after none, else
 * twice the last, up to 8x the first. */
static uint64_t next_gap(uint64_t gap, bool shared) {
  uint64_t first = first_gap();
  if (shared)
    return 0;
  if (gap == 0)
    return first;
  return gap * 2 < first * GAP_GROWTH_MAX ? gap * 2 : first * GAP_GROWTH_MAX;
}

bool fr_spin_pause(fr_spin *s) {
  uint64_t now = fr_now_ns();
  s->yield_ns = 0;
  if (now >= s->end)
    return false;
  if (now < s->next_yield) {
    cpu_relax();
    return true;
  }
  sched_yield();
  uint64_t after = fr_now_ns();
  s->yield_ns = after - now;
  if (first_gap() != 0) { /* the default, 0, yields at every pause: nothing to adapt */
    thread_shared = ran_another(s->yield_ns);
    s->gap = next_gap(s->gap, thread_shared);
  }
  s->next_yield = after + s->gap;
  return true; /* the caller polls once more, even when a long yield ended the window */
}
