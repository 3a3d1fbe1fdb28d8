"""ferry.Error and its subclasses, one per family of FERRY_E* codes, raised with the C library's
detail message (ferry_last_error(), read on the thread that made the failing call)."""
from . import _lib

__all__ = ["Error", "InvalidArgument", "OutOfMemory", "Timeout", "NotFound", "AlreadyExists",
           "AccessDenied", "OutOfBounds", "PeerGone", "ConnectError", "DtypeError", "ShapeError",
           "Closed", "Busy", "CapacityExceeded", "NotSupported", "StateError", "ChecksumError",
           "Stale", "check", "raise_status"]


class Error(Exception):
    """A failed ferry call. `status` is the negative FERRY_E* code, `name` its symbol
    ("FERRY_ENOTFOUND"), `detail` ferry_last_error()'s message."""

    def __init__(self, status, detail=""):
        self.status = status
        self.name = _lib.lib.ferry_status_name(status).decode()
        self.detail = detail
        text = _lib.lib.ferry_strerror(status).decode()
        super().__init__("%s: %s" % (text, detail) if detail else text)


class InvalidArgument(Error, ValueError): pass
class OutOfMemory(Error, MemoryError): pass  # FERRY_ENOMEM, FERRY_ENOSHM
class Timeout(Error, TimeoutError): pass
class NotFound(Error, KeyError):
    __str__ = Exception.__str__  # KeyError would quote the message
class AlreadyExists(Error): pass
class AccessDenied(Error, PermissionError): pass  # FERRY_EACCES, FERRY_EAUTH
class OutOfBounds(Error, IndexError): pass
class PeerGone(Error, ConnectionError): pass
class ConnectError(Error, ConnectionError): pass
class DtypeError(Error, TypeError): pass
class ShapeError(Error, ValueError): pass  # FERRY_ESHAPE, FERRY_EOVERFLOW
class Closed(Error): pass
class Busy(Error): pass
class CapacityExceeded(Error): pass
class NotSupported(Error, NotImplementedError): pass
class StateError(Error): pass
class ChecksumError(Error): pass
class Stale(Error): pass


_BY_CODE = {
    -1: InvalidArgument, -2: OutOfMemory, -3: OutOfMemory, -4: Timeout, -5: NotFound,
    -6: AlreadyExists, -7: AccessDenied, -8: OutOfBounds, -9: PeerGone, -10: Error,
    -11: ConnectError, -12: AccessDenied, -13: DtypeError, -14: ShapeError, -15: ShapeError,
    -16: Closed, -17: Busy, -18: CapacityExceeded, -19: Error, -20: NotSupported,
    -21: StateError, -22: ChecksumError, -23: Stale,
}


def raise_status(status):
    """Raises the Error subclass for a negative status, with this thread's detail message."""
    detail = (_lib.lib.ferry_last_error() or b"").decode(errors="replace")
    raise _BY_CODE.get(status, Error)(status, detail)


def check(status):
    """Returns a non-negative status; raises for a negative one."""
    if status < 0:
        raise_status(status)
    return status
