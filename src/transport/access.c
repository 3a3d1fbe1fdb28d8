/*
 * Region access blobs (access.h): the transport-neutral envelope around what transports pack
 * for a region. A blob is a list of entries, one per transport that packed something: the
 * transport's name (one length byte, then the name), then its bytes (two length bytes, little
 * endian, then the bytes). A link's transport receives the bytes of its own entry only.
 */
#include "transport/access.h"
#include "transport/transport.h"

#include <string.h>

static bool put_entry(uint8_t *buf, size_t cap, size_t *at, const char *name, const uint8_t *data,
                      size_t len) {
  size_t n = strlen(name);
  if (n > UINT8_MAX || len > UINT16_MAX || cap - *at < 1 + n + 2 + len)
    return false;
  uint8_t *p = buf + *at;
  p[0] = (uint8_t)n;
  memcpy(p + 1, name, n);
  p[1 + n] = (uint8_t)len;
  p[2 + n] = (uint8_t)(len >> 8);
  memcpy(p + 3 + n, data, len);
  *at += 1 + n + 2 + len;
  return true;
}

int fr_region_access_pack(ferry_ctx *ctx, const ferry_region_ref *ref, uint8_t *buf, size_t cap,
                          size_t *len) {
  if (!ctx || !ref || !buf || !len)
    return fr_err(FERRY_EINVAL, "region access: NULL argument");
  *len = 0;
  fr_region *r = NULL;
  int rc = fr_region_acquire(&ctx->regions, ref->id, ref->key, 0, 0, &r);
  for (size_t i = 0; rc == 0 && i < ctx->norder; i++) {
    const fr_transport_ops *ops = ctx->order[i];
    uint8_t part[FR_ACCESS_MAX];
    size_t n = 0;
    if (!ops->region_pack || ops->region_pack(ctx, r, part, sizeof part, &n) != 0 || n == 0)
      continue; /* nothing to publish: peers ask */
    if (!put_entry(buf, cap, len, ops->name, part, n))
      rc = fr_err(FERRY_ERANGE, "region access: %s's part does not fit %zu bytes", ops->name, cap);
  }
  fr_region_release(r);
  if (rc != 0)
    *len = 0;
  return rc;
}

void fr_link_access_hint(ferry_link *l, const uint8_t *blob, size_t len) {
  if (!l || !blob || !l->ops->region_hint)
    return;
  size_t want = strlen(l->ops->name);
  for (size_t at = 0; at < len;) {
    size_t n = blob[at];
    if (len - at < 1 + n + 2)
      return;
    const uint8_t *p = blob + at + 1 + n;
    size_t part = (size_t)p[0] | (size_t)p[1] << 8;
    if (len - at - 1 - n - 2 < part)
      return;
    if (n == want && memcmp(blob + at + 1, l->ops->name, n) == 0) {
      l->ops->region_hint(l, p + 2, part);
      return;
    }
    at += 1 + n + 2 + part;
  }
}
