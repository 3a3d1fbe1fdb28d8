/*
 * `ferry bench gpu`'s refit group row (issue 37's row d: two sender ranks on one GPU's memory, as
 * the group path stages it), on one host without network namespaces: two trainer ranks, each a
 * process holding every other tensor of a bf16 state dict in device memory of device 0, push as
 * one sharded sender (ferry_refit_opts rank/world, published in a directory this process hosts on
 * loopback) to a group receiver here that binds every tensor whole in device memory of its own.
 * A group's receiver reads shards, so its buckets are hashed and come through host memory: each
 * rank packs device to host into pinned buckets (`ferry-group`) or device to device into CUDA
 * buckets that are hashed through pinned host memory (`ferry-group-device-buckets`), and the
 * receiver copies each run host to device. Each row is timed from telling both ranks to push to
 * both pushes having returned (every byte committed here), against one device-to-device copy of
 * the same bytes in the same run, with a breakdown line as the colocated rows have (tx_*: the two
 * ranks' means). The bytes are checked at the end of each row.
 */
#include "bench_gpu.h"
#include "cli/cli.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define GG_RANKS 2
#define GG_COLS 4096                /* bf16 [rows, 4096]: 8 KiB a row */
#define GG_TENSOR_MAX (64ull << 20) /* a large layer's matrix */
#define GG_WAIT_MS 60000            /* a push of 2 GiB through host memory takes about a second */

/* The state dict both ranks and the checks agree on: n tensors of `each` bytes (the last one
 * less), tensor i held by rank i % GG_RANKS and filled with the byte i + 1. */
static uint64_t tensor_bytes(uint64_t bytes, uint64_t *each) {
  const uint64_t row = GG_COLS * 2;
  uint64_t e = bytes / 64 / row * row;
  *each = e < row ? row : e > GG_TENSOR_MAX ? GG_TENSOR_MAX : e;
  return bytes / row * row;
}

static ferry_tensor_desc tensor_desc(uint64_t len) {
  return (ferry_tensor_desc){
      .dtype = FERRY_DTYPE_BF16, .ndim = 2, .shape = {len / (GG_COLS * 2), GG_COLS}};
}

/* ---- a rank's process ---- */

/* What the run tells a rank ('n': wait for a receiver, 'p': push version v, 'q': quit, answered
 * with its phases per timed push) and what a rank answers (0 or a status). */
typedef struct gg_cmd {
  char op;
  uint64_t v;
} gg_cmd;

static int rank_serve(ferry_ctx *ctx, ferry_refit_sender *s, int up, int down) {
  gg_cmd c;
  ferry_refit_push_opts po = {.size = sizeof po, .timeout_ms = GG_WAIT_MS};
  gphases first = {0}, last = {0};
  int pushes = 0;
  while (bench_read_all(down, &c, sizeof c) == 0 && c.op != 'q') {
    int rc = 0;
    if (c.op == 'n')
      for (int i = 0; i < 60000 && ferry_refit_receivers(s) < 1; i++)
        usleep(1000);
    else if ((rc = ferry_refit_push(s, c.v, &po)) != 0)
      fprintf(stderr, "ferry bench gpu: rank push: %s\n", ferry_last_error());
    if (c.op == 'p' && ++pushes == 1) /* the first push (mapping, faults) is not timed */
      first = bench_gpu_phases(ctx);
    if (bench_write_all(up, &rc, sizeof rc) != 0)
      return FERRY_ESYS;
  }
  last = bench_gpu_phases(ctx);
  gphases per = bench_gpu_phases_per(&first, &last, pushes - 1);
  return bench_write_all(up, &per, sizeof per) == 0 ? 0 : FERRY_ESYS;
}

/* argv: gpu --group-rank DIRECTORY NAME RANK UP DOWN BYTES DEVICE_BUCKETS */
int bench_gpu_group_rank(int argc, char **argv) {
  if (argc != 9)
    return CLI_USAGE;
  setenv("FERRY_DIRECTORY", argv[2], 1);
  int rank = atoi(argv[4]), up = atoi(argv[5]), down = atoi(argv[6]);
  uint64_t each, bytes = tensor_bytes(strtoull(argv[7], NULL, 10), &each);
  char node[32];
  snprintf(node, sizeof node, "bench-gpu-rank-%d", rank);
  ferry_ctx_opts co = {.size = sizeof co, .name = node};
  ferry_refit_opts so = {.size = sizeof so,
                         .publish = 1,
                         .rank = rank,
                         .world = GG_RANKS,
                         .device_buckets = atoi(argv[8])};
  ferry_ctx *ctx = NULL;
  ferry_refit_sender *s = NULL;
  uint8_t *mem = NULL;
  int rc = ferry_ctx_open(&co, &ctx);
  if (rc == 0)
    rc = ferry_refit_sender_open(ctx, argv[3], &so, &s);
  if (rc == 0)
    mem = bench_gpu_alloc(bytes, &rc); /* its own tensors lie where they lie in the whole */
  for (uint64_t at = 0, i = 0; rc == 0 && at < bytes; at += each, i++) {
    uint64_t len = bytes - at < each ? bytes - at : each;
    char name[32];
    snprintf(name, sizeof name, "layers.%llu.weight", (unsigned long long)i);
    ferry_tensor_desc d = tensor_desc(len);
    if (i % GG_RANKS == (uint64_t)rank &&
        (rc = bench_gpu_fill(mem + at, len, (uint8_t)(i + 1))) == 0)
      rc = ferry_refit_declare(s, name, &d, mem + at, FERRY_DTYPE_INVALID);
  }
  if (rc == 0)
    rc = ferry_refit_seal(s);
  if (rc != 0)
    fprintf(stderr, "ferry bench gpu: rank %d: %s\n", rank, ferry_last_error());
  if (bench_write_all(up, &rc, sizeof rc) == 0 && rc == 0)
    rc = rank_serve(ctx, s, up, down);
  ferry_refit_sender_close(s);
  if (mem)
    ferry_cuda_free(mem);
  ferry_ctx_close(ctx);
  return rc == 0 ? CLI_OK : CLI_FAIL;
}

/* ---- the run ---- */

typedef struct gg_rank {
  pid_t pid;
  int to, from;
} gg_rank;

static int rank_spawn(gg_rank *k, const char *self, const char *url, const char *name, int rank,
                      uint64_t bytes, bool device_buckets) {
  int up[2], down[2];
  k->pid = -1, k->to = k->from = -1;
  if (pipe(up) != 0)
    return FERRY_ESYS;
  if (pipe(down) != 0) {
    close(up[0]), close(up[1]);
    return FERRY_ESYS;
  }
  char r[8], u[16], d[16], b[24];
  snprintf(r, sizeof r, "%d", rank);
  snprintf(u, sizeof u, "%d", up[1]);
  snprintf(d, sizeof d, "%d", down[0]);
  snprintf(b, sizeof b, "%llu", (unsigned long long)bytes);
  fflush(NULL);
  k->pid = fork();
  if (k->pid == 0) {
    close(up[0]), close(down[1]);
    execl(self, "ferry", "bench", "gpu", "--group-rank", url, name, r, u, d, b,
          device_buckets ? "1" : "0", (char *)NULL);
    _exit(127);
  }
  close(up[1]), close(down[0]);
  k->from = up[0], k->to = down[1];
  return k->pid > 0 ? 0 : FERRY_ESYS;
}

/* Tells every rank c and reads each one's answer: 0, or the first failure. */
static int ranks_do(gg_rank *k, char op, uint64_t v) {
  gg_cmd c = {op, v};
  int rc = 0, st;
  for (int i = 0; i < GG_RANKS; i++)
    if (bench_write_all(k[i].to, &c, sizeof c) != 0)
      rc = FERRY_EPEER;
  for (int i = 0; i < GG_RANKS; i++)
    if (bench_read_all(k[i].from, &st, sizeof st) != 0 || (st != 0 && rc == 0))
      rc = st ? st : FERRY_EPEER;
  return rc;
}

/* Stops the ranks; *tx: their phases per timed push, averaged. */
static void ranks_stop(gg_rank *k, gphases *tx) {
  gg_cmd c = {'q', 0};
  gphases per[GG_RANKS];
  memset(per, 0, sizeof per);
  double *sum = (double *)tx;
  for (int i = 0; i < GG_RANKS && k[i].pid > 0; i++) {
    if (bench_write_all(k[i].to, &c, sizeof c) != 0 ||
        bench_read_all(k[i].from, &per[i], sizeof per[i]) != 0)
      kill(k[i].pid, SIGTERM);
    for (size_t f = 0; f < sizeof *tx / sizeof(double); f++)
      sum[f] += ((double *)&per[i])[f] / GG_RANKS;
    close(k[i].to), close(k[i].from);
    waitpid(k[i].pid, NULL, 0);
    k[i].pid = -1;
  }
}

/* Opens the group (retrying while its ranks publish) and binds every tensor whole into one
 * allocation of device memory, each where the ranks' layout has it (layers.I.weight at I * each:
 * the group's manifest comes in its own order). */
static int receiver_bind(ferry_ctx *ctx, const char *name, ferry_refit_receiver **rx, uint8_t **mem,
                         uint64_t bytes, uint64_t each) {
  int rc = FERRY_ENOTFOUND;
  for (int tries = 0; tries < 300 && rc == FERRY_ENOTFOUND; tries++)
    if ((rc = ferry_refit_receiver_open(ctx, name, 30000, rx)) == FERRY_ENOTFOUND)
      usleep(100000);
  *mem = rc == 0 ? bench_gpu_alloc(bytes, &rc) : NULL;
  size_t n = rc == 0 ? ferry_refit_tensor_count(*rx) : 0;
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const char *tname;
    ferry_tensor_desc d;
    uint64_t len = 0;
    unsigned long long k = 0;
    rc = ferry_refit_tensor_info(*rx, i, &tname, &d);
    if (rc == 0)
      rc = ferry_tensor_nbytes(&d, &len);
    if (rc == 0 && (sscanf(tname, "layers.%llu.weight", &k) != 1 || k * each + len > bytes))
      rc = FERRY_ERANGE;
    if (rc == 0)
      rc = ferry_refit_bind(*rx, tname, *mem + k * each, &d);
  }
  if (rc == 0 && n != (bytes + each - 1) / each)
    rc = FERRY_EPROTO; /* a tensor of the ranks' missing from the group's manifest */
  return rc;
}

/* Whether tensor i (laid end to end, as the ranks made them) holds the byte i + 1. */
static bool received(const uint8_t *mem, uint64_t bytes, uint64_t each) {
  bool ok = true;
  for (uint64_t at = 0, i = 0; ok && at < bytes; at += each, i++)
    ok = bench_gpu_holds(mem + at, bytes - at < each ? bytes - at : each, (uint8_t)(i + 1));
  return ok;
}

/* One row: reps + 1 pushes (the first untimed) of both ranks to a group receiver here. */
static int group_series(const char *self, const char *url, const char *name, uint64_t bytes,
                        bool device_buckets, int reps, bench_samples *b, gphases *tx, gphases *rx) {
  uint64_t each;
  bytes = tensor_bytes(bytes, &each);
  gg_rank k[GG_RANKS] = {{-1, -1, -1}, {-1, -1, -1}};
  int rc = 0, st;
  for (int i = 0; rc == 0 && i < GG_RANKS; i++)
    rc = rank_spawn(&k[i], self, url, name, i, bytes, device_buckets);
  for (int i = 0; rc == 0 && i < GG_RANKS; i++) /* each declared and sealed, or why not */
    if (bench_read_all(k[i].from, &st, sizeof st) != 0 || st != 0)
      rc = st ? st : FERRY_EPEER;
  ferry_ctx_opts co = {.size = sizeof co, .name = "bench-gpu-group-engine"};
  ferry_ctx *ctx = NULL;
  ferry_refit_receiver *r = NULL;
  uint8_t *mem = NULL;
  if (rc == 0)
    rc = ferry_ctx_open(&co, &ctx);
  if (rc == 0)
    rc = receiver_bind(ctx, name, &r, &mem, bytes, each);
  if (rc == 0)
    rc = ranks_do(k, 'n', 0);
  gphases first = {0};
  for (int v = 1; rc == 0 && v <= reps + 1; v++) {
    double t = bench_now();
    rc = ranks_do(k, 'p', (uint64_t)v);
    if (rc == 0)
      rc = ferry_refit_wait(r, (uint64_t)v, GG_WAIT_MS, NULL);
    if (v > 1)
      bench_add(b, bench_now() - t);
    else
      first = bench_gpu_phases(ctx);
  }
  if (rc == 0) {
    gphases last = bench_gpu_phases(ctx);
    *rx = bench_gpu_phases_per(&first, &last, reps);
  }
  if (rc != 0)
    cli_fail("bench gpu", rc, "refit group");
  else if (!received(mem, bytes, each))
    rc = cli_fail("bench gpu", FERRY_ECHECKSUM,
                  "refit group: the receiver's device tensors do not hold what was pushed");
  ferry_refit_receiver_close(r); /* first: the ranks' stopping is no news to it */
  ranks_stop(k, tx);
  if (mem)
    ferry_cuda_free(mem);
  ferry_ctx_close(ctx);
  return rc;
}

int bench_gpu_group(const bench_opts *o, const char *self, uint64_t bytes, int reps) {
  uint64_t each;
  bytes = tensor_bytes(bytes, &each);
  char label[32], sz[16], url[128];
  snprintf(label, sizeof label, "refit-group-%s", bench_size_name(bytes, sz, sizeof sz));
  bench_samples copy = {0};
  int rc = 0;
  uint8_t *src = bench_gpu_alloc(bytes, &rc);
  uint8_t *dst = rc == 0 ? bench_gpu_alloc(bytes, &rc) : NULL;
  if (rc == 0)
    rc = bench_gpu_fill(src, bytes, 0x3c);
  if (rc == 0)
    rc = bench_gpu_d2d(dst, src, bytes, reps, &copy);
  if (src)
    ferry_cuda_free(src);
  if (dst)
    ferry_cuda_free(dst); /* the ranks and the receiver need the room */
  if (rc != 0)
    return cli_fail("bench gpu", rc, "refit group: device memory");
  bench_row(o, "gpu", label, "d2d-copy", bytes, &copy, true);
  ferry_ctx *dctx = NULL;
  ferry_store *dir = NULL;
  if ((rc = bench_dir_host("bench-gpu-dir", "127.0.0.1:0", &dctx, &dir, url, sizeof url)) != 0)
    cli_fail("bench gpu", rc, "refit group: the directory");
  const char *prior = getenv("FERRY_DIRECTORY");
  char *saved = prior ? strdup(prior) : NULL;
  setenv("FERRY_DIRECTORY", url, 1); /* where the receiver finds the ranks */
  for (int dev = 0; rc == 0 && dev < 2; dev++) {
    const char *impl = dev ? "ferry-group-device-buckets" : "ferry-group";
    char name[32];
    snprintf(name, sizeof name, "bench-gpu-group-%d-%d", (int)getpid(), dev);
    bench_samples b = {0};
    gphases tx = {0}, rx = {0};
    rc = group_series(self, url, name, bytes, dev == 1, reps, &b, &tx, &rx);
    if (rc == 0) {
      bench_row(o, "gpu", label, impl, bytes, &b, false);
      bench_gpu_breakdown(o, label, impl, &b, &tx, &rx);
    }
    bench_free(&b);
  }
  if (saved)
    setenv("FERRY_DIRECTORY", saved, 1);
  else
    unsetenv("FERRY_DIRECTORY");
  free(saved);
  if (dir)
    ferry_store_close(dir);
  ferry_ctx_close(dctx);
  bench_free(&copy);
  return rc;
}
