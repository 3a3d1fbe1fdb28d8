/*
 * Helpers of the store commands (store_io.h): the terminal progress bar and the short-lived
 * node every store command opens (a context plus a store that hands its puts to a holder,
 * `ferry serve`, so they outlive the command). The .npy format lives in npy.c.
 */
#include "cli/store_io.h"
#include "cli/cli.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void cli_progress_start(cli_progress *p, const char *what, uint64_t total) {
  *p = (cli_progress){.what = what, .total = total, .last_pct = -1};
  p->on = total > CLI_PROGRESS_MIN && isatty(STDERR_FILENO);
  cli_progress_update(p, 0, total);
}

void cli_progress_update(void *arg, uint64_t done, uint64_t total) {
  cli_progress *p = arg;
  if (!p->on || total == 0)
    return;
  int pct = (int)(done * 100 / total);
  if (pct == p->last_pct)
    return;
  p->last_pct = pct;
  char bar[41];
  int fill = pct * 40 / 100;
  for (int i = 0; i < 40; i++)
    bar[i] = i < fill ? '#' : ' ';
  bar[40] = '\0';
  fprintf(stderr, "\r%s [%s] %3d%% %llu/%llu MiB", p->what, bar, pct,
          (unsigned long long)(done >> 20), (unsigned long long)(total >> 20));
  fflush(stderr);
}

void cli_progress_end(cli_progress *p) {
  if (p->on)
    fputc('\n', stderr);
}

bool cli_has_suffix(const char *s, const char *suffix) {
  size_t n = strlen(s), m = strlen(suffix);
  return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* ---- the short-lived node ---- */

int cli_node_open(cli_node *n, const char *directory, const char *cmd) {
  char name[64];
  snprintf(name, sizeof name, "cli-%ld", (long)getpid());
  ferry_ctx_opts co = {.size = sizeof co, .name = name};
  *n = (cli_node){0};
  int rc = ferry_ctx_open(&co, &n->ctx);
  if (rc != 0)
    return cli_fail(cmd, rc, "cannot open a context");
  ferry_store_opts so = {.size = sizeof so, .directory = directory, .flags = FERRY_STORE_DELEGATE};
  rc = ferry_store_open(n->ctx, &so, &n->store);
  if (rc != 0) {
    ferry_ctx_close(n->ctx);
    return cli_fail(cmd, rc, "cannot reach the directory");
  }
  return 0;
}

void cli_node_close(cli_node *n) {
  ferry_store_close(n->store);
  ferry_ctx_close(n->ctx);
}
