"""Stand-in for volcengine/verl verl/checkpoint_engine/base.py at commit
11eb3d0d7dada6e90f3aaba7d1856f08d1573095: TensorMeta, CheckpointEngineRegistry (register(backend)
decorator, get, new(backend, *args, **kwargs) raising ValueError for an unknown backend) and
CheckpointEngine (abstract prepare, classmethod build_topology(trainer_world_size,
rollout_world_size, metadata), init_process_group(**kwargs), finalize, async
send_weights(weights generator), async receive_weights()), transcribed; and the two calls of
the rollout side that drive an engine, from CheckpointEngineWorker and CheckpointEngineManager
in the same file: CheckpointEngineRegistry.new(backend, bucket_size=..., **engine_kwargs), and
rollout_update_weights(): weights = engine.receive_weights(); await
server_adapter.update_weights(weights). build_process_group() is transcribed as a function
(prepare on every worker, build_topology, init_process_group with each rank's share, every list
as long as its world). Left out: Ray, worker groups, replicas, ColocatedCheckpointEngine and
CheckpointEngineWithCache."""
from abc import ABC, abstractmethod
from typing import Any, Generator, TypedDict

import torch


class TensorMeta(TypedDict):
    name: str
    shape: torch.Size
    dtype: torch.dtype
    offset: int


class CheckpointEngineRegistry:
    _registry: dict = {}

    def register(backend: str):
        def wrapper(cls):
            CheckpointEngineRegistry._registry[backend] = cls
            return cls

        return wrapper

    @classmethod
    def get(cls, backend: str):
        return cls._registry[backend]

    @classmethod
    def new(cls, backend: str, *args, **kwargs):
        if backend not in cls._registry:
            raise ValueError(f"Checkpoint engine {backend} not registered")
        return cls._registry[backend](*args, **kwargs)


class CheckpointEngine(ABC):
    @abstractmethod
    def prepare(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    @abstractmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list[dict]):
        raise NotImplementedError

    @abstractmethod
    def init_process_group(self, **kwargs):
        raise NotImplementedError

    @abstractmethod
    def finalize(self):
        raise NotImplementedError

    @abstractmethod
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None]):
        raise NotImplementedError

    @abstractmethod
    async def receive_weights(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        raise NotImplementedError


def build_process_group(backend_cls, trainer, rollout):
    """CheckpointEngineManager.build_process_group over lists of engines (no Ray)."""
    metadata = [e.prepare() for e in trainer] + [e.prepare() for e in rollout]
    trainer_kwargs, rollout_kwargs = backend_cls.build_topology(len(trainer), len(rollout),
                                                                metadata)
    for k, v in trainer_kwargs.items():
        assert len(v) == len(trainer), f"trainer_kwargs[{k}] must have length of {len(trainer)}"
    for k, v in rollout_kwargs.items():
        assert len(v) == len(rollout), f"rollout_kwargs[{k}] must have length of {len(rollout)}"
    for group, kwargs in ((trainer, trainer_kwargs), (rollout, rollout_kwargs)):
        for i, e in enumerate(group):
            e.init_process_group(**{k: v[i] for k, v in kwargs.items()})


async def rollout_update_weights(engine, server_adapter):
    """CheckpointEngineWorker.update_weights."""
    weights = engine.receive_weights()
    await server_adapter.update_weights(weights)
