/*
 * libFuzzer target for the refit manifest decoder: any input is refused cleanly or decodes into
 * a plan whose layout re-encodes to the same bytes.
 */
#include "refit/plan.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fr_refit_plan plan;
  if (fr_refit_manifest_decode(data, size, &plan) != 0)
    return 0;
  uint8_t *again;
  size_t len;
  if (fr_refit_manifest_encode(&plan, &again, &len) == 0) {
    assert(len == size && memcmp(again, data, size) == 0);
    free(again);
  }
  for (uint32_t b = 0; b < plan.buckets && b < 64; b++) {
    uint32_t e = fr_refit_first_entry(&plan, b);
    uint64_t wo, bo;
    if (e < plan.count && fr_refit_overlap(&plan, e, b, &wo, &bo) > 0)
      assert(wo < plan.entries[e].wire_bytes);
  }
  fr_refit_plan_free(&plan);
  return 0;
}
