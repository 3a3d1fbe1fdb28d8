/*
 * Casts done on the sender so bytes land in the engine's layout: f32→bf16 and f32→f16 (round to
 * nearest even), and f32/bf16→fp8 e4m3 (the "fn" variant, max 448) with a per-tensor scale that
 * the manifest carries. Element by element, so a cast may cover any window of a tensor.
 */
#include "core/core.h"
#include "refit/plan.h"

#include <math.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* IEEE half precision, round to nearest even; clang 14 has no _Float16 on x86, so by hand. */
static uint16_t f32_to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u)
    return sign | 0x7e00u; /* NaN */
  if (a >= 0x477ff000u)
    return sign | 0x7c00u;            /* overflows to infinity (65520 and up round there) */
  if (a < 0x38800000u) {              /* below 2^-14: a subnormal half, or zero */
    float m = fabsf(f) * 16777216.0f; /* in units of 2^-24 */
    return sign | (uint16_t)nearbyintf(m);
  }
  uint32_t mant = a & 0x7fffffu, exp = (a >> 23) - 112; /* rebias 127 -> 15 */
  uint32_t h = exp << 10 | mant >> 13;
  uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
    h++; /* may carry into the exponent, which is right */
  return sign | (uint16_t)h;
}

/* e4m3fn: bias 7, no infinities, 0x7f/0xff are NaN, largest finite 448. */
static uint8_t f32_to_e4m3(float x) {
  uint8_t sign = signbit(x) ? 0x80 : 0;
  float a = fabsf(x);
  if (isnan(a))
    return 0x7f;
  if (a >= 464.0f) /* 448 + half a step: saturate */
    return sign | 0x7e;
  if (a < 0.015625f) { /* below 2^-6: subnormal, steps of 2^-9 */
    int m = (int)nearbyintf(a * 512.0f);
    return sign | (uint8_t)m; /* m == 8 is the smallest normal, encoded the same way */
  }
  int e;
  float frac = frexpf(a, &e); /* a = frac * 2^e, frac in [0.5, 1) */
  int m = (int)nearbyintf((frac * 2.0f - 1.0f) * 8.0f);
  int exp = e - 1;
  if (m == 8) {
    m = 0;
    exp++;
  }
  if (exp > 8 || (exp == 8 && m > 6))
    return sign | 0x7e;
  return sign | (uint8_t)((exp + 7) << 3) | (uint8_t)m;
}

bool fr_refit_cast_supported(ferry_dtype from, ferry_dtype to) {
  if (from == to)
    return ferry_dtype_size(from) > 0;
  if (from == FERRY_DTYPE_F32)
    return to == FERRY_DTYPE_BF16 || to == FERRY_DTYPE_F16 || to == FERRY_DTYPE_F8E4M3;
  return from == FERRY_DTYPE_BF16 && to == FERRY_DTYPE_F8E4M3;
}

static float load(ferry_dtype t, const void *src, uint64_t i) {
  if (t == FERRY_DTYPE_F32)
    return ((const float *)src)[i];
  return bf16_to_f32(((const uint16_t *)src)[i]);
}

int fr_refit_cast(ferry_dtype from, ferry_dtype to, float scale, const void *src, void *dst,
                  uint64_t count) {
  if (from == to) {
    memcpy(dst, src, count * ferry_dtype_size(from));
    return 0;
  }
  if (!fr_refit_cast_supported(from, to))
    return fr_err(FERRY_EDTYPE, "no cast from %s to %s", ferry_dtype_name(from),
                  ferry_dtype_name(to));
  if (to == FERRY_DTYPE_BF16) {
    for (uint64_t i = 0; i < count; i++)
      ((uint16_t *)dst)[i] = f32_to_bf16(((const float *)src)[i]);
  } else if (to == FERRY_DTYPE_F16) {
    for (uint64_t i = 0; i < count; i++)
      ((uint16_t *)dst)[i] = f32_to_f16(((const float *)src)[i]);
  } else {
    float inv = scale > 0 ? 1.0f / scale : 1.0f;
    for (uint64_t i = 0; i < count; i++)
      ((uint8_t *)dst)[i] = f32_to_e4m3(load(from, src, i) * inv);
  }
  return 0;
}

float fr_refit_amax(ferry_dtype from, const void *src, uint64_t count, float amax) {
  for (uint64_t i = 0; i < count; i++) {
    float a = fabsf(load(from, src, i));
    if (a > amax && !isnan(a))
      amax = a;
  }
  return amax;
}

float fr_refit_fp8_scale_of(float amax) { return amax > 0 ? amax / 448.0f : 1.0f; }

float fr_refit_fp8_scale(ferry_dtype from, const void *src, uint64_t count) {
  return fr_refit_fp8_scale_of(fr_refit_amax(from, src, count, 0));
}
