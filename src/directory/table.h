/*
 * The embedded directory's object table in shared memory (table.c): a copy of its object records
 * that clients on its host read without asking, so that a lookup wakes no thread.
 *
 * Layout: FR_DIR_TABLE_SLOTS slots of FR_DIR_TABLE_SLOT_BYTES, a key in slot
 * fr_dir_key_hash(key) % slots (one key per slot; a collision or an empty slot sends the reader
 * to the server). A slot is u64 words:
 *   [0] seq    even: stable; odd: a writer holds it (writers take it by compare-and-swap)
 *   [1] pend   tickets: posted puts of a key of this slot that clients took (before sending)
 *   [2] done   posted puts of this slot that the server applied (or whose sender gave up)
 *   [3] ticket the ticket of a POSTED record
 *   [4] state << 32 | len
 *   [5..] len bytes: the record as fr_wr_object() writes it (decoded with fr_rd_object(): the
 *         slot is untrusted memory)
 * States: EMPTY; COMMITTED (the server wrote it: the key's record as it stands in the server);
 * POSTED (a client wrote it before sending the put, under its ticket).
 *
 * A reader trusts a slot only when (done read before the slot, pend after it, seq unchanged
 * around it): COMMITTED and pend == done (no posted put of the slot in flight), or POSTED with
 * pend == done + 1 == ticket (the one put in flight is the slot's, and nothing was written
 * after it). A put that returned took its ticket before, so it is either applied and written,
 * or it is the one in flight and in the slot. Anything else (a torn read, a put in flight
 * elsewhere in the slot, a writer that died holding the slot) sends the reader to the server.
 */
#ifndef FR_DIR_TABLE_H
#define FR_DIR_TABLE_H

#include "directory/directory.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define FR_DIR_TABLE_SLOTS 4096u
#define FR_DIR_TABLE_SLOT_BYTES 640u
#define FR_DIR_TABLE_BYTES ((size_t)FR_DIR_TABLE_SLOTS * FR_DIR_TABLE_SLOT_BYTES)

enum { FR_SLOT_EMPTY = 0, FR_SLOT_COMMITTED = 1, FR_SLOT_POSTED = 2 };

/* The slot of key in a table of `slots` slots. */
uint64_t *fr_dir_table_slot(uint64_t *table, uint32_t slots, const char *key);

/* Server: writes key's record (NULL: the key has none; the slot is emptied if it holds key).
 * Gives up (leaving the slot to its stuck writer) when the slot stays locked. */
void fr_dir_table_publish(uint64_t *slot, const char *key, const fr_dir_object *rec);
/* Server: a node's records dropped. Empties the slots that hold a posted record of owner's:
 * a put posted just before its sender died may never arrive (its ticket then stays open, and
 * readers of the slot ask the server from then on). */
void fr_dir_table_drop_owner(uint64_t *table, uint32_t slots, const char *owner);
/* Server: one posted put of the slot applied (after its publish). */
void fr_dir_table_done(uint64_t *slot);

/* Client: takes a ticket before sending a posted put; returns it. */
uint64_t fr_dir_table_ticket(uint64_t *slot);
/* Client: writes a posted record under its ticket (skipped when the slot is busy). */
void fr_dir_table_post(uint64_t *slot, uint64_t ticket, const fr_dir_object *rec);

/* Reader: fills *out with key's record when the slot proves it current; false: ask the server. */
bool fr_dir_table_read(const uint64_t *slot, const char *key, fr_dir_object *out);

#endif
