/*
 * One refit sender and one refit receiver per ferry_ctx: each role reads the ctx's refit channel
 * (FR_CHANNEL_REFIT) on its service thread, so two of a role on one ctx would steal each other's
 * messages. A table per role records which ctxs are taken.
 */
#include "refit/refit.h"

#include <pthread.h>

#define FR_REFIT_CTXS 64

static struct {
  pthread_mutex_t lock;
  ferry_ctx *taken[FR_REFIT_CTXS];
} roles[2] = {{.lock = PTHREAD_MUTEX_INITIALIZER}, {.lock = PTHREAD_MUTEX_INITIALIZER}};

static const char *const role_names[2] = {"sender", "receiver"};

int fr_refit_claim(ferry_ctx *ctx, fr_refit_role role) {
  pthread_mutex_lock(&roles[role].lock);
  int free_slot = -1, rc = 0;
  for (int i = 0; i < FR_REFIT_CTXS && rc == 0; i++) {
    if (roles[role].taken[i] == ctx)
      rc = fr_err(FERRY_EBUSY, "this context already has a refit %s", role_names[role]);
    else if (!roles[role].taken[i] && free_slot < 0)
      free_slot = i;
  }
  if (rc == 0 && free_slot < 0)
    rc = fr_err(FERRY_EBUSY, "too many refit %ss in this process", role_names[role]);
  else if (rc == 0)
    roles[role].taken[free_slot] = ctx;
  pthread_mutex_unlock(&roles[role].lock);
  return rc;
}

void fr_refit_unclaim(ferry_ctx *ctx, fr_refit_role role) {
  pthread_mutex_lock(&roles[role].lock);
  for (int i = 0; i < FR_REFIT_CTXS; i++)
    if (roles[role].taken[i] == ctx)
      roles[role].taken[i] = NULL;
  pthread_mutex_unlock(&roles[role].lock);
}
