/*
 * Messages between stores on FR_CHANNEL_STORE (sent by msg.c, answered by service.c): the
 * decoded form and its pure decoder (msg.c), shared with the fuzzer.
 */
#ifndef FR_STORE_SERVICE_H
#define FR_STORE_SERVICE_H

#include "core/region.h"
#include "directory/dirwire.h"
#include "store/store.h"

#define FR_STORE_MSG_MAGIC 0x31545346u /* "FST1" */

enum { FR_SMSG_DELETE = 1, FR_SMSG_DROPPED = 2, FR_SMSG_UPLOAD = 3 };

typedef struct fr_store_msg {
  uint16_t op;
  char key[FR_DIR_KEY_MAX + 1];
  uint64_t generation;    /* DELETE (0: any), DROPPED */
  ferry_tensor_desc desc; /* UPLOAD: the tensor, read from (ref, offset) on the sender */
  ferry_region_ref ref;
  uint64_t offset, bytes;
} fr_store_msg;

/* Decodes and validates one message; FERRY_EPROTO (and *m zeroed) when malformed. */
int fr_store_msg_decode(const void *data, size_t len, fr_store_msg *m);

#endif
