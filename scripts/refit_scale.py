#!/usr/bin/env python3
"""The model of docs/SCALE.md, as numbers: a sharded refit's time from the model's bytes, both
sides' layouts, the link rate, the bucket size and the hop latency.

    scripts/refit_scale.py                 # the bench rows' predictions, and DeepSeek-V3's
    scripts/refit_scale.py RUN.json ...    # and the check: predicted against measured, from
                                           # `ferry bench refit --group-only --json` outputs

The bench's model and layouts are bench/bench_refit_peers.c's (gmodel_*), mirrored here.
"""
import json
import math
import statistics
import sys

# ---- the bench's model: 11 layers of h = 512 float32 (bench/bench_refit_group.h) ----
HIDDEN, LAYERS = 512, 11
KINDS = [(1, 1), (1, 1), (1, 1), (1, 1), (4, 1), (1, 4), (0, 1), (0, 1)]  # q k v o up down norms
TENSORS = [(k, r * HIDDEN if r else 1, c * HIDDEN) for _ in range(LAYERS) for k, (r, c) in enumerate(KINDS)]
S = sum(r * c * 4 for _, r, c in TENSORS)
NORM = 6

ETA = 1448 / 1514  # TCP payload per byte tbf counts at MTU 1500 (66 header bytes a segment)
BUCKET = 2 << 20  # the rows' bucket_bytes
T0 = 0.002  # first bucket packed (~0.7 ms), four ~0.1 ms round trips, the ranks' start skew


def split(length, rank, world):
    size = length // world
    start = size * rank
    return start, length if rank == world - 1 else start + size


def engine_part(kind, rows, cols, e, n):
    """(dim, start, stop) an engine rank binds: TP splits as engines do, or the whole tensor."""
    if n <= 1 or kind >= NORM:
        return 0, 0, rows
    dim = 1 if kind in (3, 5) else 0
    return (dim,) + split(cols if dim else rows, e, n)


def engine_bytes(e, n):
    total = 0
    for kind, rows, cols in TENSORS:
        dim, a, b = engine_part(kind, rows, cols, e, n)
        total += (b - a) * (rows if dim else cols) * 4
    return total


def trainer_bytes(t, m, n):
    """What trainer rank t sends: its rows of each matrix that each engine binds, and its share
    of the replicated norms (each engine reads them from one of the m holders)."""
    total = 0.0
    for kind, rows, cols in TENSORS:
        if kind >= NORM:
            total += sum((b - a) * cols * 4 for _, a, b in [engine_part(kind, rows, cols, e, n) for e in range(n)]) / m
            continue
        ts, te = split(rows, t, m)
        for e in range(n):
            dim, a, b = engine_part(kind, rows, cols, e, n)
            if dim:
                total += (te - ts) * (b - a) * 4
            else:
                total += max(0, min(b, te) - max(a, ts)) * cols * 4
    return total


def bench_row(m, n, tp, mbit):
    """floor, ferry, funnel, gloo (seconds) and the busiest host's bytes of one M×N row."""
    rate = mbit * 125e3
    ne = n if tp else 1
    ins = [engine_bytes(e, ne) for e in range(n)]
    outs = [trainer_bytes(t, m, ne) * (1 if tp else n) for t in range(m)]
    busiest = max(ins + outs)
    matrices = sum(r * c * 4 for k, r, c in TENSORS if k < NORM)
    gather = matrices * (m - 1) / m
    pushed = sum(ins) if tp else S
    chain_fill = 0 if tp else (n - 1) * BUCKET
    return {
        "H": busiest,
        "floor": busiest / rate,
        "ferry": busiest / (ETA * rate) + T0,
        "funnel": (gather + pushed + chain_fill) / (ETA * rate),
        "gloo": (gather + math.ceil(math.log2(n + 1)) * S) / (ETA * rate),
        "A": sum(ins),
    }


ROWS = [("MxN-M4-N2", 4, 2, False, 1000), ("MxN-M4-TP4", 4, 4, True, 1000),
        ("MxN-M2-TP4", 2, 4, True, 1000), ("MxN-M8-TP8", 8, 8, True, 400)]


def fmt(s):
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.3f} s"


def check(paths):
    """Predicted against the medians of the runs' medians."""
    got, ratios = {}, {}
    for p in paths:
        for line in open(p):
            if line.startswith("{"):
                d = json.loads(line)
                if d["impl"] == "ratios":
                    ratios.setdefault(d["case"], []).append(d)
                else:
                    got.setdefault((d["case"], d["impl"]), []).append(d["median_s"])
    print("| row | H | floor | ferry predicted | measured | pred/meas | funnel predicted | measured "
          "| pred/meas | gloo predicted | measured | pred/meas |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case, m, n, tp, mbit in ROWS:
        p = bench_row(m, n, tp, mbit)
        cells = [case + f" ({mbit} Mbit/s)", f"{p['H'] / 2**20:.1f} MiB", fmt(p["floor"])]
        for impl, key in (("ferry/group", "ferry"), ("funnel", "funnel"), ("gloo", "gloo")):
            v = got.get((case, impl))
            med = statistics.median(v) if v else None
            cells += [fmt(p[key]), fmt(med) if med else "-", f"{p[key] / med:.3f}" if med else "-"]
        if (case, "ferry/group") in got:
            print("| " + " | ".join(cells) + " |")
    for case, m, n, tp, mbit in ROWS:
        rs = ratios.get(case)
        v = got.get((case, "ferry/group"))
        if not rs or not v:
            continue
        a = bench_row(m, n, tp, mbit)["A"]
        kappa = [(r["procs_cores"] + r["net_cores"]) * t / a * 1e9 for r, t in zip(rs, v)]
        print(f"{case}: over floor {[round(r['over_floor'], 3) for r in rs]}, funnel/ferry "
              f"{[round(r['funnel_over_ferry'], 2) for r in rs]}, gloo/ferry "
              f"{[round(r['gloo_over_ferry'], 2) for r in rs]}, cores (processes + irq/softirq) "
              f"{[round(r['procs_cores'] + r['net_cores'], 2) for r in rs]}, kappa ns/B "
              f"{[round(k, 2) for k in kappa]}, CPU term A*kappa/2 "
              f"{fmt(a * statistics.median(kappa) * 1e-9 / 2)}")


def deepseek():
    """DeepSeek-V3 (671 B parameters), PP16×EP16 on 32 nodes -> TP32 on 4 nodes, a 400 Gbit/s
    NIC per GPU."""
    rate, eta = 50e9, 0.97
    routed = 654e9 / 671e9
    for name, model in (("bf16", 1.342e12), ("fp8", 0.68e12)):
        engine = model / 32
        trainer = model * routed / 256 + model * (1 - routed) / 16 / 16
        link = engine / (eta * rate)
        print(f"DeepSeek-V3 {name}: S {model / 1e12:.3f} TB, engine GPU binds {engine / 1e9:.1f} GB, "
              f"trainer GPU sends {trainer / 1e9:.2f} GB, floor {engine / rate:.3f} s, link term "
              f"{link:.3f} s, H2D at 50 GB/s {engine / 50e9:.3f} s, verify {engine / 9e9:.1f} core-s, "
              f"sender hash {trainer / 20e9:.3f} s, funnel >= {2 * model / 400e9:.1f} s, one link "
              f"{model / rate:.1f} s")


if __name__ == "__main__":
    for case, m, n, tp, mbit in ROWS + [("MxN-M8-TP8@1000", 8, 8, True, 1000)]:
        p = bench_row(m, n, tp, mbit)
        print(f"{case}: H {p['H'] / 2**20:.2f} MiB, floor {fmt(p['floor'])}, ferry {fmt(p['ferry'])} "
              f"({p['ferry'] / p['floor']:.3f}x), funnel {fmt(p['funnel'])}, gloo {fmt(p['gloo'])}, "
              f"A {p['A'] / 1e6:.1f} MB")
    deepseek()
    if len(sys.argv) > 1:
        check(sys.argv[1:])
