/*
 * The refit sender's metrics: pushes (how many, how long, how many bytes of buckets, how many
 * failed), and per receiver the version it last committed and the pushes it failed, which
 * answers "which engine holds which version, and who was slow"; and where pushes' time went, by
 * phase (packing, waiting for a slot or for reads, sending, the commit). A push is seconds of
 * work, so its counting (clock reads around each phase, a few adds) costs nothing.
 */
#include "refit/sender_impl.h"

#include <stdio.h>

void fr_refit_count_push(ferry_refit_sender *s, int rc, uint64_t bytes, uint64_t t0) {
  uint64_t now = fr_now_ns();
  pthread_mutex_lock(&s->lock);
  s->pushes++;
  if (rc != 0)
    s->push_failures++;
  s->push_bytes += bytes;
  s->last_push_ns = now - t0;
  pthread_mutex_unlock(&s->lock);
  fr_hist_observe(&s->push_ns, now - t0);
}

static void collect(void *arg, fr_stats_out *out) {
  ferry_refit_sender *s = arg;
  const char *n = s->name;
  fr_stat_hist(out, "ferry_refit_push_duration_seconds", "Time a push took, to every commit",
               &s->push_ns, 1e-9, "sender", n, NULL);
  pthread_mutex_lock(&s->lock);
  fr_stat_counter(out, "ferry_refit_pushes_total", "Pushes started", (double)s->pushes, "sender", n,
                  NULL);
  fr_stat_counter(out, "ferry_refit_push_failures_total",
                  "Pushes that some receiver did not commit", (double)s->push_failures, "sender", n,
                  NULL);
  fr_stat_counter(out, "ferry_refit_push_bytes_total",
                  "Bytes of the buckets pushes sent (unchanged buckets skipped)",
                  (double)s->push_bytes, "sender", n, NULL);
  fr_stat_gauge(out, "ferry_refit_last_push_seconds", "How long the last push took",
                (double)s->last_push_ns * 1e-9, "sender", n, NULL);
  fr_stat_gauge(out, "ferry_refit_version", "The last version pushed", (double)s->latest, "sender",
                n, NULL);
  static const char *const phases[FR_REFIT_PHASES] = {"pack", "slot_wait", "read_wait", "notify",
                                                      "commit"};
  for (int i = 0; i < FR_REFIT_PHASES; i++)
    fr_stat_counter(out, "ferry_refit_push_phase_seconds_total",
                    "Pushes' time by phase: pack (device copies included), slot_wait (a bucket "
                    "left to pack, no slot free), read_wait (all packed, reads not acknowledged), "
                    "notify (sending frames), commit (waiting for COMMITTED)",
                    (double)fr_counted(&s->phase_ns[i]) * 1e-9, "sender", n, "phase", phases[i],
                    NULL);
  size_t nrecv = 0;
  for (receiver *r = s->receivers; r; r = r->next, nrecv++) {
    fr_stat_gauge(out, "ferry_refit_receiver_committed_version",
                  "The last version a receiver committed (0: none yet)", (double)r->committed,
                  "sender", n, "receiver", r->peer, NULL);
    fr_stat_counter(out, "ferry_refit_receiver_failures_total",
                    "Pushes a receiver did not commit (timed out, died, checksum)",
                    (double)r->failures, "sender", n, "receiver", r->peer, NULL);
    fr_stat_gauge(out, "ferry_refit_receiver_dropped",
                  "1 while a receiver is left out of pushes (it acknowledged nothing in time)",
                  r->dropped ? 1.0 : 0.0, "sender", n, "receiver", r->peer, NULL);
  }
  fr_stat_gauge(out, "ferry_refit_receivers", "Receivers attached", (double)nrecv, "sender", n,
                NULL);
  pthread_mutex_unlock(&s->lock);
}

int fr_refit_stats_start(ferry_refit_sender *s) {
  return fr_stats_add(fr_ctx_stats(s->ctx), collect, NULL, s);
}

void fr_refit_stats_stop(ferry_refit_sender *s) { fr_stats_remove(fr_ctx_stats(s->ctx), s); }
