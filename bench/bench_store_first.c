/*
 * `ferry bench store`, the rows of routing replay as it really runs: every key is new. The
 * engine (a producer process) makes each request's [45, 32768, 8] uint8 routing in a buffer of
 * its own (ferry_alloc_uninit), fills it and puts it in place; the trainer (this process) gets
 * each key once into new memory (ferry_store_get_alloc, as Python's get() does), or takes a view
 * of it and reads it, then deletes it. The engine frees the buffers of deleted keys
 * (ferry_store_released), so that its next allocations may take their pages back, as the
 * Python binding does. Rows:
 *   first/put        ferry(fill+put): alloc, fill and put of a new buffer; malloc+fill: the same
 *                    fill of a private buffer (alloc, fill, free), the baseline
 *   first/get        ferry: a key's only get; ferry(view): its view; view+read: the view and a
 *                    memcpy out of it; memcpy: the same bytes between two buffers of this
 *                    process; memcpy(new): into a new malloc, as a get into new memory is
 *   consumer-start   open: a new trainer process's context and store; first get: its first get;
 *                    memcpy(new proc): the floor, a new process that maps a memfd of the same
 *                    bytes for the first time and copies them into new memory as a get does
 * With reuse false the engine keeps no freed memory (FERRY_ALLOC_CACHE_BYTES=0): the same rows
 * as nocache/put and nocache/get, what every key cost before regions were reused.
 */
#include "bench_store.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

/* Keys the engine runs ahead of the trainer: 1, so that every put and get is timed alone (an
 * engine that runs ahead fills its next buffer while the trainer copies, and the two share
 * the memory bandwidth: that is the machine's, not the calls'). */
#define WINDOW 1
#define STARTS 5 /* new trainer processes timed */

static const ferry_tensor_desc routing_desc = {
    .dtype = FERRY_DTYPE_U8, .ndim = 3, .shape = {BS_LAYERS, BS_TOKENS, BS_TOPK}};

typedef struct engine {
  ferry_ctx *ctx;
  ferry_store *s;
  int to_trainer, from_trainer;
  struct {
    char key[32];
    void *buf;
  } live[2 * WINDOW + STARTS + 1]; /* keys put, not yet released */
} engine;

/* Frees the buffers of the keys the trainer deleted. */
static void engine_release(engine *e) {
  ferry_store_info *gone = NULL;
  size_t n = 0;
  if (ferry_store_released(e->s, &gone, &n) != 0)
    return;
  size_t cap = sizeof e->live / sizeof e->live[0];
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < cap; j++)
      if (e->live[j].buf && strcmp(e->live[j].key, gone[i].key) == 0) {
        ferry_free(e->ctx, e->live[j].buf);
        e->live[j].buf = NULL;
      }
  ferry_store_list_free(gone);
}

/* A new buffer, filled and put under key; the time of it all. */
static int engine_put(engine *e, const char *key, uint8_t fill, double *dt) {
  size_t cap = sizeof e->live / sizeof e->live[0], j = 0;
  while (j < cap && e->live[j].buf)
    j++;
  if (j == cap)
    return bs_fail("engine: too many keys in flight");
  double t = bench_now();
  void *buf;
  int rc = ferry_alloc_uninit(e->ctx, BS_ROUTING_BYTES, &buf);
  if (rc != 0)
    return rc;
  memset(buf, fill, BS_ROUTING_BYTES); /* the engine writes its routing here */
  rc = ferry_store_put(e->s, key, &routing_desc, buf, 0, -1);
  *dt = bench_now() - t;
  snprintf(e->live[j].key, sizeof e->live[j].key, "%s", key);
  e->live[j].buf = buf;
  return rc;
}

/* The same fill of a private buffer (malloc, fill, free): the baseline, timed beside each put. */
static double private_fill(uint8_t fill) {
  double t = bench_now();
  uint8_t *own = malloc(BS_ROUTING_BYTES);
  memset(own, fill, BS_ROUTING_BYTES);
  __asm__ volatile("" ::"r"(own) : "memory");
  free(own);
  return bench_now() - t;
}

/* The engine: STARTS keys for the new trainers, then 2 * keys keys (gets, then views), at most
 * WINDOW ahead of the trainer's acks; each put's time and its baseline's, taken just before it,
 * go to the trainer. */
static int engine_main(const char *url, int keys, bool reuse, int to_trainer, int from_trainer) {
  if (!reuse)
    setenv("FERRY_ALLOC_CACHE_BYTES", "0", 1);
  engine e = {.to_trainer = to_trainer, .from_trainer = from_trainer};
  e.s = bs_open_node("first-engine", NULL, url, 0, 1 << 20, &e.ctx);
  if (!e.s)
    return 1;
  ferry_store_released(e.s, &(ferry_store_info *){NULL}, &(size_t){0}); /* keep them from now */
  int rc = 0;
  char key[32], ack;
  double dt;
  for (int i = 0; rc == 0 && i < STARTS; i++) {
    snprintf(key, sizeof key, "start/%d", i);
    rc = engine_put(&e, key, (uint8_t)(i + 1), &dt);
  }
  rc = rc ? rc : bench_write_all(to_trainer, &dt, sizeof dt);
  rc = rc ? rc : bench_read_all(from_trainer, &ack, 1); /* the new trainers are done */
  for (int i = 0; rc == 0 && i < 2 * keys; i++) {
    if (i >= WINDOW)
      rc = bench_read_all(from_trainer, &ack, 1);
    double times[2] = {private_fill((uint8_t)i), 0};
    engine_release(&e);
    snprintf(key, sizeof key, "first/%d", i);
    rc = rc ? rc : engine_put(&e, key, (uint8_t)(i + 1), &times[1]);
    rc = rc ? rc : bench_write_all(to_trainer, times, sizeof times);
  }
  if (rc != 0)
    fprintf(stderr, "ferry bench store: first: engine: %s\n", ferry_last_error());
  bench_read_all(from_trainer, &ack, 1); /* until the trainer is done */
  ferry_store_close(e.s);
  ferry_ctx_close(e.ctx);
  return rc ? 1 : 0;
}

/* A new trainer process: opens, gets start/i once; writes both times to fd. */
static int starter_main(const char *url, int i, int fd) {
  double t = bench_now(), times[2];
  ferry_ctx *ctx;
  ferry_store *s = bs_open_node("first-start", NULL, url, 0, 1 << 20, &ctx);
  if (!s)
    return 1;
  times[0] = bench_now() - t;
  char key[32];
  snprintf(key, sizeof key, "start/%d", i);
  void *p = NULL;
  t = bench_now();
  int rc = ferry_store_get_alloc(s, key, &p, NULL, -1);
  times[1] = bench_now() - t;
  if (rc == 0 && ((uint8_t *)p)[BS_ROUTING_BYTES - 1] != (uint8_t)(i + 1))
    rc = bs_fail("first: a new trainer got wrong bytes");
  free(p);
  ferry_store_close(s);
  ferry_ctx_close(ctx);
  return rc == 0 && bench_write_all(fd, times, sizeof times) == 0 ? 0 : 1;
}

/* The floor of a new trainer's first get: map a memfd this process never touched and copy it
 * into new memory (malloc, its huge-page-aligned interior MADV_HUGEPAGE, as the store's get
 * allocates); the time to fd. */
static int floor_main(int memfd, int fd) {
  double t = bench_now();
  uint8_t *src = mmap(NULL, BS_ROUTING_BYTES, PROT_READ, MAP_SHARED, memfd, 0);
  uint8_t *dst = malloc(BS_ROUTING_BYTES);
  if (src == MAP_FAILED || !dst)
    return 1;
  uintptr_t huge = (uintptr_t)2 << 20, lo = ((uintptr_t)dst + huge - 1) & ~(huge - 1);
  uintptr_t hi = ((uintptr_t)dst + BS_ROUTING_BYTES) & ~(huge - 1);
  if (hi > lo)
    madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
  memcpy(dst, src, BS_ROUTING_BYTES);
  __asm__ volatile("" ::"r"(dst) : "memory");
  double dt = bench_now() - t;
  return bench_write_all(fd, &dt, sizeof dt) == 0 && dst[7] == src[7] ? 0 : 1;
}

/* Runs body(arg, fd) in a new process; its double(s) into out. */
static int in_new_process(int (*body)(void *, int), void *arg, double *out, size_t n) {
  int fd[2];
  if (pipe(fd) != 0)
    return -1;
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    close(fd[0]);
    _exit(body(arg, fd[1]));
  }
  close(fd[1]);
  int rc = bench_read_all(fd[0], out, n * sizeof *out);
  close(fd[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  return rc == 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

typedef struct trainer {
  ferry_store *s;
  int from_engine, to_engine;
  uint8_t *dst;
  bs_series *fill, *put, *get, *view, *read;
} trainer;

static int take_put_time(trainer *t) {
  double times[2];
  if (bench_read_all(t->from_engine, times, sizeof times) != 0)
    return bs_fail("first: the engine stopped");
  if (t->fill)
    bench_add(&t->fill->s, times[0]);
  bench_add(&t->put->s, times[1]);
  return 0;
}

/* Key i's only read: a get into new memory, or a view and a memcpy out of it. */
static int read_once(trainer *t, const char *key, int i, bool view) {
  const uint8_t *p = NULL;
  void *got = NULL;
  ferry_store_view *v = NULL;
  double t0 = bench_now();
  int rc = view ? ferry_store_get_view(t->s, key, (const void **)&p, NULL, &v, -1)
                : ferry_store_get_alloc(t->s, key, &got, NULL, -1);
  double dt = bench_now() - t0;
  bench_add(view ? &t->view->s : &t->get->s, dt);
  if (rc == 0 && view) {
    t0 = bench_now();
    memcpy(t->dst, p, BS_ROUTING_BYTES);
    __asm__ volatile("" ::"r"(t->dst) : "memory");
    bench_add(&t->read->s, dt + bench_now() - t0);
    p = t->dst;
  } else if (rc == 0) {
    p = got;
  }
  if (rc == 0 && (p[0] != (uint8_t)(i + 1) || p[BS_ROUTING_BYTES - 1] != p[0]))
    rc = bs_fail("first: wrong bytes");
  ferry_store_view_release(v);
  free(got);
  return rc ? rc : ferry_store_delete(t->s, key, -1);
}

/* memcpy of the same bytes in this process: between two buffers, and into a new malloc. */
static void time_memcpy(bs_series *warm, bs_series *fresh, uint8_t *dst, int keys) {
  uint8_t *src = malloc(BS_ROUTING_BYTES);
  memset(src, 0, BS_ROUTING_BYTES);
  for (int i = 0; i < keys; i++) {
    memset(src, i + 1, BS_ROUTING_BYTES); /* fresh bytes, as the engine's are */
    double t = bench_now();
    memcpy(dst, src, BS_ROUTING_BYTES);
    __asm__ volatile("" ::"r"(dst) : "memory");
    bench_add(&warm->s, bench_now() - t);
    memset(src, i + 2, BS_ROUTING_BYTES);
    t = bench_now();
    uint8_t *p = malloc(BS_ROUTING_BYTES);
    memcpy(p, src, BS_ROUTING_BYTES);
    __asm__ volatile("" ::"r"(p) : "memory");
    free(p);
    bench_add(&fresh->s, bench_now() - t);
  }
  free(src);
}

typedef struct start_arg {
  const char *url;
  int i, memfd;
} start_arg;

static int run_starter(void *arg, int fd) {
  start_arg *a = arg;
  return starter_main(a->url, a->i, fd);
}

static int run_floor(void *arg, int fd) { return floor_main(((start_arg *)arg)->memfd, fd); }

/* A memfd of the routing's bytes, filled here and never mapped by the floor's process. */
static int filled_memfd(void) {
  int fd = memfd_create("first-floor", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, BS_ROUTING_BYTES) != 0)
    return -1;
  uint8_t *p = mmap(NULL, BS_ROUTING_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED)
    return -1;
  memset(p, 7, BS_ROUTING_BYTES);
  munmap(p, BS_ROUTING_BYTES);
  return fd;
}

/* STARTS new trainer processes, one after the other, before this process opens anything, and
 * as many of the floor's. */
static int time_starts(bs_report *r, const char *url) {
  bs_series *open = bs_add(r, "consumer-start", "open", 0, false);
  bs_series *first = bs_add(r, "consumer-start", "first get", BS_ROUTING_BYTES, false);
  bs_series *floor = bs_add(r, "consumer-start", "memcpy(new proc)", BS_ROUTING_BYTES, true);
  start_arg a = {.url = url, .memfd = filled_memfd()};
  int rc = a.memfd < 0 ? -1 : 0;
  for (int i = 0; rc == 0 && i < STARTS; i++) {
    double times[2], dt;
    a.i = i;
    rc = in_new_process(run_starter, &a, times, 2);
    rc = rc ? rc : in_new_process(run_floor, &a, &dt, 1);
    if (rc == 0) {
      bench_add(&open->s, times[0]);
      bench_add(&first->s, times[1]);
      bench_add(&floor->s, dt);
    }
  }
  if (a.memfd >= 0)
    close(a.memfd);
  return rc ? bs_fail("first: a new trainer failed") : 0;
}

static int trainer_main(bs_report *r, const char *url, int keys, bool reuse, trainer *t) {
  const char *put_case = reuse ? "first/put" : "nocache/put";
  const char *get_case = reuse ? "first/get" : "nocache/get";
  double dt;
  if (bench_read_all(t->from_engine, &dt, sizeof dt) != 0 || (reuse && time_starts(r, url) != 0))
    return -1;
  ferry_ctx *ctx;
  t->s = bs_open_node("first-trainer", NULL, url, 0, 1 << 20, &ctx);
  if (!t->s)
    return -1;
  bench_write_all(t->to_engine, "S", 1);
  t->fill = reuse ? bs_add(r, put_case, "malloc+fill", BS_ROUTING_BYTES, true) : NULL;
  t->put = bs_add(r, put_case, "ferry(fill+put)", BS_ROUTING_BYTES, false);
  t->get = bs_add(r, get_case, "ferry", BS_ROUTING_BYTES, false);
  t->view = bs_add(r, get_case, "ferry(view)", BS_ROUTING_BYTES, false);
  t->read = bs_add(r, get_case, "view+read", BS_ROUTING_BYTES, false);
  int rc = 0;
  for (int i = 0; rc == 0 && i < 2 * keys; i++) {
    char key[32];
    snprintf(key, sizeof key, "first/%d", i);
    rc = take_put_time(t);
    rc = rc ? rc : read_once(t, key, i, i >= keys);
    rc = rc ? rc : bench_write_all(t->to_engine, "A", 1);
  }
  if (rc == 0 && reuse)
    time_memcpy(bs_add(r, "first/get", "memcpy", BS_ROUTING_BYTES, true),
                bs_add(r, "first/get", "memcpy(new)", BS_ROUTING_BYTES, true), t->dst, keys);
  bench_write_all(t->to_engine, "Q", 1);
  ferry_store_close(t->s);
  ferry_ctx_close(ctx);
  return rc;
}

void bs_first(bs_report *r, int keys, bool reuse) {
  char listen[64], url[80];
  int port = bs_free_port();
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  snprintf(url, sizeof url, "ferry://127.0.0.1:%d", port);
  int dq[2], e2t[2], t2e[2];
  if (pipe(dq) != 0 || pipe(e2t) != 0 || pipe(t2e) != 0)
    return;
  fflush(NULL);
  pid_t dir = fork();
  if (dir == 0) {
    close(dq[1]);
    _exit(bs_directory_main(listen, dq[0]));
  }
  close(dq[0]);
  usleep(200000); /* let it listen */
  pid_t eng = fork();
  if (eng == 0) {
    close(dq[1]);
    _exit(engine_main(url, keys, reuse, e2t[1], t2e[0]));
  }
  close(e2t[1]);
  close(t2e[0]);
  trainer t = {.from_engine = e2t[0], .to_engine = t2e[1], .dst = malloc(BS_ROUTING_BYTES)};
  memset(t.dst, 1, BS_ROUTING_BYTES);
  if (trainer_main(r, url, keys, reuse, &t) != 0)
    fprintf(stderr, "ferry bench store: first%s: %s\n", reuse ? "" : " (no reuse)",
            ferry_last_error());
  free(t.dst);
  close(t2e[1]);
  waitpid(eng, NULL, 0);
  close(dq[1]);
  waitpid(dir, NULL, 0);
  close(e2t[0]);
}
