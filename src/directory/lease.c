/*
 * A node's registration in the directory, held under a lease: the one piece of bookkeeping that
 * the store, mq and refit's published names share. Taking a name that another incarnation holds
 * succeeds only when that holder is verifiably dead (nothing accepts a connection at its address,
 * or whoever answers there is not it), so a restarted process gets its name back at once instead
 * of after the old lease lapses. Renewal runs every third of the lease; when the directory lost
 * the node (its lease lapsed, or the directory restarted: its epoch moved) the name is taken again
 * and the caller is told to publish its records again. Joining and leaving are logged at info
 * (the directory logs them too, with what a leaving node's records were).
 */
#include "directory/directory.h"

#include <stdio.h>
#include <string.h>

/* After a failed renewal, the next try comes soon (and loudly): RETRY_PER_LEASE tries fit in
 * the third of the lease that is left before it lapses (200 ms at the default 15 s). */
#define RETRY_PER_LEASE 25

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
    l->epoch = epoch;
    fr_info("%s: joined the directory at %s as node '%s' (%s; lease %d ms)", l->who, l->dir->url,
            l->node.name, l->node.address, l->lease_ms);
  }
  l->held = rc == 0;
  schedule(l, rc == 0);
  return rc;
}

bool fr_dir_lease_due(const fr_dir_lease *l) {
  return fr_now_ns() >= __atomic_load_n(&l->next_renew_ns, __ATOMIC_ACQUIRE);
}

bool fr_dir_lease_current(const fr_dir_lease *l) {
  return l->held && l->dir->ops->epoch(l->dir->state) == l->epoch;
}

void fr_dir_lease_lost(fr_dir_lease *l) {
  l->held = false;
  schedule(l, false);
}

int fr_dir_lease_renew(fr_dir_lease *l) {
  int timeout = l->lease_ms / 3 > 100 ? l->lease_ms / 3 : 100;
  const fr_dir_ops *ops = l->dir->ops;
  int rc = ops->node_renew(l->dir->state, l->node.name, l->node.incarnation, l->lease_ms, timeout);
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
