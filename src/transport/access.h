/*
 * Region access blobs: what a node's transports let a peer know up front so that it reaches a
 * region directly, without first asking the owner (ucx: the region's packed rkey). Jobs put the
 * opaque blob in their records (the store: its pool's, in its node record) and hand it to the
 * link they open to the owner; transports never see jobs, and jobs never look inside a blob.
 */
#ifndef FR_ACCESS_H
#define FR_ACCESS_H

#include "ferry.h"

#include <stddef.h>
#include <stdint.h>

#define FR_ACCESS_MAX 256 /* bytes of a blob that records make room for */

/* Packs what the ctx's transports publish for one of its regions (ref: id and key) into buf;
 * *len is 0 when none has anything to say (registered memory, no transport that packs).
 * FERRY_ERANGE when it does not fit cap. */
int fr_region_access_pack(ferry_ctx *ctx, const ferry_region_ref *ref, uint8_t *buf, size_t cap,
                          size_t *len);
/* Hands a blob from a record to a link to the region's owner: the link's transport takes what
 * is meant for it and keeps it for the link's later accesses; anything it cannot use is ignored
 * (the access then asks the owner, as without a blob). */
void fr_link_access_hint(ferry_link *link, const uint8_t *blob, size_t len);

#endif
