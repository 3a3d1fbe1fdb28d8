/*
 * `ferry ctl`: drive an inference engine's weight lifecycle through its control cell from the
 * shell. `ferry ctl NAME status|clear|update|abort` acts as a controller and exits with a code
 * that says what happened; `ferry ctl engine NAME --ranks R` plays an engine (a cell and R rank
 * threads that ack every command) for demos and tests; `ferry ctl serve` (ctl_http.c) puts the
 * same operations behind HTTP.
 */
#include "cli/args.h"
#include "cli/cli.h"
#include "cli/ctl.h"
#include "core/core.h"
#include "core/task.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char usage_text[] =
    "usage: ferry ctl NAME status [--json]\n"
    "       ferry ctl NAME clear|update|abort [--timeout S] [--json]\n"
    "       ferry ctl serve NAME --http HOST:PORT [--allow-remote]\n"
    "       ferry ctl engine NAME --ranks R [--work-ms MS] [--fail-update RANK]\n"
    "\n"
    "Controls the weight lifecycle of the inference engine whose control cell is NAME\n"
    "(FERRY_CTL_DIR/ferry-ctl-NAME): serving -clear-> cleared -update-> serving. A request\n"
    "returns when every rank acked it. `clear` while cleared succeeds at once; `update` needs\n"
    "cleared; `abort` supersedes a command still in flight (its controller died or gave up).\n"
    "\n"
    "  status        print the engine's and every rank's state (--json: one JSON object)\n"
    "  --timeout S   seconds to wait for every rank (default FERRY_TIMEOUT_MS)\n"
    "  serve         serve the cell over HTTP (`ferry ctl serve --help`)\n"
    "  engine        play an engine: create the cell and run R rank threads that ack each\n"
    "                command after MS milliseconds of pretend work (--fail-update RANK makes\n"
    "                that rank fail updates); prints one 'ready' line, runs until SIGINT/SIGTERM\n";

int ctl_exit_code(int status) {
  switch (status) {
  case FERRY_ESTATE:
    return CLI_STATE;
  case FERRY_EBUSY:
    return CLI_BUSY;
  case FERRY_ESTALE:
    return CLI_PEER;
  default:
    return cli_exit_code(status);
  }
}

static int ctl_fail(int status, const char *what) {
  cli_fail("ctl", status, what);
  return ctl_exit_code(status);
}

int ctl_parse_seconds(const char *text) { return cli_parse_seconds(text); }

/* ---- JSON ---- */

static void rank_json(FILE *out, const ferry_ctl_rank_status *r) {
  fprintf(out,
          "{\"rank\":%u,\"pid\":%d,\"alive\":%s,\"seq\":%lu,\"state\":\"%s\",\"fail_seq\":%lu,"
          "\"error\":\"%s\",\"message\":",
          r->rank, r->pid, r->alive ? "true" : "false", (unsigned long)r->seq,
          ferry_ctl_state_name(r->state), (unsigned long)r->fail_seq,
          r->fail_seq ? ferry_status_name(r->error) : "");
  cli_json_string(out, r->message);
  fputc('}', out);
}

int ctl_status_json(FILE *out, ferry_ctl *ctl, const char *name) {
  ferry_ctl_status st = {.size = sizeof st};
  int rc = ferry_ctl_status_get(ctl, &st);
  if (rc)
    return rc;
  fputs("{\"name\":", out);
  cli_json_string(out, name);
  fprintf(out,
          ",\"incarnation\":%lu,\"engine_pid\":%d,\"engine_alive\":%s,\"seq\":%lu,"
          "\"command\":\"%s\",\"in_flight\":%s,\"state\":\"%s\",\"agreed\":%s,\"ranks\":[",
          (unsigned long)st.incarnation, st.engine_pid, st.engine_alive ? "true" : "false",
          (unsigned long)st.seq, ferry_ctl_cmd_name(st.cmd), st.in_flight ? "true" : "false",
          ferry_ctl_state_name(st.state), st.agreed ? "true" : "false");
  for (uint32_t i = 0; i < st.nranks; i++) {
    ferry_ctl_rank_status r = {.size = sizeof r};
    if ((rc = ferry_ctl_rank_status_get(ctl, i, &r)) != 0)
      return rc;
    if (i)
      fputc(',', out);
    rank_json(out, &r);
  }
  fputs("]}", out);
  return 0;
}

/* ---- status and requests ---- */

static void print_rank(const ferry_ctl_rank_status *r) {
  printf("  rank %-4u %-9s seq %-6lu pid %d %s", r->rank, ferry_ctl_state_name(r->state),
         (unsigned long)r->seq, r->pid,
         r->pid == 0 ? "(detached)"
         : r->alive  ? "alive"
                     : "DEAD");
  if (r->fail_seq)
    printf("  last failure: seq %lu %s %s", (unsigned long)r->fail_seq, ferry_status_name(r->error),
           r->message);
  printf("\n");
}

static int print_status(ferry_ctl *ctl, const char *name) {
  ferry_ctl_status st = {.size = sizeof st};
  int rc = ferry_ctl_status_get(ctl, &st);
  if (rc)
    return ctl_fail(rc, "status");
  printf("%s: %s%s, seq %lu (%s%s), incarnation %lu, engine pid %d %s, %u ranks\n", name,
         ferry_ctl_state_name(st.state), st.agreed ? "" : " (ranks disagree)",
         (unsigned long)st.seq, ferry_ctl_cmd_name(st.cmd), st.in_flight ? ", in flight" : "",
         (unsigned long)st.incarnation, st.engine_pid, st.engine_alive ? "alive" : "DEAD",
         st.nranks);
  for (uint32_t i = 0; i < st.nranks; i++) {
    ferry_ctl_rank_status r = {.size = sizeof r};
    if ((rc = ferry_ctl_rank_status_get(ctl, i, &r)) != 0)
      return ctl_fail(rc, "status");
    print_rank(&r);
  }
  if (!st.engine_alive) {
    fprintf(stderr, "ferry ctl: cell '%s' is stale: its engine (pid %d) is dead\n", name,
            st.engine_pid);
    return CLI_PEER;
  }
  return CLI_OK;
}

static int do_request(ferry_ctl *ctl, const char *name, ferry_ctl_cmd cmd, int timeout_ms,
                      bool json) {
  int rc = ferry_ctl_request(ctl, cmd, timeout_ms);
  ferry_ctl_status st = {.size = sizeof st};
  if (json) {
    fr_err_keep keep;
    fr_err_save(&keep, rc);
    printf("{\"name\":");
    cli_json_string(stdout, name);
    printf(",\"command\":\"%s\",\"ok\":%s,\"status\":\"%s\",\"detail\":", ferry_ctl_cmd_name(cmd),
           rc ? "false" : "true", ferry_status_name(rc));
    cli_json_string(stdout, rc ? keep.detail : "");
    if (ferry_ctl_status_get(ctl, &st) == 0)
      printf(",\"state\":\"%s\",\"seq\":%lu", ferry_ctl_state_name(st.state),
             (unsigned long)st.seq);
    printf("}\n");
    return ctl_exit_code(rc);
  }
  if (rc)
    return ctl_fail(rc, ferry_ctl_cmd_name(cmd));
  if (ferry_ctl_status_get(ctl, &st) == 0)
    printf("%s: %s done: %s, seq %lu\n", name, ferry_ctl_cmd_name(cmd),
           ferry_ctl_state_name(st.state), (unsigned long)st.seq);
  return CLI_OK;
}

static int ctl_named(int argc, char **argv) {
  int timeout_ms = -1;
  bool json = false;
  const cli_opt opts[] = {
      {"timeout", CLI_ARG_SECONDS, &timeout_ms, 0, 0}, {"json", CLI_ARG_FLAG, &json, 0, 0}, {0}};
  const cli_cmd ctl_cmd = {"ctl", usage_text, "NAME and what to do (status, clear, update, abort)",
                           2,     2,          opts};
  char **pos = NULL;
  if (cli_parse(&ctl_cmd, argc, argv, &pos) < 0)
    return CLI_USAGE;
  const char *name = pos[0], *action = pos[1];
  ferry_ctl_cmd cmd = FERRY_CTL_NONE;
  if (strcmp(action, "status") != 0 && ferry_ctl_cmd_parse(action, &cmd) != 0) {
    return cli_usage_error(&ctl_cmd, "unknown action '%s' (status, clear, update, abort)", action);
  }
  ferry_ctl *ctl = NULL;
  int rc = ferry_ctl_open(name, &ctl);
  if (rc)
    return ctl_fail(rc, "open");
  int code;
  if (cmd != FERRY_CTL_NONE) {
    code = do_request(ctl, name, cmd, timeout_ms, json);
  } else if (json) {
    rc = ctl_status_json(stdout, ctl, name);
    printf("\n");
    code = rc ? ctl_fail(rc, "status") : CLI_OK;
  } else {
    code = print_status(ctl, name);
  }
  ferry_ctl_close(ctl);
  return code;
}

/* ---- `ferry ctl engine`: a pretend engine ---- */

typedef struct pretend_rank {
  const char *name;
  uint32_t rank;
  int work_ms;
  bool fail_update;
  atomic_int *stop;
  pthread_barrier_t *attached; /* "ready" is printed once every rank passed it */
  int rc;
} pretend_rank;

static void pretend_work(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
  while (ms > 0 && nanosleep(&ts, &ts) != 0)
    ;
}

static int pretend_clear(void *arg) {
  pretend_work(((pretend_rank *)arg)->work_ms);
  return 0;
}

static int pretend_update(void *arg) {
  pretend_rank *p = arg;
  pretend_work(p->work_ms);
  return p->fail_update ? FERRY_ECHECKSUM : 0;
}

static void *pretend_rank_main(void *arg) {
  pretend_rank *p = arg;
  ferry_ctl_rank *r = NULL;
  p->rc = ferry_ctl_rank_open(p->name, p->rank, NULL, &r);
  pthread_barrier_wait(p->attached);
  if (p->rc) {
    cli_fail("ctl engine", p->rc, "rank open");
    return NULL;
  }
  ferry_ctl_handlers h = {sizeof h, pretend_clear, pretend_update, NULL, p};
  while (!atomic_load(p->stop)) {
    int rc = ferry_ctl_rank_step(r, &h, 60000, NULL);
    if (rc && rc != FERRY_ETIMEDOUT) {
      p->rc = cli_fail("ctl engine", rc, "rank step");
      break;
    }
  }
  ferry_ctl_rank_close(r);
  return NULL;
}

static int parse_engine_args(int argc, char **argv, const char **name, int *ranks, int *work_ms,
                             int *fail) {
  const cli_opt opts[] = {{"ranks", CLI_ARG_INT, ranks, 1, FERRY_CTL_MAX_RANKS},
                          {"work-ms", CLI_ARG_INT, work_ms, 0, 3600000},
                          {"fail-update", CLI_ARG_INT, fail, 0, 0},
                          {0}};
  const cli_cmd cmd = {"ctl engine", usage_text, "NAME", 1, 1, opts};
  char **pos = NULL;
  if (cli_parse(&cmd, argc, argv, &pos) < 0)
    return CLI_USAGE;
  *name = pos[0];
  if (*ranks == 0)
    return cli_usage_error(&cmd, "--ranks R is required");
  return CLI_OK;
}

/* Stops the ranks: the flag, then an abort that wakes every rank so it sees the flag. */
static void stop_pretend_ranks(const char *name, atomic_int *stop) {
  atomic_store(stop, 1);
  ferry_ctl *ctl = NULL;
  if (ferry_ctl_open(name, &ctl) == 0) {
    ferry_ctl_request(ctl, FERRY_CTL_ABORT, -1);
    ferry_ctl_close(ctl);
  }
}

static int ctl_engine(int argc, char **argv) {
  const char *name = NULL;
  int ranks = 0, work_ms = 0, fail = -1;
  if (parse_engine_args(argc, argv, &name, &ranks, &work_ms, &fail) != CLI_OK)
    return CLI_USAGE;
  uint32_t nranks = (uint32_t)ranks;
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, NULL); /* rank threads inherit it; main waits for them */
  ferry_ctl_cell *cell = NULL;
  int rc = ferry_ctl_cell_create(name, nranks, NULL, &cell);
  if (rc)
    return ctl_fail(rc, "create cell");
  atomic_int stop = 0;
  pretend_rank *p = calloc(nranks, sizeof *p);
  pthread_t *t = calloc(nranks, sizeof *t);
  pthread_barrier_t attached;
  if (!p || !t) {
    free(p);
    free(t);
    ferry_ctl_cell_close(cell);
    return ctl_fail(FERRY_ENOMEM, "engine");
  }
  pthread_barrier_init(&attached, NULL, nranks + 1);
  for (uint32_t i = 0; i < nranks; i++) {
    p[i] = (pretend_rank){name, i, work_ms, (int)i == fail, &stop, &attached, 0};
    fr_thread_start(&t[i], "ctl-rank", pretend_rank_main, &p[i], false);
  }
  pthread_barrier_wait(&attached);
  printf("engine %s: %u ranks ready (incarnation %lu)\n", name, nranks,
         (unsigned long)ferry_ctl_cell_incarnation(cell));
  fflush(stdout);
  int sig = 0;
  sigwait(&sigs, &sig);
  stop_pretend_ranks(name, &stop);
  int code = CLI_OK;
  for (uint32_t i = 0; i < nranks; i++) {
    pthread_join(t[i], NULL);
    code = p[i].rc ? CLI_FAIL : code;
  }
  pthread_barrier_destroy(&attached);
  free(p);
  free(t);
  ferry_ctl_cell_close(cell);
  return code;
}

int cli_ctl(int argc, char **argv) {
  if (argc >= 2 && strcmp(argv[1], "serve") == 0)
    return ctl_serve(argc - 1, argv + 1);
  if (argc >= 2 && strcmp(argv[1], "engine") == 0)
    return ctl_engine(argc - 1, argv + 1);
  return ctl_named(argc, argv);
}
