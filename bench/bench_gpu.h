/*
 * What `ferry bench gpu`'s files share (bench_gpu.c: the mode, the colocated refit, routing and
 * staged rows; bench_gpu_group.c: the refit group row): device memory filled and checked through
 * ferry_mem_copy, the device-to-device baseline, and where a refit's time went in one process
 * (its metrics, read with ferry_stats_each).
 */
#ifndef FR_BENCH_GPU_H
#define FR_BENCH_GPU_H

#include "cli/bench.h"
#include "ferry.h"

#include <stdbool.h>
#include <stdint.h>

/* Device memory of device 0 (NULL with *rc set); n bytes at dev set to value; whether the first
 * and last MiB of n bytes at dev hold value; reps timed device-to-device copies (one untimed
 * first). */
void *bench_gpu_alloc(uint64_t n, int *rc);
int bench_gpu_fill(void *dev, uint64_t n, uint8_t value);
bool bench_gpu_holds(const void *dev, uint64_t n, uint8_t value);
int bench_gpu_d2d(void *dst, const void *src, uint64_t n, int reps, bench_samples *b);

/* A process's refit counters: the sender's push phases, the receiver's, its CUDA copies. */
enum { GP_PACK, GP_SLOT_WAIT, GP_READ_WAIT, GP_NOTIFY, GP_COMMIT, GP_SENDER };
enum { GP_RX_WAIT, GP_RX_COPY, GP_RX_ACK, GP_RECEIVER };
typedef struct gphases {
  double push[GP_SENDER];         /* ferry_refit_push_phase_seconds_total, by phase */
  double rx[GP_RECEIVER];         /* ferry_refit_receiver_phase_seconds_total, by phase */
  double buckets;                 /* ferry_refit_receiver_buckets_total */
  double copies, issue_s, sync_s; /* ferry_cuda_copies_total, ..._issue_/_sync_seconds_total */
} gphases;

/* The sums now (ctx's sets and the process's); (b - a) / n field by field; a row's breakdown
 * line (JSON: "breakdown": impl, tx_* from tx, rx_* from rx, the phases per timed push). */
gphases bench_gpu_phases(ferry_ctx *ctx);
gphases bench_gpu_phases_per(const gphases *a, const gphases *b, int n);
void bench_gpu_breakdown(const bench_opts *o, const char *label, const char *impl, bench_samples *b,
                         const gphases *tx, const gphases *rx);

/* bench_gpu_group.c: the group row (two sender ranks, each a process holding half of `bytes` in
 * device memory, to a group receiver here binding device memory); and a rank's process
 * (`ferry bench gpu --group-rank ...`, argv as bench_gpu got it). self: this program's path. */
int bench_gpu_group(const bench_opts *o, const char *self, uint64_t bytes, int reps);
int bench_gpu_group_rank(int argc, char **argv);

/* bench_gpu_bounce.c: a CUDA buffer read over tcp (through host memory), FERRY_CUDA_BOUNCE=malloc
 * against pinned; min(bytes, 256 MiB). Run with the staged row. */
int bench_gpu_bounce(const bench_opts *o, uint64_t bytes, int reps);

#endif
