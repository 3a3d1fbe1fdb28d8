"""RefitSender.push_iter: a version pushed from an iterable of (name, tensor) whose tensors exist
only while it yields them (FSDP full_tensor(), Megatron -> HF conversion, a checkpoint read a
bucket at a time), in parts under a memory cap (ferry_refit_push_opts.part, docs/REFIT.md,
Streaming pushes).

The plan (names, dtypes, shapes, in the order they came) is made by RefitSender.plan(meta) from
metadata alone, or else by a sender's first push_iter, which has to see every tensor before a
receiver can place a byte: that version is copied into host memory as it comes, declared and
pushed whole, and the copies are freed when it returns. Every push_iter after the plan streams:
each tensor is pointed at where the iterable put it (ferry_refit_set_data) and held (a
reference, no copy) until the buckets it lies in were sent.
Whenever the held bytes would pass the cap, a part goes: the sender packs and sends every bucket
whose tensors all came, and the tensors whose buckets all went are let go. The last part commits
the version at every receiver that took all of its parts; a receiver never reports a version
whose bytes are not all that version (a sender that dies between parts leaves it torn, with its
committed version 0, until a whole version lands)."""
import ctypes
from typing import Any, Dict, Iterable, Optional, Tuple

import numpy as np

from .._lib import PushOpts, byref, lib
from ..errors import InvalidArgument, check
from ..tensors import _torch, as_buffer, desc_shape, dtype_code

PART_NONE, PART_MORE, PART_LAST, PART_ABORT = 0, 1, 2, 3


class PlanChanged(InvalidArgument):
    """push_iter met a tensor whose name, dtype or shape the sender's plan does not have (or
    missed one it has): the version was abandoned (no receiver commits it); the next push_iter
    plans anew from what it yields."""


class _Planned:
    __slots__ = ("bname", "key", "nbytes")

    def __init__(self, bname, key, nbytes):
        self.bname, self.key, self.nbytes = bname, key, nbytes


def _host_copy(name, t):
    """A contiguous host copy of a tensor the iterable yields (the first push's staging)."""
    torch = _torch()
    if torch is not None and isinstance(t, torch.Tensor):
        return t.detach().to("cpu", copy=True).contiguous()
    return np.array(t, copy=True, order="C")  # numpy, or what numpy takes (host memory)


_CODES: Dict[Any, int] = {}  # dtype object -> ferry dtype code, looked up once per dtype


def _code(dtype):
    code = _CODES.get(dtype)
    if code is None:
        code = _CODES[dtype] = dtype_code(dtype)
    return code


def _source(t):
    """(what to hold, its address, (dtype code, shape)) of a yielded tensor: CPU torch tensors and
    numpy arrays in place (a non-contiguous one copied once), anything else through as_buffer
    (a CUDA tensor: after its producer's stream is synchronized). A few µs: it runs per tensor."""
    if type(t) is np.ndarray:
        if not t.flags.c_contiguous:
            t = np.ascontiguousarray(t)
        return t, t.ctypes.data, (_code(t.dtype), t.shape)
    torch = _torch()
    if torch is not None and isinstance(t, torch.Tensor) and t.device.type == "cpu":
        if not t.is_contiguous():
            t = t.contiguous()
        return t, t.data_ptr(), (_code(t.dtype), tuple(t.shape))
    if isinstance(t, np.ndarray):
        return _source(np.asarray(t))
    desc, arr = as_buffer(t)
    return (t, arr), arr.ctypes.data, (desc.dtype, desc_shape(desc))


def _describe(key):
    from ..tensors import DTYPES
    return "%s%s" % (DTYPES[key[0]][0], list(key[1]))


def plan_and_push(tx, v, weights, opts) -> None:
    """The first push_iter (or one after the plan changed): every tensor copied to host memory,
    declared, sealed and pushed whole; tx._plan is then what the next ones stream against."""
    staged: Dict[str, Any] = {}
    for name, t in weights:
        if not isinstance(name, str):
            raise InvalidArgument(-1, "refit '%s' push_iter: names are str, got %r"
                                  % (tx.name, name))
        if name in staged:
            raise InvalidArgument(-1, "refit '%s' push_iter: tensor '%s' came twice in version "
                                  "%d" % (tx.name, name, v))
        staged[name] = _host_copy(name, t)
    if not staged:
        raise InvalidArgument(-1, "refit '%s' push_iter: version %d yielded no tensor"
                              % (tx.name, v))
    gone = [n for n in tx._sources if n not in staged]
    if gone:
        raise PlanChanged(-1, "refit '%s' push_iter: version %d lacks %s of the plan, and a plan "
                          "only grows (receivers bound them): open a sender under another name"
                          % (tx.name, v, ", ".join("'%s'" % n for n in gone[:3])))
    tx._sources = {}  # every tensor declared again, at its copy (a name keeps its place)
    tx._declare(staged)  # and sealed
    tx._plan = {name: _Planned(name.encode(), (src.desc.dtype, desc_shape(src.desc)),
                               _nbytes(src.desc))
                for name, src in tx._sources.items()}
    opts.part = PART_NONE
    try:
        check(lib.ferry_refit_push(tx.handle, v, byref(opts)))
    except BaseException:
        opts.part = PART_ABORT  # forgets what was given: those copies go below
        lib.ferry_refit_push(tx.handle, v, byref(opts))
        raise
    finally:
        tx.version = max(tx.version, v)
        for src in tx._sources.values():
            src.obj = src.stage = src.arr = None  # the copies go: later versions stream


def _meta(tx, name, t):
    """(dtype code, shape) of a plan entry: a tensor of any device (torch's meta device too), a
    numpy array, or a (shape, dtype) pair."""
    if isinstance(t, tuple) and len(t) == 2:
        return dtype_code(t[1]), tuple(int(d) for d in t[0])
    if hasattr(t, "dtype") and hasattr(t, "shape"):
        return dtype_code(t.dtype), tuple(int(d) for d in t.shape)
    raise InvalidArgument(-1, "refit '%s' plan: '%s' is %r; give a tensor (any device, torch's "
                          "meta device too) or a (shape, dtype) pair" % (tx.name, name, t))


def plan_from(tx, meta) -> None:
    """Declares and seals the plan from names, dtypes and shapes alone (no bytes), so that the
    first push_iter streams as every later one does and receivers may attach before it. The
    tensors point at a zeroed buffer that no push reads: nothing is given until push_iter gives
    it, and a part packs only buckets whose tensors were all given."""
    from ..tensors import make_desc
    from .sender import _cast_code
    entries = []
    for name, t in meta:
        code, shape = _meta(tx, name, t)
        send_as = _cast_code(tx._cast, name, code)
        if send_as == 14 and code != 14:
            raise InvalidArgument(-1, "refit '%s' plan: '%s' is cast to float8_e4m3, whose scale "
                                  "comes from its bytes at the seal: let the first push_iter "
                                  "plan instead" % (tx.name, name))
        entries.append((name, make_desc(code, shape), send_as))
    if not entries:
        raise InvalidArgument(-1, "refit '%s' plan: no tensor" % tx.name)
    if tx._plan is not None or tx._sources:
        raise InvalidArgument(-1, "refit '%s' plan: it has one (the plan is made once; a changed "
                              "one comes from push_iter)" % tx.name)
    zeros = np.zeros(max(max(_nbytes(d) for _, d, _ in entries), 1), np.uint8)
    h = tx.handle
    for name, desc, send_as in entries:
        check(lib.ferry_refit_declare(h, name.encode(), byref(desc), zeros.ctypes.data, send_as))
    check(lib.ferry_refit_seal(h))
    opts = PushOpts(ctypes.sizeof(PushOpts), None, 0, 0, -1, 0, PART_ABORT)
    check(lib.ferry_refit_push(h, tx.version + 1, byref(opts)))  # none open: forgets the givens
    tx._zeros = zeros  # declared there until the first push_iter points each tensor elsewhere
    tx._plan = {name: _Planned(name.encode(), (desc.dtype, desc_shape(desc)), _nbytes(desc))
                for name, desc, _ in entries}
    tx._sources = {name: _Declared(desc, send_as) for name, desc, send_as in entries}


class _Declared:
    """A tensor of a plan made from metadata: what manifest() reports (no bytes kept)."""
    __slots__ = ("obj", "stage", "desc", "arr", "send_as")

    def __init__(self, desc, send_as):
        self.obj = self.stage = self.arr = None
        self.desc, self.send_as = desc, send_as


def _nbytes(desc):
    from ..tensors import DTYPES
    n = np.dtype(DTYPES[desc.dtype][1]).itemsize
    for d in desc_shape(desc):
        n *= d
    return n


_set_data = lib.ferry_refit_set_data


class _Parts:
    """One streamed version: the tensors held, and the parts pushed so far."""

    def __init__(self, tx, v, opts, cap):
        self.tx, self.v, self.opts, self.cap = tx, v, opts, cap
        self.h = tx.handle
        self.held: Dict[str, Tuple[Any, _Planned]] = {}
        self.held_bytes = self.fresh = self.held_max = 0
        self.parts = 0
        self.opened = False
        self.given = set()

    def add(self, name, t):
        p = self.tx._plan.get(name)
        obj, ptr, key = _source(t)
        if p is None or key != p.key:
            had = _describe(p.key) if p is not None else "no such tensor"
            raise PlanChanged(-1, "refit '%s' push_iter: tensor '%s' is %s in version %d, the "
                              "plan (from the first push_iter) has %s; version %d is abandoned "
                              "(no receiver commits it) and the next push_iter plans anew"
                              % (self.tx.name, name, _describe(key), self.v, had, self.v))
        if name in self.given:
            raise InvalidArgument(-1, "refit '%s' push_iter: tensor '%s' came twice in version "
                                  "%d" % (self.tx.name, name, self.v))
        n = p.nbytes
        if self.held and self.held_bytes + n > self.cap and self.fresh * 2 >= self.cap:
            self.push(PART_MORE)
        if n:
            rc = _set_data(self.h, p.bname, ptr)
            if rc:
                check(rc)
        self.given.add(name)
        self.held[name] = (obj, p)
        self.held_bytes += n
        self.fresh += n
        self.held_max = max(self.held_max, self.held_bytes)
        if n > self.cap:  # bigger than the cap by itself: a part of its own (with what shares
            self.push(PART_MORE)  # its buckets)

    def push(self, part):
        self.opts.part = part
        self.opened = True
        check(lib.ferry_refit_push(self.tx.handle, self.v, byref(self.opts)))
        self.parts += 1
        self.fresh = 0
        if part != PART_MORE:
            return  # the version ended: the caller lets go of everything
        h = self.tx.handle
        for name in [k for k, (_, p) in self.held.items()
                     if not p.nbytes or lib.ferry_refit_part_sent(h, p.bname) == 1]:
            self.held_bytes -= self.held.pop(name)[1].nbytes

    def abort(self):
        self.opts.part = PART_ABORT
        lib.ferry_refit_push(self.tx.handle, self.v, byref(self.opts))  # 0 when none is open


def stream_push(tx, v, weights: Iterable[Tuple[str, Any]], opts, cap: int) -> Dict[str, int]:
    """A version in parts against tx._plan; returns what it took (parts, held_max bytes)."""
    s = _Parts(tx, v, opts, cap)
    try:
        for name, t in weights:
            s.add(name, t)
        missing = [n for n in tx._plan if n not in s.given]
        if missing:
            raise PlanChanged(-1, "refit '%s' push_iter: version %d lacks %s of the plan; it is "
                              "abandoned (no receiver commits it) and the next push_iter plans "
                              "anew" % (tx.name, v, ", ".join("'%s'" % n for n in missing[:3])))
        s.push(PART_LAST)
    except BaseException as e:
        s.abort()
        if isinstance(e, PlanChanged):
            tx._plan = None
        raise
    finally:
        s.held.clear()
        tx.version = max(tx.version, v) if s.opened else tx.version
    tx._zeros = None  # every tensor was given: none points at plan()'s zeros any more
    return {"parts": s.parts, "held_max": s.held_max, "bytes": sum(
        p.nbytes for p in tx._plan.values()) if tx._plan else 0}


def cap_bytes(cap: Optional[float], bucket: Optional[int], default_bucket: int) -> int:
    """The cap in bytes: an int, a fraction in (0, 1) of the free memory of torch's current CUDA
    device (else of the host's available memory), or None: 4 buckets."""
    if cap is None:
        return 4 * (bucket or default_bucket)
    if isinstance(cap, float) and 0 < cap < 1:
        torch = _torch()
        free = None
        if torch is not None and torch.cuda.is_available():
            free = torch.cuda.mem_get_info()[0]
        if free is None:
            import os
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return max(int(cap * free), 1)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
        raise InvalidArgument(-1, "refit stream_cap=%r: bytes (an int > 0) or a fraction of free "
                              "memory (a float in (0, 1))" % (cap,))
    return cap

