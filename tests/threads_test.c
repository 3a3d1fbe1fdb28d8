/*
 * The library's threads (core/task.h, docs/ARCHITECTURE.md's thread table): every thread it
 * starts carries one of the known names (a thread started without fr_thread_start would carry
 * the process's), and the task pool keeps a worker for its timers however much blocking work
 * holds the others.
 */
// ferry-test: threaded
#include "testutil.h"

#include "core/core.h"
#include "core/task.h"

#include <dirent.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The library's thread kinds (ARCHITECTURE.md §2): the context's two, the jobs (a refit group's
 * receiver reads each rank on a thread of its own, ferry-refit-rk), the task pool's workers and
 * the refit packer. */
static const char *const known[] = {
    "ferry-progress", "ferry-server",   "ferry-store",    "ferry-mq",   "ferry-directory",
    "ferry-refit-tx", "ferry-refit-rx", "ferry-refit-rk", "ferry-task", "ferry-pack"};
#define NKNOWN (sizeof known / sizeof known[0])
#define MAX_TASKS 256

static int known_index(const char *name) {
  for (size_t i = 0; i < NKNOWN; i++)
    if (strcmp(name, known[i]) == 0)
      return (int)i;
  return -1;
}

/* The ids of this process's threads now (at most MAX_TASKS). */
static size_t tasks(long *tid) {
  DIR *d = opendir("/proc/self/task");
  assert_non_null(d);
  size_t n = 0;
  for (struct dirent *e; (e = readdir(d)) && n < MAX_TASKS;)
    if (e->d_name[0] != '.')
      tid[n++] = atol(e->d_name);
  closedir(d);
  return n;
}

static void comm_of(long tid, char *name, size_t cap) {
  char path[64];
  snprintf(path, sizeof path, "/proc/self/task/%ld/comm", tid);
  FILE *f = fopen(path, "r");
  name[0] = '\0';
  if (f && fgets(name, (int)cap, f))
    name[strcspn(name, "\n")] = '\0';
  if (f)
    fclose(f);
}

static void *nothing(void *arg) { return arg; }

static bool listed(const long *v, size_t n, long tid) {
  for (size_t i = 0; i < n; i++)
    if (v[i] == tid)
      return true;
  return false;
}

/* A context with a store (hosting the directory), an mq and a published refit sender, after a
 * batch get (the pool's helpers): each thread that was not there before has a known name, and
 * the kinds these start are all there. */
static void test_thread_names(void **state) {
  (void)state;
  long before[MAX_TASKS], now[MAX_TASKS];
  pthread_t first; /* TSan starts its own thread at a process's first pthread_create */
  assert_int_equal(pthread_create(&first, NULL, nothing, NULL), 0);
  pthread_join(first, NULL);
  size_t nbefore = tasks(before); /* the main thread, and a sanitizer's own */
  ferry_ctx_opts co = {.size = sizeof co, .name = "threads-a", .token = ""};
  ferry_ctx *ctx = NULL;
  FR_OK(ferry_ctx_open(&co, &ctx));
  ferry_store_opts so = {.size = sizeof so, .flags = FERRY_STORE_HOST_DIRECTORY};
  ferry_store *st = NULL;
  FR_OK(ferry_store_open(ctx, &so, &st));
  const char *tcp = strstr(ferry_ctx_address(ctx), "tcp://");
  assert_non_null(tcp);
  char dir[128];
  snprintf(dir, sizeof dir, "ferry://%.*s", (int)strcspn(tcp + 6, ","), tcp + 6);
  ferry_mq_opts mo = {.size = sizeof mo, .directory = dir};
  ferry_mq *mq = NULL;
  FR_OK(ferry_mq_open(ctx, &mo, &mq));
  ferry_refit_opts ro = {.size = sizeof ro, .publish = 1, .directory = dir};
  ferry_refit_sender *tx = NULL;
  FR_OK(ferry_refit_sender_open(ctx, "threads-policy", &ro, &tx));
  float x[64] = {1};
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_F32, .ndim = 1, .shape = {64}};
  char keys[4][16];
  ferry_store_item items[4];
  float got[4][64];
  for (int i = 0; i < 4; i++) {
    snprintf(keys[i], sizeof keys[i], "thr/%d", i);
    FR_OK(ferry_store_put(st, keys[i], &d, x, 0, 5000));
    items[i] = (ferry_store_item){.key = keys[i], .dst = got[i], .cap = sizeof got[i]};
  }
  FR_OK(ferry_store_get_batch(st, items, 4, 5000));

  bool seen[NKNOWN] = {0};
  size_t n = tasks(now);
  for (size_t i = 0; i < n; i++) {
    if (listed(before, nbefore, now[i]))
      continue;
    char name[32];
    comm_of(now[i], name, sizeof name);
    int k = known_index(name);
    /* one just started names itself first thing: look again for up to 2 s (a thread started
     * without a name keeps the process's for good) */
    for (uint64_t end = fr_deadline_ns(2000); k < 0 && name[0] && fr_now_ns() < end;) {
      sched_yield();
      comm_of(now[i], name, sizeof name);
      k = known_index(name);
    }
    if (k < 0 && !name[0])
      continue; /* it ended meanwhile */
    if (k < 0)
      fail_msg("thread %ld is named '%s', not one of the library's kinds: started without "
               "fr_thread_start?",
               now[i], name);
    seen[k] = true;
  }
  for (size_t k = 0; k < NKNOWN; k++)
    if (strncmp(known[k], "ferry-refit-r", 13) != 0) /* no receiver here */
      assert_true(seen[k] || !fprintf(stderr, "no thread '%s'\n", known[k]));
  ferry_refit_sender_close(tx);
  ferry_mq_close(mq);
  ferry_store_close(st);
  ferry_ctx_close(ctx);
}

/* ---- the pool ---- */

typedef struct gate {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  bool open;
  int in, fired;
} gate;

static void held(void *arg) { /* blocking work: holds its worker until the gate opens */
  gate *g = arg;
  pthread_mutex_lock(&g->lock);
  g->in++;
  pthread_cond_broadcast(&g->cond);
  while (!g->open)
    pthread_cond_wait(&g->cond, &g->lock);
  g->in--;
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&g->lock);
}

static void fired(void *arg) {
  gate *g = arg;
  pthread_mutex_lock(&g->lock);
  g->fired++;
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&g->lock);
}

/* Waits (bounded, 30 s: no timing asserted) until *v reaches want; returns it. */
static int wait_for(gate *g, const int *v, int want) {
  pthread_mutex_lock(&g->lock);
  uint64_t end = fr_deadline_ns(30000);
  while (*v < want && fr_now_ns() < end) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 1;
    pthread_cond_timedwait(&g->cond, &g->lock, &ts);
  }
  int got = *v;
  pthread_mutex_unlock(&g->lock);
  return got;
}

/* Blocking work takes every worker but one (FERRY_TASK_THREADS is 4 here: main sets it), then is
 * refused; a timer still fires on the one kept. */
static void test_pool_keeps_one_for_timers(void **state) {
  (void)state;
  gate g = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};
  int taken = 0;
  while (taken < 100 && fr_task_try(held, &g) == 0)
    taken++;
  int started, max;
  fr_task_counts(&started, &max);
  assert_int_equal(max, 4);
  assert_int_equal(taken, max - 1);
  assert_int_equal(wait_for(&g, &g.in, taken), taken);
  fr_timer t;
  fr_timer_init(&t, fired, &g);
  fr_timer_arm(&t, fr_now_ns());
  assert_int_equal(wait_for(&g, &g.fired, 1), 1);
  pthread_mutex_lock(&g.lock);
  g.open = true;
  pthread_cond_broadcast(&g.cond);
  pthread_mutex_unlock(&g.lock);
  pthread_mutex_lock(&g.lock);
  while (g.in > 0)
    pthread_cond_wait(&g.cond, &g.lock);
  pthread_mutex_unlock(&g.lock);
  fr_timer_cancel(&t);
}

typedef struct again {
  fr_timer t;
  gate g;
} again;

static void fire_again(void *arg) { /* arms itself again until it fired three times */
  again *a = arg;
  fired(&a->g);
  pthread_mutex_lock(&a->g.lock);
  bool more = a->g.fired < 3;
  pthread_mutex_unlock(&a->g.lock);
  if (more)
    fr_timer_arm(&a->t, fr_now_ns());
}

/* A timer armed again from its own callback fires again; one cancelled before its deadline does
 * not fire, and cancel returns with the callback not running. */
static void test_timer_again_and_cancel(void **state) {
  (void)state;
  again a = {.g = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER}};
  fr_timer_init(&a.t, fire_again, &a);
  fr_timer_arm(&a.t, fr_now_ns());
  assert_int_equal(wait_for(&a.g, &a.g.fired, 3), 3);
  fr_timer_cancel(&a.t);
  gate g = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};
  fr_timer later;
  fr_timer_init(&later, fired, &g);
  fr_timer_arm(&later, fr_now_ns() + 3600ull * 1000000000ull);
  fr_timer_cancel(&later);
  assert_false(later.armed);
  assert_int_equal(g.fired, 0);
}

int main(void) {
  setenv("FERRY_TASK_THREADS", "4", 1); /* read once, at the pool's first use */
  tu_filter();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_thread_names),
      cmocka_unit_test(test_pool_keeps_one_for_timers),
      cmocka_unit_test(test_timer_again_and_cancel),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
