/*
 * The ucx transport in a build without UCX (-DFERRY_WITH_UCX=OFF, or libucx-dev missing): the
 * name stays known so that FERRY_TRANSPORTS=ucx fails with a clear FERRY_ENOTSUP instead of
 * "unknown transport", and `ferry info` can say why there is no ucx.
 */
#include "transport/transport.h"
#include "transport/ucx.h"

static int ucx_off(void) {
  return fr_err(FERRY_ENOTSUP, "ucx: not supported in this build (configure with libucx-dev "
                               "installed and -DFERRY_WITH_UCX=ON)");
}

static int ucx_off_listen(ferry_ctx *ctx, int *fd, char *url, size_t url_len) { return ucx_off(); }

static int ucx_off_dial(const char *where, int timeout_ms, int *fd) { return ucx_off(); }

void fr_ucx_describe(FILE *out) { fprintf(out, "ucx:        not in this build\n"); }

const fr_transport_ops fr_ucx_transport = {
    .name = "ucx",
    .scheme = "ucx://",
    .listen = ucx_off_listen,
    .dial = ucx_off_dial,
};
