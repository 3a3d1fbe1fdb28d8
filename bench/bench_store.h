/*
 * `ferry bench store`, internal: the pieces its two files share. bench_store.c runs ferry (a
 * producer process puts, this process gets) and memcpy; bench_store_base.c runs the baselines
 * (np/torch files through Debian's python3, Redis SET/GET) and the tcp-between-namespaces case.
 */
#ifndef FR_CLI_BENCH_STORE_H
#define FR_CLI_BENCH_STORE_H

#include "cli/bench.h"
#include "ferry.h"

#include <stdbool.h>
#include <stdint.h>

#define BS_LAYERS 45
#define BS_TOKENS 32768
#define BS_TOPK 8
#define BS_ROUTING_BYTES ((uint64_t)BS_LAYERS * BS_TOKENS * BS_TOPK) /* uint8 */
#define BS_LAYER_BYTES ((uint64_t)BS_TOKENS * BS_TOPK * 4)           /* int32 */

/* Samples of one (case, impl), kept until the report. */
typedef struct bs_series {
  char case_name[32], impl[32];
  uint64_t bytes;
  bench_samples s;
  bool baseline;
  bench_wake w; /* the paced run's wake-ups per call (bench.h) */
} bs_series;

typedef struct bs_report {
  bs_series v[64];
  int n;
} bs_report;

bs_series *bs_add(bs_report *r, const char *case_name, const char *impl, uint64_t bytes,
                  bool baseline);
/* Prints "ferry bench store: what: <detail>" on stderr; returns -1. */
int bs_fail(const char *what);
double bs_median(const bs_series *s);
const bs_series *bs_find(const bs_report *r, const char *case_name, const char *impl);

/* The processes of a run (bench_store.c): a free loopback port, a store node, and the
 * directory process's body (hosts the embedded directory on `listen` until quit_fd closes). */
int bs_free_port(void);
ferry_store *bs_open_node(const char *name, const char *listen, const char *url, uint32_t flags,
                          uint64_t capacity, ferry_ctx **ctx);
int bs_directory_main(const char *listen, int quit_fd);
/* Routing replay as it runs (bench_store_first.c): every key new, got once, deleted. */
void bs_first(bs_report *r, int keys, bool reuse);

/* Baselines. Each adds its series; a baseline that cannot run says why on stderr and adds
 * nothing. */
void bs_python(bs_report *r, int requests);
void bs_redis(bs_report *r, int requests);
/* The tcp case across two namespaces; `self` is this binary. */
void bs_netns(bs_report *r, const char *self, int reps);
/* The roles bs_netns runs inside the namespaces. */
int bs_role(const char *role);

#endif
