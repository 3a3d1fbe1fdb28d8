/*
 * The wake-up meter of `ferry bench`'s paced rows (src/cli/bench.c, bench_wake): it must count
 * the blocking of a peer process's threads as well as this process's, leave out the bench's own
 * pauses, and count nothing for work that wakes nobody; and the rows must carry the figure
 * (wakeups_per_call in --json, null where nothing was counted). Counts of context switches, not
 * timings: a pipe ping-pong with a child blocks the child once per message and this process at
 * most once per answer, whatever the machine's speed. And the rows' p99 (nearest rank).
 */
#include "cli/bench.h"
#include "testutil.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#define CALLS 20

typedef struct echo {
  int in, out;
  int theirs[2]; /* the parent's ends: closed here, or the child never sees its pipe close */
} echo;

/* The child: answers each byte with one, until its pipe closes. */
static int echo_main(void *arg) {
  echo *e = arg;
  close(e->theirs[0]);
  close(e->theirs[1]);
  char c;
  while (bench_read_all(e->in, &c, 1) == 0)
    if (bench_write_all(e->out, &c, 1) != 0)
      return 1;
  return 0;
}

static long self_switches(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_nvcsw;
}

/* CALLS paced ping-pongs with an echoing child, metered with the child as peer (or not);
 * *own: this process's switches per call in the same window, its pauses (one each) left out. */
static double ping_pong(bool count_child, double *own) {
  int down[2], up[2];
  assert_int_equal(pipe(down), 0);
  assert_int_equal(pipe(up), 0);
  echo e = {down[0], up[1], {down[1], up[0]}};
  pid_t child = tu_spawn(echo_main, &e);
  close(down[0]);
  close(up[1]);
  char c = 'x';
  assert_int_equal(bench_write_all(down[1], &c, 1), 0); /* the child is up and waiting */
  assert_int_equal(bench_read_all(up[0], &c, 1), 0);
  usleep(20000); /* and blocks again: before the window */
  bench_opts o = {.pace_ms = 1, .reps = CALLS};
  bench_until u = bench_until_paced(&o);
  bench_wake w;
  bench_wake_init(&w, &child, count_child ? 1 : 0);
  long before = self_switches();
  bench_wake_begin(&w);
  size_t n = 0;
  while (!bench_done(&u, n)) {
    assert_int_equal(bench_write_all(down[1], &c, 1), 0);
    assert_int_equal(bench_read_all(up[0], &c, 1), 0);
    n++;
  }
  usleep(20000); /* the child blocks again after its last answer: inside the window */
  bench_wake_end(&w, n);
  *own = (double)(self_switches() - before - CALLS) / CALLS;
  close(down[1]);
  close(up[0]);
  assert_int_equal(tu_wait(child), 0);
  assert_int_equal(n, CALLS);
  return bench_wake_per_call(&w);
}

/* Each message wakes the sleeping child, which blocks again after answering: one switch of the
 * child's per call, besides this process's own blocking for the answers; the pauses between
 * the calls are not counted. */
static void test_counts_peer(void **state) {
  (void)state;
  double own, w = ping_pong(true, &own);
  assert_true(own >= 0 && own <= 1.0 + 1.0 / CALLS); /* the answers, and the usleep */
  assert_true(w - own > 1.0 - 0.5 / CALLS);
  assert_true(w - own < 1.0 + 0.5 / CALLS);
}

/* Without the child as a peer, only this process's blocking is left. */
static void test_counts_self_only(void **state) {
  (void)state;
  double own, w = ping_pong(false, &own);
  assert_true(w - own > -0.5 / CALLS);
  assert_true(w - own < 0.5 / CALLS);
}

/* Work that blocks nowhere costs no wake-up, however many pauses came between. */
static void test_local_work_none(void **state) {
  (void)state;
  bench_opts o = {.pace_ms = 1, .reps = CALLS};
  bench_until u = bench_until_paced(&o);
  bench_wake w;
  bench_wake_init(&w, NULL, 0);
  bench_wake_begin(&w);
  size_t n = 0;
  volatile uint64_t sum = 0;
  while (!bench_done(&u, n)) {
    for (int i = 0; i < 1000; i++)
      sum += (uint64_t)i;
    n++;
  }
  bench_wake_end(&w, n);
  assert_true(bench_wake_per_call(&w) == 0.0);
  assert_true(bench_wake_idle_per_call(&w) < 0); /* no idle measured: none reported */
  bench_wake_idle(&w, 5);
  assert_true(bench_wake_idle_per_call(&w) == 0.0);
}

/* The rows: wakeups_per_call as measured, null where nothing was counted. */
static void test_rows_json(void **state) {
  (void)state;
  char path[] = "/tmp/ferry-bench-test-XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  fflush(stdout);
  int saved = dup(1);
  dup2(fd, 1);
  bench_opts o = {.json = true, .pace_ms = 10};
  bench_samples s = {0};
  bench_add(&s, 1e-5);
  bench_wake w;
  bench_wake_init(&w, NULL, 0);
  bench_wake_add(&w, 6, 0.1, 4);
  bench_paced_row(&o, "t", "case", "impl", 64, &s, 5e-6, &w);
  bench_paced_row(&o, "t", "case", "other", 64, &s, 5e-6, NULL);
  bench_row_wake(&o, "t", "case", "b2b", 64, &s, true, &w);
  fflush(stdout);
  dup2(saved, 1);
  close(saved);
  bench_free(&s);
  char buf[2048] = "";
  FILE *f = fdopen(fd, "r");
  rewind(f);
  size_t len = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  unlink(path);
  buf[len] = '\0';
  char *second = strchr(buf, '\n');
  assert_non_null(second);
  *second++ = '\0';
  assert_non_null(strstr(buf, "\"impl\":\"impl@10ms\""));
  assert_non_null(strstr(buf, "\"wakeups_per_call\":1.5,"));
  assert_non_null(strstr(buf, "\"idle_wakeups_per_call\":null"));
  assert_non_null(strstr(second, "\"wakeups_per_call\":null"));
  assert_non_null(strstr(second, "\"b2b\""));
  assert_non_null(strstr(strstr(second, "\"b2b\""), "\"wakeups_per_call\":1.5}"));
}

/* A text row that moves no bytes (the demo's ctl-request) shows "-" for GB/s, not 0.00. */
static void test_rows_text_without_bytes(void **state) {
  (void)state;
  char path[] = "/tmp/ferry-bench-test-XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  fflush(stdout);
  int saved = dup(1);
  dup2(fd, 1);
  bench_opts o = {0};
  bench_samples s = {0};
  bench_add(&s, 1e-3);
  bench_row(&o, "t", "ctl-request", "ferry", 0, &s, true);
  bench_row(&o, "t", "copy", "ferry", 4000000, &s, false);
  fflush(stdout);
  dup2(saved, 1);
  close(saved);
  bench_free(&s);
  char buf[1024] = "";
  FILE *f = fdopen(fd, "r");
  rewind(f);
  size_t len = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  unlink(path);
  buf[len] = '\0';
  char *second = strchr(buf, '\n');
  assert_non_null(second);
  *second++ = '\0';
  assert_non_null(strstr(buf, "ms          - "));
  assert_null(strstr(buf, "0.00 "));
  assert_non_null(strstr(second, "ms       4.00 ")); /* 4 MB in 1 ms */
}

/* p99 by nearest rank: of 100 samples the 99th, of 2 the larger (never below the median). */
static void test_p99(void **state) {
  (void)state;
  bench_samples s = {0};
  for (int i = 100; i >= 1; i--)
    bench_add(&s, i);
  assert_true(bench_p99(&s) == 99);
  bench_reset(&s);
  bench_add(&s, 2);
  bench_add(&s, 1);
  assert_true(bench_p99(&s) == 2);
  assert_true(bench_p99(&s) >= bench_median(&s));
  bench_reset(&s);
  bench_add(&s, 7);
  assert_true(bench_p99(&s) == 7);
  bench_free(&s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_counts_peer),
      cmocka_unit_test(test_counts_self_only),
      cmocka_unit_test(test_local_work_none),
      cmocka_unit_test(test_rows_json),
      cmocka_unit_test(test_rows_text_without_bytes),
      cmocka_unit_test(test_p99),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, NULL, NULL);
}
