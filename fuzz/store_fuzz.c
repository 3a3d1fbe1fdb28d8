/*
 * libFuzzer target for the store service's message decoder (messages one store sends another on
 * FR_CHANNEL_STORE: delete, drop notice, upload, read receipt). Any input is rejected cleanly or
 * decodes into a message whose key, dtype, shape and byte range (or receipt count) all passed
 * validation.
 */
#include "store/service.h"

#include <assert.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fr_store_msg m;
  if (fr_store_msg_decode(data, size, &m) != 0)
    return 0;
  assert(m.op >= FR_SMSG_DELETE && m.op <= FR_SMSG_READS);
  if (m.op == FR_SMSG_READS) { /* a read receipt: no key, a bounded count */
    assert(m.gets >= 1 && m.gets <= FR_STORE_READS_MAX && !m.key[0]);
    return 0;
  }
  assert(memchr(m.key, 0, sizeof m.key) && m.key[0]);
  if (m.op == FR_SMSG_UPLOAD) {
    uint64_t nb = 0;
    assert(ferry_tensor_nbytes(&m.desc, &nb) == 0 && nb == m.bytes);
    assert(m.bytes == 0 || (m.offset <= m.ref.size && m.bytes <= m.ref.size - m.offset));
  }
  return 0;
}
