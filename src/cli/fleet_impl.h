/*
 * What the parts of the fleet snapshot share (cli only): fleet.c reads the directory and keeps
 * the last snapshot; fleet_prom.c reads a node's metrics text; fleet_ask.c asks the nodes for it,
 * in parallel, within the budget; fleet_json.c writes the snapshot's JSON.
 */
#ifndef FR_CLI_FLEET_IMPL_H
#define FR_CLI_FLEET_IMPL_H

#include "cli/fleet.h"
#include "core/core.h"
#include "directory/directory.h"
#include "ferry.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

/* A link kept to a node between snapshots: connecting anew each time would churn connections
 * (and log two lines per node per snapshot on each side). */
typedef struct kept_link {
  char *address;
  ferry_link *link;
} kept_link;

/* An address that just failed: not asked again before `until` (fr_now_ns). */
typedef struct down_addr {
  char *address;
  uint64_t until;
  double since; /* when it first failed, in seconds since the epoch */
  char error[256];
} down_addr;

struct fleet_view {
  ferry_ctx *ctx;
  fr_dir *dir;
  int budget_ms;
  pthread_mutex_t lock; /* what follows */
  pthread_cond_t done;  /* a snapshot was taken (busy went false) */
  bool busy;            /* a snapshot is being taken: only its thread touches kept and down */
  json_t *last;         /* the last snapshot (NULL: it failed, with last_rc and last_error) */
  int last_rc;
  char last_error[512];
  uint64_t last_ns; /* when it was taken (fr_now_ns); 0: none yet */
  kept_link kept[FLEET_NODES_MAX];
  size_t nkept;
  down_addr down[FLEET_NODES_MAX];
  size_t ndown;
};

#define LABELS_MAX 6

typedef struct sample {
  char *name;
  size_t nlabels;
  char *key[LABELS_MAX], *val[LABELS_MAX];
  double value;
} sample;

typedef struct samples {
  sample *s;
  size_t n, cap;
} samples;

/* The metrics of every node, fetched once per distinct address. */
typedef struct node_stats {
  const char *address;
  samples ss;
  bool ok;
  char error[256];
  double down_since; /* not reached: when the address first failed (0: it just did) */
  bool skipped;      /* not asked: it failed less than FLEET_SKIP_MS ago */
  /* the asking (ask_one) */
  ferry_link *link; /* in: the link kept to it (NULL: connect); out: the one to keep */
  char *text;
  int rc;
  bool asked; /* false: the budget ran out before its turn (not held against it) */
} node_stats;

typedef struct snap {
  fleet_view *v;
  uint64_t deadline; /* the budget's end (fr_now_ns) */
  fr_dir_node *nodes;
  size_t nnodes, total;
  fr_dir_object *jobs; /* the job records, sorted by key */
  size_t njobs;
  node_stats *stats; /* parallel to nodes; entries of a repeated address point at the first */
  node_stats **of;
} snap;

/* fleet_prom.c */
void fleet_samples_free(samples *ss);
void fleet_parse_prom(const char *text, samples *out);
const char *fleet_label(const sample *s, const char *key);
const sample *fleet_find(const samples *ss, const char *name, const char *k1, const char *v1,
                         const char *k2, const char *v2);

/* fleet_ask.c */
void fleet_drop_link(fleet_view *v, size_t i);
void fleet_drop_down(fleet_view *v, size_t i);
int fleet_left_ms(uint64_t deadline);
void fleet_fetch_stats(snap *s);

/* fleet_json.c */
json_t *fleet_assemble(snap *s, const fr_dir_object *objs, size_t nobjs, const fr_dir_object *mq,
                       size_t nmq);

#endif
