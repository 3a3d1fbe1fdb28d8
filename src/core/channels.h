/*
 * Reserved message channels. Applications use 0..FR_CHANNEL_APP_MAX; ferry's own services take
 * the top of the range, one channel each, so their traffic never mixes with an application's.
 */
#ifndef FR_CHANNELS_H
#define FR_CHANNELS_H

#define FR_CHANNEL_APP_MAX 47
/* Every ctx answers a call here with its metrics (the Prometheus text its /metrics would
 * serve), on its server thread: how a fleet view (ferry serve's /v1/fleet, ferry top) learns
 * what only a node knows, such as the version each of its refit receivers committed. */
/* refit: what receivers send to their sender (ATTACH, VIEW, ACK, COMMITTED, CATCHUP, DETACH),
 * and what a sender sends to its receivers (BUCKET, COMMIT, ROUTE, DROPPED, CATCHUP refused).
 * Two channels, so a process can be a sender and a receiver on one context, each role owning
 * its channel (fr_ctx_channel_open). */
#define FR_CHANNEL_REFIT_RECEIVER 58
#define FR_CHANNEL_STATS 59
#define FR_CHANNEL_DIRECTORY 60 /* embedded directory: requests answered by its server */
#define FR_CHANNEL_STORE 61     /* store service: remote delete, drop notices, uploads */
#define FR_CHANNEL_REFIT_SENDER 62
#define FR_CHANNEL_MQ 63

#endif
