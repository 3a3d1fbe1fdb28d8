"""The engine-side model the adapters load into: the examples' small transformer
(examples/refit_engine.py: its sizes and its math, rms_norm, rope, causal_attention, imported
from there) laid out as a vLLM / SGLang tensor-parallel rank lays out a Llama.

- load_weights: LlamaModel.load_weights of vllm-project/vllm vllm/model_executor/models/llama.py
  at commit e06c9ba2a6ea923a84add30f5dafaea126429b81, transcribed (stacked_params_mapping
  (".qkv_proj", ".q_proj", "q") ... (".gate_up_proj", ".up_proj", 1); a fused parameter's
  weight_loader(param, loaded_weight, shard_id), the others' weight_loader(param,
  loaded_weight) or default_weight_loader; returns the set of loaded names). LlamaForCausalLM's
  AutoWeightsLoader is reduced to: "model.*" goes to that, "lm_head.*" to lm_head's loader.
  SGLang's llama.py load_weights has the same loop.
- weight loaders: the slicing of vLLM's QKVParallelLinear, MergedColumnParallelLinear and
  RowParallelLinear, written from its semantics rather than transcribed, and checked against
  their unquantized weight_loader in vllm/model_executor/layers/linear.py at commit
  9e109c9887e38c51fc16b0da89760c5bd7c293c9: each takes the checkpoint's whole tensor and copies
  this rank's part. QKV: q at 0, k after num_heads*head_size, v after (num_heads +
  num_kv_heads)*head_size of this rank's rows, the source rows from tp_rank*size (k, v: from
  tp_rank // num_kv_head_replicas, which is tp_rank here: 2 KV heads over 2 ranks); merged
  gate / up: shard i at sum(output_sizes[:i]) // tp_size, size output_sizes[i] // tp_size, source
  rows from tp_rank*size; row-parallel: input columns (dim 1) from tp_rank*size. Embedding and
  lm_head are replicated here (vLLM splits the vocabulary; not needed to test a loader).
- a "quant_method" on o_proj whose process_weights_after_loading counts its calls (vLLM runs it
  after every load).
- tp_logits(ranks, tokens): the forward pass of TP ranks held in one process (the row-parallel
  partial outputs summed, as their all-reduce would), so a TP-2 engine's logits can be checked.
"""
import importlib.util
import os

import torch
import torch.nn.functional as F
from torch import nn

_EX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples",
                   "refit_engine.py")
_spec = importlib.util.spec_from_file_location("ferry_example_refit_engine", _EX)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

VOCAB, HIDDEN, HEADS, KV_HEADS = example.VOCAB, example.HIDDEN, example.HEADS, example.KV_HEADS
INTER, LAYERS, HEAD_DIM = example.INTER, example.LAYERS, example.HEAD_DIM
TrainerLM = example.TrainerLM


def default_weight_loader(param, loaded_weight):
    if param.size() != loaded_weight.size():
        raise ValueError("Attempted to load weight (%s) into parameter (%s)"
                         % (loaded_weight.size(), param.size()))
    param.data.copy_(loaded_weight)


def _param(shape, loader):
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.weight_loader = loader
    return p


class QKVParallelLinear(nn.Module):
    def __init__(self, rank, world):
        super().__init__()
        self.rank = rank
        self.q = HEADS // world * HEAD_DIM
        self.kv = KV_HEADS // world * HEAD_DIM
        self.weight = _param((self.q + 2 * self.kv, HIDDEN), self.weight_loader)

    def weight_loader(self, param, loaded_weight, loaded_shard_id):
        offset, size = {"q": (0, self.q), "k": (self.q, self.kv),
                        "v": (self.q + self.kv, self.kv)}[loaded_shard_id]
        shard = loaded_weight.narrow(0, self.rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), shard)


class MergedColumnParallelLinear(nn.Module):
    def __init__(self, rank, world):
        super().__init__()
        self.rank, self.size = rank, INTER // world
        self.weight = _param((2 * self.size, HIDDEN), self.weight_loader)

    def weight_loader(self, param, loaded_weight, loaded_shard_id):
        shard = loaded_weight.narrow(0, self.rank * self.size, self.size)
        default_weight_loader(param.data.narrow(0, loaded_shard_id * self.size, self.size), shard)


class CountingQuantMethod:
    calls = 0

    def process_weights_after_loading(self, layer):
        type(self).calls += 1


class RowParallelLinear(nn.Module):
    def __init__(self, rank, world, in_features):
        super().__init__()
        self.rank, self.size = rank, in_features // world
        self.weight = _param((HIDDEN, self.size), self.weight_loader)

    def weight_loader(self, param, loaded_weight):
        default_weight_loader(param, loaded_weight.narrow(1, self.rank * self.size, self.size))


class Replicated(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.weight = _param(shape, default_weight_loader)


class Layer(nn.Module):
    def __init__(self, rank, world):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(rank, world)
        self.self_attn.o_proj = RowParallelLinear(rank, world, HEADS * HEAD_DIM)
        self.self_attn.o_proj.quant_method = CountingQuantMethod()
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = MergedColumnParallelLinear(rank, world)
        self.mlp.down_proj = RowParallelLinear(rank, world, INTER)
        self.input_layernorm = Replicated((HIDDEN,))
        self.post_attention_layernorm = Replicated((HIDDEN,))


class LlamaModel(nn.Module):
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, rank, world):
        super().__init__()
        self.embed_tokens = Replicated((VOCAB, HIDDEN))
        self.layers = nn.ModuleList(Layer(rank, world) for _ in range(LAYERS))
        self.norm = Replicated((HIDDEN,))

    def load_weights(self, weights):
        params_dict = dict(self.named_parameters())
        loaded_params = set()
        for name, loaded_weight in weights:
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name not in name:
                    continue
                name = name.replace(weight_name, param_name)
                param = params_dict[name]
                weight_loader = param.weight_loader
                weight_loader(param, loaded_weight, shard_id)
                break
            else:
                param = params_dict[name]
                weight_loader = getattr(param, "weight_loader", default_weight_loader)
                weight_loader(param, loaded_weight)
            loaded_params.add(name)
        return loaded_params


class LlamaForCausalLM(nn.Module):
    """One TP rank (rank of world) of the engine's model."""

    def __init__(self, rank=0, world=1):
        super().__init__()
        self.rank, self.world = rank, world
        self.model = LlamaModel(rank, world)
        self.lm_head = Replicated((VOCAB, HIDDEN))
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(float("nan"))  # nothing loaded yet: any use shows

    def load_weights(self, weights):
        loaded = set()
        inner = []
        for name, w in weights:
            if name.startswith("model."):
                inner.append((name[len("model."):], w))
            else:
                p = dict(self.named_parameters())[name]
                getattr(p, "weight_loader", default_weight_loader)(p, w)
                loaded.add(name)
        loaded |= {"model." + n for n in self.model.load_weights(inner)}
        return loaded


@torch.no_grad()
def tp_logits(ranks, tokens):
    """Logits [T, VOCAB] of the TP ranks `ranks` (LlamaForCausalLM of ranks 0..world-1)."""
    tokens = torch.as_tensor(tokens)
    t = tokens.shape[0]
    h = F.embedding(tokens, ranks[0].model.embed_tokens.weight)
    for i in range(LAYERS):
        layers = [r.model.layers[i] for r in ranks]
        x = example.rms_norm(h, layers[0].input_layernorm.weight)
        attn = 0
        for lay in layers:
            qkv = lay.self_attn.qkv_proj
            q, k, v = F.linear(x, qkv.weight).split([qkv.q, qkv.kv, qkv.kv], -1)
            q = example.rope(q.reshape(t, -1, HEAD_DIM))
            k = example.rope(k.reshape(t, -1, HEAD_DIM))
            out = example.causal_attention(q, k, v.reshape(t, -1, HEAD_DIM))
            attn = attn + F.linear(out, lay.self_attn.o_proj.weight)
        h = h + attn
        x = example.rms_norm(h, layers[0].post_attention_layernorm.weight)
        mlp = 0
        for lay in layers:
            gate, up = F.linear(x, lay.mlp.gate_up_proj.weight).chunk(2, -1)
            mlp = mlp + F.linear(F.silu(gate) * up, lay.mlp.down_proj.weight)
        h = h + mlp
    h = example.rms_norm(h, ranks[0].model.norm.weight)
    return F.linear(h, ranks[0].lm_head.weight)
