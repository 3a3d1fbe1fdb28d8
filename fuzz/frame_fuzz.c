/*
 * libFuzzer target for the link wire decoders: the frame header, then whichever fixed body the
 * header's type calls for. Any input must be rejected cleanly or decoded into values that pass
 * the same checks again when re-encoded.
 */
#include "transport/wire.h"

#include <assert.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < FR_FRAME_BYTES)
    return 0;
  fr_frame f;
  if (fr_frame_decode(data, 1u << 20, &f) != 0)
    return 0;
  uint8_t again[FR_FRAME_BYTES];
  fr_frame_encode(&f, again);
  assert(memcmp(again, data, FR_FRAME_BYTES) == 0);
  const uint8_t *body = data + FR_FRAME_BYTES;
  size_t n = size - FR_FRAME_BYTES;
  if (n > f.len)
    n = (size_t)f.len;
  union {
    fr_hello h;
    fr_hello_ack a;
    fr_auth au;
    fr_rma r;
    fr_map m;
    fr_readv v;
  } u;
  fr_rma_run runs[FR_READV_MAX_RUNS];
  switch (f.type) {
  case FR_HELLO:
    if (fr_hello_decode(body, n, &u.h) == 0)
      assert(memchr(u.h.name, 0, sizeof u.h.name));
    break;
  case FR_HELLO_ACK:
    if (fr_hello_ack_decode(body, n, &u.a) == 0)
      assert(memchr(u.a.name, 0, sizeof u.a.name));
    break;
  case FR_AUTH:
    fr_auth_decode(body, n, &u.au);
    break;
  case FR_READ:
  case FR_WRITE:
    if (fr_rma_decode(body, n, &u.r) == 0)
      assert(u.r.offset + u.r.length >= u.r.offset);
    break;
  case FR_MAP:
    fr_map_decode(body, n, &u.m);
    break;
  case FR_READV:
    if (fr_readv_decode(body, n, &u.v, runs) == 0)
      for (uint32_t i = 0; i < u.v.count; i++)
        assert(runs[i].length > 0 && runs[i].offset >= u.v.lo &&
               runs[i].offset + runs[i].length <= u.v.hi);
    break;
  default:
    break;
  }
  return 0;
}
