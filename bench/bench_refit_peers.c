/*
 * The helper processes of `ferry bench refit`'s M×N rows (bench_refit_group.h), each this program
 * run again by the run (bench_refit_group.c), on a "host" of its own between namespaces:
 *   --group-rank: one trainer rank of a sharded sender (ferry_refit_opts rank/world): it
 *     declares its pieces of the model (the trainer's layout) and pushes when told;
 *   --group-funnel: one rank of today's funnel: ranks 1..M-1 send their pieces to rank 0 over
 *     plain tcp, and rank 0, holding the whole model, pushes it with one single sender;
 *   --group-engine: an engine rank: opens the sender by name and binds its TP shards (or the
 *     whole model, flat), then waits for each version it is told.
 * Each answers on its pipe with a gpeer_report: ready, then one per command. Also the synthetic
 * model and its two layouts, which every process makes alike from the same arguments.
 */
#include "bench_refit_group.h"
#include "cli/cli.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- the model and its layouts ---- */

int gmodel_make(gmodel *m, uint64_t bytes, size_t small_count) {
  const uint64_t h = GM_HIDDEN;
  const uint64_t layer = (4 * h * h + 8 * h * h + 2 * h) * 4;
  size_t layers = bytes ? (size_t)((bytes + layer - 1) / layer) : 1;
  size_t cap = small_count ? small_count : layers * GM_KINDS;
  *m = (gmodel){.small = small_count != 0};
  m->name = calloc(cap, sizeof *m->name);
  m->desc = calloc(cap, sizeof *m->desc);
  if (!m->name || !m->desc)
    return FERRY_ENOMEM;
  for (size_t i = 0; i < cap; i++) {
    static const char *const kinds[] = {"q", "k", "v", "o", "up", "down", "norm1", "norm2"};
    static const uint64_t rows[] = {1, 1, 1, 1, 4, 1, 0, 0}, cols[] = {1, 1, 1, 1, 1, 4, 1, 1};
    uint64_t r = small_count ? 1 : rows[i % GM_KINDS] ? rows[i % GM_KINDS] * h : 1;
    uint64_t c = small_count ? 256 : cols[i % GM_KINDS] * h;
    m->desc[i] = (ferry_tensor_desc){.dtype = FERRY_DTYPE_F32, .ndim = 2, .shape = {r, c}};
    if (small_count)
      snprintf(m->name[i], sizeof m->name[i], "t.%zu", i);
    else
      snprintf(m->name[i], sizeof m->name[i], "layers.%zu.%s", i / GM_KINDS, kinds[i % GM_KINDS]);
    m->bytes += r * c * 4;
  }
  m->n = cap;
  return 0;
}

void gmodel_free(gmodel *m) {
  free(m->name);
  free(m->desc);
}

int gmodel_kind(const gmodel *m, size_t i) { return m->small ? GM_NORM1 : (int)(i % GM_KINDS); }

uint64_t gmodel_tensor_bytes(const gmodel *m, size_t i) {
  return m->desc[i].shape[0] * m->desc[i].shape[1] * 4;
}

static bool is_norm(const gmodel *m, size_t i) { return gmodel_kind(m, i) >= GM_NORM1; }

int gmodel_trainer_part(const gmodel *m, size_t i, int rank, int world, int64_t *start,
                        int64_t *stop, bool *whole) {
  int64_t rows = (int64_t)m->desc[i].shape[0];
  *whole = m->small || is_norm(m, i) || world <= 1;
  if (m->small && world > 1 && (int)(i % (size_t)world) != rank)
    return 0;
  if (*whole) {
    *start = 0, *stop = rows;
    return 1;
  }
  int64_t size = rows / world;
  *start = size * rank;
  *stop = rank == world - 1 ? rows : *start + size;
  return 1;
}

void gmodel_engine_part(const gmodel *m, size_t i, int rank, int world, int *dim, int64_t *start,
                        int64_t *stop) {
  int kind = gmodel_kind(m, i);
  *dim = kind == GM_O || kind == GM_DOWN ? 1 : 0;
  int64_t len = (int64_t)m->desc[i].shape[*dim];
  if (world <= 1 || is_norm(m, i)) {
    *dim = 0, *start = 0, *stop = (int64_t)m->desc[i].shape[0];
    return;
  }
  int64_t size = len / world;
  *start = size * rank;
  *stop = rank == world - 1 ? len : *start + size;
}

static uint64_t engine_part_bytes(const gmodel *m, size_t i, int rank, int world) {
  int dim;
  int64_t a, b;
  gmodel_engine_part(m, i, rank, world, &dim, &a, &b);
  uint64_t other = m->desc[i].shape[dim ? 0 : 1];
  return (uint64_t)(b - a) * other * 4;
}

uint64_t gmodel_engine_bytes(const gmodel *m, int rank, int engines) {
  uint64_t sum = 0;
  for (size_t i = 0; i < m->n; i++)
    sum += engine_part_bytes(m, i, rank, engines);
  return sum;
}

uint64_t gmodel_trainer_bytes(const gmodel *m, int rank, int trainers, int engines) {
  double sum = 0;
  for (size_t i = 0; i < m->n; i++) {
    int64_t ts, te;
    bool whole;
    if (!gmodel_trainer_part(m, i, rank, trainers, &ts, &te, &whole))
      continue;
    int holders = m->small || trainers <= 1 ? 1 : is_norm(m, i) ? trainers : 0;
    if (holders) { /* read whole, once per engine, from one of its holders */
      for (int e = 0; e < engines; e++)
        sum += (double)engine_part_bytes(m, i, e, engines) / holders;
      continue;
    }
    uint64_t cols = m->desc[i].shape[1];
    for (int e = 0; e < engines; e++) {
      int dim;
      int64_t es, ee;
      gmodel_engine_part(m, i, e, engines, &dim, &es, &ee);
      int64_t lo = dim ? ts : (es > ts ? es : ts), hi = dim ? te : (ee < te ? ee : te);
      uint64_t width = dim ? (uint64_t)(ee - es) : cols;
      if (hi > lo)
        sum += (double)(hi - lo) * (double)width * 4;
    }
  }
  return (uint64_t)sum;
}

/* ---- what every helper shares ---- */

typedef struct peer_io {
  int up, down; /* to the run, from the run */
} peer_io;

static double cpu_seconds(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
         (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

static int report(const peer_io *io, gpeer_report r) {
  r.cpu = cpu_seconds();
  return bench_write_all(io->up, &r, sizeof r);
}

static int next_cmd(const peer_io *io, gpeer_cmd *c) {
  return bench_read_all(io->down, c, sizeof *c) == 0 ? 0 : -1;
}

static int fail(const char *who, int rc) {
  fprintf(stderr, "bench refit %s: %s\n", who, ferry_last_error());
  return rc ? rc : -1;
}

/* The memory of rank `rank`'s part of tensor i (one fill per tensor, so no page is shared). */
static void *part_alloc(const gmodel *m, size_t i, int64_t start, int64_t stop) {
  size_t n = (size_t)(stop - start) * m->desc[i].shape[1] * 4;
  void *p = malloc(n ? n : 1);
  if (p)
    memset(p, (int)(i & 0x7f) + 1, n);
  return p;
}

/* ---- a trainer rank of a sharded sender ---- */

typedef struct rank_args {
  const char *name;
  int rank, world;
  uint64_t bytes, small, bucket;
} rank_args;

static int declare_parts(ferry_refit_sender *s, const gmodel *m, const rank_args *a, void **data) {
  int rc = 0;
  for (size_t i = 0; rc == 0 && i < m->n; i++) {
    int64_t start, stop;
    bool whole;
    if (!gmodel_trainer_part(m, i, a->rank, a->world, &start, &stop, &whole))
      continue;
    if (!(data[i] = part_alloc(m, i, start, stop)))
      return FERRY_ENOMEM;
    if (whole) {
      rc = ferry_refit_declare(s, m->name[i], &m->desc[i], data[i], FERRY_DTYPE_INVALID);
      continue;
    }
    ferry_tensor_desc d = m->desc[i];
    d.shape[0] = (uint64_t)(stop - start);
    char local[64];
    snprintf(local, sizeof local, "%s.r%d", m->name[i], a->rank);
    ferry_refit_piece of = {m->name[i], 0, start, stop};
    rc = ferry_refit_declare_piece(s, local, &d, data[i], FERRY_DTYPE_INVALID, &of);
  }
  return rc;
}

/* Until at least n receivers attached (60 s at most). */
static int wait_receivers(ferry_refit_sender *s, uint64_t n) {
  for (int i = 0; i < 60000; i++) {
    if (ferry_refit_receivers(s) >= n)
      return 0;
    usleep(1000);
  }
  return FERRY_ETIMEDOUT;
}

/* Serves the run's commands for a sender: 'n' and 'p'; `before` runs ahead of each push (the
 * funnel's gather; NULL: none). */
static int serve_sender(const peer_io *io, ferry_refit_sender *s, int (*before)(void *),
                        void *arg) {
  gpeer_cmd c;
  ferry_refit_push_opts po = {.size = sizeof po, .timeout_ms = -1};
  while (next_cmd(io, &c) == 0 && c.op != 'q') {
    gpeer_report r = {0};
    if (c.op == 'n') {
      r.rc = s ? wait_receivers(s, c.v) : 0;
    } else if (c.op == 'p') {
      r.t0 = bench_now();
      r.rc = before ? before(arg) : 0;
      if (r.rc == 0 && s)
        r.rc = ferry_refit_push(s, c.v, &po);
      r.t1 = bench_now();
      if (r.rc != 0)
        fail("rank push", r.rc);
    }
    if (report(io, r) != 0)
      return -1;
  }
  return 0;
}

static int rank_main(const peer_io *io, const rank_args *a) {
  gmodel m;
  ferry_ctx *ctx = NULL;
  ferry_refit_sender *s = NULL;
  char node[32];
  snprintf(node, sizeof node, "bench-rank-%d", a->rank);
  ferry_ctx_opts co = {.size = sizeof co, .name = node};
  ferry_refit_opts so = {.size = sizeof so,
                         .bucket_bytes = a->bucket,
                         .publish = 1,
                         .rank = a->rank,
                         .world = a->world};
  int rc = gmodel_make(&m, a->bytes, a->small);
  void **data = rc == 0 ? calloc(m.n, sizeof *data) : NULL;
  if (rc == 0 && !data)
    rc = FERRY_ENOMEM;
  if (rc == 0)
    rc = ferry_ctx_open(&co, &ctx);
  if (rc == 0)
    rc = ferry_refit_sender_open(ctx, a->name, &so, &s);
  if (rc == 0)
    rc = declare_parts(s, &m, a, data);
  if (rc == 0)
    rc = ferry_refit_seal(s);
  if (rc != 0)
    fail("rank", rc);
  if (report(io, (gpeer_report){.rc = rc}) == 0 && rc == 0)
    rc = serve_sender(io, s, NULL, NULL);
  ferry_refit_sender_close(s);
  ferry_ctx_close(ctx);
  for (size_t i = 0; data && i < m.n; i++)
    free(data[i]);
  free(data);
  gmodel_free(&m);
  return rc == 0 ? CLI_OK : CLI_FAIL;
}

/* ---- the funnel: gather to rank 0 over tcp, then one sender pushes ---- */

typedef struct funnel {
  const gmodel *m;
  const rank_args *a;
  void **data; /* rank 0: every whole tensor; others: their pieces */
  int *socks;  /* rank 0: one per other rank (by rank); others: socks[0] to rank 0 */
} funnel;

static int io_all(int fd, void *buf, size_t len, bool sending) {
  uint8_t *p = buf;
  while (len > 0) {
    ssize_t n = sending ? send(fd, p, len, MSG_NOSIGNAL) : recv(fd, p, len, 0);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n, len -= (size_t)n;
  }
  return 0;
}

/* Rank r's pieces, in tensor order: sent by rank r, received by rank 0 into place. */
static int move_pieces(const funnel *f, int r, int fd, bool sending) {
  for (size_t i = 0; i < f->m->n; i++) {
    int64_t start, stop;
    bool whole;
    if (!gmodel_trainer_part(f->m, i, r, f->a->world, &start, &stop, &whole) || whole)
      continue;
    uint64_t row = f->m->desc[i].shape[1] * 4;
    uint8_t *p = f->data[i];
    if (!sending)
      p += (uint64_t)start * row;
    if (io_all(fd, p, (size_t)((uint64_t)(stop - start) * row), sending) != 0) {
      fprintf(stderr, "bench refit funnel: rank %d's pieces: %s\n", r,
              errno ? strerror(errno) : "the peer closed");
      return FERRY_EPEER;
    }
  }
  return 0;
}

typedef struct gather_job {
  const funnel *f;
  int rank, rc;
} gather_job;

static void *gather_one(void *arg) {
  gather_job *j = arg;
  j->rc = move_pieces(j->f, j->rank, j->f->socks[j->rank], false);
  return NULL;
}

/* Before each push: every other rank's pieces into rank 0's whole tensors (a thread per rank,
 * so every link into rank 0 is busy at once); on the others, their pieces to rank 0. */
static int funnel_gather(void *arg) {
  const funnel *f = arg;
  if (f->a->rank != 0)
    return move_pieces(f, f->a->rank, f->socks[0], true);
  int world = f->a->world, rc = 0;
  gather_job jobs[64];
  pthread_t th[64];
  for (int r = 1; r < world; r++) {
    jobs[r] = (gather_job){f, r, 0};
    if (pthread_create(&th[r], NULL, gather_one, &jobs[r]) != 0)
      return FERRY_ESYS;
  }
  for (int r = 1; r < world; r++) {
    pthread_join(th[r], NULL);
    rc = rc ? rc : jobs[r].rc;
  }
  return rc;
}

static int parse_addr(const char *hostport, struct sockaddr_in *sa) {
  char host[64];
  const char *colon = strrchr(hostport, ':');
  if (!colon || (size_t)(colon - hostport) >= sizeof host)
    return -1;
  memcpy(host, hostport, (size_t)(colon - hostport));
  host[colon - hostport] = 0;
  *sa = (struct sockaddr_in){.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
  return inet_pton(AF_INET, host, &sa->sin_addr) == 1 ? 0 : -1;
}

/* Rank 0 accepts one connection from each other rank (each says its rank first); the others
 * connect to it, retrying for 20 s while it comes up. */
static int funnel_connect(funnel *f, const char *addr) {
  struct sockaddr_in sa;
  int world = f->a->world, one = 1;
  if (parse_addr(addr, &sa) != 0)
    return FERRY_EINVAL;
  if (f->a->rank != 0) {
    for (int tries = 0; tries < 2000; tries++, usleep(10000)) {
      int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) {
        f->socks[0] = fd;
        return io_all(fd, (void *)&f->a->rank, sizeof f->a->rank, true) == 0 ? 0 : FERRY_EPEER;
      }
      if (fd >= 0)
        close(fd);
    }
    return FERRY_ECONNECT;
  }
  int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (lfd < 0 || setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      bind(lfd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(lfd, 64) != 0)
    return FERRY_ESYS;
  int rc = 0;
  for (int got = 1; rc == 0 && got < world; got++) {
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC), r = -1;
    if (fd < 0 || io_all(fd, &r, sizeof r, false) != 0 || r < 1 || r >= world || f->socks[r] >= 0)
      rc = FERRY_EPEER;
    else
      f->socks[r] = fd;
  }
  close(lfd);
  return rc;
}

/* Rank 0's whole tensors (its own pieces in place in them); the others' pieces. */
static int funnel_memory(funnel *f) {
  for (size_t i = 0; i < f->m->n; i++) {
    int64_t start, stop;
    bool whole;
    bool holds = gmodel_trainer_part(f->m, i, f->a->rank, f->a->world, &start, &stop, &whole);
    if (f->a->rank == 0)
      start = 0, stop = (int64_t)f->m->desc[i].shape[0];
    else if (!holds || whole)
      continue;
    if (!(f->data[i] = part_alloc(f->m, i, start, stop)))
      return FERRY_ENOMEM;
  }
  return 0;
}

static int funnel_main(const peer_io *io, const rank_args *a, const char *addr) {
  gmodel m;
  ferry_ctx *ctx = NULL;
  ferry_refit_sender *s = NULL;
  int socks[64];
  for (int i = 0; i < 64; i++)
    socks[i] = -1;
  int rc = a->world < 2 || a->world > 64 ? FERRY_EINVAL : gmodel_make(&m, a->bytes, a->small);
  funnel f = {&m, a, rc == 0 ? calloc(m.n, sizeof(void *)) : NULL, socks};
  if (rc == 0 && !f.data)
    rc = FERRY_ENOMEM;
  if (rc == 0)
    rc = funnel_memory(&f);
  if (rc == 0)
    rc = funnel_connect(&f, addr);
  ferry_ctx_opts co = {.size = sizeof co, .name = "bench-funnel"};
  ferry_refit_opts so = {.size = sizeof so, .bucket_bytes = a->bucket, .publish = 1};
  if (rc == 0 && a->rank == 0 && (rc = ferry_ctx_open(&co, &ctx)) == 0)
    rc = ferry_refit_sender_open(ctx, a->name, &so, &s);
  for (size_t i = 0; rc == 0 && s && i < m.n; i++)
    rc = ferry_refit_declare(s, m.name[i], &m.desc[i], f.data[i], FERRY_DTYPE_INVALID);
  if (rc == 0 && s)
    rc = ferry_refit_seal(s);
  if (rc != 0)
    fail("funnel", rc);
  if (report(io, (gpeer_report){.rc = rc}) == 0 && rc == 0)
    rc = serve_sender(io, s, funnel_gather, &f);
  ferry_refit_sender_close(s);
  ferry_ctx_close(ctx);
  for (int i = 0; i < 64; i++)
    if (socks[i] >= 0)
      close(socks[i]);
  for (size_t i = 0; f.data && i < m.n; i++)
    free(f.data[i]);
  free(f.data);
  if (a->world >= 2 && a->world <= 64)
    gmodel_free(&m);
  return rc == 0 ? CLI_OK : CLI_FAIL;
}

/* ---- an engine rank ---- */

/* Binds target `name` to fresh (touched) memory receiving pieces of tensors src[0..n). */
static int engine_bind(ferry_refit_receiver *rx, const gmodel *m, const char *name,
                       const size_t *src, size_t n, int rank, int world, void **mem) {
  ferry_refit_piece pc[3];
  ferry_tensor_desc d = m->desc[src[0]];
  d.shape[0] = 0;
  for (size_t j = 0; j < n; j++) {
    int dim;
    int64_t a, b;
    gmodel_engine_part(m, src[j], rank, world, &dim, &a, &b);
    pc[j] = (ferry_refit_piece){m->name[src[j]], dim, a, b};
    d.shape[0] += dim == 0 ? (uint64_t)(b - a) : m->desc[src[j]].shape[0];
    if (dim == 1)
      d.shape[1] = (uint64_t)(b - a);
  }
  uint64_t bytes = d.shape[0] * d.shape[1] * 4;
  if (!(*mem = malloc(bytes)))
    return FERRY_ENOMEM;
  memset(*mem, 0, bytes); /* an engine's weight memory exists before it loads */
  return ferry_refit_bind_pieces(rx, name, *mem, &d, pc, n);
}

/* TP: q, k and v fused into one target, every other tensor its own. */
static int engine_bind_tp(ferry_refit_receiver *rx, const gmodel *m, int rank, int world,
                          void **mem) {
  int rc = 0;
  for (size_t i = 0; rc == 0 && i < m->n;) {
    bool fused = gmodel_kind(m, i) == GM_Q;
    size_t src[3] = {i, i + 1, i + 2}, n = fused ? 3 : 1;
    char name[64];
    snprintf(name, sizeof name, "%s%s", m->name[i], fused ? "kv" : "");
    rc = engine_bind(rx, m, name, src, n, rank, world, &mem[i]);
    i += n;
  }
  return rc;
}

/* Opens the sender published as `name`, retrying for 30 s while it is not there yet. */
static int engine_open(ferry_ctx *ctx, const char *name, ferry_refit_receiver **rx) {
  int rc = FERRY_ENOTFOUND;
  for (int tries = 0; tries < 300 && rc == FERRY_ENOTFOUND; tries++) {
    rc = ferry_refit_receiver_open(ctx, name, 30000, rx);
    if (rc == FERRY_ENOTFOUND)
      usleep(100000);
  }
  return rc;
}

static int engine_main(const peer_io *io, const char *name, int rank, int world, uint64_t bytes,
                       uint64_t small) {
  gmodel m;
  char node[32];
  snprintf(node, sizeof node, "bench-engine-%d", rank);
  ferry_ctx_opts co = {.size = sizeof co, .name = node};
  ferry_ctx *ctx = NULL;
  ferry_refit_receiver *rx = NULL;
  int rc = gmodel_make(&m, bytes, small);
  void **mem = rc == 0 ? calloc(m.n, sizeof *mem) : NULL;
  if (rc == 0 && !mem)
    rc = FERRY_ENOMEM;
  if (rc == 0)
    rc = ferry_ctx_open(&co, &ctx);
  if (rc == 0)
    rc = engine_open(ctx, name, &rx);
  if (rc == 0)
    rc = world > 1 ? engine_bind_tp(rx, &m, rank, world, mem) : ferry_refit_bind_flat(rx);
  if (rc != 0)
    fail("engine", rc);
  gpeer_cmd c;
  if (report(io, (gpeer_report){.rc = rc}) == 0 && rc == 0)
    while (next_cmd(io, &c) == 0 && c.op == 'w') {
      gpeer_report r = {0};
      r.rc = ferry_refit_wait(rx, c.v, 120000, &r.committed);
      if (r.rc != 0)
        fail("engine wait", r.rc);
      r.bytes_read = ferry_refit_bytes_read(rx);
      if (report(io, r) != 0)
        break;
    }
  ferry_refit_receiver_close(rx);
  ferry_ctx_close(ctx);
  for (size_t i = 0; mem && i < m.n; i++)
    free(mem[i]);
  free(mem);
  gmodel_free(&m);
  return rc == 0 ? CLI_OK : CLI_FAIL;
}

/* argv: refit --group-KIND UP DOWN NAME RANK WORLD BYTES SMALL [BUCKET [GATHER_ADDR]] */
int bench_refit_group_peer(int argc, char **argv) {
  if (argc < 9)
    return CLI_USAGE;
  peer_io io = {atoi(argv[2]), atoi(argv[3])};
  rank_args a = {argv[4],
                 atoi(argv[5]),
                 atoi(argv[6]),
                 strtoull(argv[7], NULL, 10),
                 strtoull(argv[8], NULL, 10),
                 argc > 9 ? strtoull(argv[9], NULL, 10) : 0};
  if (strcmp(argv[1], "--group-engine") == 0)
    return engine_main(&io, a.name, a.rank, a.world, a.bytes, a.small);
  if (strcmp(argv[1], "--group-rank") == 0 && argc == 10)
    return rank_main(&io, &a);
  if (strcmp(argv[1], "--group-funnel") == 0 && argc == 11)
    return funnel_main(&io, &a, argv[10]);
  return CLI_USAGE;
}
