/*
 * The etcd directory backend (etcd://HOST[:PORT][,HOST[:PORT]...][?ns=NAME], url.c reads it), for
 * fleets whose directory must outlive any one host: the records live in an etcd cluster, reached
 * through its v3 JSON gateway (etcd_client.c, etcd_http.c). Keys sit under "ferry/" ("ferry@NS/"
 * for ?ns=NS, so fleets sharing a cluster neither see nor delete each other's): a node is
 * PREFIX n/NAME, its value the node record (dirwire.h), bound to an etcd lease that is the node's
 * lease (granted at registration, kept alive by each renewal, revoked by the node's delete or a
 * takeover); an object is PREFIX o/KEY, its value the object record, bound to its owner's lease,
 * so etcd drops a dead owner's objects with its node when the lease lapses, and a revoke drops
 * them at once. Every check-then-write is one txn whose compares make it atomic: a put compares
 * the owner's node key still on the lease the object is bound to (registered, same
 * registration), a conditional delete the record's mod revision. There are no stamps
 * (fr_dir_ops.stamp): a watch learns of another process's change only some time after etcd
 * applied it, so a stamp from it could not prove a key unchanged to a reader that heard of the
 * change by other means (a message from the writer), and every lookup asks etcd.
 */
#include "directory/dirwire.h"
#include "directory/etcd.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TRIES 8 /* rounds of a check-then-write that lost a race, within the deadline */
#define GROUP_MAX ((FR_ETCD_TXN_OPS - 1) / 2) /* puts in one txn */

static int dead_line(int timeout_ms, const fr_etcd *e, const char *what) {
  return fr_err(FERRY_ETIMEDOUT, "etcd at %s: %s kept changing for %d ms", e->m.shown, what,
                timeout_ms);
}

static int delete_at(fr_etcd *e, const char *k, size_t kn, int64_t mod, const char *key, bool *ran,
                     bool *done, fr_dir_object *deleted, uint64_t deadline, int timeout_ms);

/* ---- nodes ---- */

/* The holder's lease left, for the message naming it (0 when unknown). */
static uint32_t lease_left_ms(fr_etcd *e, int64_t lease, uint64_t deadline, int timeout_ms) {
  int64_t ttl = 0;
  if (fr_etcd_lease_call(e, FR_ETCD_CALLS, "/v3/lease/timetolive", lease, &ttl, deadline,
                         timeout_ms) != 0) {
    fr_err_clear();
    return 0;
  }
  return ttl > 0 ? (uint32_t)(ttl * 1000) : 0;
}

/* Puts the node record under its key, bound to `lease`, if the key is as it was read: absent
 * (mod 0) or at mod revision `mod`. *ok: it was. */
static int node_write(fr_etcd *e, const fr_dir_node *n, const char *key, size_t kn, int64_t mod,
                      int64_t lease, bool *ok, uint64_t deadline, int timeout_ms) {
  uint8_t buf[FR_ETCD_RECORD_MAX];
  fr_wr w = FR_WR_ON(buf);
  fr_wr_node(&w, n);
  json_t *compare = json_array(), *success = json_array(), *j, *resp;
  json_array_append_new(compare, mod ? fr_etcd_cmp(key, kn, "MOD", "mod_revision", mod)
                                     : fr_etcd_cmp(key, kn, "VERSION", "version", 0));
  json_array_append_new(success, fr_etcd_op_put(key, kn, w.p, w.len, lease));
  fr_wr_free(&w);
  int rc = fr_etcd_txn(e, compare, success, NULL, &j, ok, &resp, deadline, timeout_ms);
  if (rc == 0)
    json_decref(j);
  return rc;
}

static int etcd_node_put(void *st, const fr_dir_node *n, int lease_ms, uint64_t takeover,
                         fr_dir_node *holder, int timeout_ms) {
  fr_etcd *e = st;
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  char key[FR_ETCD_KEY_BYTES];
  size_t kn = fr_etcd_key_of(e, 'n', n->name, key);
  for (int i = 0; i < TRIES; i++) {
    fr_etcd_kv v;
    fr_dir_node h;
    bool ok = false;
    int rc = fr_etcd_get_key(e, key, &v, deadline, timeout_ms);
    if (rc != 0)
      return rc;
    bool held = v.found && fr_etcd_node_of(&v, n->name, &h);
    if (held && h.incarnation == n->incarnation) { /* its own refresh: same lease, kept alive */
      if ((rc = node_write(e, n, key, kn, v.mod, v.lease, &ok, deadline, timeout_ms)) != 0)
        return rc;
      if (!ok)
        continue;
      int64_t ttl = 0;
      rc = fr_etcd_lease_call(e, FR_ETCD_CALLS, "/v3/lease/keepalive", v.lease, &ttl, deadline,
                              timeout_ms);
      if (rc != 0 || ttl > 0) {
        fr_etcd_lease_remember(e, n->name, n->incarnation, v.lease);
        return rc;
      }
      continue; /* the lease lapsed meanwhile: register anew */
    }
    if (held && (!takeover || takeover != h.incarnation)) {
      if (holder)
        *holder = h;
      return fr_dir_name_taken(&h, lease_left_ms(e, v.lease, deadline, timeout_ms));
    }
    if (v.found) { /* a holder proven dead (it goes with its lease), or a record that is none */
      bool ran, done;
      rc = v.lease ? fr_etcd_lease_revoke(e, v.lease, deadline, timeout_ms)
                   : delete_at(e, key, kn, v.mod, NULL, &ran, &done, NULL, deadline, timeout_ms);
      if (rc != 0)
        return rc;
      continue;
    }
    int64_t lease;
    if ((rc = fr_etcd_lease_grant(e, lease_ms, &lease, deadline, timeout_ms)) != 0)
      return rc;
    rc = node_write(e, n, key, kn, 0, lease, &ok, deadline, timeout_ms);
    if (rc == 0 && ok) {
      fr_etcd_lease_remember(e, n->name, n->incarnation, lease);
      return 0;
    }
    fr_etcd_lease_revoke(e, lease, deadline, timeout_ms); /* another registered first */
    fr_err_clear();
    if (rc != 0)
      return rc;
  }
  return dead_line(timeout_ms, e, "node name");
}

/* The lease of the node `name` held by `incarnation` (0 and FERRY_ENOTFOUND when not held), asked
 * on the renewals' lane. */
static int node_lease(fr_etcd *e, const char *name, uint64_t incarnation, int64_t *lease,
                      uint64_t deadline, int timeout_ms) {
  char key[FR_ETCD_KEY_BYTES];
  fr_etcd_key_of(e, 'n', name, key);
  fr_etcd_kv v;
  fr_dir_node h;
  int rc = fr_etcd_get_key_on(e, FR_ETCD_RENEWALS, key, &v, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  if (!v.found || !fr_etcd_node_of(&v, name, &h) || h.incarnation != incarnation || !v.lease)
    return fr_err(FERRY_ENOTFOUND, "node '%s' is not registered (its lease lapsed?)", name);
  *lease = v.lease;
  return 0;
}

/* The lease of a node's registration is the node's: it lives while the registration does (a
 * takeover or delete revokes it), so a renewal of a lease this client bound the node to is one
 * keep-alive; TTL 0 says it lapsed. Renewals go on a connection of their own (FR_ETCD_RENEWALS):
 * a call that a silent member holds never makes one wait. */
static int etcd_node_renew(void *st, const char *name, uint64_t incarnation, int lease_ms,
                           int timeout_ms) {
  fr_etcd *e = st;
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  int64_t lease = fr_etcd_lease_cached(e, name, incarnation), ttl = 0;
  int rc = lease ? 0 : node_lease(e, name, incarnation, &lease, deadline, timeout_ms);
  if (rc == 0)
    rc = fr_etcd_lease_call(e, FR_ETCD_RENEWALS, "/v3/lease/keepalive", lease, &ttl, deadline,
                            timeout_ms);
  if (rc == 0 && ttl <= 0) {
    fr_etcd_lease_forget(e, name);
    rc = fr_err(FERRY_ENOTFOUND, "node '%s' is not registered (its lease lapsed)", name);
  }
  if (rc == 0)
    fr_etcd_lease_remember(e, name, incarnation, lease);
  return rc;
}

static int etcd_node_get(void *st, const char *name, fr_dir_node *out, int timeout_ms) {
  fr_etcd *e = st;
  char key[FR_ETCD_KEY_BYTES];
  fr_etcd_key_of(e, 'n', name, key);
  fr_etcd_kv v;
  int rc = fr_etcd_get_key(e, key, &v, fr_deadline_ns(timeout_ms), timeout_ms);
  if (rc == 0 && !(v.found && fr_etcd_node_of(&v, name, out)))
    rc = fr_err(FERRY_ENOTFOUND, "no node '%s' in the directory", name);
  return rc;
}

static int etcd_node_del(void *st, const char *name, uint64_t incarnation, int timeout_ms) {
  fr_etcd *e = st;
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  char key[FR_ETCD_KEY_BYTES];
  fr_etcd_key_of(e, 'n', name, key);
  fr_etcd_kv v;
  fr_dir_node h;
  int rc = fr_etcd_get_key(e, key, &v, deadline, timeout_ms);
  if (rc != 0 || !v.found)
    return rc;
  bool mine = fr_etcd_node_of(&v, name, &h) && (!incarnation || h.incarnation == incarnation);
  if (!mine && fr_etcd_node_of(&v, name, &h))
    return 0; /* another incarnation holds the name now */
  fr_etcd_lease_forget(e, name);
  return v.lease ? fr_etcd_lease_revoke(e, v.lease, deadline, timeout_ms) : 0;
}

/* ---- ranges: every key under a prefix, page by page, sorted by key ---- */

typedef bool (*kv_fn)(void *arg, const fr_etcd_kv *v);

static int range_all(fr_etcd *e, const char *prefix, size_t pn, kv_fn fn, void *arg,
                     uint64_t deadline, int timeout_ms) {
  char end[FR_ETCD_KEY_BYTES], from[FR_ETCD_KEY_BYTES + 1];
  size_t en = fr_etcd_prefix_end(prefix, pn, end), fn_len = pn;
  memcpy(from, prefix, pn);
  int64_t rev = 0;
  for (bool more = true; more;) {
    json_t *req = fr_etcd_with_key(json_object(), from, fn_len), *j;
    fr_etcd_set_b64(req, "range_end", en ? end : "\0", en ? en : 1);
    fr_etcd_set_i64(req, "limit", FR_ETCD_PAGE);
    if (rev)
      fr_etcd_set_i64(req, "revision", rev); /* every page as of the first */
    int rc = fr_etcd_call_until(e, "/v3/kv/range", req, &j, deadline, timeout_ms);
    if (rc != 0)
      return rc;
    json_t *kvs = json_object_get(j, "kvs"), *head = json_object_get(j, "header");
    more = fr_etcd_get_bool(j, "more");
    if ((kvs && !json_is_array(kvs)) || (!rev && !fr_etcd_get_i64(head, "revision", &rev))) {
      json_decref(j);
      return fr_etcd_malformed(e, "a range");
    }
    size_t n = json_array_size(kvs);
    for (size_t i = 0; i < n; i++) {
      fr_etcd_kv v;
      size_t kl = 0;
      json_t *one = json_array_get(kvs, i);
      if (!fr_etcd_kv_read(one, &v) ||
          !fr_etcd_get_bytes(one, "key", (uint8_t *)from, sizeof from - 1, &kl) || kl < pn) {
        json_decref(j);
        return fr_etcd_malformed(e, "a range");
      }
      fn_len = kl;
      if (!fn(arg, &v)) {
        json_decref(j);
        return fr_err(FERRY_ENOMEM, "etcd range");
      }
    }
    json_decref(j);
    if (more && n == 0)
      return fr_etcd_malformed(e, "a range (more, but no keys)");
    from[fn_len++] = '\0'; /* the next page starts after the last key */
  }
  return 0;
}

typedef struct grow {
  void *v;
  size_t n, cap, size;
  const char *prefix; /* objects: the scan's prefix, which every key must start with */
} grow;

static void *grow_slot(grow *g) {
  if (g->n == g->cap) {
    size_t cap = g->cap ? 2 * g->cap : 64;
    void *v = realloc(g->v, cap * g->size);
    if (!v)
      return NULL;
    g->v = v;
    g->cap = cap;
  }
  return (char *)g->v + g->n * g->size;
}

static bool add_node(void *arg, const fr_etcd_kv *v) {
  grow *g = arg;
  fr_dir_node *slot = grow_slot(g);
  if (!slot)
    return false;
  g->n += fr_etcd_node_of(v, NULL, slot); /* a peer's garbage is left out */
  return true;
}

static bool add_object(void *arg, const fr_etcd_kv *v) {
  grow *g = arg;
  fr_dir_object *slot = grow_slot(g);
  if (!slot)
    return false;
  g->n += fr_etcd_object_of(v, NULL, slot) && strncmp(slot->key, g->prefix, strlen(g->prefix)) == 0;
  return true;
}

static int collect(fr_etcd *e, char kind, const char *prefix, kv_fn fn, size_t size, void **out,
                   size_t *count, int timeout_ms) {
  char key[FR_ETCD_KEY_BYTES];
  size_t kn = fr_etcd_key_of(e, kind, prefix, key);
  grow g = {.size = size, .prefix = prefix};
  int rc = range_all(e, key, kn, fn, &g, fr_deadline_ns(timeout_ms), timeout_ms);
  if (rc == 0 && !g.v && !(g.v = calloc(1, size)))
    rc = fr_err(FERRY_ENOMEM, "etcd range");
  if (rc != 0) {
    free(g.v);
    return rc;
  }
  *out = g.v;
  *count = g.n;
  return 0;
}

static int etcd_node_list(void *st, fr_dir_node **out, size_t *n, int timeout_ms) {
  return collect(st, 'n', "", add_node, sizeof **out, (void **)out, n, timeout_ms);
}

static int etcd_obj_scan(void *st, const char *prefix, fr_dir_object **out, size_t *n,
                         int timeout_ms) {
  return collect(st, 'o', prefix, add_object, sizeof **out, (void **)out, n, timeout_ms);
}

/* ---- objects ---- */

/* What a failed put's txn read back: the owner's node (its lease) and, with keep_others, the
 * record under the key. */
static int put_lost(fr_etcd *e, const fr_dir_object *o, json_t *resp, bool *keep, int64_t *lease,
                    bool *absent) {
  fr_etcd_kv node, rec;
  fr_dir_node h;
  fr_dir_object old;
  if (!fr_etcd_range_kv(fr_etcd_response(resp, 0, "response_range"), &node) ||
      (*keep && !fr_etcd_range_kv(fr_etcd_response(resp, 1, "response_range"), &rec)))
    return fr_etcd_malformed(e, "a put");
  if (!node.found || !node.lease || !fr_etcd_node_of(&node, o->owner, &h))
    return fr_err(FERRY_ENOTFOUND, "put '%s': node '%s' is not registered", o->key, o->owner);
  fr_etcd_lease_remember(e, o->owner, h.incarnation, node.lease);
  *lease = node.lease;
  if (!*keep)
    return 0;
  *absent = !rec.found;
  if (rec.found && rec.lease != node.lease && fr_etcd_object_of(&rec, o->key, &old) &&
      strcmp(old.owner, o->owner) != 0)
    return fr_err(FERRY_EEXIST, "'%s' is now owned by '%s'", o->key, old.owner);
  if (rec.found && rec.lease != node.lease) /* its own, or no record at all: replace it */
    *keep = false;
  return 0;
}

/* What a put that replaced prev (a put's prev_kv, may be NULL) tells: another owner's record. */
static void put_replaced(const fr_dir_object *o, json_t *prev, fr_dir_object *replaced,
                         bool *had_other) {
  fr_etcd_kv pv;
  fr_dir_object old;
  *had_other = prev && fr_etcd_kv_read(prev, &pv) && fr_etcd_object_of(&pv, o->key, &old) &&
               strcmp(old.owner, o->owner) != 0;
  if (*had_other)
    *replaced = old;
}

/* One try of a put: bound to `lease` if the owner's node is still on it (and, with keep, if the
 * record is absent or on it too). *done: it was written. */
static int put_try(fr_etcd *e, const fr_dir_object *o, const uint8_t *val, size_t vn,
                   int64_t *lease, bool *keep, bool *absent, bool *done, fr_dir_object *replaced,
                   bool *had_other, uint64_t deadline, int timeout_ms) {
  char nk[FR_ETCD_KEY_BYTES], ok[FR_ETCD_KEY_BYTES];
  size_t nn = fr_etcd_key_of(e, 'n', o->owner, nk), on = fr_etcd_key_of(e, 'o', o->key, ok);
  json_t *compare = json_array(), *success = json_array(), *failure = json_array(), *j, *resp;
  json_array_append_new(compare, fr_etcd_cmp(nk, nn, "LEASE", "lease", *lease));
  json_array_append_new(compare, fr_etcd_cmp_unchanged(e, ok, on));
  json_array_append_new(compare, fr_etcd_cmp_marker(e, o->key));
  if (*keep)
    json_array_append_new(compare, *absent ? fr_etcd_cmp(ok, on, "VERSION", "version", 0)
                                           : fr_etcd_cmp(ok, on, "LEASE", "lease", *lease));
  json_array_append_new(success, fr_etcd_op_put(ok, on, val, vn, *lease));
  json_array_append_new(failure, fr_etcd_op_range(nk, nn));
  if (*keep)
    json_array_append_new(failure, fr_etcd_op_range(ok, on));
  int rc = fr_etcd_txn(e, compare, success, failure, &j, done, &resp, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  if (!*done) {
    rc = put_lost(e, o, resp, keep, lease, absent);
    json_decref(j);
    return rc;
  }
  fr_dir_object old;
  bool other;
  put_replaced(o, json_object_get(fr_etcd_response(resp, 0, "response_put"), "prev_kv"), &old,
               &other);
  if (other && replaced)
    *replaced = old;
  if (had_other)
    *had_other = other;
  json_decref(j);
  return 0;
}

static int obj_put_until(fr_etcd *e, const fr_dir_object *o, unsigned flags,
                         fr_dir_object *replaced, bool *had_other, uint64_t deadline,
                         int timeout_ms) {
  uint8_t buf[FR_ETCD_RECORD_MAX];
  fr_wr w = FR_WR_ON(buf);
  fr_wr_object(&w, o);
  if (w.failed || w.len > FR_ETCD_RECORD_MAX) {
    fr_wr_free(&w);
    return fr_err(FERRY_ENOMEM, "put '%s'", o->key);
  }
  if (w.p != buf) /* it grew out of buf: cannot happen below FR_ETCD_RECORD_MAX, but be sure */
    memcpy(buf, w.p, w.len);
  size_t vn = w.len;
  fr_wr_free(&w);
  int64_t lease = fr_etcd_lease_cached(e, o->owner, 0);
  int rc = 0;
  if (!lease) { /* never 0 in a compare: a missing key's lease is 0 too */
    char nk[FR_ETCD_KEY_BYTES];
    fr_etcd_key_of(e, 'n', o->owner, nk);
    fr_etcd_kv v;
    fr_dir_node h;
    if ((rc = fr_etcd_get_key(e, nk, &v, deadline, timeout_ms)) != 0)
      return rc;
    if (!v.found || !v.lease || !fr_etcd_node_of(&v, o->owner, &h))
      return fr_err(FERRY_ENOTFOUND, "put '%s': node '%s' is not registered", o->key, o->owner);
    lease = v.lease;
  }
  bool keep = flags & FR_DIR_PUT_KEEP_OTHERS, absent = false, done = false;
  for (int i = 0; i < TRIES && rc == 0 && !done; i++)
    rc = put_try(e, o, buf, vn, &lease, &keep, &absent, &done, replaced, had_other, deadline,
                 timeout_ms);
  if (rc == 0 && !done)
    rc = dead_line(timeout_ms, e, "the owner's registration");
  return rc;
}

static int etcd_obj_put(void *st, const fr_dir_object *o, unsigned flags, fr_dir_object *replaced,
                        bool *had_other, int timeout_ms) {
  if (had_other)
    *had_other = false;
  return obj_put_until(st, o, flags, replaced, had_other, fr_deadline_ns(timeout_ms), timeout_ms);
}

/* n objects of one owner (distinct keys, n <= GROUP_MAX) in one txn: the owner's node still on
 * `lease`, each key and its delete marker unchanged, then every put. *again: it failed with the
 * owner's node still on `lease` (a key or marker moved since this client last heard from etcd:
 * the answer told it the newer revision, and the group is sent again). *done false: the owner's
 * registration is not what the lease cache says (the caller puts them one by one, which finds out).
 */
static int put_group(fr_etcd *e, const fr_dir_object *objs, size_t n, int64_t lease, int *status,
                     fr_dir_object *replaced, bool *had_other, bool *done, bool *again,
                     uint64_t deadline, int timeout_ms) {
  char nk[FR_ETCD_KEY_BYTES];
  size_t nn = fr_etcd_key_of(e, 'n', objs[0].owner, nk);
  json_t *compare = json_array(), *success = json_array(), *failure = json_array(), *j, *resp;
  json_array_append_new(failure, fr_etcd_op_range(nk, nn));
  json_array_append_new(compare, fr_etcd_cmp(nk, nn, "LEASE", "lease", lease));
  for (size_t i = 0; i < n; i++) {
    uint8_t buf[FR_ETCD_RECORD_MAX];
    char ok[FR_ETCD_KEY_BYTES];
    size_t on = fr_etcd_key_of(e, 'o', objs[i].key, ok);
    json_array_append_new(compare, fr_etcd_cmp_unchanged(e, ok, on));
    json_array_append_new(compare, fr_etcd_cmp_marker(e, objs[i].key));
    fr_wr w = FR_WR_ON(buf);
    fr_wr_object(&w, &objs[i]);
    json_array_append_new(success, fr_etcd_op_put(ok, on, w.p, w.len, lease));
    fr_wr_free(&w);
  }
  int rc = fr_etcd_txn(e, compare, success, failure, &j, done, &resp, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  fr_etcd_kv node;
  *again = !*done && fr_etcd_range_kv(fr_etcd_response(resp, 0, "response_range"), &node) &&
           node.found && node.lease == lease; /* a key or its marker moved since: send it again */
  for (size_t i = 0; *done && i < n; i++) {
    put_replaced(&objs[i], json_object_get(fr_etcd_response(resp, i, "response_put"), "prev_kv"),
                 &replaced[i], &had_other[i]);
    status[i] = 0;
  }
  json_decref(j);
  return 0;
}

/* How many objects from objs[0] go in one txn: of one owner, keys distinct (etcd refuses a txn
 * that puts a key twice), at most GROUP_MAX (two compares each and the owner's: at most
 * FR_ETCD_TXN_OPS compares). */
static size_t group_of(const fr_dir_object *objs, size_t n) {
  size_t m = 1;
  for (; m < n && m < GROUP_MAX && strcmp(objs[m].owner, objs[0].owner) == 0; m++)
    for (size_t k = 0; k < m; k++)
      if (strcmp(objs[k].key, objs[m].key) == 0)
        return m;
  return m;
}

/* Objects of one owner go in txns of up to GROUP_MAX puts (once this client knows the owner's
 * lease), a group sent again while only a key or marker moved; a put that must keep others'
 * records, or of a group whose owner is not on the lease cached (or that kept losing), one by
 * one. */
static int etcd_obj_put_batch(void *st, const fr_dir_object *objs, size_t n, unsigned flags,
                              int *status, fr_dir_object *replaced, bool *had_other,
                              int timeout_ms) {
  fr_etcd *e = st;
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  for (size_t i = 0; i < n;) {
    size_t m = flags & FR_DIR_PUT_KEEP_OTHERS ? 1 : group_of(objs + i, n - i);
    int64_t lease = m > 1 ? fr_etcd_lease_cached(e, objs[i].owner, 0) : 0;
    bool done = false, again = lease != 0;
    for (size_t k = i; k < i + m; k++)
      had_other[k] = false;
    int rc = 0;
    for (int t = 0; rc == 0 && again && t < TRIES; t++)
      rc = put_group(e, objs + i, m, lease, status + i, replaced + i, had_other + i, &done, &again,
                     deadline, timeout_ms);
    if (rc != 0)
      return rc;
    for (size_t k = i; !done && k < i + (lease ? m : 1); k++) {
      status[k] =
          obj_put_until(e, &objs[k], flags, &replaced[k], &had_other[k], deadline, timeout_ms);
      if (status[k] != 0 && status[k] != FERRY_ENOTFOUND && status[k] != FERRY_EEXIST)
        return status[k]; /* the cluster did not answer: the rest would fail alike */
    }
    i += done || lease ? m : 1; /* without a lease known, one put learns it for the rest */
  }
  return 0;
}

/* Up to FR_ETCD_TXN_OPS keys in one txn of ranges. */
static int get_some(fr_etcd *e, const char *const *keys, size_t n, fr_dir_object *out, int *status,
                    uint64_t deadline, int timeout_ms) {
  json_t *success = json_array(), *j, *resp;
  for (size_t i = 0; i < n; i++) {
    char k[FR_ETCD_KEY_BYTES];
    size_t kn = fr_etcd_key_of(e, 'o', keys[i], k);
    json_array_append_new(success, fr_etcd_op_range(k, kn));
  }
  bool ok;
  int rc = fr_etcd_txn(e, json_array(), success, NULL, &j, &ok, &resp, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  if (!ok || json_array_size(resp) != n)
    rc = fr_etcd_malformed(e, "a lookup");
  for (size_t i = 0; rc == 0 && i < n; i++) {
    fr_etcd_kv v;
    if (!fr_etcd_range_kv(fr_etcd_response(resp, i, "response_range"), &v))
      rc = fr_etcd_malformed(e, "a lookup");
    else
      status[i] = v.found && fr_etcd_object_of(&v, keys[i], &out[i]) ? 0 : FERRY_ENOTFOUND;
  }
  json_decref(j);
  return rc;
}

static int etcd_obj_get(void *st, const char *const *keys, size_t n, fr_dir_object *out,
                        int *status, int timeout_ms) {
  fr_etcd *e = st;
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  if (n == 1) { /* a plain range: cheaper than a txn */
    char k[FR_ETCD_KEY_BYTES];
    fr_etcd_key_of(e, 'o', keys[0], k);
    fr_etcd_kv v;
    int rc = fr_etcd_get_key(e, k, &v, deadline, timeout_ms);
    if (rc == 0)
      status[0] = v.found && fr_etcd_object_of(&v, keys[0], &out[0]) ? 0 : FERRY_ENOTFOUND;
    return rc;
  }
  for (size_t i = 0; i < n; i += FR_ETCD_TXN_OPS) {
    size_t m = n - i < FR_ETCD_TXN_OPS ? n - i : FR_ETCD_TXN_OPS;
    int rc = get_some(e, keys + i, m, out + i, status + i, deadline, timeout_ms);
    if (rc != 0)
      return rc;
  }
  return 0;
}

static int not_found(const char *key, const char *owner) {
  return fr_err(FERRY_ENOTFOUND, "no object '%s'%s%s", key, owner && *owner ? " of " : "",
                owner ? owner : "");
}

/* Deletes the key if it is still at mod revision `mod` (0: whatever it holds, unmodified since
 * this client's last answer, so that a delete left with a stopped member and run late cannot
 * remove a record put after it was sent), an object's (key not NULL) with its delete marker.
 * *ran: the compare held (else the key moved: read or send it again); *done: it was there to
 * delete; *deleted its record. */
static int delete_at(fr_etcd *e, const char *k, size_t kn, int64_t mod, const char *key, bool *ran,
                     bool *done, fr_dir_object *deleted, uint64_t deadline, int timeout_ms) {
  json_t *compare = json_array(), *success = json_array(), *j, *resp;
  json_array_append_new(compare, mod ? fr_etcd_cmp(k, kn, "MOD", "mod_revision", mod)
                                     : fr_etcd_cmp_unchanged(e, k, kn));
  json_array_append_new(success, fr_etcd_op_delete(k, kn));
  if (key)
    json_array_append_new(success, fr_etcd_op_mark(e, key));
  int rc = fr_etcd_txn(e, compare, success, NULL, &j, ran, &resp, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  json_t *prev = json_object_get(fr_etcd_response(resp, 0, "response_delete_range"), "prev_kvs");
  fr_etcd_kv v;
  fr_dir_object rec;
  *done = *ran && json_array_size(prev) == 1 && fr_etcd_kv_read(json_array_get(prev, 0), &v);
  if (*done && deleted && fr_etcd_object_of(&v, key, &rec))
    *deleted = rec;
  json_decref(j);
  return 0;
}

/* A delete that found nothing to delete still puts the key's marker: a put sent before it, left
 * with a stopped member and run late, must not create the key after the delete said it is gone. */
static int mark_deleted(fr_etcd *e, const char *key, uint64_t deadline, int timeout_ms) {
  json_t *success = json_array(), *j, *resp;
  json_array_append_new(success, fr_etcd_op_mark(e, key));
  bool ok;
  int rc = fr_etcd_txn(e, json_array(), success, NULL, &j, &ok, &resp, deadline, timeout_ms);
  if (rc == 0)
    json_decref(j);
  return rc;
}

static int etcd_obj_del(void *st, const char *key, const char *owner, uint64_t generation,
                        fr_dir_object *deleted, int timeout_ms) {
  fr_etcd *e = st;
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  char k[FR_ETCD_KEY_BYTES];
  size_t kn = fr_etcd_key_of(e, 'o', key, k);
  for (int i = 0; i < TRIES; i++) {
    int64_t mod = 0;
    if (owner && *owner) { /* read, check, then delete only what was read */
      fr_etcd_kv v;
      fr_dir_object rec;
      int rc = fr_etcd_get_key(e, k, &v, deadline, timeout_ms);
      if (rc != 0)
        return rc;
      if (!v.found || !fr_etcd_object_of(&v, key, &rec) || strcmp(rec.owner, owner) != 0 ||
          (generation && rec.generation != generation))
        return (rc = mark_deleted(e, key, deadline, timeout_ms)) ? rc : not_found(key, owner);
      mod = v.mod;
    }
    bool ran = false, done = false;
    int rc = delete_at(e, k, kn, mod, key, &ran, &done, deleted, deadline, timeout_ms);
    if (rc != 0)
      return rc;
    if (done || (ran && !mod)) /* deleted, or nothing there to delete (its marker put) */
      return done ? 0 : not_found(key, owner);
  }
  return dead_line(timeout_ms, e, "the record");
}

/* ---- lifecycle ---- */

static int etcd_open(ferry_ctx *ctx, const char *where, int timeout_ms, void **state) {
  fr_etcd *e = calloc(1, sizeof *e);
  if (!e)
    return fr_err(FERRY_ENOMEM, "etcd client");
  char url[FR_DIR_ADDRESS_MAX + 16];
  snprintf(url, sizeof url, "etcd://%s", where);
  fr_url_redact(url, e->m.shown, sizeof e->m.shown);
  int rc = fr_etcd_url_parse(url, &e->m.u);
  if (rc != 0) {
    free(e);
    return rc;
  }
  snprintf(e->prefix, sizeof e->prefix, e->m.u.ns[0] ? "ferry@%s/" : "ferry/", e->m.u.ns);
  e->prefix_len = strlen(e->prefix);
  e->epoch = 1;
  fr_etcd_lanes_init(e);
  pthread_mutex_init(&e->cache_lock, NULL);
  /* one answer now, so a URL where nothing answers fails the open, as the other backends do */
  timeout_ms = timeout_ms > 0 ? timeout_ms : 1000;
  char k[FR_ETCD_KEY_BYTES];
  fr_etcd_key_of(e, 'n', "", k);
  fr_etcd_kv v;
  rc = fr_etcd_get_key(e, k, &v, fr_deadline_ns(timeout_ms), timeout_ms);
  if (rc != 0) {
    fr_etcd_lanes_close(e);
    pthread_mutex_destroy(&e->cache_lock);
    free(e);
    return rc;
  }
  *state = e;
  return 0;
}

static void etcd_close(void *state) {
  fr_etcd *e = state;
  if (!e)
    return;
  fr_etcd_lanes_close(e);
  pthread_mutex_destroy(&e->cache_lock);
  free(e);
}

static uint64_t etcd_epoch(void *state) {
  fr_etcd *e = state;
  return __atomic_load_n(&e->epoch, __ATOMIC_ACQUIRE);
}

const fr_dir_ops fr_dir_etcd_ops = {
    .scheme = "etcd://",
    .open = etcd_open,
    .close = etcd_close,
    .epoch = etcd_epoch,
    .node_put = etcd_node_put,
    .node_renew = etcd_node_renew,
    .node_get = etcd_node_get,
    .node_list = etcd_node_list,
    .node_del = etcd_node_del,
    .obj_put = etcd_obj_put,
    .obj_put_batch = etcd_obj_put_batch,
    .obj_get = etcd_obj_get,
    .obj_del = etcd_obj_del,
    .obj_scan = etcd_obj_scan,
};
