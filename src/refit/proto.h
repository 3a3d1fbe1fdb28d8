/*
 * The refit protocol between a sender and its receivers: what goes to a sender on channel
 * FR_CHANNEL_REFIT_SENDER, what goes to a receiver on FR_CHANNEL_REFIT_RECEIVER (core/channels.h).
 * Messages are fixed little-endian records led by a type word; the ATTACH reply carries the
 * manifest.
 *
 *   receiver → sender  ATTACH (a call)      body: the receiver's ctx address (for its chain
 *                                           successor); reply: status, latest version (during a
 *                                           push, the push's: the receiver is not in it and
 *                                           asks to catch up to it), alias buffer, manifest
 *   sender → receiver  ROUTE                the address of its chain predecessor (after the record)
 *   sender → receiver  BUCKET               version, generation, bucket, seq, bytes, checksum, and
 *                                           where to read it: a region (src, src_offset) of the
 *                                           sender, or of the predecessor (FROM_UP); KEEP: land it
 *                                           in forwarding slot `buffer` for a successor
 *   receiver → sender  ACK                  version, bucket, seq, status; with KEEP, where the
 *                                           bucket now lies in the receiver (src, src_offset)
 *   sender → receiver  COMMIT               version, how many buckets the push carried (a
 *                                           version sent in parts: all its parts'); ABORTED:
 *                                           the version is abandoned, fail it
 *   receiver → sender  COMMITTED            version, status; a group's sub-receiver refusing a
 *                                           version another rank failed (FERRY_ESTALE, also in its
 *                                           ACK) puts 1 + that rank in `generation`
 *   receiver → sender  DETACH
 *   sender → receiver  DROPPED              version: the receiver acknowledged nothing within that
 *                                           push's timeout and is left out of pushes until it
 *                                           attaches again (an ATTACH call on the same link)
 *   receiver → sender  CATCHUP              a receiver that lacks the latest version (it attached
 *                                           late) and has bound its destinations asks for it; the
 *                                           sender answers with BUCKETs of version `latest` read
 *                                           from its retained buffer, then COMMIT, outside any push
 *                                           (one that comes during a push: once it ended)
 *   sender → receiver  CATCHUP              status: the catch-up cannot be done (no retained copy);
 *                                           the version comes with the next push
 *   receiver → sender  VIEW                 shards (shard.h): the pieces of target slot `bucket`
 *                                           (`bytes` of them, after the record; 0 clears it) for
 *                                           manifest `generation`; `seq` is the declaration's
 *                                           serial. BUCKETs then carry `view` (the serial of the
 *                                           declarations the sender hashed) and `view_sum`
 *
 * BUCKET also carries timeout_ms, the push's timeout: a receiver bounds its read with it, so a
 * stalled chain predecessor costs its successor no more than the sender waits anyway.
 */
#ifndef FR_REFIT_PROTO_H
#define FR_REFIT_PROTO_H

#include "ferry.h"

#include <stddef.h>
#include <stdint.h>

enum fr_refit_msg {
  FR_REFIT_ATTACH = 1,
  FR_REFIT_BUCKET = 2,
  FR_REFIT_ACK = 3,
  FR_REFIT_COMMIT = 4,
  FR_REFIT_COMMITTED = 5,
  FR_REFIT_DETACH = 6,
  FR_REFIT_ROUTE = 7,
  FR_REFIT_DROPPED = 8,
  FR_REFIT_CATCHUP = 9,
  FR_REFIT_VIEW = 10,
};

#define FR_REFIT_UNCHANGED 1u /* BUCKET: the receiver already has these bytes */
#define FR_REFIT_FROM_UP 2u   /* BUCKET: read from the chain predecessor, not the sender */
#define FR_REFIT_KEEP 4u      /* BUCKET: keep it for a successor; ACK: src says where it is */
#define FR_REFIT_UPSTREAM 8u  /* ACK: failed reading from the predecessor (not this receiver) */
/* BUCKET: CUDA memory of the sender on this host, not hashed (checksum 0): read it with the copy
 * engines through CUDA IPC, straight into the bound tensors; refused over any other link. */
#define FR_REFIT_DIRECT 16u
/* COMMIT: the sender abandoned the version before its last part (a version sent in parts): the
 * receiver fails it, whatever it verified */
#define FR_REFIT_ABORTED 32u
#define FR_REFIT_FLAGS 63u
#define FR_REFIT_ADDRESS_MAX 1024 /* ROUTE and ATTACH addresses */

typedef struct fr_refit_msg_t {
  uint32_t type;
  uint32_t bucket;     /* BUCKET, ACK */
  uint32_t generation; /* BUCKET; ACK, COMMITTED with FERRY_ESTALE: 1 + the rank to blame */
  uint32_t buffer;     /* BUCKET with KEEP: forwarding slot 0 or 1 */
  uint32_t flags;      /* BUCKET, ACK */
  int32_t status;      /* ACK, COMMITTED */
  uint32_t seq;        /* BUCKET, ACK: position in the push */
  uint32_t timeout_ms; /* BUCKET: the push's timeout (0: the default) */
  uint64_t version;
  uint64_t bytes;    /* BUCKET: bytes in the bucket; COMMIT: buckets in the push */
  uint64_t checksum; /* BUCKET */
  ferry_region_ref src;
  uint64_t src_offset;
  uint32_t view;     /* BUCKET: serial of the receiver's shard view view_sum covers (0: none) */
  uint64_t view_sum; /* BUCKET: the sum of the view's runs in the bucket */
  const char *route; /* ROUTE: the predecessor's address; VIEW: its pieces (points into the
                        record, not NUL-ended) */
  size_t route_len;
} fr_refit_msg_t;
#define FR_REFIT_MSG_BYTES 104

typedef struct fr_refit_attach_reply {
  int32_t status;
  uint64_t latest;         /* last pushed version, or the one a push under way carries (0: none) */
  ferry_region_ref alias;  /* the sender's whole wire buffer, when it keeps one (alias mode) */
  const uint8_t *manifest; /* points into the reply */
  size_t manifest_len;
} fr_refit_attach_reply;
#define FR_REFIT_ATTACH_HEAD 48

void fr_refit_msg_encode(const fr_refit_msg_t *m, uint8_t out[FR_REFIT_MSG_BYTES]);
int fr_refit_msg_decode(const uint8_t *in, size_t len, fr_refit_msg_t *out);
void fr_refit_attach_head_encode(const fr_refit_attach_reply *r, uint8_t out[FR_REFIT_ATTACH_HEAD]);
int fr_refit_attach_decode(const uint8_t *in, size_t len, fr_refit_attach_reply *out);

#endif
