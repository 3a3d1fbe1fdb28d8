/*
 * `ferry ctl serve NAME --http HOST:PORT`: the control cell behind a small HTTP API
 * (libmicrohttpd, one thread per connection, since a request blocks until the ranks ack):
 *
 *   GET  /v1/control/NAME          status (JSON)
 *   POST /v1/control/NAME/clear    request; ?timeout_s=S or a JSON body {"timeout_s": S}
 *   POST /v1/control/NAME/update
 *   POST /v1/control/NAME/abort
 *
 * 200 done, 409 invalid transition (or aborted), 503 busy, 504 timed out, 404 no such cell,
 * 502 a rank or the engine is dead, 401 missing or wrong bearer token when FERRY_TOKEN is set.
 * It binds loopback unless --allow-remote. Each request opens the cell afresh, so the server
 * follows an engine that restarts with a new incarnation.
 */
#include "cli/cli.h"
#include "cli/ctl.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define BODY_MAX 4096

typedef struct server {
  const char *name;
  char prefix[128];  /* "/v1/control/NAME" */
  const char *token; /* NULL: no auth */
} server;

typedef struct request_body {
  char data[BODY_MAX + 1];
  size_t len;
} request_body;

static const char serve_usage[] =
    "usage: ferry ctl serve NAME --http HOST:PORT [--allow-remote]\n"
    "\n"
    "Serves the control cell NAME over HTTP until SIGINT/SIGTERM (PORT 0: any free port; the\n"
    "first line printed says which):\n"
    "  GET  /v1/control/NAME               the status as JSON\n"
    "  POST /v1/control/NAME/clear|update|abort[?timeout_s=S]   (or body {\"timeout_s\": S})\n"
    "Responses are JSON: 200 done, 400 bad request, 401 unauthorized, 404 no such cell or path,\n"
    "409 invalid transition or aborted, 502 a rank or the engine is dead, 503 busy (nothing was\n"
    "issued), 504 timed out. HOST must be a loopback address unless --allow-remote. When\n"
    "FERRY_TOKEN is set, every request needs 'Authorization: Bearer <FERRY_TOKEN>'.\n";

static int http_status(int rc) {
  switch (rc) {
  case FERRY_OK:
    return MHD_HTTP_OK;
  case FERRY_ESTATE:
  case FERRY_ECLOSED:
    return MHD_HTTP_CONFLICT;
  case FERRY_EBUSY:
    return MHD_HTTP_SERVICE_UNAVAILABLE;
  case FERRY_ETIMEDOUT:
    return MHD_HTTP_GATEWAY_TIMEOUT;
  case FERRY_ENOTFOUND:
    return MHD_HTTP_NOT_FOUND;
  case FERRY_EINVAL:
    return MHD_HTTP_BAD_REQUEST;
  case FERRY_EPEER:
  case FERRY_ESTALE:
    return MHD_HTTP_BAD_GATEWAY;
  default:
    return MHD_HTTP_INTERNAL_SERVER_ERROR;
  }
}

static enum MHD_Result send_json(struct MHD_Connection *conn, int code, char *json, size_t len) {
  struct MHD_Response *resp = MHD_create_response_from_buffer(len, json, MHD_RESPMEM_MUST_FREE);
  MHD_add_response_header(resp, "Content-Type", "application/json");
  if (code == MHD_HTTP_UNAUTHORIZED)
    MHD_add_response_header(resp, "WWW-Authenticate", "Bearer");
  enum MHD_Result ret = MHD_queue_response(conn, (unsigned)code, resp);
  MHD_destroy_response(resp);
  return ret;
}

/* {"ok":false,"status":...,"error":...,"detail":...} with the HTTP code of `rc`. */
static enum MHD_Result send_error(struct MHD_Connection *conn, int code, int rc,
                                  const char *detail) {
  char *buf = NULL;
  size_t len = 0;
  FILE *out = open_memstream(&buf, &len);
  fprintf(out, "{\"ok\":false,\"status\":\"%s\",\"error\":", ferry_status_name(rc));
  ctl_json_string(out, ferry_strerror(rc));
  fputs(",\"detail\":", out);
  ctl_json_string(out, detail);
  fputs("}\n", out);
  fclose(out);
  return send_json(conn, code, buf, len);
}

static bool token_ok(const server *s, struct MHD_Connection *conn) {
  if (!s->token)
    return true;
  const char *auth = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
  if (!auth || strncmp(auth, "Bearer ", 7) != 0)
    return false;
  const char *given = auth + 7;
  size_t n = strlen(s->token);
  if (strlen(given) != n)
    return false;
  unsigned char diff = 0; /* constant time in the token's length */
  for (size_t i = 0; i < n; i++)
    diff |= (unsigned char)(given[i] ^ s->token[i]);
  return diff == 0;
}

/* timeout_s from the query string or the JSON body; -1: the default; -2: malformed. */
static int request_timeout(struct MHD_Connection *conn, const request_body *body) {
  const char *q = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "timeout_s");
  if (q)
    return ctl_parse_seconds(q) < 0 ? -2 : ctl_parse_seconds(q);
  const char *key = body ? strstr(body->data, "\"timeout_s\"") : NULL;
  if (!key)
    return -1;
  const char *colon = strchr(key + 11, ':');
  if (!colon)
    return -2;
  char num[32] = {0};
  size_t n = strspn(colon + 1, " \t");
  sscanf(colon + 1 + n, "%31[0-9.]", num);
  int ms = ctl_parse_seconds(num);
  return ms < 0 ? -2 : ms;
}

static enum MHD_Result handle_status(const server *s, struct MHD_Connection *conn) {
  ferry_ctl *ctl = NULL;
  int rc = ferry_ctl_open(s->name, &ctl);
  char *buf = NULL;
  size_t len = 0;
  FILE *out = open_memstream(&buf, &len);
  if (rc == 0)
    rc = ctl_status_json(out, ctl, s->name);
  fputs("\n", out);
  fclose(out);
  ferry_ctl_close(ctl);
  if (rc) {
    free(buf);
    return send_error(conn, http_status(rc), rc, ferry_last_error());
  }
  return send_json(conn, MHD_HTTP_OK, buf, len);
}

static enum MHD_Result handle_request(const server *s, struct MHD_Connection *conn,
                                      ferry_ctl_cmd cmd, const request_body *body) {
  int timeout_ms = request_timeout(conn, body);
  if (timeout_ms == -2)
    return send_error(conn, MHD_HTTP_BAD_REQUEST, FERRY_EINVAL, "timeout_s wants seconds");
  ferry_ctl *ctl = NULL;
  int rc = ferry_ctl_open(s->name, &ctl);
  if (rc == 0)
    rc = ferry_ctl_request(ctl, cmd, timeout_ms);
  char detail[512];
  snprintf(detail, sizeof detail, "%s", rc ? ferry_last_error() : "");
  char *buf = NULL;
  size_t len = 0;
  FILE *out = open_memstream(&buf, &len);
  fprintf(out, "{\"ok\":%s,\"command\":\"%s\",\"status\":\"%s\",\"error\":", rc ? "false" : "true",
          ferry_ctl_cmd_name(cmd), ferry_status_name(rc));
  ctl_json_string(out, rc ? ferry_strerror(rc) : "");
  fputs(",\"detail\":", out);
  ctl_json_string(out, detail);
  ferry_ctl_status st = {.size = sizeof st};
  if (ctl && ferry_ctl_status_get(ctl, &st) == 0)
    fprintf(out, ",\"state\":\"%s\",\"seq\":%lu", ferry_ctl_state_name(st.state),
            (unsigned long)st.seq);
  fputs("}\n", out);
  fclose(out);
  ferry_ctl_close(ctl);
  return send_json(conn, http_status(rc), buf, len);
}

static enum MHD_Result route(const server *s, struct MHD_Connection *conn, const char *url,
                             const char *method, const request_body *body) {
  if (!token_ok(s, conn))
    return send_error(conn, MHD_HTTP_UNAUTHORIZED, FERRY_EAUTH, "missing or wrong bearer token");
  size_t plen = strlen(s->prefix);
  if (strncmp(url, s->prefix, plen) != 0 || (url[plen] != '\0' && url[plen] != '/'))
    return send_error(conn, MHD_HTTP_NOT_FOUND, FERRY_ENOTFOUND, "no such path");
  const char *rest = url + plen;
  bool get = strcmp(method, "GET") == 0, post = strcmp(method, "POST") == 0;
  if (*rest == '\0')
    return get ? handle_status(s, conn)
               : send_error(conn, MHD_HTTP_METHOD_NOT_ALLOWED, FERRY_EINVAL, "use GET");
  ferry_ctl_cmd cmd;
  if (ferry_ctl_cmd_parse(rest + 1, &cmd) != 0)
    return send_error(conn, MHD_HTTP_NOT_FOUND, FERRY_ENOTFOUND, "no such command");
  return post ? handle_request(s, conn, cmd, body)
              : send_error(conn, MHD_HTTP_METHOD_NOT_ALLOWED, FERRY_EINVAL, "use POST");
}

/* libmicrohttpd calls this first with the headers, then once per body chunk, then with an
 * empty chunk: the body is gathered (up to BODY_MAX) and the request answered at the end. */
static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls) {
  request_body *body = *con_cls;
  if (!body) {
    body = calloc(1, sizeof *body);
    *con_cls = body;
    return body ? MHD_YES : MHD_NO;
  }
  if (*upload_data_size > 0) {
    size_t room = BODY_MAX - body->len;
    size_t n = *upload_data_size < room ? *upload_data_size : room;
    memcpy(body->data + body->len, upload_data, n);
    body->len += n;
    *upload_data_size = 0;
    return MHD_YES;
  }
  return route(cls, conn, url, method, body);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
  free(*con_cls);
  *con_cls = NULL;
}

static int parse_listen(const char *text, bool allow_remote, struct sockaddr_in *sa) {
  char host[64];
  const char *colon = text ? strrchr(text, ':') : NULL;
  if (!colon || (size_t)(colon - text) >= sizeof host) {
    fprintf(stderr, "ferry ctl serve: --http wants HOST:PORT\n");
    return CLI_USAGE;
  }
  snprintf(host, sizeof host, "%.*s", (int)(colon - text), text);
  char *end = NULL;
  long port = strtol(colon + 1, &end, 10);
  memset(sa, 0, sizeof *sa);
  sa->sin_family = AF_INET;
  sa->sin_port = htons((uint16_t)port);
  if (strcmp(host, "localhost") == 0)
    snprintf(host, sizeof host, "127.0.0.1");
  if (*end || port < 0 || port > 65535 || inet_pton(AF_INET, host, &sa->sin_addr) != 1) {
    fprintf(stderr, "ferry ctl serve: bad address '%s' (IPv4 HOST:PORT)\n", text);
    return CLI_USAGE;
  }
  if ((ntohl(sa->sin_addr.s_addr) >> 24) != 127 && !allow_remote) {
    fprintf(stderr,
            "ferry ctl serve: %s is not loopback; pass --allow-remote (and set "
            "FERRY_TOKEN) to serve beyond this host\n",
            host);
    return CLI_USAGE;
  }
  return CLI_OK;
}

static int parse_serve_args(int argc, char **argv, server *s, struct sockaddr_in *sa) {
  const char *listen = NULL;
  bool allow_remote = false;
  for (int i = 2; i < argc; i++) {
    if (strcmp(argv[i], "--http") == 0 && i + 1 < argc)
      listen = argv[++i];
    else if (strcmp(argv[i], "--allow-remote") == 0)
      allow_remote = true;
    else {
      fprintf(stderr, "ferry ctl serve: unknown option '%s' (--help)\n", argv[i]);
      return CLI_USAGE;
    }
  }
  if (!listen) {
    fprintf(stderr, "ferry ctl serve: --http HOST:PORT is required\n");
    return CLI_USAGE;
  }
  s->name = argv[1];
  snprintf(s->prefix, sizeof s->prefix, "/v1/control/%s", s->name);
  const char *token = ferry_config_get("FERRY_TOKEN");
  s->token = token && *token ? token : NULL;
  return parse_listen(listen, allow_remote, sa);
}

int ctl_serve(int argc, char **argv) {
  if (argc < 2 || strcmp(argv[1], "--help") == 0 || (argc > 2 && !strcmp(argv[2], "--help"))) {
    fputs(serve_usage, argc < 2 ? stderr : stdout);
    return argc < 2 ? CLI_USAGE : CLI_OK;
  }
  server s;
  struct sockaddr_in sa;
  int code = parse_serve_args(argc, argv, &s, &sa);
  if (code != CLI_OK)
    return code;
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, NULL); /* before MHD's threads start, so they inherit it */
  struct MHD_Daemon *d = MHD_start_daemon(
      MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION, 0, NULL, NULL, on_request,
      &s, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa, MHD_OPTION_NOTIFY_COMPLETED, on_completed,
      NULL, MHD_OPTION_CONNECTION_TIMEOUT, 3600u, MHD_OPTION_END);
  if (!d) {
    fprintf(stderr, "ferry ctl serve: cannot listen on %s:%d\n", inet_ntoa(sa.sin_addr),
            ntohs(sa.sin_port));
    return CLI_FAIL;
  }
  const union MHD_DaemonInfo *info = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
  printf("serving control cell '%s' on http://%s:%u%s\n", s.name, inet_ntoa(sa.sin_addr),
         info ? info->port : ntohs(sa.sin_port), s.prefix);
  fflush(stdout);
  int sig = 0;
  sigwait(&sigs, &sig);
  MHD_stop_daemon(d);
  return CLI_OK;
}
