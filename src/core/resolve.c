/*
 * Name resolution that honours a deadline. getaddrinfo(3) has no timeout: a name that goes to an
 * unreachable DNS server blocks for the resolver's own retries (resolv.conf's timeout × attempts ×
 * servers, tens of seconds), which would make a dial with a 1 s timeout wait that long. A numeric
 * address (and a passive lookup) never leaves the process and is resolved in place; a name is
 * resolved on a thread of its own while the caller waits no later than its deadline. A caller
 * that gives up leaves the thread to finish: the last of the two to let go of the job frees it,
 * and an answer nobody waits for any more is freed with it.
 */
#include "core/core.h"

#include <errno.h>
#include <netdb.h>
#include <stdlib.h>
#include <string.h>

/* getaddrinfo itself; tests replace it with one that blocks (fr_resolve_set_lookup). */
typedef int lookup_fn(const char *, const char *, const struct addrinfo *, struct addrinfo **);
static lookup_fn *lookup_override;

static int lookup(const char *host, const char *service, const struct addrinfo *hints,
                  struct addrinfo **out) {
  lookup_fn *fn = __atomic_load_n(&lookup_override, __ATOMIC_ACQUIRE);
  return (fn ? fn : getaddrinfo)(host, service, hints, out);
}

typedef struct resolve_job {
  pthread_mutex_t lock;
  pthread_cond_t done_cond;
  int refs;  /* the caller and the thread, under lock */
  bool done; /* the thread has answered, under lock */
  int rc;    /* its getaddrinfo result */
  struct addrinfo *ai;
  struct addrinfo hints;
  char *host, *service;
} resolve_job;

/* Drops one reference (the job's lock held, and released here); the last one frees the job and
 * an answer that nobody took. */
static void job_release(resolve_job *j) {
  bool last = --j->refs == 0;
  pthread_mutex_unlock(&j->lock);
  if (!last)
    return;
  if (j->ai)
    freeaddrinfo(j->ai);
  pthread_cond_destroy(&j->done_cond);
  pthread_mutex_destroy(&j->lock);
  free(j->host);
  free(j->service);
  free(j);
}

static void *resolve_thread(void *arg) {
  resolve_job *j = arg;
  struct addrinfo *ai = NULL;
  int rc = lookup(j->host, j->service, &j->hints, &ai);
  pthread_mutex_lock(&j->lock);
  j->rc = rc;
  j->ai = rc == 0 ? ai : NULL;
  j->done = true;
  pthread_cond_signal(&j->done_cond);
  job_release(j);
  return NULL;
}

static resolve_job *job_new(const char *host, const char *service, const struct addrinfo *hints) {
  resolve_job *j = calloc(1, sizeof *j);
  if (!j)
    return NULL;
  j->host = strdup(host);
  j->service = service ? strdup(service) : NULL;
  if (!j->host || (service && !j->service)) {
    free(j->host);
    free(j->service);
    free(j);
    return NULL;
  }
  j->hints = *hints;
  j->refs = 2;
  pthread_mutex_init(&j->lock, NULL);
  fr_cond_init_monotonic(&j->done_cond);
  return j;
}

/* Resolves a name on a thread of its own, waiting for it no later than deadline_ns. */
static int resolve_by_deadline(const char *host, const char *service, const struct addrinfo *hints,
                               uint64_t deadline_ns, struct addrinfo **out) {
  resolve_job *j = job_new(host, service, hints);
  if (!j)
    return EAI_MEMORY;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t t;
  int started = pthread_create(&t, &attr, resolve_thread, j);
  pthread_attr_destroy(&attr);
  if (started != 0) { /* no thread to spare: resolve here, as getaddrinfo alone would */
    j->refs = 1;
    pthread_mutex_lock(&j->lock);
    job_release(j);
    return lookup(host, service, hints, out);
  }
  pthread_mutex_lock(&j->lock);
  struct timespec until = fr_timespec(deadline_ns);
  while (!j->done && pthread_cond_timedwait(&j->done_cond, &j->lock, &until) != ETIMEDOUT) {
  }
  int rc = j->done ? j->rc : FR_RESOLVE_TIMEDOUT;
  if (j->done) {
    *out = j->ai;
    j->ai = NULL; /* the caller's now */
  }
  job_release(j);
  return rc;
}

int fr_resolve(const char *host, const char *service, const struct addrinfo *hints,
               uint64_t deadline_ns, struct addrinfo **out) {
  *out = NULL;
  if (!host) /* a passive or loopback address: nothing to look up */
    return getaddrinfo(host, service, hints, out);
  struct addrinfo numeric = *hints;
  numeric.ai_flags |= AI_NUMERICHOST;
  int rc = getaddrinfo(host, service, &numeric, out);
  if (rc != EAI_NONAME) /* a numeric address (or a malformed one) */
    return rc;
  if (deadline_ns == 0)
    return lookup(host, service, hints, out);
  return resolve_by_deadline(host, service, hints, deadline_ns, out);
}

const char *fr_resolve_strerror(int rc) {
  return rc == FR_RESOLVE_TIMEDOUT ? "the name service did not answer by the deadline"
                                   : gai_strerror(rc);
}

void fr_resolve_set_lookup(lookup_fn *fn) {
  __atomic_store_n(&lookup_override, fn, __ATOMIC_RELEASE);
}
