/*
 * The baselines of `ferry bench store`, run in the same invocation as ferry itself:
 *   - np.save/np.load and torch.save/torch.load of the same tensors to local files, timed by
 *     Debian's /usr/bin/python3 running a small embedded script that prints one JSON line of
 *     per-request timings per (case, impl);
 *   - Redis SET/GET of the same bytes (hiredis; a redis-server started here on loopback);
 *   - over tcp between two network namespaces: ferry's get against a plain socket stream of the
 *     same bytes, taking turns (this binary re-run inside each namespace with --role).
 * A baseline that cannot run (no python3, numpy, torch, redis-server or namespaces) says why.
 */
#include "bench_store.h"
#include "netns.h"
#include "ferry.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- JSON lines of timings: {"case": "...", "impl": "...", "s": [t, ...]} ---- */

static bool json_str(const char *line, const char *field, char *out, size_t cap) {
  char pat[32];
  snprintf(pat, sizeof pat, "\"%s\": \"", field);
  const char *p = strstr(line, pat);
  if (!p)
    return false;
  p += strlen(pat);
  size_t n = strcspn(p, "\"");
  if (n >= cap)
    return false;
  memcpy(out, p, n);
  out[n] = '\0';
  return true;
}

static void take_line(bs_report *r, const char *line, uint64_t bytes_of(const char *)) {
  char case_name[32], impl[32];
  const char *p = strstr(line, "\"s\": [");
  if (!p || !json_str(line, "case", case_name, sizeof case_name) ||
      !json_str(line, "impl", impl, sizeof impl))
    return;
  bs_series *s = bs_add(r, case_name, impl, bytes_of(case_name), false);
  for (p += 6; s && *p && *p != ']';) {
    char *end;
    double v = strtod(p, &end);
    if (end == p)
      break;
    bench_add(&s->s, v);
    p = end + strspn(end, ", ");
  }
}

static uint64_t case_bytes(const char *case_name) {
  return strncmp(case_name, "layers", 6) == 0 ? BS_LAYERS * BS_LAYER_BYTES
         : strncmp(case_name, "tcp", 3) == 0  ? BS_ROUTING_BYTES
                                              : BS_ROUTING_BYTES;
}

static void read_lines(bs_report *r, FILE *f) {
  char *line = NULL;
  size_t cap = 0;
  while (getline(&line, &cap, f) > 0) {
    if (line[0] == '{')
      take_line(r, line, case_bytes);
    else
      fputs(line, stderr);
  }
  free(line);
}

/* ---- numpy and torch through python3 ---- */

static const char py_script[] =
    "import json, os, shutil, sys, tempfile, time\n"
    "R = int(sys.argv[1])\n"
    "import numpy as np\n"
    "try:\n"
    "    import torch\n"
    "except Exception as e:\n"
    "    torch = None\n"
    "    print('ferry bench store: torch baseline skipped: %s' % e, flush=True)\n"
    "d = tempfile.mkdtemp(prefix='ferry-bench-')\n"
    "rng = np.random.default_rng(0)\n"
    "routing = rng.integers(0, 256, size=(45, 32768, 8), dtype=np.uint8)\n"
    "layers = [rng.integers(0, 256, size=(32768, 8), dtype=np.int32) for _ in range(45)]\n"
    "def emit(case, impl, s):\n"
    "    print(json.dumps({'case': case, 'impl': impl, 's': s}), flush=True)\n"
    "def run(case, arrays, save, load, ext, name):\n"
    "    ts, tl = [], []\n"
    "    for i in range(R):\n"
    "        paths = [os.path.join(d, '%s-%d-%d%s' % (case, i, j, ext)) for j in "
    "range(len(arrays))]\n"
    "        t = time.perf_counter()\n"
    "        for p, a in zip(paths, arrays):\n"
    "            save(p, a)\n"
    "        ts.append(time.perf_counter() - t)\n"
    "        t = time.perf_counter()\n"
    "        for p in paths:\n"
    "            load(p)\n"
    "        tl.append(time.perf_counter() - t)\n"
    "        for p in paths:\n"
    "            os.unlink(p)\n"
    "    emit(case + '/put', name + '.save', ts)\n"
    "    emit(case + '/get', name + '.load', tl)\n"
    "try:\n"
    "    run('routing', [routing], np.save, np.load, '.npy', 'np')\n"
    "    run('layers', layers, np.save, np.load, '.npy', 'np')\n"
    "    if torch is not None:\n"
    "        tr = [torch.from_numpy(routing)]\n"
    "        tlay = [torch.from_numpy(a) for a in layers]\n"
    "        save = lambda p, t: torch.save(t, p)\n"
    "        run('routing', tr, save, torch.load, '.pt', 'torch')\n"
    "        run('layers', tlay, save, torch.load, '.pt', 'torch')\n"
    "finally:\n"
    "    shutil.rmtree(d, ignore_errors=True)\n";

void bs_python(bs_report *r, int requests) {
  if (access("/usr/bin/python3", X_OK) != 0) {
    fprintf(stderr, "ferry bench store: np/torch baselines skipped: no /usr/bin/python3\n");
    return;
  }
  char script[] = "/tmp/ferry-bench-XXXXXX.py";
  int fd = mkstemps(script, 3);
  if (fd < 0 || write(fd, py_script, sizeof py_script - 1) != (ssize_t)(sizeof py_script - 1)) {
    fprintf(stderr, "ferry bench store: cannot write the python script\n");
    return;
  }
  close(fd);
  char cmd[256];
  snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s %d 2>&1", script, requests);
  FILE *f = popen(cmd, "r");
  if (f) {
    read_lines(r, f);
    if (pclose(f) != 0)
      fprintf(stderr, "ferry bench store: the python baseline failed (numpy missing? "
                      "scripts/deps.sh bench)\n");
  }
  unlink(script);
}

/* ---- Redis ---- */

static pid_t start_redis(int port) {
  char p[16];
  snprintf(p, sizeof p, "%d", port);
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    dup2(devnull, 2);
    execlp("redis-server", "redis-server", "--port", p, "--bind", "127.0.0.1", "--save", "",
           "--appendonly", "no", (char *)NULL);
    _exit(127);
  }
  return pid;
}

static redisContext *connect_redis(int port) {
  for (int i = 0; i < 300; i++) {
    redisContext *c = redisConnect("127.0.0.1", port);
    if (c && !c->err)
      return c;
    redisFree(c);
    usleep(10000);
  }
  return NULL;
}

/* One request: `n` values of `bytes` each, SET then GET (pipelined when n > 1). */
static bool redis_request(redisContext *c, int i, int n, const char *val, size_t bytes,
                          bs_series *set, bs_series *get) {
  double t = bench_now();
  for (int j = 0; j < n; j++)
    redisAppendCommand(c, "SET req:%d:%d %b", i, j, val, bytes);
  bool ok = true;
  for (int j = 0; j < n; j++) {
    redisReply *rep = NULL;
    ok = ok && redisGetReply(c, (void **)&rep) == REDIS_OK;
    freeReplyObject(rep);
  }
  bench_add(&set->s, bench_now() - t);
  t = bench_now();
  for (int j = 0; j < n; j++)
    redisAppendCommand(c, "GET req:%d:%d", i, j);
  for (int j = 0; j < n; j++) {
    redisReply *rep = NULL;
    ok = ok && redisGetReply(c, (void **)&rep) == REDIS_OK && rep &&
         rep->type == REDIS_REPLY_STRING && rep->len == bytes;
    freeReplyObject(rep);
  }
  bench_add(&get->s, bench_now() - t);
  for (int j = 0; j < n; j++)
    freeReplyObject(redisCommand(c, "DEL req:%d:%d", i, j));
  return ok;
}

static void redis_case(bs_report *r, redisContext *c, const char *name, int requests, int n,
                       size_t bytes, const char *val) {
  char put[32], get[32];
  snprintf(put, sizeof put, "%s/put", name);
  snprintf(get, sizeof get, "%s/get", name);
  bs_series *s = bs_add(r, put, "redis SET", (uint64_t)n * bytes, false);
  bs_series *g = bs_add(r, get, "redis GET", (uint64_t)n * bytes, false);
  for (int i = 0; s && g && i < requests; i++)
    if (!redis_request(c, i, n, val, bytes, s, g)) {
      fprintf(stderr, "ferry bench store: redis baseline failed: %s\n", c->errstr);
      return;
    }
}

void bs_redis(bs_report *r, int requests) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  bind(fd, (struct sockaddr *)&sa, sizeof sa);
  getsockname(fd, (struct sockaddr *)&sa, &len);
  close(fd);
  int port = ntohs(sa.sin_port);
  pid_t pid = start_redis(port);
  redisContext *c = connect_redis(port);
  if (!c) {
    fprintf(stderr, "ferry bench store: redis baseline skipped: redis-server did not start "
                    "(scripts/deps.sh bench installs it)\n");
  } else {
    char *val = malloc(BS_ROUTING_BYTES);
    memset(val, 7, BS_ROUTING_BYTES);
    redis_case(r, c, "routing", requests, 1, BS_ROUTING_BYTES, val);
    redis_case(r, c, "layers", requests, BS_LAYERS, BS_LAYER_BYTES, val);
    free(val);
    redisFree(c);
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
}

/* ---- tcp between two network namespaces ---- */

#define NS_TAG "bs"
#define NS_NET "10.231.9"
#define NS_A NETNS_HOST(NS_TAG, 1)
#define NS_B NETNS_HOST(NS_TAG, 2)
#define IP_A NETNS_IP(NS_NET, 1)
#define IP_B NETNS_IP(NS_NET, 2)
#define DIR_PORT 7792
#define SOCK_PORT 7793

static bool hosts_up(void) {
  char failed[512];
  if (netns_up(NS_TAG, NS_NET, 2, NULL, failed, sizeof failed))
    return true;
  fprintf(stderr, "ferry bench store: tcp-between-namespaces skipped: `%s` failed (needs root)\n",
          failed);
  return false;
}

void bs_netns(bs_report *r, const char *self, int reps) {
  if (!hosts_up())
    return;
  bool token = bench_token_begin();
  char cmd[4400];
  snprintf(cmd, sizeof cmd, "ip netns exec " NS_A " %s bench store --role ns-owner", self);
  FILE *owner = popen(cmd, "w");
  snprintf(cmd, sizeof cmd,
           "ip netns exec " NS_B " env FERRY_BENCH_REPS=%d %s bench store --role ns-reader", reps,
           self);
  FILE *reader = owner ? popen(cmd, "r") : NULL;
  if (reader) {
    read_lines(r, reader);
    pclose(reader);
  }
  if (owner)
    pclose(owner);
  bench_token_end(token);
  netns_down(NS_TAG, 2);
}

typedef struct sock_srv {
  int fd;
  const uint8_t *data;
} sock_srv;

/* The plain-socket baseline: a request is 8 bytes (a length); the answer is that many bytes. */
static void *sock_serve(void *arg) {
  sock_srv *s = arg;
  int fd = accept(s->fd, NULL, NULL);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  uint64_t len;
  while (bench_read_all(fd, &len, sizeof len) == 0 && len <= BS_ROUTING_BYTES)
    if (bench_write_all(fd, s->data, (size_t)len) != 0)
      break;
  close(fd);
  return NULL;
}

static int sock_listen(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(SOCK_PORT)};
  inet_pton(AF_INET, IP_A, &sa.sin_addr);
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(fd, 4) != 0)
    return -1;
  return fd;
}

static int role_owner(void) {
  char listen[64];
  snprintf(listen, sizeof listen, IP_A ":%d", DIR_PORT);
  ferry_ctx_opts co = {.size = sizeof co, .name = "ns-owner", .tcp_listen = listen};
  ferry_store_opts so = {
      .size = sizeof so, .capacity = 1 << 20, .flags = FERRY_STORE_HOST_DIRECTORY};
  ferry_ctx *ctx;
  ferry_store *s;
  uint8_t *mem;
  ferry_tensor_desc d = {
      .dtype = FERRY_DTYPE_U8, .ndim = 3, .shape = {BS_LAYERS, BS_TOKENS, BS_TOPK}};
  if (ferry_ctx_open(&co, &ctx) != 0 || ferry_store_open(ctx, &so, &s) != 0 ||
      ferry_alloc(ctx, BS_ROUTING_BYTES, (void **)&mem) != 0)
    return bs_fail("ns owner");
  memset(mem, 3, BS_ROUTING_BYTES);
  sock_srv srv = {.fd = sock_listen(), .data = mem};
  pthread_t t;
  if (srv.fd < 0 || pthread_create(&t, NULL, sock_serve, &srv) != 0 ||
      ferry_store_put(s, "tcp/obj", &d, mem, 0, -1) != 0)
    return bs_fail("ns owner");
  char line[16];
  while (fgets(line, sizeof line, stdin)) /* until the parent closes our stdin */
    ;
  _exit(0); /* the socket thread is blocked in recv */
}

static void emit(const char *case_name, const char *impl, const bench_samples *s) {
  printf("{\"case\": \"%s\", \"impl\": \"%s\", \"s\": [", case_name, impl);
  for (size_t i = 0; i < s->n; i++)
    printf("%s%.9g", i ? ", " : "", s->s[i]);
  printf("]}\n");
  fflush(stdout);
}

static int socket_dial(void) {
  int fd = -1;
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(SOCK_PORT)};
  inet_pton(AF_INET, IP_A, &sa.sin_addr);
  for (int i = 0; i < 200; i++) { /* the owner may still be starting */
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0)
      break;
    close(fd);
    fd = -1;
    usleep(20000);
  }
  int one = 1;
  if (fd >= 0)
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

static int socket_read(int fd, uint8_t *dst) {
  uint64_t len = BS_ROUTING_BYTES;
  return bench_write_all(fd, &len, sizeof len) == 0 && bench_read_all(fd, dst, len) == 0 ? 0 : -1;
}

static ferry_store *reader_store(ferry_ctx **ctx) {
  char url[64];
  snprintf(url, sizeof url, "ferry://" IP_A ":%d", DIR_PORT);
  ferry_ctx_opts co = {.size = sizeof co, .name = "ns-reader", .tcp_listen = IP_B ":0"};
  ferry_store_opts so = {.size = sizeof so, .directory = url, .capacity = 1 << 20};
  ferry_store *s = NULL;
  if (ferry_ctx_open(&co, ctx) != 0)
    return NULL;
  int rc = FERRY_ECONNECT;
  for (int i = 0; i < 200 && rc == FERRY_ECONNECT; i++) /* the owner may still be starting */
    if ((rc = ferry_store_open(*ctx, &so, &s)) == FERRY_ECONNECT)
      usleep(50000);
  for (int i = 0; rc == 0 && i < 500 && ferry_store_exists(s, "tcp/obj", -1) != 1; i++)
    usleep(10000);
  if (rc != 0) {
    ferry_ctx_close(*ctx);
    return NULL;
  }
  return s;
}

/* One read of the object by each, timed; `socket_first` says which goes first. */
static int read_both(ferry_store *s, int fd, uint8_t *dst, bool socket_first, double *t_ferry,
                     double *t_socket) {
  for (int k = 0; k < 2; k++) {
    double t = bench_now();
    if (socket_first == (k == 0)) {
      if (socket_read(fd, dst) != 0)
        return bs_fail("ns reader: socket");
      *t_socket = bench_now() - t;
    } else {
      if (ferry_store_get(s, "tcp/obj", NULL, dst, BS_ROUTING_BYTES, NULL, -1) != 0 || dst[0] != 3)
        return bs_fail("ns reader: get");
      *t_ferry = bench_now() - t;
    }
  }
  return 0;
}

/* ferry's get and the plain socket's read take turns (the first of each pair alternating), so
 * both rows see the same moments of a shared machine; the first pair warms up. */
static int role_reader(void) {
  const char *env = getenv("FERRY_BENCH_REPS");
  int reps = env ? atoi(env) : 37;
  uint8_t *dst = malloc(BS_ROUTING_BYTES);
  ferry_ctx *ctx = NULL;
  ferry_store *s = dst ? reader_store(&ctx) : NULL;
  int fd = s ? socket_dial() : -1;
  int rc = fd >= 0 ? 0 : bs_fail("ns reader");
  bench_samples fb = {0}, sb = {0};
  for (int i = 0; rc == 0 && i <= reps; i++) {
    double tf = 0, ts = 0;
    rc = read_both(s, fd, dst, i % 2 == 1, &tf, &ts);
    if (rc == 0 && i > 0) {
      bench_add(&fb, tf);
      bench_add(&sb, ts);
    }
  }
  if (rc == 0) {
    emit("tcp/get", "ferry/tcp", &fb);
    emit("tcp/get", "socket", &sb);
  }
  bench_free(&fb);
  bench_free(&sb);
  if (fd >= 0)
    close(fd);
  ferry_store_close(s);
  if (ctx)
    ferry_ctx_close(ctx);
  free(dst);
  return rc ? 1 : 0;
}

int bs_role(const char *role) {
  if (strcmp(role, "ns-owner") == 0)
    return role_owner();
  if (strcmp(role, "ns-reader") == 0)
    return role_reader();
  fprintf(stderr, "ferry bench store: unknown role '%s'\n", role);
  return 2;
}
