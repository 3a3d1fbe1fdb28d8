/*
 * `ferry ctl serve NAME --http HOST:PORT`: the control cell behind a small HTTP API
 * (libmicrohttpd, one thread per connection, since a request blocks until the ranks ack; idle
 * connections are closed and their number is bounded, see ctl_serve):
 *
 *   GET  /v1/control/NAME          status (JSON)
 *   POST /v1/control/NAME/clear    request; ?timeout_s=S or a JSON body {"timeout_s": S}
 *   POST /v1/control/NAME/update
 *   POST /v1/control/NAME/abort
 *
 * A body is optional; when present it is one JSON object (jansson), read whole (up to BODY_MAX,
 * however many pieces it arrives in) before it is parsed. The POSTs know one field, timeout_s,
 * a number of seconds in (0, 86400]; GET knows none. Anything else is refused with 400 rather
 * than ignored, so that a typo ("timeout": 2) does not silently run with the default timeout.
 * Every response, errors included, is a JSON object built with jansson.
 *
 * 200 done, 400 bad request, 409 invalid transition (or aborted), 503 busy, 504 timed out,
 * 404 no such cell or path, 405 wrong method, 413 body over BODY_MAX, 502 a rank or the engine
 * is dead, 401 missing or wrong bearer token. The API wants 'Authorization: Bearer TOKEN', TOKEN
 * being FERRY_TOKEN when it is set, else this user's own secret (FERRY_TOKEN_FILE, ~/.ferry/token,
 * the one links prove): as with links, another local user, who cannot read it, is refused.
 * It binds loopback unless --allow-remote. It also serves, with no token (read-only, as
 * Prometheus scrapes and probes ask), the process's metrics at /metrics (Prometheus text: the
 * requests it made), /healthz (the server answers) and /readyz (the cell can be opened: its
 * engine is there). Each request opens the cell afresh, so the server follows an engine that
 * restarts with a new incarnation. Slow clients cannot hold its connections (http_guard.c).
 */
#include "cli/args.h"
#include "cli/cli.h"
#include "cli/ctl.h"
#include "core/core.h"
#include "transport/http_guard.h"

#include <arpa/inet.h>
#include <jansson.h>
#include <math.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define BODY_MAX 4096
#define TIMEOUT_MAX_S 86400.0

typedef struct server {
  const char *name;
  char prefix[128]; /* "/v1/control/NAME" */
  char *token;      /* FERRY_TOKEN, or this user's secret: every API request must bear it */
} server;

/* One request's state across libmicrohttpd's calls. */
typedef struct request_body {
  char data[BODY_MAX];
  size_t len;
  bool too_big;  /* more than BODY_MAX arrived: the rest is dropped and the answer is 413 */
  bool answered; /* a response went out before the body (401, 413 by Content-Length) */
} request_body;

static const char serve_usage[] =
    "usage: ferry ctl serve NAME --http HOST:PORT [--allow-remote]\n"
    "\n"
    "Serves the control cell NAME over HTTP until SIGINT/SIGTERM (PORT 0: any free port; the\n"
    "first line printed says which):\n"
    "  GET  /v1/control/NAME               the status as JSON\n"
    "  POST /v1/control/NAME/clear|update|abort[?timeout_s=S]   (or body {\"timeout_s\": S})\n"
    "  GET  /metrics, /healthz, /readyz    Prometheus metrics, liveness, readiness (no token)\n"
    "A body is optional; when given it must be a JSON object of at most 4096 bytes whose only\n"
    "field is timeout_s (a number of seconds, > 0 and <= 86400; not with ?timeout_s as well).\n"
    "Responses are JSON: 200 done, 400 bad request (malformed JSON, unknown field, wrong type or\n"
    "range), 401 unauthorized, 404 no such cell or path, 405 wrong method, 409 invalid transition\n"
    "or aborted, 413 body too large, 502 a rank or the engine is dead, 503 busy (nothing was\n"
    "issued), 504 timed out. HOST must be a loopback address unless --allow-remote.\n"
    "Every /v1 request needs 'Authorization: Bearer TOKEN': FERRY_TOKEN when set, else this\n"
    "user's secret, the file FERRY_TOKEN_FILE (default ~/.ferry/token), e.g.\n"
    "  curl -H \"Authorization: Bearer $(cat ~/.ferry/token)\" "
    "http://127.0.0.1:PORT/v1/control/NAME\n"
    "A client that has not sent a whole request within FERRY_HTTP_HEADER_MS is disconnected.\n";

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

/* ---- JSON out ---- */

/* A JSON string of s. jansson takes UTF-8 only, and a rank's message or an echoed field name
 * may hold other bytes: those become '?' rather than losing the whole response. */
static json_t *jstr(const char *s) {
  json_t *j = json_string(s ? s : "");
  if (j || !s)
    return j;
  char *copy = strdup(s);
  if (!copy)
    return NULL;
  for (unsigned char *p = (unsigned char *)copy; *p; p++)
    if (*p >= 0x80)
      *p = '?';
  j = json_string(copy);
  free(copy);
  return j;
}

/* Sends obj (taking it) as the body, one line of compact JSON. A response that cannot be built
 * (out of memory) closes the connection, which the client sees as an error too. */
static enum MHD_Result send_json(struct MHD_Connection *conn, int code, json_t *obj,
                                 const char *allow) {
  char *text = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
  json_decref(obj);
  size_t len = text ? strlen(text) : 0;
  char *body = text ? realloc(text, len + 2) : NULL;
  if (!body) {
    free(text);
    return MHD_NO;
  }
  body[len++] = '\n';
  body[len] = '\0';
  struct MHD_Response *resp = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
  if (!resp) {
    free(body);
    return MHD_NO;
  }
  MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
  if (code == MHD_HTTP_UNAUTHORIZED)
    MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
  if (allow)
    MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
  enum MHD_Result ret = MHD_queue_response(conn, (unsigned)code, resp);
  MHD_destroy_response(resp);
  return ret;
}

/* {"ok":false,"status":...,"error":...,"detail":...} with HTTP status `code`. */
static enum MHD_Result send_error_allow(struct MHD_Connection *conn, int code, int rc,
                                        const char *detail, const char *allow) {
  json_t *o = json_object();
  json_object_set_new(o, "ok", json_false());
  json_object_set_new(o, "status", json_string(ferry_status_name(rc)));
  json_object_set_new(o, "error", jstr(ferry_strerror(rc)));
  json_object_set_new(o, "detail", jstr(detail));
  return send_json(conn, code, o, allow);
}

static enum MHD_Result send_error(struct MHD_Connection *conn, int code, int rc,
                                  const char *detail) {
  return send_error_allow(conn, code, rc, detail, NULL);
}

static enum MHD_Result bad_request(struct MHD_Connection *conn, const char *detail) {
  return send_error(conn, MHD_HTTP_BAD_REQUEST, FERRY_EINVAL, detail);
}

static enum MHD_Result too_large(struct MHD_Connection *conn) {
  char detail[64];
  snprintf(detail, sizeof detail, "the body is over %d bytes", BODY_MAX);
  return send_error(conn, MHD_HTTP_CONTENT_TOO_LARGE, FERRY_ERANGE, detail);
}

static json_t *rank_object(const ferry_ctl_rank_status *r) {
  json_t *o = json_object();
  json_object_set_new(o, "rank", json_integer(r->rank));
  json_object_set_new(o, "pid", json_integer(r->pid));
  json_object_set_new(o, "alive", json_boolean(r->alive));
  json_object_set_new(o, "seq", json_integer((json_int_t)r->seq));
  json_object_set_new(o, "state", json_string(ferry_ctl_state_name(r->state)));
  json_object_set_new(o, "fail_seq", json_integer((json_int_t)r->fail_seq));
  json_object_set_new(o, "error", json_string(r->fail_seq ? ferry_status_name(r->error) : ""));
  char message[sizeof r->message + 1];
  snprintf(message, sizeof message, "%.*s", (int)sizeof r->message, r->message);
  json_object_set_new(o, "message", jstr(message));
  return o;
}

/* The cell's status, the same fields as `ferry ctl NAME status --json`. */
static int status_object(ferry_ctl *ctl, const char *name, json_t **out) {
  ferry_ctl_status st = {.size = sizeof st};
  int rc = ferry_ctl_status_get(ctl, &st);
  if (rc)
    return rc;
  json_t *o = json_object(), *ranks = json_array();
  json_object_set_new(o, "name", jstr(name));
  json_object_set_new(o, "incarnation", json_integer((json_int_t)st.incarnation));
  json_object_set_new(o, "engine_pid", json_integer(st.engine_pid));
  json_object_set_new(o, "engine_alive", json_boolean(st.engine_alive));
  json_object_set_new(o, "seq", json_integer((json_int_t)st.seq));
  json_object_set_new(o, "command", json_string(ferry_ctl_cmd_name(st.cmd)));
  json_object_set_new(o, "in_flight", json_boolean(st.in_flight));
  json_object_set_new(o, "state", json_string(ferry_ctl_state_name(st.state)));
  json_object_set_new(o, "agreed", json_boolean(st.agreed));
  for (uint32_t i = 0; i < st.nranks && rc == 0; i++) {
    ferry_ctl_rank_status r = {.size = sizeof r};
    if ((rc = ferry_ctl_rank_status_get(ctl, i, &r)) == 0)
      json_array_append_new(ranks, rank_object(&r));
  }
  json_object_set_new(o, "ranks", ranks);
  if (rc)
    json_decref(o);
  else
    *out = o;
  return rc;
}

/* ---- JSON and arguments in ---- */

static bool token_ok(const server *s, struct MHD_Connection *conn) {
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

/* The body as a JSON object: an empty (or all-whitespace) body reads as {}; anything else must
 * be exactly one object without duplicate keys. NULL, with why in err, when it is not. */
static json_t *parse_body(const request_body *body, char *err, size_t errlen) {
  size_t i = 0;
  while (i < body->len && (body->data[i] == ' ' || body->data[i] == '\t' || body->data[i] == '\r' ||
                           body->data[i] == '\n'))
    i++;
  if (i == body->len)
    return json_object();
  json_error_t e;
  json_t *j = json_loadb(body->data, body->len, JSON_REJECT_DUPLICATES, &e);
  if (!j) {
    snprintf(err, errlen, "the body is not valid JSON: %s (line %d, column %d)", e.text, e.line,
             e.column);
    return NULL;
  }
  if (!json_is_object(j)) {
    snprintf(err, errlen, "the body must be a JSON object");
    json_decref(j);
    return NULL;
  }
  return j;
}

/* Refuses a field of obj other than `allowed` (a field name; "" for none). */
static int check_fields(json_t *obj, const char *allowed, char *err, size_t errlen) {
  const char *key;
  json_t *value;
  json_object_foreach(obj, key, value) {
    if (strcmp(key, allowed) != 0) {
      snprintf(err, errlen, "unknown field '%.64s' in the body (this endpoint takes %s%s)", key,
               *allowed ? "only " : "no fields", allowed);
      return -1;
    }
  }
  return 0;
}

typedef struct query_check {
  const char *allowed;
  char *err;
  size_t errlen;
  bool bad;
} query_check;

static enum MHD_Result check_query_arg(void *cls, enum MHD_ValueKind kind, const char *key,
                                       const char *value) {
  query_check *q = cls;
  if (strcmp(key, q->allowed) != 0)
    snprintf(q->err, q->errlen, "unknown query argument '%.64s' (this endpoint takes %s%s)", key,
             *q->allowed ? "only " : "none", q->allowed);
  else if (!value)
    snprintf(q->err, q->errlen, "query argument %s wants a value", key);
  else
    return MHD_YES;
  q->bad = true;
  return MHD_NO;
}

/* Seconds as milliseconds (a part of a millisecond counts as one); -1 outside (0, a day]. */
static int seconds_ms(double s) {
  if (!(s > 0 && s <= TIMEOUT_MAX_S)) /* NaN fails too */
    return -1;
  return (int)ceil(s * 1000.0);
}

static const char *json_type_name(const json_t *j) {
  switch (json_typeof(j)) {
  case JSON_OBJECT:
    return "an object";
  case JSON_ARRAY:
    return "an array";
  case JSON_STRING:
    return "a string";
  case JSON_TRUE:
  case JSON_FALSE:
    return "a boolean";
  case JSON_NULL:
    return "null";
  default:
    return "a number";
  }
}

/* timeout_s from the query string or the body (not both) into *timeout_ms; -1 when absent (the
 * default). Returns -1, with why in err, when it is malformed or out of range. */
static int request_timeout(struct MHD_Connection *conn, json_t *body, int *timeout_ms, char *err,
                           size_t errlen) {
  const char *q = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "timeout_s");
  json_t *b = json_object_get(body, "timeout_s");
  *timeout_ms = -1;
  if (q && b) {
    snprintf(err, errlen, "timeout_s is given twice (query and body)");
    return -1;
  }
  if (q) {
    char *end = NULL;
    double s = strtod(q, &end);
    if (end == q || *end || (*timeout_ms = seconds_ms(s)) < 0) {
      snprintf(err, errlen, "timeout_s=%.32s: want seconds, > 0 and <= %.0f", q, TIMEOUT_MAX_S);
      return -1;
    }
  } else if (b) {
    if (!json_is_number(b)) {
      snprintf(err, errlen, "timeout_s must be a number of seconds, not %s", json_type_name(b));
      return -1;
    }
    if ((*timeout_ms = seconds_ms(json_number_value(b))) < 0) {
      snprintf(err, errlen, "timeout_s %g is out of range: want > 0 and <= %.0f",
               json_number_value(b), TIMEOUT_MAX_S);
      return -1;
    }
  }
  return 0;
}

/* The body and query arguments of a request to an endpoint that takes `allowed` (one name or
 * ""), parsed and checked; NULL after answering 400. */
static json_t *request_args(struct MHD_Connection *conn, const request_body *body,
                            const char *allowed, enum MHD_Result *answered) {
  char err[256] = "";
  query_check q = {allowed, err, sizeof err, false};
  MHD_get_connection_values(conn, MHD_GET_ARGUMENT_KIND, check_query_arg, &q);
  json_t *args = q.bad ? NULL : parse_body(body, err, sizeof err);
  if (args && check_fields(args, allowed, err, sizeof err) != 0) {
    json_decref(args);
    args = NULL;
  }
  if (!args)
    *answered = bad_request(conn, err);
  return args;
}

/* ---- endpoints ---- */

static enum MHD_Result handle_status(const server *s, struct MHD_Connection *conn,
                                     const request_body *body) {
  enum MHD_Result ret;
  json_t *args = request_args(conn, body, "", &ret);
  if (!args)
    return ret;
  json_decref(args);
  ferry_ctl *ctl = NULL;
  json_t *status = NULL;
  int rc = ferry_ctl_open(s->name, &ctl);
  if (rc == 0)
    rc = status_object(ctl, s->name, &status);
  fr_err_keep keep;
  fr_err_save(&keep, rc);
  ferry_ctl_close(ctl);
  if (rc)
    return send_error(conn, http_status(rc), rc, keep.detail);
  return send_json(conn, MHD_HTTP_OK, status, NULL);
}

static enum MHD_Result handle_request(const server *s, struct MHD_Connection *conn,
                                      ferry_ctl_cmd cmd, const request_body *body) {
  enum MHD_Result ret;
  json_t *args = request_args(conn, body, "timeout_s", &ret);
  if (!args)
    return ret;
  char err[256];
  int timeout_ms;
  int bad = request_timeout(conn, args, &timeout_ms, err, sizeof err);
  json_decref(args);
  if (bad)
    return bad_request(conn, err);
  ferry_ctl *ctl = NULL;
  int rc = ferry_ctl_open(s->name, &ctl);
  if (rc == 0)
    rc = ferry_ctl_request(ctl, cmd, timeout_ms);
  fr_err_keep keep;
  fr_err_save(&keep, rc);
  json_t *o = json_object();
  json_object_set_new(o, "ok", json_boolean(rc == 0));
  json_object_set_new(o, "command", json_string(ferry_ctl_cmd_name(cmd)));
  json_object_set_new(o, "status", json_string(ferry_status_name(rc)));
  json_object_set_new(o, "error", jstr(rc ? ferry_strerror(rc) : ""));
  json_object_set_new(o, "detail", jstr(rc ? keep.detail : ""));
  ferry_ctl_status st = {.size = sizeof st};
  if (ctl && ferry_ctl_status_get(ctl, &st) == 0) {
    json_object_set_new(o, "state", json_string(ferry_ctl_state_name(st.state)));
    json_object_set_new(o, "seq", json_integer((json_int_t)st.seq));
  }
  ferry_ctl_close(ctl);
  return send_json(conn, http_status(rc), o, NULL);
}

static enum MHD_Result send_text(struct MHD_Connection *conn, int code, const char *type,
                                 char *text, size_t len, enum MHD_ResponseMemoryMode mode) {
  struct MHD_Response *r = MHD_create_response_from_buffer(len, text, mode);
  if (!r)
    return MHD_NO;
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  enum MHD_Result ret = MHD_queue_response(conn, (unsigned)code, r);
  MHD_destroy_response(r);
  return ret;
}

static bool ops_path(const char *url) {
  return !strcmp(url, "/metrics") || !strcmp(url, "/healthz") || !strcmp(url, "/readyz");
}

/* /metrics, /healthz, /readyz: what an operator's probes and Prometheus read. */
static enum MHD_Result route_ops(const server *s, struct MHD_Connection *conn, const char *url) {
  static const char plain[] = "text/plain; charset=utf-8";
  if (!strcmp(url, "/healthz"))
    return send_text(conn, MHD_HTTP_OK, plain, "ok\n", 3, MHD_RESPMEM_PERSISTENT);
  if (!strcmp(url, "/readyz")) {
    ferry_ctl *ctl = NULL;
    int rc = ferry_ctl_open(s->name, &ctl);
    ferry_ctl_close(ctl);
    char line[600];
    int n = snprintf(line, sizeof line, "%s\n", rc == 0 ? "ready" : ferry_last_error());
    return send_text(conn, rc == 0 ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE, plain, line,
                     (size_t)n < sizeof line ? (size_t)n : sizeof line - 1, MHD_RESPMEM_MUST_COPY);
  }
  char *text = NULL;
  size_t len = 0;
  if (ferry_stats_prometheus(NULL, &text, &len) != 0)
    return send_error(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, FERRY_ENOMEM, "metrics");
  enum MHD_Result ret = send_text(conn, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8",
                                  text, len, MHD_RESPMEM_MUST_COPY);
  ferry_stats_text_free(text);
  return ret;
}

static enum MHD_Result route(const server *s, struct MHD_Connection *conn, const char *url,
                             const char *method, const request_body *body) {
  if (ops_path(url))
    return strcmp(method, "GET") == 0 ? route_ops(s, conn, url)
                                      : send_error_allow(conn, MHD_HTTP_METHOD_NOT_ALLOWED,
                                                         FERRY_EINVAL, "use GET", "GET");
  if (fr_http_reserved(conn))
    return send_error(conn, MHD_HTTP_SERVICE_UNAVAILABLE, FERRY_EBUSY,
                      "every connection is taken: only /healthz, /readyz and /metrics answer");
  if (!token_ok(s, conn))
    return send_error(conn, MHD_HTTP_UNAUTHORIZED, FERRY_EAUTH, "missing or wrong bearer token");
  size_t plen = strlen(s->prefix);
  if (strncmp(url, s->prefix, plen) != 0 || (url[plen] != '\0' && url[plen] != '/'))
    return send_error(conn, MHD_HTTP_NOT_FOUND, FERRY_ENOTFOUND, "no such path");
  const char *rest = url + plen;
  bool get = strcmp(method, "GET") == 0, post = strcmp(method, "POST") == 0;
  if (*rest == '\0')
    return get ? handle_status(s, conn, body)
               : send_error_allow(conn, MHD_HTTP_METHOD_NOT_ALLOWED, FERRY_EINVAL, "use GET",
                                  "GET");
  ferry_ctl_cmd cmd;
  if (ferry_ctl_cmd_parse(rest + 1, &cmd) != 0)
    return send_error(conn, MHD_HTTP_NOT_FOUND, FERRY_ENOTFOUND, "no such command");
  return post ? handle_request(s, conn, cmd, body)
              : send_error_allow(conn, MHD_HTTP_METHOD_NOT_ALLOWED, FERRY_EINVAL, "use POST",
                                 "POST");
}

/* The first call, with the headers only: a request that cannot succeed (no token, or a declared
 * body over BODY_MAX) is answered before its body is read. */
static enum MHD_Result on_headers(const server *s, struct MHD_Connection *conn, const char *url,
                                  request_body *body) {
  if (!ops_path(url) && !token_ok(s, conn)) {
    body->answered = true;
    fr_http_request_read(conn);
    return send_error(conn, MHD_HTTP_UNAUTHORIZED, FERRY_EAUTH, "missing or wrong bearer token");
  }
  const char *length =
      MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
  if (length && strtoull(length, NULL, 10) > BODY_MAX) {
    body->answered = true;
    fr_http_request_read(conn);
    return too_large(conn);
  }
  return MHD_YES;
}

/* libmicrohttpd calls this first with the headers, then once per piece of the body (as it
 * arrives, or per chunk of a chunked upload), then with an empty piece: the pieces are gathered
 * and the request answered at the end, with 413 when they came to more than BODY_MAX. */
static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls) {
  request_body *body = *con_cls;
  if (!body) {
    if (!(body = calloc(1, sizeof *body)))
      return MHD_NO;
    *con_cls = body;
    return on_headers(cls, conn, url, body);
  }
  if (*upload_data_size > 0) {
    size_t n = *upload_data_size;
    if (!body->too_big && n <= BODY_MAX - body->len) {
      memcpy(body->data + body->len, upload_data, n);
      body->len += n;
    } else {
      body->too_big = true;
    }
    *upload_data_size = 0;
    return MHD_YES;
  }
  fr_http_request_read(conn);
  if (body->answered)
    return MHD_YES;
  if (body->too_big)
    return too_large(conn);
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
  const cli_opt opts[] = {{"http", CLI_ARG_STR, &listen, 0, 0},
                          {"allow-remote", CLI_ARG_FLAG, &allow_remote, 0, 0},
                          {0}};
  const cli_cmd cmd = {"ctl serve", serve_usage, "NAME", 1, 1, opts};
  char **pos = NULL;
  if (cli_parse(&cmd, argc, argv, &pos) < 0)
    return CLI_USAGE;
  if (!listen)
    return cli_usage_error(&cmd, "--http HOST:PORT is required");
  s->name = pos[0];
  snprintf(s->prefix, sizeof s->prefix, "/v1/control/%s", s->name);
  return parse_listen(listen, allow_remote, sa);
}

/* The token every API request must bear: FERRY_TOKEN, else this user's secret (made when there
 * is none yet), as links use. */
static int load_token(server *s) {
  const char *token = ferry_config_get("FERRY_TOKEN");
  int rc = token && *token ? fr_token_check(token, "FERRY_TOKEN") : fr_user_token(&s->token);
  if (rc == 0 && !s->token && !(s->token = strdup(token)))
    rc = fr_err(FERRY_ENOMEM, "token");
  if (rc != 0)
    fprintf(stderr, "ferry ctl serve: %s\n", ferry_last_error());
  return rc;
}

/* Half-sent requests must not pin the server (http_guard.c): a request must arrive whole within
 * FERRY_HTTP_HEADER_MS, a connection idle for idle_s (nothing received or sent; a request waiting
 * for its ranks' acks is not idle, it runs in its handler) is closed, and past `connections` open
 * at once (a thread each, with a small stack), or past one address's share, a new connection
 * closes the oldest one still sending its request; when every one is answering, a few reserved
 * slots still answer /healthz, /readyz and /metrics. */
static const fr_http_limits LIMITS = {
    .connections = 512, .per_address = 64, .reserved = 8, .idle_s = 30, .thread_stack = 256 << 10};

int ctl_serve(int argc, char **argv) {
  server s = {0};
  struct sockaddr_in sa;
  int code = parse_serve_args(argc, argv, &s, &sa);
  if (code != CLI_OK)
    return code;
  if (load_token(&s) != 0)
    return CLI_FAIL;
  cli_server_logging();
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, NULL); /* before MHD's threads start, so they inherit it */
  fr_http_server *d = NULL;
  if (fr_http_start("ctl serve", (struct sockaddr *)&sa, &LIMITS, on_request, &s, on_completed,
                    &d) != 0) {
    fprintf(stderr, "ferry ctl serve: cannot listen on %s:%d\n", inet_ntoa(sa.sin_addr),
            ntohs(sa.sin_port));
    free(s.token);
    return CLI_FAIL;
  }
  unsigned port = fr_http_port(d);
  printf("serving control cell '%s' on http://%s:%u%s\n", s.name, inet_ntoa(sa.sin_addr),
         port ? port : ntohs(sa.sin_port), s.prefix);
  fflush(stdout);
  int sig = 0;
  sigwait(&sigs, &sig);
  fr_http_stop(d);
  free(s.token);
  return CLI_OK;
}
