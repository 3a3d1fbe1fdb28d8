/*
 * The stand-in nodes of `ferry bench directory` (bench_directory.c has the overview). A real node
 * is a process with its own directory client and connection that registers once, publishes its
 * objects and renews its lease every third of it from its own timer (src/directory/lease.c).
 * Thousands of processes do not fit on a small host, so a worker process stands in for many:
 * each node here has a client of its own (fr_dir_open_unshared: its own connection), registers
 * under its own name and incarnation, puts its objects in one batch, and renews on its own
 * schedule from then on (while the worker sets up the others too): first at a random point of
 * the first period, then a third of the lease after its last renewal returned, as the lease
 * timer does. One thread renews a worker's nodes in the order
 * they come due, through the same front door (fr_dir_node_renew_batch with one name) the lease
 * timer uses. The probe is one more node whose calls are the timed ones.
 */
#include "bench_directory.h"
#include "cli/cli.h"
#include "directory/directory.h"
#include "ferry.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct sim_node {
  fr_dir *dir;
  fr_dir_node rec;
  uint64_t due_ns; /* its next renewal */
} sim_node;

/* The stand-in's own ctx: tcp only, as a node on another host reaches the directory (over shm a
 * ferry:// client on the directory's host would skip the round trips this bench measures). */
static int open_ctx(const char *name, ferry_ctx **ctx) {
  ferry_ctx_opts co = {
      .size = sizeof co, .name = name, .transports = "tcp", .tcp_listen = "127.0.0.1:0"};
  return ferry_ctx_open(&co, ctx);
}

/* Object j of node `name`: a key of its own, bytes in a region of its pool, a generation. */
static void object_of(const char *name, int n, int j, int keys, fr_dir_object *o) {
  memset(o, 0, sizeof *o);
  snprintf(o->key, sizeof o->key, BD_KEY_FMT, n, j);
  fr_str_copy(o->owner, sizeof o->owner, name);
  o->region = (ferry_region_ref){1, (uint64_t)n * 1000003u + 17u, (uint64_t)keys * 4096u};
  o->offset = (uint64_t)j * 4096u;
  o->bytes = 4096;
  o->gen_region = (ferry_region_ref){2, (uint64_t)n * 7919u + 5u, (uint64_t)keys * 8u};
  o->gen_offset = (uint64_t)j * 8u;
  o->generation = (uint64_t)j + 1;
  o->desc.dtype = FERRY_DTYPE_U8;
  o->desc.ndim = 1;
  o->desc.shape[0] = 4096;
}

/* Registers node n and puts its keys; 0 or a ferry status. */
static int node_up(sim_node *s, ferry_ctx *ctx, const bd_plan *p, int n, fr_dir_object *objs,
                   int *status, fr_dir_object *replaced, bool *had_other) {
  int rc = fr_dir_open_unshared(ctx, p->url, BD_SETUP_MS, &s->dir);
  if (rc != 0)
    return rc;
  snprintf(s->rec.name, sizeof s->rec.name, BD_NODE_FMT, n);
  fr_str_copy(s->rec.address, sizeof s->rec.address, ferry_ctx_address(ctx));
  s->rec.incarnation = fr_random_u64() | 1;
  if ((rc = fr_dir_node_put(s->dir, &s->rec, p->lease_ms, 0, NULL, BD_SETUP_MS)) != 0)
    return rc;
  for (int j = 0; j < p->keys; j++)
    object_of(s->rec.name, n, j, p->keys, &objs[j]);
  for (int j = 0; j < p->keys; j += FR_DIR_BATCH_MAX) {
    size_t k = (size_t)(p->keys - j < FR_DIR_BATCH_MAX ? p->keys - j : FR_DIR_BATCH_MAX);
    rc = fr_dir_obj_put_batch(s->dir, objs + j, k, 0, status, replaced, had_other, BD_SETUP_MS);
    for (size_t i = 0; rc == 0 && i < k; i++)
      rc = status[i];
    if (rc != 0)
      return rc;
  }
  return 0;
}

static void fail(bd_counters *c, int rc, const char *what) {
  snprintf(c->error, sizeof c->error, "%s: %s (%s)", what, ferry_strerror(rc), ferry_last_error());
  __atomic_store_n(&c->state, -1, __ATOMIC_RELEASE);
}

/* The node due first. */
static sim_node *next_due(sim_node *s, int n) {
  sim_node *first = &s[0];
  for (int i = 1; i < n; i++)
    if (s[i].due_ns < first->due_ns)
      first = &s[i];
  return first;
}

/* Waits until at_ns; false when quit_fd closed (or spoke) meanwhile. */
static bool wait_until(uint64_t at_ns, int quit_fd) {
  for (;;) {
    uint64_t now = fr_now_ns();
    int ms = at_ns > now ? (int)((at_ns - now + 999999) / 1000000) : 0;
    struct pollfd pf = {quit_fd, POLLIN, 0};
    int r = poll(&pf, 1, ms);
    if (r > 0)
      return false;
    if (r == 0 || fr_now_ns() >= at_ns)
      return true;
  }
}

static uint64_t period_ns(const bd_plan *p) { return (uint64_t)p->lease_ms * 1000000ull / 3; }

/* One renewal of d, counted; its next one a third of the lease on from the answer, as the lease
 * timer schedules it. */
static void renew_one(sim_node *d, const bd_plan *p, bd_counters *c) {
  uint64_t late = fr_now_ns() - d->due_ns;
  if (late > __atomic_load_n(&c->late_ns, __ATOMIC_RELAXED))
    __atomic_store_n(&c->late_ns, late, __ATOMIC_RELAXED);
  fr_dir_renewal r = {d->rec.name, d->rec.incarnation, p->lease_ms};
  int st = 0;
  int rc = fr_dir_node_renew_batch(d->dir, &r, 1, &st, p->lease_ms / 3);
  __atomic_add_fetch(rc == 0 && st == 0 ? &c->renewals : &c->failures, 1, __ATOMIC_RELAXED);
  d->due_ns = fr_now_ns() + period_ns(p);
}

/* While the worker sets up its other nodes: renews those up already whose renewal is due (a
 * slow directory's setup may take longer than a lease). */
static void renew_due(sim_node *s, int n, const bd_plan *p, bd_counters *c) {
  for (int i = 0; i < n; i++)
    if (s[i].due_ns <= fr_now_ns())
      renew_one(&s[i], p, c);
}

/* Renews each node when due, one at a time, until quit_fd closes. */
static void renew_loop(sim_node *s, int n, const bd_plan *p, bd_counters *c, int quit_fd) {
  for (;;) {
    sim_node *d = next_due(s, n);
    if (!wait_until(d->due_ns, quit_fd))
      return;
    renew_one(d, p, c);
  }
}

int bd_worker_main(const bd_plan *p, int w, bd_counters *c, int quit_fd) {
  int mine = p->nodes / p->workers + (w < p->nodes % p->workers);
  sim_node *s = calloc((size_t)(mine > 0 ? mine : 1), sizeof *s);
  size_t k = (size_t)p->keys;
  fr_dir_object *objs = calloc(k, sizeof *objs), *replaced = calloc(k, sizeof *replaced);
  int *status = calloc(k, sizeof *status);
  bool *had_other = calloc(k, sizeof *had_other);
  char name[64];
  snprintf(name, sizeof name, "bench-dir-w%d-%d", w, (int)getpid());
  ferry_ctx *ctx = NULL;
  int rc = !s || !objs || !replaced || !status || !had_other ? FERRY_ENOMEM : open_ctx(name, &ctx);
  if (rc != 0) {
    fail(c, rc, "worker");
    return CLI_FAIL;
  }
  for (int i = 0; i < mine; i++) {
    if ((rc = node_up(&s[i], ctx, p, w + i * p->workers, objs, status, replaced, had_other))) {
      char what[96];
      snprintf(what, sizeof what, "setting up node " BD_NODE_FMT, w + i * p->workers);
      fail(c, rc, what);
      return CLI_FAIL;
    }
    s[i].due_ns = fr_now_ns() + fr_random_u64() % period_ns(p); /* its first: at random */
    renew_due(s, i + 1, p, c);
  }
  __atomic_store_n(&c->late_ns, 0, __ATOMIC_RELAXED); /* lateness counts from here on */
  __atomic_store_n(&c->state, 1, __ATOMIC_RELEASE);
  if (mine > 0)
    renew_loop(s, mine, p, c, quit_fd);
  /* _exit: the directory sees the connections close, as it would the nodes' processes end */
  return CLI_OK;
}

/* ---- the probe ---- */

typedef struct probe {
  fr_dir *dir;
  fr_dir_node rec;
  const bd_plan *p;
  int puts_done;
  uint32_t misses;
} probe;

static int lookup_once(probe *pr, double *seconds) {
  char key[FR_DIR_KEY_MAX + 1];
  uint64_t r = fr_random_u64();
  snprintf(key, sizeof key, BD_KEY_FMT, (int)(r % (uint64_t)pr->p->nodes),
           (int)((r >> 32) % (uint64_t)pr->p->keys));
  const char *keys[1] = {key};
  fr_dir_object out;
  int st = 0;
  double t = bench_now();
  int rc = fr_dir_obj_get(pr->dir, keys, 1, &out, &st, 5000);
  *seconds = bench_now() - t;
  if (rc == 0 && st != 0)
    pr->misses++; /* a key whose node lapsed: the parent reports it */
  return rc;
}

/* A put of a new key of the probe's own, as a store's put of a new tensor. */
static int put_once(probe *pr, double *seconds) {
  fr_dir_object o;
  int j = pr->puts_done++;
  object_of(pr->rec.name, 0, 0, 1, &o);
  snprintf(o.key, sizeof o.key, "probe/t%07d", j);
  o.generation = (uint64_t)j + 1;
  double t = bench_now();
  int rc = fr_dir_obj_put(pr->dir, &o, 0, NULL, NULL, 5000);
  *seconds = bench_now() - t;
  return rc;
}

/* n timed calls of fn (paced: each after o->pace_ms) into b. */
static int time_calls(probe *pr, int (*fn)(probe *, double *), int n, const bench_opts *paced,
                      bench_samples *b) {
  for (int i = 0; i < n; i++) {
    if (paced)
      bench_pace(paced);
    double s = 0;
    int rc = fn(pr, &s);
    if (rc != 0)
      return rc;
    bench_add(b, s);
  }
  return 0;
}

static void send_samples(int fd, const bench_samples *b) {
  if (b->n)
    bench_write_all(fd, b->s, b->n * sizeof *b->s);
}

int bd_probe_main(const bd_plan *p, const bench_opts *o, int lookups, int puts, int fd) {
  bd_probe_head h = {0};
  bench_samples b[4] = {{0}};
  ferry_ctx *ctx = NULL;
  probe pr = {.p = p};
  int paced = bench_paced_samples(o);
  snprintf(pr.rec.name, sizeof pr.rec.name, "probe-%d", (int)getpid());
  int rc = open_ctx(pr.rec.name, &ctx);
  if (rc == 0)
    rc = fr_dir_open_unshared(ctx, p->url, BD_SETUP_MS, &pr.dir);
  if (rc == 0) {
    fr_str_copy(pr.rec.address, sizeof pr.rec.address, ferry_ctx_address(ctx));
    pr.rec.incarnation = fr_random_u64() | 1;
    rc = fr_dir_node_put(pr.dir, &pr.rec, 600000, 0, NULL, BD_SETUP_MS); /* outlives the probe */
  }
  double warm;
  for (int i = 0; rc == 0 && i < 20; i++) /* the connection and both paths warm */
    if ((rc = lookup_once(&pr, &warm)) == 0)
      rc = put_once(&pr, &warm);
  if (rc == 0)
    rc = time_calls(&pr, lookup_once, lookups, NULL, &b[0]);
  if (rc == 0)
    rc = time_calls(&pr, put_once, puts, NULL, &b[1]);
  if (rc == 0 && paced > 0)
    rc = time_calls(&pr, lookup_once, paced, o, &b[2]);
  if (rc == 0 && paced > 0)
    rc = time_calls(&pr, put_once, paced, o, &b[3]);
  h.ok = rc;
  if (rc != 0)
    snprintf(h.error, sizeof h.error, "%s (%s)", ferry_strerror(rc), ferry_last_error());
  h.lookups = (uint32_t)b[0].n, h.puts = (uint32_t)b[1].n;
  h.paced_lookups = (uint32_t)b[2].n, h.paced_puts = (uint32_t)b[3].n;
  h.misses = pr.misses;
  bench_write_all(fd, &h, sizeof h);
  for (int i = 0; i < 4; i++)
    send_samples(fd, &b[i]);
  return rc == 0 ? CLI_OK : CLI_FAIL;
}
