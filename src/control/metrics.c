/*
 * Control metrics: requests (clear, update, abort) by command and outcome, and how long they
 * took, for the whole process (a control cell belongs to no ctx), in the process-wide set of
 * collectors, registered by the first request.
 */
#include "control/cell.h"
#include "core/stats.h"

#include <pthread.h>

#define OUTCOMES 32 /* -status: 0 done, FERRY_ETIMEDOUT, FERRY_EBUSY, ... */

static uint64_t requests[FERRY_CTL_ABORT + 1][OUTCOMES];
static fr_hist latency[FERRY_CTL_ABORT + 1];
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void collect(void *arg, fr_stats_out *out) {
  for (int c = FERRY_CTL_CLEAR; c <= FERRY_CTL_ABORT; c++) {
    const char *cmd = ferry_ctl_cmd_name((ferry_ctl_cmd)c);
    fr_stat_hist(out, "ferry_control_request_duration_seconds",
                 "Time a control request took, issued to every rank's ack", &latency[c], 1e-9,
                 "command", cmd, NULL);
    for (int o = 0; o < OUTCOMES; o++) {
      uint64_t n = fr_counted(&requests[c][o]);
      if (n || o == 0)
        fr_stat_counter(out, "ferry_control_requests_total",
                        "Control requests by command and outcome (FERRY_OK: done)", (double)n,
                        "command", cmd, "outcome", ferry_status_name(-o), NULL);
    }
  }
}

static void register_collector(void) {
  if (fr_stats_add(fr_stats_global(), collect, NULL, requests) != 0)
    fr_err_clear(); /* out of memory: the process reports no control metrics */
}

void fr_ctl_count_request(ferry_ctl_cmd cmd, int rc, uint64_t t0) {
  if (cmd < FERRY_CTL_CLEAR || cmd > FERRY_CTL_ABORT)
    return;
  pthread_once(&once, register_collector);
  int o = rc <= 0 && -rc < OUTCOMES ? -rc : OUTCOMES - 1;
  fr_count(&requests[cmd][o], 1);
  fr_hist_observe(&latency[cmd], fr_now_ns() - t0);
}
