/*
 * Refit plans: layout, bucket windows, the manifest codec and its validation, and the casts.
 */
#include "testutil.h"

#include "refit/plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static fr_refit_plan make_plan(uint32_t n, uint64_t budget) {
  fr_refit_plan p = {.count = n, .entries = calloc(n, sizeof(fr_refit_entry))};
  for (uint32_t i = 0; i < n; i++) {
    fr_refit_entry *e = &p.entries[i];
    char name[64];
    snprintf(name, sizeof name, "layers.%u.weight", i);
    e->name = strdup(name);
    e->desc = (ferry_tensor_desc){
        .dtype = FERRY_DTYPE_F32, .ndim = 2, .shape = {1 + i % 7, 3 + (i * 13) % 100}};
    if (i % 3 == 1)
      e->wire = FERRY_DTYPE_BF16;
  }
  FR_OK(fr_refit_plan_build(&p, budget));
  return p;
}

static void test_layout_and_buckets(void **s) {
  fr_refit_plan p = make_plan(500, 4096);
  assert_true(p.buckets > 1);
  uint64_t covered = 0;
  for (uint32_t i = 0; i < p.count; i++) {
    assert_int_equal(p.entries[i].offset % FR_REFIT_ALIGN, 0);
    if (i % 3 == 1)
      assert_int_equal(p.entries[i].wire_bytes * 2, p.entries[i].src_bytes);
  }
  /* every wire byte of every tensor is in exactly one bucket */
  for (uint32_t b = 0; b < p.buckets; b++) {
    uint32_t first = fr_refit_first_entry(&p, b);
    for (uint32_t e = 0; e < p.count; e++) {
      uint64_t wo, bo, n = fr_refit_overlap(&p, e, b, &wo, &bo);
      if (n > 0) {
        assert_true(e >= first);
        assert_true(bo + n <= fr_refit_bucket_len(&p, b));
      }
      covered += n;
    }
  }
  uint64_t want = 0;
  for (uint32_t i = 0; i < p.count; i++)
    want += p.entries[i].wire_bytes;
  assert_int_equal(covered, want);
  assert_int_equal(fr_refit_plan_find(&p, "layers.7.weight"), 7);
  assert_int_equal(fr_refit_plan_find(&p, "nope"), -1);
  fr_refit_plan_free(&p);
}

static void test_manifest_round_trip(void **s) {
  fr_refit_plan p = make_plan(50, 1 << 20);
  p.entries[4].scale = 0.25f;
  p.generation = 3;
  uint8_t *buf;
  size_t len;
  FR_OK(fr_refit_manifest_encode(&p, &buf, &len));
  fr_refit_plan q;
  FR_OK(fr_refit_manifest_decode(buf, len, &q));
  assert_int_equal(q.count, 50);
  assert_int_equal(q.generation, 3);
  assert_int_equal(q.total_bytes, p.total_bytes);
  assert_int_equal(q.buckets, p.buckets);
  assert_string_equal(q.entries[9].name, p.entries[9].name);
  assert_true(q.entries[4].scale == 0.25f);
  assert_int_equal(q.entries[7].wire, FERRY_DTYPE_BF16);
  fr_refit_plan_free(&q);
  /* every truncation and a flipped byte in each header field are refused, never trusted */
  for (size_t cut = 0; cut < len; cut += 7)
    assert_int_equal(fr_refit_manifest_decode(buf, cut, &q), FERRY_EPROTO);
  for (size_t i = 0; i < 32; i++) {
    if ((i >= 8 && i < 12) || i >= 24)
      continue; /* the generation and the bucket size may be anything */
    buf[i] ^= 0x40;
    assert_int_equal(fr_refit_manifest_decode(buf, len, &q), FERRY_EPROTO);
    buf[i] ^= 0x40;
  }
  free(buf);
  fr_refit_plan_free(&p);
}

static void test_casts(void **s) {
  float in[] = {1.0f, -2.0f, 0.0f, 448.0f, 1000.0f, 1.0f / 512, 3.14159f, 1.0f + 1.0f / 256};
  uint16_t bf[8];
  FR_OK(fr_refit_cast(FERRY_DTYPE_F32, FERRY_DTYPE_BF16, 1, in, bf, 8));
  assert_int_equal(bf[0], 0x3f80);
  assert_int_equal(bf[1], 0xc000);
  assert_int_equal(bf[7], 0x3f80); /* 1 + 2^-8 rounds to even */
  uint8_t f8[8];
  FR_OK(fr_refit_cast(FERRY_DTYPE_F32, FERRY_DTYPE_F8E4M3, 1, in, f8, 8));
  assert_int_equal(f8[0], 0x38);
  assert_int_equal(f8[1], 0xc0);
  assert_int_equal(f8[2], 0x00);
  assert_int_equal(f8[3], 0x7e);
  assert_int_equal(f8[4], 0x7e); /* saturates */
  assert_int_equal(f8[5], 0x01); /* smallest subnormal */
  assert_int_equal(f8[6], 0x45); /* 3.14159 -> 1.625 * 2^1 = 3.25 */
  float scale = fr_refit_fp8_scale(FERRY_DTYPE_F32, in, 8);
  assert_true(scale > 2.2f && scale < 2.24f); /* 1000 / 448 */
  FR_OK(fr_refit_cast(FERRY_DTYPE_BF16, FERRY_DTYPE_F8E4M3, 1, bf, f8, 2));
  assert_int_equal(f8[0], 0x38);
  uint16_t h[8];
  FR_OK(fr_refit_cast(FERRY_DTYPE_F32, FERRY_DTYPE_F16, 1, in, h, 8));
  assert_int_equal(h[0], 0x3c00); /* 1 */
  assert_int_equal(h[1], 0xc000); /* -2 */
  assert_int_equal(h[2], 0x0000);
  assert_int_equal(h[3], 0x5f00); /* 448 */
  assert_int_equal(h[4], 0x63d0); /* 1000 */
  assert_int_equal(h[5], 0x1800); /* 2^-9 */
  assert_int_equal(h[6], 0x4248); /* 3.14159 -> 3.140625 */
  float big = 70000.0f, tiny = 1e-8f;
  FR_OK(fr_refit_cast(FERRY_DTYPE_F32, FERRY_DTYPE_F16, 1, &big, h, 1));
  assert_int_equal(h[0], 0x7c00); /* overflow: infinity */
  FR_OK(fr_refit_cast(FERRY_DTYPE_F32, FERRY_DTYPE_F16, 1, &tiny, h, 1));
  assert_int_equal(h[0], 0x0000); /* below half the smallest subnormal */
  assert_int_equal(fr_refit_cast(FERRY_DTYPE_I32, FERRY_DTYPE_BF16, 1, in, bf, 1), FERRY_EDTYPE);
  assert_false(fr_refit_cast_supported(FERRY_DTYPE_F8E4M3, FERRY_DTYPE_F32));
}

static void test_plan_rejects(void **s) {
  fr_refit_plan p = {.count = 1, .entries = calloc(1, sizeof(fr_refit_entry))};
  p.entries[0].name = strdup("w");
  p.entries[0].desc = (ferry_tensor_desc){.dtype = FERRY_DTYPE_I32, .ndim = 1, .shape = {4}};
  p.entries[0].wire = FERRY_DTYPE_BF16;
  assert_int_equal(fr_refit_plan_build(&p, 1 << 20), FERRY_EDTYPE);
  assert_non_null(strstr(ferry_last_error(), "'w'"));
  fr_refit_plan_free(&p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_layout_and_buckets),
      cmocka_unit_test(test_manifest_round_trip),
      cmocka_unit_test(test_casts),
      cmocka_unit_test(test_plan_rejects),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, NULL, NULL);
}
