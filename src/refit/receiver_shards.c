/*
 * The refit receiver's shards (ferry_refit_bind_pieces): targets, each a destination filled by
 * slices of the sender's tensors along its dim 0. A target is checked against the manifest,
 * recorded, and declared to the sender (a VIEW call, so that once it returns the sender hashes
 * exactly these slices for the next push); the view of runs built from the targets (shard.h)
 * says which bytes of each bucket this receiver reads. When the sender re-seals, every target is
 * resolved against the new manifest and declared again. Every call here runs with bind_lock
 * held; shared with the receiver's other files through receiver_impl.h.
 */
#include "refit/receiver_impl.h"
#include "transport/wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void fr_refit_rx_target_free(struct rx_target *t) {
  for (uint32_t i = 0; t->sources && i < t->t.npieces; i++)
    free(t->sources[i]);
  free(t->sources);
  free(t->t.pieces);
  free(t->t.places);
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
int fr_refit_rx_pieces_fit(const fr_refit_plan *plan, const char *target,
                           const ferry_tensor_desc *desc, char *const *sources,
                           fr_refit_piece *pieces, uint32_t n) {
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

/* Checks pieces [0, n) with places against the plan: their sources resolved by name, each a
 * slice of its source landing at its place, every block inside the destination [dst, dst + the
 * bytes of desc); the error names the piece that does not fit. */
int fr_refit_rx_places_fit(const fr_refit_plan *plan, const char *target,
                           const ferry_tensor_desc *desc, const uint8_t *dst, char *const *sources,
                           fr_refit_piece *pieces, const fr_refit_place *places, uint32_t n) {
  char who[FR_REFIT_NAME_MAX * 2 + 128];
  uint64_t size = 0;
  int rc = ferry_tensor_nbytes(desc, &size);
  for (uint32_t i = 0; i < n && rc == 0; i++) {
    const fr_refit_place *pl = &places[i];
    snprintf(who, sizeof who, "refit: target '%s' part %u ('%s' dim %u [%llu:%llu])", target, i,
             sources[i], pieces[i].dim, (unsigned long long)pieces[i].start,
             (unsigned long long)pieces[i].stop);
    int64_t e = fr_refit_plan_find(plan, sources[i]);
    if (e < 0)
      return fr_err(FERRY_ENOTFOUND, "%s: the sender sends no tensor '%s'", who, sources[i]);
    pieces[i].entry = (uint32_t)e;
    uint64_t bytes = 0;
    rc = fr_refit_piece_check(plan, &pieces[i], who);
    if (rc == 0)
      rc = fr_refit_place_check(plan, &pieces[i], pl, who);
    if (rc == 0)
      rc = ferry_tensor_nbytes(&pl->block, &bytes);
    long long at = (long long)((uintptr_t)pl->dst - (uintptr_t)dst);
    if (rc == 0 && (at < 0 || (uint64_t)at > size || bytes > size - (uint64_t)at))
      rc = fr_err(FERRY_ERANGE, "%s: its block (%llu bytes at %lld) lies outside the target's %llu",
                  who, (unsigned long long)bytes, at, (unsigned long long)size);
  }
  return rc;
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
                        const fr_refit_piece *pieces, const fr_refit_place *places, uint32_t n) {
  bool same = t->t.dst == dst && t->t.npieces == n && t->desc.dtype == desc->dtype &&
              t->desc.ndim == desc->ndim &&
              memcmp(t->desc.shape, desc->shape, sizeof(uint64_t) * desc->ndim) == 0 &&
              memcmp(t->t.pieces, pieces, n * sizeof *pieces) == 0 && !t->t.places == !places;
  for (uint32_t i = 0; same && places && i < n; i++) /* field by field: a desc has padding */
    same = t->t.places[i].dst == places[i].dst && t->t.places[i].dim == places[i].dim &&
           t->t.places[i].at == places[i].at &&
           t->t.places[i].block.dtype == places[i].block.dtype &&
           t->t.places[i].block.ndim == places[i].block.ndim &&
           memcmp(t->t.places[i].block.shape, places[i].block.shape,
                  sizeof(uint64_t) * places[i].block.ndim) == 0;
  return same;
}

/* Records a checked target (pieces resolved) and declares it; `fresh`: memory the receiver did
 * not write before (not a whole binding turned into a target), which then holds no version.
 * With places (a group's sub-receiver), they are checked here: sources resolved by name, each
 * piece a slice of its source, each place's block inside [dst, dst + desc's bytes). */
int fr_refit_rx_add_target(ferry_refit_receiver *r, const char *name, void *dst, int device,
                           const ferry_tensor_desc *desc, char *const *sources,
                           const fr_refit_piece *pieces, const fr_refit_place *places, uint32_t n,
                           bool fresh) {
  uint32_t slot = 0;
  int rc = target_slot(r, name, &slot);
  if (rc != 0)
    return rc;
  struct rx_target t = {.name = strdup(name), .desc = *desc, .device = device};
  t.sources = calloc(n, sizeof *t.sources);
  t.t.pieces = malloc(n * sizeof *t.t.pieces);
  t.t.places = places ? malloc(n * sizeof *t.t.places) : NULL;
  t.t.dst = dst;
  bool ok = t.name && t.sources && t.t.pieces && (t.t.places || !places);
  for (uint32_t i = 0; ok && i < n; i++)
    ok = (t.sources[i] = strdup(sources[i])) != NULL;
  t.t.npieces = n;
  if (!ok) {
    fr_refit_rx_target_free(&t);
    return fr_err(FERRY_ENOMEM, "refit: target '%s'", name);
  }
  memcpy(t.t.pieces, pieces, n * sizeof *pieces);
  if (places)
    memcpy(t.t.places, places, n * sizeof *places);
  if (places)
    rc = fr_refit_rx_places_fit(&r->plan, name, desc, dst, sources, t.t.pieces, places, n);
  if (rc != 0) {
    fr_refit_rx_target_free(&t);
    return rc;
  }
  bool moved = fresh && !same_target(&r->targets[slot], dst, desc, t.t.pieces, places, n);
  for (uint32_t i = 0; moved && i < n; i++)
    fr_refit_rx_new_destination(r, r->plan.entries[t.t.pieces[i].entry].offset,
                                r->plan.entries[t.t.pieces[i].entry].wire_bytes);
  fr_refit_rx_target_free(&r->targets[slot]);
  r->targets[slot] = t;
  __atomic_store_n(&r->bound_any, true, __ATOMIC_RELEASE);
  return declare(r, slot);
}

/* A whole tensor as a target of one piece: all of its dim 0. */
fr_refit_piece fr_refit_rx_whole_piece(const fr_refit_plan *plan, uint32_t e) {
  const fr_refit_entry *x = &plan->entries[e];
  return (fr_refit_piece){e, 0, 0, x->desc.ndim ? x->desc.shape[0] : 1};
}

/* The first shard binding: every tensor bound whole so far becomes a target too, since from now
 * on only the view's runs are read. */
int fr_refit_rx_enter_shards(ferry_refit_receiver *r) {
  if (r->shards)
    return 0;
  r->shards = true;
  for (uint32_t i = 0; i < r->plan.count; i++) {
    void *dst = r->bound[i];
    r->bound[i] = NULL;
    r->dev_bound -= dst && r->bound_dev[i] >= 0;
    fr_refit_piece pc = fr_refit_rx_whole_piece(&r->plan, i);
    char *src = r->plan.entries[i].name;
    int rc = dst && r->plan.entries[i].wire_bytes
                 ? fr_refit_rx_add_target(r, src, dst, r->bound_dev[i], &r->bound_desc[i], &src,
                                          &pc, NULL, 1, false)
                 : 0;
    if (rc != 0)
      return rc;
  }
  return 0;
}

/* The sender re-sealed: pieces name their sources again by index in the new manifest; a target
 * that no longer fits is unbound (the first such is the error), the others are declared again. */
int fr_refit_rx_retarget(ferry_refit_receiver *r) {
  int rc = 0;
  fr_refit_view_free(r->view);
  r->view = NULL;
  for (uint32_t i = 0; i < r->ntargets; i++) {
    struct rx_target *t = &r->targets[i];
    if (!t->name)
      continue;
    int fit = t->t.places
                  ? fr_refit_rx_places_fit(&r->plan, t->name, &t->desc, t->t.dst, t->sources,
                                           t->t.pieces, t->t.places, t->t.npieces)
                  : fr_refit_rx_pieces_fit(&r->plan, t->name, &t->desc, t->sources, t->t.pieces,
                                           t->t.npieces);
    if (fit != 0) {
      fr_warn("%s (unbound: bind it again)", ferry_last_error());
      rc = rc ? rc : fit;
      fr_refit_rx_target_free(t);
    } else if ((fit = declare(r, i)) != 0 && rc == 0) {
      rc = fit;
    }
  }
  return rc;
}

int fr_refit_rx_ensure_view(ferry_refit_receiver *r) {
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
  return rc ? rc : fr_refit_rx_build_dev_ranges(r);
}
