/*
 * Who may connect (#17 row 2, docs/SECURITY.md): with no FERRY_TOKEN every process of a user
 * proves the same per-user secret, made 0600 on first use (even by processes racing to make it),
 * so they connect with no configuration; another Unix user (here root's forked helper turned
 * into `nobody`) is refused over shm (by its uid, before the handshake) and over tcp (by the
 * token), with its own secret or a guessed one, and cannot reach the node's memory through /proc
 * either; a token file that is not the user's alone is refused with a line saying how to fix it.
 * Multi-process: helpers are this binary again (tu_spawn_exec), the intruder drops to uid 65534.
 */
#include "testutil.h"

#include "core/core.h"
#include "transport/ctxcalls.h"
#include "transport/wire.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define NOBODY 65534
#define REGION_BYTES 8192
#define SEED 17

static char tmpdir[64];

static void tmp_make(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/ferry-sec-XXXXXX");
  assert_non_null(mkdtemp(tmpdir));
  assert_int_equal(chmod(tmpdir, 0711), 0); /* the intruder reaches its own folder in it */
}

static void tmp_remove(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", tmpdir);
  assert_int_equal(system(cmd), 0);
}

static void use_token_file(const char *rel) {
  char path[128];
  snprintf(path, sizeof path, "%s/%s", tmpdir, rel);
  setenv("FERRY_TOKEN_FILE", path, 1);
}

/* Defaults: no FERRY_TOKEN, no FERRY_TOKEN_FILE (~/.ferry/token). */
static void defaults(void) {
  unsetenv("FERRY_TOKEN");
  unsetenv("FERRY_TOKEN_FILE");
}

static ferry_ctx *open_ctx(const char *name, const char *transports, const char *token) {
  ferry_ctx_opts o = {.size = sizeof o, .name = name, .transports = transports, .token = token};
  ferry_ctx *c = NULL;
  FR_OK(ferry_ctx_open(&o, &c));
  return c;
}

/* A node with a shared region full of a known pattern. */
typedef struct node {
  ferry_ctx *ctx;
  void *mem;
  ferry_region_ref ref;
  char id[24], key[24], size[24];
} node;

static void node_open(node *n) {
  n->ctx = open_ctx("owner", "shm,tcp", NULL);
  FR_OK(ferry_alloc(n->ctx, REGION_BYTES, &n->mem));
  tu_fill(n->mem, REGION_BYTES, SEED);
  FR_OK(ferry_region_find(n->ctx, n->mem, REGION_BYTES, &n->ref, NULL));
  snprintf(n->id, sizeof n->id, "%llu", (unsigned long long)n->ref.id);
  snprintf(n->key, sizeof n->key, "%llu", (unsigned long long)n->ref.key);
  snprintf(n->size, sizeof n->size, "%llu", (unsigned long long)n->ref.size);
}

static bool node_intact(const node *n) {
  uint8_t *want = malloc(REGION_BYTES);
  tu_fill(want, REGION_BYTES, SEED);
  bool same = memcmp(want, n->mem, REGION_BYTES) == 0;
  free(want);
  return same;
}

static ferry_region_ref ref_of(char **argv) {
  return (ferry_region_ref){strtoull(argv[0], NULL, 10), strtoull(argv[1], NULL, 10),
                            strtoull(argv[2], NULL, 10)};
}

/* ---- helpers (this binary again) ---- */

/* Same user, no configuration: connects over shm, then over tcp ("" as the token, which means
 * the same as none given), reads the region and checks the pattern. */
static int same_user(const char *address, char **refv) {
  ferry_region_ref ref = ref_of(refv);
  const char *transports[] = {"shm", "tcp"};
  const char *tokens[] = {NULL, ""};
  uint8_t *got = malloc(REGION_BYTES), *want = malloc(REGION_BYTES);
  tu_fill(want, REGION_BYTES, SEED);
  for (int i = 0; i < 2; i++) {
    ferry_ctx_opts o = {.size = sizeof o, .name = "same", .transports = transports[i]};
    o.token = tokens[i];
    ferry_ctx *c = NULL;
    ferry_link *l = NULL;
    int rc = ferry_ctx_open(&o, &c);
    if (rc == 0)
      rc = ferry_connect(c, address, 10000, &l);
    if (rc == 0)
      rc = ferry_read(l, &ref, 0, got, REGION_BYTES, 10000);
    if (rc != 0 || memcmp(got, want, REGION_BYTES) != 0) {
      fprintf(stderr, "same user over %s: %s (%s)\n", transports[i], ferry_status_name(rc),
              ferry_last_error());
      return 1 + i;
    }
    ferry_link_close(l);
    ferry_ctx_close(c);
  }
  free(got);
  free(want);
  return 0;
}

/* HELLO on the node's shm socket by hand: the node must refuse it at once (status EAUTH, no
 * challenge), which only its uid check does; a token mismatch would answer a challenge first. */
static bool raw_hello_refused(const char *address) {
  const char *at = strstr(address, "shm://@");
  if (!at)
    return false;
  at += 6;
  size_t n = strcspn(at, ",");
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (n >= sizeof sa.sun_path)
    return false;
  memcpy(sa.sun_path, at, n);
  sa.sun_path[0] = '\0';
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  struct timeval tv = {10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (connect(fd, (struct sockaddr *)&sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n)))
    return false;
  fr_hello h = {.name = "intruder"};
  uint8_t body[FR_HELLO_BYTES], hdr[FR_FRAME_BYTES];
  fr_hello_encode(&h, body);
  fr_frame_encode(&(fr_frame){.type = FR_HELLO, .len = FR_HELLO_BYTES}, hdr);
  bool sent =
      write(fd, hdr, sizeof hdr) == sizeof hdr && write(fd, body, sizeof body) == sizeof body;
  size_t got = 0;
  for (ssize_t r = 1; sent && got < sizeof hdr && r > 0; got += r > 0 ? (size_t)r : 0)
    r = read(fd, hdr + got, sizeof hdr - got);
  fr_frame f;
  bool refused = got == sizeof hdr && fr_frame_decode(hdr, 1 << 20, &f) == 0 &&
                 f.type == FR_HELLO_ACK && f.status == FERRY_EAUTH && f.len == 0;
  close(fd);
  return refused;
}

/* The owner's memory through /proc: its fds (memfds of its regions and rings) and its mem. */
static bool proc_closed(pid_t owner) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)owner);
  DIR *d = opendir(path);
  bool closed = true;
  for (struct dirent *e; d && (e = readdir(d));) {
    char fd_path[320];
    snprintf(fd_path, sizeof fd_path, "%s/%s", path, e->d_name);
    int fd = e->d_name[0] == '.' ? -1 : open(fd_path, O_RDONLY);
    if (fd >= 0) {
      closed = false;
      close(fd);
    }
  }
  if (d)
    closedir(d);
  snprintf(path, sizeof path, "/proc/%d/mem", (int)owner);
  int fd = open(path, O_RDONLY);
  if (fd >= 0) {
    closed = false;
    close(fd);
  }
  return closed;
}

/* Another user, trying what it can: root's token file, connecting over shm and tcp with its own
 * secret and with a guessed token, a raw handshake, /proc. Exits 0 when everything was refused. */
static int intruder(const char *address, char **refv, const char *root_file, const char *own_file) {
  ferry_region_ref ref = ref_of(refv);
  pid_t owner = getppid();
  if (setgroups(0, NULL) != 0 || setresgid(NOBODY, NOBODY, NOBODY) != 0 ||
      setresuid(NOBODY, NOBODY, NOBODY) != 0 || geteuid() != NOBODY) {
    fprintf(stderr, "intruder: cannot become uid %d: %s\n", NOBODY, strerror(errno));
    return 2;
  }
  int fd = open(root_file, O_RDONLY);
  if (fd >= 0 || errno != EACCES) {
    fprintf(stderr, "intruder: root's token file %s: %s\n", root_file,
            fd >= 0 ? "readable" : strerror(errno));
    return 3;
  }
  setenv("FERRY_TOKEN_FILE", own_file, 1); /* its own per-user secret, as its ferry would make */
  const char *transports[] = {"shm", "tcp"};
  const char *tokens[] = {NULL, "a-guess-of-16-bytes-or-more"};
  for (int t = 0; t < 2; t++)
    for (int k = 0; k < 2; k++) {
      ferry_ctx_opts o = {.size = sizeof o, .name = "intruder", .transports = transports[t]};
      o.token = tokens[k];
      ferry_ctx *c = NULL;
      ferry_link *l = NULL;
      int rc = ferry_ctx_open(&o, &c);
      if (rc != 0) {
        fprintf(stderr, "intruder: own ctx: %s\n", ferry_last_error());
        return 4;
      }
      rc = ferry_connect(c, address, 10000, &l);
      if (rc != FERRY_EAUTH) {
        uint8_t byte = 0;
        fprintf(stderr, "intruder over %s (token %s): connect %s (%s); read %s\n", transports[t],
                tokens[k] ? tokens[k] : "its own", ferry_status_name(rc), ferry_last_error(),
                rc == 0 ? ferry_status_name(ferry_read(l, &ref, 0, &byte, 1, 1000)) : "-");
        return 5;
      }
      ferry_ctx_close(c);
    }
  if (!raw_hello_refused(address)) {
    fprintf(stderr, "intruder: a raw HELLO over shm was not refused by uid\n");
    return 6;
  }
  if (!proc_closed(owner)) {
    fprintf(stderr, "intruder: opened something of the owner's under /proc\n");
    return 7;
  }
  return 0;
}

/* Makes (or reads) the secret and writes it to fd: racing processes must agree. */
static int token_race(int fd) {
  char *t = NULL;
  if (fr_user_token(&t) != 0) {
    fprintf(stderr, "token race: %s\n", ferry_last_error());
    return 1;
  }
  char line[128];
  int n = snprintf(line, sizeof line, "%-64.64s\n", t);
  free(t);
  return write(fd, line, (size_t)n) == n ? 0 : 1;
}

/* ---- tests ---- */

static void check_private_file(const char *path) {
  struct stat st;
  assert_int_equal(stat(path, &st), 0);
  assert_true(S_ISREG(st.st_mode));
  assert_int_equal(st.st_mode & 07777, 0600);
  assert_int_equal(st.st_uid, geteuid());
}

/* The secret is made 0600 whatever the umask, in a folder made 0700, and holds 32 random bytes
 * in hex; without FERRY_TOKEN_FILE it is ~/.ferry/token, home from the password database. */
static void test_token_file_made_private(void **s) {
  tmp_make();
  defaults();
  use_token_file("sub/token");
  mode_t old = umask(0);
  ferry_ctx *c = open_ctx("maker", "shm,tcp", NULL);
  umask(old);
  char path[128];
  snprintf(path, sizeof path, "%s/sub/token", tmpdir);
  check_private_file(path);
  snprintf(path, sizeof path, "%s/sub", tmpdir);
  struct stat st;
  assert_int_equal(stat(path, &st), 0);
  assert_int_equal(st.st_mode & 07777, 0700);
  char *t = NULL;
  FR_OK(fr_user_token(&t));
  assert_int_equal(strlen(t), 64);
  assert_int_equal(strspn(t, "0123456789abcdef"), 64);
  free(t);
  ferry_ctx_close(c);

  defaults();
  c = open_ctx("maker", "shm", NULL);
  ferry_ctx_close(c);
  struct passwd *pw = getpwuid(geteuid());
  assert_non_null(pw);
  char want[512], got[512];
  snprintf(want, sizeof want, "%s/.ferry/token", pw->pw_dir);
  FR_OK(fr_config_token_path(got, sizeof got));
  assert_string_equal(got, want);
  check_private_file(want);
  tmp_remove();
  (void)s;
}

static void expect_refused(const char *why) {
  ferry_ctx_opts o = {.size = sizeof o, .name = "refused", .transports = "shm,tcp"};
  ferry_ctx *c = NULL;
  assert_int_equal(ferry_ctx_open(&o, &c), FERRY_EINVAL);
  assert_null(c);
  const char *e = ferry_last_error();
  if (!strstr(e, why) || !strstr(e, tmpdir))
    fail_msg("expected '%s' and the path in: %s", why, e);
}

/* A token file that is not this user's alone, or holds no token, is refused with one line that
 * names it and says what to do; an explicit token does not read it at all. */
static void test_token_file_refused(void **s) {
  tmp_make();
  defaults();
  use_token_file("token");
  char path[128];
  snprintf(path, sizeof path, "%s/token", tmpdir);
  FILE *f = fopen(path, "w");
  fputs("a-secret-of-16-bytes-or-more\n", f);
  fclose(f);
  assert_int_equal(chmod(path, 0644), 0);
  expect_refused("chmod 600");
  assert_int_equal(chmod(path, 0640), 0);
  expect_refused("group or others");
  assert_int_equal(chmod(path, 0602), 0);
  expect_refused("mode 0602");
  /* an explicit token wins: the file is not read */
  setenv("FERRY_TOKEN", "explicit-token-0123456", 1);
  ferry_ctx_close(open_ctx("explicit", "shm,tcp", NULL));
  unsetenv("FERRY_TOKEN");
  ferry_ctx_close(open_ctx("explicit", "shm,tcp", "explicit-token-too-of-32-bytes-0"));
  assert_int_equal(chmod(path, 0600), 0);
  ferry_ctx_close(open_ctx("fixed", "shm,tcp", NULL));
  if (geteuid() == 0) {
    assert_int_equal(chown(path, NOBODY, NOBODY), 0);
    expect_refused("owned by uid 65534");
    assert_int_equal(chown(path, 0, 0), 0);
  }
  f = fopen(path, "w"); /* 15 bytes: too short to be a secret (issue 32 row 12) */
  fputs("a-15-byte-token\n", f);
  fclose(f);
  expect_refused("head -c 32 /dev/urandom | base64 >");
  assert_int_equal(truncate(path, 0), 0);
  expect_refused("empty");
  assert_int_equal(unlink(path), 0);
  assert_int_equal(mkdir(path, 0700), 0);
  expect_refused("not a regular file");
  assert_int_equal(rmdir(path), 0);
  tmp_remove();
  (void)s;
}

/* An explicit token (FERRY_TOKEN or ferry_ctx_opts.token) shorter than 16 bytes is refused with
 * one line saying how to make one (issue 32 row 12: a 1-byte token was a fleet's secret). */
static void test_short_token_refused(void **s) {
  defaults();
  ferry_ctx_opts o = {.size = sizeof o, .name = "short", .transports = "shm,tcp"};
  ferry_ctx *c = NULL;
  setenv("FERRY_TOKEN", "x", 1);
  assert_int_equal(ferry_ctx_open(&o, &c), FERRY_EINVAL);
  assert_null(c);
  assert_non_null(strstr(ferry_last_error(), "FERRY_TOKEN is 1 bytes"));
  assert_non_null(strstr(ferry_last_error(), "head -c 32 /dev/urandom | base64"));
  unsetenv("FERRY_TOKEN");
  o.token = "fifteen-bytes!!";
  assert_int_equal(ferry_ctx_open(&o, &c), FERRY_EINVAL);
  assert_non_null(strstr(ferry_last_error(), "at least 16"));
  o.token = "sixteen-bytes!!!";
  FR_OK(ferry_ctx_open(&o, &c));
  ferry_ctx_close(c);
  (void)s;
}

/* Eight processes start at once with no secret yet: one makes it, all use the same one, and no
 * temporary file is left. */
static void test_token_file_race(void **s) {
  tmp_make();
  defaults();
  use_token_file("race/token");
  tu_pipe p;
  tu_pipe_open(&p);
  char wr[16];
  snprintf(wr, sizeof wr, "%d", p.wr);
  enum { N = 8 };
  pid_t pids[N];
  for (int i = 0; i < N; i++)
    pids[i] = tu_spawn_exec("--token-race", wr, NULL);
  for (int i = 0; i < N; i++)
    assert_int_equal(tu_wait(pids[i]), 0);
  char lines[N][65];
  for (int i = 0; i < N; i++)
    assert_int_equal(tu_pipe_get(&p, lines[i], 65, 10000), 0);
  tu_pipe_close(&p);
  char path[128], file[80];
  snprintf(path, sizeof path, "%s/race/token", tmpdir);
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  assert_non_null(fgets(file, sizeof file, f));
  fclose(f);
  for (int i = 0; i < N; i++)
    assert_memory_equal(lines[i], file, 64);
  check_private_file(path);
  snprintf(path, sizeof path, "%s/race", tmpdir);
  DIR *d = opendir(path);
  int entries = 0;
  for (struct dirent *e; (e = readdir(d));)
    entries += e->d_name[0] != '.';
  closedir(d);
  assert_int_equal(entries, 1);
  tmp_remove();
  (void)s;
}

/* Processes of one user talk with no configuration ("" as the token is the same as none); one
 * given an explicit token does not talk to one on the per-user secret. */
static void test_same_user_no_config(void **s) {
  defaults();
  node n;
  node_open(&n);
  pid_t pid = tu_spawn_exec("--same-user", ferry_ctx_address(n.ctx), n.id, n.key, n.size, NULL);
  assert_int_equal(tu_wait(pid), 0);
  ferry_ctx *x = open_ctx("explicit", "shm,tcp", "some-fleet-token-of-32-bytes-000");
  ferry_link *l = NULL;
  assert_int_equal(ferry_connect(x, ferry_ctx_address(n.ctx), 10000, &l), FERRY_EAUTH);
  ferry_ctx_close(x);
  ferry_ctx_close(n.ctx);
  (void)s;
}

/* #17 row 2: with default settings, another Unix user listed, read, overwrote and deleted root's
 * keys. Now it cannot connect over shm or tcp, with its own secret or a guessed one, cannot read
 * root's secret, nor reach the node's memory under /proc; the owner's region is untouched and
 * the owner still serves its own user. */
static void test_other_user_refused(void **s) {
  if (geteuid() != 0) {
    tu_skip(TU_SKIP_NOT_HERE, "another user: needs root to become uid %d", NOBODY);
    return;
  }
  tmp_make();
  defaults();
  char own[128], root_file[512];
  snprintf(own, sizeof own, "%s/nobody", tmpdir);
  assert_int_equal(mkdir(own, 0700), 0);
  assert_int_equal(chown(own, NOBODY, NOBODY), 0);
  strcat(own, "/token");
  FR_OK(fr_config_token_path(root_file, sizeof root_file));
  node n;
  node_open(&n);
  check_private_file(root_file);
  pid_t pid = tu_spawn_exec("--intruder", ferry_ctx_address(n.ctx), n.id, n.key, n.size, root_file,
                            own, NULL);
  assert_int_equal(tu_wait(pid), 0);
  assert_true(node_intact(&n));
  pid = tu_spawn_exec("--same-user", ferry_ctx_address(n.ctx), n.id, n.key, n.size, NULL);
  assert_int_equal(tu_wait(pid), 0);
  ferry_ctx_close(n.ctx);
  tmp_remove();
  (void)s;
}

/* Beyond loopback the per-user secret is not enough: only an explicit token opens the port. */
static void test_exposed_needs_explicit_token(void **s) {
  defaults();
  ferry_ctx_opts o = {
      .size = sizeof o, .name = "wide", .transports = "tcp", .tcp_listen = "0.0.0.0:0"};
  ferry_ctx *c = NULL;
  assert_int_equal(ferry_ctx_open(&o, &c), FERRY_EINVAL);
  assert_non_null(strstr(ferry_last_error(), "FERRY_TOKEN"));
  setenv("FERRY_TOKEN", "fleet-secret-of-32-bytes-000000", 1);
  FR_OK(ferry_ctx_open(&o, &c));
  ferry_ctx_close(c);
  unsetenv("FERRY_TOKEN");
  (void)s;
}

/* #32 row 3: any local user denied ferry serve's /healthz (a liveness probe's restart) with ~70
 * connections trickling a header line each: libmicrohttpd's 64 were held as long as they
 * trickled, and the probe was refused. Now a request must arrive whole within
 * FERRY_HTTP_HEADER_MS (1 s here) and a full server closes the oldest connection still sending:
 * every probe is answered while they trickle (within 2 s, a hang bound), and every trickler is
 * closed (within 4 s of the flood's end). */
static void test_metrics_slowloris(void **s) {
  defaults();
  setenv("FERRY_HTTP_HEADER_MS", "1000", 1);
  ferry_ctx *c = open_ctx("loris", "tcp", NULL);
  ferry_metrics_server *m = NULL;
  FR_OK(ferry_metrics_serve(c, "127.0.0.1:0", &m));
  unsetenv("FERRY_HTTP_HEADER_MS");
  int port = atoi(strrchr(ferry_metrics_server_address(m), ':') + 1);
  tu_loris r = tu_slowloris(port, 70, 1000, 3000, 4000, "/healthz", 2000);
  printf("# %d trickling connections; %d/%d probes answered, slowest %d ms; %d left open\n",
         r.opened, r.probes_ok, r.probes, r.worst_probe_ms, r.still_open);
  ferry_metrics_server_close(m);
  ferry_ctx_close(c);
  assert_true(r.opened >= 70);
  assert_true(r.probes >= 2); /* one at the start, and one at least every 2.2 s */
  assert_int_equal(r.probes_ok, r.probes);
  assert_int_equal(r.still_open, 0);
  (void)s;
}

/* A route that holds its request until the test lets go: the server's slots all answering. */
static pthread_mutex_t hold_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_cond = PTHREAD_COND_INITIALIZER;
static int held;
static bool hold_release;

static unsigned hold_route(void *arg, char **body, size_t *len, const char **type) {
  pthread_mutex_lock(&hold_lock);
  held++;
  pthread_cond_broadcast(&hold_cond);
  while (!hold_release)
    pthread_cond_wait(&hold_cond, &hold_lock);
  held--;
  pthread_mutex_unlock(&hold_lock);
  *body = strdup("held\n");
  *len = 5;
  (void)arg, (void)type;
  return 200;
}

/* A whole GET of path from 127.0.0.<host>; its socket (the answer unread), or -1. */
static int get_from(int host, int port, const char *path) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in from = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000000u | host)};
  struct sockaddr_in to = {.sin_family = AF_INET,
                           .sin_port = htons((uint16_t)port),
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  char req[256];
  int n =
      snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", path);
  if (fd < 0 || bind(fd, (struct sockaddr *)&from, sizeof from) != 0 ||
      connect(fd, (struct sockaddr *)&to, sizeof to) != 0 || write(fd, req, (size_t)n) != n) {
    if (fd >= 0)
      close(fd);
    return -1;
  }
  return fd;
}

/* The status of the answer on fd within 2 s (a hang bound), 0 for none; closes fd. */
static int answer(int fd) {
  char resp[512] = "";
  size_t n = 0;
  struct pollfd p = {.fd = fd, .events = POLLIN};
  while (fd >= 0 && n + 1 < sizeof resp && poll(&p, 1, 2000) == 1) {
    ssize_t r = read(fd, resp + n, sizeof resp - 1 - n);
    if (r <= 0)
      break;
    n += (size_t)r;
  }
  resp[n] = '\0';
  if (fd >= 0)
    close(fd);
  int code = 0;
  return sscanf(resp, "HTTP/1.%*d %d", &code) == 1 ? code : 0;
}

/* #32 deliverable 3: health is answered even when every slot is busy answering a request (no
 * connection still sending, so none to close): 64 requests held in a route, 32 from each of two
 * addresses (each address's whole share, and the server's 64); /healthz from a third address,
 * and from a full one, comes in on a reserved slot and is answered (it was refused at the
 * limit), while a held route asked there is told 503 rather than held. */
static void test_metrics_reserved_slots(void **s) {
  defaults();
  ferry_ctx *c = open_ctx("reserve", "tcp", NULL);
  ferry_metrics_server *m = NULL;
  FR_OK(ferry_metrics_serve(c, "127.0.0.1:0", &m));
  FR_OK(fr_metrics_route(m, "/hold", hold_route, NULL));
  int port = atoi(strrchr(ferry_metrics_server_address(m), ':') + 1);
  int fds[64];
  hold_release = false;
  for (int i = 0; i < 64; i++)
    fds[i] = get_from(1 + i % 2, port, "/hold");
  pthread_mutex_lock(&hold_lock);
  struct timespec end;
  clock_gettime(CLOCK_REALTIME, &end);
  end.tv_sec += 10;
  while (held < 64 && pthread_cond_timedwait(&hold_cond, &hold_lock, &end) == 0)
    ;
  int all_held = held;
  pthread_mutex_unlock(&hold_lock);
  /* first, while nothing is closing: any connection that has had its answer may be closed to
   * make room, so the later ones may come in on a slot of an earlier one */
  int hold3 = answer(get_from(3, port, "/hold"));
  int health3 = answer(get_from(3, port, "/healthz"));
  int health1 = answer(get_from(1, port, "/healthz"));
  int ready3 = answer(get_from(3, port, "/readyz"));
  pthread_mutex_lock(&hold_lock);
  hold_release = true;
  pthread_cond_broadcast(&hold_cond);
  pthread_mutex_unlock(&hold_lock);
  int answered = 0;
  for (int i = 0; i < 64; i++)
    answered += answer(fds[i]) == 200;
  int after = answer(get_from(3, port, "/hold"));
  ferry_metrics_server_close(m);
  ferry_ctx_close(c);
  printf("# %d held; /healthz %d and %d, /readyz %d, /hold %d while full; %d answered; then %d\n",
         all_held, health3, health1, ready3, hold3, answered, after);
  assert_int_equal(all_held, 64);
  assert_int_equal(health3, 200);
  assert_int_equal(health1, 200);
  assert_int_equal(ready3, 200);
  assert_int_equal(hold3, 503);
  assert_int_equal(answered, 64);
  assert_int_equal(after, 200);
  (void)s;
}

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  if (argc == 6 && strcmp(argv[1], "--same-user") == 0)
    return same_user(argv[2], argv + 3);
  if (argc == 8 && strcmp(argv[1], "--intruder") == 0)
    return intruder(argv[2], argv + 3, argv[6], argv[7]);
  if (argc == 3 && strcmp(argv[1], "--token-race") == 0)
    return token_race(atoi(argv[2]));
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_token_file_made_private),
      cmocka_unit_test(test_token_file_refused),
      cmocka_unit_test(test_short_token_refused),
      cmocka_unit_test(test_token_file_race),
      cmocka_unit_test(test_same_user_no_config),
      cmocka_unit_test(test_other_user_refused),
      cmocka_unit_test(test_exposed_needs_explicit_token),
      cmocka_unit_test(test_metrics_slowloris),
      cmocka_unit_test(test_metrics_reserved_slots),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, NULL, NULL);
}
