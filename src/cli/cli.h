/*
 * The `ferry` command's subcommands, and the one table of exit statuses they all share (printed
 * by `ferry --help` and at the end of every subcommand's --help).
 */
#ifndef FR_CLI_H
#define FR_CLI_H

#include <stdio.h>

/* Every exit status any subcommand returns; cli_exit_meaning[] says what each means. */
enum {
  CLI_OK = 0,
  CLI_FAIL = 1,
  CLI_USAGE = 2,
  CLI_NOTFOUND = 3,
  CLI_TIMEOUT = 4,
  CLI_PEER = 5,
  CLI_STATE = 6, /* ferry ctl: invalid transition */
  CLI_BUSY = 7,  /* ferry ctl: another command in flight; nothing was issued */
  CLI_NEXIT
};
extern const char *const cli_exit_meaning[CLI_NEXIT];
/* Prints "exit status:" and one line per code. */
void cli_print_exit_codes(FILE *out);

/* Maps a ferry status to the exit status above. */
int cli_exit_code(int status);
/* Prints "ferry CMD: <what>: <strerror> (<detail>)" on stderr in one line; returns the exit code.
 */
int cli_fail(const char *cmd, int status, const char *what);

/* `ferry serve` and `ferry ctl serve`: log at info unless FERRY_LOG is set. */
void cli_server_logging(void);

int cli_info(int argc, char **argv);
int cli_bench(int argc, char **argv);
int cli_ctl(int argc, char **argv);
int cli_demo(int argc, char **argv);
int cli_serve(int argc, char **argv);
int cli_put(int argc, char **argv);
int cli_get(int argc, char **argv);
int cli_ls(int argc, char **argv);
int cli_rm(int argc, char **argv);
int cli_stat(int argc, char **argv);
int cli_gc(int argc, char **argv);
int cli_top(int argc, char **argv);

#endif
