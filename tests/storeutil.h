/*
 * Helpers for the directory and store tests: free loopback ports, a private redis-server
 * started on one and stopped at the end, and polling with a deadline (never a timing assert).
 */
#ifndef FERRY_STOREUTIL_H
#define FERRY_STOREUTIL_H

#include "testutil.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static inline int su_free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 ||
      getsockname(fd, (struct sockaddr *)&sa, &len) != 0)
    return -1;
  close(fd);
  return ntohs(sa.sin_port);
}

static inline bool su_port_open(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET,
                           .sin_port = htons((uint16_t)port),
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  bool ok = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
  close(fd);
  return ok;
}

static inline void su_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

typedef struct su_redis {
  pid_t pid;
  int port;
  char url[64];
} su_redis;

/* Starts redis-server on loopback port `want` (0: a free one) with up to 12 more arguments
 * (NULL-terminated `extra`, may be NULL: e.g. --requirepass PW); false (with a message) when it
 * cannot. */
static inline bool su_redis_start_with(su_redis *r, int want, const char *const *extra) {
  if (access("/usr/bin/redis-server", X_OK) != 0 && system("command -v redis-server >/dev/null")) {
    tu_skip(TU_SKIP_FIXABLE, "redis part: redis-server is not installed (scripts/deps.sh test)");
    return false;
  }
  r->port = want ? want : su_free_port();
  snprintf(r->url, sizeof r->url, "redis://127.0.0.1:%d", r->port);
  char port[16];
  snprintf(port, sizeof port, "%d", r->port);
  fflush(NULL);
  r->pid = fork();
  if (r->pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a test that failed half-way */
    int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    dup2(devnull, 2);
    const char *argv[24] = {"redis-server", "--port",     port,     "--bind",
                            "127.0.0.1",    "--save",     "",       "--appendonly",
                            "no",           "--loglevel", "warning"};
    for (int i = 0, n = 11; extra && extra[i] && i < 12; i++)
      argv[n++] = extra[i];
    execvp("redis-server", (char *const *)argv);
    _exit(127);
  }
  for (int i = 0; i < 500; i++) {
    if (su_port_open(r->port))
      return true;
    su_sleep_ms(10);
  }
  kill(r->pid, SIGKILL);
  waitpid(r->pid, NULL, 0);
  tu_skip(TU_SKIP_FIXABLE, "redis part: redis-server did not start on port %d", r->port);
  return false;
}

static inline bool su_redis_start_on(su_redis *r, int want) {
  return su_redis_start_with(r, want, NULL);
}
static inline bool su_redis_start(su_redis *r) { return su_redis_start_on(r, 0); }

static inline void su_redis_stop(su_redis *r) {
  if (r->pid > 0) {
    kill(r->pid, SIGKILL);
    waitpid(r->pid, NULL, 0);
    r->pid = 0;
  }
}

#endif
