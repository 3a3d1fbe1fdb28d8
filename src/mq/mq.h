/*
 * mq, internal view: the state behind a ferry_mq handle and what its files share.
 *
 * wire.c encodes and decodes mq frames (a pure decoder, fuzzed); mq.c opens and closes, owns
 * the context's FR_CHANNEL_MQ (its on_msg dispatches every frame as it arrives, on whichever
 * thread drives the context), runs the mq's thread (timers, and what on_msg may not do because
 * it could block) and the one wait; discover.c subscribes, advertises and finds peers;
 * publish.c sends (with credit.c, batch.c, fast.c, pool.c, clock.c, loan.c: publish.h); recv.c
 * queues messages for the application, hands them out and returns credit.
 *
 * Roles: as a publisher this node keeps a `peer` per remote subscriber node (its link, credit
 * window and what is in flight to it) and, per topic, the list of peers subscribed. As a
 * subscriber it keeps a `session` per link that data arrives on (credit it owes back, pool blocks
 * it holds), and the set of topics it subscribed.
 *
 * Locks, in this order: publish_lock, then the context's channel lock (held around on_msg),
 * then mq->lock, then the inbox's. So nothing that holds mq->lock calls into the context (a
 * send, a wait, a link poll, a channel open or close): on_msg, run by that call's thread or by
 * the one it waits on, would take mq->lock again or wait for the holder.
 */
#ifndef FR_MQ_H
#define FR_MQ_H

#include "core/channels.h"
#include "core/core.h"
#include "core/pool.h"
#include "core/cuda.h"
#include "core/region.h"
#include "directory/directory.h"
#include "directory/peers.h"
#include "transport/job.h"

#include <pthread.h>
#include <string.h>
#include <stdbool.h>

/* ---- wire.c: frames on FR_CHANNEL_MQ ---- */
#define FR_MQ_MAGIC 0x31514d46u /* "FMQ1" */
#define FR_MQ_VERSION 1
#define FR_MQ_HEAD_BYTES 48
#define FR_MQ_TENSOR_BYTES 72 /* u32 dtype, u32 ndim, 8 x u64 shape */
#define FR_MQ_SHM_BYTES 40    /* region id, key, size, offset, token */
#define FR_MQ_ALIGN 64        /* inline payloads start at a multiple of this in the frame */
#define FR_MQ_MAX_RELEASES 4096
#define FR_MQ_HEAD_MAX                                                                             \
  (FR_MQ_HEAD_BYTES + FR_MQ_TENSOR_BYTES + FR_MQ_SHM_BYTES + FERRY_MQ_TOPIC_MAX + 1 + FR_MQ_ALIGN)

enum fr_mq_type {
  FR_MQ_DATA = 1,   /* a message, payload inline */
  FR_MQ_SHM = 2,    /* a message whose payload lies in the publisher's pool region */
  FR_MQ_SUB = 3,    /* subscriber -> publisher (a call): add me to topic; `value` = my window */
  FR_MQ_UNSUB = 4,  /* subscriber -> publisher: remove me from topic */
  FR_MQ_CREDIT = 5, /* subscriber -> publisher: `value` = bytes consumed so far; pool releases */
  FR_MQ_BYE = 6,    /* either way: this mq is closing; forget me */
  FR_MQ_BATCH = 7,  /* DATA frames back to back (small messages of a stream) */
  FR_MQ_TYPE_MAX = 7,
};
#define FR_MQ_F_TENSOR 1u

typedef struct fr_mq_frame {
  uint8_t type, flags;
  uint64_t seq;   /* DATA/SHM: the publisher's message number */
  uint64_t len;   /* DATA/SHM: payload bytes */
  uint64_t value; /* DATA/SHM: credit charged; SUB: window; CREDIT: bytes consumed (cumulative) */
  const char *topic; /* NUL-terminated inside the frame; NULL for CREDIT/BYE */
  size_t topic_len;
  ferry_tensor_desc desc;  /* FR_MQ_F_TENSOR */
  ferry_region_ref ref;    /* SHM */
  uint64_t offset, token;  /* SHM */
  const uint8_t *payload;  /* DATA */
  const uint8_t *releases; /* CREDIT: n little-endian u64 tokens */
  uint32_t nrelease;
} fr_mq_frame;

/* Checks a topic: 1..FERRY_MQ_TOPIC_MAX bytes, no control characters. */
int fr_mq_topic_check(const char *topic);
/* Writes a frame's head (everything before an inline payload) into buf (FR_MQ_HEAD_MAX bytes)
 * and returns its length. `f->topic` may be NULL for CREDIT/BYE. For CREDIT the releases follow
 * the head and are not written here (nrelease is). */
size_t fr_mq_encode(const fr_mq_frame *f, uint8_t *buf);
/* Patches `value` of an encoded head (a DATA/SHM message's charge, per subscriber). */
void fr_mq_set_value(uint8_t *head, uint64_t value);
/* Decodes and validates one frame into *out (which means nothing when it fails); FERRY_EPROTO
 * with a detail when malformed. Pure. */
int fr_mq_decode(const void *data, size_t len, fr_mq_frame *out);
/* The next DATA frame of a decoded BATCH (*pos: 0 at first): 1 with *out set, 0 at the end, or
 * FERRY_EPROTO. Pure. */
int fr_mq_batch_next(const fr_mq_frame *batch, size_t *pos, fr_mq_frame *out);
#define FR_MQ_BATCH_BYTES 32768 /* a batch is sent when it would grow past this */

/* ---- the handle ---- */
typedef struct fr_mq_peer { /* a remote subscriber node, as its publisher sees it */
  char name[FR_DIR_NAME_MAX + 1];
  ferry_link *link;
  uint64_t window, sent, acked; /* credit: may send while sent - acked + charge <= window;
                                 * sent written under publish_lock, acked under lock, both
                                 * atomically (a publish in a stream reads acked unlocked) */
  uint64_t *tokens;             /* pool blocks it holds */
  size_t ntokens, captokens;
  bool dead;
  uint8_t *batch; /* small messages not yet sent (publish_lock) */
  size_t batch_len;
  uint64_t batch_ns; /* when the batch's first message was published (publish_lock) */
  int batch_rc;      /* a failed batch send, reported by the next publish */
  bool dirty;        /* listed in mq->dirty */
  int refs; /* topics listing it + a pending batch + publishes in flight while it has none */
  struct fr_mq_peer *next;
} fr_mq_peer;

typedef struct fr_mq_topic { /* a topic this node publishes (or was asked about) */
  char *name;
  bool advertised;
  fr_mq_peer **subs;
  size_t nsubs, capsubs;
  uint64_t published, published_bytes; /* metrics: written under publish_lock, read relaxed */
  struct fr_mq_topic *next;
} fr_mq_topic;

/* Received messages per topic (metrics.c): a bounded table, the rest counted as one row. */
#define FR_MQ_STAT_TOPICS 32
typedef struct fr_mq_rx_stat {
  char *name; /* NULL: the row of topics beyond the table */
  size_t len;
  uint64_t msgs, bytes;
} fr_mq_rx_stat;

typedef struct fr_mq_session { /* a link that messages arrive on */
  ferry_link *link;
  uint64_t consumed;  /* credit returned so far (cumulative, what CREDIT carries) */
  uint64_t pending;   /* credit freed but not yet returned */
  uint64_t held;      /* credit of messages queued or held by the application */
  uint64_t window;    /* our window, for the return threshold */
  uint64_t *releases; /* pool tokens to release */
  size_t nreleases, capreleases;
  bool gone;       /* the publisher said BYE or the link died */
  bool credit_due; /* credit to send that on_msg could not (a send may block): the thread's */
  int refs;        /* the session list + messages */
  struct fr_mq_session *next;
} fr_mq_session;

typedef struct fr_mq_rmsg { /* a received message */
  ferry_mq_msg pub;         /* first: the caller sees this */
  ferry_mq *mq;
  ferry_msg *raw;
  struct fr_mq_rxbatch *batch; /* the batch it came in (owns raw), or NULL */
  fr_mq_session *sess;
  uint64_t charge, token;
  struct fr_mq_rmsg *next;
} fr_mq_rmsg;

typedef struct fr_mq_rxbatch { /* messages that arrived in one BATCH frame: one allocation */
  ferry_msg *raw;
  size_t refs; /* messages not yet freed (mq->lock) */
  fr_mq_rmsg msgs[];
} fr_mq_rxbatch;

typedef struct fr_mq_block { /* a pool block in flight (or lent to the application) */
  uint64_t off, len;
  int refs; /* subscribers that still hold it, + 1 while lent; 0: free slot */
  uint32_t gen;
  bool lent; /* ferry_mq_loan gave it out and no publish took it back yet */
} fr_mq_block;

#define FR_MQ_FAST_SUBS 8
typedef struct fr_mq_fast { /* the last publish's topic and subscribers (publish_lock) */
  fr_mq_topic *t;           /* NULL: none */
  uint64_t gen;             /* mq->subs_gen then */
  size_t n;
  fr_mq_peer *subs[FR_MQ_FAST_SUBS];
} fr_mq_fast;

typedef struct fr_mq_clock { /* the TSC against CLOCK_MONOTONIC (publish_lock) */
  uint64_t tsc, ns;          /* at the last clock read */
  uint64_t rate;             /* ns per tick, 32.32 fixed point; 0: not measured yet */
  uint64_t rebase_ticks;     /* ticks after which the clock is read again */
} fr_mq_clock;

struct ferry_mq {
  ferry_ctx *ctx;
  char name[FR_DIR_NAME_MAX + 1]; /* the ctx's name */
  fr_dir *dir;
  fr_dir_lease lease; /* its job record "ferry:job/mq/" + name on its context's node */
  uint64_t window, inline_bytes;

  pthread_mutex_t lock; /* everything below */
  pthread_cond_t cond;  /* state changed (fr_mq_changed): waiters in fr_mq_wait sleep on it */
  uint64_t events;      /* bumped with every change a waiter may wait for (fr_mq_changed): what the
                         * one wait's ready() reads without the lock (atomic) */
  bool closing;
  bool rx_costly;     /* atomic: the last frame came on a link not cheap to poll (not shm):
                       * waiters then do not spin */
  uint64_t malformed; /* frames dropped as malformed */
  /* The mq's thread (transport/job.h), owning FR_CHANNEL_MQ with mq.c's channel table: its
   * inbox holds what on_msg leaves to the thread (SUB calls, malformed calls, data whose pool is
   * not mapped yet, and data behind it). Set before the channel is owned, NULL after close. */
  fr_job *job;
  size_t deferred; /* data frames in the inbox: later ones queue behind them (order) */

  fr_mq_rmsg *head, *tail; /* received, not yet taken */
  size_t queued;
  char **subscribed; /* topics */
  size_t nsubscribed, capsubscribed;
  fr_mq_session *sessions;
  fr_mq_peer *peers;
  fr_mq_topic *topics;
  uint64_t subs_gen;  /* bumped whenever a topic's subscribers change (read unlocked: atomic) */
  struct fr_mq_link { /* every link this mq dialled or was dialled on, one ref each */
    ferry_link *link;
    bool bye; /* the peer's mq said BYE on it: it is gone, nobody would answer ours */
  } * links;
  size_t nlinks, caplinks;
  fr_peers dialled; /* the links this mq dialled, by node name (directory/peers.h): closed last */

  ferry_mq_fn callback;
  void *callback_arg;
  bool in_callback; /* the thread is in the callback */

  pthread_mutex_t publish_lock; /* one publish at a time: every subscriber sees one order */
  uint64_t seq;
  uint64_t last_publish_ns; /* publishes closer together than this batch small messages;
                             * written under publish_lock, read unlocked by receives (atomic) */
  fr_mq_clock clock;        /* the time a publish reads (publish.c) */
  fr_mq_fast fast;          /* what a publish in a stream reuses (publish.c) */
  fr_mq_peer **dirty;       /* peers with a pending batch, a reference each (publish_lock) */
  size_t ndirty, capdirty;
  uint64_t batch_since_ns; /* when the oldest pending message was published; 0: none (atomic) */

  /* the pool: one ferry_alloc'd region that large payloads are copied into once. Trust: it
   * holds payload bytes only, no metadata; a subscriber learns a message's place from the SHM
   * frame (copied out of the link's ring, then decoded by fr_mq_decode), reads it through
   * ferry_view (bounds-checked against the region as mapped, transport/shm.c) and returns its
   * token in a CREDIT frame, which the publisher honours only for blocks that subscriber
   * holds (fr_mq_on_credit in recv.c). A subscriber that writes into the pool corrupts payloads, no
   * more. */
  uint8_t *pool;
  ferry_region_ref pool_ref;
  uint64_t pool_bytes;
  uint64_t pool_hwm; /* end of the highest block so far: the pool below was written lately */
  uint64_t fresh_ps_per_byte; /* what a copy into fresh pool memory cost (publish_lock) */
  /* timing settings, read at open: FERRY_MQ_FLUSH_US (a pending batch goes out after this at
   * the latest), FERRY_MQ_STREAM_GAP_US (publishes closer than this are a stream: batched),
   * FERRY_MQ_WARM_WAIT_US (the least a large publish waits for a warm pool block before it
   * grows the pool) */
  uint64_t flush_ns, stream_gap_ns, warm_wait_ns;
  fr_mq_block *blocks;
  size_t nblocks, capblocks;
  fr_pool space; /* which bytes of the pool are free, in 4 KiB granules (core/pool.h) */

  bool thread_started; /* job runs: close says BYE while it answers peers' BYEs */

  /* metrics (metrics.c), under lock; last, so that the fields above keep their cache lines */
  fr_mq_rx_stat rx[FR_MQ_STAT_TOPICS + 1]; /* the last row: every other topic */
  size_t nrx, rx_last;
  uint64_t credit_waits, credit_wait_ns, publish_errors; /* publish_errors: atomic */
  uint64_t stall_log_ns; /* a wait for credit this long is logged (FERRY_MQ_STALL_LOG_MS) */
};

/* mq.c */
/* Waits (mq->lock held) until ready(mq, arg) or the deadline: through the context's one wait
 * (fr_ctx_wait), woken by fr_mq_changed; a waiter that leads the context's epoll or spins on
 * its shm rings has what it waits for delivered by its own thread. A wait whose deadline has
 * passed drains the shm rings once first. 0, FERRY_ETIMEDOUT or FERRY_ECLOSED (no detail set). */
int fr_mq_wait(ferry_mq *mq, bool (*ready)(ferry_mq *, void *), void *arg, uint64_t deadline_ns);

/* Something a waiter may wait for changed (lock held): wakes fr_mq_wait's sleepers, and the
 * waiter that leads the context's epoll, when another thread changed it (the mq's thread added
 * a subscriber, the application freed a loan or closes: no message wakes that leader). */
static inline void fr_mq_changed(ferry_mq *mq) {
  __atomic_store_n(&mq->events, mq->events + 1, __ATOMIC_SEQ_CST);
  pthread_cond_broadcast(&mq->cond);
  fr_ctx_poke(mq->ctx, FR_CHANNEL_MQ);
}
/* Gives the thread something to look at (lock held): a timer moved, a callback to run, credit
 * to send. */
static inline void fr_mq_kick(ferry_mq *mq) {
  if (mq->job)
    fr_job_wake(mq->job, 0);
}
/* Remembers a link (takes a reference) so close can say BYE and release it. lock held. */
void fr_mq_keep_link(ferry_mq *mq, ferry_link *l);

/* discover.c */
int fr_mq_register(ferry_mq *mq, bool fresh, int timeout_ms);
void fr_mq_unregister(ferry_mq *mq); /* removes the node and its records */
/* Hands publishing its records again, after the directory lost them, to the node's timer (on),
 * or takes it back (off: waits for a call under way). */
void fr_mq_republish_by_timer(ferry_mq *mq, bool on);
/* The topic's entry (lock held); created when absent. NULL on out of memory. */
fr_mq_topic *fr_mq_topic_get(ferry_mq *mq, const char *topic);
/* Publishes the topic's publisher record and adds every subscriber the directory knows. */
int fr_mq_advertise(ferry_mq *mq, const char *topic, int timeout_ms);
/* Adds peer `name` on `link` (NULL: dial it) to topic with `window` (lock not held). */
int fr_mq_add_subscriber(ferry_mq *mq, const char *topic, const char *name, ferry_link *link,
                         uint64_t window, int timeout_ms);
void fr_mq_remove_subscriber(ferry_mq *mq, const char *topic, const char *name);
/* A subscriber died or left: drop it from every topic and free its pool blocks (lock held). */
void fr_mq_peer_drop(ferry_mq *mq, fr_mq_peer *p, const char *why);
void fr_mq_peer_unref(ferry_mq *mq, fr_mq_peer *p); /* lock held */
fr_mq_peer *fr_mq_peer_by_link(ferry_mq *mq, ferry_link *l);
/* The directory keys of a topic's records. */
void fr_mq_key(char *buf, size_t cap, char role, const char *topic, const char *node);

/* publish.c */
/* Sends every pending batch (publish_lock held). */
void fr_mq_flush_locked(ferry_mq *mq);
/* The same from a thread about to wait: skipped when a publish is running (it flushes). */
void fr_mq_flush(ferry_mq *mq);
/* fr_mq_flush for a receive, which also ends a stream: the next publish is not batched. */
void fr_mq_stream_end(ferry_mq *mq);
void fr_mq_pool_release(ferry_mq *mq, uint64_t token); /* lock held */
void fr_mq_pool_fini(ferry_mq *mq);

/* recv.c */
/* Queues a DATA or SHM frame that arrived on msg->link (takes msg), its payload at `payload`
 * (NULL: lost, its credit returned). Never blocks: credit it cannot send is marked due on the
 * session (true returned: kick the thread). */
bool fr_mq_deliver(ferry_mq *mq, ferry_msg *msg, const fr_mq_frame *f, const void *payload);
/* Queues the messages of a BATCH frame (takes msg); a malformed batch is dropped whole. As
 * fr_mq_deliver, true when credit is due. */
bool fr_mq_deliver_batch(ferry_mq *mq, ferry_msg *msg, const fr_mq_frame *f);
/* Sends the credit marked due (the thread; lock not held). */
void fr_mq_credit_send_due(ferry_mq *mq);
/* Handles CREDIT (lock not held). */
void fr_mq_on_credit(ferry_mq *mq, ferry_link *l, const fr_mq_frame *f);
fr_mq_session *fr_mq_session_get(ferry_mq *mq, ferry_link *l); /* lock held; NULL: no memory */
void fr_mq_session_unref(fr_mq_session *s);                    /* lock held */
/* Returns credit for `charge` (and a pool token) on session s (lock held); *send tells the
 * caller to flush the session's credit (fr_mq_credit_flush) once it dropped the lock. */
void fr_mq_session_credit(fr_mq_session *s, uint64_t charge, uint64_t token, bool *send);
void fr_mq_credit_flush(ferry_mq *mq, fr_mq_session *s);
bool fr_mq_subscribed(ferry_mq *mq, const char *topic); /* lock held */

/* metrics.c: counts a message queued for the application (lock held); registers and removes
 * the mq's collector and readiness check with its ctx. */
fr_mq_rx_stat *fr_mq_rx_row(ferry_mq *mq, const char *topic);
static inline void fr_mq_count_received(ferry_mq *mq, const char *topic, uint64_t bytes) {
  fr_mq_rx_stat *r = &mq->rx[mq->rx_last]; /* a stream is one topic: try the last one first */
  if (!r->name || strcmp(r->name, topic) != 0)
    r = fr_mq_rx_row(mq, topic);
  r->msgs++;
  r->bytes += bytes;
}
int fr_mq_stats_start(ferry_mq *mq);
void fr_mq_stats_stop(ferry_mq *mq);
/* Frees the receive table, once nothing is queued any more (free_state). */
void fr_mq_stats_free(ferry_mq *mq);

#endif
