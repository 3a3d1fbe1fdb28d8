/*
 * The ctx's link metrics and the public metrics API. Each link counts its own bytes and frames
 * with plain stores under the locks its data path already holds (send_lock, rx_lock); a retired
 * link's counts are folded into its ctx's per-transport totals as it leaves the ctx's list, so a
 * snapshot (which sums the totals and the live links under links_lock) never sees a counter go
 * back. Failures are counted per status as links fail.
 */
#include "transport/transport.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int transport_index(const ferry_ctx *ctx, const fr_transport_ops *ops) {
  for (size_t i = 0; i < ctx->norder; i++)
    if (ctx->order[i] == ops)
      return (int)i;
  return -1;
}

void fr_link_stats_fold(ferry_link *l) {
  int i = transport_index(l->ctx, l->ops);
  if (i < 0)
    return;
  struct fr_link_totals *t = &l->ctx->link_totals[i];
  t->tx_bytes += __atomic_load_n(&l->tx_bytes, __ATOMIC_RELAXED);
  t->tx_frames += __atomic_load_n(&l->tx_frames, __ATOMIC_RELAXED);
  t->rx_bytes += __atomic_load_n(&l->rx_bytes, __ATOMIC_RELAXED);
  t->rx_frames += __atomic_load_n(&l->rx_frames, __ATOMIC_RELAXED);
}

void fr_link_stats_collect(void *arg, fr_stats_out *out) {
  ferry_ctx *ctx = arg;
  struct fr_link_totals sum[FR_MAX_LISTENERS];
  uint64_t open[FR_MAX_LISTENERS] = {0};
  pthread_mutex_lock(&ctx->links_lock);
  memcpy(sum, ctx->link_totals, sizeof sum);
  for (ferry_link *l = ctx->links; l; l = l->next) {
    int i = transport_index(ctx, l->ops);
    if (i < 0)
      continue;
    open[i]++;
    sum[i].tx_bytes += __atomic_load_n(&l->tx_bytes, __ATOMIC_RELAXED);
    sum[i].tx_frames += __atomic_load_n(&l->tx_frames, __ATOMIC_RELAXED);
    sum[i].rx_bytes += __atomic_load_n(&l->rx_bytes, __ATOMIC_RELAXED);
    sum[i].rx_frames += __atomic_load_n(&l->rx_frames, __ATOMIC_RELAXED);
  }
  pthread_mutex_unlock(&ctx->links_lock);
  for (size_t i = 0; i < ctx->norder; i++) {
    const char *t = ctx->order[i]->name;
    fr_stat_gauge(out, "ferry_links", "Links open now, by transport", (double)open[i], "transport",
                  t, NULL);
    fr_stat_counter(out, "ferry_links_opened_total", "Links opened (dialled or accepted)",
                    (double)sum[i].opened, "transport", t, NULL);
    fr_stat_counter(out, "ferry_link_sent_bytes_total",
                    "Bytes sent on links, frame headers included", (double)sum[i].tx_bytes,
                    "transport", t, NULL);
    fr_stat_counter(out, "ferry_link_received_bytes_total", "Bytes received on links",
                    (double)sum[i].rx_bytes, "transport", t, NULL);
    fr_stat_counter(out, "ferry_link_sent_frames_total", "Frames (messages, calls, replies) sent",
                    (double)sum[i].tx_frames, "transport", t, NULL);
    fr_stat_counter(out, "ferry_link_received_frames_total", "Frames received",
                    (double)sum[i].rx_frames, "transport", t, NULL);
  }
  for (int s = 1; s < 32; s++) {
    uint64_t n = fr_counted(&ctx->link_errors[s]);
    if (n)
      fr_stat_counter(out, "ferry_links_closed_total",
                      "Links closed, by status: FERRY_ECLOSED closed here, FERRY_EPEER the peer "
                      "went away, others failed",
                      (double)n, "status", ferry_status_name(-s), NULL);
  }
}

/* ---- the public API ---- */

fr_stats *fr_ctx_stats(ferry_ctx *ctx) { return &ctx->stats; }

int ferry_stats_each(ferry_ctx *ctx, ferry_stat_fn fn, void *arg) {
  if (!fn)
    return fr_err(FERRY_EINVAL, "ferry_stats_each: fn is NULL");
  fr_stats *sets[2] = {ctx ? &ctx->stats : NULL, fr_stats_global()};
  return fr_stats_collect(sets, 2, ctx ? ctx->name : NULL, fn, arg);
}

int ferry_stats_prometheus(ferry_ctx *ctx, char **text, size_t *len) {
  if (!text)
    return fr_err(FERRY_EINVAL, "ferry_stats_prometheus: text is NULL");
  fr_stats *sets[2] = {ctx ? &ctx->stats : NULL, fr_stats_global()};
  return fr_stats_prometheus(sets, 2, ctx ? ctx->name : NULL, text, len);
}

void ferry_stats_text_free(char *text) { free(text); }

int ferry_stats_ready(ferry_ctx *ctx, char *why, size_t len) {
  fr_stats *sets[1] = {ctx ? &ctx->stats : NULL};
  return fr_stats_ready(sets, 1, why, len);
}
