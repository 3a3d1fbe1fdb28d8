/*
 * Refit senders by name. A sender that publishes registers a node record "refit:NAME" → its ctx
 * address in the directory (FERRY_DIRECTORY or the URL it was given), under a lease that its
 * service thread renews; a receiver opened with a bare name looks the record up and connects to
 * that address. A second live sender of the same name is refused (the directory keeps one
 * holder per name); a sender that dies lets the name go when its lease lapses.
 */
#include "refit/refit.h"

#include "directory/directory.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct fr_refit_name {
  fr_dir *dir;
  char node[FR_DIR_NAME_MAX + 1];
  char address[FR_DIR_ADDRESS_MAX + 1];
  uint64_t incarnation;
  int lease_ms;
  uint64_t next_renew_ns;
};

static int node_name(const char *name, char out[FR_DIR_NAME_MAX + 1]) {
  if ((size_t)snprintf(out, FR_DIR_NAME_MAX + 1, "refit:%s", name) > FR_DIR_NAME_MAX)
    return fr_err(FERRY_EINVAL, "refit: the name '%s' is too long to publish (%d bytes at most)",
                  name, FR_DIR_NAME_MAX - 6);
  return 0;
}

static int put(fr_refit_name *n, int timeout_ms) {
  fr_dir_node rec = {.incarnation = n->incarnation};
  snprintf(rec.name, sizeof rec.name, "%s", n->node);
  snprintf(rec.address, sizeof rec.address, "%s", n->address);
  int rc = n->dir->ops->node_put(n->dir->state, &rec, n->lease_ms, 0, NULL, timeout_ms);
  if (rc == 0)
    n->next_renew_ns = fr_now_ns() + (uint64_t)n->lease_ms * 1000000ull / 3;
  return rc;
}

int fr_refit_publish(ferry_ctx *ctx, const char *name, const char *url, fr_refit_name **out) {
  fr_refit_name *n = calloc(1, sizeof *n);
  if (!n)
    return fr_err(FERRY_ENOMEM, "refit: publishing '%s'", name);
  n->incarnation = fr_random_u64() | 1;
  n->lease_ms = (int)fr_config_int("FERRY_LEASE_MS");
  snprintf(n->address, sizeof n->address, "%s", ferry_ctx_address(ctx));
  int rc = node_name(name, n->node);
  if (rc == 0)
    rc = fr_dir_open(ctx, url, fr_timeout(-1), &n->dir);
  if (rc == 0)
    rc = put(n, fr_timeout(-1));
  if (rc != 0) {
    rc = fr_err_wrap(rc, "refit: cannot publish sender '%s'", name);
    fr_refit_unpublish(n);
    return rc;
  }
  *out = n;
  return 0;
}

void fr_refit_publish_tick(fr_refit_name *n) {
  if (!n || fr_now_ns() < n->next_renew_ns)
    return;
  int timeout = n->lease_ms / 3 > 100 ? n->lease_ms / 3 : 100;
  int rc = n->dir->ops->node_renew(n->dir->state, n->node, n->incarnation, n->lease_ms, timeout);
  if (rc == FERRY_ENOTFOUND) /* the lease lapsed or the directory restarted: register again */
    rc = put(n, timeout);
  else if (rc == 0)
    n->next_renew_ns = fr_now_ns() + (uint64_t)n->lease_ms * 1000000ull / 3;
  if (rc != 0) {
    fr_warn("refit: renewing '%s' in the directory failed: %s", n->node, ferry_last_error());
    n->next_renew_ns = fr_now_ns() + 200000000ull;
  }
}

void fr_refit_unpublish(fr_refit_name *n) {
  if (!n)
    return;
  if (n->dir && n->incarnation && n->next_renew_ns)
    n->dir->ops->node_del(n->dir->state, n->node, n->incarnation, 2000);
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
    rc = dir->ops->node_get(dir->state, node, &rec, timeout_ms);
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
