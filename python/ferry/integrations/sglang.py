"""ferry for SGLang: a custom weight loader, the glue that asks every TP rank to load a version
through update_weights_from_tensor, and control's clear / update mapped onto the engine's
release_memory_occupation / resume_memory_occupation (docs/INTEGRATIONS.md).

    # the server (each TP rank's scheduler process runs the loader)
    python -m sglang.launch_server ... --custom-weight-loader ferry.integrations.sglang.load_weights
    # or sgl.Engine(..., custom_weight_loader=[ferry.integrations.sglang.LOADER])

    # the trainer pushes: ferry.RefitSender("policy", sd).push(v); then
    ferry.integrations.sglang.update_weights(engine, "policy", v)
    # = engine.update_weights_from_tensor(named_tensors=update_request("policy", v),
    #                                     load_format=LOADER, flush_cache=True)

update_weights_from_tensor hands every TP rank the same small request (a name and a version,
not weights); the loader, in that rank's process, attaches once to the refit sender by name and
loads the version through the model's load_weights (whole tensors: SGLang's weight_loaders cut
the rank's shards). Importing this module imports no SGLang.
"""
from typing import Any, Dict, List, Optional, Tuple

from ._common import DEFAULT_TIMEOUT, LifecycleBridge, RankReceiver

__all__ = ["LOADER", "load_weights", "update_request", "update_weights", "lifecycle",
           "receivers"]

LOADER = "ferry.integrations.sglang.load_weights"  # --custom-weight-loader / load_format
_PREFIX = "ferry-refit:"

receivers: Dict[str, RankReceiver] = {}  # this process's receivers, by refit name


def update_request(name: str, version: Optional[int] = None,
                   timeout: Optional[float] = DEFAULT_TIMEOUT) -> List[Tuple[str, Any]]:
    """The named_tensors of update_weights_from_tensor that make each TP rank load `version`
    (None: the newest pushed) of the refit sender `name`: one entry, ("ferry-refit:NAME",
    int64 tensor [version or 0, timeout in ms or -1])."""
    import torch

    ms = -1 if timeout is None else int(timeout * 1000)
    return [(_PREFIX + name, torch.tensor([version or 0, ms], dtype=torch.int64))]


def _parse(named_tensors):
    named_tensors = list(named_tensors)
    if len(named_tensors) != 1 or not str(named_tensors[0][0]).startswith(_PREFIX):
        raise ValueError("%s loads ferry update requests (update_request()), not %d tensors "
                         "named %s" % (LOADER, len(named_tensors),
                                       [n for n, _ in named_tensors][:3]))
    name, t = named_tensors[0]
    version, ms = (int(x) for x in t.reshape(-1).tolist())
    return name[len(_PREFIX):], (version or None), (None if ms < 0 else ms / 1000.0)


def load_weights(model: Any, named_tensors: List[Tuple[str, Any]]) -> None:
    """The custom weight loader (SGLang calls custom_loader(self.model, named_tensors) in each
    TP rank's ModelRunner.update_weights_from_tensor): attaches to the refit sender named in
    the request (once per process) and loads the version through model.load_weights."""
    name, version, timeout = _parse(named_tensors)
    rx = receivers.get(name)
    if rx is None:
        rx = receivers[name] = RankReceiver(name, DEFAULT_TIMEOUT if timeout is None else timeout)
    rx.load(model.load_weights, version, timeout)


def update_weights(engine: Any, name: str, version: Optional[int] = None,
                   timeout: Optional[float] = DEFAULT_TIMEOUT, flush_cache: bool = True) -> Any:
    """Makes every TP rank of `engine` (sglang.Engine) load `version` of the refit sender
    `name`; with flush_cache the prefix cache is flushed after. Raises when a rank failed."""
    out = engine.update_weights_from_tensor(named_tensors=update_request(name, version, timeout),
                                            load_format=LOADER, flush_cache=flush_cache)
    if isinstance(out, tuple) and out and out[0] is False:
        raise RuntimeError("sglang update_weights_from_tensor: %s" % (out[1:],))
    return out


def lifecycle(engine: Any, cell: str, name: str, version: Optional[int] = None,
              timeout: Optional[float] = DEFAULT_TIMEOUT, release: bool = True,
              rest_tags: Tuple[str, ...] = ("kv_cache",), thread: bool = True,
              initial_state: str = "serving") -> LifecycleBridge:
    """A ferry control cell `cell` whose clear / update drive `engine` (sglang.Engine): clear
    -> release_memory_occupation() (release False: flush_cache() only); update ->
    resume_memory_occupation(["weights"]), update_weights(engine, name, version),
    resume_memory_occupation(rest_tags) (add "cuda_graph" where the SGLang release takes it),
    flush_cache(). Close the bridge when done."""
    state = {"released": False}

    def clear():
        if not release:
            engine.flush_cache()
            return
        engine.release_memory_occupation()
        state["released"] = True

    def update():
        if state["released"]:
            engine.resume_memory_occupation(tags=["weights"])
        update_weights(engine, name, version, timeout, flush_cache=False)
        if state["released"]:
            engine.resume_memory_occupation(tags=list(rest_tags))
            state["released"] = False
        engine.flush_cache()

    return LifecycleBridge(cell, clear, update, initial_state=initial_state, thread=thread)
