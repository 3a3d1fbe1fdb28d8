/*
 * The M×N rows of `ferry bench refit` (issue 34): a model held by M trainer ranks, each a process
 * on a "host" of its own (a network namespace whose link is rate-limited both ways, netns.h),
 * pushed to N engine processes on N other hosts. What the two files share: the synthetic model
 * and its two layouts (the trainer's pieces, the engines' bindings), the bytes each host must
 * move, and the messages between the run (bench_refit_group.c) and its helper processes
 * (bench_refit_peers.c: trainer ranks, funnel ranks, engines).
 */
#ifndef FR_BENCH_REFIT_GROUP_H
#define FR_BENCH_REFIT_GROUP_H

#include "cli/bench.h"
#include "ferry.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A transformer-shaped model of float32 matrices, [out, in] as torch's Linear keeps them: per
 * layer q, k, v, o (h×h), up (4h×h), down (h×4h) and two norms (1×h); or (small) `count` vectors
 * of 256 floats. Every process that needs it makes the same one from the same arguments. */
enum { GM_Q, GM_K, GM_V, GM_O, GM_UP, GM_DOWN, GM_NORM1, GM_NORM2, GM_KINDS };

typedef struct gmodel {
  size_t n;
  char (*name)[48];
  ferry_tensor_desc *desc; /* global shapes */
  uint64_t bytes;
  bool small;
} gmodel;

#define GM_HIDDEN 512

/* Whole layers of GM_HIDDEN until `bytes` is reached; or, with small_count, that many vectors. */
int gmodel_make(gmodel *m, uint64_t bytes, size_t small_count);
void gmodel_free(gmodel *m);
int gmodel_kind(const gmodel *m, size_t i); /* GM_*; the small model's tensors are GM_NORM1 */
uint64_t gmodel_tensor_bytes(const gmodel *m, size_t i);

/* The trainer's layout (FSDP-like): every matrix split along dim 0 into `world` equal pieces,
 * norms whole on every rank; the small model's tensor i whole on rank i % world only. Rank
 * `rank`'s part of tensor i: 0 when it holds none; else 1, with the rows [*start, *stop) (a
 * whole tensor: all its rows, and *whole set). */
int gmodel_trainer_part(const gmodel *m, size_t i, int rank, int world, int64_t *start,
                        int64_t *stop, bool *whole);

/* The engines' layout: TP over `world` ranks as inference engines split (q, k, v fused along
 * dim 0, up along dim 0, o and down along dim 1, norms whole), or (world <= 1) the whole model.
 * Engine rank `rank`'s slice of tensor i along *dim: [*start, *stop). */
void gmodel_engine_part(const gmodel *m, size_t i, int rank, int world, int *dim, int64_t *start,
                        int64_t *stop);

/* Bytes each host must move per push: every engine's ingress, every trainer's egress (a
 * replicated tensor counted as its expected share: read once per engine from one of its
 * holders); the most of any host is the row's floor (over the link rate). */
uint64_t gmodel_engine_bytes(const gmodel *m, int rank, int engines);
uint64_t gmodel_trainer_bytes(const gmodel *m, int rank, int trainers, int engines);

/* ---- the run and its helper processes ---- */

/* Every host's link, each way (tc tbf's rate), in Mbit/s; the 8×8 row's lower: at 1 Gbit/s its
 * eight engine links take ~1 GB/s together, which costs these 2 cores more than they have (the
 * processes and the network stack ~2.4 core-seconds per GB here). */
#define MN_MBIT 1000
#define MN_MBIT_8 400
#define MN_STR_(x) #x
#define MN_STR(x) MN_STR_(x)

/* What the run asks a helper: 'n' (trainers: wait until v receivers attached), 'p' (push
 * version v), 'w' (engines: wait for version v), 'q' (quit). */
typedef struct gpeer_cmd {
  char op;
  uint64_t v;
} gpeer_cmd;

/* A helper's answer to 'r'eady (at start) and to each command. t0, t1: CLOCK_MONOTONIC around
 * the push (one clock for every process on the machine); cpu: the process's CPU seconds so far. */
typedef struct gpeer_report {
  int rc;
  double t0, t1, cpu;
  uint64_t bytes_read, committed;
} gpeer_report;

/* `ferry bench refit --group-...`: the helper processes (bench_refit_peers.c). */
int bench_refit_group_peer(int argc, char **argv);
/* The M×N rows (bench_refit_group.c): between hosts unless `hosts` is false (then only the
 * 5,000-tensor group on this host). Returns 0, or non-zero when a row failed. */
int bench_refit_group(const bench_opts *o, bool hosts, bool one_host);
/* Usage lines for bench_refit's --help. */
// clang-format off
#define BENCH_REFIT_GROUP_USAGE \
  "M×N (MxN-M4-N2, -M4-TP4, -M2-TP4; --full adds -M8-TP8): a 132 MiB model (11 layers,\n" \
  "h = 512) held by M trainer ranks (matrices split along dim 0, norms on every rank),\n" \
  "each a process on a host of its own, pushed to N engine hosts (N2: each the whole\n" \
  "model; TPn: TP ranks, fused qkv and up by rows, o and down by columns), every host's\n" \
  "link limited both ways (tc tbf on both ends of its veth) to " MN_STR(MN_MBIT) " Mbit/s (the\n" \
  "8x8 row: " MN_STR(MN_MBIT_8) " Mbit/s). Rows: floor (the most bytes any one host sends or\n" \
  "receives, over the rate; vs base = floor / time, target >= 0.8), ferry/group, funnel\n" \
  "(gathered to rank 0 over tcp, then one sender pushes), gloo (gather to rank 0, then\n" \
  "broadcast). A note line gives time / floor, funnel / ferry, gloo / ferry and the CPU\n" \
  "used per second of the pushes (the processes, irq + softirq); --json: impl \"ratios\".\n" \
  "5000t-M4 (this host, shm): 4 ranks holding 5,000 tensors of 1 KiB, the group's push\n" \
  "against a memcpy of its bytes and the same tensors from one sender. --group-only runs\n" \
  "these rows alone.\n"
// clang-format on

#endif
