"""Receivers' bucket and commit events: libferry calls the two module-wide callbacks on a
receiver's service thread, and they hand each event to the listeners of that receiver
(RefitReceiver._listen: updates() and wait_async())."""
import atexit
import itertools
import threading

from .. import _lib
from .._lib import lib


_BUCKET_FN, _COMMIT_FN = _lib.REFIT_BUCKET_FN, _lib.REFIT_COMMIT_FN


# Receivers' listeners of bucket and commit events, by receiver key (the C callbacks' arg):
# C calls the module's two callbacks on a receiver's thread; they hand each event on.
_listeners = {}
_listening = {}  # key -> the C handle whose callbacks are set
# Re-entrant: garbage collection can run a receiver's or an iterator's finalizer (which
# unlistens) on a thread that holds this lock, at any allocation under it; a plain Lock then
# deadlocks that thread against itself. Each critical section below is short and touches only
# its own receiver's key, so a finalizer's nested pass through it leaves them consistent.
_listeners_lock = threading.RLock()


def _on_foreign_thread(close) -> bool:
    """A close on a thread Python did not start (a receiver's or sender's own service thread,
    running a callback in which a garbage collection ran a finalizer) is handed to a short-lived
    Python thread: it may close the context (which that thread serves) and, closing the receiver
    whose thread it is, would leave the C side to defer it. True when handed over."""
    if not isinstance(threading.current_thread(), threading._DummyThread):
        return False
    threading.Thread(target=close, name="ferry-refit-close", daemon=True).start()
    return True


_keys = itertools.count(1)


@atexit.register
def _unhook_receivers():
    # A receiver's thread must not call into a finalizing interpreter (as ferry._unhook).
    with _listeners_lock:
        for h in _listening.values():
            lib.ferry_refit_on_bucket(h, _BUCKET_FN(), None)
            lib.ferry_refit_on_commit(h, _COMMIT_FN(), None)
        _listening.clear()
        _listeners.clear()


def _dispatch(key, event):
    with _listeners_lock:
        fns = list(_listeners.get(key, ()))
    for fn in fns:
        try:
            fn(event)
        except Exception:  # an exception cannot cross into C; the listener's owner sees none
            pass


@_BUCKET_FN
def _bucket_event(_rx, version, bucket, key):
    _dispatch(key, ("bucket", int(version), int(bucket)))


@_COMMIT_FN
def _commit_event(_rx, version, status, why, key):
    why = (why or b"").decode(errors="replace")
    _dispatch(key, ("commit", int(version), (int(status), why)))
