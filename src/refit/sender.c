/*
 * The refit sender: declared tensors, the sealed plan, two shared-memory bucket buffers, the
 * receivers that attached, and push(). A service thread answers ATTACH calls and collects the
 * receivers' ACK/COMMITTED records; push() packs bucket i+1 into one buffer while receivers read
 * bucket i from the other, and waits for every receiver before reusing a buffer.
 *
 * The sender's service thread is a job (transport/job.h) owning its context's
 * FR_CHANNEL_REFIT_SENDER: receivers write to it, and the thread is asleep until a message comes,
 * a link of the context dies (it then wakes the push, which fails a receiver that is gone at
 * once instead of polling link states), a push ends (late joiners are served then:
 * FR_REFIT_WAKE_CATCHUPS), or close stops it (the published name's lease is renewed by the
 * node's timer, directory/lease.c). The service thread never sends
 * while it holds the sender's lock (sender_impl.h): a stalled receiver cannot hold up the
 * acknowledgements of the others. A
 * receiver on the same context owns the other channel (FR_CHANNEL_REFIT_RECEIVER), so the two
 * roles never see each other's messages; a second sender on one context gets FERRY_EBUSY.
 *
 * Declared tensors may be CUDA memory: each is classified once, when declared, and packing copies
 * its bytes to the host (pack.c); the bucket buffers are then pinned, so that those copies run at
 * the copy engine's speed.
 */
#include "core/cuda.h"
#include "refit/refit.h"
#include "transport/wire.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void (*fr_refit_test_corrupt)(uint32_t bucket, uint8_t *bytes, uint64_t len);
void (*fr_refit_test_hold)(int point);

#include "refit/sender_impl.h"

/* ---- the service thread ---- */

static receiver *find_receiver(ferry_refit_sender *s, ferry_link *link) {
  for (receiver *r = s->receivers; r; r = r->next)
    if (r->link == link)
      return r;
  return NULL;
}

void fr_refit_receiver_free(receiver *r) {
  fr_refit_view_release(r);
  ferry_link_release(r->link);
  free(r->address);
  free(r->routed);
  free(r);
}

static void remove_receiver(ferry_refit_sender *s, ferry_link *link) {
  for (receiver **pp = &s->receivers; *pp; pp = &(*pp)->next)
    if ((*pp)->link == link) {
      receiver *r = *pp;
      if (r->in_push) { /* others may read from it: it goes when the push ends */
        r->detached = true;
        r->status = r->status ? r->status : FERRY_ECLOSED;
        return;
      }
      *pp = r->next;
      fr_refit_receiver_free(r);
      return;
    }
}

/* A new receiver from its ATTACH call; its body is the receiver's ctx address. */
static receiver *new_receiver(ferry_msg *m) {
  receiver *r = calloc(1, sizeof *r);
  size_t alen = m->len > 4 ? m->len - 4 : 0;
  if (r && alen <= FR_REFIT_ADDRESS_MAX &&
      (r->address = strndup((const char *)m->data + 4, alen))) {
    r->link = ferry_link_retain(m->link);
    r->shm = strcmp(ferry_link_transport(m->link), "shm") == 0;
    fr_str_copy(r->peer, sizeof r->peer, ferry_link_peer(m->link));
    return r;
  }
  free(r);
  return NULL;
}

/* The ATTACH reply is built under the lock (the manifest is copied: a seal may replace it) and
 * sent after it. The receiver is recorded first, under the same lock: once its open returns, a
 * push that begins includes it. (Frames of that push may reach it before the reply; its service
 * thread, started once the reply is in, takes them after.) A reply that cannot go leaves the link
 * dead, and the next push drops the record. One that attaches while a push is under way is not
 * in it: the reply names that push's version as the latest, so the receiver asks to catch up to
 * it, and the request is served once the push ends (catchup.c). */
static void answer_attach(ferry_refit_sender *s, ferry_msg *m) {
  pthread_mutex_lock(&s->lock);
  fr_refit_attach_reply rep = {.status = s->sealed ? 0 : FERRY_ESTATE,
                               .latest = s->pushing ? s->pushing : s->latest};
  if (s->alias)
    rep.alias = s->ref[0];
  size_t mlen = s->sealed ? s->manifest_len : 0;
  uint8_t *manifest = mlen ? malloc(mlen) : NULL;
  if (manifest)
    memcpy(manifest, s->manifest, mlen);
  else if (mlen)
    rep.status = FERRY_ENOMEM;
  receiver *known = find_receiver(s, m->link);
  if (known && known->dropped) { /* back from a stall: in the next push again */
    known->dropped = false;
    fr_info("refit '%s': receiver '%s' attached again", s->name, known->peer);
  }
  receiver *r = rep.status == 0 && !known ? new_receiver(m) : NULL;
  if (r) {
    r->next = s->receivers;
    s->receivers = r;
    fr_info("refit '%s': receiver '%s' attached", s->name, r->peer);
  }
  pthread_mutex_unlock(&s->lock);
  uint8_t head[FR_REFIT_ATTACH_HEAD];
  fr_refit_attach_head_encode(&rep, head);
  struct iovec iov[2] = {{head, sizeof head}, {manifest, manifest ? mlen : 0}};
  ferry_reply(m, iov, 2, -1);
  free(manifest);
}

/* A receiver verified a bucket (it is then a source for its successor) or failed it. A failure
 * to read from its predecessor is not its own: it takes the rest from the sender later. */
static void record_ack(ferry_refit_sender *s, receiver *r, const fr_refit_msg_t *x) {
  if (x->status != 0 && (x->flags & FR_REFIT_UPSTREAM)) {
    r->orphan |= !s->repairing;
  } else if (x->status != 0) {
    if (r->status == 0 && x->status == FERRY_ESTALE)
      r->blame = x->generation;
    r->status = r->status ? r->status : x->status;
  } else if (x->seq == r->acked) {
    if (x->flags & FR_REFIT_KEEP) {
      r->fwd[x->seq % 2] = x->src;
      r->fwd_offset[x->seq % 2] = x->src_offset;
    }
    r->acked++;
    r->progress_ns = fr_now_ns(); /* the pushing thread announces what may go now */
  }
}

/* Sends what the service thread queued under the lock (catch-up frames; svc_sending was set
 * then), then applies failures. A push that begins meanwhile waits for it (begin_push, for the
 * push's timeout at most), so that no catch-up frame reaches a receiver after the push's first
 * frame. */
static void send_queued(ferry_refit_sender *s) {
  if (!s->svc_sending)
    return;
  void (*hold)(int) = __atomic_load_n(&fr_refit_test_hold, __ATOMIC_ACQUIRE);
  if (hold)
    hold(FR_REFIT_HOLD_SEND);
  fr_refit_out_send(&s->svc_out);
  pthread_mutex_lock(&s->lock);
  fr_refit_out_settle(s, &s->svc_out);
  s->svc_sending = false;
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
}

int fr_refit_service_await(ferry_refit_sender *s, uint64_t version, int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  struct timespec ts = fr_timespec(deadline);
  fr_refit_buf_moves(s); /* a sum being taken stops at its next chunk, and none begins */
  s->bar_sums++;
  while ((s->svc_sending || s->summing_host) && fr_now_ns() < deadline)
    pthread_cond_timedwait(&s->cond, &s->lock, &ts);
  s->bar_sums--;
  if (!s->svc_sending && !s->summing_host)
    return 0;
  return fr_err(FERRY_ETIMEDOUT,
                "refit '%s': version %llu not pushed: the sender's service thread was still %s "
                "after the push's timeout (%d ms); no receiver was sent anything",
                s->name, (unsigned long long)version,
                s->svc_sending ? "sending catch-up frames to late joiners"
                               : "hashing a late joiner's shard runs",
                timeout_ms);
}

/* Takes the checksums that catch-ups wait for (catchup.c), one bucket at a time, each without
 * s->lock, and sends what each one lets go. A push that begins meanwhile never waits for the
 * copy: it voids the sum, and the copy stops at its next chunk. */
static void take_sums(ferry_refit_sender *s) {
  for (;;) {
    fr_refit_sum_job j;
    pthread_mutex_lock(&s->lock);
    bool any = fr_refit_catchup_sum_next(s, &j);
    pthread_mutex_unlock(&s->lock);
    if (!any)
      return;
    uint64_t sum = 0;
    int rc = fr_refit_sum_run(s, &j, &sum);
    pthread_mutex_lock(&s->lock);
    fr_refit_catchup_sum_done(s, &j, rc, sum, &s->svc_out);
    s->svc_sending = s->svc_out.n != 0;
    pthread_mutex_unlock(&s->lock);
    send_queued(s);
  }
}

static void record(ferry_refit_sender *s, ferry_msg *m, const fr_refit_msg_t *x) {
  pthread_mutex_lock(&s->lock);
  receiver *r = find_receiver(s, m->link);
  if (x->type == FR_REFIT_DETACH) {
    remove_receiver(s, m->link);
  } else if (r && x->type == FR_REFIT_CATCHUP) {
    fr_refit_catchup_request(s, r, x->version, &s->svc_out);
  } else if (r && r->in_push && x->version == s->pushing && x->type == FR_REFIT_ACK) {
    record_ack(s, r, x);
  } else if (r && r->in_push && x->version == s->pushing && x->type == FR_REFIT_COMMITTED) {
    if (x->status != 0 && r->status == 0) {
      r->status = x->status;
      r->blame = x->status == FERRY_ESTALE ? x->generation : 0;
    }
    r->commit_seen = true;
  } else if (r) {
    fr_refit_catchup_record(s, r, x, &s->svc_out);
  }
  s->svc_sending = s->svc_out.n != 0;
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
  send_queued(s);
  take_sums(s);
}

/* A receiver declares a shard target (a call, so that its bind returns once the next push
 * hashes its slices); the reply is the status. */
static void answer_view(ferry_refit_sender *s, ferry_msg *m) {
  fr_refit_msg_t x;
  int rc = fr_refit_msg_decode(m->data, m->len, &x);
  pthread_mutex_lock(&s->lock);
  receiver *r = rc == 0 ? find_receiver(s, m->link) : NULL;
  if (rc == 0 && !r)
    rc = fr_err(FERRY_ESTATE, "refit '%s': a view from a receiver that is not attached", s->name);
  if (rc == 0)
    rc = fr_refit_view_record(s, r, &x);
  pthread_mutex_unlock(&s->lock);
  uint8_t st[4];
  fr_put_u32(st, (uint32_t)rc);
  struct iovec iov = {st, sizeof st};
  ferry_reply(m, &iov, 1, -1);
}

/* ---- the service thread's callbacks (transport/job.h) ---- */

static void service_msg(void *arg, ferry_msg *m) {
  ferry_refit_sender *s = arg;
  fr_refit_msg_t x;
  if (ferry_msg_is_call(m) && m->len >= FR_REFIT_MSG_BYTES && fr_get_u32(m->data) == FR_REFIT_VIEW)
    answer_view(s, m);
  else if (ferry_msg_is_call(m)) /* the other call is ATTACH */
    answer_attach(s, m);
  else if (fr_refit_msg_decode(m->data, m->len, &x) == 0)
    record(s, m, &x);
  else
    fr_warn("refit '%s': dropped a bad message from '%s': %s", s->name, ferry_link_peer(m->link),
            ferry_last_error());
  ferry_msg_free(m);
}

/* A link of the context died: a receiver's, maybe (or one the push does not use: rare, and
 * harmless); a push waiting on it looks again. */
static void service_link_down(void *arg) {
  ferry_refit_sender *s = arg;
  pthread_mutex_lock(&s->lock);
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
}

/* FR_REFIT_WAKE_CATCHUPS: a push or a seal ended; late joiners that asked meanwhile, and the
 * catch-ups under way (a seal leaves them nothing to catch up from). */
static void service_wake(void *arg, unsigned bits) {
  ferry_refit_sender *s = arg;
  if (!(bits & FR_REFIT_WAKE_CATCHUPS))
    return;
  pthread_mutex_lock(&s->lock);
  fr_refit_catchup_serve(s, &s->svc_out);
  s->svc_sending = s->svc_out.n != 0;
  pthread_mutex_unlock(&s->lock);
  send_queued(s);
  take_sums(s);
}

/* No timer: the published name's lease is renewed by the node's own timer (directory/lease.c). */
static const fr_job_ops service_ops = {
    .on_msg = service_msg, .on_link_down = service_link_down, .on_wake = service_wake};

/* ---- open, declare, seal ---- */

/* The bucket budget from options and configuration. */
static uint64_t bucket_budget(const ferry_refit_opts *opts) {
  if (FR_OPT(opts, bucket_bytes, 0))
    return opts->bucket_bytes;
  const char *ratio = fr_config_str("FERRY_REFIT_BUFFER_RATIO");
  if (*ratio) {
    double r = strtod(ratio, NULL);
    long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (r > 0 && r < 1 && pages > 0)
      return (uint64_t)(r * (double)pages * (double)page / 2);
  }
  return (uint64_t)fr_config_int("FERRY_REFIT_BUFFER_BYTES");
}

/* A group's rank (ferry_refit_opts.rank/.world): world 0 or 1 is a single sender (rank 0); a
 * group of more needs `publish` (its receivers find the ranks by name) and 0 <= rank < world. */
static int check_rank(const char *name, const ferry_refit_opts *opts) {
  int rank = FR_OPT(opts, rank, 0), world = FR_OPT(opts, world, 0);
  if (world < 0 || world > (int)FR_REFIT_MAX_WORLD)
    return fr_err(FERRY_EINVAL, "refit sender '%s': world %d (0 to %u)", name, world,
                  FR_REFIT_MAX_WORLD);
  if (world <= 1 && rank != 0)
    return fr_err(FERRY_EINVAL,
                  "refit sender '%s': rank %d of a world of %d (a single sender is rank 0)", name,
                  rank, world);
  if (world > 1 && (rank < 0 || rank >= world))
    return fr_err(FERRY_EINVAL, "refit sender '%s': rank %d outside its world of %d", name, rank,
                  world);
  if (world > 1 && !FR_OPT(opts, publish, 0))
    return fr_err(FERRY_EINVAL,
                  "refit sender '%s': a group (world %d) must publish (ferry_refit_opts.publish): "
                  "its receivers find the ranks by name",
                  name, world);
  return 0;
}

/* The name the sender goes by (and publishes): NAME alone, NAME#r as rank r of a group. */
static int own_name(const char *name, const ferry_refit_opts *opts, char **out) {
  if (FR_OPT(opts, world, 0) > 1)
    return fr_refit_rank_name(name, (uint32_t)opts->rank, out);
  *out = strdup(name);
  return *out ? 0 : fr_err(FERRY_ENOMEM, "refit sender");
}

int ferry_refit_sender_open(ferry_ctx *ctx, const char *name, const ferry_refit_opts *opts,
                            ferry_refit_sender **out) {
  if (!ctx || !name || !out)
    return fr_err(FERRY_EINVAL, "ferry_refit_sender_open: NULL argument");
  int rc = FR_OPTS_CHECK(opts, "ferry_refit_sender_open");
  if (rc == 0)
    rc = fr_name_check("refit sender name", name, FR_REFIT_NAME_MAX);
  if (rc == 0)
    rc = check_rank(name, opts);
  if (rc != 0)
    return rc;
  ferry_refit_sender *s = calloc(1, sizeof *s);
  if (!s)
    return fr_err(FERRY_ENOMEM, "refit sender");
  pthread_mutex_init(&s->lock, NULL); /* first: close takes a sender however far its open came */
  fr_cond_init_monotonic(&s->cond);
  s->dev_buf = s->pin_device = -1;
  s->ctx = ctx;
  s->budget = bucket_budget(opts);
  s->alias = FR_OPT(opts, alias, 0);
  s->device_buckets = FR_OPT(opts, device_buckets, 0);
  s->retain = !FR_OPT(opts, no_retain, 0);
  s->plan.world = FR_OPT(opts, world, 0) > 1 ? (uint32_t)opts->world : 1;
  s->plan.rank = s->plan.world > 1 ? (uint32_t)opts->rank : 0;
  rc = own_name(name, opts, &s->name);
  /* the channel is ours now; the thread starts once the sender is whole (fr_job_run below) */
  if (rc == 0 && (rc = fr_job_open(ctx, FR_CHANNEL_REFIT_SENDER, &service_ops, s, "ferry-refit-tx",
                                   &s->service)) == FERRY_EBUSY)
    rc = fr_err(rc, "ferry_refit_sender_open: this context has a refit sender already");
  if (rc == 0 && FR_OPT(opts, publish, 0))
    rc = fr_refit_publish(ctx, s->name, FR_OPT(opts, directory, NULL), &s->published);
  if (rc == 0 && fr_refit_packer_start(s, &s->packer) != 0)
    fr_warn("refit '%s': packing on one thread: %s", name, ferry_last_error());
  if (rc == 0 && (rc = fr_job_run(s->service)) != 0)
    rc = fr_err_wrap(rc, "refit sender");
  if (rc == 0)
    rc = fr_refit_stats_start(s);
  if (rc != 0) { /* close stops the job, run or not, and whatever else the open made */
    fr_err_keep keep;
    fr_err_save(&keep, rc);
    ferry_refit_sender_close(s);
    return fr_err_restore(&keep);
  }
  *out = s;
  return 0;
}

/* Where a declared tensor lives: its CUDA device, or -1 for host memory. Device memory must
 * hold the whole tensor (the copies are bounded by the allocation, never by trust). Before the
 * sender's lock: the first call may load the driver. */
static int classify(const char *name, const ferry_tensor_desc *desc, const void *data,
                    int *device) {
  fr_mem_where w = fr_cuda_where(data);
  *device = w.kind == FERRY_MEM_CUDA ? w.device : -1;
  uint64_t bytes = 0;
  if (*device < 0 || ferry_tensor_nbytes(desc, &bytes) != 0)
    return 0; /* a bad desc is reported below, under the lock, as for host memory */
  if (bytes > fr_cuda_room(&w, data))
    return fr_err(FERRY_EINVAL,
                  "refit: tensor '%s' (%llu bytes) runs past the end of its CUDA allocation on "
                  "device %d",
                  name, (unsigned long long)bytes, *device);
  return 0;
}

/* A piece (ferry_refit_declare_piece) must fit the local tensor: [start, stop) along dim is
 * all of desc's dim; no fp8 cast (its scale, the piece's max, would differ per rank). */
static int check_piece(const char *name, const ferry_tensor_desc *desc, ferry_dtype send_as,
                       const ferry_refit_piece *of) {
  if (!of->source)
    return fr_err(FERRY_EINVAL, "refit: tensor '%s': a piece of no global tensor (NULL source)",
                  name);
  if (fr_name_check("global tensor name", of->source, FR_REFIT_NAME_MAX) != 0)
    return fr_err_wrap(FERRY_EINVAL, "refit: tensor '%s'", name);
  if (desc->ndim > FERRY_MAX_DIMS || of->dim < 0 || (uint32_t)of->dim >= desc->ndim)
    return fr_err(FERRY_EINVAL,
                  "refit: tensor '%s': a piece of '%s' along dim %d, but it has %u dims", name,
                  of->source, of->dim, desc->ndim);
  if (of->start < 0 || of->stop <= of->start ||
      (uint64_t)(of->stop - of->start) != desc->shape[of->dim])
    return fr_err(FERRY_EINVAL,
                  "refit: tensor '%s': the piece [%lld, %lld) of '%s' along dim %d does not fit "
                  "its %llu elements there",
                  name, (long long)of->start, (long long)of->stop, of->source, of->dim,
                  (unsigned long long)desc->shape[of->dim]);
  if (send_as == FERRY_DTYPE_F8E4M3 && desc->dtype != FERRY_DTYPE_F8E4M3)
    return fr_err(FERRY_EDTYPE,
                  "refit: tensor '%s' (a piece of '%s'): no fp8 cast of a piece (each rank's "
                  "scale would differ); send it as %s or bf16",
                  name, of->source, ferry_dtype_name(desc->dtype));
  return 0;
}

/* The entry named `name`, added when new (the caller holds s->lock); NULL when out of memory. */
static fr_refit_entry *entry_for(ferry_refit_sender *s, const char *name, int64_t *at) {
  *at = fr_refit_plan_find(&s->plan, name);
  if (*at >= 0)
    return &s->plan.entries[*at];
  char *copy = strdup(name);
  if (!copy || FR_GROW(s->plan.entries, s->entries_cap, s->plan.count + 1, 256) != 0 ||
      FR_GROW(s->src, s->src_cap, s->plan.count + 1, 256) != 0) {
    free(copy);
    return NULL;
  }
  *at = s->plan.count++;
  s->plan.entries[*at] = (fr_refit_entry){.name = copy};
  return &s->plan.entries[*at];
}

/* Records the global piece an entry is (of NULL: whole under its own name). */
static int set_piece(fr_refit_entry *e, const ferry_refit_piece *of) {
  char *global = of ? strdup(of->source) : NULL;
  if (of && !global)
    return fr_err(FERRY_ENOMEM, "refit: tensor '%s'", e->name);
  free(e->global);
  e->global = global;
  e->gdim = of ? (uint32_t)of->dim : 0;
  e->gstart = of ? (uint64_t)of->start : 0;
  e->gstop = of ? (uint64_t)of->stop : 0;
  return 0;
}

/* A declaration after a seal: the push refuses until the next seal, naming the first one. */
static void note_since_seal(ferry_refit_sender *s, const char *name) {
  if (s->plan.generation == 0)
    return; /* never sealed: "seal before pushing" says it all */
  if (s->since_seal_count++ == 0)
    fr_str_copy(s->since_seal, sizeof s->since_seal, name);
}

static int declare(ferry_refit_sender *s, const char *name, const ferry_tensor_desc *desc,
                   const void *data, ferry_dtype send_as, const ferry_refit_piece *of) {
  if (fr_name_check("refit: tensor name", name, FR_REFIT_NAME_MAX) != 0)
    return FERRY_EINVAL;
  int device = -1;
  int rc = of ? check_piece(name, desc, send_as, of) : 0;
  if (rc == 0)
    rc = classify(name, desc, data, &device);
  if (rc != 0)
    return rc;
  pthread_mutex_lock(&s->lock);
  int64_t at;
  fr_refit_entry *e = entry_for(s, name, &at);
  if (!e)
    rc = fr_err(FERRY_ENOMEM, "refit: %u tensors", s->plan.count + 1);
  if (e) {
    e->desc = *desc;
    e->wire = send_as == FERRY_DTYPE_INVALID ? desc->dtype : send_as;
    s->src[at].data = data;
    s->src[at].device = device;
    s->src[at].given = true;
    uint64_t bytes;
    if ((rc = ferry_tensor_nbytes(desc, &bytes)) != 0)
      rc = fr_err_wrap(rc, "refit: tensor '%s'", name);
    else if (!fr_refit_cast_supported(desc->dtype, e->wire))
      rc = fr_err(FERRY_EDTYPE, "refit: tensor '%s': no cast from %s to %s", name,
                  ferry_dtype_name(desc->dtype), ferry_dtype_name(e->wire));
    int piece_rc = set_piece(e, of); /* also after a failure: the entry says what was asked */
    rc = rc ? rc : piece_rc;
    s->sealed = false;
    note_since_seal(s, name);
  }
  pthread_mutex_unlock(&s->lock);
  return rc;
}

int ferry_refit_declare(ferry_refit_sender *s, const char *name, const ferry_tensor_desc *desc,
                        const void *data, ferry_dtype send_as) {
  if (!s || !name || !desc || !data)
    return fr_err(FERRY_EINVAL, "ferry_refit_declare: NULL argument");
  return declare(s, name, desc, data, send_as, NULL);
}

int ferry_refit_declare_piece(ferry_refit_sender *s, const char *name,
                              const ferry_tensor_desc *desc, const void *data, ferry_dtype send_as,
                              const ferry_refit_piece *of) {
  if (!s || !name || !desc || !data || !of)
    return fr_err(FERRY_EINVAL, "ferry_refit_declare_piece: NULL argument");
  return declare(s, name, desc, data, send_as, of);
}

static void free_buffers(ferry_refit_sender *s) {
  for (int i = 0; i < 2 && s->dev_buf >= 0; i++)
    if (s->buf[i]) {
      /* FERRY_ETIMEDOUT: a copy from it still runs (warned); left allocated rather than freed
       * under it */
      if (ferry_deregister(s->ctx, s->ref[i].id) != FERRY_ETIMEDOUT)
        fr_cuda_free(s->buf[i]);
      s->buf[i] = NULL;
    }
  s->dev_buf = -1;
  for (int i = 0; i < 2; i++) {
    if (s->pinned[i])
      fr_cuda_unpin(s->pin_device, s->buf[i]);
    s->pinned[i] = false;
    ferry_free(s->ctx, s->buf[i]);
    s->buf[i] = NULL;
    s->ref[i] = (ferry_region_ref){0};
  }
  s->buf_bytes = 0;
}

/* Alias mode or device_buckets with every tensor on one CUDA device and sent as declared (no
 * cast: casting needs the host): that device, whose memory the buffers then are; else -1. */
static int buffer_device(const ferry_refit_sender *s) {
  if ((!s->alias && !s->device_buckets) || s->plan.count == 0)
    return -1;
  int d = s->src[0].device;
  for (uint32_t i = 0; i < s->plan.count; i++)
    if (s->src[i].device != d || s->plan.entries[i].wire != s->plan.entries[i].desc.dtype)
      return -1;
  return d;
}

/* Zeroes [0, n) of device buffer i (the gaps of a layout are never written). */
static int zero_device_buffer(ferry_refit_sender *s, int i, int device, uint64_t n) {
  void *zero = calloc(1, FR_REFIT_SCRATCH);
  int rc = zero ? 0 : fr_err(FERRY_ENOMEM, "refit '%s': zeroes for its CUDA buffer", s->name);
  for (uint64_t at = 0; rc == 0 && at < n; at += FR_REFIT_SCRATCH)
    rc = fr_cuda_copy_on(device, (uint8_t *)s->buf[i] + at, zero,
                         n - at < FR_REFIT_SCRATCH ? n - at : FR_REFIT_SCRATCH);
  free(zero);
  return rc;
}

/* Buffer i in CUDA memory of `device`, zeroed (the gaps between tensors are never written) and
 * registered, so that receivers on this host map it through CUDA IPC. */
static int alloc_device_buffer(ferry_refit_sender *s, int i, int device, uint64_t need) {
  void *p = NULL;
  int rc = fr_cuda_alloc(device, need, &p);
  s->buf[i] = p;
  if (rc == 0)
    rc = zero_device_buffer(s, i, device, need);
  if (rc == 0)
    rc = ferry_register(s->ctx, p, need, &s->ref[i]);
  if (rc != 0) {
    s->buf[i] = NULL;
    if (p)
      fr_cuda_free(p);
    return fr_err_wrap(rc, "refit '%s': a buffer of %llu bytes on CUDA device %d", s->name,
                       (unsigned long long)need, device);
  }
  s->dev_buf = device;
  return 0;
}

static int alloc_layout(ferry_refit_sender *s, bool whole) {
  uint64_t need = whole ? s->plan.total_bytes : s->plan.bucket_bytes;
  int device = buffer_device(s), n = whole ? 1 : 2, rc = 0;
  if (s->buf[0] && s->whole == whole && s->buf_bytes >= need && device == s->dev_buf) {
    /* kept: CUDA buffers are zeroed again for the new layout's gaps; peers that mapped them
     * through IPC keep a valid mapping (a new one would pin device memory in every importer
     * until its link closes) */
    for (int i = 0; i < n && device >= 0 && rc == 0; i++)
      rc = zero_device_buffer(s, i, device, s->buf_bytes);
    return rc;
  }
  free_buffers(s);
  for (int i = 0; i < n && device >= 0 && rc == 0; i++)
    rc = alloc_device_buffer(s, i, device, need);
  if (device >= 0) {
    if (rc != 0) {
      free_buffers(s);
      return rc;
    }
    s->whole = whole;
    s->buf_bytes = need;
    return 0;
  }
  for (int i = 0; i < (whole ? 1 : 2); i++) {
    int rc = ferry_alloc(s->ctx, need, &s->buf[i]);
    if (rc == 0)
      rc = ferry_region_find(s->ctx, s->buf[i], need, &s->ref[i], NULL);
    if (rc != 0) {
      free_buffers(s);
      return rc;
    }
  }
  s->whole = whole;
  s->buf_bytes = need;
  return 0;
}

/* One buffer for the whole wire layout (alias mode, or retaining the latest version for late
 * joiners; packing there in place costs no copy), else two bucket slots. A retaining sender that
 * cannot get the whole buffer falls back to two slots: late joiners then wait for the next push.
 * Device buckets take two slots, or (FERRY_REFIT_DEVICE_WHOLE, an experiment of issue 37) one per
 * bucket: the packing then never waits for a receiver's read. */
static int alloc_buffers(ferry_refit_sender *s) {
  if (buffer_device(s) >= 0)
    return alloc_layout(s, s->alias || fr_config_int("FERRY_REFIT_DEVICE_WHOLE") != 0);
  if (s->alias || !s->retain)
    return alloc_layout(s, s->alias);
  if (alloc_layout(s, true) == 0)
    return 0;
  fr_warn("refit '%s': cannot keep the whole version (%llu bytes) for late joiners (%s); using "
          "two buckets, so a receiver that attaches late waits for the next push",
          s->name, (unsigned long long)s->plan.total_bytes, ferry_last_error());
  return alloc_layout(s, false);
}

/* With a tensor on a device: the buckets pinned (once; a failure only costs speed) and the
 * scratch that casts go through. Without one any pinning is undone. */
static int prepare_device(ferry_refit_sender *s) {
  for (uint32_t i = 0; s->pin_device < 0 && s->on_device && i < s->plan.count; i++)
    if (s->src[i].device >= 0)
      s->pin_device = s->src[i].device;
  for (int i = 0; i < 2 && s->dev_buf < 0; i++) {
    if (!s->buf[i] || s->pinned[i] == s->on_device)
      continue;
    if (s->pinned[i]) {
      fr_cuda_unpin(s->pin_device, s->buf[i]);
      s->pinned[i] = false;
    } else if (fr_cuda_pin(s->pin_device, s->buf[i], s->buf_bytes) == 0) {
      s->pinned[i] = true;
    } else {
      fr_warn("refit '%s': bucket buffer not pinned, device copies run slower: %s", s->name,
              ferry_last_error());
    }
  }
  if (!s->on_device || s->scratch)
    return 0;
  if (!(s->scratch = aligned_alloc(4096, FR_REFIT_SCRATCH)))
    return fr_err(FERRY_ENOMEM, "refit '%s': %u bytes of scratch for device tensors", s->name,
                  FR_REFIT_SCRATCH);
  s->scratch_pinned = fr_cuda_pin(s->pin_device, s->scratch, FR_REFIT_SCRATCH) == 0;
  return 0;
}

int fr_refit_sender_to_device(ferry_refit_sender *s) {
  if (s->on_device)
    return 0;
  s->on_device = true;
  return prepare_device(s);
}

/* max |x| of a device tensor, read through the scratch a piece at a time. */
static int device_amax(ferry_refit_sender *s, uint32_t i, float *amax) {
  const fr_refit_entry *e = &s->plan.entries[i];
  size_t se = ferry_dtype_size(e->desc.dtype);
  uint64_t count = e->src_bytes / se, per = FR_REFIT_SCRATCH / se;
  *amax = 0;
  for (uint64_t at = 0; at < count; at += per) {
    uint64_t k = count - at < per ? count - at : per;
    int rc = fr_cuda_copy_on(s->src[i].device, s->scratch,
                             (const uint8_t *)s->src[i].data + at * se, k * se);
    if (rc != 0)
      return fr_err_wrap(rc, "refit '%s': tensor '%s' on CUDA device %d", s->name, e->name,
                         s->src[i].device);
    *amax = fr_refit_amax(e->desc.dtype, s->scratch, k, *amax);
  }
  return 0;
}

static int compute_scales(ferry_refit_sender *s) {
  int rc;
  for (uint32_t i = 0; i < s->plan.count; i++) {
    fr_refit_entry *e = &s->plan.entries[i];
    float amax = 0;
    if (e->wire != FERRY_DTYPE_F8E4M3 || e->desc.dtype == e->wire) {
      e->scale = 1.0f;
      continue;
    }
    if (s->src[i].device < 0)
      amax = fr_refit_amax(e->desc.dtype, s->src[i].data,
                           e->src_bytes / ferry_dtype_size(e->desc.dtype), 0);
    else if ((rc = device_amax(s, i, &amax)) != 0)
      return rc;
    e->scale = fr_refit_fp8_scale_of(amax);
  }
  return 0;
}

int ferry_refit_seal(ferry_refit_sender *s) {
  if (!s)
    return fr_err(FERRY_EINVAL, "ferry_refit_seal: NULL sender");
  pthread_mutex_lock(&s->lock);
  /* a catch-up's checksum being taken (unlocked) reads the buffer a seal may free or zero: it
   * is void now, and stops at its next chunk */
  fr_refit_buf_moves(s);
  s->bar_sums++;
  while (s->summing)
    pthread_cond_wait(&s->cond, &s->lock);
  int rc = s->plan.count ? 0 : fr_err(FERRY_ESTATE, "refit '%s': nothing declared", s->name);
  if (rc == 0 && s->stream.version)
    rc = fr_err(FERRY_ESTATE,
                "refit '%s': version %llu is open in parts: push its last part or abandon it "
                "(FERRY_REFIT_PART_ABORT) before sealing",
                s->name, (unsigned long long)s->stream.version);
  if (rc == 0)
    rc = fr_refit_plan_build(&s->plan, s->budget);
  s->on_device = false;
  for (uint32_t i = 0; rc == 0 && i < s->plan.count; i++)
    s->on_device |= s->src[i].device >= 0;
  s->pack_async = fr_config_int("FERRY_CUDA_PACK_ASYNC") != 0;
  if (rc == 0)
    rc = alloc_buffers(s);
  if (rc == 0)
    rc = prepare_device(s);
  if (rc == 0)
    rc = compute_scales(s);
  if (rc == 0) {
    s->plan.generation++;
    s->retained = 0;         /* the buffer holds no version in the new layout until a push */
    fr_refit_views_clear(s); /* pieces name tensors by index: receivers declare them again */
    free(s->manifest);
    s->manifest = NULL;
    rc = fr_refit_manifest_encode(&s->plan, &s->manifest, &s->manifest_len);
  }
  if (rc == 0) {
    free(s->last_sum);
    free(s->sum_known);
    s->last_sum = calloc(s->plan.buckets ? s->plan.buckets : 1, sizeof *s->last_sum);
    s->sum_known = calloc(s->plan.buckets ? s->plan.buckets : 1, 1);
    s->sealed = s->last_sum && s->sum_known;
    if (!s->sealed)
      rc = fr_err(FERRY_ENOMEM, "refit: checksums");
  }
  if (rc == 0)
    s->since_seal_count = 0;
  s->bar_sums--;
  pthread_mutex_unlock(&s->lock);
  fr_job_wake(s->service, FR_REFIT_WAKE_CATCHUPS); /* catch-ups that waited for a checksum */
  if (rc == 0)
    fr_info("refit '%s': sealed %u tensors, %llu bytes in %u buckets of %llu", s->name,
            s->plan.count, (unsigned long long)s->plan.total_bytes, s->plan.buckets,
            (unsigned long long)s->plan.bucket_bytes);
  return rc;
}

int fr_refit_unsealed(ferry_refit_sender *s) {
  pthread_mutex_lock(&s->lock);
  uint32_t n = s->since_seal_count;
  char first[FR_REFIT_NAME_MAX + 1];
  fr_str_copy(first, sizeof first, s->since_seal);
  pthread_mutex_unlock(&s->lock);
  if (n == 0)
    return fr_err(FERRY_ESTATE, "refit '%s': seal before pushing", s->name);
  if (n == 1)
    return fr_err(FERRY_ESTATE, "refit '%s': tensor '%s' declared since the last seal: seal again",
                  s->name, first);
  return fr_err(FERRY_ESTATE,
                "refit '%s': tensor '%s' (and %u more declarations) declared since the last seal: "
                "seal again",
                s->name, first, n - 1);
}

size_t ferry_refit_receivers(ferry_refit_sender *s) {
  size_t n = 0;
  pthread_mutex_lock(&s->lock);
  for (receiver *r = s->receivers; r; r = r->next)
    n += !r->dropped && ferry_link_status(r->link) == 0;
  pthread_mutex_unlock(&s->lock);
  return n;
}

/* Also a sender whose open failed halfway (ferry_refit_sender_open fails through here): each
 * part it lacks is NULL, or a job that never ran, and is skipped. */
void ferry_refit_sender_close(ferry_refit_sender *s) {
  if (!s)
    return;
  fr_refit_stats_stop(s);
  pthread_mutex_lock(&s->lock); /* a catch-up's checksum being taken stops at its next chunk */
  fr_refit_buf_moves(s);
  s->bar_sums++;
  pthread_mutex_unlock(&s->lock);
  fr_job_stop(s->service); /* messages that came after the thread stopped are dropped */
  fr_refit_out_free(&s->svc_out);
  fr_refit_packer_stop(s->packer);
  fr_refit_unpublish(s->published);
  while (s->receivers) {
    receiver *r = s->receivers;
    s->receivers = r->next;
    fr_refit_receiver_free(r);
  }
  free_buffers(s);
  fr_cuda_stager_close(s->stager);
  fr_cuda_stager_close(s->sum_stager);
  if (s->scratch_pinned)
    fr_cuda_unpin(s->pin_device, s->scratch);
  free(s->scratch);
  fr_refit_plan_free(&s->plan);
  free(s->src);
  free(s->last_sum);
  free(s->sum_known);
  free(s->stream.sent);
  free(s->manifest);
  free(s->name);
  pthread_mutex_destroy(&s->lock);
  pthread_cond_destroy(&s->cond);
  free(s);
}
