/*
 * The store and mq with CUDA memory (issue 18): tensors put from device memory and read back by
 * another process (an exec'd producer: a process that forked after loading the real driver could
 * not use it) over shm and over tcp, gets into device memory from this node's own pool, a
 * same-host owner's mapped pool and through the tcp bounce buffer (an object larger than one
 * chunk of it), batch puts and gets with device items on two devices, and mq messages published
 * from device memory (inline and through the pool) and copied into it with ferry_mq_msg_copy.
 * Refusals write nothing: a dst too small, a device pointer whose allocation ends before the
 * object does (checked by reading the whole allocation back: its sentinel bytes are intact), a
 * put or publish whose tensor runs past its allocation (nothing stored, nothing received). A
 * short-lived node's put from device memory reaches its holder. A device pool that could not be
 * made is tried again by a later put. Device memory that the driver's
 * own calls made (as torch makes it, before ferry loaded anything) is recognized at its first
 * put. A
 * child with FERRY_CUDA=off does the host round trips as before. Device memory is filled and
 * checked only through ferry_mem_copy, so the file runs unchanged on a real GPU
 * (FERRY_TEST_CUDA=driver); against the stand-in, any CPU access to device memory faults.
 */
// ferry-test: cuda
#include "directory/directory.h"
#include "storeutil.h"

#include <dlfcn.h>
#include <string.h>

#define MiB (1024 * 1024)
/* Larger than the store's tcp bounce buffer (8 MiB), and not a multiple of anything. */
#define BIG ((size_t)(8 * MiB) + 12345)
#define SMALL ((size_t)70001)
/* The allocations whose end a refusal is about: a multiple of any allocation granularity of the
 * real driver, so that the range it reports is the one asked for, rounded or not. */
#define SPAN ((size_t)2 * MiB)
#define SEED_BIG 7
#define SEED_B1 11
#define SEED_B2 13
#define SENTINEL 0xA5

static bool cuda; /* a driver is loaded (group setup) */
static int second_device;
/* The stand-in's count of copies by kind (cuStubCopyCounts), NULL on the real driver: checks of
 * where bytes went are then skipped. */
static void (*stub_counts)(unsigned long long out[4]);
enum { HTOD, DTOH, DTOD, DTOD_IPC };
/* The device pool of the producers that test it: one BIG object, and a little room. */
#define DEVPOOL_BYTES (BIG + 4096)

/* ---- helpers ---- */

static ferry_ctx *ctx_open(const char *name, const char *listen, const char *transports) {
  ferry_ctx_opts o = {
      .size = sizeof o, .name = name, .tcp_listen = listen, .transports = transports, .token = ""};
  ferry_ctx *c = NULL;
  FR_OK(ferry_ctx_open(&o, &c));
  return c;
}

static ferry_store *store_open(ferry_ctx *c, const char *url, uint32_t flags) {
  ferry_store_opts o = {.size = sizeof o, .directory = url, .capacity = 64 * MiB, .flags = flags};
  ferry_store *s = NULL;
  FR_OK(ferry_store_open(c, &o, &s));
  return s;
}

static ferry_tensor_desc u8_desc(size_t n) {
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_U8, .ndim = 1, .shape = {n}};
  return d;
}

static void *dev_alloc(int device, size_t n) {
  void *p = NULL;
  FR_OK(ferry_cuda_alloc(device, n, &p));
  return p;
}

/* Writes the pattern of seed (or, seed 0, SENTINEL bytes) into device memory, from the host. */
static int dev_fill(void *dev, size_t n, uint64_t seed) {
  uint8_t *h = malloc(n);
  if (seed)
    tu_fill(h, n, seed);
  else
    memset(h, SENTINEL, n);
  int rc = ferry_mem_copy(dev, h, n);
  free(h);
  return rc;
}

static bool host_has(const uint8_t *p, size_t n, uint64_t seed) {
  uint8_t *want = malloc(n);
  tu_fill(want, n, seed);
  bool ok = memcmp(p, want, n) == 0;
  free(want);
  return ok;
}

/* Whether device memory holds the pattern of seed in [0, n) and SENTINEL bytes in [n, all). */
static bool dev_has(const void *dev, size_t n, size_t all, uint64_t seed) {
  uint8_t *h = malloc(all);
  bool ok = ferry_mem_copy(h, dev, all) == 0 && (n == 0 || host_has(h, n, seed));
  for (size_t i = n; ok && i < all; i++)
    ok = h[i] == SENTINEL;
  free(h);
  return ok;
}

/* Finds cuStubCopyCounts in the driver ferry loaded, when that is the stand-in. */
static void find_stub_counts(void) {
  const char *lib = getenv("FERRY_CUDA_LIB");
  void *h = lib && *lib ? dlopen(lib, RTLD_NOW | RTLD_NOLOAD) : NULL;
  stub_counts = h ? (void (*)(unsigned long long *))dlsym(h, "cuStubCopyCounts") : NULL;
}

/* The copies made since `before` (and `before` moved to now); false on the real driver. */
static bool copies_since(unsigned long long before[4], unsigned long long delta[4]) {
  if (!stub_counts)
    return false;
  unsigned long long now[4];
  stub_counts(now);
  for (int i = 0; i < 4; i++) {
    delta[i] = now[i] - before[i];
    before[i] = now[i];
  }
  return true;
}

static void copies_start(unsigned long long before[4]) {
  memset(before, 0, 4 * sizeof *before);
  if (stub_counts)
    stub_counts(before);
}

static int group_setup(void **state) {
  cuda = tu_cuda_use();
  if (cuda)
    find_stub_counts();
  ferry_cuda_info ci = {.size = sizeof ci};
  ferry_cuda_info_get(&ci);
  second_device = ci.devices > 1 ? 1 : 0;
  return 0;
}

/* ---- the producer: another process that puts from device memory ---- */

/* `--role producer URL TRANSPORTS RD WR`: puts cuda/big from device 0 and cuda/b1, cuda/b2 from
 * the second device in one batch, checks that a put running past its allocation is refused and
 * stores nothing, then says 0 on WR (or the number of the step that failed) and stays until RD
 * says quit. */
static int role_producer(char **argv) {
  tu_pipe p = {.rd = atoi(argv[5]), .wr = atoi(argv[6])};
  uint8_t step = 1;
  if (!tu_cuda_use()) {
    tu_pipe_put(&p, &step, 1);
    return 1;
  }
  find_stub_counts();
  bool devpool = getenv("FERRY_STORE_DEVICE_POOL_BYTES") != NULL;
  unsigned long long before[4], d[4];
  ferry_ctx *c = ctx_open("cuda-producer", NULL, argv[4]);
  ferry_store *s = store_open(c, argv[3], 0);
  void *big = dev_alloc(0, BIG), *b1 = dev_alloc(second_device, SMALL),
       *b2 = dev_alloc(second_device, 2 * SMALL), *shorter = dev_alloc(0, SPAN);
  ferry_tensor_desc dbig = u8_desc(BIG), d1 = u8_desc(SMALL), d2 = u8_desc(2 * SMALL),
                    past = u8_desc(SPAN + 1);
  ferry_store_put_item items[] = {{"cuda/b1", &d1, b1, -1}, {"cuda/b2", &d2, b2, -1}};
  int rc = dev_fill(big, BIG, SEED_BIG) || dev_fill(b1, SMALL, SEED_B1) ||
           dev_fill(b2, 2 * SMALL, SEED_B2);
  copies_start(before);
  if (rc == 0 && (step = 2, rc = ferry_store_put(s, "cuda/big", &dbig, big, 0, 10000)) == 0 &&
      (step = 5,
       rc = !devpool || !copies_since(before, d) || (d[DTOH] == 0 && d[DTOD] > 0) ? 0 : -1) == 0 &&
      (step = 3, rc = ferry_store_put_batch(s, items, 2, 0, 10000)) == 0) {
    step = 4; /* runs past its allocation: refused, nothing stored */
    rc = ferry_store_put(s, "cuda/short", &past, shorter, 0, 10000) == FERRY_ERANGE &&
                 ferry_store_exists(s, "cuda/short", 10000) == 0
             ? 0
             : -1;
  }
  if (rc != 0)
    fprintf(stderr, "producer: step %d: %s\n", step, ferry_last_error());
  step = rc == 0 ? 0 : step;
  tu_pipe_put(&p, &step, 1);
  char ch;
  tu_pipe_get(&p, &ch, 1, 120000);
  ferry_cuda_free(big);
  ferry_cuda_free(b1);
  ferry_cuda_free(b2);
  ferry_cuda_free(shorter);
  ferry_store_close(s);
  ferry_ctx_close(c);
  return rc == 0 ? 0 : 1;
}

/* Refusals of a get into device memory, from wherever the key's owner is: dst too small
 * (cap), and a dst whose allocation ends before the object though cap says it fits. Each leaves
 * the whole allocation as it was. */
static void check_refusals(ferry_store *s, const char *key, size_t bytes) {
  size_t all = SPAN;
  uint8_t *dst = dev_alloc(0, all), *near_end = dst + all - (bytes - 1);
  FR_OK(dev_fill(dst, all, 0));
  assert_int_equal(ferry_store_get(s, key, NULL, dst, bytes - 1, NULL, 10000), FERRY_ERANGE);
  assert_true(dev_has(dst, 0, all, 0));
  /* the allocation holds bytes - 1 from near_end on, though cap claims all of it */
  assert_int_equal(ferry_store_get(s, key, NULL, near_end, all, NULL, 10000), FERRY_ERANGE);
  assert_true(dev_has(dst, 0, all, 0));
  ferry_store_item it = {.key = key, .dst = near_end, .cap = all};
  assert_int_equal(ferry_store_get_batch(s, &it, 1, 10000), FERRY_ERANGE);
  assert_int_equal(it.status, FERRY_ERANGE);
  assert_true(dev_has(dst, 0, all, 0));
  FR_OK(ferry_cuda_free(dst));
}

/* The producer's keys read here: into host memory, into device memory on both devices (with
 * sentinels after the object, which must survive), a batch into device memory, a view (host, as
 * ever), and the refusals. */
static void read_producer(ferry_store *s) {
  uint8_t *host = malloc(BIG);
  ferry_store_info info = {.size = sizeof info};
  FR_OK(ferry_store_get(s, "cuda/big", NULL, host, BIG, &info, 10000));
  assert_string_equal(info.owner, "cuda-producer");
  assert_true(host_has(host, BIG, SEED_BIG));
  for (int dev = 0; dev <= second_device; dev++) {
    void *dst = dev_alloc(dev, BIG + 100);
    FR_OK(dev_fill(dst, BIG + 100, 0));
    FR_OK(ferry_store_get(s, "cuda/big", NULL, dst, BIG + 100, NULL, 10000));
    assert_true(dev_has(dst, BIG, BIG + 100, SEED_BIG));
    FR_OK(ferry_cuda_free(dst));
  }
  void *d1 = dev_alloc(0, SMALL), *d2 = dev_alloc(second_device, 2 * SMALL);
  ferry_store_item items[] = {{.key = "cuda/b1", .dst = d1, .cap = SMALL},
                              {.key = "cuda/b2", .dst = d2, .cap = 2 * SMALL},
                              {.key = "cuda/big", .dst = host, .cap = BIG}};
  memset(host, 0, BIG);
  FR_OK(ferry_store_get_batch(s, items, 3, 10000));
  assert_int_equal(items[0].bytes, SMALL);
  assert_int_equal(items[1].bytes, 2 * SMALL);
  assert_true(dev_has(d1, SMALL, SMALL, SEED_B1));
  assert_true(dev_has(d2, 2 * SMALL, 2 * SMALL, SEED_B2));
  assert_true(host_has(host, BIG, SEED_BIG));
  const void *view = NULL;
  ferry_store_view *v = NULL;
  FR_OK(ferry_store_get_view(s, "cuda/b1", &view, NULL, &v, 10000));
  assert_int_equal(ferry_mem_where(view, NULL), FERRY_MEM_HOST);
  assert_true(host_has(view, SMALL, SEED_B1));
  ferry_store_view_release(v);
  check_refusals(s, "cuda/b1", SMALL);
  FR_OK(ferry_cuda_free(d1));
  FR_OK(ferry_cuda_free(d2));
  free(host);
}

/* With the producer's device pool: cuda/big lies there. A get into device memory on this host is
 * one device-to-device copy through CUDA IPC and nothing through host memory; over tcp its owner
 * stages it (host to device here). Records that a peer forged with offsets outside the pool's
 * region are refused: by the directory where they run past the region the record names (past its
 * end, wrapping around), by the reader's link where the record lies about the region's size (the
 * get fails stale at its timeout and writes nothing). */
static void read_device_pool(ferry_store *s, const char *url, bool shm) {
  unsigned long long before[4], d[4];
  void *dst = dev_alloc(0, BIG + 100);
  FR_OK(dev_fill(dst, BIG + 100, 0));
  copies_start(before);
  FR_OK(ferry_store_get(s, "cuda/big", NULL, dst, BIG + 100, NULL, 10000));
  if (copies_since(before, d) && shm) { /* device to device through IPC, no host bounce */
    assert_true(d[DTOD_IPC] > 0);
    assert_int_equal(d[HTOD] + d[DTOH], 0);
  } else if (stub_counts) { /* tcp: staged by the owner, host to device here */
    assert_int_equal(d[DTOD_IPC], 0);
    assert_true(d[HTOD] > 0);
  }
  assert_true(dev_has(dst, BIG, BIG + 100, SEED_BIG));
  /* forged records of the owner, pointing outside its device pool */
  ferry_ctx *fc = ctx_open("cuda-forger", NULL, NULL);
  fr_dir *dir = NULL;
  FR_OK(fr_dir_open(fc, url, 10000, &dir));
  const char *key = "cuda/big";
  fr_dir_object rec, bad[3];
  int st = -1;
  FR_OK(fr_dir_obj_get(dir, &key, 1, &rec, &st, 10000));
  assert_int_equal(st, 0);
  for (int i = 0; i < 3; i++) {
    bad[i] = rec;
    snprintf(bad[i].key, sizeof bad[i].key, "forged/%d", i);
  }
  bad[0].offset = rec.region.size - 100; /* runs past the end */
  bad[1].offset = UINT64_MAX - 10;       /* wraps around */
  bad[2].region.size = 1ull << 40;       /* claims a larger region, and reads past the real one */
  bad[2].offset = rec.region.size;
  FR_OK(dev_fill(dst, BIG + 100, 0));
  bool other = false;
  fr_dir_object old;
  for (int i = 0; i < 2; i++) /* outside the region the record names: the directory refuses */
    assert_int_equal(fr_dir_obj_put(dir, &bad[i], 0, &old, &other, 10000), FERRY_EPROTO);
  /* inside the region it claims, past the real one: the reader's link refuses every read */
  FR_OK(fr_dir_obj_put(dir, &bad[2], 0, &old, &other, 10000));
  assert_int_equal(ferry_store_get(s, bad[2].key, NULL, dst, BIG + 100, NULL, 2000), FERRY_ESTALE);
  assert_true(dev_has(dst, 0, BIG + 100, 0));
  fr_dir_close(dir);
  ferry_ctx_close(fc);
  FR_OK(ferry_cuda_free(dst));
}

static void check_other_process(const char *transports, bool devpool) {
  int port = su_free_port();
  char listen[64], url[80], rd[16], wr[16];
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  snprintf(url, sizeof url, "ferry://%s", listen);
  ferry_ctx *c = ctx_open("cuda-reader", listen, transports);
  ferry_store *s = store_open(c, NULL, FERRY_STORE_HOST_DIRECTORY);
  char pool[32];
  snprintf(pool, sizeof pool, "%zu", DEVPOOL_BYTES);
  if (devpool) /* the producer's, by the setting; this reader has none */
    setenv("FERRY_STORE_DEVICE_POOL_BYTES", pool, 1);
  tu_pipe to_child, from_child;
  tu_pipe_open(&to_child);
  tu_pipe_open(&from_child);
  snprintf(rd, sizeof rd, "%d", to_child.rd);
  snprintf(wr, sizeof wr, "%d", from_child.wr);
  pid_t pid = tu_spawn_exec("--role", "producer", url, transports, rd, wr, (char *)NULL);
  unsetenv("FERRY_STORE_DEVICE_POOL_BYTES");
  close(from_child.wr); /* the child's ends: a producer that dies is an EOF at once */
  close(to_child.rd);
  uint8_t step = 255;
  assert_int_equal(tu_pipe_get(&from_child, &step, 1, 60000), 0);
  if (step == 0)
    read_producer(s);
  if (step == 0 && devpool)
    read_device_pool(s, url, strncmp(transports, "shm", 3) == 0);
  tu_pipe_put(&to_child, "Q", 1);
  int st = tu_wait(pid);
  close(to_child.wr);
  close(from_child.rd);
  ferry_store_close(s);
  ferry_ctx_close(c);
  assert_int_equal(step, 0);
  assert_int_equal(st, 0);
}

static void test_other_process_shm(void **state) {
  if (cuda)
    check_other_process("shm,tcp", false);
}

static void test_other_process_tcp(void **state) {
  if (cuda)
    check_other_process("tcp", false);
}

static void test_device_pool_shm(void **state) {
  if (cuda)
    check_other_process("shm,tcp", true);
}

static void test_device_pool_tcp(void **state) {
  if (cuda)
    check_other_process("tcp", true);
}

/* ---- one process: this node's own pool ---- */

static void test_own_pool(void **state) {
  if (!cuda)
    return;
  int port = su_free_port();
  char listen[64];
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  ferry_ctx *c = ctx_open("cuda-own", listen, NULL);
  ferry_store *s = store_open(c, NULL, FERRY_STORE_HOST_DIRECTORY);
  uint8_t *src = dev_alloc(0, BIG), *b2 = dev_alloc(second_device, 2 * SMALL);
  FR_OK(dev_fill(src, BIG, SEED_BIG));
  FR_OK(dev_fill(b2, 2 * SMALL, SEED_B2));
  ferry_tensor_desc d = u8_desc(BIG), d1 = u8_desc(SMALL), d2 = u8_desc(2 * SMALL);
  FR_OK(ferry_store_put(s, "own/big", &d, src, 0, 10000));
  /* a slice of an allocation (the pattern from byte 5 on), and one on the second device */
  ferry_store_put_item items[] = {{"own/b1", &d1, src + 5, -1}, {"own/b2", &d2, b2, -1}};
  FR_OK(ferry_store_put_batch(s, items, 2, 0, 10000));
  /* the source changes after the put: the stored copy does not */
  FR_OK(dev_fill(src, BIG, SEED_B1));
  uint8_t *dst = dev_alloc(second_device, BIG + 64);
  FR_OK(dev_fill(dst, BIG + 64, 0));
  FR_OK(ferry_store_get(s, "own/big", &d, dst, BIG + 64, NULL, 10000));
  assert_true(dev_has(dst, BIG, BIG + 64, SEED_BIG));
  void *out = NULL;
  FR_OK(ferry_store_get_alloc(s, "own/b1", &out, NULL, 10000));
  assert_int_equal(ferry_mem_where(out, NULL), FERRY_MEM_HOST);
  uint8_t *want = malloc(SMALL + 5);
  tu_fill(want, SMALL + 5, SEED_BIG);
  assert_memory_equal(out, want + 5, SMALL);
  free(out);
  free(want);
  ferry_store_item it = {.key = "own/b2", .dst = dst, .cap = BIG + 64};
  FR_OK(dev_fill(dst, BIG + 64, 0));
  FR_OK(ferry_store_get_batch(s, &it, 1, 10000));
  assert_true(dev_has(dst, 2 * SMALL, BIG + 64, SEED_B2));
  /* a put that runs past its allocation stores nothing, and leaves the old version */
  assert_int_equal(ferry_store_put(s, "own/b2", &d, b2, 0, 10000), FERRY_ERANGE);
  ferry_store_info info = {.size = sizeof info};
  FR_OK(ferry_store_stat(s, "own/b2", &info, 10000));
  assert_int_equal(info.bytes, 2 * SMALL);
  check_refusals(s, "own/b2", 2 * SMALL);
  FR_OK(ferry_cuda_free(src));
  FR_OK(ferry_cuda_free(b2));
  FR_OK(ferry_cuda_free(dst));
  ferry_store_close(s);
  ferry_ctx_close(c);
}

/* ---- the device pool, in one process ---- */

/* Whether this store's copy of key holds the pattern of seed: into device memory (on `device`),
 * host memory, get_alloc's and a view's (both host memory: private copies). */
static void dp_check(ferry_store *s, const char *key, size_t n, uint64_t seed, int device) {
  void *dst = dev_alloc(device, n + 64);
  FR_OK(dev_fill(dst, n + 64, 0));
  FR_OK(ferry_store_get(s, key, NULL, dst, n + 64, NULL, 10000));
  assert_true(dev_has(dst, n, n + 64, seed));
  FR_OK(ferry_cuda_free(dst));
  uint8_t *host = malloc(n);
  FR_OK(ferry_store_get(s, key, NULL, host, n, NULL, 10000));
  assert_true(host_has(host, n, seed));
  free(host);
  void *out = NULL;
  FR_OK(ferry_store_get_alloc(s, key, &out, NULL, 10000));
  assert_int_equal(ferry_mem_where(out, NULL), FERRY_MEM_HOST);
  assert_true(host_has(out, n, seed));
  free(out);
  const void *view = NULL;
  ferry_store_view *v = NULL;
  FR_OK(ferry_store_get_view(s, key, &view, NULL, &v, 10000));
  assert_int_equal(ferry_mem_where(view, NULL), FERRY_MEM_HOST);
  assert_true(host_has(view, n, seed));
  assert_int_equal(ferry_store_view_valid(v), 1);
  ferry_store_view_release(v);
}

/* A gauge of ctx's metrics (its first sample), -1 when absent. */
static double gauge(ferry_ctx *c, const char *name) {
  char *text = NULL, want[128];
  size_t len = 0;
  FR_OK(ferry_stats_prometheus(c, &text, &len));
  snprintf(want, sizeof want, "\n%s{", name);
  const char *at = strstr(text, want);
  double v = at && (at = strchr(at + 1, ' ')) ? strtod(at, NULL) : -1;
  ferry_stats_text_free(text);
  return v;
}

/* A put from device memory, and whether it stayed in the device pool (device to device, nothing
 * device to host); true on the real driver, where the stand-in's counts are not to be had. */
static bool dp_put(ferry_store *s, const char *key, const void *src, size_t n) {
  unsigned long long before[4], d[4];
  ferry_tensor_desc desc = u8_desc(n);
  copies_start(before);
  FR_OK(ferry_store_put(s, key, &desc, src, 0, 10000));
  return !copies_since(before, d) || (d[DTOH] == 0 && d[DTOD] > 0);
}

/* ferry_store_opts.device_pool_bytes (room for two objects): a put from device 0 stays there, and
 * every kind of get reads it (into device memory on either device with no host bounce, host
 * memory, get_alloc and views as private host copies); a re-put takes the other half while the
 * replaced copy lingers, which then goes to make room for another put; a put that does not fit
 * goes to the host pool; a deleted object's block is reused; a put from another device goes to
 * the host pool; another context of this process reads through its link (its owner stages the
 * bytes: a process cannot open its own IPC handles). */
static void test_device_pool_own(void **state) {
  if (!cuda)
    return;
  int port = su_free_port();
  char listen[64], url[80];
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  snprintf(url, sizeof url, "ferry://%s", listen);
  ferry_ctx *c = ctx_open("cuda-devpool", listen, NULL),
            *c2 = ctx_open("cuda-devpool-2", NULL, NULL);
  ferry_store_opts o = {.size = sizeof o,
                        .capacity = 64 * MiB,
                        .flags = FERRY_STORE_HOST_DIRECTORY,
                        .device_pool_bytes = 2 * DEVPOOL_BYTES};
  ferry_store *s = NULL, *s2 = NULL;
  FR_OK(ferry_store_open(c, &o, &s));
  uint8_t *a = dev_alloc(0, BIG), *b = dev_alloc(0, BIG), *other = dev_alloc(second_device, SMALL);
  FR_OK(dev_fill(a, BIG, SEED_BIG));
  FR_OK(dev_fill(b, BIG, SEED_B1));
  FR_OK(dev_fill(other, SMALL, SEED_B2));
  unsigned long long before[4], d[4];
  assert_true(gauge(c, "ferry_store_device_pool_capacity_bytes") == 0); /* not made yet */
  assert_true(dp_put(s, "dp/a", a, BIG));
  assert_true(gauge(c, "ferry_store_device_pool_capacity_bytes") >= 2.0 * BIG);
  assert_true(gauge(c, "ferry_store_device_pool_used_bytes") >= BIG);
  copies_start(before);
  void *dst = dev_alloc(second_device, BIG);
  FR_OK(ferry_store_get(s, "dp/a", NULL, dst, BIG, NULL, 10000));
  if (copies_since(before, d)) /* device to device, in this process: no IPC, no host bounce */
    assert_int_equal(d[HTOD] + d[DTOH] + d[DTOD_IPC], 0);
  FR_OK(ferry_cuda_free(dst));
  dp_check(s, "dp/a", BIG, SEED_BIG, second_device);
  /* a re-put takes the pool's other half; its replaced copy lingers in the first */
  FR_OK(dev_fill(a, BIG, SEED_B2));
  assert_true(dp_put(s, "dp/a", a, BIG));
  dp_check(s, "dp/a", BIG, SEED_B2, 0);
  /* the lingering copy goes to make room for dp/b */
  assert_true(dp_put(s, "dp/b", b, BIG));
  dp_check(s, "dp/b", BIG, SEED_B1, second_device);
  /* full: dp/full goes to the host pool, and every object is whole */
  copies_start(before);
  ferry_tensor_desc dbig = u8_desc(BIG), ds = u8_desc(SMALL);
  FR_OK(ferry_store_put(s, "dp/full", &dbig, a, 0, 10000));
  if (copies_since(before, d))
    assert_true(d[DTOH] > 0);
  dp_check(s, "dp/full", BIG, SEED_B2, 0);
  dp_check(s, "dp/a", BIG, SEED_B2, 0);
  dp_check(s, "dp/b", BIG, SEED_B1, 0);
  /* delete, and its block is taken again */
  FR_OK(ferry_store_delete(s, "dp/a", 10000));
  assert_true(dp_put(s, "dp/c", b, BIG));
  dp_check(s, "dp/c", BIG, SEED_B1, 0);
  /* another device: the host pool (on the stand-in's second device) */
  copies_start(before);
  FR_OK(ferry_store_put(s, "dp/other", &ds, other, 0, 10000));
  if (copies_since(before, d) && second_device != 0)
    assert_true(d[DTOH] > 0);
  dp_check(s, "dp/other", SMALL, SEED_B2, 0);
  /* another context of this process, over its link */
  ferry_store_opts o2 = {.size = sizeof o2, .directory = url, .capacity = MiB};
  FR_OK(ferry_store_open(c2, &o2, &s2));
  dp_check(s2, "dp/c", BIG, SEED_B1, second_device);
  ferry_store_close(s2);
  ferry_store_close(s);
  FR_OK(ferry_cuda_free(a));
  FR_OK(ferry_cuda_free(b));
  FR_OK(ferry_cuda_free(other));
  ferry_ctx_close(c2);
  ferry_ctx_close(c);
}

/* A device pool that cannot be made (the stand-in's device memory taken by another allocation)
 * is tried again by a later put once the memory is there (before, one failure turned it off for
 * the store's life): the first put goes to the host pool, and a put after the blocker is freed
 * and the backoff (1 s) passed lands in the pool, read back whole. Stand-in only: the real
 * driver's device memory is not to be filled. */
static void test_device_pool_retried(void **state) {
  if (!cuda || !stub_counts)
    return;
  char name[64];
  uint64_t total = 0;
  FR_OK(ferry_cuda_device(0, name, sizeof name, &total));
  ferry_ctx *c = ctx_open("cuda-devpool-retry", NULL, NULL);
  ferry_store_opts o = {.size = sizeof o,
                        .capacity = 16 * MiB,
                        .flags = FERRY_STORE_HOST_DIRECTORY,
                        .device_pool_bytes = 64 * MiB};
  ferry_store *s = NULL;
  FR_OK(ferry_store_open(c, &o, &s));
  uint8_t *src = dev_alloc(0, SMALL);
  FR_OK(dev_fill(src, SMALL, SEED_B1));
  void *blocker = dev_alloc(0, (size_t)total - 32 * MiB - 2 * SMALL);
  ferry_tensor_desc d = u8_desc(SMALL);
  FR_OK(ferry_store_put(s, "retry/a", &d, src, 0, 10000)); /* no pool: the host pool */
  assert_true(gauge(c, "ferry_store_device_pool_capacity_bytes") == 0);
  FR_OK(ferry_cuda_free(blocker));
  bool made = false;
  for (int i = 0; i < 300 && !made; i++) { /* the retry comes after a 1 s backoff */
    FR_OK(ferry_store_put(s, "retry/a", &d, src, 0, 10000));
    made = gauge(c, "ferry_store_device_pool_capacity_bytes") > 0;
    if (!made)
      su_sleep_ms(100);
  }
  assert_true(made);
  dp_check(s, "retry/a", SMALL, SEED_B1, 0);
  ferry_store_close(s);
  FR_OK(ferry_cuda_free(src));
  ferry_ctx_close(c);
}

/* A put that no eviction could fit in the device pool (larger than the whole pool) goes to the
 * host pool and leaves the replaced copy lingering there alone: gets of that version still under
 * way finish with it. Linger time is an hour here, so only eviction could retire it. */
static void test_device_pool_linger_kept(void **state) {
  if (!cuda)
    return;
  setenv("FERRY_STORE_LINGER_MS", "3600000", 1);
  ferry_ctx *c = ctx_open("cuda-devpool-linger", NULL, NULL);
  ferry_store_opts o = {.size = sizeof o,
                        .capacity = 64 * MiB,
                        .flags = FERRY_STORE_HOST_DIRECTORY,
                        .device_pool_bytes = 2 * DEVPOOL_BYTES};
  ferry_store *s = NULL;
  FR_OK(ferry_store_open(c, &o, &s));
  unsetenv("FERRY_STORE_LINGER_MS");
  size_t huge = 3 * DEVPOOL_BYTES;
  uint8_t *a = dev_alloc(0, BIG), *h = dev_alloc(0, huge);
  FR_OK(dev_fill(a, BIG, SEED_BIG));
  FR_OK(dev_fill(h, huge, SEED_B1));
  assert_true(dp_put(s, "dpl/a", a, BIG));
  assert_true(dp_put(s, "dpl/a", a, BIG)); /* the first copy lingers in the device pool */
  assert_true(gauge(c, "ferry_store_lingering_objects") == 1);
  ferry_tensor_desc dh = u8_desc(huge);
  FR_OK(ferry_store_put(s, "dpl/huge", &dh, h, 0, 10000)); /* the host pool */
  assert_true(gauge(c, "ferry_store_lingering_objects") == 1);
  dp_check(s, "dpl/huge", huge, SEED_B1, 0);
  dp_check(s, "dpl/a", BIG, SEED_BIG, 0);
  ferry_store_close(s);
  FR_OK(ferry_cuda_free(a));
  FR_OK(ferry_cuda_free(h));
  ferry_ctx_close(c);
}

/* A short-lived node (FERRY_STORE_DELEGATE, as the CLI) puts from device memory: the tensor is
 * staged in its own ferry memory and its holder copies it from there. */
static void test_delegate(void **state) {
  if (!cuda)
    return;
  int port = su_free_port();
  char listen[64], url[80];
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  snprintf(url, sizeof url, "ferry://%s", listen);
  ferry_ctx *ch = ctx_open("cuda-holder", listen, NULL), *cd = ctx_open("cuda-cli", NULL, NULL);
  ferry_store *h = store_open(ch, NULL, FERRY_STORE_HOST_DIRECTORY | FERRY_STORE_HOLDER);
  ferry_store *d = store_open(cd, url, FERRY_STORE_DELEGATE);
  void *src = dev_alloc(second_device, SPAN), *dst = dev_alloc(0, SMALL + 8);
  FR_OK(dev_fill(src, SPAN, SEED_B1));
  ferry_tensor_desc desc = u8_desc(SMALL), longer = u8_desc(SPAN + 1);
  FR_OK(ferry_store_put(d, "cli/dev", &desc, src, 0, 10000));
  assert_int_equal(ferry_store_put(d, "cli/short", &longer, src, 0, 10000), FERRY_ERANGE);
  ferry_store_close(d);
  ferry_ctx_close(cd);
  ferry_store_info info = {.size = sizeof info};
  FR_OK(dev_fill(dst, SMALL + 8, 0));
  FR_OK(ferry_store_get(h, "cli/dev", NULL, dst, SMALL + 8, &info, 10000));
  assert_string_equal(info.owner, "cuda-holder");
  assert_true(dev_has(dst, SMALL, SMALL + 8, SEED_B1));
  assert_int_equal(ferry_store_exists(h, "cli/short", 10000), 0);
  FR_OK(ferry_cuda_free(src));
  FR_OK(ferry_cuda_free(dst));
  ferry_store_close(h);
  ferry_ctx_close(ch);
}

/* ---- mq ---- */

#define MSG_INLINE ((size_t)200)
#define MSG_POOL ((size_t)MiB + 3) /* over FERRY_MQ_INLINE_BYTES: through the pool over shm */

static ferry_mq *mq_open(ferry_ctx *c, const char *dir) {
  ferry_mq_opts o = {
      .size = sizeof o, .directory = dir, .flags = dir ? 0 : FERRY_MQ_HOST_DIRECTORY};
  ferry_mq *mq = NULL;
  FR_OK(ferry_mq_open(c, &o, &mq));
  return mq;
}

/* A message's payload holds the pattern of seed: as received (host memory), and copied into
 * device memory with ferry_mq_msg_copy (sentinels after it intact). */
static void check_msg(const ferry_mq_msg *m, size_t len, uint64_t seed) {
  assert_int_equal(m->len, len);
  assert_int_equal(ferry_mem_where(m->data, NULL), FERRY_MEM_HOST);
  assert_true(host_has(m->data, len, seed));
  void *dst = dev_alloc(second_device, len + 32);
  FR_OK(dev_fill(dst, len + 32, 0));
  FR_OK(ferry_mq_msg_copy(m, dst, len + 32));
  assert_true(dev_has(dst, len, len + 32, seed));
  FR_OK(ferry_cuda_free(dst));
}

/* ferry_mq_msg_copy refuses a cap too small and a device allocation too short, writing nothing. */
static void check_copy_refusals(const ferry_mq_msg *m) {
  size_t all = SPAN;
  uint8_t *dst = dev_alloc(0, all);
  FR_OK(dev_fill(dst, all, 0));
  assert_int_equal(ferry_mq_msg_copy(m, dst, m->len - 1), FERRY_ERANGE);
  assert_int_equal(ferry_mq_msg_copy(m, dst + all - (m->len - 1), all), FERRY_ERANGE);
  assert_true(dev_has(dst, 0, all, 0));
  FR_OK(ferry_cuda_free(dst));
}

static void check_mq(const char *transports) {
  ferry_ctx *ca = ctx_open("cuda-pub", NULL, transports),
            *cb = ctx_open("cuda-sub", NULL, transports);
  const char *tcp = strstr(ferry_ctx_address(ca), "tcp://");
  assert_non_null(tcp);
  char url[128];
  snprintf(url, sizeof url, "ferry://%.*s", (int)strcspn(tcp + 6, ","), tcp + 6);
  ferry_mq *pub = mq_open(ca, NULL), *sub = mq_open(cb, url);
  FR_OK(ferry_mq_subscribe(sub, "cuda/t", 10000));
  FR_OK(ferry_mq_wait_subscribers(pub, "cuda/t", 1, 10000));
  uint8_t *small = dev_alloc(0, MSG_INLINE), *large = dev_alloc(second_device, SPAN);
  FR_OK(dev_fill(small, MSG_INLINE, 21));
  FR_OK(dev_fill(large, SPAN, 22)); /* its first MSG_POOL bytes: the pattern of MSG_POOL bytes */
  ferry_tensor_desc td = {.dtype = FERRY_DTYPE_F32, .ndim = 2, .shape = {3, 1000}};
  FR_OK(ferry_mq_publish(pub, "cuda/t", small, MSG_INLINE, 10000));
  FR_OK(ferry_mq_publish(pub, "cuda/t", large, MSG_POOL, 10000));
  FR_OK(ferry_mq_publish_tensor(pub, "cuda/t", &td, large, 10000));
  /* runs past its allocation: refused, nobody receives it (the next message is the marker) */
  assert_int_equal(ferry_mq_publish(pub, "cuda/t", large, SPAN + 1, 10000), FERRY_ERANGE);
  ferry_tensor_desc too_big = {.dtype = FERRY_DTYPE_U8, .ndim = 1, .shape = {SPAN + 1}};
  assert_int_equal(ferry_mq_publish_tensor(pub, "cuda/t", &too_big, large, 10000), FERRY_ERANGE);
  uint64_t marker = 0x6d61726b6572;
  FR_OK(ferry_mq_publish(pub, "cuda/t", &marker, sizeof marker, 10000));
  ferry_mq_msg *m[4] = {0};
  for (int i = 0; i < 4; i++)
    FR_OK(ferry_mq_recv(sub, &m[i], 10000));
  check_msg(m[0], MSG_INLINE, 21);
  check_msg(m[1], MSG_POOL, 22);
  assert_int_equal(m[2]->is_tensor, 1);
  assert_int_equal(m[2]->desc.shape[1], 1000);
  uint8_t *want = malloc(MSG_POOL);
  tu_fill(want, MSG_POOL, 22);
  assert_int_equal(m[2]->len, 12000);
  assert_memory_equal(m[2]->data, want, 12000);
  free(want);
  assert_int_equal(m[3]->len, sizeof marker);
  assert_memory_equal(m[3]->data, &marker, sizeof marker);
  uint64_t host = 0;
  FR_OK(ferry_mq_msg_copy(m[3], &host, sizeof host));
  assert_int_equal(host, marker);
  check_copy_refusals(m[1]);
  check_copy_refusals(m[0]);
  for (int i = 0; i < 4; i++)
    ferry_mq_msg_free(m[i]);
  FR_OK(ferry_cuda_free(small));
  FR_OK(ferry_cuda_free(large));
  ferry_mq_close(sub);
  ferry_mq_close(pub);
  ferry_ctx_close(cb);
  ferry_ctx_close(ca);
}

static void test_mq_shm(void **state) {
  if (cuda)
    check_mq("shm,tcp");
}

static void test_mq_tcp(void **state) {
  if (cuda)
    check_mq("tcp");
}

/* ---- a driver that another library loaded first ---- */

/* `--role foreign`: device memory from the driver's own calls (as torch makes it, before ferry
 * loaded anything), then a put of it and a get into it: ferry's first look at a pointer loads
 * the driver and sees device memory. Returns the number of the step that failed, 0 when none
 * did (10 when no driver). */
static int role_foreign(void) {
  const char *lib = getenv("FERRY_CUDA_LIB");
  void *h = dlopen(lib && *lib ? lib : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  int (*init)(unsigned) = h ? (int (*)(unsigned))dlsym(h, "cuInit") : NULL;
  int (*get)(int *, int) = h ? (int (*)(int *, int))dlsym(h, "cuDeviceGet") : NULL;
  int (*retain)(void **, int) =
      h ? (int (*)(void **, int))dlsym(h, "cuDevicePrimaryCtxRetain") : NULL;
  int (*set)(void *) = h ? (int (*)(void *))dlsym(h, "cuCtxSetCurrent") : NULL;
  int (*alloc)(unsigned long long *, size_t) =
      h ? (int (*)(unsigned long long *, size_t))dlsym(h, "cuMemAlloc_v2") : NULL;
  int (*htod)(unsigned long long, const void *, size_t) =
      h ? (int (*)(unsigned long long, const void *, size_t))dlsym(h, "cuMemcpyHtoD_v2") : NULL;
  int dev = 0;
  void *cctx = NULL;
  unsigned long long a = 0, b = 0;
  uint8_t *host = malloc(SMALL);
  tu_fill(host, SMALL, SEED_B2);
  if (!init || !get || !retain || !set || !alloc || !htod || init(0) || get(&dev, 0) ||
      retain(&cctx, dev) || set(cctx) || alloc(&a, SMALL) || alloc(&b, SMALL + 8) ||
      htod(a, host, SMALL))
    return 10;
  int port = su_free_port();
  char listen[64];
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  ferry_ctx *c = ctx_open("foreign", listen, NULL);
  ferry_store *s = store_open(c, NULL, FERRY_STORE_HOST_DIRECTORY);
  ferry_tensor_desc d = u8_desc(SMALL);
  int step = 1;
  void *src = (void *)(uintptr_t)a, *dst = (void *)(uintptr_t)b;
  if (ferry_store_put(s, "foreign/k", &d, src, 0, 10000) == 0 &&
      (step = 2, ferry_mem_where(src, NULL)) == FERRY_MEM_CUDA &&
      (step = 3, dev_fill(dst, SMALL + 8, 0)) == 0 &&
      (step = 4, ferry_store_get(s, "foreign/k", NULL, dst, SMALL + 8, NULL, 10000)) == 0 &&
      (step = 5, dev_has(dst, SMALL, SMALL + 8, SEED_B2)) &&
      (step = 6, ferry_store_get(s, "foreign/k", NULL, host, SMALL, NULL, 10000)) == 0 &&
      (step = 7, host_has(host, SMALL, SEED_B2)))
    step = 0;
  if (step)
    fprintf(stderr, "foreign: step %d: %s\n", step, ferry_last_error());
  free(host);
  ferry_store_close(s);
  ferry_ctx_close(c);
  return step;
}

static void test_foreign_driver(void **state) {
  if (!cuda)
    return;
  pid_t pid = tu_spawn_exec("--role", "foreign", (char *)NULL);
  assert_int_equal(tu_wait(pid), 0);
}

/* ---- no driver: host memory as before ---- */

/* `--role nodriver`, run with FERRY_CUDA=off: no driver is loaded, host pointers are host
 * memory, and a store and mq round trip (ferry_mq_msg_copy into host memory included) works as
 * it did. Returns the number of the step that failed, 0 when none did. */
static int role_nodriver(void) {
  ferry_cuda_info ci = {.size = sizeof ci};
  uint8_t buf[4096], got[4096] = {0};
  tu_fill(buf, sizeof buf, 5);
  if (ferry_cuda_info_get(&ci) != 0 || ci.found || ferry_mem_where(buf, NULL) != FERRY_MEM_HOST)
    return 1;
  int port = su_free_port();
  char listen[64], url[80];
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  snprintf(url, sizeof url, "ferry://%s", listen);
  ferry_ctx *c = ctx_open("nodriver", listen, NULL), *c2 = ctx_open("nodriver-sub", NULL, NULL);
  ferry_store *s = store_open(c, NULL, FERRY_STORE_HOST_DIRECTORY);
  ferry_tensor_desc d = u8_desc(sizeof buf);
  int step = 2;
  if (ferry_store_put(s, "host/k", &d, buf, 0, 10000) == 0 &&
      (step = 3, ferry_store_get(s, "host/k", NULL, got, sizeof got, NULL, 10000)) == 0 &&
      (step = 4, memcmp(got, buf, sizeof buf)) == 0 &&
      (step = 5, ferry_store_get(s, "host/k", NULL, got, 100, NULL, 10000)) == FERRY_ERANGE)
    step = 0;
  ferry_mq *pub = step ? NULL : mq_open(c, url), *sub = step ? NULL : mq_open(c2, url);
  ferry_mq_msg *m = NULL;
  memset(got, 0, sizeof got);
  if (step == 0 && (step = 6, ferry_mq_subscribe(sub, "host/t", 10000)) == 0 &&
      (step = 7, ferry_mq_wait_subscribers(pub, "host/t", 1, 10000)) == 0 &&
      (step = 8, ferry_mq_publish(pub, "host/t", buf, sizeof buf, 10000)) == 0 &&
      (step = 9, ferry_mq_recv(sub, &m, 10000)) == 0 &&
      (step = 10, ferry_mq_msg_copy(m, got, sizeof got)) == 0 &&
      (step = 11, memcmp(got, buf, sizeof buf)) == 0 &&
      (step = 12, ferry_mq_msg_copy(m, got, 10)) == FERRY_ERANGE)
    step = 0;
  if (step)
    fprintf(stderr, "nodriver: step %d: %s\n", step, ferry_last_error());
  ferry_mq_msg_free(m);
  ferry_mq_close(sub);
  ferry_mq_close(pub);
  ferry_store_close(s);
  ferry_ctx_close(c2);
  ferry_ctx_close(c);
  return step;
}

static void test_no_driver(void **state) {
  setenv("FERRY_CUDA", "off", 1);
  pid_t pid = tu_spawn_exec("--role", "nodriver", (char *)NULL);
  unsetenv("FERRY_CUDA");
  assert_int_equal(tu_wait(pid), 0);
}

int main(int argc, char **argv) {
  if (argc >= 3 && strcmp(argv[1], "--role") == 0)
    return strcmp(argv[2], "producer") == 0 && argc == 7 ? role_producer(argv)
           : strcmp(argv[2], "foreign") == 0             ? role_foreign()
           : strcmp(argv[2], "nodriver") == 0            ? role_nodriver()
                                                         : 2;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_own_pool),
      cmocka_unit_test(test_delegate),
      cmocka_unit_test(test_other_process_shm),
      cmocka_unit_test(test_other_process_tcp),
      cmocka_unit_test(test_device_pool_own),
      cmocka_unit_test(test_device_pool_shm),
      cmocka_unit_test(test_device_pool_tcp),
      cmocka_unit_test(test_device_pool_linger_kept),
      cmocka_unit_test(test_device_pool_retried),
      cmocka_unit_test(test_mq_shm),
      cmocka_unit_test(test_mq_tcp),
      cmocka_unit_test(test_foreign_driver),
      cmocka_unit_test(test_no_driver),
  };
  tu_filter();
  return cmocka_run_group_tests(tests, group_setup, NULL);
}
