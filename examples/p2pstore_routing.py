#!/usr/bin/env python3
"""FastDeploy's RoutingStoreRDMA code path on ferry: the engine side below is that class as
FastDeploy writes it (P2PConfig naming the metadata server, async puts of per-layer arrays and of
fused bytes, clear_prefix_batch, clear_store), with one changed import:

    from p2pstore import P2PClient, P2PConfig         ->  from ferry.p2pstore import ...

    python3 examples/p2pstore_routing.py [--requests 4 --layers 4 --tokens 512 --top-k 8]

The trainer (this process) hosts the directory ("the metadata server") and starts the engine as
a second process; it reads every request's routing back with ferry.Store and checks each id,
then lets the engine delete by prefix and clear, and checks that the keys are gone.
"""
import argparse
import asyncio
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
    layer = np.arange(layers, dtype=np.int32)[:, None, None]
    token = np.arange(tokens, dtype=np.int32)[None, :, None]
    k = np.arange(top_k, dtype=np.int32)[None, None, :]
    return ((layer * 131 + token * 7 + k * 13 + req * 29) % EXPERTS).astype(np.int32)


class RoutingStoreRDMA:
    """Routing store as FastDeploy's (fastdeploy/model_executor/layers/moe/routing_indices_cache.py),
    the import being the only change."""

    def __init__(self, rdma_store_server):
        from ferry.p2pstore import P2PClient, P2PConfig  # was: from p2pstore import ...

        p2pConfig = P2PConfig(metadata_server=rdma_store_server)
        self.p2p_client = P2PClient(p2pConfig)

    async def put(self, routing_key, routing_indices):
        if len(routing_indices.shape) == 3:
            # fused put with bytes data
            routing_bytes = routing_indices.tobytes()
            result = await self.p2p_client.put(routing_key, routing_bytes)
        else:
            result = await self.p2p_client.put(routing_key, routing_indices)
        return result

    async def clear_prefix_batch(self, roullout_id_prefixes):
        return await self.p2p_client.delete_prefix_batch(roullout_id_prefixes)

    async def clear_store(self):
        return await self.p2p_client.clear()


def engine(args):
    store = RoutingStoreRDMA(args.directory)

    async def record():
        for req in range(args.requests):
            ids = routing_ids(req, args.layers, args.tokens, args.top_k)
            for layer in range(args.layers):  # per layer: [tokens, top_k] arrays
                assert await store.put("req-%d_%d" % (req, layer), ids[layer]) is True
            assert await store.put("req-%d" % req, ids) is True  # fused: [layers, tokens, k]

    asyncio.run(record())
    print("engine: put %d requests" % args.requests, flush=True)
    sys.stdin.readline()  # the trainer has read everything
    deleted = asyncio.run(store.clear_prefix_batch(["req-0_", "req-1_"]))
    print("engine: clear_prefix_batch -> %s" % deleted, flush=True)
    assert deleted == {"req-0_": args.layers, "req-1_": args.layers}, deleted
    # sync call sites (FastDeploy's clear_store) run the coroutine with asyncio.run
    cleared = asyncio.run(store.clear_store())
    print("engine: clear_store -> %s" % cleared, flush=True)
    assert cleared["success"], cleared
    store.p2p_client.close()


def trainer(args):
    with ferry.Store(host_directory=True, name="trainer", timeout=10) as s:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--engine", s.directory,
                              "--requests", str(args.requests), "--layers", str(args.layers),
                              "--tokens", str(args.tokens), "--top-k", str(args.top_k)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = p.stdout.readline()
        if not line.startswith("engine: put"):
            p.kill()
            sys.exit("trainer: the engine failed: %r" % line)
        t0 = time.perf_counter()
        for req in range(args.requests):
            want = routing_ids(req, args.layers, args.tokens, args.top_k)
            for layer in range(args.layers):
                got = s.get("req-%d_%d" % (req, layer))
                assert got.dtype == np.int32 and np.array_equal(got, want[layer]), (req, layer)
            fused = s.get("req-%d" % req, like=bytes)  # put as bytes: the trainer knows the layout
            got = np.frombuffer(fused, np.int32).reshape(want.shape)
            assert np.array_equal(got, want), req
            with s.get_view("req-%d" % req) as v:  # the same bytes, read in place
                assert np.array_equal(v.view(np.int32).reshape(want.shape), want)
        took = time.perf_counter() - t0
        print("trainer: %d requests x %d layers checked in %.1f ms" %
              (args.requests, args.layers, took * 1e3))
        p.stdin.write("done\n")
        p.stdin.flush()
        for line in p.stdout:
            print(line.rstrip())
        if p.wait(60) != 0:
            sys.exit("trainer: the engine exited with %d" % p.returncode)
        left = s.list()
        assert left == [], left
        print("trainer: the fleet is empty; ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--engine", metavar="DIRECTORY", dest="directory", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.directory:
        engine(args)
    else:
        trainer(args)


if __name__ == "__main__":
    main()
