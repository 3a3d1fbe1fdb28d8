/*
 * The sender's side of shards (shard.h): each receiver's declared targets, by slot, and the
 * view built from them, whose runs the push hashes per bucket so that a receiver reading only
 * its slices can verify every byte it took. A declaration for another manifest generation is
 * ignored (the receiver declares again once it has the new manifest); one that does not fit the
 * plan drops the receiver's view, so it reads and verifies whole buckets instead.
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
  return 0;
}

int fr_refit_view_record(ferry_refit_sender *s, receiver *r, const fr_refit_msg_t *x) {
  if (x->generation != s->plan.generation)
    return 0; /* for a manifest since replaced: it declares again for the new one */
  int rc = take_slot(s, r, x);
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
    fr_refit_view_free(r->view);
    r->view = NULL;
  }
}
