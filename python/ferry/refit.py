"""ferry.RefitSender and ferry.RefitReceiver: push each weight version of a model from the trainer
to every inference engine (ferry_refit_*, docs/REFIT.md).

    # trainer                                      # each engine
    tx = ferry.RefitSender("policy", model.state_dict())
                                                   rx = ferry.RefitReceiver("policy")
                                                   rx.bind(model.state_dict())   # in place
    optimizer.step()
    tx.push(1)                                     rx.wait(1)

The sender declares every tensor of the state dict once (where its bytes live: the tensors
themselves, no copy) and seals the plan; push(version) sends their current bytes. A receiver
binds its own tensors (bytes land in them) or takes views into one flat ferry buffer
(tensors()); either way nothing is copied again on the Python side.

Finding the sender: RefitSender(name) writes its address to FERRY_CTL_DIR/ferry-refit-NAME (next
to the control cells, mode 0600, removed on close), where RefitReceiver(name) reads it; a
receiver on another host passes the sender's `address` instead of the name.
"""
import ctypes
import os
import re
import socket
import threading
import time
import weakref
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import numpy as np

from . import _lib
from ._lib import POINTER, byref, c_char_p, c_int, c_size_t, c_uint64, c_void_p, lib
from .errors import (AlreadyExists, InvalidArgument, NotFound, NotSupported, Timeout, check,
                     raise_status)
from .tensors import DTYPES, Context, as_buffer, desc_shape, dtype_code, from_bits

__all__ = ["RefitSender", "RefitReceiver", "refit_address"]


class RefitOpts(ctypes.Structure):  # ferry_refit_opts
    _fields_ = [("size", c_size_t), ("bucket_bytes", c_uint64), ("alias", c_int),
                ("publish", c_int), ("directory", c_char_p)]


class PushOpts(ctypes.Structure):  # ferry_refit_push_opts
    _fields_ = [("size", c_size_t), ("only", POINTER(c_char_p)), ("n_only", c_size_t),
                ("skip_unchanged", c_int), ("timeout_ms", c_int), ("route", c_int)]


_protos = {
    "ferry_config_get": (c_char_p, [c_char_p]),
    "ferry_refit_sender_open": (c_int, [c_void_p, c_char_p, POINTER(RefitOpts),
                                        POINTER(c_void_p)]),
    "ferry_refit_sender_close": (None, [c_void_p]),
    "ferry_refit_declare": (c_int, [c_void_p, c_char_p, POINTER(_lib.TensorDesc), c_void_p,
                                    c_int]),
    "ferry_refit_seal": (c_int, [c_void_p]),
    "ferry_refit_push": (c_int, [c_void_p, c_uint64, POINTER(PushOpts)]),
    "ferry_refit_receivers": (c_size_t, [c_void_p]),
    "ferry_refit_receiver_open": (c_int, [c_void_p, c_char_p, c_int, POINTER(c_void_p)]),
    "ferry_refit_receiver_close": (None, [c_void_p]),
    "ferry_refit_tensor_count": (c_size_t, [c_void_p]),
    "ferry_refit_tensor_info": (c_int, [c_void_p, c_size_t, POINTER(c_char_p),
                                        POINTER(_lib.TensorDesc)]),
    "ferry_refit_tensor_scale": (c_int, [c_void_p, c_size_t, POINTER(ctypes.c_float)]),
    "ferry_refit_bind": (c_int, [c_void_p, c_char_p, c_void_p, POINTER(_lib.TensorDesc)]),
    "ferry_refit_bind_flat": (c_int, [c_void_p]),
    "ferry_refit_view": (c_int, [c_void_p, c_char_p, POINTER(c_void_p)]),
    "ferry_refit_wait": (c_int, [c_void_p, c_uint64, c_int, POINTER(c_uint64)]),
    "ferry_refit_committed": (c_uint64, [c_void_p]),
}
for _name, (_res, _args) in _protos.items():
    _f = getattr(lib, _name)
    _f.restype, _f.argtypes = _res, _args

_NAME_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$")
_seq = 0
_seq_lock = threading.Lock()
_published = set()  # rendezvous files this process wrote


_ms = _lib.timeout_ms


def _node_name(role):
    # Node names show in the peer's logs and errors; unique per process and handle.
    global _seq
    with _seq_lock:
        _seq += 1
        n = _seq
    return ("%s-%d-%s%d" % (socket.gethostname(), os.getpid(), role, n))[-63:]


def refit_address(name: str) -> str:
    """Where RefitSender(name) publishes its address: FERRY_CTL_DIR/ferry-refit-NAME."""
    if not _NAME_RE.match(name):
        raise InvalidArgument(-1, "refit name %r: 1-64 characters of [A-Za-z0-9._-], not "
                                  "starting with '.'" % (name,))
    d = (lib.ferry_config_get(b"FERRY_CTL_DIR") or b"/dev/shm").decode()
    return os.path.join(d, "ferry-refit-" + name)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_rendezvous(path):
    """(address, pid) of a live sender, or None."""
    try:
        with open(path) as f:
            lines = f.read().split("\n")
        addr, pid = lines[0], int(lines[1])
    except (OSError, ValueError, IndexError):
        return None
    return (addr, pid) if addr and _pid_alive(pid) else None


def _cast_code(cast, name, code):
    """The wire dtype code for a tensor: `cast` is None, one dtype (applied to every float32
    tensor, and to bfloat16 ones when it is a float8) or a {name: dtype} dict."""
    if cast is None:
        return 0
    if isinstance(cast, dict):
        return dtype_code(cast[name]) if name in cast else 0
    to = dtype_code(cast)
    if code == 12 or (code == 11 and to in (14, 15)):
        return to if to != code else 0
    return 0


class _Source:
    """One declared tensor: its bytes (the caller's tensor itself, or a contiguous staging copy
    refreshed before each push when the tensor is not contiguous)."""

    __slots__ = ("obj", "stage", "desc", "arr", "send_as")

    def __init__(self, obj):
        if hasattr(obj, "device") and getattr(obj.device, "type", "cpu") != "cpu":
            raise NotSupported(-20, "refit: tensors on %s are not supported (CPU only)"
                               % obj.device)
        self.obj = obj
        self.stage = None
        if _needs_staging(obj):
            self.stage = obj.contiguous() if hasattr(obj, "contiguous") else \
                np.ascontiguousarray(obj)
        self.desc, self.arr = as_buffer(obj if self.stage is None else self.stage)
        if self.arr.nbytes == 0:
            # ferry_refit_declare wants a pointer even for no bytes
            self.arr = np.zeros(1, np.uint8)
        self.send_as = 0

    def refresh(self):
        if self.stage is None:
            return
        if hasattr(self.stage, "copy_"):
            self.stage.copy_(self.obj.detach())
        else:
            np.copyto(self.stage, self.obj)

    def same(self, obj):
        if obj is self.obj:
            return True
        if self.stage is not None or _needs_staging(obj):
            return False
        desc, arr = as_buffer(obj)
        return (arr.ctypes.data == self.arr.ctypes.data and desc.dtype == self.desc.dtype
                and desc_shape(desc) == desc_shape(self.desc))


def _needs_staging(obj):
    if hasattr(obj, "is_contiguous"):
        return not obj.is_contiguous()
    return isinstance(obj, np.ndarray) and not obj.flags.c_contiguous


class RefitSender(_lib.Closing):
    """The trainer's side. state_dict: {name: numpy array or CPU torch tensor}; their memory is
    declared in place (keep the tensors alive; update them in place, as optimizers do; a
    non-contiguous tensor is copied into a staging buffer before each push).

    buffer_bytes: the bucket size (two are allocated; None: FERRY_REFIT_BUFFER_BYTES). cast:
    send float32 tensors as another dtype ("bfloat16", "float16", "float8_e4m3"), or a
    {name: dtype} dict. publish: write the address under `name` for RefitReceiver(name)."""

    def __init__(self, name: str, state_dict: Mapping[str, Any],
                 buffer_bytes: Optional[int] = None,
                 cast: Union[str, Any, Dict[str, Any], None] = None,
                 ctx: Optional[Context] = None, publish: bool = True) -> None:
        self.name = name
        path = refit_address(name) if publish else None
        if ctx is not None:
            self._ctx, self._owns_ctx = ctx, False
        else:
            self._ctx, self._owns_ctx = Context(name=_node_name("refit-tx")), True
        self._h = None
        self._path = None
        self._sources = {}
        self._cast = cast
        self._lock = threading.Lock()
        self.version = 0
        try:
            opts = RefitOpts(ctypes.sizeof(RefitOpts), int(buffer_bytes or 0))
            h = c_void_p()
            check(lib.ferry_refit_sender_open(self._ctx.handle, _lib.encoded(name, "name"), byref(opts),
                                              byref(h)))
            self._h = h.value
            self._declare(state_dict, first=True)
            check(lib.ferry_refit_seal(self._h))
            if path:
                self._publish(path)
        except BaseException:
            self.close()
            raise

    def _declare(self, state_dict, first=False):
        changed = False
        for name, obj in state_dict.items():
            old = self._sources.get(name)
            if old is not None and old.same(obj):
                continue
            src = _Source(obj)
            src.send_as = _cast_code(self._cast, name, src.desc.dtype)
            check(lib.ferry_refit_declare(self._h, _lib.encoded(name, "tensor name"), byref(src.desc),
                                          src.arr.ctypes.data, src.send_as))
            self._sources[name] = src
            changed = True
        if not first and changed:
            check(lib.ferry_refit_seal(self._h))
        return changed

    def _publish(self, path):
        found = _read_rendezvous(path)
        with _seq_lock:
            if path in _published or (found and found[1] != os.getpid()):
                raise AlreadyExists(-6, "refit '%s': a live sender (pid %d) publishes %s"
                                    % (self.name, found[1] if found else os.getpid(), path))
            _published.add(path)
            self._path = path
        tmp = "%s.%d.tmp" % (path, os.getpid())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("%s\n%d\n" % (self.address, os.getpid()))
        os.replace(tmp, path)

    # -- life --------------------------------------------------------------------------------
    @property
    def handle(self) -> int:
        """The C handle (ValueError once closed)."""
        if not self._h:
            raise ValueError("ferry: refit sender is closed")
        return self._h

    @property
    def address(self) -> str:
        """The address receivers attach to (RefitReceiver(address) from another host)."""
        return self._ctx.address

    @property
    def receivers(self) -> int:
        """How many receivers are attached now (not counting one dropped for a stall until it
        attaches again)."""
        return int(lib.ferry_refit_receivers(self.handle))

    def manifest(self) -> List[Dict[str, Any]]:
        """[{name, dtype, shape, wire_dtype}] in declaration order."""
        out = []
        for name, s in self._sources.items():
            out.append({"name": name, "dtype": DTYPES[s.desc.dtype][0],
                        "shape": desc_shape(s.desc),
                        "wire_dtype": DTYPES[s.send_as or s.desc.dtype][0]})
        return out

    def wait_receivers(self, n: int, timeout: Optional[float] = None) -> int:
        """Waits until at least n receivers are attached (polls; for tests and start-up)."""
        deadline = time.monotonic() + (10.0 if timeout is None else timeout)
        while self.receivers < n:
            if time.monotonic() >= deadline:
                raise Timeout(-4, "refit '%s': %d of %d receivers attached"
                              % (self.name, self.receivers, n))
            time.sleep(0.005)
        return self.receivers

    def close(self) -> None:
        """Detaches every receiver, frees the buckets and removes the published address."""
        with self._lock:
            h, self._h = self._h, None
            path, self._path = self._path, None
        if path:
            with _seq_lock:
                _published.discard(path)
            try:
                found = _read_rendezvous(path)
                if found is None or found[1] == os.getpid():
                    os.unlink(path)
            except OSError:
                pass
        if h:
            lib.ferry_refit_sender_close(h)
        if self._owns_ctx and self._ctx is not None:
            self._ctx.close()
            self._ctx = None

    # -- push --------------------------------------------------------------------------------
    def update(self, state_dict: Mapping[str, Any]) -> bool:
        """Takes tensors that were replaced (another object, dtype or shape) or added: they are
        declared again and the plan re-sealed; receivers pick the new manifest up with the next
        push (a binding that no longer fits fails there, naming the tensor). Returns whether
        anything changed."""
        with self._lock:
            return self._declare(state_dict)

    def push(self, version: Optional[int] = None, only: Optional[Iterable[str]] = None,
             skip_unchanged: bool = False, timeout: Optional[float] = None,
             state_dict: Optional[Mapping[str, Any]] = None) -> int:
        """Sends the tensors' current bytes as `version` (None: the last one + 1) and returns it
        once every attached receiver committed it. only: names of the tensors to send (the
        buckets they touch); skip_unchanged: skip buckets whose checksum did not change. Both
        apply only when every receiver holds the previous version. state_dict: update() first.
        A receiver that failed raises (the detail names only the receivers that did not commit;
        every other one committed before this returns). One that acknowledged nothing within
        `timeout` (stopped, stalled) raises ferry.Timeout and is dropped: later pushes go on
        without it until it attaches again, which it does by itself once it runs."""
        if state_dict is not None:
            self.update(state_dict)
        v = self.version + 1 if version is None else int(version)
        for s in self._sources.values():
            s.refresh()
        opts = PushOpts(ctypes.sizeof(PushOpts), None, 0, 1 if skip_unchanged else 0,
                        _ms(timeout))
        if only is not None:
            names = [_lib.encoded(n, "tensor name") for n in only]
            arr = (c_char_p * max(len(names), 1))(*names)
            opts.only, opts.n_only = ctypes.cast(arr, POINTER(c_char_p)), len(names)
        check(lib.ferry_refit_push(self.handle, v, byref(opts)))
        self.version = v
        return v


class _Flat:
    """The receiver's flat buffer seen from Python: numpy views over it keep this alive, and it
    keeps the receiver open (its close waits for the last view to go)."""

    def __init__(self, rx, base, nbytes):
        self.buf = (ctypes.c_uint8 * max(nbytes, 1)).from_address(base)
        self.buf._ferry_owner = self
        self.base = base
        rx._views += 1
        weakref.finalize(self, rx._release_view)


class RefitReceiver(_lib.Closing):
    """An engine's side: attaches to the sender published under `name` (or at an address, e.g.
    "tcp://10.0.0.5:40123", which is RefitSender.address) and receives its manifest.

    timeout: seconds to wait for the sender to appear and answer (None: FERRY_TIMEOUT_MS).
    Then either bind(state_dict) (bytes land in your tensors) or tensors() (views into one flat
    ferry buffer); wait(version) returns once a version committed (every bucket verified)."""

    def __init__(self, name: str, timeout: Optional[float] = None,
                 ctx: Optional[Context] = None) -> None:
        self.name = name
        if ctx is not None:
            self._ctx, self._owns_ctx = ctx, False
        else:
            self._ctx, self._owns_ctx = Context(name=_node_name("refit-rx")), True
        self._h = None
        self._lock = threading.Lock()
        self._bound = {}
        self._views = 0
        self._closing = False
        self._flat = None
        try:
            self._attach(name, timeout)
        except BaseException:
            self._closing = True
            self._really_close()
            raise

    def _attach(self, name, timeout):
        budget = _ms(timeout)
        if budget < 0:
            budget = int((lib.ferry_config_get(b"FERRY_TIMEOUT_MS") or b"10000").decode())
        deadline = time.monotonic() + budget / 1000.0
        if "://" in name:
            address = name
        else:
            path = refit_address(name)
            while True:
                found = _read_rendezvous(path)
                if found:
                    address = found[0]
                    break
                if time.monotonic() >= deadline:
                    raise NotFound(-5, "refit: no live sender '%s' (%s) within %.1f s"
                                   % (name, path, budget / 1000.0))
                time.sleep(0.01)
        left = max(0, int((deadline - time.monotonic()) * 1000))
        h = c_void_p()
        check(lib.ferry_refit_receiver_open(self._ctx.handle, _lib.encoded(address, "address"), left, byref(h)))
        self._h = h.value
        self.address = address

    # -- life --------------------------------------------------------------------------------
    @property
    def handle(self) -> int:
        """The C handle (ValueError once closed)."""
        if not self._h or self._closing:
            raise ValueError("ferry: refit receiver is closed")
        return self._h

    def _release_view(self):
        with self._lock:
            self._views -= 1
            last = self._views == 0 and self._closing
        if last:
            self._really_close()

    def close(self) -> None:
        """Detaches from the sender. While views from tensors() are alive the flat buffer stays
        mapped (the receiver stays attached) until the last one goes."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            busy = self._views > 0
        if not busy:
            self._really_close()

    def _really_close(self):
        h, self._h = self._h, None
        if h:
            lib.ferry_refit_receiver_close(h)
        self._bound = {}
        if self._owns_ctx and self._ctx is not None:
            self._ctx.close()
            self._ctx = None

    # -- the manifest ------------------------------------------------------------------------
    def manifest(self) -> List[Dict[str, Any]]:
        """[{name, dtype, shape, nbytes, scale}]: what the sender sends, in the wire dtype
        (after its cast), in plan order. scale: a float8_e4m3 tensor arrives as x / scale
        (x ~ value * scale); 1.0 for the others."""
        h = self.handle
        out = []
        for i in range(lib.ferry_refit_tensor_count(h)):
            name = c_char_p()
            desc = _lib.TensorDesc()
            scale = ctypes.c_float()
            check(lib.ferry_refit_tensor_info(h, i, byref(name), byref(desc)))
            check(lib.ferry_refit_tensor_scale(h, i, byref(scale)))
            shape = desc_shape(desc)
            nbytes = int(np.prod(shape, dtype=np.uint64)) * lib.ferry_dtype_size(desc.dtype)
            out.append({"name": name.value.decode(), "dtype": DTYPES[desc.dtype][0],
                        "shape": shape, "nbytes": int(nbytes), "scale": scale.value})
        return out

    def names(self) -> List[str]:
        """The tensors' names, in the sender's manifest order."""
        return [m["name"] for m in self.manifest()]

    # -- destinations ------------------------------------------------------------------------
    def bind(self, state_dict: Mapping[str, Any],
             strict: bool = True) -> Tuple[List[str], List[str]]:
        """Binds each tensor of state_dict (contiguous numpy arrays or CPU torch tensors, in the
        wire dtype and shape) by name: pushes write into them in place. strict: every tensor of
        the manifest must be bound and every name must be in it (KeyError-like NotFound
        otherwise); else returns (missing, unexpected) names. Keep the tensors alive."""
        h = self.handle
        names = set(self.names())
        missing = sorted(names - set(state_dict))
        unexpected = sorted(set(state_dict) - names)
        if strict and (missing or unexpected):
            raise NotFound(-5, "refit bind: missing %s, unexpected %s" % (missing, unexpected))
        for name, obj in state_dict.items():
            if name not in names:
                continue
            desc, arr = as_buffer(obj, writable=True)
            ptr = arr.ctypes.data if arr.nbytes else ctypes.addressof(ctypes.c_char())
            rc = lib.ferry_refit_bind(h, _lib.encoded(name, "tensor name"), ptr, byref(desc))
            if rc < 0:
                raise_status(rc)
            self._bound[name] = (obj, arr)
        return missing, unexpected

    def tensors(self, like: Any = "torch") -> Dict[str, Any]:
        """{name: tensor} views into one flat ferry buffer that every push writes in place
        (zero copy: no bytes move on the Python side). like: "torch" or "numpy" (bfloat16 and
        float8 come as their bits in numpy; a dtype the installed torch lacks, as numpy).

        When the sender re-seals (a tensor changed dtype or shape), the receiver lays the flat
        buffer out anew with the next push and frees the old one: call tensors() again then
        and drop the old views (reading them is undefined). Bound tensors (bind()) have no such
        hazard."""
        h = self.handle
        check(lib.ferry_refit_bind_flat(h))
        man = self.manifest()
        ptrs = []
        for m in man:
            p = c_void_p()
            check(lib.ferry_refit_view(h, _lib.encoded(m["name"], "tensor name"), byref(p)))
            ptrs.append(p.value)
        if not man:
            return {}
        base = min(ptrs)
        end = max(p + m["nbytes"] for p, m in zip(ptrs, man))
        with self._lock:
            flat = _Flat(self, base, end - base)
        out = {}
        for p, m in zip(ptrs, man):
            code = dtype_code(m["dtype"])
            npdt = np.dtype(DTYPES[code][1])
            arr = np.frombuffer(flat.buf, dtype=np.uint8, count=m["nbytes"], offset=p - base)
            arr = arr.view(npdt).reshape(m["shape"])
            try:
                out[m["name"]] = from_bits(arr, code, like)
            except NotSupported:  # a dtype this torch lacks (uint16..64 before torch 2.3)
                out[m["name"]] = arr
        return out

    # -- versions ----------------------------------------------------------------------------
    @property
    def committed(self) -> int:
        """The version the bound bytes hold: 0 when none yet, or when they are torn (a newer
        version began landing and did not complete: a push under way, a failed one, a sender
        that died). Serve weights only when this is the version you expect."""
        return int(lib.ferry_refit_committed(self.handle))

    def wait(self, version: Optional[int] = None, timeout: Optional[float] = None) -> int:
        """Waits until version (None: the latest the sender pushed, as far as this receiver
        knows, and at least 1) is committed and returns the committed version. Raises
        ferry.Timeout otherwise, or ferry.PeerGone at once when the sender is gone; the detail
        says the version in force, whether the bytes are torn (then `committed` is 0), and the
        last failure (e.g. a binding that no longer fits, naming the tensor)."""
        got = c_uint64()
        check(lib.ferry_refit_wait(self.handle, int(version or 0), _ms(timeout), byref(got)))
        return int(got.value)
