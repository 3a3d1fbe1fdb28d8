/*
 * A C refit sender or receiver that finds its peer by name through the directory
 * (ferry_refit_opts.publish, ferry_refit_receiver_open with a bare name), driven line by line on
 * stdin by python/tests/test_refit_names.py, so that a Python receiver is shown to find a C
 * sender and a C receiver a Python sender. Both sides fill and check the same values:
 * version V sends "w" (float32, W_ROWS x W_COLS) with w[i] = V + i / 4 and "ids" (int64, N_IDS)
 * with ids[i] = V * 1000 + i.
 *
 *   refit_peer send NAME   prints "ready"; then "receivers K" -> "ok K" once K attached,
 *                          "push V ROUTE" (auto, direct, chain) -> "pushed V STATUS"
 *   refit_peer recv NAME   prints "attached"; then "wait V" -> "got V ok" when the bytes are
 *                          version V's, "got V bad" when not, "failed V STATUS: ERROR"
 */
#include "ferry.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define W_ROWS 64
#define W_COLS 48
#define N_IDS 100

static float w[W_ROWS * W_COLS];
static int64_t ids[N_IDS];

static void fill(uint64_t v) {
  for (size_t i = 0; i < W_ROWS * W_COLS; i++)
    w[i] = (float)v + (float)i / 4.0f;
  for (size_t i = 0; i < N_IDS; i++)
    ids[i] = (int64_t)v * 1000 + (int64_t)i;
}

static int route_of(const char *s, ferry_refit_route *out) {
  static const char *const names[] = {"auto", "direct", "chain"};
  for (int i = 0; i < 3; i++)
    if (strcmp(s, names[i]) == 0) {
      *out = (ferry_refit_route)i;
      return 0;
    }
  return -1;
}

static void nap_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static int sender(ferry_ctx *ctx, const char *name) {
  ferry_refit_opts so = {.size = sizeof so, .publish = 1};
  ferry_refit_sender *s;
  ferry_tensor_desc wd = {.dtype = FERRY_DTYPE_F32, .ndim = 2, .shape = {W_ROWS, W_COLS}};
  ferry_tensor_desc id = {.dtype = FERRY_DTYPE_I64, .ndim = 1, .shape = {N_IDS}};
  if (ferry_refit_sender_open(ctx, name, &so, &s) != 0 ||
      ferry_refit_declare(s, "w", &wd, w, FERRY_DTYPE_INVALID) != 0 ||
      ferry_refit_declare(s, "ids", &id, ids, FERRY_DTYPE_INVALID) != 0 ||
      ferry_refit_seal(s) != 0) {
    fprintf(stderr, "refit_peer send: %s\n", ferry_last_error());
    return 1;
  }
  printf("ready\n");
  fflush(stdout);
  char line[128], word[32];
  unsigned long long v;
  while (fgets(line, sizeof line, stdin)) {
    ferry_refit_route route = FERRY_REFIT_ROUTE_AUTO;
    if (sscanf(line, "receivers %llu", &v) == 1) {
      for (int i = 0; i < 1000 && ferry_refit_receivers(s) < v; i++)
        nap_ms(10);
      printf("%s %zu\n", ferry_refit_receivers(s) >= v ? "ok" : "fail", ferry_refit_receivers(s));
    } else if (sscanf(line, "push %llu %31s", &v, word) == 2 && route_of(word, &route) == 0) {
      fill(v);
      ferry_refit_push_opts po = {.size = sizeof po, .timeout_ms = 10000, .route = route};
      int rc = ferry_refit_push(s, v, &po);
      printf("pushed %llu %d\n", v, rc);
    } else {
      printf("what: %s", line);
    }
    fflush(stdout);
  }
  ferry_refit_sender_close(s);
  return 0;
}

/* Whether the flat buffer holds version v's values. */
static int holds(ferry_refit_receiver *r, uint64_t v) {
  void *pw, *pi;
  if (ferry_refit_view(r, "w", &pw) != 0 || ferry_refit_view(r, "ids", &pi) != 0)
    return 0;
  fill(v);
  return memcmp(pw, w, sizeof w) == 0 && memcmp(pi, ids, sizeof ids) == 0;
}

static int receiver(ferry_ctx *ctx, const char *name) {
  ferry_refit_receiver *r;
  if (ferry_refit_receiver_open(ctx, name, 10000, &r) != 0 || ferry_refit_bind_flat(r) != 0) {
    fprintf(stderr, "refit_peer recv: %s\n", ferry_last_error());
    return 1;
  }
  printf("attached\n");
  fflush(stdout);
  char line[128];
  unsigned long long v;
  while (fgets(line, sizeof line, stdin)) {
    if (sscanf(line, "wait %llu", &v) != 1) {
      printf("what: %s", line);
    } else {
      int rc = ferry_refit_wait(r, v, 10000, NULL);
      if (rc != 0)
        printf("failed %llu %d: %s\n", v, rc, ferry_last_error());
      else
        printf("got %llu %s\n", v, holds(r, v) ? "ok" : "bad");
    }
    fflush(stdout);
  }
  ferry_refit_receiver_close(r);
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 3 || (strcmp(argv[1], "send") != 0 && strcmp(argv[1], "recv") != 0)) {
    fprintf(stderr, "usage: refit_peer send|recv NAME\n");
    return 2;
  }
  ferry_ctx_opts o = {.size = sizeof o};
  ferry_ctx *ctx;
  if (ferry_ctx_open(&o, &ctx) != 0) {
    fprintf(stderr, "refit_peer: %s\n", ferry_last_error());
    return 1;
  }
  int rc = strcmp(argv[1], "send") == 0 ? sender(ctx, argv[2]) : receiver(ctx, argv[2]);
  ferry_ctx_close(ctx);
  return rc;
}
