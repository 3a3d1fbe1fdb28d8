/*
 * The .npy reader and header writer (npy.h). The reader takes the whole file and accepts only
 * what it can store exactly as numpy would load it: the preamble (magic, version 1.0/2.0/3.0,
 * a 16- or 32-bit header length that must fit in the file), then a real parse of the header's
 * dict literal -- exactly the keys 'descr', 'fortran_order' and 'shape', each once, and nothing
 * but padding after it -- and finally shape x itemsize must equal the bytes that follow. It never
 * reads outside [buf, buf + len), so a lying header cannot make `ferry put` store memory past
 * the file's end or drop its tail.
 */
#include "cli/npy.h"
#include "core/core.h"

#include <stdio.h>
#include <string.h>

/* numpy's names (dtype.str) for the dtypes both sides know; one-byte types carry '|'. */
static const struct {
  const char *descr;
  ferry_dtype dtype;
} npy_types[] = {
    {"|b1", FERRY_DTYPE_BOOL}, {"|u1", FERRY_DTYPE_U8},  {"<u2", FERRY_DTYPE_U16},
    {"<u4", FERRY_DTYPE_U32},  {"<u8", FERRY_DTYPE_U64}, {"|i1", FERRY_DTYPE_I8},
    {"<i2", FERRY_DTYPE_I16},  {"<i4", FERRY_DTYPE_I32}, {"<i8", FERRY_DTYPE_I64},
    {"<f2", FERRY_DTYPE_F16},  {"<f4", FERRY_DTYPE_F32}, {"<f8", FERRY_DTYPE_F64},
};
#define N_TYPES (sizeof npy_types / sizeof npy_types[0])

bool cli_npy_magic(const uint8_t *buf, size_t len) {
  return len >= CLI_NPY_MAGIC_LEN && memcmp(buf, CLI_NPY_MAGIC, CLI_NPY_MAGIC_LEN) == 0;
}

/* ---- the header's dict literal ---- */

typedef struct lex {
  const char *p, *end;
  int major; /* the file's version: 1 and 2 may carry Python 2's "3L" dimensions */
} lex;

/* A printable excerpt of s[0..n) for an error message: at most 24 bytes, odd bytes as '?', so a
 * hostile header cannot break the one-line error or the terminal. */
static const char *excerpt(const char *s, size_t n, char *buf, size_t cap) {
  size_t max = cap - 4 < 24 ? cap - 4 : 24, i = 0;
  for (; i < n && i < max; i++)
    buf[i] = s[i] >= 0x20 && s[i] < 0x7f ? s[i] : '?';
  strcpy(buf + i, i < n ? "..." : "");
  return buf;
}

static bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
static bool is_word(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
         c == '.';
}

static void skip_space(lex *l) {
  while (l->p < l->end && is_space(*l->p))
    l->p++;
}

static bool eat(lex *l, char c) {
  skip_space(l);
  if (l->p < l->end && *l->p == c) {
    l->p++;
    return true;
  }
  return false;
}

/* "expected X at <what is there>" */
static int expected(lex *l, const char *what) {
  char ex[32];
  if (l->p >= l->end)
    return fr_err(FERRY_EPROTO, ".npy header: expected %s before the header's end", what);
  return fr_err(FERRY_EPROTO, ".npy header: expected %s at '%s'", what,
                excerpt(l->p, (size_t)(l->end - l->p), ex, sizeof ex));
}

/* A quoted string without escapes (no valid key or descr has one). */
static int string(lex *l, const char **s, size_t *n) {
  skip_space(l);
  if (l->p >= l->end || (*l->p != '\'' && *l->p != '"'))
    return expected(l, "a quoted string");
  char quote = *l->p++;
  const char *start = l->p;
  while (l->p < l->end && *l->p != quote) {
    if (*l->p == '\\' || *l->p == '\n')
      return expected(l, "a plain string (no escapes, one line)");
    l->p++;
  }
  if (l->p >= l->end)
    return fr_err(FERRY_EPROTO, ".npy header: a string runs to the header's end");
  *s = start;
  *n = (size_t)(l->p - start);
  l->p++;
  return 0;
}

static int descr(lex *l, ferry_dtype *out) {
  skip_space(l);
  if (l->p < l->end && (*l->p == '[' || *l->p == '{'))
    return fr_err(FERRY_EDTYPE, ".npy header: a structured 'descr'; ferry takes plain numeric "
                                "arrays");
  const char *s;
  size_t n;
  int rc = string(l, &s, &n);
  if (rc != 0)
    return rc;
  char ex[32];
  excerpt(s, n, ex, sizeof ex);
  for (size_t i = 0; n == 3 && i < N_TYPES; i++) {
    if (memcmp(s + 1, npy_types[i].descr + 1, 2) != 0)
      continue;
    /* byte order means nothing for one-byte types: numpy writes '|' but reads any */
    bool one = ferry_dtype_size(npy_types[i].dtype) == 1;
    if (s[0] == '<' || (one && s[0] && strchr("|>=", s[0]))) {
      *out = npy_types[i].dtype;
      return 0;
    }
    if (s[0] == '>')
      return fr_err(FERRY_EDTYPE,
                    ".npy header: dtype '%s' is big-endian; ferry stores little-endian "
                    "(save a.astype('<%c%c'))",
                    ex, s[1], s[2]);
  }
  return fr_err(FERRY_EDTYPE,
                ".npy header: dtype '%s' is not one ferry takes (little-endian bool, int8-64, "
                "uint8-64, float16/32/64)",
                ex);
}

static int boolean(lex *l, bool *out) {
  skip_space(l);
  size_t n = 0;
  while (l->p + n < l->end && is_word(l->p[n]))
    n++;
  if (n == 4 && memcmp(l->p, "True", 4) == 0)
    *out = true;
  else if (n == 5 && memcmp(l->p, "False", 5) == 0)
    *out = false;
  else
    return expected(l, "True or False for 'fortran_order'");
  l->p += n;
  return 0;
}

/* A non-negative decimal integer as Python writes it: no sign, no leading zeros, no '_'. */
static int dimension(lex *l, uint64_t *out) {
  skip_space(l);
  if (l->p < l->end && *l->p == '-')
    return fr_err(FERRY_ESHAPE, ".npy header: a negative dimension in 'shape'");
  const char *start = l->p;
  uint64_t v = 0;
  for (; l->p < l->end && *l->p >= '0' && *l->p <= '9'; l->p++)
    if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, *l->p - '0', &v))
      return fr_err(FERRY_EOVERFLOW, ".npy header: a dimension in 'shape' exceeds 64 bits");
  if (l->p == start || (l->p - start > 1 && *start == '0')) {
    l->p = start;
    return expected(l, "a dimension (a non-negative integer)");
  }
  if (l->major < 3 && l->p < l->end && (*l->p == 'L' || *l->p == 'l'))
    l->p++; /* Python 2's long, which numpy still reads in version 1 and 2 files */
  if (l->p < l->end && is_word(*l->p)) {
    l->p = start;
    return expected(l, "a dimension (a non-negative integer)");
  }
  *out = v;
  return 0;
}

/* A tuple: () for a scalar, (5,) for one dimension -- (5) is a number in Python, not a tuple. */
static int shape(lex *l, ferry_tensor_desc *d) {
  if (!eat(l, '('))
    return expected(l, "a tuple '(...)' for 'shape'");
  uint32_t n = 0;
  bool comma = false;
  while (!eat(l, ')')) {
    if (n > 0 && !comma)
      return expected(l, "',' or ')' in 'shape'");
    uint64_t v = 0;
    int rc = dimension(l, &v);
    if (rc != 0)
      return rc;
    if (n == FERRY_MAX_DIMS)
      return fr_err(FERRY_ESHAPE, ".npy header: 'shape' has over %d dimensions, ferry's most",
                    FERRY_MAX_DIMS);
    d->shape[n++] = v;
    comma = eat(l, ',');
  }
  if (n == 1 && !comma)
    return fr_err(FERRY_EPROTO, ".npy header: 'shape' (N) is a number, not a tuple (N,)");
  d->ndim = n;
  return 0;
}

static const char *const key_names[] = {"descr", "fortran_order", "shape"};

static int key(lex *l, unsigned *seen, int *which) {
  const char *s;
  size_t n;
  int rc = string(l, &s, &n);
  if (rc != 0)
    return rc;
  for (int i = 0; i < 3; i++) {
    if (strlen(key_names[i]) != n || memcmp(s, key_names[i], n) != 0)
      continue;
    if (*seen & (1u << i))
      return fr_err(FERRY_EPROTO, ".npy header: key '%s' appears twice", key_names[i]);
    *seen |= 1u << i;
    *which = i;
    return 0;
  }
  char ex[32];
  return fr_err(FERRY_EPROTO,
                ".npy header: unexpected key '%s' (only 'descr', 'fortran_order', 'shape')",
                excerpt(s, n, ex, sizeof ex));
}

/* The dict and the padding after it (spaces and the final newline numpy writes). */
static int dict(lex *l, ferry_tensor_desc *d, bool *fortran) {
  if (!eat(l, '{'))
    return expected(l, "a dict '{...}'");
  unsigned seen = 0;
  bool comma = true;
  while (!eat(l, '}')) {
    if (!comma)
      return expected(l, "',' or '}'");
    int which = 0, rc = key(l, &seen, &which);
    if (rc == 0 && !eat(l, ':'))
      rc = expected(l, "':'");
    if (rc == 0)
      rc = which == 0 ? descr(l, &d->dtype) : which == 1 ? boolean(l, fortran) : shape(l, d);
    if (rc != 0)
      return rc;
    comma = eat(l, ',');
  }
  for (int i = 0; i < 3; i++)
    if (!(seen & (1u << i)))
      return fr_err(FERRY_EPROTO, ".npy header: no '%s' key", key_names[i]);
  skip_space(l);
  if (l->p != l->end)
    return expected(l, "only padding after the header's dict");
  return 0;
}

/* ---- the file ---- */

/* Magic, version and header length; *start and *hlen locate the header inside buf. */
static int preamble(const uint8_t *buf, size_t len, int *major, size_t *start, size_t *hlen) {
  if (!cli_npy_magic(buf, len))
    return fr_err(FERRY_EPROTO, "not a .npy file (no \\x93NUMPY magic)");
  if (len < 8)
    return fr_err(FERRY_EPROTO, ".npy file truncated in its preamble (%zu bytes)", len);
  *major = buf[6];
  if (buf[6] < 1 || buf[6] > 3 || buf[7] != 0)
    return fr_err(FERRY_EPROTO, ".npy version %u.%u; ferry reads 1.0, 2.0 and 3.0", buf[6], buf[7]);
  *start = buf[6] == 1 ? 10 : 12;
  if (len < *start)
    return fr_err(FERRY_EPROTO, ".npy file truncated in its preamble (%zu bytes of %zu)", len,
                  *start);
  uint32_t n = (uint32_t)buf[8] | (uint32_t)buf[9] << 8;
  if (buf[6] > 1)
    n |= (uint32_t)buf[10] << 16 | (uint32_t)buf[11] << 24;
  *hlen = n;
  if (*hlen > len - *start)
    return fr_err(FERRY_EPROTO,
                  ".npy header length %zu runs past the file's end (%zu bytes after the "
                  "%zu-byte preamble)",
                  *hlen, len - *start, *start);
  return 0;
}

/* C and Fortran order lay the bytes out alike when at most one dimension exceeds 1. */
static bool same_in_both_orders(const ferry_tensor_desc *d) {
  uint32_t big = 0;
  for (uint32_t i = 0; i < d->ndim; i++) {
    if (d->shape[i] == 0)
      return true;
    big += d->shape[i] > 1;
  }
  return big <= 1;
}

static int check_data(const ferry_tensor_desc *d, bool fortran, size_t offset, size_t len,
                      uint64_t *nbytes) {
  char s[200];
  ferry_shape_format(d, s, sizeof s);
  if (ferry_tensor_nbytes(d, nbytes) != 0)
    return fr_err(FERRY_EOVERFLOW, ".npy header: %s %s is over 2^64 bytes",
                  ferry_dtype_name(d->dtype), s);
  if (fortran && !same_in_both_orders(d))
    return fr_err(FERRY_ESHAPE,
                  ".npy header: fortran_order True (column-major) %s; ferry takes C order "
                  "(save np.ascontiguousarray(a))",
                  s);
  if (*nbytes != len - offset)
    return fr_err(FERRY_ESHAPE,
                  ".npy header says %s %s, %llu bytes, but %llu bytes follow the %zu-byte "
                  "header",
                  ferry_dtype_name(d->dtype), s, (unsigned long long)*nbytes,
                  (unsigned long long)(len - offset), offset);
  return 0;
}

int cli_npy_parse(const uint8_t *buf, size_t len, cli_npy *out) {
  int major = 0;
  size_t start = 0, hlen = 0;
  int rc = preamble(buf, len, &major, &start, &hlen);
  if (rc != 0)
    return rc;
  lex l = {(const char *)buf + start, (const char *)buf + start + hlen, major};
  ferry_tensor_desc d = {0};
  bool fortran = false;
  uint64_t nbytes;
  if ((rc = dict(&l, &d, &fortran)) != 0 ||
      (rc = check_data(&d, fortran, start + hlen, len, &nbytes)) != 0)
    return rc;
  *out = (cli_npy){.desc = d, .data_offset = start + hlen, .data_bytes = nbytes};
  return 0;
}

/* ---- the header `ferry get` writes ---- */

int cli_npy_header(const ferry_tensor_desc *desc, uint8_t *buf, size_t cap, size_t *len) {
  const char *descr = NULL;
  for (size_t i = 0; i < N_TYPES; i++)
    if (npy_types[i].dtype == desc->dtype)
      descr = npy_types[i].descr;
  if (!descr)
    return fr_err(FERRY_EDTYPE, ".npy has no standard dtype for %s",
                  ferry_dtype_name(desc->dtype) ? ferry_dtype_name(desc->dtype) : "this dtype");
  if (desc->ndim > FERRY_MAX_DIMS)
    return fr_err(FERRY_ESHAPE, "%u dimensions; at most %d", desc->ndim, FERRY_MAX_DIMS);
  /* numpy's own layout: repr() of the shape tuple, padded with spaces and a newline so the
   * data starts at a multiple of 64 bytes */
  char dict[128 + 24 * FERRY_MAX_DIMS];
  int n = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': (", descr);
  for (uint32_t i = 0; i < desc->ndim; i++)
    n += snprintf(dict + n, sizeof dict - (size_t)n, "%s%llu", i ? ", " : "",
                  (unsigned long long)desc->shape[i]);
  n += snprintf(dict + n, sizeof dict - (size_t)n, "%s), }", desc->ndim == 1 ? "," : "");
  size_t pad = (64 - (10 + (size_t)n + 1) % 64) % 64;
  size_t hlen = (size_t)n + pad + 1;
  if (cap < 10 + hlen)
    return fr_err(FERRY_ERANGE, ".npy header needs %zu bytes, %zu given", 10 + hlen, cap);
  memcpy(buf, CLI_NPY_MAGIC "\x01\x00", 8);
  buf[8] = (uint8_t)hlen;
  buf[9] = (uint8_t)(hlen >> 8);
  memcpy(buf + 10, dict, (size_t)n);
  memset(buf + 10 + n, ' ', pad);
  buf[10 + hlen - 1] = '\n';
  *len = 10 + hlen;
  return 0;
}
