/*
 * The control cell as a file: naming, mapping with per-role protections, header validation,
 * process liveness (pid + start time, so a reused pid is not mistaken for a live engine or
 * rank), shared futexes, and the engine's create/close with atomic publication and detection
 * of a stale cell left by a dead engine. FERRY_CTL_DIR is shared with other users, so a cell is
 * opened only through fr_open_shared: a link, a FIFO or another user's file under a cell's name
 * is refused, never followed, blocked on or replaced.
 */
#include "control/cell.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct ferry_ctl_cell {
  int fd;
  dev_t dev;
  ino_t ino;
  uint64_t incarnation;
  char path[sizeof(((fr_ctl_map *)0)->path)];
};

/* ---- names and files ---- */

/* The one name rule (core.h: fr_name_ok), narrowed to a file name's safe characters. */
static bool name_ok(const char *name) {
  if (!fr_name_ok(name, FR_CTL_NAME_MAX) || name[0] == '.')
    return false;
  for (size_t i = 0; name[i]; i++) {
    char c = name[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-';
    if (!ok)
      return false;
  }
  return true;
}

int fr_ctl_path(const char *name, fr_ctl_map *map) {
  if (!name_ok(name))
    return fr_err(FERRY_EINVAL, "control cell name '%s': want 1-%d of [A-Za-z0-9._-]",
                  name ? name : "(null)", FR_CTL_NAME_MAX);
  const char *dir = fr_config_str("FERRY_CTL_DIR");
  int n = snprintf(map->path, sizeof map->path, "%s/ferry-ctl-%s", *dir ? dir : "/dev/shm", name);
  if (n < 0 || (size_t)n >= sizeof map->path)
    return fr_err(FERRY_EINVAL, "control cell '%s': FERRY_CTL_DIR too long", name);
  fr_str_copy(map->name, sizeof map->name, name);
  return 0;
}

static uint32_t file_size_for(uint32_t nranks) {
  uint32_t lines = nranks * FR_CTL_LINE;
  return FR_CTL_HEADER_BYTES + (lines + FR_CTL_PAGE - 1) / FR_CTL_PAGE * FR_CTL_PAGE;
}

int fr_ctl_rank_error(int32_t raw) {
  return raw < 0 && strcmp(ferry_status_name(raw), "FERRY_E?") != 0 ? raw : FERRY_EPEER;
}

int fr_ctl_header_check(const fr_ctl_header *hdr, uint64_t file_size, const char *name) {
  if (file_size < sizeof *hdr || hdr->magic != FR_CTL_MAGIC)
    return fr_err(FERRY_EPROTO, "'%s' is not a ferry control cell", name);
  if (hdr->layout_version != FR_CTL_LAYOUT_VERSION)
    return fr_err(FERRY_EPROTO, "control cell '%s' has layout version %u, this ferry reads %u",
                  name, hdr->layout_version, FR_CTL_LAYOUT_VERSION);
  if (hdr->nranks < 1 || hdr->nranks > FERRY_CTL_MAX_RANKS || hdr->line_size != FR_CTL_LINE ||
      hdr->lines_offset != FR_CTL_HEADER_BYTES || hdr->file_size != file_size_for(hdr->nranks) ||
      file_size < hdr->file_size)
    return fr_err(FERRY_EPROTO, "control cell '%s': corrupt header (%u ranks, %lu bytes)", name,
                  hdr->nranks, (unsigned long)file_size);
  return 0;
}

/* ---- mapping ---- */

int fr_ctl_map_fd(fr_ctl_map *map, int role) {
  int hdr_prot = role == FR_CTL_MAP_RANK ? PROT_READ : PROT_READ | PROT_WRITE;
  int line_prot = role == FR_CTL_MAP_CONTROLLER ? PROT_READ : PROT_READ | PROT_WRITE;
  void *hdr = mmap(NULL, FR_CTL_HEADER_BYTES, hdr_prot, MAP_SHARED, map->fd, 0);
  if (hdr == MAP_FAILED)
    return fr_err_errno(FERRY_ESYS, "map control cell '%s'", map->name);
  map->lines_len = file_size_for(map->nranks) - FR_CTL_HEADER_BYTES;
  void *lines = mmap(NULL, map->lines_len, line_prot, MAP_SHARED, map->fd, FR_CTL_HEADER_BYTES);
  if (lines == MAP_FAILED) {
    int rc = fr_err_errno(FERRY_ESYS, "map control cell '%s' ranks", map->name);
    munmap(hdr, FR_CTL_HEADER_BYTES);
    return rc;
  }
  map->hdr = hdr;
  map->lines = lines;
  return 0;
}

static int read_header(int fd, const char *name, fr_ctl_header *hdr, struct stat *st) {
  if (fstat(fd, st) != 0)
    return fr_err_errno(FERRY_ESYS, "stat control cell '%s'", name);
  memset(hdr, 0, sizeof *hdr);
  ssize_t n = pread(fd, hdr, sizeof *hdr, 0);
  if (n < 0)
    return fr_err_errno(FERRY_ESYS, "read control cell '%s'", name);
  return fr_ctl_header_check(hdr, (uint64_t)st->st_size, name);
}

int fr_ctl_map_open(const char *name, int role, fr_ctl_map *map) {
  memset(map, 0, sizeof *map);
  map->fd = -1;
  int rc = fr_ctl_path(name, map);
  if (rc)
    return rc;
  rc = fr_open_shared(AT_FDCWD, map->path, O_RDWR, &map->fd);
  if (rc != 0) {
    map->fd = -1;
    return rc == FERRY_ENOTFOUND
               ? fr_err(FERRY_ENOTFOUND, "no control cell '%s' (%s)", name, map->path)
               : fr_err_wrap(rc, "open control cell '%s'", name);
  }
  fr_ctl_header hdr;
  struct stat st;
  rc = read_header(map->fd, name, &hdr, &st);
  if (rc == 0) {
    map->nranks = hdr.nranks;
    map->incarnation = hdr.incarnation;
    map->dev = st.st_dev;
    map->ino = st.st_ino;
    rc = fr_ctl_map_fd(map, role);
  }
  if (rc) {
    close(map->fd);
    map->fd = -1;
  }
  return rc;
}

void fr_ctl_map_close(fr_ctl_map *map) {
  if (map->hdr)
    munmap(map->hdr, FR_CTL_HEADER_BYTES);
  if (map->lines)
    munmap(map->lines, map->lines_len);
  if (map->fd >= 0)
    close(map->fd);
  map->hdr = NULL;
  map->lines = NULL;
  map->fd = -1;
}

int fr_ctl_map_current(const fr_ctl_map *map) {
  struct stat st;
  if (stat(map->path, &st) != 0)
    return fr_err(FERRY_ENOTFOUND, "control cell '%s' was removed (its engine closed it)",
                  map->name);
  if (st.st_dev != map->dev || st.st_ino != map->ino)
    return fr_err(FERRY_ESTALE,
                  "control cell '%s' was replaced (engine restarted, incarnation %lu is old); "
                  "reopen it",
                  map->name, (unsigned long)map->incarnation);
  return 0;
}

int fr_ctl_engine_check(const fr_ctl_map *map) {
  if (!fr_ctl_pid_alive(map->hdr->engine_pid, map->hdr->engine_start))
    return fr_err(FERRY_ESTALE,
                  "control cell '%s' is stale: engine pid %d (incarnation %lu) is dead", map->name,
                  map->hdr->engine_pid, (unsigned long)map->incarnation);
  return 0;
}

/* ---- liveness ---- */

/* Reads state (field 3) and starttime (field 22) of /proc/PID/stat; -1 when unreadable. */
static int proc_stat(pid_t pid, char *state, uint64_t *start) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return errno == ENOENT ? 0 : -1;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0)
    return 0; /* exited between open and read */
  buf[n] = '\0';
  char *p = strrchr(buf, ')');
  if (!p || sscanf(p + 1, " %c", state) != 1)
    return -1;
  for (int field = 3; field <= 22 && p; field++) /* to the space before field `field` */
    p = strchr(p + 1, ' ');
  *start = p ? strtoull(p + 1, NULL, 10) : 0;
  return 1;
}

bool fr_ctl_pid_alive(pid_t pid, uint64_t start) {
  if (pid <= 0)
    return false;
  char state = '?';
  uint64_t now_start = 0;
  int found = proc_stat(pid, &state, &now_start);
  if (found < 0)
    return kill(pid, 0) == 0 || errno == EPERM;
  if (found == 0 || state == 'Z' || state == 'X')
    return false;
  return start == 0 || now_start == start;
}

bool fr_ctl_owner_alive(uint64_t owner) {
  pid_t pid = fr_ctl_owner_pid(owner);
  if (pid <= 0)
    return false;
  char state = '?';
  uint64_t start = 0;
  int found = proc_stat(pid, &state, &start);
  if (found < 0)
    return kill(pid, 0) == 0 || errno == EPERM;
  return found == 1 && state != 'Z' && state != 'X' &&
         (start & 0xffffffffull) == fr_ctl_owner_start(owner);
}

bool fr_ctl_pid_exists(pid_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

uint64_t fr_ctl_pid_start(pid_t pid) {
  char state;
  uint64_t start = 0;
  return proc_stat(pid, &state, &start) == 1 ? start : 0;
}

/* ---- watching processes ---- */

void fr_ctl_watch_close(fr_ctl_watch *w) {
  if (w->fd >= 0)
    close(w->fd);
  *w = (fr_ctl_watch){0, FR_CTL_WATCH_KILL};
}

void fr_ctl_watch_set(fr_ctl_watch *w, uint64_t owner, bool use_pidfd) {
  if (w->owner == owner)
    return;
  fr_ctl_watch_close(w);
  w->owner = owner;
  if (!use_pidfd || owner == 0)
    return;
  int fd = (int)syscall(SYS_pidfd_open, fr_ctl_owner_pid(owner), 0);
  if (fd < 0) {
    w->fd = errno == ESRCH ? FR_CTL_WATCH_DEAD : FR_CTL_WATCH_KILL;
    return;
  }
  w->fd = fd;
  bool known_start = fr_ctl_owner_start(owner) != 0; /* 0: /proc was unreadable */
  if (known_start && !fr_ctl_owner_alive(owner)) {   /* a reused pid, or dead before the pidfd */
    close(fd);
    w->fd = FR_CTL_WATCH_DEAD;
  }
}

void fr_ctl_watch_poll(const fr_ctl_watch *w, size_t n, bool *dead) {
  struct pollfd stack[64], *fds = n <= 64 ? stack : malloc(n * sizeof *fds);
  size_t nfds = 0;
  for (size_t i = 0; i < n; i++) {
    dead[i] = w[i].owner != 0 && w[i].fd == FR_CTL_WATCH_DEAD;
    if (w[i].owner == 0)
      continue;
    if (w[i].fd == FR_CTL_WATCH_KILL || (w[i].fd >= 0 && !fds))
      dead[i] = !fr_ctl_pid_exists(fr_ctl_owner_pid(w[i].owner));
    else if (w[i].fd >= 0)
      fds[nfds++] = (struct pollfd){.fd = w[i].fd, .events = POLLIN};
  }
  if (nfds > 0 && poll(fds, nfds, 0) > 0)
    for (size_t i = 0, k = 0; i < n; i++)
      if (w[i].owner != 0 && w[i].fd >= 0)
        dead[i] = fds[k++].revents != 0; /* POLLIN: it exited (POLLHUP/ERR: gone as well) */
  if (fds != stack)
    free(fds);
}

/* ---- futexes ---- */

static uint32_t *low_half(_Atomic uint64_t *word) {
  return (uint32_t *)(void *)word + (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__);
}

void fr_ctl_futex_wait(_Atomic uint64_t *word, uint64_t seen, int timeout_ms) {
  struct timespec ts = {.tv_sec = timeout_ms / 1000,
                        .tv_nsec = (long)(timeout_ms % 1000) * 1000000};
  syscall(SYS_futex, low_half(word), FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0);
}

void fr_ctl_futex_wake(_Atomic uint64_t *word) {
  syscall(SYS_futex, low_half(word), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* ---- the engine: create, publish, close ---- */

static void init_header(fr_ctl_header *hdr, uint32_t nranks) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  hdr->magic = FR_CTL_MAGIC;
  hdr->layout_version = FR_CTL_LAYOUT_VERSION;
  hdr->nranks = nranks;
  hdr->incarnation = 1;
  hdr->engine_pid = (int32_t)getpid();
  hdr->engine_start = fr_ctl_pid_start(getpid());
  hdr->created_unix_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
  hdr->lines_offset = FR_CTL_HEADER_BYTES;
  hdr->line_size = FR_CTL_LINE;
  hdr->file_size = file_size_for(nranks);
  atomic_store(&hdr->command, fr_ctl_cmd_word(0, FERRY_CTL_NONE));
}

/* Writes a fully initialized cell to a private temporary name; the caller publishes it. */
static int make_tmp_cell(fr_ctl_map *map, uint32_t nranks, char *tmp, size_t tmp_len) {
  snprintf(tmp, tmp_len, "%s.new-%d-%08x", map->path, (int)getpid(), (unsigned)fr_random_u64());
  map->fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (map->fd < 0)
    return fr_err_errno(FERRY_EACCES, "create control cell %s", tmp);
  map->nranks = nranks;
  int rc = 0;
  if (ftruncate(map->fd, file_size_for(nranks)) != 0)
    rc = fr_err_errno(FERRY_ENOSHM, "size control cell %s", tmp);
  if (rc == 0)
    rc = fr_ctl_map_fd(map, FR_CTL_MAP_ENGINE);
  if (rc == 0)
    init_header(map->hdr, nranks);
  if (rc) {
    unlink(tmp);
    fr_ctl_map_close(map);
  }
  return rc;
}

/* The name exists: replace it if its engine is dead (under a directory lock, so that two
 * engines replacing the same stale cell cannot both win). */
static int replace_stale(fr_ctl_map *map, const char *tmp, const ferry_ctl_cell_opts *opts) {
  const char *slash = strrchr(map->path, '/');
  char dir[sizeof map->path];
  snprintf(dir, sizeof dir, "%.*s", (int)(slash - map->path), map->path);
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0 || flock(dfd, LOCK_EX) != 0) {
    int rc = fr_err_errno(FERRY_ESYS, "lock %s", dir);
    if (dfd >= 0)
      close(dfd);
    return rc;
  }
  int old = -1;
  int rc = fr_open_shared(AT_FDCWD, map->path, O_RDONLY, &old);
  fr_ctl_header hdr;
  struct stat st;
  /* gone meanwhile: take the name; a link, a FIFO or another user's file: never replaced */
  if (rc == FERRY_ENOTFOUND)
    rc = 0;
  else if (rc != 0)
    rc = fr_err_wrap(FERRY_EEXIST, "control cell '%s'", map->name);
  else if ((rc = read_header(old, map->name, &hdr, &st)) != 0)
    ;
  else if (fr_ctl_pid_alive(hdr.engine_pid, hdr.engine_start))
    rc = fr_err(FERRY_EEXIST, "control cell '%s' belongs to live engine pid %d (incarnation %lu)",
                map->name, hdr.engine_pid, (unsigned long)hdr.incarnation);
  else if (FR_OPT(opts, fail_if_stale, 0))
    rc = fr_err(FERRY_ESTALE, "control cell '%s' is stale: engine pid %d (incarnation %lu) died",
                map->name, hdr.engine_pid, (unsigned long)hdr.incarnation);
  else {
    fr_warn("control cell '%s': replacing the stale cell of dead engine pid %d (incarnation %lu)",
            map->name, hdr.engine_pid, (unsigned long)hdr.incarnation);
    map->hdr->incarnation = hdr.incarnation + 1;
  }
  if (old >= 0)
    close(old);
  if (rc == 0 && rename(tmp, map->path) != 0)
    rc = fr_err_errno(FERRY_ESYS, "publish control cell %s", map->path);
  close(dfd); /* releases the lock */
  return rc;
}

static int publish(fr_ctl_map *map, const char *tmp, const ferry_ctl_cell_opts *opts) {
  if (link(tmp, map->path) == 0) {
    unlink(tmp);
    return 0;
  }
  if (errno != EEXIST)
    return fr_err_errno(FERRY_ESYS, "publish control cell %s", map->path);
  int rc = replace_stale(map, tmp, opts);
  if (rc)
    unlink(tmp);
  return rc;
}

int ferry_ctl_cell_create(const char *name, uint32_t nranks, const ferry_ctl_cell_opts *opts,
                          ferry_ctl_cell **out) {
  if (!out || nranks < 1 || nranks > FERRY_CTL_MAX_RANKS)
    return fr_err(FERRY_EINVAL, "control cell '%s': %u ranks (want 1..%d)", name ? name : "",
                  nranks, FERRY_CTL_MAX_RANKS);
  fr_ctl_map map = {.fd = -1};
  char tmp[sizeof map.path + 32];
  int rc = FR_OPTS_CHECK(opts, "ferry_ctl_cell_create");
  if (rc == 0)
    rc = fr_ctl_path(name, &map);
  if (rc == 0)
    rc = make_tmp_cell(&map, nranks, tmp, sizeof tmp);
  if (rc)
    return rc;
  rc = publish(&map, tmp, opts);
  ferry_ctl_cell *cell = rc ? NULL : calloc(1, sizeof *cell);
  struct stat st;
  if (rc == 0 && (!cell || fstat(map.fd, &st) != 0))
    rc = cell ? fr_err_errno(FERRY_ESYS, "stat %s", map.path) : FERRY_ENOMEM;
  if (rc) {
    free(cell);
    fr_ctl_map_close(&map);
    return rc;
  }
  *cell = (ferry_ctl_cell){
      .fd = map.fd, .dev = st.st_dev, .ino = st.st_ino, .incarnation = map.hdr->incarnation};
  fr_str_copy(cell->path, sizeof cell->path, map.path);
  map.fd = -1; /* the cell keeps the descriptor; the engine needs no mapping */
  fr_ctl_map_close(&map);
  fr_info("control cell '%s' created: %u ranks, incarnation %lu", name, nranks,
          (unsigned long)cell->incarnation);
  *out = cell;
  return 0;
}

void ferry_ctl_cell_close(ferry_ctl_cell *cell) {
  if (!cell)
    return;
  struct stat st;
  /* Remove the name only if it is still ours (a stale-replacement could have taken it). */
  if (stat(cell->path, &st) == 0 && st.st_dev == cell->dev && st.st_ino == cell->ino)
    unlink(cell->path);
  close(cell->fd);
  free(cell);
}

uint64_t ferry_ctl_cell_incarnation(const ferry_ctl_cell *cell) {
  return cell ? cell->incarnation : 0;
}
