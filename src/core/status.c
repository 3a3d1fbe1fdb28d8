/*
 * Status codes and the thread-local error detail. The code says what kind of failure it was
 * (from the X-macro table in ferry.h); the detail says what failed and where.
 *
 * A detail often quotes what a peer or a caller sent (a name, a key), so it is formatted into a
 * buffer of its own and then escaped into the detail (fr_escape): no ESC, BEL, newline or
 * invalid UTF-8 reaches a caller's terminal or log through ferry_last_error(), and a format that
 * takes ferry_last_error() as an argument reads a copy, not the buffer it writes.
 */
#include "core/core.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char err_detail[FR_ERR_DETAIL_MAX];

const char *ferry_strerror(int status) {
  switch (status) {
#define FR_STATUS_MSG_(name, code, msg)                                                            \
  case (code):                                                                                     \
    return msg;
    FERRY_STATUS_TABLE(FR_STATUS_MSG_)
#undef FR_STATUS_MSG_
  }
  return "unknown status";
}

const char *ferry_status_name(int status) {
  switch (status) {
#define FR_STATUS_NAME_(name, code, msg)                                                           \
  case (code):                                                                                     \
    return "FERRY_" #name;
    FERRY_STATUS_TABLE(FR_STATUS_NAME_)
#undef FR_STATUS_NAME_
  }
  return "FERRY_E?";
}

const char *ferry_last_error(void) { return err_detail; }

void fr_err_clear(void) { err_detail[0] = '\0'; }

void fr_err_save(fr_err_keep *keep, int status) {
  keep->status = status;
  fr_str_copy(keep->detail, sizeof keep->detail, err_detail);
}

/* A plain copy: the detail kept was escaped when it was set, and fr_escape is idempotent. */
int fr_err_restore(const fr_err_keep *keep) {
  fr_str_copy(err_detail, sizeof err_detail, keep->detail);
  return keep->status;
}

int fr_err(int status, const char *fmt, ...) {
  char raw[FR_ERR_DETAIL_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(raw, sizeof raw, fmt, ap);
  va_end(ap);
  fr_escape(err_detail, sizeof err_detail, raw);
  fr_debug("error %s: %s", ferry_status_name(status), err_detail);
  return status;
}

int fr_err_errno(int status, const char *fmt, ...) {
  int saved = errno;
  char raw[FR_ERR_DETAIL_MAX];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(raw, sizeof raw, fmt, ap);
  va_end(ap);
  if (n >= 0 && (size_t)n < sizeof raw)
    snprintf(raw + n, sizeof raw - (size_t)n, ": %s", strerror(saved));
  fr_escape(err_detail, sizeof err_detail, raw);
  if (saved == ENOMEM)
    status = FERRY_ENOMEM;
  else if (saved == ENOSPC)
    status = FERRY_ENOSHM;
  fr_debug("error %s: %s", ferry_status_name(status), err_detail);
  errno = saved;
  return status;
}

int fr_err_wrap(int status, const char *fmt, ...) {
  char before[FR_ERR_DETAIL_MAX], what[FR_ERR_DETAIL_MAX];
  fr_str_copy(before, sizeof before, err_detail);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  return *before ? fr_err(status, "%s: %s", what, before) : fr_err(status, "%s", what);
}
