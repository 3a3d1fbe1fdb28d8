"""Stand-in for vllm/distributed/__init__.py, which re-exports parallel_state's accessors
(vllm-project/vllm vllm/distributed/parallel_state.py at commit
0c175ae9295b575078961a68c4d3a2a838dce5ef: get_tensor_model_parallel_rank() returns
get_tp_group().rank_in_group, get_tensor_model_parallel_world_size() get_tp_group().world_size,
both without arguments). Here the TP group is the in-process worker the stand-in LLM is
calling (set around each collective_rpc call, vllm/entrypoints/llm.py stand-in)."""
_current = {"rank": 0, "world": 1}


def get_tensor_model_parallel_rank():
    return _current["rank"]


def get_tensor_model_parallel_world_size():
    return _current["world"]
