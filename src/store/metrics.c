/*
 * The store's metrics: put and get counts, bytes and latencies, kept by the calls themselves
 * with relaxed atomic adds at their end (one clock read at each end of a call), and the levels
 * (objects, bytes held, pool use) read under the store's lock only when someone scrapes. The
 * gets it served are what its readers' receipts report (receipts.c), bounded here: a peer's
 * claim. Its readiness is its directory lease: a store the directory lost serves no gets from
 * other nodes.
 */
#include "store/store.h"

#include <stdio.h>

void fr_store_count(ferry_store *s, bool put, size_t ok, size_t failed, uint64_t bytes,
                    uint64_t t0) {
  if (!s)
    return;
  if (ok + failed == 0)
    return;
  fr_count(put ? &s->m.puts : &s->m.gets, ok + failed);
  if (failed)
    fr_count(put ? &s->m.put_errors : &s->m.get_errors, failed);
  if (bytes)
    fr_count(put ? &s->m.put_bytes : &s->m.get_bytes, bytes);
  fr_hist_observe(put ? &s->m.put_ns : &s->m.get_ns, fr_now_ns() - t0);
}

void fr_store_count_served(ferry_store *s, uint64_t gets, uint64_t bytes) {
  fr_count(&s->m.served_gets, gets);
  fr_count(&s->m.served_bytes, bytes);
}

void fr_store_count_claimed(ferry_store *s, uint64_t gets, uint64_t bytes) {
  uint64_t largest = __atomic_load_n(&s->m.largest, __ATOMIC_RELAXED);
  uint64_t most = largest && gets > UINT64_MAX / largest ? UINT64_MAX : gets * largest;
  if (bytes > most)
    fr_debug("store '%s': a read receipt claims %llu bytes in %llu gets, more than its largest "
             "object (%llu bytes) allows: counted as %llu",
             s->name, (unsigned long long)bytes, (unsigned long long)gets,
             (unsigned long long)largest, (unsigned long long)most);
  fr_store_count_served(s, gets, bytes < most ? bytes : most);
}

void fr_store_note_size(ferry_store *s, uint64_t bytes) {
  uint64_t was = __atomic_load_n(&s->m.largest, __ATOMIC_RELAXED);
  while (bytes > was && !__atomic_compare_exchange_n(&s->m.largest, &was, bytes, true,
                                                     __ATOMIC_RELAXED, __ATOMIC_RELAXED))
    ;
}

static void collect(void *arg, fr_stats_out *out) {
  ferry_store *s = arg;
  const char *st = s->name;
  fr_stat_counter(out, "ferry_store_puts_total",
                  "Objects put (each item of a batch counts): this node's own, and those it "
                  "holds for clients (ferry put to ferry serve)",
                  (double)fr_counted(&s->m.puts), "store", st, NULL);
  fr_stat_counter(out, "ferry_store_put_errors_total", "Puts that failed",
                  (double)fr_counted(&s->m.put_errors), "store", st, NULL);
  fr_stat_counter(out, "ferry_store_put_bytes_total", "Bytes of the objects put",
                  (double)fr_counted(&s->m.put_bytes), "store", st, NULL);
  fr_stat_hist(out, "ferry_store_put_duration_seconds", "Time a put (or put batch) call took",
               &s->m.put_ns, 1e-9, "store", st, NULL);
  fr_stat_counter(out, "ferry_store_gets_total",
                  "Objects this node got (each item of a batch counts); another node's get "
                  "reads the owner's memory without it, and counts there",
                  (double)fr_counted(&s->m.gets), "store", st, NULL);
  fr_stat_counter(out, "ferry_store_get_errors_total", "Gets that failed (not found included)",
                  (double)fr_counted(&s->m.get_errors), "store", st, NULL);
  fr_stat_counter(out, "ferry_store_get_bytes_total", "Bytes of the objects got",
                  (double)fr_counted(&s->m.get_bytes), "store", st, NULL);
  fr_stat_hist(out, "ferry_store_get_duration_seconds", "Time a get (or get batch) call took",
               &s->m.get_ns, 1e-9, "store", st, NULL);
  fr_stat_counter(out, "ferry_store_served_gets_total",
                  "Gets that read one of this node's objects whole (a get, a batch item, a view), "
                  "by this node or another; another's as its read receipts reported them",
                  (double)fr_counted(&s->m.served_gets), "store", st, NULL);
  fr_stat_counter(out, "ferry_store_served_bytes_total",
                  "Bytes of those gets (a receipt's claim, at most its gets times the largest "
                  "object this node held)",
                  (double)fr_counted(&s->m.served_bytes), "store", st, NULL);
  pthread_mutex_lock(&s->lock);
  uint64_t held = 0;
  for (size_t i = 0; i < s->nowned; i++)
    held += s->owned[i]->rec.bytes;
  double objects = (double)s->nowned, used = (double)s->pool.used;
  double capacity = (double)s->pool.capacity, lingering = (double)s->nlinger;
  double dev_used = (double)s->dev.pool.used, dev_capacity = (double)s->dev.pool.capacity;
  pthread_mutex_unlock(&s->lock);
  fr_stat_gauge(out, "ferry_store_objects", "Objects this node holds (current versions)", objects,
                "store", st, NULL);
  fr_stat_gauge(out, "ferry_store_held_bytes", "Bytes of the objects this node holds", (double)held,
                "store", st, NULL);
  fr_stat_gauge(out, "ferry_store_pool_used_bytes",
                "Bytes of the store pool in use (replaced copies still lingering included)", used,
                "store", st, NULL);
  fr_stat_gauge(out, "ferry_store_pool_capacity_bytes",
                "Bytes of the store pool (FERRY_STORE_CAPACITY)", capacity, "store", st, NULL);
  fr_stat_gauge(out, "ferry_store_lingering_objects",
                "Replaced pool copies kept briefly for gets already under way", lingering, "store",
                st, NULL);
  fr_stat_gauge(out, "ferry_store_device_pool_used_bytes",
                "Bytes of the device pool in use (lingering replaced copies included)", dev_used,
                "store", st, NULL);
  fr_stat_gauge(out, "ferry_store_device_pool_capacity_bytes",
                "Bytes of the device pool (FERRY_STORE_DEVICE_POOL_BYTES; 0 until the first put "
                "from device memory made it, or none)",
                dev_capacity, "store", st, NULL);
}

/* Ready while its lease is held and its directory answered the last renewal. */
static int ready(void *arg, char *why, size_t len) {
  ferry_store *s = arg; /* a delegating store holds no name */
  return s->dir && s->mem ? fr_dir_lease_ready(&s->lease, why, len) : 0;
}

int fr_store_stats_start(ferry_store *s) {
  return fr_stats_add(fr_ctx_stats(s->ctx), collect, ready, s);
}

void fr_store_stats_stop(ferry_store *s) { fr_stats_remove(fr_ctx_stats(s->ctx), s); }
