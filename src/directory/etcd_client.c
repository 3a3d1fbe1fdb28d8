/*
 * The etcd backend's client half (etcd.c holds the directory operations): requests to the
 * cluster through its v3 JSON gateway, one member at a time over a kept-alive connection: a call
 * takes the first of a few that is free, and lease renewals have one of their own (lanes, each
 * serialised by its own mutex, so that a call a silent member holds for its whole timeout keeps
 * neither a renewal nor another thread's call waiting). When that member does
 * not answer (refused, reset, silent for its share of the time left) or says it cannot serve (no
 * leader, leader changed, 5xx), the request goes on at the next member, all within the caller's
 * deadline. Also here: reading the gateway's JSON (int64s as strings, zeros left out, bytes in
 * base64: each checked), the txn and lease requests, and the cache of which etcd lease each node's
 * records are bound to.
 */
#include "directory/dirwire.h"
#include "directory/etcd.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- JSON fields ---- */

/* obj[field] = base64 of n bytes. */
void fr_etcd_set_b64(json_t *obj, const char *field, const void *p, size_t n) {
  char *s = fr_b64_encode(p, n);
  json_object_set_new(obj, field, s ? json_string(s) : json_null());
  free(s);
}

void fr_etcd_set_i64(json_t *obj, const char *field, int64_t v) {
  char s[24];
  snprintf(s, sizeof s, "%lld", (long long)v);
  json_object_set_new(obj, field, json_string(s));
}

/* An int64 field (the gateway writes them as strings, and leaves out zeros): false when it is
 * neither absent nor a well-formed number. */
bool fr_etcd_get_i64(const json_t *obj, const char *field, int64_t *out) {
  const json_t *v = json_object_get(obj, field);
  *out = 0;
  if (!v)
    return true;
  if (json_is_integer(v)) {
    *out = (int64_t)json_integer_value(v);
    return true;
  }
  const char *s = json_string_value(v);
  if (!s || !*s || strlen(s) > 20)
    return false;
  char *end;
  errno = 0;
  long long x = strtoll(s, &end, 10);
  if (*end || errno)
    return false;
  *out = x;
  return true;
}

/* A uint64 field (cluster ids use all 64 bits). */
static bool get_u64(const json_t *obj, const char *field, uint64_t *out) {
  const char *s = json_string_value(json_object_get(obj, field));
  *out = 0;
  if (!s)
    return !json_object_get(obj, field);
  char *end;
  errno = 0;
  unsigned long long x = strtoull(s, &end, 10);
  if (!*s || *end || errno || *s == '-')
    return false;
  *out = x;
  return true;
}

/* A base64 field decoded into out (cap bytes): false when absent, malformed or too long. */
bool fr_etcd_get_bytes(const json_t *obj, const char *field, uint8_t *out, size_t cap, size_t *n) {
  const json_t *v = json_object_get(obj, field);
  *n = 0;
  if (!v) /* an empty value is left out */
    return true;
  const char *s = json_string_value(v);
  return s && fr_b64_decode(s, json_string_length(v), out, cap, n);
}

bool fr_etcd_get_bool(const json_t *obj, const char *field) {
  return json_is_true(json_object_get(obj, field));
}

/* ---- keys ---- */

/* The etcd key of a node ('n') or object ('o') name: its length. */
size_t fr_etcd_key_of(const fr_etcd *e, char kind, const char *name, char *out) {
  return (size_t)snprintf(out, FR_ETCD_KEY_BYTES, "%s%c/%s", e->prefix, kind, name);
}

/* The end of the range of keys that start with p (n bytes): p with its last byte that is not
 * 0xff incremented and what follows cut (etcd's prefix range_end). */
size_t fr_etcd_prefix_end(const char *p, size_t n, char *out) {
  memcpy(out, p, n);
  while (n > 0 && (unsigned char)out[n - 1] == 0xff)
    n--;
  if (n > 0)
    out[n - 1] = (char)((unsigned char)out[n - 1] + 1);
  return n;
}

json_t *fr_etcd_with_key(json_t *obj, const char *key, size_t n) {
  fr_etcd_set_b64(obj, "key", key, n);
  return obj;
}

/* ---- calls: one member at a time, the next when it does not answer ---- */

void fr_etcd_lanes_init(fr_etcd *e) {
  for (int i = 0; i < FR_ETCD_LANES; i++) {
    pthread_mutex_init(&e->lane[i].lock, NULL);
    fr_http_init(&e->lane[i].conn);
    e->lane[i].member = -1;
  }
}

void fr_etcd_lanes_close(fr_etcd *e) {
  for (int i = 0; i < FR_ETCD_LANES; i++) {
    fr_http_close(&e->lane[i].conn);
    pthread_mutex_destroy(&e->lane[i].lock);
  }
}

/* A call that finds every call lane busy waits for one of them at most this long before it
 * looks at all of them again: the one it waits for may be held by a silent member for the whole
 * of its timeout while another frees at once. */
#define LANE_LOOK_NS 5000000ull

/* The first free one of the call lanes, locked, by deadline (each in turn waited for briefly). */
static fr_etcd_lane *take_call_lane(fr_etcd *e, uint64_t deadline) {
  unsigned turn = __atomic_fetch_add(&e->next_lane, 1, __ATOMIC_RELAXED);
  for (;; turn++) {
    for (int i = 0; i < FR_ETCD_CALL_LANES; i++)
      if (pthread_mutex_trylock(&e->lane[i].lock) == 0)
        return &e->lane[i];
    uint64_t now = fr_now_ns();
    if (now >= deadline)
      return NULL;
    fr_etcd_lane *l = &e->lane[turn % FR_ETCD_CALL_LANES];
    if (fr_mutex_lock_until(&l->lock,
                            deadline - now < LANE_LOOK_NS ? deadline : now + LANE_LOOK_NS) == 0)
      return l;
  }
}

/* The lane a request goes on, locked: a call's the first free one of the call lanes, a
 * renewal's its own. */
static int take_lane(fr_etcd *e, int lane, fr_etcd_lane **out, uint64_t deadline, int timeout_ms) {
  if (lane == FR_ETCD_CALLS) {
    if ((*out = take_call_lane(e, deadline)) != NULL)
      return 0;
    return fr_err(FERRY_ETIMEDOUT,
                  "etcd at %s: all %d of its connections stayed busy with other calls for %d ms",
                  e->m.shown, FR_ETCD_CALL_LANES, timeout_ms);
  }
  *out = &e->lane[lane];
  if (fr_mutex_lock_until(&e->lane[lane].lock, deadline) == 0)
    return 0;
  return fr_err(FERRY_ETIMEDOUT,
                "etcd at %s: the renewals' connection stayed busy with another renewal for %d ms",
                e->m.shown, timeout_ms);
}

/* Whether an error answer means this member cannot serve now (another may): gRPC's Unavailable
 * and friends, which the gateway answers with 5xx or 429, and etcd's own words for an election. */
static bool member_cannot_serve(int status, const char *msg) {
  return status >= 500 || status == 429 || strstr(msg, "leader changed") ||
         strstr(msg, "no leader") || strstr(msg, "timed out") || strstr(msg, "not capable") ||
         strstr(msg, "too many requests") || strstr(msg, "stopped");
}

/* The error an answer carries: {"error": "...", "message": "...", "code": N}, or a stream's
 * {"error": {...}}. */
static const char *error_text(const json_t *j) {
  const json_t *e = json_object_get(j, "error");
  if (json_is_object(e))
    j = e;
  const char *m = json_string_value(json_object_get(j, "message"));
  if (!m)
    m = json_string_value(json_object_get(j, "error"));
  return m ? m : "an error without a message";
}

/* A stream's message that is an error ({"error": {"message": ...}}): its words in why. */
static bool stream_error(const json_t *j, char *why, size_t cap) {
  if (!json_is_object(json_object_get(j, "error")))
    return false;
  snprintf(why, cap, "%s", error_text(j));
  return true;
}

/* POST on member m over the kept-alive connection (dialled when it is to another member or
 * broke); a connection that was idle and turns out closed is dialled again once. */
static int exchange(fr_etcd *e, fr_etcd_lane *l, int m, const char *path, const char *body,
                    int *status, char **resp, uint64_t deadline) {
  for (int attempt = 0; attempt < 2; attempt++) {
    bool fresh = l->conn.fd < 0 || l->member != m;
    int rc = 0;
    if (fresh) {
      l->member = -1;
      rc = fr_http_dial(&l->conn, e->m.u.host[m], e->m.u.port[m], deadline);
      if (rc != 0)
        return rc;
      l->member = m;
    }
    size_t n;
    rc = fr_http_post(&l->conn, path, body, strlen(body), deadline);
    if (rc == 0)
      rc = fr_http_head(&l->conn, status, deadline);
    if (rc == 0)
      rc = fr_http_body_all(&l->conn, resp, &n, FR_HTTP_BODY_MAX, deadline);
    if (rc == 0)
      return 0;
    fr_http_close(&l->conn); /* a half-read answer would answer the next request */
    if (fresh || rc != FERRY_ECONNECT)
      return rc;
  }
  return FERRY_ECONNECT;
}

/* A 200 answer's JSON (the first value: a stream's body may hold more), its cluster checked. */
static int answer_json(fr_etcd *e, const char *body, const char *path, json_t **out) {
  json_error_t err;
  json_t *j = json_loads(body, JSON_DISABLE_EOF_CHECK, &err);
  if (!json_is_object(j)) {
    json_decref(j);
    return fr_err(FERRY_EPROTO, "etcd at %s: %s: an answer that is not a JSON object", e->m.shown,
                  path);
  }
  json_t *res = json_object_get(j, "result"); /* a stream's message */
  json_t *head = json_object_get(res ? res : j, "header");
  uint64_t cluster = 0;
  int64_t rev = 0, seen = __atomic_load_n(&e->seen_rev, __ATOMIC_ACQUIRE);
  while (head && fr_etcd_get_i64(head, "revision", &rev) && rev > seen &&
         !__atomic_compare_exchange_n(&e->seen_rev, &seen, rev, false, __ATOMIC_ACQ_REL,
                                      __ATOMIC_ACQUIRE))
    ;
  if (head && get_u64(head, "cluster_id", &cluster) && cluster) {
    uint64_t was = __atomic_exchange_n(&e->cluster, cluster, __ATOMIC_ACQ_REL);
    if (was && was != cluster) { /* another cluster: what we registered is gone */
      /* its revisions, not the old cluster's higher ones, are what unchanged-since compares
       * against (fr_etcd_cmp_unchanged): else every one would pass there */
      __atomic_store_n(&e->seen_rev, rev, __ATOMIC_RELEASE);
      __atomic_add_fetch(&e->epoch, 1, __ATOMIC_ACQ_REL);
    }
  }
  *out = j;
  return 0;
}

/* The call's deadline passed. When every member of several was asked and none answered, the
 * cluster as a whole is not serving (fewer than a quorum of its members run, or no leader is
 * elected yet): the detail says so, not only the last member's words. */
static int timed_out(fr_etcd *e, const char *path, int timeout_ms, const char *last,
                     unsigned silent) {
  int n = e->m.u.n;
  if (n > 1 && silent == (1u << n) - 1)
    return fr_err(FERRY_ETIMEDOUT,
                  "etcd at %s: none of its %d members answered %s within %d ms: the cluster has "
                  "no quorum or no leader now (members stopped or down, or an election under "
                  "way; last: %s)",
                  e->m.shown, n, path, timeout_ms, last);
  return fr_err(FERRY_ETIMEDOUT, "etcd at %s did not answer %s within %d ms (last: %s)", e->m.shown,
                path, timeout_ms, last);
}

/* One request within the deadline, moving from member to member while they do not answer;
 * takes req. *out: the answer (a stream's first message unwrapped of its "result"). */
int fr_etcd_call_on(fr_etcd *e, int lane, const char *path, json_t *req, json_t **out,
                    uint64_t deadline, int timeout_ms) {
  fr_etcd_lane *l;
  char *body = json_dumps(req, JSON_COMPACT);
  json_decref(req);
  if (!body)
    return fr_err(FERRY_ENOMEM, "etcd request");
  int rc = take_lane(e, lane, &l, deadline, timeout_ms);
  if (rc != 0) {
    free(body);
    return rc;
  }
  int n = e->m.u.n, refused = 0;
  unsigned silent = 0; /* the members this call left without an answer */
  bool garbled = false;
  char last[512] = "no member was asked";
  for (int tried = 0;; tried++) {
    int left = fr_ms_left(deadline);
    if (left <= 0) {
      rc = timed_out(e, path, timeout_ms, last, silent);
      break;
    }
    if (refused >= n) { /* every member refused, reset or garbled the last round: no use */
      rc = garbled
               ? fr_err(FERRY_EPROTO, "etcd at %s: %s (is that an etcd member?)", e->m.shown, last)
               : fr_err(FERRY_ECONNECT, "cannot reach etcd at %s: %s (is etcd running there?)",
                        e->m.shown, last);
      break;
    }
    /* a member that accepts and does not answer may keep half of what is left, at most
     * FR_ETCD_TRY_MS: a follower holds a request it forwarded to a leader that died until its
     * own request timeout (seconds), while the others elect a new leader in about two election
     * timeouts */
    int try_ms = left / 2 < FR_ETCD_TRY_MS ? left / 2 : FR_ETCD_TRY_MS;
    uint64_t until = n > 1 && left > 200 ? fr_deadline_ns(try_ms) : deadline;
    int m = __atomic_load_n(&e->m.current, __ATOMIC_ACQUIRE), status = 0;
    char *resp = NULL;
    rc = exchange(e, l, m, path, body, &status, &resp, until);
    refused = rc == FERRY_ECONNECT || rc == FERRY_EPROTO ? refused + 1 : 0;
    garbled = rc == FERRY_EPROTO;
    if (rc == 0 && status == 200) {
      rc = answer_json(e, resp, path, out);
      free(resp);
      if (rc != 0 || !stream_error(*out, last, sizeof last))
        break;
      json_decref(*out); /* a stream's error message: as an error answer */
      *out = NULL;
      rc = fr_err(FERRY_EPROTO, "etcd at %s: %s: %s", e->m.shown, path, last);
      if (!member_cannot_serve(200, last)) /* the words alone tell */
        break;
    } else if (rc == 0) {
      json_t *j = json_loads(resp, JSON_DISABLE_EOF_CHECK, NULL);
      snprintf(last, sizeof last, "%.280s: HTTP %d: %.160s", l->conn.name, status,
               j ? error_text(j) : resp);
      bool other = member_cannot_serve(status, j ? error_text(j) : "");
      json_decref(j);
      free(resp);
      if (!other) {
        rc = fr_err(FERRY_EPROTO, "etcd at %s: %s: %s", e->m.shown, path, last);
        break;
      }
    } else if (rc == FERRY_ENOMEM) {
      break;
    } else {
      fr_str_copy(last, sizeof last, ferry_last_error());
    }
    silent |= 1u << m;
    /* on to the next member, unless another call moved on meanwhile: a store would move the
     * shared choice back to a member that call found dead */
    __atomic_compare_exchange_n(&e->m.current, &m, (m + 1) % n, false, __ATOMIC_ACQ_REL,
                                __ATOMIC_ACQUIRE);
    if ((tried + 1) % n == 0 && rc != FERRY_ECONNECT) { /* a round without an answer: an election */
      int ms = fr_ms_left(deadline);
      usleep((useconds_t)(ms < 50 ? ms : 50) * 1000);
    }
  }
  pthread_mutex_unlock(&l->lock);
  free(body);
  return rc;
}

int fr_etcd_call_until(fr_etcd *e, const char *path, json_t *req, json_t **out, uint64_t deadline,
                       int timeout_ms) {
  return fr_etcd_call_on(e, FR_ETCD_CALLS, path, req, out, deadline, timeout_ms);
}

/* The answer's "result" when it is a stream's message, else itself; FERRY_EPROTO for a stream's
 * error message. */
int fr_etcd_unwrap(fr_etcd *e, json_t *j, const char *path, json_t **body) {
  json_t *res = json_object_get(j, "result");
  if (json_object_get(j, "error") && !res)
    return fr_err(FERRY_EPROTO, "etcd at %s: %s: %s", e->m.shown, path, error_text(j));
  *body = res ? res : j;
  return 0;
}

/* ---- the lease cache: the lease each node's records are bound to ---- */

int64_t fr_etcd_lease_cached(fr_etcd *e, const char *name, uint64_t incarnation) {
  int64_t l = 0;
  pthread_mutex_lock(&e->cache_lock);
  for (int i = 0; i < FR_ETCD_LEASE_CACHE && !l; i++)
    if (e->leases[i].lease && strcmp(e->leases[i].name, name) == 0 &&
        (!incarnation || e->leases[i].incarnation == incarnation))
      l = e->leases[i].lease;
  pthread_mutex_unlock(&e->cache_lock);
  return l;
}

void fr_etcd_lease_remember(fr_etcd *e, const char *name, uint64_t incarnation, int64_t lease) {
  pthread_mutex_lock(&e->cache_lock);
  __typeof__(e->leases[0]) *slot = NULL;
  for (int i = 0; i < FR_ETCD_LEASE_CACHE && !slot; i++)
    if (strcmp(e->leases[i].name, name) == 0)
      slot = &e->leases[i];
  if (!slot)
    slot = &e->leases[e->next_slot++ % FR_ETCD_LEASE_CACHE];
  fr_str_copy(slot->name, sizeof slot->name, name);
  slot->incarnation = incarnation;
  slot->lease = lease;
  pthread_mutex_unlock(&e->cache_lock);
}

void fr_etcd_lease_forget(fr_etcd *e, const char *name) { fr_etcd_lease_remember(e, name, 0, 0); }

/* ---- records ---- */

bool fr_etcd_kv_read(const json_t *j, fr_etcd_kv *out) {
  out->found = json_is_object(j);
  return out->found && fr_etcd_get_bytes(j, "value", out->val, sizeof out->val, &out->len) &&
         fr_etcd_get_i64(j, "lease", &out->lease) && fr_etcd_get_i64(j, "mod_revision", &out->mod);
}

/* The first kv of a range answer (out->found false when none). */
bool fr_etcd_range_kv(const json_t *range, fr_etcd_kv *out) {
  out->found = false;
  const json_t *kvs = json_object_get(range, "kvs");
  if (kvs && !json_is_array(kvs))
    return false;
  return json_array_size(kvs) == 0 || fr_etcd_kv_read(json_array_get(kvs, 0), out);
}

/* A node record stored under `name` (a peer's: untrusted, checked). */
bool fr_etcd_node_of(const fr_etcd_kv *v, const char *name, fr_dir_node *out) {
  fr_rd rd = fr_rd_init(v->val, v->len);
  return fr_rd_node(&rd, out) && fr_rd_done(&rd) && (!name || strcmp(out->name, name) == 0);
}

bool fr_etcd_object_of(const fr_etcd_kv *v, const char *key, fr_dir_object *out) {
  fr_rd rd = fr_rd_init(v->val, v->len);
  return fr_rd_object(&rd, out) && fr_rd_done(&rd) && (!key || strcmp(out->key, key) == 0);
}

int fr_etcd_malformed(fr_etcd *e, const char *what) {
  return fr_err(FERRY_EPROTO, "etcd at %s: a malformed answer to %s", e->m.shown, what);
}

/* Range of one key: *v. */
int fr_etcd_get_key_on(fr_etcd *e, int lane, const char *key, fr_etcd_kv *v, uint64_t deadline,
                       int timeout_ms) {
  json_t *j;
  int rc =
      fr_etcd_call_on(e, lane, "/v3/kv/range", fr_etcd_with_key(json_object(), key, strlen(key)),
                      &j, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  if (!fr_etcd_range_kv(j, v))
    rc = fr_etcd_malformed(e, "a range");
  json_decref(j);
  return rc;
}

int fr_etcd_get_key(fr_etcd *e, const char *key, fr_etcd_kv *v, uint64_t deadline, int timeout_ms) {
  return fr_etcd_get_key_on(e, FR_ETCD_CALLS, key, v, deadline, timeout_ms);
}

/* ---- leases ---- */

int fr_etcd_lease_call(fr_etcd *e, int lane, const char *path, int64_t id, int64_t *ttl,
                       uint64_t deadline, int timeout_ms) {
  json_t *req = json_object(), *j, *body;
  fr_etcd_set_i64(req, "ID", id);
  int rc = fr_etcd_call_on(e, lane, path, req, &j, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  rc = fr_etcd_unwrap(e, j, path, &body);
  if (rc == 0 && ttl && !fr_etcd_get_i64(body, "TTL", ttl))
    rc = fr_etcd_malformed(e, path);
  json_decref(j);
  return rc;
}

int fr_etcd_lease_grant(fr_etcd *e, int lease_ms, int64_t *id, uint64_t deadline, int timeout_ms) {
  json_t *req = json_object(), *j;
  fr_etcd_set_i64(req, "TTL", lease_ms <= 1000 ? 1 : (lease_ms + 999) / 1000);
  int rc = fr_etcd_call_until(e, "/v3/lease/grant", req, &j, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  if (!fr_etcd_get_i64(j, "ID", id) || *id == 0)
    rc = json_object_get(j, "error")
             ? fr_err(FERRY_EPROTO, "etcd at %s: lease grant: %s", e->m.shown, error_text(j))
             : fr_etcd_malformed(e, "a lease grant");
  json_decref(j);
  return rc;
}

/* Revokes a lease: etcd deletes every key bound to it. A lease already gone is no failure. */
int fr_etcd_lease_revoke(fr_etcd *e, int64_t id, uint64_t deadline, int timeout_ms) {
  int rc = fr_etcd_lease_call(e, FR_ETCD_CALLS, "/v3/lease/revoke", id, NULL, deadline, timeout_ms);
  if (rc == FERRY_EPROTO && strstr(ferry_last_error(), "not found")) {
    fr_err_clear();
    return 0;
  }
  return rc;
}

/* ---- txn ---- */

static json_t *compare(const char *key, size_t n, const char *target, const char *result,
                       const char *field, int64_t v) {
  json_t *c = fr_etcd_with_key(json_object(), key, n);
  json_object_set_new(c, "target", json_string(target));
  json_object_set_new(c, "result", json_string(result));
  fr_etcd_set_i64(c, field, v);
  return c;
}

json_t *fr_etcd_cmp(const char *key, size_t n, const char *target, const char *field, int64_t v) {
  return compare(key, n, target, "EQUAL", field, v);
}

json_t *fr_etcd_cmp_unchanged(fr_etcd *e, const char *key, size_t n) {
  int64_t seen = __atomic_load_n(&e->seen_rev, __ATOMIC_ACQUIRE);
  return compare(key, n, "MOD", "LESS", "mod_revision", seen + 1);
}

/* The delete marker's key of object `name` (FNV-1a, so every client picks the same one). */
static size_t marker_of(const fr_etcd *e, const char *name, char *out) {
  uint32_t h = 2166136261u;
  for (const unsigned char *p = (const unsigned char *)name; *p; p++)
    h = (h ^ *p) * 16777619u;
  return (size_t)snprintf(out, FR_ETCD_KEY_BYTES, "%sd/%02x", e->prefix,
                          (unsigned)(h % FR_ETCD_MARKERS));
}

json_t *fr_etcd_cmp_marker(fr_etcd *e, const char *name) {
  char k[FR_ETCD_KEY_BYTES];
  size_t n = marker_of(e, name, k);
  return fr_etcd_cmp_unchanged(e, k, n);
}

static json_t *fr_etcd_op(const char *kind, json_t *req);

json_t *fr_etcd_op_mark(fr_etcd *e, const char *name) {
  char k[FR_ETCD_KEY_BYTES];
  size_t n = marker_of(e, name, k);
  json_t *p = fr_etcd_with_key(json_object(), k, n);
  fr_etcd_set_b64(p, "value", "d", 1);
  return fr_etcd_op("request_put", p);
}

static json_t *fr_etcd_op(const char *kind, json_t *req) {
  json_t *o = json_object();
  json_object_set_new(o, kind, req);
  return o;
}

json_t *fr_etcd_op_range(const char *key, size_t n) {
  return fr_etcd_op("request_range", fr_etcd_with_key(json_object(), key, n));
}

json_t *fr_etcd_op_put(const char *key, size_t n, const void *val, size_t vn, int64_t lease) {
  json_t *p = fr_etcd_with_key(json_object(), key, n);
  fr_etcd_set_b64(p, "value", val, vn);
  fr_etcd_set_i64(p, "lease", lease);
  json_object_set_new(p, "prev_kv", json_true());
  return fr_etcd_op("request_put", p);
}

json_t *fr_etcd_op_delete(const char *key, size_t n) {
  json_t *d = fr_etcd_with_key(json_object(), key, n);
  json_object_set_new(d, "prev_kv", json_true());
  return fr_etcd_op("request_delete_range", d);
}

/* A txn of compares, then success or failure ops (each array taken). *ok: it succeeded;
 * *responses: the answer's responses (borrowed from *j, which the caller frees). */
int fr_etcd_txn(fr_etcd *e, json_t *compare, json_t *success, json_t *failure, json_t **j, bool *ok,
                json_t **responses, uint64_t deadline, int timeout_ms) {
  json_t *req = json_object();
  json_object_set_new(req, "compare", compare);
  json_object_set_new(req, "success", success);
  json_object_set_new(req, "failure", failure ? failure : json_array());
  int rc = fr_etcd_call_until(e, "/v3/kv/txn", req, j, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  *ok = fr_etcd_get_bool(*j, "succeeded");
  *responses = json_object_get(*j, "responses");
  if (*responses && !json_is_array(*responses)) {
    json_decref(*j);
    return fr_etcd_malformed(e, "a txn");
  }
  return 0;
}

/* The response of a txn's op i of kind ("response_range", "response_put", ...) or NULL. */
json_t *fr_etcd_response(json_t *responses, size_t i, const char *kind) {
  return json_object_get(json_array_get(responses, i), kind);
}
