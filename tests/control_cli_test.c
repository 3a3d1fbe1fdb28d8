/*
 * `ferry ctl` from the outside: the shell commands and their exit codes against a pretend engine
 * (`ferry ctl engine`), and the HTTP server (`ferry ctl serve`) driven by a raw socket client,
 * with ranks that hold a command on a pipe so that busy (503) and timeout (504) are
 * deterministic. Runs the real binary named by FERRY_CLI.
 */
// ferry-test: threaded
#include "testutil.h"

#include "core/core.h"

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[64];
static char name[64];
static const char *cli;
static char *secret;    /* this user's (fr_user_token): ctl serve wants it, FERRY_TOKEN unset */
static char auth[1200]; /* "Authorization: Bearer <secret>\r\n", for requests written by hand */

/* ---- processes ---- */

typedef struct child {
  pid_t pid;
  int out; /* its stdout */
} child;

static child spawn_cli(const char *const *args) {
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  pid_t pid = tu_fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    close(fds[0]);
    close(fds[1]);
    char *argv[16] = {(char *)cli};
    for (int i = 0; args[i] && i < 14; i++)
      argv[i + 1] = (char *)args[i];
    execv(cli, argv);
    _exit(127);
  }
  close(fds[1]);
  return (child){pid, fds[0]};
}

/* Reads the child's stdout up to len-1 bytes or EOF. */
static void read_all(int fd, char *buf, size_t len) {
  size_t n = 0;
  ssize_t r;
  while (n + 1 < len && (r = read(fd, buf + n, len - 1 - n)) > 0)
    n += (size_t)r;
  buf[n] = '\0';
}

static void read_line(int fd, char *buf, size_t len) {
  size_t n = 0;
  while (n + 1 < len) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    assert_true(poll(&p, 1, 20000) == 1);
    if (read(fd, buf + n, 1) != 1 || buf[n] == '\n')
      break;
    n++;
  }
  buf[n] = '\0';
}

/* Runs `ferry ARGS...`; returns the exit code and its stdout in out. */
static int run(char *out, size_t len, const char *const *args) {
  child c = spawn_cli(args);
  read_all(c.out, out, len);
  close(c.out);
  return tu_wait(c.pid);
}

#define RUN(out, ...) run(out, sizeof out, (const char *const[]){__VA_ARGS__, NULL})

static void stop_child(child *c, int expect) {
  kill(c->pid, SIGTERM);
  assert_int_equal(tu_wait(c->pid), expect);
  close(c->out);
}

/* ---- HTTP ---- */

/* Sends the pieces of a request, each with its own write, and reads the whole response (the
 * server closes); returns the HTTP status. */
static int http_pieces(int port, const char *const *pieces, char *resp, size_t len) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  for (int i = 0; pieces[i]; i++)
    assert_int_equal(write(fd, pieces[i], strlen(pieces[i])), (ssize_t)strlen(pieces[i]));
  read_all(fd, resp, len);
  close(fd);
  int code = 0;
  assert_int_equal(sscanf(resp, "HTTP/1.%*d %d", &code), 1);
  return code;
}

/* token NULL: this user's secret, as a client of the same user sends; "": none. */
static int http(int port, const char *method, const char *path, const char *token, const char *body,
                char *resp, size_t len) {
  char head[2048], line[1200] = "";
  if (!token)
    token = secret;
  if (*token)
    snprintf(line, sizeof line, "Authorization: Bearer %s\r\n", token);
  snprintf(head, sizeof head,
           "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s"
           "Content-Length: %zu\r\n\r\n",
           method, path, line, body ? strlen(body) : 0);
  return http_pieces(port, (const char *const[]){head, body ? body : "", NULL}, resp, len);
}

/* The response's body, which must be one JSON object. */
static json_t *resp_json(const char *resp) {
  const char *body = strstr(resp, "\r\n\r\n");
  assert_non_null(body);
  json_error_t err;
  json_t *j = json_loads(body + 4, 0, &err);
  if (!j)
    fail_msg("response body is not JSON (%s): %s", err.text, body + 4);
  assert_true(json_is_object(j));
  return j;
}

/* A 400 whose JSON body says FERRY_EINVAL, with `detail` in its detail. */
static void assert_bad_request(int port, const char *path, const char *body, const char *detail) {
  char resp[8192];
  assert_int_equal(http(port, "POST", path, NULL, body, resp, sizeof resp), 400);
  json_t *j = resp_json(resp);
  assert_string_equal(json_string_value(json_object_get(j, "status")), "FERRY_EINVAL");
  assert_non_null(json_string_value(json_object_get(j, "error")));
  const char *d = json_string_value(json_object_get(j, "detail"));
  assert_non_null(d);
  if (!strstr(d, detail))
    fail_msg("body %s: detail '%s' does not say '%s'", body, d, detail);
  json_decref(j);
}

/* ---- fixtures ---- */

static int group_setup(void **state) {
  cli = getenv("FERRY_CLI");
  assert_non_null(cli);
  snprintf(dir, sizeof dir, "/dev/shm/ferry-clitest-XXXXXX");
  assert_non_null(mkdtemp(dir));
  setenv("FERRY_CTL_DIR", dir, 1);
  setenv("FERRY_CTL_CHECK_MS", "20", 1);
  unsetenv("FERRY_TOKEN");
  signal(SIGPIPE, SIG_IGN);
  FR_OK(fr_user_token(&secret));
  snprintf(auth, sizeof auth, "Authorization: Bearer %s\r\n", secret);
  return 0;
}

static int group_teardown(void **state) {
  tu_rmdir_files(dir);
  free(secret);
  return 0;
}

static int setup(void **state) {
  static int counter;
  snprintf(name, sizeof name, "cli%d-%d", (int)getpid(), ++counter);
  return 0;
}

/* ---- the shell commands ---- */

static void test_help_and_usage(void **state) {
  char out[4096];
  assert_int_equal(RUN(out, "ctl", "--help"), 0);
  assert_non_null(strstr(out, "exit status"));
  assert_int_equal(RUN(out, "ctl", "serve", "--help"), 0);
  assert_non_null(strstr(out, "/v1/control/NAME"));
  assert_int_equal(RUN(out, "ctl", "engine", "--help"), 0);
  assert_int_equal(RUN(out, "ctl", name, "--help"), 0);
  assert_int_equal(RUN(out, "ctl", name, "reboot"), 2);
  assert_int_equal(RUN(out, "ctl", name, "clear", "--timeout", "soon"), 2);
  assert_int_equal(RUN(out, "ctl", name, "status"), 3);
  assert_int_equal(RUN(out, "ctl", "engine", name), 2);                       /* --ranks missing */
  assert_int_equal(RUN(out, "ctl", "serve", name, "--http", "0.0.0.0:0"), 2); /* not loopback */
  /* the shared parser: every code in one table, --opt=value, strays and unknowns refused */
  assert_int_equal(RUN(out, "--help"), 0);
  assert_non_null(strstr(out, "6  ctl: invalid transition"));
  assert_non_null(strstr(out, "7  ctl: busy"));
  assert_int_equal(RUN(out, "ctl", "--help"), 0);
  assert_non_null(strstr(out, "7  ctl: busy"));
  assert_int_equal(RUN(out, "help", "ctl", "engine"), 0);
  assert_non_null(strstr(out, "ferry ctl engine NAME --ranks R"));
  assert_int_equal(RUN(out, "ctl", name, "status", "--timeout=1"), 3); /* parsed, then no cell */
  assert_int_equal(RUN(out, "ctl", name, "clear", "--timeout=soon"), 2);
  assert_int_equal(RUN(out, "ctl", name, "status", "extra"), 2);
  assert_int_equal(RUN(out, "ctl", name, "status", "--bogus"), 2);
  assert_int_equal(RUN(out, "ctl", name), 2); /* no action */
  assert_int_equal(RUN(out, "ctl", "engine", name, "--ranks=0"), 2);
  assert_int_equal(RUN(out, "ctl", "engine", name, "--ranks", "2", "extra"), 2);
  assert_int_equal(RUN(out, "ctl", "engine", name, "--ranks", "two"), 2);
  assert_int_equal(RUN(out, "ctl", "serve", name, "--http=0.0.0.0:0"), 2);
  assert_int_equal(RUN(out, "ctl", "serve", name, "--http"), 2);          /* no value */
  assert_int_equal(RUN(out, "ctl", "serve", "--http", "127.0.0.1:0"), 2); /* no NAME */
}

static void test_engine_and_commands(void **state) {
  char out[8192], line[256];
  child eng = spawn_cli(
      (const char *const[]){"ctl", "engine", name, "--ranks=3", "--fail-update", "2", NULL});
  read_line(eng.out, line, sizeof line);
  assert_non_null(strstr(line, "ready"));
  assert_int_equal(RUN(out, "ctl", name, "status"), 0);
  assert_non_null(strstr(out, "serving"));
  assert_int_equal(RUN(out, "ctl", name, "update"), 6);                /* invalid transition */
  assert_int_equal(RUN(out, "ctl", "--timeout=10", name, "clear"), 0); /* options go anywhere */
  assert_non_null(strstr(out, "cleared"));
  assert_int_equal(RUN(out, "ctl", name, "clear"), 0); /* at once */
  assert_int_equal(RUN(out, "ctl", name, "update", "--json", "--timeout", "10"), 1);
  assert_non_null(strstr(out, "\"ok\":false"));
  assert_non_null(strstr(out, "FERRY_ECHECKSUM"));
  assert_non_null(strstr(out, "rank 2 failed"));
  assert_int_equal(RUN(out, "ctl", name, "status", "--json"), 0);
  assert_non_null(strstr(out, "\"state\":\"failed\""));
  assert_int_equal(RUN(out, "ctl", name, "clear"), 0); /* the way back */
  stop_child(&eng, 0);
  assert_int_equal(RUN(out, "ctl", name, "status"), 3); /* the engine removed its cell */
}

/* #17 row 11: a killed engine left its ferry-ctl-NAME file in /dev/shm for good, when no engine
 * of that name came back. `ferry gc` removes it (and half-made cells and refit rendezvous files
 * of dead processes), and leaves a live engine's cell alone. */
static void test_gc(void **state) {
  char out[8192], line[256], live[80], path[160];
  snprintf(live, sizeof live, "%s-live", name);
  child dead = spawn_cli((const char *const[]){"ctl", "engine", name, "--ranks=1", NULL});
  child alive = spawn_cli((const char *const[]){"ctl", "engine", live, "--ranks=1", NULL});
  read_line(dead.out, line, sizeof line);
  read_line(alive.out, line, sizeof line);
  kill(dead.pid, SIGKILL);
  assert_int_equal(tu_wait(dead.pid), 128 + SIGKILL);
  close(dead.out);
  snprintf(path, sizeof path, "%s/ferry-refit-%s", dir, name); /* a dead sender's rendezvous */
  FILE *f = fopen(path, "w");
  fprintf(f, "tcp://127.0.0.1:1\n%d\n", (int)dead.pid);
  fclose(f);
  snprintf(path, sizeof path, "%s/ferry-ctl-%s", dir, name);
  assert_int_equal(access(path, F_OK), 0); /* left behind */
  assert_int_equal(RUN(out, "gc", "--dry-run"), 0);
  assert_non_null(strstr(out, "would remove"));
  assert_int_equal(access(path, F_OK), 0);
  assert_int_equal(RUN(out, "gc", "--json"), 0);
  assert_non_null(strstr(out, "dead engine pid"));
  assert_non_null(strstr(out, "dead sender pid"));
  assert_null(strstr(out, live));
  assert_int_equal(access(path, F_OK), -1);
  assert_int_equal(RUN(out, "ctl", live, "status"), 0); /* the live cell is there */
  assert_int_equal(RUN(out, "gc"), 0);
  assert_non_null(strstr(out, "nothing to remove"));
  stop_child(&alive, 0);
}

/* ---- HTTP: this process is the engine; ranks are children that can hold an update ---- */

typedef struct rank_arg {
  uint32_t rank;
  int gate_rd, note_wr; /* rank 1 tells `note` it is updating, then waits for `gate` */
} rank_arg;

static int hold_update(void *p) {
  rank_arg *a = p;
  char b = 'u';
  if (a->rank == 1 && (write(a->note_wr, &b, 1) != 1 || read(a->gate_rd, &b, 1) != 1))
    return FERRY_ESYS;
  return 0;
}

static int rank_main(void *p) {
  rank_arg *a = p;
  ferry_ctl_rank *r = NULL;
  if (ferry_ctl_rank_open(name, a->rank, NULL, &r) != 0)
    return 1;
  ferry_ctl_handlers h = {sizeof h, NULL, hold_update, NULL, a};
  for (;;)
    ferry_ctl_rank_step(r, &h, -1, NULL); /* until killed */
}

static child start_server(int *port) {
  child srv = spawn_cli((const char *const[]){"ctl", "serve", name, "--http=127.0.0.1:0", NULL});
  char line[256];
  read_line(srv.out, line, sizeof line);
  const char *p = strstr(line, "127.0.0.1:");
  assert_non_null(p);
  *port = atoi(p + 10);
  assert_true(*port > 0);
  return srv;
}

static void test_http(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 2, NULL, &cell));
  tu_pipe gate, note;
  tu_pipe_open(&gate);
  tu_pipe_open(&note);
  rank_arg args[2] = {{0, gate.rd, note.wr}, {1, gate.rd, note.wr}};
  pid_t ranks[2] = {tu_spawn(rank_main, &args[0]), tu_spawn(rank_main, &args[1])};
  int port;
  child srv = start_server(&port);
  char path[128], act[160], resp[8192];
  snprintf(path, sizeof path, "/v1/control/%s", name);
  do /* until both ranks are attached */
    assert_int_equal(http(port, "GET", path, NULL, NULL, resp, sizeof resp), 200);
  while (strstr(resp, "\"state\":\"absent\""));
  assert_non_null(strstr(resp, "\"state\":\"serving\""));
  assert_non_null(strstr(resp, "application/json"));
  /* #32 row 6: with FERRY_TOKEN unset the API wants this user's secret, as links do; another
   * user, who cannot read it, drove the engine with no token at all. Probes need none. */
  snprintf(act, sizeof act, "%s/clear", path);
  assert_int_equal(http(port, "POST", act, "", NULL, resp, sizeof resp), 401);
  assert_non_null(strstr(resp, "WWW-Authenticate: Bearer"));
  assert_int_equal(http(port, "GET", path, "", NULL, resp, sizeof resp), 401);
  assert_int_equal(
      http(port, "GET", path, "not-this-users-secret-at-all-000", NULL, resp, sizeof resp), 401);
  assert_int_equal(http(port, "GET", "/healthz", "", NULL, resp, sizeof resp), 200);
  assert_int_equal(http(port, "GET", "/readyz", "", NULL, resp, sizeof resp), 200);
  assert_int_equal(http(port, "GET", path, NULL, NULL, resp, sizeof resp), 200);
  assert_non_null(strstr(resp, "\"seq\":0")); /* the refused clear issued nothing */
  snprintf(act, sizeof act, "%s/update", path);
  assert_int_equal(http(port, "POST", act, NULL, NULL, resp, sizeof resp), 409);
  assert_non_null(strstr(resp, "FERRY_ESTATE"));
  snprintf(act, sizeof act, "%s/clear", path);
  assert_int_equal(http(port, "POST", act, NULL, "{\"timeout_s\": 10}", resp, sizeof resp), 200);
  assert_non_null(strstr(resp, "\"state\":\"cleared\""));
  assert_int_equal(http(port, "POST", act, NULL, NULL, resp, sizeof resp), 200);
  /* rank 1 holds the update: the request times out (504), another one is busy (503) */
  snprintf(act, sizeof act, "%s/update?timeout_s=0.2", path);
  assert_int_equal(http(port, "POST", act, NULL, NULL, resp, sizeof resp), 504);
  assert_non_null(strstr(resp, "rank 1 (updating)"));
  char b;
  assert_int_equal(tu_pipe_get(&note, &b, 1, 10000), 0);
  snprintf(act, sizeof act, "%s/clear", path);
  assert_int_equal(http(port, "POST", act, NULL, NULL, resp, sizeof resp), 503);
  tu_pipe_put(&gate, "g", 1);
  do
    assert_int_equal(http(port, "GET", path, NULL, NULL, resp, sizeof resp), 200);
  while (strstr(resp, "\"in_flight\":true"));
  assert_non_null(strstr(resp, "\"state\":\"serving\""));
  /* paths and methods */
  assert_int_equal(http(port, "GET", "/v1/control/other", NULL, NULL, resp, sizeof resp), 404);
  snprintf(act, sizeof act, "%s/reboot", path);
  assert_int_equal(http(port, "POST", act, NULL, NULL, resp, sizeof resp), 404);
  snprintf(act, sizeof act, "%s/clear", path);
  assert_int_equal(http(port, "GET", act, NULL, NULL, resp, sizeof resp), 405);
  stop_child(&srv, 0);
  /* with FERRY_TOKEN the server wants that token, and this user's secret is not it */
  setenv("FERRY_TOKEN", "fleet-token-of-32-bytes-or-so-00", 1);
  srv = start_server(&port);
  unsetenv("FERRY_TOKEN");
  assert_int_equal(http(port, "GET", path, "", NULL, resp, sizeof resp), 401);
  assert_int_equal(http(port, "GET", path, "wrong", NULL, resp, sizeof resp), 401);
  assert_int_equal(http(port, "GET", path, NULL, NULL, resp, sizeof resp), 401);
  assert_int_equal(
      http(port, "GET", path, "fleet-token-of-32-bytes-or-so-00", NULL, resp, sizeof resp), 200);
  stop_child(&srv, 0);
  for (int i = 0; i < 2; i++) {
    kill(ranks[i], SIGKILL);
    tu_wait(ranks[i]);
  }
  tu_pipe_close(&gate);
  tu_pipe_close(&note);
  ferry_ctl_cell_close(cell);
}

/* The bodies the server accepts and refuses: JSON parsed for real, whole before it is parsed
 * however it arrives, and every answer a JSON object. */
static void test_http_bodies(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 1, NULL, &cell));
  rank_arg arg = {0, -1, -1};
  pid_t rank = tu_spawn(rank_main, &arg);
  int port;
  child srv = start_server(&port);
  char path[128], act[160], resp[16384];
  snprintf(path, sizeof path, "/v1/control/%s", name);
  do /* until the rank is attached */
    assert_int_equal(http(port, "GET", path, NULL, NULL, resp, sizeof resp), 200);
  while (strstr(resp, "\"state\":\"absent\""));
  json_t *j = resp_json(resp);
  assert_string_equal(json_string_value(json_object_get(j, "name")), name);
  assert_int_equal(json_array_size(json_object_get(j, "ranks")), 1);
  json_decref(j);
  snprintf(act, sizeof act, "%s/clear", path);
  /* a quoted "timeout_s" inside another field's string is not a timeout: that field is refused */
  assert_bad_request(port, act, "{\"note\":\"\\\"timeout_s\\\": 2\"}", "unknown field 'note'");
  assert_bad_request(port, act, "{\"timeout_s\": 2", "not valid JSON");
  assert_bad_request(port, act, "{\"timeout_s\": 2} x", "not valid JSON");
  assert_bad_request(port, act, "timeout_s=2", "not valid JSON");
  assert_bad_request(port, act, "[{\"timeout_s\": 2}]", "must be a JSON object");
  assert_bad_request(port, act, "{\"timeout_s\": \"2\"}", "not a string");
  assert_bad_request(port, act, "{\"timeout_s\": true}", "not a boolean");
  assert_bad_request(port, act, "{\"timeout_s\": null}", "not null");
  assert_bad_request(port, act, "{\"timeout_s\": 0}", "out of range");
  assert_bad_request(port, act, "{\"timeout_s\": -1}", "out of range");
  assert_bad_request(port, act, "{\"timeout_s\": 1e9}", "out of range");
  assert_bad_request(port, act, "{\"timeout_s\": 1, \"timeout_s\": 2}", "duplicate");
  assert_bad_request(port, act, "{\"timeout\": 2}", "unknown field 'timeout'");
  char query[200];
  snprintf(query, sizeof query, "%s?timeout_s=2", act);
  assert_bad_request(port, query, "{\"timeout_s\": 2}", "given twice");
  snprintf(query, sizeof query, "%s?timeout_s=soon", act);
  assert_bad_request(port, query, NULL, "want seconds");
  snprintf(query, sizeof query, "%s?wait=1", act);
  assert_bad_request(port, query, NULL, "unknown query argument 'wait'");
  /* nothing was issued by any of those */
  assert_int_equal(http(port, "GET", path, NULL, NULL, resp, sizeof resp), 200);
  j = resp_json(resp);
  assert_int_equal(json_integer_value(json_object_get(j, "seq")), 0);
  json_decref(j);
  /* a valid body, and one sent as two chunks split inside the key */
  assert_int_equal(http(port, "POST", act, NULL, " {\"timeout_s\": 10.5}\n", resp, sizeof resp),
                   200);
  j = resp_json(resp);
  assert_true(json_is_true(json_object_get(j, "ok")));
  assert_string_equal(json_string_value(json_object_get(j, "state")), "cleared");
  assert_int_equal(json_integer_value(json_object_get(j, "seq")), 1);
  json_decref(j);
  snprintf(act, sizeof act, "%s/update", path);
  char head[2048];
  snprintf(head, sizeof head,
           "POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s"
           "Transfer-Encoding: chunked\r\n\r\n",
           act, auth);
  assert_int_equal(http_pieces(port,
                               (const char *const[]){head, "7\r\n{\"timeo\r\n",
                                                     "a\r\nut_s\": 10}\r\n", "0\r\n\r\n", NULL},
                               resp, sizeof resp),
                   200);
  j = resp_json(resp);
  assert_string_equal(json_string_value(json_object_get(j, "state")), "serving");
  json_decref(j);
  /* GET takes no fields; an empty body is fine */
  snprintf(head, sizeof head,
           "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%sContent-Length: 7"
           "\r\n\r\n{\"x\":1}",
           path, auth);
  assert_int_equal(http_pieces(port, (const char *const[]){head, NULL}, resp, sizeof resp), 400);
  assert_non_null(strstr(resp, "unknown field 'x'"));
  assert_int_equal(http(port, "GET", path, NULL, "", resp, sizeof resp), 200);
  /* too large: by its Content-Length (answered before the body is sent), or as chunks */
  snprintf(head, sizeof head,
           "POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%sContent-Length: "
           "100000\r\n\r\n",
           act, auth);
  assert_int_equal(http_pieces(port, (const char *const[]){head, NULL}, resp, sizeof resp), 413);
  json_decref(resp_json(resp));
  snprintf(head, sizeof head,
           "POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s"
           "Transfer-Encoding: chunked\r\n\r\n",
           act, auth);
  char chunk[1100];
  memset(chunk, ' ', sizeof chunk);
  memcpy(chunk, "400\r\n", 5);
  memcpy(chunk + 5 + 1024, "\r\n", 3);
  const char *big[] = {head, chunk, chunk, chunk, chunk, chunk, "0\r\n\r\n", NULL};
  assert_int_equal(http_pieces(port, big, resp, sizeof resp), 413);
  assert_non_null(strstr(resp, "over 4096 bytes"));
  /* 405 says what is allowed */
  assert_int_equal(http(port, "DELETE", path, NULL, NULL, resp, sizeof resp), 405);
  assert_non_null(strstr(resp, "Allow: GET"));
  json_decref(resp_json(resp));
  stop_child(&srv, 0);
  kill(rank, SIGKILL);
  tu_wait(rank);
  ferry_ctl_cell_close(cell);
}

/* Many half-sent requests from one address do not pin `ferry ctl serve`: beyond its per-address
 * share each new one closes the oldest of that address still sending its request, and a request
 * from another loopback address (127.0.0.2) is still answered while the flood's are open. */
#define FLOOD 300

static int connect_from(const char *src, int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in from = {.sin_family = AF_INET};
  inet_pton(AF_INET, src, &from.sin_addr);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || bind(fd, (struct sockaddr *)&from, sizeof from) != 0 ||
      connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    if (fd >= 0)
      close(fd);
    return -1;
  }
  return fd;
}

static void test_http_flood(void **state) {
  int port;
  child srv = start_server(&port);
  int fds[FLOOD], opened = 0;
  const char half[] = "GET /v1/control/x HTTP/1.1\r\nHost: 127.0.0.1\r\n"; /* no end */
  for (int i = 0; i < FLOOD; i++) {
    fds[i] = connect_from("127.0.0.1", port);
    if (fds[i] >= 0 && write(fds[i], half, sizeof half - 1) == (ssize_t)(sizeof half - 1))
      opened++;
  }
  /* the first of the flood is the oldest past the per-address share: the server closes it */
  struct pollfd pfd = {.fd = fds[0], .events = POLLIN};
  int closed = fds[0] >= 0 && poll(&pfd, 1, 10000) == 1;
  char resp[8192], req[1600];
  snprintf(req, sizeof req,
           "GET /v1/control/%s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s\r\n", name,
           auth);
  int fd = connect_from("127.0.0.2", port);
  int code = 0;
  if (fd >= 0 && write(fd, req, strlen(req)) == (ssize_t)strlen(req)) {
    read_all(fd, resp, sizeof resp);
    sscanf(resp, "HTTP/1.%*d %d", &code);
  }
  if (fd >= 0)
    close(fd);
  for (int i = 0; i < FLOOD; i++)
    if (fds[i] >= 0)
      close(fds[i]);
  stop_child(&srv, 0);
  printf("# %d half-sent requests from 127.0.0.1; the one from 127.0.0.2 got %d\n", opened, code);
  assert_int_equal(opened, FLOOD);
  assert_true(closed);
  assert_true(code == 200 || code == 404); /* answered (the cell may not exist: 404) */
}

/* #32 row 4: ~70 connections from 127.0.0.1 (every local user's address) each trickling a
 * header line held ctl serve's slots for as long as they trickled, /healthz refused all along.
 * Now a request must arrive whole within FERRY_HTTP_HEADER_MS (1 s here), and past the address's
 * share a new connection closes the oldest still sending: every probe is answered while they
 * trickle (within 2 s, a hang bound), and every trickler is closed (within 4 s of the end). */
static void test_http_slowloris(void **state) {
  setenv("FERRY_HTTP_HEADER_MS", "1000", 1);
  int port;
  child srv = start_server(&port);
  unsetenv("FERRY_HTTP_HEADER_MS");
  tu_loris r = tu_slowloris(port, 70, 1000, 3000, 4000, "/healthz", 2000);
  stop_child(&srv, 0);
  printf("# %d trickling connections; %d/%d probes answered, slowest %d ms; %d left open\n",
         r.opened, r.probes_ok, r.probes, r.worst_probe_ms, r.still_open);
  assert_true(r.opened >= 70);
  assert_true(r.probes >= 2); /* one at the start, and one at least every 2.2 s */
  assert_int_equal(r.probes_ok, r.probes);
  assert_int_equal(r.still_open, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup(test_help_and_usage, setup),
      cmocka_unit_test_setup(test_engine_and_commands, setup),
      cmocka_unit_test_setup(test_gc, setup),
      cmocka_unit_test_setup(test_http, setup),
      cmocka_unit_test_setup(test_http_bodies, setup),
      cmocka_unit_test_setup(test_http_flood, setup),
      cmocka_unit_test_setup(test_http_slowloris, setup),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
