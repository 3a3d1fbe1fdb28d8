/*
 * `ferry bench store`: MoE routing replay through the store, against what engines do today.
 *
 * Workload (per request): "routing" is one [45, 32768, 8] uint8 tensor (11.25 MiB); "layers" is
 * 45 tensors of [32768, 8] int32 (1 MiB each). A producer process writes each request into
 * ferry memory and puts it (published in place; also timed: a copying put); this process gets
 * it (one get, or one batch get of 45 keys) into a warm buffer. The embedded directory runs in a
 * third process, as `ferry serve` would. Baselines in the same run (bench_store_base.c):
 * memcpy of the same bytes, np.save/np.load and torch.save/torch.load to local files, Redis
 * SET/GET, and over tcp between two network namespaces a plain socket stream. Per-request
 * medians, then each target of the issue with its measured ratio.
 */
#include "bench_store.h"
#include "cli/cli.h"
#include "ferry.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define BIG_BYTES (256ull << 20)
#define BIG_REPS 10
#define FLOOR_BYTES (64u << 10) /* the paced floor's memcpy (bench_paced_floor) */

/* ---- the report ---- */

bs_series *bs_add(bs_report *r, const char *case_name, const char *impl, uint64_t bytes,
                  bool baseline) {
  if (r->n == (int)(sizeof r->v / sizeof r->v[0]))
    return NULL;
  bs_series *s = &r->v[r->n++];
  memset(s, 0, sizeof *s);
  snprintf(s->case_name, sizeof s->case_name, "%s", case_name);
  snprintf(s->impl, sizeof s->impl, "%s", impl);
  s->bytes = bytes;
  s->baseline = baseline;
  bench_wake_init(&s->w, NULL, 0);
  return s;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double bs_median(const bs_series *s) {
  if (!s || s->s.n == 0)
    return 0;
  double *c = malloc(s->s.n * sizeof *c);
  memcpy(c, s->s.s, s->s.n * sizeof *c);
  qsort(c, s->s.n, sizeof *c, cmp_double);
  size_t n = s->s.n;
  double m = n % 2 ? c[n / 2] : (c[n / 2 - 1] + c[n / 2]) / 2;
  free(c);
  return m;
}

const bs_series *bs_find(const bs_report *r, const char *case_name, const char *impl) {
  for (int i = 0; i < r->n; i++)
    if (strcmp(r->v[i].case_name, case_name) == 0 && strcmp(r->v[i].impl, impl) == 0)
      return &r->v[i];
  return NULL;
}

int bs_fail(const char *what) {
  fprintf(stderr, "ferry bench store: %s: %s\n", what, ferry_last_error());
  return -1;
}

/* ---- pipes ---- */

/* ---- helper processes ---- */

int bs_free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  int port = -1;
  if (fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
      getsockname(fd, (struct sockaddr *)&sa, &len) == 0)
    port = ntohs(sa.sin_port);
  if (fd >= 0)
    close(fd);
  return port;
}

ferry_store *bs_open_node(const char *name, const char *listen, const char *url, uint32_t flags,
                          uint64_t capacity, ferry_ctx **ctx) {
  ferry_ctx_opts co = {.size = sizeof co, .name = name, .tcp_listen = listen};
  ferry_store_opts so = {.size = sizeof so, .directory = url, .capacity = capacity, .flags = flags};
  ferry_store *s = NULL;
  if (ferry_ctx_open(&co, ctx) != 0 || ferry_store_open(*ctx, &so, &s) != 0) {
    fprintf(stderr, "ferry bench store: %s: %s\n", name, ferry_last_error());
    return NULL;
  }
  return s;
}

/* The directory process: hosts the embedded directory until its pipe closes. */
int bs_directory_main(const char *listen, int quit_fd) {
  ferry_ctx *ctx;
  ferry_store *s =
      bs_open_node("bench-directory", listen, NULL, FERRY_STORE_HOST_DIRECTORY, 1 << 20, &ctx);
  if (!s)
    return 1;
  char c;
  while (read(quit_fd, &c, 1) < 0 && errno == EINTR)
    ;
  ferry_store_close(s);
  ferry_ctx_close(ctx);
  return 0;
}

typedef struct producer {
  ferry_store *s;
  ferry_ctx *ctx;
  int requests, to_consumer, from_consumer;
  int pace_ms;  /* > 0: the paced run: each timed put after a pause this long */
  bench_wake w; /* the paced run's: this process, the consumer and the directory */
} producer;

/* What the producer sends the consumer per timed put: its time, and in the paced run the
 * wake-ups of its window (switches < 0: not counted). */
typedef struct bs_timed {
  double dt, switches, seconds;
  double idle_switches, idle_windows; /* an empty window after it, now and then */
} bs_timed;

/* The paced run follows every IDLE_EVERY-th timed call's window with an empty one of the same
 * shape (bench_wake_idle_paced): the background the windows count besides the calls. */
#define IDLE_EVERY 4

/* After a paced call's window: now and then, an empty one into w. */
static void idle_window(bench_wake *w, int pace_ms) {
  bench_opts o = {.pace_ms = pace_ms};
  if ((w->calls - 1) % IDLE_EVERY == 0)
    bench_wake_idle_paced(w, &o, pace_ms);
}

/* The paced run's pause before a timed put, inside the put's window of wake-ups (bench.h);
 * the consumer's reads pause as long before each. */
static void window_begin(producer *p) {
  bench_opts o = {.pace_ms = p->pace_ms};
  if (p->pace_ms > 0)
    bench_wake_begin_paced(&p->w, &o);
}

/* Sends the put's time; paced, first closes its window a pause later, so what the put set off
 * in the directory and the consumer (a posted put is answered after it returned) is in it, and
 * the consumer's reads, which this message starts, are not. */
static int send_time(producer *p, double t0) {
  bs_timed m = {.dt = bench_now() - t0, .switches = -1};
  if (p->pace_ms > 0) {
    bench_wake w = p->w; /* this window's, and its empty one's */
    w.switches = w.seconds = w.idle_switches = 0;
    w.idle_windows = 0;
    bench_wake_end_settled(&w, 1, p->pace_ms);
    p->w.calls++;
    w.calls = p->w.calls;
    idle_window(&w, p->pace_ms);
    m.switches = w.switches;
    m.seconds = w.seconds;
    m.idle_switches = w.idle_switches;
    m.idle_windows = (double)w.idle_windows;
  }
  return bench_write_all(p->to_consumer, &m, sizeof m);
}

static int wait_ack(producer *p) {
  char c;
  return bench_read_all(p->from_consumer, &c, 1);
}

/* The engine's routing buffers: a ring it reuses, as engines do (a buffer is rewritten only
 * after the key it held was deleted). */
#define RING 4

static int produce_routing(producer *p) {
  uint8_t *mem;
  if (ferry_alloc(p->ctx, RING * BS_ROUTING_BYTES, (void **)&mem) != 0)
    return -1;
  ferry_tensor_desc d = {
      .dtype = FERRY_DTYPE_U8, .ndim = 3, .shape = {BS_LAYERS, BS_TOKENS, BS_TOPK}};
  int rc = 0;
  for (int i = 0; rc == 0 && i < p->requests; i++) {
    uint8_t *req = mem + (size_t)(i % RING) * BS_ROUTING_BYTES;
    char key[32];
    if (i >= RING) {
      snprintf(key, sizeof key, "routing/%d", i - RING);
      rc = ferry_store_delete(p->s, key, -1);
    }
    memset(req, i + 1, BS_ROUTING_BYTES); /* the engine writes its routing here */
    snprintf(key, sizeof key, "routing/%d", i);
    window_begin(p);
    double t = bench_now();
    rc = ferry_store_put(p->s, key, &d, req, 0, -1);
    rc = rc ? rc : send_time(p, t);
    rc = rc ? rc : wait_ack(p);
  }
  for (int i = 0; rc == 0 && i < p->requests; i++) { /* the same bytes, copied into the pool */
    window_begin(p);
    double t = bench_now();
    rc = ferry_store_put(p->s, "routing-copy", &d, mem + (size_t)(i % RING) * BS_ROUTING_BYTES,
                         FERRY_STORE_PUT_COPY, -1);
    rc = rc ? rc : send_time(p, t);
  }
  size_t n;
  ferry_store_delete_prefix(p->s, "routing", &n, -1);
  ferry_free(p->ctx, mem);
  return rc;
}

static int produce_layers(producer *p) {
  uint8_t *mem;
  if (ferry_alloc(p->ctx, BS_LAYERS * BS_LAYER_BYTES, (void **)&mem) != 0)
    return -1;
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_I32, .ndim = 2, .shape = {BS_TOKENS, BS_TOPK}};
  int rc = 0;
  for (int i = 0; rc == 0 && i < p->requests; i++) {
    memset(mem, i + 1, BS_LAYERS * BS_LAYER_BYTES);
    char keys[BS_LAYERS][48];
    ferry_store_put_item items[BS_LAYERS];
    for (int l = 0; l < BS_LAYERS; l++) {
      snprintf(keys[l], sizeof keys[l], "layers/%d/%d", i, l);
      items[l] = (ferry_store_put_item){
          .key = keys[l], .desc = &d, .data = mem + (size_t)l * BS_LAYER_BYTES};
    }
    window_begin(p);
    double t = bench_now(); /* the 45 keys of a request: one batch put, one round trip */
    rc = ferry_store_put_batch(p->s, items, BS_LAYERS, 0, -1);
    rc = rc ? rc : send_time(p, t);
    rc = rc ? rc : wait_ack(p);
    char prefix[32];
    size_t n;
    snprintf(prefix, sizeof prefix, "layers/%d/", i);
    ferry_store_delete_prefix(p->s, prefix, &n, -1);
  }
  ferry_free(p->ctx, mem);
  return rc;
}

/* One big tensor, put in place again and again: the cost does not grow with the size. */
static int produce_big(producer *p) {
  uint8_t *mem;
  if (ferry_alloc(p->ctx, BIG_BYTES, (void **)&mem) != 0)
    return -1;
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_U8, .ndim = 1, .shape = {BIG_BYTES}};
  int rc = 0;
  for (int i = 0; rc == 0 && i < BIG_REPS; i++) {
    window_begin(p);
    double t = bench_now();
    rc = ferry_store_put(p->s, "big", &d, mem, 0, -1);
    rc = rc ? rc : send_time(p, t);
  }
  ferry_store_delete(p->s, "big", -1);
  ferry_free(p->ctx, mem);
  return rc;
}

static int producer_main(const char *url, int requests, int pace_ms, int to_consumer,
                         int from_consumer, pid_t directory) {
  producer p = {.requests = requests,
                .to_consumer = to_consumer,
                .from_consumer = from_consumer,
                .pace_ms = pace_ms};
  bench_wake_init(&p.w, (pid_t[]){getppid(), directory}, 2);
  p.s = bs_open_node("bench-producer", NULL, url, 0, 2 * BS_ROUTING_BYTES + (1 << 20), &p.ctx);
  int rc = p.s ? 0 : 1;
  if (rc == 0 && (rc = produce_routing(&p)) == 0 && (rc = produce_layers(&p)) == 0)
    rc = produce_big(&p);
  if (rc != 0)
    fprintf(stderr, "ferry bench store: producer: %s\n", ferry_last_error());
  wait_ack(&p); /* until the consumer is done */
  ferry_store_close(p.s);
  ferry_ctx_close(p.ctx);
  return rc ? 1 : 0;
}

/* ---- the consumer (this process) ---- */

typedef struct consumer {
  ferry_store *s;
  int requests, from_producer, to_producer;
  uint8_t *dst, *src; /* BS_LAYERS * BS_LAYER_BYTES each: warm buffers */
  bs_report *r;
  char suffix[16]; /* of its series' impl names: "" back to back, "@10ms" in the paced run */
  int pace_ms;     /* > 0: the paced run */
  pid_t peers[2];  /* the producer and the directory: the paced run's wake-ups count them */
} consumer;

/* A series of this run: impl with the run's suffix. */
static bs_series *series(consumer *c, const char *case_name, const char *impl, uint64_t bytes,
                         bool baseline) {
  char name[32];
  snprintf(name, sizeof name, "%s%s", impl, c->suffix);
  bs_series *s = bs_add(c->r, case_name, name, bytes, baseline);
  if (s)
    bench_wake_init(&s->w, c->peers, 2);
  return s;
}

static int take_time(consumer *c, bs_series *s) {
  bs_timed m;
  if (bench_read_all(c->from_producer, &m, sizeof m) != 0)
    return bs_fail("the producer stopped");
  bench_add(&s->s, m.dt);
  if (m.switches >= 0) {
    bench_wake_add(&s->w, m.switches, m.seconds, 1);
    s->w.idle_switches += m.idle_switches;
    s->w.idle_windows += (size_t)m.idle_windows;
  }
  return 0;
}

/* In the paced run, a first read's pause and window, from before that pause to a pause after
 * the read (bench.h); w NULL: back to back, not counted. */
static void read_begin(consumer *c, bench_wake *w) {
  bench_opts o = {.pace_ms = c->pace_ms};
  if (w)
    bench_wake_begin_paced(w, &o);
}

static void read_end(consumer *c, bench_wake *w) {
  if (w) {
    bench_wake_end_settled(w, 1, c->pace_ms);
    idle_window(w, c->pace_ms);
  }
}

static void time_memcpy(consumer *c, const char *case_name, uint64_t bytes) {
  bs_series *s = bs_add(c->r, case_name, "memcpy", bytes, true);
  memcpy(c->dst, c->src, bytes);
  for (int i = 0; i < c->requests; i++) {
    memset(c->src, i + 1, bytes); /* fresh bytes, as the producer's are */
    double t = bench_now();
    memcpy(c->dst, c->src, bytes);
    __asm__ volatile("" ::"r"(c->dst) : "memory");
    bench_add(&s->s, bench_now() - t);
  }
}

/* Gets request i into this process's buffer, timed into `s`, and checks its bytes; its
 * wake-ups counted into w (NULL: not). */
static int routing_get(consumer *c, const char *key, int i, bs_series *s, bench_wake *w) {
  read_begin(c, w);
  double t = bench_now();
  int rc = ferry_store_get(c->s, key, NULL, c->dst, BS_ROUTING_BYTES, NULL, -1);
  bench_add(&s->s, bench_now() - t);
  read_end(c, w);
  if (rc == 0 && (c->dst[0] != (uint8_t)(i + 1) || c->dst[BS_ROUTING_BYTES - 1] != c->dst[0]))
    rc = bs_fail("routing: wrong bytes");
  return rc;
}

/* Takes and releases a zero-copy view of request i (usable bytes, in place, until released),
 * timed into `s`, and checks its bytes. With `copy`, also times a plain memcpy of the view into
 * this process's buffer: the bytes where the producer wrote them, read for the first time, the
 * physical limit of a copying get. */
static int routing_view(consumer *c, const char *key, int i, bs_series *s, bs_series *copy,
                        bench_wake *w) {
  const uint8_t *p = NULL;
  ferry_store_view *v = NULL;
  read_begin(c, w);
  double t = bench_now();
  int rc = ferry_store_get_view(c->s, key, (const void **)&p, NULL, &v, -1);
  bench_add(&s->s, bench_now() - t);
  read_end(c, w);
  if (rc == 0 && copy) {
    t = bench_now();
    memcpy(c->dst, p, BS_ROUTING_BYTES);
    __asm__ volatile("" ::"r"(c->dst) : "memory");
    bench_add(&copy->s, bench_now() - t);
    p = c->dst;
  }
  if (rc == 0 && (p[0] != (uint8_t)(i + 1) || p[BS_ROUTING_BYTES - 1] != p[0]))
    rc = bs_fail("routing: wrong bytes in the view");
  ferry_store_view_release(v);
  return rc;
}

/* Each request is read twice, the first read being this node's first lookup of the key (the
 * directory answers it) and the second answered from the store's lookup cache. Even requests
 * get first, odd ones take the view first, so "ferry" and "ferry(view)" are both first reads;
 * "view(cached)" is the view that follows a get of the same key. An odd request's view is also
 * copied out with a plain memcpy ("memcpy(view)"): the first read of the producer's bytes, as
 * "ferry"'s is, so the two compare a get with the memcpy of the same bytes where they lie. */
static int consume_routing(consumer *c) {
  bs_series *put = series(c, "routing/put", "ferry(in place)", BS_ROUTING_BYTES, false);
  bs_series *get = series(c, "routing/get", "ferry", BS_ROUTING_BYTES, false);
  bs_series *view = series(c, "routing/get", "ferry(view)", BS_ROUTING_BYTES, false);
  bs_series *cached = series(c, "routing/get", "view(cached)", BS_ROUTING_BYTES, false);
  bs_series *get_after = series(c, "routing/get", "ferry(cached)", BS_ROUTING_BYTES, false);
  bs_series *copy = series(c, "routing/get", "memcpy(view)", BS_ROUTING_BYTES, false);
  int rc = 0;
  for (int i = 0; rc == 0 && i < c->requests; i++) {
    if ((rc = take_time(c, put)) != 0)
      break;
    char key[32];
    snprintf(key, sizeof key, "routing/%d", i);
    bool paced = c->pace_ms > 0;
    if (i % 2 == 0) {
      rc = routing_get(c, key, i, get, paced ? &get->w : NULL);
      if (rc == 0)
        rc = routing_view(c, key, i, cached, NULL, NULL);
    } else {
      rc = routing_view(c, key, i, view, copy, paced ? &view->w : NULL);
      if (rc == 0)
        rc = routing_get(c, key, i, get_after, NULL);
    }
    bench_write_all(c->to_producer, "A", 1);
  }
  bs_series *copied_put = series(c, "routing/put", "ferry(copy)", BS_ROUTING_BYTES, false);
  for (int i = 0; rc == 0 && i < c->requests; i++)
    rc = take_time(c, copied_put);
  return rc;
}

static int consume_layers(consumer *c) {
  bs_series *put = series(c, "layers/put", "ferry(batch)", BS_LAYERS * BS_LAYER_BYTES, false);
  bs_series *get = series(c, "layers/get", "ferry(batch)", BS_LAYERS * BS_LAYER_BYTES, false);
  ferry_store_item items[BS_LAYERS];
  char keys[BS_LAYERS][48];
  int rc = 0;
  for (int i = 0; rc == 0 && i < c->requests; i++) {
    if ((rc = take_time(c, put)) != 0)
      break;
    for (int l = 0; l < BS_LAYERS; l++) {
      snprintf(keys[l], sizeof keys[l], "layers/%d/%d", i, l);
      items[l] = (ferry_store_item){
          .key = keys[l], .dst = c->dst + (size_t)l * BS_LAYER_BYTES, .cap = BS_LAYER_BYTES};
    }
    read_begin(c, c->pace_ms > 0 ? &get->w : NULL);
    double t = bench_now();
    rc = ferry_store_get_batch(c->s, items, BS_LAYERS, -1);
    bench_add(&get->s, bench_now() - t);
    read_end(c, c->pace_ms > 0 ? &get->w : NULL);
    bench_write_all(c->to_producer, "A", 1);
  }
  return rc;
}

static int consume_big(consumer *c) {
  bs_series *put = series(c, "put-256MiB", "ferry(in place)", BIG_BYTES, !*c->suffix);
  int rc = 0;
  for (int i = 0; rc == 0 && i < BIG_REPS; i++)
    rc = take_time(c, put);
  return rc;
}

static int run_consumer(consumer *c, const char *url) {
  ferry_ctx *ctx;
  c->s = bs_open_node("bench-consumer", NULL, url, 0, 1 << 20, &ctx);
  if (!c->s)
    return -1;
  c->dst = malloc(BS_LAYERS * BS_LAYER_BYTES);
  c->src = malloc(BS_LAYERS * BS_LAYER_BYTES);
  memset(c->dst, 1, BS_LAYERS * BS_LAYER_BYTES);
  memset(c->src, 2, BS_LAYERS * BS_LAYER_BYTES);
  bool paced = *c->suffix != '\0'; /* the references are timed back to back only */
  int rc = consume_routing(c);
  if (rc == 0 && !paced)
    time_memcpy(c, "routing/get", BS_ROUTING_BYTES);
  if (rc == 0 && (rc = consume_layers(c)) == 0 && !paced)
    time_memcpy(c, "layers/get", BS_LAYERS * BS_LAYER_BYTES);
  if (rc == 0)
    rc = consume_big(c);
  if (rc != 0)
    bs_fail("consumer");
  bench_write_all(c->to_producer, "Q", 1);
  free(c->dst);
  free(c->src);
  ferry_store_close(c->s);
  ferry_ctx_close(ctx);
  return rc;
}

/* Forks the directory and the producer (before this process starts any thread), then gets;
 * pace_ms > 0: the paced run (its series are named IMPL@<pace_ms>ms). */
static int run_ferry(bs_report *r, int requests, int pace_ms) {
  char listen[64], url[80];
  int port = bs_free_port();
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  snprintf(url, sizeof url, "ferry://127.0.0.1:%d", port);
  int dq[2], p2c[2], c2p[2];
  if (pipe(dq) != 0 || pipe(p2c) != 0 || pipe(c2p) != 0)
    return -1;
  fflush(NULL);
  pid_t dir = fork();
  if (dir == 0) {
    close(dq[1]);
    _exit(bs_directory_main(listen, dq[0]));
  }
  close(dq[0]);
  usleep(200000); /* let it listen; the producer's open retries nothing */
  pid_t prod = fork();
  if (prod == 0) {
    close(dq[1]);
    _exit(producer_main(url, requests, pace_ms, p2c[1], c2p[0], dir));
  }
  close(p2c[1]);
  close(c2p[0]);
  consumer c = {.requests = requests,
                .from_producer = p2c[0],
                .to_producer = c2p[1],
                .r = r,
                .pace_ms = pace_ms,
                .peers = {prod, dir}};
  if (pace_ms > 0)
    snprintf(c.suffix, sizeof c.suffix, "@%dms", pace_ms);
  int rc = run_consumer(&c, url);
  close(c2p[1]);
  int st = 0;
  waitpid(prod, &st, 0);
  close(dq[1]);
  waitpid(dir, NULL, 0);
  close(p2c[0]);
  return rc == 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

/* ---- report ---- */

static const char *const order[][2] = {
    {"routing/put", "np.save"},
    {"routing/put", "torch.save"},
    {"routing/put", "redis SET"},
    {"routing/put", "ferry(copy)"},
    {"routing/put", "ferry(in place)"},
    {"routing/get", "memcpy"},
    {"routing/get", "memcpy(view)"},
    {"routing/get", "ferry"},
    {"routing/get", "ferry(view)"},
    {"routing/get", "ferry(cached)"},
    {"routing/get", "view(cached)"},
    {"routing/get", "np.load"},
    {"routing/get", "torch.load"},
    {"routing/get", "redis GET"},
    {"layers/put", "np.save"},
    {"layers/put", "torch.save"},
    {"layers/put", "redis SET"},
    {"layers/put", "ferry(batch)"},
    {"layers/get", "memcpy"},
    {"layers/get", "ferry(batch)"},
    {"layers/get", "np.load"},
    {"layers/get", "torch.load"},
    {"layers/get", "redis GET"},
    {"put-256MiB", "ferry(in place)"},
    {"first/put", "malloc+fill"},
    {"first/put", "ferry(fill+put)"},
    {"nocache/put", "ferry(fill+put)"},
    {"first/get", "memcpy"},
    {"first/get", "memcpy(new)"},
    {"first/get", "ferry"},
    {"first/get", "ferry(view)"},
    {"first/get", "view+read"},
    {"nocache/get", "ferry"},
    {"nocache/get", "ferry(view)"},
    {"nocache/get", "view+read"},
    {"consumer-start", "memcpy(new proc)"},
    {"consumer-start", "open"},
    {"consumer-start", "first get"},
    {"tcp/get", "socket"},
    {"tcp/get", "ferry/tcp"},
};

static void print_rows(const bench_opts *o, bs_report *r) {
  bench_header(o, "ferry bench store (per-request medians; vs base = base median / row median)");
  const char *last_case = "";
  for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
    bs_series *s = (bs_series *)bs_find(r, order[i][0], order[i][1]);
    if (!s)
      continue;
    bool first = strcmp(last_case, s->case_name) != 0;
    last_case = s->case_name;
    bench_row(o, "store", s->case_name, s->impl, s->bytes, &s->s, first);
  }
}

/* The rows the paced run repeats: every call that follows a pause (the producer's puts, and the
 * first read of each request, which follows them); the cached reads come right after another
 * read, and memcpy is a reference, not a call. */
static const char *const paced_order[][2] = {
    {"routing/put", "ferry(copy)"},  {"routing/put", "ferry(in place)"},
    {"routing/get", "ferry"},        {"routing/get", "ferry(view)"},
    {"routing/get", "memcpy(view)"}, {"layers/put", "ferry(batch)"},
    {"layers/get", "ferry(batch)"},  {"put-256MiB", "ferry(in place)"},
};

static void print_paced(const bench_opts *o, bs_report *r) {
  for (size_t i = 0; i < sizeof paced_order / sizeof paced_order[0]; i++) {
    char name[32];
    snprintf(name, sizeof name, "%s@%dms", paced_order[i][1], o->pace_ms);
    const bs_series *b2b = bs_find(r, paced_order[i][0], paced_order[i][1]);
    bs_series *paced = (bs_series *)bs_find(r, paced_order[i][0], name);
    if (b2b && paced)
      bench_paced_row(o, "store", paced->case_name, b2b->impl, paced->bytes, &paced->s,
                      bs_median(b2b), &paced->w);
  }
}

/* ratio = a / b of two medians; 0 when either is missing. */
static double ratio(const bs_report *r, const char *ca, const char *ia, const char *cb,
                    const char *ib) {
  double a = bs_median(bs_find(r, ca, ia)), b = bs_median(bs_find(r, cb, ib));
  return a > 0 && b > 0 ? a / b : 0;
}

static void target(const bench_opts *o, const char *name, double value, bool met,
                   const char *unit) {
  if (value == 0) {
    if (!o->json)
      printf("  %-52s not measured\n", name);
    return;
  }
  if (o->json)
    printf("{\"bench\":\"store\",\"target\":\"%s\",\"value\":%.6g,\"met\":%s}\n", name, value,
           met ? "true" : "false");
  else
    printf("  %-52s %10.2f%-3s %s\n", name, value, unit, met ? "met" : "NOT met");
}

static void print_targets(const bench_opts *o, const bs_report *r) {
  if (!o->json)
    printf("\ntargets (from the issue)\n");
  double p1 = bs_median(bs_find(r, "routing/put", "ferry(in place)")) * 1e6;
  double p2 = bs_median(bs_find(r, "put-256MiB", "ferry(in place)")) * 1e6;
  double worst = p1 > p2 ? p1 : p2;
  target(o, "in-place put median <= 100 us (11 MiB and 256 MiB)", worst, worst <= 100, "us");
  double g = ratio(r, "routing/get", "ferry", "routing/get", "memcpy(view)");
  target(o, "get / memcpy of the same bytes <= 1.3 (routing)", g, g <= 1.3, "x");
  g = ratio(r, "layers/get", "ferry(batch)", "layers/get", "memcpy");
  target(o, "batch get / memcpy <= 1.3 (layers)", g, g <= 1.3, "x");
  g = ratio(r, "routing/get", "np.load", "routing/get", "ferry");
  target(o, "np.load / get >= 10 (routing)", g, g >= 10, "x");
  g = ratio(r, "routing/get", "torch.load", "routing/get", "ferry");
  target(o, "torch.load / get >= 10 (routing)", g, g >= 10, "x");
  g = ratio(r, "routing/get", "np.load", "routing/get", "ferry(view)");
  target(o, "np.load / zero-copy view >= 10 (routing)", g, g >= 10, "x");
  g = ratio(r, "routing/get", "torch.load", "routing/get", "ferry(view)");
  target(o, "torch.load / zero-copy view >= 10 (routing)", g, g >= 10, "x");
  g = ratio(r, "routing/put", "np.save", "routing/put", "ferry(in place)");
  target(o, "np.save / put >= 100 (routing)", g, g >= 100, "x");
  g = ratio(r, "layers/put", "np.save", "layers/put", "ferry(batch)");
  target(o, "np.save / put >= 100 (layers)", g, g >= 100, "x");
  g = ratio(r, "tcp/get", "socket", "tcp/get", "ferry/tcp");
  target(o, "tcp get speed / socket stream >= 0.8", g, g >= 0.8, "x");
  g = ratio(r, "first/get", "ferry", "first/get", "memcpy");
  target(o, "get-first / memcpy <= 1.5 (every key new)", g, g <= 1.5, "x");
  g = ratio(r, "first/get", "view+read", "first/get", "memcpy");
  target(o, "get-first-view + read / memcpy <= 1.5", g, g <= 1.5, "x");
  g = bs_median(bs_find(r, "consumer-start", "first get")) * 1e3;
  target(o, "consumer-start: a new trainer's first get <= 5 ms", g, g <= 5, "ms");
  g = (bs_median(bs_find(r, "first/put", "ferry(fill+put)")) -
       bs_median(bs_find(r, "first/put", "malloc+fill"))) *
      1e6;
  if (bs_find(r, "first/put", "ferry(fill+put)"))
    target(o, "engine fill+put of a new buffer - malloc+fill <= 100 us", g ? g : 1e-9, g <= 100,
           "us");
}

static const char store_usage[] =
    "usage: ferry bench store [--json] [--reps N] [--no-baselines] [--full] [--pace MS]\n\n"
    "MoE routing replay: N requests (default 37) of [45, 32768, 8] uint8 (11.25 MiB), and\n"
    "the per-layer variant of 45 keys of [32768, 8] int32 per request. A producer process\n"
    "puts, this process reads each request twice: into its buffer (get) and as a zero-copy\n"
    "view, taking turns at which comes first, so `ferry` and `ferry(view)` are a key's first\n"
    "lookup and the `cached` rows the second one. Baselines in the same run: memcpy of a\n"
    "buffer this process just wrote (`memcpy`) and of the producer's bytes through a view\n"
    "(`memcpy(view)`, a first read as the get's is: the get's target compares with it),\n"
    "np.save/np.load and torch.save/torch.load to local files (/usr/bin/python3), Redis\n"
    "SET/GET (a private redis-server), and over tcp between two network namespaces a plain\n"
    "socket stream "
    "(needs root; skipped otherwise). Then each target of the issue, met or not.\n"
    "Then routing replay as engines run it, every key new: max(N, 32) keys each in a new\n"
    "ferry_alloc_uninit buffer that the engine fills and puts (`first/put`, against a fill\n"
    "of a private buffer timed just before it), each got once into new memory or viewed, then\n"
    "deleted (`first/get`, against a memcpy of the same bytes); `nocache/*` the same with\n"
    "FERRY_ALLOC_CACHE_BYTES=0 (no reuse of freed memory); `consumer-start`: five new\n"
    "processes each timing its open and first get, and five the floor (map a memfd of the\n"
    "same bytes for the first time and copy it into new memory).\n"
    "--full runs the same: the default run already holds every row (~25 s here).\n"
    "Then the paced run: the same producer and reads once more, each put after a pause of\n"
    "--pace MS (default 10; 0: no paced run), 100 requests (--full: 1,000; --reps N, when\n"
    "fewer: N), and each first get after a pause of its own; p50, p99 and paced p50 /\n"
    "back-to-back p50 of every put and first get (routing gets alternate get and view: half\n"
    "the requests each), with wake-ups/call (JSON wakeups_per_call): the voluntary context\n"
    "switches of this process, the producer and the directory from before the call's pause\n"
    "to a pause after it (what a posted put sets off is in it), both pauses left out, and\n"
    "`idle`: the same in an empty window after every 4th call (`ferry bench --help`). Then\n"
    "the paced floor: a no-op and a 64 KiB memcpy, back to back and paced.\n";

int bench_store(int argc, char **argv) {
  bench_opts o = {0};
  for (int i = 1; i + 1 < argc; i++) /* a child this mode re-ran: bench_store_base.c */
    if (strcmp(argv[i], "--role") == 0)
      return bs_role(argv[i + 1]);
  bool no_baselines = false;
  const cli_opt extra[] = {{"no-baselines", CLI_ARG_FLAG, &no_baselines, 0, 0}, {0}};
  if (bench_parse_with(argc, argv, &o, store_usage, extra) < 0)
    return CLI_USAGE;
  bool baselines = !no_baselines;
  int requests = o.reps > 0 ? o.reps : 37;
  signal(SIGPIPE, SIG_IGN);
  static bs_report r;
  memset(&r, 0, sizeof r);
  if (run_ferry(&r, requests, 0) != 0)
    return CLI_FAIL;
  bs_first(&r, requests < 32 ? 32 : requests, true);
  bs_first(&r, requests < 32 ? 32 : requests, false);
  int paced = bench_paced_samples(&o);
  if (paced > 0 && run_ferry(&r, paced, o.pace_ms) != 0)
    return CLI_FAIL;
  if (baselines) {
    bs_python(&r, requests);
    bs_redis(&r, requests);
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    self[n > 0 ? n : 0] = '\0';
    bs_netns(&r, self, requests);
  }
  print_rows(&o, &r);
  print_paced(&o, &r);
  bench_paced_floor(&o, "store", FLOOR_BYTES);
  print_targets(&o, &r);
  for (int i = 0; i < r.n; i++)
    bench_free(&r.v[i].s);
  return CLI_OK;
}
