/*
 * The store, internal view: the state behind a ferry_store handle and the calls its files share.
 * Its components, each calling only those above it in this list (no file calls one below it):
 *   directory/peers.c  the peer cache: node name → directory node record → connected link,
 *                      cached, dropped on failure (shared with mq);
 *   metrics.c          the store's counters and readiness check;
 *   devpool.c          the device pool: one CUDA allocation, a registered region, where puts
 *                      from device memory keep their bytes (off unless asked for);
 *   lookup.c           the lookup cache: key → record (stamp-checked; peek; the directory);
 *   msg.c              messages to other nodes' stores (DELETE, DROPPED, UPLOAD, READS) and
 *                      their decoder;
 *   receipts.c         read receipts: the objects this node read of each owner, reported to it
 *                      (READS) in batches, so that an owner counts the gets it served;
 *   owned.c            the objects this node owns: the table, retiring, lingering copies, and
 *                      deleting one of them;
 *   register.c         the node's lease, publishing every owned object again, and settling
 *                      posted puts;
 *   put.c, get.c, ops.c  the verbs: publish; read (with the batch helpers and views); delete,
 *                      list, exists, stat. None calls another;
 *   service.c          the service thread on FR_CHANNEL_STORE, answering other nodes with the
 *                      verbs, settling and reaping;
 *   store.c            open and close, which start and stop all of the above.
 * core/pool.c sub-allocates the node's shared-memory pool, and the device pool.
 */
#ifndef FR_STORE_H
#define FR_STORE_H

#include "core/core.h"
#include "core/cuda.h"
#include "core/pool.h"
#include "core/stats.h"
#include "directory/directory.h"
#include "directory/peers.h"
#include "transport/job.h"

#include <pthread.h>
#include <stdbool.h>

/* ---- the store ---- */
#define FR_STORE_NO_POOL UINT64_MAX
#define FR_STORE_SLOT_BYTES 16 /* generation word, then the pin count of views */
/* Trust: the pool (object bytes, and these slot words) is a ferry_alloc'd region that same-host
 * readers map read-write, so a peer can write any of it. Neither word is an index or a size:
 * - the generation word (written by the owner) is only compared with a record's generation by
 *   readers, and by the owner with 0;
 * - the pin count (viewers add and drop pins) is only compared with 0 by the owner: a peer
 *   that forges it holds an object's old bytes until the re-put's deadline (wait_unpinned in
 *   owned.c abandons it then), never longer, and never makes the owner read out of the pool.
 * Where an object lies (offset, bytes) comes from the directory record, and every read of it
 * is bounds-checked by the transport against the region's size (transport/shm.c). */
/* The generation word of a retired object: 0 while its bytes stay as they were (views that pin
 * it remain valid), FR_STORE_GEN_ABANDONED once they may change under a view. */
#define FR_STORE_GEN_ABANDONED UINT64_MAX

/* An object this node owns. */
typedef struct fr_owned {
  fr_dir_object rec;
  uint64_t pool_off; /* its bytes in the pool, or FR_STORE_NO_POOL (published in place) */
  uint64_t pool_len;
  uint32_t slot;        /* its generation word */
  bool on_device;       /* pool_off is in the device pool (s->dev), data a device address */
  const uint8_t *data;  /* its bytes in this process */
  uint64_t replaced_ns; /* when a re-put replaced it (lingering copies) */
} fr_owned;

/* A replaced pool copy lingers (its bytes and generation word intact) for FERRY_STORE_LINGER_MS
 * (ferry_store.linger_ms) at least, until the next copy put or service turn after that, or
 * until its space or slot is needed, so that a get that looked it up
 * just before the re-put still completes with that whole version instead of starting over. */

/* A lookup's answer, kept with the stamp taken before it was asked (lookup.c). */
typedef struct fr_cached {
  bool used;
  fr_dir_stamp stamp;
  fr_dir_object rec;
} fr_cached;
#define FR_STORE_CACHE_SLOTS 64

/* Read receipts (receipts.c): the objects read whole from one owner, and their bytes, not yet
 * reported to it. */
typedef struct fr_receipt {
  char owner[FR_DIR_NAME_MAX + 1]; /* "": a free slot */
  uint64_t gets, bytes;
} fr_receipt;

typedef struct fr_receipts {
  pthread_mutex_t lock;
  pthread_cond_t idle; /* a flush ended */
  fr_receipt *slots;   /* by owner hash, linear probing; cap a power of 2, at most half named */
  size_t cap, named;
  bool pending;    /* some slot has counts */
  bool flushing;   /* a flush is under way (at most one) */
  bool closed;     /* the store is closing: no flush starts from a read any more */
  uint64_t due_ns; /* a read after this starts a flush */
} fr_receipts;

struct ferry_store {
  ferry_ctx *ctx;
  char name[FR_DIR_NAME_MAX + 1];
  uint32_t flags;
  fr_dir *dir;

  /* the pool region: a slot (generation word, pin count) per object, then data */
  uint8_t *mem;
  ferry_region_ref ref;
  uint64_t data_base; /* offset of the data area in the region */
  uint64_t *gens;     /* 2 words per slot: fr_store_gen(), fr_store_pins() */
  uint32_t nslots;

  pthread_mutex_t lock; /* pool, slots, owned objects */
  fr_pool pool;         /* 64-byte granules; under lock (core/pool.h) */
  uint32_t *free_slots;
  uint32_t nfree_slots;
  uint64_t next_gen;
  fr_owned **owned; /* sorted by key */
  size_t nowned, capowned;
  fr_owned **linger; /* replaced pool copies, oldest first */
  size_t nlinger;
  fr_owned **pinned; /* retired while views held them: freed when their pins drop to 0 */
  size_t npinned;
  /* Objects published in place that were deleted (by any node) and not put again since the
   * caller last asked (ferry_store_released): their memory is the caller's to reuse. Kept only
   * once the caller has asked, so a caller that never does holds nothing. */
  ferry_store_info *released;
  size_t nreleased, capreleased;
  bool released_on;

  /* The device pool (devpool.c): puts from device memory keep their bytes in one CUDA
   * allocation of this node's, registered as a region (peers on this host map it through CUDA
   * IPC with the link's region map; others read it staged by this node's server thread). Made
   * at the first put from device memory, on that put's device. Under lock. The generation
   * words stay in the host pool's slots. */
  struct {
    uint64_t want;        /* bytes asked for; 0: no device pool */
    int device;           /* its device, -1 until made */
    uint8_t *mem;         /* device address of offset 0 (atomic: set once, under lock) */
    ferry_region_ref ref; /* its registration */
    fr_pool pool;         /* 256-byte granules */
    bool other_warned;    /* a put from another device was warned about */
    /* Making it (fr_store_devpool_prepare), outside the store's lock, one put at a time; after a
     * failure the next try waits retry_ns (1 s, doubled per failure up to a minute). */
    pthread_mutex_t make_lock;
    bool make_lock_ok;
    uint32_t failures;
    uint64_t retry_ns; /* under make_lock */
  } dev;

  pthread_mutex_t publish_lock; /* orders directory publishes with local replaces */
  const char *publish_by;       /* atomic: what holds publish_lock (owned.c), for errors */
  fr_dir_lease lease;           /* this open's claim on the name in the directory */
  bool republish_due;           /* atomic: the directory may have missed a posted put (store.c) */

  pthread_mutex_t cache_lock;
  fr_cached cache[FR_STORE_CACHE_SLOTS]; /* by key hash */

  fr_peers peers;                   /* directory/peers.h: started once the directory is open */
  char holder[FR_DIR_NAME_MAX + 1]; /* cached holder node (delegating stores) */

  fr_receipts receipts; /* reads of other nodes' objects not yet reported to them */

  fr_job *service; /* the service thread on FR_CHANNEL_STORE (service.c), or NULL */
  int linger_ms;   /* FERRY_STORE_LINGER_MS */

  /* metrics (metrics.c): relaxed atomic adds, one call's worth at its end */
  struct {
    uint64_t puts, put_errors, put_bytes, gets, get_errors, get_bytes;
    uint64_t served_gets, served_bytes; /* gets of this node's objects, by any node */
    uint64_t largest;                   /* the largest object this node has held (bytes) */
    fr_hist put_ns, get_ns;
  } m;
};

/* metrics.c: counts one call's puts (or gets): `ok` succeeded and moved `bytes`, `failed` did
 * not; the call began at t0. */
void fr_store_count(ferry_store *s, bool put, size_t ok, size_t failed, uint64_t bytes,
                    uint64_t t0);
/* Counts gets of this node's objects that read `bytes` in all: its own, at once, and other
 * nodes' as their read receipts report them (fr_store_count_claimed). */
void fr_store_count_served(ferry_store *s, uint64_t gets, uint64_t bytes);
/* A peer's receipt, bounded: its bytes at most `gets` times the largest object this node has
 * held (fr_store_note_size), since each get read one whole object. */
void fr_store_count_claimed(ferry_store *s, uint64_t gets, uint64_t bytes);
/* devpool.c: the device pool; lock held by every call but open, prepare and close. */
/* Reads the pool's size (opts, else FERRY_STORE_DEVICE_POOL_BYTES); nothing is allocated yet. */
void fr_store_devpool_open(ferry_store *s, uint64_t bytes);
/* Makes the pool on `device` when the store wants one and has none yet (the lock NOT held: a
 * cuMemAlloc and a registration, which other threads' puts and gets do not wait for). A failure
 * is warned about and tried again by a later put, after a backoff. */
void fr_store_devpool_prepare(ferry_store *s, int device);
/* A block of the device pool for bytes copied from device `device`. FERRY_ENOTSUP (no error
 * set): no device pool (none wanted, or not made), or one on another device (warned once);
 * FERRY_ECAPACITY (no error set): no room. */
int fr_store_devpool_alloc(ferry_store *s, int device, uint64_t bytes, uint64_t *off);
void fr_store_devpool_free(ferry_store *s, uint64_t off, uint64_t bytes);
/* Deregisters and frees the pool (store close, after every object is retired). */
void fr_store_devpool_close(ferry_store *s);

/* Notes the size of an object this node now holds (the bound of receipts' bytes). */
void fr_store_note_size(ferry_store *s, uint64_t bytes);
/* Registers the store's collector and readiness check with its ctx; fr_store_stats_stop undoes
 * it (before the store's state goes). */
int fr_store_stats_start(ferry_store *s);
void fr_store_stats_stop(ferry_store *s);

/* An object's generation word (valid while it equals the record's generation) and the count of
 * views that pin it (views on this host add and drop pins in the shared pool region itself). */
static inline uint64_t *fr_store_gen(ferry_store *s, uint32_t slot) {
  return &s->gens[(size_t)slot * 2];
}
static inline uint64_t *fr_store_pins(ferry_store *s, uint32_t slot) {
  return &s->gens[(size_t)slot * 2 + 1];
}

/* lookup.c: the lookup cache */
/* Looks a key up: from the cache when the directory's stamp of the key has not moved since the
 * cached answer was asked for, else from the directory's shared table (fr_dir_ops.peek), else
 * from the directory. */
int fr_store_lookup(ferry_store *s, const char *key, fr_dir_object *rec, int timeout_ms);
/* fr_store_lookup(); `again` (after a read found the record stale or its owner gone) skips the
 * shared table, so the directory itself answers. */
int fr_store_lookup_again(ferry_store *s, const char *key, fr_dir_object *rec, int timeout_ms,
                          bool again);
/* Drops the cached answer for a key (its record proved wrong: ask the directory next time). */
void fr_store_forget(ferry_store *s, const char *key);
void fr_store_info_from(const fr_dir_object *rec, ferry_store_info *out);

/* msg.c: messages to other nodes' stores (over the peer cache, s->peers) */
int fr_store_call_delete(ferry_store *s, fr_peer *p, const char *key, uint64_t generation,
                         int timeout_ms);
void fr_store_send_dropped(ferry_store *s, const fr_dir_object *old);
/* data lies on CUDA device `device` (-1: host memory): copied to host memory first. */
int fr_store_upload(ferry_store *s, const char *key, const ferry_tensor_desc *desc,
                    const void *data, int device, int timeout_ms);
/* READS: tells owner that this node read `gets` of its objects, `bytes` in all (a message). */
int fr_store_send_reads(ferry_store *s, const char *owner, uint64_t gets, uint64_t bytes,
                        int timeout_ms);

/* receipts.c: read receipts */
void fr_store_receipts_init(ferry_store *s);
/* One object of `owner` read whole (a get, a batch item, a view): counted for its owner, at
 * once when that is this node, else in the receipt sent to it later. A lock and an add; at
 * most once a second it hands the sending to a task of the process's pool. */
void fr_store_receipt(ferry_store *s, const char *owner, uint64_t bytes);
/* Hands sending every count to a task of the pool (the service thread's turn), unless there
 * is none or a flush is under way. */
void fr_store_receipts_flush(ferry_store *s);
/* Waits for a flush under way, sends what is left (within a second) and frees the table. */
void fr_store_receipts_close(ferry_store *s);

/* owned.c: the objects this node owns */
fr_owned *fr_store_find_owned(ferry_store *s, const char *key, size_t *at);
/* Puts o in the table; returns the object it replaced (or NULL). Lock held. */
fr_owned *fr_store_owned_swap(ferry_store *s, fr_owned *o);
/* Zeroes o's generation word and frees its slot and block, unless a view pins it (true: it
 * waits on the pinned list). Lock held. */
bool fr_store_retire(ferry_store *s, fr_owned *o);
/* Frees the retired objects no view pins any more. Lock held. */
void fr_store_pinned_reap(ferry_store *s);
/* Waits (until the deadline) for the views that pin a slot's old in-place version. No lock. */
void fr_store_wait_unpinned(ferry_store *s, uint32_t slot, const char *key, uint64_t deadline);
/* Lingering copies, oldest first (lock held): add one; retire the oldest (false: none);
 * retire those older than FERRY_STORE_LINGER_MS. */
void fr_store_linger_push(ferry_store *s, fr_owned *o);
bool fr_store_linger_pop(ferry_store *s);
/* Retires the oldest lingering copy held in the device pool (device) or the host pool (false:
 * none): what makes room in that pool. */
bool fr_store_linger_pop_in(ferry_store *s, bool device);
/* Whether retiring every replaced copy lingering in that pool would free room enough for `bytes`
 * beside what it holds (fragmentation aside): else making room retires them for nothing. */
bool fr_store_linger_can_help(ferry_store *s, bool device, uint64_t bytes);
void fr_store_linger_expire(ferry_store *s, uint64_t now);
/* Retires lingering copies replaced more than FERRY_STORE_LINGER_MS ago and frees retired objects
 * no view pins any more (the service thread, after each request and every third of the lease). */
void fr_store_linger_reap(ferry_store *s);
/* Retires every owned and lingering object (store close). */
void fr_store_retire_all(ferry_store *s);
/* Deletes an object this node owns (generation 0: any). FERRY_ENOTFOUND when not held. Memory
 * published in place that views still pin: wait_views waits for them until the timeout (the
 * caller's own delete); otherwise (a delete another node asked for) it is handed back at once
 * and the views are told (ferry_store_view_valid() says 0). */
int fr_store_delete_local(ferry_store *s, const char *key, uint64_t generation, bool in_directory,
                          bool wait_views, int timeout_ms);
/* The same with publish_lock already held; *pinned_slot (may be NULL: hand back at once) receives
 * the slot to wait on, or UINT32_MAX. */
int fr_store_delete_owned(ferry_store *s, const char *key, uint64_t generation, bool in_directory,
                          int timeout_ms, uint32_t *pinned_slot);

/* publish_lock, taken no later than the caller's deadline: its holder may be waiting on the
 * directory for as long as its own timeout (the node timer's republish, another put or delete).
 * `by` says what takes it ("a put", ...: a static string); timeout_ms < 0 waits as long as it
 * takes (the service thread). FERRY_ETIMEDOUT names the directory and what held the lock; *w
 * receives whom the call waited behind and for how long (fr_store_waited). */
typedef struct fr_store_wait {
  const char *behind; /* NULL: the lock was free */
  int waited_ms;
} fr_store_wait;
int fr_store_publish_lock(ferry_store *s, const char *by, uint64_t deadline, int timeout_ms,
                          fr_store_wait *w);
void fr_store_publish_unlock(ferry_store *s);
/* A call that timed out after it waited behind another one for part of its time: rc with an
 * error that names its whole wait first (not the directory's share of what was left). */
int fr_store_waited(ferry_store *s, int rc, const fr_store_wait *w, int timeout_ms);

/* register.c: the node's lease and republishing */
/* Registers again when the directory's epoch moved (it restarted or was redialled). */
int fr_store_ensure_registered(ferry_store *s, int timeout_ms);
int fr_store_register(ferry_store *s, bool fresh, int timeout_ms);
/* Hands publishing every object again, after the directory lost them, to the node's timer (on),
 * or takes it back (off: waits for a call under way). */
void fr_store_republish_by_timer(ferry_store *s, bool on);
/* Leaves the directory: the node goes with its records when the store is its only job, else the
 * store deletes its records and leaves the node to the context's other jobs. */
void fr_store_unregister(ferry_store *s);
/* Acts on the answers of posted puts that came in (all of them, waiting, when `wait`): drop
 * notices for the records they replaced; a registration again (which republishes every object)
 * when the directory lost one. Takes publish_lock for the latter, both no later than the
 * deadline. */
void fr_store_settle(ferry_store *s, bool wait, uint64_t deadline);

/* put.c (a verb) */
/* Publishes a tensor; `fill` (when not NULL) writes the bytes into the pool instead of a copy
 * from data (uploads read them from a peer). data lies on CUDA device `device` (-1: host memory,
 * fr_store_device): its bytes are then copied into the device pool (device to device) or the
 * pool (device to host), never in place. */
typedef int (*fr_fill_fn)(void *arg, void *dst, uint64_t bytes);
int fr_store_put_local(ferry_store *s, const char *key, const ferry_tensor_desc *desc,
                       const void *data, int device, uint32_t flags, fr_fill_fn fill,
                       void *fill_arg, uint64_t *generation, int timeout_ms);

/* get.c (a verb) */
/* Reads the object `rec` describes into dst (rec->bytes long) on CUDA device `device` (-1: host
 * memory). FERRY_ESTALE: look it up again. */
int fr_store_read(ferry_store *s, const fr_dir_object *rec, void *dst, int device, int timeout_ms);
/* Reads in chunks, calling progress(arg, done, total) between them (the CLI's progress bar). */
int fr_store_get_progress(ferry_store *s, const char *key, void **out, ferry_store_info *info,
                          void (*progress)(void *arg, uint64_t done, uint64_t total), void *arg,
                          int timeout_ms);

/* ops.c (a verb) */
/* Deletes the object `rec` describes, asking its owner (or the directory if it is gone). */
int fr_store_delete_rec(ferry_store *s, const fr_dir_object *rec, int timeout_ms);

/* service.c */
int fr_store_service_start(ferry_store *s);
void fr_store_service_stop(ferry_store *s);

/* Where a caller's buffer lives, classified once per call: its CUDA device ordinal, or -1 for
 * host memory; *room receives the bytes from p to the end of its CUDA allocation (SIZE_MAX for
 * host memory, whose extent ferry cannot know). Without a driver a pthread_once and an atomic
 * load (fr_cuda_where); with one, one driver call for host memory, four for device memory. */
static inline int fr_store_device(const void *p, size_t *room) {
  *room = SIZE_MAX;
  fr_mem_where w = fr_cuda_where(p);
  if (w.kind != FERRY_MEM_CUDA)
    return -1;
  *room = fr_cuda_room(&w, p);
  return w.device;
}

/* Milliseconds left before a deadline, at least 1 (so a call still fails by itself). */
static inline int fr_store_left(uint64_t deadline_ns) {
  int ms = fr_ms_left(deadline_ns);
  return ms > 0 ? ms : 1;
}

#endif
