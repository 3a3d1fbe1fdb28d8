/*
 * Shards: a receiver that binds slices of the sender's tensors (a tensor-parallel rank) reads
 * only their bytes. A piece is (source tensor, dim, start, stop): the source's elements whose
 * index along `dim` lies in [start, stop). In the flat wire buffer that is a list of runs (one
 * per index of the dims before `dim`; a dim-0 slice is one run). A target is the caller's
 * destination: its pieces laid one after another in row-major order (so along its dim 0).
 *
 * The receiver declares each target's pieces to the sender (VIEW records, by tensor index of the
 * manifest generation). Both ends build the same view from the same declarations: every run of
 * every target, cut at bucket boundaries and sorted by offset. The sender hashes, per bucket, the
 * bytes of the receiver's runs in that order (XXH3 streamed over the runs) and announces that sum
 * with the view's serial beside the whole bucket's checksum; the receiver reads only its runs,
 * hashes them as they land and commits only when every bucket's sum matched. A bucket announced
 * under another serial (the receiver bound more since) is read whole and checked against the
 * bucket's checksum, so a shard reader never takes bytes nobody verified.
 */
#ifndef FR_REFIT_SHARD_H
#define FR_REFIT_SHARD_H

#include "core/hash.h"
#include "refit/plan.h"

#define FR_REFIT_PIECES_MAX 4096u       /* per target */
#define FR_REFIT_TARGETS_MAX (1u << 20) /* per receiver */
/* What a sender takes from one receiver's declarations, so that what it allocates for them (the
 * target table, the view it builds and hashes under its lock) is bounded by its own model, never
 * by what a receiver sends. Beyond these the declaration is refused (FERRY_ECAPACITY) and that
 * receiver reads whole buckets. Runs: a slice along dim d > 0 is one run per index before d; a
 * tensor-parallel rank of a 70B model (80 layers, o [8192, 8192] and down [8192, 28672] sliced
 * along dim 1, the rest along dim 0: one run each) declares 80 * 2 * 8192 = 1.31M, whatever the
 * world size; 4M leaves three times that (the sender's view of it: about 100 MB). Bytes: all
 * pieces together at most twice the model (a slice bound to two targets, as tied embeddings). */
#define FR_REFIT_VIEW_RUNS_MAX (1u << 22)
#define FR_REFIT_VIEW_OVERLAP 2u
#define FR_REFIT_TABLE_BYTES_MAX (4u << 20) /* the target table: slots and pieces */

/* A piece on the wire and in both ends' tables: the source by index in the manifest. */
typedef struct fr_refit_piece {
  uint32_t entry, dim;
  uint64_t start, stop;
} fr_refit_piece;
#define FR_REFIT_PIECE_BYTES 24

/* Where a source piece's bytes land: in a destination block of shape `block` (row-major at dst)
 * that the piece's shape equals on every dim but `dim`, where the piece covers
 * [at, at + its extent). The plain bind_pieces layout (pieces one after another) is dim 0. */
typedef struct fr_refit_place {
  uint8_t *dst;
  ferry_tensor_desc block;
  uint32_t dim;
  uint64_t at;
} fr_refit_place;

/* A target: its pieces and (receiver) where they land; dst NULL on the sender. */
typedef struct fr_refit_target {
  uint32_t npieces; /* 0: the slot is empty */
  fr_refit_piece *pieces;
  uint8_t *dst;
  /* receiver, a group's sub-receiver (group.h): per piece, where it lands, or NULL: the pieces
   * one after another from dst. The sender never sees these: a run cut further to fit its
   * destination hashes the same bytes in the same order. */
  fr_refit_place *places;
} fr_refit_target;

/* The runs piece pc is read in before cuts at bucket boundaries (1 for a contiguous slice, else
 * one per index before its dim), and its bytes; pc checked (fr_refit_piece_check). */
uint64_t fr_refit_piece_rows(const fr_refit_plan *plan, const fr_refit_piece *pc, uint64_t *bytes);

/* A run of the flat wire buffer and where it lands (receiver: an address; sender: 0). */
typedef struct fr_refit_run {
  uint64_t off, len;
  uint8_t *dst;
} fr_refit_run;

typedef struct fr_refit_view {
  uint32_t serial;    /* the declaration it was built from */
  fr_refit_run *runs; /* sorted by off, none crossing a bucket boundary (a run cut to fit its
                         places: its stretches together, in order, where the run is) */
  uint64_t nruns;
  uint64_t *first; /* per bucket b: runs [first[b], first[b+1]) lie in it */
  uint64_t bytes;  /* of all runs: what a push reads */
} fr_refit_view;

/* Checks a piece against the plan; the error says what does not fit, led by `who`. */
int fr_refit_piece_check(const fr_refit_plan *plan, const fr_refit_piece *pc, const char *who);
/* The piece's shape: the source's with dim `dim` cut to stop - start. */
void fr_refit_piece_shape(const fr_refit_plan *plan, const fr_refit_piece *pc,
                          ferry_tensor_desc *out);
/* Checks that piece pc (already checked) fits its place: a block of the piece's wire dtype and
 * as many dims, equal to the piece's shape on every dim but place->dim, along which [at, at + the
 * piece's extent) lies within the block. The error says what does not fit, led by `who`. */
int fr_refit_place_check(const fr_refit_plan *plan, const fr_refit_piece *pc,
                         const fr_refit_place *pl, const char *who);
/* Builds the view of targets [0, n) (each piece, and place, already checked). A target with
 * places cuts its runs further, one stretch per contiguous range of its destination blocks; the
 * stretches of a run stay together where the run was, so that the bytes of the view's runs, in
 * order, are those of the same targets' view without places (the sender's). */
int fr_refit_view_build(const fr_refit_plan *plan, const fr_refit_target *targets, size_t n,
                        uint32_t serial, fr_refit_view **out);
void fr_refit_view_free(fr_refit_view *v);
/* The sum of the view's runs in bucket b, whose bytes lie at `bucket`. */
uint64_t fr_refit_view_sum(const fr_refit_plan *plan, const fr_refit_view *v, uint32_t b,
                           const uint8_t *bucket);

/* The same, fed while the bucket is packed: a view's running sum over bucket b, taking the runs'
 * bytes that lie in each window [lo, lo+n) of the bucket as it is filled (windows in order, the
 * bytes before them still in place); after the bucket's last window, fr_hash_end gives what
 * fr_refit_view_sum would. */
typedef struct fr_refit_feed {
  const fr_refit_view *v;
  fr_hash *h;
  uint64_t next; /* the run being fed */
  uint64_t pos;  /* bytes of it fed so far */
} fr_refit_feed;
void fr_refit_view_feed_begin(fr_refit_feed *f, const fr_refit_view *v, uint32_t b);
/* Feeds the view's runs within [lo, lo+n) of bucket b; `window` holds those n bytes. */
void fr_refit_view_feed(const fr_refit_plan *plan, fr_refit_feed *f, uint32_t b, uint64_t lo,
                        uint64_t n, const uint8_t *window);

/* VIEW record body: the pieces of one target slot, after the fixed record. */
void fr_refit_pieces_encode(const fr_refit_piece *pieces, uint32_t n, uint8_t *out);
int fr_refit_pieces_decode(const uint8_t *in, size_t len, uint32_t n, fr_refit_piece *out);

#endif
