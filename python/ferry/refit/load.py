"""RefitReceiver.updates(): an engine loads each tensor of a version as the buckets carrying it
land, `engine.load_weights(rx.updates(v))`.

The receiver's thread reports each bucket that landed and verified (ferry_refit_on_bucket) and
the end of each version (ferry_refit_on_commit) into a queue; the iteration, on the caller's
thread, yields a tensor once every bucket that carries it (ferry_refit_tensor_buckets) was
reported for the version it loads, and the rest when the version commits. From a sharded
sender group (ferry_refit_ranks > 1) every tensor comes once the version commits. A shard target
(bind_shards) waits for every bucket of the sender tensors its pieces come from: the receiver
reports each bucket of a push, those it read nothing from included, so that is when its
slices have landed. Nothing here blocks
the receiver's thread, so the sender's pushes never wait on the engine's loading.

A mapping turns trainer names into the engine's and fuses pieces (q, k, v into qkv) along dim 0,
in the shape of vLLM's stacked_params_mapping: (param_name, shard_name, shard_id). MoE experts
fuse from rules in the shape of vLLM's expert_params_mapping (param_name, weight_name,
expert_id, shard_id), as FusedMoE.make_expert_params_mapping builds them (vllm-project/vllm
vllm/model_executor/layers/fused_moe/layer.py at commit c439a139790cafaecb54e8dea123b78049f1442b,
checked against it: the classmethod (cls, ckpt_gate_proj_name, ckpt_down_proj_name,
ckpt_up_proj_name, num_experts), the tuples in that order, experts in order and within each
(w1, gate), (w2, down), (w3, up); FusedMoE.weight_loader's _load_w13 puts w1 in the first half
of an expert's w13 rows and w3 in the second, _load_w2 w2 whole): "experts.{e}.gate_proj." (w1)
and "experts.{e}.up_proj." (w3) become "experts.w13_...", of shape [E, 2*I, H] (expert e's gate
rows then its up rows), "experts.{e}.down_proj." (w2) becomes "experts.w2_...", [E, H, I].
Later vLLM takes the model first and num_redundant_experts=0 last (EplbManager builds the list);
expert_params_mapping() is the form above.
"""
import ctypes
import numbers
import queue
import time

import numpy as np

from .. import errors
from .._lib import lib, byref, c_size_t
from ..tensors import DTYPES, dtype_code, from_bits, like_name

_QKV = {"q": 0, "k": 1, "v": 2}  # vLLM's shard ids of qkv_proj
_ETIMEDOUT = -4
_TICK = 0.1  # seconds between looks at the sender's link while no event comes


def _position(name, sid):
    if sid is None:
        return None
    if isinstance(sid, int) and not isinstance(sid, bool) and sid >= 0:
        return sid
    if isinstance(sid, str) and sid in _QKV:
        return _QKV[sid]
    raise ValueError("updates mapping of %r: shard id %r; pass an int >= 0 (the piece's place "
                     "along dim 0), 'q', 'k' or 'v', or None (no fusing)" % (name, sid))


def _normalize(name, got):
    """[(engine name, position or None)] from what a mapping says for one trainer name."""
    if got is None:
        return []
    if isinstance(got, str):
        return [(got, None)]
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], str):
        return [(got[0], _position(name, got[1]))]
    if isinstance(got, list):
        out = []
        for g in got:
            if isinstance(g, list):
                raise ValueError("updates mapping of %r: a list inside a list (%r)" % (name, got))
            out += _normalize(name, g)
        return out
    raise ValueError("updates mapping of %r: %r; give an engine name, (engine name, shard id), "
                     "a list of those, or None to skip it" % (name, got))


_EXPERT_SHARDS = {"w1": 0, "w3": 1, "w2": 0}  # place within one expert's rows; w13 has 2


def expert_params_mapping(ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name,
                          num_experts):
    """The rules vLLM's FusedMoE.make_expert_params_mapping returns (same arguments; layer.py at
    c439a139), for updates(mapping=): [(param_name, weight_name, expert_id, shard_id)]."""
    return [("experts.w13_" if weight_name in (ckpt_gate_proj_name, ckpt_up_proj_name)
             else "experts.w2_", "experts.%d.%s." % (expert_id, weight_name), expert_id, shard_id)
            for expert_id in range(num_experts)
            for shard_id, weight_name in (("w1", ckpt_gate_proj_name), ("w2", ckpt_down_proj_name),
                                          ("w3", ckpt_up_proj_name))]


def _expert_rule(rule):
    return (isinstance(rule, (tuple, list)) and len(rule) == 4 and isinstance(rule[0], str)
            and isinstance(rule[1], str) and rule[1] and isinstance(rule[2], int)
            and not isinstance(rule[2], bool) and rule[2] >= 0 and rule[3] in _EXPERT_SHARDS)


def _expert_position(rule):
    per = 1 if rule[3] == "w2" else 2
    return rule[2] * per + _EXPERT_SHARDS[rule[3]]


def experts_of(manifest, mapping):
    """{engine name: number of experts} of the targets that expert rules fuse: each is the
    pieces concatenated along dim 0, reshaped to [experts, rows of one expert, ...]."""
    if not isinstance(mapping, (list, tuple)):
        return {}
    out = {}
    for m in manifest:
        for rule in mapping:
            if _expert_rule(rule) and rule[1] in m["name"]:
                ename = m["name"].replace(rule[1], rule[0])
                out.setdefault(ename, set()).add(rule[2])
                break
    return {e: len(ids) for e, ids in out.items()}


def _rules_target(name, rules):
    # expert rules first: "experts.0.gate_proj." also holds ".gate_proj" (vLLM's MoE models skip
    # "mlp.experts" names in their stacked loop for the same reason)
    for rule in rules:
        if _expert_rule(rule) and rule[1] in name:
            return (name.replace(rule[1], rule[0]), _expert_position(rule))
    for rule in rules:
        if _expert_rule(rule):
            continue
        if not (isinstance(rule, (tuple, list)) and len(rule) == 3 and isinstance(rule[0], str)
                and isinstance(rule[1], str) and rule[1]):
            raise ValueError("updates mapping rule %r: pass (param_name, shard_name, shard_id) "
                             "as vLLM's stacked_params_mapping does, e.g. ('.qkv_proj', "
                             "'.q_proj', 'q'), or (param_name, weight_name, expert_id, "
                             "'w1'|'w2'|'w3') as its expert_params_mapping does" % (rule,))
        if rule[1] in name:
            return (name.replace(rule[1], rule[0]), rule[2])
    return name


def targets_of(name, mapping):
    """[(engine name, position or None)] of one trainer tensor under `mapping`."""
    if mapping is None:
        return [(name, None)]
    if isinstance(mapping, dict):
        return _normalize(name, mapping.get(name, name))
    if isinstance(mapping, (list, tuple)):
        return _normalize(name, _rules_target(name, mapping))
    if callable(mapping):
        return _normalize(name, mapping(name))
    raise ValueError("updates: mapping=%r; pass a dict {trainer name: engine name or (engine "
                     "name, shard id)}, a callable name -> the same, or a list of vLLM "
                     "(param_name, shard_name, shard_id) rules" % (mapping,))


def plan(manifest, mapping):
    """{engine name: [manifest index, ...] in fusing order} (one index: not fused), in the order
    the engine names first appear; ValueError for a mapping that cannot be met."""
    groups = {}
    for i, m in enumerate(manifest):
        for ename, pos in targets_of(m["name"], mapping):
            groups.setdefault(ename, []).append((pos, i))
    out = {}
    for ename, pieces in groups.items():
        names = [manifest[i]["name"] for _, i in pieces]
        if any(pos is None for pos, _ in pieces):
            if len(pieces) > 1:
                raise ValueError("updates mapping: %s all become %r; give each a shard id to fuse "
                                 "them, or distinct names" % (names, ename))
            out[ename] = [pieces[0][1]]
            continue
        pieces.sort(key=lambda p: p[0])
        if [p for p, _ in pieces] != list(range(len(pieces))):
            raise ValueError("updates mapping: the pieces of %r (%s) have shard ids %s; they must "
                             "be 0, 1, ... (or q, k, v), once each"
                             % (ename, names, [p for p, _ in pieces]))
        first = manifest[pieces[0][1]]
        for _, i in pieces:
            m = manifest[i]
            if m["dtype"] != first["dtype"] or len(m["shape"]) < 1 or \
                    m["shape"][1:] != first["shape"][1:]:
                raise ValueError("updates mapping: %r fuses %s along dim 0, but %r is %s %s and "
                                 "%r is %s %s" % (ename, names, first["name"], first["dtype"],
                                                  first["shape"], m["name"], m["dtype"],
                                                  m["shape"]))
        out[ename] = [i for _, i in pieces]
    return out


def bound_entries(rx, manifest):
    """What a receiver with bound destinations yields from: ([entry], [[manifest index, ...]])
    with an entry ({name, dtype, shape, nbytes}) per tensor bound whole (bind()) and per shard
    target (bind_shards()), in the order of the first sender tensor each reads, and the
    sender tensors whose buckets carry its bytes (a shard target's pieces lie in its sources'
    buckets: it has landed once all of those did)."""
    index = {m["name"]: i for i, m in enumerate(manifest)}
    rows = []
    for i, m in enumerate(manifest):
        if m["name"] in rx._bound and m["name"] not in rx._pieces:
            rows.append((m, [i]))
    for target, pieces in rx._pieces.items():
        gone = [p.source for p in pieces if p.source not in index]
        if gone:
            raise errors.NotFound(-5, "refit updates: shard target %r reads %s, which the sender "
                                  "no longer sends; bind its shards again" % (target, gone))
        idx = [index[p.source] for p in pieces]
        arr = rx._bound[target][1]
        rows.append(({"name": target, "dtype": manifest[idx[0]]["dtype"],
                      "shape": tuple(arr.shape), "nbytes": int(arr.nbytes)}, idx))
    rows.sort(key=lambda row: min(row[1], default=len(manifest)))
    return [e for e, _ in rows], [idx for _, idx in rows]


class _Layout:
    """Where each tensor of the manifest is (views or bound tensors), which buckets carry it,
    and the engine targets over them."""

    def __init__(self, rx, mapping, like):
        h = rx.handle
        self.manifest = rx.manifest()
        self.flat = None
        self.ptrs = {}
        if rx._alias or rx._has_flat or not rx._bound:
            if not rx._alias:
                errors.check(lib.ferry_refit_bind_flat(h))
                rx._has_flat = True
            self.tensors, self.ptrs, self.flat = rx._view_map(like)
            present = self.manifest
            sources = [[i] for i in range(len(present))]
        else:  # bind() / bind_shards(): the caller's own tensors; the rest are not stored
            self.tensors = {n: obj for n, (obj, _) in rx._bound.items()}
            present, sources = bound_entries(rx, self.manifest)
        self.targets = plan(present, mapping)
        self.experts = experts_of(present, mapping)
        self.present = present
        self.like = like
        self.alias = rx._alias
        first, count = ctypes.c_uint32(), ctypes.c_uint32()
        carry = []
        # A sharded sender group's global tensor spans buckets of several ranks: the receiver
        # says nothing per bucket (FERRY_ENOTSUP) and every target comes when the version
        # commits (no bucket completes one).
        group = lib.ferry_refit_ranks(h) > 1
        for i in range(len(self.manifest)):
            if group:
                carry.append(range(0))
                continue
            errors.check(lib.ferry_refit_tensor_buckets(h, c_size_t(i), byref(first),
                                                        byref(count)))
            carry.append(range(first.value, first.value + count.value))
        spans = [set().union(*(carry[i] for i in idx)) for idx in sources]
        self.need = {}      # engine name -> buckets it waits for
        self.by_bucket = {}  # bucket -> engine names it may complete, in target order
        for ename, idx in self.targets.items():
            need = set().union(*(spans[i] for i in idx))
            self.need[ename] = need
            for b in sorted(need):
                self.by_bucket.setdefault(b, []).append(ename)

    def tensor(self, ename):
        idx = self.targets[ename]
        parts = [self.tensors[self.present[i]["name"]] for i in idx]
        if len(parts) == 1:
            return parts[0]
        out = self._fused(idx, parts)
        n = self.experts.get(ename)
        if n:  # [E*rows, ...] -> [E, rows, ...]: the FusedMoE parameter's shape
            out = out.reshape((n, out.shape[0] // n) + tuple(out.shape[1:]))
        return out

    def _fused(self, idx, parts):
        ms = [self.present[i] for i in idx]
        ptrs = [self.ptrs.get(m["name"]) for m in ms]
        adjacent = self.flat is not None and all(p is not None for p in ptrs) and all(
            ptrs[k] + ms[k]["nbytes"] == ptrs[k + 1] for k in range(len(ms) - 1))
        if adjacent:  # one view over the pieces, back to back in the buffer
            code = dtype_code(ms[0]["dtype"])
            total = sum(m["nbytes"] for m in ms)
            shape = (sum(m["shape"][0] for m in ms),) + tuple(ms[0]["shape"][1:])
            arr = np.frombuffer(self.flat.buf, dtype=np.uint8, count=total,
                                offset=ptrs[0] - self.flat.base)
            arr = arr.view(np.dtype(DTYPES[code][1])).reshape(shape)
            if self.alias:
                arr.flags.writeable = False
            try:
                return from_bits(arr, code, self.like)
            except errors.NotSupported:
                return arr
        if isinstance(parts[0], np.ndarray):
            return np.concatenate(parts, axis=0)
        import torch
        return torch.cat(parts, dim=0)


def _failed(version, status, why):
    """The error of a version that did not commit here, with the receiver's reason."""
    cls = errors._BY_CODE.get(status, errors.Error)
    return cls(status, "refit: version %d did not commit here%s" %
               (version, ": " + why if why else ""))


def _run(up, lay, mapping, timeout_s, like):
    """The iteration of Updates `up`: yields (engine name, tensor) of version up.version."""
    rx, events = up._rx, up._events
    target, landed, done = up.version, set(), []
    seen_target = False

    def rest():
        for ename in lay.targets:
            if ename not in done:
                done.append(ename)
                yield ename, lay.tensor(ename)

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            kind, v, x = events.get_nowait()
        except queue.Empty:
            rc, have = rx._wait_now(target)  # also asks for the latest when it lacks it
            if rc == 0:  # committed (before this began, or its event is behind us)
                if not done and lay.manifest != rx.manifest():
                    lay = _Layout(rx, mapping, like)
                up.version = max(target, have) if not done else target
                yield from rest()
                return
            left = deadline - time.monotonic()
            if rc != _ETIMEDOUT or left <= 0:
                errors.raise_status(rc)
            try:
                kind, v, x = events.get(timeout=min(left, _TICK))
            except queue.Empty:
                continue
        deadline = time.monotonic() + timeout_s  # the timeout bounds a wait for progress
        if kind == "bucket" and v > target:
            if done:
                raise errors.Stale(-23, "refit: version %d was overtaken by %d while it loaded: "
                                   "the tensors yielded are being overwritten; load again"
                                   % (target, v))
            target, landed, seen_target = v, set(), False  # nothing given out: load the newer
            up.version = v
        if kind == "bucket" and v == target:
            if not seen_target:
                seen_target = True  # a re-seal comes with a version's first bucket
                if lay.manifest != rx.manifest():
                    lay = _Layout(rx, mapping, like)
            landed.add(x)
            for ename in lay.by_bucket.get(x, ()):
                if ename not in done and lay.need[ename] <= landed:
                    done.append(ename)
                    yield ename, lay.tensor(ename)
        elif kind == "commit" and v >= target:
            if x[0] != 0:
                raise _failed(v, *x)
            yield from rest()
            return


class Updates:
    """The iterator RefitReceiver.updates() returns. From its creation it has a destination
    bound and listens to the receiver, so buckets that land before the iteration begins count;
    it stops listening when the iteration ends (done or raised), on close(), on leaving a
    `with` block, or when it is garbage-collected."""

    def __init__(self, rx, version, mapping, timeout_s, like):
        self._rx = rx
        self._events = queue.SimpleQueue()
        self._listening = False
        rx._listen(self._events.put)
        self._listening = True
        try:
            lay = _Layout(rx, mapping, like)
        except BaseException:
            self.close()
            raise
        self.version = version  # the version loaded (a newer one when it overtook first)
        self._gen = _run(self, lay, mapping, timeout_s, like)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._gen)
        except BaseException:
            self.close()
            raise

    def close(self):
        """Stops listening (a load given up halfway leaves nothing behind)."""
        if self._listening:
            self._listening = False
            if hasattr(self, "_gen"):
                self._gen.close()
            self._rx._unlisten(self._events.put)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def updates(rx, version, mapping, timeout, like):
    """RefitReceiver.updates (its docstring): checks the arguments now, loads when iterated."""
    if isinstance(version, bool) or not isinstance(version, numbers.Integral) or version < 1:
        raise ValueError("updates: version=%r; pass the version to load (an int >= 1)"
                         % (version,))
    if like_name(like) not in ("torch", "numpy"):
        raise ValueError("updates: like=%r; pass 'torch' or 'numpy'" % (like,))
    manifest = rx.manifest()
    # a mapping that cannot be met fails here, not mid-load
    plan(bound_entries(rx, manifest)[0] if rx._pieces else manifest, mapping)
    budget = -1 if timeout is None else timeout * 1000
    if budget < 0:
        budget = int((lib.ferry_config_get(b"FERRY_TIMEOUT_MS") or b"10000").decode())
    return Updates(rx, int(version), mapping, budget / 1000.0, like)
