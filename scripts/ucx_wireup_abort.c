/*
 * UCX 1.13's tcp transport aborts a process that makes an endpoint to a peer dying at that
 * moment (tcp_ep.c:478, "!(ep->flags & UCT_TCP_EP_FLAG_CTX_TYPE_TX)"; docs/UCX.md, "A peer that
 * dies during wire-up"). This program shows it with UCX alone, with the UCP parameters ferry
 * uses (stream, RMA, AM and wake-up features; a serialized worker; error mode PEER): a victim
 * makes its endpoint to the survivor's worker and stops progressing; the survivor's worker takes
 * in the victim's connection; the victim is SIGKILLed; then the survivor makes its endpoint to
 * the victim's address, which takes that connection over, and progresses. Each run is a process
 * of its own; the program counts the runs that UCX aborted. Not part of the build or the suite:
 *
 *   cc -O1 scripts/ucx_wireup_abort.c $(pkg-config --cflags --libs ucx) -o /tmp/ucx_wireup_abort
 *   UCX_TLS=tcp /tmp/ucx_wireup_abort 30                     # UCX's default (blocking connect)
 *   UCX_TLS=tcp UCX_TCP_CONN_NB=y /tmp/ucx_wireup_abort 300  # what ferry sets (ucx.c)
 *
 * On the project's VM (Debian's libucx0 1.13.1): 30 of 30 runs aborted with UCX's default (23
 * of 30 in an earlier version of this program: there the victim's end sometimes came as a FIN
 * rather than a reset, and the survivor's connection request went out); with
 * UCX_TCP_CONN_NB=y, 0 of 300, each endpoint's failure reported to its error handler.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

static ucp_context_h context;
static ucp_worker_h worker;
static int peer_failed;

static void ucx_open(void) {
  ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                    .features =
                        UCP_FEATURE_STREAM | UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP};
  ucp_config_t *config;
  if (ucp_config_read(NULL, NULL, &config) != UCS_OK || ucp_init(&p, config, &context) != UCS_OK)
    exit(3);
  ucp_config_release(config);
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SERIALIZED};
  if (ucp_worker_create(context, &wp, &worker) != UCS_OK)
    exit(3);
}

static void on_peer_failure(void *arg, ucp_ep_h ep, ucs_status_t status) {
  (void)arg, (void)ep, (void)status;
  peer_failed = 1;
}

static ucp_ep_h endpoint_to(const void *address) {
  ucp_ep_params_t p = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                     UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                     UCP_EP_PARAM_FIELD_ERR_HANDLER,
                       .address = address,
                       .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                       .err_handler = {.cb = on_peer_failure}};
  ucp_ep_h ep = NULL;
  return ucp_ep_create(worker, &p, &ep) == UCS_OK ? ep : NULL;
}

static void address_put(int fd) {
  ucp_address_t *a;
  size_t n;
  if (ucp_worker_get_address(worker, &a, &n) != UCS_OK || write(fd, &n, sizeof n) != sizeof n ||
      write(fd, a, n) != (ssize_t)n)
    exit(4);
  ucp_worker_release_address(worker, a);
}

static void *address_get(int fd) {
  size_t n;
  if (read(fd, &n, sizeof n) != sizeof n)
    exit(5);
  void *a = malloc(n);
  if (!a || read(fd, a, n) != (ssize_t)n)
    exit(5);
  return a;
}

static void progress_for_ms(int ms) {
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  do {
    ucp_worker_progress(worker);
    clock_gettime(CLOCK_MONOTONIC, &t);
  } while ((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000 < ms);
}

/* Makes its endpoint to the survivor, says so, and waits to be killed without progressing: what
 * the survivor sends it stays unread, so its death resets the connection. */
static void victim(int from_survivor, int to_survivor) {
  ucx_open();
  address_put(to_survivor);
  void *survivor_address = address_get(from_survivor);
  char b = 1;
  if (!endpoint_to(survivor_address) || write(to_survivor, &b, 1) != 1)
    exit(4);
  pause();
}

/* One run: 0 when the survivor's endpoint failed through its error handler (or was refused),
 * 6 when the victim's death went unreported. */
static int survivor(void) {
  int down[2], up[2];
  if (pipe(down) || pipe(up))
    return 2;
  pid_t pid = fork();
  if (pid == 0) {
    victim(down[0], up[1]);
    _exit(0);
  }
  ucx_open();
  void *victim_address = address_get(up[0]);
  address_put(down[1]);
  char b;
  if (read(up[0], &b, 1) != 1)
    return 5;
  progress_for_ms(20); /* the victim's connection comes in: a receive-only tcp endpoint */
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  usleep(2000); /* its reset arrives, unseen: no progress meanwhile */
  ucp_ep_h ep = endpoint_to(victim_address);
  progress_for_ms(20); /* UCX 1.13's default aborts here */
  printf("  endpoint %s, error handler %s\n", ep ? "made" : "refused",
         peer_failed ? "called" : "not called");
  fflush(stdout);
  return ep && !peer_failed ? 6 : 0;
}

int main(int argc, char **argv) {
  int runs = argc > 1 ? atoi(argv[1]) : 10, aborted = 0, other = 0;
  for (int i = 0; i < runs; i++) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0)
      _exit(survivor());
    int st = 0;
    waitpid(pid, &st, 0);
    if (WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT)
      aborted++;
    else if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
      other++;
  }
  const char *nb = getenv("UCX_TCP_CONN_NB");
  printf(
      "ucx_wireup_abort: %d of %d runs aborted, %d failed otherwise (UCX %s, UCX_TCP_CONN_NB=%s)\n",
      aborted, runs, other, ucp_get_version_string(), nb ? nb : "(UCX's default, n)");
  return aborted ? 1 : 0;
}
