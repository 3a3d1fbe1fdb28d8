/*
 * The refit receiver: attaches to a sender (one call that returns the manifest), binds
 * destinations, and runs a service thread that reads each announced bucket from where the
 * announcement says (the sender's buffer, or its chain predecessor's forwarding slot; over shm
 * one memcpy, over tcp one read), verifies its checksum, puts each tensor's part where it is
 * bound, keeps it for its chain successor when asked, and commits a version only when every
 * bucket of it verified. In alias mode it reads nothing: views point into the sender's buffer.
 * The bytes it holds are the committed version's only until a new version's first byte lands
 * there; from then until that version commits they are torn, and committed()/wait() say so.
 * A receiver that binds shards (bind_pieces: slices of tensors, fused targets) declares them to
 * the sender and reads only their runs, each checked against a sum the sender takes of exactly
 * those bytes (shard.h).
 *
 * The receiver's service thread is a job (transport/job.h) owning its context's
 * FR_CHANNEL_REFIT_RECEIVER, where its sender writes: asleep until a message comes, a link of the
 * context dies (it then wakes ferry_refit_wait, which sees a sender that is gone without polling
 * its link), or close stops it; a close from one of its callbacks is reaped by the job once the
 * callback returned (service_reap). The sender's records go the other
 * way on FR_CHANNEL_REFIT_SENDER, owned by a sender on that context if it has one: one receiver
 * and one sender per context (a second receiver gets FERRY_EBUSY), and neither sees the other's
 * messages.
 *
 * Bound destinations may be CUDA memory (ferry_refit_bind, bind_pieces): each is classified once,
 * when bound. Bytes reach this process in host memory either way (a memcpy from the sender's
 * mapping over shm, a read over tcp, into the stage, pinned then), are hashed there, and are
 * copied host→device by the copy engine: a bucket is read whole then, and each tensor's part of
 * it goes in one copy. The flat buffer is host memory; alias mode views the sender's buffer,
 * which is device memory mapped through CUDA IPC when the sender keeps it on a device (then its
 * views are device addresses), and bound destinations beside either are refused.
 *
 * This file holds attaching, open and close, the service thread's job, and the versions
 * (committed() and wait(), catching up); the other parts are their own files, sharing the
 * receiver's state through receiver_impl.h: binding (receiver_bind.c), CUDA destinations
 * (receiver_cuda.c), shards (receiver_shards.c) and reading a push (receiver_read.c).
 *
 * A name that no single sender holds but whose rank 0 is published (NAME#0) is a sender group
 * (group_rx.h): the receiver returned is the group's, and each call here hands over to it. Its
 * sub-receivers, one per rank, are receivers as above opened by fr_refit_rx_sub_open, their
 * threads jobs of no channel that the group's channel feeds.
 */
#include "refit/group_rx.h"
#include "refit/receiver_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

uint64_t fr_refit_stat_forwarded;
uint64_t fr_refit_stat_direct;

/* ---- the service thread's callbacks (transport/job.h) ---- */

/* A link of the context died: the sender's, maybe (or another: rare; the wait only looks
 * again), so ferry_refit_wait looks again. */
static void service_link_down(void *arg) {
  ferry_refit_receiver *r = arg;
  pthread_mutex_lock(&r->lock);
  pthread_cond_broadcast(&r->cond);
  pthread_mutex_unlock(&r->lock);
}

static void receiver_free(ferry_refit_receiver *r);

/* Closed from a callback on the service thread: freed there once that callback returned. */
static void service_reap(void *arg) { receiver_free(arg); }

static const fr_job_ops service_ops = {
    .on_msg = fr_refit_rx_service_msg, .on_link_down = service_link_down, .on_reap = service_reap};

/* ---- attach ---- */

/* Asks the sender for its manifest, bucket buffers and latest version. */
int fr_refit_rx_fetch_manifest(ferry_refit_receiver *r, int timeout_ms, fr_refit_plan *plan) {
  uint8_t type[4] = {FR_REFIT_ATTACH, 0, 0, 0};
  const char *me = ferry_ctx_address(r->ctx); /* where a chain successor would read from */
  struct iovec iov[2] = {{type, sizeof type}, {(void *)me, strlen(me)}};
  ferry_msg *reply;
  int rc = ferry_call(r->link, FR_REFIT_TO_SENDER, iov, 2, &reply, timeout_ms);
  if (rc != 0)
    return fr_err_wrap(rc, "refit: attach to '%s'", ferry_link_peer(r->link));
  fr_refit_attach_reply a;
  rc = fr_refit_attach_decode(reply->data, reply->len, &a);
  if (rc == 0 && a.status != 0)
    rc = fr_err(a.status, "refit: the sender '%s' refused (%s)", ferry_link_peer(r->link),
                a.status == FERRY_ESTATE ? "not sealed yet" : ferry_strerror(a.status));
  if (rc == 0)
    rc = fr_refit_manifest_decode(a.manifest, a.manifest_len, plan);
  if (rc == 0) {
    r->alias_ref = a.alias;
    pthread_mutex_lock(&r->lock); /* committed() and wait() read it on the caller's thread */
    if (a.latest > r->latest_known)
      r->latest_known = a.latest;
    pthread_mutex_unlock(&r->lock);
  }
  ferry_msg_free(reply);
  return rc;
}

static int attach(ferry_refit_receiver *r, const char *address, int timeout_ms) {
  char *resolved = NULL;
  int rc = strstr(address, "://") ? 0 : fr_refit_resolve(r->ctx, address, timeout_ms, &resolved);
  if (rc == 0)
    rc = ferry_connect(r->ctx, resolved ? resolved : address, timeout_ms, &r->link);
  free(resolved);
  if (rc == 0 && r->of) /* the group routes this link's messages here from now on */
    fr_group_rx_linked(r->of, r);
  if (rc == 0)
    rc = fr_refit_rx_fetch_manifest(r, timeout_ms, &r->plan);
  if (rc == 0) {
    size_t n = r->plan.count ? r->plan.count : 1;
    r->bound = calloc(n, sizeof *r->bound);
    r->bound_desc = calloc(n, sizeof *r->bound_desc);
    r->bound_dev = calloc(n, sizeof *r->bound_dev);
    r->stage = fr_refit_rx_stage_alloc(r->plan.bucket_bytes);
    r->got = calloc(r->plan.buckets ? r->plan.buckets : 1, 1);
    if (!r->bound || !r->bound_desc || !r->bound_dev || !r->stage || !r->got)
      rc = fr_err(FERRY_ENOMEM, "refit: receiver buffers");
  }
  return rc;
}

static void receiver_free(ferry_refit_receiver *r) {
  fr_stats_remove(fr_ctx_stats(r->ctx), r);
  if (r->of) /* a group's: its link's messages are routed here no more */
    fr_group_rx_unlinked(r->of, r);
  ferry_link_close(r->up);
  ferry_link_close(r->link);
  if (r->flat)
    ferry_free(r->ctx, r->flat);
  if (r->fwd)
    ferry_free(r->ctx, r->fwd);
  free(r->up_address);
  free(r->got);
  fr_refit_plan_free(&r->plan);
  free(r->bound);
  free(r->bound_desc);
  free(r->bound_dev);
  fr_refit_rx_stage_free(r->stage, r->stage_pin);
  for (uint32_t i = 0; i < r->ntargets; i++)
    fr_refit_rx_target_free(&r->targets[i]);
  free(r->targets);
  fr_refit_view_free(r->view);
  free(r->dev_ranges);
  pthread_mutex_destroy(&r->lock);
  pthread_mutex_destroy(&r->bind_lock);
  pthread_cond_destroy(&r->cond);
  free(r);
}

/* The receiver's series: its service thread's time by phase, and the buckets it took (a group's
 * sub-receivers each by rank). Reads relaxed counters only. */
static void collect(void *arg, fr_stats_out *out) {
  ferry_refit_receiver *r = arg;
  static const char *const phases[FR_RX_PHASES] = {"wait", "copy", "ack"};
  char rank[16];
  snprintf(rank, sizeof rank, "%u", r->rank);
  for (int i = 0; i < FR_RX_PHASES; i++)
    fr_stat_counter(out, "ferry_refit_receiver_phase_seconds_total",
                    "A receiver's time by phase: wait (for the next bucket of a version after "
                    "acknowledging one), copy (reading and placing a bucket), ack (sending its "
                    "acknowledgement)",
                    (double)fr_counted(&r->phase_ns[i]) * 1e-9, "rank", rank, "phase", phases[i],
                    NULL);
  fr_stat_counter(out, "ferry_refit_receiver_buckets_total", "Buckets announced to a receiver",
                  (double)fr_counted(&r->buckets_taken), "rank", rank, NULL);
}

static ferry_refit_receiver *receiver_new(ferry_ctx *ctx) {
  ferry_refit_receiver *r = calloc(1, sizeof *r);
  if (!r)
    return NULL;
  r->ctx = ctx;
  r->stage_pin = -1;
  pthread_mutex_init(&r->lock, NULL);
  pthread_mutex_init(&r->bind_lock, NULL);
  fr_cond_init_monotonic(&r->cond);
  if (fr_stats_add(fr_ctx_stats(ctx), collect, NULL, r) != 0) { /* ENOMEM */
    receiver_free(r);
    return NULL;
  }
  return r;
}

/* Attaches r (its job opened, not running) and starts its thread (`run`: a group starts a
 * sub-receiver's once it bound it); on failure frees r. */
static int start(ferry_refit_receiver *r, const char *address, int timeout_ms, int rc, bool run) {
  if (rc == 0)
    rc = attach(r, address, fr_timeout(timeout_ms));
  if (rc == 0 && run)
    rc = fr_job_run(r->job);
  if (rc != 0) {
    fr_err_keep keep;
    fr_err_save(&keep, rc);
    fr_job_stop(r->job); /* a job that never ran: the channel closes, what came is dropped */
    receiver_free(r);
    return fr_err_restore(&keep);
  }
  return 0;
}

/* A bare name that no single sender holds may be a group's: its rank 0 published as NAME#0.
 * Returns 1 for a single sender, *resolved its address (malloc'd). */
static int open_group(ferry_ctx *ctx, const char *name, int timeout_ms, char **resolved,
                      ferry_refit_receiver **out) {
  int rc = fr_refit_resolve(ctx, name, timeout_ms, resolved);
  if (rc != FERRY_ENOTFOUND)
    return rc == 0 ? 1 : rc;
  fr_err_keep keep;
  fr_err_save(&keep, rc);
  char *rank0 = NULL;
  if (fr_refit_resolve_rank(ctx, name, 0, timeout_ms, &rank0) != 0)
    return fr_err_restore(&keep); /* neither: the error names NAME */
  rc = fr_group_rx_open(ctx, name, rank0, timeout_ms, out);
  free(rank0);
  return rc;
}

int ferry_refit_receiver_open(ferry_ctx *ctx, const char *address, int timeout_ms,
                              ferry_refit_receiver **out) {
  if (!ctx || !address || !out)
    return fr_err(FERRY_EINVAL, "ferry_refit_receiver_open: NULL argument");
  char *resolved = NULL;
  if (!strstr(address, "://")) {
    int rc = open_group(ctx, address, fr_timeout(timeout_ms), &resolved, out);
    if (rc <= 0)
      return rc;
  }
  ferry_refit_receiver *r = receiver_new(ctx);
  if (!r) {
    free(resolved);
    return fr_err(FERRY_ENOMEM, "refit receiver");
  }
  /* the channel is ours before the sender knows us; the thread starts once attached */
  int rc = fr_job_open(ctx, FR_CHANNEL_REFIT_RECEIVER, &service_ops, r, "ferry-refit-rx", &r->job);
  if (rc == FERRY_EBUSY)
    rc = fr_err(rc, "ferry_refit_receiver_open: this context has a refit receiver already");
  rc = start(r, resolved ? resolved : address, timeout_ms, rc, true);
  free(resolved);
  if (rc == 0)
    *out = r;
  return rc;
}

/* A sub-receiver's thread serves what the group's channel hands it (group_rx.c routes by link). */
static const fr_job_ops sub_ops = {.on_msg = fr_refit_rx_service_msg, .on_reap = service_reap};

int fr_refit_rx_sub_open(ferry_ctx *ctx, struct fr_group_rx *g, uint32_t rank, const char *address,
                         int timeout_ms, ferry_refit_receiver **out) {
  ferry_refit_receiver *r = receiver_new(ctx);
  if (!r)
    return fr_err(FERRY_ENOMEM, "refit receiver of rank %u", rank);
  r->of = g;
  r->rank = rank;
  int rc = fr_job_open(ctx, FR_JOB_NO_CHANNEL, &sub_ops, r, "ferry-refit-rk", &r->job);
  rc = start(r, address, timeout_ms, rc, false);
  if (rc == 0)
    *out = r;
  return rc;
}

/* A goodbye is a courtesy (the sender also notices the link's end): a sender that does not read
 * costs close no more than this. */
#define DETACH_SEND_MS 1000

void ferry_refit_receiver_close(ferry_refit_receiver *r) {
  if (!r)
    return;
  if (r->group) {
    fr_group_rx_close(r->group);
    return;
  }
  fr_refit_msg_t bye = {.type = FR_REFIT_DETACH};
  fr_refit_send(r->link, FR_REFIT_TO_SENDER, &bye, DETACH_SEND_MS);
  if (fr_job_stop(r->job)) /* else from a callback: freed by service_reap once it returned */
    receiver_free(r);
}

size_t ferry_refit_ranks(ferry_refit_receiver *r) {
  return !r ? 0 : r->group ? fr_group_rx_ranks(r->group) : 1;
}

/* ---- versions ---- */

/* Late join: a receiver whose bytes are not the latest version it knows of (it attached after
 * that version was pushed, or a push failed for it) asks the sender once per version to send it
 * that version now, rather than wait for the next push. Only once something is bound: the
 * version must land where the engine looks. Decided under r->lock (returns the version to ask
 * for, 0: none); the caller asks (ask()) once it has released the lock. */
static uint64_t maybe_catch_up(ferry_refit_receiver *r) {
  uint64_t have = r->torn_by ? 0 : r->committed;
  if (r->latest_known <= have || r->asked >= r->latest_known ||
      !__atomic_load_n(&r->bound_any, __ATOMIC_ACQUIRE))
    return 0;
  r->asked = r->latest_known;
  return r->asked;
}

/* Sent with a bound: a sender that does not read costs the caller no more. */
#define CATCHUP_ASK_MS 1000

static void ask(ferry_refit_receiver *r, uint64_t version) {
  fr_refit_msg_t m = {.type = FR_REFIT_CATCHUP, .version = version};
  if (fr_refit_send(r->link, FR_REFIT_TO_SENDER, &m, CATCHUP_ASK_MS) != 0)
    fr_warn("refit: cannot ask '%s' for version %llu: %s", ferry_link_peer(r->link),
            (unsigned long long)version, ferry_last_error());
}

uint64_t ferry_refit_committed(ferry_refit_receiver *r) {
  if (!r)
    return 0;
  if (r->group)
    return fr_group_rx_committed(r->group);
  pthread_mutex_lock(&r->lock);
  uint64_t asking = maybe_catch_up(r);
  uint64_t v = r->torn_by ? 0 : r->committed;
  pthread_mutex_unlock(&r->lock);
  if (asking)
    ask(r, asking);
  return v;
}

int ferry_refit_wait(ferry_refit_receiver *r, uint64_t version, int timeout_ms,
                     uint64_t *committed) {
  if (!r)
    return fr_err(FERRY_EINVAL, "ferry_refit_wait: NULL receiver");
  if (r->group)
    return fr_group_rx_wait(r->group, version, timeout_ms, committed);
  /* A version lands only where something is bound: waiting for one before that would either
   * time out with no hint (a late joiner) or "commit" a version whose bytes are nowhere. */
  if (!__atomic_load_n(&r->bound_any, __ATOMIC_ACQUIRE))
    return fr_err(FERRY_ESTATE,
                  "refit receiver of '%s': nothing is bound: call ferry_refit_bind, "
                  "ferry_refit_bind_flat or ferry_refit_bind_alias first (Python: tensors(), "
                  "bind() or bind_alias())",
                  ferry_link_peer(r->link));
  uint64_t deadline = fr_deadline_ns(fr_timeout(timeout_ms));
  pthread_mutex_lock(&r->lock);
  uint64_t target = version ? version : (r->latest_known ? r->latest_known : 1);
  int gone = 0;
  for (;;) {
    uint64_t asking = maybe_catch_up(r);
    if (asking) { /* not under the lock: the service thread takes it as versions land */
      pthread_mutex_unlock(&r->lock);
      ask(r, asking);
      pthread_mutex_lock(&r->lock);
    }
    if (!r->torn_by && r->committed >= target)
      break;
    if ((gone = ferry_link_status(r->link)) != 0)
      break; /* no sender: nothing will land */
    if (fr_now_ns() >= deadline)
      break;
    /* woken by a commit, a drop, or the service thread when a link died (service_link_down);
     * nothing else to look at until the deadline */
    struct timespec ts = fr_timespec(deadline);
    pthread_cond_timedwait(&r->cond, &r->lock, &ts);
  }
  uint64_t have = r->torn_by ? 0 : r->committed, torn_by = r->torn_by, last = r->committed;
  char why[sizeof r->why];
  fr_str_copy(why, sizeof why, r->why);
  pthread_mutex_unlock(&r->lock);
  if (committed)
    *committed = have;
  if (have >= target && !torn_by)
    return 0;
  char state[160];
  if (torn_by)
    snprintf(state, sizeof state,
             "the bytes are torn: version %llu began landing over %llu and did not complete",
             (unsigned long long)torn_by, (unsigned long long)last);
  else
    snprintf(state, sizeof state, "have %llu", (unsigned long long)have);
  if (gone)
    return fr_err(FERRY_EPEER,
                  "refit: version %llu not committed, the sender '%s' is gone (%s)%s%s",
                  (unsigned long long)target, ferry_link_peer(r->link), state,
                  *why ? "; last failure: " : "", why);
  return fr_err(FERRY_ETIMEDOUT, "refit: version %llu not committed in time (%s)%s%s",
                (unsigned long long)target, state, *why ? "; last failure: " : "", why);
}
