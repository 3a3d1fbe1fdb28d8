/*
 * ferry_refit_push: packs buckets into the sender's shared-memory buffers (casting on the way)
 * and schedules who reads what, when. Receivers read either from the sender (direct) or from
 * their predecessor in a chain, which keeps each bucket it received in a forwarding slot until
 * its successor has read it; so the sender sends each byte once however many receivers chain.
 * One rule drives everything: a bucket is announced to a receiver as soon as its source holds
 * it and the receiver's own forwarding slot is free. Packing bucket i+1 overlaps the reads of
 * bucket i. A receiver that dies, stalls past the timeout or refuses a checksum fails alone:
 * the receivers behind it in a chain get the buckets they miss straight from the sender in a
 * second, direct pass. A receiver that reads shards is announced, beside each bucket's
 * checksum, the sum of its own runs in it (taken while the bucket is packed), and reads directly.
 *
 * Who sends what, and when: the pushing thread decides under s->lock (mark_failures,
 * announce_ready) and queues the frames in the push's outbox; it sends them after releasing the
 * lock, and a frame that did not go fails its receiver under the lock afterwards. The service
 * thread only records acknowledgements (and wakes this thread), so a receiver whose link is full
 * never holds the others' acknowledgements; and a receiver is announced at most AHEAD buckets
 * beyond its acknowledgements, so a stopped one's link never fills with our frames in the first
 * place. Between rounds the pushing thread sleeps on s->cond until an acknowledgement, a link's
 * death (the service thread is told by the transport) or the earliest progress deadline: it
 * polls nothing.
 *
 * A version may also go in parts (ferry_refit_push_opts.part; the bookkeeping is stream.c's):
 * each part runs as a push of the buckets that are ready, the receivers its first part took stay
 * in the later ones unless they fail, and only the last part sends the COMMIT.
 */
#include "refit/sender_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One push: the buckets it moves in order (by seq) and what each one's checksum is. */
typedef struct fr_push {
  uint64_t version;
  int timeout_ms;      /* how long a receiver may make no progress */
  uint32_t n;          /* buckets in this push */
  uint32_t *order;     /* seq → bucket index */
  uint64_t *sum;       /* seq → checksum */
  bool *unchanged;     /* seq → the receivers have these bytes already */
  uint32_t first_pass; /* seqs packed at least once (their sums are known) */
  uint32_t from;       /* first seq of the current pass */
  bool skip;
  bool hash;          /* buckets are hashed (else FR_REFIT_DIRECT: a device buffer, every reader
                         on this host, viewing or reading whole buckets through CUDA IPC) */
  bool share_pack;    /* no receiver copies on this host: pack on two threads */
  bool no_overlap;    /* FERRY_REFIT_NO_OVERLAP: pack a bucket only once the one before was read */
  uint64_t had;       /* the version the whole buffer held complete when the push began, or 0 */
  receiver *head;     /* of the chain, or NULL */
  receiver **viewers; /* the receivers in the push that read shards (a view), and how many */
  size_t nviewers;
  fr_refit_feed *feeds; /* one per viewer, while a bucket is packed */
  fr_refit_outbox out;  /* frames decided under s->lock, sent by this thread after unlocking */
  int pack_rc;          /* a bucket could not be packed (a device tensor's copy failed) */
  char pack_why[256];
  int part;          /* ferry_refit_push_opts.part: a version sent in parts (stream.c) */
  uint32_t commit_n; /* buckets the COMMIT says the version carried (its parts' all, last part) */
} fr_push;

/* Announcements a receiver may have unacknowledged. A receiver reads its buckets one by one, so
 * a few ahead keep it busy; more would only fill its link. Bounding them keeps every frame a
 * stopped receiver never reads (16 of FR_REFIT_MSG_BYTES plus a frame header: ~2 KiB) within the
 * smallest socket buffer the kernel allows (SO_SNDBUF's floor is 4.5 KiB), so a send to it never
 * blocks: it simply stops being announced anything, and its progress deadline fails it. */
#define AHEAD 16u

/* Where seq j (bucket b) lies in the sender's memory: one of two slots, or (alias mode, or a
 * sender that retains the latest version for late joiners) its own place in the whole wire
 * buffer. */
static uint64_t slot_offset(const ferry_refit_sender *s, uint32_t j, uint32_t b, int *slot) {
  *slot = s->whole ? 0 : (int)(j % 2);
  return s->whole ? (uint64_t)b * s->plan.bucket_bytes : 0;
}

static int pack_seq(ferry_refit_sender *s, fr_push *p, uint32_t j) {
  uint32_t b = p->order[j];
  int slot;
  uint64_t off = slot_offset(s, j, b, &slot);
  uint8_t *dst = (uint8_t *)s->buf[slot] + off;
  bool first = j >= p->first_pass; /* else a repacked bucket: same bytes, same checksums */
  size_t nf = first ? p->nviewers : 0;
  for (size_t i = 0; i < nf; i++) /* shard readers: the sums of their runs, taken while packing */
    fr_refit_view_feed_begin(&p->feeds[i], p->viewers[i]->view, b);
  uint64_t sum = 0;
  int rc = fr_refit_pack(s, b, dst, p->share_pack, p->feeds, nf, p->hash, &sum);
  for (size_t i = 0; i < nf; i++)
    p->viewers[i]->vsum[j] = fr_hash_end(p->feeds[i].h);
  if (rc != 0) {
    p->pack_rc = rc;
    fr_str_copy(p->pack_why, sizeof p->pack_why, ferry_last_error());
    return rc;
  }
  if (p->hash) /* else when a catch-up takes its checksum (fr_refit_sum_end) */
    fr_refit_corrupt_for_test(s, b, dst);
  if (!first)
    return 0;
  p->sum[j] = sum;
  p->unchanged[j] = p->skip && p->hash && s->sum_known[b] && s->last_sum[b] == sum;
  s->last_sum[b] = sum;
  s->sum_known[b] = p->hash; /* else taken when first needed (fr_refit_sum_begin) */
  p->first_pass = j + 1;
  return 0;
}

/* Packs the buckets no receiver took (none attached, or all failed early), so the whole buffer
 * holds every bucket of the version for late joiners. */
static void pack_rest(ferry_refit_sender *s, fr_push *p) {
  for (uint32_t j = p->first_pass; j < p->n && p->pack_rc == 0; j++)
    pack_seq(s, p, j);
}

/* A bucket could not be packed: no receiver can commit the version (s->lock held). */
static void fail_all(ferry_refit_sender *s, int rc) {
  for (receiver *r = s->receivers; r; r = r->next)
    if (r->in_push && r->status == 0)
      r->status = rc;
}

static bool bucket_selected(ferry_refit_sender *s, const ferry_refit_push_opts *o, uint32_t b) {
  if (!FR_OPT(o, only, NULL))
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

/* ---- scheduling (all under s->lock) ---- */

static bool active(const receiver *r) { return r->in_push && r->status == 0 && !r->orphan; }

/* r owes the sender an acknowledgement: a bucket announced and not yet acknowledged, or the
 * COMMIT. Only then does its timeout run: a receiver that waits for a bucket the sender cannot
 * pack yet (because another one stalls) is not at fault. */
static bool owes(const receiver *r) {
  return r->announced > r->acked || (r->commit_sent && !r->commit_seen);
}

/* Marks receivers that died or owed an acknowledgement for longer than the timeout, and every
 * chain member behind a failed one. A chain member that timed out while its predecessor failed
 * was reading from that predecessor: it is cut off (orphan), not failed, and gets the rest from
 * the sender. */
static void mark_failures(ferry_refit_sender *s, const fr_push *p) {
  uint64_t now = fr_now_ns();
  for (receiver *r = s->receivers; r; r = r->next) {
    if (!r->in_push || r->status != 0 || (r->commit_seen && !r->orphan))
      continue;
    if (ferry_link_status(r->link) != 0)
      r->status = FERRY_EPEER;
    else if (!r->orphan && owes(r) && now - r->progress_ns >= (uint64_t)p->timeout_ms * 1000000ull)
      r->status = FERRY_ETIMEDOUT;
  }
  for (receiver *r = p->head; r && r->down; r = r->down) {
    if (r->status == 0 && !r->orphan)
      continue;
    receiver *d = r->down;
    if (d->status == FERRY_ETIMEDOUT && !d->commit_sent && ferry_link_status(d->link) == 0) {
      d->status = 0; /* it waited on r */
      d->progress_ns = now;
    }
    d->orphan = true;
  }
}

/* Seq j may go to r: its source holds it, and r's forwarding slot is free (its successor
 * acknowledged what the slot held). */
static bool can_announce(const ferry_refit_sender *s, const fr_push *p, const receiver *r,
                         uint32_t j) {
  bool source = r->up ? r->up->acked > j : j < s->packed && j >= p->from;
  bool slot = !r->down || !active(r->down) || j < 2 || r->down->acked + 1 >= j;
  return source && slot && j < r->acked + AHEAD;
}

/* Queues a frame of the push for r (sent once s->lock is released). */
static void queue(fr_push *p, receiver *r, const fr_refit_msg_t *m) {
  int rc = fr_refit_out_add(&p->out, r->link, m, p->timeout_ms, false);
  if (rc != 0 && r->status == 0)
    r->status = rc;
}

static void announce_one(ferry_refit_sender *s, fr_push *p, receiver *r, uint32_t j) {
  uint32_t b = p->order[j];
  fr_refit_msg_t m = {.type = FR_REFIT_BUCKET,
                      .bucket = b,
                      .generation = s->plan.generation,
                      .seq = j,
                      .version = p->version,
                      .bytes = fr_refit_bucket_len(&s->plan, b),
                      .checksum = p->sum[j],
                      .timeout_ms = (uint32_t)p->timeout_ms,
                      .flags = p->unchanged[j] ? FR_REFIT_UNCHANGED : 0};
  if (!p->hash)
    m.flags |= FR_REFIT_DIRECT;
  if (r->up) {
    m.flags |= FR_REFIT_FROM_UP;
    m.src = r->up->fwd[j % 2];
    m.src_offset = r->up->fwd_offset[j % 2];
  } else {
    int slot;
    m.src_offset = slot_offset(s, j, b, &slot);
    m.src = s->ref[slot];
  }
  if (r->down) {
    m.flags |= FR_REFIT_KEEP;
    m.buffer = j % 2;
  }
  if (r->view && r->vsum) {
    m.view = r->view->serial;
    m.view_sum = r->vsum[j];
  }
  if (!owes(r))
    r->progress_ns = fr_now_ns(); /* its clock starts now (the frame goes right after) */
  queue(p, r, &m);
  r->announced = j + 1;
}

/* Queues every bucket that may be announced now (s->lock held). */
static void announce_ready(ferry_refit_sender *s, fr_push *p) {
  for (receiver *r = s->receivers; r; r = r->next)
    while (active(r) && r->announced < p->n && can_announce(s, p, r, r->announced))
      announce_one(s, p, r, r->announced);
}

static bool pass_done(const ferry_refit_sender *s, const fr_push *p) {
  for (const receiver *r = s->receivers; r; r = r->next)
    if (active(r) && r->acked < p->n)
      return false;
  return true;
}

/* The sender may pack seq q into its slot: every receiver reading from the sender has read the
 * bucket the slot holds. */
static bool slot_free(const ferry_refit_sender *s, const fr_push *p, uint32_t q) {
  for (const receiver *r = s->receivers; p->no_overlap && q > p->from && r; r = r->next)
    if (active(r) && !r->up && r->acked < q) /* no copies of both processes at once */
      return false;
  if (s->whole || q < p->from + 2)
    return true;
  for (const receiver *r = s->receivers; r; r = r->next)
    if (active(r) && !r->up && r->acked + 1 < q)
      return false;
  return true;
}

/* When mark_failures would next fail someone by its clock: the earliest deadline of a receiver
 * that owes an acknowledgement (UINT64_MAX: none does). */
static uint64_t next_deadline(const ferry_refit_sender *s, const fr_push *p) {
  uint64_t first = UINT64_MAX, limit = (uint64_t)p->timeout_ms * 1000000ull;
  for (const receiver *r = s->receivers; r; r = r->next)
    if (r->in_push && r->status == 0 && !r->orphan && !r->commit_seen && owes(r) &&
        r->progress_ns + limit < first)
      first = r->progress_ns + limit;
  return first;
}

/* Waits (s->lock held) for what can change the push's state: an acknowledgement or a goodbye
 * (the service thread records it and signals), a link of the context that died (the transport
 * tells the service thread, which signals), or the next progress deadline. Nothing else changes
 * with time, so there is nothing to poll. */
static void wait_progress(ferry_refit_sender *s, const fr_push *p) {
  uint64_t until = next_deadline(s, p);
  if (until == UINT64_MAX) {
    pthread_cond_wait(&s->cond, &s->lock);
    return;
  }
  struct timespec ts = fr_timespec(until);
  pthread_cond_timedwait(&s->cond, &s->lock, &ts);
}

/* Sends what was queued under s->lock (it is not held), then, under it again, fails the
 * receivers whose frames did not go. */
static void send_queued(ferry_refit_sender *s, fr_push *p) {
  if (p->out.n == 0)
    return;
  uint64_t t0 = fr_now_ns();
  fr_refit_out_send(&p->out);
  pthread_mutex_lock(&s->lock);
  fr_refit_out_settle(s, &p->out);
  pthread_mutex_unlock(&s->lock);
  fr_refit_phase(s, FR_REFIT_PHASE_NOTIFY, t0);
}

/* One pass: packs and announces until every active receiver has every bucket. Decisions are made
 * under s->lock; the announcements go out after it is released. */
static void pump(ferry_refit_sender *s, fr_push *p) {
  for (;;) {
    pthread_mutex_lock(&s->lock);
    mark_failures(s, p);
    announce_ready(s, p);
    bool done = pass_done(s, p);
    uint32_t q = s->packed;
    bool pack_now = !done && q < p->n && slot_free(s, p, q);
    if (!done && !pack_now && p->out.n == 0) {
      uint64_t t0 = fr_now_ns(); /* for a slot while a bucket is left to pack, else for reads */
      wait_progress(s, p);
      fr_refit_phase(s, q < p->n ? FR_REFIT_PHASE_SLOT_WAIT : FR_REFIT_PHASE_READ_WAIT, t0);
    }
    pthread_mutex_unlock(&s->lock);
    send_queued(s, p);
    if (done)
      return;
    if (pack_now) {
      uint64_t t0 = fr_now_ns();
      int rc = pack_seq(s, p, q);
      fr_refit_phase(s, FR_REFIT_PHASE_PACK, t0);
      pthread_mutex_lock(&s->lock);
      if (rc != 0)
        fail_all(s, rc);
      else
        s->packed = q + 1;
      pthread_mutex_unlock(&s->lock);
    }
  }
}

/* Receivers whose chain broke above them read what they miss from the sender, directly. */
static bool start_repair(ferry_refit_sender *s, fr_push *p) {
  bool any = false;
  uint32_t from = p->n;
  pthread_mutex_lock(&s->lock);
  for (receiver *r = s->receivers; r; r = r->next)
    if (r->in_push && r->status == 0 && r->orphan) {
      r->orphan = false;
      r->up = r->down = NULL;
      r->announced = r->acked;
      r->progress_ns = fr_now_ns();
      from = r->acked < from ? r->acked : from;
      any = true;
    }
  if (any) {
    s->repairing = true;
    p->from = s->packed = from;
    p->head = NULL;
  }
  pthread_mutex_unlock(&s->lock);
  if (any)
    fr_info("refit '%s': a chain broke; sending from bucket #%u directly", s->name, from);
  return any;
}

/* ---- the chain ---- */

/* A shard reader holds only its slices, never a whole bucket to forward: it reads directly. */
static bool chained(const receiver *r, ferry_refit_route route) {
  if (!r->in_push || route == FERRY_REFIT_ROUTE_DIRECT || !r->address[0] || r->view)
    return false;
  return route == FERRY_REFIT_ROUTE_CHAIN || !r->shm;
}

/* Links the chain members in attach order (the list holds the newest first) and tells each one
 * where its predecessor is. */
static void build_chain(ferry_refit_sender *s, fr_push *p, ferry_refit_route route) {
  receiver *prev = NULL;
  p->head = NULL;
  for (receiver *r = s->receivers; r; r = r->next) {
    if (!chained(r, route))
      continue;
    r->down = prev; /* walking newest → oldest: r precedes the one seen before it */
    if (prev)
      prev->up = r;
    prev = r;
  }
  p->head = prev;
  for (receiver *r = p->head; r; r = r->down) {
    if (!r->up || (r->routed && strcmp(r->routed, r->up->address) == 0))
      continue;
    fr_refit_msg_t m = {
        .type = FR_REFIT_ROUTE, .route = r->up->address, .route_len = strlen(r->up->address)};
    queue(p, r, &m);
    free(r->routed);
    r->routed = strdup(r->up->address); /* unset again if the frame does not go (outbox.c) */
  }
}

/* Takes a snapshot of who is in this push (*n of them; *all_current when all of them have the
 * latest version), once the service thread's frames went (await_service, else its error). */
static int begin_push(ferry_refit_sender *s, fr_push *p, ferry_refit_route route, bool *all_current,
                      bool later, size_t *in_push) {
  size_t n = 0;
  *all_current = true;
  pthread_mutex_lock(&s->lock);
  int rc = fr_refit_service_await(s, p->version, p->timeout_ms);
  if (rc != 0) {
    pthread_mutex_unlock(&s->lock);
    return rc;
  }
  s->pushing = p->version;
  fr_refit_buf_moves(s); /* a catch-up's checksum being taken now is void: it never holds us */
  s->packed = 0;
  s->repairing = false;
  p->had = s->retained;
  s->retained = 0; /* rewritten in place from now on: late joiners wait for the push's end */
  for (receiver **pp = &s->receivers; *pp;) {
    receiver *gone = *pp;
    if (ferry_link_status(gone->link) == 0) {
      pp = &gone->next;
      continue;
    }
    *pp = gone->next; /* it left between pushes (its goodbye may not have come): not in this one */
    fr_info("refit '%s': receiver '%s' is gone", s->name, gone->peer);
    if (later && gone->in_stream && gone->stream_status == 0) /* it left between parts */
      fr_refit_stream_note(s, gone, FERRY_EPEER);
    fr_refit_receiver_free(gone);
  }
  for (receiver *r = s->receivers; r; r = r->next) {
    /* one catching up stays out, like one not yet attached: the push would wait for its reads;
     * a later part of a version goes to those its first part took that failed none since */
    if (later) {
      r->in_push = r->in_stream && r->stream_status == 0 && !r->dropped;
    } else {
      r->in_push = !fr_refit_catchup_overtaken(s, r, p->had) && !r->dropped;
      r->in_stream = r->in_push;
      r->stream_status = 0;
    }
    if (!r->in_push)
      continue; /* catching up, or it stalled in an earlier push and has not attached again */
    r->orphan = r->commit_sent = r->commit_seen = false;
    r->up = r->down = NULL;
    r->announced = r->acked = 0;
    r->status = 0;
    r->blame = 0;
    r->progress_ns = fr_now_ns();
    fr_refit_view_refresh(s, r);
    *all_current &= r->committed == s->latest && s->latest != 0;
    n++;
  }
  build_chain(s, p, route);
  p->share_pack = s->alias;
  if (!p->share_pack) {
    p->share_pack = true;
    for (receiver *r = s->receivers; r; r = r->next)
      p->share_pack &= !r->in_push || !r->shm;
  }
  pthread_mutex_unlock(&s->lock);
  *in_push = n;
  return 0;
}

static void commit_all(ferry_refit_sender *s, fr_push *p) {
  fr_refit_msg_t c = {.type = FR_REFIT_COMMIT,
                      .version = p->version,
                      .bytes = p->part ? p->commit_n : p->n,
                      .generation = s->plan.generation};
  pthread_mutex_lock(&s->lock);
  for (receiver *r = s->receivers; r; r = r->next)
    if (r->in_push && r->status == 0) {
      r->progress_ns = fr_now_ns();
      r->commit_sent = true;
      queue(p, r, &c);
    }
  pthread_mutex_unlock(&s->lock);
  send_queued(s, p);
  uint64_t t0 = fr_now_ns(); /* their COMMITTED answers */
  pthread_mutex_lock(&s->lock);
  for (;;) {
    bool all = true;
    mark_failures(s, p);
    for (receiver *r = s->receivers; r; r = r->next)
      all &= !r->in_push || r->status != 0 || r->commit_seen;
    if (all)
      break;
    wait_progress(s, p);
  }
  pthread_mutex_unlock(&s->lock);
  fr_refit_phase(s, FR_REFIT_PHASE_COMMIT, t0);
}

/* Tells a receiver that timed out that it is out of the push set until it attaches again (queued
 * in out; the frame goes once the lock is released). Sent with a short timeout: it stalls, and
 * the push's caller waits for that send. */
#define DROPPED_SEND_MS 100
static void drop(receiver *r, uint64_t version, fr_refit_outbox *out) {
  r->dropped = true;
  fr_refit_msg_t m = {.type = FR_REFIT_DROPPED, .version = version};
  fr_refit_out_add(out, r->link, &m, DROPPED_SEND_MS, false); /* no memory: it is not told */
}

/* What a push came to, for its log line. */
typedef struct push_tally {
  bool ran;           /* it got past its checks (sealed, a newer version) */
  uint32_t receivers; /* in the push */
  uint32_t committed; /* of those, how many committed */
  uint64_t bytes;     /* of the buckets it sent */
} push_tally;

/* Why a receiver did not commit, in an operator's words. */
static const char *failure_reason(int status) {
  switch (status) {
  case FERRY_ETIMEDOUT:
    return "stalled: it acknowledged nothing within the push's timeout; dropped from pushes until "
           "it attaches again";
  case FERRY_ECHECKSUM:
    return "a bucket it read did not match its checksum; its bytes of this version are torn";
  case FERRY_EPEER:
  case FERRY_ECLOSED:
    return "disconnected";
  case FERRY_ESTALE:
    return "another rank of its sender group failed this version";
  default:
    return NULL;
  }
}

static void log_receiver_outcome(const ferry_refit_sender *s, const receiver *r, uint64_t version,
                                 int status) {
  if (status == 0) {
    fr_debug("refit '%s': receiver '%s' committed version %llu (over %s, from %s)", s->name,
             r->peer, (unsigned long long)version, r->shm ? "shm" : ferry_link_transport(r->link),
             r->up ? "its chain predecessor" : "the sender");
    return;
  }
  const char *why = failure_reason(status);
  fr_warn("refit '%s': receiver '%s' did not commit version %llu: %s%s%s%s", s->name, r->peer,
          (unsigned long long)version, why ? why : ferry_strerror(status), why ? " (" : "",
          why ? ferry_status_name(status) : "", why ? ")" : "");
}

/* Sends what a part's end queued (DROPPED notices) and applies what did not go. */
static void send_notices(ferry_refit_sender *s, fr_refit_outbox *out) {
  if (out->n) {
    fr_refit_out_send(out);
    pthread_mutex_lock(&s->lock);
    fr_refit_out_settle(s, out);
    pthread_mutex_unlock(&s->lock);
  }
  fr_refit_out_free(out);
}

/* Records the push's outcome; names the receivers of this push that did not commit, frees dead
 * ones and drops those that timed out (later pushes leave them out until they attach again). */
static int finish_push(ferry_refit_sender *s, uint64_t version, bool packed_all, push_tally *t) {
  char failed[512]; /* a version sent in parts: those that failed an earlier part first */
  size_t used = (size_t)snprintf(failed, sizeof failed, "%s", s->stream.failed);
  int first = s->stream.first;
  fr_refit_outbox out = {0};
  pthread_mutex_lock(&s->lock);
  s->latest = version;
  s->retained = s->whole && packed_all ? version : 0;
  s->pushing = 0;
  for (receiver **pp = &s->receivers; *pp;) {
    receiver *r = *pp;
    bool was_in = r->in_push;
    r->in_push = false;
    t->receivers += was_in;
    if (was_in && r->status == 0 && r->commit_seen) {
      r->committed = r->lacks == version ? 0 : version; /* lacks: asked for it since (catchup.c) */
      t->committed++;
      log_receiver_outcome(s, r, version, 0);
    } else if (was_in) {
      int st = r->status ? r->status : FERRY_EPROTO;
      r->failures++;
      log_receiver_outcome(s, r, version, st);
      if (!first)
        first = st;
      char blamed[80] = "";
      if (st == FERRY_ESTALE && r->blame) /* a peer's number: printed, never used */
        snprintf(blamed, sizeof blamed, ": rank %u of its sender group failed it", r->blame - 1);
      used += (size_t)snprintf(failed + used, sizeof failed - used, "%s'%s' (%s%s%s)",
                               used ? ", " : "", r->peer, ferry_strerror(st), blamed,
                               st == FERRY_ETIMEDOUT ? ", dropped" : "");
      if (used >= sizeof failed)
        used = sizeof failed - 1; /* the list is cut; the first failures are named */
    }
    if (ferry_link_status(r->link) != 0 || r->detached) {
      *pp = r->next;
      fr_refit_receiver_free(r);
      continue;
    }
    if (was_in && r->status == FERRY_ETIMEDOUT)
      drop(r, version, &out);
    pp = &r->next;
  }
  pthread_mutex_unlock(&s->lock);
  /* receivers that attached (told this version as the latest), bound a destination or otherwise
   * asked during the push: the service thread serves them, since it
   * sends the rest of each catch-up as acknowledgements come (one thread, so in order) */
  fr_job_wake(s->service, FR_REFIT_WAKE_CATCHUPS);
  send_notices(s, &out);
  if (!first)
    return 0;
  return fr_err(first,
                "refit '%s' version %llu: not committed by %s; every other receiver "
                "committed",
                s->name, (unsigned long long)version, failed);
}

/* The end of a part that is not the last (stream.c): a receiver that failed it is out of the
 * version's later parts (the last part's error names it), one that timed out is dropped, a dead
 * or departed one freed. The push stays under way (s->pushing): receivers that attach meanwhile
 * catch up once the version ends. */
static void finish_part(ferry_refit_sender *s, uint64_t version) {
  fr_refit_outbox out = {0};
  pthread_mutex_lock(&s->lock);
  for (receiver **pp = &s->receivers; *pp;) {
    receiver *r = *pp;
    bool was_in = r->in_push;
    r->in_push = false;
    if (was_in && r->status != 0) {
      r->failures++;
      log_receiver_outcome(s, r, version, r->status);
      fr_refit_stream_note(s, r, r->status);
      if (r->status == FERRY_ETIMEDOUT)
        drop(r, version, &out);
    }
    if (ferry_link_status(r->link) != 0 || r->detached) {
      if (r->in_stream && r->stream_status == 0)
        fr_refit_stream_note(s, r, FERRY_EPEER);
      *pp = r->next;
      fr_refit_receiver_free(r);
      continue;
    }
    pp = &r->next;
  }
  pthread_mutex_unlock(&s->lock);
  send_notices(s, &out);
}

/* Abandons the version open in parts (0 when none is; the given marks are cleared either way):
 * its receivers are told with a COMMIT
 * flagged ABORTED (they fail it, FERRY_ECLOSED) and not awaited. Their bytes may hold some of
 * it, so none counts as holding any version (a skip_unchanged push sends them every bucket). */
static int abandon(ferry_refit_sender *s, push_tally *t) {
  uint64_t v = s->stream.version;
  if (!v) {
    fr_refit_stream_close(s); /* what was given goes: a later version gives its own */
    return 0;
  }
  fr_refit_msg_t c = {.type = FR_REFIT_COMMIT,
                      .version = v,
                      .flags = FR_REFIT_ABORTED,
                      .generation = s->plan.generation};
  fr_refit_outbox out = {0};
  pthread_mutex_lock(&s->lock);
  for (receiver *r = s->receivers; r; r = r->next) {
    r->in_push = false;
    if (r->in_stream && r->stream_status == 0 && ferry_link_status(r->link) == 0)
      fr_refit_out_add(&out, r->link, &c, DROPPED_SEND_MS, false); /* no memory: not told */
    if (r->in_stream)
      r->committed = 0;
    r->in_stream = false;
  }
  s->pushing = 0;
  s->retained = 0; /* parts of it are in the buffer */
  pthread_mutex_unlock(&s->lock);
  fr_refit_out_send(&out);
  fr_refit_out_free(&out);
  t->ran = true;
  t->bytes = s->stream.bytes;
  fr_warn("refit '%s': version %llu abandoned after %u of %u buckets; no receiver commits it",
          s->name, (unsigned long long)v, s->stream.nsent, s->plan.buckets);
  fr_refit_stream_close(s);
  fr_job_wake(s->service, FR_REFIT_WAKE_CATCHUPS);
  return 0;
}

/* The receivers of the push that read shards, each with room for its view's sums. */
static int plan_views(ferry_refit_sender *s, fr_push *p, uint32_t nb) {
  pthread_mutex_lock(&s->lock);
  size_t n = 0;
  for (receiver *r = s->receivers; r; r = r->next)
    n += r->in_push && r->view;
  p->viewers = n ? calloc(n, sizeof *p->viewers) : NULL;
  p->feeds = n ? calloc(n, sizeof *p->feeds) : NULL;
  int rc = n && (!p->viewers || !p->feeds)
               ? fr_err(FERRY_ENOMEM, "refit '%s': shard views", s->name)
               : 0;
  for (receiver *r = s->receivers; r && rc == 0; r = r->next) {
    if (!r->in_push || !r->view)
      continue;
    free(r->vsum);
    if (!(r->vsum = calloc(nb, sizeof *r->vsum)))
      rc = fr_err(FERRY_ENOMEM, "refit '%s': shard sums", s->name);
    else
      p->viewers[p->nviewers++] = r;
  }
  pthread_mutex_unlock(&s->lock);
  return rc;
}

static void end_views(ferry_refit_sender *s, fr_push *p) {
  pthread_mutex_lock(&s->lock);
  for (size_t i = 0; i < p->nviewers; i++) {
    free(p->viewers[i]->vsum);
    p->viewers[i]->vsum = NULL;
  }
  pthread_mutex_unlock(&s->lock);
  free(p->viewers);
  free(p->feeds);
}

/* Whether this push's buckets go unhashed (FR_REFIT_DIRECT): buffers in device memory, every
 * receiver in the push on this host viewing (alias) or reading whole buckets from the sender (no
 * chain, no shard targets: they verify), and no alias skip_unchanged (it compares checksums). */
static bool direct_push(ferry_refit_sender *s, bool skip) {
  if (s->dev_buf < 0 || (s->alias && skip))
    return false;
  bool direct = true;
  pthread_mutex_lock(&s->lock);
  for (receiver *r = s->receivers; r && direct; r = r->next)
    if (r->in_push)
      direct = r->shm && !r->up && !r->down && !r->view && !r->ntargets; /* no shards either */
  pthread_mutex_unlock(&s->lock);
  return direct;
}

static int plan_push(ferry_refit_sender *s, fr_push *p, const ferry_refit_push_opts *o,
                     bool all_current) {
  uint32_t nb = s->plan.buckets ? s->plan.buckets : 1;
  int rc = plan_views(s, p, nb);
  if (rc != 0)
    return rc;
  p->order = malloc(nb * sizeof *p->order);
  p->sum = calloc(nb, sizeof *p->sum);
  p->unchanged = calloc(nb, sizeof *p->unchanged);
  if (!p->order || !p->sum || !p->unchanged)
    return fr_err(FERRY_ENOMEM, "refit '%s': push of %u buckets", s->name, nb);
  p->skip = FR_OPT(o, skip_unchanged, 0) && all_current;
  p->hash = !direct_push(s, p->skip);
  p->no_overlap = fr_config_int("FERRY_REFIT_NO_OVERLAP") != 0;
  if (p->part) /* a part: the buckets ready and not sent yet */
    return fr_refit_stream_select(s, p->part == FERRY_REFIT_PART_LAST, p->order, &p->n);
  for (uint32_t b = 0; b < s->plan.buckets; b++)
    if (!all_current || bucket_selected(s, o, b))
      p->order[p->n++] = b;
  return 0;
}

/* The bytes of the buckets a push sends (those not skipped as unchanged). */
static uint64_t push_bytes(const ferry_refit_sender *s, const fr_push *p) {
  uint64_t bytes = 0;
  for (uint32_t j = 0; j < p->n; j++) {
    if (p->unchanged && p->unchanged[j])
      continue;
    uint64_t off = (uint64_t)p->order[j] * s->plan.bucket_bytes;
    uint64_t left = s->plan.total_bytes > off ? s->plan.total_bytes - off : 0;
    bytes += left < s->plan.bucket_bytes ? left : s->plan.bucket_bytes;
  }
  return bytes;
}

static int push_version(ferry_refit_sender *s, uint64_t version, const ferry_refit_push_opts *o,
                        push_tally *t);

/* One line per push at info (warn when a receiver did not commit): the version, the bytes, the
 * time and who committed it. Per-receiver detail is at debug, failures each at warn. */
static void log_push(const ferry_refit_sender *s, uint64_t version, const push_tally *t,
                     uint64_t ns, int rc) {
  double sec = (double)ns * 1e-9;
  double mbps = sec > 0 ? (double)t->bytes / sec / 1e6 : 0;
  if (rc == 0)
    fr_info("refit '%s': pushed version %llu: %llu bytes in %.3f s (%.1f MB/s), committed by %u "
            "receiver%s",
            s->name, (unsigned long long)version, (unsigned long long)t->bytes, sec, mbps,
            t->committed, t->committed == 1 ? "" : "s");
  else
    fr_warn("refit '%s': pushed version %llu: %llu bytes in %.3f s, committed by %u of %u "
            "receivers",
            s->name, (unsigned long long)version, (unsigned long long)t->bytes, sec, t->committed,
            t->receivers);
}

int ferry_refit_push(ferry_refit_sender *s, uint64_t version, const ferry_refit_push_opts *o) {
  if (!s)
    return fr_err(FERRY_EINVAL, "ferry_refit_push: NULL sender");
  int rc = FR_OPTS_CHECK(o, "ferry_refit_push");
  if (rc != 0)
    return rc;
  int part = FR_OPT(o, part, FERRY_REFIT_PART_NONE);
  uint64_t t0 = fr_now_ns();
  push_tally t = {0};
  rc = push_version(s, version, o, &t);
  if (part == FERRY_REFIT_PART_MORE && rc == 0) { /* the version's last part counts it */
    fr_debug("refit '%s': version %llu: a part of %llu bytes in %.3f s", s->name,
             (unsigned long long)version, (unsigned long long)t.bytes,
             (double)(fr_now_ns() - t0) * 1e-9);
    return 0;
  }
  if (part == FERRY_REFIT_PART_ABORT && !t.ran)
    return rc;                                /* none was open: no push */
  if (part != FERRY_REFIT_PART_NONE && t.ran) /* the version in parts began with its first */
    t0 = s->stream.t0 && s->stream.t0 < t0 ? s->stream.t0 : t0;
  fr_refit_count_push(s, part == FERRY_REFIT_PART_ABORT ? FERRY_ECLOSED : rc, t.bytes, t0);
  if (t.ran && part != FERRY_REFIT_PART_ABORT) /* not refused before it began: the caller has it */
    log_push(s, version, &t, fr_now_ns() - t0, rc);
  return rc;
}

/* The end of a push that failed before its receivers committed (s->lock not held): none is in a
 * push any more; a version open in parts is abandoned, the error kept. */
static int push_failed(ferry_refit_sender *s, int rc, push_tally *t) {
  pthread_mutex_lock(&s->lock);
  s->pushing = 0;
  for (receiver *r = s->receivers; r; r = r->next)
    r->in_push = false;
  pthread_mutex_unlock(&s->lock);
  if (!s->stream.version)
    return rc;
  fr_err_keep keep;
  fr_err_save(&keep, rc);
  abandon(s, t);
  return fr_err_restore(&keep);
}

static int packing_failed(ferry_refit_sender *s, const fr_push *p) {
  return fr_err(p->pack_rc, "refit '%s' version %llu: no receiver committed it: %s", s->name,
                (unsigned long long)p->version, p->pack_why);
}

static int check_version(ferry_refit_sender *s, uint64_t version) {
  uint64_t last = s->latest > s->stream.spent ? s->latest : s->stream.spent;
  if (version > last)
    return 0;
  return fr_err(FERRY_EINVAL, "refit '%s': version %llu is not after %llu%s", s->name,
                (unsigned long long)version, (unsigned long long)last,
                last > s->latest ? " (a version begun in parts spends its number)" : "");
}

static int push_version(ferry_refit_sender *s, uint64_t version, const ferry_refit_push_opts *o,
                        push_tally *t) {
  int part = FR_OPT(o, part, FERRY_REFIT_PART_NONE);
  int rc = fr_refit_stream_check(s, version, o, part);
  if (rc == 0 && part == FERRY_REFIT_PART_ABORT)
    return abandon(s, t);
  if (rc == 0 && !s->sealed)
    rc = fr_refit_unsealed(s);
  bool later = s->stream.version != 0; /* a later part of the version open in parts */
  if (rc == 0 && !later)
    rc = check_version(s, version);
  if (rc == 0 && part && !later)
    rc = fr_refit_stream_open(s, version);
  if (rc != 0)
    return rc;
  fr_push p = {.version = version,
               .timeout_ms = fr_timeout(FR_OPT(o, timeout_ms, -1)),
               .part = part,
               .commit_n = s->plan.buckets};
  bool all_current;
  t->ran = true;
  size_t in_push = 0;
  rc = begin_push(s, &p, FR_OPT(o, route, FERRY_REFIT_ROUTE_AUTO), &all_current, later, &in_push);
  if (rc != 0)
    return push_failed(s, rc, t);
  send_queued(s, &p); /* the chain's routes */
  fr_refit_out_free(&p.out);
  if (in_push == 0 && !s->whole && !part) {
    fr_refit_stream_close(s);
    return finish_push(s, version, false, t);
  }
  if (s->whole && (p.had != s->latest || s->latest == 0))
    all_current = false; /* the buffer lacks buckets a partial push would not pack: pack all */
  if (later)
    all_current = s->stream.all_current;
  s->stream.all_current = all_current;
  rc = plan_push(s, &p, o, all_current);
  if (rc == 0) {
    pump(s, &p);
    if (start_repair(s, &p))
      pump(s, &p);
    if (part != FERRY_REFIT_PART_MORE)
      commit_all(s, &p);
    if (s->whole)
      pack_rest(s, &p);
    t->bytes = push_bytes(s, &p);
    if (part)
      fr_refit_stream_sent(s, p.order, p.n);
  }
  free(p.order);
  free(p.sum);
  free(p.unchanged);
  fr_refit_out_free(&p.out);
  end_views(s, &p);
  if (rc != 0 || (part && p.pack_rc != 0))
    return push_failed(s, rc ? rc : packing_failed(s, &p), t);
  if (part == FERRY_REFIT_PART_MORE) {
    s->stream.bytes += t->bytes;
    finish_part(s, version);
    return 0;
  }
  if (part == FERRY_REFIT_PART_LAST)
    t->bytes += s->stream.bytes;
  rc = finish_push(s, version, s->whole && p.pack_rc == 0, t);
  fr_refit_stream_close(s);
  return p.pack_rc ? packing_failed(s, &p) : rc; /* what failed is the sender's */
}
