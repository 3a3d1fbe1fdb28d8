/*
 * The listeners' accept handler: new connections become links. Out of descriptors, it turns
 * pending connections away with a descriptor kept in reserve, as libuv does.
 */
#include "transport/ctx_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* Out of descriptors (EMFILE, ENFILE), a connection stays pending and the level-triggered
 * listener reports it again at once: the leader spun on it and logged each time. As libuv does,
 * the process keeps one descriptor in reserve; it is given up to accept each pending connection
 * and close it at once (the peer sees the link closed and may retry), then taken back. The
 * warning is said at most once a second, with how many connections were turned away. */
static int spare_fd = -1;

void fr_ctx_spare_take(void) {
  int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  int none = -1;
  if (fd >= 0 &&
      !__atomic_compare_exchange_n(&spare_fd, &none, fd, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
    close(fd); /* another thread keeps one already */
}

static void refuse_pending(fr_listener *ls, int err) {
  static uint64_t last_warn_ns, refused;
  int spare = __atomic_exchange_n(&spare_fd, -1, __ATOMIC_ACQ_REL);
  if (spare >= 0)
    close(spare);
  for (int fd; (fd = accept4(ls->poller.fd, NULL, NULL, SOCK_CLOEXEC)) >= 0;) {
    close(fd);
    __atomic_add_fetch(&refused, 1, __ATOMIC_RELAXED);
  }
  fr_ctx_spare_take();
  uint64_t now = fr_now_ns(), last = __atomic_load_n(&last_warn_ns, __ATOMIC_RELAXED);
  if (now - last < 1000000000ull ||
      !__atomic_compare_exchange_n(&last_warn_ns, &last, now, false, __ATOMIC_RELAXED,
                                   __ATOMIC_RELAXED))
    return;
  uint64_t n = __atomic_exchange_n(&refused, 0, __ATOMIC_RELAXED);
  fr_warn("%s listener: accept: %s: %llu connection%s closed unserved (raise `ulimit -n`)",
          ls->ops->name, strerror(err), (unsigned long long)n, n == 1 ? "" : "s");
}

void fr_ctx_on_accept(fr_poller *p, uint32_t events) {
  fr_listener *ls = (fr_listener *)p;
  for (;;) {
    int fd = accept4(p->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED)
        continue;
      if (errno == EMFILE || errno == ENFILE)
        refuse_pending(ls, errno);
      else if (errno != EAGAIN)
        fr_warn("%s listener: accept: %s", ls->ops->name, strerror(errno));
      return;
    }
    ferry_link *l = fr_link_new(ls->ctx, ls->ops, fd, true);
    if (!l) {
      close(fd);
      continue;
    }
    if (fr_link_start(l) != 0)
      fr_warn("%s listener: %s", ls->ops->name, ferry_last_error());
    fr_link_unref(l); /* the ctx holds it while it lives */
  }
}
