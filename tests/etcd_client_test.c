/*
 * The etcd:// client against a real one-member etcd behind a proxy of the test's own
 * (tests/etcd/cluster.sh), for what a fault makes of one request, made deterministic: the proxy
 * relays every request to the member, except the next one to a path it was told to hold, which
 * it keeps unanswered (as a member that stopped answering would) and, when told to, sends to the
 * member itself later (as a stopped member that resumed runs what was left in its socket):
 * - a lease renewal while another call of the same client is held: it lands within its timeout
 *   (renewals have a connection of their own; they used to wait behind the call and fail,
 *   "the connection stayed busy with another call"); and so do another thread's calls (calls
 *   take the first free one of a few connections);
 * - a put held, then a delete of its key that returned: the put, run late, does not bring the
 *   key back (a delete puts its key's delete marker, which every put compares); nor does it
 *   replace a put that returned after it, nor create a key whose delete found nothing.
 */
// ferry-test: threaded
#include "testutil.h"

#include "directory/directory.h"
#include "etcdutil.h"
#include "storeutil.h"

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

/* A call must return within twice its timeout and SLACK_MS (in a sanitizer build, and its
 * timeout: tu_allowance_ms): a bound, which a loaded machine's slowness alone never passes.
 * HANG_MS: a hang detector for the proxy's own waits. */
#define SLACK_MS 300.0
#define HANG_MS 20000
#define MAX_CONNS 32

/* ---- the proxy ---- */

typedef struct proxy proxy;
typedef struct relay {
  proxy *p;
  int c, u; /* the client's connection, and the proxy's to the member */
  pthread_t thread;
} relay;

struct proxy {
  int lfd, port, up_port;
  pthread_t acceptor;
  pthread_mutex_t lock;
  pthread_cond_t changed;
  char hold[64]; /* lock: the path whose next request is held ("": none) */
  char *held;    /* lock: that request, head and body, once it came */
  size_t held_n;
  int held_fd; /* lock: the connection it came on */
  relay conns[MAX_CONNS];
  int nconns; /* lock */
  int txns;   /* lock: /v3/kv/txn requests relayed */
};

static int write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* The length of the first whole HTTP message in b[0..n) (head and a Content-Length body, or a
 * chunked body to its last chunk), 0 while it is not all there. */
static size_t message_len(const char *b, size_t n) {
  const char *end = memmem(b, n, "\r\n\r\n", 4);
  if (!end)
    return 0;
  size_t head = (size_t)(end - b) + 4, body = 0;
  for (const char *l = b, *nl; l < end; l = nl + 1) {
    nl = memchr(l, '\n', (size_t)(end + 2 - l)); /* end[1] is the last line's '\n' */
    if (strncasecmp(l, "Content-Length:", 15) == 0)
      body = strtoul(l + 15, NULL, 10);
    if (strncasecmp(l, "Transfer-Encoding: chunked", 26) == 0) {
      const char *last = memmem(b + head, n - head, "\r\n0\r\n\r\n", 7);
      if (!last && n - head >= 5 && memcmp(b + head, "0\r\n\r\n", 5) == 0)
        return head + 5;
      return last ? (size_t)(last - b) + 7 : 0;
    }
    if (!nl)
      break;
  }
  return n >= head + body ? head + body : 0;
}

/* Whether the request r (n bytes) is the one to hold: if so it is kept and the test told. */
static bool take_hold(proxy *p, const char *r, size_t n, int fd) {
  char line[96];
  pthread_mutex_lock(&p->lock);
  snprintf(line, sizeof line, "POST %s ", p->hold);
  bool hold = p->hold[0] && n > strlen(line) && memcmp(r, line, strlen(line)) == 0;
  p->txns += !hold && n > 16 && memcmp(r, "POST /v3/kv/txn ", 16) == 0;
  if (hold && (p->held = malloc(n)) != NULL) {
    memcpy(p->held, r, n);
    p->held_n = n;
    p->held_fd = fd;
    p->hold[0] = '\0';
    pthread_cond_broadcast(&p->changed);
  }
  pthread_mutex_unlock(&p->lock);
  return hold;
}

/* One client connection: what the member answers goes back as it comes; requests go on to the
 * member one whole request at a time, but for the one held, after which nothing more is sent. */
static void *relay_main(void *arg) {
  relay *k = arg;
  size_t cap = 1 << 20, n = 0;
  char *in = malloc(cap), b[65536];
  bool holding = false, broken = false;
  while (in && !broken) {
    struct pollfd pf[2] = {{.fd = k->c, .events = POLLIN}, {.fd = k->u, .events = POLLIN}};
    if (poll(pf, 2, -1) < 0 && errno != EINTR)
      break;
    if (pf[1].revents) {
      ssize_t r = read(k->u, b, sizeof b);
      if (r <= 0 || write_all(k->c, b, (size_t)r) != 0)
        break;
    }
    if (!pf[0].revents)
      continue;
    ssize_t r = read(k->c, in + n, cap - n);
    if (r <= 0)
      break;
    n = holding ? 0 : n + (size_t)r;
    for (size_t len; !holding && !broken && (len = message_len(in, n)) > 0;) {
      holding = take_hold(k->p, in, len, k->c);
      broken = !holding && write_all(k->u, in, len) != 0;
      memmove(in, in + len, n - len);
      n -= len;
    }
    broken = broken || n == cap;
  }
  free(in);
  shutdown(k->c, SHUT_RDWR);
  shutdown(k->u, SHUT_RDWR);
  return NULL;
}

static int dial_member(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET,
                           .sin_port = htons((uint16_t)port),
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    close(fd);
    fd = -1;
  }
  return fd;
}

static void *acceptor_main(void *arg) {
  proxy *p = arg;
  for (;;) {
    int c = accept(p->lfd, NULL, NULL);
    if (c < 0)
      return NULL; /* shut down */
    int u = dial_member(p->up_port);
    pthread_mutex_lock(&p->lock);
    relay *k = u >= 0 && p->nconns < MAX_CONNS ? &p->conns[p->nconns] : NULL;
    if (k) {
      *k = (relay){.p = p, .c = c, .u = u};
      if (pthread_create(&k->thread, NULL, relay_main, k) == 0)
        p->nconns++;
      else
        k = NULL;
    }
    pthread_mutex_unlock(&p->lock);
    if (!k) {
      close(c);
      if (u >= 0)
        close(u);
    }
  }
}

/* A proxy on a free loopback port to the member at endpoint "127.0.0.1:PORT". */
static void proxy_start(proxy *p, const char *endpoint) {
  memset(p, 0, sizeof *p);
  const char *colon = strrchr(endpoint, ':');
  assert_non_null(colon);
  p->up_port = atoi(colon + 1);
  p->held_fd = -1;
  pthread_mutex_init(&p->lock, NULL);
  pthread_cond_init(&p->changed, NULL);
  p->lfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  assert_int_equal(bind(p->lfd, (struct sockaddr *)&sa, sizeof sa), 0);
  assert_int_equal(listen(p->lfd, 16), 0);
  assert_int_equal(getsockname(p->lfd, (struct sockaddr *)&sa, &len), 0);
  p->port = ntohs(sa.sin_port);
  assert_int_equal(pthread_create(&p->acceptor, NULL, acceptor_main, p), 0);
}

static void proxy_stop(proxy *p) {
  shutdown(p->lfd, SHUT_RDWR);
  pthread_join(p->acceptor, NULL);
  pthread_mutex_lock(&p->lock);
  int n = p->nconns;
  for (int i = 0; i < n; i++) {
    shutdown(p->conns[i].c, SHUT_RDWR);
    shutdown(p->conns[i].u, SHUT_RDWR);
  }
  pthread_mutex_unlock(&p->lock);
  for (int i = 0; i < n; i++) {
    pthread_join(p->conns[i].thread, NULL);
    close(p->conns[i].c);
    close(p->conns[i].u);
  }
  close(p->lfd);
  free(p->held);
  pthread_mutex_destroy(&p->lock);
  pthread_cond_destroy(&p->changed);
}

/* The next request to `path` is held. */
static void proxy_hold(proxy *p, const char *path) {
  pthread_mutex_lock(&p->lock);
  snprintf(p->hold, sizeof p->hold, "%s", path);
  free(p->held);
  p->held = NULL;
  p->held_fd = -1;
  pthread_mutex_unlock(&p->lock);
}

/* Waits until the request to hold came (at most HANG_MS, a hang detector). */
static void proxy_wait_held(proxy *p) {
  pthread_mutex_lock(&p->lock);
  for (int i = 0; !p->held && i < HANG_MS / 10; i++) {
    pthread_mutex_unlock(&p->lock);
    su_sleep_ms(10);
    pthread_mutex_lock(&p->lock);
  }
  bool held = p->held != NULL;
  pthread_mutex_unlock(&p->lock);
  if (!held)
    fail_msg("the request to hold never came");
}

/* Closes the connection the held request came on (its caller sees the member hang up). */
static void proxy_hang_up(proxy *p) {
  pthread_mutex_lock(&p->lock);
  if (p->held_fd >= 0)
    shutdown(p->held_fd, SHUT_RDWR);
  pthread_mutex_unlock(&p->lock);
}

/* Sends the held request to the member on a connection of its own, as a member that resumed
 * runs what was left in its socket: the member's answer (its JSON body), which the caller frees. */
static json_t *proxy_run_late(proxy *p) {
  pthread_mutex_lock(&p->lock);
  char *req = p->held;
  size_t n = p->held_n;
  p->held = NULL;
  pthread_mutex_unlock(&p->lock);
  assert_non_null(req);
  int fd = dial_member(p->up_port);
  assert_true(fd >= 0);
  assert_int_equal(write_all(fd, req, n), 0);
  free(req);
  static char resp[1 << 16];
  size_t got = 0, len = 0;
  while ((len = message_len(resp, got)) == 0) {
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    if (poll(&pf, 1, HANG_MS) != 1)
      fail_msg("the member did not answer the late request");
    ssize_t r = read(fd, resp + got, sizeof resp - 1 - got);
    if (r <= 0)
      fail_msg("the member hung up on the late request");
    got += (size_t)r;
  }
  close(fd);
  resp[len] = '\0';
  const char *body = strstr(resp, "\r\n\r\n") + 4;
  json_t *j = json_loads(body, JSON_DISABLE_EOF_CHECK, NULL);
  if (!j)
    fail_msg("the late request's answer is not JSON: %s", resp);
  return j;
}

/* ---- helpers ---- */

static double ms_since(uint64_t t0) { return (double)(fr_now_ns() - t0) / 1e6; }

static void within(uint64_t t0, int timeout_ms, const char *what, int rc) {
  double ms = ms_since(t0), slack = tu_allowance_ms(timeout_ms, SLACK_MS); /* sanitizers: more */
  if (ms > 2 * timeout_ms + slack)
    fail_msg("%s returned %s after %.0f ms, past twice its %d ms timeout (+%.0f ms): %s", what,
             ferry_status_name(rc), ms, timeout_ms, slack, rc ? ferry_last_error() : "");
}

static fr_dir_node node_named(const char *name, uint64_t incarnation) {
  fr_dir_node n;
  memset(&n, 0, sizeof n);
  snprintf(n.name, sizeof n.name, "%s", name);
  snprintf(n.address, sizeof n.address, "tcp://127.0.0.1:1");
  n.incarnation = incarnation;
  return n;
}

static fr_dir_object object_of(const char *key, const char *owner, uint64_t generation) {
  fr_dir_object o;
  memset(&o, 0, sizeof o);
  snprintf(o.key, sizeof o.key, "%s", key);
  snprintf(o.owner, sizeof o.owner, "%s", owner);
  o.desc = (ferry_tensor_desc){.dtype = FERRY_DTYPE_U8, .ndim = 1, .shape = {8}};
  o.bytes = 8;
  o.region = (ferry_region_ref){.id = 3, .key = 0xabc, .size = 4096};
  o.offset = 64;
  o.gen_region = o.region;
  o.gen_offset = 8;
  o.generation = generation;
  return o;
}

/* The generation of the record under key (0: none). */
static uint64_t generation_of(fr_dir *d, const char *key) {
  const char *keys[1] = {key};
  fr_dir_object o;
  int st = 0;
  FR_OK(d->ops->obj_get(d->state, keys, 1, &o, &st, 5000));
  return st == 0 ? o.generation : 0;
}

/* An etcd member and a proxy to it; d: a client through the proxy. False: etcd is not here. */
static bool setup(su_etcd *e, proxy *p, fr_dir **d) {
  if (!su_etcd_start(e, 1))
    return false;
  proxy_start(p, e->endpoints);
  char url[64];
  snprintf(url, sizeof url, "etcd://127.0.0.1:%d", p->port);
  FR_OK(fr_dir_open(NULL, url, 5000, d));
  return true;
}

static void teardown(su_etcd *e, proxy *p, fr_dir *d) {
  fr_dir_close(d);
  proxy_stop(p);
  su_etcd_stop(e);
}

/* ---- a renewal beside a call held ---- */

typedef struct held_call {
  fr_dir *d;
  int rc;
  uint64_t t0;
} held_call;

/* The held call's timeout (it ends when the proxy hangs up, long before), and that of the calls
 * beside it: ample for a loaded machine, and still far shorter than the held call, so that a call
 * that waited behind it fails. */
#define HELD_MS 60000
#define BESIDE_MS 5000

static void *held_lookup(void *arg) {
  held_call *h = arg;
  fr_dir_node got;
  h->t0 = fr_now_ns();
  h->rc = h->d->ops->node_get(h->d->state, "someone-else", &got, HELD_MS);
  return NULL;
}

/* A node registered with a 30 s lease; a lookup of the same client is held by the member (it
 * never answers); a renewal with a 5 s timeout meanwhile lands: it does not wait behind the
 * lookup. */
static void test_etcd_renewal_beside_held_call(void **state) {
  (void)state;
  su_etcd e;
  proxy p;
  fr_dir *d;
  if (!setup(&e, &p, &d))
    return;
  fr_dir_node n = node_named("renewer", 5);
  FR_OK(d->ops->node_put(d->state, &n, 30000, 0, NULL, 5000));
  proxy_hold(&p, "/v3/kv/range");
  held_call h = {.d = d};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, held_lookup, &h), 0);
  proxy_wait_held(&p);
  uint64_t t0 = fr_now_ns();
  int rc = d->ops->node_renew(d->state, n.name, n.incarnation, 30000, BESIDE_MS);
  within(t0, BESIDE_MS, "a renewal beside a held call", rc);
  if (rc != 0)
    fail_msg("a renewal beside a held call: %s (%s)", ferry_status_name(rc), ferry_last_error());
  print_message("a renewal beside a held lookup landed after %.0f ms\n", ms_since(t0));
  proxy_hang_up(&p);
  pthread_join(t, NULL);
  within(h.t0, HELD_MS, "the held lookup", h.rc);
  FR_OK(d->ops->node_renew(d->state, n.name, n.incarnation, 30000, 5000));
  FR_OK(d->ops->node_del(d->state, n.name, n.incarnation, 5000));
  teardown(&e, &p, d);
}

/* A node and its object; a lookup of the same client is held by the member; meanwhile another
 * thread's put and get (5 s timeouts) land: they do not wait behind the lookup. */
static void test_etcd_call_beside_held_call(void **state) {
  (void)state;
  su_etcd e;
  proxy p;
  fr_dir *d;
  if (!setup(&e, &p, &d))
    return;
  fr_dir_node n = node_named("caller", 6);
  FR_OK(d->ops->node_put(d->state, &n, 30000, 0, NULL, 5000));
  fr_dir_object o = object_of("beside/key", n.name, 1);
  FR_OK(d->ops->obj_put(d->state, &o, 0, NULL, NULL, 5000));
  proxy_hold(&p, "/v3/kv/range");
  held_call h = {.d = d};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, held_lookup, &h), 0);
  proxy_wait_held(&p);
  o.generation = 2;
  uint64_t t0 = fr_now_ns();
  int rc = d->ops->obj_put(d->state, &o, 0, NULL, NULL, BESIDE_MS);
  within(t0, BESIDE_MS, "a put beside a held call", rc);
  if (rc != 0)
    fail_msg("a put beside a held call: %s (%s)", ferry_status_name(rc), ferry_last_error());
  const char *keys[1] = {"beside/key"};
  fr_dir_object got;
  int st = -1;
  t0 = fr_now_ns();
  rc = d->ops->obj_get(d->state, keys, 1, &got, &st, BESIDE_MS);
  within(t0, BESIDE_MS, "a get beside a held call", rc);
  if (rc != 0)
    fail_msg("a get beside a held call: %s (%s)", ferry_status_name(rc), ferry_last_error());
  assert_int_equal(st, 0);
  assert_int_equal(got.generation, 2);
  proxy_hang_up(&p);
  pthread_join(t, NULL);
  within(h.t0, HELD_MS, "the held lookup", h.rc);
  FR_OK(d->ops->node_del(d->state, n.name, n.incarnation, 5000));
  teardown(&e, &p, d);
}

/* ---- a put run late ---- */

/* A put of (key, generation) that the member holds: it fails with the call's timeout. */
static void put_held(proxy *p, fr_dir *d, const char *key, const char *owner, uint64_t gen) {
  fr_dir_object o = object_of(key, owner, gen);
  proxy_hold(p, "/v3/kv/txn");
  uint64_t t0 = fr_now_ns();
  int rc = d->ops->obj_put(d->state, &o, 0, NULL, NULL, 1000);
  within(t0, 1000, "a held put", rc);
  if (rc != FERRY_ETIMEDOUT)
    fail_msg("a held put: %s (%s), not a timeout", ferry_status_name(rc), ferry_last_error());
  proxy_wait_held(p);
}

/* The held put runs now: whether it applied. */
static bool put_runs_late(proxy *p) {
  json_t *j = proxy_run_late(p);
  bool applied = json_is_true(json_object_get(j, "succeeded"));
  json_decref(j);
  return applied;
}

/* A node and its object (generation 1). A put of generation 2 is held, the object deleted (which
 * returned 0), then the held put runs: the key stays deleted. A put of generation 3 held, one of
 * generation 4 that returned: 4 stays. A put of a key never put held, a delete of it (not found),
 * the held put run: the key stays absent. */
static void test_etcd_late_put(void **state) {
  (void)state;
  su_etcd e;
  proxy p;
  fr_dir *d;
  if (!setup(&e, &p, &d))
    return;
  fr_dir_node n = node_named("late-owner", 7);
  FR_OK(d->ops->node_put(d->state, &n, 30000, 0, NULL, 5000));
  fr_dir_object o = object_of("late/key", n.name, 1);
  FR_OK(d->ops->obj_put(d->state, &o, 0, NULL, NULL, 5000));
  assert_int_equal(generation_of(d, "late/key"), 1);

  put_held(&p, d, "late/key", n.name, 2);
  FR_OK(d->ops->obj_del(d->state, "late/key", n.name, 0, NULL, 5000));
  bool applied = put_runs_late(&p);
  uint64_t gen = generation_of(d, "late/key");
  if (gen != 0)
    fail_msg("a put run late brought back a key deleted since (generation %llu; it %s)",
             (unsigned long long)gen, applied ? "applied" : "did not apply");
  assert_false(applied);

  put_held(&p, d, "late/key", n.name, 3);
  o.generation = 4;
  FR_OK(d->ops->obj_put(d->state, &o, 0, NULL, NULL, 5000));
  assert_false(put_runs_late(&p));
  assert_int_equal(generation_of(d, "late/key"), 4);

  put_held(&p, d, "late/never", n.name, 1);
  assert_int_equal(d->ops->obj_del(d->state, "late/never", n.name, 0, NULL, 5000), FERRY_ENOTFOUND);
  assert_false(put_runs_late(&p));
  assert_int_equal(generation_of(d, "late/never"), 0);

  o.generation = 5; /* and a put sent after the delete lands, as ever */
  FR_OK(d->ops->obj_put(d->state, &o, 0, NULL, NULL, 5000));
  assert_int_equal(generation_of(d, "late/key"), 5);
  FR_OK(d->ops->node_del(d->state, n.name, n.incarnation, 5000));
  teardown(&e, &p, d);
}

/* A node and its object (generation 1). A delete of it by any owner (owner "", as
 * ferry_mq_unsubscribe deletes) is held, a put of generation 2 returns, then the held delete runs:
 * generation 2 stays (an unconditional delete run late removed it). */
static void test_etcd_late_delete(void **state) {
  (void)state;
  su_etcd e;
  proxy p;
  fr_dir *d;
  if (!setup(&e, &p, &d))
    return;
  fr_dir_node n = node_named("late-deleter", 8);
  FR_OK(d->ops->node_put(d->state, &n, 30000, 0, NULL, 5000));
  fr_dir_object o = object_of("late/deleted", n.name, 1);
  FR_OK(d->ops->obj_put(d->state, &o, 0, NULL, NULL, 5000));
  proxy_hold(&p, "/v3/kv/txn");
  int rc = d->ops->obj_del(d->state, "late/deleted", "", 0, NULL, 1000);
  if (rc != FERRY_ETIMEDOUT)
    fail_msg("a held delete: %s (%s), not a timeout", ferry_status_name(rc), ferry_last_error());
  proxy_wait_held(&p);
  o.generation = 2;
  FR_OK(d->ops->obj_put(d->state, &o, 0, NULL, NULL, 5000));
  json_t *j = proxy_run_late(&p);
  bool applied = json_is_true(json_object_get(j, "succeeded"));
  json_decref(j);
  uint64_t gen = generation_of(d, "late/deleted");
  if (gen != 2)
    fail_msg("a delete run late removed a put acknowledged since (generation %llu; it %s)",
             (unsigned long long)gen, applied ? "applied" : "did not apply");
  assert_false(applied);
  FR_OK(d->ops->obj_del(d->state, "late/deleted", "", 0, NULL, 5000)); /* as ever otherwise */
  assert_int_equal(generation_of(d, "late/deleted"), 0);
  assert_int_equal(d->ops->obj_del(d->state, "late/deleted", "", 0, NULL, 5000), FERRY_ENOTFOUND);
  FR_OK(d->ops->node_del(d->state, n.name, n.incarnation, 5000));
  teardown(&e, &p, d);
}

/* The txns the proxy relayed so far. */
static int txns(proxy *p) {
  pthread_mutex_lock(&p->lock);
  int n = p->txns;
  pthread_mutex_unlock(&p->lock);
  return n;
}

/* The delete marker of an object key as the client picks it (etcd_client.c's marker_of). */
static unsigned marker(const char *key) {
  uint32_t h = 2166136261u;
  for (const unsigned char *c = (const unsigned char *)key; *c; c++)
    h = (h ^ *c) * 16777619u;
  return h % 256;
}

/* A batch of 10 puts of one owner goes in one txn; when another client deleted a key that
 * shares its delete marker with one of them since this client last heard from etcd, that txn
 * fails its compare, and the batch is sent again whole: two txns, every put landed (not one txn
 * and then ten, put by put). */
static void test_etcd_batch_after_delete(void **state) {
  (void)state;
  su_etcd e;
  proxy p;
  fr_dir *d, *other;
  if (!setup(&e, &p, &d))
    return;
  char url[600];
  snprintf(url, sizeof url, "etcd://%s", e.endpoints);
  FR_OK(fr_dir_open(NULL, url, 5000, &other));
  fr_dir_node n = node_named("batcher", 9);
  FR_OK(d->ops->node_put(d->state, &n, 30000, 0, NULL, 5000));
  enum { N = 10 };
  fr_dir_object objs[N], replaced[N];
  int status[N];
  bool had_other[N];
  for (int i = 0; i < N; i++) {
    char key[32];
    snprintf(key, sizeof key, "batch/%d", i);
    objs[i] = object_of(key, n.name, 1);
  }
  char twin[32] = ""; /* another key with batch/0's marker */
  for (int i = 0; !twin[0] && i < 100000; i++) {
    char k[32];
    snprintf(k, sizeof k, "twin/%d", i);
    if (marker(k) == marker("batch/0"))
      snprintf(twin, sizeof twin, "%s", k);
  }
  assert_true(twin[0] != '\0');
  int before = txns(&p);
  FR_OK(d->ops->obj_put_batch(d->state, objs, N, 0, status, replaced, had_other, 5000));
  assert_int_equal(txns(&p) - before, 1);
  assert_int_equal(other->ops->obj_del(other->state, twin, "", 0, NULL, 5000), FERRY_ENOTFOUND);
  for (int i = 0; i < N; i++)
    objs[i].generation = 2;
  before = txns(&p);
  FR_OK(d->ops->obj_put_batch(d->state, objs, N, 0, status, replaced, had_other, 5000));
  for (int i = 0; i < N; i++) {
    assert_int_equal(status[i], 0);
    assert_int_equal(generation_of(d, objs[i].key), 2);
  }
  assert_int_equal(txns(&p) - before, 2);
  FR_OK(d->ops->node_del(d->state, n.name, n.incarnation, 5000));
  fr_dir_close(other);
  teardown(&e, &p, d);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_etcd_renewal_beside_held_call),
      cmocka_unit_test(test_etcd_call_beside_held_call),
      cmocka_unit_test(test_etcd_late_put),
      cmocka_unit_test(test_etcd_late_delete),
      cmocka_unit_test(test_etcd_batch_after_delete),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, NULL, NULL);
}
