"""python3 -m ferry.bench store: the routing-replay workload of `ferry bench store`, from Python.
(python3 -m ferry.bench gpu: torch CUDA tensors through ferry against torch's own paths, in
ferry/_bench_gpu.py; python3 -m ferry.bench r3: routing replay with every key new, in
ferry/_bench_r3.py; python3 -m ferry.bench stream: refit push_iter against a declared push, in
ferry/_bench_stream.py.)

Per request one [45, 32768, 8] uint8 tensor (11.25 MiB), 37 requests. Three processes, as in
the C bench: the embedded directory, a producer that writes each request into a ring of 4
buffers in ferry memory (ferry.empty) and puts it, and this process, which gets it into a warm
buffer. Each step is timed twice in the same run, through the Python wrapper (ferry.Store) and
through the C API called directly (ctypes with prebuilt arguments, no wrapper code): separate
rings and keys, so neither gets the other's warm cache or directory lookup. Baselines in the
same run: a memcpy of the same bytes (np.copyto between warm buffers), np.save/np.load and
torch.save/torch.load to local files. "b2b" rows: 200 puts back to back after the requests (no
fill, no idle wait between them: what is left is the call itself). Then the targets of issue 6:

    Python get <= 1.2x the C get (11 MiB)          Python zero-copy put median <= 50 us

    python3 -m ferry.bench store [--json] [--reps N] [--no-baselines] [--cli PATH]

--cli PATH also runs `PATH bench store --json --no-baselines` (the C bench, its own processes)
and reports its routing get beside ours.
"""
import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, TextIO, Tuple

import numpy as np

SHAPE = (45, 32768, 8)
NBYTES = 45 * 32768 * 8
RING = 4
BENCH = "store-python"


def _fill(buf, i):
    buf.fill(i & 0xFF)


# ---- helper processes ------------------------------------------------------------------------

def _directory_main():
    import ferry
    s = ferry.Store(host_directory=True, name="bench-directory-%d" % os.getpid())
    print(s.directory, flush=True)
    sys.stdin.readline()
    s.close()


def _producer_main(directory, reps):
    import ferry
    from ferry import _lib
    s = ferry.Store(directory, name="bench-producer-%d" % os.getpid(), timeout=30)
    ring_py = [s.empty(SHAPE, np.uint8) for _ in range(RING)]
    ring_c = [s.empty(SHAPE, np.uint8) for _ in range(RING)]
    plain = np.zeros(SHAPE, np.uint8)  # not ferry memory: a put copies it into the pool
    desc = _lib.TensorDesc()
    desc.dtype, desc.ndim = 2, 3
    for d, n in enumerate(SHAPE):
        desc.shape[d] = n
    put_c = _lib.lib.ferry_store_put
    h, pdesc = s.handle, ctypes.byref(desc)
    t_py, t_c, t_copy = [], [], []
    clock = time.perf_counter
    for i in range(reps):
        if i >= RING:
            s.delete("routing/%d" % (i - RING))
            s.delete("routing-c/%d" % (i - RING))
        a, b = ring_py[i % RING], ring_c[i % RING]
        _fill(a, i)
        _fill(b, i)
        key_py, key_c = "routing/%d" % i, b"routing-c/%d" % i
        ptr_c = b.ctypes.data
        # alternate which goes first, so neither always follows the other's wake-ups
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            if which == 0:
                t = clock()
                s.put(key_py, a)
                t_py.append(clock() - t)
            else:
                t = clock()
                rc = put_c(h, key_c, pdesc, ptr_c, 0, -1)
                t_c.append(clock() - t)
                if rc != 0:
                    raise SystemExit("producer: C put failed: %d" % rc)
        _fill(plain, i)
        t = clock()
        s.put("copy/%d" % i, plain)
        t_copy.append(clock() - t)
        s.delete("copy/%d" % i)
        print("put %d" % i, flush=True)
        if sys.stdin.readline().strip() != "ok":
            break
    # Back to back (an engine finishing many requests at once): the same puts without the
    # 22 MiB fill and the idle wait between them, so no wake-ups and warm caches.
    b_py, b_c = [], []
    a, b = ring_py[0], ring_c[0]
    ptr_c = b.ctypes.data
    for i in range(200):
        t = clock()
        s.put("b2b/%d" % (i % RING), a)
        b_py.append(clock() - t)
        t = clock()
        put_c(h, b"b2b-c/%d" % (i % RING), pdesc, ptr_c, 0, -1)
        b_c.append(clock() - t)
    print(json.dumps({"put_py": t_py, "put_c": t_c, "put_copy": t_copy, "b2b_py": b_py,
                      "b2b_c": b_c}), flush=True)
    sys.stdin.readline()
    s.close()


def _spawn(*args):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "ferry.bench"] + list(args), env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


# ---- the consumer (this process) -------------------------------------------------------------

def _run_ferry(reps, rows):
    import ferry
    from ferry import _lib
    d = _spawn("_directory")
    p = None
    try:
        url = d.stdout.readline().strip()
        if not url.startswith("ferry://"):
            raise SystemExit("ferry bench store (python): the directory did not start")
        p = _spawn("_producer", url, str(reps))
        s = ferry.Store(url, name="bench-consumer-%d" % os.getpid(), timeout=30)
        dst_py = np.zeros(SHAPE, np.uint8)
        dst_c = np.zeros(SHAPE, np.uint8)
        src_m = np.ones(SHAPE, np.uint8)
        dst_m = np.zeros(SHAPE, np.uint8)
        get_c = _lib.lib.ferry_store_get
        h, ptr_c = s.handle, dst_c.ctypes.data
        t_py, t_c, t_new, t_mem = [], [], [], []
        clock = time.perf_counter
        for i in range(reps):
            line = p.stdout.readline().split()
            if line != ["put", str(i)]:
                raise SystemExit("ferry bench store (python): producer said %r" % (line,))
            key_py, key_c = "routing/%d" % i, b"routing-c/%d" % i
            for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                if which == 0:
                    t = clock()
                    s.get(key_py, out=dst_py)
                    t_py.append(clock() - t)
                else:
                    t = clock()
                    rc = get_c(h, key_c, None, ptr_c, NBYTES, None, -1)
                    t_c.append(clock() - t)
                    if rc != 0:
                        raise SystemExit("ferry bench store (python): C get failed: %d" % rc)
            if dst_py[44, -1, 7] != (i & 0xFF) or dst_c[0, 0, 0] != (i & 0xFF):
                raise SystemExit("ferry bench store (python): request %d: wrong bytes" % i)
            t = clock()
            arr = s.get(key_py)  # a new array each time (what most callers write)
            t_new.append(clock() - t)
            del arr
            t = clock()
            np.copyto(dst_m, src_m)
            t_mem.append(clock() - t)
            p.stdin.write("ok\n")
            p.stdin.flush()
        puts = json.loads(p.stdout.readline())
        s.close()
        rows += [("routing/put", "ferry(in place)", puts["put_py"]),
                 ("routing/put", "C(in place)", puts["put_c"]),
                 ("routing/put", "ferry(copy)", puts["put_copy"]),
                 ("routing/put", "ferry(b2b)", puts["b2b_py"]),
                 ("routing/put", "C(b2b)", puts["b2b_c"]),
                 ("routing/get", "memcpy", t_mem),
                 ("routing/get", "ferry", t_py),
                 ("routing/get", "C", t_c),
                 ("routing/get", "ferry(new)", t_new)]
    finally:
        for proc in (p, d):
            if proc is None:
                continue
            try:
                proc.stdin.write("\n")
                proc.stdin.close()
                proc.wait(timeout=30)
            except Exception:
                proc.kill()
                proc.wait()


def _run_files(reps, rows):
    arr = np.random.default_rng(0).integers(0, 256, size=SHAPE, dtype=np.uint8)
    d = tempfile.mkdtemp(prefix="ferry-bench-py-")
    try:
        kinds = [("np", np.save, np.load, ".npy", arr)]
        try:
            import torch
            kinds.append(("torch", lambda p, t: torch.save(t, p), torch.load, ".pt",
                          torch.from_numpy(arr)))
        except ImportError as e:
            print("ferry bench store (python): torch baseline skipped: %s" % e, file=sys.stderr)
        for name, save, load, ext, obj in kinds:
            ts, tl = [], []
            for i in range(reps):
                path = os.path.join(d, "routing-%d%s" % (i, ext))
                t = time.perf_counter()
                save(path, obj)
                ts.append(time.perf_counter() - t)
                t = time.perf_counter()
                load(path)
                tl.append(time.perf_counter() - t)
                os.unlink(path)
            rows += [("routing/put", name + ".save", ts), ("routing/get", name + ".load", tl)]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _run_cli(path, rows):
    out = subprocess.run([path, "bench", "store", "--json", "--no-baselines"],
                         capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        try:
            o = json.loads(line)
        except ValueError:
            continue
        if o.get("case") == "routing/get" and o.get("impl") == "ferry":
            rows.append(("routing/get", "ferry CLI (C)", [o["median_s"]]))
            return
    print("ferry bench store (python): no routing/get row from %s:\n%s" % (path, out.stderr),
          file=sys.stderr)


# ---- report ----------------------------------------------------------------------------------

def _fmt(s):
    return "%.3f ms" % (s * 1e3) if s >= 1e-3 else "%.2f us" % (s * 1e6)


def _median(rows, case, impl):
    for c, i, v in rows:
        if c == case and i == impl and v:
            return statistics.median(v)
    return 0.0


ORDER = [("routing/put", "np.save"), ("routing/put", "torch.save"),
         ("routing/put", "ferry(copy)"), ("routing/put", "ferry(in place)"),
         ("routing/put", "C(in place)"), ("routing/put", "ferry(b2b)"),
         ("routing/put", "C(b2b)"), ("routing/get", "memcpy"), ("routing/get", "C"),
         ("routing/get", "ferry"), ("routing/get", "ferry(new)"), ("routing/get", "np.load"),
         ("routing/get", "torch.load"), ("routing/get", "ferry CLI (C)")]


def report(rows: List[Tuple[str, str, float]], as_json: bool, out: TextIO = sys.stdout) -> None:
    """Prints the routing replay's rows (case, impl, seconds): a table of medians, or one JSON
    object per line, then the targets of issue 6 and the ratios."""
    by = {(c, i): v for c, i, v in rows}
    if not as_json:
        print("ferry bench store --python (per-request medians; vs base = base median / row "
              "median)", file=out)
        print("%-13s %-15s %12s %12s %12s %9s %8s" % ("case", "impl", "median", "min", "max",
                                                    "GB/s", "vs base"), file=out)
    base = {}
    for case, impl in ORDER:
        v = by.get((case, impl))
        if not v:
            continue
        med = statistics.median(v)
        base.setdefault(case, med)
        if as_json:
            print(json.dumps({"bench": BENCH, "case": case, "impl": impl, "bytes": NBYTES,
                              "median_s": med, "min_s": min(v), "max_s": max(v),
                              "gbps": NBYTES / med / 1e9 if med else 0, "n": len(v)}), file=out)
        else:
            print("%-13s %-15s %12s %12s %12s %9.2f %8.2f" % (
                case, impl, _fmt(med), _fmt(min(v)), _fmt(max(v)), NBYTES / med / 1e9,
                base[case] / med), file=out)
    targets = []
    g_py, g_c = _median(rows, "routing/get", "ferry"), _median(rows, "routing/get", "C")
    if g_py and g_c:
        targets.append(("python get / C get <= 1.2 (11 MiB)", g_py / g_c, g_py / g_c <= 1.2, "x"))
    p_py = _median(rows, "routing/put", "ferry(in place)")
    if p_py:
        targets.append(("python zero-copy put median <= 50 us", p_py * 1e6, p_py <= 50e-6, "us"))
    info = []
    p_c = _median(rows, "routing/put", "C(in place)")
    if p_c:
        info.append(("C in-place put median (the floor)", p_c * 1e6, "us"))
    b_py, b_c = _median(rows, "routing/put", "ferry(b2b)"), _median(rows, "routing/put", "C(b2b)")
    if b_py:
        info.append(("python in-place put, back to back", b_py * 1e6, "us"))
    if b_py and b_c:
        info.append(("python put - C put, back to back (wrapper)", (b_py - b_c) * 1e6, "us"))
    if g_py and g_c:
        info.append(("python get - C get (wrapper cost)", (g_py - g_c) * 1e6, "us"))
    cli = _median(rows, "routing/get", "ferry CLI (C)")
    if cli and g_py:
        info.append(("python get / ferry bench store's get", g_py / cli, "x"))
    for a, b in (("np.load", "ferry"), ("torch.load", "ferry")):
        x = _median(rows, "routing/get", a)
        if x and g_py:
            info.append(("%s / python get" % a, x / g_py, "x"))
    for a in ("np.save", "torch.save"):
        x = _median(rows, "routing/put", a)
        if x and p_py:
            info.append(("%s / python in-place put" % a, x / p_py, "x"))
    if as_json:
        for name, value, met, _ in targets:
            print(json.dumps({"bench": BENCH, "target": name, "value": value, "met": met}),
                  file=out)
        for name, value, _ in info:
            print(json.dumps({"bench": BENCH, "ratio": name, "value": value}), file=out)
        return
    print("\ntargets (issue 6)", file=out)
    for name, value, met, unit in targets:
        print("  %-46s %10.2f %-3s %s" % (name, value, unit, "met" if met else "NOT met"),
              file=out)
    print("\nalso", file=out)
    for name, value, unit in info:
        print(("  %-46s %10.2f %s" % (name, value, unit)).rstrip(), file=out)


def view_bench(mib: int = 11, reps: int = 50, out: TextIO = sys.stdout) -> Dict[str, float]:
    """Store.get_view vs Store.get vs np.load (page cache) of one `mib` MiB array, same host,
    and the C view (ferry_store_get_view + release through ctypes with prebuilt arguments: the
    floor under the wrapper), interleaved in each of `reps` rounds: the median seconds of each
    and the ratio np.load / get_view."""
    import tempfile
    import time
    from . import _lib
    from .store import Store
    arr = np.arange((mib << 20) // 4, dtype=np.int32)
    times: Dict[str, List[float]] = {"get_view": [], "C view": [], "get": [], "np.load": []}
    with Store(host_directory=True, name="bench-view-owner", timeout=10) as owner, \
            Store(owner.directory, name="bench-view-reader", timeout=10) as reader, \
            tempfile.TemporaryDirectory() as d:
        owner.put("r", arr)
        path = os.path.join(d, "r.npy")
        np.save(path, arr)
        np.load(path)  # in the page cache from here on
        lib, h, byref = _lib.lib, reader.handle, ctypes.byref
        info = _lib.StoreInfo()
        info.size = ctypes.sizeof(info)
        data, view = ctypes.c_void_p(), ctypes.c_void_p()
        args = (h, b"r", byref(data), byref(info), byref(view), 10000)
        for _ in range(reps):
            t = time.perf_counter()
            with reader.get_view("r") as v:
                v[-1]
            times["get_view"].append(time.perf_counter() - t)
            t = time.perf_counter()
            rc = lib.ferry_store_get_view(*args)
            lib.ferry_store_view_release(view)
            times["C view"].append(time.perf_counter() - t)
            if rc != 0:
                raise RuntimeError("ferry_store_get_view: %d" % rc)
            t = time.perf_counter()
            reader.get("r")
            times["get"].append(time.perf_counter() - t)
            t = time.perf_counter()
            np.load(path)
            times["np.load"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print("store view of %d MiB from another node on this host (median of %d):" % (mib, reps),
          file=out)
    for k, v in med.items():
        print("  %-10s %10.1f us" % (k, v * 1e6), file=out)
    print("  np.load / get_view: %.0fx" % (med["np.load"] / med["get_view"]), file=out)
    return med


def main(argv: Optional[List[str]] = None) -> None:
    """python3 -m ferry.bench store|view [options] (see --help)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_directory":
        return _directory_main()
    if argv and argv[0] == "_producer":
        return _producer_main(argv[1], int(argv[2]))
    if argv and argv[0] == "_r3_engine":
        from . import _bench_r3
        return _bench_r3.engine_main(argv[1], int(argv[2]))
    from . import _bench_gpu
    if _bench_gpu.helper(argv):
        return None
    p = argparse.ArgumentParser(prog="python3 -m ferry.bench",
                                description="ferry benchmarks from Python (the store's routing "
                                            "replay workload against np/torch files and the C "
                                            "API)")
    p.add_argument("what", choices=["store", "view", "gpu", "r3", "stream"],
                   help="store: the routing replay workload; r3: the same as FastDeploy runs it, "
                        "every key new (a new buffer per request, each key got once and "
                        "deleted); view: get_view vs get vs np.load; "
                        "gpu: torch CUDA tensors through refit and the store vs torch's CUDA "
                        "IPC and torch.save/load (needs torch with CUDA); stream: refit "
                        "push_iter of 256 MiB in 1,000 tensors vs a declared push")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--reps", type=int, default=None,
                   help="requests (store; default 37) or reads of each kind (view; default 50)")
    p.add_argument("--no-baselines", action="store_true", help="skip np/torch files")
    p.add_argument("--cli", metavar="PATH", help="also run PATH bench store --json")
    p.add_argument("--quick", action="store_true", help="gpu: small sizes, 3 repetitions")
    p.add_argument("--refit-bytes", type=int, default=0,
                   help="gpu: the state dict's bytes (default min(8 GiB, device memory / 8))")
    a = p.parse_args(argv)
    if a.what == "gpu":
        _bench_gpu.main(a)
        return
    if a.what == "stream":
        from . import _bench_stream
        _bench_stream.main(a)
        return
    if a.what == "view":
        view_bench(reps=a.reps or 50)
        return
    if a.what == "r3":
        from . import _bench_r3
        _bench_r3.run(a.reps or 37, not a.no_baselines, a.json, _spawn)
        return
    reps = a.reps or 37
    rows: List[Tuple[str, str, float]] = []
    _run_ferry(reps, rows)
    if not a.no_baselines:
        _run_files(reps, rows)
    if a.cli:
        _run_cli(a.cli, rows)
    report(rows, a.json)


if __name__ == "__main__":
    main()
