/*
 * The etcd backend's transport (etcd_http.c): one HTTP/1.1 keep-alive connection to one etcd
 * member's v3 JSON gateway over a plain socket, every wait a poll() bounded by the caller's
 * deadline, responses with a Content-Length or chunked (the gateway streams keep-alives and
 * watches chunked), and the base64 the gateway wraps keys and values in. Nothing a server sends
 * is trusted: sizes are bounded and every length and digit is checked.
 */
#ifndef FR_DIRECTORY_ETCD_HTTP_H
#define FR_DIRECTORY_ETCD_HTTP_H

#include "directory/directory.h"

#define FR_HTTP_HEAD_MAX 16384       /* bytes of a response's status line and headers */
#define FR_HTTP_BODY_MAX (64u << 20) /* bytes of a whole response body read at once */

typedef struct fr_http {
  int fd;         /* -1: not connected */
  int wake_fd;    /* -1, or an fd whose readability ends every wait (FERRY_ECLOSED) */
  char name[280]; /* "HOST:PORT": messages and the Host header */
  char *buf;      /* received and not consumed: buf[pos..len) */
  size_t pos, len, cap;
  /* the response body being read */
  bool chunked, ended, close_after;
  uint64_t left;  /* bytes left of the Content-Length body or of the current chunk */
  bool in_chunk;  /* chunked: inside a chunk's data (left counts it) */
  bool need_crlf; /* chunked: the CRLF after a chunk's data is still to be read */
} fr_http;

void fr_http_init(fr_http *h);
/* Connects to host:port by the deadline (host resolved with getaddrinfo: a name or a numeric
 * address). FERRY_ECONNECT (refused, unreachable, no such host), FERRY_ETIMEDOUT; the detail
 * names the member. */
int fr_http_dial(fr_http *h, const char *host, int port, uint64_t deadline);
void fr_http_close(fr_http *h);
/* POSTs a JSON body to path. FERRY_ECONNECT (the connection broke), FERRY_ETIMEDOUT. */
int fr_http_post(fr_http *h, const char *path, const char *body, size_t n, uint64_t deadline);
/* Reads the response's status line and headers: *status (100..599). FERRY_EPROTO for anything
 * that is not HTTP/1.x or a body of no known length. */
int fr_http_head(fr_http *h, int *status, uint64_t deadline);
/* The next bytes of the body: *p and *n, valid until the next call; *n == 0 when it ended (the
 * connection is then ready for the next request, or closed when the server said so). */
int fr_http_body_some(fr_http *h, const char **p, size_t *n, uint64_t deadline);
/* The whole body, malloc'd and NUL-terminated (*out, *n); FERRY_EPROTO past max bytes. */
int fr_http_body_all(fr_http *h, char **out, size_t *n, size_t max, uint64_t deadline);

/* base64 (RFC 4648, padded): the encoding of n bytes, malloc'd (NULL: no memory). */
char *fr_b64_encode(const void *p, size_t n);
/* Decodes len characters of s into out (cap bytes): false when not well-formed or too long. */
bool fr_b64_decode(const char *s, size_t len, uint8_t *out, size_t cap, size_t *n);

#endif
