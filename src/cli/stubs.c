/*
 * Subcommands whose implementation has not landed yet. Each says so clearly instead of pretending.
 * Remove an entry here when its real implementation lands.
 */
#include "cli/cli.h"

#include <stdio.h>

int cli_bench(int argc, char **argv) {
  fprintf(stderr, "ferry bench: not built yet\n");
  return CLI_FAIL;
}

int cli_ctl(int argc, char **argv) {
  fprintf(stderr, "ferry ctl: not built yet\n");
  return CLI_FAIL;
}
