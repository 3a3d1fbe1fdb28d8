/*
 * libFuzzer target for the mq wire decoder (src/mq/wire.c): any bytes a peer can put on
 * FR_CHANNEL_MQ, batches and the frames inside them included. Whatever decodes must be in
 * bounds and canonical: encoding the decoded frame again gives back the same head bytes.
 */
#include "mq/mq.h"

#include <stdlib.h>
#include <string.h>

/* A decoded frame that came from the `size` bytes at `data`. */
static void check(const fr_mq_frame *f, const uint8_t *data, size_t size) {
  uint8_t head[FR_MQ_HEAD_MAX];
  size_t n = fr_mq_encode(f, head);
  if (n > size || memcmp(head, data, n) != 0)
    abort();
  if (f->type == FR_MQ_DATA && (f->payload < data || f->payload + f->len != data + size))
    abort();
  if (f->topic && (f->topic < (const char *)data || strlen(f->topic) != f->topic_len))
    abort();
}

static void check_batch(const fr_mq_frame *f, const uint8_t *data, size_t size) {
  size_t pos = 0;
  fr_mq_frame sub;
  for (;;) {
    size_t start = pos ? pos : FR_MQ_ALIGN;
    if (fr_mq_batch_next(f, &pos, &sub) != 1)
      return;
    size_t len = (size_t)(sub.payload - (data + start)) + (size_t)sub.len;
    if (start % FR_MQ_ALIGN || start + len > size || (pos != size && pos < start + len))
      abort();
    check(&sub, data + start, len);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fr_mq_frame f;
  if (fr_mq_decode(data, size, &f) != 0)
    return 0;
  if (f.type != FR_MQ_BATCH)
    check(&f, data, size);
  else
    check_batch(&f, data, size);
  return 0;
}
