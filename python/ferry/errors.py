"""ferry.Error and its subclasses, one per family of FERRY_E* codes, raised with the C library's
detail message (ferry_last_error(), read on the thread that made the failing call)."""
from typing import NoReturn

from . import _lib

__all__ = ["Error", "InvalidArgument", "OutOfMemory", "Timeout", "NotFound", "AlreadyExists",
           "AccessDenied", "OutOfBounds", "PeerGone", "ConnectError", "DtypeError", "ShapeError",
           "Closed", "Busy", "CapacityExceeded", "NotSupported", "StateError", "ChecksumError",
           "Stale", "Freed", "DeviceError", "check", "raise_status"]


class Error(Exception):
    """A failed ferry call. `status` is the negative FERRY_E* code, `name` its symbol
    ("FERRY_ENOTFOUND"), `detail` ferry_last_error()'s message."""

    def __init__(self, status: int, detail: str = "") -> None:
        self.status = status
        self.name = _lib.lib.ferry_status_name(status).decode()
        self.detail = detail
        text = _lib.lib.ferry_strerror(status).decode()
        super().__init__("%s: %s" % (text, detail) if detail else text)


class InvalidArgument(Error, ValueError):
    """FERRY_EINVAL: a bad argument (the detail names it and what to pass instead)."""


class OutOfMemory(Error, MemoryError):
    """FERRY_ENOMEM, FERRY_ENOSHM: out of memory, or out of shared memory (/dev/shm full)."""


class Timeout(Error, TimeoutError):
    """FERRY_ETIMEDOUT: the call's timeout passed (the detail says waiting for what)."""


class NotFound(Error, KeyError):
    """FERRY_ENOTFOUND: no such key, cell, tensor or region."""

    __str__ = Exception.__str__  # KeyError would quote the message


class AlreadyExists(Error):
    """FERRY_EEXIST: the name is taken (a live node, engine or sender holds it)."""


class AccessDenied(Error, PermissionError):
    """FERRY_EACCES, FERRY_EAUTH: a wrong access key or token, or a refused password."""


class OutOfBounds(Error, IndexError):
    """FERRY_ERANGE: bytes outside a region, or an object larger than the buffer given."""


class PeerGone(Error, ConnectionError):
    """FERRY_EPEER: the other node died or left (the detail names it)."""


class ConnectError(Error, ConnectionError):
    """FERRY_ECONNECT: nothing answers at the address (a directory, Redis, a peer)."""


class DtypeError(Error, TypeError):
    """FERRY_EDTYPE: an unsupported or mismatched dtype."""


class ShapeError(Error, ValueError):
    """FERRY_ESHAPE, FERRY_EOVERFLOW: a mismatched shape, or a size that overflows."""


class Closed(Error):
    """FERRY_ECLOSED: the handle, link or command was closed (or superseded by an abort)."""


class Busy(Error):
    """FERRY_EBUSY: another command or callback holds what the call needs."""


class CapacityExceeded(Error):
    """FERRY_ECAPACITY: the node's pool or object slots are full (FERRY_STORE_CAPACITY,
    FERRY_STORE_MAX_OBJECTS)."""


class NotSupported(Error, NotImplementedError):
    """FERRY_ENOTSUP: not supported here (device memory, a dtype this framework lacks, ...)."""


class StateError(Error):
    """FERRY_ESTATE: a transition the control protocol does not allow from the current state."""


class ChecksumError(Error):
    """FERRY_ECHECKSUM: bytes that failed verification (a refit bucket, a failed update)."""


class Stale(Error):
    """FERRY_ESTALE: replaced during every read until the timeout, or a replaced engine cell."""


class Freed(Error):
    """FERRY_EFREED: the owner (named in the detail) freed memory it still publishes in place;
    raised at once, since no retry can bring those bytes back."""


class DeviceError(Error):
    """FERRY_EDEVICE: the CUDA driver refused a call; its error is in the detail."""


_BY_CODE = {
    -1: InvalidArgument, -2: OutOfMemory, -3: OutOfMemory, -4: Timeout, -5: NotFound,
    -6: AlreadyExists, -7: AccessDenied, -8: OutOfBounds, -9: PeerGone, -10: Error,
    -11: ConnectError, -12: AccessDenied, -13: DtypeError, -14: ShapeError, -15: ShapeError,
    -16: Closed, -17: Busy, -18: CapacityExceeded, -19: Error, -20: NotSupported,
    -21: StateError, -22: ChecksumError, -23: Stale, -24: Freed, -25: DeviceError,
}


def raise_status(status: int) -> NoReturn:
    """Raises the Error subclass for a negative status, with this thread's detail message."""
    detail = (_lib.lib.ferry_last_error() or b"").decode(errors="replace")
    raise _BY_CODE.get(status, Error)(status, detail)


def check(status: int) -> int:
    """Returns a non-negative status; raises for a negative one."""
    if status < 0:
        raise_status(status)
    return status
