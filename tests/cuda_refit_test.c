/*
 * Refit with CUDA tensors (issue 18): a sender whose declared tensors are device memory (mixed
 * with host ones, some cast to bfloat16 or fp8 on the way), pushing to receivers that bind device
 * memory (mixed with host memory) in other processes, one over shm and one over tcp; several
 * versions land whole, the fp8 scale is the one of the device tensor's values at the seal, and a
 * corrupted bucket is still refused (the version never commits, the bytes say torn). In one
 * process: a chain over tcp and a late joiner's catch-up into device memory; an alias sender whose
 * device buffer goes unhashed while every reader is on this host, its checksums taken when a late
 * joiner over tcp first needs them (fr_refit_stat_staged_sums counts them), without the sender's
 * lock (a push that begins meanwhile returns; the sum is void), and a bucket changed after that
 * checksum refused; shards (a dim-1 slice
 * and a whole tensor) landing in device memory, and the bindings ferry refuses: device memory
 * shorter than the tensor, and device memory beside a flat buffer. Device bytes are only ever
 * filled and read through ferry_mem_copy, so the same file runs on a GPU with the real driver
 * (FERRY_TEST_CUDA=driver); the stand-in faults on any CPU access.
 */
// ferry-test: cuda
#include "testutil.h"

#include "refit/plan.h"
#include "refit/refit.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The model: where each tensor lives at the sender and at the receivers, and its cast. */
#define NT 6
static const struct spec {
  const char *name;
  ferry_dtype dtype;
  ferry_dtype send_as;
  uint32_t ndim;
  uint64_t shape[2];
  bool send_dev; /* device memory at the sender */
  bool recv_dev; /* device memory at the receivers */
} specs[NT] = {
    {"embed", FERRY_DTYPE_F32, FERRY_DTYPE_INVALID, 2, {7, 300}, true, true},
    {"q", FERRY_DTYPE_F32, FERRY_DTYPE_BF16, 2, {64, 96}, true, true},
    {"ids", FERRY_DTYPE_I64, FERRY_DTYPE_INVALID, 1, {500}, false, false},
    {"o", FERRY_DTYPE_F32, FERRY_DTYPE_F8E4M3, 2, {33, 129}, true, true},
    {"norm", FERRY_DTYPE_F32, FERRY_DTYPE_BF16, 1, {1000}, false, true},
    {"bias", FERRY_DTYPE_BF16, FERRY_DTYPE_INVALID, 1, {200}, true, false},
};

static ferry_tensor_desc desc_of(int i, bool wire) {
  ferry_tensor_desc d = {.dtype = specs[i].dtype, .ndim = specs[i].ndim};
  memcpy(d.shape, specs[i].shape, sizeof specs[i].shape);
  if (wire && specs[i].send_as != FERRY_DTYPE_INVALID)
    d.dtype = specs[i].send_as;
  return d;
}

static uint64_t bytes_of(int i, bool wire) {
  ferry_tensor_desc d = desc_of(i, wire);
  uint64_t n = 0;
  FR_OK(ferry_tensor_nbytes(&d, &n));
  return n;
}

static uint64_t count_of(int i) { return bytes_of(i, false) / ferry_dtype_size(specs[i].dtype); }

/* Tensor i's source bytes in version v (host memory, malloc'd). */
static void *values(int i, uint64_t v) {
  uint64_t n = count_of(i);
  void *out = malloc(bytes_of(i, false));
  float *f = malloc(n * sizeof *f);
  for (uint64_t k = 0; k < n; k++)
    f[k] = (float)((k * 7 + (uint64_t)i * 13 + v * 5) % 1000) / 8.0f - 60.0f;
  if (specs[i].dtype == FERRY_DTYPE_I64)
    for (uint64_t k = 0; k < n; k++)
      ((int64_t *)out)[k] = (int64_t)(v * 1000 + k);
  else
    FR_OK(fr_refit_cast(FERRY_DTYPE_F32, specs[i].dtype, 1.0f, f, out, n));
  free(f);
  return out;
}

/* The fp8 scale is fixed at the seal, from the values then (version 1's). */
static float seal_scale(int i) {
  if (specs[i].send_as != FERRY_DTYPE_F8E4M3)
    return 1.0f;
  void *x = values(i, 1);
  float s = fr_refit_fp8_scale(specs[i].dtype, x, count_of(i));
  free(x);
  return s;
}

/* What tensor i holds at a receiver once version v committed. */
static void *expected(int i, uint64_t v) {
  void *src = values(i, v), *out = malloc(bytes_of(i, true));
  ferry_dtype wire = desc_of(i, true).dtype;
  FR_OK(fr_refit_cast(specs[i].dtype, wire, seal_scale(i), src, out, count_of(i)));
  free(src);
  return out;
}

/* Memory for each tensor on one side: device tensors 0 and 1 share one allocation (tensor 1 at an
 * offset inside it), the others get their own; host tensors are malloc'd. */
typedef struct side {
  void *mem[NT];
  void *alloc[NT]; /* what to free */
} side;

static void side_alloc(side *s, bool sender, int device) {
  memset(s, 0, sizeof *s);
  uint64_t shared = bytes_of(0, !sender) + 4096 + bytes_of(1, !sender);
  for (int i = 0; i < NT; i++) {
    bool dev = sender ? specs[i].send_dev : specs[i].recv_dev;
    uint64_t n = bytes_of(i, !sender);
    if (!dev)
      s->mem[i] = s->alloc[i] = calloc(1, n);
    else if (i == 0)
      FR_OK(ferry_cuda_alloc(device, shared, &s->alloc[0]));
    else if (i != 1)
      FR_OK(ferry_cuda_alloc(device, n, &s->alloc[i]));
    if (dev && i != 1)
      s->mem[i] = s->alloc[i];
  }
  s->mem[1] = (uint8_t *)s->alloc[0] + bytes_of(0, !sender) + 4096;
  for (int i = 0; i < NT; i++) {
    int d = -2;
    bool dev = sender ? specs[i].send_dev : specs[i].recv_dev;
    assert_int_equal(ferry_mem_where(s->mem[i], &d), dev ? FERRY_MEM_CUDA : FERRY_MEM_HOST);
    assert_int_equal(d, dev ? device : -1);
  }
}

static void side_free(side *s, bool sender) {
  for (int i = 0; i < NT; i++) {
    bool dev = sender ? specs[i].send_dev : specs[i].recv_dev;
    if (s->alloc[i] && dev)
      FR_OK(ferry_cuda_free(s->alloc[i]));
    else
      free(s->alloc[i]);
  }
}

/* The sender's tensors take version v's values (device ones through ferry_mem_copy). */
static void sender_fill(side *s, uint64_t v) {
  for (int i = 0; i < NT; i++) {
    void *x = values(i, v);
    FR_OK(ferry_mem_copy(s->mem[i], x, bytes_of(i, false)));
    free(x);
  }
}

/* 0 when every bound tensor holds version v; else says which does not. */
static int receiver_check(ferry_refit_receiver *r, side *s, uint64_t v) {
  int bad = 0;
  for (int i = 0; i < NT; i++) {
    uint64_t n = bytes_of(i, true);
    void *want = expected(i, v), *got = malloc(n);
    float scale = 0;
    if (ferry_mem_copy(got, s->mem[i], n) != 0 || memcmp(got, want, n) != 0) {
      fprintf(stderr, "cuda_refit_test: tensor '%s' does not hold version %llu\n", specs[i].name,
              (unsigned long long)v);
      bad = 1;
    }
    if (ferry_refit_tensor_scale(r, (size_t)i, &scale) != 0 || scale != seal_scale(i)) {
      fprintf(stderr, "cuda_refit_test: tensor '%s' has scale %g, not %g\n", specs[i].name,
              (double)scale, (double)seal_scale(i));
      bad = 1;
    }
    free(want);
    free(got);
  }
  return bad;
}

static void bind_side(ferry_refit_receiver *r, side *s) {
  assert_int_equal(ferry_refit_tensor_count(r), NT);
  for (int i = 0; i < NT; i++) {
    ferry_tensor_desc d = desc_of(i, true);
    FR_OK(ferry_refit_bind(r, specs[i].name, s->mem[i], &d));
  }
}

static ferry_ctx *ctx_for(const char *name, const char *transports) {
  ferry_ctx_opts o = {.size = sizeof o, .name = name, .transports = transports};
  ferry_ctx *c;
  FR_OK(ferry_ctx_open(&o, &c));
  return c;
}

static ferry_refit_sender *sender_for(ferry_ctx *c, side *s) {
  ferry_refit_opts o = {.size = sizeof o, .bucket_bytes = 16384};
  ferry_refit_sender *snd;
  FR_OK(ferry_refit_sender_open(c, "trainer", &o, &snd));
  sender_fill(s, 1); /* the fp8 scale is taken from these, at the seal */
  for (int i = 0; i < NT; i++) {
    ferry_tensor_desc d = desc_of(i, false);
    FR_OK(ferry_refit_declare(snd, specs[i].name, &d, s->mem[i], specs[i].send_as));
  }
  FR_OK(ferry_refit_seal(snd));
  return snd;
}

static void await_receivers(ferry_refit_sender *s, size_t n) {
  for (int i = 0; i < 1000 && ferry_refit_receivers(s) != n; i++)
    usleep(10000);
  assert_int_equal(ferry_refit_receivers(s), n);
}

/* ---- a receiver in another process ---- */

/* Commands on the pipe: a version to check (it must commit), its negation (it must not: the
 * bytes say torn), 0 to end. Each is answered with one byte, 1 for as expected. */
static int receiver_child(const char *transports, const char *address, int cmd_fd, int rep_fd) {
  setenv("FERRY_TRANSPORTS", transports, 1); /* before the first ferry call reads settings */
  if (!tu_cuda_use())
    return 3;
  ferry_ctx *c = ctx_for(strcmp(transports, "tcp") == 0 ? "rollout-tcp" : "rollout-shm", NULL);
  ferry_refit_receiver *r;
  if (ferry_refit_receiver_open(c, address, 5000, &r) != 0) {
    fprintf(stderr, "cuda_refit_test child: %s\n", ferry_last_error());
    return 1;
  }
  side s;
  side_alloc(&s, false, 0);
  bind_side(r, &s);
  tu_pipe cmd = {cmd_fd, -1}, rep = {-1, rep_fd};
  uint8_t ok = 1;
  tu_pipe_put(&rep, &ok, 1);
  int64_t v;
  while (tu_pipe_get(&cmd, &v, sizeof v, 60000) == 0 && v != 0) {
    uint64_t have = 99;
    if (v > 0)
      ok = ferry_refit_wait(r, (uint64_t)v, 20000, NULL) == 0 && receiver_check(r, &s, v) == 0;
    else
      ok = ferry_refit_wait(r, (uint64_t)-v, 300, &have) == FERRY_ETIMEDOUT && have == 0 &&
           strstr(ferry_last_error(), "torn") != NULL;
    if (!ok)
      fprintf(stderr, "cuda_refit_test child (%s): version %lld: %s\n", transports, (long long)v,
              ferry_last_error());
    tu_pipe_put(&rep, &ok, 1);
  }
  ferry_refit_receiver_close(r);
  side_free(&s, false);
  ferry_ctx_close(c);
  return 0;
}

typedef struct child {
  pid_t pid;
  tu_pipe cmd, rep;
} child;

static void child_start(child *k, const char *transports, const char *address) {
  tu_pipe_open(&k->cmd);
  tu_pipe_open(&k->rep);
  char cfd[16], rfd[16];
  snprintf(cfd, sizeof cfd, "%d", k->cmd.rd);
  snprintf(rfd, sizeof rfd, "%d", k->rep.wr);
  k->pid = tu_spawn_exec("--receiver", transports, address, cfd, rfd, NULL);
  uint8_t ready = 0;
  assert_int_equal(tu_pipe_get(&k->rep, &ready, 1, 20000), 0);
  assert_int_equal(ready, 1);
}

static void child_expect(child *k, int64_t v) {
  tu_pipe_put(&k->cmd, &v, sizeof v);
  uint8_t ok = 0;
  assert_int_equal(tu_pipe_get(&k->rep, &ok, 1, 30000), 0);
  if (!ok)
    fail_msg("the receiver in process %d did not find version %lld as expected", (int)k->pid,
             (long long)v);
}

static void child_end(child *k) {
  int64_t end = 0;
  tu_pipe_put(&k->cmd, &end, sizeof end);
  assert_int_equal(tu_wait(k->pid), 0);
  tu_pipe_close(&k->cmd);
  tu_pipe_close(&k->rep);
}

static void flip_bucket_one(uint32_t bucket, uint8_t *bytes, uint64_t len) {
  if (bucket == 1)
    bytes[len / 2] ^= 0x10;
}

/* Whether a driver (the stand-in, or a GPU's) is loaded: the group setup asks once, first. */
static bool have_cuda;

static int group_setup(void **st) {
  (void)st;
  have_cuda = tu_cuda_use();
  return 0;
}

/* Device tensors on both sides, in three processes: one receiver over shm, one over tcp. */
static void test_processes(void **st) {
  (void)st;
  if (!have_cuda)
    skip();
  ferry_ctx *sc = ctx_for("trainer", "shm,tcp");
  side s;
  side_alloc(&s, true, 0);
  ferry_refit_sender *snd = sender_for(sc, &s);
  child shm, tcp;
  child_start(&shm, "shm", ferry_ctx_address(sc));
  child_start(&tcp, "tcp", ferry_ctx_address(sc));
  await_receivers(snd, 2);
  for (uint64_t v = 1; v <= 3; v++) {
    sender_fill(&s, v);
    FR_OK(ferry_refit_push(snd, v, NULL));
    child_expect(&shm, (int64_t)v);
    child_expect(&tcp, (int64_t)v);
  }
  /* a bucket changed after its checksum was taken: refused by both, version 4 never commits */
  sender_fill(&s, 4);
  fr_refit_test_corrupt = flip_bucket_one;
  assert_int_equal(ferry_refit_push(snd, 4, NULL), FERRY_ECHECKSUM);
  fr_refit_test_corrupt = NULL;
  assert_non_null(strstr(ferry_last_error(), "rollout-shm"));
  assert_non_null(strstr(ferry_last_error(), "rollout-tcp"));
  child_expect(&shm, -4);
  child_expect(&tcp, -4);
  sender_fill(&s, 5);
  FR_OK(ferry_refit_push(snd, 5, NULL));
  child_expect(&shm, 5);
  child_expect(&tcp, 5);
  child_end(&shm);
  child_end(&tcp);
  ferry_refit_sender_close(snd);
  side_free(&s, true);
  ferry_ctx_close(sc);
}

/* ---- alias mode over CUDA IPC ---- */

/* Every tensor on device 0, none cast: the sender's whole buffer is device memory. */
#define NA 3
static const struct aspec {
  const char *name;
  ferry_dtype dtype;
  uint64_t count;
} aspecs[NA] = {
    {"w", FERRY_DTYPE_F32, 3000}, {"b", FERRY_DTYPE_BF16, 777}, {"i", FERRY_DTYPE_I64, 64}};

static ferry_tensor_desc adesc(int i) {
  return (ferry_tensor_desc){.dtype = aspecs[i].dtype, .ndim = 1, .shape = {aspecs[i].count}};
}

static uint64_t abytes(int i) { return aspecs[i].count * ferry_dtype_size(aspecs[i].dtype); }

/* Tensor i's bytes in version v (host memory, malloc'd). */
static uint8_t *avalues(int i, uint64_t v) {
  uint8_t *p = malloc(abytes(i));
  for (uint64_t k = 0; k < abytes(i); k++)
    p[k] = (uint8_t)(k * 31 + (uint64_t)i * 7 + v * 101);
  return p;
}

/* Whether the bytes at `at` (host or device memory) are tensor i of version v. */
static bool aholds(const void *at, int i, uint64_t v) {
  uint8_t *want = avalues(i, v), *got = malloc(abytes(i));
  bool same = ferry_mem_copy(got, at, abytes(i)) == 0 && memcmp(got, want, abytes(i)) == 0;
  free(want);
  free(got);
  return same;
}

#define DIRECT_YES (1ll << 40)
#define DIRECT_NO (1ll << 41)

/* The receiver process of test_alias_device and test_device_buckets: "alias" (views into the
 * sender's device buffer), "device" (bound device tensors), "host" (bound host tensors) or "shard"
 * (a slice of "w" into host memory: it reads only its runs, never viewing the device buffer from
 * the CPU). Commands as receiver_child's (positive versions only). */
static int alias_child(const char *mode, const char *transports, const char *address, int cmd_fd,
                       int rep_fd) {
  setenv("FERRY_TRANSPORTS", transports, 1);
  if (!tu_cuda_use())
    return 3;
  char name[32];
  snprintf(name, sizeof name, "rollout-%s", mode);
  ferry_ctx *c = ctx_for(name, NULL);
  ferry_refit_receiver *r;
  if (ferry_refit_receiver_open(c, address, 5000, &r) != 0)
    return 1;
  void *dst[NA] = {0};
  bool alias = strcmp(mode, "alias") == 0, dev = strcmp(mode, "device") == 0,
       shard = strcmp(mode, "shard") == 0;
  int rc = alias ? ferry_refit_bind_alias(r) : 0;
  float slice[300]; /* w[100, 400) */
  if (shard) {
    ferry_refit_piece piece = {.source = "w", .dim = 0, .start = 100, .stop = 400};
    ferry_tensor_desc d = {.dtype = FERRY_DTYPE_F32, .ndim = 1, .shape = {300}};
    rc = ferry_refit_bind_pieces(r, "w-part", slice, &d, &piece, 1);
  }
  for (int i = 0; i < NA && !alias && !shard && rc == 0; i++) {
    ferry_tensor_desc d = adesc(i);
    if (dev)
      rc = ferry_cuda_alloc(0, abytes(i), &dst[i]);
    else
      dst[i] = (rc = (dst[i] = calloc(1, abytes(i))) ? 0 : FERRY_ENOMEM) == 0 ? dst[i] : NULL;
    if (rc == 0)
      rc = ferry_refit_bind(r, aspecs[i].name, dst[i], &d);
  }
  if (rc != 0) {
    fprintf(stderr, "cuda_refit_test alias child (%s): %s\n", mode, ferry_last_error());
    return 2;
  }
  tu_pipe cmd = {cmd_fd, -1}, rep = {-1, rep_fd};
  uint8_t ok = 1;
  tu_pipe_put(&rep, &ok, 1);
  int64_t v;
  uint64_t direct_before = 0; /* buckets read direct up to the last version (read as it lands) */
  while (tu_pipe_get(&cmd, &v, sizeof v, 60000) == 0 && v != 0) {
    /* DIRECT_YES / DIRECT_NO: whether the version must come device to device, unhashed */
    int64_t want = v & (DIRECT_YES | DIRECT_NO);
    v &= ~(DIRECT_YES | DIRECT_NO);
    ok = ferry_refit_wait(r, (uint64_t)v, 20000, NULL) == 0;
    uint64_t now = __atomic_load_n(&fr_refit_stat_direct, __ATOMIC_RELAXED);
    uint64_t direct = now - direct_before;
    direct_before = now;
    if ((want == DIRECT_YES && direct == 0) || (want == DIRECT_NO && direct != 0)) {
      fprintf(stderr, "cuda_refit_test alias child (%s): %llu buckets read direct\n", mode,
              (unsigned long long)direct);
      ok = false;
    }
    if (shard && ok) {
      uint8_t *w = avalues(0, (uint64_t)v);
      ok = memcmp(slice, w + 100 * sizeof(float), sizeof slice) == 0;
      free(w);
    }
    for (int i = 0; i < NA && ok && !shard; i++) {
      void *at = dst[i];
      int where = -1;
      if (alias) /* a view: device memory of the sender's buffer, mapped here */
        ok = ferry_refit_view(r, aspecs[i].name, &at) == 0 &&
             ferry_mem_where(at, &where) == FERRY_MEM_CUDA;
      ok = ok && aholds(at, i, (uint64_t)v);
    }
    if (!ok)
      fprintf(stderr, "cuda_refit_test alias child (%s): version %lld: %s\n", mode, (long long)v,
              ferry_last_error());
    tu_pipe_put(&rep, &ok, 1);
  }
  ferry_refit_receiver_close(r);
  for (int i = 0; i < NA; i++)
    if (dev)
      ferry_cuda_free(dst[i]);
    else
      free(dst[i]);
  ferry_ctx_close(c);
  return 0;
}

static void alias_child_start(child *k, const char *mode, const char *transports,
                              const char *address) {
  tu_pipe_open(&k->cmd);
  tu_pipe_open(&k->rep);
  char cfd[16], rfd[16];
  snprintf(cfd, sizeof cfd, "%d", k->cmd.rd);
  snprintf(rfd, sizeof rfd, "%d", k->rep.wr);
  k->pid = tu_spawn_exec("--alias-receiver", mode, transports, address, cfd, rfd, NULL);
  uint8_t ready = 0;
  assert_int_equal(tu_pipe_get(&k->rep, &ready, 1, 20000), 0);
  assert_int_equal(ready, 1);
}

/* The sender's side of the two cases below: the NA tensors in device memory of this process,
 * declared as they are and sealed; version v written into them; freed. */
static void device_sender_declare(ferry_refit_sender *snd, void *src[NA]) {
  for (int i = 0; i < NA; i++) {
    ferry_tensor_desc d = adesc(i);
    FR_OK(ferry_cuda_alloc(0, abytes(i), &src[i]));
    FR_OK(ferry_refit_declare(snd, aspecs[i].name, &d, src[i], FERRY_DTYPE_INVALID));
  }
  FR_OK(ferry_refit_seal(snd));
}

static void device_sender_fill(void *src[NA], uint64_t v) {
  for (int i = 0; i < NA; i++) {
    uint8_t *x = avalues(i, v);
    FR_OK(ferry_mem_copy(src[i], x, abytes(i)));
    free(x);
  }
}

static void device_sender_free(void *src[NA]) {
  for (int i = 0; i < NA; i++)
    FR_OK(ferry_cuda_free(src[i]));
}

/* A sender in alias mode whose tensors are all on the device: its buffer is device memory. An
 * engine on this host views it in place through CUDA IPC (device addresses, nothing copied);
 * receivers that copy read it over shm into device tensors, and over tcp (staged by the owner)
 * into host ones, verified against checksums the sender took through host memory; a shard
 * reader on this host reads only its slice's runs. */
static void test_alias_device(void **st) {
  (void)st;
  if (!have_cuda)
    skip();
  ferry_ctx *sc = ctx_for("trainer", "shm,tcp");
  ferry_refit_opts o = {.size = sizeof o, .bucket_bytes = 8192, .alias = 1};
  ferry_refit_sender *snd;
  FR_OK(ferry_refit_sender_open(sc, "trainer", &o, &snd));
  void *src[NA];
  device_sender_declare(snd, src);
  child alias, dev, host, shard;
  alias_child_start(&alias, "alias", "shm", ferry_ctx_address(sc));
  alias_child_start(&dev, "device", "shm", ferry_ctx_address(sc));
  alias_child_start(&host, "host", "tcp", ferry_ctx_address(sc));
  alias_child_start(&shard, "shard", "shm", ferry_ctx_address(sc));
  await_receivers(snd, 4);
  for (uint64_t v = 1; v <= 4; v++) {
    device_sender_fill(src, v);
    if (v == 4) /* sealed again: the same device buffer, zeroed and packed anew */
      FR_OK(ferry_refit_seal(snd));
    FR_OK(ferry_refit_push(snd, v, NULL));
    child_expect(&alias, (int64_t)v);
    child_expect(&dev, (int64_t)v);
    child_expect(&host, (int64_t)v);
    child_expect(&shard, (int64_t)v);
  }
  child_end(&alias);
  child_end(&dev);
  child_end(&host);
  child_end(&shard);
  ferry_refit_sender_close(snd);
  device_sender_free(src);
  ferry_ctx_close(sc);
}

static uint64_t staged_sums(void) {
  return __atomic_load_n(&fr_refit_stat_staged_sums, __ATOMIC_RELAXED);
}

static void alias_expect_all(child *k[], size_t n, uint64_t v, int64_t direct) {
  for (size_t i = 0; i < n; i++) /* k[0] views: it reads nothing, direct or not */
    child_expect(k[i], (int64_t)v | (i == 0 ? 0 : direct));
}

/* Alias mode, the buffer in device memory, every receiver on this host (a view, device tensors
 * copied through CUDA IPC): a push takes no checksum through host memory. A receiver over tcp
 * that attaches later catches up verified: the checksums are taken then, once (a second one finds
 * them taken; a late joiner on this host reads unhashed). A push with receivers over tcp in it is
 * hashed, and a bucket changed after its checksum was taken is refused by those that verify; a
 * push with skip_unchanged is hashed (it compares checksums). */
static void test_alias_device_lazy_sums(void **st) {
  (void)st;
  if (!have_cuda)
    skip();
  ferry_ctx *sc = ctx_for("trainer", "shm,tcp");
  ferry_refit_opts o = {.size = sizeof o, .bucket_bytes = 8192, .alias = 1};
  ferry_refit_sender *snd;
  FR_OK(ferry_refit_sender_open(sc, "trainer", &o, &snd));
  void *src[NA];
  device_sender_declare(snd, src);
  child alias, dev, late, tcp, tcp2;
  child *local[] = {&alias, &dev, &late}, *all[] = {&alias, &dev, &late, &tcp, &tcp2};
  alias_child_start(&alias, "alias", "shm", ferry_ctx_address(sc));
  alias_child_start(&dev, "device", "shm", ferry_ctx_address(sc));
  await_receivers(snd, 2);
  uint64_t before = staged_sums();
  for (uint64_t v = 1; v <= 2; v++) {
    device_sender_fill(src, v);
    FR_OK(ferry_refit_push(snd, v, NULL));
    assert_int_equal(staged_sums(), before); /* nothing staged, nothing hashed */
    alias_expect_all(local, 2, v, DIRECT_YES);
  }
  alias_child_start(&tcp, "host", "tcp", ferry_ctx_address(sc));
  child_expect(&tcp, 2 | DIRECT_NO); /* caught up, each bucket verified */
  uint64_t taken = staged_sums() - before;
  assert_true(taken > 0);
  alias_child_start(&late, "device", "shm", ferry_ctx_address(sc));
  child_expect(&late, 2 | DIRECT_YES);
  /* last: its COMMITTED may come after the next push began, which leaves it out to catch up */
  alias_child_start(&tcp2, "host", "tcp", ferry_ctx_address(sc));
  child_expect(&tcp2, 2 | DIRECT_NO);
  assert_int_equal(staged_sums(), before + taken); /* taken once, kept for the version */
  await_receivers(snd, 5);
  device_sender_fill(src, 3);
  FR_OK(ferry_refit_push(snd, 3, NULL));
  assert_int_equal(staged_sums(), before + 2 * taken);
  alias_expect_all(all, 5, 3, DIRECT_NO);
  device_sender_fill(src, 4);
  fr_refit_test_corrupt = flip_bucket_one;
  assert_int_equal(ferry_refit_push(snd, 4, NULL), FERRY_ECHECKSUM);
  fr_refit_test_corrupt = NULL;
  assert_non_null(strstr(ferry_last_error(), "rollout-host"));
  assert_non_null(strstr(ferry_last_error(), "rollout-device"));
  child_end(&tcp);
  child_end(&tcp2);
  await_receivers(snd, 3);
  device_sender_fill(src, 5);
  before = staged_sums(); /* version 4's repair pass hashed again (the tcp pair was a chain) */
  FR_OK(ferry_refit_push(snd, 5, NULL));
  assert_int_equal(staged_sums(), before);
  alias_expect_all(local, 3, 5, DIRECT_YES);
  device_sender_fill(src, 6);
  ferry_refit_push_opts skip = {.size = sizeof skip, .skip_unchanged = 1, .timeout_ms = -1};
  FR_OK(ferry_refit_push(snd, 6, &skip));
  assert_int_equal(staged_sums(), before + taken);
  alias_expect_all(local, 3, 6, DIRECT_NO);
  for (size_t i = 0; i < 3; i++)
    child_end(local[i]);
  ferry_refit_sender_close(snd);
  device_sender_free(src);
  ferry_ctx_close(sc);
}

/* A receiver in this process over tcp, binding host memory for the NA tensors of the alias
 * sender above: it verifies every bucket it catches up with. */
typedef struct host_rx {
  ferry_ctx *ctx;
  ferry_refit_receiver *r;
  void *dst[NA];
} host_rx;

static void host_rx_open(host_rx *h, const char *address) {
  h->ctx = ctx_for("late", "tcp");
  FR_OK(ferry_refit_receiver_open(h->ctx, address, 5000, &h->r));
  for (int i = 0; i < NA; i++) {
    ferry_tensor_desc d = adesc(i);
    assert_non_null(h->dst[i] = calloc(1, abytes(i)));
    FR_OK(ferry_refit_bind(h->r, aspecs[i].name, h->dst[i], &d));
  }
  (void)ferry_refit_committed(h->r); /* asks to catch up to the latest version */
}

static bool host_rx_holds(host_rx *h, uint64_t v) {
  bool all = true;
  for (int i = 0; i < NA; i++)
    all &= aholds(h->dst[i], i, v);
  return all;
}

static void host_rx_close(host_rx *h) {
  ferry_refit_receiver_close(h->r);
  for (int i = 0; i < NA; i++)
    free(h->dst[i]);
  ferry_ctx_close(h->ctx);
}

/* fr_refit_test_hold: the service thread stops the first time it comes to hold_point (hashing a
 * bucket for a catch-up, in the middle; or sending catch-up frames) until the test lets it go
 * (hold_state 1 while held, 2 once let go); after 60 s nobody let go of it (3): the test fails
 * rather than hangs. */
static pthread_mutex_t hold_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_cv = PTHREAD_COND_INITIALIZER;
static int hold_state, hold_point;

static void hold_at(int point) {
  pthread_mutex_lock(&hold_mu);
  if (hold_state == 0 && point == hold_point) {
    hold_state = 1;
    pthread_cond_broadcast(&hold_cv);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 60;
    while (hold_state == 1 && pthread_cond_timedwait(&hold_cv, &hold_mu, &until) == 0)
      ;
    if (hold_state == 1)
      hold_state = 3;
  }
  pthread_mutex_unlock(&hold_mu);
}

/* Lets hold_at hold the service thread at `point` from now on. */
static void hold_arm(int point) {
  hold_state = 0;
  hold_point = point;
  __atomic_store_n(&fr_refit_test_hold, hold_at, __ATOMIC_RELEASE);
}

/* Lets it go; the state it was in (1: still held). */
static int hold_release(void) {
  pthread_mutex_lock(&hold_mu);
  int state = hold_state;
  hold_state = 2;
  pthread_cond_broadcast(&hold_cv);
  pthread_mutex_unlock(&hold_mu);
  return state;
}

/* Waits (60 s at most) until hold_at holds the service thread; the state then. */
static int hold_wait(void) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 60;
  pthread_mutex_lock(&hold_mu);
  while (hold_state == 0 && pthread_cond_timedwait(&hold_cv, &hold_mu, &until) == 0)
    ;
  int state = hold_state;
  pthread_mutex_unlock(&hold_mu);
  return state;
}

static ferry_refit_sender *alias_device_sender(ferry_ctx *sc, void *src[NA]) {
  ferry_refit_opts o = {.size = sizeof o, .bucket_bytes = 8192, .alias = 1};
  ferry_refit_sender *snd;
  FR_OK(ferry_refit_sender_open(sc, "trainer", &o, &snd));
  device_sender_declare(snd, src);
  return snd;
}

/* A late joiner's checksum of an unhashed alias device bucket is taken without the sender's lock:
 * while the service thread is held in the middle of that hash, a push (of a short timeout)
 * begins and returns; the sum, of the version the push replaced, is void, and the late joiner
 * then catches up to the push's version, every bucket verified against sums of its own bytes.
 * On the code that hashed under the lock the push waited for the held hash (60 s: the hold gave
 * up, state 3). */
static void test_alias_lazy_sum_unlocked(void **st) {
  (void)st;
  if (!have_cuda)
    skip();
  ferry_ctx *sc = ctx_for("trainer", "shm,tcp");
  void *src[NA];
  ferry_refit_sender *snd = alias_device_sender(sc, src);
  device_sender_fill(src, 1);
  FR_OK(ferry_refit_push(snd, 1, NULL)); /* nobody attached: unhashed */
  hold_arm(FR_REFIT_HOLD_SUM);
  host_rx late;
  host_rx_open(&late, ferry_ctx_address(sc));
  assert_int_equal(hold_wait(), 1); /* the service thread hashes bucket 0 for it, held */
  device_sender_fill(src, 2);
  ferry_refit_push_opts po = {.size = sizeof po, .timeout_ms = 200};
  FR_OK(ferry_refit_push(snd, 2, &po)); /* the late joiner stays out: it catches up after */
  assert_int_equal(hold_release(), 1);  /* still held: the push did not wait for it */
  FR_OK(ferry_refit_wait(late.r, 2, 20000, NULL));
  assert_true(host_rx_holds(&late, 2));
  __atomic_store_n(&fr_refit_test_hold, NULL, __ATOMIC_RELEASE);
  host_rx_close(&late);
  ferry_refit_sender_close(snd);
  device_sender_free(src);
  ferry_ctx_close(sc);
}

/* A push waits for the catch-up frames the service thread is sending (they go first) no longer
 * than its timeout: with the service thread held before it sends a late joiner's frames, a push
 * of a short timeout returns FERRY_ETIMEDOUT, nothing of it begun; once the frames went, the late
 * joiner catches up and the next push lands. On the code that waited without a deadline the push
 * returned only once the hold gave up (60 s), and then pushed. */
static void test_push_awaits_service_bounded(void **st) {
  (void)st;
  if (!have_cuda)
    skip();
  ferry_ctx *sc = ctx_for("trainer", "shm,tcp");
  void *src[NA];
  ferry_refit_sender *snd = alias_device_sender(sc, src);
  device_sender_fill(src, 1);
  FR_OK(ferry_refit_push(snd, 1, NULL));
  hold_arm(FR_REFIT_HOLD_SEND);
  host_rx late;
  host_rx_open(&late, ferry_ctx_address(sc));
  assert_int_equal(hold_wait(), 1); /* its first catch-up frames queued, not sent */
  device_sender_fill(src, 2);
  ferry_refit_push_opts po = {.size = sizeof po, .timeout_ms = 200};
  assert_int_equal(ferry_refit_push(snd, 2, &po), FERRY_ETIMEDOUT);
  assert_non_null(strstr(ferry_last_error(), "catch-up frames"));
  assert_int_equal(hold_release(), 1);
  FR_OK(ferry_refit_wait(late.r, 1, 20000, NULL));
  assert_true(host_rx_holds(&late, 1));
  __atomic_store_n(&fr_refit_test_hold, NULL, __ATOMIC_RELEASE);
  FR_OK(ferry_refit_push(snd, 2, NULL));
  FR_OK(ferry_refit_wait(late.r, 2, 20000, NULL));
  assert_true(host_rx_holds(&late, 2));
  host_rx_close(&late);
  ferry_refit_sender_close(snd);
  device_sender_free(src);
  ferry_ctx_close(sc);
}

/* The same for a shard reader catching up from a host sender: the sum of its runs in a bucket is
 * taken by the service thread without the sender's lock, a chunk at a time, and a push that
 * begins meanwhile waits for it to stop at its next chunk, no longer than its timeout: with the
 * hash held there, the push returns FERRY_ETIMEDOUT, nothing begun; once let go, the reader
 * catches up and the next push lands. On the code that took that sum under the lock the push
 * waited for the lock until the hold gave up (60 s), and then pushed. */
static void test_shard_view_sum_unlocked(void **st) {
  (void)st;
  ferry_ctx *sc = ctx_for("trainer", "shm"), *lc = ctx_for("late", "shm");
  ferry_refit_opts o = {.size = sizeof o, .bucket_bytes = 8192};
  ferry_refit_sender *snd;
  FR_OK(ferry_refit_sender_open(sc, "trainer", &o, &snd));
  uint8_t *src[NA];
  for (int i = 0; i < NA; i++) {
    ferry_tensor_desc d = adesc(i);
    src[i] = avalues(i, 1);
    FR_OK(ferry_refit_declare(snd, aspecs[i].name, &d, src[i], FERRY_DTYPE_INVALID));
  }
  FR_OK(ferry_refit_seal(snd));
  FR_OK(ferry_refit_push(snd, 1, NULL));
  hold_arm(FR_REFIT_HOLD_SUM);
  ferry_refit_receiver *r;
  FR_OK(ferry_refit_receiver_open(lc, ferry_ctx_address(sc), 5000, &r));
  float slice[300]; /* w[100, 400) */
  ferry_refit_piece piece = {.source = "w", .dim = 0, .start = 100, .stop = 400};
  ferry_tensor_desc sd = {.dtype = FERRY_DTYPE_F32, .ndim = 1, .shape = {300}};
  FR_OK(ferry_refit_bind_pieces(r, "w-part", slice, &sd, &piece, 1));
  (void)ferry_refit_committed(r);   /* asks to catch up */
  assert_int_equal(hold_wait(), 1); /* the service thread hashes its runs in bucket 0, held */
  uint8_t *w2 = avalues(0, 2);
  memcpy(src[0], w2, abytes(0));
  free(w2);
  ferry_refit_push_opts po = {.size = sizeof po, .timeout_ms = 200};
  assert_int_equal(ferry_refit_push(snd, 2, &po), FERRY_ETIMEDOUT);
  assert_non_null(strstr(ferry_last_error(), "shard runs"));
  assert_int_equal(hold_release(), 1);
  __atomic_store_n(&fr_refit_test_hold, NULL, __ATOMIC_RELEASE);
  FR_OK(ferry_refit_wait(r, 1, 20000, NULL)); /* version 1's runs: the push did not begin */
  FR_OK(ferry_refit_push(snd, 2, NULL));
  FR_OK(ferry_refit_wait(r, 2, 20000, NULL));
  assert_memory_equal(slice, src[0] + 100 * sizeof(float), sizeof slice);
  ferry_refit_receiver_close(r);
  ferry_refit_sender_close(snd);
  for (int i = 0; i < NA; i++)
    free(src[i]);
  ferry_ctx_close(lc);
  ferry_ctx_close(sc);
}

/* The corruption hook reaches a bucket summed lazily: an unhashed push leaves it alone, and the
 * late joiner's checksum is taken before the hook changes the bytes, so the late joiner (over
 * tcp, verifying) refuses the bucket and never commits the version; the next push lands. On the
 * code that corrupted the unhashed push, the later sum was of the corrupt bytes: it committed. */
static void test_alias_lazy_sum_corrupt(void **st) {
  (void)st;
  if (!have_cuda)
    skip();
  ferry_ctx *sc = ctx_for("trainer", "shm,tcp");
  void *src[NA];
  ferry_refit_sender *snd = alias_device_sender(sc, src);
  device_sender_fill(src, 1);
  __atomic_store_n(&fr_refit_test_corrupt, flip_bucket_one, __ATOMIC_RELEASE);
  FR_OK(ferry_refit_push(snd, 1, NULL)); /* nobody attached: unhashed */
  host_rx late;
  host_rx_open(&late, ferry_ctx_address(sc));
  int rc = 0;
  for (int i = 0; i < 300; i++) { /* until it commits or fails the version (60 s at most) */
    rc = ferry_refit_wait(late.r, 1, 200, NULL);
    if (rc == 0 || strstr(ferry_last_error(), "checksum"))
      break;
  }
  assert_int_equal(rc, FERRY_ETIMEDOUT);
  assert_non_null(strstr(ferry_last_error(), "does not match its checksum"));
  __atomic_store_n(&fr_refit_test_corrupt, NULL, __ATOMIC_RELEASE);
  device_sender_fill(src, 2);
  FR_OK(ferry_refit_push(snd, 2, NULL)); /* the late joiner is in it, over tcp: hashed */
  FR_OK(ferry_refit_wait(late.r, 2, 20000, NULL));
  assert_true(host_rx_holds(&late, 2));
  host_rx_close(&late);
  ferry_refit_sender_close(snd);
  device_sender_free(src);
  ferry_ctx_close(sc);
}

/* device_buckets: two bucket slots in the device's memory. With every receiver on this host,
 * pushes go unhashed and receivers copy device to device (or device to host) through CUDA IPC
 * straight into their bound tensors; once a receiver over tcp attaches, buckets are hashed through
 * host memory again and every receiver verifies them; when it leaves, direct again. */
static void test_device_buckets(void **st) {
  (void)st;
  if (!have_cuda)
    skip();
  ferry_ctx *sc = ctx_for("trainer", "shm,tcp");
  ferry_refit_opts o = {.size = sizeof o, .bucket_bytes = 8192, .device_buckets = 1};
  ferry_refit_sender *snd;
  FR_OK(ferry_refit_sender_open(sc, "trainer", &o, &snd));
  void *src[NA];
  device_sender_declare(snd, src);
  child dev, host, tcp;
  alias_child_start(&dev, "device", "shm", ferry_ctx_address(sc));
  alias_child_start(&host, "host", "shm", ferry_ctx_address(sc));
  await_receivers(snd, 2);
  for (uint64_t v = 1; v <= 4; v++) {
    if (v == 3) {
      alias_child_start(&tcp, "host", "tcp", ferry_ctx_address(sc));
      await_receivers(snd, 3);
    }
    device_sender_fill(src, v);
    FR_OK(ferry_refit_push(snd, v, NULL));
    int64_t want = (int64_t)v | (v == 3 ? DIRECT_NO : DIRECT_YES);
    child_expect(&dev, want);
    child_expect(&host, want);
    if (v == 3) {
      child_expect(&tcp, (int64_t)v | DIRECT_NO);
      child_end(&tcp);
      await_receivers(snd, 2);
    }
  }
  child_end(&dev);
  child_end(&host);
  ferry_refit_sender_close(snd);
  device_sender_free(src);
  ferry_ctx_close(sc);
}

/* ---- one process ---- */

/* A chain over tcp (the second receiver reads each bucket from the first, which keeps it in a
 * forwarding slot and puts its own copy on the device), and a receiver that attaches late and
 * catches up from the sender's retained buffer into device memory. */
static void test_chain_and_late_join(void **st) {
  (void)st;
  if (!have_cuda)
    skip();
  ferry_ctx *sc = ctx_for("trainer", "tcp"), *ac = ctx_for("head", "tcp"),
            *bc = ctx_for("tail", "tcp"), *lc = ctx_for("late", "tcp");
  side s, a, b, l;
  side_alloc(&s, true, 0);
  ferry_refit_sender *snd = sender_for(sc, &s);
  ferry_refit_receiver *ra, *rb, *rl;
  FR_OK(ferry_refit_receiver_open(ac, ferry_ctx_address(sc), 5000, &ra));
  side_alloc(&a, false, 0);
  bind_side(ra, &a);
  await_receivers(snd, 1);
  FR_OK(ferry_refit_receiver_open(bc, ferry_ctx_address(sc), 5000, &rb));
  side_alloc(&b, false, 0);
  bind_side(rb, &b);
  await_receivers(snd, 2);
  ferry_refit_push_opts po = {
      .size = sizeof po, .timeout_ms = 10000, .route = FERRY_REFIT_ROUTE_CHAIN};
  for (uint64_t v = 1; v <= 2; v++) {
    uint64_t forwarded = __atomic_load_n(&fr_refit_stat_forwarded, __ATOMIC_RELAXED);
    sender_fill(&s, v);
    FR_OK(ferry_refit_push(snd, v, &po));
    assert_true(__atomic_load_n(&fr_refit_stat_forwarded, __ATOMIC_RELAXED) > forwarded);
    FR_OK(ferry_refit_wait(ra, v, 5000, NULL));
    FR_OK(ferry_refit_wait(rb, v, 5000, NULL));
    assert_int_equal(receiver_check(ra, &a, v), 0);
    assert_int_equal(receiver_check(rb, &b, v), 0);
  }
  FR_OK(ferry_refit_receiver_open(lc, ferry_ctx_address(sc), 5000, &rl));
  side_alloc(&l, false, 0);
  bind_side(rl, &l);
  FR_OK(ferry_refit_wait(rl, 2, 10000, NULL)); /* caught up, no push */
  assert_int_equal(receiver_check(rl, &l, 2), 0);
  ferry_refit_receiver_close(rl);
  ferry_refit_receiver_close(rb);
  ferry_refit_receiver_close(ra);
  ferry_refit_sender_close(snd);
  side_free(&l, false);
  side_free(&b, false);
  side_free(&a, false);
  side_free(&s, true);
  ferry_ctx_close(lc);
  ferry_ctx_close(bc);
  ferry_ctx_close(ac);
  ferry_ctx_close(sc);
}

/* One round of test_pack_async: FERRY_CUDA_PACK_ASYNC set to `setting` before any thread of
 * ours runs, a sender of the mixed model (host buckets: device tensors copied in, some cast) and a
 * receiver over shm binding device and host memory; three versions land whole. */
static void pack_round(const char *setting) {
  setenv("FERRY_CUDA_PACK_ASYNC", setting, 1);
  ferry_ctx *sc = ctx_for("trainer", "shm"), *rc = ctx_for("rollout", "shm");
  side s, r;
  side_alloc(&s, true, 0);
  ferry_refit_sender *snd = sender_for(sc, &s);
  ferry_refit_receiver *rx;
  FR_OK(ferry_refit_receiver_open(rc, ferry_ctx_address(sc), 5000, &rx));
  side_alloc(&r, false, 0);
  bind_side(rx, &r);
  await_receivers(snd, 1);
  for (uint64_t v = 1; v <= 3; v++) {
    sender_fill(&s, v);
    FR_OK(ferry_refit_push(snd, v, NULL));
    FR_OK(ferry_refit_wait(rx, v, 5000, NULL));
    assert_int_equal(receiver_check(rx, &r, v), 0);
  }
  ferry_refit_receiver_close(rx);
  ferry_refit_sender_close(snd);
  side_free(&r, false);
  side_free(&s, true);
  ferry_ctx_close(rc);
  ferry_ctx_close(sc);
  unsetenv("FERRY_CUDA_PACK_ASYNC"); /* every thread of ours has ended */
}

/* A bucket's device copies one synchronous copy each (0), or queued on one stream and waited for
 * once per bucket (1): the same bytes land either way. The stand-in runs a queued copy only when
 * its stream is synchronized, so a bucket hashed or read before the wait would hold the last
 * version's bytes. */
static void test_pack_async(void **st) {
  (void)st;
  if (!have_cuda)
    skip();
  pack_round("0");
  pack_round("1");
}

/* Shards into device memory: a dim-1 slice of a device tensor (one run per row, merged into one
 * copy per stretch) and a tensor bound whole beside it (a target of one piece). */
static void test_shards(void **st) {
  (void)st;
  if (!have_cuda)
    skip();
  ferry_ctx *sc = ctx_for("trainer", "shm"), *rc = ctx_for("rollout", "shm");
  ferry_tensor_desc wd = {.dtype = FERRY_DTYPE_F32, .ndim = 2, .shape = {40, 64}};
  ferry_tensor_desc bd = {.dtype = FERRY_DTYPE_F32, .ndim = 1, .shape = {64}};
  float w[40 * 64], b[64];
  void *dw;
  FR_OK(ferry_cuda_alloc(0, sizeof w, &dw));
  ferry_refit_opts o = {.size = sizeof o, .bucket_bytes = 4096};
  ferry_refit_sender *snd;
  FR_OK(ferry_refit_sender_open(sc, "trainer", &o, &snd));
  FR_OK(ferry_refit_declare(snd, "w", &wd, dw, FERRY_DTYPE_INVALID));
  FR_OK(ferry_refit_declare(snd, "b", &bd, b, FERRY_DTYPE_INVALID));
  FR_OK(ferry_refit_seal(snd));

  ferry_refit_receiver *r;
  FR_OK(ferry_refit_receiver_open(rc, ferry_ctx_address(sc), 5000, &r));
  ferry_tensor_desc cd = {.dtype = FERRY_DTYPE_F32, .ndim = 2, .shape = {40, 16}};
  void *cols, *bias;
  FR_OK(ferry_cuda_alloc(0, 40 * 16 * 4, &cols));
  FR_OK(ferry_cuda_alloc(0, sizeof b, &bias));
  FR_OK(ferry_refit_bind(r, "b", bias, &bd));
  ferry_refit_piece pc = {"w", 1, 16, 32};
  FR_OK(ferry_refit_bind_pieces(r, "w.cols", cols, &cd, &pc, 1));
  await_receivers(snd, 1);
  for (uint64_t v = 1; v <= 2; v++) {
    for (int k = 0; k < 40 * 64; k++)
      w[k] = (float)(v * 10000 + (uint64_t)k);
    for (int k = 0; k < 64; k++)
      b[k] = (float)v - (float)k;
    FR_OK(ferry_mem_copy(dw, w, sizeof w));
    FR_OK(ferry_refit_push(snd, v, NULL));
    FR_OK(ferry_refit_wait(r, v, 5000, NULL));
    float got[40 * 16], gb[64];
    FR_OK(ferry_mem_copy(got, cols, sizeof got));
    FR_OK(ferry_mem_copy(gb, bias, sizeof gb));
    for (int row = 0; row < 40; row++)
      assert_memory_equal(&got[row * 16], &w[row * 64 + 16], 16 * 4);
    assert_memory_equal(gb, b, sizeof b);
  }
  ferry_refit_receiver_close(r);
  ferry_refit_sender_close(snd);
  FR_OK(ferry_cuda_free(cols));
  FR_OK(ferry_cuda_free(bias));
  FR_OK(ferry_cuda_free(dw));
  ferry_ctx_close(rc);
  ferry_ctx_close(sc);
}

/* Device memory shorter than the tensor is refused on both sides, nothing declared or bound; a
 * flat buffer (host memory) and device bindings exclude each other. */
static void test_refusals(void **st) {
  (void)st;
  if (!have_cuda)
    skip();
  ferry_ctx *sc = ctx_for("trainer", "shm"), *rc = ctx_for("rollout", "shm");
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_F32, .ndim = 1, .shape = {256}};
  void *dev;
  FR_OK(ferry_cuda_alloc(0, 1024, &dev));
  ferry_refit_sender *snd;
  FR_OK(ferry_refit_sender_open(sc, "trainer", NULL, &snd));
  assert_int_equal(ferry_refit_declare(snd, "x", &d, (uint8_t *)dev + 4, FERRY_DTYPE_INVALID),
                   FERRY_EINVAL);
  assert_non_null(strstr(ferry_last_error(), "'x'"));
  assert_non_null(strstr(ferry_last_error(), "CUDA allocation"));
  assert_int_equal(ferry_refit_seal(snd), FERRY_ESTATE); /* nothing was declared */
  FR_OK(ferry_refit_declare(snd, "x", &d, dev, FERRY_DTYPE_INVALID));
  FR_OK(ferry_refit_seal(snd));

  ferry_refit_receiver *r;
  FR_OK(ferry_refit_receiver_open(rc, ferry_ctx_address(sc), 5000, &r));
  void *small;
  FR_OK(ferry_cuda_alloc(0, 512, &small));
  assert_int_equal(ferry_refit_bind(r, "x", small, &d), FERRY_EINVAL);
  assert_non_null(strstr(ferry_last_error(), "CUDA allocation"));
  void *dst;
  FR_OK(ferry_cuda_alloc(0, 1024, &dst));
  FR_OK(ferry_refit_bind(r, "x", dst, &d));
  assert_int_equal(ferry_refit_bind_flat(r), FERRY_ENOTSUP);
  assert_non_null(strstr(ferry_last_error(), "CUDA memory"));
  await_receivers(snd, 1);
  float x[256];
  for (int k = 0; k < 256; k++)
    x[k] = (float)k * 0.5f;
  FR_OK(ferry_mem_copy(dev, x, sizeof x));
  FR_OK(ferry_refit_push(snd, 1, NULL));
  FR_OK(ferry_refit_wait(r, 1, 5000, NULL));
  float got[256];
  FR_OK(ferry_mem_copy(got, dst, sizeof got));
  assert_memory_equal(got, x, sizeof x);
  ferry_refit_receiver_close(r);

  /* the other way round: a flat buffer first, then a device binding */
  FR_OK(ferry_refit_receiver_open(rc, ferry_ctx_address(sc), 5000, &r));
  FR_OK(ferry_refit_bind_flat(r));
  assert_int_equal(ferry_refit_bind(r, "x", dst, &d), FERRY_ENOTSUP);
  assert_non_null(strstr(ferry_last_error(), "flat buffer"));
  ferry_refit_receiver_close(r);
  ferry_refit_sender_close(snd);
  FR_OK(ferry_cuda_free(small));
  FR_OK(ferry_cuda_free(dst));
  FR_OK(ferry_cuda_free(dev));
  ferry_ctx_close(rc);
  ferry_ctx_close(sc);
}

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  if (argc == 6 && strcmp(argv[1], "--receiver") == 0)
    return receiver_child(argv[2], argv[3], atoi(argv[4]), atoi(argv[5]));
  if (argc == 7 && strcmp(argv[1], "--alias-receiver") == 0)
    return alias_child(argv[2], argv[3], argv[4], atoi(argv[5]), atoi(argv[6]));
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_processes),
      cmocka_unit_test(test_alias_device),
      cmocka_unit_test(test_alias_device_lazy_sums),
      cmocka_unit_test(test_alias_lazy_sum_unlocked),
      cmocka_unit_test(test_alias_lazy_sum_corrupt),
      cmocka_unit_test(test_push_awaits_service_bounded),
      cmocka_unit_test(test_shard_view_sum_unlocked),
      cmocka_unit_test(test_pack_async),
      cmocka_unit_test(test_device_buckets),
      cmocka_unit_test(test_chain_and_late_join),
      cmocka_unit_test(test_shards),
      cmocka_unit_test(test_refusals),
  };
  tu_filter();
  return cmocka_run_group_tests(tests, group_setup, NULL);
}
