/*
 * The objects this node owns: the table of them (sorted by key), retiring them (their
 * generation word zeroed before their block or slot can be reused; views on this host hold
 * retired objects on the pinned list until their pins drop), the replaced pool copies that
 * linger (oldest first) so gets that looked them up just before a re-put still finish, and
 * deleting an object of ours. Below the registration (register.c republishes these objects)
 * and the verbs (put.c fills the table; get.c pins objects in place; ops.c deletes).
 */
#include "store/store.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- the owned-object table: sorted by key ---- */

fr_owned *fr_store_find_owned(ferry_store *s, const char *key, size_t *at) {
  size_t lo = 0, hi = s->nowned;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (strcmp(s->owned[mid]->rec.key, key) < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  *at = lo;
  return lo < s->nowned && strcmp(s->owned[lo]->rec.key, key) == 0 ? s->owned[lo] : NULL;
}

/* ---- released: in-place objects deleted, their memory the caller's to reuse; lock held ---- */

static void released_add(ferry_store *s, const fr_owned *o) {
  if (!s->released_on || o->pool_off != FR_STORE_NO_POOL ||
      FR_GROW(s->released, s->capreleased, s->nreleased + 1, 16) != 0)
    return;
  ferry_store_info *info = &s->released[s->nreleased++];
  info->size = sizeof *info;
  fr_store_info_from(&o->rec, info);
}

/* A put of key: its memory is published again, not released. */
static void released_forget(ferry_store *s, const char *key) {
  for (size_t i = 0; i < s->nreleased;)
    if (strcmp(s->released[i].key, key) == 0)
      s->released[i] = s->released[--s->nreleased];
    else
      i++;
}

int ferry_store_released(ferry_store *s, ferry_store_info **out, size_t *n) {
  if (!s || !out || !n)
    return fr_err(FERRY_EINVAL, "ferry_store_released: NULL argument");
  pthread_mutex_lock(&s->lock);
  s->released_on = true;
  *out = s->released;
  *n = s->nreleased;
  s->released = NULL;
  s->nreleased = s->capreleased = 0;
  pthread_mutex_unlock(&s->lock);
  return 0;
}

/* Puts o in the table; returns the object it replaced (or NULL). Lock held. */
fr_owned *fr_store_owned_swap(ferry_store *s, fr_owned *o) {
  if (s->nreleased)
    released_forget(s, o->rec.key);
  size_t at;
  fr_owned *old = fr_store_find_owned(s, o->rec.key, &at);
  if (old) {
    s->owned[at] = o;
    return old;
  }
  if (s->nowned == s->capowned) { /* capacity reserved when the slot was taken */
    fr_error("store: owned table full (cannot happen)");
    return NULL;
  }
  memmove(&s->owned[at + 1], &s->owned[at], (s->nowned - at) * sizeof *s->owned);
  s->owned[at] = o;
  s->nowned++;
  return NULL;
}

static void owned_remove(ferry_store *s, size_t at) {
  memmove(&s->owned[at], &s->owned[at + 1], (s->nowned - at - 1) * sizeof *s->owned);
  s->nowned--;
}

static void release_home(ferry_store *s, fr_owned *o) {
  if (o->pool_off != FR_STORE_NO_POOL && o->on_device)
    fr_store_devpool_free(s, o->pool_off, o->pool_len);
  else if (o->pool_off != FR_STORE_NO_POOL)
    fr_pool_free(&s->pool, o->pool_off, o->pool_len);
  s->free_slots[s->nfree_slots++] = o->slot;
  free(o);
}

/* Invalidates an object's generation word, then frees its slot and block, unless a view pins it:
 * then it waits on the pinned list (true). A viewer adds its pin before it checks the
 * generation, and this zeroes the generation before it checks the pins (both sequentially
 * consistent), so either the viewer sees the object gone or this sees the pin. Lock held. */
bool fr_store_retire(ferry_store *s, fr_owned *o) {
  __atomic_store_n(fr_store_gen(s, o->slot), 0, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(fr_store_pins(s, o->slot), __ATOMIC_SEQ_CST) != 0) {
    s->pinned[s->npinned++] = o; /* it holds a slot: npinned <= nslots */
    return true;
  }
  release_home(s, o);
  return false;
}

void fr_store_pinned_reap(ferry_store *s) {
  size_t w = 0;
  for (size_t i = 0; i < s->npinned; i++) {
    fr_owned *o = s->pinned[i];
    if (__atomic_load_n(fr_store_pins(s, o->slot), __ATOMIC_SEQ_CST) == 0)
      release_home(s, o);
    else
      s->pinned[w++] = o;
  }
  s->npinned = w;
}

/* Memory published in place is the caller's again when a re-put or delete returns: wait (until
 * the deadline) for the views that still pin its old version to be released. No lock held. */
void fr_store_wait_unpinned(ferry_store *s, uint32_t slot, const char *key, uint64_t deadline) {
  uint64_t *pins = fr_store_pins(s, slot), *gen = fr_store_gen(s, slot);
  for (long ns = 20000;; ns = ns < 1000000 ? ns * 2 : ns) {
    /* a non-zero generation: the slot was freed and taken again meanwhile */
    if (__atomic_load_n(pins, __ATOMIC_SEQ_CST) == 0 || __atomic_load_n(gen, __ATOMIC_SEQ_CST))
      return;
    if (fr_ms_left(deadline) == 0) {
      uint64_t zero = 0; /* tell the views (ferry_store_view_valid) the bytes may change now */
      __atomic_compare_exchange_n(gen, &zero, FR_STORE_GEN_ABANDONED, false, __ATOMIC_SEQ_CST,
                                  __ATOMIC_SEQ_CST);
      fr_warn("store '%s': views of the old '%s' are still held; its memory (published in place) "
              "is the caller's again, and they may see it change",
              s->name, key);
      return;
    }
    struct timespec ts = {0, ns};
    nanosleep(&ts, NULL);
  }
}

/* ---- lingering copies: oldest first; lock held ---- */

void fr_store_linger_push(ferry_store *s, fr_owned *o) {
  o->replaced_ns = fr_now_ns();
  s->linger[s->nlinger++] = o; /* o holds a slot, so nowned + nlinger <= nslots */
}

static void linger_remove(ferry_store *s, size_t i) {
  fr_store_retire(s, s->linger[i]);
  memmove(&s->linger[i], &s->linger[i + 1], (s->nlinger - i - 1) * sizeof *s->linger);
  s->nlinger--;
}

bool fr_store_linger_pop(ferry_store *s) {
  if (s->nlinger == 0)
    return false;
  linger_remove(s, 0);
  return true;
}

bool fr_store_linger_pop_in(ferry_store *s, bool device) {
  for (size_t i = 0; i < s->nlinger; i++)
    if (s->linger[i]->on_device == device) {
      linger_remove(s, i);
      return true;
    }
  return false;
}

bool fr_store_linger_can_help(ferry_store *s, bool device, uint64_t bytes) {
  const fr_pool *p = device ? &s->dev.pool : &s->pool;
  if (bytes > p->capacity)
    return false; /* and rounding it cannot overflow */
  uint64_t lingering = 0;
  for (size_t i = 0; i < s->nlinger; i++)
    if (s->linger[i]->on_device == device && s->linger[i]->pool_off != FR_STORE_NO_POOL)
      lingering += fr_pool_round(p, s->linger[i]->pool_len);
  return fr_pool_round(p, bytes) <= p->capacity - p->used + lingering;
}

void fr_store_linger_expire(ferry_store *s, uint64_t now) {
  uint64_t age = (uint64_t)s->linger_ms * 1000000ull;
  while (s->nlinger > 0 && now - s->linger[0]->replaced_ns > age)
    fr_store_linger_pop(s);
}

void fr_store_linger_reap(ferry_store *s) {
  pthread_mutex_lock(&s->lock);
  fr_store_linger_expire(s, fr_now_ns());
  fr_store_pinned_reap(s);
  pthread_mutex_unlock(&s->lock);
}

void fr_store_retire_all(ferry_store *s) {
  pthread_mutex_lock(&s->lock);
  for (size_t i = 0; i < s->nowned; i++)
    fr_store_retire(s, s->owned[i]);
  s->nowned = 0;
  while (fr_store_linger_pop(s))
    ;
  for (size_t i = 0; i < s->npinned; i++) { /* the pool goes with the store; views keep a mapping */
    if (s->pinned[i]->pool_off == FR_STORE_NO_POOL) /* the caller's memory: no longer ours */
      __atomic_store_n(fr_store_gen(s, s->pinned[i]->slot), FR_STORE_GEN_ABANDONED,
                       __ATOMIC_SEQ_CST);
    release_home(s, s->pinned[i]);
  }
  s->npinned = 0;
  pthread_mutex_unlock(&s->lock);
}

/* ---- publish_lock ---- */

int fr_store_publish_lock(ferry_store *s, const char *by, uint64_t deadline, int timeout_ms,
                          fr_store_wait *w) {
  *w = (fr_store_wait){0};
  if (pthread_mutex_trylock(&s->publish_lock) != 0) {
    const char *behind = __atomic_load_n(&s->publish_by, __ATOMIC_ACQUIRE);
    w->behind = behind ? behind : "another call to the directory";
    uint64_t t0 = fr_now_ns();
    if (timeout_ms < 0)
      pthread_mutex_lock(&s->publish_lock);
    else if (fr_mutex_lock_until(&s->publish_lock, deadline) != 0)
      return fr_err(FERRY_ETIMEDOUT,
                    "timed out after %d ms waiting for the directory at %s behind %s of node '%s'",
                    timeout_ms, s->dir->url, w->behind, s->lease.node.name);
    w->waited_ms = (int)((fr_now_ns() - t0) / 1000000);
  }
  __atomic_store_n(&s->publish_by, by, __ATOMIC_RELEASE);
  return 0;
}

void fr_store_publish_unlock(ferry_store *s) {
  __atomic_store_n(&s->publish_by, NULL, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&s->publish_lock);
}

int fr_store_waited(ferry_store *s, int rc, const fr_store_wait *w, int timeout_ms) {
  if (rc != FERRY_ETIMEDOUT || !w->behind || w->waited_ms < 1)
    return rc;
  return fr_err_wrap(rc,
                     "no answer from the directory at %s within %d ms (%d ms of them behind %s)",
                     s->dir->url, timeout_ms, w->waited_ms, w->behind);
}

/* ---- delete ---- */

/* publish_lock held. */
int fr_store_delete_owned(ferry_store *s, const char *key, uint64_t generation, bool in_directory,
                          int timeout_ms, uint32_t *pinned_slot) {
  if (pinned_slot)
    *pinned_slot = UINT32_MAX;
  pthread_mutex_lock(&s->lock);
  size_t at;
  fr_owned *o = fr_store_find_owned(s, key, &at);
  bool match = o && (generation == 0 || o->rec.generation == generation);
  uint64_t gen = match ? o->rec.generation : 0;
  pthread_mutex_unlock(&s->lock);
  if (!match)
    return fr_err(FERRY_ENOTFOUND, "'%s' is not held by '%s'", key, s->name);
  if (in_directory) {
    int rc = fr_dir_obj_del(s->dir, key, s->name, gen, NULL, timeout_ms);
    if (rc != 0 && rc != FERRY_ENOTFOUND) /* ENOTFOUND: replaced elsewhere, or lost */
      return rc;
  }
  pthread_mutex_lock(&s->lock);
  o = fr_store_find_owned(s, key, &at); /* the publish lock kept it in place */
  owned_remove(s, at);
  released_add(s, o);
  uint32_t slot = o->slot;
  bool in_place = o->pool_off == FR_STORE_NO_POOL;
  bool pinned = fr_store_retire(s, o);
  pthread_mutex_unlock(&s->lock);
  if (pinned && in_place && pinned_slot)
    *pinned_slot = slot;
  else if (pinned && in_place) /* nobody to wait for: the views learn it from view_valid */
    fr_store_wait_unpinned(s, slot, key, 0);
  return 0;
}

int fr_store_delete_local(ferry_store *s, const char *key, uint64_t generation, bool in_directory,
                          bool wait_views, int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  uint32_t slot;
  fr_store_wait w;
  int rc = fr_store_publish_lock(s, "a delete", deadline, timeout_ms, &w);
  if (rc != 0)
    return fr_err_wrap(rc, "delete '%s'", key);
  rc = fr_store_delete_owned(s, key, generation, in_directory, fr_store_left(deadline), &slot);
  fr_store_publish_unlock(s);
  rc = fr_store_waited(s, rc, &w, timeout_ms);
  if (slot != UINT32_MAX) /* outside the publish lock: other puts go on meanwhile */
    fr_store_wait_unpinned(s, slot, key, wait_views ? deadline : 0);
  return rc;
}
