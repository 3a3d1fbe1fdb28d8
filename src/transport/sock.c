/*
 * Socket plumbing shared by the socket transports (tcp, and shm's unix-socket control channel):
 * connect with a timeout, write a whole iovec by a deadline (with an optional passed fd), and
 * receive with file-descriptor collection. Sockets of started links are non-blocking; these
 * helpers wait with poll() so a dead or stuck peer costs at most the deadline.
 */
#include "transport/transport.h"

#include <errno.h>
#include <sched.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int fr_sock_set_nonblock(int fd, bool on) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0)
    return fr_err_errno(FERRY_ESYS, "fcntl");
  flags = on ? flags | O_NONBLOCK : flags & ~O_NONBLOCK;
  if (fcntl(fd, F_SETFL, flags) < 0)
    return fr_err_errno(FERRY_ESYS, "fcntl");
  return 0;
}

static int wait_fd(int fd, short events, uint64_t deadline_ns) {
  for (;;) {
    int ms = fr_ms_left(deadline_ns);
    if (ms == 0 && fr_now_ns() >= deadline_ns)
      return FERRY_ETIMEDOUT;
    struct pollfd pfd = {.fd = fd, .events = events};
    int n = poll(&pfd, 1, ms);
    if (n > 0)
      return 0;
    if (n == 0)
      return FERRY_ETIMEDOUT;
    if (errno != EINTR)
      return FERRY_ESYS;
  }
}

int fr_sock_connect(int fd, const struct sockaddr *addr, socklen_t len, int timeout_ms,
                    const char *what) {
  int rc = fr_sock_set_nonblock(fd, true);
  if (rc != 0)
    return rc;
  if (connect(fd, addr, len) < 0) {
    if (errno != EINPROGRESS && errno != EAGAIN)
      return fr_err_errno(FERRY_ECONNECT, "connect to %s", what);
    if (wait_fd(fd, POLLOUT, fr_deadline_ns(timeout_ms)) != 0)
      return fr_err(FERRY_ECONNECT, "connect to %s: no answer within %d ms", what, timeout_ms);
    int err = 0;
    socklen_t elen = sizeof err;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen);
    if (err) {
      errno = err;
      return fr_err_errno(FERRY_ECONNECT, "connect to %s", what);
    }
  }
  return fr_sock_set_nonblock(fd, false);
}

int fr_sock_sendv(int fd, struct iovec *iov, int iovcnt, int fd_out, uint64_t spin_ns,
                  uint64_t deadline_ns) {
  char cbuf[CMSG_SPACE(sizeof(int))];
  uint64_t spin_end = spin_ns ? fr_now_ns() + spin_ns : 0;
  while (iovcnt > 0) {
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)iovcnt};
    if (fd_out >= 0) {
      memset(cbuf, 0, sizeof cbuf);
      mh.msg_control = cbuf;
      mh.msg_controllen = sizeof cbuf;
      struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      memcpy(CMSG_DATA(c), &fd_out, sizeof(int));
    }
    ssize_t n = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        fr_ctx_lead_early_drop();                 /* others drive the links while this send waits */
        if (spin_end && fr_now_ns() < spin_end) { /* the reader is likely reading now */
          sched_yield();
          continue;
        }
        int rc = wait_fd(fd, POLLOUT, deadline_ns);
        if (rc == FERRY_ETIMEDOUT)
          return fr_err(FERRY_ETIMEDOUT, "send: peer did not take the bytes in time");
        if (rc != 0)
          return fr_err_errno(FERRY_EPEER, "send: poll");
        continue;
      }
      return fr_err_errno(FERRY_EPEER, "send");
    }
    fd_out = -1; /* the fd went with the first byte */
    size_t left = (size_t)n;
    while (iovcnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      iov++;
      iovcnt--;
    }
    if (iovcnt > 0) {
      iov->iov_base = (uint8_t *)iov->iov_base + left;
      iov->iov_len -= left;
    }
  }
  return 0;
}

ssize_t fr_sock_recv_some(int fd, void *buf, size_t len, int *fds, int *nfds, int max_fds) {
  char cbuf[CMSG_SPACE(sizeof(int) * FR_MAX_RX_FDS)];
  struct iovec iov = {.iov_base = buf, .iov_len = len};
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  if (fds) {
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
  }
  ssize_t n;
  do
    n = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  while (n < 0 && errno == EINTR);
  if (n < 0)
    return -errno;
  if (fds) {
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
        continue;
      size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; i++) {
        int got;
        memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof got);
        if (*nfds < max_fds)
          fds[(*nfds)++] = got;
        else
          close(got); /* a peer flooding us with fds gets them closed */
      }
    }
  }
  return n;
}

int fr_sock_recv_all(int fd, void *buf, size_t len, uint64_t deadline_ns, int *fds, int *nfds) {
  uint8_t *p = buf;
  while (len > 0) {
    ssize_t n = fr_sock_recv_some(fd, p, len, fds, nfds, FR_MAX_RX_FDS);
    if (n == 0)
      return fr_err(FERRY_EPEER, "peer closed the connection");
    if (n == -EAGAIN || n == -EWOULDBLOCK) {
      int rc = wait_fd(fd, POLLIN, deadline_ns);
      if (rc == FERRY_ETIMEDOUT)
        return fr_err(FERRY_ETIMEDOUT, "peer sent nothing in time");
      if (rc != 0)
        return fr_err_errno(FERRY_EPEER, "recv: poll");
      continue;
    }
    if (n < 0) {
      errno = (int)-n;
      return fr_err_errno(FERRY_EPEER, "recv");
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}
