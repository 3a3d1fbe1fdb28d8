/*
 * A process's node in the directory, held under one lease: the one piece of bookkeeping that the
 * store, mq and refit's published senders of a context share. A client (one per context and
 * directory, directory.c) registers one node named after its context; each job attaches to it
 * and publishes a job record ("ferry:job/KIND/NAME") owned by the node, next to its own records,
 * so that all of them vanish together when the node's lease lapses. One request every third of
 * the node's lease (the shortest any job asked for) renews it, sent by the node's one timer on
 * the process's task pool (core/task.h), never by a job's thread.
 *
 * Taking a name (the node's, or a job's that another node publishes) that another incarnation
 * holds succeeds only when that holder is verifiably dead (nothing accepts a connection at its
 * address, or whoever answers there is not it), so a restarted process gets its names back at
 * once instead of after the old lease lapses. When the directory lost the node (its lease lapsed,
 * or the directory restarted: its epoch moved) the timer registers the node again, publishes
 * each job's record again and calls what each job registered to publish the rest of its records
 * again (fr_dir_lease_set_republish). Joining and leaving are logged at info (the directory logs
 * them too, with what a leaving node's records were).
 */
#include "directory/directory.h"
#include "core/task.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* After a failed renewal, the next try comes soon (and loudly): RETRY_PER_LEASE tries fit in
 * the third of the lease that is left before it lapses (200 ms at the default 15 s). */
#define RETRY_PER_LEASE 25

struct fr_dir_self {
  pthread_mutex_t lock; /* registering, renewing and the members: one at a time */
  const char *busy;     /* atomic: what holds `lock` while it may wait on the directory */
  fr_dir *dir;
  ferry_ctx *ctx;
  fr_dir_node node;       /* as registered (name, address and incarnation fixed at creation) */
  int lease_ms;           /* as registered */
  bool held;              /* registered, and not found lost since */
  uint64_t epoch;         /* the directory's epoch when it was registered */
  uint64_t taken;         /* atomic: registrations so far (a job publishes again when it moves) */
  uint64_t next_renew_ns; /* atomic */
  uint64_t retry_ns;      /* lock: a job's records failed to publish: the next try (0: none) */
  bool ok;                /* atomic: held, and the directory answered the last request */
  fr_dir_lease *members;
  fr_timer timer;          /* the renewal (tick), on the task pool */
  fr_dir_lease *calling;   /* lock: the member whose republish the timer runs now (unlocked) */
  pthread_cond_t returned; /* lock: `calling` went back to NULL (a leaving job waits for it) */
  /* Records of its jobs whose delete failed (the directory away for a moment): deleted at the
   * node's renewals until done, since the node's lease, which would take them, goes on. */
  fr_dir_object *orphans;
  size_t norphans, orphans_cap;
  struct fr_dir_self *next_self; /* in `selves` */
};

/* Guards the creation of a client's node (its `self`) and the list of all of them (`selves`):
 * the node's own lock guards the rest. */
static pthread_mutex_t create_lock = PTHREAD_MUTEX_INITIALIZER;
static fr_dir_self *selves;

/* Whether `incarnation` is another client's node of the same context in this process: the same
 * directory reached through another URL (a spelling fr_dir_open does not know as the same). */
static bool ours_elsewhere(const fr_dir_self *me, uint64_t incarnation, char *url, size_t cap) {
  bool found = false;
  pthread_mutex_lock(&create_lock);
  for (const fr_dir_self *o = selves; o && !found; o = o->next_self)
    if (o != me && o->ctx == me->ctx && o->node.incarnation == incarnation) {
      fr_str_copy(url, cap, o->dir->url);
      found = true;
    }
  pthread_mutex_unlock(&create_lock);
  return found;
}

static void tick(void *arg);

static fr_dir_self *self_of(fr_dir *dir, ferry_ctx *ctx) {
  pthread_mutex_lock(&create_lock);
  fr_dir_self *me = dir->self;
  if (!me && (me = calloc(1, sizeof *me))) {
    pthread_mutex_init(&me->lock, NULL);
    pthread_cond_init(&me->returned, NULL);
    fr_timer_init(&me->timer, tick, me);
    me->dir = dir;
    me->ctx = ctx;
    fr_str_copy(me->node.name, sizeof me->node.name, ferry_ctx_name(ctx));
    fr_str_copy(me->node.address, sizeof me->node.address, ferry_ctx_address(ctx));
    me->node.incarnation = fr_random_u64() | 1;
    me->lease_ms = (int)fr_config_int("FERRY_LEASE_MS");
    dir->self = me;
    me->next_self = selves;
    selves = me;
  }
  pthread_mutex_unlock(&create_lock);
  return me;
}

void fr_dir_self_free(fr_dir_self *self) {
  if (!self)
    return;
  fr_timer_cancel(&self->timer); /* no job is attached: a tick running now touches nothing */
  pthread_mutex_lock(&create_lock);
  for (fr_dir_self **p = &selves; *p; p = &(*p)->next_self)
    if (*p == self) {
      *p = self->next_self;
      break;
    }
  pthread_mutex_unlock(&create_lock);
  pthread_mutex_destroy(&self->lock);
  pthread_cond_destroy(&self->returned);
  free(self->orphans);
  free(self);
}

/* ---- job records ---- */

int fr_dir_job_key(const char *kind, const char *name, char out[FR_DIR_KEY_MAX + 1]) {
  char what[32];
  snprintf(what, sizeof what, "%s name", kind);
  int rc = fr_name_check(what, name, FR_DIR_NAME_MAX);
  if (rc != 0)
    return rc;
  snprintf(out, FR_DIR_KEY_MAX + 1, FR_DIR_JOBS "%s/%s", kind, name);
  return fr_dir_key_check(out, kind);
}

bool fr_dir_job_parse(const char *key, char kind[16], char name[FR_DIR_NAME_MAX + 1]) {
  size_t pre = sizeof FR_DIR_JOBS - 1;
  if (strncmp(key, FR_DIR_JOBS, pre) != 0)
    return false;
  const char *k = key + pre, *slash = strchr(k, '/');
  size_t kn = slash ? (size_t)(slash - k) : 0, nn = slash ? strlen(slash + 1) : 0;
  if (kn == 0 || kn >= 16 || nn == 0 || nn > FR_DIR_NAME_MAX)
    return false;
  memcpy(kind, k, kn);
  kind[kn] = '\0';
  memcpy(name, slash + 1, nn + 1);
  return true;
}

static void job_record(const fr_dir_lease *l, fr_dir_object *o) {
  memset(o, 0, sizeof *o);
  fr_str_copy(o->key, sizeof o->key, l->key);
  fr_str_copy(o->owner, sizeof o->owner, l->node.name);
  o->gen_region.size = 8;
  o->generation = l->node.incarnation;
  o->desc = (ferry_tensor_desc){.dtype = FERRY_DTYPE_U8, .ndim = 1};
}

int fr_dir_job_find(fr_dir *dir, const char *kind, const char *name, fr_dir_node *out,
                    int timeout_ms) {
  char key[FR_DIR_KEY_MAX + 1];
  int rc = fr_dir_job_key(kind, name, key), st = FERRY_ENOTFOUND;
  const char *k = key;
  fr_dir_object o;
  if (rc == 0 && (rc = fr_dir_obj_get(dir, &k, 1, &o, &st, timeout_ms)) == 0 && st != 0)
    rc = fr_err(st, "no %s '%s' in the directory", kind, name);
  if (rc == 0 && (rc = fr_dir_node_get(dir, o.owner, out, timeout_ms)) == FERRY_ENOTFOUND)
    rc = fr_err(rc, "no %s '%s' in the directory (its node '%s' is gone)", kind, name, o.owner);
  return rc;
}

/* ---- the node ---- */

/* me->lock held. What the node's record should say: the jobs' flags and access blob, and the
 * shortest lease any of them asked for. */
static void wanted(const fr_dir_self *me, fr_dir_node *n, int *lease_ms) {
  *n = me->node;
  n->flags = 0;
  n->access_len = 0;
  *lease_ms = 0;
  for (const fr_dir_lease *m = me->members; m; m = m->next) {
    n->flags |= m->node.flags;
    if (!n->access_len && m->node.access_len) {
      n->access_len = m->node.access_len;
      memcpy(n->access, m->node.access, m->node.access_len);
    }
    if (*lease_ms == 0 || m->lease_ms < *lease_ms)
      *lease_ms = m->lease_ms;
  }
  if (*lease_ms == 0)
    *lease_ms = me->lease_ms;
}

/* me->lock held. What the node's record says now that the directory took n: its flags and access
 * blob (name, address and incarnation never change after creation, so they are read without the
 * lock). */
static void set_record(fr_dir_self *me, const fr_dir_node *n, int lease_ms) {
  me->node.flags = n->flags;
  me->node.access_len = n->access_len;
  memcpy(me->node.access, n->access, n->access_len);
  me->lease_ms = lease_ms;
}

static bool same_record(const fr_dir_self *me, const fr_dir_node *n, int lease_ms) {
  return me->lease_ms == lease_ms && me->node.flags == n->flags &&
         me->node.access_len == n->access_len &&
         memcmp(me->node.access, n->access, n->access_len) == 0;
}

static void schedule(fr_dir_self *me, bool ok) {
  __atomic_store_n(&me->ok, ok && me->held, __ATOMIC_RELAXED);
  uint64_t third = (uint64_t)me->lease_ms * 1000000ull / 3;
  uint64_t after = ok ? third : third / RETRY_PER_LEASE;
  __atomic_store_n(&me->next_renew_ns, fr_now_ns() + after, __ATOMIC_RELEASE);
}

/* Whether the holder h of a name is verifiably dead: nothing accepts a connection at its address
 * before the deadline (refused, not timed out), or another node than h answers there. A live
 * holder keeps its name. */
static bool holder_dead(ferry_ctx *ctx, const fr_dir_node *h, int timeout_ms) {
  int ms = timeout_ms < 2000 ? timeout_ms : 2000;
  uint64_t deadline = fr_deadline_ns(ms);
  ferry_link *link = NULL;
  int rc = ferry_connect(ctx, h->address, ms, &link);
  bool dead = rc != 0 && rc != FERRY_EAUTH && fr_ms_left(deadline) > 0;
  if (rc == 0) {
    dead = strcmp(ferry_link_peer(link), h->name) != 0;
    ferry_link_close(link);
  }
  fr_err_clear();
  return dead;
}

/* me->lock held. Registers the node with record n under lease_ms, taking its name over from a
 * dead holder; on success every job publishes again (taken moves). */
static int register_node(fr_dir_self *me, const fr_dir_lease *l, const fr_dir_node *n, int lease_ms,
                         int timeout_ms) {
  const fr_dir_ops *ops = me->dir->ops;
  /* listed but unreachable is worse than refused: say so before registering */
  int rc = fr_dir_reach_check(me->dir->url, n->address, l->who, fr_deadline_ns(timeout_ms));
  uint64_t epoch = fr_dir_epoch(me->dir);
  fr_dir_node holder;
  if (rc == 0)
    rc = ops->node_put(me->dir->state, n, lease_ms, 0, &holder, timeout_ms);
  char other[FR_DIR_ADDRESS_MAX + 1];
  if (rc == FERRY_EEXIST && ours_elsewhere(me, holder.incarnation, other, sizeof other)) {
    rc = fr_err(FERRY_EEXIST,
                "%s: this context registered node '%s' in this directory already, through '%s'; "
                "open every job of a context with the same directory URL",
                l->who, n->name, other);
  } else if (rc == FERRY_EEXIST) {
    fr_err_keep taken;
    fr_err_save(&taken, rc);
    if (holder_dead(me->ctx, &holder, timeout_ms)) {
      fr_info("%s: the node that held '%s' at %s is dead; taking the name over", l->who, n->name,
              holder.address);
      rc = ops->node_put(me->dir->state, n, lease_ms, holder.incarnation, NULL, timeout_ms);
    } else {
      rc = fr_err(FERRY_EEXIST, "%s: %s; give this node another name or stop the other one", l->who,
                  taken.detail);
    }
  }
  __atomic_store_n(&me->held, rc == 0, __ATOMIC_RELEASE);
  if (rc == 0) {
    set_record(me, n, lease_ms);
    __atomic_store_n(&me->epoch, epoch, __ATOMIC_RELEASE);
    __atomic_add_fetch(&me->taken, 1, __ATOMIC_ACQ_REL); /* every job publishes again */
    fr_info("%s: node '%s' registered in the directory at %s (%s; lease %d ms)", l->who, n->name,
            me->dir->url, n->address, lease_ms);
  }
  schedule(me, rc == 0);
  return rc;
}

/* me->lock held. One renewal request for the node; FERRY_ENOTFOUND when the directory lost it. */
static int renew_node(fr_dir_self *me, int timeout_ms) {
  fr_dir_renewal r = {me->node.name, me->node.incarnation, me->lease_ms};
  int status = 0;
  int rc = fr_dir_node_renew_batch(me->dir, &r, 1, &status, timeout_ms);
  if (rc == 0 && status == FERRY_ENOTFOUND)
    rc = fr_err(FERRY_ENOTFOUND, "node '%s' is not registered (its lease lapsed?)", r.name);
  return rc ? rc : status;
}

/* me->lock held. Adds a record whose delete failed to those the renewals delete. */
static void orphan_add(fr_dir_self *me, const fr_dir_object *rec) {
  for (size_t i = 0; i < me->norphans; i++)
    if (strcmp(me->orphans[i].key, rec->key) == 0)
      return;
  if (FR_GROW(me->orphans, me->orphans_cap, me->norphans + 1, 4) == 0)
    me->orphans[me->norphans++] = *rec;
  else /* it goes with the node's lease, then */
    fr_warn("directory: no memory to remember '%s' for deletion", rec->key);
}

/* me->lock held. A key published again is no orphan (a job of the same name came back: its
 * record has the same owner and generation). */
static void orphan_forget(fr_dir_self *me, const char *key) {
  for (size_t i = 0; i < me->norphans; i++)
    if (strcmp(me->orphans[i].key, key) == 0) {
      me->orphans[i] = me->orphans[--me->norphans];
      return;
    }
}

/* me->lock held, after a renewal the directory answered: deletes the orphans it can. */
static void orphans_retry(fr_dir_self *me, int timeout_ms) {
  for (size_t i = 0; i < me->norphans;) {
    const fr_dir_object *o = &me->orphans[i];
    int rc = fr_dir_obj_del(me->dir, o->key, o->owner, o->generation, NULL, timeout_ms);
    if (rc != 0 && rc != FERRY_ENOTFOUND) {
      fr_err_clear();
      return; /* the directory is away again: the next renewal tries */
    }
    me->orphans[i] = me->orphans[--me->norphans];
  }
}

void fr_dir_lease_orphan(fr_dir_lease *l, const fr_dir_object *recs, size_t n) {
  fr_dir_self *me = l->self;
  if (!me || n == 0)
    return;
  pthread_mutex_lock(&me->lock); /* once: a renewal may hold it while it waits on the directory */
  for (size_t i = 0; i < n; i++)
    orphan_add(me, &recs[i]);
  pthread_mutex_unlock(&me->lock);
}

/* me->lock held. The node registered, not lost, with the record its jobs want; renewed first when
 * `renew` (its renewal is due) or when its record changes (a put of a lapsed node's incarnation
 * would bring it back without its records: the renewal finds out). */
static int ensure_node(fr_dir_self *me, const fr_dir_lease *l, bool renew, int timeout_ms) {
  fr_dir_node want;
  int lease_ms;
  wanted(me, &want, &lease_ms);
  bool same = same_record(me, &want, lease_ms);
  bool current = me->held && fr_dir_epoch(me->dir) == me->epoch;
  int rc = 0;
  if (current && (renew || !same)) {
    rc = renew_node(me, timeout_ms);
    if (rc == FERRY_ENOTFOUND) {
      fr_info("%s: the directory lost node '%s'; registering it again", l->who, me->node.name);
      fr_err_clear();
      current = false;
      rc = 0;
    }
  } else if (me->held && !current) {
    fr_info("%s: the directory at %s may have lost node '%s'; registering it again", l->who,
            me->dir->url, me->node.name);
  }
  if (rc == 0 && !current)
    return register_node(me, l, &want, lease_ms, timeout_ms);
  if (rc == 0 && !same &&
      (rc = me->dir->ops->node_put(me->dir->state, &want, lease_ms, 0, NULL, timeout_ms)) == 0) {
    set_record(me, &want, lease_ms);
  }
  if (rc == 0 && renew && me->norphans)
    orphans_retry(me, timeout_ms);
  if (rc != 0 || renew || !same) /* it asked the directory: the next renewal is a third on */
    schedule(me, rc == 0);
  return rc;
}

/* me->lock held. The job's name is another node's: free when that node is gone or verifiably
 * dead (it is dropped, with its records), else FERRY_EEXIST naming it. */
static int job_holder_gone(fr_dir_self *me, const fr_dir_lease *l, int timeout_ms) {
  const char *k = l->key;
  fr_dir_object o;
  fr_dir_node h;
  int st = 0;
  int rc = fr_dir_obj_get(me->dir, &k, 1, &o, &st, timeout_ms);
  if (rc != 0 || st != 0)
    return rc; /* gone meanwhile: put again */
  rc = fr_dir_node_get(me->dir, o.owner, &h, timeout_ms);
  if (rc == FERRY_ENOTFOUND) { /* its node left (the record goes with it) */
    fr_err_clear();
    rc = fr_dir_obj_del(me->dir, l->key, o.owner, o.generation, NULL, timeout_ms);
    return rc == FERRY_ENOTFOUND ? (fr_err_clear(), 0) : rc;
  }
  if (rc != 0)
    return rc;
  if (!holder_dead(me->ctx, &h, timeout_ms))
    return fr_err(FERRY_EEXIST,
                  "%s: the name '%s' is held by the live node '%s' at %s; give this one another "
                  "name or stop the other one",
                  l->who, l->job, h.name, h.address);
  fr_info("%s: the node '%s' that held '%s' at %s is dead; taking the name over", l->who, h.name,
          l->job, h.address);
  return me->dir->ops->node_del(me->dir->state, h.name, h.incarnation, timeout_ms);
}

/* me->lock held. Publishes the job record (taking the name over from a dead holder). */
static int publish_job(fr_dir_self *me, fr_dir_lease *l, int timeout_ms) {
  fr_dir_object o;
  job_record(l, &o);
  orphan_forget(me, o.key);
  int rc = fr_dir_obj_put(me->dir, &o, FR_DIR_PUT_KEEP_OTHERS, NULL, NULL, timeout_ms);
  if (rc == FERRY_EEXIST && (rc = job_holder_gone(me, l, timeout_ms)) == 0) {
    rc = fr_dir_obj_put(me->dir, &o, FR_DIR_PUT_KEEP_OTHERS, NULL, NULL, timeout_ms);
    if (rc == FERRY_EEXIST)
      rc = fr_err_wrap(rc, "%s: the name '%s' was taken meanwhile", l->who, l->job);
  }
  if (rc == 0) {
    __atomic_store_n(&l->held, true, __ATOMIC_RELEASE);
    __atomic_store_n(&l->want, false, __ATOMIC_RELEASE);
    __atomic_store_n(&l->seen, __atomic_load_n(&me->taken, __ATOMIC_ACQUIRE), __ATOMIC_RELEASE);
  } else {
    __atomic_store_n(&l->held, false, __ATOMIC_RELEASE);
    __atomic_store_n(&l->want, true, __ATOMIC_RELEASE);
  }
  return rc;
}

/* ---- the jobs ---- */

int fr_dir_lease_init(fr_dir_lease *l, fr_dir *dir, ferry_ctx *ctx, const char *kind,
                      const char *name, const char *who) {
  memset(l, 0, sizeof *l);
  l->dir = dir;
  l->ctx = ctx;
  fr_str_copy(l->who, sizeof l->who, who);
  fr_str_copy(l->job, sizeof l->job, name);
  l->lease_ms = (int)fr_config_int("FERRY_LEASE_MS");
  int rc = fr_dir_job_key(kind, name, l->key);
  if (rc != 0)
    return rc; /* its detail names the kind and the name already */
  if (!(l->self = self_of(dir, ctx)))
    return fr_err(FERRY_ENOMEM, "%s: directory node", who);
  fr_str_copy(l->node.name, sizeof l->node.name, l->self->node.name);
  fr_str_copy(l->node.address, sizeof l->node.address, l->self->node.address);
  l->node.incarnation = l->self->node.incarnation;
  return 0;
}

static void join(fr_dir_self *me, fr_dir_lease *l) {
  if (!l->in_node) {
    l->next = me->members;
    me->members = l;
    l->in_node = true;
  }
}

static void leave(fr_dir_self *me, fr_dir_lease *l) {
  for (fr_dir_lease **p = &me->members; l->in_node && *p; p = &(*p)->next)
    if (*p == l) {
      *p = l->next;
      l->in_node = false;
      break; /* *p may be NULL now: the step would read through it */
    }
}

/* Takes me->lock for `busy`, waiting no later than the deadline: a renewal (or another job's
 * registration) may hold it while it waits on a directory that does not answer. */
static int lock_until(fr_dir_self *me, const fr_dir_lease *l, const char *busy, uint64_t deadline,
                      int timeout_ms) {
  if (fr_mutex_lock_until(&me->lock, deadline) != 0) {
    const char *by = __atomic_load_n(&me->busy, __ATOMIC_ACQUIRE);
    return fr_err(FERRY_ETIMEDOUT,
                  "%s: timed out after %d ms waiting for the directory at %s behind %s of node "
                  "'%s'",
                  l->who, timeout_ms, me->dir->url, by ? by : "another job's call", me->node.name);
  }
  __atomic_store_n(&me->busy, busy, __ATOMIC_RELEASE);
  return 0;
}

static void unlock(fr_dir_self *me) {
  __atomic_store_n(&me->busy, NULL, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&me->lock);
}

/* me->lock held. Whether m's records must be published (again): its own call asked
 * (fr_dir_lease_lost), or the node was registered again since they were. */
static bool stale(const fr_dir_self *me, const fr_dir_lease *m) {
  return __atomic_load_n(&m->want, __ATOMIC_ACQUIRE) || !m->held ||
         __atomic_load_n(&m->seen, __ATOMIC_ACQUIRE) !=
             __atomic_load_n(&me->taken, __ATOMIC_ACQUIRE);
}

/* me->lock held. The timer fires at the node's next renewal, or sooner for a job whose records
 * wait to be published (at once, or after a failed try when the retry is due). */
static void rearm(fr_dir_self *me) {
  uint64_t at = __atomic_load_n(&me->next_renew_ns, __ATOMIC_ACQUIRE);
  for (const fr_dir_lease *m = me->members; m; m = m->next)
    if (stale(me, m) && me->retry_ns < at)
      at = me->retry_ns;
  fr_timer_arm(&me->timer, at);
}

int fr_dir_lease_take(fr_dir_lease *l, int timeout_ms) {
  fr_dir_self *me = l->self;
  if (!me)
    return fr_err(FERRY_EINVAL, "%s: not attached to a directory", l->who);
  timeout_ms = fr_timeout(timeout_ms);
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  int rc = lock_until(me, l, "a registration", deadline, timeout_ms);
  if (rc != 0)
    return rc;
  join(me, l);
  int left = fr_ms_left(deadline) > 0 ? fr_ms_left(deadline) : 1;
  rc = ensure_node(me, l, false, left);
  if (rc == 0)
    rc = publish_job(me, l, fr_ms_left(deadline) > 0 ? fr_ms_left(deadline) : 1);
  if (rc == 0)
    fr_info("%s: joined the directory at %s as node '%s' (%s; lease %d ms)", l->who, me->dir->url,
            me->node.name, me->node.address, me->lease_ms);
  else
    __atomic_store_n(&l->want, true, __ATOMIC_RELEASE);
  rearm(me); /* a registration moved `taken`: the other jobs publish again at once */
  unlock(me);
  return rc;
}

void fr_dir_lease_set_republish(fr_dir_lease *l, int (*republish)(void *arg, int timeout_ms),
                                void *arg) {
  fr_dir_self *me = l->self;
  if (!me)
    return;
  pthread_mutex_lock(&me->lock);
  while (me->calling == l) /* clearing it waits for a call under way */
    pthread_cond_wait(&me->returned, &me->lock);
  l->republish = republish;
  l->republish_arg = arg;
  pthread_mutex_unlock(&me->lock);
}

bool fr_dir_lease_current(const fr_dir_lease *l) {
  const fr_dir_self *me = l->self;
  if (!me)
    return false;
  /* without the lock: a store's every put asks, and a renewal may hold the lock a while */
  return __atomic_load_n(&l->held, __ATOMIC_ACQUIRE) &&
         __atomic_load_n(&me->held, __ATOMIC_ACQUIRE) &&
         !__atomic_load_n(&l->want, __ATOMIC_ACQUIRE) &&
         __atomic_load_n(&l->seen, __ATOMIC_ACQUIRE) ==
             __atomic_load_n(&me->taken, __ATOMIC_ACQUIRE) &&
         fr_dir_epoch(me->dir) == __atomic_load_n(&me->epoch, __ATOMIC_ACQUIRE);
}

bool fr_dir_lease_ok(const fr_dir_lease *l) {
  const fr_dir_self *me = l->self;
  return me && __atomic_load_n(&me->ok, __ATOMIC_RELAXED) &&
         !__atomic_load_n(&l->want, __ATOMIC_ACQUIRE) &&
         __atomic_load_n(&l->seen, __ATOMIC_ACQUIRE) ==
             __atomic_load_n(&me->taken, __ATOMIC_ACQUIRE);
}

int fr_dir_lease_ready(const fr_dir_lease *l, char *why, size_t len) {
  if (fr_dir_lease_ok(l))
    return 0;
  if (why && len)
    snprintf(why, len,
             "%s: its directory lease is not held (the directory did not answer its last "
             "renewal, or the node is registering again)",
             l->who);
  return FERRY_ECONNECT;
}

void fr_dir_lease_lost(fr_dir_lease *l) {
  __atomic_store_n(&l->want, true, __ATOMIC_RELEASE);
  if (l->self) /* the timer publishes them again now */
    fr_timer_arm(&l->self->timer, fr_now_ns());
}

/* ---- the node's timer ---- */

/* me->lock held on entry and return. Calls what each job marked `republishing` registered to
 * publish again, one at a time and without the node's lock (a store's takes its publish_lock,
 * which its puts take before the node's); a job leaving meanwhile waits for its call to return
 * (`calling`). Says whether one failed (that job is marked to publish again). */
static bool republish_members(fr_dir_self *me, int timeout_ms) {
  bool failed = false;
  for (;;) {
    fr_dir_lease *m = me->members;
    while (m && !m->republishing)
      m = m->next;
    if (!m)
      return failed;
    m->republishing = false;
    me->calling = m;
    unlock(me);
    int rc = m->republish(m->republish_arg, timeout_ms);
    if (rc != 0)
      fr_warn("%s: publishing its records again failed: %s", m->who, ferry_last_error());
    pthread_mutex_lock(&me->lock);
    __atomic_store_n(&me->busy, "a lease renewal", __ATOMIC_RELEASE);
    if (rc != 0) {
      __atomic_store_n(&m->want, true, __ATOMIC_RELEASE);
      failed = true;
    }
    me->calling = NULL;
    pthread_cond_broadcast(&me->returned);
  }
}

/* The node's timer, on a worker of the task pool: renews the node when due (one request for all
 * its jobs), registers it again when the directory lost it, publishes again the job records that
 * went with it and calls each job's republish for the rest; then arms itself for the next
 * renewal (soon after a failure: RETRY_PER_LEASE tries fit in the third of the lease left). */
static void tick(void *arg) {
  fr_dir_self *me = arg;
  pthread_mutex_lock(&me->lock);
  __atomic_store_n(&me->busy, "a lease renewal", __ATOMIC_RELEASE);
  fr_dir_lease *l = me->members; /* the one whose name the messages give */
  if (!l) { /* the last job left: nothing to renew until one attaches (its take arms it) */
    unlock(me);
    return;
  }
  int timeout = me->lease_ms / 3 > 100 ? me->lease_ms / 3 : 100;
  bool due = !me->held || fr_now_ns() >= __atomic_load_n(&me->next_renew_ns, __ATOMIC_ACQUIRE);
  int rc = ensure_node(me, l, due, timeout);
  bool failed = rc != 0;
  if (rc != 0) /* retried every 200 ms while the directory is away */
    fr_warn_limited("%s: renewing node '%s' in the directory failed: %s", l->who, me->node.name,
                    ferry_last_error());
  for (fr_dir_lease *m = me->members; rc == 0 && m; m = m->next) {
    if (!stale(me, m))
      continue;
    if (publish_job(me, m, timeout) == 0) {
      m->republishing = m->republish != NULL; /* then the rest of its records */
    } else {
      fr_warn_limited("%s: publishing its job record again failed: %s", m->who, ferry_last_error());
      failed = true;
    }
  }
  failed |= republish_members(me, timeout);
  uint64_t retry = (uint64_t)me->lease_ms * 1000000ull / 3 / RETRY_PER_LEASE;
  me->retry_ns = failed ? fr_now_ns() + retry : 0;
  rearm(me);
  unlock(me);
}

bool fr_dir_lease_alone(const fr_dir_lease *l) {
  fr_dir_self *me = l->self;
  if (!me)
    return true;
  pthread_mutex_lock(&me->lock);
  bool alone = !me->members || (me->members == l && !l->next);
  pthread_mutex_unlock(&me->lock);
  return alone;
}

/* me->lock held; l has left. The node goes with its last job; else only l's record, and the node
 * record drops what l added to it (best effort: the lease's next renewal fixes nothing, but a
 * reader only loses a shortcut). */
static void detach(fr_dir_self *me, fr_dir_lease *l) {
  const fr_dir_ops *ops = me->dir->ops;
  int rc = 0;
  if (!me->members) {
    if (me->held)
      rc = ops->node_del(me->dir->state, me->node.name, me->node.incarnation, 2000);
    __atomic_store_n(&me->held, false, __ATOMIC_RELEASE);
    __atomic_store_n(&me->ok, false, __ATOMIC_RELAXED);
  } else if (l->held) {
    rc = fr_dir_obj_del(me->dir, l->key, me->node.name, me->node.incarnation, NULL, 2000);
    if (rc == FERRY_ENOTFOUND)
      rc = 0;
    if (rc != 0) { /* else the job's name stays taken while the node lives */
      fr_dir_object o = {.generation = me->node.incarnation};
      fr_str_copy(o.key, sizeof o.key, l->key);
      fr_str_copy(o.owner, sizeof o.owner, me->node.name);
      orphan_add(me, &o);
    }
    fr_dir_node want;
    int lease_ms;
    wanted(me, &want, &lease_ms);
    if (rc == 0 && me->held && !same_record(me, &want, lease_ms) &&
        ops->node_put(me->dir->state, &want, lease_ms, 0, NULL, 2000) == 0) {
      set_record(me, &want, lease_ms);
    }
  }
  if (rc == 0)
    fr_info("%s: left the directory at %s", l->who, me->dir->url);
  else /* not worth a warning: a directory that is gone has dropped the records already */
    fr_info("%s: left without telling the directory at %s (%s); its record goes at the node's "
            "next renewal, or when its lease of %d ms lapses",
            l->who, me->dir->url, ferry_last_error(), me->lease_ms);
}

void fr_dir_lease_drop(fr_dir_lease *l) {
  fr_dir_self *me = l->self;
  if (!me)
    return;
  /* closing does not fail, nor touch the caller's error (a failed open drops, then reports) */
  fr_err_keep kept;
  fr_err_save(&kept, 0);
  pthread_mutex_lock(&me->lock);
  while (me->calling == l) /* the timer publishes its records: they go after it returned */
    pthread_cond_wait(&me->returned, &me->lock);
  __atomic_store_n(&me->busy, "a job leaving", __ATOMIC_RELEASE);
  bool was = l->in_node;
  leave(me, l);
  if (was && (l->held || !me->members))
    detach(me, l);
  __atomic_store_n(&l->held, false, __ATOMIC_RELEASE);
  unlock(me);
  fr_err_restore(&kept);
}
