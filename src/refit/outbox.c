/*
 * The sender's outbox: how it sends to receivers without holding its lock. What to send to whom
 * is decided under s->lock (the scheduling state lives there) and queued here; the frames go out
 * once the lock is released, so that a receiver whose link is slow or full (a stopped process)
 * holds up only the thread sending to it, never the service thread that records the others'
 * acknowledgements. Each entry holds its own reference to the link, so a frame may go out after
 * its receiver's record was freed. Frames go in the order queued: to one receiver, BUCKET i
 * before i+1 before COMMIT. A frame that cannot go leaves its link dead (a half-sent frame breaks
 * the stream), and the later frames for that link are not tried: they fail with the same status.
 */
#include "refit/sender_impl.h"

#include <stdlib.h>
#include <string.h>

int fr_refit_out_add(fr_refit_outbox *o, ferry_link *link, const fr_refit_msg_t *m, int timeout_ms,
                     bool catchup) {
  if (FR_GROW(o->v, o->cap, o->n + 1, 16) != 0)
    return fr_err(FERRY_ENOMEM, "refit: queueing a frame for '%s'", ferry_link_peer(link));
  fr_refit_out *e = &o->v[o->n];
  *e = (fr_refit_out){.m = *m, .timeout_ms = timeout_ms, .catchup = catchup};
  if (m->route_len) { /* a ROUTE: the address may be freed with its record before it goes */
    if (!(e->route = malloc(m->route_len)))
      return fr_err(FERRY_ENOMEM, "refit: queueing a route for '%s'", ferry_link_peer(link));
    memcpy(e->route, m->route, m->route_len);
    e->m.route = e->route;
  }
  e->link = ferry_link_retain(link);
  o->n++;
  return 0;
}

void fr_refit_out_send(fr_refit_outbox *o) {
  bool failed = false;
  for (size_t i = 0; i < o->n; i++) {
    fr_refit_out *e = &o->v[i];
    e->rc = 0;
    for (size_t k = 0; failed && k < i && e->rc == 0; k++) /* not after a frame that failed */
      if (o->v[k].link == e->link && o->v[k].rc != 0)
        e->rc = o->v[k].rc;
    if (e->rc == 0)
      e->rc = fr_refit_send(e->link, FR_REFIT_TO_RECEIVER, &e->m, e->timeout_ms);
    failed |= e->rc != 0;
  }
}

/* What a frame that could not go means for its receiver (s->lock held). */
static void failed(ferry_refit_sender *s, receiver *r, const fr_refit_out *e) {
  if (e->catchup) { /* the catch-up stops; the next push brings the version */
    if (r->cu_version == e->m.version || e->m.type == FR_REFIT_CATCHUP)
      fr_refit_catchup_cancel(r);
  } else if (e->m.type == FR_REFIT_DROPPED) {
    fr_warn("refit '%s': cannot tell '%s' it was dropped: %s", s->name, r->peer,
            ferry_strerror(e->rc));
  } else {
    if (e->m.type == FR_REFIT_ROUTE) { /* told nothing: tell it again next time */
      free(r->routed);
      r->routed = NULL;
    }
    if (r->in_push && r->status == 0)
      r->status = e->rc;
  }
}

void fr_refit_out_settle(ferry_refit_sender *s, fr_refit_outbox *o) {
  for (size_t i = 0; i < o->n; i++) {
    if (o->v[i].rc == 0)
      continue;
    for (receiver *r = s->receivers; r; r = r->next)
      if (r->link == o->v[i].link) /* our reference keeps the pointer from being reused */
        failed(s, r, &o->v[i]);
  }
  fr_refit_out_clear(o);
}

void fr_refit_out_clear(fr_refit_outbox *o) {
  for (size_t i = 0; i < o->n; i++) {
    ferry_link_release(o->v[i].link);
    free(o->v[i].route);
  }
  o->n = 0;
}

void fr_refit_out_free(fr_refit_outbox *o) {
  fr_refit_out_clear(o);
  free(o->v);
  *o = (fr_refit_outbox){0};
}
