/*
 * A link's handshake (link.c has the overview): the connector's side runs blocking before the
 * link is started (fr_link_handshake), the acceptor's as steps of the receive state machine
 * (HELLO, AUTH). Each side proves the fleet's token by a MAC over both nonces; over shm the
 * acceptor also passes a memory segment the connector must read back, proving the same host.
 */
#include "transport/link_impl.h"

#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- handshake ---- */

static void mac_for(const ferry_ctx *ctx, const char *label, const uint8_t a[FR_NONCE_BYTES],
                    const uint8_t b[FR_NONCE_BYTES], uint8_t out[FR_MAC_BYTES]) {
  uint8_t msg[32 + 2 * FR_NONCE_BYTES] = {0};
  size_t n = strlen(label);
  memcpy(msg, label, n);
  memcpy(msg + 32, a, FR_NONCE_BYTES);
  memcpy(msg + 32 + FR_NONCE_BYTES, b, FR_NONCE_BYTES);
  fr_hmac_sha256(ctx->token, strlen(ctx->token), msg, sizeof msg, out);
}

static int recv_frame_sync(ferry_link *l, uint8_t type, void *body, size_t body_len,
                           uint64_t deadline, int *fds, int *nfds, int *status) {
  uint8_t hdr[FR_FRAME_BYTES];
  fr_frame f;
  int rc = fr_sock_recv_all(l->poller.fd, hdr, sizeof hdr, deadline, fds, nfds);
  if (rc == 0)
    rc = fr_frame_decode(hdr, l->ctx->max_payload, &f);
  if (rc == 0 && f.type != type)
    rc = fr_err(FERRY_EPROTO, "handshake: expected frame %u, got %u", type, f.type);
  if (rc == 0 && f.len > 0)
    rc = fr_sock_recv_all(l->poller.fd, body, f.len <= body_len ? f.len : 0, deadline, fds, nfds);
  if (rc == 0)
    *status = f.status;
  return rc;
}

/* A ctx that proves this user's own secret (no explicit token) links with this user's processes
 * only. Where the kernel tells who is at the other end (shm's unix socket, which any local user
 * may reach: abstract sockets have no file permissions), another uid is refused before a byte of
 * its is parsed; the token would refuse it too, a round trip later. An explicit token is how a
 * fleet spans users. */
static int check_peer_user(ferry_link *l) {
  if (l->ctx->token_explicit || !l->ops->peer_uid)
    return 0;
  uid_t uid = 0;
  int rc = l->ops->peer_uid(l->poller.fd, &uid);
  if (rc != 0)
    return fr_err_wrap(FERRY_EAUTH, "%s link: cannot tell the peer's user", l->ops->name);
  if (uid != geteuid())
    return fr_err(FERRY_EAUTH,
                  "%s link: the peer runs as uid %u, not this user (uid %u); processes of "
                  "different users share a fleet only with an explicit FERRY_TOKEN",
                  l->ops->name, (unsigned)uid, (unsigned)geteuid());
  return 0;
}

int fr_link_handshake(ferry_link *l, int timeout_ms) {
  ferry_ctx *ctx = l->ctx;
  uint64_t deadline = fr_deadline_ns(timeout_ms);
  int rc = check_peer_user(l);
  if (rc != 0)
    return rc;
  fr_hello hello;
  memset(&hello, 0, sizeof hello);
  fr_random_bytes(hello.nonce, sizeof hello.nonce);
  fr_str_copy(hello.name, sizeof hello.name, ctx->name);
  uint8_t buf[FR_HELLO_ACK_BYTES];
  fr_hello_encode(&hello, buf);
  struct iovec iov = {buf, FR_HELLO_BYTES};
  fr_frame f = {.type = FR_HELLO, .len = FR_HELLO_BYTES};
  rc = fr_link_send_frame(l, &f, &iov, 1, -1, deadline);
  int fds[FR_MAX_RX_FDS], nfds = 0, status = 0;
  fr_hello_ack ack;
  if (rc == 0)
    rc = recv_frame_sync(l, FR_HELLO_ACK, buf, sizeof buf, deadline, fds, &nfds, &status);
  if (rc == 0)
    rc = status
             ? fr_err(status, "the peer refused the handshake (%s)%s", ferry_strerror(status),
                      status == FERRY_EAUTH ? ": another user's node, or another fleet token" : "")
             : fr_hello_ack_decode(buf, sizeof buf, &ack);
  uint8_t expect[FR_MAC_BYTES];
  if (rc == 0) {
    mac_for(ctx, "ferry-acceptor", hello.nonce, ack.nonce, expect);
    if (!fr_memeq_const(expect, ack.mac, FR_MAC_BYTES))
      rc =
          fr_err(FERRY_EAUTH, "peer '%s' does not know this fleet's token (FERRY_TOKEN)", ack.name);
  }
  fr_auth auth;
  memset(&auth, 0, sizeof auth);
  if (rc == 0 && l->ops->passes_fds) {
    /* Same host proven: we can read the peer's memory segment. */
    if (nfds < 1 || pread(fds[0], auth.proof, FR_NONCE_BYTES, 0) != FR_NONCE_BYTES)
      rc = fr_err(FERRY_ECONNECT, "peer did not share a readable memory segment");
  }
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  int offer_fd = -1;
  if (rc == 0 && l->ops->offer)
    rc = l->ops->offer(l, &offer_fd);
  if (rc == 0) {
    mac_for(ctx, "ferry-connector", ack.nonce, hello.nonce, auth.mac);
    fr_auth_encode(&auth, buf);
    iov = (struct iovec){buf, FR_AUTH_BYTES};
    f = (fr_frame){.type = FR_AUTH, .len = FR_AUTH_BYTES};
    rc = fr_link_send_frame(l, &f, &iov, 1, offer_fd, deadline);
  }
  nfds = 0;
  if (rc == 0)
    rc = recv_frame_sync(l, FR_AUTH_ACK, buf, 0, deadline, fds, &nfds, &status);
  if (rc == 0 && status != 0)
    rc = fr_err(status, "peer '%s' refused the link (%s)", ack.name,
                status == FERRY_EAUTH ? "fleet token mismatch" : ferry_strerror(status));
  if (rc == 0) {
    memcpy(l->peer, ack.name, sizeof l->peer);
    l->state = FR_LINK_OPEN;
    if (l->ops->opened)
      l->ops->opened(l);
  }
  return rc;
}

int fr_link_on_hello(ferry_link *l) {
  fr_hello h;
  int rc = check_peer_user(l);
  if (rc != 0) {
    fr_warn_limited("refusing a link: %s", ferry_last_error());
    fr_link_send_status(l, FR_HELLO_ACK, 0, rc);
    return rc;
  }
  if ((rc = fr_hello_decode(l->rx_body, l->rx_frame.len, &h)) != 0) {
    fr_link_send_status(l, FR_HELLO_ACK, 0,
                        rc); /* the peer hears why; the error detail is escaped */
    return rc;
  }
  memcpy(l->peer, h.name, sizeof l->peer);
  memcpy(l->nonce_peer, h.nonce, FR_NONCE_BYTES);
  fr_hello_ack ack;
  memset(&ack, 0, sizeof ack);
  fr_random_bytes(l->nonce_self, FR_NONCE_BYTES);
  memcpy(ack.nonce, l->nonce_self, FR_NONCE_BYTES);
  mac_for(l->ctx, "ferry-acceptor", l->nonce_peer, l->nonce_self, ack.mac);
  fr_str_copy(ack.name, sizeof ack.name, l->ctx->name);
  int proof_fd = -1;
  if (l->ops->passes_fds) {
    fr_random_bytes(l->proof, FR_NONCE_BYTES);
    proof_fd = memfd_create("ferry-proof", MFD_CLOEXEC);
    if (proof_fd < 0 || fchmod(proof_fd, 0600) != 0 ||
        pwrite(proof_fd, l->proof, FR_NONCE_BYTES, 0) != FR_NONCE_BYTES) {
      rc = fr_err_errno(FERRY_ESYS, "handshake: proof segment");
      if (proof_fd >= 0)
        close(proof_fd);
      return rc;
    }
  }
  uint8_t buf[FR_HELLO_ACK_BYTES];
  fr_hello_ack_encode(&ack, buf);
  struct iovec iov = {buf, sizeof buf};
  fr_frame f = {.type = FR_HELLO_ACK, .len = sizeof buf};
  __atomic_store_n(&l->state, FR_LINK_AUTH, __ATOMIC_RELEASE);
  rc = fr_link_send_frame(l, &f, &iov, 1, proof_fd, fr_deadline_ns(l->ctx->timeout_ms));
  if (proof_fd >= 0)
    close(proof_fd);
  return rc;
}

int fr_link_on_auth(ferry_link *l) {
  fr_auth a;
  int rc = fr_auth_decode(l->rx_body, l->rx_frame.len, &a);
  if (rc != 0)
    return rc;
  uint8_t expect[FR_MAC_BYTES];
  mac_for(l->ctx, "ferry-connector", l->nonce_self, l->nonce_peer, expect);
  int status = 0;
  if (!fr_memeq_const(expect, a.mac, FR_MAC_BYTES))
    status = fr_err(FERRY_EAUTH, "'%s' does not know this fleet's token", l->peer);
  else if (l->ops->passes_fds && !fr_memeq_const(l->proof, a.proof, FR_NONCE_BYTES))
    status = fr_err(FERRY_EAUTH, "'%s' could not read our memory segment", l->peer);
  if (status == 0 && l->ops->accept_offer)
    status = l->ops->accept_offer(l, fr_link_take_fd(l));
  if (status == 0 && l->rx_stage_pos < l->rx_stage_len)
    status = fr_err(FERRY_EPROTO, "'%s' sent frames before the link was open", l->peer);
  if (status != 0) {
    fr_warn_limited("refusing link from '%s': %s", l->peer, ferry_last_error());
    fr_link_send_status(l, FR_AUTH_ACK, 0, status);
    return status;
  }
  rc = fr_link_send_status(l, FR_AUTH_ACK, 0, 0);
  if (rc != 0)
    return rc;
  __atomic_store_n(&l->state, FR_LINK_OPEN, __ATOMIC_RELEASE);
  if (l->ops->opened)
    l->ops->opened(l);
  fr_debug("link %s from '%s' open", l->ops->name, l->peer);
  return 0;
}
