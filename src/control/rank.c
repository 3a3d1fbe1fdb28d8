/*
 * The rank side of a control cell: attach to a rank line, wait (on a futex) for the latest
 * command, and acknowledge it by writing only this rank's own line. The rank maps the command
 * word read-only, so it can observe commands but never change or "write back" one.
 * ferry_ctl_rank_step() is the loop body most engines want: it runs the clear/update/abort
 * handlers and acks their outcome; the update handler is the commit step that ends UPDATING.
 */
#include "control/cell.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct ferry_ctl_rank {
  fr_ctl_map map;
  fr_ctl_line *line;
  uint32_t rank;
  uint64_t owner;
  uint64_t taken_seq; /* the last command taken by wait_command */
  ferry_ctl_cmd taken_cmd;
  bool acked;            /* the taken command has been acked */
  ferry_ctl_state state; /* the last state acked (terminal) */
  int error;             /* the last FAILED ack's error */
};

/* Publishes the ack word; a final state wakes the controllers waiting on it (they wait only
 * for final states, so CLEARING/UPDATING would only cost them a useless wake-up), and only if
 * one sleeps: most acks land while the controller is still awake, and eight ranks' needless
 * FUTEX_WAKE calls were a third of a request's system calls. The store and the load are both
 * seq_cst, against the controller's increment and its re-read (wait_acks): either the rank
 * sees the waiter or the controller sees the ack before sleeping. */
static void publish_ack(ferry_ctl_rank *r, uint64_t seq, ferry_ctl_state state) {
  atomic_store_explicit(&r->line->ack, fr_ctl_word(seq, state), memory_order_seq_cst);
  if (fr_ctl_state_terminal(state) &&
      atomic_load_explicit(&r->map.hdr->ack_waiters, memory_order_seq_cst) != 0)
    fr_ctl_futex_wake(&r->line->ack);
}

/* Records a failure before its ack: fail_seq is cleared, error and message written, then
 * fail_seq set, so a reader that sees the same fail_seq before and after reading has a
 * consistent record. The record stays until this rank's next failure. */
static void publish_failure(fr_ctl_line *line, uint64_t seq, int error, const char *message) {
  char text[FERRY_CTL_MESSAGE_MAX] = {0};
  if (message)
    strncpy(text, message, sizeof text - 1);
  atomic_store_explicit(&line->fail_seq, 0, memory_order_relaxed);
  atomic_thread_fence(memory_order_release);
  for (int i = 0; i < FR_CTL_MSG_WORDS; i++) {
    uint64_t w;
    memcpy(&w, text + 8 * i, 8);
    atomic_store_explicit(&line->message[i], w, memory_order_relaxed);
  }
  atomic_store_explicit(&line->error, error, memory_order_relaxed);
  atomic_store_explicit(&line->fail_seq, seq, memory_order_release);
}

/* Claims the line: free, or held by a dead process (a rank that restarted). */
static int claim_line(ferry_ctl_rank *r) {
  uint64_t seen = atomic_load(&r->line->owner);
  if (seen != 0 && fr_ctl_owner_alive(seen))
    return fr_err(FERRY_EBUSY, "rank %u of control cell '%s' is held by live pid %d", r->rank,
                  r->map.name, fr_ctl_owner_pid(seen));
  if (!atomic_compare_exchange_strong(&r->line->owner, &seen, r->owner))
    return fr_err(FERRY_EBUSY, "rank %u of control cell '%s' was just claimed by pid %d", r->rank,
                  r->map.name, fr_ctl_owner_pid(seen));
  return 0;
}

int ferry_ctl_rank_open(const char *name, uint32_t rank, const ferry_ctl_rank_opts *opts,
                        ferry_ctl_rank **out) {
  int rc = FR_OPTS_CHECK(opts, "ferry_ctl_rank_open");
  if (rc != 0)
    return rc;
  ferry_ctl_state initial =
      FR_OPT(opts, initial_state, 0) ? opts->initial_state : FERRY_CTL_SERVING;
  if (!out || (initial != FERRY_CTL_SERVING && initial != FERRY_CTL_CLEARED))
    return fr_err(FERRY_EINVAL, "rank open '%s': initial state must be serving or cleared",
                  name ? name : "");
  ferry_ctl_rank *r = calloc(1, sizeof *r);
  if (!r)
    return fr_err(FERRY_ENOMEM, "rank open '%s'", name);
  rc = fr_ctl_map_open(name, FR_CTL_MAP_RANK, &r->map);
  if (rc) {
    free(r);
    return rc;
  }
  if (rank >= r->map.nranks) {
    rc = fr_err(FERRY_ERANGE, "rank %u of control cell '%s': it has %u ranks", rank, name,
                r->map.nranks);
  } else {
    r->rank = rank;
    r->line = &r->map.lines[rank];
    r->owner = fr_ctl_owner(getpid(), fr_ctl_pid_start(getpid()));
    rc = claim_line(r);
  }
  if (rc) {
    fr_ctl_map_close(&r->map);
    free(r);
    return rc;
  }
  /* A new owner starts at seq 0, so its first wait returns the latest command, if any. */
  r->state = initial;
  publish_ack(r, 0, initial);
  *out = r;
  return 0;
}

void ferry_ctl_rank_close(ferry_ctl_rank *r) {
  if (!r)
    return;
  uint64_t mine = r->owner;
  atomic_compare_exchange_strong(&r->line->owner, &mine, 0);
  fr_ctl_futex_wake(&r->line->ack); /* a waiting controller notices the detach sooner */
  fr_ctl_map_close(&r->map);
  free(r);
}

static void take(ferry_ctl_rank *r, uint64_t word, ferry_ctl_command *out) {
  r->taken_seq = fr_ctl_cmd_seq(word);
  r->taken_cmd = (ferry_ctl_cmd)fr_ctl_cmd_of(word);
  r->acked = false;
  if (r->taken_cmd == FERRY_CTL_CLEAR)
    publish_ack(r, r->taken_seq, FERRY_CTL_CLEARING);
  else if (r->taken_cmd == FERRY_CTL_UPDATE)
    publish_ack(r, r->taken_seq, FERRY_CTL_UPDATING);
  out->seq = r->taken_seq;
  out->cmd = r->taken_cmd;
}

int ferry_ctl_wait_command(ferry_ctl_rank *r, int timeout_ms, ferry_ctl_command *out) {
  if (!r || !out)
    return fr_err(FERRY_EINVAL, "wait_command: NULL argument");
  uint64_t deadline = fr_deadline_ns(fr_timeout(timeout_ms));
  for (;;) {
    uint64_t word = atomic_load_explicit(&r->map.hdr->command, memory_order_acquire);
    if (fr_ctl_cmd_seq(word) > r->taken_seq) {
      take(r, word, out);
      return 0;
    }
    int left = fr_ms_left(deadline);
    if (left == 0)
      return fr_err(FERRY_ETIMEDOUT, "rank %u of '%s': no new command (last seq %lu)", r->rank,
                    r->map.name, (unsigned long)r->taken_seq);
    fr_ctl_futex_wait(&r->map.hdr->command, word, left);
  }
}

static bool ack_state_ok(ferry_ctl_cmd cmd, ferry_ctl_state state) {
  switch (cmd) {
  case FERRY_CTL_CLEAR:
    return state == FERRY_CTL_CLEARED || state == FERRY_CTL_FAILED;
  case FERRY_CTL_UPDATE:
    return state == FERRY_CTL_SERVING || state == FERRY_CTL_FAILED;
  case FERRY_CTL_ABORT:
    return fr_ctl_state_terminal(state);
  default:
    return false;
  }
}

int ferry_ctl_ack(ferry_ctl_rank *r, uint64_t seq, ferry_ctl_state state, int error,
                  const char *message) {
  if (!r || seq == 0 || seq != r->taken_seq)
    return fr_err(FERRY_EINVAL, "ack seq %lu: the last command taken is seq %lu",
                  (unsigned long)seq, r ? (unsigned long)r->taken_seq : 0ul);
  if (r->acked)
    return fr_err(FERRY_ESTATE, "ack seq %lu: already acked", (unsigned long)seq);
  if (!ack_state_ok(r->taken_cmd, state))
    return fr_err(FERRY_ESTATE, "rank %u cannot end %s with state %s", r->rank,
                  ferry_ctl_cmd_name(r->taken_cmd), ferry_ctl_state_name(state));
  if ((state == FERRY_CTL_FAILED) != (error < 0))
    return fr_err(FERRY_EINVAL, "ack %s: a FAILED ack needs an error < 0, others none",
                  ferry_ctl_state_name(state));
  if (state == FERRY_CTL_FAILED) {
    publish_failure(r->line, seq, error, message);
    /* an abort's FAILED only repeats an earlier failure, already said */
    if (r->taken_cmd != FERRY_CTL_ABORT)
      fr_warn_limited("control '%s': rank %u failed %s seq %lu: %s (%s)", r->map.name, r->rank,
                      ferry_ctl_cmd_name(r->taken_cmd), (unsigned long)seq,
                      ferry_status_name(error), message && *message ? message : "no detail");
  }
  publish_ack(r, seq, state);
  r->acked = true;
  r->state = state;
  r->error = error;
  return 0;
}

/* Runs one handler with a clean error detail, so a failure's message is the handler's own. */
static int run_handler(int (*fn)(void *), void *arg) {
  if (!fn)
    return 0;
  fr_err_clear();
  int rc = fn(arg);
  return rc > 0 ? FERRY_EINVAL : rc;
}

static int ack_result(ferry_ctl_rank *r, ferry_ctl_state ok_state, int rc) {
  if (rc == 0)
    return ferry_ctl_ack(r, r->taken_seq, ok_state, 0, NULL);
  const char *detail = ferry_last_error();
  char msg[FERRY_CTL_MESSAGE_MAX];
  strncpy(msg, *detail ? detail : ferry_strerror(rc), sizeof msg - 1);
  msg[sizeof msg - 1] = '\0';
  return ferry_ctl_ack(r, r->taken_seq, FERRY_CTL_FAILED, rc, msg);
}

static int handle(ferry_ctl_rank *r, const ferry_ctl_handlers *h) {
  void *arg = FR_OPT(h, arg, NULL);
  switch (r->taken_cmd) {
  case FERRY_CTL_CLEAR:
    if (r->state == FERRY_CTL_CLEARED)
      return ferry_ctl_ack(r, r->taken_seq, FERRY_CTL_CLEARED, 0, NULL);
    return ack_result(r, FERRY_CTL_CLEARED, run_handler(FR_OPT(h, clear, NULL), arg));
  case FERRY_CTL_UPDATE:
    if (r->state != FERRY_CTL_CLEARED)
      return ack_result(r, FERRY_CTL_SERVING,
                        fr_err(FERRY_ESTATE, "update while %s", ferry_ctl_state_name(r->state)));
    return ack_result(r, FERRY_CTL_SERVING, run_handler(FR_OPT(h, update, NULL), arg));
  default: { /* abort: report what this rank can vouch for */
    ferry_ctl_state st = FR_OPT(h, abort, NULL) ? h->abort(arg) : r->state;
    if (!fr_ctl_state_terminal(st))
      st = FERRY_CTL_FAILED;
    if (st != FERRY_CTL_FAILED)
      return ferry_ctl_ack(r, r->taken_seq, st, 0, NULL);
    return ferry_ctl_ack(r, r->taken_seq, st, r->error < 0 ? r->error : FERRY_ECLOSED, "aborted");
  }
  }
}

int ferry_ctl_rank_step(ferry_ctl_rank *r, const ferry_ctl_handlers *h, int timeout_ms,
                        ferry_ctl_command *handled) {
  int rc = FR_OPTS_CHECK(h, "ferry_ctl_rank_step");
  if (rc)
    return rc;
  ferry_ctl_command cmd;
  rc = ferry_ctl_wait_command(r, timeout_ms, &cmd);
  if (rc)
    return rc;
  rc = handle(r, h);
  if (rc == 0 && handled)
    *handled = cmd;
  return rc;
}
