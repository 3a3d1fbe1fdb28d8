"""Stand-in for vllm-project/vllm vllm/distributed/weight_transfer/factory.py at commit
047c993cc49c32e9b94f5bf826a9214e163eb982: WeightTransferEngineFactory (register_engine by module
path + class name, loaded lazily, or by class; a second registration of a name raises;
create_engine(config, vllm_config, device, model) by config.backend), transcribed. Left out: the
trainer-side factory, logging, and the built-in "nccl" / "ipc" / "sparse_nccl" registrations
(their modules are not here)."""
import importlib


class WeightTransferEngineFactory:
    _registry: dict = {}

    @classmethod
    def register_engine(cls, name, module_path_or_cls, class_name=None) -> None:
        if name in cls._registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        if isinstance(module_path_or_cls, str):
            module_path = module_path_or_cls
            if class_name is None:
                raise ValueError("class_name is required when registering with module path")

            def loader():
                module = importlib.import_module(module_path)
                return getattr(module, class_name)

            cls._registry[name] = loader
        else:
            engine_cls = module_path_or_cls
            cls._registry[name] = lambda: engine_cls

    @classmethod
    def create_engine(cls, config, vllm_config, device, model):
        backend = config.backend
        if backend not in cls._registry:
            available = list(cls._registry.keys())
            raise ValueError(f"Invalid weight transfer backend: {backend}. "
                             f"Available engines: {available}")
        engine_cls = cls._registry[backend]()
        return engine_cls(config, vllm_config, device, model)
