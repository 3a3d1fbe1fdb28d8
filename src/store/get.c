/*
 * Reading objects. A get looks the key up in the directory (or its cache, lookup.c), then reads
 * the bytes straight from the owner over a cached link (one memcpy on one host, one stream over
 * tcp), then reads the object's generation word: a mismatch means the owner replaced or deleted
 * it during the copy, and the get looks it up again and reads again, backing off, until it has a
 * whole copy or its timeout passes. Bytes whose region is gone while their generation word still
 * says their version were freed by an owner that still publishes them: that fails at once
 * (FERRY_EFREED). A batch get does one directory round trip for all keys and keeps
 * FERRY_STORE_THREADS reads in flight with helpers from the process's task pool (core/task.h).
 * Links to owners come from the peer cache (directory/peers.c), by node name. A get into CUDA
 * memory copies host to device from where the bytes already are (this node's pool, or, through the
 * link's read, a same-host owner's pool mapped here), or, across hosts, through host memory a chunk
 * at a time (the link's read too); the caller's pointer is classified once per call (per item in a
 * batch) for its allocation's end and this node's own pool, never per chunk. An object held in a
 * device pool (devpool.c) is a registered CUDA region to its readers: the link's read copies it
 * device to device (or device to host) through the owner's allocation mapped once per link with
 * CUDA IPC, or, across hosts, staged by the owner; a view of it is a private host copy. Each object
 * read whole (a get, a batch item, a view) counts once for its owner, whose CPU the read bypasses:
 * a read receipt (receipts.c), sent later.
 */
#include "store/store.h"
#include "core/task.h"
#include "transport/access.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <time.h>

#define PROGRESS_CHUNK (64ull << 20)

/* ---- reading one object ---- */

typedef void (*progress_fn)(void *arg, uint64_t done, uint64_t total);

static int stale(const fr_dir_object *rec) {
  return fr_err(FERRY_ESTALE, "get '%s': replaced or deleted during the read", rec->key);
}

/* The owner freed the memory of an object it still publishes in place (its generation word
 * still says this version while its bytes' region is gone): nothing will bring those bytes back,
 * and nothing republishes the key, so the reader is told at once instead of retrying until its
 * timeout. A re-put or delete retires the version (its word leaves the generation) before the
 * caller gets the memory back, so an ordinary replace never looks like this. */
static int freed(const fr_dir_object *rec) {
  return fr_err(FERRY_EFREED,
                "get '%s': its owner '%s' freed the memory of generation %llu while still "
                "publishing it (memory put in place must stay allocated until the key is deleted "
                "or replaced)",
                rec->key, rec->owner, (unsigned long long)rec->generation);
}

/* A read or view of rec's bytes failed with rc, which says their region is gone (freed, or never
 * there) when it is ENOTFOUND or ESTALE: whether the generation word, read through the same
 * link, still says rec's version (freed while published), rather than a replace or delete
 * (stale: look again). */
static bool freed_under(ferry_link *l, const fr_dir_object *rec, int rc, int timeout_ms) {
  uint64_t gen = 0;
  return (rc == FERRY_ENOTFOUND || rc == FERRY_ESTALE) &&
         ferry_read(l, &rec->gen_region, rec->gen_offset, &gen, sizeof gen, timeout_ms) == 0 &&
         gen == rec->generation;
}

/* Whether this node's own in-place object still lies in ferry memory (a pool copy always
 * does). Lock held: o is in the owned table. */
static bool owned_mapped(ferry_store *s, const fr_owned *o) {
  ferry_region_ref ref;
  if (o->pool_off != FR_STORE_NO_POOL || o->rec.bytes == 0)
    return true;
  bool ok = ferry_region_find(s->ctx, o->data, (size_t)o->rec.bytes, &ref, NULL) == 0;
  fr_err_clear();
  return ok;
}

static int read_local(ferry_store *s, const fr_dir_object *rec, void *dst, int device) {
  int rc = 0;
  pthread_mutex_lock(&s->lock);
  size_t at;
  fr_owned *o = fr_store_find_owned(s, rec->key, &at);
  bool ok = o && o->rec.generation == rec->generation;
  bool mapped = !ok || owned_mapped(s, o);
  const uint8_t *src = ok ? o->data : NULL;
  uint32_t slot = ok ? o->slot : 0;
  bool on_device = ok && o->on_device; /* then src is in the device pool, on s->dev.device */
  int src_device = s->dev.device;
  pthread_mutex_unlock(&s->lock);
  if (!ok)
    return stale(rec);
  if (!mapped)
    return freed(rec);
  if (device < 0 && on_device)
    rc = fr_cuda_copy_on(src_device, dst, src, (size_t)rec->bytes);
  else if (device < 0)
    memcpy(dst, src, rec->bytes);
  else
    rc = fr_cuda_copy_on(device, dst, src, (size_t)rec->bytes);
  if (rc != 0)
    return fr_err_wrap(rc, "get '%s': %s CUDA device %d", rec->key, device < 0 ? "from" : "into",
                       device < 0 ? src_device : device);
  __atomic_signal_fence(__ATOMIC_SEQ_CST); /* x86 keeps loads in order; stop the compiler */
  return __atomic_load_n(fr_store_gen(s, slot), __ATOMIC_ACQUIRE) == rec->generation ? 0
                                                                                     : stale(rec);
}

static int read_bytes(ferry_link *l, const fr_dir_object *rec, void *dst, progress_fn progress,
                      void *arg, uint64_t deadline) {
  uint64_t chunk = progress ? PROGRESS_CHUNK : rec->bytes;
  int rc = 0;
  for (uint64_t done = 0; rc == 0 && done < rec->bytes; done += chunk) {
    uint64_t n = rec->bytes - done < chunk ? rec->bytes - done : chunk;
    rc = ferry_read(l, &rec->region, rec->offset + done, (uint8_t *)dst + done, (size_t)n,
                    fr_store_left(deadline));
    if (rc == 0 && progress)
      progress(arg, done + n, rec->bytes);
  }
  return rc;
}

/* dst may be device memory: the link's read copies straight into it from the owner's pool mapped
 * here (shm), or through host memory a chunk at a time (tcp, ucx). */
static int read_remote(ferry_store *s, const fr_dir_object *rec, void *dst, progress_fn progress,
                       void *arg, int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  fr_peer *p;
  int rc = fr_peer_acquire(&s->peers, rec->owner, timeout_ms, &p);
  if (rc != 0)
    return rc;
  uint64_t gen = 0;
  rc = read_bytes(p->link, rec, dst, progress, arg, deadline);
  if (rc == 0)
    rc = ferry_read(p->link, &rec->gen_region, rec->gen_offset, &gen, sizeof gen,
                    fr_store_left(deadline));
  else if (freed_under(p->link, rec, rc, fr_store_left(deadline)))
    rc = FERRY_EFREED;
  bool dead = rc == FERRY_EPEER || rc == FERRY_ECLOSED;
  fr_peer_release(&s->peers, p, dead);
  if (dead)
    return fr_err_wrap(FERRY_EPEER, "get '%s': owner '%s' is gone", rec->key, rec->owner);
  if (rc == FERRY_EFREED)
    return freed(rec);
  if (rc == FERRY_ENOTFOUND || rc == FERRY_ESTALE || rc == FERRY_ERANGE || rc == FERRY_EACCES)
    return stale(rec); /* the region went away or changed: look the key up again */
  if (rc != 0)
    return fr_err_wrap(rc, "get '%s' from '%s'", rec->key, rec->owner);
  return gen == rec->generation ? 0 : stale(rec);
}

/* Reads one whole object; each one read counts once for its owner (receipts.c). */
static int read_object(ferry_store *s, const fr_dir_object *rec, void *dst, int device,
                       progress_fn progress, void *arg, int timeout_ms) {
  int rc;
  if (s->mem && strcmp(rec->owner, s->name) == 0) {
    rc = read_local(s, rec, dst, device);
    if (rc == 0 && progress)
      progress(arg, rec->bytes, rec->bytes);
  } else {
    rc = read_remote(s, rec, dst, progress, arg, timeout_ms);
  }
  if (rc == 0)
    fr_store_receipt(s, rec->owner, rec->bytes);
  return rc;
}

int fr_store_read(ferry_store *s, const fr_dir_object *rec, void *dst, int device, int timeout_ms) {
  return read_object(s, rec, dst, device, NULL, NULL, timeout_ms);
}

/* ---- get ---- */

/* Whether the object fits the caller's buffer: cap bytes, or fewer when dst is device memory
 * whose allocation ends sooner (room: fr_store_device), so nothing is written past either. */
static int check_fit(const fr_dir_object *rec, const ferry_tensor_desc *expect, size_t cap,
                     size_t room) {
  char a[160], b[160];
  if (expect && expect->dtype != FERRY_DTYPE_INVALID) {
    bool dtype_ok = expect->dtype == rec->desc.dtype;
    bool shape_ok = expect->ndim == rec->desc.ndim &&
                    memcmp(expect->shape, rec->desc.shape, rec->desc.ndim * 8) == 0;
    if (!dtype_ok || !shape_ok)
      return fr_err(dtype_ok ? FERRY_ESHAPE : FERRY_EDTYPE,
                    "get '%s': stored as %s %s, expected %s %s", rec->key,
                    ferry_dtype_name(rec->desc.dtype), ferry_shape_format(&rec->desc, a, sizeof a),
                    ferry_dtype_name(expect->dtype) ? ferry_dtype_name(expect->dtype) : "?",
                    ferry_shape_format(expect, b, sizeof b));
  }
  if (cap < rec->bytes)
    return fr_err(FERRY_ERANGE, "get '%s': %llu bytes do not fit a buffer of %zu", rec->key,
                  (unsigned long long)rec->bytes, cap);
  if (room < rec->bytes)
    return fr_err(FERRY_ERANGE,
                  "get '%s': %llu bytes do not fit the CUDA allocation at dst (%zu bytes from "
                  "there)",
                  rec->key, (unsigned long long)rec->bytes, room);
  return 0;
}

static void info_out(const fr_dir_object *rec, ferry_store_info *info) {
  if (info)
    fr_store_info_from(rec, info);
}

/* Between attempts of a get whose object was replaced under it: the first retries go at once
 * (the new version is already published), later ones back off up to 1 ms so that a producer
 * re-putting in a tight loop gets the core it needs to finish, and the reader a quiet window. */
static void backoff(int attempt) {
  if (attempt < 2)
    return;
  if (attempt < 4) {
    sched_yield();
    return;
  }
  int shift = attempt - 4 < 5 ? attempt - 4 : 5;
  struct timespec ts = {0, (long)(30000 << shift)}; /* 30 us .. ~1 ms */
  nanosleep(&ts, NULL);
}

/* dst: a destination classified once (fr_store_device) for every attempt of a get. */
typedef struct get_dst {
  void *p;
  size_t cap, room;
  int device;
} get_dst;

/* The timeout passed after the object was replaced during every read so far: FERRY_ESTALE, as
 * ferry.h promises, even when the deadline fell inside a lookup or a read (FERRY_ETIMEDOUT). */
static int stale_until_timeout(const char *key, int stale_reads, int timeout_ms) {
  return fr_err(FERRY_ESTALE,
                "get '%s': replaced during each of %d reads in %d ms (no whole copy in time)", key,
                stale_reads, timeout_ms);
}

static int get_tries(ferry_store *s, const char *key, const ferry_tensor_desc *expect,
                     const get_dst *dst, ferry_store_info *info, progress_fn progress, void *arg,
                     int timeout_ms, uint64_t *bytes) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  fr_dir_object rec;
  int rc, stale_reads = 0, dead = 0;
  for (int attempt = 0;; attempt++) {
    if ((rc = fr_store_lookup_again(s, key, &rec, fr_store_left(deadline), attempt > 0)) != 0 ||
        (rc = check_fit(&rec, expect, dst->cap, dst->room)) != 0)
      return rc == FERRY_ETIMEDOUT && stale_reads > 0
                 ? stale_until_timeout(key, stale_reads, timeout_ms)
                 : rc;
    rc = read_object(s, &rec, dst->p, dst->device, progress, arg, fr_store_left(deadline));
    if (rc == FERRY_ETIMEDOUT && stale_reads > 0)
      return stale_until_timeout(key, stale_reads, timeout_ms);
    if (rc == FERRY_ESTALE || rc == FERRY_EPEER)
      fr_store_forget(s, key);
    /* stale: look again until the deadline; a dead owner: once more, in case the key moved */
    if (rc == FERRY_ESTALE)
      stale_reads++;
    else if (rc != FERRY_EPEER || dead++ > 0)
      break;
    if (fr_ms_left(deadline) == 0)
      return rc == FERRY_ESTALE ? stale_until_timeout(key, stale_reads, timeout_ms) : rc;
    backoff(stale_reads);
  }
  if (rc == 0) {
    info_out(&rec, info);
    *bytes = rec.bytes;
  }
  return rc;
}

/* One get, counted in the store's metrics. */
static int get_loop(ferry_store *s, const char *key, const ferry_tensor_desc *expect,
                    const get_dst *dst, ferry_store_info *info, progress_fn progress, void *arg,
                    int timeout_ms) {
  uint64_t t0 = fr_now_ns(), bytes = 0;
  int rc = get_tries(s, key, expect, dst, info, progress, arg, timeout_ms, &bytes);
  fr_store_count(s, false, rc == 0, rc != 0, bytes, t0);
  return rc;
}

int ferry_store_get(ferry_store *s, const char *key, const ferry_tensor_desc *expect, void *dst,
                    size_t cap, ferry_store_info *info, int timeout_ms) {
  if (!s || (!dst && cap > 0))
    return fr_err(FERRY_EINVAL, "get: NULL argument");
  int rc = fr_dir_key_check(key, "get");
  if (rc != 0)
    return rc;
  get_dst d = {.p = dst, .cap = cap, .room = SIZE_MAX, .device = -1};
  if (cap > 0)
    d.device = fr_store_device(dst, &d.room);
  return get_loop(s, key, expect, &d, info, NULL, NULL, fr_timeout(timeout_ms));
}

int fr_store_get_progress(ferry_store *s, const char *key, void **out, ferry_store_info *info,
                          progress_fn progress, void *arg, int timeout_ms) {
  if (!s || !out)
    return fr_err(FERRY_EINVAL, "get: NULL argument");
  int rc = fr_dir_key_check(key, "get");
  uint64_t deadline = fr_deadline_ns(fr_timeout(timeout_ms));
  for (int attempt = 0; rc == 0 && attempt < 3; attempt++) {
    fr_dir_object rec;
    uint64_t t0 = fr_now_ns();
    if ((rc = fr_store_lookup(s, key, &rec, fr_store_left(deadline))) != 0) {
      fr_store_count(s, false, 0, 1, 0, t0); /* the get that get_loop would have counted */
      return rc;
    }
    void *buf = fr_malloc_large((size_t)rec.bytes);
    if (!buf)
      return fr_err(FERRY_ENOMEM, "get '%s': %llu bytes", key, (unsigned long long)rec.bytes);
    get_dst d = {.p = buf, .cap = (size_t)rec.bytes, .room = SIZE_MAX, .device = -1};
    rc = get_loop(s, key, NULL, &d, info, progress, arg, fr_store_left(deadline));
    if (rc == 0) {
      *out = buf;
      return 0;
    }
    free(buf);
    if (rc == FERRY_ERANGE) /* re-put with another size meanwhile */
      rc = 0;
    else
      return rc;
  }
  return rc ? rc : fr_err(FERRY_ESTALE, "get '%s': its size keeps changing", key);
}

int ferry_store_get_alloc(ferry_store *s, const char *key, void **out, ferry_store_info *info,
                          int timeout_ms) {
  return fr_store_get_progress(s, key, out, info, NULL, NULL, timeout_ms);
}

/* ---- batch get ---- */

typedef struct fr_batch {
  ferry_store *s;
  ferry_store_item *items;
  fr_dir_object *recs;
  int *devices; /* each item's dst: fr_store_device */
  size_t n;
  size_t next; /* atomic */
  uint64_t deadline;
  pthread_mutex_t lock;
  pthread_cond_t done; /* the last helper out signals it (the caller waits) */
  int helpers;         /* lock: helpers (pool tasks) still inside run_jobs */
} fr_batch;

#define PENDING 1

static void run_jobs(fr_batch *b) {
  for (;;) {
    size_t i = __atomic_fetch_add(&b->next, 1, __ATOMIC_ACQ_REL);
    if (i >= b->n)
      return;
    ferry_store_item *it = &b->items[i];
    if (it->status != PENDING)
      continue;
    it->status =
        fr_store_read(b->s, &b->recs[i], it->dst, b->devices[i], fr_store_left(b->deadline));
    it->bytes = it->status == 0 ? b->recs[i].bytes : 0;
  }
}

/* A helper: a task of the process's pool (core/task.h) that reads items until none is left.
 * Only the last one out signals the caller; b is the caller's, not touched after the unlock. */
static void helper_main(void *arg) {
  fr_batch *b = arg;
  run_jobs(b);
  pthread_mutex_lock(&b->lock);
  if (--b->helpers == 0)
    pthread_cond_signal(&b->done);
  pthread_mutex_unlock(&b->lock);
}

/* FERRY_STORE_THREADS reads in flight: the caller and up to that many less one helpers, as many
 * as the pool has free (none: the caller reads alone; a batch waiting out its timeout on an
 * owner that does not answer holds its own helpers, nobody else's). */
static void run_batch(fr_batch *b) {
  int64_t want = fr_config_int("FERRY_STORE_THREADS") - 1;
  want = want > (int64_t)b->n - 1 ? (int64_t)b->n - 1 : want;
  pthread_mutex_init(&b->lock, NULL);
  pthread_cond_init(&b->done, NULL);
  b->helpers = want > 0 ? (int)want : 0; /* counted before they start: one may end at once */
  int refused = b->helpers - fr_task_try_many(helper_main, b, b->helpers);
  pthread_mutex_lock(&b->lock);
  b->helpers -= refused;
  pthread_mutex_unlock(&b->lock);
  run_jobs(b);
  pthread_mutex_lock(&b->lock);
  while (b->helpers > 0)
    pthread_cond_wait(&b->done, &b->lock);
  pthread_mutex_unlock(&b->lock);
  pthread_cond_destroy(&b->done);
  pthread_mutex_destroy(&b->lock);
}

/* Looks up, in one round trip, the keys that the directory's shared table did not answer
 * (fr_dir_ops.peek); st[] is n long and starts at 0 (found). */
static int batch_ask(ferry_store *s, fr_batch *b, const char **keys, int *st, int timeout_ms) {
  size_t *at = calloc(b->n, sizeof *at), m = 0; /* the items asked for, in order */
  const char **ask = calloc(b->n, sizeof *ask);
  fr_dir_object *recs = calloc(b->n, sizeof *recs);
  int *got = calloc(b->n, sizeof *got);
  int rc = at && ask && recs && got ? 0 : fr_err(FERRY_ENOMEM, "batch of %zu", b->n);
  for (size_t i = 0; rc == 0 && i < b->n; i++)
    if (!fr_dir_peek(s->dir, keys[i], &b->recs[i])) {
      ask[m] = keys[i];
      at[m++] = i;
    }
  if (rc == 0 && m > 0)
    rc = fr_dir_obj_get(s->dir, ask, m, recs, got, timeout_ms);
  for (size_t j = 0; rc == 0 && j < m; j++) {
    b->recs[at[j]] = recs[j];
    st[at[j]] = got[j];
  }
  free(at);
  free(ask);
  free(recs);
  free(got);
  return rc;
}

/* Looks every key up (the shared table, then one round trip) and marks the items that can be
 * read. */
static int batch_lookup(ferry_store *s, fr_batch *b, int timeout_ms) {
  const char **keys = calloc(b->n, sizeof *keys);
  int *st = calloc(b->n, sizeof *st);
  int rc = keys && st ? 0 : fr_err(FERRY_ENOMEM, "batch of %zu", b->n);
  for (size_t i = 0; rc == 0 && i < b->n; i++) {
    keys[i] = b->items[i].key;
    if ((rc = fr_dir_key_check(keys[i], "get")) != 0 || !b->items[i].dst)
      rc = rc ? rc : fr_err(FERRY_EINVAL, "get '%s': NULL dst", keys[i]);
  }
  if (rc == 0)
    rc = batch_ask(s, b, keys, st, timeout_ms);
  for (size_t i = 0; rc == 0 && i < b->n; i++) {
    ferry_store_item *it = &b->items[i];
    size_t room = SIZE_MAX;
    b->devices[i] = st[i] || !it->cap ? -1 : fr_store_device(it->dst, &room);
    it->bytes = 0;
    it->status = st[i] ? fr_err(FERRY_ENOTFOUND, "get '%s': no such key", it->key)
                       : check_fit(&b->recs[i], NULL, it->cap, room);
    if (it->status == 0)
      it->status = PENDING;
  }
  free(keys);
  free(st);
  return rc;
}

static int get_batch(ferry_store *s, ferry_store_item *items, size_t n, int timeout_ms);

int ferry_store_get_batch(ferry_store *s, ferry_store_item *items, size_t n, int timeout_ms) {
  uint64_t t0 = fr_now_ns();
  int rc = get_batch(s, items, n, timeout_ms);
  if (s && (items || n == 0)) {
    uint64_t bytes = 0;
    size_t ok = 0;
    for (size_t i = 0; i < n; i++)
      if (items[i].status == 0) {
        bytes += items[i].bytes;
        ok++;
      }
    fr_store_count(s, false, ok, n - ok, bytes, t0);
  }
  return rc;
}

static int get_batch(ferry_store *s, ferry_store_item *items, size_t n, int timeout_ms) {
  if (!s || (!items && n > 0))
    return fr_err(FERRY_EINVAL, "get_batch: NULL argument");
  if (n == 0)
    return 0;
  fr_batch b = {.s = s, .items = items, .n = n};
  b.deadline = fr_deadline_ns(fr_timeout(timeout_ms));
  b.recs = calloc(n, sizeof *b.recs);
  b.devices = calloc(n, sizeof *b.devices);
  int rc = b.recs && b.devices ? batch_lookup(s, &b, fr_store_left(b.deadline))
                               : fr_err(FERRY_ENOMEM, "batch of %zu", n);
  if (rc == 0)
    run_batch(&b);
  free(b.recs);
  free(b.devices);
  if (rc != 0)
    return rc;
  int first = 0;
  for (size_t i = 0; i < n; i++) { /* stale or moved: the single-key path retries */
    ferry_store_item *it = &items[i];
    if (it->status == FERRY_ESTALE || it->status == FERRY_EPEER) {
      ferry_store_info info = {.size = sizeof info};
      it->status =
          ferry_store_get(s, it->key, NULL, it->dst, it->cap, &info, fr_store_left(b.deadline));
      it->bytes = it->status == 0 ? info.bytes : 0;
    }
    if (it->status != 0 && first == 0) {
      first = it->status;
      fr_err(first, "get_batch: item %zu ('%s') failed: %s", i, it->key, ferry_strerror(first));
    }
  }
  return first;
}

/* ---- views: reading in place ---- */

struct ferry_store_view {
  ferry_store *s;
  fr_peer *peer;  /* the owner's link (a view of a peer's memory), or NULL */
  uint64_t *pins; /* the object's pin count, or NULL (a private copy) */
  const uint64_t *gen;
  uint64_t generation;
  void *copy; /* the private copy of an object across hosts */
};

/* Pins the object `rec` describes in this node's own pool. */
static int pin_local(ferry_store *s, const fr_dir_object *rec, ferry_store_view *v,
                     const void **data) {
  pthread_mutex_lock(&s->lock);
  size_t at;
  fr_owned *o = fr_store_find_owned(s, rec->key, &at);
  bool ok = o && o->rec.generation == rec->generation;
  if (ok && !owned_mapped(s, o)) {
    pthread_mutex_unlock(&s->lock);
    return freed(rec);
  }
  if (ok && o->on_device) { /* no view of device memory: the caller reads a copy */
    pthread_mutex_unlock(&s->lock);
    return FERRY_ENOTSUP;
  }
  if (ok) {
    v->pins = fr_store_pins(s, o->slot);
    v->gen = fr_store_gen(s, o->slot);
    __atomic_add_fetch(v->pins, 1, __ATOMIC_SEQ_CST); /* under the lock: retire cannot race */
    *data = o->data;
  }
  pthread_mutex_unlock(&s->lock);
  return ok ? 0 : stale(rec);
}

/* Pins the object in a same-host owner's pool: add a pin, then check the generation (the owner
 * zeroes the generation, then checks the pins; see fr_store_retire() in owned.c). */
static int pin_remote(ferry_store *s, const fr_dir_object *rec, ferry_store_view *v,
                      const void **data, int timeout_ms) {
  int rc = fr_peer_acquire(&s->peers, rec->owner, timeout_ms, &v->peer);
  if (rc != 0)
    return rc;
  const void *slot = NULL;
  rc = ferry_view(v->peer->link, &rec->gen_region, rec->gen_offset, FR_STORE_SLOT_BYTES, &slot);
  if (rc == 0 && rec->bytes > 0 &&
      (rc = ferry_view(v->peer->link, &rec->region, rec->offset, (size_t)rec->bytes, data)) != 0 &&
      freed_under(v->peer->link, rec, rc, timeout_ms))
    rc = FERRY_EFREED;
  if (rc == 0) {
    v->gen = slot;
    v->pins = (uint64_t *)((uintptr_t)slot + 8); /* the pool is mapped read-write */
    __atomic_add_fetch(v->pins, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(v->gen, __ATOMIC_SEQ_CST) == rec->generation)
      return 0;
    __atomic_sub_fetch(v->pins, 1, __ATOMIC_SEQ_CST);
    v->pins = NULL;
    rc = stale(rec);
  } else if (rc == FERRY_ENOTSUP) {
    fr_err_clear(); /* not on this host: the caller reads a copy */
  } else if (rc == FERRY_ENOTFOUND || rc == FERRY_ESTALE || rc == FERRY_ERANGE ||
             rc == FERRY_EACCES) {
    rc = stale(rec);
  }
  bool dead = rc == FERRY_EPEER || rc == FERRY_ECLOSED;
  fr_peer_release(&s->peers, v->peer, dead);
  v->peer = NULL;
  if (rc == FERRY_EFREED)
    return freed(rec);
  return dead ? fr_err_wrap(FERRY_EPEER, "view '%s': owner '%s' is gone", rec->key, rec->owner)
              : rc;
}

/* One attempt: pin in place, or read a private copy when the owner is on another host. */
static int view_once(ferry_store *s, const fr_dir_object *rec, ferry_store_view *v,
                     const void **data, int timeout_ms) {
  static const uint8_t empty[1];
  int rc = s->mem && strcmp(rec->owner, s->name) == 0 ? pin_local(s, rec, v, data)
                                                      : pin_remote(s, rec, v, data, timeout_ms);
  if (rc == 0)
    fr_store_receipt(s, rec->owner, rec->bytes); /* a copy (below) counts in read_object */
  if (rc != FERRY_ENOTSUP)
    return rc;
  if (!(v->copy = malloc(rec->bytes ? (size_t)rec->bytes : 1)))
    return fr_err(FERRY_ENOMEM, "view '%s': %llu bytes", rec->key, (unsigned long long)rec->bytes);
  if ((rc = read_object(s, rec, v->copy, -1, NULL, NULL, timeout_ms)) != 0) {
    free(v->copy);
    v->copy = NULL;
    return rc;
  }
  *data = rec->bytes ? v->copy : empty;
  return 0;
}

int ferry_store_get_view(ferry_store *s, const char *key, const void **data, ferry_store_info *info,
                         ferry_store_view **out, int timeout_ms) {
  if (!s || !data || !out)
    return fr_err(FERRY_EINVAL, "view: NULL argument");
  int rc = fr_dir_key_check(key, "view");
  if (rc != 0)
    return rc;
  ferry_store_view *v = calloc(1, sizeof *v);
  if (!v)
    return fr_err(FERRY_ENOMEM, "view '%s'", key);
  v->s = s;
  uint64_t deadline = fr_deadline_ns(fr_timeout(timeout_ms));
  fr_dir_object rec;
  const void *p = NULL;
  int stale_tries = 0, dead = 0;
  for (;;) {
    bool again = stale_tries + dead > 0;
    if ((rc = fr_store_lookup_again(s, key, &rec, fr_store_left(deadline), again)) != 0)
      break;
    rc = view_once(s, &rec, v, &p, fr_store_left(deadline));
    if (rc == FERRY_ESTALE || rc == FERRY_EPEER)
      fr_store_forget(s, key);
    if (rc == FERRY_ESTALE)
      stale_tries++;
    else if (rc != FERRY_EPEER || dead++ > 0)
      break;
    if (fr_ms_left(deadline) == 0)
      break;
    backoff(stale_tries);
  }
  if (rc != 0) {
    free(v);
    return rc;
  }
  if (rec.bytes == 0 && !v->copy)
    p = v; /* any valid pointer */
  v->generation = rec.generation;
  info_out(&rec, info);
  *data = p;
  *out = v;
  return 0;
}

int ferry_store_view_valid(const ferry_store_view *v) {
  if (!v)
    return fr_err(FERRY_EINVAL, "view_valid: NULL view");
  if (!v->pins)
    return 1; /* a private copy */
  return __atomic_load_n(v->gen, __ATOMIC_SEQ_CST) == v->generation ||
         __atomic_load_n(v->gen, __ATOMIC_SEQ_CST) == 0; /* replaced, still pinned */
}

void ferry_store_view_release(ferry_store_view *v) {
  if (!v)
    return;
  if (v->pins)
    __atomic_sub_fetch(v->pins, 1, __ATOMIC_SEQ_CST);
  if (v->peer)
    fr_peer_release(&v->s->peers, v->peer, false);
  free(v->copy);
  free(v);
}
