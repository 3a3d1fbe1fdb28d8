/*
 * The .npy reader and header writer of `ferry put`/`ferry get` (src/cli/npy.c), called directly
 * on files built byte by byte here: valid version 1/2/3 files of several dtypes and shapes, every
 * header `get` writes read back, and each way a header can lie about the file -- refused with
 * the right status and a message that says what is wrong. Every buffer is allocated at exactly
 * the file's length, so a read past it shows under ASan.
 */
#include "cli/npy.h"
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A file: preamble (version major.0), dict, padding to 64 bytes and '\n', then data_len bytes. */
static uint8_t *npy_file(int major, const char *dict, size_t data_len, size_t *len) {
  size_t pre = major == 1 ? 10 : 12, n = strlen(dict);
  size_t hlen = n + 1 + (64 - (pre + n + 1) % 64) % 64;
  *len = pre + hlen + data_len;
  uint8_t *b = malloc(*len ? *len : 1);
  memcpy(b, "\x93NUMPY", 6);
  b[6] = (uint8_t)major;
  b[7] = 0;
  for (size_t i = 0; i < pre - 8; i++)
    b[8 + i] = (uint8_t)(hlen >> (8 * i));
  memcpy(b + pre, dict, n);
  memset(b + pre + n, ' ', hlen - n - 1);
  b[pre + hlen - 1] = '\n';
  for (size_t i = 0; i < data_len; i++)
    b[pre + hlen + i] = (uint8_t)(i * 7 + 1);
  return b;
}

static void expect_ok(int major, const char *dict, size_t data_len, ferry_dtype dtype,
                      uint32_t ndim, const uint64_t *shape) {
  size_t len;
  uint8_t *b = npy_file(major, dict, data_len, &len);
  cli_npy npy;
  int rc = cli_npy_parse(b, len, &npy);
  if (rc != 0)
    fprintf(stderr, "refused %s: %s\n", dict, ferry_last_error());
  assert_int_equal(rc, 0);
  assert_int_equal(npy.desc.dtype, dtype);
  assert_int_equal(npy.desc.ndim, ndim);
  for (uint32_t i = 0; i < ndim; i++)
    assert_int_equal(npy.desc.shape[i], shape[i]);
  assert_int_equal(npy.data_bytes, data_len);
  assert_int_equal(npy.data_offset, len - data_len);
  free(b);
}

/* Refused with status, the detail naming `says`, and *out untouched. */
static void expect_bad_file(const uint8_t *b, size_t len, int status, const char *says) {
  cli_npy npy, before;
  memset(&npy, 0xa5, sizeof npy);
  before = npy;
  int rc = cli_npy_parse(b, len, &npy);
  const char *err = ferry_last_error();
  if (rc != status || !strstr(err, says))
    fprintf(stderr, "got %s '%s'; wanted %s '%s'\n", ferry_status_name(rc), err,
            ferry_status_name(status), says);
  assert_int_equal(rc, status);
  assert_non_null(strstr(err, says));
  assert_null(strchr(err, '\n'));
  assert_memory_equal(&npy, &before, sizeof npy);
}

static void expect_bad(int major, const char *dict, size_t data_len, int status, const char *says) {
  size_t len;
  uint8_t *b = npy_file(major, dict, data_len, &len);
  expect_bad_file(b, len, status, says);
  free(b);
}

static void test_valid(void **state) {
  const uint64_t s34[] = {3, 4}, s5[] = {5}, s03[] = {0, 3}, s6[] = {6};
  /* exactly what numpy writes, in each version */
  expect_ok(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }", 48, FERRY_DTYPE_F32,
            2, s34);
  expect_ok(2, "{'descr': '<f8', 'fortran_order': False, 'shape': (5,), }", 40, FERRY_DTYPE_F64, 1,
            s5);
  expect_ok(3, "{'descr': '<u2', 'fortran_order': False, 'shape': (5,), }", 10, FERRY_DTYPE_U16, 1,
            s5);
  expect_ok(1, "{'descr': '<i8', 'fortran_order': False, 'shape': (), }", 8, FERRY_DTYPE_I64, 0,
            NULL);
  expect_ok(1, "{'descr': '|u1', 'fortran_order': False, 'shape': (5,), }", 5, FERRY_DTYPE_U8, 1,
            s5);
  expect_ok(1, "{'descr': '|b1', 'fortran_order': False, 'shape': (3, 4), }", 12, FERRY_DTYPE_BOOL,
            2, s34);
  expect_ok(1, "{'descr': '|i1', 'fortran_order': False, 'shape': (5,), }", 5, FERRY_DTYPE_I8, 1,
            s5);
  expect_ok(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (3, 4), }", 24, FERRY_DTYPE_F16,
            2, s34);
  expect_ok(2, "{'descr': '<u8', 'fortran_order': False, 'shape': (5,), }", 40, FERRY_DTYPE_U64, 1,
            s5);
  /* zero-size arrays hold no bytes */
  expect_ok(1, "{'descr': '<i2', 'fortran_order': False, 'shape': (0, 3), }", 0, FERRY_DTYPE_I16, 2,
            s03);
  /* other spellings Python (and numpy's reader) accept: key order, quotes, commas, spacing,
   * Python 2's longs in old files, byte order on one-byte types */
  expect_ok(1, "{\"shape\":(3,4),\"descr\":\"<i4\",\"fortran_order\":False}", 48, FERRY_DTYPE_I32,
            2, s34);
  expect_ok(1, "{'descr': '<u4', 'fortran_order': False, 'shape': (3L, 4L), }", 48, FERRY_DTYPE_U32,
            2, s34);
  expect_ok(1, "{ 'descr' : '<i2' ,\n 'fortran_order' : False , 'shape' : ( 3 , 4 , ) }", 24,
            FERRY_DTYPE_I16, 2, s34);
  expect_ok(1, "{'descr': '>u1', 'fortran_order': False, 'shape': (5,), }", 5, FERRY_DTYPE_U8, 1,
            s5);
  /* Fortran order where it is the same layout as C order */
  expect_ok(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (6,), }", 24, FERRY_DTYPE_F32, 1,
            s6);
  expect_ok(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (0, 3), }", 0, FERRY_DTYPE_F32, 2,
            s03);
}

/* The user's reports: a shape that disagrees with the bytes that follow, either way. */
static void test_shape_vs_data(void **state) {
  const char *f4_1g = "{'descr': '<f4', 'fortran_order': False, 'shape': (1073741824,), }";
  expect_bad(1, f4_1g, 16, FERRY_ESHAPE, "4294967296 bytes, but 16 bytes follow");
  const char *f4_8 = "{'descr': '<f4', 'fortran_order': False, 'shape': (8,), }";
  expect_bad(1, f4_8, 16, FERRY_ESHAPE, "32 bytes, but 16 bytes follow");
  const char *f4_4 = "{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }";
  expect_bad(1, f4_4, 4096, FERRY_ESHAPE, "16 bytes, but 4096 bytes follow");
  expect_bad(1, f4_4, 17, FERRY_ESHAPE, "but 17 bytes follow");
  /* overflow: of the product, and of one dimension */
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", 0,
             FERRY_EOVERFLOW, "over 2^64 bytes");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (18446744073709551616,), }", 0,
             FERRY_EOVERFLOW, "exceeds 64 bits");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", 0, FERRY_ESHAPE,
             "negative dimension");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,1,1,1,1,1,1,1,1), }", 4,
             FERRY_ESHAPE, "over 8 dimensions");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", 24, FERRY_ESHAPE,
             "fortran_order True");
}

static void test_bad_preamble(void **state) {
  const char *ok = "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }";
  size_t len;
  uint8_t *b = npy_file(1, ok, 48, &len);
  expect_bad_file((const uint8_t *)"NUMPY\x93xx", 8, FERRY_EPROTO, "no \\x93NUMPY magic");
  expect_bad_file(b, 7, FERRY_EPROTO, "truncated in its preamble");
  expect_bad_file(b, 9, FERRY_EPROTO, "truncated in its preamble");
  /* every shorter prefix of a good file is refused, without reading past it */
  for (size_t n = 0; n < len; n++) {
    uint8_t *cut = malloc(n ? n : 1);
    memcpy(cut, b, n);
    cli_npy npy;
    assert_int_not_equal(cli_npy_parse(cut, n, &npy), 0);
    free(cut);
  }
  /* a header cut short: its length runs past the end of the file */
  expect_bad_file(b, 60, FERRY_EPROTO, "header length 118 runs past the file's end");
  b[8] = 0xff;
  b[9] = 0xff;
  expect_bad_file(b, len, FERRY_EPROTO, "header length 65535 runs past");
  free(b);
  b = npy_file(2, ok, 48, &len);
  b[11] = 0x80;
  expect_bad_file(b, len, FERRY_EPROTO, "runs past the file's end");
  b[6] = 4;
  expect_bad_file(b, len, FERRY_EPROTO, "version 4.0");
  b[6] = 1;
  b[7] = 1;
  expect_bad_file(b, len, FERRY_EPROTO, "version 1.1");
  free(b);
}

static void test_bad_header(void **state) {
  /* a descr that merely contains a good one */
  expect_bad(1, "{'descr': 'x<f4', 'fortran_order': False, 'shape': (3,), }", 12, FERRY_EDTYPE,
             "dtype 'x<f4'");
  expect_bad(1, "{'descr': '<f4<', 'fortran_order': False, 'shape': (3,), }", 12, FERRY_EDTYPE,
             "dtype '<f4<'");
  expect_bad(1, "{'descr': '>f4', 'fortran_order': False, 'shape': (3,), }", 12, FERRY_EDTYPE,
             "big-endian");
  expect_bad(1, "{'descr': '<c8', 'fortran_order': False, 'shape': (3,), }", 24, FERRY_EDTYPE,
             "dtype '<c8'");
  expect_bad(1, "{'descr': '|O', 'fortran_order': False, 'shape': (3,), }", 24, FERRY_EDTYPE,
             "dtype '|O'");
  expect_bad(1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (3,), }", 12,
             FERRY_EDTYPE, "structured");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'shape': (3,), }", 12,
             FERRY_EPROTO, "key 'shape' appears twice");
  expect_bad(1, "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", 12,
             FERRY_EPROTO, "key 'descr' appears twice");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }xyz", 12, FERRY_EPROTO,
             "only padding after the header's dict at 'xyz");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,)", 12, FERRY_EPROTO,
             "',' or '}'");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False}", 12, FERRY_EPROTO, "no 'shape' key");
  expect_bad(1, "{'descr': '<f4', 'shape': (3,)}", 12, FERRY_EPROTO, "no 'fortran_order' key");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'x': 1}", 12, FERRY_EPROTO,
             "unexpected key 'x'");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': 0, 'shape': (3,), }", 12, FERRY_EPROTO,
             "True or False");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': Falsey, 'shape': (3,), }", 12, FERRY_EPROTO,
             "True or False");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3), }", 12, FERRY_EPROTO,
             "not a tuple");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': [3], }", 12, FERRY_EPROTO,
             "a tuple");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3 4), }", 48, FERRY_EPROTO,
             "',' or ')'");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (,), }", 0, FERRY_EPROTO,
             "a dimension");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (03,), }", 12, FERRY_EPROTO,
             "a dimension");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3.0,), }", 12, FERRY_EPROTO,
             "a dimension");
  expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1_2,), }", 48, FERRY_EPROTO,
             "a dimension");
  expect_bad(3, "{'descr': '<f4', 'fortran_order': False, 'shape': (3L,), }", 12, FERRY_EPROTO,
             "a dimension");
  expect_bad(1, "{'descr': '<f4\\x', 'fortran_order': False, 'shape': (3,), }", 12, FERRY_EPROTO,
             "no escapes");
  expect_bad(1, "{'descr' '<f4', 'fortran_order': False, 'shape': (3,), }", 12, FERRY_EPROTO,
             "expected ':'");
  expect_bad(1, "['descr', '<f4']", 12, FERRY_EPROTO, "a dict");
  expect_bad(1, "", 12, FERRY_EPROTO, "a dict");
  /* a NUL or a non-ASCII byte after the dict, shown as '?' */
  const char *dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }AB";
  size_t len;
  uint8_t *b = npy_file(1, dict, 12, &len);
  b[10 + strlen(dict) - 2] = '\0';
  b[10 + strlen(dict) - 1] = 0xff;
  expect_bad_file(b, len, FERRY_EPROTO, "at '??");
  free(b);
}

/* Each header `ferry get` writes reads back as the same tensor, 64-byte aligned. */
static void test_header_round_trip(void **state) {
  const ferry_dtype dtypes[] = {
      FERRY_DTYPE_BOOL, FERRY_DTYPE_U8,  FERRY_DTYPE_U16, FERRY_DTYPE_U32,
      FERRY_DTYPE_U64,  FERRY_DTYPE_I8,  FERRY_DTYPE_I16, FERRY_DTYPE_I32,
      FERRY_DTYPE_I64,  FERRY_DTYPE_F16, FERRY_DTYPE_F32, FERRY_DTYPE_F64,
  };
  const ferry_tensor_desc shapes[] = {
      {.ndim = 0},
      {.ndim = 1, .shape = {5}},
      {.ndim = 2, .shape = {3, 4}},
      {.ndim = 3, .shape = {2, 0, 7}},
      {.ndim = 8, .shape = {1, 2, 1, 3, 1, 2, 1, 2}},
  };
  for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
    for (size_t j = 0; j < sizeof shapes / sizeof shapes[0]; j++) {
      ferry_tensor_desc d = shapes[j];
      d.dtype = dtypes[i];
      uint64_t nbytes;
      assert_int_equal(ferry_tensor_nbytes(&d, &nbytes), 0);
      uint8_t head[512];
      size_t hlen;
      assert_int_equal(cli_npy_header(&d, head, sizeof head, &hlen), 0);
      assert_int_equal(hlen % 64, 0);
      assert_int_equal(head[hlen - 1], '\n');
      uint8_t *file = malloc(hlen + nbytes + 1);
      memcpy(file, head, hlen);
      memset(file + hlen, 0x11, nbytes);
      cli_npy npy;
      assert_int_equal(cli_npy_parse(file, hlen + nbytes, &npy), 0);
      assert_int_equal(npy.data_offset, hlen);
      assert_int_equal(npy.data_bytes, nbytes);
      assert_int_equal(npy.desc.dtype, d.dtype);
      assert_int_equal(npy.desc.ndim, d.ndim);
      assert_memory_equal(npy.desc.shape, d.shape, d.ndim * sizeof d.shape[0]);
      free(file);
    }
  }
  /* numpy's own spelling of the shape tuple: () (5,) (3, 4) */
  uint8_t head[512];
  size_t hlen;
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_F32, .ndim = 1, .shape = {5}};
  assert_int_equal(cli_npy_header(&d, head, sizeof head, &hlen), 0);
  const char *want1 = "{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }";
  assert_memory_equal(head + 10, want1, strlen(want1));
  d.ndim = 0;
  assert_int_equal(cli_npy_header(&d, head, sizeof head, &hlen), 0);
  const char *want0 = "{'descr': '<f4', 'fortran_order': False, 'shape': (), }";
  assert_memory_equal(head + 10, want0, strlen(want0));
  /* no .npy name for bfloat16; a buffer too small is refused, not overrun */
  d.dtype = FERRY_DTYPE_BF16;
  assert_int_equal(cli_npy_header(&d, head, sizeof head, &hlen), FERRY_EDTYPE);
  d.dtype = FERRY_DTYPE_F32;
  assert_int_equal(cli_npy_header(&d, head, 100, &hlen), FERRY_ERANGE);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_valid),
      cmocka_unit_test(test_shape_vs_data),
      cmocka_unit_test(test_bad_preamble),
      cmocka_unit_test(test_bad_header),
      cmocka_unit_test(test_header_round_trip),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, NULL, NULL);
}
