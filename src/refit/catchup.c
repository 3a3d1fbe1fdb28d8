/*
 * Late join: a receiver that attaches after a version was pushed gets that version at once,
 * without waiting for the next push. The sender keeps every bucket of the latest version in
 * one shared buffer (it packs there in place, so retaining costs no copy) together with each
 * bucket's checksum; a receiver that lacks the latest version and has bound its destinations
 * asks (CATCHUP), and the sender announces it the buckets of that buffer, a few at a time, then
 * COMMIT, exactly as a push would but to that receiver alone. Everything runs on the sender's
 * service thread as acknowledgements arrive, so a catch-up never holds the pushing thread (the
 * frames are queued under the sender's lock and sent once it is released, sender_impl.h); it
 * waits while a push rewrites the buffer. A push that begins stops it and leaves the receiver
 * out (it has no version of the buffer's to build on, and reading every bucket there would make
 * the others' push wait for it): once the push ends it catches up to the newer version from the
 * buffer. A receiver that asks while a push is under way (it attached during the push, or bound
 * a destination while the push landed) is served likewise once the push ends. The receiver
 * verifies each bucket against its checksum, so a bucket a push began to
 * overwrite is refused, never taken, and the abandoned version is never committed (no COMMIT
 * for it follows; the newer version's first bucket starts that version over). A bucket of a
 * device buffer that its push left unhashed (every reader of it read through CUDA IPC) is hashed
 * the first time a receiver that verifies catches up (over tcp, or a shard reader): its
 * announcement waits while the service thread hashes it without s->lock (fr_refit_sum_run), so
 * that a push that begins meanwhile never waits for the copy; the push voids the sum (the
 * buffer's epoch moved), and only a sum of the version's own bytes is kept. A shard reader's sum
 * of its runs in a bucket of a host buffer is taken the same way, a chunk at a time: a push that
 * begins waits for the chunk under way (it rewrites that memory). A reader on this host
 * of whole buckets reads them unhashed (FR_REFIT_DIRECT) as in a push: a push that overwrites
 * them mid-way cancels the catch-up, so no COMMIT follows for the torn version.
 */
#include "refit/sender_impl.h"

/* Bytes announced to a catching-up receiver ahead of its acknowledgements, in whole buckets
 * (at least one, at most four): enough to keep its reads back to back, few enough that a push
 * that begins meanwhile waits for little. Such a push waits for the receiver, which reads what
 * was announced before the push's own buckets: four buckets of the default 64 MiB were the
 * whole of a 256 MiB model (docs/PERFORMANCE.md, Late join). With one 64 MiB bucket in flight
 * the receiver idles an acknowledgement's round trip between reads of tens of milliseconds. */
#define CATCHUP_WINDOW_BYTES (16u << 20)
#define CATCHUP_WINDOW_MAX 4u

static uint32_t window(const fr_refit_plan *p) {
  uint64_t w = CATCHUP_WINDOW_BYTES / (p->bucket_bytes ? p->bucket_bytes : 1);
  return w < 1 ? 1 : w > CATCHUP_WINDOW_MAX ? CATCHUP_WINDOW_MAX : (uint32_t)w;
}

/* Catch-up frames are sent with this timeout: the receiver asked, so it reads; one that stopped
 * since costs the service thread no more than this. */
#define CATCHUP_SEND_MS 1000

static void queue(fr_refit_outbox *out, receiver *r, const fr_refit_msg_t *m) {
  if (fr_refit_out_add(out, r->link, m, CATCHUP_SEND_MS, true) != 0)
    fr_refit_catchup_cancel(r); /* no memory: the next push brings the version */
}

static void tell_no_copy(ferry_refit_sender *s, receiver *r, fr_refit_outbox *out) {
  fr_refit_msg_t m = {.type = FR_REFIT_CATCHUP, .version = s->latest, .status = FERRY_ENOTFOUND};
  queue(out, r, &m);
}

/* Whether r reads the buffer's whole buckets on this host from device memory: unhashed
 * (FR_REFIT_DIRECT), as in a push. */
static bool reads_direct(const ferry_refit_sender *s, const receiver *r) {
  return s->dev_buf >= 0 && r->shm && !r->view && !r->ntargets;
}

static void cannot_catch_up(ferry_refit_sender *s, receiver *r, const char *why,
                            fr_refit_outbox *out) {
  fr_warn("refit '%s': receiver '%s' cannot catch up to version %llu: %s", s->name, r->peer,
          (unsigned long long)r->cu_version, why);
  fr_refit_catchup_cancel(r);
  tell_no_copy(s, r, out);
}

/* Bucket b's checksum for r into m: 1 when there (or r reads it unhashed), 0 when not taken yet
 * (a device buffer's bucket its push left unhashed: the service thread takes it without the lock,
 * fr_refit_catchup_sum_next, then announces it), -1 when r cannot catch up (told so): the buffer
 * no longer holds r's version. */
static int sum_for(ferry_refit_sender *s, receiver *r, uint32_t b, fr_refit_msg_t *m,
                   fr_refit_outbox *out) {
  bool holds = !s->pushing && s->retained == r->cu_version;
  if (holds && reads_direct(s, r)) {
    m->flags |= FR_REFIT_DIRECT;
    return 1;
  }
  if (holds && s->sum_known[b]) {
    m->checksum = s->last_sum[b];
    return 1;
  }
  if (holds && s->dev_buf >= 0)
    return 0;
  cannot_catch_up(s, r, holds ? "no checksum of it was taken" : "the buffer no longer holds it",
                  out);
  return -1;
}

static void announce_next(ferry_refit_sender *s, receiver *r, fr_refit_outbox *out) {
  const fr_refit_plan *p = &s->plan;
  uint32_t w = window(p);
  while (r->cu_version && r->cu_announced < p->buckets && r->cu_announced < r->cu_acked + w) {
    uint32_t b = r->cu_announced;
    fr_refit_msg_t m = {.type = FR_REFIT_BUCKET,
                        .bucket = b,
                        .generation = p->generation,
                        .seq = b,
                        .version = r->cu_version,
                        .bytes = fr_refit_bucket_len(p, b),
                        .src = s->ref[0],
                        .src_offset = (uint64_t)b * p->bucket_bytes};
    if (sum_for(s, r, b, &m, out) <= 0)
      return;                        /* 0: announced once its checksum is taken */
    if (r->view && s->dev_buf < 0) { /* a shard reader: the sum of its runs, taken from the
                                        retained bucket by the service thread without the lock
                                        (in CUDA memory: it reads whole buckets) */
      if (r->cu_view_for != b + 1)
        return; /* announced once it is taken */
      m.view = r->view->serial;
      m.view_sum = r->cu_view_sum;
    }
    r->cu_announced++;
    queue(out, r, &m);
  }
}

/* Whether r's next announcement (bucket *b: announce_next stopped there) waits for a sum to be
 * taken: the bucket's checksum (a device buffer's that no push took), or (*view) the sum of r's
 * view's runs in it. */
static bool waits_for_sum(const ferry_refit_sender *s, const receiver *r, uint32_t *b, bool *view) {
  *b = r->cu_announced;
  *view = false;
  if (!r->cu_version || r->cu_version != s->retained || *b >= s->plan.buckets ||
      *b >= r->cu_acked + window(&s->plan))
    return false;
  if (s->dev_buf >= 0)
    return !reads_direct(s, r) && !s->sum_known[*b];
  *view = r->view && r->cu_view_for != *b + 1;
  return *view;
}

bool fr_refit_catchup_sum_next(ferry_refit_sender *s, fr_refit_sum_job *j) {
  if (s->pushing || s->bar_sums || s->summing || !s->sealed || !s->retained)
    return false;
  for (receiver *r = s->receivers; r; r = r->next) {
    uint32_t b;
    bool view;
    if (waits_for_sum(s, r, &b, &view)) {
      fr_refit_sum_begin(s, b, view ? r : NULL, j);
      return true;
    }
  }
  return false;
}

void fr_refit_catchup_sum_done(ferry_refit_sender *s, const fr_refit_sum_job *j, int rc,
                               uint64_t sum, fr_refit_outbox *out) {
  rc = fr_refit_sum_end(s, j, rc, sum);
  char why[256];
  fr_str_copy(why, sizeof why, rc ? ferry_last_error() : "");
  for (receiver *r = s->receivers; r; r = r->next) {
    uint32_t b;
    bool view;
    if (rc != 0 && rc != FERRY_ESTALE && waits_for_sum(s, r, &b, &view) && b == j->bucket && !view)
      cannot_catch_up(s, r, why, out); /* the copy failed */
    else
      announce_next(s, r, out); /* void (FERRY_ESTALE): a push or seal stops it anyway */
  }
}

static void start(ferry_refit_sender *s, receiver *r, fr_refit_outbox *out) {
  r->want_catchup = false;
  r->cu_version = s->latest;
  r->cu_announced = r->cu_acked = r->cu_view_for = 0;
  fr_refit_view_refresh(s, r);
  fr_info("refit '%s': receiver '%s' catches up to version %llu", s->name, r->peer,
          (unsigned long long)s->latest);
  announce_next(s, r, out);
}

void fr_refit_catchup_serve(ferry_refit_sender *s, fr_refit_outbox *out) {
  if (s->pushing || !s->sealed)
    return; /* the buffer is being rewritten: served when the push ends */
  for (receiver *r = s->receivers; r; r = r->next) {
    if (r->cu_version) /* under way: what may go now (none once a seal dropped its version) */
      announce_next(s, r, out);
    if (!r->want_catchup || r->dropped || r->cu_version)
      continue;
    if (r->committed == s->latest || s->latest == 0) {
      r->want_catchup = false; /* it has it already (a push brought it) */
    } else if (s->retained != s->latest || s->retained == 0) {
      r->want_catchup = false;
      tell_no_copy(s, r, out);
    } else {
      start(s, r, out);
    }
  }
}

/* A request that comes during a push is kept, and served when the push ends (its end wakes the
 * service thread), also from a receiver in the push: one that bound a destination while the
 * push landed refuses the push's version, and asks for it (it learnt of it from the COMMIT)
 * before its refusal reaches us. A receiver asks only for a version it does not hold, so one in
 * the push that asks for the push's own version lacks it, whatever its COMMITTED says (it bound
 * a new destination after committing it). */
void fr_refit_catchup_request(ferry_refit_sender *s, receiver *r, uint64_t version,
                              fr_refit_outbox *out) {
  if (s->pushing && version < s->pushing && (r->in_push || r->in_stream))
    return; /* the push under way (between its parts, too) lands a newer one over it */
  if (version == r->committed)
    r->committed = 0; /* it lacks what it committed: it bound a new destination since */
  if (r->in_push && version == s->pushing)
    r->lacks = version;
  if (r->cu_version)
    return; /* under way already */
  r->want_catchup = true;
  fr_refit_catchup_serve(s, out); /* now, unless a push is under way */
}

bool fr_refit_catchup_overtaken(ferry_refit_sender *s, receiver *r, uint64_t retained) {
  bool catching_up = r->cu_version || r->want_catchup;
  fr_refit_catchup_cancel(r);
  if (!catching_up || retained == 0 || retained != s->latest)
    return false;         /* nothing whole to catch up from after the push: the push brings it */
  r->want_catchup = true; /* served when the push ends, with the push's version */
  fr_info("refit '%s': receiver '%s' was catching up; it catches up to version %llu after that "
          "push instead of joining it",
          s->name, r->peer, (unsigned long long)s->pushing);
  return true;
}

void fr_refit_catchup_cancel(receiver *r) {
  r->cu_version = 0;
  r->want_catchup = false;
}

bool fr_refit_catchup_record(ferry_refit_sender *s, receiver *r, const fr_refit_msg_t *x,
                             fr_refit_outbox *out) {
  if (!r->cu_version || x->version != r->cu_version)
    return false;
  if (x->type == FR_REFIT_COMMITTED) {
    if (x->status == 0)
      r->committed = r->cu_version;
    fr_info("refit '%s': receiver '%s' %s version %llu", s->name, r->peer,
            x->status == 0 ? "caught up to" : "failed to catch up to",
            (unsigned long long)r->cu_version);
    r->cu_version = 0;
  } else if (x->type == FR_REFIT_ACK && x->status != 0) {
    fr_warn("refit '%s': receiver '%s' could not catch up to version %llu (%s); the next push "
            "brings it",
            s->name, r->peer, (unsigned long long)r->cu_version, ferry_strerror(x->status));
    r->cu_version = 0;
  } else if (x->type == FR_REFIT_ACK && x->seq == r->cu_acked) {
    r->cu_acked++;
    announce_next(s, r, out);
    if (r->cu_acked == s->plan.buckets) {
      fr_refit_msg_t c = {.type = FR_REFIT_COMMIT,
                          .version = r->cu_version,
                          .bytes = s->plan.buckets,
                          .generation = s->plan.generation};
      queue(out, r, &c);
    }
  }
  return true;
}
