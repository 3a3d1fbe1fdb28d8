"""Stand-in for sgl-project/sglang python/sglang/srt/entrypoints/engine.py at commit
001067fffe33427bee0ed2f007fb7551a1d76b44: Engine.update_weights_from_tensor(named_tensors,
load_format=None, flush_cache=True) (one MultiprocessingSerializer payload per TP rank; each
rank's scheduler deserializes its own, serialized_named_tensors[tp_rank], and calls its
ModelRunner.update_weights_from_tensor; the cache is flushed after a success when flush_cache),
release_memory_occupation(tags=None), resume_memory_occupation(tags=None) and flush_cache(),
transcribed as calls. Left out: the tokenizer manager, schedulers and processes (the TP ranks'
model runners are in this process, called in turn), generation. Memory release is modelled:
releasing "weights" (tags None: weights and kv_cache) overwrites every parameter with NaN, as
torch_memory_saver's pause loses the contents; resume reallocates, contents not restored."""
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.utils import MultiprocessingSerializer


@dataclass
class ServerArgs:
    tp_size: int = 1
    custom_weight_loader: Optional[List[str]] = field(default=None)

    def __post_init__(self):
        if self.custom_weight_loader is None:
            self.custom_weight_loader = []


class Engine:
    def __init__(self, models, custom_weight_loader=None) -> None:
        self.server_args = ServerArgs(tp_size=len(models),
                                      custom_weight_loader=custom_weight_loader)
        self.model_runners = [ModelRunner(m, r, len(models), self.server_args)
                              for r, m in enumerate(models)]
        self.released = set()
        self.calls = []

    def update_weights_from_tensor(self, named_tensors, load_format: Optional[str] = None,
                                   flush_cache: bool = True):
        serialized_named_tensors = [MultiprocessingSerializer.serialize(named_tensors)
                                    for _ in range(self.server_args.tp_size)]
        self.calls.append("update_weights_from_tensor")
        if "weights" in self.released:
            return False, "weights are released"
        for runner in self.model_runners:
            success, message = runner.update_weights_from_tensor(
                named_tensors=MultiprocessingSerializer.deserialize(
                    serialized_named_tensors[runner.tp_rank]),
                load_format=load_format)
            if not success:
                return success, message
        if flush_cache:
            self.flush_cache()
        return True, "Success"

    def flush_cache(self):
        self.calls.append("flush_cache")
        return True

    def release_memory_occupation(self, tags: Optional[List[str]] = None):
        tags = ["weights", "kv_cache"] if tags is None else tags
        self.calls.append("release(%s)" % ",".join(tags))
        if "weights" in tags:
            with torch.no_grad():
                for runner in self.model_runners:
                    for p in runner.model.parameters():
                        p.fill_(float("nan"))
        self.released |= set(tags)

    def resume_memory_occupation(self, tags: Optional[List[str]] = None):
        tags = ["weights", "kv_cache"] if tags is None else tags
        self.calls.append("resume(%s)" % ",".join(tags))
        self.released -= set(tags)
