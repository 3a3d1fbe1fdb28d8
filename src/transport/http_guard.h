/* The HTTP servers' shared front against slow clients (http_guard.c): ferry serve's metrics and
 * status page, FERRY_METRICS_LISTEN, and `ferry ctl serve`. */
#pragma once

#include <microhttpd.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/socket.h>

typedef struct fr_http_limits {
  unsigned connections; /* open at once, beyond which the oldest still-sending one is closed */
  unsigned per_address; /* the share of one client address */
  unsigned reserved;    /* admitted past a full server, for health paths only */
  unsigned idle_s;      /* nothing received or sent for this long: closed */
  size_t thread_stack;  /* of each connection's thread; 0: libmicrohttpd's default */
} fr_http_limits;

typedef struct fr_http_server fr_http_server;

/* Serves `sa` with a thread per connection: `handler` answers requests (cls its argument),
 * `completed` (may be NULL) is told when one is done, as MHD_OPTION_NOTIFY_COMPLETED would.
 * `who` names the server in errors and logs. */
int fr_http_start(const char *who, const struct sockaddr *sa, const fr_http_limits *lim,
                  MHD_AccessHandlerCallback handler, void *cls,
                  MHD_RequestCompletedCallback completed, fr_http_server **out);
unsigned fr_http_port(const fr_http_server *s);
void fr_http_stop(fr_http_server *s);

/* From the handler, when the request is whole (its last call, the body read): its deadline
 * stops. Until then a connection that takes longer than FERRY_HTTP_HEADER_MS is closed. */
void fr_http_request_read(struct MHD_Connection *conn);
/* Whether conn came in on a reserved slot: it may be answered only on health paths (the caller
 * says 503 to the rest). */
bool fr_http_reserved(struct MHD_Connection *conn);
