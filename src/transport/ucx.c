/*
 * The ucx transport: links over UCX's UCP layer, ferry's road to RDMA fabrics and GPU memory,
 * tested here over UCX's own tcp and shared-memory transports.
 *
 * A link keeps a tcp socket, as in tcp.c: it carries the handshake, and afterwards only
 * liveness (its end of stream means the peer is gone). Once the link is open each side sends
 * its UCP worker address on that socket (the preamble) and makes an endpoint to the peer's; the
 * link's byte stream then runs over the UCP stream API. Every link has its own worker, so its
 * two endpoints always pair with each other and no link waits behind another. The worker's
 * event fd sits in the ctx's epoll beside the socket: the progress thread drains the stream
 * when UCX has something and sleeps when it has not. Other threads progress the worker while
 * they wait for their own operations; when that leaves stream data or unarmed events behind,
 * they kick the progress thread through an eventfd.
 *
 * One-sided reads and writes of a peer's ferry_alloc'd region are UCP get/put with the region's
 * packed rkey, which the owner hands out once per region and link after checking the key (as
 * shm hands out memfds); later accesses check bounds here and read the region's state word with
 * one more small get, so a freed region reads as gone. The owner keeps a region mapped, and its
 * memory alive, while a link that was given its rkey lives. Where UCX only emulates RMA (its tcp
 * transport, where an emulated get is far slower than an active message) or the region is
 * registered caller memory, a read is an active message the owner answers after checking key
 * and bounds, and the bytes land in the destination through UCX's rendezvous; writes then go as
 * stream requests (link.c), which the owner checks the same way.
 *
 * This file holds the context: the per-ctx UCX state, regions of UCX memory and the mappings
 * that give peers this side's regions, `ferry info`'s description, and the ops table. A link's
 * worker, endpoint and byte stream are in ucx_ep.c, active messages in ucx_am.c, one-sided
 * reads and writes in ucx_rma.c; ucx_impl.h holds what they share.
 */
#include "transport/ucx.h"
#include "transport/ucx_impl.h"

#include <stdlib.h>
#include <string.h>
#include <ucs/config/global_opts.h>
#include <uct/api/uct.h>

/* ---- device memory ---- */

/* CUDA pointers are told apart by core/cuda.c (the driver loaded at run time). Debian's UCX has
 * no CUDA support: ferry_read/ferry_write bring a caller's CUDA buffer through host memory before
 * it gets here (api.c), and a CUDA region is refused to peers' requests. A UCX built with CUDA
 * (uc->cuda) takes device memory itself: the seam for GPUDirect (docs/UCX.md). */
int fr_ucx_check_memory(const ucx_link *u, const void *p, const char *what) {
  if (!p || !fr_cuda_is_device(p) || (u->uc && u->uc->cuda))
    return 0;
  return fr_err(FERRY_ENOTSUP,
                "ucx %s: %p is device (CUDA) memory: not supported in this build (UCX has no "
                "CUDA memory support; see docs/UCX.md)",
                what, p);
}

/* ---- the per-ctx state ---- */

ucx_ctx *fr_ucx_ctx_of(ferry_ctx *ctx) {
  void **slot = fr_ctx_tstate(ctx, &fr_ucx_transport);
  return slot ? *slot : NULL;
}

static int parse_rma_mode(int *out) {
  const char *m = fr_config_str("FERRY_UCX_RMA");
  *out = strcmp(m, "get") == 0 ? RMA_GET : strcmp(m, "am") == 0 ? RMA_AM : RMA_AUTO;
  if (*out == RMA_AUTO && strcmp(m, "auto") != 0)
    return fr_err(FERRY_EINVAL, "FERRY_UCX_RMA='%s': get, am or auto", m);
  return 0;
}

/* Whether UCX may open its tcp transport: UCX_TLS and UCX_NET_DEVICES allow it (a setting that
 * no transport takes draws a warning from UCX). Network devices are named `eth0`, RDMA ports
 * `mlx5_0:1`. */
static bool tcp_may_run(void) {
  const char *tls = getenv("UCX_TLS"), *dev = getenv("UCX_NET_DEVICES");
  bool tls_ok = !tls || !*tls ||
                (tls[0] == '^' ? !strstr(tls, "tcp") : strstr(tls, "tcp") || strstr(tls, "all"));
  if (!tls_ok || !dev || !*dev || strstr(dev, "all"))
    return tls_ok;
  char *list = strdup(dev), *save = NULL;
  bool netdev = !list;
  for (char *d = list ? strtok_r(list, ",", &save) : NULL; d && !netdev;
       d = strtok_r(NULL, ",", &save))
    netdev = !strchr(d, ':');
  free(list);
  return netdev;
}

/* ferry's defaults for UCX settings the user left unset (the variable in the environment wins):
 * - RNDV_SCHEME=get_zcopy: reads pull, so a large read over shared memory is one cma copy.
 * - TCP_TX_SEG_SIZE, TCP_RX_SEG_SIZE=2M where tcp may run (UCX's own: 8K, 64K): UCX's tcp
 *   sends the answer to a read in fragments of one segment, each its own send, receive, copy
 *   and progress call, and answers up to one segment go eager, without a rendezvous round trip
 *   (docs/UCX.md; 2M reads 64 MiB faster than 512K, 8M no faster).
 * - TCP_CONN_NB=y where tcp may run (UCX's own: n): UCX's tcp connects without blocking. With
 *   a blocking connect, an endpoint made while its peer dies (its connection request fails and
 *   the reconnect is refused at once) is marked failed before it has its send side, and UCX
 *   1.13 then aborts the process on its own assertion (tcp_ep.c:478; docs/UCX.md, "A peer that
 *   dies during wire-up"). A connect that does not block fails later, through the endpoint's
 *   error handler, and the link fails as for any dead peer.
 * UCP takes transport settings by their name within the transport (TX_SEG_SIZE, CONN_NB: tcp's
 * alone). */
static void config_defaults(ucp_config_t *config) {
  static const char *const defaults[][3] = {{"UCX_RNDV_SCHEME", "RNDV_SCHEME", "get_zcopy"},
                                            {"UCX_TCP_TX_SEG_SIZE", "TX_SEG_SIZE", "2M"},
                                            {"UCX_TCP_RX_SEG_SIZE", "RX_SEG_SIZE", "2M"},
                                            {"UCX_TCP_CONN_NB", "CONN_NB", "y"}};
  size_t n = tcp_may_run() ? sizeof defaults / sizeof defaults[0] : 1;
  for (size_t i = 0; i < n; i++)
    if (!getenv(defaults[i][0]) &&
        ucp_config_modify(config, defaults[i][1], defaults[i][2]) != UCS_OK)
      fr_debug("ucx: could not set %s=%s", defaults[i][0], defaults[i][2]);
}

static int uctx_open(ferry_ctx *ctx, ucx_ctx **out) {
  ucx_ctx *uc = calloc(1, sizeof *uc);
  if (!uc)
    return fr_err(FERRY_ENOMEM, "ucx: ctx state");
  pthread_mutex_init(&uc->lock, NULL);
  int rc = parse_rma_mode(&uc->rma);
  ucp_config_t *config = NULL;
  ucs_status_t st = rc == 0 ? ucp_config_read(NULL, NULL, &config) : UCS_OK;
  if (st == UCS_OK && rc == 0)
    config_defaults(config);
  if (st == UCS_OK && rc == 0) {
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                                    UCP_PARAM_FIELD_NAME,
                      .features = UCP_FEATURE_STREAM | UCP_FEATURE_RMA | UCP_FEATURE_AM |
                                  UCP_FEATURE_WAKEUP,
                      .mt_workers_shared = 1,
                      .name = "ferry"};
    st = ucp_init(&p, config, &uc->context);
    ucp_config_release(config);
  }
  if (rc == 0 && st != UCS_OK)
    rc = fr_ucx_err(FERRY_ENOTSUP, st, "init (check UCX_TLS / UCX_NET_DEVICES)", NULL);
  if (rc != 0) {
    pthread_mutex_destroy(&uc->lock);
    free(uc);
    return rc;
  }
  uc->refs = 1;
  ucp_context_attr_t attr = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
  if (ucp_context_query(uc->context, &attr) == UCS_OK)
    uc->cuda = attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA);
  *out = uc;
  return 0;
}

void fr_ucx_mapping_unref_locked(ucx_ctx *uc, ucx_mapping *m) {
  if (--m->refs > 0)
    return;
  for (ucx_mapping **pp = &uc->maps; *pp; pp = &(*pp)->next)
    if (*pp == m) {
      *pp = m->next;
      break;
    }
  ucp_rkey_buffer_release(m->rkey);
  if (m->own_memh)
    ucp_mem_unmap(uc->context, m->memh);
  fr_region_release(m->region);
  free(m);
}

/* ---- regions of UCX memory (ferry_alloc in a ctx that lists ucx first) ---- */

typedef struct ucx_memory {
  ucx_ctx *uc; /* a reference */
  ucp_mem_h memh;
} ucx_memory;

static void uctx_unref(ucx_ctx *uc) {
  if (__atomic_sub_fetch(&uc->refs, 1, __ATOMIC_ACQ_REL) > 0)
    return;
  ucp_cleanup(uc->context);
  pthread_mutex_destroy(&uc->lock);
  free(uc);
}

static void memory_release(void *handle) {
  ucx_memory *mem = handle;
  ucp_mem_unmap(mem->uc->context, mem->memh);
  uctx_unref(mem->uc);
  free(mem);
}

/* Memory UCX allocates (its first choice is shared memory, sysv or posix, whose rkeys a peer on
 * the host maps: a read is then one memcpy, where a memfd region is copied by cma). */
static int ucx_alloc_region(ferry_ctx *ctx, size_t bytes, fr_region_mem *out) {
  ucx_ctx *uc = fr_ucx_ctx_of(ctx);
  ucx_memory *mem = uc ? calloc(1, sizeof *mem) : NULL;
  if (!mem)
    return fr_err(uc ? FERRY_ENOMEM : FERRY_EINVAL, "ucx: memory record");
  ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                                           UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                           UCP_MEM_MAP_PARAM_FIELD_FLAGS,
                             .address = NULL,
                             .length = bytes,
                             .flags = UCP_MEM_MAP_ALLOCATE};
  ucs_status_t st = ucp_mem_map(uc->context, &mp, &mem->memh);
  ucp_mem_attr_t a = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH};
  if (st == UCS_OK && (st = ucp_mem_query(mem->memh, &a)) == UCS_OK &&
      ((uintptr_t)a.address % FR_SHM_HEADER_BYTES != 0 || a.length < bytes))
    st = UCS_ERR_UNSUPPORTED; /* heap memory: neither page-aligned nor zeroed */
  if (st != UCS_OK) {
    if (mem->memh)
      ucp_mem_unmap(uc->context, mem->memh);
    free(mem);
    return fr_ucx_err(FERRY_ENOSHM, st, "mem_map (allocate)", NULL);
  }
  mem->uc = uc;
  __atomic_add_fetch(&uc->refs, 1, __ATOMIC_RELAXED);
  *out = (fr_region_mem){.addr = a.address, .release = memory_release, .handle = mem};
  return 0;
}

/* A region's UCX registration: UCX memory's own, or a new one of a memfd's mapping (*own). */
static ucs_status_t region_memh(ucx_ctx *uc, const fr_region *reg, ucp_mem_h *memh, bool *own) {
  *own = reg->mem.release != memory_release;
  if (!*own) {
    *memh = ((const ucx_memory *)reg->mem.handle)->memh;
    return UCS_OK;
  }
  ucp_mem_map_params_t mp = {.field_mask =
                                 UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                             .address = reg->map,
                             .length = reg->map_bytes};
  return ucp_mem_map(uc->context, &mp, memh);
}

/* The mapping of a shared region, found or made (refs 0 when new: the caller takes one). */
static int mapping_get_locked(ucx_ctx *uc, fr_region *reg, ucx_mapping **out) {
  ucx_mapping *m = uc->maps;
  while (m && m->region != reg)
    m = m->next;
  if (m) {
    *out = m;
    return 0;
  }
  if (!(m = calloc(1, sizeof *m)))
    return fr_err(FERRY_ENOMEM, "ucx: mapping record");
  ucs_status_t st = region_memh(uc, reg, &m->memh, &m->own_memh);
  if (st == UCS_OK &&
      (st = ucp_rkey_pack(uc->context, m->memh, &m->rkey, &m->rkey_len)) != UCS_OK && m->own_memh)
    ucp_mem_unmap(uc->context, m->memh);
  if (st != UCS_OK) {
    free(m);
    return fr_ucx_err(FERRY_ESYS, st, "mem_map", NULL);
  }
  __atomic_add_fetch(&reg->refs, 1, __ATOMIC_RELAXED);
  m->region = reg;
  m->next = uc->maps;
  uc->maps = m;
  *out = m;
  return 0;
}

/* Drops a mapping that mapping_get_locked made and nobody took. */
static void mapping_drop_unused_locked(ucx_ctx *uc, ucx_mapping *m) {
  if (m->refs == 0) {
    m->refs = 1;
    fr_ucx_mapping_unref_locked(uc, m);
  }
}

/* The mapping of a shared region, made on first use; the link holds a reference. */
int fr_ucx_mapping_for(ucx_link *u, fr_region *reg, ucx_mapping **out) {
  ucx_ctx *uc = u->uc;
  pthread_mutex_lock(&uc->lock);
  ucx_mapping *m = NULL;
  int rc = mapping_get_locked(uc, reg, &m);
  bool given = false;
  for (ucx_given *g = u->given; rc == 0 && g && !given; g = g->next)
    given = g->m == m;
  ucx_given *g = rc == 0 && !given ? calloc(1, sizeof *g) : NULL;
  if (g) {
    g->m = m;
    g->next = u->given;
    u->given = g;
    m->refs++;
  } else if (rc == 0 && !given) {
    rc = fr_err(FERRY_ENOMEM, "ucx: mapping record");
    mapping_drop_unused_locked(uc, m);
  }
  pthread_mutex_unlock(&uc->lock);
  if (rc == 0)
    *out = m;
  return rc;
}

/* Publishes a shared region's rkey for records (access.h): BLOB_HDR_BYTES, then the packed rkey.
 * The mapping stays until the ctx closes, since the owner
 * cannot know who read the record (a region freed meanwhile keeps its memory until then, and its
 * state word says it was freed). Registered memory is not published: peers ask, and are told to
 * use read requests. */
static int ucx_region_pack(ferry_ctx *ctx, fr_region *reg, uint8_t *buf, size_t cap, size_t *len) {
  ucx_ctx *uc = fr_ucx_ctx_of(ctx);
  *len = 0;
  if (!uc || !reg->map)
    return 0;
  pthread_mutex_lock(&uc->lock);
  ucx_mapping *m = NULL;
  int rc = mapping_get_locked(uc, reg, &m);
  if (rc == 0 && BLOB_HDR_BYTES + m->rkey_len > cap) {
    rc = fr_err(FERRY_ERANGE, "ucx: packed rkey of %zu bytes", m->rkey_len);
    mapping_drop_unused_locked(uc, m);
  } else if (rc == 0) {
    if (!m->published)
      m->refs++;
    m->published = true;
    fr_put_u64(buf, reg->id);
    fr_put_u64(buf + 8, reg->key);
    fr_put_u64(buf + 16, (uint64_t)(uintptr_t)reg->map);
    fr_put_u64(buf + 24, reg->size);
    memcpy(buf + BLOB_HDR_BYTES, m->rkey, m->rkey_len);
    *len = BLOB_HDR_BYTES + m->rkey_len;
  }
  pthread_mutex_unlock(&uc->lock);
  return rc;
}

/* ---- ops: listen ---- */

static int ucx_listen(ferry_ctx *ctx, int *fd, char *url, size_t url_len) {
  ucx_ctx *uc = NULL;
  int rc = uctx_open(ctx, &uc);
  if (rc != 0)
    return rc;
  *fr_ctx_tstate(ctx, &fr_ucx_transport) = uc;
  char where[256];
  const char *cfg = fr_config_str("FERRY_UCX_LISTEN");
  if (*cfg) {
    fr_str_copy(where, sizeof where, cfg);
  } else { /* the tcp listener's host, any port */
    const char *colon = strrchr(ctx->tcp_listen, ':');
    int n = colon ? (int)(colon - ctx->tcp_listen) : (int)strlen(ctx->tcp_listen);
    snprintf(where, sizeof where, "%.*s:0", n, ctx->tcp_listen);
  }
  char *saved = ctx->tcp_listen; /* tcp's listen reads it; the ctx is not running yet */
  ctx->tcp_listen = where;
  rc = fr_tcp_transport.listen(ctx, fd, url, url_len);
  ctx->tcp_listen = saved;
  if (rc == 0 && strncmp(url, "tcp://", 6) == 0)
    memcpy(url, "ucx", 3);
  return rc;
}

/* ---- the ctx ---- */

static void ucx_ctx_fini(ferry_ctx *ctx) {
  void **slot = fr_ctx_tstate(ctx, &fr_ucx_transport);
  ucx_ctx *uc = slot ? *slot : NULL;
  if (!uc)
    return;
  pthread_mutex_lock(&uc->lock);
  ucx_link *held = uc->links; /* links the application still holds */
  uc->links = NULL;
  pthread_mutex_unlock(&uc->lock);
  for (ucx_link *u = held; u; u = u->next) {
    fr_ucx_release(u, ctx->epfd);
    u->uc = NULL;
  }
  pthread_mutex_lock(&uc->lock);
  while (uc->maps) {
    uc->maps->refs = 1;
    fr_ucx_mapping_unref_locked(uc, uc->maps);
  }
  pthread_mutex_unlock(&uc->lock);
  *slot = NULL;
  uctx_unref(uc); /* regions of UCX memory may hold it a little longer (the region table) */
}

/* ---- ferry info ---- */

static void describe_md(uct_component_h comp, const char *md_name, FILE *out) {
  uct_md_config_t *cfg = NULL;
  uct_md_h md = NULL;
  uct_tl_resource_desc_t *res = NULL;
  unsigned n = 0;
  if (uct_md_config_read(comp, NULL, NULL, &cfg) != UCS_OK)
    return;
  if (uct_md_open(comp, md_name, cfg, &md) == UCS_OK) {
    if (uct_md_query_tl_resources(md, &res, &n) == UCS_OK) {
      for (unsigned i = 0; i < n; i++)
        fprintf(out, " %s/%s", res[i].tl_name, res[i].dev_name);
      uct_release_tl_resource_list(res);
    }
    uct_md_close(md);
  }
  uct_config_release(cfg);
}

void fr_ucx_describe(FILE *out) {
  fprintf(out, "ucx:        UCX %s; transports/devices:", ucp_get_version_string());
  uct_component_h *comps = NULL;
  unsigned ncomps = 0;
  if (uct_query_components(&comps, &ncomps) == UCS_OK) {
    for (unsigned c = 0; c < ncomps; c++) {
      uct_component_attr_t a = {.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT};
      if (uct_component_query(comps[c], &a) != UCS_OK || a.md_resource_count == 0)
        continue;
      uct_md_resource_desc_t *mds = calloc(a.md_resource_count, sizeof *mds);
      a.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
      a.md_resources = mds;
      if (mds && uct_component_query(comps[c], &a) == UCS_OK)
        for (unsigned m = 0; m < a.md_resource_count; m++)
          describe_md(comps[c], mds[m].md_name, out);
      free(mds);
    }
    uct_release_component_list(comps);
  }
  const char *tls = getenv("UCX_TLS");
  fprintf(out, "\n            UCX_TLS=%s (UCX's own variables pass through)\n",
          tls ? tls : "(all)");
}

const fr_transport_ops fr_ucx_transport = {
    .name = "ucx",
    .scheme = "ucx://",
    .passes_fds = false,
    .listen = ucx_listen,
    .dial = fr_ucx_dial,
    .setup = fr_ucx_setup,
    .sendv = fr_ucx_sendv,
    .recv = fr_ucx_recv,
    .readable = fr_ucx_readable,
    .flush = fr_ucx_flush,
    .idle = fr_ucx_idle,
    .offer = fr_ucx_offer,
    .accept_offer = fr_ucx_accept_offer,
    .opened = fr_ucx_opened,
    .read = fr_ucx_read,
    .readv = fr_ucx_readv,
    .write = fr_ucx_write,
    .link_fini = fr_ucx_link_fini,
    .retire = fr_ucx_retire,
    .alloc_region = ucx_alloc_region,
    .region_pack = ucx_region_pack,
    .region_hint = fr_ucx_region_hint,
    .ctx_fini = ucx_ctx_fini,
};
