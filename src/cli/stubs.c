/*
 * Subcommands whose implementation has not landed yet. Each says so clearly instead of pretending.
 * Remove an entry here when its real implementation lands.
 */
#include "cli/cli.h"

#include <stdio.h>

int cli_ctl(int argc, char **argv) {
  fprintf(stderr, "ferry ctl: not built yet\n");
  return CLI_FAIL;
}

/* `ferry bench control` lives in bench_control.c once the control job lands; remove this then. */
int bench_control(int argc, char **argv) {
  fprintf(stderr, "ferry bench control: not built yet\n");
  return CLI_FAIL;
}
