/*
 * Encoders and decoders for directory records and messages (see dirwire.h). Decoders trust
 * nothing: every length is checked against what is left, strings must fit their destination and
 * contain no NUL, records must be self-consistent. The embedded server, its client, the Redis
 * backend and the store's service messages all use these.
 */
#include "directory/dirwire.h"
#include "core/region.h"

#include <stdlib.h>
#include <string.h>

/* Moves a borrowed writer's bytes to the heap, with room for n more. */
static bool wr_unborrow(fr_wr *w, size_t n) {
  size_t cap = w->cap * 2 > w->len + n ? w->cap * 2 : w->len + n;
  uint8_t *heap = malloc(cap);
  if (!heap)
    return false;
  memcpy(heap, w->p, w->len);
  *w = (fr_wr){.p = heap, .len = w->len, .cap = cap};
  return true;
}

static bool wr_grow(fr_wr *w, size_t n) {
  if (w->failed)
    return false;
  if (w->borrowed ? !wr_unborrow(w, n) : FR_GROW(w->p, w->cap, w->len + n, 256) != 0) {
    w->failed = true;
    return false;
  }
  return true;
}

/* Room for n more bytes; false once out of memory (failed: nothing more is written). */
static inline bool wr_reserve(fr_wr *w, size_t n) {
  return (!w->failed && w->len + n <= w->cap) || wr_grow(w, n);
}

void fr_wr_bytes(fr_wr *w, const void *p, size_t n) {
  if (n && wr_reserve(w, n)) {
    memcpy(w->p + w->len, p, n);
    w->len += n;
  }
}

/* Little-endian whatever the host: one store on a little-endian one (inlined with a constant
 * `bytes`), byte by byte elsewhere. */
static inline void wr_le(fr_wr *w, uint64_t v, int bytes) {
  if (!wr_reserve(w, (size_t)bytes))
    return;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  memcpy(w->p + w->len, &v, (size_t)bytes);
  w->len += (size_t)bytes;
#else
  for (int i = 0; i < bytes; i++)
    w->p[w->len++] = (uint8_t)(v >> (8 * i));
#endif
}

void fr_wr_u8(fr_wr *w, uint8_t v) { wr_le(w, v, 1); }
void fr_wr_u16(fr_wr *w, uint16_t v) { wr_le(w, v, 2); }
void fr_wr_u32(fr_wr *w, uint32_t v) { wr_le(w, v, 4); }
void fr_wr_u64(fr_wr *w, uint64_t v) { wr_le(w, v, 8); }

void fr_wr_str(fr_wr *w, const char *s) {
  size_t n = s ? strlen(s) : 0;
  if (n > UINT16_MAX)
    n = UINT16_MAX;
  fr_wr_u16(w, (uint16_t)n);
  fr_wr_bytes(w, s, n);
}

void fr_wr_node(fr_wr *w, const fr_dir_node *n) {
  fr_wr_str(w, n->name);
  fr_wr_str(w, n->address);
  fr_wr_u32(w, n->flags);
  fr_wr_u64(w, n->incarnation);
  uint16_t acc = n->access_len <= FR_DIR_ACCESS_MAX ? n->access_len : 0;
  fr_wr_u16(w, acc);
  fr_wr_bytes(w, n->access, acc);
}

static void wr_ref(fr_wr *w, const ferry_region_ref *r) {
  fr_wr_u64(w, r->id);
  fr_wr_u64(w, r->key);
  fr_wr_u64(w, r->size);
}

void fr_wr_object(fr_wr *w, const fr_dir_object *o) {
  fr_wr_str(w, o->key);
  fr_wr_str(w, o->owner);
  wr_ref(w, &o->region);
  fr_wr_u64(w, o->offset);
  fr_wr_u64(w, o->bytes);
  wr_ref(w, &o->gen_region);
  fr_wr_u64(w, o->gen_offset);
  fr_wr_u64(w, o->generation);
  fr_wr_u32(w, (uint32_t)o->desc.dtype);
  uint32_t nd = o->desc.ndim <= FERRY_MAX_DIMS ? o->desc.ndim : FERRY_MAX_DIMS;
  fr_wr_u32(w, nd);
  for (uint32_t i = 0; i < nd; i++)
    fr_wr_u64(w, o->desc.shape[i]);
}

void fr_wr_request(fr_wr *w, uint16_t op) {
  fr_wr_u32(w, FR_DIRWIRE_MAGIC);
  fr_wr_u16(w, op);
  fr_wr_u16(w, 0);
}

void fr_wr_reply(fr_wr *w, int status, const char *detail) {
  fr_wr_u32(w, FR_DIRWIRE_MAGIC);
  fr_wr_u32(w, (uint32_t)status);
  fr_wr_str(w, status ? detail : "");
}

void fr_wr_free(fr_wr *w) {
  if (!w->borrowed)
    free(w->p);
  *w = (fr_wr){0};
}

/* ---- readers ---- */

const uint8_t *fr_rd_bytes(fr_rd *r, size_t n) {
  if (r->failed || n > r->len - r->pos) {
    r->failed = true;
    return NULL;
  }
  const uint8_t *p = r->p + r->pos;
  r->pos += n;
  return p;
}

static inline uint64_t rd_le(fr_rd *r, int bytes) {
  const uint8_t *b = fr_rd_bytes(r, (size_t)bytes);
  uint64_t v = 0;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  if (b)
    memcpy(&v, b, (size_t)bytes);
#else
  for (int i = 0; b && i < bytes; i++)
    v |= (uint64_t)b[i] << (8 * i);
#endif
  return v;
}

uint8_t fr_rd_u8(fr_rd *r) { return (uint8_t)rd_le(r, 1); }
uint16_t fr_rd_u16(fr_rd *r) { return (uint16_t)rd_le(r, 2); }
uint32_t fr_rd_u32(fr_rd *r) { return (uint32_t)rd_le(r, 4); }
uint64_t fr_rd_u64(fr_rd *r) { return rd_le(r, 8); }

bool fr_rd_str(fr_rd *r, char *out, size_t cap) {
  uint16_t n = fr_rd_u16(r);
  const uint8_t *b = fr_rd_bytes(r, n);
  if (!b || (size_t)n >= cap || memchr(b, '\0', n)) {
    r->failed = true;
    if (cap)
      out[0] = '\0';
    return false;
  }
  memcpy(out, b, n);
  out[n] = '\0';
  return true;
}

/* A node name a peer sent: the one name rule (core.h), and no ',' (address lists use it). */
static bool name_ok(const char *s) { return fr_name_ok(s, FR_DIR_NAME_MAX) && !strchr(s, ','); }

bool fr_rd_node(fr_rd *r, fr_dir_node *out) {
  fr_dir_node n;
  fr_rd_str(r, n.name, sizeof n.name);
  fr_rd_str(r, n.address, sizeof n.address);
  n.flags = fr_rd_u32(r);
  n.incarnation = fr_rd_u64(r);
  n.access_len = fr_rd_u16(r);
  const uint8_t *acc = n.access_len <= FR_DIR_ACCESS_MAX ? fr_rd_bytes(r, n.access_len) : NULL;
  if (acc)
    memcpy(n.access, acc, n.access_len);
  else
    r->failed = true;
  if (r->failed || !n.name[0] || !name_ok(n.name)) {
    r->failed = true;
    return false;
  }
  *out = n;
  return true;
}

static void rd_ref(fr_rd *r, ferry_region_ref *out) {
  out->id = fr_rd_u64(r);
  out->key = fr_rd_u64(r);
  out->size = fr_rd_u64(r);
}

/* A record must describe bytes that lie inside its regions and match its dtype and shape. */
static bool object_consistent(const fr_dir_object *o) {
  uint64_t nb;
  if (fr_dir_key_check(o->key, "record") != 0 || !o->owner[0] || !name_ok(o->owner))
    return false;
  if (ferry_tensor_nbytes(&o->desc, &nb) != 0 || nb != o->bytes || o->generation == 0)
    return false;
  return fr_range_ok(o->offset, o->bytes, o->region.size) &&
         fr_range_ok(o->gen_offset, 8, o->gen_region.size) && o->gen_offset % 8 == 0;
}

bool fr_rd_object(fr_rd *r, fr_dir_object *out) {
  fr_dir_object o;
  memset(&o, 0, sizeof o);
  fr_rd_str(r, o.key, sizeof o.key);
  fr_rd_str(r, o.owner, sizeof o.owner);
  rd_ref(r, &o.region);
  o.offset = fr_rd_u64(r);
  o.bytes = fr_rd_u64(r);
  rd_ref(r, &o.gen_region);
  o.gen_offset = fr_rd_u64(r);
  o.generation = fr_rd_u64(r);
  o.desc.dtype = (ferry_dtype)fr_rd_u32(r);
  o.desc.ndim = fr_rd_u32(r);
  if (o.desc.ndim > FERRY_MAX_DIMS)
    r->failed = true;
  for (uint32_t i = 0; !r->failed && i < o.desc.ndim; i++)
    o.desc.shape[i] = fr_rd_u64(r);
  if (r->failed || !object_consistent(&o)) {
    fr_err_clear();
    r->failed = true;
    return false;
  }
  *out = o;
  return true;
}

uint16_t fr_rd_request(fr_rd *r) {
  uint32_t magic = fr_rd_u32(r);
  uint16_t op = fr_rd_u16(r);
  fr_rd_u16(r);
  if (r->failed || magic != FR_DIRWIRE_MAGIC || op == 0 || op >= FR_DOP_MAX_) {
    r->failed = true;
    return 0;
  }
  return op;
}

bool fr_rd_reply(fr_rd *r, int *status, char *detail, size_t cap) {
  uint32_t magic = fr_rd_u32(r);
  int32_t st = (int32_t)fr_rd_u32(r);
  fr_rd_str(r, detail, cap);
  if (r->failed || magic != FR_DIRWIRE_MAGIC || st > 0 || st < -1000) {
    r->failed = true;
    return false;
  }
  *status = st;
  return true;
}
