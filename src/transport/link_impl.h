/*
 * What the parts of a link share, inside src/transport only: link.c makes a link, sends on it,
 * pairs requests with their answers and ends it; link_handshake.c proves each side to the other;
 * link_rx.c is the receive state machine the ctx's leader (or a spinner) drives, with the
 * requests it serves.
 * The struct itself and the calls the rest of the transport makes are in transport.h.
 */
#ifndef FR_LINK_IMPL_H
#define FR_LINK_IMPL_H

#include "transport/transport.h"

#include <sys/epoll.h>

static inline int link_state(const ferry_link *l) {
  return __atomic_load_n(&l->state, __ATOMIC_ACQUIRE);
}

/* Edge-triggered where the transport allows: a drained socket is not polled again by the next
 * epoll_wait (the leader then drains until the socket has nothing, see rx_drain). */
static inline uint32_t link_events(const ferry_link *l) {
  return EPOLLIN | EPOLLRDHUP | (l->ops->edge_triggered ? EPOLLET : 0);
}

/* link.c: a frame with only a status, for a request or a handshake step */
int fr_link_send_status(ferry_link *l, uint8_t type, uint64_t req_id, int status);

/* link_handshake.c: the acceptor's steps, run by the receive state machine */
int fr_link_on_hello(ferry_link *l);
int fr_link_on_auth(ferry_link *l);

/* link_rx.c: the link's epoll handler */
void fr_link_on_event(fr_poller *p, uint32_t events);

#endif
