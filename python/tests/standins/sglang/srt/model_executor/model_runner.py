"""Stand-in for sgl-project/sglang python/sglang/srt/model_executor/model_runner.py at commit
0005834cdb2a5b7472789ccbf0d3361b5cf853b8: ModelRunner.update_weights_from_tensor(named_tensors,
load_format=None), transcribed: each tensor unwrapped for this TP rank and moved to the device,
then load_format "direct" -> _model_load_weights_direct, a load_format listed in
server_args.custom_weight_loader -> dynamic_import(load_format)(self.model, named_tensors),
None -> self.model.load_weights(named_tensors), anything else -> NotImplementedError; returns
(True, "Success"). Left out: the "flattened_bucket" format, LocalSerializedTensor (plain tensors
only), monkey_patch_torch_reductions, and everything else a ModelRunner does."""
from typing import List, Optional, Tuple

import torch

from sglang.srt.utils import dynamic_import


def _unwrap_tensor(tensor, tp_rank, device):
    return tensor.to(device)


def _model_load_weights_direct(model, named_tensors):
    params_dict = dict(model.named_parameters())
    for name, tensor in named_tensors:
        params_dict[name].data.copy_(tensor)


class ModelRunner:
    def __init__(self, model, tp_rank: int, tp_size: int, server_args) -> None:
        self.model, self.tp_rank, self.tp_size = model, tp_rank, tp_size
        self.server_args = server_args
        self.device = "cpu"

    def update_weights_from_tensor(self, named_tensors: List[Tuple[str, torch.Tensor]],
                                   load_format: Optional[str] = None):
        infered_device = torch.device(self.device)
        named_tensors = [(name, _unwrap_tensor(tensor, tp_rank=self.tp_rank,
                                               device=infered_device))
                         for name, tensor in named_tensors]
        if load_format == "direct":
            _model_load_weights_direct(self.model, named_tensors)
        elif load_format in self.server_args.custom_weight_loader:
            custom_loader = dynamic_import(load_format)
            custom_loader(self.model, named_tensors)
        elif load_format is None:
            self.model.load_weights(named_tensors)
        else:
            raise NotImplementedError(f"Unknown load_format={load_format}")
        return True, "Success"
