"""How a sender is found by name without a directory: the rendezvous file
FERRY_CTL_DIR/ferry-refit-NAME on this host (the package docstring says when), read and written
only as a regular file of this user's; and the names of the senders' own nodes."""
import atexit
import errno
import os
import re
import socket
import stat
import threading

from .._lib import lib
from ..errors import AccessDenied, InvalidArgument


_NAME_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$")
_seq = 0
_seq_lock = threading.Lock()
_published = set()  # rendezvous files this process wrote


def _directory_configured(directory):
    """Whether names go through a directory (as in C) rather than the same-host file: a
    directory URL was given, or FERRY_DIRECTORY is set (libferry reads the same environment)."""
    return bool(directory) or bool(os.environ.get("FERRY_DIRECTORY"))


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


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))


def _planted(path, what):
    return AccessDenied(-7, "refit: %s is %s, not a regular file of this user's (uid %d): not "
                            "used; another user may have planted it: remove it, set "
                            "FERRY_CTL_DIR to a directory only this user may write, or "
                            "configure a directory (FERRY_DIRECTORY)"
                        % (path, what, os.geteuid()))


def _kind(mode):
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _open_shared(path, flags=os.O_RDONLY):
    """A descriptor of `path` in FERRY_CTL_DIR, which other users may write too (as C's
    fr_open_shared): never following a link nor blocking on a FIFO, and only for a regular file
    this user owns (ferry.AccessDenied naming what is there otherwise); None when there is none."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENOTDIR):
            try:
                raise _planted(path, _kind(os.lstat(path).st_mode)) from None
            except FileNotFoundError:
                return None
        raise AccessDenied(-7, "refit: open %s: %s" % (path, e.strerror)) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise _planted(path, "owned by uid %d" % st.st_uid if stat.S_ISREG(st.st_mode)
                       else _kind(st.st_mode))
    return fd


def _read_rendezvous(path):
    """(address, pid) of a live sender, or None; ferry.AccessDenied when what is there is not a
    regular file of this user's (_open_shared)."""
    fd = _open_shared(path)
    if fd is None:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            lines = f.read(4096).decode().split("\n")
        addr, pid = lines[0], int(lines[1])
    except (OSError, ValueError, IndexError):
        return None
    return (addr, pid) if addr and _pid_alive(pid) else None


@atexit.register
def _unpublish_at_exit():
    # A sender still open at exit (asyncio.run(tx.push_async(1)) at a script's top level) would
    # be closed by garbage collection only once the interpreter finalizes, when its close can no
    # longer import anything and the rendezvous file stayed behind (issue 35). atexit runs
    # before that: remove each file this process published that still names this process.
    with _seq_lock:
        paths = list(_published)
    for path in paths:
        try:
            found = _read_rendezvous(path)
            if found is not None and found[1] == os.getpid():
                os.unlink(path)
        except (OSError, AccessDenied):
            pass
