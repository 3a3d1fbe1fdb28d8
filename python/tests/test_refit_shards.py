"""Shards: tensor-parallel ranks built by ferry.tp_shards bind their slices with bind_shards (dim 0,
dim 1, a fused qkv, a replicated norm), over shm and tcp; put together the slices equal the
sender's tensors, each rank reads exactly its slices' bytes (at most 1/world of the sharded model
plus the replicated tensor), late ranks catch up the same way, ranks load their slices through
updates() as they land, and a piece that does not fit is a clear error."""
import ctypes
import os
import threading

import numpy as np
import pytest

import ferry

_n = [0]

RULES = [(r"^(q|k|v|up)$", 0), (r"^(o|down)$", 1), (r"^norm$", None)]
FUSED = {"qkv": ["q", "k", "v"]}


def unique(tag):
    _n[0] += 1
    return "pyshards-%d-%s-%d" % (os.getpid(), tag, _n[0])


def model(seed=0):
    g = np.random.default_rng(seed)
    shapes = {"q": (64, 32), "k": (32, 32), "v": (32, 32), "o": (32, 64), "up": (128, 32),
              "down": (32, 128), "norm": (32,)}
    return {n: g.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def open_rank(name, rank, world, transports):
    ctx = ferry.Context(name="%s-r%d" % (name, rank), transports=transports)
    rx = ferry.RefitReceiver(name, timeout=5, ctx=ctx)
    specs = ferry.tp_shards(rx, rank, world, RULES, fused=FUSED)
    mine = {t: np.zeros(shape, dtype=dtype) for t, (shape, dtype, _) in specs.items()}
    rx.bind_shards({t: (mine[t], specs[t][2]) for t in specs})
    return ctx, rx, specs, mine


def check_ranks(sd, ranks, world):
    """Put back together from the ranks, every tensor equals the sender's."""
    parts = {"q": [], "k": [], "v": []}
    for _, _, _, mine in ranks:
        q, k, v = np.split(mine["qkv"], [64 // world, 64 // world + 32 // world])
        parts["q"].append(q), parts["k"].append(k), parts["v"].append(v)
        assert np.array_equal(mine["norm"], sd["norm"])
    for n in "qkv":
        assert np.array_equal(np.concatenate(parts[n], axis=0), sd[n]), n
    assert np.array_equal(np.concatenate([m["up"] for *_, m in ranks], axis=0), sd["up"])
    assert np.array_equal(np.concatenate([m["o"] for *_, m in ranks], axis=1), sd["o"])
    assert np.array_equal(np.concatenate([m["down"] for *_, m in ranks], axis=1), sd["down"])


def check_read(sd, ranks, world, before):
    sharded = sum(a.nbytes for n, a in sd.items() if n != "norm")
    for (_, rx, _, mine), b in zip(ranks, before):
        read = rx.bytes_read - b
        assert read == sum(a.nbytes for a in mine.values())
        assert read <= sharded // world + sd["norm"].nbytes


def close_ranks(ranks):
    for ctx, rx, _, _ in ranks:
        rx.close()
        ctx.close()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("transports", ["shm,tcp", "tcp"])
def test_ranks_read_only_their_shards(world, transports):
    sd = model(1)
    name = unique("tp")
    tx = ferry.RefitSender(name, sd, buffer_bytes=4096)
    ranks = [open_rank(name, r, world, transports) for r in range(world)]
    try:
        for v in (1, 2):
            before = [rx.bytes_read for _, rx, _, _ in ranks]
            tx.push(v)
            for _, rx, _, _ in ranks:
                assert rx.wait(v, timeout=5) == v
            check_ranks(sd, ranks, world)
            check_read(sd, ranks, world, before)
            for a in sd.values():
                a += 1.0
    finally:
        close_ranks(ranks)
        tx.close()


def test_late_ranks_catch_up_with_their_shards():
    sd = model(2)
    name = unique("late")
    tx = ferry.RefitSender(name, sd, buffer_bytes=4096)
    try:
        tx.push(1)  # nobody attached yet
        ranks = [open_rank(name, r, 2, "shm,tcp") for r in range(2)]
        for _, rx, _, _ in ranks:
            assert rx.wait(1, timeout=10) == 1
        check_ranks(sd, ranks, 2)
        check_read(sd, ranks, 2, [0, 0])
        close_ranks(ranks)
    finally:
        tx.close()


def test_tp_shards_specs():
    sd = model()
    specs = ferry.tp_shards({n: a.shape for n, a in sd.items()}, 1, 4, RULES, fused=FUSED)
    assert set(specs) == {"qkv", "o", "up", "down", "norm"}
    assert specs["qkv"][0] == (32, 32)
    assert specs["qkv"][2] == [ferry.Piece("q", 0, 16, 32), ferry.Piece("k", 0, 8, 16),
                               ferry.Piece("v", 0, 8, 16)]
    assert specs["o"][0] == (32, 16) and specs["o"][2] == [ferry.Piece("o", 1, 16, 32)]
    assert specs["norm"][0] == (32,) and specs["norm"][2] == [ferry.Piece("norm", 0, 0, 32)]
    with pytest.raises(ferry.InvalidArgument, match="does not split in 3"):
        ferry.tp_shards({n: a.shape for n, a in sd.items()}, 0, 3, RULES)
    with pytest.raises(ferry.InvalidArgument, match="sends no"):
        ferry.tp_shards({"q": (4, 4)}, 0, 2, RULES, fused={"qkv": ["q", "k"]})
    with pytest.raises(ferry.InvalidArgument, match="rank 2 of world 2"):
        ferry.tp_shards({"q": (4, 4)}, 2, 2, RULES)


def test_bind_errors_name_the_piece():
    sd = model(3)
    name = unique("err")
    tx = ferry.RefitSender(name, sd, buffer_bytes=4096)
    rx = ferry.RefitReceiver(name, timeout=5)
    try:
        out = np.zeros((32, 16), np.float32)
        with pytest.raises(ferry.ShapeError, match=r"piece 0 \('o' dim 1 \[60:76\]\)"):
            rx.bind_shards({"o": (out, [("o", 1, 60, 76)])})
        qkv = np.zeros((48, 32), np.float32)
        with pytest.raises(ferry.ShapeError, match=r"piece 1 \('o' dim 0"):
            rx.bind_shards({"qkv": (qkv, [ferry.Piece("q", 0, 0, 32),
                                          ferry.Piece("o", 0, 0, 16)])})
        with pytest.raises(ferry.NotFound, match="no tensor 'nope'"):
            rx.bind_shards({"x": (out, [("nope", 0, 0, 1)])})
        with pytest.raises(ferry.DtypeError):
            rx.bind_shards({"o": (out.astype(np.float64), [("o", 1, 0, 16)])})
        rx.bind_shards({"o": (out, [("o", 1, 16, 32)])})
        tx.push(1)
        assert rx.wait(1, timeout=5) == 1
        assert np.array_equal(out, sd["o"][:, 16:32])
        assert rx.bytes_read == out.nbytes
    finally:
        rx.close()
        tx.close()


def test_updates_yields_each_ranks_slices_as_they_land():
    """Two ranks that bound torch shards load version 2 through updates(): each target comes
    as its sources' buckets land (rank 0's receiver is held before the last bucket, which
    carries only the norm: every other target comes while the version is not committed), it
    is the rank's own bound tensor, and put together they are the sender's tensors; each rank
    still reads only its slices."""
    torch = pytest.importorskip("torch")
    world = 2
    sd = model(4)
    name = unique("upd")
    tx = ferry.RefitSender(name, {n: torch.from_numpy(a) for n, a in sd.items()},
                           buffer_bytes=4096)
    ranks = []
    try:
        for r in range(world):
            ctx = ferry.Context(name="%s-r%d" % (name, r), transports="shm,tcp")
            rx = ferry.RefitReceiver(name, timeout=5, ctx=ctx)
            specs = ferry.tp_shards(rx, r, world, RULES, fused=FUSED)
            mine = {t: torch.zeros(shape, dtype=getattr(torch, dtype))
                    for t, (shape, dtype, _) in specs.items()}
            rx.bind_shards({t: (mine[t], specs[t][2]) for t in specs})
            ranks.append((ctx, rx, specs, mine))
        tx.push(1)
        for _, rx, _, _ in ranks:
            assert rx.wait(1, timeout=5) == 1
        rx0 = ranks[0][1]
        first, count = ctypes.c_uint32(), ctypes.c_uint32()
        spans = {}
        for i, n in enumerate(rx0.names()):
            ferry.refit.lib.ferry_refit_tensor_buckets(rx0.handle, i, ctypes.byref(first),
                                                       ctypes.byref(count))
            spans[n] = (first.value, first.value + count.value)
        last = spans["norm"][0]
        assert all(stop <= last for n, (_, stop) in spans.items() if n != "norm")
        gate = threading.Event()

        def hold(event):
            if event == ("bucket", 2, last):
                gate.wait(30)

        rx0._listen(hold)
        before = [rx.bytes_read for _, rx, _, _ in ranks]
        its = [rx0.updates(2, timeout=30), ranks[1][1].updates(2, mapping={"qkv": "fused"})]
        for a in sd.values():
            a += 1.0
        pusher = threading.Thread(target=tx.push, args=(2,), kwargs={"timeout": 30})
        pusher.start()
        try:
            got0, early = [], 0
            for target, t in its[0]:
                got0.append((target, t))
                early += rx0.committed == 0
                if len(got0) == len(ranks[0][3]) - 1:
                    gate.set()
        finally:
            gate.set()
            pusher.join()
            rx0._unlisten(hold)
        got1 = list(its[1])
        assert early >= len(ranks[0][3]) - 1  # all but the norm came before the commit
        assert [n for n, _ in got0][-1] == "norm"
        renamed = [lambda t: t, lambda t: "fused" if t == "qkv" else t]
        for (_, _, _, mine), got, rename in zip(ranks, (got0, got1), renamed):
            assert sorted(n for n, _ in got) == sorted(map(rename, mine))
            got = dict(got)
            for target, t in mine.items():
                assert got[rename(target)] is t, target  # the rank's own tensor, no copy
        as_numpy = [(c, rx, s, {t: v.numpy() for t, v in mine.items()})
                    for c, rx, s, mine in ranks]
        check_ranks(sd, as_numpy, world)
        check_read(sd, as_numpy, world, before)
    finally:
        close_ranks(ranks)
        tx.close()


def test_zero_size_tensor_binds_as_tp_shards_gives_it():
    """tp_shards' own pieces for zero-size tensors (shape (0, 4): replicated, and split along
    dim 0 or dim 1) bind, and the version commits with every other tensor whole (issue 32 row
    10: the [0:0] piece was refused and the whole bind failed)."""
    sd = {"empty": np.zeros((0, 4), np.float32), "wide": np.zeros((0, 4), np.float32),
          "cols": np.zeros((4, 0), np.float32),
          "w": np.arange(32, dtype=np.float32).reshape(8, 4)}
    name = unique("zero")
    tx = ferry.RefitSender(name, sd, buffer_bytes=4096)
    rx = ferry.RefitReceiver(name, timeout=5)
    try:
        specs = ferry.tp_shards(rx, 1, 2, [(r"^w$", 0), (r"^wide$", 1), (r"^cols$", 1)])
        assert specs["empty"][2] == [ferry.Piece("empty", 0, 0, 0)]
        assert specs["cols"][2] == [ferry.Piece("cols", 1, 0, 0)]
        mine = {t: np.zeros(shape, dtype=dtype) for t, (shape, dtype, _) in specs.items()}
        rx.bind_shards({t: (mine[t], specs[t][2]) for t in specs})
        tx.push(1)
        assert rx.wait(1, timeout=5) == 1
        assert np.array_equal(mine["w"], sd["w"][4:])
        assert mine["empty"].shape == (0, 4) and mine["wide"].shape == (0, 2)
        assert mine["cols"].shape == (4, 0)
        with pytest.raises(ferry.ShapeError, match="not a slice"):  # still no empty slice of rows
            rx.bind_shards({"x": (np.zeros((0, 4), np.float32), [("w", 0, 3, 3)])})
    finally:
        rx.close()
        tx.close()
