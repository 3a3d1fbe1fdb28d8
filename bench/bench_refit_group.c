/*
 * `ferry bench refit`'s M×N rows (issue 34): a model held by M trainer ranks, each a process on a
 * "host" of its own, pushed to N engine hosts: network namespaces on one bridge (netns.h), each
 * host's link rate-limited in both directions by tc tbf. The run itself hosts the directory the
 * ranks publish in (a namespace of its own) and drives its helper processes (bench_refit_peers.c)
 * over pipes. Each row times, in the same run:
 *   - ferry/group: the sharded sender, every rank pushing its own pieces at once;
 *   - funnel: today's path, the shards gathered to rank 0 over the same links (plain tcp), then
 *     one single sender pushes the whole model;
 *   - gloo: torch.distributed (Debian's python3-torch) gathering to rank 0, then broadcasting
 *     to the engines, in 16 MiB buckets;
 * against the row's floor: the most bytes any one host must send or receive, over the link rate.
 * The CPU the processes used per second of the timed pushes, and how busy the host's cores
 * were, show that the two cores are not what bounds the row. And on this host, without
 * namespaces: a group of 4 ranks holding 5,000 small tensors, for a group push's cost beyond
 * moving bytes.
 */
#include "bench_refit_group.h"
#include "cli/cli.h"
#include "netns.h"

#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MN_TAG "mn"
#define MN_NET "10.79.0"
#define MN_DIR_PORT "7796"
#define MN_GATHER_PORT "7797"
#define MN_GLOO_PORT "7798"
#define MN_BUCKET (2u << 20)
#define MN_MODEL (128ull << 20)
#define PEER_TIMEOUT_MS 300000

static char self_path[PATH_MAX];

/* ---- helper processes ---- */

typedef struct peer {
  pid_t pid;
  int to, from;
} peer;

/* Runs `ferry bench refit KIND UP DOWN args...` on host `host` (0: this host, not a namespace)
 * with the fleet's directory at dir_url. */
static int peer_spawn(peer *p, int host, const char *dir_url, const char *kind,
                      const char *const *args, int nargs) {
  int up[2], down[2];
  p->pid = -1, p->to = p->from = -1;
  if (pipe2(up, O_CLOEXEC) != 0)
    return -1;
  if (pipe2(down, O_CLOEXEC) != 0) {
    close(up[0]), close(up[1]);
    return -1;
  }
  char fu[16], fd[16], ns[32], listen[32];
  snprintf(fu, sizeof fu, "%d", up[1]);
  snprintf(fd, sizeof fd, "%d", down[0]);
  netns_host(MN_TAG, host, ns, sizeof ns);
  snprintf(listen, sizeof listen, MN_NET ".%d:0", host);
  const char *argv[24] = {"ip", "netns", "exec", ns, self_path, "bench", "refit", kind, fu, fd};
  int at = 10;
  for (int i = 0; i < nargs && at < 23; i++)
    argv[at++] = args[i];
  fflush(NULL);
  p->pid = fork();
  if (p->pid == 0) {
    fcntl(up[1], F_SETFD, 0);
    fcntl(down[0], F_SETFD, 0);
    setenv("FERRY_DIRECTORY", dir_url, 1);
    if (host > 0) {
      setenv("FERRY_TCP_LISTEN", listen, 1);
      setenv("FERRY_TRANSPORTS", "tcp", 1);
    }
    execvp(host > 0 ? "ip" : self_path, (char *const *)(host > 0 ? argv : argv + 4));
    _exit(127);
  }
  close(up[1]), close(down[0]);
  p->from = up[0], p->to = down[1];
  return p->pid > 0 ? 0 : -1;
}

static int peer_send(const peer *p, char op, uint64_t v) {
  gpeer_cmd c = {op, v};
  return bench_write_all(p->to, &c, sizeof c);
}

/* The next report, within PEER_TIMEOUT_MS; a helper that died or said nothing: rc != 0. */
static gpeer_report peer_read(const peer *p) {
  gpeer_report r = {.rc = FERRY_EPEER};
  struct pollfd pf = {p->from, POLLIN, 0};
  if (poll(&pf, 1, PEER_TIMEOUT_MS) == 1 && bench_read_all(p->from, &r, sizeof r) != 0)
    r.rc = FERRY_EPEER;
  return r;
}

static void peers_stop(peer *ps, int n) {
  for (int i = 0; i < n; i++) {
    if (ps[i].pid <= 0)
      continue;
    peer_send(&ps[i], 'q', 0);
    close(ps[i].to), close(ps[i].from);
    struct timespec ts = {0, 10000000};
    int status;
    for (int t = 0; t < 500 && waitpid(ps[i].pid, &status, WNOHANG) == 0; t++)
      nanosleep(&ts, NULL);
    if (kill(ps[i].pid, 0) == 0) {
      kill(ps[i].pid, SIGKILL);
      waitpid(ps[i].pid, &status, 0);
    }
    ps[i].pid = -1;
  }
}

/* Every peer's 'r'eady; rc of the first that failed. */
static int peers_ready(peer *ps, int n) {
  int rc = 0;
  for (int i = 0; i < n; i++) {
    gpeer_report r = peer_read(&ps[i]);
    rc = rc ? rc : r.rc;
  }
  return rc;
}

/* ---- CPU ---- */

/* The host's busy, network-stack (irq + softirq) and total jiffies over every core (/proc/stat's
 * first line). */
static void host_jiffies(double *busy, double *net, double *total) {
  unsigned long long v[10] = {0};
  FILE *f = fopen("/proc/stat", "r");
  *busy = *net = *total = 0;
  if (!f)
    return;
  if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4],
             &v[5], &v[6], &v[7]) == 8)
    for (int i = 0; i < 8; i++) {
      *total += (double)v[i];
      *busy += i == 3 || i == 4 ? 0 : (double)v[i];
      *net += i == 5 || i == 6 ? (double)v[i] : 0;
    }
  fclose(f);
}

/* What one timed series used: the processes' CPU seconds and the host's busy cores over it. */
typedef struct cpu_meter {
  double procs0, procs1, wall0, wall1, busy0, net0, total0, busy1, net1, total1;
} cpu_meter;

static double meter_procs(const cpu_meter *c) {
  double wall = c->wall1 - c->wall0;
  return wall > 0 ? (c->procs1 - c->procs0) / wall : 0;
}

/* Cores busy over the series: every kind of work (`net`: irq and softirq only, the network
 * stack's packets, tc's shaping among them), the host's other work included. */
static double meter_host(const cpu_meter *c, bool net) {
  double total = c->total1 - c->total0;
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  double busy = net ? c->net1 - c->net0 : c->busy1 - c->busy0;
  return total > 0 ? busy / total * (double)cores : 0;
}

/* ---- one series of pushes ---- */

/* A row's shape: M trainer ranks to N engines, TP (each engine a TP rank) or whole. */
typedef struct mn_row {
  int m, n;
  bool tp;
  const gmodel *model;
  uint64_t bytes, small;
  int base_host; /* trainer r on host base + r, engine e on base + m + e; 0: this host */
  const char *dir_url;
  int mbit; /* every host's link, each way, in Mbit/s */
} mn_row;

static int host_of(const mn_row *r, int i) { return r->base_host ? r->base_host + i : 0; }

/* Trainers (kind --group-rank or --group-funnel) and engines up, the engines attached. */
static int row_up(const mn_row *r, const char *kind, const char *name, peer *tr, peer *en) {
  char rank[16], world[16], bytes[32], small[32], bucket[32], ew[16];
  snprintf(world, sizeof world, "%d", r->m);
  snprintf(ew, sizeof ew, "%d", r->tp ? r->n : 1);
  snprintf(bytes, sizeof bytes, "%llu", (unsigned long long)r->bytes);
  snprintf(small, sizeof small, "%llu", (unsigned long long)r->small);
  snprintf(bucket, sizeof bucket, "%u", r->small ? 0u : MN_BUCKET);
  const char *gather = NETNS_IP(MN_NET, 1) ":" MN_GATHER_PORT;
  int rc = 0;
  for (int i = 0; i < r->m && rc == 0; i++) {
    snprintf(rank, sizeof rank, "%d", i);
    const char *args[] = {name, rank, world, bytes, small, bucket, gather};
    bool funnel = strcmp(kind, "--group-funnel") == 0; /* its ranks also take rank 0's address */
    rc = peer_spawn(&tr[i], host_of(r, i), r->dir_url, kind, args, funnel ? 7 : 6);
  }
  if (rc == 0)
    rc = peers_ready(tr, r->m);
  for (int i = 0; i < r->n && rc == 0; i++) {
    snprintf(rank, sizeof rank, "%d", i);
    const char *args[] = {name, rank, ew, bytes, small};
    rc = peer_spawn(&en[i], host_of(r, r->m + i), r->dir_url, "--group-engine", args, 5);
  }
  if (rc == 0)
    rc = peers_ready(en, r->n);
  /* every trainer (the funnel: rank 0) sees every engine attached */
  for (int i = 0; i < r->m && rc == 0; i++)
    rc = peer_send(&tr[i], 'n', (uint64_t)r->n) == 0 ? peer_read(&tr[i]).rc : FERRY_EPEER;
  return rc;
}

/* One version: every trainer told to push at once; the time from the first push's start to
 * the last one's end; then every engine must hold it. */
static int row_push(const mn_row *r, peer *tr, peer *en, uint64_t v, double *took, double *cpu) {
  int rc = 0;
  double t0 = 0, t1 = 0;
  *cpu = 0;
  for (int i = 0; i < r->m && rc == 0; i++)
    rc = peer_send(&tr[i], 'p', v);
  for (int i = 0; i < r->m && rc == 0; i++) {
    gpeer_report p = peer_read(&tr[i]);
    rc = p.rc;
    t0 = i == 0 || p.t0 < t0 ? p.t0 : t0;
    t1 = p.t1 > t1 ? p.t1 : t1;
    *cpu += p.cpu;
  }
  for (int i = 0; i < r->n && rc == 0; i++) {
    gpeer_report e =
        rc == 0 && peer_send(&en[i], 'w', v) == 0 ? peer_read(&en[i]) : (gpeer_report){.rc = -1};
    rc = e.rc ? e.rc : e.committed == v ? 0 : FERRY_ESTATE;
    *cpu += e.cpu;
  }
  *took = t1 - t0;
  return rc;
}

/* reps + 1 pushes (the first faults the pages in); *m: the CPU over the timed ones. */
static int row_series(const mn_row *r, const char *kind, const char *name, int reps,
                      bench_samples *b, cpu_meter *m) {
  peer tr[16] = {0}, en[16] = {0};
  int rc = row_up(r, kind, name, tr, en);
  for (int v = 1; rc == 0 && v <= reps + 1; v++) {
    double took, cpu;
    rc = row_push(r, tr, en, (uint64_t)v, &took, &cpu);
    double now = bench_now(), busy, net, total;
    host_jiffies(&busy, &net, &total);
    if (v == 1)
      *m = (cpu_meter){cpu, cpu, now, now, busy, net, total, busy, net, total};
    else
      bench_add(b, took), m->procs1 = cpu, m->wall1 = now, m->busy1 = busy, m->net1 = net,
                          m->total1 = total;
  }
  if (rc != 0)
    fprintf(stderr, "bench refit: %s %dx%d: failed (%d): see the helpers' lines above\n", name,
            r->m, r->n, rc);
  peers_stop(en, r->n); /* the engines first: a trainer gone before them is a warning */
  peers_stop(tr, r->m);
  return rc;
}

/* ---- gloo: gather to rank 0, then broadcast ---- */

static const char gloo_script[] =
    "import datetime,json,sys,time,torch,torch.distributed as dist\n"
    "a=sys.argv\n"
    "rank,world,M,addr,port,local,bucket,reps=int(a[1]),int(a[2]),int(a[3]),a[4],a[5],"
    "int(a[6]),int(a[7]),int(a[8])\n"
    "dist.init_process_group('gloo',init_method='tcp://%s:%s'%(addr,port),rank=rank,"
    "world_size=world,timeout=datetime.timedelta(seconds=600))\n"
    "tr=dist.new_group(list(range(M)))\n"
    "bc=dist.new_group([0]+list(range(M,world)))\n"
    "full=torch.empty(local*M) if rank==0 or rank>=M else None\n"
    "mine=torch.full((local,),float(rank)) if rank<M else None\n"
    "step=max(1,bucket//4//M)\n"
    "def funnel():\n"
    "  if rank<M:\n"
    "    for s in range(0,local,step):\n"
    "      e=min(s+step,local)\n"
    "      if rank==0: dist.gather(mine[s:e],[full[r*local+s:r*local+e] for r in range(M)],"
    "dst=0,group=tr)\n"
    "      else: dist.gather(mine[s:e],dst=0,group=tr)\n"
    "  if rank==0 or rank>=M:\n"
    "    n=bucket//4\n"
    "    for s in range(0,local*M,n): dist.broadcast(full[s:s+n],0,group=bc)\n"
    "times=[]\n"
    "for r in range(reps+1):\n"
    "  dist.barrier(); t=time.perf_counter(); funnel(); dist.barrier()\n"
    "  if r: times.append(time.perf_counter()-t)\n"
    "if rank==0: print(json.dumps({'gloo':times}))\n";

static bool gloo_available(void) {
  return system("/usr/bin/python3 -c 'import torch.distributed' >/dev/null 2>&1") == 0;
}

static void parse_list(const char *at, bench_samples *b) {
  const char *p = at ? strchr(at, '[') : NULL;
  while (p && *p && *p != ']') {
    char *end;
    double v = strtod(p + 1, &end);
    if (end == p + 1)
      break;
    bench_add(b, v);
    p = end;
    while (*p == ' ')
      p++;
  }
}

/* M + N python processes, rank i on the row's host i + 1 (trainers, then engines). */
static int gloo_series(const mn_row *r, int reps, bench_samples *b) {
  char dir[] = "/tmp/ferry-bench-mn-XXXXXX";
  if (!mkdtemp(dir))
    return -1;
  char script[64], out[64], cmd[768];
  snprintf(script, sizeof script, "%s/gloo.py", dir);
  snprintf(out, sizeof out, "%s/out.json", dir);
  FILE *f = fopen(script, "w");
  if (!f)
    return -1;
  fputs(gloo_script, f);
  fclose(f);
  unsigned long long local = r->model->bytes / 4 / (uint64_t)r->m;
  int world = r->m + r->n, rc = 0;
  for (int i = world - 1; i >= 0; i--) {
    int host = host_of(r, i);
    snprintf(cmd, sizeof cmd,
             "timeout 900 ip netns exec " NETNS_HOST(
                 MN_TAG, ) "%d env GLOO_SOCKET_IFNAME=f" MN_TAG
                           "%d OMP_NUM_THREADS=1 /usr/bin/python3 %s %d %d %d " NETNS_IP(
                               MN_NET, ) "%d " MN_GLOO_PORT " %llu %d %d %s%s",
             host, host, script, i, world, r->m, host_of(r, 0), local, 16 << 20, reps,
             i ? ">/dev/null 2>&1 &" : "> ", i ? "" : out);
    if (system(cmd) != 0 && i == 0)
      rc = -1;
  }
  f = fopen(out, "r");
  char buf[4096];
  size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
  if (f)
    fclose(f);
  buf[n] = 0;
  parse_list(strstr(buf, "\"gloo\": ["), b);
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  if (system(cmd) != 0)
    rc = -1;
  return rc == 0 && b->n ? 0 : -1;
}

/* ---- the rows ---- */

/* The floor: the most bytes any one host must move per push, and its seconds at the rate. */
static uint64_t row_host_bytes(const mn_row *r) {
  uint64_t most = 0;
  for (int e = 0; e < r->n; e++) {
    uint64_t b = gmodel_engine_bytes(r->model, e, r->tp ? r->n : 1);
    most = b > most ? b : most;
  }
  for (int t = 0; t < r->m; t++) {
    uint64_t b = gmodel_trainer_bytes(r->model, t, r->m, r->tp ? r->n : 1);
    /* whole-model engines: each reads every byte, so a trainer's part goes out n times */
    b = r->tp ? b : b * (uint64_t)r->n;
    most = b > most ? b : most;
  }
  return most;
}

static double ratio(double a, double b) { return b > 0 ? a / b : 0; }

/* The note under a row: every ratio its targets read, and the CPU. */
static void row_note(const bench_opts *o, const char *name, const mn_row *r, double floor_s,
                     uint64_t host_bytes, bench_samples *fe, bench_samples *fu, bench_samples *gl,
                     const cpu_meter *cpu) {
  double f = bench_median(fe), over = ratio(f, floor_s), fun = ratio(bench_median(fu), f);
  double glo = ratio(bench_median(gl), f);
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  bool tp4 = r->tp && r->n == 4 && r->m == 4;
  if (o->json) {
    printf("{\"bench\":\"refit\",\"case\":\"%s\",\"impl\":\"ratios\",\"trainers\":%d,"
           "\"engines\":%d,\"tp\":%s,\"host_bytes\":%llu,\"rate_bytes_per_s\":%.0f,"
           "\"floor_s\":%.6g,\"over_floor\":%.6g,\"target_over_floor_max\":1.25,"
           "\"funnel_over_ferry\":%.6g,\"target_funnel_over_ferry_min\":%s,"
           "\"gloo_over_ferry\":%.6g,\"procs_cores\":%.4g,\"net_cores\":%.4g,"
           "\"host_busy_cores\":%.4g,\"cores\":%ld}\n",
           name, r->m, r->n, r->tp ? "true" : "false", (unsigned long long)host_bytes,
           r->mbit * 125e3, floor_s, over, fun, tp4 ? "3" : "null", glo, meter_procs(cpu),
           meter_host(cpu, true), meter_host(cpu, false), cores);
    return;
  }
  printf("%-16s ferry/group %.2fx the floor (target <= 1.25), funnel %.2fx ferry%s, gloo "
         "%.2fx ferry; floor %.1f MiB on the busiest host at %d Mbit/s; CPU during the "
         "pushes: the processes %.2f cores, irq+softirq %.2f, the host (other work too) %.2f "
         "of %ld\n",
         name, over, fun, tp4 ? " (target >= 3)" : "", glo, (double)host_bytes / 1048576.0, r->mbit,
         meter_procs(cpu), meter_host(cpu, true), meter_host(cpu, false), cores);
}

static int run_row(const bench_opts *o, const mn_row *r, int reps, bool gloo) {
  char name[32], gname[32], fname[32];
  if (r->tp)
    snprintf(name, sizeof name, "MxN-M%d-TP%d", r->m, r->n);
  else
    snprintf(name, sizeof name, "MxN-M%d-N%d", r->m, r->n);
  snprintf(gname, sizeof gname, "mn-g%d%c%d", r->m, r->tp ? 't' : 'x', r->n);
  snprintf(fname, sizeof fname, "mn-f%d%c%d", r->m, r->tp ? 't' : 'x', r->n);
  uint64_t host_bytes = row_host_bytes(r);
  double floor_s = (double)host_bytes / (r->mbit * 125e3);
  bench_samples fl = {0}, fe = {0}, fu = {0}, gl = {0};
  bench_add(&fl, floor_s);
  cpu_meter cpu = {0}, fcpu = {0};
  int rc = row_series(r, "--group-rank", gname, reps, &fe, &cpu);
  int frc = row_series(r, "--group-funnel", fname, reps, &fu, &fcpu);
  if (gloo && gloo_series(r, reps, &gl) != 0 && !o->json)
    printf("(%s: gloo failed)\n", name);
  bench_row(o, "refit", name, "floor", r->model->bytes, &fl, true);
  if (rc == 0)
    bench_row(o, "refit", name, "ferry/group", r->model->bytes, &fe, false);
  if (frc == 0)
    bench_row(o, "refit", name, "funnel", r->model->bytes, &fu, false);
  if (gl.n)
    bench_row(o, "refit", name, "gloo", r->model->bytes, &gl, false);
  if (rc == 0)
    row_note(o, name, r, floor_s, host_bytes, &fe, &fu, &gl, &cpu);
  bench_free(&fl), bench_free(&fe), bench_free(&fu), bench_free(&gl);
  return rc ? rc : frc;
}

/* The directory the ranks publish in, hosted by this process on `listen` (its ctx listens
 * there); *url names it. */
static int dir_open(const char *listen, ferry_ctx **ctx, ferry_store **st, char *url, size_t cap) {
  int rc = bench_dir_host("bench-dir", listen, ctx, st, url, cap);
  if (rc != 0)
    fprintf(stderr, "bench refit: the directory: %s\n", ferry_last_error());
  return rc;
}

static void dir_close(ferry_ctx *ctx, ferry_store *st) {
  if (st)
    ferry_store_close(st);
  ferry_ctx_close(ctx);
}

/* The rows between hosts, run with this thread in the directory's namespace (host nh). */
static int hosts_rows(const bench_opts *o, int nh, int reps, bool gloo) {
  int home;
  if (netns_enter(MN_TAG, nh, &home) != 0)
    return -1;
  char listen[32], url[96];
  snprintf(listen, sizeof listen, MN_NET ".%d:" MN_DIR_PORT, nh);
  ferry_ctx *ctx = NULL;
  ferry_store *st = NULL;
  int rc = dir_open(listen, &ctx, &st, url, sizeof url);
  gmodel m;
  if (rc == 0)
    rc = gmodel_make(&m, MN_MODEL, 0);
  const mn_row rows[] = {{4, 2, false, &m, MN_MODEL, 0, 1, url, MN_MBIT},
                         {4, 4, true, &m, MN_MODEL, 0, 1, url, MN_MBIT},
                         {2, 4, true, &m, MN_MODEL, 0, 1, url, MN_MBIT},
                         {8, 8, true, &m, MN_MODEL, 0, 1, url, MN_MBIT_8}};
  int nrows = o->full ? 4 : 3, failed = 0, mbit = MN_MBIT;
  for (int i = 0; rc == 0 && i < nrows; i++) {
    char rate[32], why[512];
    snprintf(rate, sizeof rate, "%dmbit", rows[i].mbit);
    if (rows[i].mbit != mbit && !netns_set_rate(MN_TAG, nh, rate, true, why, sizeof why)) {
      fprintf(stderr, "bench refit: `%s` failed\n", why);
      failed = 1;
      break;
    }
    mbit = rows[i].mbit;
    failed |= run_row(o, &rows[i], reps, gloo) != 0;
  }
  if (rc == 0)
    gmodel_free(&m);
  dir_close(ctx, st);
  return netns_leave(home) == 0 && rc == 0 && !failed ? 0 : -1;
}

/* ---- 5,000 tensors over 4 ranks, on this host ---- */

static void time_memcpy(const gmodel *m, int reps, bench_samples *b) {
  uint8_t *dst = malloc(m->bytes), **src = calloc(m->n, sizeof *src);
  for (size_t i = 0; i < m->n; i++)
    if ((src[i] = malloc(gmodel_tensor_bytes(m, i))))
      memset(src[i], (int)i, gmodel_tensor_bytes(m, i));
  for (int r = 0; dst && r <= reps; r++) {
    double t = bench_now();
    uint64_t at = 0;
    for (size_t i = 0; i < m->n; i++) {
      if (src[i])
        memcpy(dst + at, src[i], gmodel_tensor_bytes(m, i));
      at += gmodel_tensor_bytes(m, i);
    }
    __asm__ volatile("" ::"r"(dst) : "memory");
    if (r > 0)
      bench_add(b, bench_now() - t);
  }
  for (size_t i = 0; i < m->n; i++)
    free(src[i]);
  free(src);
  free(dst);
}

static int small_rows(const bench_opts *o, int reps) {
  ferry_ctx *ctx = NULL;
  ferry_store *st = NULL;
  char url[96];
  gmodel m;
  int rc = dir_open("127.0.0.1:0", &ctx, &st, url, sizeof url);
  if (rc == 0)
    rc = gmodel_make(&m, 0, 5000);
  bench_samples mc = {0}, one = {0}, group = {0};
  cpu_meter cpu;
  mn_row single = {1, 1, false, &m, 0, 5000, 0, url, 0},
         four = {4, 1, false, &m, 0, 5000, 0, url, 0};
  if (rc == 0) {
    time_memcpy(&m, reps, &mc);
    bench_row(o, "refit", "5000t-M4", "memcpy", m.bytes, &mc, true);
    if (row_series(&single, "--group-rank", "mn-s1", reps, &one, &cpu) == 0)
      bench_row(o, "refit", "5000t-M4", "ferry/single", m.bytes, &one, false);
    rc = row_series(&four, "--group-rank", "mn-s4", reps, &group, &cpu);
  }
  if (rc == 0) {
    bench_row(o, "refit", "5000t-M4", "ferry/group", m.bytes, &group, false);
    double beyond = bench_median(&group) - bench_median(&mc);
    if (o->json)
      printf("{\"bench\":\"refit\",\"case\":\"5000t-M4\",\"impl\":\"ratios\",\"ranks\":4,"
             "\"beyond_bytes_s\":%.6g,\"target_push_max_s\":0.002}\n",
             beyond);
    else
      printf("%-16s a push of the group of 4 %.3f ms (target <= 2 ms), %.3f ms beyond a memcpy "
             "of its bytes\n",
             "5000t-M4", bench_median(&group) * 1e3, beyond * 1e3);
  }
  if (ctx)
    gmodel_free(&m);
  bench_free(&mc), bench_free(&one), bench_free(&group);
  dir_close(ctx, st);
  return rc;
}

int bench_refit_group(const bench_opts *o, bool hosts, bool one_host) {
  ssize_t len = readlink("/proc/self/exe", self_path, sizeof self_path - 1);
  if (len <= 0)
    return -1;
  self_path[len] = 0;
  int rc = one_host ? small_rows(o, o->reps ? o->reps : 20) : 0;
  if (!hosts)
    return rc;
  int nh = (o->full ? 16 : 8) + 1; /* the last: the directory's */
  char failed[512];
  char rate[32];
  snprintf(rate, sizeof rate, "%dmbit", MN_MBIT);
  if (!netns_up(MN_TAG, MN_NET, nh, rate, failed, sizeof failed) ||
      !netns_limit_ingress(MN_TAG, nh, rate, failed, sizeof failed)) {
    netns_down(MN_TAG, nh);
    if (!o->json)
      printf("(network namespaces or tc unavailable here: `%s` failed; needs root, iproute2; "
             "M×N rows skipped)\n",
             failed);
    return rc;
  }
  bool gloo = gloo_available();
  if (!gloo && !o->json)
    printf("(python3-torch not found: the M×N gloo rows skipped)\n");
  bool token = bench_token_begin();
  int hrc = hosts_rows(o, nh, o->reps ? o->reps : 3, gloo);
  bench_token_end(token);
  netns_down(MN_TAG, nh);
  return rc ? rc : hrc;
}
