/*
 * The fleet snapshot's JSON (fleet.c has the overview): its sections (nodes, the store's keys
 * by prefix, refit senders and their receivers, mq topics, this host's control cells, the
 * limits), from the directory's records and the nodes' metrics. Every string that came from a
 * peer is made valid UTF-8 first.
 */
#include "cli/fleet_impl.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- strings from peers ---- */

/* A JSON string of s with every byte that is not part of valid UTF-8 replaced by U+FFFD (jansson
 * refuses invalid UTF-8, and a peer may send anything). */
static json_t *jstr(const char *s) {
  size_t left = strlen(s);
  char *buf = malloc(left * 3 + 1), *o = buf;
  if (!buf)
    return NULL;
  for (const unsigned char *p = (const unsigned char *)s; *p;) {
    size_t n = *p >= 0x80 ? fr_utf8_seq(p, left) : 1;
    if (n == 0) {
      memcpy(o, "\xef\xbf\xbd", 3), o += 3, n = 1;
    } else {
      memcpy(o, p, n), o += n;
    }
    p += n, left -= n;
  }
  *o = '\0';
  json_t *j = json_string(buf);
  free(buf);
  return j;
}

static void set_str(json_t *obj, const char *key, const char *s) {
  json_object_set_new(obj, key, jstr(s));
}

/* A count or a byte size is written as an integer, a duration as a real. */
static void set_sample(json_t *obj, const char *key, const sample *s) {
  if (!s)
    return;
  bool whole = s->value == (double)(int64_t)s->value && fabs(s->value) < 9007199254740992.0;
  json_object_set_new(obj, key, whole ? json_integer((json_int_t)s->value) : json_real(s->value));
}

static node_stats *stats_of(snap *s, const char *node) {
  for (size_t i = 0; i < s->nnodes; i++)
    if (strcmp(s->nodes[i].name, node) == 0)
      return s->of[i];
  return NULL;
}

/* ---- the sections ---- */

/* The jobs of node `name` (from its job records): an array of {kind, name}, and their kinds,
 * comma-separated, each once ("store,mq,refit"). Whether it has a store: *store. */
static json_t *jobs_of(const snap *s, const char *name, char *kinds, size_t cap, bool *store) {
  json_t *arr = json_array();
  *kinds = '\0';
  *store = false;
  for (size_t i = 0; i < s->njobs; i++) {
    char kind[16], job[FR_DIR_NAME_MAX + 1], with[24];
    if (strcmp(s->jobs[i].owner, name) != 0 || !fr_dir_job_parse(s->jobs[i].key, kind, job))
      continue;
    json_t *j = json_object();
    set_str(j, "kind", kind);
    set_str(j, "name", job);
    json_array_append_new(arr, j);
    *store |= strcmp(kind, "store") == 0;
    snprintf(with, sizeof with, ",%s,", kind);
    char have[FR_DIR_KEY_MAX + 3];
    snprintf(have, sizeof have, ",%s,", kinds);
    size_t n = strlen(kinds);
    if (!strstr(have, with) && n + strlen(kind) + 2 < cap)
      snprintf(kinds + n, cap - n, "%s%s", n ? "," : "", kind);
  }
  return arr;
}

/* "reached", and for a node not reached its error and, when it failed before, since when (the
 * address is then not asked until FLEET_SKIP_MS after its last failure: "skipped"). */
static void set_reached(json_t *o, const node_stats *ns) {
  json_object_set_new(o, "reached", json_boolean(ns->ok));
  if (ns->ok)
    return;
  set_str(o, "error", ns->error);
  if (ns->down_since > 0)
    json_object_set_new(o, "unreachable_since", json_real(ns->down_since));
  json_object_set_new(o, "skipped", json_boolean(ns->skipped));
}

static json_t *nodes_json(snap *s) {
  json_t *arr = json_array();
  for (size_t i = 0; i < s->nnodes; i++) {
    const fr_dir_node *n = &s->nodes[i];
    json_t *o = json_object();
    set_str(o, "name", n->name);
    set_str(o, "address", n->address);
    char kinds[64];
    bool store;
    json_t *jobs = jobs_of(s, n->name, kinds, sizeof kinds, &store);
    set_str(o, "kind", kinds);
    json_object_set_new(o, "jobs", jobs);
    json_object_set_new(o, "holder", json_boolean(n->flags & FR_NODE_HOLDER));
    node_stats *ns = s->of[i];
    set_reached(o, ns);
    if (store && ns->ok) {
      json_t *st = json_object();
      set_sample(st, "objects", fleet_find(&ns->ss, "ferry_store_objects", "store", n->name, 0, 0));
      set_sample(st, "held_bytes",
                 fleet_find(&ns->ss, "ferry_store_held_bytes", "store", n->name, 0, 0));
      set_sample(st, "pool_used_bytes",
                 fleet_find(&ns->ss, "ferry_store_pool_used_bytes", "store", n->name, 0, 0));
      set_sample(st, "pool_capacity_bytes",
                 fleet_find(&ns->ss, "ferry_store_pool_capacity_bytes", "store", n->name, 0, 0));
      json_object_set_new(o, "store", st);
    }
    json_array_append_new(arr, o);
  }
  return arr;
}

/* "ckpt/step1/w" -> "ckpt/"; a key without '/' has the prefix "". */
static size_t prefix_len(const char *key) {
  const char *slash = strchr(key, '/');
  return slash ? (size_t)(slash - key) + 1 : 0;
}

static json_t *key_json(const fr_dir_object *o) {
  json_t *k = json_object();
  set_str(k, "key", o->key);
  json_object_set_new(k, "bytes", json_integer((json_int_t)o->bytes));
  set_str(k, "owner", o->owner);
  const char *dt = ferry_dtype_name(o->desc.dtype);
  set_str(k, "dtype", dt ? dt : "?");
  json_t *shape = json_array();
  for (uint32_t d = 0; d < o->desc.ndim && d < FERRY_MAX_DIMS; d++)
    json_array_append_new(shape, json_integer((json_int_t)o->desc.shape[d]));
  json_object_set_new(k, "shape", shape);
  return k;
}

static void add_owner(json_t *owners, const char *owner) {
  size_t i;
  json_t *e;
  json_array_foreach(owners, i, e) {
    if (strcmp(json_string_value(e), owner) == 0)
      return;
  }
  if (json_array_size(owners) < FLEET_OWNERS_PER_PREFIX)
    json_array_append_new(owners, jstr(owner));
}

/* The user's keys (objs sorted by key, reserved ones skipped), grouped by prefix. */
static json_t *store_json(const fr_dir_object *objs, size_t n) {
  json_t *by = json_object(), *out = json_object();
  uint64_t keys = 0, bytes = 0, prefixes_omitted = 0;
  for (size_t i = 0; i < n; i++) {
    const fr_dir_object *o = &objs[i];
    if (fr_dir_key_reserved(o->key))
      continue;
    keys++, bytes += o->bytes;
    char prefix[FR_DIR_KEY_MAX + 1];
    snprintf(prefix, sizeof prefix, "%.*s", (int)prefix_len(o->key), o->key);
    json_t *tmp = jstr(prefix);
    const char *pkey = json_string_value(tmp); /* as the JSON will spell it */
    json_t *p = pkey ? json_object_get(by, pkey) : NULL;
    if (!p && pkey && json_object_size(by) < FLEET_PREFIXES_MAX) {
      p = json_object();
      set_str(p, "prefix", pkey);
      json_object_set_new(p, "keys", json_integer(0));
      json_object_set_new(p, "bytes", json_integer(0));
      json_object_set_new(p, "owners", json_array());
      json_object_set_new(p, "listed", json_array());
      json_object_set_new(p, "keys_omitted", json_integer(0));
      json_object_set_new(by, pkey, p);
    }
    json_decref(tmp);
    if (!p) {
      prefixes_omitted++;
      continue;
    }
    json_t *listed = json_object_get(p, "listed");
    json_integer_set(json_object_get(p, "keys"),
                     json_integer_value(json_object_get(p, "keys")) + 1);
    json_integer_set(json_object_get(p, "bytes"),
                     json_integer_value(json_object_get(p, "bytes")) + (json_int_t)o->bytes);
    add_owner(json_object_get(p, "owners"), o->owner);
    if (json_array_size(listed) < FLEET_KEYS_PER_PREFIX) {
      json_array_append_new(listed, key_json(o));
    } else {
      json_t *om = json_object_get(p, "keys_omitted");
      json_integer_set(om, json_integer_value(om) + 1);
    }
  }
  json_t *arr = json_array();
  const char *k;
  json_t *p;
  json_object_foreach(by, k, p) { json_array_append(arr, p); }
  json_decref(by);
  json_object_set_new(out, "keys", json_integer((json_int_t)keys));
  json_object_set_new(out, "bytes", json_integer((json_int_t)bytes));
  json_object_set_new(out, "prefixes", arr);
  json_object_set_new(out, "prefixes_omitted", json_integer((json_int_t)prefixes_omitted));
  return out;
}

static json_t *receivers_json(const samples *ss, const char *sender) {
  json_t *arr = json_array();
  for (size_t i = 0; ss && i < ss->n; i++) {
    const sample *c = &ss->s[i];
    const char *snd = fleet_label(c, "sender"), *rcv = fleet_label(c, "receiver");
    if (strcmp(c->name, "ferry_refit_receiver_committed_version") != 0 || !snd || !rcv ||
        strcmp(snd, sender) != 0)
      continue;
    json_t *r = json_object();
    set_str(r, "receiver", rcv);
    json_object_set_new(r, "committed", json_integer((json_int_t)c->value));
    const sample *d =
        fleet_find(ss, "ferry_refit_receiver_dropped", "sender", sender, "receiver", rcv);
    json_object_set_new(r, "dropped", json_boolean(d && d->value != 0));
    set_sample(
        r, "failures",
        fleet_find(ss, "ferry_refit_receiver_failures_total", "sender", sender, "receiver", rcv));
    json_array_append_new(arr, r);
  }
  return arr;
}

static json_t *refit_json(snap *s) {
  json_t *arr = json_array();
  for (size_t i = 0; i < s->njobs; i++) {
    char kind[16], sender[FR_DIR_NAME_MAX + 1];
    if (!fr_dir_job_parse(s->jobs[i].key, kind, sender) || strcmp(kind, "refit") != 0)
      continue;
    const char *node = s->jobs[i].owner;
    node_stats *ns = stats_of(s, node);
    const fr_dir_node *nr = NULL;
    for (size_t k = 0; k < s->nnodes && !nr; k++)
      if (strcmp(s->nodes[k].name, node) == 0)
        nr = &s->nodes[k];
    if (!ns || !nr) /* its node is past FLEET_NODES_MAX, or left between the reads */
      continue;
    json_t *o = json_object();
    set_str(o, "sender", sender);
    set_str(o, "node", node);
    set_str(o, "address", nr->address);
    set_reached(o, ns);
    const samples *ss = ns->ok ? &ns->ss : NULL;
    const sample *ver = fleet_find(ss, "ferry_refit_version", "sender", sender, 0, 0);
    json_object_set_new(o, "version", ver ? json_integer((json_int_t)ver->value) : json_null());
    set_sample(o, "pushes", fleet_find(ss, "ferry_refit_pushes_total", "sender", sender, 0, 0));
    set_sample(o, "last_push_seconds",
               fleet_find(ss, "ferry_refit_last_push_seconds", "sender", sender, 0, 0));
    json_object_set_new(o, "receivers", receivers_json(ss, sender));
    json_array_append_new(arr, o);
  }
  return arr;
}

/* "ferry:mq/<role>/<len>:<topic>/<mq>" (src/mq/discover.c) taken apart; false: not one. */
static bool mq_record(const char *key, char *role, char *topic, size_t cap, const char **mq) {
  const char *p = key + strlen(FR_DIR_RESERVED "mq/");
  if (strncmp(key, FR_DIR_RESERVED "mq/", strlen(FR_DIR_RESERVED "mq/")) != 0 ||
      (p[0] != 'p' && p[0] != 's') || p[1] != '/')
    return false;
  *role = p[0];
  char *end;
  unsigned long len = strtoul(p + 2, &end, 10);
  if (*end != ':' || len >= cap || strlen(end + 1) < len + 1 || end[1 + len] != '/')
    return false;
  memcpy(topic, end + 1, len);
  topic[len] = '\0';
  *mq = end + 2 + len;
  return true;
}

static json_t *mq_member(snap *s, const fr_dir_object *o, char role, const char *topic,
                         const char *mq, json_int_t *depth) {
  json_t *m = json_object();
  set_str(m, "mq", mq);
  set_str(m, "node", o->owner);
  node_stats *ns = stats_of(s, o->owner);
  const samples *ss = ns && ns->ok ? &ns->ss : NULL;
  json_object_set_new(m, "reached", json_boolean(ss != NULL));
  if (role == 'p') {
    set_sample(m, "published",
               fleet_find(ss, "ferry_mq_published_total", "mq", mq, "topic", topic));
    set_sample(m, "subscribers", fleet_find(ss, "ferry_mq_subscribers", "mq", mq, "topic", topic));
  } else {
    set_sample(m, "received", fleet_find(ss, "ferry_mq_received_total", "mq", mq, "topic", topic));
    const sample *q = fleet_find(ss, "ferry_mq_queue_messages", "mq", mq, 0, 0);
    set_sample(m, "queued", q);
    if (q)
      *depth += (json_int_t)q->value;
  }
  return m;
}

static json_t *mq_json(snap *s, const fr_dir_object *recs, size_t n, uint64_t *omitted) {
  json_t *by = json_object();
  for (size_t i = 0; i < n; i++) {
    char role, topic[FR_DIR_KEY_MAX + 1];
    const char *mq;
    if (!mq_record(recs[i].key, &role, topic, sizeof topic, &mq))
      continue;
    json_t *tmp = jstr(topic);
    const char *tkey = json_string_value(tmp);
    json_t *t = tkey ? json_object_get(by, tkey) : NULL;
    if (!t && tkey && json_object_size(by) < FLEET_TOPICS_MAX) {
      t = json_object();
      set_str(t, "topic", tkey);
      json_object_set_new(t, "publishers", json_array());
      json_object_set_new(t, "subscribers", json_array());
      json_object_set_new(t, "depth", json_integer(0));
      json_object_set_new(by, tkey, t);
    }
    json_decref(tmp);
    if (!t) {
      (*omitted)++;
      continue;
    }
    json_int_t depth = 0;
    json_t *m = mq_member(s, &recs[i], role, topic, mq, &depth);
    json_array_append_new(json_object_get(t, role == 'p' ? "publishers" : "subscribers"), m);
    json_t *d = json_object_get(t, "depth");
    json_integer_set(d, json_integer_value(d) + depth);
  }
  json_t *arr = json_array();
  const char *k;
  json_t *t;
  json_object_foreach(by, k, t) { json_array_append(arr, t); }
  json_decref(by);
  return arr;
}

static json_t *cell_json(const char *name) {
  json_t *c = json_object();
  set_str(c, "name", name);
  ferry_ctl *ctl = NULL;
  ferry_ctl_status st = {.size = sizeof st};
  int rc = ferry_ctl_open(name, &ctl);
  if (rc == 0)
    rc = ferry_ctl_status_get(ctl, &st);
  ferry_ctl_close(ctl);
  if (rc != 0) {
    set_str(c, "error", ferry_last_error());
    return c;
  }
  const char *state = ferry_ctl_state_name(st.state), *cmd = ferry_ctl_cmd_name(st.cmd);
  set_str(c, "state", st.engine_alive ? (state ? state : "?") : "STALE");
  set_str(c, "command", st.seq ? (cmd ? cmd : "?") : "");
  json_object_set_new(c, "seq", json_integer((json_int_t)st.seq));
  json_object_set_new(c, "in_flight", json_boolean(st.in_flight));
  json_object_set_new(c, "agreed", json_boolean(st.agreed));
  json_object_set_new(c, "ranks", json_integer(st.nranks));
  json_object_set_new(c, "engine_pid", json_integer(st.engine_pid));
  json_object_set_new(c, "engine_alive", json_boolean(st.engine_alive));
  return c;
}

static int name_cmp(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The control cells in this host's FERRY_CTL_DIR ("ferry-ctl-NAME" files), sorted by name. */
static json_t *control_json(void) {
  const char *dir = ferry_config_get("FERRY_CTL_DIR");
  dir = dir && *dir ? dir : "/dev/shm";
  json_t *out = json_object(), *arr = json_array();
  set_str(out, "dir", dir);
  char *names[FLEET_CELLS_MAX];
  size_t n = 0, omitted = 0;
  DIR *d = opendir(dir);
  for (struct dirent *e; d && (e = readdir(d));) {
    const char *name = e->d_name + strlen("ferry-ctl-");
    if (strncmp(e->d_name, "ferry-ctl-", strlen("ferry-ctl-")) != 0 || !*name ||
        strchr(name, '.')) /* ".PID.tmp": one being made */
      continue;
    if (n < FLEET_CELLS_MAX && (names[n] = strdup(name)))
      n++;
    else
      omitted++;
  }
  if (d)
    closedir(d);
  qsort(names, n, sizeof *names, name_cmp);
  for (size_t i = 0; i < n; i++) {
    json_array_append_new(arr, cell_json(names[i]));
    free(names[i]);
  }
  json_object_set_new(out, "cells", arr);
  json_object_set_new(out, "cells_omitted", json_integer((json_int_t)omitted));
  return out;
}

static json_t *limits_json(const fleet_view *v) {
  json_t *l = json_object();
  json_object_set_new(l, "nodes", json_integer(FLEET_NODES_MAX));
  json_object_set_new(l, "prefixes", json_integer(FLEET_PREFIXES_MAX));
  json_object_set_new(l, "keys_per_prefix", json_integer(FLEET_KEYS_PER_PREFIX));
  json_object_set_new(l, "owners_per_prefix", json_integer(FLEET_OWNERS_PER_PREFIX));
  json_object_set_new(l, "topics", json_integer(FLEET_TOPICS_MAX));
  json_object_set_new(l, "cells", json_integer(FLEET_CELLS_MAX));
  json_object_set_new(l, "budget_ms", json_integer(v->budget_ms));
  json_object_set_new(l, "cache_ms", json_integer(FLEET_CACHE_MS));
  json_object_set_new(l, "skip_ms", json_integer(FLEET_SKIP_MS));
  return l;
}

json_t *fleet_assemble(snap *s, const fr_dir_object *objs, size_t nobjs, const fr_dir_object *mq,
                       size_t nmq) {
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  json_t *o = json_object();
  json_object_set_new(o, "version", json_integer(1));
  set_str(o, "ferry", ferry_version());
  set_str(o, "directory", s->v->dir->url);
  json_object_set_new(o, "time", json_real((double)now.tv_sec + now.tv_nsec * 1e-9));
  json_object_set_new(o, "limits", limits_json(s->v));
  json_object_set_new(o, "nodes", nodes_json(s));
  json_object_set_new(o, "nodes_omitted", json_integer((json_int_t)(s->total - s->nnodes)));
  json_object_set_new(o, "store", store_json(objs, nobjs));
  json_object_set_new(o, "refit", refit_json(s));
  uint64_t topics_omitted = 0;
  json_object_set_new(o, "mq", mq_json(s, mq, nmq, &topics_omitted));
  json_object_set_new(o, "mq_topics_omitted", json_integer((json_int_t)topics_omitted));
  json_object_set_new(o, "control", control_json());
  return o;
}
