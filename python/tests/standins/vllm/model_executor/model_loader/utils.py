"""Stand-in for vllm-project/vllm vllm/model_executor/model_loader/utils.py at commit
3d333269ca2218f2ec4c19d2bfd738f555be3000: process_weights_after_loading(model, model_config,
target_device), transcribed: every module's quant_method.process_weights_after_loading(module),
then every attention module's process_weights_after_loading(model_config.dtype). Left out:
QKVCrossParallelLinear, the QuantizeMethodBase type check (any quant_method with the method
counts) and device_loading_context (CPU offload)."""


def process_weights_after_loading(model, model_config, target_device) -> None:
    for _, module in model.named_modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
            quant_method.process_weights_after_loading(module)
    for _, module in model.named_modules():
        if getattr(module, "is_attention", False) and \
                hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading(model_config.dtype)
