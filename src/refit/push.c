/*
 * ferry_refit_push: packs buckets into the sender's two shared-memory buffers (casting on the
 * way), announces each to every receiver, and waits for acknowledgements before a buffer is
 * reused, so packing bucket i+1 overlaps the receivers' reads of bucket i. A receiver that dies,
 * stalls past the timeout or refuses a checksum fails alone; the others commit.
 */
#include "refit/sender_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FR_REFIT_CHUNK (256u * 1024u) /* packed and hashed while it is still in cache */

/* Packs [lo, lo+len) of bucket b (casting on the way) into dst. */
static void pack_window(ferry_refit_sender *s, uint32_t b, uint64_t lo, uint64_t len,
                        uint8_t *dst) {
  const fr_refit_plan *p = &s->plan;
  uint64_t start = (uint64_t)b * p->bucket_bytes + lo;
  for (uint32_t e = fr_refit_first_entry(p, b); e < p->count; e++) {
    uint64_t wire_off, dst_off, n = fr_refit_overlap_window(p, e, start, len, &wire_off, &dst_off);
    if (n == 0) {
      if (p->entries[e].offset >= start + len)
        break;
      continue;
    }
    const fr_refit_entry *x = &p->entries[e];
    size_t we = ferry_dtype_size(x->wire), se = ferry_dtype_size(x->desc.dtype);
    const uint8_t *src = (const uint8_t *)s->src[e].data + wire_off / we * se;
    fr_refit_cast(x->desc.dtype, x->wire, x->scale, src, dst + dst_off, n / we);
  }
}

/* Packs bucket b into dst chunk by chunk, hashing each chunk while it is hot. */
static uint64_t pack(ferry_refit_sender *s, uint32_t b, uint8_t *dst) {
  uint64_t len = fr_refit_bucket_len(&s->plan, b);
  fr_hash *h = fr_hash_begin();
  for (uint64_t lo = 0; lo < len; lo += FR_REFIT_CHUNK) {
    uint64_t n = len - lo < FR_REFIT_CHUNK ? len - lo : FR_REFIT_CHUNK;
    pack_window(s, b, lo, n, dst + lo);
    fr_hash_update(h, dst + lo, n);
  }
  uint64_t sum = fr_hash_end(h);
  return sum;
}

static bool bucket_selected(ferry_refit_sender *s, const ferry_refit_push_opts *o, uint32_t b) {
  if (!o || !o->only)
    return true;
  const fr_refit_plan *p = &s->plan;
  for (uint32_t e = fr_refit_first_entry(p, b); e < p->count; e++) {
    uint64_t wo, bo;
    if (fr_refit_overlap(p, e, b, &wo, &bo) == 0)
      break;
    for (size_t i = 0; i < o->n_only; i++)
      if (strcmp(o->only[i], p->entries[e].name) == 0)
        return true;
  }
  return false;
}

/* Marks receivers that died or ran out of time; true when every live one satisfies `done`. */
static bool all_done(ferry_refit_sender *s, uint64_t deadline, uint32_t acked, bool commit) {
  bool all = true;
  for (receiver *r = s->receivers; r; r = r->next) {
    if (!r->in_push || r->status != 0)
      continue;
    if (commit ? r->commit_seen : r->acked >= acked)
      continue;
    int st = ferry_link_status(r->link);
    if (st != 0)
      r->status = FERRY_EPEER;
    else if (fr_now_ns() >= deadline)
      r->status = FERRY_ETIMEDOUT;
    else
      all = false;
  }
  return all;
}

static void wait_for(ferry_refit_sender *s, uint64_t deadline, uint32_t acked, bool commit) {
  pthread_mutex_lock(&s->lock);
  while (!all_done(s, deadline, acked, commit)) {
    uint64_t t = fr_now_ns() + 50000000ull; /* re-check liveness every 50 ms */
    if (t > deadline)
      t = deadline;
    struct timespec ts = {(time_t)(t / 1000000000ull), (long)(t % 1000000000ull)};
    pthread_cond_timedwait(&s->cond, &s->lock, &ts);
  }
  pthread_mutex_unlock(&s->lock);
}

static void announce(ferry_refit_sender *s, const fr_refit_msg_t *m, int timeout_ms) {
  pthread_mutex_lock(&s->lock);
  for (receiver *r = s->receivers; r; r = r->next)
    if (r->in_push && r->status == 0) {
      int rc = fr_refit_send(r->link, m, timeout_ms);
      if (rc != 0)
        r->status = rc;
    }
  pthread_mutex_unlock(&s->lock);
}

/* Takes a snapshot of who is in this push; true when all of them have the latest version. */
static size_t begin_push(ferry_refit_sender *s, uint64_t version, bool *all_current) {
  size_t n = 0;
  *all_current = true;
  pthread_mutex_lock(&s->lock);
  s->pushing = version;
  for (receiver *r = s->receivers; r; r = r->next) {
    *r = (receiver){.link = r->link, .committed = r->committed, .next = r->next, .in_push = true};
    snprintf(r->peer, sizeof r->peer, "%s", ferry_link_peer(r->link));
    *all_current &= r->committed == s->latest && s->latest != 0;
    n++;
  }
  pthread_mutex_unlock(&s->lock);
  return n;
}

/* Commits the push's outcome; names the failed receivers in the error and drops dead ones. */
static int finish_push(ferry_refit_sender *s, uint64_t version) {
  char failed[512] = "";
  size_t used = 0;
  int first = 0;
  pthread_mutex_lock(&s->lock);
  s->latest = version;
  s->pushing = 0;
  for (receiver **pp = &s->receivers; *pp;) {
    receiver *r = *pp;
    r->in_push = false;
    if (r->status == 0 && r->commit_seen) {
      r->committed = version;
    } else {
      if (!first)
        first = r->status ? r->status : FERRY_EPROTO;
      used += (size_t)snprintf(failed + used, sizeof failed - used, "%s'%s' (%s)", used ? ", " : "",
                               r->peer, ferry_strerror(r->status ? r->status : FERRY_EPROTO));
      if (used >= sizeof failed)
        used = sizeof failed - 1; /* the list is cut; the first failures are named */
    }
    if (ferry_link_status(r->link) != 0) {
      *pp = r->next;
      ferry_link_release(r->link);
      free(r);
    } else {
      pp = &r->next;
    }
  }
  pthread_mutex_unlock(&s->lock);
  if (!first)
    return 0;
  return fr_err(first, "refit '%s' version %llu: not committed by %s", s->name,
                (unsigned long long)version, failed);
}

int ferry_refit_push(ferry_refit_sender *s, uint64_t version, const ferry_refit_push_opts *o) {
  if (!s)
    return fr_err(FERRY_EINVAL, "ferry_refit_push: NULL sender");
  if (!s->sealed)
    return fr_err(FERRY_ESTATE, "refit '%s': seal before pushing", s->name);
  if (version <= s->latest)
    return fr_err(FERRY_EINVAL, "refit '%s': version %llu is not after %llu", s->name,
                  (unsigned long long)version, (unsigned long long)s->latest);
  int timeout_ms = fr_timeout(o ? o->timeout_ms : -1);
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  bool all_current;
  if (begin_push(s, version, &all_current) == 0)
    return finish_push(s, version);
  bool skip = o && o->skip_unchanged && all_current;
  uint32_t sent = 0;
  for (uint32_t b = 0; b < s->plan.buckets; b++) {
    if (all_current && !bucket_selected(s, o, b))
      continue;
    uint32_t k = sent % 2;
    if (sent >= 2)
      wait_for(s, deadline, sent - 1, false); /* the buffer's previous bucket was read */
    uint64_t len = fr_refit_bucket_len(&s->plan, b);
    uint64_t sum = pack(s, b, s->buf[k]);
    if (fr_refit_test_corrupt)
      fr_refit_test_corrupt(b, s->buf[k], len);
    fr_refit_msg_t m = {.type = FR_REFIT_BUCKET,
                        .bucket = b,
                        .generation = s->plan.generation,
                        .buffer = k,
                        .version = version,
                        .bytes = len,
                        .checksum = sum};
    if (skip && s->last_sum[b] == sum)
      m.flags = FR_REFIT_UNCHANGED;
    s->last_sum[b] = sum;
    announce(s, &m, timeout_ms);
    sent++;
  }
  wait_for(s, deadline, sent, false);
  fr_refit_msg_t c = {
      .type = FR_REFIT_COMMIT, .version = version, .bytes = sent, .generation = s->plan.generation};
  announce(s, &c, timeout_ms);
  wait_for(s, deadline, 0, true);
  return finish_push(s, version);
}
