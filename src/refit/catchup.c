/*
 * Late join: a receiver that attaches after a version was pushed gets that version at once,
 * without waiting for the next push. The sender keeps every bucket of the latest version in
 * one shared buffer (it packs there in place, so retaining costs no copy) together with each
 * bucket's checksum; a receiver that lacks the latest version and has bound its destinations
 * asks (CATCHUP), and the sender announces it the buckets of that buffer, a few at a time, then
 * COMMIT, exactly as a push would but to that receiver alone. Everything runs on the sender's
 * service thread as acknowledgements arrive, so a catch-up never holds the pushing thread; it
 * waits while a push rewrites the buffer, and a push that begins stops it (the receiver is in
 * that push and gets every bucket of the newer version there). The receiver verifies each
 * bucket against its checksum, so a bucket a push began to overwrite is refused, never taken.
 */
#include "refit/sender_impl.h"

/* Buckets announced to a catching-up receiver ahead of its acknowledgements: enough to keep
 * its reads back to back, few enough that a push that begins meanwhile waits for little. */
#define CATCHUP_WINDOW 4u

static void tell_no_copy(ferry_refit_sender *s, receiver *r) {
  fr_refit_msg_t m = {.type = FR_REFIT_CATCHUP, .version = s->latest, .status = FERRY_ENOTFOUND};
  fr_refit_send(r->link, FR_REFIT_TO_RECEIVER, &m, 1000);
}

static void announce_next(ferry_refit_sender *s, receiver *r) {
  const fr_refit_plan *p = &s->plan;
  while (r->cu_version && r->cu_announced < p->buckets &&
         r->cu_announced < r->cu_acked + CATCHUP_WINDOW) {
    uint32_t b = r->cu_announced++;
    fr_refit_msg_t m = {.type = FR_REFIT_BUCKET,
                        .bucket = b,
                        .generation = p->generation,
                        .seq = b,
                        .version = r->cu_version,
                        .bytes = fr_refit_bucket_len(p, b),
                        .checksum = s->last_sum[b],
                        .src = s->ref[0],
                        .src_offset = (uint64_t)b * p->bucket_bytes};
    if (r->view) { /* a shard reader: the sum of its runs, from the retained bucket */
      m.view = r->view->serial;
      m.view_sum = fr_refit_view_sum(p, r->view, b, (const uint8_t *)s->buf[0] + m.src_offset);
    }
    if (fr_refit_send(r->link, FR_REFIT_TO_RECEIVER, &m, 1000) != 0)
      fr_refit_catchup_cancel(r);
  }
}

static void start(ferry_refit_sender *s, receiver *r) {
  r->want_catchup = false;
  r->cu_version = s->latest;
  r->cu_announced = r->cu_acked = 0;
  fr_refit_view_refresh(s, r);
  fr_info("refit '%s': receiver '%s' catches up to version %llu", s->name, r->peer,
          (unsigned long long)s->latest);
  announce_next(s, r);
}

void fr_refit_catchup_serve(ferry_refit_sender *s) {
  if (s->pushing || !s->sealed)
    return; /* the buffer is being rewritten: served when the push ends */
  for (receiver *r = s->receivers; r; r = r->next) {
    if (!r->want_catchup || r->dropped || r->cu_version)
      continue;
    if (r->committed == s->latest || s->latest == 0) {
      r->want_catchup = false; /* it has it already (a push brought it) */
    } else if (s->retained != s->latest || s->retained == 0) {
      r->want_catchup = false;
      tell_no_copy(s, r);
    } else {
      start(s, r);
    }
  }
}

void fr_refit_catchup_request(ferry_refit_sender *s, receiver *r) {
  if (r->cu_version || r->in_push)
    return; /* under way already, or a push brings it */
  r->want_catchup = true;
  fr_refit_catchup_serve(s);
}

void fr_refit_catchup_cancel(receiver *r) {
  r->cu_version = 0;
  r->want_catchup = false;
}

bool fr_refit_catchup_record(ferry_refit_sender *s, receiver *r, const fr_refit_msg_t *x) {
  if (!r->cu_version || x->version != r->cu_version)
    return false;
  if (x->type == FR_REFIT_COMMITTED) {
    if (x->status == 0)
      r->committed = r->cu_version;
    fr_info("refit '%s': receiver '%s' %s version %llu", s->name, r->peer,
            x->status == 0 ? "caught up to" : "failed to catch up to",
            (unsigned long long)r->cu_version);
    r->cu_version = 0;
  } else if (x->type == FR_REFIT_ACK && x->status != 0) {
    fr_warn("refit '%s': receiver '%s' could not catch up to version %llu (%s); the next push "
            "brings it",
            s->name, r->peer, (unsigned long long)r->cu_version, ferry_strerror(x->status));
    r->cu_version = 0;
  } else if (x->type == FR_REFIT_ACK && x->seq == r->cu_acked) {
    r->cu_acked++;
    announce_next(s, r);
    if (r->cu_acked == s->plan.buckets) {
      fr_refit_msg_t c = {.type = FR_REFIT_COMMIT,
                          .version = r->cu_version,
                          .bytes = s->plan.buckets,
                          .generation = s->plan.generation};
      if (fr_refit_send(r->link, FR_REFIT_TO_RECEIVER, &c, 1000) != 0)
        r->cu_version = 0;
    }
  }
  return true;
}
