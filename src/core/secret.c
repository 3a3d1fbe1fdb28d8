/*
 * The per-user fleet secret: what a context proves in the link handshake when no token is given
 * (neither ferry_ctx_opts.token nor FERRY_TOKEN). Every process of a user reads the same file
 * (FERRY_TOKEN_FILE, else ~/.ferry/token), so they talk to each other with no configuration,
 * while another user, who cannot read it, cannot connect at all (docs/SECURITY.md).
 *
 * The first process to need it makes it: 32 random bytes in hex, written to a private temporary
 * file and published with link(2), which never replaces a file that is there. Two processes that
 * start at once both try; one wins, the other finds the winner's file, and both then use what
 * the file holds (rename(2) would let the later one replace a secret the earlier one already
 * uses). A file that another user owns, or that group or others may read or write, is refused:
 * such a secret is not this user's alone.
 */
#include "core/core.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define SECRET_BYTES 32
#define TOKEN_MAX 1024 /* an edited file may hold any secret; more than this is not one */

/* The secret in the open file fd (path names it in errors), checked; malloc'd in *out. */
static int read_secret(int fd, const char *path, char **out) {
  struct stat st;
  if (fstat(fd, &st) != 0)
    return fr_err_errno(FERRY_ESYS, "fleet token file '%s': fstat", path);
  if (!S_ISREG(st.st_mode))
    return fr_err(FERRY_EINVAL, "fleet token file '%s' is not a regular file", path);
  if (st.st_uid != geteuid())
    return fr_err(FERRY_EINVAL,
                  "fleet token file '%s' is owned by uid %u, not by this user (uid %u): remove "
                  "it, or set FERRY_TOKEN_FILE to a file of this user's",
                  path, (unsigned)st.st_uid, (unsigned)geteuid());
  if (st.st_mode & 077)
    return fr_err(FERRY_EINVAL,
                  "fleet token file '%s' has mode %04o: group or others may use it; run "
                  "`chmod 600 %s` (or remove it to have a new secret made)",
                  path, (unsigned)(st.st_mode & 07777), path);
  char buf[TOKEN_MAX + 2];
  size_t n = 0;
  while (n < sizeof buf) {
    ssize_t r = read(fd, buf + n, sizeof buf - n);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      return fr_err_errno(FERRY_ESYS, "fleet token file '%s': read", path);
    if (r == 0)
      break;
    n += (size_t)r;
  }
  while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' '))
    n--;
  if (n == 0)
    return fr_err(FERRY_EINVAL, "fleet token file '%s' is empty (remove it to have one made)",
                  path);
  if (n < FR_TOKEN_MIN)
    return fr_err(FERRY_EINVAL,
                  "fleet token file '%s' holds %zu bytes, a token needs at least %d: remove it to "
                  "have one made, or write one with `head -c 32 /dev/urandom | base64 > %s`",
                  path, n, FR_TOKEN_MIN, path);
  if (n > TOKEN_MAX || memchr(buf, '\0', n))
    return fr_err(FERRY_EINVAL,
                  "fleet token file '%s' does not hold a token (a NUL byte, or over %d bytes)",
                  path, TOKEN_MAX);
  char *s = malloc(n + 1);
  if (!s)
    return fr_err(FERRY_ENOMEM, "fleet token");
  memcpy(s, buf, n);
  s[n] = '\0';
  *out = s;
  return 0;
}

/* The directory of path, made 0700 when it is missing (one level: ~/.ferry). */
static int make_parent(const char *path) {
  char dir[4096];
  fr_str_copy(dir, sizeof dir, path);
  char *slash = strrchr(dir, '/');
  if (!slash || slash == dir)
    return 0;
  *slash = '\0';
  if (mkdir(dir, 0700) != 0 && errno != EEXIST)
    return fr_err_errno(FERRY_ESYS,
                        "cannot make '%s' for the fleet token: set FERRY_TOKEN, or "
                        "FERRY_TOKEN_FILE to a path this user may write",
                        dir);
  return 0;
}

static int write_all(int fd, const char *buf, size_t len) {
  while (len > 0) {
    ssize_t w = write(fd, buf, len);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return -1;
    buf += w;
    len -= (size_t)w;
  }
  return 0;
}

/* Publishes a new secret at path unless one is there already (then that one stays). */
static int create_secret(const char *path) {
  int rc = make_parent(path);
  if (rc != 0)
    return rc;
  uint8_t raw[SECRET_BYTES];
  if ((rc = fr_random_bytes(raw, sizeof raw)) != 0)
    return rc;
  char text[2 * SECRET_BYTES + 2];
  for (size_t i = 0; i < SECRET_BYTES; i++)
    snprintf(text + 2 * i, 3, "%02x", raw[i]);
  text[2 * SECRET_BYTES] = '\n';
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.XXXXXX", path);
  int fd = mkostemp(tmp, O_CLOEXEC); /* 0600, whatever the umask */
  if (fd < 0)
    return fr_err_errno(FERRY_ESYS,
                        "cannot create the fleet token file '%s': set FERRY_TOKEN, or "
                        "FERRY_TOKEN_FILE to a path this user may write",
                        path);
  bool ok = fchmod(fd, 0600) == 0 && write_all(fd, text, sizeof text - 1) == 0 && fsync(fd) == 0;
  int err = errno;
  close(fd);
  bool mine = false; /* false with ok: another process published its secret first */
  if (ok && !(mine = link(tmp, path) == 0) && errno != EEXIST) {
    /* a file system without hard links may still rename without replacing */
    mine = renameat2(AT_FDCWD, tmp, AT_FDCWD, path, RENAME_NOREPLACE) == 0;
    ok = mine || errno == EEXIST;
    err = errno;
  }
  unlink(tmp);
  if (!ok) {
    errno = err;
    return fr_err_errno(FERRY_ESYS, "cannot write the fleet token file '%s'", path);
  }
  if (mine)
    fr_info("made this user's fleet token file %s", path);
  return 0;
}

int fr_token_check(const char *token, const char *what) {
  size_t n = token ? strlen(token) : 0;
  if (n >= FR_TOKEN_MIN)
    return 0;
  return fr_err(FERRY_EINVAL,
                "%s is %zu bytes, a fleet token needs at least %d: make one with "
                "`head -c 32 /dev/urandom | base64`",
                what, n, FR_TOKEN_MIN);
}

int fr_user_token(char **out) {
  char path[4096];
  int rc = fr_config_token_path(path, sizeof path);
  if (rc != 0)
    return rc;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) {
    if ((rc = create_secret(path)) != 0)
      return rc;
    fd = open(path, O_RDONLY | O_CLOEXEC);
  }
  if (fd < 0)
    return fr_err_errno(errno == EACCES ? FERRY_EINVAL : FERRY_ESYS,
                        "cannot open the fleet token file '%s'", path);
  rc = read_secret(fd, path, out);
  close(fd);
  return rc;
}
