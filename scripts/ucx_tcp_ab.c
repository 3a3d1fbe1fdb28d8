/*
 * ucx_tcp_ab: ferry tcp against ucx over UCX's tcp, one-sided reads taking turns.
 *
 * Timed one row after the other, on a shared machine, the load moves between the two windows
 * and the ratio of their medians moves with it (`ferry bench link` takes turns for these two
 * rows from 16 MiB). This tool, for any size and with only these two links in the process,
 * reads from one owner process over a tcp link and a ucx link (UCX_TLS=tcp) in turns (tcp
 * first in even rounds, ucx first in odd ones), so both see the same load, and prints each
 * median and their ratio (tcp's median over ucx's: above 1, ucx is faster). UCX_* in the
 * environment apply to the ucx ctxs as usual; ONLY=tcp or ONLY=ucx times one of them alone
 * (for strace/perf). Not built by CMake; see docs/PERFORMANCE.md ("## ucx"):
 *
 *   cc -O2 -std=c17 -o build/ucx_tcp_ab scripts/ucx_tcp_ab.c -Iinclude -Lbuild -lferry \
 *      -Wl,-rpath,$PWD/build
 *   build/ucx_tcp_ab [MiB (64)] [rounds (21)]
 */
#define _GNU_SOURCE
#include "ferry.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct owner_info {
  char address[2][512];
  ferry_region_ref ref[2];
} owner_info;

static const char *const transports[2] = {"tcp", "ucx"};

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static ferry_ctx *open_ctx(const char *name, int i) {
  if (i == 1)
    setenv("UCX_TLS", "tcp", 1);
  ferry_ctx_opts o = {.size = sizeof o, .name = name, .transports = transports[i]};
  ferry_ctx *ctx;
  if (ferry_ctx_open(&o, &ctx) != 0) {
    fprintf(stderr, "ucx_tcp_ab: %s ctx: %s\n", transports[i], ferry_last_error());
    exit(1);
  }
  return ctx;
}

/* The child: a region of `bytes` in a tcp ctx and in a ucx ctx, until the parent says done. */
static void owner(int info_fd, int quit_fd, size_t bytes) {
  owner_info info;
  for (int i = 0; i < 2; i++) {
    ferry_ctx *ctx = open_ctx(i ? "ab-owner-ucx" : "ab-owner-tcp", i);
    void *mem;
    if (ferry_alloc(ctx, bytes, &mem) != 0 ||
        ferry_region_find(ctx, mem, bytes, &info.ref[i], NULL) != 0) {
      fprintf(stderr, "ucx_tcp_ab: owner: %s\n", ferry_last_error());
      _exit(1);
    }
    memset(mem, 0x5a, bytes);
    snprintf(info.address[i], sizeof info.address[i], "%s", ferry_ctx_address(ctx));
  }
  char c;
  if (write(info_fd, &info, sizeof info) != sizeof info || read(quit_fd, &c, 1) < 0)
    _exit(1);
  _exit(0);
}

static void read_or_die(ferry_link *l, const ferry_region_ref *ref, void *dst, size_t bytes) {
  if (ferry_read(l, ref, 0, dst, bytes, -1) != 0) {
    fprintf(stderr, "ucx_tcp_ab: read: %s\n", ferry_last_error());
    exit(1);
  }
}

int main(int argc, char **argv) {
  size_t bytes = (size_t)(argc > 1 ? strtoull(argv[1], NULL, 0) : 64) << 20;
  int rounds = argc > 2 ? atoi(argv[2]) : 21;
  const char *only = getenv("ONLY");
  int info_pipe[2], quit_pipe[2];
  if (rounds < 1 || pipe(info_pipe) != 0 || pipe(quit_pipe) != 0)
    return 2;
  pid_t pid = fork();
  if (pid == 0)
    owner(info_pipe[1], quit_pipe[0], bytes);
  owner_info info;
  if (pid < 0 || read(info_pipe[0], &info, sizeof info) != sizeof info)
    return 1;
  void *dst = malloc(bytes);
  double *ms[2] = {calloc((size_t)rounds, sizeof(double)), calloc((size_t)rounds, sizeof(double))};
  ferry_link *link[2];
  if (!dst || !ms[0] || !ms[1])
    return 1;
  memset(dst, 1, bytes);
  for (int i = 0; i < 2; i++) {
    if (ferry_connect(open_ctx(i ? "ab-ucx" : "ab-tcp", i), info.address[i], 5000, &link[i])) {
      fprintf(stderr, "ucx_tcp_ab: connect: %s\n", ferry_last_error());
      return 1;
    }
    read_or_die(link[i], &info.ref[i], dst, bytes); /* warm-up */
  }
  for (int r = 0; r < rounds; r++)
    for (int k = 0; k < 2; k++) {
      int i = r & 1 ? 1 - k : k;
      if (only && strcmp(only, transports[i]) != 0)
        continue;
      double t0 = now_ms();
      read_or_die(link[i], &info.ref[i], dst, bytes);
      ms[i][r] = now_ms() - t0;
    }
  for (int i = 0; i < 2; i++)
    qsort(ms[i], (size_t)rounds, sizeof(double), by_value);
  double tcp = ms[0][rounds / 2], ucx = ms[1][rounds / 2];
  printf("%zu MiB x %d: ferry/tcp median %.3f ms (min %.3f), ferry/ucx-tcp median %.3f ms "
         "(min %.3f), tcp/ucx %.2f\n",
         bytes >> 20, rounds, tcp, ms[0][0], ucx, ms[1][0], ucx > 0 ? tcp / ucx : 0.0);
  if (write(quit_pipe[1], "q", 1) != 1)
    return 1;
  waitpid(pid, NULL, 0);
  return 0;
}
