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
/* A snapshot's budget (FERRY_FLEET_BUDGET_MS, held within these): the directory read and every
 * node's metrics, asked FLEET_ASK_THREADS at a time, each given what is left of it. */
#define FLEET_BUDGET_MIN_MS 100
#define FLEET_BUDGET_MAX_MS 60000
#define FLEET_ASK_THREADS 16
#define FLEET_CACHE_MS 1000 /* a snapshot this recent is served again, not taken anew */
#define FLEET_SKIP_MS 10000 /* an address that failed is not asked again for this long */

typedef struct fleet_view fleet_view;

/* A client of the fleet whose directory is at url (NULL: FERRY_DIRECTORY): its own ctx, named
 * `name` (it registers nothing), and a directory connection. */
int fleet_view_open(const char *url, const char *name, fleet_view **out);
void fleet_view_close(fleet_view *v);
/* FERRY_FLEET_BUDGET_MS, held within FLEET_BUDGET_MIN_MS .. FLEET_BUDGET_MAX_MS. */
int fleet_budget_ms(void);
/* One snapshot (the /v1/fleet object), taken within the budget. Thread-safe: one is taken at a
 * time; a caller gets the last one when it is under FLEET_CACHE_MS old, or while another is being
 * taken (else it waits for that one). A node that does not answer is listed with its error; only
 * a directory that does not answer fails the call. */
int fleet_snapshot(fleet_view *v, json_t **out);
/* The snapshot as compact JSON text (malloc'd, NUL-terminated). */
int fleet_json(fleet_view *v, char **text, size_t *len);

/* The status page (HTML with its script), served at / by ferry serve. */
extern const char fleet_page_html[];

#endif
