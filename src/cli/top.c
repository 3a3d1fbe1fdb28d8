/*
 * `ferry top`: the fleet's status page in a terminal. It takes the same snapshot as ferry serve's
 * /v1/fleet (cli/fleet.c) from the directory at --directory or FERRY_DIRECTORY, and draws it as
 * text every --interval seconds until interrupted; --once draws one frame, --json prints the
 * snapshot's JSON. Names come from peers, so every control character in them (C0, DEL and C1) and
 * every byte that is not UTF-8 is shown as '?' (core's fr_text_char decides, as for every name
 * and escape): a node's name must not be able to move the cursor or recolour the terminal.
 */
#include "cli/args.h"
#include "cli/cli.h"
#include "cli/fleet.h"
#include "core/core.h"
#include "ferry.h"

#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char top_usage[] =
    "usage: ferry top [--directory URL] [--interval SECONDS] [--once | --json]\n\n"
    "Shows the fleet reached through the directory (--directory, default FERRY_DIRECTORY):\n"
    "its nodes and addresses, store keys by prefix with sizes and owners, refit senders with\n"
    "their receivers and committed versions, mq topics with publishers, subscribers and\n"
    "depth, and this host's control cells. The same data as ferry serve's status page\n"
    "(/v1/fleet); docs/OPERATIONS.md says where each value comes from.\n"
    "Redraws every --interval seconds (default 1) until interrupted (Ctrl-C), clearing the\n"
    "screen when stdout is a terminal.\n\n"
    "  --directory URL    ferry://HOST:PORT (or HOST:PORT) or redis://... (default\n"
    "                     FERRY_DIRECTORY)\n"
    "  --interval SECONDS between frames (0.1 .. 86400)\n"
    "  --once             print one frame and exit\n"
    "  --json             print one snapshot as JSON (the /v1/fleet object) and exit\n";

typedef struct top_opts {
  const char *directory;
  int interval_ms;
  bool once, json;
} top_opts;

static volatile sig_atomic_t interrupted;
static void on_signal(int sig) {
  (void)sig;
  interrupted = 1;
}

/* ---- drawing ---- */

/* s, padded or cut to width (0: as is), with control characters (C0, DEL, or a C1 code point
 * U+0080..U+009F, which UTF-8 spells C2 80..C2 9F: U+009B is an 8-bit CSI that some terminals
 * obey) and bytes that are not UTF-8 shown as '?' (one column each). */
static void put(const char *s, int width) {
  int n = 0;
  const unsigned char *p = (const unsigned char *)(s ? s : "-");
  for (size_t left = strlen((const char *)p); *p && (!width || n < width); n++) {
    size_t c = fr_text_char(p, left);
    if (c == 0) {
      putchar('?');
      c = fr_utf8_seq(p, left) == 2 ? 2 : 1; /* a C1 character is one '?' */
    } else {
      fwrite(p, 1, c, stdout);
    }
    p += c, left -= c;
  }
  for (; n < width; n++)
    putchar(' ');
  if (width)
    putchar(' ');
}

static const char *str(const json_t *o, const char *key) {
  const char *s = json_string_value(json_object_get(o, key));
  return s ? s : "-";
}

static void put_num(const json_t *v, int width) {
  char buf[64] = "-";
  if (json_is_integer(v))
    snprintf(buf, sizeof buf, "%lld", (long long)json_integer_value(v));
  else if (json_is_real(v))
    snprintf(buf, sizeof buf, "%.3f", json_real_value(v));
  printf("%*s ", width, buf);
}

static const char *human(const json_t *v, char *buf, size_t cap) {
  if (!json_is_number(v))
    return "-";
  double b = json_number_value(v);
  const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4)
    b /= 1024, u++;
  snprintf(buf, cap, u ? "%.1f %s" : "%.0f %s", b, units[u]);
  return buf;
}

static void list(const json_t *arr, const char *key, int width) {
  char buf[512] = "";
  size_t used = 0, i;
  json_t *e;
  json_array_foreach(arr, i, e) {
    const char *s = key ? str(e, key) : json_string_value(e);
    used += (size_t)snprintf(buf + used, sizeof buf - used, "%s%s", i ? "," : "", s ? s : "-");
    if (used >= sizeof buf)
      break;
  }
  put(*buf ? buf : "-", width);
}

static void draw_nodes(const json_t *f) {
  const json_t *nodes = json_object_get(f, "nodes");
  printf("NODES (%zu)\n  ", json_array_size(nodes));
  printf("%-24s %-14s %-8s %8s %-11s %-21s %s\n", "NAME", "JOBS", "METRICS", "OBJECTS", "HELD",
         "POOL USED/CAPACITY", "ADDRESS");
  size_t i;
  json_t *n;
  json_array_foreach(nodes, i, n) {
    const json_t *st = json_object_get(n, "store");
    char a[32], b[32], c[32], pool[72];
    printf("  ");
    put(str(n, "name"), 24);
    put(str(n, "kind"), 14);
    put(json_is_true(json_object_get(n, "reached")) ? "ok" : "no", 8);
    put_num(json_object_get(st, "objects"), 8);
    put(human(json_object_get(st, "held_bytes"), a, sizeof a), 11);
    snprintf(pool, sizeof pool, "%s/%s", human(json_object_get(st, "pool_used_bytes"), b, sizeof b),
             human(json_object_get(st, "pool_capacity_bytes"), c, sizeof c));
    put(st ? pool : "-", 21);
    put(str(n, "address"), 0);
    if (!json_is_true(json_object_get(n, "reached"))) {
      printf("\n      ");
      put(str(n, "error"), 0);
    }
    printf("\n");
  }
  if (json_integer_value(json_object_get(f, "nodes_omitted")))
    printf("  ... %lld more nodes\n",
           (long long)json_integer_value(json_object_get(f, "nodes_omitted")));
}

static void draw_store(const json_t *f) {
  const json_t *st = json_object_get(f, "store");
  char total[32];
  printf("\nSTORE: %lld keys, %s\n  %-24s %6s %11s  %s\n",
         (long long)json_integer_value(json_object_get(st, "keys")),
         human(json_object_get(st, "bytes"), total, sizeof total), "PREFIX", "KEYS", "SIZE",
         "OWNERS");
  size_t i;
  json_t *p;
  json_array_foreach(json_object_get(st, "prefixes"), i, p) {
    char size[32];
    printf("  ");
    put(*str(p, "prefix") ? str(p, "prefix") : "(no prefix)", 24);
    put_num(json_object_get(p, "keys"), 6);
    printf("%11s  ", human(json_object_get(p, "bytes"), size, sizeof size));
    list(json_object_get(p, "owners"), NULL, 0);
    printf("\n");
  }
}

static void draw_refit(const json_t *f) {
  printf("\nREFIT\n  %-24s %8s  %-24s %9s  %s\n", "SENDER", "VERSION", "RECEIVER", "COMMITTED",
         "STATE");
  size_t i, j;
  json_t *s, *r;
  json_array_foreach(json_object_get(f, "refit"), i, s) {
    const json_t *rs = json_object_get(s, "receivers");
    if (!json_is_true(json_object_get(s, "reached"))) {
      printf("  ");
      put(str(s, "sender"), 24);
      put(str(s, "error"), 0);
      printf("\n");
      continue;
    }
    if (json_array_size(rs) == 0) {
      printf("  ");
      put(str(s, "sender"), 24);
      put_num(json_object_get(s, "version"), 8);
      printf(" (no receivers)\n");
    }
    json_array_foreach(rs, j, r) {
      printf("  ");
      put(str(s, "sender"), 24);
      put_num(json_object_get(s, "version"), 8);
      printf(" ");
      put(str(r, "receiver"), 24);
      put_num(json_object_get(r, "committed"), 9);
      printf(" %s\n", json_is_true(json_object_get(r, "dropped")) ? "dropped" : "attached");
    }
  }
}

static void draw_mq(const json_t *f) {
  printf("\nMQ\n  %-24s %-24s %-24s %s\n", "TOPIC", "PUBLISHERS", "SUBSCRIBERS", "DEPTH");
  size_t i;
  json_t *t;
  json_array_foreach(json_object_get(f, "mq"), i, t) {
    printf("  ");
    put(str(t, "topic"), 24);
    list(json_object_get(t, "publishers"), "mq", 24);
    list(json_object_get(t, "subscribers"), "mq", 24);
    put_num(json_object_get(t, "depth"), 5);
    printf("\n");
  }
}

static void draw_control(const json_t *f) {
  const json_t *c = json_object_get(f, "control");
  printf("\nCONTROL (this host: ");
  put(str(c, "dir"), 0);
  printf(")\n  %-24s %-10s %-8s %6s %5s\n", "CELL", "STATE", "COMMAND", "SEQ", "RANKS");
  size_t i;
  json_t *e;
  json_array_foreach(json_object_get(c, "cells"), i, e) {
    printf("  ");
    put(str(e, "name"), 24);
    if (json_object_get(e, "error")) {
      put(str(e, "error"), 0);
      printf("\n");
      continue;
    }
    put(str(e, "state"), 10);
    put(*str(e, "command") ? str(e, "command") : "-", 8);
    put_num(json_object_get(e, "seq"), 6);
    put_num(json_object_get(e, "ranks"), 5);
    printf("\n");
  }
}

static void draw(const json_t *f) {
  time_t now = time(NULL);
  char when[32];
  strftime(when, sizeof when, "%H:%M:%S", localtime(&now));
  printf("ferry top: directory ");
  put(str(f, "directory"), 0);
  printf(" at %s\n\n", when);
  draw_nodes(f);
  draw_store(f);
  draw_refit(f);
  draw_mq(f);
  draw_control(f);
}

/* ---- the command ---- */

static int frame(fleet_view *v, const top_opts *o, bool tty) {
  json_t *f = NULL;
  int rc = fleet_snapshot(v, &f);
  if (rc != 0)
    return rc;
  if (tty && !o->once && !o->json)
    printf("\033[H\033[2J");
  if (o->json) {
    char *text = json_dumps(f, JSON_COMPACT);
    printf("%s\n", text ? text : "{}");
    free(text);
  } else {
    draw(f);
  }
  json_decref(f);
  fflush(stdout);
  return 0;
}

static void nap(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (!interrupted && nanosleep(&ts, &ts) != 0)
    ;
}

int cli_top(int argc, char **argv) {
  top_opts o = {.interval_ms = 1000};
  const cli_opt opts[] = {{"directory", CLI_ARG_STR, &o.directory, 0, 0},
                          {"interval", CLI_ARG_SECONDS, &o.interval_ms, 0, 0},
                          {"once", CLI_ARG_FLAG, &o.once, 0, 0},
                          {"json", CLI_ARG_FLAG, &o.json, 0, 0},
                          {0}};
  const cli_cmd cmd = {"top", top_usage, NULL, 0, 0, opts};
  if (cli_parse(&cmd, argc, argv, NULL) < 0)
    return CLI_USAGE;
  if (o.interval_ms < 100)
    return cli_usage_error(&cmd, "--interval must be at least 0.1 seconds");
  char name[64];
  snprintf(name, sizeof name, "top-%ld", (long)getpid());
  fleet_view *v = NULL;
  int rc = fleet_view_open(o.directory, name, &v);
  if (rc != 0)
    return cli_fail("top", rc, "cannot reach the directory");
  struct sigaction sa = {.sa_handler = on_signal};
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  bool tty = isatty(STDOUT_FILENO);
  bool loop = !o.once && !o.json;
  do {
    rc = frame(v, &o, tty);
    if (rc != 0 && loop) { /* the directory may come back: say so and keep trying */
      printf("%sferry top: no snapshot: %s\n", tty ? "\033[H\033[2J" : "", ferry_last_error());
      fflush(stdout);
    }
    if (loop)
      nap(o.interval_ms);
  } while (loop && !interrupted);
  fleet_view_close(v);
  return rc && !loop ? cli_fail("top", rc, "cannot take a snapshot") : CLI_OK;
}
