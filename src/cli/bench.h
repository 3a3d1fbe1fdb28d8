/*
 * Shared machinery of `ferry bench`: timing samples, medians, the table and the JSON lines.
 * Every mode reports rows {bench, case, impl, bytes, median_s, min_s, max_s, gbps}; rows of one
 * case compare, and the first row of a case is its baseline.
 */
#ifndef FR_BENCH_H
#define FR_BENCH_H

#include "cli/args.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct bench_opts {
  bool json;
  int reps;          /* 0: chosen per size */
  uint64_t max_size; /* largest transfer */
  bool full;         /* run the longer sweep */
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
/* "64KiB", "1GiB", "64B" */
const char *bench_size_name(uint64_t bytes, char *buf, size_t len);

/* When a timing loop stops: after `reps` samples, or, given a budget, once `budget_s` seconds
 * have passed since bench_until_start with at least `least` samples (the default runs keep to
 * a time budget; --full and --reps take exactly `reps`). */
typedef struct bench_until {
  int reps, least;
  double end; /* bench_now() deadline; 0: none */
} bench_until;
bench_until bench_until_start(int reps, int least, double budget_s);
bool bench_done(const bench_until *u, size_t n);

/* The cases between network namespaces listen beyond loopback, where a node needs the fleet
 * token (docs/SECURITY.md): without FERRY_TOKEN set, bench_token_begin sets a random one for
 * the case (the processes it starts inherit it) and says so; bench_token_end(that) unsets it. */
bool bench_token_begin(void);
void bench_token_end(bool set);

int bench_link(int argc, char **argv);
int bench_control(int argc, char **argv);
int bench_store(int argc, char **argv);
int bench_refit(int argc, char **argv);
int bench_mq(int argc, char **argv);

#endif
