/*
 * The directory, internal view: where a fleet looks up nodes (name -> addresses) and objects
 * (key -> owner, region, offset, bytes, dtype, shape, generation). Backends are ops tables chosen
 * by URL scheme (directory.c lists them): ferry:// is the embedded server (server.c, client.c),
 * redis:// keeps the same records in Redis (redis.c), etcd:// in an etcd cluster (etcd.c,
 * etcd_client.c, etcd_http.c). A node holds a lease; when it lapses, the node's records vanish.
 * Jobs use the fr_dir_* calls below (the front door), never dir->ops.
 */
#ifndef FR_DIRECTORY_H
#define FR_DIRECTORY_H

#include "core/core.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define FR_DIR_KEY_MAX 255     /* bytes of an object key, NUL not included */
#define FR_DIR_NAME_MAX 63     /* bytes of a node name */
#define FR_DIR_ADDRESS_MAX 511 /* bytes of a node's address list */
#define FR_DIR_BATCH_MAX 1024  /* keys per multi-get message */
#define FR_DIR_SCAN_PAGE 512   /* records per scan reply */
#define FR_DIR_ACCESS_MAX 256  /* bytes of a node's region access blob */

/* Node flags. */
#define FR_NODE_HOLDER 1u /* holds objects for short-lived nodes (`ferry serve`) */

typedef struct fr_dir_node {
  char name[FR_DIR_NAME_MAX + 1];
  char address[FR_DIR_ADDRESS_MAX + 1];
  uint32_t flags;
  uint64_t incarnation; /* random per store open, never 0: tells a node's own re-registration
                           from another process claiming its name */
  /* Opaque (the transports' region access blob of its pool, transport/access.h): lets a reader
   * reach the pool without first asking the node for its keys. */
  uint16_t access_len;
  uint8_t access[FR_DIR_ACCESS_MAX];
} fr_dir_node;

typedef struct fr_dir_object {
  char key[FR_DIR_KEY_MAX + 1];
  char owner[FR_DIR_NAME_MAX + 1];
  ferry_region_ref region; /* where the bytes are, on the owner */
  uint64_t offset, bytes;
  ferry_region_ref gen_region; /* the generation word: valid while it equals `generation` */
  uint64_t gen_offset;
  uint64_t generation; /* never 0; unique per owner */
  ferry_tensor_desc desc;
} fr_dir_object;

/* A stamp of one key's records (fr_dir_ops.stamp). */
typedef struct fr_dir_stamp {
  uint64_t epoch, all, key;
} fr_dir_stamp;

static inline bool fr_dir_stamp_eq(const fr_dir_stamp *a, const fr_dir_stamp *b) {
  return a->epoch == b->epoch && a->all == b->all && a->key == b->key;
}

/* Object put flags. */
#define FR_DIR_PUT_KEEP_OTHERS                                                                     \
  1u /* do not replace a record another node owns (re-registration)                                \
      */
/* May return before the directory answered (ferry:// over shm: the server applies it before it
 * answers anything sent after the put returned, server.c); its answer is collected by settle(),
 * and until then the put reports success and no replaced record. */
#define FR_DIR_PUT_POSTED 2u

/* What settle() reports of a posted put that needs acting on: `status` is what the put would
 * have returned for `put` (the thread's error detail says why); when 0, `replaced` is the record
 * of another owner that it replaced. */
typedef void (*fr_dir_settle_fn)(void *arg, const fr_dir_object *put, int status,
                                 const fr_dir_object *replaced);

/* One name of a renewal of several (fr_dir_ops.node_renew_batch). */
typedef struct fr_dir_renewal {
  const char *name;
  uint64_t incarnation;
  int lease_ms;
} fr_dir_renewal;

typedef struct fr_dir_ops {
  const char *scheme; /* "ferry://", "redis://", "etcd://" */
  /* Connects to `where` (the URL after the scheme); ctx is the node's (links, if any). */
  int (*open)(ferry_ctx *ctx, const char *where, int timeout_ms, void **state);
  void (*close)(void *state);
  /* Bumped whenever the backend may have lost records (reconnect, server restart): the caller
   * then registers again. */
  uint64_t (*epoch)(void *state);
  /* Registers a node, or refreshes its own registration (same incarnation). A name is held by
   * one incarnation at a time: while another one's lease runs, FERRY_EEXIST (the detail names
   * it) and *holder (may be NULL) receives its record, unless `takeover` is that incarnation
   * (the caller verified it is dead): then it and its objects are dropped first. A name whose
   * holder's lease lapsed is free. */
  int (*node_put)(void *state, const fr_dir_node *node, int lease_ms, uint64_t takeover,
                  fr_dir_node *holder, int timeout_ms);
  /* FERRY_ENOTFOUND when the lease already lapsed or the name passed to another incarnation
   * (register again). */
  int (*node_renew)(void *state, const char *name, uint64_t incarnation, int lease_ms,
                    int timeout_ms);
  int (*node_get)(void *state, const char *name, fr_dir_node *out, int timeout_ms);
  /* All live nodes; *out is malloc'd. */
  int (*node_list)(void *state, fr_dir_node **out, size_t *n, int timeout_ms);
  /* Removes a node and every object it owns, if the name is still held by `incarnation` (0:
   * whoever holds it). */
  int (*node_del)(void *state, const char *name, uint64_t incarnation, int timeout_ms);
  /* Stores an object (its owner must be registered, else FERRY_ENOTFOUND). When it replaced a
   * record of another owner, *replaced (may be NULL) receives it and *had_other is set. */
  int (*obj_put)(void *state, const fr_dir_object *obj, unsigned flags, fr_dir_object *replaced,
                 bool *had_other, int timeout_ms);
  /* obj_put of n objects in one round trip: status[i] is 0 or what obj_put would return for
   * objs[i]; replaced[i] and had_other[i] as obj_put's (both arrays n long). Returns 0 unless the
   * round trip itself failed. */
  int (*obj_put_batch)(void *state, const fr_dir_object *objs, size_t n, unsigned flags,
                       int *status, fr_dir_object *replaced, bool *had_other, int timeout_ms);
  /* Looks up n keys; status[i] is 0 (out[i] set) or FERRY_ENOTFOUND. */
  int (*obj_get)(void *state, const char *const *keys, size_t n, fr_dir_object *out, int *status,
                 int timeout_ms);
  /* Deletes `key` if owner is "" or (owner, generation) match the record. FERRY_ENOTFOUND when
   * nothing matched; *deleted (may be NULL) receives the record. */
  int (*obj_del)(void *state, const char *key, const char *owner, uint64_t generation,
                 fr_dir_object *deleted, int timeout_ms);
  /* Every object whose key starts with prefix, sorted by key; *out is malloc'd. */
  int (*obj_scan)(void *state, const char *prefix, fr_dir_object **out, size_t *n, int timeout_ms);
  /* Collects the answers of posted puts, oldest first: those already in, or (wait) all of them,
   * waiting up to timeout_ms; calls cb (may be NULL) for each record that failed or replaced
   * another owner's. NULL in backends that never post. */
  void (*settle)(void *state, bool wait, fr_dir_settle_fn cb, void *arg, int timeout_ms);
  /* Where the backend can tell without asking (ferry:// on the directory's host: counters in
   * the server's shared memory), fills *out and returns true; else false. Two equal stamps of a
   * key prove that no put or delete of the key and no loss of records completed between them:
   * an answer to a lookup sent after the first is still the answer when the second is taken.
   * Posted puts count when they return, so a stamp never hides one. "Between" is in real time,
   * whoever put: another process's put that returned between the two makes them differ, which
   * rules out stamps kept from a watch's events (they arrive after the change applied). NULL in
   * backends that cannot tell. */
  bool (*stamp)(void *state, const char *key, fr_dir_stamp *out);
  /* Where the backend can answer a lookup of one key without asking (ferry:// on the
   * directory's host: its shared object table, table.h), fills *out and returns true: the key's
   * record as of some moment during the call, after every put or delete of it that returned
   * before the call. false: ask obj_get (the key may still exist). NULL in backends that cannot. */
  bool (*peek)(void *state, const char *key, fr_dir_object *out);
  /* node_renew of n names in one round trip (at most FR_DIR_BATCH_MAX): status[i] is what
   * node_renew would return for r[i]. Returns 0 unless the round trip itself failed. NULL in
   * backends that renew one name at a time (the front door then calls node_renew for each). */
  int (*node_renew_batch)(void *state, const fr_dir_renewal *r, size_t n, int *status,
                          int timeout_ms);
} fr_dir_ops;

/* A connected directory client: the backend and its state. Thread-safe: the jobs of a context
 * share one (fr_dir_open). */
typedef struct fr_dir {
  const fr_dir_ops *ops;
  void *state;
  char url[FR_DIR_ADDRESS_MAX + 1]; /* redacted (fr_url_redact): safe to print */
  /* The sharing (directory.c, under its lock): NULL `key` for a client nobody shares
   * (fr_dir_open_local). */
  ferry_ctx *ctx;
  char *key; /* the canonical URL, password included: never printed */
  unsigned refs;
  struct fr_dir *next;
  struct fr_dir_self *self;     /* the node its jobs attach to (lease.c; made by the first) */
  struct fr_dir_server *hosted; /* fr_dir_host's server: stopped by the last close */
} fr_dir;

/* Connects to the directory at url (NULL: FERRY_DIRECTORY). The client is shared: while one is
 * open for the same context and URL (a redis:// URL's default port and database spelled or not
 * make no difference), this returns it with one more reference, so the store, mq and refit of a
 * context reach a directory over one client (one link, one redial, one set of change words).
 * Each fr_dir_open is paired with one fr_dir_close; the last closes the client. Only the store
 * posts puts (FR_DIR_PUT_POSTED) and settles them, one store per context, so a settle never
 * collects another job's answers. FERRY_EINVAL for an unknown scheme, FERRY_ECONNECT when nothing
 * answers (the detail says how to start one). */
int fr_dir_open(ferry_ctx *ctx, const char *url, int timeout_ms, fr_dir **out);
void fr_dir_close(fr_dir *dir);
/* A client of its own, shared with nobody (fr_dir_open's rules for url and errors): what a
 * process that stands in for many nodes needs, one connection each (`ferry bench directory`).
 * Closed by fr_dir_close. */
int fr_dir_open_unshared(ferry_ctx *ctx, const char *url, int timeout_ms, fr_dir **out);
/* Hosts the directory on ctx (fr_dir_server_start) and opens a client bound to it (no link),
 * shared like fr_dir_open's: a job of ctx that opens the URL the server is reached at
 * ("ferry://" + the tcp:// address in ctx's address list) gets this client, so the jobs of a
 * context that hosts its directory still register one node. The server stops with the client's
 * last fr_dir_close (a job that hosted it may close before the others that use it). */
int fr_dir_host(ferry_ctx *ctx, fr_dir **out);
/* How many fr_dir_open()s hold a shared client open (tests). */
unsigned fr_dir_refs(fr_dir *dir);
/* The backends, in one place (directory.c). */
const fr_dir_ops *fr_dir_backend(const char *url);

/* ---- the front door (directory.c): what jobs call, never dir->ops ----
 * Each is the backend's operation of the same name (fr_dir_ops above says what it does), with the
 * rules every caller shares applied in one place: a negative timeout means FERRY_TIMEOUT_MS (a
 * backend never sees one), and the optional operations (peek, stamp, settle) answer "cannot"
 * where the backend has none. */
uint64_t fr_dir_epoch(fr_dir *dir);
/* Registers a node (fr_dir_ops.node_put): the lease's (lease.c) and a stand-in node's. */
int fr_dir_node_put(fr_dir *dir, const fr_dir_node *node, int lease_ms, uint64_t takeover,
                    fr_dir_node *holder, int timeout_ms);
/* Where the backend cannot renew several at once (or its server is older), one at a time. */
int fr_dir_node_renew_batch(fr_dir *dir, const fr_dir_renewal *r, size_t n, int *status,
                            int timeout_ms);
int fr_dir_node_get(fr_dir *dir, const char *name, fr_dir_node *out, int timeout_ms);
int fr_dir_node_list(fr_dir *dir, fr_dir_node **out, size_t *n, int timeout_ms);
int fr_dir_obj_put(fr_dir *dir, const fr_dir_object *obj, unsigned flags, fr_dir_object *replaced,
                   bool *had_other, int timeout_ms);
int fr_dir_obj_put_batch(fr_dir *dir, const fr_dir_object *objs, size_t n, unsigned flags,
                         int *status, fr_dir_object *replaced, bool *had_other, int timeout_ms);
int fr_dir_obj_get(fr_dir *dir, const char *const *keys, size_t n, fr_dir_object *out, int *status,
                   int timeout_ms);
int fr_dir_obj_del(fr_dir *dir, const char *key, const char *owner, uint64_t generation,
                   fr_dir_object *deleted, int timeout_ms);
int fr_dir_obj_scan(fr_dir *dir, const char *prefix, fr_dir_object **out, size_t *n,
                    int timeout_ms);
/* Does nothing where the backend never posts. */
void fr_dir_settle(fr_dir *dir, bool wait, fr_dir_settle_fn cb, void *arg, int timeout_ms);
/* false where the backend cannot tell without asking (or has no stamps at all). */
bool fr_dir_stamp_take(fr_dir *dir, const char *key, fr_dir_stamp *out);
/* false where the backend cannot answer without asking (or has no peek at all): ask obj_get. */
bool fr_dir_peek(fr_dir *dir, const char *key, fr_dir_object *out);

/* Object keys that start with this prefix belong to ferry's own jobs (mq's discovery records):
 * the store refuses them as user keys and leaves them out of list and delete_prefix/clear. */
#define FR_DIR_RESERVED "ferry:"
static inline bool fr_dir_key_reserved(const char *key) {
  return __builtin_strncmp(key, FR_DIR_RESERVED, sizeof FR_DIR_RESERVED - 1) == 0;
}

/* A key's hash (FNV-1a): the same in every process, so it may index shared tables. */
static inline uint32_t fr_dir_key_hash(const char *key) {
  uint32_t h = 2166136261u;
  for (const unsigned char *p = (const unsigned char *)key; *p; p++)
    h = (h ^ *p) * 16777619u;
  return h;
}

/* Checks a key: 1..FR_DIR_KEY_MAX bytes, the one name rule (core.h: fr_name_check). */
int fr_dir_key_check(const char *key, const char *what);
/* FERRY_EEXIST naming the live node that holds a name. */
int fr_dir_name_taken(const fr_dir_node *holder, uint32_t lease_left_ms);
/* Sorts objects by key. */
void fr_dir_sort(fr_dir_object *objs, size_t n);

/* ---- directory URLs (url.c) ---- */
/* A fleet's namespace: "?ns=NAME" at the end of a directory URL (issue 36), 1..FR_DIR_NS_MAX
 * bytes of [A-Za-z0-9_.-]. Parsed here once for every backend (redis.c keeps its records under
 * "ferry@NAME:" instead of "ferry:"; an etcd backend prefixes its keys the same way), so fleets
 * sharing one server neither see nor delete each other's records. out gets "" when the URL has
 * no query; FERRY_EINVAL for any other query or a bad name. *query_at (may be NULL) receives
 * where the '?' is (the URL's length when none). */
#define FR_DIR_NS_MAX 63
int fr_dir_url_ns(const char *url, char *out, size_t cap, size_t *query_at);
/* A URL as it may be printed: the password in its userinfo replaced by three stars
 * (e.g. redis://user:...@host:6379/0 shows user, host, port and db; a userinfo without a colon is
 * all password). Every message, log line or output that names a directory URL prints this, never
 * the URL itself. */
void fr_url_redact(const char *url, char *out, size_t cap);

/* A bare HOST:PORT (no scheme; HOST a name, an IPv4 address or a [v6] one) names an embedded
 * directory, as ferry.p2pstore reads one: out (cap bytes) gets "ferry://HOST:PORT" and is
 * returned. Any other url (NULL included) is returned as it is. */
const char *fr_dir_url_normal(const char *url, char *out, size_t cap);

/* A redis:// URL taken apart, as redis-cli reads one: redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]
 * (a userinfo without ':' is the password; USER and PASSWORD are percent-decoded; HOST may be
 * [v6]; empty HOST: 127.0.0.1; PORT 6379, DB 0 by default). rediss://... is the same over TLS,
 * with ?ca=PATH, ?cert=PATH, ?key=PATH (percent-decoded). redis+sentinel://[[USER]:PASSWORD@]
 * S1[:PORT],S2[:PORT]/NAME[/DB] names the sentinels (port 26379 by default) and the primary's
 * name they watch. Every form takes ?ns=NAME; options are joined by '&'. */
#define FR_REDIS_SENTINELS_MAX 8
typedef struct fr_redis_url {
  char host[256];
  int port, db;
  char user[128];
  char password[256];
  bool auth;                  /* a user or password was given: AUTH after every connect */
  char ns[FR_DIR_NS_MAX + 1]; /* "?ns=NAME" (fr_dir_url_ns); "" when none */
  bool tls;                   /* rediss:// */
  char ca[256], cert[256], key[256];
  int sentinels; /* redis+sentinel://: how many (host and port above: the first) */
  struct {
    char host[256];
    int port;
  } sentinel[FR_REDIS_SENTINELS_MAX];
  char master[128]; /* the name the sentinels know the primary by */
} fr_redis_url;
/* url with or without its scheme (redis:// when none). FERRY_EINVAL (the detail shows the URL
 * redacted). */
int fr_redis_url_parse(const char *url, fr_redis_url *out);

/* An etcd:// URL taken apart: etcd://HOST[:PORT][,HOST[:PORT]...][?ns=NAME], the members of one
 * cluster (HOST a name, an IPv4 address or a [v6] one; PORT 2379 by default). No userinfo (etcd's
 * own users and TLS are not supported). */
#define FR_ETCD_MEMBERS_MAX 16
typedef struct fr_etcd_url {
  int n;
  char host[FR_ETCD_MEMBERS_MAX][256];
  int port[FR_ETCD_MEMBERS_MAX];
  char ns[FR_DIR_NS_MAX + 1];
} fr_etcd_url;
/* url with or without its "etcd://". FERRY_EINVAL. */
int fr_etcd_url_parse(const char *url, fr_etcd_url *out);

/* ---- whether peers can reach what a node advertises (reach.c) ---- */
/* A loopback address (127/8, ::1, ::ffff:127/104) or "localhost". */
bool fr_addr_loopback(const char *host);
/* The host of scheme://[USERINFO@]HOST[:PORT][/...] or HOST:PORT, brackets removed. */
int fr_url_host(const char *url, char *host, size_t cap);
/* Pure: whether a node advertising `node_address` (a ctx address list) can be reached by the
 * peers of a directory at the numeric address dir_host: always when that is loopback (one host),
 * else when some tcp:// or ucx:// address in the list is neither loopback nor a wildcard. */
bool fr_dir_can_reach(const char *dir_host, const char *node_address);
/* The local address the kernel would send from to reach `ip` (numeric). Sends nothing. */
int fr_route_source(const char *ip, char *out, size_t cap);
/* FERRY_EINVAL, one line naming FERRY_TCP_LISTEN and the interface that routes to the directory,
 * when a node advertising `node_address` registers in the directory at dir_url on another host
 * while it listens on loopback only; else 0 (also when the directory's host name does not resolve
 * by deadline_ns: 0 for none). */
int fr_dir_reach_check(const char *dir_url, const char *node_address, const char *who,
                       uint64_t deadline_ns);
/* For a node that is about to open its context and join dir_url: when tcp_listen (HOST:PORT) is
 * loopback and the directory is on another host, writes "ADDR:PORT" (ADDR: the interface that
 * routes to the directory, PORT: tcp_listen's) to out and returns 1; else 0. */
int fr_dir_tcp_listen_for(const char *dir_url, const char *tcp_listen, char *out, size_t cap);

/* ---- a process's node: one registration per client, under one lease (lease.c) ----
 * A client (the jobs of a context share one, fr_dir_open) registers ONE node in the directory:
 * one name, one incarnation, one address and one lease, renewed by one request every third of
 * the lease, sent by the node's one timer (on the process's task pool, core/task.h; no job's
 * thread renews anything). The node is named after its context
 * (ferry_ctx_name): that is the name the process answers under on every link, so a live holder
 * of the name is told from a dead one by connecting to its address and seeing who answers
 * (holder_dead); the store's objects and mq's discovery records already name it as their owner;
 * and mq dials its peers by it. The first job's name would not do: a refit sender's name is not
 * what its links answer under, and the node would change names with the order jobs open in.
 * The node's lease is the shortest any attached job asked for (FERRY_LEASE_MS by default), its
 * flags the union of theirs, its access blob the store's.
 *
 * Each job attaches with an fr_dir_lease and publishes a job record owned by the node:
 * "ferry:job/KIND/NAME" (FR_DIR_JOBS; KIND store, mq or refit; NAME the job's: the ctx name for
 * store and mq, the sender's published name for refit). Like every record the node owns it
 * vanishes with the node's lease, and after the directory lost the node (its lease lapsed, or
 * its epoch moved) the timer registers the node again, publishes every job record again and
 * calls what each job registered to publish the rest of its records (fr_dir_lease_set_republish).
 * A job name held by a live
 * node of another process is refused (FERRY_EEXIST naming it); one held by a dead node (nothing
 * accepts a connection at its address, or another node answers there) is taken over at once:
 * the dead node and its records are dropped. Lookups by job name: fr_dir_job_find. */
#define FR_DIR_JOBS FR_DIR_RESERVED "job/"

typedef struct fr_dir_self fr_dir_self; /* a client's node (lease.c) */

typedef struct fr_dir_lease {
  fr_dir *dir;
  ferry_ctx *ctx;
  fr_dir_self *self; /* the client's node; NULL until init succeeded */
  /* The node as this job names it: name, address and incarnation are the node's (its records'
   * owner and generation); flags and the access blob are what this job adds to the node record
   * (set before taking). */
  fr_dir_node node;
  int lease_ms; /* the lease this job asks for: FERRY_LEASE_MS from init; the caller may change
                   it before taking */
  char key[FR_DIR_KEY_MAX + 1]; /* its job record */
  char job[FR_DIR_NAME_MAX + 1];
  char who[96];  /* "store 'a'": how messages name the caller */
  bool held;     /* under the node's lock: its job record is published */
  bool want;     /* atomic: its records must be published again (fr_dir_lease_lost) */
  uint64_t seen; /* atomic: the node's registration its records were published under */
  int (*republish)(void *arg, int timeout_ms); /* the node's lock: fr_dir_lease_set_republish */
  void *republish_arg;
  bool republishing; /* the node's lock: the timer calls republish next */
  bool in_node;
  struct fr_dir_lease *next; /* the node's members */
} fr_dir_lease;

/* Whether the node is held and its directory answered the last take or renewal, and this job's
 * record is published: what a job's readiness check (/readyz) reports; safe from any thread. */
bool fr_dir_lease_ok(const fr_dir_lease *l);
/* A job's /readyz answer from its lease: 0 while fr_dir_lease_ok, else FERRY_ECONNECT with why
 * (when given) naming the job ("store 'a': its directory lease is not held ..."). */
int fr_dir_lease_ready(const fr_dir_lease *l, char *why, size_t len);
/* Records of this job's (key, owner, generation) whose delete failed: the node deletes them at
 * its renewals until the directory takes them, since the node's lease, which would, goes on. Only
 * for records whose (owner, generation) a later put of the key cannot have again (a store's
 * objects; the job records, which a job publishing the same name takes back). */
void fr_dir_lease_orphan(fr_dir_lease *l, const fr_dir_object *recs, size_t n);

/* Attaches a job (kind "store", "mq" or "refit"; name its name, 1 to FR_DIR_NAME_MAX bytes
 * without control characters, '/' allowed: the kind ends at the first) to the node of dir.
 * FERRY_EINVAL for a bad name, FERRY_ENOMEM. Pair with fr_dir_lease_drop (also after a failed
 * init). */
int fr_dir_lease_init(fr_dir_lease *l, fr_dir *dir, ferry_ctx *ctx, const char *kind,
                      const char *name, const char *who);
/* Registers the node unless it is registered (with this job's lease, flags and access blob),
 * then publishes the job record. FERRY_EEXIST naming a live holder of the node's name or of the
 * job's name; a dead holder is taken over. */
int fr_dir_lease_take(fr_dir_lease *l, int timeout_ms);
/* What publishes this job's records but its job record again (its objects, its topics), after
 * the directory lost them with the node, or after fr_dir_lease_lost: called by the node's timer
 * on a worker of the task pool, without the node's lock, with the timeout to keep to; a failure
 * (< 0, its detail logged) is tried again at the timer's next try. NULL (the default): the job
 * record is its only one. Clearing it waits for a call under way. */
void fr_dir_lease_set_republish(fr_dir_lease *l, int (*republish)(void *arg, int timeout_ms),
                                void *arg);
/* Held, and the directory has not lost the node since this job published (its epoch did not
 * move, the node was not registered again). */
bool fr_dir_lease_current(const fr_dir_lease *l);
/* The caller could not publish its records after taking: the node's timer publishes them again
 * now (its job record, then its republish). Any thread; takes no lock of the node. */
void fr_dir_lease_lost(fr_dir_lease *l);
/* Whether this job is the node's only one: its drop removes the node with every record it owns.
 * Otherwise the job deletes its own records before dropping (the node lives on). */
bool fr_dir_lease_alone(const fr_dir_lease *l);
/* Detaches the job: deletes its job record, or the node with all its records when it was the
 * last job; the node's record loses this job's flags and access blob. */
void fr_dir_lease_drop(fr_dir_lease *l);
/* Frees a client's node (fr_dir_close, once no job is attached). */
void fr_dir_self_free(fr_dir_self *self);

/* The node that publishes job `name` of `kind` (its job record's owner), e.g. the refit sender
 * "policy": FERRY_ENOTFOUND when none does. */
int fr_dir_job_find(fr_dir *dir, const char *kind, const char *name, fr_dir_node *out,
                    int timeout_ms);
/* The job record key of (kind, name): FERRY_EINVAL when it does not fit. */
int fr_dir_job_key(const char *kind, const char *name, char out[FR_DIR_KEY_MAX + 1]);
/* A job record's key taken apart ("ferry:job/refit/policy" -> "refit", "policy"); false: not
 * one (a peer's record: untrusted, checked). */
bool fr_dir_job_parse(const char *key, char kind[16], char name[FR_DIR_NAME_MAX + 1]);

/* ---- the embedded server (server.c) ---- */
typedef struct fr_dir_server fr_dir_server;
/* Starts a server answering ferry_call()s on FR_CHANNEL_DIRECTORY of ctx (one thread). */
int fr_dir_server_start(ferry_ctx *ctx, fr_dir_server **out);
void fr_dir_server_stop(fr_dir_server *srv);
/* A server state with no thread, for in-process use and the fuzzer. */
fr_dir_server *fr_dir_server_new(const char *address);
void fr_dir_server_free(fr_dir_server *srv);
/* Handles one request message; *reply is malloc'd (the caller frees it). Pure apart from the
 * server's own state and the clock. Never fails: errors are encoded in the reply. */
void fr_dir_server_handle(fr_dir_server *srv, const void *req, size_t len, void **reply,
                          size_t *reply_len);
/* fr_dir_server_handle() for a caller in the server's process: when the server is started, it
 * first answers the posted puts that may precede the call (see server.c). */
void fr_dir_server_call(fr_dir_server *srv, const void *req, size_t len, void **reply,
                        size_t *reply_len);
/* Renewal requests answered so far, the names they renewed, and how many the last one renewed
 * (tests). */
void fr_dir_server_renewals(fr_dir_server *srv, uint64_t *requests, uint64_t *names,
                            uint64_t *last);
/* Drops nodes whose lease lapsed (and their objects); the thread calls it on its own. */
void fr_dir_server_expire(fr_dir_server *srv, uint64_t now_ns);
/* Opens a client bound to an in-process server (no link). */
int fr_dir_open_local(fr_dir_server *srv, fr_dir **out);

#endif
