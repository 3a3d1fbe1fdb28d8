/*
 * The fleet snapshot behind ferry serve's /v1/fleet (and its status page) and `ferry top`.
 *
 * The directory is the front door: its node records give the nodes (one per process and
 * directory) and their addresses, its job records ("ferry:job/KIND/NAME", owned by a node) what
 * runs on each (a store, an mq, published refit senders), its object records the store's keys
 * (grouped by prefix: the key up to its first '/') and the mq's publisher and subscriber records
 * per topic. What only a node knows (the version each of a sender's receivers committed, an mq's
 * queue, a store node's pool) comes from that node's own metrics, which every ctx gives on a ferry
 * call (FR_CHANNEL_STATS, the text its /metrics would serve): one call per distinct address. The
 * whole snapshot has a budget (FERRY_FLEET_BUDGET_MS): the directory is read within it, then the
 * nodes are asked in parallel (FLEET_ASK_THREADS at a time), each given what is left of it, so a
 * node that is slow or gone costs the snapshot at most the budget and is shown with its error. An
 * address that failed is remembered and not asked again for FLEET_SKIP_MS (listed unreachable, with
 * why and since when), so that a dead node whose records wait for its lease to lapse does not cost
 * every snapshot. One snapshot is taken at a time and kept FLEET_CACHE_MS: concurrent callers (page
 * viewers, ferry top) share it, or wait for the one in flight, instead of each asking every node.
 * Control cells are not in the directory (they live in FERRY_CTL_DIR's shared memory): the
 * snapshot lists this host's. Every string that came from a peer is made valid UTF-8 before it
 * goes into the JSON; the page renders it as text.
 */
#include "cli/fleet.h"
#include "core/core.h"
#include "directory/directory.h"
#include "ferry.h"
#include "transport/linkcalls.h"

#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* A link kept to a node between snapshots: connecting anew each time would churn connections
 * (and log two lines per node per snapshot on each side). */
typedef struct kept_link {
  char *address;
  ferry_link *link;
} kept_link;

/* An address that just failed: not asked again before `until` (fr_now_ns). */
typedef struct down_addr {
  char *address;
  uint64_t until;
  double since; /* when it first failed, in seconds since the epoch */
  char error[256];
} down_addr;

struct fleet_view {
  ferry_ctx *ctx;
  fr_dir *dir;
  int budget_ms;
  pthread_mutex_t lock; /* what follows */
  pthread_cond_t done;  /* a snapshot was taken (busy went false) */
  bool busy;            /* a snapshot is being taken: only its thread touches kept and down */
  json_t *last;         /* the last snapshot (NULL: it failed, with last_rc and last_error) */
  int last_rc;
  char last_error[512];
  uint64_t last_ns; /* when it was taken (fr_now_ns); 0: none yet */
  kept_link kept[FLEET_NODES_MAX];
  size_t nkept;
  down_addr down[FLEET_NODES_MAX];
  size_t ndown;
};

int fleet_budget_ms(void) {
  int64_t ms = fr_config_int("FERRY_FLEET_BUDGET_MS");
  return ms < FLEET_BUDGET_MIN_MS   ? FLEET_BUDGET_MIN_MS
         : ms > FLEET_BUDGET_MAX_MS ? FLEET_BUDGET_MAX_MS
                                    : (int)ms;
}

int fleet_view_open(const char *url, const char *name, fleet_view **out) {
  fleet_view *v = calloc(1, sizeof *v);
  if (!v)
    return fr_err(FERRY_ENOMEM, "fleet view");
  pthread_mutex_init(&v->lock, NULL);
  fr_cond_init_monotonic(&v->done);
  v->budget_ms = fleet_budget_ms();
  ferry_ctx_opts co = {.size = sizeof co, .name = name};
  int rc = ferry_ctx_open(&co, &v->ctx);
  if (rc == 0) /* the budget bounds this too: a directory that is down must not hold a caller */
    rc = fr_dir_open(v->ctx, url, v->budget_ms, &v->dir);
  if (rc != 0) {
    fleet_view_close(v);
    return rc;
  }
  *out = v;
  return 0;
}

static void drop_link(fleet_view *v, size_t i) {
  ferry_link_close(v->kept[i].link);
  free(v->kept[i].address);
  v->kept[i] = v->kept[--v->nkept];
}

static void drop_down(fleet_view *v, size_t i) {
  free(v->down[i].address);
  v->down[i] = v->down[--v->ndown];
}

void fleet_view_close(fleet_view *v) {
  if (!v)
    return;
  while (v->nkept)
    drop_link(v, 0);
  while (v->ndown)
    drop_down(v, 0);
  json_decref(v->last);
  fr_dir_close(v->dir);
  ferry_ctx_close(v->ctx);
  pthread_cond_destroy(&v->done);
  pthread_mutex_destroy(&v->lock);
  free(v);
}

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

/* ---- a node's metrics (the Prometheus text format, as src/core/stats.c writes it) ---- */

#define LABELS_MAX 6

typedef struct sample {
  char *name;
  size_t nlabels;
  char *key[LABELS_MAX], *val[LABELS_MAX];
  double value;
} sample;

typedef struct samples {
  sample *s;
  size_t n, cap;
} samples;

static void samples_free(samples *ss) {
  for (size_t i = 0; i < ss->n; i++) {
    free(ss->s[i].name);
    for (size_t k = 0; k < ss->s[i].nlabels; k++)
      free(ss->s[i].key[k]), free(ss->s[i].val[k]);
  }
  free(ss->s);
  *ss = (samples){0};
}

/* A label value: "..." with \\, \" and \n escaped; *p is past it on return. NULL: malformed. */
static char *label_value(const char **p) {
  const char *q = *p;
  if (*q++ != '"')
    return NULL;
  char *out = malloc(strlen(q) + 1), *o = out;
  if (!out)
    return NULL;
  while (*q && *q != '"') {
    if (*q == '\\' && q[1]) {
      q++;
      *o++ = *q == 'n' ? '\n' : *q;
    } else {
      *o++ = *q;
    }
    q++;
  }
  if (*q != '"') {
    free(out);
    return NULL;
  }
  *o = '\0';
  *p = q + 1;
  return out;
}

/* One sample line: name{k="v",...} value. false: not a sample we keep (malformed, too many
 * labels). */
static bool parse_line(const char *line, sample *s) {
  *s = (sample){0};
  size_t n = strspn(line, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_:");
  if (n == 0 || !(s->name = strndup(line, n)))
    return false;
  const char *p = line + n;
  if (*p == '{') {
    p++;
    while (*p && *p != '}') {
      size_t k = strcspn(p, "=");
      if (s->nlabels == LABELS_MAX || !p[k])
        goto bad;
      s->key[s->nlabels] = strndup(p, k);
      p += k + 1;
      if (!(s->val[s->nlabels++] = label_value(&p)))
        goto bad;
      if (*p == ',')
        p++;
    }
    if (*p++ != '}')
      goto bad;
  }
  char *end;
  s->value = strtod(p, &end);
  if (end != p)
    return true;
bad:
  free(s->name);
  for (size_t k = 0; k < s->nlabels; k++)
    free(s->key[k]), free(s->val[k]);
  *s = (sample){0};
  return false;
}

static void parse_prom(const char *text, samples *out) {
  for (const char *line = text; line && *line;) {
    const char *nl = strchr(line, '\n');
    char *copy = nl ? strndup(line, (size_t)(nl - line)) : strdup(line);
    sample s;
    if (copy && *copy != '#' && parse_line(copy, &s)) {
      if (FR_GROW(out->s, out->cap, out->n + 1, 64) == 0)
        out->s[out->n++] = s;
    }
    free(copy);
    line = nl ? nl + 1 : NULL;
  }
}

static const char *label(const sample *s, const char *key) {
  for (size_t k = 0; k < s->nlabels; k++)
    if (strcmp(s->key[k], key) == 0)
      return s->val[k];
  return NULL;
}

/* The sample `name` whose label k1 is v1 (and k2 v2 when k2 is not NULL). */
static const sample *find(const samples *ss, const char *name, const char *k1, const char *v1,
                          const char *k2, const char *v2) {
  for (size_t i = 0; ss && i < ss->n; i++) {
    const sample *s = &ss->s[i];
    const char *a = label(s, k1), *b = k2 ? label(s, k2) : NULL;
    if (strcmp(s->name, name) == 0 && a && strcmp(a, v1) == 0 && (!k2 || (b && !strcmp(b, v2))))
      return s;
  }
  return NULL;
}

/* A count or a byte size is written as an integer, a duration as a real. */
static void set_sample(json_t *obj, const char *key, const sample *s) {
  if (!s)
    return;
  bool whole = s->value == (double)(int64_t)s->value && fabs(s->value) < 9007199254740992.0;
  json_object_set_new(obj, key, whole ? json_integer((json_int_t)s->value) : json_real(s->value));
}

/* The metrics of every node, fetched once per distinct address. */
typedef struct node_stats {
  const char *address;
  samples ss;
  bool ok;
  char error[256];
  double down_since; /* not reached: when the address first failed (0: it just did) */
  bool skipped;      /* not asked: it failed less than FLEET_SKIP_MS ago */
  /* the asking (ask_one) */
  ferry_link *link; /* in: the link kept to it (NULL: connect); out: the one to keep */
  char *text;
  int rc;
  bool asked; /* false: the budget ran out before its turn (not held against it) */
} node_stats;

typedef struct snap {
  fleet_view *v;
  uint64_t deadline; /* the budget's end (fr_now_ns) */
  fr_dir_node *nodes;
  size_t nnodes, total;
  fr_dir_object *jobs; /* the job records, sorted by key */
  size_t njobs;
  node_stats *stats; /* parallel to nodes; entries of a repeated address point at the first */
  node_stats **of;
} snap;

static node_stats *stats_of(snap *s, const char *node) {
  for (size_t i = 0; i < s->nnodes; i++)
    if (strcmp(s->nodes[i].name, node) == 0)
      return s->of[i];
  return NULL;
}

/* Milliseconds left before deadline, rounded up (0: none). */
static int left_ms(uint64_t deadline) {
  uint64_t now = fr_now_ns();
  return now >= deadline ? 0 : (int)((deadline - now + 999999) / 1000000);
}

/* The metrics of one address, over the link kept to it (or a new one), within what is left of
 * the budget. Runs on an asker thread: it touches only ns. */
static void ask_one(snap *s, node_stats *ns) {
  int ms = left_ms(s->deadline), rc = 0;
  if (ms == 0)
    rc = fr_err(FERRY_ETIMEDOUT, "not asked: the snapshot's %d ms budget ran out", s->v->budget_ms);
  ns->asked = rc == 0;
  if (rc == 0 && !ns->link)
    rc = ferry_connect(s->v->ctx, ns->address, ms, &ns->link);
  if (rc == 0 && (ms = left_ms(s->deadline)) == 0)
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
  size_t next;
} askers;

static void *asker_main(void *arg) {
  askers *a = arg;
  for (;;) {
    pthread_mutex_lock(&a->lock);
    size_t i = a->next;
    while (i < a->s->nnodes && (a->s->of[i] != &a->s->stats[i] || a->s->stats[i].skipped))
      i++;
    a->next = i + 1;
    pthread_mutex_unlock(&a->lock);
    if (i >= a->s->nnodes)
      return NULL;
    ask_one(a->s, &a->s->stats[i]);
  }
}

/* Asks every address at once, FLEET_ASK_THREADS at a time (this thread too: it also asks when
 * no thread can be started). */
static void ask_all(snap *s, size_t nask) {
  askers a = {.s = s};
  pthread_mutex_init(&a.lock, NULL);
  pthread_t t[FLEET_ASK_THREADS];
  size_t nt = 0;
  while (nt + 1 < FLEET_ASK_THREADS && nt + 1 < nask &&
         pthread_create(&t[nt], NULL, asker_main, &a) == 0)
    nt++;
  asker_main(&a);
  while (nt)
    pthread_join(t[--nt], NULL);
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
    drop_link(v, 0);
  for (size_t i = v->ndown; i-- > 0;)
    if (now >= v->down[i].until)
      drop_down(v, i);
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
      parse_prom(ns->text, &ns->ss);
      ns->ok = true;
      char *address = strdup(ns->address);
      if (address && v->nkept < FLEET_NODES_MAX)
        v->kept[v->nkept++] = (kept_link){address, ns->link};
      else
        free(address), ferry_link_close(ns->link);
      ns->link = NULL;
      if (d)
        drop_down(v, (size_t)(d - v->down));
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

static void fetch_stats(snap *s) {
  size_t nask = plan(s);
  if (nask)
    ask_all(s, nask);
  settle(s);
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
      set_sample(st, "objects", find(&ns->ss, "ferry_store_objects", "store", n->name, 0, 0));
      set_sample(st, "held_bytes", find(&ns->ss, "ferry_store_held_bytes", "store", n->name, 0, 0));
      set_sample(st, "pool_used_bytes",
                 find(&ns->ss, "ferry_store_pool_used_bytes", "store", n->name, 0, 0));
      set_sample(st, "pool_capacity_bytes",
                 find(&ns->ss, "ferry_store_pool_capacity_bytes", "store", n->name, 0, 0));
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
    const char *snd = label(c, "sender"), *rcv = label(c, "receiver");
    if (strcmp(c->name, "ferry_refit_receiver_committed_version") != 0 || !snd || !rcv ||
        strcmp(snd, sender) != 0)
      continue;
    json_t *r = json_object();
    set_str(r, "receiver", rcv);
    json_object_set_new(r, "committed", json_integer((json_int_t)c->value));
    const sample *d = find(ss, "ferry_refit_receiver_dropped", "sender", sender, "receiver", rcv);
    json_object_set_new(r, "dropped", json_boolean(d && d->value != 0));
    set_sample(r, "failures",
               find(ss, "ferry_refit_receiver_failures_total", "sender", sender, "receiver", rcv));
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
    const sample *ver = find(ss, "ferry_refit_version", "sender", sender, 0, 0);
    json_object_set_new(o, "version", ver ? json_integer((json_int_t)ver->value) : json_null());
    set_sample(o, "pushes", find(ss, "ferry_refit_pushes_total", "sender", sender, 0, 0));
    set_sample(o, "last_push_seconds",
               find(ss, "ferry_refit_last_push_seconds", "sender", sender, 0, 0));
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
    set_sample(m, "published", find(ss, "ferry_mq_published_total", "mq", mq, "topic", topic));
    set_sample(m, "subscribers", find(ss, "ferry_mq_subscribers", "mq", mq, "topic", topic));
  } else {
    set_sample(m, "received", find(ss, "ferry_mq_received_total", "mq", mq, "topic", topic));
    const sample *q = find(ss, "ferry_mq_queue_messages", "mq", mq, 0, 0);
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

static int node_cmp(const void *a, const void *b) {
  return strcmp(((const fr_dir_node *)a)->name, ((const fr_dir_node *)b)->name);
}

/* The directory's records: nodes (sorted by name), user objects and mq records. */
static int read_directory(fleet_view *v, snap *s, fr_dir_object **objs, size_t *nobjs,
                          fr_dir_object **mq, size_t *nmq) {
  int ms = left_ms(s->deadline);
  int rc = fr_dir_node_list(v->dir, &s->nodes, &s->nnodes, ms ? ms : 1);
  if (rc == 0 && (ms = left_ms(s->deadline)) > 0)
    rc = fr_dir_obj_scan(v->dir, "", objs, nobjs, ms);
  if (rc == 0 && (ms = left_ms(s->deadline)) > 0)
    rc = fr_dir_obj_scan(v->dir, FR_DIR_RESERVED "mq/", mq, nmq, ms);
  if (rc == 0 && (ms = left_ms(s->deadline)) > 0)
    rc = fr_dir_obj_scan(v->dir, FR_DIR_JOBS, &s->jobs, &s->njobs, ms);
  if (rc == 0 && ms == 0)
    rc = fr_err(FERRY_ETIMEDOUT, "no answer within the snapshot's %d ms budget", v->budget_ms);
  if (rc != 0)
    return fr_err_wrap(rc, "fleet: the directory %s", v->dir->url);
  qsort(s->nodes, s->nnodes, sizeof *s->nodes, node_cmp);
  return 0;
}

static json_t *assemble(snap *s, const fr_dir_object *objs, size_t nobjs, const fr_dir_object *mq,
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

/* A new snapshot, taken within the budget (the caller has made v busy). */
static int take(fleet_view *v, json_t **out) {
  snap s = {.v = v, .deadline = fr_deadline_ns(v->budget_ms)};
  fr_dir_object *objs = NULL, *mq = NULL;
  size_t nobjs = 0, nmq = 0;
  int rc = read_directory(v, &s, &objs, &nobjs, &mq, &nmq);
  s.total = s.nnodes;
  if (s.nnodes > FLEET_NODES_MAX) /* the rest are counted, not asked */
    s.nnodes = FLEET_NODES_MAX;
  if (rc == 0 && (!(s.stats = calloc(s.nnodes + 1, sizeof *s.stats)) ||
                  !(s.of = calloc(s.nnodes + 1, sizeof *s.of))))
    rc = fr_err(FERRY_ENOMEM, "fleet snapshot");
  if (rc == 0) {
    fetch_stats(&s);
    *out = assemble(&s, objs, nobjs, mq, nmq);
    if (!*out)
      rc = fr_err(FERRY_ENOMEM, "fleet snapshot");
  }
  for (size_t i = 0; s.stats && i < s.nnodes; i++) {
    samples_free(&s.stats[i].ss);
    free(s.stats[i].text);
  }
  free(s.stats);
  free(s.of);
  free(s.nodes);
  free(s.jobs);
  free(objs);
  free(mq);
  return rc;
}

/* The last snapshot (v->lock held): a copy of it, or its failure. */
static int last(fleet_view *v, json_t **out) {
  if (!v->last)
    return fr_err(v->last_rc, "%s", v->last_error);
  *out = json_deep_copy(v->last);
  return *out ? 0 : fr_err(FERRY_ENOMEM, "fleet snapshot");
}

int fleet_snapshot(fleet_view *v, json_t **out) {
  pthread_mutex_lock(&v->lock);
  for (;;) {
    bool fresh = v->last_ns && fr_now_ns() - v->last_ns < (uint64_t)FLEET_CACHE_MS * 1000000ull;
    if (fresh || (v->busy && v->last)) { /* one in flight: the last one meanwhile */
      int rc = last(v, out);
      pthread_mutex_unlock(&v->lock);
      return rc;
    }
    if (!v->busy)
      break;
    pthread_cond_wait(&v->done, &v->lock); /* at most the budget */
  }
  v->busy = true;
  pthread_mutex_unlock(&v->lock);
  json_t *o = NULL;
  int rc = take(v, &o);
  pthread_mutex_lock(&v->lock);
  v->busy = false;
  json_decref(v->last);
  v->last = rc == 0 ? o : NULL;
  v->last_rc = rc;
  fr_str_copy(v->last_error, sizeof v->last_error, rc == 0 ? "" : ferry_last_error());
  v->last_ns = fr_now_ns();
  pthread_cond_broadcast(&v->done);
  if (rc == 0 && !(*out = json_deep_copy(o)))
    rc = fr_err(FERRY_ENOMEM, "fleet snapshot");
  pthread_mutex_unlock(&v->lock);
  return rc;
}

int fleet_json(fleet_view *v, char **text, size_t *len) {
  json_t *o = NULL;
  int rc = fleet_snapshot(v, &o);
  if (rc != 0)
    return rc;
  *text = json_dumps(o, JSON_COMPACT);
  json_decref(o);
  if (!*text)
    return fr_err(FERRY_ENOMEM, "fleet snapshot");
  *len = strlen(*text);
  return 0;
}
