/*
 * The `ferry` command's subcommands. Each returns the process exit status (see `ferry --help`):
 * 0 success, 1 the operation failed, 2 usage error, 3 not found, 4 timed out, 5 peer/connection.
 */
#ifndef FR_CLI_H
#define FR_CLI_H

enum { CLI_OK = 0, CLI_FAIL = 1, CLI_USAGE = 2, CLI_NOTFOUND = 3, CLI_TIMEOUT = 4, CLI_PEER = 5 };

/* Maps a ferry status to the exit status above. */
int cli_exit_code(int status);
/* Prints "ferry CMD: <what>: <strerror> (<detail>)" on stderr in one line; returns the exit code.
 */
int cli_fail(const char *cmd, int status, const char *what);

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

#endif
