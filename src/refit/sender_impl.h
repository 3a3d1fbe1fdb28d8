/*
 * The refit sender's state, shared by sender.c (open, declare, seal, the service thread) and
 * push.c.
 */
#ifndef FR_REFIT_SENDER_IMPL_H
#define FR_REFIT_SENDER_IMPL_H

#include "refit/refit.h"

#include <pthread.h>

typedef struct receiver {
  ferry_link *link;
  char peer[64];
  uint64_t committed; /* last version it committed */
  bool in_push;       /* takes part in the push under way */
  uint32_t acked;     /* buckets of the current push it acknowledged */
  bool commit_seen;
  int status; /* first failure in the current push */
  struct receiver *next;
} receiver;

typedef struct declared {
  const void *data;
} declared;

struct ferry_refit_sender {
  ferry_ctx *ctx;
  char *name;
  fr_refit_plan plan; /* entries double as the declarations until sealed */
  declared *src;
  uint32_t cap;
  bool sealed;
  uint64_t budget;
  void *buf[2];
  ferry_region_ref ref[2];
  uint64_t buf_bytes;
  uint64_t *last_sum; /* per bucket, of the last push */
  uint8_t *manifest;
  size_t manifest_len;

  pthread_mutex_t lock;
  pthread_cond_t cond;
  receiver *receivers;
  uint64_t latest;
  uint64_t pushing; /* version under way, 0 when idle */
  bool stop;
  pthread_t service;
};

#endif
