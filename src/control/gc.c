/*
 * Reclaiming what killed engines leave in FERRY_CTL_DIR. A control cell's name is taken over by
 * the next engine of that name (cell.c replaces a dead engine's cell), but a name that never
 * comes back keeps its file in /dev/shm for good, and so does a half-made cell
 * (`ferry-ctl-NAME.new-PID-*`) of a process killed between creating and publishing it.
 * ferry_ctl_gc removes both, taking the same directory lock as an engine that replaces a stale
 * cell, so it never removes a cell that a live engine has just published. Only regular files of
 * this user's are judged (fr_open_shared): a link, a FIFO or another user's file planted under
 * such a name stays, and never blocks the scan.
 */
#include "control/cell.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#define CELL_PREFIX "ferry-ctl-"

/* fr_open_shared, saying why a file that is there was skipped (a link, a FIFO, another user's). */
static int open_ours(int dfd, const char *file, int *fd) {
  int rc = fr_open_shared(dfd, file, O_RDONLY, fd);
  if (rc != 0 && rc != FERRY_ENOTFOUND)
    fr_warn("gc: skipped %s", ferry_last_error());
  return rc;
}

/* Whether the cell file at `path` belongs to a dead engine; *why says what was found. Files that
 * are not cells (or of another layout) are not ours to judge: false. */
static bool cell_is_stale(int dfd, const char *file, char *why, size_t why_len) {
  int fd;
  if (open_ours(dfd, file, &fd) != 0)
    return false;
  fr_ctl_header hdr;
  struct stat st;
  bool stale = false;
  if (fstat(fd, &st) == 0 && pread(fd, &hdr, sizeof hdr, 0) == (ssize_t)sizeof hdr &&
      fr_ctl_header_check(&hdr, (uint64_t)st.st_size, file) == 0 &&
      !fr_ctl_pid_alive(hdr.engine_pid, hdr.engine_start)) {
    snprintf(why, why_len, "control cell of dead engine pid %d (incarnation %llu)",
             (int)hdr.engine_pid, (unsigned long long)hdr.incarnation);
    stale = true;
  }
  close(fd);
  return stale;
}

/* "ferry-ctl-NAME.new-PID-RAND": the pid of the process that was making it. */
static pid_t half_made_pid(const char *file) {
  const char *p = strstr(file, ".new-");
  if (!p)
    return 0;
  char *end;
  long pid = strtol(p + 5, &end, 10);
  return end != p + 5 && *end == '-' && pid > 0 ? (pid_t)pid : 0;
}

/* Whether `file` is garbage; *why says why. Decided under the directory lock. */
static bool is_garbage(int dfd, const char *file, char *why, size_t why_len) {
  pid_t maker = half_made_pid(file);
  if (maker > 0) {
    int fd;
    if (fr_ctl_pid_exists(maker) || open_ours(dfd, file, &fd) != 0)
      return false; /* a live maker's, or not a file of this user's: not ours to remove */
    close(fd);
    snprintf(why, why_len, "half-made control cell of dead pid %d", (int)maker);
    return true;
  }
  return cell_is_stale(dfd, file, why, why_len);
}

int ferry_ctl_gc(int dry_run, ferry_ctl_gc_fn each, void *arg) {
  const char *dir = fr_config_str("FERRY_CTL_DIR");
  if (!*dir)
    dir = "/dev/shm";
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0)
    return fr_err_errno(FERRY_ESYS, "gc: open %s", dir);
  DIR *d = fdopendir(dup(dfd));
  if (!d || flock(dfd, LOCK_EX) != 0) {
    int rc = fr_err_errno(FERRY_ESYS, "gc: read or lock %s", dir);
    if (d)
      closedir(d);
    close(dfd);
    return rc;
  }
  int count = 0;
  for (struct dirent *e; (e = readdir(d));) {
    char why[160], path[4096];
    if (strncmp(e->d_name, CELL_PREFIX, strlen(CELL_PREFIX)) != 0 ||
        !is_garbage(dfd, e->d_name, why, sizeof why))
      continue;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (!dry_run && unlinkat(dfd, e->d_name, 0) != 0) {
      fr_warn("gc: cannot remove %s: %s", path, strerror(errno));
      continue;
    }
    count++;
    if (each)
      each(path, why, arg);
  }
  closedir(d);
  close(dfd); /* releases the lock */
  return count;
}
