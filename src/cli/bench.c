/*
 * The reporting the benchmarks share (bench.h): timing samples, medians, the table and the JSON
 * lines, and the options every mode takes. Here rather than in bench/ because `ferry demo`
 * prints its table the same way; the modes themselves are the ferry-bench program (bench/).
 * Numbers are medians over repeated runs with min and max beside them; the "vs base" column is
 * the baseline's median over this row's median, so 1.00 means "as fast as the baseline" and
 * higher is faster.
 */
#include "cli/args.h"
#include "cli/bench.h"
#include "cli/cli.h"
#include "core/core.h"
#include "ferry.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

double bench_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void bench_add(bench_samples *b, double seconds) {
  if (FR_GROW(b->s, b->cap, b->n + 1, 64) != 0) {
    errno = ENOMEM;
    perror("ferry bench");
    exit(CLI_FAIL);
  }
  b->s[b->n++] = seconds;
}

void bench_reset(bench_samples *b) { b->n = 0; }

bench_until bench_until_start(int reps, int least, double budget_s) {
  return (bench_until){reps, least < reps ? least : reps, budget_s > 0 ? bench_now() + budget_s : 0,
                       0};
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

bool bench_done(const bench_until *u, size_t n) {
  if (n >= (size_t)u->reps)
    return true;
  if (u->end > 0 && n >= (size_t)u->least && bench_now() >= u->end)
    return true;
  if (u->pace_ms > 0)
    sleep_ms(u->pace_ms);
  return false;
}

int bench_paced_samples(const bench_opts *o) {
  if (o->pace_ms <= 0)
    return 0;
  int n = o->full ? 10 * BENCH_PACED_SAMPLES : BENCH_PACED_SAMPLES;
  return o->reps > 0 && o->reps < n ? o->reps : n;
}

bench_until bench_until_paced(const bench_opts *o) {
  int n = bench_paced_samples(o);
  return (bench_until){n, n, 0, o->pace_ms};
}

void bench_pace(const bench_opts *o) {
  if (o->pace_ms > 0)
    sleep_ms(o->pace_ms);
}

bool bench_token_begin(void) {
  const char *t = ferry_config_get("FERRY_TOKEN");
  uint8_t r[16];
  if ((t && *t) || getrandom(r, sizeof r, 0) != (ssize_t)sizeof r)
    return false;
  char hex[2 * sizeof r + 1];
  for (size_t i = 0; i < sizeof r; i++)
    snprintf(hex + 2 * i, 3, "%02x", r[i]);
  return setenv("FERRY_TOKEN", hex, 1) == 0;
}

void bench_token_end(bool set) {
  if (set)
    unsetenv("FERRY_TOKEN");
}

void bench_free(bench_samples *b) {
  free(b->s);
  *b = (bench_samples){0};
}

int bench_write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

int bench_read_all(int fd, void *buf, size_t len) {
  char *p = buf;
  while (len > 0) {
    ssize_t n = read(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

const char *bench_size_name(uint64_t bytes, char *buf, size_t len) {
  static const char *units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (u < 3 && bytes >= 1024 && bytes % 1024 == 0) {
    bytes /= 1024;
    u++;
  }
  snprintf(buf, len, "%llu%s", (unsigned long long)bytes, units[u]);
  return buf;
}

static double case_baseline = 0; /* median of the current case's baseline row */

void bench_header(const bench_opts *o, const char *title) {
  if (o->json)
    return;
  printf("\n%s\n%-16s %-14s %12s %12s %12s %10s %8s\n", title, "case", "impl", "median", "min",
         "max", "GB/s", "vs base");
}

static const char *fmt_time(double s, char *buf, size_t len) {
  if (s < 1e-3)
    snprintf(buf, len, "%.2f us", s * 1e6);
  else if (s < 1)
    snprintf(buf, len, "%.3f ms", s * 1e3);
  else
    snprintf(buf, len, "%.3f s", s);
  return buf;
}

double bench_median(bench_samples *b) {
  if (b->n == 0)
    return 0;
  qsort(b->s, b->n, sizeof *b->s, cmp_double);
  return b->n % 2 ? b->s[b->n / 2] : (b->s[b->n / 2 - 1] + b->s[b->n / 2]) / 2;
}

double bench_p99(bench_samples *b) {
  if (b->n == 0)
    return 0;
  qsort(b->s, b->n, sizeof *b->s, cmp_double);
  return b->s[(size_t)((double)(b->n - 1) * 0.99)];
}

void bench_row(const bench_opts *o, const char *bench, const char *case_name, const char *impl,
               uint64_t bytes, bench_samples *b, bool baseline) {
  if (b->n == 0)
    return;
  double p99 = bench_p99(b);
  double med = b->n % 2 ? b->s[b->n / 2] : (b->s[b->n / 2 - 1] + b->s[b->n / 2]) / 2;
  double mn = b->s[0], mx = b->s[b->n - 1];
  double gbps = med > 0 ? (double)bytes / med / 1e9 : 0;
  if (baseline)
    case_baseline = med;
  if (o->json) {
    printf("{\"bench\":\"%s\",\"case\":\"%s\",\"impl\":\"%s\",\"bytes\":%llu,\"median_s\":%.9g,"
           "\"min_s\":%.9g,\"max_s\":%.9g,\"p99_s\":%.9g,\"gbps\":%.6g}\n",
           bench, case_name, impl, (unsigned long long)bytes, med, mn, mx, p99, gbps);
  } else {
    char a[32], c[32], d[32];
    printf("%-16s %-14s %12s %12s %12s %10.2f %8.2f\n", case_name, impl, fmt_time(med, a, sizeof a),
           fmt_time(mn, c, sizeof c), fmt_time(mx, d, sizeof d), gbps,
           case_baseline > 0 && med > 0 ? case_baseline / med : 0);
  }
  fflush(stdout);
}

void bench_paced_row(const bench_opts *o, const char *bench, const char *case_name,
                     const char *impl, uint64_t bytes, bench_samples *paced, double b2b_median) {
  if (paced->n == 0)
    return;
  double p99 = bench_p99(paced);
  double med = bench_median(paced);
  double ratio = b2b_median > 0 ? med / b2b_median : 0;
  if (o->json) {
    printf("{\"bench\":\"%s\",\"case\":\"%s\",\"impl\":\"%s@%dms\",\"paced_ms\":%d,"
           "\"bytes\":%llu,\"samples\":%zu,\"median_s\":%.9g,\"p99_s\":%.9g,\"min_s\":%.9g,"
           "\"max_s\":%.9g,\"b2b_median_s\":%.9g,\"paced_over_b2b\":%.6g}\n",
           bench, case_name, impl, o->pace_ms, o->pace_ms, (unsigned long long)bytes, paced->n, med,
           p99, paced->s[0], paced->s[paced->n - 1], b2b_median, ratio);
  } else {
    char name[48], a[32], c[32];
    snprintf(name, sizeof name, "%s@%dms", impl, o->pace_ms);
    printf("%-16s %-14s %12s  p99 %-12s paced/back-to-back %.2f (%zu calls)\n", case_name, name,
           fmt_time(med, a, sizeof a), fmt_time(p99, c, sizeof c), ratio, paced->n);
  }
  fflush(stdout);
}

uint64_t bench_parse_size(const char *s) {
  uint64_t v = 0;
  return cli_parse_size(s, &v) == 0 ? v : 0;
}

#define MAX_EXTRA 8
#define COMMON 5

int bench_parse_with(int argc, char **argv, bench_opts *o, const char *usage,
                     const cli_opt *extra) {
  o->pace_ms = BENCH_PACE_MS;
  cli_opt opts[COMMON + MAX_EXTRA + 1] = {
      {"json", CLI_ARG_FLAG, &o->json, 0, 0},         {"reps", CLI_ARG_INT, &o->reps, 1, 0},
      {"max-size", CLI_ARG_SIZE, &o->max_size, 1, 0}, {"full", CLI_ARG_FLAG, &o->full, 0, 0},
      {"pace", CLI_ARG_INT, &o->pace_ms, 0, 10000},
  };
  for (size_t i = 0; extra && extra[i].name && i < MAX_EXTRA; i++)
    opts[COMMON + i] = extra[i];
  char name[64];
  snprintf(name, sizeof name, "bench %s", argc > 0 ? argv[0] : "");
  const cli_cmd cmd = {name, usage, NULL, 0, 0, opts};
  return cli_parse(&cmd, argc, argv, NULL) < 0 ? -1 : argc;
}

int bench_parse(int argc, char **argv, bench_opts *o, const char *usage) {
  return bench_parse_with(argc, argv, o, usage, NULL);
}
