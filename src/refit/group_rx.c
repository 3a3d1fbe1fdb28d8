/*
 * The receiver of a sharded sender group (group_rx.h): opening it (every rank attached, one
 * sub-receiver each, on the caller's context), the channel that routes each rank's messages to
 * its sub-receiver's thread, the versions as the caller sees them (a version is committed only
 * once every rank's part of it is, and 0 while any is torn or behind), failures (a rank whose link
 * died, or that sends nothing for longer than the push timeout while others send a version,
 * fails that version for the group, named in why; every other rank still sending it then has it
 * refused by its sub-receiver, so that no rank's push waits for a receiver that cannot commit),
 * and the timer that attaches a gone rank again once it is published again, replaying the
 * bindings on it so that the next version commits everywhere.
 */
#include "refit/group_rx.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A gone rank is looked up again this often (its restarted process publishes NAME#k anew). */
#define REATTACH_MS 200
/* Looking a gone rank up and attaching to it, on the group's thread: bounded, so that a record
 * still naming a dead process holds the timer no longer than this. */
#define REATTACH_TIMEOUT_MS 1000
/* Waiting for a rank that is not published yet, during open. */
#define RESOLVE_RETRY_MS 50
/* wait() looks at the ranks again at least this often (a catch-up to ask for). */
#define WAIT_LOOK_MS 1000

static uint64_t ns_of_ms(uint64_t ms) { return ms * 1000000ull; }

/* ---- the channel: each message to its rank's sub-receiver ---- */

/* The sub-receiver reading from link; route held. */
static ferry_refit_receiver *sub_of_link(fr_group_rx *g, const ferry_link *link) {
  for (uint32_t k = 0; k < g->world; k++)
    if (g->ranks[k].sub && g->ranks[k].sub->link == link)
      return g->ranks[k].sub;
  return NULL;
}

static void route_msg(void *arg, ferry_link *link, ferry_msg *msg) {
  fr_group_rx *g = arg;
  pthread_mutex_lock(&g->route);
  ferry_refit_receiver *sub = sub_of_link(g, link);
  if (sub)
    fr_job_put(sub->job, msg);
  pthread_mutex_unlock(&g->route);
  if (!sub)
    ferry_msg_free(msg); /* from no rank of ours (a rank replaced since) */
}

/* A link died: the timer looks at every rank's. */
static void route_link_down(void *arg, ferry_link *link) {
  (void)link;
  fr_job_wake(((fr_group_rx *)arg)->job, 0);
}

static const fr_channel_ops group_channel = {.on_msg = route_msg, .on_link_down = route_link_down};

static uint64_t group_timer(void *arg);
static const fr_job_ops group_ops = {
    .on_timer = group_timer, .channel = &group_channel, .quiet = true};

void fr_group_rx_linked(fr_group_rx *g, ferry_refit_receiver *sub) {
  pthread_mutex_lock(&g->route);
  if (g->ranks[sub->rank].sub != sub) {
    g->ranks[sub->rank].prev = g->ranks[sub->rank].sub;
    g->ranks[sub->rank].sub = sub;
  }
  pthread_mutex_unlock(&g->route);
}

void fr_group_rx_unlinked(fr_group_rx *g, ferry_refit_receiver *sub) {
  pthread_mutex_lock(&g->route);
  fr_group_rank *rk = sub->rank < g->world ? &g->ranks[sub->rank] : NULL;
  if (rk && rk->sub == sub) { /* its attach failed: the rank's previous one stands again */
    rk->sub = rk->prev;
    rk->prev = NULL;
  }
  pthread_mutex_unlock(&g->route);
}

static ferry_refit_receiver *rank_sub(fr_group_rx *g, uint32_t k, bool *gone) {
  pthread_mutex_lock(&g->route);
  ferry_refit_receiver *sub = g->ranks[k].sub;
  if (gone)
    *gone = g->ranks[k].gone;
  pthread_mutex_unlock(&g->route);
  return sub;
}

/* ---- versions ---- */

/* The version rank k's sub-receiver holds (0: none, or torn); asks its rank for a catch-up
 * when it is behind (ferry_refit_committed) if `ask`. */
static uint64_t sub_held(ferry_refit_receiver *sub, bool ask) {
  if (ask)
    return ferry_refit_committed(sub);
  pthread_mutex_lock(&sub->lock);
  uint64_t v = sub->torn_by ? 0 : sub->committed;
  pthread_mutex_unlock(&sub->lock);
  return v;
}

/* The version the group's bytes hold: every rank's part of it that something is bound to, and
 * none torn; 0 otherwise (a mix of versions is none). */
static uint64_t group_held(fr_group_rx *g, bool ask) {
  uint64_t v = 0;
  for (uint32_t k = 0; k < g->world; k++) {
    bool gone = false;
    ferry_refit_receiver *sub = rank_sub(g, k, &gone);
    if (!sub)
      return 0;
    if (!__atomic_load_n(&sub->bound_any, __ATOMIC_ACQUIRE))
      continue; /* this receiver reads nothing from rank k */
    uint64_t c = sub_held(sub, ask && !gone);
    if (c == 0 || (v && c != v))
      return 0;
    v = c;
  }
  return v;
}

uint64_t fr_group_rx_committed(fr_group_rx *g) { return group_held(g, true); }

/* Fails version v for the group (once: a later report of it is dropped), naming rank k, and
 * tells on_commit. */
static void group_fail(fr_group_rx *g, uint64_t v, int status, uint32_t k, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void group_fail(fr_group_rx *g, uint64_t v, int status, uint32_t k, const char *fmt, ...) {
  char detail[384], why[sizeof g->why];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&g->lock);
  if (v <= g->failed) {
    pthread_mutex_unlock(&g->lock);
    return;
  }
  g->failed = v;
  g->failure = status;
  g->failed_rank = k;
  snprintf(g->why, sizeof g->why, "rank %u (%s#%u): %s", k, g->name, k, detail);
  fr_str_copy(why, sizeof why, g->why);
  g->events++;
  pthread_cond_broadcast(&g->cond);
  bool tell = g->told < v;
  if (tell)
    g->told = v, g->told_ok = false;
  ferry_refit_commit_fn fn = g->on_commit;
  void *arg = g->on_commit_arg;
  pthread_mutex_unlock(&g->lock);
  fr_warn("refit group '%s': version %llu failed: %s", g->name, (unsigned long long)v, why);
  if (tell && fn)
    fn(g->self, v, status, why, arg);
}

/* A sub-receiver's version ended (its on_commit, on its thread): a failure fails the version
 * for the group; a commit that completes the group's is told once. */
static void sub_committed(ferry_refit_receiver *sub, uint64_t v, int status, const char *why,
                          void *arg) {
  fr_group_rx *g = arg;
  if (rank_sub(g, sub->rank, NULL) != sub)
    return; /* a replaced one, serving what was queued */
  pthread_mutex_lock(&g->lock);
  if (v > g->ranks[sub->rank].ended)
    g->ranks[sub->rank].ended = v;
  g->events++;
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&g->lock);
  if (status != 0) {
    group_fail(g, v, status, sub->rank, "%s", why ? why : ferry_strerror(status));
    return;
  }
  if (group_held(g, false) != v)
    return;
  pthread_mutex_lock(&g->lock);
  bool tell = g->told < v || (g->told == v && !g->told_ok);
  if (tell)
    g->told = v, g->told_ok = true;
  ferry_refit_commit_fn fn = g->on_commit;
  void *fn_arg = g->on_commit_arg;
  pthread_mutex_unlock(&g->lock);
  if (tell)
    fr_info("refit: committed version %llu from group '%s' (%u ranks)", (unsigned long long)v,
            g->name, g->world);
  if (tell && fn)
    fn(g->self, v, 0, NULL, fn_arg);
}

/* A sub-receiver's bucket landed: reported numbered after the buckets of the ranks before. */
static void sub_bucket(ferry_refit_receiver *sub, uint64_t v, uint32_t b, void *arg) {
  fr_group_rx *g = arg;
  pthread_mutex_lock(&g->lock);
  ferry_refit_bucket_fn fn = g->on_bucket;
  void *fn_arg = g->on_bucket_arg;
  uint32_t base = sub->rank < g->world ? g->ranks[sub->rank].bucket_base : 0;
  pthread_mutex_unlock(&g->lock);
  if (fn)
    fn(g->self, v, base + b, fn_arg);
}

int fr_group_rx_veto(fr_group_rx *g, ferry_refit_receiver *sub, uint64_t version,
                     uint32_t timeout_ms, char *why, size_t n, uint32_t *blame) {
  uint64_t now = fr_now_ns();
  bool began = false;
  pthread_mutex_lock(&g->lock);
  fr_group_rank *rk = &g->ranks[sub->rank];
  rk->heard_ns = now;
  if (timeout_ms)
    rk->timeout_ms = timeout_ms;
  if (version > g->landing) {
    g->landing = version;
    g->landing_ns = now;
    began = true;
  }
  /* FERRY_ESTALE, not the failure's own status: the rank's sender must neither take this
   * receiver for stalled (FERRY_ETIMEDOUT drops it) nor for gone */
  int status = g->refused ? g->refused : version <= g->failed ? FERRY_ESTALE : 0;
  *blame = status == FERRY_ESTALE ? g->failed_rank + 1 : 0;
  if (status)
    snprintf(why, n, "refit group '%s': version %llu failed for the group: %s", g->name,
             (unsigned long long)version, g->why);
  pthread_mutex_unlock(&g->lock);
  if (began) /* the timer now watches every rank for it */
    fr_job_wake(g->job, 0);
  return status;
}

int fr_group_rx_wait(fr_group_rx *g, uint64_t version, int timeout_ms, uint64_t *committed) {
  if (!fr_group_rx_bound_any(g))
    return fr_err(FERRY_ESTATE,
                  "refit receiver of group '%s': nothing is bound: call ferry_refit_bind, "
                  "ferry_refit_bind_pieces or ferry_refit_bind_flat first",
                  g->name);
  uint64_t deadline = fr_deadline_ns(fr_timeout(timeout_ms)), target = version;
  for (uint32_t k = 0; k < g->world && !target; k++) {
    ferry_refit_receiver *sub = rank_sub(g, k, NULL);
    pthread_mutex_lock(&sub->lock);
    target = sub->latest_known > target ? sub->latest_known : target;
    pthread_mutex_unlock(&sub->lock);
  }
  target = target ? target : 1;
  uint64_t have = 0;
  int rc = 0;
  for (;;) {
    pthread_mutex_lock(&g->lock);
    uint64_t seen = g->events;
    pthread_mutex_unlock(&g->lock);
    if ((have = group_held(g, true)) >= target)
      break;
    pthread_mutex_lock(&g->lock);
    if (g->refused) { /* until the ranks agree again */
      rc = fr_err(g->refused, "refit: group '%s' takes no version now: %s (have %llu)", g->name,
                  g->why, (unsigned long long)have);
      pthread_mutex_unlock(&g->lock);
      break;
    }
    if (g->failed >= target) {
      rc = fr_err(g->failure, "refit: version %llu of group '%s' failed: %s (have %llu)",
                  (unsigned long long)g->failed, g->name, g->why, (unsigned long long)have);
      pthread_mutex_unlock(&g->lock);
      break;
    }
    uint64_t now = fr_now_ns();
    if (now >= deadline) {
      rc = fr_err(FERRY_ETIMEDOUT,
                  "refit: version %llu of group '%s' not committed in time (have %llu)%s%s",
                  (unsigned long long)target, g->name, (unsigned long long)have,
                  *g->why ? "; last failure: " : "", g->why);
      pthread_mutex_unlock(&g->lock);
      break;
    }
    uint64_t until =
        now + ns_of_ms(WAIT_LOOK_MS) < deadline ? now + ns_of_ms(WAIT_LOOK_MS) : deadline;
    struct timespec ts = fr_timespec(until);
    if (g->events == seen) /* woken by a rank's commit or a failure */
      pthread_cond_timedwait(&g->cond, &g->lock, &ts);
    pthread_mutex_unlock(&g->lock);
  }
  if (committed)
    *committed = have >= target ? have : group_held(g, false);
  return rc;
}

size_t fr_group_rx_ranks(fr_group_rx *g) { return g->world; }

uint64_t fr_group_rx_bytes_read(fr_group_rx *g) {
  uint64_t n = 0;
  pthread_mutex_lock(&g->route);
  for (uint32_t k = 0; k < g->world; k++)
    n += g->ranks[k].sub ? __atomic_load_n(&g->ranks[k].sub->bytes_read, __ATOMIC_RELAXED) : 0;
  for (uint32_t i = 0; i < g->nold; i++)
    n += __atomic_load_n(&g->old[i]->bytes_read, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&g->route);
  return n;
}

void fr_group_rx_on_bucket(fr_group_rx *g, ferry_refit_bucket_fn fn, void *arg) {
  pthread_mutex_lock(&g->lock);
  g->on_bucket = fn;
  g->on_bucket_arg = arg;
  pthread_mutex_unlock(&g->lock);
}

void fr_group_rx_on_commit(fr_group_rx *g, ferry_refit_commit_fn fn, void *arg) {
  pthread_mutex_lock(&g->lock);
  g->on_commit = fn;
  g->on_commit_arg = arg;
  pthread_mutex_unlock(&g->lock);
}

/* ---- attaching ranks ---- */

/* on_bucket numbers a group's buckets rank after rank. */
static void number_buckets(fr_group_rx *g) {
  uint32_t base = 0;
  for (uint32_t k = 0; k < g->world; k++) {
    ferry_refit_receiver *sub = rank_sub(g, k, NULL);
    pthread_mutex_lock(&g->lock);
    g->ranks[k].bucket_base = base;
    pthread_mutex_unlock(&g->lock);
    if (sub) {
      pthread_mutex_lock(&sub->bind_lock); /* its thread may take a new manifest */
      base += sub->plan.buckets;
      pthread_mutex_unlock(&sub->bind_lock);
    }
  }
}

/* Attaches a sub-receiver to rank k at address (its thread not yet running: the caller binds
 * first). Its plan must say it is rank k of a group of `world` (0: rank 0, which tells it). */
static int attach_rank(fr_group_rx *g, uint32_t k, uint32_t world, const char *address,
                       int timeout_ms, ferry_refit_receiver **out) {
  ferry_refit_receiver *sub = NULL;
  int rc = fr_refit_rx_sub_open(g->ctx, g, k, address, timeout_ms, &sub);
  if (rc != 0)
    return fr_err_wrap(rc, "refit: attaching rank %u of group '%s'", k, g->name);
  if (sub->plan.rank != k || (world && sub->plan.world != world) || sub->plan.world < 2)
    rc = fr_err(FERRY_EPROTO,
                "refit: '%s#%u' says it is rank %u of a group of %u (the group has %u ranks)",
                g->name, k, sub->plan.rank, sub->plan.world, world ? world : sub->plan.world);
  if (rc != 0) {
    ferry_refit_receiver_close(sub);
    return rc;
  }
  *out = sub;
  return 0;
}

/* Resolves rank k (waiting for it to be published until deadline) and attaches to it. A look-up
 * that runs out of time after the directory has said the rank is not there reports that answer,
 * not the timeout: the deadline fell while waiting for the rank, not for the directory. */
static int resolve_and_attach(fr_group_rx *g, uint32_t k, uint64_t deadline,
                              ferry_refit_receiver **out) {
  char *address = NULL;
  char absent[512] = "";
  int rc;
  for (;;) {
    int left = (int)((deadline > fr_now_ns() ? deadline - fr_now_ns() : 0) / 1000000ull);
    rc = fr_refit_resolve_rank(g->ctx, g->name, k, left ? left : 1, &address);
    if (rc == FERRY_ETIMEDOUT && absent[0])
      rc = fr_err(FERRY_ENOTFOUND, "%s", absent);
    if (rc != FERRY_ENOTFOUND || fr_now_ns() + ns_of_ms(RESOLVE_RETRY_MS) >= deadline)
      break;
    snprintf(absent, sizeof absent, "%s", ferry_last_error());
    usleep(RESOLVE_RETRY_MS * 1000); /* the rank's process is still starting */
  }
  if (rc == 0) {
    int left = (int)((deadline > fr_now_ns() ? deadline - fr_now_ns() : 0) / 1000000ull);
    rc = attach_rank(g, k, g->world, address, left ? left : 1, out);
  }
  free(address);
  return rc;
}

static void start_rank(fr_group_rx *g, ferry_refit_receiver *sub) {
  pthread_mutex_lock(&sub->bind_lock);
  sub->on_commit = sub_committed;
  sub->on_commit_arg = g;
  sub->on_bucket = sub_bucket;
  sub->on_bucket_arg = g;
  pthread_mutex_unlock(&sub->bind_lock);
}

/* The ranks table for `world` ranks (rank 0 attached already). */
static int grow_ranks(fr_group_rx *g, uint32_t world) {
  fr_group_rank *ranks = calloc(world, sizeof *ranks);
  if (!ranks)
    return fr_err(FERRY_ENOMEM, "refit: group '%s' of %u ranks", g->name, world);
  pthread_mutex_lock(&g->route);
  pthread_mutex_lock(&g->lock);
  ranks[0] = g->ranks[0];
  free(g->ranks);
  g->ranks = ranks;
  g->world = world;
  pthread_mutex_unlock(&g->lock);
  pthread_mutex_unlock(&g->route);
  return 0;
}

static int attach_all(fr_group_rx *g, const char *address0, int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  ferry_refit_receiver *sub = NULL;
  int rc = attach_rank(g, 0, 0, address0, timeout_ms, &sub);
  if (rc == 0)
    rc = grow_ranks(g, sub->plan.world);
  for (uint32_t k = 1; rc == 0 && k < g->world; k++)
    rc = resolve_and_attach(g, k, deadline, &sub);
  for (uint32_t k = 0; rc == 0 && k < g->world; k++)
    start_rank(g, g->ranks[k].sub);
  if (rc == 0)
    rc = fr_group_rx_build_manifest(g);
  if (rc == 0)
    number_buckets(g);
  for (uint32_t k = 0; rc == 0 && k < g->world; k++)
    rc = fr_job_run(g->ranks[k].sub->job);
  return rc;
}

/* ---- the timer: ranks gone, stalled, back ---- */

/* Rank k's link died: a version it had not finished fails for the group now; the rank is
 * looked up again from now on. */
static void rank_lost(fr_group_rx *g, uint32_t k, uint64_t now) {
  pthread_mutex_lock(&g->route);
  g->ranks[k].gone = true;
  g->ranks[k].next_try_ns = now + ns_of_ms(REATTACH_MS);
  pthread_mutex_unlock(&g->route);
  pthread_mutex_lock(&g->lock);
  uint64_t v = g->landing, ended = g->ranks[k].ended;
  pthread_mutex_unlock(&g->lock);
  fr_warn("refit group '%s': rank %u is gone; it is attached again once it is back", g->name, k);
  if (v > ended)
    group_fail(g, v, FERRY_EPEER, k,
               "its sender is gone (the link died) while version %llu was landing",
               (unsigned long long)v);
}

/* A rank that sent nothing for longer than the push timeout while a version lands from the
 * others fails that version (it was stopped, or died before its link says so). Returns when to
 * look again. */
static uint64_t watch_stalls(fr_group_rx *g, uint64_t now) {
  uint64_t next = UINT64_MAX, v = 0;
  uint32_t stalled = UINT32_MAX, ms = 0;
  pthread_mutex_lock(&g->lock);
  if (g->landing > g->failed) {
    v = g->landing;
    for (uint32_t k = 0; k < g->world; k++)
      ms = g->ranks[k].timeout_ms > ms ? g->ranks[k].timeout_ms : ms;
    uint64_t tmo = ns_of_ms(ms ? ms : (uint32_t)fr_timeout(-1));
    for (uint32_t k = 0; k < g->world && stalled == UINT32_MAX; k++) {
      if (g->ranks[k].ended >= v)
        continue;
      uint64_t since = g->ranks[k].heard_ns > g->landing_ns ? g->ranks[k].heard_ns : g->landing_ns;
      if (now >= since + tmo)
        stalled = k;
      else if (since + tmo < next)
        next = since + tmo;
    }
  }
  pthread_mutex_unlock(&g->lock);
  if (stalled != UINT32_MAX) {
    group_fail(g, v, FERRY_ETIMEDOUT, stalled,
               "it sent nothing for %u ms while version %llu was landing from the other ranks",
               ms ? ms : (uint32_t)fr_timeout(-1), (unsigned long long)v);
    return now;
  }
  return next;
}

/* Rebuilds the global manifest from every rank's plan and declares every binding again on the
 * ranks (rank k, and those not gone), since a rank's new plan may move any rank's parts. While
 * that fails (one rank re-sealed and the others not yet, or a binding no longer fits), every
 * version fails, why naming rank k and the tensor; a later relayout that succeeds ends that.
 * bind_lock held. */
static void relayout(fr_group_rx *g, uint32_t k, const char *what) {
  int rc = fr_group_rx_build_manifest(g);
  for (uint32_t j = 0; rc == 0 && j < g->world; j++) {
    bool gone = false;
    rank_sub(g, j, &gone);
    if (j == k || !gone)
      rc = fr_group_rx_replay(g, j);
  }
  pthread_mutex_lock(&g->lock);
  g->refused = rc;
  if (rc != 0)
    snprintf(g->why, sizeof g->why, "rank %u (%s#%u) %s: %s", k, g->name, k, what,
             ferry_last_error());
  pthread_mutex_unlock(&g->lock);
  if (rc != 0)
    fr_warn("refit group '%s': every version fails until the ranks agree again: %s", g->name,
            g->why);
}

/* Rank k is back (published again): a new sub-receiver, the bindings replayed on it. */
static int reattach(fr_group_rx *g, uint32_t k) {
  ferry_refit_receiver *sub = NULL;
  uint64_t deadline = fr_deadline_ns(REATTACH_TIMEOUT_MS);
  int rc = resolve_and_attach(g, k, deadline, &sub);
  if (rc != 0)
    return rc;
  start_rank(g, sub);
  pthread_mutex_lock(&g->bind_lock);
  ferry_refit_receiver *prev = g->ranks[k].prev;
  if (prev && fr_group_rx_same_plan(g, prev, &sub->plan)) {
    int replayed = fr_group_rx_replay(g, k);
    if (replayed != 0)
      fr_warn("refit group '%s': rank %u's bindings: %s", g->name, k, ferry_last_error());
  } else {
    relayout(g, k, "came back with another manifest");
  }
  pthread_mutex_lock(&g->route); /* under bind_lock: a binding from now on declares on sub */
  g->ranks[k].gone = false;
  pthread_mutex_unlock(&g->route);
  pthread_mutex_unlock(&g->bind_lock);
  number_buckets(g);
  pthread_mutex_lock(&g->route);
  ferry_refit_receiver **old = realloc(g->old, (g->nold + 1) * sizeof *old);
  if (old) { /* else it stays where it is, unfreed: it is never used again */
    g->old = old;
    g->old[g->nold++] = g->ranks[k].prev;
  }
  g->ranks[k].prev = NULL;
  pthread_mutex_lock(&g->lock);
  g->ranks[k].heard_ns = fr_now_ns();
  pthread_mutex_unlock(&g->lock);
  pthread_mutex_unlock(&g->route);
  fr_info("refit group '%s': rank %u attached again", g->name, k);
  return fr_job_run(sub->job);
}

void fr_group_rx_resealed(fr_group_rx *g, ferry_refit_receiver *sub) {
  if (rank_sub(g, sub->rank, NULL) != sub)
    return;
  pthread_mutex_lock(&g->lock);
  g->ranks[sub->rank].resealed = true;
  pthread_mutex_unlock(&g->lock);
  fr_job_wake(g->job, 0);
}

/* Ranks that re-sealed since the timer last looked: the layout is redone for each. */
static void take_reseals(fr_group_rx *g) {
  for (uint32_t k = 0; k < g->world; k++) {
    pthread_mutex_lock(&g->lock);
    bool resealed = g->ranks[k].resealed;
    g->ranks[k].resealed = false;
    pthread_mutex_unlock(&g->lock);
    if (!resealed)
      continue;
    pthread_mutex_lock(&g->bind_lock);
    relayout(g, k, "re-sealed");
    pthread_mutex_unlock(&g->bind_lock);
    number_buckets(g);
  }
}

static uint64_t group_timer(void *arg) {
  fr_group_rx *g = arg;
  take_reseals(g);
  uint64_t now = fr_now_ns(), next = UINT64_MAX;
  for (uint32_t k = 0; k < g->world; k++) {
    bool gone = false;
    ferry_refit_receiver *sub = rank_sub(g, k, &gone);
    if (!gone && sub && ferry_link_status(sub->link) != 0) {
      rank_lost(g, k, now);
      gone = true;
    }
    if (!gone)
      continue;
    pthread_mutex_lock(&g->route);
    uint64_t due = g->ranks[k].next_try_ns;
    pthread_mutex_unlock(&g->route);
    if (now >= due && reattach(g, k) != 0) {
      fr_debug("refit group '%s': rank %u not back yet: %s", g->name, k, ferry_last_error());
      pthread_mutex_lock(&g->route);
      g->ranks[k].next_try_ns = (due = fr_now_ns() + ns_of_ms(REATTACH_MS));
      pthread_mutex_unlock(&g->route);
    } else if (now >= due) {
      continue; /* back */
    }
    next = due < next ? due : next;
  }
  uint64_t stall = watch_stalls(g, fr_now_ns());
  return stall < next ? stall : next;
}

/* ---- open and close ---- */

/* Spreads the reads of replicated tensors: receivers on different contexts pick different
 * holders (FNV-1a of the context's address). */
static uint64_t salt_of(ferry_ctx *ctx) {
  uint64_t h = 1469598103934665603ull;
  for (const char *s = ferry_ctx_address(ctx); s && *s; s++)
    h = (h ^ (uint8_t)*s) * 1099511628211ull;
  return h;
}

/* Closes a sub-receiver of g. One whose callback closes the group (this is its thread) is freed
 * by its thread once the callback returned, after g is gone: it forgets g first. */
static void sub_close(ferry_refit_receiver *sub) {
  if (sub && fr_job_on_thread(sub->job))
    sub->of = NULL;
  ferry_refit_receiver_close(sub);
}

static void group_free(fr_group_rx *g) {
  for (uint32_t k = 0; k < g->world; k++) {
    ferry_refit_receiver *sub = g->ranks[k].sub, *prev = g->ranks[k].prev;
    sub_close(sub); /* unlinked: prev stands in its place */
    sub_close(prev);
  }
  for (uint32_t i = 0; i < g->nold; i++)
    sub_close(g->old[i]);
  fr_group_rx_bindings_free(g);
  fr_group_manifest_free(&g->man);
  if (g->flat)
    ferry_free(g->ctx, g->flat);
  if (g->flat_orphan)
    ferry_free(g->ctx, g->flat_orphan);
  free(g->flat_off);
  for (uint32_t i = 0; g->flat_names && i < g->flat_count; i++)
    free(g->flat_names[i]);
  free(g->flat_names);
  free(g->old);
  free(g->ranks);
  free(g->name);
  pthread_mutex_destroy(&g->route);
  pthread_mutex_destroy(&g->bind_lock);
  pthread_mutex_destroy(&g->lock);
  pthread_cond_destroy(&g->cond);
  free(g->self);
  free(g);
}

int fr_group_rx_open(ferry_ctx *ctx, const char *name, const char *address0, int timeout_ms,
                     ferry_refit_receiver **out) {
  fr_group_rx *g = calloc(1, sizeof *g);
  ferry_refit_receiver *self = calloc(1, sizeof *self);
  fr_group_rank *ranks = calloc(1, sizeof *ranks);
  char *copy = strdup(name);
  if (!g || !self || !ranks || !copy) {
    free(g), free(self), free(ranks), free(copy);
    return fr_err(FERRY_ENOMEM, "refit: receiver of group '%s'", name);
  }
  *g = (fr_group_rx){.self = self, .ctx = ctx, .name = copy, .world = 1, .ranks = ranks};
  g->salt = salt_of(ctx);
  self->ctx = ctx;
  self->group = g;
  pthread_mutex_init(&g->route, NULL);
  pthread_mutex_init(&g->bind_lock, NULL);
  pthread_mutex_init(&g->lock, NULL);
  fr_cond_init_monotonic(&g->cond);
  /* the channel is ours before any rank knows us; the timer starts once all are attached */
  int rc = fr_job_open(ctx, FR_CHANNEL_REFIT_RECEIVER, &group_ops, g, "ferry-refit-rx", &g->job);
  if (rc == FERRY_EBUSY)
    rc = fr_err(rc, "ferry_refit_receiver_open: this context has a refit receiver already");
  if (rc == 0)
    rc = attach_all(g, address0, timeout_ms);
  if (rc == 0)
    rc = fr_job_run(g->job);
  if (rc != 0) {
    fr_err_keep keep;
    fr_err_save(&keep, rc);
    fr_job_stop(g->job);
    group_free(g);
    return fr_err_restore(&keep);
  }
  fr_info("refit: receiver of group '%s' attached to its %u ranks", name, g->world);
  *out = self;
  return 0;
}

void fr_group_rx_close(fr_group_rx *g) {
  fr_job_stop(g->job); /* no message is routed, no rank attached again, after it */
  group_free(g);
}
