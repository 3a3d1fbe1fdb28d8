/*
 * Spinning waiters: a thread about to sleep on a flag or a channel first polls for a few
 * microseconds, driving the links it waits on itself (shm rings are cheap to poll), so a shm
 * round trip costs no wake-up and no system call. Also the helpers that drain or mark as
 * polled every cheap link of a context (fr_ctx_poll_links, fr_ctx_work_polling).
 */
#include "transport/ctx_impl.h"

#include <stdlib.h>

/* Marks the links as polled by this thread: their peers send without a doorbell meanwhile. */
static void polling_begin(ferry_link **links, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (links[i]->ops->poll_begin)
      links[i]->ops->poll_begin(links[i]);
}

/* Ends polling_begin and drains the links: what arrived as polling stopped is not stranded. */
static void polling_end(ferry_link **links, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (links[i]->ops->poll_end)
      links[i]->ops->poll_end(links[i]);
    fr_link_poll(links[i], true);
  }
}

/* Spinning keeps a waiter on its core for the next microseconds instead of paying a wake-up
 * (tens of microseconds here). While it spins it drives the links it waits on itself, so a
 * shm round trip needs no wake-up and no system call at all. It yields between polls
 * (core/spin.c) so that on a busy machine the thread it waits for gets the core. */
static bool spin_for(ferry_link **links, size_t n, bool (*ready_fn)(void *), void *arg,
                     int spin_us) {
  if (ready_fn(arg))
    return true;
  polling_begin(links, n);
  fr_spin spin;
  fr_spin_begin(&spin, (uint64_t)spin_us * 1000u);
  bool ready = false;
  do {
    for (size_t i = 0; i < n; i++)
      fr_link_poll(links[i], false);
  } while (!(ready = ready_fn(arg)) && fr_spin_pause(&spin));
  polling_end(links, n);
  return ready || ready_fn(arg);
}

typedef struct spin_word {
  const void *word;
  size_t width; /* 1: a bool, else an int */
} spin_word;

static bool word_set(void *arg) {
  const spin_word *w = arg;
  return w->width == 1 ? __atomic_load_n((const bool *)w->word, __ATOMIC_ACQUIRE)
                       : __atomic_load_n((const int *)w->word, __ATOMIC_ACQUIRE) != 0;
}

static bool spin(ferry_link **links, size_t n, const void *word, size_t width, int spin_us) {
  spin_word w = {word, width};
  return spin_for(links, n, word_set, &w, spin_us);
}

bool fr_spin_until(ferry_link *link, const bool *flag, int spin_us) {
  bool pollable = link && link->ops->pollable && link->ops->pollable(link);
  return spin(&link, pollable ? 1 : 0, flag, 1, spin_us);
}

/* The links of the context that are cheap to poll (shm rings), up to cap, a reference each.
 * They come first in ctx->links (link.c links_insert): the walk ends at the first other one. */
static size_t cheap_links(ferry_ctx *ctx, ferry_link **links, size_t cap) {
  size_t n = 0;
  pthread_mutex_lock(&ctx->links_lock);
  for (ferry_link *l = ctx->links; l && l->ops->poll_is_cheap && n < cap; l = l->next)
    if (l->ops->pollable(l)) {
      fr_link_ref(l);
      links[n++] = l;
    }
  pthread_mutex_unlock(&ctx->links_lock);
  return n;
}

void fr_ctx_work_polling(ferry_ctx *ctx, void (*work)(void *), void *arg) {
  ferry_link *links[16];
  size_t n = cheap_links(ctx, links, 16);
  polling_begin(links, n);
  work(arg);
  polling_end(links, n);
  for (size_t i = 0; i < n; i++)
    fr_link_unref(links[i]);
}

/* Spins on a channel, driving every link of the context that is cheap to poll (shm rings);
 * the others keep their messages coming through the progress thread. Where callers lead the
 * epoll, spinning without such a link is pointless: the caller leads at once instead. */
void fr_ctx_spin_channel(ferry_ctx *ctx, fr_channel *c) {
  ferry_link *links[16];
  size_t n = cheap_links(ctx, links, 16);
  if (n > 0 || !ctx->users_may_lead)
    spin(links, n, &c->count, sizeof c->count, ctx->spin_us);
  for (size_t i = 0; i < n; i++)
    fr_link_unref(links[i]);
}

bool fr_ctx_spin(ferry_ctx *ctx, bool (*ready)(void *), void *arg) {
  ferry_link *links[16];
  size_t n = cheap_links(ctx, links, 16);
  bool got = n > 0 ? spin_for(links, n, ready, arg, ctx->spin_us) : ready(arg);
  for (size_t i = 0; i < n; i++)
    fr_link_unref(links[i]);
  return got;
}

/* Drains every link of the context that is cheap to poll (shm rings), waiting for one that
 * another thread is draining right now: whatever such a link's peer had sent before this call
 * is then in the channel queues. */
void fr_ctx_poll_links(ferry_ctx *ctx) {
  ferry_link *few[16], **links = few;
  pthread_mutex_lock(&ctx->links_lock);
  size_t n = 0;
  for (ferry_link *l = ctx->links; l && l->ops->poll_is_cheap; l = l->next)
    n++;
  if (n > sizeof few / sizeof *few && !(links = malloc(n * sizeof *links))) {
    pthread_mutex_unlock(&ctx->links_lock);
    fr_warn("poll links: out of memory");
    return;
  }
  n = 0;
  for (ferry_link *l = ctx->links; l && l->ops->poll_is_cheap; l = l->next)
    if (l->ops->pollable(l)) {
      fr_link_ref(l);
      links[n++] = l;
    }
  pthread_mutex_unlock(&ctx->links_lock);
  for (size_t i = 0; i < n; i++) {
    fr_link_poll(links[i], true);
    fr_link_unref(links[i]);
  }
  if (links != few)
    free(links);
}
