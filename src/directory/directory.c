/*
 * The directory's front door: the backends in one table, chosen by URL scheme, and the helpers
 * every backend shares (key checks, sorting). A job opens a directory with fr_dir_open() and
 * calls through dir->ops; it never names a backend.
 */
#include "directory/directory.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern const fr_dir_ops fr_dir_embedded_ops;
extern const fr_dir_ops fr_dir_redis_ops;

static const fr_dir_ops *const backends[] = {&fr_dir_embedded_ops, &fr_dir_redis_ops};

const fr_dir_ops *fr_dir_backend(const char *url) {
  for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++) {
    size_t n = strlen(backends[i]->scheme);
    if (strncmp(url, backends[i]->scheme, n) == 0)
      return backends[i];
  }
  return NULL;
}

int fr_dir_open(ferry_ctx *ctx, const char *url, int timeout_ms, fr_dir **out) {
  if (!url || !*url)
    url = fr_config_str("FERRY_DIRECTORY");
  const fr_dir_ops *ops = fr_dir_backend(url);
  char shown[FR_DIR_ADDRESS_MAX + 1];
  fr_url_redact(url, shown, sizeof shown);
  if (!ops)
    return fr_err(FERRY_EINVAL,
                  "directory '%s': unknown scheme (ferry://HOST:PORT or "
                  "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB])",
                  shown);
  if (strlen(url) > FR_DIR_ADDRESS_MAX)
    return fr_err(FERRY_EINVAL, "directory URL too long");
  fr_dir *d = calloc(1, sizeof *d);
  if (!d)
    return fr_err(FERRY_ENOMEM, "directory client");
  d->ops = ops;
  snprintf(d->url, sizeof d->url, "%s", shown);
  int rc = ops->open(ctx, url + strlen(ops->scheme), fr_timeout(timeout_ms), &d->state);
  if (rc != 0) {
    free(d);
    return rc;
  }
  *out = d;
  return 0;
}

void fr_dir_close(fr_dir *dir) {
  if (!dir)
    return;
  dir->ops->close(dir->state);
  free(dir);
}

int fr_dir_key_check(const char *key, const char *what) {
  if (!key || !*key)
    return fr_err(FERRY_EINVAL, "%s: empty key", what);
  size_t n = 0;
  for (const unsigned char *p = (const unsigned char *)key; *p; p++, n++)
    if (*p < 0x20 || *p == 0x7f)
      return fr_err(FERRY_EINVAL, "%s: key has a control character at byte %zu", what, n);
  if (n > FR_DIR_KEY_MAX)
    return fr_err(FERRY_EINVAL, "%s: key of %zu bytes (at most %d)", what, n, FR_DIR_KEY_MAX);
  return 0;
}

int fr_dir_name_taken(const fr_dir_node *holder, uint32_t lease_left_ms) {
  return fr_err(FERRY_EEXIST,
                "node name '%s' is held by a live node at %s (its lease runs %u ms more)",
                holder->name, holder->address, lease_left_ms);
}

static int cmp_object(const void *a, const void *b) {
  return strcmp(((const fr_dir_object *)a)->key, ((const fr_dir_object *)b)->key);
}

void fr_dir_sort(fr_dir_object *objs, size_t n) {
  if (n > 1)
    qsort(objs, n, sizeof *objs, cmp_object);
}
