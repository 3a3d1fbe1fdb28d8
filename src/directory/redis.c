/*
 * The Redis directory backend, for fleets that want Redis' replication and failover: redis://
 * [[USER]:PASSWORD@]HOST[:PORT][/DB], rediss://... (TLS) and redis+sentinel://S1,S2,S3/NAME[/DB]
 * (the primary the sentinels name; url.c reads all three). Records live under "ferry:" keys: a
 * node is a hash ferry:n:NAME {addr, flags, inc, acc} with the lease as its TTL (inc: the
 * incarnation that holds the name; acc: its access blob in hex); an object is a hash
 * ferry:o:KEY {owner, gen, rec} (rec is the dirwire encoding) whose TTL follows its owner's;
 * ferry:s:NAME lists the keys a node owns so a renewal can extend them all. Each multi-step
 * operation is one Lua script, so it is atomic. One connection (redis_conn.c), serialized by a
 * mutex, redialled once per call after a broken connection; every dial sends AUTH (when the URL
 * has a password) before SELECT, and behind Sentinel asks the sentinels first and checks ROLE.
 * Every call returns by its caller's deadline, whatever the server does (see "connection"
 * below). Messages name the server by its redacted URL only.
 */
#include "directory/dirwire.h"
#include "directory/redis_conn.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct rds {
  pthread_mutex_t lock;
  fr_redis_url u;
  char shown[FR_DIR_ADDRESS_MAX + 1];     /* the URL, redacted */
  char primary[FR_DIR_ADDRESS_MAX + 300]; /* behind Sentinel: shown and the primary's address */
  fr_rtls *tls;                           /* rediss:// */
  fr_rconn *c;
  uint64_t epoch; /* atomic: read without the lock, which a call may hold for its whole timeout */
  /* "ferry:", or "ferry@NS:" for a URL's ?ns=NS (issue 36): every key, scan and script stays
   * under it, so fleets sharing one Redis neither see nor delete each other's records */
  char prefix[FR_DIR_NS_MAX + 8];
  size_t prefix_len;
} rds;

/* A name is held by one incarnation at a time: another one's live record is answered with
 * {1, inc, addr, flags, pttl} unless ARGV[5] names it (verified dead). A new holder starts clean:
 * whatever an earlier incarnation left under the name goes. */
static const char node_put_lua[] =
    "local cur = redis.call('HMGET', KEYS[1], 'inc', 'addr', 'flags') "
    "if cur[1] == ARGV[4] then "
    "  redis.call('HSET', KEYS[1], 'addr', ARGV[1], 'flags', ARGV[2], 'acc', ARGV[7]) "
    "  redis.call('PEXPIRE', KEYS[1], ARGV[3]) return {0} end "
    "if cur[1] and cur[1] ~= ARGV[5] then "
    "  return {1, cur[1], cur[2] or '', cur[3] or '0', redis.call('PTTL', KEYS[1])} end "
    "for _, k in ipairs(redis.call('SMEMBERS', KEYS[2])) do "
    "  if redis.call('HGET', k, 'owner') == ARGV[6] then redis.call('DEL', k) end "
    "end "
    "redis.call('DEL', KEYS[1], KEYS[2]) "
    "redis.call('HSET', KEYS[1], 'addr', ARGV[1], 'flags', ARGV[2], 'inc', ARGV[4], 'acc', "
    "  ARGV[7]) "
    "redis.call('PEXPIRE', KEYS[1], ARGV[3]) return {0}";

static const char renew_lua[] =
    "if redis.call('HGET', KEYS[1], 'inc') ~= ARGV[3] then return -1 end "
    "if redis.call('PEXPIRE', KEYS[1], ARGV[2]) == 0 then return -1 end "
    "local ks = redis.call('SMEMBERS', KEYS[2]) "
    "for _, k in ipairs(ks) do "
    "  if redis.call('HGET', k, 'owner') == ARGV[1] then redis.call('PEXPIRE', k, ARGV[2]) "
    "  else redis.call('SREM', KEYS[2], k) end "
    "end "
    "redis.call('PEXPIRE', KEYS[2], ARGV[2]) return #ks";

static const char node_del_lua[] =
    "local cur = redis.call('HGET', KEYS[1], 'inc') "
    "if ARGV[2] ~= '0' and cur and cur ~= ARGV[2] then return 0 end "
    "for _, k in ipairs(redis.call('SMEMBERS', KEYS[2])) do "
    "  if redis.call('HGET', k, 'owner') == ARGV[1] then redis.call('DEL', k) end "
    "end "
    "redis.call('DEL', KEYS[1], KEYS[2]) return 1";

/* The object's TTL is whatever is left of its owner's lease. */
static const char obj_put_lua[] =
    "local ttl = redis.call('PTTL', KEYS[3]) "
    "if ttl <= 0 then return {-1} end "
    "local old = redis.call('HMGET', KEYS[1], 'owner', 'rec') "
    "local other = old[1] and old[1] ~= ARGV[1] "
    "if other and ARGV[4] == '1' then return {-2, old[1]} end "
    "redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'gen', ARGV[2], 'rec', ARGV[3]) "
    "redis.call('PEXPIRE', KEYS[1], ttl) "
    "redis.call('SADD', KEYS[2], KEYS[1]) redis.call('PEXPIRE', KEYS[2], ttl) "
    "if other then return {1, old[2]} end return {0}";

static const char obj_del_lua[] =
    "local v = redis.call('HMGET', KEYS[1], 'owner', 'gen', 'rec') "
    "if not v[1] then return false end "
    "if ARGV[1] ~= '' and (v[1] ~= ARGV[1] or (ARGV[2] ~= '0' and v[2] ~= ARGV[2])) then "
    "  return false end "
    "redis.call('DEL', KEYS[1]) return v[3]";

/* ---- connection ---- */

/* Every call carries the caller's deadline: the mutex is waited for until it, and every step on
 * the connection (redis_conn.c) waits no later than it; a redial happens only while time is
 * left. A server that accepts but does not answer (SIGSTOPped, swapping) therefore costs the
 * caller its timeout, never the connection's. */

/* An error reply: FERRY_EAUTH when the server wants (another) password, else `other`. */
static int error_reply(const rds *r, const char *what, const char *msg, int other) {
  if (strncmp(msg, "NOAUTH", 6) == 0)
    return fr_err(FERRY_EAUTH,
                  "Redis at %s requires a password (NOAUTH): give it in the URL, "
                  "redis://[USER]:PASSWORD@HOST:PORT",
                  r->shown);
  if (strcmp(what, "AUTH") == 0 || strncmp(msg, "WRONGPASS", 9) == 0)
    return fr_err(FERRY_EAUTH, "Redis at %s refused the password (AUTH): %s", r->shown, msg);
  return fr_err(other, "Redis at %s: %s: %s", r->shown, what, msg);
}

/* An error reply that means "this is no longer the primary" (a failover moved it): behind
 * Sentinel the connection is dropped and the sentinels are asked again. */
static bool not_primary(const rds *r, const char *msg) {
  return r->u.sentinels && (strncmp(msg, "READONLY", 8) == 0 ||
                            strncmp(msg, "MASTERDOWN", 10) == 0 || strncmp(msg, "LOADING", 7) == 0);
}

/* One setup command on a fresh connection: 0 or its failure. */
static int setup_call(const rds *r, fr_rconn *c, int argc, const char **argv, uint64_t deadline,
                      int timeout_ms) {
  redisReply *rep;
  int rc = fr_rconn_call(c, argc, argv, NULL, &rep, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  if (rep->type == REDIS_REPLY_ERROR)
    rc = error_reply(r, argv[0], rep->str, FERRY_EINVAL);
  freeReplyObject(rep);
  return rc;
}

/* Behind Sentinel: whether the server the sentinels named is the primary now (ROLE). */
static int check_primary(const rds *r, fr_rconn *c, uint64_t deadline, int timeout_ms) {
  const char *argv[1] = {"ROLE"};
  redisReply *rep;
  int rc = fr_rconn_call(c, 1, argv, NULL, &rep, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  bool primary = rep->type == REDIS_REPLY_ARRAY && rep->elements >= 1 &&
                 rep->element[0]->type == REDIS_REPLY_STRING &&
                 strcmp(rep->element[0]->str, "master") == 0;
  if (!primary)
    rc = fr_err(FERRY_ECONNECT,
                "Redis at %s: the server the sentinels named is not the primary "
                "(a failover under way?)",
                r->primary);
  freeReplyObject(rep);
  return rc;
}

/* AUTH (when the URL has a password), SELECT (db != 0); without either, a PING tells at once
 * whether the server wants a password rather than at the first real command. */
static int setup(const rds *r, fr_rconn *c, uint64_t deadline, int timeout_ms) {
  char db[16];
  snprintf(db, sizeof db, "%d", r->u.db);
  const char *auth[3] = {"AUTH", r->u.user[0] ? r->u.user : r->u.password, r->u.password};
  const char *select[2] = {"SELECT", db}, *ping[1] = {"PING"};
  int rc = 0;
  if (r->u.auth)
    rc = setup_call(r, c, r->u.user[0] ? 3 : 2, auth, deadline, timeout_ms);
  if (rc == 0 && r->u.db)
    rc = setup_call(r, c, 2, select, deadline, timeout_ms);
  if (rc == 0 && !r->u.auth && !r->u.db)
    rc = setup_call(r, c, 1, ping, deadline, timeout_ms);
  if (rc == 0 && r->u.sentinels)
    rc = check_primary(r, c, deadline, timeout_ms);
  return rc;
}

/* A connection to host:port, set up: it becomes the client's, and the epoch moves (a new
 * connection may meet another server, or a restarted one, without the records). Lock held. */
static int dial_at(rds *r, const char *host, int port, const char *shown, uint64_t deadline,
                   int timeout_ms) {
  fr_rconn *c = NULL;
  int rc = fr_rconn_open(host, port, r->tls, shown, deadline, timeout_ms, &c);
  if (rc == 0)
    rc = setup(r, c, deadline, timeout_ms);
  if (rc != 0) {
    fr_rconn_close(c);
    return rc;
  }
  r->c = c;
  __atomic_add_fetch(&r->epoch, 1, __ATOMIC_ACQ_REL);
  return 0;
}

/* Behind Sentinel: asks the sentinels where the primary is and dials it, again and again until
 * one answers as the primary or the deadline passes (during a failover the sentinels name the
 * old primary, which is gone, until they have promoted a replica). */
static int dial_primary(rds *r, uint64_t deadline, int timeout_ms) {
  for (;;) {
    char host[256];
    int port = 0;
    int rc = fr_rconn_sentinel_primary(&r->u, deadline, timeout_ms, host, sizeof host, &port);
    if (rc == 0) {
      snprintf(r->primary, sizeof r->primary, "%s (primary %s:%d)", r->shown, host, port);
      rc = dial_at(r, host, port, r->primary, deadline, timeout_ms);
    }
    int left = fr_ms_left(deadline);
    if (rc == 0 || rc == FERRY_EAUTH || rc == FERRY_EINVAL || left <= 0)
      return rc == 0
                 ? 0
                 : fr_err_wrap(rc, "Redis at %s: no primary within %d ms", r->shown, timeout_ms);
    struct timespec pause = {0, (long)(left < 100 ? left : 100) * 1000000L};
    nanosleep(&pause, NULL);
  }
}

static int dial(rds *r, uint64_t deadline, int timeout_ms) {
  return r->u.sentinels ? dial_primary(r, deadline, timeout_ms)
                        : dial_at(r, r->u.host, r->u.port, r->shown, deadline, timeout_ms);
}

/* Drops the connection: after a timeout its reply may still come, and would answer the next
 * command. Lock held. */
static void hang_up(rds *r) {
  fr_rconn_close(r->c);
  r->c = NULL;
}

/* Runs one command (binary-safe argv), redialling once after a broken connection (not after a
 * timeout: a server that does not answer would only cost the caller more), or, behind Sentinel,
 * after an answer that this is no longer the primary. Lock held. */
static int command(rds *r, int argc, const char **argv, const size_t *lens, redisReply **out,
                   uint64_t deadline, int timeout_ms) {
  for (int attempt = 0; attempt < 2; attempt++) {
    int rc = r->c ? 0 : dial(r, deadline, timeout_ms);
    if (rc != 0)
      return rc;
    redisReply *rep = NULL;
    rc = fr_rconn_call(r->c, argc, argv, lens, &rep, deadline, timeout_ms);
    if (rc == 0 && rep->type == REDIS_REPLY_ERROR && not_primary(r, rep->str))
      rc = fr_err(FERRY_ECONNECT, "Redis at %s: %s: %s", r->primary, argv[0], rep->str);
    else if (rc == 0 && rep->type == REDIS_REPLY_ERROR)
      rc = error_reply(r, argv[0], rep->str, FERRY_EPROTO);
    else if (rc == 0) {
      *out = rep;
      return 0;
    }
    if (rep) {
      freeReplyObject(rep);
      if (rc != FERRY_ECONNECT)
        return rc;
    }
    hang_up(r);
    if (rc != FERRY_ECONNECT)
      return rc;
    fr_warn("%s; reconnecting", ferry_last_error());
  }
  return fr_err(FERRY_ECONNECT, "Redis at %s stopped answering", r->shown);
}

/* Takes the connection's mutex, waiting no later than the deadline (another caller may be
 * waiting out its own timeout on a server that does not answer). */
static int lock_until(rds *r, uint64_t deadline, int timeout_ms) {
  if (fr_mutex_lock_until(&r->lock, deadline) == 0)
    return 0;
  return fr_err(FERRY_ETIMEDOUT,
                "Redis at %s: the connection stayed busy with another call for %d ms", r->shown,
                timeout_ms);
}

/* Builds an argv of NUL-terminated strings (lengths by strlen, or given in lens). */
typedef struct args {
  const char *v[12];
  size_t len[12];
  int n;
} args;

static void arg(args *a, const char *s, size_t len) {
  a->v[a->n] = s;
  a->len[a->n++] = len == (size_t)-1 ? strlen(s) : len;
}
#define ARG(a, s) arg((a), (s), (size_t)-1)

/* One command within the caller's deadline; timeout_ms only words the error. */
static int run_until(rds *r, args *a, redisReply **out, uint64_t deadline, int timeout_ms) {
  int rc = lock_until(r, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  rc = command(r, a->n, a->v, a->len, out, deadline, timeout_ms);
  pthread_mutex_unlock(&r->lock);
  return rc;
}

static int run(rds *r, args *a, redisReply **out, int timeout_ms) {
  return run_until(r, a, out, fr_deadline_ns(timeout_ms), timeout_ms);
}

static void key_of(const rds *r, char *out, size_t cap, char kind, const char *name) {
  snprintf(out, cap, "%s%c:%s", r->prefix, kind, name);
}

/* A node's access blob travels as hex (n bytes: 2n digits and a NUL in out). */
static const char hex_digits[] = "0123456789abcdef";

static void hex_of(const uint8_t *p, size_t n, char *out) {
  for (size_t i = 0; i < n; i++) {
    out[2 * i] = hex_digits[p[i] >> 4];
    out[2 * i + 1] = hex_digits[p[i] & 15];
  }
  out[2 * n] = '\0';
}

/* The bytes of a hex string of at most FR_DIR_ACCESS_MAX bytes; 0 (none) when it is not one. */
static size_t bytes_of_hex(const char *s, uint8_t *out) {
  size_t n = strlen(s);
  if (n % 2 || n / 2 > FR_DIR_ACCESS_MAX)
    return 0;
  for (size_t i = 0; i < n; i++) {
    const char *d = s[i] ? strchr(hex_digits, s[i]) : NULL;
    if (!d)
      return 0;
    uint8_t v = (uint8_t)(d - hex_digits);
    out[i / 2] = i % 2 ? (uint8_t)(out[i / 2] | v) : (uint8_t)(v << 4);
  }
  return n / 2;
}

/* ---- nodes ---- */

static int rds_node_put(void *st, const fr_dir_node *n, int lease_ms, uint64_t takeover,
                        fr_dir_node *holder, int timeout_ms) {
  char k[FR_DIR_NAME_MAX + FR_DIR_NS_MAX + 16], set[FR_DIR_NAME_MAX + FR_DIR_NS_MAX + 16],
      flags[16], lease[16], inc[24], over[24], acc[2 * FR_DIR_ACCESS_MAX + 1];
  hex_of(n->access, n->access_len <= FR_DIR_ACCESS_MAX ? n->access_len : 0, acc);
  key_of(st, k, sizeof k, 'n', n->name);
  key_of(st, set, sizeof set, 's', n->name);
  snprintf(flags, sizeof flags, "%u", n->flags);
  snprintf(lease, sizeof lease, "%d", lease_ms < 100 ? 100 : lease_ms);
  snprintf(inc, sizeof inc, "%llu", (unsigned long long)n->incarnation);
  snprintf(over, sizeof over, "%llu", (unsigned long long)takeover);
  args a = {0};
  ARG(&a, "EVAL"), ARG(&a, node_put_lua), ARG(&a, "2"), ARG(&a, k), ARG(&a, set);
  ARG(&a, n->address), ARG(&a, flags), ARG(&a, lease), ARG(&a, inc), ARG(&a, over);
  ARG(&a, n->name), ARG(&a, acc);
  redisReply *rep;
  int rc = run(st, &a, &rep, timeout_ms);
  if (rc != 0)
    return rc;
  bool ok = rep->type == REDIS_REPLY_ARRAY && rep->elements >= 1 &&
            rep->element[0]->type == REDIS_REPLY_INTEGER;
  if (ok && rep->element[0]->integer == 1 && rep->elements == 5) {
    fr_dir_node h;
    memset(&h, 0, sizeof h);
    fr_str_copy(h.name, sizeof h.name, n->name);
    h.incarnation = strtoull(rep->element[1]->str ? rep->element[1]->str : "0", NULL, 10);
    fr_str_copy(h.address, sizeof h.address, rep->element[2]->str ? rep->element[2]->str : "");
    h.flags = (uint32_t)strtoul(rep->element[3]->str ? rep->element[3]->str : "0", NULL, 10);
    long long left = rep->element[4]->integer;
    if (holder)
      *holder = h;
    rc = fr_dir_name_taken(&h, left > 0 ? (uint32_t)left : 0);
  } else if (!ok || rep->element[0]->integer != 0) {
    rc = fr_err(FERRY_EPROTO, "Redis node put '%s': unexpected reply", n->name);
  }
  freeReplyObject(rep);
  return rc;
}

static int rds_node_renew(void *st, const char *name, uint64_t incarnation, int lease_ms,
                          int timeout_ms) {
  char k[FR_DIR_NAME_MAX + FR_DIR_NS_MAX + 16], s[FR_DIR_NAME_MAX + FR_DIR_NS_MAX + 16], lease[16],
      inc[24];
  key_of(st, k, sizeof k, 'n', name);
  key_of(st, s, sizeof s, 's', name);
  snprintf(lease, sizeof lease, "%d", lease_ms < 100 ? 100 : lease_ms);
  snprintf(inc, sizeof inc, "%llu", (unsigned long long)incarnation);
  args a = {0};
  ARG(&a, "EVAL"), ARG(&a, renew_lua), ARG(&a, "2"), ARG(&a, k), ARG(&a, s), ARG(&a, name);
  ARG(&a, lease), ARG(&a, inc);
  redisReply *rep;
  int rc = run(st, &a, &rep, timeout_ms);
  if (rc != 0)
    return rc;
  bool lapsed = rep->type == REDIS_REPLY_INTEGER && rep->integer < 0;
  freeReplyObject(rep);
  return lapsed ? fr_err(FERRY_ENOTFOUND, "node '%s' is not registered (its lease lapsed?)", name)
                : 0;
}

static bool reply_to_node(const char *name, redisReply *rep, fr_dir_node *out) {
  if (rep->type != REDIS_REPLY_ARRAY || rep->elements != 4 ||
      rep->element[0]->type != REDIS_REPLY_STRING)
    return false;
  memset(out, 0, sizeof *out);
  fr_str_copy(out->name, sizeof out->name, name);
  fr_str_copy(out->address, sizeof out->address, rep->element[0]->str);
  if (rep->element[1]->type == REDIS_REPLY_STRING)
    out->flags = (uint32_t)strtoul(rep->element[1]->str, NULL, 10);
  if (rep->element[2]->type == REDIS_REPLY_STRING)
    out->incarnation = strtoull(rep->element[2]->str, NULL, 10);
  if (rep->element[3]->type == REDIS_REPLY_STRING)
    out->access_len = (uint16_t)bytes_of_hex(rep->element[3]->str, out->access);
  return true;
}

static int node_get_until(rds *r, const char *name, fr_dir_node *out, uint64_t deadline,
                          int timeout_ms) {
  char k[FR_DIR_NAME_MAX + FR_DIR_NS_MAX + 16];
  key_of(r, k, sizeof k, 'n', name);
  args a = {0};
  ARG(&a, "HMGET"), ARG(&a, k), ARG(&a, "addr"), ARG(&a, "flags"), ARG(&a, "inc");
  ARG(&a, "acc");
  redisReply *rep;
  int rc = run_until(r, &a, &rep, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  fr_dir_node n;
  bool ok = reply_to_node(name, rep, &n);
  freeReplyObject(rep);
  if (!ok)
    return fr_err(FERRY_ENOTFOUND, "no node '%s' in the directory", name);
  *out = n;
  return 0;
}

static int rds_node_get(void *st, const char *name, fr_dir_node *out, int timeout_ms) {
  return node_get_until(st, name, out, fr_deadline_ns(timeout_ms), timeout_ms);
}

static int rds_node_del(void *st, const char *name, uint64_t incarnation, int timeout_ms) {
  char k[FR_DIR_NAME_MAX + FR_DIR_NS_MAX + 16], s[FR_DIR_NAME_MAX + FR_DIR_NS_MAX + 16], inc[24];
  key_of(st, k, sizeof k, 'n', name);
  key_of(st, s, sizeof s, 's', name);
  snprintf(inc, sizeof inc, "%llu", (unsigned long long)incarnation);
  args a = {0};
  ARG(&a, "EVAL"), ARG(&a, node_del_lua), ARG(&a, "2"), ARG(&a, k), ARG(&a, s), ARG(&a, name);
  ARG(&a, inc);
  redisReply *rep;
  int rc = run(st, &a, &rep, timeout_ms);
  if (rc == 0)
    freeReplyObject(rep);
  return rc;
}

/* ---- SCAN: every key matching a pattern ---- */

typedef struct keylist {
  char **v;
  size_t n, cap;
} keylist;

static void keylist_free(keylist *l) {
  for (size_t i = 0; i < l->n; i++)
    free(l->v[i]);
  free(l->v);
}

static int keylist_add(keylist *l, const char *s, size_t len) {
  if (FR_GROW(l->v, l->cap, l->n + 1, 64) != 0)
    return fr_err(FERRY_ENOMEM, "scan");
  char *c = malloc(len + 1);
  if (!c)
    return fr_err(FERRY_ENOMEM, "scan");
  memcpy(c, s, len);
  c[len] = '\0';
  l->v[l->n++] = c;
  return 0;
}

/* Every SCAN round trip within the one deadline. */
static int scan_keys(rds *r, const char *pattern, keylist *out, uint64_t deadline, int timeout_ms) {
  char cursor[32] = "0";
  int rc = 0;
  do {
    args a = {0};
    ARG(&a, "SCAN"), ARG(&a, cursor), ARG(&a, "MATCH"), ARG(&a, pattern), ARG(&a, "COUNT");
    ARG(&a, "1000");
    redisReply *rep;
    if ((rc = run_until(r, &a, &rep, deadline, timeout_ms)) != 0)
      break;
    if (rep->type != REDIS_REPLY_ARRAY || rep->elements != 2) {
      freeReplyObject(rep);
      rc = fr_err(FERRY_EPROTO, "Redis SCAN: unexpected reply");
      break;
    }
    fr_str_copy(cursor, sizeof cursor, rep->element[0]->str);
    redisReply *keys = rep->element[1];
    for (size_t i = 0; rc == 0 && i < keys->elements; i++)
      rc = keylist_add(out, keys->element[i]->str, keys->element[i]->len);
    freeReplyObject(rep);
  } while (rc == 0 && strcmp(cursor, "0") != 0);
  return rc;
}

/* A glob pattern matching every key that starts with `prefix` after `head`. */
static void glob_prefix(char *out, size_t cap, const char *head, const char *prefix) {
  size_t n = fr_str_copy(out, cap, head);
  for (const char *p = prefix; *p && n + 3 < cap; p++) {
    if (strchr("*?[]\\", *p))
      out[n++] = '\\';
    out[n++] = *p;
  }
  out[n++] = '*';
  out[n] = '\0';
}

static int rds_node_list(void *st, fr_dir_node **out, size_t *count, int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  keylist keys = {0};
  const rds *r = st;
  char pattern[FR_DIR_NS_MAX + 16];
  snprintf(pattern, sizeof pattern, "%sn:*", r->prefix); /* no glob character in a namespace */
  int rc = scan_keys(st, pattern, &keys, deadline, timeout_ms);
  fr_dir_node *v = rc == 0 ? calloc(keys.n + 1, sizeof *v) : NULL;
  size_t n = 0;
  if (rc == 0 && !v)
    rc = fr_err(FERRY_ENOMEM, "node list");
  for (size_t i = 0; rc == 0 && i < keys.n; i++) {
    int g = node_get_until(st, keys.v[i] + r->prefix_len + 2, &v[n], deadline, timeout_ms);
    if (g == 0)
      n++;
    else if (g != FERRY_ENOTFOUND) /* expired between SCAN and HMGET: skip */
      rc = g;
  }
  keylist_free(&keys);
  if (rc != 0) {
    free(v);
    return rc;
  }
  *out = v;
  *count = n;
  return 0;
}

/* ---- objects ---- */

static int decode_rec(const char *data, size_t len, fr_dir_object *out) {
  fr_rd rd = fr_rd_init(data, len);
  fr_rd_object(&rd, out);
  return fr_rd_done(&rd) ? 0 : fr_err(FERRY_EPROTO, "Redis holds a malformed ferry record");
}

/* The EVAL of one object put (its buffers live in the struct). */
typedef struct put_cmd {
  char k[FR_DIR_KEY_MAX + FR_DIR_NS_MAX + 16], s[FR_DIR_NAME_MAX + FR_DIR_NS_MAX + 16],
      n[FR_DIR_NAME_MAX + FR_DIR_NS_MAX + 16], gen[24];
  fr_wr w;
  args a;
} put_cmd;

static int put_cmd_make(const rds *r, put_cmd *c, const fr_dir_object *o, unsigned flags) {
  memset(c, 0, sizeof *c);
  key_of(r, c->k, sizeof c->k, 'o', o->key);
  key_of(r, c->s, sizeof c->s, 's', o->owner);
  key_of(r, c->n, sizeof c->n, 'n', o->owner);
  snprintf(c->gen, sizeof c->gen, "%llu", (unsigned long long)o->generation);
  fr_wr_object(&c->w, o);
  if (c->w.failed) {
    fr_wr_free(&c->w);
    return fr_err(FERRY_ENOMEM, "put '%s'", o->key);
  }
  args *a = &c->a;
  ARG(a, "EVAL"), ARG(a, obj_put_lua), ARG(a, "3"), ARG(a, c->k), ARG(a, c->s), ARG(a, c->n);
  ARG(a, o->owner), ARG(a, c->gen), arg(a, (const char *)c->w.p, c->w.len);
  ARG(a, (flags & FR_DIR_PUT_KEEP_OTHERS) ? "1" : "0");
  return 0;
}

static int put_reply(const fr_dir_object *o, const redisReply *rep, fr_dir_object *replaced,
                     bool *had_other) {
  if (rep->type == REDIS_REPLY_ERROR)
    return fr_err(FERRY_EPROTO, "Redis put '%s': %s", o->key, rep->str);
  long long code = rep->type == REDIS_REPLY_ARRAY && rep->elements >= 1 &&
                           rep->element[0]->type == REDIS_REPLY_INTEGER
                       ? rep->element[0]->integer
                       : -99;
  int rc = 0;
  if (code == -1)
    rc = fr_err(FERRY_ENOTFOUND, "put '%s': node '%s' is not registered", o->key, o->owner);
  else if (code == -2 && rep->elements == 2)
    rc = fr_err(FERRY_EEXIST, "'%s' is now owned by '%s'", o->key, rep->element[1]->str);
  else if (code == 1 && rep->elements == 2)
    rc = replaced ? decode_rec(rep->element[1]->str, rep->element[1]->len, replaced) : 0;
  else if (code != 0)
    rc = fr_err(FERRY_EPROTO, "Redis put '%s': unexpected reply", o->key);
  if (rc == 0 && had_other)
    *had_other = code == 1;
  return rc;
}

static int rds_obj_put(void *st, const fr_dir_object *o, unsigned flags, fr_dir_object *replaced,
                       bool *had_other, int timeout_ms) {
  put_cmd c;
  int rc = put_cmd_make(st, &c, o, flags);
  if (rc != 0)
    return rc;
  redisReply *rep;
  rc = run(st, &c.a, &rep, timeout_ms);
  fr_wr_free(&c.w);
  if (rc != 0)
    return rc;
  rc = put_reply(o, rep, replaced, had_other);
  freeReplyObject(rep);
  return rc;
}

/* Reads a pipeline's next reply within the deadline; on failure the connection is dropped
 * (replies may be pending). Lock held. */
static int pipeline_reply(rds *r, redisReply **rep, const char *what, uint64_t deadline,
                          int timeout_ms) {
  *rep = NULL;
  int rc = fr_rconn_reply(r->c, rep, what, deadline, timeout_ms);
  if (rc == 0 && (*rep)->type == REDIS_REPLY_ERROR && not_primary(r, (*rep)->str)) {
    rc = fr_err(FERRY_ECONNECT, "Redis at %s: %s: %s", r->primary, what, (*rep)->str);
    freeReplyObject(*rep);
    *rep = NULL;
  }
  if (rc != 0)
    hang_up(r);
  return rc;
}

/* Every put pipelined on the connection, then every reply. Lock held. */
static int pipeline_put(rds *r, const fr_dir_object *objs, size_t n, unsigned flags, int *status,
                        fr_dir_object *replaced, bool *had_other, uint64_t deadline,
                        int timeout_ms) {
  int rc = r->c ? 0 : dial(r, deadline, timeout_ms);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    put_cmd c;
    if ((rc = put_cmd_make(r, &c, &objs[i], flags)) != 0)
      break;
    rc = fr_rconn_append(r->c, c.a.n, c.a.v, c.a.len);
    fr_wr_free(&c.w);
  }
  if (rc != 0 && r->c) /* half a pipeline may be queued: start over on a new connection */
    hang_up(r);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    redisReply *rep;
    if ((rc = pipeline_reply(r, &rep, "a put", deadline, timeout_ms)) != 0)
      break;
    had_other[i] = false;
    status[i] = put_reply(&objs[i], rep, &replaced[i], &had_other[i]);
    freeReplyObject(rep);
  }
  return rc;
}

static int rds_obj_put_batch(void *st, const fr_dir_object *objs, size_t n, unsigned flags,
                             int *status, fr_dir_object *replaced, bool *had_other,
                             int timeout_ms) {
  rds *r = st;
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  int rc = lock_until(r, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  rc = pipeline_put(r, objs, n, flags, status, replaced, had_other, deadline, timeout_ms);
  if (rc == FERRY_ECONNECT) /* one redial, as for single commands (the puts are idempotent) */
    rc = pipeline_put(r, objs, n, flags, status, replaced, had_other, deadline, timeout_ms);
  pthread_mutex_unlock(&r->lock);
  return rc;
}

static int pipeline_get(rds *r, const char *const *keys, size_t n, fr_dir_object *out, int *status,
                        uint64_t deadline, int timeout_ms) {
  int rc = r->c ? 0 : dial(r, deadline, timeout_ms);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    char k[FR_DIR_KEY_MAX + FR_DIR_NS_MAX + 16];
    key_of(r, k, sizeof k, 'o', keys[i]);
    const char *argv[3] = {"HGET", k, "rec"};
    rc = fr_rconn_append(r->c, 3, argv, NULL);
  }
  if (rc != 0 && r->c) /* half a pipeline may be queued: start over on a new connection */
    hang_up(r);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    redisReply *rep;
    if ((rc = pipeline_reply(r, &rep, "a lookup", deadline, timeout_ms)) != 0)
      break;
    status[i] = FERRY_ENOTFOUND;
    if (rep->type == REDIS_REPLY_STRING && decode_rec(rep->str, rep->len, &out[i]) == 0)
      status[i] = 0;
    freeReplyObject(rep);
  }
  return rc;
}

static int obj_get_until(rds *r, const char *const *keys, size_t n, fr_dir_object *out, int *status,
                         uint64_t deadline, int timeout_ms) {
  int rc = lock_until(r, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  rc = pipeline_get(r, keys, n, out, status, deadline, timeout_ms);
  if (rc == FERRY_ECONNECT) /* one redial, as for single commands */
    rc = pipeline_get(r, keys, n, out, status, deadline, timeout_ms);
  pthread_mutex_unlock(&r->lock);
  return rc;
}

static int rds_obj_get(void *st, const char *const *keys, size_t n, fr_dir_object *out, int *status,
                       int timeout_ms) {
  return obj_get_until(st, keys, n, out, status, fr_deadline_ns(timeout_ms), timeout_ms);
}

static int rds_obj_del(void *st, const char *key, const char *owner, uint64_t gen,
                       fr_dir_object *deleted, int timeout_ms) {
  char k[FR_DIR_KEY_MAX + FR_DIR_NS_MAX + 16], g[24];
  key_of(st, k, sizeof k, 'o', key);
  snprintf(g, sizeof g, "%llu", (unsigned long long)gen);
  args a = {0};
  ARG(&a, "EVAL"), ARG(&a, obj_del_lua), ARG(&a, "1"), ARG(&a, k), ARG(&a, owner ? owner : "");
  ARG(&a, g);
  redisReply *rep;
  int rc = run(st, &a, &rep, timeout_ms);
  if (rc != 0)
    return rc;
  if (rep->type != REDIS_REPLY_STRING)
    rc = fr_err(FERRY_ENOTFOUND, "no object '%s'%s%s", key, owner && *owner ? " of " : "",
                owner ? owner : "");
  else if (deleted)
    rc = decode_rec(rep->str, rep->len, deleted);
  freeReplyObject(rep);
  return rc;
}

static int rds_obj_scan(void *st, const char *prefix, fr_dir_object **out, size_t *count,
                        int timeout_ms) {
  const rds *r = st;
  char pattern[2 * FR_DIR_KEY_MAX + FR_DIR_NS_MAX + 16], head[FR_DIR_NS_MAX + 16];
  snprintf(head, sizeof head, "%so:", r->prefix);
  glob_prefix(pattern, sizeof pattern, head, prefix);
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  keylist keys = {0};
  int rc = scan_keys(st, pattern, &keys, deadline, timeout_ms);
  fr_dir_object *v = rc == 0 ? calloc(keys.n + 1, sizeof *v) : NULL;
  int *status = rc == 0 ? calloc(keys.n + 1, sizeof *status) : NULL;
  const char **names = rc == 0 ? calloc(keys.n + 1, sizeof *names) : NULL;
  if (rc == 0 && (!v || !status || !names))
    rc = fr_err(FERRY_ENOMEM, "scan: %zu records", keys.n);
  for (size_t i = 0; rc == 0 && i < keys.n; i++)
    names[i] = keys.v[i] + r->prefix_len + 2; /* the object key after "ferry:o:" */
  if (rc == 0)
    rc = obj_get_until(st, names, keys.n, v, status, deadline, timeout_ms);
  size_t n = 0;
  for (size_t i = 0; rc == 0 && i < keys.n; i++)
    if (status[i] == 0) /* expired between SCAN and HGET: skip */
      v[n++] = v[i];
  keylist_free(&keys);
  free(status);
  free(names);
  if (rc != 0) {
    free(v);
    return rc;
  }
  fr_dir_sort(v, n);
  *out = v;
  *count = n;
  return 0;
}

/* ---- lifecycle ---- */

static void rds_free(rds *r) {
  fr_rconn_close(r->c);
  fr_rtls_free(r->tls);
  explicit_bzero(r, sizeof *r);
  free(r);
}

/* Opens scheme + where, the whole URL. */
static int open_scheme(const char *scheme, const char *where, int timeout_ms, void **state) {
  rds *r = calloc(1, sizeof *r);
  if (!r)
    return fr_err(FERRY_ENOMEM, "redis client");
  char url[FR_DIR_ADDRESS_MAX + 32];
  snprintf(url, sizeof url, "%s%s", scheme, where);
  fr_url_redact(url, r->shown, sizeof r->shown);
  fr_str_copy(r->primary, sizeof r->primary, r->shown);
  int rc = fr_redis_url_parse(url, &r->u);
  explicit_bzero(url, sizeof url);
  snprintf(r->prefix, sizeof r->prefix, r->u.ns[0] ? "ferry@%s:" : "ferry:", r->u.ns);
  r->prefix_len = strlen(r->prefix);
  timeout_ms = timeout_ms > 0 ? timeout_ms : 1000;
  if (rc == 0 && r->u.tls)
    rc = fr_rtls_new(&r->u, r->shown, &r->tls);
  if (rc == 0)
    rc = dial(r, fr_deadline_ns(timeout_ms), timeout_ms);
  if (rc != 0) {
    rds_free(r);
    return rc;
  }
  pthread_mutex_init(&r->lock, NULL);
  *state = r;
  return 0;
}

/* The front door hands every URL that starts "redis" here (the scheme below), `where` what
 * follows: "://..." (plain), "s://..." (TLS) or "+sentinel://...". */
static int rds_open(ferry_ctx *ctx, const char *where, int timeout_ms, void **state) {
  if (strncmp(where, "://", 3) != 0 && strncmp(where, "s://", 4) != 0 &&
      strncmp(where, "+sentinel://", 12) != 0)
    return fr_err(FERRY_EINVAL, "directory 'redis...': unknown scheme (redis://, rediss:// or "
                                "redis+sentinel://)");
  return open_scheme("redis", where, timeout_ms, state);
}

static void rds_close(void *state) {
  rds *r = state;
  if (!r)
    return;
  pthread_mutex_destroy(&r->lock);
  rds_free(r);
}

/* Without the lock: every put asks (fr_dir_lease_current), and a call waiting on a server that
 * does not answer holds the lock for its whole timeout. */
static uint64_t rds_epoch(void *state) {
  rds *r = state;
  return __atomic_load_n(&r->epoch, __ATOMIC_ACQUIRE);
}

/* One table for the three URL forms: the scheme is their common start. */
const fr_dir_ops fr_dir_redis_ops = {
    .scheme = "redis",
    .open = rds_open,
    .close = rds_close,
    .epoch = rds_epoch,
    .node_put = rds_node_put,
    .node_renew = rds_node_renew,
    .node_get = rds_node_get,
    .node_list = rds_node_list,
    .node_del = rds_node_del,
    .obj_put = rds_obj_put,
    .obj_put_batch = rds_obj_put_batch,
    .obj_get = rds_obj_get,
    .obj_del = rds_obj_del,
    .obj_scan = rds_obj_scan,
};
