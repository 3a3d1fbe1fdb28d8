"""What the engine and framework adapters share: an engine rank's receiver (attach by name, load a
version through the model's own load_weights), a trainer's sender fed by a generator of
transient tensors (streamed, push_iter), and the bridge from a ferry control cell to an engine's lifecycle calls.

Nothing here imports an engine or a framework."""
import asyncio
import inspect
import logging
import threading
from typing import Any, Callable, Iterable, Optional, Tuple

from ..control import ControlCell, ControlRank
from ..errors import StateError, Timeout
from ..refit import RefitReceiver, RefitSender

log = logging.getLogger("ferry")

DEFAULT_TIMEOUT = 60.0  # seconds for one exchange (attach, a version to land)


def call(fn: Callable[..., Any], *args: Any, loop: Optional[asyncio.AbstractEventLoop] = None,
         **kwargs: Any) -> Any:
    """fn(*args, **kwargs); when that is a coroutine (an async engine client: vLLM's AsyncLLM,
    SGLang's tokenizer manager), it runs on `loop`, the engine's event loop, and this waits."""
    out = fn(*args, **kwargs)
    if not inspect.isawaitable(out):
        return out
    if loop is None:
        if inspect.iscoroutine(out):
            out.close()
        raise TypeError("loop= needed: %s is a coroutine function; pass the event loop the "
                        "engine client runs on" % getattr(fn, "__qualname__", fn))
    return asyncio.run_coroutine_threadsafe(_awaited(out), loop).result()


async def _awaited(aw):
    return await aw


class RankReceiver:
    """One engine rank's refit receiver, attached to the sender published as `name`.

    It binds one flat ferry buffer with every tensor whole, so the model's load_weights gets
    the trainer's (Hugging Face) names and full tensors, as it does from a checkpoint, and its
    weight_loaders cut this rank's shards (vLLM and SGLang models slice by their own TP rank).
    mapping: RefitReceiver.updates' trainer -> engine names (None: the trainer's names)."""

    def __init__(self, name: str, timeout: Optional[float] = DEFAULT_TIMEOUT,
                 mapping: Any = None, tp_rank: int = 0) -> None:
        self.name, self.timeout, self.mapping, self.tp_rank = name, timeout, mapping, tp_rank
        self.rx = RefitReceiver(name, timeout=timeout)
        try:
            self.rx.tensors()  # bind the flat buffer now; the views are not kept
        except BaseException:
            self.rx.close()
            raise
        self.version = 0  # the version last loaded into the model

    def load(self, load_weights: Callable[[Iterable[Tuple[str, Any]]], Any],
             version: Optional[int] = None, timeout: Optional[float] = None) -> int:
        """Waits for `version` (None: the newest the sender pushed, at least 1; loading it again
        is harmless), feeds it to load_weights(iterable of (name, tensor)) and returns it.
        Raises when a newer push tore the bytes while they were loading."""
        t = self.timeout if timeout is None else timeout
        v = self.rx.wait(version, timeout=t)
        if version is not None and v != version:
            raise RuntimeError("refit '%s': version %d asked, %d committed"
                               % (self.name, version, v))
        load_weights(self.rx.updates(v, mapping=self.mapping, timeout=t))
        if self.rx.committed != v:
            raise RuntimeError("refit '%s': version %d changed while loading" % (self.name, v))
        self.version = v
        return v

    def close(self) -> None:
        self.rx.close()


def _refused_while_binding(e: StateError) -> bool:
    """The push's error names the receivers that did not commit, each with its status ("'peer'
    (Invalid state)"): true when every one of them refused with FERRY_ESTATE (it bound a buffer
    as the version landed), which the sender's catch-up repairs."""
    detail = e.detail or ""
    state = "' (%s" % str(StateError(e.status)).split(":")[0]  # ferry_strerror(FERRY_ESTATE)
    named = detail.count("' (")
    return named > 0 and named == detail.count(state)


class GeneratorSender:
    """A trainer's sender fed by a generator of (name, tensor) whose tensors exist only while it
    yields them (FSDP full_tensor(), Megatron -> HF conversion): a streaming ferry.RefitSender
    (no state_dict) pushing each version with push_iter. The first push plans (its tensors are
    staged in host memory, declared, pushed whole, and the copies freed); every later one
    streams under the sender's stream_cap, holding each tensor only until the buckets it lies in
    went, so the whole model is never copied on the trainer. A changed name, dtype or shape
    raises ferry.refit.stream.PlanChanged naming it and abandons that version; the next push
    plans anew. sender_kwargs go to ferry.RefitSender (stream_cap=, buffer_bytes=, ...)."""

    def __init__(self, name: str, **sender_kwargs: Any) -> None:
        self.name, self.kwargs = name, sender_kwargs
        self.sender: Optional[RefitSender] = None

    def push(self, weights: Iterable[Tuple[str, Any]], version: Optional[int] = None,
             timeout: Optional[float] = DEFAULT_TIMEOUT) -> int:
        """Consumes `weights` on this thread (its collectives run here) while pushing them as
        `version` (None: the last + 1); returns it once every receiver in the push committed it.

        Receivers that attach while the push runs are not in it, and one that binds its buffer
        while the version lands there refuses it (FERRY_ESTATE: "a destination was bound while
        version V was landing"): the sender catches each of them up to this version from its
        retained copy once the push ends. So a push refused only that way is logged, not
        raised; any other failure is raised."""
        if self.sender is None:
            self.sender = RefitSender(self.name, **self.kwargs)
        version = self.sender.version + 1 if version is None else version
        try:
            return self.sender.push_iter(version, weights, timeout=timeout)
        except StateError as e:
            if not _refused_while_binding(e):
                raise
            log.info("refit '%s': version %d: %s; those receivers catch up to it", self.name,
                     version, e.detail or e)
            return version

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


class LifecycleBridge:
    """A ferry control rank for an engine whose lifecycle calls are engine-wide (vLLM's LLM,
    SGLang's Engine): its cell has one rank, driven here; control's clear runs clear() and its
    update runs update(), which returns once every TP rank loaded the version (collective_rpc
    and update_weights_from_tensor return only then), so the controller's request means what it
    means with one control rank per TP rank.

    thread=True runs the rank's loop on a thread of its own (the engine's calls then happen on
    it: the controller's clear is the promise that no request is running); thread=False leaves
    step() to the caller's loop."""

    def __init__(self, cell: str, clear: Callable[[], Any], update: Callable[[], Any],
                 initial_state: str = "serving", thread: bool = True) -> None:
        self.cell = ControlCell(cell, 1)
        try:
            self.rank = ControlRank(cell, 0, initial_state=initial_state)
        except BaseException:
            self.cell.close()
            raise
        self.clear, self.update = clear, update
        self._stop = threading.Event()
        self._thread = None
        if thread:
            self._thread = threading.Thread(target=self._loop, name="ferry-lifecycle",
                                            daemon=True)
            self._thread.start()

    def step(self, timeout: Optional[float] = None) -> Any:
        """One command: waits up to `timeout` seconds, runs its handler, acks (ferry.Timeout
        when none came)."""
        return self.rank.step(clear=self.clear, update=self.update, timeout=timeout)

    def _loop(self):
        while not self._stop.is_set():
            try:
                self.step(timeout=0.2)
            except Timeout:
                continue

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.rank.close()
        self.cell.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
