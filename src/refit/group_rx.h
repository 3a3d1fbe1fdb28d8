/*
 * The receiver of a sharded sender group (issue 34; docs/REFIT.md, Sharded senders): what the
 * public receiver calls do when ferry_refit_receiver_open found a group under the name (ranks
 * NAME#0 .. NAME#(world-1)). The group attaches one sub-receiver per rank, all on the caller's
 * one context: each is an ordinary refit receiver (receiver_impl.h, `of` pointing here) whose
 * thread is a job of no channel, so the group reads from every rank at once; the group owns
 * FR_CHANNEL_REFIT_RECEIVER and routes each message by its link to that rank's sub-receiver.
 *
 * group_rx.c holds open and close, the routing, the versions (committed(), wait(), on_commit
 * once per group version), failures (a rank that died or stalled fails the version for the group
 * and, through fr_group_rx_veto, at every other rank still sending it) and the timer that
 * attaches a rank again once it is back, and redoes the layout when a rank re-sealed.
 * group_bind.c holds the global manifest as the caller sees it and the bindings: each one is kept
 * here and turned into parts (group.h), declared on the sub-receivers as shard targets with
 * places; a rank attached again, or any rank after a re-seal, gets them declared again.
 *
 * Locking, in this order: bind_lock guards the manifest, the bindings and the flat buffer (taken
 * before a sub-receiver's own bind_lock); route guards ranks[].sub, .prev and .gone as the
 * channel reads them, held briefly (under any bind_lock, before lock and a sub-receiver's lock);
 * lock guards the versions and the ranks' progress, a leaf but for the job's inbox (a
 * sub-receiver's thread takes it under its own bind_lock). A sub-receiver replaced by a new one
 * for its rank is kept, its thread fed nothing, until the group closes: a pointer read from
 * ranks[] stays valid.
 */
#ifndef FR_REFIT_GROUP_RX_H
#define FR_REFIT_GROUP_RX_H

#include "refit/group.h"
#include "refit/receiver_impl.h"

typedef struct fr_group_rank {
  ferry_refit_receiver *sub;  /* route: the rank's sub-receiver (a gone one until replaced) */
  ferry_refit_receiver *prev; /* route: the one sub replaces, while sub attaches */
  bool gone;                  /* its link died: the timer attaches the rank again */
  uint64_t next_try_ns;       /* when the timer next looks the rank up */
  uint64_t heard_ns;          /* lock: the last bucket from it */
  uint64_t ended;             /* lock: the last version it committed or failed here */
  uint32_t timeout_ms;        /* lock: the push timeout its last bucket carried */
  uint32_t bucket_base;       /* lock: buckets of the ranks before it (on_bucket's numbering) */
  bool resealed;              /* lock: it sent a new manifest; the timer redoes the layout */
} fr_group_rank;

typedef struct fr_group_binding {
  char *target;
  char **names; /* per piece: the global tensor's name (found again when the manifest changes) */
  fr_group_piece *pieces;
  uint32_t n;
  uint8_t *dst;
  ferry_tensor_desc desc;
  int device;
  /* NULL: pieces[0..n) fill dst (desc) along its dim 0, as bind_pieces lays them. Else (the flat
   * buffer: one binding for every tensor, declared in few targets) piece i is a whole tensor at
   * dst + units[i], desc the whole buffer's bytes. */
  uint64_t *units;
} fr_group_binding;

typedef struct fr_group_rx {
  ferry_refit_receiver *self; /* the caller's handle (self->group == this) */
  ferry_ctx *ctx;
  char *name;
  uint32_t world;
  uint64_t salt; /* spreads the reads of replicated tensors over their holders (group.h) */
  fr_job *job;   /* owns FR_CHANNEL_REFIT_RECEIVER; its timer watches the ranks */
  fr_group_rank *ranks;
  ferry_refit_receiver **old; /* replaced sub-receivers, stopped, freed at close */
  uint32_t nold;

  pthread_mutex_t route;
  pthread_mutex_t bind_lock;
  fr_group_manifest man;
  fr_group_binding *binds;
  uint32_t nbinds;
  uint8_t *flat; /* ferry_alloc'd (bind_flat), or NULL: tensor flat_names[i] at flat_off[i] */
  uint64_t *flat_off;
  char **flat_names; /* the manifest's names when it was laid out (a re-seal may add or move) */
  uint32_t flat_count;
  uint8_t *flat_orphan; /* a flat buffer whose binding failed halfway: freed at close */
  int refused; /* lock: the ranks' plans or the bindings do not fit together (a rank re-sealed
                  or came back with another manifest): every version fails until they do */

  pthread_mutex_t lock;
  pthread_cond_t cond;
  uint64_t events;      /* bumped on every commit or failure (wait's wake-ups) */
  uint64_t landing;     /* the newest version any rank began sending */
  uint64_t landing_ns;  /* when it began */
  uint64_t failed;      /* the newest version that failed for the group */
  int failure;          /* and its status */
  uint32_t failed_rank; /* and the rank that failed it */
  char why[512];        /* and why, naming the rank */
  uint64_t told;        /* the last version on_commit reported (told_ok: as committed) */
  bool told_ok;
  ferry_refit_bucket_fn on_bucket;
  void *on_bucket_arg;
  ferry_refit_commit_fn on_commit;
  void *on_commit_arg;
} fr_group_rx;

/* group_rx.c */
/* Opens the receiver of group `name`, whose rank 0 is at address0: attaches every rank within
 * timeout_ms and builds the global manifest. FERRY_EBUSY when ctx has a receiver. */
int fr_group_rx_open(ferry_ctx *ctx, const char *name, const char *address0, int timeout_ms,
                     ferry_refit_receiver **out);
void fr_group_rx_close(fr_group_rx *g);
/* sub connected to its rank (before it attaches): its link's messages go to it from now on;
 * unlinked as it is freed (an attach that failed: the rank's previous one stands again). */
void fr_group_rx_linked(fr_group_rx *g, ferry_refit_receiver *sub);
void fr_group_rx_unlinked(fr_group_rx *g, ferry_refit_receiver *sub);
/* sub takes a bucket of `version` (its bind_lock held): 0, or FERRY_ESTALE when the version
 * failed for the group (the status a refused manifest failed with, when one did), *why then
 * saying so and *blame set to 1 + the rank that failed it (0: none, a refused manifest); the
 * sub-receiver then fails it too (its ACK tells the rank, naming the one to blame). */
int fr_group_rx_veto(fr_group_rx *g, ferry_refit_receiver *sub, uint64_t version,
                     uint32_t timeout_ms, char *why, size_t n, uint32_t *blame);
/* sub took a new manifest from its rank (a re-seal), its bind_lock held: the group's timer
 * rebuilds the global manifest and declares the bindings again. */
void fr_group_rx_resealed(fr_group_rx *g, ferry_refit_receiver *sub);
uint64_t fr_group_rx_committed(fr_group_rx *g);
int fr_group_rx_wait(fr_group_rx *g, uint64_t version, int timeout_ms, uint64_t *committed);
size_t fr_group_rx_ranks(fr_group_rx *g);
uint64_t fr_group_rx_bytes_read(fr_group_rx *g);
void fr_group_rx_on_bucket(fr_group_rx *g, ferry_refit_bucket_fn fn, void *arg);
void fr_group_rx_on_commit(fr_group_rx *g, ferry_refit_commit_fn fn, void *arg);
/* Whether anything is bound (a version has somewhere to land). */
bool fr_group_rx_bound_any(fr_group_rx *g);

/* group_bind.c (each takes bind_lock) */
size_t fr_group_rx_tensor_count(fr_group_rx *g);
int fr_group_rx_tensor_info(fr_group_rx *g, size_t i, const char **name, ferry_tensor_desc *desc);
int fr_group_rx_tensor_scale(fr_group_rx *g, size_t i, float *scale);
int fr_group_rx_bind(fr_group_rx *g, const char *name, void *dst, const ferry_tensor_desc *desc);
int fr_group_rx_bind_pieces(fr_group_rx *g, const char *target, void *dst,
                            const ferry_tensor_desc *desc, const ferry_refit_piece *pieces,
                            size_t n);
int fr_group_rx_bind_flat(fr_group_rx *g);
int fr_group_rx_view(fr_group_rx *g, const char *name, void **out);
/* Builds the global manifest from the sub-receivers' plans (each sub's bind_lock taken). */
int fr_group_rx_build_manifest(fr_group_rx *g);
/* Declares every binding's parts for rank k on its (new) sub-receiver. */
int fr_group_rx_replay(fr_group_rx *g, uint32_t k);
/* Whether a rank's new plan declares what its previous sub-receiver's did (same entries). */
bool fr_group_rx_same_plan(fr_group_rx *g, const ferry_refit_receiver *prev,
                           const fr_refit_plan *plan);
void fr_group_rx_bindings_free(fr_group_rx *g);

#endif
