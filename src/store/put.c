/*
 * Publishing and retiring the objects this node owns. A put finds the bytes a home (in place
 * when they already lie in ferry memory, else a pool block it copies into), takes a generation
 * word, writes the generation there only after the bytes are in place, and then publishes the
 * record in the directory. Retiring an object zeroes its generation word before its block can be
 * reused, so a reader that copied while the bytes changed always sees the mismatch. A pool copy
 * that a re-put replaced is not retired at once: it lingers, still whole and still valid, for
 * FERRY_STORE_LINGER_MS at least (the next copy put or service turn after that retires it)
 * or until its block or slot is needed (oldest first), so gets that looked it up an instant
 * before the re-put finish with it instead of starting over. Memory published in
 * place is the caller's again once the re-put returns, so it is retired at once. A tensor in CUDA
 * memory is never in place: its bytes are copied device to device into a block of the device
 * pool when the store has one there (devpool.c), else device to host into a pool block. The table
 * of owned objects, retiring and lingering are owned.c's; (re-)registering is register.c's.
 */
#include "store/store.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- put ---- */

/* Checks a put and classifies its data once (*device: fr_store_device). Device memory must hold
 * the whole tensor: a desc larger than the CUDA allocation would read past its end. */
static int check_put(ferry_store *s, const char *key, const ferry_tensor_desc *desc,
                     const void *data, uint64_t *bytes, int *device) {
  if (!s || !desc)
    return fr_err(FERRY_EINVAL, "put: NULL argument");
  int rc = fr_dir_key_check(key, "put");
  if (rc != 0)
    return rc;
  if (fr_dir_key_reserved(key))
    return fr_err(FERRY_EINVAL, "put '%s': keys starting '" FR_DIR_RESERVED "' are ferry's own",
                  key);
  if ((rc = ferry_tensor_nbytes(desc, bytes)) != 0)
    return fr_err_wrap(rc, "put '%s'", key);
  if (!data && *bytes > 0)
    return fr_err(FERRY_EINVAL, "put '%s': NULL data", key);
  size_t room;
  *device = *bytes > 0 ? fr_store_device(data, &room) : -1;
  if (*device >= 0 && *bytes > room)
    return fr_err(FERRY_ERANGE,
                  "put '%s': %llu bytes run past the end of the CUDA allocation at %p (device "
                  "%d: %zu bytes from there)",
                  key, (unsigned long long)*bytes, data, *device, room);
  return 0;
}

/* A pool block for bytes (lock held); FERRY_ECAPACITY with the sizes in the detail. */
static int pool_alloc(ferry_store *s, uint64_t bytes, uint64_t *off) {
  fr_pool *p = &s->pool;
  if (fr_pool_alloc(p, bytes, p->capacity, off) == 0)
    return 0;
  return fr_err(FERRY_ECAPACITY,
                "%llu bytes do not fit the store pool: capacity %llu, in use %llu, largest free "
                "block %llu (raise FERRY_STORE_CAPACITY or delete objects)",
                (unsigned long long)bytes, (unsigned long long)p->capacity,
                (unsigned long long)p->used, (unsigned long long)fr_pool_largest(p));
}

/* A block of the device pool for a put from device `device` (lock held): replaced copies
 * lingering there go first, oldest first, when it is full and their room would let the put fit
 * (fr_store_linger_can_help; as for the host pool in place()). false: the host pool takes the bytes
 * (no device pool, one on another device, or full). */
static bool device_block(ferry_store *s, const fr_owned *o, int device, uint64_t *off) {
  int rc = fr_store_devpool_alloc(s, device, o->rec.bytes, off);
  bool room = rc == FERRY_ECAPACITY && fr_store_linger_can_help(s, true, o->rec.bytes);
  while (rc == FERRY_ECAPACITY && room && fr_store_linger_pop_in(s, true))
    rc = fr_store_devpool_alloc(s, device, o->rec.bytes, off);
  if (rc == FERRY_ECAPACITY)
    fr_warn_limited("store '%s': device pool full: put '%s' (%llu bytes) goes to the host pool "
                    "(device pool: %llu bytes, in use %llu, largest free block %llu; raise "
                    "FERRY_STORE_DEVICE_POOL_BYTES)",
                    s->name, o->rec.key, (unsigned long long)o->rec.bytes,
                    (unsigned long long)s->dev.pool.capacity, (unsigned long long)s->dev.pool.used,
                    (unsigned long long)fr_pool_largest(&s->dev.pool));
  return rc == 0;
}

/* Finds a home for the bytes: in place, a block of the device pool (device memory, when the store
 * has one), or a pool block (filled outside the lock). Device memory is never published in place
 * (the caller's allocation is not ours to hand out). */
static int place(ferry_store *s, fr_owned *o, const void *data, int device, uint32_t flags,
                 bool fill) {
  uint64_t off = 0;
  ferry_region_ref ref;
  if (!fill && data && device < 0 && o->rec.bytes > 0 && !(flags & FERRY_STORE_PUT_COPY) &&
      ferry_region_find(s->ctx, data, o->rec.bytes, &ref, &off) == 0) {
    o->rec.region = ref;
    o->rec.offset = off;
    o->pool_off = FR_STORE_NO_POOL;
    o->data = data;
    return 0;
  }
  fr_err_clear();
  if (!fill && device >= 0 && o->rec.bytes > 0)
    fr_store_devpool_prepare(s, device); /* made outside the lock, at the first such put */
  pthread_mutex_lock(&s->lock);
  fr_store_linger_expire(s, fr_now_ns());
  fr_store_pinned_reap(s);
  bool on_device = !fill && device >= 0 && o->rec.bytes > 0 && device_block(s, o, device, &off);
  int rc = o->rec.bytes && !on_device ? pool_alloc(s, o->rec.bytes, &off) : 0;
  bool room = rc == FERRY_ECAPACITY && fr_store_linger_can_help(s, false, o->rec.bytes);
  while (rc == FERRY_ECAPACITY && room &&
         fr_store_linger_pop_in(s, false)) /* make room: the oldest replaced copies go */
    rc = (fr_err_clear(), pool_alloc(s, o->rec.bytes, &off));
  pthread_mutex_unlock(&s->lock);
  if (rc != 0) {
    rc = fr_err_wrap(rc, "put '%s'", o->rec.key);
    if (rc == FERRY_ECAPACITY) /* the holder's operator sees it, not only the client */
      fr_warn_limited("store '%s': full: %s", s->name, ferry_last_error());
    return rc;
  }
  o->pool_off = o->rec.bytes ? off : FR_STORE_NO_POOL;
  o->pool_len = o->rec.bytes;
  o->on_device = on_device;
  o->rec.region = on_device ? s->dev.ref : s->ref;
  o->rec.offset = on_device ? off : s->data_base + off;
  o->data = on_device ? s->dev.mem + off : s->mem + s->data_base + off;
  return 0;
}

/* Takes a generation word; FERRY_ECAPACITY when every slot is in use. */
static int take_slot(ferry_store *s, fr_owned *o) {
  pthread_mutex_lock(&s->lock);
  int rc = 0;
  if (s->nfree_slots == 0)
    fr_store_pinned_reap(s);
  if (s->nfree_slots == 0)
    fr_store_linger_pop(s);
  if (s->nfree_slots == 0)
    rc = fr_err(FERRY_ECAPACITY,
                "put '%s': this node already holds %u objects "
                "(FERRY_STORE_MAX_OBJECTS)",
                o->rec.key, s->nslots);
  else
    o->slot = s->free_slots[--s->nfree_slots];
  o->rec.generation = s->next_gen++;
  pthread_mutex_unlock(&s->lock);
  if (rc == FERRY_ECAPACITY)
    fr_warn_limited("store '%s': full: %s", s->name, ferry_last_error());
  o->rec.gen_region = s->ref;
  o->rec.gen_offset = (uint64_t)o->slot * FR_STORE_SLOT_BYTES;
  return rc;
}

static void unplace(ferry_store *s, fr_owned *o, bool slot) {
  pthread_mutex_lock(&s->lock);
  if (o->pool_off != FR_STORE_NO_POOL && o->on_device)
    fr_store_devpool_free(s, o->pool_off, o->pool_len);
  else if (o->pool_off != FR_STORE_NO_POOL)
    fr_pool_free(&s->pool, o->pool_off, o->pool_len);
  if (slot)
    s->free_slots[s->nfree_slots++] = o->slot;
  pthread_mutex_unlock(&s->lock);
  free(o);
}

/* Publishes o's record, then makes it the local object of its key. */
static int publish(ferry_store *s, fr_owned *o, int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  fr_dir_object old;
  bool other = false;
  uint32_t pinned_slot = UINT32_MAX;
  char key[FR_DIR_KEY_MAX + 1]; /* o belongs to the table once swapped in */
  fr_str_copy(key, sizeof key, o->rec.key);
  fr_store_settle(s, false, deadline); /* what earlier puts left to do */
  fr_store_wait w;
  int rc = fr_store_publish_lock(s, "a put", deadline, timeout_ms, &w);
  if (rc != 0)
    return fr_err_wrap(rc, "put '%s'", key);
  rc = fr_store_ensure_registered(s, fr_store_left(deadline));
  if (rc == 0)
    rc = fr_dir_obj_put(s->dir, &o->rec, FR_DIR_PUT_POSTED, &old, &other, fr_store_left(deadline));
  if (rc == FERRY_ENOTFOUND && (rc = fr_store_register(s, false, fr_store_left(deadline))) == 0)
    rc = fr_dir_obj_put(s->dir, &o->rec, 0, &old, &other, fr_store_left(deadline));
  if (rc == 0) {
    pthread_mutex_lock(&s->lock);
    fr_owned *prev = fr_store_owned_swap(s, o);
    uint32_t slot = prev ? prev->slot : UINT32_MAX;
    if (prev && prev->pool_off != FR_STORE_NO_POOL)
      fr_store_linger_push(s, prev);
    else if (prev && fr_store_retire(s, prev))
      pinned_slot = slot;
    pthread_mutex_unlock(&s->lock);
  }
  fr_store_publish_unlock(s);
  rc = fr_store_waited(s, rc, &w, timeout_ms);
  if (pinned_slot != UINT32_MAX)
    fr_store_wait_unpinned(s, pinned_slot, key, deadline);
  if (rc == 0 && other)
    fr_store_send_dropped(s, &old);
  return rc;
}

/* Writes a pool copy's bytes: from the fill, from the device (its copy engine: device to host, or
 * device to device into the device pool), or a memcpy. */
static int fill_block(const fr_owned *o, const void *data, int device, fr_fill_fn fill,
                      void *fill_arg) {
  uint8_t *block = (uint8_t *)o->data;
  if (fill)
    return fill(fill_arg, block, o->rec.bytes);
  if (device < 0) {
    memcpy(block, data, o->rec.bytes);
    return 0;
  }
  int rc = fr_cuda_copy_on(device, block, data, (size_t)o->rec.bytes);
  return rc ? fr_err_wrap(rc, "put '%s': from CUDA device %d", o->rec.key, device) : 0;
}

/* Gives a new object its home, its slot and its bytes, then sets its generation word. */
static int prepare(ferry_store *s, const char *key, const ferry_tensor_desc *desc, const void *data,
                   int device, uint32_t flags, fr_fill_fn fill, void *fill_arg, fr_owned **out) {
  fr_owned *o = calloc(1, sizeof *o);
  if (!o)
    return fr_err(FERRY_ENOMEM, "put '%s'", key);
  fr_str_copy(o->rec.key, sizeof o->rec.key, key);
  fr_str_copy(o->rec.owner, sizeof o->rec.owner, s->name);
  o->rec.desc = *desc;
  ferry_tensor_nbytes(desc, &o->rec.bytes);
  int rc = place(s, o, data, device, flags, fill != NULL);
  if (rc != 0) {
    free(o);
    return rc;
  }
  if ((rc = take_slot(s, o)) != 0) {
    unplace(s, o, false);
    return rc;
  }
  if (o->pool_off != FR_STORE_NO_POOL)
    rc = fill_block(o, data, device, fill, fill_arg);
  if (rc != 0) {
    unplace(s, o, true);
    return rc;
  }
  /* the generation becomes visible only after the bytes are complete */
  __atomic_store_n(fr_store_gen(s, o->slot), o->rec.generation, __ATOMIC_SEQ_CST);
  fr_store_note_size(s, o->rec.bytes);
  *out = o;
  return 0;
}

/* Undoes prepare() for an object that was never published. */
static void unprepare(ferry_store *s, fr_owned *o) {
  __atomic_store_n(fr_store_gen(s, o->slot), 0, __ATOMIC_SEQ_CST);
  unplace(s, o, true);
}

int fr_store_put_local(ferry_store *s, const char *key, const ferry_tensor_desc *desc,
                       const void *data, int device, uint32_t flags, fr_fill_fn fill,
                       void *fill_arg, uint64_t *generation, int timeout_ms) {
  fr_owned *o = NULL;
  int rc = prepare(s, key, desc, data, device, flags, fill, fill_arg, &o);
  if (rc != 0)
    return rc;
  uint64_t gen = o->rec.generation;
  if ((rc = publish(s, o, timeout_ms)) != 0) {
    unprepare(s, o);
    return rc;
  }
  if (generation)
    *generation = gen;
  return 0;
}

/* ---- batch put: one directory round trip for many objects ---- */

typedef struct batch_pub {
  fr_dir_object *recs, *old;
  int *st;
  bool *other;
  uint32_t *pinned;
  size_t n;
} batch_pub;

/* Publishes the prepared objects os[0..n) (one round trip), then makes each that the directory
 * took the local object of its key; st[i] receives each one's status. */
static int publish_batch(ferry_store *s, fr_owned **os, size_t n, int *st, int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  batch_pub b = {.n = n};
  b.recs = malloc(n * sizeof *b.recs);
  b.old = malloc(n * sizeof *b.old);
  b.other = calloc(n, sizeof *b.other);
  b.pinned = malloc(n * sizeof *b.pinned);
  int rc = b.recs && b.old && b.other && b.pinned ? 0 : fr_err(FERRY_ENOMEM, "put_batch of %zu", n);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    b.recs[i] = os[i]->rec;
    b.pinned[i] = UINT32_MAX;
  }
  fr_store_settle(s, false, deadline); /* what earlier puts left to do */
  fr_store_wait w = {0};
  bool locked = rc == 0;
  if (locked && (rc = fr_store_publish_lock(s, "a put_batch", deadline, timeout_ms, &w)) != 0) {
    rc = fr_err_wrap(rc, "put_batch of %zu", n);
    locked = false;
  }
  if (rc == 0)
    rc = fr_store_ensure_registered(s, fr_store_left(deadline));
  if (rc == 0)
    rc = fr_dir_obj_put_batch(s->dir, b.recs, n, FR_DIR_PUT_POSTED, st, b.old, b.other,
                              fr_store_left(deadline));
  if (rc == 0 && n > 0 && st[0] == FERRY_ENOTFOUND && /* the lease lapsed: register, again */
      (rc = fr_store_register(s, false, fr_store_left(deadline))) == 0)
    rc = fr_dir_obj_put_batch(s->dir, b.recs, n, 0, st, b.old, b.other, fr_store_left(deadline));
  if (rc == 0) {
    pthread_mutex_lock(&s->lock);
    for (size_t i = 0; i < n; i++) {
      if (st[i] != 0)
        continue;
      fr_owned *prev = fr_store_owned_swap(s, os[i]);
      uint32_t slot = prev ? prev->slot : UINT32_MAX;
      if (prev && prev->pool_off != FR_STORE_NO_POOL)
        fr_store_linger_push(s, prev);
      else if (prev && fr_store_retire(s, prev))
        b.pinned[i] = slot;
    }
    pthread_mutex_unlock(&s->lock);
  }
  if (locked)
    fr_store_publish_unlock(s);
  rc = fr_store_waited(s, rc, &w, timeout_ms);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    if (b.pinned[i] != UINT32_MAX)
      fr_store_wait_unpinned(s, b.pinned[i], b.recs[i].key, deadline);
    if (st[i] == 0 && b.other[i])
      fr_store_send_dropped(s, &b.old[i]);
  }
  free(b.recs);
  free(b.old);
  free(b.other);
  free(b.pinned);
  return rc;
}

static int put_batch(ferry_store *s, ferry_store_put_item *items, size_t n, uint32_t flags,
                     int timeout_ms) {
  if (!s || (!items && n > 0))
    return fr_err(FERRY_EINVAL, "put_batch: NULL argument");
  timeout_ms = fr_timeout(timeout_ms);
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  fr_owned **os = calloc(n ? n : 1, sizeof *os);
  int *st = calloc(n ? n : 1, sizeof *st);
  size_t *at = calloc(n ? n : 1, sizeof *at);
  if (!os || !st || !at) {
    free(os), free(st), free(at);
    return fr_err(FERRY_ENOMEM, "put_batch of %zu", n);
  }
  size_t k = 0; /* prepared objects, os[0..k); at[j]: their items */
  for (size_t i = 0; i < n; i++) {
    ferry_store_put_item *it = &items[i];
    uint64_t bytes;
    int device;
    it->status = check_put(s, it->key, it->desc, it->data, &bytes, &device);
    if (it->status == 0 && (s->flags & FERRY_STORE_DELEGATE))
      it->status = fr_store_upload(s, it->key, it->desc, it->data, device, fr_store_left(deadline));
    else if (it->status == 0 && (it->status = prepare(s, it->key, it->desc, it->data, device, flags,
                                                      NULL, NULL, &os[k])) == 0)
      at[k++] = i;
  }
  int rc = k ? publish_batch(s, os, k, st, fr_store_left(deadline)) : 0;
  for (size_t j = 0; j < k; j++) {
    items[at[j]].status = rc ? rc : st[j];
    if (items[at[j]].status != 0)
      unprepare(s, os[j]);
  }
  int first = 0;
  for (size_t i = 0; i < n && first == 0; i++)
    if ((first = items[i].status) != 0)
      fr_err(first, "put_batch: item %zu ('%s') failed: %s", i,
             items[i].key ? items[i].key : "(null)", ferry_strerror(first));
  free(os);
  free(st);
  free(at);
  return first;
}

int ferry_store_put_batch(ferry_store *s, ferry_store_put_item *items, size_t n, uint32_t flags,
                          int timeout_ms) {
  uint64_t t0 = fr_now_ns();
  int rc = put_batch(s, items, n, flags, timeout_ms);
  if (s && (items || n == 0)) {
    uint64_t bytes = 0, one;
    size_t ok = 0;
    for (size_t i = 0; i < n; i++)
      if (items[i].status == 0 && items[i].desc && ferry_tensor_nbytes(items[i].desc, &one) == 0) {
        bytes += one;
        ok++;
      }
    fr_store_count(s, true, ok, n - ok, bytes, t0);
  }
  return rc;
}

int ferry_store_put(ferry_store *s, const char *key, const ferry_tensor_desc *desc,
                    const void *data, uint32_t flags, int timeout_ms) {
  uint64_t bytes;
  int device;
  int rc = check_put(s, key, desc, data, &bytes, &device);
  if (rc != 0)
    return rc;
  uint64_t t0 = fr_now_ns();
  if (s->flags & FERRY_STORE_DELEGATE)
    rc = fr_store_upload(s, key, desc, data, device, fr_timeout(timeout_ms));
  else
    rc = fr_store_put_local(s, key, desc, data, device, flags, NULL, NULL, NULL,
                            fr_timeout(timeout_ms));
  fr_store_count(s, true, rc == 0, rc != 0, rc == 0 ? bytes : 0, t0);
  return rc;
}
