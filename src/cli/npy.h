/*
 * The .npy format (numpy's one-array file) for `ferry put` and `ferry get`: a strict reader that
 * checks the header against the file before anything is stored, and the header `get` writes.
 * Pure functions on a buffer, so fuzz/npy_fuzz.c and tests/npy_test.c call them directly.
 */
#ifndef FR_CLI_NPY_H
#define FR_CLI_NPY_H

#include "ferry.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Every .npy file starts with these 6 bytes; `ferry put` decides ".npy or raw" by them alone. */
#define CLI_NPY_MAGIC "\x93NUMPY"
#define CLI_NPY_MAGIC_LEN 6

/* What a valid .npy file holds: its tensor and where the tensor's bytes are. */
typedef struct cli_npy {
  ferry_tensor_desc desc;
  size_t data_offset;  /* preamble + header; <= the file's length */
  uint64_t data_bytes; /* ferry_tensor_nbytes(desc), and exactly len - data_offset */
} cli_npy;

/* True when buf starts with the .npy magic. */
bool cli_npy_magic(const uint8_t *buf, size_t len);

/* Parses the whole file buf[0..len) (versions 1.0, 2.0, 3.0): the header must be the dict
 * numpy writes ({'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }) with a
 * little-endian (or one-byte) dtype ferry knows and C order, and the bytes after it must be
 * exactly the tensor. On failure *out is untouched and ferry_last_error() says what is wrong:
 * FERRY_EPROTO (a malformed or truncated file), FERRY_EDTYPE (a dtype ferry does not take),
 * FERRY_ESHAPE (a shape ferry does not take, or the data's size disagrees with it),
 * FERRY_EOVERFLOW (the shape's size overflows 64 bits). */
int cli_npy_parse(const uint8_t *buf, size_t len, cli_npy *out);

/* Formats the v1.0 preamble and header for desc into buf (cap bytes; 256 + 24 per dimension
 * always suffice), padded so the data starts 64-byte aligned; *len gets its size.
 * FERRY_EDTYPE for a dtype .npy has no standard name for (bfloat16, float8), FERRY_ESHAPE for
 * ndim over FERRY_MAX_DIMS, FERRY_ERANGE when cap is too small. */
int cli_npy_header(const ferry_tensor_desc *desc, uint8_t *buf, size_t cap, size_t *len);

#endif
