/*
 * Network namespaces as hosts (see netns.h): the one set-up and tear-down that the tests and
 * benchmarks between "hosts" share. Each step is one iproute2 (or tc) command run through the
 * shell with its output dropped, so a failure names the command that failed and the caller
 * decides whether that is a skip (not root) or an error.
 */
#include "netns.h"

#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Runs the formatted command quietly; writes it into failed when it fails. */
static bool step(char *failed, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static bool step(char *failed, size_t cap, const char *fmt, ...) {
  char cmd[512], full[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  snprintf(full, sizeof full, "%s >/dev/null 2>&1", cmd);
  if (system(full) == 0)
    return true;
  if (failed && cap > 0)
    snprintf(failed, cap, "%s", cmd);
  return false;
}

void netns_host(const char *tag, int i, char *buf, size_t cap) {
  snprintf(buf, cap, "ferry-%s-%d", tag, i);
}

void netns_down(const char *tag, int n) {
  for (int i = 1; i <= n; i++) {
    step(NULL, 0, "ip netns del ferry-%s-%d", tag, i);
    /* a run killed between creating a veth and moving it leaves it here (both ends go) */
    step(NULL, 0, "ip link del f%s%d", tag, i);
  }
  step(NULL, 0, "ip netns del ferry-%s-sw", tag);
}

/* Host i: its namespace, a veth to the bridge, its address, its rate limit. */
static bool host_up(const char *tag, const char *net, int i, const char *rate, char *failed,
                    size_t cap) {
  return step(failed, cap, "ip netns add ferry-%s-%d", tag, i) &&
         step(failed, cap, "ip link add f%s%d type veth peer name f%s%ds", tag, i, tag, i) &&
         step(failed, cap, "ip link set f%s%d netns ferry-%s-%d", tag, i, tag, i) &&
         step(failed, cap, "ip link set f%s%ds netns ferry-%s-sw", tag, i, tag) &&
         step(failed, cap, "ip -n ferry-%s-sw link set f%s%ds master br0 up", tag, tag, i) &&
         step(failed, cap, "ip -n ferry-%s-%d link set lo up", tag, i) &&
         step(failed, cap, "ip -n ferry-%s-%d addr add %s.%d/24 dev f%s%d", tag, i, net, i, tag,
              i) &&
         step(failed, cap, "ip -n ferry-%s-%d link set f%s%d up", tag, i, tag, i) &&
         (!rate || step(failed, cap,
                        "tc -n ferry-%s-%d qdisc add dev f%s%d root tbf rate %s burst 1mb "
                        "latency 100ms",
                        tag, i, tag, i, rate));
}

bool netns_up(const char *tag, const char *net, int n, const char *rate, char *failed, size_t cap) {
  if (strlen(tag) > NETNS_TAG_MAX || n < 1 || n > NETNS_HOSTS_MAX) {
    snprintf(failed, cap, "netns_up: tag '%s' over %d bytes, or %d hosts", tag, NETNS_TAG_MAX, n);
    return false;
  }
  netns_down(tag, n);
  bool ok = step(failed, cap, "ip netns add ferry-%s-sw", tag) &&
            step(failed, cap, "ip -n ferry-%s-sw link add br0 type bridge", tag) &&
            step(failed, cap, "ip -n ferry-%s-sw link set br0 up", tag);
  for (int i = 1; ok && i <= n; i++)
    ok = host_up(tag, net, i, rate, failed, cap);
  if (!ok)
    netns_down(tag, n);
  return ok;
}

bool netns_limit_ingress(const char *tag, int n, const char *rate, char *failed, size_t cap) {
  bool ok = true;
  for (int i = 1; ok && i <= n; i++)
    ok = step(failed, cap,
              "tc -n ferry-%s-sw qdisc add dev f%s%ds root tbf rate %s burst 1mb latency 100ms",
              tag, tag, i, rate);
  return ok;
}

bool netns_set_rate(const char *tag, int n, const char *rate, bool ingress, char *failed,
                    size_t cap) {
  bool ok = true;
  for (int i = 1; ok && i <= n; i++)
    ok = step(failed, cap,
              "tc -n ferry-%s-%d qdisc change dev f%s%d root tbf rate %s burst 1mb latency 100ms",
              tag, i, tag, i, rate) &&
         (!ingress || step(failed, cap,
                           "tc -n ferry-%s-sw qdisc change dev f%s%ds root tbf rate %s burst 1mb "
                           "latency 100ms",
                           tag, tag, i, rate));
  return ok;
}

int netns_enter(const char *tag, int i, int *home) {
  char path[96];
  snprintf(path, sizeof path, "/run/netns/ferry-%s-%d", tag, i);
  int here = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  int ns = open(path, O_RDONLY | O_CLOEXEC);
  int rc = here >= 0 && ns >= 0 && setns(ns, CLONE_NEWNET) == 0 ? 0 : -1;
  if (ns >= 0)
    close(ns);
  if (rc != 0 && here >= 0)
    close(here);
  if (rc == 0)
    *home = here;
  return rc;
}

int netns_leave(int home) {
  int rc = setns(home, CLONE_NEWNET) == 0 ? 0 : -1;
  close(home);
  return rc;
}
