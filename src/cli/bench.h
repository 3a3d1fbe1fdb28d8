/*
 * Shared machinery of `ferry bench` (the modes are bench/, the ferry-bench program; `ferry demo`
 * prints its table with it too): timing samples, medians, the table and the JSON lines. Every mode
 * reports rows {bench, case, impl, bytes, median_s, min_s, max_s, gbps}; rows of one case compare,
 * and the first row of a case is its baseline.
 */
#ifndef FR_BENCH_H
#define FR_BENCH_H

#include "cli/args.h"
#include "ferry.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct bench_opts {
  bool json;
  int reps;          /* 0: chosen per size */
  uint64_t max_size; /* largest transfer */
  bool full;         /* run the longer sweep */
  int pace_ms;       /* --pace: latency rows also run with calls this far apart (0: not) */
} bench_opts;

typedef struct bench_samples {
  double *s; /* seconds */
  size_t n, cap;
} bench_samples;

void bench_add(bench_samples *b, double seconds);
void bench_reset(bench_samples *b);
void bench_free(bench_samples *b);
double bench_now(void); /* monotonic seconds */

/* Reports one row: prints it (table or JSON). `baseline` marks the case's reference row. */
void bench_row(const bench_opts *o, const char *bench, const char *case_name, const char *impl,
               uint64_t bytes, bench_samples *b, bool baseline);
struct bench_wake;
/* The same with the calls' wake-ups (w: bench_wake below; NULL: none): the table's last column
 * and JSON's wakeups_per_call. */
void bench_row_wake(const bench_opts *o, const char *bench, const char *case_name, const char *impl,
                    uint64_t bytes, bench_samples *b, bool baseline, const struct bench_wake *w);
/* The 99th percentile of the samples (sorts them). */
double bench_p99(bench_samples *b);
/* Prints the table header (not in JSON mode). */
void bench_header(const bench_opts *o, const char *title);
/* Parses a mode's arguments (argv[0] is the mode's name) with the shared parser (args.h):
 * --json, --reps N, --max-size BYTES (K/M/G or KiB/MiB/GiB), --full, -h/--help; a mode takes no
 * operands. Returns argc, or -1 after a one-line usage error. */
int bench_parse(int argc, char **argv, bench_opts *o, const char *usage);
/* The same with the mode's own options besides (a table that ends with a row whose name is
 * NULL). */
int bench_parse_with(int argc, char **argv, bench_opts *o, const char *usage, const cli_opt *extra);
/* "4096", "256K", "1M", "2GiB": bytes (args.h's cli_parse_size); 0 when malformed. */
uint64_t bench_parse_size(const char *s);
/* Write or read exactly len bytes on a pipe or socket (EINTR retried); 0 or -1. */
int bench_write_all(int fd, const void *buf, size_t len);
int bench_read_all(int fd, void *buf, size_t len);
/* A directory this process hosts for a bench's helper processes: a ctx named `name` listening
 * on `listen` ("127.0.0.1:0": a free loopback port) with a store hosting the directory; *url is
 * its "ferry://HOST:PORT". FERRY_ESTATE when the ctx has no tcp address. */
int bench_dir_host(const char *name, const char *listen, ferry_ctx **ctx, ferry_store **st,
                   char *url, size_t cap);
/* "64KiB", "1GiB", "64B" */
const char *bench_size_name(uint64_t bytes, char *buf, size_t len);

/* When a timing loop stops: after `reps` samples, or, given a budget, once `budget_s` seconds
 * have passed since bench_until_start with at least `least` samples (the default runs keep to
 * a time budget; --full and --reps take exactly `reps`). A paced plan (bench_until_paced) also
 * spaces the calls: bench_done sleeps pace_ms before each call it lets through. */
typedef struct bench_until {
  int reps, least;
  double end;  /* bench_now() deadline; 0: none */
  int pace_ms; /* 0: back to back */
} bench_until;
bench_until bench_until_start(int reps, int least, double budget_s);
bool bench_done(const bench_until *u, size_t n);

/* ---- paced latency ----
 * Back-to-back calls keep every thread on their path awake (spinning, or just woken); an
 * application calls between other work, a rollout or a training step, and then each call can
 * pay the wake-ups of sleeping threads. So every latency row also runs paced: the same calls,
 * each after a pause of --pace MS (default BENCH_PACE_MS), reported as p50 and p99 beside the
 * ratio paced p50 / back-to-back p50. BENCH_PACED_SAMPLES calls a row (--full: ten times as
 * many; --reps N, when fewer, N). */
#define BENCH_PACE_MS 10
#define BENCH_PACED_SAMPLES 100
/* How many paced calls a row makes (0 when --pace 0 turned pacing off). */
int bench_paced_samples(const bench_opts *o);
/* A fixed-count plan of bench_paced_samples(o) calls, each after a pause of o->pace_ms. */
bench_until bench_until_paced(const bench_opts *o);
/* Sleeps o->pace_ms: for loops that are not driven by bench_done. */
void bench_pace(const bench_opts *o);
/* The median of the samples (sorts them); 0 when there are none. */
double bench_median(bench_samples *b);

/* ---- wake-ups ----
 * What a paced call pays is mostly the wake-ups of sleeping threads (~20-40 us each on a VM), so
 * the paced rows count them: the voluntary context switches (a thread blocking, to be woken
 * later) of every thread of every process on the call's path, this one (getrusage, dead threads
 * included) and its peers (/proc/PID/task/N/status), summed over windows that hold the timed
 * calls, less this thread's own pauses (each bench pause is one switch of its own, counted as it
 * sleeps), per call. Every wake-up ends in a switch, so a window that covers a call and what it
 * set off counts each once. What the same processes do meanwhile on their own (timers, polls) is
 * counted too, so it is measured apart and reported beside: idle wake-ups per call, from empty
 * windows of the calls' shape between them (bench_wake_idle_paced) or from the processes'
 * idle rate over the windows' length (bench_wake_idle). */
#define BENCH_WAKE_PEERS 16
#define BENCH_WAKE_IDLE_MS 200 /* how long bench_wake_idle watches */
#define BENCH_WAKE_QUIET_MS 1  /* bench_wake_begin_paced's settling before a window */
typedef struct bench_wake {
  pid_t peers[BENCH_WAKE_PEERS]; /* the peer processes on the path */
  int npeers;
  double switches;      /* counted in closed windows, own pauses taken out */
  double seconds;       /* the length of those windows */
  size_t calls;         /* the calls they hold */
  double idle_per_s;    /* the same processes idle (bench_wake_idle); < 0: not measured */
  double idle_switches; /* or in empty windows of the calls' shape (bench_wake_idle_paced) */
  size_t idle_windows;
  uint64_t at, own_at; /* the open window: where it began */
  double t_at;
} bench_wake;
/* A meter of this process and the peers pids[0..n) (at most BENCH_WAKE_PEERS; a pid <= 0 is
 * left out). */
void bench_wake_init(bench_wake *w, const pid_t *pids, int n);
/* Opens a window; bench_wake_end closes it, holding `calls` calls. */
void bench_wake_begin(bench_wake *w);
void bench_wake_end(bench_wake *w, size_t calls);
/* Opens a window for one paced call in a loop that also hands messages between processes (the
 * store's producer and consumer): lets what came before settle (BENCH_WAKE_QUIET_MS, outside the
 * window: the other side's harness blocking on its pipe is not the call's), opens the window,
 * then pauses o->pace_ms. So the call follows its pause directly, as unmetered (reading /proc
 * right before it would change what it finds in the caches). */
void bench_wake_begin_paced(bench_wake *w, const bench_opts *o);
/* Closes a window after a pause of ms (this thread's own switch taken out): what the call set
 * off after it returned (a posted message the peer takes later) falls in its window. */
void bench_wake_end_settled(bench_wake *w, size_t calls, int ms);
/* Adds windows counted elsewhere (another process's meter, sent over a pipe). */
void bench_wake_add(bench_wake *w, double switches, double seconds, size_t calls);
/* The background: the processes left alone for ms (this thread asleep), as a rate. */
void bench_wake_idle(bench_wake *w, int ms);
/* Or one empty window of a paced call's shape (bench_wake_begin_paced, no call, a settle of
 * settle_ms) between the calls: the background as the calls see it. */
void bench_wake_idle_paced(bench_wake *w, const bench_opts *o, int settle_ms);
/* Switches per call (< 0: nothing counted), and the background's part of it (< 0: not
 * measured). */
double bench_wake_per_call(const bench_wake *w);
double bench_wake_idle_per_call(const bench_wake *w);
/* This process's and the peers' voluntary switches now. */
uint64_t bench_wake_count(const bench_wake *w);

/* Reports the paced row of (case, impl): p50, p99 and p50 / b2b_median (the back-to-back row's
 * median), in the table or as one JSON line with impl "IMPL@MSms", paced_ms, samples,
 * median_s, p99_s, min_s, max_s, b2b_median_s and paced_over_b2b; with a meter (w, NULL: none),
 * wakeups_per_call and idle_wakeups_per_call (bench_wake_*_per_call; null when not measured). */
void bench_paced_row(const bench_opts *o, const char *bench, const char *case_name,
                     const char *impl, uint64_t bytes, bench_samples *paced, double b2b_median,
                     const bench_wake *w);

/* The floor of a paced call in this process, printed as rows of case "paced-floor": a no-op
 * (the clock, read right after a pause) and a memcpy of `bytes` between two buffers nothing else
 * touches, each back to back and paced. A call that wakes nobody still pays what a pause costs
 * what it touches (caches, TLB, a vCPU that idled); against the memcpy's ratio a row's own
 * ratio tells that cost from its wake-ups. */
void bench_paced_floor(const bench_opts *o, const char *bench, uint64_t bytes);

/* The cases between network namespaces listen beyond loopback, where a node needs the fleet
 * token (docs/SECURITY.md): without FERRY_TOKEN set, bench_token_begin sets a random one for
 * the case (the processes it starts inherit it) and says so; bench_token_end(that) unsets it. */
bool bench_token_begin(void);
void bench_token_end(bool set);

/* The modes (bench/bench_MODE.c), in the ferry-bench program only; argv[0] is the mode's name. */
int bench_link(int argc, char **argv);
int bench_control(int argc, char **argv);
int bench_store(int argc, char **argv);
int bench_refit(int argc, char **argv);
int bench_mq(int argc, char **argv);
int bench_gpu(int argc, char **argv);
int bench_directory(int argc, char **argv);

#endif
