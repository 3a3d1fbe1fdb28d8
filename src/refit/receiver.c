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
 */
#include "core/cuda.h"
#include "refit/refit.h"
#include "refit/shard.h"
#include "transport/job.h"
#include "transport/wire.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ferry_refit_receiver {
  ferry_ctx *ctx;
  ferry_link *link;
  fr_refit_plan plan;
  void **bound;                  /* per tensor: the caller's destination, or NULL */
  ferry_tensor_desc *bound_desc; /* and how the caller described it */
  int *bound_dev;                /* and its CUDA device, -1 for host memory */
  uint32_t dev_bound;            /* how many bound[] are device memory (bind_lock) */
  int stage_pin;                 /* the device whose context pinned the stage (fr_cuda_pin: a
                                    device this receiver copies to), or -1: not pinned */
  uint8_t *flat;                 /* ferry_alloc'd flat buffer, or NULL */
  const uint8_t *alias;          /* the sender's wire buffer, mapped (alias mode), or NULL */
  ferry_region_ref alias_ref;    /* the sender's wire buffer, if it keeps one */
  uint8_t *stage;
  uint8_t *fwd;     /* two forwarding slots for a chain successor (ferry_alloc'd), or NULL */
  ferry_link *up;   /* to the chain predecessor, or NULL */
  char *up_address; /* where the sender said the predecessor is */
  uint8_t *got;     /* per bucket: verified in the version arriving */
  ferry_refit_bucket_fn on_bucket; /* these four under bind_lock */
  void *on_bucket_arg;
  ferry_refit_commit_fn on_commit;
  void *on_commit_arg;
  uint32_t bind_epoch;      /* bumped when a destination is bound (under bind_lock) */
  uint32_t committed_epoch; /* bind_epoch when the last version committed */
  uint64_t missed;          /* a version a destination bound mid-way missed buckets of */
  uint64_t unheld; /* a version sent with buckets flagged unchanged (the sender skips what the
                      last commit holds) while a destination bound since then lacks them */

  pthread_mutex_t bind_lock; /* bound, flat: held by the service thread while a bucket lands */
  pthread_mutex_t lock;      /* the versions below */
  pthread_cond_t cond;
  uint64_t committed, latest_known;
  uint64_t torn_by;   /* 0, or the version whose bytes began landing over `committed` and did not
                         complete: the bytes are then neither version (committed() says 0) */
  uint64_t receiving; /* version whose buckets are arriving */
  uint32_t verified;
  int failure;
  bool bound_any; /* something is bound (a tensor, flat, alias): a catch-up has somewhere to land */
  uint64_t asked; /* the latest version this receiver asked to catch up to (late join) */
  char why[256];  /* what the last failed version went wrong on, for wait()'s error */
  fr_job *job;    /* the service thread, owning FR_CHANNEL_REFIT_RECEIVER (transport/job.h) */

  /* shards (ferry_refit_bind_pieces): once any is bound, every binding is a target, declared to
   * the sender, and only the runs of the view built from them are read (bind_lock) */
  bool shards;
  struct rx_target {
    char *name;
    ferry_tensor_desc desc;
    int device;     /* of dst: a CUDA device, or -1 for host memory */
    char **sources; /* the pieces' source names (pieces name them by index in the manifest) */
    fr_refit_target t;
  } * targets;
  uint32_t ntargets;
  uint32_t serial;     /* of the last VIEW record sent */
  fr_refit_view *view; /* built from the targets at `serial`, or NULL (built when needed) */
  struct dev_range {
    uintptr_t lo, hi;
    int device;
  } * dev_ranges;      /* the device targets' memory, sorted (built with the view) */
  size_t ndev_ranges;  /* 0: every target is host memory */
  uint64_t bytes_read; /* atomic: bytes read from the sender or a predecessor, all told */
};

uint64_t fr_refit_stat_forwarded;
uint64_t fr_refit_stat_direct;

static int fetch_manifest(ferry_refit_receiver *r, int timeout_ms, fr_refit_plan *plan);
static int alias_map(ferry_refit_receiver *r);
static int binding_fits(const fr_refit_entry *e, const ferry_tensor_desc *desc);
static void new_destination(ferry_refit_receiver *r, uint64_t lo, uint64_t len);
static void tell_commit(ferry_refit_receiver *r, uint64_t version, int status);
static void receiver_free(ferry_refit_receiver *r);

/* ---- CUDA destinations ---- */

/* Where a destination of `bytes` lives: its CUDA device, or -1 for host memory. FERRY_EINVAL
 * when device memory does not hold all of it (the copies are bounded by the allocation). Not
 * under a lock: the first call may load the driver. */
static int where_bound(const char *name, const void *dst, const ferry_tensor_desc *desc,
                       int *device) {
  fr_mem_where w = fr_cuda_where(dst);
  *device = w.kind == FERRY_MEM_CUDA ? w.device : -1;
  uint64_t bytes = 0;
  if (*device < 0 || ferry_tensor_nbytes(desc, &bytes) != 0)
    return 0; /* a bad desc is reported with the binding's other checks */
  if (bytes > fr_cuda_room(&w, dst))
    return fr_err(FERRY_EINVAL,
                  "refit: '%s' (%llu bytes) runs past the end of its CUDA allocation on device %d",
                  name, (unsigned long long)bytes, *device);
  return 0;
}

/* The flat buffer and alias mode hold every tensor themselves: a device destination beside
 * them would never be written. */
static int host_only(const ferry_refit_receiver *r, const char *name) {
  return fr_err(FERRY_ENOTSUP,
                "refit: '%s' is CUDA memory, but this receiver is bound to %s, which holds every "
                "tensor itself; bind device tensors with ferry_refit_bind alone (or use the "
                "alias views: device memory when the sender keeps its buffer on a device)",
                name,
                r->flat ? "a flat buffer (ferry_refit_bind_flat)" : "the sender's buffer (alias)");
}

/* The stage a bucket passes through: page-aligned and page-sized, so that it can be pinned. */
static uint64_t stage_bytes(uint64_t bucket) { return (bucket + 4095) & ~(uint64_t)4095; }
static uint8_t *stage_alloc(uint64_t bucket) { return aligned_alloc(4096, stage_bytes(bucket)); }
static void stage_free(uint8_t *stage, int pinned_on) {
  if (pinned_on >= 0)
    fr_cuda_unpin(pinned_on, stage);
  free(stage);
}

/* A device this receiver copies to: a bound tensor's or a shard target's (-1: none). */
static int some_device(const ferry_refit_receiver *r) {
  for (uint32_t i = 0; r->bound_dev && i < r->plan.count; i++)
    if (r->bound_dev[i] >= 0)
      return r->bound_dev[i];
  for (uint32_t i = 0; i < r->ntargets; i++)
    if (r->targets[i].name && r->targets[i].device >= 0)
      return r->targets[i].device;
  return -1;
}

/* Once a destination is device memory the stage is pinned, in that device's context, so that
 * the host→device copies from it run at the copy engine's speed (a failure only costs that).
 * bind_lock held. */
static void pin_stage(ferry_refit_receiver *r) {
  int device = some_device(r);
  if (r->stage_pin >= 0 || !r->stage || device < 0)
    return;
  if (fr_cuda_pin(device, r->stage, stage_bytes(r->plan.bucket_bytes)) == 0)
    r->stage_pin = device;
  else
    fr_warn("refit: receive stage not pinned, device copies run slower: %s", ferry_last_error());
}

/* A shard run's destination: the device of the target holding it, or -1 (host memory). */
static int run_device(const ferry_refit_receiver *r, const uint8_t *dst) {
  size_t lo = 0, hi = r->ndev_ranges;
  uintptr_t a = (uintptr_t)dst;
  while (lo < hi) { /* the ranges are disjoint and sorted: the first that ends past a */
    size_t mid = lo + (hi - lo) / 2;
    if (r->dev_ranges[mid].hi <= a)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < r->ndev_ranges && r->dev_ranges[lo].lo <= a ? r->dev_ranges[lo].device : -1;
}

/* Runs' bytes on their way out of the stage (or a landed bucket). Host runs are memcpy'd; runs
 * into a device target are merged while they continue one another at both ends (a slice along
 * dim 1 lands row after row), so a stretch costs one copy; copy_done issues the last one. */
typedef struct rx_copy {
  uint8_t *dst;
  const uint8_t *src;
  uint64_t len;
  int device;
} rx_copy;

static int copy_done(rx_copy *c) {
  int rc = c->len ? fr_cuda_copy_on(c->device, c->dst, c->src, c->len) : 0;
  c->len = 0;
  return rc ? fr_err_wrap(rc, "refit: a shard into CUDA device %d", c->device) : 0;
}

static int put_run(const ferry_refit_receiver *r, rx_copy *c, uint8_t *dst, const uint8_t *src,
                   uint64_t len) {
  int device = r->ndev_ranges ? run_device(r, dst) : -1;
  if (device < 0) {
    memcpy(dst, src, len);
    return 0;
  }
  if (c->len && c->device == device && c->dst + c->len == dst && c->src + c->len == src) {
    c->len += len;
    return 0;
  }
  int rc = copy_done(c);
  *c = (rx_copy){dst, src, len, device};
  return rc;
}

static int range_cmp(const void *a, const void *b) {
  const struct dev_range *x = a, *y = b;
  return (x->lo > y->lo) - (x->lo < y->lo);
}

/* The device targets' memory, sorted and merged (two targets may share bytes), for run_device.
 * bind_lock held. */
static int build_dev_ranges(ferry_refit_receiver *r) {
  free(r->dev_ranges);
  r->dev_ranges = NULL;
  r->ndev_ranges = 0;
  size_t n = 0, k = 0;
  for (uint32_t i = 0; i < r->ntargets; i++)
    n += r->targets[i].name && r->targets[i].device >= 0;
  if (n == 0)
    return 0;
  struct dev_range *v = malloc(n * sizeof *v);
  if (!v)
    return fr_err(FERRY_ENOMEM, "refit: %zu device targets", n);
  n = 0;
  for (uint32_t i = 0; i < r->ntargets; i++) {
    const struct rx_target *t = &r->targets[i];
    uint64_t bytes = 0;
    if (t->name && t->device >= 0 && ferry_tensor_nbytes(&t->desc, &bytes) == 0)
      v[n++] = (struct dev_range){(uintptr_t)t->t.dst, (uintptr_t)t->t.dst + bytes, t->device};
  }
  qsort(v, n, sizeof *v, range_cmp);
  for (size_t i = 0; i < n; i++) {
    if (k && v[i].lo < v[k - 1].hi)
      v[k - 1].hi = v[i].hi > v[k - 1].hi ? v[i].hi : v[k - 1].hi;
    else
      v[k++] = v[i];
  }
  r->dev_ranges = v;
  r->ndev_ranges = k;
  return 0;
}

/* ---- shards: targets, declarations, views (bind_lock held) ---- */

static void target_free(struct rx_target *t) {
  for (uint32_t i = 0; t->sources && i < t->t.npieces; i++)
    free(t->sources[i]);
  free(t->sources);
  free(t->t.pieces);
  free(t->name);
  memset(t, 0, sizeof *t);
}

/* Tells the sender target slot i's pieces (none: the slot is empty), under a new serial; a call,
 * so that once it returns the sender hashes these slices for the next push. */
static int declare(ferry_refit_receiver *r, uint32_t i) {
  const fr_refit_target *t = &r->targets[i].t;
  size_t len = (size_t)t->npieces * FR_REFIT_PIECE_BYTES;
  uint8_t *body = malloc(FR_REFIT_MSG_BYTES + len);
  if (!body)
    return fr_err(FERRY_ENOMEM, "refit: declaring target %u", i);
  fr_refit_msg_t m = {.type = FR_REFIT_VIEW,
                      .generation = r->plan.generation,
                      .seq = ++r->serial,
                      .bucket = i,
                      .bytes = t->npieces};
  fr_refit_msg_encode(&m, body);
  fr_refit_pieces_encode(t->pieces, t->npieces, body + FR_REFIT_MSG_BYTES);
  struct iovec iov = {body, FR_REFIT_MSG_BYTES + len};
  ferry_msg *reply = NULL;
  int rc = ferry_call(r->link, FR_REFIT_TO_SENDER, &iov, 1, &reply, -1);
  free(body);
  if (rc == 0)
    rc = reply->len == 4 ? (int)fr_get_u32(reply->data) : FERRY_EPROTO;
  ferry_msg_free(reply);
  fr_refit_view_free(r->view);
  r->view = NULL;
  const char *name = r->targets[i].name ? r->targets[i].name : "";
  if (rc == FERRY_ECAPACITY) /* the sender's reply is a status: say what it means here */
    return fr_err(rc,
                  "refit: the sender refused target '%s': this receiver's shards pass its limits "
                  "(at most %u runs, %u times the model's bytes, a %u-byte table); the target "
                  "stays bound and this receiver reads whole buckets",
                  name, FR_REFIT_VIEW_RUNS_MAX, FR_REFIT_VIEW_OVERLAP, FR_REFIT_TABLE_BYTES_MAX);
  return rc ? fr_err_wrap(rc, "refit: the sender did not take target '%s'", name) : 0;
}

/* Checks pieces [0, n) against the plan and the destination they fill one after another along
 * its dim 0, and resolves their sources; the error names the piece that does not fit. */
static int pieces_fit(const fr_refit_plan *plan, const char *target, const ferry_tensor_desc *desc,
                      char *const *sources, fr_refit_piece *pieces, uint32_t n) {
  char who[FR_REFIT_NAME_MAX * 2 + 128], have[96], want[96];
  uint64_t rows = 0;
  for (uint32_t i = 0; i < n; i++) {
    const fr_refit_piece *pc = &pieces[i];
    snprintf(who, sizeof who, "refit: target '%s' piece %u ('%s' dim %u [%llu:%llu])", target, i,
             sources[i], pc->dim, (unsigned long long)pc->start, (unsigned long long)pc->stop);
    int64_t e = fr_refit_plan_find(plan, sources[i]);
    if (e < 0)
      return fr_err(FERRY_ENOTFOUND, "%s: the sender sends no tensor '%s'", who, sources[i]);
    pieces[i].entry = (uint32_t)e;
    int rc = fr_refit_piece_check(plan, pc, who);
    if (rc != 0)
      return rc;
    ferry_tensor_desc ps;
    fr_refit_piece_shape(plan, pc, &ps);
    if (ps.dtype != desc->dtype)
      return fr_err(FERRY_EDTYPE, "%s arrives as %s, the target is %s", who,
                    ferry_dtype_name(ps.dtype), ferry_dtype_name(desc->dtype) ?: "?");
    bool fits =
        ps.ndim == desc->ndim && (ps.ndim == 0 ? n == 1
                                               : memcmp(ps.shape + 1, desc->shape + 1,
                                                        sizeof(uint64_t) * (ps.ndim - 1)) == 0);
    if (!fits)
      return fr_err(FERRY_ESHAPE, "%s is %s: it does not fit the target's %s along dim 0", who,
                    ferry_shape_format(&ps, have, sizeof have),
                    ferry_shape_format(desc, want, sizeof want));
    rows += ps.ndim ? ps.shape[0] : 1;
  }
  uint64_t need = desc->ndim ? desc->shape[0] : 1;
  if (rows != need)
    return fr_err(FERRY_ESHAPE, "refit: target '%s' is %s: its pieces fill %llu of its %llu rows",
                  target, ferry_shape_format(desc, want, sizeof want), (unsigned long long)rows,
                  (unsigned long long)need);
  return 0;
}

/* The slot of target `name`: its own, or a new one. */
static int target_slot(ferry_refit_receiver *r, const char *name, uint32_t *out) {
  uint32_t free_slot = r->ntargets;
  for (uint32_t i = 0; i < r->ntargets; i++) {
    if (r->targets[i].name && strcmp(r->targets[i].name, name) == 0) {
      *out = i;
      return 0;
    }
    if (!r->targets[i].name && free_slot == r->ntargets)
      free_slot = i;
  }
  if (free_slot == r->ntargets) {
    if (r->ntargets >= FR_REFIT_TARGETS_MAX)
      return fr_err(FERRY_ECAPACITY, "refit: more than %u targets", FR_REFIT_TARGETS_MAX);
    struct rx_target *t = realloc(r->targets, (r->ntargets + 1) * sizeof *t);
    if (!t)
      return fr_err(FERRY_ENOMEM, "refit: targets");
    memset(&t[r->ntargets], 0, sizeof *t);
    r->targets = t;
    r->ntargets++;
  }
  *out = free_slot;
  return 0;
}

/* Whether slot t already holds exactly this target: the same memory, laid out the same way, filled
 * from the same slices. Anything else (another rank's slice into the same buffer) is memory that
 * holds no version of what it now receives. */
static bool same_target(const struct rx_target *t, const void *dst, const ferry_tensor_desc *desc,
                        const fr_refit_piece *pieces, uint32_t n) {
  return t->t.dst == dst && t->t.npieces == n && t->desc.dtype == desc->dtype &&
         t->desc.ndim == desc->ndim &&
         memcmp(t->desc.shape, desc->shape, sizeof(uint64_t) * desc->ndim) == 0 &&
         memcmp(t->t.pieces, pieces, n * sizeof *pieces) == 0;
}

/* Records a checked target (pieces resolved) and declares it; `fresh`: memory the receiver did
 * not write before (not a whole binding turned into a target), which then holds no version. */
static int add_target(ferry_refit_receiver *r, const char *name, void *dst, int device,
                      const ferry_tensor_desc *desc, char *const *sources,
                      const fr_refit_piece *pieces, uint32_t n, bool fresh) {
  uint32_t slot = 0;
  int rc = target_slot(r, name, &slot);
  if (rc != 0)
    return rc;
  struct rx_target t = {.name = strdup(name), .desc = *desc, .device = device};
  t.sources = calloc(n, sizeof *t.sources);
  t.t.pieces = malloc(n * sizeof *t.t.pieces);
  t.t.dst = dst;
  bool ok = t.name && t.sources && t.t.pieces;
  for (uint32_t i = 0; ok && i < n; i++)
    ok = (t.sources[i] = strdup(sources[i])) != NULL;
  t.t.npieces = n;
  if (!ok) {
    target_free(&t);
    return fr_err(FERRY_ENOMEM, "refit: target '%s'", name);
  }
  memcpy(t.t.pieces, pieces, n * sizeof *pieces);
  bool moved = fresh && !same_target(&r->targets[slot], dst, desc, pieces, n);
  for (uint32_t i = 0; moved && i < n; i++)
    new_destination(r, r->plan.entries[pieces[i].entry].offset,
                    r->plan.entries[pieces[i].entry].wire_bytes);
  target_free(&r->targets[slot]);
  r->targets[slot] = t;
  __atomic_store_n(&r->bound_any, true, __ATOMIC_RELEASE);
  return declare(r, slot);
}

/* A whole tensor as a target of one piece: all of its dim 0. */
static fr_refit_piece whole_piece(const fr_refit_plan *plan, uint32_t e) {
  const fr_refit_entry *x = &plan->entries[e];
  return (fr_refit_piece){e, 0, 0, x->desc.ndim ? x->desc.shape[0] : 1};
}

/* The first shard binding: every tensor bound whole so far becomes a target too, since from now
 * on only the view's runs are read. */
static int enter_shards(ferry_refit_receiver *r) {
  if (r->shards)
    return 0;
  r->shards = true;
  for (uint32_t i = 0; i < r->plan.count; i++) {
    void *dst = r->bound[i];
    r->bound[i] = NULL;
    r->dev_bound -= dst && r->bound_dev[i] >= 0;
    fr_refit_piece pc = whole_piece(&r->plan, i);
    char *src = r->plan.entries[i].name;
    int rc = dst && r->plan.entries[i].wire_bytes
                 ? add_target(r, src, dst, r->bound_dev[i], &r->bound_desc[i], &src, &pc, 1, false)
                 : 0;
    if (rc != 0)
      return rc;
  }
  return 0;
}

/* The sender re-sealed: pieces name their sources again by index in the new manifest; a target
 * that no longer fits is unbound (the first such is the error), the others are declared again. */
static int retarget(ferry_refit_receiver *r) {
  int rc = 0;
  fr_refit_view_free(r->view);
  r->view = NULL;
  for (uint32_t i = 0; i < r->ntargets; i++) {
    struct rx_target *t = &r->targets[i];
    if (!t->name)
      continue;
    int fit = pieces_fit(&r->plan, t->name, &t->desc, t->sources, t->t.pieces, t->t.npieces);
    if (fit != 0) {
      fr_warn("%s (unbound: bind it again)", ferry_last_error());
      rc = rc ? rc : fit;
      target_free(t);
    } else if ((fit = declare(r, i)) != 0 && rc == 0) {
      rc = fit;
    }
  }
  return rc;
}

static int ensure_view(ferry_refit_receiver *r) {
  if (r->view && r->view->serial == r->serial)
    return 0;
  fr_refit_view_free(r->view);
  r->view = NULL;
  fr_refit_target *ts = calloc(r->ntargets ? r->ntargets : 1, sizeof *ts);
  if (!ts)
    return fr_err(FERRY_ENOMEM, "refit: shard view");
  for (uint32_t i = 0; i < r->ntargets; i++)
    ts[i] = r->targets[i].t;
  int rc = fr_refit_view_build(&r->plan, ts, r->ntargets, r->serial, &r->view);
  free(ts);
  return rc ? rc : build_dev_ranges(r);
}

/* ---- receiving a push (service thread) ---- */

/* The sender re-sealed: take its new manifest, carry every binding that still fits over by
 * name, and fail (naming the tensor) for one that does not; that tensor stays unbound until the
 * engine binds it again. A flat buffer is laid out anew (views move: fetch them again). */
static int install_manifest(ferry_refit_receiver *r, fr_refit_plan plan) {
  int rc = 0;
  size_t n = plan.count ? plan.count : 1;
  void **bound = calloc(n, sizeof *bound);
  ferry_tensor_desc *descs = calloc(n, sizeof *descs);
  int *devs = calloc(n, sizeof *devs);
  uint8_t *stage = stage_alloc(plan.bucket_bytes);
  uint32_t dev_bound = 0;
  if (!bound || !descs || !devs || !stage) {
    free(bound), free(descs), free(devs), free(stage);
    fr_refit_plan_free(&plan);
    return fr_err(FERRY_ENOMEM, "refit: new manifest");
  }
  for (uint32_t i = 0; i < r->plan.count; i++) {
    int64_t j = r->bound[i] ? fr_refit_plan_find(&plan, r->plan.entries[i].name) : -1;
    int fit = j < 0 ? 0 : binding_fits(&plan.entries[j], &r->bound_desc[i]);
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
  if (r->alias && alias_map(r) != 0 && rc == 0)
    rc = fr_err_wrap(FERRY_ENOTSUP, "refit: cannot map the sender's new buffer");
  if (r->fwd && plan.bucket_bytes != r->plan.bucket_bytes) {
    ferry_free(r->ctx, r->fwd);
    r->fwd = NULL; /* allocated again, at the new size, when a successor needs it */
  }
  free(r->bound), free(r->bound_desc), free(r->bound_dev), free(r->got);
  stage_free(r->stage, r->stage_pin);
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
    pin_stage(r);
  fr_info("refit: manifest generation %u from '%s' (%u tensors)", plan.generation,
          ferry_link_peer(r->link), plan.count);
  int moved = r->shards ? retarget(r) : 0;
  return rc ? rc : moved;
}

static int refetch_manifest(ferry_refit_receiver *r) {
  fr_refit_plan plan;
  int rc = fetch_manifest(r, -1, &plan);
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
      rc = put_run(r, &c, v->runs[i + j].dst, at, v->runs[i + j].len);
    }
    if (rc == 0)
      rc = copy_done(&c); /* before the next batch overwrites the stage */
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
    rc = put_run(r, &c, v->runs[i].dst, *at + (v->runs[i].off - start), v->runs[i].len);
  return rc ? rc : copy_done(&c);
}

static int fetch_shards(ferry_refit_receiver *r, const fr_refit_msg_t *m, ferry_region_ref *kept,
                        uint64_t *kept_off) {
  int rc = ensure_view(r);
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

static void on_bucket(ferry_refit_receiver *r, const fr_refit_msg_t *m) {
  fr_refit_msg_t ack = {.type = FR_REFIT_ACK,
                        .version = m->version,
                        .bucket = m->bucket,
                        .seq = m->seq,
                        .flags = m->flags & FR_REFIT_KEEP};
  pthread_mutex_lock(&r->bind_lock); /* bind_alias sets r->alias under it */
  if (r->alias && !(m->flags & FR_REFIT_UNCHANGED))
    tear(r, m->version); /* the sender wrote this bucket into the buffer the engine reads */
  if (m->version != r->receiving)
    new_version(r, m->version);
  int rc = r->failure ? r->failure : take_bucket(r, m, &ack.src, &ack.src_offset);
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
  fr_refit_send(r->link, FR_REFIT_TO_SENDER, &ack, -1);
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

static void on_commit(ferry_refit_receiver *r, const fr_refit_msg_t *m) {
  int status = m->version != r->receiving && m->bytes > 0 ? FERRY_EPROTO
               : r->failure                               ? r->failure
               : r->verified != m->bytes                  ? FERRY_EPROTO
                                                          : 0;
  if (status == 0)
    status = rebound_midway(r, m);
  pthread_mutex_lock(&r->lock);
  if (status == 0) {
    r->committed = m->version;
    r->torn_by = 0;
  }
  if (m->version > r->latest_known)
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
  pthread_mutex_unlock(&r->bind_lock);
  fr_refit_msg_t done = {.type = FR_REFIT_COMMITTED, .version = m->version, .status = status};
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
  int rc = fetch_manifest(r, -1, &plan);
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

/* ---- the service thread's callbacks (transport/job.h) ---- */

static void service_msg(void *arg, ferry_msg *msg) {
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
    .on_msg = service_msg, .on_link_down = service_link_down, .on_reap = service_reap};

/* ---- attach ---- */

/* Asks the sender for its manifest, bucket buffers and latest version. */
static int fetch_manifest(ferry_refit_receiver *r, int timeout_ms, fr_refit_plan *plan) {
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
  char *resolved = NULL;
  int rc = strstr(address, "://") ? 0 : fr_refit_resolve(r->ctx, address, timeout_ms, &resolved);
  if (rc == 0)
    rc = ferry_connect(r->ctx, resolved ? resolved : address, timeout_ms, &r->link);
  free(resolved);
  if (rc == 0)
    rc = fetch_manifest(r, timeout_ms, &r->plan);
  if (rc == 0) {
    size_t n = r->plan.count ? r->plan.count : 1;
    r->bound = calloc(n, sizeof *r->bound);
    r->bound_desc = calloc(n, sizeof *r->bound_desc);
    r->bound_dev = calloc(n, sizeof *r->bound_dev);
    r->stage = stage_alloc(r->plan.bucket_bytes);
    r->got = calloc(r->plan.buckets ? r->plan.buckets : 1, 1);
    if (!r->bound || !r->bound_desc || !r->bound_dev || !r->stage || !r->got)
      rc = fr_err(FERRY_ENOMEM, "refit: receiver buffers");
  }
  return rc;
}

static void receiver_free(ferry_refit_receiver *r) {
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
  stage_free(r->stage, r->stage_pin);
  for (uint32_t i = 0; i < r->ntargets; i++)
    target_free(&r->targets[i]);
  free(r->targets);
  fr_refit_view_free(r->view);
  free(r->dev_ranges);
  pthread_mutex_destroy(&r->lock);
  pthread_mutex_destroy(&r->bind_lock);
  pthread_cond_destroy(&r->cond);
  free(r);
}

int ferry_refit_receiver_open(ferry_ctx *ctx, const char *address, int timeout_ms,
                              ferry_refit_receiver **out) {
  if (!ctx || !address || !out)
    return fr_err(FERRY_EINVAL, "ferry_refit_receiver_open: NULL argument");
  ferry_refit_receiver *r = calloc(1, sizeof *r);
  if (!r)
    return fr_err(FERRY_ENOMEM, "refit receiver");
  r->ctx = ctx;
  r->stage_pin = -1;
  pthread_mutex_init(&r->lock, NULL);
  pthread_mutex_init(&r->bind_lock, NULL);
  fr_cond_init_monotonic(&r->cond);
  /* the channel is ours before the sender knows us; the thread starts once attached */
  int rc = fr_job_open(ctx, FR_CHANNEL_REFIT_RECEIVER, &service_ops, r, "ferry-refit-rx", &r->job);
  if (rc == FERRY_EBUSY)
    rc = fr_err(rc, "ferry_refit_receiver_open: this context has a refit receiver already");
  if (rc == 0)
    rc = attach(r, address, fr_timeout(timeout_ms));
  if (rc == 0)
    rc = fr_job_run(r->job);
  if (rc != 0) {
    char detail[512];
    fr_str_copy(detail, sizeof detail, ferry_last_error());
    fr_job_stop(r->job); /* a job that never ran: the channel closes, what came is dropped */
    receiver_free(r);
    return fr_err(rc, "%s", detail);
  }
  *out = r;
  return 0;
}

/* A goodbye is a courtesy (the sender also notices the link's end): a sender that does not read
 * costs close no more than this. */
#define DETACH_SEND_MS 1000

void ferry_refit_receiver_close(ferry_refit_receiver *r) {
  if (!r)
    return;
  fr_refit_msg_t bye = {.type = FR_REFIT_DETACH};
  fr_refit_send(r->link, FR_REFIT_TO_SENDER, &bye, DETACH_SEND_MS);
  if (fr_job_stop(r->job)) /* else from a callback: freed by service_reap once it returned */
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

int ferry_refit_tensor_scale(ferry_refit_receiver *r, size_t i, float *scale) {
  if (!r || !scale)
    return fr_err(FERRY_EINVAL, "ferry_refit_tensor_scale: NULL argument");
  pthread_mutex_lock(&r->bind_lock);
  int rc = i < r->plan.count ? 0 : fr_err(FERRY_ENOTFOUND, "refit: no tensor %zu", i);
  if (rc == 0)
    *scale = r->plan.entries[i].scale;
  pthread_mutex_unlock(&r->bind_lock);
  return rc;
}

/* A destination just bound (the wire bytes [lo, lo+len) go there) holds no version: the
 * receiver holds none until a version lands whole (a catch-up when it next waits, or a push),
 * and a version landing now fails here if a bucket of those bytes already landed. bind_lock
 * held. */
static void new_destination(ferry_refit_receiver *r, uint64_t lo, uint64_t len) {
  r->bind_epoch++;
  const fr_refit_plan *p = &r->plan;
  for (uint64_t b = lo / p->bucket_bytes;
       r->receiving && len && b * p->bucket_bytes < lo + len && b < p->buckets; b++)
    if (r->got[b])
      r->missed = r->receiving; /* that bucket landed before the destination existed */
  pthread_mutex_lock(&r->lock);
  if (r->committed)
    fr_info("refit: a destination bound after version %llu committed; it is caught up",
            (unsigned long long)r->committed);
  r->committed = 0;
  r->asked = 0;
  pthread_mutex_unlock(&r->lock);
  __atomic_store_n(&r->bound_any, true, __ATOMIC_RELEASE);
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
  int device = -1;
  int rc = where_bound(name ? name : "", dst, desc, &device);
  if (rc != 0)
    return rc;
  uint32_t i = 0;
  pthread_mutex_lock(&r->bind_lock); /* the service thread may swap in a new manifest */
  rc = find(r, name, &i);
  if (rc == 0)
    rc = binding_fits(&r->plan.entries[i], desc);
  if (rc == 0 && device >= 0 && (r->flat || r->alias))
    rc = host_only(r, name);
  if (rc == 0 && device >= 0)
    pin_stage(r);
  if (rc == 0 && r->shards) { /* a target of one piece: the whole tensor */
    fr_refit_piece pc = whole_piece(&r->plan, i);
    char *src = r->plan.entries[i].name;
    rc = r->plan.entries[i].wire_bytes ? add_target(r, name, dst, device, desc, &src, &pc, 1, true)
                                       : 0;
    pthread_mutex_unlock(&r->bind_lock);
    return rc;
  }
  if (rc == 0 && r->bound[i] != dst)
    new_destination(r, r->plan.entries[i].offset, r->plan.entries[i].wire_bytes);
  if (rc == 0) {
    r->dev_bound -= r->bound[i] && r->bound_dev[i] >= 0;
    r->dev_bound += device >= 0;
    r->bound[i] = dst;
    r->bound_desc[i] = *desc;
    r->bound_dev[i] = device;
  }
  pthread_mutex_unlock(&r->bind_lock);
  return rc;
}

/* The flat buffer and alias mode hold every tensor themselves: with a tensor bound to device
 * memory they would leave it unwritten. bind_lock held. */
static int no_device_bound(const ferry_refit_receiver *r, const char *mode) {
  return r->dev_bound ? fr_err(FERRY_ENOTSUP,
                               "refit: %u bound tensors are CUDA memory, and %s holds every "
                               "tensor itself; bind device tensors with ferry_refit_bind alone",
                               r->dev_bound, mode)
                      : 0;
}

int ferry_refit_bind_flat(ferry_refit_receiver *r) {
  if (!r)
    return fr_err(FERRY_EINVAL, "ferry_refit_bind_flat: NULL receiver");
  if (r->plan.total_bytes == 0)
    return fr_err(FERRY_ESTATE, "refit: the manifest is empty");
  pthread_mutex_lock(&r->bind_lock);
  void *flat = r->flat;
  int rc = r->alias    ? fr_err(FERRY_ESTATE, "refit: already bound in alias mode")
           : r->shards ? fr_err(FERRY_ESTATE, "refit: shards are bound; a flat buffer would "
                                              "receive every byte")
                       : no_device_bound(r, "a flat buffer");
  if (rc == 0 && !flat) {
    rc = ferry_alloc(r->ctx, r->plan.total_bytes, &flat);
    if (rc == 0)
      new_destination(r, 0, r->plan.total_bytes);
  }
  if (rc == 0)
    r->flat = flat;
  pthread_mutex_unlock(&r->bind_lock);
  return rc;
}

/* Maps the sender's whole wire buffer (alias mode): its shared memory, or its CUDA buffer through
 * CUDA IPC (the views are then device addresses). */
static int alias_map(ferry_refit_receiver *r) {
  const void *at = NULL;
  int rc = r->alias_ref.size ? ferry_view(r->link, &r->alias_ref, 0, r->alias_ref.size, &at)
                             : fr_err(FERRY_ENOTSUP, "refit: the sender keeps no alias buffer "
                                                     "(open it with ferry_refit_opts.alias)");
  if (rc == FERRY_ENOTSUP && r->alias_ref.size) /* CUDA memory, or nothing it can map */
    rc = ferry_view_device(r->link, &r->alias_ref, 0, r->alias_ref.size, &at);
  if (rc == 0 && r->alias_ref.size < r->plan.total_bytes)
    rc = fr_err(FERRY_EPROTO, "refit: the sender's alias buffer is smaller than its manifest");
  if (rc == 0)
    r->alias = at;
  return rc;
}

int ferry_refit_bind_alias(ferry_refit_receiver *r) {
  if (!r)
    return fr_err(FERRY_EINVAL, "ferry_refit_bind_alias: NULL receiver");
  pthread_mutex_lock(&r->bind_lock);
  int rc = r->flat     ? fr_err(FERRY_ESTATE, "refit: already bound to a flat buffer")
           : r->shards ? fr_err(FERRY_ESTATE, "refit: shards are bound to their own memory")
                       : no_device_bound(r, "the sender's buffer (alias mode)");
  if (rc == 0 && strcmp(ferry_link_transport(r->link), "shm") != 0)
    rc = fr_err(FERRY_ENOTSUP, "refit: alias mode needs the sender on this host (link is %s)",
                ferry_link_transport(r->link));
  if (rc == 0)
    rc = alias_map(r);
  if (rc == 0)
    __atomic_store_n(&r->bound_any, true, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&r->bind_lock);
  return rc;
}

int ferry_refit_bind_pieces(ferry_refit_receiver *r, const char *target, void *dst,
                            const ferry_tensor_desc *desc, const ferry_refit_piece *pieces,
                            size_t n) {
  if (!r || !target || !dst || !desc || !pieces)
    return fr_err(FERRY_EINVAL, "ferry_refit_bind_pieces: NULL argument");
  if (!*target || n == 0 || n > FR_REFIT_PIECES_MAX)
    return fr_err(FERRY_EINVAL, "refit: target '%s' with %zu pieces (1 to %u, and a name)", target,
                  n, FR_REFIT_PIECES_MAX);
  int device = -1;
  int rc = where_bound(target, dst, desc, &device);
  if (rc != 0)
    return rc;
  fr_refit_piece *pc = malloc(n * sizeof *pc);
  char **sources = malloc(n * sizeof *sources);
  rc = pc && sources ? 0 : fr_err(FERRY_ENOMEM, "refit: target '%s'", target);
  for (size_t i = 0; i < n && rc == 0; i++) {
    const ferry_refit_piece *p = &pieces[i];
    if (!p->source || p->dim < 0 || p->dim >= FERRY_MAX_DIMS || p->start < 0 || p->stop < 0)
      rc = fr_err(FERRY_ESHAPE,
                  "refit: target '%s' piece %zu ('%s' dim %d [%lld:%lld]) is not a "
                  "slice",
                  target, i, p->source ? p->source : "(null)", p->dim, (long long)p->start,
                  (long long)p->stop);
    else
      pc[i] = (fr_refit_piece){0, (uint32_t)p->dim, (uint64_t)p->start, (uint64_t)p->stop};
    sources[i] = (char *)p->source;
  }
  pthread_mutex_lock(&r->bind_lock);
  if (rc == 0)
    rc = r->flat || r->alias
             ? fr_err(FERRY_ESTATE, "refit: bound to %s; shards need their own memory",
                      r->flat ? "a flat buffer" : "the sender's buffer (alias mode)")
             : pieces_fit(&r->plan, target, desc, sources, pc, (uint32_t)n);
  if (rc == 0)
    rc = enter_shards(r);
  if (rc == 0 && device >= 0)
    pin_stage(r);
  if (rc == 0)
    rc = add_target(r, target, dst, device, desc, sources, pc, (uint32_t)n, true);
  pthread_mutex_unlock(&r->bind_lock);
  free(pc);
  free(sources);
  return rc;
}

uint64_t ferry_refit_bytes_read(ferry_refit_receiver *r) {
  return r ? __atomic_load_n(&r->bytes_read, __ATOMIC_RELAXED) : 0;
}

int ferry_refit_view(ferry_refit_receiver *r, const char *name, void **out) {
  uint32_t i = 0;
  pthread_mutex_lock(&r->bind_lock);
  int rc = find(r, name, &i);
  if (rc == 0 && !r->flat && !r->alias)
    rc = fr_err(FERRY_ESTATE, "refit: views need ferry_refit_bind_flat() or _bind_alias() first");
  if (rc == 0)
    *out =
        (uint8_t *)(r->flat ? r->flat : (uint8_t *)(uintptr_t)r->alias) + r->plan.entries[i].offset;
  pthread_mutex_unlock(&r->bind_lock);
  return rc;
}

void ferry_refit_on_bucket(ferry_refit_receiver *r, ferry_refit_bucket_fn fn, void *arg) {
  if (!r)
    return;
  pthread_mutex_lock(&r->bind_lock);
  r->on_bucket = fn;
  r->on_bucket_arg = arg;
  pthread_mutex_unlock(&r->bind_lock);
}

void ferry_refit_on_commit(ferry_refit_receiver *r, ferry_refit_commit_fn fn, void *arg) {
  if (!r)
    return;
  pthread_mutex_lock(&r->bind_lock);
  r->on_commit = fn;
  r->on_commit_arg = arg;
  pthread_mutex_unlock(&r->bind_lock);
}

int ferry_refit_tensor_buckets(ferry_refit_receiver *r, size_t i, uint32_t *first,
                               uint32_t *count) {
  if (!r || !first || !count)
    return fr_err(FERRY_EINVAL, "ferry_refit_tensor_buckets: NULL argument");
  pthread_mutex_lock(&r->bind_lock);
  const fr_refit_plan *p = &r->plan;
  int rc = i < p->count ? 0 : fr_err(FERRY_ENOTFOUND, "refit: no tensor %zu", i);
  if (rc == 0) {
    const fr_refit_entry *e = &p->entries[i];
    *first = (uint32_t)(e->offset / p->bucket_bytes);
    *count = e->wire_bytes
                 ? (uint32_t)((e->offset + e->wire_bytes - 1) / p->bucket_bytes) - *first + 1
                 : 0;
  }
  pthread_mutex_unlock(&r->bind_lock);
  return rc;
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
