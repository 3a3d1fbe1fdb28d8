/*
 * The sender's side of shards (shard.h): each receiver's declared targets, by slot, and the
 * view built from them, whose runs the push hashes per bucket so that a receiver reading only
 * its slices can verify every byte it took. A declaration for another manifest generation is
 * ignored (the receiver declares again once it has the new manifest); one that does not fit the
 * plan drops the receiver's view, so it reads and verifies whole buckets instead; so does one
 * past the limits on what one receiver may declare (shard.h), and every later one until a new
 * manifest, since a view of only some of its targets would not match the runs it reads.
 */
#include "refit/sender_impl.h"

#include <stdlib.h>
#include <string.h>

static void clear_targets(receiver *r) {
  for (uint32_t i = 0; i < r->ntargets; i++)
    free(r->targets[i].pieces);
  free(r->targets);
  r->targets = NULL;
  r->ntargets = 0;
  r->decl_rows = r->decl_bytes = r->decl_pieces = 0;
  r->view_serial = 0;
  r->view_stale = true;
}

void fr_refit_view_release(receiver *r) {
  clear_targets(r);
  fr_refit_view_free(r->view);
  r->view = NULL;
  free(r->vsum);
  r->vsum = NULL;
}

/* Whether slot `slot` holding pieces[0, n) keeps the receiver's declarations within the limits;
 * if so, the sums it then has. */
static int within_limits(ferry_refit_sender *s, receiver *r, uint32_t slot,
                         const fr_refit_piece *pieces, uint32_t n, uint64_t sums[3]) {
  uint64_t rows = r->decl_rows, bytes = r->decl_bytes, np = r->decl_pieces, b = 0;
  const fr_refit_target *old = slot < r->ntargets ? &r->targets[slot] : NULL;
  for (uint32_t i = 0; old && i < old->npieces; i++) {
    rows -= fr_refit_piece_rows(&s->plan, &old->pieces[i], &b);
    bytes -= b;
  }
  np -= old ? old->npieces : 0;
  for (uint32_t i = 0; i < n; i++) {
    rows += fr_refit_piece_rows(&s->plan, &pieces[i], &b);
    bytes += b;
  }
  np += n;
  uint64_t slots = slot >= r->ntargets ? (uint64_t)slot + 1 : r->ntargets;
  uint64_t table = slots * sizeof(fr_refit_target) + np * sizeof(fr_refit_piece);
  uint64_t most = (uint64_t)FR_REFIT_VIEW_OVERLAP * s->plan.total_bytes;
  if (rows > FR_REFIT_VIEW_RUNS_MAX || bytes > most || table > FR_REFIT_TABLE_BYTES_MAX)
    return fr_err(FERRY_ECAPACITY,
                  "refit view: target %u takes this receiver's shards past the sender's limits "
                  "(%llu runs, %llu bytes, a %llu-byte table; at most %u runs, %u times the "
                  "model's %llu bytes, %u bytes)",
                  slot, (unsigned long long)rows, (unsigned long long)bytes,
                  (unsigned long long)table, FR_REFIT_VIEW_RUNS_MAX, FR_REFIT_VIEW_OVERLAP,
                  (unsigned long long)s->plan.total_bytes, FR_REFIT_TABLE_BYTES_MAX);
  sums[0] = rows, sums[1] = bytes, sums[2] = np;
  return 0;
}

static int take_slot(ferry_refit_sender *s, receiver *r, const fr_refit_msg_t *x) {
  uint32_t slot = x->bucket, n = (uint32_t)x->bytes;
  if (slot >= FR_REFIT_TARGETS_MAX)
    return fr_err(FERRY_EPROTO, "refit view: slot %u", slot);
  fr_refit_piece *pieces = n ? malloc(n * sizeof *pieces) : NULL;
  if (n && !pieces)
    return fr_err(FERRY_ENOMEM, "refit view: %u pieces", n);
  int rc = fr_refit_pieces_decode((const uint8_t *)x->route, x->route_len, n, pieces);
  for (uint32_t i = 0; i < n && rc == 0; i++)
    rc = fr_refit_piece_check(&s->plan, &pieces[i], "refit view");
  uint64_t sums[3] = {0};
  if (rc == 0)
    rc = within_limits(s, r, slot, pieces, n, sums);
  if (rc == 0 && slot >= r->ntargets) {
    fr_refit_target *t = realloc(r->targets, (slot + 1) * sizeof *t);
    if (!t)
      rc = fr_err(FERRY_ENOMEM, "refit view: %u targets", slot + 1);
    else {
      memset(t + r->ntargets, 0, (slot + 1 - r->ntargets) * sizeof *t);
      r->targets = t;
      r->ntargets = slot + 1;
    }
  }
  if (rc != 0) {
    free(pieces);
    return rc;
  }
  free(r->targets[slot].pieces);
  r->targets[slot] = (fr_refit_target){.npieces = n, .pieces = pieces};
  r->decl_rows = sums[0], r->decl_bytes = sums[1], r->decl_pieces = sums[2];
  return 0;
}

int fr_refit_view_record(ferry_refit_sender *s, receiver *r, const fr_refit_msg_t *x) {
  if (x->generation != s->plan.generation)
    return 0; /* for a manifest since replaced: it declares again for the new one */
  int rc = r->view_refused
               ? fr_err(FERRY_ECAPACITY, "refit view: this receiver's shards passed the sender's "
                                         "limits; it reads whole buckets until a new manifest")
               : take_slot(s, r, x);
  r->view_refused |= rc == FERRY_ECAPACITY;
  if (rc != 0) {
    fr_warn("refit '%s': receiver '%s' declared shards that do not fit (%s); it reads whole "
            "buckets",
            s->name, r->peer, ferry_last_error());
    clear_targets(r);
    return rc;
  }
  r->view_serial = x->seq;
  r->view_stale = true;
  return 0;
}

void fr_refit_view_refresh(ferry_refit_sender *s, receiver *r) {
  if (!r->view_stale)
    return;
  r->view_stale = false;
  fr_refit_view_free(r->view);
  r->view = NULL;
  if (r->view_serial == 0)
    return;
  if (fr_refit_view_build(&s->plan, r->targets, r->ntargets, r->view_serial, &r->view) != 0)
    fr_warn("refit '%s': receiver '%s' reads whole buckets: %s", s->name, r->peer,
            ferry_last_error());
}

void fr_refit_views_clear(ferry_refit_sender *s) {
  for (receiver *r = s->receivers; r; r = r->next) {
    clear_targets(r);
    r->view_refused = false;
    fr_refit_view_free(r->view);
    r->view = NULL;
  }
}
