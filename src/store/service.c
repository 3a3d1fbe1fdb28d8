/*
 * The store service: the answering side of what one node's store asks of another's, on
 * FR_CHANNEL_STORE (the asking side and the encoding are msg.c's). DELETE asks an owner to delete
 * its object (it frees the bytes and removes the record); DROPPED tells an owner that another
 * node replaced its key (it frees its copy); UPLOAD asks a holder (`ferry serve`) to copy a
 * tensor out of a short-lived node's ferry memory, over the link the request came on, and publish
 * it as its own; READS reports gets a reader made of this node's objects (counted, bounded). The
 * service turn also sends this node's own read receipts (receipts.c). The service thread also
 * collects the answers of posted puts and retires replaced copies whose lingering time is up
 * (owned.c), after each request and every third of the lease (the node's lease is renewed by the
 * node's own timer, directory/lease.c); uploads run on the task pool's workers (see "uploads"
 * below), so a stalled sender never holds back the service thread. Messages are decoded by
 * fr_store_msg_decode() (msg.c), a pure function (fuzzed with the directory's decoders). It sits on
 * top of the verbs: it calls put.c and owned.c as a local caller would.
 */
#include "store/service.h"
#include "core/channels.h"
#include "core/task.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct pull {
  ferry_link *link;
  const fr_store_msg *m;
  int timeout_ms;
} pull;

static int fill_from_peer(void *arg, void *dst, uint64_t bytes) {
  pull *p = arg;
  return ferry_read(p->link, &p->m->ref, p->m->offset, dst, (size_t)bytes, p->timeout_ms);
}

/* ---- the service thread ---- */

static int handle(ferry_store *s, ferry_msg *msg, const fr_store_msg *m, uint64_t *gen) {
  int timeout = fr_timeout(-1);
  switch (m->op) {
  case FR_SMSG_DELETE: /* deletes and puts are the application's own: counted, not logged */
    fr_debug("store '%s': '%s' deleted by '%s'", s->name, m->key, ferry_link_peer(msg->link));
    return fr_store_delete_local(s, m->key, m->generation, true, false, timeout);
  case FR_SMSG_READS: /* a reader's receipt: a peer's claim, bounded (metrics.c) */
    fr_store_count_claimed(s, m->gets, m->bytes);
    return 0;
  case FR_SMSG_DROPPED:
    fr_debug("store '%s': '%s' was put again on '%s'; dropping our copy", s->name, m->key,
             ferry_link_peer(msg->link));
    fr_store_delete_local(s, m->key, m->generation, false, false, timeout);
    return 0;
  default: /* FR_SMSG_UPLOAD: counted as this node's put (the object is its own now) */
    if (!(s->flags & FERRY_STORE_HOLDER))
      return fr_err(FERRY_ENOTSUP, "node '%s' does not hold objects for others", s->name);
    pull p = {.link = msg->link, .m = m, .timeout_ms = timeout};
    uint64_t t0 = fr_now_ns(), bytes = 0;
    int rc = fr_store_put_local(s, m->key, &m->desc, NULL, -1, FERRY_STORE_PUT_COPY, fill_from_peer,
                                &p, gen, timeout);
    if (rc == 0)
      ferry_tensor_nbytes(&m->desc, &bytes);
    fr_store_count(s, true, rc == 0, rc != 0, bytes, t0);
    return rc;
  }
}

static void answer(ferry_msg *msg, int rc, uint64_t gen) {
  if (!ferry_msg_is_call(msg))
    return;
  fr_wr w = {0};
  fr_wr_reply(&w, rc, rc ? ferry_last_error() : "");
  if (rc == 0)
    fr_wr_u64(&w, gen);
  struct iovec iov = {w.p, w.len};
  if (!w.failed && ferry_reply(msg, &iov, 1, 5000) != 0)
    fr_debug("store: reply to '%s' failed: %s", ferry_link_peer(msg->link), ferry_last_error());
  fr_wr_free(&w);
}

/* ---- uploads: each on a worker of the task pool ---- */

/* An upload reads the whole tensor from its sender, which may stall (SIGSTOPped, swapping, a
 * slow network) for as long as the read's timeout: on the service thread that would hold back
 * every other upload and every delete. So each upload runs as a task of the process's pool
 * (core/task.h), and the service thread only hands it over. A stalled sender holds its own
 * worker until its read times out, nobody else's. At most UPLOADS_MAX run at once, and at most
 * UPLOADS_PER_PEER for one sender, and only while the pool has a worker free (one always stays
 * for its timers: the lease's renewal): beyond, the upload is refused at once with FERRY_EBUSY
 * (the sender may retry) rather than queued behind the ones that hold the workers. */
#define UPLOADS_MAX 64
#define UPLOADS_PER_PEER 8

typedef struct upload {
  ferry_store *s;
  ferry_msg *msg;
  fr_store_msg m;
} upload;

static pthread_mutex_t uploads_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t uploads_done = PTHREAD_COND_INITIALIZER;

/* Uploads running for store s (all of them, and those from `link`). uploads_lock held. */
typedef struct running {
  ferry_store *s;
  ferry_link *link;
  struct running *next;
} running;
static running *uploads_running;

static void count(const ferry_store *s, const ferry_link *link, int *all, int *peer) {
  *all = *peer = 0;
  for (running *r = uploads_running; r; r = r->next)
    if (r->s == s) {
      (*all)++;
      *peer += r->link == link;
    }
}

static void upload_main(void *arg) {
  upload *u = arg;
  uint64_t gen = 0;
  int rc = handle(u->s, u->msg, &u->m, &gen);
  answer(u->msg, rc, gen);
  pthread_mutex_lock(&uploads_lock);
  for (running **r = &uploads_running; *r; r = &(*r)->next)
    if ((*r)->s == u->s && (*r)->link == u->msg->link) {
      running *gone = *r;
      *r = gone->next;
      free(gone);
      break;
    }
  pthread_cond_broadcast(&uploads_done);
  pthread_mutex_unlock(&uploads_lock);
  ferry_msg_free(u->msg);
  free(u);
}

/* Starts msg's upload on a worker of the pool (it then owns msg); else the error to answer. */
static int upload_start(ferry_store *s, ferry_msg *msg, const fr_store_msg *m) {
  upload *u = malloc(sizeof *u);
  running *r = malloc(sizeof *r);
  pthread_mutex_lock(&uploads_lock);
  int all, peer;
  count(s, msg->link, &all, &peer);
  bool ok = false;
  int rc = 0;
  if (!u || !r) {
    rc = fr_err(FERRY_ENOMEM, "store '%s': upload '%s'", s->name, m->key);
  } else if (all >= UPLOADS_MAX || peer >= UPLOADS_PER_PEER) {
    rc = fr_err(FERRY_EBUSY,
                "store '%s' is busy: %d uploads in progress (%d from '%s'); retry later", s->name,
                all, peer, ferry_link_peer(msg->link));
  } else {
    *u = (upload){.s = s, .msg = msg, .m = *m};
    *r = (running){.s = s, .link = msg->link, .next = uploads_running};
    uploads_running = r; /* before the task: it may end at once */
    ok = fr_task_try(upload_main, u) == 0;
    if (!ok) {
      uploads_running = r->next;
      rc = fr_err(FERRY_EBUSY,
                  "store '%s' is busy: every worker of its process's task pool is taken "
                  "(FERRY_TASK_THREADS; %d uploads in progress); retry later",
                  s->name, all);
    }
  }
  pthread_mutex_unlock(&uploads_lock);
  if (!ok) {
    free(u);
    free(r);
  }
  return rc;
}

/* Waits for store s's uploads to finish (each is bounded by its timeout). */
static void uploads_wait(ferry_store *s) {
  pthread_mutex_lock(&uploads_lock);
  for (;;) {
    int all, peer;
    count(s, NULL, &all, &peer);
    if (all == 0)
      break;
    pthread_cond_wait(&uploads_done, &uploads_lock);
  }
  pthread_mutex_unlock(&uploads_lock);
}

/* Answers one message; returns false when an upload thread took msg over. */
static bool serve_one(ferry_store *s, ferry_msg *msg) {
  fr_store_msg m;
  uint64_t gen = 0;
  int rc = fr_store_msg_decode(msg->data, msg->len, &m);
  if (rc == 0 && m.op == FR_SMSG_UPLOAD && (s->flags & FERRY_STORE_HOLDER)) {
    if ((rc = upload_start(s, msg, &m)) == 0)
      return false;
  } else if (rc == 0) {
    rc = handle(s, msg, &m, &gen);
  }
  answer(msg, rc, gen);
  return true;
}

/* The job's callbacks (transport/job.h). A request comes straight to the job's inbox (the store
 * owns FR_CHANNEL_STORE); the thread sleeps until one, a third of the lease, or
 * fr_store_service_stop. Nothing else wakes it: what settles without telling anyone is taken up
 * when it is needed and a third of the lease later at the latest (service_turn). */
static void service_msg(void *arg, ferry_msg *m) {
  if (serve_one(arg, m))
    ferry_msg_free(m);
}

/* After each request and every third of the lease, what settles unannounced is taken up:
 * answers to posted puts (the directory rings nobody with them; the next put collects them too),
 * so a put that replaced another node's record tells that node at the latest a third of
 * FERRY_LEASE_MS after it; views unpinned in shared memory and lingering copies whose time is
 * up, whose space a put that needs it takes back at once (put.c place, take_slot). Returns when
 * to look again. */
static uint64_t service_turn(void *arg) {
  ferry_store *s = arg;
  fr_store_settle(s, false, fr_deadline_ns(fr_timeout(-1)));
  fr_store_linger_reap(s);
  fr_store_receipts_flush(s);
  return s->lease.lease_ms > 0 ? fr_now_ns() + (uint64_t)s->lease.lease_ms * 1000000ull / 3
                               : UINT64_MAX;
}

static const fr_job_ops service_ops = {.on_msg = service_msg, .on_timer = service_turn};

int fr_store_service_start(ferry_store *s) {
  int rc = fr_job_start(s->ctx, FR_CHANNEL_STORE, &service_ops, s, "ferry-store", &s->service);
  if (rc == FERRY_EBUSY)
    return fr_err(rc, "store: this context has a store already (one store per context)");
  if (rc != 0)
    return fr_err_wrap(rc, "store: the service thread");
  fr_store_republish_by_timer(s, true);
  return 0;
}

void fr_store_service_stop(ferry_store *s) {
  if (s->service) {
    fr_store_republish_by_timer(s, false); /* before the job goes */
    fr_job_stop(s->service); /* requests that came as it stopped: their callers time out */
    s->service = NULL;
  }
  uploads_wait(s); /* they publish into this store */
}
