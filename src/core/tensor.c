/*
 * Tensor descriptors: dtypes from the table in ferry.h, shapes, and an overflow-safe byte size.
 */
#include "core/core.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

size_t ferry_dtype_size(ferry_dtype dtype) {
  switch (dtype) {
#define FR_DTYPE_SIZE_(name, code, size, str)                                                      \
  case FERRY_DTYPE_##name:                                                                         \
    return (size);
    FERRY_DTYPE_TABLE(FR_DTYPE_SIZE_)
#undef FR_DTYPE_SIZE_
  default:
    return 0;
  }
}

const char *ferry_dtype_name(ferry_dtype dtype) {
  switch (dtype) {
#define FR_DTYPE_NAME_(name, code, size, str)                                                      \
  case FERRY_DTYPE_##name:                                                                         \
    return (str);
    FERRY_DTYPE_TABLE(FR_DTYPE_NAME_)
#undef FR_DTYPE_NAME_
  default:
    return NULL;
  }
}

static const struct {
  const char *alias;
  ferry_dtype dtype;
} dtype_aliases[] = {
    {"u8", FERRY_DTYPE_U8},
    {"u16", FERRY_DTYPE_U16},
    {"u32", FERRY_DTYPE_U32},
    {"u64", FERRY_DTYPE_U64},
    {"i8", FERRY_DTYPE_I8},
    {"i16", FERRY_DTYPE_I16},
    {"i32", FERRY_DTYPE_I32},
    {"i64", FERRY_DTYPE_I64},
    {"f16", FERRY_DTYPE_F16},
    {"half", FERRY_DTYPE_F16},
    {"bf16", FERRY_DTYPE_BF16},
    {"f32", FERRY_DTYPE_F32},
    {"float", FERRY_DTYPE_F32},
    {"f64", FERRY_DTYPE_F64},
    {"double", FERRY_DTYPE_F64},
    {"fp8_e4m3", FERRY_DTYPE_F8E4M3},
    {"float8_e4m3fn", FERRY_DTYPE_F8E4M3},
    {"fp8_e5m2", FERRY_DTYPE_F8E5M2},
};

int ferry_dtype_parse(const char *name, ferry_dtype *out) {
  if (!name || !out)
    return fr_err(FERRY_EINVAL, "dtype parse: NULL argument");
#define FR_DTYPE_PARSE_(n, code, size, str)                                                        \
  if (strcasecmp(name, str) == 0) {                                                                \
    *out = FERRY_DTYPE_##n;                                                                        \
    return 0;                                                                                      \
  }
  FERRY_DTYPE_TABLE(FR_DTYPE_PARSE_)
#undef FR_DTYPE_PARSE_
  for (size_t i = 0; i < sizeof dtype_aliases / sizeof dtype_aliases[0]; i++)
    if (strcasecmp(name, dtype_aliases[i].alias) == 0) {
      *out = dtype_aliases[i].dtype;
      return 0;
    }
  return fr_err(FERRY_EDTYPE, "unknown dtype '%s'", name);
}

int ferry_tensor_nbytes(const ferry_tensor_desc *desc, uint64_t *out) {
  if (!desc || !out)
    return fr_err(FERRY_EINVAL, "tensor size: NULL argument");
  size_t elem = ferry_dtype_size(desc->dtype);
  if (elem == 0)
    return fr_err(FERRY_EDTYPE, "invalid dtype code %d", (int)desc->dtype);
  if (desc->ndim > FERRY_MAX_DIMS)
    return fr_err(FERRY_ESHAPE, "%u dimensions; at most %d", desc->ndim, FERRY_MAX_DIMS);
  uint64_t n = elem;
  for (uint32_t i = 0; i < desc->ndim; i++)
    if (__builtin_mul_overflow(n, desc->shape[i], &n))
      return fr_err(FERRY_EOVERFLOW, "tensor size overflows 64 bits at dimension %u", i);
  *out = n;
  return 0;
}

int ferry_shape_parse(const char *text, ferry_tensor_desc *desc) {
  if (!text || !desc)
    return fr_err(FERRY_EINVAL, "shape parse: NULL argument");
  ferry_tensor_desc d = *desc;
  d.ndim = 0;
  const char *p = text;
  while (*p == '[' || *p == '(' || *p == ' ')
    p++;
  while (*p && *p != ']' && *p != ')') {
    if (d.ndim == FERRY_MAX_DIMS)
      return fr_err(FERRY_ESHAPE, "shape '%s' has more than %d dimensions", text, FERRY_MAX_DIMS);
    if (*p < '0' || *p > '9')
      return fr_err(FERRY_ESHAPE, "shape '%s': expected a number at '%s'", text, p);
    char *end;
    errno = 0;
    unsigned long long v = strtoull(p, &end, 10);
    if (errno)
      return fr_err(FERRY_EOVERFLOW, "shape '%s': dimension too large", text);
    d.shape[d.ndim++] = v;
    p = end;
    while (*p == ' ')
      p++;
    if (*p == ',' || *p == 'x')
      p++;
    while (*p == ' ')
      p++;
  }
  *desc = d;
  return 0;
}

char *ferry_shape_format(const ferry_tensor_desc *desc, char *buf, size_t len) {
  if (!buf || len == 0)
    return buf;
  size_t used = (size_t)snprintf(buf, len, "[");
  for (uint32_t i = 0; desc && i < desc->ndim && i < FERRY_MAX_DIMS && used < len; i++)
    used += (size_t)snprintf(buf + used, len - used, "%s%llu", i ? ", " : "",
                             (unsigned long long)desc->shape[i]);
  if (used < len)
    snprintf(buf + used, len - used, "]");
  return buf;
}
