/*
 * The etcd backend's stamps (fr_dir_ops.stamp), from a watch: where the embedded server bumps its
 * change words as it applies a put or delete (server.c), an etcd client learns of changes by a
 * watch of every key under its prefix, and counts each object key's changes in a word of its
 * bucket (4096 buckets, as the server's words). One thread per client holds the watch, a
 * streaming POST /v3/watch on one member; a stamp is (the watch's session, the key's word). The
 * session is 0 (no stamp: ask the directory) while no watch is current (connecting, or after the
 * stream broke), and a new number each time a watch is created, so a stamp from before a break
 * never equals one after it: a change the gap missed cannot hide behind equal stamps. The thread
 * moves to another member when its stream breaks or ends, or when calls found its member dead
 * (members.failures). This process's own puts and deletes bump the word as they return (before
 * the watch brings their event); another process's change is seen when its event arrives, which
 * on loopback is well under a millisecond after etcd applied it.
 */
#include "directory/dirwire.h"
#include "directory/etcd.h"

#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#define LINE_MAX_BYTES FR_HTTP_BODY_MAX /* one watch message (a lapsed lease's many deletes) */

struct fr_etcd_watch {
  fr_etcd_members *m;
  char prefix[FR_DIR_NS_MAX + 8];
  size_t prefix_len;
  pthread_t thread;
  int wake;         /* eventfd: the close */
  uint64_t session; /* atomic: 0 while no watch is current */
  uint64_t sessions;
  uint64_t words[FR_DIR_WATCH_BUCKETS]; /* atomic */
  fr_http conn;
  char *line; /* a message being received */
  size_t line_len, line_cap;
};

static uint64_t *word_of(fr_etcd_watch *w, const char *key) {
  return &w->words[fr_dir_watch_bucket(key, FR_DIR_WATCH_BUCKETS)];
}

void fr_etcd_watch_bump(fr_etcd_watch *w, const char *key) {
  __atomic_add_fetch(word_of(w, key), 1, __ATOMIC_SEQ_CST);
}

bool fr_etcd_watch_stamp(fr_etcd_watch *w, const char *key, fr_dir_stamp *out) {
  uint64_t s = __atomic_load_n(&w->session, __ATOMIC_SEQ_CST);
  if (!s)
    return false;
  uint64_t k = __atomic_load_n(word_of(w, key), __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&w->session, __ATOMIC_SEQ_CST) != s)
    return false;
  *out = (fr_dir_stamp){.epoch = s, .all = 0, .key = k};
  return true;
}

static bool closing(fr_etcd_watch *w) {
  uint64_t v;
  return read(w->wake, &v, sizeof v) == sizeof v;
}

/* One event's key: bumps its word when it is an object's (PREFIX o/KEY). */
static void event(fr_etcd_watch *w, const json_t *ev) {
  uint8_t key[FR_ETCD_KEY_BYTES + 1];
  size_t n = 0;
  const json_t *kv = json_object_get(ev, "kv");
  if (!fr_etcd_get_bytes(kv, "key", key, sizeof key - 1, &n) || n < w->prefix_len + 2 ||
      memcmp(key, w->prefix, w->prefix_len) != 0 || memcmp(key + w->prefix_len, "o/", 2) != 0)
    return; /* a node's key, or one no ferry client wrote */
  key[n] = '\0';
  fr_etcd_watch_bump(w, (const char *)key + w->prefix_len + 2);
}

/* One message of the stream: false when the watch ended (canceled, an error). */
static bool message(fr_etcd_watch *w, const char *text, size_t n) {
  json_t *j = json_loadb(text, n, 0, NULL);
  const json_t *res = json_object_get(j, "result");
  bool ok = json_is_object(res) && !fr_etcd_get_bool(res, "canceled");
  if (ok && fr_etcd_get_bool(res, "created"))
    __atomic_store_n(&w->session, ++w->sessions, __ATOMIC_SEQ_CST);
  const json_t *evs = json_object_get(res, "events");
  for (size_t i = 0; ok && i < json_array_size(evs); i++)
    event(w, json_array_get(evs, i));
  json_decref(j);
  return ok;
}

/* Bytes of the stream: complete lines are messages. False when the watch ended. */
static bool take(fr_etcd_watch *w, const char *p, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (p[i] == '\n') {
      bool ok = w->line_len == 0 || message(w, w->line, w->line_len);
      w->line_len = 0;
      if (!ok)
        return false;
      continue;
    }
    if (w->line_len == w->line_cap) {
      size_t cap = w->line_cap ? 2 * w->line_cap : 4096;
      char *l = cap <= LINE_MAX_BYTES ? realloc(w->line, cap) : NULL;
      if (!l)
        return false;
      w->line = l;
      w->line_cap = cap;
    }
    w->line[w->line_len++] = p[i];
  }
  return true;
}

/* Opens the watch on member m: the stream's head read. */
static int open_stream(fr_etcd_watch *w, int m) {
  uint64_t deadline = fr_deadline_ns(2000);
  int rc = fr_http_dial(&w->conn, w->m->u.host[m], w->m->u.port[m], deadline);
  char end[FR_ETCD_KEY_BYTES];
  size_t en = fr_etcd_prefix_end(w->prefix, w->prefix_len, end);
  json_t *create = json_object(), *req = json_object();
  fr_etcd_set_b64(create, "key", w->prefix, w->prefix_len);
  fr_etcd_set_b64(create, "range_end", end, en);
  json_object_set_new(req, "create_request", create);
  char *body = json_dumps(req, JSON_COMPACT);
  json_decref(req);
  int status = 0;
  if (rc == 0 && !body)
    rc = fr_err(FERRY_ENOMEM, "etcd watch");
  if (rc == 0)
    rc = fr_http_post(&w->conn, "/v3/watch", body, strlen(body), deadline);
  if (rc == 0)
    rc = fr_http_head(&w->conn, &status, deadline);
  if (rc == 0 && status != 200)
    rc = fr_err(FERRY_EPROTO, "etcd member %s: watch: HTTP %d", w->conn.name, status);
  free(body);
  return rc;
}

/* Reads the stream until it ends, breaks, the client closes, or calls found member m dead. */
static void follow(fr_etcd_watch *w, int m) {
  uint64_t failures = __atomic_load_n(&w->m->failures[m], __ATOMIC_ACQUIRE);
  w->line_len = 0;
  for (;;) {
    const char *p;
    size_t n;
    int rc = fr_http_body_some(&w->conn, &p, &n, fr_deadline_ns(250));
    if (rc == FERRY_ETIMEDOUT &&
        __atomic_load_n(&w->m->failures[m], __ATOMIC_ACQUIRE) == failures) {
      fr_err_clear();
      continue; /* a quiet stream */
    }
    if (rc != 0 || n == 0 || !take(w, p, n))
      return;
  }
}

static void *watch_main(void *arg) {
  fr_etcd_watch *w = arg;
  int m = __atomic_load_n(&w->m->current, __ATOMIC_ACQUIRE);
  while (!closing(w)) {
    if (open_stream(w, m) == 0)
      follow(w, m);
    __atomic_store_n(&w->session, 0, __ATOMIC_SEQ_CST); /* no stamps until the next watch */
    fr_http_close(&w->conn);
    fr_err_clear();
    int cur = __atomic_load_n(&w->m->current, __ATOMIC_ACQUIRE);
    m = cur != m ? cur : (m + 1) % w->m->u.n; /* where calls go, else the next member */
    struct pollfd p = {.fd = w->wake, .events = POLLIN};
    poll(&p, 1, 100); /* not a spin while no member answers */
  }
  return NULL;
}

int fr_etcd_watch_start(fr_etcd_members *m, const char *prefix, fr_etcd_watch **out) {
  fr_etcd_watch *w = calloc(1, sizeof *w);
  if (!w)
    return fr_err(FERRY_ENOMEM, "etcd watch");
  w->m = m;
  w->prefix_len = fr_str_copy(w->prefix, sizeof w->prefix, prefix);
  fr_http_init(&w->conn);
  w->wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  w->conn.wake_fd = w->wake;
  if (w->wake < 0 || pthread_create(&w->thread, NULL, watch_main, w) != 0) {
    int rc = fr_err_errno(FERRY_ESYS, "etcd watch thread");
    if (w->wake >= 0)
      close(w->wake);
    free(w);
    return rc;
  }
  *out = w;
  return 0;
}

void fr_etcd_watch_stop(fr_etcd_watch *w) {
  if (!w)
    return;
  uint64_t one = 1;
  if (write(w->wake, &one, sizeof one) != sizeof one)
    fr_warn("etcd watch: cannot wake its thread");
  pthread_join(w->thread, NULL);
  fr_http_close(&w->conn);
  close(w->wake);
  free(w->line);
  free(w);
}
