/*
 * Encoding and validation of link frames and their fixed bodies. Every decoder checks lengths
 * and values before it copies anything out; nothing here allocates or does I/O.
 */
#include "transport/wire.h"
#include "core/core.h"

#include <string.h>

void fr_frame_encode(const fr_frame *f, uint8_t out[FR_FRAME_BYTES]) {
  fr_put_u32(out, FR_WIRE_MAGIC);
  out[4] = FR_WIRE_VERSION;
  out[5] = f->type;
  out[6] = (uint8_t)f->flags;
  out[7] = (uint8_t)(f->flags >> 8);
  fr_put_u32(out + 8, (uint32_t)f->status);
  fr_put_u32(out + 12, f->channel);
  fr_put_u64(out + 16, f->req_id);
  fr_put_u64(out + 24, f->len);
}

/* The payload length a frame type must have, or its bounds. */
static int check_length(const fr_frame *f, uint64_t max_payload) {
  uint64_t exact = UINT64_MAX, max = 0;
  bool error_response = f->status != 0;
  switch ((fr_frame_type)f->type) {
  case FR_HELLO:
    exact = FR_HELLO_BYTES;
    break;
  case FR_HELLO_ACK: /* a refusal (another user's shm peer) has no challenge to carry */
    exact = error_response ? 0 : FR_HELLO_ACK_BYTES;
    break;
  case FR_AUTH:
    exact = FR_AUTH_BYTES;
    break;
  case FR_AUTH_ACK:
  case FR_WRITE_RESP:
    exact = 0;
    break;
  case FR_READ:
    exact = FR_RMA_BYTES;
    break;
  case FR_READV:
    if (f->len < FR_READV_HEAD_BYTES + FR_READV_RUN_BYTES)
      return fr_err(FERRY_EPROTO, "frame READV: %llu bytes, no run", (unsigned long long)f->len);
    max = FR_READV_HEAD_BYTES + FR_READV_RUN_BYTES * FR_READV_MAX_RUNS;
    break;
  case FR_MAP:
    exact = FR_MAP_BYTES;
    break;
  case FR_MAP_RESP:
    exact = error_response ? 0 : f->len == FR_MAP_RESP_CUDA_BYTES ? f->len : FR_MAP_RESP_BYTES;
    break;
  case FR_MSG:
  case FR_CALL:
    max = max_payload;
    break;
  case FR_REPLY:
  case FR_READ_RESP:
    max = error_response ? 0 : max_payload;
    break;
  case FR_WRITE:
    if (f->len < FR_RMA_BYTES)
      return fr_err(FERRY_EPROTO, "frame WRITE: %llu bytes, shorter than its header",
                    (unsigned long long)f->len);
    max = max_payload > UINT64_MAX - FR_RMA_BYTES ? UINT64_MAX : max_payload + FR_RMA_BYTES;
    break;
  }
  if (exact != UINT64_MAX && f->len != exact)
    return fr_err(FERRY_EPROTO, "frame type %u: length %llu, expected %llu", f->type,
                  (unsigned long long)f->len, (unsigned long long)exact);
  if (exact == UINT64_MAX && f->len > max)
    return fr_err(FERRY_EPROTO, "frame type %u: length %llu exceeds the limit %llu", f->type,
                  (unsigned long long)f->len, (unsigned long long)max);
  return 0;
}

static bool is_response(uint8_t type) {
  return type == FR_HELLO_ACK || type == FR_AUTH_ACK || type == FR_READ_RESP ||
         type == FR_WRITE_RESP || type == FR_MAP_RESP || type == FR_REPLY;
}

int fr_frame_decode(const uint8_t in[FR_FRAME_BYTES], uint64_t max_payload, fr_frame *out) {
  uint32_t magic = fr_get_u32(in);
  if (magic != FR_WIRE_MAGIC)
    return fr_err(FERRY_EPROTO, "bad frame magic 0x%08x", magic);
  if (in[4] != FR_WIRE_VERSION)
    return fr_err(FERRY_EPROTO, "unsupported wire version %u (this build speaks %u)", in[4],
                  FR_WIRE_VERSION);
  fr_frame f = {
      .type = in[5],
      .flags = (uint16_t)(in[6] | in[7] << 8),
      .status = (int32_t)fr_get_u32(in + 8),
      .channel = fr_get_u32(in + 12),
      .req_id = fr_get_u64(in + 16),
      .len = fr_get_u64(in + 24),
  };
  if (f.type < FR_HELLO || f.type > FR_FRAME_TYPE_MAX)
    return fr_err(FERRY_EPROTO, "unknown frame type %u", f.type);
  if (f.flags != 0)
    return fr_err(FERRY_EPROTO, "frame type %u: unknown flags 0x%04x", f.type, f.flags);
  if (f.status > 0 || f.status < -1000 || (f.status != 0 && !is_response(f.type)))
    return fr_err(FERRY_EPROTO, "frame type %u: invalid status %d", f.type, f.status);
  bool channelled = f.type == FR_MSG || f.type == FR_CALL;
  if (channelled ? f.channel >= FERRY_MAX_CHANNELS : f.channel != 0)
    return fr_err(FERRY_EPROTO, "frame type %u: invalid channel %u", f.type, f.channel);
  int rc = check_length(&f, max_payload);
  if (rc != 0)
    return rc;
  *out = f;
  return 0;
}

/* A peer's node name, held to the one name rule (fr_name_check) before anything logs it. */
static int copy_name(char dst[FR_NAME_BYTES], const uint8_t *src) {
  if (!memchr(src, '\0', FR_NAME_BYTES))
    return fr_err(FERRY_EPROTO, "node name is not terminated");
  if (fr_name_check("node name", (const char *)src, FR_NAME_BYTES - 1) != 0)
    return fr_err_wrap(FERRY_EPROTO, "hello");
  memcpy(dst, src, FR_NAME_BYTES);
  return 0;
}

void fr_hello_encode(const fr_hello *h, uint8_t out[FR_HELLO_BYTES]) {
  memcpy(out, h->nonce, FR_NONCE_BYTES);
  memcpy(out + FR_NONCE_BYTES, h->name, FR_NAME_BYTES);
}

int fr_hello_decode(const uint8_t *in, size_t len, fr_hello *out) {
  if (len != FR_HELLO_BYTES)
    return fr_err(FERRY_EPROTO, "hello: %zu bytes", len);
  fr_hello h;
  memcpy(h.nonce, in, FR_NONCE_BYTES);
  int rc = copy_name(h.name, in + FR_NONCE_BYTES);
  if (rc == 0)
    *out = h;
  return rc;
}

void fr_hello_ack_encode(const fr_hello_ack *h, uint8_t out[FR_HELLO_ACK_BYTES]) {
  memcpy(out, h->nonce, FR_NONCE_BYTES);
  memcpy(out + FR_NONCE_BYTES, h->mac, FR_MAC_BYTES);
  memcpy(out + FR_NONCE_BYTES + FR_MAC_BYTES, h->name, FR_NAME_BYTES);
}

int fr_hello_ack_decode(const uint8_t *in, size_t len, fr_hello_ack *out) {
  if (len != FR_HELLO_ACK_BYTES)
    return fr_err(FERRY_EPROTO, "hello ack: %zu bytes", len);
  fr_hello_ack h;
  memcpy(h.nonce, in, FR_NONCE_BYTES);
  memcpy(h.mac, in + FR_NONCE_BYTES, FR_MAC_BYTES);
  int rc = copy_name(h.name, in + FR_NONCE_BYTES + FR_MAC_BYTES);
  if (rc == 0)
    *out = h;
  return rc;
}

void fr_auth_encode(const fr_auth *a, uint8_t out[FR_AUTH_BYTES]) {
  memcpy(out, a->mac, FR_MAC_BYTES);
  memcpy(out + FR_MAC_BYTES, a->proof, FR_NONCE_BYTES);
}

int fr_auth_decode(const uint8_t *in, size_t len, fr_auth *out) {
  if (len != FR_AUTH_BYTES)
    return fr_err(FERRY_EPROTO, "auth: %zu bytes", len);
  memcpy(out->mac, in, FR_MAC_BYTES);
  memcpy(out->proof, in + FR_MAC_BYTES, FR_NONCE_BYTES);
  return 0;
}

void fr_rma_encode(const fr_rma *r, uint8_t out[FR_RMA_BYTES]) {
  fr_put_u64(out, r->region);
  fr_put_u64(out + 8, r->key);
  fr_put_u64(out + 16, r->offset);
  fr_put_u64(out + 24, r->length);
}

int fr_rma_decode(const uint8_t *in, size_t len, fr_rma *out) {
  if (len < FR_RMA_BYTES)
    return fr_err(FERRY_EPROTO, "rma request: %zu bytes", len);
  fr_rma r = {fr_get_u64(in), fr_get_u64(in + 8), fr_get_u64(in + 16), fr_get_u64(in + 24)};
  if (r.offset + r.length < r.offset)
    return fr_err(FERRY_EPROTO, "rma request: offset %llu + length %llu overflows",
                  (unsigned long long)r.offset, (unsigned long long)r.length);
  *out = r;
  return 0;
}

void fr_readv_encode_head(uint64_t region, uint64_t key, uint32_t count,
                          uint8_t out[FR_READV_HEAD_BYTES]) {
  fr_put_u64(out, region);
  fr_put_u64(out + 8, key);
  fr_put_u32(out + 16, count);
  fr_put_u32(out + 20, 0);
}

void fr_readv_encode_run(const fr_rma_run *run, uint8_t out[FR_READV_RUN_BYTES]) {
  fr_put_u64(out, run->offset);
  fr_put_u64(out + 8, run->length);
}

int fr_readv_decode(const uint8_t *in, size_t len, fr_readv *head, fr_rma_run *runs) {
  if (len < FR_READV_HEAD_BYTES)
    return fr_err(FERRY_EPROTO, "readv request: %zu bytes", len);
  fr_readv h = {.region = fr_get_u64(in), .key = fr_get_u64(in + 8), .count = fr_get_u32(in + 16)};
  if (fr_get_u32(in + 20) != 0 || h.count == 0 || h.count > FR_READV_MAX_RUNS ||
      len != FR_READV_HEAD_BYTES + (size_t)h.count * FR_READV_RUN_BYTES)
    return fr_err(FERRY_EPROTO, "readv request: %u runs in %zu bytes", h.count, len);
  h.lo = UINT64_MAX;
  for (uint32_t i = 0; i < h.count; i++) {
    const uint8_t *p = in + FR_READV_HEAD_BYTES + (size_t)i * FR_READV_RUN_BYTES;
    fr_rma_run r = {fr_get_u64(p), fr_get_u64(p + 8)};
    if (r.length == 0 || r.offset + r.length < r.offset || h.total + r.length < h.total)
      return fr_err(FERRY_EPROTO, "readv request: run %u is empty or overflows", i);
    h.total += r.length;
    h.lo = r.offset < h.lo ? r.offset : h.lo;
    h.hi = r.offset + r.length > h.hi ? r.offset + r.length : h.hi;
    runs[i] = r;
  }
  *head = h;
  return 0;
}

void fr_map_encode(const fr_map *m, uint8_t out[FR_MAP_BYTES]) {
  fr_put_u64(out, m->region);
  fr_put_u64(out + 8, m->key);
}

int fr_map_decode(const uint8_t *in, size_t len, fr_map *out) {
  if (len != FR_MAP_BYTES)
    return fr_err(FERRY_EPROTO, "map request: %zu bytes", len);
  out->region = fr_get_u64(in);
  out->key = fr_get_u64(in + 8);
  return 0;
}

void fr_cuda_ipc_encode(const fr_cuda_ipc *h, uint8_t out[FR_MAP_RESP_CUDA_BYTES - 8]) {
  memcpy(out, h->handle, sizeof h->handle);
  fr_put_u64(out + 64, h->offset);
  fr_put_u64(out + 72, h->alloc_bytes);
  fr_put_u32(out + 80, (uint32_t)h->device);
  fr_put_u32(out + 84, 0);
}

void fr_cuda_ipc_decode(const uint8_t in[FR_MAP_RESP_CUDA_BYTES - 8], fr_cuda_ipc *h) {
  memset(h, 0, sizeof *h);
  memcpy(h->handle, in, sizeof h->handle);
  h->offset = fr_get_u64(in + 64);
  h->alloc_bytes = fr_get_u64(in + 72);
  h->device = (int32_t)fr_get_u32(in + 80);
}
