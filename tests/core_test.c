/*
 * Core services: status table, error details, config table, dtypes and overflow-safe sizes,
 * checksums.
 */
#include "testutil.h"

#include "core/core.h"
#include "core/hash.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void test_status_strings(void **state) {
  assert_string_equal(ferry_strerror(FERRY_OK), "success");
  assert_string_equal(ferry_strerror(FERRY_EPEER), "peer gone");
  assert_string_equal(ferry_status_name(FERRY_ERANGE), "FERRY_ERANGE");
  assert_string_equal(ferry_strerror(-9999), "unknown status");
  /* every code in the table has a distinct message */
  const int codes[] = {
#define C_(n, c, m) c,
      FERRY_STATUS_TABLE(C_)
#undef C_
  };
  for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++)
    for (size_t j = i + 1; j < sizeof codes / sizeof codes[0]; j++)
      assert_string_not_equal(ferry_strerror(codes[i]), ferry_strerror(codes[j]));
}

static void test_error_detail(void **state) {
  int rc = fr_err(FERRY_ERANGE, "read region %d: offset %d", 7, 4096);
  assert_int_equal(rc, FERRY_ERANGE);
  assert_string_equal(ferry_last_error(), "read region 7: offset 4096");
}

static void test_config(void **state) {
  assert_true(ferry_config_count() >= 5);
  for (size_t i = 0; i < ferry_config_count(); i++) {
    const ferry_config_item *it = ferry_config_at(i);
    assert_non_null(it);
    assert_true(strncmp(it->name, "FERRY_", 6) == 0);
    assert_true(strlen(it->doc) > 10);
  }
  assert_null(ferry_config_at(ferry_config_count()));
  assert_null(ferry_config_get("FERRY_NO_SUCH"));
  unsetenv("FERRY_TIMEOUT_MS");
  assert_string_equal(ferry_config_get("FERRY_TIMEOUT_MS"), "10000");
  setenv("FERRY_TIMEOUT_MS", "1234", 1);
  assert_int_equal(fr_timeout(-1), 1234);
  assert_int_equal(fr_timeout(5), 5);
  setenv("FERRY_TIMEOUT_MS", "garbage", 1);
  assert_int_equal(fr_timeout(-1), 10000);
  unsetenv("FERRY_TIMEOUT_MS");
}

static void test_dtypes(void **state) {
  ferry_dtype d;
  FR_OK(ferry_dtype_parse("bf16", &d));
  assert_int_equal(d, FERRY_DTYPE_BF16);
  assert_int_equal(ferry_dtype_size(d), 2);
  FR_OK(ferry_dtype_parse("uint8", &d));
  assert_string_equal(ferry_dtype_name(d), "uint8");
  FR_OK(ferry_dtype_parse("float8_e4m3", &d));
  assert_int_equal(ferry_dtype_size(d), 1);
  assert_int_equal(ferry_dtype_parse("complex64", &d), FERRY_EDTYPE);
  assert_non_null(strstr(ferry_last_error(), "complex64"));
  assert_int_equal(ferry_dtype_size((ferry_dtype)99), 0);
  assert_null(ferry_dtype_name((ferry_dtype)0));
}

static void test_tensor_sizes(void **state) {
  ferry_tensor_desc t = {.dtype = FERRY_DTYPE_U8, .ndim = 3, .shape = {45, 32768, 8}};
  uint64_t n = 0;
  FR_OK(ferry_tensor_nbytes(&t, &n));
  assert_int_equal(n, 45ull * 32768 * 8);
  t.dtype = FERRY_DTYPE_I32;
  FR_OK(ferry_tensor_nbytes(&t, &n));
  assert_int_equal(n, 4ull * 45 * 32768 * 8);
  t.ndim = 0; /* scalar */
  FR_OK(ferry_tensor_nbytes(&t, &n));
  assert_int_equal(n, 4);

  ferry_tensor_desc big = {.dtype = FERRY_DTYPE_F64, .ndim = 2, .shape = {1ull << 40, 1ull << 30}};
  n = 77;
  assert_int_equal(ferry_tensor_nbytes(&big, &n), FERRY_EOVERFLOW);
  assert_int_equal(n, 77); /* outputs untouched on failure */
  big.ndim = 9;
  assert_int_equal(ferry_tensor_nbytes(&big, &n), FERRY_ESHAPE);
  big.ndim = 1;
  big.dtype = (ferry_dtype)42;
  assert_int_equal(ferry_tensor_nbytes(&big, &n), FERRY_EDTYPE);
}

static void test_shape_parse(void **state) {
  ferry_tensor_desc t = {.dtype = FERRY_DTYPE_U8};
  FR_OK(ferry_shape_parse("45,32768,8", &t));
  assert_int_equal(t.ndim, 3);
  assert_int_equal(t.shape[1], 32768);
  char buf[64];
  assert_string_equal(ferry_shape_format(&t, buf, sizeof buf), "[45, 32768, 8]");
  FR_OK(ferry_shape_parse("[2, 3]", &t));
  assert_int_equal(t.ndim, 2);
  assert_int_equal(ferry_shape_parse("1,2,3,4,5,6,7,8,9", &t), FERRY_ESHAPE);
  assert_int_equal(ferry_shape_parse("4,-1", &t), FERRY_ESHAPE);
  assert_int_equal(ferry_shape_parse("99999999999999999999999", &t), FERRY_EOVERFLOW);
  assert_int_equal(t.ndim, 2); /* untouched on failure */
}

static void test_checksum(void **state) {
  const char *s = "ferry";
  assert_int_equal(ferry_checksum(s, 5), ferry_checksum("ferry", 5));
  assert_int_not_equal(ferry_checksum(s, 5), ferry_checksum("ferrz", 5));
  assert_string_equal(ferry_version(), FERRY_VERSION_STRING);
}

static int log_calls;
static void count_log(ferry_log_level level, const char *msg, void *arg) {
  (void)level;
  (void)arg;
  if (strstr(msg, "hello 42"))
    log_calls++;
}

static void test_logging(void **state) {
  ferry_log_level old = ferry_log_get_level();
  ferry_log_set_callback(count_log, NULL);
  ferry_log_set_level(FERRY_LOG_ERROR);
  fr_info("hello %d", 42);
  assert_int_equal(log_calls, 0);
  ferry_log_set_level(FERRY_LOG_INFO);
  fr_info("hello %d", 42);
  assert_int_equal(log_calls, 1);
  ferry_log_set_callback(NULL, NULL);
  ferry_log_set_level(old);
  assert_int_equal(fr_log_level_parse("debug"), FERRY_LOG_DEBUG);
  assert_int_equal(fr_log_level_parse("loud"), -1);
}

/* Every XXH3 build gives the same values, one-shot and streaming, for every length. */
static void test_hash_builds_agree(void **state) {
  uint8_t buf[5000];
  tu_fill(buf, sizeof buf, 42);
  __builtin_cpu_init();
  bool avx2 = __builtin_cpu_supports("avx2");
  for (size_t n = 0; n < sizeof buf; n = n * 2 + 1) {
    uint64_t want = fr_hash_generic.oneshot(buf, n);
    assert_true(ferry_checksum(buf, n) == want);
    if (avx2)
      assert_true(fr_hash_avx2.oneshot(buf, n) == want);
    fr_hash *h = fr_hash_begin();
    for (size_t at = 0; at < n; at += 777)
      fr_hash_update(h, buf + at, n - at < 777 ? n - at : 777);
    assert_true(fr_hash_end(h) == want);
  }
}

static void hex(const uint8_t *b, size_t n, char *out) {
  for (size_t i = 0; i < n; i++)
    sprintf(out + 2 * i, "%02x", b[i]);
}

static void test_sha256_hmac(void **state) {
  uint8_t d[32];
  char h[65];
  fr_sha256("abc", 3, d);
  hex(d, 32, h);
  assert_string_equal(h, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  fr_sha256("", 0, d);
  hex(d, 32, h);
  assert_string_equal(h, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  /* RFC 4231 test case 2 */
  fr_hmac_sha256("Jefe", 4, "what do ya want for nothing?", 28, d);
  hex(d, 32, h);
  assert_string_equal(h, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  /* RFC 4231 test case 6: key longer than a block */
  uint8_t key[131];
  memset(key, 0xaa, sizeof key);
  const char *m = "Test Using Larger Than Block-Size Key - Hash Key First";
  fr_hmac_sha256(key, sizeof key, m, strlen(m), d);
  hex(d, 32, h);
  assert_string_equal(h, "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  assert_true(fr_memeq_const("abc", "abc", 3));
  assert_false(fr_memeq_const("abc", "abd", 3));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_status_strings), cmocka_unit_test(test_error_detail),
      cmocka_unit_test(test_config),         cmocka_unit_test(test_dtypes),
      cmocka_unit_test(test_tensor_sizes),   cmocka_unit_test(test_shape_parse),
      cmocka_unit_test(test_checksum),       cmocka_unit_test(test_logging),
      cmocka_unit_test(test_sha256_hmac),    cmocka_unit_test(test_hash_builds_agree),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
