/*
 * The fleet snapshot behind ferry serve's /v1/fleet (and its status page) and `ferry top`.
 *
 * The directory is the front door: its node records give the nodes (one per process and
 * directory) and their addresses, its job records ("ferry:job/KIND/NAME", owned by a node) what
 * runs on each (a store, an mq, published refit senders), its object records the store's keys
 * (grouped by prefix: the key up to its first '/') and the mq's publisher and subscriber records
 * per topic. What only a node knows (the version each of a sender's receivers committed, an mq's
 * queue, a store node's pool) comes from that node's own metrics, which every ctx gives on a ferry
 * call (FR_CHANNEL_STATS, the text its /metrics would serve): one call per distinct address. The
 * whole snapshot has a budget (FERRY_FLEET_BUDGET_MS): the directory is read within it, then the
 * nodes are asked in parallel (FLEET_ASK_THREADS at a time), each given what is left of it, so a
 * node that is slow or gone costs the snapshot at most the budget and is shown with its error. An
 * address that failed is remembered and not asked again for FLEET_SKIP_MS (listed unreachable, with
 * why and since when), so that a dead node whose records wait for its lease to lapse does not cost
 * every snapshot. One snapshot is taken at a time and kept FLEET_CACHE_MS: concurrent callers (page
 * viewers, ferry top) share it, or wait for the one in flight, instead of each asking every node.
 * Control cells are not in the directory (they live in FERRY_CTL_DIR's shared memory): the
 * snapshot lists this host's. Every string that came from a peer is made valid UTF-8 before it
 * goes into the JSON; the page renders it as text.
 *
 * This file opens the view, reads the directory and keeps the last snapshot; the Prometheus reader
 * is fleet_prom.c, the askers fleet_ask.c, the JSON fleet_json.c (fleet_impl.h: what they share).
 */
#include "cli/fleet_impl.h"

#include <stdlib.h>
#include <string.h>

int fleet_budget_ms(void) {
  int64_t ms = fr_config_int("FERRY_FLEET_BUDGET_MS");
  return ms < FLEET_BUDGET_MIN_MS   ? FLEET_BUDGET_MIN_MS
         : ms > FLEET_BUDGET_MAX_MS ? FLEET_BUDGET_MAX_MS
                                    : (int)ms;
}

int fleet_view_open(const char *url, const char *name, fleet_view **out) {
  fleet_view *v = calloc(1, sizeof *v);
  if (!v)
    return fr_err(FERRY_ENOMEM, "fleet view");
  pthread_mutex_init(&v->lock, NULL);
  fr_cond_init_monotonic(&v->done);
  v->budget_ms = fleet_budget_ms();
  ferry_ctx_opts co = {.size = sizeof co, .name = name};
  int rc = ferry_ctx_open(&co, &v->ctx);
  if (rc == 0) /* the budget bounds this too: a directory that is down must not hold a caller */
    rc = fr_dir_open(v->ctx, url, v->budget_ms, &v->dir);
  if (rc != 0) {
    fleet_view_close(v);
    return rc;
  }
  *out = v;
  return 0;
}

void fleet_view_close(fleet_view *v) {
  if (!v)
    return;
  while (v->nkept)
    fleet_drop_link(v, 0);
  while (v->ndown)
    fleet_drop_down(v, 0);
  json_decref(v->last);
  fr_dir_close(v->dir);
  ferry_ctx_close(v->ctx);
  pthread_cond_destroy(&v->done);
  pthread_mutex_destroy(&v->lock);
  free(v);
}

static int node_cmp(const void *a, const void *b) {
  return strcmp(((const fr_dir_node *)a)->name, ((const fr_dir_node *)b)->name);
}

/* The directory's records: nodes (sorted by name), user objects and mq records. */
static int read_directory(fleet_view *v, snap *s, fr_dir_object **objs, size_t *nobjs,
                          fr_dir_object **mq, size_t *nmq) {
  int ms = fleet_left_ms(s->deadline);
  int rc = fr_dir_node_list(v->dir, &s->nodes, &s->nnodes, ms ? ms : 1);
  if (rc == 0 && (ms = fleet_left_ms(s->deadline)) > 0)
    rc = fr_dir_obj_scan(v->dir, "", objs, nobjs, ms);
  if (rc == 0 && (ms = fleet_left_ms(s->deadline)) > 0)
    rc = fr_dir_obj_scan(v->dir, FR_DIR_RESERVED "mq/", mq, nmq, ms);
  if (rc == 0 && (ms = fleet_left_ms(s->deadline)) > 0)
    rc = fr_dir_obj_scan(v->dir, FR_DIR_JOBS, &s->jobs, &s->njobs, ms);
  if (rc == 0 && ms == 0)
    rc = fr_err(FERRY_ETIMEDOUT, "no answer within the snapshot's %d ms budget", v->budget_ms);
  if (rc != 0)
    return fr_err_wrap(rc, "fleet: the directory %s", v->dir->url);
  qsort(s->nodes, s->nnodes, sizeof *s->nodes, node_cmp);
  return 0;
}

/* A new snapshot, taken within the budget (the caller has made v busy). */
static int take(fleet_view *v, json_t **out) {
  snap s = {.v = v, .deadline = fr_deadline_ns(v->budget_ms)};
  fr_dir_object *objs = NULL, *mq = NULL;
  size_t nobjs = 0, nmq = 0;
  int rc = read_directory(v, &s, &objs, &nobjs, &mq, &nmq);
  s.total = s.nnodes;
  if (s.nnodes > FLEET_NODES_MAX) /* the rest are counted, not asked */
    s.nnodes = FLEET_NODES_MAX;
  if (rc == 0 && (!(s.stats = calloc(s.nnodes + 1, sizeof *s.stats)) ||
                  !(s.of = calloc(s.nnodes + 1, sizeof *s.of))))
    rc = fr_err(FERRY_ENOMEM, "fleet snapshot");
  if (rc == 0) {
    fleet_fetch_stats(&s);
    *out = fleet_assemble(&s, objs, nobjs, mq, nmq);
    if (!*out)
      rc = fr_err(FERRY_ENOMEM, "fleet snapshot");
  }
  for (size_t i = 0; s.stats && i < s.nnodes; i++) {
    fleet_samples_free(&s.stats[i].ss);
    free(s.stats[i].text);
  }
  free(s.stats);
  free(s.of);
  free(s.nodes);
  free(s.jobs);
  free(objs);
  free(mq);
  return rc;
}

/* The last snapshot (v->lock held): a copy of it, or its failure. */
static int last(fleet_view *v, json_t **out) {
  if (!v->last)
    return fr_err(v->last_rc, "%s", v->last_error);
  *out = json_deep_copy(v->last);
  return *out ? 0 : fr_err(FERRY_ENOMEM, "fleet snapshot");
}

int fleet_snapshot(fleet_view *v, json_t **out) {
  pthread_mutex_lock(&v->lock);
  for (;;) {
    bool fresh = v->last_ns && fr_now_ns() - v->last_ns < (uint64_t)FLEET_CACHE_MS * 1000000ull;
    if (fresh || (v->busy && v->last)) { /* one in flight: the last one meanwhile */
      int rc = last(v, out);
      pthread_mutex_unlock(&v->lock);
      return rc;
    }
    if (!v->busy)
      break;
    pthread_cond_wait(&v->done, &v->lock); /* at most the budget */
  }
  v->busy = true;
  pthread_mutex_unlock(&v->lock);
  json_t *o = NULL;
  int rc = take(v, &o);
  pthread_mutex_lock(&v->lock);
  v->busy = false;
  json_decref(v->last);
  v->last = rc == 0 ? o : NULL;
  v->last_rc = rc;
  fr_str_copy(v->last_error, sizeof v->last_error, rc == 0 ? "" : ferry_last_error());
  v->last_ns = fr_now_ns();
  pthread_cond_broadcast(&v->done);
  if (rc == 0 && !(*out = json_deep_copy(o)))
    rc = fr_err(FERRY_ENOMEM, "fleet snapshot");
  pthread_mutex_unlock(&v->lock);
  return rc;
}

int fleet_json(fleet_view *v, char **text, size_t *len) {
  json_t *o = NULL;
  int rc = fleet_snapshot(v, &o);
  if (rc != 0)
    return rc;
  *text = json_dumps(o, JSON_COMPACT);
  json_decref(o);
  if (!*text)
    return fr_err(FERRY_ENOMEM, "fleet snapshot");
  *len = strlen(*text);
  return 0;
}
