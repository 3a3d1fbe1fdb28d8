/*
 * The one place transports are registered. Adding a transport means writing its ops table and
 * listing it here; FERRY_TRANSPORTS names entries of this list.
 */
#include "transport/transport.h"

#include <string.h>

extern const fr_transport_ops fr_shm_transport;
extern const fr_transport_ops fr_tcp_transport;
extern const fr_transport_ops fr_ucx_transport; /* ucx.c, or ucx_off.c in a build without UCX */

static const fr_transport_ops *const transports[] = {
    &fr_shm_transport,
    &fr_tcp_transport,
    &fr_ucx_transport,
};

const fr_transport_ops *fr_transport_find(const char *name) {
  for (size_t i = 0; i < sizeof transports / sizeof transports[0]; i++)
    if (strcmp(transports[i]->name, name) == 0)
      return transports[i];
  return NULL;
}
