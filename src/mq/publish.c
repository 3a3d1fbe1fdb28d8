/*
 * Publishing: credit, the frames, and the shared-memory pool for large payloads.
 *
 * Credit: each subscriber grants each publisher `window` bytes (FERRY_MQ_QUEUE_BYTES on the
 * subscriber). A message is charged its length plus a little (capped at half the window, so any
 * one message fits once the subscriber has freed what it held); the subscriber returns credit as
 * the application frees messages. A publish first waits until every subscriber of the topic has
 * credit for it (taking credit off the channel meanwhile), so it either reaches all of them or,
 * at the deadline, none, naming the subscriber whose queue stayed full. Nothing is dropped.
 *
 * The pool: payloads over FERRY_MQ_INLINE_BYTES to subscribers on shm links are copied once into
 * one ferry_alloc'd region (mapped once by each subscriber) and the frame carries its place; the
 * subscriber hands the application a pointer into the pool and releases the block (with its
 * credit) when the message is freed. A block is reused once every subscriber released it or was
 * dropped. When the pool has no room the payload goes inline instead (never a wait).
 *
 * Loans: ferry_mq_loan lends the application a pool block to build a message in (waiting for
 * room); ferry_mq_publish_loan then sends it with no copy at all (the block's holders are the
 * loan, dropped after the sends, and each shm subscriber).
 *
 * Batches: a publish that follows the previous one closely (a stream) appends small inline
 * messages to a per-subscriber batch instead of writing each one to the link; the batch goes out
 * when it is full, before anything else is sent to that subscriber, before this node waits for
 * anything (credit, a message, subscribers), and otherwise within FLUSH_NS, sent by the
 * background thread. So a stream of small messages costs one link write per 32 KiB, while an
 * isolated publish (or a ping-pong) is written at once. A publish in a stream that goes to the
 * subscribers the previous one went to, each with a pending batch and credit, takes no mq->lock
 * at all (fast_reserve): the batches hold those subscribers, and publish_lock the batches.
 */
#include "mq/mq.h"
#include "core/channels.h"
#include "transport/transport.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define POOL_ALIGN 4096u
#define CHARGE_OVERHEAD 128u
#define STREAM_GAP_NS 20000u /* publishes closer than this are a stream: batch them */

/* ---- the pool: first-fit over sorted free extents ---- */

static int pool_open(ferry_mq *mq) {
  void *mem = NULL;
  if (mq->pool_bytes < POOL_ALIGN)
    return FERRY_ENOSHM;
  mq->pool_bytes = mq->pool_bytes / POOL_ALIGN * POOL_ALIGN;
  int rc = ferry_alloc(mq->ctx, mq->pool_bytes, &mem);
  if (rc == 0)
    rc = ferry_region_find(mq->ctx, mem, mq->pool_bytes, &mq->pool_ref, NULL);
  mq->free_off = malloc(16 * sizeof(uint64_t));
  mq->free_len = malloc(16 * sizeof(uint64_t));
  if (rc == 0 && (!mq->free_off || !mq->free_len))
    rc = FERRY_ENOMEM;
  if (rc != 0) {
    fr_warn("mq '%s': no pool (%s); large payloads go inline", mq->name, ferry_last_error());
    if (mem)
      ferry_free(mq->ctx, mem);
    mq->pool_bytes = 0;
    return rc;
  }
  mq->pool = mem;
  mq->capfree = 16;
  mq->free_off[0] = 0;
  mq->free_len[0] = mq->pool_bytes;
  mq->nfree = 1;
  return 0;
}

/* First fit among the free extents, ending at most at `limit`. */
static bool extent_alloc(ferry_mq *mq, uint64_t len, uint64_t limit, uint64_t *off) {
  for (size_t i = 0; i < mq->nfree && mq->free_off[i] + len <= limit; i++)
    if (mq->free_len[i] >= len) {
      *off = mq->free_off[i];
      mq->free_off[i] += len;
      mq->free_len[i] -= len;
      if (mq->free_len[i] == 0) {
        memmove(mq->free_off + i, mq->free_off + i + 1, (mq->nfree - i - 1) * sizeof(uint64_t));
        memmove(mq->free_len + i, mq->free_len + i + 1, (mq->nfree - i - 1) * sizeof(uint64_t));
        mq->nfree--;
      }
      return true;
    }
  return false;
}

static void extent_free(ferry_mq *mq, uint64_t off, uint64_t len) {
  size_t i = 0;
  while (i < mq->nfree && mq->free_off[i] < off)
    i++;
  bool left = i > 0 && mq->free_off[i - 1] + mq->free_len[i - 1] == off;
  bool right = i < mq->nfree && off + len == mq->free_off[i];
  if (left && right) {
    mq->free_len[i - 1] += len + mq->free_len[i];
    memmove(mq->free_off + i, mq->free_off + i + 1, (mq->nfree - i - 1) * sizeof(uint64_t));
    memmove(mq->free_len + i, mq->free_len + i + 1, (mq->nfree - i - 1) * sizeof(uint64_t));
    mq->nfree--;
  } else if (left) {
    mq->free_len[i - 1] += len;
  } else if (right) {
    mq->free_off[i] = off;
    mq->free_len[i] += len;
  } else {
    if (mq->nfree == mq->capfree) {
      size_t cap = mq->capfree * 2;
      uint64_t *o = realloc(mq->free_off, cap * sizeof *o);
      if (o)
        mq->free_off = o;
      uint64_t *l = o ? realloc(mq->free_len, cap * sizeof *l) : NULL;
      if (!l) {
        fr_warn_limited("mq '%s': out of memory: %llu pool bytes lost", mq->name,
                        (unsigned long long)len);
        return;
      }
      mq->free_len = l;
      mq->capfree = cap;
    }
    memmove(mq->free_off + i + 1, mq->free_off + i, (mq->nfree - i) * sizeof(uint64_t));
    memmove(mq->free_len + i + 1, mq->free_len + i, (mq->nfree - i) * sizeof(uint64_t));
    mq->free_off[i] = off;
    mq->free_len[i] = len;
    mq->nfree++;
  }
}

/* A block of len bytes with `refs` holders: its token (slot + 1 and a generation), or 0. Below
 * the high-water mark only, unless `grow`. */
static uint64_t block_alloc(ferry_mq *mq, uint64_t len, int refs, bool grow, uint64_t *off) {
  if (!mq->pool && (mq->pool_bytes == 0 || pool_open(mq) != 0))
    return 0;
  uint64_t want = (len + POOL_ALIGN - 1) / POOL_ALIGN * POOL_ALIGN;
  size_t slot = 0;
  while (slot < mq->nblocks && mq->blocks[slot].refs > 0)
    slot++;
  if (slot == mq->nblocks && mq->nblocks == mq->capblocks) {
    size_t cap = mq->capblocks ? mq->capblocks * 2 : 64;
    fr_mq_block *v = realloc(mq->blocks, cap * sizeof *v);
    if (!v)
      return 0;
    mq->blocks = v;
    mq->capblocks = cap;
  }
  if (!extent_alloc(mq, want, grow ? mq->pool_bytes : mq->pool_hwm, off))
    return 0;
  if (*off + want > mq->pool_hwm)
    mq->pool_hwm = *off + want;
  if (slot == mq->nblocks)
    mq->blocks[mq->nblocks++] = (fr_mq_block){0};
  fr_mq_block *b = &mq->blocks[slot];
  b->off = *off;
  b->len = want;
  b->refs = refs;
  b->lent = false;
  b->gen++;
  return (uint64_t)b->gen << 32 | (uint64_t)(slot + 1);
}

void fr_mq_pool_release(ferry_mq *mq, uint64_t token) {
  size_t slot = (size_t)(token & 0xffffffffu);
  if (slot == 0 || slot > mq->nblocks)
    return;
  fr_mq_block *b = &mq->blocks[slot - 1];
  if (b->refs <= 0 || b->gen != (uint32_t)(token >> 32))
    return;
  if (--b->refs == 0)
    extent_free(mq, b->off, b->len);
}

void fr_mq_pool_fini(ferry_mq *mq) {
  if (mq->pool)
    ferry_free(mq->ctx, mq->pool);
  mq->pool = NULL;
  free(mq->blocks);
  free(mq->free_off);
  free(mq->free_len);
  free(mq->dirty);
}

static int peer_hold(fr_mq_peer *p, uint64_t token) {
  if (p->ntokens == p->captokens) {
    size_t cap = p->captokens ? p->captokens * 2 : 16;
    uint64_t *v = realloc(p->tokens, cap * sizeof *v);
    if (!v)
      return -1;
    p->tokens = v;
    p->captokens = cap;
  }
  p->tokens[p->ntokens++] = token;
  return 0;
}

/* ---- batches ---- */

static void flush_peer(ferry_mq *mq, fr_mq_peer *p) {
  if (!p->batch_len)
    return;
  fr_mq_frame f = {.type = FR_MQ_BATCH, .len = p->batch_len};
  uint8_t head[FR_MQ_HEAD_MAX];
  struct iovec iov[2] = {{head, fr_mq_encode(&f, head)}, {p->batch, p->batch_len}};
  int rc = ferry_send(p->link, FR_CHANNEL_MQ, iov, 2, fr_timeout(-1));
  if (rc != 0 && !p->batch_rc)
    p->batch_rc = rc;
  p->batch_len = 0;
}

void fr_mq_flush_locked(ferry_mq *mq) {
  for (size_t i = 0; i < mq->ndirty; i++) {
    flush_peer(mq, mq->dirty[i]);
    mq->dirty[i]->dirty = false;
  }
  if (mq->ndirty) {
    pthread_mutex_lock(&mq->lock);
    for (size_t i = 0; i < mq->ndirty; i++)
      fr_mq_peer_unref(mq, mq->dirty[i]);
    pthread_mutex_unlock(&mq->lock);
  }
  mq->ndirty = 0;
  __atomic_store_n(&mq->batch_since_ns, 0, __ATOMIC_RELEASE);
}

/* Flushes the pending batches unless a publish is running (it flushes before it waits, the
 * background thread after); `end_stream` also makes the next publish an isolated one. */
static void flush_unless_publishing(ferry_mq *mq, bool end_stream) {
  bool stream = end_stream && __atomic_load_n(&mq->last_publish_ns, __ATOMIC_RELAXED);
  if (!stream && !__atomic_load_n(&mq->batch_since_ns, __ATOMIC_ACQUIRE))
    return; /* nothing to do: a subscriber that never publishes takes no lock per receive */
  if (pthread_mutex_trylock(&mq->publish_lock) != 0)
    return;
  if (end_stream)
    __atomic_store_n(&mq->last_publish_ns, 0, __ATOMIC_RELAXED);
  if (__atomic_load_n(&mq->batch_since_ns, __ATOMIC_ACQUIRE))
    fr_mq_flush_locked(mq);
  pthread_mutex_unlock(&mq->publish_lock);
}

void fr_mq_flush(ferry_mq *mq) { flush_unless_publishing(mq, false); }

/* A receive ends a stream: the next publish is an answer (a ping-pong, a relay), written at
 * once. Batching it would only cost a batch of one, flushed by the next receive, and a wake-up
 * of the background thread per message (which starts every batch's FLUSH_NS clock). */
void fr_mq_stream_end(ferry_mq *mq) { flush_unless_publishing(mq, true); }

/* Appends a frame, published at `now`, to p's batch (publish_lock held); false when it does
 * not fit at all. */
static bool batch_add(ferry_mq *mq, fr_mq_peer *p, const uint8_t *head, size_t hl, const void *data,
                      size_t len, uint64_t now) {
  size_t at = (p->batch_len + FR_MQ_ALIGN - 1) / FR_MQ_ALIGN * FR_MQ_ALIGN;
  if (at + hl + len > FR_MQ_BATCH_BYTES - FR_MQ_ALIGN) {
    flush_peer(mq, p);
    at = 0;
  }
  if (at == 0)
    p->batch_ns = now; /* its oldest message: the background thread sends it FLUSH_NS after */
  if (!p->batch && !(p->batch = malloc(FR_MQ_BATCH_BYTES)))
    return false;
  if (!p->dirty && mq->ndirty == mq->capdirty) {
    size_t cap = mq->capdirty ? mq->capdirty * 2 : 8;
    fr_mq_peer **v = realloc(mq->dirty, cap * sizeof *v);
    if (!v)
      return false;
    mq->dirty = v;
    mq->capdirty = cap;
  }
  if (!p->dirty) {
    pthread_mutex_lock(&mq->lock);
    p->refs++;
    pthread_mutex_unlock(&mq->lock);
    mq->dirty[mq->ndirty++] = p;
    p->dirty = true;
  }
  memset(p->batch + p->batch_len, 0, at - p->batch_len);
  memcpy(p->batch + at, head, hl);
  if (len)
    memcpy(p->batch + at + hl, data, len);
  p->batch_len = at + hl + len;
  return true;
}

/* ---- credit ---- */

typedef struct target {
  fr_mq_peer *p;
  uint64_t charge;
  bool shm;
  bool ref; /* this publish holds a reference (else the peer's pending batch does) */
  int rc;
} target;

static uint64_t charge_for(const fr_mq_peer *p, uint64_t len) {
  uint64_t c = len + CHARGE_OVERHEAD;
  return c > p->window / 2 ? p->window / 2 : c;
}

static bool alive(const fr_mq_peer *p) { return !p->dead && ferry_link_status(p->link) == 0; }

static bool has_credit(const fr_mq_peer *p, uint64_t len) {
  return p->sent - p->acked + charge_for(p, len) <= p->window;
}

typedef struct pub_wait {
  fr_mq_topic *t;
  uint64_t len;
} pub_wait;

static bool credit_ready(ferry_mq *mq, void *arg) {
  pub_wait *w = arg;
  for (size_t i = 0; i < w->t->nsubs; i++)
    if (alive(w->t->subs[i]) && !has_credit(w->t->subs[i], w->len))
      return false;
  return true;
}

static int full_error(ferry_mq *mq, fr_mq_topic *t, uint64_t len, int rc, int ms) {
  if (rc == FERRY_ECLOSED)
    return fr_err(rc, "publish '%s': mq closing", t->name);
  for (size_t i = 0; i < t->nsubs; i++) {
    fr_mq_peer *p = t->subs[i];
    if (alive(p) && !has_credit(p, len))
      return fr_err(FERRY_ETIMEDOUT,
                    "publish '%s': subscriber '%s' did not take the message within %d ms (its "
                    "queue holds %llu of %llu bytes)",
                    t->name, p->name, ms, (unsigned long long)(p->sent - p->acked),
                    (unsigned long long)p->window);
  }
  return fr_err(FERRY_ETIMEDOUT, "publish '%s': timed out", t->name);
}

/* Who holds a publish back: the first live subscriber without room for it, copied while the lock
 * is held (the peer may go while the publish waits). Only copied: the line is formatted only
 * when the wait turns out long. */
typedef struct holder {
  char name[FR_DIR_NAME_MAX + 1]; /* "" when none was found */
  uint64_t queued, window;
} holder;

static void find_holder(const fr_mq_topic *t, uint64_t len, holder *h) {
  h->name[0] = '\0';
  h->queued = h->window = 0;
  for (size_t i = 0; i < t->nsubs; i++) {
    const fr_mq_peer *p = t->subs[i];
    if (alive(p) && !has_credit(p, len)) {
      memcpy(h->name, p->name, sizeof h->name);
      h->queued = p->sent - p->acked;
      h->window = p->window;
      return;
    }
  }
}

/* A subscriber that held a publish back longer than FERRY_MQ_STALL_LOG_MS: who, how long, on
 * which topic. Rate-limited: a stalled subscriber holds back every publish to it. */
static void log_stall(const ferry_mq *mq, const fr_mq_topic *t, const holder *h, uint64_t ns,
                      int rc) {
  fr_warn_limited("mq '%s': a publish on '%s' waited %.3f s for subscriber '%s' to take messages "
                  "(its queue held %llu of %llu bytes)%s",
                  mq->name, t->name, (double)ns * 1e-9, h->name[0] ? h->name : "?",
                  (unsigned long long)h->queued, (unsigned long long)h->window,
                  rc == FERRY_ETIMEDOUT ? "; the publish timed out" : "");
}

/* Waits for credit and takes it: *out lists the subscribers, each held for the sends. A peer
 * with a pending batch is held by mq->dirty until a flush, and flushes need publish_lock, which
 * the publish holds: it takes no reference of its own on those, so a publish in a stream needs
 * no lock round after its sends (see settle_quiet). */
#define LOCAL_TARGETS 8 /* subscribers a publish lists without an allocation */

static int reserve(ferry_mq *mq, fr_mq_topic *t, uint64_t len, uint64_t deadline, int ms,
                   bool ready, target *local, target **out, size_t *n, bool *waited) {
  pub_wait w = {t, len};
  int rc = 0;
  *waited = !ready && !credit_ready(mq, &w); /* ready: the caller just found credit */
  if (*waited) {
    uint64_t t0 = fr_now_ns();
    holder h;
    find_holder(t, len, &h);
    mq->waiters++;
    rc = fr_mq_wait(mq, credit_ready, &w, deadline);
    mq->waiters--;
    mq->credit_waits++;
    uint64_t ns = fr_now_ns() - t0;
    mq->credit_wait_ns += ns;
    if (ns >= mq->stall_log_ns && rc != FERRY_ECLOSED)
      log_stall(mq, t, &h, ns, rc);
  }
  if (rc != 0)
    return full_error(mq, t, len, rc, ms);
  target *v = t->nsubs <= LOCAL_TARGETS ? local : calloc(t->nsubs, sizeof *v);
  if (!v)
    return fr_err(FERRY_ENOMEM, "publish '%s'", t->name);
  size_t k = 0;
  for (size_t i = 0; i < t->nsubs; i++) {
    fr_mq_peer *p = t->subs[i];
    v[k] = (target){.p = p, .charge = charge_for(p, len), .ref = !p->dirty, .rc = 0};
    v[k].shm = len > mq->inline_bytes && strcmp(ferry_link_transport(p->link), "shm") == 0;
    __atomic_store_n(&p->sent, p->sent + v[k].charge, __ATOMIC_RELAXED); /* on_credit reads it */
    p->refs += v[k].ref;
    k++;
  }
  *out = v;
  *n = k;
  return 0;
}

/* Dispatches what already arrived on the channel, without waiting (lock held, as it returns),
 * unless another thread is taking messages off it. */
static void drain(ferry_mq *mq) {
  if (!mq->thread_started || !pthread_equal(pthread_self(), mq->thread))
    mq->app_pump_ns = fr_now_ns(); /* the background thread leaves the pump to this thread */
  if (mq->pumping)
    return;
  mq->pumping = true;
  pthread_mutex_unlock(&mq->lock);
  fr_ctx_poll_links(mq->ctx); /* what the shm rings hold: a receive that does not wait skips them */
  for (int i = 0; i < 256; i++) {
    ferry_msg *m = NULL;
    if (ferry_recv(mq->ctx, FR_CHANNEL_MQ, &m, 0) != 0)
      break;
    fr_mq_dispatch(mq, m);
  }
  pthread_mutex_lock(&mq->lock);
  mq->pumping = false;
  pthread_cond_broadcast(&mq->cond);
}

/* ---- sending ---- */

typedef struct frames {
  uint8_t data[FR_MQ_HEAD_MAX], shm[FR_MQ_HEAD_MAX];
  size_t data_len, shm_len;
  uint64_t token;
} frames;

static void build(ferry_mq *mq, frames *fr, const char *topic, const ferry_tensor_desc *desc,
                  uint64_t len, uint64_t seq, uint64_t off) {
  fr_mq_frame f; /* the fields encode reads, one by one: zeroing the whole frame is a rep stos */
  f.type = FR_MQ_DATA;
  f.flags = 0;
  f.seq = seq;
  f.len = len;
  f.value = 0; /* the charge, set per subscriber */
  f.topic = topic;
  f.topic_len = strlen(topic);
  f.nrelease = 0;
  if (desc) {
    f.flags = FR_MQ_F_TENSOR;
    f.desc = *desc;
  }
  fr->data_len = fr_mq_encode(&f, fr->data);
  if (fr->token) {
    f.type = FR_MQ_SHM;
    f.ref = mq->pool_ref;
    f.offset = off;
    f.token = fr->token;
    fr->shm_len = fr_mq_encode(&f, fr->shm);
  }
}

/* Sends or batches the message to every target; `now` is the publish's time, stream whether it
 * batches. */
static void send_all(ferry_mq *mq, frames *fr, target *v, size_t n, const void *data, size_t len,
                     uint64_t deadline, uint64_t now, bool stream) {
  for (size_t i = 0; i < n; i++) {
    bool shm = v[i].shm && fr->token;
    uint8_t *head = shm ? fr->shm : fr->data;
    fr_mq_set_value(head, v[i].charge);
    size_t hl = shm ? fr->shm_len : fr->data_len;
    if (!shm && stream && hl + len <= FR_MQ_BATCH_BYTES / 4 &&
        batch_add(mq, v[i].p, head, hl, data, len, now))
      continue;
    flush_peer(mq, v[i].p); /* what was batched goes first */
    struct iovec iov[2] = {{head, hl}, {(void *)data, len}};
    int ms = fr_ms_left(deadline);
    v[i].rc = ferry_send(v[i].p->link, FR_CHANNEL_MQ, iov, shm || len == 0 ? 1 : 2, ms ? ms : 1);
    if (v[i].rc != 0)
      fr_debug("mq '%s': send to '%s': %s", mq->name, v[i].p->name, ferry_last_error());
  }
}

/* After the sends (lock held): pool holds, dead subscribers; the error for the caller. */
static int settle(ferry_mq *mq, frames *fr, target *v, size_t n, const char *topic) {
  char dead[512];
  dead[0] = '\0';
  size_t used = 0, ndead = 0;
  for (size_t i = 0; i < n; i++) {
    fr_mq_peer *p = v[i].p;
    bool shm = v[i].shm && fr->token;
    if (v[i].rc == 0 && p->batch_rc) { /* an earlier batch to it failed */
      v[i].rc = p->batch_rc;
      p->batch_rc = 0;
    }
    if (shm && (v[i].rc != 0 || peer_hold(p, fr->token) != 0))
      fr_mq_pool_release(mq, fr->token);
    if (v[i].rc != 0 && !p->dead) {
      used +=
          (size_t)snprintf(dead + used, sizeof dead - used, "%s'%s'", ndead ? ", " : "", p->name);
      used = used < sizeof dead ? used : sizeof dead - 1;
      ndead++;
      fr_mq_peer_drop(mq, p, ferry_strerror(v[i].rc));
    }
    if (v[i].ref)
      fr_mq_peer_unref(mq, p);
  }
  if (ndead)
    return fr_err(FERRY_EPEER,
                  "publish '%s': subscriber%s %s gone and dropped; every other subscriber got "
                  "the message",
                  topic, ndead > 1 ? "s" : "", dead);
  return 0;
}

/* Whether settle has nothing to do (no pool block, no error to report, no reference to drop),
 * so the publish skips its lock round: the common case of a stream. publish_lock held. */
static bool settle_quiet(const frames *fr, const target *v, size_t n) {
  if (fr->token)
    return false;
  for (size_t i = 0; i < n; i++)
    if (v[i].rc || v[i].ref || v[i].p->batch_rc)
      return false;
  return true;
}

/* When the oldest message of the pending batches was published (publish_lock held; 0: none).
 * A peer listed dirty whose batch went out already counts as pending from `now`, so the
 * background thread's flush drops its reference soon. */
static uint64_t oldest_batch(const ferry_mq *mq, uint64_t now) {
  uint64_t oldest = 0;
  for (size_t i = 0; i < mq->ndirty; i++) {
    const fr_mq_peer *p = mq->dirty[i];
    uint64_t t = p->batch_len ? p->batch_ns : now;
    oldest = oldest && oldest < t ? oldest : t;
  }
  return oldest;
}

/* After the sends: tells the background thread when the pending batches are due. A batch sent
 * because it was full moves the time on, so a stream's batches go out full and the background
 * thread sends none. True when the background thread must be woken (lock held by the caller
 * then). */
static bool batch_due_moved(ferry_mq *mq, uint64_t now) {
  uint64_t oldest = oldest_batch(mq, now);
  uint64_t since = __atomic_load_n(&mq->batch_since_ns, __ATOMIC_ACQUIRE);
  if (!oldest || oldest == since)
    return false;
  if (!since)
    return true; /* the background thread may sleep for long: store and signal under the lock */
  /* It only moves later (but for the publish clock's error, well under FLUSH_NS): the
   * background thread, sleeping until the earlier time, wakes early at worst. */
  __atomic_store_n(&mq->batch_since_ns, oldest, __ATOMIC_RELEASE);
  return false;
}

/* Memory not written lately can cost far more to write than a copy into a block reused while
 * it is warm (page faults; on some VMs, the host backing the page: 5-7 ms per MiB measured on
 * the project's VM against 0.08 for a warm block). So the pool keeps a small warm working set:
 * - a stream of messages up to a sixteenth of the pool gets two blocks of its size at once
 *   (one the subscriber reads, one the publisher copies the next message into), so a copy
 *   does not wait for the previous message's release; larger ones reuse one block, where the
 *   wait is small beside the copy and a second block would cost more fresh memory;
 * - beyond that, a copy goes into a block below the pool's high-water mark, and when none is
 *   free the publisher waits for a subscriber to release one for as long as writing fresh
 *   memory of that size would take (2 ms plus the cost per byte measured on this pool's fresh
 *   copies, 1 ns until measured) before it grows the pool. */
#define WARM_WAIT_NS 2000000ull
#define WARM_BLOCKS 2
#define FRESH_PS_DEFAULT 1000u /* picoseconds per byte of fresh memory until measured */
#define FRESH_MEASURE_MIN (1u << 20)

typedef struct warm_wait {
  uint64_t len;
  int refs;
  uint64_t off, token;
} warm_wait;

static bool warm_ready(ferry_mq *mq, void *arg) {
  warm_wait *w = arg;
  if (!w->token)
    w->token = block_alloc(mq, w->len, w->refs, false, &w->off);
  return w->token != 0;
}

static bool pool_busy(const ferry_mq *mq) { /* blocks held by subscribers: releases to come */
  for (size_t i = 0; i < mq->nblocks; i++)
    if (mq->blocks[i].refs > 0)
      return true;
  return false;
}

static uint64_t fresh_wait_ns(const ferry_mq *mq, uint64_t len) {
  uint64_t ps = mq->fresh_ps_per_byte ? mq->fresh_ps_per_byte : FRESH_PS_DEFAULT;
  return WARM_WAIT_NS + len / 1000 * ps;
}

/* The pool block the payload goes out in to nshm subscribers (lock held): the loan it was
 * built in, or a new block that the caller copies it into; 0 when none (inline instead).
 * *fresh: the block reaches above the memory written so far. */
static uint64_t take_block(ferry_mq *mq, uint64_t len, int nshm, uint64_t loan, uint64_t deadline,
                           uint64_t *off, bool *fresh) {
  *fresh = false;
  if (nshm == 0)
    return 0;
  if (loan) {
    fr_mq_block *b = &mq->blocks[(loan & 0xffffffffu) - 1];
    b->refs += nshm;
    *off = b->off;
    return loan;
  }
  drain(mq); /* take the releases in: the pool stays small and warm */
  warm_wait w = {len, nshm, 0, 0};
  uint64_t want = (len + POOL_ALIGN - 1) / POOL_ALIGN * POOL_ALIGN;
  bool small = want <= mq->pool_bytes / 16 && mq->pool_hwm < WARM_BLOCKS * want;
  if (!warm_ready(mq, &w) && !small && pool_busy(mq)) {
    uint64_t until = fr_now_ns() + fresh_wait_ns(mq, len);
    fr_mq_wait(mq, warm_ready, &w, until < deadline ? until : deadline);
  }
  *off = w.off;
  if (w.token)
    return w.token;
  uint64_t hwm = mq->pool_hwm;
  uint64_t token = block_alloc(mq, len, nshm, true, off);
  *fresh = token && *off + want > hwm;
  return token;
}

typedef struct pool_copy_args {
  ferry_mq *mq;
  uint64_t off;
  const void *data;
  size_t len;
  bool fresh;
} pool_copy_args;

static void pool_copy_work(void *arg) {
  pool_copy_args *a = arg;
  uint64_t t0 = a->fresh && a->len >= FRESH_MEASURE_MIN ? fr_now_ns() : 0;
  memcpy(a->mq->pool + a->off, a->data, a->len);
  if (t0) { /* publish_lock held: the only writer */
    uint64_t ps = (fr_now_ns() - t0) * 1000 / a->len;
    ferry_mq *mq = a->mq;
    mq->fresh_ps_per_byte = mq->fresh_ps_per_byte ? (mq->fresh_ps_per_byte + ps) / 2 : ps;
  }
}

/* Copies a payload into its pool block; a copy into fresh memory is timed to learn what
 * growing the pool costs here. The copy counts as polling the shm rings: the releases that the
 * subscribers send meanwhile (of the blocks the next publishes need) then ring no doorbell and
 * wake no thread of this process; a wake-up per message, on a core the copy needs, cost a
 * large stream a third of its speed. */
static void pool_copy(ferry_mq *mq, uint64_t off, const void *data, size_t len, bool fresh) {
  pool_copy_args a = {mq, off, data, len, fresh};
  fr_ctx_work_polling(mq->ctx, pool_copy_work, &a);
}

/* ---- the publish clock ---- */

/* A publish reads the time once, to tell a stream (batched) from an isolated message. Reading
 * CLOCK_MONOTONIC cost a fifth of a 64 B stream's publish on the project's VM (28-40 ns through
 * kvm-clock); on x86-64 the TSC costs 12. So there the time is the last clock read plus the TSC
 * ticks since, at a rate measured between clock reads; the clock is read again once a
 * millisecond has passed (or the TSC went back: another core's), so an error in the rate stays
 * within a small part of that millisecond. Elsewhere it is the clock. publish_lock held. */
#define CLOCK_REBASE_NS 1000000ull
#define CLOCK_RATE_MAX_NS (1ull << 31) /* a rate is measured over less than this: no overflow */

static uint64_t publish_now(ferry_mq *mq) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  fr_mq_clock *c = &mq->clock;
  uint64_t ticks = __builtin_ia32_rdtsc() - c->tsc;
  if (c->rate && ticks < c->rebase_ticks)
    return c->ns + (ticks * c->rate >> 32);
  uint64_t ns = fr_now_ns(), tsc = __builtin_ia32_rdtsc();
  uint64_t dns = ns - c->ns;
  if (c->tsc && tsc > c->tsc && ns >= c->ns + CLOCK_REBASE_NS && dns < CLOCK_RATE_MAX_NS) {
    uint64_t rate = (dns << 32) / (tsc - c->tsc); /* ns per tick, 32.32 fixed point */
    bool plausible = rate >= (1ull << 32) / 10 && rate <= (10ull << 32); /* 0.1-10 GHz */
    c->rate = plausible ? rate : 0; /* else the clock, every time */
    c->rebase_ticks = plausible ? (CLOCK_REBASE_NS << 32) / rate : 0;
  }
  if (!c->tsc || ns >= c->ns + CLOCK_REBASE_NS || tsc < c->tsc) {
    c->tsc = tsc;
    c->ns = ns;
  }
  return ns;
#else
  return fr_now_ns();
#endif
}

/* ---- publish ---- */

typedef struct pub { /* one publish, between its two halves */
  target local[LOCAL_TARGETS], *v;
  size_t n;
  frames fr;
  uint64_t off, seq, deadline;
  bool fresh, waited; /* waited: the time read at the start is stale */
  fr_mq_topic *t;     /* for the metrics */
} pub;

/* The last publish's topic and subscribers, for a publish in a stream to reuse without taking
 * mq->lock (publish_lock). Valid while mq->subs_gen is unchanged (a subscriber added, removed
 * or dropped bumps it) and every subscriber in it has a pending batch: mq->dirty holds those,
 * and only a flush, which needs publish_lock, lets them go. */
static void fast_remember(ferry_mq *mq, fr_mq_topic *t, const pub *u, uint64_t loan) {
  fr_mq_fast *c = &mq->fast;
  c->t = NULL;
  if (loan || u->fr.token || u->n > FR_MQ_FAST_SUBS)
    return;
  for (size_t i = 0; i < u->n; i++) {
    if (!alive(u->v[i].p) || u->v[i].shm)
      return;
    c->subs[i] = u->v[i].p;
  }
  c->t = t;
  c->n = u->n;
  c->gen = mq->subs_gen; /* lock held: no bump in flight */
}

static bool listed_dirty(const ferry_mq *mq, const fr_mq_peer *p) { /* compares pointers only */
  for (size_t i = 0; i < mq->ndirty; i++)
    if (mq->dirty[i] == p)
      return true;
  return false;
}

/* The targets of a publish in a stream, with their credit taken, without mq->lock: false when
 * the remembered subscribers do not hold (then the publish takes the lock). */
static bool fast_reserve(ferry_mq *mq, const char *topic, uint64_t len, pub *u) {
  fr_mq_fast *c = &mq->fast;
  if (!c->t || len > mq->inline_bytes)
    return false;
  for (size_t i = 0; i < c->n; i++)
    if (!listed_dirty(mq, c->subs[i])) /* before anything reads the peer: it may be gone */
      return false;
  if (__atomic_load_n(&mq->subs_gen, __ATOMIC_ACQUIRE) != c->gen || strcmp(c->t->name, topic))
    return false;
  for (size_t i = 0; i < c->n; i++) {
    fr_mq_peer *p = c->subs[i];
    uint64_t acked = __atomic_load_n(&p->acked, __ATOMIC_ACQUIRE);
    if (ferry_link_status(p->link) != 0 || p->sent - acked + charge_for(p, len) > p->window)
      return false; /* a dead link or a wait for credit: the full path */
  }
  for (size_t i = 0; i < c->n; i++) {
    fr_mq_peer *p = c->subs[i];
    u->local[i] = (target){.p = p, .charge = charge_for(p, len)};
    __atomic_store_n(&p->sent, p->sent + u->local[i].charge, __ATOMIC_RELAXED);
  }
  u->v = u->local;
  u->n = c->n;
  u->seq = ++mq->seq;
  u->t = c->t;
  return true;
}

/* The first half of a publish, under mq->lock: the topic, credit (waiting for it), the
 * sequence number and the pool block. */
static int prepare(ferry_mq *mq, const char *topic, uint64_t len, int ms, uint64_t loan, pub *u) {
  int rc = 0;
  pthread_mutex_lock(&mq->lock);
  fr_mq_topic *t = fr_mq_topic_get(mq, topic);
  if (t && !t->advertised) { /* the first publish on the topic: a directory round trip */
    pthread_mutex_unlock(&mq->lock);
    rc = fr_mq_advertise(mq, topic, ms);
    pthread_mutex_lock(&mq->lock);
    u->waited = true;
  }
  if (rc == 0 && !t)
    rc = fr_err(FERRY_ENOMEM, "publish '%s'", topic);
  pub_wait w = {t, len};
  bool ready = rc == 0 && mq->ndirty && credit_ready(mq, &w);
  if (rc == 0 && mq->ndirty && !ready) {
    pthread_mutex_unlock(&mq->lock); /* what the subscribers wait for must not sit here */
    fr_mq_flush_locked(mq);
    pthread_mutex_lock(&mq->lock);
    u->waited = true;
  }
  bool credit_waited = false;
  u->t = t;
  if (rc == 0)
    rc = reserve(mq, t, len, u->deadline, ms, ready, u->local, &u->v, &u->n, &credit_waited);
  u->waited |= credit_waited;
  if (rc == 0) {
    u->seq = ++mq->seq;
    int nshm = 0;
    for (size_t i = 0; i < u->n; i++)
      nshm += u->v[i].shm;
    u->fr.token = take_block(mq, len, nshm, loan, u->deadline, &u->off, &u->fresh);
    fast_remember(mq, t, u, loan);
  }
  pthread_mutex_unlock(&mq->lock);
  return rc;
}

/* The second half: the sends (or batches), then what they leave to settle. */
static int deliver(ferry_mq *mq, const char *topic, const ferry_tensor_desc *desc, const void *data,
                   size_t len, uint64_t start, uint64_t loan, pub *u) {
  if (u->fr.token && !loan)
    pool_copy(mq, u->off, data, len, u->fresh);
  build(mq, &u->fr, topic, desc, len, u->seq, u->off);
  uint64_t now = u->fr.token || u->waited ? fr_now_ns() : start; /* after a wait or a copy */
  uint64_t last = __atomic_load_n(&mq->last_publish_ns, __ATOMIC_RELAXED); /* stream_end: 0 */
  bool stream = now < last + STREAM_GAP_NS; /* or before it: TSC vs clock */
  __atomic_store_n(&mq->last_publish_ns, now, __ATOMIC_RELAXED);
  send_all(mq, &u->fr, u->v, u->n, data, len, u->deadline, now, stream);
  bool wake = batch_due_moved(mq, now);
  if (!wake && settle_quiet(&u->fr, u->v, u->n))
    return 0;
  pthread_mutex_lock(&mq->lock);
  int rc = settle(mq, &u->fr, u->v, u->n, topic);
  if (wake) {
    __atomic_store_n(&mq->batch_since_ns, oldest_batch(mq, now), __ATOMIC_RELEASE);
    pthread_cond_signal(&mq->bg_cond); /* the background thread sends it if nobody does */
  }
  pthread_mutex_unlock(&mq->lock);
  return rc;
}

/* Publishes data (in the pool block `loan` when not 0: then it is not copied). */
static int publish(ferry_mq *mq, const char *topic, const ferry_tensor_desc *desc, const void *data,
                   size_t len, int timeout_ms, uint64_t loan) {
  int ms = fr_timeout(timeout_ms);
  pthread_mutex_lock(&mq->publish_lock);
  uint64_t start = publish_now(mq); /* the one time read of a publish that does not wait */
  pub u;
  u.v = NULL;
  u.n = 0;
  u.fr.token = 0;
  u.off = u.seq = 0;
  u.fresh = u.waited = false;
  u.t = NULL;
  u.deadline = start + (uint64_t)ms * 1000000ull;
  int rc = 0;
  if (loan || !fast_reserve(mq, topic, len, &u))
    rc = prepare(mq, topic, len, ms, loan, &u);
  if (rc == 0)
    rc = deliver(mq, topic, desc, data, len, start, loan, &u);
  if (rc == 0 && u.t) { /* publish_lock: one writer; a scrape reads them relaxed */
    __atomic_store_n(&u.t->published, u.t->published + 1, __ATOMIC_RELAXED);
    __atomic_store_n(&u.t->published_bytes, u.t->published_bytes + len, __ATOMIC_RELAXED);
  } else if (rc != 0) {
    fr_count(&mq->publish_errors, 1);
  }
  pthread_mutex_unlock(&mq->publish_lock);
  if (u.v != u.local)
    free(u.v);
  return rc;
}

int ferry_mq_publish(ferry_mq *mq, const char *topic, const void *data, size_t len,
                     int timeout_ms) {
  if (!mq || (!data && len))
    return fr_err(FERRY_EINVAL, "ferry_mq_publish: NULL argument");
  int rc = fr_mq_topic_check(topic);
  return rc ? rc : publish(mq, topic, NULL, data, len, timeout_ms, 0);
}

int ferry_mq_publish_tensor(ferry_mq *mq, const char *topic, const ferry_tensor_desc *desc,
                            const void *data, int timeout_ms) {
  uint64_t len = 0;
  if (!mq || !desc)
    return fr_err(FERRY_EINVAL, "ferry_mq_publish_tensor: NULL argument");
  int rc = fr_mq_topic_check(topic);
  if (rc == 0)
    rc = ferry_tensor_nbytes(desc, &len);
  if (rc == 0 && !data && len)
    rc = fr_err(FERRY_EINVAL, "ferry_mq_publish_tensor: NULL data");
  if (rc == 0 && len > SIZE_MAX)
    rc = fr_err(FERRY_EOVERFLOW, "ferry_mq_publish_tensor: %llu bytes", (unsigned long long)len);
  if (rc != 0)
    return rc;
  ferry_tensor_desc d = *desc;
  for (uint32_t i = d.ndim; i < FERRY_MAX_DIMS; i++)
    d.shape[i] = 0;
  return publish(mq, topic, &d, data, (size_t)len, timeout_ms, 0);
}

/* ---- loans: messages built in the pool, published without a copy ---- */

/* The pool, opened; FERRY_ENOSHM / FERRY_EINVAL when no loan of len bytes can ever be made. */
static int loan_pool(ferry_mq *mq, size_t len) {
  if (!mq->pool && (mq->pool_bytes == 0 || pool_open(mq) != 0))
    return fr_err(FERRY_ENOSHM, "ferry_mq_loan: no shared-memory pool (FERRY_MQ_POOL_BYTES)");
  if (len == 0 || len > mq->pool_bytes)
    return fr_err(FERRY_EINVAL, "ferry_mq_loan: %zu bytes (the pool holds %llu)", len,
                  (unsigned long long)mq->pool_bytes);
  return 0;
}

typedef struct loan_wait {
  uint64_t len, off, token;
} loan_wait;

static bool loan_ready(ferry_mq *mq, void *arg) { /* allocates as soon as there is room */
  loan_wait *w = arg;
  if (!w->token)
    w->token = block_alloc(mq, w->len, 1, true, &w->off);
  return w->token != 0;
}

int ferry_mq_loan(ferry_mq *mq, size_t len, void **buf, int timeout_ms) {
  if (!mq || !buf)
    return fr_err(FERRY_EINVAL, "ferry_mq_loan: NULL argument");
  int ms = fr_timeout(timeout_ms);
  uint64_t deadline = fr_deadline_ns(ms);
  fr_mq_flush(mq); /* before this node waits: what we batched may be what frees the pool */
  pthread_mutex_lock(&mq->lock);
  int rc = loan_pool(mq, len);
  loan_wait w = {len, 0, 0};
  if (rc == 0) {
    drain(mq); /* releases first: reuse the blocks still warm in the cache */
    mq->waiters++;
    rc = fr_mq_wait(mq, loan_ready, &w, deadline);
    mq->waiters--;
    if (rc != 0)
      rc = fr_err(rc,
                  rc == FERRY_ETIMEDOUT
                      ? "ferry_mq_loan: no %zu bytes free in the pool within %d ms "
                        "(subscribers still hold the messages published from it)"
                      : "ferry_mq_loan: mq closing",
                  len, ms);
  }
  if (rc == 0) {
    mq->blocks[(w.token & 0xffffffffu) - 1].lent = true;
    *buf = mq->pool + w.off;
  }
  pthread_mutex_unlock(&mq->lock);
  return rc;
}

/* The token of the lent block at buf, no longer lent (lock held); 0 when buf is not a loan. */
static uint64_t loan_take(ferry_mq *mq, const void *buf, size_t *cap) {
  const uint8_t *p = buf;
  if (!mq->pool || p < mq->pool || p >= mq->pool + mq->pool_bytes)
    return 0;
  uint64_t off = (uint64_t)(p - mq->pool);
  for (size_t i = 0; i < mq->nblocks; i++) {
    fr_mq_block *b = &mq->blocks[i];
    if (b->refs > 0 && b->lent && b->off == off) {
      b->lent = false;
      *cap = (size_t)b->len;
      return (uint64_t)b->gen << 32 | (uint64_t)(i + 1);
    }
  }
  return 0;
}

void ferry_mq_loan_free(ferry_mq *mq, void *buf) {
  size_t cap = 0;
  if (!mq || !buf)
    return;
  pthread_mutex_lock(&mq->lock);
  uint64_t token = loan_take(mq, buf, &cap);
  if (token)
    fr_mq_pool_release(mq, token);
  pthread_mutex_unlock(&mq->lock);
}

/* What publish_loan checks before it sends (the loan is taken already). */
static int loan_check(const char *topic, const ferry_tensor_desc *desc, size_t len, size_t cap) {
  uint64_t n = len;
  int rc = fr_mq_topic_check(topic);
  if (rc == 0 && desc && (rc = ferry_tensor_nbytes(desc, &n)) == 0 && n != len)
    rc = fr_err(FERRY_EINVAL, "ferry_mq_publish_loan: the tensor holds %llu bytes, not %zu",
                (unsigned long long)n, len);
  if (rc == 0 && len > cap)
    rc = fr_err(FERRY_EINVAL, "ferry_mq_publish_loan: %zu bytes in a loan of %zu", len, cap);
  return rc;
}

int ferry_mq_publish_loan(ferry_mq *mq, const char *topic, const ferry_tensor_desc *desc, void *buf,
                          size_t len, int timeout_ms) {
  size_t cap = 0;
  if (!mq || !buf)
    return fr_err(FERRY_EINVAL, "ferry_mq_publish_loan: NULL argument");
  pthread_mutex_lock(&mq->lock);
  uint64_t token = loan_take(mq, buf, &cap);
  pthread_mutex_unlock(&mq->lock);
  if (!token)
    return fr_err(FERRY_EINVAL,
                  "ferry_mq_publish_loan: %p is not a loan of this mq (or was "
                  "published or freed already)",
                  buf);
  ferry_tensor_desc d;
  int rc = loan_check(topic, desc, len, cap);
  if (rc == 0 && desc) {
    d = *desc;
    for (uint32_t i = d.ndim; i < FERRY_MAX_DIMS; i++)
      d.shape[i] = 0;
  }
  if (rc == 0)
    rc = publish(mq, topic, desc ? &d : NULL, buf, len, timeout_ms, token);
  pthread_mutex_lock(&mq->lock);
  fr_mq_pool_release(mq, token); /* the loan's own hold; subscribers keep theirs */
  pthread_mutex_unlock(&mq->lock);
  return rc;
}
