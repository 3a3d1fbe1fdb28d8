/*
 * The directory's front door: the backends in one table, chosen by URL scheme, and the helpers
 * every backend shares (key checks, sorting). A job opens a directory with fr_dir_open() and
 * calls the front-door functions below; it never names a backend nor calls dir->ops itself, so
 * the rules every call shares (the timeout's meaning, the optional operations) live here once.
 */
#include "directory/directory.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern const fr_dir_ops fr_dir_embedded_ops;
extern const fr_dir_ops fr_dir_redis_ops;
extern const fr_dir_ops fr_dir_etcd_ops;

static const fr_dir_ops *const backends[] = {&fr_dir_embedded_ops, &fr_dir_redis_ops,
                                             &fr_dir_etcd_ops};

const fr_dir_ops *fr_dir_backend(const char *url) {
  for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++) {
    size_t n = strlen(backends[i]->scheme);
    if (strncmp(url, backends[i]->scheme, n) == 0)
      return backends[i];
  }
  return NULL;
}

/* ---- one client per context and URL ----
 * The open clients in a list under a lock: a process holds a handful (one per context and
 * directory), and an open is rare next to the calls made through it. */

static pthread_mutex_t shared_lock = PTHREAD_MUTEX_INITIALIZER;
static fr_dir *shared;

/* The URL as the client it names: a redis:// URL rebuilt from its parts (so redis://h and
 * redis://h:6379/0 are one client), any other as written. NULL when out of memory. */
static char *canonical(const char *url) {
  char buf[2 * FR_DIR_ADDRESS_MAX + 64];
  fr_redis_url r;
  if (strncmp(url, "redis://", 8) != 0)
    return strdup(url);
  if (fr_redis_url_parse(url, &r) != 0) {
    fr_err_clear(); /* the backend's open says what is wrong with it */
    return strdup(url);
  }
  snprintf(buf, sizeof buf, "redis://%s\n%s\n%s\n%d\n%d\n%s", r.auth ? r.user : "",
           r.auth ? r.password : "", r.host, r.port, r.db, r.ns); /* ns: another fleet */
  return strdup(buf);
}

/* shared_lock held. A reference to the open client of (ctx, key), or NULL. */
static fr_dir *shared_find(ferry_ctx *ctx, const char *key) {
  for (fr_dir *d = shared; d; d = d->next)
    if (d->ctx == ctx && strcmp(d->key, key) == 0) {
      d->refs++;
      return d;
    }
  return NULL;
}

static int connect_new(ferry_ctx *ctx, const char *url, const fr_dir_ops *ops, const char *shown,
                       int timeout_ms, fr_dir **out) {
  fr_dir *d = calloc(1, sizeof *d);
  if (!d)
    return fr_err(FERRY_ENOMEM, "directory client");
  d->ops = ops;
  fr_str_copy(d->url, sizeof d->url, shown);
  int rc = ops->open(ctx, url + strlen(ops->scheme), timeout_ms, &d->state);
  if (rc != 0) {
    free(d);
    return rc;
  }
  *out = d;
  return 0;
}

int fr_dir_open(ferry_ctx *ctx, const char *url, int timeout_ms, fr_dir **out) {
  if (!url || !*url)
    url = fr_config_str("FERRY_DIRECTORY");
  char bare[FR_DIR_ADDRESS_MAX + 16]; /* HOST:PORT is ferry://HOST:PORT */
  url = fr_dir_url_normal(url, bare, sizeof bare);
  const fr_dir_ops *ops = fr_dir_backend(url);
  char shown[FR_DIR_ADDRESS_MAX + 1];
  fr_url_redact(url, shown, sizeof shown);
  if (!ops)
    return fr_err(FERRY_EINVAL,
                  "directory '%s': unknown scheme (ferry://HOST:PORT, HOST:PORT, "
                  "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB], rediss://... (TLS), "
                  "redis+sentinel://S1[:PORT],S2.../NAME[/DB] or "
                  "etcd://HOST[:PORT][,HOST[:PORT]...])",
                  shown);
  if (strlen(url) > FR_DIR_ADDRESS_MAX)
    return fr_err(FERRY_EINVAL, "directory URL too long");
  char *key = canonical(url);
  if (!key)
    return fr_err(FERRY_ENOMEM, "directory client");
  pthread_mutex_lock(&shared_lock);
  fr_dir *d = shared_find(ctx, key);
  pthread_mutex_unlock(&shared_lock);
  if (d) {
    free(key);
    *out = d;
    return 0;
  }
  /* connect without the lock (it may take the whole timeout); when another thread connected
   * meanwhile, keep its client and close ours */
  fr_dir *mine = NULL;
  int rc = connect_new(ctx, url, ops, shown, fr_timeout(timeout_ms), &mine);
  if (rc != 0) {
    free(key);
    return rc;
  }
  pthread_mutex_lock(&shared_lock);
  if (!(d = shared_find(ctx, key))) {
    d = mine;
    d->ctx = ctx;
    d->key = key;
    d->refs = 1;
    d->next = shared;
    shared = d;
    mine = NULL;
  }
  pthread_mutex_unlock(&shared_lock);
  if (mine) {
    mine->ops->close(mine->state);
    free(mine);
    free(key);
  }
  *out = d;
  return 0;
}

int fr_dir_open_unshared(ferry_ctx *ctx, const char *url, int timeout_ms, fr_dir **out) {
  if (!url || !*url)
    url = fr_config_str("FERRY_DIRECTORY");
  char bare[FR_DIR_ADDRESS_MAX + 16];
  url = fr_dir_url_normal(url, bare, sizeof bare);
  const fr_dir_ops *ops = fr_dir_backend(url);
  char shown[FR_DIR_ADDRESS_MAX + 1];
  fr_url_redact(url, shown, sizeof shown);
  if (!ops)
    return fr_err(FERRY_EINVAL, "directory '%s': unknown scheme", shown);
  if (strlen(url) > FR_DIR_ADDRESS_MAX)
    return fr_err(FERRY_EINVAL, "directory URL too long");
  int rc = connect_new(ctx, url, ops, shown, fr_timeout(timeout_ms), out);
  if (rc == 0)
    (*out)->ctx = ctx; /* key stays NULL: in no list, closed by its one fr_dir_close */
  return rc;
}

/* "ferry://HOST:PORT" of the tcp:// address in ctx's address list, or NULL (none, or no memory). */
static char *hosted_url(ferry_ctx *ctx) {
  const char *a = ferry_ctx_address(ctx), *t = a ? strstr(a, "tcp://") : NULL;
  while (t && t != a && t[-1] != ',')
    t = strstr(t + 1, "tcp://");
  if (!t)
    return NULL;
  size_t n = strcspn(t + 6, ",");
  char *url = malloc(n + 9);
  if (url)
    snprintf(url, n + 9, "ferry://%.*s", (int)n, t + 6);
  return url;
}

int fr_dir_host(ferry_ctx *ctx, fr_dir **out) {
  fr_dir_server *srv = NULL;
  fr_dir *d = NULL;
  int rc = fr_dir_server_start(ctx, &srv);
  if (rc == 0 && (rc = fr_dir_open_local(srv, &d)) != 0)
    fr_dir_server_stop(srv);
  if (rc != 0)
    return rc;
  d->hosted = srv;
  d->ctx = ctx;
  d->key = hosted_url(ctx); /* NULL: nobody can name it; unshared, like fr_dir_open_local's */
  d->refs = 1;
  if (d->key) {
    pthread_mutex_lock(&shared_lock);
    d->next = shared;
    shared = d;
    pthread_mutex_unlock(&shared_lock);
  }
  *out = d;
  return 0;
}

/* shared_lock held. Whether this was the last reference (then d is out of the list). */
static bool shared_put(fr_dir *d) {
  if (--d->refs > 0)
    return false;
  for (fr_dir **p = &shared; *p; p = &(*p)->next)
    if (*p == d) {
      *p = d->next;
      break;
    }
  return true;
}

void fr_dir_close(fr_dir *dir) {
  if (!dir)
    return;
  if (dir->key) {
    pthread_mutex_lock(&shared_lock);
    bool last = shared_put(dir);
    pthread_mutex_unlock(&shared_lock);
    if (!last)
      return;
  }
  fr_dir_self_free(dir->self); /* its timer stops before the client it renews through */
  dir->ops->close(dir->state);
  fr_dir_server_stop(dir->hosted);
  free(dir->key);
  free(dir);
}

unsigned fr_dir_refs(fr_dir *dir) {
  pthread_mutex_lock(&shared_lock);
  unsigned n = dir->key ? dir->refs : 1;
  pthread_mutex_unlock(&shared_lock);
  return n;
}

/* ---- the front door ---- */

uint64_t fr_dir_epoch(fr_dir *dir) { return dir->ops->epoch(dir->state); }

int fr_dir_node_put(fr_dir *dir, const fr_dir_node *node, int lease_ms, uint64_t takeover,
                    fr_dir_node *holder, int timeout_ms) {
  return dir->ops->node_put(dir->state, node, lease_ms, takeover, holder, fr_timeout(timeout_ms));
}

int fr_dir_node_renew_batch(fr_dir *dir, const fr_dir_renewal *r, size_t n, int *status,
                            int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(fr_timeout(timeout_ms));
  if (dir->ops->node_renew_batch) {
    int rc = dir->ops->node_renew_batch(dir->state, r, n, status, fr_timeout(timeout_ms));
    if (rc != FERRY_EPROTO) /* an older server does not know the request: one at a time */
      return rc;
    fr_err_clear();
  }
  for (size_t i = 0; i < n; i++) {
    int ms = fr_ms_left(deadline);
    status[i] = dir->ops->node_renew(dir->state, r[i].name, r[i].incarnation, r[i].lease_ms,
                                     ms > 0 ? ms : 1);
    if (status[i] != 0 && status[i] != FERRY_ENOTFOUND)
      return status[i]; /* the directory did not answer: the rest would fail alike */
  }
  return 0;
}

int fr_dir_node_get(fr_dir *dir, const char *name, fr_dir_node *out, int timeout_ms) {
  return dir->ops->node_get(dir->state, name, out, fr_timeout(timeout_ms));
}

int fr_dir_node_list(fr_dir *dir, fr_dir_node **out, size_t *n, int timeout_ms) {
  return dir->ops->node_list(dir->state, out, n, fr_timeout(timeout_ms));
}

int fr_dir_obj_put(fr_dir *dir, const fr_dir_object *obj, unsigned flags, fr_dir_object *replaced,
                   bool *had_other, int timeout_ms) {
  return dir->ops->obj_put(dir->state, obj, flags, replaced, had_other, fr_timeout(timeout_ms));
}

int fr_dir_obj_put_batch(fr_dir *dir, const fr_dir_object *objs, size_t n, unsigned flags,
                         int *status, fr_dir_object *replaced, bool *had_other, int timeout_ms) {
  return dir->ops->obj_put_batch(dir->state, objs, n, flags, status, replaced, had_other,
                                 fr_timeout(timeout_ms));
}

int fr_dir_obj_get(fr_dir *dir, const char *const *keys, size_t n, fr_dir_object *out, int *status,
                   int timeout_ms) {
  return dir->ops->obj_get(dir->state, keys, n, out, status, fr_timeout(timeout_ms));
}

int fr_dir_obj_del(fr_dir *dir, const char *key, const char *owner, uint64_t generation,
                   fr_dir_object *deleted, int timeout_ms) {
  return dir->ops->obj_del(dir->state, key, owner, generation, deleted, fr_timeout(timeout_ms));
}

int fr_dir_obj_scan(fr_dir *dir, const char *prefix, fr_dir_object **out, size_t *n,
                    int timeout_ms) {
  return dir->ops->obj_scan(dir->state, prefix, out, n, fr_timeout(timeout_ms));
}

void fr_dir_settle(fr_dir *dir, bool wait, fr_dir_settle_fn cb, void *arg, int timeout_ms) {
  if (dir->ops->settle)
    dir->ops->settle(dir->state, wait, cb, arg, fr_timeout(timeout_ms));
}

bool fr_dir_stamp_take(fr_dir *dir, const char *key, fr_dir_stamp *out) {
  return dir->ops->stamp && dir->ops->stamp(dir->state, key, out);
}

bool fr_dir_peek(fr_dir *dir, const char *key, fr_dir_object *out) {
  return dir->ops->peek && dir->ops->peek(dir->state, key, out);
}

int fr_dir_key_check(const char *key, const char *what) {
  if (fr_name_ok(key, FR_DIR_KEY_MAX))
    return 0; /* the common case, without formatting `what` */
  char who[96];
  snprintf(who, sizeof who, "%s: key", what);
  return fr_name_check(who, key, FR_DIR_KEY_MAX);
}

int fr_dir_name_taken(const fr_dir_node *holder, uint32_t lease_left_ms) {
  return fr_err(FERRY_EEXIST,
                "node name '%s' is held by a live node at %s (its lease runs %u ms more)",
                holder->name, holder->address, lease_left_ms);
}

static int cmp_object(const void *a, const void *b) {
  return strcmp(((const fr_dir_object *)a)->key, ((const fr_dir_object *)b)->key);
}

void fr_dir_sort(fr_dir_object *objs, size_t n) {
  if (n > 1)
    qsort(objs, n, sizeof *objs, cmp_object);
}
