"""ferry from Python: ctypes over libferry.so, zero-copy with NumPy arrays and CPU torch tensors;
CUDA tensors (torch, __cuda_array_interface__) are taken in place too (ferry.cuda, docs/GPU.md).

    import ferry
    with ferry.Store(host_directory=True) as s:         # or Store("ferry://host:7700")
        s.put("r42", routing_ids)                       # numpy array or torch tensor
        ids = s.get("r42")                              # numpy array

libferry.so is found through FERRY_LIB (only there, when set), beside this package, where `make
install` put it, in the checkout's build/ folder, or on the loader's path. ferry's log lines go
to the `logging` logger "ferry"; the level of what ferry emits is FERRY_LOG (or
ferry.set_log_level()). Calls into the library release the GIL.
"""
import atexit
import logging

from typing import Union

from . import _lib, aio  # noqa: F401
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .store import Store, StoreView
from .refit import RefitReceiver, RefitSender
from .refit import Piece, tp_shards  # shards of a tensor-parallel rank
from .refit import expert_pieces, fsdp_pieces, tp_pieces  # a sharded sender's pieces
from .control import Control, ControlCell, ControlRank
from .mq import MQ
from . import p2pstore  # noqa: F401
from .tensors import Context, default_context, empty
from .stats import prometheus, readiness, stats
from . import cuda  # noqa: F401
from .cuda import DeviceArray, DeviceView, cuda_info

__version__ = _lib.lib.ferry_version().decode()
library_path: str = _lib.path  # the libferry.so this process loaded

__all__ = ["Store", "StoreView", "MQ", "p2pstore", "aio", "RefitSender", "RefitReceiver", "Control", "ControlRank",
           "ControlCell", "Context", "default_context", "empty", "set_log_level", "version",
           "library_path", "stats", "prometheus", "readiness"] + [n for n in _errors_all if n not in ("check", "raise_status")]
__all__ += ["Piece", "tp_shards", "tp_pieces", "fsdp_pieces", "expert_pieces", "cuda", "cuda_info",
            "DeviceArray", "DeviceView"]

logger = logging.getLogger("ferry")

# ferry level -> logging level
_LEVELS = {0: logging.ERROR, 1: logging.WARNING, 2: logging.INFO, 3: logging.DEBUG, 4: 5}


def _on_log(level, msg, arg):
    # Runs on whichever thread logged (ferry's progress threads too); ctypes takes the GIL for
    # us. An exception must not escape into C.
    try:
        logger.log(_LEVELS.get(level, logging.DEBUG), "%s", msg.decode(errors="replace"))
    except Exception:
        pass


# The CFUNCTYPE object must outlive every call C may make to it: keep it in the module.
_log_callback = _lib.LOG_FN(_on_log)
_lib.lib.ferry_log_set_callback(_log_callback, None)


@atexit.register
def _unhook():
    # Threads of contexts still open at exit must not call into a finalizing interpreter.
    _lib.lib.ferry_log_set_callback(_lib.LOG_FN(), None)


def set_log_level(level: Union[int, str]) -> None:
    """What ferry emits: a logging level (logging.DEBUG, ...) or a ferry name ("debug")."""
    names = {"error": 0, "warn": 1, "warning": 1, "info": 2, "debug": 3, "trace": 4}
    if isinstance(level, str):
        code = names[level.lower()]
    elif level >= logging.ERROR:
        code = 0
    elif level >= logging.WARNING:
        code = 1
    elif level >= logging.INFO:
        code = 2
    elif level >= logging.DEBUG:
        code = 3
    else:
        code = 4
    _lib.lib.ferry_log_set_level(code)


def version() -> str:
    """libferry's version ("0.1.0")."""
    return __version__
