/*
 * Streaming pushes: a version sent in parts (ferry_refit_push_opts.part), for a trainer whose
 * tensors exist a few at a time. The caller points declared tensors at their bytes as they come
 * (ferry_refit_set_data, which marks each one given); each part sends the buckets of the version
 * that are ready (every tensor in them given) and not sent yet, and the last part commits. This
 * file keeps that bookkeeping: which buckets a part sends, which were sent, which tensors' memory
 * is no longer read (ferry_refit_part_sent), and the rules of when a part may run; push.c runs
 * each part as a push that sends only those buckets and, but for the last, commits nothing.
 * Receivers count the buckets they verified over all the parts of a version, and commit only at
 * the last part's COMMIT, which carries the version's whole bucket count: one that took fewer
 * (it attached between parts, or the sender died before the last) never reports the version.
 */
#include "core/cuda.h"
#include "refit/sender_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The entry named `name` (s->lock held), looked up first where the last one was found + 1:
 * a trainer yields its tensors in the same order every version, so each lookup is one compare. */
static int64_t find(ferry_refit_sender *s, const char *name) {
  uint32_t h = s->stream.find_hint;
  if (h < s->plan.count && strcmp(s->plan.entries[h].name, name) == 0) {
    s->stream.find_hint = h + 1;
    return h;
  }
  int64_t at = fr_refit_plan_find(&s->plan, name);
  if (at >= 0)
    s->stream.find_hint = (uint32_t)at + 1;
  return at;
}

/* Where data lives (a CUDA device, or -1), and that the tensor fits there. */
static int where(ferry_refit_sender *s, const fr_refit_entry *e, const void *data, int *device) {
  fr_mem_where w = fr_cuda_where(data);
  *device = w.kind == FERRY_MEM_CUDA ? w.device : -1;
  if (*device >= 0 && e->src_bytes > fr_cuda_room(&w, data))
    return fr_err(FERRY_EINVAL,
                  "refit '%s': tensor '%s' (%llu bytes) runs past the end of its CUDA allocation "
                  "on device %d",
                  s->name, e->name, (unsigned long long)e->src_bytes, *device);
  if (s->dev_buf >= 0 && *device != s->dev_buf)
    return fr_err(FERRY_EINVAL,
                  "refit '%s': tensor '%s': this sender's buffers are CUDA device %d's memory, "
                  "so its tensors stay there (declare and seal again to move them)",
                  s->name, e->name, s->dev_buf);
  return 0;
}

int ferry_refit_set_data(ferry_refit_sender *s, const char *name, const void *data) {
  if (!s || !name || !data)
    return fr_err(FERRY_EINVAL, "ferry_refit_set_data: NULL argument");
  pthread_mutex_lock(&s->lock);
  int64_t at = find(s, name);
  int device = -1;
  int rc = at < 0 ? fr_err(FERRY_ENOTFOUND, "refit '%s': no tensor '%s' declared", s->name, name)
                  : where(s, &s->plan.entries[at], data, &device);
  if (rc == 0) {
    s->src[at].data = data;
    s->src[at].device = device;
    s->src[at].given = true;
    if (device >= 0 && s->sealed)
      rc = fr_refit_sender_to_device(s);
  }
  pthread_mutex_unlock(&s->lock);
  return rc;
}

/* Every bucket that holds a byte of entry e was sent (s->lock held). */
static bool entry_sent(const ferry_refit_sender *s, uint32_t e) {
  const fr_refit_entry *x = &s->plan.entries[e];
  uint64_t bb = s->plan.bucket_bytes, len = x->wire_bytes;
  if (!s->stream.version || !s->stream.sent || bb == 0)
    return false;
  for (uint64_t b = x->offset / bb; len && b <= (x->offset + len - 1) / bb && b < s->plan.buckets;
       b++)
    if (!s->stream.sent[b])
      return false;
  return true;
}

int ferry_refit_part_sent(ferry_refit_sender *s, const char *name) {
  if (!s || !name)
    return fr_err(FERRY_EINVAL, "ferry_refit_part_sent: NULL argument");
  pthread_mutex_lock(&s->lock);
  int64_t at = find(s, name);
  int rc = at < 0 ? fr_err(FERRY_ENOTFOUND, "refit '%s': no tensor '%s' declared", s->name, name)
                  : entry_sent(s, (uint32_t)at);
  pthread_mutex_unlock(&s->lock);
  return rc;
}

int fr_refit_stream_check(ferry_refit_sender *s, uint64_t version, const ferry_refit_push_opts *o,
                          int part) {
  uint64_t open = s->stream.version;
  if (part < FERRY_REFIT_PART_NONE || part > FERRY_REFIT_PART_ABORT)
    return fr_err(FERRY_EINVAL, "refit '%s': push part %d (NONE, MORE, LAST or ABORT)", s->name,
                  part);
  if (part == FERRY_REFIT_PART_NONE && open)
    return fr_err(FERRY_ESTATE,
                  "refit '%s': version %llu is open in parts: push its last part "
                  "(FERRY_REFIT_PART_LAST) or abandon it (FERRY_REFIT_PART_ABORT) first",
                  s->name, (unsigned long long)open);
  if (part == FERRY_REFIT_PART_NONE || part == FERRY_REFIT_PART_ABORT)
    return 0;
  if (s->plan.world > 1)
    return fr_err(FERRY_ENOTSUP,
                  "refit '%s': a rank of a sender group cannot push in parts (push each version "
                  "whole)",
                  s->name);
  if (s->dev_buf >= 0)
    return fr_err(FERRY_ENOTSUP,
                  "refit '%s': a sender whose buffers are CUDA memory (alias or device_buckets) "
                  "cannot push in parts",
                  s->name);
  if (FR_OPT(o, only, NULL))
    return fr_err(FERRY_EINVAL,
                  "refit '%s': `only` with a push in parts (a part sends what was given)", s->name);
  if (open && version != open)
    return fr_err(FERRY_EINVAL,
                  "refit '%s': version %llu is open in parts: its parts carry that number, not "
                  "%llu",
                  s->name, (unsigned long long)open, (unsigned long long)version);
  return 0;
}

int fr_refit_stream_open(ferry_refit_sender *s, uint64_t version) {
  fr_refit_stream *st = &s->stream;
  free(st->sent);
  st->sent = calloc(s->plan.buckets ? s->plan.buckets : 1, 1);
  if (!st->sent)
    return fr_err(FERRY_ENOMEM, "refit '%s': %u buckets", s->name, s->plan.buckets);
  st->version = st->spent = version;
  st->nsent = 0;
  st->bytes = 0;
  st->t0 = fr_now_ns();
  st->first = 0;
  st->failed[0] = 0;
  return 0;
}

/* Bucket b's tensors were all given (s->lock held); *missing: the first that was not. */
static bool ready(const ferry_refit_sender *s, uint32_t b, uint32_t *missing) {
  const fr_refit_plan *p = &s->plan;
  for (uint32_t e = fr_refit_first_entry(p, b); e < p->count; e++) {
    uint64_t wo, bo;
    if (fr_refit_overlap(p, e, b, &wo, &bo) == 0) {
      if (p->entries[e].offset >= (uint64_t)b * p->bucket_bytes + fr_refit_bucket_len(p, b))
        break;
      continue; /* no bytes (an empty tensor) */
    }
    if (!s->src[e].given) {
      *missing = e;
      return false;
    }
  }
  return true;
}

int fr_refit_stream_select(ferry_refit_sender *s, bool last, uint32_t *order, uint32_t *n) {
  uint32_t missing = UINT32_MAX, count = 0;
  pthread_mutex_lock(&s->lock);
  for (uint32_t b = 0; b < s->plan.buckets; b++) {
    uint32_t m = UINT32_MAX;
    if (s->stream.sent[b])
      continue;
    if (ready(s, b, &m))
      order[count++] = b;
    else if (missing == UINT32_MAX)
      missing = m;
  }
  char name[FR_REFIT_NAME_MAX + 1] = "";
  if (missing != UINT32_MAX)
    fr_str_copy(name, sizeof name, s->plan.entries[missing].name);
  pthread_mutex_unlock(&s->lock);
  *n = count;
  if (last && missing != UINT32_MAX)
    return fr_err(FERRY_ESTATE,
                  "refit '%s': the last part of version %llu, but tensor '%s' was not given "
                  "(ferry_refit_set_data) for it; the version is abandoned",
                  s->name, (unsigned long long)s->stream.version, name);
  return 0;
}

void fr_refit_stream_sent(ferry_refit_sender *s, const uint32_t *order, uint32_t n) {
  pthread_mutex_lock(&s->lock);
  for (uint32_t j = 0; j < n; j++) {
    s->stream.nsent += !s->stream.sent[order[j]];
    s->stream.sent[order[j]] = 1;
  }
  pthread_mutex_unlock(&s->lock);
}

void fr_refit_stream_note(ferry_refit_sender *s, receiver *r, int status) {
  fr_refit_stream *st = &s->stream;
  r->stream_status = status;
  if (!st->first)
    st->first = status;
  size_t used = strlen(st->failed);
  if (used + 1 < sizeof st->failed)
    snprintf(st->failed + used, sizeof st->failed - used, "%s'%s' (%s, in an earlier part)",
             used ? ", " : "", r->peer, ferry_strerror(status));
}

void fr_refit_stream_close(ferry_refit_sender *s) {
  pthread_mutex_lock(&s->lock);
  s->stream.version = 0;
  s->stream.first = 0;
  s->stream.failed[0] = 0;
  for (uint32_t i = 0; i < s->plan.count; i++)
    s->src[i].given = false;
  pthread_mutex_unlock(&s->lock);
}
