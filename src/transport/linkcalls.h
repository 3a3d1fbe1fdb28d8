/*
 * The few link calls jobs make beyond ferry.h, without seeing the transport's structs
 * (transport.h): a link's state, quiet replies, posted calls whose answers are collected later
 * (the embedded directory's posted puts) and the doorbell for them, driving a link's receive
 * side, and a peer's metrics. Links stay opaque: a job holds ferry_link and fr_pending pointers
 * only.
 */
#ifndef FR_LINKCALLS_H
#define FR_LINKCALLS_H

#include "ferry.h"

#include <stdbool.h>
#include <stdint.h>

/* A call in flight on a link (fr_link_call_post), owned by the link until collected. */
typedef struct fr_pending fr_pending;

/* Whether the link is open now: handshaken, neither failed nor closed. A dead link's peer may be
 * gone, and what was mapped over it (a directory's change words) no longer follows that peer. */
bool fr_link_is_open(const ferry_link *l);
/* ferry_reply(), but quiet when `quiet`: where the transport has doorbells (shm), the reply waits
 * in the ring, without waking the peer, until the peer polls or a later frame rings. */
int fr_link_reply(ferry_msg *request, const struct iovec *iov, int iovcnt, int timeout_ms,
                  bool quiet);
/* A CALL whose reply is collected later: sends it (quietly when `quiet`, as fr_link_reply) and
 * returns at once with *out, which the caller must hand to fr_link_call_collect exactly once
 * (that frees it), before the link is closed. Nothing is registered when it fails. */
int fr_link_call_post(ferry_link *l, uint32_t channel, const struct iovec *iov, int iovcnt,
                      int timeout_ms, bool quiet, fr_pending **out);
/* Whether a posted call's reply (or the link's failure) is in; never waits. */
bool fr_link_call_ready(const fr_pending *p);
/* Waits up to timeout_ms for a posted call's reply, unregisters and frees p; *reply is the
 * caller's (on success only). */
int fr_link_call_collect(ferry_link *l, fr_pending *p, ferry_msg **reply, int timeout_ms);
/* Wakes the peer for the quiet frames sent to it that it has not taken yet, as a frame that is
 * not quiet would; a no-op where frames are never quiet. */
void fr_link_ring(ferry_link *l);
/* Drives a pollable link's receive side (shm) from the calling thread: what its peer sent is
 * delivered (channel queues, posted replies) when it returns. A no-op for other links, or when
 * another thread is doing it and `wait` is false; with `wait` it waits for that thread and
 * re-arms the link's wake-up once drained. */
void fr_link_poll(ferry_link *l, bool wait);
/* The metrics of the ctx at the other end of link, as the Prometheus text its /metrics would
 * serve; *text is malloc'd and NUL-terminated. FERRY_ETIMEDOUT / FERRY_EPEER when the node does
 * not answer. */
int fr_stats_call(ferry_link *link, int timeout_ms, char **text);

#endif
