/*
 * The context: one per node. Opening it starts its listeners, its epoll and two threads: the
 * progress thread (leader.c), which drives every link's receive state machine unless a waiting
 * caller does, and the server thread (server.c), which sends large read responses. Closing it
 * stops them and fails its links. Its other parts: the channel queues (chanq.c), the message
 * buffers (msgcache.c), spinning waiters (spin.c) and accepting links (accept.c); ctx_impl.h
 * is what they share.
 */
#include "transport/ctx_impl.h"
#include "core/task.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

static int parse_transports(ferry_ctx *ctx, const char *list) {
  char buf[128];
  fr_str_copy(buf, sizeof buf, list);
  char *save = NULL;
  for (char *t = strtok_r(buf, ", ", &save); t; t = strtok_r(NULL, ", ", &save)) {
    const fr_transport_ops *ops = fr_transport_find(t);
    if (!ops)
      return fr_err(FERRY_EINVAL, "FERRY_TRANSPORTS: unknown transport '%s'", t);
    if (ctx->norder < FR_MAX_LISTENERS)
      ctx->order[ctx->norder++] = ops;
  }
  if (ctx->norder == 0)
    return fr_err(FERRY_EINVAL, "FERRY_TRANSPORTS: no transport in '%s'", list);
  ctx->users_may_lead = true;
  for (size_t i = 0; i < ctx->norder; i++)
    ctx->users_may_lead &= ctx->order[i]->any_thread_events;
  return 0;
}

static int add_poller(ferry_ctx *ctx, fr_poller *p) {
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = p};
  if (epoll_ctl(ctx->epfd, EPOLL_CTL_ADD, p->fd, &ev) < 0)
    return fr_err_errno(FERRY_ESYS, "epoll_ctl");
  return 0;
}

/* The progress thread's epoll (leader.c): the ctx's epoll, lent (EPOLLIN) until a thread leads
 * it (data 0), and the eventfd that stops the thread (data 1). */
static int progress_epoll(ferry_ctx *ctx) {
  if ((ctx->outer_epfd = epoll_create1(EPOLL_CLOEXEC)) < 0)
    return fr_err_errno(FERRY_ESYS, "epoll_create1");
  if ((ctx->outer_wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
    return fr_err_errno(FERRY_ESYS, "eventfd");
  struct epoll_event inner = {.events = EPOLLIN, .data.u64 = 0};
  struct epoll_event stop = {.events = EPOLLIN, .data.u64 = 1};
  if (epoll_ctl(ctx->outer_epfd, EPOLL_CTL_ADD, ctx->epfd, &inner) < 0 ||
      epoll_ctl(ctx->outer_epfd, EPOLL_CTL_ADD, ctx->outer_wake, &stop) < 0)
    return fr_err_errno(FERRY_ESYS, "epoll_ctl");
  return 0;
}

static int start_listeners(ferry_ctx *ctx) {
  size_t used = 0;
  for (size_t i = 0; i < ctx->norder; i++) {
    fr_listener *ls = &ctx->listeners[ctx->nlisteners];
    char url[160];
    int rc = ctx->order[i]->listen(ctx, &ls->poller.fd, url, sizeof url);
    if (rc != 0)
      return rc;
    ls->poller.on_event = fr_ctx_on_accept;
    fr_ctx_spare_take();
    ls->ctx = ctx;
    ls->ops = ctx->order[i];
    ctx->nlisteners++;
    if ((rc = add_poller(ctx, &ls->poller)) != 0)
      return rc;
    used += (size_t)snprintf(ctx->address + used, sizeof ctx->address - used, "%s%s",
                             used ? "," : "", url);
  }
  return 0;
}

static void fini_transports(ferry_ctx *ctx) {
  for (size_t i = 0; i < ctx->norder; i++)
    if (ctx->order[i]->ctx_fini)
      ctx->order[i]->ctx_fini(ctx);
}

static char *default_name(void) {
  char host[64] = "node", buf[96];
  gethostname(host, sizeof host - 1);
  snprintf(buf, sizeof buf, "%s-%d", host, (int)getpid());
  return strdup(buf);
}

static void ctx_init_sync(ferry_ctx *ctx) {
  pthread_mutex_init(&ctx->links_lock, NULL);
  pthread_mutex_init(&ctx->serve_lock, NULL);
  pthread_cond_init(&ctx->serve_cond, NULL);
  pthread_mutex_init(&ctx->lead, NULL);
  for (int i = 0; i < FERRY_MAX_CHANNELS; i++) {
    pthread_mutex_init(&ctx->channels[i].lock, NULL);
    fr_cond_init_monotonic(&ctx->channels[i].cond);
  }
  fr_region_table_init(&ctx->regions);
  fr_stats_init(&ctx->stats);
}

/* FERRY_METRICS_LISTEN: a bad address fails the ctx (the operator asked for it); a port already
 * taken (a second ctx of this process) only warns, since the first one serves. */
static int start_metrics(ferry_ctx *ctx) {
  int rc = fr_stats_add(&ctx->stats, fr_link_stats_collect, NULL, ctx);
  const char *listen = fr_config_str("FERRY_METRICS_LISTEN");
  if (rc != 0 || !*listen)
    return rc;
  rc = ferry_metrics_serve(ctx, listen, &ctx->metrics);
  if (rc == FERRY_ESYS) {
    fr_warn("ctx '%s': %s; not serving metrics", ctx->name, ferry_last_error());
    rc = 0;
  }
  return rc;
}

/* The token the ctx's links prove: the caller's, else FERRY_TOKEN, else this user's secret. ""
 * counts as none given, so there is no way to turn authentication off: a ctx that passed "" to
 * mean "no token" still talks to every process of its user, and to nothing else. */
static int ctx_token(ferry_ctx *ctx, const ferry_ctx_opts *o) {
  const char *given = o && o->token && *o->token ? o->token : fr_config_str("FERRY_TOKEN");
  if (!*given)
    return fr_user_token(&ctx->token);
  int rc = fr_token_check(given, o && o->token && *o->token ? "ctx token" : "FERRY_TOKEN");
  if (rc != 0)
    return rc;
  ctx->token_explicit = true;
  ctx->token = strdup(given);
  return ctx->token ? 0 : fr_err(FERRY_ENOMEM, "ctx: token");
}

/* A duration setting in nanoseconds, given its unit in them (1000: microseconds); at least 1. */
static uint64_t config_ns(const char *name, uint64_t unit) {
  int64_t v = fr_config_int(name);
  return v > 0 ? (uint64_t)v * unit : 1;
}

static int ctx_configure(ferry_ctx *ctx, const ferry_ctx_opts *o) {
  const char *name = o && o->name ? o->name : NULL;
  if (name && fr_name_check("node name", name, FR_NAME_BYTES - 1) != 0)
    return FERRY_EINVAL;
  ctx->name = name ? strdup(name) : default_name();
  ctx->tcp_listen = strdup(o && o->tcp_listen ? o->tcp_listen : fr_config_str("FERRY_TCP_LISTEN"));
  ctx->max_payload = (uint64_t)fr_config_int("FERRY_MAX_MESSAGE");
  ctx->spin_us = (int)fr_config_int("FERRY_SPIN_US");
  ctx->follow_ns = config_ns("FERRY_LEAD_FOLLOW_US", 1000);
  ctx->sleeper_slice_ns = config_ns("FERRY_SLEEPER_SLICE_MS", 1000000);
  ctx->shared_core_ns = config_ns("FERRY_SHARED_CORE_US", 1000);
  ctx->timeout_ms = fr_timeout(-1);
  if (!ctx->name || !ctx->tcp_listen)
    return fr_err(FERRY_ENOMEM, "ctx: names");
  int rc = ctx_token(ctx, o);
  if (rc != 0)
    return rc;
  return parse_transports(ctx,
                          o && o->transports ? o->transports : fr_config_str("FERRY_TRANSPORTS"));
}

int ferry_ctx_open(const ferry_ctx_opts *opts, ferry_ctx **out) {
  if (!out)
    return fr_err(FERRY_EINVAL, "ferry_ctx_open: out is NULL");
  int rc = FR_OPTS_CHECK(opts, "ferry_ctx_open");
  if (rc != 0)
    return rc;
  ferry_ctx_opts o = {.size = sizeof o,
                      .name = FR_OPT(opts, name, NULL),
                      .tcp_listen = FR_OPT(opts, tcp_listen, NULL),
                      .transports = FR_OPT(opts, transports, NULL),
                      .token = FR_OPT(opts, token, NULL)};
  ferry_ctx *ctx = calloc(1, sizeof *ctx);
  if (!ctx)
    return fr_err(FERRY_ENOMEM, "ferry_ctx_open");
  ctx->epfd = ctx->wake.fd = ctx->outer_epfd = ctx->outer_wake = -1;
  ctx->next_reap = fr_now_ns() + 1000000000ull;
  ctx_init_sync(ctx);
  rc = ctx_configure(ctx, &o);
  if (rc == 0) /* before the threads start, so that their lines carry it too */
    ctx->log_node = fr_log_set_node(ctx->name);
  if (rc == 0 && (ctx->epfd = epoll_create1(EPOLL_CLOEXEC)) < 0)
    rc = fr_err_errno(FERRY_ESYS, "epoll_create1");
  if (rc == 0 && (ctx->wake.fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
    rc = fr_err_errno(FERRY_ESYS, "eventfd");
  ctx->wake.on_event = fr_ctx_on_wake;
  if (rc == 0)
    rc = add_poller(ctx, &ctx->wake);
  if (rc == 0)
    rc = progress_epoll(ctx);
  if (rc == 0)
    rc = start_listeners(ctx);
  if (rc == 0)
    rc = start_metrics(ctx);
  if (rc == 0 &&
      (rc = fr_thread_start(&ctx->server, "ferry-server", fr_ctx_server_main, ctx, false)) == 0)
    ctx->server_started = true;
  if (rc == 0 && (rc = fr_thread_start(&ctx->progress, "ferry-progress", fr_ctx_progress_main, ctx,
                                       false)) == 0)
    ctx->progress_started = true;
  if (rc != 0) { /* close takes a ctx however far its open came */
    fr_err_keep keep;
    fr_err_save(&keep, rc);
    ferry_ctx_close(ctx);
    return fr_err_restore(&keep);
  }
  fr_debug("ctx '%s' listening at %s", ctx->name, ctx->address);
  *out = ctx;
  return 0;
}

static void close_links(ferry_ctx *ctx) {
  pthread_mutex_lock(&ctx->links_lock);
  ferry_link *all = ctx->links;
  ctx->links = NULL;
  pthread_mutex_unlock(&ctx->links_lock);
  uint64_t flush_by = all ? fr_link_flush_deadline(ctx) : 0; /* one bound for all (transport.h) */
  while (all) {
    ferry_link *next = all->next;
    fr_link_flush(all, flush_by); /* as ferry_link_close (api.c) */
    fr_link_fail(all, FERRY_ECLOSED, "context closed");
    fr_link_unref(all);
    all = next;
  }
}

bool fr_ctx_closing(const ferry_ctx *ctx) { return fr_ctx_stopping(ctx); }

/* Stops and joins the threads the ctx's open started (none, one or both). */
static void stop_threads(ferry_ctx *ctx) {
  __atomic_store_n(&ctx->stopping, true, __ATOMIC_RELEASE);
  if (ctx->progress_started) {
    fr_ctx_stop_progress(ctx);
    pthread_join(ctx->progress, NULL);
  }
  for (size_t i = 0; i < ctx->ngrave; i++)
    fr_link_unref(ctx->grave[i]);
  if (ctx->server_started) {
    pthread_mutex_lock(&ctx->serve_lock);
    pthread_cond_broadcast(&ctx->serve_cond);
    pthread_mutex_unlock(&ctx->serve_lock);
    pthread_join(ctx->server, NULL);
  }
}

static void close_fd(int fd) {
  if (fd >= 0)
    close(fd);
}

/* Also a ctx whose open failed halfway (ferry_ctx_open fails through here): every part is
 * released only if it was made (descriptors of -1, threads not started, no listeners). */
void ferry_ctx_close(ferry_ctx *ctx) {
  if (!ctx)
    return;
  ferry_metrics_server_close(ctx->metrics); /* its scrapes read the ctx */
  ctx->metrics = NULL;
  stop_threads(ctx);
  close_links(ctx);
  for (int i = 0; i < FERRY_MAX_CHANNELS; i++) {
    fr_channel *c = &ctx->channels[i];
    pthread_mutex_lock(&c->lock);
    pthread_cond_broadcast(&c->cond);
    fr_msg_fifo_free(&c->head, &c->tail);
    pthread_mutex_unlock(&c->lock);
  }
  fini_transports(ctx);
  for (size_t i = 0; i < ctx->nlisteners; i++)
    close(ctx->listeners[i].poller.fd);
  close_fd(ctx->epfd);
  close_fd(ctx->wake.fd);
  close_fd(ctx->outer_epfd);
  close_fd(ctx->outer_wake);
  fr_region_table_fini(&ctx->regions);
  fr_stats_fini(&ctx->stats);
  if (ctx->log_node)
    fr_log_set_node(NULL);
  free(ctx->name);
  free(ctx->token);
  free(ctx->tcp_listen);
  free(ctx);
  fr_task_quiesce(); /* the pool's workers end with the last job's timers */
}

const char *ferry_ctx_name(const ferry_ctx *ctx) { return ctx ? ctx->name : NULL; }
const char *ferry_ctx_address(const ferry_ctx *ctx) { return ctx ? ctx->address : NULL; }
