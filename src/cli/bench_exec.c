/*
 * `ferry bench`: the benchmarks are a program of their own, ferry-bench (bench/), so that the
 * ferry command links neither nng nor ZeroMQ. This execs it in this process with the arguments
 * as given ("ferry bench MODE ..."), so what `ferry bench` prints, its --help and its exit
 * status are the benchmarks' own. The program is FERRY_BENCH_BIN when set; else the one next to
 * this executable (the build tree), else the installed one in FERRY_BENCH_RELDIR from this
 * executable's folder (../libexec/ferry: `make install` puts it there).
 */
#include "cli/cli.h"
#include "ferry.h"

#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef FERRY_BENCH_RELDIR
#define FERRY_BENCH_RELDIR "../libexec/ferry"
#endif
#define BENCH_NAME "ferry-bench"

/* Whether path is this program: exec'ing it would run `ferry bench` again, for ever. */
static bool is_self(const char *path) {
  struct stat a, b;
  return stat(path, &a) == 0 && stat("/proc/self/exe", &b) == 0 && a.st_dev == b.st_dev &&
         a.st_ino == b.st_ino;
}

/* Runs path with args unless it is this program; returns the error's errno. */
static int try_exec(const char *path, char **args) {
  if (is_self(path))
    return ELOOP;
  execv(path, args);
  return errno;
}

/* Runs the benchmarks with args; returns only when they could not be run: the error's errno. */
static int exec_bench(char **args) {
  const char *set = ferry_config_get("FERRY_BENCH_BIN");
  if (set && *set) {
    int err = try_exec(set, args);
    fprintf(stderr, "ferry bench: cannot run FERRY_BENCH_BIN=%s: %s\n", set,
            err == ELOOP ? "it is the ferry command itself" : strerror(err));
    return err;
  }
  char self[PATH_MAX], near[PATH_MAX + 16], installed[PATH_MAX + 64];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) {
    int err = errno;
    fprintf(stderr, "ferry bench: cannot find this program's folder: %s\n", strerror(err));
    return err;
  }
  self[n] = '\0';
  *strrchr(self, '/') = '\0'; /* the kernel's path is absolute */
  snprintf(near, sizeof near, "%s/" BENCH_NAME, self);
  snprintf(installed, sizeof installed, "%s/" FERRY_BENCH_RELDIR "/" BENCH_NAME, self);
  const char *tried = near;
  int err = try_exec(near, args);
  if (err == ENOENT) {
    tried = installed;
    err = try_exec(installed, args);
  }
  if (err == ENOENT)
    fprintf(stderr,
            "ferry bench: the benchmarks are not built or not installed: neither %s nor %s "
            "exists (FERRY_BENCH_BIN names another)\n",
            near, installed);
  else
    fprintf(stderr, "ferry bench: cannot run %s: %s\n", tried,
            err == ELOOP ? "it is the ferry command itself" : strerror(err));
  return err;
}

int cli_bench(int argc, char **argv) {
  char **args = calloc((size_t)argc + 2, sizeof *args);
  if (!args) {
    fprintf(stderr, "ferry bench: out of memory\n");
    return CLI_FAIL;
  }
  args[0] = "ferry"; /* as the benchmarks re-run themselves: "ferry bench MODE ..." */
  memcpy(args + 1, argv, (size_t)argc * sizeof *args);
  fflush(NULL);
  int err = exec_bench(args);
  free(args);
  return err == ENOENT ? CLI_NOTFOUND : CLI_FAIL;
}
