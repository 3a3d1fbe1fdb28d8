/*
 * Helpers of the store commands (store_io.h): the terminal progress bar, .npy headers and the
 * short-lived node every store command opens (a context plus a store that hands its puts to a
 * holder, `ferry serve`, so they outlive the command).
 */
#include "cli/store_io.h"
#include "cli/cli.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void cli_progress_start(cli_progress *p, const char *what, uint64_t total) {
  *p = (cli_progress){.what = what, .total = total, .last_pct = -1};
  p->on = total > CLI_PROGRESS_MIN && isatty(STDERR_FILENO);
  cli_progress_update(p, 0, total);
}

void cli_progress_update(void *arg, uint64_t done, uint64_t total) {
  cli_progress *p = arg;
  if (!p->on || total == 0)
    return;
  int pct = (int)(done * 100 / total);
  if (pct == p->last_pct)
    return;
  p->last_pct = pct;
  char bar[41];
  int fill = pct * 40 / 100;
  for (int i = 0; i < 40; i++)
    bar[i] = i < fill ? '#' : ' ';
  bar[40] = '\0';
  fprintf(stderr, "\r%s [%s] %3d%% %llu/%llu MiB", p->what, bar, pct,
          (unsigned long long)(done >> 20), (unsigned long long)(total >> 20));
  fflush(stderr);
}

void cli_progress_end(cli_progress *p) {
  if (p->on)
    fputc('\n', stderr);
}

bool cli_has_suffix(const char *s, const char *suffix) {
  size_t n = strlen(s), m = strlen(suffix);
  return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* ---- .npy ---- */

static const struct {
  const char *descr;
  ferry_dtype dtype;
} npy_types[] = {
    {"|b1", FERRY_DTYPE_BOOL}, {"|u1", FERRY_DTYPE_U8},  {"<u2", FERRY_DTYPE_U16},
    {"<u4", FERRY_DTYPE_U32},  {"<u8", FERRY_DTYPE_U64}, {"|i1", FERRY_DTYPE_I8},
    {"<i2", FERRY_DTYPE_I16},  {"<i4", FERRY_DTYPE_I32}, {"<i8", FERRY_DTYPE_I64},
    {"<f2", FERRY_DTYPE_F16},  {"<f4", FERRY_DTYPE_F32}, {"<f8", FERRY_DTYPE_F64},
};

static int npy_shape(const char *header, ferry_tensor_desc *desc) {
  const char *p = strstr(header, "'shape':");
  const char *open = p ? strchr(p, '(') : NULL;
  const char *close = open ? strchr(open, ')') : NULL;
  if (!close)
    return FERRY_EPROTO;
  desc->ndim = 0;
  for (const char *q = open + 1; q < close;) {
    while (q < close && (*q == ' ' || *q == ','))
      q++;
    if (q >= close)
      break;
    char *end;
    unsigned long long v = strtoull(q, &end, 10);
    if (end == q || desc->ndim == FERRY_MAX_DIMS)
      return FERRY_EPROTO;
    desc->shape[desc->ndim++] = v;
    q = end;
  }
  return 0;
}

int cli_npy_parse(const uint8_t *buf, size_t len, ferry_tensor_desc *desc, size_t *data_offset) {
  if (len < 10 || memcmp(buf, "\x93NUMPY", 6) != 0)
    return FERRY_EPROTO;
  size_t hlen = buf[6] == 1 ? (size_t)(buf[8] | buf[9] << 8) : 0;
  size_t start = 10;
  if (buf[6] >= 2 && len >= 12) {
    hlen = (size_t)buf[8] | (size_t)buf[9] << 8 | (size_t)buf[10] << 16 | (size_t)buf[11] << 24;
    start = 12;
  }
  if (hlen == 0 || hlen > 65536 || start + hlen > len)
    return FERRY_EPROTO;
  char header[65537];
  memcpy(header, buf + start, hlen);
  header[hlen] = '\0';
  if (strstr(header, "'fortran_order': True"))
    return FERRY_EPROTO;
  desc->dtype = FERRY_DTYPE_INVALID;
  for (size_t i = 0; i < sizeof npy_types / sizeof npy_types[0]; i++)
    if (strstr(header, npy_types[i].descr))
      desc->dtype = npy_types[i].dtype;
  if (desc->dtype == FERRY_DTYPE_INVALID || npy_shape(header, desc) != 0)
    return FERRY_EPROTO;
  *data_offset = start + hlen;
  return 0;
}

int cli_npy_write_header(FILE *f, const ferry_tensor_desc *desc) {
  const char *descr = NULL;
  for (size_t i = 0; i < sizeof npy_types / sizeof npy_types[0]; i++)
    if (npy_types[i].dtype == desc->dtype)
      descr = npy_types[i].descr;
  if (!descr)
    return FERRY_EDTYPE;
  char shape[256] = "";
  size_t n = 0;
  for (uint32_t i = 0; i < desc->ndim; i++)
    n += (size_t)snprintf(shape + n, sizeof shape - n, "%llu,%s",
                          (unsigned long long)desc->shape[i], desc->ndim > 1 ? " " : "");
  if (desc->ndim > 1 && n >= 2)
    shape[n - 2] = '\0';
  char header[512];
  int len = snprintf(header, sizeof header,
                     "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }", descr, shape);
  int total = 10 + len + 1;
  int pad = (64 - total % 64) % 64;
  uint16_t hlen = (uint16_t)(len + pad + 1);
  uint8_t pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (uint8_t)hlen, (uint8_t)(hlen >> 8)};
  fwrite(pre, 1, sizeof pre, f);
  fwrite(header, 1, (size_t)len, f);
  for (int i = 0; i < pad; i++)
    fputc(' ', f);
  fputc('\n', f);
  return ferror(f) ? FERRY_ESYS : 0;
}

/* ---- the short-lived node ---- */

int cli_node_open(cli_node *n, const char *directory, const char *cmd) {
  char name[64];
  snprintf(name, sizeof name, "cli-%ld", (long)getpid());
  ferry_ctx_opts co = {.size = sizeof co, .name = name};
  *n = (cli_node){0};
  int rc = ferry_ctx_open(&co, &n->ctx);
  if (rc != 0)
    return cli_fail(cmd, rc, "cannot open a context");
  ferry_store_opts so = {.size = sizeof so, .directory = directory, .flags = FERRY_STORE_DELEGATE};
  rc = ferry_store_open(n->ctx, &so, &n->store);
  if (rc != 0) {
    ferry_ctx_close(n->ctx);
    return cli_fail(cmd, rc, "cannot reach the directory");
  }
  return 0;
}

void cli_node_close(cli_node *n) {
  ferry_store_close(n->store);
  ferry_ctx_close(n->ctx);
}
