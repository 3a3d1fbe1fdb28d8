/*
 * The byte format of directory records and of the embedded directory's messages: little-endian
 * integers, strings as a u16 length and bytes. Writers grow a buffer; readers are bounds-checked
 * cursors that fail closed (a failed reader returns zeros and stays failed), so a decoder can
 * read a whole message and check once at the end. Everything here is pure (fuzzed).
 */
#ifndef FR_DIRWIRE_H
#define FR_DIRWIRE_H

#include "directory/directory.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define FR_DIRWIRE_MAGIC 0x31524446u /* "FDR1" */

enum fr_dir_op {
  FR_DOP_HELLO = 1,     /* -> u64 instance, str address */
  FR_DOP_NODE_PUT,      /* node, u32 lease_ms, u64 takeover -> u8 taken, [node, u32 lease left] */
  FR_DOP_NODE_RENEW,    /* str name, u64 incarnation, u32 lease_ms */
  FR_DOP_NODE_GET,      /* str name -> node */
  FR_DOP_NODE_LIST,     /* -> u32 n, n nodes */
  FR_DOP_NODE_DEL,      /* str name, u64 incarnation */
  FR_DOP_OBJ_PUT,       /* u32 flags, object -> u8 had_other, [object] */
  FR_DOP_OBJ_GET,       /* u32 n, n str keys -> n (i32 status, [object]) */
  FR_DOP_OBJ_DEL,       /* str key, str owner, u64 generation -> object */
  FR_DOP_OBJ_SCAN,      /* str prefix, str after, u32 limit -> u32 n, n objects, u8 more */
  FR_DOP_OBJ_PUT_BATCH, /* u32 flags, u32 n, n objects -> n (i32 status, [u8 other, [object]]) */
  FR_DOP_POSTED,        /* u64 sent_ns, u16 op (OBJ_PUT or OBJ_PUT_BATCH), its arguments -> its
                           reply. A put whose sender returned before the answer (server.c) */
  FR_DOP_WATCH,         /* -> region ref (u64 id, u64 key, u64 size), u32 buckets: the change
                           words (server.c); region ref, u32 slots, u32 slot bytes: the object
                           table (table.h) */
  FR_DOP_NODE_RENEW_BATCH, /* u32 n, n (str name, u64 incarnation, u32 lease_ms) -> n i32 status */
  FR_DOP_MAX_
};

/* A posted put rings no doorbell (but a client's 12th unanswered one, client_posted.c POSTED_RING):
 * waking the embedded server from the put would cost its caller the server's whole turn
 * (measured: the paced in-place put 34 -> 82 us, docs/PERFORMANCE.md "Paced latency"). The
 * server takes it in with the next message from anyone (every request drains the posts first,
 * server.c), or at its next look at the leases (once a second) at the latest; readers on its
 * host see the record at once in the shared table (table.h). Its answer rings nobody either:
 * the client collects it at its next put, its lease renewal, or when it waits for it
 * (fr_dir_settle, which rings). Neither side looks for the other on a timer of its own
 * (server.c, client_posted.c). */

/* The change words, in a region of the server's (FR_DOP_WATCH): word 0 counts changes of many
 * keys at once (a node and its records dropped), word 1 + b changes of the keys in bucket b. */
#define FR_DIR_WATCH_BUCKETS 4096u
static inline uint32_t fr_dir_watch_bucket(const char *key, uint32_t buckets) {
  return fr_dir_key_hash(key) % buckets;
}

typedef struct fr_wr {
  uint8_t *p;
  size_t len, cap;
  bool failed;   /* out of memory */
  bool borrowed; /* p is the caller's array (FR_WR_ON): never reallocated nor freed */
} fr_wr;
/* A writer that starts in the caller's array `buf` and moves to the heap only when it outgrows
 * it: a put writes its record twice (its post, the shared table's slot), and the writers'
 * mallocs, reallocs and frees were a tenth of its instructions. fr_wr_free it as any other; its
 * bytes are at p (buf until it moved). */
#define FR_WR_ON(buf) ((fr_wr){.p = (buf), .cap = sizeof(buf), .borrowed = true})

void fr_wr_u8(fr_wr *w, uint8_t v);
void fr_wr_u16(fr_wr *w, uint16_t v);
void fr_wr_u32(fr_wr *w, uint32_t v);
void fr_wr_u64(fr_wr *w, uint64_t v);
void fr_wr_bytes(fr_wr *w, const void *p, size_t n);
void fr_wr_str(fr_wr *w, const char *s); /* at most 65535 bytes */
void fr_wr_node(fr_wr *w, const fr_dir_node *n);
/* The most bytes fr_wr_object writes: the longest key and owner, two region refs, four u64s,
 * dtype and rank, every dimension. */
#define FR_DIR_OBJECT_WIRE_MAX                                                                     \
  (2 + FR_DIR_KEY_MAX + 2 + FR_DIR_NAME_MAX + 2 * 24 + 4 * 8 + 2 * 4 + 8 * FERRY_MAX_DIMS)
void fr_wr_object(fr_wr *w, const fr_dir_object *o);
/* Request and reply headers. */
void fr_wr_request(fr_wr *w, uint16_t op);
void fr_wr_reply(fr_wr *w, int status, const char *detail);
void fr_wr_free(fr_wr *w);

typedef struct fr_rd {
  const uint8_t *p;
  size_t len, pos;
  bool failed;
} fr_rd;

static inline fr_rd fr_rd_init(const void *p, size_t len) { return (fr_rd){.p = p, .len = len}; }
uint8_t fr_rd_u8(fr_rd *r);
uint16_t fr_rd_u16(fr_rd *r);
uint32_t fr_rd_u32(fr_rd *r);
uint64_t fr_rd_u64(fr_rd *r);
/* Copies a string of at most cap-1 bytes with no NUL inside; fails otherwise. */
bool fr_rd_str(fr_rd *r, char *out, size_t cap);
/* A pointer to the next n bytes (NULL and failed when fewer remain). */
const uint8_t *fr_rd_bytes(fr_rd *r, size_t n);
/* Records, validated: names and keys well-formed, dtype and shape consistent with bytes. */
bool fr_rd_node(fr_rd *r, fr_dir_node *out);
bool fr_rd_object(fr_rd *r, fr_dir_object *out);
/* Headers: the request's op (0 when malformed); the reply's status and detail. */
uint16_t fr_rd_request(fr_rd *r);
bool fr_rd_reply(fr_rd *r, int *status, char *detail, size_t cap);
/* True when the reader consumed exactly all bytes without failing. */
static inline bool fr_rd_done(const fr_rd *r) { return !r->failed && r->pos == r->len; }

#endif
