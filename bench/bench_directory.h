/*
 * What `ferry bench directory` (bench_directory.c) shares with its stand-in nodes
 * (bench_directory_nodes.c): the plan a worker process or the probe is forked with, the counters
 * a worker keeps in memory the parent reads, and the probe's report.
 */
#ifndef FR_BENCH_DIRECTORY_H
#define FR_BENCH_DIRECTORY_H

#include "cli/bench.h"

#include <stdint.h>

#define BD_NODE_FMT "node-%05d"         /* a stand-in node's name */
#define BD_KEY_FMT BD_NODE_FMT "/t%03d" /* its keys: node, then the key's number */
#define BD_SETUP_MS 30000               /* each setup call's timeout */

/* What a worker or the probe is forked with. */
typedef struct bd_plan {
  char url[512]; /* the directory */
  int nodes;     /* in all, over every worker */
  int keys;      /* objects per node */
  int workers;
  int lease_ms;
} bd_plan;

/* One worker's counters (in MAP_SHARED memory: the parent reads them while it runs). */
typedef struct bd_counters {
  uint64_t renewals; /* atomic: renewals the directory answered */
  uint64_t failures; /* atomic: renewals that failed or found the node gone */
  uint64_t late_ns;  /* atomic: the most a renewal ran after it was due */
  int state;         /* atomic: 0 setting up, 1 ready and renewing, -1 failed (error says why) */
  char error[256];
} bd_counters;

/* Worker w of p->workers: its share of the nodes (w, w + workers, ...), each with its own
 * client and connection, registered with p->keys objects each; then renews each node on its own
 * schedule until quit_fd closes. Runs in a forked child; returns its exit status. */
int bd_worker_main(const bd_plan *p, int w, bd_counters *c, int quit_fd);

/* The probe's figures: the timed calls of one more node, sent to the parent over a pipe. */
typedef struct bd_probe_head {
  int32_t ok; /* 0, or a ferry status (error says why) */
  uint32_t lookups, puts, paced_lookups, paced_puts, misses;
  char error[256];
} bd_probe_head;

/* The probe: one more node with its own client; times lookups of random keys of the stand-in
 * nodes and puts of keys of its own, back to back and paced (o->pace_ms), and writes a
 * bd_probe_head then the four sample arrays (doubles, seconds) to fd. Runs in a forked child. */
int bd_probe_main(const bd_plan *p, const bench_opts *o, int lookups, int puts, int fd);

#endif
