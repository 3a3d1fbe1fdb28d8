/*
 * A node's registration in the directory, held under a lease: the one piece of bookkeeping that
 * the store, mq and refit's published names share. Taking a name that another incarnation holds
 * succeeds only when that holder is verifiably dead (nothing accepts a connection at its address,
 * or whoever answers there is not it), so a restarted process gets its name back at once instead
 * of after the old lease lapses. Renewal runs every third of the lease; when the directory lost
 * the node (its lease lapsed, or the directory restarted: its epoch moved) the name is taken again
 * and the caller is told to publish its records again. The leases taken over one client (the
 * store, mq and refit of a context share it, directory.c) are renewed together: one request
 * every third of the shortest lease renews all of them, whichever job's thread sends it. Joining
 * and leaving are logged at info (the directory logs them too, with what a leaving node's records
 * were).
 */
#include "directory/directory.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* After a failed renewal, the next try comes soon (and loudly): RETRY_PER_LEASE tries fit in
 * the third of the lease that is left before it lapses (200 ms at the default 15 s). */
#define RETRY_PER_LEASE 25
#define GROUP_MAX 64 /* leases per renewal request; more renew in turns */

/* Guards every client's `leases` list and the members' in_group/next: a process has a few. */
static pthread_mutex_t group_lock = PTHREAD_MUTEX_INITIALIZER;

static void group_join(fr_dir_lease *l) {
  pthread_mutex_lock(&group_lock);
  if (!l->in_group) {
    l->next = l->dir->leases;
    l->dir->leases = l;
    l->in_group = true;
  }
  pthread_mutex_unlock(&group_lock);
}

static void group_leave(fr_dir_lease *l) {
  pthread_mutex_lock(&group_lock);
  for (fr_dir_lease **p = &l->dir->leases; l->in_group && *p; p = &(*p)->next)
    if (*p == l) {
      *p = l->next;
      l->in_group = false;
      break; /* *p may be NULL now: the step would read through it */
    }
  pthread_mutex_unlock(&group_lock);
}

/* group_lock held. */
static bool group_has(const fr_dir *dir, const fr_dir_lease *l) {
  for (const fr_dir_lease *m = dir->leases; m; m = m->next)
    if (m == l)
      return true;
  return false;
}

void fr_dir_lease_init(fr_dir_lease *l, fr_dir *dir, ferry_ctx *ctx, const char *name,
                       const char *who) {
  memset(l, 0, sizeof *l);
  l->dir = dir;
  l->ctx = ctx;
  snprintf(l->node.name, sizeof l->node.name, "%s", name);
  snprintf(l->node.address, sizeof l->node.address, "%s", ferry_ctx_address(ctx));
  l->node.incarnation = fr_random_u64() | 1;
  l->lease_ms = (int)fr_config_int("FERRY_LEASE_MS");
  snprintf(l->who, sizeof l->who, "%s", who);
}

static void schedule(fr_dir_lease *l, bool ok) {
  __atomic_store_n(&l->ok, ok && l->held, __ATOMIC_RELAXED);
  uint64_t third = (uint64_t)l->lease_ms * 1000000ull / 3;
  uint64_t after = ok ? third : third / RETRY_PER_LEASE;
  __atomic_store_n(&l->next_renew_ns, fr_now_ns() + after, __ATOMIC_RELEASE);
}

/* Whether the holder of our name is verifiably dead: nothing accepts a connection at its address
 * before the deadline (refused, not timed out), or, where it answers under a node name we know,
 * another node answers there. A live holder keeps its name. */
static bool holder_dead(const fr_dir_lease *l, const fr_dir_node *h, int timeout_ms) {
  int ms = timeout_ms < 2000 ? timeout_ms : 2000;
  uint64_t deadline = fr_deadline_ns(ms);
  ferry_link *link = NULL;
  int rc = ferry_connect(l->ctx, h->address, ms, &link);
  bool dead = rc != 0 && rc != FERRY_EAUTH && fr_ms_left(deadline) > 0;
  if (rc == 0) {
    dead = l->holder_peer[0] && strcmp(ferry_link_peer(link), l->holder_peer) != 0;
    ferry_link_close(link);
  }
  fr_err_clear();
  return dead;
}

int fr_dir_lease_take(fr_dir_lease *l, int timeout_ms) {
  const fr_dir_ops *ops = l->dir->ops;
  /* listed but unreachable is worse than refused: say so before registering */
  int rc = fr_dir_reach_check(l->dir->url, l->node.address, l->who);
  uint64_t epoch = ops->epoch(l->dir->state);
  fr_dir_node holder;
  if (rc == 0)
    rc = ops->node_put(l->dir->state, &l->node, l->lease_ms, 0, &holder, timeout_ms);
  if (rc == FERRY_EEXIST) {
    char taken[512];
    snprintf(taken, sizeof taken, "%s", ferry_last_error());
    if (holder_dead(l, &holder, timeout_ms)) {
      fr_info("%s: the node that held '%s' at %s is dead; taking the name over", l->who,
              l->node.name, holder.address);
      rc =
          ops->node_put(l->dir->state, &l->node, l->lease_ms, holder.incarnation, NULL, timeout_ms);
    } else {
      rc = fr_err(FERRY_EEXIST, "%s: %s; give this node another name or stop the other one", l->who,
                  taken);
    }
  }
  if (rc == 0) {
    __atomic_store_n(&l->epoch, epoch, __ATOMIC_RELEASE); /* the group's renewal reads it */
    fr_info("%s: joined the directory at %s as node '%s' (%s; lease %d ms)", l->who, l->dir->url,
            l->node.name, l->node.address, l->lease_ms);
  }
  l->held = rc == 0;
  __atomic_store_n(&l->want, rc != 0, __ATOMIC_RELEASE);
  schedule(l, rc == 0);
  if (rc == 0)
    group_join(l);
  return rc;
}

bool fr_dir_lease_due(const fr_dir_lease *l) {
  return fr_now_ns() >= __atomic_load_n(&l->next_renew_ns, __ATOMIC_ACQUIRE);
}

bool fr_dir_lease_current(const fr_dir_lease *l) {
  return l->held && fr_dir_epoch(l->dir) == __atomic_load_n(&l->epoch, __ATOMIC_ACQUIRE);
}

int fr_dir_lease_ready(const fr_dir_lease *l, char *why, size_t len) {
  if (fr_dir_lease_ok(l))
    return 0;
  if (why && len)
    snprintf(why, len,
             "%s: its directory lease is not held (the directory did not answer its last "
             "renewal, or the node is registering again)",
             l->who);
  return FERRY_ECONNECT;
}

void fr_dir_lease_lost(fr_dir_lease *l) {
  l->held = false;
  __atomic_store_n(&l->want, true, __ATOMIC_RELEASE);
  schedule(l, false);
}

/* What a renewal of the group tells the other members (group_lock held): renewed, the next
 * one a third of its lease away; or not found, left to its own caller. A member taken under an
 * older epoch of the directory (Redis reconnected, a server restarted) counts as not found even
 * when its name answered: its records may be gone, and only its own caller republishes them. */
static void group_tell(fr_dir_lease *m, int status, uint64_t epoch) {
  if (status == 0 && __atomic_load_n(&m->epoch, __ATOMIC_ACQUIRE) == epoch) {
    __atomic_store_n(&m->ok, true, __ATOMIC_RELAXED);
    __atomic_store_n(&m->next_renew_ns, fr_now_ns() + (uint64_t)m->lease_ms * 1000000ull / 3,
                     __ATOMIC_RELEASE);
  } else {
    __atomic_store_n(&m->ok, false, __ATOMIC_RELAXED);
    __atomic_store_n(&m->want, true, __ATOMIC_RELEASE);
    __atomic_store_n(&m->next_renew_ns, fr_now_ns(), __ATOMIC_RELEASE); /* due now */
  }
}

/* Renews l and, in the same request, every other member of its group that its own caller does
 * not need to take again; returns l's status. Names are copied: a member may leave (and be
 * freed) while the request is out; what comes back is told only to members still in. */
static int renew_group(fr_dir_lease *l, int timeout_ms) {
  char names[GROUP_MAX][FR_DIR_NAME_MAX + 1];
  fr_dir_renewal r[GROUP_MAX];
  fr_dir_lease *who[GROUP_MAX];
  int status[GROUP_MAX];
  size_t n = 0;
  pthread_mutex_lock(&group_lock);
  who[n++] = l;
  for (fr_dir_lease *m = l->dir->leases; m && n < GROUP_MAX; m = m->next)
    if (m != l && !__atomic_load_n(&m->want, __ATOMIC_ACQUIRE))
      who[n++] = m;
  for (size_t i = 0; i < n; i++) {
    snprintf(names[i], sizeof names[i], "%s", who[i]->node.name);
    r[i] = (fr_dir_renewal){names[i], who[i]->node.incarnation, who[i]->lease_ms};
  }
  pthread_mutex_unlock(&group_lock);
  int rc = fr_dir_node_renew_batch(l->dir, r, n, status, timeout_ms);
  if (rc != 0)
    return rc;
  uint64_t epoch = fr_dir_epoch(l->dir);
  pthread_mutex_lock(&group_lock);
  for (size_t i = 1; i < n; i++)
    if (group_has(l->dir, who[i]))
      group_tell(who[i], status[i], epoch);
  pthread_mutex_unlock(&group_lock);
  if (status[0] == FERRY_ENOTFOUND)
    return fr_err(FERRY_ENOTFOUND, "node '%s' is not registered (its lease lapsed?)", l->node.name);
  return status[0];
}

int fr_dir_lease_renew(fr_dir_lease *l) {
  int timeout = l->lease_ms / 3 > 100 ? l->lease_ms / 3 : 100;
  /* wanted: lost by its caller, or found missing by the group's renewal: take it again */
  bool want = __atomic_exchange_n(&l->want, false, __ATOMIC_ACQ_REL);
  int rc = want ? FERRY_ENOTFOUND : renew_group(l, timeout);
  if (rc == FERRY_ENOTFOUND || (rc == 0 && !fr_dir_lease_current(l))) {
    fr_info("%s: the directory lost '%s'; registering again", l->who, l->node.name);
    rc = fr_dir_lease_take(l, timeout);
    if (rc == 0)
      return 1;
  } else {
    schedule(l, rc == 0);
  }
  if (rc != 0) /* retried every 200 ms while the directory is away */
    fr_warn_limited("%s: renewing '%s' in the directory failed: %s", l->who, l->node.name,
                    ferry_last_error());
  return rc;
}

void fr_dir_lease_drop(fr_dir_lease *l) {
  if (l->dir)
    group_leave(l);
  if (l->held) {
    int rc = l->dir->ops->node_del(l->dir->state, l->node.name, l->node.incarnation, 2000);
    if (rc == 0)
      fr_info("%s: left the directory at %s", l->who, l->dir->url);
    else /* not worth a warning: a directory that is gone has dropped the records already */
      fr_info("%s: left without telling the directory at %s (%s); its records go when its lease "
              "of %d ms lapses",
              l->who, l->dir->url, ferry_last_error(), l->lease_ms);
    fr_err_clear(); /* closing does not fail */
  }
  l->held = false;
  __atomic_store_n(&l->ok, false, __ATOMIC_RELAXED);
}
