/*
 * libFuzzer target for the checks a control cell's readers make on bytes that any process of
 * the user may have written (control/cell.h, "Trust"): the header validation that decides how
 * much of the file to map and how many rank lines to walk, and the mapping of a rank's error
 * word to the status a controller reports. The input is a file size (8 bytes) followed by the
 * first bytes of a header (the rest zero). Checked: an accepted header describes a layout that
 * lies inside the file (every rank line within file_size, the lines after the header), and a
 * rank's error always becomes a named ferry status.
 */
#include "control/cell.h"

#include <assert.h>
#include <string.h>

static uint32_t expected_size(uint32_t nranks) {
  uint64_t lines = (uint64_t)nranks * FR_CTL_LINE;
  return (uint32_t)(FR_CTL_HEADER_BYTES + (lines + FR_CTL_PAGE - 1) / FR_CTL_PAGE * FR_CTL_PAGE);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 8)
    return 0;
  uint64_t file_size;
  memcpy(&file_size, data, 8);
  data += 8;
  size -= 8;
  static fr_ctl_header hdr;
  memset(&hdr, 0, sizeof hdr);
  memcpy(&hdr, data, size < sizeof hdr ? size : sizeof hdr);
  if (fr_ctl_header_check(&hdr, file_size, "fuzz") == 0) {
    assert(hdr.nranks >= 1 && hdr.nranks <= FERRY_CTL_MAX_RANKS);
    assert(hdr.line_size == FR_CTL_LINE && hdr.lines_offset == FR_CTL_HEADER_BYTES);
    assert(hdr.file_size == expected_size(hdr.nranks) && file_size >= hdr.file_size);
    assert((uint64_t)hdr.lines_offset + (uint64_t)hdr.nranks * FR_CTL_LINE <= file_size);
  }
  for (size_t i = 0; i + 4 <= size; i += 4) {
    int32_t raw;
    memcpy(&raw, data + i, 4);
    int st = fr_ctl_rank_error(raw);
    assert(st < 0 && strcmp(ferry_status_name(st), "FERRY_E?") != 0);
    assert(st == raw || st == FERRY_EPEER);
  }
  return 0;
}
