/*
 * The metrics HTTP server (libmicrohttpd, one internal thread: a scrape is a snapshot and a
 * write, no request blocks): GET /metrics gives the Prometheus text of a ctx and the process,
 * /healthz says the process answers, /readyz runs the ctx's readiness checks (its jobs' directory
 * leases held; a ctx with no directory is ready); a caller may add routes of its own
 * (fr_metrics_route: ferry serve's status page at / and /v1/fleet). A ctx opened with
 * FERRY_METRICS_LISTEN starts one; `ferry serve --http` starts one for its node. It binds loopback
 * unless told otherwise, and an address other hosts can reach needs a fleet token (FERRY_TOKEN),
 * the rule of tcp listeners (docs/SECURITY.md): the metrics are read-only and need no token to be
 * read, but they name nodes, topics and receivers, which belong to a fleet that has decided to be
 * reachable.
 */
#include "transport/http_guard.h"
#include "transport/transport.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Slow clients (http_guard.c): a request must arrive whole within FERRY_HTTP_HEADER_MS; a full
 * server closes the oldest connection still sending one; a few reserved slots answer health. */
static const fr_http_limits LIMITS = {
    .connections = 64, .per_address = 32, .reserved = 4, .idle_s = 10, .thread_stack = 0};

#define ROUTES_MAX 4

struct ferry_metrics_server {
  ferry_ctx *ctx;
  fr_http_server *http;
  char address[300];
  pthread_mutex_t lock; /* routes: added while requests are answered */
  size_t nroutes;
  struct route {
    char path[64];
    fr_http_route_fn fn;
    void *arg;
  } routes[ROUTES_MAX];
};

static enum MHD_Result respond(struct MHD_Connection *conn, unsigned code, const char *type,
                               char *body, size_t len, enum MHD_ResponseMemoryMode mode) {
  struct MHD_Response *r = MHD_create_response_from_buffer(len, body, mode);
  if (!r)
    return MHD_NO;
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
  enum MHD_Result ret = MHD_queue_response(conn, code, r);
  MHD_destroy_response(r);
  return ret;
}

static enum MHD_Result text(struct MHD_Connection *conn, unsigned code, const char *msg) {
  return respond(conn, code, "text/plain; charset=utf-8", (char *)msg, strlen(msg),
                 MHD_RESPMEM_MUST_COPY);
}

int fr_metrics_route(ferry_metrics_server *s, const char *path, fr_http_route_fn fn, void *arg) {
  if (!s || !path || !fn || strlen(path) >= sizeof s->routes[0].path)
    return fr_err(FERRY_EINVAL, "metrics: bad route");
  pthread_mutex_lock(&s->lock);
  int rc = s->nroutes < ROUTES_MAX ? 0 : fr_err(FERRY_ERANGE, "metrics: too many routes");
  if (rc == 0) {
    struct route *r = &s->routes[s->nroutes++];
    fr_str_copy(r->path, sizeof r->path, path);
    r->fn = fn, r->arg = arg;
  }
  pthread_mutex_unlock(&s->lock);
  return rc;
}

/* A route the caller added (ferry serve's status page and /v1/fleet): false when none matches. */
static bool routed(ferry_metrics_server *s, struct MHD_Connection *conn, const char *url,
                   enum MHD_Result *ret) {
  fr_http_route_fn fn = NULL;
  void *arg = NULL;
  pthread_mutex_lock(&s->lock);
  for (size_t i = 0; i < s->nroutes && !fn; i++)
    if (strcmp(s->routes[i].path, url) == 0)
      fn = s->routes[i].fn, arg = s->routes[i].arg;
  pthread_mutex_unlock(&s->lock);
  if (!fn)
    return false;
  char *body = NULL;
  size_t len = 0;
  const char *type = "text/plain; charset=utf-8";
  unsigned code = fn(arg, &body, &len, &type);
  *ret = body ? respond(conn, code, type, body, len, MHD_RESPMEM_MUST_FREE)
              : text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
  return true;
}

static enum MHD_Result metrics(ferry_metrics_server *s, struct MHD_Connection *conn) {
  char *body = NULL;
  size_t len = 0;
  if (ferry_stats_prometheus(s->ctx, &body, &len) != 0)
    return text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "metrics: out of memory\n");
  return respond(conn, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", body, len,
                 MHD_RESPMEM_MUST_FREE);
}

static enum MHD_Result ready(ferry_metrics_server *s, struct MHD_Connection *conn) {
  char why[400], line[512];
  int rc = ferry_stats_ready(s->ctx, why, sizeof why);
  snprintf(line, sizeof line, "%s\n", rc == 0 ? "ready" : why);
  return text(conn, rc == 0 ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE, line);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls) {
  if (!*con_cls) { /* headers only: wait for the (empty) body */
    *con_cls = conn;
    return MHD_YES;
  }
  if (*upload_size) { /* no route takes a body */
    *upload_size = 0;
    return MHD_YES;
  }
  fr_http_request_read(conn);
  if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
    return text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "use GET\n");
  if (strcmp(url, "/metrics") == 0)
    return metrics(cls, conn);
  if (strcmp(url, "/healthz") == 0)
    return text(conn, MHD_HTTP_OK, "ok\n");
  if (strcmp(url, "/readyz") == 0)
    return ready(cls, conn);
  if (fr_http_reserved(conn))
    return text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "busy: only /metrics, /healthz and /readyz\n");
  enum MHD_Result ret;
  if (routed(cls, conn, url, &ret))
    return ret;
  return text(conn, MHD_HTTP_NOT_FOUND, "no such path: try /metrics, /healthz or /readyz\n");
}

/* "HOST:PORT" (HOST empty: loopback) to an address to listen on. */
static int resolve(const char *listen, struct addrinfo **out) {
  char host[256], port[16];
  if (fr_split_host_port(listen, host, sizeof host, port, sizeof port) != 0)
    return fr_err(FERRY_EINVAL, "metrics: '%s' is not HOST:PORT", listen);
  char *end;
  long n = strtol(port, &end, 10);
  if (*end || end == port || n < 0 || n > 65535)
    return fr_err(FERRY_EINVAL, "metrics: bad port in '%s'", listen);
  struct addrinfo hints = {
      .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
  int g = getaddrinfo(*host ? host : "127.0.0.1", port, &hints, out);
  if (g != 0)
    return fr_err(FERRY_EINVAL, "metrics: cannot resolve '%s': %s", listen, gai_strerror(g));
  return 0;
}

int ferry_metrics_serve(ferry_ctx *ctx, const char *listen, ferry_metrics_server **out) {
  if (!listen || !out)
    return fr_err(FERRY_EINVAL, "ferry_metrics_serve: listen and out are required");
  struct addrinfo *ai = NULL;
  int rc = resolve(listen, &ai);
  if (rc != 0)
    return rc;
  if ((rc = fr_listen_exposure_check(ctx, ai->ai_addr, "metrics", listen)) != 0) {
    freeaddrinfo(ai);
    return rc;
  }
  ferry_metrics_server *s = calloc(1, sizeof *s);
  if (!s) {
    freeaddrinfo(ai);
    return fr_err(FERRY_ENOMEM, "ferry_metrics_serve");
  }
  s->ctx = ctx;
  pthread_mutex_init(&s->lock, NULL);
  rc = fr_http_start("metrics", ai->ai_addr, &LIMITS, on_request, s, NULL, &s->http);
  char host[INET6_ADDRSTRLEN] = "";
  bool v6 = ai->ai_family == AF_INET6;
  inet_ntop(ai->ai_family,
            v6 ? (void *)&((struct sockaddr_in6 *)ai->ai_addr)->sin6_addr
               : (void *)&((struct sockaddr_in *)ai->ai_addr)->sin_addr,
            host, sizeof host);
  freeaddrinfo(ai);
  if (rc != 0) {
    pthread_mutex_destroy(&s->lock);
    free(s);
    return fr_err(FERRY_ESYS, "metrics: cannot listen on %s", listen);
  }
  snprintf(s->address, sizeof s->address, v6 ? "[%s]:%u" : "%s:%u", host, fr_http_port(s->http));
  fr_info("metrics: serving http://%s/metrics", s->address);
  *out = s;
  return 0;
}

const char *ferry_metrics_server_address(const ferry_metrics_server *s) {
  return s ? s->address : NULL;
}

void ferry_metrics_server_close(ferry_metrics_server *s) {
  if (!s)
    return;
  fr_http_stop(s->http);
  pthread_mutex_destroy(&s->lock);
  free(s);
}
