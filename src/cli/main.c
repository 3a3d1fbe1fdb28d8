/*
 * The `ferry` command: a table of subcommands, global --help/--version, and the exit-code rules
 * every subcommand shares.
 */
#include "cli/cli.h"
#include "ferry.h"

#include <stdio.h>
#include <string.h>

static const struct {
  const char *name;
  int (*run)(int argc, char **argv);
  const char *summary;
} commands[] = {
    {"demo", cli_demo, "the RL data plane end to end: trainer, two rollouts, three steps"},
    {"info", cli_info, "version, transports and configuration (--config)"},
    {"bench", cli_bench, "benchmarks against baselines: link, store, refit, control, all"},
    {"ctl", cli_ctl, "control an engine's weight lifecycle: status, clear, update, serve"},
    {"serve", cli_serve, "run the fleet's directory and hold objects for short-lived clients"},
    {"put", cli_put, "store a file (raw or .npy) under a key"},
    {"get", cli_get, "fetch a key into a file (raw or .npy) or stdout"},
    {"ls", cli_ls, "list keys (by prefix) with dtype, shape, size and owner"},
    {"rm", cli_rm, "delete a key, or every key with a prefix"},
    {"stat", cli_stat, "describe a key"},
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *out) {
  fprintf(out, "usage: ferry <command> [options]\n\n"
               "ferry moves tensors between the trainer and the inference engines of RL\n"
               "post-training.\n\ncommands:\n");
  for (size_t i = 0; i < N_COMMANDS; i++)
    fprintf(out, "  %-8s %s\n", commands[i].name, commands[i].summary);
  fprintf(out, "\n`ferry <command> --help` describes a command.\n\n"
               "exit status: 0 success, 1 failure, 2 usage error, 3 not found, 4 timed out,\n"
               "             5 peer or connection error\n"
               "environment: FERRY_* settings, listed by `ferry info --config`\n");
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
  const char *detail = ferry_last_error();
  fprintf(stderr, "ferry %s: %s: %s%s%s%s\n", cmd, what, ferry_strerror(status),
          *detail ? " (" : "", detail, *detail ? ")" : "");
  return cli_exit_code(status);
}

int main(int argc, char **argv) {
  if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
      strcmp(argv[1], "help") == 0) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? CLI_USAGE : CLI_OK;
  }
  if (strcmp(argv[1], "--version") == 0) {
    printf("ferry %s\n", ferry_version());
    return CLI_OK;
  }
  for (size_t i = 0; i < N_COMMANDS; i++)
    if (strcmp(argv[1], commands[i].name) == 0)
      return commands[i].run(argc - 1, argv + 1);
  fprintf(stderr, "ferry: unknown command '%s' (ferry --help lists them)\n", argv[1]);
  return CLI_USAGE;
}
