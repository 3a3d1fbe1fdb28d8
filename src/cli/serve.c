/*
 * `ferry serve`: a long-lived node for the fleet. Without --directory it hosts the embedded
 * directory on --listen (default: the host:port of FERRY_DIRECTORY, ferry://127.0.0.1:7700);
 * with --directory, or when FERRY_DIRECTORY is a redis:// or etcd:// URL (a directory it cannot
 * host), it
 * joins that one, listening where the directory's other hosts can reach it. Either way it is a
 * store node that holds objects for short-lived clients (`ferry put` hands it the bytes). It runs
 * until SIGINT or SIGTERM.
 */
#include "cli/args.h"
#include "cli/cli.h"
#include "cli/fleet.h"
#include "core/core.h"
#include "directory/directory.h"
#include "ferry.h"
#include "transport/ctxcalls.h"

#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char serve_usage[] =
    "usage: ferry serve [--listen HOST:PORT] [--directory URL] [--name NAME]\n"
    "                   [--capacity BYTES] [--http HOST:PORT|off] [--json]\n\n"
    "Runs a long-lived node: it hosts the embedded directory on --listen (default: the\n"
    "host:port of FERRY_DIRECTORY, 127.0.0.1:7700), or with --directory (or a redis://\n"
    "FERRY_DIRECTORY) joins that one (ferry://HOST:PORT, a bare HOST:PORT,\n"
    "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] or etcd://HOST[:PORT][,HOST[:PORT]...]);\n"
    "and it holds objects that short-lived\n"
    "clients put (`ferry put`), in a pool of --capacity bytes (default FERRY_STORE_CAPACITY;\n"
    "K, M, G, T or KiB, MiB, GiB, TiB suffixes).\n"
    "It serves its metrics (Prometheus text at /metrics, /healthz, /readyz), the fleet's\n"
    "status page (/) and its data (/v1/fleet, JSON; `ferry top` shows the same) over HTTP on\n"
    "--http (default: 127.0.0.1 and the port after the node's --listen port, 7701 for the\n"
    "default 7700, so that a restart serves at the same address; a free port, with a warning,\n"
    "when that one is taken; FERRY_METRICS_LISTEN when set; off: none); the ready line says\n"
    "where.\n"
    "Prints one 'ready' line, then runs until SIGINT or SIGTERM. With --json that line is\n"
    "one JSON object: {\"ready\": true, \"directory\", \"hosting\", \"node\", \"address\",\n"
    "\"capacity\" (the pool's bytes), \"metrics\" (its URL, or null), \"status\" (the status\n"
    "page's URL, or null)}.\n";

typedef struct serve_opts {
  const char *listen, *directory, *name, *http;
  uint64_t capacity;
  bool json;
} serve_opts;

static int parse(int argc, char **argv, serve_opts *o) {
  const cli_opt opts[] = {{"listen", CLI_ARG_STR, &o->listen, 0, 0},
                          {"directory", CLI_ARG_STR, &o->directory, 0, 0},
                          {"name", CLI_ARG_STR, &o->name, 0, 0},
                          {"capacity", CLI_ARG_SIZE, &o->capacity, 1, 0},
                          {"json", CLI_ARG_FLAG, &o->json, 0, 0},
                          {"http", CLI_ARG_STR, &o->http, 0, 0},
                          {0}};
  const cli_cmd cmd = {"serve", serve_usage, NULL, 0, 0, opts};
  return cli_parse(&cmd, argc, argv, NULL) < 0 ? -1 : 0;
}

/* The one line that says the node is up: text, or with --json one object. */
static void print_ready(const serve_opts *o, ferry_ctx *ctx, const char *listen,
                        const char *metrics, bool page) {
  char url[FR_DIR_ADDRESS_MAX + 1]; /* a URL's password never reaches the screen */
  if (o->directory)
    fr_url_redact(o->directory, url, sizeof url);
  else
    snprintf(url, sizeof url, "ferry://%s", listen);
  if (o->json) {
    printf("{\"ready\":true,\"directory\":");
    cli_json_string(stdout, url);
    printf(",\"hosting\":%s,\"node\":", o->directory ? "false" : "true");
    cli_json_string(stdout, ferry_ctx_name(ctx));
    printf(",\"address\":");
    cli_json_string(stdout, ferry_ctx_address(ctx));
    uint64_t cap = o->capacity ? o->capacity : (uint64_t)fr_config_int("FERRY_STORE_CAPACITY");
    printf(",\"capacity\":%llu,\"metrics\":", (unsigned long long)cap);
    if (metrics && page)
      printf("\"http://%s/metrics\",\"status\":\"http://%s/\"}\n", metrics, metrics);
    else if (metrics)
      printf("\"http://%s/metrics\",\"status\":null}\n", metrics);
    else
      printf("null,\"status\":null}\n");
  } else if (o->directory) {
    printf("ready: node '%s' joined %s (%s)", ferry_ctx_name(ctx), url, ferry_ctx_address(ctx));
  } else {
    printf("ready: directory %s, node '%s' (%s)", url, ferry_ctx_name(ctx), ferry_ctx_address(ctx));
  }
  if (!o->json && metrics)
    printf("; metrics http://%s/metrics", metrics);
  if (!o->json && metrics && page)
    printf("; status page http://%s/", metrics);
  if (!o->json)
    printf("\n");
  fflush(stdout);
}

/* Without --directory: the host:port to host the directory on (--listen, else
 * FERRY_DIRECTORY's ferry:// host:port); NULL when FERRY_DIRECTORY names a directory this node
 * cannot host (redis://), which it then joins as if given --directory. */
static const char *host_port(serve_opts *o, char *buf, size_t len) {
  if (o->listen)
    return o->listen;
  char bare[FR_DIR_ADDRESS_MAX + 16];
  const char *url = fr_dir_url_normal(ferry_config_get("FERRY_DIRECTORY"), bare, sizeof bare);
  if (strncmp(url, "ferry://", 8) != 0) {
    o->directory = url;
    return NULL;
  }
  fr_str_copy(buf, len, url + 8);
  return buf;
}

/* Joining: the tcp listener's address. A loopback FERRY_TCP_LISTEN (the default) with a
 * directory on another host would register an address its peers cannot dial: listen on the
 * interface that routes to the directory instead. */
static const char *join_listen(const serve_opts *o, char *buf, size_t len) {
  if (o->listen ||
      fr_dir_tcp_listen_for(o->directory, ferry_config_get("FERRY_TCP_LISTEN"), buf, len) != 1)
    return o->listen;
  fprintf(stderr,
          "ferry serve: listening on %s, the interface that routes to the directory "
          "(FERRY_TCP_LISTEN is loopback)\n",
          buf);
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

/* FERRY_METRICS_LISTEN, where the ctx serves its own metrics; NULL when unset. */
static const char *metrics_env(void) {
  const char *env = ferry_config_get("FERRY_METRICS_LISTEN");
  return env && *env ? env : NULL;
}

/* The fleet view behind / and /v1/fleet: a client of the directory this node hosts or joined,
 * opened at the first request (so that a directory that is down at start does not stop the
 * node) and kept. Opening is bounded by the snapshot's budget, and a failure is remembered for
 * FLEET_CACHE_MS: while the directory is down, requests that queued behind one attempt get its
 * error instead of each trying again. */
typedef struct fleet_http {
  char url[FR_DIR_ADDRESS_MAX + 1], name[64];
  pthread_mutex_t lock; /* what follows: requests come on a thread each */
  fleet_view *view;
  uint64_t failed_ns; /* when opening last failed (fr_now_ns; 0: it has not) */
  int failed_rc;
  char failed[512];
} fleet_http;

static int open_view(fleet_http *f, fleet_view **out) {
  pthread_mutex_lock(&f->lock);
  int rc = 0;
  if (!f->view && f->failed_ns &&
      fr_now_ns() - f->failed_ns < (uint64_t)FLEET_CACHE_MS * 1000000ull)
    rc = fr_err(f->failed_rc, "%s", f->failed);
  else if (!f->view && (rc = fleet_view_open(f->url, f->name, &f->view)) != 0) {
    f->failed_ns = fr_now_ns(), f->failed_rc = rc;
    fr_str_copy(f->failed, sizeof f->failed, ferry_last_error());
  }
  *out = f->view;
  pthread_mutex_unlock(&f->lock);
  return rc;
}

static unsigned fleet_route(void *arg, char **body, size_t *len, const char **type) {
  fleet_http *f = arg;
  fleet_view *view = NULL;
  int rc = open_view(f, &view);
  if (rc == 0 && (rc = fleet_json(view, body, len)) == 0) {
    *type = "application/json";
    return 200;
  }
  fr_warn("serve: /v1/fleet: %s", ferry_last_error());
  FILE *m = open_memstream(body, len);
  if (m) {
    fprintf(m, "{\"error\":");
    cli_json_string(m, ferry_last_error());
    fprintf(m, "}");
    fclose(m);
  }
  *type = "application/json";
  return 503;
}

static unsigned page_route(void *arg, char **body, size_t *len, const char **type) {
  (void)arg;
  *body = strdup(fleet_page_html);
  *len = *body ? strlen(*body) : 0;
  *type = "text/html; charset=utf-8";
  return 200;
}

static int add_fleet_routes(ferry_metrics_server *http, fleet_http *f) {
  int rc = fr_metrics_route(http, "/", page_route, NULL);
  return rc ? rc : fr_metrics_route(http, "/v1/fleet", fleet_route, f);
}

/* The default --http port: the one after the node's listen port (a scrape config stays right
 * across restarts, and two nodes of one host listening on different ports differ), or after
 * 7700 when the node listens on no fixed port. */
#define SERVE_HTTP_BASE_PORT 7700

static void default_http(const char *listen, char *buf, size_t len) {
  const char *colon = listen ? strrchr(listen, ':') : NULL;
  long port = colon ? strtol(colon + 1, NULL, 10) : 0;
  snprintf(buf, len, "127.0.0.1:%ld", (port > 0 && port < 65535 ? port : SERVE_HTTP_BASE_PORT) + 1);
}

/* --http: on by default (default_http, loopback), unless FERRY_METRICS_LISTEN already has the
 * ctx serving them or the caller said off. A default port that is taken gives way to a free
 * one, with a warning (the ready line says which); a port the caller chose does not. */
static int start_http(const serve_opts *o, const char *listen, ferry_ctx *ctx,
                      ferry_metrics_server **out) {
  if ((o->http && strcmp(o->http, "off") == 0) || (!o->http && metrics_env()))
    return 0;
  if (o->http)
    return ferry_metrics_serve(ctx, o->http, out);
  char addr[64];
  default_http(listen, addr, sizeof addr);
  if (ferry_metrics_serve(ctx, addr, out) == 0)
    return 0;
  fr_warn("serve: metrics: cannot listen on %s (%s): on a free port instead; pass --http "
          "HOST:PORT for a fixed one",
          addr, ferry_last_error());
  return ferry_metrics_serve(ctx, "127.0.0.1:0", out);
}

int cli_serve(int argc, char **argv) {
  serve_opts o = {0};
  if (parse(argc, argv, &o) != 0)
    return CLI_USAGE;
  cli_server_logging();
  char buf[256];
  const char *listen = o.directory ? o.listen : host_port(&o, buf, sizeof buf);
  if (o.directory)
    listen = join_listen(&o, buf, sizeof buf);
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
  ferry_metrics_server *http = NULL;
  if ((rc = start_http(&o, listen, ctx, &http)) != 0) {
    ferry_store_close(store);
    ferry_ctx_close(ctx);
    return cli_fail("serve", rc, "cannot serve metrics");
  }
  fleet_http fleet = {.lock = PTHREAD_MUTEX_INITIALIZER};
  if (o.directory)
    fr_str_copy(fleet.url, sizeof fleet.url, o.directory);
  else
    snprintf(fleet.url, sizeof fleet.url, "ferry://%s", listen);
  snprintf(fleet.name, sizeof fleet.name, "%.50s-fleet", ferry_ctx_name(ctx));
  if (http && (rc = add_fleet_routes(http, &fleet)) != 0) {
    ferry_metrics_server_close(http);
    ferry_store_close(store);
    ferry_ctx_close(ctx);
    return cli_fail("serve", rc, "cannot serve the status page");
  }
  print_ready(&o, ctx, listen, http ? ferry_metrics_server_address(http) : metrics_env(),
              http != NULL);
  int sig = wait_for_signal();
  /* a log line like the others (with FERRY_LOG_FORMAT=json, every stderr line is JSON) */
  fr_info("serve: %s: shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
  ferry_metrics_server_close(http);
  fleet_view_close(fleet.view);
  ferry_store_close(store);
  ferry_ctx_close(ctx);
  return CLI_OK;
}
