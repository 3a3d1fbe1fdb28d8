/*
 * Test helpers: child processes (which die with the test: tu_fork) and pipes for the
 * multi-process tests, and the allowance a deadline check gives a call in this build.
 */
#include "testutil.h"

#include "core/core.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

pid_t tu_fork(void) {
  pid_t parent = getpid();
  fflush(NULL);
  pid_t pid = fork();
  assert_true(pid >= 0);
  /* the parent may have died before the death signal was set: then nobody would send it */
  if (pid == 0 && (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent))
    _exit(126);
  return pid;
}

pid_t tu_spawn(int (*fn)(void *arg), void *arg) {
  pid_t pid = tu_fork();
  if (pid == 0)
    _exit(fn(arg));
  return pid;
}

pid_t tu_spawn_exec(const char *arg1, ...) {
  char *argv[16] = {"/proc/self/exe", (char *)arg1};
  va_list ap;
  va_start(ap, arg1);
  for (int i = 2; i < 15 && (argv[i] = va_arg(ap, char *)); i++)
    ;
  va_end(ap);
  argv[15] = NULL;
  pid_t pid = tu_fork();
  if (pid == 0) {
    execv("/proc/self/exe", argv);
    _exit(127);
  }
  return pid;
}

int tu_wait(pid_t pid) {
  int st = 0;
  while (waitpid(pid, &st, 0) < 0)
    if (errno != EINTR)
      return -1;
  if (WIFSIGNALED(st))
    return 128 + WTERMSIG(st);
  return WEXITSTATUS(st);
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define TU_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define TU_SANITIZED 1
#endif
#endif

double tu_allowance_ms(int timeout_ms, double plain_ms) {
#ifdef TU_SANITIZED
  return timeout_ms > plain_ms ? timeout_ms : plain_ms;
#else
  (void)timeout_ms;
  return plain_ms;
#endif
}

void tu_pipe_open(tu_pipe *p) {
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  p->rd = fds[0];
  p->wr = fds[1];
}

void tu_pipe_close(tu_pipe *p) {
  close(p->rd);
  close(p->wr);
}

void tu_pipe_put(tu_pipe *p, const void *buf, size_t len) {
  const char *c = buf;
  while (len > 0) {
    ssize_t n = write(p->wr, c, len);
    if (n < 0 && errno == EINTR)
      continue;
    assert_true(n > 0);
    c += n;
    len -= (size_t)n;
  }
}

int tu_pipe_get(tu_pipe *p, void *buf, size_t len, int timeout_ms) {
  char *c = buf;
  while (len > 0) {
    struct pollfd pfd = {.fd = p->rd, .events = POLLIN};
    if (poll(&pfd, 1, timeout_ms) <= 0)
      return -1;
    ssize_t n = read(p->rd, c, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    c += n;
    len -= (size_t)n;
  }
  return 0;
}

void tu_rmdir_files(const char *dir) {
  DIR *d = opendir(dir);
  struct dirent *e;
  char path[4096];
  while (d && (e = readdir(d)))
    if (e->d_name[0] != '.') {
      snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
      unlink(path);
    }
  if (d)
    closedir(d);
  rmdir(dir);
}

void tu_fill(void *buf, size_t len, uint64_t seed) {
  uint8_t *b = buf;
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < len; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b[i] = (uint8_t)x;
  }
}

void tu_skip(tu_skip_why why, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  const char *strict = getenv("FERRY_TEST_STRICT");
  if (why == TU_SKIP_FIXABLE && strict && strcmp(strict, "1") == 0)
    fail_msg("would skip under make test, which installs what it needs: %s", msg);
  fprintf(stderr, "SKIP %s\n", msg);
}

void tu_filter(void) {
  const char *only = getenv("FERRY_TEST_ONLY"), *skip = getenv("FERRY_TEST_SKIP");
  if (only && *only)
    cmocka_set_test_filter(only);
  if (skip && *skip)
    cmocka_set_skip_filter(skip);
}

/* Whether "/" is a mount point as this process sees it (not so in a plain chroot). */
static bool root_is_mount(void) {
  FILE *f = fopen("/proc/self/mountinfo", "r");
  char line[1024];
  bool found = false;
  while (f && !found && fgets(line, sizeof line, f)) {
    char mount_point[512];
    found =
        sscanf(line, "%*s %*s %*s %*s %511s", mount_point) == 1 && strcmp(mount_point, "/") == 0;
  }
  if (f)
    fclose(f);
  return found;
}

tu_skip_why tu_netns_skip_why(void) {
  return geteuid() == 0 && root_is_mount() ? TU_SKIP_FIXABLE : TU_SKIP_NOT_HERE;
}

/* Whether task `tid` of /proc/PID/task (dir) is named `thread`. */
static bool task_named(const char *dir, const char *tid, const char *thread) {
  char path[512], comm[64] = "";
  snprintf(path, sizeof path, "%s/%s/comm", dir, tid);
  FILE *f = fopen(path, "r");
  bool got = f && fgets(comm, sizeof comm, f);
  if (f)
    fclose(f);
  comm[strcspn(comm, "\n")] = 0;
  return got && strcmp(comm, thread) == 0;
}

long tu_wakeups(pid_t pid, const char *thread) {
  char dir[64];
  snprintf(dir, sizeof dir, "/proc/%d/task", (int)pid);
  DIR *d = opendir(dir);
  if (!d)
    return -1;
  long n = 0;
  for (struct dirent *e; (e = readdir(d));) {
    if (e->d_name[0] == '.' || (thread && !task_named(dir, e->d_name, thread)))
      continue;
    char path[512], line[128];
    snprintf(path, sizeof path, "%s/%s/status", dir, e->d_name);
    FILE *f = fopen(path, "r");
    for (long v; f && fgets(line, sizeof line, f);)
      if (sscanf(line, "voluntary_ctxt_switches: %ld", &v) == 1)
        n += v;
    if (f)
      fclose(f);
  }
  closedir(d);
  return n;
}

bool tu_cuda_use(void) {
  const char *mode = getenv("FERRY_TEST_CUDA");
  bool driver = mode && strcmp(mode, "driver") == 0;
  if (!driver) {
    const char *stub = getenv("FERRY_CUDASTUB");
    if (!stub || !*stub) {
      tu_skip(TU_SKIP_FIXABLE, "no CUDA driver: FERRY_CUDASTUB (the stand-in's path) is not set");
      return false;
    }
    setenv("FERRY_CUDA_LIB", stub, 1);
  }
  ferry_cuda_info ci = {.size = sizeof ci};
  ferry_cuda_info_get(&ci);
  if (!ci.found || ci.devices < 1) {
    tu_skip(driver ? TU_SKIP_NOT_HERE : TU_SKIP_FIXABLE, "no CUDA driver: %s",
            ci.found ? "no device" : ci.detail);
    return false;
  }
  return true;
}

/* ---- a slow-loris (tu_slowloris) ---- */

static int loris_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    close(fd);
    fd = -1;
  }
  return fd;
}

static int64_t loris_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A trickler: its request line now, a header line at each call after. */
static int loris_open(int port) {
  static const char line[] = "GET /healthz HTTP/1.1\r\n";
  int fd = loris_connect(port);
  if (fd >= 0 && send(fd, line, sizeof line - 1, MSG_NOSIGNAL) != (ssize_t)(sizeof line - 1)) {
    close(fd);
    fd = -1;
  }
  return fd;
}

/* Whether the server closed fd (end of stream, a reset, or a response it then closed on). */
static bool loris_closed(int fd) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  if (poll(&p, 1, 0) != 1)
    return false;
  char buf[512];
  ssize_t r = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
  return r <= 0 && !(r < 0 && (errno == EAGAIN || errno == EINTR));
}

/* The probe's round trip: true for a 200 within probe_ms; *ms how long it took. */
static bool loris_probe(int port, const char *path, int probe_ms, int *ms) {
  int64_t t0 = loris_ms();
  int fd = loris_connect(port), code = 0;
  char req[256], resp[1024];
  snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
           path);
  size_t n = 0;
  if (fd >= 0 && send(fd, req, strlen(req), MSG_NOSIGNAL) == (ssize_t)strlen(req)) {
    while (n + 1 < sizeof resp) {
      int left = probe_ms - (int)(loris_ms() - t0);
      struct pollfd p = {.fd = fd, .events = POLLIN};
      if (left <= 0 || poll(&p, 1, left) != 1)
        break;
      ssize_t r = recv(fd, resp + n, sizeof resp - 1 - n, 0);
      if (r <= 0)
        break;
      n += (size_t)r;
    }
  }
  resp[n] = '\0';
  if (fd >= 0)
    close(fd);
  *ms = (int)(loris_ms() - t0);
  return sscanf(resp, "HTTP/1.%*d %d", &code) == 1 && code == 200;
}

tu_loris tu_slowloris(int port, int n, int interval_ms, int run_ms, int settle_ms,
                      const char *probe, int probe_ms) {
  static const char header[] = "X-Trickle: 1\r\n";
  tu_loris out = {0};
  int *fds = calloc((size_t)n, sizeof *fds);
  assert_non_null(fds);
  for (int i = 0; i < n; i++)
    if ((fds[i] = loris_open(port)) >= 0)
      out.opened++;
  int64_t start = loris_ms(), next_line = start + interval_ms, next_probe = start;
  for (;;) {
    int64_t now = loris_ms();
    bool running = now - start < run_ms;
    if (!running && now - start >= run_ms + settle_ms)
      break;
    int open = 0;
    for (int i = 0; i < n; i++) {
      if (fds[i] >= 0 && loris_closed(fds[i])) {
        close(fds[i]);
        fds[i] = -1;
      }
      if (fds[i] < 0 && running && out.opened < 4 * n && (fds[i] = loris_open(port)) >= 0)
        out.opened++;
      open += fds[i] >= 0;
    }
    if (!running && open == 0)
      break;
    if (now >= next_line) {
      for (int i = 0; i < n; i++)
        if (fds[i] >= 0)
          send(fds[i], header, sizeof header - 1, MSG_NOSIGNAL);
      next_line = now + interval_ms;
    }
    if (running && now >= next_probe) {
      int ms;
      out.probes++;
      out.probes_ok += loris_probe(port, probe, probe_ms, &ms);
      if (ms > out.worst_probe_ms)
        out.worst_probe_ms = ms;
      next_probe = loris_ms() + 200;
    }
    usleep(20000);
  }
  for (int i = 0; i < n; i++)
    if (fds[i] >= 0) {
      out.still_open++;
      close(fds[i]);
    }
  free(fds);
  return out;
}

/* ---- a name service that hangs (fr_resolve's lookup) ---- */

static pthread_mutex_t dns_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t dns_cond = PTHREAD_COND_INITIALIZER;
static bool dns_released;
static int dns_waiting, dns_held;

static int hanging_lookup(const char *host, const char *service, const struct addrinfo *hints,
                          struct addrinfo **out) {
  (void)host, (void)service, (void)hints, (void)out;
  pthread_mutex_lock(&dns_lock);
  dns_waiting++;
  dns_held++;
  while (!dns_released)
    pthread_cond_wait(&dns_cond, &dns_lock);
  dns_waiting--;
  pthread_cond_broadcast(&dns_cond);
  pthread_mutex_unlock(&dns_lock);
  return EAI_NONAME;
}

void tu_dns_hang(void) {
  pthread_mutex_lock(&dns_lock);
  dns_released = false;
  dns_held = 0;
  pthread_mutex_unlock(&dns_lock);
  fr_resolve_set_lookup(hanging_lookup);
}

int tu_dns_answer(void) {
  pthread_mutex_lock(&dns_lock);
  dns_released = true;
  pthread_cond_broadcast(&dns_cond);
  while (dns_waiting > 0)
    pthread_cond_wait(&dns_cond, &dns_lock);
  int held = dns_held;
  pthread_mutex_unlock(&dns_lock);
  fr_resolve_set_lookup(NULL);
  return held;
}
