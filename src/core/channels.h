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
#define FR_CHANNEL_STATS 59
#define FR_CHANNEL_DIRECTORY 60 /* embedded directory: requests answered by its server */
#define FR_CHANNEL_STORE 61     /* store service: remote delete, drop notices, uploads */
#define FR_CHANNEL_REFIT 62
#define FR_CHANNEL_MQ 63

#endif
