/*
 * Refit plans: the flat layout and bucket windows (see plan.h), and the manifest codec that a
 * receiver trusts only after checking every field.
 */
#include "refit/plan.h"
#include "core/core.h"
#include "transport/wire.h" /* little-endian helpers */

#include <stdlib.h>
#include <string.h>

static uint64_t align_up(uint64_t v) {
  return (v + FR_REFIT_ALIGN - 1) & ~(uint64_t)(FR_REFIT_ALIGN - 1);
}

static int entry_sizes(fr_refit_entry *e) {
  int rc = ferry_tensor_nbytes(&e->desc, &e->src_bytes);
  if (rc != 0)
    return fr_err_wrap(rc, "tensor '%s'", e->name);
  if (e->wire == FERRY_DTYPE_INVALID)
    e->wire = e->desc.dtype;
  if (!fr_refit_cast_supported(e->desc.dtype, e->wire))
    return fr_err(FERRY_EDTYPE, "tensor '%s': no cast from %s to %s", e->name,
                  ferry_dtype_name(e->desc.dtype), ferry_dtype_name(e->wire));
  ferry_tensor_desc w = e->desc;
  w.dtype = e->wire;
  return ferry_tensor_nbytes(&w, &e->wire_bytes);
}

int fr_refit_plan_build(fr_refit_plan *plan, uint64_t bucket_budget) {
  uint64_t off = 0;
  for (uint32_t i = 0; i < plan->count; i++) {
    fr_refit_entry *e = &plan->entries[i];
    int rc = entry_sizes(e);
    if (rc != 0)
      return rc;
    e->offset = off;
    if (__builtin_add_overflow(off, align_up(e->wire_bytes), &off))
      return fr_err(FERRY_EOVERFLOW, "refit plan: the model's bytes overflow 64 bits");
  }
  plan->total_bytes = off;
  uint64_t bucket = bucket_budget & ~(uint64_t)(FR_REFIT_ALIGN - 1);
  plan->bucket_bytes = bucket < FR_REFIT_ALIGN ? FR_REFIT_ALIGN : bucket;
  uint64_t n = (off + plan->bucket_bytes - 1) / plan->bucket_bytes;
  if (n > UINT32_MAX)
    return fr_err(FERRY_ERANGE, "refit plan: %llu buckets; raise the buffer budget",
                  (unsigned long long)n);
  plan->buckets = (uint32_t)n;
  return 0;
}

void fr_refit_plan_free(fr_refit_plan *plan) {
  for (uint32_t i = 0; plan->entries && i < plan->count; i++) {
    free(plan->entries[i].name);
    free(plan->entries[i].global);
  }
  free(plan->entries);
  plan->entries = NULL;
  plan->count = 0;
}

int64_t fr_refit_plan_find(const fr_refit_plan *plan, const char *name) {
  for (uint32_t i = 0; i < plan->count; i++)
    if (strcmp(plan->entries[i].name, name) == 0)
      return i;
  return -1;
}

uint32_t fr_refit_first_entry(const fr_refit_plan *plan, uint32_t b) {
  uint64_t start = (uint64_t)b * plan->bucket_bytes;
  uint32_t lo = 0, hi = plan->count; /* first entry whose end is past start */
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    const fr_refit_entry *e = &plan->entries[mid];
    if (e->offset + e->wire_bytes <= start)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

uint64_t fr_refit_overlap_window(const fr_refit_plan *plan, uint32_t e, uint64_t start,
                                 uint64_t len, uint64_t *wire_off, uint64_t *window_off) {
  const fr_refit_entry *x = &plan->entries[e];
  uint64_t end = start + len;
  uint64_t lo = x->offset > start ? x->offset : start;
  uint64_t hi = x->offset + x->wire_bytes < end ? x->offset + x->wire_bytes : end;
  if (hi <= lo)
    return 0;
  *wire_off = lo - x->offset;
  *window_off = lo - start;
  return hi - lo;
}

uint64_t fr_refit_overlap(const fr_refit_plan *plan, uint32_t e, uint32_t b, uint64_t *wire_off,
                          uint64_t *bucket_off) {
  return fr_refit_overlap_window(plan, e, (uint64_t)b * plan->bucket_bytes,
                                 fr_refit_bucket_len(plan, b), wire_off, bucket_off);
}

/* ---- manifest codec ----
 *
 * Head (HEAD_BYTES): magic, version, generation, count (u32 each), total and bucket bytes (u64),
 * the sender's rank and world (u32; a single sender is rank 0 of 1). Then per entry: name (u16
 * length, bytes), dtype, wire dtype, ndim, a zero byte, the fp8 scale (f32 bits), the shape (u64
 * per dim), the offset (u64), and the global piece: the global tensor's name (u16 length, bytes;
 * 0: whole under its own name, nothing follows) then gdim (u32), gstart and gstop (u64). */

#define MANIFEST_MAGIC 0x464d5246u /* "FRMF" */
#define MANIFEST_VERSION 2u        /* 2: rank, world and the global pieces (issue 34) */
#define HEAD_BYTES 40u

static size_t global_wire_size(const fr_refit_entry *e) {
  return 2 + (e->global ? strlen(e->global) + 4 + 8 + 8 : 0);
}

static size_t entry_wire_size(const fr_refit_entry *e) {
  return 2 + strlen(e->name) + 4 + 4 + 8 * (size_t)e->desc.ndim + 8 + global_wire_size(e);
}

static uint8_t *put_name(uint8_t *p, const char *name) {
  size_t nl = name ? strlen(name) : 0;
  p[0] = (uint8_t)nl;
  p[1] = (uint8_t)(nl >> 8);
  memcpy(p + 2, name ? name : "", nl);
  return p + 2 + nl;
}

static uint8_t *put_entry(uint8_t *p, const fr_refit_entry *e) {
  p = put_name(p, e->name);
  p[0] = (uint8_t)e->desc.dtype;
  p[1] = (uint8_t)e->wire;
  p[2] = (uint8_t)e->desc.ndim;
  p[3] = 0;
  uint32_t scale;
  memcpy(&scale, &e->scale, 4);
  fr_put_u32(p + 4, scale);
  p += 8;
  for (uint32_t d = 0; d < e->desc.ndim; d++, p += 8)
    fr_put_u64(p, e->desc.shape[d]);
  fr_put_u64(p, e->offset);
  p = put_name(p + 8, e->global);
  if (!e->global)
    return p;
  fr_put_u32(p, e->gdim);
  fr_put_u64(p + 4, e->gstart);
  fr_put_u64(p + 12, e->gstop);
  return p + 20;
}

int fr_refit_manifest_encode(const fr_refit_plan *plan, uint8_t **out, size_t *len) {
  size_t n = HEAD_BYTES;
  for (uint32_t i = 0; i < plan->count; i++)
    n += entry_wire_size(&plan->entries[i]);
  uint8_t *b = malloc(n), *p = b;
  if (!b)
    return fr_err(FERRY_ENOMEM, "refit manifest: %zu bytes", n);
  bool group = plan->world > 1;
  fr_put_u32(p, MANIFEST_MAGIC);
  fr_put_u32(p + 4, MANIFEST_VERSION);
  fr_put_u32(p + 8, plan->generation);
  fr_put_u32(p + 12, plan->count);
  fr_put_u64(p + 16, plan->total_bytes);
  fr_put_u64(p + 24, plan->bucket_bytes);
  fr_put_u32(p + 32, group ? plan->rank : 0);
  fr_put_u32(p + 36, group ? plan->world : 1);
  p += HEAD_BYTES;
  for (uint32_t i = 0; i < plan->count; i++)
    p = put_entry(p, &plan->entries[i]);
  *out = b;
  *len = n;
  return 0;
}

/* A name (u16 length, bytes) at *pp: NULL in *out when the length is 0 and `optional`; FERRY_EPROTO
 * for one that is too long, runs past the end, holds a NUL or breaks the name rule. */
static int get_name(const uint8_t **pp, const uint8_t *end, bool optional, const char *what,
                    char **out) {
  const uint8_t *p = *pp;
  *out = NULL;
  if (end - p < 2)
    return fr_err(FERRY_EPROTO, "refit manifest: truncated");
  size_t nl = (size_t)p[0] | (size_t)p[1] << 8;
  if ((nl == 0 && !optional) || nl > FR_REFIT_NAME_MAX || (size_t)(end - p) < 2 + nl)
    return fr_err(FERRY_EPROTO, "refit manifest: bad %s length %zu", what, nl);
  *pp = p + 2 + nl;
  if (nl == 0)
    return 0;
  if (memchr(p + 2, '\0', nl))
    return fr_err(FERRY_EPROTO, "refit manifest: NUL inside a %s", what);
  if (!(*out = strndup((const char *)p + 2, nl)))
    return fr_err(FERRY_ENOMEM, "refit manifest: %s", what);
  if (!fr_name_ok(*out, FR_REFIT_NAME_MAX)) /* the one name rule (core.h) */
    return fr_err(FERRY_EPROTO, "refit manifest: a %s with a control character or not UTF-8: '%s'",
                  what, *out);
  return 0;
}

/* The global piece after an entry's offset: none, or a slice of e's shape (gdim < ndim, [gstart,
 * gstop) as long as e's dim gdim, within int64 like a ferry_refit_piece). */
static int decode_global(const uint8_t **pp, const uint8_t *end, fr_refit_entry *e) {
  int rc = get_name(pp, end, true, "global tensor name", &e->global);
  if (rc != 0 || !e->global)
    return rc;
  const uint8_t *p = *pp;
  if (end - p < 20)
    return fr_err(FERRY_EPROTO, "refit manifest: '%s': truncated piece", e->name);
  e->gdim = fr_get_u32(p);
  e->gstart = fr_get_u64(p + 4);
  e->gstop = fr_get_u64(p + 12);
  *pp = p + 20;
  if (e->gdim >= e->desc.ndim || e->gstart >= e->gstop || e->gstop > INT64_MAX ||
      e->gstop - e->gstart != e->desc.shape[e->gdim])
    return fr_err(FERRY_EPROTO,
                  "refit manifest: '%s' is a piece of '%s' along dim %u, [%llu, %llu), that does "
                  "not fit its shape",
                  e->name, e->global, e->gdim, (unsigned long long)e->gstart,
                  (unsigned long long)e->gstop);
  return 0;
}

static int decode_entry(const uint8_t **pp, const uint8_t *end, fr_refit_entry *e) {
  int rc = get_name(pp, end, false, "tensor name", &e->name);
  if (rc != 0)
    return rc;
  const uint8_t *p = *pp;
  if (end - p < 8)
    return fr_err(FERRY_EPROTO, "refit manifest: '%s' truncated", e->name);
  e->desc.dtype = (ferry_dtype)p[0];
  e->wire = (ferry_dtype)p[1];
  e->desc.ndim = p[2];
  if (p[3] != 0 || e->wire == FERRY_DTYPE_INVALID)
    return fr_err(FERRY_EPROTO, "refit manifest: '%s' has a bad dtype or reserved byte", e->name);
  uint32_t scale = fr_get_u32(p + 4);
  memcpy(&e->scale, &scale, 4);
  p += 8;
  if (e->desc.ndim > FERRY_MAX_DIMS || (size_t)(end - p) < 8 * (size_t)e->desc.ndim + 8)
    return fr_err(FERRY_EPROTO, "refit manifest: '%s' has a bad shape", e->name);
  for (uint32_t d = 0; d < e->desc.ndim; d++, p += 8)
    e->desc.shape[d] = fr_get_u64(p);
  e->offset = fr_get_u64(p);
  *pp = p + 8;
  if ((rc = decode_global(pp, end, e)) != 0)
    return rc;
  rc = entry_sizes(e);
  return rc ? fr_err_wrap(FERRY_EPROTO, "refit manifest") : 0;
}

/* The head's fields, each checked: a plan with no entries yet. */
static int decode_head(const uint8_t *in, size_t len, fr_refit_plan *plan) {
  if (len < HEAD_BYTES || fr_get_u32(in) != MANIFEST_MAGIC)
    return fr_err(FERRY_EPROTO, "refit manifest: bad header");
  if (fr_get_u32(in + 4) != MANIFEST_VERSION)
    return fr_err(FERRY_EPROTO, "refit manifest: version %u (this ferry reads %u)",
                  fr_get_u32(in + 4), MANIFEST_VERSION);
  *plan = (fr_refit_plan){.generation = fr_get_u32(in + 8),
                          .count = fr_get_u32(in + 12),
                          .total_bytes = fr_get_u64(in + 16),
                          .bucket_bytes = fr_get_u64(in + 24),
                          .rank = fr_get_u32(in + 32),
                          .world = fr_get_u32(in + 36)};
  if (plan->count > FR_REFIT_MAX_TENSORS || plan->count > len / 20)
    return fr_err(FERRY_EPROTO, "refit manifest: %u tensors", plan->count);
  if (plan->bucket_bytes == 0 || plan->bucket_bytes % FR_REFIT_ALIGN)
    return fr_err(FERRY_EPROTO, "refit manifest: bucket size %llu",
                  (unsigned long long)plan->bucket_bytes);
  if (plan->world == 0 || plan->world > FR_REFIT_MAX_WORLD || plan->rank >= plan->world)
    return fr_err(FERRY_EPROTO, "refit manifest: rank %u of a world of %u", plan->rank,
                  plan->world);
  return 0;
}

int fr_refit_manifest_decode(const uint8_t *in, size_t len, fr_refit_plan *out) {
  fr_refit_plan plan;
  int rc = decode_head(in, len, &plan);
  if (rc != 0)
    return rc;
  plan.entries = calloc(plan.count ? plan.count : 1, sizeof *plan.entries);
  if (!plan.entries)
    return fr_err(FERRY_ENOMEM, "refit manifest: %u entries", plan.count);
  const uint8_t *p = in + HEAD_BYTES, *end = in + len;
  uint64_t next = 0;
  for (uint32_t i = 0; i < plan.count && rc == 0; i++) {
    fr_refit_entry *e = &plan.entries[i];
    rc = decode_entry(&p, end, e);
    if (rc == 0 && (e->offset != next || e->offset % FR_REFIT_ALIGN))
      rc = fr_err(FERRY_EPROTO, "refit manifest: '%s' at offset %llu, expected %llu", e->name,
                  (unsigned long long)e->offset, (unsigned long long)next);
    if (rc == 0 && __builtin_add_overflow(next, align_up(e->wire_bytes), &next))
      rc = fr_err(FERRY_EPROTO, "refit manifest: sizes overflow");
  }
  if (rc == 0 && (p != end || next != plan.total_bytes))
    rc = fr_err(FERRY_EPROTO, "refit manifest: sizes do not add up");
  uint64_t buckets = (plan.total_bytes + plan.bucket_bytes - 1) / plan.bucket_bytes;
  if (rc == 0 && buckets > UINT32_MAX)
    rc = fr_err(FERRY_EPROTO, "refit manifest: too many buckets");
  if (rc != 0) { /* entries past the failure are zeroed: freeing them is safe */
    fr_refit_plan_free(&plan);
    return rc;
  }
  plan.buckets = (uint32_t)buckets;
  *out = plan;
  return 0;
}
