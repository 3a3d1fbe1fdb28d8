/*
 * The peer cache: links to other nodes by their directory name (name → node record → link),
 * shared by the jobs that dial each other by name (the store reaches owners and holders, mq
 * reaches publishers and subscribers). One cache per job instance; see peers.c.
 */
#ifndef FR_DIR_PEERS_H
#define FR_DIR_PEERS_H

#include "directory/directory.h"

#include <pthread.h>
#include <stdbool.h>

/* One cached link. `users` counts fr_peer_acquire()s not yet released; a dead peer stays
 * listed (never handed out again) until its last user releases it, which closes the link. */
typedef struct fr_peer {
  char name[FR_DIR_NAME_MAX + 1];
  ferry_link *link;
  int users;
  bool dead;
  struct fr_peer *next;
} fr_peer;

typedef struct fr_peers {
  ferry_ctx *ctx;
  fr_dir *dir; /* NULL until fr_peers_init: fr_peers_close is then a no-op */
  pthread_mutex_t lock;
  fr_peer *list;
} fr_peers;

/* Starts an empty cache that dials through ctx at the addresses dir gives. */
void fr_peers_init(fr_peers *c, fr_dir *dir, ferry_ctx *ctx);
/* A live link to node `name`: a cached one, else looked up in the directory and dialled (within
 * timeout_ms each), handing the link the node record's access blob. FERRY_EPEER when the node
 * is not in the directory or does not answer, FERRY_EAUTH on a token mismatch. */
int fr_peer_acquire(fr_peers *c, const char *name, int timeout_ms, fr_peer **out);
/* Ends one use; `dead` (the link failed: FERRY_EPEER, FERRY_ECLOSED) stops handing it out, and
 * the last user of a dead peer closes its link. */
void fr_peer_release(fr_peers *c, fr_peer *p, bool dead);
/* Closes every cached link (no users left) and the cache. */
void fr_peers_close(fr_peers *c);

#endif
