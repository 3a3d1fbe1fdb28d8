/*
 * The receiver of a sender group (group_rx.h): its global manifest as the caller sees it, and
 * its bindings. A binding (a whole global tensor, pieces of global tensors along any dim, or the
 * flat buffer's tensors) is kept here by the names of its global tensors and turned into parts
 * (group.h: per rank, a slice of its local tensor and where it lands in the destination); each
 * rank's parts become one shard target with places on that rank's sub-receiver, declared to the
 * rank, so that each sub-receiver reads only the bytes the caller binds, straight from the rank
 * that holds them. The parts are computed when a binding or a rank's manifest changes, never per
 * push. A rank attached again gets every binding replayed; after a rank re-sealed, every rank
 * does (group_rx.c's relayout), its parts computed from the rebuilt global manifest.
 */
#include "refit/group_rx.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

size_t fr_group_rx_tensor_count(fr_group_rx *g) {
  pthread_mutex_lock(&g->bind_lock);
  size_t n = g->man.count;
  pthread_mutex_unlock(&g->bind_lock);
  return n;
}

int fr_group_rx_tensor_info(fr_group_rx *g, size_t i, const char **name, ferry_tensor_desc *desc) {
  pthread_mutex_lock(&g->bind_lock);
  int rc = i < g->man.count ? 0 : fr_err(FERRY_ENOTFOUND, "refit: no tensor %zu", i);
  if (rc == 0 && name)
    *name = g->man.tensors[i].name;
  if (rc == 0 && desc)
    *desc = g->man.tensors[i].desc;
  pthread_mutex_unlock(&g->bind_lock);
  return rc;
}

int fr_group_rx_tensor_scale(fr_group_rx *g, size_t i, float *scale) {
  pthread_mutex_lock(&g->bind_lock);
  int rc = i < g->man.count ? 0 : fr_err(FERRY_ENOTFOUND, "refit: no tensor %zu", i);
  if (rc == 0)
    *scale = g->man.tensors[i].scale;
  pthread_mutex_unlock(&g->bind_lock);
  return rc;
}

bool fr_group_rx_bound_any(fr_group_rx *g) {
  pthread_mutex_lock(&g->bind_lock);
  bool any = g->nbinds > 0;
  pthread_mutex_unlock(&g->bind_lock);
  return any;
}

/* ---- the manifest ---- */

int fr_group_rx_build_manifest(fr_group_rx *g) {
  fr_refit_plan *plans = calloc(g->world, sizeof *plans);
  if (!plans)
    return fr_err(FERRY_ENOMEM, "refit: group '%s' manifest", g->name);
  ferry_refit_receiver **subs = calloc(g->world, sizeof *subs);
  int rc = subs ? 0 : fr_err(FERRY_ENOMEM, "refit: group '%s' manifest", g->name);
  for (uint32_t k = 0; rc == 0 && k < g->world; k++) {
    pthread_mutex_lock(&g->route);
    subs[k] = g->ranks[k].sub;
    pthread_mutex_unlock(&g->route);
    pthread_mutex_lock(&subs[k]->bind_lock); /* its thread may take a new manifest */
    plans[k] = subs[k]->plan;                /* read only, while the locks are held */
  }
  fr_group_manifest man = {0};
  if (rc == 0)
    rc = fr_group_manifest_build(plans, g->world, &man);
  for (uint32_t k = 0; subs && k < g->world; k++)
    pthread_mutex_unlock(&subs[k]->bind_lock);
  free(subs);
  free(plans);
  if (rc != 0)
    return fr_err_wrap(rc, "refit: group '%s'", g->name);
  fr_group_manifest_free(&g->man);
  g->man = man;
  return 0;
}

static bool same_entry(const fr_refit_entry *a, const fr_refit_entry *b) {
  return strcmp(a->name, b->name) == 0 && a->wire == b->wire && a->scale == b->scale &&
         a->desc.dtype == b->desc.dtype && a->desc.ndim == b->desc.ndim &&
         memcmp(a->desc.shape, b->desc.shape, sizeof(uint64_t) * a->desc.ndim) == 0 &&
         !a->global == !b->global && (!a->global || strcmp(a->global, b->global) == 0) &&
         a->gdim == b->gdim && a->gstart == b->gstart && a->gstop == b->gstop;
}

bool fr_group_rx_same_plan(fr_group_rx *g, const ferry_refit_receiver *prev,
                           const fr_refit_plan *plan) {
  (void)g;
  ferry_refit_receiver *was = (ferry_refit_receiver *)prev;
  pthread_mutex_lock(&was->bind_lock); /* its thread may still take a manifest */
  bool same = was->plan.count == plan->count && was->plan.rank == plan->rank &&
              was->plan.world == plan->world;
  for (uint32_t i = 0; same && i < plan->count; i++)
    same = same_entry(&was->plan.entries[i], &plan->entries[i]);
  pthread_mutex_unlock(&was->bind_lock);
  return same;
}

/* ---- bindings → parts → shard targets on the sub-receivers ---- */

/* The name of chunk c of target `target` on a sub-receiver (a target takes at most
 * FR_REFIT_PIECES_MAX pieces; chunk 0 is the target's own name). */
static void chunk_name(const char *target, uint32_t c, char *out, size_t cap) {
  if (c == 0)
    snprintf(out, cap, "%s", target);
  else
    snprintf(out, cap, "%s#%u", target, c);
}

/* Whether sub holds target `name` with pieces (*any: it holds any target at all). bind_lock of
 * sub held. */
static bool holds(const ferry_refit_receiver *sub, const char *name, bool *any) {
  *any = false;
  for (uint32_t i = 0; i < sub->ntargets; i++) {
    *any |= sub->targets[i].name != NULL;
    if (sub->targets[i].name && strcmp(sub->targets[i].name, name) == 0)
      return sub->targets[i].t.npieces > 0;
  }
  return false;
}

/* Declares chunk `name` of binding b on sub: parts[0..n) (all sub's rank's). None: declared
 * empty only if sub held that chunk before (its old parts must go), or chunk 0 when sub holds
 * nothing yet (an empty target makes it read none of its rank's bytes, rather than every bucket
 * whole). bind_lock of sub held. */
static int declare_chunk(fr_group_rx *g, ferry_refit_receiver *sub, const fr_group_binding *b,
                         const char *name, bool first, const fr_group_part *parts, uint32_t n,
                         fr_refit_piece *pieces, fr_refit_place *places, char **sources) {
  bool any = false, held = holds(sub, name, &any);
  if (n == 0 && !held && (any || !first))
    return 0;
  for (uint32_t i = 0; i < n; i++) {
    pieces[i] = parts[i].src;
    places[i] = parts[i].place;
    if (pieces[i].entry >= sub->plan.count)
      return fr_err(FERRY_EPROTO, "refit: group '%s' rank %u has no tensor %u (re-sealed?)",
                    g->name, sub->rank, pieces[i].entry);
    sources[i] = sub->plan.entries[pieces[i].entry].name;
  }
  int rc = fr_refit_rx_enter_shards(sub);
  if (rc == 0 && b->device >= 0 && n)
    fr_refit_rx_pin_stage(sub);
  return rc ? rc
            : fr_refit_rx_add_target(sub, name, b->dst, b->device, &b->desc, sources, pieces,
                                     places, n, true);
}

/* Declares rank k's parts of binding b (parts[0..n) all rank k's) on its sub-receiver, in
 * chunks of at most FR_REFIT_PIECES_MAX; a chunk it held before beyond those is emptied. */
static int declare_rank(fr_group_rx *g, ferry_refit_receiver *sub, const fr_group_binding *b,
                        const fr_group_part *parts, uint32_t n) {
  size_t most = n < FR_REFIT_PIECES_MAX ? (n ? n : 1) : FR_REFIT_PIECES_MAX;
  fr_refit_piece *pieces = malloc(most * sizeof *pieces);
  fr_refit_place *places = malloc(most * sizeof *places);
  char **sources = malloc(most * sizeof *sources);
  char name[FR_REFIT_NAME_MAX * 2 + 16];
  int rc = pieces && places && sources ? 0 : fr_err(FERRY_ENOMEM, "refit: target '%s'", b->target);
  pthread_mutex_lock(&sub->bind_lock);
  uint32_t c = 0;
  for (uint32_t at = 0; rc == 0 && (at < n || c == 0); c++) {
    uint32_t m = n - at < FR_REFIT_PIECES_MAX ? n - at : FR_REFIT_PIECES_MAX;
    chunk_name(b->target, c, name, sizeof name);
    rc = declare_chunk(g, sub, b, name, c == 0, parts + at, m, pieces, places, sources);
    at += m;
  }
  bool any = false;
  for (; rc == 0; c++) { /* chunks beyond this layout's, from an earlier one */
    chunk_name(b->target, c, name, sizeof name);
    if (!holds(sub, name, &any))
      break;
    rc = declare_chunk(g, sub, b, name, false, NULL, 0, pieces, places, sources);
  }
  pthread_mutex_unlock(&sub->bind_lock);
  free(pieces);
  free(places);
  free(sources);
  return rc;
}

/* Appends the parts of b's pieces [i, i + n) landing in (dst, desc) to *parts, which has room
 * for *cap (FR_GROW: doubling, where one realloc per tensor copied the whole list each time under
 * the sanitizers' allocators, quadratic in a flat binding's thousands of tensors). */
static int add_parts(fr_group_rx *g, fr_group_binding *b, uint32_t i, uint32_t n, uint8_t *dst,
                     const ferry_tensor_desc *desc, fr_group_part **parts, size_t *nparts,
                     size_t *cap) {
  fr_group_part *more = NULL;
  size_t nmore = 0;
  int rc = fr_group_parts(&g->man, b->target, b->pieces + i, n, dst, desc, g->salt, &more, &nmore);
  if (rc != 0 || nmore == 0) {
    free(more);
    return rc;
  }
  if (FR_GROW(*parts, *cap, *nparts + nmore, nmore) != 0) {
    free(more);
    return fr_err(FERRY_ENOMEM, "refit: target '%s'", b->target);
  }
  memcpy(*parts + *nparts, more, nmore * sizeof *more);
  *nparts += nmore;
  free(more);
  return 0;
}

/* Binding b's parts, by the global tensors' names in the manifest as it is now. */
static int parts_of(fr_group_rx *g, fr_group_binding *b, fr_group_part **parts, size_t *n) {
  for (uint32_t i = 0; i < b->n; i++) {
    int64_t t = fr_group_find(&g->man, b->names[i]);
    if (t < 0)
      return fr_err(FERRY_ENOTFOUND, "refit: target '%s': group '%s' sends no tensor '%s'",
                    b->target, g->name, b->names[i]);
    b->pieces[i].tensor = (uint32_t)t;
  }
  *parts = NULL;
  *n = 0;
  size_t cap = 0;
  if (!b->units)
    return add_parts(g, b, 0, b->n, b->dst, &b->desc, parts, n, &cap);
  int rc = 0;
  for (uint32_t i = 0; rc == 0 && i < b->n; i++) {
    ferry_tensor_desc d = g->man.tensors[b->pieces[i].tensor].desc;
    uint64_t bytes = 0;
    if (ferry_tensor_nbytes(&d, &bytes) == 0 && bytes) /* else nothing lands */
      rc = add_parts(g, b, i, 1, b->dst + b->units[i], &d, parts, n, &cap);
  }
  if (rc != 0) {
    free(*parts);
    *parts = NULL;
  }
  return rc;
}

/* Declares binding b on rank `only`'s sub-receiver, or on every rank's (UINT32_MAX) but those
 * gone (replayed when they are back). */
static int declare(fr_group_rx *g, fr_group_binding *b, uint32_t only) {
  fr_group_part *parts = NULL, *mine = NULL;
  size_t n = 0;
  int rc = parts_of(g, b, &parts, &n);
  if (rc == 0 && n && !(mine = malloc(n * sizeof *mine)))
    rc = fr_err(FERRY_ENOMEM, "refit: target '%s'", b->target);
  for (uint32_t k = 0; rc == 0 && k < g->world; k++) {
    bool gone = false;
    pthread_mutex_lock(&g->route);
    ferry_refit_receiver *sub = g->ranks[k].sub;
    gone = g->ranks[k].gone;
    pthread_mutex_unlock(&g->route);
    if ((only != UINT32_MAX && k != only) || (only == UINT32_MAX && gone) || !sub)
      continue;
    uint32_t m = 0;
    for (size_t i = 0; i < n; i++)
      if (parts[i].rank == k)
        mine[m++] = parts[i];
    rc = declare_rank(g, sub, b, mine, m);
  }
  free(mine);
  free(parts);
  return rc;
}

static void binding_free(fr_group_binding *b) {
  for (uint32_t i = 0; b->names && i < b->n; i++)
    free(b->names[i]);
  free(b->names);
  free(b->units);
  free(b->pieces);
  free(b->target);
  memset(b, 0, sizeof *b);
}

void fr_group_rx_bindings_free(fr_group_rx *g) {
  for (uint32_t i = 0; i < g->nbinds; i++)
    binding_free(&g->binds[i]);
  free(g->binds);
  g->binds = NULL;
  g->nbinds = 0;
}

/* Records binding b (taken) in place of one of the same target, once declared. bind_lock held. */
static int add_binding(fr_group_rx *g, fr_group_binding *b) {
  int rc = declare(g, b, UINT32_MAX);
  uint32_t i = 0;
  while (i < g->nbinds && strcmp(g->binds[i].target, b->target) != 0)
    i++;
  if (rc == 0 && i == g->nbinds) {
    fr_group_binding *v = realloc(g->binds, (g->nbinds + 1) * sizeof *v);
    if (!v) {
      rc = fr_err(FERRY_ENOMEM, "refit: target '%s'", b->target);
    } else {
      memset(&v[i], 0, sizeof *v);
      g->binds = v;
      g->nbinds++;
    }
  }
  if (rc != 0) {
    binding_free(b);
    return rc;
  }
  binding_free(&g->binds[i]);
  g->binds[i] = *b;
  return 0;
}

static int new_binding(const char *target, uint32_t n, void *dst, const ferry_tensor_desc *desc,
                       int device, fr_group_binding *b) {
  *b = (fr_group_binding){
      .target = strdup(target), .n = n, .dst = dst, .desc = *desc, .device = device};
  b->names = calloc(n, sizeof *b->names);
  b->pieces = calloc(n, sizeof *b->pieces);
  if (b->target && b->names && b->pieces)
    return 0;
  binding_free(b);
  return fr_err(FERRY_ENOMEM, "refit: target '%s'", target);
}

/* Binds global tensor t whole at dst. bind_lock held. */
static int bind_whole(fr_group_rx *g, uint32_t t, void *dst, const ferry_tensor_desc *desc,
                      int device) {
  const fr_group_tensor *x = &g->man.tensors[t];
  fr_group_binding b;
  int rc = new_binding(x->name, 1, dst, desc, device, &b);
  if (rc != 0)
    return rc;
  b.pieces[0] = (fr_group_piece){t, 0, 0, x->desc.ndim ? x->desc.shape[0] : 1};
  if (!(b.names[0] = strdup(x->name))) {
    binding_free(&b);
    return fr_err(FERRY_ENOMEM, "refit: target '%s'", x->name);
  }
  return add_binding(g, &b);
}

/* Checks that desc is how global tensor x arrives; the error names it. */
static int fits_whole(const fr_group_tensor *x, const ferry_tensor_desc *desc) {
  char got[96], want[96];
  if (desc->dtype != x->desc.dtype)
    return fr_err(FERRY_EDTYPE, "refit: tensor '%s' arrives as %s, bound as %s", x->name,
                  ferry_dtype_name(x->desc.dtype), ferry_dtype_name(desc->dtype) ?: "?");
  if (desc->ndim != x->desc.ndim ||
      memcmp(desc->shape, x->desc.shape, sizeof(uint64_t) * desc->ndim) != 0)
    return fr_err(FERRY_ESHAPE, "refit: tensor '%s' arrives as %s, bound as %s", x->name,
                  ferry_shape_format(&x->desc, want, sizeof want),
                  ferry_shape_format(desc, got, sizeof got));
  return 0;
}

int fr_group_rx_bind(fr_group_rx *g, const char *name, void *dst, const ferry_tensor_desc *desc) {
  int device = -1;
  int rc = fr_refit_rx_where_bound(name ? name : "", dst, desc, &device);
  if (rc != 0)
    return rc;
  pthread_mutex_lock(&g->bind_lock);
  int64_t t = name ? fr_group_find(&g->man, name) : -1;
  rc = t >= 0 ? fits_whole(&g->man.tensors[t], desc)
              : fr_err(FERRY_ENOTFOUND, "refit: the group '%s' sends no tensor '%s'", g->name,
                       name ? name : "");
  uint64_t bytes = 0;
  if (rc == 0 && ferry_tensor_nbytes(desc, &bytes) == 0 && bytes)
    rc = bind_whole(g, (uint32_t)t, dst, desc, device);
  pthread_mutex_unlock(&g->bind_lock);
  return rc;
}

int fr_group_rx_bind_pieces(fr_group_rx *g, const char *target, void *dst,
                            const ferry_tensor_desc *desc, const ferry_refit_piece *pieces,
                            size_t n) {
  if (!*target || n == 0 || n > FR_REFIT_PIECES_MAX)
    return fr_err(FERRY_EINVAL, "refit: target '%s' with %zu pieces (1 to %u, and a name)", target,
                  n, FR_REFIT_PIECES_MAX);
  int device = -1;
  int rc = fr_refit_rx_where_bound(target, dst, desc, &device);
  fr_group_binding b;
  if (rc == 0)
    rc = new_binding(target, (uint32_t)n, dst, desc, device, &b);
  if (rc != 0)
    return rc;
  for (size_t i = 0; i < n && rc == 0; i++) {
    const ferry_refit_piece *p = &pieces[i];
    if ((rc = fr_refit_rx_piece_arg_check(target, i, p)) != 0)
      break;
    if (!(b.names[i] = strdup(p->source)))
      rc = fr_err(FERRY_ENOMEM, "refit: target '%s'", target);
    else
      b.pieces[i] = (fr_group_piece){0, (uint32_t)p->dim, (uint64_t)p->start, (uint64_t)p->stop};
  }
  if (rc != 0) {
    binding_free(&b);
    return rc;
  }
  pthread_mutex_lock(&g->bind_lock);
  if (g->flat) {
    rc = fr_err(FERRY_ESTATE, "refit: bound to a flat buffer; shards need their own memory");
    binding_free(&b);
  } else {
    rc = add_binding(g, &b);
  }
  pthread_mutex_unlock(&g->bind_lock);
  return rc;
}

/* The target name of the flat buffer's binding on the sub-receivers (and its chunks'). */
#define FLAT_TARGET "ferry:flat"

/* The flat buffer's one binding: every global tensor whole at off[i] of flat (total bytes),
 * declared to each rank in as few targets as its parts take. bind_lock held. */
static int bind_flat_all(fr_group_rx *g, uint8_t *flat, uint64_t total, const uint64_t *off) {
  ferry_tensor_desc whole = {.dtype = FERRY_DTYPE_U8, .ndim = 1, .shape = {total}};
  fr_group_binding b;
  int rc = new_binding(FLAT_TARGET, g->man.count, flat, &whole, -1, &b);
  if (rc != 0)
    return rc;
  b.units = malloc(g->man.count * sizeof *b.units);
  rc = b.units ? 0 : fr_err(FERRY_ENOMEM, "refit: group '%s' flat buffer", g->name);
  for (uint32_t i = 0; rc == 0 && i < g->man.count; i++) {
    const fr_group_tensor *x = &g->man.tensors[i];
    b.pieces[i] = (fr_group_piece){i, 0, 0, x->desc.ndim ? x->desc.shape[0] : 1};
    b.units[i] = off[i];
    if (!(b.names[i] = strdup(x->name)))
      rc = fr_err(FERRY_ENOMEM, "refit: group '%s' flat buffer", g->name);
  }
  if (rc != 0) {
    binding_free(&b);
    return rc;
  }
  return add_binding(g, &b);
}

/* The flat buffer: every global tensor in manifest order, each aligned as a single sender's. */
int fr_group_rx_bind_flat(fr_group_rx *g) {
  pthread_mutex_lock(&g->bind_lock);
  if (g->flat) {
    pthread_mutex_unlock(&g->bind_lock);
    return 0;
  }
  uint32_t count = g->man.count;
  uint64_t total = 0, *off = calloc(count ? count : 1, sizeof *off);
  char **names = calloc(count ? count : 1, sizeof *names);
  int rc = off && names ? 0 : fr_err(FERRY_ENOMEM, "refit: group '%s' flat buffer", g->name);
  for (uint32_t i = 0; rc == 0 && i < count; i++) {
    uint64_t bytes = 0;
    total = (total + FR_REFIT_ALIGN - 1) / FR_REFIT_ALIGN * FR_REFIT_ALIGN;
    off[i] = total;
    rc = ferry_tensor_nbytes(&g->man.tensors[i].desc, &bytes);
    total += bytes;
    if (rc == 0 && !(names[i] = strdup(g->man.tensors[i].name)))
      rc = fr_err(FERRY_ENOMEM, "refit: group '%s' flat buffer", g->name);
  }
  if (rc == 0 && total == 0)
    rc = fr_err(FERRY_ESTATE, "refit: the manifest is empty");
  void *flat = NULL;
  if (rc == 0)
    rc = ferry_alloc(g->ctx, total, &flat);
  if (rc == 0)
    rc = bind_flat_all(g, flat, total, off);
  if (rc == 0) {
    g->flat = flat;
    g->flat_off = off;
    g->flat_names = names;
    g->flat_count = count;
  } else {
    for (uint32_t i = 0; names && i < count; i++)
      free(names[i]);
    free(names);
    free(off);
    if (flat) /* some rank may have taken part of it: freed at close */
      g->flat_orphan = flat;
  }
  pthread_mutex_unlock(&g->bind_lock);
  return rc;
}

/* Tensor `name`'s place in the flat buffer (by index when the manifest kept its order), or -1:
 * not laid out there (a tensor a rank added since bind_flat). bind_lock held. */
static int64_t flat_slot(const fr_group_rx *g, const char *name, int64_t t) {
  if (t < g->flat_count && strcmp(g->flat_names[t], name) == 0)
    return t;
  for (uint32_t i = 0; i < g->flat_count; i++)
    if (strcmp(g->flat_names[i], name) == 0)
      return i;
  return -1;
}

int fr_group_rx_view(fr_group_rx *g, const char *name, void **out) {
  pthread_mutex_lock(&g->bind_lock);
  int64_t t = name ? fr_group_find(&g->man, name) : -1;
  int rc = t < 0 ? fr_err(FERRY_ENOTFOUND, "refit: the group '%s' sends no tensor '%s'", g->name,
                          name ? name : "")
           : !g->flat ? fr_err(FERRY_ESTATE, "refit: views need ferry_refit_bind_flat() first")
                      : 0;
  int64_t at = rc == 0 ? flat_slot(g, name, t) : -1;
  if (rc == 0 && at < 0)
    rc = fr_err(FERRY_ENOTFOUND,
                "refit: tensor '%s' came with a re-seal after the flat buffer was laid out: bind "
                "it (ferry_refit_bind) to memory of yours",
                name);
  if (rc == 0)
    *out = g->flat + g->flat_off[at];
  pthread_mutex_unlock(&g->bind_lock);
  return rc;
}

int fr_group_rx_replay(fr_group_rx *g, uint32_t k) {
  int rc = 0;
  for (uint32_t i = 0; i < g->nbinds; i++) {
    int one = declare(g, &g->binds[i], k);
    rc = rc ? rc : one;
  }
  return rc;
}
