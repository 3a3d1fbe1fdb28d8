/*
 * The `ferry` command's one argument parser, shared by every subcommand: a subcommand declares
 * its options as a table (cli_opt) and its operands as a count (cli_cmd), and cli_parse does the
 * rest with getopt_long: `--opt value` and `--opt=value`, -h/--help and --version everywhere,
 * values checked as they are read (sizes, integers, seconds), and a one-line usage error for
 * anything it does not know. Also the JSON string writer every --json output uses.
 */
#ifndef FR_CLI_ARGS_H
#define FR_CLI_ARGS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

typedef enum cli_arg_kind {
  CLI_ARG_FLAG,    /* bool *: set to true; takes no value */
  CLI_ARG_STR,     /* const char **: the value as given */
  CLI_ARG_SIZE,    /* uint64_t *: bytes (cli_parse_size), within [min, max] */
  CLI_ARG_INT,     /* int *: a decimal integer >= 0, within [min, max] */
  CLI_ARG_SECONDS, /* int *: seconds ("2", "0.5", at most a day) as milliseconds */
} cli_arg_kind;

typedef struct cli_opt {
  const char *name; /* the long name without "--"; NULL ends a table */
  cli_arg_kind kind;
  void *target;
  uint64_t min, max; /* bounds of SIZE and INT; max 0: no upper bound */
} cli_opt;

typedef struct cli_cmd {
  const char *name;     /* "ls", "ctl engine": errors say "ferry NAME: ..." */
  const char *usage;    /* the --help text; the exit-code table is appended to it */
  const char *operands; /* what a missing-operand error names ("KEY FILE"); NULL: none */
  int min_operands, max_operands;
  const cli_opt *opts; /* ends with a row whose name is NULL; NULL: no options */
} cli_cmd;

/* Parses argv[1..argc-1] (argv[0] is the subcommand's name) against cmd. Options and operands
 * may come in any order; "--" ends the options. -h/--help prints the usage on stdout and
 * --version the version, and both exit 0. Returns the number of operands, which *operands
 * then points at (in their order), or -1 after a one-line usage error on stderr. */
int cli_parse(const cli_cmd *cmd, int argc, char **argv, char ***operands);
/* Prints cmd's usage and the exit-code table. */
void cli_help(const cli_cmd *cmd, FILE *out);
/* Prints "ferry NAME: <message> (ferry NAME --help)" on stderr; returns CLI_USAGE. */
int cli_usage_error(const cli_cmd *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Bytes: digits with an optional fraction and unit: none or B, K/KiB, M/MiB, G/GiB, T/TiB (powers
 * of 1024; letters in any case). "4096", "64K", "1.5GiB". 0 or -1 when malformed or too big
 * (a sign, spaces, an unknown unit, a fraction of a byte, more than 2^64-1). */
int cli_parse_size(const char *text, uint64_t *bytes);
/* Seconds ("2", "0.5", 0..86400) as milliseconds; -1 when malformed. */
int cli_parse_seconds(const char *text);

/* Writes s as a JSON string literal: quotes, backslashes and control bytes escaped, and bytes
 * that are not UTF-8 written as U+FFFD, so the output always parses. */
void cli_json_string(FILE *out, const char *s);

#endif
