/*
 * Packing a bucket: each tensor's part of the window is cast into the wire buffer (alignment
 * gaps zeroed, so the same tensors always hash the same) and the bucket is hashed with XXH3.
 * When the cores are not needed by receivers on this host (alias mode, or receivers elsewhere),
 * two threads share the work: a packer thread copies the bucket chunk by chunk while the
 * pushing thread hashes each chunk right behind it, still in cache; so a bucket costs about one
 * copy, not a copy plus a hash. The checksum is the plain XXH3 of the bucket's bytes either way.
 * The sums of shard readers' runs (shard.h) are taken from each chunk right after it, in cache.
 * A tensor in CUDA memory (classified once, at declare) is never read by the CPU: its bytes are
 * copied device→host into the bucket (pinned) by the copy engine, and a cast then runs on the
 * host, through a scratch buffer; such a plan packs each bucket whole on the pushing thread, one
 * copy per tensor part rather than one per 256 KiB chunk (each waited for, or with
 * FERRY_CUDA_PACK_ASYNC queued and waited for once per bucket), and hashes it afterwards. A bucket
 * of a buffer in device memory is hashed (through pinned host memory) only when a reader of the
 * push needs its checksum; else the checksum is taken when somebody first needs it (a late joiner
 * that verifies), by the service thread without the sender's lock (fr_refit_sum_begin/_run/_end),
 * and kept until the bucket is packed again, unless a push or seal began meanwhile.
 */
#include "core/cuda.h"
#include "core/task.h"
#include "refit/sender_impl.h"

#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

struct fr_refit_packer {
  ferry_refit_sender *s;
  pthread_t thread;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  bool stop;
  uint64_t jobs; /* posted so far; the thread takes each in turn */
  uint32_t bucket;
  uint8_t *dst;
  uint64_t len;
  _Atomic uint64_t packed; /* bytes of the current job copied so far */
};

/* Copies `count` elements of a device tensor's part at src into dst in the wire dtype: straight
 * into the bucket when there is no cast (queued on this thread's stream when `queued` is given,
 * the device's bit set in it), else through the scratch, cast on the host. */
static int pack_device(ferry_refit_sender *s, const fr_refit_entry *x, int device,
                       const uint8_t *src, uint8_t *dst, uint64_t count, uint64_t *queued) {
  size_t se = ferry_dtype_size(x->desc.dtype), we = ferry_dtype_size(x->wire);
  int rc = 0;
  if (x->desc.dtype == x->wire && queued && device < 64) {
    rc = fr_cuda_copy_async(device, dst, src, count * se);
    *queued |= 1ull << device;
  } else if (x->desc.dtype == x->wire) {
    rc = fr_cuda_copy_on(device, dst, src, count * se);
  }
  for (uint64_t i = 0, per = FR_REFIT_SCRATCH / se; x->desc.dtype != x->wire && i < count && !rc;
       i += per) {
    uint64_t k = count - i < per ? count - i : per;
    if ((rc = fr_cuda_copy_on(device, s->scratch, src + i * se, k * se)) == 0)
      fr_refit_cast(x->desc.dtype, x->wire, x->scale, s->scratch, dst + i * we, k);
  }
  return rc ? fr_err_wrap(rc, "refit '%s': tensor '%s' on CUDA device %d", s->name, x->name, device)
            : 0;
}

/* Packs [lo, lo+len) of bucket b (casting on the way) into dst, zeroing the gaps (but in a
 * device buffer, zeroed when it was made: a layout's gaps are never written); device copies
 * queued as pack_device says when `queued` is given. */
static int pack_window(ferry_refit_sender *s, uint32_t b, uint64_t lo, uint64_t len, uint8_t *dst,
                       uint64_t *queued) {
  bool zero_gaps = s->dev_buf < 0;
  const fr_refit_plan *p = &s->plan;
  uint64_t start = (uint64_t)b * p->bucket_bytes + lo, filled = 0;
  for (uint32_t e = fr_refit_first_entry(p, b); e < p->count; e++) {
    uint64_t wire_off, dst_off, n = fr_refit_overlap_window(p, e, start, len, &wire_off, &dst_off);
    if (n == 0) {
      if (p->entries[e].offset >= start + len)
        break;
      continue;
    }
    const fr_refit_entry *x = &p->entries[e];
    size_t we = ferry_dtype_size(x->wire), se = ferry_dtype_size(x->desc.dtype);
    const uint8_t *src = (const uint8_t *)s->src[e].data + wire_off / we * se;
    if (dst_off > filled && zero_gaps)
      memset(dst + filled, 0, dst_off - filled);
    if (s->src[e].device >= 0) {
      int rc = pack_device(s, x, s->src[e].device, src, dst + dst_off, n / we, queued);
      if (rc != 0)
        return rc;
    } else {
      fr_refit_cast(x->desc.dtype, x->wire, x->scale, src, dst + dst_off, n / we);
    }
    filled = dst_off + n;
  }
  if (filled < len && zero_gaps)
    memset(dst + filled, 0, len - filled);
  return 0;
}

/* All of bucket b, some of its tensors on a device, into dst on this thread: one synchronous copy
 * per device tensor part, or (FERRY_CUDA_PACK_ASYNC as of the seal) the uncast parts' copies
 * queued on this thread's stream of each device and waited for once, after the last (a cast part
 * waits for its own copy, through the scratch, and so for those queued before it on its device). */
static int pack_bucket(ferry_refit_sender *s, uint32_t b, uint64_t len, uint8_t *dst) {
  uint64_t queued = 0;
  int rc = pack_window(s, b, 0, len, dst, s->pack_async ? &queued : NULL);
  for (int d = 0; d < 64 && (queued >> d) != 0; d++) { /* also after a failure: none in flight */
    int synced = (queued >> d) & 1 ? fr_cuda_sync(d) : 0;
    if (synced != 0 && rc == 0)
      rc = fr_err_wrap(synced, "refit '%s': bucket %u's copies on CUDA device %d", s->name, b, d);
  }
  return rc;
}

static void *packer_main(void *arg) {
  fr_refit_packer *k = arg;
  uint64_t taken = 0;
  pthread_mutex_lock(&k->lock);
  for (;;) {
    while (!k->stop && k->jobs == taken)
      pthread_cond_wait(&k->cond, &k->lock);
    if (k->stop)
      break;
    taken = k->jobs;
    uint32_t b = k->bucket;
    uint8_t *dst = k->dst;
    uint64_t len = k->len;
    pthread_mutex_unlock(&k->lock);
    for (uint64_t lo = 0; lo < len; lo += FR_REFIT_CHUNK) {
      uint64_t n = len - lo < FR_REFIT_CHUNK ? len - lo : FR_REFIT_CHUNK;
      (void)pack_window(k->s, b, lo, n, dst + lo, NULL); /* host tensors only: cannot fail */
      atomic_store_explicit(&k->packed, lo + n, memory_order_release);
    }
    pthread_mutex_lock(&k->lock);
  }
  pthread_mutex_unlock(&k->lock);
  return NULL;
}

int fr_refit_packer_start(ferry_refit_sender *s, fr_refit_packer **out) {
  fr_refit_packer *k = calloc(1, sizeof *k);
  if (!k)
    return fr_err(FERRY_ENOMEM, "refit: packer");
  k->s = s;
  pthread_mutex_init(&k->lock, NULL);
  pthread_cond_init(&k->cond, NULL);
  int rc = fr_thread_start(&k->thread, "ferry-pack", packer_main, k, false);
  if (rc != 0) {
    pthread_mutex_destroy(&k->lock);
    pthread_cond_destroy(&k->cond);
    free(k);
    return fr_err_wrap(rc, "refit: the packer thread");
  }
  *out = k;
  return 0;
}

void fr_refit_packer_stop(fr_refit_packer *k) {
  if (!k)
    return;
  pthread_mutex_lock(&k->lock);
  k->stop = true;
  pthread_cond_signal(&k->cond);
  pthread_mutex_unlock(&k->lock);
  pthread_join(k->thread, NULL);
  pthread_mutex_destroy(&k->lock);
  pthread_cond_destroy(&k->cond);
  free(k);
}

/* Waits until the packer has copied `upto` bytes of the current job. */
static void wait_packed(fr_refit_packer *k, uint64_t upto) {
  for (unsigned spins = 0; atomic_load_explicit(&k->packed, memory_order_acquire) < upto; spins++)
    if (spins > 64)
      sched_yield();
}

/* Hashing a bucket of a device buffer: each chunk as it reaches host memory. A catch-up's sum
 * (lazy) stops at the next chunk once the buffer's epoch moved from `epoch`: a push or a seal
 * rewrites the bucket, and the sum would be void. */
typedef struct device_hash {
  ferry_refit_sender *s;
  uint32_t b;
  uint64_t at;
  fr_hash *h;
  fr_refit_feed *feeds;
  size_t nfeeds;
  bool lazy;
  uint64_t epoch;
} device_hash;

/* A catch-up's sum goes on with its next chunk: FERRY_ESTALE once the buffer's epoch moved from
 * the one it began with. */
static int lazy_step(ferry_refit_sender *s, uint32_t b, uint64_t epoch) {
  void (*hold)(int) = __atomic_load_n(&fr_refit_test_hold, __ATOMIC_ACQUIRE);
  if (hold)
    hold(FR_REFIT_HOLD_SUM);
  if (__atomic_load_n(&s->buf_epoch, __ATOMIC_ACQUIRE) == epoch)
    return 0;
  return fr_err(FERRY_ESTALE, "refit '%s': bucket %u rewritten while it was hashed", s->name, b);
}

static int hash_chunk(void *arg, const void *buf, size_t len) {
  device_hash *d = arg;
  int rc = d->lazy ? lazy_step(d->s, d->b, d->epoch) : 0;
  if (rc != 0)
    return rc;
  fr_hash_update(d->h, buf, len);
  for (size_t i = 0; i < d->nfeeds; i++)
    fr_refit_view_feed(&d->s->plan, &d->feeds[i], d->b, d->at, len, buf);
  d->at += len;
  return 0;
}

uint64_t fr_refit_stat_staged_sums;

/* [at, at+len) of the device buffer (d->b's bytes), hashed as the copy engine brings it to host
 * memory through *stager a chunk at a time (the next chunk's copy under this one's hash), feeding
 * shard readers' runs. */
static int hash_device_bucket(fr_cuda_stager **stager, device_hash *d, int device,
                              const uint8_t *at, uint64_t len, uint64_t *sum) {
  int rc = *stager ? 0 : fr_cuda_stager_open(fr_cuda_chunk_bytes(), stager);
  if (rc != 0)
    return rc;
  d->h = fr_hash_begin();
  rc = fr_cuda_stage_out(*stager, device, at, len, hash_chunk, d);
  *sum = fr_hash_end(d->h);
  __atomic_add_fetch(&fr_refit_stat_staged_sums, rc == 0, __ATOMIC_RELAXED);
  if (rc == 0 || rc == FERRY_ESTALE)
    return rc;
  return fr_err_wrap(rc, "refit '%s': bucket %u in CUDA memory", d->s->name, d->b);
}

/* A bucket of the device buffer: packed device to device, then hashed unless nobody reading this
 * push needs its checksum (a FR_REFIT_DIRECT push: its readers copy through CUDA IPC or view). */
static int pack_device_bucket(ferry_refit_sender *s, uint32_t b, uint8_t *dst, uint64_t len,
                              fr_refit_feed *feeds, size_t nfeeds, bool hash, uint64_t *sum) {
  int rc = pack_bucket(s, b, len, dst);
  *sum = 0;
  if (rc != 0 || !hash)
    return rc;
  device_hash d = {.s = s, .b = b, .feeds = feeds, .nfeeds = nfeeds};
  return hash_device_bucket(&s->stager, &d, s->dev_buf, dst, len, sum);
}

void fr_refit_sum_begin(ferry_refit_sender *s, uint32_t b, receiver *r, fr_refit_sum_job *j) {
  *j = (fr_refit_sum_job){.bucket = b,
                          .epoch = s->buf_epoch,
                          .device = s->dev_buf,
                          .at = (const uint8_t *)s->buf[0] + (uint64_t)b * s->plan.bucket_bytes,
                          .len = fr_refit_bucket_len(&s->plan, b),
                          .r = r};
  s->summing = true;
  s->summing_host = s->dev_buf < 0;
}

/* The sum of r's view's runs in bucket j->bucket of the host buffer (fr_refit_view_sum's), a
 * chunk at a time: a push that begins waits for one chunk at most. */
static int hash_view_runs(ferry_refit_sender *s, const fr_refit_sum_job *j, uint64_t *sum) {
  const fr_refit_view *v = j->r->view;
  uint64_t start = (uint64_t)j->bucket * s->plan.bucket_bytes;
  fr_hash *h = fr_hash_begin();
  int rc = 0;
  for (uint64_t i = v->first[j->bucket]; i < v->first[j->bucket + 1] && rc == 0; i++)
    for (uint64_t at = 0; at < v->runs[i].len && rc == 0; at += FR_REFIT_CHUNK) {
      uint64_t n = v->runs[i].len - at < FR_REFIT_CHUNK ? v->runs[i].len - at : FR_REFIT_CHUNK;
      if ((rc = lazy_step(s, j->bucket, j->epoch)) == 0)
        fr_hash_update(h, j->at + (v->runs[i].off - start) + at, n);
    }
  *sum = fr_hash_end(h);
  return rc;
}

int fr_refit_sum_run(ferry_refit_sender *s, const fr_refit_sum_job *j, uint64_t *sum) {
  if (j->r)
    return hash_view_runs(s, j, sum);
  device_hash d = {.s = s, .b = j->bucket, .lazy = true, .epoch = j->epoch};
  return hash_device_bucket(&s->sum_stager, &d, j->device, j->at, j->len, sum);
}

int fr_refit_sum_end(ferry_refit_sender *s, const fr_refit_sum_job *j, int rc, uint64_t sum) {
  s->summing = s->summing_host = false;
  pthread_cond_broadcast(&s->cond); /* a seal or a push may wait for it */
  if (s->buf_epoch != j->epoch || s->pushing)
    return fr_err(FERRY_ESTALE, "refit '%s': bucket %u rewritten while it was hashed", s->name,
                  j->bucket);
  if (rc != 0)
    return rc;
  if (j->r) { /* for its announcement of this bucket, next */
    j->r->cu_view_sum = sum;
    j->r->cu_view_for = j->bucket + 1;
    return 0;
  }
  s->last_sum[j->bucket] = sum;
  s->sum_known[j->bucket] = 1;
  fr_refit_corrupt_for_test(s, j->bucket, (uint8_t *)j->at); /* the bytes change after the sum */
  return 0;
}

void fr_refit_corrupt_for_test(ferry_refit_sender *s, uint32_t b, uint8_t *dst) {
  void (*corrupt)(uint32_t, uint8_t *, uint64_t) =
      __atomic_load_n(&fr_refit_test_corrupt, __ATOMIC_ACQUIRE);
  if (!corrupt)
    return;
  uint64_t len = fr_refit_bucket_len(&s->plan, b);
  uint8_t *host = s->dev_buf < 0 ? dst : malloc(len);
  if (host && (s->dev_buf < 0 || fr_cuda_copy_on(s->dev_buf, host, dst, len) == 0)) {
    corrupt(b, host, len);
    if (s->dev_buf >= 0)
      (void)fr_cuda_copy_on(s->dev_buf, dst, host, len);
  }
  if (host != dst)
    free(host);
}

int fr_refit_pack(ferry_refit_sender *s, uint32_t b, uint8_t *dst, bool share, fr_refit_feed *feeds,
                  size_t nfeeds, bool hash, uint64_t *sum) {
  uint64_t len = fr_refit_bucket_len(&s->plan, b);
  if (s->dev_buf >= 0)
    return pack_device_bucket(s, b, dst, len, feeds, nfeeds, hash, sum);
  fr_refit_packer *k = share && !s->on_device ? s->packer : NULL;
  if (k) {
    atomic_store_explicit(&k->packed, 0, memory_order_relaxed);
    pthread_mutex_lock(&k->lock);
    k->bucket = b;
    k->dst = dst;
    k->len = len;
    k->jobs++;
    pthread_cond_signal(&k->cond);
    pthread_mutex_unlock(&k->lock);
  }
  int rc = s->on_device ? pack_bucket(s, b, len, dst) : 0;
  if (rc != 0)
    return rc;
  fr_hash *h = fr_hash_begin();
  for (uint64_t lo = 0; lo < len; lo += FR_REFIT_CHUNK) {
    uint64_t n = len - lo < FR_REFIT_CHUNK ? len - lo : FR_REFIT_CHUNK;
    if (k)
      wait_packed(k, lo + n);
    else if (!s->on_device)
      (void)pack_window(s, b, lo, n, dst + lo, NULL); /* host tensors only: cannot fail */
    fr_hash_update(h, dst + lo, n);
    for (size_t i = 0; i < nfeeds; i++) /* shard readers' runs, while the chunk is in cache */
      fr_refit_view_feed(&s->plan, &feeds[i], b, lo, n, dst + lo);
  }
  *sum = fr_hash_end(h);
  return 0;
}
