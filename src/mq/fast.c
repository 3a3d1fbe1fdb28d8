/*
 * The lock-free fast path: a publish in a stream to the subscribers of the previous one takes
 * its credit without mq->lock, since their pending batches (and publish_lock) hold them.
 */
#include "mq/publish.h"

#include <string.h>

/* The last publish's topic and subscribers, for a publish in a stream to reuse without taking
 * mq->lock (publish_lock). Valid while mq->subs_gen is unchanged (a subscriber added, removed
 * or dropped bumps it) and every subscriber in it has a pending batch: mq->dirty holds those,
 * and only a flush, which needs publish_lock, lets them go. */
void fr_mq_fast_remember(ferry_mq *mq, fr_mq_topic *t, const fr_mq_pub *u, uint64_t loan) {
  fr_mq_fast *c = &mq->fast;
  c->t = NULL;
  if (loan || u->fr.token || u->n > FR_MQ_FAST_SUBS)
    return;
  for (size_t i = 0; i < u->n; i++) {
    if (!fr_mq_peer_alive(u->v[i].p) || u->v[i].shm)
      return;
    c->subs[i] = u->v[i].p;
  }
  c->t = t;
  c->n = u->n;
  c->gen = mq->subs_gen; /* lock held: no bump in flight */
}

static bool listed_dirty(const ferry_mq *mq, const fr_mq_peer *p) { /* compares pointers only */
  for (size_t i = 0; i < mq->ndirty; i++)
    if (mq->dirty[i] == p)
      return true;
  return false;
}

/* The targets of a publish in a stream, with their credit taken, without mq->lock: false when
 * the remembered subscribers do not hold (then the publish takes the lock). */
bool fr_mq_fast_reserve(ferry_mq *mq, const char *topic, uint64_t len, fr_mq_pub *u) {
  fr_mq_fast *c = &mq->fast;
  if (!c->t || len > mq->inline_bytes)
    return false;
  for (size_t i = 0; i < c->n; i++)
    if (!listed_dirty(mq, c->subs[i])) /* before anything reads the peer: it may be gone */
      return false;
  if (__atomic_load_n(&mq->subs_gen, __ATOMIC_ACQUIRE) != c->gen || strcmp(c->t->name, topic))
    return false;
  for (size_t i = 0; i < c->n; i++) {
    fr_mq_peer *p = c->subs[i];
    uint64_t acked = __atomic_load_n(&p->acked, __ATOMIC_ACQUIRE);
    if (ferry_link_status(p->link) != 0 || p->sent - acked + fr_mq_charge_for(p, len) > p->window)
      return false; /* a dead link or a wait for credit: the full path */
  }
  for (size_t i = 0; i < c->n; i++) {
    fr_mq_peer *p = c->subs[i];
    u->local[i] = (fr_mq_target){.p = p, .charge = fr_mq_charge_for(p, len)};
    __atomic_store_n(&p->sent, p->sent + u->local[i].charge, __ATOMIC_RELAXED);
  }
  u->v = u->local;
  u->n = c->n;
  u->seq = ++mq->seq;
  u->t = c->t;
  return true;
}
