/*
 * Read receipts: how an owner learns of the gets it served. A get reads the owner's memory
 * one-sidedly (mapped on its host, ferry_read across hosts), so the owner's CPU never sees it;
 * instead each reader counts, per owner, the objects it read whole (a get, each item of a batch,
 * a view) and their bytes, and reports them to that owner in one READS message (msg.c) per owner:
 * from a task of the process's pool at most once every RECEIPT_PERIOD_MS while reads go on, at
 * the service thread's turn (a third of the lease) and when the store closes. Counting is a
 * lock and an add per object read, never a message, so a get costs what it did. The owner adds
 * what it is told to ferry_store_served_gets_total / _bytes_total (metrics.c), bounded there: a
 * receipt is a peer's claim. Reads of this node's own objects count there at once, with no
 * receipt. Receipts a reader could not deliver (the owner gone or stalled past RECEIPT_SEND_MS,
 * or no memory for the table) are dropped: the counters are for operations, not accounting.
 */
#include "store/store.h"
#include "core/task.h"

#include <stdlib.h>
#include <string.h>

#define RECEIPT_PERIOD_MS 1000
#define RECEIPT_SEND_MS 200   /* one owner's READS; a stalled owner costs at most this */
#define RECEIPT_CLOSE_MS 1000 /* every owner's, when the store closes */
#define RECEIPT_MIN_SLOTS 16

/* ---- the table: owner name → counts not yet reported (open addressing, linear probing) ---- */

static fr_receipt *probe(fr_receipt *slots, size_t cap, const char *owner) {
  size_t i = fr_dir_key_hash(owner) & (cap - 1);
  while (slots[i].owner[0] && strcmp(slots[i].owner, owner) != 0)
    i = (i + 1) & (cap - 1);
  return &slots[i];
}

/* Rebuilds the table with room for twice the owners that have counts (the names of owners with
 * none are dropped, so it never outgrows the owners read from in one period). Lock held. */
static bool rebuild(fr_receipts *r) {
  size_t live = 0;
  for (size_t i = 0; i < r->cap; i++)
    live += r->slots[i].gets > 0;
  size_t cap = RECEIPT_MIN_SLOTS;
  while (cap < live * 4)
    cap *= 2;
  fr_receipt *slots = calloc(cap, sizeof *slots);
  if (!slots)
    return false;
  for (size_t i = 0; i < r->cap; i++)
    if (r->slots[i].gets > 0)
      *probe(slots, cap, r->slots[i].owner) = r->slots[i];
  free(r->slots);
  r->slots = slots;
  r->cap = cap;
  r->named = live;
  return true;
}

/* The slot of owner, named if it was not; NULL when no memory. Lock held. */
static fr_receipt *slot_of(fr_receipts *r, const char *owner) {
  if ((r->named + 1) * 2 > r->cap && !rebuild(r))
    return NULL;
  fr_receipt *e = probe(r->slots, r->cap, owner);
  if (!e->owner[0]) {
    fr_str_copy(e->owner, sizeof e->owner, owner);
    r->named++;
  }
  return e;
}

/* ---- reporting ---- */

/* Takes every count (zeroing them) and sends each owner its READS, no later than the deadline.
 * The caller holds the flush (r->flushing). */
static void flush(ferry_store *s, uint64_t deadline) {
  fr_receipts *r = &s->receipts;
  pthread_mutex_lock(&r->lock);
  size_t n = 0;
  fr_receipt *out = r->named ? malloc(r->named * sizeof *out) : NULL;
  for (size_t i = 0; out && i < r->cap; i++)
    if (r->slots[i].gets > 0) {
      out[n++] = r->slots[i];
      r->slots[i].gets = r->slots[i].bytes = 0;
    }
  if (out)
    r->pending = false;
  pthread_mutex_unlock(&r->lock);
  for (size_t i = 0; i < n; i++) {
    int ms = fr_ms_left(deadline);
    if (ms <= 0 || fr_store_send_reads(s, out[i].owner, out[i].gets, out[i].bytes,
                                       ms < RECEIPT_SEND_MS ? ms : RECEIPT_SEND_MS) != 0)
      fr_debug("store '%s': %llu reads of '%s' not reported: %s", s->name,
               (unsigned long long)out[i].gets, out[i].owner,
               ms <= 0 ? "out of time" : ferry_last_error());
  }
  fr_err_clear();
  free(out);
}

/* Takes the flush (false: nothing to report, another flush holds it, or the store is
 * closing). */
static bool flush_take(fr_receipts *r) {
  pthread_mutex_lock(&r->lock);
  bool took = r->pending && !r->flushing && !r->closed;
  r->flushing |= took;
  pthread_mutex_unlock(&r->lock);
  return took;
}

static void flush_give(fr_receipts *r) {
  pthread_mutex_lock(&r->lock);
  r->flushing = false;
  r->due_ns = fr_now_ns() + RECEIPT_PERIOD_MS * 1000000ull;
  pthread_cond_broadcast(&r->idle);
  pthread_mutex_unlock(&r->lock);
}

static void flush_task(void *arg) {
  ferry_store *s = arg;
  flush(s, fr_deadline_ns(RECEIPT_CLOSE_MS));
  flush_give(&s->receipts);
}

void fr_store_receipts_init(ferry_store *s) {
  fr_receipts *r = &s->receipts;
  pthread_mutex_init(&r->lock, NULL);
  pthread_cond_init(&r->idle, NULL);
  r->due_ns = fr_now_ns() + RECEIPT_PERIOD_MS * 1000000ull;
}

void fr_store_receipt(ferry_store *s, const char *owner, uint64_t bytes) {
  if (s->mem && strcmp(owner, s->name) == 0) {
    fr_store_count_served(s, 1, bytes); /* its own object: no receipt to send */
    return;
  }
  fr_receipts *r = &s->receipts;
  uint64_t now = fr_now_ns();
  pthread_mutex_lock(&r->lock);
  fr_receipt *e = slot_of(r, owner);
  if (e) {
    e->gets++;
    e->bytes += bytes;
    r->pending = true;
  }
  bool start = e && now >= r->due_ns && !r->flushing && !r->closed;
  r->flushing |= start;
  pthread_mutex_unlock(&r->lock);
  if (start && fr_task_try(flush_task, s) != 0)
    flush_give(r); /* every worker is busy: the next read after a period tries again */
}

void fr_store_receipts_flush(ferry_store *s) {
  if (flush_take(&s->receipts) && fr_task_try(flush_task, s) != 0)
    flush_give(&s->receipts); /* on a task: a stalled owner never holds the service thread */
}

void fr_store_receipts_close(ferry_store *s) {
  fr_receipts *r = &s->receipts;
  pthread_mutex_lock(&r->lock);
  r->closed = true; /* no flush starts after this one */
  while (r->flushing)
    pthread_cond_wait(&r->idle, &r->lock);
  r->flushing = true;
  pthread_mutex_unlock(&r->lock);
  if (s->dir)
    flush(s, fr_deadline_ns(RECEIPT_CLOSE_MS));
  free(r->slots);
  r->slots = NULL;
  r->cap = r->named = 0;
  pthread_cond_destroy(&r->idle);
  pthread_mutex_destroy(&r->lock);
}
