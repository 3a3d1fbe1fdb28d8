"""Sharded senders from Python (issue 34): trainer ranks that each hold part of one model
(RefitSender(name, sd, rank=r, world=M, pieces=...), with the pieces ferry.tp_pieces,
fsdp_pieces and expert_pieces build) push every version; receivers opened by the one name see
the global model (ranks == M) and get it whole (bind, tensors()) or as their own shards
(tp_shards with the engine's splits), and updates() yields every tensor once the version
committed. The directory the ranks are published in is hosted by this process."""
import os
import threading

import numpy as np
import pytest

import ferry

_n = [0]

HIDDEN, Q, KV, INTER = 16, 16, 8, 32
GLOBAL = {"embed": (32, HIDDEN), "q": (Q, HIDDEN), "k": (KV, HIDDEN), "v": (KV, HIDDEN),
          "o": (HIDDEN, Q), "gate": (INTER, HIDDEN), "up": (INTER, HIDDEN),
          "down": (HIDDEN, INTER), "norm": (HIDDEN,)}
TRAINER_RULES = [(r"^(q|k|v|gate|up)$", 0), (r"^(o|down)$", 1)]
FUSED = {"qkv": ["q", "k", "v"], "gate_up": ["gate", "up"]}
# the engine's own split: everything along dim 1 but the fused column-parallel ones
ENGINE_RULES = [(r"^(q|k|v|gate|up)$", 0), (r"^(o|down|embed)$", 1), (r"^norm$", None)]


def unique(tag):
    _n[0] += 1
    return "pygroup-%d-%s-%d" % (os.getpid(), tag, _n[0])


@pytest.fixture
def directory(monkeypatch):
    """A directory hosted in this process; FERRY_DIRECTORY names it."""
    with ferry.Store(host_directory=True, name=unique("dir")) as st:
        monkeypatch.setenv("FERRY_DIRECTORY", st.directory)
        yield st.directory


def full_model(v):
    g = np.random.default_rng(v)
    return {n: g.standard_normal(s).astype(np.float32) for n, s in GLOBAL.items()}


def tp_local(full, rank, world):
    def cut(name, dim):
        n = full[name].shape[dim] // world
        return np.ascontiguousarray(np.take(full[name], range(rank * n, (rank + 1) * n), axis=dim))
    return {"embed": full["embed"].copy(), "norm": full["norm"].copy(),
            "qkv": np.concatenate([cut("q", 0), cut("k", 0), cut("v", 0)]),
            "gate_up": np.concatenate([cut("gate", 0), cut("up", 0)]),
            "o": cut("o", 1), "down": cut("down", 1)}


class Ranks:
    """M sender ranks in this process (each its own context), holding `layout`'s parts."""

    def __init__(self, name, layout, world):
        self.world, self.layout = world, layout
        self.local = [None] * world  # what each rank's tensors are, updated in place
        self.tx = []
        for r in range(world):
            sd, pieces = self.parts(full_model(0), r)
            self.tx.append(ferry.RefitSender(name, sd, rank=r, world=world, pieces=pieces,
                                             buffer_bytes=4096))

    def parts(self, full, r):
        if self.layout == "tp":
            self.local[r] = tp_local(full, r, self.world)
            return ferry.tp_pieces(self.local[r], r, self.world, TRAINER_RULES, fused=FUSED,
                                   shapes={n: GLOBAL[n] for n in ("q", "k", "v")})
        slices, pieces = ferry.fsdp_pieces(GLOBAL, r, self.world)
        self.local[r] = {n: np.ascontiguousarray(full[n][s]) for n, s in slices.items()}
        return self.local[r], pieces

    def step(self, v):
        """Every rank's tensors become version v's (in place), then every rank pushes v."""
        full = full_model(v)
        for r in range(self.world):
            old = self.local[r]
            self.parts(full, r)
            for n, t in old.items():
                np.copyto(t, self.local[r][n])
            self.local[r] = old
        errs = []

        def push(tx):
            try:
                tx.push(v, timeout=10)
            except Exception as e:  # noqa: BLE001 (reported below)
                errs.append(e)
        threads = [threading.Thread(target=push, args=(tx,)) for tx in self.tx]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errs, errs
        return full

    def close(self):
        for tx in self.tx:
            tx.close()


def engine_rank(rx, rank, world):
    specs = ferry.tp_shards(rx, rank, world, ENGINE_RULES, fused={"qkv": ["q", "k", "v"]})
    mine = {t: np.zeros(shape, dtype=dtype) for t, (shape, dtype, _) in specs.items()}
    rx.bind_shards({t: (mine[t], specs[t][2]) for t in specs})
    return mine


def check_shards(full, shards):
    """Engine ranks' shards (ENGINE_RULES, fused qkv) put together equal the global model."""
    world = len(shards)
    for n, dim in (("o", 1), ("down", 1), ("embed", 1), ("gate", 0), ("up", 0)):
        assert np.array_equal(np.concatenate([s[n] for s in shards], axis=dim), full[n]), n
    q, k = Q // world, KV // world
    assert np.array_equal(np.concatenate([s["qkv"][:q] for s in shards]), full["q"])
    assert np.array_equal(np.concatenate([s["qkv"][q:q + k] for s in shards]), full["k"])
    assert np.array_equal(np.concatenate([s["qkv"][q + k:] for s in shards]), full["v"])
    for s in shards:
        assert np.array_equal(s["norm"], full["norm"])


@pytest.mark.parametrize("layout,world", [("tp", 2), ("fsdp", 3)])
def test_group_to_whole_flat_and_shard_receivers(directory, layout, world):
    name = unique(layout)
    ranks = Ranks(name, layout, world)
    rxs = []
    try:
        whole_rx = ferry.RefitReceiver(name, timeout=10)
        rxs.append(whole_rx)
        assert whole_rx.ranks == world
        man = {m["name"]: (tuple(m["shape"]), m["dtype"]) for m in whole_rx.manifest()}
        assert man == {n: (s, "float32") for n, s in GLOBAL.items()}
        whole = {n: np.zeros(s, np.float32) for n, s in GLOBAL.items()}
        whole_rx.bind(whole)
        flat_rx = ferry.RefitReceiver(name, timeout=10)
        rxs.append(flat_rx)
        views = flat_rx.tensors(like="numpy")
        shard_rxs = [ferry.RefitReceiver(name, timeout=10) for _ in range(2)]
        rxs += shard_rxs
        shards = [engine_rank(rx, r, 2) for r, rx in enumerate(shard_rxs)]
        for tx in ranks.tx:
            tx.wait_receivers(len(rxs), timeout=10)
        for v in (1, 2):
            its = [rx.updates(v, like="numpy", timeout=10) for rx in (whole_rx, flat_rx)]
            full = ranks.step(v)
            for rx in rxs:
                assert rx.wait(v, timeout=10) == v
                assert rx.committed == v
            for n, t in full.items():
                assert np.array_equal(whole[n], t), (v, n)
                assert np.array_equal(views[n], t), (v, n)
            check_shards(full, shards)
            for it in its:  # a group's updates(): every tensor, once committed
                got = dict(it)
                assert it.version == v and sorted(got) == sorted(GLOBAL)
                for n, t in full.items():
                    assert np.array_equal(got[n], t), (v, n)
        # an engine rank reads about its share, straight from the ranks
        model = sum(t.nbytes for t in full_model(0).values())
        for rx in shard_rxs:
            assert rx.bytes_read < 2 * 0.75 * model, (rx.bytes_read, model)
    finally:
        for rx in rxs:
            rx.close()
        ranks.close()


def test_expert_ranks_to_one_receiver(directory):
    """Experts held by their owners (global names and Megatron's local indices alike): the
    receiver sees every expert once and the replicated router."""
    name = unique("ep")
    world, num = 2, 4
    full = {"router": np.arange(num * 4, dtype=np.float32).reshape(num, 4)}
    for e in range(num):
        full["experts.%d.w" % e] = np.full((3, 4), e, np.float32)
    txs = []
    try:
        for r in range(world):
            local = {"router": full["router"].copy()}
            for i in range(num // world):  # Megatron's local_experts.i of rank r
                local["experts.%d.w" % i] = full["experts.%d.w" % (r * num // world + i)].copy()
            sd, pieces = ferry.expert_pieces(local, r, world, r"experts\.(\d+)\.", num,
                                             local_index=True)
            txs.append(ferry.RefitSender(name, sd, rank=r, world=world, pieces=pieces))
        with ferry.RefitReceiver(name, timeout=10) as rx:
            views = rx.tensors(like="numpy")
            assert sorted(views) == sorted(full)
            threads = [threading.Thread(target=tx.push, args=(1,)) for tx in txs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert rx.wait(1, timeout=10) == 1
            for n, t in full.items():
                assert np.array_equal(views[n], t), n
    finally:
        for tx in txs:
            tx.close()


def test_receiver_refuses_ranks_that_do_not_tile(directory):
    """Pieces that overlap: the receiver's open fails, naming the tensor and the ranks."""
    name = unique("overlap")
    w = np.zeros((4, 2), np.float32)
    txs = [ferry.RefitSender(name, {"w": w[:3]}, rank=0, world=2,
                             pieces={"w": ferry.Piece("w", 0, 0, 3)}),
           ferry.RefitSender(name, {"w": w[2:]}, rank=1, world=2,
                             pieces={"w": ferry.Piece("w", 0, 2, 4)})]
    try:
        with pytest.raises(ferry.Error) as e:
            ferry.RefitReceiver(name, timeout=5)
        msg = str(e.value)
        assert "'w'" in msg and "rank 0" in msg and "rank 1" in msg, msg
    finally:
        for tx in txs:
            tx.close()


def test_late_receiver_catches_up_from_every_rank(directory):
    """A receiver that opens after version 2 was pushed gets it at once from every rank's
    retained buffer, with no push: wait() and updates() return version 2."""
    name = unique("late")
    ranks = Ranks(name, "fsdp", 2)
    try:
        ranks.step(1)
        full = ranks.step(2)
        with ferry.RefitReceiver(name, timeout=10) as rx:
            views = rx.tensors(like="numpy")
            assert rx.wait(timeout=10) == 2
            for n, t in full.items():
                assert np.array_equal(views[n], t), n
        with ferry.RefitReceiver(name, timeout=10) as rx:
            it = rx.updates(1, like="numpy", timeout=10)
            got = dict(it)
            assert it.version == 2 and sorted(got) == sorted(GLOBAL)
            for n, t in full.items():
                assert np.array_equal(got[n], t), n
    finally:
        ranks.close()


_RANK1 = r"""
import sys
import numpy as np
import ferry
name = sys.argv[1]
w = np.zeros((4, 8), np.float32)
with ferry.RefitSender(name, {"w": w}, rank=1, world=2,
                       pieces={"w": ferry.Piece("w", 0, 4, 8)}) as tx:
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, v = line.split()
        if cmd == "receivers":
            tx.wait_receivers(int(v), timeout=10)
        else:
            w[:] = int(v)
            tx.push(int(v), timeout=10)
        print("ok", flush=True)
"""


def test_rank_killed_then_restarted(directory, tmp_path):
    """Rank 1 (another process) SIGKILLed while version 2 lands from rank 0: updates(2) raises
    naming rank 1 and committed() is 0; a new rank 1 process comes back, the receiver takes it
    back, and version 3 commits with both ranks' bytes."""
    import signal
    import subprocess
    import sys
    name = unique("kill")
    script = tmp_path / "rank1.py"
    script.write_text(_RANK1)

    def rank1():
        p = subprocess.Popen([sys.executable, str(script), name], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=os.path.dirname(
                                 os.path.dirname(ferry.__file__))))
        assert p.stdout.readline().strip() == "ready"
        return p

    def ask(p, line):
        p.stdin.write(line + "\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "ok", line

    w0 = np.zeros((4, 8), np.float32)
    procs = [rank1()]
    with ferry.RefitSender(name, {"w": w0}, rank=0, world=2,
                           pieces={"w": ferry.Piece("w", 0, 0, 4)}) as tx:
        try:
            with ferry.RefitReceiver(name, timeout=10) as rx:
                views = rx.tensors(like="numpy")
                tx.wait_receivers(1, timeout=10)
                ask(procs[0], "receivers 1")
                w0[:] = 1
                tx.push(1, timeout=10)
                ask(procs[0], "push 1")
                assert rx.wait(1, timeout=10) == 1 and (views["w"] == 1).all()
                it = rx.updates(2, like="numpy", timeout=10)
                w0[:] = 2
                tx.push(2, timeout=10)  # rank 0's part of version 2 is in
                procs[0].kill()
                procs[0].wait()
                assert procs[0].returncode == -signal.SIGKILL
                with pytest.raises(ferry.Error, match=r"rank 1 \(%s#1\)" % name):
                    list(it)
                assert rx.committed == 0  # rank 0's part is of version 2, rank 1's of 1
                procs.append(rank1())  # the same rank and declaration, a new process
                ask(procs[1], "receivers 1")
                w0[:] = 3
                threads = [threading.Thread(target=tx.push, args=(3,), kwargs={"timeout": 10})]
                threads[0].start()
                ask(procs[1], "push 3")
                threads[0].join()
                assert rx.wait(3, timeout=10) == 3
                assert (views["w"] == 3).all()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
