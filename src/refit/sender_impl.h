/*
 * The refit sender's state, shared by sender.c (open, declare, seal, the service thread) and
 * push.c.
 *
 * Locking: s->lock guards the receiver list and every receiver record, and nothing is ever sent
 * while it is held. What to send is decided under it and queued in an outbox (outbox.c), and the
 * thread that queued it sends after unlocking: during a push only the pushing thread sends to the
 * receivers of the push (and, as it ends, the DROPPED notices); outside one the service thread
 * sends catch-up frames, and its ATTACH and VIEW replies go unlocked too. Nothing waits for a
 * receiver with the lock held, so a receiver whose link is full delays only that thread's next
 * frames, and the service thread keeps recording the others' acknowledgements.
 */
#ifndef FR_REFIT_SENDER_IMPL_H
#define FR_REFIT_SENDER_IMPL_H

#include "core/stats.h"
#include "core/cuda.h"
#include "refit/refit.h"
#include "refit/shard.h"
#include "transport/job.h"

#include <pthread.h>

/* Frames decided under s->lock and sent after it is released (outbox.c). fr_refit_out_add queues
 * a copy of m for link (a reference is taken; catchup: the frame belongs to a late joiner's
 * catch-up, not to a push); fr_refit_out_send sends them in order without the lock, each with its
 * own timeout; fr_refit_out_settle, under the lock again, applies what failed (a push's receiver
 * fails with the send's status, a catch-up stops) and empties the outbox. */
typedef struct fr_refit_out {
  ferry_link *link;
  fr_refit_msg_t m;
  char *route; /* ROUTE: m.route's own copy */
  int timeout_ms;
  bool catchup;
  int rc; /* of the send */
} fr_refit_out;
typedef struct fr_refit_outbox {
  fr_refit_out *v;
  size_t n, cap;
} fr_refit_outbox;

/* One receiver that attached. Lifetime: a record is freed only under s->lock, and never while it
 * is in a push (in_push; one that says goodbye is marked `detached` and goes when the push ends),
 * by the service thread (DETACH), by begin_push/finish_push on the pushing thread, or by close.
 * Its link reference goes with it; a frame queued for it (fr_refit_outbox) holds a reference of
 * its own, so a send that runs unlocked never touches a freed link. */
typedef struct receiver {
  ferry_link *link;
  char peer[64];
  char *address;      /* its ctx address, where a chain successor reads from ("" if unknown) */
  char *routed;       /* the predecessor address it was last told (ROUTE), or NULL */
  bool shm;           /* on this host */
  uint64_t committed; /* last version it committed */
  bool dropped;       /* acknowledged nothing within a push's timeout: left out of pushes until it
                         attaches again (its ATTACH call after our DROPPED notice) */

  /* the push under way (reset by begin_push) */
  bool in_push;
  bool orphan;             /* its chain broke above it: it gets the rest from the sender */
  struct receiver *up;     /* chain predecessor it reads from; NULL: the sender */
  struct receiver *down;   /* chain successor that reads from it */
  uint32_t announced;      /* buckets (by seq) announced to it */
  uint32_t acked;          /* buckets (by seq, a prefix) it verified */
  uint64_t progress_ns;    /* since when it owes an acknowledgement (it last acknowledged, or was
                              given something while it owed nothing) */
  ferry_region_ref fwd[2]; /* where it keeps seq % 2 for its successor, from its ACK */
  uint64_t fwd_offset[2];
  bool commit_sent;
  bool commit_seen;
  bool detached;     /* said goodbye during the push; freed after it */
  int status;        /* first failure in the current push */
  uint32_t blame;    /* with status FERRY_ESTALE: 1 + the rank of its group that failed the
                        version, as its ACK or COMMITTED said (0: not said) */
  uint64_t failures; /* metrics: pushes it did not commit (s->lock) */

  /* catching up (late join): it asked for the latest version outside a push */
  bool want_catchup;     /* asked; served once no push is under way */
  uint64_t lacks;        /* a push's version it asked for during that push (it was in it): it
                            does not hold it, whatever its COMMITTED said */
  uint64_t cu_version;   /* the version being sent to it now, 0 when none */
  uint32_t cu_announced; /* buckets announced (by index) */
  uint32_t cu_acked;     /* buckets it verified */
  uint64_t cu_view_sum;  /* a shard reader's: the sum of its view's runs in bucket */
  uint32_t cu_view_for;  /* cu_view_for - 1 (0: none), taken for its next announcement */

  /* shards (views.c): what it declared, and the view built from that between pushes */
  fr_refit_target *targets; /* by slot */
  uint32_t ntargets;
  uint32_t view_serial;                        /* of the last declaration taken (0: none) */
  bool view_stale;                             /* declarations came since the view was built */
  fr_refit_view *view;                         /* NULL: it reads whole buckets */
  uint64_t decl_rows, decl_bytes, decl_pieces; /* its targets' sums, against FR_REFIT_VIEW_* */
  bool view_refused; /* it declared past those limits: no view (until a new manifest) */
  uint64_t *vsum;    /* per seq of the push under way: the sum of its view's runs */
  /* a version sent in parts (stream.c): it was in the version's first part, and how it failed
   * one (0: it did not); it takes the later parts only while this is 0 */
  bool in_stream;
  int stream_status;
  struct receiver *next;
} receiver;

typedef struct declared {
  const void *data;
  int device; /* CUDA device ordinal of data, -1 for host memory (classified at declare, and at
                 ferry_refit_set_data) */
  bool given; /* pointed at (ferry_refit_set_data) since the last version ended: its buckets may
                 go in a part (stream.c) */
} declared;

/* A version sent in parts (stream.c; ferry_refit_push_opts.part), from its first part to its
 * last or its abandonment; only the pushing thread touches it. */
typedef struct fr_refit_stream {
  uint64_t version;   /* open in parts, 0: none */
  uint64_t spent;     /* the last version opened in parts: the next push must be greater */
  bool all_current;   /* as its first part found (skip_unchanged) */
  uint8_t *sent;      /* per bucket: sent (packed) in this version */
  uint32_t nsent;     /* how many */
  uint32_t find_hint; /* where the next name is looked up first (tensors come in plan order) */
  uint64_t bytes;     /* of the buckets its parts sent */
  uint64_t t0;        /* its first part's start */
  int first;          /* the first failure of a receiver in an earlier part (0: none) */
  char failed[512];   /* those receivers, named for the last part's error */
} fr_refit_stream;

/* Where a push's time goes (ferry_refit_push_phase_seconds_total, by phase; metrics.c): packing
 * buckets (device copies included), waiting for a free bucket slot while a bucket is left to
 * pack, waiting for the receivers' reads once every bucket is packed, sending the frames
 * (announcements, the COMMIT), and waiting for the COMMITTED answers. */
enum {
  FR_REFIT_PHASE_PACK,
  FR_REFIT_PHASE_SLOT_WAIT,
  FR_REFIT_PHASE_READ_WAIT,
  FR_REFIT_PHASE_NOTIFY,
  FR_REFIT_PHASE_COMMIT,
  FR_REFIT_PHASES
};

/* A device tensor that is cast reaches the host through this much scratch at a time. */
#define FR_REFIT_SCRATCH (4u << 20)
/* The service thread's wake (fr_job_wake): a push ended, late joiners that asked meanwhile are
 * served now (push.c). */
#define FR_REFIT_WAKE_CATCHUPS 1u

struct ferry_refit_sender {
  ferry_ctx *ctx;
  char *name;
  fr_refit_plan plan; /* entries double as the declarations until sealed */
  declared *src;
  size_t entries_cap, src_cap; /* of plan.entries and src, one slot per declared tensor */
  bool sealed;
  /* declarations since the last seal (none before the first): a push refuses until the next
   * seal, naming the first of them */
  uint32_t since_seal_count;
  char since_seal[FR_REFIT_NAME_MAX + 1];
  uint64_t budget;
  bool alias;               /* receivers may map buf[0] (alias mode) */
  bool device_buckets;      /* ferry_refit_opts.device_buckets */
  bool retain;              /* keep the latest version whole (not ferry_refit_opts.no_retain) */
  bool whole;               /* buf[0] holds every bucket (alias mode, or retaining), not
                               two of them */
  uint64_t retained;        /* the version whose every bucket buf[0] holds (late joiners
                               catch up from it), 0 when none or while a push rewrites it */
  fr_refit_name *published; /* its record in the directory, or NULL */
  struct fr_refit_packer *packer; /* the thread that copies while push() hashes, or NULL */
  void *buf[2];
  ferry_region_ref ref[2];
  uint64_t buf_bytes;
  bool on_device;   /* a declared tensor is CUDA memory (as of the seal): the buffers are pinned,
                       and one thread packs each bucket whole (copy engines want big copies) */
  bool pack_async;  /* FERRY_CUDA_PACK_ASYNC as of the seal: a bucket's device copies queued,
                       waited for once (pack.c) */
  bool pinned[2];   /* buf[i] is registered with the driver (fr_cuda_pin) */
  int pin_device;   /* the device whose context pins and unpins them: the first device tensor's
                       as of the first pin (registration is portable: it serves every device) */
  uint8_t *scratch; /* FR_REFIT_SCRATCH host bytes (pinned when it could be) where a device
                       tensor's bytes land before a cast or the fp8 scale reads them, or NULL */
  bool scratch_pinned;
  /* Alias mode or device_buckets, with every tensor on one CUDA device, sent as declared: the
   * device whose memory the buffers are (registered: receivers on this host map them through
   * CUDA IPC; alias views are device memory), packed by the copy engines and hashed through host
   * memory by `stager` (or not at all: FR_REFIT_DIRECT pushes); -1 when they are host memory. */
  int dev_buf;
  fr_cuda_stager *stager;     /* the pushing thread's */
  fr_cuda_stager *sum_stager; /* the service thread's, for the checksums catch-ups take */
  uint64_t *last_sum;         /* per bucket, of the bytes buf holds (whole) or last packed there */
  uint8_t *sum_known; /* per bucket: last_sum is taken (0: packed unhashed, FR_REFIT_DIRECT) */
  /* Bumped (s->lock held, atomically: a hash running unlocked reads it) whenever the buffer's
   * bytes may change: a push begins, a seal. A checksum taken without s->lock (a catch-up's,
   * fr_refit_sum_run) counts only if this did not move meanwhile. */
  uint64_t buf_epoch;
  bool summing;      /* the service thread is hashing a bucket without s->lock (a seal waits) */
  bool summing_host; /* ...of host memory, which a push rewrites: the push waits for it to stop */
  uint32_t bar_sums; /* a seal or a push waits for that hash, or close began: no other begins */
  uint8_t *manifest;
  size_t manifest_len;

  pthread_mutex_t lock;
  pthread_cond_t cond;
  receiver *receivers;
  uint64_t latest;
  uint64_t pushing; /* version under way, 0 when idle */
  uint32_t packed;  /* buckets (by seq) of the push packed so far */
  bool repairing;   /* the push's second, direct pass (chain members whose chain broke) */
  /* the service thread (transport/job.h), owning FR_CHANNEL_REFIT_SENDER: what receivers send
   * comes to it; a link of the context that dies wakes it, and it wakes the push's waits */
  fr_job *service;
  fr_refit_outbox svc_out; /* the service thread's frames (catch-ups), sent after unlocking */
  bool svc_sending;        /* it is sending them: a push begins after (its frames go after) */

  fr_refit_stream stream; /* a version sent in parts (stream.c) */
  /* metrics (metrics.c): pushes run one at a time; the scrape reads them under lock */
  uint64_t pushes, push_failures, push_bytes, last_push_ns;
  fr_hist push_ns;
  uint64_t phase_ns[FR_REFIT_PHASES]; /* relaxed adds by the pushing thread (fr_refit_phase) */
};

/* metrics.c: counts a push that ended with rc, sent `bytes` of buckets, began at t0. */
void fr_refit_count_push(ferry_refit_sender *s, int rc, uint64_t bytes, uint64_t t0);
/* Adds the time since t0 (fr_now_ns) to one phase of the pushes (their time, split: issue 37). */
static inline void fr_refit_phase(ferry_refit_sender *s, int phase, uint64_t t0) {
  fr_count(&s->phase_ns[phase], fr_now_ns() - t0);
}
int fr_refit_stats_start(ferry_refit_sender *s);
void fr_refit_stats_stop(ferry_refit_sender *s);

int fr_refit_out_add(fr_refit_outbox *o, ferry_link *link, const fr_refit_msg_t *m, int timeout_ms,
                     bool catchup);
void fr_refit_out_send(fr_refit_outbox *o);
void fr_refit_out_settle(ferry_refit_sender *s, fr_refit_outbox *o);
void fr_refit_out_clear(fr_refit_outbox *o);
void fr_refit_out_free(fr_refit_outbox *o);
/* The packer thread (pack.c): fr_refit_pack packs and hashes bucket b into dst, sharing the
 * work with the packer thread when `share` (the cores are not busy with local receivers) and no
 * tensor is on a device, and gives the bucket's checksum in *sum; it feeds each of
 * feeds[0..nfeeds) (begun for bucket b) the runs of its shard view as the chunks are packed.
 * Fails only when a device tensor cannot be copied (FERRY_EDEVICE: the tensor named). */
typedef struct fr_refit_packer fr_refit_packer;
int fr_refit_packer_start(ferry_refit_sender *s, fr_refit_packer **out);
void fr_refit_packer_stop(fr_refit_packer *k);
int fr_refit_pack(ferry_refit_sender *s, uint32_t b, uint8_t *dst, bool share, fr_refit_feed *feeds,
                  size_t nfeeds, bool hash, uint64_t *sum);
/* A sum a catch-up waits for, taken by the service thread without s->lock so that a push that
 * begins meanwhile waits for no copy or hash of a bucket (pack.c): the checksum of a bucket of the
 * whole device buffer that no push took (FR_REFIT_DIRECT), or (r given) the sum of shard reader
 * r's view's runs in a bucket of the host buffer. fr_refit_sum_begin (s->lock held, no push or
 * seal under way) takes what to hash and the buffer's epoch and marks s->summing (and
 * summing_host for host memory); fr_refit_sum_run (unlocked) hashes it (device memory through
 * pinned host memory), stopping at its next chunk once the epoch moved (FERRY_ESTALE): a push
 * does not wait for a device bucket's copy (it reads other memory than the push writes, and the
 * sum is void), and waits a chunk at most for a host one (fr_refit_service_await). r and its view
 * stay while it runs: only the service thread, a seal or a push (both waiting for it) free them.
 * fr_refit_sum_end (s->lock held) clears the marks and keeps the sum (sum_known, or r's
 * cu_view_sum) only if the epoch is still the one begun with: the bucket still holds that
 * version's bytes. It returns 0 when kept, FERRY_ESTALE when void (a push or seal came), or the
 * copy's failure. */
typedef struct fr_refit_sum_job {
  uint32_t bucket;
  uint64_t epoch;
  int device;
  const uint8_t *at;
  uint64_t len;
  receiver *r; /* a view's sum, else NULL */
} fr_refit_sum_job;
void fr_refit_sum_begin(ferry_refit_sender *s, uint32_t b, receiver *r, fr_refit_sum_job *j);
int fr_refit_sum_run(ferry_refit_sender *s, const fr_refit_sum_job *j, uint64_t *sum);
int fr_refit_sum_end(ferry_refit_sender *s, const fr_refit_sum_job *j, int rc, uint64_t sum);
/* sender.c: FERRY_ESTATE for a push before the seal: a first seal, or one after declaring again (a
 * rank of a group whose receivers would otherwise see a stale manifest). */
int fr_refit_unsealed(ferry_refit_sender *s);
/* sender.c, s->lock held: waits until the service thread sent the catch-up frames it queued (a
 * push's go after them) and stopped a hash of host memory (the push rewrites it), for timeout_ms
 * at most: it sends each frame with a timeout of its own (a late joiner that does not read holds
 * it that long), and a push's caller waits for no stalled party longer than the push's timeout.
 * FERRY_ETIMEDOUT (version not pushed) when it still sends or hashes then. */
int fr_refit_service_await(ferry_refit_sender *s, uint64_t version, int timeout_ms);
/* The buffer's bytes may change from now on (s->lock held): sums being taken are void. */
static inline void fr_refit_buf_moves(ferry_refit_sender *s) {
  __atomic_add_fetch(&s->buf_epoch, 1, __ATOMIC_RELEASE);
}
/* Calls fr_refit_test_corrupt on bucket b packed at dst (a device buffer's through host memory),
 * if it is set. */
void fr_refit_corrupt_for_test(ferry_refit_sender *s, uint32_t b, uint8_t *dst);
/* Late join (catchup.c), all under s->lock, queueing what it sends in `out` (sent once the lock is
 * released): a receiver asked for the latest version (it lacks `version`; kept during a push and
 * served when it ends); serves every pending request when no push
 * is under way; handles a catch-up ACK or COMMITTED (true when the record belonged to a
 * catch-up); stops a receiver's catch-up; and, as a push begins
 * (the buffer held version `retained` whole, 0: none), stops r's catch-up and says whether r
 * stays out of the push (true: it was catching up, and catches up to the push's version when the
 * push ends). */
void fr_refit_catchup_request(ferry_refit_sender *s, receiver *r, uint64_t version,
                              fr_refit_outbox *out);
void fr_refit_catchup_serve(ferry_refit_sender *s, fr_refit_outbox *out);
bool fr_refit_catchup_record(ferry_refit_sender *s, receiver *r, const fr_refit_msg_t *x,
                             fr_refit_outbox *out);
void fr_refit_catchup_cancel(receiver *r);
bool fr_refit_catchup_overtaken(ferry_refit_sender *s, receiver *r, uint64_t retained);
/* The service thread's lazy checksums (catchup.c, s->lock held): fr_refit_catchup_sum_next
 * begins the hash of a bucket a catch-up waits for (false: none waits, or a push or seal is under
 * way); fr_refit_catchup_sum_done ends it (fr_refit_sum_end) and announces what may go now,
 * or tells the receivers that waited for it that they cannot catch up when the copy failed. */
bool fr_refit_catchup_sum_next(ferry_refit_sender *s, fr_refit_sum_job *j);
void fr_refit_catchup_sum_done(ferry_refit_sender *s, const fr_refit_sum_job *j, int rc,
                               uint64_t sum, fr_refit_outbox *out);
/* Shards (views.c), under s->lock: a VIEW call (its pieces follow the record; 0 or why not); the
 * view rebuilt from the declarations when they changed (never during a push: the push hashes
 * the one it began with); every view dropped when the sender re-seals (receivers declare again
 * for the new generation); a receiver's shard state freed. */
int fr_refit_view_record(ferry_refit_sender *s, receiver *r, const fr_refit_msg_t *x);
void fr_refit_view_refresh(ferry_refit_sender *s, receiver *r);
void fr_refit_views_clear(ferry_refit_sender *s);
void fr_refit_view_release(receiver *r);
/* Versions sent in parts (stream.c). fr_refit_stream_check: whether a push of `version` as
 * `part` may run now (FERRY_EINVAL/ESTATE/ENOTSUP saying why). fr_refit_stream_open: its first
 * part opens the version. fr_refit_stream_select: the buckets a part sends (ready, not sent yet)
 * into order, their count in *n; FERRY_ESTATE naming a tensor not given when `last` and some
 * bucket is not ready. fr_refit_stream_sent: marks them sent. fr_refit_stream_note: a receiver
 * failed a part (s->lock held). fr_refit_stream_close: the version ended (committed, failed or
 * abandoned); the given marks are cleared, also after a whole push (close with nothing open). */
int fr_refit_stream_check(ferry_refit_sender *s, uint64_t version, const ferry_refit_push_opts *o,
                          int part);
int fr_refit_stream_open(ferry_refit_sender *s, uint64_t version);
int fr_refit_stream_select(ferry_refit_sender *s, bool last, uint32_t *order, uint32_t *n);
void fr_refit_stream_sent(ferry_refit_sender *s, const uint32_t *order, uint32_t n);
void fr_refit_stream_note(ferry_refit_sender *s, receiver *r, int status);
void fr_refit_stream_close(ferry_refit_sender *s);
/* sender.c, s->lock held: a tensor of a host sender now lives on a CUDA device (set_data): its
 * buffers are pinned and the scratch for casts allocated, as a seal with it there would. */
int fr_refit_sender_to_device(ferry_refit_sender *s);
/* Releases a receiver record (its link reference and strings). */
void fr_refit_receiver_free(receiver *r);

#endif
