/*
 * A name -> index table for the embedded directory's nodes (server.c): open addressing with
 * linear probing over indices into the caller's array, so a renewal or a put finds its node in
 * O(1) instead of comparing every node's name (a directory of 10,000 nodes renews 2,000 a
 * second). The table stores no names: `name_of` reads entry i's name from the caller's array.
 * Not thread-safe: the caller's lock covers it with the array.
 */
#ifndef FR_DIRECTORY_NAMES_H
#define FR_DIRECTORY_NAMES_H

#include <stddef.h>
#include <stdint.h>

typedef const char *(*fr_name_of)(const void *arg, uint32_t i);

typedef struct fr_names {
  uint32_t *slot; /* i + 1, or 0 when empty; cap slots, a power of two (0: none yet) */
  size_t cap, n;
  fr_name_of name_of;
  const void *arg;
} fr_names;

/* Entry i's index, or -1. */
long fr_names_find(const fr_names *t, const char *name);
/* Adds entry i (not present), growing the table: FERRY_ENOMEM (no change) when it cannot. */
int fr_names_add(fr_names *t, uint32_t i);
/* Removes entry i (present). */
void fr_names_del(fr_names *t, uint32_t i);
/* Entry `from` is now entry `to` (the caller moved it in its array; its name is readable at
 * `to`). */
void fr_names_move(fr_names *t, uint32_t from, uint32_t to);
void fr_names_free(fr_names *t);

#endif
