/*
 * The refit receiver reading a push, on its service thread: each BUCKET announcement is read
 * from where it says (the sender's buffer or the chain predecessor's forwarding slot; in chunks
 * over shm, one read elsewhere, only the view's runs for a shard reader, straight into bound
 * CUDA memory for a direct bucket), verified against its checksum, placed where it is bound,
 * kept for a successor when asked, and acknowledged; COMMIT commits the version when every
 * bucket of it verified (over all its parts, for a version sent in parts: the buckets verified
 * count up while the version stays the one arriving) and nothing was bound mid-way, and one
 * flagged ABORTED fails it; ROUTE, DROPPED and a refused catch-up are
 * handled here too, as is a new manifest taken when the sender re-sealed. Each bucket's time is
 * counted (waiting for it, taking it, acknowledging it: receiver_impl.h's phases). Shared with
 * the receiver's other files through receiver_impl.h.
 */
#include "refit/group_rx.h"
#include "refit/receiver_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void tell_commit(ferry_refit_receiver *r, uint64_t version, int status);

/* The sender re-sealed: take its new manifest, carry every binding that still fits over by
 * name, and fail (naming the tensor) for one that does not; that tensor stays unbound until the
 * engine binds it again. A flat buffer is laid out anew (views move: fetch them again). */
static int install_manifest(ferry_refit_receiver *r, fr_refit_plan plan) {
  int rc = 0;
  size_t n = plan.count ? plan.count : 1;
  void **bound = calloc(n, sizeof *bound);
  ferry_tensor_desc *descs = calloc(n, sizeof *descs);
  int *devs = calloc(n, sizeof *devs);
  uint8_t *stage = fr_refit_rx_stage_alloc(plan.bucket_bytes);
  uint32_t dev_bound = 0;
  if (!bound || !descs || !devs || !stage) {
    free(bound), free(descs), free(devs), free(stage);
    fr_refit_plan_free(&plan);
    return fr_err(FERRY_ENOMEM, "refit: new manifest");
  }
  for (uint32_t i = 0; i < r->plan.count; i++) {
    int64_t j = r->bound[i] ? fr_refit_plan_find(&plan, r->plan.entries[i].name) : -1;
    int fit = j < 0 ? 0 : fr_refit_rx_binding_fits(&plan.entries[j], &r->bound_desc[i]);
    if (j >= 0 && fit == 0) {
      bound[j] = r->bound[i];
      descs[j] = r->bound_desc[i];
      devs[j] = r->bound_dev[i];
      dev_bound += devs[j] >= 0;
    } else if (fit != 0 && rc == 0) {
      rc = fit;
    }
  }
  if (r->flat) {
    r->bind_epoch++;              /* a new buffer: it holds none of the buckets a push may skip */
    pthread_mutex_lock(&r->lock); /* the flat buffer starts empty: no version is in it */
    r->torn_by = r->torn_by ? r->torn_by : r->committed + 1;
    pthread_mutex_unlock(&r->lock);
    ferry_free(r->ctx, r->flat);
    r->flat = NULL;
    if (ferry_alloc(r->ctx, plan.total_bytes, (void **)&r->flat) != 0 && rc == 0)
      rc = fr_err(FERRY_ENOSHM, "refit: no flat buffer for the new manifest");
  }
  uint8_t *got = calloc(plan.buckets ? plan.buckets : 1, 1);
  if (!got) {
    free(bound), free(descs), free(devs), free(stage);
    fr_refit_plan_free(&plan);
    return fr_err(FERRY_ENOMEM, "refit: new manifest");
  }
  if (r->alias && fr_refit_rx_alias_map(r) != 0 && rc == 0)
    rc = fr_err_wrap(FERRY_ENOTSUP, "refit: cannot map the sender's new buffer");
  if (r->fwd && plan.bucket_bytes != r->plan.bucket_bytes) {
    ferry_free(r->ctx, r->fwd);
    r->fwd = NULL; /* allocated again, at the new size, when a successor needs it */
  }
  free(r->bound), free(r->bound_desc), free(r->bound_dev), free(r->got);
  fr_refit_rx_stage_free(r->stage, r->stage_pin);
  fr_refit_plan_free(&r->plan);
  r->got = got;
  r->plan = plan;
  r->bound = bound;
  r->bound_desc = descs;
  r->bound_dev = devs;
  r->dev_bound = dev_bound;
  r->stage = stage;
  r->stage_pin = -1;
  bool device_targets = false;
  for (uint32_t i = 0; i < r->ntargets; i++)
    device_targets |= r->targets[i].name && r->targets[i].device >= 0;
  if (dev_bound || device_targets)
    fr_refit_rx_pin_stage(r);
  fr_info("refit: manifest generation %u from '%s' (%u tensors)", plan.generation,
          ferry_link_peer(r->link), plan.count);
  int moved = r->shards ? fr_refit_rx_retarget(r) : 0;
  if (r->of) /* a group's: its timer redoes the global manifest and the parts */
    fr_group_rx_resealed(r->of, r);
  return rc ? rc : moved;
}

static int refetch_manifest(ferry_refit_receiver *r) {
  fr_refit_plan plan;
  int rc = fr_refit_rx_fetch_manifest(r, -1, &plan);
  return rc != 0 ? rc : install_manifest(r, plan);
}

/* Puts [lo, lo+len) of bucket b, held at src (host memory, hashed), where its tensors are
 * bound: a memcpy, or a host→device copy. */
static int scatter(ferry_refit_receiver *r, uint32_t b, uint64_t lo, uint64_t len,
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
    uint8_t *to = r->bound[e] ? (uint8_t *)r->bound[e] + wire_off : NULL;
    int dev = to ? r->bound_dev[e] : -1, rc = 0;
    if (to && dev < 0)
      memcpy(to, src + src_off, n);
    else if (to && (rc = fr_cuda_copy_on(dev, to, src + src_off, n)) != 0)
      return fr_err_wrap(rc, "refit: tensor '%s' into CUDA device %d", p->entries[e].name, dev);
  }
  return 0;
}

/* The link to read a bucket from: the sender's, or the predecessor's (connected again if it
 * dropped). */
static int source_link(ferry_refit_receiver *r, const fr_refit_msg_t *m, ferry_link **out) {
  if (!(m->flags & FR_REFIT_FROM_UP)) {
    *out = r->link;
    return 0;
  }
  if (r->up && ferry_link_status(r->up) != 0) {
    ferry_link_close(r->up);
    r->up = NULL;
  }
  if (!r->up && r->up_address && ferry_connect(r->ctx, r->up_address, -1, &r->up) != 0)
    return fr_err_wrap(FERRY_EPEER, "refit: cannot reach the chain predecessor at '%s'",
                       r->up_address);
  if (!r->up)
    return fr_err(FERRY_EPROTO, "refit: told to read from a predecessor, but given none");
  *out = r->up;
  return 0;
}

/* Where bucket m lands: its place in the flat buffer, a forwarding slot when a successor will
 * read it from here (whole), or the stage that one chunk at a time passes through. */
static int landing(ferry_refit_receiver *r, const fr_refit_msg_t *m, uint8_t **out, bool *whole) {
  uint64_t bb = r->plan.bucket_bytes;
  *whole = true;
  if (r->flat) {
    *out = r->flat + (uint64_t)m->bucket * bb;
    return 0;
  }
  if (m->flags & FR_REFIT_KEEP) {
    if (!r->fwd && ferry_alloc(r->ctx, 2 * bb, (void **)&r->fwd) != 0)
      return fr_err_wrap(FERRY_ENOSHM, "refit: no forwarding buffer");
    *out = r->fwd + m->buffer * bb;
    return 0;
  }
  *whole = false;
  *out = r->stage;
  return 0;
}

/* Reads a bucket in chunks (on shm each one memcpy), hashing and scattering each chunk while it
 * is in cache; over other links one read, since every read there is a round trip. */
static int read_bucket(ferry_refit_receiver *r, const fr_refit_msg_t *m, uint8_t *land, bool whole,
                       uint64_t *sum) {
  ferry_link *from = NULL;
  int rc = source_link(r, m, &from);
  if (rc != 0)
    return rc;
  bool scatter_it = !r->flat && !r->alias;
  /* a device destination takes its part of a bucket in one copy: the bucket is read whole */
  bool chunked = strcmp(ferry_link_transport(from), "shm") == 0 && !(scatter_it && r->dev_bound);
  uint64_t chunk = chunked ? FR_REFIT_CHUNK : m->bytes;
  fr_hash *h = fr_hash_begin();
  for (uint64_t lo = 0; lo < m->bytes && rc == 0; lo += chunk) {
    uint64_t n = m->bytes - lo < chunk ? m->bytes - lo : chunk;
    uint8_t *at = whole ? land + lo : land;
    rc = ferry_read(from, &m->src, m->src_offset + lo, at, n,
                    m->timeout_ms ? (int)m->timeout_ms : -1);
    if (rc == 0) {
      __atomic_add_fetch(&r->bytes_read, n, __ATOMIC_RELAXED);
      fr_hash_update(h, at, n);
      if (scatter_it)
        rc = scatter(r, m->bucket, lo, n, at);
    }
  }
  *sum = fr_hash_end(h);
  if (rc == 0 && from == r->up)
    __atomic_add_fetch(&fr_refit_stat_forwarded, 1, __ATOMIC_RELAXED);
  return rc;
}

/* The bound bytes stop being the committed version: version's bytes begin landing (or, in alias
 * mode, the sender began writing them in place). */
static void tear(ferry_refit_receiver *r, uint64_t version) {
  pthread_mutex_lock(&r->lock);
  if (!r->torn_by)
    r->torn_by = version;
  pthread_mutex_unlock(&r->lock);
}

/* Runs read at a time over a link that is not shm: one ferry_readv (its requests all in flight),
 * into the stage, then hashed and copied out while in cache. */
#define RUNS_PER_READV 4096u

/* Over shm: each run straight into its destination, one memcpy each, from a view of the
 * source's pages (checked afterwards, as ferry_read does, for a source freed meanwhile); one
 * ferry_read per run when the source cannot be viewed (memory registered, not ferry_alloc'd). */
static int read_runs_direct(ferry_refit_receiver *r, ferry_link *from, const fr_refit_msg_t *m,
                            fr_hash *h) {
  uint64_t start = (uint64_t)m->bucket * r->plan.bucket_bytes;
  const fr_refit_view *v = r->view;
  const uint8_t *src = NULL;
  int rc = 0;
  bool viewed = ferry_view(from, &m->src, m->src_offset, m->bytes, (const void **)&src) == 0;
  for (uint64_t i = v->first[m->bucket]; i < v->first[m->bucket + 1] && rc == 0; i++) {
    const fr_refit_run *run = &v->runs[i];
    if (viewed)
      memcpy(run->dst, src + (run->off - start), run->len);
    else
      rc = ferry_read(from, &m->src, m->src_offset + (run->off - start), run->dst, run->len,
                      m->timeout_ms ? (int)m->timeout_ms : -1);
    if (rc == 0) {
      __atomic_add_fetch(&r->bytes_read, run->len, __ATOMIC_RELAXED);
      fr_hash_update(h, run->dst, run->len);
    }
  }
  if (rc == 0 && viewed && (rc = ferry_view_valid(from, &m->src)) != 0)
    rc = fr_err(rc, "refit: the bucket's source at '%s' went away during the copy",
                ferry_link_peer(from));
  return rc;
}

/* Elsewhere: the runs gathered into as few requests as the transport allows (ferry_readv), a
 * stage's worth at a time. */
static int read_runs_gathered(ferry_refit_receiver *r, ferry_link *from, const fr_refit_msg_t *m,
                              fr_hash *h) {
  uint64_t start = (uint64_t)m->bucket * r->plan.bucket_bytes;
  const fr_refit_view *v = r->view;
  ferry_read_run *batch = malloc(RUNS_PER_READV * sizeof *batch);
  int rc = batch ? 0 : fr_err(FERRY_ENOMEM, "refit: shard reads");
  for (uint64_t i = v->first[m->bucket], end = v->first[m->bucket + 1]; i < end && rc == 0;) {
    size_t k = 0;
    uint64_t bytes = 0;
    for (; i + k < end && k < RUNS_PER_READV && bytes + v->runs[i + k].len <= r->plan.bucket_bytes;
         k++) {
      batch[k] = (ferry_read_run){m->src_offset + (v->runs[i + k].off - start), v->runs[i + k].len};
      bytes += v->runs[i + k].len;
    }
    rc = ferry_readv(from, &m->src, batch, k, r->stage, m->timeout_ms ? (int)m->timeout_ms : -1);
    const uint8_t *at = r->stage;
    rx_copy c = {0};
    for (size_t j = 0; j < k && rc == 0; at += v->runs[i + j++].len) {
      fr_hash_update(h, at, v->runs[i + j].len);
      rc = fr_refit_rx_put_run(r, &c, v->runs[i + j].dst, at, v->runs[i + j].len);
    }
    if (rc == 0)
      rc = fr_refit_rx_copy_done(&c); /* before the next batch overwrites the stage */
    if (rc == 0)
      __atomic_add_fetch(&r->bytes_read, bytes, __ATOMIC_RELAXED);
    i += k;
  }
  free(batch);
  return rc;
}

/* A shard reader's bucket announced with its view: only the view's runs are read, and their sum
 * is checked. */
static int read_runs(ferry_refit_receiver *r, const fr_refit_msg_t *m) {
  ferry_link *from = NULL;
  int rc = source_link(r, m, &from);
  if (rc != 0)
    return rc;
  fr_hash *h = fr_hash_begin();
  /* device targets are never read by the CPU: their runs go through the stage, hashed there */
  rc = strcmp(ferry_link_transport(from), "shm") == 0 && !r->ndev_ranges
           ? read_runs_direct(r, from, m, h)
           : read_runs_gathered(r, from, m, h);
  uint64_t sum = fr_hash_end(h);
  if (rc == 0 && sum != m->view_sum)
    rc = fr_err(FERRY_ECHECKSUM,
                "refit: the slices read from bucket %u of version %llu do not match their "
                "checksum",
                m->bucket, (unsigned long long)m->version);
  return rc;
}

/* A shard reader's bucket announced without its current view (it bound more since the sender
 * began this push, or the sender has not taken its declarations): the whole bucket is read and
 * verified, then its runs are copied out. */
static int read_whole_for_runs(ferry_refit_receiver *r, const fr_refit_msg_t *m, uint8_t **at) {
  bool whole;
  uint64_t sum = 0;
  int rc = landing(r, m, at, &whole);
  if (rc == 0)
    rc = read_bucket(r, m, *at, true, &sum); /* the stage holds a whole bucket */
  if (rc == 0 && sum != m->checksum)
    rc = fr_err(FERRY_ECHECKSUM, "refit: bucket %u of version %llu does not match its checksum",
                m->bucket, (unsigned long long)m->version);
  uint64_t start = (uint64_t)m->bucket * r->plan.bucket_bytes;
  const fr_refit_view *v = r->view;
  rx_copy c = {0};
  for (uint64_t i = v->first[m->bucket]; rc == 0 && i < v->first[m->bucket + 1]; i++)
    rc = fr_refit_rx_put_run(r, &c, v->runs[i].dst, *at + (v->runs[i].off - start), v->runs[i].len);
  return rc ? rc : fr_refit_rx_copy_done(&c);
}

static int fetch_shards(ferry_refit_receiver *r, const fr_refit_msg_t *m, ferry_region_ref *kept,
                        uint64_t *kept_off) {
  int rc = fr_refit_rx_ensure_view(r);
  if (rc != 0)
    return rc;
  bool keep = m->flags & FR_REFIT_KEEP;
  if (m->view && m->view == r->view->serial && !keep)
    return read_runs(r, m);
  uint8_t *at = NULL;
  rc = read_whole_for_runs(r, m, &at);
  if (rc == 0 && keep)
    rc = ferry_region_find(r->ctx, at, m->bytes, kept, kept_off);
  return rc;
}

/* A FR_REFIT_DIRECT bucket: the sender's CUDA memory on this host, not hashed. Each bound
 * tensor's part is read straight into it (ferry_read over shm: the copy engines, from the IPC
 * mapping, device to device or into host memory); a flat buffer takes the bucket whole. */
static int read_direct(ferry_refit_receiver *r, const fr_refit_msg_t *m) {
  if (strcmp(ferry_link_transport(r->link), "shm") != 0 || (m->flags & FR_REFIT_FROM_UP))
    return fr_err(FERRY_EPROTO, "refit: an unhashed bucket offered over %s: refused",
                  ferry_link_transport(r->link));
  int ms = m->timeout_ms ? (int)m->timeout_ms : -1;
  if (r->flat)
    return ferry_read(r->link, &m->src, m->src_offset,
                      r->flat + (uint64_t)m->bucket * r->plan.bucket_bytes, m->bytes, ms);
  const fr_refit_plan *p = &r->plan;
  uint64_t start = (uint64_t)m->bucket * p->bucket_bytes;
  int rc = 0;
  for (uint32_t e = fr_refit_first_entry(p, m->bucket); e < p->count && rc == 0; e++) {
    uint64_t wire_off, src_off,
        n = fr_refit_overlap_window(p, e, start, m->bytes, &wire_off, &src_off);
    if (n == 0 && p->entries[e].offset >= start + m->bytes)
      break;
    if (n && r->bound[e])
      rc = ferry_read(r->link, &m->src, m->src_offset + src_off, (uint8_t *)r->bound[e] + wire_off,
                      n, ms);
  }
  if (rc == 0)
    __atomic_add_fetch(&r->bytes_read, m->bytes, __ATOMIC_RELAXED);
  __atomic_add_fetch(&fr_refit_stat_direct, rc == 0, __ATOMIC_RELAXED);
  return rc;
}

/* Reads, verifies and places bucket m; with KEEP, *kept says where a successor finds it. */
static int fetch_bucket(ferry_refit_receiver *r, const fr_refit_msg_t *m, ferry_region_ref *kept,
                        uint64_t *kept_off) {
  bool keep = m->flags & FR_REFIT_KEEP;
  if (r->alias && !keep)
    return 0; /* the bytes are already where the engine looks: the sender's buffer */
  if (!r->alias)
    tear(r, m->version); /* the first byte lands below; ahead of the checksum */
  if ((m->flags & FR_REFIT_DIRECT) && !keep && !r->shards)
    return read_direct(r, m);
  if (m->flags & FR_REFIT_DIRECT) /* the sender counts none of these among a direct push's */
    return fr_err(FERRY_EPROTO, "refit: an unhashed bucket for a chain member or shard reader");
  if (r->shards)
    return fetch_shards(r, m, kept, kept_off);
  uint8_t *land = NULL;
  bool whole;
  uint64_t sum = 0;
  int rc = landing(r, m, &land, &whole);
  if (rc == 0)
    rc = read_bucket(r, m, land, whole, &sum);
  if (rc == 0 && sum != m->checksum)
    rc = fr_err(FERRY_ECHECKSUM, "refit: bucket %u of version %llu does not match its checksum",
                m->bucket, (unsigned long long)m->version);
  if (rc == 0 && keep)
    rc = ferry_region_find(r->ctx, land, m->bytes, kept, kept_off);
  return rc;
}

static int take_bucket(ferry_refit_receiver *r, const fr_refit_msg_t *m, ferry_region_ref *kept,
                       uint64_t *kept_off) {
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
  if ((m->flags & FR_REFIT_UNCHANGED) && r->bind_epoch != r->committed_epoch && !r->alias)
    r->unheld = m->version; /* fails at COMMIT, so that the catch-up starts afresh */
  if ((m->flags & FR_REFIT_UNCHANGED) || (r->got[m->bucket] && !(m->flags & FR_REFIT_KEEP)))
    return 0; /* nothing new, or a second announcement of a bucket already here */
  return fetch_bucket(r, m, kept, kept_off);
}

static void new_version(ferry_refit_receiver *r, uint64_t version) {
  r->receiving = version;
  r->verified = 0;
  r->failure = 0;
  r->missed = r->unheld = 0; /* a catch-up receives it afresh, every bucket read */
  memset(r->got, 0, r->plan.buckets ? r->plan.buckets : 1);
}

/* A failure of this receiver poisons the version; one reading from the predecessor does not
 * (the sender sends that bucket again directly). */
static void note_failure(ferry_refit_receiver *r, const fr_refit_msg_t *m, int rc) {
  char why[sizeof r->why]; /* before the log line: a log callback may make calls that set it */
  fr_str_copy(why, sizeof why, ferry_last_error());
  fr_warn_limited("%s", why); /* per bucket: a bad link fails many */
  if (m->flags & FR_REFIT_FROM_UP)
    return;
  r->failure = rc;
  pthread_mutex_lock(&r->lock);
  fr_str_copy(r->why, sizeof r->why, why);
  pthread_mutex_unlock(&r->lock);
}

/* A group's sub-receiver (group_rx.h) refuses a version that failed for its group (another rank
 * died or stalled in it): its rank's push then ends rather than wait for a commit that cannot
 * come. Returns the status it fails with (0: none). */
static int group_veto(ferry_refit_receiver *r, const fr_refit_msg_t *m) {
  char why[sizeof r->why];
  uint32_t blame = 0;
  int status =
      r->of ? fr_group_rx_veto(r->of, r, m->version, m->timeout_ms, why, sizeof why, &blame) : 0;
  r->blame = blame;
  if (status) {
    pthread_mutex_lock(&r->lock);
    fr_str_copy(r->why, sizeof r->why, why);
    pthread_mutex_unlock(&r->lock);
  }
  return status;
}

static void on_bucket(ferry_refit_receiver *r, const fr_refit_msg_t *m) {
  fr_refit_msg_t ack = {.type = FR_REFIT_ACK,
                        .version = m->version,
                        .bucket = m->bucket,
                        .seq = m->seq,
                        .flags = m->flags & FR_REFIT_KEEP};
  uint64_t t0 = fr_now_ns();
  if (m->version == r->receiving && r->acked_at) /* since it acknowledged the bucket before */
    fr_count(&r->phase_ns[FR_RX_PHASE_WAIT], t0 - r->acked_at);
  pthread_mutex_lock(&r->bind_lock); /* bind_alias sets r->alias under it */
  if (r->alias && !(m->flags & FR_REFIT_UNCHANGED))
    tear(r, m->version); /* the sender wrote this bucket into the buffer the engine reads */
  if (m->version != r->receiving)
    new_version(r, m->version);
  if (r->of && !r->failure)
    r->failure = group_veto(r, m);
  uint64_t t1 = fr_now_ns();
  int rc = r->failure ? r->failure : take_bucket(r, m, &ack.src, &ack.src_offset);
  fr_refit_rx_phase(r, FR_RX_PHASE_COPY, t1);
  fr_count(&r->buckets_taken, 1);
  bool fresh = rc == 0 && m->bucket < r->plan.buckets && !r->got[m->bucket];
  if (fresh) {
    r->got[m->bucket] = 1;
    r->verified++;
  }
  ferry_refit_bucket_fn fn = r->on_bucket;
  void *fn_arg = r->on_bucket_arg;
  pthread_mutex_unlock(&r->bind_lock);
  bool poisons = rc != 0 && !r->failure && !(m->flags & FR_REFIT_FROM_UP);
  if (rc != 0 && !r->failure)
    note_failure(r, m, rc);
  if (rc != 0 && (m->flags & FR_REFIT_FROM_UP))
    ack.flags |= FR_REFIT_UPSTREAM;
  if (fresh && fn && !(m->flags & FR_REFIT_UNCHANGED))
    fn(r, m->version, m->bucket, fn_arg);
  if (poisons) /* it cannot commit now; the sender may send no COMMIT */
    tell_commit(r, m->version, rc);
  ack.status = rc;
  ack.generation = rc == FERRY_ESTALE ? r->blame : 0;
  uint64_t t2 = fr_now_ns();
  fr_refit_send(r->link, FR_REFIT_TO_SENDER, &ack, -1);
  r->acked_at = fr_now_ns();
  fr_count(&r->phase_ns[FR_RX_PHASE_ACK], r->acked_at - t2);
}

/* The sender says which receiver precedes this one in its chain: connect to it now, so the
 * first bucket does not wait for the handshake. */
static void on_route(ferry_refit_receiver *r, const fr_refit_msg_t *m) {
  char *address = strndup(m->route, m->route_len);
  if (!address)
    return;
  if (r->up_address && strcmp(r->up_address, address) == 0 && r->up &&
      ferry_link_status(r->up) == 0) {
    free(address);
    return;
  }
  ferry_link_close(r->up);
  r->up = NULL;
  free(r->up_address);
  r->up_address = address;
  if (ferry_connect(r->ctx, address, -1, &r->up) != 0)
    fr_warn("refit: cannot reach the chain predecessor at '%s' yet: %s", address,
            ferry_last_error());
}

/* The commit callback, read under bind_lock (the caller may set it while versions land). */
static void tell_commit(ferry_refit_receiver *r, uint64_t version, int status) {
  pthread_mutex_lock(&r->bind_lock);
  ferry_refit_commit_fn fn = r->on_commit;
  void *arg = r->on_commit_arg;
  pthread_mutex_unlock(&r->bind_lock);
  if (!fn)
    return;
  char why[sizeof r->why];
  pthread_mutex_lock(&r->lock);
  fr_str_copy(why, sizeof why, status ? r->why : "");
  pthread_mutex_unlock(&r->lock);
  fn(r, version, status, status ? why : NULL, arg);
}

/* A destination bound after a bucket of its bytes landed missed that bucket; one bound since the
 * last commit misses the buckets a push skipped (unchanged, not in `only`): the version is not
 * in it. Otherwise notes the bindings the committed version is in. */
static int rebound_midway(ferry_refit_receiver *r, const fr_refit_msg_t *m) {
  uint64_t version = m->version;
  pthread_mutex_lock(&r->bind_lock);
  bool unheld = r->unheld == version;
  bool moved = unheld || (m->bytes > 0 && r->missed == version) ||
               (m->bytes < r->plan.buckets && r->bind_epoch != r->committed_epoch);
  if (!moved)
    r->committed_epoch = r->bind_epoch;
  pthread_mutex_unlock(&r->bind_lock);
  if (!moved)
    return 0;
  int rc = unheld ? fr_err(FERRY_ESTATE,
                           "refit: version %llu came with buckets flagged unchanged, which a "
                           "destination bound since the last commit does not hold; the "
                           "receiver catches up when it next waits",
                           (unsigned long long)version)
                  : fr_err(FERRY_ESTATE,
                           "refit: a destination was bound while version %llu was landing here "
                           "(it missed the buckets before); the receiver catches up when it next "
                           "waits",
                           (unsigned long long)version);
  pthread_mutex_lock(&r->lock);
  fr_str_copy(r->why, sizeof r->why, ferry_last_error());
  pthread_mutex_unlock(&r->lock);
  return rc;
}

/* The sender abandoned a version sent in parts: it fails here, whatever landed (the bytes that
 * did are torn). Not a version the sender pushed: wait(0) does not wait for it. */
static int abandoned(ferry_refit_receiver *r, const fr_refit_msg_t *m) {
  pthread_mutex_lock(&r->lock);
  snprintf(r->why, sizeof r->why,
           "the sender abandoned version %llu before its last part (its trainer's tensors "
           "stopped coming)",
           (unsigned long long)m->version);
  pthread_mutex_unlock(&r->lock);
  return FERRY_ECLOSED;
}

static void on_commit(ferry_refit_receiver *r, const fr_refit_msg_t *m) {
  bool aborted = m->flags & FR_REFIT_ABORTED;
  int status = aborted                                      ? abandoned(r, m)
               : m->version != r->receiving && m->bytes > 0 ? FERRY_EPROTO
               : r->failure                                 ? r->failure
               : r->verified != m->bytes                    ? FERRY_EPROTO
                                                            : 0;
  if (status == 0)
    status = rebound_midway(r, m);
  if (status == 0 && r->of)
    status = group_veto(r, m);
  pthread_mutex_lock(&r->lock);
  if (status == 0) {
    r->committed = m->version;
    r->torn_by = 0;
  }
  if (m->version > r->latest_known && !aborted)
    r->latest_known = m->version;
  pthread_cond_broadcast(&r->cond);
  pthread_mutex_unlock(&r->lock);
  if (status != 0)
    fr_warn("refit: version %llu not committed (%s); %s %llu", (unsigned long long)m->version,
            ferry_strerror(status), r->torn_by ? "bytes torn, no longer" : "keeping",
            (unsigned long long)r->committed);
  else /* one line per push: which version this engine serves from now on */
    fr_info("refit: committed version %llu from '%s'", (unsigned long long)m->version,
            ferry_link_peer(r->link));
  pthread_mutex_lock(&r->bind_lock); /* binding reads it */
  r->receiving = 0;
  r->acked_at = 0; /* the next version's first bucket waited for the trainer, not for us */
  pthread_mutex_unlock(&r->bind_lock);
  fr_refit_msg_t done = {.type = FR_REFIT_COMMITTED,
                         .version = m->version,
                         .status = status,
                         .generation = status == FERRY_ESTALE ? r->blame : 0};
  if (!aborted) /* the sender does not wait for an answer to that */
    fr_refit_send(r->link, FR_REFIT_TO_SENDER, &done, -1);
  tell_commit(r, m->version, status);
}

/* The sender dropped this receiver: it acknowledged nothing within a push's timeout (it was
 * stopped, or too slow). Whatever of that version landed here stays torn; attach again (one call
 * on the same link, which also brings a newer manifest) so that the next push includes it. */
static void on_dropped(ferry_refit_receiver *r, const fr_refit_msg_t *m) {
  pthread_mutex_lock(&r->lock);
  if (m->version > r->latest_known)
    r->latest_known = m->version;
  snprintf(r->why, sizeof r->why,
           "the sender dropped this receiver from version %llu (it acknowledged nothing in time)",
           (unsigned long long)m->version);
  pthread_cond_broadcast(&r->cond);
  pthread_mutex_unlock(&r->lock);
  fr_warn("refit: %s; attaching again", r->why);
  fr_refit_plan plan;
  int rc = fr_refit_rx_fetch_manifest(r, -1, &plan);
  if (rc == 0 && plan.generation == r->plan.generation) {
    fr_refit_plan_free(&plan);
  } else if (rc == 0) {
    pthread_mutex_lock(&r->bind_lock);
    rc = install_manifest(r, plan);
    pthread_mutex_unlock(&r->bind_lock);
  }
  if (rc != 0)
    fr_warn("refit: cannot attach again: %s", ferry_last_error());
  tell_commit(r, m->version, FERRY_ETIMEDOUT);
}

/* The sender cannot catch this receiver up (it keeps no whole copy of the version). */
static void on_catchup_refused(ferry_refit_receiver *r, const fr_refit_msg_t *m) {
  pthread_mutex_lock(&r->lock);
  snprintf(r->why, sizeof r->why,
           "the sender keeps no whole copy of version %llu to catch up from (opened with "
           "no_retain); it comes with the next push",
           (unsigned long long)m->version);
  pthread_cond_broadcast(&r->cond);
  pthread_mutex_unlock(&r->lock);
}

/* ---- the service thread's messages (transport/job.h) ---- */

void fr_refit_rx_service_msg(void *arg, ferry_msg *msg) {
  ferry_refit_receiver *r = arg;
  fr_refit_msg_t m;
  if (msg->link != r->link || fr_refit_msg_decode(msg->data, msg->len, &m) != 0)
    fr_warn("refit: dropped a message that is not from our sender or is malformed");
  else if (m.type == FR_REFIT_BUCKET)
    on_bucket(r, &m);
  else if (m.type == FR_REFIT_COMMIT)
    on_commit(r, &m);
  else if (m.type == FR_REFIT_ROUTE)
    on_route(r, &m);
  else if (m.type == FR_REFIT_DROPPED)
    on_dropped(r, &m);
  else if (m.type == FR_REFIT_CATCHUP)
    on_catchup_refused(r, &m);
  ferry_msg_free(msg);
}
