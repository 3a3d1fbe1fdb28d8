/*
 * The tcp transport: links between hosts. Sockets use TCP_NODELAY (small frames go out at once)
 * and, when FERRY_TCP_SOCKBUF is set, fixed large buffers. One-sided reads and writes are
 * requests the owner answers after checking key and bounds (link_rx.c); payloads go from the
 * region with one sendmsg and land in the destination with recv, with no staging buffer.
 */
#include "transport/transport.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* Splits "HOST:PORT" (HOST may be "[v6]"); host may be empty. */
int fr_split_host_port(const char *text, char *host, size_t hlen, char *port, size_t plen) {
  const char *colon = strrchr(text, ':');
  if (!colon || colon[1] == '\0')
    return fr_err(FERRY_EINVAL, "'%s' is not HOST:PORT", text);
  const char *h = text;
  size_t n = (size_t)(colon - text);
  if (n >= 2 && h[0] == '[' && h[n - 1] == ']') {
    h++;
    n -= 2;
  }
  if (n >= hlen || strlen(colon + 1) >= plen)
    return fr_err(FERRY_EINVAL, "'%s' is too long", text);
  memcpy(host, h, n);
  host[n] = '\0';
  fr_str_copy(port, plen, colon + 1);
  return 0;
}

/* Resolves "host:port" (a name no later than deadline_ns; 0: no deadline). */
static int resolve(const char *text, bool passive, uint64_t deadline_ns, struct addrinfo **out) {
  char host[256], port[16];
  int rc = fr_split_host_port(text, host, sizeof host, port, sizeof port);
  if (rc != 0)
    return rc;
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
  if (passive)
    hints.ai_flags = AI_PASSIVE;
  int g = fr_resolve(*host ? host : NULL, port, &hints, deadline_ns, out);
  if (g != 0)
    return fr_err(g == FR_RESOLVE_TIMEDOUT ? FERRY_ETIMEDOUT : FERRY_EINVAL,
                  "cannot resolve '%s': %s", text, fr_resolve_strerror(g));
  return 0;
}

/* The address peers should dial when we listen on a wildcard: the first non-loopback IPv4. */
static void advertised_host(const struct sockaddr_storage *ss, char *out, size_t len) {
  if (ss->ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)ss)->sin6_addr, out, (socklen_t)len);
    return;
  }
  struct in_addr a = ((const struct sockaddr_in *)ss)->sin_addr;
  if (a.s_addr == htonl(INADDR_ANY)) {
    struct ifaddrs *ifs = NULL;
    a.s_addr = htonl(INADDR_LOOPBACK);
    if (getifaddrs(&ifs) == 0) {
      for (struct ifaddrs *i = ifs; i; i = i->ifa_next)
        if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET) {
          struct in_addr c = ((struct sockaddr_in *)i->ifa_addr)->sin_addr;
          if ((ntohl(c.s_addr) >> 24) != 127) {
            a = c;
            break;
          }
        }
      freeifaddrs(ifs);
    }
  }
  inet_ntop(AF_INET, &a, out, (socklen_t)len);
}

static bool loopback_sockaddr(const struct sockaddr *sa) {
  if (sa->sa_family == AF_INET)
    return ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24 == 127;
  const struct in6_addr *a6 = &((const struct sockaddr_in6 *)sa)->sin6_addr;
  return sa->sa_family == AF_INET6 &&
         (IN6_IS_ADDR_LOOPBACK(a6) || (IN6_IS_ADDR_V4MAPPED(a6) && a6->s6_addr[12] == 127));
}

/* A tcp link can read and write every region its node shares: on an address other hosts can
 * reach, only the fleet token keeps them out, so there it is required (docs/SECURITY.md), and it
 * must be one the fleet shares: this user's own secret (in the home directory of one host) is
 * not, and a listener that relied on it would refuse every other host anyway. */
int fr_listen_exposure_check(const ferry_ctx *ctx, const struct sockaddr *sa, const char *what,
                             const char *where) {
  bool explicit_token = ctx ? ctx->token_explicit : *fr_config_str("FERRY_TOKEN") != '\0';
  if (loopback_sockaddr(sa) || explicit_token)
    return 0;
  return fr_err(FERRY_EINVAL,
                "%s: listening on %s (reachable from other hosts) needs a fleet token: set "
                "FERRY_TOKEN to one secret shared by every node, e.g. "
                "FERRY_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')",
                what, where);
}

static int tcp_listen(ferry_ctx *ctx, int *fd_out, char *url, size_t url_len) {
  struct addrinfo *ai = NULL;
  int rc = resolve(ctx->tcp_listen, true, 0, &ai);
  if (rc != 0)
    return rc;
  if ((rc = fr_listen_exposure_check(ctx, ai->ai_addr, "tcp", ctx->tcp_listen)) != 0) {
    freeaddrinfo(ai);
    return rc;
  }
  int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int one = 1;
  if (fd >= 0)
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (fd < 0 || bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, 128) < 0) {
    rc = fr_err_errno(FERRY_ESYS, "tcp: cannot listen on %s", ctx->tcp_listen);
    if (fd >= 0)
      close(fd);
    freeaddrinfo(ai);
    return rc;
  }
  freeaddrinfo(ai);
  struct sockaddr_storage ss;
  socklen_t slen = sizeof ss;
  getsockname(fd, (struct sockaddr *)&ss, &slen);
  char host[INET6_ADDRSTRLEN];
  advertised_host(&ss, host, sizeof host);
  int port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                            : ((struct sockaddr_in *)&ss)->sin_port);
  snprintf(url, url_len, ss.ss_family == AF_INET6 ? "tcp://[%s]:%d" : "tcp://%s:%d", host, port);
  *fd_out = fd;
  return 0;
}

static int tcp_dial(const char *where, int timeout_ms, int *fd_out) {
  struct addrinfo *ai = NULL;
  uint64_t deadline = timeout_ms > 0 ? fr_deadline_ns(timeout_ms) : 0;
  int rc = resolve(where, false, deadline, &ai);
  if (rc != 0)
    return rc;
  int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(ai);
    return fr_err_errno(FERRY_ESYS, "tcp: socket");
  }
  char what[300];
  snprintf(what, sizeof what, "tcp://%s", where);
  rc = fr_sock_connect(fd, ai->ai_addr, ai->ai_addrlen,
                       deadline ? fr_ms_left(deadline) : timeout_ms, what);
  freeaddrinfo(ai);
  if (rc != 0) {
    close(fd);
    return rc;
  }
  *fd_out = fd;
  return 0;
}

/* Whether fd's peer is on this host: a loopback address, or this end's own address. */
static bool same_host(int fd) {
  struct sockaddr_storage me, peer;
  socklen_t ml = sizeof me, pl = sizeof peer;
  if (getsockname(fd, (struct sockaddr *)&me, &ml) != 0 ||
      getpeername(fd, (struct sockaddr *)&peer, &pl) != 0 || me.ss_family != peer.ss_family)
    return false;
  if (peer.ss_family == AF_INET) {
    in_addr_t p = ((struct sockaddr_in *)&peer)->sin_addr.s_addr;
    return (ntohl(p) >> 24) == 127 || p == ((struct sockaddr_in *)&me)->sin_addr.s_addr;
  }
  if (peer.ss_family == AF_INET6) {
    const struct in6_addr *p = &((struct sockaddr_in6 *)&peer)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(p) ||
           memcmp(p, &((struct sockaddr_in6 *)&me)->sin6_addr, sizeof *p) == 0;
  }
  return false;
}

/* Within one host, the kernel's default congestion control may pace what loopback could take
 * at once: with bbr (the project's VM), a 1 MiB ping-pong took 300 us one way (p99 550-600)
 * and a stream of 16 MiB messages 2.7 GB/s; with reno, which does not pace, 120-140 us (p99
 * 200-230) and 8.8 GB/s. FERRY_TCP_LOCAL_CC names the one to use there ("reno" by default, an
 * unprivileged process may choose among net.ipv4.tcp_allowed_congestion_control); links to
 * other hosts keep the kernel's. */
static void tcp_local_cc(int fd) {
  const char *cc = fr_config_str("FERRY_TCP_LOCAL_CC");
  if (!cc || !*cc || !same_host(fd))
    return;
  if (setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cc, (socklen_t)strlen(cc)) != 0)
    fr_debug("tcp: congestion control '%s' within this host: %s", cc, strerror(errno));
}

static void tcp_setup(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  tcp_local_cc(fd);
  int buf = (int)fr_config_int("FERRY_TCP_SOCKBUF");
  if (buf > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
  }
}

const fr_transport_ops fr_tcp_transport = {
    .name = "tcp",
    .scheme = "tcp://",
    .passes_fds = false,
    .listen = tcp_listen,
    .dial = tcp_dial,
    .setup = tcp_setup,
    .sendv = fr_link_sock_sendv,
    .recv = fr_link_sock_recv,
    .any_thread_events = true,
    .edge_triggered = true,
    .read = fr_link_rma_read,
    .readv = fr_link_rma_readv,
    .write = fr_link_rma_write,
};
