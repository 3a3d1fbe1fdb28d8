/*
 * What the logs tell an operator at info level, checked line by line: the directory sees nodes
 * join, leave and let their lease lapse (naming the keys it dropped), a node says when it joins
 * and leaves, a refit push says its version, bytes and time, a receiver that stalls is named as
 * dropped, an mq subscriber that holds a publisher back is named, control requests say their
 * transition and a failing rank its error. The library's lines are caught through the log
 * callback; `ferry serve`'s on its stderr, at its default level, in text and in JSON, where
 * short-lived clients leave no lines (a quiet log is part of a useful one).
 */
// ferry-test: threaded
#include "storeutil.h"

#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <regex.h>
#include <string.h>
#include <sys/stat.h>

static char cli[4096];
static char tmpdir[256];

/* ---- the library's lines, through the callback ---- */

static pthread_mutex_t cap_lock = PTHREAD_MUTEX_INITIALIZER;
static char *cap_buf;
static size_t cap_len, cap_cap;

static void capture(ferry_log_level level, const char *msg, void *arg) {
  static const char *const names[] = {"error", "warn", "info", "debug", "trace"};
  (void)arg;
  char line[1400];
  int n = snprintf(line, sizeof line, "%s: %s\n", names[level], msg);
  if (n < 0)
    return;
  size_t len = (size_t)n < sizeof line ? (size_t)n : sizeof line - 1;
  pthread_mutex_lock(&cap_lock);
  if (cap_len + len + 1 > cap_cap) {
    size_t cap = (cap_len + len + 1) * 2;
    char *p = realloc(cap_buf, cap);
    if (p) {
      cap_buf = p;
      cap_cap = cap;
    }
  }
  if (cap_len + len + 1 <= cap_cap) {
    memcpy(cap_buf + cap_len, line, len);
    cap_len += len;
    cap_buf[cap_len] = '\0';
  }
  pthread_mutex_unlock(&cap_lock);
}

static void capture_start(void) {
  pthread_mutex_lock(&cap_lock);
  cap_len = 0;
  if (cap_buf)
    cap_buf[0] = '\0';
  pthread_mutex_unlock(&cap_lock);
  ferry_log_set_callback(capture, NULL);
  ferry_log_set_level(FERRY_LOG_INFO);
}

static void capture_stop(void) {
  ferry_log_set_callback(NULL, NULL);
  ferry_log_set_level(FERRY_LOG_WARN);
}

/* Whether one line of text holds every needle (NULL-terminated list). */
static bool line_with(const char *text, const char *const *needles) {
  for (const char *line = text; line && *line;) {
    const char *end = strchr(line, '\n');
    size_t len = end ? (size_t)(end - line) : strlen(line);
    bool all = true;
    for (size_t i = 0; all && needles[i]; i++) {
      const char *hit = memmem(line, len, needles[i], strlen(needles[i]));
      all = hit != NULL;
    }
    if (all)
      return true;
    line = end ? end + 1 : NULL;
  }
  return false;
}

static bool captured_(const char *const *needles) {
  pthread_mutex_lock(&cap_lock);
  bool ok = cap_buf && line_with(cap_buf, needles);
  pthread_mutex_unlock(&cap_lock);
  return ok;
}

/* Waits (polling, up to 30 s: a bound, not a timing) for a captured line holding every needle. */
static void await_line_(const char *const *needles) {
  for (int i = 0; i < 3000 && !captured_(needles); i++)
    su_sleep_ms(10);
  if (!captured_(needles)) {
    pthread_mutex_lock(&cap_lock);
    fprintf(stderr, "captured:\n%s\n", cap_buf ? cap_buf : "");
    pthread_mutex_unlock(&cap_lock);
    fail_msg("no log line with '%s'%s%s", needles[0], needles[1] ? " and '" : "",
             needles[1] ? needles[1] : "");
  }
}
#define await_line(...) await_line_((const char *const[]){__VA_ARGS__, NULL})
#define captured(...) captured_((const char *const[]){__VA_ARGS__, NULL})

static ferry_ctx *ctx_for(const char *name) {
  ferry_ctx_opts o = {.size = sizeof o, .name = name, .transports = "shm,tcp"};
  ferry_ctx *c;
  FR_OK(ferry_ctx_open(&o, &c));
  return c;
}

/* ferry://<the tcp listener of c> */
static void dir_url(ferry_ctx *c, char *buf, size_t cap) {
  const char *tcp = strstr(ferry_ctx_address(c), "tcp://");
  assert_non_null(tcp);
  snprintf(buf, cap, "ferry://%.*s", (int)strcspn(tcp + 6, ","), tcp + 6);
}

/* ---- helper processes (exec'd) ---- */

/* A store node NAME that joins URL with a lease of LEASE ms, puts KEY, says so on fd WR, then
 * closes cleanly when a byte comes on fd RD (or is killed). */
static int node_child(const char *name, const char *url, int lease_ms, const char *key, int rd,
                      int wr) {
  ferry_ctx *c = ctx_for(name);
  ferry_store_opts so = {
      .size = sizeof so, .directory = url, .capacity = 1 << 20, .lease_ms = lease_ms};
  ferry_store *s;
  if (ferry_store_open(c, &so, &s) != 0)
    return 1;
  float data[64] = {0};
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_F32, .ndim = 1, .shape = {64}};
  if (ferry_store_put(s, key, &d, data, FERRY_STORE_PUT_COPY, 10000) != 0)
    return 2;
  tu_pipe p = {rd, wr};
  uint8_t b = 1;
  tu_pipe_put(&p, &b, 1);
  tu_pipe_get(&p, &b, 1, 60000);
  ferry_store_close(s);
  ferry_ctx_close(c);
  return 0;
}

/* A refit receiver "logs-rx" of the sender at ADDRESS; says it is attached on fd WR, then lets
 * its service thread commit pushes until it is stopped or killed. */
static int receiver_child(const char *address, int wr) {
  ferry_ctx *c = ctx_for("logs-rx");
  ferry_refit_receiver *r;
  if (ferry_refit_receiver_open(c, address, 10000, &r) != 0 || ferry_refit_bind_flat(r) != 0)
    return 1;
  uint8_t b = 1;
  if (write(wr, &b, 1) != 1)
    return 1;
  for (;;)
    pause();
}

/* ---- nodes joining and leaving ---- */

static pid_t spawn_node(const char *name, const char *url, const char *lease, const char *key,
                        tu_pipe *to, tu_pipe *from) {
  tu_pipe_open(to);
  tu_pipe_open(from);
  char rd[16], wr[16];
  snprintf(rd, sizeof rd, "%d", to->rd);
  snprintf(wr, sizeof wr, "%d", from->wr);
  pid_t pid = tu_spawn_exec("--node", name, url, lease, key, rd, wr, NULL);
  uint8_t b = 0;
  if (tu_pipe_get(from, &b, 1, 30000) != 0)
    fail_msg("node '%s' did not start (exit %d)", name, tu_wait(pid));
  return pid;
}

/* Waits until the directory lists key (a node's put may reach it after the put returned). */
static void await_key(ferry_store *s, const char *key) {
  size_t n = 0;
  for (int i = 0; i < 3000 && n != 1; i++) {
    ferry_store_info *list = NULL;
    n = 0;
    FR_OK(ferry_store_list(s, key, &list, &n, 10000));
    ferry_store_list_free(list);
    if (n != 1)
      su_sleep_ms(10);
  }
  assert_int_equal(n, 1);
}

/* The directory logs a node that joins, one that leaves (with the key it held) and one whose
 * lease lapses after it was killed (with the key the directory dropped); the hosting node logs
 * its own joining and leaving. */
static void test_nodes_join_leave_and_lapse(void **state) {
  capture_start();
  ferry_ctx *c = ctx_for("logs-dir");
  ferry_store_opts so = {
      .size = sizeof so, .capacity = 1 << 20, .flags = FERRY_STORE_HOST_DIRECTORY};
  ferry_store *s;
  FR_OK(ferry_store_open(c, &so, &s));
  char url[128];
  dir_url(c, url, sizeof url);
  await_line("info: directory: node 'logs-dir' joined at ", "(lease ");
  await_line("info: store 'logs-dir': joined the directory at ", "as node 'logs-dir'");

  tu_pipe to, from;
  pid_t leaver = spawn_node("logs-leaver", url, "5000", "logs/leaver-key", &to, &from);
  await_line("info: directory: node 'logs-leaver' joined at ", "(lease 5000 ms)");
  await_key(s, "logs/leaver-key");
  uint8_t b = 'c';
  tu_pipe_put(&to, &b, 1);
  assert_int_equal(tu_wait(leaver), 0);
  await_line("info: directory: node 'logs-leaver' at ",
             " left; its 1 key dropped ('logs/leaver-key')");
  tu_pipe_close(&to);
  tu_pipe_close(&from);

  pid_t lapser = spawn_node("logs-lapser", url, "300", "logs/lapser-key", &to, &from);
  await_line("info: directory: node 'logs-lapser' joined at ", "(lease 300 ms)");
  await_key(s, "logs/lapser-key");
  kill(lapser, SIGKILL);
  tu_wait(lapser);
  await_line("info: directory: node 'logs-lapser' at ", "gone: its lease lapsed",
             "its 1 key dropped ('logs/lapser-key')");
  tu_pipe_close(&to);
  tu_pipe_close(&from);

  ferry_store_close(s);
  await_line("info: store 'logs-dir': left the directory at ");
  ferry_ctx_close(c);
  capture_stop();
}

/* ---- refit ---- */

/* One line per push with its version and bytes; a receiver that stops acknowledging is named,
 * with why (stalled) and what follows (dropped), and the push's line says who committed. */
static void test_push_and_dropped_receiver(void **state) {
  capture_start();
  ferry_ctx *c = ctx_for("logs-trainer");
  ferry_refit_opts o = {.size = sizeof o, .bucket_bytes = 16384};
  ferry_refit_sender *s;
  FR_OK(ferry_refit_sender_open(c, "logs-refit", &o, &s));
  static float w[16384]; /* 65536 bytes: a multiple of the wire alignment, so a push's bytes */
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_F32, .ndim = 1, .shape = {16384}};
  FR_OK(ferry_refit_declare(s, "w", &d, w, FERRY_DTYPE_INVALID));
  FR_OK(ferry_refit_seal(s));
  await_line("info: refit 'logs-refit': sealed 1 tensors, 65536 bytes");

  tu_pipe from;
  tu_pipe_open(&from);
  char wr[16];
  snprintf(wr, sizeof wr, "%d", from.wr);
  pid_t rx = tu_spawn_exec("--receiver", ferry_ctx_address(c), wr, NULL);
  uint8_t b = 0;
  assert_int_equal(tu_pipe_get(&from, &b, 1, 30000), 0);
  for (int i = 0; i < 3000 && ferry_refit_receivers(s) < 1; i++)
    su_sleep_ms(10);
  assert_int_equal(ferry_refit_receivers(s), 1);
  await_line("info: refit 'logs-refit': receiver 'logs-rx' attached");

  ferry_refit_push_opts po = {.size = sizeof po, .timeout_ms = 20000};
  FR_OK(ferry_refit_push(s, 1, &po));
  await_line("info: refit 'logs-refit': pushed version 1: 65536 bytes in ",
             "committed by 1 receiver");

  kill(rx, SIGSTOP);
  int st;
  assert_int_equal(waitpid(rx, &st, WUNTRACED), rx);
  po.timeout_ms = 500;
  w[0] = 1;
  assert_int_equal(ferry_refit_push(s, 2, &po), FERRY_ETIMEDOUT);
  await_line("warn: refit 'logs-refit': receiver 'logs-rx' did not commit version 2: stalled",
             "dropped from pushes until it attaches again", "FERRY_ETIMEDOUT");
  await_line("warn: refit 'logs-refit': pushed version 2: 65536 bytes in ",
             "committed by 0 of 1 receivers");
  assert_false(captured("info: refit 'logs-refit': pushed version 2"));

  kill(rx, SIGKILL);
  tu_wait(rx);
  tu_pipe_close(&from);
  ferry_refit_sender_close(s);
  ferry_ctx_close(c);
  capture_stop();
}

/* ---- mq ---- */

/* A subscriber that takes nothing holds its publisher back: the publish that waited (every wait
 * is logged here, FERRY_MQ_STALL_LOG_MS=0) names it, its topic and its queue, and says the
 * publish timed out. */
static void test_mq_subscriber_holds_publisher_back(void **state) {
  capture_start();
  setenv("FERRY_MQ_STALL_LOG_MS", "0", 1);
  ferry_ctx *pc = ctx_for("logs-pub"), *sc = ctx_for("logs-sub");
  ferry_mq_opts po = {.size = sizeof po, .flags = FERRY_MQ_HOST_DIRECTORY};
  ferry_mq *pub, *sub;
  FR_OK(ferry_mq_open(pc, &po, &pub));
  char url[128];
  dir_url(pc, url, sizeof url);
  ferry_mq_opts so = {.size = sizeof so, .directory = url, .queue_bytes = 4096};
  FR_OK(ferry_mq_open(sc, &so, &sub));
  unsetenv("FERRY_MQ_STALL_LOG_MS");
  FR_OK(ferry_mq_subscribe(sub, "logs-topic", 10000));
  FR_OK(ferry_mq_wait_subscribers(pub, "logs-topic", 1, 10000));
  uint8_t msg[1000] = {0};
  int rc = 0;
  for (int i = 0; i < 100 && rc == 0; i++)
    rc = ferry_mq_publish(pub, "logs-topic", msg, sizeof msg, 300);
  assert_int_equal(rc, FERRY_ETIMEDOUT);
  await_line("warn: mq 'logs-pub': a publish on 'logs-topic' waited ",
             "for subscriber 'logs-sub' to take messages (its queue held ", " of 4096 bytes)",
             "; the publish timed out");
  ferry_mq_close(sub);
  ferry_mq_close(pub);
  ferry_ctx_close(sc);
  ferry_ctx_close(pc);
  capture_stop();
}

/* ---- control ---- */

typedef struct rank_loop {
  ferry_ctl_rank *rank;
  uint32_t index;
  bool stop; /* atomic */
} rank_loop;

static int clear_ok(void *arg) { return 0; }
static int update_fails_on_rank_one(void *arg) {
  return ((rank_loop *)arg)->index == 1 ? FERRY_ECHECKSUM : 0;
}

static void *rank_main(void *arg) {
  rank_loop *l = arg;
  ferry_ctl_handlers h = {
      .size = sizeof h, .clear = clear_ok, .update = update_fails_on_rank_one, .arg = l};
  while (!__atomic_load_n(&l->stop, __ATOMIC_RELAXED))
    ferry_ctl_rank_step(l->rank, &h, 50, NULL);
  return NULL;
}

/* A request that went through says its transition; one that a rank failed says which rank and
 * why, on the controller (info: the caller has the error too) and on the rank (warn). */
static void test_control_transitions(void **state) {
  char dir[512];
  snprintf(dir, sizeof dir, "%s/ctl", tmpdir);
  assert_true(mkdir(dir, 0700) == 0 || errno == EEXIST);
  setenv("FERRY_CTL_DIR", dir, 1);
  capture_start();
  ferry_ctl_cell *cell;
  FR_OK(ferry_ctl_cell_create("logs-cell", 2, NULL, &cell));
  await_line("info: control cell 'logs-cell' created: 2 ranks");
  rank_loop loops[2];
  pthread_t threads[2];
  for (uint32_t i = 0; i < 2; i++) {
    loops[i] = (rank_loop){.index = i};
    FR_OK(ferry_ctl_rank_open("logs-cell", i, NULL, &loops[i].rank));
    assert_int_equal(pthread_create(&threads[i], NULL, rank_main, &loops[i]), 0);
  }
  ferry_ctl *ctl;
  FR_OK(ferry_ctl_open("logs-cell", &ctl));
  FR_OK(ferry_ctl_request(ctl, FERRY_CTL_CLEAR, 10000));
  await_line("info: control: clear seq 1 on 'logs-cell' done in ", "serving -> cleared");
  assert_int_equal(ferry_ctl_request(ctl, FERRY_CTL_UPDATE, 10000), FERRY_ECHECKSUM);
  await_line("warn: control 'logs-cell': rank 1 failed update seq 2: FERRY_ECHECKSUM");
  await_line("info: control: update seq 2 on 'logs-cell': rank 1 failed", "the engine was cleared");
  FR_OK(ferry_ctl_request(ctl, FERRY_CTL_CLEAR, 10000));
  await_line("info: control: clear seq 3 on 'logs-cell' done in ", "failed -> cleared");
  ferry_ctl_close(ctl);
  for (int i = 0; i < 2; i++) {
    __atomic_store_n(&loops[i].stop, true, __ATOMIC_RELAXED);
    pthread_join(threads[i], NULL);
    ferry_ctl_rank_close(loops[i].rank);
  }
  ferry_ctl_cell_close(cell);
  capture_stop();
  tu_rmdir_files(dir);
}

/* ---- ferry serve's stderr ---- */

static char *slurp(const char *name) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", tmpdir, name);
  FILE *f = fopen(path, "rb");
  if (!f)
    return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = calloc(1, (size_t)n + 1);
  if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
    free(buf);
    buf = NULL;
  }
  fclose(f);
  return buf;
}

/* Starts the CLI with argv (NULL-terminated), its stdout and stderr in files of tmpdir, and
 * FERRY_LOG_FORMAT=format (NULL: unset); FERRY_LOG is unset (main): the command's own default.
 * The environment is set here, before the fork: the child only opens files and execs. */
static pid_t spawn_cli(const char *const *argv, const char *out, const char *err,
                       const char *format) {
  char po[512], pe[512];
  snprintf(po, sizeof po, "%s/%s", tmpdir, out);
  snprintf(pe, sizeof pe, "%s/%s", tmpdir, err);
  unlink(po); /* an earlier run's "ready" must not be taken for this one's */
  unlink(pe);
  if (format)
    setenv("FERRY_LOG_FORMAT", format, 1);
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fo = open(po, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int fe = open(pe, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fo < 0 || fe < 0 || dup2(fo, 1) < 0 || dup2(fe, 2) < 0)
      _exit(127);
    execv(argv[0], (char *const *)argv);
    _exit(127);
  }
  unsetenv("FERRY_LOG_FORMAT");
  return pid;
}

static void await_ready(pid_t pid, const char *out, const char *err) {
  for (int i = 0; i < 3000; i++) {
    char *s = slurp(out);
    bool ready = s && strstr(s, "ready");
    free(s);
    if (ready)
      return;
    if (waitpid(pid, NULL, WNOHANG) == pid) {
      char *e = slurp(err);
      fail_msg("ferry serve exited before it was ready:\n%s", e ? e : "");
    }
    su_sleep_ms(10);
  }
  fail_msg("ferry serve was not ready in 30 s");
}

/* Waits for a line of the file holding every needle. */
static void await_file_line_(const char *name, const char *const *needles) {
  for (int i = 0; i < 3000; i++) {
    char *s = slurp(name);
    bool ok = s && line_with(s, needles);
    if (!ok && i == 2999) {
      fprintf(stderr, "%s:\n%s\n", name, s ? s : "(missing)");
      fail_msg("%s: no line with '%s'", name, needles[0]);
    }
    free(s);
    if (ok)
      return;
    su_sleep_ms(10);
  }
}
#define await_file_line(name, ...) await_file_line_(name, (const char *const[]){__VA_ARGS__, NULL})

static void assert_matches(const char *text, const char *pattern) {
  regex_t re;
  assert_int_equal(regcomp(&re, pattern, REG_EXTENDED | REG_NOSUB | REG_NEWLINE), 0);
  int rc = regexec(&re, text, 0, NULL, 0);
  regfree(&re);
  if (rc != 0)
    fail_msg("no line matches /%s/ in:\n%s", pattern, text);
}

/* Two `ferry serve`s at their default level: the second joins the first's directory, clients
 * put through them, the second stops. The first logs the join and the leave, the second its own;
 * the clients leave no line. Each line in the format asked for: text, or one JSON object. */
static void serve_logs(const char *format) {
  int port = su_free_port();
  char listen[64], url[80];
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  snprintf(url, sizeof url, "ferry://%s", listen);
  const char *a1[] = {cli, "serve", "--listen", listen, "--name", "logs-s1", "--http", "off", NULL};
  pid_t s1 = spawn_cli(a1, "s1.out", "s1.err", format);
  await_ready(s1, "s1.out", "s1.err");
  const char *a2[] = {cli,      "serve",   "--directory", url,   "--listen", "127.0.0.1:0",
                      "--name", "logs-s2", "--http",      "off", NULL};
  pid_t s2 = spawn_cli(a2, "s2.out", "s2.err", format);
  await_ready(s2, "s2.out", "s2.err");
  char blob[512], cmd[8192];
  snprintf(blob, sizeof blob, "%s/blob.bin", tmpdir);
  FILE *f = fopen(blob, "wb");
  assert_non_null(f);
  for (int i = 0; i < 4096; i++)
    fputc(i & 0xff, f);
  fclose(f);
  for (int i = 0; i < 3; i++) {
    snprintf(cmd, sizeof cmd, "%s put --directory %s logs/k%d %s >/dev/null 2>%s/put.err", cli, url,
             i, blob, tmpdir);
    if (system(cmd) != 0) {
      char *e = slurp("put.err");
      fail_msg("%s: %s", cmd, e ? e : "");
    }
  }
  kill(s2, SIGTERM);
  assert_int_equal(tu_wait(s2), 0);
  await_file_line("s1.err", "directory: node 'logs-s2' at ", " left");
  await_file_line("s2.err", "store 'logs-s2': joined the directory at ferry://127.0.0.1:");
  await_file_line("s2.err", "store 'logs-s2': left the directory at ferry://127.0.0.1:");
  char *e1 = slurp("s1.err"), *e2 = slurp("s2.err");
  assert_non_null(e1);
  assert_non_null(e2);
  /* the clients (nodes 'cli-PID') came and went without a line on either server */
  if (strstr(e1, "cli-") || strstr(e2, "cli-"))
    fail_msg("a client left lines:\n%s\n%s", e1, e2);
  if (format) { /* every line of s2 (shut down) one JSON object */
    int lines = 0;
    for (char *line = strtok(e2, "\n"); line; line = strtok(NULL, "\n"), lines++) {
      json_error_t err;
      json_t *j = json_loads(line, 0, &err);
      if (!j)
        fail_msg("not JSON (%s): %s", err.text, line);
      assert_string_equal(json_string_value(json_object_get(j, "node")), "logs-s2");
      json_decref(j);
    }
    assert_true(lines >= 3); /* joined, shutting down, left */
  }
  if (format) { /* every line of s1 (still running) one JSON object; the join among them */
    bool joined = false;
    int lines = 0;
    for (char *line = strtok(e1, "\n"); line; line = strtok(NULL, "\n")) {
      json_error_t err;
      json_t *j = json_loads(line, 0, &err);
      if (!j)
        fail_msg("not JSON (%s): %s", err.text, line);
      const char *msg = json_string_value(json_object_get(j, "msg"));
      assert_non_null(msg);
      assert_string_equal(json_string_value(json_object_get(j, "node")), "logs-s1");
      if (strstr(msg, "directory: node 'logs-s2' joined at ")) {
        joined = true;
        assert_string_equal(json_string_value(json_object_get(j, "level")), "info");
        assert_non_null(strstr(json_string_value(json_object_get(j, "src")), "server.c:"));
      }
      json_decref(j);
      lines++;
    }
    assert_true(joined);
    assert_true(lines >= 3); /* its own join, s2's join and leave */
  } else {
    char pattern[256];
    snprintf(pattern, sizeof pattern,
             "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+Z ferry\\[%d\\] node=logs-s1 info "
             "server\\.c:[0-9]+: directory: node 'logs-s2' joined at [^ ]+ \\(lease [0-9]+ ms\\)$",
             (int)s1);
    assert_matches(e1, pattern);
  }
  free(e1);
  free(e2);
  kill(s1, SIGTERM);
  assert_int_equal(tu_wait(s1), 0);
}

static void test_serve_logs_text(void **state) { serve_logs(NULL); }
static void test_serve_logs_json(void **state) { serve_logs("json"); }

static int setup(void **state) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/ferry-logs-test-XXXXXX");
  assert_non_null(mkdtemp(tmpdir));
  return 0;
}

static int teardown(void **state) {
  char path[600];
  snprintf(path, sizeof path, "%s/ctl", tmpdir);
  rmdir(path);
  tu_rmdir_files(tmpdir);
  return 0;
}

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  if (argc == 8 && strcmp(argv[1], "--node") == 0)
    return node_child(argv[2], argv[3], atoi(argv[4]), argv[5], atoi(argv[6]), atoi(argv[7]));
  if (argc == 4 && strcmp(argv[1], "--receiver") == 0)
    return receiver_child(argv[2], atoi(argv[3]));
  const char *env = getenv("FERRY_CLI");
  if (!env || !*env) {
    fprintf(stderr, "FERRY_CLI is not set: run this test through ctest\n");
    return 1;
  }
  snprintf(cli, sizeof cli, "%s", env);
  /* the commands run at their own default level; this process sets its own (capture_start) */
  unsetenv("FERRY_LOG");
  unsetenv("FERRY_LOG_FORMAT");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_nodes_join_leave_and_lapse),
      cmocka_unit_test(test_push_and_dropped_receiver),
      cmocka_unit_test(test_mq_subscriber_holds_publisher_back),
      cmocka_unit_test(test_control_transitions),
      cmocka_unit_test(test_serve_logs_text),
      cmocka_unit_test(test_serve_logs_json),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, setup, teardown);
}
