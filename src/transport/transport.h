/*
 * Transports and links, internal view. A transport is an ops table (registry.c lists them all);
 * a link is one connection to a peer, driven by whichever thread leads its context's epoll: a
 * caller waiting for its answer or message, else the context's progress thread (leader.c);
 * spinning waiters drain pollable links themselves. Jobs use links through ferry.h
 * (ferry_connect, ferry_send, ferry_read, ...) and never see these structs; transports know
 * nothing of jobs.
 */
#ifndef FR_TRANSPORT_H
#define FR_TRANSPORT_H

#include "core/core.h"
#include "core/region.h"
#include "core/stats.h"
#include "transport/ctxcalls.h"
#include "transport/linkcalls.h"
#include "transport/wire.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/types.h>

typedef struct fr_poller {
  int fd;
  void (*on_event)(struct fr_poller *p, uint32_t events);
} fr_poller;

typedef struct fr_transport_ops {
  const char *name;   /* "shm", "tcp" */
  const char *scheme; /* "shm://", "tcp://" */
  bool passes_fds;    /* the link can carry file descriptors (SCM_RIGHTS) */
  /* Opens a non-blocking listening socket; writes the URL peers dial into url. */
  int (*listen)(ferry_ctx *ctx, int *fd, char *url, size_t url_len);
  /* Dials `where` (the URL after the scheme); returns a connected, blocking socket. */
  int (*dial)(const char *where, int timeout_ms, int *fd);
  /* Socket options for a new link (both ends). */
  void (*setup)(int fd);
  /* Optional. The uid of the process at the other end of a link's socket, as the kernel vouches
   * for it (shm: SO_PEERCRED); 0 or a status. */
  int (*peer_uid)(int fd, uid_t *uid);
  /* The byte stream of a link. sendv writes all of iov (plus fd_out, when >= 0, beside it) by
   * the deadline; recv returns bytes (dst NULL: discard), 0 at end of stream, -EAGAIN when
   * nothing is there, or -errno. */
  int (*sendv)(ferry_link *l, struct iovec *iov, int iovcnt, int fd_out, uint64_t deadline_ns);
  ssize_t (*recv)(ferry_link *l, void *dst, size_t len);
  /* Optional. The ctx's leader saw the socket readable: consume what is there besides the
   * stream (doorbells, passed fds); 0 or a status that closes the link. */
  int (*readable)(ferry_link *l);
  /* Optional. The thread that drained this link is about to leave it (the leader going back to
   * its epoll, a spinner's last look): false if bytes arrived meanwhile and it must drain
   * again. */
  bool (*idle)(ferry_link *l);
  /* Optional. Spinning waiters may drive this link themselves (poll_begin/poll_end bracket
   * their spinning so producers can skip wake-ups). */
  bool (*pollable)(ferry_link *l);
  bool poll_is_cheap; /* polling costs no system call: fine to do on every link of a ctx */
  /* Its pollers may run on whichever thread leads the ctx's epoll (a waiting caller instead of
   * the progress thread, see leader.c); a ctx lets callers lead only if all its transports say
   * so. */
  bool any_thread_events;
  bool edge_triggered; /* its links sit in epoll with EPOLLET (the stream is all on the socket) */
  void (*poll_begin)(ferry_link *l);
  void (*poll_end)(ferry_link *l);
  /* Optional. Wakes the peer for what quiet frames left in its ring (fr_link_ring). */
  void (*ring)(ferry_link *l);
  /* Optional. Handshake: the connector offers an fd with its AUTH (offer), the acceptor takes
   * it (accept_offer), and both switch to their fast path once the link is open (opened). */
  int (*offer)(ferry_link *l, int *fd);
  int (*accept_offer)(ferry_link *l, int fd);
  void (*opened)(ferry_link *l);
  /* Optional. Waits for an fd that travels beside the stream (a MAP response's memfd). */
  int (*fetch_fd)(ferry_link *l, uint64_t deadline_ns, int *fd);
  /* One-sided operations; the stream implementations (fr_link_rma_*) serve transports that do
   * not have a faster path. */
  int (*read)(ferry_link *l, const ferry_region_ref *r, uint64_t off, void *dst, size_t len,
              int timeout_ms);
  /* Optional. Reads runs one after another into dst in as few round trips as the transport
   * allows (ferry_readv; without it, one read per run). */
  int (*readv)(ferry_link *l, const ferry_region_ref *r, const ferry_read_run *runs, size_t n,
               void *dst, int timeout_ms);
  int (*write)(ferry_link *l, const ferry_region_ref *r, uint64_t off, const void *src, size_t len,
               int timeout_ms);
  /* Optional. read and write where the caller's buffer is CUDA memory of `device` (shm: a copy by
   * the copy engines from the mapped region, host memory or a peer's CUDA memory through IPC).
   * Without them ferry_read/ferry_write move the bytes through host memory
   * (fr_link_read_bounced, fr_link_write_bounced). */
  int (*read_device)(ferry_link *l, const ferry_region_ref *r, uint64_t off, void *dst, size_t len,
                     int device, int timeout_ms);
  int (*write_device)(ferry_link *l, const ferry_region_ref *r, uint64_t off, const void *src,
                      size_t len, int device, int timeout_ms);
  int (*view)(ferry_link *l, const ferry_region_ref *r, uint64_t off, size_t len, const void **out);
  /* Optional. A peer's CUDA region mapped here (shm: its IPC mapping): a device address. */
  int (*view_device)(ferry_link *l, const ferry_region_ref *r, uint64_t off, size_t len,
                     const void **out);
  int (*view_valid)(ferry_link *l, const ferry_region_ref *r);
  void (*link_fini)(ferry_link *l); /* frees transport state (mappings) */
  /* Optional. The ctx's leader is unregistering a dead link: drop the fds the transport
   * added to the ctx's epoll for it (events already fetched are ignored, the link lives until
   * the end of the batch). */
  void (*retire)(ferry_link *l);
  /* Optional. This node is closing an open link gracefully (ferry_link_close, its ctx closing),
   * before the socket's end tells the peer: sees, bounded, that what sends handed to the
   * transport has left (ucx: a completed stream send may leave bytes in UCX's buffers), waiting
   * until deadline_ns at most (fr_link_flush_deadline: one deadline for all the links a closing
   * ctx flushes, so peers that stopped cost its close one bound in all, not one each). */
  void (*flush)(ferry_link *l, uint64_t deadline_ns);
  /* Optional. Memory for ferry_alloc in a ctx that lists this transport first (ucx: memory UCX
   * allocates, which its shared-memory transports let peers map, where a memfd would be copied
   * through the kernel); on failure ferry_alloc uses a memfd. Such a region has no memfd, so shm
   * links reach it through its owner, as registered memory. */
  int (*alloc_region)(ferry_ctx *ctx, size_t bytes, fr_region_mem *out);
  /* Optional. Region access blobs (access.h): what a peer may know of one of the ctx's regions
   * up front (ucx: its packed rkey), packed into buf (*len 0: nothing); and, on a link, such
   * bytes from a record, kept for the link's accesses to that region (bad bytes are ignored). */
  int (*region_pack)(ferry_ctx *ctx, fr_region *r, uint8_t *buf, size_t cap, size_t *len);
  void (*region_hint)(ferry_link *l, const uint8_t *bytes, size_t len);
  /* Optional. Frees the transport's per-ctx state (fr_ctx_tstate) once the ctx's links are
   * closed; also called when ferry_ctx_open fails after the transport's listen ran. */
  void (*ctx_fini)(ferry_ctx *ctx);
} fr_transport_ops;

/* registry.c: every transport, in one place. */
const fr_transport_ops *fr_transport_find(const char *name);

/* ---- links ---- */
enum fr_link_state { FR_LINK_HELLO, FR_LINK_AUTH, FR_LINK_OPEN, FR_LINK_DEAD };
enum fr_rx_phase { FR_RX_HEADER, FR_RX_BODY, FR_RX_PAYLOAD };

struct fr_pending {
  uint64_t id;
  uint8_t expect; /* the response type */
  void *dst;      /* READ: where the bytes go */
  uint64_t len;
  int status;
  bool done, claimed; /* claimed: the receive machine is writing into dst */
  int fd;             /* MAP: the fd that came with the response */
  uint64_t size;      /* MAP: the region's size */
  fr_cuda_ipc *ipc;   /* MAP: where a CUDA region's IPC handle goes (cuda set when one came) */
  bool cuda;
  ferry_msg *reply; /* CALL: the reply */
  struct fr_pending *next;
};

#define FR_SMALL_BODY 128
#define FR_MAX_RX_FDS 8

struct ferry_link {
  fr_poller poller;
  ferry_ctx *ctx;
  const fr_transport_ops *ops;
  int refs;
  char peer[FR_NAME_BYTES];
  bool accepted;
  uint64_t created_ns;

  pthread_mutex_t lock; /* state, pending, dead_status */
  pthread_cond_t cond;
  int state;
  int dead_status;
  fr_pending *pending;
  pthread_mutex_t send_lock;
  bool quiet; /* under send_lock: this frame rings no doorbell (fr_link_send_frame_quiet) */
  /* Metrics, written under send_lock (tx) and rx_lock (rx) with plain stores, read relaxed by a
   * snapshot: no locked instruction on the data path. */
  uint64_t tx_bytes, tx_frames;
  pthread_mutex_t rx_lock; /* the receive state below: the ctx's leader or a spinning waiter */

  /* receive state */
  int rx_phase;
  uint8_t rx_header[FR_FRAME_BYTES];
  uint8_t rx_body[FR_SMALL_BODY];
  size_t rx_have, rx_want;
  fr_frame rx_frame;
  uint8_t *rx_dst; /* payload destination, NULL: discard */
  uint64_t rx_left;
  ferry_msg *rx_msg;
  fr_pending *rx_req;
  fr_region *rx_region;
  fr_rma rx_rma;
  int rx_fds[FR_MAX_RX_FDS];
  int rx_nfds;
  uint8_t rx_stage[16384]; /* small frames arrive here, many per recv */
  size_t rx_stage_pos, rx_stage_len;
  bool rx_more;                 /* rx_drain stopped before the socket was empty */
  uint64_t rx_bytes, rx_frames; /* metrics, under rx_lock (see tx_bytes) */

  /* handshake (acceptor side) */
  uint8_t nonce_self[FR_NONCE_BYTES], nonce_peer[FR_NONCE_BYTES], proof[FR_NONCE_BYTES];

  void *tdata;             /* transport state */
  struct ferry_link *next; /* ctx->links */
};

/* A received message with its queue link; the payload follows the struct. */
typedef struct fr_msg_node { /* its size is a multiple of 16: the payload follows, aligned */
  _Alignas(16) struct fr_msg_node *next;
  uint64_t call_id; /* non-zero for a CALL: ferry_reply() answers it */
  size_t cap;       /* payload bytes the node holds (a reused node may hold more than len) */
  uint64_t kept_ns; /* on a free list (ctx.c): since when */
  ferry_msg msg;
} fr_msg_node;
static inline fr_msg_node *fr_msg_node_of(ferry_msg *m) {
  return (fr_msg_node *)((char *)m - offsetof(fr_msg_node, msg));
}
/* The one FIFO of messages, linked through their nodes: a channel's queue (chanq.c) and a job's
 * inbox (inbox.c) keep one each, as head and tail under their own lock (the caller holds it). */
static inline void fr_msg_fifo_push(fr_msg_node **head, fr_msg_node **tail, fr_msg_node *n) {
  n->next = NULL;
  if (*tail)
    (*tail)->next = n;
  else
    *head = n;
  *tail = n;
}
static inline fr_msg_node *fr_msg_fifo_pop(fr_msg_node **head, fr_msg_node **tail) {
  fr_msg_node *n = *head;
  if (n && !(*head = n->next))
    *tail = NULL;
  if (n)
    n->next = NULL;
  return n;
}
/* Frees every message left in the FIFO, which is then empty. */
static inline void fr_msg_fifo_free(fr_msg_node **head, fr_msg_node **tail) {
  for (fr_msg_node *n; (n = fr_msg_fifo_pop(head, tail));)
    ferry_msg_free(&n->msg);
}
ferry_msg *fr_msg_alloc(uint64_t len);
/* Bytes of free buffers kept for messages of len's size class (tests). */
size_t fr_msg_kept_bytes(uint64_t len);
/* Frees the kept buffers of the sizes not used for FERRY_MSG_KEEP_IDLE_MS by now_ns. */
void fr_msg_keep_trim(uint64_t now_ns);

/* ---- the context ---- */
typedef struct fr_channel {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  struct fr_msg_node *head, *tail;
  int count;        /* atomic, for spinning readers */
  bool last_costly; /* atomic: the last message came on a link that is not cheap to poll */
  bool kicked;      /* atomic: fr_ctx_kick, not yet seen by a wait (fr_ctx_await) */
  /* The owner (fr_ctx_channel_open), under lock; ops is also read atomically by ferry_recv.
   * With one, messages go to ops->on_msg and nothing is queued. */
  const fr_channel_ops *ops;
  void *arg;
} fr_channel;

typedef struct fr_listener {
  fr_poller poller;
  ferry_ctx *ctx;
  const fr_transport_ops *ops;
} fr_listener;

typedef struct fr_serve_job fr_serve_job;

#define FR_MAX_LISTENERS 4

struct ferry_ctx {
  char *name;
  bool log_node; /* this context names the process's log lines (fr_log_set_node) */
  char *token;
  /* The token came from the caller or FERRY_TOKEN, not this user's secret (fr_user_token): only
   * then may the ctx listen beyond loopback, or take shm links from another user. */
  bool token_explicit;
  char *tcp_listen;
  char address[512];
  const fr_transport_ops *order[FR_MAX_LISTENERS];
  size_t norder;
  fr_listener listeners[FR_MAX_LISTENERS];
  size_t nlisteners;
  uint64_t max_payload;
  int spin_us;
  int timeout_ms;

  int epfd;
  fr_poller wake;
  pthread_t progress;
  bool progress_started; /* a ctx whose open failed halfway may lack a thread: close joins none */
  bool stopping;

  /* Leading: one thread at a time waits in epoll_wait and runs the handlers, holding `lead`.
   * A caller about to sleep on its own response or message leads when it can (leader.c), so
   * the bytes it waits for wake it and no one else; the progress thread sleeps meanwhile in
   * outer_epfd, which holds epfd only while nobody leads it. */
  pthread_mutex_t lead;
  int outer_epfd;         /* the progress thread's epoll: epfd (lent while unled), outer_wake */
  int outer_wake;         /* eventfd: the progress thread must look at `stopping` */
  bool users_may_lead;    /* every transport of the ctx has any_thread_events */
  bool user_leading;      /* atomic: a caller holds `lead` */
  int lead_waits_for;     /* atomic: what that caller waits for (fr_ctx_wait's waits_for) */
  unsigned long leader;   /* atomic: the pthread_t running a batch (0: none) */
  uint64_t caller_led_ns; /* atomic: when a wait that is not idle last led or wanted to */
  bool lead_idle;         /* atomic: `lead` is held by an idle wait (or ucx's progress thread) */
  bool lead_brief;        /* atomic: the progress thread holds `lead` for one batch */
  bool lead_claimed;      /* atomic: a caller asked such a leader to step down */
  uint64_t next_reap;     /* under lead */
  /* leader.c's timing (FERRY_LEAD_FOLLOW_US, FERRY_SLEEPER_SLICE_MS, FERRY_SHARED_CORE_US),
   * read at open */
  uint64_t follow_ns, sleeper_slice_ns, shared_core_ns;

  fr_region_table regions;
  fr_channel channels[FERRY_MAX_CHANNELS];

  pthread_mutex_t links_lock;
  ferry_link *links; /* the links cheap to poll (shm rings) first: link.c links_insert */
  uint64_t next_req_id;

  pthread_t server; /* sends large read responses so the ctx's leader never blocks (server.c) */
  bool server_started;
  pthread_mutex_t serve_lock;
  pthread_cond_t serve_cond;
  fr_serve_job *serve_head, *serve_tail; /* large read responses, in order */
  fr_serve_job *stats_head, *stats_tail; /* calls for the metrics: served first (server.c) */

  ferry_link *grave[64]; /* retired during the current event batch */
  size_t ngrave;

  void *tstate[FR_MAX_LISTENERS]; /* per-transport state, parallel to order[] */

  /* Metrics (stats.c, linkstats.c): the collectors of this ctx's objects, and the link
   * counters of links already retired, per transport (parallel to order[]), under links_lock. */
  fr_stats stats;
  struct fr_link_totals {
    uint64_t opened, tx_bytes, tx_frames, rx_bytes, rx_frames;
  } link_totals[FR_MAX_LISTENERS];
  uint64_t link_errors[32];      /* atomic: links closed, by -status */
  ferry_metrics_server *metrics; /* FERRY_METRICS_LISTEN's server, or NULL */
};

/* linkstats.c: the ctx's own collector (links), registered by ferry_ctx_open. */
void fr_link_stats_collect(void *ctx, fr_stats_out *out);
/* Adds a retired link's counters to its ctx's totals; under links_lock. */
void fr_link_stats_fold(ferry_link *l);

/* A call's timeout: negative means the ctx's FERRY_TIMEOUT_MS (read when it opened). */
static inline int fr_ctx_timeout(const ferry_ctx *ctx, int timeout_ms) {
  return timeout_ms >= 0 ? timeout_ms : ctx->timeout_ms;
}

/* The opaque per-ctx slot of a transport in the ctx's order (NULL when it is not used). */
static inline void **fr_ctx_tstate(ferry_ctx *ctx, const fr_transport_ops *ops) {
  for (size_t i = 0; i < ctx->norder; i++)
    if (ctx->order[i] == ops)
      return &ctx->tstate[i];
  return NULL;
}

/* link.c; link_handshake.c (fr_link_handshake); link_rx.c (fr_link_take_fd, fr_link_reap_stale) */
ferry_link *fr_link_new(ferry_ctx *ctx, const fr_transport_ops *ops, int fd, bool accepted);
void fr_link_ref(ferry_link *l);
void fr_link_unref(ferry_link *l);
/* Registers a link in the ctx's epoll, for whichever thread leads it (the ctx then holds a
 * reference). */
int fr_link_start(ferry_link *l);
/* Marks the link dead with `status`, fails its pending requests and shuts its socket down: the
 * ctx's leader sees the hang-up and unregisters the link. */
void fr_link_fail(ferry_link *l, int status, const char *why);
/* The connector's side of the handshake, blocking, before the link is started. */
int fr_link_handshake(ferry_link *l, int timeout_ms);
/* Sends header + iov, whole, under the link's send lock. `fd_out` >= 0 rides along (shm). */
int fr_link_send_frame(ferry_link *l, const fr_frame *f, const struct iovec *iov, int iovcnt,
                       int fd_out, uint64_t deadline_ns);
/* The same without waking the peer: where the transport has doorbells (shm), the frame waits in
 * the ring until the peer polls or a later frame rings (a full ring still rings). */
int fr_link_send_frame_quiet(ferry_link *l, const fr_frame *f, const struct iovec *iov, int iovcnt,
                             uint64_t deadline_ns);
/* Stream one-sided operations: requests answered by the owner. */
int fr_link_rma_read(ferry_link *l, const ferry_region_ref *r, uint64_t off, void *dst, size_t len,
                     int timeout_ms);
int fr_link_rma_write(ferry_link *l, const ferry_region_ref *r, uint64_t off, const void *src,
                      size_t len, int timeout_ms);
/* READV requests of up to FR_READV_MAX_RUNS runs each, all sent before the first answer is
 * awaited. */
int fr_link_rma_readv(ferry_link *l, const ferry_region_ref *r, const ferry_read_run *runs,
                      size_t n, void *dst, int timeout_ms);
/* Sends a CALL and waits for its REPLY (a message owned by the caller). */
int fr_link_call(ferry_link *l, uint32_t channel, const struct iovec *iov, int iovcnt,
                 ferry_msg **reply, int timeout_ms);
/* fr_link_reply, fr_link_call_post/_ready/_collect, fr_link_ring, fr_link_poll: linkcalls.h */
/* Asks the owner for a region's memfd (shm): *fd and *size on success; for a CUDA region, its
 * IPC handle in *ipc instead (*cuda true, *fd -1). */
int fr_link_map_request(ferry_link *l, const ferry_region_ref *r, int timeout_ms, int *fd,
                        uint64_t *size, fr_cuda_ipc *ipc, bool *cuda);
/* ferry_read / ferry_write of a caller's CUDA buffer through host memory, chunk by chunk, with
 * the transport's host read/write (the default of ops->read_device / write_device). */
int fr_link_read_bounced(ferry_link *l, const ferry_region_ref *r, uint64_t off, void *dst,
                         size_t len, int device, int timeout_ms);
int fr_link_write_bounced(ferry_link *l, const ferry_region_ref *r, uint64_t off, const void *src,
                          size_t len, int device, int timeout_ms);
/* A READ_RESP whose payload is registered memory (its owner may free it once deregistered,
 * core/region.h): the header, then the bytes staged through host memory a chunk at a time (CUDA
 * memory by `stager`, host memory through buf, `chunk` bytes), each copied while the region's
 * bytes are in use and sent after, all under the send lock. A deregistration stops it between
 * chunks (FERRY_ENOTFOUND; the frame is cut short, so the link fails). */
typedef struct fr_link_stage {
  fr_region *region;
  fr_cuda_stager *stager; /* CUDA memory */
  uint8_t *buf;           /* host memory */
  size_t chunk;
} fr_link_stage;
int fr_link_send_frame_staged(ferry_link *l, const fr_frame *f, const struct iovec *iov, int iovcnt,
                              const fr_link_stage *stage, uint64_t deadline_ns);
/* Stream operations over the link's socket, for transports' sendv/recv. */
int fr_link_sock_sendv(ferry_link *l, struct iovec *iov, int iovcnt, int fd_out,
                       uint64_t deadline_ns);
ssize_t fr_link_sock_recv(ferry_link *l, void *dst, size_t len);
/* Takes an fd that arrived beside the stream; -1 when none did. */
int fr_link_take_fd(ferry_link *l);
/* Fails every handshake older than the timeout (the ctx's leader, at most once a second; the
 * progress thread's 1 s epoll timeout makes sure of it on a quiet node). */
void fr_link_reap_stale(ferry_ctx *ctx);
/* A graceful close's flush (ops->flush) waits until this deadline at most: the ctx's timeout,
 * and FR_LINK_FLUSH_NS at most. One deadline serves every link a closing ctx flushes. */
#define FR_LINK_FLUSH_NS (2000ull * 1000000ull)
uint64_t fr_link_flush_deadline(const ferry_ctx *ctx);
/* ops->flush, when the transport has one and the link is open. */
void fr_link_flush(ferry_link *l, uint64_t deadline_ns);

/* peerstats.c: fr_stats_call (linkcalls.h) */

/* metrics_http.c: fr_metrics_route (ctxcalls.h) */

/* the context: ctx.c, leader.c, chanq.c, spin.c, server.c, accept.c, msgcache.c */
void fr_ctx_deliver(ferry_ctx *ctx, ferry_msg *msg);
/* A link died: tells the channels' owners that want to know (fr_channel_ops.on_link_down);
 * called once per link, by the thread that retires it (chanq.c). */
void fr_ctx_link_down(ferry_ctx *ctx, ferry_link *l);
/* Drops the ctx's reference to a retired link once the current event batch is done. */
void fr_ctx_bury(ferry_ctx *ctx, ferry_link *l);
/* Queues a large read response for the server thread (takes the refs it is given). */
void fr_ctx_serve_later(ferry_ctx *ctx, ferry_link *l, uint64_t req_id, fr_region *r, uint64_t off,
                        uint64_t len);
/* The same for a READV: its runs (taken, freed after) one after another, `total` bytes. */
void fr_ctx_serve_later_v(ferry_ctx *ctx, ferry_link *l, uint64_t req_id, fr_region *r,
                          fr_rma_run *runs, uint32_t nruns, uint64_t total);
/* Spins up to ctx->spin_us for *flag, driving `link` (if pollable) meanwhile; returns whether
 * the flag became true. */
bool fr_spin_until(ferry_link *link, const bool *flag, int spin_us);
/* fr_ctx_wait, FR_CTX_WAIT_REPLY: ctxcalls.h */
/* leader.c: takes the ctx's lead (and its epoll out of the progress thread's) for the wait that
 * is about to follow on this thread, before the request it waits for goes out: an answer that
 * comes before the wait begins then finds no epoll lent to the progress thread to wake it
 * (loopback answers a small request within the send). False where it cannot (someone leads,
 * callers never lead). The next fr_ctx_wait of this thread on ctx leads with it; one that does
 * not come (the send failed, the wait ended before leading) is ended by fr_ctx_lead_early_end,
 * which does nothing when the lead was used or not taken. */
bool fr_ctx_lead_early(ferry_ctx *ctx);
void fr_ctx_lead_early_end(ferry_ctx *ctx);
/* Gives up this thread's early lead, if it holds one, before the send would wait (for the send
 * lock, or for room in the socket): while it waits, another thread must drive the links, or a
 * peer that waits for this node to read before it reads would never take the bytes. */
void fr_ctx_lead_early_drop(void);
/* fr_ctx_kick, fr_ctx_await, fr_ctx_take, fr_ctx_closing, fr_ctx_poll_links, fr_ctx_poke,
 * fr_ctx_spin, fr_ctx_work_polling, fr_ctx_channel_open, fr_inbox: ctxcalls.h */

/* tcp.c: what every listener on an address shares (the tcp transport's, and the metrics one's) */
/* Splits "HOST:PORT" or "[V6]:PORT" (HOST may be empty); FERRY_EINVAL when it is not one. */
int fr_split_host_port(const char *text, char *host, size_t hlen, char *port, size_t plen);
/* A listener beyond loopback lets any host that reaches it in: it needs an explicit fleet token
 * (ctx's, or FERRY_TOKEN when ctx is NULL); FERRY_EINVAL naming `what` and `where` otherwise. */
int fr_listen_exposure_check(const ferry_ctx *ctx, const struct sockaddr *sa, const char *what,
                             const char *where);

/* sock.c: socket helpers shared by the socket transports */
int fr_sock_set_nonblock(int fd, bool on);
/* Connects fd to addr within timeout_ms. */
int fr_sock_connect(int fd, const struct sockaddr *addr, socklen_t len, int timeout_ms,
                    const char *what);
/* Writes all of iov (plus an SCM_RIGHTS fd when fd_out >= 0) by the deadline. A full socket
 * buffer is first retried, yielding, for spin_ns (its reader is usually reading on another
 * core: a poll() sleep and wake-up per piece of a large message cost more than the piece),
 * then waited for with poll(). */
int fr_sock_sendv(int fd, struct iovec *iov, int iovcnt, int fd_out, uint64_t spin_ns,
                  uint64_t deadline_ns);
/* Reads exactly len bytes by the deadline, collecting passed fds into fds/nfds when non-NULL. */
int fr_sock_recv_all(int fd, void *buf, size_t len, uint64_t deadline_ns, int *fds, int *nfds);
/* One non-blocking recvmsg; collects passed fds. Returns bytes, 0 on EOF, -EAGAIN or -errno. */
ssize_t fr_sock_recv_some(int fd, void *buf, size_t len, int *fds, int *nfds, int max_fds);

#endif
