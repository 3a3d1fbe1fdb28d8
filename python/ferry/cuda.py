"""CUDA memory from Python: the driver ferry loaded (cuda_info), device tensors as arguments, and
ferry.DeviceArray, device memory of ferry's own for machines without torch CUDA (docs/GPU.md).

A tensor argument may be a torch CUDA tensor or any object with __cuda_array_interface__ (CuPy,
Numba, a DeviceArray). It must be contiguous (a destination is written in place; a source could
be copied, but silently making a device copy of gigabytes is worse than saying so).

Streams. Before ferry reads or writes a CUDA tensor it synchronizes the stream the producer is
on: for a torch tensor, torch.cuda.current_stream(tensor.device); for an
__cuda_array_interface__ object, the interface's `stream` (none given: nothing to wait for, as
the interface says). ferry's own copies run on non-blocking streams of its own and are complete
when the call returns, so what a get, a refit push or a recv wrote is visible to every stream
afterwards, with no event to wait on. The cost is one stream synchronization per call (not per
tensor of a state dict: per device).
"""
import ctypes
import math
import threading
import types
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from . import _lib
from ._lib import byref, c_int, c_uint64, c_void_p, lib
from .errors import NotSupported, check

__all__ = ["cuda_info", "DeviceArray", "mem_copy", "mem_where", "device_ordinal"]

_state = {"loaded": None}  # None: not asked yet; else the driver's library path ("" if none)
_state_lock = threading.Lock()


def cuda_info() -> Dict[str, Any]:
    """The CUDA driver as this process sees it (loads it on first use): {"found": bool,
    "driver_version": int (12080 for 12.8), "devices": [{"index", "name", "total_bytes"}],
    "library": the library loaded or tried, "detail": why none was loaded ("" when found)}.
    FERRY_CUDA=off, or no libcuda.so.1 (FERRY_CUDA_LIB names another), gives found=False."""
    ci = _lib.CudaInfo()
    ci.size = ctypes.sizeof(ci)
    check(lib.ferry_cuda_info_get(byref(ci)))
    devices = []
    for i in range(ci.devices if ci.found else 0):
        name = ctypes.create_string_buffer(256)
        total = c_uint64()
        check(lib.ferry_cuda_device(i, name, len(name), byref(total)))
        devices.append({"index": i, "name": name.value.decode(errors="replace"),
                        "total_bytes": int(total.value)})
    with _state_lock:
        _state["loaded"] = ci.library.decode() if ci.found else ""
    return {"found": bool(ci.found), "driver_version": int(ci.driver_version),
            "devices": devices, "library": ci.library.decode(errors="replace"),
            "detail": ci.detail.decode(errors="replace")}


def _require_driver(what: str) -> None:
    """Loads the driver once; NotSupported("no CUDA driver: ...") naming `what` without one. The
    C jobs see device memory only once a driver is loaded, so a device pointer must never reach
    them before this."""
    if _state["loaded"]:
        return
    info = cuda_info()
    if not info["found"]:
        raise NotSupported(-20, "%s: no CUDA driver (%s)" % (what, info["detail"]))


def mem_where(ptr: int) -> Tuple[str, int]:
    """("cuda", device ordinal) for CUDA memory, else ("host", -1)."""
    dev = c_int(-1)
    kind = lib.ferry_mem_where(c_void_p(ptr), byref(dev))
    return ("cuda", dev.value) if kind == 1 else ("host", -1)


def mem_copy(dst: int, src: int, nbytes: int) -> None:
    """Copies nbytes between two addresses, each host or CUDA memory (ferry_mem_copy); complete
    on return. ferry.DeviceError with the driver's error."""
    if nbytes:
        check(lib.ferry_mem_copy(c_void_p(dst), c_void_p(src),
                                 _lib.c_int_of(nbytes, _lib.c_size_t, "bytes")))


def device_ordinal(device: Any) -> Optional[int]:
    """The CUDA ordinal a device= argument names, or None for host memory: None or "cpu" (host),
    "cuda" (torch's current device when torch CUDA is in use, else 0), "cuda:N", an int N, or a
    torch.device. ValueError for anything else."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise ValueError("ferry: device must be 'cpu', 'cuda' or 'cuda:N', not %r" % (device,))
    if isinstance(device, int):
        if device < 0:
            raise ValueError("ferry: device ordinal %d is negative" % device)
        return device
    kind = getattr(device, "type", None)
    if kind is not None and not isinstance(device, str):  # a torch.device
        if kind == "cpu":
            return None
        if kind != "cuda":
            raise ValueError("ferry: device %s: only 'cpu' and 'cuda' devices" % device)
        return device.index if device.index is not None else _current_torch_device()
    if isinstance(device, str):
        if device == "cpu":
            return None
        if device == "cuda":
            return _current_torch_device()
        if device.startswith("cuda:") and device[5:].isdigit():
            return int(device[5:])
    raise ValueError("ferry: device must be 'cpu', 'cuda' or 'cuda:N', not %r" % (device,))


def _current_torch_device() -> int:
    torch = _torch_cuda()
    return int(torch.cuda.current_device()) if torch is not None else 0


def _torch_cuda() -> Optional[types.ModuleType]:
    """torch when the process imported it and it has CUDA, else None (never imports torch)."""
    from .tensors import _torch
    t = _torch()
    if t is None:
        return None
    try:
        return t if t.cuda.is_available() else None
    except Exception:  # a torch built without CUDA may raise rather than answer False
        return None


class _Ptr:
    __slots__ = ("data",)

    def __init__(self, data: int) -> None:
        self.data = data


class DeviceBytes:
    """A contiguous CUDA tensor's bytes, as the Python layer's calls see a host array's: the
    device pointer as .ctypes.data, .nbytes and .size, so every call that hands an array's
    pointer to C (put, get's out=, refit declare and bind, publish) takes a device tensor
    unchanged. The C jobs recognise the pointer as device memory and move its bytes with the
    copy engines. Nothing here may read the bytes from the CPU (on a GPU that faults)."""

    __slots__ = ("ctypes", "nbytes", "size", "device", "obj", "sync", "stream")

    def __init__(self, obj: Any, ptr: int, nbytes: int, device: int,
                 sync: Callable[[], None], stream: Any = None) -> None:
        self.obj = obj  # keeps the tensor (and its memory) alive as long as the call needs it
        self.ctypes = _Ptr(ptr)
        self.nbytes = nbytes
        self.size = nbytes
        self.device = device
        self.sync = sync  # waits for the producer's stream; as_buffer called it once already
        self.stream = stream  # which stream sync waits on (None: none), so sync_all waits once


def _no_sync() -> None:
    pass


def _contiguous_error(what: str) -> ValueError:
    return ValueError("ferry: %s is not contiguous: ferry takes a CUDA tensor in place, as one "
                      "block of device memory; pass x.contiguous() (for a destination, one made "
                      "contiguous, then copy from it)" % what)


def torch_tensor(t: Any, torch: types.ModuleType) -> Tuple[Any, DeviceBytes]:
    """(desc, DeviceBytes) of a torch CUDA tensor, after synchronizing its device's current
    stream (the one torch ran the tensor's producers on, unless the caller chose another)."""
    from .tensors import dtype_code, make_desc
    _require_driver("a torch tensor on %s" % t.device)
    if not t.is_contiguous():
        raise _contiguous_error("the torch tensor on %s" % t.device)
    code = dtype_code(t.dtype)
    dev = t.device

    def sync() -> None:
        torch.cuda.current_stream(dev).synchronize()

    sync()
    nbytes = t.numel() * t.element_size()
    ordinal = dev.index if dev.index is not None else torch.cuda.current_device()
    return make_desc(code, tuple(t.shape)), DeviceBytes(t, int(t.data_ptr()), nbytes, ordinal,
                                                        sync, ("torch", ordinal))


def _cai_code(typestr: str) -> int:
    from .tensors import _NP_TO_FERRY, _SUPPORTED
    try:
        dt = np.dtype(typestr)
    except TypeError:
        dt = None
    if dt is None or dt.byteorder == ">" or dt not in _NP_TO_FERRY:
        raise TypeError("ferry: __cuda_array_interface__ typestr %r is not supported: %s"
                        % (typestr, _SUPPORTED))
    return _NP_TO_FERRY[dt]  # "<" is the native order here: ">" was refused above


def cai_object(obj: Any, writable: bool = False) -> Tuple[Any, DeviceBytes]:
    """(desc, DeviceBytes) of an object with __cuda_array_interface__ (v2 or v3), after
    synchronizing its `stream` when it names one. `writable`: a destination, which an interface
    marked read-only (data[1]) refuses."""
    from .tensors import _what, make_desc
    if isinstance(obj, DeviceArray):
        return obj._as_buffer()
    cai = obj.__cuda_array_interface__
    if writable and cai["data"][1]:
        raise ValueError("ferry: a destination is written in place, and this %s is read-only "
                         "(__cuda_array_interface__ data[1]): pass a writable one" % _what(obj))
    shape = tuple(int(n) for n in cai["shape"])
    code = _cai_code(cai["typestr"])
    itemsize = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    if strides is not None:
        want, acc = [], itemsize
        for n in reversed(shape):
            want.append(acc)
            acc *= n
        # strides of dimensions of length 1 (and of empty arrays) do not matter
        if any(int(s) != w for s, w, n in zip(strides, reversed(want), shape) if n > 1) and \
                all(n > 0 for n in shape):
            raise _contiguous_error("the %s (__cuda_array_interface__ strides %s)"
                                    % (_what(obj), tuple(strides)))
    ptr = int(cai["data"][0] or 0)
    nbytes = itemsize * int(np.prod(shape, dtype=np.uint64))
    _require_driver("a %s (__cuda_array_interface__)" % _what(obj))
    kind, device = mem_where(ptr) if nbytes else ("cuda", 0)
    if kind != "cuda":
        raise NotSupported(-20, "%s: __cuda_array_interface__ data 0x%x is not CUDA memory the "
                           "driver knows (%s)" % (_what(obj), ptr, kind))
    stream = cai.get("stream")
    if stream is not None and int(stream) == 0:
        raise ValueError("ferry: %s: __cuda_array_interface__ stream 0 is ambiguous (the "
                         "interface forbids it): use 1 (legacy default stream) or 2 (per-thread)"
                         % _what(obj))
    sync = _no_sync if stream is None else (lambda: _stream_sync(device, int(stream)))
    sync()
    key = None if stream is None else ("cai", device, int(stream))
    return make_desc(code, shape), DeviceBytes(obj, ptr, nbytes, device, sync, key)


# -- the driver, for the one thing ferry's C API does not do for Python: wait on a stream -------
class _Driver:
    def __init__(self, path: str) -> None:
        d = ctypes.CDLL(path)  # the library ferry loaded: dlopen hands back the same one
        f = _lib.declare(d, _lib.CUDA_DRIVER_PROTOS)
        self.get_current = f["cuCtxGetCurrent"]
        self.set_current = f["cuCtxSetCurrent"]
        self.device_get = f["cuDeviceGet"]
        self.retain = f["cuDevicePrimaryCtxRetain"]
        self.release = f["cuDevicePrimaryCtxRelease_v2"]
        self.sync = f["cuStreamSynchronize"]


_driver: Optional[_Driver] = None


def _stream_sync(device: int, stream: int) -> None:
    """cuStreamSynchronize(stream) in `device`'s primary context (the one CuPy, Numba and torch
    use), restoring the thread's current context. The interface's 1 and 2 are the legacy and
    per-thread default streams, which are the driver's handles of them too."""
    global _driver
    if _driver is None:
        _driver = _Driver(_state["loaded"])
    d = _driver
    old, ctx, dev = c_void_p(), c_void_p(), c_int()
    r = d.get_current(byref(old)) or d.device_get(byref(dev), device) or \
        d.retain(byref(ctx), dev.value)
    if r:
        raise NotSupported(-25, "cuda: cannot enter device %d's context to synchronize stream "
                           "0x%x (CUresult %d)" % (device, stream, r))
    try:
        r = d.set_current(ctx) or d.sync(c_void_p(stream))
    finally:
        d.set_current(old)
        d.release(dev.value)
    if r:
        from .errors import DeviceError
        raise DeviceError(-25, "cuStreamSynchronize(0x%x) on cuda:%d: CUresult %d"
                          % (stream, device, r))


def sync_all(bufs: Sequence[DeviceBytes]) -> None:
    """Synchronizes each distinct producer stream of bufs once (a refit push of a state dict on
    one GPU waits on one stream, not on each tensor's)."""
    seen = set()
    for b in bufs:
        if b.stream is None or b.stream in seen:
            continue
        seen.add(b.stream)
        b.sync()


# -- ferry.DeviceArray ---------------------------------------------------------------------------
class DeviceArray(_lib.Closing):
    """Contiguous device memory of ferry's own (ferry_cuda_alloc on one device), for machines
    without torch CUDA: what get(..., device="cuda:N") and recv(device=) return there. It exposes
    __cuda_array_interface__ (v3, no stream: its bytes are complete whenever ferry returns), so
    torch.as_tensor(a, device="cuda") or cupy.asarray(a) wrap it without a copy (keep the
    DeviceArray alive as long as they are used). bfloat16 and float8 show as their bits (uint16,
    uint8) there, as in numpy; `dtype_name` says which.

    to_host() copies it into a new numpy array; copy_from_host(arr) fills it from a host array
    of the same size. close() (or garbage collection) frees the memory."""

    def __init__(self, shape: Union[int, Sequence[int]], dtype: Any = np.uint8,
                 device: Any = 0) -> None:
        from .tensors import DTYPES, dtype_code, make_desc
        self._ptr = 0
        shape = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
        if any(n < 0 for n in shape):
            raise ValueError("ferry.DeviceArray: negative dimension in %s" % (shape,))
        self.code = dtype_code(dtype)
        self.desc = make_desc(self.code, shape)
        ordinal = device_ordinal(device)
        if ordinal is None:
            raise ValueError("ferry.DeviceArray: device must be a CUDA device ('cuda:N'), not "
                             "%r" % (device,))
        _require_driver("ferry.DeviceArray")
        self.shape = shape
        self.dtype = np.dtype(DTYPES[self.code][1])
        self.dtype_name = DTYPES[self.code][0]
        self.device = ordinal
        self.nbytes = math.prod(shape) * self.dtype.itemsize  # Python ints: no wrap
        p = c_void_p()
        check(lib.ferry_cuda_alloc(_lib.c_int_of(ordinal, c_int, "CUDA device", lo=0),
                                   _lib.c_int_of(max(self.nbytes, 1), _lib.c_size_t,
                                                 "ferry.DeviceArray bytes"), byref(p)))
        self._ptr = int(p.value)

    @property
    def ptr(self) -> int:
        """The device address (ValueError once closed)."""
        if not self._ptr:
            raise ValueError("ferry.DeviceArray is closed")
        return self._ptr

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False),
                "version": 3, "strides": None, "stream": None}

    def _as_buffer(self) -> Tuple[Any, DeviceBytes]:
        return self.desc, DeviceBytes(self, self.ptr, self.nbytes, self.device, _no_sync)

    def to_host(self) -> np.ndarray:
        """A new numpy array holding a copy of the bytes (complete on return)."""
        out = np.empty(self.shape, dtype=self.dtype)
        mem_copy(out.ctypes.data, self.ptr, self.nbytes)
        return out

    def copy_from_host(self, arr: Any) -> "DeviceArray":
        """Fills this array from a host array (numpy, a CPU tensor, bytes) of the same number of
        bytes; complete on return. Returns self."""
        from .tensors import as_buffer
        _, host = as_buffer(arr)
        if host.nbytes != self.nbytes:
            raise ValueError("ferry.DeviceArray.copy_from_host: %d bytes into %d"
                             % (host.nbytes, self.nbytes))
        if isinstance(host, DeviceBytes):
            raise ValueError("ferry.DeviceArray.copy_from_host: the source is device memory; "
                             "pass a host array")
        mem_copy(self.ptr, host.ctypes.data, self.nbytes)
        return self

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d ferry.DeviceArray")
        return self.shape[0]

    def __repr__(self) -> str:
        return "ferry.DeviceArray(shape=%s, dtype=%s, device='cuda:%d'%s)" % (
            self.shape, self.dtype_name, self.device, "" if self._ptr else ", closed")

    def close(self) -> None:
        """Frees the device memory (twice is fine); views others made of it must be gone."""
        p, self._ptr = self._ptr, 0
        if p:
            lib.ferry_cuda_free(c_void_p(p))


class DeviceView:
    """Device memory ferry does not own, at a fixed address: a refit receiver's alias view into
    the sender's CUDA buffer, mapped through CUDA IPC. It exposes __cuda_array_interface__
    (read-only) so torch.as_tensor(v, device="cuda") or cupy.asarray(v) wrap it without a copy;
    `owner` (the receiver) is kept alive as long as the view is. to_host() copies it out."""

    def __init__(self, ptr: int, shape: Sequence[int], code: int, device: int,
                 owner: Any) -> None:
        from .tensors import DTYPES
        self.ptr, self.shape, self.device, self._owner = ptr, tuple(shape), device, owner
        self.dtype = np.dtype(DTYPES[code][1])
        self.dtype_name = DTYPES[code][0]
        self.nbytes = int(np.prod(self.shape, dtype=np.uint64)) * self.dtype.itemsize

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, True),
                "version": 3, "strides": None, "stream": None}

    def to_host(self) -> np.ndarray:
        """A new numpy array holding a copy of the bytes (complete on return)."""
        out = np.empty(self.shape, dtype=self.dtype)
        mem_copy(out.ctypes.data, self.ptr, self.nbytes)
        return out

    def __repr__(self) -> str:
        return "ferry.DeviceView(shape=%s, dtype=%s, device='cuda:%d')" % (
            self.shape, self.dtype_name, self.device)


def device_view(ptr: int, shape: Sequence[int], code: int, device: int, owner: Any,
                like: Any) -> Any:
    """A view of device memory at ptr: a torch CUDA tensor over it when like is torch (or the
    default) and torch has CUDA, else a ferry.DeviceView."""
    from .tensors import like_name
    view = DeviceView(ptr, shape, code, device, owner)
    torch = _torch_cuda()
    if torch is not None and like_name(like) in ("torch", "numpy"):
        t = torch.as_tensor(view, device="cuda:%d" % device)
        t._ferry_owner = view  # the receiver (and its mapping) outlive the tensor
        return t
    return view


def new_on_device(shape: Sequence[int], code: int, device: int, like: Any) -> Any:
    """An uninitialised tensor of ferry dtype `code` on CUDA device `device`: a torch CUDA tensor
    when like is torch, or when like is the default and torch (imported) has CUDA; otherwise a
    ferry.DeviceArray."""
    from .tensors import _FERRY_TO_TORCH, DTYPES, like_name
    kind = like_name(like)
    if kind == "bytes":
        raise ValueError("ferry: like=bytes is host memory; with device=%r pass like='torch' "
                         "(or the default)" % ("cuda:%d" % device))
    torch = _torch_cuda()
    if kind == "torch" and torch is None:
        from .tensors import _torch
        _torch(need=True)
        raise NotSupported(-20, "like='torch' with device='cuda:%d' needs torch with CUDA "
                           "(torch.cuda.is_available() is False here); the default like= gives "
                           "a ferry.DeviceArray" % device)
    if torch is not None and kind in ("torch", "numpy"):
        if code not in _FERRY_TO_TORCH:
            raise NotSupported(-20, "this torch has no %s" % DTYPES[code][0])
        return torch.empty(tuple(shape), dtype=_FERRY_TO_TORCH[code], device="cuda:%d" % device)
    return DeviceArray(tuple(shape), DTYPES[code][0], device)


def host_to_new_device(arr: np.ndarray, code: int, device: int, like: Any) -> Any:
    """A new tensor on `device` (as new_on_device) holding a copy of host array arr."""
    from .tensors import as_buffer
    out = new_on_device(arr.shape, code, device, like)
    _, dst = as_buffer(out, writable=True)  # syncs torch's stream: its allocator may reuse a block
    if arr.nbytes:
        src = np.ascontiguousarray(arr)
        mem_copy(dst.ctypes.data, src.ctypes.data, arr.nbytes)
    return out
