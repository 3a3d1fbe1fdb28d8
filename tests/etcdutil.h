/*
 * A throwaway etcd cluster for the etcd:// directory tests (issue 36): tests/etcd/cluster.sh
 * starts N members on free loopback ports, each with its data under one temporary folder, and
 * su_etcd_stop kills them and removes it (a cluster a failed case left running is stopped when
 * the test process exits). Skipped with a message when etcd is not installed.
 */
#ifndef FERRY_ETCDUTIL_H
#define FERRY_ETCDUTIL_H

#include "testutil.h"

#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>

typedef struct su_etcd {
  char dir[64];        /* the cluster's folder (cluster.sh's DIR) */
  char endpoints[512]; /* HOST:PORT,HOST:PORT,... */
  char url[600];       /* etcd://ENDPOINTS */
  char script[512];    /* tests/etcd/cluster.sh */
} su_etcd;

/* The clusters started and not stopped yet, stopped at exit: a case that fails an assertion leaves
 * its function before su_etcd_stop (cmocka jumps out), and must not leave etcd running. */
#define SU_ETCD_LIVE 8
static su_etcd su_etcd_live[SU_ETCD_LIVE];
static pid_t su_etcd_owner; /* the process that started them */

static inline void su_etcd_live_set(const su_etcd *e, bool on) {
  for (int i = 0; i < SU_ETCD_LIVE; i++)
    if (on ? !su_etcd_live[i].dir[0] : strcmp(su_etcd_live[i].dir, e->dir) == 0) {
      if (on)
        su_etcd_live[i] = *e;
      else
        su_etcd_live[i].dir[0] = '\0';
      return;
    }
}

/* Runs cluster.sh CMD [ARG]; its exit status. */
static inline int su_etcd_sh(const su_etcd *e, const char *cmd, int arg) {
  char line[1200];
  if (arg > 0)
    snprintf(line, sizeof line, "sh '%s' %s '%s' %d", e->script, cmd, e->dir, arg);
  else
    snprintf(line, sizeof line, "sh '%s' %s '%s'", e->script, cmd, e->dir);
  return system(line);
}

static inline void su_etcd_stop_all(void);

/* Starts `members` members; false (with a message) when etcd is not installed or did not come
 * up. */
static inline bool su_etcd_start(su_etcd *e, int members) {
  memset(e, 0, sizeof *e);
  if (system("command -v etcd >/dev/null && command -v etcdctl >/dev/null") != 0) {
    tu_skip(TU_SKIP_FIXABLE, "etcd part: etcd is not installed (etcd-server, etcd-client: "
                             "scripts/deps.sh test)");
    return false;
  }
  const char *src = getenv("FERRY_SOURCE_DIR");
  snprintf(e->script, sizeof e->script, "%s/tests/etcd/cluster.sh", src ? src : ".");
  snprintf(e->dir, sizeof e->dir, "/tmp/ferry-etcd-XXXXXX");
  if (!mkdtemp(e->dir)) {
    tu_skip(TU_SKIP_FIXABLE, "etcd part: no temporary folder");
    return false;
  }
  char line[1200];
  snprintf(line, sizeof line, "sh '%s' start '%s' %d", e->script, e->dir, members);
  FILE *p = popen(line, "r");
  bool ok = p && fgets(e->endpoints, sizeof e->endpoints, p) != NULL;
  ok = (p ? pclose(p) == 0 : false) && ok;
  e->endpoints[strcspn(e->endpoints, "\n")] = '\0';
  if (!ok || !e->endpoints[0]) {
    su_etcd_sh(e, "stop", 0);
    tu_skip(TU_SKIP_FIXABLE, "etcd part: the cluster did not start (see cluster.sh)");
    return false;
  }
  snprintf(e->url, sizeof e->url, "etcd://%s", e->endpoints);
  static bool registered;
  if (!registered)
    registered = atexit(su_etcd_stop_all) == 0;
  su_etcd_owner = getpid();
  su_etcd_live_set(e, true);
  return true;
}

/* The member that leads now (1-based, cluster.sh leader), polled up to 5 s: 0 when none does. */
static inline int su_etcd_leader(const su_etcd *e) {
  char line[1200], out[16] = "";
  snprintf(line, sizeof line, "sh '%s' leader '%s'", e->script, e->dir);
  for (int i = 0; i < 50; i++) {
    FILE *p = popen(line, "r");
    bool got = p && fgets(out, sizeof out, p) != NULL;
    if (p)
      pclose(p);
    if (got && atoi(out) > 0)
      return atoi(out);
    struct timespec ts = {0, 100000000L};
    nanosleep(&ts, NULL);
  }
  return 0;
}

/* Sends sig to member m (1-based; its pid from DIR/mM.pid): SIGKILL, SIGSTOP, SIGCONT. False
 * when its pid is not known. */
/* Member m's pid while it is this cluster's etcd (its command line names DIR/mM.data), else 0:
 * a member that died leaves its number to be reused by any process (cluster.sh's member_pid). */
static inline int su_etcd_pid(const su_etcd *e, int m) {
  char path[128], want[128], cmd[4096];
  snprintf(path, sizeof path, "%s/m%d.pid", e->dir, m);
  FILE *f = fopen(path, "r");
  int pid = 0;
  if (!f || fscanf(f, "%d", &pid) != 1 || pid <= 0)
    pid = 0;
  if (f)
    fclose(f);
  snprintf(path, sizeof path, "/proc/%d/cmdline", pid);
  f = pid ? fopen(path, "r") : NULL;
  size_t n = f ? fread(cmd, 1, sizeof cmd - 1, f) : 0;
  if (f)
    fclose(f);
  for (size_t i = 0; i < n; i++)
    cmd[i] = cmd[i] ? cmd[i] : ' ';
  cmd[n] = '\0';
  snprintf(want, sizeof want, " %s/m%d.data ", e->dir, m);
  return n && strstr(cmd, want) ? pid : 0;
}

static inline bool su_etcd_signal(const su_etcd *e, int m, int sig) {
  int pid = su_etcd_pid(e, m);
  return pid > 0 && kill(pid, sig) == 0;
}

static inline void su_etcd_stop(su_etcd *e) {
  if (e->dir[0]) {
    su_etcd_sh(e, "stop", 0);
    su_etcd_live_set(e, false);
  }
  e->dir[0] = '\0';
}

static inline void su_etcd_stop_all(void) {
  if (getpid() != su_etcd_owner) /* a forked child that exits: the clusters are its parent's */
    return;
  for (int i = 0; i < SU_ETCD_LIVE; i++)
    if (su_etcd_live[i].dir[0]) {
      su_etcd_sh(&su_etcd_live[i], "stop", 0);
      su_etcd_live[i].dir[0] = '\0';
    }
}

#endif
