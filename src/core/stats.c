/*
 * The metrics registry: sets of collectors (one set per ctx, one for the process), a snapshot
 * that runs them, merges samples of one series and sorts them into families, and the Prometheus
 * text rendering of such a snapshot. The counters themselves live in the objects they describe
 * (stats.h); nothing here is on a hot path: a snapshot costs a lock on the set and a sort.
 */
#include "core/stats.h"
#include "core/core.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LABELS 4
#define LABEL_NAME 32
#define LABEL_VALUE 160

typedef struct sample {
  const char *name, *help; /* static strings of the collector */
  ferry_stat_kind kind;
  size_t nl;
  char lk[MAX_LABELS][LABEL_NAME];
  char lv[MAX_LABELS][LABEL_VALUE];
  double value, scale;
  uint64_t bucket[FR_HIST_BUCKETS + 1];
} sample;

struct fr_stats_out {
  sample *v;
  size_t n, cap;
  bool oom;
};

static fr_stats global_set = {.lock = PTHREAD_MUTEX_INITIALIZER};
static pthread_once_t global_once = PTHREAD_ONCE_INIT;

/* The process's own series (procstats.c) are the set's first collector. */
static void global_init(void) {
  if (fr_stats_add(&global_set, fr_procstats_collect, NULL, &global_set) != 0)
    fr_err_clear(); /* out of memory: the process reports no series of its own */
}

fr_stats *fr_stats_global(void) {
  pthread_once(&global_once, global_init);
  return &global_set;
}

void fr_stats_init(fr_stats *s) {
  memset(s, 0, sizeof *s);
  pthread_mutex_init(&s->lock, NULL);
}

void fr_stats_fini(fr_stats *s) {
  free(s->v);
  s->v = NULL;
  s->n = s->cap = 0;
  pthread_mutex_destroy(&s->lock);
}

int fr_stats_add(fr_stats *s, fr_stats_fn fn, fr_ready_fn ready, void *arg) {
  pthread_mutex_lock(&s->lock);
  if (FR_GROW(s->v, s->cap, s->n + 1, 8) != 0) {
    pthread_mutex_unlock(&s->lock);
    return fr_err(FERRY_ENOMEM, "metrics: collector table");
  }
  s->v[s->n++] = (fr_stats_entry){fn, ready, arg};
  pthread_mutex_unlock(&s->lock);
  return 0;
}

void fr_stats_remove(fr_stats *s, void *arg) {
  pthread_mutex_lock(&s->lock);
  for (size_t i = 0; i < s->n;)
    if (s->v[i].arg == arg)
      s->v[i] = s->v[--s->n];
    else
      i++;
  pthread_mutex_unlock(&s->lock);
}

/* ---- emitting ---- */

static sample *sample_new(fr_stats_out *o, const char *name, const char *help, ferry_stat_kind k,
                          va_list ap) {
  if (FR_GROW(o->v, o->cap, o->n + 1, 64) != 0) {
    o->oom = true;
    return NULL;
  }
  sample *s = &o->v[o->n];
  memset(s, 0, sizeof *s);
  s->name = name;
  s->help = help;
  s->kind = k;
  /* slot 0 is kept for the node label, filled in by the snapshot */
  s->nl = 1;
  for (const char *key; (key = va_arg(ap, const char *)) != NULL;) {
    const char *val = va_arg(ap, const char *);
    if (s->nl == MAX_LABELS)
      continue;
    fr_str_copy(s->lk[s->nl], LABEL_NAME, key);
    fr_str_copy(s->lv[s->nl], LABEL_VALUE, val ? val : "");
    s->nl++;
  }
  o->n++;
  return s;
}

void fr_stat_counter(fr_stats_out *o, const char *name, const char *help, double value, ...) {
  va_list ap;
  va_start(ap, value);
  sample *s = sample_new(o, name, help, FERRY_STAT_COUNTER, ap);
  va_end(ap);
  if (s)
    s->value = value;
}

void fr_stat_gauge(fr_stats_out *o, const char *name, const char *help, double value, ...) {
  va_list ap;
  va_start(ap, value);
  sample *s = sample_new(o, name, help, FERRY_STAT_GAUGE, ap);
  va_end(ap);
  if (s)
    s->value = value;
}

void fr_stat_hist(fr_stats_out *o, const char *name, const char *help, const fr_hist *h,
                  double scale, ...) {
  va_list ap;
  va_start(ap, scale);
  sample *s = sample_new(o, name, help, FERRY_STAT_HISTOGRAM, ap);
  va_end(ap);
  if (!s)
    return;
  for (int i = 0; i <= FR_HIST_BUCKETS; i++)
    s->bucket[i] = fr_counted(&h->bucket[i]);
  s->value = (double)fr_counted(&h->sum) * scale;
  s->scale = scale;
}

/* ---- snapshots ---- */

static int label_cmp(const sample *a, const sample *b) {
  if (a->nl != b->nl)
    return a->nl < b->nl ? -1 : 1;
  for (size_t i = 1; i < a->nl; i++) {
    int c = strcmp(a->lk[i], b->lk[i]);
    if (!c)
      c = strcmp(a->lv[i], b->lv[i]);
    if (c)
      return c;
  }
  return 0;
}

static int sample_cmp(const void *x, const void *y) {
  const sample *a = x, *b = y;
  int c = strcmp(a->name, b->name);
  return c ? c : label_cmp(a, b);
}

/* Sums samples of one series into the first: two objects of one ctx reporting one topic. */
static size_t merge(sample *v, size_t n) {
  size_t out = 0;
  for (size_t i = 0; i < n; i++) {
    if (out > 0 && sample_cmp(&v[out - 1], &v[i]) == 0) {
      sample *d = &v[out - 1];
      d->value += v[i].value;
      for (int b = 0; b <= FR_HIST_BUCKETS; b++)
        d->bucket[b] += v[i].bucket[b];
    } else if (out != i) {
      v[out++] = v[i];
    } else {
      out++;
    }
  }
  return out;
}

static int emit(const sample *s, const char *node, ferry_stat_fn fn, void *arg) {
  const char *keys[MAX_LABELS], *vals[MAX_LABELS];
  size_t first = node ? 0 : 1;
  keys[0] = "node";
  vals[0] = node;
  for (size_t i = 1; i < s->nl; i++) {
    keys[i] = s->lk[i];
    vals[i] = s->lv[i];
  }
  double le[FR_HIST_BUCKETS];
  uint64_t cum[FR_HIST_BUCKETS], total = 0;
  for (int i = 0; i < FR_HIST_BUCKETS; i++) {
    total += s->bucket[i];
    cum[i] = total;
    le[i] = ldexp(1024.0, 2 * i) * s->scale;
  }
  bool hist = s->kind == FERRY_STAT_HISTOGRAM;
  ferry_stat st = {
      .name = s->name,
      .help = s->help,
      .kind = s->kind,
      .nlabels = s->nl - first,
      .label_names = keys + first,
      .label_values = vals + first,
      .value = s->value,
      .count = hist ? total + s->bucket[FR_HIST_BUCKETS] : 0,
      .nbuckets = hist ? FR_HIST_BUCKETS : 0,
      .bucket_le = hist ? le : NULL,
      .bucket_counts = hist ? cum : NULL,
  };
  return fn(&st, arg);
}

int fr_stats_collect(fr_stats *const *sets, size_t nsets, const char *node, ferry_stat_fn fn,
                     void *arg) {
  fr_stats_out o = {0};
  for (size_t i = 0; i < nsets; i++) {
    if (!sets[i])
      continue;
    pthread_mutex_lock(&sets[i]->lock);
    for (size_t j = 0; j < sets[i]->n; j++)
      if (sets[i]->v[j].fn)
        sets[i]->v[j].fn(sets[i]->v[j].arg, &o);
    pthread_mutex_unlock(&sets[i]->lock);
  }
  if (o.oom) {
    free(o.v);
    return fr_err(FERRY_ENOMEM, "metrics: snapshot");
  }
  if (o.n)
    qsort(o.v, o.n, sizeof *o.v, sample_cmp);
  size_t n = merge(o.v, o.n);
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++)
    rc = emit(&o.v[i], node, fn, arg);
  free(o.v);
  return rc;
}

int fr_stats_ready(fr_stats *const *sets, size_t nsets, char *why, size_t len) {
  int rc = 0;
  for (size_t i = 0; i < nsets && rc == 0; i++) {
    if (!sets[i])
      continue;
    pthread_mutex_lock(&sets[i]->lock);
    for (size_t j = 0; j < sets[i]->n && rc == 0; j++)
      if (sets[i]->v[j].ready)
        rc = sets[i]->v[j].ready(sets[i]->v[j].arg, why, len);
    pthread_mutex_unlock(&sets[i]->lock);
  }
  if (rc == 0 && why && len)
    snprintf(why, len, "ready");
  return rc;
}

/* ---- Prometheus text format ---- */

typedef struct text {
  char *buf;
  size_t len, cap;
  bool oom;
  const char *family; /* the last family written */
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(text *t, const char *fmt, ...) {
  for (int pass = 0; pass < 2 && !t->oom; pass++) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->buf ? t->buf + t->len : NULL, t->buf ? t->cap - t->len : 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
      t->oom = true;
      return;
    }
    if (t->buf && t->len + (size_t)n < t->cap) {
      t->len += (size_t)n;
      return;
    }
    if (FR_GROW(t->buf, t->cap, t->len + (size_t)n + 1, 4096) != 0) { /* + 1: the NUL */
      t->oom = true;
      return;
    }
  }
}

/* Label values escape backslash, double quote and newline; HELP text backslash and newline. */
static void put_escaped(text *t, const char *s, bool quote) {
  for (; *s; s++) {
    if (*s == '\\')
      put(t, "\\\\");
    else if (*s == '\n')
      put(t, "\\n");
    else if (*s == '"' && quote)
      put(t, "\\\"");
    else
      put(t, "%c", *s);
  }
}

static void put_labels(text *t, const ferry_stat *s, const char *le) {
  if (s->nlabels == 0 && !le)
    return;
  put(t, "{");
  for (size_t i = 0; i < s->nlabels; i++) {
    put(t, "%s%s=\"", i ? "," : "", s->label_names[i]);
    put_escaped(t, s->label_values[i], true);
    put(t, "\"");
  }
  if (le)
    put(t, "%sle=\"%s\"", s->nlabels ? "," : "", le);
  put(t, "}");
}

static int render(const ferry_stat *s, void *arg) {
  text *t = arg;
  static const char *const kinds[] = {"counter", "gauge", "histogram"};
  if (!t->family || strcmp(t->family, s->name) != 0) {
    put(t, "# HELP %s ", s->name);
    put_escaped(t, s->help, false);
    put(t, "\n# TYPE %s %s\n", s->name, kinds[s->kind]);
    t->family = s->name;
  }
  if (s->kind != FERRY_STAT_HISTOGRAM) {
    put(t, "%s", s->name);
    put_labels(t, s, NULL);
    put(t, " %.17g\n", s->value);
    return t->oom ? FERRY_ENOMEM : 0;
  }
  char le[64];
  for (size_t i = 0; i < s->nbuckets; i++) {
    snprintf(le, sizeof le, "%.6g", s->bucket_le[i]);
    put(t, "%s_bucket", s->name);
    put_labels(t, s, le);
    put(t, " %llu\n", (unsigned long long)s->bucket_counts[i]);
  }
  put(t, "%s_bucket", s->name);
  put_labels(t, s, "+Inf");
  put(t, " %llu\n%s_sum", (unsigned long long)s->count, s->name);
  put_labels(t, s, NULL);
  put(t, " %.17g\n%s_count", s->value, s->name);
  put_labels(t, s, NULL);
  put(t, " %llu\n", (unsigned long long)s->count);
  return t->oom ? FERRY_ENOMEM : 0;
}

int fr_stats_prometheus(fr_stats *const *sets, size_t nsets, const char *node, char **out,
                        size_t *len) {
  text t = {0};
  put(&t, "%s", ""); /* an empty snapshot is an empty, valid exposition */
  int rc = fr_stats_collect(sets, nsets, node, render, &t);
  if (rc == 0 && t.oom)
    rc = fr_err(FERRY_ENOMEM, "metrics: text");
  if (rc != 0) {
    free(t.buf);
    return rc;
  }
  *out = t.buf;
  if (len)
    *len = t.len;
  return 0;
}
