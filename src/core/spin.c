/*
 * How a waiter spins: between two polls of what it waits for it pauses the CPU, and it gives
 * its core away (sched_yield) only every FERRY_SPIN_YIELD_US of polling, so that a thread that
 * waits for this core still gets it within that bound. Every polling wait of the transport goes
 * through here (a leader polling the epoll, a shm ring's reader and writer).
 *
 * Why not a yield per poll, as before: a sched_yield is a system call and a pass through the
 * scheduler even when nothing else is runnable, ~0.5 us here against ~0.15 us for a poll of
 * the epoll and a few ns for a ring's, so most of a spinning waiter's reaction time was its
 * own yields (a shm round trip 1.3 us with one per poll, 0.8 us with one per 5 us).
 */
#include "core/core.h"

#include <pthread.h>
#include <sched.h>

static uint64_t yield_every_ns;
static pthread_once_t yield_once = PTHREAD_ONCE_INIT;

static void load_yield_every(void) {
  int64_t us = fr_config_int("FERRY_SPIN_YIELD_US");
  yield_every_ns = us > 0 ? (uint64_t)us * 1000u : 0;
}

void fr_spin_begin(fr_spin *s, uint64_t window_ns) {
  pthread_once(&yield_once, load_yield_every);
  uint64_t now = fr_now_ns();
  s->end = now + window_ns;
  s->next_yield = now + yield_every_ns;
  s->yield_ns = 0;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

bool fr_spin_pause(fr_spin *s) {
  cpu_relax();
  uint64_t now = fr_now_ns();
  s->yield_ns = 0;
  if (now >= s->next_yield) {
    sched_yield();
    uint64_t after = fr_now_ns();
    s->yield_ns = after - now;
    s->next_yield = after + yield_every_ns;
    now = after;
  }
  return now < s->end;
}
