#!/usr/bin/env python3
"""Refit a tensor-parallel inference engine from an RL trainer, with control's clear -> update ->
serve around every push, and check that the engine computes what the trainer's model computes.

    python3 examples/refit_engine.py [--steps 3]

Processes (all on this host; every socket is loopback):
- the trainer (this process): a small Llama-style transformer with the names a trainer has
  (model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj, mlp.gate_proj/up_proj/down_proj,
  norms, embed_tokens, lm_head), a ferry.RefitSender of its state_dict, and the RL controller
  (ferry.Control) of each engine;
- engine "tp2": two rank processes, a 2-way tensor-parallel group (torch.distributed, gloo over
  127.0.0.1). Each rank holds only its shards, as vLLM lays them out: a column-parallel fused
  qkv_proj (its slices of q, k and v, concatenated along dim 0) and gate_up_proj, row-parallel
  o_proj and down_proj (split along dim 1, their outputs all-reduced), replicated norms,
  embedding and lm_head. Its receiver reads only those bytes: ferry.tp_shards computes the
  rank's pieces from the sender's manifest (fusing as the model's stacked_params_mapping says)
  and bind_shards binds them, so a rank reads its slices and the replicated tensors, not the
  whole model. It starts serving dummy (random) weights, as RL frameworks start vLLM with
  load_format="dummy" and sync from the trainer;
- engine "join": a fresh single-rank engine (world 1, the same code) started after step 1
  without weights. Its first update gets version 1 at once from the sender's retained copy (late
  join, docs/REFIT.md), with no push, and it serves steps 2 and 3 with the others.

Each step: the trainer takes an optimizer step; the controller clears every engine (its ranks
drop their weights); the trainer pushes the new version; the controller updates every engine
(each rank waits for the version's commit and loads it through its model's
load_weights(rx.updates(v)), whose weight_loaders get the rank's shards already sliced); then
each engine decodes a few tokens greedily from a fixed prompt, the trainer checks every rank's
logits against its own model's on the same tokens, and prints the bytes each rank read for
that version as a fraction of the model's (a tp2 rank: half of each split tensor plus the
replicated ones). Any mismatch, timeout or dead process exits non-zero; every child process
is ended on the way out (and dies with the trainer if the trainer is killed).
"""
import argparse
import ctypes
import datetime
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

try:
    import ferry
except ImportError:  # run from a checkout: use its python/ folder
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import ferry

VOCAB, HIDDEN, HEADS, KV_HEADS, INTER, LAYERS, EPS = 128, 64, 4, 2, 128, 2, 1e-5
HEAD_DIM = HIDDEN // HEADS
PROMPT = [1, 17, 42, 99, 7, 3]
NEW_TOKENS = 4
TIMEOUT = 60  # seconds for any one exchange; the whole example takes a few


# -- shared math (the trainer's model and the engine compute the same function) ---------------
def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def rope(x):
    """Rotary position embedding of x [tokens, heads, HEAD_DIM] (positions 0..tokens-1)."""
    half = HEAD_DIM // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    ang = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * freqs[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def causal_attention(q, k, v):
    """q [T, Hq, D], k and v [T, Hkv, D] (grouped-query: Hq / Hkv query heads per kv head)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / HEAD_DIM ** 0.5
    t = q.shape[0]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, -1)


# -- the trainer's model: Hugging Face names, whole tensors ------------------------------------
class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x):
        return rms_norm(x, self.weight)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x):
        t = x.shape[0]
        q = rope(self.q_proj(x).view(t, HEADS, HEAD_DIM))
        k = rope(self.k_proj(x).view(t, KV_HEADS, HEAD_DIM))
        return self.o_proj(causal_attention(q, k, self.v_proj(x).view(t, KV_HEADS, HEAD_DIM)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = Attention(), MLP()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(), RMSNorm()

    def forward(self, h):
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(LAYERS))
        self.norm = RMSNorm()


class TrainerLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Backbone()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):  # [T] -> logits [T, VOCAB]
        h = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(self.model.norm(h))


# -- the engine's model: what a vLLM-style engine rank holds and how it loads -------------------
def set_weight_attrs(param, attrs):
    for k, v in attrs.items():
        setattr(param, k, v)


def default_weight_loader(param, loaded_weight):
    """The tensor this rank holds, whole: a replicated one, or its shard as the receiver
    sliced it."""
    if param.shape != loaded_weight.shape:
        raise ValueError("shape %s does not fit the parameter's %s"
                         % (tuple(loaded_weight.shape), tuple(param.shape)))
    param.data.copy_(loaded_weight)


class TPGroup:
    """This rank's place in its tensor-parallel group and the all-reduce of row-parallel
    outputs (gloo over loopback; world 1: nothing to reduce)."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def all_reduce(self, x):
        if self.world > 1:
            torch.distributed.all_reduce(x)
        return x


class EngineParam(nn.Module):
    """A layer with one weight, allocated empty: the engine fills it through weight_loader.
    tp_dim: the dim its weight is split along between the ranks (None: replicated)."""
    tp_dim = None

    def __init__(self, tp, shape):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def weight_loader(self, param, loaded_weight):
        default_weight_loader(param, loaded_weight)


class QKVParallelLinear(EngineParam):
    """Column-parallel fused q/k/v: this rank's q heads, then its kv heads of k, then of v."""
    tp_dim = 0

    def __init__(self, tp):
        self.q_size = HEADS // tp.world * HEAD_DIM
        self.kv_size = KV_HEADS // tp.world * HEAD_DIM
        super().__init__(tp, (self.q_size + 2 * self.kv_size, HIDDEN))

    def weight_loader(self, param, loaded_weight):
        """loaded_weight: this rank's fused shard as the receiver laid it (its slice of q, then
        of k, then of v: ferry.tp_shards' fused pieces), so each part goes where it lies."""
        offset = 0
        for size in (self.q_size, self.kv_size, self.kv_size):
            default_weight_loader(param.data.narrow(0, offset, size),
                                  loaded_weight.narrow(0, offset, size))
            offset += size

    def forward(self, x):
        return F.linear(x, self.weight).split([self.q_size, self.kv_size, self.kv_size], -1)


class MergedColumnParallelLinear(EngineParam):
    """Column-parallel fused gate/up: this rank's rows of gate, then its rows of up."""
    tp_dim = 0

    def __init__(self, tp):
        self.size = INTER // tp.world
        super().__init__(tp, (2 * self.size, HIDDEN))

    def forward(self, x):
        gate, up = F.linear(x, self.weight).chunk(2, -1)
        return F.silu(gate) * up


class RowParallelLinear(EngineParam):
    """Row-parallel: this rank's columns (input features); partial outputs are summed."""
    tp_dim = 1

    def __init__(self, tp, in_features):
        self.size = in_features // tp.world
        super().__init__(tp, (HIDDEN, self.size))

    def forward(self, x):
        return self.tp.all_reduce(F.linear(x, self.weight))


class EngineLayer(nn.Module):
    def __init__(self, tp):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(tp)
        self.self_attn.o_proj = RowParallelLinear(tp, HEADS * HEAD_DIM)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = MergedColumnParallelLinear(tp)
        self.mlp.down_proj = RowParallelLinear(tp, INTER)
        self.input_layernorm = EngineParam(tp, (HIDDEN,))
        self.post_attention_layernorm = EngineParam(tp, (HIDDEN,))

    def forward(self, h):
        t = h.shape[0]
        q, k, v = self.self_attn.qkv_proj(rms_norm(h, self.input_layernorm.weight))
        q, k = rope(q.reshape(t, -1, HEAD_DIM)), rope(k.reshape(t, -1, HEAD_DIM))
        h = h + self.self_attn.o_proj(causal_attention(q, k, v.reshape(t, -1, HEAD_DIM)))
        x = rms_norm(h, self.post_attention_layernorm.weight)
        return h + self.mlp.down_proj(self.mlp.gate_up_proj(x))


class EngineLM(nn.Module):
    # trainer names -> the engine's fused parameters: (param_name, shard_name, shard_id)
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, tp):
        super().__init__()
        self.tp = tp
        self.model = nn.Module()
        self.model.embed_tokens = EngineParam(tp, (VOCAB, HIDDEN))  # replicated
        self.model.layers = nn.ModuleList(EngineLayer(tp) for _ in range(LAYERS))
        self.model.norm = EngineParam(tp, (HIDDEN,))
        self.lm_head = EngineParam(tp, (VOCAB, HIDDEN))  # replicated
        self.shapes = {n: p.shape for n, p in self.named_parameters()}

    def shard_specs(self, manifest):
        """This rank's targets, {parameter name: (shape, dtype, [ferry.Piece])}: ferry.tp_shards
        over the sender's manifest, the trainer tensors of each fused parameter taken in
        stacked_params_mapping's shard order, each split along its layer's tp_dim. Raises
        unless they are exactly this model's parameters, in their shapes."""
        names = [m["name"] for m in manifest]
        order = {"q": 0, "k": 1, "v": 2}
        fused, dims = {}, {}
        for name in names:
            target = name
            for param_name, shard_name, shard_id in self.stacked_params_mapping:
                if shard_name in name:
                    target = name.replace(shard_name, param_name)
                    fused.setdefault(target, []).append((order.get(shard_id, shard_id), name))
                    break
            layer = self.get_submodule(target.rsplit(".", 1)[0]) if target in self.shapes else None
            dims[name] = getattr(layer, "tp_dim", None)
        rules = [("^%s$" % re.escape(name), dim) for name, dim in dims.items()]
        specs = ferry.tp_shards(manifest, self.tp.rank, self.tp.world, rules,
                                fused={t: [n for _, n in sorted(src)] for t, src in fused.items()})
        got = {t: tuple(shape) for t, (shape, _, _) in specs.items()}
        want = {n: tuple(shape) for n, shape in self.shapes.items()}
        if got != want:
            raise ValueError("the sender's tensors split for rank %d of %d are %s, not this "
                             "model's parameters %s" % (self.tp.rank, self.tp.world, got, want))
        return specs

    def load_weights(self, weights):
        """weights: an iterable of (parameter name, this rank's tensor for it): the receiver
        bound this rank's shards (shard_specs), so fused parameters come fused and split ones
        come as this rank's slice. Returns the names of the parameters loaded."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, loaded_weight in weights:
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, loaded_weight)
            loaded.add(name)
        return loaded

    def expected(self):
        """What a complete load_weights returns: every parameter."""
        return set(self.shapes)

    def nbytes(self):
        """What this rank holds when awake: its shards and the replicated tensors."""
        return sum(4 * torch.Size(shape).numel() for shape in self.shapes.values())

    def sleep(self):
        """Drops the weights (vLLM's sleep level 2): nothing stale can be served."""
        for p in self.parameters():
            p.data = torch.empty(0)

    def wake_up(self):
        """Allocates the weights again, NaN until loaded, so a shard left unloaded shows."""
        for n, p in self.named_parameters():
            p.data = torch.full(self.shapes[n], float("nan"))

    def dummy_init(self, seed):
        g = torch.Generator().manual_seed(seed)
        for n, p in self.named_parameters():
            p.data = torch.randn(self.shapes[n], generator=g) * 0.05

    def forward(self, tokens):
        h = F.embedding(tokens, self.model.embed_tokens.weight)
        for layer in self.model.layers:
            h = layer(h)
        return F.linear(rms_norm(h, self.model.norm.weight), self.lm_head.weight)

    @torch.no_grad()
    def generate(self, prompt, n):
        """Greedy decoding; rank 0 picks each token and broadcasts it (as an engine's driver
        worker samples for the group). Returns (new tokens, their logits [n, VOCAB])."""
        tokens, rows = list(prompt), []
        for _ in range(n):
            logits = self(torch.tensor(tokens))[-1]
            tok = logits.argmax().reshape(1)
            if self.tp.world > 1:
                torch.distributed.broadcast(tok, src=0)
            rows.append(logits)
            tokens.append(int(tok))
        return tokens[len(prompt):], torch.stack(rows)


# -- an engine rank process -------------------------------------------------------------------
class EngineRank:
    def __init__(self, args):
        self.args = args
        self.tp = TPGroup(args.rank, args.world)
        self.model = EngineLM(self.tp)
        self.lock = threading.Lock()  # the control thread's handlers vs. generation
        self.version = None  # the refit version the weights are; None: dummy or dropped
        if args.dummy:
            self.model.dummy_init(1000 + args.rank)
            self.state = "serving"
        else:
            self.model.sleep()
            self.state = "cleared"

    def clear(self):  # control's clear: drop the weights (and a KV cache, had we one)
        with self.lock:
            self.model.sleep()
            self.version, self.state = None, "cleared"

    def update(self):  # control's update: return only once the new version is loaded whole
        with self.lock:
            # The latest version this receiver knows of; a late joiner's first wait catches up
            # to the sender's last push from its retained copy, with no push.
            v = self.rx.wait(timeout=TIMEOUT)
            self.model.wake_up()
            # (parameter name, this rank's shard) of every target bound, the receiver's own
            # tensors (no copy); v is committed already, so they come at once (created before a
            # push, updates() yields each one as the buckets of its pieces land)
            loaded = self.model.load_weights(self.rx.updates(v, timeout=TIMEOUT))
            missing = self.model.expected() - loaded
            if missing:
                raise RuntimeError("not loaded: %s" % sorted(map(str, missing))[:3])
            if self.rx.committed != v:  # a newer push landed while loading: torn
                raise RuntimeError("version %d changed while loading" % v)
            self.version, self.state = v, "serving"

    def control_loop(self, rank, stop):
        while not stop.is_set():
            try:
                rank.step(clear=self.clear, update=self.update, timeout=0.2)
            except ferry.Timeout:
                continue

    def generate(self, req):
        with self.lock:
            if self.state != "serving":
                return {"error": "rank %d is %s" % (self.args.rank, self.state)}
            tokens, logits = self.model.generate(req["prompt"], req["n"])
            return {"version": self.version, "tokens": tokens, "logits": logits.tolist(),
                    "bytes_read": self.rx.bytes_read}

    def run(self):
        a = self.args
        cell = None
        if a.world > 1:
            store = torch.distributed.FileStore(a.store, a.world)
            torch.distributed.init_process_group(
                "gloo", store=store, rank=a.rank, world_size=a.world,
                timeout=datetime.timedelta(seconds=TIMEOUT))
        if a.rank == 0:  # the engine's cell, created before any rank opens it
            cell = ferry.ControlCell(a.engine, a.world)
        if a.world > 1:
            torch.distributed.barrier()
        stop = threading.Event()
        with ferry.ControlRank(a.engine, a.rank, initial_state=self.state) as rank, \
                ferry.RefitReceiver(a.refit, timeout=TIMEOUT) as rx:
            self.rx = rx
            # this rank's shards, in tensors of its own: what the receiver reads and verifies
            specs = self.model.shard_specs(rx.manifest())
            self.staged = {t: torch.empty(shape, dtype=getattr(torch, dtype))
                           for t, (shape, dtype, _) in specs.items()}
            rx.bind_shards({t: (self.staged[t], pieces) for t, (_, _, pieces) in specs.items()})
            ctl = threading.Thread(target=self.control_loop, args=(rank, stop))
            ctl.start()
            try:
                reply({"ready": True, "nbytes": self.model.nbytes()})
                for line in sys.stdin:  # the trainer's requests; EOF: shut down
                    reply(self.generate(json.loads(line)))
            finally:
                stop.set()
                ctl.join()
                self.staged = None
        if cell is not None:
            cell.close()
        if a.world > 1:
            torch.distributed.destroy_process_group()


def reply(msg):
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def die_with_parent(parent):
    """A child must not outlive the trainer (a SIGKILLed trainer runs no cleanup)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the trainer died before prctl
        os._exit(1)


def engine_main(args):
    die_with_parent(args.parent)
    torch.set_num_threads(1)
    try:
        EngineRank(args).run()
    except Exception as e:  # tell the trainer, which is waiting for a line
        reply({"error": "%s: %s" % (type(e).__name__, e)})
        raise


# -- the trainer ------------------------------------------------------------------------------
class Failed(Exception):
    pass


class Child:
    """One engine rank process and a reader thread for its replies (so that no read can hang
    the trainer past TIMEOUT)."""

    def __init__(self, label, argv):
        self.label = label
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(ferry.__file__)),
                   GLOO_SOCKET_IFNAME="lo")
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__)] + argv,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=env)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, msg):
        try:
            self.p.stdin.write(json.dumps(msg) + "\n")
            self.p.stdin.flush()
        except OSError as e:
            raise Failed("%s: %s (exit code %s)" % (self.label, e, self.p.poll()))

    def recv(self):
        try:
            line = self.lines.get(timeout=TIMEOUT)
        except queue.Empty:
            raise Failed("%s: no answer within %d s" % (self.label, TIMEOUT)) from None
        if line is None:
            raise Failed("%s exited (code %s)" % (self.label, self.p.wait()))
        msg = json.loads(line)
        if "error" in msg:
            raise Failed("%s: %s" % (self.label, msg["error"]))
        return msg

    def close(self):
        try:
            self.p.stdin.close()  # EOF: the rank shuts down
        except OSError:
            pass

    def reap(self, deadline):
        try:
            self.p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


class Engine:
    """An engine as the trainer sees it: its rank processes and its controller."""

    def __init__(self, label, world, refit, tmp, dummy):
        self.label, self.world = label, world
        self.cell = "%s-%d" % (label, os.getpid())
        base = ["--role", "engine", "--engine", self.cell, "--world", str(world), "--refit",
                refit, "--store", os.path.join(tmp, label + ".store"), "--parent",
                str(os.getpid())] + (["--dummy"] if dummy else [])
        self.ranks = [Child("engine %s rank %d" % (label, r), base + ["--rank", str(r)])
                      for r in range(world)]
        self.ctl = None
        self.read = [0] * world  # each rank's bytes_read at the last check

    def started(self):
        """Waits until every rank attached and opened its control rank; returns the bytes
        of weights each rank holds."""
        held = [k.recv()["nbytes"] for k in self.ranks]
        self.ctl = ferry.Control(self.cell)
        return held

    def request(self, cmd):
        t = time.monotonic()
        self.ctl.request(cmd, TIMEOUT)
        return time.monotonic() - t

    def generate(self, prompt, n):
        for k in self.ranks:  # every rank runs the forward pass (the all-reduces need all)
            k.send({"prompt": prompt, "n": n})
        return [k.recv() for k in self.ranks]

    def close(self):
        if self.ctl is not None:
            self.ctl.close()
        for k in self.ranks:
            k.close()


@torch.no_grad()
def reference_logits(model, prompt, tokens):
    """The trainer's logits for each of `tokens` (teacher-forced on the engine's tokens, so a
    near-tie in one argmax cannot make the two sequences part)."""
    seq = torch.tensor(prompt + tokens[:-1])
    return model(seq)[len(prompt) - 1:]


def compare(engine, model):
    """Runs a generation on every rank of `engine`; returns (replies, per rank: whether its
    logits are close to the trainer's, and the largest difference)."""
    outs = engine.generate(PROMPT, NEW_TOKENS)
    diffs = []
    for out in outs:
        got = torch.tensor(out["logits"], dtype=torch.float32)
        want = reference_logits(model, PROMPT, out["tokens"])
        diffs.append((torch.allclose(got, want, rtol=1e-4, atol=1e-5),  # False for any NaN
                      float((got - want).abs().max())))
    return outs, diffs


def check(engine, model, version, prev=None):
    """The engine must serve `version` and compute what the trainer's model computes. prev: the
    previous version's trainer output, which must differ (else this check could not tell a
    stale engine from a refitted one). Returns a line for the summary."""
    outs, diffs = compare(engine, model)
    for r, (out, (close, diff)) in enumerate(zip(outs, diffs)):
        if out["version"] != version:
            raise Failed("engine %s rank %d serves version %s, not %d"
                         % (engine.label, r, out["version"], version))
        if not close:
            raise Failed("engine %s rank %d: logits differ from the trainer's at version %d "
                         "(max |diff| %.3g)" % (engine.label, r, version, diff))
        if out["tokens"] != outs[0]["tokens"]:
            raise Failed("engine %s: ranks decoded different tokens" % engine.label)
    # what each rank read for this version (since the last check), as a part of the model
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    parts = [(out["bytes_read"] - was) / model_bytes for out, was in zip(outs, engine.read)]
    engine.read = [out["bytes_read"] for out in outs]
    if engine.world > 1 and max(parts) >= 1:
        raise Failed("engine %s: a rank read %.2f of the model, not only its shards"
                     % (engine.label, max(parts)))
    if prev is not None:
        with torch.no_grad():
            now = model(torch.tensor(PROMPT))[-1]
        if torch.allclose(prev, now, rtol=1e-3, atol=1e-3):
            raise Failed("the training step hardly changed the model: this check would not "
                         "tell version %d from %d" % (version, version - 1))
    return ("engine %s (%d rank%s): tokens %s, logits match (max |diff| %.1e); read %s of the "
            "model" % (engine.label, engine.world, "s" if engine.world > 1 else "",
                       outs[0]["tokens"], max(d for _, d in diffs),
                       " + ".join("%.2f" % f for f in parts)))


def trainer_main(args):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TrainerLM()
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    data = torch.randint(0, VOCAB, (33,), generator=torch.Generator().manual_seed(7))
    refit = "refit-engine-example-%d" % os.getpid()
    tmp = tempfile.mkdtemp(prefix="ferry-refit-engine-")
    engines = []
    t0 = time.monotonic()
    try:
        with ferry.RefitSender(refit, model.state_dict()) as tx:
            sd = model.state_dict()
            kib = sum(t.numel() * t.element_size() for t in sd.values()) / 1024
            engines.append(Engine("tp2", 2, refit, tmp, dummy=True))
            held = engines[0].started()
            tx.wait_receivers(2, timeout=TIMEOUT)
            print("refit_engine: trainer model: %d tensors, %.0f KiB; engine tp2: 2 ranks (gloo "
                  "on 127.0.0.1) holding %s KiB of shards and replicated tensors, serving "
                  "dummy weights" % (len(sd), kib, " + ".join("%.0f" % (n / 1024) for n in held)))
            if any(close for close, _ in compare(engines[0], model)[1]):  # so checks can fail
                raise Failed("the dummy engine matches the trainer: the check proves nothing")
            prev = None
            for step in range(1, args.steps + 1):
                loss = F.cross_entropy(model(data[:-1]), data[1:])
                opt.zero_grad()
                loss.backward()
                opt.step()  # in place: the sender's declared tensors
                t_clear = sum(e.request("clear") for e in engines)
                t = time.monotonic()
                tx.push(step, timeout=TIMEOUT)
                t_push = time.monotonic() - t
                t_update = sum(e.request("update") for e in engines)
                print("refit_engine: step %d: loss %.3f; clear %.0f ms, push v%d %.0f ms, update "
                      "(load_weights) %.0f ms" % (step, loss.item(), t_clear * 1e3, step,
                                                  t_push * 1e3, t_update * 1e3))
                for e in engines:
                    print("  " + check(e, model, step, prev))
                with torch.no_grad():
                    prev = model(torch.tensor(PROMPT))[-1]
                if step == 1:
                    late_join(engines, tx, refit, tmp, model)
            print("refit_engine: %d steps in %.1f s; every rank of every engine computed what "
                  "the trainer's model computes" % (args.steps, time.monotonic() - t0))
    except (Failed, ferry.Error) as e:
        raise SystemExit("refit_engine: FAILED: %s" % e)
    finally:
        for e in engines:
            e.close()
        deadline = time.monotonic() + 10
        for e in engines:
            for k in e.ranks:
                k.reap(deadline)
        shutil.rmtree(tmp, ignore_errors=True)


def late_join(engines, tx, refit, tmp, model):
    """A third engine process starts after version 1 was pushed, without weights (cleared); its
    first update must serve version 1 at once: no push happens until step 2."""
    e = Engine("join", 1, refit, tmp, dummy=False)
    engines.append(e)
    e.started()
    tx.wait_receivers(3, timeout=TIMEOUT)
    t = e.request("update")
    print("refit_engine: engine join (1 rank) started after step 1; its update caught up to "
          "v1 with no push in %.0f ms" % (t * 1e3))
    print("  " + check(e, model, 1))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=("trainer", "engine"), default="trainer")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--engine")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--refit")
    p.add_argument("--store")
    p.add_argument("--parent", type=int)
    p.add_argument("--dummy", action="store_true")
    args = p.parse_args()
    (engine_main if args.role == "engine" else trainer_main)(args)


if __name__ == "__main__":
    main()
