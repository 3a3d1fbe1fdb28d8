"""python3 -m ferry.bench stream: RefitSender.push_iter against a declared push of the same bytes
(issue 35 deliverable 3: push_iter of 256 MiB in 1,000 tensors <= 1.3x the declared push).

One process: a declared sender (RefitSender(name, state_dict), push(); default buckets) and, per
cap, a streaming sender (RefitSender(name, stream_cap=...), push_iter(v, generator); buckets of
cap / 8) beside a declared one with those same buckets, each with one receiver on this host
reading into a flat buffer (its C thread reads; the GIL is released during pushes). The generator
yields the trainer's tensors one by one, as a state dict's items; the first push_iter of each
sender plans (staged whole) and is not timed. Rounds take turns, declared first in even rounds
and last in odd ones. Every push is checked at the receiver (the committed version). Medians of
--reps rounds."""
import json
import os
import statistics
import time
from typing import Any, Dict, List, Optional, TextIO

import numpy as np

TENSORS = 1000
TOTAL = 256 << 20


def _model(total: int, count: int) -> Dict[str, np.ndarray]:
    per = total // count // 4
    rng = np.random.default_rng(5)
    return {"layers.%d.weight" % i: rng.standard_normal(per, dtype=np.float32)
            for i in range(count)}


def run(reps: int = 5, caps: Optional[List[int]] = None, as_json: bool = False,
        total: int = TOTAL, count: int = TENSORS, out: TextIO = None) -> Dict[str, float]:
    """Rows: "declared" (RefitSender(name, state_dict), default buckets), and for each cap a
    streaming sender (its default buckets, cap / 8) beside a declared one with those buckets."""
    import sys
    import ferry
    out = out or sys.stdout
    caps = caps or [256 << 20, 64 << 20]
    sd = _model(total, count)
    pid = os.getpid()
    senders = {"declared": ferry.RefitSender("bench-decl-%d" % pid, sd)}
    for c in caps:
        mib = c >> 20
        senders["declared, %d MiB buckets" % (c // 8 >> 20)] = ferry.RefitSender(
            "bench-decl%d-%d" % (mib, pid), sd, buffer_bytes=c // 8)
        senders["push_iter, cap %d MiB" % mib] = ferry.RefitSender(
            "bench-iter%d-%d" % (mib, pid), stream_cap=c)
    receivers = {}
    times: Dict[str, List[float]] = {k: [] for k in senders}
    parts: Dict[str, List[int]] = {k: [] for k in senders}

    def push(key, v):
        tx = senders[key]
        t0 = time.perf_counter()
        if key.startswith("push_iter"):
            tx.push_iter(v, iter(sd.items()), timeout=60)
            parts[key].append(tx.stream_info["parts"])
        else:
            tx.push(v, timeout=60)
            parts[key].append(1)
        times[key].append(time.perf_counter() - t0)
        assert receivers[key].committed == v

    try:
        for key, tx in senders.items():
            if key.startswith("push_iter"):
                tx.push_iter(1, iter(sd.items()))  # plans (not timed)
            rx = receivers[key] = ferry.RefitReceiver(tx.name, timeout=10)
            rx.tensors(like="numpy")
        for key, tx in senders.items():
            if not key.startswith("push_iter"):
                tx.push(1, timeout=60)
            receivers[key].wait(1, timeout=30)
        order = list(senders)
        for v in range(2, reps + 2):  # every other round the other way round
            for key in (order if v % 2 == 0 else order[::-1]):
                push(key, v)
    finally:
        for rx in receivers.values():
            rx.close()
        for tx in senders.values():
            tx.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    for k in senders:
        ref = k
        if k.startswith("push_iter"):
            ref = "declared, %d MiB buckets" % (int(k.split()[-2]) // 8)
        row = {"bench": "refit-stream", "case": "%dMiB-%dt" % (total >> 20, count), "impl": k,
               "median_ms": med[k] * 1e3, "vs_declared": med[k] / med["declared"],
               "vs_same_buckets": med[k] / med[ref], "parts": statistics.median(parts[k]),
               "reps": reps}
        if as_json:
            print(json.dumps(row), file=out)
        else:
            print("%-28s %8.1f ms  %5.2fx declared  %5.2fx same buckets  (parts %g)"
                  % (k, row["median_ms"], row["vs_declared"], row["vs_same_buckets"],
                     row["parts"]), file=out)
    return med


def main(a: Any) -> None:
    run(reps=a.reps or 5, as_json=a.json)
