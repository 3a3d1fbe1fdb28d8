/*
 * Directory URLs: a bare HOST:PORT read as ferry://HOST:PORT, taking a redis:// URL apart (user,
 * password, host, port, database, as redis-cli and redis-py read them) and redacting any URL
 * before it is printed. A directory URL
 * may carry a password, so every message, log line and ready line that names one goes through
 * fr_url_redact() first; the password itself only ever reaches the Redis AUTH command.
 */
#include "directory/directory.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Where the userinfo of `url` ends (its last '@'; a password may hold an unencoded '@' or '/'),
 * or NULL when it has none. *start: where the authority begins (after "://"). */
static const char *userinfo_end(const char *url, const char **start) {
  const char *s = strstr(url, "://");
  *start = s ? s + 3 : url;
  return strrchr(*start, '@');
}

void fr_url_redact(const char *url, char *out, size_t cap) {
  if (!cap)
    return;
  if (!url) {
    fr_str_copy(out, cap, "");
    return;
  }
  const char *start;
  const char *at = userinfo_end(url, &start);
  if (!at) {
    fr_str_copy(out, cap, url);
    return;
  }
  /* "user:password" keeps the user; a bare userinfo is all password (redis-cli's reading) */
  const char *colon = memchr(start, ':', (size_t)(at - start));
  size_t keep = colon ? (size_t)(colon - start) + 1 : 0;
  snprintf(out, cap, "%.*s%.*s***%s", (int)(start - url), url, (int)keep, start, at);
}

const char *fr_dir_url_normal(const char *url, char *out, size_t cap) {
  if (!url || strstr(url, "://") || strpbrk(url, "/@?#"))
    return url;
  const char *colon = strrchr(url, ':');
  if (!colon || colon == url || !colon[1] || strlen(colon + 1) > 5)
    return url;
  for (const char *p = colon + 1; *p; p++)
    if (!isdigit((unsigned char)*p))
      return url;
  bool v6 = url[0] == '[' && colon[-1] == ']';
  if (!v6 && memchr(url, ':', (size_t)(colon - url))) /* an unbracketed v6 address: ambiguous */
    return url;
  snprintf(out, cap, "ferry://%s", url);
  return out;
}

static int hex_value(char c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  c = (char)tolower((unsigned char)c);
  return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* Percent-decodes n bytes of s into out (cap bytes, NUL included); false when malformed or too
 * long. */
static bool percent_decode(const char *s, size_t n, char *out, size_t cap) {
  size_t o = 0;
  for (size_t i = 0; i < n; i++) {
    char c = s[i];
    if (c == '%') {
      int h = i + 2 < n ? hex_value(s[i + 1]) : -1, l = i + 2 < n ? hex_value(s[i + 2]) : -1;
      if (h < 0 || l < 0)
        return false;
      c = (char)(h * 16 + l);
      i += 2;
    }
    if (c == '\0' || o + 1 >= cap)
      return false;
    out[o++] = c;
  }
  out[o] = '\0';
  return true;
}

static int bad(const char *url, const char *why) {
  char shown[FR_DIR_ADDRESS_MAX + 1];
  fr_url_redact(url, shown, sizeof shown);
  return fr_err(FERRY_EINVAL, "directory '%s': %s (redis://[[USER]:PASSWORD@]HOST[:PORT][/DB])",
                shown, why);
}

static int parse_userinfo(const char *url, const char *start, const char *at, fr_redis_url *r) {
  const char *colon = memchr(start, ':', (size_t)(at - start));
  const char *pass = colon ? colon + 1 : start;
  if (colon && !percent_decode(start, (size_t)(colon - start), r->user, sizeof r->user))
    return bad(url, "malformed or too long user name");
  if (!percent_decode(pass, (size_t)(at - pass), r->password, sizeof r->password))
    return bad(url, "malformed or too long password (percent-encode '%', ':' and '@' as %25, "
                    "%3A, %40)");
  r->auth = r->user[0] || r->password[0];
  return 0;
}

/* host[:port] or [v6][:port], n bytes at s (port `default_port` when none). */
static int parse_host_port(const char *url, const char *s, size_t n, int default_port, char *host,
                           size_t cap, int *port_out) {
  const char *end = s + n, *port = NULL;
  size_t hn;
  const char *h = s;
  if (n && *s == '[') {
    const char *close = memchr(s, ']', n);
    if (!close)
      return bad(url, "'[' without ']'");
    h = s + 1;
    hn = (size_t)(close - h);
    if (close + 1 < end && close[1] != ':')
      return bad(url, "bad text after ']'");
    port = close + 1 < end ? close + 2 : NULL;
  } else {
    const char *colon = memchr(s, ':', n);
    if (colon && memchr(colon + 1, ':', (size_t)(end - colon - 1)))
      return bad(url, "an IPv6 address goes in brackets, e.g. redis://[::1]:6379");
    hn = colon ? (size_t)(colon - s) : n;
    port = colon ? colon + 1 : NULL;
  }
  if (hn >= cap)
    return bad(url, "host name too long");
  snprintf(host, cap, "%.*s", (int)hn, h);
  if (!host[0])
    snprintf(host, cap, "127.0.0.1");
  *port_out = default_port;
  if (port) {
    long v = 0;
    const char *p = port;
    for (; p < end && isdigit((unsigned char)*p) && v <= 65535; p++)
      v = v * 10 + (*p - '0');
    if (p == port || p != end || v <= 0 || v > 65535)
      return bad(url, "bad port");
    *port_out = (int)v;
  }
  return 0;
}

static bool ns_char(char c) {
  return isalnum((unsigned char)c) || c == '_' || c == '.' || c == '-';
}

/* Whether n bytes at s are a namespace: 1..FR_DIR_NS_MAX of [A-Za-z0-9_.-], fitting cap. */
static bool ns_ok(const char *s, size_t n, size_t cap) {
  bool ok = n >= 1 && n <= FR_DIR_NS_MAX && n < cap;
  for (size_t i = 0; ok && i < n; i++)
    ok = ns_char(s[i]);
  return ok;
}

int fr_dir_url_ns(const char *url, char *out, size_t cap, size_t *query_at) {
  char shown[FR_DIR_ADDRESS_MAX + 1];
  const char *q = strrchr(url, '?');
  const char *at = strrchr(url, '@'); /* a '?' in a password is not a query */
  if (q && at && q < at)
    q = NULL;
  if (query_at)
    *query_at = q ? (size_t)(q - url) : strlen(url);
  fr_str_copy(out, cap, "");
  if (!q)
    return 0;
  if (strncmp(q, "?ns=", 4) != 0 || !ns_ok(q + 4, strlen(q + 4), cap)) {
    fr_url_redact(url, shown, sizeof shown);
    return fr_err(FERRY_EINVAL,
                  "directory '%s': the only query a directory URL takes is ?ns=NAME (1..%d "
                  "letters, digits, '_', '.', '-')",
                  shown, FR_DIR_NS_MAX);
  }
  fr_str_copy(out, cap, q + 4);
  return 0;
}

/* One option NAME=VALUE of a Redis URL's query (n bytes at p). */
static int parse_option(const char *url, const char *p, size_t n, fr_redis_url *r) {
  const char *eq = memchr(p, '=', n);
  size_t kn = eq ? (size_t)(eq - p) : n, vn = eq ? n - kn - 1 : 0;
  const char *v = eq ? eq + 1 : p + n;
  char *file = NULL;
  if (kn == 2 && memcmp(p, "ns", 2) == 0) {
    if (!ns_ok(v, vn, sizeof r->ns))
      return bad(url, "?ns=NAME takes 1..63 letters, digits, '_', '.', '-'");
    snprintf(r->ns, sizeof r->ns, "%.*s", (int)vn, v);
    return 0;
  }
  if (r->tls && kn == 2 && memcmp(p, "ca", 2) == 0)
    file = r->ca;
  else if (r->tls && kn == 4 && memcmp(p, "cert", 4) == 0)
    file = r->cert;
  else if (r->tls && kn == 3 && memcmp(p, "key", 3) == 0)
    file = r->key;
  if (!file)
    return bad(url, "unknown option (a Redis URL takes ?ns=NAME; rediss:// also ca=PATH, "
                    "cert=PATH, key=PATH, joined by '&')");
  if (!vn || !percent_decode(v, vn, file, sizeof r->ca))
    return bad(url, "malformed or too long file name in the query");
  return 0;
}

static int parse_query(const char *url, const char *q, fr_redis_url *r) {
  int rc = 0;
  for (const char *p = q ? q + 1 : NULL; rc == 0 && p;) {
    size_t n = strcspn(p, "&");
    rc = parse_option(url, p, n, r);
    p = p[n] ? p + n + 1 : NULL;
  }
  return rc;
}

/* S1[:PORT],S2[:PORT],... (n bytes at s). */
static int parse_sentinels(const char *url, const char *s, size_t n, fr_redis_url *r) {
  for (size_t i = 0;;) {
    const char *comma = memchr(s + i, ',', n - i);
    size_t len = comma ? (size_t)(comma - (s + i)) : n - i;
    if (r->sentinels == FR_REDIS_SENTINELS_MAX)
      return bad(url, "more than 8 sentinels");
    int rc = parse_host_port(url, s + i, len, 26379, r->sentinel[r->sentinels].host,
                             sizeof r->sentinel[0].host, &r->sentinel[r->sentinels].port);
    if (rc != 0)
      return rc;
    r->sentinels++;
    if (!comma)
      break;
    i += len + 1;
    if (i >= n)
      return bad(url, "an empty sentinel after ','");
  }
  fr_str_copy(r->host, sizeof r->host, r->sentinel[0].host);
  r->port = r->sentinel[0].port;
  return 0;
}

/* The database number in n bytes at s. */
static int parse_db(const char *url, const char *s, size_t n, fr_redis_url *r) {
  char *e;
  long db = strtol(s, &e, 10);
  if (e != s + n || db < 0 || db > 1000 || !isdigit((unsigned char)s[0]))
    return bad(url, "bad database number");
  r->db = (int)db;
  return 0;
}

/* After the sentinels: /NAME[/DB] (n bytes at s, the '/' included). */
static int parse_master(const char *url, const char *s, size_t n, fr_redis_url *r) {
  const char *name = n ? s + 1 : s, *end = s + n;
  const char *slash = memchr(name, '/', (size_t)(end - name));
  size_t len = slash ? (size_t)(slash - name) : (size_t)(end - name);
  if (!len || len >= sizeof r->master)
    return bad(url, "the primary's name goes after the sentinels: "
                    "redis+sentinel://S1:26379,S2:26379,S3:26379/NAME[/DB]");
  snprintf(r->master, sizeof r->master, "%.*s", (int)len, name);
  return slash && slash + 1 < end ? parse_db(url, slash + 1, (size_t)(end - slash - 1), r) : 0;
}

int fr_redis_url_parse(const char *url, fr_redis_url *out) {
  fr_redis_url r;
  memset(&r, 0, sizeof r);
  const char *start;
  const char *at = userinfo_end(url, &start);
  bool sentinel = strncmp(url, "redis+sentinel://", 17) == 0;
  r.tls = strncmp(url, "rediss://", 9) == 0;
  if (strstr(url, "://") && strncmp(url, "redis://", 8) != 0 && !r.tls && !sentinel)
    return bad(url, "not a redis://, rediss:// or redis+sentinel:// URL");
  const char *hp = at ? at + 1 : start;
  const char *q = strchr(hp, '?');
  const char *end = q ? q : url + strlen(url);
  int rc = parse_query(url, q, &r);
  if (rc == 0 && at)
    rc = parse_userinfo(url, start, at, &r);
  const char *slash = memchr(hp, '/', (size_t)(end - hp));
  size_t n = slash ? (size_t)(slash - hp) : (size_t)(end - hp);
  if (rc == 0 && sentinel)
    rc = parse_sentinels(url, hp, n, &r);
  if (rc == 0 && sentinel)
    rc = parse_master(url, slash ? slash : end, slash ? (size_t)(end - slash) : 0, &r);
  if (rc == 0 && !sentinel)
    rc = parse_host_port(url, hp, n, 6379, r.host, sizeof r.host, &r.port);
  if (rc == 0 && !sentinel && slash && slash + 1 < end)
    rc = parse_db(url, slash + 1, (size_t)(end - slash - 1), &r);
  if (rc == 0)
    *out = r;
  explicit_bzero(&r, sizeof r); /* the password lives on only in *out */
  return rc;
}

/* ---- etcd:// (issue 36) ---- */

static int etcd_bad(const char *url, const char *why) {
  char shown[FR_DIR_ADDRESS_MAX + 1];
  fr_url_redact(url, shown, sizeof shown);
  return fr_err(FERRY_EINVAL, "directory '%s': %s (etcd://HOST[:PORT][,HOST[:PORT]...][?ns=NAME])",
                shown, why);
}

/* One member, HOST[:PORT] or [V6][:PORT], n bytes at s. */
static int etcd_member(const char *url, const char *s, size_t n, char *host, size_t cap,
                       int *port) {
  const char *end = s + n, *h = s, *p = NULL;
  size_t hn;
  if (n && *s == '[') {
    const char *close = memchr(s, ']', n);
    if (!close || (close + 1 < end && close[1] != ':'))
      return etcd_bad(url, "a bad [IPv6] member");
    h = s + 1;
    hn = (size_t)(close - h);
    p = close + 1 < end ? close + 2 : NULL;
  } else {
    const char *colon = memchr(s, ':', n);
    if (colon && memchr(colon + 1, ':', (size_t)(end - colon - 1)))
      return etcd_bad(url, "an IPv6 member goes in brackets, e.g. etcd://[::1]:2379");
    hn = colon ? (size_t)(colon - s) : n;
    p = colon ? colon + 1 : NULL;
  }
  if (hn == 0 || hn >= cap)
    return etcd_bad(url, hn ? "a member's host name is too long" : "a member without a host");
  for (size_t i = 0; i < hn; i++)
    if (!isalnum((unsigned char)h[i]) && !strchr(".-_:%", h[i]))
      return etcd_bad(url, "a member's host has a character no host name has");
  snprintf(host, cap, "%.*s", (int)hn, h);
  *port = 2379;
  if (p) {
    long v = 0;
    const char *d = p;
    for (; d < end && isdigit((unsigned char)*d) && v <= 65535; d++)
      v = v * 10 + (*d - '0');
    if (d == p || d != end || v <= 0 || v > 65535)
      return etcd_bad(url, "a member's port is not 1..65535");
    *port = (int)v;
  }
  return 0;
}

int fr_etcd_url_parse(const char *url, fr_etcd_url *out) {
  fr_etcd_url u;
  memset(&u, 0, sizeof u);
  const char *s = strstr(url, "://");
  if (s && strncmp(url, "etcd://", 7) != 0)
    return etcd_bad(url, "not an etcd:// URL");
  s = s ? s + 3 : url;
  size_t len;
  int rc = fr_dir_url_ns(url, u.ns, sizeof u.ns, &len);
  if (rc != 0)
    return rc;
  const char *end = url + len;
  if (memchr(s, '@', (size_t)(end - s)) || memchr(s, '/', (size_t)(end - s)))
    return etcd_bad(url, "etcd:// takes members only: no user, password or path");
  while (rc == 0) {
    const char *comma = memchr(s, ',', (size_t)(end - s));
    size_t n = comma ? (size_t)(comma - s) : (size_t)(end - s);
    if (u.n == FR_ETCD_MEMBERS_MAX)
      return etcd_bad(url, "too many members");
    rc = etcd_member(url, s, n, u.host[u.n], sizeof u.host[u.n], &u.port[u.n]);
    u.n++;
    if (!comma)
      break;
    s = comma + 1;
  }
  if (rc == 0)
    *out = u;
  return rc;
}
