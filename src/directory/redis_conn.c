/*
 * The Redis backend's connection (redis.c runs the commands): one nonblocking TCP socket, TLS
 * through OpenSSL for rediss:// (Debian 12's hiredis 0.14 has no SSL support: it arrived in
 * hiredis 1.0), and hiredis's protocol parts on top: redisFormatCommandArgv writes a command,
 * a redisReader parses the replies. Every step (connect, TLS handshake, each send and read)
 * waits in poll() no later than the caller's deadline, so a server that accepts but never
 * answers costs a call its own timeout. Plain redis:// takes the same path without TLS. Also here:
 * asking a redis+sentinel:// URL's sentinels where the primary is. Messages name the server by a
 * redacted URL, never a password.
 */
#include "directory/redis_conn.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

struct fr_rconn {
  int fd;
  SSL *ssl;
  redisReader *rd;
  char *out; /* commands appended, not yet sent */
  size_t out_len, out_cap;
  char shown[FR_DIR_ADDRESS_MAX + 320]; /* the server, for messages */
};

/* ---- TLS settings ---- */

/* A URL's value, else the FERRY_* setting's (empty: none). */
static const char *tls_file(const char *from_url, const char *setting) {
  return from_url[0] ? from_url : fr_config_str(setting);
}

int fr_rtls_new(const fr_redis_url *u, const char *shown, fr_rtls **out) {
  const char *ca = tls_file(u->ca, "FERRY_REDIS_TLS_CA");
  const char *cert = tls_file(u->cert, "FERRY_REDIS_TLS_CERT");
  const char *key = tls_file(u->key, "FERRY_REDIS_TLS_KEY");
  SSL_CTX *t = SSL_CTX_new(TLS_client_method());
  if (!t)
    return fr_err(FERRY_ENOMEM, "Redis at %s: TLS context", shown);
  SSL_CTX_set_min_proto_version(t, TLS1_2_VERSION);
  SSL_CTX_set_verify(t, SSL_VERIFY_PEER, NULL);
  SSL_CTX_set_mode(t, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  int rc = 0;
  ERR_clear_error();
  if (ca[0] ? SSL_CTX_load_verify_locations(t, ca, NULL) != 1
            : SSL_CTX_set_default_verify_paths(t) != 1)
    rc = fr_err(FERRY_EINVAL, "Redis at %s: cannot read the CA certificates %s (?ca=PATH)", shown,
                ca[0] ? ca : "of the system's store");
  else if (!cert[0] != !key[0])
    rc = fr_err(FERRY_EINVAL,
                "Redis at %s: a client certificate needs both ?cert=PATH and ?key=PATH", shown);
  else if (cert[0] && SSL_CTX_use_certificate_chain_file(t, cert) != 1)
    rc = fr_err(FERRY_EINVAL, "Redis at %s: cannot read the client certificate %s (?cert=)", shown,
                cert);
  else if (key[0] && (SSL_CTX_use_PrivateKey_file(t, key, SSL_FILETYPE_PEM) != 1 ||
                      SSL_CTX_check_private_key(t) != 1))
    rc = fr_err(FERRY_EINVAL,
                "Redis at %s: cannot read the client key %s, or it does not match %s (?key=)",
                shown, key, cert);
  ERR_clear_error();
  if (rc != 0) {
    SSL_CTX_free(t);
    return rc;
  }
  *out = t;
  return 0;
}

void fr_rtls_free(fr_rtls *tls) { SSL_CTX_free(tls); }

/* ---- waiting and failing ---- */

static int timed_out(const fr_rconn *c, const char *what, int timeout_ms) {
  return fr_err(FERRY_ETIMEDOUT, "Redis at %s did not answer %s within %d ms", c->shown, what,
                timeout_ms);
}

static int broken(const fr_rconn *c, const char *what, const char *why) {
  return fr_err(FERRY_ECONNECT, "Redis at %s: %s: %s", c->shown, what, why);
}

/* Waits until c's socket is ready for `events`; FERRY_ETIMEDOUT at the deadline. */
static int wait_fd(const fr_rconn *c, short events, const char *what, uint64_t deadline,
                   int timeout_ms) {
  for (;;) {
    int ms = fr_ms_left(deadline);
    if (ms <= 0)
      return timed_out(c, what, timeout_ms);
    struct pollfd p = {.fd = c->fd, .events = events};
    int n = poll(&p, 1, ms);
    if (n > 0)
      return 0;
    if (n < 0 && errno != EINTR)
      return broken(c, what, strerror(errno));
  }
}

/* OpenSSL's reason for the last failure on this thread (or errno's, or "closed"). */
static const char *tls_reason(char *buf, size_t cap, int ssl_error) {
  unsigned long e = ERR_get_error();
  if (e)
    ERR_error_string_n(e, buf, cap);
  else if (ssl_error == SSL_ERROR_SYSCALL && errno)
    fr_str_copy(buf, cap, strerror(errno));
  else
    fr_str_copy(buf, cap, "the server closed the connection");
  ERR_clear_error();
  return buf;
}

/* OpenSSL writes with write(): a peer that closed would raise SIGPIPE in an application that
 * does not ignore it. The signal is blocked on this thread around the write and any it raised
 * is taken back. */
typedef struct nopipe {
  sigset_t old;
  bool was_pending;
} nopipe;

static void nopipe_begin(nopipe *g) {
  sigset_t pipe_set, pending;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  sigpending(&pending);
  g->was_pending = sigismember(&pending, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &g->old);
}

static void nopipe_end(nopipe *g) {
  sigset_t pipe_set, pending;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  sigpending(&pending);
  if (!g->was_pending && sigismember(&pending, SIGPIPE)) {
    struct timespec none = {0, 0};
    sigtimedwait(&pipe_set, NULL, &none);
  }
  pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

/* ---- connecting ---- */

/* A nonblocking connect to one address within the deadline: the socket, or -1 with *err
 * (an errno, ETIMEDOUT at the deadline). */
static int connect_one(const struct addrinfo *a, uint64_t deadline, int *err) {
  int fd = socket(a->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  int rc = connect(fd, a->ai_addr, a->ai_addrlen);
  if (rc != 0 && errno == EINPROGRESS) {
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    int n;
    do
      n = poll(&p, 1, fr_ms_left(deadline));
    while (n < 0 && errno == EINTR);
    int so = n == 0 ? ETIMEDOUT : n < 0 ? errno : 0;
    socklen_t len = sizeof so;
    if (n > 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &len) != 0)
      so = errno;
    errno = so;
    rc = so ? -1 : 0;
  }
  if (rc != 0) {
    *err = errno;
    close(fd);
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  return fd;
}

static int dial_tcp(fr_rconn *c, const char *host, int port, uint64_t deadline, int timeout_ms) {
  char service[16];
  snprintf(service, sizeof service, "%d", port);
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
  int g = fr_resolve(host, service, &hints, deadline, &ai);
  if (g == FR_RESOLVE_TIMEDOUT)
    return fr_err(FERRY_ETIMEDOUT,
                  "cannot reach Redis at %s: the name service did not resolve %s within %d ms",
                  c->shown, host, timeout_ms);
  if (g != 0)
    return fr_err(FERRY_ECONNECT, "cannot reach Redis at %s: %s: %s", c->shown, host,
                  fr_resolve_strerror(g));
  int err = ECONNREFUSED;
  for (struct addrinfo *a = ai; a && c->fd < 0 && err != ETIMEDOUT; a = a->ai_next)
    c->fd = connect_one(a, deadline, &err);
  freeaddrinfo(ai);
  if (c->fd >= 0)
    return 0;
  if (err == ETIMEDOUT)
    return timed_out(c, "a connection", timeout_ms);
  return fr_err(FERRY_ECONNECT, "cannot reach Redis at %s: %s (is redis-server running there?)",
                c->shown, strerror(err));
}

/* The handshake's failure: the certificate (FERRY_EAUTH: not the server the URL names, or a CA
 * the client was not given), or anything else (not a TLS port, a reset). */
static int handshake_failed(const fr_rconn *c, int ssl_error) {
  long v = SSL_get_verify_result(c->ssl);
  char why[256];
  tls_reason(why, sizeof why, ssl_error);
  if (v != X509_V_OK)
    return fr_err(FERRY_EAUTH,
                  "Redis at %s: certificate verify failed: %s (the CA is ?ca=PATH or "
                  "FERRY_REDIS_TLS_CA, else the system's store; the name checked is the URL's "
                  "host)",
                  c->shown, X509_verify_cert_error_string(v));
  return fr_err(FERRY_ECONNECT,
                "Redis at %s: TLS handshake failed: %s (is this redis-server's --tls-port?)",
                c->shown, why);
}

static int handshake(fr_rconn *c, fr_rtls *tls, const char *host, uint64_t deadline,
                     int timeout_ms) {
  c->ssl = SSL_new(tls);
  if (!c->ssl || SSL_set_fd(c->ssl, c->fd) != 1)
    return fr_err(FERRY_ENOMEM, "Redis at %s: TLS", c->shown);
  unsigned char ip[16];
  bool numeric = inet_pton(AF_INET, host, ip) == 1 || inet_pton(AF_INET6, host, ip) == 1;
  X509_VERIFY_PARAM *p = SSL_get0_param(c->ssl);
  if (numeric)
    X509_VERIFY_PARAM_set1_ip_asc(p, host);
  else {
    SSL_set_tlsext_host_name(c->ssl, host);
    X509_VERIFY_PARAM_set1_host(p, host, 0);
  }
  for (;;) {
    ERR_clear_error();
    nopipe g;
    nopipe_begin(&g);
    int r = SSL_connect(c->ssl);
    nopipe_end(&g);
    if (r == 1)
      return 0;
    int e = SSL_get_error(c->ssl, r);
    if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE)
      return handshake_failed(c, e);
    int rc = wait_fd(c, e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, "the TLS handshake", deadline,
                     timeout_ms);
    if (rc != 0)
      return rc;
  }
}

int fr_rconn_open(const char *host, int port, fr_rtls *tls, const char *shown, uint64_t deadline,
                  int timeout_ms, fr_rconn **out) {
  fr_rconn *c = calloc(1, sizeof *c);
  if (!c)
    return fr_err(FERRY_ENOMEM, "Redis connection");
  c->fd = -1;
  fr_str_copy(c->shown, sizeof c->shown, shown);
  c->rd = redisReaderCreate();
  int rc = c->rd ? 0 : fr_err(FERRY_ENOMEM, "Redis connection");
  if (rc == 0 && fr_ms_left(deadline) <= 0)
    rc = timed_out(c, "a connection", timeout_ms);
  if (rc == 0)
    rc = dial_tcp(c, host, port, deadline, timeout_ms);
  if (rc == 0 && tls)
    rc = handshake(c, tls, host, deadline, timeout_ms);
  if (rc != 0) {
    fr_rconn_close(c);
    return rc;
  }
  *out = c;
  return 0;
}

void fr_rconn_close(fr_rconn *c) {
  if (!c)
    return;
  SSL_free(c->ssl); /* no close_notify: the connection may be broken, or a reply late */
  if (c->fd >= 0)
    close(c->fd);
  if (c->rd)
    redisReaderFree(c->rd);
  free(c->out);
  free(c);
}

/* ---- commands and replies ---- */

/* At most n bytes out: how many (> 0), 0 when the socket wants `*want` first, < 0 on failure
 * (the detail set). */
static ssize_t write_some(fr_rconn *c, const char *p, size_t n, short *want, const char *what) {
  if (!c->ssl) {
    ssize_t w = send(c->fd, p, n, MSG_NOSIGNAL);
    if (w >= 0 || errno == EAGAIN || errno == EINTR) {
      *want = POLLOUT;
      return w > 0 ? w : 0;
    }
    return broken(c, what, strerror(errno));
  }
  ERR_clear_error();
  nopipe g;
  nopipe_begin(&g);
  int w = SSL_write(c->ssl, p, (int)(n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n));
  nopipe_end(&g);
  if (w > 0)
    return w;
  int e = SSL_get_error(c->ssl, w);
  if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
    *want = e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT;
    return 0;
  }
  char why[256];
  return broken(c, what, tls_reason(why, sizeof why, e));
}

static int write_all(fr_rconn *c, const char *p, size_t n, const char *what, uint64_t deadline,
                     int timeout_ms) {
  while (n > 0) {
    short want = POLLOUT;
    ssize_t w = write_some(c, p, n, &want, what);
    if (w < 0)
      return (int)w;
    p += w;
    n -= (size_t)w;
    int rc = n && w == 0 ? wait_fd(c, want, what, deadline, timeout_ms) : 0;
    if (rc != 0)
      return rc;
  }
  return 0;
}

int fr_rconn_append(fr_rconn *c, int argc, const char **argv, const size_t *lens) {
  char *cmd = NULL;
  int len = redisFormatCommandArgv(&cmd, argc, argv, lens);
  if (len < 0 || FR_GROW(c->out, c->out_cap, c->out_len + (size_t)len, 4096) != 0) {
    redisFreeCommand(cmd);
    return fr_err(FERRY_ENOMEM, "Redis %s: formatting the command", argv[0]);
  }
  memcpy(c->out + c->out_len, cmd, (size_t)len);
  c->out_len += (size_t)len;
  redisFreeCommand(cmd);
  return 0;
}

/* Sends what was appended. */
static int flush(fr_rconn *c, const char *what, uint64_t deadline, int timeout_ms) {
  int rc = c->out_len ? write_all(c, c->out, c->out_len, what, deadline, timeout_ms) : 0;
  c->out_len = 0;
  return rc;
}

int fr_rconn_send(fr_rconn *c, int argc, const char **argv, const size_t *lens, uint64_t deadline,
                  int timeout_ms) {
  int rc = fr_rconn_append(c, argc, argv, lens);
  return rc == 0 ? flush(c, argv[0], deadline, timeout_ms) : rc;
}

/* Reads what the server sent into the reader: > 0 bytes, 0 when the socket wants `*want`
 * first, < 0 on failure (the detail set). */
static ssize_t read_some(fr_rconn *c, short *want, const char *what) {
  char buf[16384];
  ssize_t n;
  *want = POLLIN;
  if (!c->ssl) {
    n = recv(c->fd, buf, sizeof buf, 0);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
      return 0;
    if (n < 0)
      return broken(c, what, strerror(errno));
  } else {
    ERR_clear_error();
    errno = 0;
    int r = SSL_read(c->ssl, buf, sizeof buf);
    int e = r > 0 ? SSL_ERROR_NONE : SSL_get_error(c->ssl, r);
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
      *want = e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT;
      return 0;
    }
    char why[256];
    if (e != SSL_ERROR_NONE && e != SSL_ERROR_ZERO_RETURN)
      return broken(c, what, tls_reason(why, sizeof why, e));
    n = r > 0 ? r : 0;
  }
  if (n == 0)
    return broken(c, what, "the server closed the connection");
  if (redisReaderFeed(c->rd, buf, (size_t)n) != REDIS_OK)
    return fr_err(FERRY_ENOMEM, "Redis at %s: reading a reply", c->shown);
  return n;
}

int fr_rconn_reply(fr_rconn *c, redisReply **out, const char *what, uint64_t deadline,
                   int timeout_ms) {
  int rc = flush(c, what, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  for (;;) {
    void *rep = NULL;
    if (redisReaderGetReply(c->rd, &rep) != REDIS_OK)
      return fr_err(FERRY_EPROTO, "Redis at %s: %s: a malformed reply (%s)", c->shown, what,
                    c->rd->errstr);
    if (rep) {
      *out = rep;
      return 0;
    }
    /* the reply is rarely there yet: wait for it first rather than try a read that would find
     * nothing (one system call less per command), unless TLS holds bytes already read */
    short want = POLLIN;
    bool buffered = c->ssl && SSL_has_pending(c->ssl);
    ssize_t n = 0;
    do {
      rc = buffered ? 0 : wait_fd(c, want, what, deadline, timeout_ms);
      buffered = false;
      n = rc == 0 ? read_some(c, &want, what) : rc;
    } while (n == 0);
    if (n < 0)
      return (int)n;
  }
}

int fr_rconn_call(fr_rconn *c, int argc, const char **argv, const size_t *lens, redisReply **out,
                  uint64_t deadline, int timeout_ms) {
  int rc = fr_rconn_send(c, argc, argv, lens, deadline, timeout_ms);
  return rc == 0 ? fr_rconn_reply(c, out, argv[0], deadline, timeout_ms) : rc;
}

/* ---- sentinels ---- */

/* AUTH on a sentinel, with the URL's credentials: a sentinel without a password (the common
 * case: only the data nodes have one) answers that none is set, which is fine. */
static int sentinel_auth(fr_rconn *c, const fr_redis_url *u, uint64_t deadline, int timeout_ms) {
  const char *argv[3] = {"AUTH", u->user[0] ? u->user : u->password, u->password};
  redisReply *rep;
  int rc = fr_rconn_call(c, u->user[0] ? 3 : 2, argv, NULL, &rep, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  if (rep->type == REDIS_REPLY_ERROR && !strstr(rep->str, "no password") &&
      !strstr(rep->str, "without any password"))
    rc = fr_err(FERRY_EAUTH, "Redis at %s refused the password (AUTH): %s", c->shown, rep->str);
  freeReplyObject(rep);
  return rc;
}

static int sentinel_ask(fr_rconn *c, const fr_redis_url *u, char *host, size_t cap, int *port,
                        uint64_t deadline, int timeout_ms) {
  const char *argv[3] = {"SENTINEL", "get-master-addr-by-name", u->master};
  redisReply *rep;
  int rc = fr_rconn_call(c, 3, argv, NULL, &rep, deadline, timeout_ms);
  if (rc != 0)
    return rc;
  if (rep->type == REDIS_REPLY_ARRAY && rep->elements == 2 &&
      rep->element[0]->type == REDIS_REPLY_STRING && rep->element[1]->type == REDIS_REPLY_STRING) {
    fr_str_copy(host, cap, rep->element[0]->str);
    *port = atoi(rep->element[1]->str);
  } else if (rep->type == REDIS_REPLY_ERROR)
    rc = fr_err(FERRY_EPROTO, "Redis at %s: %s", c->shown, rep->str);
  else
    rc = fr_err(FERRY_ENOTFOUND, "Redis at %s knows no primary named '%s'", c->shown, u->master);
  freeReplyObject(rep);
  return rc;
}

int fr_rconn_sentinel_primary(const fr_redis_url *u, uint64_t deadline, int timeout_ms, char *host,
                              size_t cap, int *port) {
  int rc = fr_err(FERRY_EINVAL, "no sentinel in the URL");
  for (int i = 0; i < u->sentinels; i++) {
    /* a sentinel that does not answer gets its share of what is left, not all of it */
    uint64_t now = fr_now_ns(), left = deadline > now ? deadline - now : 0;
    uint64_t mine = now + left / (uint64_t)(u->sentinels - i);
    char shown[FR_DIR_ADDRESS_MAX + 1];
    snprintf(shown, sizeof shown, "sentinel %s:%d", u->sentinel[i].host, u->sentinel[i].port);
    fr_rconn *c = NULL;
    rc = fr_rconn_open(u->sentinel[i].host, u->sentinel[i].port, NULL, shown, mine, timeout_ms, &c);
    if (rc == 0 && u->auth)
      rc = sentinel_auth(c, u, mine, timeout_ms);
    if (rc == 0)
      rc = sentinel_ask(c, u, host, cap, port, mine, timeout_ms);
    fr_rconn_close(c);
    if (rc == 0 || rc == FERRY_EAUTH)
      return rc;
  }
  return rc;
}
