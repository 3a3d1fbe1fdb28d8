/*
 * The object table that the embedded directory shares with the clients on its host (layout and
 * the rules for trusting a slot: table.h). The server writes each key's record into its slot
 * after every change, before it answers; a client posting a put writes its record there before
 * sending it. Readers copy a slot under its sequence word and decode the copy with the wire
 * format's fail-closed reader, so a torn, stale or corrupt slot is never taken for a record:
 * the lookup goes to the server instead. Words are read and written with atomics: the writer
 * may be another process at any moment.
 */
#include "directory/table.h"
#include "directory/dirwire.h"

#include <string.h>

#define HEAD_WORDS 5
#define DATA_BYTES (FR_DIR_TABLE_SLOT_BYTES - HEAD_WORDS * 8)
#define DATA_WORDS (DATA_BYTES / 8)
#define SERVER_SPINS 100000 /* a writer holds a slot for a few hundred nanoseconds */
#define CLIENT_SPINS 64

_Static_assert(FR_DIR_TABLE_SLOT_BYTES % 8 == 0, "slots are u64 words");
_Static_assert(DATA_BYTES >= FR_DIR_OBJECT_WIRE_MAX, "a slot holds the longest record");

enum { SEQ, PEND, DONE, TICKET, STATE };

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

uint64_t *fr_dir_table_slot(uint64_t *table, uint32_t slots, const char *key) {
  return table + (size_t)(fr_dir_key_hash(key) % slots) * (FR_DIR_TABLE_SLOT_BYTES / 8);
}

static bool slot_lock(uint64_t *slot, int spins) {
  for (int i = 0; i < spins; i++) {
    uint64_t seq = __atomic_load_n(&slot[SEQ], __ATOMIC_RELAXED);
    if (!(seq & 1) && __atomic_compare_exchange_n(&slot[SEQ], &seq, seq + 1, false,
                                                  __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
      return true;
    relax();
  }
  return false;
}

static void slot_unlock(uint64_t *slot) { __atomic_add_fetch(&slot[SEQ], 1, __ATOMIC_RELEASE); }

/* Writes state, ticket and bytes (slot locked). */
static void slot_write(uint64_t *slot, uint32_t state, uint64_t ticket, const void *p, size_t len) {
  uint64_t words[DATA_WORDS] = {0};
  if (len > 0)
    memcpy(words, p, len);
  /* release stores: the odd sequence word is visible before any of them */
  for (size_t i = 0; i < (len + 7) / 8; i++)
    __atomic_store_n(&slot[HEAD_WORDS + i], words[i], __ATOMIC_RELEASE);
  __atomic_store_n(&slot[TICKET], ticket, __ATOMIC_RELEASE);
  __atomic_store_n(&slot[STATE], (uint64_t)state << 32 | len, __ATOMIC_RELEASE);
}

/* Writes rec in `state`, or empties the slot when rec does not fit (slot locked). */
static void slot_write_record(uint64_t *slot, uint32_t state, uint64_t ticket,
                              const fr_dir_object *rec) {
  uint8_t buf[DATA_BYTES];
  fr_wr w = FR_WR_ON(buf);
  fr_wr_object(&w, rec);
  if (!w.failed && w.len <= DATA_BYTES)
    slot_write(slot, state, ticket, w.p, w.len);
  else
    slot_write(slot, FR_SLOT_EMPTY, 0, NULL, 0);
  fr_wr_free(&w);
}

/* Copies the first len bytes of the slot's record into words (acquire loads: a seqlock reader's
 * second read of the sequence word comes after all of them). */
static void copy_words(const uint64_t *slot, uint64_t *words, uint32_t len) {
  for (size_t i = 0; i < (len + 7) / 8; i++)
    words[i] = __atomic_load_n(&slot[HEAD_WORDS + i], __ATOMIC_ACQUIRE);
}

/* Copies the slot's record bytes and state; false when torn, empty or malformed. */
static bool slot_copy(const uint64_t *slot, uint64_t words[DATA_WORDS], uint32_t *state,
                      uint32_t *len, uint64_t *ticket) {
  uint64_t seq = __atomic_load_n(&slot[SEQ], __ATOMIC_ACQUIRE);
  if (seq & 1)
    return false;
  /* acquire loads: the second read of the sequence word comes after all of them */
  uint64_t sl = __atomic_load_n(&slot[STATE], __ATOMIC_ACQUIRE);
  *ticket = __atomic_load_n(&slot[TICKET], __ATOMIC_ACQUIRE);
  *state = (uint32_t)(sl >> 32);
  *len = (uint32_t)sl;
  if (*state == FR_SLOT_EMPTY || *len > DATA_BYTES)
    return false;
  copy_words(slot, words, *len);
  return __atomic_load_n(&slot[SEQ], __ATOMIC_RELAXED) == seq;
}

static bool decode(const uint64_t *words, uint32_t len, fr_dir_object *out) {
  fr_rd rd = fr_rd_init(words, len);
  return fr_rd_object(&rd, out) && fr_rd_done(&rd);
}

/* Whether the (locked) slot holds key, or something that is no record at all. */
static bool slot_holds(const uint64_t *slot, const char *key) {
  uint64_t words[DATA_WORDS];
  uint64_t sl = __atomic_load_n(&slot[STATE], __ATOMIC_RELAXED);
  uint32_t len = (uint32_t)sl;
  if ((sl >> 32) == FR_SLOT_EMPTY)
    return false;
  if (len > DATA_BYTES)
    return true;
  copy_words(slot, words, len);
  fr_dir_object o;
  return !decode(words, len, &o) || strcmp(o.key, key) == 0;
}

void fr_dir_table_publish(uint64_t *slot, const char *key, const fr_dir_object *rec) {
  if (!slot_lock(slot, SERVER_SPINS))
    return; /* its writer died in it: readers never trust it again */
  if (rec)
    slot_write_record(slot, FR_SLOT_COMMITTED, 0, rec);
  else if (slot_holds(slot, key))
    slot_write(slot, FR_SLOT_EMPTY, 0, NULL, 0);
  slot_unlock(slot);
}

/* Empties the (locked) slot if it holds a posted record of owner's. */
static void drop_posted(uint64_t *slot, const char *owner) {
  uint64_t words[DATA_WORDS];
  uint64_t sl = __atomic_load_n(&slot[STATE], __ATOMIC_RELAXED);
  uint32_t len = (uint32_t)sl;
  if ((sl >> 32) != FR_SLOT_POSTED || len > DATA_BYTES)
    return;
  copy_words(slot, words, len);
  fr_dir_object o;
  if (!decode(words, len, &o) || strcmp(o.owner, owner) == 0)
    slot_write(slot, FR_SLOT_EMPTY, 0, NULL, 0);
}

void fr_dir_table_drop_owner(uint64_t *table, uint32_t slots, const char *owner) {
  for (uint32_t i = 0; i < slots; i++) {
    uint64_t *slot = table + (size_t)i * (FR_DIR_TABLE_SLOT_BYTES / 8);
    if ((__atomic_load_n(&slot[STATE], __ATOMIC_RELAXED) >> 32) != FR_SLOT_POSTED ||
        !slot_lock(slot, SERVER_SPINS))
      continue;
    drop_posted(slot, owner);
    slot_unlock(slot);
  }
}

void fr_dir_table_done(uint64_t *slot) { __atomic_add_fetch(&slot[DONE], 1, __ATOMIC_SEQ_CST); }

uint64_t fr_dir_table_ticket(uint64_t *slot) {
  return __atomic_add_fetch(&slot[PEND], 1, __ATOMIC_SEQ_CST);
}

void fr_dir_table_post(uint64_t *slot, uint64_t ticket, const fr_dir_object *rec) {
  if (!slot_lock(slot, CLIENT_SPINS))
    return; /* readers ask the server until it applied the put */
  slot_write_record(slot, FR_SLOT_POSTED, ticket, rec);
  slot_unlock(slot);
}

bool fr_dir_table_read(const uint64_t *slot, const char *key, fr_dir_object *out) {
  uint64_t done = __atomic_load_n(&slot[DONE], __ATOMIC_SEQ_CST);
  uint64_t words[DATA_WORDS], ticket;
  uint32_t state, len;
  if (!slot_copy(slot, words, &state, &len, &ticket))
    return false;
  uint64_t pend = __atomic_load_n(&slot[PEND], __ATOMIC_SEQ_CST);
  bool current = state == FR_SLOT_COMMITTED
                     ? pend == done
                     : state == FR_SLOT_POSTED && pend == done + 1 && ticket == pend;
  fr_dir_object o;
  if (!current || !decode(words, len, &o) || strcmp(o.key, key) != 0)
    return false;
  *out = o;
  return true;
}
