/*
 * Another node's metrics, asked for over a ferry link: every ctx answers a call on
 * FR_CHANNEL_STATS with the Prometheus text its /metrics would serve (ctx.c's server thread). A
 * fleet view (ferry serve's /v1/fleet, ferry top) uses it for what only a node knows: the version
 * each of a refit sender's receivers committed, an mq's queue, a store node's pool. It needs no
 * HTTP listener on the node, and the link is authenticated with the fleet token like any other.
 */
#include "core/channels.h"
#include "transport/transport.h"

#include <stdlib.h>
#include <string.h>

int fr_stats_fetch(ferry_ctx *ctx, const char *address, int timeout_ms, char **text) {
  if (!ctx || !address || !text)
    return fr_err(FERRY_EINVAL, "stats fetch: NULL argument");
  if (strcmp(address, ferry_ctx_address(ctx)) == 0) { /* this node: no link to itself */
    size_t len = 0;
    return ferry_stats_prometheus(ctx, text, &len);
  }
  ferry_link *link = NULL;
  int rc = ferry_connect(ctx, address, timeout_ms, &link);
  if (rc != 0)
    return rc;
  ferry_msg *reply = NULL;
  rc = fr_link_call(link, FR_CHANNEL_STATS, NULL, 0, &reply, timeout_ms);
  ferry_link_close(link);
  if (rc != 0)
    return rc;
  if (reply->len == 0) {
    ferry_msg_free(reply);
    return fr_err(FERRY_EPEER, "stats fetch: %s had no metrics to give", address);
  }
  *text = strndup(reply->data, reply->len);
  ferry_msg_free(reply);
  return *text ? 0 : fr_err(FERRY_ENOMEM, "stats fetch");
}
