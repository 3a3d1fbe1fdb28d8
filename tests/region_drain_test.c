/*
 * Deregistration against transfers in flight (session 20): once ferry_deregister (or
 * ferry_store_close, for the store's device pool) returned, no thread of this process touches the
 * memory any more, and its owner may free it. Each case pauses a thread of the owner at one step
 * of a transfer of registered memory (the test hooks of core/region.h), deregisters and frees the
 * memory there, and lets the transfer go on: a tcp read staged by the server thread (host and
 * CUDA memory, and the store's device pool closed under a get) is refused with FERRY_ENOTFOUND
 * instead of sending freed bytes; a read paused in the middle of its copy holds the
 * deregistration until the copy is done, and is read whole; a peer's write paused before its
 * bytes land is discarded and refused. The steps are ordered by the hooks, never by time. Under
 * ASan, a freed byte touched is a heap-use-after-free report; on the stand-in driver, a copy from
 * freed device memory faults.
 */
// ferry-test: threaded
// ferry-test: cuda
#include "core/region.h"
#include "linkutil.h"
#include "storeutil.h"

#include <pthread.h>
#include <string.h>

#define MiB (1024 * 1024)

static bool cuda; /* a driver (the stand-in, or FERRY_TEST_CUDA=driver) is loaded: group_setup */

/* ---- a pause at one hook: the hooked thread waits there until the test lets it go ---- */

static struct {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  uint64_t region;        /* the region paused on (0: any CUDA region) */
  bool reached, released; /* the hooked thread is there; it may go on */
  bool draining;          /* a deregistration waits for the paused thread */
} pause_at = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};

static bool pause_matches(const fr_region *r) {
  return pause_at.region ? r->id == pause_at.region : r->kind == FERRY_MEM_CUDA;
}

/* The hook: the first matching call waits until pause_release. */
static void pause_here(const fr_region *r) {
  pthread_mutex_lock(&pause_at.lock);
  if (pause_matches(r) && !pause_at.reached) {
    pause_at.reached = true;
    pthread_cond_broadcast(&pause_at.cond);
    while (!pause_at.released)
      pthread_cond_wait(&pause_at.cond, &pause_at.lock);
  }
  pthread_mutex_unlock(&pause_at.lock);
}

static void on_draining(const fr_region *r) {
  pthread_mutex_lock(&pause_at.lock);
  if (pause_matches(r))
    pause_at.draining = true;
  pthread_cond_broadcast(&pause_at.cond);
  pthread_mutex_unlock(&pause_at.lock);
}

static void pause_arm(uint64_t region) {
  pthread_mutex_lock(&pause_at.lock);
  pause_at.region = region;
  pause_at.reached = pause_at.released = pause_at.draining = false;
  pthread_mutex_unlock(&pause_at.lock);
  fr_region_test_draining = on_draining;
}

/* Waits until the hooked thread is there (reached) or a deregistration waits (draining). */
static void pause_wait(bool *flag) {
  pthread_mutex_lock(&pause_at.lock);
  while (!*flag)
    pthread_cond_wait(&pause_at.cond, &pause_at.lock);
  pthread_mutex_unlock(&pause_at.lock);
}

static void pause_release(void) {
  pthread_mutex_lock(&pause_at.lock);
  pause_at.released = true;
  pthread_cond_broadcast(&pause_at.cond);
  pthread_mutex_unlock(&pause_at.lock);
}

static void hooks_off(void) {
  fr_region_test_serving = fr_region_test_copying = fr_region_test_receiving = NULL;
  fr_region_test_draining = NULL;
}

/* ---- a read or write on its own thread ---- */

typedef struct transfer {
  ferry_link *link;
  ferry_region_ref ref;
  void *buf;
  size_t len;
  bool write;
  int rc;
  pthread_t thread;
} transfer;

static void *transfer_main(void *arg) {
  transfer *t = arg;
  t->rc = t->write ? ferry_write(t->link, &t->ref, 0, t->buf, t->len, 60000)
                   : ferry_read(t->link, &t->ref, 0, t->buf, t->len, 60000);
  return NULL;
}

static void transfer_start(transfer *t) {
  assert_int_equal(pthread_create(&t->thread, NULL, transfer_main, t), 0);
}

typedef struct deregistration {
  ferry_ctx *ctx;
  uint64_t id;
  int rc;
  pthread_t thread;
} deregistration;

static void *deregister_main(void *arg) {
  deregistration *d = arg;
  d->rc = ferry_deregister(d->ctx, d->id);
  return NULL;
}

/* ---- cases ---- */

/* A tcp read of registered host memory, larger than an inline answer (the server thread stages
 * it), paused once that thread took it: the memory is deregistered and freed there; the read
 * goes on and is refused, no byte of the freed memory sent (ASan: a heap-use-after-free before
 * the fix, the send reading the freed buffer). */
static void test_read_after_deregister_host(void **state) {
  (void)state;
  lt_pair p;
  lt_pair_open(&p, "tcp");
  size_t n = MiB;
  uint8_t *mem = malloc(n), *dst = malloc(n);
  assert_true(mem && dst);
  tu_fill(mem, n, 3);
  transfer t = {.link = p.ab, .buf = dst, .len = n};
  FR_OK(ferry_register(p.b, mem, n, &t.ref));
  pause_arm(t.ref.id);
  fr_region_test_serving = pause_here;
  transfer_start(&t);
  pause_wait(&pause_at.reached);
  FR_OK(ferry_deregister(p.b, t.ref.id));
  free(mem); /* the caller's right, once ferry_deregister returned */
  pause_release();
  pthread_join(t.thread, NULL);
  hooks_off();
  assert_int_equal(t.rc, FERRY_ENOTFOUND);
  free(dst);
  lt_pair_close(&p);
}

/* The same read, paused inside its copy of the bytes (one chunk: the whole read): the
 * deregistration waits for the copy, which then finishes, and the read arrives whole; the
 * memory is freed only after ferry_deregister returned. */
static void test_deregister_waits_for_copy(void **state) {
  (void)state;
  lt_pair p;
  lt_pair_open(&p, "tcp");
  size_t n = 256 * 1024; /* above the inline answer's 64 KiB, one chunk of the server's copy */
  uint8_t *mem = malloc(n), *dst = malloc(n), *want = malloc(n);
  assert_true(mem && dst && want);
  tu_fill(mem, n, 5);
  memcpy(want, mem, n);
  transfer t = {.link = p.ab, .buf = dst, .len = n};
  FR_OK(ferry_register(p.b, mem, n, &t.ref));
  pause_arm(t.ref.id);
  fr_region_test_copying = pause_here;
  transfer_start(&t);
  pause_wait(&pause_at.reached);
  deregistration d = {.ctx = p.b, .id = t.ref.id};
  assert_int_equal(pthread_create(&d.thread, NULL, deregister_main, &d), 0);
  pause_wait(&pause_at.draining); /* it waits for the paused copy */
  pause_release();
  pthread_join(d.thread, NULL);
  FR_OK(d.rc);
  free(mem);
  pthread_join(t.thread, NULL);
  hooks_off();
  FR_OK(t.rc);
  assert_memory_equal(dst, want, n);
  free(dst);
  free(want);
  lt_pair_close(&p);
}

/* A peer's write over tcp into registered host memory, paused before its first bytes land: the
 * memory is deregistered and freed there; the rest of the write is discarded and refused
 * (before the fix, the receive wrote into the freed buffer). */
static void test_write_after_deregister(void **state) {
  (void)state;
  lt_pair p;
  lt_pair_open(&p, "tcp");
  size_t n = MiB;
  uint8_t *mem = malloc(n), *src = malloc(n);
  assert_true(mem && src);
  tu_fill(src, n, 9);
  transfer t = {.link = p.ab, .buf = src, .len = n, .write = true};
  FR_OK(ferry_register(p.b, mem, n, &t.ref));
  pause_arm(t.ref.id);
  fr_region_test_receiving = pause_here;
  transfer_start(&t);
  pause_wait(&pause_at.reached);
  FR_OK(ferry_deregister(p.b, t.ref.id));
  free(mem);
  pause_release();
  pthread_join(t.thread, NULL);
  hooks_off();
  assert_int_equal(t.rc, FERRY_ENOTFOUND);
  free(src);
  lt_pair_close(&p);
}

/* Registered CUDA memory read over tcp (staged by the owner's server thread through host
 * memory), deregistered and freed (cuMemFree) once that thread took the read: refused, and no
 * copy from the freed allocation (the stand-in faults on one). */
static void test_read_after_deregister_cuda(void **state) {
  (void)state;
  if (!cuda)
    return;
  lt_pair p;
  lt_pair_open(&p, "tcp");
  size_t n = MiB;
  void *dev = NULL;
  uint8_t *dst = malloc(n);
  FR_OK(ferry_cuda_alloc(0, n, &dev));
  transfer t = {.link = p.ab, .buf = dst, .len = n};
  FR_OK(ferry_register(p.b, dev, n, &t.ref));
  pause_arm(t.ref.id);
  fr_region_test_serving = pause_here;
  transfer_start(&t);
  pause_wait(&pause_at.reached);
  FR_OK(ferry_deregister(p.b, t.ref.id));
  FR_OK(ferry_cuda_free(dev));
  pause_release();
  pthread_join(t.thread, NULL);
  hooks_off();
  assert_int_equal(t.rc, FERRY_ENOTFOUND);
  free(dst);
  lt_pair_close(&p);
}

/* Registered CUDA memory read over tcp, paused inside the owner's staged copy of its one chunk
 * (the copy about to be queued): the deregistration waits for the copy to be queued and then
 * for it to finish (the region's copy event), the read arrives whole, and the allocation is
 * freed only after ferry_deregister returned. */
static void test_deregister_waits_for_device_copy(void **state) {
  (void)state;
  if (!cuda)
    return;
  lt_pair p;
  lt_pair_open(&p, "tcp");
  size_t n = MiB; /* one chunk of FERRY_CUDA_CHUNK_BYTES (4 MiB) */
  void *dev = NULL;
  uint8_t *dst = malloc(n), *want = malloc(n);
  assert_true(dst && want);
  tu_fill(want, n, 6);
  FR_OK(ferry_cuda_alloc(0, n, &dev));
  FR_OK(ferry_mem_copy(dev, want, n));
  transfer t = {.link = p.ab, .buf = dst, .len = n};
  FR_OK(ferry_register(p.b, dev, n, &t.ref));
  pause_arm(t.ref.id);
  fr_region_test_copying = pause_here;
  transfer_start(&t);
  pause_wait(&pause_at.reached);
  deregistration d = {.ctx = p.b, .id = t.ref.id};
  assert_int_equal(pthread_create(&d.thread, NULL, deregister_main, &d), 0);
  pause_wait(&pause_at.draining);
  pause_release();
  pthread_join(d.thread, NULL);
  FR_OK(d.rc);
  FR_OK(ferry_cuda_free(dev));
  pthread_join(t.thread, NULL);
  hooks_off();
  FR_OK(t.rc);
  assert_memory_equal(dst, want, n);
  free(dst);
  free(want);
  lt_pair_close(&p);
}

typedef struct store_get {
  ferry_store *store;
  void *dst;
  size_t len;
  int rc;
  pthread_t thread;
} store_get;

static void *store_get_main(void *arg) {
  store_get *g = arg;
  g->rc = ferry_store_get(g->store, "drain/x", NULL, g->dst, g->len, NULL, 30000);
  return NULL;
}

/* The store's device pool (the review of session 19): a get over tcp of an object held there,
 * paused once the owner's server thread took the read, and the owner's store closed meanwhile
 * (the pool deregistered and freed): the get fails, and nothing copies from the freed pool. */
static void test_store_close_during_device_get(void **state) {
  (void)state;
  if (!cuda)
    return;
  int port = su_free_port();
  char listen[64], url[80];
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  snprintf(url, sizeof url, "ferry://%s", listen);
  /* the directory on a ctx of its own, which outlives the owner's store */
  ferry_ctx_opts co = {.size = sizeof co,
                       .name = "drain-dir",
                       .tcp_listen = listen,
                       .transports = "tcp",
                       .token = ""};
  ferry_ctx *cd = NULL, *c = NULL, *c2 = NULL;
  FR_OK(ferry_ctx_open(&co, &cd));
  co.tcp_listen = NULL;
  co.name = "drain-owner";
  FR_OK(ferry_ctx_open(&co, &c));
  co.name = "drain-reader";
  FR_OK(ferry_ctx_open(&co, &c2));
  size_t n = 2 * MiB;
  ferry_store_opts od = {.size = sizeof od, .capacity = MiB, .flags = FERRY_STORE_HOST_DIRECTORY};
  ferry_store_opts o = {
      .size = sizeof o, .directory = url, .capacity = 16 * MiB, .device_pool_bytes = 4 * MiB};
  ferry_store_opts o2 = {.size = sizeof o2, .directory = url, .capacity = MiB};
  ferry_store *sd = NULL, *s = NULL, *s2 = NULL;
  FR_OK(ferry_store_open(cd, &od, &sd));
  FR_OK(ferry_store_open(c, &o, &s));
  FR_OK(ferry_store_open(c2, &o2, &s2));
  void *dev = NULL;
  FR_OK(ferry_cuda_alloc(0, n, &dev));
  uint8_t *host = malloc(n);
  tu_fill(host, n, 4);
  FR_OK(ferry_mem_copy(dev, host, n));
  ferry_tensor_desc desc = {.dtype = FERRY_DTYPE_U8, .ndim = 1, .shape = {n}};
  FR_OK(ferry_store_put(s, "drain/x", &desc, dev, 0, 10000));
  store_get g = {.store = s2, .dst = host, .len = n};
  pause_arm(0); /* the first CUDA region the server thread serves: the pool */
  fr_region_test_serving = pause_here;
  assert_int_equal(pthread_create(&g.thread, NULL, store_get_main, &g), 0);
  pause_wait(&pause_at.reached);
  ferry_store_close(s); /* deregisters and frees the device pool */
  pause_release();
  pthread_join(g.thread, NULL);
  hooks_off();
  assert_int_not_equal(g.rc, 0);
  ferry_store_close(s2);
  ferry_store_close(sd);
  FR_OK(ferry_cuda_free(dev));
  free(host);
  ferry_ctx_close(c2);
  ferry_ctx_close(c);
  ferry_ctx_close(cd);
}

static int group_setup(void **state) {
  (void)state;
  cuda = tu_cuda_use();
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_read_after_deregister_host),
      cmocka_unit_test(test_deregister_waits_for_copy),
      cmocka_unit_test(test_write_after_deregister),
      cmocka_unit_test(test_read_after_deregister_cuda),
      cmocka_unit_test(test_deregister_waits_for_device_copy),
      cmocka_unit_test(test_store_close_during_device_get),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, group_setup, NULL);
}
