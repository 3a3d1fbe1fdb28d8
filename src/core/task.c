/*
 * Threads, the task pool and its timers (task.h). fr_thread_start names a thread before its
 * main runs, so no library thread is ever seen under its process's name. The pool's workers
 * share one queue and one sorted list of timers under one lock: a worker takes the next task,
 * else fires the first timer that is due, else sleeps. One sleeping worker (the keeper) waits
 * for the earliest deadline, the others for work, so an idle pool wakes only when a timer is
 * due. A keeper woken for a task hands the watch to another sleeping worker before it runs it.
 * Workers are started on demand, up to FERRY_TASK_THREADS, and never end (they sleep); a forked
 * child starts with none (its parent's timers are not its own: they are dropped there).
 */
#include "core/task.h"
#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- naming threads ---- */

typedef struct start {
  char name[16];
  void *(*main)(void *);
  void *arg;
} start;

static void *named_main(void *p) {
  start s = *(start *)p;
  free(p);
  pthread_setname_np(pthread_self(), s.name); /* for top -H, perf, gdb */
  return s.main(s.arg);
}

int fr_thread_start(pthread_t *out, const char *name, void *(*main)(void *), void *arg,
                    bool detached) {
  start *s = malloc(sizeof *s);
  if (!s)
    return fr_err(FERRY_ENOMEM, "thread '%s'", name);
  fr_str_copy(s->name, sizeof s->name, name);
  s->main = main, s->arg = arg;
  pthread_t t;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  if (detached)
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  int e = pthread_create(&t, &attr, named_main, s);
  pthread_attr_destroy(&attr);
  if (e != 0) {
    free(s);
    return fr_err(FERRY_ESYS, "cannot start a thread '%s': %s", name, strerror(e));
  }
  if (out)
    *out = t;
  return 0;
}

/* ---- the pool ---- */

typedef struct task {
  fr_task_fn fn;
  void *arg;
  struct task *next;
} task;

static struct {
  pthread_mutex_t lock;
  pthread_cond_t work;   /* sleeping workers but the keeper: a task came */
  pthread_cond_t watch;  /* the keeper: an earlier deadline, or a task nobody else can take */
  pthread_cond_t landed; /* a timer's callback returned (fr_timer_cancel waits for it) */
  bool ready;            /* max read, conditions made */
  int max, started, idle, queued;
  int tasks;          /* taken by fr_task_try and not yet returned: at most max - 1 */
  bool keeper;        /* a sleeping worker waits for the first deadline */
  bool ending;        /* fr_task_quiesce: workers with nothing to do end */
  pthread_t *threads; /* the workers started, joined by fr_task_quiesce (max of them) */
  task *head, *tail;
  fr_timer *timers; /* armed, earliest first */
} P = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void on_fork_child(void) {
  pthread_mutex_init(&P.lock, NULL);
  P.started = P.idle = P.queued = P.tasks = 0, P.keeper = P.ending = false;
  P.head = P.tail = NULL; /* their workers are the parent's: they stay there */
  for (fr_timer *t = P.timers; t; t = t->next)
    t->armed = false;
  P.timers = NULL;
}

/* P.lock held. */
static void ready(void) {
  if (P.ready)
    return;
  int64_t n = fr_config_int("FERRY_TASK_THREADS");
  P.max = n < 2 ? 2 : n > 1024 ? 1024 : (int)n;
  P.threads = calloc((size_t)P.max, sizeof *P.threads);
  P.max = P.threads ? P.max : 0; /* no memory: no workers (every try is refused) */
  pthread_cond_init(&P.work, NULL);
  fr_cond_init_monotonic(&P.watch);
  pthread_cond_init(&P.landed, NULL);
  pthread_atfork(NULL, NULL, on_fork_child);
  P.ready = true;
}

static pthread_cond_t *wake_one(int waiting);
static void signal_now(pthread_cond_t *c);

/* P.lock held. The first armed timer whose callback is not running now (one that its own
 * callback armed again waits for it to return: a callback never runs twice at once). */
static fr_timer *next_timer(void) {
  fr_timer *t = P.timers;
  while (t && t->running)
    t = t->next;
  return t;
}

/* P.lock held: runs t's callback without it. */
static void fire(fr_timer *t) {
  for (fr_timer **p = &P.timers; *p; p = &(*p)->next)
    if (*p == t) {
      *p = t->next;
      break;
    }
  t->armed = false;
  t->running = true;
  t->runner = pthread_self();
  if (next_timer() && !P.keeper) /* the keeper was this worker: another one keeps the watch */
    signal_now(wake_one(P.queued + 1));
  pthread_mutex_unlock(&P.lock);
  t->fn(t->arg);
  pthread_mutex_lock(&P.lock);
  t->running = false;
  pthread_cond_broadcast(&P.landed);
  if (t->armed && P.keeper) /* armed again while it ran: the keeper did not count it */
    pthread_cond_signal(&P.watch);
}

/* P.lock held. Sleeps until a task, or the first deadline for the keeper. */
static void sleep_turn(void) {
  fr_timer *t = next_timer();
  P.idle++;
  if (t && !P.keeper) {
    P.keeper = true;
    struct timespec ts = fr_timespec(t->deadline);
    pthread_cond_timedwait(&P.watch, &P.lock, &ts);
    P.keeper = false;
    P.idle--;
    /* off to a task: a sleeper not woken for the other tasks keeps the watch */
    if (P.head && P.idle > 0 && P.idle >= P.queued)
      pthread_cond_signal(&P.work);
    return;
  }
  pthread_cond_wait(&P.work, &P.lock);
  P.idle--;
}

static _Thread_local bool on_worker;

static void *worker_main(void *unused) {
  (void)unused;
  on_worker = true;
  pthread_mutex_lock(&P.lock);
  for (;;) {
    task *k = P.head;
    if (!k && P.ending)
      break;
    if (k) {
      P.head = k->next;
      P.tail = P.head ? P.tail : NULL;
      P.queued--;
      pthread_mutex_unlock(&P.lock);
      k->fn(k->arg);
      free(k);
      pthread_mutex_lock(&P.lock);
      P.tasks--;
      continue;
    }
    fr_timer *t = next_timer();
    if (t && t->deadline <= fr_now_ns())
      fire(t);
    else
      sleep_turn();
  }
  pthread_mutex_unlock(&P.lock);
  return NULL;
}

/* P.lock held. One more worker; false when the system refuses. */
static bool add_worker(void) {
  if (P.started >= P.max ||
      fr_thread_start(&P.threads[P.started], "ferry-task", worker_main, NULL, false) != 0) {
    fr_err_clear();
    return false;
  }
  P.started++;
  return true;
}

/* P.lock held, a task or a timer just came: the condition to signal for a sleeping worker to
 * take it (NULL: none, or a new worker started for it). Signalled once the lock is let go (woken
 * under it, the worker would wake only to wait for the lock: a second wake-up per task). */
static pthread_cond_t *wake_one(int waiting) {
  if (P.idle - (P.keeper ? 1 : 0) >= waiting)
    return &P.work;
  if (P.idle >= waiting)
    return &P.watch;
  add_worker();
  return NULL;
}

static void signal_now(pthread_cond_t *c) {
  if (c)
    pthread_cond_signal(c);
}

/* P.lock held: queues k if the pool has room for it, waking nobody yet: *wake is the condition
 * to signal once the lock is let go (NULL: none). */
static bool take(task *k, pthread_cond_t **wake) {
  *wake = NULL;
  if (P.tasks >= P.max - 1) /* one worker stays for the timers */
    return false;
  if (P.idle <= P.queued && !add_worker()) /* no sleeper left for it */
    return false;
  *(P.tail ? &P.tail->next : &P.head) = k;
  P.tail = k;
  P.queued++;
  P.tasks++;
  if (P.idle >= P.queued) /* else the worker just started takes it */
    *wake = wake_one(P.queued);
  return true;
}

int fr_task_try_many(fr_task_fn fn, void *arg, int n) {
  task *k[FR_TASK_MANY_MAX];
  pthread_cond_t *wake[FR_TASK_MANY_MAX];
  n = n < FR_TASK_MANY_MAX ? n : FR_TASK_MANY_MAX;
  int got = 0;
  for (; got < n && (k[got] = malloc(sizeof *k[got])); got++)
    *k[got] = (task){.fn = fn, .arg = arg};
  int made = got;
  pthread_mutex_lock(&P.lock);
  ready();
  for (got = 0; got < made && take(k[got], &wake[got]); got++)
    ;
  pthread_mutex_unlock(&P.lock);
  for (int i = 0; i < got; i++) /* woken under the lock, each would wake again to take it */
    signal_now(wake[i]);
  for (int i = got; i < made; i++)
    free(k[i]);
  return got;
}

int fr_task_try(fr_task_fn fn, void *arg) {
  return fr_task_try_many(fn, arg, 1) == 1 ? 0 : FERRY_EBUSY;
}

void fr_task_quiesce(void) {
  pthread_mutex_lock(&P.lock);
  int n = P.started;
  pthread_t *ended = n && !on_worker && !P.head && !P.tasks && !P.timers && !P.ending
                         ? malloc((size_t)n * sizeof *ended)
                         : NULL;
  if (!ended) {
    pthread_mutex_unlock(&P.lock);
    return;
  }
  memcpy(ended, P.threads, (size_t)n * sizeof *ended);
  P.ending = true;
  pthread_cond_broadcast(&P.work);
  pthread_cond_broadcast(&P.watch);
  pthread_mutex_unlock(&P.lock);
  for (int i = 0; i < n; i++)
    pthread_join(ended[i], NULL);
  free(ended);
  pthread_mutex_lock(&P.lock);
  /* workers started meanwhile (a try from another thread) stay, after the ended ones */
  memmove(P.threads, P.threads + n, (size_t)(P.started - n) * sizeof *P.threads);
  P.started -= n;
  P.ending = false;
  pthread_mutex_unlock(&P.lock);
}

void fr_task_counts(int *started, int *max) {
  pthread_mutex_lock(&P.lock);
  ready();
  *started = P.started;
  *max = P.max;
  pthread_mutex_unlock(&P.lock);
}

/* ---- timers ---- */

void fr_timer_init(fr_timer *t, fr_task_fn fn, void *arg) { *t = (fr_timer){.fn = fn, .arg = arg}; }

/* P.lock held. */
static void unlink_timer(fr_timer *t) {
  for (fr_timer **p = &P.timers; t->armed && *p; p = &(*p)->next)
    if (*p == t) {
      *p = t->next;
      break;
    }
  t->armed = false;
}

void fr_timer_arm(fr_timer *t, uint64_t deadline_ns) {
  pthread_mutex_lock(&P.lock);
  ready();
  unlink_timer(t);
  t->deadline = deadline_ns;
  fr_timer **p = &P.timers;
  while (*p && (*p)->deadline <= deadline_ns)
    p = &(*p)->next;
  t->next = *p;
  *p = t;
  t->armed = true;
  pthread_cond_t *wake = NULL;
  if (P.keeper && next_timer() == t) /* the first deadline moved earlier */
    wake = &P.watch;
  else if (!P.keeper && !t->running) /* nobody keeps the watch: a sleeper, or a new worker */
    wake = wake_one(P.queued + 1);
  pthread_mutex_unlock(&P.lock);
  signal_now(wake);
}

void fr_timer_cancel(fr_timer *t) {
  pthread_mutex_lock(&P.lock);
  bool own = t->running && pthread_equal(t->runner, pthread_self());
  unlink_timer(t);
  while (t->running && !own) {
    pthread_cond_wait(&P.landed, &P.lock);
    unlink_timer(t); /* its callback may have armed it again */
  }
  pthread_mutex_unlock(&P.lock);
}
