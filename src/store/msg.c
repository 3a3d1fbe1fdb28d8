/*
 * Messages between stores on FR_CHANNEL_STORE, the asking side: their encoding and the pure
 * decoder (fr_store_msg_decode, shared with service.c and the fuzzer), and the calls one node's
 * store makes of another's: DELETE (ask an owner to delete its object), DROPPED (tell an owner
 * another node replaced its key), UPLOAD (ask a holder, `ferry serve`, to copy a tensor out of
 * this short-lived node's memory and publish it), READS (tell an owner how many of its objects
 * this node read: receipts.c). Peers are reached through the peer cache
 * (directory/peers.c); the answering side is service.c.
 */
#include "store/service.h"
#include "core/channels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- messages ---- */

static void wr_header(fr_wr *w, uint16_t op) {
  fr_wr_u32(w, FR_STORE_MSG_MAGIC);
  fr_wr_u16(w, op);
  fr_wr_u16(w, 0);
}

static void wr_desc(fr_wr *w, const ferry_tensor_desc *d) {
  fr_wr_u32(w, (uint32_t)d->dtype);
  fr_wr_u32(w, d->ndim);
  for (uint32_t i = 0; i < d->ndim && i < FERRY_MAX_DIMS; i++)
    fr_wr_u64(w, d->shape[i]);
}

int fr_store_msg_decode(const void *data, size_t len, fr_store_msg *m) {
  fr_rd r = fr_rd_init(data, len);
  memset(m, 0, sizeof *m);
  uint32_t magic = fr_rd_u32(&r);
  m->op = fr_rd_u16(&r);
  fr_rd_u16(&r);
  if (m->op == FR_SMSG_READS) {
    m->gets = fr_rd_u64(&r);
    m->bytes = fr_rd_u64(&r);
    bool ok = fr_rd_done(&r) && magic == FR_STORE_MSG_MAGIC && m->gets >= 1 &&
              m->gets <= FR_STORE_READS_MAX;
    if (!ok)
      memset(m, 0, sizeof *m);
    return ok ? 0 : fr_err(FERRY_EPROTO, "store: malformed read receipt of %zu bytes", len);
  }
  fr_rd_str(&r, m->key, sizeof m->key);
  if (m->op == FR_SMSG_UPLOAD) {
    m->desc.dtype = (ferry_dtype)fr_rd_u32(&r);
    m->desc.ndim = fr_rd_u32(&r);
    for (uint32_t i = 0; !r.failed && i < m->desc.ndim && i < FERRY_MAX_DIMS; i++)
      m->desc.shape[i] = fr_rd_u64(&r);
    m->ref.id = fr_rd_u64(&r);
    m->ref.key = fr_rd_u64(&r);
    m->ref.size = fr_rd_u64(&r);
    m->offset = fr_rd_u64(&r);
  } else {
    m->generation = fr_rd_u64(&r);
  }
  bool ok = fr_rd_done(&r) && magic == FR_STORE_MSG_MAGIC && m->op >= FR_SMSG_DELETE &&
            m->op <= FR_SMSG_UPLOAD && fr_dir_key_check(m->key, "store message") == 0;
  if (ok && m->op == FR_SMSG_UPLOAD)
    ok = m->desc.ndim <= FERRY_MAX_DIMS && ferry_tensor_nbytes(&m->desc, &m->bytes) == 0 &&
         (m->bytes == 0 || fr_range_ok(m->offset, m->bytes, m->ref.size));
  if (!ok) {
    memset(m, 0, sizeof *m);
    return fr_err(FERRY_EPROTO, "store: malformed message of %zu bytes", len);
  }
  return 0;
}

static int decode_reply(ferry_msg *m, uint64_t *generation) {
  fr_rd r = fr_rd_init(m->data, m->len);
  int st = 0;
  char detail[512];
  fr_rd_reply(&r, &st, detail, sizeof detail);
  uint64_t gen = st == 0 ? fr_rd_u64(&r) : 0;
  if (!fr_rd_done(&r))
    return fr_err(FERRY_EPROTO, "store: malformed reply from '%s'", ferry_link_peer(m->link));
  if (st != 0)
    return fr_err(st, "%s", detail);
  if (generation)
    *generation = gen;
  return 0;
}

static int call(fr_peer *p, fr_wr *w, uint64_t *generation, int timeout_ms) {
  if (w->failed) {
    fr_wr_free(w);
    return fr_err(FERRY_ENOMEM, "store message");
  }
  struct iovec iov = {w->p, w->len};
  ferry_msg *reply = NULL;
  int rc = ferry_call(p->link, FR_CHANNEL_STORE, &iov, 1, &reply, timeout_ms);
  fr_wr_free(w);
  if (rc != 0)
    return rc;
  rc = decode_reply(reply, generation);
  ferry_msg_free(reply);
  return rc;
}

int fr_store_call_delete(ferry_store *s, fr_peer *p, const char *key, uint64_t generation,
                         int timeout_ms) {
  fr_wr w = {0};
  wr_header(&w, FR_SMSG_DELETE);
  fr_wr_str(&w, key);
  fr_wr_u64(&w, generation);
  return call(p, &w, NULL, timeout_ms);
}

void fr_store_send_dropped(ferry_store *s, const fr_dir_object *old) {
  fr_peer *p;
  if (fr_peer_acquire(&s->peers, old->owner, 1000, &p) != 0) {
    fr_debug("store: cannot tell '%s' that '%s' moved: %s", old->owner, old->key,
             ferry_last_error());
    return;
  }
  fr_wr w = {0};
  wr_header(&w, FR_SMSG_DROPPED);
  fr_wr_str(&w, old->key);
  fr_wr_u64(&w, old->generation);
  struct iovec iov = {w.p, w.len};
  int rc = w.failed ? FERRY_ENOMEM : ferry_send(p->link, FR_CHANNEL_STORE, &iov, 1, 1000);
  fr_wr_free(&w);
  fr_peer_release(&s->peers, p, rc == FERRY_EPEER || rc == FERRY_ECLOSED);
}

/* Tells an owner how many of its objects this node read, and their bytes (receipts.c): a
 * message, not a call; more than FR_STORE_READS_MAX gets go in several. */
int fr_store_send_reads(ferry_store *s, const char *owner, uint64_t gets, uint64_t bytes,
                        int timeout_ms) {
  fr_peer *p;
  int rc = fr_peer_acquire(&s->peers, owner, timeout_ms, &p);
  if (rc != 0)
    return rc;
  while (rc == 0 && gets > 0) {
    uint64_t g = gets < FR_STORE_READS_MAX ? gets : FR_STORE_READS_MAX;
    uint64_t b = g == gets ? bytes : (uint64_t)((unsigned __int128)bytes * g / gets);
    fr_wr w = {0};
    wr_header(&w, FR_SMSG_READS);
    fr_wr_u64(&w, g);
    fr_wr_u64(&w, b);
    struct iovec iov = {w.p, w.len};
    rc = w.failed ? fr_err(FERRY_ENOMEM, "read receipt")
                  : ferry_send(p->link, FR_CHANNEL_STORE, &iov, 1, timeout_ms);
    fr_wr_free(&w);
    gets -= g;
    bytes -= b;
  }
  fr_peer_release(&s->peers, p, rc == FERRY_EPEER || rc == FERRY_ECLOSED);
  return rc;
}

/* ---- uploads from a delegating (short-lived) node ---- */

static int find_holder(ferry_store *s, char *name, size_t cap, int timeout_ms) {
  if (s->holder[0]) {
    fr_str_copy(name, cap, s->holder);
    return 0;
  }
  fr_dir_node *v = NULL;
  size_t n = 0;
  int rc = fr_dir_node_list(s->dir, &v, &n, timeout_ms);
  size_t i = 0;
  while (rc == 0 && i < n && !(v[i].flags & FR_NODE_HOLDER))
    i++;
  if (rc == 0 && i == n) /* the directory answers, so `ferry serve` joins it rather than hosts */
    rc = fr_err(FERRY_ENOTFOUND,
                "no node holds objects for others in the directory at %s: "
                "start one with `ferry serve --directory %s`",
                s->dir->url, s->dir->url);
  if (rc == 0) {
    fr_str_copy(s->holder, sizeof s->holder, v[i].name);
    fr_str_copy(name, cap, v[i].name);
  }
  free(v);
  return rc;
}

static int send_upload(ferry_store *s, const char *holder, const char *key,
                       const ferry_tensor_desc *desc, const ferry_region_ref *ref, uint64_t offset,
                       int timeout_ms) {
  fr_peer *p;
  int rc = fr_peer_acquire(&s->peers, holder, timeout_ms, &p);
  if (rc != 0)
    return rc;
  fr_wr w = {0};
  wr_header(&w, FR_SMSG_UPLOAD);
  fr_wr_str(&w, key);
  wr_desc(&w, desc);
  fr_wr_u64(&w, ref->id);
  fr_wr_u64(&w, ref->key);
  fr_wr_u64(&w, ref->size);
  fr_wr_u64(&w, offset);
  rc = call(p, &w, NULL, timeout_ms);
  fr_peer_release(&s->peers, p, rc == FERRY_EPEER || rc == FERRY_ECLOSED);
  return rc;
}

int fr_store_upload(ferry_store *s, const char *key, const ferry_tensor_desc *desc,
                    const void *data, int device, int timeout_ms) {
  uint64_t bytes = 0, offset = 0;
  ferry_tensor_nbytes(desc, &bytes);
  char holder[FR_DIR_NAME_MAX + 1];
  int rc = find_holder(s, holder, sizeof holder, timeout_ms);
  if (rc != 0)
    return rc;
  ferry_region_ref ref = {0};
  void *tmp = NULL;
  if (bytes > 0 && (device >= 0 || ferry_region_find(s->ctx, data, bytes, &ref, &offset) != 0)) {
    if ((rc = ferry_alloc(s->ctx, bytes, &tmp)) != 0)
      return rc;
    if ((rc = fr_cuda_copy_on(device, tmp, data, (size_t)bytes)) != 0) { /* memcpy for host */
      ferry_free(s->ctx, tmp);
      return fr_err_wrap(rc, "put '%s'", key);
    }
    ferry_region_find(s->ctx, tmp, bytes, &ref, &offset);
  }
  fr_err_clear();
  rc = send_upload(s, holder, key, desc, &ref, offset, timeout_ms);
  if (rc == FERRY_EPEER) /* the holder restarted: find it again */
    s->holder[0] = '\0';
  if (tmp)
    ferry_free(s->ctx, tmp);
  return rc;
}
