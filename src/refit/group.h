/*
 * Sharded senders as one model (issue 34; docs/REFIT.md, Sharded senders). A group is `world`
 * senders published as NAME#0 .. NAME#(world-1), each with its own plan whose entries are whole
 * tensors or pieces of global tensors (plan.h: global, gdim, gstart, gstop). A receiver of the
 * group attaches to every rank (one sub-receiver each, all on its one context) and sees the
 * global manifest built here from the ranks' plans. A binding (a whole global tensor, or pieces
 * of global tensors laid along dim 0 of a destination, as ferry_refit_bind_pieces takes) becomes
 * parts: for each rank that holds bytes of it, a slice of that rank's local tensor and where it
 * lands in the destination. Each sub-receiver declares its parts as shard targets (shard.h) and
 * reads only those bytes, straight from its rank.
 *
 * Layout (group_layout.c): pure functions of the plans, no locks, no I/O.
 */
#ifndef FR_REFIT_GROUP_H
#define FR_REFIT_GROUP_H

#include "refit/plan.h"
#include "refit/shard.h"

/* One rank's hold on a global tensor. */
typedef struct fr_group_holder {
  uint32_t rank;
  uint32_t entry;       /* its entry in that rank's plan */
  uint64_t start, stop; /* the slice of the global tensor along the tensor's `dim` it holds
                           (a whole tensor: [0, extent of dim 0), or [0, 1) for a scalar) */
} fr_group_holder;

typedef struct fr_group_tensor {
  char *name;
  ferry_tensor_desc desc;   /* the global shape; dtype: the wire dtype */
  float scale;              /* fp8 casts (whole tensors only: every holder's must agree), else 1 */
  int32_t dim;              /* the dim the ranks cut; -1: every holder holds it whole */
  fr_group_holder *holders; /* pieces: sorted by start, tiling [0, shape[dim]) (empty pieces
                               left out: a tensor of extent 0 has none); whole: by rank */
  uint32_t nholders;
} fr_group_tensor;

typedef struct fr_group_manifest {
  fr_group_tensor *tensors; /* in order of first appearance: rank 0's entries, then rank 1's
                               new ones, ... (a stable order every receiver sees alike) */
  uint32_t count;
  uint32_t world;
  uint32_t *slots; /* fr_group_find's index of the names: tensor + 1 per slot, 0 empty */
  uint64_t nslots; /* a power of two */
} fr_group_manifest;

/* Builds the global manifest from plans[0..world) (plans[r].rank == r, .world == world).
 * Refuses, with an error naming the tensor and the ranks involved: pieces of one global tensor
 * that cut different dims, overlap, leave a gap (or do not start at 0), disagree on dtype or on
 * any other dim; a name held whole by one rank and as pieces by another; whole copies whose
 * shapes, dtypes or fp8 scales differ. FERRY_ESHAPE / FERRY_EDTYPE / FERRY_EINVAL. */
int fr_group_manifest_build(const fr_refit_plan *plans, uint32_t world, fr_group_manifest *out);
void fr_group_manifest_free(fr_group_manifest *m);
/* Index of the global tensor `name`, or -1. */
int64_t fr_group_find(const fr_group_manifest *m, const char *name);

/* A piece of a global tensor that a receiver binds: the elements of tensor `tensor` (index in
 * the group manifest) whose index along `dim` lies in [start, stop). */
typedef struct fr_group_piece {
  uint32_t tensor, dim;
  uint64_t start, stop;
} fr_group_piece;

/* One rank's share of a binding: a slice of that rank's local tensor (entry of its plan, dim,
 * start, stop in local coordinates) and where it lands (shard.h). */
typedef struct fr_group_part {
  uint32_t rank;
  fr_refit_piece src;
  fr_refit_place place;
} fr_group_part;

/* The parts that fill dst (described by dst_desc) with pieces[0..n) laid one after another along
 * its dim 0, as ferry_refit_bind_pieces lays them (a whole tensor: n = 1, its full range of dim
 * 0). Checks that the pieces fit dst_desc (the errors name `target` and the piece, as
 * bind_pieces's do). A tensor held whole by several ranks is read from one of them, holder
 * (tensor + salt) % nholders, so that receivers with different salts spread their reads over the
 * holders. Parts come in the order of the pieces, then of the holders (by start); a piece of no
 * bytes has none. Each part's place lies in [dst, dst + dst_desc's bytes): place.block is its
 * global piece's shape at that piece's rows of dst, place.dim the dim the ranks cut (0 for a
 * whole tensor). Every part of one rank may become one shard target of that rank's
 * sub-receiver (fr_refit_rx_add_target with places). *out is malloc'd (free()). */
int fr_group_parts(const fr_group_manifest *m, const char *target, const fr_group_piece *pieces,
                   uint32_t n, uint8_t *dst, const ferry_tensor_desc *dst_desc, uint64_t salt,
                   fr_group_part **out, size_t *nout);

#endif
