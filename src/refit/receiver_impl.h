/*
 * The refit receiver's state, shared by the files that hold its parts: receiver.c (attach, open
 * and close, the service thread's job, versions: committed() and wait()), receiver_bind.c (the
 * manifest as the caller sees it, and binding: whole tensors, flat, alias, pieces),
 * receiver_cuda.c (CUDA destinations: where a destination lives, the pinned stage, copies into
 * device memory), receiver_shards.c (shard targets, their declarations to the sender, the view
 * of runs built from them) and receiver_read.c (reading a push: each announced bucket read,
 * verified and placed, commits, drops, a new manifest taken mid-stream).
 *
 * Locking: bind_lock guards what is bound (bound, flat, alias, the targets and their view, the
 * callbacks), held by the service thread while a bucket lands and by the binding calls; lock
 * guards the versions (committed, torn_by, latest_known, why), which committed() and wait() read
 * on the caller's thread. A function below that says "bind_lock held" expects its caller to hold
 * it.
 */
#ifndef FR_REFIT_RECEIVER_IMPL_H
#define FR_REFIT_RECEIVER_IMPL_H

#include "core/cuda.h"
#include "core/stats.h"
#include "refit/refit.h"
#include "refit/shard.h"
#include "transport/job.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

struct fr_group_rx;

/* Where a receiver's service thread spends a version (issue 37): waiting for the next bucket
 * after acknowledging one, taking a bucket (reading and placing it: device copies included), and
 * sending its acknowledgement. */
enum { FR_RX_PHASE_WAIT, FR_RX_PHASE_COPY, FR_RX_PHASE_ACK, FR_RX_PHASES };

struct ferry_refit_receiver {
  ferry_ctx *ctx;
  /* Sharded senders (group_rx.h): the receiver of a group, whose calls go to `group` (the fields
   * below are then unused), or one of a group's sub-receivers, reading rank `rank` for `of`; both
   * NULL for a single sender. */
  struct fr_group_rx *group;
  struct fr_group_rx *of;
  uint32_t rank;
  uint32_t blame; /* a sub-receiver that refused a version for its group: 1 + the rank that failed
                    it, sent with its FERRY_ESTALE ACK and COMMITTED (0: none) */
  ferry_link *link;
  fr_refit_plan plan;
  void **bound;                  /* per tensor: the caller's destination, or NULL */
  ferry_tensor_desc *bound_desc; /* and how the caller described it */
  int *bound_dev;                /* and its CUDA device, -1 for host memory */
  uint32_t dev_bound;            /* how many bound[] are device memory (bind_lock) */
  int stage_pin;                 /* the device whose context pinned the stage (fr_cuda_pin: a
                                    device this receiver copies to), or -1: not pinned */
  uint8_t *flat;                 /* ferry_alloc'd flat buffer, or NULL */
  const uint8_t *alias;          /* the sender's wire buffer, mapped (alias mode), or NULL */
  ferry_region_ref alias_ref;    /* the sender's wire buffer, if it keeps one */
  uint8_t *stage;
  uint8_t *fwd;     /* two forwarding slots for a chain successor (ferry_alloc'd), or NULL */
  ferry_link *up;   /* to the chain predecessor, or NULL */
  char *up_address; /* where the sender said the predecessor is */
  uint8_t *got;     /* per bucket: verified in the version arriving */
  ferry_refit_bucket_fn on_bucket; /* these four under bind_lock */
  void *on_bucket_arg;
  ferry_refit_commit_fn on_commit;
  void *on_commit_arg;
  uint32_t bind_epoch;      /* bumped when a destination is bound (under bind_lock) */
  uint32_t committed_epoch; /* bind_epoch when the last version committed */
  uint64_t missed;          /* a version a destination bound mid-way missed buckets of */
  uint64_t unheld; /* a version sent with buckets flagged unchanged (the sender skips what the
                      last commit holds) while a destination bound since then lacks them */

  pthread_mutex_t bind_lock; /* bound, flat: held by the service thread while a bucket lands */
  pthread_mutex_t lock;      /* the versions below */
  pthread_cond_t cond;
  uint64_t committed, latest_known;
  uint64_t torn_by;   /* 0, or the version whose bytes began landing over `committed` and did not
                         complete: the bytes are then neither version (committed() says 0) */
  uint64_t receiving; /* version whose buckets are arriving */
  uint32_t verified;
  int failure;
  bool bound_any; /* something is bound (a tensor, flat, alias): a catch-up has somewhere to land */
  uint64_t asked; /* the latest version this receiver asked to catch up to (late join) */
  char why[256];  /* what the last failed version went wrong on, for wait()'s error */
  fr_job *job;    /* the service thread, owning FR_CHANNEL_REFIT_RECEIVER (transport/job.h) */

  /* shards (ferry_refit_bind_pieces): once any is bound, every binding is a target, declared to
   * the sender, and only the runs of the view built from them are read (bind_lock) */
  bool shards;
  struct rx_target {
    char *name;
    ferry_tensor_desc desc;
    int device;     /* of dst: a CUDA device, or -1 for host memory */
    char **sources; /* the pieces' source names (pieces name them by index in the manifest) */
    fr_refit_target t;
  } * targets;
  uint32_t ntargets;
  uint32_t serial;     /* of the last VIEW record sent */
  fr_refit_view *view; /* built from the targets at `serial`, or NULL (built when needed) */
  struct dev_range {
    uintptr_t lo, hi;
    int device;
  } * dev_ranges;      /* the device targets' memory, sorted (built with the view) */
  size_t ndev_ranges;  /* 0: every target is host memory */
  uint64_t bytes_read; /* atomic: bytes read from the sender or a predecessor, all told */
  /* where the service thread's time went (ferry_refit_receiver_phase_seconds_total, receiver.c):
   * relaxed adds by the service thread, read by a scrape; acked_at is its own (0: no bucket of
   * the version arriving acknowledged yet) */
  uint64_t phase_ns[FR_RX_PHASES], buckets_taken, acked_at;
};

/* Adds the time since t0 (fr_now_ns) to one phase of the receiver's (issue 37). */
static inline void fr_refit_rx_phase(ferry_refit_receiver *r, int phase, uint64_t t0) {
  fr_count(&r->phase_ns[phase], fr_now_ns() - t0);
}

/* Runs' bytes on their way out of the stage (or a landed bucket). Host runs are memcpy'd; runs
 * into a device target are merged while they continue one another at both ends (a slice along
 * dim 1 lands row after row) within one target's memory, so a stretch costs one copy;
 * copy_done issues the last one. Never across targets: two allocations may lie end to end, and
 * one copy spanning both is refused by the driver (CUDA_ERROR_INVALID_VALUE). */
typedef struct rx_copy {
  uint8_t *dst;
  const uint8_t *src;
  uint64_t len;
  int device;
  uintptr_t end; /* where the device range dst lies in ends */
} rx_copy;

/* receiver.c: asks the sender for its manifest, bucket buffers and latest version. */
int fr_refit_rx_fetch_manifest(ferry_refit_receiver *r, int timeout_ms, fr_refit_plan *plan);
/* receiver.c: a group's sub-receiver for rank `rank` of g, attached to the sender at `address`:
 * on ctx (whose FR_CHANNEL_REFIT_RECEIVER the group owns), its thread a job of no channel that
 * the group feeds (group_rx.h) and starts (fr_job_run) once it bound it; closed with
 * ferry_refit_receiver_close. */
int fr_refit_rx_sub_open(ferry_ctx *ctx, struct fr_group_rx *g, uint32_t rank, const char *address,
                         int timeout_ms, ferry_refit_receiver **out);

/* receiver_bind.c */
/* Checks a caller's piece i of `target` before anything is looked up: a source, a dim, and
 * bounds that are not negative (FERRY_ESHAPE naming both otherwise). */
int fr_refit_rx_piece_arg_check(const char *target, size_t i, const ferry_refit_piece *p);
/* Checks that a binding fits its tensor; the error names the tensor. */
int fr_refit_rx_binding_fits(const fr_refit_entry *e, const ferry_tensor_desc *desc);
/* A destination just bound ([lo, lo+len) of the wire bytes) holds no version. bind_lock held. */
void fr_refit_rx_new_destination(ferry_refit_receiver *r, uint64_t lo, uint64_t len);
/* Maps the sender's whole wire buffer (alias mode). */
int fr_refit_rx_alias_map(ferry_refit_receiver *r);

/* receiver_cuda.c */
int fr_refit_rx_where_bound(const char *name, const void *dst, const ferry_tensor_desc *desc,
                            int *device);
int fr_refit_rx_host_only(const ferry_refit_receiver *r, const char *name);
uint8_t *fr_refit_rx_stage_alloc(uint64_t bucket);
void fr_refit_rx_stage_free(uint8_t *stage, int pinned_on);
void fr_refit_rx_pin_stage(ferry_refit_receiver *r);
int fr_refit_rx_copy_done(rx_copy *c);
int fr_refit_rx_put_run(const ferry_refit_receiver *r, rx_copy *c, uint8_t *dst, const uint8_t *src,
                        uint64_t len);
int fr_refit_rx_build_dev_ranges(ferry_refit_receiver *r);

/* receiver_shards.c (bind_lock held) */
void fr_refit_rx_target_free(struct rx_target *t);
int fr_refit_rx_pieces_fit(const fr_refit_plan *plan, const char *target,
                           const ferry_tensor_desc *desc, char *const *sources,
                           fr_refit_piece *pieces, uint32_t n);
/* The same for pieces with places (add_target's check of them): each a slice of its source
 * (resolved by name into pieces[i].entry) that fits places[i] (shard.h), each block inside
 * [dst, dst + the bytes of desc) (FERRY_ERANGE otherwise). */
int fr_refit_rx_places_fit(const fr_refit_plan *plan, const char *target,
                           const ferry_tensor_desc *desc, const uint8_t *dst, char *const *sources,
                           fr_refit_piece *pieces, const fr_refit_place *places, uint32_t n);
/* Records target `name` and declares it to the sender. places NULL: pieces (checked, resolved)
 * fill dst, described by desc, one after another along its dim 0. places[0..n) (a group's
 * sub-receiver, group.h's parts): piece i lands at places[i] instead; dst and desc are then the
 * whole destination the blocks lie in (device ranges are taken from it), and the pieces and
 * places are checked here (sources resolved by name; FERRY_ERANGE for a block outside dst). The
 * places are copied. */
int fr_refit_rx_add_target(ferry_refit_receiver *r, const char *name, void *dst, int device,
                           const ferry_tensor_desc *desc, char *const *sources,
                           const fr_refit_piece *pieces, const fr_refit_place *places, uint32_t n,
                           bool fresh);
fr_refit_piece fr_refit_rx_whole_piece(const fr_refit_plan *plan, uint32_t e);
int fr_refit_rx_enter_shards(ferry_refit_receiver *r);
int fr_refit_rx_retarget(ferry_refit_receiver *r);
int fr_refit_rx_ensure_view(ferry_refit_receiver *r);

/* receiver_read.c: the service thread's on_msg (transport/job.h): a record from the sender. */
void fr_refit_rx_service_msg(void *arg, ferry_msg *msg);

#endif
