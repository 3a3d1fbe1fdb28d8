/*
 * What the etcd backend's parts share (etcd.c: the operations; etcd_client.c: requests to the
 * cluster and the gateway's JSON; etcd_http.c: the HTTP under them): the client's state, the
 * cluster's members and which one calls go to.
 */
#ifndef FR_DIRECTORY_ETCD_H
#define FR_DIRECTORY_ETCD_H

#include "directory/directory.h"
#include "directory/etcd_http.h"

#include <jansson.h>
#include <pthread.h>

typedef struct fr_etcd_members {
  fr_etcd_url u;
  char shown[FR_DIR_ADDRESS_MAX + 1]; /* the URL as messages name it */
  int current;                        /* atomic: the member calls go to */
} fr_etcd_members;

#define FR_ETCD_LEASE_CACHE 32  /* nodes whose lease a client remembers */
#define FR_ETCD_TXN_OPS 128     /* etcd's --max-txn-ops default */
#define FR_ETCD_PAGE 1000       /* keys per range page */
#define FR_ETCD_RECORD_MAX 2048 /* bytes of one record's value */
#define FR_ETCD_KEY_BYTES (FR_DIR_KEY_MAX + FR_DIR_NS_MAX + 16)
#define FR_ETCD_TRY_MS 1000 /* the longest one member may keep a call (of several members) */

/* A connection of the client's own, one call on it at a time. Calls (FR_ETCD_CALLS) take the
 * first of FR_ETCD_CALL_LANES that is free, dialled when first needed, so that a call held for
 * its whole timeout (a member that stopped answering, an election) does not make the other
 * threads' calls wait behind it; lease renewals (FR_ETCD_RENEWALS) have one of their own, so that
 * no call makes a renewal wait and miss its lease. */
typedef struct fr_etcd_lane {
  pthread_mutex_t lock; /* conn, member */
  fr_http conn;
  int member; /* the member conn is to (-1: none) */
} fr_etcd_lane;

#define FR_ETCD_CALL_LANES 4
enum { FR_ETCD_CALLS = 0, FR_ETCD_RENEWALS = FR_ETCD_CALL_LANES, FR_ETCD_LANES };

typedef struct fr_etcd {
  fr_etcd_members m;
  fr_etcd_lane lane[FR_ETCD_LANES];
  unsigned next_lane; /* atomic: the call lane a call waits for first when every one is busy */
  uint64_t cluster;   /* atomic: the cluster id answers carry (0: none seen yet) */
  uint64_t epoch;     /* atomic: bumped when another cluster answers */
  int64_t seen_rev;   /* atomic: the highest revision an answer's header carried */
  char prefix[FR_DIR_NS_MAX + 8]; /* "ferry/" or "ferry@NS/" */
  size_t prefix_len;
  pthread_mutex_t cache_lock;
  struct {
    char name[FR_DIR_NAME_MAX + 1];
    uint64_t incarnation;
    int64_t lease;
  } leases[FR_ETCD_LEASE_CACHE];
  unsigned next_slot;
} fr_etcd;

/* ---- requests (etcd_client.c) ---- */
/* POSTs req (taken) to path within the deadline, member after member while they do not answer
 * (timeout_ms only words the error). *out: the answer. FERRY_ETIMEDOUT (the last member's words
 * in the detail), FERRY_ECONNECT (every member refused), FERRY_EPROTO (an error answer no other
 * member would change). */
int fr_etcd_call_until(fr_etcd *e, const char *path, json_t *req, json_t **out, uint64_t deadline,
                       int timeout_ms);
/* The same on a lane of the client's (FR_ETCD_CALLS or FR_ETCD_RENEWALS). */
int fr_etcd_call_on(fr_etcd *e, int lane, const char *path, json_t *req, json_t **out,
                    uint64_t deadline, int timeout_ms);
void fr_etcd_lanes_init(fr_etcd *e);
void fr_etcd_lanes_close(fr_etcd *e);
/* A stream's message: its "result" (*body, borrowed from j), or FERRY_EPROTO for its error. */
int fr_etcd_unwrap(fr_etcd *e, json_t *j, const char *path, json_t **body);
int fr_etcd_malformed(fr_etcd *e, const char *what);

/* JSON fields: bytes in base64, int64s as strings (absent: 0). The getters return false for a
 * field that is there and not well-formed. */
void fr_etcd_set_b64(json_t *obj, const char *field, const void *p, size_t n);
void fr_etcd_set_i64(json_t *obj, const char *field, int64_t v);
bool fr_etcd_get_i64(const json_t *obj, const char *field, int64_t *out);
bool fr_etcd_get_bytes(const json_t *obj, const char *field, uint8_t *out, size_t cap, size_t *n);
bool fr_etcd_get_bool(const json_t *obj, const char *field);
json_t *fr_etcd_with_key(json_t *obj, const char *key, size_t n); /* obj["key"], returns obj */

/* The etcd key of a node ('n') or object ('o') name (out: FR_ETCD_KEY_BYTES): its length. */
size_t fr_etcd_key_of(const fr_etcd *e, char kind, const char *name, char *out);
/* etcd's range_end for every key that starts with p[0..n): its length (0: to the end). */
size_t fr_etcd_prefix_end(const char *p, size_t n, char *out);

/* One key-value of an answer. */
typedef struct fr_etcd_kv {
  bool found;
  uint8_t val[FR_ETCD_RECORD_MAX];
  size_t len;
  int64_t lease, mod;
} fr_etcd_kv;
bool fr_etcd_kv_read(const json_t *j, fr_etcd_kv *out);
/* The first kv of a range answer (out->found false when none); false when malformed. */
bool fr_etcd_range_kv(const json_t *range, fr_etcd_kv *out);
/* The record a kv holds, checked (and its name or key, when not NULL, the one it is stored
 * under): a peer wrote it. */
bool fr_etcd_node_of(const fr_etcd_kv *v, const char *name, fr_dir_node *out);
bool fr_etcd_object_of(const fr_etcd_kv *v, const char *key, fr_dir_object *out);
/* A range of one key (on the calls' lane; _on: on `lane`). */
int fr_etcd_get_key(fr_etcd *e, const char *key, fr_etcd_kv *v, uint64_t deadline, int timeout_ms);
int fr_etcd_get_key_on(fr_etcd *e, int lane, const char *key, fr_etcd_kv *v, uint64_t deadline,
                       int timeout_ms);

/* Leases: /v3/lease/keepalive and /timetolive on `lane` (*ttl in seconds, 0 or less: gone),
 * grant (TTL lease_ms rounded up to seconds), revoke (a lease already gone is no failure). */
int fr_etcd_lease_call(fr_etcd *e, int lane, const char *path, int64_t id, int64_t *ttl,
                       uint64_t deadline, int timeout_ms);
int fr_etcd_lease_grant(fr_etcd *e, int lease_ms, int64_t *id, uint64_t deadline, int timeout_ms);
int fr_etcd_lease_revoke(fr_etcd *e, int64_t id, uint64_t deadline, int timeout_ms);
/* The cache of node name -> (incarnation, the lease its records are bound to): the lease of name
 * as held by incarnation (0: by whoever), 0 when not known. */
int64_t fr_etcd_lease_cached(fr_etcd *e, const char *name, uint64_t incarnation);
void fr_etcd_lease_remember(fr_etcd *e, const char *name, uint64_t incarnation, int64_t lease);
void fr_etcd_lease_forget(fr_etcd *e, const char *name);

/* A txn: compare, then success or failure ops (each array taken; failure may be NULL). *ok: it
 * succeeded; *responses: its responses (borrowed from *j, which the caller frees). */
json_t *fr_etcd_cmp(const char *key, size_t n, const char *target, const char *field, int64_t v);
/* The key not modified since the latest revision this client saw (absent counts as unmodified): a
 * put that carries it, sent again to another member or left with a stopped one that runs it
 * late, can never replace a record written after it was sent (that one's revision is newer). */
json_t *fr_etcd_cmp_unchanged(fr_etcd *e, const char *key, size_t n);
/* An object key's delete marker: PREFIX d/XX, one of FR_ETCD_MARKERS keys picked by a hash of
 * the object's name. Every delete of an object puts its marker in the txn that deletes it (a
 * delete that found nothing to delete puts it alone), and every put of an object compares it
 * unchanged too (fr_etcd_cmp_marker): an absent key compares as unmodified, so without it a put
 * left with a stopped member, run late, would bring back a key deleted since it was sent. A
 * delete of another key of the same marker makes a put sent before it fail its compare once (it
 * is sent again, knowing the newer revision). */
#define FR_ETCD_MARKERS 256
json_t *fr_etcd_cmp_marker(fr_etcd *e, const char *name);
json_t *fr_etcd_op_mark(fr_etcd *e, const char *name);
json_t *fr_etcd_op_range(const char *key, size_t n);
json_t *fr_etcd_op_put(const char *key, size_t n, const void *val, size_t vn, int64_t lease);
json_t *fr_etcd_op_delete(const char *key, size_t n);
int fr_etcd_txn(fr_etcd *e, json_t *compare, json_t *success, json_t *failure, json_t **j, bool *ok,
                json_t **responses, uint64_t deadline, int timeout_ms);
/* Response i of a txn, of kind "response_range", "response_put" or "response_delete_range". */
json_t *fr_etcd_response(json_t *responses, size_t i, const char *kind);

#endif
