/*
 * Stand-in hosts for the tests and benchmarks that need traffic between machines: network
 * namespaces on one bridge (root and iproute2 needed; tc for a rate limit). One set is named by
 * a short tag: hosts 1..n are namespaces NETNS_HOST(tag, i) with address NETNS_IP(net, i)/24 on a
 * veth whose other end is a port of bridge br0 in namespace "ferry-TAG-sw". Tags keep sets that
 * run at once apart (their veths are made in the caller's namespace before they move), so each
 * user of this file has its own. Used by tests/store_test.c, tests/directory_test.c and the
 * store and refit benchmarks; tests compile it into their utility library.
 */
#ifndef FR_CLI_NETNS_H
#define FR_CLI_NETNS_H

#include <stdbool.h>
#include <stddef.h>

/* Host i's namespace and address, for a literal i (they build command lines at compile time). */
#define NETNS_HOST(tag, i) "ferry-" tag "-" #i
#define NETNS_IP(net, i) net "." #i

#define NETNS_TAG_MAX 8 /* a veth is fTAG<i>s: interface names hold 15 bytes */
#define NETNS_HOSTS_MAX 64

/* Makes hosts 1..n of set `tag` on subnet `net` ("10.231.7": three octets), each host's egress
 * limited to `rate` by tc tbf ("1gbit"; NULL: no limit). Removes what a previous run left
 * first. On failure it removes what it made, writes the command that failed into failed (cap
 * bytes) and returns false. */
bool netns_up(const char *tag, const char *net, int n, const char *rate, char *failed, size_t cap);
/* Limits what reaches hosts 1..n of set `tag` to `rate` as well: a tc tbf on each host's port of
 * the bridge (the bridge's egress towards the host). With netns_up's egress limit, each host's
 * link is then limited in both directions, as a host's NIC is. Same failure contract. */
bool netns_limit_ingress(const char *tag, int n, const char *rate, char *failed, size_t cap);
/* Changes the limit of hosts 1..n of set `tag` to `rate`: their egress, and with `ingress` (after
 * netns_limit_ingress) what reaches them too. Same failure contract. */
bool netns_set_rate(const char *tag, int n, const char *rate, bool ingress, char *failed,
                    size_t cap);
/* Removes hosts 1..n and the bridge's namespace of set `tag` (what is not there is skipped). */
void netns_down(const char *tag, int n);
/* Writes host i's namespace name into buf. */
void netns_host(const char *tag, int i, char *buf, size_t cap);
/* Moves the calling thread (and the threads it starts after) into host i's namespace; *home
 * receives a descriptor of the one it was in, for netns_leave. 0, or -1 with nothing changed. */
int netns_enter(const char *tag, int i, int *home);
/* Back to the namespace netns_enter left (closes home); 0 or -1. */
int netns_leave(int home);

#endif
