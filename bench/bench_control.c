/*
 * `ferry bench control`: how long a weight-lifecycle request takes from the controller's
 * request until every rank acked it, with 1 and 8 rank processes, for
 *   poll-1s    the design it replaces: one int32 in shared memory, polled every second by rank 0
 *              (which forwards to the other ranks over pipes, as an engine broadcasts) and by
 *              the controller waiting for rank 0's write-back (the baseline row);
 *   poll-1ms   the same with a 1 ms poll;
 *   pipe       a pipe ping-pong to every rank (what plain kernel IPC costs);
 *   ferry      a control cell: futex wake, per-rank acks, futex waits.
 * Ranks do no work, so the numbers are pure signalling latency. Rows report median, min and max;
 * the table also prints p99 (p99_s in --json). The pipe and ferry rows run once more paced
 * (bench.h): requests --pace ms apart, as a controller issues them between training steps.
 */
#include "cli/bench.h"
#include "cli/cli.h"
#include "ferry.h"

#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_RANKS 8

typedef struct legacy_cell { /* the one-int32 design, plus the bench's own stop flag */
  _Atomic int32_t state;
  _Atomic int stop;
} legacy_cell;

static const char control_usage[] =
    "usage: ferry bench control [--json] [--reps N] [--full] [--pace MS]\n\n"
    "Request-to-all-acked latency with 1 and 8 rank processes: ferry's control cell vs the\n"
    "one-int32 polled design it replaces (1 s and 1 ms polls) and a pipe ping-pong.\n"
    "--reps N sets the repetitions of the fast rows (default 2000); the 1 ms poll runs\n"
    "N/10 and the 1 s poll 3. --full runs the same: the default run already holds every row.\n"
    "The pipe and ferry rows also run paced (--pace MS, default 10: 100 requests, each after\n"
    "that pause; --full: 1,000): p50, p99 and paced p50 / back-to-back p50; both runs with\n"
    "wake-ups/call (JSON wakeups_per_call): voluntary context switches per request of this\n"
    "process and the rank processes, the pauses left out (`ferry bench --help`).\n";

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
  nanosleep(&ts, NULL);
}

static void put_byte(int fd) {
  char b = 1;
  if (write(fd, &b, 1) != 1)
    _exit(3);
}

static void get_byte(int fd) {
  char b;
  if (read(fd, &b, 1) != 1)
    _exit(0); /* the other side closed: we are done */
}

static void reap(pid_t *pid, int n) {
  for (int i = 0; i < n; i++) {
    kill(pid[i], SIGKILL);
    waitpid(pid[i], NULL, 0);
  }
}

static void report(const bench_opts *o, const char *case_name, const char *impl, bench_samples *b,
                   bool baseline, const bench_wake *w) {
  double p99 = bench_p99(b);
  bench_row_wake(o, "control", case_name, impl, 0, b, baseline, w);
  if (!o->json && b->n)
    printf("%-16s %-14s %12s p99 %.2f us (n=%zu)\n", "", "", "", p99 * 1e6, b->n);
}

/* ---- the polled int32 (with rank 0 forwarding to the others over pipes) ---- */

typedef struct pipes {
  int down[MAX_RANKS][2]; /* rank 0 -> rank i */
  int up[2];              /* ranks -> rank 0 */
} pipes;

static void legacy_rank0(legacy_cell *c, pipes *p, int nranks, int poll_ms) {
  int32_t seen = 0;
  while (!atomic_load(&c->stop)) {
    int32_t v = atomic_load(&c->state);
    if (v == seen || v % 2 == 0) { /* no new command (even values are write-backs) */
      sleep_ms(poll_ms);
      continue;
    }
    seen = v;
    for (int i = 1; i < nranks; i++)
      put_byte(p->down[i][1]);
    for (int i = 1; i < nranks; i++)
      get_byte(p->up[0]);
    atomic_store(&c->state, v + 1); /* the write-back: "done" */
  }
}

static double legacy_request(legacy_cell *c, int32_t cmd, int poll_ms) {
  double t0 = bench_now();
  atomic_store(&c->state, cmd);
  while (atomic_load(&c->state) != cmd + 1)
    sleep_ms(poll_ms);
  return bench_now() - t0;
}

static void legacy_run(const bench_opts *o, const char *case_name, int nranks, int poll_ms,
                       int reps) {
  legacy_cell *c = mmap(NULL, sizeof *c, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  pipes p;
  if (c == MAP_FAILED || pipe(p.up) != 0)
    return;
  pid_t pid[MAX_RANKS];
  for (int i = 1; i < nranks; i++)
    if (pipe(p.down[i]) != 0)
      return;
  for (int i = 0; i < nranks; i++) {
    if ((pid[i] = fork()) == 0) {
      if (i == 0)
        legacy_rank0(c, &p, nranks, poll_ms);
      else
        for (;;) { /* a forwarded command: ack it */
          get_byte(p.down[i][0]);
          put_byte(p.up[1]);
        }
      _exit(0);
    }
  }
  bench_samples b = {0};
  for (int k = 0; k < reps; k++)
    bench_add(&b, legacy_request(c, 2 * k + 1, poll_ms));
  atomic_store(&c->stop, 1);
  reap(pid, nranks); /* children hold each other's pipe ends: no EOF to wait for */
  for (int i = 1; i < nranks; i++) {
    close(p.down[i][0]);
    close(p.down[i][1]);
  }
  close(p.up[0]);
  close(p.up[1]);
  char impl[32];
  snprintf(impl, sizeof impl, "poll-%s", poll_ms >= 1000 ? "1s" : "1ms");
  report(o, case_name, impl, &b, poll_ms >= 1000, NULL);
  bench_free(&b);
  munmap(c, sizeof *c);
}

/* ---- pipe ping-pong ---- */

static void time_pipe(pipes *p, int nranks, bench_until u, bench_samples *b) {
  while (!bench_done(&u, b->n)) {
    double t0 = bench_now();
    for (int i = 0; i < nranks; i++)
      put_byte(p->down[i][1]);
    for (int i = 0; i < nranks; i++)
      get_byte(p->up[0]);
    bench_add(b, bench_now() - t0);
  }
}

static void pipe_run(const bench_opts *o, const char *case_name, int nranks, int reps) {
  pipes p;
  pid_t pid[MAX_RANKS];
  if (pipe(p.up) != 0)
    return;
  for (int i = 0; i < nranks; i++) {
    if (pipe(p.down[i]) != 0)
      return;
    if ((pid[i] = fork()) == 0) {
      for (;;) {
        get_byte(p.down[i][0]);
        put_byte(p.up[1]);
      }
    }
  }
  bench_samples b = {0}, paced = {0};
  bench_wake w, wp; /* the wake-ups of this process and the ranks' */
  bench_wake_init(&w, pid, nranks);
  bench_wake_begin(&w);
  time_pipe(&p, nranks, bench_until_start(reps, reps, 0), &b);
  bench_wake_end(&w, b.n);
  bench_wake_init(&wp, pid, nranks);
  bench_wake_begin(&wp);
  time_pipe(&p, nranks, bench_until_paced(o), &paced);
  bench_wake_end(&wp, paced.n);
  bench_wake_idle(&wp, BENCH_WAKE_IDLE_MS);
  reap(pid, nranks);
  for (int i = 0; i < nranks; i++) {
    close(p.down[i][0]);
    close(p.down[i][1]);
  }
  close(p.up[0]);
  close(p.up[1]);
  report(o, case_name, "pipe", &b, false, &w);
  bench_paced_row(o, "control", case_name, "pipe", 0, &paced, bench_median(&b), &wp);
  bench_free(&b);
  bench_free(&paced);
}

/* ---- ferry ---- */

static void ferry_rank(const char *name, uint32_t rank, _Atomic int *stop) {
  ferry_ctl_rank *r = NULL;
  if (ferry_ctl_rank_open(name, rank, NULL, &r) != 0)
    _exit(2);
  while (!atomic_load(stop))
    ferry_ctl_rank_step(r, NULL, 1000, NULL);
  ferry_ctl_rank_close(r);
  _exit(0);
}

static int wait_attached(ferry_ctl *ctl, int nranks) {
  for (int i = 0; i < nranks; i++) {
    ferry_ctl_rank_status st = {.size = sizeof st};
    int rc;
    while ((rc = ferry_ctl_rank_status_get(ctl, (uint32_t)i, &st)) == 0 && !st.alive)
      sched_yield();
    if (rc)
      return rc;
  }
  return 0;
}

/* Requests until u is done; *k counts them across calls, so clear and update keep alternating. */
static int time_ferry(ferry_ctl *ctl, bench_until u, int *k, bench_samples *b) {
  for (; !bench_done(&u, b->n); (*k)++) {
    ferry_ctl_cmd cmd = *k % 2 ? FERRY_CTL_UPDATE : FERRY_CTL_CLEAR;
    double t0 = bench_now();
    int rc = ferry_ctl_request(ctl, cmd, 10000);
    if (rc)
      return cli_fail("bench control", rc, ferry_ctl_cmd_name(cmd));
    bench_add(b, bench_now() - t0);
  }
  return 0;
}

static int ferry_run(const bench_opts *o, const char *case_name, int nranks, int reps) {
  char name[64];
  snprintf(name, sizeof name, "bench-%d-%d", (int)getpid(), nranks);
  ferry_ctl_cell *cell = NULL;
  int rc = ferry_ctl_cell_create(name, (uint32_t)nranks, NULL, &cell);
  if (rc)
    return cli_fail("bench control", rc, "create cell");
  _Atomic int *stop =
      mmap(NULL, sizeof *stop, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  *stop = 0;
  pid_t pid[MAX_RANKS];
  for (int i = 0; i < nranks; i++)
    if ((pid[i] = fork()) == 0)
      ferry_rank(name, (uint32_t)i, stop);
  ferry_ctl *ctl = NULL;
  bench_samples b = {0}, paced = {0};
  int k = 0;
  rc = ferry_ctl_open(name, &ctl);
  if (rc == 0)
    rc = wait_attached(ctl, nranks);
  bench_wake w, wp; /* the wake-ups of this process and the ranks' */
  bench_wake_init(&w, pid, nranks);
  bench_wake_init(&wp, pid, nranks);
  bench_wake_begin(&w);
  if (rc == 0)
    rc = time_ferry(ctl, bench_until_start(reps, reps, 0), &k, &b);
  bench_wake_end(&w, b.n);
  bench_wake_begin(&wp);
  if (rc == 0)
    rc = time_ferry(ctl, bench_until_paced(o), &k, &paced);
  bench_wake_end(&wp, paced.n);
  if (rc == 0)
    bench_wake_idle(&wp, BENCH_WAKE_IDLE_MS);
  atomic_store(stop, 1);
  if (ctl)
    ferry_ctl_request(ctl, FERRY_CTL_ABORT, 10000); /* wakes the ranks to see `stop` */
  for (int i = 0; i < nranks; i++)
    waitpid(pid[i], NULL, 0);
  ferry_ctl_close(ctl);
  ferry_ctl_cell_close(cell);
  if (rc == 0) {
    report(o, case_name, "ferry", &b, false, &w);
    bench_paced_row(o, "control", case_name, "ferry", 0, &paced, bench_median(&b), &wp);
  }
  bench_free(&b);
  bench_free(&paced);
  munmap((void *)stop, sizeof *stop);
  return rc ? CLI_FAIL : 0;
}

int bench_control(int argc, char **argv) {
  bench_opts o = {0};
  if (bench_parse(argc, argv, &o, control_usage) < 0)
    return CLI_USAGE;
  int reps = o.reps > 0 ? o.reps : 2000;
  signal(SIGPIPE, SIG_IGN);
  bench_header(&o, "control: request -> every rank acked (rank processes, no work)");
  static const int rank_counts[] = {1, 8};
  int rc = 0;
  for (int i = 0; i < 2 && rc == 0; i++) {
    int n = rank_counts[i];
    char case_name[32];
    snprintf(case_name, sizeof case_name, "%d rank%s", n, n > 1 ? "s" : "");
    legacy_run(&o, case_name, n, 1000, 3);
    legacy_run(&o, case_name, n, 1, reps / 10 > 0 ? reps / 10 : 1);
    pipe_run(&o, case_name, n, reps);
    rc = ferry_run(&o, case_name, n, reps);
  }
  return rc;
}
