/*
 * The few context calls jobs make beyond ferry.h, without seeing the transport's structs
 * (transport.h): a service loop marks its thread, and is woken out of a long wait.
 */
#ifndef FR_CTXCALLS_H
#define FR_CTXCALLS_H

#include "ferry.h"

#include <stdint.h>

/* Ends the channel's current or next wait (fr_ctx_await, ferry_recv) early, once, as a message
 * would: a service loop that waits for long is told to stop, or to look at its timers, without
 * polling. */
void fr_ctx_kick(ferry_ctx *ctx, uint32_t channel);
/* Marks the calling thread as a background one (a service loop such as the embedded
 * directory's): it leads the ctx's epoll only while no other caller has led for a while, and
 * steps down when one wants to, as the progress thread does. */
void fr_ctx_background_thread(void);

#endif
