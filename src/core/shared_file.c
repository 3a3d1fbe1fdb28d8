/*
 * Files in directories every user may write (FERRY_CTL_DIR, /dev/shm by default): control cells
 * and the Python binding's refit rendezvous files live there, so another local user can plant
 * anything under the names ferry looks for. A symbolic link would send a write to a file of the
 * victim's, a FIFO would block an open or a read for ever, and another user's file would feed
 * the victim a forged address or pid. So such a file is opened without following links and
 * without blocking, and used only when fstat says it is a regular file this user owns; anything
 * else is refused with one line saying what was found (docs/SECURITY.md).
 */
#include "core/core.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *kind_of(mode_t mode) {
  if (S_ISLNK(mode))
    return "a symbolic link";
  if (S_ISFIFO(mode))
    return "a FIFO";
  if (S_ISDIR(mode))
    return "a directory";
  if (S_ISSOCK(mode))
    return "a socket";
  if (S_ISCHR(mode) || S_ISBLK(mode))
    return "a device";
  return "not a regular file";
}

static int refuse(const char *name, const char *what) {
  return fr_err(FERRY_EACCES,
                "'%s' is %s, not a regular file of this user's (uid %u): not used; another user "
                "may have planted it: remove it, or set FERRY_CTL_DIR to a directory only this "
                "user may write",
                name, what, (unsigned)geteuid());
}

int fr_open_shared(int dfd, const char *name, int flags, int *fd) {
  int f = openat(dfd, name, flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (f < 0) {
    if (errno == ENOENT)
      return fr_err(FERRY_ENOTFOUND, "no file '%s'", name);
    if (errno == ELOOP || errno == ENXIO || errno == EISDIR || errno == ENOTDIR) {
      struct stat st;
      bool seen = fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0;
      return refuse(name, seen ? kind_of(st.st_mode) : "not a regular file");
    }
    return fr_err_errno(FERRY_EACCES, "open '%s'", name);
  }
  struct stat st;
  if (fstat(f, &st) != 0) {
    int rc = fr_err_errno(FERRY_ESYS, "fstat '%s'", name);
    close(f);
    return rc;
  }
  if (!S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
    char owner[48];
    snprintf(owner, sizeof owner, "owned by uid %u", (unsigned)st.st_uid);
    close(f);
    return refuse(name, S_ISREG(st.st_mode) ? owner : kind_of(st.st_mode));
  }
  *fd = f;
  return 0;
}
