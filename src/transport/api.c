/*
 * The public entry points for memory and links (ferry.h): argument checks and error details
 * here, then the work is handed to the region table, the link or the link's transport.
 */
#include "transport/transport.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- memory ---- */

/* Memory from the ctx's first transport (see alloc_region in transport.h). */
static int transport_memory(void *arg, size_t bytes, fr_region_mem *out) {
  ferry_ctx *ctx = arg;
  return ctx->order[0]->alloc_region(ctx, bytes, out);
}

static int alloc_shared(ferry_ctx *ctx, size_t bytes, bool uninit, void **out) {
  if (!ctx || !out)
    return fr_err(FERRY_EINVAL, "ferry_alloc: NULL argument");
  fr_region *r;
  bool hook = ctx->norder > 0 && ctx->order[0]->alloc_region;
  int rc =
      fr_region_alloc_shared(&ctx->regions, bytes, uninit, hook ? transport_memory : NULL, ctx, &r);
  if (rc == 0)
    *out = r->data;
  return rc;
}

int ferry_alloc(ferry_ctx *ctx, size_t bytes, void **out) {
  return alloc_shared(ctx, bytes, false, out);
}

int ferry_alloc_uninit(ferry_ctx *ctx, size_t bytes, void **out) {
  return alloc_shared(ctx, bytes, true, out);
}

int ferry_free(ferry_ctx *ctx, void *ptr) {
  if (!ctx)
    return fr_err(FERRY_EINVAL, "ferry_free: NULL ctx");
  if (!ptr)
    return 0;
  return fr_region_remove(&ctx->regions, 0, ptr);
}

int ferry_register(ferry_ctx *ctx, void *ptr, size_t len, ferry_region_ref *out) {
  if (!ctx || !out)
    return fr_err(FERRY_EINVAL, "ferry_register: NULL argument");
  fr_region *r;
  int rc = fr_region_add_registered(&ctx->regions, ptr, len, &r);
  if (rc == 0)
    *out = (ferry_region_ref){r->id, r->key, r->size};
  return rc;
}

int ferry_deregister(ferry_ctx *ctx, uint64_t region_id) {
  if (!ctx || region_id == 0)
    return fr_err(FERRY_EINVAL, "ferry_deregister: bad arguments");
  return fr_region_remove(&ctx->regions, region_id, NULL);
}

int ferry_region_find(ferry_ctx *ctx, const void *ptr, size_t len, ferry_region_ref *out,
                      uint64_t *offset) {
  if (!ctx || !ptr || !out)
    return fr_err(FERRY_EINVAL, "ferry_region_find: NULL argument");
  fr_region *r;
  int rc = fr_region_find(&ctx->regions, ptr, len, &r);
  if (rc != 0)
    return rc;
  *out = (ferry_region_ref){r->id, r->key, r->size};
  if (offset)
    *offset = (uint64_t)((const uint8_t *)ptr - r->data);
  fr_region_release(r);
  return 0;
}

/* ---- links ---- */

/* Finds the URL for `scheme` in a comma-separated address list; copies what follows it. */
static bool address_part(const char *address, const char *scheme, char *out, size_t len) {
  size_t sl = strlen(scheme);
  for (const char *p = address; p && *p;) {
    const char *end = strchr(p, ',');
    size_t n = end ? (size_t)(end - p) : strlen(p);
    if (n > sl && strncmp(p, scheme, sl) == 0 && n - sl < len) {
      memcpy(out, p + sl, n - sl);
      out[n - sl] = '\0';
      return true;
    }
    p = end ? end + 1 : NULL;
  }
  return false;
}

static int connect_with(ferry_ctx *ctx, const fr_transport_ops *ops, const char *where,
                        int timeout_ms, ferry_link **out) {
  int fd = -1;
  int rc = ops->dial(where, timeout_ms, &fd);
  if (rc != 0)
    return rc;
  ferry_link *l = fr_link_new(ctx, ops, fd, false);
  if (!l) {
    close(fd);
    return fr_err(FERRY_ENOMEM, "connect: link");
  }
  if ((rc = fr_link_handshake(l, timeout_ms)) == 0 && (rc = fr_link_start(l)) == 0) {
    *out = l;
    return 0;
  }
  l->state = FR_LINK_DEAD;
  fr_link_unref(l);
  return rc;
}

int ferry_connect(ferry_ctx *ctx, const char *address, int timeout_ms, ferry_link **out) {
  if (!ctx || !address || !out)
    return fr_err(FERRY_EINVAL, "ferry_connect: NULL argument");
  int ms = fr_timeout(timeout_ms);
  char where[256], tried[512] = "";
  size_t used = 0;
  int last = FERRY_ECONNECT;
  for (size_t i = 0; i < ctx->norder; i++) {
    const fr_transport_ops *ops = ctx->order[i];
    if (!address_part(address, ops->scheme, where, sizeof where))
      continue;
    int rc = connect_with(ctx, ops, where, ms, out);
    if (rc == 0 || rc == FERRY_EAUTH)
      return rc;
    last = rc;
    used += (size_t)snprintf(tried + used, sizeof tried - used, "%s%s: %s", used ? "; " : "",
                             ops->name, ferry_last_error());
    if (used >= sizeof tried)
      used = sizeof tried - 1;
  }
  if (!used)
    return fr_err(FERRY_ECONNECT, "'%s' offers no transport this node uses (FERRY_TRANSPORTS)",
                  address);
  return fr_err(last == FERRY_ETIMEDOUT ? FERRY_ECONNECT : last, "cannot connect to %s (%s)",
                address, tried);
}

void ferry_link_close(ferry_link *link) {
  if (!link)
    return;
  if (fr_link_is_open(link)) /* a link its closed ctx ended no longer reaches that ctx */
    fr_link_flush(link, fr_link_flush_deadline(link->ctx));
  fr_link_fail(link, FERRY_ECLOSED, "closed by this node");
  fr_link_unref(link);
}

ferry_link *ferry_link_retain(ferry_link *link) {
  if (link)
    fr_link_ref(link);
  return link;
}

void ferry_link_release(ferry_link *link) { fr_link_unref(link); }

int ferry_link_status(const ferry_link *link) {
  if (!link)
    return FERRY_EINVAL;
  if (__atomic_load_n(&link->state, __ATOMIC_ACQUIRE) != FR_LINK_DEAD)
    return 0;
  return link->dead_status ? link->dead_status : FERRY_EPEER;
}

const char *ferry_link_transport(const ferry_link *link) { return link ? link->ops->name : NULL; }
const char *ferry_link_peer(const ferry_link *link) { return link ? link->peer : NULL; }

static int check_send(ferry_link *link, uint32_t channel, const struct iovec *iov, int iovcnt,
                      uint64_t *len) {
  if (!link || channel >= FERRY_MAX_CHANNELS || iovcnt < 0 || (iovcnt > 0 && !iov))
    return fr_err(FERRY_EINVAL, "send: bad arguments (channel %u)", channel);
  *len = 0;
  for (int i = 0; i < iovcnt; i++)
    *len += iov[i].iov_len;
  if (*len > link->ctx->max_payload)
    return fr_err(FERRY_ERANGE, "send: %llu bytes exceed FERRY_MAX_MESSAGE (%llu)",
                  (unsigned long long)*len, (unsigned long long)link->ctx->max_payload);
  return 0;
}

int ferry_send(ferry_link *link, uint32_t channel, const struct iovec *iov, int iovcnt,
               int timeout_ms) {
  uint64_t len = 0;
  int rc = check_send(link, channel, iov, iovcnt, &len);
  if (rc != 0)
    return rc;
  fr_frame f = {.type = FR_MSG, .channel = channel, .len = len};
  return fr_link_send_frame(link, &f, iov, iovcnt, -1,
                            fr_deadline_ns(fr_ctx_timeout(link->ctx, timeout_ms)));
}

int ferry_call(ferry_link *link, uint32_t channel, const struct iovec *iov, int iovcnt,
               ferry_msg **reply, int timeout_ms) {
  uint64_t len = 0;
  int rc = check_send(link, channel, iov, iovcnt, &len);
  if (rc == 0 && !reply)
    rc = fr_err(FERRY_EINVAL, "ferry_call: reply is NULL");
  return rc ? rc
            : fr_link_call(link, channel, iov, iovcnt, reply,
                           fr_ctx_timeout(link->ctx, timeout_ms));
}

int ferry_reply(ferry_msg *request, const struct iovec *iov, int iovcnt, int timeout_ms) {
  return fr_link_reply(request, iov, iovcnt, timeout_ms, false);
}

int fr_link_reply(ferry_msg *request, const struct iovec *iov, int iovcnt, int timeout_ms,
                  bool quiet) {
  if (!request || !request->link)
    return fr_err(FERRY_EINVAL, "ferry_reply: no request");
  fr_msg_node *n = fr_msg_node_of(request);
  if (n->call_id == 0)
    return fr_err(FERRY_EINVAL, "ferry_reply: the message was not a call (or was answered)");
  uint64_t len = 0;
  int rc = check_send(request->link, 0, iov, iovcnt, &len);
  if (rc != 0)
    return rc;
  fr_frame f = {.type = FR_REPLY, .req_id = n->call_id, .len = len};
  n->call_id = 0;
  uint64_t deadline = fr_deadline_ns(fr_ctx_timeout(request->link->ctx, timeout_ms));
  return quiet ? fr_link_send_frame_quiet(request->link, &f, iov, iovcnt, deadline)
               : fr_link_send_frame(request->link, &f, iov, iovcnt, -1, deadline);
}

int ferry_msg_is_call(const ferry_msg *msg) {
  return msg && fr_msg_node_of((ferry_msg *)msg)->call_id != 0;
}

/* A view (copies == false) maps the peer's region and moves no bytes: FERRY_MAX_MESSAGE, the
 * largest transfer, does not bound it (an 8 GiB alias of a refit buffer is one view); the
 * transport checks it against the region's size. */
static int check_rma(ferry_link *link, const ferry_region_ref *r, uint64_t off, size_t len,
                     const void *buf, bool copies, const char *what) {
  if (!link || !r || (!buf && len > 0))
    return fr_err(FERRY_EINVAL, "%s: NULL argument", what);
  if (copies && len > link->ctx->max_payload)
    return fr_err(FERRY_ERANGE, "%s: %zu bytes exceed FERRY_MAX_MESSAGE", what, len);
  if (off + len < off)
    return fr_err(FERRY_ERANGE, "%s: offset + length overflows", what);
  return 0;
}

/* One read into the caller's buffer, whose device (-1: host memory) the call found once. */
static int read_one(ferry_link *link, const ferry_region_ref *r, uint64_t off, void *dst,
                    size_t len, int device, int ms) {
  if (device < 0)
    return link->ops->read(link, r, off, dst, len, ms);
  if (link->ops->read_device)
    return link->ops->read_device(link, r, off, dst, len, device, ms);
  return fr_link_read_bounced(link, r, off, dst, len, device, ms);
}

int ferry_read(ferry_link *link, const ferry_region_ref *remote, uint64_t offset, void *dst,
               size_t len, int timeout_ms) {
  int rc = check_rma(link, remote, offset, len, dst, true, "ferry_read");
  return rc ? rc
            : read_one(link, remote, offset, dst, len, fr_cuda_device_of(dst),
                       fr_ctx_timeout(link->ctx, timeout_ms));
}

int ferry_readv(ferry_link *link, const ferry_region_ref *remote, const ferry_read_run *runs,
                size_t n, void *dst, int timeout_ms) {
  uint64_t total = 0;
  int rc = !runs && n ? fr_err(FERRY_EINVAL, "ferry_readv: NULL runs") : 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    rc = check_rma(link, remote, runs[i].offset, runs[i].len, dst, true, "ferry_readv");
    if (rc == 0 && (runs[i].len == 0 || __builtin_add_overflow(total, runs[i].len, &total)))
      rc = fr_err(FERRY_EINVAL, "ferry_readv: run %zu is empty or the total overflows", i);
  }
  if (rc == 0 && total > link->ctx->max_payload)
    rc = fr_err(FERRY_ERANGE, "ferry_readv: %llu bytes exceed FERRY_MAX_MESSAGE",
                (unsigned long long)total);
  if (rc != 0 || n == 0)
    return rc;
  int ms = fr_ctx_timeout(link->ctx, timeout_ms), device = fr_cuda_device_of(dst);
  if (link->ops->readv && device < 0)
    return link->ops->readv(link, remote, runs, n, dst, ms);
  uint64_t deadline = fr_deadline_ns(ms);
  uint8_t *at = dst;
  for (size_t i = 0; i < n && rc == 0; at += runs[i++].len)
    rc = read_one(link, remote, runs[i].offset, at, runs[i].len, device, fr_ms_left(deadline));
  return rc;
}

int ferry_write(ferry_link *link, const ferry_region_ref *remote, uint64_t offset, const void *src,
                size_t len, int timeout_ms) {
  int rc = check_rma(link, remote, offset, len, src, true, "ferry_write");
  if (rc != 0)
    return rc;
  int ms = fr_ctx_timeout(link->ctx, timeout_ms), device = fr_cuda_device_of(src);
  if (device < 0)
    return link->ops->write(link, remote, offset, src, len, ms);
  if (link->ops->write_device)
    return link->ops->write_device(link, remote, offset, src, len, device, ms);
  return fr_link_write_bounced(link, remote, offset, src, len, device, ms);
}

int ferry_view(ferry_link *link, const ferry_region_ref *remote, uint64_t offset, size_t len,
               const void **out) {
  int rc = check_rma(link, remote, offset, len, out, false, "ferry_view");
  if (rc != 0)
    return rc;
  if (!link->ops->view)
    return fr_err(FERRY_ENOTSUP, "ferry_view: the %s transport cannot map peer memory",
                  link->ops->name);
  return link->ops->view(link, remote, offset, len, out);
}

int ferry_view_device(ferry_link *link, const ferry_region_ref *remote, uint64_t offset, size_t len,
                      const void **out) {
  int rc = check_rma(link, remote, offset, len, out, false, "ferry_view_device");
  if (rc != 0)
    return rc;
  if (!link->ops->view_device)
    return fr_err(FERRY_ENOTSUP, "ferry_view_device: the %s transport cannot map peer memory",
                  link->ops->name);
  return link->ops->view_device(link, remote, offset, len, out);
}

int ferry_view_valid(ferry_link *link, const ferry_region_ref *remote) {
  if (!link || !remote)
    return fr_err(FERRY_EINVAL, "ferry_view_valid: NULL argument");
  if (!link->ops->view_valid)
    return fr_err(FERRY_ENOTSUP, "ferry_view_valid: not a shm link");
  return link->ops->view_valid(link, remote);
}
