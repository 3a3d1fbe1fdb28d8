/*
 * Sharded refit's layout (group.h): the global manifest that a receiver of a group sees, built
 * from the ranks' plans and checked across them (every refusal names the tensor and the ranks),
 * and the parts a binding turns into: which slice of which rank's local tensor lands where in the
 * caller's destination. Pure functions of the plans: no locks, no I/O. The plans come from the
 * ranks' manifests, so nothing in them is trusted: every piece is checked against its entry.
 */
#include "refit/group.h"
#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the name index: open addressing, slot value = tensor index + 1 (0: empty) ---- */

static uint64_t name_hash(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
  for (; *s; s++)
    h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
  return h;
}

static int64_t index_find(const fr_group_manifest *m, const char *name, uint64_t *slot) {
  uint64_t mask = m->nslots - 1;
  for (uint64_t i = name_hash(name) & mask;; i = (i + 1) & mask) {
    uint32_t v = m->slots[i];
    if (v == 0 || strcmp(m->tensors[v - 1].name, name) == 0) {
      if (slot)
        *slot = i;
      return (int64_t)v - 1;
    }
  }
}

int64_t fr_group_find(const fr_group_manifest *m, const char *name) {
  return m && m->nslots && name ? index_find(m, name, NULL) : -1;
}

void fr_group_manifest_free(fr_group_manifest *m) {
  if (!m)
    return;
  for (uint32_t i = 0; m->tensors && i < m->count; i++) {
    free(m->tensors[i].name);
    free(m->tensors[i].holders);
  }
  free(m->tensors);
  free(m->slots);
  memset(m, 0, sizeof *m);
}

/* ---- building ---- */

static const fr_refit_entry *entry_of(const fr_refit_plan *plans, const fr_group_holder *h) {
  return &plans[h->rank].entries[h->entry];
}

static const char *global_name(const fr_refit_entry *e) { return e->global ? e->global : e->name; }

/* Every global name once, in order of first appearance, with the number of its holders. */
static int collect_names(const fr_refit_plan *plans, uint32_t world, fr_group_manifest *m) {
  uint64_t total = 0;
  for (uint32_t r = 0; r < world; r++)
    total += plans[r].count;
  if (total > (uint64_t)FR_REFIT_MAX_TENSORS * 64)
    return fr_err(FERRY_ECAPACITY, "refit group: %llu tensors over %u ranks",
                  (unsigned long long)total, world);
  m->nslots = 16;
  while (m->nslots < total * 2)
    m->nslots *= 2;
  m->slots = calloc(m->nslots, sizeof *m->slots);
  m->tensors = calloc(total ? total : 1, sizeof *m->tensors);
  if (!m->slots || !m->tensors)
    return fr_err(FERRY_ENOMEM, "refit group: a manifest of %llu tensors",
                  (unsigned long long)total);
  for (uint32_t r = 0; r < world; r++) {
    for (uint32_t e = 0; e < plans[r].count; e++) {
      const char *name = global_name(&plans[r].entries[e]);
      uint64_t slot = 0;
      int64_t t = index_find(m, name, &slot);
      if (t < 0) {
        t = m->count;
        if (!(m->tensors[t].name = strdup(name)))
          return fr_err(FERRY_ENOMEM, "refit group: tensor '%s'", name);
        m->count++;
        m->slots[slot] = (uint32_t)t + 1;
      }
      m->tensors[t].nholders++;
    }
  }
  fr_group_tensor *fit = realloc(m->tensors, (m->count ? m->count : 1) * sizeof *fit);
  m->tensors = fit ? fit : m->tensors; /* room for every entry was taken; keep what is used */
  return 0;
}

/* Each tensor's holders, in rank order (then entry order). */
static int collect_holders(const fr_refit_plan *plans, uint32_t world, fr_group_manifest *m) {
  for (uint32_t t = 0; t < m->count; t++) {
    m->tensors[t].holders = calloc(m->tensors[t].nholders, sizeof(fr_group_holder));
    if (!m->tensors[t].holders)
      return fr_err(FERRY_ENOMEM, "refit group: holders of '%s'", m->tensors[t].name);
    m->tensors[t].nholders = 0;
  }
  for (uint32_t r = 0; r < world; r++) {
    for (uint32_t e = 0; e < plans[r].count; e++) {
      const fr_refit_entry *x = &plans[r].entries[e];
      fr_group_tensor *t = &m->tensors[index_find(m, global_name(x), NULL)];
      fr_group_holder h = {.rank = r, .entry = e, .start = 0, .stop = 1};
      if (x->global)
        h.start = x->gstart, h.stop = x->gstop;
      else if (x->desc.ndim)
        h.stop = x->desc.shape[0];
      t->holders[t->nholders++] = h;
    }
  }
  return 0;
}

static char *shape_text(const ferry_tensor_desc *d, char *buf, size_t len) {
  return ferry_shape_format(d, buf, len) ? buf : "?";
}

/* The copies of a tensor held whole: one shape, one wire dtype, one fp8 scale. */
static int check_whole(const fr_refit_plan *plans, fr_group_tensor *t) {
  const fr_group_holder *h0 = &t->holders[0];
  const fr_refit_entry *x0 = entry_of(plans, h0);
  char a[96], b[96];
  for (uint32_t i = 1; i < t->nholders; i++) {
    const fr_group_holder *h = &t->holders[i];
    const fr_refit_entry *x = entry_of(plans, h);
    if (x->desc.ndim != x0->desc.ndim ||
        memcmp(x->desc.shape, x0->desc.shape, sizeof(uint64_t) * x0->desc.ndim) != 0)
      return fr_err(FERRY_ESHAPE, "refit group: '%s' is %s on rank %u but %s on rank %u", t->name,
                    shape_text(&x0->desc, a, sizeof a), h0->rank, shape_text(&x->desc, b, sizeof b),
                    h->rank);
    if (x->wire != x0->wire)
      return fr_err(FERRY_EDTYPE,
                    "refit group: '%s' arrives as %s from rank %u but %s from rank %u", t->name,
                    ferry_dtype_name(x0->wire), h0->rank, ferry_dtype_name(x->wire), h->rank);
    if (x0->wire == FERRY_DTYPE_F8E4M3 && x->scale != x0->scale)
      return fr_err(FERRY_EINVAL,
                    "refit group: the copies of '%s' on ranks %u and %u carry different fp8 "
                    "scales (%g, %g): replicas must hold the same values",
                    t->name, h0->rank, h->rank, (double)x0->scale, (double)x->scale);
  }
  t->dim = -1;
  t->desc = x0->desc;
  t->desc.dtype = x0->wire;
  t->scale = x0->wire == FERRY_DTYPE_F8E4M3 ? x0->scale : 1.0f;
  return 0;
}

/* A piece against its own entry: a slice of a dim the entry has, as long as the entry is. */
static int check_piece_entry(const fr_refit_plan *plans, const fr_group_tensor *t,
                             const fr_group_holder *h) {
  const fr_refit_entry *x = entry_of(plans, h);
  if (x->desc.ndim == 0 || x->gdim >= x->desc.ndim || h->start > h->stop ||
      x->desc.shape[x->gdim] != h->stop - h->start)
    return fr_err(FERRY_ESHAPE,
                  "refit group: rank %u's '%s' (%u dims) is not piece [%llu:%llu] along dim %u of "
                  "'%s'",
                  h->rank, x->name, x->desc.ndim, (unsigned long long)h->start,
                  (unsigned long long)h->stop, x->gdim, t->name);
  return 0;
}

/* A piece against the first: the same cut dim, the same other dims, wire dtype and fp8 scale. */
static int check_piece_alike(const fr_refit_plan *plans, const fr_group_tensor *t,
                             const fr_group_holder *h0, const fr_group_holder *h) {
  const fr_refit_entry *x0 = entry_of(plans, h0), *x = entry_of(plans, h);
  char a[96], b[96];
  if (x->gdim != x0->gdim)
    return fr_err(FERRY_ESHAPE, "refit group: rank %u cuts '%s' along dim %u, rank %u along dim %u",
                  h0->rank, t->name, x0->gdim, h->rank, x->gdim);
  bool same = x->desc.ndim == x0->desc.ndim;
  for (uint32_t d = 0; same && d < x0->desc.ndim; d++)
    same = d == x0->gdim || x->desc.shape[d] == x0->desc.shape[d];
  if (!same)
    return fr_err(FERRY_ESHAPE,
                  "refit group: the pieces of '%s' differ beyond dim %u: %s on rank %u, %s on "
                  "rank %u",
                  t->name, x0->gdim, shape_text(&x0->desc, a, sizeof a), h0->rank,
                  shape_text(&x->desc, b, sizeof b), h->rank);
  if (x->wire != x0->wire)
    return fr_err(FERRY_EDTYPE, "refit group: '%s' arrives as %s from rank %u but %s from rank %u",
                  t->name, ferry_dtype_name(x0->wire), h0->rank, ferry_dtype_name(x->wire),
                  h->rank);
  if (x0->wire == FERRY_DTYPE_F8E4M3 && x->scale != x0->scale)
    return fr_err(FERRY_EINVAL,
                  "refit group: the pieces of '%s' on ranks %u and %u carry different fp8 scales "
                  "(%g, %g): one tensor has one scale (declare it without the fp8 cast, or whole)",
                  t->name, h0->rank, h->rank, (double)x0->scale, (double)x->scale);
  return 0;
}

static int holder_cmp(const void *a, const void *b) {
  const fr_group_holder *x = a, *y = b;
  if (x->start != y->start)
    return x->start < y->start ? -1 : 1;
  if (x->stop != y->stop)
    return x->stop < y->stop ? -1 : 1;
  return x->rank != y->rank ? (x->rank < y->rank ? -1 : 1)
                            : (x->entry > y->entry) - (x->entry < y->entry);
}

/* The pieces, sorted, tile [0, extent) with no overlap and no gap; empty ones are dropped. */
static int check_tiling(fr_group_tensor *t, uint32_t dim, uint64_t *extent) {
  qsort(t->holders, t->nholders, sizeof *t->holders, holder_cmp);
  uint64_t pos = 0;
  uint32_t k = 0;
  const fr_group_holder *prev = NULL;
  fr_group_holder stray = {0}; /* the first empty piece beyond the pieces so far, if any */
  bool strays = false;
  for (uint32_t i = 0; i < t->nholders; i++) {
    const fr_group_holder *h = &t->holders[i];
    if (h->start == h->stop) { /* holds nothing; beyond the end it is no piece of the tensor */
      if (h->start > pos && !strays)
        stray = *h, strays = true;
      continue;
    }
    if (h->start > pos && !prev)
      return fr_err(FERRY_ESHAPE,
                    "refit group: no rank holds [0:%llu] of '%s' along dim %u (the first piece, "
                    "rank %u's, starts at %llu)",
                    (unsigned long long)h->start, t->name, dim, h->rank,
                    (unsigned long long)h->start);
    if (h->start > pos)
      return fr_err(FERRY_ESHAPE,
                    "refit group: the pieces of '%s' along dim %u leave a gap [%llu:%llu] between "
                    "rank %u's [%llu:%llu] and rank %u's [%llu:%llu]",
                    t->name, dim, (unsigned long long)pos, (unsigned long long)h->start, prev->rank,
                    (unsigned long long)prev->start, (unsigned long long)prev->stop, h->rank,
                    (unsigned long long)h->start, (unsigned long long)h->stop);
    if (h->start < pos)
      return fr_err(FERRY_ESHAPE,
                    "refit group: the pieces of '%s' along dim %u overlap: rank %u holds "
                    "[%llu:%llu], rank %u [%llu:%llu]",
                    t->name, dim, prev->rank, (unsigned long long)prev->start,
                    (unsigned long long)prev->stop, h->rank, (unsigned long long)h->start,
                    (unsigned long long)h->stop);
    pos = h->stop;
    t->holders[k++] = *h;
    prev = &t->holders[k - 1];
  }
  if (strays && stray.start > pos) /* (one before a later piece is that piece's gap) */
    return fr_err(FERRY_ESHAPE,
                  "refit group: rank %u's empty piece [%llu:%llu] of '%s' lies past its end (%llu "
                  "along dim %u)",
                  stray.rank, (unsigned long long)stray.start, (unsigned long long)stray.stop,
                  t->name, (unsigned long long)pos, dim);
  t->nholders = k;
  *extent = pos;
  return 0;
}

/* Pieces of a global tensor: one cut dim, alike elsewhere, tiling it. */
static int check_pieces(const fr_refit_plan *plans, fr_group_tensor *t) {
  fr_group_holder h0 = t->holders[0];
  for (uint32_t i = 0; i < t->nholders; i++) {
    int rc = check_piece_entry(plans, t, &t->holders[i]);
    if (rc == 0 && i > 0)
      rc = check_piece_alike(plans, t, &h0, &t->holders[i]);
    if (rc != 0)
      return rc;
  }
  const fr_refit_entry *x0 = entry_of(plans, &h0);
  uint64_t extent = 0;
  int rc = check_tiling(t, x0->gdim, &extent);
  if (rc != 0)
    return rc;
  t->dim = (int32_t)x0->gdim;
  t->desc = x0->desc;
  t->desc.dtype = x0->wire;
  t->desc.shape[x0->gdim] = extent;
  t->scale = x0->wire == FERRY_DTYPE_F8E4M3 ? x0->scale : 1.0f;
  return 0;
}

/* One global tensor: all holders whole or all pieces, then the checks of its kind. */
static int check_tensor(const fr_refit_plan *plans, fr_group_tensor *t) {
  const fr_group_holder *h0 = &t->holders[0];
  bool piece = entry_of(plans, h0)->global != NULL;
  for (uint32_t i = 1; i < t->nholders; i++) {
    const fr_group_holder *h = &t->holders[i];
    if ((entry_of(plans, h)->global != NULL) != piece)
      return fr_err(FERRY_EINVAL,
                    "refit group: '%s' is held whole by rank %u and as a piece by rank %u: a "
                    "tensor is either whole on every rank that holds it or cut into pieces",
                    t->name, piece ? h->rank : h0->rank, piece ? h0->rank : h->rank);
  }
  int rc = piece ? check_pieces(plans, t) : check_whole(plans, t);
  uint64_t bytes = 0;
  if (rc == 0 && (rc = ferry_tensor_nbytes(&t->desc, &bytes)) != 0)
    rc = fr_err_wrap(rc, "refit group: '%s'", t->name);
  return rc;
}

static int check_ranks(const fr_refit_plan *plans, uint32_t world) {
  if (!plans || world == 0)
    return fr_err(FERRY_EINVAL, "refit group: no ranks");
  for (uint32_t r = 0; r < world; r++) {
    bool alone = world == 1 && plans[r].world <= 1;
    if (plans[r].rank != r || (plans[r].world != world && !alone))
      return fr_err(FERRY_EINVAL,
                    "refit group: the sender at rank %u says it is rank %u of %u, not of %u", r,
                    plans[r].rank, plans[r].world, world);
  }
  return 0;
}

int fr_group_manifest_build(const fr_refit_plan *plans, uint32_t world, fr_group_manifest *out) {
  fr_group_manifest m = {.world = world};
  int rc = check_ranks(plans, world);
  if (rc == 0)
    rc = collect_names(plans, world, &m);
  if (rc == 0)
    rc = collect_holders(plans, world, &m);
  for (uint32_t t = 0; rc == 0 && t < m.count; t++)
    rc = check_tensor(plans, &m.tensors[t]);
  if (rc != 0) {
    fr_group_manifest_free(&m);
    return rc;
  }
  *out = m;
  return 0;
}

/* ---- parts ---- */

typedef struct parts {
  fr_group_part *v;
  size_t n, cap;
} parts;

static int push_part(parts *ps, uint32_t rank, fr_refit_piece src, fr_refit_place place) {
  if (FR_GROW(ps->v, ps->cap, ps->n + 1, 16) != 0)
    return fr_err(FERRY_ENOMEM, "refit group: %zu parts", ps->n + 1);
  ps->v[ps->n++] = (fr_group_part){rank, src, place};
  return 0;
}

/* Checks piece i against the manifest and the destination; *shape: the piece's shape. */
static int piece_fits(const fr_group_manifest *m, const char *target, const fr_group_piece *pc,
                      uint32_t i, uint32_t n, const ferry_tensor_desc *dst_desc,
                      ferry_tensor_desc *shape) {
  if (pc->tensor >= m->count)
    return fr_err(FERRY_ENOTFOUND, "refit: target '%s' piece %u: no tensor %u in the group's %u",
                  target, i, pc->tensor, m->count);
  const fr_group_tensor *t = &m->tensors[pc->tensor];
  char who[FR_REFIT_NAME_MAX * 2 + 128], have[96], want[96];
  snprintf(who, sizeof who, "refit: target '%s' piece %u ('%s' dim %u [%llu:%llu])", target, i,
           t->name, pc->dim, (unsigned long long)pc->start, (unsigned long long)pc->stop);
  uint32_t nd = t->desc.ndim;
  if (pc->dim >= (nd ? nd : 1))
    return fr_err(FERRY_ESHAPE, "%s: '%s' has %u dims, no dim %u", who, t->name, nd, pc->dim);
  uint64_t extent = nd ? t->desc.shape[pc->dim] : 1;
  if ((pc->start >= pc->stop && !(extent == 0 && pc->stop == 0)) || pc->stop > extent)
    return fr_err(FERRY_ESHAPE, "%s: [%llu:%llu] is not a slice of '%s' dim %u (size %llu)", who,
                  (unsigned long long)pc->start, (unsigned long long)pc->stop, t->name, pc->dim,
                  (unsigned long long)extent);
  *shape = t->desc;
  if (nd)
    shape->shape[pc->dim] = pc->stop - pc->start;
  if (shape->dtype != dst_desc->dtype)
    return fr_err(FERRY_EDTYPE, "%s arrives as %s, the target is %s", who,
                  ferry_dtype_name(shape->dtype), ferry_dtype_name(dst_desc->dtype) ?: "?");
  bool fits = nd == dst_desc->ndim && (nd == 0 ? n == 1
                                               : memcmp(shape->shape + 1, dst_desc->shape + 1,
                                                        sizeof(uint64_t) * (nd - 1)) == 0);
  if (!fits)
    return fr_err(FERRY_ESHAPE, "%s is %s: it does not fit the target's %s along dim 0", who,
                  shape_text(shape, have, sizeof have), shape_text(dst_desc, want, sizeof want));
  return 0;
}

/* The parts of one global piece whose block (its shape) lies at `block` in the destination. */
static int piece_parts(const fr_group_manifest *m, const fr_group_piece *pc,
                       const ferry_tensor_desc *shape, uint8_t *block, uint64_t salt, parts *ps) {
  const fr_group_tensor *t = &m->tensors[pc->tensor];
  fr_refit_place place = {.dst = block, .block = *shape, .dim = 0, .at = 0};
  if (t->dim < 0) { /* whole: one holder, sliced as the piece is */
    const fr_group_holder *h = &t->holders[((uint64_t)pc->tensor + salt) % t->nholders];
    return push_part(ps, h->rank, (fr_refit_piece){h->entry, pc->dim, pc->start, pc->stop}, place);
  }
  uint32_t a = (uint32_t)t->dim;
  place.dim = a;
  for (uint32_t i = 0; i < t->nholders; i++) {
    const fr_group_holder *h = &t->holders[i];
    fr_refit_piece src = {h->entry, pc->dim, pc->start, pc->stop};
    if (a == pc->dim) { /* the holder's share of the piece's range */
      uint64_t lo = pc->start > h->start ? pc->start : h->start;
      uint64_t hi = pc->stop < h->stop ? pc->stop : h->stop;
      if (lo >= hi)
        continue;
      src.start = lo - h->start, src.stop = hi - h->start;
      place.at = lo - pc->start;
    } else { /* the piece spans all of dim a: each holder's slice of it, at the holder's range */
      place.at = h->start;
    }
    int rc = push_part(ps, h->rank, src, place);
    if (rc != 0)
      return rc;
  }
  return 0;
}

int fr_group_parts(const fr_group_manifest *m, const char *target, const fr_group_piece *pieces,
                   uint32_t n, uint8_t *dst, const ferry_tensor_desc *dst_desc, uint64_t salt,
                   fr_group_part **out, size_t *nout) {
  if (!m || !target || (n && !pieces) || !dst_desc || !out || !nout)
    return fr_err(FERRY_EINVAL, "refit group: parts: NULL argument");
  uint64_t es = ferry_dtype_size(dst_desc->dtype), row = es, rows = 0;
  for (uint32_t d = 1; d < dst_desc->ndim; d++)
    row *= dst_desc->shape[d];
  parts ps = {0};
  int rc = 0;
  for (uint32_t i = 0; i < n && rc == 0; i++) {
    ferry_tensor_desc shape;
    uint64_t bytes = 0;
    rc = piece_fits(m, target, &pieces[i], i, n, dst_desc, &shape);
    if (rc == 0)
      rc = ferry_tensor_nbytes(&shape, &bytes);
    if (rc == 0 && bytes) /* an empty piece holds nothing to read */
      rc = piece_parts(m, &pieces[i], &shape, dst ? dst + rows * row : NULL, salt, &ps);
    if (rc == 0)
      rows += shape.ndim ? shape.shape[0] : 1;
  }
  uint64_t need = dst_desc->ndim ? dst_desc->shape[0] : 1;
  char want[96];
  if (rc == 0 && rows != need)
    rc = fr_err(FERRY_ESHAPE, "refit: target '%s' is %s: its pieces fill %llu of its %llu rows",
                target, shape_text(dst_desc, want, sizeof want), (unsigned long long)rows,
                (unsigned long long)need);
  if (rc != 0) {
    free(ps.v);
    return rc;
  }
  *out = ps.v;
  *nout = ps.n;
  return 0;
}
