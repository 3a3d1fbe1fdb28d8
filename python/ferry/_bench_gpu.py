"""python3 -m ferry.bench gpu: ferry's Python path with torch CUDA tensors against what engines and
trainers do with torch today, in the same run (issue 18's rows that need torch; `ferry bench gpu`
has the C rows and the device-to-device and pinned baselines):

  refit-colo   a bf16 state dict on cuda:0 of this process (the trainer) into an engine process's
               own cuda:0 tensors: ferry.RefitSender -> RefitReceiver.bind (copying receiver),
               against the torch.multiprocessing CUDA IPC path engines use today
               (update_weights_from_tensor: the trainer pickles the tensors with
               ForkingPickler, the engine rebuilds them from the IPC handles and copies them
               into its own), and against a device-to-device copy of the same bytes here;
  routing      an int32 [45, 8192, 8] tensor put from cuda:0 by a producer process and got into a
               cuda:0 tensor here (ferry.Store), against torch.save + torch.load of it
               (map_location cuda:0) and a device-to-device copy; then again with the
               producer's store keeping it in a device pool (Store(device_pool_bytes=), rows
               "(devpool)").

Every row is timed from the caller's side until the bytes are in the destination and the
streams synchronized. Without torch CUDA it prints why and exits 0.
"""
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, List, Optional, TextIO, Tuple

BENCH = "gpu-python"
ROUTING = (45, 8192, 8)
COLS = 4096  # bf16 [rows, 4096] tensors: 8 KiB a row
Rows = List[Tuple[str, str, int, List[float]]]


def _torch_cuda() -> Tuple[Any, str]:
    """(torch, "") when torch with a CUDA device is importable, else (None, why not)."""
    try:
        import torch
    except ImportError as e:
        return None, "torch is not installed (%s)" % e
    try:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch, ""
    except Exception as e:  # a CPU-only build may raise rather than answer
        return None, "torch %s has no CUDA (%s)" % (torch.__version__, e)
    return None, "torch.cuda is not available (torch %s%s)" % (
        torch.__version__, "" if torch.version.cuda else ", built without CUDA")


def _shapes(nbytes: int) -> List[Tuple[int, int]]:
    """bf16 [rows, 4096] shapes of about nbytes/64 each (8 KiB .. 64 MiB), nbytes in all."""
    row = COLS * 2
    each = max(row, min(64 << 20, nbytes // 64 // row * row))
    out, left = [], nbytes // row * row
    while left >= row:
        n = min(each, left)
        out.append((n // row, COLS))
        left -= n
    return out


def _state_dict(torch: Any, shapes: List[Tuple[int, int]]) -> dict:
    """Tensor i holds i + 1 (exact in bf16 up to 256; then it wraps), on cuda:0."""
    return {"layers.%d.weight" % i: torch.full(s, float((i % 250) + 1), dtype=torch.bfloat16,
                                               device="cuda:0")
            for i, s in enumerate(shapes)}


def _holds(torch: Any, dst: dict) -> bool:
    return all(float(t[0, 0]) == (i % 250) + 1 and float(t[-1, -1]) == (i % 250) + 1
               for i, t in enumerate(dst.values()))


# ---- the engine process: a copying receiver of either path ----------------------------------

def _engine_main(mode: str, name: str, shapes_json: str) -> None:
    import torch
    shapes = [tuple(s) for s in json.loads(shapes_json)]
    dst = {"layers.%d.weight" % i: torch.empty(s, dtype=torch.bfloat16, device="cuda:0")
           for i, s in enumerate(shapes)}
    rx = None
    if mode == "ferry":
        import ferry
        rx = ferry.RefitReceiver(name, timeout=60)
        rx.bind(dst)
    print("ready", flush=True)
    for line in sys.stdin:
        line = line.strip()
        if line == "check":
            torch.cuda.synchronize()
            print("ok" if _holds(torch, dst) else "bad", flush=True)
        elif line.startswith("ipc "):  # what update_weights_from_tensor does with the handles
            named = pickle.loads(bytes.fromhex(line[4:]))
            for (n, t) in named:
                dst[n].copy_(t)
            del named
            torch.cuda.synchronize()
            print("ok", flush=True)
        elif line == "":
            break
    if rx is not None:
        rx.close()


def _spawn(*args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "ferry.bench"] + list(args), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    if p.stdout.readline().strip() != "ready":
        p.kill()
        raise SystemExit("ferry bench gpu (python): a helper process did not start")
    return p


def _ask(p: subprocess.Popen, line: str) -> str:
    p.stdin.write(line + "\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


def _stop(p: subprocess.Popen) -> None:
    try:
        p.stdin.close()
        p.wait(timeout=60)
    except Exception:
        p.kill()
        p.wait()


def _run_refit(torch: Any, nbytes: int, reps: int, rows: Rows) -> None:
    import ferry
    from multiprocessing.reduction import ForkingPickler
    import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reductions)
    shapes = _shapes(nbytes)
    total = sum(r * c * 2 for r, c in shapes)
    case = "refit-colo-%dMiB" % (total >> 20)
    sd = _state_dict(torch, shapes)
    flat_src = list(sd.values())
    flat_dst = [torch.empty_like(t) for t in flat_src]
    copy = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for d, s in zip(flat_dst, flat_src):
            d.copy_(s)
        torch.cuda.synchronize()
        if i:
            copy.append(time.perf_counter() - t)
    del flat_dst
    rows.append((case, "d2d-copy", total, copy))

    p = _spawn("_gpu_engine", "ipc", "-", json.dumps(shapes))
    ipc = []
    try:
        for i in range(reps + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            buf = ForkingPickler.dumps(list(sd.items()))
            if _ask(p, "ipc " + bytes(buf).hex()) != "ok":
                raise SystemExit("ferry bench gpu (python): the IPC engine failed")
            if i:
                ipc.append(time.perf_counter() - t)
        if _ask(p, "check") != "ok":
            raise SystemExit("ferry bench gpu (python): the IPC engine's tensors are wrong")
    finally:
        _stop(p)
    rows.append((case, "torch-mp-ipc", total, ipc))

    name = "bench-gpu-py-%d" % os.getpid()
    tx = ferry.RefitSender(name, sd, device_buckets=True)  # device to device through CUDA IPC
    p = _spawn("_gpu_engine", "ferry", name, json.dumps(shapes))
    push = []
    try:
        tx.wait_receivers(1, timeout=60)
        for v in range(1, reps + 2):
            t = time.perf_counter()
            tx.push(v)
            if v > 1:
                push.append(time.perf_counter() - t)
        if _ask(p, "check") != "ok":
            raise SystemExit("ferry bench gpu (python): the ferry engine's tensors are wrong")
    finally:
        _stop(p)
        tx.close()
    rows.append((case, "ferry-copying", total, push))


# ---- routing: a producer process puts from cuda:0, this one gets into cuda:0 ------------------

def _producer_main(directory: str, device_pool_bytes: int = 0) -> None:
    import torch
    import ferry
    s = ferry.Store(directory, name="bench-gpu-producer-%d" % os.getpid(), timeout=30,
                    device_pool_bytes=device_pool_bytes)
    t = torch.empty(ROUTING, dtype=torch.int32, device="cuda:0")
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        t.fill_(int(line))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s.put("routing", t)
        print(repr(time.perf_counter() - t0), flush=True)
    s.close()


def _run_routing(torch: Any, reps: int, rows: Rows) -> None:
    nbytes = 4 * ROUTING[0] * ROUTING[1] * ROUTING[2]
    case = "routing-11MiB"
    src = torch.randint(0, 256, ROUTING, dtype=torch.int32, device="cuda:0")
    dst = torch.empty_like(src)
    copy, save_load = [], []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        if i:
            copy.append(time.perf_counter() - t)
    with tempfile.TemporaryDirectory(prefix="ferry-bench-gpu-") as d:
        path = os.path.join(d, "routing.pt")
        for i in range(reps + 1):
            t = time.perf_counter()
            torch.save(src, path)
            got = torch.load(path, map_location="cuda:0")
            torch.cuda.synchronize()
            if i:
                save_load.append(time.perf_counter() - t)
            del got
    rows.append((case, "d2d-copy", nbytes, copy))
    rows.append((case, "torch.save+load", nbytes, save_load))
    for pool, suffix in ((0, ""), (4 * nbytes, "(devpool)")):
        _ferry_routing(dst, reps, pool, suffix, nbytes, rows)


def _ferry_routing(dst: Any, reps: int, pool: int, suffix: str, nbytes: int,
                   rows: Rows) -> None:
    """A producer process (its store's device pool: pool bytes, 0 none) puts reps + 1 versions,
    each got into dst here; the rows' impls end with suffix."""
    import ferry
    case = "routing-11MiB"
    s = ferry.Store(host_directory=True, name="bench-gpu-consumer-%d" % os.getpid(), timeout=30)
    p = None
    puts, gets, both = [], [], []
    try:
        p = _spawn("_gpu_producer", s.directory, str(pool))
        for i in range(reps + 1):
            tp = float(_ask(p, str(i + 1)))
            t = time.perf_counter()
            s.get("routing", out=dst)
            tg = time.perf_counter() - t
            if int(dst[0, 0, 0]) != i + 1 or int(dst[-1, -1, -1]) != i + 1:
                raise SystemExit("ferry bench gpu (python): routing %d: wrong bytes" % i)
            if i:  # the first get maps the producer's pool
                puts.append(tp)
                gets.append(tg)
                both.append(tp + tg)
    finally:
        if p is not None:
            _stop(p)
        s.close()
    rows += [(case, "ferry-put" + suffix, nbytes, puts),
             (case, "ferry-get" + suffix, nbytes, gets),
             (case, "ferry-put+get" + suffix, nbytes, both)]


# ---- report ----------------------------------------------------------------------------------

def _fmt(s: float) -> str:
    return "%.3f s" % s if s >= 1 else "%.3f ms" % (s * 1e3) if s >= 1e-3 else \
        "%.2f us" % (s * 1e6)


def report(rows: Rows, as_json: bool, out: TextIO = sys.stdout) -> None:
    """The rows (case, impl, bytes, seconds) as a table of medians, the case's first row the
    baseline, or one JSON object per line."""
    if not as_json:
        print("%-16s %-16s %12s %12s %12s %9s %8s" % ("case", "impl", "median", "min", "max",
                                                     "GB/s", "vs base"), file=out)
    base = {}
    for case, impl, nbytes, v in rows:
        if not v:
            continue
        med = statistics.median(v)
        base.setdefault(case, med)
        if as_json:
            print(json.dumps({"bench": BENCH, "case": case, "impl": impl, "bytes": nbytes,
                              "median_s": med, "min_s": min(v), "max_s": max(v),
                              "gbps": nbytes / med / 1e9 if med else 0, "n": len(v)}), file=out)
        else:
            print("%-16s %-16s %12s %12s %12s %9.2f %8.2f" % (
                case, impl, _fmt(med), _fmt(min(v)), _fmt(max(v)), nbytes / med / 1e9,
                base[case] / med), file=out)


def main(args: Any) -> None:
    """Runs the rows (args: json, reps, quick, refit_bytes) or says why it cannot."""
    torch, why = _torch_cuda()
    if torch is None:
        if args.json:
            print(json.dumps({"bench": BENCH, "skipped": True, "detail": why}))
        else:
            print("ferry bench gpu (python): skipped: %s" % why)
        return
    total = torch.cuda.get_device_properties(0).total_memory
    nbytes = args.refit_bytes or ((4 << 20) if args.quick else min(8 << 30, total // 8))
    reps = args.reps or (3 if args.quick else 5)
    if not args.json:
        print("ferry bench gpu (python): cuda:0 %s, torch %s; vs base = base median / row "
              "median" % (torch.cuda.get_device_name(0), torch.__version__))
    rows: Rows = []
    _run_refit(torch, nbytes, reps, rows)
    _run_routing(torch, args.reps or (3 if args.quick else 20), rows)
    report(rows, args.json)


def helper(argv: List[str]) -> Optional[bool]:
    """Runs a helper process's role when argv names one (True), else None."""
    if argv and argv[0] == "_gpu_engine":
        _engine_main(argv[1], argv[2], argv[3])
        return True
    if argv and argv[0] == "_gpu_producer":
        _producer_main(argv[1], int(argv[2]) if len(argv) > 2 else 0)
        return True
    return None
