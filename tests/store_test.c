/*
 * The store: every operation on both directory backends (embedded, hosted in-process, and a
 * private Redis), producer and consumer in separate processes over shm, across two network
 * namespaces over tcp, batch gets, replacement under concurrent reads (never torn), and faults:
 * an owner SIGKILLed during gets or SIGSTOPped, a restarted directory, Redis SIGKILLed and
 * restarted, Redis unreachable, no directory, and bad
 * input (unknown keys, wrong dtypes, oversized tensors); and the order of puts that return before
 * the directory answered them, and lookups answered from a reader's cache only while nothing
 * changed. No timing assertions: waits poll with
 * deadlines. Helper roles re-run this binary inside namespaces (`--role ...`).
 */
// ferry-test: threaded
#include "bench/netns.h"
#include "core/channels.h"
#include "store/service.h"
#include "redisutil.h"
#include "storeutil.h"
#include "etcdutil.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>

#define MiB (1024 * 1024)

static char self_exe[4096];
static char cli_path[4096]; /* the ferry binary: FERRY_CLI, or next to the tests */

/* ---- helpers ---- */

static ferry_ctx *open_ctx(const char *name, const char *listen) {
  ferry_ctx_opts o = {.size = sizeof o, .name = name, .tcp_listen = listen, .token = ""};
  ferry_ctx *c = NULL;
  FR_OK(ferry_ctx_open(&o, &c));
  return c;
}

static ferry_store *open_store(ferry_ctx *c, const char *url, uint32_t flags, uint64_t cap,
                               int lease_ms) {
  ferry_store_opts o = {
      .size = sizeof o, .directory = url, .capacity = cap, .lease_ms = lease_ms, .flags = flags};
  ferry_store *s = NULL;
  FR_OK(ferry_store_open(c, &o, &s));
  return s;
}

static ferry_tensor_desc u8_desc(uint64_t a, uint64_t b) {
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_U8, .ndim = 2, .shape = {a, b}};
  return d;
}

static bool pattern_ok(const uint8_t *p, size_t n, uint64_t seed) {
  uint8_t *want = malloc(n ? n : 1);
  tu_fill(want, n, seed);
  bool ok = memcmp(p, want, n) == 0;
  free(want);
  return ok;
}

/* A directory in a child process (`ferry serve`, exec'd: a clean process even when this one
 * has threads), listening on port; killed by the caller. */
static pid_t start_directory(int port) {
  char listen[64];
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  pid_t pid = tu_fork();
  if (pid == 0) {
    int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    execl(cli_path, cli_path, "serve", "--listen", listen, "--capacity", "1048576", (char *)NULL);
    _exit(127);
  }
  for (int i = 0; i < 1000 && !su_port_open(port); i++) /* up to 10 s: a loaded ASan build */
    su_sleep_ms(10);
  return pid;
}

static void stop_child(pid_t pid) {
  kill(pid, SIGKILL);
  tu_wait(pid);
}

/* The fleet's directory for a test: `ferry serve` (embedded) or a private redis-server, each
 * restartable on the same port. */
typedef struct dirsvc {
  bool redis;
  pid_t pid;
  su_redis r;
  int port;
  char url[80];
} dirsvc;

static bool dirsvc_start(dirsvc *d) {
  if (d->redis) {
    if (!su_redis_start_on(&d->r, d->port))
      return false;
    d->port = d->r.port;
    snprintf(d->url, sizeof d->url, "%s", d->r.url);
    return true;
  }
  d->port = d->port ? d->port : su_free_port();
  d->pid = start_directory(d->port);
  snprintf(d->url, sizeof d->url, "ferry://127.0.0.1:%d", d->port);
  return true;
}

static void dirsvc_stop(dirsvc *d) {
  if (d->redis)
    su_redis_stop(&d->r);
  else
    stop_child(d->pid);
}

/* ---- every operation, on a pair of stores sharing one directory ---- */

typedef struct pair {
  ferry_ctx *ca, *cb;
  ferry_store *a, *b;
  char url[80];
} pair;

static void pair_open(pair *p, const char *url) {
  char listen[64], hosted[80];
  int port = su_free_port();
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  snprintf(hosted, sizeof hosted, "ferry://127.0.0.1:%d", port);
  p->ca = open_ctx("node-a", url ? NULL : listen);
  p->cb = open_ctx("node-b", NULL);
  snprintf(p->url, sizeof p->url, "%s", url ? url : hosted);
  p->a = open_store(p->ca, url, FERRY_STORE_HOLDER | (url ? 0 : FERRY_STORE_HOST_DIRECTORY),
                    8 * MiB, 0);
  p->b = open_store(p->cb, p->url, 0, 8 * MiB, 0);
}

static void pair_close(pair *p) {
  ferry_store_close(p->b);
  ferry_store_close(p->a);
  ferry_ctx_close(p->cb);
  ferry_ctx_close(p->ca);
}

static void check_put_get(pair *p) {
  ferry_tensor_desc d = u8_desc(64, 1024);
  uint8_t *src = malloc(64 * 1024), *dst = malloc(64 * 1024);
  tu_fill(src, 64 * 1024, 1);
  FR_OK(ferry_store_put(p->a, "t/copy", &d, src, 0, -1));
  memset(src, 0, 64 * 1024); /* a copy: the caller's buffer is free again */
  ferry_store_info info = {.size = sizeof info};
  FR_OK(ferry_store_get(p->b, "t/copy", &d, dst, 64 * 1024, &info, -1));
  assert_true(pattern_ok(dst, 64 * 1024, 1));
  assert_string_equal(info.owner, "node-a");
  assert_int_equal(info.bytes, 64 * 1024);
  /* in place: ferry memory is published without a copy, and read from there */
  void *mem;
  FR_OK(ferry_alloc(p->ca, 64 * 1024, &mem));
  tu_fill(mem, 64 * 1024, 2);
  FR_OK(ferry_store_put(p->a, "t/inplace", &d, mem, 0, -1));
  void *got = NULL;
  FR_OK(ferry_store_get_alloc(p->b, "t/inplace", &got, NULL, -1));
  assert_true(pattern_ok(got, 64 * 1024, 2));
  free(got);
  /* the owner reads its own objects too */
  FR_OK(ferry_store_get(p->a, "t/inplace", NULL, dst, 64 * 1024, NULL, -1));
  assert_true(pattern_ok(dst, 64 * 1024, 2));
  /* re-put replaces: new bytes, new generation */
  uint64_t gen = info.generation;
  tu_fill(src, 64 * 1024, 3);
  FR_OK(ferry_store_put(p->a, "t/copy", &d, src, 0, -1));
  FR_OK(ferry_store_get(p->b, "t/copy", NULL, dst, 64 * 1024, &info, -1));
  assert_true(pattern_ok(dst, 64 * 1024, 3));
  assert_true(info.generation != gen);
  /* an empty tensor */
  ferry_tensor_desc e = u8_desc(0, 5);
  FR_OK(ferry_store_put(p->a, "t/empty", &e, NULL, 0, -1));
  FR_OK(ferry_store_get(p->b, "t/empty", &e, NULL, 0, &info, -1));
  assert_int_equal(info.bytes, 0);
  FR_OK(ferry_store_delete(p->b, "t/empty", -1));
  FR_OK(ferry_store_delete(p->a, "t/inplace", -1));
  FR_OK(ferry_free(p->ca, mem));
  free(src);
  free(dst);
}

static void check_bookkeeping(pair *p) {
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_I32, .ndim = 1, .shape = {16}};
  int32_t v[16] = {1, 2, 3};
  FR_OK(ferry_store_put(p->a, "r/1/a", &d, v, 0, -1));
  FR_OK(ferry_store_put(p->b, "r/1/b", &d, v, 0, -1));
  FR_OK(ferry_store_put(p->b, "r/2/a", &d, v, 0, -1));
  assert_int_equal(ferry_store_exists(p->a, "r/1/b", -1), 1);
  assert_int_equal(ferry_store_exists(p->a, "r/9", -1), 0);
  ferry_store_info st = {.size = sizeof st};
  FR_OK(ferry_store_stat(p->a, "r/1/b", &st, -1));
  assert_int_equal(st.desc.dtype, FERRY_DTYPE_I32);
  assert_int_equal(st.bytes, 64);
  assert_string_equal(st.owner, "node-b");
  ferry_store_info *list;
  size_t n;
  FR_OK(ferry_store_list(p->a, "r/1/", &list, &n, -1));
  assert_int_equal(n, 2);
  assert_string_equal(list[0].key, "r/1/a");
  assert_string_equal(list[1].key, "r/1/b");
  ferry_store_list_free(list);
  /* delete_prefix reaches both owners */
  size_t deleted = 0;
  FR_OK(ferry_store_delete_prefix(p->a, "r/1/", &deleted, -1));
  assert_int_equal(deleted, 2);
  assert_int_equal(ferry_store_exists(p->b, "r/1/b", -1), 0);
  /* a put from another node takes the key over; the old owner frees its copy */
  FR_OK(ferry_store_put(p->a, "r/2/a", &d, v, 0, -1));
  FR_OK(ferry_store_stat(p->b, "r/2/a", &st, -1));
  assert_string_equal(st.owner, "node-a");
  FR_OK(ferry_store_clear(p->b, &deleted, -1));
  assert_true(deleted >= 2);
  FR_OK(ferry_store_list(p->b, "", &list, &n, -1));
  assert_int_equal(n, 0);
  ferry_store_list_free(list);
}

static void check_bad_input(pair *p) {
  uint8_t small[16];
  ferry_tensor_desc d = u8_desc(4, 4);
  FR_OK(ferry_store_put(p->a, "bad/x", &d, small, 0, -1));
  assert_int_equal(ferry_store_get(p->b, "bad/unknown", NULL, small, 16, NULL, -1),
                   FERRY_ENOTFOUND);
  assert_non_null(strstr(ferry_last_error(), "bad/unknown"));
  ferry_tensor_desc want = {.dtype = FERRY_DTYPE_I32, .ndim = 2, .shape = {4, 4}};
  assert_int_equal(ferry_store_get(p->b, "bad/x", &want, small, 16, NULL, -1), FERRY_EDTYPE);
  assert_non_null(strstr(ferry_last_error(), "uint8"));
  want = u8_desc(2, 8);
  assert_int_equal(ferry_store_get(p->b, "bad/x", &want, small, 16, NULL, -1), FERRY_ESHAPE);
  assert_int_equal(ferry_store_get(p->b, "bad/x", NULL, small, 8, NULL, -1), FERRY_ERANGE);
  ferry_tensor_desc bad = {.dtype = (ferry_dtype)99, .ndim = 1, .shape = {1}};
  assert_int_equal(ferry_store_put(p->a, "bad/y", &bad, small, 0, -1), FERRY_EDTYPE);
  bad = (ferry_tensor_desc){.dtype = FERRY_DTYPE_U8, .ndim = 9};
  assert_int_equal(ferry_store_put(p->a, "bad/y", &bad, small, 0, -1), FERRY_ESHAPE);
  bad = (ferry_tensor_desc){.dtype = FERRY_DTYPE_F64, .ndim = 2, .shape = {1ull << 40, 1ull << 40}};
  assert_int_equal(ferry_store_put(p->a, "bad/y", &bad, small, 0, -1), FERRY_EOVERFLOW);
  assert_int_equal(ferry_store_put(p->a, "", &d, small, 0, -1), FERRY_EINVAL);
  assert_int_equal(ferry_store_put(p->a, "bad/y", &d, NULL, 0, -1), FERRY_EINVAL);
  assert_int_equal(ferry_store_put(p->a, "ferry:mq/x", &d, small, 0, -1), FERRY_EINVAL);
  assert_non_null(strstr(ferry_last_error(), "ferry's own"));
  /* larger than the pool: an error that names the sizes */
  ferry_tensor_desc big = u8_desc(16, MiB);
  uint8_t *huge = calloc(16, MiB);
  assert_int_equal(ferry_store_put(p->a, "bad/huge", &big, huge, 0, -1), FERRY_ECAPACITY);
  print_message("%s\n", ferry_last_error());
  assert_non_null(strstr(ferry_last_error(), "16777216"));
  assert_non_null(strstr(ferry_last_error(), "capacity"));
  free(huge);
  assert_int_equal(ferry_store_exists(p->a, "bad/huge", -1), 0);
  FR_OK(ferry_store_delete(p->a, "bad/x", -1));
  assert_int_equal(ferry_store_delete(p->a, "bad/x", -1), FERRY_ENOTFOUND);
}

static void check_batch(pair *p) {
  enum { N = 45, BYTES = 32 * 1024 };
  ferry_tensor_desc d = u8_desc(32, 1024);
  uint8_t *src = malloc(BYTES), *dst = malloc((size_t)N * BYTES);
  char keys[N + 1][32];
  ferry_store_item items[N + 1];
  for (int i = 0; i < N; i++) {
    snprintf(keys[i], sizeof keys[i], "batch/%02d", i);
    tu_fill(src, BYTES, 100 + (uint64_t)i);
    FR_OK(ferry_store_put(i % 2 ? p->a : p->b, keys[i], &d, src, 0, -1));
    items[i] = (ferry_store_item){.key = keys[i], .dst = dst + (size_t)i * BYTES, .cap = BYTES};
  }
  snprintf(keys[N], sizeof keys[N], "batch/missing");
  items[N] = (ferry_store_item){.key = keys[N], .dst = dst, .cap = BYTES};
  assert_int_equal(ferry_store_get_batch(p->b, items, N + 1, -1), FERRY_ENOTFOUND);
  for (int i = 0; i < N; i++) {
    assert_int_equal(items[i].status, 0);
    assert_int_equal(items[i].bytes, BYTES);
    assert_true(pattern_ok(dst + (size_t)i * BYTES, BYTES, 100 + (uint64_t)i));
  }
  assert_int_equal(items[N].status, FERRY_ENOTFOUND);
  FR_OK(ferry_store_get_batch(p->a, items, N, -1));
  size_t deleted;
  FR_OK(ferry_store_delete_prefix(p->a, "batch/", &deleted, -1));
  assert_int_equal(deleted, N);
  free(src);
  free(dst);
}

/* A batch put: one directory round trip, each item its own status. */
static void check_put_batch(pair *p) {
  enum { N = 45, BYTES = 32 * 1024 };
  ferry_tensor_desc d = u8_desc(32, 1024);
  uint8_t *mem, *src = malloc((size_t)N * BYTES), *dst = malloc(BYTES);
  FR_OK(ferry_alloc(p->ca, (size_t)N * BYTES, (void **)&mem));
  char keys[N + 1][32];
  ferry_store_put_item items[N + 1];
  for (int i = 0; i < N; i++) {
    snprintf(keys[i], sizeof keys[i], "pb/%02d", i);
    uint8_t *at = (i % 2 ? mem : src) + (size_t)i * BYTES; /* in place and copies */
    tu_fill(at, BYTES, 200 + (uint64_t)i);
    items[i] = (ferry_store_put_item){.key = keys[i], .desc = &d, .data = at};
  }
  items[N] = (ferry_store_put_item){.key = "", .desc = &d, .data = src};
  assert_int_equal(ferry_store_put_batch(p->a, items, N + 1, 0, -1), FERRY_EINVAL);
  assert_int_equal(items[N].status, FERRY_EINVAL);
  for (int i = 0; i < N; i++) {
    assert_int_equal(items[i].status, 0);
    ferry_store_info info = {.size = sizeof info};
    FR_OK(ferry_store_get(p->b, keys[i], &d, dst, BYTES, &info, -1));
    assert_true(pattern_ok(dst, BYTES, 200 + (uint64_t)i));
    assert_string_equal(info.owner, "node-a");
  }
  /* again from the other node: it takes every key over */
  for (int i = 0; i < N; i++) {
    tu_fill(src + (size_t)i * BYTES, BYTES, 300 + (uint64_t)i);
    items[i].data = src + (size_t)i * BYTES;
  }
  FR_OK(ferry_store_put_batch(p->b, items, N, 0, -1));
  for (int i = 0; i < N; i += 11) {
    ferry_store_info info = {.size = sizeof info};
    FR_OK(ferry_store_get(p->a, keys[i], &d, dst, BYTES, &info, -1));
    assert_true(pattern_ok(dst, BYTES, 300 + (uint64_t)i));
    assert_string_equal(info.owner, "node-b");
  }
  FR_OK(ferry_store_put_batch(p->a, NULL, 0, 0, -1));
  size_t deleted;
  FR_OK(ferry_store_delete_prefix(p->a, "pb/", &deleted, -1));
  assert_int_equal(deleted, N);
  FR_OK(ferry_free(p->ca, mem));
  free(src);
  free(dst);
}

static void check_holder(pair *p) {
  /* a short-lived node hands its put to a holder (node-a), where it outlives it */
  ferry_ctx *c = open_ctx("cli-node", NULL);
  ferry_store_opts o = {.size = sizeof o, .directory = p->url, .flags = FERRY_STORE_DELEGATE};
  ferry_store *d;
  FR_OK(ferry_store_open(c, &o, &d));
  uint8_t v[100], back[100];
  tu_fill(v, sizeof v, 9);
  ferry_tensor_desc desc = u8_desc(10, 10);
  FR_OK(ferry_store_put(d, "held/x", &desc, v, 0, -1));
  ferry_store_put_item two[2] = {{.key = "held/y", .desc = &desc, .data = v},
                                 {.key = "held/z", .desc = &desc, .data = v}};
  FR_OK(ferry_store_put_batch(d, two, 2, 0, -1));
  ferry_store_close(d);
  ferry_ctx_close(c);
  ferry_store_info info = {.size = sizeof info};
  FR_OK(ferry_store_get(p->b, "held/x", &desc, back, sizeof back, &info, -1));
  assert_memory_equal(v, back, sizeof v);
  assert_string_equal(info.owner, "node-a");
  FR_OK(ferry_store_get(p->b, "held/z", &desc, back, sizeof back, &info, -1));
  assert_memory_equal(v, back, sizeof v);
  size_t deleted = 0;
  FR_OK(ferry_store_delete_prefix(p->b, "held/", &deleted, -1));
  assert_int_equal(deleted, 3);
}

/* Whether a view pins the owner's memory: over shm it does; over the other transports (what
 * FERRY_TRANSPORTS puts first) a view is a private copy, which stays valid. */
static int valid_after_handback(void) {
  return strncmp(ferry_config_get("FERRY_TRANSPORTS"), "shm", 3) == 0 ? 0 : 1;
}

/* A get that starts after a put returned sees that put, on any directory: node b keeps looking
 * the key up (its lookup cache warm) while node a re-puts it, and each get must bring the
 * version just put, not the replaced copy that lingers in a's pool (an etcd watch that had not
 * yet brought the change once made b's cache answer with the old record). */
static void check_read_after_write(pair *p) {
  enum { N = 4096 };
  ferry_tensor_desc d = u8_desc(4, 1024);
  uint8_t src[N], dst[N];
  for (uint64_t i = 0; i < 40; i++) {
    tu_fill(src, N, 100 + i);
    FR_OK(ferry_store_put(p->a, "raw/key", &d, src, 0, -1));
    FR_OK(ferry_store_get(p->b, "raw/key", NULL, dst, N, NULL, -1));
    assert_true(pattern_ok(dst, N, 100 + i));
  }
  FR_OK(ferry_store_delete(p->a, "raw/key", -1));
}

/* Zero-copy views: pinned until released, whatever happens to the key meanwhile. */
static void check_views(pair *p) {
  enum { N = 256 * 1024 };
  ferry_tensor_desc d = u8_desc(256, 1024);
  uint8_t *src = malloc(N), *dst = malloc(N);
  tu_fill(src, N, 21);
  FR_OK(ferry_store_put(p->a, "v/copy", &d, src, 0, -1));
  ferry_store_view *v = NULL, *own = NULL;
  const uint8_t *bytes = NULL, *mine = NULL;
  ferry_store_info info = {.size = sizeof info};
  FR_OK(ferry_store_get_view(p->b, "v/copy", (const void **)&bytes, &info, &v, -1));
  assert_int_equal(info.bytes, N);
  assert_true(pattern_ok(bytes, N, 21));
  FR_OK(ferry_store_get_view(p->a, "v/copy", (const void **)&mine, NULL, &own, -1));
  assert_true(pattern_ok(mine, N, 21));
  /* re-put and delete: the pinned old version stays intact; gets see the new one */
  tu_fill(src, N, 22);
  FR_OK(ferry_store_put(p->a, "v/copy", &d, src, 0, -1));
  FR_OK(ferry_store_get(p->b, "v/copy", NULL, dst, N, NULL, -1));
  assert_true(pattern_ok(dst, N, 22));
  FR_OK(ferry_store_delete(p->b, "v/copy", -1));
  for (int i = 0; i < 8; i++) { /* churn the pool under the views */
    tu_fill(src, N, 30 + (uint64_t)i);
    FR_OK(ferry_store_put(p->a, "v/other", &d, src, 0, -1));
  }
  assert_true(pattern_ok(bytes, N, 21));
  assert_true(pattern_ok(mine, N, 21));
  assert_int_equal(ferry_store_view_valid(v), 1);
  ferry_store_view_release(v);
  ferry_store_view_release(own);
  ferry_store_view_release(NULL);
  /* memory published in place: a re-put waits for the view (here until its timeout), then
   * hands the memory back and the view says so */
  void *mem;
  FR_OK(ferry_alloc(p->ca, N, &mem));
  tu_fill(mem, N, 23);
  FR_OK(ferry_store_put(p->a, "v/inplace", &d, mem, 0, -1));
  FR_OK(ferry_store_get_view(p->b, "v/inplace", (const void **)&bytes, NULL, &v, -1));
  assert_true(pattern_ok(bytes, N, 23));
  FR_OK(ferry_store_put(p->a, "v/inplace", &d, src, 0, 300));
  assert_int_equal(ferry_store_view_valid(v), valid_after_handback());
  ferry_store_view_release(v);
  /* a delete another node asks for does not wait for views (the owner's service thread must
   * not stall): the memory goes back at once and the view says so */
  FR_OK(ferry_store_put(p->a, "v/inplace", &d, mem, 0, -1));
  FR_OK(ferry_store_get_view(p->b, "v/inplace", (const void **)&bytes, NULL, &v, -1));
  assert_int_equal(ferry_store_view_valid(v), 1);
  FR_OK(ferry_store_delete(p->b, "v/inplace", -1));
  assert_int_equal(ferry_store_view_valid(v), valid_after_handback());
  ferry_store_view_release(v);
  assert_int_equal(ferry_store_get_view(p->b, "v/none", (const void **)&bytes, NULL, &v, -1),
                   FERRY_ENOTFOUND);
  FR_OK(ferry_store_delete_prefix(p->a, "v/", NULL, -1));
  FR_OK(ferry_free(p->ca, mem));
  free(src);
  free(dst);
}

/* Memory published in place that its owner freed while still publishing it: every reader (a
 * get, a view, a batch item, the owner's own get) fails at once with FERRY_EFREED naming the
 * owner, where it used to retry until its timeout and then blame a replace. The timeout given
 * is far longer than the test needs: a reader that retried would end in FERRY_ESTALE instead.
 * An ordinary in-place replace followed by a free of the old buffer still reads the new bytes. */
static void check_freed(pair *p) {
  enum { N = 16 * 1024, WAIT_MS = 20000 };
  ferry_tensor_desc d = u8_desc(16, 1024);
  uint8_t *dst = malloc(N);
  void *mem, *next;
  FR_OK(ferry_alloc(p->ca, N, &mem));
  tu_fill(mem, N, 41);
  FR_OK(ferry_store_put(p->a, "f/freed", &d, mem, 0, -1));
  FR_OK(ferry_store_get(p->b, "f/freed", &d, dst, N, NULL, -1)); /* the reader mapped it */
  assert_true(pattern_ok(dst, N, 41));
  FR_OK(ferry_free(p->ca, mem));
  assert_int_equal(ferry_store_get(p->b, "f/freed", &d, dst, N, NULL, WAIT_MS), FERRY_EFREED);
  assert_non_null(strstr(ferry_last_error(), "owner 'node-a' freed"));
  const void *bytes = NULL;
  ferry_store_view *v = NULL;
  assert_int_equal(ferry_store_get_view(p->b, "f/freed", &bytes, NULL, &v, WAIT_MS), FERRY_EFREED);
  assert_null(v);
  assert_non_null(strstr(ferry_last_error(), "'node-a'"));
  ferry_store_item item = {.key = "f/freed", .dst = dst, .cap = N};
  assert_int_equal(ferry_store_get_batch(p->b, &item, 1, WAIT_MS), FERRY_EFREED);
  assert_int_equal(item.status, FERRY_EFREED);
  assert_int_equal(ferry_store_get(p->a, "f/freed", &d, dst, N, NULL, WAIT_MS), FERRY_EFREED);
  assert_int_equal(ferry_store_get_view(p->a, "f/freed", &bytes, NULL, &v, WAIT_MS), FERRY_EFREED);
  FR_OK(ferry_store_delete(p->a, "f/freed", -1)); /* the owner can still take the key back */
  assert_int_equal(ferry_store_get(p->b, "f/freed", &d, dst, N, NULL, -1), FERRY_ENOTFOUND);
  /* replaced, then freed: the reader gets the new version, never an error */
  FR_OK(ferry_alloc(p->ca, N, &mem));
  FR_OK(ferry_alloc(p->ca, N, &next));
  tu_fill(mem, N, 42);
  FR_OK(ferry_store_put(p->a, "f/moved", &d, mem, 0, -1));
  FR_OK(ferry_store_get(p->b, "f/moved", &d, dst, N, NULL, -1));
  tu_fill(next, N, 43);
  FR_OK(ferry_store_put(p->a, "f/moved", &d, next, 0, -1));
  FR_OK(ferry_free(p->ca, mem));
  FR_OK(ferry_store_get(p->b, "f/moved", &d, dst, N, NULL, -1));
  assert_true(pattern_ok(dst, N, 43));
  FR_OK(ferry_store_delete(p->a, "f/moved", -1));
  FR_OK(ferry_free(p->ca, next));
  free(dst);
}

static void run_suite(const char *url) {
  pair p;
  pair_open(&p, url);
  check_put_get(&p);
  check_read_after_write(&p);
  check_views(&p);
  check_freed(&p);
  check_bookkeeping(&p);
  check_bad_input(&p);
  check_batch(&p);
  check_put_batch(&p);
  check_holder(&p);
  pair_close(&p);
}

static void test_embedded(void **state) { run_suite(NULL); }

static void test_redis(void **state) {
  su_redis r;
  if (!su_redis_start(&r))
    return;
  run_suite(r.url);
  /* Redis goes away under a store: clear errors, no hang */
  ferry_ctx *c = open_ctx("orphan", NULL);
  ferry_store *s = open_store(c, r.url, 0, MiB, 0);
  su_redis_stop(&r);
  uint8_t v[4] = {0};
  ferry_tensor_desc d = u8_desc(2, 2);
  assert_int_equal(ferry_store_put(s, "x", &d, v, 0, 2000), FERRY_ECONNECT);
  assert_non_null(strstr(ferry_last_error(), "Redis"));
  assert_int_equal(ferry_store_get(s, "x", NULL, v, 4, NULL, 2000), FERRY_ECONNECT);
  ferry_store_close(s);
  ferry_ctx_close(c);
}

static void test_unreachable(void **state) {
  ferry_ctx *c = open_ctx("alone", NULL);
  char url[80];
  ferry_store_opts o = {.size = sizeof o, .directory = url};
  ferry_store *s = (ferry_store *)0x1;
  snprintf(url, sizeof url, "redis://127.0.0.1:%d", su_free_port());
  assert_int_equal(ferry_store_open(c, &o, &s), FERRY_ECONNECT);
  assert_non_null(strstr(ferry_last_error(), "cannot reach Redis"));
  snprintf(url, sizeof url, "ferry://127.0.0.1:%d", su_free_port());
  assert_int_equal(ferry_store_open(c, &o, &s), FERRY_ECONNECT);
  assert_non_null(strstr(ferry_last_error(), "ferry serve"));
  assert_ptr_equal(s, (ferry_store *)0x1);
  ferry_ctx_close(c);
}

/* ---- producer and consumer in separate processes ---- */

typedef struct producer {
  char url[80];
  char key[64];
  uint64_t bytes;
  uint64_t seed;
  int lease_ms;
  bool in_place;
  bool churn;    /* keep re-putting uniform buffers until told to stop */
  char name[32]; /* its node name (empty: "producer") */
  tu_pipe ready, quit;
} producer;

/* The producer is paced: a get that finds its object replaced while it copied starts again,
 * and an in-place put costs microseconds while a get's lookup and copy take far longer (on a
 * loaded machine, or instrumented, many times longer). A producer that re-put in a tight loop
 * replaced the object during nearly every get, and the readers' retries could go on until
 * their timeout (seen: a TSan run over ucx that did not end in 300 s, a plain run at load 15).
 * Paced, gets still race re-puts, every 1 ms (5 ms under sanitizers, which also check every
 * byte a memcpy moves: a lighter hammer there). */
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define HAMMER_GETS 40
#define HAMMER_BYTES (256 * 1024)
#define HAMMER_PAUSE_US 5000
#else
#define HAMMER_GETS 150
#define HAMMER_BYTES MiB
#define HAMMER_PAUSE_US 1000
#endif

/* Re-puts p->key over and over, each version one uniform byte value, until told to stop: copies
 * from one malloc'd buffer, or in place from a ring of 4 ferry buffers (as engines reuse theirs).
 */
static int churn(ferry_store *s, ferry_ctx *c, producer *p, ferry_tensor_desc *d, uint8_t *buf) {
  uint8_t *ring[4] = {buf};
  for (int i = 1; i < 4 && p->in_place; i++)
    if (ferry_alloc(c, p->bytes, (void **)&ring[i]) != 0)
      return 2;
  for (uint8_t v = 1;; v++) {
    uint8_t *b = p->in_place ? ring[v % 4] : buf;
    memset(b, v, p->bytes);
    if (ferry_store_put(s, p->key, d, b, 0, -1) != 0)
      return 3;
    usleep(HAMMER_PAUSE_US);
    char ch;
    if (tu_pipe_get(&p->quit, &ch, 1, 0) == 0)
      return 0;
  }
}

static int producer_main(void *arg) {
  producer *p = arg;
  ferry_ctx *c = open_ctx(p->name[0] ? p->name : "producer", NULL);
  ferry_store *s = open_store(c, p->url, 0, p->bytes * (p->churn ? 8 : 3) + MiB, p->lease_ms);
  ferry_tensor_desc d = u8_desc(p->bytes / 1024, 1024);
  uint8_t *buf = NULL;
  if (p->in_place)
    FR_OK(ferry_alloc(c, p->bytes, (void **)&buf));
  else
    buf = malloc(p->bytes);
  if (p->churn) /* every version a churn reader can see is one byte value, the first too */
    memset(buf, 0, p->bytes);
  else
    tu_fill(buf, p->bytes, p->seed);
  FR_OK(ferry_store_put(s, p->key, &d, buf, 0, -1));
  tu_pipe_put(&p->ready, "R", 1);
  int rc = 0;
  if (p->churn)
    rc = churn(s, c, p, &d, buf);
  else {
    char ch;
    tu_pipe_get(&p->quit, &ch, 1, 60000);
  }
  ferry_store_close(s);
  ferry_ctx_close(c);
  return rc;
}

static pid_t start_producer(producer *p) {
  tu_pipe_open(&p->ready);
  tu_pipe_open(&p->quit);
  pid_t pid = tu_spawn(producer_main, p);
  char c;
  assert_int_equal(tu_pipe_get(&p->ready, &c, 1, 20000), 0);
  return pid;
}

static void check_processes(bool redis) {
  dirsvc dir = {.redis = redis};
  if (!dirsvc_start(&dir))
    return;
  producer p = {.bytes = 4 * MiB, .seed = 42, .in_place = true};
  snprintf(p.url, sizeof p.url, "%s", dir.url);
  snprintf(p.key, sizeof p.key, "proc/in-place");
  pid_t pid = start_producer(&p);
  ferry_ctx *c = open_ctx("consumer", NULL);
  ferry_store *s = open_store(c, p.url, 0, MiB, 0);
  uint8_t *dst = malloc(p.bytes);
  ferry_store_info info = {.size = sizeof info};
  for (int i = 0; i < 3; i++) {
    memset(dst, 0, p.bytes);
    FR_OK(ferry_store_get(s, "proc/in-place", NULL, dst, p.bytes, &info, -1));
    assert_true(pattern_ok(dst, p.bytes, 42));
  }
  assert_string_equal(info.owner, "producer");
  /* the producer closes its store: its objects leave with it */
  tu_pipe_put(&p.quit, "Q", 1);
  assert_int_equal(tu_wait(pid), 0);
  assert_int_equal(ferry_store_get(s, "proc/in-place", NULL, dst, p.bytes, NULL, -1),
                   FERRY_ENOTFOUND);
  tu_pipe_close(&p.ready);
  tu_pipe_close(&p.quit);
  free(dst);
  ferry_store_close(s);
  ferry_ctx_close(c);
  dirsvc_stop(&dir);
}

static void test_processes(void **state) {
  check_processes(false);
  check_processes(true);
}

/* ---- ordering: a put returns before the directory answered it (posted over shm) ---- */

#define ORDER_ROUNDS 200
#define ORDER_BYTES 256

typedef struct orderer {
  char url[80];
  tu_pipe go, said, ack;
} orderer;

static void put_seed(ferry_store *s, const char *key, uint64_t seed) {
  uint8_t v[ORDER_BYTES];
  tu_fill(v, sizeof v, seed);
  ferry_tensor_desc d = u8_desc(1, ORDER_BYTES);
  FR_OK(ferry_store_put(s, key, &d, v, 0, -1));
}

/* A get, then a view of the same key (its lookup answered from the store's cache unless the
 * key changed in between): both must hold the version of `seed`. */
static bool has_seed(ferry_store *s, const char *key, uint64_t seed, char *owner, size_t cap) {
  uint8_t v[ORDER_BYTES];
  ferry_store_info info = {.size = sizeof info};
  int rc = ferry_store_get(s, key, NULL, v, sizeof v, &info, 5000);
  snprintf(owner, cap, "%s", rc == 0 ? info.owner : ferry_last_error());
  if (rc != 0 || !pattern_ok(v, sizeof v, seed))
    return false;
  const void *p = NULL;
  ferry_store_view *view = NULL;
  rc = ferry_store_get_view(s, key, &p, &info, &view, 5000);
  snprintf(owner, cap, "%s (view)", rc == 0 ? info.owner : ferry_last_error());
  bool ok = rc == 0 && info.bytes == ORDER_BYTES && pattern_ok(p, ORDER_BYTES, seed);
  ferry_store_view_release(view);
  return ok;
}

/* Puts ord/I and ord/shared each round, says I, and waits for the other process's turn. */
static int order_writer(void *arg) {
  orderer *o = arg;
  char ch;
  if (tu_pipe_get(&o->go, &ch, 1, 20000) != 0)
    return 2;
  ferry_ctx *c = open_ctx("writer", NULL);
  ferry_store *s = open_store(c, o->url, 0, MiB, 0);
  for (int i = 0; i < ORDER_ROUNDS; i++) {
    char key[32];
    snprintf(key, sizeof key, "ord/%d", i);
    put_seed(s, key, (uint64_t)i + 1);
    put_seed(s, "ord/shared", (uint64_t)i + 1);
    tu_pipe_put(&o->said, &i, sizeof i);
    if (tu_pipe_get(&o->ack, &ch, 1, 20000) != 0)
      return 3;
  }
  ferry_store_close(s);
  ferry_ctx_close(c);
  return 0;
}

/* Right after the writer's put returned (and said so through a pipe, not through ferry), this
 * process finds the new key and the new version of the shared one; then it replaces the shared
 * key itself and must read its own version back, not the writer's older one. host: this
 * process hosts the directory (answering the reads itself), else `ferry serve` does. */
static void check_order(bool host) {
  orderer o = {0};
  tu_pipe_open(&o.go);
  tu_pipe_open(&o.said);
  tu_pipe_open(&o.ack);
  int port = su_free_port();
  snprintf(o.url, sizeof o.url, "ferry://127.0.0.1:%d", port);
  pid_t dir = host ? -1 : start_directory(port);
  pid_t pid = tu_spawn(order_writer, &o);
  char listen[64];
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  ferry_ctx *c = open_ctx("reader", host ? listen : NULL);
  ferry_store *s =
      open_store(c, host ? NULL : o.url, host ? FERRY_STORE_HOST_DIRECTORY : 0, MiB, 0);
  tu_pipe_put(&o.go, "G", 1);
  int missed = 0, stale = 0, lost = 0;
  char owner[256];
  for (int i = 0; i < ORDER_ROUNDS; i++) {
    int said = -1;
    assert_int_equal(tu_pipe_get(&o.said, &said, sizeof said, 20000), 0);
    assert_int_equal(said, i);
    char key[32];
    snprintf(key, sizeof key, "ord/%d", i);
    missed += !has_seed(s, key, (uint64_t)i + 1, owner, sizeof owner);
    stale += !has_seed(s, "ord/shared", (uint64_t)i + 1, owner, sizeof owner);
    put_seed(s, "ord/shared", 100000u + (uint64_t)i);
    if (!has_seed(s, "ord/shared", 100000u + (uint64_t)i, owner, sizeof owner)) {
      print_message("round %d: ord/shared from %s\n", i, owner);
      lost++;
    }
    tu_pipe_put(&o.ack, "A", 1);
  }
  print_message("posted order (%s): %d missed, %d stale, %d lost of %d rounds\n",
                host ? "hosted here" : "ferry serve", missed, stale, lost, ORDER_ROUNDS);
  assert_int_equal(missed + stale + lost, 0);
  assert_int_equal(tu_wait(pid), 0);
  ferry_store_close(s);
  ferry_ctx_close(c);
  if (!host)
    stop_child(dir);
  tu_pipe_close(&o.go);
  tu_pipe_close(&o.said);
  tu_pipe_close(&o.ack);
}

static void test_posted_order(void **state) {
  check_order(false);
  check_order(true);
}

/* ---- quiet after posted puts: neither side looks for the other on a timer ---- */

#define QUIET_PUTS 50
#define QUIET_MS 2000

typedef struct quieter {
  char url[80];
  tu_pipe done, quit;
} quieter;

/* A burst of posted puts (five re-puts of each of ten keys: replaced copies linger), then it says
 * so and waits, doing nothing, until told to quit. */
static int quiet_putter(void *arg) {
  quieter *q = arg;
  ferry_ctx *c = open_ctx("quiet-putter", NULL);
  ferry_store *s = open_store(c, q->url, 0, MiB, 0);
  for (int i = 0; i < QUIET_PUTS; i++) {
    char key[32];
    snprintf(key, sizeof key, "quiet/%d", i % 10);
    put_seed(s, key, (uint64_t)i + 1);
  }
  tu_pipe_put(&q->done, "D", 1);
  char ch;
  int rc = tu_pipe_get(&q->quit, &ch, 1, 60000);
  ferry_store_close(s);
  ferry_ctx_close(c);
  return rc == 0 ? 0 : 2;
}

/* Right after a burst of posted puts, the putting process and the directory (`ferry serve`)
 * sleep: posts ring no doorbell and the directory takes them in at its next look at the leases
 * (once a second); their answers wait for the putter's next put or lease renewal, and so do
 * the replaced copies. The directory used to look for more posts every 50 ms for 1 s and the
 * store for the answers every 50 ms for 2 s (60-70 wake-ups in this window); what remains is
 * what is scheduled anyway (the directory's lease look, the contexts' own timers). A count, not
 * a timing: a slow machine only makes them wake less. */
/* The bound on both processes' wake-ups over QUIET_MS. TSan's runtime runs a thread of its own
 * that wakes on a timer (10-20 times a second): under it the case runs and prints its count, with
 * no bound (as mq_test's idle case). */
#if defined(__SANITIZE_THREAD__)
#define QUIET_WAKEUPS_MAX 100000
#else
#define QUIET_WAKEUPS_MAX 20
#endif
static void test_quiet_after_puts(void **state) {
  quieter q = {0};
  tu_pipe_open(&q.done);
  tu_pipe_open(&q.quit);
  int port = su_free_port();
  snprintf(q.url, sizeof q.url, "ferry://127.0.0.1:%d", port);
  pid_t dir = start_directory(port);
  pid_t pid = tu_spawn(quiet_putter, &q);
  char ch;
  assert_int_equal(tu_pipe_get(&q.done, &ch, 1, 30000), 0);
  long p0 = tu_wakeups(pid, NULL), d0 = tu_wakeups(dir, NULL);
  su_sleep_ms(QUIET_MS);
  long p1 = tu_wakeups(pid, NULL), d1 = tu_wakeups(dir, NULL);
  tu_pipe_put(&q.quit, "Q", 1);
  assert_int_equal(tu_wait(pid), 0);
  stop_child(dir);
  tu_pipe_close(&q.done);
  tu_pipe_close(&q.quit);
  assert_true(p0 >= 0 && p1 >= p0 && d0 >= 0 && d1 >= d0);
  print_message("after %d posted puts: the putter woke %ld times and the directory %ld in %d ms\n",
                QUIET_PUTS, p1 - p0, d1 - d0, QUIET_MS);
  assert_true(p1 - p0 + d1 - d0 <= QUIET_WAKEUPS_MAX);
}

/* A key looked up once is answered from the reader's cache while the directory's change words
 * say nothing changed: with `ferry serve` stopped (SIGSTOP), a view and a get of it still work.
 * A put of the key (posted: it returns without the directory) moves the words, and the next get
 * must not use the cached record: it waits for the stopped directory (here: times out), and once
 * the directory runs again it gets the new version. */
static void test_lookup_cache(void **state) {
  const char *transports = getenv("FERRY_TRANSPORTS");
  if (transports && !strstr(transports, "shm")) { /* the words are mapped over shm only */
    tu_skip(TU_SKIP_NOT_HERE, "lookup cache: no shm link to the directory (FERRY_TRANSPORTS=%s)",
            transports);
    return;
  }
  int port = su_free_port();
  char url[80];
  snprintf(url, sizeof url, "ferry://127.0.0.1:%d", port);
  pid_t dir = start_directory(port);
  ferry_ctx *ca = open_ctx("cache-writer", NULL), *cb = open_ctx("cache-reader", NULL);
  ferry_store *a = open_store(ca, url, 0, MiB, 0), *b = open_store(cb, url, 0, MiB, 0);
  char owner[256];
  put_seed(a, "c/k", 1);
  bool first_ok = has_seed(b, "c/k", 1, owner, sizeof owner);
  assert_int_equal(kill(dir, SIGSTOP), 0); /* resumed and stopped before anything is asserted */
  uint8_t v[ORDER_BYTES];
  const void *p = NULL;
  ferry_store_view *view = NULL;
  /* answered from b's cache and a's memory, not the stopped directory: a generous timeout
   * (never waited out when they pass) keeps a loaded machine from failing them */
  int view_rc = ferry_store_get_view(b, "c/k", &p, NULL, &view, 10000);
  bool view_ok = view_rc == 0 && pattern_ok(p, ORDER_BYTES, 1);
  ferry_store_view_release(view);
  int get_rc = ferry_store_get(b, "c/k", NULL, v, sizeof v, NULL, 10000);
  bool get_ok = get_rc == 0 && pattern_ok(v, sizeof v, 1);
  ferry_tensor_desc d = u8_desc(1, ORDER_BYTES);
  tu_fill(v, sizeof v, 2);
  int put_rc = ferry_store_put(a, "c/k", &d, v, 0, 10000); /* posted */
  int rc = ferry_store_get(b, "c/k", NULL, v, sizeof v, NULL, 300);
  bool after_ok = rc == FERRY_ETIMEDOUT || (rc == 0 && pattern_ok(v, sizeof v, 2));
  kill(dir, SIGCONT);
  bool last_ok = has_seed(b, "c/k", 2, owner, sizeof owner);
  ferry_store_close(b);
  ferry_store_close(a);
  ferry_ctx_close(cb);
  ferry_ctx_close(ca);
  stop_child(dir);
  assert_true(first_ok);
  assert_int_equal(view_rc, 0);
  assert_true(view_ok);
  assert_int_equal(get_rc, 0);
  assert_true(get_ok);
  assert_int_equal(put_rc, 0);
  assert_true(after_ok);
  assert_true(last_ok);
}

/* A first lookup on the directory's host reads the directory's shared table: with `ferry serve`
 * SIGSTOPped, keys this reader never looked up are still found (of an owner it has met: a node's
 * address still comes from the directory), a put posted meanwhile (its
 * record in the table before it is sent) and a re-put too; a key the table does not hold waits
 * for the directory. */
static void test_shared_table(void **state) {
  const char *transports = getenv("FERRY_TRANSPORTS");
  if (transports && !strstr(transports, "shm")) { /* the table is mapped over shm only */
    tu_skip(TU_SKIP_NOT_HERE, "shared table: no shm link to the directory (FERRY_TRANSPORTS=%s)",
            transports);
    return;
  }
  int port = su_free_port();
  char url[80], owner[256];
  snprintf(url, sizeof url, "ferry://127.0.0.1:%d", port);
  pid_t dir = start_directory(port);
  ferry_ctx *ca = open_ctx("table-writer", NULL), *cb = open_ctx("table-reader", NULL);
  ferry_store *a = open_store(ca, url, 0, MiB, 0), *b = open_store(cb, url, 0, MiB, 0);
  put_seed(a, "t/warm", 4);
  put_seed(a, "t/first", 1);
  assert_int_equal(ferry_store_exists(a, "t/absent", 5000), 0); /* the puts are applied now */
  bool warm_ok = has_seed(b, "t/warm", 4, owner, sizeof owner); /* b knows a's address now */
  assert_int_equal(kill(dir, SIGSTOP), 0);
  int wst = 0; /* stopped for sure: a thread of it may run on for a moment after kill() */
  assert_int_equal(waitpid(dir, &wst, WUNTRACED), dir);
  assert_true(WIFSTOPPED(wst)); /* resumed and stopped before anything is asserted */
  bool first_ok = has_seed(b, "t/first", 1, owner, sizeof owner);
  uint8_t v[ORDER_BYTES];
  ferry_tensor_desc d = u8_desc(1, ORDER_BYTES);
  tu_fill(v, sizeof v, 3);
  int posted_rc = ferry_store_put(a, "t/posted", &d, v, 0, 10000); /* posted: not waited out */
  bool posted_ok = has_seed(b, "t/posted", 3, owner, sizeof owner);
  tu_fill(v, sizeof v, 2);
  int reput_rc = ferry_store_put(a, "t/first", &d, v, 0, 10000);
  bool reput_ok = has_seed(b, "t/first", 2, owner, sizeof owner);
  int absent_rc = ferry_store_get(b, "t/absent", NULL, v, sizeof v, NULL, 300);
  kill(dir, SIGCONT);
  bool after_ok = has_seed(b, "t/first", 2, owner, sizeof owner) &&
                  has_seed(b, "t/posted", 3, owner, sizeof owner);
  ferry_store_close(b);
  ferry_store_close(a);
  ferry_ctx_close(cb);
  ferry_ctx_close(ca);
  stop_child(dir);
  assert_true(warm_ok);
  assert_true(first_ok);
  assert_int_equal(posted_rc, 0);
  assert_true(posted_ok);
  assert_int_equal(reput_rc, 0);
  assert_true(reput_ok);
  assert_int_equal(absent_rc, FERRY_ETIMEDOUT);
  assert_true(after_ok);
}

/* ---- one name, one live node ---- */

static void check_duplicate_name(const char *url) {
  /* a holder SIGKILLed long before its lease lapses: proven dead (nothing answers at its
   * address), so a new process takes the name over at once, without the dead one's objects */
  producer p = {.bytes = MiB, .seed = 5, .lease_ms = 60000};
  snprintf(p.url, sizeof p.url, "%s", url);
  snprintf(p.key, sizeof p.key, "dead/x");
  pid_t pid = start_producer(&p);
  kill(pid, SIGKILL);
  assert_int_equal(tu_wait(pid), 128 + SIGKILL);
  tu_pipe_close(&p.ready);
  tu_pipe_close(&p.quit);
  ferry_ctx *c0 = open_ctx("producer", NULL);
  ferry_store *s0 = open_store(c0, url, 0, MiB, 0);
  assert_int_equal(ferry_store_exists(s0, "dead/x", -1), 0);
  ferry_store_close(s0);
  ferry_ctx_close(c0);
  /* a live holder keeps its name: the second is refused with an error naming the holder */
  ferry_ctx *c1 = open_ctx("twin", NULL), *c2 = open_ctx("twin", NULL);
  ferry_store *a = open_store(c1, url, 0, MiB, 0);
  uint8_t v[64];
  tu_fill(v, sizeof v, 3);
  ferry_tensor_desc d = u8_desc(8, 8);
  FR_OK(ferry_store_put(a, "twin/x", &d, v, 0, -1));
  ferry_store_opts o = {.size = sizeof o, .directory = url, .capacity = MiB};
  ferry_store *b = (ferry_store *)0x1;
  assert_int_equal(ferry_store_open(c2, &o, &b), FERRY_EEXIST);
  print_message("%s\n", ferry_last_error());
  assert_ptr_equal(b, (ferry_store *)0x1);
  assert_non_null(strstr(ferry_last_error(), "'twin' is held by a live node"));
  assert_non_null(strstr(ferry_last_error(), ferry_ctx_address(c1)));
  /* and the holder's objects are untouched */
  ferry_store_info info = {.size = sizeof info};
  uint8_t back[64];
  FR_OK(ferry_store_get(a, "twin/x", &d, back, sizeof back, &info, -1));
  assert_memory_equal(v, back, sizeof v);
  /* once the holder closes, the name is free */
  ferry_store_close(a);
  FR_OK(ferry_store_open(c2, &o, &b));
  ferry_store_close(b);
  ferry_ctx_close(c2);
  ferry_ctx_close(c1);
}

static void test_duplicate_name(void **state) {
  int port = su_free_port();
  pid_t dir = start_directory(port);
  char url[80];
  snprintf(url, sizeof url, "ferry://127.0.0.1:%d", port);
  check_duplicate_name(url);
  stop_child(dir);
  su_redis r;
  if (!su_redis_start(&r))
    return;
  check_duplicate_name(r.url);
  su_redis_stop(&r);
}

/* ---- re-put churn: a producer replaces one key over and over while consumers get it ---- */

typedef struct hammer_reader {
  ferry_store *s;
  uint64_t bytes;
  bool view; /* zero-copy views instead of gets */
  int ok, failed, torn, invalid, last_rc;
  char last_error[256];
} hammer_reader;

/* Gets (or views) the key again and again: every get must succeed with one whole version (one
 * byte value), and a view's bytes must stay that version until it is released. */
static void *hammer_gets(void *arg) {
  hammer_reader *r = arg;
  uint8_t *dst = malloc(r->bytes);
  for (int i = 0; i < HAMMER_GETS; i++) {
    ferry_store_view *v = NULL;
    const uint8_t *p = dst;
    int rc = r->view ? ferry_store_get_view(r->s, "churn", (const void **)&p, NULL, &v, 30000)
                     : ferry_store_get(r->s, "churn", NULL, dst, r->bytes, NULL, 30000);
    if (rc != 0) {
      r->failed++;
      r->last_rc = rc;
      snprintf(r->last_error, sizeof r->last_error, "%s", ferry_last_error());
      continue;
    }
    bool whole = true;
    for (size_t j = 1; j < r->bytes && whole; j++)
      whole = p[j] == p[0];
    if (v) {
      r->invalid += ferry_store_view_valid(v) != 1;
      ferry_store_view_release(v);
    }
    r->ok += whole;
    r->torn += !whole;
  }
  free(dst);
  return NULL;
}

typedef struct hammer_proc {
  char url[80];
  uint64_t bytes;
} hammer_proc;

/* A consumer in its own process: exits with 0, or 1 (a failed get) or 2 (a torn one). */
static int hammer_proc_main(void *arg) {
  hammer_proc *h = arg;
  ferry_ctx *c = open_ctx("reader-proc", NULL);
  hammer_reader r = {.s = open_store(c, h->url, 0, MiB, 0), .bytes = h->bytes};
  hammer_gets(&r);
  if (r.failed)
    fprintf(stderr, "reader-proc: %d gets failed, last %s: %s\n", r.failed,
            ferry_status_name(r.last_rc), r.last_error);
  ferry_store_close(r.s);
  ferry_ctx_close(c);
  return r.torn ? 2 : r.failed ? 1 : 0;
}

/* One producer process re-putting, one consumer process and two consumer threads here (one of
 * them with zero-copy views). */
static void hammer(const char *url, bool in_place) {
  producer p = {.bytes = HAMMER_BYTES, .seed = 1, .churn = true, .in_place = in_place};
  snprintf(p.url, sizeof p.url, "%s", url);
  snprintf(p.key, sizeof p.key, "churn");
  pid_t pid = start_producer(&p);
  hammer_proc hp = {.bytes = p.bytes};
  snprintf(hp.url, sizeof hp.url, "%s", url);
  pid_t reader = tu_spawn(hammer_proc_main, &hp);
  ferry_ctx *c = open_ctx("reader", NULL);
  ferry_store *s = open_store(c, url, 0, MiB, 0);
  hammer_reader r[2] = {{.s = s, .bytes = p.bytes}, {.s = s, .bytes = p.bytes, .view = true}};
  pthread_t t[2];
  for (int i = 0; i < 2; i++)
    pthread_create(&t[i], NULL, hammer_gets, &r[i]);
  for (int i = 0; i < 2; i++)
    pthread_join(t[i], NULL);
  int proc_rc = tu_wait(reader);
  tu_pipe_put(&p.quit, "Q", 1);
  assert_int_equal(tu_wait(pid), 0); /* the producer's puts all succeeded */
  print_message("churn (%s, %s): %d + %d whole gets here, reader process exit %d\n", url,
                in_place ? "in place" : "copies", r[0].ok, r[1].ok, proc_rc);
  for (int i = 0; i < 2; i++) {
    if (r[i].failed)
      fail_msg("%d gets failed, last %s: %s", r[i].failed, ferry_status_name(r[i].last_rc),
               r[i].last_error);
    assert_int_equal(r[i].torn, 0);
    assert_int_equal(r[i].invalid, 0);
    assert_int_equal(r[i].ok, HAMMER_GETS);
  }
  assert_int_equal(proc_rc, 0);
  tu_pipe_close(&p.ready);
  tu_pipe_close(&p.quit);
  ferry_store_close(s);
  ferry_ctx_close(c);
}

/* Replaced over and over while read: every get is one whole version, and none fails. */
static void test_churn(void **state) {
  int port = su_free_port();
  pid_t dir = start_directory(port);
  char url[80];
  snprintf(url, sizeof url, "ferry://127.0.0.1:%d", port);
  hammer(url, false);
  hammer(url, true);
  stop_child(dir);
  su_redis r;
  if (!su_redis_start(&r))
    return;
  hammer(r.url, false);
  hammer(r.url, true);
  su_redis_stop(&r);
}

typedef struct getter {
  ferry_store *s;
  uint64_t bytes;
  bool stop;
  int ok, failed, last_rc;
  bool bad_data;
} getter;

static void *get_loop(void *arg) {
  getter *g = arg;
  uint8_t *dst = malloc(g->bytes);
  while (!__atomic_load_n(&g->stop, __ATOMIC_ACQUIRE)) {
    int rc = ferry_store_get(g->s, "victim", NULL, dst, g->bytes, NULL, 3000);
    if (rc == 0) {
      __atomic_add_fetch(&g->ok, 1, __ATOMIC_RELEASE);
      if (!pattern_ok(dst, g->bytes, 7))
        g->bad_data = true;
    } else {
      g->failed++;
      g->last_rc = rc;
      assert_true(rc == FERRY_EPEER || rc == FERRY_ENOTFOUND || rc == FERRY_ESTALE);
    }
  }
  free(dst);
  return NULL;
}

static void check_owner_killed(bool redis) {
  dirsvc dir = {.redis = redis};
  if (!dirsvc_start(&dir))
    return;
  producer p = {.bytes = 16 * MiB, .seed = 7, .lease_ms = 600};
  snprintf(p.url, sizeof p.url, "%s", dir.url);
  snprintf(p.key, sizeof p.key, "victim");
  pid_t pid = start_producer(&p);
  ferry_ctx *c = open_ctx("survivor", NULL);
  ferry_store *s = open_store(c, p.url, 0, MiB, 0);
  getter g = {.s = s, .bytes = p.bytes};
  pthread_t t;
  pthread_create(&t, NULL, get_loop, &g);
  while (__atomic_load_n(&g.ok, __ATOMIC_ACQUIRE) < 3)
    su_sleep_ms(1);
  const uint8_t *seen = NULL;
  ferry_store_view *v = NULL;
  FR_OK(ferry_store_get_view(s, "victim", (const void **)&seen, NULL, &v, -1));
  kill(pid, SIGKILL); /* in the middle of the reader's gets */
  assert_int_equal(tu_wait(pid), 128 + SIGKILL);
  /* a view outlives its owner: still mapped, still the bytes it pinned */
  assert_true(pattern_ok(seen, p.bytes, 7));
  ferry_store_view_release(v);
  /* the record vanishes when the lease lapses; meanwhile gets fail clearly, never hang */
  uint8_t one[16];
  int rc = 0;
  for (int i = 0; i < 1000 && rc != FERRY_ENOTFOUND; i++) {
    rc = ferry_store_get(s, "victim", NULL, one, sizeof one, NULL, 3000);
    assert_true(rc == FERRY_EPEER || rc == FERRY_ENOTFOUND || rc == FERRY_ERANGE);
    if (rc != FERRY_ENOTFOUND)
      su_sleep_ms(10);
  }
  __atomic_store_n(&g.stop, true, __ATOMIC_RELEASE);
  pthread_join(t, NULL);
  assert_int_equal(rc, FERRY_ENOTFOUND);
  assert_false(g.bad_data); /* every get that succeeded returned the whole tensor */
  print_message("owner killed (%s): %d good gets, %d failed (last: %s)\n", dir.url, g.ok, g.failed,
                ferry_status_name(g.last_rc));
  tu_pipe_close(&p.ready);
  tu_pipe_close(&p.quit);
  ferry_store_close(s);
  ferry_ctx_close(c);
  dirsvc_stop(&dir);
}

static void test_owner_killed(void **state) {
  check_owner_killed(false);
  check_owner_killed(true);
}

/* The directory restarts empty (ferry serve, or Redis without persistence): nodes register
 * again and re-publish, and the store keeps working. */
static void check_directory_restart(bool redis) {
  dirsvc dir = {.redis = redis};
  if (!dirsvc_start(&dir))
    return;
  producer p = {.bytes = MiB, .seed = 11, .lease_ms = 900};
  snprintf(p.url, sizeof p.url, "%s", dir.url);
  snprintf(p.key, sizeof p.key, "persistent");
  pid_t pid = start_producer(&p);
  ferry_ctx *c = open_ctx("consumer2", NULL);
  ferry_store *s = open_store(c, p.url, 0, MiB, 900);
  uint8_t *dst = malloc(p.bytes);
  FR_OK(ferry_store_get(s, "persistent", NULL, dst, p.bytes, NULL, -1));
  dirsvc_stop(&dir);
  assert_true(dirsvc_start(&dir)); /* the same port */
  /* the producer notices, registers again and re-publishes: the store keeps working */
  int rc = -1;
  for (int i = 0; i < 1000 && rc != 0; i++) {
    rc = ferry_store_get(s, "persistent", NULL, dst, p.bytes, NULL, 2000);
    if (rc != 0)
      su_sleep_ms(10);
  }
  FR_OK(rc);
  assert_true(pattern_ok(dst, p.bytes, 11));
  /* and the consumer's own puts work against the new directory too */
  ferry_tensor_desc d = u8_desc(1, 16);
  FR_OK(ferry_store_put(s, "after-restart", &d, dst, 0, -1));
  assert_int_equal(ferry_store_exists(s, "after-restart", -1), 1);
  tu_pipe_put(&p.quit, "Q", 1);
  assert_int_equal(tu_wait(pid), 0);
  tu_pipe_close(&p.ready);
  tu_pipe_close(&p.quit);
  free(dst);
  ferry_store_close(s);
  ferry_ctx_close(c);
  dirsvc_stop(&dir);
}

static void test_directory_restart(void **state) {
  check_directory_restart(false);
  check_directory_restart(true);
}

/* ---- across network namespaces (bench/netns.h), over tcp ---- */

#define NS_TAG "st"
#define NS_NET "10.231.7"
#define NS_A NETNS_HOST(NS_TAG, 1)
#define NS_B NETNS_HOST(NS_TAG, 2)
#define IP_A NETNS_IP(NS_NET, 1)
#define IP_B NETNS_IP(NS_NET, 2)
#define NS_PORT "7791"

static bool hosts_up(void) {
  char failed[512];
  if (netns_up(NS_TAG, NS_NET, 2, NULL, failed, sizeof failed))
    return true;
  /* root has CAP_NET_ADMIN, so there the failure is a missing iproute2 or a broken set-up */
  tu_skip(tu_netns_skip_why(),
          "netns part: `%s` failed (needs root, CAP_NET_ADMIN, iproute2, and / a mount point)",
          failed);
  return false;
}

/* In NS_A: host the directory, publish, wait for stdin to close. */
/* The two hosts' fleet token: a node listening beyond loopback must have one. */
#define NS_TOKEN "store-test-netns"

static int role_owner(void) {
  ferry_ctx_opts co = {
      .size = sizeof co, .name = "ns-owner", .tcp_listen = IP_A ":" NS_PORT, .token = NS_TOKEN};
  ferry_ctx *c;
  if (ferry_ctx_open(&co, &c) != 0)
    return 2;
  ferry_store_opts o = {
      .size = sizeof o, .capacity = 16 * MiB, .flags = FERRY_STORE_HOST_DIRECTORY};
  ferry_store *s;
  if (ferry_store_open(c, &o, &s) != 0)
    return 2;
  uint8_t *buf = malloc(8 * MiB);
  tu_fill(buf, 8 * MiB, 77);
  ferry_tensor_desc d = u8_desc(8 * 1024, 1024);
  if (ferry_store_put(s, "ns/obj", &d, buf, 0, -1) != 0)
    return 3;
  printf("ready\n");
  fflush(stdout);
  char line[8];
  while (fgets(line, sizeof line, stdin))
    ;
  ferry_store_close(s);
  ferry_ctx_close(c);
  free(buf);
  return 0;
}

/* In NS_B: read it over tcp (shm cannot reach across namespaces). */
static int role_reader(void) {
  ferry_ctx_opts co = {
      .size = sizeof co, .name = "ns-reader", .tcp_listen = IP_B ":0", .token = NS_TOKEN};
  ferry_ctx *c;
  if (ferry_ctx_open(&co, &c) != 0)
    return 2;
  ferry_store_opts o = {
      .size = sizeof o, .directory = "ferry://" IP_A ":" NS_PORT, .capacity = MiB};
  ferry_store *s;
  if (ferry_store_open(c, &o, &s) != 0) {
    fprintf(stderr, "reader: %s\n", ferry_last_error());
    return 3;
  }
  for (int i = 0; i < 500 && ferry_store_exists(s, "ns/obj", -1) != 1; i++)
    su_sleep_ms(20); /* the owner may still be publishing */
  uint8_t *dst = malloc(8 * MiB);
  int rc = ferry_store_get(s, "ns/obj", NULL, dst, 8 * MiB, NULL, -1);
  if (rc != 0)
    fprintf(stderr, "reader: %s\n", ferry_last_error());
  int result = rc != 0 ? 4 : pattern_ok(dst, 8 * MiB, 77) ? 0 : 5;
  free(dst);
  ferry_store_close(s);
  ferry_ctx_close(c);
  return result;
}

static void test_netns(void **state) {
  if (!hosts_up())
    return;
  char cmd[8192];
  snprintf(cmd, sizeof cmd, "ip netns exec " NS_A " %s --role owner", self_exe);
  FILE *owner = popen(cmd, "w"); /* its stdin: closing it ends the owner */
  assert_non_null(owner);
  /* wait for the directory port to answer inside NS_B, then read from there */
  snprintf(cmd, sizeof cmd,
           "for i in $(seq 200); do ip netns exec " NS_B " bash -c 'echo > /dev/tcp/" IP_A
           "/" NS_PORT "' 2>/dev/null && break; sleep 0.05; "
           "done; ip netns exec " NS_B " %s --role reader",
           self_exe);
  int rc = system(cmd);
  pclose(owner);
  netns_down(NS_TAG, 2);
  assert_int_equal(WEXITSTATUS(rc), 0);
}

/* ---- a stopped directory: every call returns by its caller's timeout ---- */

/* The time since `t0` in ms, printed only: the bound asserted below is a hang detector (the bug
 * was 20.5 s, and a hang is the failure mode), never a timing. */
static double ms_since(const struct timespec *t0) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)(t.tv_sec - t0->tv_sec) * 1e3 + (double)(t.tv_nsec - t0->tv_nsec) / 1e6;
}

#define HANG_MS 10000.0 /* far above any 1 s call plus its constant: only a hang gets there */

/* Stops the directory process `pid` (SIGSTOP, waited for) and calls get, stat, exists and list
 * with a 1 s timeout on a store of it: each returns a clear error (or, for a key a reader can
 * find without the directory, its answer) well before a hang would. */
static void check_stopped(const char *what, const char *url, pid_t pid) {
  ferry_ctx *c = open_ctx("stop-reader", NULL);
  ferry_store *s = open_store(c, url, 0, MiB, 0);
  put_seed(s, "stop/k", 1);
  assert_int_equal(ferry_store_exists(s, "stop/absent", 5000), 0); /* the put is applied */
  assert_int_equal(kill(pid, SIGSTOP), 0);
  int wst = 0;
  assert_int_equal(waitpid(pid, &wst, WUNTRACED), pid);
  assert_true(WIFSTOPPED(wst));
  uint8_t v[ORDER_BYTES];
  ferry_store_info info = {.size = sizeof info};
  ferry_store_info *list = NULL;
  size_t n = 0;
  struct timespec t0;
  double ms[5];
  int rc[5];
  clock_gettime(CLOCK_MONOTONIC, &t0);
  rc[0] = ferry_store_get(s, "stop/absent", NULL, v, sizeof v, NULL, 1000);
  ms[0] = ms_since(&t0);
  clock_gettime(CLOCK_MONOTONIC, &t0);
  rc[1] = ferry_store_stat(s, "stop/absent", &info, 1000);
  ms[1] = ms_since(&t0);
  clock_gettime(CLOCK_MONOTONIC, &t0);
  rc[2] = ferry_store_exists(s, "stop/absent2", 1000);
  ms[2] = ms_since(&t0);
  clock_gettime(CLOCK_MONOTONIC, &t0);
  rc[3] = ferry_store_list(s, "stop/", &list, &n, 1000);
  ms[3] = ms_since(&t0);
  if (rc[3] == 0)
    ferry_store_list_free(list);
  clock_gettime(CLOCK_MONOTONIC, &t0);
  rc[4] = ferry_store_get(s, "stop/k", NULL, v, sizeof v, NULL, 1000);
  ms[4] = ms_since(&t0);
  kill(pid, SIGCONT);
  const char *names[5] = {"get", "stat", "exists", "list", "get (known key)"};
  for (int i = 0; i < 5; i++)
    printf("# %s stopped: %s with a 1000 ms timeout returned %s after %.0f ms\n", what, names[i],
           ferry_strerror(rc[i]), ms[i]);
  bool back = has_seed(s, "stop/k", 1, NULL, 0); /* it answers again once resumed */
  ferry_store_close(s);
  ferry_ctx_close(c);
  for (int i = 0; i < 4; i++) {
    assert_int_equal(rc[i], FERRY_ETIMEDOUT);
    assert_true(ms[i] < HANG_MS);
  }
  /* ferry:// on this host may find the record in the directory's shared table and read it
   * from its live owner (this process); Redis cannot answer */
  assert_true(rc[4] == FERRY_ETIMEDOUT || rc[4] == 0);
  assert_true(ms[4] < HANG_MS);
  assert_true(back);
}

static void test_stopped_directory(void **state) {
  su_redis r;
  if (su_redis_start(&r)) {
    check_stopped("redis", r.url, r.pid);
    su_redis_stop(&r);
  }
  int port = su_free_port();
  char url[80];
  snprintf(url, sizeof url, "ferry://127.0.0.1:%d", port);
  pid_t dir = start_directory(port);
  check_stopped("ferry serve", url, dir);
  stop_child(dir);
}

/* ---- a stopped directory under mixed calls: every call keeps its deadline ---- */

/* How long the directories stay stopped while the calls go on: FERRY_STOP_MIX_MS, 3 s by
 * default (store_test runs in every build stage); the fault suite (tests/faults/run.sh, row 7)
 * runs the issue's 20 s. At the 6 s lease below a renewal is due every 2 s and waits up to 2 s
 * on the stopped directory (retried every 80 ms after a failure), so one is pending for most of
 * the time. */
static int mix_stop_ms(void) {
  const char *env = getenv("FERRY_STOP_MIX_MS");
  int ms = env ? atoi(env) : 0;
  return ms > 0 ? ms : 3000;
}
/* The issue's hang detector for a 1 s timeout: 1.5 s; under a sanitizer 2 s (tu_allowance_ms:
 * ten caller threads and their stores' threads on 2 loaded cores). A call that waits out a
 * renewal's 2 s on the stopped directory besides its own 1 s still breaks it. */
static double mix_bound_ms(void) { return 1000.0 + tu_allowance_ms(1000, 500.0); }

/* Whether an error names the directory (its port), and as the first wait it names not the tail
 * of one that another call spent ("did not answer PING within 1 ms" after 1 s behind a renewal):
 * at least half the caller's 1 s. */
static bool names_real_wait(const char *msg, int port) {
  char p[16];
  snprintf(p, sizeof p, "%d", port);
  if (!strstr(msg, p))
    return false;
  for (const char *m = strstr(msg, " ms"); m; m = strstr(m + 1, " ms")) {
    const char *d = m;
    while (d > msg && d[-1] >= '0' && d[-1] <= '9')
      d--;
    if (d < m)
      return atoi(d) >= 500;
  }
  return true; /* no wait named in ms: the directory is */
}

/* One caller of the mix: a verb called over and over with a 1 s timeout until `end`. */
typedef struct mixer {
  ferry_store *s;
  int op; /* 0 put, 1 get, 2 exists, 3 delete */
  int id, port;
  uint64_t end_ns;
  int calls, bad;
  double worst;
  char first_bad[512], sample[512]; /* the first call that broke the promise; the first error */
} mixer;

static const char *const mix_names[4] = {"put", "get", "exists", "delete"};

static uint64_t mono_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void *mix_main(void *arg) {
  mixer *m = arg;
  uint8_t v[ORDER_BYTES];
  tu_fill(v, sizeof v, 42);
  ferry_tensor_desc d = u8_desc(1, ORDER_BYTES);
  struct timespec t0;
  for (int i = 0; mono_ns() < m->end_ns; i++) {
    char key[64];
    snprintf(key, sizeof key, "mix/p%d-%d", m->id, i % 8);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int rc = m->op == 0   ? ferry_store_put(m->s, key, &d, v, 0, 1000)
             : m->op == 1 ? ferry_store_get(m->s, "mix/held", NULL, v, sizeof v, NULL, 1000)
             : m->op == 2 ? ferry_store_exists(m->s, "mix/absent", 1000)
                          : ferry_store_delete(m->s, "mix/held", 1000);
    double ms = ms_since(&t0);
    const char *why = rc < 0 ? ferry_last_error() : "";
    m->calls++;
    m->worst = ms > m->worst ? ms : m->worst;
    bool ok = ms < mix_bound_ms() &&
              (rc >= 0 || (rc == FERRY_ETIMEDOUT && names_real_wait(why, m->port)));
    if (!ok && m->bad++ == 0)
      snprintf(m->first_bad, sizeof m->first_bad, "%s returned %s after %.0f ms: %s",
               mix_names[m->op], ferry_status_name(rc), ms, why);
    if (rc < 0 && !m->sample[0])
      snprintf(m->sample, sizeof m->sample, "%s", why);
    if (ms < 5) /* answered without the directory (a key in ferry serve's table): no spinning */
      su_sleep_ms(5);
  }
  return NULL;
}

#define MIXERS 5 /* two putters (one waits behind the other), get, exists, delete */

/* One stopped directory and the store whose calls drive it. */
typedef struct mixrun {
  const char *what;
  pid_t pid;
  ferry_ctx *c;
  ferry_store *s;
  mixer m[MIXERS];
  pthread_t t[MIXERS];
} mixrun;

/* Opens a store on the directory at url (its process `pid`, listening on port), puts a key,
 * stops the directory and starts the callers until end_ns. */
static void mix_start(mixrun *r, const char *what, const char *url, int port, pid_t pid,
                      const char *node, uint64_t end_ns) {
  *r = (mixrun){.what = what, .pid = pid};
  r->c = open_ctx(node, NULL);
  r->s = open_store(r->c, url, 0, 4 * MiB, 6000);
  put_seed(r->s, "mix/held", 41);
  assert_int_equal(ferry_store_exists(r->s, "mix/absent", 5000), 0); /* the put is applied */
  assert_int_equal(kill(pid, SIGSTOP), 0);
  int wst = 0;
  assert_int_equal(waitpid(pid, &wst, WUNTRACED), pid);
  assert_true(WIFSTOPPED(wst));
  for (int i = 0; i < MIXERS; i++) {
    r->m[i] = (mixer){.s = r->s, .op = i == 0 ? 0 : i - 1, .id = i, .port = port, .end_ns = end_ns};
    assert_int_equal(pthread_create(&r->t[i], NULL, mix_main, &r->m[i]), 0);
  }
}

/* Joins the callers, says what they saw, resumes the directory and checks that the store works
 * again (its lease may have lapsed meanwhile: it registers again); true when all held. */
static bool mix_finish(mixrun *r, int stop_ms) {
  int bad = 0;
  for (int i = 0; i < MIXERS; i++) {
    mixer *m = &r->m[i];
    pthread_join(r->t[i], NULL);
    printf("# %s stopped for %.1f s: %d %s calls with a 1000 ms timeout, the longest %.0f ms%s%s\n",
           r->what, stop_ms / 1000.0, m->calls, mix_names[m->op], m->worst,
           m->sample[0] ? "; e.g. " : "", m->sample);
    if (m->bad)
      printf("# %s stopped: %d %s calls broke the bound or named a wrong wait; the first: %s\n",
             r->what, m->bad, mix_names[m->op], m->first_bad);
    bad += m->bad;
  }
  kill(r->pid, SIGCONT);
  ferry_tensor_desc d = u8_desc(1, ORDER_BYTES);
  uint8_t v[ORDER_BYTES] = {0};
  int back = -1;
  for (int i = 0; i < 500 && back != 0; i++)
    if ((back = ferry_store_put(r->s, "mix/after", &d, v, 0, 2000)) != 0)
      su_sleep_ms(20);
  if (back != 0)
    printf("# %s resumed: a put still fails: %s\n", r->what, ferry_last_error());
  ferry_store_close(r->s);
  ferry_ctx_close(r->c);
  return bad == 0 && back == 0;
}

/* Redis and `ferry serve` SIGSTOPped at once, each under a store whose put, get, exists and
 * delete go on concurrently with a 1 s timeout while its lease renewals wait on the stopped
 * directory: every call returns within mix_bound_ms(), with an answer (a posted put, a key found
 * in ferry serve's shared table) or an error that names the directory and its real wait (whom it
 * waited behind: a lease renewal, a put, a delete). After SIGCONT each store works again. */
static void test_stopped_directory_mixed(void **state) {
  int stop_ms = mix_stop_ms();
  su_redis rs;
  bool redis = su_redis_start(&rs);
  int port = su_free_port();
  char url[80];
  snprintf(url, sizeof url, "ferry://127.0.0.1:%d", port);
  pid_t dir = start_directory(port);
  mixrun r[2];
  uint64_t end = mono_ns() + (uint64_t)stop_ms * 1000000ull;
  mix_start(&r[0], "ferry serve", url, port, dir, "mix-serve", end);
  if (redis)
    mix_start(&r[1], "redis", rs.url, rs.port, rs.pid, "mix-redis", end);
  bool serve_ok = mix_finish(&r[0], stop_ms);
  bool redis_ok = !redis || mix_finish(&r[1], stop_ms);
  stop_child(dir);
  if (redis)
    su_redis_stop(&rs);
  assert_true(serve_ok);
  assert_true(redis_ok);
}

/* ---- closing a store while its directory is stopped ---- */

#define CLOSE_KEYS 16
#define CLOSE_HANG_MS 15000.0 /* a hang detector: one delete of 2 s per key was 32 s and more */

/* A store that shares its node with an mq (so its records are deleted one by one at close,
 * rather than with the node) closes while Redis is SIGSTOPped: the deletes share one bound, and
 * the records left go with the node's renewals later, so the close does not take a timeout per
 * record, nor one per wait behind the mq's lease renewals. */
static void test_close_stopped_directory(void **state) {
  su_redis r;
  if (!su_redis_start(&r))
    return;
  ferry_ctx *c = open_ctx("close-node", NULL);
  ferry_store *s = open_store(c, r.url, 0, 4 * MiB, 1500); /* renewals wait 0.5 s at most */
  ferry_mq_opts mo = {.size = sizeof mo, .directory = r.url};
  ferry_mq *mq = NULL;
  FR_OK(ferry_mq_open(c, &mo, &mq));
  for (int i = 0; i < CLOSE_KEYS; i++) {
    char key[32];
    snprintf(key, sizeof key, "close/k%d", i);
    put_seed(s, key, (uint64_t)i + 1);
  }
  assert_int_equal(kill(r.pid, SIGSTOP), 0);
  int wst = 0;
  assert_int_equal(waitpid(r.pid, &wst, WUNTRACED), r.pid);
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  ferry_store_close(s);
  double ms = ms_since(&t0);
  kill(r.pid, SIGCONT);
  printf("# redis stopped: closing a store of %d keys (its node shared with an mq) took %.0f ms\n",
         CLOSE_KEYS, ms);
  ferry_mq_close(mq);
  ferry_ctx_close(c);
  su_redis_stop(&r);
  assert_true(ms < CLOSE_HANG_MS);
}

/* ---- stalled uploaders do not hold back a holder's other uploads ---- */

#define STALL_UPLOADERS 3
#define STALL_MIB 128

/* `--role uploader`: a short-lived node (FERRY_TRANSPORTS=tcp, FERRY_DIRECTORY from the parent)
 * that hands a small put to the holder (so its holder and link are known), says 'r' on stdout,
 * then hands over STALL_MIB MiB under $STALL_KEY; its parent stops it meanwhile. */
static int role_uploader(void) {
  ferry_ctx *c = open_ctx(NULL, NULL);
  ferry_store_opts o = {.size = sizeof o, .flags = FERRY_STORE_DELEGATE};
  ferry_store *d = NULL;
  if (!c || ferry_store_open(c, &o, &d) != 0)
    return 2;
  uint8_t small[64] = {1};
  ferry_tensor_desc ds = u8_desc(1, sizeof small);
  char warm[128];
  snprintf(warm, sizeof warm, "%s.warm", getenv("STALL_KEY"));
  if (ferry_store_put(d, warm, &ds, small, 0, 10000) != 0)
    return 3;
  size_t n = (size_t)STALL_MIB * MiB;
  void *big = NULL;
  if (ferry_alloc(c, n, &big) != 0)
    return 4;
  memset(big, 7, n);
  ferry_tensor_desc db = u8_desc(STALL_MIB, MiB);
  if (write(1, "r", 1) != 1)
    return 5;
  return ferry_store_put(d, getenv("STALL_KEY"), &db, big, 0, 60000) == 0 ? 0 : 6;
}

static pid_t start_uploader(const char *url, const char *key, int *ready_fd) {
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  pid_t pid = tu_fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    setenv("FERRY_DIRECTORY", url, 1);
    setenv("FERRY_TRANSPORTS", "tcp", 1);
    setenv("FERRY_TOKEN", "", 1);
    setenv("STALL_KEY", key, 1);
    execl(self_exe, self_exe, "--role", "uploader", (char *)NULL);
    _exit(127);
  }
  close(fds[1]);
  *ready_fd = fds[0];
  return pid;
}

/* Three tcp uploaders to one holder are SIGSTOPped mid-upload; an unrelated upload (another
 * node) still lands, within a timeout shorter than one stalled read's. A stalled one is told by
 * its key being absent after the others went through (it cannot finish while stopped). */
static void test_stalled_uploaders(void **state) {
  char listen[64], url[80];
  int port = su_free_port();
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  snprintf(url, sizeof url, "ferry://%s", listen);
  ferry_ctx *ch = open_ctx("stall-holder", listen);
  ferry_store *h = open_store(ch, NULL, FERRY_STORE_HOLDER | FERRY_STORE_HOST_DIRECTORY,
                              (uint64_t)(STALL_UPLOADERS + 1) * STALL_MIB * MiB + 64 * MiB, 0);
  pid_t pid[STALL_UPLOADERS];
  char key[STALL_UPLOADERS][32];
  for (int i = 0; i < STALL_UPLOADERS; i++) {
    snprintf(key[i], sizeof key[i], "stall/%d", i);
    int ready;
    pid[i] = start_uploader(url, key[i], &ready);
    char ch1 = 0;
    ssize_t got = read(ready, &ch1, 1); /* it is about to hand over the big tensor */
    close(ready);
    su_sleep_ms(5);
    kill(pid[i], SIGSTOP);
    int wst = 0;
    waitpid(pid[i], &wst, WUNTRACED);
    assert_int_equal(got, 1);
  }
  /* the unrelated upload: another short-lived node, another link */
  ferry_ctx *cu = open_ctx("stall-other", NULL);
  ferry_store_opts o = {.size = sizeof o, .directory = url, .flags = FERRY_STORE_DELEGATE};
  ferry_store *d = NULL;
  FR_OK(ferry_store_open(cu, &o, &d));
  uint8_t v[4096], back[4096];
  tu_fill(v, sizeof v, 5);
  ferry_tensor_desc desc = u8_desc(4, 1024);
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int rc = ferry_store_put(d, "stall/other", &desc, v, 0, 5000);
  printf("# unrelated upload with %d uploaders stopped: %s after %.0f ms\n", STALL_UPLOADERS,
         ferry_strerror(rc), ms_since(&t0));
  int get_rc = ferry_store_get(h, "stall/other", &desc, back, sizeof back, NULL, 5000);
  int stalled = 0;
  for (int i = 0; i < STALL_UPLOADERS; i++)
    stalled += ferry_store_exists(h, key[i], 5000) == 0;
  printf("# %d of %d uploaders were stopped mid-upload\n", stalled, STALL_UPLOADERS);
  for (int i = 0; i < STALL_UPLOADERS; i++) {
    kill(pid[i], SIGKILL);
    tu_wait(pid[i]);
  }
  ferry_store_close(d);
  ferry_ctx_close(cu);
  ferry_store_close(h);
  ferry_ctx_close(ch);
  assert_true(stalled > 0); /* else the case did not happen (all finished before the stop) */
  assert_int_equal(rc, 0);
  assert_int_equal(get_rc, 0);
  assert_memory_equal(v, back, sizeof v);
}

/* ---- an owner stopped (SIGSTOP): its keys fail clearly, everyone else's are served ---- */

/* A get_batch on another thread (of the stopped owner's key, a longer timeout). */
typedef struct long_batch {
  ferry_store *s;
  const char *key;
  uint8_t *dst;
  int rc;
} long_batch;

static void *long_batch_main(void *arg) {
  long_batch *lb = arg;
  ferry_store_item it = {.key = lb->key, .dst = lb->dst, .cap = MiB};
  lb->rc = ferry_store_get_batch(lb->s, &it, 1, 2500);
  return NULL;
}

/* Over tcp: while a get_batch waits its 2.5 s on the stopped owner (it holds the batch workers),
 * a get_batch of the healthy owner's key with a 1 s timeout returns within the issue's 1.5 s
 * bound, served (it read on its own thread instead of waiting for the workers: issue 32 row 7's
 * "every call keeps its deadline whatever it waits behind"). */
static bool batch_behind_stopped(ferry_store *s, const char *stopped, const char *healthy) {
  long_batch lb = {.s = s, .key = stopped, .dst = malloc(MiB)};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, long_batch_main, &lb), 0);
  su_sleep_ms(300); /* its lookup done: it holds the workers (if not, this only passes early) */
  uint8_t *dst = malloc(MiB);
  ferry_store_item it = {.key = healthy, .dst = dst, .cap = MiB};
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int rc = ferry_store_get_batch(s, &it, 1, 1000);
  double ms = ms_since(&t0);
  printf("# owner stopped (tcp): a get_batch of the healthy key beside one waiting on the stopped "
         "owner returned %s after %.0f ms\n",
         ferry_status_name(rc), ms);
  pthread_join(t, NULL);
  free(lb.dst);
  free(dst);
  /* asserted by the caller once the owner runs again (a failed assert here would leave it
   * stopped); 1.5 s is the issue's hang detector for a 1 s timeout */
  return rc == 0 && ms < 1500.0 && lb.rc == FERRY_ETIMEDOUT;
}

/* Two owners in child processes publish a key each; one is stopped (SIGSTOP, waited for). A get
 * of its key with a 1 s timeout returns a clear error well before a hang would (over shm the
 * reader may instead read it one-sided from the stopped owner's pool: then the bytes must be
 * whole); the directory still lists it (the owner's lease has not lapsed: it is not reported
 * gone); the healthy owner's key is served; the reader's own puts work. After SIGCONT the key
 * is served intact. `transports` is FERRY_TRANSPORTS for every node of the case. */
static void check_owner_stopped(const char *transports) {
  setenv("FERRY_TRANSPORTS", transports, 1);
  dirsvc dir = {.redis = false};
  dirsvc_start(&dir);
  producer stopped = {.bytes = MiB, .seed = 21}, healthy = {.bytes = MiB, .seed = 22};
  snprintf(stopped.url, sizeof stopped.url, "%s", dir.url);
  snprintf(healthy.url, sizeof healthy.url, "%s", dir.url);
  snprintf(stopped.key, sizeof stopped.key, "stopped/owner");
  snprintf(healthy.key, sizeof healthy.key, "healthy/owner");
  snprintf(stopped.name, sizeof stopped.name, "owner-stopped");
  snprintf(healthy.name, sizeof healthy.name, "owner-healthy");
  pid_t spid = start_producer(&stopped), hpid = start_producer(&healthy);
  ferry_ctx *c = open_ctx("stopped-owner-reader", NULL);
  ferry_store *s = open_store(c, dir.url, 0, 4 * MiB, 0);
  uint8_t *dst = malloc(MiB);
  /* both served first, so the reader holds a link to each owner */
  FR_OK(ferry_store_get(s, stopped.key, NULL, dst, MiB, NULL, 10000));
  FR_OK(ferry_store_get(s, healthy.key, NULL, dst, MiB, NULL, 10000));
  assert_int_equal(kill(spid, SIGSTOP), 0);
  int wst = 0;
  assert_int_equal(waitpid(spid, &wst, WUNTRACED), spid);
  assert_true(WIFSTOPPED(wst));
  memset(dst, 0, MiB);
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int rc = ferry_store_get(s, stopped.key, NULL, dst, MiB, NULL, 1000);
  double ms = ms_since(&t0);
  char why[512];
  snprintf(why, sizeof why, "%s", rc ? ferry_last_error() : "served");
  bool whole = rc == 0 && pattern_ok(dst, MiB, stopped.seed);
  int listed = ferry_store_exists(s, stopped.key, 10000);
  int healthy_rc = ferry_store_get(s, healthy.key, NULL, dst, MiB, NULL, 10000);
  bool healthy_ok = healthy_rc == 0 && pattern_ok(dst, MiB, healthy.seed);
  ferry_tensor_desc d = u8_desc(1, 64);
  int put_rc = ferry_store_put(s, "reader/own", &d, dst, 0, 10000);
  bool batch_ok =
      strcmp(transports, "tcp") != 0 || batch_behind_stopped(s, stopped.key, healthy.key);
  kill(spid, SIGCONT);
  printf("# owner stopped (%s): get with a 1000 ms timeout returned %s after %.0f ms: %s\n",
         transports, ferry_status_name(rc), ms, why);
  memset(dst, 0, MiB);
  int back = ferry_store_get(s, stopped.key, NULL, dst, MiB, NULL, 10000);
  bool back_whole = back == 0 && pattern_ok(dst, MiB, stopped.seed);
  tu_pipe_put(&stopped.quit, "Q", 1);
  tu_pipe_put(&healthy.quit, "Q", 1);
  int sst = tu_wait(spid), hst = tu_wait(hpid);
  free(dst);
  ferry_store_close(s);
  ferry_ctx_close(c);
  dirsvc_stop(&dir);
  unsetenv("FERRY_TRANSPORTS");
  tu_pipe_close(&stopped.ready);
  tu_pipe_close(&stopped.quit);
  tu_pipe_close(&healthy.ready);
  tu_pipe_close(&healthy.quit);
  assert_true(ms < HANG_MS);
  if (strcmp(transports, "tcp") == 0) /* the owner must answer a tcp read: it cannot */
    assert_int_equal(rc, FERRY_ETIMEDOUT);
  else
    assert_true(rc == FERRY_ETIMEDOUT || whole);
  assert_int_equal(listed, 1); /* stopped is not gone */
  assert_int_equal(healthy_rc, 0);
  assert_true(healthy_ok);
  assert_true(batch_ok);
  assert_int_equal(put_rc, 0);
  assert_int_equal(back, 0); /* resumed: served again, whole */
  assert_true(back_whole);
  assert_int_equal(sst, 0);
  assert_int_equal(hst, 0);
}

static void test_owner_stopped(void **state) {
  check_owner_stopped("tcp");
  check_owner_stopped("shm,tcp");
}

/* ---- Redis SIGKILLed under a fleet, then restarted empty on its port ---- */

/* While Redis is dead every call fails clearly within its timeout (never "not found" for a key
 * that is held: nothing is misreported); a put that failed is not stored. Redis restarts empty
 * (no persistence) on the same port: each node registers again and re-publishes what it holds
 * (src/store/store.c), so every committed key is served again, whole. */
static void test_redis_killed(void **state) {
  su_redis r;
  if (!su_redis_start(&r))
    return;
  int port = r.port;
  producer p = {.bytes = MiB, .seed = 31, .lease_ms = 900};
  snprintf(p.url, sizeof p.url, "%s", r.url);
  snprintf(p.key, sizeof p.key, "held/remote");
  pid_t pid = start_producer(&p);
  ferry_ctx *c = open_ctx("redis-killed-reader", NULL);
  ferry_store *s = open_store(c, r.url, 0, 4 * MiB, 900);
  put_seed(s, "held/local", 32);
  uint8_t *dst = malloc(MiB);
  FR_OK(ferry_store_get(s, p.key, NULL, dst, MiB, NULL, 10000));
  su_redis_stop(&r); /* SIGKILL */
  const char *names[4] = {"get", "exists", "list", "put"};
  int rc[4];
  double ms[4];
  char why[4][256];
  struct timespec t0;
  ferry_store_info *list = NULL;
  size_t n = 0;
  ferry_tensor_desc d = u8_desc(1, ORDER_BYTES);
  uint8_t v[ORDER_BYTES];
  tu_fill(v, sizeof v, 33);
  for (int i = 0; i < 4; i++) {
    clock_gettime(CLOCK_MONOTONIC, &t0);
    rc[i] = i == 0   ? ferry_store_get(s, p.key, NULL, dst, MiB, NULL, 1000)
            : i == 1 ? ferry_store_exists(s, "held/local", 1000)
            : i == 2 ? ferry_store_list(s, "held/", &list, &n, 1000)
                     : ferry_store_put(s, "during/outage", &d, v, 0, 1000);
    ms[i] = ms_since(&t0);
    snprintf(why[i], sizeof why[i], "%s", rc[i] < 0 ? ferry_last_error() : "answered");
    printf("# redis killed: %s with a 1000 ms timeout returned %s after %.0f ms: %s\n", names[i],
           ferry_status_name(rc[i]), ms[i], why[i]);
  }
  if (rc[2] == 0)
    ferry_store_list_free(list);
  bool get_whole = rc[0] == 0 && pattern_ok(dst, MiB, p.seed);
  /* the same port, empty: the nodes find it, register again and re-publish */
  bool restarted = su_redis_start_on(&r, port);
  int back = -1;
  for (int i = 0; restarted && i < 1500 && back != 0; i++)
    if ((back = ferry_store_get(s, p.key, NULL, dst, MiB, NULL, 2000)) != 0)
      su_sleep_ms(10);
  bool back_whole = back == 0 && pattern_ok(dst, MiB, p.seed);
  char owner[256];
  bool local_back = false;
  for (int i = 0; restarted && i < 1500 && !local_back; i++)
    if (!(local_back = has_seed(s, "held/local", 32, owner, sizeof owner)))
      su_sleep_ms(10);
  int during = restarted ? ferry_store_exists(s, "during/outage", 10000) : -1;
  bool during_ok = rc[3] != 0 ? during == 0 : has_seed(s, "during/outage", 33, owner, sizeof owner);
  tu_pipe_put(&p.quit, "Q", 1);
  int pst = tu_wait(pid);
  tu_pipe_close(&p.ready);
  tu_pipe_close(&p.quit);
  free(dst);
  ferry_store_close(s);
  ferry_ctx_close(c);
  su_redis_stop(&r);
  for (int i = 0; i < 4; i++)
    assert_true(ms[i] < HANG_MS);
  /* the key's record lives in Redis: no answer, or (from the reader's cache) the whole bytes */
  assert_true(rc[0] == FERRY_ECONNECT || rc[0] == FERRY_ETIMEDOUT || get_whole);
  for (int i = 1; i < 4; i++) /* never "absent" (0) for a held key: an error */
    if (i != 3 || rc[3] != 0)
      assert_true(rc[i] == FERRY_ECONNECT || rc[i] == FERRY_ETIMEDOUT);
  assert_true(restarted);
  assert_int_equal(back, 0);
  assert_true(back_whole);
  assert_true(local_back);
  assert_true(during_ok); /* a put that failed left nothing; one that returned 0 is served */
  assert_int_equal(pst, 0);
}

/* The store through etcd:// (issue 36): the suite every directory passes (put, get, views,
 * freed buffers, batches, holders), against a three-member cluster on loopback. */
static void test_etcd(void **state) {
  su_etcd e;
  if (!su_etcd_start(&e, 3))
    return;
  run_suite(e.url);
  su_etcd_stop(&e);
}

/* ---- the gets an owner served (issue 35: `ferry serve`'s gets stayed 0) ---- */

typedef struct stat_sum {
  const char *name;
  double value;
} stat_sum;

static int add_stat(const ferry_stat *st, void *arg) {
  stat_sum *sum = arg;
  if (strcmp(st->name, sum->name) == 0)
    sum->value += st->value;
  return 0;
}

/* The sum of ctx's samples of one counter. */
static double store_stat(ferry_ctx *c, const char *name) {
  stat_sum sum = {name, 0};
  FR_OK(ferry_stats_each(c, add_stat, &sum));
  return sum.value;
}

/* Waits (a deadline, never a timing assert) until ctx's served gets reach `want`. */
static double served_reach(ferry_ctx *c, double want) {
  double got = 0;
  for (int i = 0; i < 1000 && (got = store_stat(c, "ferry_store_served_gets_total")) < want; i++)
    su_sleep_ms(10);
  return got;
}

/* A forged read receipt straight onto the owner's FR_CHANNEL_STORE. */
static void send_reads(ferry_link *l, uint64_t gets, uint64_t bytes) {
  uint8_t m[24];
  uint32_t magic = FR_STORE_MSG_MAGIC;
  uint16_t op = FR_SMSG_READS, pad = 0;
  memcpy(m, &magic, 4); /* little-endian, as the wire is (x86) */
  memcpy(m + 4, &op, 2);
  memcpy(m + 6, &pad, 2);
  memcpy(m + 8, &gets, 8);
  memcpy(m + 16, &bytes, 8);
  struct iovec iov = {m, sizeof m};
  FR_OK(ferry_send(l, FR_CHANNEL_STORE, &iov, 1, 5000));
}

/* Every object read whole counts once in its owner's ferry_store_served_gets_total, with its
 * bytes: a get, the same get again (answered from the lookup cache), each item of a batch, a
 * view, and the owner's own get (at once); another node's once its read receipts arrive (its
 * close sends what is left). A get that failed (no such key, a buffer too small) counts nothing
 * there, and the reader's own gets_total is unchanged by all this. A receipt is a peer's claim:
 * bytes beyond its gets times the owner's largest object count as that bound, and more gets
 * than one receipt may claim are refused. */
static void test_served_gets(void **state) {
  (void)state;
  enum { BIG = 16 * 1024, SMALL = 4 * 1024 };
  pair p;
  pair_open(&p, NULL);
  ferry_tensor_desc big = u8_desc(16, 1024), small = u8_desc(4, 1024);
  uint8_t *src = malloc(BIG), *dst = malloc(BIG), *dst2 = malloc(SMALL);
  tu_fill(src, BIG, 41);
  FR_OK(ferry_store_put(p.a, "served/big", &big, src, 0, -1));
  FR_OK(ferry_store_put(p.a, "served/small", &small, src, 0, -1));
  assert_true(store_stat(p.ca, "ferry_store_served_gets_total") == 0);
  FR_OK(ferry_store_get(p.b, "served/big", &big, dst, BIG, NULL, -1));
  FR_OK(ferry_store_get(p.b, "served/big", &big, dst, BIG, NULL, -1));
  ferry_store_item items[2] = {{.key = "served/big", .dst = dst, .cap = BIG},
                               {.key = "served/small", .dst = dst2, .cap = SMALL}};
  FR_OK(ferry_store_get_batch(p.b, items, 2, -1));
  const void *view = NULL;
  ferry_store_view *v = NULL;
  FR_OK(ferry_store_get_view(p.b, "served/big", &view, NULL, &v, -1));
  assert_true(pattern_ok(view, BIG, 41));
  ferry_store_view_release(v);
  assert_int_equal(ferry_store_get(p.b, "served/none", NULL, dst, BIG, NULL, -1), FERRY_ENOTFOUND);
  assert_int_equal(ferry_store_get(p.b, "served/big", NULL, dst, 10, NULL, -1), FERRY_ERANGE);
  FR_OK(ferry_store_get(p.a, "served/small", NULL, dst2, SMALL, NULL, -1));
  assert_true(store_stat(p.ca, "ferry_store_served_gets_total") >= 1); /* its own: at once */
  /* b's own count: 2 gets, 2 batch items, 2 that failed (a view is not counted there) */
  assert_true(store_stat(p.cb, "ferry_store_gets_total") == 6);
  assert_true(store_stat(p.cb, "ferry_store_served_gets_total") == 0); /* b owns nothing */
  ferry_store_close(p.b);
  p.b = NULL;
  assert_true(served_reach(p.ca, 6) == 6); /* big: 2 gets, a batch item, a view; small: 2 */
  assert_true(store_stat(p.ca, "ferry_store_served_bytes_total") == 4.0 * BIG + 2.0 * SMALL);
  /* forged receipts over a link of a third context */
  ferry_ctx *x = open_ctx("forger", NULL);
  ferry_link *l = NULL;
  FR_OK(ferry_connect(x, ferry_ctx_address(p.ca), 10000, &l));
  send_reads(l, 2, 1ull << 40);             /* bytes bounded: 2 x the largest (BIG) */
  send_reads(l, FR_STORE_READS_MAX + 1, 1); /* refused whole */
  send_reads(l, 1, 100);                    /* in order after both: counted as claimed */
  assert_true(served_reach(p.ca, 9) == 9);
  assert_true(store_stat(p.ca, "ferry_store_served_bytes_total") ==
              4.0 * BIG + 2.0 * SMALL + 2.0 * BIG + 100);
  ferry_link_close(l);
  ferry_ctx_close(x);
  free(src);
  free(dst);
  free(dst2);
  pair_close(&p);
}

/* ---- Redis behind Sentinel: the primary SIGKILLed (issue 36) ---- */

/* A put with a 1 s timeout, timed. */
static int timed_put(ferry_store *s, const char *key, uint64_t seed, double *ms) {
  uint8_t v[ORDER_BYTES];
  tu_fill(v, sizeof v, seed);
  ferry_tensor_desc d = u8_desc(1, ORDER_BYTES);
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int rc = ferry_store_put(s, key, &d, v, 0, 1000);
  *ms = ms_since(&t0);
  return rc;
}

/* A primary, a replica and three sentinels; a writer and a reader through redis+sentinel://. The
 * primary is SIGKILLed: puts fail clearly within their 1 s timeout while the sentinels elect the
 * replica, then land on it; what the replica had acknowledged (WAIT) before the kill is still
 * served, and the writer's records are all there (it registers again when the epoch moves). */
static void test_redis_sentinel_failover(void **state) {
  su_sentinels z;
  if (!su_sentinels_start(&z))
    return;
  ferry_ctx *cw = open_ctx("sentinel-writer", NULL), *cr = open_ctx("sentinel-reader", NULL);
  ferry_store *w = open_store(cw, z.url, 0, 4 * MiB, 0), *r = open_store(cr, z.url, 0, 4 * MiB, 0);
  char key[64], owner[256];
  for (int i = 0; i < 20; i++) {
    snprintf(key, sizeof key, "before/%d", i);
    put_seed(w, key, 100 + (uint64_t)i);
    assert_true(has_seed(r, key, 100 + (uint64_t)i, owner, sizeof owner));
  }
  const char *wait_cmd[3] = {"WAIT", "1", "5000"}; /* the replica has every write so far */
  redisReply *rep = su_redis_ask(z.primary_port, 3, wait_cmd);
  assert_non_null(rep);
  assert_int_equal(rep->type, REDIS_REPLY_INTEGER);
  assert_int_equal(rep->integer, 1);
  freeReplyObject(rep);
  uint64_t killed = fr_now_ns();
  su_kill(&z.primary);
  int failed = 0, landed = -1;
  double slowest = 0, ms;
  for (int i = 0; i < 300 && landed < 0; i++) {
    snprintf(key, sizeof key, "after/%d", i);
    int rc = timed_put(w, key, 500 + (uint64_t)i, &ms);
    slowest = ms > slowest ? ms : slowest;
    assert_true(ms < HANG_MS);
    if (rc == 0) {
      landed = i;
      break;
    }
    if (failed++ < 3)
      print_message("during the failover: %s after %.0f ms: %s\n", ferry_status_name(rc), ms,
                    ferry_last_error());
    assert_true(rc == FERRY_ECONNECT || rc == FERRY_ETIMEDOUT);
  }
  double failover_ms = (double)(fr_now_ns() - killed) / 1e6;
  assert_true(landed >= 0);
  print_message("sentinel failover: a put landed %.0f ms after the primary's SIGKILL (%d puts "
                "failed first, the slowest took %.0f ms of its 1000)\n",
                failover_ms, failed, slowest);
  snprintf(key, sizeof key, "after/%d", landed);
  assert_true(has_seed(r, key, 500 + (uint64_t)landed, owner, sizeof owner));
  for (int i = 0; i < 20; i++) {
    snprintf(key, sizeof key, "before/%d", i);
    assert_true(has_seed(r, key, 100 + (uint64_t)i, owner, sizeof owner));
  }
  /* the sentinels name the replica now */
  const char *ask[3] = {"SENTINEL", "get-master-addr-by-name", "mymaster"};
  rep = su_redis_ask(z.sentinel_port[0], 3, ask);
  assert_non_null(rep);
  assert_int_equal(rep->type, REDIS_REPLY_ARRAY);
  assert_int_equal(atoi(rep->element[1]->str), z.replica_port);
  freeReplyObject(rep);
  ferry_store_close(r);
  ferry_store_close(w);
  ferry_ctx_close(cr);
  ferry_ctx_close(cw);
  su_sentinels_stop(&z);
}

int main(int argc, char **argv) {
  ssize_t n = readlink("/proc/self/exe", self_exe, sizeof self_exe - 1);
  self_exe[n > 0 ? n : 0] = '\0';
  const char *env = getenv("FERRY_CLI");
  snprintf(cli_path, sizeof cli_path, "%s", env ? env : self_exe);
  char *slash = env ? NULL : strrchr(cli_path, '/');
  if (slash)
    snprintf(slash, sizeof cli_path - (size_t)(slash - cli_path), "/../ferry");
  if (argc == 3 && strcmp(argv[1], "--role") == 0)
    return strcmp(argv[2], "owner") == 0      ? role_owner()
           : strcmp(argv[2], "uploader") == 0 ? role_uploader()
                                              : role_reader();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_embedded),
      cmocka_unit_test(test_redis),
      cmocka_unit_test(test_etcd),
      cmocka_unit_test(test_unreachable),
      cmocka_unit_test(test_processes),
      cmocka_unit_test(test_churn),
      cmocka_unit_test(test_owner_killed),
      cmocka_unit_test(test_directory_restart),
      cmocka_unit_test(test_netns),
      cmocka_unit_test(test_duplicate_name),
      cmocka_unit_test(test_posted_order),
      cmocka_unit_test(test_quiet_after_puts),
      cmocka_unit_test(test_lookup_cache),
      cmocka_unit_test(test_shared_table),
      cmocka_unit_test(test_stopped_directory),
      cmocka_unit_test(test_stopped_directory_mixed),
      cmocka_unit_test(test_close_stopped_directory),
      cmocka_unit_test(test_stalled_uploaders),
      cmocka_unit_test(test_owner_stopped),
      cmocka_unit_test(test_redis_killed),
      cmocka_unit_test(test_redis_sentinel_failover),
      cmocka_unit_test(test_served_gets),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, NULL, NULL);
}
