#!/usr/bin/env python3
"""Refit from a sharded trainer: two Megatron tensor-parallel trainer ranks push their halves of
one model, shard to shard, to a 2-rank tensor-parallel engine and to a whole-model engine; one
trainer rank is killed mid-push and comes back.

    python3 examples/refit_sharded.py [--steps 4] [--kill-at 3]

Processes (all on this host; every socket is loopback). The orchestrator (this process) hosts
the directory (ferry.Store(host_directory=True): the ranks are found there by name) and starts:
- two trainer ranks (torch.distributed, gloo on 127.0.0.1) that train the small Llama-style
  transformer of examples/refit_engine.py with Megatron tensor parallelism. Each holds only its
  half: column-parallel q/k/v (one fused qkv_proj = [q_r; k_r; v_r]) and gate/up (one fused
  gate_up_proj) split along dim 0, row-parallel o_proj and down_proj split along dim 1 (their
  outputs all-reduced), replicated norms, embedding and lm_head. ferry.tp_pieces turns that
  state dict into views named by the global tensors, with the pieces of the global model they
  are, and each rank opens ferry.RefitSender(name, sd, rank=r, world=2, pieces=pieces): no rank
  ever holds or gathers the whole model to push it;
- engine A: two engine ranks (gloo), tensor-parallel with the engine's own layout (vLLM's:
  fused qkv_proj and gate_up_proj along dim 0, o_proj and down_proj along dim 1, computed by
  ferry.tp_shards from the receiver's global manifest, bound with bind_shards), each loading
  through model.load_weights(rx.updates(v));
- engine B: one rank holding the whole model, reading every tensor into one flat buffer
  (tensors()) and loading through load_weights(rx.updates(v, mapping=stacked_params_mapping)),
  which fuses q/k/v and gate/up.
Each receiver opens the group by its one name (RefitReceiver(name): ranks == 2) and reads each
rank's part straight from that rank.

Each step: the engines start listening for version v (updates(v)); both trainer ranks take an
optimizer step (in place: what their senders declared) and push v; every engine rank loads v;
then each engine generates a few tokens greedily and the orchestrator checks their logits
against the trainer's model put together from the ranks' checkpoints (the full-model
reference), every step. At step --kill-at, trainer rank 1 is SIGKILLed in the middle of the
push of v: rank 0's push of its part returned (that part landed at every engine), rank 1 had
trained the step but not sent its part. v must fail at every engine rank, naming rank 1, and
every engine must keep serving v - 1 (its logits still the trainer's of v - 1). Rank 1 then
restarts (a new process, the same rank and declaration, resuming from its checkpoint of that
step), both ranks form a new process group, and the next step must commit everywhere. Any
failed check, timeout or dead process exits non-zero; every child process is ended on the way
out (and dies with the orchestrator if it is killed).
"""
import argparse
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# the transformer, the engine's model, and ferry's import (from the checkout when not installed)
import refit_engine as base  # noqa: E402
from refit_engine import (EngineLM, HEAD_DIM, HEADS, KV_HEADS, LAYERS, NEW_TOKENS,  # noqa: E402
                          PROMPT, TPGroup, TrainerLM, causal_attention, die_with_parent,
                          reference_logits, rms_norm, rope)

ferry = base.ferry
TIMEOUT = 30  # seconds for any one exchange
PUSH_TIMEOUT = 10  # a push that cannot end (a rank gone) fails within this
WORLD = 2  # trainer ranks, and engine A's ranks
# The trainer's Megatron split of the global (Hugging Face) names, as tp_shards takes it
RULES = [(r"\.(q|k|v|gate|up)_proj\.", 0), (r"\.(o|down)_proj\.", 1)]


def fused_map():
    """{local fused tensor: [global tensors, in the order its rows hold them]}."""
    out = {}
    for i in range(LAYERS):
        p = "model.layers.%d." % i
        out[p + "self_attn.qkv_proj.weight"] = [p + "self_attn.%s_proj.weight" % x for x in "qkv"]
        out[p + "mlp.gate_up_proj.weight"] = [p + "mlp.%s_proj.weight" % x for x in ("gate", "up")]
    return out


# -- a trainer rank: Megatron tensor parallelism over gloo --------------------------------------
class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        torch.distributed.all_reduce(g)
        return g


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward (the row-parallel partial sums), identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        torch.distributed.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def tp_half(full, rank, world):
    """Rank `rank`'s own parameters, cut from the full initial model (as every rank initializes
    the same model from one seed and keeps its part): {local name: tensor}."""
    sd = full.state_dict()
    out = {}
    for name, t in sd.items():
        m = re.search(r"\.(q|k|v|gate|up|o|down)_proj\.", name)
        if m is None:
            out[name] = t.clone()
            continue
        dim = 1 if m.group(1) in ("o", "down") else 0
        out[name] = t.chunk(world, dim)[rank].clone()
    for fused, sources in fused_map().items():
        out[fused] = torch.cat([out.pop(s) for s in sources])
    return out


class TrainerRank:
    def __init__(self, args):
        self.args = args
        torch.manual_seed(0)
        full = TrainerLM()  # the same initial model on every rank; each keeps its half
        self.global_shapes = {n: tuple(t.shape) for n, t in full.state_dict().items()}
        self.params = {n: torch.nn.Parameter(t) for n, t in tp_half(full, args.rank, WORLD).items()}
        del full
        self.opt = torch.optim.Adam(self.params.values(), lr=2e-2)
        self.data = torch.randint(0, base.VOCAB, (33,), generator=torch.Generator().manual_seed(7))
        if args.resume:
            saved = torch.load(self.ckpt(args.resume))
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(saved["params"][n])
            self.opt.load_state_dict(saved["opt"])
        # The global tensors' views (fused ones split by source) and their pieces: declared in
        # place, so every optimizer step is what the next push sends
        self.sd, self.pieces = ferry.tp_pieces({n: p.detach() for n, p in self.params.items()},
                                               args.rank, WORLD, RULES, fused=fused_map(),
                                               shapes=self.global_shapes)

    def ckpt(self, step):
        return os.path.join(self.args.tmp, "rank%d-step%d.pt" % (self.args.rank, step))

    def save(self, step):
        torch.save({"params": {n: p.detach().clone() for n, p in self.params.items()},
                    "opt": self.opt.state_dict(),
                    "global": {n: t.clone() for n, t in self.sd.items()},
                    "pieces": {n: tuple(p) for n, p in self.pieces.items()}}, self.ckpt(step))

    def forward(self, tokens):
        P, t = self.params, tokens.shape[0]
        q_size, kv_size = HEADS // WORLD * HEAD_DIM, KV_HEADS // WORLD * HEAD_DIM
        h = F.embedding(tokens, P["model.embed_tokens.weight"])
        for i in range(LAYERS):
            pre = "model.layers.%d." % i
            x = CopyToTP.apply(rms_norm(h, P[pre + "input_layernorm.weight"]))
            q, k, v = F.linear(x, P[pre + "self_attn.qkv_proj.weight"]).split(
                [q_size, kv_size, kv_size], -1)
            q, k = rope(q.reshape(t, -1, HEAD_DIM)), rope(k.reshape(t, -1, HEAD_DIM))
            a = causal_attention(q, k, v.reshape(t, -1, HEAD_DIM))
            h = h + ReduceFromTP.apply(F.linear(a, P[pre + "self_attn.o_proj.weight"]))
            x = CopyToTP.apply(rms_norm(h, P[pre + "post_attention_layernorm.weight"]))
            gate, up = F.linear(x, P[pre + "mlp.gate_up_proj.weight"]).chunk(2, -1)
            h = h + ReduceFromTP.apply(F.linear(F.silu(gate) * up, P[pre + "mlp.down_proj.weight"]))
        return F.linear(rms_norm(h, P["model.norm.weight"]), P["lm_head.weight"])

    def train_step(self):
        loss = F.cross_entropy(self.forward(self.data[:-1]), self.data[1:])
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def run(self):
        a = self.args
        join_group(a.store, a.rank, WORLD)
        if not a.resume:
            self.save(0)
        with ferry.RefitSender(a.refit, self.sd, rank=a.rank, world=WORLD, pieces=self.pieces,
                               buffer_bytes=16 << 10) as tx:
            reply({"ready": True, "tensors": len(self.sd),
                   "bytes": sum(t.numel() * t.element_size() for t in self.sd.values())})
            for line in sys.stdin:
                req = json.loads(line)
                if req["cmd"] == "receivers":
                    reply({"receivers": tx.wait_receivers(req["n"], timeout=TIMEOUT)})
                elif req["cmd"] == "regroup":
                    torch.distributed.destroy_process_group()
                    join_group(req["store"], a.rank, WORLD)
                    reply({"regrouped": True})
                elif req["cmd"] == "step":
                    v = req["step"]
                    loss = self.train_step()
                    self.save(v)
                    if req.get("hold"):  # the orchestrator SIGKILLs this rank before it pushes
                        reply({"held": v, "loss": loss})
                        continue
                    t = time.monotonic()
                    try:
                        tx.push(v, timeout=PUSH_TIMEOUT)
                        reply({"pushed": v, "loss": loss, "ms": (time.monotonic() - t) * 1e3})
                    except ferry.Error as e:
                        reply({"push_failed": v, "loss": loss, "why": str(e)})


def join_group(store, rank, world):
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.FileStore(store, world), rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT))


# -- an engine rank -----------------------------------------------------------------------------
class EngineRank:
    def __init__(self, args):
        self.args = args
        self.tp = TPGroup(args.rank, args.world)
        self.model = EngineLM(self.tp)
        self.model.dummy_init(1000 + args.rank)  # serving dummy weights until the first refit
        self.version = None

    def load(self, rx, v, mapping):
        """Loads version v into the model's parameters. A group's updates() yields once v
        committed, so a failed v raises before any parameter changes: the model keeps serving
        the version it has."""
        it = rx.updates(v, mapping=mapping, timeout=TIMEOUT)  # listening from here on
        reply({"listening": v})
        try:
            loaded = self.model.load_weights(it)
        except ferry.Error as e:
            return {"failed": v, "why": str(e), "committed": rx.committed}
        missing = self.model.expected() - loaded
        if missing:
            return {"error": "version %d: not loaded: %s" % (v, sorted(missing)[:3])}
        self.version = v
        return {"loaded": v, "committed": rx.committed}

    def run(self):
        a = self.args
        if a.world > 1:
            join_group(a.store, a.rank, a.world)
        with ferry.RefitReceiver(a.refit, timeout=TIMEOUT) as rx:
            man = rx.manifest()
            mapping = None
            if a.flat:  # the whole model: every tensor in one flat buffer, fused as it loads
                rx.tensors()
                mapping = EngineLM.stacked_params_mapping
            else:  # this rank's shards, in tensors of its own
                specs = self.model.shard_specs(man)
                self.staged = {t: torch.empty(shape, dtype=getattr(torch, dtype))
                               for t, (shape, dtype, _) in specs.items()}
                rx.bind_shards({t: (self.staged[t], pieces)
                                for t, (_, _, pieces) in specs.items()})
            reply({"ready": True, "ranks": rx.ranks,
                   "manifest": {m["name"]: list(m["shape"]) for m in man}})
            for line in sys.stdin:
                req = json.loads(line)
                if req["cmd"] == "load":
                    reply(self.load(rx, req["v"], mapping))
                elif req["cmd"] == "generate":
                    with torch.no_grad():
                        tokens, logits = self.model.generate(PROMPT, NEW_TOKENS)
                    reply({"version": self.version, "tokens": tokens, "logits": logits.tolist(),
                           "committed": rx.committed, "bytes_read": rx.bytes_read})
        if a.world > 1:
            torch.distributed.destroy_process_group()


def reply(msg):
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def child_main(args):
    die_with_parent(args.parent)
    torch.set_num_threads(1)
    try:
        (TrainerRank if args.role == "trainer" else EngineRank)(args).run()
    except Exception as e:  # tell the orchestrator, which is waiting for a line
        reply({"error": "%s: %s" % (type(e).__name__, e)})
        raise


# -- the orchestrator ---------------------------------------------------------------------------
class Failed(Exception):
    pass


class Child:
    """One child process and a reader thread for its replies (no read can hang past TIMEOUT)."""

    def __init__(self, label, argv, env):
        self.label = label
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__)] + argv,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=env)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, **msg):
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
            self.p.stdin.close()  # EOF: the child shuts down
        except OSError:
            pass

    def reap(self, deadline):
        try:
            self.p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


class Run:
    def __init__(self, args, directory, tmp):
        self.args, self.tmp = args, tmp
        self.refit = "refit-sharded-example-%d" % os.getpid()
        self.env = dict(os.environ, FERRY_DIRECTORY=directory, GLOO_SOCKET_IFNAME="lo",
                        PYTHONPATH=os.path.dirname(os.path.dirname(ferry.__file__)))
        self.children = []
        self.groups = 0

    def spawn(self, label, role, rank, world, store, *extra):
        k = Child(label, ["--role", role, "--rank", str(rank), "--world", str(world), "--refit",
                          self.refit, "--store", store, "--tmp", self.tmp, "--parent",
                          str(os.getpid())] + list(extra), self.env)
        self.children.append(k)
        return k

    def store(self, what):
        self.groups += 1
        return os.path.join(self.tmp, "%s-%d.store" % (what, self.groups))

    def trainer(self, rank, store, resume=0):
        return self.spawn("trainer rank %d" % rank, "trainer", rank, WORLD, store,
                          "--resume", str(resume))

    def reference(self, step):
        """The trainer's model at `step`, put together from both ranks' checkpoints (each
        global tensor from the pieces that hold it; a replicated one from rank 0)."""
        model = TrainerLM()
        sd = {n: torch.full_like(t, float("nan")) for n, t in model.state_dict().items()}
        for r in reversed(range(WORLD)):
            saved = torch.load(os.path.join(self.tmp, "rank%d-step%d.pt" % (r, step)))
            for n, t in saved["global"].items():
                p = saved["pieces"].get(n)
                if p is None:
                    sd[n] = t
                else:
                    sd[p[0]].narrow(p[1], p[2], p[3] - p[2]).copy_(t)
        bad = [n for n, t in sd.items() if torch.isnan(t).any()]
        if bad:
            raise Failed("the ranks' checkpoints of step %d leave %s unfilled" % (step, bad[:3]))
        model.load_state_dict(sd)
        return model

    def serve(self, engines):
        """Every engine generates (each of its ranks: the all-reduces need all)."""
        for ranks in engines.values():
            for k in ranks:
                k.send(cmd="generate")
        return {e: [k.recv() for k in ranks] for e, ranks in engines.items()}

    def check_serving(self, engines, model, version, model_bytes, read):
        """Every engine rank serves `version` with the logits of `model`; returns a summary."""
        lines = []
        for e, outs in self.serve(engines).items():
            worst = 0.0
            for r, out in enumerate(outs):
                if out["version"] != version:
                    raise Failed("engine %s rank %d serves version %s, not %s"
                                 % (e, r, out["version"], version))
                got = torch.tensor(out["logits"], dtype=torch.float32)
                want = reference_logits(model, PROMPT, out["tokens"])
                diff = float((got - want).abs().max())
                if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                    raise Failed("engine %s rank %d: logits differ from the trainer's at version "
                                 "%s (max |diff| %.3g)" % (e, r, version, diff))
                if out["tokens"] != outs[0]["tokens"]:
                    raise Failed("engine %s: its ranks decoded different tokens" % e)
                worst = max(worst, diff)
            parts = [(o["bytes_read"] - was) / model_bytes for o, was in zip(outs, read[e])]
            read[e] = [o["bytes_read"] for o in outs]
            if len(outs) > 1 and version and max(parts) >= 0.9:
                raise Failed("engine %s: a rank read %.2f of the model, not only its shards"
                             % (e, max(parts)))
            lines.append("engine %s (%d rank%s): serves v%s, tokens %s, logits match (max |diff| "
                         "%.1e); read %s of the model" % (e, len(outs), "s" * (len(outs) > 1),
                                                          version, outs[0]["tokens"], worst,
                                                          " + ".join("%.2f" % f for f in parts)))
        return lines

    def main(self):
        a, t0 = self.args, time.monotonic()
        tstore = self.store("trainers")
        trainers = [self.trainer(r, tstore) for r in range(WORLD)]
        ready = [k.recv() for k in trainers]
        estore = self.store("engine-a")
        engines = {"A": [self.spawn("engine A rank %d" % r, "engine", r, WORLD, estore)
                         for r in range(WORLD)],
                   "B": [self.spawn("engine B", "engine", 0, 1, "-", "--flat")]}
        model0 = self.reference(0)
        want = {n: list(t.shape) for n, t in model0.state_dict().items()}
        model_bytes = sum(t.numel() * t.element_size() for t in model0.state_dict().values())
        for e, ranks in engines.items():
            for r, k in enumerate(ranks):
                got = k.recv()
                if got["ranks"] != WORLD or got["manifest"] != want:
                    raise Failed("engine %s rank %d sees %d sender ranks and the manifest %s, not "
                                 "%d ranks and the trainer's model" % (e, r, got["ranks"],
                                                                      got["manifest"], WORLD))
        for k in trainers:
            k.send(cmd="receivers", n=3)
        for k in trainers:
            k.recv()
        print("refit_sharded: trainer: 2 Megatron-TP ranks (gloo on 127.0.0.1) holding %s KiB "
              "of the model's %.0f KiB, %s local tensors; engine A: 2 TP ranks, engine B: the "
              "whole model; each receiver sees one model of %d tensors from 2 ranks"
              % (" + ".join("%.0f" % (m["bytes"] / 1024) for m in ready), model_bytes / 1024,
                 " + ".join(str(m["tensors"]) for m in ready), len(want)))
        for out in self.serve(engines).values():  # dummy weights: the checks can fail
            got = torch.tensor(out[0]["logits"], dtype=torch.float32)
            if torch.allclose(got, reference_logits(model0, PROMPT, out[0]["tokens"]),
                              rtol=1e-3, atol=1e-3):
                raise Failed("a dummy engine matches the trainer: the checks prove nothing")
        read = {e: [0] * len(ranks) for e, ranks in engines.items()}
        served, prev = 0, None
        for step in range(1, a.steps + 1):
            kill = step == a.kill_at
            for ranks in engines.values():
                for k in ranks:
                    k.send(cmd="load", v=step)
                    k.recv()  # listening for this version from here on
            for r, k in enumerate(trainers):
                k.send(cmd="step", step=step, hold=kill and r == 1)
            pushed = [k.recv() for k in trainers]
            if kill:  # rank 0's part of v landed everywhere; rank 1 dies before sending its own
                os.kill(trainers[1].p.pid, signal.SIGKILL)
            loads = {e: [k.recv() for k in ranks] for e, ranks in engines.items()}
            print("refit_sharded: step %d: loss %.3f; push v%d: %s" % (
                step, pushed[0]["loss"], step, ", ".join(
                    "rank %d %s" % (r, "%.0f ms" % p["ms"] if "pushed" in p else
                                    "SIGKILLed before it pushed" if "held" in p else
                                    "failed: " + p["why"]) for r, p in enumerate(pushed))))
            if kill:
                self.killed_mid_push(trainers, pushed[0], loads, step, engines, served, read,
                                     model_bytes)
                trainers = self.restart(trainers, step)
                continue
            for e, outs in loads.items():
                for r, out in enumerate(outs):
                    if out.get("loaded") != step:
                        raise Failed("engine %s rank %d did not load v%d: %s" % (e, r, step, out))
            if "push_failed" in pushed[0] or "push_failed" in pushed[1]:
                raise Failed("a push of v%d failed: %s" % (step, pushed))
            model = self.reference(step)
            for line in self.check_serving(engines, model, step, model_bytes, read):
                print("  " + line)
            with torch.no_grad():
                now = model(torch.tensor(PROMPT))
            if prev is not None and torch.allclose(prev, now, rtol=1e-3, atol=1e-3):
                raise Failed("the training step hardly changed the model: this check could "
                             "not tell v%d from v%d" % (step, served))
            prev, served = now, step
        print("refit_sharded: %d steps in %.1f s; every engine rank computed what the trainer's "
              "model computes at every version it committed" % (a.steps, time.monotonic() - t0))

    def killed_mid_push(self, trainers, pushed0, loads, step, engines, served, read, model_bytes):
        """Rank 1 was SIGKILLed in the middle of the push of `step` (rank 0's part landed, its own
        not sent): the version fails at every engine rank, naming rank 1, and every engine keeps
        serving the last one it committed."""
        code = trainers[1].p.wait(timeout=TIMEOUT)
        if code != -signal.SIGKILL:
            raise Failed("trainer rank 1 exited with %s, not SIGKILL" % code)
        for e, outs in loads.items():
            for r, out in enumerate(outs):
                if out.get("failed") != step:
                    raise Failed("engine %s rank %d: v%d with rank 1 killed mid-push: %s"
                                 % (e, r, step, out))
                if "rank 1" not in out["why"]:
                    raise Failed("engine %s rank %d: v%d failed without naming rank 1: %s"
                                 % (e, r, step, out["why"]))
        if "pushed" not in pushed0:
            raise Failed("trainer rank 0's push of v%d: %s" % (step, pushed0))
        print("  trainer rank 1 SIGKILLed mid-push (rank 0's part of v%d landed, its own not "
              "sent): v%d failed at every engine rank (%s); committed() there: %s"
              % (step, step, loads["A"][0]["why"],
                 ", ".join("%s %s" % (e, "/".join(str(o["committed"]) for o in outs))
                           for e, outs in loads.items())))
        for line in self.check_serving(engines, self.reference(served), served, model_bytes,
                                       read):
            print("  still " + line)

    def restart(self, trainers, step):
        """A new rank 1 process (the same rank and declaration, resuming from its checkpoint
        of `step`) and a new process group with rank 0."""
        store = self.store("trainers")
        trainers[0].send(cmd="regroup", store=store)
        k = self.trainer(1, store, resume=step)
        trainers = [trainers[0], k]
        for t in trainers:
            t.recv()
        k.send(cmd="receivers", n=3)
        k.recv()
        print("  trainer rank 1 restarted (a new process, resuming from its step %d checkpoint); "
              "the engines' receivers took it back" % step)
        return trainers


def orchestrator_main(args):
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="ferry-refit-sharded-")
    run = None
    try:
        # hosts the directory the ranks publish NAME#r in and the receivers resolve them from
        with ferry.Store(host_directory=True, name="refit-sharded-dir-%d" % os.getpid()) as dir_:
            run = Run(args, dir_.directory, tmp)
            run.main()
    except (Failed, ferry.Error) as e:
        raise SystemExit("refit_sharded: FAILED: %s" % e)
    finally:
        if run is not None:
            for k in run.children:
                k.close()
            deadline = time.monotonic() + 10
            for k in run.children:
                k.reap(deadline)
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=("orchestrator", "trainer", "engine"), default="orchestrator")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=3)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--refit")
    p.add_argument("--store")
    p.add_argument("--tmp")
    p.add_argument("--parent", type=int)
    p.add_argument("--resume", type=int, default=0)
    p.add_argument("--flat", action="store_true")
    args = p.parse_args()
    if args.role == "orchestrator":
        if not 2 <= args.kill_at < args.steps:
            p.error("--kill-at must be in [2, steps): a version to keep serving before, a step "
                    "to commit after")
        orchestrator_main(args)
    else:
        child_main(args)


if __name__ == "__main__":
    main()
