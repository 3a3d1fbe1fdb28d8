"""ctypes declarations of libferry's C API (include/ferry.h), and how the library is found.

The structs mirror the C ones field for field, `size` first; the prototypes are declared once
here so a wrong argument fails in Python instead of corrupting memory. ctypes.CDLL releases the
GIL around every call, so a blocking get or put lets other Python threads run.
"""
import ctypes
import ctypes.util
import os
from typing import Any, List, Optional, Tuple, Union

__all__ = ["lib", "path", "MAX_DIMS", "STORE_KEY_MAX", "STORE_NAME_MAX"]

MAX_DIMS = 8
STORE_KEY_MAX = 255
STORE_NAME_MAX = 63

STORE_HOST_DIRECTORY = 1
STORE_HOLDER = 2
STORE_DELEGATE = 4
STORE_PUT_COPY = 1

_HERE = os.path.dirname(os.path.abspath(__file__))


def _candidates() -> List[str]:
    env = os.environ.get("FERRY_LIB")
    if env:
        # An explicit choice is the only one: silently falling back would hide a wrong path.
        return [env]
    out = [os.path.join(_HERE, "libferry.so")]  # beside the package (copied in)
    try:  # installed by make install, which wrote where the library went
        from ._installed import LIBDIR
        libdir = os.path.normpath(os.path.join(_HERE, LIBDIR))
        out += [os.path.join(libdir, "libferry.so.0"), os.path.join(libdir, "libferry.so")]
    except ImportError:
        pass
    repo = os.path.dirname(os.path.dirname(_HERE))
    out.append(os.path.join(repo, "build", "libferry.so"))  # the build tree of a checkout
    found = ctypes.util.find_library("ferry")  # the loader's search path (ldconfig)
    if found:
        out.append(found)
    out.append("libferry.so.0")
    return out


def _load() -> Tuple[ctypes.CDLL, str]:
    errors = []
    for cand in _candidates():
        if os.sep in cand and not os.path.exists(cand):
            errors.append("%s: no such file" % cand)
            continue
        try:
            return ctypes.CDLL(cand), cand
        except OSError as e:
            errors.append("%s: %s" % (cand, e))
    raise ImportError("ferry: cannot load libferry.so (set FERRY_LIB to its path); tried: " +
                      "; ".join(errors))


lib, path = _load()

c_int, c_uint32, c_uint64, c_size_t = ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_size_t
c_char_p, c_void_p, POINTER, byref = ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER, ctypes.byref


def c_int_of(value: Any, ctype: Any, what: str, lo: Optional[int] = None,
             hi: Optional[int] = None) -> int:
    """value as an int that the ctypes integer type `ctype` holds, within [lo, hi] when given:
    ctypes silently wraps one that does not fit (1 << 32 into a c_int is 0, -1 into a c_uint64
    is 2^64 - 1), so every integer a caller gives goes through this on its way to C.
    ferry.InvalidArgument naming `what` and the range otherwise."""
    bits = 8 * ctypes.sizeof(ctype)
    signed = ctype(-1).value == -1
    low = -(1 << (bits - 1)) if signed else 0
    high = (1 << (bits - 1)) - 1 if signed else (1 << bits) - 1
    low, high = max(low, lo) if lo is not None else low, min(high, hi) if hi is not None else high
    try:
        v = int(value)
        ok = low <= v <= high and (not isinstance(value, float) or v == value) and \
            not isinstance(value, (str, bytes, bytearray))
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        from .errors import InvalidArgument
        raise InvalidArgument(-1, "%s: %r is not an integer in %d..%d" % (what, value, low, high))
    return v


INT_MAX = (1 << 31) - 1


def timeout_ms(timeout: Optional[float]) -> int:
    """Seconds (None: FERRY_TIMEOUT_MS) to the C library's milliseconds (-1: its default);
    ferry.InvalidArgument for one C's int milliseconds cannot hold (over 24.8 days, inf, nan)."""
    if timeout is None:
        return -1
    try:
        ms = max(0, int(timeout * 1000))
    except (TypeError, ValueError, OverflowError):
        ms = -1
    if not 0 <= ms <= INT_MAX:
        from .errors import InvalidArgument
        raise InvalidArgument(-1, "timeout %r s: want 0 to %d s (None: FERRY_TIMEOUT_MS)"
                              % (timeout, INT_MAX // 1000))
    return ms


def encoded(value: Optional[Union[str, bytes]], what: str) -> Optional[bytes]:
    """A str or bytes argument (a key, a topic, a name, an address) as the bytes the C library
    takes, or None for None. The C library sees a string up to its first NUL, so a NUL inside
    would silently cut it ("abc\\x00evil" would be "abc"): refused here with the C library's own
    rule for keys (no control characters), as ferry.InvalidArgument. The C library checks the
    rest (length, the other control characters) the same way for every binding."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = value.encode()
        except UnicodeEncodeError as e:  # a lone surrogate (e.g. os.fsdecode of a bad name)
            from .errors import InvalidArgument
            raise InvalidArgument(-1, "%s: character %d (%s) is a lone surrogate, not text that "
                                      "UTF-8 can hold: pass a valid str, or bytes"
                                  % (what, e.start, ascii(value[e.start]))) from None
    elif not isinstance(value, bytes):
        raise TypeError("ferry: %s must be a str (or bytes), not %s: pass str(%s)"
                        % (what, type(value).__name__, "x" if len(repr(value)) > 40
                           else repr(value)))
    at = value.find(b"\0")
    if at >= 0:
        from .errors import InvalidArgument
        raise InvalidArgument(-1, "%s: has a control character (NUL) at byte %d" % (what, at))
    return value


class Closing:
    """For handles: `with` closes them, and so does garbage collection (errors swallowed there).
    A subclass defines close(), which must be safe to call twice."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class TensorDesc(ctypes.Structure):
    _fields_ = [("dtype", c_int), ("ndim", c_uint32), ("shape", c_uint64 * MAX_DIMS)]


class CtxOpts(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("name", c_char_p), ("tcp_listen", c_char_p),
                ("transports", c_char_p), ("token", c_char_p)]


class StoreOpts(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("directory", c_char_p), ("capacity", c_uint64),
                ("lease_ms", c_int), ("flags", c_uint32)]


class StoreInfo(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("key", ctypes.c_char * (STORE_KEY_MAX + 1)),
                ("owner", ctypes.c_char * (STORE_NAME_MAX + 1)), ("desc", TensorDesc),
                ("bytes", c_uint64), ("generation", c_uint64)]


class StoreItem(ctypes.Structure):
    _fields_ = [("key", c_char_p), ("dst", c_void_p), ("cap", c_size_t), ("status", c_int),
                ("bytes", c_uint64)]


class CudaInfo(ctypes.Structure):  # ferry_cuda_info
    _fields_ = [("size", c_size_t), ("found", c_int), ("driver_version", c_int),
                ("devices", c_int), ("library", ctypes.c_char * 256),
                ("detail", ctypes.c_char * 256)]


LOG_FN = ctypes.CFUNCTYPE(None, c_int, c_char_p, c_void_p)

_protos = {
    "ferry_version": (c_char_p, []),
    "ferry_strerror": (c_char_p, [c_int]),
    "ferry_status_name": (c_char_p, [c_int]),
    "ferry_last_error": (c_char_p, []),
    "ferry_log_set_callback": (None, [LOG_FN, c_void_p]),
    "ferry_log_set_level": (None, [c_int]),
    "ferry_log_get_level": (c_int, []),
    "ferry_dtype_size": (c_size_t, [c_int]),
    "ferry_dtype_name": (c_char_p, [c_int]),
    "ferry_tensor_nbytes": (c_int, [POINTER(TensorDesc), POINTER(c_uint64)]),
    "ferry_ctx_open": (c_int, [POINTER(CtxOpts), POINTER(c_void_p)]),
    "ferry_ctx_close": (None, [c_void_p]),
    "ferry_ctx_name": (c_char_p, [c_void_p]),
    "ferry_ctx_address": (c_char_p, [c_void_p]),
    "ferry_alloc": (c_int, [c_void_p, c_size_t, POINTER(c_void_p)]),
    "ferry_alloc_uninit": (c_int, [c_void_p, c_size_t, POINTER(c_void_p)]),
    "ferry_free": (c_int, [c_void_p, c_void_p]),
    "ferry_store_open": (c_int, [c_void_p, POINTER(StoreOpts), POINTER(c_void_p)]),
    "ferry_store_close": (None, [c_void_p]),
    "ferry_store_put": (c_int, [c_void_p, c_char_p, POINTER(TensorDesc), c_void_p, c_uint32, c_int]),
    "ferry_store_get": (c_int, [c_void_p, c_char_p, POINTER(TensorDesc), c_void_p, c_size_t,
                                POINTER(StoreInfo), c_int]),
    "ferry_store_get_alloc": (c_int, [c_void_p, c_char_p, POINTER(c_void_p), POINTER(StoreInfo),
                                      c_int]),
    "ferry_store_get_batch": (c_int, [c_void_p, POINTER(StoreItem), c_size_t, c_int]),
    "ferry_store_delete": (c_int, [c_void_p, c_char_p, c_int]),
    "ferry_store_delete_prefix": (c_int, [c_void_p, c_char_p, POINTER(c_size_t), c_int]),
    "ferry_store_clear": (c_int, [c_void_p, POINTER(c_size_t), c_int]),
    "ferry_store_list": (c_int, [c_void_p, c_char_p, POINTER(POINTER(StoreInfo)),
                                 POINTER(c_size_t), c_int]),
    "ferry_store_list_free": (None, [POINTER(StoreInfo)]),
    "ferry_store_released": (c_int, [c_void_p, POINTER(POINTER(StoreInfo)), POINTER(c_size_t)]),
    "ferry_cuda_info_get": (c_int, [POINTER(CudaInfo)]),
    "ferry_cuda_device": (c_int, [c_int, c_char_p, c_size_t, POINTER(c_uint64)]),
    "ferry_mem_where": (c_int, [c_void_p, POINTER(c_int)]),
    "ferry_mem_copy": (c_int, [c_void_p, c_void_p, c_size_t]),
    "ferry_cuda_alloc": (c_int, [c_int, c_size_t, POINTER(c_void_p)]),
    "ferry_cuda_free": (c_int, [c_void_p]),
    "ferry_store_exists": (c_int, [c_void_p, c_char_p, c_int]),
    "ferry_store_stat": (c_int, [c_void_p, c_char_p, POINTER(StoreInfo), c_int]),
}
for _name, (_res, _args) in _protos.items():
    _f = getattr(lib, _name)
    _f.restype, _f.argtypes = _res, _args

# The same put without argument conversion, for Store.put's common call (an in-place re-put
# right after its caller filled megabytes, where converting six arguments cost ~10 us of cold
# caches): every argument must already be what C takes: c_void_p handle and data pointer,
# byref(TensorDesc), bytes key, int flags and timeout. Anything else is undefined behaviour.
store_put_unchecked = lib["ferry_store_put"]
store_put_unchecked.restype = c_int

# get_alloc's buffer is malloc'd by libferry: free it with the same process-wide allocator.
libc = ctypes.CDLL(None)
libc.free.restype, libc.free.argtypes = None, [c_void_p]
