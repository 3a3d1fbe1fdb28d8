/*
 * The refit receiver: attaches to a sender (one call that returns the manifest and where the
 * sender's bucket buffers are), binds destinations, and runs a service thread that reads each
 * announced bucket (over shm one memcpy from the sender's buffer, over tcp one read), verifies
 * its checksum, puts each tensor's part where it is bound, and commits a version only when every
 * bucket of it verified.
 */
#include "refit/refit.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ferry_refit_receiver {
  ferry_ctx *ctx;
  ferry_link *link;
  fr_refit_plan plan;
  ferry_region_ref buf[2];
  void **bound;                  /* per tensor: the caller's destination, or NULL */
  ferry_tensor_desc *bound_desc; /* and how the caller described it */
  uint8_t *flat;                 /* ferry_alloc'd flat buffer, or NULL */
  uint8_t *stage;
  ferry_refit_bucket_fn on_bucket;
  void *on_bucket_arg;

  pthread_mutex_t bind_lock; /* bound, flat: held by the service thread while a bucket lands */
  pthread_mutex_t lock;      /* the versions below */
  pthread_cond_t cond;
  uint64_t committed, latest_known;
  uint64_t receiving; /* version whose buckets are arriving */
  uint32_t verified;
  int failure;
  char why[256]; /* what the last failed version went wrong on, for wait()'s error */
  bool stop;
  pthread_t service;
};

static ferry_ctx *receiver_ctxs[64];
static pthread_mutex_t receiver_ctxs_lock = PTHREAD_MUTEX_INITIALIZER;

static int claim_ctx(ferry_ctx *ctx, bool claim) {
  pthread_mutex_lock(&receiver_ctxs_lock);
  int slot = -1, rc = 0;
  for (int i = 0; i < 64; i++) {
    if (receiver_ctxs[i] == ctx) {
      rc = claim ? fr_err(FERRY_EBUSY, "this context already has a refit receiver") : 0;
      if (!claim)
        receiver_ctxs[i] = NULL;
      pthread_mutex_unlock(&receiver_ctxs_lock);
      return rc;
    }
    if (!receiver_ctxs[i] && slot < 0)
      slot = i;
  }
  if (claim && slot < 0)
    rc = fr_err(FERRY_EBUSY, "too many refit receivers in this process");
  else if (claim)
    receiver_ctxs[slot] = ctx;
  pthread_mutex_unlock(&receiver_ctxs_lock);
  return rc;
}

/* ---- receiving a push (service thread) ---- */

static int fetch_manifest(ferry_refit_receiver *r, int timeout_ms, fr_refit_plan *plan);
static int binding_fits(const fr_refit_entry *e, const ferry_tensor_desc *desc);

/* The sender re-sealed: take its new manifest, carry every binding that still fits over by
 * name, and fail (naming the tensor) for one that does not; that tensor stays unbound until the
 * engine binds it again. A flat buffer is laid out anew (views move: fetch them again). */
static int refetch_manifest(ferry_refit_receiver *r) {
  fr_refit_plan plan;
  int rc = fetch_manifest(r, -1, &plan);
  if (rc != 0)
    return rc;
  size_t n = plan.count ? plan.count : 1;
  void **bound = calloc(n, sizeof *bound);
  ferry_tensor_desc *descs = calloc(n, sizeof *descs);
  uint8_t *stage = malloc(plan.bucket_bytes);
  if (!bound || !descs || !stage) {
    free(bound), free(descs), free(stage);
    fr_refit_plan_free(&plan);
    return fr_err(FERRY_ENOMEM, "refit: new manifest");
  }
  for (uint32_t i = 0; i < r->plan.count; i++) {
    int64_t j = r->bound[i] ? fr_refit_plan_find(&plan, r->plan.entries[i].name) : -1;
    int fit = j < 0 ? 0 : binding_fits(&plan.entries[j], &r->bound_desc[i]);
    if (j >= 0 && fit == 0) {
      bound[j] = r->bound[i];
      descs[j] = r->bound_desc[i];
    } else if (fit != 0 && rc == 0) {
      rc = fit;
    }
  }
  if (r->flat) {
    ferry_free(r->ctx, r->flat);
    r->flat = NULL;
    if (ferry_alloc(r->ctx, plan.total_bytes, (void **)&r->flat) != 0 && rc == 0)
      rc = fr_err(FERRY_ENOSHM, "refit: no flat buffer for the new manifest");
  }
  free(r->bound), free(r->bound_desc), free(r->stage);
  fr_refit_plan_free(&r->plan);
  r->plan = plan;
  r->bound = bound;
  r->bound_desc = descs;
  r->stage = stage;
  fr_info("refit: manifest generation %u from '%s' (%u tensors)", plan.generation,
          ferry_link_peer(r->link), plan.count);
  return rc;
}

#define FR_REFIT_CHUNK (256u * 1024u)

/* Puts [lo, lo+len) of bucket b, held at src, where its tensors are bound. */
static void scatter(ferry_refit_receiver *r, uint32_t b, uint64_t lo, uint64_t len,
                    const uint8_t *src) {
  const fr_refit_plan *p = &r->plan;
  uint64_t start = (uint64_t)b * p->bucket_bytes + lo;
  for (uint32_t e = fr_refit_first_entry(p, b); e < p->count; e++) {
    uint64_t wire_off, src_off, n = fr_refit_overlap_window(p, e, start, len, &wire_off, &src_off);
    if (n == 0) {
      if (p->entries[e].offset >= start + len)
        break;
      continue;
    }
    if (r->bound[e])
      memcpy((uint8_t *)r->bound[e] + wire_off, src + src_off, n);
  }
}

/* Reads a bucket in chunks (on shm each one memcpy), hashing and scattering each chunk while it
 * is in cache; over other links one read, since every read there is a round trip. */
static int read_bucket(ferry_refit_receiver *r, const fr_refit_msg_t *m, uint64_t *sum) {
  uint8_t *dst = r->flat ? r->flat + (uint64_t)m->bucket * r->plan.bucket_bytes : r->stage;
  uint64_t chunk = strcmp(ferry_link_transport(r->link), "shm") == 0 ? FR_REFIT_CHUNK : m->bytes;
  fr_hash *h = fr_hash_begin();
  int rc = 0;
  for (uint64_t lo = 0; lo < m->bytes && rc == 0; lo += chunk) {
    uint64_t n = m->bytes - lo < chunk ? m->bytes - lo : chunk;
    uint8_t *at = r->flat ? dst + lo : dst;
    rc = ferry_read(r->link, &r->buf[m->buffer], lo, at, n, -1);
    if (rc == 0) {
      fr_hash_update(h, at, n);
      if (!r->flat)
        scatter(r, m->bucket, lo, n, at);
    }
  }
  *sum = fr_hash_end(h);
  return rc;
}

static int take_bucket(ferry_refit_receiver *r, const fr_refit_msg_t *m) {
  if (m->generation != r->plan.generation) {
    int rc = refetch_manifest(r);
    if (rc != 0)
      return rc;
    if (m->generation != r->plan.generation)
      return fr_err(FERRY_EPROTO, "refit: bucket of manifest generation %u, the sender has %u",
                    m->generation, r->plan.generation);
  }
  if (m->bucket >= r->plan.buckets || m->bytes != fr_refit_bucket_len(&r->plan, m->bucket))
    return fr_err(FERRY_EPROTO, "refit: bucket %u of %llu bytes is not in the plan", m->bucket,
                  (unsigned long long)m->bytes);
  if (m->flags & FR_REFIT_UNCHANGED)
    return 0;
  uint64_t sum = 0;
  int rc = read_bucket(r, m, &sum);
  if (rc != 0)
    return rc;
  if (sum != m->checksum)
    return fr_err(FERRY_ECHECKSUM, "refit: bucket %u of version %llu does not match its checksum",
                  m->bucket, (unsigned long long)m->version);
  return 0;
}

static void on_bucket(ferry_refit_receiver *r, const fr_refit_msg_t *m) {
  if (m->version != r->receiving) {
    r->receiving = m->version;
    r->verified = 0;
    r->failure = 0;
  }
  pthread_mutex_lock(&r->bind_lock);
  int rc = r->failure ? r->failure : take_bucket(r, m);
  pthread_mutex_unlock(&r->bind_lock);
  if (rc != 0 && !r->failure) {
    fr_warn("%s", ferry_last_error());
    r->failure = rc;
    pthread_mutex_lock(&r->lock);
    snprintf(r->why, sizeof r->why, "%s", ferry_last_error());
    pthread_mutex_unlock(&r->lock);
  }
  if (rc == 0) {
    r->verified++;
    if (r->on_bucket && !(m->flags & FR_REFIT_UNCHANGED))
      r->on_bucket(r, m->version, m->bucket, r->on_bucket_arg);
  }
  fr_refit_msg_t ack = {
      .type = FR_REFIT_ACK, .version = m->version, .bucket = m->bucket, .status = rc};
  fr_refit_send(r->link, &ack, -1);
}

static void on_commit(ferry_refit_receiver *r, const fr_refit_msg_t *m) {
  int status = m->version != r->receiving && m->bytes > 0 ? FERRY_EPROTO
               : r->failure                               ? r->failure
               : r->verified != m->bytes                  ? FERRY_EPROTO
                                                          : 0;
  pthread_mutex_lock(&r->lock);
  if (status == 0)
    r->committed = m->version;
  if (m->version > r->latest_known)
    r->latest_known = m->version;
  pthread_cond_broadcast(&r->cond);
  pthread_mutex_unlock(&r->lock);
  if (status != 0)
    fr_warn("refit: version %llu not committed (%s); keeping %llu", (unsigned long long)m->version,
            ferry_strerror(status), (unsigned long long)r->committed);
  r->receiving = 0;
  fr_refit_msg_t done = {.type = FR_REFIT_COMMITTED, .version = m->version, .status = status};
  fr_refit_send(r->link, &done, -1);
}

static void *service_main(void *arg) {
  ferry_refit_receiver *r = arg;
  while (!__atomic_load_n(&r->stop, __ATOMIC_ACQUIRE)) {
    ferry_msg *msg;
    int rc = ferry_recv(r->ctx, FR_CHANNEL_REFIT, &msg, 100);
    if (rc == FERRY_ECLOSED)
      return NULL;
    if (rc != 0)
      continue;
    fr_refit_msg_t m;
    if (msg->link != r->link || fr_refit_msg_decode(msg->data, msg->len, &m) != 0)
      fr_warn("refit: dropped a message that is not from our sender or is malformed");
    else if (m.type == FR_REFIT_BUCKET)
      on_bucket(r, &m);
    else if (m.type == FR_REFIT_COMMIT)
      on_commit(r, &m);
    ferry_msg_free(msg);
  }
  return NULL;
}

/* ---- attach ---- */

/* Asks the sender for its manifest, bucket buffers and latest version. */
static int fetch_manifest(ferry_refit_receiver *r, int timeout_ms, fr_refit_plan *plan) {
  uint8_t type[4] = {FR_REFIT_ATTACH, 0, 0, 0};
  struct iovec iov = {type, sizeof type};
  ferry_msg *reply;
  int rc = ferry_call(r->link, FR_CHANNEL_REFIT, &iov, 1, &reply, timeout_ms);
  if (rc != 0)
    return fr_err(rc, "refit: attach to '%s': %s", ferry_link_peer(r->link), ferry_last_error());
  fr_refit_attach_reply a;
  rc = fr_refit_attach_decode(reply->data, reply->len, &a);
  if (rc == 0 && a.status != 0)
    rc = fr_err(a.status, "refit: the sender '%s' refused (%s)", ferry_link_peer(r->link),
                a.status == FERRY_ESTATE ? "not sealed yet" : ferry_strerror(a.status));
  if (rc == 0)
    rc = fr_refit_manifest_decode(a.manifest, a.manifest_len, plan);
  if (rc == 0) {
    memcpy(r->buf, a.buffers, sizeof r->buf);
    if (a.latest > r->latest_known)
      r->latest_known = a.latest;
  }
  ferry_msg_free(reply);
  return rc;
}

/* Checks that a binding fits its tensor; the error names the tensor. */
static int binding_fits(const fr_refit_entry *e, const ferry_tensor_desc *desc) {
  char got[96], want[96];
  ferry_tensor_desc w = e->desc;
  w.dtype = e->wire;
  if (desc->dtype != e->wire)
    return fr_err(FERRY_EDTYPE, "refit: tensor '%s' arrives as %s, bound as %s", e->name,
                  ferry_dtype_name(e->wire), ferry_dtype_name(desc->dtype) ?: "?");
  if (desc->ndim != w.ndim || memcmp(desc->shape, w.shape, sizeof(uint64_t) * w.ndim) != 0)
    return fr_err(FERRY_ESHAPE, "refit: tensor '%s' arrives as %s, bound as %s", e->name,
                  ferry_shape_format(&w, want, sizeof want),
                  ferry_shape_format(desc, got, sizeof got));
  return 0;
}

static int attach(ferry_refit_receiver *r, const char *address, int timeout_ms) {
  int rc = ferry_connect(r->ctx, address, timeout_ms, &r->link);
  if (rc == 0)
    rc = fetch_manifest(r, timeout_ms, &r->plan);
  if (rc == 0) {
    size_t n = r->plan.count ? r->plan.count : 1;
    r->bound = calloc(n, sizeof *r->bound);
    r->bound_desc = calloc(n, sizeof *r->bound_desc);
    r->stage = malloc(r->plan.bucket_bytes);
    if (!r->bound || !r->bound_desc || !r->stage)
      rc = fr_err(FERRY_ENOMEM, "refit: receiver buffers");
  }
  return rc;
}

static void receiver_free(ferry_refit_receiver *r) {
  ferry_link_close(r->link);
  if (r->flat)
    ferry_free(r->ctx, r->flat);
  fr_refit_plan_free(&r->plan);
  free(r->bound);
  free(r->bound_desc);
  free(r->stage);
  pthread_mutex_destroy(&r->lock);
  pthread_mutex_destroy(&r->bind_lock);
  pthread_cond_destroy(&r->cond);
  claim_ctx(r->ctx, false);
  free(r);
}

int ferry_refit_receiver_open(ferry_ctx *ctx, const char *address, int timeout_ms,
                              ferry_refit_receiver **out) {
  if (!ctx || !address || !out)
    return fr_err(FERRY_EINVAL, "ferry_refit_receiver_open: NULL argument");
  int rc = claim_ctx(ctx, true);
  if (rc != 0)
    return rc;
  ferry_refit_receiver *r = calloc(1, sizeof *r);
  if (!r) {
    claim_ctx(ctx, false);
    return fr_err(FERRY_ENOMEM, "refit receiver");
  }
  r->ctx = ctx;
  pthread_mutex_init(&r->lock, NULL);
  pthread_mutex_init(&r->bind_lock, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&r->cond, &ca);
  pthread_condattr_destroy(&ca);
  rc = attach(r, address, fr_timeout(timeout_ms));
  if (rc == 0 && pthread_create(&r->service, NULL, service_main, r) != 0)
    rc = fr_err(FERRY_ESYS, "refit receiver: cannot start its thread");
  if (rc != 0) {
    char detail[512];
    snprintf(detail, sizeof detail, "%s", ferry_last_error());
    receiver_free(r);
    return fr_err(rc, "%s", detail);
  }
  *out = r;
  return 0;
}

void ferry_refit_receiver_close(ferry_refit_receiver *r) {
  if (!r)
    return;
  fr_refit_msg_t bye = {.type = FR_REFIT_DETACH};
  fr_refit_send(r->link, &bye, 1000);
  __atomic_store_n(&r->stop, true, __ATOMIC_RELEASE);
  pthread_join(r->service, NULL);
  receiver_free(r);
}

/* ---- the manifest and bindings ---- */

size_t ferry_refit_tensor_count(ferry_refit_receiver *r) { return r ? r->plan.count : 0; }

int ferry_refit_tensor_info(ferry_refit_receiver *r, size_t i, const char **name,
                            ferry_tensor_desc *desc) {
  if (!r)
    return fr_err(FERRY_EINVAL, "ferry_refit_tensor_info: NULL receiver");
  pthread_mutex_lock(&r->bind_lock);
  int rc = i < r->plan.count ? 0 : fr_err(FERRY_ENOTFOUND, "refit: no tensor %zu", i);
  if (rc == 0 && name)
    *name = r->plan.entries[i].name;
  if (rc == 0 && desc) {
    *desc = r->plan.entries[i].desc;
    desc->dtype = r->plan.entries[i].wire;
  }
  pthread_mutex_unlock(&r->bind_lock);
  return rc;
}

static int find(ferry_refit_receiver *r, const char *name, uint32_t *out) {
  int64_t i = r && name ? fr_refit_plan_find(&r->plan, name) : -1;
  if (i < 0)
    return fr_err(FERRY_ENOTFOUND, "refit: the sender sends no tensor '%s'", name ? name : "");
  *out = (uint32_t)i;
  return 0;
}

int ferry_refit_bind(ferry_refit_receiver *r, const char *name, void *dst,
                     const ferry_tensor_desc *desc) {
  if (!r || !dst || !desc)
    return fr_err(FERRY_EINVAL, "ferry_refit_bind: NULL argument");
  uint32_t i = 0;
  pthread_mutex_lock(&r->bind_lock); /* the service thread may swap in a new manifest */
  int rc = find(r, name, &i);
  if (rc == 0)
    rc = binding_fits(&r->plan.entries[i], desc);
  if (rc == 0) {
    r->bound[i] = dst;
    r->bound_desc[i] = *desc;
  }
  pthread_mutex_unlock(&r->bind_lock);
  return rc;
}

int ferry_refit_bind_flat(ferry_refit_receiver *r) {
  if (!r)
    return fr_err(FERRY_EINVAL, "ferry_refit_bind_flat: NULL receiver");
  if (r->plan.total_bytes == 0)
    return fr_err(FERRY_ESTATE, "refit: the manifest is empty");
  pthread_mutex_lock(&r->bind_lock);
  void *flat = r->flat;
  int rc = flat ? 0 : ferry_alloc(r->ctx, r->plan.total_bytes, &flat);
  if (rc == 0)
    r->flat = flat;
  pthread_mutex_unlock(&r->bind_lock);
  return rc;
}

int ferry_refit_view(ferry_refit_receiver *r, const char *name, void **out) {
  uint32_t i = 0;
  pthread_mutex_lock(&r->bind_lock);
  int rc = find(r, name, &i);
  if (rc == 0 && !r->flat)
    rc = fr_err(FERRY_ESTATE, "refit: views need ferry_refit_bind_flat() first");
  if (rc == 0)
    *out = r->flat + r->plan.entries[i].offset;
  pthread_mutex_unlock(&r->bind_lock);
  return rc;
}

void ferry_refit_on_bucket(ferry_refit_receiver *r, ferry_refit_bucket_fn fn, void *arg) {
  if (!r)
    return;
  r->on_bucket = fn;
  r->on_bucket_arg = arg;
}

/* ---- versions ---- */

uint64_t ferry_refit_committed(ferry_refit_receiver *r) {
  if (!r)
    return 0;
  pthread_mutex_lock(&r->lock);
  uint64_t v = r->committed;
  pthread_mutex_unlock(&r->lock);
  return v;
}

int ferry_refit_wait(ferry_refit_receiver *r, uint64_t version, int timeout_ms,
                     uint64_t *committed) {
  if (!r)
    return fr_err(FERRY_EINVAL, "ferry_refit_wait: NULL receiver");
  uint64_t deadline = fr_deadline_ns(fr_timeout(timeout_ms));
  struct timespec ts = {(time_t)(deadline / 1000000000ull), (long)(deadline % 1000000000ull)};
  pthread_mutex_lock(&r->lock);
  uint64_t target = version ? version : (r->latest_known ? r->latest_known : 1);
  while (r->committed < target)
    if (pthread_cond_timedwait(&r->cond, &r->lock, &ts) != 0)
      break;
  uint64_t now = r->committed;
  char why[sizeof r->why];
  snprintf(why, sizeof why, "%s", r->why);
  pthread_mutex_unlock(&r->lock);
  if (committed)
    *committed = now;
  if (now < target)
    return fr_err(FERRY_ETIMEDOUT, "refit: version %llu not committed in time (have %llu)%s%s",
                  (unsigned long long)target, (unsigned long long)now,
                  *why ? "; last failure: " : "", why);
  return 0;
}
