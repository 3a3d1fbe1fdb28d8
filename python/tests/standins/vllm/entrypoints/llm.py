"""Stand-in for vllm-project/vllm vllm/entrypoints/llm.py at commit
10fdb8f0d75a3ad1122b87020f1359d3fc51f2ca: LLM.sleep(level=1) (reset_prefix_cache(), then the
engine sleeps: every worker's sleep(level)), wake_up(tags=None), reset_prefix_cache(
reset_running_requests=False, reset_connector=False) -> bool, collective_rpc(method,
timeout=None, args=(), kwargs=None) -> one result per worker, init_weight_transfer_engine(request)
and update_weights(request) (a dict with "init_info" / "update_info" sent to every worker by
collective_rpc), transcribed.

Left out: the engine core, scheduler and generation. The workers are in this process, TP rank
r = worker r, called one after another (each with vllm.distributed's TP rank set to its own);
worker_cls and worker_extension_cls are resolved as WorkerWrapperBase.init_worker does. The
prefix cache is a set of prompts the stand-in serves from (calls are recorded in `calls`)."""
from types import SimpleNamespace

from vllm import distributed
from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.worker_base import inject_worker_extension


class LLM:
    def __init__(self, models, worker_extension_cls=None, weight_transfer_config=None,
                 enable_sleep_mode=False, dtype="float32") -> None:
        worker_class = type("Worker", (Worker,), {})
        if worker_extension_cls:
            inject_worker_extension(worker_class, worker_extension_cls)
        tp = len(models)
        vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(dtype=dtype, enable_sleep_mode=enable_sleep_mode),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, rank=0, world_size=tp,
                                            data_parallel_index=0),
            weight_transfer_config=weight_transfer_config)
        self.workers = [worker_class(vllm_config, r, r, m) for r, m in enumerate(models)]
        self.prefix_cache = set()
        self.calls = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        out = []
        for w in self.workers:
            distributed._current.update(rank=w.rank, world=len(self.workers))
            try:
                out.append(getattr(w, method)(*args, **(kwargs or {})))
            finally:
                distributed._current.update(rank=0, world=1)
        return out

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        self.calls.append("reset_prefix_cache")
        self.prefix_cache.clear()
        return True

    def sleep(self, level: int = 1):
        if not self.workers[0].model_config.enable_sleep_mode:
            raise ValueError("Sleep mode is not enabled (enable_sleep_mode=True)")
        self.reset_prefix_cache()
        self.calls.append("sleep(%d)" % level)
        self.collective_rpc("sleep", kwargs={"level": level})

    def wake_up(self, tags=None):
        self.calls.append("wake_up(%s)" % (",".join(tags) if tags else "all"))
        self.collective_rpc("wake_up", kwargs={"tags": tags})

    def init_weight_transfer_engine(self, request) -> None:
        init_info_dict = request["init_info"] if isinstance(request, dict) else request.init_info
        self.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info_dict})

    def update_weights(self, request) -> None:
        update_info_dict = request["update_info"] if isinstance(request, dict) \
            else request.update_info
        self.collective_rpc("update_weights", kwargs={"update_info": update_info_dict})
