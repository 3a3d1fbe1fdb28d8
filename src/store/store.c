/*
 * Opening and closing a store, the top of its components (store.h lists their order). Opening
 * connects to the directory (or hosts it), starts the peer cache, reserves the pool (one
 * ferry_alloc'd region: generation words, then data; a device pool, devpool.c, is
 * made by the first put from device memory), registers the node under a fresh
 * incarnation (register.c: fr_dir_lease; refused while another live node holds the name; an
 * earlier incarnation proven dead is dropped with its records) and starts the service thread,
 * which renews the lease. Closing stops them in the opposite order, once the reads this node
 * made of other nodes' objects are reported to them (receipts.c).
 */
#include "store/store.h"
#include "transport/access.h"

_Static_assert(FR_DIR_ACCESS_MAX >= FR_ACCESS_MAX, "a node record holds a pool's access blob");

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int pool_open(ferry_store *s, uint64_t capacity) {
  int64_t slots = fr_config_int("FERRY_STORE_MAX_OBJECTS");
  if (slots < 16)
    slots = 16;
  if (slots > (1 << 24))
    slots = 1 << 24;
  s->nslots = (uint32_t)slots;
  s->data_base = ((uint64_t)s->nslots * FR_STORE_SLOT_BYTES + 4095) / 4096 * 4096;
  int rc = fr_pool_init(&s->pool, capacity, 64);
  s->free_slots = malloc(s->nslots * sizeof *s->free_slots);
  s->owned = malloc(s->nslots * sizeof *s->owned);
  s->linger = malloc(s->nslots * sizeof *s->linger);
  s->pinned = malloc(s->nslots * sizeof *s->pinned);
  if (rc == 0 && (!s->free_slots || !s->owned || !s->linger || !s->pinned))
    rc = fr_err(FERRY_ENOMEM, "store: object table of %u entries", s->nslots);
  void *mem = NULL;
  if (rc == 0 && (rc = ferry_alloc(s->ctx, s->data_base + s->pool.capacity, &mem)) != 0)
    rc = fr_err_wrap(rc, "store pool of %llu bytes (FERRY_STORE_CAPACITY)",
                     (unsigned long long)s->pool.capacity);
  if (rc == 0)
    rc = ferry_region_find(s->ctx, mem, s->data_base + s->pool.capacity, &s->ref, NULL);
  if (rc != 0)
    return rc;
  s->mem = mem;
  s->gens = mem;
  s->capowned = s->nslots;
  for (uint32_t i = 0; i < s->nslots; i++)
    s->free_slots[i] = s->nslots - 1 - i;
  s->nfree_slots = s->nslots;
  s->next_gen = 1;
  return 0;
}

static int dir_open(ferry_store *s, const ferry_store_opts *o) {
  if (!(s->flags & FERRY_STORE_HOST_DIRECTORY))
    return fr_dir_open(s->ctx, o ? o->directory : NULL, fr_timeout(-1), &s->dir);
  return fr_dir_host(s->ctx, &s->dir);
}

static ferry_store *store_new(ferry_ctx *ctx, const ferry_store_opts *o) {
  ferry_store *s = calloc(1, sizeof *s);
  if (!s)
    return NULL;
  s->ctx = ctx;
  fr_str_copy(s->name, sizeof s->name, ferry_ctx_name(ctx));
  s->flags = o ? o->flags : 0;
  int64_t linger = fr_config_int("FERRY_STORE_LINGER_MS");
  s->linger_ms = linger > 0 ? (int)linger : 0;
  pthread_mutex_init(&s->lock, NULL);
  pthread_mutex_init(&s->publish_lock, NULL);
  pthread_mutex_init(&s->cache_lock, NULL);
  fr_store_receipts_init(s);
  return s;
}

static int lease_init(ferry_store *s, const ferry_store_opts *o) {
  char who[96];
  snprintf(who, sizeof who, "store '%s'", s->name);
  int rc = fr_dir_lease_init(&s->lease, s->dir, s->ctx, "store", s->name, who);
  if (rc != 0)
    return rc;
  s->lease.node.flags = (s->flags & FERRY_STORE_HOLDER) ? FR_NODE_HOLDER : 0;
  if (o && o->lease_ms > 0)
    s->lease.lease_ms = o->lease_ms;
  if (s->lease.lease_ms < 300)
    s->lease.lease_ms = 300;
  /* The pool's access blob rides in the node record: readers reach it without asking first. */
  size_t n = 0;
  if (fr_region_access_pack(s->ctx, &s->ref, s->lease.node.access, FR_DIR_ACCESS_MAX, &n) != 0)
    fr_err_clear(); /* readers ask the owner, as without one */
  s->lease.node.access_len = (uint16_t)n;
  return 0;
}

static int store_start(ferry_store *s, const ferry_store_opts *o) {
  uint64_t cap = o && o->capacity ? o->capacity : (uint64_t)fr_config_int("FERRY_STORE_CAPACITY");
  if (s->flags & FERRY_STORE_DELEGATE)
    cap = 0; /* its puts live on a holder */
  else
    fr_store_devpool_open(s, o ? o->device_pool_bytes : 0);
  int rc = dir_open(s, o);
  if (rc == 0)
    fr_peers_init(&s->peers, s->dir, s->ctx);
  if (rc == 0 && !(s->flags & FERRY_STORE_DELEGATE)) {
    if ((rc = pool_open(s, cap)) == 0 && (rc = lease_init(s, o)) == 0) {
      pthread_mutex_lock(&s->publish_lock);
      rc = fr_store_register(s, true, fr_timeout(-1));
      pthread_mutex_unlock(&s->publish_lock);
    }
    if (rc == 0)
      rc = fr_store_service_start(s);
  }
  return rc;
}

int ferry_store_open(ferry_ctx *ctx, const ferry_store_opts *opts, ferry_store **out) {
  if (!ctx || !out)
    return fr_err(FERRY_EINVAL, "ferry_store_open: NULL argument");
  int rc = FR_OPTS_CHECK(opts, "ferry_store_open");
  if (rc != 0)
    return rc;
  ferry_store_opts o = {.size = sizeof o,
                        .directory = FR_OPT(opts, directory, NULL),
                        .capacity = FR_OPT(opts, capacity, 0),
                        .lease_ms = FR_OPT(opts, lease_ms, 0),
                        .flags = FR_OPT(opts, flags, 0),
                        .device_pool_bytes = FR_OPT(opts, device_pool_bytes, 0)};
  ferry_store *s = store_new(ctx, &o);
  if (!s)
    return fr_err(FERRY_ENOMEM, "ferry_store_open");
  rc = store_start(s, &o);
  if (rc == 0 && (rc = fr_store_stats_start(s)) != 0)
    fr_store_stats_stop(s);
  if (rc != 0) {
    fr_err_keep keep;
    fr_err_save(&keep, rc);
    ferry_store_close(s);
    return fr_err_restore(&keep);
  }
  *out = s;
  return 0;
}

void ferry_store_close(ferry_store *s) {
  if (!s)
    return;
  fr_store_stats_stop(s);
  fr_store_service_stop(s);
  fr_store_receipts_close(s); /* over the peers' links, which close below */
  if (s->dir && s->mem)
    fr_store_unregister(s);
  if (s->mem)
    fr_store_retire_all(s);
  fr_peers_close(&s->peers);
  fr_dir_close(s->dir);
  fr_store_devpool_close(s); /* every object retired: no block of it is in use */
  if (s->mem)
    ferry_free(s->ctx, s->mem);
  fr_pool_fini(&s->pool);
  free(s->free_slots);
  free(s->owned);
  free(s->linger);
  free(s->pinned);
  free(s->released);
  pthread_mutex_destroy(&s->lock);
  pthread_mutex_destroy(&s->publish_lock);
  pthread_mutex_destroy(&s->cache_lock);
  free(s);
}
