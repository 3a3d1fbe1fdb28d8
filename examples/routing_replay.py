#!/usr/bin/env python3
"""Routing replay with ferry.Store: a rollout engine records, per generated token, which experts
every MoE layer chose ([layers, tokens, top_k] uint8) and puts one tensor per request; the
trainer gets them to replay exactly that routing, and checks every id.

    python3 examples/routing_replay.py [--requests 8 --layers 4 --tokens 2048 --top-k 8]

The trainer (this process) hosts the fleet's directory and starts the engine as a second
process. The engine writes its ids straight into ferry memory (ferry.empty), so each put
publishes them in place: nothing is copied until the trainer's get reads them from the
engine's pages (one memcpy on one host).
"""
import argparse
import os
import subprocess
import sys
import time

import numpy as np

try:
    import ferry
except ImportError:  # run from a checkout: use its python/ folder
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import ferry

EXPERTS = 64


def routing_ids(req, layers, tokens, top_k):
    """What request `req` routed (deterministic, so the trainer can check it)."""
    layer = np.arange(layers, dtype=np.uint32)[:, None, None]
    token = np.arange(tokens, dtype=np.uint32)[None, :, None]
    k = np.arange(top_k, dtype=np.uint32)[None, None, :]
    return ((layer * 131 + token * 7 + k * 13 + req * 29) % EXPERTS).astype(np.uint8)


def engine(args):
    s = ferry.Store(args.directory, name="rollout-engine-%d" % os.getpid(), timeout=10)
    bufs = []
    for req in range(args.requests):
        # The engine's own buffer in ferry shared memory: the put is zero-copy.
        ids = s.empty((args.layers, args.tokens, args.top_k), np.uint8)
        ids[...] = routing_ids(req, args.layers, args.tokens, args.top_k)
        s.put("replay/step0/req%d" % req, ids)
        bufs.append(ids)  # published in place: keep it alive and unmodified
    s.put("replay/step0/done", np.array([args.requests], np.int64))
    sys.stdin.readline()  # until the trainer is done with them
    s.close()


def trainer(args):
    with ferry.Store(host_directory=True, name="trainer", timeout=10) as s:
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "engine",
               "--directory", s.directory, "--requests", str(args.requests), "--layers",
               str(args.layers), "--tokens", str(args.tokens), "--top-k", str(args.top_k)]
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(ferry.__file__)))
        eng = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
        try:
            deadline = time.monotonic() + 30
            while not s.exists("replay/step0/done"):
                if eng.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("routing_replay: the engine never finished its puts")
                time.sleep(0.01)
            keys = s.list("replay/step0/req")
            assert len(keys) == args.requests, keys
            t0 = time.perf_counter()
            got = s.get_batch(keys)
            dt = time.perf_counter() - t0
            for key, ids in zip(keys, got):
                req = int(key.rsplit("req", 1)[1])
                assert ids.dtype == np.uint8 and ids.shape == (args.layers, args.tokens,
                                                                args.top_k), key
                assert np.array_equal(ids, routing_ids(req, args.layers, args.tokens,
                                                       args.top_k)), key
            owner = s.stat(keys[0])["owner"]
            # one as a torch tensor too, read into a buffer the trainer reuses
            if "torch" in sys.modules or args.torch:
                import torch
                out = torch.empty((args.layers, args.tokens, args.top_k), dtype=torch.uint8)
                s.get(keys[0], out=out)
                assert torch.equal(out, torch.from_numpy(routing_ids(0, args.layers,
                                                                     args.tokens, args.top_k)))
            mib = sum(g.nbytes for g in got) / 2**20
            print("routing_replay: %d requests of [%d, %d, %d] uint8 from '%s' verified "
                  "(%.1f MiB, get_batch %.1f ms)" % (len(keys), args.layers, args.tokens,
                                                     args.top_k, owner, mib, dt * 1e3))
            assert s.delete_prefix("replay/step0/") == args.requests + 1
        finally:
            eng.stdin.close()
            eng.wait(timeout=30)
    if eng.returncode != 0:
        raise SystemExit("routing_replay: the engine exited with %d" % eng.returncode)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=("trainer", "engine"), default="trainer")
    p.add_argument("--directory")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--torch", action="store_true", help="also get one as a torch tensor")
    args = p.parse_args()
    (engine if args.role == "engine" else trainer)(args)


if __name__ == "__main__":
    main()
