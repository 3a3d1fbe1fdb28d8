/*
 * libFuzzer target for the .npy reader of `ferry put` (src/cli/npy.c). The input is a whole
 * file. A refusal must leave the output untouched and say why in one line; an acceptance must
 * describe exactly the bytes after the header (so a put can never read past the file or drop
 * its tail), and the header `ferry get` would write for that tensor must read back the same.
 */
#include "cli/npy.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

static void check_accepted(const uint8_t *data, size_t size, const cli_npy *npy) {
  assert(npy->data_offset <= size);
  assert(npy->data_bytes == size - npy->data_offset);
  assert(npy->desc.ndim <= FERRY_MAX_DIMS);
  assert(ferry_dtype_size(npy->desc.dtype) != 0);
  uint64_t nbytes;
  assert(ferry_tensor_nbytes(&npy->desc, &nbytes) == 0 && nbytes == npy->data_bytes);
  /* what get writes for it is read back as the same tensor with the same bytes */
  uint8_t head[512];
  size_t hlen;
  assert(cli_npy_header(&npy->desc, head, sizeof head, &hlen) == 0 && hlen % 64 == 0);
  uint8_t *again = malloc(hlen + npy->data_bytes + 1);
  memcpy(again, head, hlen);
  memcpy(again + hlen, data + npy->data_offset, npy->data_bytes);
  cli_npy back;
  assert(cli_npy_parse(again, hlen + npy->data_bytes, &back) == 0);
  assert(back.data_offset == hlen && back.data_bytes == npy->data_bytes);
  assert(back.desc.dtype == npy->desc.dtype && back.desc.ndim == npy->desc.ndim);
  assert(memcmp(back.desc.shape, npy->desc.shape, npy->desc.ndim * sizeof(uint64_t)) == 0);
  free(again);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* an exact-size copy, so ASan sees any read past the file's end */
  uint8_t *file = malloc(size ? size : 1);
  memcpy(file, data, size);
  cli_npy npy, before;
  memset(&npy, 0x5a, sizeof npy);
  before = npy;
  int rc = cli_npy_parse(file, size, &npy);
  if (rc == 0) {
    check_accepted(file, size, &npy);
  } else {
    const char *why = ferry_last_error();
    assert(rc < 0 && why[0] != '\0' && !strchr(why, '\n'));
    assert(memcmp(&npy, &before, sizeof npy) == 0);
  }
  free(file);
  return 0;
}
