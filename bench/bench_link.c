/*
 * `ferry bench link`: what a link costs against the physical limits, in one run.
 *
 * A child process owns a region; this process reads it with ferry over shm and over tcp. In the
 * same run: a single-thread memcpy of the same bytes (the limit for shm), and a plain blocking
 * TCP socket over loopback that streams the same bytes on request (the limit for tcp). Round
 * trips: 64-byte messages echoed by the child over ferry shm and tcp, against a plain blocking
 * socket ping-pong; and 64-byte one-sided reads.
 *
 * With UCX built in, the same over ucx twice, UCX_TLS=sm and UCX_TLS=tcp (a ctx and a region
 * per setting on each side, since UCX reads its settings when a ctx opens), and where ucx-utils
 * is installed, ucx_perftest's own put bandwidth as the figure UCX reaches without ferry; beside
 * the sm rows, one process_vm_readv of the owner's region (`cma`), the copy UCX's shared-memory
 * rendezvous makes for memory it did not allocate. From 16 MiB, the ferry/tcp and ferry/ucx-tcp
 * reads take turns, so the two rows, whose ratio is a target, see the same load.
 *
 * By default the run holds the rows the targets are judged by (docs/PERFORMANCE.md): reads of
 * 64 MiB and the 64-byte round trips, these for a time budget. `--full` reads every size from
 * 4 KiB to --max-size with ucx_perftest beside the ucx rows, and 20,000 round trips a row.
 */
#include "cli/bench.h"
#include "cli/cli.h"
#include "ferry.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define ECHO_CHANNEL 1

#ifdef FERRY_HAVE_UCX
#define UCX_FLAVORS 2
#else
#define UCX_FLAVORS 0
#endif
static const char *const ucx_tls[] = {"sm", "tcp"}; /* UCX_TLS of each ucx flavor */

typedef struct owner_info {
  char address[512];
  ferry_region_ref ref;
  int socket_port; /* the plain-socket baseline server */
  char ucx_address[2][512];
  ferry_region_ref ucx_ref[2];
  uint64_t ucx_mem[2]; /* where the owner's ucx regions lie in its address space (cma row) */
} owner_info;

/* ---- the owner (child process) ---- */

typedef struct socket_server {
  int listen_fd;
  const uint8_t *data;
} socket_server;

/* The plain-socket baseline: a request is 8 bytes (a length); the answer is that many bytes. */
static void *socket_serve(void *arg) {
  socket_server *s = arg;
  int fd = accept(s->listen_fd, NULL, NULL);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  uint64_t len;
  while (bench_read_all(fd, &len, sizeof len) == 0)
    if (bench_write_all(fd, s->data, (size_t)len) != 0)
      break;
  close(fd);
  return NULL;
}

static void *echo_serve(void *arg) {
  ferry_ctx *ctx = arg;
  for (;;) {
    ferry_msg *m;
    int rc = ferry_recv(ctx, ECHO_CHANNEL, &m, 60000);
    if (rc == FERRY_ECLOSED)
      return NULL;
    if (rc != 0)
      continue;
    struct iovec iov = {m->data, m->len};
    ferry_send(m->link, ECHO_CHANNEL, &iov, 1, 5000);
    ferry_msg_free(m);
  }
}

static int listen_loopback(int *port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, 4) < 0 ||
      getsockname(fd, (struct sockaddr *)&sa, &len) < 0)
    return -1;
  *port = ntohs(sa.sin_port);
  return fd;
}

/* A ctx with only ucx under UCX_TLS=tls (read when the ctx opens). */
static int open_ucx_ctx(const char *name, const char *tls, ferry_ctx **out) {
  char *saved = getenv("UCX_TLS") ? strdup(getenv("UCX_TLS")) : NULL;
  setenv("UCX_TLS", tls, 1);
  ferry_ctx_opts o = {.size = sizeof o, .name = name, .transports = "ucx"};
  int rc = ferry_ctx_open(&o, out);
  if (saved)
    setenv("UCX_TLS", saved, 1);
  else
    unsetenv("UCX_TLS");
  free(saved);
  return rc;
}

/* The owner's ucx ctxs, each with its own region of the same bytes. */
static int owner_ucx(owner_info *info, uint64_t bytes) {
  for (int i = 0; i < UCX_FLAVORS; i++) {
    char name[32];
    snprintf(name, sizeof name, "bench-owner-ucx-%s", ucx_tls[i]);
    ferry_ctx *ctx;
    void *mem;
    if (open_ucx_ctx(name, ucx_tls[i], &ctx) != 0 || ferry_alloc(ctx, bytes, &mem) != 0 ||
        ferry_region_find(ctx, mem, bytes, &info->ucx_ref[i], NULL) != 0)
      return -1;
    memset(mem, 0x5a, bytes);
    info->ucx_mem[i] = (uint64_t)(uintptr_t)mem;
    snprintf(info->ucx_address[i], sizeof info->ucx_address[i], "%s", ferry_ctx_address(ctx));
    pthread_t echo_thread;
    pthread_create(&echo_thread, NULL, echo_serve, ctx);
  }
  return 0;
}

static int owner_main(int info_fd, int quit_fd, uint64_t bytes) {
  ferry_ctx_opts o = {.size = sizeof o, .name = "bench-owner", .transports = "shm,tcp"};
  ferry_ctx *ctx;
  void *mem;
  owner_info info;
  memset(&info, 0, sizeof info);
  if (ferry_ctx_open(&o, &ctx) != 0 || ferry_alloc(ctx, bytes, &mem) != 0 ||
      ferry_region_find(ctx, mem, bytes, &info.ref, NULL) != 0) {
    fprintf(stderr, "bench owner: %s\n", ferry_last_error());
    return 1;
  }
  memset(mem, 0x5a, bytes);
  if (owner_ucx(&info, bytes) != 0) {
    fprintf(stderr, "bench owner: ucx: %s\n", ferry_last_error());
    return 1;
  }
  snprintf(info.address, sizeof info.address, "%s", ferry_ctx_address(ctx));
  socket_server srv = {.data = mem};
  srv.listen_fd = listen_loopback(&info.socket_port);
  pthread_t sock_thread, echo_thread;
  pthread_create(&sock_thread, NULL, socket_serve, &srv);
  pthread_create(&echo_thread, NULL, echo_serve, ctx);
  bench_write_all(info_fd, &info, sizeof info);
  char c;
  while (read(quit_fd, &c, 1) < 0 && errno == EINTR)
    ;
  _exit(0); /* the threads are blocked in accept/recv; the process ends them */
}

/* ---- the reader (this process) ---- */

typedef struct reader {
  const bench_opts *o;
  ferry_ctx *ctx;
  ferry_link *shm, *tcp;
  ferry_region_ref ref;
  ferry_ctx *ucx_ctx[2];
  ferry_link *ucx[2];
  ferry_region_ref ucx_ref[2];
  int sock;
  uint8_t *src, *dst; /* memcpy baseline source; destination of every read */
  bool perftest;      /* ucx_perftest is installed and --full asked for its rows */
  pid_t owner;
  uint64_t ucx_mem[2];
} reader;

static int reps_for(const bench_opts *o, uint64_t bytes) {
  if (o->reps > 0)
    return o->reps;
  uint64_t r = (4ull << 30) / (bytes ? bytes : 1);
  return r < 5 ? 5 : r > 200 ? 200 : (int)r;
}

/* A row's samples: `reps` with --full or --reps; by default up to `reps` within `budget_s`
 * seconds, and at least `least`. */
static bench_until until_for(const bench_opts *o, int reps, int least, double budget_s) {
  return o->full || o->reps > 0 ? bench_until_start(reps, reps, 0)
                                : bench_until_start(reps, least, budget_s);
}

/* A read row of the default run: up to reps_for's count within READ_BUDGET_S seconds, at least
 * READ_LEAST (a 64 MiB read takes 5-50 ms here: 60-64 samples on a quiet machine). */
#define READ_LEAST 20
#define READ_BUDGET_S 3.0
static bench_until read_until(const bench_opts *o, int reps) {
  return until_for(o, reps, READ_LEAST, READ_BUDGET_S);
}

/* The reads of the default run: 64 MiB, the size the targets read (less with a smaller
 * --max-size). */
#define TARGET_READ_BYTES (64ull << 20)
static uint64_t largest_read(const bench_opts *o) {
  return o->full || o->max_size < TARGET_READ_BYTES ? o->max_size : TARGET_READ_BYTES;
}

static const ferry_region_ref *ref_of(reader *r, ferry_link *l) {
  for (int i = 0; i < UCX_FLAVORS; i++)
    if (l == r->ucx[i])
      return &r->ucx_ref[i];
  return &r->ref;
}

static int time_ferry_read(reader *r, ferry_link *l, uint64_t bytes, bench_until u,
                           bench_samples *b) {
  const ferry_region_ref *ref = ref_of(r, l);
  int rc = ferry_read(l, ref, 0, r->dst, bytes, -1); /* warm-up: maps, faults */
  while (rc == 0 && !bench_done(&u, b->n)) {
    double t = bench_now();
    rc = ferry_read(l, ref, 0, r->dst, bytes, -1);
    bench_add(b, bench_now() - t);
  }
  if (rc != 0)
    fprintf(stderr, "ferry bench link: read over %s: %s (%s)\n", ferry_link_transport(l),
            ferry_strerror(rc), ferry_last_error());
  return rc;
}

/* Reads over two links in turns, the first of each turn alternating, so both rows see the same
 * load on a shared machine (timed one after the other, a load that moves between the two
 * windows moves their ratio). Only reads that take milliseconds: a short read that follows the
 * other link's would time its own link waking up from idle. */
#define TURNS_MIN_BYTES (16ull << 20)
static int time_ferry_reads_in_turns(reader *r, ferry_link *const l[2], uint64_t bytes,
                                     bench_until u, bench_samples *const b[2]) {
  int rc = 0;
  for (int k = 0; k < 2 && rc == 0; k++) /* warm-up */
    rc = ferry_read(l[k], ref_of(r, l[k]), 0, r->dst, bytes, -1);
  for (int i = 0; rc == 0 && (i % 2 || !bench_done(&u, (size_t)i / 2)); i++) {
    int k = (i & 1) ^ ((i >> 1) & 1); /* turns: 0 1, 1 0, 0 1, ... */
    double t = bench_now();
    rc = ferry_read(l[k], ref_of(r, l[k]), 0, r->dst, bytes, -1);
    bench_add(b[k], bench_now() - t);
  }
  if (rc != 0)
    fprintf(stderr, "ferry bench link: reads over %s and %s: %s (%s)\n", ferry_link_transport(l[0]),
            ferry_link_transport(l[1]), ferry_strerror(rc), ferry_last_error());
  return rc;
}

static int time_socket_read(reader *r, uint64_t bytes, bench_until u, bench_samples *b) {
  for (int i = 0; i == 0 || !bench_done(&u, b->n); i++) {
    double t = bench_now();
    if (bench_write_all(r->sock, &bytes, sizeof bytes) != 0 ||
        bench_read_all(r->sock, r->dst, bytes) != 0) {
      fprintf(stderr, "ferry bench link: socket baseline: %s\n", strerror(errno));
      return -1;
    }
    if (i > 0) /* the first is a warm-up */
      bench_add(b, bench_now() - t);
  }
  return 0;
}

static void time_memcpy(reader *r, uint64_t bytes, bench_until u, bench_samples *b) {
  memcpy(r->dst, r->src, bytes);
  while (!bench_done(&u, b->n)) {
    double t = bench_now();
    memcpy(r->dst, r->src, bytes);
    __asm__ volatile("" ::"r"(r->dst) : "memory");
    bench_add(b, bench_now() - t);
  }
}

/* ucx_perftest's put bandwidth between two processes under UCX_TLS=tls, as seconds per
 * transfer of `bytes` (one sample); -1 when it is not installed or fails. */
static double perftest_put(const char *tls, uint64_t bytes, int reps) {
  int port = 0, fd = listen_loopback(&port);
  if (fd < 0)
    return -1;
  close(fd);
  char p[16], s[24], n[16], cmd[256];
  snprintf(p, sizeof p, "%d", port);
  char *srv_argv[] = {"ucx_perftest", "-p", p, NULL};
  setenv("UCX_TLS", tls, 1); /* the server inherits it; popen's client too */
  pid_t srv;
  posix_spawn_file_actions_t fa; /* the server's report is not ours to print */
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  int spawned = posix_spawnp(&srv, "ucx_perftest", &fa, NULL, srv_argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (spawned != 0)
    return -1;
  usleep(300000);
  snprintf(s, sizeof s, "%llu", (unsigned long long)bytes);
  snprintf(n, sizeof n, "%d", reps < 3 ? 3 : reps);
  snprintf(cmd, sizeof cmd, "ucx_perftest 127.0.0.1 -p %s -t ucp_put_bw -s %s -n %s -f 2>/dev/null",
           p, s, n);
  FILE *f = popen(cmd, "r");
  char line[512];
  double mbps = -1, v[8];
  while (f && fgets(line, sizeof line, f)) { /* iters lat50 lat lat bw bw rate rate */
    const char *c = strchr(line, ':');       /* -f prints the numbers alone */
    if (sscanf(c ? c + 1 : line, "%lf %lf %lf %lf %lf %lf", &v[0], &v[1], &v[2], &v[3], &v[4],
               &v[5]) == 6)
      mbps = v[5]; /* overall MB/s */
  }
  if (f)
    pclose(f);
  kill(srv, SIGTERM);
  waitpid(srv, NULL, 0);
  unsetenv("UCX_TLS");
  return mbps > 0 ? (double)bytes / (mbps * 1024 * 1024) : -1;
}

/* The copy UCX's shared-memory rendezvous makes for memory it did not allocate: one
 * process_vm_readv (cma) of the owner's region, as a limit for the ucx-sm rows. */
static int time_cma(reader *r, uint64_t bytes, bench_until u, bench_samples *b) {
  for (int i = 0; i == 0 || !bench_done(&u, b->n); i++) {
    struct iovec local = {r->dst, bytes}, remote = {(void *)(uintptr_t)r->ucx_mem[0], bytes};
    double t = bench_now();
    if (process_vm_readv(r->owner, &local, 1, &remote, 1, 0) != (ssize_t)bytes)
      return -1; /* not permitted here (ptrace scope): no row */
    if (i > 0)
      bench_add(b, bench_now() - t);
  }
  return 0;
}

/* The ucx rows of one flavor; taken: its reads, timed already (in turns with ferry/tcp). */
static int bench_ucx_reads(reader *r, const char *name, int i, uint64_t bytes, int reps,
                           bench_samples *b, bench_samples *taken) {
  char impl[32];
  if (i == 0) {
    bench_reset(b);
    if (time_cma(r, bytes, read_until(r->o, reps), b) == 0)
      bench_row(r->o, "link", name, "cma", bytes, b, false);
  }
  snprintf(impl, sizeof impl, "ferry/ucx-%s", ucx_tls[i]);
  bench_reset(b);
  int rc = taken ? 0 : time_ferry_read(r, r->ucx[i], bytes, read_until(r->o, reps), b);
  bench_row(r->o, "link", name, impl, bytes, taken ? taken : b, false);
  bench_reset(b);
  double put = rc == 0 && r->perftest ? perftest_put(ucx_tls[i], bytes, reps) : -1;
  if (put > 0) {
    snprintf(impl, sizeof impl, "ucx_perftest/%s", ucx_tls[i]);
    bench_add(b, put);
    bench_row(r->o, "link", name, impl, bytes, b, false);
  }
  return rc;
}

static int bench_reads(reader *r, uint64_t bytes) {
  char name[32], size[16];
  snprintf(name, sizeof name, "read-%s", bench_size_name(bytes, size, sizeof size));
  int reps = reps_for(r->o, bytes);
  bench_samples b = {0};
  time_memcpy(r, bytes, read_until(r->o, reps), &b);
  bench_row(r->o, "link", name, "memcpy", bytes, &b, true);
  bench_reset(&b);
  int rc = time_ferry_read(r, r->shm, bytes, read_until(r->o, reps), &b);
  bench_row(r->o, "link", name, "ferry/shm", bytes, &b, false);
  if (rc == 0 && UCX_FLAVORS > 0)
    rc = bench_ucx_reads(r, name, 0, bytes, reps, &b, NULL);
  bench_reset(&b);
  if (rc == 0 && (rc = time_socket_read(r, bytes, read_until(r->o, reps), &b)) == 0)
    bench_row(r->o, "link", name, "socket", bytes, &b, true);
  bench_reset(&b);
  bench_samples ucx_tcp = {0};
  if (rc == 0 && UCX_FLAVORS > 1 && bytes >= TURNS_MIN_BYTES) /* ferry/tcp and ucx-tcp in turns */
    rc = time_ferry_reads_in_turns(r, (ferry_link *const[2]){r->tcp, r->ucx[1]}, bytes,
                                   until_for(r->o, reps, READ_LEAST, 2 * READ_BUDGET_S),
                                   (bench_samples *const[2]){&b, &ucx_tcp});
  else if (rc == 0)
    rc = time_ferry_read(r, r->tcp, bytes, read_until(r->o, reps), &b);
  bench_row(r->o, "link", name, "ferry/tcp", bytes, &b, false);
  if (rc == 0 && UCX_FLAVORS > 1)
    rc = bench_ucx_reads(r, name, 1, bytes, reps, &b, bytes >= TURNS_MIN_BYTES ? &ucx_tcp : NULL);
  bench_free(&ucx_tcp);
  bench_free(&b);
  return rc;
}

static int time_echo(ferry_ctx *ctx, ferry_link *l, bench_until u, bench_samples *b) {
  char msg[64] = "ping";
  struct iovec iov = {msg, sizeof msg};
  for (int i = 0; i == 0 || !bench_done(&u, b->n); i++) {
    double t = bench_now();
    ferry_msg *m;
    int rc = ferry_send(l, ECHO_CHANNEL, &iov, 1, -1);
    if (rc == 0)
      rc = ferry_recv(ctx, ECHO_CHANNEL, &m, -1);
    if (rc != 0) {
      fprintf(stderr, "ferry bench link: echo over %s: %s\n", ferry_link_transport(l),
              ferry_last_error());
      return rc;
    }
    ferry_msg_free(m);
    if (i > 0)
      bench_add(b, bench_now() - t);
  }
  return 0;
}

/* A round-trip row of the default run: up to 20,000 within RTT_BUDGET_S seconds, at least
 * RTT_LEAST (their targets read medians). */
#define RTT_REPS 20000
#define RTT_LEAST 2000
#define RTT_BUDGET_S 1.0
static bench_until rtt_until(const bench_opts *o) {
  return until_for(o, o->reps > 0 ? o->reps : RTT_REPS, RTT_LEAST, RTT_BUDGET_S);
}

/* One 64-byte round-trip row: what it times (a socket ping-pong, a message echo or a one-sided
 * read) and over which link. */
enum { RTT_SOCKET, RTT_ECHO, RTT_READ };
typedef struct rtt_case {
  const char *case_name;
  char impl[32];
  int kind;
  ferry_ctx *ctx;
  ferry_link *link;
  bool base;
} rtt_case;

static int rtt_time(reader *r, const rtt_case *c, bench_until u, bench_samples *b) {
  bench_reset(b);
  if (c->kind == RTT_SOCKET)
    return time_socket_read(r, 64, u, b);
  if (c->kind == RTT_ECHO)
    return time_echo(c->ctx, c->link, u, b);
  return time_ferry_read(r, c->link, 64, u, b);
}

/* Times the row with u, its wake-ups (this process and the owner's) counted into w. */
static int rtt_counted(reader *r, const rtt_case *c, bench_until u, bench_samples *b,
                       bench_wake *w) {
  bench_wake_init(w, &r->owner, 1);
  bench_wake_begin(w);
  int rc = rtt_time(r, c, u, b);
  bench_wake_end(w, b->n + 1); /* and the warm-up call each loop makes */
  return rc;
}

/* The row back to back, then (unless --pace 0) paced, beside it; both with their wake-ups per
 * call (the owner's idle rate beside the paced one's). */
static int rtt_row(reader *r, const rtt_case *c, bench_samples *b) {
  bench_wake w;
  int rc = rtt_counted(r, c, rtt_until(r->o), b, &w);
  bench_row_wake(r->o, "link", c->case_name, c->impl, 64, b, c->base, &w);
  double b2b = bench_median(b);
  if (rc == 0 && bench_paced_samples(r->o) > 0 &&
      (rc = rtt_counted(r, c, bench_until_paced(r->o), b, &w)) == 0) {
    bench_wake_idle(&w, BENCH_WAKE_IDLE_MS);
    bench_paced_row(r->o, "link", c->case_name, c->impl, 64, b, b2b, &w);
  }
  return rc;
}

static rtt_case rtt(const char *case_name, const char *impl, int kind, ferry_ctx *ctx,
                    ferry_link *link) {
  rtt_case c = {.case_name = case_name, .kind = kind, .ctx = ctx, .link = link};
  snprintf(c.impl, sizeof c.impl, "%s", impl);
  c.base = kind == RTT_SOCKET; /* the plain socket is each case's reference */
  return c;
}

static int bench_round_trips(reader *r) {
  rtt_case cases[6 + 2 * UCX_FLAVORS];
  int n = 0;
  char impl[32];
  for (int one_sided = 0; one_sided < 2; one_sided++) {
    const char *cs = one_sided ? "read-64B" : "rtt-64B";
    int kind = one_sided ? RTT_READ : RTT_ECHO;
    cases[n++] = rtt(cs, "socket", RTT_SOCKET, NULL, NULL);
    cases[n++] =
        rtt(cs, one_sided ? "ferry/tcp" : "ferry/shm", kind, r->ctx, one_sided ? r->tcp : r->shm);
    cases[n++] =
        rtt(cs, one_sided ? "ferry/shm" : "ferry/tcp", kind, r->ctx, one_sided ? r->shm : r->tcp);
    for (int i = 0; i < UCX_FLAVORS; i++) {
      snprintf(impl, sizeof impl, "ferry/ucx-%s", ucx_tls[i]);
      cases[n++] = rtt(cs, impl, kind, r->ucx_ctx[i], r->ucx[i]);
    }
  }
  bench_samples b = {0};
  int rc = 0;
  for (int i = 0; i < n && rc == 0; i++)
    rc = rtt_row(r, &cases[i], &b);
  bench_free(&b);
  return rc;
}

/* The URL of one transport out of an address list, e.g. "tcp://127.0.0.1:4000". */
static void pick(const char *address, const char *scheme, char *out, size_t len) {
  const char *p = strstr(address, scheme);
  size_t n = p ? strcspn(p, ",") : 0;
  snprintf(out, len, "%.*s", (int)n, p ? p : "");
}

static int connect_all(reader *r, const owner_info *info) {
  ferry_ctx_opts o = {.size = sizeof o, .name = "bench-reader", .transports = "shm,tcp"};
  char url[256];
  int rc = ferry_ctx_open(&o, &r->ctx);
  pick(info->address, "shm://", url, sizeof url);
  if (rc == 0)
    rc = ferry_connect(r->ctx, url, -1, &r->shm);
  pick(info->address, "tcp://", url, sizeof url);
  if (rc == 0)
    rc = ferry_connect(r->ctx, url, -1, &r->tcp);
  for (int i = 0; i < UCX_FLAVORS && rc == 0; i++) {
    char name[32];
    snprintf(name, sizeof name, "bench-reader-ucx-%s", ucx_tls[i]);
    if ((rc = open_ucx_ctx(name, ucx_tls[i], &r->ucx_ctx[i])) == 0)
      rc = ferry_connect(r->ucx_ctx[i], info->ucx_address[i], -1, &r->ucx[i]);
    r->ucx_ref[i] = info->ucx_ref[i];
  }
  if (rc != 0)
    return cli_fail("bench link", rc, "connect to the owner");
  r->ref = info->ref;
  memcpy(r->ucx_mem, info->ucx_mem, sizeof r->ucx_mem);
  r->perftest =
      UCX_FLAVORS > 0 && r->o->full && system("command -v ucx_perftest >/dev/null 2>&1") == 0;
  r->sock = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET,
                           .sin_port = htons((uint16_t)info->socket_port),
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  int one = 1;
  setsockopt(r->sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (connect(r->sock, (struct sockaddr *)&sa, sizeof sa) != 0) {
    perror("ferry bench link: socket baseline");
    return CLI_FAIL;
  }
  return 0;
}

static const char link_usage[] =
    "usage: ferry bench link [--json] [--reps N] [--max-size BYTES] [--full] [--pace MS]\n\n"
    "One-sided reads of 64 MiB (--full: every size of 4 KiB..1 GiB, up to --max-size) from\n"
    "another process, over ferry shm and tcp, against memcpy and a plain loopback socket\n"
    "stream; 64-byte round trips (message echo and one-sided read) against a plain socket\n"
    "ping-pong. With UCX: ucx rows under UCX_TLS=sm and UCX_TLS=tcp (--full: and\n"
    "ucx_perftest's put bandwidth beside them). By default each row takes its samples within\n"
    "a few seconds (64 MiB reads: up to 64, at least 20; round trips: up to 20,000, at least\n"
    "2,000); --full and --reps N take a fixed count (reads: by size; round trips: 20,000).\n"
    "Each round-trip row also runs paced (--pace MS, default 10: 100 calls, each after that\n"
    "pause; --full: 1,000): p50, p99 and paced p50 / back-to-back p50; both runs with\n"
    "wake-ups/call (JSON wakeups_per_call): voluntary context switches per call of this\n"
    "process and the owner process, the pauses left out (`ferry bench --help`).\n";

int bench_link(int argc, char **argv) {
  bench_opts o = {.max_size = 1ull << 30};
  if (bench_parse(argc, argv, &o, link_usage) < 0)
    return CLI_USAGE;
  signal(SIGPIPE, SIG_IGN);
  int info_pipe[2], quit_pipe[2];
  if (pipe(info_pipe) != 0 || pipe(quit_pipe) != 0)
    return CLI_FAIL;
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    close(quit_pipe[1]);
    _exit(owner_main(info_pipe[1], quit_pipe[0], largest_read(&o)));
  }
  close(quit_pipe[0]);
  owner_info info;
  reader r = {.o = &o, .owner = pid};
  int rc =
      bench_read_all(info_pipe[0], &info, sizeof info) == 0 ? connect_all(&r, &info) : CLI_FAIL;
  uint64_t largest = largest_read(&o);
  if (rc == 0) {
    r.src = malloc(largest);
    r.dst = malloc(largest);
    if (!r.src || !r.dst)
      rc = CLI_FAIL;
    else
      memset(r.src, 0x5a, largest), memset(r.dst, 0, largest);
  }
  bench_header(&o, "ferry bench link (one-sided reads from another process; vs base = speed)");
  for (uint64_t s = 4096; o.full && rc == 0 && s <= o.max_size; s *= (s < (1 << 20) ? 16 : 4))
    rc = bench_reads(&r, s);
  if (!o.full && rc == 0 && largest > 0)
    rc = bench_reads(&r, largest);
  if (rc == 0)
    rc = bench_round_trips(&r);
  ferry_link_close(r.shm);
  ferry_link_close(r.tcp);
  ferry_ctx_close(r.ctx);
  for (int i = 0; i < UCX_FLAVORS; i++) {
    ferry_link_close(r.ucx[i]);
    ferry_ctx_close(r.ucx_ctx[i]);
  }
  close(quit_pipe[1]);
  waitpid(pid, NULL, 0);
  free(r.src);
  free(r.dst);
  return rc == 0 ? CLI_OK : CLI_FAIL;
}
