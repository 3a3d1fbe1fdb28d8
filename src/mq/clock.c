/*
 * The publish clock: a publish reads the time once, to tell a stream from an isolated message;
 * on x86-64 from the TSC, rebased on the monotonic clock.
 */
#include "mq/publish.h"

/* A publish reads the time once, to tell a stream (batched) from an isolated message. Reading
 * CLOCK_MONOTONIC cost a fifth of a 64 B stream's publish on the project's VM (28-40 ns through
 * kvm-clock); on x86-64 the TSC costs 12. So there the time is the last clock read plus the TSC
 * ticks since, at a rate measured between clock reads; the clock is read again once a
 * millisecond has passed (or the TSC went back: another core's), so an error in the rate stays
 * within a small part of that millisecond. Elsewhere it is the clock. publish_lock held. */
#define CLOCK_REBASE_NS 1000000ull
#define CLOCK_RATE_MAX_NS (1ull << 31) /* a rate is measured over less than this: no overflow */

uint64_t fr_mq_publish_now(ferry_mq *mq) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  fr_mq_clock *c = &mq->clock;
  uint64_t ticks = __builtin_ia32_rdtsc() - c->tsc;
  if (c->rate && ticks < c->rebase_ticks)
    return c->ns + (ticks * c->rate >> 32);
  uint64_t ns = fr_now_ns(), tsc = __builtin_ia32_rdtsc();
  uint64_t dns = ns - c->ns;
  if (c->tsc && tsc > c->tsc && ns >= c->ns + CLOCK_REBASE_NS && dns < CLOCK_RATE_MAX_NS) {
    uint64_t rate = (dns << 32) / (tsc - c->tsc); /* ns per tick, 32.32 fixed point */
    bool plausible = rate >= (1ull << 32) / 10 && rate <= (10ull << 32); /* 0.1-10 GHz */
    c->rate = plausible ? rate : 0; /* else the clock, every time */
    c->rebase_ticks = plausible ? (CLOCK_REBASE_NS << 32) / rate : 0;
  }
  if (!c->tsc || ns >= c->ns + CLOCK_REBASE_NS || tsc < c->tsc) {
    c->tsc = tsc;
    c->ns = ns;
  }
  return ns;
#else
  return fr_now_ns();
#endif
}
