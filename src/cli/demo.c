/*
 * `ferry demo`: the RL data plane end to end on one machine. A trainer process hosts the
 * embedded directory and a refit sender; two rollout processes (this binary again) each run an
 * engine with one control rank, a refit receiver and a store. For three steps the trainer clears
 * each rollout's weights through control, pushes version v, and asks for the update, which a
 * rollout acknowledges only once version v is committed and its weights match the checksum the
 * trainer published in the store. Each rollout then puts the routing-replay tensors of its
 * requests ([layers, tokens, top_k] uint8) in place, and the trainer gets and verifies them all.
 * Prints what moved and how fast next to a memcpy of the same bytes; exits 0 only if every
 * check passed.
 */
#include "cli/args.h"
#include "cli/bench.h"
#include "cli/cli.h"
#include "ferry.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define STEPS 3
#define ROLLOUTS 2
#define REQUESTS 2 /* per rollout and step */
#define DONE_CHANNEL 1
#define LAYERS 45
#define TOKENS 32768
#define TOP_K 8
#define REPLAY_BYTES ((size_t)LAYERS * TOKENS * TOP_K) /* one request's routing-replay tensor */
#define TENSORS 160

static const ferry_tensor_desc routing_desc = {
    .dtype = FERRY_DTYPE_U8, .ndim = 3, .shape = {LAYERS, TOKENS, TOP_K}};

/* ---- shared by both roles ---- */

/* The model at version v: TENSORS float32 matrices whose values depend on v. */
static void model_fill(float **w, const ferry_tensor_desc *d, uint64_t v) {
  for (int i = 0; i < TENSORS; i++)
    for (uint64_t k = 0; k < d[i].shape[0] * d[i].shape[1]; k++)
      w[i][k] = (float)((k + (uint64_t)i * 31 + v * 7) % 997) * 0.01f;
}

static void model_shape(ferry_tensor_desc *d, char (*name)[32]) {
  for (int i = 0; i < TENSORS; i++) {
    uint64_t rows = i % 4 == 3 ? 1 : 256, cols = i % 4 == 3 ? 1024 : 256 + (uint64_t)(i % 3) * 256;
    d[i] = (ferry_tensor_desc){.dtype = FERRY_DTYPE_F32, .ndim = 2, .shape = {rows, cols}};
    snprintf(name[i], sizeof name[0], "layers.%d.%s%d", i / 4, i % 4 == 3 ? "norm" : "w", i % 4);
  }
}

/* One number for a whole model: XXH3 of each tensor, mixed in order. */
static uint64_t model_sum(const void *const *w, const ferry_tensor_desc *d) {
  uint64_t sum = 0;
  for (int i = 0; i < TENSORS; i++)
    sum = sum * 1000003u ^ ferry_checksum(w[i], d[i].shape[0] * d[i].shape[1] * 4);
  return sum;
}

static uint8_t routing_byte(uint64_t step, int rollout, int req, uint64_t k) {
  return (uint8_t)((k * 2654435761u + step * 97 + (uint64_t)rollout * 13 + (uint64_t)req) % 64);
}

static void routing_key(char *buf, size_t len, uint64_t step, int rollout, int req) {
  snprintf(buf, len, "replay/step%llu/rollout%d/req%d", (unsigned long long)step, rollout, req);
}

static int fail(const char *who, int rc, const char *what) {
  fprintf(stderr, "ferry demo (%s): %s: %s (%s)\n", who, what, ferry_strerror(rc),
          ferry_last_error());
  return rc ? rc : FERRY_EPROTO;
}

/* ---- a rollout (helper process) ---- */

typedef struct rollout {
  int index;
  char name[32];
  ferry_store *store;
  ferry_refit_receiver *receiver;
  ferry_link *trainer;
  uint64_t expect; /* the version the next update must bring */
  void *views[TENSORS];
  ferry_tensor_desc desc[TENSORS];
  uint8_t *ids[REQUESTS]; /* routing-replay buffers in ferry memory */
} rollout;

/* The update handler: the rank returns to SERVING only when the weights are version `expect`,
 * whole: wait() fails (and so the update) while they are torn (a failed push, a dead sender). */
static int rollout_update(void *arg) {
  rollout *r = arg;
  int rc = ferry_refit_wait(r->receiver, r->expect, 30000, NULL);
  if (rc != 0)
    return rc;
  char key[64];
  snprintf(key, sizeof key, "policy/v%llu/sum", (unsigned long long)r->expect);
  uint64_t want = 0;
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_U64, .ndim = 1, .shape = {1}};
  rc = ferry_store_get(r->store, key, &d, &want, sizeof want, NULL, -1);
  if (rc == 0 && model_sum((const void *const *)r->views, r->desc) != want)
    rc = FERRY_ECHECKSUM;
  /* the bytes summed must still be that version: a push that began landing meanwhile tears
   * them (committed() says 0), and the rank must not serve them */
  if (rc == 0 && ferry_refit_committed(r->receiver) != r->expect)
    rc = FERRY_ESTALE;
  return rc;
}

/* Puts this step's routing ids. The buffers live in ferry memory (so a put copies nothing) and
 * are reused every step, as an engine reuses its pinned buffers: the trainer deletes a step's
 * keys before it starts the next one. */
static int rollout_generate(rollout *r, uint64_t step) {
  for (int q = 0; q < REQUESTS; q++) {
    uint8_t *ids = r->ids[q];
    for (size_t k = 0; k < LAYERS * TOKENS * TOP_K; k++)
      ids[k] = routing_byte(step, r->index, q, k);
    char key[96];
    routing_key(key, sizeof key, step, r->index, q);
    int rc = ferry_store_put(r->store, key, &routing_desc, ids, 0, -1);
    if (rc != 0)
      return rc;
  }
  struct iovec iov = {&step, sizeof step};
  return ferry_send(r->trainer, DONE_CHANNEL, &iov, 1, -1);
}

static int rollout_main(int index, const char *trainer, const char *directory) {
  rollout r = {.index = index, .expect = 1};
  snprintf(r.name, sizeof r.name, "ferry-demo-rollout-%d", index);
  ferry_ctx_opts co = {.size = sizeof co, .name = r.name + 11};
  ferry_store_opts so = {.size = sizeof so, .directory = directory};
  ferry_ctx *ctx;
  ferry_ctl_cell *cell;
  ferry_ctl_rank *rank;
  int rc = ferry_ctx_open(&co, &ctx);
  if (rc == 0)
    rc = ferry_store_open(ctx, &so, &r.store);
  if (rc == 0)
    rc = ferry_refit_receiver_open(ctx, trainer, -1, &r.receiver);
  if (rc == 0)
    rc = ferry_refit_bind_flat(r.receiver);
  char names[TENSORS][32];
  model_shape(r.desc, names);
  for (int i = 0; rc == 0 && i < TENSORS; i++)
    rc = ferry_refit_view(r.receiver, names[i], &r.views[i]);
  for (int q = 0; rc == 0 && q < REQUESTS; q++)
    rc = ferry_alloc(ctx, LAYERS * TOKENS * TOP_K, (void **)&r.ids[q]);
  if (rc == 0)
    rc = ferry_connect(ctx, trainer, -1, &r.trainer);
  if (rc == 0)
    rc = ferry_ctl_cell_create(r.name, 1, NULL, &cell);
  if (rc == 0)
    rc = ferry_ctl_rank_open(r.name, 0, NULL, &rank);
  if (rc != 0)
    return fail(r.name, rc, "start");
  uint64_t ready = 0;
  struct iovec iov = {&ready, sizeof ready};
  ferry_send(r.trainer, DONE_CHANNEL, &iov, 1, -1);
  ferry_ctl_handlers h = {.size = sizeof h, .update = rollout_update, .arg = &r};
  while (ferry_link_status(r.trainer) == 0) {
    ferry_ctl_command cmd;
    if (ferry_ctl_rank_step(rank, &h, 200, &cmd) != 0 || cmd.cmd != FERRY_CTL_UPDATE)
      continue;
    if (ferry_refit_committed(r.receiver) == r.expect &&
        (rc = rollout_generate(&r, r.expect++)) != 0)
      return fail(r.name, rc, "generate");
  }
  ferry_ctl_rank_close(rank);
  ferry_ctl_cell_close(cell);
  ferry_refit_receiver_close(r.receiver);
  ferry_link_close(r.trainer);
  ferry_store_close(r.store);
  ferry_ctx_close(ctx);
  return 0;
}

/* ---- the trainer ---- */

typedef struct trainer {
  ferry_ctx *ctx;
  ferry_store *store;
  ferry_refit_sender *sender;
  float *w[TENSORS];
  ferry_tensor_desc desc[TENSORS];
  uint64_t model_bytes;
  ferry_ctl *ctl[ROLLOUTS];
  uint8_t *replay; /* where the routing-replay tensors land: ROLLOUTS * REQUESTS of REPLAY_BYTES */
  bench_samples push, control, get, copy_model, copy_replay;
  int checks, failed;
} trainer;

static void check(trainer *t, bool ok, const char *what, uint64_t step) {
  t->checks++;
  if (!ok) {
    t->failed++;
    fprintf(stderr, "ferry demo: step %llu: %s failed: %s\n", (unsigned long long)step, what,
            ferry_last_error());
  }
}

static int trainer_open(trainer *t, char *directory, size_t len) {
  ferry_ctx_opts co = {.size = sizeof co, .name = "trainer"};
  ferry_store_opts so = {.size = sizeof so, .flags = FERRY_STORE_HOST_DIRECTORY};
  int rc = ferry_ctx_open(&co, &t->ctx);
  if (rc == 0)
    rc = ferry_store_open(t->ctx, &so, &t->store);
  if (rc == 0)
    rc = ferry_refit_sender_open(t->ctx, "policy", NULL, &t->sender);
  /* on the heap, not static: a 45 MiB array in .bss is what LeakSanitizer scans at the exit of
   * every ferry process (0.3-0.5 s per command under ASan) */
  if (rc == 0 && !(t->replay = malloc(ROLLOUTS * REQUESTS * REPLAY_BYTES)))
    rc = FERRY_ENOMEM;
  char names[TENSORS][32];
  model_shape(t->desc, names);
  for (int i = 0; rc == 0 && i < TENSORS; i++) {
    uint64_t n = t->desc[i].shape[0] * t->desc[i].shape[1] * 4;
    t->w[i] = malloc(n);
    t->model_bytes += n;
    rc = ferry_refit_declare(t->sender, names[i], &t->desc[i], t->w[i], FERRY_DTYPE_INVALID);
  }
  if (rc == 0)
    rc = ferry_refit_seal(t->sender);
  const char *tcp = strstr(ferry_ctx_address(t->ctx), "tcp://");
  snprintf(directory, len, "ferry://%.*s", tcp ? (int)strcspn(tcp + 6, ",") : 0,
           tcp ? tcp + 6 : "");
  return rc;
}

static int wait_rollouts(trainer *t, uint64_t step) {
  for (int i = 0; i < ROLLOUTS; i++) {
    ferry_msg *m;
    int rc = ferry_recv(t->ctx, DONE_CHANNEL, &m, 60000);
    if (rc != 0)
      return rc;
    bool ok = m->len == sizeof step && memcmp(m->data, &step, sizeof step) == 0;
    ferry_msg_free(m);
    if (!ok)
      return FERRY_EPROTO;
  }
  return 0;
}

static int control_all(trainer *t, ferry_ctl_cmd cmd) {
  for (int i = 0; i < ROLLOUTS; i++) {
    double t0 = bench_now();
    int rc = ferry_ctl_request(t->ctl[i], cmd, 30000);
    bench_add(&t->control, bench_now() - t0);
    if (rc != 0)
      return rc;
  }
  return 0;
}

static void verify_replay(trainer *t, uint64_t step) {
  uint8_t *bufs[ROLLOUTS * REQUESTS];
  ferry_store_item items[ROLLOUTS * REQUESTS];
  char keys[ROLLOUTS * REQUESTS][96];
  for (int i = 0; i < ROLLOUTS * REQUESTS; i++) {
    bufs[i] = t->replay + (size_t)i * REPLAY_BYTES;
    routing_key(keys[i], sizeof keys[i], step, i / REQUESTS, i % REQUESTS);
    items[i] = (ferry_store_item){.key = keys[i], .dst = bufs[i], .cap = REPLAY_BYTES};
  }
  double t0 = bench_now();
  int rc = ferry_store_get_batch(t->store, items, ROLLOUTS * REQUESTS, -1);
  double dt = bench_now() - t0;
  for (int i = 0; i < ROLLOUTS * REQUESTS; i++)
    bench_add(&t->get, dt / (ROLLOUTS * REQUESTS));
  check(t, rc == 0, "getting the routing-replay tensors", step);
  for (int i = 0; rc == 0 && i < ROLLOUTS * REQUESTS; i++) {
    bool same = items[i].status == 0 && items[i].bytes == REPLAY_BYTES;
    for (size_t k = 0; same && k < REPLAY_BYTES; k++)
      same = bufs[i][k] == routing_byte(step, i / REQUESTS, i % REQUESTS, k);
    check(t, same, keys[i], step);
  }
  char prefix[48];
  snprintf(prefix, sizeof prefix, "replay/step%llu/", (unsigned long long)step);
  size_t deleted = 0;
  check(t,
        ferry_store_delete_prefix(t->store, prefix, &deleted, -1) == 0 &&
            deleted == ROLLOUTS * REQUESTS,
        "deleting the step's keys", step);
}

static void baselines(trainer *t) {
  size_t replay = LAYERS * TOKENS * TOP_K;
  uint8_t *dst = malloc(t->model_bytes), *src = malloc(replay);
  memset(src, 1, replay);
  for (int r = 0; r < 5; r++) {
    double t0 = bench_now();
    uint64_t at = 0;
    for (int i = 0; i < TENSORS; i++) {
      uint64_t n = t->desc[i].shape[0] * t->desc[i].shape[1] * 4;
      memcpy(dst + at, t->w[i], n);
      at += n;
    }
    bench_add(&t->copy_model, bench_now() - t0);
    t0 = bench_now();
    memcpy(dst, src, replay);
    __asm__ volatile("" ::"r"(dst) : "memory");
    bench_add(&t->copy_replay, bench_now() - t0);
  }
  free(dst);
  free(src);
}

static int trainer_step(trainer *t, uint64_t step) {
  model_fill(t->w, t->desc, step);
  uint64_t sum = model_sum((const void *const *)t->w, t->desc);
  char key[64];
  snprintf(key, sizeof key, "policy/v%llu/sum", (unsigned long long)step);
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_U64, .ndim = 1, .shape = {1}};
  int rc = ferry_store_put(t->store, key, &d, &sum, FERRY_STORE_PUT_COPY, -1);
  if (rc == 0)
    rc = control_all(t, FERRY_CTL_CLEAR);
  double t0 = bench_now();
  if (rc == 0)
    rc = ferry_refit_push(t->sender, step, NULL);
  bench_add(&t->push, bench_now() - t0);
  check(t, rc == 0, "pushing the weights", step);
  if (rc == 0)
    rc = control_all(t, FERRY_CTL_UPDATE); /* each rank verifies the checksum first */
  check(t, rc == 0, "clear/update through control", step);
  if (rc == 0)
    rc = wait_rollouts(t, step);
  check(t, rc == 0, "rollouts generating", step);
  if (rc == 0)
    verify_replay(t, step);
  return rc;
}

static void row(const char *what, const char *base_name, bench_samples *ferry, bench_samples *base,
                uint64_t bytes) {
  bench_opts o = {0};
  bench_row(&o, "demo", what, base_name, bytes, base, true);
  bench_row(&o, "demo", what, "ferry", bytes, ferry, false);
}

static void summary(trainer *t) {
  printf("\nferry demo: %d steps, %d rollouts; %d checks, %d failed\n", STEPS, ROLLOUTS, t->checks,
         t->failed);
  printf("  refit: %d tensors, %.1f MiB per version, pushed to %d rollouts (shm)\n", TENSORS,
         (double)t->model_bytes / (1 << 20), ROLLOUTS);
  printf("  store: %d routing-replay tensors of [%d, %d, %d] uint8 (%.1f MiB) per step\n",
         ROLLOUTS * REQUESTS, LAYERS, TOKENS, TOP_K, LAYERS * TOKENS * TOP_K / 1048576.0);
  printf("  control: clear and update of each rollout every step (%zu requests)\n", t->control.n);
  bench_opts o = {0};
  bench_header(&o, "what moved, and a memcpy of the same bytes in this process:");
  row("refit-push", "memcpy", &t->push, &t->copy_model, t->model_bytes);
  row("replay-get", "memcpy", &t->get, &t->copy_replay, LAYERS * TOKENS * TOP_K);
  bench_row(&o, "demo", "ctl-request", "ferry", 0, &t->control, true); /* no baseline: its own */
}

static int spawn_rollouts(trainer *t, const char *directory, pid_t *pids) {
  for (int i = 0; i < ROLLOUTS; i++) {
    char index[8];
    snprintf(index, sizeof index, "%d", i);
    fflush(NULL);
    if ((pids[i] = fork()) == 0) {
      execl("/proc/self/exe", "ferry", "demo", "--rollout", index, ferry_ctx_address(t->ctx),
            directory, (char *)NULL);
      _exit(127);
    }
  }
  int rc = wait_rollouts(t, 0); /* each says it is ready */
  for (int i = 0; rc == 0 && i < ROLLOUTS; i++) {
    char name[32];
    snprintf(name, sizeof name, "ferry-demo-rollout-%d", i);
    rc = ferry_ctl_open(name, &t->ctl[i]);
  }
  while (rc == 0 && ferry_refit_receivers(t->sender) < ROLLOUTS)
    usleep(1000);
  return rc;
}

static void trainer_close(trainer *t, pid_t *pids) {
  for (int i = 0; i < ROLLOUTS; i++)
    ferry_ctl_close(t->ctl[i]);
  ferry_refit_sender_close(t->sender);
  ferry_store_close(t->store);
  ferry_ctx_close(t->ctx); /* the rollouts see the trainer gone and stop */
  for (int i = 0; i < ROLLOUTS; i++) {
    int st = 0;
    waitpid(pids[i], &st, 0);
  }
  for (int i = 0; i < TENSORS; i++)
    free(t->w[i]);
  free(t->replay);
}

static const char demo_usage[] =
    "usage: ferry demo\n\n"
    "The RL data plane end to end on this machine: a trainer and two rollout processes; for\n"
    "three steps the trainer clears the rollouts' weights through control, pushes the new\n"
    "version with refit, has the rollouts verify and load it, and gets and verifies the\n"
    "routing-replay tensors they put in the store. Exits 0 only if every check passed.\n";

int cli_demo(int argc, char **argv) {
  if (argc == 5 && strcmp(argv[1], "--rollout") == 0)
    return rollout_main(atoi(argv[2]), argv[3], argv[4]) ? CLI_FAIL : CLI_OK;
  const cli_cmd cmd = {"demo", demo_usage, NULL, 0, 0, NULL};
  if (cli_parse(&cmd, argc, argv, NULL) < 0)
    return CLI_USAGE;
  signal(SIGPIPE, SIG_IGN);
  trainer t;
  memset(&t, 0, sizeof t);
  char directory[128];
  pid_t pids[ROLLOUTS] = {0};
  int rc = trainer_open(&t, directory, sizeof directory);
  if (rc != 0)
    return cli_fail("demo", rc, "starting the trainer");
  if ((rc = spawn_rollouts(&t, directory, pids)) != 0)
    fail("trainer", rc, "starting the rollouts");
  for (uint64_t step = 1; rc == 0 && step <= STEPS; step++)
    rc = trainer_step(&t, step);
  if (rc != 0)
    t.failed++;
  baselines(&t);
  summary(&t);
  trainer_close(&t, pids);
  bench_free(&t.push);
  bench_free(&t.control);
  bench_free(&t.get);
  bench_free(&t.copy_model);
  bench_free(&t.copy_replay);
  printf("%s\n", t.failed ? "ferry demo: FAILED" : "ferry demo: every check passed");
  return t.failed ? CLI_FAIL : CLI_OK;
}
