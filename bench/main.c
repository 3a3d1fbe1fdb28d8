/*
 * ferry-bench: the benchmarks behind `ferry bench`, a program of their own so that only it links
 * nng and ZeroMQ (and starts redis, python and network namespaces), never the ferry command.
 * `ferry bench MODE ...` execs it with argv "ferry bench MODE ..." (src/cli/bench_exec.c), and
 * the modes re-run it (/proc/self/exe) the same way for their helper processes; run by hand,
 * `ferry-bench MODE ...` means the same. This file dispatches to the modes (bench_MODE.c); the
 * reporting they share is src/cli/bench.c, which `ferry demo` uses too.
 */
#include "cli/args.h"
#include "cli/bench.h"
#include "cli/cli.h"

#include <string.h>

static const char bench_usage[] =
    "usage: ferry bench <mode> [--json] [--reps N] [--max-size BYTES] [--full] [--pace MS]\n\n"
    "Runs ferry and its baselines in the same run and prints medians and ratios.\n\n"
    "modes:\n"
    "  link      one-sided reads (4 KiB..1 GiB) over shm and tcp vs memcpy and a plain\n"
    "            socket stream; 64 B round trips vs a plain socket ping-pong\n"
    "  control   weight-lifecycle request latency vs a polled shared int32\n"
    "  store     routing replay: put/get vs np/torch files, Redis, memcpy, sockets\n"
    "  refit     push a model to K receivers vs memcpy and torch.distributed gloo\n"
    "  mq        pub/sub latency and streaming vs nng and ZeroMQ (ipc, tcp) and memcpy\n"
    "  gpu       CUDA memory: colocated refit, routing put/get, staged copies vs device\n"
    "            copies (says so and exits 0 without a CUDA driver)\n"
    "  directory the directory at 100 and 1,000 nodes (--full: 10,000) holding leases and\n"
    "            objects: lookup/put p50 and p99, renewal CPU and memory of ferry serve vs\n"
    "            redis-server (and etcd)\n"
    "  all       every mode above\n\n"
    "options:\n"
    "  --json            one JSON object per line: bench, case, impl, bytes, median_s,\n"
    "                    min_s, max_s, p99_s, gbps\n"
    "  --reps N          repetitions per size (default: by size)\n"
    "  --max-size BYTES  largest transfer (link; default 1G; K/M/G or KiB/MiB/GiB)\n"
    "  --full            the longer sweep (every size, more repetitions); by default a\n"
    "                    mode runs the rows docs/PERFORMANCE.md's targets read\n"
    "  --pace MS         latency rows (link, control, store, mq) also run paced: each call\n"
    "                    after a pause of MS ms (default 10; 0: no paced rows), 100 calls a\n"
    "                    row (--full: 1,000); reported as p50, p99 and paced p50 / back-to-\n"
    "                    back p50. JSON: impl \"IMPL@MSms\", with paced_ms, samples,\n"
    "                    b2b_median_s and paced_over_b2b\n"
    "  wake-ups/call     (JSON wakeups_per_call) on every paced row, and on the back-to-\n"
    "                    back rows of link, control and mq (lat-p50): the voluntary\n"
    "                    context switches per call of every thread of this process and\n"
    "                    of the peer processes on the call's path (each is a thread that\n"
    "                    slept and is woken, ~20-40 us on a VM), the bench's own pauses\n"
    "                    left out; `idle` (idle_wakeups_per_call) is what the same\n"
    "                    processes do on their own in as long (timers, polls), counted\n"
    "                    in it too. The paced-floor rows (store) time a no-op and a\n"
    "                    64 KiB memcpy the same way: what a pause costs a call that\n"
    "                    wakes nobody\n"
    "`ferry bench <mode> --help` lists a mode's own options.\n\n"
    "The 'vs base' column is the baseline's median / this row's median: >1 is faster.\n"
    "These machines are shared and noisy: compare ratios within one run.\n";

/* argv[1] is the mode; argv[0] is not read. */
static int run(int argc, char **argv) {
  const cli_cmd cmd = {
      "bench", bench_usage, "a mode (link, control, store, refit, mq, gpu, directory, all)",
      1,       1,           NULL};
  if (argc < 2 || argv[1][0] == '-') { /* no mode: --help, --version, or a usage error */
    cli_parse(&cmd, argc, argv, NULL);
    return CLI_USAGE;
  }
  const char *mode = argv[1];
  if (strcmp(mode, "link") == 0)
    return bench_link(argc - 1, argv + 1);
  if (strcmp(mode, "control") == 0)
    return bench_control(argc - 1, argv + 1);
  if (strcmp(mode, "store") == 0)
    return bench_store(argc - 1, argv + 1);
  if (strcmp(mode, "refit") == 0)
    return bench_refit(argc - 1, argv + 1);
  if (strcmp(mode, "mq") == 0)
    return bench_mq(argc - 1, argv + 1);
  if (strcmp(mode, "gpu") == 0)
    return bench_gpu(argc - 1, argv + 1);
  if (strcmp(mode, "directory") == 0)
    return bench_directory(argc - 1, argv + 1);
  if (strcmp(mode, "all") == 0) {
    bench_opts check = {0}; /* only the options every mode takes; check them once, up front */
    if (bench_parse(argc - 1, argv + 1, &check, bench_usage) < 0)
      return CLI_USAGE;
    int (*const all[])(int, char **) = {bench_link,    bench_store, bench_refit,    bench_mq,
                                        bench_control, bench_gpu,   bench_directory};
    int rc = 0;
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
      int r = all[i](argc - 1, argv + 1);
      rc = rc ? rc : r;
    }
    return rc;
  }
  return cli_usage_error(&cmd, "unknown mode '%s'", mode);
}

int main(int argc, char **argv) {
  if (argc >= 2 && strcmp(argv[1], "bench") == 0)
    return run(argc - 1, argv + 1);
  return run(argc, argv); /* run by hand: argv[1] is the mode all the same */
}
