/*
 * Whether the address a node advertises in the directory is one its peers can dial. A node's
 * links listen on loopback by default (FERRY_TCP_LISTEN=127.0.0.1:0), which is right within one
 * host and useless to peers on others: a node that registers in a directory on another host
 * with loopback-only addresses would be listed but unreachable. The context's listeners are
 * bound when it opens, before any directory is known, so the library refuses such a
 * registration with one line naming FERRY_TCP_LISTEN and the interface that routes to the
 * directory; `ferry serve`, which knows its directory before it opens its context, listens on
 * that interface instead (fr_dir_tcp_listen_for).
 */
#include "directory/directory.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

bool fr_addr_loopback(const char *host) {
  struct in_addr a4;
  struct in6_addr a6;
  if (strcmp(host, "localhost") == 0)
    return true;
  if (inet_pton(AF_INET, host, &a4) == 1)
    return (ntohl(a4.s_addr) >> 24) == 127;
  if (inet_pton(AF_INET6, host, &a6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&a6))
      return true;
    return IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr[12] == 127;
  }
  return false;
}

/* The unspecified address (a wildcard listener's, never a dialable one). */
static bool addr_any(const char *host) {
  struct in_addr a4;
  struct in6_addr a6;
  if (inet_pton(AF_INET, host, &a4) == 1)
    return a4.s_addr == htonl(INADDR_ANY);
  return inet_pton(AF_INET6, host, &a6) == 1 && IN6_IS_ADDR_UNSPECIFIED(&a6);
}

int fr_url_host(const char *url, char *host, size_t cap) {
  const char *s = strstr(url, "://");
  s = s ? s + 3 : url;
  const char *at = strrchr(s, '@');
  if (at)
    s = at + 1;
  size_t n = strcspn(s, "/?#");
  const char *h = s;
  size_t hn;
  if (n && *s == '[') {
    const char *close = memchr(s, ']', n);
    if (!close)
      return FERRY_EINVAL;
    h = s + 1;
    hn = (size_t)(close - h);
  } else {
    const char *colon = memchr(s, ':', n);
    hn = colon ? (size_t)(colon - s) : n;
  }
  if (hn >= cap)
    return FERRY_EINVAL;
  snprintf(host, cap, "%.*s", (int)hn, h);
  return 0;
}

bool fr_dir_can_reach(const char *dir_host, const char *node_address) {
  if (fr_addr_loopback(dir_host))
    return true; /* a fleet on one host: loopback is what its peers dial */
  for (const char *p = node_address; p && *p;) {
    size_t n = strcspn(p, ",");
    char one[FR_DIR_ADDRESS_MAX + 1], host[256];
    snprintf(one, sizeof one, "%.*s", (int)n, p);
    bool net = strncmp(one, "tcp://", 6) == 0 || strncmp(one, "ucx://", 6) == 0;
    if (net && fr_url_host(one, host, sizeof host) == 0 && host[0] && !fr_addr_loopback(host) &&
        !addr_any(host))
      return true;
    p += n;
    p += *p == ',';
  }
  return false;
}

/* The directory's host as a numeric address: a loopback one when the name has any (localhost
 * resolves to both ::1 and 127.0.0.1), else the first. */
static int host_numeric(const char *host, char *ip, size_t cap, uint64_t deadline_ns) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_DGRAM}, *ai = NULL;
  if (fr_resolve(host, NULL, &hints, deadline_ns, &ai) != 0)
    return FERRY_ENOTFOUND;
  int rc = FERRY_ENOTFOUND;
  for (struct addrinfo *a = ai; a; a = a->ai_next) {
    char buf[INET6_ADDRSTRLEN];
    if (getnameinfo(a->ai_addr, a->ai_addrlen, buf, sizeof buf, NULL, 0, NI_NUMERICHOST) != 0)
      continue;
    if (rc != 0 || fr_addr_loopback(buf)) {
      fr_str_copy(ip, cap, buf);
      rc = 0;
    }
    if (fr_addr_loopback(buf))
      break;
  }
  freeaddrinfo(ai);
  return rc;
}

int fr_route_source(const char *ip, char *out, size_t cap) {
  struct addrinfo hints = {.ai_flags = AI_NUMERICHOST, .ai_socktype = SOCK_DGRAM}, *ai = NULL;
  if (getaddrinfo(ip, "9", &hints, &ai) != 0)
    return FERRY_EINVAL;
  /* connecting a UDP socket only picks the route and source address: nothing is sent */
  int fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct sockaddr_storage me;
  socklen_t ml = sizeof me;
  bool ok =
      fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
      getsockname(fd, (struct sockaddr *)&me, &ml) == 0 &&
      getnameinfo((struct sockaddr *)&me, ml, out, (socklen_t)cap, NULL, 0, NI_NUMERICHOST) == 0;
  if (fd >= 0)
    close(fd);
  freeaddrinfo(ai);
  return ok ? 0 : FERRY_ENOTFOUND;
}

int fr_dir_reach_check(const char *dir_url, const char *node_address, const char *who,
                       uint64_t deadline_ns) {
  char host[256], ip[INET6_ADDRSTRLEN], src[INET6_ADDRSTRLEN], shown[FR_DIR_ADDRESS_MAX + 1];
  /* an in-process directory, or one whose host no longer resolves: nothing to judge by */
  if (fr_url_host(dir_url, host, sizeof host) != 0 || !host[0] ||
      host_numeric(host, ip, sizeof ip, deadline_ns) != 0 || fr_dir_can_reach(ip, node_address))
    return 0;
  fr_url_redact(dir_url, shown, sizeof shown);
  char hint[INET6_ADDRSTRLEN + 64] = "this host's address on that network";
  if (fr_route_source(ip, src, sizeof src) == 0 && !fr_addr_loopback(src))
    snprintf(hint, sizeof hint, strchr(src, ':') ? "[%s]:0" : "%s:0", src);
  return fr_err(FERRY_EINVAL,
                "%s: the directory %s is on another host, but this node listens on loopback only "
                "(%s), where peers there cannot reach it; set FERRY_TCP_LISTEN=%s",
                who, shown, node_address, hint);
}

int fr_dir_tcp_listen_for(const char *dir_url, const char *tcp_listen, char *out, size_t cap) {
  char host[256], ip[INET6_ADDRSTRLEN], src[INET6_ADDRSTRLEN], listen_host[256];
  if (fr_url_host(tcp_listen, listen_host, sizeof listen_host) != 0 || !listen_host[0] ||
      !fr_addr_loopback(listen_host))
    return 0; /* already a wildcard or a chosen interface */
  if (fr_url_host(dir_url, host, sizeof host) != 0 || !host[0] ||
      host_numeric(host, ip, sizeof ip, 0) != 0 || fr_addr_loopback(ip))
    return 0;
  if (fr_route_source(ip, src, sizeof src) != 0 || fr_addr_loopback(src))
    return 0; /* no route: the registration check explains */
  const char *colon = strrchr(tcp_listen, ':');
  snprintf(out, cap, strchr(src, ':') ? "[%s]:%s" : "%s:%s", src, colon ? colon + 1 : "0");
  return 1;
}
