/*
 * The peer cache: how a job reaches another node it knows only by name. The name is looked up
 * in the directory (fr_dir_node_get: the node's address and the access blob of its regions),
 * dialled, and the link kept by name, so that later calls reuse it. A link is taken out of use
 * when a user reports it failed (fr_peer_release(..., dead)) or when it is found closed, and is
 * closed when its last user lets go; the next acquire dials again, at whatever address the
 * directory gives then (a restarted node re-registers under a new incarnation and address).
 * It lives in the directory because it is about names → records → links, which the jobs share
 * (the store and mq each dialled their peers this way before, with their own copies).
 */
#include "directory/peers.h"
#include "transport/access.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void fr_peers_init(fr_peers *c, fr_dir *dir, ferry_ctx *ctx) {
  memset(c, 0, sizeof *c);
  c->ctx = ctx;
  c->dir = dir;
  pthread_mutex_init(&c->lock, NULL);
}

/* lock held. A link found closed is taken out of use as if its user had said so; a dead peer
 * nobody uses any more moves to *reap, for the caller to close outside the lock. */
static fr_peer *peer_find(fr_peers *c, const char *name, fr_peer **reap) {
  fr_peer *found = NULL;
  for (fr_peer **pp = &c->list, *p; (p = *pp) != NULL;) {
    if (!p->dead && ferry_link_status(p->link) != 0)
      p->dead = true;
    if (p->dead && p->users == 0) {
      *pp = p->next;
      p->next = *reap;
      *reap = p;
      continue;
    }
    if (!p->dead && !found && strcmp(p->name, name) == 0)
      found = p;
    pp = &p->next;
  }
  return found;
}

static void reap_all(fr_peer *p) {
  for (fr_peer *next; p; p = next) {
    next = p->next;
    ferry_link_close(p->link);
    free(p);
  }
}

static int peer_connect(fr_peers *c, const char *name, int timeout_ms, ferry_link **out) {
  fr_dir_node n;
  int rc = fr_dir_node_get(c->dir, name, &n, timeout_ms);
  if (rc == FERRY_ENOTFOUND)
    return fr_err(FERRY_EPEER, "peer '%s' is gone (no longer in the directory)", name);
  if (rc != 0)
    return rc;
  rc = ferry_connect(c->ctx, n.address, timeout_ms, out);
  if (rc != 0 && rc != FERRY_EAUTH)
    return fr_err_wrap(FERRY_EPEER, "peer '%s' is unreachable", name);
  if (rc == 0) /* the peer's regions, reachable without asking it first */
    fr_link_access_hint(*out, n.access, n.access_len);
  return rc;
}
int fr_peer_acquire(fr_peers *c, const char *name, int timeout_ms, fr_peer **out) {
  fr_peer *reap = NULL;
  pthread_mutex_lock(&c->lock);
  fr_peer *p = peer_find(c, name, &reap);
  if (p)
    p->users++;
  pthread_mutex_unlock(&c->lock);
  reap_all(reap);
  reap = NULL;
  if (p) {
    *out = p;
    return 0;
  }
  ferry_link *l = NULL;
  int rc = peer_connect(c, name, timeout_ms, &l);
  if (rc != 0)
    return rc;
  pthread_mutex_lock(&c->lock);
  if ((p = peer_find(c, name, &reap)) != NULL) { /* another thread connected first */
    ferry_link_close(l);
  } else if ((p = calloc(1, sizeof *p)) != NULL) {
    fr_str_copy(p->name, sizeof p->name, name);
    p->link = l;
    p->next = c->list;
    c->list = p;
  } else {
    ferry_link_close(l);
  }
  if (p)
    p->users++;
  pthread_mutex_unlock(&c->lock);
  reap_all(reap);
  if (!p)
    return fr_err(FERRY_ENOMEM, "peer '%s'", name);
  *out = p;
  return 0;
}

void fr_peer_release(fr_peers *c, fr_peer *p, bool dead) {
  pthread_mutex_lock(&c->lock);
  if (dead)
    p->dead = true;
  bool last = --p->users == 0 && p->dead;
  if (last)
    for (fr_peer **pp = &c->list; *pp; pp = &(*pp)->next)
      if (*pp == p) {
        *pp = p->next;
        break;
      }
  pthread_mutex_unlock(&c->lock);
  if (last) {
    ferry_link_close(p->link);
    free(p);
  }
}

void fr_peers_close(fr_peers *c) {
  if (!c->dir)
    return; /* never started */
  reap_all(c->list);
  c->list = NULL;
  pthread_mutex_destroy(&c->lock);
  c->dir = NULL;
}
