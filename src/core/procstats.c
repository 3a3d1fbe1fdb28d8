/*
 * The process's own series, in the process-wide metrics set (every /metrics of the process shows
 * them): ferry_build_info (1, labelled with the library's version and whether it was built with
 * ucx) and the process_* series that Prometheus client libraries export under the same names
 * (CPU seconds, resident and virtual memory, start time, open and maximum file descriptors),
 * read from /proc/self at each scrape. A series whose source cannot be read is left out. Once the
 * process made a device copy, the CUDA copy counters too (ferry_cuda_copy_*, cuda.c).
 */
#include "core/core.h"
#include "core/cuda.h"
#include "core/stats.h"

#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#ifdef FERRY_HAVE_UCX
#define BUILT_WITH_UCX "yes"
#else
#define BUILT_WITH_UCX "no"
#endif

/* /proc/self/stat's utime, stime (ticks), starttime (ticks since boot), vsize (bytes) and rss
 * (pages); 0 when it cannot be read. The command name (field 2) may hold spaces and ')'. */
static int read_stat(double *cpu_ticks, double *start_ticks, double *vsize, double *rss_pages) {
  char buf[1024];
  FILE *f = fopen("/proc/self/stat", "r");
  if (!f)
    return -1;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  char *p = strrchr(buf, ')');
  unsigned long long ut, st, start, vs;
  long long rss;
  /* after ")": state(3) ... utime(14) stime(15) ... starttime(22) vsize(23) rss(24) */
  if (!p || sscanf(p + 2,
                   "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d %*d "
                   "%*d %llu %llu %lld",
                   &ut, &st, &start, &vs, &rss) != 5)
    return -1;
  *cpu_ticks = (double)(ut + st), *start_ticks = (double)start;
  *vsize = (double)vs, *rss_pages = (double)rss;
  return 0;
}

/* The boot time (seconds since the epoch), /proc/stat's btime; 0 when unknown. */
static double boot_time(void) {
  char line[256];
  double btime = 0;
  FILE *f = fopen("/proc/stat", "r");
  if (!f)
    return 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "btime %lf", &btime) == 1)
      break;
  fclose(f);
  return btime;
}

static double open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (!d)
    return -1;
  double n = 0;
  for (struct dirent *e; (e = readdir(d));)
    n += e->d_name[0] != '.';
  closedir(d);
  return n - 1; /* the descriptor reading the folder */
}

void fr_procstats_collect(void *arg, fr_stats_out *out) {
  (void)arg;
  fr_stat_gauge(out, "ferry_build_info", "The ferry library's build (always 1)", 1.0, "version",
                ferry_version(), "ucx", BUILT_WITH_UCX, NULL);
  double ticks = (double)sysconf(_SC_CLK_TCK), page = (double)sysconf(_SC_PAGESIZE);
  double cpu, start, vsize, rss;
  if (ticks > 0 && read_stat(&cpu, &start, &vsize, &rss) == 0) {
    fr_stat_counter(out, "process_cpu_seconds_total",
                    "Total user and system CPU time spent in seconds", cpu / ticks, NULL);
    fr_stat_gauge(out, "process_resident_memory_bytes", "Resident memory size in bytes", rss * page,
                  NULL);
    fr_stat_gauge(out, "process_virtual_memory_bytes", "Virtual memory size in bytes", vsize, NULL);
    double boot = boot_time();
    if (boot > 0)
      fr_stat_gauge(out, "process_start_time_seconds",
                    "Start time of the process since unix epoch in seconds", boot + start / ticks,
                    NULL);
  }
  double fds = open_fds();
  if (fds >= 0)
    fr_stat_gauge(out, "process_open_fds", "Number of open file descriptors", fds, NULL);
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
    fr_stat_gauge(out, "process_max_fds", "Maximum number of open file descriptors",
                  (double)rl.rlim_cur, NULL);
  fr_cuda_collect(out);
}
