/*
 * Refit senders by name. A sender that publishes attaches to its context's node in the directory
 * (FERRY_DIRECTORY or the URL it was given; one node per process, directory.h) with a job record
 * "ferry:job/refit/NAME" owned by that node, renewed with the node's lease by the node's timer
 * (published again by it, too, when the directory lost the node); a receiver opened with a bare
 * name looks the record up, then its node's address, and connects there. A second live sender of
 * the same name is refused (one record per name); a sender that dies lets the name go when its
 * node's lease lapses, or at once to a new sender of the name when nothing accepts connections at
 * the dead node's address any more (src/directory/lease.c).
 *
 * The ranks of a sharded sender group (ferry_refit_opts.world > 1) publish one record each, under
 * "NAME#r"; a receiver opened with NAME that finds no single sender resolves the ranks.
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

int fr_refit_publish(ferry_ctx *ctx, const char *name, const char *url, fr_refit_name **out) {
  char who[96];
  fr_refit_name *n = calloc(1, sizeof *n);
  if (!n)
    return fr_err(FERRY_ENOMEM, "refit: publishing '%s'", name);
  int rc = fr_dir_open(ctx, url, fr_timeout(-1), &n->dir);
  if (rc == 0) {
    snprintf(who, sizeof who, "refit sender '%s'", name);
    rc = fr_dir_lease_init(&n->lease, n->dir, ctx, "refit", name, who);
  }
  if (rc == 0)
    rc = fr_dir_lease_take(&n->lease, fr_timeout(-1));
  if (rc != 0) {
    rc = fr_err_wrap(rc, "refit: cannot publish sender '%s'", name);
    fr_refit_unpublish(n);
    return rc;
  }
  *out = n;
  return 0;
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
  fr_dir *dir = NULL;
  fr_dir_node rec;
  int rc = fr_dir_open(ctx, NULL, timeout_ms, &dir);
  if (rc == 0)
    rc = fr_dir_job_find(dir, "refit", name, &rec, timeout_ms);
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

int fr_refit_rank_name(const char *name, uint32_t rank, char **out) {
  char *n = NULL;
  if (asprintf(&n, "%s#%u", name, rank) < 0)
    return fr_err(FERRY_ENOMEM, "refit: rank %u of '%s'", rank, name);
  int rc = fr_name_check("refit: a group rank's name", n, FR_REFIT_NAME_MAX);
  if (rc != 0) {
    free(n);
    return rc;
  }
  *out = n;
  return 0;
}

int fr_refit_resolve_rank(ferry_ctx *ctx, const char *name, uint32_t rank, int timeout_ms,
                          char **address) {
  char *n = NULL;
  int rc = fr_refit_rank_name(name, rank, &n);
  if (rc == 0)
    rc = fr_refit_resolve(ctx, n, timeout_ms, address);
  if (rc == FERRY_ENOTFOUND)
    rc = fr_err(rc, "refit: rank %u of group '%s' is not published ('%s' is not in the directory)",
                rank, name, n);
  free(n);
  return rc;
}
