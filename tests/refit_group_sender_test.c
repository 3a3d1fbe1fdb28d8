/*
 * Sharded refit, the sender's side (issue 34): a rank's options (rank and world, a group must
 * publish), pieces of global tensors (ferry_refit_declare_piece: slices that must fit, no fp8
 * cast), the manifest's group fields (rank, world, each entry's global piece) through a round
 * trip and a decoder that refuses every bad one, a push after declaring since the last seal
 * (refused, the tensor named), and two ranks on two contexts of this process published as one
 * group under NAME#0 and NAME#1, found by fr_refit_resolve_rank.
 */
// ferry-test: threaded
#include "testutil.h"

#include "directory/directory.h"
#include "refit/plan.h"
#include "refit/refit.h"
#include "refit/sender_impl.h"
#include "storeutil.h"
#include "transport/wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The timeout of a look-up the directory answers at once (found, or "not published"): it only
 * bounds how long a loaded machine (ASan, TSan, ctest -j beside it) takes to answer, so it is
 * generous; it is never waited out when the test passes (a short one failed as FERRY_ETIMEDOUT
 * under load). */
#define ANSWER_MS 10000

static ferry_ctx *ctx_for(const char *name) {
  ferry_ctx_opts o = {.size = sizeof o, .name = name, .transports = "shm,tcp"};
  ferry_ctx *c;
  FR_OK(ferry_ctx_open(&o, &c));
  return c;
}

/* Opening with opts o fails with FERRY_EINVAL, the detail containing `why`. */
static void open_refused(ferry_ctx *c, const ferry_refit_opts *o, const char *why) {
  ferry_refit_sender *s = NULL;
  assert_int_equal(ferry_refit_sender_open(c, "policy", o, &s), FERRY_EINVAL);
  assert_null(s);
  assert_non_null(strstr(ferry_last_error(), "'policy'"));
  assert_non_null(strstr(ferry_last_error(), why));
}

static void test_rank_world_checks(void **st) {
  ferry_ctx *c = ctx_for("trainer");
  ferry_refit_opts o = {.size = sizeof o, .world = 2, .rank = 0};
  open_refused(c, &o, "must publish");
  o.publish = 1;
  o.rank = 2;
  open_refused(c, &o, "rank 2 outside its world of 2");
  o.rank = -1;
  open_refused(c, &o, "rank -1 outside its world of 2");
  o.world = 1, o.rank = 1;
  open_refused(c, &o, "a single sender is rank 0");
  o.world = 0, o.rank = 3;
  open_refused(c, &o, "a single sender is rank 0");
  o.world = -1, o.rank = 0;
  open_refused(c, &o, "world -1");
  o.world = (int)FR_REFIT_MAX_WORLD + 1;
  open_refused(c, &o, "world 65537");
  /* world 0 and 1 are the single sender of today: rank 0, unpublished, under its own name */
  for (int world = 0; world <= 1; world++) {
    ferry_refit_opts one = {.size = sizeof one, .world = world};
    ferry_refit_sender *s;
    FR_OK(ferry_refit_sender_open(c, "policy", &one, &s));
    assert_string_equal(s->name, "policy");
    assert_int_equal(s->plan.world, 1);
    assert_int_equal(s->plan.rank, 0);
    ferry_refit_sender_close(s);
  }
  ferry_ctx_close(c);
}

/* The entry the sender holds for a local tensor. */
static const fr_refit_entry *entry_of(ferry_refit_sender *s, const char *name) {
  int64_t at = fr_refit_plan_find(&s->plan, name);
  assert_true(at >= 0);
  return &s->plan.entries[at];
}

static void test_declare_piece_checks(void **st) {
  ferry_ctx *c = ctx_for("trainer");
  ferry_refit_sender *s;
  FR_OK(ferry_refit_sender_open(c, "policy", NULL, &s));
  static float w[4 * 6];
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_F32, .ndim = 2, .shape = {4, 6}};
  ferry_refit_piece of = {.source = "layers.0.qkv", .dim = 1, .start = 6, .stop = 12};
  struct {
    ferry_refit_piece p;
    ferry_dtype as;
    int want;
    const char *why;
  } bad[] = {
      {{.source = "g", .dim = 2, .start = 0, .stop = 4},
       FERRY_DTYPE_INVALID,
       FERRY_EINVAL,
       "along dim 2, but it has 2 dims"},
      {{.source = "g", .dim = -1, .start = 0, .stop = 4},
       FERRY_DTYPE_INVALID,
       FERRY_EINVAL,
       "along dim -1"},
      {{.source = "g", .dim = 0, .start = 0, .stop = 5},
       FERRY_DTYPE_INVALID,
       FERRY_EINVAL,
       "[0, 5) of 'g' along dim 0 does not fit its 4 elements"},
      {{.source = "g", .dim = 1, .start = 6, .stop = 6},
       FERRY_DTYPE_INVALID,
       FERRY_EINVAL,
       "does not fit"},
      {{.source = "g", .dim = 0, .start = -4, .stop = 0},
       FERRY_DTYPE_INVALID,
       FERRY_EINVAL,
       "does not fit"},
      {{.source = NULL, .dim = 0, .start = 0, .stop = 4},
       FERRY_DTYPE_INVALID,
       FERRY_EINVAL,
       "NULL source"},
      {{.source = "g\n", .dim = 0, .start = 0, .stop = 4},
       FERRY_DTYPE_INVALID,
       FERRY_EINVAL,
       "control character"},
      {{.source = "g", .dim = 0, .start = 0, .stop = 4},
       FERRY_DTYPE_F8E4M3,
       FERRY_EDTYPE,
       "no fp8 cast of a piece"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    assert_int_equal(ferry_refit_declare_piece(s, "q", &d, w, bad[i].as, &bad[i].p), bad[i].want);
    assert_non_null(strstr(ferry_last_error(), "'q'"));
    assert_non_null(strstr(ferry_last_error(), bad[i].why));
  }
  assert_int_equal(s->plan.count, 0); /* a refused piece declares nothing */
  assert_int_equal(ferry_refit_declare_piece(s, "q", &d, w, FERRY_DTYPE_INVALID, NULL),
                   FERRY_EINVAL);

  /* a piece sent as bf16, a whole tensor; re-declaring turns a piece whole and back */
  FR_OK(ferry_refit_declare_piece(s, "q", &d, w, FERRY_DTYPE_BF16, &of));
  FR_OK(ferry_refit_declare(s, "norm", &d, w, FERRY_DTYPE_F8E4M3)); /* whole: fp8 is fine */
  const fr_refit_entry *q = entry_of(s, "q");
  assert_string_equal(q->global, "layers.0.qkv");
  assert_int_equal(q->gdim, 1);
  assert_int_equal(q->gstart, 6);
  assert_int_equal(q->gstop, 12);
  assert_null(entry_of(s, "norm")->global);
  FR_OK(ferry_refit_declare(s, "q", &d, w, FERRY_DTYPE_INVALID));
  assert_null(entry_of(s, "q")->global);
  FR_OK(ferry_refit_declare_piece(s, "q", &d, w, FERRY_DTYPE_INVALID, &of));
  assert_string_equal(entry_of(s, "q")->global, "layers.0.qkv");

  /* the sealed manifest carries them */
  FR_OK(ferry_refit_seal(s));
  fr_refit_plan m;
  FR_OK(fr_refit_manifest_decode(s->manifest, s->manifest_len, &m));
  assert_int_equal(m.count, 2);
  assert_int_equal(m.world, 1);
  assert_string_equal(m.entries[0].name, "q");
  assert_string_equal(m.entries[0].global, "layers.0.qkv");
  assert_int_equal(m.entries[0].gdim, 1);
  assert_int_equal(m.entries[0].gstart, 6);
  assert_int_equal(m.entries[0].gstop, 12);
  assert_null(m.entries[1].global);
  fr_refit_plan_free(&m);
  ferry_refit_sender_close(s); /* frees the global names (ASan's leak check) */
  ferry_ctx_close(c);
}

/* A group rank's plan: 3 of 4; a whole tensor, a row piece and a column piece. */
static fr_refit_plan group_plan(void) {
  fr_refit_plan p = {.count = 3,
                     .entries = calloc(3, sizeof(fr_refit_entry)),
                     .rank = 3,
                     .world = 4,
                     .generation = 2};
  const char *names[] = {"norm", "embed.3", "o_proj.3"};
  for (uint32_t i = 0; i < 3; i++) {
    p.entries[i].name = strdup(names[i]);
    p.entries[i].desc = (ferry_tensor_desc){.dtype = FERRY_DTYPE_F32, .ndim = 2, .shape = {8, 5}};
  }
  p.entries[1].global = strdup("embed");
  p.entries[1].gdim = 0, p.entries[1].gstart = 24, p.entries[1].gstop = 32;
  p.entries[2].global = strdup("o_proj");
  p.entries[2].gdim = 1, p.entries[2].gstart = 15, p.entries[2].gstop = 20;
  FR_OK(fr_refit_plan_build(&p, 4096));
  return p;
}

/* Where the last entry's piece lies in an encoded manifest: its global name's length (u16),
 * then gdim (u32), gstart, gstop (u64). */
typedef struct piece_at {
  size_t glen, gdim, gstart, gstop;
} piece_at;

static piece_at last_piece(size_t len, size_t global_len) {
  piece_at a = {.gstop = len - 8, .gstart = len - 16, .gdim = len - 20};
  a.glen = a.gdim - global_len - 2;
  return a;
}

/* Decoding buf after `poke` is refused with FERRY_EPROTO; buf is restored. */
static void refused_with(uint8_t *buf, size_t len, size_t at, const void *poke, size_t n,
                         const char *why) {
  uint8_t keep[8];
  memcpy(keep, buf + at, n);
  memcpy(buf + at, poke, n);
  fr_refit_plan q;
  assert_int_equal(fr_refit_manifest_decode(buf, len, &q), FERRY_EPROTO);
  assert_non_null(strstr(ferry_last_error(), why));
  memcpy(buf + at, keep, n);
}

static void test_manifest_group_round_trip(void **st) {
  fr_refit_plan p = group_plan();
  uint8_t *buf;
  size_t len;
  FR_OK(fr_refit_manifest_encode(&p, &buf, &len));
  fr_refit_plan q;
  FR_OK(fr_refit_manifest_decode(buf, len, &q));
  assert_int_equal(q.rank, 3);
  assert_int_equal(q.world, 4);
  assert_int_equal(q.generation, 2);
  assert_null(q.entries[0].global);
  assert_string_equal(q.entries[1].global, "embed");
  assert_int_equal(q.entries[1].gdim, 0);
  assert_int_equal(q.entries[1].gstart, 24);
  assert_int_equal(q.entries[1].gstop, 32);
  assert_string_equal(q.entries[2].global, "o_proj");
  assert_int_equal(q.entries[2].gdim, 1);
  assert_int_equal(q.entries[2].gstart, 15);
  assert_int_equal(q.entries[2].gstop, 20);
  fr_refit_plan_free(&q);

  /* every truncation is refused */
  for (size_t cut = 0; cut < len; cut++)
    assert_int_equal(fr_refit_manifest_decode(buf, cut, &q), FERRY_EPROTO);
  /* rank and world (head bytes 32..40) */
  uint8_t u32[4];
  fr_put_u32(u32, 4);
  refused_with(buf, len, 32, u32, 4, "rank 4 of a world of 4");
  fr_put_u32(u32, 0);
  refused_with(buf, len, 36, u32, 4, "world of 0");
  fr_put_u32(u32, FR_REFIT_MAX_WORLD + 1);
  refused_with(buf, len, 36, u32, 4, "world of 65537");
  /* the last entry's piece of "o_proj" */
  piece_at a = last_piece(len, strlen("o_proj"));
  assert_memory_equal(buf + a.glen + 2, "o_proj", 6);
  uint8_t u64[8];
  fr_put_u32(u32, 2);
  refused_with(buf, len, a.gdim, u32, 4, "along dim 2");
  fr_put_u64(u64, 20);
  refused_with(buf, len, a.gstart, u64, 8, "[20, 20)");
  fr_put_u64(u64, 21);
  refused_with(buf, len, a.gstop, u64, 8, "[15, 21)"); /* 6 columns, the tensor has 5 */
  fr_put_u64(u64, (uint64_t)1 << 63);
  refused_with(buf, len, a.gstart, u64, 8, "does not fit");
  uint64_t past = ((uint64_t)1 << 63) + 5;
  fr_put_u64(u64, past);
  uint8_t u64b[8];
  fr_put_u64(u64b, past - 5);
  memcpy(buf + a.gstart, u64b, 8); /* [2^63, 2^63 + 5): 5 wide, past int64 */
  refused_with(buf, len, a.gstop, u64, 8, "does not fit");
  fr_put_u64(buf + a.gstart, 15);
  refused_with(buf, len, a.glen + 3, "\x1b", 1, "control character");
  refused_with(buf, len, a.glen + 3, "\0", 1, "NUL inside a global tensor name");
  uint8_t glen[2] = {0xff, 0x01}; /* 511: longer than a name may be */
  refused_with(buf, len, a.glen, glen, 2, "bad global tensor name length 511");
  glen[0] = 7, glen[1] = 0; /* one more than is there: the piece runs short */
  refused_with(buf, len, a.glen, glen, 2, "refit manifest");
  glen[0] = 0; /* whole: the piece's bytes are left over */
  refused_with(buf, len, a.glen, glen, 2, "sizes do not add up");
  FR_OK(fr_refit_manifest_decode(buf, len, &q)); /* restored whole */
  fr_refit_plan_free(&q);
  free(buf);

  /* a single sender's plan (world 0 or 1) goes as rank 0 of 1 */
  p.world = 0, p.rank = 0;
  FR_OK(fr_refit_manifest_encode(&p, &buf, &len));
  assert_int_equal(fr_get_u32(buf + 32), 0);
  assert_int_equal(fr_get_u32(buf + 36), 1);
  free(buf);
  fr_refit_plan_free(&p);
}

/* The fuzzer's seeds (fuzz/seeds/manifest_fuzz) are manifests of this version: each decodes and
 * encodes to the same bytes, and one is a group's rank with pieces. */
static void test_manifest_fuzz_seeds(void **st) {
  const char *src = getenv("FERRY_SOURCE_DIR");
  assert_non_null(src);
  const char *seeds[] = {"three", "group_rank1"};
  for (size_t i = 0; i < 2; i++) {
    char path[512];
    snprintf(path, sizeof path, "%s/fuzz/seeds/manifest_fuzz/%s", src, seeds[i]);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    uint8_t in[4096];
    size_t n = fread(in, 1, sizeof in, f);
    fclose(f);
    fr_refit_plan p;
    FR_OK(fr_refit_manifest_decode(in, n, &p));
    uint8_t *again;
    size_t len;
    FR_OK(fr_refit_manifest_encode(&p, &again, &len));
    assert_int_equal(len, n);
    assert_memory_equal(again, in, n);
    if (i == 1) {
      assert_int_equal(p.rank, 1);
      assert_int_equal(p.world, 2);
      assert_non_null(p.entries[0].global);
    }
    free(again);
    fr_refit_plan_free(&p);
  }
}

/* A push after declaring since the last seal is refused, naming the tensor, until the sender
 * seals again; before the first seal it says to seal. */
static void test_declared_since_seal(void **st) {
  ferry_ctx *c = ctx_for("trainer");
  ferry_refit_sender *s;
  FR_OK(ferry_refit_sender_open(c, "policy", NULL, &s));
  static float w[16], x[16];
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_F32, .ndim = 1, .shape = {16}};
  FR_OK(ferry_refit_declare(s, "w", &d, w, FERRY_DTYPE_INVALID));
  assert_int_equal(ferry_refit_push(s, 1, NULL), FERRY_ESTATE);
  assert_non_null(strstr(ferry_last_error(), "seal before pushing"));
  FR_OK(ferry_refit_seal(s));
  FR_OK(ferry_refit_push(s, 1, NULL));

  FR_OK(ferry_refit_declare(s, "x", &d, x, FERRY_DTYPE_INVALID)); /* a new tensor */
  assert_int_equal(ferry_refit_push(s, 2, NULL), FERRY_ESTATE);
  assert_non_null(
      strstr(ferry_last_error(), "tensor 'x' declared since the last seal: seal again"));
  FR_OK(ferry_refit_seal(s));
  FR_OK(ferry_refit_push(s, 2, NULL));

  ferry_refit_piece of = {.source = "wx", .dim = 0, .start = 16, .stop = 32};
  FR_OK(ferry_refit_declare_piece(s, "w", &d, w, FERRY_DTYPE_INVALID, &of)); /* re-declared */
  FR_OK(ferry_refit_declare(s, "x", &d, x, FERRY_DTYPE_INVALID)); /* unchanged, still counts */
  assert_int_equal(ferry_refit_push(s, 3, NULL), FERRY_ESTATE);
  assert_non_null(strstr(ferry_last_error(), "tensor 'w' (and 1 more declarations) declared "
                                             "since the last seal: seal again"));
  assert_int_equal(ferry_refit_push(s, 3, NULL), FERRY_ESTATE); /* still, until sealed */
  FR_OK(ferry_refit_seal(s));
  FR_OK(ferry_refit_push(s, 3, NULL)); /* the refused pushes took no version */
  ferry_refit_sender_close(s);
  ferry_ctx_close(c);
}

/* A rank with one whole and one piece, opened, declared and sealed. */
static ferry_refit_sender *rank_sender(ferry_ctx *c, int rank, int world, float *w) {
  ferry_refit_opts o = {
      .size = sizeof o, .bucket_bytes = 4096, .publish = 1, .rank = rank, .world = world};
  ferry_refit_sender *s;
  FR_OK(ferry_refit_sender_open(c, "policy", &o, &s));
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_F32, .ndim = 2, .shape = {4, 8}};
  ferry_refit_piece of = {.source = "embed", .dim = 0, .start = 4 * rank, .stop = 4 * rank + 4};
  FR_OK(ferry_refit_declare(s, "norm", &d, w, FERRY_DTYPE_INVALID));
  FR_OK(ferry_refit_declare_piece(s, "embed.local", &d, w, FERRY_DTYPE_INVALID, &of));
  FR_OK(ferry_refit_seal(s));
  return s;
}

/* Two ranks on two contexts of this process publish as one group: NAME#0 and NAME#1, each at
 * its own context's address, each manifest saying its rank of 2; NAME alone, NAME#2 and a
 * second rank 1 are not to be had. */
static void test_group_published(void **st) {
  char listen[64], url[80];
  int port = su_free_port();
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  snprintf(url, sizeof url, "ferry://127.0.0.1:%d", port);
  ferry_ctx_opts dopts = {.size = sizeof dopts, .name = "directory", .tcp_listen = listen};
  ferry_ctx *dc;
  FR_OK(ferry_ctx_open(&dopts, &dc));
  fr_dir_server *srv;
  FR_OK(fr_dir_server_start(dc, &srv));
  setenv("FERRY_DIRECTORY", url, 1);

  static float w[2][32];
  ferry_ctx *tc[2] = {ctx_for("trainer-0"), ctx_for("trainer-1")}, *rc = ctx_for("rollout"),
            *extra = ctx_for("trainer-1b");
  ferry_refit_sender *s[2];
  for (int r = 0; r < 2; r++)
    s[r] = rank_sender(tc[r], r, 2, w[r]);
  for (uint32_t r = 0; r < 2; r++) {
    char *address = NULL, want[16];
    FR_OK(fr_refit_resolve_rank(rc, "policy", r, ANSWER_MS, &address));
    assert_string_equal(address, ferry_ctx_address(tc[r]));
    free(address);
    snprintf(want, sizeof want, "policy#%u", r);
    assert_string_equal(s[r]->name, want);
    fr_refit_plan m;
    FR_OK(fr_refit_manifest_decode(s[r]->manifest, s[r]->manifest_len, &m));
    assert_int_equal(m.rank, r);
    assert_int_equal(m.world, 2);
    assert_string_equal(m.entries[1].global, "embed");
    assert_int_equal(m.entries[1].gstart, 4 * r);
    fr_refit_plan_free(&m);
  }
  char *address = NULL;
  assert_int_equal(fr_refit_resolve_rank(rc, "policy", 2, ANSWER_MS, &address), FERRY_ENOTFOUND);
  assert_non_null(strstr(ferry_last_error(), "rank 2 of group 'policy' is not published"));
  assert_int_equal(fr_refit_resolve(rc, "policy", ANSWER_MS, &address), FERRY_ENOTFOUND);
  assert_null(address);
  ferry_refit_opts o = {.size = sizeof o, .publish = 1, .rank = 1, .world = 2};
  ferry_refit_sender *again;
  assert_int_equal(ferry_refit_sender_open(extra, "policy", &o, &again), FERRY_EEXIST);
  assert_non_null(strstr(ferry_last_error(), "policy#1"));

  /* a rank that closes lets its name go: another process's rank 1 takes it */
  ferry_refit_sender_close(s[1]);
  s[1] = rank_sender(extra, 1, 2, w[1]);
  FR_OK(fr_refit_resolve_rank(rc, "policy", 1, ANSWER_MS, &address));
  assert_string_equal(address, ferry_ctx_address(extra));
  free(address);
  for (int r = 0; r < 2; r++)
    ferry_refit_sender_close(s[r]);
  assert_int_equal(fr_refit_resolve_rank(rc, "policy", 0, ANSWER_MS, &address), FERRY_ENOTFOUND);

  unsetenv("FERRY_DIRECTORY");
  ferry_ctx_close(extra);
  ferry_ctx_close(rc);
  ferry_ctx_close(tc[1]);
  ferry_ctx_close(tc[0]);
  fr_dir_server_stop(srv);
  ferry_ctx_close(dc);
}

/* A single sender publishes under its own name, as before groups: no NAME#0. */
static void test_single_published_as_before(void **st) {
  char listen[64], url[80];
  int port = su_free_port();
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  snprintf(url, sizeof url, "ferry://127.0.0.1:%d", port);
  ferry_ctx_opts dopts = {.size = sizeof dopts, .name = "directory", .tcp_listen = listen};
  ferry_ctx *dc;
  FR_OK(ferry_ctx_open(&dopts, &dc));
  fr_dir_server *srv;
  FR_OK(fr_dir_server_start(dc, &srv));
  setenv("FERRY_DIRECTORY", url, 1);
  static float w[32];
  ferry_ctx *tc = ctx_for("trainer"), *rc = ctx_for("rollout");
  ferry_refit_sender *s = rank_sender(tc, 0, 1, w);
  char *address = NULL;
  FR_OK(fr_refit_resolve(rc, "policy", ANSWER_MS, &address));
  assert_string_equal(address, ferry_ctx_address(tc));
  free(address);
  address = NULL;
  assert_int_equal(fr_refit_resolve_rank(rc, "policy", 0, ANSWER_MS, &address), FERRY_ENOTFOUND);
  ferry_refit_sender_close(s);
  unsetenv("FERRY_DIRECTORY");
  ferry_ctx_close(rc);
  ferry_ctx_close(tc);
  fr_dir_server_stop(srv);
  ferry_ctx_close(dc);
}

static void test_rank_names(void **st) {
  char *n = NULL;
  FR_OK(fr_refit_rank_name("policy", 12, &n));
  assert_string_equal(n, "policy#12");
  free(n);
  char longname[FR_REFIT_NAME_MAX + 1];
  memset(longname, 'a', FR_REFIT_NAME_MAX);
  longname[FR_REFIT_NAME_MAX] = '\0';
  n = NULL;
  assert_int_equal(fr_refit_rank_name(longname, 1, &n), FERRY_EINVAL);
  assert_null(n);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rank_world_checks),
      cmocka_unit_test(test_declare_piece_checks),
      cmocka_unit_test(test_manifest_group_round_trip),
      cmocka_unit_test(test_manifest_fuzz_seeds),
      cmocka_unit_test(test_declared_since_seal),
      cmocka_unit_test(test_group_published),
      cmocka_unit_test(test_single_published_as_before),
      cmocka_unit_test(test_rank_names),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, NULL, NULL);
}
