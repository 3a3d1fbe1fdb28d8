/*
 * The process's threads: fr_thread_start, the one way the library starts a thread (named, for
 * top -H, perf, gdb and the test that lists them), and the task pool, the one place blocking work
 * runs (the store's get helpers and uploads, the fleet's askers) and timers fire (a node's lease
 * renewal, the HTTP guard's deadlines).
 *
 * The pool is process-wide: at most FERRY_TASK_THREADS workers ("ferry-task"), started as work
 * needs them and kept, asleep, afterwards (no wake-ups while idle), until the last context
 * closes with nothing left to do (fr_task_quiesce). Work that may block for a
 * long time (a stalled peer holds it until its timeout) goes through fr_task_try, which takes a
 * worker only while another one stays free for the timers: so a flood of stalled uploads never
 * delays a lease renewal, it is refused (FERRY_EBUSY) instead, as uploads beyond their caps are.
 *
 * Timers: an fr_timer (the caller's memory) fires fn(arg) once on a worker when its deadline
 * passes; the callback may arm it again. One idle worker sleeps until the earliest deadline; the
 * others sleep until work comes.
 */
#ifndef FR_TASK_H
#define FR_TASK_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

/* Starts a thread running main(arg), named `name` (at most 15 bytes; kept by the caller until
 * the thread named itself, so a literal) before main runs. detached: nobody joins it (out may
 * then be NULL). FERRY_ESYS with a detail naming it when the system refuses. */
int fr_thread_start(pthread_t *out, const char *name, void *(*main)(void *), void *arg,
                    bool detached);

typedef void (*fr_task_fn)(void *arg);

/* Runs fn(arg) on a pool worker now, if one is free (or may be started) beyond the one kept for
 * timers: 0, and fn runs (once, soon, on another thread); else FERRY_EBUSY, with no detail set
 * (the caller decides what it means: do the work itself, or refuse it). */
int fr_task_try(fr_task_fn fn, void *arg);
/* fr_task_try n times (at most FR_TASK_MANY_MAX) in one go, the workers woken after the pool's
 * lock is let go (a batch's helpers: one pass, no worker woken only to wait for the lock while
 * the next is handed over): how many it took, each running fn(arg) once. */
#define FR_TASK_MANY_MAX 64
int fr_task_try_many(fr_task_fn fn, void *arg, int n);

typedef struct fr_timer {
  fr_task_fn fn;
  void *arg;
  uint64_t deadline; /* fr_now_ns; the pool's lock */
  bool armed;        /* in the pool's list (the pool's lock) */
  bool running;      /* fn runs now (the pool's lock) */
  pthread_t runner;  /* the worker running fn, while running */
  struct fr_timer *next;
} fr_timer;

void fr_timer_init(fr_timer *t, fr_task_fn fn, void *arg);
/* Fires fn once at deadline_ns (fr_now_ns; one past: at once), replacing an earlier arming.
 * Any thread, fn itself included. */
void fr_timer_arm(fr_timer *t, uint64_t deadline_ns);
/* Disarms t and, unless called from fn itself, waits for a running fn to return: after it, fn
 * does not run again until armed again, and t may be freed (from fn: once fn returned). */
void fr_timer_cancel(fr_timer *t);

/* Ends the workers (joined) when the pool has nothing to do: no task, no armed timer; else, or
 * from a worker, nothing. The next task or timer starts them again. ferry_ctx_close calls it, so
 * a process that closed its contexts has no thread of ferry's left (a fork then starts clean). */
void fr_task_quiesce(void);
/* Workers started so far and the most there may be (FERRY_TASK_THREADS): for tests, metrics. */
void fr_task_counts(int *started, int *max);

#endif
