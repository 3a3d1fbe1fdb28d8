/*
 * libFuzzer target for what an etcd member sends the etcd directory backend (etcd_http.c,
 * etcd_client.c): each input is an HTTP response, read from a socket by the client's own reader
 * (status line, headers, a Content-Length or chunked body, trailers) within a short deadline;
 * a body that is JSON goes through the answer readers the operations use (a range's key-values,
 * their base64 values as node and object records, int64 fields). The input is also given to the
 * base64 decoder and, as a string, to the etcd:// URL parser. Nothing may crash, leak, hang past
 * its deadline or read out of bounds.
 */
#include "directory/etcd.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* A JSON answer as the operations read one. */
static void read_answer(const char *body, size_t len) {
  json_t *j = json_loadb(body, len, JSON_DISABLE_EOF_CHECK, NULL);
  if (!j)
    return;
  fr_etcd_kv v;
  if (fr_etcd_range_kv(j, &v) && v.found) {
    fr_dir_node n;
    fr_dir_object o;
    if (fr_etcd_node_of(&v, NULL, &n))
      assert(strlen(n.name) <= FR_DIR_NAME_MAX);
    if (fr_etcd_object_of(&v, NULL, &o))
      assert(strlen(o.key) <= FR_DIR_KEY_MAX);
  }
  int64_t x;
  fr_etcd_get_i64(j, "TTL", &x);
  fr_etcd_get_i64(json_object_get(j, "header"), "revision", &x);
  json_t *res = json_object_get(j, "responses");
  for (size_t i = 0; i < json_array_size(res) && i < 8; i++)
    fr_etcd_range_kv(fr_etcd_response(res, i, "response_range"), &v);
  json_decref(j);
}

static void read_response(const uint8_t *data, size_t size) {
  int sv[2];
  if (size > 65536 || socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
    return;
  size_t off = 0;
  while (off < size) {
    ssize_t w = write(sv[0], data + off, size - off);
    if (w <= 0)
      break;
    off += (size_t)w;
  }
  shutdown(sv[0], SHUT_WR);
  fr_http h;
  fr_http_init(&h);
  h.fd = sv[1];
  snprintf(h.name, sizeof h.name, "fuzz");
  uint64_t deadline = fr_deadline_ns(100);
  int status = 0;
  char *body = NULL;
  size_t n = 0;
  if (fr_http_head(&h, &status, deadline) == 0) {
    assert(status >= 100 && status <= 599);
    if (fr_http_body_all(&h, &body, &n, FR_HTTP_BODY_MAX, deadline) == 0) {
      assert(body[n] == '\0');
      read_answer(body, n);
      free(body);
    }
  }
  fr_err_clear();
  fr_http_close(&h);
  close(sv[0]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  read_response(data, size);
  uint8_t out[4096];
  size_t n = 0;
  if (fr_b64_decode((const char *)data, size, out, sizeof out, &n))
    assert(n <= sizeof out && n <= size);
  char url[1024];
  size_t len = size < sizeof url - 1 ? size : sizeof url - 1;
  memcpy(url, data, len);
  url[len] = '\0';
  fr_etcd_url u;
  if (fr_etcd_url_parse(url, &u) == 0)
    assert(u.n >= 1 && u.n <= FR_ETCD_MEMBERS_MAX);
  fr_err_clear();
  return 0;
}
