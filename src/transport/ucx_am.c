/*
 * The ucx transport's active messages (overview in ucx.c). The owner's side answers a peer's
 * request for a region's rkey or for bytes, after checking the key (and the bounds); the
 * requester's side lists each request, on its waiter's stack, until the answer names it by id,
 * and takes the bytes of a large answer straight into the destination (UCX's rendezvous).
 */
#include "transport/ucx_impl.h"

#include <stdlib.h>
#include <string.h>

/* ---- active messages: the owner's side ---- */

typedef struct ucx_reply {
  uint8_t hdr[RKEY_RESP_BYTES];
  fr_region *region; /* READ_RESP: the bytes being sent */
  uint8_t *copy;     /* READ_RESP of registered memory: the copy being sent (reply_copy) */
} ucx_reply;

static void reply_done(void *request, ucs_status_t st, void *arg) {
  ucx_reply *r = arg;
  fr_region_release(r->region);
  free(r->copy);
  free(r);
  if (request)
    ucp_request_free(request);
}

static void send_reply(ucx_link *u, unsigned id, ucx_reply *r, size_t hdr_len, const void *data,
                       size_t len) {
  if (!u->ep) {
    reply_done(NULL, UCS_OK, r);
    return;
  }
  ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                           .cb.send = reply_done,
                           .user_data = r};
  HB_HAND_OVER();
  ucs_status_ptr_t sp = ucp_am_send_nbx(u->ep, id, r->hdr, hdr_len, data, len, &p);
  if (sp == NULL || UCS_PTR_IS_ERR(sp))
    reply_done(NULL, UCS_OK, r);
}

/* A peer asks for a region's rkey: key checked here; registered memory is refused (ENOTSUP)
 * since the caller may free it after ferry_deregister, so peers read it with requests. */
static ucs_status_t on_rkey_req(void *arg, const void *header, size_t header_len, void *data,
                                size_t len, const ucp_am_recv_param_t *param) {
  ucx_link *u = arg;
  if (header_len != RKEY_REQ_BYTES || !u->uc)
    return UCS_OK;
  const uint8_t *h = header;
  fr_region *reg = NULL;
  ucx_mapping *m = NULL;
  int status =
      fr_region_acquire(&u->link->ctx->regions, fr_get_u64(h + 8), fr_get_u64(h + 16), 0, 0, &reg);
  if (status == 0 && !reg->map)
    status = FERRY_ENOTSUP;
  if (status == 0)
    status = fr_ucx_mapping_for(u, reg, &m);
  fr_region_release(reg);
  ucx_reply *r = calloc(1, sizeof *r);
  if (!r)
    return UCS_OK; /* the peer times out */
  fr_put_u64(r->hdr, fr_get_u64(h));
  fr_put_u64(r->hdr + 8, (uint64_t)(int64_t)status);
  fr_put_u64(r->hdr + 16, status == 0 ? (uint64_t)(uintptr_t)m->region->map : 0);
  fr_put_u64(r->hdr + 24, status == 0 ? m->region->size : 0);
  send_reply(u, AM_RKEY_RESP, r, RKEY_RESP_BYTES, status == 0 ? m->rkey : NULL,
             status == 0 ? m->rkey_len : 0);
  return UCS_OK;
}

/* Registered memory's bytes are its caller's, who may free them once ferry_deregister returned
 * (core/region.h), and UCX may send them long after this returns (a rendezvous the peer pulls):
 * a copy made while the region is in use goes out instead. */
static int reply_copy(ucx_reply *r, fr_region *reg, uint64_t off, uint64_t n) {
  if (!fr_region_is_registered(reg) || n == 0)
    return 0;
  if (!(r->copy = malloc(n)))
    return FERRY_ENOMEM;
  if (!fr_region_use_begin(reg))
    return FERRY_ENOTFOUND;
  int rc = 0;
  if (reg->kind == FERRY_MEM_CUDA)
    rc = fr_cuda_copy_on(reg->device, r->copy, reg->data + off, n);
  else {
    FR_ONE_SIDED_READ_BEGIN(); /* the owner may be rewriting them (core.h) */
    memcpy(r->copy, reg->data + off, n);
    FR_ONE_SIDED_READ_END();
  }
  fr_region_use_end(reg);
  return rc;
}

/* A peer asks for bytes: key and bounds checked here, then the bytes go from the region (a copy
 * of registered memory's). */
static ucs_status_t on_read_req(void *arg, const void *header, size_t header_len, void *data,
                                size_t len, const ucp_am_recv_param_t *param) {
  ucx_link *u = arg;
  if (header_len != READ_REQ_BYTES)
    return UCS_OK;
  const uint8_t *h = header;
  uint64_t off = fr_get_u64(h + 24), n = fr_get_u64(h + 32);
  fr_region *reg = NULL;
  int status = n > u->link->ctx->max_payload
                   ? FERRY_ERANGE
                   : fr_region_acquire(&u->link->ctx->regions, fr_get_u64(h + 8),
                                       fr_get_u64(h + 16), off, n, &reg);
  if (status == 0 && fr_ucx_check_memory(u, reg->data, "read") != 0)
    status = FERRY_ENOTSUP;
  ucx_reply *r = calloc(1, sizeof *r);
  if (!r) {
    fr_region_release(reg);
    return UCS_OK;
  }
  if (status == 0)
    status = reply_copy(r, reg, off, n);
  r->region = status == 0 ? reg : NULL;
  if (status != 0)
    fr_region_release(reg);
  fr_put_u64(r->hdr, fr_get_u64(h));
  fr_put_u64(r->hdr + 8, (uint64_t)(int64_t)status);
  const uint8_t *bytes = status != 0 ? NULL : r->copy ? r->copy : reg->data + off;
  send_reply(u, AM_READ_RESP, r, READ_RESP_BYTES, bytes, status == 0 ? n : 0);
  return UCS_OK;
}

/* ---- active messages: the requester's side ---- */

static ucx_req *req_find_locked(ucx_link *u, uint64_t id, int answer) {
  for (ucx_req *r = u->reqs; r; r = r->next)
    if (r->id == id && r->answer == answer && !r->done && !r->claimed)
      return r;
  return NULL;
}

static void req_finish(ucx_req *r, int status) {
  r->status = status;
  r->done = true;
}

static void read_data_cb(void *request, ucs_status_t st, size_t len, void *arg) {
  req_finish(arg, st == UCS_OK ? 0 : FERRY_EPEER);
  ucp_request_free(request);
}

static ucs_status_t on_rkey_resp(void *arg, const void *header, size_t header_len, void *data,
                                 size_t len, const ucp_am_recv_param_t *param) {
  ucx_link *u = arg;
  if (header_len != RKEY_RESP_BYTES || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV))
    return UCS_OK;
  const uint8_t *h = header;
  ucx_req *r = req_find_locked(u, fr_get_u64(h), AM_RKEY_RESP);
  if (!r)
    return UCS_OK;
  int status = (int)(int64_t)fr_get_u64(h + 8);
  r->base = fr_get_u64(h + 16);
  r->size = fr_get_u64(h + 24);
  if (status == 0 && (len == 0 || !(r->rkey = malloc(len))))
    status = len == 0 ? FERRY_EPROTO : FERRY_ENOMEM;
  if (status == 0) {
    memcpy(r->rkey, data, len);
    r->rkey_len = len;
  }
  req_finish(r, status > 0 ? FERRY_EPROTO : status);
  return UCS_OK;
}

static ucs_status_t on_read_resp(void *arg, const void *header, size_t header_len, void *data,
                                 size_t len, const ucp_am_recv_param_t *param) {
  ucx_link *u = arg;
  if (header_len != READ_RESP_BYTES)
    return UCS_OK;
  const uint8_t *h = header;
  ucx_req *r = req_find_locked(u, fr_get_u64(h), AM_READ_RESP);
  if (!r)
    return UCS_OK; /* timed out: dropped (a rendezvous sender completes) */
  int status = (int)(int64_t)fr_get_u64(h + 8);
  if (status == 0 && len != r->len)
    status = FERRY_EPROTO;
  if (status != 0 || len == 0) {
    req_finish(r, status > 0 ? FERRY_EPROTO : status);
    return UCS_OK;
  }
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    memcpy(r->dst, data, len);
    req_finish(r, 0);
    return UCS_OK;
  }
  ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                           .cb.recv_am = read_data_cb,
                           .user_data = r};
  r->claimed = true;
  ucs_status_ptr_t sp = ucp_am_recv_data_nbx(u->worker, data, r->dst, len, &p);
  if (sp == NULL)
    req_finish(r, 0);
  else if (UCS_PTR_IS_ERR(sp))
    req_finish(r, FERRY_EPEER);
  return UCS_OK;
}

int fr_ucx_set_handlers(ucx_link *u) {
  static const struct {
    unsigned id;
    ucp_am_recv_callback_t cb;
  } handlers[] = {{AM_RKEY_REQ, on_rkey_req},
                  {AM_RKEY_RESP, on_rkey_resp},
                  {AM_READ_REQ, on_read_req},
                  {AM_READ_RESP, on_read_resp}};
  for (size_t i = 0; i < sizeof handlers / sizeof handlers[0]; i++) {
    ucp_am_handler_param_t p = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
        .id = handlers[i].id,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
        .cb = handlers[i].cb,
        .arg = u};
    ucs_status_t st = ucp_worker_set_am_recv_handler(u->worker, &p);
    if (st != UCS_OK)
      return fr_ucx_err(FERRY_ESYS, st, "am handler", NULL);
  }
  return 0;
}

/* ---- requests ---- */

int fr_ucx_request_locked(ucx_link *u, ucx_req *r, unsigned am, const uint8_t *hdr, size_t len,
                          uint64_t deadline_ns) {
  int rc = fr_ucx_wait_ready_locked(u, deadline_ns);
  if (rc != 0)
    return rc;
  r->id = __atomic_add_fetch(&u->link->ctx->next_req_id, 1, __ATOMIC_RELAXED);
  uint8_t h[READ_REQ_BYTES];
  memcpy(h, hdr, len);
  fr_put_u64(h, r->id);
  r->next = u->reqs;
  u->reqs = r;
  ucx_op op = {0};
  ucp_request_param_t p = fr_ucx_op_param(&op);
  fr_ucx_op_issued(&op, ucp_am_send_nbx(u->ep, am, h, len, NULL, 0, &p));
  rc = fr_ucx_wait_locked(u, &op.done, deadline_ns);
  if (rc == 0 && op.status != UCS_OK)
    rc = FERRY_EPEER;
  if (rc == 0)
    rc = fr_ucx_wait_locked(u, &r->done, deadline_ns);
  if (r->claimed)
    fr_ucx_settle_locked(u, &r->done);
  for (ucx_req **pp = &u->reqs; *pp; pp = &(*pp)->next)
    if (*pp == r) {
      *pp = r->next;
      break;
    }
  return rc ? rc : r->status;
}

int fr_ucx_answer_error(ferry_link *l, int rc, const char *what, uint64_t id) {
  if (rc == FERRY_EPEER || rc == FERRY_ECLOSED || rc == FERRY_ETIMEDOUT)
    return fr_err(rc, "%s of region %llu from '%s': %s", what, (unsigned long long)id, l->peer,
                  rc == FERRY_ETIMEDOUT ? "no answer in time" : "link lost");
  return fr_err(rc, "%s of region %llu from '%s': refused by the owner (%s)", what,
                (unsigned long long)id, l->peer, ferry_strerror(rc));
}

int fr_ucx_am_read_locked(ucx_link *u, const ferry_region_ref *ref, uint64_t off, void *dst,
                          size_t len, uint64_t deadline_ns) {
  uint8_t hdr[READ_REQ_BYTES] = {0};
  fr_put_u64(hdr + 8, ref->id);
  fr_put_u64(hdr + 16, ref->key);
  fr_put_u64(hdr + 24, off);
  fr_put_u64(hdr + 32, len);
  ucx_req req = {.answer = AM_READ_RESP, .dst = dst, .len = len};
  int rc = fr_ucx_request_locked(u, &req, AM_READ_REQ, hdr, sizeof hdr, deadline_ns);
  return rc ? fr_ucx_answer_error(u->link, rc, "read", ref->id) : 0;
}
