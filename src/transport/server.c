/*
 * The server thread of a context: it sends large read responses (fr_ctx_serve_later) so that the
 * thread driving the links never blocks on a slow reader.
 */
#include "transport/ctx_impl.h"

#include <stdlib.h>

struct fr_serve_job {
  ferry_link *link;
  uint64_t req_id;
  fr_region *region;
  uint64_t off, len;
  fr_serve_job *next;
};

void fr_ctx_serve_later(ferry_ctx *ctx, ferry_link *l, uint64_t req_id, fr_region *r, uint64_t off,
                        uint64_t len) {
  fr_serve_job *j = malloc(sizeof *j);
  if (!j) {
    fr_region_release(r);
    fr_link_fail(l, FERRY_ENOMEM, "cannot queue a read response");
    fr_link_unref(l);
    return;
  }
  *j = (fr_serve_job){l, req_id, r, off, len, NULL};
  pthread_mutex_lock(&ctx->serve_lock);
  if (ctx->serve_tail)
    ctx->serve_tail->next = j;
  else
    ctx->serve_head = j;
  ctx->serve_tail = j;
  pthread_cond_signal(&ctx->serve_cond);
  pthread_mutex_unlock(&ctx->serve_lock);
}

void *fr_ctx_server_main(void *arg) {
  pthread_setname_np(pthread_self(), "ferry-server"); /* for top -H, perf, gdb */
  ferry_ctx *ctx = arg;
  for (;;) {
    pthread_mutex_lock(&ctx->serve_lock);
    while (!ctx->serve_head && !fr_ctx_stopping(ctx))
      pthread_cond_wait(&ctx->serve_cond, &ctx->serve_lock);
    fr_serve_job *j = ctx->serve_head;
    if (j && !(ctx->serve_head = j->next))
      ctx->serve_tail = NULL;
    pthread_mutex_unlock(&ctx->serve_lock);
    if (!j)
      return NULL;
    if (!fr_ctx_stopping(ctx)) {
      fr_frame f = {.type = FR_READ_RESP, .req_id = j->req_id, .len = j->len};
      struct iovec iov = {j->region->data + j->off, j->len};
      fr_link_send_frame(j->link, &f, &iov, 1, -1, fr_deadline_ns(ctx->timeout_ms));
    }
    fr_region_release(j->region);
    fr_link_unref(j->link);
    free(j);
  }
}
