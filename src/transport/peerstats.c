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

int fr_stats_call(ferry_link *link, int timeout_ms, char **text) {
  if (!link || !text)
    return fr_err(FERRY_EINVAL, "stats call: NULL argument");
  ferry_msg *reply = NULL;
  int rc = fr_link_call(link, FR_CHANNEL_STATS, NULL, 0, &reply, timeout_ms);
  if (rc != 0)
    return rc;
  if (reply->len == 0) {
    ferry_msg_free(reply);
    return fr_err(FERRY_EPEER, "stats call: '%s' had no metrics to give", link->peer);
  }
  *text = strndup(reply->data, reply->len);
  ferry_msg_free(reply);
  return *text ? 0 : fr_err(FERRY_ENOMEM, "stats call");
}
