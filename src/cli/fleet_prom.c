/*
 * The fleet snapshot's reader of a node's metrics (fleet.c has the overview): the Prometheus
 * text format, as src/core/stats.c writes it, taken into samples (a name, up to LABELS_MAX
 * labels, a value), and the lookups the JSON sections make in them. A line that does not parse is
 * skipped: the text came from a peer.
 */
#include "cli/fleet_impl.h"

#include <stdlib.h>
#include <string.h>

void fleet_samples_free(samples *ss) {
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

void fleet_parse_prom(const char *text, samples *out) {
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

const char *fleet_label(const sample *s, const char *key) {
  for (size_t k = 0; k < s->nlabels; k++)
    if (strcmp(s->key[k], key) == 0)
      return s->val[k];
  return NULL;
}

/* The sample `name` whose label k1 is v1 (and k2 v2 when k2 is not NULL). */
const sample *fleet_find(const samples *ss, const char *name, const char *k1, const char *v1,
                         const char *k2, const char *v2) {
  for (size_t i = 0; ss && i < ss->n; i++) {
    const sample *s = &ss->s[i];
    const char *a = fleet_label(s, k1), *b = k2 ? fleet_label(s, k2) : NULL;
    if (strcmp(s->name, name) == 0 && a && strcmp(a, v1) == 0 && (!k2 || (b && !strcmp(b, v2))))
      return s;
  }
  return NULL;
}
