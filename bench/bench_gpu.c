/*
 * `ferry bench gpu`: ferry's jobs with CUDA memory on both sides, each row against the copy it
 * stands for, in the same run (issue 18's device check; docs/GPU.md):
 *   (a) colocated refit: a bf16 state dict in device memory of this process (the trainer) pushed
 *       to a receiver process on the same GPU that binds tensors of its own device memory
 *       (copying receiver: device buckets, read device to device through CUDA IPC, unhashed;
 *       with the default buckets, then buckets of an eighth of the model: each bucket is a round
 *       trip), against one device-to-device copy of the same bytes (goal <= 1.2x the copy); and in
 * alias mode, the receiver viewing the sender's device buffer through CUDA IPC (nothing copied on
 * its side; the sender packs device to device and takes the checksums through pinned host memory);
 * (b) an 11.25 MiB routing tensor (int32 [45, 8192, 8], the bytes of `ferry bench store`'s routing
 * case) put from device memory by a producer process and got into device memory here, against a
 * device-to-device copy of it, with the producer's store holding it in host memory, then in a
 * device pool (got device to device through CUDA IPC; goal <= 1.3x the copy); (c) staged device ->
 * host -> device: a large buffer through a bounded pinned bounce buffer in chunks, as ferry stages
 * bytes that cross a wire, against one pinned device -> host copy and one host -> device copy of
 * the whole buffer. The driver is the one ferry loads (FERRY_CUDA_LIB, else libcuda.so.1): on the
 * tests' stand-in this runs end to end at small sizes (--quick), on a GPU at the sizes of the
 * issue. Without a driver it says so and exits 0. The rows are copies of megabytes to gigabytes,
 * timed back to back: no paced rows. torch's paths (CUDA IPC through torch.multiprocessing,
 * torch.save) are the Python bench's (`python3 -m ferry.bench gpu`).
 */
#include "bench_gpu.h"
#include "cli/bench.h"
#include "cli/cli.h"
#include "core/cuda.h"
#include "ferry.h"

#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

static const char gpu_usage[] =
    "usage: ferry bench gpu [--json] [--reps N] [--quick] [--only CASE]\n"
    "                       [--refit-bytes BYTES] [--staged-bytes BYTES]\n\n"
    "CUDA memory through ferry's jobs, against device copies of the same bytes, in one run:\n"
    "  refit-colo  a bf16 state dict from device memory here to a receiver process's device\n"
    "              tensors on the same GPU (device buckets, device to device through CUDA IPC;\n"
    "              and in alias mode, the receiver viewing the sender's buffer), vs one\n"
    "              device-to-device copy (goal <= 1.2x); breakdown lines say where a push's\n"
    "              time went; rows -whole, -serial and -pack-async try\n"
    "              FERRY_REFIT_DEVICE_WHOLE=1, FERRY_REFIT_NO_OVERLAP=1 and\n"
    "              FERRY_CUDA_PACK_ASYNC=1; d2d-copy-by-tensor copies one tensor at a time\n"
    "              (docs/GPU.md)\n"
    "  routing     an int32 [45, 8192, 8] tensor put from device memory by a producer process\n"
    "              and got into device memory here, vs a device-to-device copy; (devpool):\n"
    "              the producer's store keeps it in a device pool (goal <= 1.3x the copy)\n"
    "  staged      device -> pinned host -> device in chunks (ferry's staging), vs one pinned\n"
    "              device -> host and one host -> device copy of the whole buffer; bounce:\n"
    "              a device buffer read over tcp with FERRY_CUDA_BOUNCE=malloc vs pinned\n"
    "  group       two sender rank processes, each holding half of a bf16 state dict (min(2 GiB,\n"
    "              --refit-bytes)) in device memory, to a group receiver here binding device\n"
    "              tensors (hashed, through host memory; host or device buckets), vs a\n"
    "              device-to-device copy; the directory on loopback, no namespaces\n\n"
    "options:\n"
    "  --refit-bytes BYTES   the state dict (default: min(8 GiB, device memory / 8))\n"
    "  --staged-bytes BYTES  the staged buffer (default: min(1 GiB, device memory / 16))\n"
    "  --quick               small sizes (4 MiB state dict, 8 MiB staged), 3 repetitions:\n"
    "                        the tests' run on the stand-in driver\n"
    "  --only CASE           one case: refit, routing, staged or group\n"
    "  --json, --reps N      as every mode (ferry bench --help)\n\n"
    "Device 0 runs every row. Without a CUDA driver: one line saying so, exit status 0.\n"
    "torch's paths (CUDA IPC handles, torch.save/load) are `python3 -m ferry.bench gpu`'s.\n";

#define ROUTING_LAYERS 45
#define ROUTING_TOKENS 8192
#define ROUTING_TOPK 8
#define ROUTING_BYTES ((uint64_t)ROUTING_LAYERS * ROUTING_TOKENS * ROUTING_TOPK * 4)
#define TENSOR_COLS 4096                /* bf16 [rows, 4096]: 8 KiB a row */
#define TENSOR_MAX (64ull << 20)        /* a large layer's matrix */
#define CHECK_BYTES ((size_t)1 << 20)   /* verified at each end of a tensor */
#define STAGE_CHUNK ((uint64_t)8 << 20) /* the bounce buffer's half */

static char self_path[PATH_MAX];

/* ---- device memory, filled and checked only through ferry_mem_copy ---- */

/* Sets n bytes at dev (device memory) to value, through a host buffer. */
static int dev_fill(void *dev, uint64_t n, uint8_t value) {
  size_t chunk = n < (64u << 20) ? (size_t)n : 64u << 20;
  uint8_t *h = malloc(chunk ? chunk : 1);
  if (!h)
    return FERRY_ENOMEM;
  memset(h, value, chunk);
  int rc = 0;
  for (uint64_t at = 0; rc == 0 && at < n; at += chunk)
    rc = ferry_mem_copy((uint8_t *)dev + at, h, n - at < chunk ? (size_t)(n - at) : chunk);
  free(h);
  return rc;
}

/* Whether the first and last CHECK_BYTES of n bytes at dev all hold value. */
static bool dev_holds(const void *dev, uint64_t n, uint8_t value) {
  size_t k = n < CHECK_BYTES ? (size_t)n : CHECK_BYTES;
  uint8_t *h = malloc(k ? k : 1);
  bool ok = h != NULL;
  for (int end = 0; ok && end < 2; end++) {
    const uint8_t *at = (const uint8_t *)dev + (end ? n - k : 0);
    ok = ferry_mem_copy(h, at, k) == 0;
    for (size_t i = 0; ok && i < k; i++)
      ok = h[i] == value;
  }
  free(h);
  return ok;
}

static void *dev_alloc(uint64_t n, int *rc) {
  void *p = NULL;
  *rc = ferry_cuda_alloc(0, (size_t)(n ? n : 1), &p);
  return *rc == 0 ? p : NULL;
}

/* The device-to-device baseline: reps copies of n bytes (the first one, which maps pages, not
 * timed). */
static int time_d2d(void *dst, const void *src, uint64_t n, int reps, bench_samples *b) {
  for (int i = 0; i <= reps; i++) {
    double t = bench_now();
    int rc = ferry_mem_copy(dst, src, (size_t)n);
    if (rc != 0)
      return rc;
    if (i > 0)
      bench_add(b, bench_now() - t);
  }
  return 0;
}

/* bench_gpu.h's, for bench_gpu_group.c */
void *bench_gpu_alloc(uint64_t n, int *rc) { return dev_alloc(n, rc); }
int bench_gpu_fill(void *dev, uint64_t n, uint8_t value) { return dev_fill(dev, n, value); }
bool bench_gpu_holds(const void *dev, uint64_t n, uint8_t value) {
  return dev_holds(dev, n, value);
}
int bench_gpu_d2d(void *dst, const void *src, uint64_t n, int reps, bench_samples *b) {
  return time_d2d(dst, src, n, reps, b);
}

/* The ratio a goal reads (this row's median over the baseline's), and whether it is met. */
static void goal_row(const bench_opts *o, const char *case_name, const char *what, double ratio,
                     double goal) {
  if (o->json)
    printf("{\"bench\":\"gpu\",\"case\":\"%s\",\"goal\":\"%s\",\"ratio\":%.4g,\"goal_ratio\":%.4g,"
           "\"met\":%s}\n",
           case_name, what, ratio, goal, ratio <= goal ? "true" : "false");
  else
    printf("%-16s goal: %s <= %.2fx: %.2fx (%s)\n", case_name, what, goal, ratio,
           ratio <= goal ? "met" : "not met");
  fflush(stdout);
}

/* ---- (a) colocated refit ---- */

/* The state dict: bf16 [rows, 4096] tensors of about bytes/64 each (8 KiB to 64 MiB), laid end
 * to end from offset 0; tensor i holds the byte i + 1. */
typedef struct gmodel {
  size_t n;
  ferry_tensor_desc *desc;
  uint64_t *off, *len;
  char (*name)[32];
  uint64_t bytes;
} gmodel;

static int gmodel_make(gmodel *m, uint64_t bytes) {
  const uint64_t row = TENSOR_COLS * 2;
  uint64_t each = bytes / 64 / row * row;
  each = each < row ? row : each > TENSOR_MAX ? TENSOR_MAX : each;
  size_t cap = (size_t)(bytes / each + 1);
  m->desc = calloc(cap, sizeof *m->desc);
  m->off = calloc(cap, sizeof *m->off);
  m->len = calloc(cap, sizeof *m->len);
  m->name = calloc(cap, sizeof *m->name);
  m->n = 0;
  m->bytes = 0;
  if (!m->desc || !m->off || !m->len || !m->name)
    return FERRY_ENOMEM;
  while (m->bytes + row <= bytes && m->n < cap) {
    uint64_t len = bytes - m->bytes < each ? (bytes - m->bytes) / row * row : each;
    m->desc[m->n] = (ferry_tensor_desc){
        .dtype = FERRY_DTYPE_BF16, .ndim = 2, .shape = {len / row, TENSOR_COLS}};
    snprintf(m->name[m->n], sizeof m->name[0], "layers.%zu.weight", m->n);
    m->off[m->n] = m->bytes;
    m->len[m->n] = len;
    m->bytes += len;
    m->n++;
  }
  return m->n ? 0 : FERRY_EINVAL;
}

static void gmodel_free(gmodel *m) {
  free(m->desc);
  free(m->off);
  free(m->len);
  free(m->name);
}

/* Where a refit's time went in one process, from its metrics (ferry_stats_each): the sender's
 * push phases, the receiver's, and the process's CUDA copies (issue 37: the copying refit took
 * 7.4x one device copy, and nobody knew where). Sums since the process began; a row takes the
 * difference over its timed pushes. */
static const char *const gp_push_names[GP_SENDER] = {"pack", "slot_wait", "read_wait", "notify",
                                                     "commit"};
static const char *const gp_rx_names[GP_RECEIVER] = {"wait", "copy", "ack"};

static int phase_of(const ferry_stat *st, const char *const *names, int n) {
  for (size_t i = 0; i < st->nlabels; i++)
    if (strcmp(st->label_names[i], "phase") == 0)
      for (int k = 0; k < n; k++)
        if (strcmp(st->label_values[i], names[k]) == 0)
          return k;
  return -1;
}

static int take_stat(const ferry_stat *st, void *arg) {
  gphases *g = arg;
  int k;
  if (strcmp(st->name, "ferry_refit_push_phase_seconds_total") == 0 &&
      (k = phase_of(st, gp_push_names, GP_SENDER)) >= 0)
    g->push[k] += st->value;
  else if (strcmp(st->name, "ferry_refit_receiver_phase_seconds_total") == 0 &&
           (k = phase_of(st, gp_rx_names, GP_RECEIVER)) >= 0)
    g->rx[k] += st->value;
  else if (strcmp(st->name, "ferry_refit_receiver_buckets_total") == 0)
    g->buckets += st->value;
  else if (strcmp(st->name, "ferry_cuda_copies_total") == 0)
    g->copies += st->value;
  else if (strcmp(st->name, "ferry_cuda_copy_issue_seconds_total") == 0)
    g->issue_s += st->value;
  else if (strcmp(st->name, "ferry_cuda_copy_sync_seconds_total") == 0)
    g->sync_s += st->value;
  return 0;
}

gphases bench_gpu_phases(ferry_ctx *ctx) {
  gphases g = {0};
  ferry_stats_each(ctx, take_stat, &g);
  return g;
}

/* (b - a) / n, field by field: the mean per push between two readings. */
gphases bench_gpu_phases_per(const gphases *a, const gphases *b, int n) {
  gphases d;
  const double *x = (const double *)a, *y = (const double *)b;
  double *z = (double *)&d;
  for (size_t i = 0; i < sizeof d / sizeof(double); i++)
    z[i] = n > 0 ? (y[i] - x[i]) / n : 0;
  return d;
}

/* The breakdown of a refit row's pushes: the phases' means per timed push beside the pushes'
 * mean and median; one JSON line (no "impl": not a timed row), or a line of text, milliseconds. */
void bench_gpu_breakdown(const bench_opts *o, const char *label, const char *impl, bench_samples *b,
                         const gphases *tx, const gphases *rx) {
  double mean = 0, median = bench_median(b);
  for (size_t i = 0; i < b->n; i++)
    mean += b->s[i] / (double)b->n;
  if (o->json) {
    printf("{\"bench\":\"gpu\",\"case\":\"%s\",\"breakdown\":\"%s\",\"pushes\":%zu,"
           "\"push_mean_s\":%.6g,\"push_median_s\":%.6g",
           label, impl, b->n, mean, median);
    for (int k = 0; k < GP_SENDER; k++)
      printf(",\"tx_%s_s\":%.6g", gp_push_names[k], tx->push[k]);
    printf(",\"tx_copies\":%.6g,\"tx_copy_issue_s\":%.6g,\"tx_copy_sync_s\":%.6g", tx->copies,
           tx->issue_s, tx->sync_s);
    printf(",\"rx_buckets\":%.6g", rx->buckets);
    for (int k = 0; k < GP_RECEIVER; k++)
      printf(",\"rx_%s_s\":%.6g", gp_rx_names[k], rx->rx[k]);
    printf(",\"rx_copies\":%.6g,\"rx_copy_issue_s\":%.6g,\"rx_copy_sync_s\":%.6g}\n", rx->copies,
           rx->issue_s, rx->sync_s);
  } else {
    printf("%-16s %s, ms per push (mean %.3f, median %.3f): sender pack %.3f (%.0f copies: issue "
           "%.3f, sync %.3f), slot wait %.3f, read wait %.3f, notify %.3f, commit %.3f; receiver "
           "(%.0f buckets) wait %.3f, copy %.3f (%.0f copies: issue %.3f, sync %.3f), ack %.3f\n",
           label, impl, mean * 1e3, median * 1e3, tx->push[GP_PACK] * 1e3, tx->copies,
           tx->issue_s * 1e3, tx->sync_s * 1e3, tx->push[GP_SLOT_WAIT] * 1e3,
           tx->push[GP_READ_WAIT] * 1e3, tx->push[GP_NOTIFY] * 1e3, tx->push[GP_COMMIT] * 1e3,
           rx->buckets, rx->rx[GP_RX_WAIT] * 1e3, rx->rx[GP_RX_COPY] * 1e3, rx->copies,
           rx->issue_s * 1e3, rx->sync_s * 1e3, rx->rx[GP_RX_ACK] * 1e3);
  }
  fflush(stdout);
}

/* The receiver's readings around its timed versions, taken as versions 1 and the last commit, on
 * its service thread (the next version's buckets are read after the callback returns): a
 * reading on the caller's thread after wait() could come late, after the later pushes. */
typedef struct rx_window {
  ferry_ctx *ctx;
  uint64_t last_version;
  gphases first, last;
  int done; /* atomic: last is taken (the callback runs after wait() saw the commit) */
} rx_window;

static void window_mark(ferry_refit_receiver *r, uint64_t version, int status, const char *why,
                        void *arg) {
  (void)r, (void)why;
  rx_window *w = arg;
  if (status == 0 && version == 1)
    w->first = bench_gpu_phases(w->ctx);
  if (status == 0 && version == w->last_version) {
    w->last = bench_gpu_phases(w->ctx);
    __atomic_store_n(&w->done, 1, __ATOMIC_RELEASE);
  }
}

/* The receiver process: binds every tensor into device memory of its own (alias: views the
 * sender's device buffer instead), waits for versions 1..versions, checks each tensor's bytes and
 * writes 'v' (or 'x') on fd, then its phases per push after the first (a gphases), then stays
 * attached until the trainer stops it. */
static int gpu_receiver(const char *address, int fd, uint64_t versions, bool alias) {
  ferry_ctx_opts o = {.size = sizeof o, .name = "bench-gpu-engine"};
  ferry_ctx *ctx = NULL;
  ferry_refit_receiver *r = NULL;
  int rc = ferry_ctx_open(&o, &ctx);
  if (rc == 0)
    rc = ferry_refit_receiver_open(ctx, address, -1, &r);
  size_t n = rc == 0 ? ferry_refit_tensor_count(r) : 0;
  uint64_t total = 0, *at = calloc(n + 1, sizeof *at);
  if (!at)
    return CLI_FAIL;
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const char *name;
    ferry_tensor_desc d;
    uint64_t len = 0;
    rc = ferry_refit_tensor_info(r, i, &name, &d);
    if (rc == 0)
      rc = ferry_tensor_nbytes(&d, &len);
    at[i] = total;
    total += len;
  }
  at[n] = total;
  uint8_t *mem = rc == 0 && !alias ? dev_alloc(total, &rc) : NULL;
  if (rc == 0 && alias)
    rc = ferry_refit_bind_alias(r);
  for (size_t i = 0; rc == 0 && !alias && i < n; i++) {
    const char *name;
    ferry_tensor_desc d;
    rc = ferry_refit_tensor_info(r, i, &name, &d);
    if (rc == 0)
      rc = ferry_refit_bind(r, name, mem + at[i], &d);
  }
  /* the readings' callback is in place before the trainer is told to push: a commit before it
   * would go unread (on a loaded machine every version could, leaving the breakdown all zero) */
  rx_window w = {.ctx = ctx, .last_version = versions};
  if (rc == 0)
    ferry_refit_on_commit(r, window_mark, &w);
  char ch = 'r';
  if (rc == 0 && write(fd, &ch, 1) != 1)
    rc = FERRY_ESYS;
  for (uint64_t v = 1; rc == 0 && v <= versions; v++)
    rc = ferry_refit_wait(r, v, 600000, NULL);
  for (int i = 0; rc == 0 && i < 100000 && !__atomic_load_n(&w.done, __ATOMIC_ACQUIRE); i++)
    usleep(100); /* 10 s at most */
  if (rc != 0)
    fprintf(stderr, "ferry bench gpu: receiver: %s\n", ferry_last_error());
  ch = rc == 0 ? 'v' : 'x';
  for (size_t i = 0; ch == 'v' && i < n; i++) {
    const char *name;
    ferry_tensor_desc d;
    void *view = mem + at[i];
    if (alias &&
        (ferry_refit_tensor_info(r, i, &name, &d) != 0 || ferry_refit_view(r, name, &view) != 0 ||
         ferry_mem_where(view, NULL) != FERRY_MEM_CUDA))
      ch = 'x';
    else if (!dev_holds(view, at[i + 1] - at[i], (uint8_t)(i + 1)))
      ch = 'x';
  }
  gphases per = bench_gpu_phases_per(&w.first, &w.last, (int)versions - 1);
  if (write(fd, &ch, 1) != 1 || bench_write_all(fd, &per, sizeof per) != 0)
    rc = FERRY_ESYS;
  /* Stay attached until the trainer stops this process (SIGTERM): its last push returns once
   * this receiver's commit reached it, which may be after wait() returned here. */
  if (r && rc == 0)
    ferry_refit_wait(r, versions + 1, 600000, NULL);
  ferry_refit_receiver_close(r);
  if (mem)
    ferry_cuda_free(mem);
  ferry_ctx_close(ctx);
  free(at);
  return rc == 0 && ch == 'v' ? CLI_OK : CLI_FAIL;
}

static pid_t spawn(int *from, const char *role, const char *a, const char *b) {
  int p[2];
  if (pipe(p) != 0)
    return -1;
  char fd[16];
  snprintf(fd, sizeof fd, "%d", p[1]);
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    execl(self_path, "ferry", "bench", "gpu", role, a, fd, b, (char *)NULL);
    _exit(127);
  }
  close(p[1]);
  *from = p[0];
  return pid;
}

/* Pushes reps + 1 versions of m (device memory at src) to one receiver process; the first push
 * (which maps the buckets and faults pages) is not timed. *tx and *rx: the sender's and the
 * receiver's phases per timed push. */
static int time_refit(const gmodel *m, uint8_t *src, int reps, bool alias, uint64_t bucket,
                      bench_samples *b, gphases *tx, gphases *rx) {
  ferry_ctx_opts co = {.size = sizeof co, .name = "bench-gpu-trainer"};
  ferry_refit_opts so = {
      .size = sizeof so, .alias = alias, .device_buckets = !alias, .bucket_bytes = bucket};
  ferry_refit_push_opts po = {.size = sizeof po, .timeout_ms = -1};
  ferry_ctx *ctx = NULL;
  ferry_refit_sender *s = NULL;
  int rc = ferry_ctx_open(&co, &ctx);
  if (rc == 0)
    rc = ferry_refit_sender_open(ctx, "bench-gpu", &so, &s);
  for (size_t i = 0; rc == 0 && i < m->n; i++)
    rc = ferry_refit_declare(s, m->name[i], &m->desc[i], src + m->off[i], FERRY_DTYPE_INVALID);
  if (rc == 0)
    rc = ferry_refit_seal(s);
  int from = -1;
  pid_t pid = -1;
  char versions[24], ch = 0;
  snprintf(versions, sizeof versions, "%d", reps + 1);
  const char *role = alias ? "--alias-receiver" : "--receiver";
  if (rc == 0 && ((pid = spawn(&from, role, ferry_ctx_address(ctx), versions)) < 0 ||
                  read(from, &ch, 1) != 1 || ch != 'r'))
    rc = FERRY_ECONNECT;
  while (rc == 0 && ferry_refit_receivers(s) < 1)
    usleep(1000);
  gphases first = {0};
  for (int v = 1; rc == 0 && v <= reps + 1; v++) {
    double t = bench_now();
    rc = ferry_refit_push(s, (uint64_t)v, &po);
    if (v > 1)
      bench_add(b, bench_now() - t);
    else
      first = bench_gpu_phases(ctx);
  }
  if (rc == 0) {
    gphases last = bench_gpu_phases(ctx);
    *tx = bench_gpu_phases_per(&first, &last, reps);
  }
  if (rc != 0)
    cli_fail("bench gpu", rc, "refit push");
  else if (read(from, &ch, 1) != 1 || ch != 'v' || bench_read_all(from, rx, sizeof *rx) != 0) {
    rc = FERRY_ECHECKSUM;
    cli_fail("bench gpu", rc, "refit: the receiver's device tensors do not hold what was pushed");
  }
  if (pid > 0) { /* after the last push returned: nothing is under way */
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
  }
  if (from >= 0)
    close(from);
  ferry_refit_sender_close(s);
  ferry_ctx_close(ctx);
  return rc;
}

/* One copying (or alias) variant of the refit row: its timed row, its ratio to the device copy
 * and where its pushes' time went. `setting` (NAME=VALUE, or NULL) is set in this process, the
 * sender's, for the variant only. */
typedef struct refit_variant {
  const char *impl;
  bool alias;
  uint64_t bucket; /* 0: the default (FERRY_REFIT_BUFFER_BYTES) */
  const char *setting;
} refit_variant;

static int run_variant(const bench_opts *o, const char *label, const gmodel *m, uint8_t *src,
                       int reps, const refit_variant *v, bench_samples *copy) {
  bench_samples b = {0};
  gphases tx = {0}, rx = {0};
  char name[64] = "";
  if (v->setting) {
    snprintf(name, sizeof name, "%.*s", (int)strcspn(v->setting, "="), v->setting);
    setenv(name, v->setting + strlen(name) + 1, 1);
  }
  int rc = time_refit(m, src, reps, v->alias, v->bucket, &b, &tx, &rx);
  if (v->setting)
    unsetenv(name);
  if (rc == 0) {
    bench_row(o, "gpu", label, v->impl, m->bytes, &b, false);
    char what[128], bsz[16];
    if (v->bucket)
      snprintf(what, sizeof what, "copying refit, %s buckets / d2d copy",
               bench_size_name(v->bucket, bsz, sizeof bsz));
    else if (v->setting)
      snprintf(what, sizeof what, "copying refit, %s / d2d copy", v->setting);
    else
      snprintf(what, sizeof what, "copying refit / d2d copy");
    if (!v->alias)
      goal_row(o, label, what, bench_median(&b) / bench_median(copy), 1.2);
    bench_gpu_breakdown(o, label, v->impl, &b, &tx, &rx);
  }
  bench_free(&b);
  return rc;
}

/* The same bytes copied one tensor at a time, each copy waited for, in this one process: what
 * one pass of the refit's copies costs alone (a push makes two such passes, one per process). */
static int time_pieces(uint8_t *dst, const uint8_t *src, const gmodel *m, int reps,
                       bench_samples *b) {
  for (int i = 0; i <= reps; i++) {
    double t = bench_now();
    for (size_t k = 0; k < m->n; k++) {
      int rc = ferry_mem_copy(dst + m->off[k], src + m->off[k], (size_t)m->len[k]);
      if (rc != 0)
        return rc;
    }
    if (i > 0)
      bench_add(b, bench_now() - t);
  }
  return 0;
}

static int run_refit(const bench_opts *o, uint64_t bytes, int reps) {
  gmodel m;
  int rc = gmodel_make(&m, bytes);
  char label[32], sz[16];
  snprintf(label, sizeof label, "refit-colo-%s", bench_size_name(m.bytes, sz, sizeof sz));
  uint8_t *src = rc == 0 ? dev_alloc(m.bytes, &rc) : NULL;
  uint8_t *dst = rc == 0 ? dev_alloc(m.bytes, &rc) : NULL;
  for (size_t i = 0; rc == 0 && i < m.n; i++)
    rc = dev_fill(src + m.off[i], m.len[i], (uint8_t)(i + 1));
  bench_samples copy = {0}, pieces = {0};
  if (rc == 0)
    rc = time_d2d(dst, src, m.bytes, reps, &copy);
  if (rc == 0)
    rc = time_pieces(dst, src, &m, reps, &pieces);
  if (rc != 0)
    cli_fail("bench gpu", rc, "refit: device memory");
  if (dst)
    ferry_cuda_free(dst); /* the receiver's copy needs the room */
  if (rc == 0) {
    bench_row(o, "gpu", label, "d2d-copy", m.bytes, &copy, true);
    bench_row(o, "gpu", label, "d2d-copy-by-tensor", m.bytes, &pieces, false);
  }
  bench_free(&pieces);
  /* the default buckets (FERRY_REFIT_BUFFER_BYTES, 64 MiB, sized for host memory); buckets of
   * 1/32 and 1/8 of the model (256 MiB and 1 GiB of 8): each bucket costs a round trip (a
   * message, stream synchronisations, the receiver's acknowledgement) beside its two copies; and
   * the experiments of issue 37 at the default buckets: a slot per bucket (the sender never waits
   * for a read), and no overlap (the sender packs a bucket only once the receiver read the one
   * before: the two processes never copy on the GPU at once, which time-slices them); and the
   * sender's copies of a bucket queued on one stream, waited for once (FERRY_CUDA_PACK_ASYNC) */
  char impl[2][64], bsz[16];
  refit_variant vs[7] = {{.impl = "ferry-copying"}};
  int nv = 1;
  for (uint64_t part = 32; part >= 8; part /= 4, nv++) {
    uint64_t bucket = (m.bytes / part + (1u << 20) - 1) & ~(uint64_t)((1u << 20) - 1);
    snprintf(impl[nv - 1], sizeof impl[0], "ferry-copying-%s-buckets",
             bench_size_name(bucket, bsz, sizeof bsz));
    vs[nv] = (refit_variant){.impl = impl[nv - 1], .bucket = bucket};
  }
  vs[nv++] =
      (refit_variant){.impl = "ferry-copying-whole", .setting = "FERRY_REFIT_DEVICE_WHOLE=1"};
  vs[nv++] = (refit_variant){.impl = "ferry-copying-serial", .setting = "FERRY_REFIT_NO_OVERLAP=1"};
  vs[nv++] =
      (refit_variant){.impl = "ferry-copying-pack-async", .setting = "FERRY_CUDA_PACK_ASYNC=1"};
  vs[nv++] = (refit_variant){.impl = "ferry-alias", .alias = true};
  for (int i = 0; rc == 0 && i < nv; i++)
    rc = run_variant(o, label, &m, src, reps, &vs[i], &copy);
  if (src)
    ferry_cuda_free(src);
  bench_free(&copy);
  gmodel_free(&m);
  return rc;
}

/* ---- (b) routing: put from device memory in one process, got into device memory here ---- */

static const ferry_tensor_desc routing_desc = {
    .dtype = FERRY_DTYPE_I32, .ndim = 3, .shape = {ROUTING_LAYERS, ROUTING_TOKENS, ROUTING_TOPK}};

/* The producer process: for each 'p' on `down` fills its device buffer with the next value (not
 * timed), puts it as "routing" and writes the put's seconds (a double) on `up`. Its store has a
 * device pool of devpool bytes (0: none; ferry_store_opts.device_pool_bytes). */
static int gpu_producer(const char *url, int up, int down, uint64_t devpool) {
  ferry_ctx_opts co = {.size = sizeof co, .name = "bench-gpu-producer"};
  ferry_store_opts so = {.size = sizeof so,
                         .directory = url,
                         .capacity = 4 * ROUTING_BYTES,
                         .device_pool_bytes = devpool};
  ferry_ctx *ctx = NULL;
  ferry_store *s = NULL;
  int rc = ferry_ctx_open(&co, &ctx);
  if (rc == 0)
    rc = ferry_store_open(ctx, &so, &s);
  uint8_t *mem = rc == 0 ? dev_alloc(ROUTING_BYTES, &rc) : NULL;
  char ch;
  for (uint8_t v = 1; rc == 0 && read(down, &ch, 1) == 1 && ch == 'p'; v++) {
    rc = dev_fill(mem, ROUTING_BYTES, v);
    double t = bench_now();
    if (rc == 0)
      rc = ferry_store_put(s, "routing", &routing_desc, mem, 0, -1);
    t = bench_now() - t;
    if (rc == 0 && bench_write_all(up, &t, sizeof t) != 0)
      rc = FERRY_ESYS;
  }
  if (rc != 0)
    fprintf(stderr, "ferry bench gpu: producer: %s\n", ferry_last_error());
  ferry_store_close(s);
  if (mem)
    ferry_cuda_free(mem);
  ferry_ctx_close(ctx);
  return rc == 0 ? CLI_OK : CLI_FAIL;
}

/* "ferry://HOST:PORT" of this ctx's tcp listener (where its hosted directory answers). */
static int directory_url(ferry_ctx *ctx, char *out, size_t len) {
  const char *tcp = strstr(ferry_ctx_address(ctx), "tcp://");
  if (!tcp)
    return FERRY_ENOTSUP;
  size_t n = strcspn(tcp + 6, ",");
  snprintf(out, len, "ferry://%.*s", (int)n, tcp + 6);
  return 0;
}

/* The device pool of the producer's rows that use one: the version being put, the one it
 * replaces (lingering for gets under way), and room. */
#define ROUTING_DEVPOOL (4 * ROUTING_BYTES)

/* reps puts by a producer process whose store has a device pool of devpool bytes (0: none), each
 * got into dst here. */
static int time_routing(int reps, uint8_t *dst, uint64_t devpool, bench_samples *put,
                        bench_samples *get, bench_samples *both) {
  ferry_ctx_opts co = {
      .size = sizeof co, .name = "bench-gpu-consumer", .tcp_listen = "127.0.0.1:0"};
  ferry_store_opts so = {
      .size = sizeof so, .capacity = 1 << 20, .flags = FERRY_STORE_HOST_DIRECTORY};
  ferry_ctx *ctx = NULL;
  ferry_store *s = NULL;
  char url[128];
  int rc = ferry_ctx_open(&co, &ctx);
  if (rc == 0)
    rc = ferry_store_open(ctx, &so, &s);
  if (rc == 0)
    rc = directory_url(ctx, url, sizeof url);
  int up[2] = {-1, -1}, down[2] = {-1, -1};
  pid_t pid = -1;
  if (rc == 0 && (pipe(up) != 0 || pipe(down) != 0))
    rc = FERRY_ESYS;
  if (rc == 0) {
    char a[16], b[16], pool[24];
    snprintf(a, sizeof a, "%d", up[1]);
    snprintf(b, sizeof b, "%d", down[0]);
    snprintf(pool, sizeof pool, "%llu", (unsigned long long)devpool);
    fflush(NULL);
    pid = fork();
    if (pid == 0) {
      close(up[0]), close(down[1]);
      execl(self_path, "ferry", "bench", "gpu", "--producer", url, a, b, pool, (char *)NULL);
      _exit(127);
    }
    close(up[1]), close(down[0]);
    up[1] = down[0] = -1;
  }
  for (int i = 0; rc == 0 && i <= reps; i++) {
    double tp = 0, tg;
    char ch = 'p';
    if (bench_write_all(down[1], &ch, 1) != 0 || bench_read_all(up[0], &tp, sizeof tp) != 0) {
      rc = FERRY_EPEER;
      break;
    }
    tg = bench_now();
    rc = ferry_store_get(s, "routing", &routing_desc, dst, ROUTING_BYTES, NULL, -1);
    tg = bench_now() - tg;
    if (rc == 0 && !dev_holds(dst, ROUTING_BYTES, (uint8_t)(i + 1)))
      rc = FERRY_EPEER;
    if (rc == 0 && i > 0) { /* the first get maps the producer's pool */
      bench_add(put, tp);
      bench_add(get, tg);
      bench_add(both, tp + tg);
    }
  }
  if (rc != 0)
    cli_fail("bench gpu", rc,
             rc == FERRY_EPEER ? "routing: the producer failed, or the device "
                                 "buffer does not hold what it put"
                               : "routing");
  if (down[1] >= 0)
    close(down[1]); /* the producer's end of input: it stops */
  if (pid > 0)
    waitpid(pid, NULL, 0);
  if (up[0] >= 0)
    close(up[0]);
  ferry_store_close(s);
  ferry_ctx_close(ctx);
  return rc;
}

static int run_routing(const bench_opts *o, int reps) {
  int rc = 0;
  uint8_t *src = dev_alloc(ROUTING_BYTES, &rc);
  uint8_t *dst = rc == 0 ? dev_alloc(ROUTING_BYTES, &rc) : NULL;
  bench_samples copy = {0}, put = {0}, get = {0}, both = {0};
  bench_samples dput = {0}, dget = {0}, dboth = {0}; /* the producer with a device pool */
  if (rc == 0)
    rc = dev_fill(src, ROUTING_BYTES, 0x5a);
  if (rc == 0)
    rc = time_d2d(dst, src, ROUTING_BYTES, reps, &copy);
  if (rc != 0)
    cli_fail("bench gpu", rc, "routing: device memory");
  if (rc == 0)
    rc = time_routing(reps, dst, 0, &put, &get, &both);
  if (rc == 0)
    rc = time_routing(reps, dst, ROUTING_DEVPOOL, &dput, &dget, &dboth);
  if (rc == 0) {
    const char *c = "routing-11MiB";
    bench_row(o, "gpu", c, "d2d-copy", ROUTING_BYTES, &copy, true);
    bench_row(o, "gpu", c, "ferry-put", ROUTING_BYTES, &put, false);
    bench_row(o, "gpu", c, "ferry-get", ROUTING_BYTES, &get, false);
    bench_row(o, "gpu", c, "ferry-put+get", ROUTING_BYTES, &both, false);
    bench_row(o, "gpu", c, "ferry-put(devpool)", ROUTING_BYTES, &dput, false);
    bench_row(o, "gpu", c, "ferry-get(devpool)", ROUTING_BYTES, &dget, false);
    bench_row(o, "gpu", c, "ferry-put+get(devpool)", ROUTING_BYTES, &dboth, false);
    goal_row(o, c, "ferry-get(devpool)", bench_median(&dget) / bench_median(&copy), 1.3);
  }
  if (src)
    ferry_cuda_free(src);
  if (dst)
    ferry_cuda_free(dst);
  bench_free(&copy), bench_free(&put), bench_free(&get), bench_free(&both);
  bench_free(&dput), bench_free(&dget), bench_free(&dboth);
  return rc;
}

/* ---- (c) staged device -> host -> device ---- */

/* Host memory of n bytes, pinned (fr_cuda_pin): what ferry's staging copies through. */
static void *pinned_alloc(uint64_t n, int *rc) {
  void *p = mmap(NULL, (size_t)n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    *rc = FERRY_ENOMEM;
    return NULL;
  }
  memset(p, 0, (size_t)n); /* resident before it is pinned, as a long-lived buffer is */
  if ((*rc = fr_cuda_pin(0, p, (size_t)n)) != 0) { /* the bench's buffers are on device 0 */
    munmap(p, (size_t)n);
    return NULL;
  }
  return p;
}

static void pinned_free(void *p, uint64_t n) {
  if (p) {
    fr_cuda_unpin(0, p);
    munmap(p, (size_t)n);
  }
}

static int staged_copy(uint8_t *dst, const uint8_t *src, uint64_t n, uint8_t *bounce,
                       uint64_t chunk) {
  int rc = 0;
  for (uint64_t at = 0, k = 0; rc == 0 && at < n; at += chunk, k ^= 1) {
    size_t len = (size_t)(n - at < chunk ? n - at : chunk);
    rc = ferry_mem_copy(bounce + k * chunk, src + at, len);
    if (rc == 0)
      rc = ferry_mem_copy(dst + at, bounce + k * chunk, len);
  }
  return rc;
}

static int run_staged(const bench_opts *o, uint64_t bytes, uint64_t chunk, int reps) {
  int rc = 0;
  uint8_t *src = dev_alloc(bytes, &rc);
  uint8_t *dst = rc == 0 ? dev_alloc(bytes, &rc) : NULL;
  uint8_t *host = rc == 0 ? pinned_alloc(bytes, &rc) : NULL;
  uint8_t *bounce = rc == 0 ? pinned_alloc(2 * chunk, &rc) : NULL;
  bench_samples whole = {0}, staged = {0};
  if (rc == 0)
    rc = dev_fill(src, bytes, 0xa5);
  for (int i = 0; rc == 0 && i <= reps; i++) {
    double t = bench_now();
    rc = ferry_mem_copy(host, src, (size_t)bytes);
    if (rc == 0)
      rc = ferry_mem_copy(dst, host, (size_t)bytes);
    if (i > 0)
      bench_add(&whole, bench_now() - t);
  }
  if (rc == 0)
    rc = dev_fill(dst, bytes, 0);
  for (int i = 0; rc == 0 && i <= reps; i++) {
    double t = bench_now();
    rc = staged_copy(dst, src, bytes, bounce, chunk);
    if (i > 0)
      bench_add(&staged, bench_now() - t);
  }
  if (rc == 0 && !dev_holds(dst, bytes, 0xa5))
    rc = FERRY_ECHECKSUM;
  if (rc != 0)
    cli_fail("bench gpu", rc, "staged copies");
  if (rc == 0) {
    char label[32], sz[16], csz[16];
    snprintf(label, sizeof label, "staged-%s", bench_size_name(bytes, sz, sizeof sz));
    bench_row(o, "gpu", label, "pinned-d2h+h2d", bytes, &whole, true);
    bench_row(o, "gpu", label, "ferry-staged", bytes, &staged, false);
    if (!o->json)
      printf("%-16s (ferry-staged: through two pinned %s chunks)\n", label,
             bench_size_name(chunk, csz, sizeof csz));
  }
  pinned_free(bounce, 2 * chunk);
  pinned_free(host, bytes);
  if (src)
    ferry_cuda_free(src);
  if (dst)
    ferry_cuda_free(dst);
  bench_free(&whole), bench_free(&staged);
  return rc;
}

/* ---- the mode ---- */

int bench_gpu(int argc, char **argv) {
  if (argc == 5 && (strcmp(argv[1], "--receiver") == 0 || strcmp(argv[1], "--alias-receiver") == 0))
    return gpu_receiver(argv[2], atoi(argv[3]), strtoull(argv[4], NULL, 10),
                        strcmp(argv[1], "--alias-receiver") == 0);
  if (argc == 6 && strcmp(argv[1], "--producer") == 0)
    return gpu_producer(argv[2], atoi(argv[3]), atoi(argv[4]), strtoull(argv[5], NULL, 10));
  if (argc > 1 && strcmp(argv[1], "--group-rank") == 0)
    return bench_gpu_group_rank(argc, argv);
  bool quick = false;
  const char *only = NULL;
  uint64_t refit_bytes = 0, staged_bytes = 0; /* 0: by the device's memory */
  const cli_opt extra[] = {{"quick", CLI_ARG_FLAG, &quick, 0, 0},
                           {"refit-bytes", CLI_ARG_SIZE, &refit_bytes, TENSOR_COLS * 2, 0},
                           {"staged-bytes", CLI_ARG_SIZE, &staged_bytes, 1, 0},
                           {"only", CLI_ARG_STR, &only, 0, 0},
                           {0}};
  bench_opts o = {0};
  if (bench_parse_with(argc, argv, &o, gpu_usage, extra) < 0)
    return CLI_USAGE;
  if (only && strcmp(only, "refit") != 0 && strcmp(only, "routing") != 0 &&
      strcmp(only, "staged") != 0 && strcmp(only, "group") != 0) {
    fprintf(stderr, "ferry bench gpu: --only '%s': expected refit, routing, staged or group\n",
            only);
    return CLI_USAGE;
  }
  ssize_t len = readlink("/proc/self/exe", self_path, sizeof self_path - 1);
  if (len <= 0)
    return cli_fail("bench gpu", FERRY_ESYS, "cannot find this program's path");
  self_path[len] = 0;
  signal(SIGPIPE, SIG_IGN);
  ferry_cuda_info ci = {.size = sizeof ci};
  ferry_cuda_info_get(&ci);
  uint64_t total = 0;
  char name[128] = "";
  if (ci.found && ci.devices > 0 && ferry_cuda_device(0, name, sizeof name, &total) != 0)
    ci.found = 0, snprintf(ci.detail, sizeof ci.detail, "%s", ferry_last_error());
  if (!ci.found || ci.devices < 1) {
    const char *why = ci.found ? "no device" : ci.detail;
    if (o.json) {
      char esc[2 * sizeof ci.detail];
      size_t k = 0;
      for (const char *c = why; *c && k + 2 < sizeof esc; c++) { /* a JSON string: \ and " */
        if (*c == '"' || *c == '\\')
          esc[k++] = '\\';
        esc[k++] = (unsigned char)*c < 0x20 ? ' ' : *c;
      }
      esc[k] = 0;
      printf("{\"bench\":\"gpu\",\"skipped\":true,\"detail\":\"no CUDA driver (%s)\"}\n", esc);
    } else
      printf("ferry bench gpu: no CUDA driver (%s)\n", why);
    return CLI_OK;
  }
  int reps = o.reps ? o.reps : quick ? 3 : 5;
  if (!refit_bytes)
    refit_bytes = quick ? 4ull << 20 : total / 8 < (8ull << 30) ? total / 8 : 8ull << 30;
  if (!staged_bytes)
    staged_bytes = quick ? 8ull << 20 : total / 16 < (1ull << 30) ? total / 16 : 1ull << 30;
  uint64_t chunk = quick ? 1ull << 20 : STAGE_CHUNK;
  if (!o.json)
    printf("cuda:0 %s, %.1f GiB, driver %d.%d (%s)\n", name, (double)total / (1 << 30),
           ci.driver_version / 1000, ci.driver_version % 1000 / 10, ci.library);
  bench_header(&o, "ferry bench gpu (CUDA memory on both sides; vs base = speed)");
  int rc = 0, r;
  if (!only || strcmp(only, "refit") == 0)
    rc = run_refit(&o, refit_bytes, reps);
  if (!only || strcmp(only, "routing") == 0) {
    r = run_routing(&o, o.reps ? o.reps : quick ? 3 : 20);
    rc = rc ? rc : r;
  }
  if (!only || strcmp(only, "staged") == 0) {
    r = run_staged(&o, staged_bytes, chunk, reps);
    rc = rc ? rc : r;
    r = bench_gpu_bounce(&o, staged_bytes, reps); /* bench_gpu_bounce.c */
    rc = rc ? rc : r;
  }
  if (!only || strcmp(only, "group") == 0) { /* through host memory: 2 GiB at most */
    r = bench_gpu_group(&o, self_path, refit_bytes < (2ull << 30) ? refit_bytes : 2ull << 30, reps);
    rc = rc ? rc : r;
  }
  return rc == 0 ? CLI_OK : CLI_FAIL;
}
