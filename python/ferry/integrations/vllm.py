"""ferry for vLLM: a worker extension, a weight transfer engine "ferry", and control's clear /
update mapped onto the engine's sleep / wake_up (docs/INTEGRATIONS.md).

Worker extension (each worker process, on its own thread: collective_rpc runs the method there):

    llm = LLM(model, worker_extension_cls="ferry.integrations.vllm.FerryWorkerExtension",
              enable_sleep_mode=True, load_format="dummy")
    llm.collective_rpc("ferry_attach", args=("policy",))   # by name; each TP rank its own
    # the trainer: ferry.RefitSender("policy", model.state_dict()).push(v)
    llm.collective_rpc("ferry_update", args=(v,))          # load_weights(rx.updates(v)), then
                                                           # process_weights_after_loading
Control (the RL controller's ferry.Control("llm-0").request("clear" | "update")):

    bridge = ferry.integrations.vllm.lifecycle(llm, "llm-0")  # clear -> sleep(level=2);
                                                              # update -> wake_up(["weights"]),
                                                              # ferry_update, wake_up(["kv_cache"]),
                                                              # reset_prefix_cache()
Weight transfer engine (vllm/distributed/weight_transfer): register() adds "ferry" to
WeightTransferEngineFactory in this process (where the workers start: the installed distribution
declares it as the vLLM general plugin "ferry", python/pyproject.toml); FerryWeightTransferEngine
is built on first access, so importing this module imports no vLLM. init_info {"name",
"timeout"}; update_info {"version", "timeout"}.
"""
from typing import Any, Dict, Optional

from ._common import DEFAULT_TIMEOUT, GeneratorSender, LifecycleBridge, RankReceiver, call

# and FerryWeightTransferEngine, built on first access (so not in a star import)
__all__ = ["FerryWorkerExtension", "register", "lifecycle", "trainer_send_weights",
           "EXTENSION", "BACKEND"]

EXTENSION = "ferry.integrations.vllm.FerryWorkerExtension"  # --worker-extension-cls
BACKEND = "ferry"  # the weight transfer backend's name


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _after_loading(model, model_config, device) -> None:
    """vLLM's own post-load step (quantized layers repack, MLA decompresses), as its loaders
    run it after load_weights."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    process_weights_after_loading(model, model_config, device)


class FerryWorkerExtension:
    """Mixed into vLLM's worker class (--worker-extension-cls): its methods run in each worker
    process through LLM.collective_rpc / the engine client's collective_rpc, on the worker's
    own thread, and see the worker's model_runner, model_config and device."""

    def ferry_attach(self, name: str, tp_rank: Optional[int] = None,
                     timeout: Optional[float] = DEFAULT_TIMEOUT, mapping: Any = None) -> Dict:
        """Attaches this worker to the refit sender published as `name` (tp_rank: this
        worker's tensor-parallel rank; None: vLLM's). Returns {name, tp_rank, tensors}."""
        if getattr(self, "_ferry_rx", None) is not None:
            self._ferry_rx.close()
        rank = _tp_rank() if tp_rank is None else int(tp_rank)
        self._ferry_rx = RankReceiver(name, timeout, mapping, tp_rank=rank)
        return {"name": name, "tp_rank": rank, "tensors": len(self._ferry_rx.rx.manifest())}

    def ferry_update(self, version: Optional[int] = None,
                     timeout: Optional[float] = None) -> int:
        """Loads `version` (None: the newest pushed) through model_runner.model.load_weights,
        then process_weights_after_loading; returns the version loaded."""
        rx = getattr(self, "_ferry_rx", None)
        if rx is None:
            raise RuntimeError("ferry_update before ferry_attach")
        model = self.model_runner.model
        v = rx.load(model.load_weights, version, timeout)
        _after_loading(model, self.model_config, self.device)
        return v

    def ferry_version(self) -> int:
        """The version this worker loaded last (0: none)."""
        rx = getattr(self, "_ferry_rx", None)
        return 0 if rx is None else rx.version

    def ferry_detach(self) -> None:
        rx, self._ferry_rx = getattr(self, "_ferry_rx", None), None
        if rx is not None:
            rx.close()


def lifecycle(llm: Any, cell: str, sleep_level: Optional[int] = 2,
              version: Optional[int] = None, timeout: Optional[float] = DEFAULT_TIMEOUT,
              thread: bool = True, initial_state: str = "serving",
              loop: Any = None) -> LifecycleBridge:
    """A ferry control cell `cell` whose clear / update drive `llm` (vllm.LLM, or an engine
    client with its sleep, wake_up, reset_prefix_cache and collective_rpc, e.g. AsyncLLM, whose
    coroutines run on `loop`, the event loop it serves on): clear -> sleep(level) (sleep_level
    None: reset_prefix_cache() only, for an engine without sleep mode); update ->
    wake_up(["weights"]), collective_rpc("ferry_update") on every worker (the newest version,
    or `version`), wake_up(["kv_cache"]), reset_prefix_cache(). The workers must be attached
    (ferry_attach). Close the bridge when done."""
    state = {"asleep": False}

    def clear():
        if sleep_level is None:
            call(llm.reset_prefix_cache, loop=loop)
            return
        call(llm.sleep, level=sleep_level, loop=loop)
        state["asleep"] = True

    def update():
        if state["asleep"]:
            call(llm.wake_up, tags=["weights"], loop=loop)
        got = call(llm.collective_rpc, "ferry_update", args=(version, timeout), loop=loop)
        if len(set(got)) != 1:
            raise RuntimeError("workers loaded different versions: %s" % (got,))
        if state["asleep"]:
            call(llm.wake_up, tags=["kv_cache"], loop=loop)
            state["asleep"] = False
        call(llm.reset_prefix_cache, loop=loop)

    return LifecycleBridge(cell, clear, update, initial_state=initial_state, thread=thread)


def trainer_send_weights(iterator: Any, trainer_args: Any) -> int:
    """The trainer's side of the "ferry" backend: pushes every (name, tensor) the iterator
    yields. trainer_args: {"sender": a ferry.integrations GeneratorSender (or "name": a refit
    name, for a sender made here and returned under "sender"), "version": None (the last + 1),
    "timeout"}. Returns the version pushed."""
    args = trainer_args if isinstance(trainer_args, dict) else vars(trainer_args)
    sender = args.get("sender")
    if sender is None:
        sender = args["sender"] = GeneratorSender(args["name"])
    return sender.push(iterator, args.get("version"), args.get("timeout", DEFAULT_TIMEOUT))


def _build_engine_class():
    from dataclasses import dataclass

    from vllm.distributed.weight_transfer.base import (WeightTransferEngine,
                                                       WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)

    @dataclass
    class FerryInitInfo(WeightTransferInitInfo):
        name: str
        timeout: Optional[float] = DEFAULT_TIMEOUT

    @dataclass
    class FerryUpdateInfo(WeightTransferUpdateInfo):
        version: Optional[int] = None
        timeout: Optional[float] = None

    class FerryWeightTransferEngine(WeightTransferEngine):
        """vLLM's WeightTransferEngine over a ferry refit receiver: init_transfer_engine
        attaches by name, receive_weights loads a version through the model's load_weights
        (whole tensors; its weight_loaders cut this rank's shards) and runs vLLM's
        process_weights_after_loading. Weights are applied in place: start / finish are
        no-ops. trainer_send_weights pushes an iterator of (name, tensor)."""

        init_info_cls = FerryInitInfo
        update_info_cls = FerryUpdateInfo

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.receiver: Optional[RankReceiver] = None

        def init_transfer_engine(self, init_info):
            if self.receiver is not None:
                self.receiver.close()
            self.receiver = RankReceiver(init_info.name, init_info.timeout)

        def start_weight_update(self):
            pass

        def finish_weight_update(self):
            pass

        def receive_weights(self, update_info, load_weights=None):
            if self.receiver is None:
                raise RuntimeError("ferry weight transfer: init_transfer_engine() first")
            model = getattr(self, "model", None)
            load = load_weights if load_weights is not None else model.load_weights
            self.receiver.load(load, update_info.version, update_info.timeout)
            if model is not None:
                _after_loading(model, self.model_config, self.device)

        def shutdown(self):
            if self.receiver is not None:
                self.receiver.close()
                self.receiver = None

        trainer_send_weights = staticmethod(trainer_send_weights)

    FerryWeightTransferEngine.__module__ = __name__
    return FerryWeightTransferEngine


_built: Dict[str, Any] = {}


def __getattr__(attr):  # PEP 562: the engine class exists only once vLLM is imported
    if attr == "FerryWeightTransferEngine":
        if attr not in _built:
            _built[attr] = _build_engine_class()
        return _built[attr]
    raise AttributeError("module %r has no attribute %r" % (__name__, attr))


def register(name: str = BACKEND) -> None:
    """Registers the "ferry" weight transfer engine with vLLM's WeightTransferEngineFactory
    (lazily: the class is built when vLLM creates an engine). Idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if name not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(name, __name__, "FerryWeightTransferEngine")
