/*
 * The controller side of a control cell: validate a transition against a consistent snapshot of
 * the rank lines, issue the command with one compare-and-swap of the command word (a second
 * controller racing for the same word loses and gets FERRY_EBUSY; nothing is ever written back),
 * wake the ranks, and wait on the rank lines' futexes until every rank acked, checking every
 * FERRY_CTL_CHECK_MS that the ranks still waited on are alive. Also the status snapshots and the
 * state/command names.
 */
#include "control/cell.h"

#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ferry_ctl {
  fr_ctl_map map;
  int spin_us; /* FERRY_CTL_SPIN_US: how long a request yields for its acks before it sleeps */
  fr_ctl_watch *watch; /* the ranks' processes, then the engine's (nranks + 1) */
};

/* Up to this many processes (ranks and the engine) are watched through pidfds; beyond, kill()
 * (a cell of 1024 ranks would otherwise hold 1025 descriptors). */
#define WATCH_PIDFD_MAX 64

/* ---- names ---- */

static const char *const state_names[] = {"absent",  "serving",  "clearing",
                                          "cleared", "updating", "failed"};
static const char *const cmd_names[] = {"none", "clear", "update", "abort"};

const char *ferry_ctl_state_name(ferry_ctl_state state) {
  return (unsigned)state < 6 ? state_names[state] : "?";
}

const char *ferry_ctl_cmd_name(ferry_ctl_cmd cmd) {
  return (unsigned)cmd < 4 ? cmd_names[cmd] : "?";
}

int ferry_ctl_cmd_parse(const char *name, ferry_ctl_cmd *out) {
  for (int c = FERRY_CTL_CLEAR; c <= FERRY_CTL_ABORT; c++)
    if (name && out && strcmp(name, cmd_names[c]) == 0) {
      *out = (ferry_ctl_cmd)c;
      return 0;
    }
  return fr_err(FERRY_EINVAL, "unknown control command '%s' (clear, update, abort)",
                name ? name : "(null)");
}

/* ---- snapshots ---- */

typedef struct failure {
  uint64_t seq; /* 0: none */
  int error;
  char message[FERRY_CTL_MESSAGE_MAX];
} failure;

/* A seqlock read of a rank's failure record: fail_seq is set last (release) by the rank and only
 * ever grows, so reading the same value before and after proves error and message are its. */
static void read_failure(const fr_ctl_line *l, failure *f) {
  for (int tries = 0; tries < 1000; tries++) {
    f->seq = atomic_load_explicit(&l->fail_seq, memory_order_acquire);
    f->error = atomic_load_explicit(&l->error, memory_order_relaxed);
    for (int i = 0; i < FR_CTL_MSG_WORDS; i++) {
      uint64_t w = atomic_load_explicit(&l->message[i], memory_order_relaxed);
      memcpy(f->message + 8 * i, &w, 8);
    }
    f->message[FERRY_CTL_MESSAGE_MAX - 1] = '\0';
    atomic_thread_fence(memory_order_acquire);
    if (f->seq != 0 && atomic_load_explicit(&l->fail_seq, memory_order_relaxed) == f->seq)
      return;
    if (f->seq == 0 && tries > 0)
      break; /* no failure recorded (or one being written for a later command) */
  }
  *f = (failure){0};
}

static uint64_t load_ack(const ferry_ctl *ctl, uint32_t rank) {
  return atomic_load_explicit(&ctl->map.lines[rank].ack, memory_order_acquire);
}

static bool line_done(uint64_t ack, uint64_t seq) {
  return fr_ctl_seq(ack) == seq && fr_ctl_state_terminal(fr_ctl_low(ack));
}

typedef struct cell_snap {
  uint64_t word;
  bool in_flight, agreed;
  ferry_ctl_state state;
  unsigned outcome; /* of the latest command, as the next issuer records it */
} cell_snap;

/* The engine's state from the set of rank states seen; *kinds counts the distinct ones. */
static ferry_ctl_state merge_states(const uint8_t *seen, int *kinds) {
  *kinds = 0;
  ferry_ctl_state one = FERRY_CTL_FAILED;
  for (int s = FERRY_CTL_ABSENT; s <= FERRY_CTL_FAILED; s++)
    if (seen[s]) {
      ++*kinds;
      one = (ferry_ctl_state)s;
    }
  if (seen[FERRY_CTL_ABSENT])
    return FERRY_CTL_ABSENT;
  if (seen[FERRY_CTL_UPDATING])
    return FERRY_CTL_UPDATING;
  if (seen[FERRY_CTL_CLEARING])
    return FERRY_CTL_CLEARING;
  return *kinds == 1 ? one : FERRY_CTL_FAILED;
}

static unsigned outcome_of(uint64_t seq, bool in_flight, bool failed) {
  if (seq == 0)
    return FR_CTL_OUT_UNKNOWN;
  return in_flight ? FR_CTL_OUT_SUPERSEDED : failed ? FR_CTL_OUT_FAILED : FR_CTL_OUT_OK;
}

static void snapshot(const ferry_ctl *ctl, cell_snap *cs) {
  cs->word = atomic_load_explicit(&ctl->map.hdr->command, memory_order_acquire);
  uint64_t seq = fr_ctl_cmd_seq(cs->word);
  uint8_t seen[8] = {0};
  cs->in_flight = false;
  /* Before the first command (seq 0) nothing can be in flight: a rank that has claimed its line
   * but not yet published its initial state still reads ABSENT, and it will take whatever
   * command comes next like any other rank. */
  for (uint32_t i = 0; i < ctl->map.nranks; i++) {
    uint64_t ack = load_ack(ctl, i);
    cs->in_flight |= seq != 0 && !line_done(ack, seq);
    seen[fr_ctl_low(ack) & 7] = 1;
  }
  int kinds;
  cs->state = merge_states(seen, &kinds);
  cs->agreed = !cs->in_flight && kinds == 1;
  cs->outcome = outcome_of(seq, cs->in_flight, seen[FERRY_CTL_FAILED]);
  unsigned cmd = fr_ctl_cmd_of(cs->word);
  if (cs->in_flight && cmd == FERRY_CTL_CLEAR)
    cs->state = FERRY_CTL_CLEARING;
  else if (cs->in_flight && cmd == FERRY_CTL_UPDATE)
    cs->state = FERRY_CTL_UPDATING;
}

/* ---- a small bounded text builder for details that name ranks ---- */

typedef struct text {
  char buf[400];
  size_t len;
} text;

static void text_add(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void text_add(text *t, const char *fmt, ...) {
  if (t->len >= sizeof t->buf - 1)
    return;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(t->buf + t->len, sizeof t->buf - t->len, fmt, ap);
  va_end(ap);
  if (n > 0)
    t->len = t->len + (size_t)n >= sizeof t->buf ? sizeof t->buf - 1 : t->len + (size_t)n;
}

/* "clear seq 7 on 'engine'" for details */
#define CMD_FMT "%s seq %lu on '%s'"
#define CMD_ARGS(ctl, word)                                                                        \
  ferry_ctl_cmd_name(fr_ctl_cmd_of(word)), (unsigned long)fr_ctl_cmd_seq(word), (ctl)->map.name

/* ---- open / close ---- */

int ferry_ctl_open(const char *name, ferry_ctl **out) {
  if (!out)
    return fr_err(FERRY_EINVAL, "ferry_ctl_open: out is NULL");
  ferry_ctl *ctl = calloc(1, sizeof *ctl);
  if (!ctl)
    return fr_err(FERRY_ENOMEM, "ferry_ctl_open '%s'", name ? name : "");
  ctl->spin_us = (int)fr_config_int("FERRY_CTL_SPIN_US");
  int rc = fr_ctl_map_open(name, FR_CTL_MAP_CONTROLLER, &ctl->map);
  if (rc) {
    free(ctl);
    return rc;
  }
  if (!(ctl->watch = malloc((ctl->map.nranks + 1) * sizeof *ctl->watch))) {
    fr_ctl_map_close(&ctl->map);
    free(ctl);
    return fr_err(FERRY_ENOMEM, "ferry_ctl_open '%s'", name);
  }
  for (uint32_t i = 0; i <= ctl->map.nranks; i++)
    ctl->watch[i] = (fr_ctl_watch){0, FR_CTL_WATCH_KILL};
  *out = ctl;
  return 0;
}

void ferry_ctl_close(ferry_ctl *ctl) {
  if (!ctl)
    return;
  for (uint32_t i = 0; i <= ctl->map.nranks; i++)
    fr_ctl_watch_close(&ctl->watch[i]);
  free(ctl->watch);
  fr_ctl_map_close(&ctl->map);
  free(ctl);
}

/* ---- request ---- */

/* FERRY_EPEER naming every rank that is detached or dead (among those that have not acked
 * `seq`; seq 0: among all). `dead` (from poll_watches, before issuing) says which are dead
 * without reading /proc; NULL: each rank's /proc entry is read (while waiting, every
 * FERRY_CTL_CHECK_MS). */
static int check_ranks_alive(const ferry_ctl *ctl, uint64_t seq, const char *what,
                             const bool *dead) {
  text t = {0};
  int bad = 0;
  for (uint32_t i = 0; i < ctl->map.nranks; i++) {
    if (seq && line_done(load_ack(ctl, i), seq))
      continue; /* it answered; whether it lives on matters for the next command */
    uint64_t owner = atomic_load(&ctl->map.lines[i].owner);
    bool watched = dead && owner == ctl->watch[i].owner;
    if (owner == 0)
      text_add(&t, "%srank %u is not attached", bad++ ? "; " : "", i);
    else if (watched ? dead[i] : !fr_ctl_owner_alive(owner))
      text_add(&t, "%srank %u (pid %d) is dead", bad++ ? "; " : "", i, fr_ctl_owner_pid(owner));
  }
  if (bad)
    return fr_err(FERRY_EPEER, "%s on '%s': %s", what, ctl->map.name, t.buf);
  return 0;
}

/* Points the watches at the ranks' and the engine's current processes and polls them all at
 * once: dead[i] for rank i, dead[nranks] for the engine. */
static void poll_watches(ferry_ctl *ctl, bool *dead) {
  uint32_t n = ctl->map.nranks;
  bool pidfds = n + 1 <= WATCH_PIDFD_MAX;
  for (uint32_t i = 0; i < n; i++)
    fr_ctl_watch_set(&ctl->watch[i], atomic_load(&ctl->map.lines[i].owner), pidfds);
  const fr_ctl_header *h = ctl->map.hdr;
  fr_ctl_watch_set(&ctl->watch[n], fr_ctl_owner(h->engine_pid, h->engine_start), pidfds);
  fr_ctl_watch_poll(ctl->watch, n + 1, dead);
}

/* "1,3": the ranks that have not acked the command in `word`. */
static void pending_ranks(const ferry_ctl *ctl, uint64_t word, text *t, bool with_state) {
  int n = 0;
  for (uint32_t i = 0; i < ctl->map.nranks; i++) {
    uint64_t ack = load_ack(ctl, i);
    if (line_done(ack, fr_ctl_cmd_seq(word)))
      continue;
    if (with_state)
      text_add(t, "%srank %u (%s)", n++ ? ", " : "", i, ferry_ctl_state_name(fr_ctl_low(ack)));
    else
      text_add(t, "%s%u", n++ ? "," : "", i);
  }
}

/* 1: nothing to do (CLEAR while CLEARED); 0: issue it; < 0: refused. */
static int validate(const ferry_ctl *ctl, const cell_snap *cs, ferry_ctl_cmd cmd) {
  if (cmd == FERRY_CTL_ABORT)
    return 0;
  if (cs->in_flight) {
    text t = {0};
    pending_ranks(ctl, cs->word, &t, false);
    return fr_err(FERRY_EBUSY,
                  "%s on '%s': " CMD_FMT " is still in flight (ranks %s have not acked)",
                  ferry_ctl_cmd_name(cmd), ctl->map.name, CMD_ARGS(ctl, cs->word), t.buf);
  }
  if (cmd == FERRY_CTL_CLEAR)
    return cs->state == FERRY_CTL_CLEARED ? 1 : 0;
  if (cs->state != FERRY_CTL_CLEARED)
    return fr_err(FERRY_ESTATE,
                  "update on '%s': needs every rank cleared, the engine is %s "
                  "(clear it first)",
                  ctl->map.name, ferry_ctl_state_name(cs->state));
  return 0;
}

/* The command failed on some ranks: the first failing rank's error, every failure named. */
static int failure_error(const ferry_ctl *ctl, uint64_t word) {
  text t = {0};
  int first = 0;
  for (uint32_t i = 0; i < ctl->map.nranks; i++) {
    failure f;
    read_failure(&ctl->map.lines[i], &f);
    if (f.seq != fr_ctl_cmd_seq(word))
      continue;
    int err = fr_ctl_rank_error(f.error); /* the rank may have written any value */
    text_add(&t, "%srank %u failed: %s (%s)", first ? "; " : "", i, ferry_status_name(err),
             f.message);
    if (!first)
      first = err;
  }
  if (!first) /* the records were overwritten by later failures: say what is known */
    return fr_err(FERRY_EPEER, CMD_FMT ": some ranks failed (details overwritten since)",
                  CMD_ARGS(ctl, word));
  return fr_err(first, CMD_FMT ": %s", CMD_ARGS(ctl, word), t.buf);
}

/* Every rank acked `word`: 0, or the failure. */
static int completed(const ferry_ctl *ctl, uint64_t word) {
  for (uint32_t i = 0; i < ctl->map.nranks; i++)
    if (fr_ctl_low(load_ack(ctl, i)) == FERRY_CTL_FAILED)
      return failure_error(ctl, word);
  return 0;
}

/* Records a complete command's outcome; a slot only ever moves to a larger seq, so a stale
 * writer cannot overwrite a newer record. */
static void record_outcome(fr_ctl_header *h, uint64_t seq, unsigned outcome) {
  _Atomic uint64_t *slot = &h->outcomes[seq % FR_CTL_OUTCOMES];
  uint64_t seen = atomic_load_explicit(slot, memory_order_relaxed);
  while (fr_ctl_seq(seen) < seq &&
         !atomic_compare_exchange_weak_explicit(slot, &seen, fr_ctl_word(seq, outcome),
                                                memory_order_release, memory_order_relaxed))
    ;
}

/* The command word moved on: whoever issued the next command recorded how ours ended, if it
 * had ended; no record means an abort superseded it. */
static int superseded(const ferry_ctl *ctl, uint64_t word, uint64_t now) {
  uint64_t seq = fr_ctl_cmd_seq(word), since = fr_ctl_cmd_seq(now) - seq;
  uint64_t rec =
      atomic_load_explicit(&ctl->map.hdr->outcomes[seq % FR_CTL_OUTCOMES], memory_order_acquire);
  if (fr_ctl_seq(rec) == seq)
    return fr_ctl_low(rec) == FR_CTL_OUT_OK ? 0 : failure_error(ctl, word);
  if (since < FR_CTL_OUTCOMES)
    return fr_err(FERRY_ECLOSED, CMD_FMT " was aborted (by a later command) before all ranks acked",
                  CMD_ARGS(ctl, word));
  return fr_err(FERRY_ECLOSED, CMD_FMT ": outcome unknown, %lu commands were issued since",
                CMD_ARGS(ctl, word), (unsigned long)since);
}

/* Sleeps until rank `i`'s ack word moves from `seen` (or the timeout). Counted in ack_waiters
 * first, then the word is re-read (both seq_cst, the rank's publish_ack is the other half), so
 * a rank that acks meanwhile either wakes us or is seen here. A controller that dies while
 * counted leaves the count high: ranks then always wake, as before layout 3. */
static void sleep_on_ack(const ferry_ctl *ctl, uint32_t i, uint64_t seen, int timeout_ms) {
  fr_ctl_header *h = ctl->map.hdr;
  _Atomic uint64_t *word = &ctl->map.lines[i].ack;
  atomic_fetch_add_explicit(&h->ack_waiters, 1, memory_order_seq_cst);
  if (atomic_load_explicit(word, memory_order_seq_cst) == seen)
    fr_ctl_futex_wait(word, seen, timeout_ms);
  atomic_fetch_sub_explicit(&h->ack_waiters, 1, memory_order_relaxed);
}

/* Waits on the first rank that has not acked: first yielding for up to FERRY_CTL_SPIN_US (acks
 * come within tens of microseconds; a sleep would add a wake-up of this controller to each
 * request, and to the slowest ones most: at 200 µs the requests that were already the tail
 * paid it), then sleeping; every FERRY_CTL_CHECK_MS checks the pending
 * ranks are alive, so a dead rank fails the request long before the timeout. */
static int wait_acks(const ferry_ctl *ctl, uint64_t word, int timeout_ms) {
  uint64_t seq = fr_ctl_cmd_seq(word);
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  int64_t check_ms = fr_config_int("FERRY_CTL_CHECK_MS");
  uint64_t check_ns = (uint64_t)(check_ms < 1 ? 1 : check_ms) * 1000000ull;
  uint64_t start = fr_now_ns(), next_check = start + check_ns;
  uint64_t spin_end = start + (uint64_t)(ctl->spin_us > 0 ? ctl->spin_us : 0) * 1000u;
  uint32_t from = 0; /* ranks below `from` have acked; an ack for seq is final */
  for (;;) {
    uint64_t ack = 0;
    while (from < ctl->map.nranks && line_done(ack = load_ack(ctl, from), seq))
      from++;
    if (from == ctl->map.nranks)
      return completed(ctl, word);
    uint64_t now_word = atomic_load_explicit(&ctl->map.hdr->command, memory_order_acquire);
    if (now_word != word)
      return superseded(ctl, word, now_word);
    uint64_t now = fr_now_ns();
    if (now >= deadline) {
      text t = {0};
      pending_ranks(ctl, word, &t, true);
      return fr_err(FERRY_ETIMEDOUT, CMD_FMT ": %s did not ack within %d ms", CMD_ARGS(ctl, word),
                    t.buf, timeout_ms);
    }
    if (now >= next_check) {
      int rc = check_ranks_alive(ctl, seq, ferry_ctl_cmd_name(fr_ctl_cmd_of(word)), NULL);
      if (rc)
        return rc;
      next_check = now + check_ns;
    }
    if (now < spin_end) { /* the ranks need the cores more than a sleeping controller does */
      sched_yield();
      continue;
    }
    uint64_t until = deadline < next_check ? deadline : next_check;
    sleep_on_ack(ctl, from, ack, fr_ms_left(until));
  }
}

/* Before issuing: the cell is still the one under its name, and its engine and every rank are
 * alive (one poll() over pidfds, no /proc read: a zombie counts as dead). */
static int check_cell(ferry_ctl *ctl, ferry_ctl_cmd cmd) {
  int rc = fr_ctl_map_current(&ctl->map);
  if (rc)
    return rc;
  uint32_t n = ctl->map.nranks;
  bool stack[WATCH_PIDFD_MAX], *dead = n + 1 <= WATCH_PIDFD_MAX ? stack : calloc(n + 1, 1);
  if (!dead)
    return fr_err(FERRY_ENOMEM, "%s on '%s'", ferry_ctl_cmd_name(cmd), ctl->map.name);
  poll_watches(ctl, dead);
  if (dead[n])
    rc = fr_ctl_engine_check(&ctl->map); /* the detail */
  if (rc == 0)
    rc = check_ranks_alive(ctl, 0, ferry_ctl_cmd_name(cmd), dead);
  if (dead != stack)
    free(dead);
  return rc;
}

/* A request that was issued, for its log line: its command word and the state it found. */
typedef struct issued {
  uint64_t word; /* 0: not issued (refused before, or nothing to do) */
  ferry_ctl_state from;
} issued;

static int request(ferry_ctl *ctl, ferry_ctl_cmd cmd, int timeout_ms, issued *is);

/* One line per command issued: the state it moved the engine from and to; or its failure, naming
 * the ranks (rate-limited: a dead rank fails every request). Both at info: the caller has the
 * error too (a `ferry ctl` command prints it as its one line), and the failing rank says it at
 * warn in the engine's log. A request refused before it was issued (busy, wrong state) is the
 * caller's alone. */
static void log_request(const ferry_ctl *ctl, const issued *is, int rc, uint64_t t0) {
  if (!fr_log_on(FERRY_LOG_INFO))
    return; /* a request costs microseconds: not even the clock read below when not logging */
  double ms = (double)(fr_now_ns() - t0) * 1e-6;
  if (rc != 0) {
    fr_info_limited("control: %s (after %.3f ms; the engine was %s)", ferry_last_error(), ms,
                    ferry_ctl_state_name(is->from));
    return;
  }
  cell_snap after;
  snapshot(ctl, &after);
  fr_info("control: " CMD_FMT " done in %.3f ms: %s -> %s", CMD_ARGS(ctl, is->word), ms,
          ferry_ctl_state_name(is->from), ferry_ctl_state_name(after.state));
}

int ferry_ctl_request(ferry_ctl *ctl, ferry_ctl_cmd cmd, int timeout_ms) {
  if (!ctl || cmd < FERRY_CTL_CLEAR || cmd > FERRY_CTL_ABORT)
    return fr_err(FERRY_EINVAL, "ferry_ctl_request: bad %s", ctl ? "command" : "handle");
  uint64_t t0 = fr_now_ns();
  issued is = {0};
  int rc = request(ctl, cmd, timeout_ms, &is);
  fr_ctl_count_request(cmd, rc, t0);
  if (is.word)
    log_request(ctl, &is, rc, t0);
  return rc;
}

static int request(ferry_ctl *ctl, ferry_ctl_cmd cmd, int timeout_ms, issued *is) {
  timeout_ms = fr_timeout(timeout_ms);
  int rc = check_cell(ctl, cmd);
  if (rc)
    return rc;
  cell_snap cs;
  snapshot(ctl, &cs);
  rc = validate(ctl, &cs, cmd);
  if (rc)
    return rc > 0 ? 0 : rc;
  /* Record how the previous command ended before anything can supersede it (its controller
   * may be preempted and look only later); then issue, only if nobody issued since. */
  if (cs.outcome == FR_CTL_OUT_OK || cs.outcome == FR_CTL_OUT_FAILED)
    record_outcome(ctl->map.hdr, fr_ctl_cmd_seq(cs.word), cs.outcome);
  uint64_t next = fr_ctl_cmd_word(fr_ctl_cmd_seq(cs.word) + 1, cmd);
  uint64_t seen = cs.word;
  if (!atomic_compare_exchange_strong(&ctl->map.hdr->command, &seen, next))
    return fr_err(FERRY_EBUSY, "%s on '%s': another controller issued " CMD_FMT " first",
                  ferry_ctl_cmd_name(cmd), ctl->map.name, CMD_ARGS(ctl, seen));
  fr_ctl_futex_wake(&ctl->map.hdr->command);
  fr_debug("control: issued " CMD_FMT, CMD_ARGS(ctl, next));
  *is = (issued){.word = next, .from = cs.state};
  return wait_acks(ctl, next, timeout_ms);
}

/* ---- status ---- */

int ferry_ctl_status_get(ferry_ctl *ctl, ferry_ctl_status *out) {
  if (!ctl || !out || out->size == 0)
    return fr_err(FERRY_EINVAL, "ferry_ctl_status_get: NULL handle or out->size unset");
  int rc = fr_ctl_map_current(&ctl->map);
  if (rc)
    return rc;
  cell_snap cs;
  snapshot(ctl, &cs);
  const fr_ctl_header *h = ctl->map.hdr;
  ferry_ctl_status st = {
      .size = out->size,
      .incarnation = ctl->map.incarnation, /* as checked at open: the file may say otherwise */
      .nranks = ctl->map.nranks,
      .engine_pid = h->engine_pid,
      .engine_alive = fr_ctl_pid_alive(h->engine_pid, h->engine_start),
      .seq = fr_ctl_cmd_seq(cs.word),
      .cmd = (ferry_ctl_cmd)fr_ctl_cmd_of(cs.word),
      .in_flight = cs.in_flight,
      .state = cs.state,
      .agreed = cs.agreed,
  };
  memcpy(out, &st, out->size < sizeof st ? out->size : sizeof st);
  return 0;
}

int ferry_ctl_rank_status_get(ferry_ctl *ctl, uint32_t rank, ferry_ctl_rank_status *out) {
  if (!ctl || !out || out->size == 0)
    return fr_err(FERRY_EINVAL, "ferry_ctl_rank_status_get: NULL handle or out->size unset");
  if (rank >= ctl->map.nranks)
    return fr_err(FERRY_ERANGE, "rank %u of '%s': it has %u ranks", rank, ctl->map.name,
                  ctl->map.nranks);
  const fr_ctl_line *l = &ctl->map.lines[rank];
  uint64_t owner = atomic_load(&l->owner);
  uint64_t ack = load_ack(ctl, rank);
  failure f;
  read_failure(l, &f);
  ferry_ctl_rank_status st = {
      .size = out->size,
      .rank = rank,
      .pid = fr_ctl_owner_pid(owner),
      .alive = owner != 0 && fr_ctl_owner_alive(owner),
      .seq = fr_ctl_seq(ack),
      .state = (ferry_ctl_state)fr_ctl_low(ack),
      .fail_seq = f.seq,
      .error = f.seq ? fr_ctl_rank_error(f.error) : 0,
  };
  memcpy(st.message, f.message, sizeof st.message);
  memcpy(out, &st, out->size < sizeof st ? out->size : sizeof st);
  return 0;
}
