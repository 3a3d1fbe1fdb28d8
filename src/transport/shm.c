/*
 * The shm transport: links between processes on one host. The control channel is a unix-domain
 * socket in the abstract namespace (nothing on disk to leak; scoped to the network namespace;
 * no file permissions either, so any local user may connect: a ctx with this user's own secret
 * refuses other uids by SO_PEERCRED before the handshake, and the token does the rest);
 * the handshake proves the peers share a host by having the connector read a memory segment the
 * acceptor passes it. One-sided reads and writes of a peer's ferry_alloc'd region are a memcpy
 * from/to its pages: the first access asks the owner for the region's memfd (the owner checks the
 * key), later ones use the cached mapping and check bounds and the region header here. Regions
 * that are registered caller memory cannot be mapped; for those the link falls back to read
 * requests the owner answers over the socket. A registered CUDA region is mapped through the
 * CUDA IPC handle its owner sends instead of a memfd, and copied by the copy engines.
 * A memfd is mapped once per link: when its owner frees a region and makes a new one of the same
 * memory (core/region.h, the cache), that region is read through the same mapping, recognized by
 * its id's lineage and the key in its header, without asking the owner again; a mapping whose
 * memfd the owner dropped for good is unmapped at the next new mapping, unless a view of it was
 * handed out.
 */
#include "transport/ring.h"
#include "transport/transport.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

/* One mapping of a peer's memory. A memfd is mapped once: when its owner frees the region and
 * takes the memfd back for a new one (core/region.h, the cache), the new region's MAP answer
 * brings the same file, and this mapping serves the new region (id, key and size change; they
 * are atomics, read without the lock). An access checks the header's region_id against the
 * region it wants before and after its copy, so a reader of the old region fails, and bounds
 * are checked against the mapping's own length too. */
typedef struct shm_map {
  uint64_t id, key, size;
  uint8_t *base; /* the mapping: header page, then data */
  size_t map_bytes;
  dev_t dev; /* the memfd's identity (a mapped one: base != NULL) */
  ino_t ino;
  uint64_t lineage; /* of the region ids it serves (fr_region_lineage), fixed */
  /* Accesses under way (atomic; taken under the link's lock) and whether a view was handed out:
   * a mapping whose memfd its owner dropped for good is unmapped once nobody uses it and it was
   * never viewed (sweep_dead), else it would hold the owner's freed pages until the link
   * closes. */
  int users;
  bool viewed;
  bool writable;    /* mprotect'ed for writes (mapped read-only at first), under the lock */
  bool stream_only; /* registered memory: use read requests */
  /* A peer's CUDA region, mapped through its IPC handle: cuda_base is the allocation here, data
   * starts at cuda_data; only the copy engines touch it (fr_cuda_copy_on, on device). */
  bool cuda;
  int device;
  void *cuda_base;
  uint8_t *cuda_data;
  struct shm_map *next;
} shm_map;

typedef struct shm_link {
  pthread_mutex_t lock;
  shm_map *maps;
  /* The byte stream, once the link is open. Each ring's position is written by the thread that
   * sends or the one that drains, on every message: a cache line each, apart from the rest.
   * Each side maps the segment itself (ring_map, unmapped only in shm_link_fini) and nothing
   * resets a ring: a peer that closes or exits drops only its own mapping, so the bytes it
   * wrote before its end stay readable here until this link is freed, and the receiver takes
   * them in after that end (link_rx.c, rx_last). */
  _Alignas(64) fr_ring tx;
  _Alignas(64) fr_ring rx;
  _Alignas(64) void *ring_map;
  size_t ring_len;
  int offer_fd;
  bool ring_on;
} shm_link;

static socklen_t unix_address(const char *where, struct sockaddr_un *sa) {
  memset(sa, 0, sizeof *sa);
  sa->sun_family = AF_UNIX;
  size_t n = strlen(where);
  if (n >= sizeof sa->sun_path)
    n = sizeof sa->sun_path - 1;
  memcpy(sa->sun_path, where, n);
  if (where[0] == '@')
    sa->sun_path[0] = '\0'; /* abstract namespace */
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n + (where[0] == '@' ? 0 : 1));
}

static int shm_listen(ferry_ctx *ctx, int *fd_out, char *url, size_t url_len) {
  char name[48];
  snprintf(name, sizeof name, "@ferry-%016llx", (unsigned long long)fr_random_u64());
  struct sockaddr_un sa;
  socklen_t len = unix_address(name, &sa);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0 || bind(fd, (struct sockaddr *)&sa, len) < 0 || listen(fd, 128) < 0) {
    int rc = fr_err_errno(FERRY_ESYS, "shm: cannot listen on %s", name);
    if (fd >= 0)
      close(fd);
    return rc;
  }
  snprintf(url, url_len, "shm://%s", name);
  *fd_out = fd;
  return 0;
}

static int shm_dial(const char *where, int timeout_ms, int *fd_out) {
  struct sockaddr_un sa;
  socklen_t len = unix_address(where, &sa);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return fr_err_errno(FERRY_ESYS, "shm: socket");
  char what[160];
  snprintf(what, sizeof what, "shm://%s", where);
  int rc = fr_sock_connect(fd, (struct sockaddr *)&sa, len, timeout_ms, what);
  if (rc != 0) {
    close(fd);
    return rc;
  }
  *fd_out = fd;
  return 0;
}

static int shm_peer_uid(int fd, uid_t *uid) {
  struct ucred cred;
  socklen_t len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof cred)
    return fr_err_errno(FERRY_ESYS, "shm: SO_PEERCRED");
  *uid = cred.uid;
  return 0;
}

static void shm_setup(int fd) {
  int buf = 1 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
}

static shm_link *shm_state(ferry_link *l) {
  /* Created lazily on the first one-sided access; links are started before any user call. */
  shm_link *s = __atomic_load_n((shm_link **)&l->tdata, __ATOMIC_ACQUIRE);
  if (s)
    return s;
  shm_link *fresh = aligned_alloc(_Alignof(shm_link), sizeof *fresh);
  if (!fresh)
    return NULL;
  memset(fresh, 0, sizeof *fresh);
  pthread_mutex_init(&fresh->lock, NULL);
  fresh->offer_fd = -1;
  void *expected = NULL;
  if (!__atomic_compare_exchange_n(&l->tdata, &expected, fresh, false, __ATOMIC_ACQ_REL,
                                   __ATOMIC_ACQUIRE)) {
    pthread_mutex_destroy(&fresh->lock);
    free(fresh);
    return expected;
  }
  return fresh;
}

/* Whether the mapped header describes region `id` of `size` bytes, which the mapping holds. */
static bool header_names(const shm_map *m, uint64_t id, uint64_t size) {
  const fr_shm_header *h = (const fr_shm_header *)m->base;
  return h->magic == FR_SHM_MAGIC && h->layout_version == FR_SHM_LAYOUT_VERSION &&
         __atomic_load_n(&h->region_id, __ATOMIC_ACQUIRE) == id &&
         __atomic_load_n(&h->data_bytes, __ATOMIC_RELAXED) == size &&
         h->header_bytes == FR_SHM_HEADER_BYTES && size <= m->map_bytes - FR_SHM_HEADER_BYTES;
}

/* Maps the memfd a region's owner sent. `size` is the owner's word, so the memfd itself must
 * hold header + size bytes and be sealed against shrinking (fr_shm_segment_check): else a size
 * near 2^64 wrapped the mapping's length, and a short or later truncated memfd raised SIGBUS in
 * the first copy. The header is compared, never used: the bounds are `size` as checked here. */
static int map_segment(int fd, uint64_t id, uint64_t size, shm_map *m) {
  char what[64];
  snprintf(what, sizeof what, "shm: region %llu", (unsigned long long)id);
  if (size > (uint64_t)SIZE_MAX - FR_SHM_HEADER_BYTES)
    return fr_err(FERRY_EPROTO, "%s: the owner claims %llu bytes", what, (unsigned long long)size);
  int rc = fr_shm_segment_check(fd, (size_t)size + FR_SHM_HEADER_BYTES, what);
  struct stat st;
  if (rc == 0 && fstat(fd, &st) != 0)
    rc = fr_err_errno(FERRY_EPROTO, "%s: cannot stat the peer's memory", what);
  if (rc != 0)
    return rc;
  if ((uint64_t)st.st_size > SIZE_MAX)
    return fr_err(FERRY_EPROTO, "%s: the peer's memory holds %lld bytes", what,
                  (long long)st.st_size);
  /* all of it, sealed: a later region on the same memfd may be longer than this one; read-only
   * until a write (writable_map): a read fault on a writable shared mapping costs up to 3x one
   * on a read-only one on some machines (docs/PERFORMANCE.md), and reads are what gets do */
  size_t bytes = (size_t)st.st_size;
  void *p = mmap(NULL, bytes, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED)
    return fr_err_errno(FERRY_ESYS, "shm: cannot map region %llu", (unsigned long long)id);
  m->base = p;
  m->map_bytes = bytes;
  m->dev = st.st_dev;
  m->ino = st.st_ino;
  if (!header_names(m, id, size)) {
    munmap(p, bytes);
    m->base = NULL;
    return fr_err(FERRY_EPROTO, "shm: region %llu has a foreign or corrupt header",
                  (unsigned long long)id);
  }
  return 0;
}

/* Maps a peer's CUDA region through the IPC handle it sent. The owner's words (size, offset,
 * allocation size) are checked against each other, and fr_cuda_ipc_open checks the allocation
 * really is that long, so every copy stays inside it. */
static int map_cuda(ferry_link *l, const ferry_region_ref *r, const fr_cuda_ipc *ipc, uint64_t size,
                    shm_map *m) {
  if (ipc->offset > ipc->alloc_bytes || size > ipc->alloc_bytes - ipc->offset)
    return fr_err(FERRY_EPROTO, "CUDA region %llu of '%s': %llu bytes at %llu of %llu",
                  (unsigned long long)r->id, l->peer, (unsigned long long)size,
                  (unsigned long long)ipc->offset, (unsigned long long)ipc->alloc_bytes);
  void *base = NULL;
  int rc = fr_cuda_ipc_open(ipc, -1, &base);
  if (rc != 0)
    return rc;
  m->cuda = true;
  m->device = fr_cuda_device_of(base);
  m->cuda_base = base;
  m->cuda_data = (uint8_t *)base + ipc->offset;
  return 0;
}

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELAXED)

/* Whether the mapped header describes region r alive, with r's key (a later region of the
 * memfd that m mapped for an earlier one: its id and key there, written by the owner before
 * ALIVE; bounds stay the mapping's own). */
static bool header_is(const shm_map *m, const ferry_region_ref *r) {
  const fr_shm_header *h = (const fr_shm_header *)m->base;
  return __atomic_load_n(&h->state, __ATOMIC_ACQUIRE) == FR_SHM_ALIVE &&
         header_names(m, r->id, r->size) &&
         __atomic_load_n(&h->region_key, __ATOMIC_RELAXED) == r->key;
}

/* The mapping that serves region r, or NULL. A region this link never asked for that its owner
 * made of memory mapped here already (same lineage) is taken on without asking the owner when
 * the header names it with r's key: whoever maps the memfd may read and write it all anyway. */
static shm_map *find_map(shm_link *s, const ferry_region_ref *r) {
  pthread_mutex_lock(&s->lock);
  shm_map *m = s->maps;
  while (m && LOAD(m->id) != r->id)
    m = m->next;
  for (shm_map *l = m ? NULL : s->maps; l; l = l->next)
    if (l->base && l->lineage == fr_region_lineage(r->id) && header_is(l, r)) {
      STORE(l->size, r->size);
      STORE(l->key, r->key);
      STORE(l->id, r->id);
      m = l;
      break;
    }
  if (m)
    __atomic_add_fetch(&m->users, 1, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&s->lock);
  return m;
}

static void put_map(shm_map *m) { __atomic_sub_fetch(&m->users, 1, __ATOMIC_RELEASE); }

/* Unmaps the mappings of memfds their owner dropped for good (state FREED or CLOSED, not
 * CACHED for a later region) that nobody uses and nobody viewed. Lock held. */
static void sweep_dead(shm_link *s) {
  for (shm_map **at = &s->maps; *at;) {
    shm_map *m = *at;
    uint32_t st = m->base ? __atomic_load_n(&((fr_shm_header *)m->base)->state, __ATOMIC_ACQUIRE)
                          : FR_SHM_ALIVE;
    if ((st == FR_SHM_FREED || st == FR_SHM_CLOSED) &&
        !__atomic_load_n(&m->viewed, __ATOMIC_RELAXED) &&
        __atomic_load_n(&m->users, __ATOMIC_ACQUIRE) == 0) {
      *at = m->next;
      munmap(m->base, m->map_bytes);
      free(m);
    } else {
      at = &m->next;
    }
  }
}

/* The mapping of the memfd fd already mapped here (its owner freed the region it served and
 * made a new one of it), now serving r: NULL when fd is new here. A mapping whose header does
 * not name r is an error: the owner sent the memfd as r's. */
static int map_again(shm_link *s, int fd, const ferry_region_ref *r, uint64_t size, shm_map **out) {
  struct stat st;
  *out = NULL;
  if (fstat(fd, &st) != 0)
    return 0;
  pthread_mutex_lock(&s->lock);
  shm_map *m = s->maps;
  while (m && !(m->base && m->dev == st.st_dev && m->ino == st.st_ino))
    m = m->next;
  bool ok = m && header_names(m, r->id, size);
  if (ok) {
    STORE(m->size, size);
    STORE(m->key, r->key);
    STORE(m->id, r->id);
    __atomic_add_fetch(&m->users, 1, __ATOMIC_RELAXED);
  }
  pthread_mutex_unlock(&s->lock);
  if (m && !ok)
    return fr_err(FERRY_EPROTO, "shm: region %llu has a foreign or corrupt header",
                  (unsigned long long)r->id);
  *out = m;
  return 0;
}

/* The mapping for a region, asking the owner (who checks the key) on first use; in use by the
 * caller until put_map. */
static int get_map(ferry_link *l, const ferry_region_ref *r, int timeout_ms, shm_map **out) {
  shm_link *s = shm_state(l);
  if (!s)
    return fr_err(FERRY_ENOMEM, "shm: link state");
  shm_map *m = find_map(s, r);
  if (m && LOAD(m->key) == r->key) {
    *out = m;
    return 0;
  }
  int fd = -1;
  uint64_t size = 0;
  fr_cuda_ipc ipc;
  bool cuda = false;
  int rc = fr_link_map_request(l, r, timeout_ms, &fd, &size, &ipc, &cuda);
  if (rc != 0 && rc != FERRY_ENOTSUP)
    return rc;
  if (m) { /* same region, another key that the owner accepted: cannot happen, keys are fixed */
    put_map(m);
    if (fd >= 0)
      close(fd);
    return fr_err(FERRY_EACCES, "region %llu: key changed", (unsigned long long)r->id);
  }
  if (rc == 0 && !cuda) {
    rc = map_again(s, fd, r, size, &m);
    if (rc != 0 || m) {
      close(fd);
      *out = m;
      return rc;
    }
  }
  shm_map *fresh = calloc(1, sizeof *fresh);
  if (!fresh) {
    if (fd >= 0)
      close(fd);
    return fr_err(FERRY_ENOMEM, "shm: mapping record");
  }
  *fresh = (shm_map){.id = r->id,
                     .key = r->key,
                     .size = size,
                     .lineage = fr_region_lineage(r->id),
                     .users = 1,
                     .stream_only = rc != 0};
  if (cuda && rc == 0 && map_cuda(l, r, &ipc, size, fresh) != 0) {
    fr_debug("shm: CUDA region %llu of '%s' through its owner: %s", (unsigned long long)r->id,
             l->peer, ferry_last_error());
    fresh->stream_only = true; /* read requests, which the owner stages through host memory */
  } else if (!fresh->stream_only && !cuda) {
    rc = map_segment(fd, r->id, size, fresh);
    close(fd);
    if (rc != 0) {
      free(fresh);
      return rc;
    }
  }
  pthread_mutex_lock(&s->lock);
  sweep_dead(s); /* a new mapping: drop the dead ones, so they never pile up */
  fresh->next = s->maps;
  s->maps = fresh;
  pthread_mutex_unlock(&s->lock);
  *out = fresh;
  return 0;
}

/* Retires the mapping of a freed region. It stays mapped until the link closes, since another
 * thread may be copying from it right now (and its owner may make a new region of it: then
 * map_again finds it); id 0 (never a region's id) keeps lookups away. */
static void drop_map(ferry_link *l, shm_map *dead, uint64_t id) {
  shm_link *s = l->tdata;
  pthread_mutex_lock(&s->lock);
  if (LOAD(dead->id) == id)
    STORE(dead->id, 0);
  pthread_mutex_unlock(&s->lock);
}

/* Whether the mapping still holds region id alive. A CUDA region has no header page to say it
 * was freed: its owner's deregistration is not seen here (the jobs' generation words are); it
 * reads as alive. */
static bool region_alive(const shm_map *m, uint64_t id) {
  if (m->cuda)
    return true;
  const fr_shm_header *h = (const fr_shm_header *)m->base;
  return __atomic_load_n(&h->state, __ATOMIC_ACQUIRE) == FR_SHM_ALIVE &&
         __atomic_load_n(&h->region_id, __ATOMIC_ACQUIRE) == id;
}

/* Resolves a mapped access: the mapping, bounds and liveness checks. On success the caller
 * holds the mapping until put_map. */
static int mapped_access(ferry_link *l, const ferry_region_ref *r, uint64_t off, size_t len,
                         int timeout_ms, shm_map **out) {
  shm_map *m = NULL;
  int rc = get_map(l, r, timeout_ms, &m);
  if (rc != 0)
    return rc;
  if (m->stream_only) {
    *out = m;
    return 0;
  }
  uint64_t size = LOAD(m->size); /* never past the mapping (map_again) */
  if (!fr_range_ok(off, len, size)) {
    put_map(m);
    return fr_err(FERRY_ERANGE, "region %llu of '%s': bytes [%llu, +%zu) outside its %llu bytes",
                  (unsigned long long)r->id, l->peer, (unsigned long long)off, len,
                  (unsigned long long)size);
  }
  if (!region_alive(m, r->id)) {
    drop_map(l, m, r->id);
    put_map(m);
    return fr_err(FERRY_ENOTFOUND, "region %llu of '%s' was freed", (unsigned long long)r->id,
                  l->peer);
  }
  *out = m;
  return 0;
}

/* After a copy: the bytes were region r's only if it is still alive there (its owner moves
 * the header's id or state before writing the region's memory again). */
static int after_copy(ferry_link *l, const ferry_region_ref *r, shm_map *m) {
  FR_FENCE(__ATOMIC_ACQUIRE); /* the copy's loads before the header's */
  if (!region_alive(m, r->id))
    return fr_err(FERRY_ESTALE, "region %llu of '%s' was freed during the copy",
                  (unsigned long long)r->id, l->peer);
  if (__atomic_load_n(&l->state, __ATOMIC_ACQUIRE) != FR_LINK_OPEN)
    return fr_err(FERRY_EPEER, "'%s' went away during the copy", l->peer);
  return 0;
}

/* The mapped address of byte `off` of a region: its pages, or its CUDA IPC mapping. */
static uint8_t *mapped_at(const shm_map *m, uint64_t off) {
  return (m->cuda ? m->cuda_data : m->base + FR_SHM_HEADER_BYTES) + off;
}

/* One copy between a caller's buffer (CUDA memory of `device`, or host memory: -1) and a mapped
 * region: a memcpy when both are host memory, else the copy engines. */
static int copy_mapped(const shm_map *m, int device, void *dst, const void *src, size_t len) {
  if (device < 0 && !m->cuda) {
    memcpy(dst, src, len);
    return 0;
  }
  return fr_cuda_copy_on(device >= 0 ? device : m->device, dst, src, len);
}

/* Makes a host mapping writable, once (a one-sided write into the peer's region). */
static int writable_map(ferry_link *l, shm_map *m) {
  shm_link *s = l->tdata;
  int rc = 0;
  pthread_mutex_lock(&s->lock);
  if (!m->writable && mprotect(m->base, m->map_bytes, PROT_READ | PROT_WRITE) != 0)
    rc = fr_err_errno(FERRY_ESYS, "shm: cannot write a region of '%s'", l->peer);
  m->writable = rc == 0;
  pthread_mutex_unlock(&s->lock);
  return rc;
}

/* A read or write of [off, off+len) with the caller's buffer on `device` (-1: host memory);
 * memory the link cannot map goes through the owner's stream requests. */
static int mapped_rw(ferry_link *l, const ferry_region_ref *r, uint64_t off, void *buf, size_t len,
                     int device, int timeout_ms, bool write) {
  shm_map *m = NULL;
  int rc = mapped_access(l, r, off, len, timeout_ms, &m);
  if (rc != 0)
    return rc;
  if (m->stream_only && device >= 0)
    rc = write ? fr_link_write_bounced(l, r, off, buf, len, device, timeout_ms)
               : fr_link_read_bounced(l, r, off, buf, len, device, timeout_ms);
  else if (m->stream_only)
    rc = write ? fr_link_rma_write(l, r, off, buf, len, timeout_ms)
               : fr_link_rma_read(l, r, off, buf, len, timeout_ms);
  else if (write && !m->cuda && (rc = writable_map(l, m)) != 0)
    ;
  else
    rc = write ? copy_mapped(m, device, mapped_at(m, off), buf, len)
               : copy_mapped(m, device, buf, mapped_at(m, off), len);
  if (rc == 0 && !m->stream_only)
    rc = after_copy(l, r, m);
  put_map(m);
  return rc;
}

static int shm_read(ferry_link *l, const ferry_region_ref *r, uint64_t off, void *dst, size_t len,
                    int timeout_ms) {
  return mapped_rw(l, r, off, dst, len, -1, timeout_ms, false);
}

/* Into a caller's CUDA buffer: one copy by the copy engines, from the mapped pages (host memory
 * they read directly) or the peer's CUDA region (device to device). */
static int shm_read_device(ferry_link *l, const ferry_region_ref *r, uint64_t off, void *dst,
                           size_t len, int device, int timeout_ms) {
  return mapped_rw(l, r, off, dst, len, device, timeout_ms, false);
}

static int shm_write(ferry_link *l, const ferry_region_ref *r, uint64_t off, const void *src,
                     size_t len, int timeout_ms) {
  return mapped_rw(l, r, off, (void *)src, len, -1, timeout_ms, true);
}

static int shm_write_device(ferry_link *l, const ferry_region_ref *r, uint64_t off, const void *src,
                            size_t len, int device, int timeout_ms) {
  return mapped_rw(l, r, off, (void *)src, len, device, timeout_ms, true);
}

/* One memcpy per run from the peer's mapped pages (registered memory: READV requests). */
static int shm_readv(ferry_link *l, const ferry_region_ref *r, const ferry_read_run *runs, size_t n,
                     void *dst, int timeout_ms) {
  uint64_t lo = UINT64_MAX, hi = 0;
  for (size_t i = 0; i < n; i++) {
    lo = runs[i].offset < lo ? runs[i].offset : lo;
    hi = runs[i].offset + runs[i].len > hi ? runs[i].offset + runs[i].len : hi;
  }
  shm_map *m = NULL;
  int rc = mapped_access(l, r, lo, hi - lo, timeout_ms, &m);
  if (rc != 0)
    return rc;
  if (m->stream_only) {
    put_map(m);
    return fr_link_rma_readv(l, r, runs, n, dst, timeout_ms);
  }
  uint8_t *at = dst;
  for (size_t i = 0; i < n && rc == 0; at += runs[i++].len)
    rc = copy_mapped(m, -1, at, mapped_at(m, runs[i].offset), runs[i].len);
  rc = rc ? rc : after_copy(l, r, m);
  put_map(m);
  return rc;
}

static int shm_view(ferry_link *l, const ferry_region_ref *r, uint64_t off, size_t len,
                    const void **out) {
  shm_map *m = NULL;
  int rc = mapped_access(l, r, off, len, l->ctx->timeout_ms, &m);
  if (rc != 0)
    return rc;
  bool host = !m->stream_only && !m->cuda;
  if (host) /* mapped until the link closes: set before put_map, so no sweep sees it unused */
    __atomic_store_n(&m->viewed, true, __ATOMIC_RELAXED);
  if (host && (rc = writable_map(l, m)) != 0) { /* callers write through views (pins, tables) */
    put_map(m);
    return rc;
  }
  put_map(m);
  if (!host)
    return fr_err(FERRY_ENOTSUP, "region %llu of '%s' is %s: it cannot be viewed from the CPU",
                  (unsigned long long)r->id, l->peer,
                  m->cuda ? "CUDA memory (ferry_view_device)"
                          : "registered memory (or CUDA memory its IPC handle could not map here)");
  *out = m->base + FR_SHM_HEADER_BYTES + off;
  return 0;
}

/* A peer's CUDA region through its IPC mapping: a device address in this process. */
static int shm_view_device(ferry_link *l, const ferry_region_ref *r, uint64_t off, size_t len,
                           const void **out) {
  shm_map *m = NULL;
  int rc = mapped_access(l, r, off, len, l->ctx->timeout_ms, &m);
  if (rc != 0)
    return rc;
  put_map(m); /* CUDA mappings have no pages here to sweep */
  if (!m->cuda)
    return fr_err(FERRY_ENOTSUP, "region %llu of '%s' is %s, not CUDA memory mapped here",
                  (unsigned long long)r->id, l->peer,
                  m->stream_only ? "reached through its owner" : "host memory (ferry_view)");
  *out = m->cuda_data + off;
  return 0;
}

static int shm_view_valid(ferry_link *l, const ferry_region_ref *r) {
  shm_link *s = shm_state(l);
  bool mapped = false, alive = false;
  if (s) { /* under the lock: a mapping nobody viewed may be swept */
    pthread_mutex_lock(&s->lock);
    shm_map *m = s->maps;
    while (m && (LOAD(m->id) != r->id || LOAD(m->key) != r->key))
      m = m->next;
    mapped = m && !m->stream_only && !m->cuda;
    alive = mapped && region_alive(m, r->id);
    pthread_mutex_unlock(&s->lock);
  }
  if (!mapped)
    return fr_err(FERRY_ENOTFOUND, "region %llu of '%s' is not viewed", (unsigned long long)r->id,
                  l->peer);
  return alive ? 0
               : fr_err(FERRY_ESTALE, "region %llu of '%s' was freed", (unsigned long long)r->id,
                        l->peer);
}

static void shm_link_fini(ferry_link *l) {
  shm_link *s = l->tdata;
  if (!s)
    return;
  if (s->ring_map)
    munmap(s->ring_map, s->ring_len);
  if (s->offer_fd >= 0)
    close(s->offer_fd);
  for (shm_map *m = s->maps, *next; m; m = next) {
    next = m->next;
    if (m->base)
      munmap(m->base, m->map_bytes);
    if (m->cuda_base)
      fr_cuda_ipc_close(m->cuda_base);
    free(m);
  }
  pthread_mutex_destroy(&s->lock);
  free(s);
}

/* ---- the byte stream: a shared-memory ring once open, the socket before ---- */

static shm_link *ring_of(ferry_link *l) {
  shm_link *s = __atomic_load_n((shm_link **)&l->tdata, __ATOMIC_ACQUIRE);
  return s && __atomic_load_n(&s->ring_on, __ATOMIC_ACQUIRE) ? s : NULL;
}

static void ring_doorbell(ferry_link *l, shm_link *s) {
  if (fr_ring_needs_doorbell(&s->tx)) {
    char bell = 'd';
    if (send(l->poller.fd, &bell, 1, MSG_DONTWAIT | MSG_NOSIGNAL) < 0 && errno != EAGAIN)
      fr_debug("shm doorbell to '%s': %s", l->peer, strerror(errno));
  }
}

/* The peer wrote a position it never had into its side of a ring: nothing of that ring is used
 * again, and the link closes (the caller's error, and the reader's -EPROTO, do that). */
static int ring_corrupt(ferry_link *l, const fr_ring *r, const char *peer_role) {
  fr_warn("link shm '%s': closing: the peer (%s) wrote an out-of-range ring position %llu "
          "(ring of %llu bytes, ours at %llu)",
          l->peer, peer_role, (unsigned long long)r->seen, (unsigned long long)(r->mask + 1),
          (unsigned long long)r->pos);
  return fr_err(FERRY_EPROTO, "shm ring of '%s' is corrupt (the peer wrote position %llu)", l->peer,
                (unsigned long long)r->seen);
}

static int ring_write_all(ferry_link *l, shm_link *s, const uint8_t *p, size_t len,
                          uint64_t deadline_ns) {
  while (len > 0) {
    size_t n = fr_ring_write(&s->tx, p, len);
    if (fr_ring_corrupt(&s->tx))
      return ring_corrupt(l, &s->tx, "consumer");
    p += n;
    len -= n;
    if (len == 0)
      break;
    ring_doorbell(l, s); /* the reader must know there is something to make room for */
    uint64_t slice = fr_now_ns() + 50000000ull;
    fr_ring_wait_space(&s->tx, len, (uint64_t)l->ctx->spin_us * 1000u,
                       slice < deadline_ns ? slice : deadline_ns);
    if (__atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == FR_LINK_DEAD)
      return fr_err(FERRY_EPEER, "'%s' went away while we sent", l->peer);
    if (fr_now_ns() >= deadline_ns)
      return fr_err(FERRY_ETIMEDOUT, "send: '%s' did not take the bytes in time", l->peer);
  }
  return 0;
}

static int shm_sendv(ferry_link *l, struct iovec *iov, int iovcnt, int fd_out,
                     uint64_t deadline_ns) {
  shm_link *s = ring_of(l);
  if (!s)
    return fr_link_sock_sendv(l, iov, iovcnt, fd_out, deadline_ns);
  if (fd_out >= 0) { /* fds cannot cross a ring: one marker byte carries it on the socket */
    char mark = 'f';
    struct iovec m = {&mark, 1};
    int rc = fr_link_sock_sendv(l, &m, 1, fd_out, deadline_ns);
    if (rc != 0)
      return rc;
  }
  for (int i = 0; i < iovcnt; i++) {
    int rc = ring_write_all(l, s, iov[i].iov_base, iov[i].iov_len, deadline_ns);
    if (rc != 0)
      return rc;
  }
  if (!l->quiet)
    ring_doorbell(l, s);
  return 0;
}

static void shm_ring(ferry_link *l) {
  shm_link *s = ring_of(l);
  if (s)
    ring_doorbell(l, s);
}

static ssize_t shm_recv(ferry_link *l, void *dst, size_t len) {
  shm_link *s = ring_of(l);
  if (!s)
    return fr_link_sock_recv(l, dst, len);
  size_t n = fr_ring_read(&s->rx, dst, len);
  if (n == 0 && fr_ring_corrupt(&s->rx)) {
    ring_corrupt(l, &s->rx, "producer");
    return -EPROTO;
  }
  return n ? (ssize_t)n : -EAGAIN;
}

/* Doorbells and fd markers: drained here; end of stream means the peer is gone. */
static int shm_readable(ferry_link *l) {
  if (!ring_of(l))
    return 0;
  char buf[256];
  for (;;) {
    ssize_t n = fr_link_sock_recv(l, buf, sizeof buf);
    if (n == -EAGAIN || n == -EWOULDBLOCK)
      return 0;
    if (n == 0)
      return fr_err(FERRY_EPEER, "peer closed the connection");
    if (n < 0) {
      errno = (int)-n;
      return fr_err_errno(FERRY_EPEER, "recv");
    }
  }
}

static bool shm_idle(ferry_link *l) {
  shm_link *s = ring_of(l);
  return !s || fr_ring_sleep(&s->rx);
}

static bool shm_pollable(ferry_link *l) { return ring_of(l) != NULL; }

static void shm_poll_begin(ferry_link *l) {
  shm_link *s = ring_of(l);
  if (s)
    fr_ring_poll_begin(&s->rx);
}

static void shm_poll_end(ferry_link *l) {
  shm_link *s = ring_of(l);
  if (s)
    fr_ring_poll_end(&s->rx);
}

static int shm_offer(ferry_link *l, int *fd) {
  shm_link *s = shm_state(l);
  if (!s)
    return fr_err(FERRY_ENOMEM, "shm: link state");
  uint64_t bytes = (uint64_t)fr_config_int("FERRY_SHM_RING_BYTES");
  if (bytes < 4096 || bytes > (1ull << 30) || (bytes & (bytes - 1)))
    return fr_err(FERRY_EINVAL, "FERRY_SHM_RING_BYTES=%llu: a power of two, 4 KiB..1 GiB",
                  (unsigned long long)bytes);
  int rc = fr_ring_segment_create(bytes, &s->offer_fd, &s->ring_map, &s->ring_len);
  if (rc != 0)
    return rc;
  fr_ring_attach(s->ring_map, 0, bytes, &s->tx);
  fr_ring_attach(s->ring_map, 1, bytes, &s->rx);
  *fd = s->offer_fd;
  return 0;
}

static int shm_accept_offer(ferry_link *l, int fd) {
  if (fd < 0)
    return fr_err(FERRY_EPROTO, "'%s' offered no ring segment", l->peer);
  shm_link *s = shm_state(l);
  uint64_t bytes = 0;
  int rc = s ? fr_ring_segment_map(fd, &s->ring_map, &s->ring_len, &bytes)
             : fr_err(FERRY_ENOMEM, "shm: link state");
  close(fd);
  if (rc != 0)
    return rc;
  fr_ring_attach(s->ring_map, 1, bytes, &s->tx);
  fr_ring_attach(s->ring_map, 0, bytes, &s->rx);
  return 0;
}

static void shm_opened(ferry_link *l) {
  shm_link *s = l->tdata;
  if (s->offer_fd >= 0) {
    close(s->offer_fd);
    s->offer_fd = -1;
  }
  __atomic_store_n(&s->ring_on, true, __ATOMIC_RELEASE);
}

static int shm_fetch_fd(ferry_link *l, uint64_t deadline_ns, int *fd) {
  char buf[64];
  while ((*fd = fr_link_take_fd(l)) < 0) {
    ssize_t n = fr_link_sock_recv(l, buf, sizeof buf);
    if (n == 0)
      return fr_err(FERRY_EPEER, "peer closed the connection");
    if (n == -EAGAIN) {
      struct pollfd p = {.fd = l->poller.fd, .events = POLLIN};
      if (fr_ms_left(deadline_ns) == 0 || poll(&p, 1, fr_ms_left(deadline_ns)) == 0)
        return fr_err(FERRY_ETIMEDOUT, "'%s' did not pass the promised fd", l->peer);
    } else if (n < 0 && n != -EINTR) {
      errno = (int)-n;
      return fr_err_errno(FERRY_EPEER, "recv");
    }
  }
  return 0;
}

const fr_transport_ops fr_shm_transport = {
    .name = "shm",
    .scheme = "shm://",
    .passes_fds = true,
    .listen = shm_listen,
    .dial = shm_dial,
    .setup = shm_setup,
    .peer_uid = shm_peer_uid,
    .sendv = shm_sendv,
    .recv = shm_recv,
    .readable = shm_readable,
    .idle = shm_idle,
    .pollable = shm_pollable,
    .poll_is_cheap = true,
    .any_thread_events = true,
    .poll_begin = shm_poll_begin,
    .poll_end = shm_poll_end,
    .ring = shm_ring,
    .offer = shm_offer,
    .accept_offer = shm_accept_offer,
    .opened = shm_opened,
    .fetch_fd = shm_fetch_fd,
    .read = shm_read,
    .readv = shm_readv,
    .write = shm_write,
    .read_device = shm_read_device,
    .write_device = shm_write_device,
    .view = shm_view,
    .view_device = shm_view_device,
    .view_valid = shm_view_valid,
    .link_fini = shm_link_fini,
};
