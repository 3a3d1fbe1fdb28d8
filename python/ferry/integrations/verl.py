"""ferry for verl: a CheckpointEngine registered as "ferry" (verl/checkpoint_engine/base.py's
shape: prepare, build_topology, init_process_group, finalize, async send_weights(generator),
async receive_weights()), docs/INTEGRATIONS.md.

    ferry.integrations.verl.register()          # in the trainer's and the rollout's processes
    # config: actor_rollout_ref.rollout.checkpoint_engine.backend=ferry
    #         ...checkpoint_engine.engine_kwargs.ferry.name=policy   (the refit name)

The trainer's rank 0 pushes each version from the generator verl hands it (FSDP full_tensor(),
Megatron -> HF: transient tensors, copied into the sender's own host tensors as they come; the
other trainer ranks only drain it, as they must to run its collectives); each rollout rank
attaches to the sender by name and yields the newest version's tensors as they are committed.
No NCCL group: init_process_group only records the rank. Importing this module imports no verl;
FerryCheckpointEngine is built on first access.
"""
import asyncio
import functools
from typing import Any, AsyncGenerator, Dict, Optional, Tuple

from ._common import DEFAULT_TIMEOUT, GeneratorSender, RankReceiver

__all__ = ["register", "BACKEND"]  # and FerryCheckpointEngine, built on first access

BACKEND = "ferry"


class _FerryCheckpointEngine:
    """verl's CheckpointEngine over ferry refit (the class verl sees, FerryCheckpointEngine,
    adds verl's base class). name: the refit name; bucket_size: the sender's bucket bytes
    (verl's update_weights_bucket_megabytes); timeout: seconds for one version; other keyword
    arguments go to ferry.RefitSender (cast=, directory=, ...)."""

    def __init__(self, bucket_size: int = 0, name: str = "ferry-verl", is_master: bool = False,
                 timeout: Optional[float] = DEFAULT_TIMEOUT, **sender_kwargs: Any) -> None:
        self.bucket_size, self.name, self.is_master = bucket_size, name, is_master
        self.timeout = timeout
        if bucket_size:
            sender_kwargs.setdefault("buffer_bytes", bucket_size)
        self.sender_kwargs = sender_kwargs
        self.rank: Optional[int] = None
        self.world_size: Optional[int] = None
        self.sender: Optional[GeneratorSender] = None
        self.receiver: Optional[RankReceiver] = None
        self.next_version = 1  # trainer rank 0: what the next send_weights pushes
        self.expect: Optional[int] = None  # rollout: at least this version, from the topology

    def prepare(self) -> Dict[str, Any]:
        """No buckets to allocate (the sender's are ferry's). The metadata: the refit name and,
        from the trainer's rank 0, the version its next send_weights pushes: rollout ranks load
        that one (or a newer one), not an older one the sender still holds (a rollout rank
        opened after the trainer's first steps would otherwise load that at once)."""
        if self.is_master or self.rank == 0:
            return {"name": self.name, "version": self.next_version}
        return {"name": self.name}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list) -> Tuple[Dict[str, list], Dict[str, list]]:
        """Trainer rank 0 sends (rank 0), its other ranks only drain (rank -1); every rollout
        rank receives (ranks 1..N). All use the name rank 0 prepared."""
        master = (metadata[0] or {}) if metadata else {}
        name, version = master.get("name"), master.get("version")
        world = rollout_world_size + 1
        trainer = {"rank": [0] + [-1] * (trainer_world_size - 1),
                   "world_size": [world] * trainer_world_size,
                   "name": [name] * trainer_world_size}
        rollout = {"rank": list(range(1, rollout_world_size + 1)),
                   "world_size": [world] * rollout_world_size,
                   "name": [name] * rollout_world_size,
                   "version": [version] * rollout_world_size}
        return trainer, rollout

    def init_process_group(self, rank: int, world_size: int, name: Optional[str] = None,
                           version: Optional[int] = None, **_: Any) -> None:
        self.rank, self.world_size = int(rank), int(world_size)
        if name:
            self.name = name
        self.expect = version  # a rollout rank: the version the next receive_weights loads

    def finalize(self) -> None:
        """Keeps the sender and the receivers: the next step reuses the plan and the links."""

    async def send_weights(self, weights) -> Optional[int]:
        """Trainer: rank 0 pushes every (name, tensor) `weights` yields as the version it
        announced in prepare() and returns it once every receiver in the push committed it
        (rollout ranks still attaching catch up to it); other ranks drain `weights`."""
        if self.rank is not None and self.rank < 0:
            for _ in weights:
                pass
            return None
        if self.sender is None:
            self.sender = GeneratorSender(self.name, **self.sender_kwargs)
        # the generator runs the trainer's collectives (full_tensor): it is consumed on this
        # thread, part by part as the push streams it (rollout ranks attaching or binding
        # concurrently, the first step, get this version from the sender's retained copy once
        # the push ends; the push waits for the others)
        sent = self.sender.push(weights, self.next_version, self.timeout)
        self.next_version = sent + 1
        return sent

    async def receive_weights(self) -> AsyncGenerator[Tuple[str, Any], None]:
        """Rollout: yields (name, tensor) of the version the trainer's rank 0 announced in
        prepare() (or a newer one; without one: newer than the last received), as views of this
        rank's flat buffer, valid until the next version lands."""
        loop = asyncio.get_running_loop()
        if self.receiver is None:
            self.receiver = await loop.run_in_executor(None, functools.partial(
                RankReceiver, self.name, self.timeout))
        rx = self.receiver
        v = await rx.rx.wait_async(max(rx.version + 1, self.expect or 0), timeout=self.timeout)
        for name, tensor in rx.rx.updates(v, timeout=self.timeout):  # committed: no waiting
            yield name, tensor
        if rx.rx.committed != v:
            raise RuntimeError("ferry checkpoint engine: version %d changed while loading" % v)
        rx.version = v

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()


def _build():
    from verl.checkpoint_engine.base import CheckpointEngine

    cls = type("FerryCheckpointEngine", (_FerryCheckpointEngine, CheckpointEngine),
               {"__module__": __name__, "__doc__": _FerryCheckpointEngine.__doc__})
    return cls


_built: Dict[str, Any] = {}


def __getattr__(attr):  # PEP 562: the class exists only once verl is imported
    if attr == "FerryCheckpointEngine":
        if attr not in _built:
            _built[attr] = _build()
        return _built[attr]
    raise AttributeError("module %r has no attribute %r" % (__name__, attr))


def register(backend: str = BACKEND):
    """Registers FerryCheckpointEngine with verl's CheckpointEngineRegistry as `backend`;
    returns the class."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    cls = __getattr__("FerryCheckpointEngine")
    return CheckpointEngineRegistry.register(backend)(cls)
