/*
 * Receiving: messages into the mq's queue, out to the application (recv or the callback), and
 * credit back to their publishers. ferry_mq_msg_copy copies a payload out into host or CUDA
 * memory (payloads themselves are always host memory).
 *
 * A message keeps the ferry message it arrived in (an inline payload is read where the link
 * put it: no copy) or points into the publisher's pool (mapped once per link: no copy either).
 * Freeing it returns its credit, and its pool block, to the session of the link it came on;
 * a session sends CREDIT once a quarter of its window is owed, so a stream of small messages
 * costs one credit frame per many messages, while a publisher never waits on credit that the
 * application has already freed for long (it is at most a quarter window behind).
 */
#include "mq/mq.h"
#include "core/channels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RELEASE_BATCH 64

/* ---- sessions ---- */

fr_mq_session *fr_mq_session_get(ferry_mq *mq, ferry_link *l) {
  for (fr_mq_session *s = mq->sessions; s; s = s->next)
    if (s->link == l)
      return s;
  fr_mq_session *s = calloc(1, sizeof *s);
  if (!s)
    return NULL;
  s->link = ferry_link_retain(l);
  s->window = mq->window;
  s->refs = 1;
  s->next = mq->sessions;
  mq->sessions = s;
  fr_mq_keep_link(mq, l);
  return s;
}

void fr_mq_session_unref(fr_mq_session *s) {
  if (--s->refs > 0)
    return;
  ferry_link_release(s->link);
  free(s->releases);
  free(s);
}

void fr_mq_session_credit(fr_mq_session *s, uint64_t charge, uint64_t token, bool *send) {
  s->pending += charge;
  if (token) {
    if (FR_GROW(s->releases, s->capreleases, s->nreleases + 1, 16) == 0)
      s->releases[s->nreleases++] = token;
    /* else the block stays held until the peer goes */
  }
  /* pool blocks go back at once: the publisher reuses them while they are warm in its cache */
  *send = !s->gone && (s->pending >= s->window / 4 || s->nreleases > 0);
}

void fr_mq_credit_flush(ferry_mq *mq, fr_mq_session *s) {
  uint64_t toks[RELEASE_BATCH * 2];
  pthread_mutex_lock(&mq->lock);
  if (s->gone || ferry_link_status(s->link) != 0 || (s->pending == 0 && s->nreleases == 0)) {
    pthread_mutex_unlock(&mq->lock);
    return;
  }
  s->consumed += s->pending;
  s->pending = 0;
  size_t n = s->nreleases < RELEASE_BATCH * 2 ? s->nreleases : RELEASE_BATCH * 2;
  if (n)
    memcpy(toks, s->releases + s->nreleases - n, n * sizeof *toks);
  s->nreleases -= n;
  fr_mq_frame f = {.type = FR_MQ_CREDIT, .value = s->consumed, .nrelease = (uint32_t)n};
  ferry_link *l = ferry_link_retain(s->link);
  s->refs++;
  pthread_mutex_unlock(&mq->lock);
  uint8_t head[FR_MQ_HEAD_MAX], rel[sizeof toks];
  for (size_t i = 0; i < n; i++)
    for (int b = 0; b < 8; b++)
      rel[8 * i + b] = (uint8_t)(toks[i] >> (8 * b));
  struct iovec iov[2] = {{head, fr_mq_encode(&f, head)}, {rel, n * 8}};
  int rc = ferry_send(l, FR_CHANNEL_MQ, iov, n ? 2 : 1, 2000);
  if (rc != 0)
    fr_debug("mq '%s': credit to '%s': %s", mq->name, ferry_link_peer(l), ferry_last_error());
  ferry_link_release(l);
  pthread_mutex_lock(&mq->lock);
  fr_mq_session_unref(s);
  pthread_mutex_unlock(&mq->lock);
}

/* ---- arrivals ---- */

static void fill(fr_mq_rmsg *r, ferry_mq *mq, ferry_msg *msg, const fr_mq_frame *f,
                 const void *payload, fr_mq_session *s);

/* Returns the credit of a message not queued (lock held); true when it is due now. */
static bool credit_back(fr_mq_session *s, uint64_t charge, uint64_t token) {
  bool send = false;
  fr_mq_session_credit(s, charge, token, &send);
  s->credit_due |= send;
  return send;
}

bool fr_mq_deliver(ferry_mq *mq, ferry_msg *msg, const fr_mq_frame *f, const void *payload) {
  fr_mq_rmsg *r = payload ? malloc(sizeof *r) : NULL;
  bool due = false;
  pthread_mutex_lock(&mq->lock);
  fr_mq_session *s = fr_mq_session_get(mq, msg->link);
  if (s && r && fr_mq_subscribed(mq, f->topic) && !mq->closing) {
    fill(r, mq, msg, f, payload, s);
    fr_mq_changed(mq);
    pthread_mutex_unlock(&mq->lock);
    return false;
  }
  if (s)
    due = credit_back(s, f->value, f->type == FR_MQ_SHM ? f->token : 0);
  pthread_mutex_unlock(&mq->lock);
  free(r);
  ferry_msg_free(msg);
  return due;
}

void fr_mq_credit_send_due(ferry_mq *mq) {
  for (;;) {
    pthread_mutex_lock(&mq->lock);
    fr_mq_session *s = mq->sessions;
    while (s && !s->credit_due)
      s = s->next;
    if (s) {
      s->credit_due = false;
      s->refs++;
    }
    pthread_mutex_unlock(&mq->lock);
    if (!s)
      return;
    fr_mq_credit_flush(mq, s);
    pthread_mutex_lock(&mq->lock);
    fr_mq_session_unref(s);
    pthread_mutex_unlock(&mq->lock);
  }
}

/* The message of a DATA frame that arrived on msg's link, not queued yet (no lock needed). */
static void describe(fr_mq_rmsg *r, ferry_mq *mq, ferry_msg *msg, const fr_mq_frame *f,
                     const void *payload) {
  r->pub = (ferry_mq_msg){.topic = f->topic,
                          .publisher = ferry_link_peer(msg->link),
                          .data = payload,
                          .len = (size_t)f->len,
                          .seq = f->seq,
                          .is_tensor = (f->flags & FR_MQ_F_TENSOR) != 0,
                          .desc = f->desc};
  r->mq = mq;
  r->raw = msg;
  r->batch = NULL;
  r->charge = f->value;
  r->token = f->type == FR_MQ_SHM ? f->token : 0;
  r->next = NULL;
}

/* Queues a described message that came from session s (lock held). */
static void enqueue(ferry_mq *mq, fr_mq_rmsg *r, fr_mq_session *s) {
  r->sess = s;
  s->refs++;
  s->held += r->charge;
  if (mq->tail)
    mq->tail->next = r;
  else
    mq->head = r;
  mq->tail = r;
  mq->queued++;
  fr_mq_count_received(mq, r->pub.topic, r->pub.len);
  if (mq->callback) /* its thread runs it (a lease renewal no longer wakes that thread) */
    fr_mq_kick(mq);
}

/* Fills a queued message from a DATA frame that arrived on msg's link (lock held). */
static void fill(fr_mq_rmsg *r, ferry_mq *mq, ferry_msg *msg, const fr_mq_frame *f,
                 const void *payload, fr_mq_session *s) {
  describe(r, mq, msg, f, payload);
  enqueue(mq, r, s);
}

/* The messages of a BATCH frame, each decoded once (no lock): a batch with n of them, or NULL
 * when none, out of memory, or one fails validation (then the whole batch is dropped). Every
 * frame in a batch takes at least FR_MQ_ALIGN bytes, which bounds the allocation; it is cut to
 * size before anything points into it. */
static fr_mq_rxbatch *batch_decode(ferry_mq *mq, ferry_msg *msg, const fr_mq_frame *f, size_t *n) {
  size_t max = (size_t)f->len / FR_MQ_ALIGN + 1, pos = 0;
  fr_mq_rxbatch *b = malloc(sizeof *b + max * sizeof b->msgs[0]);
  fr_mq_frame sub;
  int rc = 0;
  *n = 0;
  while (b && *n < max && (rc = fr_mq_batch_next(f, &pos, &sub)) == 1)
    describe(&b->msgs[(*n)++], mq, msg, &sub, sub.payload);
  if (b && rc < 0) {
    pthread_mutex_lock(&mq->lock);
    mq->malformed++;
    pthread_mutex_unlock(&mq->lock);
    fr_warn_limited("mq '%s': dropped a batch from '%s': %s", mq->name, ferry_link_peer(msg->link),
                    ferry_last_error());
  }
  if (!b || rc != 0 || *n == 0) {
    free(b);
    return NULL;
  }
  fr_mq_rxbatch *cut = realloc(b, sizeof *b + *n * sizeof b->msgs[0]);
  return cut ? cut : b;
}

bool fr_mq_deliver_batch(ferry_mq *mq, ferry_msg *msg, const fr_mq_frame *f) {
  size_t n = 0;
  fr_mq_rxbatch *b = batch_decode(mq, msg, f, &n);
  if (!b) {
    ferry_msg_free(msg);
    return false;
  }
  b->raw = msg;
  b->refs = 0;
  bool due = false;
  pthread_mutex_lock(&mq->lock);
  fr_mq_session *s = fr_mq_session_get(mq, msg->link);
  for (size_t i = 0; s && i < n; i++) {
    if (!fr_mq_subscribed(mq, b->msgs[i].pub.topic) || mq->closing) {
      due |= credit_back(s, b->msgs[i].charge, 0);
      continue;
    }
    enqueue(mq, &b->msgs[i], s);
    b->msgs[i].batch = b;
    b->refs++;
  }
  bool none = b->refs == 0;
  if (!none)
    fr_mq_changed(mq);
  pthread_mutex_unlock(&mq->lock);
  if (none) {
    ferry_msg_free(msg);
    free(b);
  }
  return due;
}

void fr_mq_on_credit(ferry_mq *mq, ferry_link *l, const fr_mq_frame *f) {
  pthread_mutex_lock(&mq->lock);
  fr_mq_peer *p = fr_mq_peer_by_link(mq, l);
  if (p && f->value > p->acked && f->value <= __atomic_load_n(&p->sent, __ATOMIC_RELAXED))
    __atomic_store_n(&p->acked, f->value, __ATOMIC_RELEASE); /* a publish may read it unlocked */
  for (uint32_t i = 0; p && i < f->nrelease; i++) {
    uint64_t tok = 0;
    for (int b = 0; b < 8; b++)
      tok |= (uint64_t)f->releases[8 * i + b] << (8 * b);
    for (size_t k = 0; k < p->ntokens; k++) /* only blocks this peer holds */
      if (p->tokens[k] == tok) {
        memmove(p->tokens + k, p->tokens + k + 1, (p->ntokens - k - 1) * sizeof *p->tokens);
        p->ntokens--;
        fr_mq_pool_release(mq, tok);
        break;
      }
  }
  fr_mq_changed(mq);
  pthread_mutex_unlock(&mq->lock);
}

/* ---- the application's side ---- */

static bool has_message(ferry_mq *mq, void *arg) { return mq->head || mq->callback; }

int ferry_mq_recv(ferry_mq *mq, ferry_mq_msg **out, int timeout_ms) {
  if (!mq || !out)
    return fr_err(FERRY_EINVAL, "ferry_mq_recv: NULL argument");
  int ms = fr_timeout(timeout_ms);
  fr_mq_stream_end(mq); /* what we batched may be what the peer answers */
  pthread_mutex_lock(&mq->lock);
  int rc = 0;
  if (!mq->head && !mq->callback) /* only a receive that waits reads the clock */
    rc = fr_mq_wait(mq, has_message, NULL, fr_deadline_ns(ms));
  if (rc == 0 && mq->callback)
    rc = FERRY_EBUSY;
  fr_mq_rmsg *r = rc == 0 ? mq->head : NULL;
  if (r) {
    if (!(mq->head = r->next))
      mq->tail = NULL;
    mq->queued--;
    r->next = NULL;
  }
  pthread_mutex_unlock(&mq->lock);
  switch (rc) {
  case 0:
    *out = &r->pub;
    return 0;
  case FERRY_ETIMEDOUT:
    return fr_err(rc, "mq recv: no message within %d ms", ms);
  case FERRY_EBUSY:
    return fr_err(rc, "mq recv: a callback takes the messages");
  default:
    return fr_err(rc, "mq recv: mq closing");
  }
}

int ferry_mq_msg_copy(const ferry_mq_msg *msg, void *dst, size_t cap) {
  if (!msg || (!dst && msg->len > 0))
    return fr_err(FERRY_EINVAL, "ferry_mq_msg_copy: NULL argument");
  if (cap < msg->len)
    return fr_err(FERRY_ERANGE, "mq message of '%s' on '%s': %zu bytes do not fit a buffer of %zu",
                  msg->publisher, msg->topic, msg->len, cap);
  if (msg->len == 0)
    return 0;
  fr_mem_where w = fr_cuda_where(dst);
  if (w.kind != FERRY_MEM_CUDA) {
    memcpy(dst, msg->data, msg->len);
    return 0;
  }
  size_t room = fr_cuda_room(&w, dst);
  if (room < msg->len)
    return fr_err(FERRY_ERANGE,
                  "mq message of '%s' on '%s': %zu bytes do not fit the CUDA allocation at dst "
                  "(%zu bytes from there)",
                  msg->publisher, msg->topic, msg->len, room);
  int rc = fr_cuda_copy_on(w.device, dst, msg->data, msg->len);
  return rc ? fr_err_wrap(rc, "mq message of '%s' on '%s': into CUDA device %d", msg->publisher,
                          msg->topic, w.device)
            : 0;
}

void ferry_mq_msg_free(ferry_mq_msg *msg) {
  if (!msg)
    return;
  fr_mq_rmsg *r = (fr_mq_rmsg *)msg;
  ferry_mq *mq = r->mq;
  fr_mq_session *s = r->sess;
  bool send = false;
  pthread_mutex_lock(&mq->lock);
  s->held -= r->charge;
  fr_mq_session_credit(s, r->charge, r->token, &send);
  fr_mq_rxbatch *b = r->batch;
  bool last = !b || --b->refs == 0;
  if (!send) /* one lock round per message: the session is needed no longer */
    fr_mq_session_unref(s);
  pthread_mutex_unlock(&mq->lock);
  if (last)
    ferry_msg_free(r->raw);
  if (!b)
    free(r);
  else if (last)
    free(b);
  if (!send)
    return;
  fr_mq_credit_flush(mq, s);
  pthread_mutex_lock(&mq->lock);
  fr_mq_session_unref(s);
  pthread_mutex_unlock(&mq->lock);
}
