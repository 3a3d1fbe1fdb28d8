/*
 * `ferry info`: the library version, the transports this build has, and with --config every
 * FERRY_* setting with its current value and doc.
 */
#include "cli/cli.h"
#include "transport/ucx.h"
#include "directory/directory.h"
#include "ferry.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void print_config(void) {
  for (size_t i = 0; i < ferry_config_count(); i++) {
    const ferry_config_item *it = ferry_config_at(i);
    char now[FR_DIR_ADDRESS_MAX + 1]; /* a URL's password never reaches the screen */
    fr_url_redact(ferry_config_get(it->name), now, sizeof now);
    if (strcmp(it->name, "FERRY_TOKEN") == 0 && *now)
      snprintf(now, sizeof now, "***");
    printf("%-26s %-14s %s%s%s\n", it->name, *now ? now : "\"\"", it->doc,
           getenv(it->name) ? "" : " (default)", "");
  }
}

/* The directory this node would use, and whether it answers (with how many nodes). */
static void print_directory(void) {
  const char *url = ferry_config_get("FERRY_DIRECTORY");
  char shown[FR_DIR_ADDRESS_MAX + 1];
  fr_url_redact(url, shown, sizeof shown);
  printf("directory:  %s (FERRY_DIRECTORY): ", shown);
  ferry_ctx_opts co = {.size = sizeof co, .name = "ferry-info"};
  ferry_ctx *ctx = NULL;
  fr_dir *dir = NULL;
  int rc = ferry_ctx_open(&co, &ctx);
  if (rc == 0)
    rc = fr_dir_open(ctx, url, 1000, &dir);
  fr_dir_node *nodes = NULL;
  size_t n = 0;
  if (rc == 0)
    rc = dir->ops->node_list(dir->state, &nodes, &n, 1000);
  if (rc == 0)
    printf("up, %zu node%s\n", n, n == 1 ? "" : "s");
  else
    printf("not reachable: %s\n", ferry_last_error());
  free(nodes);
  fr_dir_close(dir);
  ferry_ctx_close(ctx);
}

int cli_info(int argc, char **argv) {
  bool config = false;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--config") == 0) {
      config = true;
    } else if (strcmp(argv[i], "--help") == 0) {
      printf("usage: ferry info [--config]\n\n"
             "Prints the version and transports; --config lists every FERRY_* setting\n"
             "with its current value and what it does.\n");
      return CLI_OK;
    } else {
      fprintf(stderr, "ferry info: unknown option '%s'\n", argv[i]);
      return CLI_USAGE;
    }
  }
  printf("ferry %s\n", ferry_version());
  printf("transports: shm (same host: unix socket + mapped memory), tcp, ucx\n");
  fr_ucx_describe(stdout);
  printf("order:      %s (FERRY_TRANSPORTS)\n", ferry_config_get("FERRY_TRANSPORTS"));
  print_directory();
  if (config)
    print_config();
  return CLI_OK;
}
