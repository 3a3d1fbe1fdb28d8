/*
 * What the embedded directory's client shares between its files (src/directory only): client.c
 * connects, calls and keeps the client's state; client_posted.c sends puts without waiting for
 * their answers and settles them later.
 */
#ifndef FR_DIR_CLIENT_IMPL_H
#define FR_DIR_CLIENT_IMPL_H

#include "directory/dirwire.h"

#include <pthread.h>

typedef struct posted posted; /* client_posted.c */

typedef struct emb {
  ferry_ctx *ctx;
  fr_dir_server *local; /* in-process server: no link */
  char where[FR_DIR_ADDRESS_MAX + 1];
  /* Held while the link is dialled, which may take a dialler's whole timeout: link, watch,
   * table and epoch are written under it (atomically) but read without it where a caller has
   * no time to wait (current_maps, emb_epoch). */
  pthread_mutex_t lock;
  ferry_link *link;
  ferry_link **grave; /* dead links, closed with the client (callers may still hold them) */
  size_t ngrave, capgrave;
  uint64_t instance, epoch;
  uint64_t *watch; /* the server's change words as mapped over `link`, or NULL */
  uint64_t *table; /* its object table, mapped with the words */
  pthread_mutex_t posted_lock;
  posted *posted_head, *posted_tail; /* oldest first */
  size_t nposted;
} emb;

/* client.c */
int fr_dir_emb_current_link(emb *e, ferry_link *dead, int timeout_ms, ferry_link **out);
bool fr_dir_emb_current_maps(emb *e, ferry_link **l, uint64_t **watch, uint64_t **table);

/* client_posted.c */
bool fr_dir_emb_post(emb *e, uint16_t op, const fr_wr *args, const fr_dir_object *objs, size_t n,
                     unsigned flags, int timeout_ms);
int fr_dir_emb_read_put_answer(fr_rd *rd, bool batch, bool *other, fr_dir_object *old);
void fr_dir_emb_settle(void *st, bool wait, fr_dir_settle_fn cb, void *arg, int timeout_ms);

#endif
