/*
 * The `ferry` command: dispatches to subcommands (info, bench, ...).
 */
#include "ferry.h"

#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--version") == 0) {
    printf("ferry %s\n", ferry_version());
    return 0;
  }
  fprintf(stderr, "usage: ferry <command> [args]\n");
  return 2;
}
