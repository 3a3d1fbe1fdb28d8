"""NumPy arrays and torch tensors as (ferry_tensor_desc, data pointer) without copies, contexts,
and ferry.empty: arrays in ferry shared memory (ferry_alloc), so a store put of one is in place."""
import ctypes
import math
import sys
import threading
import warnings
import weakref
from types import ModuleType
from typing import Any, Dict, Optional, Sequence, Set, Tuple, Union

import numpy as np

from . import _lib
from ._lib import lib
from .errors import NotSupported, check

__all__ = ["Context", "default_context", "empty", "DTYPES"]

# ferry dtype code -> (name, numpy dtype that holds its bits)
DTYPES = {
    1: ("bool", np.bool_), 2: ("uint8", np.uint8), 3: ("uint16", np.uint16),
    4: ("uint32", np.uint32), 5: ("uint64", np.uint64), 6: ("int8", np.int8),
    7: ("int16", np.int16), 8: ("int32", np.int32), 9: ("int64", np.int64),
    10: ("float16", np.float16), 11: ("bfloat16", np.uint16), 12: ("float32", np.float32),
    13: ("float64", np.float64), 14: ("float8_e4m3", np.uint8), 15: ("float8_e5m2", np.uint8),
}
NP_DTYPES = {code: np.dtype(t) for code, (_, t) in DTYPES.items()}  # made once: per-call lookups
_BY_NAME = {name: code for code, (name, _) in DTYPES.items()}
_BY_NAME.update({"bf16": 11, "f16": 10, "f32": 12, "f64": 13, "half": 10, "float": 12,
                 "double": 13, "fp8_e4m3": 14, "fp8_e5m2": 15, "float8_e4m3fn": 14})
_NP_TO_FERRY = {np.dtype(t): code for code, (name, t) in DTYPES.items()
                if code not in (11, 14, 15)}

# torch is optional and imported lazily: it takes seconds to import, and an object can only be
# a torch tensor (or dtype) once the caller imported torch itself.
_TORCH_TO_FERRY = {}
_FERRY_TO_TORCH = {}


def _torch(need: bool = False) -> Optional[ModuleType]:
    """The torch module if the process imported it (need=True: import it now), else None."""
    t = sys.modules.get("torch")
    if t is None and need:
        try:
            import torch as t
        except ImportError:
            raise ImportError("ferry: like='torch' needs torch") from None
    if t is not None and not _TORCH_TO_FERRY:
        _torch_dtypes(t)
    return t


def _torch_dtypes(torch: ModuleType) -> None:
    m = {torch.bool: 1, torch.uint8: 2, torch.int8: 6, torch.int16: 7, torch.int32: 8,
         torch.int64: 9, torch.float16: 10, torch.bfloat16: 11, torch.float32: 12,
         torch.float64: 13}
    for attr, code in (("uint16", 3), ("uint32", 4), ("uint64", 5), ("float8_e4m3fn", 14),
                       ("float8_e5m2", 15)):
        if hasattr(torch, attr):
            m[getattr(torch, attr)] = code
    _FERRY_TO_TORCH.update({code: t for t, code in m.items()})
    _TORCH_TO_FERRY.update(m)


_SUPPORTED = ("pass one of " + ", ".join(name for name, _ in DTYPES.values()) +
              " (a name like \"bfloat16\", a numpy dtype or a torch dtype)")


def dtype_code(dtype: Any) -> int:
    """A ferry dtype code from a name ("bfloat16", "u8"), a numpy dtype or a torch dtype.
    TypeError naming the supported dtypes for anything else."""
    if isinstance(dtype, str) and dtype in _BY_NAME:
        return _BY_NAME[dtype]
    torch = _torch()
    if torch is not None and isinstance(dtype, torch.dtype):
        if dtype in _TORCH_TO_FERRY:
            return _TORCH_TO_FERRY[dtype]
        raise TypeError("ferry: torch dtype %s is not supported: %s" % (dtype, _SUPPORTED))
    try:
        return _NP_TO_FERRY[np.dtype(dtype)]
    except (TypeError, KeyError):
        raise TypeError("ferry: dtype %r is not supported: %s" % (dtype, _SUPPORTED)) from None


_DESCS = {}  # (code, shape) -> TensorDesc: calls only read a desc, so one serves every call


def make_desc(code: int, shape: Sequence[int]) -> Any:
    """The ferry_tensor_desc (_lib.TensorDesc) of dtype code and shape, cached: calls only read
    it. ValueError beyond MAX_DIMS dimensions."""
    d = _DESCS.get((code, shape))
    if d is not None:
        return d
    if len(shape) > _lib.MAX_DIMS:
        raise ValueError("ferry: %d dimensions; at most %d" % (len(shape), _lib.MAX_DIMS))
    d = _lib.TensorDesc()
    d.dtype, d.ndim = code, len(shape)
    for i, n in enumerate(shape):
        d.shape[i] = _lib.c_int_of(n, _lib.c_uint64, "shape %s dim %d" % (tuple(shape), i))
    if len(_DESCS) < 4096:
        _DESCS[(code, tuple(int(n) for n in shape))] = d
    return d


def desc_shape(desc: Any) -> Tuple[int, ...]:
    """A ferry_tensor_desc's shape as a tuple of ints."""
    return tuple(desc.shape[:desc.ndim])  # a ctypes array's slice is a list of ints


_KDLCPU = 1  # DLPack's device type of host memory


def _what(obj: Any) -> str:
    return type(obj).__module__ + "." + type(obj).__qualname__ \
        if type(obj).__module__ != "builtins" else type(obj).__name__


# a destination (get's out=, a refit binding) is written in place: a contiguous copy of it would
# take the bytes instead of the caller's memory
_NOT_IN_PLACE = ("ferry: a destination is written in place and must be %s: pass one made "
                 "contiguous (np.empty(shape, dtype) or torch.empty(...)) and copy from it "
                 "afterwards; a contiguous copy of this one would not be the caller's memory")


def _unsupported(obj: Any, why: str) -> TypeError:
    return TypeError("ferry: cannot store or send %s (%s): pass a numpy array, a CPU tensor of any framework "
                     "(anything with __dlpack__: torch, paddle, jax, cupy on the host), a CUDA "
                     "tensor (torch, or anything with __cuda_array_interface__), or bytes"
                     % (_what(obj), why))


def _from_dlpack(obj: Any) -> np.ndarray:
    """A numpy array over obj's memory through DLPack (no copy); host memory only."""
    dev = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else (_KDLCPU, 0)
    if int(dev[0]) != _KDLCPU:
        raise NotSupported(-20, "%s lies in device memory (DLPack device %d), which ferry takes "
                           "only as a torch CUDA tensor or through __cuda_array_interface__; "
                           "pass x.cpu() (or the framework's equivalent)"
                           % (_what(obj), int(dev[0])))
    try:
        return np.from_dlpack(obj)
    except (TypeError, BufferError, RuntimeError) as e:
        raise _unsupported(obj, "DLPack export failed: %s" % e) from None


def as_buffer(obj: Any, writable: bool = False) -> Tuple[Any, Any]:
    """(desc, numpy array sharing obj's memory) for a numpy array, a CPU torch tensor, any
    object with __dlpack__ (paddle, jax, cupy host arrays), or bytes-like data (bytes,
    bytearray, memoryview: uint8 of their length).

    A torch CUDA tensor or an object with __cuda_array_interface__ (CuPy, a ferry.DeviceArray)
    gives a ferry.cuda.DeviceBytes instead (the device pointer as .ctypes.data, .nbytes), after
    synchronizing the producer's stream (ferry/cuda.py); it must be contiguous.

    Contiguous input is used in place (the returned array is a view of it); a non-contiguous
    array or tensor is copied once, which is wrong for an output, so `writable` refuses it."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            if obj.device.type == "cuda":
                from .cuda import torch_tensor
                return torch_tensor(obj.detach(), torch)
            raise NotSupported(-20, "tensors on %s are not supported (CPU and CUDA only): pass "
                               "x.cpu()" % obj.device)
        code = dtype_code(obj.dtype)
        t = obj.detach()
        if not t.is_contiguous():
            if writable:
                raise ValueError(_NOT_IN_PLACE % "contiguous")
            t = t.contiguous()
        if code in (11, 14, 15):  # numpy has no such dtype: carry the bits
            bits = torch.int16 if code == 11 else torch.uint8
            arr = t.view(bits).numpy().view(DTYPES[code][1])
        else:
            arr = t.numpy()
        return make_desc(code, tuple(t.shape)), arr
    if isinstance(obj, (bytes, bytearray, memoryview)):
        mv = memoryview(obj)
        if not mv.c_contiguous:
            mv = memoryview(mv.tobytes())
        obj = np.frombuffer(mv.cast("B"), dtype=np.uint8) if mv.nbytes else \
            np.zeros(0, np.uint8)
    elif not isinstance(obj, np.ndarray):
        if hasattr(type(obj), "__cuda_array_interface__"):  # before DLPack: CuPy has both
            from .cuda import cai_object
            return cai_object(obj, writable)
        if hasattr(obj, "__dlpack__"):
            obj = _from_dlpack(obj)
        elif isinstance(obj, str):
            raise _unsupported(obj, "text: pass x.encode() (get(key, like=bytes).decode() "
                               "reads it back)")
        elif isinstance(obj, (list, tuple)) and all(isinstance(x, (int, float, bool))
                                                    for x in obj):
            raise _unsupported(obj, "a sequence of numbers: pass np.asarray(x) (with the dtype "
                               "you want, e.g. np.asarray(x, np.int32))")
        elif isinstance(obj, (dict, list, tuple, set)) or obj is None:
            raise _unsupported(obj, "not an array; serialize it first, e.g. "
                               "json.dumps(x).encode() or pickle.dumps(x)")
        else:
            obj = np.asarray(obj)
    code = _NP_TO_FERRY.get(obj.dtype)
    if code is None:
        if obj.dtype.kind in "OSUV":
            raise _unsupported(obj, "numpy dtype %s holds no fixed-size numbers; pass "
                               "bytes(...) or an array of a numeric dtype" % obj.dtype)
        if obj.dtype.kind == "c":
            raise _unsupported(obj, "complex numbers: pass x.view(np.float%d) (real and "
                               "imaginary parts interleaved)" % (obj.dtype.itemsize * 4))
        code = dtype_code(obj.dtype)
    if not obj.flags.c_contiguous:
        if writable:
            raise ValueError(_NOT_IN_PLACE % "C-contiguous")
        obj = np.ascontiguousarray(obj)
    if writable and not obj.flags.writeable:
        raise ValueError("ferry: a destination is written in place, and this array is read-only: "
                         "pass a writable one (np.empty_like(x), or np.array(x) for a copy)")
    return make_desc(code, obj.shape), obj


Like = Union[str, type, ModuleType]


def like_name(like: Any) -> str:
    """"numpy", "torch", "bytes" or "dlpack" (a module with from_dlpack) for a like= value."""
    if like is None or like == "numpy" or like is np:
        return "numpy"
    if like == "torch" or (isinstance(like, ModuleType) and like.__name__ == "torch"):
        return "torch"
    if like is bytes or like == "bytes":
        return "bytes"
    if isinstance(like, ModuleType) and hasattr(like, "from_dlpack"):
        return "dlpack"
    raise ValueError("ferry: like must be 'numpy', 'torch', bytes or a module with from_dlpack "
                     "(numpy, torch, paddle, jax.numpy, cupy), not %r" % (like,))


def from_bits(arr: np.ndarray, code: int, like: Any) -> Any:
    """Turns an array holding a dtype's bits into what the caller asked for: a numpy array
    ("numpy" or the numpy module), a torch tensor ("torch" or the module), bytes, or
    like.from_dlpack(arr) for any other framework module (paddle, jax.numpy, cupy)."""
    kind = like_name(like)
    if kind == "numpy":
        return arr
    if kind == "bytes":
        return arr.tobytes()
    if kind == "dlpack":
        if code in (11, 14, 15):
            raise NotSupported(-20, "%s through DLPack: numpy has no %s; use like='torch' or "
                               "like=numpy (its bits)" % (DTYPES[code][0], DTYPES[code][0]))
        src = arr if arr.flags.writeable else arr.copy()  # DLPack (numpy 1) cannot mark read-only
        return like.from_dlpack(src)
    torch = _torch(need=True)
    if code not in _FERRY_TO_TORCH:
        raise NotSupported(-20, "this torch has no %s" % DTYPES[code][0])
    with warnings.catch_warnings():
        # a read-only view (get_view) becomes a tensor that must not be written: documented
        warnings.filterwarnings("ignore", message=".*not writable.*")
        if code in (11, 14, 15):
            bits = np.int16 if code == 11 else np.uint8
            t = torch.from_numpy(arr.view(bits)) if arr.size else \
                torch.from_numpy(arr.view(bits).copy())
            return t.view(_FERRY_TO_TORCH[code])
        return torch.from_numpy(arr)


def _enc(s: Optional[Union[str, bytes]]) -> Optional[bytes]:
    return _lib.encoded(s, "string")


class NodeHandle(_lib.Closing):
    """A job's handle (store, mq) on a Context: `handle` (ValueError once closed), `context`,
    `name`. Subclasses set _h, _ctx and _what."""

    _what = "handle"

    @property
    def handle(self) -> int:
        """The C handle (ValueError once closed)."""
        h = self._h
        if not h:
            raise ValueError("ferry: %s is closed" % self._what)
        return h

    @property
    def context(self) -> "Context":
        """The ferry.Context this handle is opened on."""
        return self._ctx

    @property
    def name(self) -> str:
        """This node's name."""
        return self._ctx.name


class Context(_lib.Closing):
    """A ferry_ctx: one node (name, listeners, progress thread, regions). Closing it is deferred
    while arrays from ferry.empty() on it are alive, since closing unmaps their memory.

    name: the node's name (None: <hostname>-<pid>). tcp_listen: HOST:PORT of its tcp listener
    (None: FERRY_TCP_LISTEN). transports: the links it offers, in order, e.g. "shm,tcp" (None:
    FERRY_TRANSPORTS). token: the fleet token every link must prove it knows (None:
    FERRY_TOKEN, else this user's secret)."""

    def __init__(self, name: Optional[str] = None, tcp_listen: Optional[str] = None,
                 transports: Optional[str] = None, token: Optional[str] = None) -> None:
        opts = _lib.CtxOpts(ctypes.sizeof(_lib.CtxOpts), _enc(name), _enc(tcp_listen),
                            _enc(transports), _enc(token))
        h = ctypes.c_void_p()
        check(lib.ferry_ctx_open(ctypes.byref(opts), ctypes.byref(h)))
        self._h = h.value
        # Re-entrant: arrays' finalizers release through it (_free, _unhold), and the collector
        # may run one at an allocation this thread makes while holding it.
        self._lock = threading.RLock()
        self._allocs = 0
        self._closing = False
        self._jobs: Set[str] = set()  # the kinds of handle opened on it (_claim): one of each
        self._ranges: Dict[int, int] = {}  # ferry_alloc blocks alive: address -> bytes

    @property
    def handle(self) -> int:
        """The C handle (ValueError once closed)."""
        if not self._h or self._closing:
            raise ValueError("ferry: context is closed")
        return self._h

    @property
    def name(self) -> str:
        """The node's name (ferry_ctx_opts.name or <hostname>-<pid>)."""
        return lib.ferry_ctx_name(self.handle).decode()

    @property
    def address(self) -> str:
        """The URLs peers reach this node at, comma-separated."""
        return lib.ferry_ctx_address(self.handle).decode()

    @property
    def tcp_address(self) -> Optional[str]:
        """"HOST:PORT" of the tcp listener (where a hosted directory is reached)."""
        for url in self.address.split(","):
            if url.startswith("tcp://"):
                return url[len("tcp://"):]
        return None

    def _claim(self, kind: str) -> bool:
        """Marks this context as holding a handle of `kind` ("store", "mq", "refit-rx"): False
        when it holds one already (the C library allows one of each per context)."""
        with self._lock:
            if kind in self._jobs:
                return False
            self._jobs.add(kind)
            return True

    def _release(self, kind: str) -> None:
        with self._lock:
            self._jobs.discard(kind)

    def _alloc(self, nbytes: int) -> int:
        p = ctypes.c_void_p()
        with self._lock:
            nbytes = _lib.c_int_of(max(int(nbytes), 1), _lib.c_size_t, "ferry memory bytes")
            check(lib.ferry_alloc_uninit(self.handle, nbytes, ctypes.byref(p)))
            self._allocs += 1
            self._ranges[p.value] = max(int(nbytes), 1)
        return p.value

    def _hold(self) -> None:
        """Defers closing while something (a store view) still uses this context's mappings."""
        with self._lock:
            self._allocs += 1

    def _unhold(self) -> None:
        with self._lock:
            self._allocs -= 1
            last = self._allocs == 0 and self._closing
        if last:
            self._really_close()

    def _owns(self, ptr: int) -> bool:
        """Whether ptr lies in a live ferry_alloc block of this context (a put publishes it in
        place)."""
        with self._lock:
            return any(a <= ptr < a + n for a, n in self._ranges.items())

    def _free(self, ptr: int) -> None:
        with self._lock:
            if self._h:
                lib.ferry_free(self._h, ptr)
            self._ranges.pop(ptr, None)
            self._allocs -= 1
            last = self._allocs == 0 and self._closing
        if last:
            self._really_close()

    def close(self) -> None:
        """Closes the context (deferred while arrays from ferry.empty() on it are alive)."""
        with self._lock:
            if not self._h or self._closing:
                return
            self._closing = True
            busy = self._allocs > 0
        if not busy:
            self._really_close()

    def _really_close(self) -> None:
        h, self._h = self._h, None
        if h:
            lib.ferry_ctx_close(h)


_default = None
_extra = 0
_default_lock = threading.Lock()


def default_context() -> Context:
    """The process's default context (FERRY_* settings), opened on first use: the one node of
    this process. Every handle opened without ctx= runs on it (_ctx_for), so that a process with a
    store, an mq and a refit receiver is one node, and arrays from ferry.empty() are put in
    place."""
    global _default
    with _default_lock:
        if _default is None or _default._h is None:
            _default = Context()
        return _default


def _ctx_for(kind: str, name: Optional[str] = None, tcp_listen: Optional[str] = None,
             transports: Optional[str] = None) -> Tuple[Context, bool]:
    """The context for a handle of `kind` ("store", "mq", "refit-rx") opened without ctx=, claimed
    for it (Context._claim; the handle releases it as it closes), and whether the handle owns
    it (closes it with itself). The one policy of every handle: one node per process, the
    default context, which the first handle opens with its name, tcp_listen and transports.
    Only where the default cannot be this handle's does it get a context of its own: the
    default holds a handle of this kind already (the C library allows one store, one mq, one
    refit receiver per context: FERRY_EBUSY), or the caller asks for a node the default is not
    (another name, a tcp listener, transports). RefitSender keeps a context of its own
    (ferry/refit/sender.py says why)."""
    global _default, _extra
    with _default_lock:
        if _default is None or _default._h is None:
            _default = Context(name=name, tcp_listen=tcp_listen, transports=transports)
            _default._claim(kind)
            return _default, False
        d = _default
    if tcp_listen is None and transports is None and (name is None or name == d.name) and \
            d._claim(kind):
        return d, False
    if name is None:
        # Node names must be unique in the fleet, and every unnamed ctx of this process would
        # be "<hostname>-<pid>": number the extra ones.
        with _default_lock:
            _extra += 1
            name = "%s-%d" % (d.name, _extra)
    ctx = Context(name=name, tcp_listen=tcp_listen, transports=transports)
    ctx._claim(kind)
    return ctx, True


class _Alloc:
    """Owns one ferry_alloc block; frees it when the last array over it goes away."""

    def __init__(self, ctx: Context, nbytes: int) -> None:
        self.ctx = ctx
        self.ptr = ctx._alloc(nbytes)
        self.nbytes = nbytes
        weakref.finalize(self, ctx._free, self.ptr)

    def buffer(self) -> Any:
        """A ctypes array over the block that keeps this owner alive (the numpy base)."""
        buf = (ctypes.c_uint8 * max(self.nbytes, 1)).from_address(self.ptr)
        buf._ferry_owner = self
        return buf


def empty(shape: Union[int, Sequence[int]], dtype: Any, like: "Like" = "numpy",
          ctx: Optional[Context] = None) -> Any:
    """An uninitialised array or tensor in ferry shared memory (new memory is zeroed; memory this
    context freed before and reuses, with its pages still mapped, keeps what it held, as
    numpy's empty does): a store put of it publishes it in place. shape: an int or a sequence of ints; dtype: a numpy or torch
    dtype or a ferry name ("bfloat16"); like: "numpy" (default), "torch" or the torch module.
    Memory of `ctx` (default: the default context)."""
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(n) for n in shape)
    code = dtype_code(dtype)
    make_desc(code, shape)  # validates ndim
    npdt = np.dtype(DTYPES[code][1])
    nbytes = math.prod(shape) * npdt.itemsize  # Python ints: no wrap (make_desc refused < 0)
    owner = _Alloc(ctx or default_context(), nbytes)
    arr = np.frombuffer(owner.buffer(), dtype=np.uint8, count=nbytes).view(npdt).reshape(shape)
    return from_bits(arr, code, like)
