/*
 * Internal to the `ferry ctl` command: the pieces its text, JSON and HTTP faces share.
 */
#ifndef FR_CLI_CTL_H
#define FR_CLI_CTL_H

#include "ferry.h"

#include <stdio.h>

/* Maps a ferry status to `ferry ctl`'s exit code (cli.h's table; CLI_STATE and CLI_BUSY are
 * ctl's own). */
int ctl_exit_code(int status);
/* Writes the cell's status as one JSON object; the ferry status of reading it. */
int ctl_status_json(FILE *out, ferry_ctl *ctl, const char *name);
/* Parses seconds ("2", "0.5") into milliseconds; -1 when malformed. */
int ctl_parse_seconds(const char *text);

/* `ferry ctl serve NAME --http HOST:PORT [--allow-remote]` (ctl_http.c). */
int ctl_serve(int argc, char **argv);

#endif
