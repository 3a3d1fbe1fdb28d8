/*
 * `ferry bench directory`: the directory at a fleet's scale (issue 36). For N stand-in nodes
 * (100 and 1,000; --full adds 10,000), each holding a lease and K objects (100), against each
 * directory in the same run:
 *   ferry   a `ferry serve` process this bench starts (the embedded directory);
 *   redis   a redis-server it starts on loopback (the store bench's baseline does the same);
 *   etcd    one etcd member it starts, when this ferry has the etcd:// backend (else one line
 *           says why the rows are missing).
 * For each it reports lookup and put latency (p50, p99; back to back and paced) of one more node
 * while the N nodes hold their leases and renew them; the directory process's CPU per second
 * (utime + stime from /proc/PID/stat) over a window in which only renewals happen, beside the
 * same process idle before any node joined; and its resident memory (VmRSS) loaded and idle. The
 * nodes are simulated by a few worker processes (bench_directory_nodes.c says how and what that
 * leaves out). docs/PERFORMANCE.md reads three targets from these rows: ferry:// lookups at least
 * as fast as Redis's at every N; 1,000 nodes renewing at the default lease cost the directory at
 * most 5% of a core; a lookup's p99 at 1,000 nodes at most 2x its p99 at 100.
 */
#include "bench_directory.h"
#include "bench_store.h"
#include "cli/cli.h"
#include "directory/directory.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static const char directory_usage[] =
    "usage: ferry bench directory [--json] [--reps N] [--full] [--pace MS] [--nodes N[,N...]]\n"
    "                             [--keys K] [--workers W] [--lease MS] [--window MS]\n"
    "                             [--impl ferry,redis,etcd]\n\n"
    "The directory at a fleet's scale: N stand-in nodes (default 100 and 1000; --full adds\n"
    "10000), each with its own client and connection, a lease renewed every third of it on its\n"
    "own schedule and K objects (--keys, default 100), against a `ferry serve` (ferry://), a\n"
    "redis-server (redis://) and one etcd member (etcd://, when this ferry has that backend),\n"
    "each started here on loopback. The nodes run in W worker processes (--workers, default 4),\n"
    "over tcp as nodes on other hosts would. Per directory and N:\n"
    "  lookup-N, put-N   one more node's lookups of random keys and puts of new keys of its\n"
    "                    own while the N nodes renew: median, p99 (--reps N lookups, default\n"
    "                    2000, --full 10000; half as many puts), and paced (--pace)\n"
    "  renew-N           the directory process's CPU per second (utime + stime, /proc) over\n"
    "                    --window MS (default two renewal periods) in which only renewals\n"
    "                    happen, beside the same process idle before any node joined, per\n"
    "                    renewal; its resident memory (VmRSS) loaded and idle; the setup time\n"
    "--lease MS is the nodes' lease (default FERRY_LEASE_MS, 15000: a renewal every 5 s).\n"
    "The 'vs base' column is redis's median / this row's. JSON: lookup and put rows as every\n"
    "mode's; renew rows {bench, case, impl, nodes, keys, lease_ms, window_s, renewals_per_s,\n"
    "renew_failures, renew_late_max_s, cpu_per_s, idle_cpu_per_s, renew_cpu_per_s,\n"
    "cpu_per_renewal_s, rss_bytes, idle_rss_bytes, setup_s}; goal rows {bench, goal, impl,\n"
    "value, limit, met}. The `ferry` it starts is FERRY_BIN when set, else the one beside\n"
    "this program (the build tree) or in ../../bin from it (installed).\n";

#define MAX_SIZES 4
#define IDLE_MS 2000   /* the idle window before any node joins (at most --window) */
#define SETTLE_MS 1000 /* after the directory started, before the idle window (same) */
#define READY_MS 30000 /* a directory's start */

enum { IMPL_REDIS, IMPL_FERRY, IMPL_ETCD, NIMPL };
static const char *const impl_names[NIMPL] = {"redis", "ferry", "etcd"};

typedef struct dirproc {
  pid_t pid;
  char url[512];
  char tmp[64]; /* a data dir to remove afterwards ("": none) */
} dirproc;

typedef struct result {
  bool ran;
  bench_samples look, put, plook, pput;
  double setup_s, idle_cpu, cpu, renew_rate, late_s;
  uint64_t failures, misses, rss_idle, rss;
} result;

typedef struct args {
  bench_opts o;
  int sizes[MAX_SIZES], nsizes;
  bool want[NIMPL];
  int keys, workers, lease_ms, window_ms, lookups, puts;
} args;

/* ---- the directory's process ---- */

static char ferry_path[PATH_MAX];

/* The ferry command: FERRY_BIN, beside this program, or the installed one. */
static bool find_ferry(void) {
  const char *set = getenv("FERRY_BIN");
  if (set && *set) {
    fr_str_copy(ferry_path, sizeof ferry_path, set);
    return access(ferry_path, X_OK) == 0;
  }
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0)
    return false;
  self[n] = '\0';
  *strrchr(self, '/') = '\0';
  snprintf(ferry_path, sizeof ferry_path, "%.*s/ferry", PATH_MAX - 8, self);
  if (access(ferry_path, X_OK) == 0)
    return true;
  snprintf(ferry_path, sizeof ferry_path, "%.*s/../../bin/ferry", PATH_MAX - 20, self);
  return access(ferry_path, X_OK) == 0;
}

/* Starts argv (PATH searched) with stdout to out_fd (-1: /dev/null) and stderr to /dev/null,
 * dying with this process. */
static pid_t spawn(char *const argv[], int out_fd) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int null = open("/dev/null", O_WRONLY);
    dup2(out_fd >= 0 ? out_fd : null, 1);
    dup2(null, 2);
    execvp(argv[0], argv);
    _exit(127);
  }
  return pid;
}

/* Whether something accepts on 127.0.0.1:port within ms, and pid still runs. */
static bool accepts(pid_t pid, int port, int ms) {
  for (int waited = 0; waited < ms; waited += 20) {
    if (waitpid(pid, NULL, WNOHANG) != 0)
      return false;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    bool ok = fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    if (fd >= 0)
      close(fd);
    if (ok)
      return true;
    usleep(20000);
  }
  return false;
}

/* `ferry serve` hosting the embedded directory: up once it printed its ready line. */
static int start_ferry(dirproc *d, int nodes, char *why, size_t cap) {
  (void)nodes;
  int port = bs_free_port(), fds[2];
  char listen[32];
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  if (pipe(fds) != 0)
    return snprintf(why, cap, "pipe failed"), -1;
  char *argv[] = {ferry_path, "serve",      "--listen", listen,   "--http",
                  "off",      "--capacity", "1M",       "--json", NULL};
  d->pid = spawn(argv, fds[1]);
  close(fds[1]);
  char line[1024] = "";
  size_t used = 0;
  struct pollfd pf = {fds[0], POLLIN, 0};
  while (used < sizeof line - 1 && !strchr(line, '\n') && poll(&pf, 1, READY_MS) > 0) {
    ssize_t n = read(fds[0], line + used, sizeof line - 1 - used);
    if (n <= 0)
      break;
    line[used += (size_t)n] = '\0';
  }
  close(fds[0]);
  if (!strstr(line, "\"ready\":true"))
    return snprintf(why, cap, "`%s serve` did not start", ferry_path), -1;
  snprintf(d->url, sizeof d->url, "ferry://%s", listen);
  return 0;
}

static int start_redis(dirproc *d, int nodes, char *why, size_t cap) {
  int port = bs_free_port();
  char p[16], maxc[16];
  snprintf(p, sizeof p, "%d", port);
  snprintf(maxc, sizeof maxc, "%d", nodes + 128);
  char *argv[] = {"redis-server", "--port",       p,    "--bind",
                  "127.0.0.1",    "--save",       "",   "--appendonly",
                  "no",           "--maxclients", maxc, NULL};
  d->pid = spawn(argv, -1);
  if (!accepts(d->pid, port, READY_MS))
    return snprintf(why, cap, "redis-server did not start (scripts/deps.sh bench installs it)"), -1;
  snprintf(d->url, sizeof d->url, "redis://127.0.0.1:%d/0", port);
  return 0;
}

/* One etcd member on loopback, its data in a temp dir (as tests/etcd/cluster.sh starts three). */
static int start_etcd(dirproc *d, int nodes, char *why, size_t cap) {
  (void)nodes;
  snprintf(d->tmp, sizeof d->tmp, "/tmp/ferry-bench-etcd-XXXXXX");
  if (!mkdtemp(d->tmp))
    return d->tmp[0] = '\0', snprintf(why, cap, "mkdtemp failed"), -1;
  int port = bs_free_port(), peer = bs_free_port();
  char data[96], client[64], peers[64], cluster[96];
  snprintf(data, sizeof data, "%s/data", d->tmp);
  snprintf(client, sizeof client, "http://127.0.0.1:%d", port);
  snprintf(peers, sizeof peers, "http://127.0.0.1:%d", peer);
  snprintf(cluster, sizeof cluster, "m1=%s", peers);
  char *argv[] = {"etcd",  "--name",
                  "m1",    "--data-dir",
                  data,    "--listen-client-urls",
                  client,  "--advertise-client-urls",
                  client,  "--listen-peer-urls",
                  peers,   "--initial-advertise-peer-urls",
                  peers,   "--initial-cluster",
                  cluster, "--initial-cluster-state",
                  "new",   NULL};
  d->pid = spawn(argv, -1);
  if (!accepts(d->pid, port, READY_MS))
    return snprintf(why, cap, "etcd did not start (scripts/deps.sh bench installs etcd-server)"),
           -1;
  snprintf(d->url, sizeof d->url, "etcd://127.0.0.1:%d", port);
  return 0;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st, (void)flag, (void)ftw;
  remove(path);
  return 0;
}

static void stop_dir(dirproc *d) {
  if (d->pid > 0) {
    kill(d->pid, SIGKILL);
    waitpid(d->pid, NULL, 0);
  }
  if (d->tmp[0])
    nftw(d->tmp, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
  *d = (dirproc){0};
}

/* utime + stime of every thread of pid, in seconds; < 0 when it cannot be read. */
static double cpu_seconds(pid_t pid) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
  if (f)
    fclose(f);
  buf[n] = '\0';
  char *p = strrchr(buf, ')'); /* the command may hold spaces: fields count from its end */
  unsigned long long ut = 0, st = 0;
  if (!p || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
    return -1;
  return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* VmRSS of pid in bytes; 0 when it cannot be read. */
static uint64_t rss_bytes(pid_t pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  unsigned long long kb = 0;
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "VmRSS: %llu kB", &kb) == 1)
      break;
  if (f)
    fclose(f);
  return kb * 1024;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
  while (nanosleep(&ts, &ts) != 0)
    ;
}

/* ---- one directory at one N ---- */

typedef struct fleet {
  pid_t *pid;
  bd_counters *c; /* shared with the workers */
  int n, quit;    /* quit: the pipe's write end; closing it ends them */
} fleet;

static int fleet_start(fleet *f, const bd_plan *p) {
  f->n = p->workers;
  f->pid = calloc((size_t)f->n, sizeof *f->pid);
  f->c = mmap(NULL, (size_t)f->n * sizeof *f->c, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
              -1, 0);
  int q[2];
  if (!f->pid || f->c == MAP_FAILED || pipe(q) != 0)
    return -1;
  memset(f->c, 0, (size_t)f->n * sizeof *f->c);
  f->quit = q[1];
  fflush(NULL);
  for (int w = 0; w < f->n; w++)
    if ((f->pid[w] = fork()) == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      close(q[1]);
      _exit(bd_worker_main(p, w, &f->c[w], q[0]));
    }
  close(q[0]);
  return 0;
}

/* Waits until every worker is set up; false (why says which failed) when one failed. */
static bool fleet_ready(fleet *f, char *why, size_t cap) {
  for (;;) {
    int ready = 0;
    for (int w = 0; w < f->n; w++) {
      int s = __atomic_load_n(&f->c[w].state, __ATOMIC_ACQUIRE);
      if (s < 0 || (s == 0 && waitpid(f->pid[w], NULL, WNOHANG) != 0)) {
        snprintf(why, cap, "worker %d: %s", w, s < 0 ? f->c[w].error : "died");
        return false;
      }
      ready += s == 1;
    }
    if (ready == f->n)
      return true;
    sleep_ms(20);
  }
}

static void fleet_count(const fleet *f, uint64_t *renewals, uint64_t *failures, uint64_t *late) {
  *renewals = *failures = *late = 0;
  for (int w = 0; w < f->n; w++) {
    *renewals += __atomic_load_n(&f->c[w].renewals, __ATOMIC_RELAXED);
    *failures += __atomic_load_n(&f->c[w].failures, __ATOMIC_RELAXED);
    uint64_t l = __atomic_load_n(&f->c[w].late_ns, __ATOMIC_RELAXED);
    *late = l > *late ? l : *late;
  }
}

static void fleet_stop(fleet *f) {
  if (f->quit > 0)
    close(f->quit);
  for (int w = 0; f->pid && w < f->n; w++)
    if (f->pid[w] > 0)
      waitpid(f->pid[w], NULL, 0);
  free(f->pid);
  if (f->c && f->c != MAP_FAILED)
    munmap(f->c, (size_t)f->n * sizeof *f->c);
  *f = (fleet){0};
}

static bool read_samples(int fd, uint32_t n, bench_samples *b) {
  for (uint32_t i = 0; i < n; i++) {
    double s;
    if (bench_read_all(fd, &s, sizeof s) != 0)
      return false;
    bench_add(b, s);
  }
  return true;
}

/* The probe, forked: its samples into r. */
static bool probe_run(const bd_plan *p, const args *a, int quit, result *r, char *why, size_t cap) {
  int fds[2];
  if (pipe(fds) != 0)
    return snprintf(why, cap, "pipe failed"), false;
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(fds[0]);
    close(quit); /* the workers' pipe: only the parent may end them */
    _exit(bd_probe_main(p, &a->o, a->lookups, a->puts, fds[1]));
  }
  close(fds[1]);
  bd_probe_head h;
  bool ok = bench_read_all(fds[0], &h, sizeof h) == 0;
  if (ok && h.ok != 0)
    snprintf(why, cap, "probe: %s", h.error);
  ok = ok && h.ok == 0 && read_samples(fds[0], h.lookups, &r->look) &&
       read_samples(fds[0], h.puts, &r->put) && read_samples(fds[0], h.paced_lookups, &r->plook) &&
       read_samples(fds[0], h.paced_puts, &r->pput);
  if (!ok && !*why)
    snprintf(why, cap, "probe died");
  r->misses = ok ? h.misses : 0;
  close(fds[0]);
  waitpid(pid, NULL, 0);
  return ok;
}

/* Idle window, nodes up, renewal window, probe; the directory process is d. */
static bool measure(const args *a, const bd_plan *p, const dirproc *d, result *r, char *why,
                    size_t cap) {
  int idle_ms = a->window_ms < IDLE_MS ? a->window_ms : IDLE_MS; /* a short run: short waits */
  sleep_ms(a->window_ms < SETTLE_MS ? a->window_ms : SETTLE_MS);
  double c0 = cpu_seconds(d->pid), t0 = bench_now();
  sleep_ms(idle_ms);
  r->idle_cpu = (cpu_seconds(d->pid) - c0) / (bench_now() - t0);
  r->rss_idle = rss_bytes(d->pid);
  fleet f = {0};
  double s0 = bench_now();
  bool ok = fleet_start(&f, p) == 0 && fleet_ready(&f, why, cap);
  r->setup_s = bench_now() - s0;
  if (ok) {
    uint64_t n0, n1, fail0, fail1, late;
    fleet_count(&f, &n0, &fail0, &late);
    c0 = cpu_seconds(d->pid), t0 = bench_now();
    sleep_ms(a->window_ms);
    double c1 = cpu_seconds(d->pid), t1 = bench_now();
    fleet_count(&f, &n1, &fail1, &late);
    r->cpu = (c1 - c0) / (t1 - t0);
    r->renew_rate = (double)(n1 - n0) / (t1 - t0);
    ok = probe_run(p, a, f.quit, r, why, cap);
    r->rss = rss_bytes(d->pid);
    fleet_count(&f, &n1, &r->failures, &late);
    r->late_s = (double)late * 1e-9;
  }
  fleet_stop(&f);
  return ok;
}

/* false when the measurement failed; a baseline that cannot start (redis-server or etcd not
 * installed) is skipped, saying why, as the other modes' baselines are. */
static bool run_one(const args *a, int impl, int nodes, result *r) {
  static int (*const start[NIMPL])(dirproc *, int, char *, size_t) = {start_redis, start_ferry,
                                                                      start_etcd};
  dirproc d = {0};
  char why[512] = "";
  bd_plan p = {.nodes = nodes, .keys = a->keys, .lease_ms = a->lease_ms};
  p.workers = a->workers < nodes ? a->workers : nodes;
  bool started = start[impl](&d, nodes, why, sizeof why) == 0, ok = started;
  if (ok) {
    fr_str_copy(p.url, sizeof p.url, d.url);
    ok = measure(a, &p, &d, r, why, sizeof why);
  }
  stop_dir(&d);
  if (!ok)
    fprintf(stderr, "ferry bench directory: %s rows at %d nodes %s: %s\n", impl_names[impl], nodes,
            started ? "failed" : "skipped", why);
  r->ran = ok;
  return ok || (!started && impl != IMPL_FERRY);
}

/* ---- reporting ---- */

static void report_latency(const args *a, int nodes, result *res) {
  const char *what[2] = {"lookup", "put"};
  for (int k = 0; k < 2; k++) {
    char c[32];
    snprintf(c, sizeof c, "%s-N%d", what[k], nodes);
    bool base = true;
    for (int i = 0; i < NIMPL; i++)
      if (res[i].ran) {
        bench_row(&a->o, "directory", c, impl_names[i], 0, k ? &res[i].put : &res[i].look, base);
        base = false;
      }
    if (!a->o.json) { /* the table has no p99 column (JSON has p99_s): the targets read it */
      printf("%-16s p99:", c);
      for (int i = 0; i < NIMPL; i++)
        if (res[i].ran)
          printf("  %s %.2f us", impl_names[i], 1e6 * bench_p99(k ? &res[i].put : &res[i].look));
      printf("\n");
    }
    for (int i = 0; i < NIMPL; i++)
      if (res[i].ran)
        bench_paced_row(&a->o, "directory", c, impl_names[i], 0, k ? &res[i].pput : &res[i].plook,
                        bench_median(k ? &res[i].put : &res[i].look), NULL);
  }
}

static void report_load(const args *a, int nodes, const result *res) {
  double window = a->window_ms / 1000.0;
  if (!a->o.json)
    printf("renew-N%-9d %-6s %10s %11s %15s %13s %12s %16s %9s\n", nodes, "impl", "setup",
           "renewals/s", "dir CPU (idle)", "renewals' CPU", "per renewal", "RSS (idle)",
           "failures");
  for (int i = 0; i < NIMPL; i++) {
    const result *r = &res[i];
    if (!r->ran)
      continue;
    double renew = r->cpu - r->idle_cpu;
    double per = r->renew_rate > 0 ? renew / r->renew_rate : 0;
    if (a->o.json) {
      printf("{\"bench\":\"directory\",\"case\":\"renew-N%d\",\"impl\":\"%s\",\"nodes\":%d,"
             "\"keys\":%d,\"lease_ms\":%d,\"window_s\":%.3f,\"renewals_per_s\":%.6g,"
             "\"renew_failures\":%llu,\"renew_late_max_s\":%.6g,\"lookup_misses\":%llu,"
             "\"cpu_per_s\":%.6g,\"idle_cpu_per_s\":%.6g,\"renew_cpu_per_s\":%.6g,"
             "\"cpu_per_renewal_s\":%.6g,\"rss_bytes\":%llu,\"idle_rss_bytes\":%llu,"
             "\"setup_s\":%.6g}\n",
             nodes, impl_names[i], nodes, a->keys, a->lease_ms, window, r->renew_rate,
             (unsigned long long)r->failures, r->late_s, (unsigned long long)r->misses, r->cpu,
             r->idle_cpu, renew, per, (unsigned long long)r->rss, (unsigned long long)r->rss_idle,
             r->setup_s);
      continue;
    }
    char cpu[32], rss[32];
    snprintf(cpu, sizeof cpu, "%.2f%% (%.2f%%)", 100 * r->cpu, 100 * r->idle_cpu);
    snprintf(rss, sizeof rss, "%.1f (%.1f) MiB", (double)r->rss / (1 << 20),
             (double)r->rss_idle / (1 << 20));
    printf("%-16s %-6s %8.2f s %11.1f %15s %12.2f%% %9.1f us %16s %9llu%s\n", "", impl_names[i],
           r->setup_s, r->renew_rate, cpu, 100 * renew, per * 1e6, rss,
           (unsigned long long)r->failures, r->misses ? "  (lookups missed keys!)" : "");
  }
  fflush(stdout);
}

static void goal(const args *a, const char *what, const char *impl, double value, double limit,
                 bool met, const char *unit) {
  if (a->o.json)
    printf("{\"bench\":\"directory\",\"goal\":\"%s\",\"impl\":\"%s\",\"value\":%.6g,"
           "\"limit\":%.6g,\"met\":%s}\n",
           what, impl, value, limit, met ? "true" : "false");
  else
    printf("goal %-44s %-6s %8.3f%s (limit %.3f%s): %s\n", what, impl, value, unit, limit, unit,
           met ? "met" : "NOT met");
}

/* The three targets, from the rows at N = 100 and 1,000 when both ran. */
static void report_goals(const args *a, result res[][NIMPL]) {
  int i100 = -1, i1000 = -1;
  for (int s = 0; s < a->nsizes; s++) {
    i100 = a->sizes[s] == 100 ? s : i100;
    i1000 = a->sizes[s] == 1000 ? s : i1000;
  }
  if (!a->o.json)
    printf("\n");
  for (int s = 0; s < a->nsizes; s++) {
    result *f = &res[s][IMPL_FERRY], *r = &res[s][IMPL_REDIS];
    if (f->ran && r->ran) {
      char what[64];
      snprintf(what, sizeof what, "lookup p50 redis/ferry >= 1 at N=%d", a->sizes[s]);
      double ratio = bench_median(&r->look) / bench_median(&f->look);
      goal(a, what, "ferry", ratio, 1, ratio >= 1, "x");
    }
  }
  for (int i = 0; i < NIMPL && i1000 >= 0; i++) {
    result *r = &res[i1000][i];
    if (r->ran)
      goal(a, "renewals' CPU at N=1000 <= 5% of a core", impl_names[i],
           100 * (r->cpu - r->idle_cpu), 5, r->cpu - r->idle_cpu <= 0.05, "%");
  }
  for (int i = 0; i < NIMPL && i100 >= 0 && i1000 >= 0; i++) {
    result *lo = &res[i100][i], *hi = &res[i1000][i];
    if (lo->ran && hi->ran) {
      double ratio = bench_p99(&hi->look) / bench_p99(&lo->look);
      goal(a, "lookup p99 N=1000 / N=100 <= 2", impl_names[i], ratio, 2, ratio <= 2, "x");
    }
  }
  fflush(stdout);
}

/* ---- options ---- */

static bool parse_sizes(const char *s, args *a) {
  a->nsizes = 0;
  while (s && *s && a->nsizes < MAX_SIZES) {
    char *end = NULL;
    long v = strtol(s, &end, 10);
    if (end == s || v < 1 || v > 60000 || (*end && (*end != ',' || !end[1])))
      return false;
    a->sizes[a->nsizes++] = (int)v;
    s = *end ? end + 1 : end;
  }
  return a->nsizes > 0 && !*s;
}

static bool parse_impls(const char *s, args *a) {
  memset(a->want, 0, sizeof a->want);
  if (!*s)
    return false;
  for (const char *p = s; *p;) {
    size_t n = strcspn(p, ",");
    if (p[n] == ',' && !p[n + 1])
      return false; /* a trailing comma names nothing */
    bool known = false;
    for (int i = 0; i < NIMPL; i++)
      if (strlen(impl_names[i]) == n && strncmp(p, impl_names[i], n) == 0)
        a->want[i] = known = true;
    if (!known)
      return false;
    p += n + (p[n] == ',');
  }
  return true;
}

static int parse(int argc, char **argv, args *a) {
  const char *nodes = NULL, *impls = NULL;
  int lease = 0;
  a->keys = 100, a->workers = 4;
  const cli_opt extra[] = {{"nodes", CLI_ARG_STR, &nodes, 0, 0},
                           {"keys", CLI_ARG_INT, &a->keys, 1, 10000},
                           {"workers", CLI_ARG_INT, &a->workers, 1, 64},
                           {"lease", CLI_ARG_INT, &lease, 300, 3600000},
                           {"window", CLI_ARG_INT, &a->window_ms, 100, 3600000},
                           {"impl", CLI_ARG_STR, &impls, 0, 0},
                           {0}};
  if (bench_parse_with(argc, argv, &a->o, directory_usage, extra) < 0)
    return -1;
  const cli_cmd cmd = {"bench directory", directory_usage, NULL, 0, 0, NULL};
  static const int dflt[] = {100, 1000, 10000};
  a->nsizes = a->o.full ? 3 : 2;
  memcpy(a->sizes, dflt, sizeof dflt);
  if (nodes && !parse_sizes(nodes, a))
    return cli_usage_error(&cmd, "--nodes '%s': expected counts 1..60000, comma-separated", nodes),
           -1;
  for (int i = 0; i < NIMPL; i++)
    a->want[i] = true;
  if (impls && !parse_impls(impls, a))
    return cli_usage_error(&cmd, "--impl '%s': expected ferry, redis or etcd, comma-separated",
                           impls),
           -1;
  a->lease_ms = lease ? lease : (int)strtol(ferry_config_get("FERRY_LEASE_MS"), NULL, 10);
  if (a->lease_ms < 300)
    a->lease_ms = 15000;
  if (!a->window_ms)
    a->window_ms = 2 * a->lease_ms / 3;
  a->lookups = a->o.reps > 0 ? a->o.reps : a->o.full ? 10000 : 2000;
  a->puts = a->lookups / 2 > 0 ? a->lookups / 2 : 1;
  return 0;
}

/* Room for a descriptor per node in the directory and the workers (each end of a connection). */
static void raise_fd_limit(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
}

int bench_directory(int argc, char **argv) {
  args a = {0};
  if (parse(argc, argv, &a) < 0)
    return CLI_USAGE;
  signal(SIGPIPE, SIG_IGN);
  raise_fd_limit();
  if (a.want[IMPL_FERRY] && !find_ferry()) {
    fprintf(stderr, "ferry bench directory: ferry rows skipped: no ferry command beside this "
                    "program nor in ../../bin (set FERRY_BIN)\n");
    a.want[IMPL_FERRY] = false;
  }
  if (a.want[IMPL_ETCD] && !fr_dir_backend("etcd://127.0.0.1:2379")) {
    fprintf(stderr, "ferry bench directory: etcd rows skipped: this ferry has no etcd:// "
                    "directory backend yet (issue 36 deliverable 1)\n");
    a.want[IMPL_ETCD] = false;
  }
  char title[160];
  snprintf(title, sizeof title,
           "directory: N nodes x %d keys, lease %d ms (a renewal every %d ms per node), "
           "renewal window %d ms; vs base = redis",
           a.keys, a.lease_ms, a.lease_ms / 3, a.window_ms);
  bench_header(&a.o, title);
  result(*res)[NIMPL] = calloc((size_t)a.nsizes, sizeof *res);
  int rc = CLI_OK;
  for (int s = 0; res && s < a.nsizes; s++) {
    for (int i = 0; i < NIMPL; i++)
      if (a.want[i] && !run_one(&a, i, a.sizes[s], &res[s][i]))
        rc = CLI_FAIL;
    report_latency(&a, a.sizes[s], res[s]);
    report_load(&a, a.sizes[s], res[s]);
  }
  if (res)
    report_goals(&a, res);
  for (int s = 0; res && s < a.nsizes; s++)
    for (int i = 0; i < NIMPL; i++) {
      bench_free(&res[s][i].look), bench_free(&res[s][i].put);
      bench_free(&res[s][i].plook), bench_free(&res[s][i].pput);
    }
  int status = res ? rc : CLI_FAIL;
  free(res);
  return status;
}
