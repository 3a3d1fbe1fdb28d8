/*
 * `ferry bench mq`: message latency and streaming throughput between two processes, ferry's mq
 * against nng (pair1) and ZeroMQ (PAIR), each over its same-host transport (ferry shm, ipc) and
 * over loopback tcp, in one run.
 *
 * For each implementation a server process (this binary exec'd again, so it starts clean of the
 * libraries' threads) echoes every message (ping-pong: one-way latency = round trip / 2, p50 and
 * p99) or, asked by a small command message, streams N messages of one size; this process
 * receives them and times from the end of a warm-up (the first eighth) to the last one
 * (messages/s and GB/s at the receiver). Receivers take each message and free it without
 * copying it anywhere: ferry hands out the bytes where they arrived (the ring's copy, or the
 * publisher's shared pool for large messages), nng and ZeroMQ in the buffer they received into.
 * ferry/shm-loan streams large messages built in loans from the publisher's pool (no copy).
 * memcpy of the same size, timed as a stream is, is the reference for large messages on one
 * host; its streams take turns with ferry/shm's (one after each), so a slower phase of the
 * shared machine's memory bandwidth hits both rows alike. nng and ZeroMQ are linked into this
 * command only (never into libferry); without them their rows say so.
 */
#include "cli/bench.h"
#include "cli/cli.h"
#include "ferry.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef FERRY_BENCH_NNG
#include <nng/nng.h>
#include <nng/protocol/pair1/pair.h>
#endif
#ifdef FERRY_BENCH_ZMQ
#include <zmq.h>
#endif

extern char **environ;

#define CMD_MAGIC 0x4d5145524e454242ull /* "BBENREQM": a stream request, 24 bytes */
#define LOAN_MIN (256u << 10)           /* ferry/shm-loan streams messages this large and larger */

typedef struct ep ep; /* one end of a connection, any implementation */
typedef struct ep_ops {
  int (*send)(ep *e, const void *data, size_t len);
  /* Receives one message: *data and *len until release(e, *token). */
  int (*recv)(ep *e, const void **data, size_t *len, void **token);
  void (*release)(ep *e, void *token);
  void (*close)(ep *e);
} ep_ops;

struct ep {
  const ep_ops *ops;
  ferry_ctx *ctx;
  ferry_mq *mq;
  const char *out_topic;
#ifdef FERRY_BENCH_NNG
  nng_socket nng;
#endif
  void *zctx, *zsock;
};

typedef struct impl {
  const char *name, *cls; /* "ferry/shm", "ipc" */
  bool built;
  bool loan; /* ferry/shm-loan: streams messages built in loans (large messages only) */
  /* Server (child): sets up, writes one line (its address) to fd, then serves. */
  int (*serve_open)(ep *e, char *addr, size_t cap);
  int (*client_open)(ep *e, const char *addr);
} impl;

/* ---- ferry ---- */

static int f_send(ep *e, const void *data, size_t len) {
  return ferry_mq_publish(e->mq, e->out_topic, data, len, 60000);
}
static int f_recv(ep *e, const void **data, size_t *len, void **token) {
  ferry_mq_msg *m;
  int rc = ferry_mq_recv(e->mq, &m, 60000);
  if (rc == 0)
    *data = m->data, *len = m->len, *token = m;
  return rc;
}
static void f_release(ep *e, void *token) { ferry_mq_msg_free(token); }
static void f_close(ep *e) {
  ferry_mq_close(e->mq);
  ferry_ctx_close(e->ctx);
}
static const ep_ops ferry_ops = {f_send, f_recv, f_release, f_close};

static int f_open(ep *e, const char *name, const char *transports, const char *dir, const char *in,
                  const char *out) {
  ferry_ctx_opts co = {.size = sizeof co, .name = name, .transports = transports};
  ferry_mq_opts mo = {
      .size = sizeof mo, .directory = dir, .flags = dir ? 0 : FERRY_MQ_HOST_DIRECTORY};
  e->ops = &ferry_ops;
  e->out_topic = out;
  int rc = ferry_ctx_open(&co, &e->ctx);
  if (rc == 0)
    rc = ferry_mq_open(e->ctx, &mo, &e->mq);
  if (rc == 0)
    rc = ferry_mq_subscribe(e->mq, in, 20000);
  if (rc != 0)
    fprintf(stderr, "ferry bench mq: %s: %s\n", name, ferry_last_error());
  return rc;
}

static int f_serve_open(ep *e, const char *transports, char *addr, size_t cap) {
  int rc = f_open(e, "bench-mq-server", transports, NULL, "c2s", "s2c");
  const char *tcp = rc == 0 ? strstr(ferry_ctx_address(e->ctx), "tcp://") : NULL;
  if (!tcp)
    return -1;
  snprintf(addr, cap, "ferry://%.*s", (int)strcspn(tcp + 6, ","), tcp + 6);
  return 0;
}

static int f_client_open(ep *e, const char *transports, const char *dir) {
  int rc = f_open(e, "bench-mq-client", transports, dir, "s2c", "c2s");
  if (rc == 0)
    rc = ferry_mq_wait_subscribers(e->mq, "c2s", 1, 20000);
  return rc;
}

static int fshm_serve(ep *e, char *a, size_t n) { return f_serve_open(e, "shm,tcp", a, n); }

/* Message i of a stream built in a loan from the pool: the producer writes its output there
 * instead of into a buffer of its own (here only its first 64 bytes: a header with i; the rest
 * holds what the block held) and publishes it without a copy. */
static int f_send_loan(ep *e, uint64_t i, size_t len) {
  void *buf = NULL;
  int rc = ferry_mq_loan(e->mq, len, &buf, 60000);
  if (rc == 0) {
    uint64_t head[8] = {i, len};
    memcpy(buf, head, len < sizeof head ? len : sizeof head);
    rc = ferry_mq_publish_loan(e->mq, e->out_topic, NULL, buf, len, 60000);
  }
  if (rc != 0)
    fprintf(stderr, "ferry bench mq: loan: %s\n", ferry_last_error());
  return rc;
}
static int fshm_client(ep *e, const char *a) { return f_client_open(e, "shm,tcp", a); }
static int ftcp_serve(ep *e, char *a, size_t n) { return f_serve_open(e, "tcp", a, n); }
static int ftcp_client(ep *e, const char *a) { return f_client_open(e, "tcp", a); }

/* ---- nng pair1 ---- */
#ifdef FERRY_BENCH_NNG
static int n_send(ep *e, const void *data, size_t len) {
  return nng_send(e->nng, (void *)data, len, 0) == 0 ? 0 : -1;
}
static int n_recv(ep *e, const void **data, size_t *len, void **token) {
  void *buf = NULL;
  int rc = nng_recv(e->nng, &buf, len, NNG_FLAG_ALLOC);
  if (rc != 0)
    return -1;
  *data = buf;
  *token = buf;
  return 0;
}
static void n_release(ep *e, void *token) { nng_free(token, 0); }
static void n_close(ep *e) { nng_close(e->nng); }
static const ep_ops nng_ops = {n_send, n_recv, n_release, n_close};

static int n_setup(ep *e) {
  e->ops = &nng_ops;
  if (nng_pair1_open(&e->nng) != 0)
    return -1;
  nng_socket_set_size(e->nng, NNG_OPT_RECVMAXSZ, 0); /* default 1 MiB */
  nng_socket_set_ms(e->nng, NNG_OPT_RECVTIMEO, 60000);
  nng_socket_set_ms(e->nng, NNG_OPT_SENDTIMEO, 60000);
  return 0;
}

static int n_serve(ep *e, const char *url, char *addr, size_t cap) {
  nng_listener l;
  if (n_setup(e) != 0 || nng_listen(e->nng, url, &l, 0) != 0)
    return -1;
  int port = 0;
  if (strncmp(url, "tcp", 3) == 0 && nng_listener_get_int(l, NNG_OPT_TCP_BOUND_PORT, &port) == 0)
    snprintf(addr, cap, "tcp://127.0.0.1:%d", port);
  else
    snprintf(addr, cap, "%s", url);
  return 0;
}
static int nipc_serve(ep *e, char *a, size_t n) {
  char url[128];
  snprintf(url, sizeof url, "ipc:///tmp/ferry-bench-nng-%d", (int)getpid());
  return n_serve(e, url, a, n);
}
static int ntcp_serve(ep *e, char *a, size_t n) { return n_serve(e, "tcp://127.0.0.1:0", a, n); }
static int n_client(ep *e, const char *addr) {
  return n_setup(e) == 0 && nng_dial(e->nng, addr, NULL, 0) == 0 ? 0 : -1;
}
#endif

/* ---- ZeroMQ PAIR ---- */
#ifdef FERRY_BENCH_ZMQ
static int z_send(ep *e, const void *data, size_t len) {
  return zmq_send(e->zsock, data, len, 0) == (int)len || len > INT32_MAX ? 0 : -1;
}
static int z_recv(ep *e, const void **data, size_t *len, void **token) {
  zmq_msg_t *m = malloc(sizeof *m);
  zmq_msg_init(m);
  if (zmq_msg_recv(m, e->zsock, 0) < 0) {
    zmq_msg_close(m);
    free(m);
    return -1;
  }
  *data = zmq_msg_data(m);
  *len = zmq_msg_size(m);
  *token = m;
  return 0;
}
static void z_release(ep *e, void *token) {
  zmq_msg_close(token);
  free(token);
}
static void z_close(ep *e) {
  int zero = 0;
  zmq_setsockopt(e->zsock, ZMQ_LINGER, &zero, sizeof zero);
  zmq_close(e->zsock);
  zmq_ctx_term(e->zctx);
}
static const ep_ops zmq_ops = {z_send, z_recv, z_release, z_close};

static int z_setup(ep *e) {
  e->ops = &zmq_ops;
  e->zctx = zmq_ctx_new();
  e->zsock = e->zctx ? zmq_socket(e->zctx, ZMQ_PAIR) : NULL;
  int ms = 60000;
  if (e->zsock)
    zmq_setsockopt(e->zsock, ZMQ_RCVTIMEO, &ms, sizeof ms);
  return e->zsock ? 0 : -1;
}
static int z_serve(ep *e, const char *url, char *addr, size_t cap) {
  size_t n = cap;
  if (z_setup(e) != 0 || zmq_bind(e->zsock, url) != 0 ||
      zmq_getsockopt(e->zsock, ZMQ_LAST_ENDPOINT, addr, &n) != 0)
    return -1;
  return 0;
}
static int zipc_serve(ep *e, char *a, size_t n) {
  char url[128];
  snprintf(url, sizeof url, "ipc:///tmp/ferry-bench-zmq-%d", (int)getpid());
  return z_serve(e, url, a, n);
}
static int ztcp_serve(ep *e, char *a, size_t n) { return z_serve(e, "tcp://127.0.0.1:*", a, n); }
static int z_client(ep *e, const char *addr) {
  return z_setup(e) == 0 && zmq_connect(e->zsock, addr) == 0 ? 0 : -1;
}
#endif

#ifndef FERRY_BENCH_NNG
#define nipc_serve NULL
#define ntcp_serve NULL
#define n_client NULL
#define NNG_BUILT false
#else
#define NNG_BUILT true
#endif
#ifndef FERRY_BENCH_ZMQ
#define zipc_serve NULL
#define ztcp_serve NULL
#define z_client NULL
#define ZMQ_BUILT false
#else
#define ZMQ_BUILT true
#endif

/* Within a class, the baselines first (the first is the case's reference), ferry last. */
static const impl impls[] = {
    {"zmq/ipc", "ipc", ZMQ_BUILT, false, zipc_serve, z_client},
    {"nng/ipc", "ipc", NNG_BUILT, false, nipc_serve, n_client},
    {"ferry/shm", "ipc", true, false, fshm_serve, fshm_client},
    {"ferry/shm-loan", "ipc", true, true, fshm_serve, fshm_client},
    {"zmq/tcp", "tcp", ZMQ_BUILT, false, ztcp_serve, z_client},
    {"nng/tcp", "tcp", NNG_BUILT, false, ntcp_serve, n_client},
    {"ferry/tcp", "tcp", true, false, ftcp_serve, ftcp_client},
};
#define NIMPLS (sizeof impls / sizeof impls[0])

/* ---- the server (child) ---- */

typedef struct cmd {
  uint64_t magic, size, count;
} cmd;

static int serve(const impl *im, int fd) {
  ep e = {0};
  char addr[256] = "";
  if (im->serve_open(&e, addr, sizeof addr) != 0) {
    fprintf(stderr, "ferry bench mq: %s server: cannot start\n", im->name);
    return 1;
  }
  dprintf(fd, "%s\n", addr);
  close(fd);
  uint8_t *buf = NULL;
  for (;;) {
    const void *data;
    size_t len;
    void *tok;
    if (e.ops->recv(&e, &data, &len, &tok) != 0)
      break;
    cmd c = {0};
    if (len == sizeof c)
      memcpy(&c, data, sizeof c);
    if (c.magic != CMD_MAGIC) { /* echo */
      int rc = e.ops->send(&e, data, len);
      e.ops->release(&e, tok);
      if (rc != 0)
        break;
      continue;
    }
    e.ops->release(&e, tok);
    if (c.count == 0)
      break; /* quit */
    free(buf);
    if (!(buf = malloc(c.size ? c.size : 1)))
      break;
    memset(buf, 0x5a, c.size);
    for (uint64_t i = 0; i < c.count; i++)
      if ((im->loan ? f_send_loan(&e, i, c.size) : e.ops->send(&e, buf, c.size)) != 0)
        break;
  }
  free(buf);
  e.ops->close(&e);
  return 0;
}

/* ---- the client (this process) ---- */

static pid_t spawn_server(const impl *im, int *rd) {
  int p[2];
  if (pipe(p) != 0)
    return -1;
  char fd[16];
  snprintf(fd, sizeof fd, "%d", p[1]);
  char *argv[] = {"ferry", "bench", "mq", "--serve", (char *)im->name, fd, NULL};
  pid_t pid;
  fflush(NULL);
  if (posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, environ) != 0)
    pid = -1;
  close(p[1]);
  *rd = p[0];
  return pid;
}

static int read_line(int fd, char *buf, size_t cap) {
  size_t n = 0;
  while (n + 1 < cap) {
    ssize_t r = read(fd, buf + n, 1);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      return -1;
    if (buf[n] == '\n')
      break;
    n++;
  }
  buf[n] = '\0';
  return 0;
}

static int ping(ep *e, const void *msg, size_t size) {
  const void *d;
  size_t len;
  void *tok;
  if (e->ops->send(e, msg, size) != 0 || e->ops->recv(e, &d, &len, &tok) != 0)
    return -1;
  e->ops->release(e, tok);
  return len == size ? 0 : -1;
}

typedef struct plan {
  uint64_t lat[8], tput[8];
  int nlat, ntput;
  bench_samples lat_s[NIMPLS][8], tput_s[NIMPLS][8]; /* seconds: one way; per message */
  bench_samples paced_s[NIMPLS][8];                  /* one way, pings --pace ms apart */
  bench_wake lat_w[NIMPLS][8], paced_w[NIMPLS][8];   /* wake-ups per ping: this process, server */
  bench_samples memcpy_s[8]; /* the reference, taking turns with ferry/shm's streams */
} plan;

/* A latency row's pings: 5,000 up to 16 KiB, 500 from 256 KiB, after a tenth of that as a
 * warm-up. By default (no --full, no --reps) a row up to 16 KiB stops after LAT_BUDGET_S seconds
 * if it has LAT_LEAST (its p99 is a target: enough samples that the 99th percentile is not one
 * outlier), and the warm-up is a fiftieth. */
#define LAT_LEAST 1000
#define LAT_BUDGET_S 1.0
static int latency(const bench_opts *o, const impl *im, ep *e, uint64_t size, bench_samples *b,
                   pid_t server, bench_wake *w) {
  int reps = o->reps > 0 ? o->reps : size <= 16384 ? 5000 : size <= (1 << 20) ? 500 : 50;
  bool fixed = o->full || o->reps > 0;
  uint8_t *msg = calloc(1, size);
  int rc = msg ? 0 : -1;
  for (int i = 0; rc == 0 && i < reps / (fixed ? 10 : 50) + 1; i++) /* warm-up */
    rc = ping(e, msg, size);
  bench_until u =
      bench_until_start(reps, fixed || size > 16384 ? reps : LAT_LEAST, fixed ? 0 : LAT_BUDGET_S);
  bench_wake_init(w, &server, 1);
  bench_wake_begin(w);
  while (rc == 0 && !bench_done(&u, b->n)) {
    double t = bench_now();
    rc = ping(e, msg, size);
    bench_add(b, (bench_now() - t) / 2);
  }
  bench_wake_end(w, b->n);
  if (rc != 0)
    fprintf(stderr, "ferry bench mq: %s: ping-pong of %llu bytes failed\n", im->name,
            (unsigned long long)size);
  free(msg);
  return rc;
}

/* The paced pings of a latency row (bench.h): bench_paced_samples() up to 16 KiB, a quarter of
 * that from 256 KiB (as the back-to-back rows take a tenth), so the mode keeps to its budget. */
static int paced(const bench_opts *o, const impl *im, ep *e, uint64_t size, bench_samples *b,
                 pid_t server, bench_wake *w) {
  uint8_t *msg = calloc(1, size);
  int rc = msg ? 0 : -1;
  bench_until u = bench_until_paced(o);
  if (size > 16384 && u.reps > 4)
    u.reps = u.least = u.reps / 4;
  bench_wake_init(w, &server, 1);
  bench_wake_begin(w);
  while (rc == 0 && !bench_done(&u, b->n)) {
    double t = bench_now();
    rc = ping(e, msg, size);
    bench_add(b, (bench_now() - t) / 2);
  }
  bench_wake_end(w, b->n);
  if (rc == 0)
    bench_wake_idle(w, BENCH_WAKE_IDLE_MS);
  if (rc != 0)
    fprintf(stderr, "ferry bench mq: %s: paced ping-pong of %llu bytes failed\n", im->name,
            (unsigned long long)size);
  free(msg);
  return rc;
}

static uint64_t stream_count(uint64_t size) {
  uint64_t n = (128ull << 20) / size;
  return n < 5 ? 5 : n > 100000 ? 100000 : n;
}

/* One stream of n messages; seconds per message after the warm-up. */
static int stream_once(ep *e, uint64_t size, uint64_t n, double *per_msg) {
  cmd c = {CMD_MAGIC, size, n};
  if (e->ops->send(e, &c, sizeof c) != 0)
    return -1;
  uint64_t warm = n / 8 ? n / 8 : 1;
  double t0 = 0;
  for (uint64_t i = 0; i < n; i++) {
    const void *d;
    size_t len;
    void *tok;
    if (e->ops->recv(e, &d, &len, &tok) != 0 || len != size)
      return -1;
    e->ops->release(e, tok);
    if (i + 1 == warm)
      t0 = bench_now();
  }
  *per_msg = (bench_now() - t0) / (double)(n - warm);
  return 0;
}

/* The reference for large messages on one host, timed as a stream is: the same number of
 * messages, per message after the first eighth; each one copied from one warm buffer into
 * another (as ferry/shm's publisher copies from its buffer into a pool block that the
 * subscriber released a moment ago). */
typedef struct copier {
  uint8_t *src, *dst;
} copier;

static int copier_open(copier *c, uint64_t size) {
  c->src = malloc(size);
  c->dst = malloc(size);
  if (!c->src || !c->dst)
    return -1;
  memset(c->src, 1, size);
  memset(c->dst, 2, size);
  return 0;
}

static void copier_close(copier *c) {
  free(c->src);
  free(c->dst);
}

static double copy_stream(copier *c, uint64_t size) {
  uint64_t n = stream_count(size), warm = n / 8 ? n / 8 : 1;
  double t0 = bench_now();
  for (uint64_t i = 0; i < n; i++) {
    memcpy(c->dst, c->src, size);
    __asm__ volatile("" ::"r"(c->dst) : "memory");
    if (i + 1 == warm)
      t0 = bench_now();
  }
  return (bench_now() - t0) / (double)(n - warm);
}

/* Streams of one size; with `mc`, a memcpy stream after each one (the reference takes turns
 * with ferry/shm, so a slower phase of the shared machine's memory hits both alike). 5 streams
 * (3 from 16 MiB); by default (no --full, no --reps) no more once STREAM_BUDGET_S seconds have
 * passed: a baseline that takes seconds a stream (nng's small messages, 64 MiB) runs one. */
#define STREAM_BUDGET_S 1.0

/* The messages of each stream: 128 MiB worth (stream_count). By default, when that is 1,024 or
 * more (small messages), as many as STREAM_RUN_S seconds take at the rate a probe stream of a
 * sixteenth of them measured (it also warms up; it is not a sample), never fewer than 1,024:
 * nng's 64-byte stream, 60 µs a message here, would take 6 s a run. A faster implementation
 * keeps 128 MiB worth. */
#define STREAM_RUN_S 0.2
#define STREAM_PROBE_MIN 1024
static int stream_messages(const bench_opts *o, ep *e, uint64_t size, uint64_t *n) {
  *n = stream_count(size);
  if (o->full || o->reps > 0 || *n < STREAM_PROBE_MIN)
    return 0;
  double per = 0;
  int rc = stream_once(e, size, *n / 16, &per);
  double fit = per > 0 ? STREAM_RUN_S / per : (double)*n;
  if (rc == 0 && fit < (double)*n)
    *n = fit < STREAM_PROBE_MIN ? STREAM_PROBE_MIN : (uint64_t)fit;
  return rc;
}

static int throughput(const bench_opts *o, const impl *im, ep *e, uint64_t size, bench_samples *b,
                      bench_samples *mc) {
  int reps = o->reps > 0 ? o->reps : size >= (16 << 20) ? 3 : 5;
  bool fixed = o->full || o->reps > 0;
  copier c = {0};
  uint64_t n = 0;
  int rc = mc ? copier_open(&c, size) : 0;
  if (rc == 0)
    rc = stream_messages(o, e, size, &n);
  bench_until u = bench_until_start(reps, fixed ? reps : 1, fixed ? 0 : STREAM_BUDGET_S);
  while (rc == 0 && !bench_done(&u, b->n)) {
    double s;
    if ((rc = stream_once(e, size, n, &s)) == 0)
      bench_add(b, s);
    if (rc == 0 && mc)
      bench_add(mc, copy_stream(&c, size));
  }
  copier_close(&c);
  if (rc != 0)
    fprintf(stderr, "ferry bench mq: %s: stream of %llu-byte messages failed\n", im->name,
            (unsigned long long)size);
  return rc;
}

/* The reference alone, when ferry/shm did not run: as many memcpy streams as a stream's reps. */
static void memcpy_row(const bench_opts *o, const char *cs, uint64_t size, bench_samples *b) {
  int reps = o->reps > 0 ? o->reps : size >= (16 << 20) ? 3 : 5;
  copier c = {0};
  if (b->n == 0 && copier_open(&c, size) == 0)
    for (int r = 0; r < reps; r++)
      bench_add(b, copy_stream(&c, size));
  copier_close(&c);
  if (b->n)
    bench_row(o, "mq", cs, "memcpy", size, b, false);
}

static void not_built(const bench_opts *o, const impl *im) {
  if (o->json)
    printf("{\"bench\":\"mq\",\"case\":\"all\",\"impl\":\"%s\",\"not_built\":true}\n", im->name);
  else
    printf("%-16s %-14s %s\n", "all", im->name,
           "not built (install libnng-dev / libzmq3-dev and reconfigure)");
}

static int run_impl(const bench_opts *o, size_t k, plan *p, bool do_lat) {
  const impl *im = &impls[k];
  int fd = -1;
  pid_t pid = spawn_server(im, &fd);
  char addr[256] = "";
  ep e = {0};
  int rc = pid > 0 && read_line(fd, addr, sizeof addr) == 0 ? 0 : -1;
  if (fd >= 0)
    close(fd);
  if (rc == 0 && (rc = im->client_open(&e, addr)) != 0)
    fprintf(stderr, "ferry bench mq: %s: cannot connect to %s\n", im->name, addr);
  for (int i = 0; rc == 0 && do_lat && !im->loan && i < p->nlat; i++) {
    rc = latency(o, im, &e, p->lat[i], &p->lat_s[k][i], pid, &p->lat_w[k][i]);
    if (rc == 0)
      rc = paced(o, im, &e, p->lat[i], &p->paced_s[k][i], pid, &p->paced_w[k][i]);
  }
  for (int i = 0; rc == 0 && !do_lat && i < p->ntput; i++)
    if (!im->loan || p->tput[i] >= LOAN_MIN)
      rc = throughput(
          o, im, &e, p->tput[i], &p->tput_s[k][i],
          strcmp(im->name, "ferry/shm") == 0 && p->tput[i] >= (1 << 20) ? &p->memcpy_s[i] : NULL);
  if (e.ops) {
    cmd quit = {CMD_MAGIC, 0, 0};
    e.ops->send(&e, &quit, sizeof quit);
    e.ops->close(&e);
  }
  if (pid > 0) {
    int st;
    for (int i = 0; i < 200 && waitpid(pid, &st, WNOHANG) == 0; i++)
      usleep(10000);
    if (waitpid(pid, &st, WNOHANG) == 0) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
    }
  }
  if (strncmp(addr, "ipc://", 6) == 0)
    unlink(addr + 6); /* a killed server leaves its socket file behind */
  return rc;
}

static bool is_base(size_t k) { return k == 0 || strcmp(impls[k].cls, impls[k - 1].cls) != 0; }

/* Rows grouped by case, each class's reference first. */
static void print_latency(const bench_opts *o, plan *p) {
  char cs[48], sz[16];
  for (int j = 0; j < p->nlat; j++)
    for (int q = 0; q < 2; q++) {
      snprintf(cs, sizeof cs, "lat-%s-%s", q ? "p99" : "p50",
               bench_size_name(p->lat[j], sz, sizeof sz));
      for (size_t k = 0; k < NIMPLS; k++) {
        bench_samples *b = &p->lat_s[k][j];
        if (b->n == 0)
          continue;
        bench_samples one = {0};
        if (q) { /* bench_row sorted them for p50 */
          bench_add(&one, b->s[(size_t)((double)(b->n - 1) * 0.99)]);
          b = &one;
        }
        bench_row_wake(o, "mq", cs, impls[k].name, p->lat[j], b, is_base(k),
                       q ? NULL : &p->lat_w[k][j]);
        bench_free(&one);
      }
    }
  for (int j = 0; j < p->nlat; j++) {
    snprintf(cs, sizeof cs, "lat-%s", bench_size_name(p->lat[j], sz, sizeof sz));
    for (size_t k = 0; k < NIMPLS; k++)
      bench_paced_row(o, "mq", cs, impls[k].name, p->lat[j], &p->paced_s[k][j],
                      bench_median(&p->lat_s[k][j]), &p->paced_w[k][j]);
  }
}

static void print_throughput(const bench_opts *o, plan *p) {
  char cs[48], sz[16];
  for (int j = 0; j < p->ntput; j++) {
    snprintf(cs, sizeof cs, "stream-%s", bench_size_name(p->tput[j], sz, sizeof sz));
    for (size_t k = 0; k < NIMPLS; k++) {
      if (p->tput_s[k][j].n)
        bench_row(o, "mq", cs, impls[k].name, p->tput[j], &p->tput_s[k][j], is_base(k));
      bool last_ipc = k + 1 == NIMPLS || strcmp(impls[k + 1].cls, "ipc") != 0;
      if (strcmp(impls[k].cls, "ipc") == 0 && last_ipc && p->tput[j] >= (1 << 20) &&
          (p->tput_s[k][j].n || p->tput_s[k - 1][j].n))
        memcpy_row(o, cs, p->tput[j], &p->memcpy_s[j]);
    }
  }
}

static const char mq_usage[] =
    "usage: ferry bench mq [--json] [--reps N] [--max-size BYTES] [--min-size BYTES]\n"
    "                      [--only IMPL] [--pass lat|stream] [--full] [--pace MS]\n\n"
    "Messages between two processes: ferry's mq over shm and tcp against nng pair1 and ZeroMQ\n"
    "PAIR over ipc and tcp. Ping-pong latency, 64 B..1 MiB (lat-p50 and lat-p99 cases: one\n"
    "way = round trip / 2); streaming throughput at the receiver after a warm-up, 64 B..64 MiB\n"
    "(stream cases: median time per message, GB/s; messages/s = 1 / median), with memcpy\n"
    "beside ferry/shm for 1 MiB and more (timed as a stream is, each of its runs right after\n"
    "one of ferry/shm's). ferry/shm-loan streams messages of 256 KiB and more built in loans\n"
    "from the publisher's pool (ferry_mq_loan), sent without a copy. The reference of each\n"
    "case is ZeroMQ in its class.\n"
    "--only IMPL runs the implementations whose name contains IMPL (e.g. ferry, tcp);\n"
    "--min-size BYTES leaves out the cases of smaller messages; --pass runs one half.\n"
    "By default each row keeps to a time budget: latency up to 16 KiB 5,000 pings or 1 s\n"
    "(at least 1,000), from 256 KiB 500; streams 5 runs (3 from 16 MiB) or 1 s (at least\n"
    "one), a slow implementation's small-message streams ~0.2 s long (at least 1,024\n"
    "messages). --full (or --reps N) takes the fixed counts: 5,000/500 pings, 5/3 streams\n"
    "of 128 MiB worth (5..100,000 messages).\n"
    "Paced latency (lat cases): each latency row's ping-pong again, each ping after a pause\n"
    "of --pace MS (default 10; 0: none), 100 pings up to 16 KiB and 25 from 256 KiB (--full:\n"
    "1,000 and 250): p50, p99 and paced p50 / back-to-back p50. The lat-p50 rows and the\n"
    "paced ones carry wake-ups/call (JSON wakeups_per_call): voluntary context switches per\n"
    "ping (a round trip) of this process and the server process, the pauses left out\n"
    "(`ferry bench --help`).\n";

int bench_mq(int argc, char **argv) {
  if (argc == 4 && strcmp(argv[1], "--serve") == 0) {
    for (size_t i = 0; i < NIMPLS; i++)
      if (strcmp(impls[i].name, argv[2]) == 0)
        return serve(&impls[i], atoi(argv[3]));
    return CLI_USAGE;
  }
  bench_opts o = {.max_size = 64ull << 20};
  const char *only = NULL; /* --only SUBSTRING: the implementations whose name contains it */
  uint64_t min_size = 0;   /* --min-size BYTES: leave out smaller cases */
  const char *half = "";   /* --pass lat|stream: only that half */
  const cli_opt extra[] = {{"only", CLI_ARG_STR, &only, 0, 0},
                           {"min-size", CLI_ARG_SIZE, &min_size, 0, 0},
                           {"pass", CLI_ARG_STR, &half, 0, 0},
                           {0}};
  if (bench_parse_with(argc, argv, &o, mq_usage, extra) < 0)
    return CLI_USAGE;
  if (*half && strcmp(half, "lat") != 0 && strcmp(half, "stream") != 0) {
    fprintf(stderr, "ferry bench mq: --pass wants lat or stream, not '%s'\n", half);
    return CLI_USAGE;
  }
  signal(SIGPIPE, SIG_IGN);
  static plan p;
  for (size_t k = 0; k < NIMPLS; k++)
    for (int j = 0; j < 8; j++)
      bench_reset(&p.lat_s[k][j]), bench_reset(&p.tput_s[k][j]), bench_reset(&p.paced_s[k][j]);
  for (int j = 0; j < 8; j++)
    bench_reset(&p.memcpy_s[j]);
  p.nlat = p.ntput = 0;
  for (uint64_t s = 64; s <= (1 << 20) && s <= o.max_size; s *= 16)
    if (s >= min_size)
      p.lat[p.nlat++] = s;
  if ((1 << 20) <= o.max_size && min_size <= (1 << 20) &&
      (p.nlat == 0 || p.lat[p.nlat - 1] != (1 << 20)))
    p.lat[p.nlat++] = 1 << 20;
  static const uint64_t tput[] = {64,      1 << 10, 16 << 10, 256 << 10,
                                  1 << 20, 4 << 20, 16 << 20, 64 << 20};
  for (size_t i = 0; i < sizeof tput / sizeof tput[0] && tput[i] <= o.max_size; i++)
    if (tput[i] >= min_size)
      p.tput[p.ntput++] = tput[i];
  int rc = 0;
  for (int pass = 0; pass < 2; pass++) {
    if (strcmp(half, pass ? "lat" : "stream") == 0)
      continue;
    for (size_t k = 0; k < NIMPLS; k++) {
      bool want = !only || strstr(impls[k].name, only);
      int r = impls[k].built && want ? run_impl(&o, k, &p, pass == 0) : 0;
      rc = rc ? rc : r;
    }
    bench_header(&o, pass == 0 ? "ferry bench mq: ping-pong, one-way latency (vs base = speed)"
                               : "ferry bench mq: streaming at the receiver (vs base = speed)");
    for (size_t k = 0; k < NIMPLS; k++)
      if (!impls[k].built)
        not_built(&o, &impls[k]);
    if (pass == 0)
      print_latency(&o, &p);
    else
      print_throughput(&o, &p);
  }
  for (size_t k = 0; k < NIMPLS; k++)
    for (int j = 0; j < 8; j++)
      bench_free(&p.lat_s[k][j]), bench_free(&p.tput_s[k][j]), bench_free(&p.paced_s[k][j]);
  for (int j = 0; j < 8; j++)
    bench_free(&p.memcpy_s[j]);
  return rc == 0 ? CLI_OK : CLI_FAIL;
}
