"""ferry.RefitSender: the trainer's side of refit (ferry_refit_sender_*): declares a state dict's
tensors in place and pushes each version of them to every receiver."""
import asyncio
import ctypes
import functools
import os
import secrets
import threading
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import numpy as np

from .. import _lib
from .._lib import POINTER, byref, c_char_p, c_uint64, c_void_p, lib
from ..errors import AlreadyExists, InvalidArgument, NotSupported, StateError, Timeout, check
from ..cuda import DeviceBytes, sync_all
from ..tensors import DTYPES, Context, as_buffer, desc_shape, dtype_code

from .events import _on_foreign_thread
from .names import (_directory_configured, _node_name, _open_shared, _published, _read_rendezvous,
                    _seq_lock, refit_address)
from .shards import Piece


# ferry_refit_route, by the name push(route=...) takes
ROUTES = {"auto": 0, "direct": 1, "chain": 2}

# The C structs this module passes (declared, with every prototype, in _lib)
RefitOpts, PushOpts = _lib.RefitOpts, _lib.PushOpts

_ms = _lib.timeout_ms


def _route_code(route):
    if route in ROUTES:
        return ROUTES[route]
    raise ValueError("refit push: route=%r; pass 'auto' (the default), 'direct' or 'chain'"
                     % (route,))


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


def _stream_sizes(name, buffer_bytes, stream_cap, world):
    """(bucket bytes, cap bytes) of a streaming sender: buckets of at most cap / 2."""
    from .stream import cap_bytes
    if world > 1:
        raise NotSupported(-20, "refit '%s': a rank of a sender group cannot stream (push_iter): "
                           "open it with its state_dict" % name)
    default = int(lib.ferry_config_get(b"FERRY_REFIT_BUFFER_BYTES").decode() or 67108864)
    cap = cap_bytes(stream_cap, buffer_bytes, default)
    if buffer_bytes is None:
        buffer_bytes = max(min(default, cap // 8) // 64 * 64, 64)
    elif buffer_bytes > cap // 2:
        raise InvalidArgument(-1, "refit '%s': buffer_bytes %d with stream_cap %d: a part sends "
                              "whole buckets, so they must be at most half the cap"
                              % (name, buffer_bytes, cap))
    return buffer_bytes, cap


def _rank_world(name, rank, world, in_dir):
    """(rank, world) checked: world 0 or 1 is a single sender (rank 0); a group needs a
    directory, where its ranks are published."""
    world = _lib.c_int_of(world, ctypes.c_int, "world", lo=0)
    rank = _lib.c_int_of(rank, ctypes.c_int, "rank", lo=0)
    if rank >= max(world, 1):
        raise InvalidArgument(-1, "refit '%s': rank %d of world %d" % (name, rank, world))
    if world > 1 and not in_dir:
        raise InvalidArgument(-1, "refit '%s': a sender group (world %d) publishes its ranks "
                              "in the directory, and none is configured: set FERRY_DIRECTORY "
                              "or pass directory= (and publish=True)" % (name, world))
    return rank, world


def _pieces_of(pieces, state_dict):
    """{local name: Piece} checked: each names a tensor of state_dict; ints that C holds."""
    out = {}
    for local, p in (pieces or {}).items():
        if local not in state_dict:
            raise InvalidArgument(-1, "refit pieces: '%s' is not a tensor of the state dict"
                                  % (local,))
        if not isinstance(p, (tuple, list)) or len(p) != 4:
            raise InvalidArgument(-1, "refit pieces: '%s': %r; pass ferry.Piece(global name, "
                                  "dim, start, stop)" % (local, p))
        what = "piece of '%s'" % local
        out[local] = Piece(str(p[0]), _lib.c_int_of(p[1], ctypes.c_int, what + " dim", lo=0),
                           _lib.c_int_of(p[2], ctypes.c_int64, what + " start", lo=0),
                           _lib.c_int_of(p[3], ctypes.c_int64, what + " stop", lo=0))
    return out


def _whole_pieces_only(name, pieces, state_dict):
    """A single sender's receivers see its tensors under their own names, whole: a piece of a
    tensor under another name, or of part of one, needs a group (world > 1). The pieces a
    builder gives a world of 1 (each tensor whole, under its own name) pass."""
    for local, p in pieces.items():
        shape = tuple(getattr(state_dict[local], "shape", ()))
        if p.source != local or p.dim >= len(shape) or (p.start, p.stop) != (0, shape[p.dim]):
            raise InvalidArgument(-1, "refit '%s': '%s' is %s, a piece of another tensor: that "
                                  "needs a sender group (world > 1); a single sender's receivers "
                                  "see its tensors whole under their own names" % (name, local, p))


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
    through CUDA IPC, unhashed (ferry_refit_opts.device_buckets, docs/GPU.md).

    Sharded senders (docs/REFIT.md, Sharded senders): rank, world: this process is rank `rank` of
    `world` trainer ranks that hold one model together, each opening a RefitSender under the same
    name (published in the directory as NAME#rank: a group needs one, FERRY_DIRECTORY or
    `directory`) and all pushing every version; receivers open NAME and see one model. world 1
    (the default): this sender holds the whole model. pieces: {local name: ferry.Piece(global
    name, dim, start, stop)}: that tensor of state_dict is the slice [start, stop) along dim of
    the global tensor `global name` (ferry.tp_pieces, fsdp_pieces and expert_pieces build them
    for the usual layouts); a tensor without an entry is whole under its own name (several ranks
    may each hold one whole: receivers read it from one of them). The ranks' pieces must tile
    each global tensor; a receiver refuses the group otherwise, naming the tensor and ranks.

    Streaming (push_iter, docs/REFIT.md, Streaming pushes): open it with no state_dict and push
    each version from an iterable of (name, tensor) whose tensors exist only while it yields them.
    stream_cap: how many bytes of those tensors push_iter may hold at once (int), or a fraction
    in (0, 1) of the free memory of torch's current CUDA device (of the host's available memory
    without one), as NeMo-RL sizes its refit buffer; None: 4 x FERRY_REFIT_BUFFER_BYTES (256
    MiB), or 4 x buffer_bytes when given. Without buffer_bytes the buckets are
    min(FERRY_REFIT_BUFFER_BYTES, cap / 8): a part sends whole buckets, so buffer_bytes must be
    at most cap / 2."""

    def __init__(self, name: str, state_dict: Optional[Mapping[str, Any]] = None,
                 buffer_bytes: Optional[int] = None,
                 cast: Union[str, Any, Dict[str, Any], None] = None,
                 ctx: Optional[Context] = None, publish: bool = True,
                 directory: Optional[str] = None, alias: bool = False,
                 device_buckets: bool = False, rank: int = 0, world: int = 1,
                 pieces: Optional[Mapping[str, Any]] = None,
                 stream_cap: Optional[float] = None) -> None:
        self.name = name
        self._streaming = state_dict is None
        self._plan = None  # streaming: {name: stream._Planned} once the first push_iter planned
        self._zeros = None  # plan(): what the tensors point at until push_iter gives them
        self.stream_info: Dict[str, int] = {}  # what the last push_iter took (parts, held_max)
        if self._streaming:
            buffer_bytes, self.stream_cap = _stream_sizes(name, buffer_bytes, stream_cap, world)
            state_dict = {}
        path = refit_address(name) if publish else None  # also checks the name
        in_dir = bool(publish) and _directory_configured(directory)
        if in_dir:
            path = None
        self.rank, self.world = _rank_world(name, rank, world, in_dir)
        self.pieces = _pieces_of(pieces, state_dict)
        if self.world <= 1:
            _whole_pieces_only(name, self.pieces, state_dict)
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
                             1 if device_buckets else 0, self.rank, self.world)
            h = c_void_p()
            check(lib.ferry_refit_sender_open(self._ctx.handle, _lib.encoded(name, "name"), byref(opts),
                                              byref(h)))
            self._h = h.value
            if not self._streaming:  # a streaming sender declares and seals at its first push
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
            piece = self.pieces.get(name)
            if piece is None:
                check(lib.ferry_refit_declare(self._h, _lib.encoded(name, "tensor name"),
                                              byref(src.desc), src.arr.ctypes.data, src.send_as))
            else:
                of = _lib.RefitPiece(_lib.encoded(piece.source, "global name"), piece.dim,
                                     piece.start, piece.stop)
                check(lib.ferry_refit_declare_piece(self._h, _lib.encoded(name, "tensor name"),
                                                    byref(src.desc), src.arr.ctypes.data,
                                                    src.send_as, byref(of)))
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
        """[{name, dtype, shape, wire_dtype, piece}] in declaration order: this rank's own
        tensors (piece: the ferry.Piece of a global tensor it is, None when whole)."""
        out = []
        for name, s in self._sources.items():
            out.append({"name": name, "dtype": DTYPES[s.desc.dtype][0],
                        "shape": desc_shape(s.desc),
                        "wire_dtype": DTYPES[s.send_as or s.desc.dtype][0],
                        "piece": self.pieces.get(name)})
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
        self._not_streaming("update")
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
        self._not_streaming("push")
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

    def _not_streaming(self, what):
        if self._streaming:
            raise StateError(-21, "refit '%s': %s() on a streaming sender (opened with no "
                             "state_dict): it keeps no tensors between versions; use push_iter"
                             % (self.name, what))

    def plan(self, meta: Iterable[Tuple[str, Any]]) -> None:
        """Makes a streaming sender's plan from names, dtypes and shapes alone: meta yields
        (name, tensor) with tensors of any device, torch's meta device too (a model's
        state_dict() built on the meta device, or its parameters' shapes before they are
        gathered), or (name, (shape, dtype)). The first push_iter then streams like every later
        one, with nothing staged in host memory, and receivers may attach before it (their
        committed version is 0 until it lands). Once per sender, before any push_iter; not with
        a float8 cast (its scale comes from the bytes at the seal)."""
        from . import stream
        if not self._streaming:
            raise StateError(-21, "refit '%s': plan() is for a sender opened with no state_dict"
                             % self.name)
        with self._lock:
            stream.plan_from(self, meta)

    def push_iter(self, version: Optional[int], weights: Iterable[Tuple[str, Any]],
                  timeout: Optional[float] = None, skip_unchanged: bool = False,
                  route: str = "auto") -> int:
        """Pushes `version` (None: the last one + 1) from `weights`, an iterable of (name,
        tensor) whose tensors need exist only while it yields them (a generator of FSDP
        full_tensor()s, of Megatron -> HF conversions), and returns it once every receiver in
        the push committed it. Needs a sender opened with no state_dict.

        Without plan() first, the first call plans: it copies each tensor into host memory as it
        comes (the plan, the receivers' manifest, needs every name and shape before a byte can
        go), then declares and pushes them whole, and frees the copies. Later calls stream
        against that plan (names, dtypes and shapes; any order, the first call's order holding
        the least; torch tensors and numpy arrays, host or CUDA for torch): each tensor is
        used where it is, held until the buckets it lies in went, and whenever the held bytes
        would pass stream_cap a part goes (a tensor bigger than the cap goes in a part of its
        own). Receivers commit the version with its last part, only if they took every part: a
        version cut short (the iterable raised, the sender died) is never reported by any
        receiver; the iterable's exception is re-raised once the version was abandoned, and the
        sender takes the next version as usual. A tensor of another name, dtype or shape than
        the plan's, or a name missing, raises PlanChanged (a ferry.InvalidArgument) naming it,
        abandons the version, and the next push_iter plans anew (a plan only grows: a name
        missing then still raises). A version begun spends its number, committed or not.
        timeout, skip_unchanged and route as push(); the last call's parts and the most bytes it
        held are in stream_info."""
        from . import stream
        if not self._streaming:
            raise StateError(-21, "refit '%s': push_iter needs a sender opened with no "
                             "state_dict (this one declares its tensors in place: push())"
                             % self.name)
        code = _route_code(route)
        v = _lib.c_int_of(self.version + 1 if version is None else version, c_uint64, "version")
        if v <= self.version:  # refused before the iterable is drawn from
            raise InvalidArgument(-1, "refit '%s': version %d is not after %d (a version begun "
                                  "spends its number)" % (self.name, v, self.version))
        opts = PushOpts(ctypes.sizeof(PushOpts), None, 0, 1 if skip_unchanged else 0,
                        _ms(timeout), code, 0)
        with self._lock:
            if self._plan is None:
                stream.plan_and_push(self, v, weights, opts)
                self.stream_info = {"parts": 0, "held_max": sum(p.nbytes for p in
                                                                self._plan.values())}
            else:
                self.stream_info = stream.stream_push(self, v, weights, opts, self.stream_cap)
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
