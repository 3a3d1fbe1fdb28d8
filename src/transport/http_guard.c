/*
 * What the HTTP servers (ferry serve's metrics and status page, FERRY_METRICS_LISTEN, `ferry ctl
 * serve`) share against slow clients. They run libmicrohttpd with a thread per connection, which
 * closes a connection only after an idle timeout, one that a client trickling a byte every few
 * seconds never reaches, and which refuses every new connection once its limit is reached, a
 * health probe's as well. So here, around it:
 *
 *  - a deadline for a request (FERRY_HTTP_HEADER_MS): a connection that has not sent a whole
 *    request, head and body, within it of being accepted (or of its previous answer) is shut
 *    down by a timer on the process's task pool (core/task.h), however it trickles;
 *  - a new connection that finds the server full, in all or in its address's share, has the
 *    oldest connection still sending a request (of its own address first) shut down to make
 *    room: a trickler ages out, while a request sent at once is read within a millisecond and
 *    is never the oldest for long;
 *  - when nothing can be shut down (every slot is answering a request), a few reserved slots
 *    still admit connections, which are answered on health paths only.
 *
 * Every local user is the same 127.0.0.1, so per-address shares cannot tell a loopback attacker
 * from a probe: the deadline and the shutting down of the oldest are what bound how long a client
 * that is not sending a request can hold a slot. A connection is shut down with shutdown(2),
 * which wakes its thread (it reads the end of the stream and closes); its descriptor stays valid
 * until libmicrohttpd's MHD_CONNECTION_NOTIFY_CLOSED, which removes it from the table under the
 * same lock, so a descriptor number that was reused is never shut down.
 */
#include "transport/http_guard.h"

#include "core/core.h"
#include "core/task.h"

#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#define HEADER_MS_MIN 10

typedef struct slot {
  struct slot *prev, *next;
  struct fr_http_server *srv;
  int fd;
  uint8_t addr[16]; /* the client's address (IPv4 or IPv6 bytes), for its share */
  uint8_t alen;
  uint64_t since; /* fr_now_ns when it began to wait for the request being read */
  bool waiting;   /* a request is being read: the deadline runs */
  bool doomed;    /* shut down: on its way out, counted nowhere */
  bool reserved;  /* admitted past a full server: health paths only */
} slot;

struct fr_http_server {
  char who[48];
  struct MHD_Daemon *d;
  fr_http_limits lim;
  uint64_t deadline_ns;
  MHD_RequestCompletedCallback completed;
  void *cls;
  pthread_mutex_t lock;
  fr_timer watchdog;       /* fires at the first deadline of a connection still sending (lock) */
  uint64_t armed_at;       /* lock: when it fires (0: not armed) */
  slot *head;              /* every connection not yet closed by libmicrohttpd */
  unsigned open, reserved; /* of those not doomed */
};

static void doom(fr_http_server *s, slot *c, const char *why) {
  shutdown(c->fd, SHUT_RDWR);
  c->doomed = true;
  s->open--;
  if (c->reserved)
    s->reserved--;
  fr_debug("%s: closed a connection: %s", s->who, why);
}

/* The waiting connection that began to wait first (of address c's when same_addr), not c. */
static slot *oldest_waiting(fr_http_server *s, const slot *c, bool same_addr) {
  slot *best = NULL;
  for (slot *p = s->head; p; p = p->next)
    if (p != c && !p->doomed && p->waiting &&
        (!same_addr || (p->alen == c->alen && memcmp(p->addr, c->addr, c->alen) == 0)) &&
        (!best || p->since < best->since))
      best = p;
  return best;
}

static unsigned share(const fr_http_server *s, const slot *c) {
  unsigned n = 0;
  for (const slot *p = s->head; p; p = p->next)
    n += !p->doomed && p->alen == c->alen && memcmp(p->addr, c->addr, c->alen) == 0;
  return n;
}

/* Makes room for the new connection c (counted already), or admits it on a reserved slot, or
 * shuts it down. */
static void admit(fr_http_server *s, slot *c) {
  bool own = share(s, c) > s->lim.per_address;
  if (!own && s->open <= s->lim.connections)
    return;
  slot *victim = oldest_waiting(s, c, own);
  if (victim) {
    doom(s, victim,
         own ? "its address holds its whole share; it was the oldest still sending"
             : "the server is full; it was the oldest still sending");
  } else if (s->reserved < s->lim.reserved) {
    c->reserved = true;
    s->reserved++;
  } else {
    doom(s, c, "the server is full, every slot answering a request");
  }
}

/* lock held; c began to wait for a request: the watchdog fires by its deadline. Deadlines only
 * grow (each is now + deadline_ns), so an armed watchdog fires early enough already. */
static void watch(fr_http_server *s, const slot *c) {
  if (s->armed_at)
    return;
  s->armed_at = c->since + s->deadline_ns;
  fr_timer_arm(&s->watchdog, s->armed_at);
}

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
  fr_http_server *s = cls;
  if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
    slot *c = *socket_context;
    if (!c)
      return;
    pthread_mutex_lock(&s->lock);
    if (!c->doomed)
      s->open--, s->reserved -= c->reserved;
    if (c->prev)
      c->prev->next = c->next;
    else
      s->head = c->next;
    if (c->next)
      c->next->prev = c->prev;
    pthread_mutex_unlock(&s->lock);
    free(c);
    *socket_context = NULL;
    return;
  }
  const union MHD_ConnectionInfo *fd =
      MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
  const union MHD_ConnectionInfo *addr =
      MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
  slot *c = fd ? calloc(1, sizeof *c) : NULL;
  if (!c) { /* untracked: not served */
    if (fd)
      shutdown(fd->connect_fd, SHUT_RDWR);
    return;
  }
  c->srv = s;
  c->fd = fd->connect_fd;
  const struct sockaddr *sa = addr ? addr->client_addr : NULL;
  if (sa && sa->sa_family == AF_INET)
    c->alen = 4, memcpy(c->addr, &((const struct sockaddr_in *)sa)->sin_addr, 4);
  else if (sa && sa->sa_family == AF_INET6)
    c->alen = 16, memcpy(c->addr, &((const struct sockaddr_in6 *)sa)->sin6_addr, 16);
  c->since = fr_now_ns();
  c->waiting = true;
  pthread_mutex_lock(&s->lock);
  c->next = s->head;
  if (s->head)
    s->head->prev = c;
  s->head = c;
  s->open++;
  admit(s, c);
  watch(s, c);
  pthread_mutex_unlock(&s->lock);
  *socket_context = c;
}

static slot *slot_of(struct MHD_Connection *conn) {
  const union MHD_ConnectionInfo *i =
      MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  return i ? i->socket_context : NULL;
}

void fr_http_request_read(struct MHD_Connection *conn) {
  slot *c = slot_of(conn);
  if (!c)
    return;
  pthread_mutex_lock(&c->srv->lock);
  c->waiting = false;
  pthread_mutex_unlock(&c->srv->lock);
}

/* c->reserved is set before the connection's thread starts, and never changes. */
bool fr_http_reserved(struct MHD_Connection *conn) {
  slot *c = slot_of(conn);
  return !c || c->reserved;
}

/* A request is done (answered, or its connection closing): the next one's deadline starts. */
static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
  fr_http_server *s = cls;
  slot *c = slot_of(conn);
  if (c) {
    pthread_mutex_lock(&s->lock);
    c->since = fr_now_ns();
    c->waiting = true;
    watch(s, c);
    pthread_mutex_unlock(&s->lock);
  }
  if (s->completed)
    s->completed(s->cls, conn, con_cls, toe);
}

/* The watchdog, on a worker of the task pool: shuts down each connection past its deadline,
 * then arms itself for the next one's (none: it stays unarmed until a connection waits). */
static void watchdog(void *arg) {
  fr_http_server *s = arg;
  pthread_mutex_lock(&s->lock);
  uint64_t now = fr_now_ns(), next = UINT64_MAX;
  for (slot *c = s->head; c; c = c->next) {
    if (c->doomed || !c->waiting)
      continue;
    uint64_t end = c->since + s->deadline_ns;
    if (end <= now)
      doom(s, c, "no whole request within FERRY_HTTP_HEADER_MS");
    else if (end < next)
      next = end;
  }
  s->armed_at = next == UINT64_MAX ? 0 : next;
  if (s->armed_at)
    fr_timer_arm(&s->watchdog, next);
  pthread_mutex_unlock(&s->lock);
}

static int header_ms(void) {
  int64_t ms = fr_config_int("FERRY_HTTP_HEADER_MS");
  if (ms >= HEADER_MS_MIN && ms <= 3600000)
    return (int)ms;
  fr_warn("FERRY_HTTP_HEADER_MS=%lld is outside [%d, 3600000]; using 5000", (long long)ms,
          HEADER_MS_MIN);
  return 5000;
}

int fr_http_start(const char *who, const struct sockaddr *sa, const fr_http_limits *lim,
                  MHD_AccessHandlerCallback handler, void *cls,
                  MHD_RequestCompletedCallback completed, fr_http_server **out) {
  fr_http_server *s = calloc(1, sizeof *s);
  if (!s)
    return fr_err(FERRY_ENOMEM, "%s", who);
  fr_str_copy(s->who, sizeof s->who, who);
  s->lim = *lim;
  s->deadline_ns = (uint64_t)header_ms() * 1000000ull;
  s->completed = completed, s->cls = cls;
  pthread_mutex_init(&s->lock, NULL);
  fr_timer_init(&s->watchdog, watchdog, s);
  /* libmicrohttpd's own limit leaves room past ours for the reserved slots and for connections
   * shut down but not yet closed, which a flood of new ones may outpace for a moment */
  unsigned limit = 2 * lim->connections + lim->reserved;
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_AUTO;
  if (sa->sa_family == AF_INET6)
    flags |= MHD_USE_IPv6;
  s->d = MHD_start_daemon(flags, 0, NULL, NULL, handler, cls, MHD_OPTION_SOCK_ADDR, sa,
                          MHD_OPTION_NOTIFY_CONNECTION, on_connection, s,
                          MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                          MHD_OPTION_CONNECTION_TIMEOUT, lim->idle_s, MHD_OPTION_CONNECTION_LIMIT,
                          limit, MHD_OPTION_THREAD_STACK_SIZE, lim->thread_stack, MHD_OPTION_END);
  if (!s->d) {
    fr_http_stop(s);
    return fr_err(FERRY_ESYS, "%s: cannot listen", who);
  }
  *out = s;
  return 0;
}

unsigned fr_http_port(const fr_http_server *s) {
  const union MHD_DaemonInfo *i = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
  return i ? i->port : 0u;
}

void fr_http_stop(fr_http_server *s) {
  if (!s)
    return;
  if (s->d)
    MHD_stop_daemon(s->d);       /* every connection closed, and out of the table */
  fr_timer_cancel(&s->watchdog); /* and waits for it, if it runs */
  pthread_mutex_destroy(&s->lock);
  free(s);
}
