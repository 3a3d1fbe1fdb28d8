/*
 * libFuzzer target for the refit protocol records (proto.c) and the shard pieces a VIEW record
 * carries (shard.c): any input is refused cleanly or decodes into a record whose fixed part
 * re-encodes to the same bytes; pieces that pass the plan's checks (against a fixed two-tensor
 * plan) build a view whose runs are sorted, lie in the flat buffer and never cross a bucket.
 */
#include "refit/proto.h"
#include "refit/shard.h"

#include <stdlib.h>
#include <string.h>

/* Checked in every build type (assert() is gone under NDEBUG). */
#define CHECK(c) ((c) ? (void)0 : abort())

static void check_view(const fr_refit_piece *pieces, uint32_t n) {
  fr_refit_entry e[2] = {
      {.name = "a", .desc = {.dtype = FERRY_DTYPE_F32, .ndim = 2, .shape = {40, 30}}},
      {.name = "b", .desc = {.dtype = FERRY_DTYPE_BF16, .ndim = 3, .shape = {3, 5, 7}}}};
  fr_refit_plan plan = {.entries = e, .count = 2};
  if (fr_refit_plan_build(&plan, 1024) != 0)
    return;
  for (uint32_t i = 0; i < n; i++)
    if (fr_refit_piece_check(&plan, &pieces[i], "fuzz") != 0)
      return;
  fr_refit_target t = {n, (fr_refit_piece *)pieces, NULL, NULL};
  fr_refit_view *v;
  if (fr_refit_view_build(&plan, &t, 1, 1, &v) != 0)
    return;
  for (uint64_t i = 0; i < v->nruns; i++) {
    const fr_refit_run *r = &v->runs[i];
    CHECK(r->len > 0 && r->off + r->len <= plan.total_bytes);
    CHECK(r->off / plan.bucket_bytes == (r->off + r->len - 1) / plan.bucket_bytes);
    CHECK(i == 0 || v->runs[i - 1].off <= r->off);
  }
  fr_refit_view_free(v);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fr_refit_msg_t m;
  if (fr_refit_msg_decode(data, size, &m) != 0)
    return 0;
  uint8_t again[FR_REFIT_MSG_BYTES];
  fr_refit_msg_encode(&m, again);
  /* the 4 bytes after `view` are reserved (ignored on decode) */
  CHECK(memcmp(again, data, 92) == 0 && memcmp(again + 96, data + 96, 8) == 0);
  if (m.type != FR_REFIT_VIEW || m.bytes > 64)
    return 0;
  fr_refit_piece pieces[64];
  if (fr_refit_pieces_decode((const uint8_t *)m.route, m.route_len, (uint32_t)m.bytes, pieces) == 0)
    check_view(pieces, (uint32_t)m.bytes);
  return 0;
}
