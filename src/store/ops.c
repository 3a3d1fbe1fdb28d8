/*
 * The store's bookkeeping calls: delete (by key or prefix, wherever the object lives), list,
 * exists and stat. Deleting another node's object asks that node to do it (it frees the bytes
 * and removes the record); when the owner is gone, the record is removed from the directory
 * directly, conditionally on the owner and generation so a newer put is never lost. Keys are
 * looked up through the lookup cache (lookup.c); owners are reached through the peer cache
 * (directory/peers.c) and asked with msg.c's calls.
 */
#include "store/store.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool owner_gone(int rc) {
  return rc == FERRY_EPEER || rc == FERRY_ECONNECT || rc == FERRY_ETIMEDOUT || rc == FERRY_ECLOSED;
}

int fr_store_delete_rec(ferry_store *s, const fr_dir_object *rec, int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  if (s->mem && strcmp(rec->owner, s->name) == 0) {
    int rc = fr_store_delete_local(s, rec->key, rec->generation, true, true, timeout_ms);
    if (rc != FERRY_ENOTFOUND)
      return rc; /* else: a record of ours we no longer hold; remove it below */
  } else {
    fr_peer *p;
    int rc = fr_peer_acquire(&s->peers, rec->owner, timeout_ms, &p);
    if (rc == 0) {
      rc = fr_store_call_delete(s, p, rec->key, rec->generation, fr_store_left(deadline));
      fr_peer_release(&s->peers, p, rc == FERRY_EPEER || rc == FERRY_ECLOSED);
    }
    if (rc == 0 || (!owner_gone(rc) && rc != FERRY_ENOTFOUND))
      return rc;
  }
  int rc =
      fr_dir_obj_del(s->dir, rec->key, rec->owner, rec->generation, NULL, fr_store_left(deadline));
  return rc == FERRY_ENOTFOUND ? 0 : rc; /* gone already: the delete happened */
}

int ferry_store_delete(ferry_store *s, const char *key, int timeout_ms) {
  if (!s)
    return fr_err(FERRY_EINVAL, "delete: NULL store");
  int rc = fr_dir_key_check(key, "delete");
  fr_dir_object rec;
  uint64_t deadline = fr_deadline_ns(fr_timeout(timeout_ms));
  if (rc == 0)
    rc = fr_store_lookup(s, key, &rec, fr_store_left(deadline));
  return rc ? rc : fr_store_delete_rec(s, &rec, fr_store_left(deadline));
}

int ferry_store_delete_prefix(ferry_store *s, const char *prefix, size_t *deleted, int timeout_ms) {
  if (!s)
    return fr_err(FERRY_EINVAL, "delete_prefix: NULL store");
  uint64_t deadline = fr_deadline_ns(fr_timeout(timeout_ms));
  fr_dir_object *v = NULL;
  size_t n = 0, done = 0;
  int rc = fr_dir_obj_scan(s->dir, prefix ? prefix : "", &v, &n, fr_store_left(deadline));
  for (size_t i = 0; rc == 0 && i < n; i++) {
    if (fr_dir_key_reserved(v[i].key)) /* ferry's own records (mq discovery) */
      continue;
    rc = fr_store_delete_rec(s, &v[i], fr_store_left(deadline));
    if (rc == FERRY_ENOTFOUND) /* deleted by someone else meanwhile */
      rc = 0;
    else if (rc == 0)
      done++;
  }
  free(v);
  if (rc == 0 && deleted)
    *deleted = done;
  return rc;
}

int ferry_store_clear(ferry_store *s, size_t *deleted, int timeout_ms) {
  return ferry_store_delete_prefix(s, "", deleted, timeout_ms);
}

int ferry_store_list(ferry_store *s, const char *prefix, ferry_store_info **out, size_t *count,
                     int timeout_ms) {
  if (!s || !out || !count)
    return fr_err(FERRY_EINVAL, "list: NULL argument");
  fr_dir_object *v = NULL;
  size_t n = 0;
  int rc = fr_dir_obj_scan(s->dir, prefix ? prefix : "", &v, &n, fr_timeout(timeout_ms));
  if (rc != 0)
    return rc;
  ferry_store_info *list = calloc(n ? n : 1, sizeof *list);
  size_t kept = 0;
  for (size_t i = 0; list && i < n; i++) {
    if (fr_dir_key_reserved(v[i].key)) /* ferry's own records (mq discovery) */
      continue;
    list[kept].size = sizeof list[kept];
    fr_store_info_from(&v[i], &list[kept++]);
  }
  free(v);
  if (!list)
    return fr_err(FERRY_ENOMEM, "list of %zu", n);
  *out = list;
  *count = kept;
  return 0;
}

void ferry_store_list_free(ferry_store_info *list) { free(list); }

int ferry_store_exists(ferry_store *s, const char *key, int timeout_ms) {
  if (!s)
    return fr_err(FERRY_EINVAL, "exists: NULL store");
  int rc = fr_dir_key_check(key, "exists");
  fr_dir_object rec;
  if (rc == 0)
    rc = fr_store_lookup(s, key, &rec, fr_timeout(timeout_ms));
  if (rc == FERRY_ENOTFOUND) {
    fr_err_clear();
    return 0;
  }
  return rc == 0 ? 1 : rc;
}

int ferry_store_stat(ferry_store *s, const char *key, ferry_store_info *out, int timeout_ms) {
  if (!s || !out || out->size < sizeof(size_t))
    return fr_err(FERRY_EINVAL, "stat: NULL argument or out->size not set");
  int rc = fr_dir_key_check(key, "stat");
  fr_dir_object rec;
  if (rc == 0)
    rc = fr_store_lookup(s, key, &rec, fr_timeout(timeout_ms));
  if (rc == 0)
    fr_store_info_from(&rec, out);
  return rc;
}
