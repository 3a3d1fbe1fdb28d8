"""ferry.RefitReceiver: an engine's side of refit (ferry_refit_receiver_*): attaches to a sender,
binds destinations (its own tensors, one flat buffer, the sender's alias buffer, or shards), and
waits for versions."""
import asyncio
import ctypes
import threading
import time
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .. import _lib
from .._lib import byref, c_char_p, c_int, c_uint64, c_void_p, lib
from ..errors import NotFound, NotSupported, check, raise_status
from .. import cuda
from ..tensors import DTYPES, Context, _ctx_for, as_buffer, desc_shape, dtype_code, from_bits

from . import events
from .events import _bucket_event, _commit_event, _keys, _on_foreign_thread
from .names import _directory_configured, _read_rendezvous, refit_address
from .shards import Piece


# The C structs and callback types this module passes (declared, with every prototype, in _lib)
_PieceC = _lib.RefitPiece
_BUCKET_FN, _COMMIT_FN = _lib.REFIT_BUCKET_FN, _lib.REFIT_COMMIT_FN

_ms = _lib.timeout_ms


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
    (DETACH), so sharing a context that outlives it is fine.

    A sharded sender group (the M ranks of a trainer, each a RefitSender(name, ..., rank=r,
    world=M) published in the directory) opens by its name the same way: the receiver attaches
    to every rank and sees one global manifest (ranks says M); bind, bind_shards, tensors() and
    wait mean what they mean for one sender, and it reads each byte straight from the rank
    that holds it."""

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
        with events._listeners_lock:
            events._listeners.pop(self._key, None)
            if h and events._listening.pop(self._key, None):
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
        with events._listeners_lock:
            fns = events._listeners.setdefault(self._key, [])
            fns.append(fn)
            if len(fns) == 1:  # under the lock: a concurrent _unlisten cannot undo it
                lib.ferry_refit_on_bucket(h, _bucket_event, self._key)
                lib.ferry_refit_on_commit(h, _commit_event, self._key)
                events._listening[self._key] = h

    def _unlisten(self, fn):
        with events._listeners_lock:
            fns = events._listeners.get(self._key)
            if not fns or fn not in fns:
                return
            fns.remove(fn)
            if fns:
                return
            del events._listeners[self._key]
            h = events._listening.pop(self._key, None)
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
        like: "torch" or "numpy".

        From a sharded sender group (ranks > 1) a global tensor's bytes come in buckets of
        several ranks, so nothing is yielded per bucket: every tensor comes once the version
        committed here, with the same meaning otherwise (a failed version raises before any
        tensor is given out)."""
        from .load import updates
        return updates(self, version, mapping, timeout, like)

    def bind_shards(self, targets: Dict[str, Tuple[Any, Sequence[Any]]]) -> None:
        """Binds engine tensors to slices of the sender's: targets is {target: (tensor,
        pieces)} (tensor: a contiguous numpy array or CPU torch tensor in the wire dtype, whose
        dim 0 the pieces fill one after another; pieces: Piece or (source, dim, start, stop)
        tuples), e.g. what ferry.tp_shards() computes for a rank. From then on this receiver
        reads from the sender only the bytes of what it bound (tensors from bind() count whole)
        and verifies each of them. A piece that does not fit raises (ferry.ShapeError,
        DtypeError or NotFound) naming the target and the piece. Keep the tensors alive."""
        h = self.handle
        for target, (obj, pieces) in targets.items():
            what = "target '%s' piece" % target
            pieces = [Piece(str(p[0]), _lib.c_int_of(p[1], c_int, what + " dim"),
                            _lib.c_int_of(p[2], ctypes.c_int64, what + " start"),
                            _lib.c_int_of(p[3], ctypes.c_int64, what + " stop"))
                      for p in pieces]
            names = [_lib.encoded(p.source, "tensor name") for p in pieces]
            arr_c = (_PieceC * max(len(pieces), 1))(
                *[_PieceC(n, p.dim, p.start, p.stop) for n, p in zip(names, pieces)])
            desc, arr = as_buffer(obj, writable=True)
            ptr = arr.ctypes.data if arr.nbytes else ctypes.addressof(ctypes.c_char())
            rc = lib.ferry_refit_bind_pieces(h, _lib.encoded(target, "target name"), ptr,
                                             byref(desc), arr_c, len(pieces))
            if rc < 0:
                raise_status(rc)
            self._bound[target] = (obj, arr)
            self._pieces[target] = pieces

    @property
    def ranks(self) -> int:
        """How many sender ranks this receiver reads from: the world of a sharded sender group
        (RefitSender(rank=, world=)), 1 for a single sender."""
        return int(lib.ferry_refit_ranks(self.handle))

    @property
    def bytes_read(self) -> int:
        """Bytes this receiver read from the sender since it attached (a tensor-parallel rank that
        bound its shards reads about 1/world of the model per push)."""
        return int(lib.ferry_refit_bytes_read(self.handle))
