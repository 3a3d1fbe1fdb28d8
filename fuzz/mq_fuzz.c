/*
 * libFuzzer target for the mq wire decoder (src/mq/wire.c): any bytes a peer can put on
 * FR_CHANNEL_MQ. Whatever decodes must be in bounds and canonical: encoding the decoded frame
 * again gives back the same head bytes.
 */
#include "mq/mq.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fr_mq_frame f;
  if (fr_mq_decode(data, size, &f) != 0)
    return 0;
  uint8_t head[FR_MQ_HEAD_MAX];
  size_t n = fr_mq_encode(&f, head);
  if (n > size || memcmp(head, data, n) != 0)
    abort();
  if (f.type == FR_MQ_DATA && (f.payload < data || f.payload + f.len != data + size))
    abort();
  if (f.topic && (f.topic < (const char *)data || strlen(f.topic) != f.topic_len))
    abort();
  return 0;
}
