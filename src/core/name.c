/*
 * The one rule for a name a peer or a caller gives (node, context, store, sender, topic and cell
 * names, and keys), and the one escape for text that reaches a log line, an error detail or a
 * terminal. A name is well-formed UTF-8 without a control character: no C0 (0x00-0x1f), no DEL
 * (0x7f) and no C1 (U+0080..U+009F, which UTF-8 spells C2 80..C2 9F: U+009B is an 8-bit CSI that
 * some terminals obey). Each caller keeps its own length limit. Text that breaks the rule anyway
 * (an older peer's key, a message that quotes what a peer sent) is escaped byte by byte as \xNN,
 * so that no byte of it can move a cursor, recolour a terminal or forge a log line.
 */
#include "core/core.h"

#include <string.h>

size_t fr_text_char(const unsigned char *p, size_t left) {
  if (left == 0 || *p < 0x20 || *p == 0x7f)
    return 0;
  if (*p < 0x80)
    return 1;
  if (p[0] == 0xc2 && left > 1 && p[1] >= 0x80 && p[1] <= 0x9f)
    return 0; /* C1 */
  return fr_utf8_seq(p, left);
}

/* The offset of the first byte of s (len bytes) that breaks the rule, and whether it is a
 * control character (else not UTF-8); len when none does. */
static size_t first_bad(const char *s, size_t len, bool *control) {
  const unsigned char *p = (const unsigned char *)s;
  for (size_t at = 0; at < len;) {
    size_t n = fr_text_char(p + at, len - at);
    if (n == 0) {
      *control = p[at] < 0x20 || p[at] == 0x7f ||
                 (p[at] == 0xc2 && at + 1 < len && p[at + 1] >= 0x80 && p[at + 1] <= 0x9f);
      return at;
    }
    at += n;
  }
  return len;
}

bool fr_name_ok(const char *s, size_t max) {
  bool control;
  size_t len = s ? strlen(s) : 0;
  return len > 0 && len <= max && first_bad(s, len, &control) == len;
}

int fr_name_check(const char *what, const char *s, size_t max) {
  size_t len = s ? strlen(s) : 0;
  if (len == 0)
    return fr_err(FERRY_EINVAL, "%s: empty", what);
  bool control = false;
  size_t at = first_bad(s, len, &control);
  if (at < len)
    return fr_err(FERRY_EINVAL, "%s '%s' has %s at byte %zu", what, s,
                  control ? "a control character" : "bytes that are not UTF-8", at);
  if (len > max)
    return fr_err(FERRY_EINVAL, "%s of %zu bytes (at most %zu)", what, len, max);
  return 0;
}

size_t fr_escape(char *dst, size_t cap, const char *src) {
  static const char hex[] = "0123456789abcdef";
  const unsigned char *p = (const unsigned char *)(src ? src : "");
  size_t left = strlen((const char *)p), o = 0;
  if (cap == 0)
    return 0;
  while (left > 0) {
    size_t n = fr_text_char(p, left);
    if (n == 0) {
      if (o + 4 >= cap)
        break;
      dst[o++] = '\\', dst[o++] = 'x', dst[o++] = hex[*p >> 4], dst[o++] = hex[*p & 15];
      n = 1;
    } else {
      if (o + n >= cap)
        break;
      memcpy(dst + o, p, n);
      o += n;
    }
    p += n, left -= n;
  }
  dst[o] = '\0';
  return o;
}
