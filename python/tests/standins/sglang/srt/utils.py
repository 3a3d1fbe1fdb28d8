"""Stand-in for the two helpers of sglang's srt utils that ModelRunner.update_weights_from_tensor
uses: dynamic_import(func_path) (module path and attribute split at the last dot, imported) and
MultiprocessingSerializer (serialize / deserialize of the named tensors, one payload per TP rank;
upstream it shares CUDA tensors through IPC handles, here it pickles). Not transcriptions: written
to the behaviour sglang/srt/model_executor/model_runner.py (see its stand-in) relies on."""
import importlib
import io
import pickle

import torch


def dynamic_import(func_path: str):
    parts = func_path.split(".")
    if len(parts) < 2:
        raise ValueError("func_path should contain both module name and func name "
                         "(such as 'module.func')")
    module = importlib.import_module(".".join(parts[:-1]))
    return getattr(module, parts[-1])


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    @staticmethod
    def deserialize(data):
        return torch.load(io.BytesIO(data))


__all__ = ["dynamic_import", "MultiprocessingSerializer", "pickle"]
