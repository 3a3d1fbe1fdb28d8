/*
 * The refit protocol between a sender and its receivers, on channel FR_CHANNEL_REFIT. Messages
 * are fixed little-endian records led by a type word; the ATTACH reply carries the manifest.
 *
 *   receiver → sender  ATTACH (a call)      reply: status, latest version, bucket buffers, manifest
 *   sender → receiver  BUCKET               version, generation, bucket, buffer, bytes, checksum
 *   receiver → sender  ACK                  version, bucket, status
 *   sender → receiver  COMMIT               version, how many buckets the push carried
 *   receiver → sender  COMMITTED            version, status
 *   receiver → sender  DETACH
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
};

#define FR_REFIT_UNCHANGED 1u /* BUCKET flag: the receiver already has these bytes */

typedef struct fr_refit_msg_t {
  uint32_t type;
  uint32_t bucket;     /* BUCKET, ACK */
  uint32_t generation; /* BUCKET */
  uint32_t buffer;     /* BUCKET: 0 or 1 */
  uint32_t flags;      /* BUCKET */
  int32_t status;      /* ACK, COMMITTED */
  uint64_t version;
  uint64_t bytes;    /* BUCKET: bytes in the bucket; COMMIT: buckets in the push */
  uint64_t checksum; /* BUCKET */
} fr_refit_msg_t;
#define FR_REFIT_MSG_BYTES 56

typedef struct fr_refit_attach_reply {
  int32_t status;
  uint64_t latest; /* last committed version (0: none yet) */
  ferry_region_ref buffers[2];
  const uint8_t *manifest; /* points into the reply */
  size_t manifest_len;
} fr_refit_attach_reply;
#define FR_REFIT_ATTACH_HEAD 64

void fr_refit_msg_encode(const fr_refit_msg_t *m, uint8_t out[FR_REFIT_MSG_BYTES]);
int fr_refit_msg_decode(const uint8_t *in, size_t len, fr_refit_msg_t *out);
void fr_refit_attach_head_encode(const fr_refit_attach_reply *r, uint8_t out[FR_REFIT_ATTACH_HEAD]);
int fr_refit_attach_decode(const uint8_t *in, size_t len, fr_refit_attach_reply *out);

#endif
