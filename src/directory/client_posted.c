/*
 * The embedded directory's posted puts (client.c has the overview): a put with
 * FR_DIR_PUT_POSTED over a shm link to a server on this host is sent without waiting for its
 * answer, after taking a ticket in the key's slot of the shared table and writing the record
 * there; its answer is collected later (fr_dir_settle: the next put, the lease renewal, or a
 * caller that waits), and cb told of the records that failed or replaced another owner's.
 */
#include "core/channels.h"
#include "directory/client_impl.h"
#include "directory/table.h"
#include "transport/linkcalls.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* A put sent without waiting for its answer (FR_DIR_PUT_POSTED), until settled. */
typedef struct posted {
  fr_pending *pending; /* the put, in flight on link until collected */
  ferry_link *link;
  fr_dir_object *objs; /* what was put: n records */
  size_t n;
  bool batch;
  struct posted *next;
} posted;

/* Posted puts not yet settled, at most: beyond, a put waits for its answer (and so for theirs),
 * which keeps a writer in a tight loop from queueing without bound at the server. */
#define POSTED_MAX 16
/* The post that leaves this many unanswered rings the server (a no-op when it is awake): a stream
 * of puts faster than the server's look at its leases then costs one wake-up per POSTED_RING
 * puts, on the put that rings, and fills POSTED_MAX (a put then waits) only when it outruns the
 * server. */
#define POSTED_RING (POSTED_MAX * 3 / 4)

/* The current link when it goes to shm (the server then orders posted puts by this host's
 * clock, server.c) and the change words and table are mapped over it (*watch, *table); NULL
 * otherwise. */
static ferry_link *post_link(emb *e, int timeout_ms, uint64_t **watch, uint64_t **table) {
  ferry_link *l = NULL, *cur = NULL;
  if (e->local || fr_dir_emb_current_link(e, NULL, timeout_ms, &l) != 0)
    return NULL;
  if (!fr_dir_emb_current_maps(e, &cur, watch, table) || cur != l)
    return NULL;
  return *watch && *table && strcmp(ferry_link_transport(l), "shm") == 0 ? l : NULL;
}

/* Before a posted put is sent: a ticket per record in the table, and the record in its slot
 * (not for a put that may be refused: FR_DIR_PUT_KEEP_OTHERS). */
static void table_tickets(uint64_t *table, const fr_dir_object *objs, size_t n, unsigned flags) {
  for (size_t i = 0; i < n; i++) {
    uint64_t *slot = fr_dir_table_slot(table, FR_DIR_TABLE_SLOTS, objs[i].key);
    uint64_t ticket = fr_dir_table_ticket(slot);
    if (!(flags & FR_DIR_PUT_KEEP_OTHERS))
      fr_dir_table_post(slot, ticket, &objs[i]);
  }
}

/* A posted put that could not be sent: its tickets are done (the caller asks and waits). */
static void table_give_up(uint64_t *table, const fr_dir_object *objs, size_t n) {
  for (size_t i = 0; i < n; i++)
    fr_dir_table_done(fr_dir_table_slot(table, FR_DIR_TABLE_SLOTS, objs[i].key));
}

/* A posted put is in the server's ring: stamps taken from now on differ (fr_dir_ops.stamp). */
static void watch_posted(uint64_t *watch, const fr_dir_object *objs, size_t n) {
  for (size_t i = 0; i < n; i++)
    __atomic_add_fetch(&watch[1 + fr_dir_watch_bucket(objs[i].key, FR_DIR_WATCH_BUCKETS)], 1,
                       __ATOMIC_SEQ_CST);
}

static void posted_append(emb *e, posted *ps) {
  pthread_mutex_lock(&e->posted_lock);
  if (e->posted_tail)
    e->posted_tail->next = ps;
  else
    e->posted_head = ps;
  e->posted_tail = ps;
  e->nposted++;
  pthread_mutex_unlock(&e->posted_lock);
}

static size_t posted_count(emb *e) {
  pthread_mutex_lock(&e->posted_lock);
  size_t n = e->nposted;
  pthread_mutex_unlock(&e->posted_lock);
  return n;
}

/* Sends a put (`op` and its arguments in `args`) without waiting for the answer; false when it
 * cannot be posted (the caller then calls and waits). */
bool fr_dir_emb_post(emb *e, uint16_t op, const fr_wr *args, const fr_dir_object *objs, size_t n,
                     unsigned flags, int timeout_ms) {
  uint64_t *watch = NULL, *table = NULL;
  size_t before = posted_count(e);
  ferry_link *l = before >= POSTED_MAX ? NULL : post_link(e, timeout_ms, &watch, &table);
  posted *ps = l && !args->failed ? calloc(1, sizeof *ps) : NULL;
  fr_dir_object *copy = ps ? malloc(n * sizeof *copy) : NULL;
  if (copy) { /* all set before the answer can come in */
    memcpy(copy, objs, n * sizeof *copy);
    *ps = (posted){.link = l, .objs = copy, .n = n, .batch = op == FR_DOP_OBJ_PUT_BATCH};
  }
  uint8_t buf[FR_DIR_OBJECT_WIRE_MAX + 64];
  fr_wr w = FR_WR_ON(buf);
  fr_wr_request(&w, FR_DOP_POSTED);
  fr_wr_u64(&w, fr_now_ns()); /* before the bytes go out: see server.c */
  fr_wr_u16(&w, op);
  fr_wr_bytes(&w, args->p, args->len);
  struct iovec iov = {w.p, w.len};
  bool ready = copy && !w.failed;
  if (ready)
    table_tickets(table, objs, n, flags);
  /* quiet: a doorbell would wake the server on this caller's path (dirwire.h); but the
   * POSTED_RING-th unanswered post rings, so a stream seldom fills POSTED_MAX and waits */
  bool quiet = before + 1 < POSTED_RING;
  bool sent = ready && fr_link_call_post(l, FR_CHANNEL_DIRECTORY, &iov, 1, timeout_ms, quiet,
                                         &ps->pending) == 0;
  fr_wr_free(&w);
  if (ready && !sent)
    table_give_up(table, objs, n);
  if (!sent) {
    free(copy);
    free(ps);
    fr_err_clear();
    return false;
  }
  watch_posted(watch, objs, n); /* before the put returns */
  posted_append(e, ps);
  return true;
}

/* One record's answer to a put: its status (batches only; a single put's is the reply's), then
 * whether it replaced another owner's record, and that record. A status that is no ferry error
 * marks the reply malformed. */
int fr_dir_emb_read_put_answer(fr_rd *rd, bool batch, bool *other, fr_dir_object *old) {
  int st = batch ? (int32_t)fr_rd_u32(rd) : 0;
  *other = st == 0 && fr_rd_u8(rd) != 0;
  if (*other)
    fr_rd_object(rd, old);
  if (st > 0 || st < -1000)
    rd->failed = true;
  return st;
}

/* Reads a posted put's answers: calls cb for each record that failed or replaced another
 * owner's (cb NULL: only checks the reply). False when the reply is malformed. */
static bool posted_replies(fr_rd rd, const posted *ps, fr_dir_settle_fn cb, void *arg) {
  for (size_t i = 0; i < ps->n && !rd.failed; i++) {
    fr_dir_object old;
    bool other;
    int st = fr_dir_emb_read_put_answer(&rd, ps->batch, &other, &old);
    if (cb && !rd.failed && (st != 0 || other)) {
      if (st != 0)
        fr_err(st, "put '%s': %s", ps->objs[i].key, ferry_strerror(st));
      cb(arg, &ps->objs[i], st, other ? &old : NULL);
    }
  }
  return fr_rd_done(&rd);
}

/* Collects one posted put's answer and tells cb what needs acting on. */
static void settle_one(emb *e, posted *ps, fr_dir_settle_fn cb, void *arg, int timeout_ms) {
  ferry_msg *m = NULL;
  int rc = fr_link_call_collect(ps->link, ps->pending, &m, timeout_ms);
  char detail[512];
  fr_rd rd = rc == 0 ? fr_rd_init(m->data, m->len) : fr_rd_init(NULL, 0);
  int st = 0;
  if (rc == 0 && !fr_rd_reply(&rd, &st, detail, sizeof detail))
    rc = FERRY_EPROTO;
  else if (rc == 0 && st != 0)
    rc = st;
  else if (rc == 0 && !posted_replies(rd, ps, NULL, NULL))
    rc = FERRY_EPROTO;
  if (rc == 0 && cb)
    posted_replies(rd, ps, cb, arg);
  for (size_t i = 0; rc != 0 && cb && i < ps->n; i++) {
    fr_err(rc, "directory at ferry://%s: posted put '%s': %s", e->where, ps->objs[i].key,
           st ? detail : ferry_strerror(rc));
    cb(arg, &ps->objs[i], rc, NULL);
  }
  ferry_msg_free(m);
  free(ps->objs);
  free(ps);
}

/* Collects the answers that are in, oldest first; with `wait`, every answer, each waited for
 * until the deadline, after ringing the server for the posts it has not taken yet (one doorbell
 * brings in all of them). Answers ring nobody (server.c), so this drives the link's receive side
 * to see them. Nothing calls this on a timer: a put settles what earlier ones left, the store's
 * lease renewal what a quiet store left (dirwire.h). */
void fr_dir_emb_settle(void *st, bool wait, fr_dir_settle_fn cb, void *arg, int timeout_ms) {
  emb *e = st;
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  for (;;) {
    pthread_mutex_lock(&e->posted_lock);
    posted *ps = e->posted_head;
    if (ps && !fr_link_call_ready(ps->pending))
      fr_link_poll(ps->link, false); /* answers to posted puts ring no doorbell */
    if (ps && wait && !fr_link_call_ready(ps->pending))
      fr_link_ring(ps->link); /* a no-op unless the server sleeps (ring.h) */
    if (ps && !wait && !fr_link_call_ready(ps->pending))
      ps = NULL;
    if (ps && !(e->posted_head = ps->next))
      e->posted_tail = NULL;
    if (ps)
      e->nposted--;
    pthread_mutex_unlock(&e->posted_lock);
    if (!ps)
      return;
    settle_one(e, ps, cb, arg, wait ? fr_ms_left(deadline) : 0);
  }
}
