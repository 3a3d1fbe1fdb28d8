/*
 * The ucx transport's one-sided reads and writes of a peer's region (overview in ucx.c): the
 * region's rkey, from a record or asked for once per link, then a memcpy where UCX mapped the
 * region here, a UCP get or put where the endpoint has real RMA, or else read requests
 * (ucx_am.c) and stream write requests (link.c). Every access ends by reading the region's state
 * word, so a freed region reads as gone.
 */
#include "transport/ucx_impl.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* ---- ops: one-sided reads and writes ---- */

/* How a one-sided access reaches a peer's region (rem: its rkey, when asked for). */
enum { BY_REQUEST, BY_RMA, BY_PTR };
static int access_mode(const ucx_link *u, const ucx_remote *rem) {
  if (!rem || !rem->rkey)
    return BY_REQUEST;
  return rem->ptr ? BY_PTR : u->use_get ? BY_RMA : BY_REQUEST;
}

/* Makes a remote's rkey usable on the endpoint, and maps the region here where UCX can (its
 * header must then name the region, and hold its bytes). */
static int remote_unpack_locked(ucx_link *u, ucx_remote *rem, const void *packed) {
  ucs_status_t st = ucp_ep_rkey_unpack(u->ep, packed, &rem->rkey);
  if (st != UCS_OK)
    return fr_ucx_err(FERRY_EPROTO, st, "rkey unpack", u->link);
  if (!u->try_ptr || ucp_rkey_ptr(rem->rkey, rem->base, &rem->ptr) != UCS_OK) {
    rem->ptr = NULL; /* not UCX memory, or not mappable here */
    return 0;
  }
  const fr_shm_header *h = rem->ptr;
  if (h->magic != FR_SHM_MAGIC || h->region_id != rem->id || h->data_bytes < rem->size)
    rem->ptr = NULL;
  return 0;
}

/* A record's rkey (region_hint, access.h): kept, unpacked on first use. Bytes that do not
 * parse, or a region the link already knows, change nothing. */
void fr_ucx_region_hint(ferry_link *l, const uint8_t *bytes, size_t len) {
  ucx_link *u = ucx_of(l);
  if (!u || len <= BLOB_HDR_BYTES)
    return;
  ucx_remote *rem = calloc(1, sizeof *rem);
  void *packed = rem ? malloc(len - BLOB_HDR_BYTES) : NULL;
  if (!packed) {
    free(rem);
    return;
  }
  memcpy(packed, bytes + BLOB_HDR_BYTES, len - BLOB_HDR_BYTES);
  *rem = (ucx_remote){.id = fr_get_u64(bytes),
                      .key = fr_get_u64(bytes + 8),
                      .base = fr_get_u64(bytes + 16),
                      .size = fr_get_u64(bytes + 24),
                      .packed = packed,
                      .packed_len = len - BLOB_HDR_BYTES};
  pthread_mutex_lock(&u->lock);
  bool known = false;
  for (ucx_remote *r = u->remotes; r && !known; r = r->next)
    known = r->id == rem->id && r->key == rem->key;
  if (!known) {
    rem->next = u->remotes;
    u->remotes = rem;
  }
  pthread_mutex_unlock(&u->lock);
  if (known) {
    free(packed);
    free(rem);
  }
}

static void remote_unlink_locked(ucx_link *u, ucx_remote *rem) {
  for (ucx_remote **pp = &u->remotes; *pp; pp = &(*pp)->next)
    if (*pp == rem) {
      *pp = rem->next;
      break;
    }
  free(rem->packed);
  free(rem);
}

/* A remote known on this link: one whose rkey came from a record is unpacked now; if that
 * fails, it is forgotten and the owner is asked, as for a region never seen. */
static ucx_remote *remote_known_locked(ucx_link *u, const ferry_region_ref *ref) {
  ucx_remote *r = u->remotes;
  while (r && (r->id != ref->id || r->key != ref->key))
    r = r->next;
  if (!r || !r->packed)
    return r;
  int rc = u->ep ? remote_unpack_locked(u, r, r->packed) : FERRY_EPEER;
  free(r->packed);
  r->packed = NULL;
  if (rc == 0) {
    fr_debug("ucx: region %llu of '%s' by %s, its rkey from a record", (unsigned long long)r->id,
             u->link->peer,
             r->ptr       ? "memcpy (mapped here)"
             : u->use_get ? "get"
                          : "request");
    return r;
  }
  fr_err_clear();
  remote_unlink_locked(u, r);
  return NULL;
}

/* The rkey of a peer's region: from a record, or asked for once per link (the owner checks the
 * key). */
static int remote_for(ucx_link *u, const ferry_region_ref *ref, uint64_t deadline_ns,
                      ucx_remote **out) {
  if ((*out = remote_known_locked(u, ref)) != NULL)
    return 0;
  uint8_t hdr[RKEY_REQ_BYTES] = {0};
  fr_put_u64(hdr + 8, ref->id);
  fr_put_u64(hdr + 16, ref->key);
  ucx_req req = {.answer = AM_RKEY_RESP};
  int rc = fr_ucx_request_locked(u, &req, AM_RKEY_REQ, hdr, sizeof hdr, deadline_ns);
  ucx_remote *rem = NULL;
  if ((rc == 0 || rc == FERRY_ENOTSUP) && !(rem = calloc(1, sizeof *rem)))
    rc = fr_err(FERRY_ENOMEM, "ucx: remote region");
  else if (rc != 0 && rc != FERRY_ENOTSUP)
    rc = fr_ucx_answer_error(u->link, rc, "rkey", ref->id);
  if (rem)
    *rem = (ucx_remote){.id = ref->id, .key = ref->key, .base = req.base, .size = req.size};
  if (rc == 0 && u->ep)
    rc = remote_unpack_locked(u, rem, req.rkey);
  free(req.rkey);
  if (rem && (rc == 0 || rc == FERRY_ENOTSUP)) {
    fr_debug("ucx: region %llu of '%s' by %s", (unsigned long long)ref->id, u->link->peer,
             access_mode(u, rem) == BY_PTR   ? "memcpy (mapped here)"
             : access_mode(u, rem) == BY_RMA ? "get"
                                             : "request");
    rem->next = u->remotes;
    u->remotes = rem;
    *out = rem;
    return 0;
  }
  free(rem);
  return rc;
}

/* What a peer region's state word says: alive, freed, or gone with its owner's ctx (before the
 * link's end may have been noticed). */
static int state_check(const ucx_link *u, const ucx_remote *rem, uint32_t state) {
  if (state == FR_SHM_ALIVE)
    return 0;
  if (state == FR_SHM_CLOSED)
    return fr_err(FERRY_EPEER, "'%s' closed its ctx (region %llu)", u->link->peer,
                  (unsigned long long)rem->id);
  return fr_err(FERRY_ENOTFOUND, "region %llu of '%s' was freed", (unsigned long long)rem->id,
                u->link->peer);
}

/* The region's state word tells a freed region from a live one (the memory itself stays). */
static int rma_locked(ucx_link *u, const ucx_remote *rem, uint64_t off, void *buf, size_t len,
                      bool put, uint64_t deadline_ns) {
  int rc = fr_ucx_ep_check(u);
  if (rc != 0)
    return rc;
  uint64_t data = rem->base + FR_SHM_HEADER_BYTES + off;
  uint32_t state = 0;
  ucx_op ops[3] = {{0}};
  ucp_request_param_t p0 = fr_ucx_op_param(&ops[0]), p1 = fr_ucx_op_param(&ops[1]),
                      p2 = fr_ucx_op_param(&ops[2]);
  fr_ucx_op_issued(&ops[0], put ? ucp_put_nbx(u->ep, buf, len, data, rem->rkey, &p0)
                                : ucp_get_nbx(u->ep, buf, len, data, rem->rkey, &p0));
  fr_ucx_op_issued(&ops[1],
                   ucp_get_nbx(u->ep, &state, sizeof state,
                               rem->base + offsetof(fr_shm_header, state), rem->rkey, &p1));
  if (put) /* remote completion of the put */
    fr_ucx_op_issued(&ops[2], ucp_ep_flush_nbx(u->ep, &p2));
  else
    ops[2].done = true;
  for (int i = 0; i < 3; i++) { /* all of them: none may outlive this frame */
    int w = rc == 0 ? fr_ucx_wait_locked(u, &ops[i].done, deadline_ns) : 0;
    fr_ucx_settle_locked(u, &ops[i].done);
    rc = rc ? rc : w;
  }
  for (int i = 0; i < 3 && rc == 0; i++)
    if (ops[i].status != UCS_OK)
      rc = fr_ucx_err(FERRY_EPEER, ops[i].status, put ? "put" : "get", u->link);
  return rc ? rc : state_check(u, rem, __atomic_load_n(&state, __ATOMIC_ACQUIRE));
}

/* A peer region of UCX memory mapped here: one memcpy, then its state word, as rma_locked. */
static int ptr_copy_locked(ucx_link *u, const ucx_remote *rem, uint64_t off, void *buf, size_t len,
                           bool put) {
  int rc = fr_ucx_ep_check(u);
  if (rc != 0)
    return rc;
  uint8_t *data = (uint8_t *)rem->ptr + FR_SHM_HEADER_BYTES + off;
  if (put)
    memcpy(data, buf, len);
  else
    memcpy(buf, data, len);
  const fr_shm_header *h = rem->ptr;
  return state_check(u, rem, __atomic_load_n(&h->state, __ATOMIC_ACQUIRE));
}

/* The start of every one-sided access of region r from or into buf (what: "read", "write"):
 * NULL when the link is not open or UCX cannot reach buf (*rc says why); else the link, its lock
 * held, with *rc from waiting for the link and finding the region, *rem the region (NULL: not
 * looked up) and *mode how it is reached. */
static ucx_link *access_begin(ferry_link *l, const ferry_region_ref *r, const void *buf,
                              const char *what, uint64_t deadline, ucx_remote **rem, int *mode,
                              int *rc) {
  ucx_link *u = ucx_of(l);
  *rc = u ? fr_ucx_check_memory(u, buf, what) : fr_err(FERRY_EPEER, "ucx link is not open");
  if (*rc != 0)
    return NULL;
  pthread_mutex_lock(&u->lock);
  *rem = NULL;
  if ((*rc = fr_ucx_wait_ready_locked(u, deadline)) == 0 && (u->use_get || u->try_ptr))
    *rc = remote_for(u, r, deadline, rem);
  *mode = access_mode(u, *rem);
  return u;
}

/* FERRY_ERANGE unless bytes [off, +len) lie within the region. */
static int range_check(const ferry_link *l, const ferry_region_ref *r, const ucx_remote *rem,
                       uint64_t off, uint64_t len) {
  if (fr_range_ok(off, len, rem->size))
    return 0;
  return fr_err(FERRY_ERANGE, "region %llu of '%s': bytes [%llu, +%llu) outside its %llu bytes",
                (unsigned long long)r->id, l->peer, (unsigned long long)off,
                (unsigned long long)len, (unsigned long long)rem->size);
}

int fr_ucx_read(ferry_link *l, const ferry_region_ref *r, uint64_t off, void *dst, size_t len,
                int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  ucx_remote *rem;
  int mode, rc;
  ucx_link *u = access_begin(l, r, dst, "read", deadline, &rem, &mode, &rc);
  if (!u)
    return rc;
  if (rc == 0 && mode == BY_REQUEST)
    rc = fr_ucx_am_read_locked(u, r, off, dst, len, deadline);
  else if (rc == 0 && (rc = range_check(l, r, rem, off, len)) == 0)
    rc = mode == BY_PTR ? ptr_copy_locked(u, rem, off, dst, len, false)
                        : rma_locked(u, rem, off, dst, len, false, deadline);
  pthread_mutex_unlock(&u->lock);
  return rc;
}

/* A vectored read by RMA: every get issued before any is waited for, then the region's state
 * word after them, as rma_locked does for one. */
static int gets_locked(ucx_link *u, const ucx_remote *rem, const ferry_read_run *runs, size_t n,
                       uint8_t *dst, uint64_t deadline_ns) {
  int rc = fr_ucx_ep_check(u);
  ucx_op *ops = rc == 0 ? calloc(n + 1, sizeof *ops) : NULL;
  if (rc != 0 || !ops)
    return rc ? rc : fr_err(FERRY_ENOMEM, "ucx readv of %zu runs", n);
  uint32_t state = 0;
  for (size_t i = 0; i < n; dst += runs[i++].len) {
    ucp_request_param_t p = fr_ucx_op_param(&ops[i]);
    fr_ucx_op_issued(&ops[i],
                     ucp_get_nbx(u->ep, dst, runs[i].len,
                                 rem->base + FR_SHM_HEADER_BYTES + runs[i].offset, rem->rkey, &p));
  }
  ucp_request_param_t ps = fr_ucx_op_param(&ops[n]);
  fr_ucx_op_issued(&ops[n],
                   ucp_get_nbx(u->ep, &state, sizeof state,
                               rem->base + offsetof(fr_shm_header, state), rem->rkey, &ps));
  for (size_t i = 0; i <= n; i++) { /* all of them: none may outlive this frame */
    int w = rc == 0 ? fr_ucx_wait_locked(u, &ops[i].done, deadline_ns) : 0;
    fr_ucx_settle_locked(u, &ops[i].done);
    rc = rc ? rc : w;
  }
  for (size_t i = 0; i <= n && rc == 0; i++)
    if (ops[i].status != UCS_OK)
      rc = fr_ucx_err(FERRY_EPEER, ops[i].status, "get", u->link);
  free(ops);
  return rc ? rc : state_check(u, rem, __atomic_load_n(&state, __ATOMIC_ACQUIRE));
}

/* Runs of one region: mapped here, one memcpy each; by RMA, all gets in flight at once; else one
 * read request per run. */
int fr_ucx_readv(ferry_link *l, const ferry_region_ref *r, const ferry_read_run *runs, size_t n,
                 void *dst, int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  ucx_remote *rem;
  int mode, rc;
  ucx_link *u = access_begin(l, r, dst, "read", deadline, &rem, &mode, &rc);
  if (!u)
    return rc;
  for (size_t i = 0; rc == 0 && mode != BY_REQUEST && i < n; i++)
    rc = range_check(l, r, rem, runs[i].offset, runs[i].len);
  uint8_t *at = dst;
  if (rc == 0 && mode == BY_RMA)
    rc = gets_locked(u, rem, runs, n, at, deadline);
  else
    for (size_t i = 0; rc == 0 && i < n; at += runs[i++].len)
      rc = mode == BY_PTR ? ptr_copy_locked(u, rem, runs[i].offset, at, runs[i].len, false)
                          : fr_ucx_am_read_locked(u, r, runs[i].offset, at, runs[i].len, deadline);
  pthread_mutex_unlock(&u->lock);
  return rc;
}

int fr_ucx_write(ferry_link *l, const ferry_region_ref *r, uint64_t off, const void *src,
                 size_t len, int timeout_ms) {
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  ucx_remote *rem;
  int mode, rc;
  ucx_link *u = access_begin(l, r, src, "write", deadline, &rem, &mode, &rc);
  if (!u)
    return rc;
  bool by_stream = rc == 0 && mode == BY_REQUEST;
  if (rc == 0 && !by_stream && (rc = range_check(l, r, rem, off, len)) == 0)
    rc = mode == BY_PTR ? ptr_copy_locked(u, rem, off, (void *)src, len, true)
                        : rma_locked(u, rem, off, (void *)src, len, true, deadline);
  pthread_mutex_unlock(&u->lock);
  return by_stream ? fr_link_rma_write(l, r, off, src, len, timeout_ms) : rc;
}
