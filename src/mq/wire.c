/*
 * The mq wire format: frames that ride in ferry messages on FR_CHANNEL_MQ. A frame is a fixed
 * 48-byte little-endian head, then (by type and flags) a tensor header, a shared-memory
 * reference, the topic with its NUL, padding to a multiple of 64, and an inline payload:
 *
 *   off size field
 *    0   4   magic "FMQ1"
 *    4   1   version (1)
 *    5   1   type (fr_mq_type)
 *    6   1   flags (FR_MQ_F_TENSOR; only on DATA/SHM)
 *    7   1   reserved, 0
 *    8   2   topic bytes (DATA, SHM, SUB, UNSUB: 1..FERRY_MQ_TOPIC_MAX; else 0)
 *   10   2   reserved, 0
 *   12   4   releases (CREDIT: count of u64 tokens after the head; else 0)
 *   16   8   seq (DATA/SHM)
 *   24   8   payload bytes (DATA/SHM)
 *   32   8   value (DATA/SHM: credit charged; SUB: window; CREDIT: bytes consumed so far)
 *   40   8   payload offset (DATA: where the payload starts; BATCH: 64; else the frame's length)
 *   48  72   tensor header (FR_MQ_F_TENSOR): u32 dtype, u32 ndim, 8 x u64 shape
 *   ..  40   SHM: region id, key, size, offset of the payload in it, pool token
 *   ..       topic, NUL
 *
 * A BATCH frame (payload bytes = what follows its 64-byte head) carries DATA frames back to back,
 * each starting at a multiple of 64 from the batch's start, zeros between them, the last one
 * ending the frame: a publisher streaming small messages sends many per link write.
 *
 * fr_mq_decode() is pure and checks every field before anything is trusted (fuzz/mq_fuzz.c).
 */
#include "mq/mq.h"

#include <string.h>

/* Little-endian fields; on a little-endian host each is one load or store. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint16_t get16(const uint8_t *p) {
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
}
static uint32_t get32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}
static uint64_t get64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}
#else
static void put16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get64(const uint8_t *p) {
  return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}
#endif

#define VALUE_AT 32 /* the head's `value` field */

void fr_mq_set_value(uint8_t *head, uint64_t value) { put64(head + VALUE_AT, value); }

int fr_mq_topic_check(const char *topic) {
  return fr_name_ok(topic, FERRY_MQ_TOPIC_MAX)
             ? 0
             : fr_name_check("mq: topic", topic, FERRY_MQ_TOPIC_MAX);
}

static bool has_topic(uint8_t type) { return type >= FR_MQ_DATA && type <= FR_MQ_UNSUB; }
static bool is_message(uint8_t type) { return type == FR_MQ_DATA || type == FR_MQ_SHM; }
static bool has_payload(uint8_t type) { return is_message(type) || type == FR_MQ_BATCH; }

/* Bytes of the head through the topic's NUL, before padding. */
static size_t head_bytes(uint8_t type, uint8_t flags, size_t topic_len) {
  size_t n = FR_MQ_HEAD_BYTES;
  if (flags & FR_MQ_F_TENSOR)
    n += FR_MQ_TENSOR_BYTES;
  if (type == FR_MQ_SHM)
    n += FR_MQ_SHM_BYTES;
  if (has_topic(type))
    n += topic_len + 1;
  return n;
}

static size_t align_up(size_t n) { return (n + FR_MQ_ALIGN - 1) / FR_MQ_ALIGN * FR_MQ_ALIGN; }

size_t fr_mq_encode(const fr_mq_frame *f, uint8_t *buf) {
  size_t tl = has_topic(f->type) && f->topic ? f->topic_len : 0;
  size_t n = head_bytes(f->type, f->flags, tl);
  size_t total = f->type == FR_MQ_DATA || f->type == FR_MQ_BATCH ? align_up(n) : n;
  memset(buf, 0, total);
  put32(buf, FR_MQ_MAGIC);
  buf[4] = FR_MQ_VERSION;
  buf[5] = f->type;
  buf[6] = f->flags;
  put16(buf + 8, (uint16_t)tl);
  put32(buf + 12, f->type == FR_MQ_CREDIT ? f->nrelease : 0);
  put64(buf + 16, f->seq);
  put64(buf + 24, f->len);
  put64(buf + VALUE_AT, f->value);
  put64(buf + 40, total + (f->type == FR_MQ_CREDIT ? (uint64_t)f->nrelease * 8 : 0));
  uint8_t *p = buf + FR_MQ_HEAD_BYTES;
  if (f->flags & FR_MQ_F_TENSOR) {
    put32(p, (uint32_t)f->desc.dtype);
    put32(p + 4, f->desc.ndim);
    for (uint32_t i = 0; i < f->desc.ndim && i < FERRY_MAX_DIMS; i++)
      put64(p + 8 + 8 * i, f->desc.shape[i]);
    p += FR_MQ_TENSOR_BYTES;
  }
  if (f->type == FR_MQ_SHM) {
    put64(p, f->ref.id);
    put64(p + 8, f->ref.key);
    put64(p + 16, f->ref.size);
    put64(p + 24, f->offset);
    put64(p + 32, f->token);
    p += FR_MQ_SHM_BYTES;
  }
  if (tl)
    memcpy(p, f->topic, tl); /* the NUL and the padding are the memset's */
  return total;
}

static int bad(size_t len, const char *why) {
  return fr_err(FERRY_EPROTO, "mq: malformed frame of %zu bytes: %s", len, why);
}

static int decode_tensor(const uint8_t *p, fr_mq_frame *f) {
  f->desc.dtype = (ferry_dtype)get32(p);
  f->desc.ndim = get32(p + 4);
  if (f->desc.ndim > FERRY_MAX_DIMS)
    return -1;
  for (uint32_t i = 0; i < FERRY_MAX_DIMS; i++) {
    uint64_t v = get64(p + 8 + 8 * i);
    if (i >= f->desc.ndim && v != 0)
      return -1; /* one encoding per tensor header */
    f->desc.shape[i] = i < f->desc.ndim ? v : 0;
  }
  uint64_t nb;
  return ferry_tensor_nbytes(&f->desc, &nb) == 0 && nb == f->len ? 0 : -1;
}

static int decode_topic(const uint8_t *p, size_t tl, fr_mq_frame *f) {
  if (tl == 0 || tl > FERRY_MQ_TOPIC_MAX || p[tl] != 0 || memchr(p, 0, tl) ||
      !fr_name_ok((const char *)p, FERRY_MQ_TOPIC_MAX))
    return -1; /* the one name rule (core.h) */
  f->topic = (const char *)p;
  f->topic_len = tl;
  return 0;
}

/* The fields after the head, for a frame whose head checked out. */
static int decode_body(const uint8_t *b, size_t len, size_t tl, size_t off, fr_mq_frame *f) {
  const uint8_t *p = b + FR_MQ_HEAD_BYTES;
  if ((f->flags & FR_MQ_F_TENSOR) && decode_tensor(p, f) != 0)
    return bad(len, "bad tensor header");
  if (f->flags & FR_MQ_F_TENSOR)
    p += FR_MQ_TENSOR_BYTES;
  if (f->type == FR_MQ_SHM) {
    f->ref = (ferry_region_ref){get64(p), get64(p + 8), get64(p + 16)};
    f->offset = get64(p + 24);
    f->token = get64(p + 32);
    p += FR_MQ_SHM_BYTES;
    if (!fr_range_ok(f->offset, f->len, f->ref.size) || f->token == 0)
      return bad(len, "shared-memory payload outside its region");
  }
  if (has_topic(f->type) && decode_topic(p, tl, f) != 0)
    return bad(len, "bad topic");
  if (f->type == FR_MQ_DATA || f->type == FR_MQ_BATCH) {
    for (size_t i = head_bytes(f->type, f->flags, tl); i < off; i++)
      if (b[i] != 0)
        return bad(len, "padding is not zero");
    f->payload = b + off;
  }
  if (f->type == FR_MQ_CREDIT)
    f->releases = b + FR_MQ_HEAD_BYTES;
  return 0;
}

/* The fields decode_body sets only when the frame has them, zeroed field by field: a memset of
 * the whole frame (a `rep stos`) cost half of decoding a small message. */
static void clear_body(fr_mq_frame *f) {
  f->topic = NULL;
  f->topic_len = 0;
  f->desc.dtype = 0;
  f->desc.ndim = 0;
  for (int i = 0; i < FERRY_MAX_DIMS; i++)
    f->desc.shape[i] = 0;
  f->ref = (ferry_region_ref){0};
  f->offset = f->token = 0;
  f->payload = f->releases = NULL;
}

int fr_mq_decode(const void *data, size_t len, fr_mq_frame *out) {
  const uint8_t *b = data;
  if (!b || len < FR_MQ_HEAD_BYTES)
    return bad(len, "shorter than its head");
  fr_mq_frame *f = out; /* written in place: on failure its contents mean nothing */
  clear_body(f);
  f->type = b[5];
  f->flags = b[6];
  size_t tl = get16(b + 8);
  f->nrelease = get32(b + 12);
  f->seq = get64(b + 16);
  f->len = get64(b + 24);
  f->value = get64(b + VALUE_AT);
  uint64_t off = get64(b + 40);
  if (get32(b) != FR_MQ_MAGIC || b[4] != FR_MQ_VERSION || b[7] != 0 || get16(b + 10) != 0)
    return bad(len, "bad magic, version or reserved bytes");
  if (f->type < FR_MQ_DATA || f->type > FR_MQ_TYPE_MAX || (f->flags & ~FR_MQ_F_TENSOR) ||
      (f->flags && !is_message(f->type)))
    return bad(len, "bad type or flags");
  if ((has_topic(f->type) ? tl == 0 : tl != 0) ||
      (f->type == FR_MQ_CREDIT ? f->nrelease > FR_MQ_MAX_RELEASES : f->nrelease != 0) ||
      (!is_message(f->type) && f->seq) || (!has_payload(f->type) && f->len))
    return bad(len, "fields that do not belong to its type");
  size_t need = head_bytes(f->type, f->flags, tl);
  if (f->type == FR_MQ_CREDIT)
    need += (size_t)f->nrelease * 8;
  if (f->type == FR_MQ_DATA || f->type == FR_MQ_BATCH) {
    if (off != align_up(need) || off > len || len - off != f->len ||
        (f->type == FR_MQ_BATCH && !f->len))
      return bad(len, "payload offset or length does not match the frame");
  } else if (off != len || len != need) {
    return bad(len, "length does not match its fields");
  }
  return decode_body(b, len, tl, (size_t)off, f);
}

int fr_mq_batch_next(const fr_mq_frame *batch, size_t *pos, fr_mq_frame *out) {
  const uint8_t *b = batch->payload - FR_MQ_ALIGN; /* the batch frame's first byte */
  size_t end = FR_MQ_ALIGN + (size_t)batch->len;
  if (*pos == 0)
    *pos = FR_MQ_ALIGN;
  if (*pos >= end)
    return 0;
  if (end - *pos < FR_MQ_HEAD_BYTES)
    return bad(end, "batch: a frame's head is cut");
  uint64_t sub_len = get64(b + *pos + 24), sub_off = get64(b + *pos + 40);
  if (sub_off > end - *pos || sub_len > end - *pos - sub_off)
    return bad(end, "batch: a frame runs past the batch");
  size_t n = (size_t)(sub_off + sub_len);
  int rc = fr_mq_decode(b + *pos, n, out);
  if (rc == 0 && out->type != FR_MQ_DATA)
    rc = bad(end, "batch: only inline messages may be batched");
  if (rc != 0)
    return rc;
  size_t next = *pos + n;
  if (next < end) { /* zeros up to the next frame, which starts at a multiple of 64 */
    size_t aligned = align_up(next);
    if (aligned >= end)
      return bad(end, "batch: padding at its end");
    for (size_t i = next; i < aligned; i++)
      if (b[i] != 0)
        return bad(end, "batch: padding is not zero");
    next = aligned;
  }
  *pos = next;
  return 1;
}
