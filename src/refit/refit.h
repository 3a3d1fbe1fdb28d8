/*
 * Internals shared by the refit sender and receiver.
 */
#ifndef FR_REFIT_H
#define FR_REFIT_H

#include "core/channels.h"
#include "core/core.h"
#include "core/hash.h"
#include "refit/plan.h"
#include "refit/proto.h"

/* Test hook: when set, the sender calls it on each bucket right after computing its checksum (a
 * test flips a byte to prove the receiver refuses the version): as a push packs it, or, for a
 * bucket its push left unhashed (FR_REFIT_DIRECT), when a catch-up first takes its checksum. */
extern void (*fr_refit_test_corrupt)(uint32_t bucket, uint8_t *bytes, uint64_t len);
/* Test hook: when set, a sender's service thread calls it at `point`, holding no lock: hashing a
 * bucket for a catch-up (FR_REFIT_HOLD_SUM, before each chunk), or about to send the catch-up
 * frames it queued (FR_REFIT_HOLD_SEND); a test holds it there to show what does not wait. */
enum { FR_REFIT_HOLD_SUM = 1, FR_REFIT_HOLD_SEND = 2 };
extern void (*fr_refit_test_hold)(int point);

/* Buckets this process's receivers read from a chain predecessor (tests prove chains carry). */
extern uint64_t fr_refit_stat_forwarded;
/* Buckets read device to device (FR_REFIT_DIRECT) by receivers of this process, for tests. */
extern uint64_t fr_refit_stat_direct;
/* Checksums of device-memory buckets senders of this process took through host memory, for
 * tests (a push whose readers all read through CUDA IPC takes none). */
extern uint64_t fr_refit_stat_staged_sums;

/* Bytes packed, or read and hashed, at a time: the chunk stays in cache between the steps. */
#define FR_REFIT_CHUNK (256u * 1024u)

/* Senders by name in the directory (name.c). */
typedef struct fr_refit_name fr_refit_name;
/* Publishes the job record "ferry:job/refit/NAME" on ctx's node in the directory at url (NULL:
 * FERRY_DIRECTORY; the node carries ctx's address). FERRY_EEXIST when another live sender holds
 * the name. */
int fr_refit_publish(ferry_ctx *ctx, const char *name, const char *url, fr_refit_name **out);
void fr_refit_unpublish(fr_refit_name *n);
/* The address of the sender published as name; *address is malloc'd. */
int fr_refit_resolve(ferry_ctx *ctx, const char *name, int timeout_ms, char **address);
/* Sharded senders: rank r of group NAME publishes as "NAME#r". fr_refit_rank_name gives that
 * name (malloc'd), FERRY_EINVAL when it breaks the name rule or is longer than
 * FR_REFIT_NAME_MAX. fr_refit_resolve_rank resolves it as fr_refit_resolve does (the receiver of
 * a group: NAME#0 first, whose manifest gives the world, then NAME#1 .. NAME#world-1);
 * FERRY_ENOTFOUND saying "rank r of group 'NAME' is not published" when none is. */
int fr_refit_rank_name(const char *name, uint32_t rank, char **out);
int fr_refit_resolve_rank(ferry_ctx *ctx, const char *name, uint32_t rank, int timeout_ms,
                          char **address);

/* Sends one protocol record on a link: to a sender on FR_CHANNEL_REFIT_SENDER, to a receiver on
 * FR_CHANNEL_REFIT_RECEIVER. */
int fr_refit_send(ferry_link *link, uint32_t channel, const fr_refit_msg_t *m, int timeout_ms);
#define FR_REFIT_TO_SENDER FR_CHANNEL_REFIT_SENDER
#define FR_REFIT_TO_RECEIVER FR_CHANNEL_REFIT_RECEIVER

#endif
