/*
 * `ferry bench refit`: pushes a synthetic transformer-shaped model from this process (the
 * trainer) to K receiver processes (K = 1, 2, 4) on this host over shm, and compares in the same
 * run with a single-thread memcpy of the model's bytes and with torch.distributed gloo
 * broadcasts of the same tensors (per tensor, and in flat buckets), run by Debian's python3.
 * A late joiner (a receiver process that attaches mid-run, after a push) catches up to the
 * latest version; its catch-up time is set against a direct push to one receiver. And pushes
 * to K = 1, 2 receivers alone, against the same pushes while a joiner attaches and while a
 * catch-up is under way (the late-join target: a joiner slows the others' pushes <= 10%). TP-4:
 * four tensor-parallel ranks, each binding its shards (fused qkv and up by rows, o and down by
 * columns, norms whole), against one receiver of the whole model: push time and bytes read per
 * rank.
 * A second model of 5,000 small tensors shows what a push costs beyond moving bytes. Then, as
 * "hosts": the trainer and each receiver in a network namespace of its own, joined by a bridge,
 * every host's egress rate-limited with tc tbf; chain against direct for K = 1, 2, 4.
 *
 * By default the run holds the rows the targets are judged by (docs/PERFORMANCE.md): the
 * 256 MiB model at K = 1, 2, 4 with gloo's bucketed broadcast, the 5,000-tensor model at K = 1,
 * and the chain between hosts at K = 2, 4 against K = 1. `--full` adds gloo's per-tensor
 * broadcast, the 5,000-tensor model at K = 2, 4 and against gloo, and direct pushes between
 * hosts at K = 2, 4.
 */
#include "bench_refit_group.h"
#include "cli/bench.h"
#include "cli/cli.h"
#include "netns.h"
#include "ferry.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct model {
  size_t n;
  ferry_tensor_desc *desc;
  float **data;
  char (*name)[48];
  uint64_t bytes;
  bool small; /* the many-small-tensors model */
} model;

/* Layers of attention and MLP matrices plus norms and biases, until `bytes` is reached; or
 * (small) `count` vectors of 256 floats. */
static void model_make(model *m, uint64_t bytes, size_t small_count) {
  size_t cap = small_count ? small_count : 4096;
  m->desc = calloc(cap, sizeof *m->desc);
  m->data = calloc(cap, sizeof *m->data);
  m->name = calloc(cap, sizeof *m->name);
  m->n = 0;
  m->bytes = 0;
  m->small = small_count != 0;
  uint64_t h = 512;
  while (m->n < cap && (small_count ? m->n < small_count : m->bytes < bytes)) {
    size_t layer = m->n / 8, kind = m->n % 8;
    uint64_t rows = small_count ? 1 : kind < 4 ? h : kind < 6 ? 4 * h : 1;
    uint64_t cols = small_count ? 256 : kind == 5 ? h : kind < 4 ? h : kind == 4 ? h : h;
    if (!small_count && kind == 4)
      rows = h, cols = 4 * h;
    m->desc[m->n] = (ferry_tensor_desc){.dtype = FERRY_DTYPE_F32, .ndim = 2, .shape = {rows, cols}};
    snprintf(m->name[m->n], sizeof m->name[0], "layers.%zu.p%zu", layer, kind);
    m->data[m->n] = malloc(rows * cols * 4);
    memset(m->data[m->n], (int)(m->n & 0x7f), rows * cols * 4);
    m->bytes += rows * cols * 4;
    m->n++;
  }
}

static void model_free(model *m) {
  for (size_t i = 0; i < m->n; i++)
    free(m->data[i]);
  free(m->desc);
  free(m->data);
  free(m->name);
}

/* ---- receivers: this binary again, as helper processes ---- */

/* A receiver process: binds a flat buffer ("flat") or the sender's own buffer ("alias"). */
static int bench_refit_receiver(const char *address, int fd, const char *mode) {
  ferry_ctx_opts o = {.size = sizeof o, .name = "bench-rollout"};
  ferry_ctx *ctx;
  ferry_refit_receiver *r;
  bool alias = strcmp(mode, "alias") == 0;
  if (ferry_ctx_open(&o, &ctx) != 0 || ferry_refit_receiver_open(ctx, address, -1, &r) != 0 ||
      (alias ? ferry_refit_bind_alias(r) : ferry_refit_bind_flat(r)) != 0) {
    fprintf(stderr, "bench receiver: %s\n", ferry_last_error());
    return CLI_FAIL;
  }
  char ready = 'r';
  if (write(fd, &ready, 1) != 1)
    return CLI_FAIL;
  for (uint64_t v = 1; ferry_refit_wait(r, v, 120000, NULL) == 0; v++)
    ;
  return CLI_OK;
}

/* A late joiner: attaches to a sender that has pushed already, binds a flat buffer and touches
 * its pages (an engine's weight memory exists before it loads), then times wait(0), which
 * catches up to the latest version, and writes the seconds (a double) on fd before it
 * detaches. */
static int bench_refit_late(const char *address, int fd) {
  ferry_ctx_opts o = {.size = sizeof o, .name = "bench-late"};
  ferry_ctx *ctx;
  ferry_refit_receiver *r;
  if (ferry_ctx_open(&o, &ctx) != 0 || ferry_refit_receiver_open(ctx, address, -1, &r) != 0 ||
      ferry_refit_bind_flat(r) != 0) {
    fprintf(stderr, "bench late receiver: %s\n", ferry_last_error());
    return CLI_FAIL;
  }
  size_t n = ferry_refit_tensor_count(r);
  const char *name;
  ferry_tensor_desc d;
  void *first, *last;
  uint64_t bytes;
  if (n == 0 || ferry_refit_tensor_info(r, 0, &name, &d) != 0 ||
      ferry_refit_view(r, name, &first) != 0 || ferry_refit_tensor_info(r, n - 1, &name, &d) != 0 ||
      ferry_refit_view(r, name, &last) != 0 || ferry_tensor_nbytes(&d, &bytes) != 0)
    return CLI_FAIL;
  memset(first, 0, (size_t)((uint8_t *)last - (uint8_t *)first) + bytes);
  double t = bench_now();
  if (ferry_refit_wait(r, 0, 120000, NULL) != 0) {
    fprintf(stderr, "bench late receiver: %s\n", ferry_last_error());
    return CLI_FAIL;
  }
  t = bench_now() - t;
  int rc = bench_write_all(fd, &t, sizeof t) == 0 ? CLI_OK : CLI_FAIL;
  ferry_refit_receiver_close(r);
  ferry_ctx_close(ctx);
  return rc;
}

/* A joiner beside pushes to others (time_push_joining): opens its ctx and touches its weight
 * memory (`bytes`, the model's size: an engine's memory exists before it loads), writes 'r' on
 * fd and waits for 'g' on go; then attaches, binds every tensor into that memory and waits for
 * the latest version (wait(0), which asks for a catch-up), writing 'b' on fd when its first
 * bucket lands. It then reads the version the trainer pushed last from go, waits for it, and
 * writes 'd' with the first wait's seconds and version and the version it holds at the end. */
typedef struct joiner_result {
  double seconds;
  uint64_t first, committed;
} joiner_result;

static void joiner_first_bucket(ferry_refit_receiver *r, uint64_t version, uint32_t bucket,
                                void *arg) {
  (void)r, (void)version, (void)bucket;
  int *fd = arg;
  if (*fd >= 0) { /* once: the trainer starts the push it times on this */
    char b = 'b';
    ssize_t w = write(*fd, &b, 1); /* a trainer gone: nothing to tell */
    (void)w;
    *fd = -1;
  }
}

static int bench_refit_joiner(const char *address, int fd, int go, uint64_t bytes) {
  ferry_ctx_opts o = {.size = sizeof o, .name = "bench-joiner"};
  ferry_ctx *ctx;
  ferry_refit_receiver *r;
  uint8_t *mem = malloc(bytes ? bytes : 1);
  if (!mem || ferry_ctx_open(&o, &ctx) != 0)
    return CLI_FAIL;
  memset(mem, 0, bytes);
  char ch = 'r';
  if (write(fd, &ch, 1) != 1 || read(go, &ch, 1) != 1 || ch != 'g')
    return CLI_FAIL;
  int bucket_fd = fd;
  if (ferry_refit_receiver_open(ctx, address, -1, &r) != 0) {
    fprintf(stderr, "bench joiner: %s\n", ferry_last_error());
    return CLI_FAIL;
  }
  ferry_refit_on_bucket(r, joiner_first_bucket, &bucket_fd);
  uint64_t at = 0;
  for (size_t i = 0; i < ferry_refit_tensor_count(r); i++) {
    const char *name;
    ferry_tensor_desc d;
    uint64_t n;
    if (ferry_refit_tensor_info(r, i, &name, &d) != 0 || ferry_tensor_nbytes(&d, &n) != 0 ||
        at + n > bytes || ferry_refit_bind(r, name, mem + at, &d) != 0) {
      fprintf(stderr, "bench joiner: cannot bind tensor %zu: %s\n", i, ferry_last_error());
      return CLI_FAIL;
    }
    at += n;
  }
  joiner_result res = {0};
  double t = bench_now();
  uint64_t latest = 0;
  if (ferry_refit_wait(r, 0, 120000, &res.first) != 0 ||
      bench_read_all(go, &latest, sizeof latest) != 0 ||
      ferry_refit_wait(r, latest, 120000, &res.committed) != 0) {
    fprintf(stderr, "bench joiner: %s\n", ferry_last_error());
    return CLI_FAIL;
  }
  res.seconds = bench_now() - t;
  ferry_refit_on_bucket(r, NULL, NULL);
  ch = 'd';
  int rc = write(fd, &ch, 1) == 1 && bench_write_all(fd, &res, sizeof res) == 0 ? CLI_OK : CLI_FAIL;
  ferry_refit_receiver_close(r);
  ferry_ctx_close(ctx);
  free(mem);
  return rc;
}

/* How one measured series pushes. */
typedef struct push_cfg {
  ferry_refit_route route;
  bool alias;            /* sender keeps its whole buffer; receivers bind it in place */
  bool hosts;            /* the namespaces of bench_hosts_up(): tcp between "hosts" */
  uint64_t bucket_bytes; /* 0: the default */
} push_cfg;

/* The "hosts" (netns.h): host 1 is the trainer, host i + 2 receiver i. */
#define HOSTS_TAG "rb"
#define HOSTS_NET "10.78.0"
#define HOSTS_N 5
#define HOSTS_RATE "1gbit"

static char self_path[PATH_MAX];

/* Receiver i runs this binary again; between "hosts" in host i + 2's namespace, listening on
 * its address there (its chain successor reads from it). */
static void exec_receiver(const char *address, const char *fd, const push_cfg *c, int i) {
  const char *mode = c->alias ? "alias" : "flat";
  if (!c->hosts)
    execl(self_path, "ferry", "bench", "refit", "--receiver", address, fd, mode, (char *)NULL);
  char ns[32], listen[32];
  netns_host(HOSTS_TAG, i + 2, ns, sizeof ns);
  snprintf(listen, sizeof listen, HOSTS_NET ".%d:0", i + 2);
  setenv("FERRY_TCP_LISTEN", listen, 1);
  setenv("FERRY_TRANSPORTS", "tcp", 1);
  execlp("ip", "ip", "netns", "exec", ns, self_path, "bench", "refit", "--receiver", address, fd,
         mode, (char *)NULL);
}

static int spawn_receivers(const char *address, int k, pid_t *pids, const push_cfg *c) {
  int p[2];
  if (pipe(p) != 0)
    return -1;
  char fd[16];
  snprintf(fd, sizeof fd, "%d", p[1]);
  for (int i = 0; i < k; i++) {
    fflush(NULL);
    pids[i] = fork();
    if (pids[i] == 0) {
      close(p[0]);
      exec_receiver(address, fd, c, i);
      _exit(127);
    }
  }
  close(p[1]);
  int ready = 0;
  char ch;
  while (ready < k && read(p[0], &ch, 1) == 1)
    ready++;
  close(p[0]);
  return ready == k ? 0 : -1;
}

static void stop_receivers(pid_t *pids, int k) {
  for (int i = 0; i < k; i++) {
    kill(pids[i], SIGTERM);
    waitpid(pids[i], NULL, 0);
  }
}

/* The trainer's side: a ctx, and a sender "bench" with every tensor of m declared and sealed.
 * What was opened stays in *ctx and *s on failure too: the callers close both on every path. */
static int open_trainer(const model *m, const ferry_ctx_opts *co, const ferry_refit_opts *so,
                        ferry_ctx **ctx, ferry_refit_sender **s) {
  int rc = ferry_ctx_open(co, ctx);
  if (rc == 0)
    rc = ferry_refit_sender_open(*ctx, "bench", so, s);
  for (size_t i = 0; rc == 0 && i < m->n; i++)
    rc = ferry_refit_declare(*s, m->name[i], &m->desc[i], m->data[i], FERRY_DTYPE_INVALID);
  if (rc == 0)
    rc = ferry_refit_seal(*s);
  return rc;
}

/* ---- ferry ---- */

static int time_pushes(const model *m, int k, int reps, bench_samples *b, const push_cfg *c) {
  ferry_ctx_opts co = {.size = sizeof co, .name = "bench-trainer"};
  if (c->hosts) {
    co.tcp_listen = NETNS_IP(HOSTS_NET, 1) ":0";
    co.transports = "tcp";
  }
  ferry_refit_opts so = {.size = sizeof so, .bucket_bytes = c->bucket_bytes, .alias = c->alias};
  ferry_refit_push_opts po = {.size = sizeof po, .timeout_ms = -1, .route = c->route};
  ferry_ctx *ctx = NULL;
  ferry_refit_sender *s = NULL;
  int rc = open_trainer(m, &co, &so, &ctx, &s);
  pid_t pids[8];
  if (rc == 0 && spawn_receivers(ferry_ctx_address(ctx), k, pids, c) != 0)
    rc = FERRY_ECONNECT;
  while (rc == 0 && ferry_refit_receivers(s) < (size_t)k)
    usleep(1000);
  for (int v = 1; rc == 0 && v <= reps + 1; v++) {
    double t = bench_now();
    rc = ferry_refit_push(s, (uint64_t)v, &po);
    if (v > 1) /* the first push maps the buckets and faults the receivers' pages */
      bench_add(b, bench_now() - t);
  }
  if (rc != 0)
    cli_fail("bench refit", rc, "push");
  stop_receivers(pids, rc == 0 || rc == FERRY_ECONNECT ? k : 0);
  ferry_refit_sender_close(s);
  ferry_ctx_close(ctx);
  return rc;
}

/* Starts a late joiner and returns the seconds its catch-up took (< 0 on failure). */
static double time_one_join(ferry_refit_sender *s, const char *address) {
  int p[2];
  if (pipe(p) != 0)
    return -1;
  char fd[16];
  snprintf(fd, sizeof fd, "%d", p[1]);
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    execl(self_path, "ferry", "bench", "refit", "--late", address, fd, (char *)NULL);
    _exit(127);
  }
  close(p[1]);
  double t = -1;
  if (pid < 0 || bench_read_all(p[0], &t, sizeof t) != 0)
    t = -1;
  close(p[0]);
  int status = 0;
  if (pid > 0)
    waitpid(pid, &status, 0);
  for (int i = 0; i < 10000 && ferry_refit_receivers(s) > 1; i++)
    usleep(1000); /* its goodbye reached the sender: the next push is to one receiver again */
  return t;
}

/* Late join, mid-run: the trainer pushes to one receiver; after each push a new receiver
 * process attaches and catches up to the latest version. Rows: a direct push to one receiver,
 * and the catch-up (target: at most 1.2 times the push). */
static int time_late_join(const model *m, int reps, bench_samples *push, bench_samples *join) {
  ferry_ctx_opts co = {.size = sizeof co, .name = "bench-trainer"};
  ferry_refit_opts so = {.size = sizeof so};
  ferry_refit_push_opts po = {.size = sizeof po, .timeout_ms = -1};
  ferry_ctx *ctx = NULL;
  ferry_refit_sender *s = NULL;
  int rc = open_trainer(m, &co, &so, &ctx, &s);
  pid_t pids[1];
  push_cfg one = {.route = FERRY_REFIT_ROUTE_AUTO};
  if (rc == 0 && spawn_receivers(ferry_ctx_address(ctx), 1, pids, &one) != 0)
    rc = FERRY_ECONNECT;
  while (rc == 0 && ferry_refit_receivers(s) < 1)
    usleep(1000);
  for (int v = 1; rc == 0 && v <= reps + 1; v++) {
    double t = bench_now();
    rc = ferry_refit_push(s, (uint64_t)v, &po);
    if (v == 1)
      continue; /* the first push maps the buckets and faults the receiver's pages */
    bench_add(push, bench_now() - t);
    double j = rc == 0 ? time_one_join(s, ferry_ctx_address(ctx)) : -1;
    if (j < 0 && rc == 0)
      rc = FERRY_EPEER;
    else if (rc == 0)
      bench_add(join, j);
  }
  if (rc != 0)
    cli_fail("bench refit", rc, "late join");
  stop_receivers(pids, rc == 0 || rc == FERRY_ECONNECT || rc == FERRY_EPEER ? 1 : 0);
  ferry_refit_sender_close(s);
  ferry_ctx_close(ctx);
  return rc;
}

/* A joiner process (bench_refit_joiner) and the trainer's ends of its two pipes. */
typedef struct joiner {
  pid_t pid;
  int from, to;
} joiner;

/* Reads the joiner's one-byte reports until `want` (0 when it came, -1 at its end). */
static int joiner_until(joiner *j, char want) {
  char ch;
  while (read(j->from, &ch, 1) == 1)
    if (ch == want)
      return 0;
  return -1;
}

/* Starts a joiner and waits until it has its ctx and touched memory (it attaches on 'g'). */
static int joiner_start(joiner *j, const char *address, uint64_t bytes) {
  int up[2], down[2];
  j->pid = -1;
  if (pipe(up) != 0)
    return -1;
  if (pipe(down) != 0) {
    close(up[0]), close(up[1]);
    return -1;
  }
  char fd[16], go[16], sz[32];
  snprintf(fd, sizeof fd, "%d", up[1]);
  snprintf(go, sizeof go, "%d", down[0]);
  snprintf(sz, sizeof sz, "%llu", (unsigned long long)bytes);
  fflush(NULL);
  j->pid = fork();
  if (j->pid == 0) {
    close(up[0]), close(down[1]);
    execl(self_path, "ferry", "bench", "refit", "--joiner", address, fd, go, sz, (char *)NULL);
    _exit(127);
  }
  close(up[1]), close(down[0]);
  j->from = up[0], j->to = down[1];
  if (j->pid > 0 && joiner_until(j, 'r') == 0)
    return 0;
  close(j->from), close(j->to); /* a joiner that did not come up: reaped here */
  if (j->pid > 0) {
    kill(j->pid, SIGTERM);
    waitpid(j->pid, NULL, 0);
  }
  return -1;
}

/* Tells the joiner the version pushed last, reads its report and reaps it; then waits until
 * its goodbye reached the sender (the next push is to the k others again). */
static int joiner_finish(joiner *j, ferry_refit_sender *s, size_t k, uint64_t latest,
                         joiner_result *res) {
  int rc = bench_write_all(j->to, &latest, sizeof latest) == 0 && joiner_until(j, 'd') == 0 &&
                   bench_read_all(j->from, res, sizeof *res) == 0
               ? 0
               : -1;
  close(j->from), close(j->to);
  int status = 0;
  if (j->pid > 0)
    waitpid(j->pid, &status, 0);
  for (int i = 0; i < 10000 && ferry_refit_receivers(s) > k; i++)
    usleep(1000);
  return rc == 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : -1;
}

/* Pushes to k receivers while others join, against the same pushes with nobody joining (the
 * late-join target: a joiner slows the pushes to the others by at most 10%). Each rep takes
 * three turns, in an order that rotates from rep to rep: (a) a push alone; (b) a joiner is
 * released just before the push, so it attaches, binds and asks to catch up while the push
 * runs; (c) the push begins once the first bucket of the joiner's catch-up landed, so it
 * stops a catch-up mid-way (catchup.c: the joiner stays out of that push and catches up to its
 * version after it). Every joiner must end holding the version pushed last, or the row fails. */
typedef struct joining_rows {
  bench_samples alone, join, mid;
  /* each round's (b)/(a) and (c)/(a): its three turns run within a second */
  bench_samples pair_join, pair_mid;
  int stopped; /* (c) turns whose catch-up the push overtook (the joiner's first wait saw it) */
} joining_rows;

static int time_push_joining(const model *m, int k, int reps, joining_rows *out) {
  ferry_ctx_opts co = {.size = sizeof co, .name = "bench-trainer"};
  ferry_refit_opts so = {.size = sizeof so};
  ferry_refit_push_opts po = {.size = sizeof po, .timeout_ms = -1};
  ferry_ctx *ctx = NULL;
  ferry_refit_sender *s = NULL;
  int rc = open_trainer(m, &co, &so, &ctx, &s);
  pid_t pids[2];
  push_cfg direct = {.route = FERRY_REFIT_ROUTE_AUTO};
  if (rc == 0 && spawn_receivers(ferry_ctx_address(ctx), k, pids, &direct) != 0)
    rc = FERRY_ECONNECT;
  while (rc == 0 && ferry_refit_receivers(s) < (size_t)k)
    usleep(1000);
  uint64_t v = 1;
  if (rc == 0) /* maps the buckets and faults the receivers' pages */
    rc = ferry_refit_push(s, v, &po);
  const char *why = "push";
  for (int rep = 0; rc == 0 && rep < reps; rep++) {
    double took[3] = {0};
    for (int turn = 0; rc == 0 && turn < 3; turn++) {
      int kind = (turn + rep) % 3;
      joiner j = {.pid = -1, .from = -1, .to = -1};
      if (kind > 0 && joiner_start(&j, ferry_ctx_address(ctx), m->bytes) != 0) {
        rc = FERRY_EPEER, why = "a joiner did not start";
        break;
      }
      if (kind > 0 && write(j.to, "g", 1) != 1)
        rc = FERRY_EPEER, why = "a joiner is gone";
      if (rc == 0 && kind == 2 && joiner_until(&j, 'b') != 0)
        rc = FERRY_EPEER, why = "a joiner's catch-up landed no bucket";
      double t = bench_now();
      if (rc == 0)
        rc = ferry_refit_push(s, ++v, &po);
      if (rc == 0)
        bench_add(kind == 0   ? &out->alone
                  : kind == 1 ? &out->join
                              : &out->mid,
                  took[kind] = bench_now() - t);
      joiner_result res = {0};
      if (kind > 0 && joiner_finish(&j, s, (size_t)k, v, &res) != 0 && rc == 0)
        rc = FERRY_EPEER, why = "a joiner failed";
      else if (kind > 0 && rc == 0 && res.committed != v)
        rc = FERRY_EPEER, why = "a joiner did not end at the latest version";
      if (kind == 2 && rc == 0 && res.first == v)
        out->stopped++;
    }
    if (rc == 0) {
      bench_add(&out->pair_join, took[1] / took[0]);
      bench_add(&out->pair_mid, took[2] / took[0]);
    }
  }
  if (rc != 0) {
    char what[96];
    snprintf(what, sizeof what, "push beside a late joiner: %s", why);
    cli_fail("bench refit", rc, what);
  }
  stop_receivers(pids, rc == 0 || rc == FERRY_ECONNECT || rc == FERRY_EPEER ? k : 0);
  ferry_refit_sender_close(s);
  ferry_ctx_close(ctx);
  return rc;
}

static void time_memcpy(const model *m, int reps, bench_samples *b) {
  uint8_t *dst = malloc(m->bytes);
  for (int r = 0; r <= reps; r++) {
    double t = bench_now();
    uint64_t at = 0;
    for (size_t i = 0; i < m->n; i++) {
      uint64_t n = m->desc[i].shape[0] * m->desc[i].shape[1] * 4;
      memcpy(dst + at, m->data[i], n);
      at += n;
    }
    __asm__ volatile("" ::"r"(dst) : "memory");
    if (r > 0)
      bench_add(b, bench_now() - t);
  }
  free(dst);
}

/* ---- tensor-parallel receivers: each reads its shards only ---- */

/* One rank's destinations: per tensor group a buffer its pieces fill (qkv fused). */
typedef struct tp_rank {
  ferry_ctx *ctx;
  ferry_refit_receiver *rx;
  void **mem;
  size_t nmem;
} tp_rank;

/* The split of the model's tensor i: attention q, k, v (kinds 0-2) and the MLP's up (4) by
 * rows, o (3) and down (5) by columns, norms (6, 7) whole. */
static int tp_dim(const model *m, size_t i) {
  size_t kind = i % 8;
  return m->small || kind >= 6 ? -1 : kind == 3 || kind == 5 ? 1 : 0;
}

/* Binds target `name` of pieces [0, n) (same dtype, laid along dim 0) in fresh memory. */
static int tp_bind(tp_rank *k, const model *m, const char *name, const size_t *src, size_t n,
                   int rank, int world) {
  ferry_refit_piece pc[3];
  ferry_tensor_desc d = m->desc[src[0]];
  d.shape[0] = 0;
  for (size_t j = 0; j < n; j++) {
    const ferry_tensor_desc *s = &m->desc[src[j]];
    int dim = tp_dim(m, src[j]);
    uint64_t size = dim < 0 ? s->shape[0] : s->shape[dim] / (uint64_t)world;
    uint64_t start = dim < 0 ? 0 : size * (uint64_t)rank;
    pc[j] = (ferry_refit_piece){m->name[src[j]], dim < 0 ? 0 : dim, (int64_t)start,
                                (int64_t)(start + size)};
    d.shape[0] += dim == 0 ? size : s->shape[0];
    if (dim == 1)
      d.shape[1] = size;
  }
  uint64_t bytes = 0;
  int rc = ferry_tensor_nbytes(&d, &bytes);
  void *mem = rc == 0 ? malloc(bytes) : NULL;
  if (rc == 0 && !mem)
    rc = FERRY_ENOMEM;
  if (rc != 0)
    return rc;
  memset(mem, 0, bytes); /* an engine's weight memory exists before it loads */
  k->mem[k->nmem++] = mem;
  return ferry_refit_bind_pieces(k->rx, name, mem, &d, pc, n);
}

static int tp_open(tp_rank *k, const model *m, const char *address, int rank, int world) {
  char node[32];
  snprintf(node, sizeof node, "bench-tp-%d", rank);
  ferry_ctx_opts o = {.size = sizeof o, .name = node};
  k->mem = calloc(m->n, sizeof *k->mem);
  int rc = k->mem ? ferry_ctx_open(&o, &k->ctx) : FERRY_ENOMEM;
  if (rc == 0)
    rc = ferry_refit_receiver_open(k->ctx, address, -1, &k->rx);
  for (size_t i = 0; rc == 0 && i < m->n;) {
    bool fused = tp_dim(m, i) == 0 && i % 8 == 0 && i + 2 < m->n;
    size_t src[3] = {i, i + 1, i + 2}, n = fused ? 3 : 1;
    char name[64];
    snprintf(name, sizeof name, "%s%s", m->name[i], fused ? ".qkv" : "");
    rc = tp_bind(k, m, name, src, n, rank, world);
    i += n;
  }
  return rc;
}

static void tp_close(tp_rank *k) {
  ferry_refit_receiver_close(k->rx);
  ferry_ctx_close(k->ctx);
  for (size_t i = 0; i < k->nmem; i++)
    free(k->mem[i]);
  free(k->mem);
}

/* Pushes to `world` ranks that bind their shards (world 1: one receiver of the whole model,
 * in a flat buffer), all in this process; *read: the most bytes a rank read per push. */
static int time_tp(const model *m, int world, int reps, bench_samples *b, uint64_t *read) {
  ferry_ctx_opts co = {.size = sizeof co, .name = "bench-trainer"};
  ferry_refit_opts so = {.size = sizeof so};
  ferry_refit_push_opts po = {.size = sizeof po, .timeout_ms = -1};
  ferry_ctx *ctx = NULL;
  ferry_refit_sender *s = NULL;
  tp_rank ranks[4] = {{0}};
  int rc = open_trainer(m, &co, &so, &ctx, &s);
  for (int r = 0; rc == 0 && r < world; r++) {
    ferry_ctx_opts o = {.size = sizeof o, .name = "bench-full"};
    if (world > 1)
      rc = tp_open(&ranks[r], m, ferry_ctx_address(ctx), r, world);
    else if ((rc = ferry_ctx_open(&o, &ranks[r].ctx)) == 0 &&
             (rc = ferry_refit_receiver_open(ranks[r].ctx, ferry_ctx_address(ctx), -1,
                                             &ranks[r].rx)) == 0)
      rc = ferry_refit_bind_flat(ranks[r].rx);
  }
  uint64_t before[4] = {0};
  for (int v = 1; rc == 0 && v <= reps + 1; v++) {
    double t = bench_now();
    rc = ferry_refit_push(s, (uint64_t)v, &po);
    if (v == 1) /* the first push faults the pages in */
      for (int r = 0; r < world; r++)
        before[r] = ferry_refit_bytes_read(ranks[r].rx);
    else
      bench_add(b, bench_now() - t);
  }
  *read = 0;
  for (int r = 0; rc == 0 && r < world; r++) {
    uint64_t per = (ferry_refit_bytes_read(ranks[r].rx) - before[r]) / (uint64_t)reps;
    *read = per > *read ? per : *read;
  }
  if (rc != 0)
    cli_fail("bench refit", rc, world > 1 ? "tensor-parallel ranks" : "full receiver");
  for (int r = 0; r < world; r++)
    if (ranks[r].rx || ranks[r].ctx)
      tp_close(&ranks[r]);
  ferry_refit_sender_close(s);
  ferry_ctx_close(ctx);
  return rc;
}

/* TP-4: four ranks that read their shards against one receiver of the whole model; rows: the
 * full receiver's push, the four ranks' push (vs base: how much faster), and the bytes each
 * rank read per push (the row's bytes; target 1/4 of the model plus the norms). */
static int run_tp(const bench_opts *o, const char *label, const model *m, int reps) {
  bench_samples full = {0}, tp = {0};
  uint64_t full_read = 0, rank_read = 0;
  char name[48];
  snprintf(name, sizeof name, "%s-TP4", label);
  int rc = time_tp(m, 1, reps, &full, &full_read);
  if (rc == 0)
    rc = time_tp(m, 4, reps, &tp, &rank_read);
  if (rc == 0) {
    bench_row(o, "refit", name, "ferry/full", full_read, &full, true);
    bench_row(o, "refit", name, "ferry/TP-4", m->bytes, &tp, false);
    bench_row(o, "refit", name, "TP-4/rank-read", rank_read, &tp, false);
    if (!o->json)
      printf("%-16s each rank read %.4f of the bytes a full receiver read (1/4 = 0.25)\n", name,
             full_read ? (double)rank_read / (double)full_read : 0);
  }
  bench_free(&full);
  bench_free(&tp);
  return rc;
}

/* ---- gloo (python3 + torch) ---- */

static const char gloo_script[] =
    "import json,os,sys,time,torch,torch.distributed as dist\n"
    "rank,world,port,spec,bucket,reps=int(sys.argv[1]),int(sys.argv[2]),sys.argv[3],"
    "json.load(open(sys.argv[4])),int(sys.argv[5]),int(sys.argv[6])\n"
    "which=sys.argv[7].split(',')\n"
    "dist.init_process_group('gloo',init_method='tcp://127.0.0.1:'+port,rank=rank,"
    "world_size=world)\n"
    "ts=[torch.full(s,float(i%100)) for i,s in enumerate(spec)]\n"
    "def per_tensor():\n"
    "  for t in ts: dist.broadcast(t,0)\n"
    "groups=[];cur=[];size=0\n"
    "for t in ts:\n"
    "  if cur and size+t.numel()*4>bucket: groups.append(cur);cur=[];size=0\n"
    "  cur.append(t);size+=t.numel()*4\n"
    "if cur: groups.append(cur)\n"
    "def bucketed():\n"
    "  for g in groups:\n"
    "    flat=torch.cat([t.reshape(-1) for t in g]) if rank==0 else "
    "torch.empty(sum(t.numel() for t in g))\n"
    "    dist.broadcast(flat,0)\n"
    "    if rank:\n"
    "      for t,f in zip(g,torch.split(flat,[t.numel() for t in g])): t.copy_(f.view_as(t))\n"
    "out={}\n"
    "for name,f in (('per-tensor',per_tensor),('bucketed',bucketed)):\n"
    "  if name not in which: continue\n"
    "  times=[]\n"
    "  for r in range(reps+1):\n"
    "    dist.barrier(); t=time.perf_counter(); f(); dist.barrier()\n"
    "    if r: times.append(time.perf_counter()-t)\n"
    "  out[name]=times\n"
    "if rank==0: print(json.dumps(out))\n";

static int gloo_available(void) {
  return system("/usr/bin/python3 -c 'import torch.distributed' >/dev/null 2>&1") == 0;
}

/* Adds the numbers of a JSON list that starts somewhere after `at`. */
static void parse_list(const char *at, bench_samples *b) {
  const char *p = at ? strchr(at, '[') : NULL;
  while (p && *p && *p != ']') {
    char *end;
    double v = strtod(p + 1, &end);
    if (end == p + 1)
      break;
    bench_add(b, v);
    p = end;
    while (*p == ' ')
      p++;
  }
}

/* Runs K+1 python ranks; parses rank 0's JSON into the two sample sets (per tensor only when
 * `per_tensor`). */
static int time_gloo(const model *m, int k, int reps, bool per_tensor, bench_samples *per,
                     bench_samples *bkt) {
  char dir[] = "/tmp/ferry-bench-XXXXXX";
  if (!mkdtemp(dir))
    return -1;
  char script[64], spec[64], out[64], cmd[512];
  snprintf(script, sizeof script, "%s/gloo.py", dir);
  snprintf(spec, sizeof spec, "%s/spec.json", dir);
  snprintf(out, sizeof out, "%s/out.json", dir);
  FILE *f = fopen(script, "w");
  fputs(gloo_script, f);
  fclose(f);
  f = fopen(spec, "w");
  fputc('[', f);
  for (size_t i = 0; i < m->n; i++)
    fprintf(f, "%s[%llu,%llu]", i ? "," : "", (unsigned long long)m->desc[i].shape[0],
            (unsigned long long)m->desc[i].shape[1]);
  fputs("]\n", f);
  fclose(f);
  int port = 20000 + (int)(getpid() % 20000);
  for (int r = k; r >= 0; r--) {
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 /usr/bin/python3 %s %d %d %d %s %d %d %s %s%s",
             script, r, k + 1, port, spec, 16 << 20, reps,
             per_tensor ? "per-tensor,bucketed" : "bucketed", r ? ">/dev/null 2>&1 &" : "> ",
             r ? "" : out);
    if (system(cmd) != 0 && r == 0)
      return -1;
  }
  f = fopen(out, "r");
  char buf[65536];
  size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
  if (f)
    fclose(f);
  buf[n] = 0;
  parse_list(strstr(buf, "\"per-tensor\": ["), per);
  parse_list(strstr(buf, "\"bucketed\": ["), bkt);
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  if (system(cmd) != 0)
    return -1;
  return (per->n || !per_tensor) && bkt->n ? 0 : -1;
}

/* ---- the cases ---- */

/* NAME-late-KK: pushes to k receivers alone, while a joiner attaches, and while a catch-up is
 * under way; then (b)/(a) and (c)/(a), the late-join target being (b)/(a) <= 1.10. */
static int push_joining_case(const bench_opts *o, const char *label, const model *m, int k,
                             int reps) {
  joining_rows x = {0};
  int rc = time_push_joining(m, k, reps, &x);
  char name[48];
  snprintf(name, sizeof name, "%s-late-K%d", label, k);
  if (rc == 0) {
    double alone = bench_median(&x.alone), join = bench_median(&x.join), mid = bench_median(&x.mid);
    bench_row(o, "refit", name, "push/alone", m->bytes, &x.alone, true);
    bench_row(o, "refit", name, "push/joining", m->bytes, &x.join, false);
    bench_row(o, "refit", name, "push/mid-catch", m->bytes, &x.mid, false);
    double rb = alone > 0 ? join / alone : 0, rcu = alone > 0 ? mid / alone : 0;
    double pb = bench_median(&x.pair_join), pc = bench_median(&x.pair_mid);
    if (o->json)
      printf("{\"bench\":\"refit\",\"case\":\"%s\",\"impl\":\"ratios\","
             "\"joining_over_alone\":%.6g,\"mid_catch_over_alone\":%.6g,"
             "\"paired_joining_over_alone\":%.6g,\"paired_mid_catch_over_alone\":%.6g,"
             "\"target_max\":1.1,\"joiners\":%zu,\"catchups_stopped\":%d}\n",
             name, rb, rcu, pb, pc, x.join.n + x.mid.n, x.stopped);
    else
      printf("%-16s push/joining %.2fx alone (target <= 1.10; per round %.2fx), push/mid-catch "
             "%.2fx (per round %.2fx); each of %zu joiners held the latest version; the push "
             "overtook %d of %zu catch-ups\n",
             name, rb, pb, rcu, pc, x.join.n + x.mid.n, x.stopped, x.mid.n);
  }
  bench_free(&x.alone);
  bench_free(&x.join);
  bench_free(&x.mid);
  bench_free(&x.pair_join);
  bench_free(&x.pair_mid);
  return rc;
}

/* The late-join cases: NAME-late (a joiner's catch-up against a push), then NAME-late-K1, -K2
 * (pushes to the others beside joiners). */
static int run_late(const bench_opts *o, const char *label, const model *m, int reps) {
  bench_samples b = {0}, per = {0};
  char name[48];
  snprintf(name, sizeof name, "%s-late", label);
  int rc = time_late_join(m, reps, &b, &per);
  bench_row(o, "refit", name, "ferry/push", m->bytes, &b, true);
  bench_row(o, "refit", name, "ferry/catch-up", m->bytes, &per, false);
  bench_free(&b);
  bench_free(&per);
  /* A 10% target on a shared, noisy machine: twice the turns by default */
  for (int k = 1; rc == 0 && k <= 2; k++)
    rc = push_joining_case(o, label, m, k, o->reps ? o->reps : 2 * reps);
  return rc;
}

/* The model's cases at K = 1, 2, 4; by default the 5,000-tensor model's K = 1 only, without
 * gloo (its target reads the push against memcpy). */
static int run_case(const bench_opts *o, const char *label, const model *m, int reps, bool gloo) {
  int ks[] = {1, 2, 4};
  int nk = o->full || !m->small ? 3 : 1;
  gloo = gloo && (o->full || !m->small);
  bench_samples b = {0}, per = {0}, bkt = {0};
  time_memcpy(m, reps, &b);
  char name[48];
  int rc = 0;
  for (int i = 0; i < nk && rc == 0; i++) {
    snprintf(name, sizeof name, "%s-K%d", label, ks[i]);
    if (i > 0) {
      bench_reset(&b);
      time_memcpy(m, reps, &b);
    }
    bench_row(o, "refit", name, "memcpy", m->bytes, &b, true);
    bench_reset(&b);
    push_cfg direct = {.route = FERRY_REFIT_ROUTE_AUTO};
    rc = time_pushes(m, ks[i], reps, &b, &direct);
    bench_row(o, "refit", name, "ferry/shm", m->bytes, &b, false);
    bench_reset(&b);
    push_cfg alias = {.route = FERRY_REFIT_ROUTE_AUTO, .alias = true};
    if (rc == 0 && ks[i] == 1 && !m->small) {
      rc = time_pushes(m, ks[i], reps, &b, &alias);
      bench_row(o, "refit", name, "ferry/shm-alias", m->bytes, &b, false);
      bench_reset(&b);
    }
    if (gloo && time_gloo(m, ks[i], reps, o->full, &per, &bkt) == 0) {
      bench_row(o, "refit", name, "gloo/bucketed", m->bytes, &bkt, false);
      bench_row(o, "refit", name, "gloo/tensor", m->bytes, &per, false); /* --full only */
    }
    bench_reset(&per);
    bench_reset(&bkt);
  }
  if (rc == 0 && !m->small)
    rc = run_tp(o, label, m, reps);
  if (rc == 0 && !m->small)
    rc = run_late(o, label, m, reps);
  bench_free(&b);
  bench_free(&per);
  bench_free(&bkt);
  return rc;
}

/* ---- between "hosts": network namespaces, rate-limited links ---- */

/* Runs fn with this thread (and the threads it starts) in the trainer's namespace. */
static int in_trainer_ns(int (*fn)(const bench_opts *, const model *, int), const bench_opts *o,
                         const model *m, int reps) {
  int home;
  if (netns_enter(HOSTS_TAG, 1, &home) != 0)
    return -1;
  int rc = fn(o, m, reps);
  return netns_leave(home) == 0 ? rc : -1;
}

static int hosts_cases(const bench_opts *o, const model *m, int reps) {
  int ks[] = {1, 2, 4};
  bench_samples base = {0}, b = {0};
  push_cfg chain = {.route = FERRY_REFIT_ROUTE_CHAIN, .hosts = true, .bucket_bytes = 2 << 20};
  push_cfg direct = chain;
  direct.route = FERRY_REFIT_ROUTE_DIRECT;
  int rc = time_pushes(m, 1, reps, &base, &direct);
  char name[48];
  for (int i = 0; i < 3 && rc == 0; i++) {
    snprintf(name, sizeof name, "hosts128MiB-K%d", ks[i]);
    bench_row(o, "refit", name, "ferry/tcp K=1", m->bytes, &base, true);
    if (ks[i] == 1)
      continue;
    if (o->full) { /* no target reads direct pushes: K copies through one egress, as expected */
      rc = time_pushes(m, ks[i], reps, &b, &direct);
      bench_row(o, "refit", name, "ferry/direct", m->bytes, &b, false);
      bench_reset(&b);
    }
    if (rc == 0)
      rc = time_pushes(m, ks[i], reps, &b, &chain);
    bench_row(o, "refit", name, "ferry/chain", m->bytes, &b, false);
    bench_reset(&b);
  }
  bench_free(&base);
  bench_free(&b);
  return rc;
}

/* The "hosts" topology: K = 1, 2, 4 receivers, chain against direct. */
static int run_hosts(const bench_opts *o, int reps) {
  char failed[512];
  if (!netns_up(HOSTS_TAG, HOSTS_NET, HOSTS_N, HOSTS_RATE, failed, sizeof failed)) {
    if (!o->json)
      printf("(network namespaces or tc unavailable here: `%s` failed; needs root, iproute2; "
             "hosts rows skipped)\n",
             failed);
    return 0;
  }
  model m;
  model_make(&m, 128ull << 20, 0);
  bool token = bench_token_begin();
  int rc = in_trainer_ns(hosts_cases, o, &m, reps);
  bench_token_end(token);
  model_free(&m);
  netns_down(HOSTS_TAG, HOSTS_N);
  return rc;
}

static const char refit_usage[] =
    "usage: ferry bench refit [--json] [--reps N] [--max-size BYTES] [--full]\n"
    "                         [--hosts-only|--no-hosts|--late-only|--group-only]\n\n"
    "Pushes a transformer-shaped model (256 MiB; --max-size 1G adds a 1 GiB case) to K = 1, 2\n"
    "and 4 receiver processes on this host over shm, against a memcpy of the model's bytes\n"
    "and torch.distributed gloo broadcasts (per tensor and in 16 MiB buckets) when python3-torch\n"
    "is installed; K = 1 also in alias mode (the receiver uses the sender's buffer in place);\n"
    "Late join (NAME-late): after each push to one receiver a new receiver process attaches\n"
    "and catches up to the latest version; its catch-up time against the push (target: the\n"
    "catch-up takes at most 1.2 times the push, vs base >= 0.83).\n"
    "NAME-late-K1, -K2: pushes to K receivers alone (push/alone), while a joiner attaches and\n"
    "asks to catch up (push/joining) and once a joiner's catch-up landed its first bucket\n"
    "(push/mid-catch), in turns (10 each; --reps N: N); target: push/joining <= 1.10 times\n"
    "push/alone (also as the median over rounds of each round's ratio: \"per round\").\n"
    "With --json also a line per case, impl \"ratios\": joining_over_alone,\n"
    "mid_catch_over_alone, paired_joining_over_alone, paired_mid_catch_over_alone,\n"
    "target_max, joiners, catchups_stopped.\n"
    "--late-only runs the late-join cases alone.\n"
    "TP-4 (NAME-TP4): four tensor-parallel ranks read their shards only, against one receiver\n"
    "of the whole model: the push, and the bytes each rank read per push (TP-4/rank-read).\n"
    "Then a model of 5,000 small tensors for the per-push overhead.\n"
    "Then \"hosts\": the trainer and 4 receivers each in a network namespace (root needed),\n"
    "joined by a bridge, every host's egress limited to " HOSTS_RATE " by tc tbf; a 128 MiB model\n"
    "in 2 MiB buckets pushed to K = 1, 2, 4 over tcp, chain against direct; vs base is the\n"
    "K = 1 time over the row's (the chain's target: >= 0.8 at K = 4).\n"
    "By default the rows the targets read; --full adds gloo per tensor, the 5,000-tensor\n"
    "model at K = 2, 4 and against gloo, and direct pushes between hosts at K = 2, 4.\n"
    "Sharded senders (issue 34), last (--no-hosts: 5000t-M4 alone; --hosts-only: all but\n"
    "5000t-M4):\n" BENCH_REFIT_GROUP_USAGE;

int bench_refit(int argc, char **argv) {
  if (argc == 5 && strcmp(argv[1], "--receiver") == 0)
    return bench_refit_receiver(argv[2], atoi(argv[3]), argv[4]);
  if (argc == 4 && strcmp(argv[1], "--late") == 0)
    return bench_refit_late(argv[2], atoi(argv[3]));
  if (argc >= 2 && strncmp(argv[1], "--group-", 8) == 0 && strcmp(argv[1], "--group-only") != 0)
    return bench_refit_group_peer(argc, argv);
  if (argc == 6 && strcmp(argv[1], "--joiner") == 0)
    return bench_refit_joiner(argv[2], atoi(argv[3]), atoi(argv[4]), strtoull(argv[5], NULL, 10));
  bool hosts_only = false, no_hosts = false, late_only = false, group_only = false;
  const cli_opt extra[] = {{"hosts-only", CLI_ARG_FLAG, &hosts_only, 0, 0},
                           {"group-only", CLI_ARG_FLAG, &group_only, 0, 0},
                           {"no-hosts", CLI_ARG_FLAG, &no_hosts, 0, 0},
                           {"late-only", CLI_ARG_FLAG, &late_only, 0, 0},
                           {0}};
  bench_opts o = {.max_size = 256ull << 20};
  if (bench_parse_with(argc, argv, &o, refit_usage, extra) < 0)
    return CLI_USAGE;
  ssize_t len = readlink("/proc/self/exe", self_path, sizeof self_path - 1);
  if (len <= 0)
    return cli_fail("bench refit", FERRY_ESYS, "cannot find this program's path");
  self_path[len] = 0;
  signal(SIGPIPE, SIG_IGN);
  bool gloo = gloo_available();
  if (!gloo && !o.json)
    printf("(python3-torch not found: gloo rows skipped)\n");
  bench_header(&o, "ferry bench refit (push to K receivers on one host; vs base = speed)");
  int rc = 0;
  hosts_only = hosts_only || group_only;
  for (uint64_t size = 256ull << 20; rc == 0 && !hosts_only && size <= o.max_size; size *= 4) {
    model m;
    model_make(&m, size, 0);
    char label[24], sz[16];
    snprintf(label, sizeof label, "%s", bench_size_name(size, sz, sizeof sz));
    int reps = o.reps ? o.reps : 5;
    rc = late_only ? run_late(&o, label, &m, reps) : run_case(&o, label, &m, reps, gloo);
    model_free(&m);
  }
  if (rc == 0 && !hosts_only && !late_only) {
    model m;
    model_make(&m, 0, 5000);
    rc = run_case(&o, "5000t", &m, o.reps ? o.reps : 20, gloo);
    model_free(&m);
  }
  if (rc == 0 && !no_hosts && !late_only && !group_only)
    rc = run_hosts(&o, o.reps ? o.reps : 3);
  if (rc == 0 && !late_only)
    rc = bench_refit_group(&o, !no_hosts, !hosts_only || group_only);
  return rc == 0 ? CLI_OK : CLI_FAIL;
}
