"""ferry.integrations against stand-ins of vLLM, SGLang and verl (python/tests/standins: their
classes, method names and arguments transcribed from the upstream files named in each header),
with a real model: the examples' transformer (examples/refit_engine.py) as a 2-way
tensor-parallel engine loads, through each adapter, what a trainer pushes with ferry.RefitSender,
and its logits are checked against the trainer's after each training step."""
import asyncio
import itertools
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import ferry  # noqa: E402

STANDINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standins")
_ENGINES = ("vllm", "sglang", "verl", "llama_tp")
_names = itertools.count()
TIMEOUT = 30


def unique(what):
    return "integ-%s-%d-%d" % (what, os.getpid(), next(_names))


@pytest.fixture(scope="module")
def standins():
    """The stand-in packages importable as vllm / sglang / verl for this module's tests only."""
    sys.path.insert(0, STANDINS)
    try:
        import llama_tp

        yield llama_tp
    finally:
        sys.path.remove(STANDINS)
        for m in list(sys.modules):
            if m.split(".")[0] in _ENGINES:
                del sys.modules[m]


class Trainer:
    """The examples' trainer model and optimizer; its state_dict is what a sender declares."""

    def __init__(self, L, seed=0):
        torch.manual_seed(seed)
        self.model = L.TrainerLM()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=2e-2)
        self.data = torch.randint(0, L.VOCAB, (33,), generator=torch.Generator().manual_seed(7))
        self.prompt = torch.tensor(L.example.PROMPT)

    def step(self):
        loss = F.cross_entropy(self.model(self.data[:-1]), self.data[1:])
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    @torch.no_grad()
    def logits(self):
        return self.model(self.prompt)

    def transient(self):
        """The weights as a framework hands them over: fresh tensors, one at a time."""
        return ((n, t.detach().clone()) for n, t in self.model.state_dict().items())


def assert_serves(L, trainer, models):
    got = L.tp_logits(models, trainer.prompt)
    want = trainer.logits()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), float((got - want).abs().max())


def assert_stale(L, trainer, models):
    got = L.tp_logits(models, trainer.prompt)
    assert not torch.allclose(got, trainer.logits(), rtol=1e-4, atol=1e-5)


def test_no_engine_imported():
    """Importing the adapters imports no engine; the engine classes need the engine."""
    code = ("import sys, ferry.integrations.vllm as v, ferry.integrations.sglang, "
            "ferry.integrations.verl as r\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang', 'verl')]\n"
            "assert not bad, bad\n"
            "for mod, cls in ((v, 'FerryWeightTransferEngine'), (r, 'FerryCheckpointEngine')):\n"
            "    try:\n"
            "        getattr(mod, cls)\n"
            "    except ImportError:\n"
            "        pass\n"
            "    else:\n"
            "        raise SystemExit(cls + ' built without its engine')\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(ferry.__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr


def test_vllm_worker_extension_lifecycle(standins):
    """--worker-extension-cls injected into a TP-2 LLM; control's clear / update drive sleep /
    wake_up / ferry_update / reset_prefix_cache; each rank serves each pushed version."""
    L = standins
    from vllm.entrypoints.llm import LLM
    from ferry.integrations import vllm as fv

    trainer = Trainer(L)
    name, cell = unique("vllm-ext"), unique("vllm-cell")
    models = [L.LlamaForCausalLM(r, 2) for r in range(2)]
    llm = LLM(models, worker_extension_cls=fv.EXTENSION, enable_sleep_mode=True)
    with ferry.RefitSender(name, trainer.model.state_dict()) as tx:
        attached = llm.collective_rpc("ferry_attach", args=(name,), kwargs={"timeout": TIMEOUT})
        assert [a["tp_rank"] for a in attached] == [0, 1]
        assert all(a["tensors"] == len(trainer.model.state_dict()) for a in attached)
        bridge = fv.lifecycle(llm, cell, timeout=TIMEOUT)
        ctl = ferry.Control(cell)
        try:
            ctl.wait_ranks(1, TIMEOUT)
            for step in (1, 2):
                trainer.step()
                assert_stale(L, trainer, models)
                before = L.CountingQuantMethod.calls
                llm.calls.clear()
                ctl.request("clear", TIMEOUT)
                assert llm.calls == ["reset_prefix_cache", "sleep(2)"]
                assert all(torch.isnan(p).all() for p in models[0].parameters())  # discarded
                tx.push(step, timeout=TIMEOUT)
                ctl.request("update", TIMEOUT)
                assert llm.calls[2:] == ["wake_up(weights)", "wake_up(kv_cache)",
                                         "reset_prefix_cache"]
                assert_serves(L, trainer, models)
                assert llm.collective_rpc("ferry_version") == [step, step]
                # vLLM's process_weights_after_loading ran on each rank's two o_proj layers
                assert L.CountingQuantMethod.calls - before == 2 * L.LAYERS
            assert ctl.status()["state"] == "serving"
        finally:
            ctl.close()
            bridge.close()
            llm.collective_rpc("ferry_detach")


class AsyncClient:
    """An async engine client over the stand-in LLM: its lifecycle calls as coroutines, the
    shape of vLLM's AsyncLLM (sleep, wake_up, reset_prefix_cache, collective_rpc awaited)."""

    def __init__(self, llm):
        self.llm = llm

    async def sleep(self, level=1):
        self.llm.sleep(level)

    async def wake_up(self, tags=None):
        self.llm.wake_up(tags)

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        return self.llm.reset_prefix_cache()

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return self.llm.collective_rpc(method, timeout, args, kwargs)


def test_vllm_lifecycle_async_client(standins):
    """lifecycle() over an async engine client runs its coroutines on the client's loop; without
    loop= the update fails, saying to pass it."""
    L = standins
    from vllm.entrypoints.llm import LLM
    from ferry.integrations import vllm as fv

    trainer = Trainer(L)
    name, cell = unique("vllm-async"), unique("vllm-async-cell")
    models = [L.LlamaForCausalLM(r, 2) for r in range(2)]
    llm = LLM(models, worker_extension_cls=fv.EXTENSION, enable_sleep_mode=True)
    client = AsyncClient(llm)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        with ferry.RefitSender(name, trainer.model.state_dict()) as tx:
            llm.collective_rpc("ferry_attach", args=(name,), kwargs={"timeout": TIMEOUT})
            trainer.step()
            tx.push(1, timeout=TIMEOUT)
            with fv.lifecycle(client, cell, timeout=TIMEOUT), ferry.Control(cell) as ctl:
                ctl.wait_ranks(1, TIMEOUT)
                with pytest.raises(ferry.Error, match="loop="):
                    ctl.request("clear", TIMEOUT)
            with fv.lifecycle(client, cell, timeout=TIMEOUT, loop=loop, initial_state="cleared"), \
                    ferry.Control(cell) as ctl:
                ctl.wait_ranks(1, TIMEOUT)
                llm.calls.clear()
                ctl.request("update", TIMEOUT)
                assert llm.calls == ["reset_prefix_cache"]  # not asleep: no wake_up
                assert_serves(L, trainer, models)
                trainer.step()
                ctl.request("clear", TIMEOUT)
                tx.push(2, timeout=TIMEOUT)
                ctl.request("update", TIMEOUT)
                assert llm.calls[1:] == ["reset_prefix_cache", "sleep(2)", "wake_up(weights)",
                                         "wake_up(kv_cache)", "reset_prefix_cache"]
                assert_serves(L, trainer, models)
            llm.collective_rpc("ferry_detach")
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join()
        loop.close()


def test_vllm_update_failure_reaches_controller(standins):
    """An update whose version never comes fails the controller's request, naming the cause."""
    L = standins
    from vllm.entrypoints.llm import LLM
    from ferry.integrations import vllm as fv

    trainer = Trainer(L)
    name, cell = unique("vllm-fail"), unique("vllm-fail-cell")
    llm = LLM([L.LlamaForCausalLM(0, 1)], worker_extension_cls=fv.EXTENSION,
              enable_sleep_mode=True)
    with ferry.RefitSender(name, trainer.model.state_dict()):
        llm.collective_rpc("ferry_attach", args=(name,), kwargs={"timeout": TIMEOUT})
        with fv.lifecycle(llm, cell, version=7, timeout=0.2), \
                ferry.Control(cell) as ctl:
            ctl.wait_ranks(1, TIMEOUT)
            ctl.request("clear", TIMEOUT)
            with pytest.raises(ferry.Error) as e:
                ctl.request("update", TIMEOUT)
            assert "rank 0" in str(e.value)
            assert ctl.rank_status(0)["state"] == "failed"
        llm.collective_rpc("ferry_detach")


def test_vllm_weight_transfer_engine(standins):
    """The "ferry" WeightTransferEngine: registered with the factory, created by the worker from
    weight_transfer_config, fed by trainer_send_weights from transient tensors."""
    L = standins
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.entrypoints.llm import LLM
    from ferry.integrations import vllm as fv

    fv.register()
    fv.register()  # idempotent
    engine_cls = WeightTransferEngineFactory._registry["ferry"]()
    assert engine_cls is fv.FerryWeightTransferEngine
    assert issubclass(engine_cls, WeightTransferEngine)

    trainer = Trainer(L)
    name = unique("vllm-wte")
    models = [L.LlamaForCausalLM(r, 2) for r in range(2)]
    llm = LLM(models, weight_transfer_config=SimpleNamespace(backend="ferry"))
    args = {"name": name, "timeout": TIMEOUT}
    try:
        for step in (1, 2):
            trainer.step()
            assert engine_cls.trainer_send_weights(trainer.transient(), args) == step
            if step == 1:  # attaches after the first push: it gets version 1 at once
                llm.init_weight_transfer_engine({"init_info": {"name": name,
                                                               "timeout": TIMEOUT}})
            assert_stale(L, trainer, models)
            llm.collective_rpc("start_weight_update")
            llm.update_weights({"update_info": {"version": step}})
            llm.collective_rpc("finish_weight_update")
            assert_serves(L, trainer, models)
        llm.collective_rpc("start_weight_update")
        with pytest.raises(ValueError, match="Invalid update_info"):
            llm.update_weights({"update_info": {"versoin": 3}})
    finally:
        llm.collective_rpc("shutdown")
        if "sender" in args:
            args["sender"].close()


def test_sglang_custom_loader_lifecycle(standins):
    """--custom-weight-loader ferry.integrations.sglang.load_weights in a TP-2 Engine; control's
    clear / update drive release / resume_memory_occupation, update_weights_from_tensor and
    flush_cache; each rank serves each pushed version."""
    L = standins
    from sglang.srt.entrypoints.engine import Engine
    from ferry.integrations import sglang as fs

    trainer = Trainer(L)
    name, cell = unique("sglang"), unique("sglang-cell")
    models = [L.LlamaForCausalLM(r, 2) for r in range(2)]
    engine = Engine(models, custom_weight_loader=[fs.LOADER])
    with ferry.RefitSender(name, trainer.model.state_dict()) as tx, \
            fs.lifecycle(engine, cell, name, timeout=TIMEOUT), ferry.Control(cell) as ctl:
        try:
            ctl.wait_ranks(1, TIMEOUT)
            for step in (1, 2):
                trainer.step()
                assert_stale(L, trainer, models)
                engine.calls.clear()
                ctl.request("clear", TIMEOUT)
                assert engine.calls == ["release(weights,kv_cache)"]
                tx.push(step, timeout=TIMEOUT)
                ctl.request("update", TIMEOUT)
                assert engine.calls[1:] == ["resume(weights)", "update_weights_from_tensor",
                                            "resume(kv_cache)", "flush_cache"]
                assert_serves(L, trainer, models)
                assert fs.receivers[name].version == step
            # the glue alone, flushing the cache itself
            trainer.step()
            tx.push(3, timeout=TIMEOUT)
            engine.calls.clear()
            assert fs.update_weights(engine, name, 3, TIMEOUT) == (True, "Success")
            assert engine.calls == ["update_weights_from_tensor", "flush_cache"]
            assert_serves(L, trainer, models)
            # SGLang refuses a loader its server was not started with
            plain = Engine([L.LlamaForCausalLM(0, 1)])
            with pytest.raises(NotImplementedError):
                fs.update_weights(plain, name, 3, TIMEOUT)
            with pytest.raises(ValueError, match="update requests"):
                fs.load_weights(models[0], trainer.model.state_dict().items())
        finally:
            rx = fs.receivers.pop(name, None)
            if rx is not None:
                rx.close()


class ServerAdapter:
    """What verl's rollout server adapter does with receive_weights(): loads every tensor."""

    def __init__(self, model):
        self.model = model

    async def update_weights(self, weights):
        self.model.load_weights([(n, t) async for n, t in weights])


def test_verl_checkpoint_engine(standins):
    """The "ferry" CheckpointEngine: registered, built through the registry with verl's
    arguments, topology from prepare(); trainer rank 0 pushes the transient tensors verl hands
    it (rank 1 drains them), each of two rollout ranks loads what receive_weights yields."""
    L = standins
    from verl.checkpoint_engine import base
    from ferry.integrations import verl as fverl

    cls = fverl.register()
    assert base.CheckpointEngineRegistry.get("ferry") is cls
    assert issubclass(cls, base.CheckpointEngine)

    trainer = Trainer(L)
    name = unique("verl")
    new = base.CheckpointEngineRegistry.new
    senders = [new("ferry", bucket_size=1 << 20, name=name, is_master=True, timeout=TIMEOUT),
               new("ferry", bucket_size=1 << 20, name=name, timeout=TIMEOUT)]
    rollout = [new("ferry", bucket_size=1 << 20, timeout=TIMEOUT) for _ in range(2)]
    models = [L.LlamaForCausalLM(r, 2) for r in range(2)]

    async def update():
        return await asyncio.gather(
            senders[0].send_weights(trainer.transient()),
            senders[1].send_weights(trainer.transient()),
            *[base.rollout_update_weights(e, ServerAdapter(m)) for e, m in zip(rollout, models)])

    try:
        first = None
        for step in (1, 2, 3):
            base.build_process_group(cls, senders, rollout)  # before each update, as verl does
            assert [e.rank for e in senders] == [0, -1] and [e.rank for e in rollout] == [1, 2]
            assert all(e.name == name for e in rollout)  # from rank 0's prepare()
            expect = rollout[0].expect
            trainer.step()
            assert_stale(L, trainer, models)
            sent = asyncio.run(update())
            assert sent[:2] == [expect, None]  # the version rank 0 announced
            for e in senders + rollout:
                e.finalize()
            assert_serves(L, trainer, models)
            assert [e.receiver.version for e in rollout] == [step, step] and expect == step
            first = first or senders[0].sender.sender
            assert senders[0].sender.sender is first  # the plan is kept between steps
    finally:
        for e in senders + rollout:
            e.close()


def test_generator_sender_plan(standins):
    """A generator whose names changed abandons that version with PlanChanged naming the tensor,
    and the next push plans anew (receivers get the new tensors); one that drops a tensor the
    plan has is refused, naming it. Pushes after the first stream: in parts, holding at most
    about the cap (plus the one tensor crossing into the next bucket)."""
    from ferry.integrations._common import GeneratorSender, RankReceiver
    from ferry.refit.stream import PlanChanged

    name = unique("gen")
    cap, each = 1 << 16, 4096 * 4
    tx = GeneratorSender(name, stream_cap=cap)
    try:
        tx.push([("a", torch.ones(4)), ("b", torch.zeros(2, 3))], timeout=TIMEOUT)
        rx = RankReceiver(name, TIMEOUT)
        try:
            got = {}

            def load():
                got.clear()
                return rx.load(lambda ws: got.update((n, t.clone()) for n, t in ws),
                               timeout=TIMEOUT)

            assert load() == 1
            assert got["a"].tolist() == [1.0] * 4 and tuple(got["b"].shape) == (2, 3)

            def weights(b):
                return [("a", torch.full((4,), 3.0))] + [
                    ("w%d" % i, torch.full((each // 4,), float(i))) for i in range(8)] + [
                    ("b", torch.full((2, 3), b))]

            with pytest.raises(PlanChanged, match="'w0'"):
                tx.push(weights(0.0), timeout=TIMEOUT)  # that version abandoned
            v = tx.push(weights(0.0), timeout=TIMEOUT)
            assert v > 1 and load() == v and got["w7"].tolist() == [7.0] * (each // 4)
            assert tx.push(weights(1.0), timeout=TIMEOUT) == v + 1  # streamed against the plan
            assert tx.sender.stream_info["parts"] > 1
            assert tx.sender.stream_info["held_max"] <= cap + each
            assert load() == v + 1 and got["b"].tolist() == [[1.0] * 3] * 2
            with pytest.raises(ValueError, match="'b'"):
                tx.push(weights(1.0)[:-1], timeout=TIMEOUT)
        finally:
            rx.close()
    finally:
        tx.close()


def test_generator_sender_binding_refusal(standins):
    """push(): a push that receivers refused only because they were binding (FERRY_ESTATE: the
    sender catches them up after the push) returns the version; any other failure is raised."""
    from ferry.integrations._common import GeneratorSender

    class Sender:
        def __init__(self, detail):
            self.version, self.detail, self.pushed = 0, detail, []

        def push_iter(self, version, weights, timeout=None):
            self.pushed.append((version, list(weights)))
            if self.detail:
                raise ferry.StateError(-21, self.detail)
            self.version = version
            return version

    state = str(ferry.StateError(-21))
    refused = "refit 'x' version 4: not committed by 'a' (%s), 'b' (%s); every other " \
              "receiver committed" % (state, state)
    tx = GeneratorSender("unused")
    tx.sender = Sender(refused)
    assert tx.push([("w", 1)], 4, TIMEOUT) == 4 and tx.sender.pushed == [(4, [("w", 1)])]
    tx.sender = Sender(None)
    assert tx.push([], None, TIMEOUT) == 1 and tx.sender.pushed == [(1, [])]
    tx.sender = Sender("refit 'x' version 7: not committed by 'a' (%s), 'b' (timed out, "
                       "dropped); every other receiver committed" % state)
    with pytest.raises(ferry.StateError):
        tx.push([], 7, TIMEOUT)
    tx.sender = Sender("refit 'x': seal before pushing")
    with pytest.raises(ferry.StateError):
        tx.push([], 7, TIMEOUT)
    tx.sender = None
