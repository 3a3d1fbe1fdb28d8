/*
 * Received-message buffers: allocated per message (fr_msg_alloc), freed by their taker
 * (ferry_msg_free), and kept per process for reuse in size classes, since fresh memory costs a
 * page fault per 4 KiB. The cache is process-wide (one lock), shared by every context.
 */
#include "transport/ctx_impl.h"

#include <stdlib.h>

/* Received-message buffers are kept for reuse per process, in sizes of four steps per doubling
 * (1, 1.25, 1.5, 1.75, 2 KiB, ... 128 MiB: at most a quarter wasted), one free list per size.
 * glibc gives freed memory back to the kernel (a MiB block at once; smaller ones when a queue
 * that grew drains: per-thread arenas shrink their heaps), and fresh memory costs a page fault
 * per 4 KiB (5-7 ms a MiB on the project's VM): a stream of 16 KiB messages over shm took 35-60
 * us a message with fresh buffers and 2-4 with kept ones, and 16-64 MiB tcp messages were
 * received at 0.2 GB/s. The budget, MSG_KEEP_BYTES, covers a subscriber that fell a whole mq
 * queue (FERRY_MQ_QUEUE_BYTES, 64 MiB by default) behind plus the messages in flight. A full
 * budget makes room by freeing buffers of other sizes (the sizes in use now are the ones worth
 * keeping: after a stream of 1 KiB messages had filled it, a 16 KiB stream faulted every
 * buffer in again), and the buffers of a size not used for FERRY_MSG_KEEP_IDLE_MS go back to the
 * system (fr_msg_keep_trim, from each ctx's reap once a second), so an idle process holds none. */
#define MSG_CLASS_MIN (1u << 10) /* the smallest class; messages over half of it get one */
#define MSG_CLASSES (18 * 4)     /* eighteen doublings, four steps each: up to 128 MiB */
#define MSG_KEEP_BYTES (160ull << 20)
static pthread_mutex_t msg_keep_lock = PTHREAD_MUTEX_INITIALIZER;
static fr_msg_node *msg_class[MSG_CLASSES]; /* newest first */
static size_t msg_class_bytes;

static size_t msg_class_size(int i) {
  size_t base = (size_t)MSG_CLASS_MIN << (i / 4);
  return base + (size_t)(i % 4) * (base / 4);
}

/* The class of len (its index in msg_class), or -1 when len gets none. */
static int msg_class_of(size_t len) {
  if (len <= MSG_CLASS_MIN / 2 || len > msg_class_size(MSG_CLASSES - 1))
    return -1;
  if (len <= MSG_CLASS_MIN)
    return 0;
  int d = 63 - __builtin_clzll((unsigned long long)(len - 1)); /* 2^d < len <= 2^(d+1) */
  size_t base = (size_t)1 << d, quarter = base / 4;
  size_t step = (len - base + quarter - 1) / quarter; /* 1..4: base + step quarters */
  return (d - 10) * 4 + (int)step;
}

/* A kept buffer of class i, taken; NULL when none. */
static fr_msg_node *msg_class_take(int i) {
  pthread_mutex_lock(&msg_keep_lock);
  fr_msg_node *n = msg_class[i];
  if (n) {
    msg_class[i] = n->next;
    msg_class_bytes -= n->cap;
  }
  pthread_mutex_unlock(&msg_keep_lock);
  return n;
}

static void msg_free_all(fr_msg_node *n) {
  for (fr_msg_node *next; n; n = next) {
    next = n->next;
    free(n);
  }
}

/* Keeps n (its cap a class size), making room from the other classes; false: the caller frees
 * it (a buffer larger than the budget). */
static bool msg_class_keep(fr_msg_node *n, int i) {
  fr_msg_node *evicted = NULL;
  pthread_mutex_lock(&msg_keep_lock);
  for (int j = 0; j < MSG_CLASSES && msg_class_bytes + n->cap > MSG_KEEP_BYTES; j++)
    while (j != i && msg_class[j] && msg_class_bytes + n->cap > MSG_KEEP_BYTES) {
      fr_msg_node *e = msg_class[j];
      msg_class[j] = e->next;
      msg_class_bytes -= e->cap;
      e->next = evicted;
      evicted = e;
    }
  bool kept = msg_class_bytes + n->cap <= MSG_KEEP_BYTES;
  if (kept) {
    n->kept_ns = fr_now_ns();
    n->next = msg_class[i];
    msg_class[i] = n;
    msg_class_bytes += n->cap;
  }
  pthread_mutex_unlock(&msg_keep_lock);
  msg_free_all(evicted);
  return kept;
}

/* A size whose newest kept buffer is older than FERRY_MSG_KEEP_IDLE_MS is not in use: all its
 * buffers go (a size in use keeps its own, within the budget; looking at the heads only keeps
 * this a few dozen loads under the lock, once a second). */
void fr_msg_keep_trim(uint64_t now_ns) {
  fr_msg_node *idle[MSG_CLASSES];
  int nidle = 0;
  int64_t ms = fr_config_int("FERRY_MSG_KEEP_IDLE_MS"); /* once a second: cheap enough */
  uint64_t keep_ns = ms > 0 ? (uint64_t)ms * 1000000ull : 0;
  pthread_mutex_lock(&msg_keep_lock);
  for (int i = 0; i < MSG_CLASSES; i++)
    if (msg_class[i] && msg_class[i]->kept_ns + keep_ns <= now_ns) {
      for (fr_msg_node *n = msg_class[i]; n; n = n->next)
        msg_class_bytes -= n->cap;
      idle[nidle++] = msg_class[i];
      msg_class[i] = NULL;
    }
  pthread_mutex_unlock(&msg_keep_lock);
  for (int i = 0; i < nidle; i++)
    msg_free_all(idle[i]);
}

size_t fr_msg_kept_bytes(uint64_t len) {
  int class = msg_class_of((size_t)len);
  size_t bytes = 0;
  pthread_mutex_lock(&msg_keep_lock);
  for (fr_msg_node *n = class >= 0 ? msg_class[class] : NULL; n; n = n->next)
    bytes += n->cap;
  pthread_mutex_unlock(&msg_keep_lock);
  return bytes;
}

ferry_msg *fr_msg_alloc(uint64_t len) {
  if (len > SIZE_MAX - sizeof(fr_msg_node) - 1)
    return NULL;
  int class = msg_class_of((size_t)len);
  size_t cap = class >= 0 ? msg_class_size(class) : (size_t)len;
  fr_msg_node *n = class >= 0 ? msg_class_take(class) : NULL;
  if (!n && (n = malloc(sizeof *n + cap + 1)))
    n->cap = cap;
  if (!n)
    return NULL;
  n->next = NULL;
  n->call_id = 0;
  n->msg = (ferry_msg){.data = n + 1, .len = (size_t)len};
  return &n->msg;
}

void ferry_msg_free(ferry_msg *msg) {
  if (!msg)
    return;
  fr_msg_node *n = fr_msg_node_of(msg);
  if (msg->link)
    fr_link_unref(msg->link);
  int class = msg_class_of(n->cap);
  if (class < 0 || msg_class_size(class) != n->cap || !msg_class_keep(n, class))
    free(n);
}
