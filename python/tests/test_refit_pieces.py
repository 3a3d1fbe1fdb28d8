"""The sharded senders' piece builders (ferry.tp_pieces, fsdp_pieces, expert_pieces), pure Python:
put together over the ranks, the pieces each builder gives tile every global tensor exactly
once, each local tensor (a view, for a fused one) is the slice its piece names, and what cannot
be split is a clear error; RefitSender checks its rank, world and pieces before opening."""
import os

import numpy as np
import pytest

import ferry

# A Llama-like layer in the global (Hugging Face) names, q/k/v of grouped-query sizes
HIDDEN, Q, KV, INTER = 8, 8, 4, 12
GLOBAL = {"embed": (16, HIDDEN), "q": (Q, HIDDEN), "k": (KV, HIDDEN), "v": (KV, HIDDEN),
          "o": (HIDDEN, Q), "gate": (INTER, HIDDEN), "up": (INTER, HIDDEN),
          "down": (HIDDEN, INTER), "norm": (HIDDEN,)}
RULES = [(r"^(q|k|v|gate|up)$", 0), (r"^(o|down)$", 1), (r"^norm$", None)]


def full_model(seed=0):
    g = np.random.default_rng(seed)
    return {n: g.standard_normal(s).astype(np.float32) for n, s in GLOBAL.items()}


def tp_local(full, rank, world):
    """Rank `rank`'s Megatron state dict: column-parallel rows, row-parallel columns, fused
    qkv = [q_r; k_r; v_r] and gate_up = [gate_r; up_r] (copies: a trainer's own tensors)."""
    def cut(name, dim):
        n = full[name].shape[dim] // world
        return np.take(full[name], range(rank * n, (rank + 1) * n), axis=dim)
    return {"embed": full["embed"].copy(), "norm": full["norm"].copy(),
            "qkv": np.concatenate([cut("q", 0), cut("k", 0), cut("v", 0)]),
            "gate_up": np.concatenate([cut("gate", 0), cut("up", 0)]),
            "o": cut("o", 1), "down": cut("down", 1)}


def assemble(ranks):
    """The global tensors put back from every rank's (state_dict, pieces): each element written
    exactly once (a count per element), replicated tensors equal on every rank."""
    out, count = {}, {}
    for sd, pieces in ranks:
        for local, t in sd.items():
            p = pieces.get(local)
            if p is None:  # whole under its own name
                if local in out:
                    assert np.array_equal(out[local], t), local
                else:
                    out[local], count[local] = np.array(t), np.ones(np.shape(t), int)
                continue
            shape = list(np.shape(t))
            shape[p.dim] = max(p.stop, out[p.source].shape[p.dim] if p.source in out else 0)
            if p.source not in out:
                out[p.source] = np.zeros(shape, np.float32)
                count[p.source] = np.zeros(shape, int)
            elif out[p.source].shape[p.dim] < p.stop:  # grow along dim
                pad = [(0, 0)] * len(shape)
                pad[p.dim] = (0, p.stop - out[p.source].shape[p.dim])
                out[p.source] = np.pad(out[p.source], pad)
                count[p.source] = np.pad(count[p.source], pad)
            index = [slice(None)] * len(shape)
            index[p.dim] = slice(p.start, p.stop)
            assert np.shape(t)[p.dim] == p.stop - p.start, (local, p)
            out[p.source][tuple(index)] = t
            count[p.source][tuple(index)] += 1
    for name, c in count.items():
        if name in out and any(name == p.source for _, ps in ranks for p in ps.values()):
            assert (c == 1).all(), "%s: elements covered %s times" % (name, np.unique(c))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_tp_pieces_tile_the_model(world):
    full = full_model(1)
    shapes = {n: GLOBAL[n] for n in ("q", "k", "v")}
    ranks = [ferry.tp_pieces(tp_local(full, r, world), r, world, RULES,
                             fused={"qkv": ["q", "k", "v"], "gate_up": ["gate", "up"]},
                             shapes=shapes) for r in range(world)]
    sd, pieces = ranks[-1]
    # the fused tensors became views per source, named by the global names
    assert sorted(sd) == sorted(GLOBAL)
    assert pieces["q"] == ferry.Piece("q", 0, (world - 1) * Q // world, Q)
    assert pieces["o"] == ferry.Piece("o", 1, (world - 1) * Q // world, Q)
    assert pieces["q"].global_name == "q"
    assert "norm" not in pieces and "embed" not in pieces  # replicated: whole
    got = assemble(ranks)
    assert sorted(got) == sorted(GLOBAL)
    for n, t in full.items():
        assert np.array_equal(got[n], t), n


def test_tp_pieces_views_share_the_fused_tensor():
    """A fused tensor's parts are views: the trainer's in-place step is what gets sent."""
    full = full_model(2)
    local = tp_local(full, 1, 2)
    sd, _ = ferry.tp_pieces(local, 1, 2, RULES, fused={"qkv": ["q", "k", "v"],
                                                       "gate_up": ["gate", "up"]},
                            shapes={n: GLOBAL[n] for n in "qkv"})
    local["qkv"] += 1
    assert np.array_equal(sd["k"], local["qkv"][Q // 2:Q // 2 + KV // 2])
    assert np.shares_memory(sd["v"], local["qkv"])


def test_tp_pieces_with_torch_tensors():
    torch = pytest.importorskip("torch")
    local = {n: torch.from_numpy(t) for n, t in tp_local(full_model(3), 0, 2).items()}
    sd, pieces = ferry.tp_pieces(local, 0, 2, RULES, fused={"gate_up": ["gate", "up"],
                                                            "qkv": ["q", "k", "v"]},
                                 shapes={n: GLOBAL[n] for n in "qkv"})
    assert sd["up"].data_ptr() == local["gate_up"][INTER // 2:].data_ptr()
    assert sd["up"].is_contiguous() and tuple(sd["up"].shape) == (INTER // 2, HIDDEN)
    assert pieces["up"] == ferry.Piece("up", 0, 0, INTER // 2)


def test_tp_pieces_errors():
    local = tp_local(full_model(4), 0, 2)
    fused = {"qkv": ["q", "k", "v"], "gate_up": ["gate", "up"]}
    # q, k and v differ in size: an even split of the fused rows needs their shapes
    with pytest.raises(ferry.InvalidArgument, match="qkv.*shapes="):
        ferry.tp_pieces(local, 0, 2, RULES, fused=fused)
    # a wrong global shape: the local tensor is not its slice
    bad = {"q": (Q, HIDDEN), "k": (KV, HIDDEN), "v": (2 * KV, HIDDEN)}
    with pytest.raises(ferry.InvalidArgument, match="'qkv'"):
        ferry.tp_pieces(local, 0, 2, RULES, fused=fused, shapes=bad)
    with pytest.raises(ferry.InvalidArgument, match="rank 2 of world 2"):
        ferry.tp_pieces(local, 2, 2, RULES)
    with pytest.raises(ferry.InvalidArgument, match="norm.*no dim 1"):
        ferry.tp_pieces({"norm": np.zeros(4)}, 0, 2, [("norm", 1)])
    with pytest.raises(ferry.InvalidArgument, match="'q' is in fused 'qkv'"):
        ferry.tp_pieces(dict(local, q=np.zeros((4, HIDDEN))), 0, 2, RULES, fused=fused,
                        shapes={n: GLOBAL[n] for n in "qkv"})


@pytest.mark.parametrize("world", [1, 3, 4, 8])
def test_fsdp_pieces_split_dim0_last_shorter(world):
    shapes = {"w": (10, 3), "b": (10,), "tiny": (2, 5), "scalar": (), "empty": (0, 4)}
    full = {n: np.arange(int(np.prod(s)), dtype=np.float32).reshape(s) for n, s in shapes.items()}
    ranks = []
    for r in range(world):
        slices, pieces = ferry.fsdp_pieces(shapes, r, world)
        assert set(pieces) <= set(slices)
        ranks.append(({n: full[n][s] for n, s in slices.items()}, pieces))
        for n, p in pieces.items():
            assert p == ferry.Piece(n, 0, slices[n].start, slices[n].stop)
        assert "scalar" in slices and "scalar" not in pieces  # 0-d: whole on every rank
        assert ("empty" in slices) == (r == 0) and "empty" not in pieces
    c = -(-10 // world)
    rows = [ranks[r][1]["w"].stop - ranks[r][1]["w"].start for r in range(world)
            if "w" in ranks[r][1]]
    assert rows[:-1] == [c] * (len(rows) - 1) and 0 < rows[-1] <= c  # torch.chunk's split
    got = assemble(ranks)
    for n in ("w", "b", "tiny", "scalar", "empty"):
        assert np.array_equal(got[n], full[n]), n
    # full tensors work as shapes
    assert ferry.fsdp_pieces(full, world - 1, world) == ferry.fsdp_pieces(shapes, world - 1,
                                                                          world)


def test_fsdp_pieces_bad_rank():
    with pytest.raises(ferry.InvalidArgument, match="rank -1 of world 2"):
        ferry.fsdp_pieces({"w": (4,)}, -1, 2)
    with pytest.raises(ferry.InvalidArgument, match="world 0"):
        ferry.fsdp_pieces({"w": (4,)}, 0, 0)


EXPERT = r"\.experts\.(\d+)\."


def moe_model(num_experts):
    sd = {"embed.weight": np.zeros((4, 2), np.float32), "router.weight": np.ones((num_experts, 2))}
    for e in range(num_experts):
        sd["layers.0.experts.%d.w1.weight" % e] = np.full((3, 2), e, np.float32)
        sd["layers.0.experts.%d.w2.weight" % e] = np.full((2, 3), e, np.float32)
    return sd


@pytest.mark.parametrize("placement,world,owner", [
    ("contiguous", 2, lambda e: e // 3), ("contiguous", 4, lambda e: e // 2),
    ("round_robin", 4, lambda e: e % 4), ("round_robin", 1, lambda e: 0)])
def test_expert_pieces_global_names(placement, world, owner):
    """Names with global indices (the whole model's state dict): each rank keeps its experts
    and the replicated tensors; nothing renamed, no pieces."""
    sd = moe_model(6)
    held = {}
    for r in range(world):
        mine, pieces = ferry.expert_pieces(sd, r, world, EXPERT, 6, placement)
        assert pieces == {}
        assert "embed.weight" in mine and "router.weight" in mine
        for n in mine:
            if ".experts." in n:
                e = int(n.split(".")[3])
                assert owner(e) == r, (n, r)
                held.setdefault(n, []).append(r)
    assert sorted(held) == sorted(n for n in sd if ".experts." in n)
    assert all(len(rs) == 1 for rs in held.values())


@pytest.mark.parametrize("placement", ["contiguous", "round_robin"])
def test_expert_pieces_local_index(placement):
    """Megatron's local_experts.i on rank r: declared under the global index, as a piece that
    covers the whole tensor (none when the name does not change); over the ranks every expert is
    held once."""
    world, num = 2, 6
    held = {}
    for r in range(world):
        local = {"norm": np.zeros(2)}
        for i in range(num // world):
            local["layers.0.experts.%d.w1.weight" % i] = np.full((3, 2), 10 * r + i)
        sd, pieces = ferry.expert_pieces(local, r, world, EXPERT, num, placement, local_index=True)
        assert sd.keys() == local.keys() and "norm" not in pieces
        for n in local:
            if n == "norm":
                continue
            i = int(n.split(".")[3])
            e = r * 3 + i if placement == "contiguous" else i * world + r
            want = "layers.0.experts.%d.w1.weight" % e
            if want == n:
                assert n not in pieces
            else:
                assert pieces[n] == ferry.Piece(want, 0, 0, 3), (n, pieces.get(n))
            held.setdefault(want, []).append(r)
    assert sorted(held) == sorted("layers.0.experts.%d.w1.weight" % e for e in range(num))
    assert all(len(rs) == 1 for rs in held.values())


def test_expert_pieces_errors():
    sd = moe_model(4)
    with pytest.raises(ferry.InvalidArgument, match="placement"):
        ferry.expert_pieces(sd, 0, 2, EXPERT, 4, "striped")
    with pytest.raises(ferry.InvalidArgument, match="no group"):
        ferry.expert_pieces(sd, 0, 2, r"\.experts\.\d+\.", 4)
    with pytest.raises(ferry.InvalidArgument, match="expert 5"):
        ferry.expert_pieces({"x.experts.5.w": np.zeros(2)}, 0, 2, EXPERT, 4)
    # local index 2 on rank 1 of 2 with 4 experts contiguous: global 4, past the last
    with pytest.raises(ferry.InvalidArgument, match="expert 4 is not rank 1's"):
        ferry.expert_pieces({"x.experts.2.w": np.zeros(2)}, 1, 2, EXPERT, 4, local_index=True)
    with pytest.raises(ferry.InvalidArgument, match="0-d"):
        ferry.expert_pieces({"x.experts.0.s": np.zeros(())}, 1, 2, EXPERT, 4, local_index=True)


def test_sender_checks_rank_world_and_pieces(monkeypatch):
    """Before anything opens: a rank outside the world, a group without a directory (its ranks
    are found there), a piece of a tensor it does not hold."""
    monkeypatch.delenv("FERRY_DIRECTORY", raising=False)
    sd = {"w": np.zeros((4, 2), np.float32)}
    name = "pypieces-%d" % os.getpid()
    with pytest.raises(ferry.InvalidArgument, match="rank 2 of world 2"):
        ferry.RefitSender(name, sd, rank=2, world=2, directory="ferry://127.0.0.1:1")
    with pytest.raises(ferry.InvalidArgument, match="rank 1 of world 1"):
        ferry.RefitSender(name, sd, rank=1)
    with pytest.raises(ferry.InvalidArgument, match="directory"):
        ferry.RefitSender(name, sd, rank=0, world=2)
    with pytest.raises(ferry.InvalidArgument, match="'x' is not a tensor"):
        ferry.RefitSender(name, sd, pieces={"x": ferry.Piece("w", 0, 0, 4)})
    with pytest.raises(ferry.InvalidArgument, match="Piece"):
        ferry.RefitSender(name, sd, pieces={"w": ("w", 0, 4)})
    # a single sender's receivers see its tensors whole under their own names
    with pytest.raises(ferry.InvalidArgument, match="needs a sender group"):
        ferry.RefitSender(name, sd, pieces={"w": ferry.Piece("glob", 0, 0, 4)})
    with pytest.raises(ferry.InvalidArgument, match="needs a sender group"):
        ferry.RefitSender(name, sd, pieces={"w": ferry.Piece("w", 0, 0, 2)})


def test_single_sender_takes_a_world_of_one_from_the_builders(monkeypatch):
    """What the builders give for world 1 (every tensor whole under its own name) declares as a
    plain sender does: the receiver sees the same names and bytes."""
    monkeypatch.delenv("FERRY_DIRECTORY", raising=False)
    full = full_model(5)
    slices, pieces = ferry.fsdp_pieces(full, 0, 1)
    assert set(pieces) == set(full)  # each tensor one piece: the whole of it
    name = "pypieces-one-%d" % os.getpid()
    with ferry.RefitSender(name, {n: full[n][s] for n, s in slices.items()}, pieces=pieces) as tx:
        with ferry.RefitReceiver(name, timeout=5) as rx:
            assert rx.ranks == 1
            views = rx.tensors(like="numpy")
            tx.push(1)
            assert rx.wait(1, timeout=5) == 1
            for n, t in full.items():
                assert np.array_equal(views[n], t), n
