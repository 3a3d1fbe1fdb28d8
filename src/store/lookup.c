/*
 * The lookup cache: key → record. A key looked up again (a view after a get, a get after a stat,
 * get_alloc's second look) is answered here without the directory when the directory's stamp
 * of the key (fr_dir_ops.stamp: counters in its shared memory) did not move since the answer
 * was asked for, which proves no put or delete of the key completed meanwhile. A first lookup
 * on the directory's host reads the key's record from the directory's shared table
 * (fr_dir_ops.peek), which asks nobody either; a lookup after a read that found the record
 * stale or its owner gone asks the directory itself. Uses the directory only; get.c and ops.c
 * look keys up through it.
 */
#include "store/store.h"

#include <stdio.h>
#include <string.h>

static fr_cached *cache_slot(ferry_store *s, const char *key) {
  return &s->cache[fr_dir_key_hash(key) % FR_STORE_CACHE_SLOTS];
}

static bool cache_get(ferry_store *s, const char *key, const fr_dir_stamp *now,
                      fr_dir_object *rec) {
  fr_cached *c = cache_slot(s, key);
  pthread_mutex_lock(&s->cache_lock);
  bool hit = c->used && fr_dir_stamp_eq(&c->stamp, now) && strcmp(c->rec.key, key) == 0;
  if (hit)
    *rec = c->rec;
  pthread_mutex_unlock(&s->cache_lock);
  return hit;
}

static void cache_put(ferry_store *s, const fr_dir_stamp *before, const fr_dir_object *rec) {
  fr_cached *c = cache_slot(s, rec->key);
  pthread_mutex_lock(&s->cache_lock);
  *c = (fr_cached){.used = true, .stamp = *before, .rec = *rec};
  pthread_mutex_unlock(&s->cache_lock);
}

void fr_store_forget(ferry_store *s, const char *key) {
  fr_cached *c = cache_slot(s, key);
  pthread_mutex_lock(&s->cache_lock);
  if (c->used && strcmp(c->rec.key, key) == 0)
    c->used = false;
  pthread_mutex_unlock(&s->cache_lock);
}

int fr_store_lookup_again(ferry_store *s, const char *key, fr_dir_object *rec, int timeout_ms,
                          bool again) {
  fr_dir_stamp now; /* taken before the question goes out */
  bool stamped = fr_dir_stamp_take(s->dir, key, &now);
  if (stamped && cache_get(s, key, &now, rec))
    return 0;
  if (!again && fr_dir_peek(s->dir, key, rec))
    return 0;
  int st = 0;
  int rc = fr_dir_obj_get(s->dir, &key, 1, rec, &st, timeout_ms);
  if (rc != 0)
    return rc;
  if (st != 0)
    return fr_err(FERRY_ENOTFOUND, "no object '%s' in the store", key);
  if (stamped)
    cache_put(s, &now, rec);
  return 0;
}

int fr_store_lookup(ferry_store *s, const char *key, fr_dir_object *rec, int timeout_ms) {
  return fr_store_lookup_again(s, key, rec, timeout_ms, false);
}

void fr_store_info_from(const fr_dir_object *rec, ferry_store_info *out) {
  ferry_store_info i;
  memset(&i, 0, sizeof i);
  i.size = out->size;
  fr_str_copy(i.key, sizeof i.key, rec->key);
  fr_str_copy(i.owner, sizeof i.owner, rec->owner);
  i.desc = rec->desc;
  i.bytes = rec->bytes;
  i.generation = rec->generation;
  size_t n = out->size < sizeof i ? out->size : sizeof i;
  memcpy(out, &i, n);
}
