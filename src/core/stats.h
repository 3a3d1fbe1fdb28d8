/*
 * Metrics inside the library: counters, gauges and histograms that the layers keep in their own
 * objects with relaxed atomics (no lock on a hot path), and collectors that report them when
 * someone asks (ferry_stats_each, the /metrics endpoint). A layer registers a collector per
 * object it owns (a ctx's links, a store, an mq, a refit sender) and removes it when the object
 * closes; a collector reads its object's counters and emits samples. Process-wide objects (control
 * cells, which belong to no ctx) register with the global set. Readiness checks (/readyz) are
 * registered the same way.
 */
#ifndef FR_STATS_H
#define FR_STATS_H

#include "ferry.h"

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Log4 buckets: bucket i counts observations <= 4^i * 1024 units (1 us .. 69 s in ns; 1 KiB ..
 * 64 GiB in bytes); the last counts the rest (+Inf). Fixed, so observing is one clz and two
 * relaxed adds, and two histograms of one family always share their bounds. */
#define FR_HIST_BUCKETS 14
typedef struct fr_hist {
  uint64_t bucket[FR_HIST_BUCKETS + 1];
  uint64_t sum; /* in the observed unit (ns, bytes) */
} fr_hist;

static inline void fr_hist_observe(fr_hist *h, uint64_t v) {
  unsigned i = 0;
  if (v > 1024) {
    unsigned log2 = 64u - (unsigned)__builtin_clzll(v - 1); /* 2^(log2-1) < v <= 2^log2 */
    i = (log2 - 10 + 1) / 2;
    if (i > FR_HIST_BUCKETS)
      i = FR_HIST_BUCKETS;
  }
  __atomic_fetch_add(&h->bucket[i], 1, __ATOMIC_RELAXED);
  __atomic_fetch_add(&h->sum, v, __ATOMIC_RELAXED);
}

static inline void fr_count(uint64_t *c, uint64_t n) { __atomic_fetch_add(c, n, __ATOMIC_RELAXED); }
static inline uint64_t fr_counted(const uint64_t *c) {
  return __atomic_load_n(c, __ATOMIC_RELAXED);
}

/* ---- collecting ---- */
typedef struct fr_stats_out fr_stats_out;
/* Emits the samples of one object. Called with the set's lock held: it must not take a lock that
 * the object holds while it removes its collector, nor register collectors. */
typedef void (*fr_stats_fn)(void *arg, fr_stats_out *out);
/* Whether the object is ready (0), or a status with a one-line reason in why. */
typedef int (*fr_ready_fn)(void *arg, char *why, size_t len);

typedef struct fr_stats_entry {
  fr_stats_fn fn;
  fr_ready_fn ready;
  void *arg;
} fr_stats_entry;

typedef struct fr_stats {
  pthread_mutex_t lock;
  fr_stats_entry *v;
  size_t n, cap;
} fr_stats;

void fr_stats_init(fr_stats *s);
void fr_stats_fini(fr_stats *s);
/* The process-wide set: objects that belong to no ctx (control cells and ranks), and the
 * process's own series (ferry_build_info, process_*: fr_procstats_collect, procstats.c). */
fr_stats *fr_stats_global(void);
void fr_procstats_collect(void *arg, fr_stats_out *out);
/* A ctx's set: its jobs register their collectors there (defined by the transport layer, which
 * owns the ctx). */
fr_stats *fr_ctx_stats(ferry_ctx *ctx);
/* Registers fn (may be NULL) and ready (may be NULL) for arg; 0 or FERRY_ENOMEM. */
int fr_stats_add(fr_stats *s, fr_stats_fn fn, fr_ready_fn ready, void *arg);
/* Removes arg's entry; after it returns no collector of arg runs. */
void fr_stats_remove(fr_stats *s, void *arg);

/* Samples: label pairs (name, value) follow, ended by NULL. Values are in base units: histograms
 * give `scale`, the base unit of one observed unit (1e-9 for ns). */
void fr_stat_counter(fr_stats_out *o, const char *name, const char *help, double value, ...)
    __attribute__((sentinel));
void fr_stat_gauge(fr_stats_out *o, const char *name, const char *help, double value, ...)
    __attribute__((sentinel));
void fr_stat_hist(fr_stats_out *o, const char *name, const char *help, const fr_hist *h,
                  double scale, ...) __attribute__((sentinel));

/* Runs the collectors of every set given (NULL entries skipped), merges samples of one series
 * (two publishers of one topic), sorts them by family and calls fn for each, with `node` added
 * as a label when not NULL. */
int fr_stats_collect(fr_stats *const *sets, size_t nsets, const char *node, ferry_stat_fn fn,
                     void *arg);
/* Runs the readiness checks of the sets: 0 when all pass, else the first failure's status. */
int fr_stats_ready(fr_stats *const *sets, size_t nsets, char *why, size_t len);
/* The Prometheus text exposition (version 0.0.4) of the sets' samples, malloc'd. */
int fr_stats_prometheus(fr_stats *const *sets, size_t nsets, const char *node, char **text,
                        size_t *len);

#endif
