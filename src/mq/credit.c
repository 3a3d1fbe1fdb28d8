/*
 * Credit: what each subscriber lets a publisher have in flight, and the wait for it. A publish
 * takes credit for every subscriber of its topic at once, or none at the deadline.
 */
#include "mq/publish.h"

#include <stdlib.h>
#include <string.h>

#define CHARGE_OVERHEAD 128u

uint64_t fr_mq_charge_for(const fr_mq_peer *p, uint64_t len) {
  uint64_t c = len + CHARGE_OVERHEAD;
  return c > p->window / 2 ? p->window / 2 : c;
}

bool fr_mq_peer_alive(const fr_mq_peer *p) { return !p->dead && ferry_link_status(p->link) == 0; }

static bool has_credit(const fr_mq_peer *p, uint64_t len) {
  return p->sent - p->acked + fr_mq_charge_for(p, len) <= p->window;
}

bool fr_mq_credit_ready(ferry_mq *mq, void *arg) {
  fr_mq_pub_wait *w = arg;
  for (size_t i = 0; i < w->t->nsubs; i++)
    if (fr_mq_peer_alive(w->t->subs[i]) && !has_credit(w->t->subs[i], w->len))
      return false;
  return true;
}

static int full_error(ferry_mq *mq, fr_mq_topic *t, uint64_t len, int rc, int ms) {
  if (rc == FERRY_ECLOSED)
    return fr_err(rc, "publish '%s': mq closing", t->name);
  for (size_t i = 0; i < t->nsubs; i++) {
    fr_mq_peer *p = t->subs[i];
    if (fr_mq_peer_alive(p) && !has_credit(p, len))
      return fr_err(FERRY_ETIMEDOUT,
                    "publish '%s': subscriber '%s' did not take the message within %d ms (its "
                    "queue holds %llu of %llu bytes)",
                    t->name, p->name, ms, (unsigned long long)(p->sent - p->acked),
                    (unsigned long long)p->window);
  }
  return fr_err(FERRY_ETIMEDOUT, "publish '%s': timed out", t->name);
}

/* Who holds a publish back: the first live subscriber without room for it, copied while the lock
 * is held (the peer may go while the publish waits). Only copied: the line is formatted only
 * when the wait turns out long. */
typedef struct holder {
  char name[FR_DIR_NAME_MAX + 1]; /* "" when none was found */
  uint64_t queued, window;
} holder;

static void find_holder(const fr_mq_topic *t, uint64_t len, holder *h) {
  h->name[0] = '\0';
  h->queued = h->window = 0;
  for (size_t i = 0; i < t->nsubs; i++) {
    const fr_mq_peer *p = t->subs[i];
    if (fr_mq_peer_alive(p) && !has_credit(p, len)) {
      memcpy(h->name, p->name, sizeof h->name);
      h->queued = p->sent - p->acked;
      h->window = p->window;
      return;
    }
  }
}

/* A subscriber that held a publish back longer than FERRY_MQ_STALL_LOG_MS: who, how long, on
 * which topic. Rate-limited: a stalled subscriber holds back every publish to it. */
static void log_stall(const ferry_mq *mq, const fr_mq_topic *t, const holder *h, uint64_t ns,
                      int rc) {
  fr_warn_limited("mq '%s': a publish on '%s' waited %.3f s for subscriber '%s' to take messages "
                  "(its queue held %llu of %llu bytes)%s",
                  mq->name, t->name, (double)ns * 1e-9, h->name[0] ? h->name : "?",
                  (unsigned long long)h->queued, (unsigned long long)h->window,
                  rc == FERRY_ETIMEDOUT ? "; the publish timed out" : "");
}

/* Waits for credit and takes it: *out lists the subscribers, each held for the sends. A peer
 * with a pending batch is held by mq->dirty until a flush, and flushes need publish_lock, which
 * the publish holds: it takes no reference of its own on those, so a publish in a stream needs
 * no lock round after its sends (see settle_quiet). */

int fr_mq_reserve(ferry_mq *mq, fr_mq_topic *t, uint64_t len, uint64_t deadline, int ms, bool ready,
                  fr_mq_target *local, fr_mq_target **out, size_t *n, bool *waited) {
  fr_mq_pub_wait w = {t, len};
  int rc = 0;
  *waited = !ready && !fr_mq_credit_ready(mq, &w); /* ready: the caller just found credit */
  if (*waited) {
    uint64_t t0 = fr_now_ns();
    holder h;
    find_holder(t, len, &h);
    rc = fr_mq_wait(mq, fr_mq_credit_ready, &w, deadline);
    mq->credit_waits++;
    uint64_t ns = fr_now_ns() - t0;
    mq->credit_wait_ns += ns;
    if (ns >= mq->stall_log_ns && rc != FERRY_ECLOSED)
      log_stall(mq, t, &h, ns, rc);
  }
  if (rc != 0)
    return full_error(mq, t, len, rc, ms);
  fr_mq_target *v = t->nsubs <= FR_MQ_LOCAL_TARGETS ? local : calloc(t->nsubs, sizeof *v);
  if (!v)
    return fr_err(FERRY_ENOMEM, "publish '%s'", t->name);
  size_t k = 0;
  for (size_t i = 0; i < t->nsubs; i++) {
    fr_mq_peer *p = t->subs[i];
    v[k] = (fr_mq_target){.p = p, .charge = fr_mq_charge_for(p, len), .ref = !p->dirty, .rc = 0};
    v[k].shm = len > mq->inline_bytes && strcmp(ferry_link_transport(p->link), "shm") == 0;
    __atomic_store_n(&p->sent, p->sent + v[k].charge, __ATOMIC_RELAXED); /* on_credit reads it */
    p->refs += v[k].ref;
    k++;
  }
  *out = v;
  *n = k;
  return 0;
}
