/*
 * The node's registration: its lease in the directory (fr_dir_lease), taken at open and renewed
 * by the node's timer (directory/lease.c), and what happens when the directory lost the node (it
 * restarted, or a lease lapsed): register again and publish every owned object again. Also the
 * answers of posted puts (fr_store_settle): a replaced record of another owner gets a drop notice
 * (msg.c), a lost registration marks the node for registering again. Above owned.c and msg.c; put.c
 * calls it before each publish, service.c on its ticks.
 */
#include "store/store.h"

#include <stdlib.h>

/* Re-publishes every owned object by the deadline (one for all of them, not a timeout each);
 * keys another node took meanwhile are dropped here. */
static int republish(ferry_store *s, uint64_t deadline) {
  pthread_mutex_lock(&s->lock);
  size_t n = s->nowned;
  fr_dir_object *recs = malloc((n ? n : 1) * sizeof *recs);
  for (size_t i = 0; recs && i < n; i++)
    recs[i] = s->owned[i]->rec;
  pthread_mutex_unlock(&s->lock);
  if (!recs)
    return fr_err(FERRY_ENOMEM, "store: re-registration");
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    rc = fr_dir_obj_put(s->dir, &recs[i], FR_DIR_PUT_KEEP_OTHERS, NULL, NULL,
                        fr_store_left(deadline));
    if (rc == FERRY_EEXIST) {
      fr_info_limited("store '%s': '%s' now belongs to another node; dropping our copy", s->name,
                      recs[i].key);
      rc = 0;
      fr_store_delete_owned(s, recs[i].key, recs[i].generation, false, fr_store_left(deadline),
                            NULL);
    }
  }
  free(recs);
  return rc;
}

/* publish_lock held. Registers the node (taking its name over from a dead holder); unless
 * `fresh`, publishes every owned object again (the directory lost them). All of it within
 * timeout_ms: a put that registers again first still returns by its own timeout. */
int fr_store_register(ferry_store *s, bool fresh, int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(fr_timeout(timeout_ms));
  int rc = fr_dir_lease_take(&s->lease, fr_store_left(deadline));
  if (rc == 0 && !fresh && (rc = republish(s, deadline)) != 0)
    fr_dir_lease_lost(&s->lease);
  return rc;
}

/* publish_lock held. */
int fr_store_ensure_registered(ferry_store *s, int timeout_ms) {
  bool due = __atomic_exchange_n(&s->republish_due, false, __ATOMIC_SEQ_CST);
  if (!due && fr_dir_lease_current(&s->lease))
    return 0;
  fr_info("store '%s': directory changed; registering again", s->name);
  int rc = fr_store_register(s, false, timeout_ms);
  if (rc != 0 && due)
    __atomic_store_n(&s->republish_due, true, __ATOMIC_SEQ_CST);
  return rc;
}

/* A posted put's answer that needs acting on (fr_dir_settle_fn). */
static void settled(void *arg, const fr_dir_object *put, int status,
                    const fr_dir_object *replaced) {
  ferry_store *s = arg;
  if (status == 0) {
    fr_store_send_dropped(s, replaced);
  } else if (status == FERRY_ENOTFOUND || status == FERRY_EPEER || status == FERRY_ECLOSED ||
             status == FERRY_ETIMEDOUT) { /* not registered there, or the answer was lost */
    fr_info("store '%s': the directory may have missed put '%s' (%s); registering again", s->name,
            put->key, ferry_last_error());
    __atomic_store_n(&s->republish_due, true, __ATOMIC_SEQ_CST);
  } else {
    fr_warn("store '%s': the directory refused put '%s': %s", s->name, put->key,
            ferry_last_error());
  }
}

void fr_store_settle(ferry_store *s, bool wait, uint64_t deadline) {
  fr_dir_settle(s->dir, wait, settled, s, wait ? fr_ms_left(deadline) : 0);
  if (!__atomic_load_n(&s->republish_due, __ATOMIC_SEQ_CST))
    return;
  /* within the caller's deadline: a put that cannot have the lock in time fails on its own
   * try for it, and the flag stays for the next put or renewal */
  fr_store_wait w;
  int ms = fr_ms_left(deadline);
  if (ms <= 0 || fr_store_publish_lock(s, "registering the node again", deadline, ms, &w) != 0) {
    fr_err_clear();
    return;
  }
  if (fr_store_ensure_registered(s, fr_store_left(deadline)) != 0)
    fr_warn("store '%s': registering again: %s", s->name, ferry_last_error());
  fr_store_publish_unlock(s);
}

/* The store's own records when it leaves a node that its context's other jobs keep (mq's and
 * refit's records stay): deleted within one bound for all of them (FR_CLOSE_DELETE_MS), not one
 * timeout per record, since a directory that does not answer the first answers none; those left
 * go at the node's renewals (handed over at once: one wait for the node's lock), or with its
 * lease. */
#define FR_CLOSE_DELETE_MS 2000
static void delete_records(ferry_store *s) {
  pthread_mutex_lock(&s->lock);
  size_t n = s->nowned, left = 0;
  fr_dir_object *recs = malloc((n ? n : 1) * sizeof *recs);
  for (size_t i = 0; recs && i < n; i++)
    recs[i] = s->owned[i]->rec;
  pthread_mutex_unlock(&s->lock);
  uint64_t deadline = fr_deadline_ns(FR_CLOSE_DELETE_MS);
  for (size_t i = 0; recs && i < n; i++) {
    int ms = fr_ms_left(deadline);
    int rc = ms > 0
                 ? fr_dir_obj_del(s->dir, recs[i].key, recs[i].owner, recs[i].generation, NULL, ms)
                 : FERRY_ETIMEDOUT;
    if (rc != 0 && rc != FERRY_ENOTFOUND)
      recs[left++] = recs[i]; /* the node's renewals delete it */
  }
  if (recs)
    fr_dir_lease_orphan(&s->lease, recs, left);
  if (!recs || left > 0)
    fr_info("store '%s': %zu of its %zu records stay in the directory until node '%s' renews "
            "its lease or leaves",
            s->name, recs ? left : n, n, s->lease.node.name);
  fr_err_clear();
  free(recs);
}

/* A closing store first collects its posted puts' answers, so that a put that replaced another
 * node's record tells that node (DROPPED) before this store goes: nothing polls for them, and
 * the next put or renewal that would have collected them will not come. Bounded like a link's
 * graceful close (FR_CLOSE_SETTLE_MS). */
#define FR_CLOSE_SETTLE_MS 2000
void fr_store_unregister(ferry_store *s) {
  int ms = fr_timeout(-1);
  fr_dir_settle(s->dir, true, settled, s, ms < FR_CLOSE_SETTLE_MS ? ms : FR_CLOSE_SETTLE_MS);
  if (!fr_dir_lease_alone(&s->lease))
    delete_records(s);
  fr_dir_lease_drop(&s->lease);
}

/* The store's republish (fr_dir_lease_set_republish): the node's timer calls it after the
 * directory lost the node, on a worker of the task pool. The renewal itself asked the directory
 * without publish_lock (a directory that does not answer would hold it for a third of the lease,
 * and puts and deletes would wait behind it past their own timeouts): only publishing every
 * object again is ordered with puts and deletes. A failure is tried again by the timer. */
static int republish_again(void *arg, int timeout_ms) {
  ferry_store *s = arg;
  fr_store_wait w;
  fr_store_publish_lock(s, "publishing its objects again", 0, -1, &w);
  int rc = republish(s, timeout_ms);
  fr_store_publish_unlock(s);
  return rc;
}

void fr_store_republish_by_timer(ferry_store *s, bool on) {
  fr_dir_lease_set_republish(&s->lease, on ? republish_again : NULL, on ? s : NULL);
}
