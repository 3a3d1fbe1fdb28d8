/*
 * The wire format of a link: a fixed 32-byte little-endian frame header followed by `len` bytes
 * of payload. Decoders validate everything before anything is trusted; they are pure functions
 * (no I/O), which is what the fuzz target exercises.
 *
 *   off size field
 *    0   4   magic "FRY1"
 *    4   1   version (1)
 *    5   1   type (fr_frame_type)
 *    6   2   flags (none defined: must be 0)
 *    8   4   status (responses: 0 or a negative FERRY_E* code; requests: 0)
 *   12   4   channel (MSG and CALL only; < FERRY_MAX_CHANNELS)
 *   16   8   request id (pairs a response with its request)
 *   24   8   payload length
 */
#ifndef FR_WIRE_H
#define FR_WIRE_H

#include "core/cuda.h"

#include <endian.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define FR_WIRE_MAGIC 0x31595246u /* "FRY1" as little-endian bytes */
#define FR_WIRE_VERSION 1
#define FR_FRAME_BYTES 32
#define FR_NAME_BYTES 64
#define FR_NONCE_BYTES 16
#define FR_MAC_BYTES 32

typedef enum fr_frame_type {
  FR_HELLO = 1,     /* connector → acceptor: fr_hello */
  FR_HELLO_ACK = 2, /* acceptor → connector: fr_hello_ack (+ proof memfd on shm) */
  FR_AUTH = 3,      /* connector → acceptor: fr_auth */
  FR_AUTH_ACK = 4,  /* acceptor → connector: status only */
  FR_MSG = 5,       /* a message on a channel */
  FR_READ = 6,      /* fr_rma request: send me these bytes of your region */
  FR_READ_RESP = 7, /* the bytes (len == requested), or an error status and no payload */
  FR_WRITE = 8,     /* fr_rma request followed by the bytes to write */
  FR_WRITE_RESP = 9,
  FR_MAP = 10,      /* fr_map request: give me your region's memfd (shm only) */
  FR_MAP_RESP = 11, /* fr_map_resp (+ the memfd), or an error status */
  FR_CALL = 12,     /* a message on a channel that wants a REPLY with its request id */
  FR_REPLY = 13,    /* the answer to a CALL: payload, or an error status and no payload */
  FR_READV = 14,    /* fr_readv request: send me these runs of your region, one after another
                       (answered by READ_RESP with their bytes concatenated) */
  FR_FRAME_TYPE_MAX = 14,
} fr_frame_type;

typedef struct fr_frame {
  uint8_t type;
  uint16_t flags;
  int32_t status;
  uint32_t channel;
  uint64_t req_id;
  uint64_t len;
} fr_frame;

typedef struct fr_hello {
  uint8_t nonce[FR_NONCE_BYTES];
  char name[FR_NAME_BYTES]; /* NUL-terminated */
} fr_hello;
#define FR_HELLO_BYTES (FR_NONCE_BYTES + FR_NAME_BYTES)

typedef struct fr_hello_ack {
  uint8_t nonce[FR_NONCE_BYTES];
  uint8_t mac[FR_MAC_BYTES];
  char name[FR_NAME_BYTES];
} fr_hello_ack;
#define FR_HELLO_ACK_BYTES (FR_NONCE_BYTES + FR_MAC_BYTES + FR_NAME_BYTES)

typedef struct fr_auth {
  uint8_t mac[FR_MAC_BYTES];
  uint8_t proof[FR_NONCE_BYTES]; /* what the connector read from the acceptor's memfd */
} fr_auth;
#define FR_AUTH_BYTES (FR_MAC_BYTES + FR_NONCE_BYTES)

typedef struct fr_rma {
  uint64_t region, key, offset, length;
} fr_rma;
#define FR_RMA_BYTES 32

/* READV body: region, key, run count (u32, then 4 zero bytes), then each run's offset and
 * length (u64 each). */
typedef struct fr_readv {
  uint64_t region, key;
  uint32_t count;
  uint64_t total;  /* bytes of all runs */
  uint64_t lo, hi; /* the span the runs lie in */
} fr_readv;
typedef struct fr_rma_run {
  uint64_t offset, length;
} fr_rma_run;
#define FR_READV_HEAD_BYTES 24
#define FR_READV_RUN_BYTES 16
#define FR_READV_MAX_RUNS 256

typedef struct fr_map {
  uint64_t region, key;
} fr_map;
#define FR_MAP_BYTES 16
#define FR_MAP_RESP_BYTES 8 /* u64 data size */
/* A CUDA region's answer: the size, then its fr_cuda_ipc (core/cuda.h), no fd. */
#define FR_MAP_RESP_CUDA_BYTES (8 + 88)

/* Encodes a header into 32 bytes. */
void fr_frame_encode(const fr_frame *f, uint8_t out[FR_FRAME_BYTES]);
/* Decodes and validates a header: magic, version, type, flags, status sign, channel and the
 * payload length allowed for the type (max_payload bounds MSG, READ_RESP and WRITE).
 * Returns 0 or FERRY_EPROTO with a detail message saying which field is wrong. */
int fr_frame_decode(const uint8_t in[FR_FRAME_BYTES], uint64_t max_payload, fr_frame *out);

void fr_hello_encode(const fr_hello *h, uint8_t out[FR_HELLO_BYTES]);
int fr_hello_decode(const uint8_t *in, size_t len, fr_hello *out);
void fr_hello_ack_encode(const fr_hello_ack *h, uint8_t out[FR_HELLO_ACK_BYTES]);
int fr_hello_ack_decode(const uint8_t *in, size_t len, fr_hello_ack *out);
void fr_auth_encode(const fr_auth *a, uint8_t out[FR_AUTH_BYTES]);
int fr_auth_decode(const uint8_t *in, size_t len, fr_auth *out);
void fr_rma_encode(const fr_rma *r, uint8_t out[FR_RMA_BYTES]);
int fr_rma_decode(const uint8_t *in, size_t len, fr_rma *out);
void fr_readv_encode_head(uint64_t region, uint64_t key, uint32_t count,
                          uint8_t out[FR_READV_HEAD_BYTES]);
void fr_readv_encode_run(const fr_rma_run *run, uint8_t out[FR_READV_RUN_BYTES]);
/* Decodes a READV body into *head and runs[0, head->count) (room for FR_READV_MAX_RUNS): every
 * run non-empty, no offset + length overflows, the total neither. */
int fr_readv_decode(const uint8_t *in, size_t len, fr_readv *head, fr_rma_run *runs);
void fr_map_encode(const fr_map *m, uint8_t out[FR_MAP_BYTES]);
/* A CUDA region's IPC handle in a MAP response, after the size (wire.c). */
void fr_cuda_ipc_encode(const fr_cuda_ipc *h, uint8_t out[FR_MAP_RESP_CUDA_BYTES - 8]);
void fr_cuda_ipc_decode(const uint8_t in[FR_MAP_RESP_CUDA_BYTES - 8], fr_cuda_ipc *h);
int fr_map_decode(const uint8_t *in, size_t len, fr_map *out);

/* Little-endian fields through memcpy: one load or store on little-endian hosts. */
static inline void fr_put_u64(uint8_t *p, uint64_t v) {
  v = htole64(v);
  memcpy(p, &v, sizeof v);
}
static inline uint64_t fr_get_u64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, sizeof v);
  return le64toh(v);
}
static inline void fr_put_u32(uint8_t *p, uint32_t v) {
  v = htole32(v);
  memcpy(p, &v, sizeof v);
}
static inline uint32_t fr_get_u32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, sizeof v);
  return le32toh(v);
}

#endif
