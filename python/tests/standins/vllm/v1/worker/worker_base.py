"""Stand-in for vllm-project/vllm vllm/v1/worker/worker_base.py at commit
09aa6b34bf7bd7f309464cefb570552144db41c3: WorkerWrapperBase.init_worker's injection of
--worker-extension-cls, transcribed: the extension class is resolved by its qualified name, none
of its attributes (but dunders) may exist on the worker class already, and it is appended to
the worker class's __bases__; load_general_plugins() runs first in every worker. Left out:
environment, multimodal caches, vllm_config context."""
import importlib


def resolve_obj_by_qualname(qualname: str):
    module_name, obj_name = qualname.rsplit(".", 1)
    module = importlib.import_module(module_name)
    return getattr(module, obj_name)


def inject_worker_extension(worker_class, worker_extension_qualname):
    worker_extension_cls = resolve_obj_by_qualname(worker_extension_qualname)
    if worker_extension_cls not in worker_class.__bases__:
        for attr in dir(worker_extension_cls):
            if attr.startswith("__"):
                continue
            assert not hasattr(worker_class, attr), (
                f"Worker class {worker_class} already has an attribute"
                f" {attr}, which conflicts with the worker"
                f" extension class {worker_extension_cls}.")
        worker_class.__bases__ = worker_class.__bases__ + (worker_extension_cls,)
    return worker_class
