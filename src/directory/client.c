/*
 * The embedded directory's client (ferry://HOST:PORT). It dials the server's tcp listener, asks
 * for the server's full address and moves to shm when the two share a host (a directory call is
 * then a few microseconds of unix-socket traffic). Every operation is one ferry_call() on
 * FR_CHANNEL_DIRECTORY; a dead link is redialled once per call, and a server with a new instance
 * id (it restarted, its tables are empty) bumps the epoch so the node registers again. On the
 * server's host the client maps the server's change words (FR_DOP_WATCH, server.c): stamps read
 * them without a round trip, and a posted put bumps its key's word once it is in the ring (only
 * a client with the words mapped posts). With the words it maps the server's object table
 * (table.h): a lookup reads the key's slot there and asks the server only when the slot cannot
 * prove itself current, and a posted put takes a ticket and writes its record there before it
 * is sent. A client opened with fr_dir_open_local() calls an in-process server directly. Every
 * operation keeps to its caller's timeout: its redial, its pages and its chunks share one
 * deadline, and a caller waits for another one's dial no longer than its own timeout.
 *
 * Posted puts, sent without waiting for their answers, are client_posted.c; client_impl.h holds
 * what the two share.
 */
#include "core/channels.h"
#include "directory/client_impl.h"
#include "directory/table.h"
#include "transport/linkcalls.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct reply {
  ferry_msg *msg;
  void *buf;
  fr_rd rd;
} reply;

static void reply_free(reply *r) {
  ferry_msg_free(r->msg);
  free(r->buf);
}

/* ---- connecting ---- */

/* Milliseconds left before a deadline, at least 1: a step after the deadline still fails by
 * itself (with FERRY_ETIMEDOUT) instead of waiting without one. */
static int left_ms(uint64_t deadline_ns) {
  int ms = fr_ms_left(deadline_ns);
  return ms > 0 ? ms : 1;
}

static int no_directory(const emb *e, int rc) {
  fr_err_keep why;
  fr_err_save(&why, rc);
  return fr_err(FERRY_ECONNECT,
                "no ferry directory answers at ferry://%s (%s); start one with `ferry serve "
                "--listen %s`, or set FERRY_DIRECTORY to a running one",
                e->where, *why.detail ? why.detail : ferry_strerror(rc), e->where);
}

/* Asks `op`, a request without arguments, over l; *m: the answer. */
static int call_bare(ferry_link *l, uint16_t op, int timeout_ms, ferry_msg **m) {
  fr_wr w = {0};
  fr_wr_request(&w, op);
  struct iovec iov = {w.p, w.len};
  int rc = w.failed ? FERRY_ENOMEM : ferry_call(l, FR_CHANNEL_DIRECTORY, &iov, 1, m, timeout_ms);
  fr_wr_free(&w);
  return rc;
}

static int hello(emb *e, ferry_link *l, int timeout_ms, uint64_t *instance, char *address,
                 size_t cap) {
  ferry_msg *m = NULL;
  int rc = call_bare(l, FR_DOP_HELLO, timeout_ms, &m);
  if (rc != 0)
    return rc;
  fr_rd rd = fr_rd_init(m->data, m->len);
  int st = 0;
  char detail[256];
  fr_rd_reply(&rd, &st, detail, sizeof detail);
  *instance = fr_rd_u64(&rd);
  fr_rd_str(&rd, address, cap);
  rc = !fr_rd_done(&rd) ? fr_err(FERRY_EPROTO, "ferry://%s is not a ferry directory", e->where)
       : st             ? fr_err(st, "directory hello: %s", detail)
                        : 0;
  ferry_msg_free(m);
  return rc;
}

/* The shm part of an address list, if any. */
static bool shm_part(const char *address, char *out, size_t cap) {
  const char *p = strstr(address, "shm://");
  if (!p)
    return false;
  size_t n = strcspn(p, ",");
  if (n >= cap)
    return false;
  memcpy(out, p, n);
  out[n] = '\0';
  return true;
}

static int dial(emb *e, int timeout_ms, ferry_link **out) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  char url[FR_DIR_ADDRESS_MAX + 8], address[FR_DIR_ADDRESS_MAX + 1];
  snprintf(url, sizeof url, "tcp://%s", e->where);
  ferry_link *l = NULL;
  uint64_t instance = 0;
  int rc = ferry_connect(e->ctx, url, timeout_ms, &l);
  if (rc == FERRY_EAUTH)
    return rc;
  if (rc != 0)
    return no_directory(e, rc);
  if ((rc = hello(e, l, left_ms(deadline), &instance, address, sizeof address)) != 0) {
    ferry_link_close(l);
    return rc;
  }
  ferry_link *shm = NULL;
  int shm_ms = fr_ms_left(deadline) < 1000 ? fr_ms_left(deadline) : 1000;
  if (shm_ms > 0 && shm_part(address, url, sizeof url) &&
      ferry_connect(e->ctx, url, shm_ms, &shm) == 0) {
    ferry_link_close(l);
    l = shm;
  }
  fr_err_clear();
  if (instance != e->instance) {
    if (e->instance)
      fr_info("directory at ferry://%s restarted: registering again", e->where);
    e->instance = instance;
    __atomic_add_fetch(&e->epoch, 1, __ATOMIC_ACQ_REL);
  }
  *out = l;
  return 0;
}

static ferry_region_ref rd_ref(fr_rd *rd) {
  ferry_region_ref ref;
  ref.id = fr_rd_u64(rd);
  ref.key = fr_rd_u64(rd);
  ref.size = fr_rd_u64(rd);
  return ref;
}

/* Maps `bytes` of a region of the server's (read-write: the regions are); NULL when it cannot. */
static uint64_t *map_region(ferry_link *l, const ferry_region_ref *ref, size_t bytes) {
  const void *p = NULL;
  return ref->size >= bytes && ferry_view(l, ref, 0, bytes, &p) == 0 ? (uint64_t *)p : NULL;
}

/* Touches every page of a mapping now: a lookup that first touches its slot's page would pay a
 * page fault, which costs tens of microseconds on some VMs. */
static uint64_t *prefault(uint64_t *p, size_t bytes) {
  uint64_t sum = 0;
  for (size_t i = 0; i < bytes / 8; i += 4096 / 8)
    sum += __atomic_load_n(&p[i], __ATOMIC_RELAXED);
  __asm__ volatile("" ::"r"(sum));
  return p;
}

/* Maps the server's change words and object table over l (shm only): both, or neither. */
static void watch_map(emb *e, ferry_link *l, int timeout_ms) {
  __atomic_store_n(&e->watch, NULL, __ATOMIC_RELEASE);
  __atomic_store_n(&e->table, NULL, __ATOMIC_RELEASE);
  if (strcmp(ferry_link_transport(l), "shm") != 0)
    return;
  ferry_msg *m = NULL;
  int rc = call_bare(l, FR_DOP_WATCH, timeout_ms, &m);
  fr_rd rd = rc == 0 ? fr_rd_init(m->data, m->len) : fr_rd_init(NULL, 0);
  int st = 0;
  char detail[256];
  bool ok = rc == 0 && fr_rd_reply(&rd, &st, detail, sizeof detail) && st == 0;
  ferry_region_ref words = rd_ref(&rd);
  uint32_t buckets = fr_rd_u32(&rd);
  ferry_region_ref table = rd_ref(&rd);
  uint32_t slots = fr_rd_u32(&rd), slot_bytes = fr_rd_u32(&rd);
  ok = ok && fr_rd_done(&rd) && buckets == FR_DIR_WATCH_BUCKETS && slots == FR_DIR_TABLE_SLOTS &&
       slot_bytes == FR_DIR_TABLE_SLOT_BYTES;
  uint64_t *w = ok ? map_region(l, &words, (1 + (size_t)FR_DIR_WATCH_BUCKETS) * 8) : NULL;
  uint64_t *t = w ? map_region(l, &table, FR_DIR_TABLE_BYTES) : NULL;
  if (t) {
    __atomic_store_n(&e->watch, w, __ATOMIC_RELEASE);
    __atomic_store_n(&e->table, prefault(t, FR_DIR_TABLE_BYTES), __ATOMIC_RELEASE);
  }
  ferry_msg_free(m);
  fr_err_clear();
}

/* The current link, redialled when `dead` is the current one. Another caller may be dialling
 * a server that does not answer: the lock is waited for no longer than this call's timeout. */
int fr_dir_emb_current_link(emb *e, ferry_link *dead, int timeout_ms, ferry_link **out) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  if (fr_mutex_lock_until(&e->lock, deadline) != 0)
    return fr_err(FERRY_ETIMEDOUT,
                  "directory at ferry://%s: another call kept dialling it for %d ms", e->where,
                  timeout_ms);
  int rc = 0;
  if (!e->link || e->link == dead) {
    if (e->link) {
      if (FR_GROW(e->grave, e->capgrave, e->ngrave + 1, 4) == 0)
        e->grave[e->ngrave++] = e->link;
      /* else: leaked until exit; better than closing it under another caller */
      __atomic_store_n(&e->link, NULL, __ATOMIC_RELEASE);
      __atomic_store_n(&e->watch, NULL, __ATOMIC_RELEASE);
      __atomic_store_n(&e->table, NULL, __ATOMIC_RELEASE);
    }
    ferry_link *l = NULL;
    if ((rc = dial(e, timeout_ms, &l)) == 0) {
      watch_map(e, l, left_ms(deadline)); /* mapped before the link is seen: current_maps */
      __atomic_store_n(&e->link, l, __ATOMIC_RELEASE);
    }
  }
  if (rc == 0)
    *out = e->link;
  pthread_mutex_unlock(&e->lock);
  return rc;
}

/* The current link with the change words and table mapped over it, read without the lock (a
 * dial may hold it for its caller's whole timeout): the three as one link set them, else false.
 * A link is stored after its maps and cleared before them, and dead links are never freed while
 * the client lives (the grave), so a link read twice alike had these maps in between. */
bool fr_dir_emb_current_maps(emb *e, ferry_link **l, uint64_t **watch, uint64_t **table) {
  ferry_link *first = __atomic_load_n(&e->link, __ATOMIC_ACQUIRE);
  *watch = __atomic_load_n(&e->watch, __ATOMIC_ACQUIRE);
  *table = __atomic_load_n(&e->table, __ATOMIC_ACQUIRE);
  *l = __atomic_load_n(&e->link, __ATOMIC_ACQUIRE);
  return first && first == *l;
}

/* ---- calls ---- */

/* A round trip that timed out names the directory and the whole wait (ferry_call's detail names
 * only the server's node). */
static int asked(const emb *e, int rc, int timeout_ms) {
  return rc == FERRY_ETIMEDOUT
             ? fr_err_wrap(rc, "directory at ferry://%s did not answer within %d ms", e->where,
                           timeout_ms)
             : rc;
}

/* One round trip; the redial after a dead link and the call again share its deadline. */
static int call_link(emb *e, fr_wr *req, reply *r, int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  struct iovec iov = {req->p, req->len};
  ferry_link *l = NULL;
  int rc = fr_dir_emb_current_link(e, NULL, timeout_ms, &l);
  if (rc == 0)
    rc = asked(e, ferry_call(l, FR_CHANNEL_DIRECTORY, &iov, 1, &r->msg, left_ms(deadline)),
               timeout_ms);
  if ((rc == FERRY_EPEER || rc == FERRY_ECLOSED) && fr_ms_left(deadline) > 0) {
    if ((rc = fr_dir_emb_current_link(e, l, left_ms(deadline), &l)) == 0)
      rc = asked(e, ferry_call(l, FR_CHANNEL_DIRECTORY, &iov, 1, &r->msg, left_ms(deadline)),
                 timeout_ms);
  }
  if (rc == 0)
    r->rd = fr_rd_init(r->msg->data, r->msg->len);
  return rc;
}

/* Sends a request and checks the reply's header; on success r->rd is at the payload. */
static int call(emb *e, fr_wr *req, reply *r, int timeout_ms) {
  memset(r, 0, sizeof *r);
  int rc;
  if (req->failed) {
    rc = fr_err(FERRY_ENOMEM, "directory request");
  } else if (e->local) {
    size_t len = 0;
    fr_dir_server_call(e->local, req->p, req->len, &r->buf, &len);
    r->rd = fr_rd_init(r->buf, len);
    rc = r->buf ? 0 : fr_err(FERRY_ENOMEM, "directory reply");
  } else {
    rc = call_link(e, req, r, timeout_ms);
  }
  fr_wr_free(req);
  int st = 0;
  char detail[512];
  if (rc == 0 && !fr_rd_reply(&r->rd, &st, detail, sizeof detail))
    rc = fr_err(FERRY_EPROTO, "directory at ferry://%s: malformed reply", e->where);
  else if (rc == 0 && st != 0)
    rc = fr_err(st, "%s", detail);
  if (rc != 0)
    reply_free(r);
  return rc;
}

static int finish(emb *e, reply *r) {
  int rc = fr_rd_done(&r->rd)
               ? 0
               : fr_err(FERRY_EPROTO, "directory at ferry://%s: malformed reply", e->where);
  reply_free(r);
  return rc;
}

/* ---- operations ---- */

static int emb_node_put(void *st, const fr_dir_node *n, int lease_ms, uint64_t takeover,
                        fr_dir_node *holder, int timeout_ms) {
  fr_wr w = {0};
  fr_wr_request(&w, FR_DOP_NODE_PUT);
  fr_wr_node(&w, n);
  fr_wr_u32(&w, (uint32_t)lease_ms);
  fr_wr_u64(&w, takeover);
  reply r;
  int rc = call(st, &w, &r, timeout_ms);
  if (rc != 0)
    return rc;
  fr_dir_node h;
  uint32_t left = 0;
  bool taken = fr_rd_u8(&r.rd) != 0;
  if (taken) {
    fr_rd_node(&r.rd, &h);
    left = fr_rd_u32(&r.rd);
  }
  if ((rc = finish(st, &r)) != 0 || !taken)
    return rc;
  if (holder)
    *holder = h;
  return fr_dir_name_taken(&h, left);
}

static int emb_node_renew(void *st, const char *name, uint64_t incarnation, int lease_ms,
                          int timeout_ms) {
  fr_wr w = {0};
  fr_wr_request(&w, FR_DOP_NODE_RENEW);
  fr_wr_str(&w, name);
  fr_wr_u64(&w, incarnation);
  fr_wr_u32(&w, (uint32_t)lease_ms);
  reply r;
  int rc = call(st, &w, &r, timeout_ms);
  return rc ? rc : finish(st, &r);
}

static int emb_node_renew_batch(void *st, const fr_dir_renewal *rn, size_t n, int *status,
                                int timeout_ms) {
  if (n > FR_DIR_BATCH_MAX)
    return fr_err(FERRY_EINVAL, "renew: %zu names (at most %d)", n, FR_DIR_BATCH_MAX);
  fr_wr w = {0};
  fr_wr_request(&w, FR_DOP_NODE_RENEW_BATCH);
  fr_wr_u32(&w, (uint32_t)n);
  for (size_t i = 0; i < n; i++) {
    fr_wr_str(&w, rn[i].name);
    fr_wr_u64(&w, rn[i].incarnation);
    fr_wr_u32(&w, (uint32_t)rn[i].lease_ms);
  }
  reply r;
  int rc = call(st, &w, &r, timeout_ms);
  if (rc != 0)
    return rc;
  for (size_t i = 0; i < n && !r.rd.failed; i++) {
    status[i] = (int32_t)fr_rd_u32(&r.rd);
    if (status[i] != 0 && status[i] != FERRY_ENOTFOUND)
      r.rd.failed = true;
  }
  return finish(st, &r);
}

static int emb_node_get(void *st, const char *name, fr_dir_node *out, int timeout_ms) {
  fr_wr w = {0};
  fr_wr_request(&w, FR_DOP_NODE_GET);
  fr_wr_str(&w, name);
  reply r;
  int rc = call(st, &w, &r, timeout_ms);
  if (rc != 0)
    return rc;
  fr_dir_node n;
  fr_rd_node(&r.rd, &n);
  if ((rc = finish(st, &r)) == 0)
    *out = n;
  return rc;
}

static int emb_node_list(void *st, fr_dir_node **out, size_t *count, int timeout_ms) {
  fr_wr w = {0};
  fr_wr_request(&w, FR_DOP_NODE_LIST);
  reply r;
  int rc = call(st, &w, &r, timeout_ms);
  if (rc != 0)
    return rc;
  uint32_t n = fr_rd_u32(&r.rd);
  fr_dir_node *v = n <= r.rd.len / 17 ? calloc(n ? n : 1, sizeof *v) : NULL;
  if (!v) {
    reply_free(&r);
    return fr_err(FERRY_EPROTO, "directory: bad node list");
  }
  for (uint32_t i = 0; i < n; i++)
    fr_rd_node(&r.rd, &v[i]);
  if ((rc = finish(st, &r)) != 0) {
    free(v);
    return rc;
  }
  *out = v;
  *count = n;
  return 0;
}

static int emb_node_del(void *st, const char *name, uint64_t incarnation, int timeout_ms) {
  fr_wr w = {0};
  fr_wr_request(&w, FR_DOP_NODE_DEL);
  fr_wr_str(&w, name);
  fr_wr_u64(&w, incarnation);
  reply r;
  int rc = call(st, &w, &r, timeout_ms);
  return rc ? rc : finish(st, &r);
}

/* A put's arguments: u32 flags (without the client-side POSTED), the object. */
static void put_one_args(fr_wr *w, const fr_dir_object *o, unsigned flags) {
  fr_wr_u32(w, flags & ~FR_DIR_PUT_POSTED);
  fr_wr_object(w, o);
}

/* A batch's arguments: u32 flags, u32 n, n objects. */
static void put_args(fr_wr *w, const fr_dir_object *objs, size_t n, unsigned flags) {
  fr_wr_u32(w, flags & ~FR_DIR_PUT_POSTED);
  fr_wr_u32(w, (uint32_t)n);
  for (size_t i = 0; i < n; i++)
    fr_wr_object(w, &objs[i]);
}

static int emb_obj_put(void *st, const fr_dir_object *o, unsigned flags, fr_dir_object *replaced,
                       bool *had_other, int timeout_ms) {
  if (flags & FR_DIR_PUT_POSTED) {
    uint8_t buf[FR_DIR_OBJECT_WIRE_MAX + 16];
    fr_wr args = FR_WR_ON(buf);
    put_one_args(&args, o, flags);
    bool sent = fr_dir_emb_post(st, FR_DOP_OBJ_PUT, &args, o, 1, flags, timeout_ms);
    fr_wr_free(&args);
    if (sent && had_other)
      *had_other = false;
    if (sent)
      return 0;
  }
  fr_wr w = {0};
  fr_wr_request(&w, FR_DOP_OBJ_PUT);
  put_one_args(&w, o, flags);
  reply r;
  int rc = call(st, &w, &r, timeout_ms);
  if (rc != 0)
    return rc;
  fr_dir_object old;
  bool other;
  fr_dir_emb_read_put_answer(&r.rd, false, &other, &old);
  if ((rc = finish(st, &r)) != 0)
    return rc;
  if (had_other)
    *had_other = other;
  if (other && replaced)
    *replaced = old;
  return 0;
}

static int put_chunk(void *st, const fr_dir_object *objs, size_t n, unsigned flags, int *status,
                     fr_dir_object *replaced, bool *had_other, int timeout_ms) {
  if (flags & FR_DIR_PUT_POSTED) {
    fr_wr args = {0};
    put_args(&args, objs, n, flags);
    bool sent = fr_dir_emb_post(st, FR_DOP_OBJ_PUT_BATCH, &args, objs, n, flags, timeout_ms);
    fr_wr_free(&args);
    for (size_t i = 0; sent && i < n; i++) {
      status[i] = 0;
      had_other[i] = false;
    }
    if (sent)
      return 0;
  }
  fr_wr w = {0};
  fr_wr_request(&w, FR_DOP_OBJ_PUT_BATCH);
  put_args(&w, objs, n, flags);
  reply r;
  int rc = call(st, &w, &r, timeout_ms);
  if (rc != 0)
    return rc;
  for (size_t i = 0; i < n && !r.rd.failed; i++) {
    status[i] = fr_dir_emb_read_put_answer(&r.rd, true, &had_other[i], &replaced[i]);
    if (!r.rd.failed && status[i] != 0)
      fr_err(status[i], "put '%s': %s", objs[i].key, ferry_strerror(status[i]));
  }
  return finish(st, &r);
}

static int emb_obj_put_batch(void *st, const fr_dir_object *objs, size_t n, unsigned flags,
                             int *status, fr_dir_object *replaced, bool *had_other,
                             int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  for (size_t i = 0; i < n; i += FR_DIR_BATCH_MAX) {
    size_t k = n - i < FR_DIR_BATCH_MAX ? n - i : FR_DIR_BATCH_MAX;
    int rc = put_chunk(st, objs + i, k, flags, status + i, replaced + i, had_other + i,
                       left_ms(deadline));
    if (rc != 0)
      return rc;
  }
  return 0;
}

static int get_chunk(void *st, const char *const *keys, size_t n, fr_dir_object *out, int *status,
                     int timeout_ms) {
  fr_wr w = {0};
  fr_wr_request(&w, FR_DOP_OBJ_GET);
  fr_wr_u32(&w, (uint32_t)n);
  for (size_t i = 0; i < n; i++)
    fr_wr_str(&w, keys[i]);
  reply r;
  int rc = call(st, &w, &r, timeout_ms);
  if (rc != 0)
    return rc;
  for (size_t i = 0; i < n && !r.rd.failed; i++) {
    status[i] = (int32_t)fr_rd_u32(&r.rd);
    if (status[i] == 0)
      fr_rd_object(&r.rd, &out[i]);
    else if (status[i] != FERRY_ENOTFOUND)
      r.rd.failed = true;
  }
  return finish(st, &r);
}

static int emb_obj_get(void *st, const char *const *keys, size_t n, fr_dir_object *out, int *status,
                       int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  for (size_t i = 0; i < n; i += FR_DIR_BATCH_MAX) {
    size_t k = n - i < FR_DIR_BATCH_MAX ? n - i : FR_DIR_BATCH_MAX;
    int rc = get_chunk(st, keys + i, k, out + i, status + i, left_ms(deadline));
    if (rc != 0)
      return rc;
  }
  return 0;
}

static int emb_obj_del(void *st, const char *key, const char *owner, uint64_t gen,
                       fr_dir_object *deleted, int timeout_ms) {
  fr_wr w = {0};
  fr_wr_request(&w, FR_DOP_OBJ_DEL);
  fr_wr_str(&w, key);
  fr_wr_str(&w, owner ? owner : "");
  fr_wr_u64(&w, gen);
  reply r;
  int rc = call(st, &w, &r, timeout_ms);
  if (rc != 0)
    return rc;
  fr_dir_object o;
  fr_rd_object(&r.rd, &o);
  if ((rc = finish(st, &r)) == 0 && deleted)
    *deleted = o;
  return rc;
}

/* One page of a scan, appended to *v. */
static int scan_page(emb *e, const char *prefix, const char *after, fr_dir_object **v, size_t *n,
                     size_t *cap, bool *more, int timeout_ms) {
  fr_wr w = {0};
  fr_wr_request(&w, FR_DOP_OBJ_SCAN);
  fr_wr_str(&w, prefix);
  fr_wr_str(&w, after);
  fr_wr_u32(&w, FR_DIR_SCAN_PAGE);
  reply r;
  int rc = call(e, &w, &r, timeout_ms);
  if (rc != 0)
    return rc;
  uint32_t k = fr_rd_u32(&r.rd);
  if (k > FR_DIR_SCAN_PAGE) {
    reply_free(&r);
    return fr_err(FERRY_EPROTO, "directory at ferry://%s: malformed scan reply", e->where);
  }
  if (FR_GROW(*v, *cap, *n + k, FR_DIR_SCAN_PAGE) != 0) {
    reply_free(&r);
    return fr_err(FERRY_ENOMEM, "scan: %zu records", *n + k);
  }
  for (uint32_t i = 0; i < k; i++)
    fr_rd_object(&r.rd, &(*v)[*n + i]);
  *more = fr_rd_u8(&r.rd) != 0;
  if ((rc = finish(e, &r)) == 0)
    *n += k;
  return rc;
}

static int emb_obj_scan(void *st, const char *prefix, fr_dir_object **out, size_t *count,
                        int timeout_ms) {
  fr_dir_object *v = NULL;
  size_t n = 0, cap = 0;
  bool more = true;
  int rc = 0;
  uint64_t deadline = fr_deadline_ns(timeout_ms); /* every page within the one call's timeout */
  while (rc == 0 && more)
    rc = scan_page(st, prefix, n ? v[n - 1].key : "", &v, &n, &cap, &more, left_ms(deadline));
  if (rc != 0) {
    free(v);
    return rc;
  }
  *out = v ? v : calloc(1, sizeof *v);
  *count = n;
  return *out ? 0 : fr_err(FERRY_ENOMEM, "scan");
}

static bool emb_stamp(void *st, const char *key, fr_dir_stamp *out) {
  emb *e = st;
  ferry_link *l;
  uint64_t *w, *t;
  bool same = fr_dir_emb_current_maps(e, &l, &w, &t);
  uint64_t epoch = __atomic_load_n(&e->epoch, __ATOMIC_ACQUIRE); /* bumped before l was stored */
  /* a dead link: the server may be gone and another one taking puts that these words miss */
  if (!same || !w || !fr_link_is_open(l))
    return false;
  out->epoch = epoch;
  out->all = __atomic_load_n(&w[0], __ATOMIC_SEQ_CST);
  out->key =
      __atomic_load_n(&w[1 + fr_dir_watch_bucket(key, FR_DIR_WATCH_BUCKETS)], __ATOMIC_SEQ_CST);
  return true;
}

/* A lookup in the server's shared table: no round trip, nobody woken (table.h). */
static bool emb_peek(void *st, const char *key, fr_dir_object *out) {
  emb *e = st;
  ferry_link *l;
  uint64_t *w, *t;
  bool same = fr_dir_emb_current_maps(e, &l, &w, &t);
  /* a dead link: the server may be gone and another one taking puts that this table misses */
  if (!same || !t || !fr_link_is_open(l))
    return false;
  return fr_dir_table_read(fr_dir_table_slot(t, FR_DIR_TABLE_SLOTS, key), key, out);
}

/* ---- lifecycle ---- */

static int emb_open(ferry_ctx *ctx, const char *where, int timeout_ms, void **state) {
  if (!ctx)
    return fr_err(FERRY_EINVAL, "ferry:// directory needs a context");
  if (!*where || !strchr(where, ':'))
    return fr_err(FERRY_EINVAL, "directory 'ferry://%s': expected ferry://HOST:PORT", where);
  if (strchr(where, '?')) /* namespaces (fr_dir_url_ns) live in shared servers: Redis, etcd */
    return fr_err(FERRY_EINVAL,
                  "directory 'ferry://%s': ferry:// takes no ?ns= namespace; a `ferry serve` "
                  "is one fleet's directory (run one per fleet, or share a redis:// URL with "
                  "?ns=NAME)",
                  where);
  emb *e = calloc(1, sizeof *e);
  if (!e)
    return fr_err(FERRY_ENOMEM, "directory client");
  e->ctx = ctx;
  fr_str_copy(e->where, sizeof e->where, where);
  pthread_mutex_init(&e->lock, NULL);
  pthread_mutex_init(&e->posted_lock, NULL);
  ferry_link *l;
  int rc = fr_dir_emb_current_link(e, NULL, timeout_ms, &l);
  if (rc != 0) {
    pthread_mutex_destroy(&e->posted_lock);
    pthread_mutex_destroy(&e->lock);
    free(e);
    return rc;
  }
  *state = e;
  return 0;
}

static void emb_close(void *state) {
  emb *e = state;
  if (!e)
    return;
  fr_dir_emb_settle(e, true, NULL, NULL, 0); /* unregisters what is still pending from the links */
  pthread_mutex_destroy(&e->posted_lock);
  ferry_link_close(e->link);
  for (size_t i = 0; i < e->ngrave; i++)
    ferry_link_close(e->grave[i]);
  free(e->grave);
  pthread_mutex_destroy(&e->lock);
  free(e);
}

/* Without the lock: every put asks (fr_dir_lease_current), and a dial may hold the lock for its
 * caller's whole timeout. */
static uint64_t emb_epoch(void *state) {
  emb *e = state;
  return __atomic_load_n(&e->epoch, __ATOMIC_ACQUIRE);
}

const fr_dir_ops fr_dir_embedded_ops = {
    .scheme = "ferry://",
    .open = emb_open,
    .close = emb_close,
    .epoch = emb_epoch,
    .node_put = emb_node_put,
    .node_renew = emb_node_renew,
    .node_get = emb_node_get,
    .node_list = emb_node_list,
    .node_del = emb_node_del,
    .obj_put = emb_obj_put,
    .obj_put_batch = emb_obj_put_batch,
    .obj_get = emb_obj_get,
    .obj_del = emb_obj_del,
    .obj_scan = emb_obj_scan,
    .settle = fr_dir_emb_settle,
    .stamp = emb_stamp,
    .peek = emb_peek,
    .node_renew_batch = emb_node_renew_batch,
};

int fr_dir_open_local(fr_dir_server *srv, fr_dir **out) {
  fr_dir *d = calloc(1, sizeof *d);
  emb *e = calloc(1, sizeof *e);
  if (!d || !e) {
    free(d);
    free(e);
    return fr_err(FERRY_ENOMEM, "directory client");
  }
  pthread_mutex_init(&e->lock, NULL);
  pthread_mutex_init(&e->posted_lock, NULL);
  e->local = srv;
  e->epoch = 1;
  snprintf(e->where, sizeof e->where, "(in-process)");
  d->ops = &fr_dir_embedded_ops;
  d->state = e;
  snprintf(d->url, sizeof d->url, "ferry://(in-process)");
  *out = d;
  return 0;
}
