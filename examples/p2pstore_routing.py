#!/usr/bin/env python3
"""FastDeploy's RoutingStoreRDMA code path on ferry: the engine side below is that class as
FastDeploy writes it (fastdeploy/model_executor/layers/moe/routing_indices_cache.py: P2PConfig
naming the metadata server as zmq://HOST:PORT[,HOST:PORT], clear_store at start, async puts of
per-layer arrays and of fused bytes, clear_prefix_batch through delete_batch), with one changed
import:

    from p2pstore import P2PClient, P2PConfig         ->  from ferry.p2pstore import ...

    python3 examples/p2pstore_routing.py [--requests 4 --layers 4 --tokens 512 --top-k 8]

The trainer (this process) hosts the directory ("the metadata server") and starts the engine as
a second process, both in fleet "rl-job" (FERRY_P2P_FLEET). Another job's key, put in the same
directory beforehand, survives the engine's clear at start. The trainer reads every request's
routing back with its own P2PClient and checks each id, then lets the engine delete the first
request's layers and clear, and checks that this job's keys are gone and the other job's stay.
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

from ferry.p2pstore import P2PClient, P2PConfig  # noqa: E402  (the trainer's client)

EXPERTS = 64
FLEET = "rl-job"


def routing_ids(req, layers, tokens, top_k):
    """What request `req` routed (deterministic, so the trainer can check it)."""
    layer = np.arange(layers, dtype=np.int32)[:, None, None]
    token = np.arange(tokens, dtype=np.int32)[None, :, None]
    k = np.arange(top_k, dtype=np.int32)[None, None, :]
    return ((layer * 131 + token * 7 + k * 13 + req * 29) % EXPERTS).astype(np.int32)


class RoutingStoreRDMA:
    """Routing store as FastDeploy's (fastdeploy/model_executor/layers/moe/routing_indices_cache.py),
    the import being the only change (its timing and logging left out)."""

    def __init__(self, routing_replay_config):
        from ferry.p2pstore import P2PClient, P2PConfig  # was: from p2pstore import ...

        rdma_store_server = routing_replay_config.rdma_store_server
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

    async def clear_prefix_batch(self, routing_prefix_key):
        result = await self.p2p_client.delete_batch([routing_prefix_key])
        return result

    async def clear_store(self):
        result = await self.p2p_client.clear()
        return result


def engine(args):
    class RoutingReplayConfig:  # the one field RoutingStoreRDMA reads
        rdma_store_server = args.directory

    store = RoutingStoreRDMA(RoutingReplayConfig())

    async def record():
        cleared = await store.clear_store()  # StoreProcess.run queues clear_store first
        assert cleared["success"], cleared
        for req in range(args.requests):
            ids = routing_ids(req, args.layers, args.tokens, args.top_k)
            for layer in range(args.layers):  # per layer: [tokens, top_k] arrays
                assert await store.put("req-%d_%d" % (req, layer), ids[layer]) is True
            assert await store.put("req-%d" % req, ids) is True  # fused: [layers, tokens, k]

    asyncio.run(record())
    print("engine: put %d requests" % args.requests, flush=True)
    sys.stdin.readline()  # the trainer has read everything

    async def finish():
        deleted = {}
        for layer in range(args.layers):
            deleted.update(await store.clear_prefix_batch("req-0_%d" % layer))
        return deleted, await store.clear_store()

    deleted, cleared = asyncio.run(finish())
    print("engine: clear_prefix_batch -> %s" % deleted, flush=True)
    assert deleted == {"req-0_%d" % i: True for i in range(args.layers)}, deleted
    print("engine: clear_store -> %s" % cleared, flush=True)
    assert cleared["success"] and cleared["failed"] == [], cleared
    store.p2p_client.close()


def trainer(args):
    with ferry.Store(host_directory=True, name="trainer", timeout=10) as s:
        url = "zmq://" + s.directory[len("ferry://"):]  # the seed's command line's form
        other = P2PClient(P2PConfig(metadata_server=url, fleet="other-job", name="other-job"))
        assert asyncio.run(other.put("req-0_0", np.zeros(4, np.int32))) is True
        env = dict(os.environ, PYTHONUNBUFFERED="1", FERRY_P2P_FLEET=FLEET)
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--engine", url,
                              "--requests", str(args.requests), "--layers", str(args.layers),
                              "--tokens", str(args.tokens), "--top-k", str(args.top_k)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = p.stdout.readline()
        if not line.startswith("engine: put"):
            p.kill()
            sys.exit("trainer: the engine failed: %r" % line)
        client = P2PClient(P2PConfig(metadata_server=url, fleet=FLEET, name="trainer-reader"))
        t0 = time.perf_counter()

        async def read_all():
            for req in range(args.requests):
                want = routing_ids(req, args.layers, args.tokens, args.top_k)
                for layer in range(args.layers):
                    got = await client.get("req-%d_%d" % (req, layer))
                    assert got.dtype == np.int32 and np.array_equal(got, want[layer]), (req, layer)
                fused = await client.get("req-%d" % req)  # put as bytes: uint8, layout known
                got = np.frombuffer(fused, np.int32).reshape(want.shape)
                assert np.array_equal(got, want), req

        asyncio.run(read_all())
        took = time.perf_counter() - t0
        print("trainer: %d requests x %d layers checked in %.1f ms" %
              (args.requests, args.layers, took * 1e3))
        with s.get_view(client.scoped("req-0")) as v:  # a plain Store reads FLEET/key in place
            assert v.nbytes == args.layers * args.tokens * args.top_k * 4
        p.stdin.write("done\n")
        p.stdin.flush()
        for line in p.stdout:
            print(line.rstrip())
        if p.wait(60) != 0:
            sys.exit("trainer: the engine exited with %d" % p.returncode)
        left = client.list()
        assert left == [], left
        assert other.list() == ["req-0_0"], other.list()
        print("trainer: fleet %s is empty, the other job's key is still there; ok" % FLEET)
        client.close()
        other.close()


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
