/*
 * What the parts of publishing share, inside src/mq only: publish.c (the publish itself, its
 * frames and sends), credit.c, batch.c, fast.c (the lock-free fast path), pool.c (the pool,
 * its block table and warm working set), clock.c (the publish clock) and loan.c. mq.h holds
 * the mq's own structs.
 */
#ifndef FR_MQ_PUBLISH_H
#define FR_MQ_PUBLISH_H

#include "mq/mq.h"
#include "transport/ctxcalls.h"

typedef struct fr_mq_target {
  fr_mq_peer *p;
  uint64_t charge;
  bool shm;
  bool ref;  /* this publish holds a reference (else the peer's pending batch does) */
  bool held; /* the peer holds the pool block already: recorded before the send, since its
              * release may come back (on_msg, on any thread) before the send returns */
  int rc;
} fr_mq_target;

typedef struct fr_mq_pub_wait {
  fr_mq_topic *t;
  uint64_t len;
} fr_mq_pub_wait;

#define FR_MQ_LOCAL_TARGETS 8 /* subscribers a publish lists without an allocation */

typedef struct fr_mq_frames {
  uint8_t data[FR_MQ_HEAD_MAX], shm[FR_MQ_HEAD_MAX];
  size_t data_len, shm_len;
  uint64_t token;
} fr_mq_frames;

typedef struct fr_mq_pub { /* one publish, between its two halves */
  fr_mq_target local[FR_MQ_LOCAL_TARGETS], *v;
  size_t n;
  fr_mq_frames fr;
  uint64_t off, seq, deadline;
  bool fresh, waited; /* waited: the time read at the start is stale */
  fr_mq_topic *t;     /* for the metrics */
} fr_mq_pub;

/* pool.c: blocks of the pool (lock held unless said) */
int fr_mq_pool_open(ferry_mq *mq);
/* A block of len bytes with `refs` holders: its token (slot + 1 and a generation), or 0. Below
 * the high-water mark only, unless `grow`. */
uint64_t fr_mq_block_alloc(ferry_mq *mq, uint64_t len, int refs, bool grow, uint64_t *off);
int fr_mq_peer_hold(fr_mq_peer *p, uint64_t token);
/* The pool block the payload goes out in to nshm subscribers: the loan, or a new block; 0: inline.
 */
uint64_t fr_mq_take_block(ferry_mq *mq, uint64_t len, int nshm, uint64_t loan, uint64_t deadline,
                          uint64_t *off, bool *fresh);
/* Copies a payload into its block (publish_lock held). */
void fr_mq_pool_copy(ferry_mq *mq, uint64_t off, const void *data, size_t len, bool fresh);

/* batch.c (publish_lock held) */
void fr_mq_flush_peer(ferry_mq *mq, fr_mq_peer *p);
bool fr_mq_batch_add(ferry_mq *mq, fr_mq_peer *p, const uint8_t *head, size_t hl, const void *data,
                     size_t len, uint64_t now);
uint64_t fr_mq_oldest_batch(const ferry_mq *mq, uint64_t now);
bool fr_mq_batch_due_moved(ferry_mq *mq, uint64_t now);

/* credit.c (lock held) */
uint64_t fr_mq_charge_for(const fr_mq_peer *p, uint64_t len);
bool fr_mq_peer_alive(const fr_mq_peer *p);
bool fr_mq_credit_ready(ferry_mq *mq, void *arg); /* arg: an fr_mq_pub_wait */
int fr_mq_reserve(ferry_mq *mq, fr_mq_topic *t, uint64_t len, uint64_t deadline, int ms, bool ready,
                  fr_mq_target *local, fr_mq_target **out, size_t *n, bool *waited);

/* clock.c: the publish's time (publish_lock held) */
uint64_t fr_mq_publish_now(ferry_mq *mq);

/* fast.c (publish_lock held) */
void fr_mq_fast_remember(ferry_mq *mq, fr_mq_topic *t, const fr_mq_pub *u, uint64_t loan);
bool fr_mq_fast_reserve(ferry_mq *mq, const char *topic, uint64_t len, fr_mq_pub *u);

/* publish.c */
void fr_mq_drain(ferry_mq *mq); /* lock held */
/* Publishes data (in the pool block `loan` when not 0: then it is not copied). */
int fr_mq_publish_msg(ferry_mq *mq, const char *topic, const ferry_tensor_desc *desc,
                      const void *data, size_t len, int timeout_ms, uint64_t loan);

/* loan.c: publishes len (> 0) bytes of CUDA memory on `device`: copied device to host once,
 * into a pool block when the payload goes there (as a loan: shm subscribers read it in place),
 * else into a host buffer of the call's; then as fr_mq_publish_msg. */
int fr_mq_publish_device(ferry_mq *mq, const char *topic, const ferry_tensor_desc *desc,
                         const void *data, size_t len, int device, int timeout_ms);

#endif
