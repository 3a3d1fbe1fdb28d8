/*
 * The refit plan: made once when the sender seals, replayed every push.
 *
 * Every declared tensor gets a place in one logical flat buffer laid out in the wire dtype
 * (after any cast), each tensor aligned to FR_REFIT_ALIGN. Buckets are fixed windows of that
 * buffer: bucket i is bytes [i * bucket_bytes, (i + 1) * bucket_bytes). A tensor may span
 * buckets; whoever packs or unpacks a bucket copies the part of each tensor that overlaps it.
 * A receiver with a flat destination buffer therefore gets every bucket in place.
 *
 * The manifest is the plan's wire form, sent to a receiver once when it attaches (and again
 * only when the sender re-seals with a new generation).
 */
#ifndef FR_REFIT_PLAN_H
#define FR_REFIT_PLAN_H

#include "ferry.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define FR_REFIT_ALIGN 64u
#define FR_REFIT_NAME_MAX 255u
#define FR_REFIT_MAX_TENSORS (1u << 20)
#define FR_REFIT_MAX_WORLD (1u << 16) /* ranks of a sharded sender group */

typedef struct fr_refit_entry {
  char *name;
  ferry_tensor_desc desc; /* the sender's tensor (source dtype) */
  ferry_dtype wire;       /* dtype on the wire and at the receiver */
  float scale;            /* fp8 casts: wire value = source value / scale */
  uint64_t src_bytes, wire_bytes;
  uint64_t offset; /* in the flat wire buffer */
  /* Sharded senders (ferry_refit_declare_piece): the global tensor this entry is a piece of, and
   * the slice [gstart, gstop) along gdim it holds; global NULL: whole under its own name. */
  char *global;
  uint32_t gdim;
  uint64_t gstart, gstop;
} fr_refit_entry;

typedef struct fr_refit_plan {
  fr_refit_entry *entries;
  uint32_t count;
  uint64_t total_bytes;  /* of the flat wire buffer */
  uint64_t bucket_bytes; /* window size (a multiple of FR_REFIT_ALIGN) */
  uint32_t buckets;
  uint32_t generation;  /* bumped by every re-seal */
  uint32_t rank, world; /* sharded senders: this sender's rank of `world` (world 1: alone) */
} fr_refit_plan;

/* Lays out `count` entries (names and descs filled in; wire == INVALID means no cast) under a
 * bucket budget. FERRY_EDTYPE for a cast this build does not do. */
int fr_refit_plan_build(fr_refit_plan *plan, uint64_t bucket_budget);
void fr_refit_plan_free(fr_refit_plan *plan);
/* Index of the entry named `name`, or -1. */
int64_t fr_refit_plan_find(const fr_refit_plan *plan, const char *name);
/* The part of entry e that bucket b holds: [*wire_off, +*len) of the tensor's wire bytes and
 * where that lands in the bucket. Returns 0 when they do not overlap. */
uint64_t fr_refit_overlap(const fr_refit_plan *plan, uint32_t e, uint32_t b, uint64_t *wire_off,
                          uint64_t *bucket_off);
/* The same for any window [start, start+len) of the flat buffer. */
uint64_t fr_refit_overlap_window(const fr_refit_plan *plan, uint32_t e, uint64_t start,
                                 uint64_t len, uint64_t *wire_off, uint64_t *window_off);
/* First entry that may overlap bucket b (entries are sorted by offset). */
uint32_t fr_refit_first_entry(const fr_refit_plan *plan, uint32_t b);
static inline uint64_t fr_refit_bucket_len(const fr_refit_plan *p, uint32_t b) {
  uint64_t start = (uint64_t)b * p->bucket_bytes;
  return p->total_bytes - start < p->bucket_bytes ? p->total_bytes - start : p->bucket_bytes;
}

/* Manifest codec. encode allocates *out (free()); decode validates everything. */
int fr_refit_manifest_encode(const fr_refit_plan *plan, uint8_t **out, size_t *len);
int fr_refit_manifest_decode(const uint8_t *in, size_t len, fr_refit_plan *plan);

/* Casts: convert `count` elements from src (dtype `from`) to dst (dtype `to`). Supported:
 * identity, f32→bf16, f32→f16, bf16→f8e4m3 and f32→f8e4m3 (divided by scale). */
int fr_refit_cast(ferry_dtype from, ferry_dtype to, float scale, const void *src, void *dst,
                  uint64_t count);
bool fr_refit_cast_supported(ferry_dtype from, ferry_dtype to);
/* The per-tensor scale for an fp8 cast: max |x| / 448 (1 when all zero). */
float fr_refit_fp8_scale(ferry_dtype from, const void *src, uint64_t count);
/* The same in steps, for a tensor read a piece at a time (device memory, through a host copy):
 * amax = fr_refit_amax(from, piece, n, amax) over the pieces from 0, then the scale of it. */
float fr_refit_amax(ferry_dtype from, const void *src, uint64_t count, float amax);
float fr_refit_fp8_scale_of(float amax);

#endif
