/*
 * File plumbing for the store commands: a progress bar for big transfers on a terminal and the
 * short-lived node every store command opens. (.npy files: npy.h.)
 */
#ifndef FR_CLI_STORE_IO_H
#define FR_CLI_STORE_IO_H

#include "ferry.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#define CLI_PROGRESS_MIN (100ull * 1000 * 1000) /* transfers above this show a bar on a tty */

typedef struct cli_progress {
  const char *what;
  uint64_t total;
  bool on;
  int last_pct;
} cli_progress;

void cli_progress_start(cli_progress *p, const char *what, uint64_t total);
void cli_progress_update(void *p, uint64_t done, uint64_t total);
void cli_progress_end(cli_progress *p);

bool cli_has_suffix(const char *s, const char *suffix);

/* A short-lived node that talks to the fleet's directory: ctx + delegating store. */
typedef struct cli_node {
  ferry_ctx *ctx;
  ferry_store *store;
} cli_node;
int cli_node_open(cli_node *n, const char *directory, const char *cmd);
void cli_node_close(cli_node *n);

#endif
