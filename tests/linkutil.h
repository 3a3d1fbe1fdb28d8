/*
 * The link tests' shared parts (tests/link_test.c, tests/link_conformance.c,
 * tests/ucx_link_test.c): two contexts joined by a link, and the case bodies that more than one
 * of those files runs, each given its transport ("shm", "tcp", "ucx").
 */
#ifndef FERRY_TESTS_LINKUTIL_H
#define FERRY_TESTS_LINKUTIL_H

#include "ferry.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct lt_pair {
  ferry_ctx *a, *b; /* a connects to b */
  ferry_link *ab;
} lt_pair;

/* A ctx named `name` on `transport` (a FERRY_TRANSPORTS list) with fleet token `token`. */
ferry_ctx *lt_open_ctx(const char *name, const char *transport, const char *token);
/* "node-a" linked to "node-b" over `transport`; lt_pair_close closes the link, then both. */
void lt_pair_open(lt_pair *p, const char *transport);
void lt_pair_close(lt_pair *p);

/* Messages both ways on one link, large and small, in order. */
void lt_messages(const char *transport);
/* Calls from two threads over one link, each reply to its caller; timeouts and late replies. */
void lt_calls(const char *transport);
/* Reads, vectored reads and writes of a ferry_alloc'd (shared) or registered region; bounds, key
 * and unknown-region refusals; views where the transport maps memory; reads after the free. */
void lt_one_sided(const char *transport, bool shared);

/* A raw ferry frame header (32 bytes) with the given fields, for peers that send bad ones. */
void lt_frame(uint8_t *out, uint32_t magic, uint8_t version, uint8_t type, uint64_t len);

/* A thread that reads `ref` (300 reads of 8 KiB) and counts those that differ from `expect`. */
typedef struct lt_hammer_args {
  ferry_link *link;
  ferry_region_ref ref;
  const uint8_t *expect;
  int failures;
} lt_hammer_args;
void *lt_hammer(void *arg);

#endif
