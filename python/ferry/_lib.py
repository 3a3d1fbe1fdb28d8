"""ctypes declarations of libferry's C API (include/ferry.h), and how the library is found.

The structs mirror the C ones field for field, `size` first, each naming its C type in
_c_name_ (python/tests/test_struct_layout.py compiles a C program against ferry.h and checks
every struct's sizeof and every field's offset and size against it). Every prototype
(libferry's, and the few of the CUDA driver's that ferry.cuda calls) is declared once here, with
the structs and callback types it takes, so a wrong argument fails in Python instead of
corrupting memory; no other module sets restype or argtypes. ctypes.CDLL releases the GIL around
every call, so a blocking get or put lets other Python threads run.
"""
import ctypes
import ctypes.util
import os
from typing import Any, Dict, List, Optional, Tuple, Union

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
    _c_name_ = "ferry_tensor_desc"
    _fields_ = [("dtype", c_int), ("ndim", c_uint32), ("shape", c_uint64 * MAX_DIMS)]


class CtxOpts(ctypes.Structure):
    _c_name_ = "ferry_ctx_opts"
    _fields_ = [("size", c_size_t), ("name", c_char_p), ("tcp_listen", c_char_p),
                ("transports", c_char_p), ("token", c_char_p)]


class StoreOpts(ctypes.Structure):
    _c_name_ = "ferry_store_opts"
    _fields_ = [("size", c_size_t), ("directory", c_char_p), ("capacity", c_uint64),
                ("lease_ms", c_int), ("flags", c_uint32), ("device_pool_bytes", c_uint64)]


class StoreInfo(ctypes.Structure):
    _c_name_ = "ferry_store_info"
    _fields_ = [("size", c_size_t), ("key", ctypes.c_char * (STORE_KEY_MAX + 1)),
                ("owner", ctypes.c_char * (STORE_NAME_MAX + 1)), ("desc", TensorDesc),
                ("bytes", c_uint64), ("generation", c_uint64)]


class StoreItem(ctypes.Structure):
    _c_name_ = "ferry_store_item"
    _fields_ = [("key", c_char_p), ("dst", c_void_p), ("cap", c_size_t), ("status", c_int),
                ("bytes", c_uint64)]


class CudaInfo(ctypes.Structure):
    _c_name_ = "ferry_cuda_info"
    _fields_ = [("size", c_size_t), ("found", c_int), ("driver_version", c_int),
                ("devices", c_int), ("library", ctypes.c_char * 256),
                ("detail", ctypes.c_char * 256)]


LOG_FN = ctypes.CFUNCTYPE(None, c_int, c_char_p, c_void_p)


# -- refit (ferry.refit) -------------------------------------------------------------------------
class RefitOpts(ctypes.Structure):
    _c_name_ = "ferry_refit_opts"
    _fields_ = [("size", c_size_t), ("bucket_bytes", c_uint64), ("alias", c_int),
                ("publish", c_int), ("directory", c_char_p), ("no_retain", c_int),
                ("device_buckets", c_int), ("rank", c_int), ("world", c_int)]


class PushOpts(ctypes.Structure):
    _c_name_ = "ferry_refit_push_opts"
    _fields_ = [("size", c_size_t), ("only", POINTER(c_char_p)), ("n_only", c_size_t),
                ("skip_unchanged", c_int), ("timeout_ms", c_int), ("route", c_int),
                ("part", c_int)]


class RefitPiece(ctypes.Structure):
    _c_name_ = "ferry_refit_piece"
    _fields_ = [("source", c_char_p), ("dim", c_int), ("start", ctypes.c_int64),
                ("stop", ctypes.c_int64)]


# ferry_refit_bucket_fn and ferry_refit_commit_fn; module-wide, so never freed while C holds them
REFIT_BUCKET_FN = ctypes.CFUNCTYPE(None, c_void_p, c_uint64, c_uint32, c_void_p)
REFIT_COMMIT_FN = ctypes.CFUNCTYPE(None, c_void_p, c_uint64, c_int, c_char_p, c_void_p)


# -- mq (ferry.mq) -------------------------------------------------------------------------------
class MQOpts(ctypes.Structure):
    _c_name_ = "ferry_mq_opts"
    _fields_ = [("size", c_size_t), ("directory", c_char_p), ("queue_bytes", c_uint64),
                ("lease_ms", c_int), ("flags", c_uint32)]


class MQMsg(ctypes.Structure):
    _c_name_ = "ferry_mq_msg"
    _fields_ = [("topic", c_char_p), ("publisher", c_char_p), ("data", c_void_p),
                ("len", c_size_t), ("seq", c_uint64), ("is_tensor", c_int),
                ("desc", TensorDesc)]


MQ_MSG_FN = ctypes.CFUNCTYPE(None, c_void_p, POINTER(MQMsg), c_void_p)  # ferry_mq_msg_fn


# -- control (ferry.control) ---------------------------------------------------------------------
CTL_MESSAGE_MAX = 32  # FERRY_CTL_MESSAGE_MAX


class CtlCellOpts(ctypes.Structure):
    _c_name_ = "ferry_ctl_cell_opts"
    _fields_ = [("size", c_size_t), ("fail_if_stale", c_int)]


class CtlRankOpts(ctypes.Structure):
    _c_name_ = "ferry_ctl_rank_opts"
    _fields_ = [("size", c_size_t), ("initial_state", c_int)]


class CtlCommand(ctypes.Structure):
    _c_name_ = "ferry_ctl_command"
    _fields_ = [("seq", c_uint64), ("cmd", c_int)]


class CtlStatus(ctypes.Structure):
    _c_name_ = "ferry_ctl_status"
    _fields_ = [("size", c_size_t), ("incarnation", c_uint64), ("nranks", c_uint32),
                ("engine_pid", ctypes.c_int32), ("engine_alive", c_int), ("seq", c_uint64),
                ("cmd", c_int), ("in_flight", c_int), ("state", c_int), ("agreed", c_int)]


class CtlRankStatus(ctypes.Structure):
    _c_name_ = "ferry_ctl_rank_status"
    _fields_ = [("size", c_size_t), ("rank", c_uint32), ("pid", ctypes.c_int32),
                ("alive", c_int), ("seq", c_uint64), ("state", c_int), ("fail_seq", c_uint64),
                ("error", c_int), ("message", ctypes.c_char * CTL_MESSAGE_MAX)]


# -- metrics (ferry.stats) -----------------------------------------------------------------------
class Stat(ctypes.Structure):
    _c_name_ = "ferry_stat"
    _fields_ = [("name", c_char_p), ("help", c_char_p), ("kind", c_int), ("nlabels", c_size_t),
                ("label_names", POINTER(c_char_p)), ("label_values", POINTER(c_char_p)),
                ("value", ctypes.c_double), ("count", c_uint64), ("nbuckets", c_size_t),
                ("bucket_le", POINTER(ctypes.c_double)), ("bucket_counts", POINTER(c_uint64))]


STAT_FN = ctypes.CFUNCTYPE(c_int, POINTER(Stat), c_void_p)  # ferry_stats_fn


# Every prototype of libferry the binding calls, by name: (restype, argtypes). Bound as the
# package is imported (ferry/__init__.py imports every module that calls them), so a symbol
# missing from the library fails the import, naming it.
_protos = {
    "ferry_version": (c_char_p, []),
    "ferry_strerror": (c_char_p, [c_int]),
    "ferry_status_name": (c_char_p, [c_int]),
    "ferry_last_error": (c_char_p, []),
    "ferry_config_get": (c_char_p, [c_char_p]),
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
    # store
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
    "ferry_store_exists": (c_int, [c_void_p, c_char_p, c_int]),
    "ferry_store_stat": (c_int, [c_void_p, c_char_p, POINTER(StoreInfo), c_int]),
    # CUDA, through libferry (which loads the driver itself, when there is one)
    "ferry_cuda_info_get": (c_int, [POINTER(CudaInfo)]),
    "ferry_cuda_device": (c_int, [c_int, c_char_p, c_size_t, POINTER(c_uint64)]),
    "ferry_mem_where": (c_int, [c_void_p, POINTER(c_int)]),
    "ferry_mem_copy": (c_int, [c_void_p, c_void_p, c_size_t]),
    "ferry_cuda_alloc": (c_int, [c_int, c_size_t, POINTER(c_void_p)]),
    "ferry_cuda_free": (c_int, [c_void_p]),
    # refit
    "ferry_refit_sender_open": (c_int, [c_void_p, c_char_p, POINTER(RefitOpts),
                                        POINTER(c_void_p)]),
    "ferry_refit_sender_close": (None, [c_void_p]),
    "ferry_refit_declare": (c_int, [c_void_p, c_char_p, POINTER(TensorDesc), c_void_p, c_int]),
    "ferry_refit_declare_piece": (c_int, [c_void_p, c_char_p, POINTER(TensorDesc), c_void_p,
                                          c_int, POINTER(RefitPiece)]),
    "ferry_refit_seal": (c_int, [c_void_p]),
    "ferry_refit_push": (c_int, [c_void_p, c_uint64, POINTER(PushOpts)]),
    "ferry_refit_set_data": (c_int, [c_void_p, c_char_p, c_void_p]),
    "ferry_refit_part_sent": (c_int, [c_void_p, c_char_p]),
    "ferry_refit_receivers": (c_size_t, [c_void_p]),
    "ferry_refit_receiver_open": (c_int, [c_void_p, c_char_p, c_int, POINTER(c_void_p)]),
    "ferry_refit_receiver_close": (None, [c_void_p]),
    "ferry_refit_tensor_count": (c_size_t, [c_void_p]),
    "ferry_refit_tensor_info": (c_int, [c_void_p, c_size_t, POINTER(c_char_p),
                                        POINTER(TensorDesc)]),
    "ferry_refit_tensor_scale": (c_int, [c_void_p, c_size_t, POINTER(ctypes.c_float)]),
    "ferry_refit_bind": (c_int, [c_void_p, c_char_p, c_void_p, POINTER(TensorDesc)]),
    "ferry_refit_bind_flat": (c_int, [c_void_p]),
    "ferry_refit_bind_pieces": (c_int, [c_void_p, c_char_p, c_void_p, POINTER(TensorDesc),
                                        POINTER(RefitPiece), c_size_t]),
    "ferry_refit_view": (c_int, [c_void_p, c_char_p, POINTER(c_void_p)]),
    "ferry_refit_wait": (c_int, [c_void_p, c_uint64, c_int, POINTER(c_uint64)]),
    "ferry_refit_committed": (c_uint64, [c_void_p]),
    "ferry_refit_bind_alias": (c_int, [c_void_p]),
    "ferry_refit_on_bucket": (None, [c_void_p, REFIT_BUCKET_FN, c_void_p]),
    "ferry_refit_on_commit": (None, [c_void_p, REFIT_COMMIT_FN, c_void_p]),
    "ferry_refit_tensor_buckets": (c_int, [c_void_p, c_size_t, POINTER(c_uint32),
                                           POINTER(c_uint32)]),
    "ferry_refit_bytes_read": (c_uint64, [c_void_p]),
    "ferry_refit_ranks": (c_size_t, [c_void_p]),
    # mq
    "ferry_mq_open": (c_int, [c_void_p, POINTER(MQOpts), POINTER(c_void_p)]),
    "ferry_mq_close": (None, [c_void_p]),
    "ferry_mq_subscribe": (c_int, [c_void_p, c_char_p, c_int]),
    "ferry_mq_unsubscribe": (c_int, [c_void_p, c_char_p, c_int]),
    "ferry_mq_publish": (c_int, [c_void_p, c_char_p, c_void_p, c_size_t, c_int]),
    "ferry_mq_publish_tensor": (c_int, [c_void_p, c_char_p, POINTER(TensorDesc), c_void_p,
                                        c_int]),
    "ferry_mq_loan": (c_int, [c_void_p, c_size_t, POINTER(c_void_p), c_int]),
    "ferry_mq_publish_loan": (c_int, [c_void_p, c_char_p, POINTER(TensorDesc), c_void_p,
                                      c_size_t, c_int]),
    "ferry_mq_loan_free": (None, [c_void_p, c_void_p]),
    "ferry_mq_wait_subscribers": (c_int, [c_void_p, c_char_p, c_size_t, c_int]),
    "ferry_mq_subscribers": (c_size_t, [c_void_p, c_char_p]),
    "ferry_mq_recv": (c_int, [c_void_p, POINTER(POINTER(MQMsg)), c_int]),
    "ferry_mq_msg_free": (None, [POINTER(MQMsg)]),
    "ferry_mq_set_callback": (c_int, [c_void_p, MQ_MSG_FN, c_void_p]),
    # control
    "ferry_ctl_cell_create": (c_int, [c_char_p, c_uint32, POINTER(CtlCellOpts),
                                      POINTER(c_void_p)]),
    "ferry_ctl_cell_close": (None, [c_void_p]),
    "ferry_ctl_cell_incarnation": (c_uint64, [c_void_p]),
    "ferry_ctl_rank_open": (c_int, [c_char_p, c_uint32, POINTER(CtlRankOpts), POINTER(c_void_p)]),
    "ferry_ctl_rank_close": (None, [c_void_p]),
    "ferry_ctl_wait_command": (c_int, [c_void_p, c_int, POINTER(CtlCommand)]),
    "ferry_ctl_ack": (c_int, [c_void_p, c_uint64, c_int, c_int, c_char_p]),
    "ferry_ctl_open": (c_int, [c_char_p, POINTER(c_void_p)]),
    "ferry_ctl_close": (None, [c_void_p]),
    "ferry_ctl_request": (c_int, [c_void_p, c_int, c_int]),
    "ferry_ctl_status_get": (c_int, [c_void_p, POINTER(CtlStatus)]),
    "ferry_ctl_rank_status_get": (c_int, [c_void_p, c_uint32, POINTER(CtlRankStatus)]),
    # metrics
    "ferry_stats_each": (c_int, [c_void_p, STAT_FN, c_void_p]),
    "ferry_stats_prometheus": (c_int, [c_void_p, POINTER(c_void_p), POINTER(c_size_t)]),
    "ferry_stats_text_free": (None, [c_void_p]),
    "ferry_stats_ready": (c_int, [c_void_p, c_char_p, c_size_t]),
}

# Declared when the library has them, skipped when it does not: the store's pinned views, which
# only Store.get_view (and bench's view mode) call, so an older library without them still
# imports and fails (AttributeError naming the symbol) only where a view is asked for.
_optional_protos = {
    "ferry_store_get_view": (c_int, [c_void_p, c_char_p, POINTER(c_void_p), POINTER(StoreInfo),
                                     POINTER(c_void_p), c_int]),
    "ferry_store_view_valid": (c_int, [c_void_p]),
    "ferry_store_view_release": (None, [c_void_p]),
}

# The CUDA driver's calls ferry.cuda makes itself (to wait on a caller's stream), declared on
# the driver library only when that first happens (cuda._Driver: declare(CDLL(path), ...)).
CUDA_DRIVER_PROTOS = {
    "cuCtxGetCurrent": (c_int, [POINTER(c_void_p)]),
    "cuCtxSetCurrent": (c_int, [c_void_p]),
    "cuDeviceGet": (c_int, [POINTER(c_int), c_int]),
    "cuDevicePrimaryCtxRetain": (c_int, [POINTER(c_void_p), c_int]),
    "cuDevicePrimaryCtxRelease_v2": (c_int, [c_int]),
    "cuStreamSynchronize": (c_int, [c_void_p]),
}


def declare(dll: Any, protos: Dict[str, Tuple[Any, List[Any]]],
            optional: bool = False) -> Dict[str, Any]:
    """Sets restype and argtypes of each of protos' functions on dll; returns them by name.
    optional: a name dll lacks is skipped (otherwise AttributeError names it)."""
    out = {}
    for name, (res, args) in protos.items():
        if optional and not hasattr(dll, name):
            continue
        f = getattr(dll, name)
        f.restype, f.argtypes = res, args
        out[name] = f
    return out


declare(lib, _protos)
declare(lib, _optional_protos, optional=True)

# The same put without argument conversion, for Store.put's common call (an in-place re-put
# right after its caller filled megabytes, where converting six arguments cost ~10 us of cold
# caches): every argument must already be what C takes: c_void_p handle and data pointer,
# byref(TensorDesc), bytes key, int flags and timeout. Anything else is undefined behaviour.
store_put_unchecked = lib["ferry_store_put"]
store_put_unchecked.restype = c_int

# get_alloc's buffer is malloc'd by libferry: free it with the same process-wide allocator.
libc = ctypes.CDLL(None)
libc.free.restype, libc.free.argtypes = None, [c_void_p]
