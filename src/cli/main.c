/*
 * The `ferry` command: a table of subcommands, global --help/--version, and the exit-code rules
 * every subcommand shares.
 */
#include "cli/cli.h"
#include "core/core.h"
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
    {"bench", cli_bench,
     "benchmarks against baselines: link, store, refit, control, mq, gpu, directory, all"},
    {"ctl", cli_ctl, "control an engine's weight lifecycle: status, clear, update, serve"},
    {"serve", cli_serve, "run the fleet's directory and hold objects for short-lived clients"},
    {"put", cli_put, "store a file (raw or .npy) under a key"},
    {"get", cli_get, "fetch a key into a file (raw or .npy) or stdout"},
    {"ls", cli_ls, "list keys (by prefix) with dtype, shape, size and owner"},
    {"rm", cli_rm, "delete a key, or every key with a prefix"},
    {"stat", cli_stat, "describe a key"},
    {"top", cli_top, "the fleet in a terminal: nodes, keys, refit, mq, control (--once, --json)"},
    {"gc", cli_gc, "remove what killed processes left in FERRY_CTL_DIR (/dev/shm)"},
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *out) {
  fprintf(out, "usage: ferry <command> [options]\n"
               "       ferry help <command>      (= ferry <command> --help)\n"
               "       ferry --version\n\n"
               "ferry moves tensors between the trainer and the inference engines of RL\n"
               "post-training.\n\ncommands:\n");
  for (size_t i = 0; i < N_COMMANDS; i++)
    fprintf(out, "  %-8s %s\n", commands[i].name, commands[i].summary);
  fprintf(out, "\nEvery command takes -h/--help and --version; options take their value as\n"
               "`--opt VALUE` or `--opt=VALUE`; sizes take K, M, G, T or KiB, MiB, GiB, TiB\n"
               "(powers of 1024). ls, stat, put, get, info, serve and top take --json.\n\n");
  cli_print_exit_codes(out);
  fprintf(out, "\nenvironment: FERRY_* settings, listed by `ferry info --config`\n");
}

/* The long-running servers log at info unless FERRY_LOG says otherwise: their lines (nodes joining
 * and leaving, pushes, failures) are what an operator follows them by, as with etcd or vLLM. The
 * library's own default (warn) suits the trainers and engines it is embedded in. */
void cli_server_logging(void) {
  if (!fr_config_is_set("FERRY_LOG"))
    ferry_log_set_level(FERRY_LOG_INFO);
}

static int dispatch(int argc, char **argv) {
  for (size_t i = 0; i < N_COMMANDS; i++)
    if (strcmp(argv[1], commands[i].name) == 0)
      return commands[i].run(argc - 1, argv + 1);
  fprintf(stderr, "ferry: unknown command '%s' (ferry --help lists them)\n", argv[1]);
  return CLI_USAGE;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return CLI_USAGE;
  }
  if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
      (strcmp(argv[1], "help") == 0 && argc == 2)) {
    usage(stdout);
    return CLI_OK;
  }
  if (strcmp(argv[1], "--version") == 0) {
    printf("ferry %s\n", ferry_version());
    return CLI_OK;
  }
  if (strcmp(argv[1], "help") == 0) { /* `ferry help CMD [SUB]` is `ferry CMD [SUB] --help` */
    if (argc > 4) {
      fprintf(stderr, "ferry help: unexpected argument '%s' (ferry --help)\n", argv[4]);
      return CLI_USAGE;
    }
    char help[] = "--help";
    char *args[] = {argv[0], argv[2], argc == 4 ? argv[3] : help, help, NULL};
    if (argc == 3)
      args[3] = NULL;
    return dispatch(argc, args);
  }
  return dispatch(argc, argv);
}
