/*
 * One connection to a Redis server or sentinel (redis_conn.c): a nonblocking socket, TLS through
 * OpenSSL for rediss://, and hiredis's protocol parts (redisFormatCommandArgv, redisReader) on
 * top. Every call takes the caller's deadline: it waits in poll() no later than that. Debian 12's
 * hiredis (0.14) has no TLS, hence the stream of our own.
 */
#ifndef FERRY_DIRECTORY_REDIS_CONN_H
#define FERRY_DIRECTORY_REDIS_CONN_H

#include "directory/directory.h"

#include <hiredis/hiredis.h>

typedef struct fr_rconn fr_rconn;
typedef struct ssl_ctx_st fr_rtls; /* OpenSSL's SSL_CTX */

/* The TLS settings of a rediss:// URL: its ?ca= (else FERRY_REDIS_TLS_CA, else the system's
 * store), ?cert= and ?key= (else FERRY_REDIS_TLS_CERT / _KEY; mutual TLS when given). The peer's
 * certificate is always verified, and its name (or IP address) against the URL's host.
 * FERRY_EINVAL naming the file that cannot be read. */
int fr_rtls_new(const fr_redis_url *u, const char *shown, fr_rtls **out);
void fr_rtls_free(fr_rtls *tls);

/* Dials host:port (TLS when tls is not NULL) within the deadline. `shown` names the server in
 * every message of this connection (a redacted URL). FERRY_ECONNECT (refused, reset, not TLS),
 * FERRY_ETIMEDOUT (timeout_ms only words it), FERRY_EAUTH (certificate verify failed). */
int fr_rconn_open(const char *host, int port, fr_rtls *tls, const char *shown, uint64_t deadline,
                  int timeout_ms, fr_rconn **out);
void fr_rconn_close(fr_rconn *c);

/* Queues one command (binary-safe argv; lens NULL: strlen) to be sent with the next send or
 * before the next reply is read (pipelining). */
int fr_rconn_append(fr_rconn *c, int argc, const char **argv, const size_t *lens);
/* Sends whatever was queued, then this command, without waiting for its reply. */
int fr_rconn_send(fr_rconn *c, int argc, const char **argv, const size_t *lens, uint64_t deadline,
                  int timeout_ms);
/* The next reply (the caller frees it with freeReplyObject; an error reply is a reply). `what`
 * words a failure: "Redis at URL did not answer WHAT within N ms". After a failure the
 * connection is of no further use (a late reply would answer the next command): close it. */
int fr_rconn_reply(fr_rconn *c, redisReply **out, const char *what, uint64_t deadline,
                   int timeout_ms);
/* send + reply. */
int fr_rconn_call(fr_rconn *c, int argc, const char **argv, const size_t *lens, redisReply **out,
                  uint64_t deadline, int timeout_ms);

/* redis+sentinel://: asks the URL's sentinels in order (each within its share of what is left
 * of the deadline; AUTH with the URL's credentials when it has them) where the primary named by
 * the URL is. 0 with its host and port, else the last sentinel's failure (FERRY_ENOTFOUND: no
 * primary of that name; FERRY_EAUTH at once on a refused password). */
int fr_rconn_sentinel_primary(const fr_redis_url *u, uint64_t deadline, int timeout_ms, char *host,
                              size_t cap, int *port);

#endif
