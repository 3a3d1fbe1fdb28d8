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

Finding the sender by name, as C senders and receivers do (ferry_refit_opts.publish): when a
directory is configured (FERRY_DIRECTORY set, or RefitSender(directory=URL)), RefitSender(name)
publishes the record "ferry:job/refit/NAME" on its context's node there (under the node's lease), and
RefitReceiver(name) on any host whose FERRY_DIRECTORY names the same directory looks it up. So
a Python receiver finds a C sender and a C receiver (ferry_refit_receiver_open(ctx, "NAME"))
finds a Python sender. With no directory configured the C side publishes nothing (its
FERRY_DIRECTORY default, ferry://127.0.0.1:7700, must then be running); Python instead falls
back to a file on this host: FERRY_CTL_DIR/ferry-refit-NAME (mode 0600, removed on close) holds
the address and RefitReceiver(name) on the same host reads it. That directory is shared with
other users (/dev/shm): the file is written under a fresh unguessable name and renamed into
place, and only a regular file this user owns is read; a link, a FIFO or another user's file
under the name is refused (ferry.AccessDenied, saying what is there), never followed or waited
on. That fallback is for one host and Python only; across hosts, or with C peers, configure a
directory (`ferry serve`), or pass the sender's `address` to the receiver instead of the name.

Routes and alias mode (docs/REFIT.md): push(v, route="direct" | "chain" | "auto") as
ferry_refit_push_opts.route (auto, the default: receivers on the sender's host read from it
directly, the others chain). RefitSender(alias=True) keeps the whole wire layout in one shared
buffer, and a receiver on its host calls bind_alias() (or opens with alias=True) for read-only
views into it: nothing is copied, and the engine must not read them while a push is under way.

Loading while buckets land: for name, t in rx.updates(v) (engine.load_weights(rx.updates(v)))
yields every tensor of version v once the buckets that carry it landed and verified, as views,
with an optional trainer -> engine name mapping that also fuses (ferry/_refit_load.py).

asyncio: await tx.push_async(v, ...) runs the push in the loop's default executor (as
ferry.aio does); await rx.wait_async(v, timeout=...) holds no thread at all: the receiver's
commit callback wakes it, so cancelling it leaves nothing behind.
"""
import asyncio
import atexit
import ctypes
import errno
import functools
import itertools
import os
import re
import secrets
import socket
import stat
import threading
import time
import weakref
from typing import (Any, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Sequence,
                    Tuple, Union)

import numpy as np

from . import _lib
from ._lib import POINTER, byref, c_char_p, c_int, c_uint64, c_void_p, lib
from .errors import (AccessDenied, AlreadyExists, InvalidArgument, NotFound, NotSupported,
                     Timeout, check, raise_status)
from . import cuda
from .cuda import DeviceBytes, sync_all
from .tensors import DTYPES, Context, _ctx_for, as_buffer, desc_shape, dtype_code, from_bits

__all__ = ["RefitSender", "RefitReceiver", "refit_address", "ROUTES", "Piece", "tp_shards"]

# ferry_refit_route, by the name push(route=...) takes
ROUTES = {"auto": 0, "direct": 1, "chain": 2}


# The C structs and callback types this module passes (declared, with every prototype, in _lib)
RefitOpts, PushOpts, _PieceC = _lib.RefitOpts, _lib.PushOpts, _lib.RefitPiece
_BUCKET_FN, _COMMIT_FN = _lib.REFIT_BUCKET_FN, _lib.REFIT_COMMIT_FN

_NAME_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$")
_seq = 0
_seq_lock = threading.Lock()
_published = set()  # rendezvous files this process wrote


_ms = _lib.timeout_ms


def _directory_configured(directory):
    """Whether names go through a directory (as in C) rather than the same-host file: a
    directory URL was given, or FERRY_DIRECTORY is set (libferry reads the same environment)."""
    return bool(directory) or bool(os.environ.get("FERRY_DIRECTORY"))


def _route_code(route):
    if route in ROUTES:
        return ROUTES[route]
    raise ValueError("refit push: route=%r; pass 'auto' (the default), 'direct' or 'chain'"
                     % (route,))


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
        dev = getattr(getattr(obj, "device", None), "type", "cpu")
        if dev not in ("cpu", "cuda"):
            raise NotSupported(-20, "refit: tensors on %s are not supported (CPU and CUDA only)"
                               % obj.device)
        self.obj = obj
        self.stage = None
        # a CUDA tensor is declared in place or refused (as_buffer says why): a device staging
        # copy refreshed before each push would double the sender's device memory unasked
        if dev == "cpu" and _needs_staging(obj):
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
    non-contiguous tensor is copied into a staging buffer before each push). CUDA tensors
    (torch, or __cuda_array_interface__ objects) are declared in place too and must be
    contiguous; each push first synchronizes the stream that produced them (torch's current
    stream of each device, or the interface's `stream`), then ferry reads them with its own
    copies, done before push returns (docs/GPU.md).

    buffer_bytes: the bucket size (two are allocated; None: FERRY_REFIT_BUFFER_BYTES). cast:
    send float32 tensors as another dtype ("bfloat16", "float16", "float8_e4m3"), or a
    {name: dtype} dict. publish: make the sender findable as RefitReceiver(name): in the
    directory (`directory`, else FERRY_DIRECTORY when set; ferry.AlreadyExists when a live
    sender holds the name), else in this host's FERRY_CTL_DIR (module docstring). alias: keep
    the whole wire layout in one shared buffer that receivers on this host read in place
    (RefitReceiver.bind_alias; device memory when every tensor is on one CUDA device, uncast).
    device_buckets: with every tensor on one CUDA device and none cast, two bucket slots in
    that device's memory; pushes whose receivers are all on this host go device to device
    through CUDA IPC, unhashed (ferry_refit_opts.device_buckets, docs/GPU.md)."""

    def __init__(self, name: str, state_dict: Mapping[str, Any],
                 buffer_bytes: Optional[int] = None,
                 cast: Union[str, Any, Dict[str, Any], None] = None,
                 ctx: Optional[Context] = None, publish: bool = True,
                 directory: Optional[str] = None, alias: bool = False,
                 device_buckets: bool = False) -> None:
        self.name = name
        path = refit_address(name) if publish else None  # also checks the name
        in_dir = bool(publish) and _directory_configured(directory)
        if in_dir:
            path = None
        self.directory = (directory or lib.ferry_config_get(b"FERRY_DIRECTORY").decode()) \
            if in_dir else None
        if ctx is not None:
            self._ctx, self._owns_ctx = ctx, False
        else:
            # A context of its own, not the process's default one (tensors._ctx_for) that the
            # store, mq and receivers share: the C sender's close sends its receivers nothing,
            # so they learn that it is gone (ferry.PeerGone) only when its links die, which is
            # when its context closes. On a context that outlives it they would wait out their
            # timeouts instead. Pass ctx= to share one anyway (one sender per context).
            self._ctx, self._owns_ctx = Context(name=_node_name("refit-tx")), True
        self._h = None
        self._path = None
        self._sources = {}
        self._device = []  # the DeviceBytes of its CUDA tensors: their streams, to wait on
        self._cast = cast
        self._lock = threading.Lock()
        self.version = 0
        try:
            opts = RefitOpts(ctypes.sizeof(RefitOpts),
                             _lib.c_int_of(buffer_bytes or 0, c_uint64, "buffer_bytes"),
                             1 if alias else 0,
                             1 if in_dir else 0, _lib.encoded(directory, "directory"), 0,
                             1 if device_buckets else 0)
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
        if changed:
            self._device = [s.arr for s in self._sources.values()
                            if isinstance(s.arr, DeviceBytes)]
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
        # FERRY_CTL_DIR is shared with other users: a fresh temporary of an unguessable name
        # (O_EXCL|O_NOFOLLOW: never a file or link someone put there), renamed into place, and
        # the result checked to be that very file. `ferry gc` reads the pid before ".tmp".
        tmp = "%s.%s.%d.tmp" % (path, secrets.token_hex(8), os.getpid())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write("%s\n%d\n" % (self.address, os.getpid()))
                f.flush()
                mine = os.fstat(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        fd = _open_shared(path)
        there = os.fstat(fd) if fd is not None else None
        if fd is not None:
            os.close(fd)
        if there is None or (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
            raise AlreadyExists(-6, "refit '%s': %s was replaced while it was published"
                                % (self.name, path))

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
        if _on_foreign_thread(self.close):
            return
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
             state_dict: Optional[Mapping[str, Any]] = None, route: str = "auto") -> int:
        """Sends the tensors' current bytes as `version` (None: the last one + 1) and returns it
        once every attached receiver committed it. only: names of the tensors to send (the
        buckets they touch); skip_unchanged: skip buckets whose checksum did not change. Both
        apply only when every receiver holds the previous version. state_dict: update() first.
        route: "auto" (receivers on this host read directly, the others chain), "direct" (every
        receiver reads from the sender) or "chain" (each reads from the one before it).
        A receiver that failed raises (the detail names only the receivers that did not commit;
        every other one committed before this returns). One that acknowledged nothing within
        `timeout` (stopped, stalled) raises ferry.Timeout and is dropped: later pushes go on
        without it until it attaches again, which it does by itself once it runs."""
        code = _route_code(route)
        if state_dict is not None:
            self.update(state_dict)
        v = _lib.c_int_of(self.version + 1 if version is None else version, c_uint64, "version")
        for s in self._sources.values():
            s.refresh()
        if self._device:
            sync_all(self._device)
        opts = PushOpts(ctypes.sizeof(PushOpts), None, 0, 1 if skip_unchanged else 0,
                        _ms(timeout), code)
        if only is not None:
            names = [_lib.encoded(n, "tensor name") for n in only]
            arr = (c_char_p * max(len(names), 1))(*names)
            opts.only, opts.n_only = ctypes.cast(arr, POINTER(c_char_p)), len(names)
        check(lib.ferry_refit_push(self.handle, v, byref(opts)))
        self.version = v
        return v

    async def push_async(self, version: Optional[int] = None, **kwargs: Any) -> int:
        """push() as a coroutine: the push runs in the event loop's default executor (ferry
        releases the GIL), so the loop keeps running. Bad arguments raise here, before any
        thread. Cancelling the await does not stop a push under way: it ends (commits or fails
        by its timeout) in that thread, and its outcome is dropped."""
        _route_code(kwargs.get("route", "auto"))
        self.handle  # closed: ValueError here
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(self.push, version, **kwargs))


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
    "tcp://10.0.0.5:40123", which is RefitSender.address) and receives its manifest. A name is
    looked up in FERRY_DIRECTORY when that is set (a C or Python sender, on any host), else in
    this host's FERRY_CTL_DIR (a Python sender on this host; module docstring).

    timeout: seconds to wait for the sender to appear and answer (None: FERRY_TIMEOUT_MS).
    Then either bind(state_dict) (bytes land in your tensors), tensors() (views into one flat
    ferry buffer) or bind_alias() (alias=True: read-only views into the sender's own buffer, on
    its host); wait(version) returns once a version committed (every bucket verified), and
    updates(version) yields each tensor as it lands. A receiver that attaches after versions
    were pushed gets the latest one at once (from its first wait, committed or updates).

    ctx: an open ferry.Context to use (one receiver per context); by default the process's
    default context, the node its store and mq share (ferry.default_context), else (it has a
    receiver already) a new one, closed with the receiver. Its close tells the sender
    (DETACH), so sharing a context that outlives it is fine."""

    def __init__(self, name: str, timeout: Optional[float] = None,
                 ctx: Optional[Context] = None, alias: bool = False) -> None:
        self.name = name
        if ctx is not None:
            # the C library refuses a second receiver on one context (FERRY_EBUSY, saying so)
            self._ctx, self._owns_ctx, self._claimed = ctx, False, ctx._claim("refit-rx")
        else:
            self._ctx, self._owns_ctx = _ctx_for("refit-rx")
            self._claimed = True
        self._h = None
        self._lock = threading.RLock()  # re-entrant: views' finalizers _release_view (ferry.tensors)
        self._bound = {}
        self._pieces = {}  # bind_shards targets: {target: [Piece]}
        self._views = 0
        self._closing = False
        self._flat = None
        self._alias = False
        self._has_flat = False
        self._key = next(_keys)  # names this receiver to the event callbacks
        try:
            self._attach(name, timeout)
            if alias:
                self.bind_alias()
        except BaseException:
            self._closing = True
            self._really_close()
            raise

    def _attach(self, name, timeout):
        budget = _ms(timeout)
        if budget < 0:
            budget = int((lib.ferry_config_get(b"FERRY_TIMEOUT_MS") or b"10000").decode())
        deadline = time.monotonic() + budget / 1000.0
        by_dir = "://" not in name and _directory_configured(None)
        if "://" in name or by_dir:
            address = name  # a name: libferry looks it up in FERRY_DIRECTORY
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
        h = c_void_p()
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            rc = lib.ferry_refit_receiver_open(self._ctx.handle, _lib.encoded(address, "address"),
                                               left, byref(h))
            if rc == -5 and by_dir and time.monotonic() < deadline:  # FERRY_ENOTFOUND
                time.sleep(0.02)  # not published (yet): the sender may be starting
                continue
            check(rc)
            break
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
        if _on_foreign_thread(self._really_close):
            return
        h, self._h = self._h, None
        with _listeners_lock:
            _listeners.pop(self._key, None)
            if h and _listening.pop(self._key, None):
                lib.ferry_refit_on_bucket(h, _BUCKET_FN(), None)
                lib.ferry_refit_on_commit(h, _COMMIT_FN(), None)
        if h:
            lib.ferry_refit_receiver_close(h)
        self._bound = {}
        self._pieces = {}
        if self._claimed:
            self._claimed = False
            self._ctx._release("refit-rx")
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
        otherwise); else returns (missing, unexpected) names. Keep the tensors alive.

        CUDA tensors (torch, __cuda_array_interface__) bind too: ferry writes them with its own
        copies while a version lands, and once wait() returns that version they are complete
        and visible to every stream; as with host tensors, do not read them while a push is
        under way (control's clear/update lifecycle)."""
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
            self._pieces.pop(name, None)  # a whole tensor now, no longer a shard target
        return missing, unexpected

    def tensors(self, like: Any = "torch") -> Dict[str, Any]:
        """{name: tensor} views into one flat ferry buffer that every push writes in place
        (zero copy: no bytes move on the Python side). like: "torch" or "numpy" (bfloat16 and
        float8 come as their bits in numpy; a dtype the installed torch lacks, as numpy).

        When the sender re-seals (a tensor changed dtype or shape), the receiver lays the flat
        buffer out anew with the next push and frees the old one: call tensors() again then
        and drop the old views (reading them is undefined). Bound tensors (bind()) have no such
        hazard. In alias mode (bind_alias()) these are its read-only views."""
        if not self._alias:
            check(lib.ferry_refit_bind_flat(self.handle))
            self._has_flat = True
        return self._view_map(like)[0]

    def bind_alias(self, like: Any = "torch") -> Dict[str, Any]:
        """Alias mode, for an engine on the sender's host whose sender has alias=True: returns
        {name: view} into the sender's own shared buffer (nothing is copied, nothing is
        allocated here). Read-only: numpy views are not writeable; torch has no read-only
        tensors, so never write them (that writes the sender's buffer). The sender writes each
        version there in place, so read them only while `committed` is the version you expect
        (the control lifecycle's clear -> update gives that). When the sender's tensors are all
        on one CUDA device (no cast), its buffer is device memory mapped here through CUDA IPC:
        the views are torch CUDA tensors (torch with CUDA) or ferry.DeviceView objects
        (__cuda_array_interface__). ferry.NotSupported when the sender keeps no alias buffer or
        is on another host."""
        check(lib.ferry_refit_bind_alias(self.handle))
        self._alias = True
        return self._view_map(like)[0]

    def _view_map(self, like):
        """({name: view}, {name: address}, the _Flat keeping them) over the flat buffer or, in
        alias mode, the sender's buffer (then read-only)."""
        h = self.handle
        man = self.manifest()
        ptrs = []
        for m in man:
            p = c_void_p()
            check(lib.ferry_refit_view(h, _lib.encoded(m["name"], "tensor name"), byref(p)))
            ptrs.append(p.value)
        if not man:
            return {}, {}, None
        kind, device = cuda.mem_where(ptrs[0])
        if kind == "cuda":  # alias mode over CUDA IPC: the sender's device buffer, mapped here
            out = {m["name"]: cuda.device_view(p, m["shape"], dtype_code(m["dtype"]), device, self,
                                               like) for p, m in zip(ptrs, man)}
            return out, {m["name"]: p for p, m in zip(ptrs, man)}, None
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
            if self._alias:
                arr.flags.writeable = False
            try:
                out[m["name"]] = from_bits(arr, code, like)
            except NotSupported:  # a dtype this torch lacks (uint16..64 before torch 2.3)
                out[m["name"]] = arr
        return out, {m["name"]: p for p, m in zip(ptrs, man)}, flat

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
        check(lib.ferry_refit_wait(self.handle, _lib.c_int_of(version or 0, c_uint64, "version"),
                                   _ms(timeout), byref(got)))
        return int(got.value)

    def _wait_now(self, version):
        """ferry_refit_wait without blocking: (status, committed). It also asks the sender for
        the latest version when this receiver lacks it (late join)."""
        got = c_uint64()
        rc = lib.ferry_refit_wait(self.handle, _lib.c_int_of(version or 0, c_uint64, "version"), 0,
                                  byref(got))
        return rc, int(got.value)

    async def wait_async(self, version: Optional[int] = None,
                         timeout: Optional[float] = None) -> int:
        """wait() as a coroutine that holds no thread: the receiver's commit callback wakes it
        (and it looks every 100 ms for a sender that is gone). Returns the committed version;
        raises as wait() does. Cancelling it only stops listening: the receiver is unchanged."""
        loop = asyncio.get_running_loop()
        budget = _ms(timeout)
        if budget < 0:
            budget = int((lib.ferry_config_get(b"FERRY_TIMEOUT_MS") or b"10000").decode())
        deadline = loop.time() + budget / 1000.0
        woke = asyncio.Event()

        def on_event(_event):  # on the receiver's thread
            loop.call_soon_threadsafe(woke.set)

        self._listen(on_event)
        try:
            while True:
                woke.clear()
                rc, got = self._wait_now(version)
                if rc == 0:
                    return got
                left = deadline - loop.time()
                if rc != -4 or left <= 0:  # FERRY_ETIMEDOUT is the only one worth waiting on
                    raise_status(rc)
                try:
                    await asyncio.wait_for(woke.wait(), min(left, 0.1))
                except asyncio.TimeoutError:
                    pass
        finally:
            self._unlisten(on_event)

    def _listen(self, fn):
        """Calls fn(("bucket", version, bucket)) for each bucket that lands and verified, and
        fn(("commit", version, status)) when a version ends here, on the receiver's thread,
        until _unlisten(fn). fn must not block."""
        h = self.handle
        with _listeners_lock:
            fns = _listeners.setdefault(self._key, [])
            fns.append(fn)
            if len(fns) == 1:  # under the lock: a concurrent _unlisten cannot undo it
                lib.ferry_refit_on_bucket(h, _bucket_event, self._key)
                lib.ferry_refit_on_commit(h, _commit_event, self._key)
                _listening[self._key] = h

    def _unlisten(self, fn):
        with _listeners_lock:
            fns = _listeners.get(self._key)
            if not fns or fn not in fns:
                return
            fns.remove(fn)
            if fns:
                return
            del _listeners[self._key]
            h = _listening.pop(self._key, None)
            if h:
                lib.ferry_refit_on_bucket(h, _BUCKET_FN(), None)
                lib.ferry_refit_on_commit(h, _COMMIT_FN(), None)

    def updates(self, version: int, mapping: Any = None, timeout: Optional[float] = None,
                like: Any = "torch") -> Iterator[Tuple[str, Any]]:
        """Yields (name, tensor) for every tensor of `version` as it lands, for
        engine.load_weights(rx.updates(v)): a tensor comes once every bucket that carries it
        landed and verified (the rest, which this push did not resend or which landed before
        the iteration began, once the version commits). The iteration ends when the version
        is committed here; it raises when the version does not commit (a failed push: the
        bytes are torn, the error says why), when the sender is gone, when a newer version
        begins landing over tensors already given out (ferry.Stale), or when nothing lands for
        `timeout` seconds (None: FERRY_TIMEOUT_MS). A version already committed (or a newer
        one, as wait() accepts; the iterator's .version says which) is yielded at once; a late
        receiver is caught up first. The iterator listens from its creation (call updates()
        before the push to see every bucket) until it ends or is closed.

        Tensors are views, never copies: of the flat buffer (tensors(), bound here when
        nothing is), of the sender's buffer in alias mode (read-only), or your own tensors
        after bind() and bind_shards(). A receiver that bound shards yields each target under
        its target name (a tensor-parallel rank's slices, e.g. a fused qkv_proj shard) once
        every bucket of the sender tensors its pieces read landed and verified, so a rank that
        reads only its slices loads with model.load_weights(rx.updates(v)).

        They hold this version only until the next push begins to land: copy them into the
        engine's parameters during the iteration (load_weights does) and keep no reference
        after it. updates() holds nothing back: the receiver keeps acknowledging buckets while
        you load, and nothing outlives the iteration (close it, or let it end).

        mapping renames and fuses trainer names into the engine's: a dict {trainer name:
        engine name | (engine name, shard id) | [several] | None (skip)}, names it lacks kept;
        a callable name -> the same; or vLLM's stacked_params_mapping rules, a list of
        (param_name, shard_name, shard_id) applied as vLLM's load_weights does
        (".q_proj" -> ".qkv_proj", "q"). Tensors with shard ids under one engine name are fused
        along dim 0 in shard order (ints 0, 1, ...; vLLM's "q", "k", "v") and yielded once all
        of them landed: a view when they lie back to back in the buffer (the sender declared
        them in that order, each a multiple of 64 bytes), else their concatenation (a copy).
        like: "torch" or "numpy"."""
        from ._refit_load import updates
        return updates(self, version, mapping, timeout, like)

# -- shards: tensor-parallel ranks that keep a slice of each tensor (docs/REFIT.md, Shards) ------

class Piece(NamedTuple):
    """Piece(source, dim, start, stop): the elements of the sender's tensor `source` whose index
    along `dim` lies in [start, stop). A target (an engine tensor) is one or more pieces laid one
    after another along its dim 0 (a fused qkv_proj shard: a q, a k and a v piece)."""
    source: str
    dim: int
    start: int
    stop: int


def _bind_shards(self, targets: Dict[str, Tuple[Any, Sequence[Any]]]) -> None:
    """Binds engine tensors to slices of the sender's: targets is {target: (tensor, pieces)}
    (tensor: a contiguous numpy array or CPU torch tensor in the wire dtype, whose dim 0 the
    pieces fill one after another; pieces: Piece or (source, dim, start, stop) tuples), e.g. what
    ferry.tp_shards() computes for a rank. From then on this receiver reads from the sender only
    the bytes of what it bound (tensors from bind() count whole) and verifies each of them.
    A piece that does not fit raises (ferry.ShapeError, DtypeError or NotFound) naming the
    target and the piece. Keep the tensors alive."""
    h = self.handle
    for target, (obj, pieces) in targets.items():
        pieces = [Piece(str(p[0]), _lib.c_int_of(p[1], c_int, "target '%s' piece dim" % target),
                        _lib.c_int_of(p[2], ctypes.c_int64, "target '%s' piece start" % target),
                        _lib.c_int_of(p[3], ctypes.c_int64, "target '%s' piece stop" % target))
                  for p in pieces]
        names = [_lib.encoded(p.source, "tensor name") for p in pieces]
        arr_c = (_PieceC * max(len(pieces), 1))(
            *[_PieceC(n, p.dim, p.start, p.stop) for n, p in zip(names, pieces)])
        desc, arr = as_buffer(obj, writable=True)
        ptr = arr.ctypes.data if arr.nbytes else ctypes.addressof(ctypes.c_char())
        rc = lib.ferry_refit_bind_pieces(h, _lib.encoded(target, "target name"), ptr, byref(desc),
                                         arr_c, len(pieces))
        if rc < 0:
            raise_status(rc)
        self._bound[target] = (obj, arr)
        self._pieces[target] = pieces


def _bytes_read(self) -> int:
    """Bytes this receiver read from the sender since it attached (a tensor-parallel rank that
    bound its shards reads about 1/world of the model per push)."""
    return int(lib.ferry_refit_bytes_read(self.handle))


RefitReceiver.bind_shards = _bind_shards
RefitReceiver.bytes_read = property(_bytes_read)


def _shapes_of(manifest_or_shapes: Any) -> Dict[str, Tuple[Tuple[int, ...], Optional[str]]]:
    """{name: (shape, dtype)} from a RefitReceiver, its manifest() list, or {name: shape} /
    {name: (shape, dtype)}."""
    src = manifest_or_shapes
    if isinstance(src, RefitReceiver):
        src = src.manifest()
    if isinstance(src, dict):
        out = {}
        for name, v in src.items():
            if (isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], str)):
                out[name] = (tuple(int(x) for x in v[0]), v[1])
            else:
                out[name] = (tuple(int(x) for x in v), None)
        return out
    return {m["name"]: (tuple(m["shape"]), m.get("dtype")) for m in src}


def _split(name: str, shape: Tuple[int, ...], dim: Optional[int], rank: int, world: int) -> Piece:
    if dim is None:
        return Piece(name, 0, 0, shape[0] if shape else 1)
    if dim < 0 or dim >= len(shape):
        raise InvalidArgument(-1, "tp_shards: '%s' %s has no dim %d" % (name, list(shape), dim))
    if shape[dim] % world:
        raise InvalidArgument(-1, "tp_shards: '%s' dim %d (size %d) does not split in %d"
                              % (name, dim, shape[dim], world))
    n = shape[dim] // world
    return Piece(name, dim, rank * n, (rank + 1) * n)


def tp_shards(manifest_or_shapes: Any, rank: int, world: int,
              rules: Sequence[Tuple[str, Optional[int]]],
              fused: Optional[Dict[str, Sequence[str]]] = None
              ) -> Dict[str, Tuple[Tuple[int, ...], Optional[str], List[Piece]]]:
    """The shards of tensor-parallel rank `rank` of `world`: {target: (shape, dtype, [Piece])},
    so that an engine rank allocates each target and binds it:

        specs = ferry.tp_shards(rx, rank, world,
                                rules=[(r"\\.(q|k|v|gate|up)_proj\\.", 0),   # column-parallel
                                       (r"\\.(o|down)_proj\\.", 1),          # row-parallel
                                       (r"norm", None)],                    # replicated
                                fused={"qkv_proj.weight": ["q_proj.weight", "k_proj.weight",
                                                           "v_proj.weight"]})
        mine = {t: torch.empty(shape, dtype=getattr(torch, dtype))
                for t, (shape, dtype, _) in specs.items()}
        rx.bind_shards({t: (mine[t], specs[t][2]) for t in specs})

    manifest_or_shapes: a RefitReceiver, its manifest(), or {name: shape} / {name: (shape,
    dtype)}; dtype is then the wire dtype's name ("bfloat16", "float32", ...; None when only
    shapes were given). rules: (regex, dim) pairs tried in order against each sender tensor's name
    (re.search); the first match splits that tensor along dim into `world` equal parts (dim
    None: every rank keeps it whole); a tensor no rule matches is replicated. fused: {target:
    [sources]}: the sources' slices laid one after another along the target's dim 0 (the
    sources then have no target of their own). Raises InvalidArgument for a dim a tensor lacks,
    a size that does not split in `world`, or a fused source that is not sent."""
    rank, world = int(rank), int(world)
    if world < 1 or not 0 <= rank < world:
        raise InvalidArgument(-1, "tp_shards: rank %d of world %d" % (rank, world))
    shapes = _shapes_of(manifest_or_shapes)
    compiled = [(re.compile(rx), d) for rx, d in rules]

    def piece_of(name):
        shape = shapes[name][0]
        dim = next((d for rx, d in compiled if rx.search(name)), None)
        return _split(name, shape, dim, rank, world)

    def piece_shape(p):
        shape = list(shapes[p.source][0]) or [1]
        shape[p.dim] = p.stop - p.start
        return shape

    out = {}
    taken = set()
    for target, sources in (fused or {}).items():
        missing = [s for s in sources if s not in shapes]
        if missing:
            raise InvalidArgument(-1, "tp_shards: fused '%s': the sender sends no %s"
                                  % (target, missing))
        pieces = [piece_of(s) for s in sources]
        shape = piece_shape(pieces[0])
        shape[0] = sum(piece_shape(p)[0] for p in pieces)
        out[target] = (tuple(shape), shapes[sources[0]][1], pieces)
        taken.update(sources)
    for name, (shape, dtype) in shapes.items():
        if name in taken:
            continue
        p = piece_of(name)
        out[name] = (tuple(piece_shape(p)) if shape else (), dtype, [p])
    return out
