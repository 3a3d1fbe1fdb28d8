/*
 * Shards (shard.h): the runs of the flat wire buffer that a receiver's pieces cover, built the
 * same way by the receiver (where each run lands) and by the sender (what to hash for it), and
 * the VIEW record's piece codec, which validates every field before anything is trusted.
 */
#include "refit/shard.h"
#include "core/core.h"
#include "core/hash.h"
#include "transport/wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int fr_refit_piece_check(const fr_refit_plan *plan, const fr_refit_piece *pc, const char *who) {
  if (pc->entry >= plan->count)
    return fr_err(FERRY_ENOTFOUND, "%s: no such tensor", who);
  const fr_refit_entry *e = &plan->entries[pc->entry];
  uint32_t nd = e->desc.ndim;
  uint64_t extent = nd ? (pc->dim < nd ? e->desc.shape[pc->dim] : 0) : 1;
  if (pc->dim >= (nd ? nd : 1))
    return fr_err(FERRY_ESHAPE, "%s: '%s' has %u dims, no dim %u", who, e->name, nd, pc->dim);
  /* [0:0] of an empty dim is the whole of a zero-size tensor, which tp_shards gives: no bytes */
  if ((pc->start >= pc->stop && !(extent == 0 && pc->stop == 0)) || pc->stop > extent)
    return fr_err(FERRY_ESHAPE, "%s: [%llu:%llu] is not a slice of '%s' dim %u (size %llu)", who,
                  (unsigned long long)pc->start, (unsigned long long)pc->stop, e->name, pc->dim,
                  (unsigned long long)extent);
  return 0;
}

void fr_refit_piece_shape(const fr_refit_plan *plan, const fr_refit_piece *pc,
                          ferry_tensor_desc *out) {
  const fr_refit_entry *e = &plan->entries[pc->entry];
  *out = e->desc;
  out->dtype = e->wire;
  if (out->ndim)
    out->shape[pc->dim] = pc->stop - pc->start;
}

int fr_refit_place_check(const fr_refit_plan *plan, const fr_refit_piece *pc,
                         const fr_refit_place *pl, const char *who) {
  ferry_tensor_desc s;
  char have[96], want[96];
  uint64_t bytes = 0;
  fr_refit_piece_shape(plan, pc, &s);
  if (!pl->dst)
    return fr_err(FERRY_EINVAL, "%s: lands nowhere (no destination)", who);
  if (pl->block.dtype != s.dtype)
    return fr_err(FERRY_EDTYPE, "%s arrives as %s, its destination block is %s", who,
                  ferry_dtype_name(s.dtype), ferry_dtype_name(pl->block.dtype) ?: "?");
  bool fits = pl->block.ndim == s.ndim && pl->dim < (s.ndim ? s.ndim : 1) &&
              ferry_tensor_nbytes(&pl->block, &bytes) == 0;
  for (uint32_t d = 0; fits && d < s.ndim; d++)
    fits = d == pl->dim ? pl->at <= pl->block.shape[d] && s.shape[d] <= pl->block.shape[d] - pl->at
                        : s.shape[d] == pl->block.shape[d];
  if (!fits || (s.ndim == 0 && pl->at != 0))
    return fr_err(FERRY_ESHAPE, "%s is %s: it does not fit at %llu along dim %u of a block %s", who,
                  ferry_shape_format(&s, have, sizeof have), (unsigned long long)pl->at, pl->dim,
                  ferry_shape_format(&pl->block, want, sizeof want));
  return 0;
}

typedef struct runs {
  fr_refit_run *v;
  size_t n, cap;
} runs;

static int push_run(runs *rs, uint64_t off, uint64_t len, uint8_t *dst) {
  if (FR_GROW(rs->v, rs->cap, rs->n + 1, 64) != 0)
    return fr_err(FERRY_ENOMEM, "refit: %zu shard runs", rs->n + 1);
  rs->v[rs->n++] = (fr_refit_run){off, len, dst};
  return 0;
}

/* Where a piece's bytes land: its byte q (in the piece's row-major order) at
 * base + (q / chunk) * stride + q % chunk. A chunk (the piece's extent along its place's dim and
 * everything after) is contiguous in the block, whose rows along that dim lie `stride` apart;
 * without a place (or a place along dim 0) the whole piece is one chunk from base. */
typedef struct landing {
  uint8_t *base;
  uint64_t chunk, stride;
} landing;

static uint8_t *landing_at(const landing *l, uint64_t q) {
  return l->base ? l->base + (q / l->chunk) * l->stride + q % l->chunk : NULL;
}

static landing place_landing(const fr_refit_plan *plan, const fr_refit_piece *pc,
                             const fr_refit_place *pl) {
  ferry_tensor_desc s;
  fr_refit_piece_shape(plan, pc, &s);
  if (s.ndim == 0)
    return (landing){pl->dst, UINT64_MAX, 0};
  uint64_t inner = ferry_dtype_size(s.dtype);
  for (uint32_t d = pl->dim + 1; d < s.ndim; d++)
    inner *= s.shape[d];
  uint64_t chunk = s.shape[pl->dim] * inner, stride = pl->block.shape[pl->dim] * inner;
  if (pl->dim == 0 || chunk == stride || chunk == 0) /* one chunk */
    chunk = UINT64_MAX;
  return (landing){pl->dst + pl->at * inner, chunk, stride};
}

/* A run before its cuts to fit a destination: what the sender's view holds (off, len), the
 * piece's byte q at off, and the piece's landing (by index). */
typedef struct span {
  uint64_t off, len, q, landing;
} span;

/* Where piece runs go: straight into runs (dst = l's address of q, or none on the sender), or
 * into spans, cut to their destinations once sorted. */
typedef struct sink {
  runs *rs;
  span *v;
  size_t n, cap;
  landing l; /* the piece's */
  bool spans;
  landing *ls; /* spans: every piece's landing */
  size_t nls, lcap;
} sink;

static int push_span(sink *k, uint64_t off, uint64_t len, uint64_t q) {
  if (FR_GROW(k->v, k->cap, k->n + 1, 1024) != 0)
    return fr_err(FERRY_ENOMEM, "refit: %zu shard runs", k->n + 1);
  k->v[k->n++] = (span){off, len, q, k->nls - 1};
  return 0;
}

/* The landing of the piece whose runs come next. */
static int sink_landing(sink *k, landing l) {
  k->l = l;
  if (!k->spans)
    return 0;
  if (FR_GROW(k->ls, k->lcap, k->nls + 1, 64) != 0)
    return fr_err(FERRY_ENOMEM, "refit: %zu shard pieces", k->nls + 1);
  k->ls[k->nls++] = l;
  return 0;
}

/* Adds [off, off+len) of the wire buffer, the piece's bytes from q, cut at bucket boundaries. */
static int add_run(sink *k, uint64_t bb, uint64_t off, uint64_t len, uint64_t q) {
  while (len > 0) {
    uint64_t room = bb - off % bb, n = len < room ? len : room;
    int rc = k->spans ? push_span(k, off, n, q) : push_run(k->rs, off, n, landing_at(&k->l, q));
    if (rc != 0)
      return rc;
    off += n, len -= n, q += n;
  }
  return 0;
}

/* The runs of one piece, in source order: the piece's bytes in row-major order. */
static int piece_runs(const fr_refit_plan *plan, const fr_refit_piece *pc, sink *k) {
  const fr_refit_entry *e = &plan->entries[pc->entry];
  uint64_t es = ferry_dtype_size(e->wire), outer = 1, inner = es;
  if (e->desc.ndim == 0)
    return add_run(k, plan->bucket_bytes, e->offset, es, 0);
  for (uint32_t d = 0; d < pc->dim; d++)
    outer *= e->desc.shape[d];
  for (uint32_t d = pc->dim + 1; d < e->desc.ndim; d++)
    inner *= e->desc.shape[d];
  uint64_t mid = e->desc.shape[pc->dim], len = (pc->stop - pc->start) * inner;
  if (len == mid * inner) /* the whole of each row: one contiguous run */
    return add_run(k, plan->bucket_bytes, e->offset + pc->start * inner, outer * len, 0);
  for (uint64_t o = 0; o < outer; o++) {
    int rc =
        add_run(k, plan->bucket_bytes, e->offset + (o * mid + pc->start) * inner, len, o * len);
    if (rc != 0)
      return rc;
  }
  return 0;
}

uint64_t fr_refit_piece_rows(const fr_refit_plan *plan, const fr_refit_piece *pc, uint64_t *bytes) {
  const fr_refit_entry *e = &plan->entries[pc->entry];
  uint64_t outer = 1, inner = ferry_dtype_size(e->wire);
  if (e->desc.ndim == 0) {
    *bytes = inner;
    return 1;
  }
  for (uint32_t d = 0; d < pc->dim; d++)
    outer *= e->desc.shape[d];
  for (uint32_t d = pc->dim + 1; d < e->desc.ndim; d++)
    inner *= e->desc.shape[d];
  *bytes = outer * (pc->stop - pc->start) * inner;
  return pc->stop - pc->start == e->desc.shape[pc->dim] ? 1 : outer;
}

static int run_cmp(const void *a, const void *b) {
  const fr_refit_run *x = a, *y = b;
  if (x->off != y->off)
    return x->off < y->off ? -1 : 1;
  if (x->len != y->len)
    return x->len < y->len ? -1 : 1;
  return (x->dst > y->dst) - (x->dst < y->dst);
}

static int view_index(const fr_refit_plan *plan, fr_refit_view *v) {
  v->first = calloc((size_t)plan->buckets + 1, sizeof *v->first);
  if (!v->first)
    return fr_err(FERRY_ENOMEM, "refit: shard view of %u buckets", plan->buckets);
  uint64_t i = 0;
  for (uint32_t b = 0; b <= plan->buckets; b++) {
    uint64_t start = (uint64_t)b * plan->bucket_bytes;
    while (i < v->nruns && v->runs[i].off < start)
      i++;
    v->first[b] = i;
  }
  v->first[plan->buckets] = v->nruns;
  return 0;
}

/* By offset, then length (as runs), then piece: equal runs hash the same bytes in any order. */
static int span_cmp(const void *a, const void *b) {
  const span *x = a, *y = b;
  if (x->off != y->off)
    return x->off < y->off ? -1 : 1;
  if (x->len != y->len)
    return x->len < y->len ? -1 : 1;
  if (x->landing != y->landing)
    return x->landing < y->landing ? -1 : 1;
  return (x->q > y->q) - (x->q < y->q);
}

/* Sorts n items by cmp, unless they are in order already (targets bound in the order of the
 * sender's tensors, the usual case: a sort of a million runs costs far more than this look). */
static void sort_once(void *items, size_t n, size_t size, int (*cmp)(const void *, const void *)) {
  const char *v = items;
  size_t i = 1;
  while (i < n && cmp(v + (i - 1) * size, v + i * size) <= 0)
    i++;
  if (i < n)
    qsort(items, n, size, cmp);
}

/* The runs of every target's pieces into k: each piece from where the one before it ended in
 * the target's dst, or at its place. */
static int target_runs(const fr_refit_plan *plan, const fr_refit_target *targets, size_t n,
                       sink *k) {
  for (size_t t = 0; t < n; t++) {
    uint8_t *dst = targets[t].dst;
    for (uint32_t i = 0; i < targets[t].npieces; i++) {
      const fr_refit_piece *pc = &targets[t].pieces[i];
      ferry_tensor_desc d;
      uint64_t bytes = 0;
      fr_refit_piece_shape(plan, pc, &d);
      int rc = ferry_tensor_nbytes(&d, &bytes);
      if (rc == 0)
        rc = sink_landing(k, targets[t].places ? place_landing(plan, pc, &targets[t].places[i])
                                               : (landing){dst, UINT64_MAX, 0});
      if (rc == 0)
        rc = piece_runs(plan, pc, k);
      if (rc != 0)
        return rc;
      dst = dst ? dst + bytes : NULL;
    }
  }
  return 0;
}

/* Cuts each span (sorted) where its destination is not contiguous; the stretches stay together
 * where the span was, so the bytes in view order are the sender's, whose view has no places. */
static int cut_spans(const sink *k, runs *rs) {
  size_t n = 0;
  for (size_t i = 0; i < k->n; i++) { /* first the count: one allocation */
    const landing *l = &k->ls[k->v[i].landing];
    n += (k->v[i].q + k->v[i].len - 1) / l->chunk - k->v[i].q / l->chunk + 1;
  }
  if (n && FR_GROW(rs->v, rs->cap, n, 64) != 0)
    return fr_err(FERRY_ENOMEM, "refit: %zu shard runs", n);
  for (size_t i = 0; i < k->n; i++) {
    const span *sp = &k->v[i];
    const landing *l = &k->ls[sp->landing];
    for (uint64_t off = sp->off, len = sp->len, q = sp->q; len > 0;) {
      uint64_t room = l->chunk - q % l->chunk, m = len < room ? len : room;
      rs->v[rs->n++] = (fr_refit_run){off, m, landing_at(l, q)};
      off += m, len -= m, q += m;
    }
  }
  return 0;
}

int fr_refit_view_build(const fr_refit_plan *plan, const fr_refit_target *targets, size_t n,
                        uint32_t serial, fr_refit_view **out) {
  bool placed = false;
  for (size_t t = 0; t < n; t++)
    placed |= targets[t].npieces && targets[t].places;
  runs rs = {0};
  sink k = {.rs = &rs, .spans = placed};
  int rc = target_runs(plan, targets, n, &k);
  if (rc == 0 && placed) {
    sort_once(k.v, k.n, sizeof *k.v, span_cmp);
    rc = cut_spans(&k, &rs);
  }
  free(k.v);
  free(k.ls);
  fr_refit_view *v = rc == 0 ? calloc(1, sizeof *v) : NULL;
  if (rc == 0 && !v)
    rc = fr_err(FERRY_ENOMEM, "refit: shard view");
  if (rc != 0) {
    free(rs.v);
    return rc;
  }
  if (!placed)
    sort_once(rs.v, rs.n, sizeof *rs.v, run_cmp);
  v->serial = serial;
  v->runs = rs.v;
  v->nruns = rs.n;
  for (uint64_t i = 0; i < rs.n; i++)
    v->bytes += rs.v[i].len;
  if ((rc = view_index(plan, v)) != 0) {
    fr_refit_view_free(v);
    return rc;
  }
  *out = v;
  return 0;
}

void fr_refit_view_free(fr_refit_view *v) {
  if (!v)
    return;
  free(v->runs);
  free(v->first);
  free(v);
}

uint64_t fr_refit_view_sum(const fr_refit_plan *plan, const fr_refit_view *v, uint32_t b,
                           const uint8_t *bucket) {
  uint64_t start = (uint64_t)b * plan->bucket_bytes;
  fr_hash *h = fr_hash_begin();
  for (uint64_t i = v->first[b]; i < v->first[b + 1]; i++)
    fr_hash_update(h, bucket + (v->runs[i].off - start), v->runs[i].len);
  return fr_hash_end(h);
}

void fr_refit_view_feed_begin(fr_refit_feed *f, const fr_refit_view *v, uint32_t b) {
  *f = (fr_refit_feed){.v = v, .h = fr_hash_begin(), .next = v->first[b], .pos = 0};
}

void fr_refit_view_feed(const fr_refit_plan *plan, fr_refit_feed *f, uint32_t b, uint64_t lo,
                        uint64_t n, const uint8_t *window) {
  uint64_t start = (uint64_t)b * plan->bucket_bytes + lo, end = start + n;
  while (f->next < f->v->first[b + 1]) {
    const fr_refit_run *run = &f->v->runs[f->next];
    uint64_t from = run->off + f->pos, to = run->off + run->len < end ? run->off + run->len : end;
    if (from >= end)
      return;
    fr_hash_update(f->h, window + (from - start), to - from);
    if (to < run->off + run->len) {
      f->pos = to - run->off;
      return;
    }
    f->next++;
    f->pos = 0;
  }
}

void fr_refit_pieces_encode(const fr_refit_piece *pieces, uint32_t n, uint8_t *out) {
  for (uint32_t i = 0; i < n; i++, out += FR_REFIT_PIECE_BYTES) {
    fr_put_u32(out, pieces[i].entry);
    fr_put_u32(out + 4, pieces[i].dim);
    fr_put_u64(out + 8, pieces[i].start);
    fr_put_u64(out + 16, pieces[i].stop);
  }
}

int fr_refit_pieces_decode(const uint8_t *in, size_t len, uint32_t n, fr_refit_piece *out) {
  if (n > FR_REFIT_PIECES_MAX || len != (size_t)n * FR_REFIT_PIECE_BYTES)
    return fr_err(FERRY_EPROTO, "refit view: %u pieces in %zu bytes", n, len);
  for (uint32_t i = 0; i < n; i++, in += FR_REFIT_PIECE_BYTES) {
    out[i] = (fr_refit_piece){fr_get_u32(in), fr_get_u32(in + 4), fr_get_u64(in + 8),
                              fr_get_u64(in + 16)};
    if (out[i].dim >= FERRY_MAX_DIMS || out[i].start > out[i].stop) /* [0:0]: piece_check */
      return fr_err(FERRY_EPROTO, "refit view: piece %u is not a slice", i);
  }
  return 0;
}
