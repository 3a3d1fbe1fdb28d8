/*
 * The ucx transport's extras beside its ops table (fr_ucx_transport, listed in registry.c).
 * Built from ucx.c (and ucx_ep.c, ucx_am.c, ucx_rma.c) when CMake found UCX (FERRY_HAVE_UCX),
 * from ucx_off.c otherwise.
 */
#ifndef FR_UCX_H
#define FR_UCX_H

#include <stdio.h>

/* Prints what `ferry info` shows of UCX: its version and the transports/devices it sees (or
 * that this build has no UCX). */
void fr_ucx_describe(FILE *out);

#endif
