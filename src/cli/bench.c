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

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
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

static uint64_t thread_switches(void) {
  struct rusage ru;
  return getrusage(RUSAGE_THREAD, &ru) == 0 ? (uint64_t)ru.ru_nvcsw : 0;
}

/* This thread's switches while it paused: the meter's windows leave them out. */
static _Thread_local uint64_t own_pause_switches;

static void sleep_ms(int ms) {
  uint64_t before = thread_switches();
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
  own_pause_switches += thread_switches() - before;
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

/* ---- wake-ups ---- */

/* The voluntary switches of every live thread of process pid (a thread that ended took its count
 * with it: the peers' threads live as long as the row). */
static uint64_t process_switches(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
  DIR *d = opendir(path);
  if (!d)
    return 0;
  uint64_t sum = 0;
  struct dirent *e;
  char line[128];
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    char status[96];
    snprintf(status, sizeof status, "/proc/%d/task/%.16s/status", (int)pid, e->d_name);
    FILE *f = fopen(status, "r");
    if (!f)
      continue;
    unsigned long long v;
    while (fgets(line, sizeof line, f))
      if (sscanf(line, "voluntary_ctxt_switches: %llu", &v) == 1) {
        sum += v;
        break;
      }
    fclose(f);
  }
  closedir(d);
  return sum;
}

void bench_wake_init(bench_wake *w, const pid_t *pids, int n) {
  *w = (bench_wake){.idle_per_s = -1};
  for (int i = 0; i < n && w->npeers < BENCH_WAKE_PEERS; i++)
    if (pids[i] > 0)
      w->peers[w->npeers++] = pids[i];
}

uint64_t bench_wake_count(const bench_wake *w) {
  struct rusage ru;
  uint64_t sum = getrusage(RUSAGE_SELF, &ru) == 0 ? (uint64_t)ru.ru_nvcsw : 0;
  for (int i = 0; i < w->npeers; i++)
    sum += process_switches(w->peers[i]);
  return sum;
}

void bench_wake_begin(bench_wake *w) {
  w->own_at = own_pause_switches;
  w->at = bench_wake_count(w);
  w->t_at = bench_now();
}

void bench_wake_begin_paced(bench_wake *w, const bench_opts *o) {
  sleep_ms(BENCH_WAKE_QUIET_MS);
  bench_wake_begin(w);
  bench_pace(o);
}

void bench_wake_end(bench_wake *w, size_t calls) {
  double t = bench_now();
  uint64_t now = bench_wake_count(w), own = own_pause_switches - w->own_at;
  double n = (double)now - (double)w->at - (double)own; /* a peer thread that ended took its own */
  bench_wake_add(w, n > 0 ? n : 0, t - w->t_at, calls);
}

void bench_wake_end_settled(bench_wake *w, size_t calls, int ms) {
  if (ms > 0)
    sleep_ms(ms);
  bench_wake_end(w, calls);
}

void bench_wake_add(bench_wake *w, double switches, double seconds, size_t calls) {
  w->switches += switches;
  w->seconds += seconds;
  w->calls += calls;
}

void bench_wake_idle(bench_wake *w, int ms) {
  bench_wake idle = *w;
  idle.switches = idle.seconds = 0;
  bench_wake_begin(&idle);
  sleep_ms(ms);
  bench_wake_end(&idle, 0);
  w->idle_per_s = idle.seconds > 0 ? idle.switches / idle.seconds : -1;
}

void bench_wake_idle_paced(bench_wake *w, const bench_opts *o, int settle_ms) {
  bench_wake idle = *w;
  idle.switches = idle.seconds = 0;
  idle.calls = 0;
  bench_wake_begin_paced(&idle, o);
  bench_wake_end_settled(&idle, 0, settle_ms);
  w->idle_switches += idle.switches;
  w->idle_windows++;
}

double bench_wake_per_call(const bench_wake *w) {
  return w && w->calls > 0 ? w->switches / (double)w->calls : -1;
}

double bench_wake_idle_per_call(const bench_wake *w) {
  if (!w || w->calls == 0)
    return -1;
  if (w->idle_windows > 0)
    return w->idle_switches / (double)w->idle_windows;
  return w->idle_per_s >= 0 ? w->idle_per_s * w->seconds / (double)w->calls : -1;
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

int bench_dir_host(const char *name, const char *listen, ferry_ctx **ctx, ferry_store **st,
                   char *url, size_t cap) {
  ferry_ctx_opts co = {.size = sizeof co, .name = name, .tcp_listen = listen};
  ferry_store_opts so = {
      .size = sizeof so, .capacity = 1 << 20, .flags = FERRY_STORE_HOST_DIRECTORY};
  *st = NULL;
  int rc = ferry_ctx_open(&co, ctx);
  if (rc == 0)
    rc = ferry_store_open(*ctx, &so, st);
  const char *tcp = rc == 0 ? strstr(ferry_ctx_address(*ctx), "tcp://") : NULL;
  if (rc == 0 && !tcp)
    rc = FERRY_ESTATE;
  if (rc == 0)
    snprintf(url, cap, "ferry://%.*s", (int)strcspn(tcp + 6, ","), tcp + 6);
  return rc;
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
  return b->s[(99 * b->n + 99) / 100 - 1]; /* nearest rank: never below the median of a few */
}

void bench_row(const bench_opts *o, const char *bench, const char *case_name, const char *impl,
               uint64_t bytes, bench_samples *b, bool baseline) {
  bench_row_wake(o, bench, case_name, impl, bytes, b, baseline, NULL);
}

void bench_row_wake(const bench_opts *o, const char *bench, const char *case_name, const char *impl,
                    uint64_t bytes, bench_samples *b, bool baseline, const bench_wake *w) {
  if (b->n == 0)
    return;
  double p99 = bench_p99(b);
  double med = b->n % 2 ? b->s[b->n / 2] : (b->s[b->n / 2 - 1] + b->s[b->n / 2]) / 2;
  double mn = b->s[0], mx = b->s[b->n - 1];
  double gbps = med > 0 ? (double)bytes / med / 1e9 : 0;
  double wk = bench_wake_per_call(w);
  if (baseline)
    case_baseline = med;
  if (o->json) {
    char wake[64] = "";
    if (wk >= 0)
      snprintf(wake, sizeof wake, ",\"wakeups_per_call\":%.4g", wk);
    printf("{\"bench\":\"%s\",\"case\":\"%s\",\"impl\":\"%s\",\"bytes\":%llu,\"median_s\":%.9g,"
           "\"min_s\":%.9g,\"max_s\":%.9g,\"p99_s\":%.9g,\"gbps\":%.6g%s}\n",
           bench, case_name, impl, (unsigned long long)bytes, med, mn, mx, p99, gbps, wake);
  } else {
    char a[32], c[32], d[32], rate[32] = "-", wake[48] = "";
    if (wk >= 0)
      snprintf(wake, sizeof wake, "  wake-ups/call %.2f", wk);
    if (bytes) /* a row that moves no bytes (a control request) has no rate: "-", not 0.00 */
      snprintf(rate, sizeof rate, "%.2f", gbps);
    printf("%-16s %-14s %12s %12s %12s %10s %8.2f%s\n", case_name, impl, fmt_time(med, a, sizeof a),
           fmt_time(mn, c, sizeof c), fmt_time(mx, d, sizeof d), rate,
           case_baseline > 0 && med > 0 ? case_baseline / med : 0, wake);
  }
  fflush(stdout);
}

/* A JSON number, or null when v < 0 (not measured). */
static const char *json_num(double v, char *buf, size_t len) {
  if (v < 0)
    snprintf(buf, len, "null");
  else
    snprintf(buf, len, "%.4g", v);
  return buf;
}

void bench_paced_row(const bench_opts *o, const char *bench, const char *case_name,
                     const char *impl, uint64_t bytes, bench_samples *paced, double b2b_median,
                     const bench_wake *w) {
  if (paced->n == 0)
    return;
  double p99 = bench_p99(paced);
  double med = bench_median(paced);
  double ratio = b2b_median > 0 ? med / b2b_median : 0;
  double wk = bench_wake_per_call(w), idle = bench_wake_idle_per_call(w);
  if (o->json) {
    char a[32], b[32];
    printf("{\"bench\":\"%s\",\"case\":\"%s\",\"impl\":\"%s@%dms\",\"paced_ms\":%d,"
           "\"bytes\":%llu,\"samples\":%zu,\"median_s\":%.9g,\"p99_s\":%.9g,\"min_s\":%.9g,"
           "\"max_s\":%.9g,\"b2b_median_s\":%.9g,\"paced_over_b2b\":%.6g,"
           "\"wakeups_per_call\":%s,\"idle_wakeups_per_call\":%s}\n",
           bench, case_name, impl, o->pace_ms, o->pace_ms, (unsigned long long)bytes, paced->n, med,
           p99, paced->s[0], paced->s[paced->n - 1], b2b_median, ratio, json_num(wk, a, sizeof a),
           json_num(idle, b, sizeof b));
  } else {
    char name[48], a[32], c[32], wake[64] = "";
    snprintf(name, sizeof name, "%s@%dms", impl, o->pace_ms);
    if (wk >= 0 && idle >= 0)
      snprintf(wake, sizeof wake, " wake-ups/call %.2f (idle %.2f)", wk, idle);
    else if (wk >= 0)
      snprintf(wake, sizeof wake, " wake-ups/call %.2f", wk);
    printf("%-16s %-14s %12s  p99 %-12s paced/back-to-back %.2f (%zu calls)%s\n", case_name, name,
           fmt_time(med, a, sizeof a), fmt_time(p99, c, sizeof c), ratio, paced->n, wake);
  }
  fflush(stdout);
}

/* One floor row: a no-op (src NULL) or a memcpy of bytes, timed by u, its wake-ups into w. */
static void floor_time(bench_until u, void *dst, const void *src, uint64_t bytes, bench_samples *b,
                       bench_wake *w) {
  bench_wake_init(w, NULL, 0);
  bench_wake_begin(w);
  while (!bench_done(&u, b->n)) {
    double t = bench_now();
    if (src)
      memcpy(dst, src, bytes);
    __asm__ volatile("" ::"r"(dst) : "memory");
    bench_add(b, bench_now() - t);
  }
  bench_wake_end(w, b->n);
}

void bench_paced_floor(const bench_opts *o, const char *bench, uint64_t bytes) {
  int paced = bench_paced_samples(o);
  uint8_t *src = malloc(bytes), *dst = malloc(bytes);
  if (paced == 0 || !src || !dst) {
    free(src), free(dst);
    return;
  }
  memset(src, 1, bytes);
  memset(dst, 2, bytes);
  char impl[32], size[16];
  snprintf(impl, sizeof impl, "memcpy-%s", bench_size_name(bytes, size, sizeof size));
  for (int k = 0; k < 2; k++) {
    bench_samples b = {0};
    bench_wake w;
    const char *name = k ? impl : "noop";
    const void *from = k ? src : NULL;
    floor_time(bench_until_start(10 * paced, 10 * paced, 0), dst, from, bytes, &b, &w);
    bench_row_wake(o, bench, "paced-floor", name, k ? bytes : 0, &b, k == 0, &w);
    double b2b = bench_median(&b);
    bench_reset(&b);
    floor_time(bench_until_paced(o), dst, from, bytes, &b, &w);
    bench_wake_idle(&w, BENCH_WAKE_IDLE_MS);
    bench_paced_row(o, bench, "paced-floor", name, k ? bytes : 0, &b, b2b, &w);
    bench_free(&b);
  }
  free(src);
  free(dst);
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
