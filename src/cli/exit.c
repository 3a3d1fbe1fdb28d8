/*
 * The exit statuses every `ferry` subcommand shares, and the one-line failure report that maps a
 * ferry status onto them. Apart from main.c so that the benchmarks (bench/, their own executable
 * behind `ferry bench`) print the same table and exit the same way as the ferry command.
 */
#include "cli/cli.h"
#include "core/core.h"
#include "ferry.h"

#include <stdio.h>

const char *const cli_exit_meaning[CLI_NEXIT] = {
    [CLI_OK] = "success",
    [CLI_FAIL] = "the operation failed (ctl: a rank reported failure, or the command was aborted)",
    [CLI_USAGE] = "usage error: an unknown option, a bad value (a dtype ferry or .npy has no\n"
                  "     type for, from an option or a .npy header), a missing or extra argument",
    [CLI_NOTFOUND] = "not found: no such key, file or control cell",
    [CLI_TIMEOUT] = "timed out",
    [CLI_PEER] = "peer or connection error: the directory, a key's owner, a rank or the engine\n"
                 "     is unreachable or dead (ctl: or the cell is stale)",
    [CLI_STATE] = "ctl: invalid transition (e.g. update while serving)",
    [CLI_BUSY] = "ctl: busy: another command is in flight or another controller won the race;\n"
                 "     nothing was issued",
};

void cli_print_exit_codes(FILE *out) {
  fprintf(out, "exit status (every command; errors are one line on stderr):\n");
  for (int i = 0; i < CLI_NEXIT; i++)
    fprintf(out, "  %d  %s\n", i, cli_exit_meaning[i]);
}

int cli_exit_code(int status) {
  switch (status) {
  case FERRY_OK:
    return CLI_OK;
  case FERRY_EINVAL:
    return CLI_USAGE;
  case FERRY_ENOTFOUND:
    return CLI_NOTFOUND;
  case FERRY_ETIMEDOUT:
    return CLI_TIMEOUT;
  case FERRY_EPEER:
  case FERRY_ECONNECT:
  case FERRY_EAUTH:
    return CLI_PEER;
  default:
    return CLI_FAIL;
  }
}

int cli_fail(const char *cmd, int status, const char *what) {
  const char *detail = ferry_last_error(); /* escaped already (core/status.c) */
  char safe[4 * 256 + 1]; /* a key or a name, perhaps copied from a peer's: escaped too */
  fr_escape(safe, sizeof safe, what);
  fprintf(stderr, "ferry %s: %s: %s%s%s%s\n", cmd, safe, ferry_strerror(status),
          *detail ? " (" : "", detail, *detail ? ")" : "");
  return cli_exit_code(status);
}
