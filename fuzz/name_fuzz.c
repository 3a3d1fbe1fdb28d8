/*
 * libFuzzer target for hostile names (issue 32 row 5, deliverable 2): the input is fed as a
 * peer's hello and hello ack (the node name in them), as directory records and nodes (keys and
 * owner names), as an mq topic and as a bare name to the one name rule (core.h fr_name_check),
 * to the escape every log line, error detail and `ferry ls`/`stat` line goes through (fr_escape),
 * and to a log line through a callback. The checks are written here once more, independently of
 * core's: whatever a decoder accepts and whatever the escape writes holds no C0, DEL or C1 byte
 * and is well-formed UTF-8; a name the rule accepts escapes to itself; escaping is idempotent.
 */
#include "core/core.h"
#include "directory/dirwire.h"
#include "mq/mq.h"
#include "transport/wire.h"

#include <assert.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* Printable, well-formed UTF-8 (RFC 3629: no overlong forms, no surrogates, at most U+10FFFF),
 * without C0, DEL or C1: checked byte by byte, not through core's helpers. */
static bool clean(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  while (*p) {
    unsigned c = p[0];
    if (c < 0x20 || c == 0x7f)
      return false;
    if (c < 0x80) {
      p++;
      continue;
    }
    unsigned n, cp;
    if (c >= 0xc2 && c <= 0xdf)
      n = 2, cp = c & 0x1f;
    else if (c >= 0xe0 && c <= 0xef)
      n = 3, cp = c & 0x0f;
    else if (c >= 0xf0 && c <= 0xf4)
      n = 4, cp = c & 0x07;
    else
      return false;
    for (unsigned i = 1; i < n; i++) {
      if ((p[i] & 0xc0) != 0x80)
        return false; /* also stops at the NUL */
      cp = cp << 6 | (p[i] & 0x3f);
    }
    if ((n == 2 && cp < 0xa0) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) ||
        cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
      return false; /* C1 (U+0080..U+009F), overlong, beyond Unicode, a surrogate */
    p += n;
  }
  return true;
}

static char logged[8192];
static void keep_log(ferry_log_level level, const char *msg, void *arg) {
  (void)level, (void)arg;
  fr_str_copy(logged, sizeof logged, msg);
}

/* s escaped: clean, idempotent, and s itself when the rule takes s. */
static void check_escape(const char *s) {
  size_t len = strlen(s);
  char *out = malloc(4 * len + 1), *again = malloc(4 * len + 1);
  assert(out && again);
  assert(fr_escape(out, 4 * len + 1, s) == strlen(out));
  assert(clean(out));
  fr_escape(again, 4 * len + 1, out);
  assert(strcmp(again, out) == 0);
  if (fr_name_ok(s, SIZE_MAX))
    assert(strcmp(out, s) == 0);
  char small[16]; /* cut short: still clean, never half a character or half an escape */
  fr_escape(small, sizeof small, s);
  assert(clean(small) && strncmp(small, out, strlen(small)) == 0);
  free(out);
  free(again);
}

static void check_rule(const char *s) {
  bool ok = fr_name_ok(s, FR_DIR_KEY_MAX);
  assert(ok == (*s && strlen(s) <= FR_DIR_KEY_MAX && clean(s)));
  assert((fr_name_check("name", s, FR_DIR_KEY_MAX) == 0) == ok);
  if (!ok)
    assert(clean(ferry_last_error())); /* the detail quotes the name, escaped */
  assert((fr_mq_topic_check(s) == 0) == fr_name_ok(s, FERRY_MQ_TOPIC_MAX));
  fr_warn("refusing link from '%s'", s);
  assert(clean(logged));
}

static void check_hello(const uint8_t *data, size_t size) {
  uint8_t buf[FR_HELLO_ACK_BYTES];
  memset(buf, 0, sizeof buf);
  memcpy(buf, data, size < sizeof buf ? size : sizeof buf);
  fr_hello h;
  if (fr_hello_decode(buf, FR_HELLO_BYTES, &h) == 0)
    assert(*h.name && clean(h.name));
  else
    assert(clean(ferry_last_error()));
  fr_hello_ack a;
  if (fr_hello_ack_decode(buf, FR_HELLO_ACK_BYTES, &a) == 0)
    assert(*a.name && clean(a.name));
}

static void check_directory(const uint8_t *data, size_t size) {
  fr_rd r = fr_rd_init(data, size);
  fr_dir_object o;
  while (fr_rd_object(&r, &o))
    assert(clean(o.key) && clean(o.owner));
  r = fr_rd_init(data, size);
  fr_dir_node n;
  while (fr_rd_node(&r, &n))
    assert(*n.name && clean(n.name));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static bool once;
  if (!once) {
    once = true;
    ferry_log_set_callback(keep_log, NULL);
    ferry_log_set_level(FERRY_LOG_WARN);
  }
  char *s = malloc(size + 1);
  assert(s);
  memcpy(s, data, size);
  s[size] = '\0'; /* the input as a string, up to its first NUL */
  check_escape(s);
  check_rule(s);
  free(s);
  check_hello(data, size);
  check_directory(data, size);
  return 0;
}
