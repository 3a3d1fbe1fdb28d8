"""Stand-in for vllm-project/vllm vllm/distributed/weight_transfer/base.py at commit
02f250b03f38822ccdb63f27a3005d10ca81f385: WeightTransferInitInfo, WeightTransferUpdateInfo and
WeightTransferEngine, transcribed (constructor (config, vllm_config, device, model), the
attributes it sets, parse_init_info / parse_update_info, the abstract methods and
update_weights: parse, then receive_weights(typed info), then synchronize).

Left out: WeightSource / ModuleSource / ParamMeta, the request dataclasses, the trainer-side
TrainerWeightTransferEngine and VLLMWeightSyncClient; update_weights'
torch.accelerator.synchronize() is called only where this torch has it (1.13 here does not;
nothing here is asynchronous)."""
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Generic, Iterator, TypeVar

import torch

TInitInfo = TypeVar("TInitInfo", bound="WeightTransferInitInfo")
TUpdateInfo = TypeVar("TUpdateInfo", bound="WeightTransferUpdateInfo")


@dataclass
class WeightTransferInitInfo(ABC):  # noqa: B024
    pass


@dataclass
class WeightTransferUpdateInfo(ABC):  # noqa: B024
    pass


class WeightTransferEngine(ABC, Generic[TInitInfo, TUpdateInfo]):
    init_info_cls: type
    update_info_cls: type

    supports_draft_weight_update: bool = True

    def __init__(self, config, vllm_config, device, model) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.model = model
        self._default_model_config = self.model_config
        self._default_model = model

    def set_weight_update_target(self, model, model_config) -> None:
        self.model = model
        self.model_config = model_config

    def reset_weight_update_target(self) -> None:
        self.model = self._default_model
        self.model_config = self._default_model_config

    def parse_init_info(self, init_dict: dict) -> TInitInfo:
        try:
            return self.init_info_cls(**init_dict)
        except TypeError as e:
            raise ValueError(f"Invalid init_info for {self.__class__.__name__}: {e}") from e

    def parse_update_info(self, update_dict: dict) -> TUpdateInfo:
        try:
            return self.update_info_cls(**update_dict)
        except TypeError as e:
            raise ValueError(f"Invalid update_info for {self.__class__.__name__}: {e}") from e

    @abstractmethod
    def init_transfer_engine(self, init_info: TInitInfo) -> None:
        raise NotImplementedError

    @abstractmethod
    def start_weight_update(self) -> None:
        raise NotImplementedError

    @abstractmethod
    def finish_weight_update(self) -> None:
        raise NotImplementedError

    def update_weights(self, update_info: dict) -> None:
        typed_update_info = self.parse_update_info(update_info)
        self.receive_weights(typed_update_info)
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None:
            accelerator.synchronize()

    @abstractmethod
    def receive_weights(self, update_info: TUpdateInfo) -> None:
        raise NotImplementedError

    @abstractmethod
    def shutdown(self) -> None:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def trainer_send_weights(iterator: Iterator[Any], trainer_args: Any) -> None:
        raise NotImplementedError
