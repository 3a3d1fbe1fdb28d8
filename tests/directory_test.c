/*
 * The directory: the record codec, then every operation against each backend — the embedded
 * server in-process, the embedded server over a link, and Redis (a private redis-server on a
 * loopback port; skipped with a message when the binary is absent) — plus leases lapsing, a
 * restarted server, and directories that are not there.
 */
// ferry-test: threaded
#include "directory/dirwire.h"
#include "directory/table.h"
#include "storeutil.h"

#include <string.h>

static fr_dir_object make_obj(const char *key, const char *owner, uint64_t gen) {
  fr_dir_object o;
  memset(&o, 0, sizeof o);
  snprintf(o.key, sizeof o.key, "%s", key);
  snprintf(o.owner, sizeof o.owner, "%s", owner);
  o.desc.dtype = FERRY_DTYPE_U8;
  o.desc.ndim = 2;
  o.desc.shape[0] = 4;
  o.desc.shape[1] = 8;
  o.bytes = 32;
  o.region = (ferry_region_ref){.id = 3, .key = 0xabc, .size = 4096};
  o.offset = 64;
  o.gen_region = (ferry_region_ref){.id = 3, .key = 0xabc, .size = 4096};
  o.gen_offset = 8;
  o.generation = gen;
  return o;
}

static fr_dir_node make_node(const char *name) {
  fr_dir_node n;
  memset(&n, 0, sizeof n);
  snprintf(n.name, sizeof n.name, "%s", name);
  snprintf(n.address, sizeof n.address, "tcp://127.0.0.1:1,shm://@x-%s", name);
  n.incarnation = 1000 + (uint64_t)strlen(name);
  n.access_len = 40; /* opaque bytes, zeros and 0xff among them */
  for (int i = 0; i < n.access_len; i++)
    n.access[i] = (uint8_t)(i * 37 + (int)strlen(name));
  return n;
}

static void test_codec(void **state) {
  fr_dir_object o = make_obj("routing/r1/layer0", "rollout-3", 7), back;
  fr_wr w = {0};
  fr_wr_object(&w, &o);
  fr_rd r = fr_rd_init(w.p, w.len);
  assert_true(fr_rd_object(&r, &back));
  assert_true(fr_rd_done(&r));
  assert_string_equal(back.key, o.key);
  assert_int_equal(back.generation, 7);
  assert_int_equal(back.desc.shape[1], 8);
  /* every truncation fails, never reads past the end */
  for (size_t n = 0; n < w.len; n++) {
    fr_rd t = fr_rd_init(w.p, n);
    assert_false(fr_rd_object(&t, &back) && fr_rd_done(&t));
  }
  fr_wr_free(&w);
  /* inconsistent records are refused: bytes vs shape, range outside the region, generation 0 */
  fr_dir_object bad[3] = {o, o, o};
  bad[0].bytes = 33;
  bad[1].offset = 4090;
  bad[2].generation = 0;
  for (int i = 0; i < 3; i++) {
    fr_wr b = {0};
    fr_wr_object(&b, &bad[i]);
    fr_rd t = fr_rd_init(b.p, b.len);
    assert_false(fr_rd_object(&t, &back));
    fr_wr_free(&b);
  }
  assert_int_equal(fr_dir_key_check("", "t"), FERRY_EINVAL);
  assert_int_equal(fr_dir_key_check("a\nb", "t"), FERRY_EINVAL);
  char longkey[300];
  memset(longkey, 'k', sizeof longkey - 1);
  longkey[sizeof longkey - 1] = '\0';
  assert_int_equal(fr_dir_key_check(longkey, "t"), FERRY_EINVAL);
}

/* ---- the shared object table (table.h) ---- */

static uint64_t *table_new(void) {
  uint64_t *t = calloc(FR_DIR_TABLE_BYTES / 8, 8);
  assert_non_null(t);
  return t;
}

static bool table_says(uint64_t *t, const char *key, uint64_t gen) {
  fr_dir_object o;
  return fr_dir_table_read(fr_dir_table_slot(t, FR_DIR_TABLE_SLOTS, key), key, &o) &&
         o.generation == gen && strcmp(o.key, key) == 0;
}

/* What the server writes is read back; a put in flight (a ticket taken) hides it until the
 * posted record is in the slot, and the posted record shows only while its put is in flight. */
static void test_table_rules(void **state) {
  (void)state;
  uint64_t *t = table_new(), *slot = fr_dir_table_slot(t, FR_DIR_TABLE_SLOTS, "t/a");
  fr_dir_object a1 = make_obj("t/a", "n1", 7), a2 = make_obj("t/a", "n2", 9), o;
  assert_false(fr_dir_table_read(slot, "t/a", &o)); /* empty */
  fr_dir_table_publish(slot, "t/a", &a1);
  assert_true(table_says(t, "t/a", 7));
  uint64_t ticket = fr_dir_table_ticket(slot);
  assert_false(fr_dir_table_read(slot, "t/a", &o)); /* a put in flight, not in the slot */
  fr_dir_table_post(slot, ticket, &a2);
  assert_true(table_says(t, "t/a", 9));
  uint64_t second = fr_dir_table_ticket(slot); /* another one, not written (its slot was busy) */
  assert_false(fr_dir_table_read(slot, "t/a", &o));
  fr_dir_table_done(slot);
  fr_dir_table_done(slot); /* both applied, the second one refused: the server writes */
  (void)second;
  assert_false(fr_dir_table_read(slot, "t/a", &o)); /* posted, but nothing in flight */
  fr_dir_table_publish(slot, "t/a", &a2);
  assert_true(table_says(t, "t/a", 9));
  fr_dir_table_publish(slot, "t/other", NULL); /* another key's delete leaves it */
  assert_true(table_says(t, "t/a", 9));
  assert_false(fr_dir_table_read(slot, "t/b", &o)); /* another key in the slot: ask */
  fr_dir_table_publish(slot, "t/a", NULL);
  assert_false(fr_dir_table_read(slot, "t/a", &o));
  /* a posted record of a node that died with its put in flight is dropped with the node */
  fr_dir_table_post(slot, fr_dir_table_ticket(slot), &a1);
  assert_true(table_says(t, "t/a", 7));
  fr_dir_table_drop_owner(t, FR_DIR_TABLE_SLOTS, "n2");
  assert_true(table_says(t, "t/a", 7));
  fr_dir_table_drop_owner(t, FR_DIR_TABLE_SLOTS, "n1");
  assert_false(fr_dir_table_read(slot, "t/a", &o));
  free(t);
}

/* The slot is untrusted memory: a locked, oversized or corrupt slot is never taken for a record. */
static void test_table_rejects_garbage(void **state) {
  (void)state;
  uint64_t *t = table_new(), *slot = fr_dir_table_slot(t, FR_DIR_TABLE_SLOTS, "t/g");
  fr_dir_object g = make_obj("t/g", "n1", 5), o;
  fr_dir_table_publish(slot, "t/g", &g);
  assert_true(table_says(t, "t/g", 5));
  slot[0] |= 1; /* a writer inside (or one that died there) */
  assert_false(fr_dir_table_read(slot, "t/g", &o));
  fr_dir_table_publish(slot, "t/g", NULL); /* gives up on the stuck slot */
  slot[0]++;
  assert_true(table_says(t, "t/g", 5));
  uint64_t state_len = slot[4];
  slot[4] = (state_len & ~0xffffffffull) | 100000u; /* a length past the slot */
  assert_false(fr_dir_table_read(slot, "t/g", &o));
  slot[4] = state_len - 1; /* one byte short */
  assert_false(fr_dir_table_read(slot, "t/g", &o));
  slot[4] = state_len;
  assert_true(table_says(t, "t/g", 5));
  uint8_t *bytes = (uint8_t *)&slot[5];
  bytes[0] = 0xff; /* the key's length */
  assert_false(fr_dir_table_read(slot, "t/g", &o));
  fr_dir_table_publish(slot, "t/g", &g);
  size_t len = (size_t)(uint32_t)slot[4];
  bytes[len - 8 * 2 - 4] = 99; /* ndim */
  assert_false(fr_dir_table_read(slot, "t/g", &o));
  fr_dir_table_publish(slot, "t/g", NULL); /* a corrupt slot is emptied */
  assert_int_equal(slot[4] >> 32, FR_SLOT_EMPTY);
  slot[4] = (uint64_t)7 << 32 | 8; /* an unknown state */
  assert_false(fr_dir_table_read(slot, "t/g", &o));
  free(t);
}

static void test_server_rejects_garbage(void **state) {
  fr_dir_server *s = fr_dir_server_new("tcp://x:1");
  const uint8_t junk[] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  void *reply;
  size_t len;
  fr_dir_server_handle(s, junk, sizeof junk, &reply, &len);
  fr_rd r = fr_rd_init(reply, len);
  int st;
  char detail[256];
  assert_true(fr_rd_reply(&r, &st, detail, sizeof detail));
  assert_int_equal(st, FERRY_EPROTO);
  free(reply);
  fr_dir_server_free(s);
}

/* Waits until node `name` is gone (its lease lapsed); false after 10 s. */
static bool wait_node_gone(fr_dir *d, const char *name) {
  for (int i = 0; i < 1000; i++) {
    fr_dir_node n;
    if (d->ops->node_get(d->state, name, &n, 2000) == FERRY_ENOTFOUND)
      return true;
    su_sleep_ms(10);
  }
  return false;
}

static void check_nodes(fr_dir *d) {
  fr_dir_node n1 = make_node("n1"), got;
  FR_OK(d->ops->node_put(d->state, &n1, 30000, 0, NULL, 2000));
  FR_OK(d->ops->node_get(d->state, "n1", &got, 2000));
  assert_string_equal(got.address, n1.address);
  assert_int_equal(got.access_len, n1.access_len);
  assert_memory_equal(got.access, n1.access, n1.access_len);
  assert_int_equal(d->ops->node_get(d->state, "nobody", &got, 2000), FERRY_ENOTFOUND);
  fr_dir_node *list;
  size_t n;
  FR_OK(d->ops->node_list(d->state, &list, &n, 2000));
  assert_true(n >= 1);
  free(list);
  FR_OK(d->ops->node_renew(d->state, "n1", n1.incarnation, 30000, 2000));
  assert_int_equal(d->ops->node_renew(d->state, "ghost", 1, 30000, 2000), FERRY_ENOTFOUND);
}

static void check_objects(fr_dir *d) {
  fr_dir_node n2 = make_node("n2");
  fr_dir_object o = make_obj("k1", "n1", 1), got, old;
  bool other = true;
  FR_OK(d->ops->obj_put(d->state, &o, 0, &old, &other, 2000));
  assert_false(other);
  const char *keys[] = {"k1", "missing"};
  fr_dir_object out[2];
  int st[2];
  FR_OK(d->ops->obj_get(d->state, keys, 2, out, st, 2000));
  assert_int_equal(st[0], 0);
  assert_int_equal(st[1], FERRY_ENOTFOUND);
  assert_string_equal(out[0].owner, "n1");
  /* an unregistered owner cannot publish */
  fr_dir_object orphan = make_obj("k2", "n2", 1);
  assert_int_equal(d->ops->obj_put(d->state, &orphan, 0, NULL, NULL, 2000), FERRY_ENOTFOUND);
  /* another owner replaces the record and learns whose it was */
  FR_OK(d->ops->node_put(d->state, &n2, 30000, 0, NULL, 2000));
  fr_dir_object o2 = make_obj("k1", "n2", 5);
  FR_OK(d->ops->obj_put(d->state, &o2, 0, &old, &other, 2000));
  assert_true(other);
  assert_string_equal(old.owner, "n1");
  /* re-registration does not clobber it */
  assert_int_equal(d->ops->obj_put(d->state, &o, FR_DIR_PUT_KEEP_OTHERS, NULL, NULL, 2000),
                   FERRY_EEXIST);
  /* a batch: a new key, one another owner held, one of an unregistered owner */
  fr_dir_object batch[3] = {make_obj("kb1", "n1", 9), make_obj("k1", "n1", 10),
                            make_obj("kb2", "ghost", 1)};
  fr_dir_object olds[3];
  int bst[3];
  bool others[3];
  FR_OK(d->ops->obj_put_batch(d->state, batch, 3, 0, bst, olds, others, 2000));
  assert_int_equal(bst[0], 0);
  assert_false(others[0]);
  assert_int_equal(bst[1], 0);
  assert_true(others[1]);
  assert_string_equal(olds[1].owner, "n2");
  assert_int_equal(bst[2], FERRY_ENOTFOUND);
  const char *bkeys[] = {"kb1", "k1", "kb2"};
  fr_dir_object bout[3];
  FR_OK(d->ops->obj_get(d->state, bkeys, 3, bout, bst, 2000));
  assert_int_equal(bst[0], 0);
  assert_int_equal(bout[1].generation, 10);
  assert_int_equal(bst[2], FERRY_ENOTFOUND);
  FR_OK(d->ops->obj_del(d->state, "kb1", "", 0, NULL, 2000));
  o2 = make_obj("k1", "n2", 5); /* back as it was */
  FR_OK(d->ops->obj_put(d->state, &o2, 0, NULL, NULL, 2000));
  /* conditional deletes */
  assert_int_equal(d->ops->obj_del(d->state, "k1", "n1", 1, NULL, 2000), FERRY_ENOTFOUND);
  assert_int_equal(d->ops->obj_del(d->state, "k1", "n2", 4, NULL, 2000), FERRY_ENOTFOUND);
  FR_OK(d->ops->obj_del(d->state, "k1", "n2", 5, &got, 2000));
  assert_int_equal(got.generation, 5);
  assert_int_equal(d->ops->obj_get(d->state, keys, 1, out, st, 2000), 0);
  assert_int_equal(st[0], FERRY_ENOTFOUND);
}

static void check_scan_and_node_delete(fr_dir *d) {
  const char *names[] = {"a/2", "a/1", "b/1", "a*", "a/3"};
  for (int i = 0; i < 5; i++) {
    fr_dir_object o = make_obj(names[i], i < 3 ? "n2" : "n1", 1);
    FR_OK(d->ops->obj_put(d->state, &o, 0, NULL, NULL, 2000));
  }
  fr_dir_object *v;
  size_t n;
  FR_OK(d->ops->obj_scan(d->state, "a/", &v, &n, 2000));
  assert_int_equal(n, 3);
  assert_string_equal(v[0].key, "a/1");
  assert_string_equal(v[2].key, "a/3");
  free(v);
  FR_OK(d->ops->obj_scan(d->state, "a*", &v, &n, 2000)); /* glob characters are literal */
  assert_int_equal(n, 1);
  free(v);
  FR_OK(d->ops->node_del(d->state, "n2", 0, 2000));
  FR_OK(d->ops->obj_scan(d->state, "", &v, &n, 2000));
  assert_int_equal(n, 2); /* n1's "a*" and "a/3" */
  free(v);
  FR_OK(d->ops->obj_del(d->state, "a*", "", 0, NULL, 2000));
  FR_OK(d->ops->obj_del(d->state, "a/3", "", 0, NULL, 2000));
}

static void check_big_scan(fr_dir *d) {
  enum { N = 1300 };
  for (int i = 0; i < N; i++) {
    char key[32];
    snprintf(key, sizeof key, "many/%05d", i);
    fr_dir_object o = make_obj(key, "n1", (uint64_t)i + 1);
    FR_OK(d->ops->obj_put(d->state, &o, 0, NULL, NULL, 2000));
  }
  fr_dir_object *v;
  size_t n;
  FR_OK(d->ops->obj_scan(d->state, "many/", &v, &n, 5000));
  assert_int_equal(n, N);
  for (size_t i = 1; i < n; i++)
    assert_true(strcmp(v[i - 1].key, v[i].key) < 0);
  free(v);
  FR_OK(d->ops->node_del(d->state, "n1", 0, 2000));
  FR_OK(d->ops->obj_scan(d->state, "many/", &v, &n, 5000));
  assert_int_equal(n, 0);
  free(v);
}

static void check_lease(fr_dir *d) {
  fr_dir_node n3 = make_node("n3");
  FR_OK(d->ops->node_put(d->state, &n3, 300, 0, NULL, 2000));
  fr_dir_object o = make_obj("leased", "n3", 1);
  FR_OK(d->ops->obj_put(d->state, &o, 0, NULL, NULL, 2000));
  assert_true(wait_node_gone(d, "n3"));
  const char *k = "leased";
  fr_dir_object out;
  int st;
  for (int i = 0; i < 500; i++) { /* the object goes with (or right after) its node */
    FR_OK(d->ops->obj_get(d->state, &k, 1, &out, &st, 2000));
    if (st == FERRY_ENOTFOUND)
      break;
    su_sleep_ms(10);
  }
  assert_int_equal(st, FERRY_ENOTFOUND);
}

/* A name is held by one incarnation: another is refused while the holder's lease runs (the
 * error names the holder), unless it takes over an incarnation it proved dead; a lapsed lease
 * frees the name. */
static void check_names(fr_dir *d) {
  fr_dir_node a = make_node("twin"), b = a, holder, got;
  b.incarnation = a.incarnation + 1;
  snprintf(b.address, sizeof b.address, "tcp://127.0.0.1:2");
  FR_OK(d->ops->node_put(d->state, &a, 30000, 0, NULL, 2000));
  FR_OK(d->ops->node_put(d->state, &a, 30000, 0, NULL, 2000)); /* its own refresh */
  fr_dir_object o = make_obj("twin/k", "twin", 1);
  FR_OK(d->ops->obj_put(d->state, &o, 0, NULL, NULL, 2000));
  memset(&holder, 0, sizeof holder);
  assert_int_equal(d->ops->node_put(d->state, &b, 30000, 0, &holder, 2000), FERRY_EEXIST);
  print_message("%s\n", ferry_last_error());
  assert_non_null(strstr(ferry_last_error(), "'twin'"));
  assert_non_null(strstr(ferry_last_error(), a.address));
  assert_int_equal(holder.incarnation, a.incarnation);
  assert_string_equal(holder.address, a.address);
  /* a wrong takeover is refused too; the holder's records are untouched */
  assert_int_equal(d->ops->node_put(d->state, &b, 30000, 12345, NULL, 2000), FERRY_EEXIST);
  FR_OK(d->ops->node_get(d->state, "twin", &got, 2000));
  assert_int_equal(got.incarnation, a.incarnation);
  /* the other incarnation can neither renew nor delete the holder */
  assert_int_equal(d->ops->node_renew(d->state, "twin", b.incarnation, 30000, 2000),
                   FERRY_ENOTFOUND);
  FR_OK(d->ops->node_del(d->state, "twin", b.incarnation, 2000));
  FR_OK(d->ops->node_get(d->state, "twin", &got, 2000));
  assert_int_equal(got.incarnation, a.incarnation);
  FR_OK(d->ops->node_renew(d->state, "twin", a.incarnation, 30000, 2000));
  /* taking over a holder proven dead drops it and its objects */
  FR_OK(d->ops->node_put(d->state, &b, 30000, a.incarnation, NULL, 2000));
  FR_OK(d->ops->node_get(d->state, "twin", &got, 2000));
  assert_int_equal(got.incarnation, b.incarnation);
  assert_string_equal(got.address, b.address);
  const char *k = "twin/k";
  int st;
  FR_OK(d->ops->obj_get(d->state, &k, 1, &o, &st, 2000));
  assert_int_equal(st, FERRY_ENOTFOUND);
  assert_int_equal(d->ops->node_renew(d->state, "twin", a.incarnation, 30000, 2000),
                   FERRY_ENOTFOUND);
  /* a lapsed lease frees the name: poll until the short lease runs out */
  fr_dir_node c = make_node("fleeting"), c2 = c;
  c2.incarnation = c.incarnation + 7;
  FR_OK(d->ops->node_put(d->state, &c, 100, 0, NULL, 2000));
  int rc = FERRY_EEXIST;
  for (int i = 0; i < 1000 && rc == FERRY_EEXIST; i++)
    if ((rc = d->ops->node_put(d->state, &c2, 30000, 0, NULL, 2000)) == FERRY_EEXIST)
      su_sleep_ms(10);
  FR_OK(rc);
  FR_OK(d->ops->node_del(d->state, "fleeting", 0, 2000));
  FR_OK(d->ops->node_del(d->state, "twin", b.incarnation, 2000));
  assert_int_equal(d->ops->node_get(d->state, "twin", &got, 2000), FERRY_ENOTFOUND);
}

static void check_all(fr_dir *d) {
  check_names(d);
  check_nodes(d);
  check_objects(d);
  check_scan_and_node_delete(d);
  check_big_scan(d);
  check_lease(d);
}

static void test_embedded_local(void **state) {
  fr_dir_server *s = fr_dir_server_new("");
  fr_dir *d;
  FR_OK(fr_dir_open_local(s, &d));
  /* an in-process server has no thread: expire by hand while waiting */
  check_nodes(d);
  check_objects(d);
  check_scan_and_node_delete(d);
  check_big_scan(d);
  check_names(d);
  fr_dir_node n3 = make_node("n3");
  FR_OK(d->ops->node_put(d->state, &n3, 100, 0, NULL, 2000));
  fr_dir_server_expire(s, fr_now_ns() + 200000000ull);
  fr_dir_node got;
  assert_int_equal(d->ops->node_get(d->state, "n3", &got, 2000), FERRY_ENOTFOUND);
  fr_dir_close(d);
  fr_dir_server_free(s);
}

static ferry_ctx *open_ctx(const char *name, const char *listen) {
  ferry_ctx_opts o = {.size = sizeof o, .name = name, .tcp_listen = listen, .token = ""};
  ferry_ctx *c = NULL;
  FR_OK(ferry_ctx_open(&o, &c));
  return c;
}

static void test_embedded_link(void **state) {
  int port = su_free_port();
  char listen[64], url[80];
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  snprintf(url, sizeof url, "ferry://127.0.0.1:%d", port);
  ferry_ctx *sc = open_ctx("dir-server", listen), *cc = open_ctx("dir-client", NULL);
  fr_dir_server *srv;
  FR_OK(fr_dir_server_start(sc, &srv));
  fr_dir *d;
  FR_OK(fr_dir_open(cc, url, 2000, &d));
  assert_int_equal(d->ops->epoch(d->state), 1);
  check_all(d);
  /* restart: a new server on the same port has empty tables and a new instance */
  fr_dir_node n = make_node("survivor");
  FR_OK(d->ops->node_put(d->state, &n, 30000, 0, NULL, 2000));
  fr_dir_server_stop(srv);
  ferry_ctx_close(sc);
  sc = open_ctx("dir-server2", listen);
  FR_OK(fr_dir_server_start(sc, &srv));
  fr_dir_node got;
  int rc = FERRY_EPEER;
  for (int i = 0; i < 100 && rc != 0 && rc != FERRY_ENOTFOUND; i++)
    rc = d->ops->node_get(d->state, "survivor", &got, 2000);
  assert_int_equal(rc, FERRY_ENOTFOUND);
  assert_int_equal(d->ops->epoch(d->state), 2);
  fr_dir_close(d);
  fr_dir_server_stop(srv);
  ferry_ctx_close(sc);
  ferry_ctx_close(cc);
}

static void test_no_directory(void **state) {
  ferry_ctx *cc = open_ctx("lonely", NULL);
  char url[80];
  snprintf(url, sizeof url, "ferry://127.0.0.1:%d", su_free_port());
  fr_dir *d = (fr_dir *)0x1;
  assert_int_equal(fr_dir_open(cc, url, 1000, &d), FERRY_ECONNECT);
  assert_ptr_equal(d, (fr_dir *)0x1);
  assert_non_null(strstr(ferry_last_error(), "ferry serve"));
  assert_int_equal(fr_dir_open(cc, "zookeeper://x", 1000, &d), FERRY_EINVAL);
  snprintf(url, sizeof url, "redis://127.0.0.1:%d", su_free_port());
  assert_int_equal(fr_dir_open(cc, url, 1000, &d), FERRY_ECONNECT);
  assert_non_null(strstr(ferry_last_error(), "cannot reach Redis"));
  ferry_ctx_close(cc);
}

static void test_redis(void **state) {
  su_redis r;
  if (!su_redis_start(&r))
    return;
  fr_dir *d;
  FR_OK(fr_dir_open(NULL, r.url, 2000, &d));
  check_all(d);
  /* Redis goes away: a clear error, then it comes back and the client redials */
  su_redis_stop(&r);
  fr_dir_node got;
  int rc = d->ops->node_get(d->state, "n1", &got, 1000);
  assert_int_equal(rc, FERRY_ECONNECT);
  assert_non_null(strstr(ferry_last_error(), "Redis"));
  fr_dir_close(d);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_codec),          cmocka_unit_test(test_server_rejects_garbage),
      cmocka_unit_test(test_embedded_local), cmocka_unit_test(test_embedded_link),
      cmocka_unit_test(test_no_directory),   cmocka_unit_test(test_redis),
      cmocka_unit_test(test_table_rules),    cmocka_unit_test(test_table_rejects_garbage),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
