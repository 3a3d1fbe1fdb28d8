/*
 * The link tests' shared parts (linkutil.h): the pair of contexts, and the case bodies that
 * tests/link_test.c and tests/ucx_link_test.c run beyond the per-transport suite
 * (tests/link_conformance.c) for their own transports (a tiny shm ring, each ucx read mode).
 */
#include "linkutil.h"
#include "testutil.h"
#include "core/channels.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

ferry_ctx *lt_open_ctx(const char *name, const char *transport, const char *token) {
  ferry_ctx_opts o = {.size = sizeof o, .name = name, .transports = transport, .token = token};
  ferry_ctx *c = NULL;
  FR_OK(ferry_ctx_open(&o, &c));
  return c;
}

void lt_pair_open(lt_pair *p, const char *transport) {
  p->a = lt_open_ctx("node-a", transport, "");
  p->b = lt_open_ctx("node-b", transport, "");
  FR_OK(ferry_connect(p->a, ferry_ctx_address(p->b), 5000, &p->ab));
  assert_string_equal(ferry_link_transport(p->ab), transport);
  assert_string_equal(ferry_link_peer(p->ab), "node-b");
}

void lt_pair_close(lt_pair *p) {
  ferry_link_close(p->ab);
  ferry_ctx_close(p->a);
  ferry_ctx_close(p->b);
}

void lt_messages(const char *transport) {
  lt_pair p;
  lt_pair_open(&p, transport);
  char big[100000];
  tu_fill(big, sizeof big, 3);
  for (int i = 0; i < 100; i++) {
    char text[32];
    snprintf(text, sizeof text, "hello %d", i);
    struct iovec iov[2] = {{text, strlen(text)}, {big, (size_t)i * 1000}};
    FR_OK(ferry_send(p.ab, 3, iov, 2, 1000));
  }
  for (int i = 0; i < 100; i++) {
    ferry_msg *m = NULL;
    FR_OK(ferry_recv(p.b, 3, &m, 5000));
    char text[32];
    int n = snprintf(text, sizeof text, "hello %d", i);
    assert_int_equal(m->len, (size_t)n + (size_t)i * 1000);
    assert_memory_equal(m->data, text, (size_t)n);
    assert_memory_equal((char *)m->data + n, big, (size_t)i * 1000);
    /* answer on the link the message came on */
    struct iovec iov = {m->data, (size_t)n};
    FR_OK(ferry_send(m->link, 4, &iov, 1, 1000));
    ferry_msg_free(m);
  }
  for (int i = 0; i < 100; i++) {
    ferry_msg *m = NULL;
    FR_OK(ferry_recv(p.a, 4, &m, 5000));
    assert_string_equal(ferry_link_peer(m->link), "node-b");
    ferry_msg_free(m);
  }
  ferry_msg *m = (ferry_msg *)0x1;
  assert_int_equal(ferry_recv(p.a, 4, &m, 10), FERRY_ETIMEDOUT);
  assert_ptr_equal(m, (ferry_msg *)0x1);
  assert_int_equal(ferry_send(p.ab, FERRY_MAX_CHANNELS, NULL, 0, 10), FERRY_EINVAL);
  lt_pair_close(&p);
}

static void *answer_calls(void *arg) {
  ferry_ctx *c = arg;
  for (int i = 0; i < 200; i++) {
    ferry_msg *m;
    if (ferry_recv(c, 9, &m, 5000) != 0)
      return NULL;
    assert_true(ferry_msg_is_call(m));
    char out[64];
    int n = snprintf(out, sizeof out, "re: %s", (char *)m->data);
    struct iovec iov = {out, (size_t)n};
    FR_OK(ferry_reply(m, &iov, 1, 1000));
    assert_false(ferry_msg_is_call(m));
    assert_int_equal(ferry_reply(m, &iov, 1, 1000), FERRY_EINVAL); /* once only */
    ferry_msg_free(m);
  }
  return NULL;
}

typedef struct caller_args {
  ferry_link *link;
  int base, failures;
} caller_args;

static void *make_calls(void *arg) {
  caller_args *a = arg;
  for (int i = 0; i < 100; i++) {
    char q[32], want[40];
    snprintf(q, sizeof q, "q%d", a->base + i);
    snprintf(want, sizeof want, "re: %s", q);
    struct iovec iov = {q, strlen(q) + 1};
    ferry_msg *r = NULL;
    if (ferry_call(a->link, 9, &iov, 1, &r, 5000) != 0 || strcmp(r->data, want) != 0)
      a->failures++;
    ferry_msg_free(r);
  }
  return NULL;
}

/* Calls from two threads over one link: every reply reaches its own caller. */
void lt_calls(const char *transport) {
  lt_pair p;
  lt_pair_open(&p, transport);
  pthread_t server, t[2];
  pthread_create(&server, NULL, answer_calls, p.b);
  caller_args a[2] = {{p.ab, 0, 0}, {p.ab, 1000, 0}};
  for (int i = 0; i < 2; i++)
    pthread_create(&t[i], NULL, make_calls, &a[i]);
  for (int i = 0; i < 2; i++) {
    pthread_join(t[i], NULL);
    assert_int_equal(a[i].failures, 0);
  }
  pthread_join(server, NULL);
  /* nobody answers: the call times out; a plain message cannot be replied to */
  struct iovec iov = {"x", 1};
  ferry_msg *r = (ferry_msg *)0x1;
  assert_int_equal(ferry_call(p.ab, 10, &iov, 1, &r, 100), FERRY_ETIMEDOUT);
  assert_ptr_equal(r, (ferry_msg *)0x1);
  ferry_msg *m;
  FR_OK(ferry_recv(p.b, 10, &m, 1000));
  FR_OK(ferry_send(p.ab, 11, &iov, 1, 1000));
  ferry_msg *plain;
  FR_OK(ferry_recv(p.b, 11, &plain, 1000));
  assert_int_equal(ferry_reply(plain, &iov, 1, 100), FERRY_EINVAL);
  ferry_msg_free(plain);
  FR_OK(ferry_reply(m, &iov, 1, 100)); /* a late reply is dropped quietly */
  ferry_msg_free(m);
  lt_pair_close(&p);
}

/* Vectored reads: a strided slice (1000 bytes of every 3000, 600 runs: several requests over
 * tcp, answered by the server thread) and a few small runs (answered inline) land one after
 * another; a bad run refuses the whole read. */
static void readv_checks(lt_pair *p, const ferry_region_ref *ref, const uint8_t *mem, size_t n,
                         uint8_t *dst) {
  ferry_read_run runs[600];
  for (size_t i = 0; i < 600; i++)
    runs[i] = (ferry_read_run){i * 3000 + 17, 1000};
  memset(dst, 0, 600 * 1000);
  FR_OK(ferry_readv(p->ab, ref, runs, 600, dst, 5000));
  for (size_t i = 0; i < 600; i++)
    if (memcmp(dst + i * 1000, mem + runs[i].offset, 1000) != 0)
      fail_msg("readv run %zu differs", i);
  ferry_read_run few[3] = {{n - 8, 8}, {0, 5}, {4096, 100}};
  FR_OK(ferry_readv(p->ab, ref, few, 3, dst, 5000));
  assert_memory_equal(dst, mem + n - 8, 8);
  assert_memory_equal(dst + 8, mem, 5);
  assert_memory_equal(dst + 13, mem + 4096, 100);
  ferry_read_run past[2] = {{0, 8}, {n - 4, 8}};
  assert_int_equal(ferry_readv(p->ab, ref, past, 2, dst, 5000), FERRY_ERANGE);
  ferry_read_run empty[2] = {{0, 8}, {8, 0}};
  assert_int_equal(ferry_readv(p->ab, ref, empty, 2, dst, 5000), FERRY_EINVAL);
  ferry_region_ref wrong = *ref;
  wrong.key ^= 1;
  assert_int_equal(ferry_readv(p->ab, &wrong, few, 3, dst, 5000), FERRY_EACCES);
}

void lt_one_sided(const char *transport, bool shared) {
  lt_pair p;
  lt_pair_open(&p, transport);
  size_t n = 3 << 20;
  uint8_t *mem, *heap = NULL;
  ferry_region_ref ref;
  if (shared) {
    FR_OK(ferry_alloc(p.b, n, (void **)&mem));
    FR_OK(ferry_region_find(p.b, mem, n, &ref, NULL));
  } else {
    heap = malloc(n);
    mem = heap;
    FR_OK(ferry_register(p.b, mem, n, &ref));
  }
  tu_fill(mem, n, 11);
  uint8_t *dst = malloc(n);
  FR_OK(ferry_read(p.ab, &ref, 0, dst, n, 5000));
  assert_memory_equal(dst, mem, n);
  FR_OK(ferry_read(p.ab, &ref, 12345, dst, 64, 5000));
  assert_memory_equal(dst, mem + 12345, 64);

  readv_checks(&p, &ref, mem, n, dst);

  tu_fill(dst, 4096, 99);
  FR_OK(ferry_write(p.ab, &ref, n - 4096, dst, 4096, 5000));
  assert_memory_equal(mem + n - 4096, dst, 4096);

  /* refused: bounds, key, unknown region; the owner keeps serving */
  assert_int_equal(ferry_read(p.ab, &ref, n - 10, dst, 11, 5000), FERRY_ERANGE);
  assert_int_equal(ferry_read(p.ab, &ref, UINT64_MAX - 2, dst, 8, 5000), FERRY_ERANGE);
  assert_int_equal(ferry_write(p.ab, &ref, n, dst, 1, 5000), FERRY_ERANGE);
  ferry_region_ref wrong = ref;
  wrong.key ^= 1;
  assert_int_equal(ferry_read(p.ab, &wrong, 0, dst, 8, 5000), FERRY_EACCES);
  assert_int_equal(ferry_write(p.ab, &wrong, 0, dst, 8, 5000), FERRY_EACCES);
  ferry_region_ref none = {.id = 999999, .key = 1, .size = 8};
  assert_int_equal(ferry_read(p.ab, &none, 0, dst, 8, 5000), FERRY_ENOTFOUND);
  FR_OK(ferry_read(p.ab, &ref, 0, dst, n, 5000));
  assert_memory_equal(dst, mem, n);

  const void *view = NULL;
  int rc = ferry_view(p.ab, &ref, 64, 64, &view);
  if (strcmp(transport, "shm") == 0 && shared) {
    FR_OK(rc);
    assert_memory_equal(view, mem + 64, 64);
    FR_OK(ferry_view_valid(p.ab, &ref));
  } else {
    assert_int_equal(rc, FERRY_ENOTSUP);
  }

  /* freed: the reader is told, nobody crashes */
  if (shared) {
    FR_OK(ferry_free(p.b, mem));
    rc = ferry_read(p.ab, &ref, 0, dst, 64, 5000);
    assert_int_equal(rc, FERRY_ENOTFOUND);
    if (strcmp(transport, "shm") == 0)
      assert_int_equal(ferry_view_valid(p.ab, &ref), FERRY_ENOTFOUND);
  } else {
    FR_OK(ferry_deregister(p.b, ref.id));
    assert_int_equal(ferry_read(p.ab, &ref, 0, dst, 64, 5000), FERRY_ENOTFOUND);
  }
  free(dst);
  lt_pair_close(&p);
  free(heap);
}

void lt_frame(uint8_t *out, uint32_t magic, uint8_t version, uint8_t type, uint64_t len) {
  memset(out, 0, 32);
  memcpy(out, &magic, 4);
  out[4] = version;
  out[5] = type;
  memcpy(out + 24, &len, 8);
}

/* ---- many threads sharing links ---- */

void *lt_hammer(void *arg) {
  lt_hammer_args *h = arg;
  uint8_t buf[8192];
  for (int i = 0; i < 300; i++) {
    size_t off = (size_t)(i * 977) % (h->ref.size - sizeof buf);
    if (ferry_read(h->link, &h->ref, off, buf, sizeof buf, 5000) != 0 ||
        memcmp(buf, h->expect + off, sizeof buf) != 0)
      h->failures++;
  }
  return NULL;
}
