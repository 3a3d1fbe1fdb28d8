/*
 * mq: publish/subscribe between processes over each transport (shm, tcp, and ucx when built):
 * ordering and content, no loss behind a slow subscriber (back-pressure instead), a publish to
 * a full queue that times out naming the subscriber, a subscriber killed with SIGKILL (dropped,
 * reported, the others go on), subscribers joining and leaving while a publisher publishes,
 * malformed frames, callbacks, zero-copy loans, an idle mq that sleeps, and the wire decoder.
 * The parent hosts the directory; helpers are this binary exec'd again (safe from a threaded
 * parent, and under TSan). No timings are asserted: waits are bounded by generous timeouts only
 * (the idle case counts wake-ups).
 */
// ferry-test: threaded
#include "testutil.h"

#include "core/channels.h"
#include "mq/mq.h"
#include "etcdutil.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *suite_transports = "shm,tcp";

/* Fewer messages under the sanitizers (every case runs over each transport, under ctest's
 * 300 s bound); the cases are the same. */
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define SCALE 4
#else
#define SCALE 1
#endif

/* The idle case's bound: wake-ups of the whole process in 3 s (10 a second). TSan's runtime
 * runs a thread of its own that wakes on a timer (10-20 times a second here): under it the
 * case still runs and prints its count, with no bound. */
#if defined(__SANITIZE_THREAD__)
#define IDLE_WAKEUPS_MAX 100000
#else
#define IDLE_WAKEUPS_MAX 30
#endif

static ferry_ctx *ctx_open(const char *name, const char *transports) {
  ferry_ctx_opts o = {.size = sizeof o, .name = name, .transports = transports, .token = ""};
  ferry_ctx *c = NULL;
  FR_OK(ferry_ctx_open(&o, &c));
  return c;
}

/* The directory URL of a ctx that hosts it: ferry://<its tcp listener>. */
static void dir_url(ferry_ctx *c, char *buf, size_t cap) {
  const char *tcp = strstr(ferry_ctx_address(c), "tcp://");
  assert_non_null(tcp);
  snprintf(buf, cap, "ferry://%.*s", (int)strcspn(tcp + 6, ","), tcp + 6);
}

static ferry_mq *mq_open(ferry_ctx *c, const char *dir, uint64_t queue_bytes) {
  ferry_mq_opts o = {.size = sizeof o,
                     .directory = dir,
                     .queue_bytes = queue_bytes,
                     .flags = dir ? 0 : FERRY_MQ_HOST_DIRECTORY};
  ferry_mq *mq = NULL;
  FR_OK(ferry_mq_open(c, &o, &mq));
  return mq;
}

/* Message k: 8 bytes of k, then a pattern seeded by k; sizes cycle through inline and pool. */
static const size_t sizes[] = {8, 64, 1000, 70000, 8, 300000, 4096};
static size_t size_of(uint64_t k) { return sizes[k % (sizeof sizes / sizeof sizes[0])]; }

static void fill(uint8_t *buf, uint64_t k, size_t len) {
  memcpy(buf, &k, 8);
  tu_fill(buf + 8, len - 8, k);
}

static bool check(const ferry_mq_msg *m, uint64_t *k) {
  if (m->len < 8)
    return false;
  memcpy(k, m->data, 8);
  if (m->len != size_of(*k))
    return false;
  uint8_t *want = malloc(m->len);
  fill(want, *k, m->len);
  bool ok = memcmp(want, m->data, m->len) == 0;
  free(want);
  return ok;
}

/* ---- helpers (exec'd) ---- */

typedef struct helper {
  const char *dir, *transports, *name, *topic;
  uint64_t count;
  tu_pipe p; /* to the parent (wr), from the parent (rd) */
} helper;

/* Publishes messages 1..count on topic once n subscribers are there. */
static int pub_main(helper *h, size_t n) {
  ferry_ctx *c = ctx_open(h->name, h->transports);
  ferry_mq *mq = mq_open(c, h->dir, 0);
  uint8_t *buf = malloc(300000);
  int rc = ferry_mq_wait_subscribers(mq, h->topic, n, 20000);
  for (uint64_t k = 1; rc == 0 && k <= h->count; k++) {
    fill(buf, k, size_of(k));
    rc = ferry_mq_publish(mq, h->topic, buf, size_of(k), 20000);
  }
  if (rc != 0)
    fprintf(stderr, "pub: %s: %s\n", ferry_strerror(rc), ferry_last_error());
  uint8_t done = 1;
  tu_pipe_put(&h->p, &done, 1);
  tu_pipe_get(&h->p, &done, 1, 60000); /* stay until the parent read everything */
  free(buf);
  ferry_mq_close(mq);
  ferry_ctx_close(c);
  return rc == 0 ? 0 : 1;
}

/* Subscribes, says so, then receives: messages must come in order with no gap from the first
 * one it got; reports how many it got (u64) when `count` arrived or the parent says stop. */
static int sub_main(helper *h, bool slow) {
  ferry_ctx *c = ctx_open(h->name, h->transports);
  ferry_mq *mq = mq_open(c, h->dir, slow ? 65536 : 0);
  FR_OK(ferry_mq_subscribe(mq, h->topic, 20000));
  uint8_t ready = 1;
  tu_pipe_put(&h->p, &ready, 1);
  if (slow) /* hold everything back until the parent says go */
    tu_pipe_get(&h->p, &ready, 1, 60000);
  uint64_t got = 0, last = 0;
  int bad = 0;
  while (got < h->count) {
    ferry_mq_msg *m;
    int rc = ferry_mq_recv(mq, &m, 30000);
    if (rc != 0) {
      fprintf(stderr, "sub %s: %s\n", h->name, ferry_last_error());
      bad = 1;
      break;
    }
    uint64_t k = 0;
    if (!check(m, &k) || (last && k != last + 1) || strcmp(m->topic, h->topic) != 0) {
      fprintf(stderr, "sub %s: message %llu after %llu is wrong\n", h->name, (unsigned long long)k,
              (unsigned long long)last);
      bad = 1;
    }
    last = k;
    got++;
    ferry_mq_msg_free(m);
    if (slow && got % 50 == 0)
      usleep(2000); /* a slow consumer */
  }
  tu_pipe_put(&h->p, &got, sizeof got);
  ferry_mq_close(mq);
  ferry_ctx_close(c);
  return bad;
}

/* The subscriber the killed case kills: subscribes, says so, receives message 0, says so, then
 * waits to be killed. Receiving it proves the publisher's endpoint to it is wired up (see
 * killed_subscriber). */
static int victim_main(helper *h) {
  ferry_ctx *c = ctx_open(h->name, h->transports);
  ferry_mq *mq = mq_open(c, h->dir, 65536); /* a small queue, as the slow subscriber's */
  FR_OK(ferry_mq_subscribe(mq, h->topic, 20000));
  uint8_t b = 1;
  tu_pipe_put(&h->p, &b, 1);
  ferry_mq_msg *m = NULL;
  uint64_t k = 1;
  if (ferry_mq_recv(mq, &m, 30000) == 0 && check(m, &k) && k == 0)
    tu_pipe_put(&h->p, &b, 1);
  else
    fprintf(stderr, "victim: no message 0: %s\n", ferry_last_error());
  ferry_mq_msg_free(m);
  tu_pipe_get(&h->p, &b, 1, 60000); /* the parent kills it first */
  return 1;
}

/* ---- the parent's side ---- */

typedef struct child {
  pid_t pid;
  tu_pipe to, from;
} child;

static void spawn(child *ch, const char *role, const char *dir, const char *name, const char *topic,
                  uint64_t count, const char *extra) {
  tu_pipe_open(&ch->to);
  tu_pipe_open(&ch->from);
  char rd[16], wr[16], cnt[32];
  snprintf(rd, sizeof rd, "%d", ch->to.rd);
  snprintf(wr, sizeof wr, "%d", ch->from.wr);
  snprintf(cnt, sizeof cnt, "%llu", (unsigned long long)count);
  ch->pid = tu_spawn_exec(role, dir, suite_transports, name, topic, cnt, rd, wr, extra, NULL);
}

static void child_done(child *ch) {
  tu_pipe_close(&ch->to);
  tu_pipe_close(&ch->from);
}

/* A publisher child sends 1..N; the parent receives them in order with the right bytes. */
static void ordering(void) {
  ferry_ctx *c = ctx_open("mq-parent", suite_transports);
  ferry_mq *mq = mq_open(c, NULL, 0);
  char dir[128];
  dir_url(c, dir, sizeof dir);
  FR_OK(ferry_mq_subscribe(mq, "ordered", 5000));
  child pub;
  const uint64_t n = 700 / SCALE;
  spawn(&pub, "--pub", dir, "mq-pub", "ordered", n, "1");
  for (uint64_t want = 1; want <= n; want++) {
    ferry_mq_msg *m;
    FR_OK(ferry_mq_recv(mq, &m, 30000));
    uint64_t k = 0;
    assert_true(check(m, &k));
    assert_int_equal(k, want);
    assert_string_equal(m->topic, "ordered");
    assert_string_equal(m->publisher, "mq-pub");
    assert_false(m->is_tensor);
    ferry_mq_msg_free(m);
  }
  uint8_t b = 1;
  tu_pipe_put(&pub.to, &b, 1);
  assert_int_equal(tu_wait(pub.pid), 0);
  child_done(&pub);
  ferry_mq_close(mq);
  ferry_ctx_close(c);
}

/* A subscriber that does not read: publishes fill its queue, then one times out naming it and
 * reaches nobody; when it reads again it gets every message that was accepted, in order. */
static void slow_subscriber(void) {
  ferry_ctx *c = ctx_open("mq-parent", suite_transports);
  ferry_mq *mq = mq_open(c, NULL, 0);
  char dir[128];
  dir_url(c, dir, sizeof dir);
  child sub;
  spawn(&sub, "--sub", dir, "mq-slow", "busy", 0, "slow");
  uint8_t b;
  assert_int_equal(tu_pipe_get(&sub.from, &b, 1, 30000), 0);
  FR_OK(ferry_mq_wait_subscribers(mq, "busy", 1, 20000));
  uint8_t buf[4096];
  uint64_t k = 0;
  int rc = 0;
  while (rc == 0 && k < 1000) { /* 64 KiB of credit: the queue fills long before 1000 */
    fill(buf, k + 1, size_of(k + 1) > sizeof buf ? 8 : size_of(k + 1));
    rc = ferry_mq_publish(mq, "busy", buf, size_of(k + 1) > sizeof buf ? 8 : size_of(k + 1), 1000);
    k += rc == 0;
  }
  assert_int_equal(rc, FERRY_ETIMEDOUT);
  assert_non_null(strstr(ferry_last_error(), "mq-slow"));
  assert_true(k > 0 && k < 1000);
  (void)sub;
  /* the child checks sizes by k, so it is told to stop at exactly k: it reads k messages */
  kill(sub.pid, SIGKILL);
  tu_wait(sub.pid);
  child_done(&sub);
  ferry_mq_close(mq);
  ferry_ctx_close(c);
}

/* No loss behind a slow consumer: a publisher sends 1..N to a subscriber with a small queue
 * that reads slowly; every message arrives, in order. */
static void no_loss(void) {
  ferry_ctx *c = ctx_open("mq-parent", suite_transports);
  ferry_mq *mq = mq_open(c, NULL, 0);
  char dir[128];
  dir_url(c, dir, sizeof dir);
  const uint64_t n = 400 / SCALE;
  child sub, pub;
  spawn(&sub, "--sub", dir, "mq-slow", "flow", n, "slow");
  uint8_t b = 1;
  assert_int_equal(tu_pipe_get(&sub.from, &b, 1, 30000), 0);
  spawn(&pub, "--pub", dir, "mq-pub", "flow", n, "1");
  assert_int_equal(tu_pipe_get(&pub.from, &b, 1, 1000) != 0, 1); /* it cannot be done yet */
  tu_pipe_put(&sub.to, &b, 1);                                   /* go */
  uint64_t got = 0;
  assert_int_equal(tu_pipe_get(&sub.from, &got, sizeof got, 120000), 0);
  assert_int_equal(got, n);
  assert_int_equal(tu_wait(sub.pid), 0);
  tu_pipe_put(&pub.to, &b, 1);
  assert_int_equal(tu_wait(pub.pid), 0);
  child_done(&sub);
  child_done(&pub);
  ferry_mq_close(mq);
  ferry_ctx_close(c);
}

/* Two subscribers; one is SIGKILLed. The publisher's next publishes report it (FERRY_EPEER,
 * named), drop it, and go on; the other subscriber gets every message.
 * The kill comes once the victim received message 0 (so the other one counts 0..n): before
 * that, the publisher's link to it may still be wiring up its UCX endpoint, and UCX 1.13's tcp
 * transport aborts the process that makes an endpoint to a peer that just died (its own
 * assertion, tcp_ep.c:478 "!(ep->flags & UCT_TCP_EP_FLAG_CTX_TYPE_TX)": the endpoint takes over
 * the connection the dead peer made to it, its connection request there fails, and it is marked
 * failed before it gets its send side). The case is about a subscriber dying on a working link. */
static void killed_subscriber(void) {
  ferry_ctx *c = ctx_open("mq-parent", suite_transports);
  ferry_mq *mq = mq_open(c, NULL, 0);
  char dir[128];
  dir_url(c, dir, sizeof dir);
  const uint64_t n = 300 / SCALE;
  child a, v;
  spawn(&a, "--sub", dir, "mq-alive", "fan", n + 1, "fast");
  spawn(&v, "--victim", dir, "mq-victim", "fan", 1, "-");
  uint8_t b;
  assert_int_equal(tu_pipe_get(&a.from, &b, 1, 30000), 0);
  assert_int_equal(tu_pipe_get(&v.from, &b, 1, 30000), 0);
  FR_OK(ferry_mq_wait_subscribers(mq, "fan", 2, 20000));
  uint8_t buf[300000];
  fill(buf, 0, size_of(0));
  FR_OK(ferry_mq_publish(mq, "fan", buf, size_of(0), 20000));
  assert_int_equal(tu_pipe_get(&v.from, &b, 1, 30000), 0); /* it has message 0 */
  kill(v.pid, SIGKILL);
  assert_int_equal(tu_wait(v.pid), 128 + SIGKILL);
  bool reported = false;
  for (uint64_t k = 1; k <= n; k++) {
    fill(buf, k, size_of(k));
    int rc = ferry_mq_publish(mq, "fan", buf, size_of(k), 20000);
    if (rc == FERRY_EPEER) {
      assert_false(reported);
      assert_non_null(strstr(ferry_last_error(), "mq-victim"));
      reported = true;
    } else {
      FR_OK(rc);
    }
  }
  assert_true(reported);
  assert_int_equal(ferry_mq_subscribers(mq, "fan"), 1);
  uint64_t got = 0;
  assert_int_equal(tu_pipe_get(&a.from, &got, sizeof got, 60000), 0);
  assert_int_equal(got, n + 1);
  assert_int_equal(tu_wait(a.pid), 0);
  child_done(&a);
  child_done(&v);
  ferry_mq_close(mq);
  ferry_ctx_close(c);
}

/* A subscriber (exec'd) that joins a running stream, checks contiguity for `count` messages,
 * then leaves by unsubscribing (even count) or closing (odd). */
static int joiner_main(helper *h) {
  ferry_ctx *c = ctx_open(h->name, h->transports);
  ferry_mq *mq = mq_open(c, h->dir, 0);
  FR_OK(ferry_mq_subscribe(mq, h->topic, 20000));
  uint64_t got = 0, last = 0;
  int bad = 0;
  while (got < h->count && !bad) {
    ferry_mq_msg *m;
    if (ferry_mq_recv(mq, &m, 30000) != 0) {
      bad = 1;
      break;
    }
    uint64_t k = 0;
    if (!check(m, &k) || (last && k != last + 1))
      bad = 1;
    last = k;
    got++;
    ferry_mq_msg_free(m);
  }
  if (h->count % 2 == 0)
    FR_OK(ferry_mq_unsubscribe(mq, h->topic, 5000));
  tu_pipe_put(&h->p, &got, sizeof got);
  ferry_mq_close(mq);
  ferry_ctx_close(c);
  return bad;
}

/* Subscribers join and leave while the parent publishes without pause. */
static void join_leave(void) {
  ferry_ctx *c = ctx_open("mq-parent", suite_transports);
  ferry_mq *mq = mq_open(c, NULL, 0);
  char dir[128];
  dir_url(c, dir, sizeof dir);
  enum { N = 4 };
  child ch[N];
  bool done[N] = {false};
  int started = 0, finished = 0;
  uint8_t buf[300000];
  for (uint64_t k = 1; finished < N; k++) {
    if (k % 150 == 0 && started < N) {
      char name[32];
      snprintf(name, sizeof name, "mq-joiner-%d", started);
      spawn(&ch[started], "--join", dir, name, "stream", 200 / SCALE + (uint64_t)started, "x");
      started++;
    }
    fill(buf, k, size_of(k));
    int rc = ferry_mq_publish(mq, "stream", buf, size_of(k), 20000);
    assert_true(rc == 0 || rc == FERRY_EPEER); /* a closing joiner may go between two sends */
    for (int i = 0; i < started; i++) {
      uint64_t got;
      if (!done[i] && tu_pipe_get(&ch[i].from, &got, sizeof got, 0) == 0) {
        assert_int_equal(got, 200 / SCALE + (uint64_t)i);
        assert_int_equal(tu_wait(ch[i].pid), 0);
        child_done(&ch[i]);
        done[i] = true;
        finished++;
      }
    }
    assert_true(k < 10000000);
  }
  ferry_mq_close(mq);
  ferry_ctx_close(c);
}

/* Writes into batch (zeroed, 256 bytes or more) a BATCH frame of two DATA frames: seq 1 on t1
 * carrying the n bytes at p, then seq 2 on t2, empty. Returns the batch's length; *gap is the
 * first zero padding byte after the first payload. */
static size_t two_message_batch(uint8_t *batch, const char *t1, const char *p, size_t n,
                                const char *t2, size_t *gap) {
  fr_mq_frame d1 = {.type = FR_MQ_DATA, .seq = 1, .len = n, .topic = t1, .topic_len = strlen(t1)};
  size_t p1 = FR_MQ_ALIGN, h1 = fr_mq_encode(&d1, batch + p1);
  memcpy(batch + p1 + h1, p, n);
  *gap = p1 + h1 + n;
  size_t p2 = (p1 + h1 + n + FR_MQ_ALIGN - 1) / FR_MQ_ALIGN * FR_MQ_ALIGN;
  fr_mq_frame d2 = {.type = FR_MQ_DATA, .seq = 2, .len = 0, .topic = t2, .topic_len = strlen(t2)};
  size_t h2 = fr_mq_encode(&d2, batch + p2);
  fr_mq_frame bf = {.type = FR_MQ_BATCH, .len = p2 + h2 - FR_MQ_ALIGN};
  assert_int_equal(fr_mq_encode(&bf, batch), FR_MQ_ALIGN);
  return p2 + h2;
}

/* A BATCH of two messages on topic "t" whose second one has padding that is not zero. */
static void send_bad_batch(ferry_link *l) {
  uint8_t batch[256];
  memset(batch, 0, sizeof batch);
  size_t gap, len = two_message_batch(batch, "t", "early", 5, "t", &gap);
  batch[len - 1] = 1;
  struct iovec iov = {batch, len};
  FR_OK(ferry_send(l, FR_CHANNEL_MQ, &iov, 1, 5000));
}

/* Garbage on the mq channel is dropped (and counted); the mq goes on. */
static void malformed(void) {
  ferry_ctx *c = ctx_open("mq-parent", suite_transports);
  ferry_mq *mq = mq_open(c, NULL, 0);
  char dir[128];
  dir_url(c, dir, sizeof dir);
  FR_OK(ferry_mq_subscribe(mq, "t", 5000));
  ferry_ctx *evil = ctx_open("mq-evil", suite_transports);
  ferry_link *l;
  FR_OK(ferry_connect(evil, ferry_ctx_address(c), 5000, &l));
  uint8_t junk[100];
  memset(junk, 0xab, sizeof junk);
  struct iovec iov = {junk, sizeof junk};
  FR_OK(ferry_send(l, FR_CHANNEL_MQ, &iov, 1, 5000));
  fr_mq_frame f = {.type = FR_MQ_DATA, .seq = 1, .len = 8, .topic = "t", .topic_len = 1};
  uint8_t head[FR_MQ_HEAD_MAX], body[8] = "payload";
  size_t hl = fr_mq_encode(&f, head);
  head[hl - 1] = 1; /* non-zero padding */
  struct iovec bad[2] = {{head, hl}, {body, 8}};
  FR_OK(ferry_send(l, FR_CHANNEL_MQ, bad, 2, 5000));
  send_bad_batch(l); /* its first message is fine, its second not: none is delivered */
  head[hl - 1] = 0;  /* now a well-formed message from a node that is no publisher: fine */
  FR_OK(ferry_send(l, FR_CHANNEL_MQ, bad, 2, 5000));
  ferry_mq_msg *m;
  FR_OK(ferry_mq_recv(mq, &m, 10000));
  assert_int_equal(m->len, 8);
  assert_memory_equal(m->data, "payload", 8);
  assert_string_equal(m->publisher, "mq-evil");
  ferry_mq_msg_free(m);
  pthread_mutex_lock(&mq->lock);
  assert_int_equal(mq->malformed, 3);
  pthread_mutex_unlock(&mq->lock);
  ferry_link_close(l);
  ferry_ctx_close(evil);
  ferry_mq_close(mq);
  ferry_ctx_close(c);
}

/* In one process: tensors keep dtype and shape, callbacks run on the mq's thread,
 * wait_subscribers times out cleanly, argument errors. */
typedef struct cb_state {
  pthread_mutex_t lock;
  int n;
  pthread_t thread;
  bool other_thread;
} cb_state;

static void on_msg(ferry_mq *mq, ferry_mq_msg *m, void *arg) {
  cb_state *s = arg;
  pthread_mutex_lock(&s->lock);
  s->n++;
  s->other_thread |= !pthread_equal(pthread_self(), s->thread);
  pthread_mutex_unlock(&s->lock);
  ferry_mq_msg_free(m);
}

/* mq's discovery records share the directory with the store's objects but are ferry's own: a
 * store neither lists nor clears them, and a new publisher still finds the subscriber. */
static void store_leaves_mq_records(ferry_ctx *c, const char *dir) {
  ferry_store_opts so = {.size = sizeof so, .directory = dir, .capacity = 1 << 20};
  ferry_store *st;
  FR_OK(ferry_store_open(c, &so, &st));
  ferry_store_info *list;
  size_t n = 1, deleted = 1;
  FR_OK(ferry_store_list(st, "", &list, &n, 5000));
  ferry_store_list_free(list);
  assert_int_equal(n, 0);
  FR_OK(ferry_store_clear(st, &deleted, 5000));
  assert_int_equal(deleted, 0);
  ferry_store_close(st);
  ferry_ctx *cc = ctx_open("mq-c", suite_transports);
  ferry_mq *late = mq_open(cc, dir, 0);
  FR_OK(ferry_mq_wait_subscribers(late, "tensors", 1, 5000));
  ferry_mq_close(late);
  ferry_ctx_close(cc);
}

static void in_process(void) {
  ferry_ctx *ca = ctx_open("mq-a", suite_transports), *cb = ctx_open("mq-b", suite_transports);
  ferry_mq *a = mq_open(ca, NULL, 0);
  char dir[128];
  dir_url(ca, dir, sizeof dir);
  ferry_mq *b = mq_open(cb, dir, 0);
  ferry_mq_opts twice = {.size = sizeof twice, .directory = dir};
  ferry_mq *dup = NULL; /* the mq owns its ctx's channel: one per ctx */
  assert_int_equal(ferry_mq_open(cb, &twice, &dup), FERRY_EBUSY);
  assert_null(dup);
  assert_non_null(strstr(ferry_last_error(), "has an mq already"));
  assert_int_equal(ferry_mq_subscribe(b, "", 1000), FERRY_EINVAL);
  assert_int_equal(ferry_mq_unsubscribe(b, "never", 1000), FERRY_ENOTFOUND);
  assert_int_equal(ferry_mq_wait_subscribers(a, "tensors", 1, 50), FERRY_ETIMEDOUT);
  FR_OK(ferry_mq_subscribe(b, "tensors", 5000));
  FR_OK(ferry_mq_subscribe(b, "tensors", 5000)); /* twice: a no-op */
  FR_OK(ferry_mq_wait_subscribers(a, "tensors", 1, 5000));
  store_leaves_mq_records(cb, dir);
  float x[2][3] = {{1, 2, 3}, {4, 5, 6}};
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_F32, .ndim = 2, .shape = {2, 3}};
  FR_OK(ferry_mq_publish_tensor(a, "tensors", &d, x, 5000));
  ferry_mq_msg *m;
  FR_OK(ferry_mq_recv(b, &m, 5000));
  assert_true(m->is_tensor);
  assert_int_equal(m->desc.dtype, FERRY_DTYPE_F32);
  assert_int_equal(m->desc.ndim, 2);
  assert_int_equal(m->desc.shape[1], 3);
  assert_memory_equal(m->data, x, sizeof x);
  assert_int_equal((uintptr_t)m->data % 16, 0);
  ferry_mq_msg_free(m);
  ferry_tensor_desc bad = {.dtype = FERRY_DTYPE_INVALID, .ndim = 1, .shape = {2}};
  assert_int_equal(ferry_mq_publish_tensor(a, "tensors", &bad, x, 1000), FERRY_EDTYPE);
  assert_int_equal(ferry_mq_recv(b, &m, 0), FERRY_ETIMEDOUT);
  cb_state s = {.lock = PTHREAD_MUTEX_INITIALIZER, .thread = pthread_self()};
  FR_OK(ferry_mq_set_callback(b, on_msg, &s));
  assert_int_equal(ferry_mq_recv(b, &m, 0), FERRY_EBUSY);
  for (int i = 0; i < 20; i++)
    FR_OK(ferry_mq_publish(a, "tensors", x, sizeof x, 5000));
  for (int i = 0; i < 3000; i++) { /* bounded wait for the callbacks; no timing asserted */
    pthread_mutex_lock(&s.lock);
    int n = s.n;
    pthread_mutex_unlock(&s.lock);
    if (n == 20)
      break;
    usleep(10000);
  }
  pthread_mutex_lock(&s.lock);
  assert_int_equal(s.n, 20);
  assert_true(s.other_thread);
  pthread_mutex_unlock(&s.lock);
  FR_OK(ferry_mq_set_callback(b, NULL, NULL));
  FR_OK(ferry_mq_unsubscribe(b, "tensors", 5000));
  FR_OK(ferry_mq_publish(a, "tensors", x, sizeof x, 5000)); /* goes nowhere */
  ferry_mq_close(b);
  ferry_mq_close(a);
  ferry_ctx_close(cb);
  ferry_ctx_close(ca);
  ferry_mq_close(NULL);
}

/* Publishes 64-byte messages first..last on `topic`, each carrying its number. */
static void stream_publish(ferry_mq *mq, const char *topic, uint64_t first, uint64_t last) {
  uint64_t word[8] = {0};
  for (word[0] = first; word[0] <= last; word[0]++)
    FR_OK(ferry_mq_publish(mq, topic, word, sizeof word, 5000));
}

/* Receives the messages first..last, in order. */
static void stream_expect(ferry_mq *mq, uint64_t first, uint64_t last) {
  for (uint64_t k = first; k <= last; k++) {
    ferry_mq_msg *m;
    uint64_t word[8];
    FR_OK(ferry_mq_recv(mq, &m, 10000));
    assert_int_equal(m->len, sizeof word);
    memcpy(word, m->data, sizeof word);
    assert_int_equal(word[0], k);
    ferry_mq_msg_free(m);
  }
}

/* A publisher `a` (which hosts the directory) and two subscribers' nodes `b` and `c`; b has
 * subscribed to `topic` and a knows it. */
typedef struct trio {
  ferry_ctx *ca, *cb, *cc;
  ferry_mq *a, *b, *c;
} trio;

static void trio_open(trio *t, const char *topic) {
  t->ca = ctx_open("mq-a", suite_transports);
  t->cb = ctx_open("mq-b", suite_transports);
  t->cc = ctx_open("mq-c", suite_transports);
  t->a = mq_open(t->ca, NULL, 0);
  char dir[128];
  dir_url(t->ca, dir, sizeof dir);
  t->b = mq_open(t->cb, dir, 0);
  t->c = mq_open(t->cc, dir, 0);
  FR_OK(ferry_mq_subscribe(t->b, topic, 5000));
  FR_OK(ferry_mq_wait_subscribers(t->a, topic, 1, 5000));
}

static void trio_close(trio *t) { /* the mqs still open (a first), then the ctxs */
  ferry_mq_close(t->a);
  ferry_mq_close(t->c);
  ferry_mq_close(t->b);
  ferry_ctx_close(t->cc);
  ferry_ctx_close(t->cb);
  ferry_ctx_close(t->ca);
}

/* A stream of small messages that fills several batches and stops: every message arrives, in
 * order, the tail of the stream too with no later publish or close to push it out (the
 * background thread sends the last, part-full batch; a full one sent before it moved its time
 * on). A subscriber that joins in the middle of a stream gets what is published after its
 * subscribe returned, one that leaves stops getting it, and the others miss nothing meanwhile
 * (a publish in a stream reuses the previous one's subscribers until they change). The
 * publisher closes while a batch may be pending: close sends it. */
static void stream_tail(void) {
  trio t;
  trio_open(&t, "tail");
  ferry_mq *a = t.a, *b = t.b, *c = t.c;
  stream_publish(a, "tail", 1, 3000); /* over ten 32 KiB batches */
  stream_expect(b, 1, 3000);
  stream_publish(a, "tail", 3001, 3500);
  FR_OK(ferry_mq_subscribe(c, "tail", 5000)); /* joins while a batch is pending */
  stream_publish(a, "tail", 3501, 4000);
  stream_expect(c, 3501, 4000);
  FR_OK(ferry_mq_unsubscribe(c, "tail", 5000));
  stream_publish(a, "tail", 4001, 4500);
  stream_expect(b, 3001, 4500);
  ferry_mq_msg *m;
  assert_int_equal(ferry_mq_recv(c, &m, 200), FERRY_ETIMEDOUT);
  stream_publish(a, "tail", 4501, 4600); /* a batch likely pending as a closes */
  ferry_mq_close(a);
  t.a = NULL;
  stream_expect(b, 4501, 4600);
  trio_close(&t);
}

/* A publisher thread that streams 64-byte messages 1, 2, ... until told to stop (or
 * STREAM_MAX). It yields every 64 messages, which keeps them a stream (well within 20 us of each
 * other) but lets the node's other threads run: flat out on 2 cores, under TSan and over ucx, it
 * starved the directory and the subscriber of the process for over 10 s. */
#define STREAM_MAX 50000
typedef struct streamer {
  ferry_mq *mq;
  uint64_t published; /* the last number whose publish returned (atomic) */
  bool stop;          /* (atomic) */
} streamer;

static void *stream_main(void *arg) {
  streamer *s = arg;
  uint64_t word[8] = {0};
  for (word[0] = 1; word[0] <= STREAM_MAX && !__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE);
       word[0]++) {
    FR_OK(ferry_mq_publish(s->mq, "joined", word, sizeof word, 5000));
    if (word[0] % 64 == 0)
      sched_yield();
    __atomic_store_n(&s->published, word[0], __ATOMIC_RELEASE);
  }
  return NULL;
}

/* A subscriber that joins while another thread streams (batches pending the whole time) gets
 * every message published after its subscribe returned, with no gap, to the end. */
static void stream_join(void) {
  trio t;
  trio_open(&t, "joined");
  ferry_mq *a = t.a, *b = t.b, *c = t.c;
  streamer s = {.mq = a};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, stream_main, &s), 0);
  while (__atomic_load_n(&s.published, __ATOMIC_ACQUIRE) < 1000) /* the stream is under way */
    usleep(100);
  FR_OK(ferry_mq_subscribe(c, "joined", 5000));
  uint64_t joined = __atomic_load_n(&s.published, __ATOMIC_ACQUIRE);
  ferry_mq_msg *m;
  uint64_t word[8], first = 0;
  if (joined < STREAM_MAX) { /* else the stream ended before: nothing to check */
    FR_OK(ferry_mq_recv(c, &m, 10000));
    memcpy(word, m->data, sizeof word);
    first = word[0];
    ferry_mq_msg_free(m);
    assert_true(first <= joined + 2); /* joined + 1 may have been in flight */
  }
  __atomic_store_n(&s.stop, true, __ATOMIC_RELEASE);
  pthread_join(th, NULL);
  uint64_t last = __atomic_load_n(&s.published, __ATOMIC_ACQUIRE);
  if (first)
    stream_expect(c, first + 1, last);
  stream_expect(b, 1, last);
  trio_close(&t);
}

/* Loans: messages built in the pool and published without a copy (shm subscribers read the
 * block in place, tcp ones get it inline); a block a subscriber still holds is not lent again;
 * a full pool makes a loan wait and time out; a loan is handed back exactly once. */
static void *loan_msg(ferry_mq *a, uint64_t k, size_t len) {
  void *buf = NULL;
  FR_OK(ferry_mq_loan(a, len, &buf, 5000));
  assert_int_equal((uintptr_t)buf % 64, 0);
  fill(buf, k, len);
  return buf;
}

static void loans_errors(ferry_mq *a) {
  void *buf = NULL, *more = NULL;
  uint8_t x[16];
  assert_int_equal(ferry_mq_loan(a, 0, &buf, 0), FERRY_EINVAL);
  assert_int_equal(ferry_mq_loan(a, a->pool_bytes + 1, &buf, 0), FERRY_EINVAL);
  assert_int_equal(ferry_mq_publish_loan(a, "loans", NULL, x, sizeof x, 1000), FERRY_EINVAL);
  FR_OK(ferry_mq_loan(a, a->pool_bytes, &buf, 1000)); /* all of it: the next one must wait */
  assert_int_equal(ferry_mq_loan(a, 4096, &more, 50), FERRY_ETIMEDOUT);
  assert_int_equal(ferry_mq_publish_loan(a, "loans", NULL, buf, a->pool_bytes + 1, 1000),
                   FERRY_EINVAL); /* more than lent: refused, and the loan is gone */
  assert_int_equal(ferry_mq_publish_loan(a, "loans", NULL, buf, 8, 1000), FERRY_EINVAL);
  FR_OK(ferry_mq_loan(a, 4096, &more, 1000));
  ferry_mq_loan_free(a, more);
  ferry_mq_loan_free(a, more); /* no longer a loan: ignored */
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_F32, .ndim = 1, .shape = {3}};
  FR_OK(ferry_mq_loan(a, 16, &buf, 1000));
  assert_int_equal(ferry_mq_publish_loan(a, "loans", &d, buf, 16, 1000), FERRY_EINVAL);
}

static void loans(void) {
  ferry_ctx *ca = ctx_open("mq-a", suite_transports), *cb = ctx_open("mq-b", suite_transports);
  ferry_mq *a = mq_open(ca, NULL, 0);
  char dir[128];
  dir_url(ca, dir, sizeof dir);
  ferry_mq *b = mq_open(cb, dir, 0);
  FR_OK(ferry_mq_subscribe(b, "loans", 5000));
  FR_OK(ferry_mq_wait_subscribers(a, "loans", 1, 5000));
  loans_errors(a);
  ferry_mq_msg *held, *m;
  FR_OK(ferry_mq_publish_loan(a, "loans", NULL, loan_msg(a, 0, 300000), 300000, 5000));
  FR_OK(ferry_mq_recv(b, &held, 5000)); /* kept while later loans are made and published */
  size_t n = 40 / SCALE;
  for (uint64_t k = 1; k <= n; k++) {
    size_t len = k % 2 ? 300000 : 8;
    ferry_tensor_desc d = {.dtype = FERRY_DTYPE_U8, .ndim = 2, .shape = {len / 8, 8}};
    FR_OK(ferry_mq_publish_loan(a, "loans", k % 3 ? NULL : &d, loan_msg(a, k, len), len, 5000));
    FR_OK(ferry_mq_recv(b, &m, 5000));
    uint64_t got = 0;
    assert_true(m->len == len && m->len >= 8);
    memcpy(&got, m->data, 8);
    assert_int_equal(got, k);
    assert_int_equal(m->is_tensor, k % 3 == 0);
    uint8_t *want = malloc(len);
    fill(want, k, len);
    assert_memory_equal(m->data, want, len);
    free(want);
    ferry_mq_msg_free(m);
  }
  uint64_t k0 = 1;
  assert_true(held->len == 300000);
  uint8_t *want = malloc(300000);
  fill(want, 0, 300000);
  assert_memory_equal(held->data, want, 300000); /* its block was not lent again */
  memcpy(&k0, held->data, 8);
  assert_int_equal(k0, 0);
  free(want);
  ferry_mq_msg_free(held);
  ferry_mq_close(b);
  ferry_mq_close(a);
  ferry_ctx_close(cb);
  ferry_ctx_close(ca);
}

static void *kill_soon(void *arg) {
  usleep(200000); /* most likely once the publish waits; before is fine too */
  kill(*(pid_t *)arg, SIGKILL);
  return NULL;
}

/* A publish waiting for credit from a subscriber that dies meanwhile goes on and reports the
 * subscriber gone (FERRY_EPEER, dropped). The link's death wakes it (no periodic check): were
 * it not woken, it would wait out its 60 s deadline first (not asserted: a timing; this case
 * then takes a minute instead of a second). */
static void dead_while_waiting(void) {
  ferry_ctx *c = ctx_open("mq-parent", suite_transports);
  ferry_mq *mq = mq_open(c, NULL, 0);
  char dir[128];
  dir_url(c, dir, sizeof dir);
  child sub;
  spawn(&sub, "--sub", dir, "mq-stuck", "stuck", 0, "slow");
  uint8_t b, buf[4096] = {0};
  assert_int_equal(tu_pipe_get(&sub.from, &b, 1, 30000), 0);
  FR_OK(ferry_mq_wait_subscribers(mq, "stuck", 1, 20000));
  /* The first message with time to spare: over ucx it waits for the link's endpoints to wire up
   * (a round trip through both workers), which a loaded machine took over 200 ms to do. */
  FR_OK(ferry_mq_publish(mq, "stuck", buf, sizeof buf, 20000));
  int rc = 0;
  for (int k = 0; rc == 0 && k < 1000; k++) /* 64 KiB of credit: full long before 1000 */
    rc = ferry_mq_publish(mq, "stuck", buf, sizeof buf, 200);
  assert_int_equal(rc, FERRY_ETIMEDOUT);
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, kill_soon, &sub.pid), 0);
  rc = ferry_mq_publish(mq, "stuck", buf, sizeof buf, 60000);
  assert_int_equal(rc, FERRY_EPEER);
  assert_non_null(strstr(ferry_last_error(), "mq-stuck"));
  pthread_join(t, NULL);
  assert_int_equal(tu_wait(sub.pid), 128 + SIGKILL);
  child_done(&sub);
  assert_int_equal(ferry_mq_subscribers(mq, "stuck"), 0);
  ferry_mq_close(mq);
  ferry_ctx_close(c);
}

typedef struct blocked_recv {
  ferry_mq *mq;
  int rc;
} blocked_recv;

static void *recv_blocked(void *arg) {
  blocked_recv *r = arg;
  ferry_mq_msg *m = NULL;
  r->rc = ferry_mq_recv(r->mq, &m, 20000);
  if (r->rc == 0)
    ferry_mq_msg_free(m);
  return NULL;
}

/* An idle mq sleeps: a publisher and a subscriber of one topic (this process, two contexts),
 * past their first message, with nothing to send, wake only for their timers (the lease) and
 * the context's own. At most 10 wake-ups a second on average over 3 s, for the whole process
 * (the pump's 20 ms checks and the background thread's turns made it 45-55). A count, not a
 * timing: a slow machine only makes it wake less. */
static void idle_sleeps(void) {
  ferry_ctx *ca = ctx_open("mq-idle-pub", suite_transports);
  ferry_ctx *cb = ctx_open("mq-idle-sub", suite_transports);
  ferry_mq *a = mq_open(ca, NULL, 0);
  char dir[128];
  dir_url(ca, dir, sizeof dir);
  ferry_mq *b = mq_open(cb, dir, 0);
  FR_OK(ferry_mq_subscribe(b, "idle", 5000));
  FR_OK(ferry_mq_wait_subscribers(a, "idle", 1, 5000));
  uint8_t buf[64] = {1};
  FR_OK(ferry_mq_publish(a, "idle", buf, sizeof buf, 5000));
  ferry_mq_msg *m;
  FR_OK(ferry_mq_recv(b, &m, 5000));
  ferry_mq_msg_free(m);
  usleep(1000000); /* what the exchange left to settle (credit, the stream's end) */
  long before = tu_wakeups(getpid(), NULL);
  usleep(3000000);
  long after = tu_wakeups(getpid(), NULL);
  assert_true(before >= 0 && after >= before);
  fprintf(stderr, "idle mq (%s): %ld wake-ups in 3 s\n", suite_transports, after - before);
  assert_true(after - before <= IDLE_WAKEUPS_MAX);
  /* A thread blocked in a long recv holds the lead of its context: the progress thread parks
   * behind it instead of checking every FERRY_PROGRESS_GRACE_US (300 a second before). */
  blocked_recv r = {b, -1};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, recv_blocked, &r), 0);
  usleep(500000);
  before = tu_wakeups(getpid(), NULL);
  usleep(3000000);
  after = tu_wakeups(getpid(), NULL);
  fprintf(stderr, "idle mq (%s), a thread blocked in recv: %ld wake-ups in 3 s\n", suite_transports,
          after - before);
  assert_true(after - before <= IDLE_WAKEUPS_MAX);
  FR_OK(ferry_mq_publish(a, "idle", buf, sizeof buf, 5000)); /* and it still works: wakes it */
  pthread_join(t, NULL);
  FR_OK(r.rc);
  ferry_mq_close(b);
  ferry_mq_close(a);
  ferry_ctx_close(cb);
  ferry_ctx_close(ca);
}

/* ---- the wire decoder ---- */

static void test_wire(void **st) {
  uint8_t buf[FR_MQ_HEAD_MAX + 64];
  fr_mq_frame f = {.type = FR_MQ_DATA,
                   .flags = FR_MQ_F_TENSOR,
                   .seq = 7,
                   .len = 24,
                   .value = 152,
                   .topic = "a/b",
                   .topic_len = 3,
                   .desc = {.dtype = FERRY_DTYPE_F64, .ndim = 1, .shape = {3}}};
  size_t hl = fr_mq_encode(&f, buf);
  assert_int_equal(hl % FR_MQ_ALIGN, 0);
  memset(buf + hl, 0x11, 24);
  fr_mq_frame g;
  FR_OK(fr_mq_decode(buf, hl + 24, &g));
  assert_int_equal(g.seq, 7);
  assert_string_equal(g.topic, "a/b");
  assert_int_equal(g.desc.shape[0], 3);
  assert_ptr_equal(g.payload, buf + hl);
  for (size_t cut = 0; cut < hl + 24; cut++) /* every truncation is refused */
    assert_int_equal(fr_mq_decode(buf, cut, &g), FERRY_EPROTO);
  buf[FR_MQ_HEAD_BYTES] = 99; /* bad dtype */
  assert_int_equal(fr_mq_decode(buf, hl + 24, &g), FERRY_EPROTO);
  fr_mq_frame s = {.type = FR_MQ_SHM,
                   .seq = 1,
                   .len = 100,
                   .topic = "t",
                   .topic_len = 1,
                   .ref = {.id = 1, .key = 2, .size = 4096},
                   .offset = 4000,
                   .token = 5};
  hl = fr_mq_encode(&s, buf);
  assert_int_equal(fr_mq_decode(buf, hl, &g), FERRY_EPROTO); /* 4000 + 100 > 4096 */
  s.offset = 3996;
  hl = fr_mq_encode(&s, buf);
  FR_OK(fr_mq_decode(buf, hl, &g));
  fr_mq_frame c = {.type = FR_MQ_CREDIT, .value = 9, .nrelease = 2};
  hl = fr_mq_encode(&c, buf);
  assert_int_equal(fr_mq_decode(buf, hl, &g), FERRY_EPROTO); /* the releases are missing */
  FR_OK(fr_mq_decode(buf, hl + 16, &g));
  assert_int_equal(g.nrelease, 2);
  /* a batch: two DATA frames at multiples of 64, zeros between */
  uint8_t batch[512];
  memset(batch, 0, sizeof batch);
  size_t gap, len = two_message_batch(batch, "a", "abc", 3, "bb", &gap);
  FR_OK(fr_mq_decode(batch, len, &g));
  size_t pos = 0;
  assert_int_equal(fr_mq_batch_next(&g, &pos, &c), 1);
  assert_int_equal(c.seq, 1);
  assert_memory_equal(c.payload, "abc", 3);
  assert_int_equal(fr_mq_batch_next(&g, &pos, &c), 1);
  assert_string_equal(c.topic, "bb");
  assert_int_equal(fr_mq_batch_next(&g, &pos, &c), 0);
  batch[gap] = 1; /* non-zero padding between frames */
  pos = 0;
  assert_int_equal(fr_mq_batch_next(&g, &pos, &c), FERRY_EPROTO);
  assert_int_equal(fr_mq_topic_check("ok topic/x"), 0);
  assert_int_equal(fr_mq_topic_check("bad\ntopic"), FERRY_EINVAL);
}

/* ---- the suite per transport ---- */

static void set_transport(const char *t) {
  suite_transports = strcmp(t, "shm") == 0 ? "shm,tcp" : strcmp(t, "ucx") == 0 ? "ucx,tcp" : "tcp";
}
#define CASES(tr)                                                                                  \
  static void test_ordering_##tr(void **st) { set_transport(#tr), ordering(); }                    \
  static void test_no_loss_##tr(void **st) { set_transport(#tr), no_loss(); }                      \
  static void test_slow_##tr(void **st) { set_transport(#tr), slow_subscriber(); }                 \
  static void test_killed_##tr(void **st) { set_transport(#tr), killed_subscriber(); }             \
  static void test_join_leave_##tr(void **st) { set_transport(#tr), join_leave(); }                \
  static void test_malformed_##tr(void **st) { set_transport(#tr), malformed(); }                  \
  static void test_in_process_##tr(void **st) { set_transport(#tr), in_process(); }                \
  static void test_loans_##tr(void **st) { set_transport(#tr), loans(); }                          \
  static void test_stream_tail_##tr(void **st) { set_transport(#tr), stream_tail(); }              \
  static void test_stream_join_##tr(void **st) { set_transport(#tr), stream_join(); }              \
  static void test_idle_##tr(void **st) { set_transport(#tr), idle_sleeps(); }                     \
  static void test_dead_waiting_##tr(void **st) { set_transport(#tr), dead_while_waiting(); }
CASES(shm)
CASES(tcp)
#ifdef FERRY_HAVE_UCX
CASES(ucx)
#endif

/* mq through etcd:// (issue 36): a publisher finds the subscriber by its topic record in a
 * three-member cluster on loopback, and the message arrives whole. */
static void test_etcd_topic(void **state) {
  su_etcd e;
  if (!su_etcd_start(&e, 3))
    return;
  ferry_ctx *ca = ctx_open("mq-etcd-a", NULL), *cb = ctx_open("mq-etcd-b", NULL);
  ferry_mq *a = mq_open(ca, e.url, 0), *b = mq_open(cb, e.url, 0);
  FR_OK(ferry_mq_subscribe(b, "etcd-topic", 5000));
  FR_OK(ferry_mq_wait_subscribers(a, "etcd-topic", 1, 5000));
  uint8_t msg[1000]; /* message 2's size (size_of) */
  fill(msg, 2, sizeof msg);
  FR_OK(ferry_mq_publish(a, "etcd-topic", msg, sizeof msg, 5000));
  ferry_mq_msg *m;
  FR_OK(ferry_mq_recv(b, &m, 5000));
  uint64_t k = 0;
  assert_true(check(m, &k));
  assert_int_equal(k, 2);
  ferry_mq_msg_free(m);
  ferry_mq_close(b);
  ferry_mq_close(a);
  ferry_ctx_close(cb);
  ferry_ctx_close(ca);
  su_etcd_stop(&e);
}

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  if (argc == 10 && argv[1][0] == '-' && argv[1][1] == '-') {
    helper h = {.dir = argv[2],
                .transports = argv[3],
                .name = argv[4],
                .topic = argv[5],
                .count = strtoull(argv[6], NULL, 10),
                .p = {atoi(argv[7]), atoi(argv[8])}};
    if (strcmp(argv[1], "--pub") == 0)
      return pub_main(&h, (size_t)atoi(argv[9]));
    if (strcmp(argv[1], "--sub") == 0)
      return sub_main(&h, strcmp(argv[9], "slow") == 0);
    if (strcmp(argv[1], "--join") == 0)
      return joiner_main(&h);
    if (strcmp(argv[1], "--victim") == 0)
      return victim_main(&h);
    return 2;
  }
#ifdef FERRY_HAVE_UCX
  setenv("UCX_TLS", "tcp", 0); /* children inherit it */
#endif
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_etcd_topic),      cmocka_unit_test(test_wire),
      cmocka_unit_test(test_ordering_shm),    cmocka_unit_test(test_no_loss_shm),
      cmocka_unit_test(test_slow_shm),        cmocka_unit_test(test_killed_shm),
      cmocka_unit_test(test_join_leave_shm),  cmocka_unit_test(test_malformed_shm),
      cmocka_unit_test(test_in_process_shm),  cmocka_unit_test(test_loans_shm),
      cmocka_unit_test(test_stream_tail_shm), cmocka_unit_test(test_stream_join_shm),
      cmocka_unit_test(test_idle_shm),        cmocka_unit_test(test_dead_waiting_shm),
      cmocka_unit_test(test_ordering_tcp),    cmocka_unit_test(test_no_loss_tcp),
      cmocka_unit_test(test_slow_tcp),        cmocka_unit_test(test_killed_tcp),
      cmocka_unit_test(test_join_leave_tcp),  cmocka_unit_test(test_malformed_tcp),
      cmocka_unit_test(test_in_process_tcp),  cmocka_unit_test(test_loans_tcp),
      cmocka_unit_test(test_stream_tail_tcp), cmocka_unit_test(test_stream_join_tcp),
      cmocka_unit_test(test_idle_tcp),        cmocka_unit_test(test_dead_waiting_tcp),
#ifdef FERRY_HAVE_UCX
      cmocka_unit_test(test_ordering_ucx),    cmocka_unit_test(test_no_loss_ucx),
      cmocka_unit_test(test_slow_ucx),        cmocka_unit_test(test_killed_ucx),
      cmocka_unit_test(test_join_leave_ucx),  cmocka_unit_test(test_malformed_ucx),
      cmocka_unit_test(test_in_process_ucx),  cmocka_unit_test(test_loans_ucx),
      cmocka_unit_test(test_stream_tail_ucx), cmocka_unit_test(test_stream_join_ucx),
      cmocka_unit_test(test_idle_ucx),        cmocka_unit_test(test_dead_waiting_ucx),
#endif
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, NULL, NULL);
}
