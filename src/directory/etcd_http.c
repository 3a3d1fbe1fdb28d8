/*
 * HTTP/1.1 to one etcd member's v3 JSON gateway, for the etcd directory backend (etcd.c). libcurl
 * would be the usual client, but its -dev package is not among ferry's build dependencies, and
 * the gateway needs little: POST with a JSON body on a kept-alive connection, and a response
 * with a Content-Length or chunked (keep-alives and watches stream). So this is a small client
 * over a nonblocking socket whose every wait is a poll() bounded by the caller's deadline: a
 * member that stops answering costs a call what it has left, never more. Lengths, chunk sizes
 * and header sizes from the server are checked and bounded. base64 (the gateway's encoding of
 * keys and values) is here too.
 */
#include "directory/etcd_http.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <fcntl.h>
#include <unistd.h>

void fr_http_init(fr_http *h) {
  memset(h, 0, sizeof *h);
  h->fd = -1;
  h->wake_fd = -1;
}

void fr_http_close(fr_http *h) {
  if (h->fd >= 0)
    close(h->fd);
  h->fd = -1;
  free(h->buf);
  h->buf = NULL;
  h->pos = h->len = h->cap = 0;
}

/* Waits for events on the socket until the deadline: 0, FERRY_ETIMEDOUT, or FERRY_ECLOSED when
 * the wake fd fired. */
static int wait_io(fr_http *h, short events, uint64_t deadline) {
  for (;;) {
    int ms = fr_ms_left(deadline);
    if (ms <= 0)
      return fr_err(FERRY_ETIMEDOUT, "etcd member %s did not answer in time", h->name);
    struct pollfd p[2] = {{.fd = h->fd, .events = events}, {.fd = h->wake_fd, .events = POLLIN}};
    int n = poll(p, h->wake_fd >= 0 ? 2 : 1, ms);
    if (n < 0 && errno != EINTR)
      return fr_err_errno(FERRY_ECONNECT, "etcd member %s: poll", h->name);
    if (n > 0 && h->wake_fd >= 0 && (p[1].revents & POLLIN))
      return fr_err(FERRY_ECLOSED, "etcd member %s: the client is closing", h->name);
    if (n > 0)
      return 0;
  }
}

static int dial_one(fr_http *h, const struct addrinfo *ai, uint64_t deadline) {
  int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
  if (fd < 0)
    return fr_err_errno(FERRY_ECONNECT, "etcd member %s: socket", h->name);
  h->fd = fd;
  if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
    int rc = fr_err_errno(FERRY_ECONNECT, "cannot reach etcd member %s", h->name);
    fr_http_close(h);
    return rc;
  }
  int rc = wait_io(h, POLLOUT, deadline);
  int err = 0;
  socklen_t len = sizeof err;
  if (rc == 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err) {
    errno = err;
    rc = fr_err_errno(FERRY_ECONNECT, "cannot reach etcd member %s", h->name);
  }
  if (rc != 0) {
    fr_http_close(h);
    return rc;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return 0;
}

int fr_http_dial(fr_http *h, const char *host, int port, uint64_t deadline) {
  fr_http_close(h);
  snprintf(h->name, sizeof h->name, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
  char service[16];
  snprintf(service, sizeof service, "%d", port);
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
  int g = fr_resolve(host, service, &hints, deadline, &ai);
  if (g != 0)
    return fr_err(g == FR_RESOLVE_TIMEDOUT ? FERRY_ETIMEDOUT : FERRY_ECONNECT, "etcd member %s: %s",
                  h->name, fr_resolve_strerror(g));
  int rc = FERRY_ECONNECT;
  for (struct addrinfo *a = ai; a; a = a->ai_next)
    if ((rc = dial_one(h, a, deadline)) == 0 || rc == FERRY_ETIMEDOUT)
      break;
  freeaddrinfo(ai);
  h->ended = true;
  return rc;
}

static int send_all(fr_http *h, const char *p, size_t n, uint64_t deadline) {
  while (n > 0) {
    ssize_t w = send(h->fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p += w;
      n -= (size_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
      return fr_err_errno(FERRY_ECONNECT, "etcd member %s: send", h->name);
    int rc = wait_io(h, POLLOUT, deadline);
    if (rc != 0)
      return rc;
  }
  return 0;
}

int fr_http_post(fr_http *h, const char *path, const char *body, size_t n, uint64_t deadline) {
  if (h->fd < 0)
    return fr_err(FERRY_ECONNECT, "etcd member %s: not connected", h->name);
  char head[512];
  int hn = snprintf(head, sizeof head,
                    "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                    "Content-Length: %zu\r\n\r\n",
                    path, h->name, n);
  if (hn < 0 || (size_t)hn >= sizeof head)
    return fr_err(FERRY_EINVAL, "etcd request to %s: path too long", h->name);
  h->ended = false;
  int rc = send_all(h, head, (size_t)hn, deadline);
  return rc ? rc : send_all(h, body, n, deadline);
}

/* Receives more bytes into buf (growing it to at most limit unread bytes). */
static int fill(fr_http *h, size_t limit, uint64_t deadline) {
  if (h->pos > 0 && h->pos == h->len)
    h->pos = h->len = 0;
  if (h->pos > 0 && h->len - h->pos < h->cap / 2) { /* slide the unread bytes down */
    memmove(h->buf, h->buf + h->pos, h->len - h->pos);
    h->len -= h->pos;
    h->pos = 0;
  }
  if (h->len - h->pos >= limit)
    return fr_err(FERRY_EPROTO, "etcd member %s: response too large", h->name);
  if (h->cap - h->len < 4096) {
    size_t cap = h->cap ? 2 * h->cap : 16384;
    char *b = realloc(h->buf, cap);
    if (!b)
      return fr_err(FERRY_ENOMEM, "etcd response");
    h->buf = b;
    h->cap = cap;
  }
  for (;;) {
    ssize_t r = recv(h->fd, h->buf + h->len, h->cap - h->len, MSG_DONTWAIT);
    if (r > 0) {
      h->len += (size_t)r;
      return 0;
    }
    if (r == 0)
      return fr_err(FERRY_ECONNECT, "etcd member %s closed the connection", h->name);
    if (errno == EINTR)
      continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      return fr_err_errno(FERRY_ECONNECT, "etcd member %s: recv", h->name);
    int rc = wait_io(h, POLLIN, deadline);
    if (rc != 0)
      return rc;
  }
}

/* A line ending in CRLF at buf[pos..]: its length without the CRLF, or -1 when none yet. */
static long line_at(const fr_http *h) {
  if (!h->buf)
    return -1;
  const char *s = h->buf + h->pos;
  const char *e = memmem(s, h->len - h->pos, "\r\n", 2);
  return e ? (long)(e - s) : -1;
}

/* A decimal (or, for chunk sizes, hex) number of n characters, every one a digit; false when not
 * one or above max. */
static bool number_of(const char *s, size_t n, int base, uint64_t max, uint64_t *out) {
  uint64_t v = 0;
  if (n == 0)
    return false;
  for (size_t i = 0; i < n; i++) {
    int d = s[i] >= '0' && s[i] <= '9'                 ? s[i] - '0'
            : base == 16 && s[i] >= 'a' && s[i] <= 'f' ? s[i] - 'a' + 10
            : base == 16 && s[i] >= 'A' && s[i] <= 'F' ? s[i] - 'A' + 10
                                                       : -1;
    if (d < 0 || v > (max - (uint64_t)d) / (uint64_t)base)
      return false;
    v = v * (uint64_t)base + (uint64_t)d;
  }
  *out = v;
  return true;
}

static bool header_is(const char *s, size_t n, const char *name, const char **value, size_t *vn) {
  size_t k = strlen(name);
  if (n <= k || strncasecmp(s, name, k) != 0 || s[k] != ':')
    return false;
  const char *v = s + k + 1, *e = s + n;
  while (v < e && (*v == ' ' || *v == '\t'))
    v++;
  while (e > v && (e[-1] == ' ' || e[-1] == '\t'))
    e--;
  *value = v;
  *vn = (size_t)(e - v);
  return true;
}

/* One header line of n bytes at s. */
static int header(fr_http *h, const char *s, size_t n, bool *has_length) {
  const char *v;
  size_t vn;
  if (header_is(s, n, "Content-Length", &v, &vn)) {
    if (!number_of(v, vn, 10, FR_HTTP_BODY_MAX, &h->left))
      return fr_err(FERRY_EPROTO, "etcd member %s: bad Content-Length", h->name);
    *has_length = true;
  } else if (header_is(s, n, "Transfer-Encoding", &v, &vn)) {
    if (vn != 7 || strncasecmp(v, "chunked", 7) != 0)
      return fr_err(FERRY_EPROTO, "etcd member %s: unknown Transfer-Encoding", h->name);
    h->chunked = true;
  } else if (header_is(s, n, "Connection", &v, &vn)) {
    h->close_after = vn == 5 && strncasecmp(v, "close", 5) == 0;
  }
  return 0;
}

int fr_http_head(fr_http *h, int *status, uint64_t deadline) {
  h->chunked = h->close_after = h->in_chunk = h->need_crlf = false;
  h->left = 0;
  bool has_length = false, first = true;
  for (;;) {
    long n = line_at(h);
    if (n < 0) {
      int rc = fill(h, FR_HTTP_HEAD_MAX, deadline);
      if (rc != 0)
        return rc;
      continue;
    }
    const char *s = h->buf + h->pos;
    h->pos += (size_t)n + 2;
    if (first) {
      uint64_t code;
      if (n < 12 || strncmp(s, "HTTP/1.", 7) != 0 || s[8] != ' ' ||
          !number_of(s + 9, 3, 10, 599, &code) || code < 100)
        return fr_err(FERRY_EPROTO, "etcd member %s: not an HTTP/1.x response", h->name);
      *status = (int)code;
      first = false;
      continue;
    }
    if (n == 0)
      break;
    int rc = header(h, s, (size_t)n, &has_length);
    if (rc != 0)
      return rc;
  }
  if (*status == 100) /* "continue": the real head follows */
    return fr_http_head(h, status, deadline);
  if (!h->chunked && !has_length)
    return fr_err(FERRY_EPROTO, "etcd member %s: a response of no known length", h->name);
  h->ended = !h->chunked && h->left == 0;
  return 0;
}

/* Chunked: reads the CRLF that ends the last chunk's data, then the next chunk-size line (and
 * the trailers after the last one). Consumes nothing it did not read whole, so a timeout leaves
 * the stream where it was. */
static int chunk_head(fr_http *h, uint64_t deadline) {
  long n;
  if (h->need_crlf) {
    while (h->len - h->pos < 2) {
      int rc = fill(h, 1024, deadline);
      if (rc != 0)
        return rc;
    }
    if (memcmp(h->buf + h->pos, "\r\n", 2) != 0)
      return fr_err(FERRY_EPROTO, "etcd member %s: a chunk without its CRLF", h->name);
    h->pos += 2;
    h->need_crlf = false;
  }
  while ((n = line_at(h)) < 0) {
    int rc = fill(h, 1024, deadline);
    if (rc != 0)
      return rc;
  }
  const char *s = h->buf + h->pos;
  size_t digits = strspn(s, "0123456789abcdefABCDEF");
  if (digits > (size_t)n || !number_of(s, digits, 16, FR_HTTP_BODY_MAX, &h->left))
    return fr_err(FERRY_EPROTO, "etcd member %s: bad chunk size", h->name);
  h->pos += (size_t)n + 2;
  if (h->left > 0) {
    h->in_chunk = true;
    return 0;
  }
  for (;;) { /* the last chunk: trailers up to an empty line */
    while ((n = line_at(h)) < 0) {
      int rc = fill(h, FR_HTTP_HEAD_MAX, deadline);
      if (rc != 0)
        return rc;
    }
    h->pos += (size_t)n + 2;
    if (n == 0)
      break;
  }
  h->ended = true;
  return 0;
}

static void body_ended(fr_http *h) {
  h->ended = true;
  if (h->close_after && h->fd >= 0) {
    close(h->fd);
    h->fd = -1;
  }
}

int fr_http_body_some(fr_http *h, const char **p, size_t *n, uint64_t deadline) {
  *n = 0;
  if (h->ended) {
    body_ended(h);
    return 0;
  }
  if (h->chunked && !h->in_chunk) {
    int rc = chunk_head(h, deadline);
    if (rc != 0 || h->ended) {
      if (rc == 0)
        body_ended(h);
      return rc;
    }
  }
  if (h->pos == h->len) {
    int rc = fill(h, FR_HTTP_BODY_MAX, deadline);
    if (rc != 0)
      return rc;
  }
  size_t have = h->len - h->pos;
  size_t take = have < h->left ? have : (size_t)h->left;
  *p = h->buf + h->pos;
  *n = take;
  h->pos += take;
  h->left -= take;
  if (h->left == 0 && h->chunked) { /* its CRLF is read before the next chunk's size */
    h->in_chunk = false;
    h->need_crlf = true;
  } else if (h->left == 0) {
    h->ended = true;
  }
  return 0;
}

int fr_http_body_all(fr_http *h, char **out, size_t *outn, size_t max, uint64_t deadline) {
  char *body = NULL;
  size_t len = 0;
  int rc = 0;
  for (;;) {
    const char *p;
    size_t n;
    if ((rc = fr_http_body_some(h, &p, &n, deadline)) != 0)
      break;
    if (n == 0 && h->ended)
      break;
    if (len + n > max) {
      rc = fr_err(FERRY_EPROTO, "etcd member %s: a response over %zu bytes", h->name, max);
      break;
    }
    char *b = realloc(body, len + n + 1);
    if (!b) {
      rc = fr_err(FERRY_ENOMEM, "etcd response");
      break;
    }
    body = b;
    memcpy(body + len, p, n);
    len += n;
  }
  if (rc == 0 && !body && !(body = malloc(1)))
    rc = fr_err(FERRY_ENOMEM, "etcd response");
  if (rc != 0) {
    free(body);
    return rc;
  }
  body[len] = '\0';
  *out = body;
  *outn = len;
  return 0;
}

/* ---- base64 ---- */

static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

char *fr_b64_encode(const void *data, size_t n) {
  const uint8_t *p = data;
  char *out = malloc(4 * ((n + 2) / 3) + 1), *o = out;
  if (!out)
    return NULL;
  for (size_t i = 0; i < n; i += 3) {
    uint32_t v = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0) |
                 (i + 2 < n ? p[i + 2] : 0);
    *o++ = b64[v >> 18];
    *o++ = b64[(v >> 12) & 63];
    *o++ = i + 1 < n ? b64[(v >> 6) & 63] : '=';
    *o++ = i + 2 < n ? b64[v & 63] : '=';
  }
  *o = '\0';
  return out;
}

static int b64_value(char c) {
  const char *d = c ? strchr(b64, c) : NULL;
  return d ? (int)(d - b64) : -1;
}

bool fr_b64_decode(const char *s, size_t len, uint8_t *out, size_t cap, size_t *n) {
  if (len % 4)
    return false;
  size_t o = 0;
  for (size_t i = 0; i < len; i += 4) {
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; k++) {
      bool last = i + 4 == len;
      if (last && k >= 2 && s[i + k] == '=' && (k == 3 || s[i + 3] == '=')) {
        v[k] = 0;
        pad++;
        continue;
      }
      if ((v[k] = b64_value(s[i + k])) < 0)
        return false;
    }
    uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
    size_t bytes = 3 - (size_t)pad;
    if (o + bytes > cap)
      return false;
    uint8_t b[3] = {(uint8_t)(w >> 16), (uint8_t)(w >> 8), (uint8_t)w};
    memcpy(out + o, b, bytes);
    o += bytes;
  }
  *n = o;
  return true;
}
