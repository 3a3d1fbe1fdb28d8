/*
 * How publishers and subscribers find each other, through the fleet's directory.
 *
 * Each mq attaches to its context's node (named as the context, directory.h: one node per
 * process and directory) with a job record "ferry:job/mq/<ctx name>", and puts one object record
 * per role
 * and topic: "ferry:mq/s/<len>:<topic>/<node>" for a subscription, "ferry:mq/p/..." for a
 * publisher (the length prefix keeps topics that contain '/' apart in prefix scans). A
 * subscriber records itself, then asks every publisher it finds to add it (SUB, a call, so when
 * subscribe returns those publishers know it); a publisher records itself, then adds every
 * subscriber it finds. Each writes before it reads, so of a publisher and a subscriber that
 * arrive together at least one sees the other. A node that dies loses its records when its lease
 * lapses; until then a publisher that finds its record fails to dial it and skips it.
 *
 * Per remote subscriber a publisher keeps one peer (its link, credit, pool blocks it holds);
 * topics list peers. A peer is dropped (and its pool blocks freed) when it leaves (BYE), when
 * its link dies, or when a send to it fails.
 */
#include "mq/mq.h"
#include "core/channels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void fr_mq_key(char *buf, size_t cap, char role, const char *topic, const char *node) {
  snprintf(buf, cap, FR_DIR_RESERVED "mq/%c/%zu:%s/%s", role, strlen(topic), topic, node);
}

/* ---- the directory: this node's records ---- */

static void record_for(ferry_mq *mq, fr_dir_object *o, char role, const char *topic) {
  memset(o, 0, sizeof *o);
  fr_mq_key(o->key, sizeof o->key, role, topic, mq->name);
  fr_str_copy(o->owner, sizeof o->owner, mq->lease.node.name);
  o->region.size = mq->window; /* what a publisher may queue here before it waits */
  o->gen_region.size = 8;
  o->generation = mq->lease.node.incarnation;
  o->desc = (ferry_tensor_desc){.dtype = FERRY_DTYPE_U8, .ndim = 1};
}

static int put_record(ferry_mq *mq, char role, const char *topic, int timeout_ms) {
  fr_dir_object o;
  record_for(mq, &o, role, topic);
  return fr_dir_obj_put(mq->dir, &o, 0, NULL, NULL, timeout_ms);
}

static void del_record(ferry_mq *mq, char role, const char *topic, int timeout_ms) {
  fr_dir_object o;
  record_for(mq, &o, role, topic);
  if (fr_dir_obj_del(mq->dir, o.key, o.owner, o.generation, NULL, timeout_ms) != 0)
    fr_err_clear(); /* gone already, or goes when the node's lease lapses */
}

/* The records of every topic this node subscribes to or advertises: put again (the directory lost
 * them), or deleted (the mq leaves, its node stays). */
static int records(ferry_mq *mq, bool put, int timeout_ms) {
  pthread_mutex_lock(&mq->lock);
  size_t n = mq->nsubscribed, m = 0;
  for (fr_mq_topic *t = mq->topics; t; t = t->next)
    m += t->advertised;
  char **names = calloc(n + m + 1, sizeof *names);
  char *roles = calloc(n + m + 1, 1);
  size_t k = 0;
  for (size_t i = 0; names && roles && i < n; i++, k++)
    names[k] = strdup(mq->subscribed[i]), roles[k] = 's';
  for (fr_mq_topic *t = mq->topics; names && roles && t; t = t->next)
    if (t->advertised)
      names[k] = strdup(t->name), roles[k++] = 'p';
  pthread_mutex_unlock(&mq->lock);
  int rc = names && roles ? 0 : fr_err(FERRY_ENOMEM, "mq: re-registration");
  for (size_t i = 0; i < k; i++) {
    if (rc == 0 && put)
      rc = names[i] ? put_record(mq, roles[i], names[i], timeout_ms)
                    : fr_err(FERRY_ENOMEM, "mq: re-registration");
    else if (names[i])
      del_record(mq, roles[i], names[i], timeout_ms);
    free(names[i]);
  }
  free(names);
  free(roles);
  return rc;
}

/* Registers this node (taking its name over from a dead holder); unless `fresh`, publishes
 * every record again (the directory lost them). */
int fr_mq_register(ferry_mq *mq, bool fresh, int timeout_ms) {
  int rc = fr_dir_lease_take(&mq->lease, timeout_ms);
  if (rc == 0 && !fresh && (rc = records(mq, true, timeout_ms)) != 0)
    fr_dir_lease_lost(&mq->lease);
  return rc;
}

void fr_mq_unregister(ferry_mq *mq) {
  if (!fr_dir_lease_alone(&mq->lease)) /* the node stays (the context's store or refit) */
    records(mq, false, 2000);
  fr_dir_lease_drop(&mq->lease);
}

/* mq's republish (fr_dir_lease_set_republish): the node's timer calls it, on a worker of the
 * task pool, after the directory lost the node with its records; a failure is tried again. */
static int republish(void *arg, int timeout_ms) { return records(arg, true, timeout_ms); }

void fr_mq_republish_by_timer(ferry_mq *mq, bool on) {
  fr_dir_lease_set_republish(&mq->lease, on ? republish : NULL, on ? mq : NULL);
}

/* ---- links to other mq nodes ---- */

/* A link to node `name` (a reference the caller releases): one this mq already has (dialled, or
 * one the node dialled us on), else one from the peer cache (directory/peers.c: dialled at the
 * address the directory gives for node <name>, the mq's context). */
static int dial(ferry_mq *mq, const char *name, int timeout_ms, ferry_link **out) {
  pthread_mutex_lock(&mq->lock);
  for (size_t i = 0; i < mq->nlinks; i++) {
    ferry_link *l = mq->links[i].link;
    if (ferry_link_status(l) == 0 && strcmp(ferry_link_peer(l), name) == 0) {
      *out = ferry_link_retain(l);
      pthread_mutex_unlock(&mq->lock);
      return 0;
    }
  }
  pthread_mutex_unlock(&mq->lock);
  fr_peer *p = NULL;
  int rc = fr_peer_acquire(&mq->dialled, name, timeout_ms, &p);
  if (rc != 0)
    return fr_err_wrap(rc, "mq: cannot reach '%s'", name);
  ferry_link *l = ferry_link_retain(p->link);
  fr_peer_release(&mq->dialled, p, false);
  pthread_mutex_lock(&mq->lock);
  fr_mq_keep_link(mq, l);
  pthread_mutex_unlock(&mq->lock);
  *out = l;
  return 0;
}

/* ---- publisher side: topics and peers ---- */

fr_mq_topic *fr_mq_topic_get(ferry_mq *mq, const char *topic) {
  for (fr_mq_topic *t = mq->topics; t; t = t->next)
    if (strcmp(t->name, topic) == 0)
      return t;
  fr_mq_topic *t = calloc(1, sizeof *t);
  if (!t || !(t->name = strdup(topic))) {
    free(t);
    return NULL;
  }
  t->next = mq->topics;
  mq->topics = t;
  return t;
}

static fr_mq_peer *peer_find(ferry_mq *mq, const char *name) {
  for (fr_mq_peer *p = mq->peers; p; p = p->next)
    if (strcmp(p->name, name) == 0)
      return p;
  return NULL;
}

fr_mq_peer *fr_mq_peer_by_link(ferry_mq *mq, ferry_link *l) {
  for (fr_mq_peer *p = mq->peers; p; p = p->next)
    if (p->link == l)
      return p;
  return NULL;
}

void fr_mq_peer_unref(ferry_mq *mq, fr_mq_peer *p) {
  if (--p->refs > 0)
    return;
  ferry_link_release(p->link);
  free(p->tokens);
  free(p->batch);
  free(p);
}

/* A topic's subscribers changed (lock held): what publishes in a stream remembered is stale. */
static void subs_changed(ferry_mq *mq) {
  __atomic_store_n(&mq->subs_gen, mq->subs_gen + 1, __ATOMIC_RELEASE);
}

static bool topic_remove(fr_mq_topic *t, fr_mq_peer *p) {
  for (size_t i = 0; i < t->nsubs; i++)
    if (t->subs[i] == p) {
      t->subs[i] = t->subs[--t->nsubs];
      return true;
    }
  return false;
}

void fr_mq_peer_drop(ferry_mq *mq, fr_mq_peer *p, const char *why) {
  if (why)
    fr_warn("mq '%s': subscriber '%s' dropped: %s", mq->name, p->name, why);
  p->dead = true;
  for (size_t i = 0; i < p->ntokens; i++)
    fr_mq_pool_release(mq, p->tokens[i]);
  p->ntokens = 0;
  for (fr_mq_peer **pp = &mq->peers; *pp; pp = &(*pp)->next)
    if (*pp == p) {
      *pp = p->next;
      p->next = NULL;
      break;
    }
  for (fr_mq_topic *t = mq->topics; t; t = t->next)
    if (topic_remove(t, p))
      fr_mq_peer_unref(mq, p);
  subs_changed(mq);
  fr_mq_changed(mq);
  fr_mq_peer_unref(mq, p); /* the list's */
}

/* The live peer for `name`, created on `l` when there is none (lock held). */
static fr_mq_peer *peer_for(ferry_mq *mq, const char *name, ferry_link *l, uint64_t window) {
  fr_mq_peer *p = peer_find(mq, name);
  if (p && ferry_link_status(p->link) != 0)
    fr_mq_peer_drop(mq, p, "its link closed");
  else if (p)
    return p;
  p = calloc(1, sizeof *p);
  if (!p)
    return NULL;
  fr_str_copy(p->name, sizeof p->name, name);
  p->link = ferry_link_retain(l);
  p->window = window < 4096 ? 4096 : window;
  p->refs = 1;
  p->next = mq->peers;
  mq->peers = p;
  return p;
}

int fr_mq_add_subscriber(ferry_mq *mq, const char *topic, const char *name, ferry_link *link,
                         uint64_t window, int timeout_ms) {
  ferry_link *l = NULL;
  if (link)
    l = ferry_link_retain(link);
  else if (dial(mq, name, timeout_ms, &l) != 0)
    return fr_err_wrap(FERRY_ECONNECT, "mq: subscriber '%s' of '%s'", name, topic);
  pthread_mutex_lock(&mq->lock);
  if (link)
    fr_mq_keep_link(mq, link);
  fr_mq_peer *p = peer_for(mq, name, l, window);
  fr_mq_topic *t = p ? fr_mq_topic_get(mq, topic) : NULL;
  int rc = t ? 0 : fr_err(FERRY_ENOMEM, "mq: subscriber '%s'", name);
  bool listed = false;
  for (size_t i = 0; t && i < t->nsubs; i++)
    listed |= t->subs[i] == p;
  if (t && !listed && FR_GROW(t->subs, t->capsubs, t->nsubs + 1, 4) != 0)
    rc = fr_err(FERRY_ENOMEM, "mq: subscriber '%s'", name);
  if (rc == 0 && !listed) {
    t->subs[t->nsubs++] = p;
    p->refs++;
    subs_changed(mq);
    fr_debug("mq '%s': '%s' subscribes to '%s'", mq->name, name, topic);
  }
  fr_mq_changed(mq);
  pthread_mutex_unlock(&mq->lock);
  ferry_link_release(l);
  return rc;
}

void fr_mq_remove_subscriber(ferry_mq *mq, const char *topic, const char *name) {
  pthread_mutex_lock(&mq->lock);
  fr_mq_peer *p = peer_find(mq, name);
  for (fr_mq_topic *t = mq->topics; p && t; t = t->next)
    if (strcmp(t->name, topic) == 0 && topic_remove(t, p))
      fr_mq_peer_unref(mq, p);
  subs_changed(mq);
  fr_mq_changed(mq);
  pthread_mutex_unlock(&mq->lock);
}

/* The node names of a topic's records of one role, except this node's. *out is malloc'd. */
static int scan(ferry_mq *mq, char role, const char *topic, fr_dir_object **out, size_t *n,
                int timeout_ms) {
  char prefix[FR_DIR_KEY_MAX + 1];
  fr_mq_key(prefix, sizeof prefix, role, topic, "");
  int rc = fr_dir_obj_scan(mq->dir, prefix, out, n, timeout_ms);
  if (rc != 0)
    return fr_err_wrap(rc, "mq: looking up topic '%s'", topic);
  size_t k = 0;
  for (size_t i = 0; i < *n; i++) {
    const char *node = (*out)[i].owner; /* an mq's node is named as the mq (its ctx) */
    if (strcmp(node, mq->name) != 0) {
      memmove((*out)[i].key, node, strlen(node) + 1);
      (*out)[k++] = (*out)[i];
    }
  }
  *n = k;
  return 0;
}

int fr_mq_advertise(ferry_mq *mq, const char *topic, int timeout_ms) {
  pthread_mutex_lock(&mq->lock);
  fr_mq_topic *t = fr_mq_topic_get(mq, topic);
  bool done = t && t->advertised;
  pthread_mutex_unlock(&mq->lock);
  if (!t)
    return fr_err(FERRY_ENOMEM, "mq: topic '%s'", topic);
  if (done)
    return 0;
  int rc = put_record(mq, 'p', topic, timeout_ms);
  fr_dir_object *subs = NULL;
  size_t n = 0;
  if (rc == 0)
    rc = scan(mq, 's', topic, &subs, &n, timeout_ms);
  for (size_t i = 0; rc == 0 && i < n; i++)
    if (fr_mq_add_subscriber(mq, topic, subs[i].key, NULL, subs[i].region.size, timeout_ms) != 0)
      fr_info_limited("mq '%s': skipping subscriber '%s' of '%s': %s", mq->name, subs[i].key, topic,
                      ferry_last_error());
  free(subs);
  if (rc != 0)
    return fr_err_wrap(rc, "mq: advertising '%s'", topic);
  pthread_mutex_lock(&mq->lock);
  t->advertised = true;
  pthread_mutex_unlock(&mq->lock);
  return 0;
}

/* ---- subscriber side ---- */

static int send_sub(ferry_mq *mq, const char *publisher, uint8_t type, const char *topic,
                    int timeout_ms) {
  ferry_link *l = NULL;
  int rc = dial(mq, publisher, timeout_ms, &l);
  if (rc != 0)
    return rc;
  fr_mq_frame f = {.type = type, .topic = topic, .topic_len = strlen(topic), .value = mq->window};
  uint8_t head[FR_MQ_HEAD_MAX];
  struct iovec iov = {head, fr_mq_encode(&f, head)};
  if (type == FR_MQ_UNSUB) {
    rc = ferry_send(l, FR_CHANNEL_MQ, &iov, 1, timeout_ms);
    ferry_link_release(l);
    return rc;
  }
  ferry_msg *reply = NULL;
  rc = ferry_call(l, FR_CHANNEL_MQ, &iov, 1, &reply, timeout_ms);
  ferry_link_release(l);
  if (rc == 0 && reply->len != 4)
    rc = fr_err(FERRY_EPROTO, "mq: malformed answer from '%s'", publisher);
  else if (rc == 0) {
    const uint8_t *b = reply->data;
    rc = (int)((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24);
    if (rc != 0)
      rc = fr_err(rc, "mq: '%s' refused the subscription: %s", publisher, ferry_strerror(rc));
  }
  ferry_msg_free(reply);
  return rc;
}

/* Tells every publisher of topic (SUB or UNSUB); failures are logged, not returned. */
static void tell_publishers(ferry_mq *mq, uint8_t type, const char *topic, uint64_t deadline) {
  fr_dir_object *pubs = NULL;
  size_t n = 0;
  if (scan(mq, 'p', topic, &pubs, &n, fr_ms_left(deadline) + 1) != 0) {
    fr_warn("mq '%s': %s", mq->name, ferry_last_error());
    return;
  }
  for (size_t i = 0; i < n; i++)
    if (send_sub(mq, pubs[i].key, type, topic, fr_ms_left(deadline) + 1) != 0)
      fr_info_limited("mq '%s': publisher '%s' of '%s' not told: %s", mq->name, pubs[i].key, topic,
                      ferry_last_error());
  free(pubs);
}

bool fr_mq_subscribed(ferry_mq *mq, const char *topic) {
  for (size_t i = 0; i < mq->nsubscribed; i++)
    if (strcmp(mq->subscribed[i], topic) == 0)
      return true;
  return false;
}

static int add_subscription(ferry_mq *mq, const char *topic) {
  if (fr_mq_subscribed(mq, topic))
    return 1;
  if (FR_GROW(mq->subscribed, mq->capsubscribed, mq->nsubscribed + 1, 8) != 0)
    return fr_err(FERRY_ENOMEM, "mq: subscribe");
  if (!(mq->subscribed[mq->nsubscribed] = strdup(topic)))
    return fr_err(FERRY_ENOMEM, "mq: subscribe");
  mq->nsubscribed++;
  return 0;
}

static bool drop_subscription(ferry_mq *mq, const char *topic) {
  for (size_t i = 0; i < mq->nsubscribed; i++)
    if (strcmp(mq->subscribed[i], topic) == 0) {
      free(mq->subscribed[i]);
      mq->subscribed[i] = mq->subscribed[--mq->nsubscribed];
      return true;
    }
  return false;
}

int ferry_mq_subscribe(ferry_mq *mq, const char *topic, int timeout_ms) {
  if (!mq)
    return fr_err(FERRY_EINVAL, "ferry_mq_subscribe: NULL mq");
  int rc = fr_mq_topic_check(topic);
  if (rc != 0)
    return rc;
  uint64_t deadline = fr_deadline_ns(fr_timeout(timeout_ms));
  pthread_mutex_lock(&mq->lock);
  rc = add_subscription(mq, topic);
  pthread_mutex_unlock(&mq->lock);
  if (rc != 0)
    return rc < 0 ? rc : 0;
  if ((rc = put_record(mq, 's', topic, fr_ms_left(deadline) + 1)) != 0) {
    fr_err_keep keep;
    fr_err_save(&keep, rc);
    pthread_mutex_lock(&mq->lock);
    drop_subscription(mq, topic);
    pthread_mutex_unlock(&mq->lock);
    return fr_err_wrap(fr_err_restore(&keep), "subscribe '%s'", topic);
  }
  tell_publishers(mq, FR_MQ_SUB, topic, deadline);
  return 0;
}

int ferry_mq_unsubscribe(ferry_mq *mq, const char *topic, int timeout_ms) {
  if (!mq)
    return fr_err(FERRY_EINVAL, "ferry_mq_unsubscribe: NULL mq");
  int rc = fr_mq_topic_check(topic);
  if (rc != 0)
    return rc;
  uint64_t deadline = fr_deadline_ns(fr_timeout(timeout_ms));
  pthread_mutex_lock(&mq->lock);
  bool was = drop_subscription(mq, topic);
  pthread_mutex_unlock(&mq->lock);
  if (!was)
    return fr_err(FERRY_ENOTFOUND, "unsubscribe: not subscribed to '%s'", topic);
  char key[FR_DIR_KEY_MAX + 1];
  fr_mq_key(key, sizeof key, 's', topic, mq->name);
  rc = fr_dir_obj_del(mq->dir, key, "", 0, NULL, fr_ms_left(deadline) + 1);
  if (rc != 0 && rc != FERRY_ENOTFOUND)
    fr_warn("mq '%s': unsubscribe '%s': %s", mq->name, topic, ferry_last_error());
  tell_publishers(mq, FR_MQ_UNSUB, topic, deadline);
  return 0;
}

/* lock held */
static size_t count_subscribers(ferry_mq *mq, const char *topic) {
  size_t n = 0;
  for (fr_mq_topic *t = mq->topics; t; t = t->next)
    if (strcmp(t->name, topic) == 0)
      for (size_t i = 0; i < t->nsubs; i++)
        n += !t->subs[i]->dead && ferry_link_status(t->subs[i]->link) == 0;
  return n;
}

static bool enough_subscribers(ferry_mq *mq, void *arg) {
  const void **a = arg;
  return count_subscribers(mq, a[0]) >= *(const size_t *)a[1];
}

size_t ferry_mq_subscribers(ferry_mq *mq, const char *topic) {
  if (!mq || !topic)
    return 0;
  pthread_mutex_lock(&mq->lock);
  size_t n = count_subscribers(mq, topic);
  pthread_mutex_unlock(&mq->lock);
  return n;
}

int ferry_mq_wait_subscribers(ferry_mq *mq, const char *topic, size_t n, int timeout_ms) {
  if (!mq)
    return fr_err(FERRY_EINVAL, "ferry_mq_wait_subscribers: NULL mq");
  int rc = fr_mq_topic_check(topic);
  if (rc != 0)
    return rc;
  int ms = fr_timeout(timeout_ms);
  uint64_t deadline = fr_deadline_ns(ms);
  if ((rc = fr_mq_advertise(mq, topic, ms)) != 0)
    return rc;
  const void *arg[2] = {topic, &n};
  fr_mq_flush(mq);
  pthread_mutex_lock(&mq->lock);
  rc = fr_mq_wait(mq, enough_subscribers, arg, deadline);
  size_t have = count_subscribers(mq, topic);
  pthread_mutex_unlock(&mq->lock);
  if (rc == FERRY_ETIMEDOUT)
    return fr_err(rc, "wait_subscribers '%s': %zu of %zu subscribers within %d ms", topic, have, n,
                  ms);
  if (rc == FERRY_ECLOSED)
    return fr_err(rc, "wait_subscribers '%s': mq closing", topic);
  return rc;
}
