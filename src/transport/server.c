/*
 * The server thread of a context: it sends large read responses (fr_ctx_serve_later) so that the
 * thread driving the links never blocks on a slow reader (and every read of a CUDA region, whose
 * bytes it stages through host memory, as those of registered host memory), and answers calls for
 * the ctx's metrics (FR_CHANNEL_STATS), which a collector's locks must not make that thread wait
 * for. Calls for the metrics have a queue of their own, served first: a fleet view asks every node
 * within one budget, and its call must not wait behind bulk responses queued for a reader (at most
 * the one being sent).
 */
#include "transport/ctx_impl.h"

#include <stdlib.h>

struct fr_serve_job {
  ferry_link *link;
  uint64_t req_id;
  fr_region *region;
  uint64_t off, len;
  ferry_msg *stats; /* a call on FR_CHANNEL_STATS to answer (then region is NULL) */
  fr_serve_job *next;
  fr_rma_run *runs; /* a READV's runs (owned), sent one after another; NULL: [off, off+len) */
  uint32_t nruns;
};

static void serve_job(ferry_ctx *ctx, fr_serve_job *j);

void fr_ctx_serve_later(ferry_ctx *ctx, ferry_link *l, uint64_t req_id, fr_region *r, uint64_t off,
                        uint64_t len) {
  fr_serve_job *j = malloc(sizeof *j);
  if (!j) {
    fr_region_release(r);
    fr_link_fail(l, FERRY_ENOMEM, "cannot queue a read response");
    fr_link_unref(l);
    return;
  }
  *j = (fr_serve_job){.link = l, .req_id = req_id, .region = r, .off = off, .len = len};
  serve_job(ctx, j);
}

void fr_ctx_serve_later_v(ferry_ctx *ctx, ferry_link *l, uint64_t req_id, fr_region *r,
                          fr_rma_run *runs, uint32_t nruns, uint64_t total) {
  fr_serve_job *j = malloc(sizeof *j);
  if (!j) {
    free(runs);
    fr_region_release(r);
    fr_link_fail(l, FERRY_ENOMEM, "cannot queue a read response");
    fr_link_unref(l);
    return;
  }
  *j = (fr_serve_job){
      .link = l, .req_id = req_id, .region = r, .len = total, .runs = runs, .nruns = nruns};
  serve_job(ctx, j);
}

static void serve_job(ferry_ctx *ctx, fr_serve_job *j) {
  fr_serve_job **head = j->stats ? &ctx->stats_head : &ctx->serve_head;
  fr_serve_job **tail = j->stats ? &ctx->stats_tail : &ctx->serve_tail;
  pthread_mutex_lock(&ctx->serve_lock);
  if (*tail)
    (*tail)->next = j;
  else
    *head = j;
  *tail = j;
  pthread_cond_signal(&ctx->serve_cond);
  pthread_mutex_unlock(&ctx->serve_lock);
}

/* The next job (serve_lock held): a call for the metrics first; NULL when none waits. */
static fr_serve_job *next_job(ferry_ctx *ctx) {
  fr_serve_job **head = ctx->stats_head ? &ctx->stats_head : &ctx->serve_head;
  fr_serve_job **tail = ctx->stats_head ? &ctx->stats_tail : &ctx->serve_tail;
  fr_serve_job *j = *head;
  if (j && !(*head = j->next))
    *tail = NULL;
  return j;
}

void fr_ctx_serve_pending(ferry_ctx *ctx, size_t *reads, size_t *stats) {
  *reads = *stats = 0;
  pthread_mutex_lock(&ctx->serve_lock);
  for (fr_serve_job *j = ctx->serve_head; j; j = j->next)
    ++*reads;
  for (fr_serve_job *j = ctx->stats_head; j; j = j->next)
    ++*stats;
  pthread_mutex_unlock(&ctx->serve_lock);
}

/* A call on FR_CHANNEL_STATS, the ctx's own service (fr_ctx_deliver): answered here, where a
 * collector's locks cannot make the thread driving the links wait. Takes msg. */
void fr_ctx_serve_stats(ferry_ctx *ctx, ferry_msg *msg) {
  fr_serve_job *j = malloc(sizeof *j);
  if (!j || !fr_msg_node_of(msg)->call_id) {
    free(j);
    ferry_msg_free(msg);
    return;
  }
  *j = (fr_serve_job){.link = msg->link, .stats = msg};
  serve_job(ctx, j);
}

/* A peer asked for this ctx's metrics: the Prometheus text, or an empty reply when it cannot be
 * made (the asker then says the node's metrics are unknown). */
static void answer_stats(ferry_ctx *ctx, ferry_msg *req) {
  char *text = NULL;
  size_t len = 0;
  if (!fr_ctx_stopping(ctx)) {
    if (ferry_stats_prometheus(ctx, &text, &len) != 0)
      len = 0;
    struct iovec iov = {text, len};
    fr_link_reply(req, &iov, 1, -1, false);
  }
  ferry_stats_text_free(text);
  ferry_msg_free(req);
}

/* How much of registered host memory one step copies out before sending it (server_stage). */
#define FR_SERVE_HOST_CHUNK (256u * 1024u)

/* The thread's staging: CUDA memory through its stager, registered host memory through a buffer
 * of FR_SERVE_HOST_CHUNK (each made at the first read that needs it). */
typedef struct server_stage {
  fr_cuda_stager *stager;
  uint8_t *buf;
} server_stage;

static int stage_ready(server_stage *st, const fr_region *r) {
  if (r->kind == FERRY_MEM_CUDA)
    return st->stager ? 0 : fr_cuda_stager_open(fr_cuda_chunk_bytes(), &st->stager);
  if (!st->buf && !(st->buf = malloc(FR_SERVE_HOST_CHUNK)))
    return fr_err(FERRY_ENOMEM, "read response staging buffer");
  return 0;
}

/* The bytes a read asked for. A shared region's live as long as the job's reference: one send
 * straight from them. Registered memory's caller may free them once ferry_deregister returned
 * (core/region.h), and a send waits for the peer: they go staged, each chunk copied out while in
 * use and sent after (fr_link_send_frame_staged), CUDA memory through the stager. */
static void send_read_response(ferry_ctx *ctx, fr_serve_job *j, server_stage *st) {
  fr_frame f = {.type = FR_READ_RESP, .req_id = j->req_id, .len = j->len};
  struct iovec iov[FR_READV_MAX_RUNS] = {{j->region->data + j->off, j->len}};
  for (uint32_t i = 0; i < j->nruns; i++)
    iov[i] = (struct iovec){j->region->data + j->runs[i].offset, j->runs[i].length};
  int n = j->runs ? (int)j->nruns : 1;
  uint64_t deadline = fr_deadline_ns(ctx->timeout_ms);
  if (!fr_region_is_registered(j->region)) {
    FR_ONE_SIDED_READ_BEGIN(); /* the owner may be rewriting them (core.h) */
    fr_link_send_frame(j->link, &f, iov, n, -1, deadline);
    FR_ONE_SIDED_READ_END();
    return;
  }
  if (fr_region_test_serving)
    fr_region_test_serving(j->region);
  int rc = stage_ready(st, j->region);
  if (rc == 0 && fr_region_use_begin(j->region)) /* deregistered already: the reader is told */
    fr_region_use_end(j->region);
  else if (rc == 0)
    rc = FERRY_ENOTFOUND;
  fr_link_stage stage = {j->region, st->stager, st->buf, FR_SERVE_HOST_CHUNK};
  if (rc == 0)
    rc = fr_link_send_frame_staged(j->link, &f, iov, n, &stage, deadline);
  else { /* nothing sent yet: the reader gets the error */
    f = (fr_frame){.type = FR_READ_RESP, .req_id = j->req_id, .status = rc};
    fr_link_send_frame(j->link, &f, NULL, 0, -1, deadline);
  }
}

void *fr_ctx_server_main(void *arg) {
  ferry_ctx *ctx = arg;
  server_stage stage = {0};
  for (;;) {
    pthread_mutex_lock(&ctx->serve_lock);
    while (!ctx->serve_head && !ctx->stats_head && !fr_ctx_stopping(ctx))
      pthread_cond_wait(&ctx->serve_cond, &ctx->serve_lock);
    fr_serve_job *j = next_job(ctx);
    pthread_mutex_unlock(&ctx->serve_lock);
    if (!j) {
      fr_cuda_stager_close(stage.stager);
      free(stage.buf);
      return NULL;
    }
    if (j->stats) {
      answer_stats(ctx, j->stats);
      free(j);
      continue;
    }
    if (!fr_ctx_stopping(ctx))
      send_read_response(ctx, j, &stage);
    free(j->runs);
    fr_region_release(j->region);
    fr_link_unref(j->link);
    free(j);
  }
}
