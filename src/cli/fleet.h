/*
 * The fleet as one picture: what a directory knows (nodes, store keys by prefix, refit senders,
 * mq topics), what each node says of itself (its metrics, asked for over a ferry link), and the
 * control cells of this host. One snapshot function feeds ferry serve's /v1/fleet and status
 * page and `ferry top`, so that they always show the same data. docs/OPERATIONS.md gives the
 * JSON schema.
 */
#ifndef FR_CLI_FLEET_H
#define FR_CLI_FLEET_H

#include <jansson.h>
#include <stddef.h>

/* Caps that bound a snapshot's size; the JSON says when something was left out. */
#define FLEET_NODES_MAX 256
#define FLEET_PREFIXES_MAX 100
#define FLEET_KEYS_PER_PREFIX 20
#define FLEET_OWNERS_PER_PREFIX 16
#define FLEET_TOPICS_MAX 100
#define FLEET_CELLS_MAX 100
#define FLEET_STATS_TIMEOUT_MS 1000 /* how long one node may take to say its metrics */

typedef struct fleet_view fleet_view;

/* A client of the fleet whose directory is at url (NULL: FERRY_DIRECTORY): its own ctx, named
 * `name` (it registers nothing), and a directory connection. */
int fleet_view_open(const char *url, const char *name, fleet_view **out);
void fleet_view_close(fleet_view *v);
/* One snapshot (the /v1/fleet object). Thread-safe (one at a time). A node that does not answer
 * is listed with its error; only a directory that does not answer fails the call. */
int fleet_snapshot(fleet_view *v, json_t **out);
/* The snapshot as compact JSON text (malloc'd, NUL-terminated). */
int fleet_json(fleet_view *v, char **text, size_t *len);

/* The status page (HTML with its script), served at / by ferry serve. */
extern const char fleet_page_html[];

#endif
