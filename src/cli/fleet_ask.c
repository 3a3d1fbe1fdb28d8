/*
 * The fleet snapshot's askers (fleet.c has the overview): the metrics of every distinct address,
 * asked in parallel (FLEET_ASK_THREADS at a time, on the task pool) within what is left of the
 * budget, over the link kept to it from the last snapshot; an address that failed is skipped for
 * FLEET_SKIP_MS.
 */
#include "cli/fleet_impl.h"
#include "core/task.h"
#include "transport/linkcalls.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

void fleet_drop_link(fleet_view *v, size_t i) {
  ferry_link_close(v->kept[i].link);
  free(v->kept[i].address);
  v->kept[i] = v->kept[--v->nkept];
}

void fleet_drop_down(fleet_view *v, size_t i) {
  free(v->down[i].address);
  v->down[i] = v->down[--v->ndown];
}

/* Milliseconds left before deadline, rounded up (0: none). */
int fleet_left_ms(uint64_t deadline) {
  uint64_t now = fr_now_ns();
  return now >= deadline ? 0 : (int)((deadline - now + 999999) / 1000000);
}

/* The metrics of one address, over the link kept to it (or a new one), within what is left of
 * the budget. Runs on an asker thread: it touches only ns. */
static void ask_one(snap *s, node_stats *ns) {
  int ms = fleet_left_ms(s->deadline), rc = 0;
  if (ms == 0)
    rc = fr_err(FERRY_ETIMEDOUT, "not asked: the snapshot's %d ms budget ran out", s->v->budget_ms);
  ns->asked = rc == 0;
  if (rc == 0 && !ns->link)
    rc = ferry_connect(s->v->ctx, ns->address, ms, &ns->link);
  if (rc == 0 && (ms = fleet_left_ms(s->deadline)) == 0)
    rc = fr_err(FERRY_ETIMEDOUT, "no answer within the snapshot's %d ms budget", s->v->budget_ms);
  if (rc == 0)
    rc = fr_stats_call(ns->link, ms, &ns->text);
  if (rc != 0) {
    fr_str_copy(ns->error, sizeof ns->error, ferry_last_error());
    ferry_link_close(ns->link);
    ns->link = NULL;
  }
  ns->rc = rc;
}

/* The addresses to ask (s->of[i] == &s->stats[i], not skipped), taken in turn by the askers. */
typedef struct askers {
  snap *s;
  pthread_mutex_t lock;
  pthread_cond_t done; /* the last helper out signals it */
  size_t next;
  int helpers; /* lock: askers on the task pool still asking */
} askers;

static void ask_next(askers *a) {
  for (;;) {
    pthread_mutex_lock(&a->lock);
    size_t i = a->next;
    while (i < a->s->nnodes && (a->s->of[i] != &a->s->stats[i] || a->s->stats[i].skipped))
      i++;
    a->next = i + 1;
    pthread_mutex_unlock(&a->lock);
    if (i >= a->s->nnodes)
      return;
    ask_one(a->s, &a->s->stats[i]);
  }
}

/* An asker on the process's task pool (core/task.h); a is the caller's, untouched after the
 * unlock. */
static void asker_main(void *arg) {
  askers *a = arg;
  ask_next(a);
  pthread_mutex_lock(&a->lock);
  if (--a->helpers == 0)
    pthread_cond_signal(&a->done);
  pthread_mutex_unlock(&a->lock);
}

/* Asks every address at once, FLEET_ASK_THREADS at a time: this thread and as many askers as
 * the task pool has workers free for (none: this thread asks alone). */
static void ask_all(snap *s, size_t nask) {
  askers a = {.s = s};
  pthread_mutex_init(&a.lock, NULL);
  pthread_cond_init(&a.done, NULL);
  size_t want = (nask < FLEET_ASK_THREADS ? nask : FLEET_ASK_THREADS) - 1;
  a.helpers = (int)want; /* counted before they start: one may end at once */
  int refused = a.helpers - fr_task_try_many(asker_main, &a, a.helpers);
  pthread_mutex_lock(&a.lock);
  a.helpers -= refused;
  pthread_mutex_unlock(&a.lock);
  ask_next(&a);
  pthread_mutex_lock(&a.lock);
  while (a.helpers > 0)
    pthread_cond_wait(&a.done, &a.lock);
  pthread_mutex_unlock(&a.lock);
  pthread_cond_destroy(&a.done);
  pthread_mutex_destroy(&a.lock);
}

static down_addr *down_of(fleet_view *v, const char *address) {
  for (size_t i = 0; i < v->ndown; i++)
    if (strcmp(v->down[i].address, address) == 0)
      return &v->down[i];
  return NULL;
}

/* Before the asking: each address to ask takes the link kept to it (links to addresses not
 * asked are closed), an address that failed less than FLEET_SKIP_MS ago is skipped, and
 * failures older than that are forgotten (so the list stays bounded however nodes come and go).
 * Returns how many to ask. */
static size_t plan(snap *s) {
  fleet_view *v = s->v;
  uint64_t now = fr_now_ns();
  size_t nask = 0;
  for (size_t i = 0; i < s->nnodes; i++) {
    s->of[i] = &s->stats[i];
    for (size_t j = 0; j < i; j++)
      if (strcmp(s->nodes[j].address, s->nodes[i].address) == 0) {
        s->of[i] = s->of[j];
        break;
      }
    if (s->of[i] != &s->stats[i])
      continue;
    node_stats *ns = &s->stats[i];
    ns->address = s->nodes[i].address;
    down_addr *d = down_of(v, ns->address);
    if (d && now < d->until) {
      ns->skipped = true, ns->down_since = d->since;
      fr_str_copy(ns->error, sizeof ns->error, d->error);
      continue;
    }
    nask++;
    for (size_t k = 0; k < v->nkept && !ns->link; k++)
      if (strcmp(v->kept[k].address, ns->address) == 0 && ferry_link_status(v->kept[k].link) == 0) {
        ns->link = v->kept[k].link;
        v->kept[k].link = NULL;
      }
  }
  while (v->nkept)
    fleet_drop_link(v, 0);
  for (size_t i = v->ndown; i-- > 0;)
    if (now >= v->down[i].until)
      fleet_drop_down(v, i);
  return nask;
}

/* After the asking: links that answered are kept, addresses that failed are remembered. */
static void settle(snap *s) {
  fleet_view *v = s->v;
  struct timespec wall;
  clock_gettime(CLOCK_REALTIME, &wall);
  for (size_t i = 0; i < s->nnodes; i++) {
    node_stats *ns = &s->stats[i];
    if (s->of[i] != ns || ns->skipped)
      continue;
    down_addr *d = down_of(v, ns->address);
    if (ns->rc == 0) {
      fleet_parse_prom(ns->text, &ns->ss);
      ns->ok = true;
      char *address = strdup(ns->address);
      if (address && v->nkept < FLEET_NODES_MAX)
        v->kept[v->nkept++] = (kept_link){address, ns->link};
      else
        free(address), ferry_link_close(ns->link);
      ns->link = NULL;
      if (d)
        fleet_drop_down(v, (size_t)(d - v->down));
      continue;
    }
    if (!ns->asked)
      continue;
    if (!d && v->ndown < FLEET_NODES_MAX && (v->down[v->ndown].address = strdup(ns->address))) {
      d = &v->down[v->ndown++];
      d->since = (double)wall.tv_sec + wall.tv_nsec * 1e-9;
    }
    if (d) {
      d->until = fr_now_ns() + (uint64_t)FLEET_SKIP_MS * 1000000ull;
      fr_str_copy(d->error, sizeof d->error, ns->error);
      ns->down_since = d->since;
    }
  }
}

void fleet_fetch_stats(snap *s) {
  size_t nask = plan(s);
  if (nask)
    ask_all(s, nask);
  settle(s);
}
