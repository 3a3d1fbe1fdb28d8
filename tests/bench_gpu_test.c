/*
 * `ferry bench gpu` end to end: on the stand-in driver (or a real one under FERRY_TEST_CUDA=driver)
 * `--quick --json` must run every case of issue 18's device check, each row beside its baseline
 * (alias mode over CUDA IPC included); without a driver (FERRY_CUDA=off) it must
 * say so in one JSON line and exit 0. Only the rows' presence and shape are checked, never their
 * times; the refit rows' breakdowns (issue 37: where a push's time goes, from the sender's and
 * the receiver's metrics) must carry every phase, and count the copies and buckets they saw; the
 * group row (two sender rank processes, a group receiver binding device memory) is there too.
 * Runs the real binary named by FERRY_CLI.
 */
// ferry-test: cuda
#include "testutil.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

static bool have_cuda;

static int setup(void **state) {
  (void)state;
  have_cuda = tu_cuda_use();
  return 0;
}

/* Runs `[env] $FERRY_CLI bench gpu ARGS` and returns its JSON lines as an array (the exit status
 * in *status). */
static json_t *run_bench(const char *env, const char *args, int *status) {
  const char *cli = getenv("FERRY_CLI");
  if (!cli)
    fail_msg("FERRY_CLI is not set: run this test through ctest");
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s '%s' bench gpu %s", env, cli, args);
  FILE *f = popen(cmd, "r");
  assert_non_null(f);
  json_t *rows = json_array();
  char line[4096];
  while (fgets(line, sizeof line, f)) {
    json_error_t err;
    json_t *j = json_loads(line, 0, &err);
    if (!j)
      fail_msg("not a JSON line: %s", line);
    json_array_append_new(rows, j);
  }
  int rc = pclose(f);
  *status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  return rows;
}

/* The row of (case prefix, impl), or NULL. */
static json_t *row(json_t *rows, const char *case_prefix, const char *impl) {
  size_t i;
  json_t *j;
  json_array_foreach(rows, i, j) {
    const char *c = json_string_value(json_object_get(j, "case"));
    const char *m = json_string_value(json_object_get(j, "impl"));
    if (c && m && strncmp(c, case_prefix, strlen(case_prefix)) == 0 && strcmp(m, impl) == 0)
      return j;
  }
  return NULL;
}

static void assert_measured(json_t *rows, const char *case_prefix, const char *impl) {
  json_t *j = row(rows, case_prefix, impl);
  if (!j)
    fail_msg("no row %s* / %s", case_prefix, impl);
  assert_true(json_number_value(json_object_get(j, "median_s")) > 0);
  assert_true(json_integer_value(json_object_get(j, "bytes")) > 0);
  assert_string_equal(json_string_value(json_object_get(j, "bench")), "gpu");
}

/* The breakdown line of refit variant impl: every field a number, none negative; the copying
 * variants counted device copies on both sides and buckets at the receiver (alias: none there). */
static const char *const breakdown_fields[] = {
    "push_mean_s",     "push_median_s",  "tx_pack_s", "tx_slot_wait_s",  "tx_read_wait_s",
    "tx_notify_s",     "tx_commit_s",    "tx_copies", "tx_copy_issue_s", "tx_copy_sync_s",
    "rx_buckets",      "rx_wait_s",      "rx_copy_s", "rx_ack_s",        "rx_copies",
    "rx_copy_issue_s", "rx_copy_sync_s", NULL};

static void assert_breakdown(json_t *rows, const char *case_prefix, const char *impl) {
  size_t i;
  json_t *j, *b = NULL;
  json_array_foreach(rows, i, j) {
    const char *c = json_string_value(json_object_get(j, "case"));
    const char *k = json_string_value(json_object_get(j, "breakdown"));
    if (c && k && strncmp(c, case_prefix, strlen(case_prefix)) == 0 && strcmp(k, impl) == 0)
      b = j;
  }
  if (!b)
    fail_msg("no breakdown line for %s", impl);
  assert_null(json_object_get(b, "impl")); /* not a timed row */
  assert_true(json_integer_value(json_object_get(b, "pushes")) > 0);
  for (const char *const *f = breakdown_fields; *f; f++) {
    json_t *v = json_object_get(b, *f);
    if (!json_is_number(v))
      fail_msg("breakdown %s: %s is not a number", impl, *f);
    assert_true(json_number_value(v) >= 0);
  }
  bool alias = strcmp(impl, "ferry-alias") == 0;
  double tx_copies = json_number_value(json_object_get(b, "tx_copies")),
         rx_copies = json_number_value(json_object_get(b, "rx_copies")),
         rx_buckets = json_number_value(json_object_get(b, "rx_buckets"));
  if (!(tx_copies > 0) || (rx_copies > 0) != !alias || !(rx_buckets > 0))
    fail_msg("breakdown %s: tx_copies %g, rx_copies %g, rx_buckets %g", impl, tx_copies, rx_copies,
             rx_buckets);
}

static void quick_run_has_every_case(void **state) {
  (void)state;
  if (!have_cuda)
    skip();
  int status;
  json_t *rows = run_bench("", "--quick --json", &status);
  assert_int_equal(status, 0);
  assert_measured(rows, "refit-colo-", "d2d-copy");
  assert_measured(rows, "refit-colo-", "ferry-copying");
  assert_measured(rows, "refit-colo-", "d2d-copy-by-tensor");
  assert_measured(rows, "refit-colo-", "ferry-alias");
  /* issue 37's experiments, each checked by its receiver like the default */
  assert_measured(rows, "refit-colo-", "ferry-copying-whole");
  assert_measured(rows, "refit-colo-", "ferry-copying-serial");
  assert_measured(rows, "refit-colo-", "ferry-copying-pack-async");
  for (const char *const *impl =
           (const char *const[]){"ferry-copying", "ferry-copying-whole", "ferry-copying-serial",
                                 "ferry-copying-pack-async", "ferry-alias", NULL};
       *impl; impl++)
    assert_breakdown(rows, "refit-colo-", *impl);
  /* row (d): two sender rank processes to a group receiver binding device memory, checked by it */
  assert_measured(rows, "refit-group-", "d2d-copy");
  assert_measured(rows, "refit-group-", "ferry-group");
  assert_measured(rows, "refit-group-", "ferry-group-device-buckets");
  assert_breakdown(rows, "refit-group-", "ferry-group");
  assert_breakdown(rows, "refit-group-", "ferry-group-device-buckets");
  for (const char *const *impl =
           (const char *const[]){"d2d-copy", "ferry-put", "ferry-get", "ferry-put+get",
                                 "ferry-put(devpool)", "ferry-get(devpool)",
                                 "ferry-put+get(devpool)", NULL};
       *impl; impl++)
    assert_measured(rows, "routing-11MiB", *impl);
  assert_measured(rows, "staged-", "pinned-d2h+h2d");
  assert_measured(rows, "staged-", "ferry-staged");
  assert_measured(rows, "bounce-", "ferry-read-malloc");
  assert_measured(rows, "bounce-", "ferry-read-pinned");
  /* the refit goal's line: a ratio, its goal and whether it is met */
  size_t i;
  json_t *j, *goal = NULL;
  json_array_foreach(rows, i, j) if (json_object_get(j, "goal")) goal = j;
  assert_non_null(goal);
  assert_true(json_number_value(json_object_get(goal, "ratio")) > 0);
  assert_true(json_is_boolean(json_object_get(goal, "met")));
  json_decref(rows);
}

static void without_a_driver_it_says_so(void **state) {
  (void)state;
  int status;
  json_t *rows = run_bench("FERRY_CUDA=off", "--json", &status);
  assert_int_equal(status, 0);
  assert_int_equal(json_array_size(rows), 1);
  json_t *j = json_array_get(rows, 0);
  assert_true(json_is_true(json_object_get(j, "skipped")));
  const char *detail = json_string_value(json_object_get(j, "detail"));
  assert_non_null(detail);
  assert_non_null(strstr(detail, "no CUDA driver"));
  assert_non_null(strstr(detail, "FERRY_CUDA=off"));
  json_decref(rows);
}

static void bad_arguments_are_usage_errors(void **state) {
  (void)state;
  int status;
  json_t *rows = run_bench("FERRY_CUDA=off", "--only nothing 2>/dev/null", &status);
  assert_int_equal(status, 2);
  assert_int_equal(json_array_size(rows), 0);
  json_decref(rows);
  rows = run_bench("FERRY_CUDA=off", "--refit-bytes 12 2>/dev/null", &status);
  assert_int_equal(status, 2);
  json_decref(rows);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(quick_run_has_every_case),
      cmocka_unit_test(without_a_driver_it_says_so),
      cmocka_unit_test(bad_arguments_are_usage_errors),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, setup, NULL);
}
