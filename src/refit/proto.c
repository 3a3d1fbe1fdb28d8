/*
 * Encoding and validation of refit protocol messages (proto.h).
 */
#include "refit/proto.h"
#include "refit/shard.h"
#include "core/channels.h"
#include "core/core.h"
#include "transport/wire.h"

#include <string.h>

void fr_refit_msg_encode(const fr_refit_msg_t *m, uint8_t out[FR_REFIT_MSG_BYTES]) {
  fr_put_u32(out, m->type);
  fr_put_u32(out + 4, m->bucket);
  fr_put_u32(out + 8, m->generation);
  fr_put_u32(out + 12, m->buffer);
  fr_put_u32(out + 16, m->flags);
  fr_put_u32(out + 20, (uint32_t)m->status);
  fr_put_u64(out + 24, m->version);
  fr_put_u64(out + 32, m->bytes);
  fr_put_u64(out + 40, m->checksum);
  fr_put_u32(out + 48, m->seq);
  fr_put_u32(out + 52, m->timeout_ms);
  fr_put_u64(out + 56, m->src.id);
  fr_put_u64(out + 64, m->src.key);
  fr_put_u64(out + 72, m->src.size);
  fr_put_u64(out + 80, m->src_offset);
  fr_put_u32(out + 88, m->view);
  fr_put_u32(out + 92, 0);
  fr_put_u64(out + 96, m->view_sum);
}

int fr_refit_msg_decode(const uint8_t *in, size_t len, fr_refit_msg_t *out) {
  if (len < FR_REFIT_MSG_BYTES ||
      len > FR_REFIT_MSG_BYTES + FR_REFIT_PIECES_MAX * (size_t)FR_REFIT_PIECE_BYTES)
    return fr_err(FERRY_EPROTO, "refit message of %zu bytes", len);
  fr_refit_msg_t m = {
      .type = fr_get_u32(in),
      .bucket = fr_get_u32(in + 4),
      .generation = fr_get_u32(in + 8),
      .buffer = fr_get_u32(in + 12),
      .flags = fr_get_u32(in + 16),
      .status = (int32_t)fr_get_u32(in + 20),
      .version = fr_get_u64(in + 24),
      .bytes = fr_get_u64(in + 32),
      .checksum = fr_get_u64(in + 40),
      .seq = fr_get_u32(in + 48),
      .timeout_ms = fr_get_u32(in + 52),
      .src = {fr_get_u64(in + 56), fr_get_u64(in + 64), fr_get_u64(in + 72)},
      .src_offset = fr_get_u64(in + 80),
      .view = fr_get_u32(in + 88),
      .view_sum = fr_get_u64(in + 96),
  };
  if (m.type < FR_REFIT_BUCKET || m.type > FR_REFIT_VIEW)
    return fr_err(FERRY_EPROTO, "refit message type %u", m.type);
  if (m.buffer > 1 || (m.flags & ~FR_REFIT_FLAGS) || m.status > 0)
    return fr_err(FERRY_EPROTO, "refit message: bad field");
  size_t extra = len - FR_REFIT_MSG_BYTES;
  if (m.type == FR_REFIT_ROUTE ? extra == 0 || extra > FR_REFIT_ADDRESS_MAX
      : m.type == FR_REFIT_VIEW
          ? m.bytes > FR_REFIT_PIECES_MAX || extra != m.bytes * FR_REFIT_PIECE_BYTES
          : extra != 0)
    return fr_err(FERRY_EPROTO, "refit message: only ROUTE and VIEW carry bytes after the record");
  m.route = (const char *)in + FR_REFIT_MSG_BYTES;
  m.route_len = len - FR_REFIT_MSG_BYTES;
  *out = m;
  return 0;
}

void fr_refit_attach_head_encode(const fr_refit_attach_reply *r,
                                 uint8_t out[FR_REFIT_ATTACH_HEAD]) {
  memset(out, 0, FR_REFIT_ATTACH_HEAD);
  fr_put_u32(out, (uint32_t)r->status);
  fr_put_u64(out + 8, r->latest);
  fr_put_u64(out + 16, r->alias.id);
  fr_put_u64(out + 24, r->alias.key);
  fr_put_u64(out + 32, r->alias.size);
}

int fr_refit_attach_decode(const uint8_t *in, size_t len, fr_refit_attach_reply *out) {
  if (len < FR_REFIT_ATTACH_HEAD)
    return fr_err(FERRY_EPROTO, "refit attach reply of %zu bytes", len);
  fr_refit_attach_reply r = {
      .status = (int32_t)fr_get_u32(in),
      .latest = fr_get_u64(in + 8),
      .alias = {fr_get_u64(in + 16), fr_get_u64(in + 24), fr_get_u64(in + 32)},
  };
  r.manifest = in + FR_REFIT_ATTACH_HEAD;
  r.manifest_len = len - FR_REFIT_ATTACH_HEAD;
  if (r.status > 0)
    return fr_err(FERRY_EPROTO, "refit attach reply: bad status");
  *out = r;
  return 0;
}

int fr_refit_send(ferry_link *link, uint32_t channel, const fr_refit_msg_t *m, int timeout_ms) {
  uint8_t buf[FR_REFIT_MSG_BYTES];
  fr_refit_msg_encode(m, buf);
  struct iovec iov[2] = {{buf, sizeof buf}, {(void *)m->route, m->route_len}};
  return ferry_send(link, channel, iov, m->route_len ? 2 : 1, timeout_ms);
}
