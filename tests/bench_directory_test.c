/*
 * `ferry bench directory` end to end at a tiny N (issue 36 deliverable 5): three stand-in nodes
 * with four keys each against a `ferry serve` and a redis-server the bench starts (and an etcd
 * member where this ferry has the etcd:// backend and etcd is installed; else the bench must say
 * why those rows are missing). Every directory must give its lookup and put rows, paced rows
 * and a renew row whose nodes renewed without a failure and whose directory process was read
 * (memory). Only the rows' presence, shape and counts are checked, never their times. Runs the
 * real binary named by FERRY_CLI.
 */
#include "directory/directory.h"
#include "testutil.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define ARGS "--nodes 3 --keys 4 --workers 2 --lease 600 --window 500 --reps 30 --pace 1 --json"

static bool on_path(const char *prog) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", prog);
  return system(cmd) == 0;
}

/* Runs `$FERRY_CLI bench directory ARGS` (stderr into err, cap bytes); its JSON lines as an
 * array, the exit status in *status. */
static json_t *run_bench(const char *args, int *status, char *err, size_t cap) {
  const char *cli = getenv("FERRY_CLI");
  if (!cli)
    fail_msg("FERRY_CLI is not set: run this test through ctest");
  char errfile[] = "/tmp/ferry-bench-dir-test-XXXXXX";
  int fd = mkstemp(errfile);
  assert_true(fd >= 0);
  close(fd);
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "'%s' bench directory %s 2>%s", cli, args, errfile);
  FILE *f = popen(cmd, "r");
  assert_non_null(f);
  json_t *rows = json_array();
  char line[4096];
  while (fgets(line, sizeof line, f)) {
    json_error_t je;
    json_t *j = json_loads(line, 0, &je);
    if (!j)
      fail_msg("not a JSON line: %s", line);
    json_array_append_new(rows, j);
  }
  int rc = pclose(f);
  *status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  FILE *e = fopen(errfile, "r");
  size_t n = e ? fread(err, 1, cap - 1, e) : 0;
  err[n] = '\0';
  if (e)
    fclose(e);
  unlink(errfile);
  return rows;
}

static json_t *row(json_t *rows, const char *case_name, const char *impl) {
  size_t i;
  json_t *j;
  json_array_foreach(rows, i, j) {
    const char *c = json_string_value(json_object_get(j, "case"));
    const char *m = json_string_value(json_object_get(j, "impl"));
    if (c && m && strcmp(c, case_name) == 0 && strcmp(m, impl) == 0)
      return j;
  }
  return NULL;
}

static double num(json_t *j, const char *field) {
  json_t *v = json_object_get(j, field);
  if (!json_is_number(v))
    fail_msg("row has no number %s", field);
  return json_number_value(v);
}

/* Every row of one directory: lookups and puts (back to back and paced) and its load. */
static void assert_directory(json_t *rows, const char *impl) {
  char paced[32];
  snprintf(paced, sizeof paced, "%s@1ms", impl);
  for (const char *const *c = (const char *const[]){"lookup-N3", "put-N3", NULL}; *c; c++) {
    json_t *j = row(rows, *c, impl), *p = row(rows, *c, paced);
    if (!j || !p)
      fail_msg("no %s row (or no paced one) for %s", *c, impl);
    assert_string_equal(json_string_value(json_object_get(j, "bench")), "directory");
    assert_true(num(j, "median_s") > 0);
    assert_true(num(j, "p99_s") >= num(j, "median_s"));
    assert_int_equal((int)num(p, "samples"), 30);
  }
  json_t *r = row(rows, "renew-N3", impl);
  if (!r)
    fail_msg("no renew-N3 row for %s", impl);
  assert_int_equal((int)num(r, "nodes"), 3);
  assert_int_equal((int)num(r, "keys"), 4);
  assert_int_equal((int)num(r, "lease_ms"), 600);
  /* a renewal every 200 ms for 500 ms, three nodes: some fell in the window, none failed */
  assert_true(num(r, "renewals_per_s") > 0);
  assert_int_equal((int)num(r, "renew_failures"), 0);
  assert_int_equal((int)num(r, "lookup_misses"), 0);
  assert_true(num(r, "rss_bytes") > 0);
  assert_true(num(r, "idle_rss_bytes") > 0);
  assert_true(num(r, "cpu_per_s") >= 0);
}

static void tiny_run_has_every_row(void **state) {
  (void)state;
  char err[4096];
  int status;
  json_t *rows = run_bench(ARGS, &status, err, sizeof err);
  if (status != 0)
    fail_msg("exit %d; stderr: %s", status, err);
  assert_directory(rows, "ferry");
  if (on_path("redis-server"))
    assert_directory(rows, "redis");
  else
    assert_non_null(strstr(err, "redis rows at 3 nodes skipped"));
  if (fr_dir_backend("etcd://127.0.0.1:2379") && on_path("etcd"))
    assert_directory(rows, "etcd");
  else if (!fr_dir_backend("etcd://127.0.0.1:2379"))
    assert_non_null(strstr(err, "etcd rows skipped: this ferry has no etcd:// directory backend"));
  json_decref(rows);
}

static void bad_arguments_are_usage_errors(void **state) {
  (void)state;
  static const char *const bad[] = {"--nodes abc",   "--nodes 0", "--nodes 10,", "--impl nope",
                                    "--impl ferry,", "--keys 0",  "--lease 5"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char err[2048];
    int status;
    json_t *rows = run_bench(bad[i], &status, err, sizeof err);
    if (status != 2)
      fail_msg("'%s': exit %d, expected 2 (usage)", bad[i], status);
    assert_int_equal(json_array_size(rows), 0);
    assert_non_null(strstr(err, "bench directory"));
    json_decref(rows);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(tiny_run_has_every_row),
      cmocka_unit_test(bad_arguments_are_usage_errors),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, NULL, NULL);
}
