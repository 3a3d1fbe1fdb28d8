/*
 * Core services: status table, error details, config table, dtypes and overflow-safe sizes,
 * checksums, the log's lines on stderr (text and JSON, the node's name from a context), the
 * options-struct rule and the growable array.
 */
// ferry-test: threaded
#include "testutil.h"

#include "core/core.h"
#include "core/hash.h"
#include "core/pool.h"

#include <errno.h>
#include <jansson.h>
#include <netdb.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
  /* fr_timeout keeps its parse while the environment's string is the same one: it still
   * follows every change */
  setenv("FERRY_TIMEOUT_MS", "1234", 1);
  assert_int_equal(fr_timeout(-1), 1234);
  setenv("FERRY_TIMEOUT_MS", "4321", 1);
  assert_int_equal(fr_timeout(-1), 4321);
  assert_int_equal(fr_timeout(-1), 4321);
  unsetenv("FERRY_TIMEOUT_MS");
  assert_int_equal(fr_timeout(-1), 10000);
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

/* A call site's limit: FR_LOG_LIMIT_LINES lines per window, the rest held back and counted on
 * the first line of a later window. The clock is the caller's, so no test waits for it. */
static void test_log_limit(void **state) {
  fr_log_limit l = {0};
  uint64_t held = 99, t = 5000000000ull, window = FR_LOG_LIMIT_WINDOW_MS * 1000000ull;
  for (int i = 0; i < FR_LOG_LIMIT_LINES; i++) {
    assert_true(fr_log_limit_pass(&l, t + (uint64_t)i, &held));
    assert_int_equal(held, 0);
  }
  for (int i = 0; i < 7; i++)
    assert_false(fr_log_limit_pass(&l, t + window - 1, &held));
  assert_true(fr_log_limit_pass(&l, t + window, &held));
  assert_int_equal(held, 7);
  assert_true(fr_log_limit_pass(&l, t + window + 1, &held));
  assert_int_equal(held, 0);
}

static int limited_calls;
static char limited_last[256];
static void count_limited(ferry_log_level level, const char *msg, void *arg) {
  (void)level;
  (void)arg;
  if (strstr(msg, "stall ")) {
    limited_calls++;
    snprintf(limited_last, sizeof limited_last, "%s", msg);
  }
}

/* Through the macro: one call site lets its few lines out; another call site has its own. */
static void test_log_limited_macro(void **state) {
  ferry_log_level old = ferry_log_get_level();
  ferry_log_set_callback(count_limited, NULL);
  ferry_log_set_level(FERRY_LOG_INFO);
  for (int i = 0; i < 3 * FR_LOG_LIMIT_LINES; i++)
    fr_warn_limited("stall %d", i);
  assert_int_equal(limited_calls, FR_LOG_LIMIT_LINES);
  assert_string_equal(limited_last, "stall 4");
  fr_info_limited("stall %s", "elsewhere");
  assert_int_equal(limited_calls, FR_LOG_LIMIT_LINES + 1);
  ferry_log_set_level(FERRY_LOG_ERROR); /* below the level: not even counted */
  fr_info_limited("stall %s", "quiet");
  assert_int_equal(limited_calls, FR_LOG_LIMIT_LINES + 1);
  ferry_log_set_callback(NULL, NULL);
  ferry_log_set_level(old);
}

/* ---- log lines on stderr ---- */

/* Sets FERRY_LOG=info and FERRY_LOG_FORMAT (NULL: unset) and rereads them. */
static void log_env(const char *format) {
  setenv("FERRY_LOG", "info", 1);
  if (format)
    setenv("FERRY_LOG_FORMAT", format, 1);
  else
    unsetenv("FERRY_LOG_FORMAT");
  fr_log_configure();
}

static void log_env_reset(void) {
  unsetenv("FERRY_LOG");
  unsetenv("FERRY_LOG_FORMAT");
  fr_log_configure();
  fr_log_set_node(NULL);
}

/* What the log writes to stderr while `emit` runs, with stderr on a temporary file. */
static char *capture_stderr(void (*emit)(void)) {
  fflush(stderr);
  FILE *tmp = tmpfile();
  assert_non_null(tmp);
  int saved = dup(STDERR_FILENO);
  assert_true(saved >= 0);
  assert_true(dup2(fileno(tmp), STDERR_FILENO) >= 0);
  emit();
  assert_true(dup2(saved, STDERR_FILENO) >= 0);
  close(saved);
  off_t n = lseek(fileno(tmp), 0, SEEK_END);
  assert_true(n >= 0);
  char *out = calloc(1, (size_t)n + 1);
  assert_non_null(out);
  assert_int_equal(pread(fileno(tmp), out, (size_t)n, 0), n);
  fclose(tmp);
  return out;
}

static void assert_matches(const char *text, const char *pattern) {
  regex_t re;
  assert_int_equal(regcomp(&re, pattern, REG_EXTENDED | REG_NOSUB), 0);
  int rc = regexec(&re, text, 0, NULL, 0);
  regfree(&re);
  if (rc != 0)
    fail_msg("'%s' does not match /%s/", text, pattern);
}

#define TS_RE "[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{6}Z"
/* quotes, a backslash, a newline, 0x01, a well-formed "é" and a stray 0xff */
#define NASTY "say \"hi\" \\ back\nnext\x01 caf\xc3\xa9 \xff end"

static void emit_hello(void) { fr_info("hello %d", 42); }
static void emit_nasty(void) { fr_info("%s", NASTY); }
/* a forged line with a colour, a bell and an 8-bit CSI (U+009B, UTF-8 C2 9B), as a peer's name */
static void emit_forged(void) {
  fr_warn("refusing link from '%s'", "x\n2026-01-01T00:00:00.000000Z ferry[1] FORGED \x1b[31m\x07"
                                     "\xc2\x9b"
                                     "2J");
}
static void emit_reconfigure(void) {
  fr_log_configure();
  fr_info("hello %d", 42);
}

/* A text line: time, pid, node, level, source, message. */
static void assert_text_line(const char *line, const char *node) {
  char pattern[256];
  snprintf(pattern, sizeof pattern,
           "^" TS_RE " ferry\\[%d\\] node=%s info core_test\\.c:[0-9]+: hello 42\n$", (int)getpid(),
           node);
  assert_matches(line, pattern);
}

static void test_log_text(void **state) {
  log_env(NULL);
  fr_log_set_node(NULL);
  char *out = capture_stderr(emit_hello);
  assert_text_line(out, "-");
  free(out);
  /* the first name stays until it is cleared */
  assert_true(fr_log_set_node("trainer-0"));
  assert_false(fr_log_set_node("other"));
  out = capture_stderr(emit_hello);
  assert_text_line(out, "trainer-0");
  free(out);
  /* a context names the lines while it is open, unless another name was there first */
  ferry_ctx_opts opts = {.size = sizeof opts, .name = "ctx-node", .transports = "tcp"};
  ferry_ctx *ctx = NULL;
  FR_OK(ferry_ctx_open(&opts, &ctx));
  out = capture_stderr(emit_hello);
  assert_text_line(out, "trainer-0");
  free(out);
  ferry_ctx_close(ctx);
  fr_log_set_node(NULL);
  FR_OK(ferry_ctx_open(&opts, &ctx));
  out = capture_stderr(emit_hello);
  assert_text_line(out, "ctx-node");
  free(out);
  ferry_ctx_close(ctx);
  out = capture_stderr(emit_hello);
  assert_text_line(out, "-");
  free(out);
  /* a format that is neither text nor json: text, and one warning however often it is read */
  setenv("FERRY_LOG_FORMAT", "yaml", 1);
  out = capture_stderr(emit_reconfigure);
  assert_non_null(strstr(out, "FERRY_LOG_FORMAT=yaml"));
  assert_text_line(strchr(out, '\n') + 1, "-");
  free(out);
  out = capture_stderr(emit_reconfigure);
  assert_text_line(out, "-");
  free(out);
  unsetenv("FERRY_LOG_FORMAT");
  fr_log_configure();
  /* what a peer sent is escaped: one line, no byte a terminal would obey */
  out = capture_stderr(emit_nasty);
  assert_non_null(strstr(out, "say \"hi\" \\ back\\x0anext\\x01 caf\xc3\xa9 \\xff end\n"));
  assert_string_equal(strchr(out, '\n'), "\n");
  free(out);
  out = capture_stderr(emit_forged);
  assert_string_equal(strchr(out, '\n'), "\n");
  assert_null(strchr(out, '\x1b'));
  assert_null(strchr(out, '\x07'));
  assert_null(strstr(out, "\xc2\x9b"));
  assert_non_null(strstr(out, "'x\\x0a2026-01-01T00:00:00.000000Z ferry[1] FORGED \\x1b[31m\\x07"
                              "\\xc2\\x9b2J'\n"));
  free(out);
  log_env_reset();
}

static char callback_msg[256];
static void keep_log(ferry_log_level level, const char *msg, void *arg) {
  snprintf(callback_msg, sizeof callback_msg, "%s", msg);
}

static void test_log_json(void **state) {
  log_env("json");
  assert_true(fr_log_set_node("trainer-\"0\""));
  char *out = capture_stderr(emit_nasty);
  /* one line: the newline in the message is escaped */
  char *nl = strchr(out, '\n');
  assert_non_null(nl);
  assert_string_equal(nl, "\n");
  assert_non_null(strstr(out, "\\n"));
  assert_non_null(strstr(out, "\\u0001"));
  assert_non_null(strstr(out, "\\u00ff"));
  assert_non_null(strstr(out, "caf\xc3\xa9")); /* well-formed UTF-8 as it is */
  json_error_t err;
  json_t *j = json_loads(out, 0, &err);
  if (!j)
    fail_msg("not JSON (%s): %s", err.text, out);
  assert_int_equal(json_object_size(j), 6);
  assert_matches(json_string_value(json_object_get(j, "ts")), "^" TS_RE "$");
  assert_string_equal(json_string_value(json_object_get(j, "level")), "info");
  assert_int_equal(json_integer_value(json_object_get(j, "pid")), getpid());
  assert_string_equal(json_string_value(json_object_get(j, "node")), "trainer-\"0\"");
  assert_matches(json_string_value(json_object_get(j, "src")), "^core_test\\.c:[0-9]+$");
  /* the stray byte reads as U+00FF; every other byte comes back as it was */
  assert_string_equal(json_string_value(json_object_get(j, "msg")),
                      "say \"hi\" \\ back\nnext\x01 caf\xc3\xa9 \xc3\xbf end");
  json_decref(j);
  free(out);
  /* C1 control characters are escaped as well: U+009B is an 8-bit CSI */
  out = capture_stderr(emit_forged);
  assert_non_null(strstr(out, "\\n2026"));
  assert_non_null(strstr(out, "\\u001b[31m\\u0007\\u009b2J"));
  assert_null(strstr(out, "\xc2\x9b"));
  j = json_loads(out, 0, &err);
  if (!j)
    fail_msg("not JSON (%s): %s", err.text, out);
  json_decref(j);
  free(out);
  /* a callback still gets the bare message, and stderr nothing; what a peer sent is escaped */
  ferry_log_set_callback(keep_log, NULL);
  out = capture_stderr(emit_hello);
  assert_string_equal(out, "");
  assert_string_equal(callback_msg, "hello 42");
  free(out);
  out = capture_stderr(emit_forged);
  ferry_log_set_callback(NULL, NULL);
  assert_string_equal(out, "");
  assert_null(strchr(callback_msg, '\x1b'));
  assert_null(strchr(callback_msg, '\n'));
  assert_non_null(strstr(callback_msg, "\\x1b[31m"));
  free(out);
  log_env_reset();
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

/* The one pool allocator (store and mq): first fit, granules, a limit, coalescing frees. */
static void test_pool(void **state) {
  (void)state;
  fr_pool p;
  assert_int_equal(fr_pool_init(&p, 1000, 64), 0);
  assert_int_equal(p.capacity, 960); /* rounded down to the granule */
  uint64_t a, b, c, d;
  assert_int_equal(fr_pool_alloc(&p, 1, p.capacity, &a), 0);
  assert_int_equal(fr_pool_alloc(&p, 65, p.capacity, &b), 0);
  assert_int_equal(fr_pool_alloc(&p, 0, p.capacity, &c), 0); /* 0 takes a granule too */
  assert_int_equal(a, 0);
  assert_int_equal(b, 64);
  assert_int_equal(c, 192);
  assert_int_equal(p.used, 256);
  assert_int_equal(fr_pool_alloc(&p, 961, p.capacity, &d), FERRY_ECAPACITY);
  assert_int_equal(fr_pool_alloc(&p, UINT64_MAX, p.capacity, &d), FERRY_ECAPACITY);
  assert_int_equal(fr_pool_alloc(&p, 64, 256, &d), FERRY_ECAPACITY); /* would end past 256 */
  assert_int_equal(fr_pool_largest(&p), 704);
  fr_pool_free(&p, b, 65); /* a hole at 64..192: first fit takes it */
  assert_int_equal(p.nfree, 2);
  assert_int_equal(fr_pool_alloc(&p, 64, 256, &d), 0);
  assert_int_equal(d, 64);
  fr_pool_free(&p, a, 1);
  fr_pool_free(&p, c, 0);
  fr_pool_free(&p, d, 64); /* between two free extents: all one again */
  assert_int_equal(p.nfree, 1);
  assert_int_equal(p.used, 0);
  assert_int_equal(fr_pool_largest(&p), 960);
  fr_pool_fini(&p);
  assert_int_equal(fr_pool_init(&p, 40 * 64, 64), 0);
  for (uint64_t i = 0; i < 40; i++)
    assert_int_equal(fr_pool_alloc(&p, 64, p.capacity, &a), 0);
  for (uint64_t off = 0; off < 40 * 64; off += 128) /* every other granule: the list grows */
    fr_pool_free(&p, off, 64);
  assert_int_equal(p.nfree, 20);
  assert_int_equal(fr_pool_largest(&p), 64);
  for (uint64_t off = 64; off < 40 * 64; off += 128)
    fr_pool_free(&p, off, 64);
  assert_int_equal(p.nfree, 1);
  fr_pool_fini(&p);
  fr_pool_fini(&p); /* a zeroed pool too */
}

/* The options-struct rule, on a struct this "library" knows at its second version. */
typedef struct opts_v1 { /* what an older caller (or a thinner binding) declares */
  size_t size;
  int a;
} opts_v1;
typedef struct opts_v2 { /* what the library knows */
  size_t size;
  int a;
  const char *b;
  uint64_t c;
} opts_v2;
typedef struct opts_v3 { /* what a newer caller declares */
  opts_v2 v2;
  int d;
} opts_v3;

static int opt_a(const opts_v2 *o) { return FR_OPT(o, a, 7); }
static const char *opt_b(const opts_v2 *o) { return FR_OPT(o, b, "dflt"); }
static uint64_t opt_c(const opts_v2 *o) { return FR_OPT(o, c, 9); }

static void test_opts_rule(void **state) {
  /* NULL: every default, and nothing to refuse */
  assert_int_equal(FR_OPTS_CHECK((const opts_v2 *)NULL, "t"), 0);
  assert_int_equal(opt_a(NULL), 7);
  assert_string_equal(opt_b(NULL), "dflt");
  assert_true(opt_c(NULL) == 9);
  /* the whole struct: every field as given */
  opts_v2 full = {.size = sizeof full, .a = 1, .b = "given", .c = 3};
  assert_int_equal(FR_OPTS_CHECK(&full, "t"), 0);
  assert_int_equal(opt_a(&full), 1);
  assert_string_equal(opt_b(&full), "given");
  assert_true(opt_c(&full) == 3);
  /* an older caller: its fields as given, the ones it does not know defaulted, whatever lies in
   * memory after its struct */
  union {
    opts_v1 v1;
    unsigned char raw[sizeof(opts_v2)];
  } old;
  memset(&old, 0xab, sizeof old);
  old.v1 = (opts_v1){.size = sizeof old.v1, .a = 2};
  const opts_v2 *as_v2 = (const opts_v2 *)(const void *)&old;
  assert_int_equal(FR_OPTS_CHECK(as_v2, "t"), 0);
  assert_int_equal(opt_a(as_v2), 2);
  assert_string_equal(opt_b(as_v2), "dflt");
  assert_true(opt_c(as_v2) == 9);
  /* a size that was never set, or garbage: refused, naming the call */
  opts_v2 unset = {.a = 1};
  assert_int_equal(FR_OPTS_CHECK(&unset, "ferry_thing_open"), FERRY_EINVAL);
  assert_non_null(strstr(ferry_last_error(), "ferry_thing_open: opts->size is 0"));
  unset.size = sizeof(size_t) - 1;
  assert_int_equal(FR_OPTS_CHECK(&unset, "t"), FERRY_EINVAL);
  unset.size = (size_t)FR_OPTS_MAX + 1;
  assert_int_equal(FR_OPTS_CHECK(&unset, "t"), FERRY_EINVAL);
  /* a newer caller: fine while what it adds is zero, refused once it sets a field we lack */
  opts_v3 newer = {.v2 = {.size = sizeof newer, .a = 4}};
  assert_int_equal(FR_OPTS_CHECK(&newer.v2, "t"), 0);
  assert_int_equal(opt_a(&newer.v2), 4);
  newer.d = 1;
  assert_int_equal(FR_OPTS_CHECK(&newer.v2, "t"), FERRY_ENOTSUP);
  char want[64];
  snprintf(want, sizeof want, "beyond the %zu bytes", sizeof(opts_v2));
  assert_non_null(strstr(ferry_last_error(), want));
}

static void test_grow(void **state) {
  uint32_t *v = NULL;
  size_t cap = 0;
  assert_int_equal(FR_GROW(v, cap, 0, 4), 0); /* nothing needed: nothing allocated */
  assert_null(v);
  assert_int_equal(cap, 0);
  assert_int_equal(FR_GROW(v, cap, 1, 4), 0); /* the first allocation is `first` */
  assert_non_null(v);
  assert_int_equal(cap, 4);
  for (uint32_t i = 0; i < 4; i++)
    v[i] = i;
  uint32_t *before = v;
  assert_int_equal(FR_GROW(v, cap, 4, 4), 0); /* it fits: no realloc */
  assert_ptr_equal(v, before);
  assert_int_equal(FR_GROW(v, cap, 5, 4), 0); /* doubles */
  assert_int_equal(cap, 8);
  assert_int_equal(FR_GROW(v, cap, 100, 4), 0); /* doubles until it covers need */
  assert_int_equal(cap, 128);
  for (uint32_t i = 0; i < 4; i++)
    assert_int_equal(v[i], i); /* contents kept */
  v[99] = 99;
  /* overflow: refused, with the array and its capacity as they were */
  before = v;
  assert_int_equal(FR_GROW(v, cap, SIZE_MAX, 4), FERRY_ENOMEM); /* the count doubling overflows */
  assert_ptr_equal(v, before);
  assert_int_equal(cap, 128);
  assert_int_equal(FR_GROW(v, cap, SIZE_MAX / 4 + 1, 4), FERRY_ENOMEM); /* the bytes overflow */
  assert_ptr_equal(v, before);
  assert_int_equal(cap, 128);
  assert_int_equal(v[99], 99);
  free(v);
  /* the untyped form, from a capacity given with first == 0 */
  void *bytes = NULL;
  size_t bcap = 0;
  assert_int_equal(fr_grow(&bytes, &bcap, 3, 1, 0), 0);
  assert_int_equal(bcap, 4);
  free(bytes);
}

/* fr_str_copy is snprintf(dst, cap, "%s", src): cut to cap - 1, always terminated, the source's
 * length returned; NULL copies as "". */
static void test_str_copy(void **state) {
  (void)state;
  char buf[6];
  assert_int_equal(fr_str_copy(buf, sizeof buf, "abc"), 3);
  assert_string_equal(buf, "abc");
  assert_int_equal(fr_str_copy(buf, sizeof buf, "abcdefgh"), 8); /* cut: the result >= cap */
  assert_string_equal(buf, "abcde");
  assert_int_equal(fr_str_copy(buf, sizeof buf, "abcde"), 5); /* exactly fits */
  assert_string_equal(buf, "abcde");
  assert_int_equal(fr_str_copy(buf, sizeof buf, NULL), 0);
  assert_string_equal(buf, "");
  buf[0] = 'x';
  assert_int_equal(fr_str_copy(buf, 0, "abc"), 3); /* no room: nothing written */
  assert_int_equal(buf[0], 'x');
}

/* Whether every byte of s is part of a printable character: nothing a terminal would obey. */
static bool all_printable(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  for (size_t left = strlen(s), n; left > 0; p += n, left -= n)
    if ((n = fr_text_char(p, left)) == 0)
      return false;
  return true;
}

/* The one name rule (fr_name_check): printable UTF-8 only, each caller's length limit. */
static void test_name_rule(void **state) {
  (void)state;
  static const char *const good[] = {
      "a",
      "rollout-3",
      "ckpt/step 7",
      "caf\xc3\xa9",
      "\xc2\xa0nbsp", /* U+00A0: past C1 */
      "\xe6\x97\xa5\xe6\x9c\xac",
      "rocket\xf0\x9f\x9a\x80",
      "\xf4\x8f\xbf\xbf", /* U+10FFFF */
      "\xef\xbf\xbd",
  };
  static const char *const bad[] = {
      "",
      "a\nb",
      "\x1b[31m",
      "bell\x07",
      "tab\t",
      "del\x7f",
      "\xc2\x80",
      "c1\xc2\x9b",
      "\xc2\x9f",
      "\xff",
      "\xfe",
      "\x80",
      "\xc0\xaf",
      "\xc1\xbf",
      "\xe0\x80\xaf",
      "\xf0\x80\x80\xaf",
      "\xed\xa0\x80",
      "\xed\xbf\xbf",
      "\xf4\x90\x80\x80",
      "\xf5\x80\x80\x80",
      "cut\xe6\x97",
      "cut\xc2",
      "cut\xf0\x9f\x9a",
  };
  for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
    assert_true(fr_name_ok(good[i], 64));
    if (fr_name_check("name", good[i], 64) != 0)
      fail_msg("good name %zu refused: %s", i, ferry_last_error());
  }
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    assert_false(fr_name_ok(bad[i], 64));
    assert_int_equal(fr_name_check("name", bad[i], 64), FERRY_EINVAL);
    if (!all_printable(ferry_last_error()))
      fail_msg("bad name %zu: the detail is not escaped", i);
  }
  assert_false(fr_name_ok(NULL, 64));
  assert_int_equal(fr_name_check("name", NULL, 64), FERRY_EINVAL);
  char longest[65];
  memset(longest, 'k', 64);
  longest[64] = '\0';
  assert_true(fr_name_ok(longest, 64)); /* each caller's limit */
  assert_false(fr_name_ok(longest, 63));
  assert_int_equal(fr_name_check("store name", longest, 63), FERRY_EINVAL);
  assert_string_equal(ferry_last_error(), "store name of 64 bytes (at most 63)");
  assert_int_equal(fr_name_check("node name", "x\n2026 FORGED \x1b[31mred\x07", 63), FERRY_EINVAL);
  assert_string_equal(ferry_last_error(), "node name 'x\\x0a2026 FORGED \\x1b[31mred\\x07' has a "
                                          "control character at byte 1");
  assert_int_equal(fr_name_check("key", "ok\xed\xa0\x80", 63), FERRY_EINVAL);
  assert_string_equal(ferry_last_error(), "key 'ok\\xed\\xa0\\x80' has bytes that are not UTF-8 at "
                                          "byte 2");
}

/* fr_escape: what is not printable becomes \xNN, nothing else changes, it cuts between whole
 * characters and escapes, and escaping twice changes nothing. */
static void test_escape(void **state) {
  (void)state;
  char out[128], again[128];
  fr_escape(out, sizeof out,
            "ok caf\xc3\xa9 \x1b[2J\x07\n\x7f c1\xc2\x9b bad\xff\xed\xa0\x80 \\x1b");
  assert_string_equal(out, "ok caf\xc3\xa9 \\x1b[2J\\x07\\x0a\\x7f c1\\xc2\\x9b "
                           "bad\\xff\\xed\\xa0\\x80 \\x1b");
  assert_true(all_printable(out));
  fr_escape(again, sizeof again, out);
  assert_string_equal(again, out);
  assert_int_equal(fr_escape(out, 4, "\x1b"), 0); /* no room for a whole escape: nothing */
  assert_string_equal(out, "");
  assert_int_equal(fr_escape(out, 5, "\x1b\x1b"), 4);
  assert_string_equal(out, "\\x1b");
  assert_int_equal(fr_escape(out, 3, "a\xc3\xa9"), 1); /* a character is never cut */
  assert_string_equal(out, "a");
  assert_int_equal(fr_escape(out, sizeof out, NULL), 0);
  assert_string_equal(out, "");
  /* a key an older peer (or Redis) holds, as `ferry ls` and `ferry stat` print it */
  char key[4 * 255 + 1], hostile[256];
  memset(hostile, 0x9b, 255);
  hostile[255] = '\0';
  assert_int_equal(fr_escape(key, sizeof key, hostile), 4 * 255);
  assert_true(all_printable(key));
}

/* An error detail quotes names as they came, escaped; a detail formatted from the detail itself
 * (the pattern err_self_format.py keeps out of src/) is not garbled; fr_err_wrap says what. */
static void test_error_detail_escaped(void **state) {
  (void)state;
  assert_int_equal(fr_err(FERRY_EINVAL, "store 'esc\x1b]0;x\x07': bad"), FERRY_EINVAL);
  assert_string_equal(ferry_last_error(), "store 'esc\\x1b]0;x\\x07': bad");
  fr_err(FERRY_EINVAL, "inner \x1b");
  fr_err(FERRY_EINVAL, "outer: %s", ferry_last_error());
  assert_string_equal(ferry_last_error(), "outer: inner \\x1b");
  fr_err(FERRY_EINVAL, "inner");
  fr_err_wrap(FERRY_EPROTO, "who '%s'", "a\x9b");
  assert_string_equal(ferry_last_error(), "who 'a\\x9b': inner");
  errno = ENOENT;
  fr_err_errno(FERRY_ESYS, "open '%s'", "f\x1b");
  assert_string_equal(ferry_last_error(), "open 'f\\x1b': No such file or directory");
}

/* A kept failure comes back as it was after cleanup that set the detail again (or cleared it);
 * the detail, escaped once, is not escaped twice. */
static void test_error_keep(void **state) {
  (void)state;
  fr_err(FERRY_EINVAL, "open 'a\x1b': bad");
  fr_err_keep keep;
  fr_err_save(&keep, FERRY_EINVAL);
  assert_string_equal(keep.detail, "open 'a\\x1b': bad");
  fr_err(FERRY_ECLOSED, "closing");
  fr_err_clear();
  assert_int_equal(fr_err_restore(&keep), FERRY_EINVAL);
  assert_string_equal(ferry_last_error(), "open 'a\\x1b': bad");
  fr_err_clear();
  fr_err_save(&keep, 0); /* no detail: restoring clears what cleanup set */
  fr_err(FERRY_ECLOSED, "closing");
  assert_int_equal(fr_err_restore(&keep), 0);
  assert_string_equal(ferry_last_error(), "");
}

/* The spin helper keeps its window: no pause says go on past `end`, a spent window says stop at
 * once. FERRY_SPIN_YIELD_NS=0 (read at the process's first spin): every pause yields, as spinners
 * did before the gap, and reports how long the yield took. */
static void test_spin(void **state) {
  (void)state;
  setenv("FERRY_SPIN_YIELD_NS", "0", 1);
  fr_spin s;
  fr_spin_begin(&s, 0);
  assert_false(fr_spin_pause(&s)); /* a spent window: no pause, no yield */
  assert_int_equal(s.yield_ns, 0);
  fr_spin_begin(&s, 50000000); /* 50 ms: room for a preemption on a loaded machine */
  assert_true(fr_spin_pause(&s));
  assert_true(s.yield_ns > 0); /* a gap of 0: the first pause yields */
  uint64_t pauses = 1;
  while (fr_spin_pause(&s))
    pauses++;
  assert_true(pauses > 1);
  assert_true(fr_now_ns() >= s.end);
  s.end = fr_now_ns() + 1000000000; /* a waiter may lengthen its window */
  assert_true(fr_spin_pause(&s));
  unsetenv("FERRY_SPIN_YIELD_NS");
}

/* A name is resolved by the caller's deadline even when the name service never answers; a
 * numeric address never waits for it; an answer that comes in time is the caller's. */
static int answer_loopback(const char *host, const char *service, const struct addrinfo *hints,
                           struct addrinfo **out) {
  (void)host;
  return getaddrinfo("127.0.0.1", service, hints, out);
}

static void test_resolve_deadline(void **state) {
  (void)state;
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
  tu_dns_hang();
  assert_int_equal(fr_resolve("ferry-test.invalid", "80", &hints, fr_deadline_ns(100), &ai),
                   FR_RESOLVE_TIMEDOUT);
  assert_null(ai);
  assert_non_null(strstr(fr_resolve_strerror(FR_RESOLVE_TIMEDOUT), "deadline"));
  assert_int_equal(fr_resolve("127.0.0.1", "80", &hints, fr_deadline_ns(100), &ai), 0);
  assert_non_null(ai);
  freeaddrinfo(ai);
  assert_int_equal(tu_dns_answer(), 1); /* the name waited; the number did not */

  fr_resolve_set_lookup(answer_loopback);
  ai = NULL;
  assert_int_equal(fr_resolve("ferry-test.invalid", "80", &hints, fr_deadline_ns(10000), &ai), 0);
  assert_non_null(ai);
  assert_int_equal(ai->ai_family, AF_INET);
  freeaddrinfo(ai);
  ai = NULL;
  assert_int_equal(fr_resolve("ferry-test.invalid", "80", &hints, 0, &ai), 0); /* no deadline */
  assert_non_null(ai);
  freeaddrinfo(ai);
  fr_resolve_set_lookup(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_status_strings), cmocka_unit_test(test_error_detail),
      cmocka_unit_test(test_config),         cmocka_unit_test(test_dtypes),
      cmocka_unit_test(test_tensor_sizes),   cmocka_unit_test(test_shape_parse),
      cmocka_unit_test(test_checksum),       cmocka_unit_test(test_logging),
      cmocka_unit_test(test_log_limit),      cmocka_unit_test(test_log_limited_macro),
      cmocka_unit_test(test_sha256_hmac),    cmocka_unit_test(test_hash_builds_agree),
      cmocka_unit_test(test_log_text),       cmocka_unit_test(test_log_json),
      cmocka_unit_test(test_opts_rule),      cmocka_unit_test(test_grow),
      cmocka_unit_test(test_pool),           cmocka_unit_test(test_spin),
      cmocka_unit_test(test_str_copy),       cmocka_unit_test(test_name_rule),
      cmocka_unit_test(test_escape),         cmocka_unit_test(test_error_detail_escaped),
      cmocka_unit_test(test_error_keep),     cmocka_unit_test(test_resolve_deadline),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, NULL, NULL);
}
