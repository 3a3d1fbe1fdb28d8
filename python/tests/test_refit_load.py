"""RefitReceiver.updates() (each tensor as the buckets carrying it land, views, a mapping that
renames and fuses, load_weights-style consumption, tears), push/wait in asyncio, routes and
alias mode from Python."""
import asyncio
import threading

import numpy as np
import pytest

import ferry

torch = pytest.importorskip("torch")
_n = [0]


def unique(tag):
    _n[0] += 1
    return "pyload-%d-%s-%d" % (id(_n), tag, _n[0])


def blocks(n=6):
    """n float32 tensors of 4096 bytes each: with 4096-byte buckets, one bucket each."""
    g = torch.Generator().manual_seed(5)
    return {"t%d" % i: torch.randn(1024, generator=g) for i in range(n)}


def test_updates_yields_each_tensor_as_its_bucket_lands():
    """The receiver's thread is held before the last bucket of version 2 lands (a listener
    that waits on a gate): every other tensor is yielded, with version 2's values, while the
    version is not committed; the gate opens and the last one and the end follow."""
    sd = blocks()
    name = unique("stream")
    with ferry.RefitSender(name, sd, buffer_bytes=4096) as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        rx.tensors()
        tx.push(1)
        assert rx.wait(1, timeout=10) == 1
        gate = threading.Event()
        last = len(sd) - 1

        def hold(event):
            if event == ("bucket", 2, last):
                gate.wait(30)

        rx._listen(hold)
        it = rx.updates(2, timeout=30)
        for t in sd.values():
            t.mul_(-2)
        pusher = threading.Thread(target=tx.push, args=(2,), kwargs={"timeout": 30})
        pusher.start()
        try:
            got = []
            for name_, t in it:
                got.append((name_, t))
                if len(got) == last:
                    assert rx.committed == 0  # torn: version 2 is still landing
                    gate.set()
        finally:
            gate.set()
            pusher.join()
            rx._unlisten(hold)
        assert [n for n, _ in got] == list(sd)  # one bucket each: landing order is plan order
        for n, t in got:
            assert torch.equal(t, sd[n]), n
        assert rx.committed == 2 and it.version == 2
        assert ferry.refit._listeners.get(rx._key) is None  # nothing outlives the iteration


def test_updates_order_follows_landing_and_views_are_not_copies():
    sd = blocks()
    name = unique("order")
    with ferry.RefitSender(name, sd, buffer_bytes=4096) as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        views = rx.tensors()
        tx.push(1)
        rx.wait(1, timeout=10)
        it = rx.updates(2)
        sd["t4"].add_(1)
        tx.push(2, only=["t4"])  # only t4's bucket lands; the others hold 2 already
        got = list(it)
        assert [n for n, _ in got][0] == "t4" and sorted(n for n, _ in got) == sorted(sd)
        for n, t in got:
            assert t.data_ptr() == views[n].data_ptr()  # the flat buffer itself
            assert torch.equal(t, sd[n])


def test_updates_of_a_version_held_and_for_a_late_receiver():
    sd = blocks(3)
    name = unique("held")
    with ferry.RefitSender(name, sd, buffer_bytes=4096) as tx:
        tx.push(1)  # before anyone attached
        sent = {k: v.clone() for k, v in sd.items()}
        for t in sd.values():
            t.add_(1)
        with ferry.RefitReceiver(name, timeout=5) as rx:
            got = dict(rx.updates(1, timeout=10))  # binds, catches up, yields
            assert sorted(got) == sorted(sd) and rx.committed == 1
            assert all(torch.equal(got[k], sent[k]) for k in sd)
            again = rx.updates(1)
            assert len(list(again)) == 3 and again.version == 1  # held: at once
        tx.push(2)
        with ferry.RefitReceiver(name, timeout=5) as rx:  # late for 1 and 2: loads 2
            it = rx.updates(1, timeout=10)
            got = dict(it)
            assert it.version == 2 and rx.committed == 2
            assert all(torch.equal(got[k], sd[k]) for k in sd)


ENGINE_NAMES = ["model.embed_tokens.weight",
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.0.self_attn.k_proj.weight",
                "model.layers.0.self_attn.v_proj.weight",
                "model.layers.0.mlp.gate_proj.weight",
                "model.layers.0.mlp.up_proj.weight",
                "model.norm.weight"]


def trainer_model():
    g = torch.Generator().manual_seed(9)
    shapes = [(50, 16), (32, 16), (16, 16), (16, 16), (48, 16), (48, 16), (16,)]
    return {n: torch.randn(*s, generator=g) for n, s in zip(ENGINE_NAMES, shapes)}


class Engine:
    """An engine with fused qkv and gate_up parameters under its own names, loading as vLLM
    models do once names are its own: params[name].copy_(tensor)."""

    def __init__(self):
        self.params = {"embed.weight": torch.zeros(50, 16), "layers.0.qkv.weight":
                       torch.zeros(64, 16), "layers.0.gate_up.weight": torch.zeros(96, 16),
                       "norm.weight": torch.zeros(16)}

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            self.params[name].copy_(w)
            loaded.add(name)
        return loaded

    def expect(self, sd):
        p = "model.layers.0."
        return {"embed.weight": sd["model.embed_tokens.weight"],
                "layers.0.qkv.weight": torch.cat([sd[p + "self_attn.%s_proj.weight" % x]
                                                  for x in "qkv"]),
                "layers.0.gate_up.weight": torch.cat([sd[p + "mlp.gate_proj.weight"],
                                                      sd[p + "mlp.up_proj.weight"]]),
                "norm.weight": sd["model.norm.weight"]}


def as_dict_mapping():
    p = "model.layers.0."
    return {"model.embed_tokens.weight": "embed.weight",
            p + "self_attn.q_proj.weight": ("layers.0.qkv.weight", "q"),
            p + "self_attn.k_proj.weight": ("layers.0.qkv.weight", "k"),
            p + "self_attn.v_proj.weight": ("layers.0.qkv.weight", "v"),
            p + "mlp.gate_proj.weight": ("layers.0.gate_up.weight", 0),
            p + "mlp.up_proj.weight": ("layers.0.gate_up.weight", 1),
            "model.norm.weight": "norm.weight"}


def as_callable_mapping(name):
    return [as_dict_mapping()[name]]


# vLLM's stacked_params_mapping for Llama, (param_name, shard_name, shard_id), as it is
RULES = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
         (".qkv_proj", ".v_proj", "v"), (".gate_up_proj", ".gate_proj", 0),
         (".gate_up_proj", ".up_proj", 1)]


@pytest.mark.parametrize("form", ["dict", "callable"])
def test_load_weights_with_a_mapping_that_renames_and_fuses(form):
    sd = trainer_model()
    mapping = as_dict_mapping() if form == "dict" else as_callable_mapping
    name = unique("engine")
    with ferry.RefitSender(name, sd, buffer_bytes=2048) as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        engine = Engine()
        views = rx.tensors()
        for v in (1, 2):
            for t in sd.values():
                t.add_(v)
            it = rx.updates(v, mapping=mapping)
            tx.push(v)
            assert engine.load_weights(it) == set(engine.params)
            for k, want in engine.expect(sd).items():
                assert torch.equal(engine.params[k], want), (v, k)
        # q, k, v and gate, up were declared back to back: the fused tensors are views
        got = dict(rx.updates(2, mapping=mapping))
        assert got["layers.0.qkv.weight"].data_ptr() == \
            views["model.layers.0.self_attn.q_proj.weight"].data_ptr()
        assert got["layers.0.gate_up.weight"].data_ptr() == \
            views["model.layers.0.mlp.gate_proj.weight"].data_ptr()


def test_vllm_rules_and_pieces_not_back_to_back():
    """vLLM's (param_name, shard_name, shard_id) rules; k declared before q and an unrelated
    tensor between them: the fused tensor is then a concatenation in shard order."""
    full = trainer_model()
    order = [ENGINE_NAMES[i] for i in (2, 0, 1, 3, 4, 5, 6)]
    sd = {k: full[k] for k in order}
    name = unique("rules")
    with ferry.RefitSender(name, sd, buffer_bytes=1024) as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        it = rx.updates(1, mapping=RULES)
        tx.push(1)
        got = dict(it)
        assert sorted(got) == ["model.embed_tokens.weight", "model.layers.0.mlp.gate_up_proj.weight",
                               "model.layers.0.self_attn.qkv_proj.weight", "model.norm.weight"]
        want = Engine().expect(full)
        assert torch.equal(got["model.layers.0.self_attn.qkv_proj.weight"],
                           want["layers.0.qkv.weight"])
        assert torch.equal(got["model.layers.0.mlp.gate_up_proj.weight"],
                           want["layers.0.gate_up.weight"])


def test_updates_into_bound_tensors_and_numpy():
    sd = blocks(3)
    name = unique("bound")
    with ferry.RefitSender(name, sd, buffer_bytes=4096) as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        dst = {k: torch.empty_like(v) for k, v in sd.items()}
        rx.bind(dst)
        it = rx.updates(1)
        tx.push(1)
        got = list(it)
        assert [n for n, _ in got] == list(sd)
        assert all(t is dst[n] and torch.equal(t, sd[n]) for n, t in got)
    name = unique("numpy")
    with ferry.RefitSender(name, sd, buffer_bytes=4096) as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        it = rx.updates(1, like="numpy")
        tx.push(1)
        got = dict(it)
        assert all(isinstance(a, np.ndarray) and np.array_equal(a, sd[k].numpy())
                   for k, a in got.items())


def test_updates_raises_when_the_version_does_not_commit():
    sd = {"w": torch.ones(300), "b": torch.ones(10)}
    name = unique("tear")
    tx = ferry.RefitSender(name, sd, buffer_bytes=256)
    with ferry.RefitReceiver(name, timeout=5) as rx:
        dst = {k: torch.empty_like(v) for k, v in sd.items()}
        rx.bind(dst)
        tx.push(1)
        rx.wait(1, timeout=10)
        it = rx.updates(2, timeout=10)
        with pytest.raises(ferry.Error):  # w no longer fits what the receiver bound
            tx.push(2, state_dict={"w": torch.ones(7)})
        with pytest.raises(ferry.ShapeError) as e:
            list(it)
        assert "version 2" in str(e.value) and "'w'" in str(e.value)
        assert ferry.refit._listeners.get(rx._key) is None
        it = rx.updates(3, timeout=30)
        tx.close()
        with pytest.raises(ferry.PeerGone):  # the sender is gone: no version 3 will come
            list(it)


def test_updates_arguments():
    sd = trainer_model()
    name = unique("args")
    with ferry.RefitSender(name, sd) as tx, ferry.RefitReceiver(name, timeout=5) as rx:
        q = "model.layers.0.self_attn.q_proj.weight"
        k = "model.layers.0.self_attn.k_proj.weight"
        for bad, what in [({q: ("qkv", "x")}, "shard id"),
                          ({q: "same", k: "same"}, "distinct names"),
                          ({q: ("qkv", 0), k: ("qkv", 2)}, "0, 1, ..."),
                          ({q: ("fused", 0), "model.norm.weight": ("fused", 1)}, "along dim 0"),
                          ({q: 3}, "engine name"),
                          ([("a", "b")], "stacked_params_mapping"),
                          (42, "a dict")]:
            with pytest.raises(ValueError) as e:
                rx.updates(1, mapping=bad)
            assert what in str(e.value), (bad, str(e.value))
        for bad in (0, -1, "1", 1.5, None):
            with pytest.raises(ValueError):
                rx.updates(bad)
        with pytest.raises(ValueError):
            rx.updates(1, like="jax")
        assert ferry.refit._listeners.get(rx._key) is None  # refused before listening
        it = rx.updates(1)
        it.close()  # given up before it began
        assert ferry.refit._listeners.get(rx._key) is None
        tx.push(1)


def test_routes_from_python():
    sd = blocks(4)
    name = unique("routes")
    with ferry.RefitSender(name, sd, buffer_bytes=4096) as tx, \
            ferry.RefitReceiver(name, timeout=5) as a, ferry.RefitReceiver(name, timeout=5) as b:
        va, vb = a.tensors(), b.tensors()
        tx.wait_receivers(2)
        for v, route in ((1, "direct"), (2, "chain"), (3, "auto"), (4, None)):
            for t in sd.values():
                t.add_(1)
            kwargs = {} if route is None else {"route": route}
            assert tx.push(v, **kwargs) == v
            assert a.wait(v, timeout=10) == v and b.wait(v, timeout=10) == v
            assert all(torch.equal(va[k], sd[k]) and torch.equal(vb[k], sd[k]) for k in sd)
        for bad in ("ring", "CHAIN", 1, None):
            with pytest.raises(ValueError) as e:
                tx.push(5, route=bad)
            assert "'direct' or 'chain'" in str(e.value)
        assert tx.version == 4  # nothing was pushed


def test_alias_views_are_the_senders_buffer_read_only():
    sd = blocks(3)
    name = unique("alias")
    with ferry.RefitSender(name, sd, buffer_bytes=4096, alias=True) as tx, \
            ferry.RefitReceiver(name, timeout=5, alias=True) as rx, \
            ferry.RefitReceiver(name, timeout=5) as other:
        views = rx.tensors()
        arrays = rx.bind_alias(like="numpy")
        assert all(not a.flags.writeable for a in arrays.values())
        with pytest.raises(ValueError):
            arrays["t0"][0] = 1
        other.tensors()
        for v in (1, 2):
            for t in sd.values():
                t.add_(1)
            it = rx.updates(v)
            tx.push(v)
            got = dict(it)
            assert rx.committed == v
            for k in sd:
                assert torch.equal(views[k], sd[k]) and np.array_equal(arrays[k], sd[k].numpy())
                assert got[k].data_ptr() == views[k].data_ptr()  # no copy, no buffer here
    name = unique("noalias")
    with ferry.RefitSender(name, sd) as tx, ferry.RefitReceiver(name, timeout=5) as rx:
        with pytest.raises(ferry.NotSupported):
            rx.bind_alias()


def test_async_push_and_wait():
    sd = blocks(3)
    name = unique("aio")

    async def main(tx, rx):
        rx.tensors()
        ticks = []

        async def ticker():  # the loop keeps running while both wait
            while True:
                ticks.append(1)
                await asyncio.sleep(0)

        tick = asyncio.ensure_future(ticker())
        waiting = asyncio.ensure_future(rx.wait_async(1, timeout=30))
        await asyncio.sleep(0)
        assert await tx.push_async(1, route="chain", timeout=30) == 1
        assert await waiting == 1
        tick.cancel()
        assert ticks
        # a cancelled wait leaves no thread and no listener, and the receiver works on
        threads = threading.active_count()
        waiting = asyncio.ensure_future(rx.wait_async(2, timeout=30))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert threading.active_count() == threads
        assert ferry.refit._listeners.get(rx._key) is None
        with pytest.raises(ferry.Timeout):
            await rx.wait_async(2, timeout=0.05)
        with pytest.raises(ValueError):
            await tx.push_async(2, route="ring")
        later = asyncio.ensure_future(rx.wait_async(2, timeout=30))
        for t in sd.values():
            t.add_(1)
        assert await tx.push_async(2) == 2
        assert await later == 2 and rx.committed == 2

    with ferry.RefitSender(name, sd, buffer_bytes=4096) as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        asyncio.run(main(tx, rx))


class VllmStyleEngine:
    """load_weights as vLLM's Llama writes it: trainer names in, stacked_params_mapping applied
    by the engine itself, each shard placed by its loader (no ferry mapping needed)."""

    def __init__(self):
        p = "model.layers.0."
        self.params = {"model.embed_tokens.weight": torch.zeros(50, 16),
                       p + "self_attn.qkv_proj.weight": torch.zeros(64, 16),
                       p + "mlp.gate_up_proj.weight": torch.zeros(96, 16),
                       "model.norm.weight": torch.zeros(16)}
        self.rows = {"q": (0, 32), "k": (32, 48), "v": (48, 64), 0: (0, 48), 1: (48, 96)}

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            for param_name, shard_name, shard_id in RULES:
                if shard_name in name:
                    name = name.replace(shard_name, param_name)
                    lo, hi = self.rows[shard_id]
                    self.params[name][lo:hi].copy_(w)
                    break
            else:
                self.params[name].copy_(w)
            loaded.add(name)
        return loaded


def test_vllm_style_load_weights_with_trainer_names():
    sd = trainer_model()
    name = unique("vllm")
    with ferry.RefitSender(name, sd, buffer_bytes=1024) as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        engine = VllmStyleEngine()
        it = rx.updates(1)
        tx.push(1)
        assert engine.load_weights(it) == set(engine.params)
        want = Engine().expect(sd)
        p = "model.layers.0."
        assert torch.equal(engine.params[p + "self_attn.qkv_proj.weight"],
                           want["layers.0.qkv.weight"])
        assert torch.equal(engine.params[p + "mlp.gate_up_proj.weight"],
                           want["layers.0.gate_up.weight"])
        assert torch.equal(engine.params["model.embed_tokens.weight"],
                           sd["model.embed_tokens.weight"])


EXIT_LISTENING = r"""
import sys, torch, ferry
sd = {"w": torch.randn(4096)}
tx = ferry.RefitSender(sys.argv[1], sd, buffer_bytes=4096)
rx = ferry.RefitReceiver(sys.argv[1], timeout=10)
it = rx.updates(1)             # listening, never iterated, never closed
tx.push(1)
print("pushed", flush=True)
"""


def test_exit_while_listening():
    """A process that exits with a receiver still listening exits cleanly: the callbacks are
    cleared before the interpreter finalizes (the bound is a hang bound, not a timing)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(ferry.__file__)))
    out = subprocess.run([sys.executable, "-c", EXIT_LISTENING, unique("exit")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["pushed"]


_GC_UNDER_LOCK = r"""
import gc, sys
import torch
import ferry
import ferry.refit as refit


class Collecting(dict):
    # The collector runs at any allocation; here, deterministically, at the one a listener
    # makes while holding the table's lock.
    def setdefault(self, key, default=None):
        gc.collect()
        return dict.setdefault(self, key, default)


refit.events._listeners = Collecting(refit.events._listeners)
name = sys.argv[1]
sd = {"w": torch.zeros(1024)}
with ferry.RefitSender(name, sd, buffer_bytes=4096) as tx, \
        ferry.RefitReceiver(name, timeout=5) as rx:
    rx.tensors()
    gc.disable()
    it = rx.updates(1)  # listens: an entry in the listener table
    it.cycle = it       # only the collector can free it, and its __del__ unlistens
    del it
    it = rx.updates(1)  # listens again: the collection under the lock finalizes the first
    it.close()
    assert not refit.events._listeners.get(rx._key)
print("ok")
"""


def test_collector_finalizing_an_iterator_under_the_listener_lock(tmp_path):
    """A garbage iterator whose finalizer unlistens, collected at an allocation made while
    this thread holds the listener table's lock (a new iterator listening): the finalizer
    must not deadlock the thread against itself (it did with a plain Lock). In a child, so
    that a deadlock fails the test instead of hanging it."""
    import subprocess
    import sys
    script = tmp_path / "gc_under_lock.py"
    script.write_text(_GC_UNDER_LOCK)
    try:
        out = subprocess.run([sys.executable, str(script), unique("gc")], capture_output=True,
                             text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("deadlocked: a finalizer took the listener lock its own thread held")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_moe_experts_fuse_as_vllm_expert_params_mapping():
    """vLLM's FusedMoE.make_expert_params_mapping rules (ferry.refit.load.expert_params_mapping
    builds the same list), with stacked rules before them as vLLM's MoE models list them:
    experts.{e}.gate_proj/up_proj become experts.w13_weight [E, 2I, H] (gate rows then up rows
    per expert), down_proj becomes experts.w2_weight [E, H, I]."""
    from ferry.refit.load import expert_params_mapping
    E, I, H = 3, 4, 8
    g = torch.Generator().manual_seed(7)
    pre = "model.layers.0.mlp."
    sd = {}
    for e in range(E):
        sd[pre + "experts.%d.gate_proj.weight" % e] = torch.randn(I, H, generator=g)
        sd[pre + "experts.%d.up_proj.weight" % e] = torch.randn(I, H, generator=g)
        sd[pre + "experts.%d.down_proj.weight" % e] = torch.randn(H, I, generator=g)
    sd["model.layers.0.self_attn.q_proj.weight"] = torch.randn(H, H, generator=g)
    rules = list(RULES) + expert_params_mapping("gate_proj", "down_proj", "up_proj", E)
    # upstream's arguments by name, Mixtral's checkpoint names (its w1/w2/w3): the list
    # layer.py at c439a139 returns
    assert expert_params_mapping(ckpt_gate_proj_name="w1", ckpt_down_proj_name="w2",
                                 ckpt_up_proj_name="w3", num_experts=1) == [
        ("experts.w13_", "experts.0.w1.", 0, "w1"), ("experts.w2_", "experts.0.w2.", 0, "w2"),
        ("experts.w13_", "experts.0.w3.", 0, "w3")]
    assert rules[-1] == ("experts.w13_", "experts.%d.up_proj." % (E - 1), E - 1, "w3")
    name = unique("moe")
    with ferry.RefitSender(name, sd, buffer_bytes=512) as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        it = rx.updates(1, mapping=rules)
        tx.push(1)
        got = dict(it)
    w13, w2 = got[pre + "experts.w13_weight"], got[pre + "experts.w2_weight"]
    assert tuple(w13.shape) == (E, 2 * I, H) and tuple(w2.shape) == (E, H, I)
    for e in range(E):
        assert torch.equal(w13[e, :I], sd[pre + "experts.%d.gate_proj.weight" % e])
        assert torch.equal(w13[e, I:], sd[pre + "experts.%d.up_proj.weight" % e])
        assert torch.equal(w2[e], sd[pre + "experts.%d.down_proj.weight" % e])
    assert "model.layers.0.self_attn.qkv_proj.weight" in got
    with pytest.raises(ValueError, match="expert_params_mapping"):
        ferry.refit.load.targets_of("x", [("experts.w2_", "x", 0, "w9")])
