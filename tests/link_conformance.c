/*
 * The link conformance cases: what every transport's links must do (messages, calls, one-sided
 * reads and writes, tokens, a peer killed mid-read, threads sharing a link, frames sent just
 * before the sender's end...). One source, compiled once per transport with
 * FERRY_TEST_TRANSPORT="shm", "tcp" or "ucx" into link_conformance_shm, _tcp and _ucx
 * (tests/CMakeLists.txt; the ucx one runs twice, over UCX_TLS=tcp and sm). What only one
 * transport has is tested in tests/link_test.c (shm, tcp, and the ctx) and
 * tests/ucx_link_test.c.
 */
// ferry-test: threaded
#include "linkutil.h"
#include "testutil.h"
#include "core/channels.h"
#include "transport/ctxcalls.h"
#include "transport/linkcalls.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef FERRY_TEST_TRANSPORT
#error "compile with -DFERRY_TEST_TRANSPORT='\"shm\"' (or tcp, ucx): tests/CMakeLists.txt does"
#endif
#define TRANSPORT FERRY_TEST_TRANSPORT

/* Every ctx answers a call on FR_CHANNEL_STATS with its metrics (a fleet view's question), on
 * one link again and again; a plain message there is dropped, and never reaches ferry_recv. */
static void stats_calls(const char *transport) {
  lt_pair p;
  lt_pair_open(&p, transport);
  char want[96];
  snprintf(want, sizeof want, "ferry_links{node=\"node-b\",transport=\"%s\"} 1", transport);
  for (int i = 0; i < 20; i++) {
    char *text = NULL;
    FR_OK(fr_stats_call(p.ab, 5000, &text));
    assert_non_null(strstr(text, want));
    free(text);
    usleep(2000);
  }
  struct iovec iov = {"x", 1};
  FR_OK(ferry_send(p.ab, FR_CHANNEL_STATS, &iov, 1, 1000));
  char *text = NULL;
  FR_OK(fr_stats_call(p.ab, 5000, &text)); /* after the message: it was taken and dropped */
  free(text);
  ferry_msg *m = NULL;
  assert_int_equal(ferry_recv(p.b, FR_CHANNEL_STATS, &m, 50), FERRY_ETIMEDOUT);
  lt_pair_close(&p);
}

/* A channel with an owner: what was queued before is handed over, a second owner and ferry_recv
 * are refused (FERRY_EBUSY), every later message reaches the owner's inbox in order, a kick ends
 * a wait without one, and once the owner closes the channel ferry_recv has it again. */
static void channel_owner(const char *transport) {
  lt_pair p;
  lt_pair_open(&p, transport);
  char text[32];
  struct iovec iov = {text, 0};
  iov.iov_len = (size_t)snprintf(text, sizeof text, "m %d", 0);
  FR_OK(ferry_send(p.ab, 5, &iov, 1, 1000));
  assert_true(fr_ctx_await(p.b, 5, 5000)); /* queued before there is an owner */
  fr_inbox q;
  fr_inbox_init(&q);
  FR_OK(fr_ctx_channel_open(p.b, 5, &fr_inbox_ops, &q));
  assert_int_equal(fr_ctx_channel_open(p.b, 5, &fr_inbox_ops, &q), FERRY_EBUSY);
  ferry_msg *m = NULL;
  assert_int_equal(ferry_recv(p.b, 5, &m, 0), FERRY_EBUSY);
  for (int i = 1; i < 50; i++) {
    iov.iov_len = (size_t)snprintf(text, sizeof text, "m %d", i);
    FR_OK(ferry_send(p.ab, 5, &iov, 1, 1000));
  }
  for (int i = 0; i < 50; i++) {
    m = fr_inbox_wait(p.b, 5, &q, UINT64_MAX);
    assert_non_null(m);
    int n = snprintf(text, sizeof text, "m %d", i);
    assert_int_equal(m->len, (size_t)n);
    assert_memory_equal(m->data, text, (size_t)n);
    assert_string_equal(ferry_link_peer(m->link), "node-a");
    ferry_msg_free(m);
  }
  fr_inbox_kick(p.b, 5, &q);
  assert_null(fr_inbox_wait(p.b, 5, &q, UINT64_MAX)); /* the kick, not a message */
  fr_ctx_channel_close(p.b, 5);
  iov.iov_len = (size_t)snprintf(text, sizeof text, "after");
  FR_OK(ferry_send(p.ab, 5, &iov, 1, 1000));
  FR_OK(ferry_recv(p.b, 5, &m, 5000));
  assert_int_equal(m->len, 5);
  ferry_msg_free(m);
  assert_null(fr_inbox_take(&q));
  fr_inbox_fini(&q);
  lt_pair_close(&p);
}

/* Timeouts are generous: under TSan on a loaded 2-core machine a ucx handshake once took over
 * 5 s. A refused token fails at once whatever the timeout. */
static void tokens(const char *transport) {
  ferry_ctx *server = lt_open_ctx("server", transport, "s3cret-fleet-token-0123456789");
  ferry_ctx *good = lt_open_ctx("good", transport, "s3cret-fleet-token-0123456789");
  ferry_ctx *bad = lt_open_ctx("bad", transport, "a-guess-of-16-bytes-or-more");
  ferry_ctx *none = lt_open_ctx("none", transport, "");
  ferry_link *l = NULL;
  FR_OK(ferry_connect(good, ferry_ctx_address(server), 20000, &l));
  ferry_link *nl = (ferry_link *)0x1;
  assert_int_equal(ferry_connect(bad, ferry_ctx_address(server), 20000, &nl), FERRY_EAUTH);
  assert_ptr_equal(nl, (ferry_link *)0x1);
  assert_int_equal(ferry_connect(none, ferry_ctx_address(server), 20000, &nl), FERRY_EAUTH);
  /* the server still serves the good peer */
  struct iovec iov = {"ok", 2};
  FR_OK(ferry_send(l, 0, &iov, 1, 1000));
  ferry_msg *m;
  FR_OK(ferry_recv(server, 0, &m, 20000));
  ferry_msg_free(m);
  ferry_link_close(l);
  ferry_ctx_close(server);
  ferry_ctx_close(good);
  ferry_ctx_close(bad);
  ferry_ctx_close(none);
}

/* ---- a peer killed mid-read ---- */

typedef struct owner_args {
  const char *transport;
  tu_pipe *pipe;
  size_t bytes;
} owner_args;

static int owner_main(void *arg) {
  owner_args *a = arg;
  ferry_ctx *c = lt_open_ctx("owner", a->transport, "");
  void *mem;
  if (ferry_alloc(c, a->bytes, &mem) != 0)
    return 1;
  ferry_region_ref ref;
  ferry_region_find(c, mem, a->bytes, &ref, NULL);
  char addr[512];
  snprintf(addr, sizeof addr, "%s", ferry_ctx_address(c));
  tu_pipe_put(a->pipe, addr, sizeof addr);
  tu_pipe_put(a->pipe, &ref, sizeof ref);
  pause();
  return 0;
}

/* Reads the owner takes no part in: shm's memcpy from mapped pages, ucx gets over shared memory
 * (cma reads the owner's pages even while it is stopped). */
static bool owner_free_reads(const char *transport) {
  const char *tls = getenv("UCX_TLS");
  return strcmp(transport, "shm") == 0 ||
         (strcmp(transport, "ucx") == 0 && tls && (strstr(tls, "sm") || strstr(tls, "cma")));
}

static void killed_mid_read(const char *transport) {
  tu_pipe pp;
  tu_pipe_open(&pp);
  owner_args a = {transport, &pp, 64 << 20};
  pid_t pid = tu_spawn(owner_main, &a);
  char addr[512];
  ferry_region_ref ref;
  assert_int_equal(tu_pipe_get(&pp, addr, sizeof addr, 10000), 0);
  assert_int_equal(tu_pipe_get(&pp, &ref, sizeof ref, 10000), 0);
  ferry_ctx *c = lt_open_ctx("reader", transport, "");
  ferry_link *l;
  FR_OK(ferry_connect(c, addr, 5000, &l));
  uint8_t *dst = malloc(a.bytes);
  FR_OK(ferry_read(l, &ref, 0, dst, 4096, 5000));
  /* Stop the owner so the read is certainly in flight, then kill it. */
  kill(pid, SIGSTOP);
  pid_t killer = fork();
  if (killer == 0) {
    usleep(200000);
    kill(pid, SIGKILL);
    _exit(0);
  }
  int rc = ferry_read(l, &ref, 0, dst, a.bytes, 8000);
  if (owner_free_reads(transport)) {
    /* a mapped read needs nothing from the owner: it completes or reports the peer gone */
    assert_true(rc == 0 || rc == FERRY_EPEER);
  } else {
    assert_int_equal(rc, FERRY_EPEER);
  }
  tu_wait(killer);
  assert_int_equal(tu_wait(pid), 128 + SIGKILL);
  /* the link is dead now: every later call says so at once */
  usleep(100000);
  assert_int_equal(ferry_read(l, &ref, 0, dst, 64, 1000), FERRY_EPEER);
  free(dst);
  ferry_link_close(l);
  ferry_ctx_close(c);
  tu_pipe_close(&pp);
}

static void concurrent(const char *transport) {
  lt_pair p;
  lt_pair_open(&p, transport);
  size_t n = 1 << 20;
  uint8_t *mem = malloc(n);
  tu_fill(mem, n, 5);
  lt_hammer_args h[4];
  pthread_t t[4];
  ferry_region_ref ref;
  FR_OK(ferry_register(p.b, mem, n, &ref));
  for (int i = 0; i < 4; i++) {
    h[i] = (lt_hammer_args){p.ab, ref, mem, 0};
    pthread_create(&t[i], NULL, lt_hammer, &h[i]);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(t[i], NULL);
    assert_int_equal(h[i].failures, 0);
  }
  lt_pair_close(&p);
  free(mem);
}

/* A thread waiting in ferry_recv leads its ctx's epoll (tcp, shm); other threads of that ctx
 * waiting for read responses meanwhile get them through it, and its own message still comes. */
typedef struct recv_args {
  ferry_ctx *c;
  int rc;
  char got[16];
} recv_args;

static void *recv_one(void *arg) {
  recv_args *r = arg;
  ferry_msg *m = NULL;
  r->rc = ferry_recv(r->c, 5, &m, 20000);
  if (r->rc == 0) {
    snprintf(r->got, sizeof r->got, "%s", (const char *)m->data);
    ferry_msg_free(m);
  }
  return NULL;
}

static void waiters(const char *transport) {
  lt_pair p;
  lt_pair_open(&p, transport);
  size_t n = 1 << 20;
  uint8_t *mem = malloc(n);
  tu_fill(mem, n, 7);
  ferry_region_ref ref;
  FR_OK(ferry_register(p.b, mem, n, &ref));
  recv_args r = {.c = p.a};
  pthread_t rt, t[2];
  pthread_create(&rt, NULL, recv_one, &r);
  lt_hammer_args h[2];
  for (int i = 0; i < 2; i++) {
    h[i] = (lt_hammer_args){p.ab, ref, mem, 0};
    pthread_create(&t[i], NULL, lt_hammer, &h[i]);
  }
  for (int i = 0; i < 2; i++) {
    pthread_join(t[i], NULL);
    assert_int_equal(h[i].failures, 0);
  }
  struct iovec hello = {"hello", 6}, back = {"back", 5};
  FR_OK(ferry_send(p.ab, 6, &hello, 1, 5000));
  ferry_msg *m = NULL;
  FR_OK(ferry_recv(p.b, 6, &m, 5000));
  FR_OK(ferry_send(m->link, 5, &back, 1, 5000));
  ferry_msg_free(m);
  pthread_join(rt, NULL);
  assert_int_equal(r.rc, 0);
  assert_string_equal(r.got, "back");
  lt_pair_close(&p);
  free(mem);
}

/* ---- frames sent just before the sender's end all arrive ---- */

/* How the sender ends after its last ferry_send returned 0: it closes the link (and then its
 * ctx), it closes only its ctx, or it exits with nothing closed (shm and tcp: nothing of a sent
 * frame is left in the sender's memory then; ucx keeps bytes in UCX until the ctx closes). */
typedef enum { END_LINK_CLOSE, END_CTX_CLOSE, END_EXIT } end_how;

typedef struct end_args {
  const char *transport;
  tu_pipe *pipe;
  int frames;
  bool large; /* every 100th frame carries END_LARGE bytes: more than a shm ring holds */
  end_how how;
} end_args;

#define END_CHANNEL 9
#define END_LARGE (700u * 1024u)

static size_t end_frame_len(const end_args *a, int i) {
  return a->large && i % 100 == 50 ? END_LARGE : 16;
}

static const char *how_name(end_how how) {
  return how == END_EXIT ? "exit" : how == END_CTX_CLOSE ? "ctx close" : "link close";
}

static int end_sender(void *arg) {
  end_args *a = arg;
  char addr[512];
  if (tu_pipe_get(a->pipe, addr, sizeof addr, 10000) != 0)
    return 2;
  ferry_ctx *c = lt_open_ctx("ender", a->transport, "");
  ferry_link *l;
  if (ferry_connect(c, addr, 5000, &l) != 0)
    return 3;
  uint8_t *buf = malloc(END_LARGE);
  if (!buf)
    return 4;
  for (int i = 0; i < a->frames; i++) {
    size_t len = end_frame_len(a, i);
    tu_fill(buf, len, (uint64_t)i);
    memcpy(buf, &i, sizeof i);
    struct iovec iov = {buf, len};
    if (ferry_send(l, END_CHANNEL, &iov, 1, 10000) != 0)
      return 5;
  }
  if (a->how == END_EXIT)
    return 0; /* tu_spawn's _exit: the kernel closes the socket, the ring stays mapped there */
  if (a->how == END_LINK_CLOSE)
    ferry_link_close(l);
  ferry_ctx_close(c);
  free(buf);
  return 0;
}

/* The receiver must get every frame whose send returned 0, in order, and then see the link end
 * (a link that ended before its frames were taken in lost them: shm's ring, ucx's stream). */
static void end_after_sends(const char *transport, bool large, end_how how) {
  tu_pipe pp;
  tu_pipe_open(&pp);
  end_args a = {transport, &pp, 1000, large, how};
  pid_t pid = tu_spawn(end_sender, &a);
  ferry_ctx *c = lt_open_ctx("end-receiver", transport, "");
  char addr[512];
  snprintf(addr, sizeof addr, "%s", ferry_ctx_address(c));
  tu_pipe_put(&pp, addr, sizeof addr);
  uint8_t *want = malloc(END_LARGE);
  ferry_link *link = NULL;
  for (int i = 0; i < a.frames; i++) {
    ferry_msg *m = NULL;
    int rc = ferry_recv(c, END_CHANNEL, &m, 20000);
    if (rc != 0)
      fail_msg("%s (%s): frame %d of %d did not arrive: %s", transport, how_name(how), i, a.frames,
               ferry_strerror(rc));
    size_t len = end_frame_len(&a, i);
    tu_fill(want, len, (uint64_t)i);
    memcpy(want, &i, sizeof i);
    assert_int_equal(m->len, len);
    assert_memory_equal(m->data, want, len);
    if (!link)
      link = ferry_link_retain(m->link);
    ferry_msg_free(m);
  }
  assert_int_equal(tu_wait(pid), 0);
  /* then the end, and nothing more: a waiting receiver drives the ctx until the link says so */
  for (int i = 0; i < 1000 && ferry_link_status(link) == 0; i++) {
    ferry_msg *m = NULL;
    assert_int_equal(ferry_recv(c, END_CHANNEL, &m, 10), FERRY_ETIMEDOUT);
  }
  if (ferry_link_status(link) == 0)
    fail_msg("%s (%s): the link did not end", transport, how_name(how));
  ferry_msg *m = NULL;
  assert_int_equal(ferry_recv(c, END_CHANNEL, &m, 10), FERRY_ETIMEDOUT);
  ferry_link_release(link);
  free(want);
  ferry_ctx_close(c);
  tu_pipe_close(&pp);
}

static void ends(const char *transport) {
  for (int how = END_LINK_CLOSE; how <= END_EXIT; how++) {
    if (how == END_EXIT && strcmp(transport, "ucx") == 0)
      continue; /* UCX's own buffers end with a process that never closed its ctx */
    end_after_sends(transport, false, (end_how)how);
    end_after_sends(transport, true, (end_how)how);
  }
}

typedef struct echo_args {
  ferry_ctx *c;
  int n, rc;
} echo_args;

static void *echo_n(void *arg) {
  echo_args *e = arg;
  for (int i = 0; i < e->n && e->rc == 0; i++) {
    ferry_msg *m = NULL;
    struct iovec back = {"back", 5};
    if ((e->rc = ferry_recv(e->c, 7, &m, 20000)) == 0)
      e->rc = ferry_send(m->link, 7, &back, 1, 5000);
    ferry_msg_free(m);
  }
  return NULL;
}

/* Round trips and one-sided reads far apart (each after a pause longer than any wait a caller's
 * lead is kept for) cost the progress threads nothing: the caller waiting for the answer, and the
 * echoing thread waiting for the request, each lead their ctx's epoll without taking it from a
 * progress thread asleep in it (leader.c). Before, each paced round trip woke the asking side's
 * progress thread twice (asked to step down, then its grace timer) and the echoing side's twice
 * more (a nudge, a grace timer): at least 4 per round trip, and 2 per one-sided read over tcp. The
 * bound leaves room for the rare answer that comes before its caller leads, and for the progress
 * threads' once-a-second look. The two ctxs of this process are the two nodes, so that
 * /proc/PID/task holds both progress threads. */
static void paced_round_trips(const char *transport) {
  if (strcmp(transport, "ucx") == 0) { /* no any_thread_events: its progress thread always leads */
    tu_skip(TU_SKIP_NOT_HERE, "ucx: callers never lead a ucx ctx, so every answer wakes its "
                              "progress thread by design (leader.c)");
    return;
  }
  lt_pair p;
  lt_pair_open(&p, transport);
  enum { ROUNDS = 40 };
  struct iovec hello = {"hello", 6};
  echo_args e = {.c = p.b, .n = ROUNDS + 1};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, echo_n, &e), 0);
  ferry_msg *m = NULL;
  FR_OK(ferry_send(p.ab, 7, &hello, 1, 5000)); /* a first one, outside the count */
  FR_OK(ferry_recv(p.a, 7, &m, 20000));
  ferry_msg_free(m);
  uint8_t mem[64], got[64];
  tu_fill(mem, sizeof mem, 3);
  ferry_region_ref ref;
  FR_OK(ferry_register(p.b, mem, sizeof mem, &ref));
  long before = tu_wakeups(getpid(), "ferry-progress");
  for (int i = 0; i < ROUNDS; i++) {
    usleep(10000);
    FR_OK(ferry_send(p.ab, 7, &hello, 1, 5000));
    FR_OK(ferry_recv(p.a, 7, &m, 20000));
    assert_string_equal((const char *)m->data, "back");
    ferry_msg_free(m);
    usleep(10000); /* and a one-sided read, served by the echoing thread's lead (tcp) */
    memset(got, 0, sizeof got);
    FR_OK(ferry_read(p.ab, &ref, 0, got, sizeof got, 5000));
    assert_memory_equal(got, mem, sizeof got);
  }
  long woke = tu_wakeups(getpid(), "ferry-progress") - before;
  pthread_join(t, NULL);
  assert_int_equal(e.rc, 0);
  fprintf(stderr, "%s: the progress threads woke %ld times in %d paced round trips and reads\n",
          transport, woke, ROUNDS);
  if (woke > ROUNDS / 2)
    fail_msg("%s: %ld progress-thread wake-ups in %d paced round trips and reads: callers wait "
             "through them",
             transport, woke, ROUNDS);
  lt_pair_close(&p);
}

static void test_messages(void **s) { lt_messages(TRANSPORT); }
static void test_calls(void **s) { lt_calls(TRANSPORT); }
static void test_stats_calls(void **s) { stats_calls(TRANSPORT); }
static void test_channel_owner(void **s) { channel_owner(TRANSPORT); }
static void test_rma_shared(void **s) { lt_one_sided(TRANSPORT, true); }
static void test_rma_registered(void **s) { lt_one_sided(TRANSPORT, false); }
static void test_token(void **s) { tokens(TRANSPORT); }
static void test_killed_mid_read(void **s) { killed_mid_read(TRANSPORT); }
static void test_concurrent(void **s) { concurrent(TRANSPORT); }
static void test_waiters(void **s) { waiters(TRANSPORT); }
static void test_end_after_sends(void **s) { ends(TRANSPORT); }
static void test_paced_round_trips(void **s) { paced_round_trips(TRANSPORT); }

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const char *tls = getenv("UCX_TLS");
  printf("link conformance over %s%s%s\n", TRANSPORT, tls ? ", UCX_TLS=" : "", tls ? tls : "");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_paced_round_trips), cmocka_unit_test(test_messages),
      cmocka_unit_test(test_channel_owner),     cmocka_unit_test(test_calls),
      cmocka_unit_test(test_stats_calls),       cmocka_unit_test(test_rma_shared),
      cmocka_unit_test(test_rma_registered),    cmocka_unit_test(test_token),
      cmocka_unit_test(test_killed_mid_read),   cmocka_unit_test(test_concurrent),
      cmocka_unit_test(test_waiters),           cmocka_unit_test(test_end_after_sends),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, NULL, NULL);
}
