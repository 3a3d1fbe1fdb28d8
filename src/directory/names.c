/*
 * The embedded directory's name -> node index (names.h): open addressing with linear probing and
 * backward-shift deletion, so a removal leaves no tombstones and lookups stay short whatever the
 * churn. The table holds indices only; names are read through the caller's name_of.
 */
#include "directory/names.h"
#include "directory/directory.h"

#include <stdlib.h>
#include <string.h>

static size_t home(const fr_names *t, uint32_t i) {
  return fr_dir_key_hash(t->name_of(t->arg, i)) & (t->cap - 1);
}

/* The slot that holds `entry`, on the probe run of the name entry `named` has now. */
static size_t slot_holding(const fr_names *t, uint32_t named, uint32_t entry) {
  size_t at = home(t, named);
  while (t->slot[at] != entry + 1)
    at = (at + 1) & (t->cap - 1);
  return at;
}

long fr_names_find(const fr_names *t, const char *name) {
  if (t->cap == 0)
    return -1;
  for (size_t at = fr_dir_key_hash(name) & (t->cap - 1); t->slot[at]; at = (at + 1) & (t->cap - 1))
    if (strcmp(t->name_of(t->arg, t->slot[at] - 1), name) == 0)
      return (long)(t->slot[at] - 1);
  return -1;
}

static void place(fr_names *t, uint32_t i) {
  size_t at = home(t, i);
  while (t->slot[at])
    at = (at + 1) & (t->cap - 1);
  t->slot[at] = i + 1;
}

/* Rehashes every entry into a table of cap slots. */
static int resize(fr_names *t, size_t cap) {
  uint32_t *old = t->slot;
  size_t old_cap = t->cap;
  uint32_t *slot = calloc(cap, sizeof *slot);
  if (!slot)
    return fr_err(FERRY_ENOMEM, "directory: node index of %zu slots", cap);
  t->slot = slot;
  t->cap = cap;
  for (size_t k = 0; k < old_cap; k++)
    if (old[k])
      place(t, old[k] - 1);
  free(old);
  return 0;
}

int fr_names_add(fr_names *t, uint32_t i) {
  if (2 * (t->n + 1) > t->cap) { /* at most half full: probes stay short */
    int rc = resize(t, t->cap ? 2 * t->cap : 64);
    if (rc != 0)
      return rc;
  }
  place(t, i);
  t->n++;
  return 0;
}

void fr_names_del(fr_names *t, uint32_t i) {
  size_t mask = t->cap - 1, hole = slot_holding(t, i, i);
  t->slot[hole] = 0;
  t->n--;
  /* Backward shift: an entry after the hole moves into it unless its home lies cyclically in
   * (hole, at], where it would no longer be found. */
  for (size_t at = (hole + 1) & mask; t->slot[at]; at = (at + 1) & mask) {
    size_t h = home(t, t->slot[at] - 1);
    if (((at - h) & mask) >= ((at - hole) & mask)) {
      t->slot[hole] = t->slot[at];
      t->slot[at] = 0;
      hole = at;
    }
  }
}

void fr_names_move(fr_names *t, uint32_t from, uint32_t to) {
  t->slot[slot_holding(t, to, from)] = to + 1; /* the name is read at `to` now */
}

void fr_names_free(fr_names *t) {
  free(t->slot);
  t->slot = NULL;
  t->cap = t->n = 0;
}
