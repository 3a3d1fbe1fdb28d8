/*
 * Refit senders by name. A sender that publishes registers a node record "refit:NAME" → its ctx
 * address in the directory (FERRY_DIRECTORY or the URL it was given), under a lease that its
 * service thread renews; a receiver opened with a bare name looks the record up and connects to
 * that address. A second live sender of the same name is refused (the directory keeps one
 * holder per name); a sender that dies lets the name go when its lease lapses, or at once to a
 * new sender of the name when nothing accepts connections at the dead one's address any more
 * (the lease helper in src/directory/lease.c).
 */
#include "refit/refit.h"

#include "directory/directory.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct fr_refit_name {
  fr_dir *dir;
  fr_dir_lease lease;
};

static int node_name(const char *name, char out[FR_DIR_NAME_MAX + 1]) {
  if ((size_t)snprintf(out, FR_DIR_NAME_MAX + 1, "refit:%s", name) > FR_DIR_NAME_MAX)
    return fr_err(FERRY_EINVAL, "refit: the name '%s' is too long to publish (%d bytes at most)",
                  name, FR_DIR_NAME_MAX - 6);
  return 0;
}

int fr_refit_publish(ferry_ctx *ctx, const char *name, const char *url, fr_refit_name **out) {
  char node[FR_DIR_NAME_MAX + 1], who[96];
  int rc = node_name(name, node);
  if (rc != 0)
    return rc;
  fr_refit_name *n = calloc(1, sizeof *n);
  if (!n)
    return fr_err(FERRY_ENOMEM, "refit: publishing '%s'", name);
  rc = fr_dir_open(ctx, url, fr_timeout(-1), &n->dir);
  if (rc == 0) {
    snprintf(who, sizeof who, "refit sender '%s'", name);
    fr_dir_lease_init(&n->lease, n->dir, ctx, node, who);
    rc = fr_dir_lease_take(&n->lease, fr_timeout(-1));
  }
  if (rc != 0) {
    rc = fr_err_wrap(rc, "refit: cannot publish sender '%s'", name);
    fr_refit_unpublish(n);
    return rc;
  }
  *out = n;
  return 0;
}

void fr_refit_publish_tick(fr_refit_name *n) {
  if (n && fr_dir_lease_due(&n->lease))
    fr_dir_lease_renew(&n->lease); /* a refit name has no records beyond the node */
}

uint64_t fr_refit_publish_due(const fr_refit_name *n) {
  return n ? __atomic_load_n(&n->lease.next_renew_ns, __ATOMIC_ACQUIRE) : UINT64_MAX;
}

void fr_refit_unpublish(fr_refit_name *n) {
  if (!n)
    return;
  if (n->dir)
    fr_dir_lease_drop(&n->lease);
  fr_dir_close(n->dir);
  free(n);
}

int fr_refit_resolve(ferry_ctx *ctx, const char *name, int timeout_ms, char **address) {
  char node[FR_DIR_NAME_MAX + 1];
  fr_dir *dir = NULL;
  fr_dir_node rec;
  int rc = node_name(name, node);
  if (rc == 0)
    rc = fr_dir_open(ctx, NULL, timeout_ms, &dir);
  if (rc == 0)
    rc = fr_dir_node_get(dir, node, &rec, timeout_ms);
  fr_dir_close(dir);
  if (rc == FERRY_ENOTFOUND)
    return fr_err(rc,
                  "refit: no sender '%s' is published in the directory (open it with "
                  "ferry_refit_opts.publish, or pass its address)",
                  name);
  if (rc != 0)
    return fr_err_wrap(rc, "refit: looking up sender '%s'", name);
  *address = strdup(rec.address);
  return *address ? 0 : fr_err(FERRY_ENOMEM, "refit: address of '%s'", name);
}
