/*
 * Refit versions sent in parts (ferry_refit_push_opts.part, ferry_refit_set_data): each version's
 * tensors live in fresh memory that is scribbled over and freed once ferry_refit_part_sent says
 * its buckets went, and the receivers must still hold exactly the version's bytes; nothing is
 * committed before the last part; an abandoned version is never reported and spends its number;
 * a receiver that attaches between parts is left out and catches up afterwards; chains and
 * skip_unchanged carry parts; the last part with a tensor not given fails, naming it; and the
 * calls that make no sense while a version is open say so.
 */
// ferry-test: threaded
#include "testutil.h"

#include "refit/refit.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NT 24
#define BUCKET 4096u

typedef struct model {
  float *w[NT]; /* this version's tensors, fresh memory per version */
  ferry_tensor_desc d[NT];
  char name[NT][32];
} model;

static uint64_t elems(const model *m, int i) { return m->d[i].shape[0] * m->d[i].shape[1]; }

static float value(int i, uint64_t k, uint64_t version) {
  return (float)((k * 7 + (uint64_t)i * 13 + version * 101) % 997) - 400.0f;
}

/* Version `version` of the model in new memory (the old is the caller's to free). */
static void model_make(model *m, uint64_t version) {
  for (int i = 0; i < NT; i++) {
    uint64_t rows = 1 + (uint64_t)(i % 3), cols = 31 + (uint64_t)(i * 211) % 900;
    m->d[i] = (ferry_tensor_desc){.dtype = FERRY_DTYPE_F32, .ndim = 2, .shape = {rows, cols}};
    snprintf(m->name[i], sizeof m->name[i], "layer.%d.w", i);
    m->w[i] = malloc(rows * cols * sizeof(float));
    for (uint64_t k = 0; k < rows * cols; k++)
      m->w[i][k] = value(i, k, version);
  }
}

static ferry_ctx *ctx_for(const char *name, const char *transports) {
  ferry_ctx_opts o = {.size = sizeof o, .name = name, .transports = transports};
  ferry_ctx *c;
  FR_OK(ferry_ctx_open(&o, &c));
  return c;
}

static ferry_refit_sender *sender_for(ferry_ctx *c, model *m) {
  ferry_refit_opts o = {.size = sizeof o, .bucket_bytes = BUCKET};
  ferry_refit_sender *s;
  FR_OK(ferry_refit_sender_open(c, "trainer", &o, &s));
  for (int i = 0; i < NT; i++)
    FR_OK(ferry_refit_declare(s, m->name[i], &m->d[i], m->w[i], FERRY_DTYPE_INVALID));
  FR_OK(ferry_refit_seal(s));
  return s;
}

typedef struct engine {
  ferry_ctx *ctx;
  ferry_refit_receiver *r;
  float *mem[NT];
} engine;

static void engine_open(engine *e, const char *name, const char *transports, const char *address,
                        const model *m) {
  e->ctx = ctx_for(name, transports);
  FR_OK(ferry_refit_receiver_open(e->ctx, address, 5000, &e->r));
  for (int i = 0; i < NT; i++) {
    e->mem[i] = calloc(elems(m, i), sizeof(float));
    FR_OK(ferry_refit_bind(e->r, m->name[i], e->mem[i], &m->d[i]));
  }
}

static void engine_close(engine *e) {
  ferry_refit_receiver_close(e->r);
  for (int i = 0; i < NT; i++)
    free(e->mem[i]);
  ferry_ctx_close(e->ctx);
}

/* Every tensor of e holds `version`'s values. */
static void assert_holds(const engine *e, const model *m, uint64_t version) {
  for (int i = 0; i < NT; i++)
    for (uint64_t k = 0; k < elems(m, i); k++)
      if (e->mem[i][k] != value(i, k, version))
        fail_msg("tensor %d element %llu: %g, version %llu has %g", i, (unsigned long long)k,
                 (double)e->mem[i][k], (unsigned long long)version, (double)value(i, k, version));
}

static void await_receivers(ferry_refit_sender *s, size_t n) {
  for (int i = 0; i < 1000 && ferry_refit_receivers(s) != n; i++)
    usleep(10000);
  assert_int_equal(ferry_refit_receivers(s), n);
}

static int push_part(ferry_refit_sender *s, uint64_t version, ferry_refit_part part,
                     ferry_refit_route route, int skip) {
  ferry_refit_push_opts o = {
      .size = sizeof o, .part = part, .route = route, .skip_unchanged = skip, .timeout_ms = 10000};
  return ferry_refit_push(s, version, &o);
}

/* Gives tensors [from, to) of m (set_data) and pushes a part; then scribbles over and frees
 * every tensor of m whose buckets all went (its memory is not read again), *freed counting them. */
static int give_and_push(ferry_refit_sender *s, model *m, uint64_t version, int from, int to,
                         ferry_refit_part part, ferry_refit_route route, int skip, int *freed) {
  for (int i = from; i < to; i++)
    FR_OK(ferry_refit_set_data(s, m->name[i], m->w[i]));
  int rc = push_part(s, version, part, route, skip);
  for (int i = 0; i < NT && rc == 0 && part == FERRY_REFIT_PART_MORE; i++) {
    int sent = ferry_refit_part_sent(s, m->name[i]);
    assert_true(sent == 0 || sent == 1);
    if (i >= to)
      assert_int_equal(sent, 0); /* not given: none of its buckets can have gone */
    if (sent && m->w[i]) {
      memset(m->w[i], 0x7f, elems(m, i) * sizeof(float));
      free(m->w[i]);
      m->w[i] = NULL;
      (*freed)++;
    }
  }
  return rc;
}

static void model_free(model *m) {
  for (int i = 0; i < NT; i++) {
    free(m->w[i]);
    m->w[i] = NULL;
  }
}

/* Version 1 pushed whole to every receiver attached (n of them). */
static void first_version(ferry_refit_sender *s, engine *e, size_t n, model *m) {
  await_receivers(s, n);
  FR_OK(ferry_refit_push(s, 1, NULL));
  for (size_t j = 0; j < n; j++) {
    FR_OK(ferry_refit_wait(e[j].r, 1, 10000, NULL));
    assert_holds(&e[j], m, 1);
  }
  model_free(m);
}

/* Versions 2 and 3 in three parts each, to two receivers: nothing is committed before the last
 * part, though bytes landed; freed tensors were not read again; the plan is reused. */
static void parts_to_two(ferry_refit_route route, const char *transports) {
  model m;
  model_make(&m, 1);
  ferry_ctx *sc = ctx_for("trainer", transports);
  ferry_refit_sender *s = sender_for(sc, &m);
  engine e[2];
  engine_open(&e[0], "rollout-0", transports, ferry_ctx_address(sc), &m);
  engine_open(&e[1], "rollout-1", transports, ferry_ctx_address(sc), &m);
  first_version(s, e, 2, &m);
  uint64_t forwarded = fr_refit_stat_forwarded;
  for (uint64_t v = 2; v <= 3; v++) {
    model_make(&m, v);
    int freed = 0;
    FR_OK(give_and_push(s, &m, v, 0, NT / 3, FERRY_REFIT_PART_MORE, route, 0, &freed));
    for (int j = 0; j < 2; j++) /* its first buckets landed over v - 1: neither version */
      assert_int_equal(ferry_refit_committed(e[j].r), 0);
    FR_OK(give_and_push(s, &m, v, NT / 3, 2 * NT / 3, FERRY_REFIT_PART_MORE, route, 0, &freed));
    assert_true(freed > 0);
    FR_OK(give_and_push(s, &m, v, 2 * NT / 3, NT, FERRY_REFIT_PART_LAST, route, 0, &freed));
    for (int j = 0; j < 2; j++) {
      FR_OK(ferry_refit_wait(e[j].r, v, 10000, NULL));
      assert_int_equal(ferry_refit_committed(e[j].r), v);
      assert_holds(&e[j], &m, v);
    }
    model_free(&m);
  }
  if (route == FERRY_REFIT_ROUTE_CHAIN)
    assert_true(fr_refit_stat_forwarded > forwarded); /* the second read from the first */
  engine_close(&e[0]);
  engine_close(&e[1]);
  ferry_refit_sender_close(s);
  ferry_ctx_close(sc);
}

static void test_parts_shm(void **st) { parts_to_two(FERRY_REFIT_ROUTE_AUTO, "shm,tcp"); }
static void test_parts_chain_tcp(void **st) { parts_to_two(FERRY_REFIT_ROUTE_CHAIN, "tcp"); }

typedef struct outcome {
  pthread_mutex_t lock;
  uint64_t version;
  int status;
  char why[256];
} outcome;

static void on_commit(ferry_refit_receiver *r, uint64_t version, int status, const char *why,
                      void *arg) {
  outcome *o = arg;
  pthread_mutex_lock(&o->lock);
  o->version = version;
  o->status = status;
  snprintf(o->why, sizeof o->why, "%s", why ? why : "");
  pthread_mutex_unlock(&o->lock);
}

/* A version abandoned after a part: its receiver says why, never reports it (its bytes are torn),
 * the number is spent, and the next version lands whole. */
static void test_parts_abort(void **st) {
  model m;
  model_make(&m, 1);
  ferry_ctx *sc = ctx_for("trainer", "shm,tcp");
  ferry_refit_sender *s = sender_for(sc, &m);
  engine e;
  engine_open(&e, "rollout", "shm,tcp", ferry_ctx_address(sc), &m);
  outcome o = {.lock = PTHREAD_MUTEX_INITIALIZER};
  ferry_refit_on_commit(e.r, on_commit, &o);
  first_version(s, &e, 1, &m);
  model_make(&m, 2);
  int freed = 0;
  FR_OK(
      give_and_push(s, &m, 2, 0, NT / 2, FERRY_REFIT_PART_MORE, FERRY_REFIT_ROUTE_AUTO, 0, &freed));
  FR_OK(push_part(s, 2, FERRY_REFIT_PART_ABORT, FERRY_REFIT_ROUTE_AUTO, 0));
  for (int i = 0; i < 500; i++) { /* the abandonment reaches the receiver */
    pthread_mutex_lock(&o.lock);
    bool told = o.version == 2;
    pthread_mutex_unlock(&o.lock);
    if (told)
      break;
    usleep(10000);
  }
  pthread_mutex_lock(&o.lock);
  assert_int_equal(o.version, 2);
  assert_int_equal(o.status, FERRY_ECLOSED);
  assert_non_null(strstr(o.why, "abandoned"));
  pthread_mutex_unlock(&o.lock);
  assert_int_equal(ferry_refit_committed(e.r), 0);
  assert_int_not_equal(ferry_refit_wait(e.r, 2, 300, NULL), 0);
  FR_OK(push_part(s, 2, FERRY_REFIT_PART_ABORT, FERRY_REFIT_ROUTE_AUTO, 0)); /* none open: 0 */
  assert_int_equal(ferry_refit_push(s, 2, NULL), FERRY_EINVAL);              /* 2 is spent */
  assert_non_null(strstr(ferry_last_error(), "parts"));
  model_free(&m);
  model_make(&m, 3); /* a whole push after it: every tensor given by set_data */
  for (int i = 0; i < NT; i++)
    FR_OK(ferry_refit_set_data(s, m.name[i], m.w[i]));
  ferry_refit_push_opts po = {.size = sizeof po, .skip_unchanged = 1, .timeout_ms = 10000};
  FR_OK(ferry_refit_push(s, 3, &po)); /* skips nothing: the receiver's bytes are torn */
  FR_OK(ferry_refit_wait(e.r, 3, 10000, NULL));
  assert_holds(&e, &m, 3);
  model_free(&m);
  engine_close(&e);
  ferry_refit_sender_close(s);
  ferry_ctx_close(sc);
}

/* A receiver that attaches between two parts is not in the version: it catches up to it from the
 * sender's retained copy once the last part committed it at the other one. */
static void test_parts_late_receiver(void **st) {
  model m;
  model_make(&m, 1);
  ferry_ctx *sc = ctx_for("trainer", "shm,tcp");
  ferry_refit_sender *s = sender_for(sc, &m);
  engine e[2];
  engine_open(&e[0], "rollout-0", "shm,tcp", ferry_ctx_address(sc), &m);
  first_version(s, e, 1, &m);
  model_make(&m, 2);
  int freed = 0;
  FR_OK(
      give_and_push(s, &m, 2, 0, NT / 2, FERRY_REFIT_PART_MORE, FERRY_REFIT_ROUTE_AUTO, 0, &freed));
  engine_open(&e[1], "rollout-1", "shm,tcp", ferry_ctx_address(sc), &m);
  await_receivers(s, 2);
  FR_OK(give_and_push(s, &m, 2, NT / 2, NT, FERRY_REFIT_PART_LAST, FERRY_REFIT_ROUTE_AUTO, 0,
                      &freed));
  for (int j = 0; j < 2; j++) {
    FR_OK(ferry_refit_wait(e[j].r, 2, 10000, NULL));
    assert_holds(&e[j], &m, 2);
  }
  model_free(&m);
  engine_close(&e[0]);
  engine_close(&e[1]);
  ferry_refit_sender_close(s);
  ferry_ctx_close(sc);
}

/* skip_unchanged per bucket across parts: half the tensors keep version 1's values. */
static void test_parts_skip_unchanged(void **st) {
  model m;
  model_make(&m, 1);
  ferry_ctx *sc = ctx_for("trainer", "shm,tcp");
  ferry_refit_sender *s = sender_for(sc, &m);
  engine e;
  engine_open(&e, "rollout", "shm,tcp", ferry_ctx_address(sc), &m);
  first_version(s, &e, 1, &m);
  model_make(&m, 1); /* version 2 = version 1's values, in new memory */
  int freed = 0;
  FR_OK(
      give_and_push(s, &m, 2, 0, NT / 2, FERRY_REFIT_PART_MORE, FERRY_REFIT_ROUTE_AUTO, 1, &freed));
  assert_int_equal(ferry_refit_committed(e.r), 1); /* every bucket unchanged: nothing landed */
  FR_OK(give_and_push(s, &m, 2, NT / 2, NT, FERRY_REFIT_PART_LAST, FERRY_REFIT_ROUTE_AUTO, 1,
                      &freed));
  FR_OK(ferry_refit_wait(e.r, 2, 10000, NULL));
  assert_holds(&e, &m, 1);
  model_free(&m);
  engine_close(&e);
  ferry_refit_sender_close(s);
  ferry_ctx_close(sc);
}

/* What a part refuses, and the last part with a tensor not given. */
static void test_parts_errors(void **st) {
  model m;
  model_make(&m, 1);
  ferry_ctx *sc = ctx_for("trainer", "shm,tcp");
  ferry_refit_sender *s = sender_for(sc, &m);
  engine e;
  engine_open(&e, "rollout", "shm,tcp", ferry_ctx_address(sc), &m);
  first_version(s, &e, 1, &m);
  assert_int_equal(ferry_refit_set_data(s, "nope", &m), FERRY_ENOTFOUND);
  assert_int_equal(ferry_refit_part_sent(s, "nope"), FERRY_ENOTFOUND);
  assert_int_equal(ferry_refit_part_sent(s, m.name[0]), 0); /* no version open */
  const char *only[] = {m.name[0]};
  ferry_refit_push_opts o = {
      .size = sizeof o, .only = only, .n_only = 1, .part = FERRY_REFIT_PART_MORE};
  assert_int_equal(ferry_refit_push(s, 2, &o), FERRY_EINVAL);
  o = (ferry_refit_push_opts){.size = sizeof o, .part = (ferry_refit_part)7};
  assert_int_equal(ferry_refit_push(s, 2, &o), FERRY_EINVAL);
  model_make(&m, 2);
  int freed = 0;
  FR_OK(
      give_and_push(s, &m, 2, 0, NT / 2, FERRY_REFIT_PART_MORE, FERRY_REFIT_ROUTE_AUTO, 0, &freed));
  assert_int_equal(ferry_refit_push(s, 2, NULL), FERRY_ESTATE); /* a whole push: not now */
  assert_int_equal(push_part(s, 3, FERRY_REFIT_PART_MORE, FERRY_REFIT_ROUTE_AUTO, 0),
                   FERRY_EINVAL); /* another version's part */
  assert_int_equal(ferry_refit_seal(s), FERRY_ESTATE);
  /* the last part, tensor NT - 1 never given */
  assert_int_equal(give_and_push(s, &m, 2, NT / 2, NT - 1, FERRY_REFIT_PART_LAST,
                                 FERRY_REFIT_ROUTE_AUTO, 0, &freed),
                   FERRY_ESTATE);
  assert_non_null(strstr(ferry_last_error(), m.name[NT - 1]));
  uint64_t v = 99;
  assert_int_not_equal(ferry_refit_wait(e.r, 2, 300, &v), 0);
  assert_int_equal(ferry_refit_committed(e.r), 0); /* abandoned over version 1: torn */
  model_free(&m);
  model_make(&m, 3); /* and the next version, in one part, lands */
  FR_OK(give_and_push(s, &m, 3, 0, NT, FERRY_REFIT_PART_LAST, FERRY_REFIT_ROUTE_AUTO, 0, &freed));
  FR_OK(ferry_refit_wait(e.r, 3, 10000, NULL));
  assert_holds(&e, &m, 3);
  model_free(&m);
  engine_close(&e);
  ferry_refit_sender_close(s);
  ferry_ctx_close(sc);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parts_shm),
      cmocka_unit_test(test_parts_chain_tcp),
      cmocka_unit_test(test_parts_abort),
      cmocka_unit_test(test_parts_late_receiver),
      cmocka_unit_test(test_parts_skip_unchanged),
      cmocka_unit_test(test_parts_errors),
  };
  tu_filter();
  return cmocka_run_group_tests(tests, NULL, NULL);
}
