/*
 * The controller side of a control cell: validate a transition against a consistent snapshot of
 * the rank lines, issue the command with one compare-and-swap of the command word (a second
 * controller racing for the same word loses and gets FERRY_EBUSY; nothing is ever written back),
 * wake the ranks, and wait on the rank lines' futexes until every rank acked, checking every
 * FERRY_CTL_CHECK_MS that the ranks still waited on are alive. Also the status snapshots and the
 * state/command names.
 */
#include "control/cell.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ferry_ctl {
  fr_ctl_map map;
};

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

typedef struct line_snap {
  uint64_t ack;
  uint64_t owner;
  int error;
  char message[FERRY_CTL_MESSAGE_MAX];
} line_snap;

/* A seqlock read: the ack word is stored last (release) by the rank, so reading it before and
 * after the other fields proves they belong to that ack. */
static void read_line(const fr_ctl_line *l, line_snap *s) {
  for (int tries = 0;; tries++) {
    s->ack = atomic_load_explicit(&l->ack, memory_order_acquire);
    s->owner = atomic_load_explicit(&l->owner, memory_order_relaxed);
    s->error = atomic_load_explicit(&l->error, memory_order_relaxed);
    for (int i = 0; i < FR_CTL_MSG_WORDS; i++) {
      uint64_t w = atomic_load_explicit(&l->message[i], memory_order_relaxed);
      memcpy(s->message + 8 * i, &w, 8);
    }
    s->message[FERRY_CTL_MESSAGE_MAX - 1] = '\0';
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&l->ack, memory_order_relaxed) == s->ack || tries > 1000)
      return;
  }
}

static bool line_done(uint64_t ack, uint64_t seq) {
  return fr_ctl_seq(ack) == seq && fr_ctl_state_terminal(fr_ctl_low(ack));
}

typedef struct cell_snap {
  uint64_t word;
  bool in_flight, agreed;
  ferry_ctl_state state;
} cell_snap;

static ferry_ctl_state merge_states(const uint8_t *seen) {
  if (seen[FERRY_CTL_ABSENT])
    return FERRY_CTL_ABSENT;
  if (seen[FERRY_CTL_UPDATING])
    return FERRY_CTL_UPDATING;
  if (seen[FERRY_CTL_CLEARING])
    return FERRY_CTL_CLEARING;
  int kinds = 0;
  ferry_ctl_state one = FERRY_CTL_FAILED;
  for (int s = FERRY_CTL_SERVING; s <= FERRY_CTL_FAILED; s++)
    if (seen[s]) {
      kinds++;
      one = (ferry_ctl_state)s;
    }
  return kinds == 1 ? one : FERRY_CTL_FAILED;
}

static void snapshot(const ferry_ctl *ctl, cell_snap *cs) {
  cs->word = atomic_load_explicit(&ctl->map.hdr->command, memory_order_acquire);
  uint64_t seq = fr_ctl_seq(cs->word);
  uint8_t seen[8] = {0};
  cs->in_flight = false;
  for (uint32_t i = 0; i < ctl->map.nranks; i++) {
    uint64_t ack = atomic_load_explicit(&ctl->map.lines[i].ack, memory_order_acquire);
    cs->in_flight |= !line_done(ack, seq);
    seen[fr_ctl_low(ack) & 7] = 1;
  }
  cs->state = merge_states(seen);
  cs->agreed = !cs->in_flight && cs->state != FERRY_CTL_FAILED;
  if (!cs->agreed && !cs->in_flight && seen[FERRY_CTL_FAILED])
    cs->agreed = !seen[FERRY_CTL_SERVING] && !seen[FERRY_CTL_CLEARED];
  unsigned cmd = fr_ctl_low(cs->word);
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
  t->len = n < 0                                 ? t->len
           : t->len + (size_t)n >= sizeof t->buf ? sizeof t->buf - 1
                                                 : t->len + (size_t)n;
}

/* ---- open / close ---- */

int ferry_ctl_open(const char *name, ferry_ctl **out) {
  if (!out)
    return fr_err(FERRY_EINVAL, "ferry_ctl_open: out is NULL");
  ferry_ctl *ctl = calloc(1, sizeof *ctl);
  if (!ctl)
    return fr_err(FERRY_ENOMEM, "ferry_ctl_open '%s'", name ? name : "");
  int rc = fr_ctl_map_open(name, FR_CTL_MAP_CONTROLLER, &ctl->map);
  if (rc) {
    free(ctl);
    return rc;
  }
  *out = ctl;
  return 0;
}

void ferry_ctl_close(ferry_ctl *ctl) {
  if (!ctl)
    return;
  fr_ctl_map_close(&ctl->map);
  free(ctl);
}

/* ---- request ---- */

/* FERRY_EPEER naming every rank that is detached or dead. */
static int check_ranks_alive(const ferry_ctl *ctl, uint64_t seq, const char *what) {
  text t = {0};
  int bad = 0;
  for (uint32_t i = 0; i < ctl->map.nranks; i++) {
    uint64_t ack = atomic_load_explicit(&ctl->map.lines[i].ack, memory_order_acquire);
    if (seq && line_done(ack, seq))
      continue; /* it answered; whether it lives on matters for the next command */
    uint64_t owner = atomic_load(&ctl->map.lines[i].owner);
    if (owner == 0)
      text_add(&t, "%srank %u is not attached", bad++ ? "; " : "", i);
    else if (!fr_ctl_owner_alive(owner))
      text_add(&t, "%srank %u (pid %d) is dead", bad++ ? "; " : "", i, fr_ctl_owner_pid(owner));
  }
  if (bad)
    return fr_err(FERRY_EPEER, "%s on '%s': %s", what, ctl->map.name, t.buf);
  return 0;
}

static int busy_error(const ferry_ctl *ctl, const cell_snap *cs, ferry_ctl_cmd cmd) {
  text t = {0};
  uint64_t seq = fr_ctl_seq(cs->word);
  int n = 0;
  for (uint32_t i = 0; i < ctl->map.nranks; i++) {
    uint64_t ack = atomic_load_explicit(&ctl->map.lines[i].ack, memory_order_acquire);
    if (!line_done(ack, seq))
      text_add(&t, "%s%u", n++ ? "," : "", i);
  }
  return fr_err(FERRY_EBUSY, "%s on '%s': %s seq %lu is still in flight (ranks %s have not acked)",
                ferry_ctl_cmd_name(cmd), ctl->map.name, ferry_ctl_cmd_name(fr_ctl_low(cs->word)),
                (unsigned long)seq, t.buf);
}

/* 1: nothing to do (CLEAR while CLEARED); 0: issue it; < 0: refused. */
static int validate(const ferry_ctl *ctl, const cell_snap *cs, ferry_ctl_cmd cmd) {
  if (cmd == FERRY_CTL_ABORT)
    return 0;
  if (cs->in_flight)
    return busy_error(ctl, cs, cmd);
  if (cmd == FERRY_CTL_CLEAR)
    return cs->state == FERRY_CTL_CLEARED ? 1 : 0;
  if (cs->state != FERRY_CTL_CLEARED)
    return fr_err(FERRY_ESTATE, "update on '%s': needs every rank cleared, the engine is %s%s",
                  ctl->map.name, ferry_ctl_state_name(cs->state),
                  cs->state == FERRY_CTL_FAILED ? " (clear it first)" : " (clear it first)");
  return 0;
}

static int timeout_error(const ferry_ctl *ctl, uint64_t word, int timeout_ms) {
  text t = {0};
  int n = 0;
  for (uint32_t i = 0; i < ctl->map.nranks; i++) {
    uint64_t ack = atomic_load_explicit(&ctl->map.lines[i].ack, memory_order_acquire);
    if (!line_done(ack, fr_ctl_seq(word)))
      text_add(&t, "%srank %u (%s)", n++ ? ", " : "", i, ferry_ctl_state_name(fr_ctl_low(ack)));
  }
  return fr_err(FERRY_ETIMEDOUT, "%s seq %lu on '%s': %s did not ack within %d ms",
                ferry_ctl_cmd_name(fr_ctl_low(word)), (unsigned long)fr_ctl_seq(word),
                ctl->map.name, t.buf, timeout_ms);
}

/* Every rank acked: 0, or the first failing rank's error with every failure named. */
static int collect_result(const ferry_ctl *ctl, uint64_t word) {
  text t = {0};
  int first = 0;
  for (uint32_t i = 0; i < ctl->map.nranks; i++) {
    line_snap s;
    read_line(&ctl->map.lines[i], &s);
    if (fr_ctl_low(s.ack) != FERRY_CTL_FAILED)
      continue;
    if (!first)
      first = s.error < 0 ? s.error : FERRY_EPEER;
    text_add(&t, "%srank %u failed: %s (%s)", first && t.len ? "; " : "", i,
             ferry_status_name(s.error), s.message);
  }
  if (!first)
    return 0;
  return fr_err(first, "%s seq %lu on '%s': %s", ferry_ctl_cmd_name(fr_ctl_low(word)),
                (unsigned long)fr_ctl_seq(word), ctl->map.name, t.buf);
}

static int wait_acks(const ferry_ctl *ctl, uint64_t word, int timeout_ms) {
  uint64_t seq = fr_ctl_seq(word);
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  int64_t check_ms = fr_config_int("FERRY_CTL_CHECK_MS");
  uint64_t check_ns = (uint64_t)(check_ms < 1 ? 1 : check_ms) * 1000000ull;
  uint64_t next_check = fr_now_ns() + check_ns;
  uint32_t from = 0; /* ranks below `from` have acked; an ack for seq is final */
  for (;;) {
    uint64_t ack = 0;
    while (
        from < ctl->map.nranks &&
        line_done(ack = atomic_load_explicit(&ctl->map.lines[from].ack, memory_order_acquire), seq))
      from++;
    if (from == ctl->map.nranks)
      return collect_result(ctl, word);
    if (atomic_load_explicit(&ctl->map.hdr->command, memory_order_acquire) != word)
      return fr_err(FERRY_ECLOSED,
                    "%s seq %lu on '%s' was superseded (aborted) before all ranks "
                    "acked",
                    ferry_ctl_cmd_name(fr_ctl_low(word)), (unsigned long)seq, ctl->map.name);
    uint64_t now = fr_now_ns();
    if (now >= deadline)
      return timeout_error(ctl, word, timeout_ms);
    if (now >= next_check) {
      int rc = check_ranks_alive(ctl, seq, ferry_ctl_cmd_name(fr_ctl_low(word)));
      if (rc)
        return rc;
      next_check = now + check_ns;
    }
    uint64_t until = deadline < next_check ? deadline : next_check;
    fr_ctl_futex_wait(&ctl->map.lines[from].ack, ack, fr_ms_left(until));
  }
}

int ferry_ctl_request(ferry_ctl *ctl, ferry_ctl_cmd cmd, int timeout_ms) {
  if (!ctl || cmd < FERRY_CTL_CLEAR || cmd > FERRY_CTL_ABORT)
    return fr_err(FERRY_EINVAL, "ferry_ctl_request: bad %s", ctl ? "command" : "handle");
  timeout_ms = fr_timeout(timeout_ms);
  int rc = fr_ctl_map_current(&ctl->map);
  if (rc == 0)
    rc = fr_ctl_engine_check(&ctl->map);
  if (rc == 0)
    rc = check_ranks_alive(ctl, 0, ferry_ctl_cmd_name(cmd));
  if (rc)
    return rc;
  cell_snap cs;
  snapshot(ctl, &cs);
  rc = validate(ctl, &cs, cmd);
  if (rc)
    return rc > 0 ? 0 : rc;
  uint64_t next = fr_ctl_word(fr_ctl_seq(cs.word) + 1, cmd);
  uint64_t expected = cs.word;
  if (!atomic_compare_exchange_strong(&ctl->map.hdr->command, &expected, next))
    return fr_err(FERRY_EBUSY, "%s on '%s': another controller issued %s seq %lu first",
                  ferry_ctl_cmd_name(cmd), ctl->map.name, ferry_ctl_cmd_name(fr_ctl_low(expected)),
                  (unsigned long)fr_ctl_seq(expected));
  fr_ctl_futex_wake(&ctl->map.hdr->command);
  fr_debug("control '%s': issued %s seq %lu", ctl->map.name, ferry_ctl_cmd_name(cmd),
           (unsigned long)fr_ctl_seq(next));
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
      .incarnation = h->incarnation,
      .nranks = h->nranks,
      .engine_pid = h->engine_pid,
      .engine_alive = fr_ctl_pid_alive(h->engine_pid, h->engine_start),
      .seq = fr_ctl_seq(cs.word),
      .cmd = (ferry_ctl_cmd)fr_ctl_low(cs.word),
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
  line_snap s;
  read_line(&ctl->map.lines[rank], &s);
  ferry_ctl_rank_status st = {
      .size = out->size,
      .rank = rank,
      .pid = fr_ctl_owner_pid(s.owner),
      .alive = s.owner != 0 && fr_ctl_owner_alive(s.owner),
      .seq = fr_ctl_seq(s.ack),
      .state = (ferry_ctl_state)fr_ctl_low(s.ack),
      .error = s.error,
  };
  memcpy(st.message, s.message, sizeof st.message);
  memcpy(out, &st, out->size < sizeof st ? out->size : sizeof st);
  return 0;
}
