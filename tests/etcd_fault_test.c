/*
 * The etcd:// directory under faults (issue 36 deliverable 2), each case against its own
 * three-member cluster on loopback (tests/etcd/cluster.sh, 50 ms heartbeats, 500 ms elections):
 * - the leader SIGKILLed in the middle of a run of store puts and gets and refit pushes to two
 *   receivers: the calls go on after the election, every put that returned 0 is still served with
 *   its bytes, the receivers report the last version a push returned as committed (and a receiver
 *   opened by name after the election finds the sender), and no call returns later than its
 *   timeout plus a scheduling allowance;
 * - two members of three SIGSTOPped (the quorum lost): every call fails within its timeout with
 *   an error naming etcd and the cluster's state, a lookup is never answered "absent"; after one
 *   member's SIGCONT the calls succeed again and nothing acknowledged is lost;
 * - leases across an election: a node that keeps renewing keeps its registration (its keep-alives
 *   reach the new leader), a node that stopped renewing loses its node and objects once its
 *   lease lapses.
 * The times (to the first success after the kill, after SIGCONT, to the dead node's keys going)
 * are printed for docs/RELIABILITY.md, never asserted. tests/faults/run.sh runs these cases.
 */
#include "testutil.h"

#include "directory/directory.h"
#include "etcdutil.h"
#include "storeutil.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MiB (1024 * 1024)
#define CALL_MS 1000  /* the timeout of each call made while the cluster is hurt */
#define VAL_BYTES 256 /* a put's value */
#define RUN_S 25      /* a hang detector for the loops: they end long before */
#define NTENSORS 4    /* the refit sender's model */
#define TENSOR_N 3000 /* floats per tensor */

/* ---- helpers ---- */

static ferry_ctx *open_ctx(const char *name) {
  ferry_ctx_opts o = {.size = sizeof o, .name = name, .token = ""};
  ferry_ctx *c = NULL;
  FR_OK(ferry_ctx_open(&o, &c));
  return c;
}

static ferry_store *open_store(ferry_ctx *c, const char *url, int lease_ms) {
  ferry_store_opts o = {
      .size = sizeof o, .directory = url, .capacity = 4 * MiB, .lease_ms = lease_ms};
  ferry_store *s = NULL;
  FR_OK(ferry_store_open(c, &o, &s));
  return s;
}

static double ms_between(uint64_t a, uint64_t b) { return (double)(b - a) / 1e6; }

/* Fails the test when a call took longer than its timeout plus the scheduling allowance (a
 * bound, not a figure): 300 ms in a plain build, which holds the promise to it; under a sanitizer
 * (tu_allowance_ms) the timeout again, so that a loaded machine's slowness alone never fails it,
 * while a call that waits on a dead or stopped member past that still does. */
static void within(uint64_t t0, int timeout_ms, const char *what, int rc) {
  double ms = ms_between(t0, fr_now_ns()), slack = tu_allowance_ms(timeout_ms, 300.0);
  if (ms > timeout_ms + slack)
    fail_msg("%s returned %s after %.0f ms, past its %d ms timeout (+%.0f ms allowance): %s", what,
             ferry_status_name(rc), ms, timeout_ms, slack, rc ? ferry_last_error() : "");
}

/* A put of VAL_BYTES bytes made from seed, timed against CALL_MS. */
static int put_seed(ferry_store *s, const char *key, uint64_t seed) {
  uint8_t v[VAL_BYTES];
  tu_fill(v, sizeof v, seed);
  ferry_tensor_desc d = {.dtype = FERRY_DTYPE_U8, .ndim = 1, .shape = {VAL_BYTES}};
  uint64_t t0 = fr_now_ns();
  int rc = ferry_store_put(s, key, &d, v, 0, CALL_MS);
  within(t0, CALL_MS, "a put", rc);
  return rc;
}

/* A get, timed against timeout_ms: 0 with the bytes of seed, or the error; wrong bytes or size
 * fail the test at once (never torn, never another version's). */
static int get_seed(ferry_store *s, const char *key, uint64_t seed, int timeout_ms) {
  uint8_t v[VAL_BYTES], want[VAL_BYTES];
  ferry_store_info info = {.size = sizeof info};
  uint64_t t0 = fr_now_ns();
  int rc = ferry_store_get(s, key, NULL, v, sizeof v, &info, timeout_ms);
  within(t0, timeout_ms, "a get", rc);
  if (rc != 0)
    return rc;
  tu_fill(want, sizeof want, seed);
  if (info.bytes != VAL_BYTES || memcmp(v, want, sizeof v) != 0)
    fail_msg("get '%s': %llu bytes, not the ones put", key, (unsigned long long)info.bytes);
  return 0;
}

/* An error while the cluster cannot answer: a timeout or no connection, never "absent", its
 * detail naming etcd. */
static void failed_clearly(int rc, const char *what) {
  if (rc != FERRY_ETIMEDOUT && rc != FERRY_ECONNECT)
    fail_msg("%s: %s (%s), not a timeout or no connection", what, ferry_status_name(rc),
             ferry_last_error());
  assert_non_null(strstr(ferry_last_error(), "etcd"));
}

/* ---- the refit side: a sender of NTENSORS tensors published by name, two receivers ---- */

typedef struct model {
  float w[NTENSORS][TENSOR_N];
  ferry_tensor_desc d;
  char name[NTENSORS][16];
} model;

static void model_set(model *m, uint64_t version) {
  for (int i = 0; i < NTENSORS; i++)
    for (int k = 0; k < TENSOR_N; k++)
      m->w[i][k] = (float)((k * 7 + i * 13 + (int)version * 101) % 1000);
}

static ferry_refit_sender *open_sender(ferry_ctx *c, model *m, const char *url) {
  m->d = (ferry_tensor_desc){.dtype = FERRY_DTYPE_F32, .ndim = 1, .shape = {TENSOR_N}};
  ferry_refit_opts o = {.size = sizeof o, .bucket_bytes = 16384, .publish = 1, .directory = url};
  ferry_refit_sender *s;
  FR_OK(ferry_refit_sender_open(c, "etcd-fault-policy", &o, &s));
  for (int i = 0; i < NTENSORS; i++) {
    snprintf(m->name[i], sizeof m->name[i], "layer.%d", i);
    FR_OK(ferry_refit_declare(s, m->name[i], &m->d, m->w[i], FERRY_DTYPE_INVALID));
  }
  FR_OK(ferry_refit_seal(s));
  return s;
}

static ferry_refit_receiver *open_receiver(ferry_ctx *c) {
  ferry_refit_receiver *r;
  FR_OK(ferry_refit_receiver_open(c, "etcd-fault-policy", 5000, &r));
  FR_OK(ferry_refit_bind_flat(r));
  return r;
}

/* r reports `version` committed and holds m's bytes. */
static void holds(ferry_refit_receiver *r, const model *m, uint64_t version) {
  uint64_t have = 0;
  FR_OK(ferry_refit_wait(r, version, 5000, &have));
  assert_int_equal(have, version);
  for (int i = 0; i < NTENSORS; i++) {
    void *p;
    FR_OK(ferry_refit_view(r, m->name[i], &p));
    if (memcmp(p, m->w[i], sizeof m->w[i]) != 0)
      fail_msg("receiver: tensor %d is not version %llu's", i, (unsigned long long)version);
  }
}

/* A push of `version` (m set to it first), timed against its timeout. */
static int push(ferry_refit_sender *s, model *m, uint64_t version) {
  model_set(m, version);
  ferry_refit_push_opts o = {.size = sizeof o, .timeout_ms = CALL_MS};
  uint64_t t0 = fr_now_ns();
  int rc = ferry_refit_push(s, version, &o);
  within(t0, CALL_MS, "a push", rc);
  return rc;
}

/* ---- the leader killed mid-run ---- */

typedef struct killer {
  su_etcd *e;
  int member, after_ms;
  uint64_t at; /* atomic: when the SIGKILL went */
} killer;

static void *kill_later(void *arg) {
  killer *k = arg;
  su_sleep_ms(k->after_ms);
  uint64_t now = fr_now_ns();
  if (su_etcd_signal(k->e, k->member, SIGKILL))
    __atomic_store_n(&k->at, now, __ATOMIC_RELEASE);
  return NULL;
}

#define RUN_KEYS 4096

/* Puts (a writer's store), gets of what was just put (a reader's) and pushes (a sender to two
 * receivers, all found through etcd://) run back to back; a thread SIGKILLs the leader 300 ms in.
 * The run goes on until every kind of call succeeded after the kill and a writer's lease (2 s)
 * passed more than once after that. Then every put that returned 0 is served whole, and the
 * receivers (and one opened by name now) report the last version pushed. */
static void test_etcd_leader_killed(void **state) {
  (void)state;
  su_etcd e;
  if (!su_etcd_start(&e, 3))
    return;
  setenv("FERRY_DIRECTORY", e.url, 1);
  ferry_ctx *cw = open_ctx("etcd-writer"), *cr = open_ctx("etcd-reader");
  ferry_ctx *cs = open_ctx("etcd-trainer"), *c1 = open_ctx("etcd-rollout-1"),
            *c2 = open_ctx("etcd-rollout-2");
  ferry_store *w = open_store(cw, e.url, 2000), *r = open_store(cr, e.url, 0);
  static model m;
  ferry_refit_sender *s = open_sender(cs, &m, e.url);
  ferry_refit_receiver *rx[2] = {open_receiver(c1), open_receiver(c2)};
  for (int i = 0; i < 1000 && ferry_refit_receivers(s) != 2; i++)
    su_sleep_ms(10);
  assert_int_equal(ferry_refit_receivers(s), 2);
  uint64_t version = 1;
  FR_OK(push(s, &m, version));
  static bool acked[RUN_KEYS];
  char key[64];
  int leader = su_etcd_leader(&e);
  assert_true(leader > 0);
  killer k = {.e = &e, .member = leader, .after_ms = 300};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, kill_later, &k), 0);
  uint64_t start = fr_now_ns(), put_back = 0, get_back = 0, push_back = 0, killed = 0;
  int failed_puts = 0, failed_gets = 0, last = -1, n = 0;
  for (; n < RUN_KEYS && ms_between(start, fr_now_ns()) < RUN_S * 1000.0; n++) {
    killed = __atomic_load_n(&k.at, __ATOMIC_ACQUIRE);
    if (killed && put_back && get_back && push_back && ms_between(killed, fr_now_ns()) > 5000)
      break;
    snprintf(key, sizeof key, "run/%d", n);
    int rc = put_seed(w, key, 1000 + (uint64_t)n);
    acked[n] = rc == 0;
    last = rc == 0 ? n : last;
    if (rc != 0 && rc != FERRY_ETIMEDOUT && rc != FERRY_ECONNECT)
      fail_msg("a put during the election: %s (%s), not a timeout or no connection",
               ferry_status_name(rc), ferry_last_error());
    if (rc != 0 && failed_puts++ < 2)
      print_message("a put during the election: %s: %s\n", ferry_status_name(rc),
                    ferry_last_error());
    if (rc == 0 && killed && !put_back)
      put_back = fr_now_ns();
    if (last >= 0) { /* what was acknowledged last, looked up anew (not cached: just put) */
      snprintf(key, sizeof key, "run/%d", last);
      rc = get_seed(r, key, 1000 + (uint64_t)last, CALL_MS);
      if (rc != 0 && rc != FERRY_ETIMEDOUT && rc != FERRY_ECONNECT)
        fail_msg("get '%s' of a put that returned 0: %s (%s)", key, ferry_status_name(rc),
                 ferry_last_error());
      if (rc != 0 && failed_gets++ < 2)
        print_message("a get during the election: %s: %s\n", ferry_status_name(rc),
                      ferry_last_error());
      if (rc == 0 && killed && !get_back && put_back)
        get_back = fr_now_ns();
    }
    rc = push(s, &m, ++version); /* the receivers are attached: no directory call in a push */
    if (rc != 0)
      fail_msg("push %llu: %s (%s)", (unsigned long long)version, ferry_status_name(rc),
               ferry_last_error());
    if (killed && !push_back)
      push_back = fr_now_ns();
  }
  pthread_join(t, NULL);
  assert_true(killed != 0);
  if (!put_back || !get_back)
    fail_msg("no put and get succeeded within %d s of the leader's SIGKILL", RUN_S);
  print_message("leader (member %d) SIGKILLed: puts back after %.0f ms, gets after %.0f ms, pushes "
                "after %.0f ms; %d puts and %d gets failed meanwhile, %d rounds in all\n",
                leader, ms_between(killed, put_back), ms_between(killed, get_back),
                ms_between(killed, push_back), failed_puts, failed_gets, n);
  int served = 0;
  for (int i = 0; i < n; i++) { /* nothing acknowledged is lost (nor changed) */
    if (!acked[i])
      continue;
    snprintf(key, sizeof key, "run/%d", i);
    int rc = get_seed(r, key, 1000 + (uint64_t)i, 5000);
    if (rc != 0)
      fail_msg("'%s' was put (0) and is lost: %s (%s)", key, ferry_status_name(rc),
               ferry_last_error());
    served++;
  }
  for (int i = 0; i < 2; i++)
    holds(rx[i], &m, version);
  ferry_ctx *c3 = open_ctx("etcd-rollout-3"); /* the sender's name outlived the election */
  ferry_refit_receiver *late = open_receiver(c3);
  holds(late, &m, version);
  print_message("%d acknowledged puts all served; 3 receivers hold version %llu\n", served,
                (unsigned long long)version);
  ferry_refit_receiver_close(late);
  ferry_ctx_close(c3);
  for (int i = 0; i < 2; i++)
    ferry_refit_receiver_close(rx[i]);
  ferry_refit_sender_close(s);
  ferry_store_close(r);
  ferry_store_close(w);
  ferry_ctx_close(c2);
  ferry_ctx_close(c1);
  ferry_ctx_close(cs);
  ferry_ctx_close(cr);
  ferry_ctx_close(cw);
  unsetenv("FERRY_DIRECTORY");
  su_etcd_stop(&e);
}

/* ---- two members of three stopped: the quorum lost ---- */

/* What a call says while no quorum answers: etcd and its state, not only the last member's
 * silence. */
static void names_quorum(const char *what) {
  if (!strstr(ferry_last_error(), "quorum"))
    fail_msg("%s: the error does not say the cluster has no quorum: %s", what, ferry_last_error());
}

/* Directory calls while no quorum answers: each fails within its timeout, clearly. */
static void calls_fail(fr_dir *d, ferry_store *w, ferry_store *r, const char **said) {
  fr_dir_node got;
  uint64_t t0 = fr_now_ns();
  int rc = d->ops->node_get(d->state, "etcd-writer", &got, CALL_MS);
  within(t0, CALL_MS, "a node lookup", rc);
  failed_clearly(rc, "a node lookup without a quorum");
  names_quorum("a node lookup");
  static char first[1024];
  snprintf(first, sizeof first, "%s", ferry_last_error());
  *said = first;
  const char *keys[1] = {"q/never-put"};
  fr_dir_object o;
  int st = 0;
  t0 = fr_now_ns();
  rc = d->ops->obj_get(d->state, keys, 1, &o, &st, CALL_MS);
  within(t0, CALL_MS, "an object lookup", rc);
  failed_clearly(rc, "an object lookup without a quorum");
  names_quorum("an object lookup");
  /* a store's lease renewals go on a connection of their own (and its calls on the first free
   * of a few): a call is sent, and its error says what etcd did */
  failed_clearly(put_seed(w, "q/after", 99), "a put without a quorum");
  failed_clearly(get_seed(r, "q/never-put", 0, CALL_MS), "a get of a key never put");
}

/* The writer's keys put before, and one put now, are served; a key never put is absent. */
static void all_served(ferry_store *w, ferry_store *r, int before) {
  char key[32];
  for (int i = 0; i < before; i++) {
    snprintf(key, sizeof key, "q/%d", i);
    FR_OK(get_seed(r, key, 500 + (uint64_t)i, 5000));
  }
  assert_int_equal(get_seed(r, "q/never-put", 0, 5000), FERRY_ENOTFOUND);
}

/* For ms, key is served with seed's bytes by every get: a put that failed while the quorum was
 * lost (its request left with a stopped member, which runs it when it resumes) must not replace
 * the one that returned 0 since. */
static void served_for(ferry_store *r, const char *key, uint64_t seed, int ms) {
  uint64_t start = fr_now_ns();
  while (ms_between(start, fr_now_ns()) < ms) {
    int rc = get_seed(r, key, seed, CALL_MS);
    if (rc != 0)
      fail_msg("'%s' was put (0) and is not served %.0f ms after the last member resumed: %s (%s)",
               key, ms_between(start, fr_now_ns()), ferry_status_name(rc), ferry_last_error());
    su_sleep_ms(50);
  }
}

/* Signals member m and waits (at most 5 s) until it is stopped (SIGSTOP) or gone (SIGKILL), as
 * /proc says: no call is made to a member the signal has not reached yet. */
static void signal_member(su_etcd *e, int m, int sig) {
  char path[160], line[512];
  int pid = su_etcd_pid(e, m);
  if (pid <= 0)
    fail_msg("member %d is not running (see %s/m%d.log)", m, e->dir, m);
  assert_int_equal(kill(pid, sig), 0);
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  for (int i = 0; i < 500; i++) {
    FILE *f = fopen(path, "r");
    char *close_paren = f && fgets(line, sizeof line, f) ? strrchr(line, ')') : NULL;
    char state = close_paren ? close_paren[2] : 'X';
    if (f)
      fclose(f);
    if (sig == SIGSTOP ? state == 'T' : state == 'Z' || state == 'X')
      return;
    su_sleep_ms(10);
  }
  fail_msg("member %d did not take signal %d", m, sig);
}

/* Puts key (seed 99) until one succeeds (at most RUN_S): when it did, after `from`. Each fails
 * only with a timeout or no connection. */
static uint64_t put_until_back(ferry_store *w, const char *key, int *failed) {
  uint64_t start = fr_now_ns();
  while (ms_between(start, fr_now_ns()) < RUN_S * 1000.0) {
    int rc = put_seed(w, key, 99);
    if (rc == 0)
      return fr_now_ns();
    if (rc != FERRY_ETIMEDOUT && rc != FERRY_ECONNECT)
      fail_msg("a put while the quorum returns: %s (%s)", ferry_status_name(rc),
               ferry_last_error());
    (*failed)++;
  }
  fail_msg("no put succeeded within %d s of a member's return", RUN_S);
  return 0;
}

/* The leader and one follower SIGSTOPped: a node lookup, an object lookup, a put and a get of a
 * key never put each fail within their 1 s with FERRY_ETIMEDOUT or FERRY_ECONNECT naming etcd and
 * the lost quorum (a lookup is never answered "absent"). The follower's SIGCONT brings a quorum
 * back: a put succeeds again (the time printed), then the leader's SIGCONT, and every key put
 * before is served with its bytes. Then the same with two members SIGKILLed (the new leader among
 * them: refused connections beside a silent member) and one restarted on its data. */
static void test_etcd_quorum_lost(void **state) {
  (void)state;
  su_etcd e;
  if (!su_etcd_start(&e, 3))
    return;
  ferry_ctx *cw = open_ctx("etcd-writer"), *cr = open_ctx("etcd-reader");
  ferry_store *w = open_store(cw, e.url, 0), *r = open_store(cr, e.url, 0);
  fr_dir *d;
  FR_OK(fr_dir_open(NULL, e.url, 5000, &d));
  enum { BEFORE = 8 };
  char key[32];
  for (int i = 0; i < BEFORE; i++) {
    snprintf(key, sizeof key, "q/%d", i);
    FR_OK(put_seed(w, key, 500 + (uint64_t)i));
  }
  all_served(w, r, BEFORE);
  int leader = su_etcd_leader(&e), other = leader % 3 + 1, failed = 0;
  assert_true(leader > 0);
  signal_member(&e, leader, SIGSTOP);
  signal_member(&e, other, SIGSTOP);
  const char *said = NULL;
  calls_fail(d, w, r, &said);
  print_message("no quorum (members %d and %d stopped): %s\n", leader, other, said);
  uint64_t cont = fr_now_ns();
  assert_true(su_etcd_signal(&e, other, SIGCONT));
  uint64_t back = put_until_back(w, "q/after", &failed);
  assert_true(su_etcd_signal(&e, leader, SIGCONT));
  print_message("quorum back (member %d SIGCONTed): a put succeeded after %.0f ms (%d failed "
                "first)\n",
                other, ms_between(cont, back), failed);
  served_for(r, "q/after", 99, 1000);
  all_served(w, r, BEFORE);
  leader = su_etcd_leader(&e), other = leader % 3 + 1, failed = 0;
  assert_true(leader > 0);
  signal_member(&e, leader, SIGKILL);
  signal_member(&e, other, SIGKILL);
  calls_fail(d, w, r, &said);
  uint64_t restart = fr_now_ns();
  assert_int_equal(su_etcd_sh(&e, "restart", other), 0);
  back = put_until_back(w, "q/after", &failed);
  print_message("members %d and %d SIGKILLed: %s; member %d restarted: a put succeeded after "
                "%.0f ms (%d failed first)\n",
                leader, other, said, other, ms_between(restart, back), failed);
  all_served(w, r, BEFORE);
  fr_dir_close(d);
  ferry_store_close(r);
  ferry_store_close(w);
  ferry_ctx_close(cr);
  ferry_ctx_close(cw);
  su_etcd_stop(&e);
}

/* ---- leases across an election ---- */

static fr_dir_node node_named(const char *name, uint64_t incarnation) {
  fr_dir_node n;
  memset(&n, 0, sizeof n);
  snprintf(n.name, sizeof n.name, "%s", name);
  snprintf(n.address, sizeof n.address, "tcp://127.0.0.1:1");
  n.incarnation = incarnation;
  return n;
}

static fr_dir_object object_of(const char *key, const char *owner) {
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
  o.generation = 1;
  return o;
}

/* Whether object key is in the directory (a lookup that fails fails the test). */
static bool object_there(fr_dir *d, const char *key) {
  const char *keys[1] = {key};
  fr_dir_object o;
  int st = 0;
  FR_OK(d->ops->obj_get(d->state, keys, 1, &o, &st, 5000));
  return st == 0;
}

#define LEASE_MS 2000

/* Two nodes with a 2 s lease and an object each; the leader is SIGKILLed. One node renews every
 * 300 ms (each renewal within its timeout; those during the election may fail), the other never.
 * The silent one's node and object go (polled, at most RUN_S); the renewing one, more than two
 * leases after the kill, is still registered as the same incarnation with its object. */
static void test_etcd_lease_election(void **state) {
  (void)state;
  su_etcd e;
  if (!su_etcd_start(&e, 3))
    return;
  fr_dir *d;
  FR_OK(fr_dir_open(NULL, e.url, 5000, &d));
  fr_dir_node alive = node_named("lease-alive", 11), dead = node_named("lease-dead", 22);
  FR_OK(d->ops->node_put(d->state, &alive, LEASE_MS, 0, NULL, 5000));
  FR_OK(d->ops->node_put(d->state, &dead, LEASE_MS, 0, NULL, 5000));
  fr_dir_object oa = object_of("alive/obj", "lease-alive"),
                od = object_of("dead/obj", "lease-dead");
  FR_OK(d->ops->obj_put(d->state, &oa, 0, NULL, NULL, 5000));
  FR_OK(d->ops->obj_put(d->state, &od, 0, NULL, NULL, 5000));
  assert_true(object_there(d, "alive/obj"));
  assert_true(object_there(d, "dead/obj"));
  int leader = su_etcd_leader(&e);
  assert_true(leader > 0);
  uint64_t killed = fr_now_ns(), renewed = 0, gone = 0;
  assert_true(su_etcd_signal(&e, leader, SIGKILL));
  int failed = 0;
  while (ms_between(killed, fr_now_ns()) < RUN_S * 1000.0) {
    uint64_t t0 = fr_now_ns();
    int rc = d->ops->node_renew(d->state, alive.name, alive.incarnation, LEASE_MS, 500);
    within(t0, 500, "a renewal", rc);
    if (rc == FERRY_ENOTFOUND)
      fail_msg("the renewing node lost its registration: %s", ferry_last_error());
    if (rc == 0 && !renewed)
      renewed = fr_now_ns();
    failed += rc != 0;
    fr_dir_node got;
    t0 = fr_now_ns();
    rc = d->ops->node_get(d->state, dead.name, &got, 500);
    within(t0, 500, "a node lookup", rc);
    if (rc == FERRY_ENOTFOUND && !gone) {
      gone = fr_now_ns();
      assert_false(object_there(d, "dead/obj")); /* bound to the same lease */
    }
    if (gone && renewed && ms_between(killed, fr_now_ns()) > 2.5 * LEASE_MS)
      break;
    su_sleep_ms(300);
  }
  if (!gone)
    fail_msg("the silent node's lease (%d ms) never lapsed after the election", LEASE_MS);
  assert_true(renewed != 0);
  fr_dir_node got;
  FR_OK(d->ops->node_get(d->state, alive.name, &got, 5000));
  assert_int_equal(got.incarnation, alive.incarnation);
  assert_true(object_there(d, "alive/obj"));
  print_message("leader (member %d) SIGKILLed: the first renewal landed after %.0f ms (%d "
                "failed); the silent node's keys went after %.0f ms (lease %d ms); the renewing "
                "one kept its registration %.0f ms\n",
                leader, ms_between(killed, renewed), failed, ms_between(killed, gone), LEASE_MS,
                ms_between(killed, fr_now_ns()));
  FR_OK(d->ops->node_del(d->state, alive.name, alive.incarnation, 5000));
  fr_dir_close(d);
  su_etcd_stop(&e);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_etcd_leader_killed),
      cmocka_unit_test(test_etcd_quorum_lost),
      cmocka_unit_test(test_etcd_lease_election),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, NULL, NULL);
}
