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

enum { FR_SMSG_DELETE = 1, FR_SMSG_DROPPED = 2, FR_SMSG_UPLOAD = 3, FR_SMSG_READS = 4 };

/* READS (a reader's receipt, receipts.c) claims 1 .. FR_STORE_READS_MAX gets in one message: a
 * reader reports at least once a second, and no reader gets 16 million objects a second from
 * one owner. The owner bounds the bytes as well (fr_store_count_claimed, metrics.c). */
#define FR_STORE_READS_MAX (1ull << 24)

typedef struct fr_store_msg {
  uint16_t op;
  char key[FR_DIR_KEY_MAX + 1]; /* "" for READS */
  uint64_t generation;          /* DELETE (0: any), DROPPED */
  ferry_tensor_desc desc;       /* UPLOAD: the tensor, read from (ref, offset) on the sender */
  ferry_region_ref ref;
  uint64_t offset, bytes; /* UPLOAD; READS: bytes read */
  uint64_t gets;          /* READS: objects read whole */
} fr_store_msg;

/* Decodes and validates one message; FERRY_EPROTO (and *m zeroed) when malformed. */
int fr_store_msg_decode(const void *data, size_t len, fr_store_msg *m);

#endif
