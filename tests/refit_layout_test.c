/*
 * Sharded refit's layout math (issue 34): the global manifest built from the ranks' plans and
 * every refusal it makes (each naming the tensor and the ranks), the parts a binding turns into
 * for the trainer and engine splits frameworks use, views built with places (their bytes, in
 * order, are the sender's view's), and an end-to-end simulation: random global tensors cut over
 * random trainer ranks, random engine bindings turned into parts, each rank's view built with
 * places and "read" by memcpy from that rank's wire buffer, the destinations checked byte for
 * byte against the global tensors, every destination byte written exactly once.
 */
#include "testutil.h"

#include "refit/group.h"
#include "refit/receiver_impl.h" /* fr_refit_rx_places_fit */
#include "refit/shard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- synthetic rank plans ---- */

static fr_refit_entry *add_entry(fr_refit_plan *p, const char *name, ferry_dtype dt, uint32_t ndim,
                                 const uint64_t *shape) {
  p->entries = realloc(p->entries, (p->count + 1) * sizeof *p->entries);
  assert_non_null(p->entries);
  fr_refit_entry *e = &p->entries[p->count++];
  memset(e, 0, sizeof *e);
  e->name = strdup(name);
  e->desc.dtype = dt;
  e->desc.ndim = ndim;
  if (ndim)
    memcpy(e->desc.shape, shape, ndim * sizeof *shape);
  e->scale = 1.0f;
  return e;
}

static fr_refit_entry *add_whole(fr_refit_plan *p, const char *name, ferry_dtype dt, uint32_t ndim,
                                 const uint64_t *shape) {
  return add_entry(p, name, dt, ndim, shape);
}

/* A piece [start, stop) along gdim of global tensor `global` whose shape is gshape. */
static fr_refit_entry *add_piece(fr_refit_plan *p, const char *local, const char *global,
                                 ferry_dtype dt, uint32_t ndim, const uint64_t *gshape,
                                 uint32_t gdim, uint64_t start, uint64_t stop) {
  uint64_t shape[FERRY_MAX_DIMS];
  memcpy(shape, gshape, ndim * sizeof *shape);
  shape[gdim] = stop - start;
  fr_refit_entry *e = add_entry(p, local, dt, ndim, shape);
  e->global = strdup(global);
  e->gdim = gdim;
  e->gstart = start;
  e->gstop = stop;
  return e;
}

static void init_plans(fr_refit_plan *plans, uint32_t world) {
  for (uint32_t r = 0; r < world; r++)
    plans[r] = (fr_refit_plan){.rank = r, .world = world};
}

static void seal_plans(fr_refit_plan *plans, uint32_t world, uint64_t budget) {
  for (uint32_t r = 0; r < world; r++)
    FR_OK(fr_refit_plan_build(&plans[r], budget));
}

/* (not fr_refit_plan_free: whether it frees `global` is the sender's business) */
static void free_plans(fr_refit_plan *plans, uint32_t world) {
  for (uint32_t r = 0; r < world; r++) {
    for (uint32_t i = 0; i < plans[r].count; i++) {
      free(plans[r].entries[i].name);
      free(plans[r].entries[i].global);
    }
    free(plans[r].entries);
    plans[r].entries = NULL;
    plans[r].count = 0;
  }
}

#define SHAPE(...) ((const uint64_t[]){__VA_ARGS__})
#define F32 FERRY_DTYPE_F32

/* Builds and expects a refusal with `status` whose text holds every string of `needles`. */
static void expect_refusal(fr_refit_plan *plans, uint32_t world, int status, const char *needles[],
                           size_t n) {
  fr_group_manifest m = {0};
  seal_plans(plans, world, 1 << 20);
  int rc = fr_group_manifest_build(plans, world, &m);
  if (rc != status)
    fail_msg("expected %s, got %s: %s", ferry_status_name(status), ferry_status_name(rc),
             ferry_last_error());
  for (size_t i = 0; i < n; i++)
    if (!strstr(ferry_last_error(), needles[i]))
      fail_msg("'%s' not in: %s", needles[i], ferry_last_error());
  free_plans(plans, world);
}
#define REFUSES(plans, world, status, ...)                                                         \
  expect_refusal(plans, world, status, (const char *[]){__VA_ARGS__},                              \
                 sizeof((const char *[]){__VA_ARGS__}) / sizeof(const char *))

/* ---- the global manifest ---- */

static void test_manifest_fsdp(void **s) {
  (void)s;
  fr_refit_plan p[3];
  init_plans(p, 3);
  /* every tensor split along dim 0 over 3 ranks, the last shorter; ranks declare in their order */
  const uint64_t *w = SHAPE(10, 4), *b = SHAPE(7);
  add_piece(&p[0], "w", "w", F32, 2, w, 0, 0, 4);
  add_piece(&p[0], "b", "b", F32, 1, b, 0, 0, 3);
  add_whole(&p[0], "norm", F32, 1, SHAPE(4));
  add_whole(&p[1], "norm", F32, 1, SHAPE(4));
  add_piece(&p[1], "b.local", "b", F32, 1, b, 0, 3, 6);
  add_piece(&p[1], "w.local", "w", F32, 2, w, 0, 4, 8);
  add_whole(&p[1], "only1", FERRY_DTYPE_BF16, 0, NULL);
  add_piece(&p[2], "b", "b", F32, 1, b, 0, 6, 7);
  add_piece(&p[2], "w", "w", F32, 2, w, 0, 8, 10);
  add_whole(&p[2], "norm", F32, 1, SHAPE(4));
  seal_plans(p, 3, 1 << 20);
  fr_group_manifest m;
  FR_OK(fr_group_manifest_build(p, 3, &m));
  assert_int_equal(m.world, 3);
  assert_int_equal(m.count, 4);
  const char *order[] = {"w", "b", "norm", "only1"};
  for (uint32_t i = 0; i < 4; i++) {
    assert_string_equal(m.tensors[i].name, order[i]);
    assert_int_equal(fr_group_find(&m, order[i]), i);
  }
  assert_int_equal(fr_group_find(&m, "w.local"), -1);
  assert_int_equal(fr_group_find(&m, "nope"), -1);
  const fr_group_tensor *tw = &m.tensors[0], *tb = &m.tensors[1], *tn = &m.tensors[2];
  assert_int_equal(tw->dim, 0);
  assert_int_equal(tw->desc.ndim, 2);
  assert_int_equal(tw->desc.shape[0], 10);
  assert_int_equal(tw->desc.shape[1], 4);
  assert_int_equal(tw->desc.dtype, F32);
  assert_int_equal(tw->nholders, 3);
  const uint64_t wcuts[][2] = {{0, 4}, {4, 8}, {8, 10}};
  const uint32_t wentry[] = {0, 2, 1};
  for (uint32_t r = 0; r < 3; r++) {
    assert_int_equal(tw->holders[r].rank, r);
    assert_int_equal(tw->holders[r].entry, wentry[r]);
    assert_int_equal(tw->holders[r].start, wcuts[r][0]);
    assert_int_equal(tw->holders[r].stop, wcuts[r][1]);
  }
  assert_int_equal(tb->desc.shape[0], 7);
  assert_int_equal(tb->holders[2].start, 6);
  assert_int_equal(tb->holders[1].entry, 1);
  assert_int_equal(tn->dim, -1);
  assert_int_equal(tn->nholders, 3);
  for (uint32_t r = 0; r < 3; r++) {
    assert_int_equal(tn->holders[r].rank, r);
    assert_int_equal(tn->holders[r].start, 0);
    assert_int_equal(tn->holders[r].stop, 4);
  }
  assert_int_equal(m.tensors[3].desc.ndim, 0);
  assert_int_equal(m.tensors[3].nholders, 1);
  assert_int_equal(m.tensors[3].holders[0].rank, 1);
  assert_int_equal(m.tensors[3].holders[0].stop, 1);
  assert_true(m.tensors[3].scale == 1.0f);
  fr_group_manifest_free(&m);
  fr_group_manifest_free(&m); /* twice: harmless */
  free_plans(p, 3);
}

static void test_manifest_megatron(void **s) {
  (void)s;
  fr_refit_plan p[2];
  init_plans(p, 2);
  /* column-parallel qkv along dim 0, row-parallel o along dim 1; rank 1 declares first the o */
  add_piece(&p[0], "qkv", "qkv", F32, 2, SHAPE(12, 8), 0, 0, 6);
  add_piece(&p[0], "o", "o", F32, 2, SHAPE(8, 12), 1, 0, 6);
  add_piece(&p[1], "o", "o", F32, 2, SHAPE(8, 12), 1, 6, 12);
  add_piece(&p[1], "qkv", "qkv", F32, 2, SHAPE(12, 8), 0, 6, 12);
  seal_plans(p, 2, 1 << 20);
  fr_group_manifest m;
  FR_OK(fr_group_manifest_build(p, 2, &m));
  assert_int_equal(m.count, 2);
  const fr_group_tensor *o = &m.tensors[fr_group_find(&m, "o")];
  assert_int_equal(o->dim, 1);
  assert_int_equal(o->desc.shape[0], 8);
  assert_int_equal(o->desc.shape[1], 12);
  assert_int_equal(o->holders[0].rank, 0);
  assert_int_equal(o->holders[1].rank, 1);
  assert_int_equal(o->holders[1].entry, 0);
  assert_int_equal(o->holders[1].start, 6);
  const fr_group_tensor *q = &m.tensors[fr_group_find(&m, "qkv")];
  assert_int_equal(q->dim, 0);
  assert_int_equal(q->desc.shape[0], 12);
  assert_int_equal(q->holders[1].entry, 1);
  fr_group_manifest_free(&m);
  free_plans(p, 2);
}

static void test_manifest_replicated(void **s) {
  (void)s;
  fr_refit_plan p[4];
  init_plans(p, 4);
  for (uint32_t r = 0; r < 4; r++)
    if (r != 2) /* rank 2 holds none of it */
      add_whole(&p[r], "emb", FERRY_DTYPE_BF16, 2, SHAPE(16, 8));
  add_whole(&p[2], "head", F32, 1, SHAPE(3));
  seal_plans(p, 4, 1 << 20);
  fr_group_manifest m;
  FR_OK(fr_group_manifest_build(p, 4, &m));
  const fr_group_tensor *t = &m.tensors[0];
  assert_string_equal(t->name, "emb");
  assert_int_equal(t->dim, -1);
  assert_int_equal(t->desc.dtype, FERRY_DTYPE_BF16);
  assert_int_equal(t->nholders, 3);
  const uint32_t ranks[] = {0, 1, 3};
  for (uint32_t i = 0; i < 3; i++) {
    assert_int_equal(t->holders[i].rank, ranks[i]);
    assert_int_equal(t->holders[i].stop, 16);
  }
  assert_string_equal(m.tensors[1].name, "head");
  fr_group_manifest_free(&m);
  free_plans(p, 4);
}

/* A group of one: the plan as it is, whole tensors (plan.world 1 or 0: an older manifest). */
static void test_manifest_alone(void **s) {
  (void)s;
  fr_refit_plan p[1] = {{.rank = 0, .world = 0}};
  add_whole(&p[0], "a", F32, 2, SHAPE(2, 3));
  add_whole(&p[0], "b", F32, 1, SHAPE(5));
  seal_plans(p, 1, 1 << 20);
  fr_group_manifest m;
  FR_OK(fr_group_manifest_build(p, 1, &m));
  assert_int_equal(m.count, 2);
  assert_int_equal(m.tensors[1].holders[0].entry, 1);
  fr_group_manifest_free(&m);
  free_plans(p, 1);
}

static void test_manifest_refusals(void **s) {
  (void)s;
  fr_refit_plan p[3];
  const uint64_t *w = SHAPE(10, 4);

  init_plans(p, 2); /* overlap */
  add_piece(&p[0], "w", "w", F32, 2, w, 0, 0, 5);
  add_piece(&p[1], "w", "w", F32, 2, w, 0, 4, 10);
  REFUSES(p, 2, FERRY_ESHAPE, "'w'", "overlap", "rank 0 holds [0:5]", "rank 1 [4:10]");

  init_plans(p, 3); /* gap, ranks declared out of order */
  add_piece(&p[0], "w", "w", F32, 2, w, 0, 6, 10);
  add_piece(&p[2], "w", "w", F32, 2, w, 0, 0, 4);
  add_piece(&p[1], "x", "x", F32, 2, w, 0, 0, 10);
  REFUSES(p, 3, FERRY_ESHAPE, "'w'", "gap [4:6]", "rank 2's [0:4]", "rank 0's [6:10]");

  init_plans(p, 2); /* not starting at 0 */
  add_piece(&p[0], "w", "w", F32, 2, w, 0, 5, 10);
  add_piece(&p[1], "w", "w", F32, 2, w, 0, 2, 5);
  REFUSES(p, 2, FERRY_ESHAPE, "'w'", "no rank holds [0:2]", "rank 1's");

  init_plans(p, 2); /* different dims */
  add_piece(&p[0], "w", "w", F32, 2, w, 0, 0, 5);
  add_piece(&p[1], "w", "w", F32, 2, SHAPE(5, 8), 1, 4, 8);
  REFUSES(p, 2, FERRY_ESHAPE, "'w'", "rank 0", "dim 0", "rank 1", "dim 1");

  init_plans(p, 2); /* dtype */
  add_piece(&p[0], "w", "w", F32, 2, w, 0, 0, 5);
  add_piece(&p[1], "w", "w", FERRY_DTYPE_BF16, 2, w, 0, 5, 10);
  REFUSES(p, 2, FERRY_EDTYPE, "'w'", "float32 from rank 0", "bfloat16 from rank 1");

  init_plans(p, 2); /* the same dtype once cast: fine */
  add_piece(&p[0], "w", "w", F32, 2, w, 0, 0, 5)->wire = FERRY_DTYPE_BF16;
  add_piece(&p[1], "w", "w", FERRY_DTYPE_BF16, 2, w, 0, 5, 10);
  seal_plans(p, 2, 1 << 20);
  fr_group_manifest m;
  FR_OK(fr_group_manifest_build(p, 2, &m));
  assert_int_equal(m.tensors[0].desc.dtype, FERRY_DTYPE_BF16);
  fr_group_manifest_free(&m);
  free_plans(p, 2);

  init_plans(p, 2); /* another dim differs */
  add_piece(&p[0], "w", "w", F32, 2, w, 0, 0, 5);
  add_piece(&p[1], "w", "w", F32, 2, SHAPE(10, 5), 0, 5, 10);
  REFUSES(p, 2, FERRY_ESHAPE, "'w'", "differ", "[5, 4] on rank 0", "[5, 5] on rank 1");

  init_plans(p, 2); /* different ndim */
  add_piece(&p[0], "w", "w", F32, 2, w, 0, 0, 5);
  add_piece(&p[1], "w", "w", F32, 3, SHAPE(10, 4, 1), 0, 5, 10);
  REFUSES(p, 2, FERRY_ESHAPE, "'w'", "rank 0", "rank 1");

  init_plans(p, 3); /* whole vs pieces */
  add_piece(&p[0], "w", "w", F32, 2, w, 0, 0, 5);
  add_whole(&p[1], "w", F32, 2, w);
  REFUSES(p, 3, FERRY_EINVAL, "'w'", "whole by rank 1", "piece by rank 0");

  init_plans(p, 2); /* and the other way round */
  add_whole(&p[0], "w", F32, 2, w);
  add_piece(&p[1], "w.1", "w", F32, 2, w, 0, 0, 10);
  REFUSES(p, 2, FERRY_EINVAL, "'w'", "whole by rank 0", "piece by rank 1");

  init_plans(p, 2); /* whole copies of another shape */
  add_whole(&p[0], "n", F32, 1, SHAPE(4));
  add_whole(&p[1], "n", F32, 1, SHAPE(5));
  REFUSES(p, 2, FERRY_ESHAPE, "'n'", "[4] on rank 0", "[5] on rank 1");

  init_plans(p, 2); /* whole copies of another dtype */
  add_whole(&p[0], "n", F32, 1, SHAPE(4));
  add_whole(&p[1], "n", FERRY_DTYPE_F16, 1, SHAPE(4));
  REFUSES(p, 2, FERRY_EDTYPE, "'n'", "rank 0", "rank 1");

  init_plans(p, 2); /* whole fp8 copies with other scales */
  add_whole(&p[0], "n", F32, 1, SHAPE(4))->wire = FERRY_DTYPE_F8E4M3;
  add_whole(&p[1], "n", F32, 1, SHAPE(4))->wire = FERRY_DTYPE_F8E4M3;
  p[1].entries[0].scale = 2.0f;
  REFUSES(p, 2, FERRY_EINVAL, "'n'", "fp8 scales", "ranks 0 and 1");

  init_plans(p, 2); /* fp8 pieces with other scales */
  add_piece(&p[0], "w", "w", F32, 2, w, 0, 0, 5)->wire = FERRY_DTYPE_F8E4M3;
  add_piece(&p[1], "w", "w", F32, 2, w, 0, 5, 10)->wire = FERRY_DTYPE_F8E4M3;
  p[1].entries[0].scale = 0.5f;
  REFUSES(p, 2, FERRY_EINVAL, "'w'", "fp8 scales", "ranks 0 and 1");

  init_plans(p, 2); /* a piece whose entry is not as long as its range */
  add_piece(&p[0], "w", "w", F32, 2, w, 0, 0, 5);
  add_piece(&p[1], "w", "w", F32, 2, w, 0, 5, 10)->gstop = 11;
  REFUSES(p, 2, FERRY_ESHAPE, "rank 1", "'w'", "[5:11]");

  init_plans(p, 2); /* a piece along a dim its entry lacks */
  add_piece(&p[0], "w", "w", F32, 2, w, 0, 0, 10)->gdim = 2;
  REFUSES(p, 2, FERRY_ESHAPE, "rank 0", "'w'");

  init_plans(p, 2); /* an empty piece past the end */
  add_piece(&p[0], "w", "w", F32, 2, w, 0, 0, 10);
  add_piece(&p[1], "w", "w", F32, 2, w, 0, 12, 12);
  REFUSES(p, 2, FERRY_ESHAPE, "rank 1", "'w'", "past its end");

  init_plans(p, 2); /* a plan that is not the rank it is given as */
  add_whole(&p[0], "n", F32, 1, SHAPE(4));
  p[1].rank = 0;
  REFUSES(p, 2, FERRY_EINVAL, "rank 1", "rank 0 of 2");
  init_plans(p, 2);
  p[1].world = 3;
  REFUSES(p, 2, FERRY_EINVAL, "rank 1 of 3");
}

/* Empty pieces (a rank of an FSDP split past the rows) hold nothing; all of them: extent 0. */
static void test_manifest_empty_pieces(void **s) {
  (void)s;
  fr_refit_plan p[4];
  init_plans(p, 4);
  const uint64_t *w = SHAPE(3, 2), *z = SHAPE(0, 2);
  for (uint32_t r = 0; r < 4; r++) {
    add_piece(&p[r], "w", "w", F32, 2, w, 0, r < 3 ? r : 3, r < 3 ? r + 1 : 3);
    add_piece(&p[r], "z", "z", F32, 2, z, 0, 0, 0);
  }
  seal_plans(p, 4, 1 << 20);
  fr_group_manifest m;
  FR_OK(fr_group_manifest_build(p, 4, &m));
  assert_int_equal(m.tensors[0].nholders, 3);
  assert_int_equal(m.tensors[0].desc.shape[0], 3);
  assert_int_equal(m.tensors[1].nholders, 0);
  assert_int_equal(m.tensors[1].desc.shape[0], 0);
  assert_int_equal(m.tensors[1].desc.shape[1], 2);
  /* binding z: nothing to read */
  fr_group_part *parts = NULL;
  size_t n = 99;
  ferry_tensor_desc d = {.dtype = F32, .ndim = 2, .shape = {0, 2}};
  fr_group_piece pc = {1, 0, 0, 0};
  uint8_t dst[1];
  FR_OK(fr_group_parts(&m, "z", &pc, 1, dst, &d, 0, &parts, &n));
  assert_int_equal(n, 0);
  free(parts);
  fr_group_manifest_free(&m);
  free_plans(p, 4);
}

/* ---- parts ---- */

typedef struct group {
  fr_refit_plan p[8];
  uint32_t world;
  fr_group_manifest m;
} group;

static void group_seal(group *g) {
  seal_plans(g->p, g->world, 1 << 20);
  FR_OK(fr_group_manifest_build(g->p, g->world, &g->m));
}

static void group_free(group *g) {
  fr_group_manifest_free(&g->m);
  free_plans(g->p, g->world);
}

static void expect_part(const fr_group_part *x, uint32_t rank, fr_refit_piece src, uint8_t *dst,
                        uint32_t dim, uint64_t at, uint64_t b0, uint64_t b1) {
  assert_int_equal(x->rank, rank);
  assert_int_equal(x->src.entry, src.entry);
  assert_int_equal(x->src.dim, src.dim);
  assert_int_equal(x->src.start, src.start);
  assert_int_equal(x->src.stop, src.stop);
  assert_ptr_equal(x->place.dst, dst);
  assert_int_equal(x->place.dim, dim);
  assert_int_equal(x->place.at, at);
  assert_int_equal(x->place.block.ndim, 2);
  assert_int_equal(x->place.block.shape[0], b0);
  assert_int_equal(x->place.block.shape[1], b1);
}

static fr_group_part *parts_of(const group *g, const char *target, const fr_group_piece *pcs,
                               uint32_t n, uint8_t *dst, ferry_tensor_desc d, uint64_t salt,
                               size_t *np) {
  fr_group_part *parts = NULL;
  FR_OK(fr_group_parts(&g->m, target, pcs, n, dst, &d, salt, &parts, np));
  return parts;
}

/* Trainer FSDP-like over 3 ranks along dim 0, engine TP 2 along dim 0: other cuts. */
static void test_parts_dim0_vs_dim0(void **s) {
  (void)s;
  group g = {.world = 3};
  init_plans(g.p, 3);
  const uint64_t *w = SHAPE(10, 4);
  add_whole(&g.p[0], "pad", F32, 1, SHAPE(3)); /* w is entry 1 on rank 0 */
  add_piece(&g.p[0], "w", "w", F32, 2, w, 0, 0, 4);
  add_piece(&g.p[1], "w", "w", F32, 2, w, 0, 4, 8);
  add_piece(&g.p[2], "w", "w", F32, 2, w, 0, 8, 10);
  group_seal(&g);
  uint32_t t = (uint32_t)fr_group_find(&g.m, "w");
  uint8_t dst[5 * 4 * 4];
  ferry_tensor_desc d = {.dtype = F32, .ndim = 2, .shape = {5, 4}};
  size_t n = 0;
  fr_group_part *x = parts_of(&g, "w", &(fr_group_piece){t, 0, 0, 5}, 1, dst, d, 0, &n);
  assert_int_equal(n, 2);
  expect_part(&x[0], 0, (fr_refit_piece){1, 0, 0, 4}, dst, 0, 0, 5, 4);
  expect_part(&x[1], 1, (fr_refit_piece){0, 0, 0, 1}, dst, 0, 4, 5, 4);
  free(x);
  x = parts_of(&g, "w", &(fr_group_piece){t, 0, 5, 10}, 1, dst, d, 0, &n);
  assert_int_equal(n, 2);
  expect_part(&x[0], 1, (fr_refit_piece){0, 0, 1, 4}, dst, 0, 0, 5, 4);
  expect_part(&x[1], 2, (fr_refit_piece){0, 0, 0, 2}, dst, 0, 3, 5, 4);
  free(x);
  group_free(&g);
}

/* Trainer along dim 0, engine along dim 1: every holder's columns, at its rows. */
static void test_parts_dim0_vs_dim1(void **s) {
  (void)s;
  group g = {.world = 3};
  init_plans(g.p, 3);
  const uint64_t *w = SHAPE(10, 4);
  add_piece(&g.p[0], "w", "w", F32, 2, w, 0, 0, 4);
  add_piece(&g.p[1], "w", "w", F32, 2, w, 0, 4, 8);
  add_piece(&g.p[2], "w", "w", F32, 2, w, 0, 8, 10);
  group_seal(&g);
  uint8_t dst[10 * 2 * 4];
  ferry_tensor_desc d = {.dtype = F32, .ndim = 2, .shape = {10, 2}};
  size_t n = 0;
  fr_group_part *x = parts_of(&g, "w", &(fr_group_piece){0, 1, 2, 4}, 1, dst, d, 0, &n);
  assert_int_equal(n, 3);
  for (uint32_t r = 0; r < 3; r++)
    expect_part(&x[r], r, (fr_refit_piece){0, 1, 2, 4}, dst, 0, r * 4, 10, 2);
  free(x);
  group_free(&g);
}

/* Trainer along dim 1 (row-parallel), engine along dim 0: each holder's rows, at its columns. */
static void test_parts_dim1_vs_dim0(void **s) {
  (void)s;
  group g = {.world = 2};
  init_plans(g.p, 2);
  const uint64_t *o = SHAPE(8, 12);
  add_piece(&g.p[0], "o", "o", F32, 2, o, 1, 0, 6);
  add_piece(&g.p[1], "o", "o", F32, 2, o, 1, 6, 12);
  group_seal(&g);
  uint8_t dst[4 * 12 * 4];
  ferry_tensor_desc d = {.dtype = F32, .ndim = 2, .shape = {4, 12}};
  size_t n = 0;
  fr_group_part *x = parts_of(&g, "o", &(fr_group_piece){0, 0, 4, 8}, 1, dst, d, 0, &n);
  assert_int_equal(n, 2);
  expect_part(&x[0], 0, (fr_refit_piece){0, 0, 4, 8}, dst, 1, 0, 4, 12);
  expect_part(&x[1], 1, (fr_refit_piece){0, 0, 4, 8}, dst, 1, 6, 4, 12);
  free(x);
  /* and along dim 1 both: the intersection, at its column in the block */
  d = (ferry_tensor_desc){.dtype = F32, .ndim = 2, .shape = {8, 4}};
  x = parts_of(&g, "o", &(fr_group_piece){0, 1, 4, 8}, 1, dst, d, 0, &n);
  assert_int_equal(n, 2);
  expect_part(&x[0], 0, (fr_refit_piece){0, 1, 4, 6}, dst, 1, 0, 8, 4);
  expect_part(&x[1], 1, (fr_refit_piece){0, 1, 0, 2}, dst, 1, 2, 8, 4);
  free(x);
  group_free(&g);
}

/* A whole binding of a tensor held in pieces. */
static void test_parts_whole_from_pieces(void **s) {
  (void)s;
  group g = {.world = 3};
  init_plans(g.p, 3);
  const uint64_t *w = SHAPE(10, 4);
  for (uint32_t r = 0; r < 3; r++)
    add_piece(&g.p[r], "w", "w", F32, 2, w, 0, r * 4, r < 2 ? r * 4 + 4 : 10);
  group_seal(&g);
  uint8_t dst[10 * 4 * 4];
  ferry_tensor_desc d = {.dtype = F32, .ndim = 2, .shape = {10, 4}};
  size_t n = 0;
  fr_group_part *x = parts_of(&g, "w", &(fr_group_piece){0, 0, 0, 10}, 1, dst, d, 0, &n);
  assert_int_equal(n, 3);
  expect_part(&x[0], 0, (fr_refit_piece){0, 0, 0, 4}, dst, 0, 0, 10, 4);
  expect_part(&x[1], 1, (fr_refit_piece){0, 0, 0, 4}, dst, 0, 4, 10, 4);
  expect_part(&x[2], 2, (fr_refit_piece){0, 0, 0, 2}, dst, 0, 8, 10, 4);
  free(x);
  group_free(&g);
}

/* An engine's fused qkv (its TP rank 1 of 2) from q, k, v each cut by 2 trainer ranks. */
static void test_parts_fused_qkv(void **s) {
  (void)s;
  group g = {.world = 2};
  init_plans(g.p, 2);
  for (uint32_t r = 0; r < 2; r++) {
    add_piece(&g.p[r], "q", "q", F32, 2, SHAPE(8, 4), 0, r * 4, r * 4 + 4);
    add_piece(&g.p[r], "k", "k", F32, 2, SHAPE(4, 4), 0, r * 2, r * 2 + 2);
    add_piece(&g.p[r], "v", "v", F32, 2, SHAPE(4, 4), 0, r * 2, r * 2 + 2);
  }
  group_seal(&g);
  uint8_t dst[8 * 4 * 4];
  ferry_tensor_desc d = {.dtype = F32, .ndim = 2, .shape = {8, 4}};
  fr_group_piece pcs[] = {{0, 0, 4, 8}, {1, 0, 2, 4}, {2, 0, 2, 4}};
  size_t n = 0;
  fr_group_part *x = parts_of(&g, "qkv", pcs, 3, dst, d, 0, &n);
  assert_int_equal(n, 3);
  expect_part(&x[0], 1, (fr_refit_piece){0, 0, 0, 4}, dst, 0, 0, 4, 4);
  expect_part(&x[1], 1, (fr_refit_piece){1, 0, 0, 2}, dst + 4 * 16, 0, 0, 2, 4);
  expect_part(&x[2], 1, (fr_refit_piece){2, 0, 0, 2}, dst + 6 * 16, 0, 0, 2, 4);
  free(x);
  /* the engine's rank 0 straddling nothing: a whole engine binding of qkv fused, rows 0..16 */
  uint8_t big[16 * 4 * 4];
  d.shape[0] = 16;
  fr_group_piece all[] = {{0, 0, 0, 8}, {1, 0, 0, 4}, {2, 0, 0, 4}};
  x = parts_of(&g, "qkv", all, 3, big, d, 0, &n);
  assert_int_equal(n, 6);
  expect_part(&x[3], 1, (fr_refit_piece){1, 0, 0, 2}, big + 8 * 16, 0, 2, 4, 4);
  expect_part(&x[5], 1, (fr_refit_piece){2, 0, 0, 2}, big + 12 * 16, 0, 2, 4, 4);
  free(x);
  group_free(&g);
}

/* Replicated whole tensors: the holder is (tensor + salt) % holders, so receivers with other
 * salts read from other ranks, and one receiver reads its tensors from several. */
static void test_parts_replicated_spread(void **s) {
  (void)s;
  group g = {.world = 3};
  init_plans(g.p, 3);
  for (uint32_t r = 0; r < 3; r++) {
    add_whole(&g.p[r], "n0", F32, 1, SHAPE(4));
    add_whole(&g.p[r], "n1", F32, 1, SHAPE(4));
  }
  group_seal(&g);
  uint8_t dst[16];
  ferry_tensor_desc d = {.dtype = F32, .ndim = 1, .shape = {4}};
  unsigned seen[2][3] = {{0}};
  for (uint64_t salt = 0; salt < 6; salt++) {
    uint32_t rank[2];
    for (uint32_t t = 0; t < 2; t++) {
      size_t n = 0;
      fr_group_part *x = parts_of(&g, "n", &(fr_group_piece){t, 0, 0, 4}, 1, dst, d, salt, &n);
      assert_int_equal(n, 1);
      rank[t] = x[0].rank;
      assert_int_equal(x[0].rank, (t + salt) % 3);
      assert_int_equal(x[0].src.entry, t);
      assert_int_equal(x[0].src.stop, 4);
      seen[t][x[0].rank]++;
      free(x);
    }
    assert_int_not_equal(rank[0], rank[1]); /* one receiver's tensors from several ranks */
  }
  for (uint32_t t = 0; t < 2; t++)
    for (uint32_t r = 0; r < 3; r++)
      assert_int_equal(seen[t][r], 2);
  /* a slice of a replicated tensor: the holder's same slice */
  size_t n = 0;
  d.shape[0] = 2;
  fr_group_part *x = parts_of(&g, "n", &(fr_group_piece){1, 0, 1, 3}, 1, dst, d, 1, &n);
  assert_int_equal(n, 1);
  assert_int_equal(x[0].rank, 2);
  assert_int_equal(x[0].src.start, 1);
  assert_int_equal(x[0].src.stop, 3);
  free(x);
  group_free(&g);
}

static void test_parts_refusals(void **s) {
  (void)s;
  group g = {.world = 2};
  init_plans(g.p, 2);
  for (uint32_t r = 0; r < 2; r++)
    add_piece(&g.p[r], "w", "w", F32, 2, SHAPE(10, 4), 0, r * 5, r * 5 + 5);
  group_seal(&g);
  uint8_t dst[256];
  fr_group_part *x = NULL;
  size_t n = 0;
  ferry_tensor_desc d = {.dtype = F32, .ndim = 2, .shape = {5, 4}};
  fr_group_piece pc = {0, 0, 0, 5};
  d.dtype = FERRY_DTYPE_BF16;
  assert_int_equal(fr_group_parts(&g.m, "tgt", &pc, 1, dst, &d, 0, &x, &n), FERRY_EDTYPE);
  assert_non_null(strstr(ferry_last_error(), "target 'tgt' piece 0 ('w' dim 0 [0:5])"));
  d.dtype = F32;
  d.shape[1] = 3;
  assert_int_equal(fr_group_parts(&g.m, "tgt", &pc, 1, dst, &d, 0, &x, &n), FERRY_ESHAPE);
  assert_non_null(strstr(ferry_last_error(), "does not fit the target's [5, 3]"));
  d.shape[1] = 4;
  d.shape[0] = 6;
  assert_int_equal(fr_group_parts(&g.m, "tgt", &pc, 1, dst, &d, 0, &x, &n), FERRY_ESHAPE);
  assert_non_null(strstr(ferry_last_error(), "fill 5 of its 6 rows"));
  pc.stop = 11;
  assert_int_equal(fr_group_parts(&g.m, "tgt", &pc, 1, dst, &d, 0, &x, &n), FERRY_ESHAPE);
  assert_non_null(strstr(ferry_last_error(), "not a slice of 'w' dim 0 (size 10)"));
  pc = (fr_group_piece){0, 2, 0, 1};
  assert_int_equal(fr_group_parts(&g.m, "tgt", &pc, 1, dst, &d, 0, &x, &n), FERRY_ESHAPE);
  assert_non_null(strstr(ferry_last_error(), "no dim 2"));
  pc = (fr_group_piece){1, 0, 0, 1};
  assert_int_equal(fr_group_parts(&g.m, "tgt", &pc, 1, dst, &d, 0, &x, &n), FERRY_ENOTFOUND);
  assert_non_null(strstr(ferry_last_error(), "target 'tgt'"));
  assert_null(x);
  group_free(&g);
}

/* ---- views with places ---- */

/* The wire bytes of a view's runs, concatenated in order. */
static uint8_t *view_bytes(const fr_refit_view *v, const uint8_t *wire) {
  uint8_t *out = malloc(v->bytes + 1), *p = out;
  for (uint64_t i = 0; i < v->nruns; i++) {
    memcpy(p, wire + v->runs[i].off, v->runs[i].len);
    p += v->runs[i].len;
  }
  return out;
}

/* The receiver's view (places) and the sender's (none, no dst) of the same pieces cover the same
 * bytes in the same order: per bucket the same sum; runs never cross a bucket boundary. */
static void check_same_bytes(const fr_refit_plan *plan, const fr_refit_target *ts, size_t n,
                             const uint8_t *wire) {
  fr_refit_target *bare = calloc(n ? n : 1, sizeof *bare);
  for (size_t i = 0; i < n; i++)
    bare[i] = (fr_refit_target){ts[i].npieces, ts[i].pieces, NULL, NULL};
  fr_refit_view *rx = NULL, *tx = NULL;
  FR_OK(fr_refit_view_build(plan, ts, n, 7, &rx));
  FR_OK(fr_refit_view_build(plan, bare, n, 7, &tx));
  assert_int_equal(rx->bytes, tx->bytes);
  assert_true(rx->nruns >= tx->nruns);
  uint8_t *a = view_bytes(rx, wire), *b = view_bytes(tx, wire);
  assert_memory_equal(a, b, rx->bytes);
  free(a);
  free(b);
  for (uint32_t k = 0; k < plan->buckets; k++) {
    uint64_t lo = (uint64_t)k * plan->bucket_bytes, hi = lo + fr_refit_bucket_len(plan, k);
    assert_int_equal(fr_refit_view_sum(plan, rx, k, wire + lo),
                     fr_refit_view_sum(plan, tx, k, wire + lo));
    for (uint64_t i = rx->first[k]; i < rx->first[k + 1]; i++)
      assert_true(rx->runs[i].off >= lo && rx->runs[i].off + rx->runs[i].len <= hi);
  }
  assert_int_equal(rx->first[plan->buckets], rx->nruns);
  fr_refit_view_free(rx);
  fr_refit_view_free(tx);
  free(bare);
}

/* Places along dim 0 one after another are the plain layout: the very same runs. And a piece
 * placed at a column range of a block is cut one stretch per row, landing at the right columns. */
static void test_view_places(void **s) {
  (void)s;
  fr_refit_plan p = {.world = 1};
  add_whole(&p, "a", FERRY_DTYPE_U8, 2, SHAPE(6, 10));
  add_whole(&p, "b", FERRY_DTYPE_U8, 3, SHAPE(3, 4, 5));
  FR_OK(fr_refit_plan_build(&p, 64));
  uint8_t *wire = malloc(p.total_bytes);
  tu_fill(wire, p.total_bytes, 3);
  uint8_t dst[256];
  fr_refit_piece pcs[] = {{0, 1, 2, 7}, {1, 2, 1, 4}};
  ferry_tensor_desc sa = {.dtype = FERRY_DTYPE_U8, .ndim = 2, .shape = {6, 5}};
  ferry_tensor_desc sb = {.dtype = FERRY_DTYPE_U8, .ndim = 3, .shape = {3, 4, 3}};
  fr_refit_place seq[] = {{dst, sa, 0, 0}, {dst + 30, sb, 0, 0}};
  fr_refit_target plain = {2, pcs, dst, NULL}, placed = {2, pcs, dst, seq};
  fr_refit_view *v1 = NULL, *v2 = NULL;
  FR_OK(fr_refit_view_build(&p, &plain, 1, 1, &v1));
  FR_OK(fr_refit_view_build(&p, &placed, 1, 1, &v2));
  assert_int_equal(v1->nruns, v2->nruns);
  assert_memory_equal(v1->runs, v2->runs, v1->nruns * sizeof *v1->runs);
  fr_refit_view_free(v1);
  fr_refit_view_free(v2);
  check_same_bytes(&p, &placed, 1, wire);

  /* b[:, :, 1:4] placed at columns [2, 5) of dim 1 of a block [3, 9, 3]: each (i, j) row of 3
   * bytes lands at block row i, column j + 2 */
  memset(dst, 0, sizeof dst);
  ferry_tensor_desc blk = {.dtype = FERRY_DTYPE_U8, .ndim = 3, .shape = {3, 9, 3}};
  fr_refit_place at = {dst, blk, 1, 2};
  FR_OK(fr_refit_place_check(&p, &pcs[1], &at, "b"));
  fr_refit_target t = {1, &pcs[1], dst, &at};
  FR_OK(fr_refit_view_build(&p, &t, 1, 1, &v2));
  assert_int_equal(v2->bytes, 3 * 4 * 3);
  for (uint64_t i = 0; i < v2->nruns; i++)
    memcpy(v2->runs[i].dst, wire + v2->runs[i].off, v2->runs[i].len);
  const uint8_t *b = wire + p.entries[1].offset;
  for (uint32_t i = 0; i < 3; i++)
    for (uint32_t j = 0; j < 9; j++)
      for (uint32_t k = 0; k < 3; k++) {
        uint8_t want = j >= 2 && j < 6 ? b[(i * 4 + (j - 2)) * 5 + 1 + k] : 0;
        assert_int_equal(dst[(i * 9 + j) * 3 + k], want);
      }
  fr_refit_view_free(v2);
  check_same_bytes(&p, &t, 1, wire);

  /* places that do not fit */
  at.at = 6;
  assert_int_equal(fr_refit_place_check(&p, &pcs[1], &at, "b"), FERRY_ESHAPE);
  assert_non_null(strstr(ferry_last_error(), "does not fit at 6 along dim 1"));
  at.at = 0;
  at.block.shape[2] = 4;
  assert_int_equal(fr_refit_place_check(&p, &pcs[1], &at, "b"), FERRY_ESHAPE);
  at.block.shape[2] = 3;
  at.block.dtype = FERRY_DTYPE_BF16;
  assert_int_equal(fr_refit_place_check(&p, &pcs[1], &at, "b"), FERRY_EDTYPE);
  at.block.dtype = FERRY_DTYPE_U8;
  at.dim = 3;
  assert_int_equal(fr_refit_place_check(&p, &pcs[1], &at, "b"), FERRY_ESHAPE);
  free(wire);
  free_plans(&p, 1);
}

/* Two targets reading the same bytes, one cut to its places and one not: the cut run's
 * stretches stay together, so the bytes in order are still the sender's (a sort of the stretches
 * by offset would interleave them with the other target's run). */
static void test_view_places_overlap(void **s) {
  (void)s;
  fr_refit_plan p = {.world = 1};
  add_whole(&p, "o", FERRY_DTYPE_U8, 2, SHAPE(4, 8));
  FR_OK(fr_refit_plan_build(&p, 1 << 20));
  uint8_t *wire = malloc(p.total_bytes);
  tu_fill(wire, p.total_bytes, 5);
  uint8_t d1[64], d2[64], d3[64];
  fr_refit_piece pc = {0, 0, 0, 4};
  ferry_tensor_desc blk = {.dtype = FERRY_DTYPE_U8, .ndim = 2, .shape = {4, 16}};
  fr_refit_place pl = {d2, blk, 1, 8}, pl3 = {d3, blk, 1, 0};
  fr_refit_target ts[] = {{1, &pc, d1, NULL}, {1, &pc, d2, &pl}, {1, &pc, d3, &pl3}};
  check_same_bytes(&p, ts, 3, wire);
  fr_refit_view *v = NULL;
  FR_OK(fr_refit_view_build(&p, ts, 3, 1, &v));
  assert_int_equal(v->nruns, 1 + 4 + 4);
  for (uint64_t i = 0; i < v->nruns; i++)
    memcpy(v->runs[i].dst, wire + v->runs[i].off, v->runs[i].len);
  assert_memory_equal(d1, wire, 32);
  for (uint32_t r = 0; r < 4; r++) {
    assert_memory_equal(d2 + r * 16 + 8, wire + r * 8, 8);
    assert_memory_equal(d3 + r * 16, wire + r * 8, 8);
  }
  fr_refit_view_free(v);
  free(wire);
  free_plans(&p, 1);
}

/* A sub-receiver's check of a target with places: sources resolved by name, each piece a slice,
 * each place fitting its piece and lying inside the target's destination. */
static void test_places_fit(void **s) {
  (void)s;
  fr_refit_plan p = {.world = 1};
  add_whole(&p, "b", F32, 1, SHAPE(3));
  add_whole(&p, "a", F32, 2, SHAPE(4, 6));
  FR_OK(fr_refit_plan_build(&p, 1 << 20));
  uint8_t buf[16 + 4 * 8 * 4], *dst = buf + 16;
  ferry_tensor_desc desc = {.dtype = F32, .ndim = 2, .shape = {4, 8}};
  ferry_tensor_desc blk = desc;
  char *src[] = {"a"};
  fr_refit_piece pc = {77, 1, 0, 6};
  fr_refit_place pl = {dst, blk, 1, 2};
  FR_OK(fr_refit_rx_places_fit(&p, "t", &desc, dst, src, &pc, &pl, 1));
  assert_int_equal(pc.entry, 1);
  pl.dst = dst + 4; /* the block runs past the destination */
  assert_int_equal(fr_refit_rx_places_fit(&p, "t", &desc, dst, src, &pc, &pl, 1), FERRY_ERANGE);
  assert_non_null(strstr(ferry_last_error(), "target 't' part 0 ('a' dim 1 [0:6])"));
  assert_non_null(strstr(ferry_last_error(), "128 bytes at 4) lies outside the target's 128"));
  pl.dst = buf; /* before it */
  assert_int_equal(fr_refit_rx_places_fit(&p, "t", &desc, dst, src, &pc, &pl, 1), FERRY_ERANGE);
  assert_non_null(strstr(ferry_last_error(), "at -16)"));
  pl.dst = dst;
  pl.at = 3; /* columns [3, 9) of 8 */
  assert_int_equal(fr_refit_rx_places_fit(&p, "t", &desc, dst, src, &pc, &pl, 1), FERRY_ESHAPE);
  pl.at = 2;
  pc.stop = 7;
  assert_int_equal(fr_refit_rx_places_fit(&p, "t", &desc, dst, src, &pc, &pl, 1), FERRY_ESHAPE);
  assert_non_null(strstr(ferry_last_error(), "not a slice of 'a' dim 1 (size 6)"));
  pc.stop = 6;
  char *none[] = {"zz"};
  assert_int_equal(fr_refit_rx_places_fit(&p, "t", &desc, dst, none, &pc, &pl, 1), FERRY_ENOTFOUND);
  assert_non_null(strstr(ferry_last_error(), "sends no tensor 'zz'"));
  free_plans(&p, 1);
}

/* ---- end to end: random layouts on both sides ---- */

static uint64_t rng;
static uint64_t rnd(uint64_t n) {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return n ? rng % n : 0;
}

typedef struct gtensor {
  char name[16];
  ferry_tensor_desc desc;
  uint8_t *data;
  uint64_t bytes;
  int32_t dim; /* the trainer's cut, or -1: whole */
} gtensor;

/* Copies the slice [s, e) along dim of tensor (desc, src) into out, row-major. */
static void slice_copy(const ferry_tensor_desc *d, const uint8_t *src, uint32_t dim, uint64_t s,
                       uint64_t e, uint8_t *out) {
  uint64_t es = ferry_dtype_size(d->dtype), outer = 1, inner = es;
  if (d->ndim == 0) {
    memcpy(out, src, es);
    return;
  }
  for (uint32_t i = 0; i < dim; i++)
    outer *= d->shape[i];
  for (uint32_t i = dim + 1; i < d->ndim; i++)
    inner *= d->shape[i];
  uint64_t mid = d->shape[dim], len = (e - s) * inner;
  for (uint64_t o = 0; o < outer; o++)
    memcpy(out + o * len, src + (o * mid + s) * inner, len);
}

static void make_tensors(gtensor *ts, uint32_t k) {
  static const ferry_dtype dts[] = {FERRY_DTYPE_U8, FERRY_DTYPE_BF16, F32};
  for (uint32_t i = 0; i < k; i++) {
    gtensor *t = &ts[i];
    snprintf(t->name, sizeof t->name, "t%u", i);
    t->desc.dtype = dts[rnd(3)];
    t->desc.ndim = rnd(10) == 0 ? 0 : 1 + (uint32_t)rnd(3);
    for (uint32_t d = 0; d < t->desc.ndim; d++)
      t->desc.shape[d] = rnd(25) == 0 ? 0 : 1 + rnd(6);
    if (i > 0 && t->desc.ndim && rnd(2)) { /* shares its trailing dims: fusable */
      const gtensor *o = &ts[rnd(i)];
      if (o->desc.ndim) {
        t->desc = o->desc;
        t->desc.shape[0] = 1 + rnd(6);
      }
    }
    FR_OK(ferry_tensor_nbytes(&t->desc, &t->bytes));
    t->data = malloc(t->bytes + 1);
    tu_fill(t->data, t->bytes, rng);
    t->dim = t->desc.ndim && rnd(4) ? (int32_t)rnd(t->desc.ndim) : -1;
  }
}

/* Some bf16 tensors declared as f32 sent as bf16: the layout is the wire dtype's throughout
 * (the simulated wire buffers hold the global tensors' bf16 bytes). */
static void cast_some(fr_refit_entry *e) {
  if (e->desc.dtype == FERRY_DTYPE_BF16 && rnd(3) == 0) {
    e->desc.dtype = F32;
    e->wire = FERRY_DTYPE_BF16;
  }
}

/* Declares tensor t on the ranks: whole on a random nonempty set of ranks, or cut along t->dim
 * into world ranges (some empty) in random rank order, a rank's range sometimes in two pieces. */
static void declare(const gtensor *t, fr_refit_plan *p, uint32_t world) {
  char local[48];
  if (t->dim < 0) {
    uint32_t mask = 1 + (uint32_t)rnd((1u << world) - 1);
    for (uint32_t r = 0; r < world; r++)
      if (mask >> r & 1)
        cast_some(add_whole(&p[r], t->name, t->desc.dtype, t->desc.ndim, t->desc.shape));
    return;
  }
  uint32_t a = (uint32_t)t->dim, perm[8];
  uint64_t ext = t->desc.shape[a], cuts[9];
  cuts[0] = 0, cuts[world] = ext;
  for (uint32_t i = 1; i < world; i++)
    cuts[i] = rnd(ext + 1);
  for (uint32_t i = 1; i < world; i++) /* sort the inner cuts */
    for (uint32_t j = i + 1; j < world; j++)
      if (cuts[j] < cuts[i]) {
        uint64_t x = cuts[i];
        cuts[i] = cuts[j], cuts[j] = x;
      }
  for (uint32_t i = 0; i < world; i++)
    perm[i] = i;
  for (uint32_t i = world; i > 1; i--) {
    uint32_t j = (uint32_t)rnd(i), x = perm[i - 1];
    perm[i - 1] = perm[j], perm[j] = x;
  }
  for (uint32_t i = 0; i < world; i++) {
    uint32_t r = perm[i];
    uint64_t s = cuts[i], e = cuts[i + 1];
    if (s == e && i > 0 && rnd(2)) /* an empty range: declared or not */
      continue;
    uint64_t mid = e - s >= 2 && rnd(3) == 0 ? s + 1 + rnd(e - s - 1) : e;
    snprintf(local, sizeof local, "%.15s.r%u.a", t->name, r);
    cast_some(
        add_piece(&p[r], local, t->name, t->desc.dtype, t->desc.ndim, t->desc.shape, a, s, mid));
    if (mid < e) {
      snprintf(local, sizeof local, "%.15s.r%u.b", t->name, r);
      cast_some(
          add_piece(&p[r], local, t->name, t->desc.dtype, t->desc.ndim, t->desc.shape, a, mid, e));
    }
  }
}

static void shuffle_entries(fr_refit_plan *p) {
  for (uint32_t i = p->count; i > 1; i--) {
    uint32_t j = (uint32_t)rnd(i);
    fr_refit_entry x = p->entries[i - 1];
    p->entries[i - 1] = p->entries[j], p->entries[j] = x;
  }
}

/* Rank r's wire buffer: each entry's slice of its global tensor at the entry's offset. */
static uint8_t *wire_of(const fr_refit_plan *p, const gtensor *ts, uint32_t k) {
  uint8_t *w = calloc(1, p->total_bytes + 1);
  for (uint32_t i = 0; i < p->count; i++) {
    const fr_refit_entry *e = &p->entries[i];
    const char *g = e->global ? e->global : e->name;
    const gtensor *t = NULL;
    for (uint32_t j = 0; j < k && !t; j++)
      t = strcmp(ts[j].name, g) == 0 ? &ts[j] : NULL;
    assert_non_null(t);
    if (e->global)
      slice_copy(&t->desc, t->data, e->gdim, e->gstart, e->gstop, w + e->offset);
    else
      memcpy(w + e->offset, t->data, t->bytes);
  }
  return w;
}

#define GUARD 64
typedef struct binding {
  fr_group_piece pcs[4];
  uint32_t n;
  ferry_tensor_desc desc;
  uint64_t bytes;
  uint8_t *dst, *want, *count;
} binding;

static uint64_t rand_range(uint64_t ext, uint64_t *s) {
  if (ext == 0)
    return *s = 0;
  uint64_t nsplit = 1 + rnd(4), j = rnd(nsplit);
  *s = j * ext / nsplit;
  uint64_t e = (j + 1) * ext / nsplit;
  if (e == *s) /* more engine ranks than rows: all of it */
    *s = 0, e = ext;
  return e;
}

/* A random binding: a piece of a random tensor along a random dim, then maybe more pieces of
 * tensors that fit below it along dim 0 (a fused target). */
static void make_binding(const gtensor *ts, uint32_t k, const fr_group_manifest *m, binding *b) {
  memset(b, 0, sizeof *b);
  const gtensor *t = &ts[rnd(k)];
  fr_group_piece *pc = &b->pcs[b->n++];
  pc->tensor = (uint32_t)fr_group_find(m, t->name);
  pc->dim = t->desc.ndim ? (uint32_t)rnd(t->desc.ndim) : 0;
  pc->stop = t->desc.ndim ? rand_range(t->desc.shape[pc->dim], &pc->start) : 1;
  b->desc = t->desc;
  if (b->desc.ndim)
    b->desc.shape[pc->dim] = pc->stop - pc->start;
  for (uint32_t more = b->desc.ndim ? (uint32_t)rnd(4) : 0; more > 0; more--) {
    const gtensor *u = &ts[rnd(k)];
    uint32_t dim = (uint32_t)rnd(u->desc.ndim ? u->desc.ndim : 1);
    bool fits = u->desc.ndim == b->desc.ndim && u->desc.dtype == b->desc.dtype;
    for (uint32_t d = 1; fits && d < u->desc.ndim; d++)
      fits = d == dim ? u->desc.shape[d] >= b->desc.shape[d] : u->desc.shape[d] == b->desc.shape[d];
    if (!fits || (dim && !b->desc.shape[dim] && u->desc.shape[dim])) /* [s:s]: no slice */
      continue;
    fr_group_piece *x = &b->pcs[b->n++];
    x->tensor = (uint32_t)fr_group_find(m, u->name);
    x->dim = dim;
    if (dim == 0) {
      x->stop = rand_range(u->desc.shape[0], &x->start);
    } else {
      x->start = rnd(u->desc.shape[dim] - b->desc.shape[dim] + 1);
      x->stop = x->start + b->desc.shape[dim];
    }
    b->desc.shape[0] += dim == 0 ? x->stop - x->start : u->desc.shape[0];
  }
  FR_OK(ferry_tensor_nbytes(&b->desc, &b->bytes));
  b->want = malloc(b->bytes + 1);
  b->dst = malloc(b->bytes + GUARD);
  b->count = calloc(1, b->bytes + 1);
  uint64_t at = 0;
  for (uint32_t i = 0; i < b->n; i++) {
    const gtensor *u = &ts[b->pcs[i].tensor];
    assert_string_equal(u->name, m->tensors[b->pcs[i].tensor].name);
    slice_copy(&u->desc, u->data, b->pcs[i].dim, b->pcs[i].start, b->pcs[i].stop, b->want + at);
    ferry_tensor_desc ps = u->desc;
    uint64_t n = 0;
    if (ps.ndim)
      ps.shape[b->pcs[i].dim] = b->pcs[i].stop - b->pcs[i].start;
    FR_OK(ferry_tensor_nbytes(&ps, &n));
    at += n;
  }
  assert_int_equal(at, b->bytes);
  for (uint64_t i = 0; i < b->bytes; i++)
    b->dst[i] = b->want[i] ^ 0xa5; /* a byte nobody wrote differs */
  memset(b->dst + b->bytes, 0x5c, GUARD);
}

/* Marks [p, p+len) written once more in the binding it lies in (it must lie in one). */
static void count_write(binding *bs, uint32_t nb, const uint8_t *p, uint64_t len) {
  for (uint32_t i = 0; i < nb; i++)
    if (p >= bs[i].dst && p < bs[i].dst + bs[i].bytes) {
      assert_true(p + len <= bs[i].dst + bs[i].bytes);
      for (uint64_t j = 0; j < len; j++)
        bs[i].count[p - bs[i].dst + j]++;
      return;
    }
  fail_msg("a run lands outside every destination");
}

/* Rank r's share of every binding: one target per binding with its parts, views built and
 * checked against the sender's, then read into the destinations. Returns the bytes read. */
static uint64_t read_rank(const fr_refit_plan *p, uint32_t r, const uint8_t *wire,
                          fr_group_part **parts, const size_t *nparts, binding *bs, uint32_t nb) {
  fr_refit_target *ts = calloc(nb, sizeof *ts);
  size_t nt = 0;
  for (uint32_t i = 0; i < nb; i++) {
    fr_refit_target *t = &ts[nt];
    t->pieces = calloc(nparts[i] + 1, sizeof *t->pieces);
    t->places = calloc(nparts[i] + 1, sizeof *t->places);
    t->dst = bs[i].dst;
    for (size_t j = 0; j < nparts[i]; j++) {
      if (parts[i][j].rank != r)
        continue;
      FR_OK(fr_refit_piece_check(p, &parts[i][j].src, "part"));
      FR_OK(fr_refit_place_check(p, &parts[i][j].src, &parts[i][j].place, "part"));
      assert_true(parts[i][j].place.dst >= bs[i].dst &&
                  parts[i][j].place.dst < bs[i].dst + bs[i].bytes);
      t->pieces[t->npieces] = parts[i][j].src;
      t->places[t->npieces++] = parts[i][j].place;
    }
    nt += t->npieces > 0;
    if (!t->npieces) {
      free(t->pieces);
      free(t->places);
      *t = (fr_refit_target){0};
    }
  }
  check_same_bytes(p, ts, nt, wire);
  fr_refit_view *v = NULL;
  FR_OK(fr_refit_view_build(p, ts, nt, 1, &v));
  for (uint64_t i = 0; i < v->nruns; i++) {
    count_write(bs, nb, v->runs[i].dst, v->runs[i].len);
    memcpy(v->runs[i].dst, wire + v->runs[i].off, v->runs[i].len);
  }
  uint64_t bytes = v->bytes;
  fr_refit_view_free(v);
  for (size_t i = 0; i < nt; i++) {
    free(ts[i].pieces);
    free(ts[i].places);
  }
  free(ts);
  return bytes;
}

static void check_manifest(const fr_group_manifest *m, const gtensor *ts, uint32_t k) {
  assert_int_equal(m->count, k);
  for (uint32_t i = 0; i < k; i++) {
    const fr_group_tensor *g = &m->tensors[fr_group_find(m, ts[i].name)];
    assert_int_equal(g->desc.dtype, ts[i].desc.dtype);
    assert_int_equal(g->desc.ndim, ts[i].desc.ndim);
    assert_memory_equal(g->desc.shape, ts[i].desc.shape, ts[i].desc.ndim * sizeof(uint64_t));
    assert_int_equal(g->dim, ts[i].dim);
  }
}

/* One random case: tensors, ranks, bindings; every destination equal to its slices of the
 * global tensors, every byte of it written once, each byte read once. */
static void simulate(uint64_t seed) {
  rng = seed * 0x9e3779b97f4a7c15ull + 1;
  uint32_t world = 1 + (uint32_t)rnd(5), k = 1 + (uint32_t)rnd(6), nb = 1 + (uint32_t)rnd(6);
  static const uint64_t budgets[] = {64, 128, 192, 256, 1024, 1 << 20};
  gtensor ts[8] = {0};
  fr_refit_plan p[8];
  make_tensors(ts, k);
  init_plans(p, world);
  for (uint32_t i = 0; i < k; i++) /* the global order: first appearance at rank 0, 1, ... */
    declare(&ts[i], p, world);
  for (uint32_t r = 0; r < world; r++)
    shuffle_entries(&p[r]);
  seal_plans(p, world, budgets[rnd(6)]);
  fr_group_manifest m;
  FR_OK(fr_group_manifest_build(p, world, &m));
  gtensor sorted[8];
  for (uint32_t i = 0; i < k; i++) /* in the manifest's order: pieces name tensors by index */
    sorted[fr_group_find(&m, ts[i].name)] = ts[i];
  check_manifest(&m, sorted, k);
  binding bs[8];
  fr_group_part *parts[8];
  size_t nparts[8];
  uint64_t salt = rnd(1000), want = 0, got = 0;
  for (uint32_t i = 0; i < nb; i++) {
    if (i > 0 && rnd(5) == 0) { /* the same pieces once more, elsewhere: overlapping runs */
      binding *b = &bs[i];
      make_binding(sorted, k, &m, b);
      free(b->want), free(b->dst), free(b->count);
      *b = bs[i - 1];
      b->want = malloc(b->bytes + 1), b->dst = malloc(b->bytes + GUARD);
      b->count = calloc(1, b->bytes + 1);
      memcpy(b->want, bs[i - 1].want, b->bytes);
      for (uint64_t j = 0; j < b->bytes; j++)
        b->dst[j] = b->want[j] ^ 0x3c;
      memset(b->dst + b->bytes, 0x5c, GUARD);
    } else {
      make_binding(sorted, k, &m, &bs[i]);
    }
    FR_OK(fr_group_parts(&m, "sim", bs[i].pcs, bs[i].n, bs[i].dst, &bs[i].desc, salt, &parts[i],
                         &nparts[i]));
    want += bs[i].bytes;
  }
  for (uint32_t r = 0; r < world; r++) {
    uint8_t *wire = wire_of(&p[r], sorted, k);
    got += read_rank(&p[r], r, wire, parts, nparts, bs, nb);
    free(wire);
  }
  assert_int_equal(got, want); /* each byte read once */
  for (uint32_t i = 0; i < nb; i++) {
    if (memcmp(bs[i].dst, bs[i].want, bs[i].bytes) != 0)
      fail_msg("seed %llu: binding %u differs", (unsigned long long)seed, i);
    for (uint64_t j = 0; j < bs[i].bytes; j++)
      if (bs[i].count[j] != 1)
        fail_msg("seed %llu: binding %u byte %llu written %u times", (unsigned long long)seed, i,
                 (unsigned long long)j, bs[i].count[j]);
    for (uint32_t j = 0; j < GUARD; j++)
      assert_int_equal(bs[i].dst[bs[i].bytes + j], 0x5c);
    free(bs[i].want), free(bs[i].dst), free(bs[i].count), free(parts[i]);
  }
  fr_group_manifest_free(&m);
  free_plans(p, world);
  for (uint32_t i = 0; i < k; i++)
    free(ts[i].data);
}

static void test_simulated_refit(void **s) {
  (void)s;
  for (uint64_t seed = 1; seed <= 3000; seed++)
    simulate(seed);
}

int main(void) {
  /* one case a line */
  // clang-format off
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_manifest_fsdp),
      cmocka_unit_test(test_manifest_megatron),
      cmocka_unit_test(test_manifest_replicated),
      cmocka_unit_test(test_manifest_alone),
      cmocka_unit_test(test_manifest_refusals),
      cmocka_unit_test(test_manifest_empty_pieces),
      cmocka_unit_test(test_parts_dim0_vs_dim0),
      cmocka_unit_test(test_parts_dim0_vs_dim1),
      cmocka_unit_test(test_parts_dim1_vs_dim0),
      cmocka_unit_test(test_parts_whole_from_pieces),
      cmocka_unit_test(test_parts_fused_qkv),
      cmocka_unit_test(test_parts_replicated_spread),
      cmocka_unit_test(test_parts_refusals),
      cmocka_unit_test(test_view_places),
      cmocka_unit_test(test_view_places_overlap),
      cmocka_unit_test(test_places_fit),
      cmocka_unit_test(test_simulated_refit),
  };
  // clang-format on

  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, NULL, NULL);
}
