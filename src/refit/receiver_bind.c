/*
 * The refit receiver's manifest as the caller sees it (tensors, their scales and buckets) and
 * its bindings: a tensor bound whole (ferry_refit_bind), the flat buffer, alias mode (views into
 * the sender's buffer), shard targets (ferry_refit_bind_pieces: checked here, recorded and
 * declared in receiver_shards.c), views, and the bucket and commit callbacks. Each takes
 * bind_lock, since the service thread may swap in a new manifest meanwhile; a destination bound
 * after a version began landing makes that version fail (new_destination). Shared with the
 * receiver's other files through receiver_impl.h. The receiver of a sender group hands each call
 * to group_bind.c or group_rx.c.
 */
#include "refit/group_rx.h"
#include "refit/receiver_impl.h"

#include <stdlib.h>
#include <string.h>

int fr_refit_rx_piece_arg_check(const char *target, size_t i, const ferry_refit_piece *p) {
  if (p->source && p->dim >= 0 && p->dim < FERRY_MAX_DIMS && p->start >= 0 && p->stop >= 0)
    return 0;
  return fr_err(FERRY_ESHAPE,
                "refit: target '%s' piece %zu ('%s' dim %d [%lld:%lld]) is not a slice", target, i,
                p->source ? p->source : "(null)", p->dim, (long long)p->start, (long long)p->stop);
}

/* Checks that a binding fits its tensor; the error names the tensor. */
int fr_refit_rx_binding_fits(const fr_refit_entry *e, const ferry_tensor_desc *desc) {
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

size_t ferry_refit_tensor_count(ferry_refit_receiver *r) {
  return !r ? 0 : r->group ? fr_group_rx_tensor_count(r->group) : r->plan.count;
}

int ferry_refit_tensor_info(ferry_refit_receiver *r, size_t i, const char **name,
                            ferry_tensor_desc *desc) {
  if (!r)
    return fr_err(FERRY_EINVAL, "ferry_refit_tensor_info: NULL receiver");
  if (r->group)
    return fr_group_rx_tensor_info(r->group, i, name, desc);
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
  if (r->group)
    return fr_group_rx_tensor_scale(r->group, i, scale);
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
void fr_refit_rx_new_destination(ferry_refit_receiver *r, uint64_t lo, uint64_t len) {
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
  if (r->group)
    return fr_group_rx_bind(r->group, name, dst, desc);
  int device = -1;
  int rc = fr_refit_rx_where_bound(name ? name : "", dst, desc, &device);
  if (rc != 0)
    return rc;
  uint32_t i = 0;
  pthread_mutex_lock(&r->bind_lock); /* the service thread may swap in a new manifest */
  rc = find(r, name, &i);
  if (rc == 0)
    rc = fr_refit_rx_binding_fits(&r->plan.entries[i], desc);
  if (rc == 0 && device >= 0 && (r->flat || r->alias))
    rc = fr_refit_rx_host_only(r, name);
  if (rc == 0 && device >= 0)
    fr_refit_rx_pin_stage(r);
  if (rc == 0 && r->shards) { /* a target of one piece: the whole tensor */
    fr_refit_piece pc = fr_refit_rx_whole_piece(&r->plan, i);
    char *src = r->plan.entries[i].name;
    rc = r->plan.entries[i].wire_bytes
             ? fr_refit_rx_add_target(r, name, dst, device, desc, &src, &pc, NULL, 1, true)
             : 0;
    pthread_mutex_unlock(&r->bind_lock);
    return rc;
  }
  if (rc == 0 && r->bound[i] != dst)
    fr_refit_rx_new_destination(r, r->plan.entries[i].offset, r->plan.entries[i].wire_bytes);
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
  if (r->group)
    return fr_group_rx_bind_flat(r->group);
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
      fr_refit_rx_new_destination(r, 0, r->plan.total_bytes);
  }
  if (rc == 0)
    r->flat = flat;
  pthread_mutex_unlock(&r->bind_lock);
  return rc;
}

/* Maps the sender's whole wire buffer (alias mode): its shared memory, or its CUDA buffer through
 * CUDA IPC (the views are then device addresses). */
int fr_refit_rx_alias_map(ferry_refit_receiver *r) {
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
  if (r->group)
    return fr_err(FERRY_ENOTSUP,
                  "refit: alias mode reads one sender's buffer; group '%s' is %zu senders (bind "
                  "tensors, pieces or a flat buffer)",
                  r->group->name, fr_group_rx_ranks(r->group));
  pthread_mutex_lock(&r->bind_lock);
  int rc = r->flat     ? fr_err(FERRY_ESTATE, "refit: already bound to a flat buffer")
           : r->shards ? fr_err(FERRY_ESTATE, "refit: shards are bound to their own memory")
                       : no_device_bound(r, "the sender's buffer (alias mode)");
  if (rc == 0 && strcmp(ferry_link_transport(r->link), "shm") != 0)
    rc = fr_err(FERRY_ENOTSUP, "refit: alias mode needs the sender on this host (link is %s)",
                ferry_link_transport(r->link));
  if (rc == 0)
    rc = fr_refit_rx_alias_map(r);
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
  if (r->group)
    return fr_group_rx_bind_pieces(r->group, target, dst, desc, pieces, n);
  if (!*target || n == 0 || n > FR_REFIT_PIECES_MAX)
    return fr_err(FERRY_EINVAL, "refit: target '%s' with %zu pieces (1 to %u, and a name)", target,
                  n, FR_REFIT_PIECES_MAX);
  int device = -1;
  int rc = fr_refit_rx_where_bound(target, dst, desc, &device);
  if (rc != 0)
    return rc;
  fr_refit_piece *pc = malloc(n * sizeof *pc);
  char **sources = malloc(n * sizeof *sources);
  rc = pc && sources ? 0 : fr_err(FERRY_ENOMEM, "refit: target '%s'", target);
  for (size_t i = 0; i < n && rc == 0; i++) {
    const ferry_refit_piece *p = &pieces[i];
    if ((rc = fr_refit_rx_piece_arg_check(target, i, p)) == 0)
      pc[i] = (fr_refit_piece){0, (uint32_t)p->dim, (uint64_t)p->start, (uint64_t)p->stop};
    sources[i] = (char *)p->source;
  }
  pthread_mutex_lock(&r->bind_lock);
  if (rc == 0)
    rc = r->flat || r->alias
             ? fr_err(FERRY_ESTATE, "refit: bound to %s; shards need their own memory",
                      r->flat ? "a flat buffer" : "the sender's buffer (alias mode)")
             : fr_refit_rx_pieces_fit(&r->plan, target, desc, sources, pc, (uint32_t)n);
  if (rc == 0)
    rc = fr_refit_rx_enter_shards(r);
  if (rc == 0 && device >= 0)
    fr_refit_rx_pin_stage(r);
  if (rc == 0)
    rc = fr_refit_rx_add_target(r, target, dst, device, desc, sources, pc, NULL, (uint32_t)n, true);
  pthread_mutex_unlock(&r->bind_lock);
  free(pc);
  free(sources);
  return rc;
}

uint64_t ferry_refit_bytes_read(ferry_refit_receiver *r) {
  return !r         ? 0
         : r->group ? fr_group_rx_bytes_read(r->group)
                    : __atomic_load_n(&r->bytes_read, __ATOMIC_RELAXED);
}

int ferry_refit_view(ferry_refit_receiver *r, const char *name, void **out) {
  if (!r || !out)
    return fr_err(FERRY_EINVAL, "ferry_refit_view: NULL argument");
  if (r->group)
    return fr_group_rx_view(r->group, name, out);
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
  if (r->group) {
    fr_group_rx_on_bucket(r->group, fn, arg);
    return;
  }
  pthread_mutex_lock(&r->bind_lock);
  r->on_bucket = fn;
  r->on_bucket_arg = arg;
  pthread_mutex_unlock(&r->bind_lock);
}

void ferry_refit_on_commit(ferry_refit_receiver *r, ferry_refit_commit_fn fn, void *arg) {
  if (!r)
    return;
  if (r->group) {
    fr_group_rx_on_commit(r->group, fn, arg);
    return;
  }
  pthread_mutex_lock(&r->bind_lock);
  r->on_commit = fn;
  r->on_commit_arg = arg;
  pthread_mutex_unlock(&r->bind_lock);
}

int ferry_refit_tensor_buckets(ferry_refit_receiver *r, size_t i, uint32_t *first,
                               uint32_t *count) {
  if (!r || !first || !count)
    return fr_err(FERRY_EINVAL, "ferry_refit_tensor_buckets: NULL argument");
  if (r->group) /* a global tensor's pieces lie in buckets of several ranks */
    return fr_err(FERRY_ENOTSUP,
                  "refit: a tensor of group '%s' spans the buckets of several ranks: wait for "
                  "the commit",
                  r->group->name);
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
