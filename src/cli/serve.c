/*
 * `ferry serve`: a long-lived node for the fleet. Without --directory it hosts the embedded
 * directory on --listen (default: the host:port of FERRY_DIRECTORY, ferry://127.0.0.1:7700);
 * with --directory it joins that one. Either way it is a store node that holds objects for
 * short-lived clients (`ferry put` hands it the bytes). It runs until SIGINT or SIGTERM.
 */
#include "cli/cli.h"
#include "ferry.h"

#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char serve_usage[] =
    "usage: ferry serve [--listen HOST:PORT] [--directory URL] [--name NAME]\n"
    "                   [--capacity BYTES]\n\n"
    "Runs a long-lived node: it hosts the embedded directory on --listen (default: the\n"
    "host:port of FERRY_DIRECTORY, 127.0.0.1:7700), or with --directory joins that one\n"
    "(ferry://HOST:PORT or redis://HOST:PORT[/DB]); and it holds objects that short-lived\n"
    "clients put (`ferry put`), in a pool of --capacity bytes (FERRY_STORE_CAPACITY).\n"
    "Prints one 'ready' line, then runs until SIGINT or SIGTERM.\n";

typedef struct serve_opts {
  const char *listen, *directory, *name;
  uint64_t capacity;
} serve_opts;

static int parse(int argc, char **argv, serve_opts *o) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    bool val = i + 1 < argc;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      fputs(serve_usage, stdout);
      exit(CLI_OK);
    } else if (strcmp(a, "--listen") == 0 && val) {
      o->listen = argv[++i];
    } else if (strcmp(a, "--directory") == 0 && val) {
      o->directory = argv[++i];
    } else if (strcmp(a, "--name") == 0 && val) {
      o->name = argv[++i];
    } else if (strcmp(a, "--capacity") == 0 && val) {
      o->capacity = strtoull(argv[++i], NULL, 0);
    } else {
      fprintf(stderr, "ferry serve: unknown option '%s'\n%s", a, serve_usage);
      return -1;
    }
  }
  return 0;
}

/* The host:port to listen on when hosting: --listen, else FERRY_DIRECTORY's. */
static const char *host_port(const serve_opts *o, char *buf, size_t len) {
  if (o->listen)
    return o->listen;
  const char *url = ferry_config_get("FERRY_DIRECTORY");
  if (strncmp(url, "ferry://", 8) != 0)
    return NULL;
  snprintf(buf, len, "%s", url + 8);
  return buf;
}

static int wait_for_signal(void) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  sigwait(&set, &sig);
  return sig;
}

int cli_serve(int argc, char **argv) {
  serve_opts o = {0};
  if (parse(argc, argv, &o) != 0)
    return CLI_USAGE;
  char buf[256];
  const char *listen = o.directory ? o.listen : host_port(&o, buf, sizeof buf);
  if (!o.directory && !listen) {
    fprintf(stderr, "ferry serve: FERRY_DIRECTORY is not ferry://; give --listen or "
                    "--directory\n");
    return CLI_USAGE;
  }
  /* signals go to sigwait, not to the library's threads */
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, NULL);
  ferry_ctx_opts co = {.size = sizeof co, .name = o.name, .tcp_listen = listen};
  ferry_ctx *ctx;
  int rc = ferry_ctx_open(&co, &ctx);
  if (rc != 0)
    return cli_fail("serve", rc, "cannot start the node");
  ferry_store_opts so = {.size = sizeof so, .directory = o.directory, .capacity = o.capacity};
  so.flags = FERRY_STORE_HOLDER | (o.directory ? 0 : FERRY_STORE_HOST_DIRECTORY);
  ferry_store *store;
  if ((rc = ferry_store_open(ctx, &so, &store)) != 0) {
    ferry_ctx_close(ctx);
    return cli_fail("serve", rc, "cannot open the store");
  }
  if (o.directory)
    printf("ready: node '%s' joined %s (%s)\n", ferry_ctx_name(ctx), o.directory,
           ferry_ctx_address(ctx));
  else
    printf("ready: directory ferry://%s, node '%s' (%s)\n", listen, ferry_ctx_name(ctx),
           ferry_ctx_address(ctx));
  fflush(stdout);
  int sig = wait_for_signal();
  fprintf(stderr, "ferry serve: %s, shutting down\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
  ferry_store_close(store);
  ferry_ctx_close(ctx);
  return CLI_OK;
}
