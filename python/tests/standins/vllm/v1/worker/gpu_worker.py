"""Stand-in for vllm-project/vllm vllm/v1/worker/gpu_worker.py.

sleep / wake_up transcribed from commit 35d5cda123ec28581759b6d34cde8052314fb1e6: level 1
offloads the weights (kept, restored by wake_up) and discards the KV cache; level 2 discards
both (the weights' contents are lost; named buffers are saved and restored by wake_up);
wake_up(tags) reallocates "weights" and/or "kv_cache" (None: both). Here "discarded" weights are
overwritten with NaN, so a model served before they are reloaded shows it.

init_weight_transfer_engine / start_weight_update / update_weights / finish_weight_update: the
state machine of a later gpu_worker.py, NOT pinned to a commit: the index the search tools read
holds vllm-project/vllm's gpu_worker.py at 35d5cda1 only, which predates these methods, and no
later upstream copy (checked again in session 17: only forks' and downstream copies have them).
What is pinned is the caller's side: vllm/entrypoints/llm.py at
10fdb8f0d75a3ad1122b87020f1359d3fc51f2ca, which sends
collective_rpc("init_weight_transfer_engine", kwargs={"init_info": ...}) and
collective_rpc("update_weights", kwargs={"update_info": ...})): the engine comes from
WeightTransferEngineFactory.create_engine(config, vllm_config, device, model); update_weights
needs an active update (start ... finish). Left out: CUDA, memory pools, distributed init,
profiler, execute_model (the model runs on CPU here)."""
from types import SimpleNamespace

import torch

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory


class Worker:
    def __init__(self, vllm_config, local_rank: int, rank: int, model) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.parallel_config = vllm_config.parallel_config
        self.local_rank, self.rank = local_rank, rank
        self.device = torch.device("cpu")
        self.model_runner = SimpleNamespace(model=model)
        self._sleep_saved_buffers = {}
        self._offloaded = None
        self.kv_cache_alive = True
        self.weight_transfer_engine = None
        self._weight_update_active = False

    def sleep(self, level: int = 1) -> None:
        model = self.model_runner.model
        if level == 2:
            self._sleep_saved_buffers = {n: b.cpu().clone() for n, b in model.named_buffers()}
        self._offloaded = {n: p.detach().clone() for n, p in model.named_parameters()} \
            if level == 1 else None
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        self.kv_cache_alive = False

    def wake_up(self, tags=None) -> None:
        model = self.model_runner.model
        if (tags is None or "weights" in tags) and self._offloaded is not None:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(self._offloaded[n])
            self._offloaded = None
        if len(self._sleep_saved_buffers):
            for name, buffer in model.named_buffers():
                if name in self._sleep_saved_buffers:
                    buffer.data.copy_(self._sleep_saved_buffers[name].data)
            self._sleep_saved_buffers = {}
        if tags is None or "kv_cache" in tags:
            self.kv_cache_alive = True

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        config = self.vllm_config.weight_transfer_config
        if config is None:
            raise RuntimeError("weight transfer is not configured (weight_transfer_config)")
        self.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
            config, self.vllm_config, self.device, self.model_runner.model)
        self.weight_transfer_engine.init_transfer_engine(
            self.weight_transfer_engine.parse_init_info(init_info))

    def _check_weight_transfer_engine(self) -> None:
        if self.weight_transfer_engine is None:
            raise RuntimeError("init_weight_transfer_engine must be called first")

    def start_weight_update(self) -> None:
        self._check_weight_transfer_engine()
        if self._weight_update_active:
            raise RuntimeError("start_weight_update called while a weight update is already "
                               "active. Call finish_weight_update first.")
        self.weight_transfer_engine.start_weight_update()
        self._weight_update_active = True

    def update_weights(self, update_info: dict) -> None:
        self._check_weight_transfer_engine()
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            self.weight_transfer_engine.update_weights(update_info)
        except BaseException:
            self._weight_update_active = False
            raise

    def finish_weight_update(self) -> None:
        self._check_weight_transfer_engine()
        if not self._weight_update_active:
            raise RuntimeError("finish_weight_update called without a matching "
                               "start_weight_update.")
        self.weight_transfer_engine.finish_weight_update()
        self._weight_update_active = False

    def shutdown(self) -> None:
        if self.weight_transfer_engine is not None:
            self.weight_transfer_engine.shutdown()
