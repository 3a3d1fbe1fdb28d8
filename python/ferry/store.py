"""ferry.Store: the peer-to-peer tensor store (ferry_store_*), with the method names and return
shapes of the p2p-store client engines use for routing replay (ferry.p2pstore has that client's
exact names and coroutine style).

Values go in as numpy arrays, CPU tensors of any framework (torch directly; anything with
__dlpack__ without a copy) or bytes; they come out as numpy arrays, torch tensors, bytes, or any
framework's tensors (like=module with from_dlpack), copied (get) or as read-only views of the
owner's memory (get_view)."""
import ctypes
import threading
import weakref
from typing import Any, Dict, Iterable, List, Optional, Union

import numpy as np

from . import _lib
from ._lib import lib
from .errors import NotFound, check, raise_status
from .tensors import (DTYPES, NP_DTYPES, Context, Like, NodeHandle, _ctx_for, as_buffer,
                      desc_shape, empty, from_bits, like_name)

__all__ = ["Store", "StoreView"]

Key = Union[str, bytes]

byref = ctypes.byref


_ms = _lib.timeout_ms


def _key(key: Key) -> Optional[bytes]:
    return _lib.encoded(key, "key")


_NO_BYTES = ctypes.c_char()  # where an empty value's data pointer points (never read)


class _Pin:
    """One ferry_store_view: the pin on the owner's bytes, dropped once (release())."""

    def __init__(self, store: "Store", view: int, info: Any) -> None:
        self.store, self.view, self._info = store, view, info  # info: the call's StoreInfo
        self.lock = threading.RLock()  # re-entrant: a view's finalizer releases (ferry.tensors)
        self.derived: List["weakref.ref[np.ndarray]"] = []  # arrays made from the view

    @property
    def info(self) -> Dict[str, Any]:
        """What the directory said (stat's dict), made when first asked for."""
        if not isinstance(self._info, dict):
            self._info = _info_dict(self._info)
        return self._info

    def valid(self) -> bool:
        with self.lock:
            return bool(self.view) and lib.ferry_store_view_valid(self.view) == 1

    def release(self) -> None:
        with self.lock:
            v, self.view = self.view, None
        if v:
            lib.ferry_store_view_release(v)
            self.store._unpin()


class StoreView(np.ndarray):
    """A read-only numpy array over an object's bytes where its owner keeps them (Store.get_view,
    Store.get(view=True)): no copy on one host, whatever the size.

    The version it shows is pinned while the view (or any array made from it: slices, reshapes)
    is alive: a re-put or delete of the key publishes a new version and leaves these bytes
    intact. Used as a context manager, leaving the block releases the pin (release()); read
    nothing from it afterwards (copy what you keep: np.array(view)).

    key, owner, generation: what the directory said; valid: whether the bytes are still the
    pinned version (False once an in-place owner took its memory back, see ferry.h)."""

    def __array_finalize__(self, obj: Any) -> None:
        # an array made from a view (slice, reshape, .view()) shares its memory: the pin
        # counts it, so that release() refuses while it is alive
        pin = self._pin()
        if pin is not None and obj is not None:
            pin.derived = [r for r in pin.derived if r() is not None]
            pin.derived.append(weakref.ref(self))

    def __array_wrap__(self, out: np.ndarray, context: Any = None, *args: Any) -> Any:
        # results of arithmetic own new memory: plain arrays, not views of the store
        if out.base is not None and self._pin() is not None and np.shares_memory(out, self):
            return out
        out = out.view(np.ndarray)
        return out[()] if out.ndim == 0 else out

    def __enter__(self) -> "StoreView":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _pin(self) -> Optional[_Pin]:
        b = self.base
        while b is not None and not hasattr(b, "_ferry_pin"):
            b = getattr(b, "base", None)
        return getattr(b, "_ferry_pin", None)

    def release(self) -> None:
        """Drops the pin now (idempotent). Raises BufferError, and keeps the pin, while other
        arrays made from this view still use its memory (the pin then goes with the last one)."""
        buf = self.base
        while buf is not None and not hasattr(buf, "_ferry_pin"):
            buf = getattr(buf, "base", None)
        if buf is None:
            return
        pin = buf._ferry_pin
        others = len([r for r in pin.derived if r() is not None and r() is not self])
        if others > 0:
            raise BufferError("ferry: %d other array(s) made from view '%s' still use its "
                              "memory; drop them (or copy: np.array(v)) before releasing" %
                              (others, pin.info["key"]))
        pin.release()

    @property
    def valid(self) -> bool:
        """True while the bytes are the version pinned at get_view time."""
        pin = self._pin()
        return pin is not None and pin.valid()

    @property
    def key(self) -> str:
        """The key this view was read from."""
        pin = self._pin()
        return pin.info["key"] if pin else ""

    @property
    def owner(self) -> str:
        """The node that holds the bytes."""
        pin = self._pin()
        return pin.info["owner"] if pin else ""

    @property
    def generation(self) -> int:
        """The version pinned."""
        pin = self._pin()
        return pin.info["generation"] if pin else 0


class _Malloced:
    """Owns a buffer libferry malloc'd (ferry_store_get_alloc) and frees it with the array."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        weakref.finalize(self.buf, _lib.libc.free, ptr)


def _info_dict(info: Any) -> Dict[str, Any]:
    code = info.desc.dtype
    return {"key": info.key.decode(errors="replace"), "owner": info.owner.decode(errors="replace"),
            "dtype": DTYPES.get(code, ("invalid", None))[0], "shape": desc_shape(info.desc),
            "bytes": int(info.bytes), "generation": int(info.generation)}


class Store(NodeHandle):
    """A node of a ferry store fleet.

    directory: the fleet's directory URL (ferry://HOST:PORT or redis://HOST:PORT[/DB]); None:
    FERRY_DIRECTORY. host_directory=True runs the embedded directory in this node instead; peers
    reach it at `store.directory`. name: this node's name (unique in the fleet). ctx: an open
    ferry.Context to use (one store per context); by default the process's default context when
    it has no store yet (so arrays from ferry.empty() are put in place), else a new one.
    capacity: bytes of this node's pool, where puts of ordinary memory are copied (0:
    FERRY_STORE_CAPACITY). lease_ms: the directory lease (0: FERRY_LEASE_MS). tcp_listen:
    HOST:PORT this node listens on (None: FERRY_TCP_LISTEN; peers on other hosts need a
    reachable one). holder=True: also hold objects put by short-lived nodes (as `ferry serve`).
    timeout: default seconds of each call (None: FERRY_TIMEOUT_MS). device_pool_bytes: bytes of
    this node's device pool, where puts from CUDA tensors stay in device memory and same-host
    gets into CUDA tensors copy device to device (0: FERRY_STORE_DEVICE_POOL_BYTES, default off;
    docs/GPU.md)."""

    _what = "store"

    def __init__(self, directory: Optional[str] = None, name: Optional[str] = None,
                 host_directory: bool = False, capacity: int = 0, lease_ms: int = 0,
                 tcp_listen: Optional[str] = None, ctx: Optional[Context] = None,
                 timeout: Optional[float] = None, holder: bool = False,
                 device_pool_bytes: int = 0) -> None:
        capacity = _lib.c_int_of(capacity, _lib.c_uint64, "capacity")  # before any ctx is made
        device_pool_bytes = _lib.c_int_of(device_pool_bytes, _lib.c_uint64, "device_pool_bytes")
        lease_ms = _lib.c_int_of(lease_ms, _lib.c_int, "lease_ms", lo=0)
        _ms(timeout)  # the default timeout too
        if ctx is not None:
            if not ctx._claim("store"):
                raise ValueError("ferry: this context already has a store")
            self._ctx, self._owns_ctx = ctx, False
        else:
            self._ctx, self._owns_ctx = _ctx_for("store", name, tcp_listen)
        flags = (_lib.STORE_HOST_DIRECTORY if host_directory else 0) | \
                (_lib.STORE_HOLDER if holder else 0)
        opts = _lib.StoreOpts(ctypes.sizeof(_lib.StoreOpts),
                              _lib.encoded(directory, "directory"),
                              capacity, lease_ms, flags, device_pool_bytes)
        h = ctypes.c_void_p()
        rc = lib.ferry_store_open(self._ctx.handle, byref(opts), byref(h))
        if rc < 0:
            try:
                raise_status(rc)
            finally:
                self._ctx._release("store")
                if self._owns_ctx:
                    self._ctx.close()
        self._h = h.value
        self._hv = h  # the handle as ctypes passes it: put's unchecked call
        self._timeout = timeout
        self._timeout_ms = _ms(timeout)
        self._lock = threading.RLock()  # re-entrant: views' finalizers _unpin (ferry.tensors)
        self._bufs = {}  # id(array) -> (weakref, layout, byref(desc), pointer, owned): _buffer_of
        # key -> value put in place (ferry memory): held until the key is deleted or replaced,
        # so that Python cannot free memory readers are reading
        self._published: Dict[bytes, Any] = {}
        self._published_mark = 64  # _drop_released when _published grows past this
        self._drop_released()  # from now on the store keeps what is released
        self._pins = 0  # store views alive (close waits for them)
        self._closing = False
        if host_directory:
            self.directory = "ferry://" + self._ctx.tcp_address
        else:
            self.directory = directory

    # -- life --------------------------------------------------------------------------------
    def close(self) -> None:
        """Removes this node's objects from the fleet and frees its pool. Idempotent. Views
        (get_view) still alive keep the node's memory mapped until they go."""
        with self._lock:
            h, self._h = getattr(self, "_h", None), None
            if not h:
                return
            self._published = {}
            self._closing = True
            busy = self._pins > 0
            self._closed_h = h
        if not busy:
            self._really_close()

    def _really_close(self) -> None:
        with self._lock:
            h, self._closed_h = getattr(self, "_closed_h", None), None
        if not h:
            return
        lib.ferry_store_close(h)
        self._ctx._release("store")
        if self._owns_ctx:
            self._ctx.close()

    def _unpin(self) -> None:
        with self._lock:
            self._pins -= 1
            last = self._pins == 0 and self._closing
        if last:
            self._really_close()

    def _t(self, timeout: Optional[float]) -> int:
        return _ms(self._timeout if timeout is None else timeout)

    # -- data --------------------------------------------------------------------------------
    def empty(self, shape: Union[int, Iterable[int]], dtype: Any, like: Like = "numpy") -> Any:
        """ferry.empty() in this store's context: a put of it publishes it in place (nothing is
        copied; the store keeps a reference to it until the key is deleted or replaced, here or
        by another node). Memory of keys deleted since is reused, its pages still mapped here
        and in the readers that read it (ferry_alloc_uninit): a routing-replay engine that
        makes a buffer per request pays no page faults for it after the first few."""
        self._drop_released()
        return empty(shape, dtype, like=like, ctx=self._ctx)

    def _drop_released(self) -> None:
        """Lets go of the values put in place whose keys were deleted since (by any node), so
        that their memory goes back to the context for reuse."""
        if not self._h:
            return
        out = ctypes.POINTER(_lib.StoreInfo)()
        n = ctypes.c_size_t()
        check(lib.ferry_store_released(self._h, byref(out), byref(n)))
        self._published_mark = 2 * len(self._published) + 64
        if not n.value:
            return
        try:
            keys = [out[i].key for i in range(n.value)]
        finally:
            lib.ferry_store_list_free(out)
        with self._lock:
            for k in keys:
                self._published.pop(k, None)

    def put(self, key: Key, value: Any, copy: bool = False,
            timeout: Optional[float] = None) -> None:
        """Publishes value under key, replacing any object of that key (readers get the old or
        the new one, never a mix).

        value: a numpy array; a CPU tensor of torch, or of any framework with __dlpack__
        (paddle, jax, cupy host arrays: taken without a copy); bytes, bytearray or memoryview
        (stored as uint8, read back with get(key, like=bytes)). Memory from ferry.empty() /
        store.empty() is published in place (keep it unmodified until the key is deleted or
        replaced; the store holds a reference so it cannot be freed meanwhile); anything else
        is copied once into this node's pool (copy=True: always). Raises TypeError naming what
        to pass for anything else (a dict, a list of str, an object array)."""
        # The common call first, with as few Python steps as can be: an engine re-putting a
        # routing buffer it just filled (megabytes) runs this with cold caches, where every
        # attribute, call and lock of the wrapper costs a few microseconds (_buffer_of).
        hit = self._bufs.get(id(value))
        if hit is not None and hit[0]() is value and \
                hit[1] == (value.shape, value.strides, value.dtype):
            desc, ptr, arr, owned = hit[2], hit[3], None, hit[4]
        else:
            desc, ptr, arr, owned = self._buffer_of(value)
        if type(key) is str and "\0" not in key and key.isascii():
            k = key.encode()
        else:
            k = _key(key)
        if not self._h:
            raise ValueError("ferry: %s is closed" % self._what)
        rc = _lib.store_put_unchecked(self._hv, k, desc, ptr, _lib.STORE_PUT_COPY if copy else 0,
                                      self._timeout_ms if timeout is None else _ms(timeout))
        if rc < 0:
            raise_status(rc)
        if owned is None:
            owned = self._ctx._owns(ptr.value)
        with self._lock:
            if owned and not copy:
                self._published[k] = value
                grown = len(self._published) > self._published_mark
            else:
                self._published.pop(k, None)
                grown = False
        if grown:  # keys other nodes deleted would hold their memory here for ever
            self._drop_released()
        del arr  # a contiguous copy of value, if as_buffer made one, lives until here

    def _buffer_of(self, value: Any) -> Any:
        """(byref(desc), data pointer as a c_void_p, array to keep alive, whether the data is
        this context's ferry memory or None: not known) for a put of value. A numpy array put
        before (engines reuse their routing buffers) is then found in a small cache, checked
        against the same object, shape, strides and dtype (put does that check itself): right
        after the caller filled megabytes, as_buffer, .ctypes.data and the ownership lookup
        cost tens of microseconds of cache and TLB misses. Whether an array's data is ferry
        memory cannot change while the array lives (it holds its block), so the cache keeps
        that too."""
        desc, arr = as_buffer(value)
        ptr = ctypes.c_void_p(arr.ctypes.data if arr.nbytes else ctypes.addressof(_NO_BYTES))
        if type(value) is not np.ndarray or arr is not value or not arr.nbytes:
            return byref(desc), ptr, arr, None
        cache = self._bufs
        if len(cache) >= 256:
            cache.clear()
        owned = self._ctx._owns(ptr.value)
        cache[id(value)] = (weakref.ref(value), (value.shape, value.strides, value.dtype),
                            byref(desc), ptr, owned)
        return byref(desc), ptr, arr, owned

    def get(self, key: Key, out: Any = None, like: Like = "numpy",
            timeout: Optional[float] = None, view: bool = False, device: Any = None) -> Any:
        """The object under key, copied into new memory: a numpy array; like="torch" (or the
        torch module): a torch tensor; like=bytes: bytes; like=<module with from_dlpack>
        (paddle, jax.numpy, cupy): that framework's tensor. out: read into that contiguous
        array/tensor of the object's dtype and shape instead, and return it (a CUDA tensor too:
        torch, or anything with __cuda_array_interface__). view=True: no copy, as
        get_view(key). bfloat16 and float8 objects come back as their bits (uint16/uint8) in
        numpy. Raises NotFound when there is no such key.

        device: "cpu" (default) or a CUDA device ("cuda", "cuda:N", N, a torch.device): a new
        tensor on that device holds the object: a torch CUDA tensor when torch (imported) has
        CUDA, else a ferry.DeviceArray (like="torch" insists on torch). Streams: ferry waits
        for torch's current stream of the device before writing out= or the new tensor (its
        allocator may hand out memory a kernel still reads), and its own copies are complete
        when get returns, so the tensor is ready on every stream (docs/GPU.md)."""
        if device is not None:
            from .cuda import device_ordinal
            ordinal = device_ordinal(device)
            if ordinal is not None:
                if out is not None or view:
                    raise ValueError("ferry: get(device=%r) makes a new tensor: pass device= "
                                     "or out=/view=, not both" % (device,))
                return self._get_to_device(key, ordinal, like, timeout)
        if view:
            if out is not None:
                raise ValueError("ferry: get(view=True) reads in place: pass out= or view=, "
                                 "not both")
            return self.get_view(key, like=like, timeout=timeout)
        like_name(like)  # a bad like= fails before anything is read
        k = _key(key)
        info = _lib.StoreInfo()
        info.size = ctypes.sizeof(info)
        if out is not None:
            desc, arr = as_buffer(out, writable=True)
            ptr = arr.ctypes.data if arr.nbytes else ctypes.addressof(ctypes.c_char())
            check(lib.ferry_store_get(self.handle, k, byref(desc), ptr, arr.nbytes, byref(info),
                                      self._t(timeout)))
            return out
        p = ctypes.c_void_p()
        check(lib.ferry_store_get_alloc(self.handle, k, byref(p), byref(info), self._t(timeout)))
        code, shape = info.desc.dtype, desc_shape(info.desc)
        npdt = NP_DTYPES[code]
        if info.bytes == 0 or not p.value:
            if p.value:
                _lib.libc.free(p.value)
            arr = np.empty(shape, dtype=npdt)
        else:
            owner = _Malloced(p.value, int(info.bytes))
            arr = np.frombuffer(owner.buf, dtype=npdt).reshape(shape)
        return from_bits(arr, code, like)

    def _get_to_device(self, key: Key, device: int, like: Like, timeout: Optional[float]) -> Any:
        """get(key, device=...): the object's description first, a tensor of that dtype and shape
        on the device, then a get into it. An object replaced by one of another dtype or shape
        between the two is described again (a few times: a key rewritten that often with
        changing shapes is a caller's race to fix)."""
        from .cuda import new_on_device
        from .errors import DtypeError, OutOfBounds, ShapeError
        like_name(like)
        for attempt in range(4):
            info = self.stat(key, timeout=timeout)
            if info is None:
                raise NotFound(-5, "get '%s': no such key" % key)
            code = [c for c, (n, _) in DTYPES.items() if n == info["dtype"]][0]
            out = new_on_device(info["shape"], code, device, like)
            try:
                return self.get(key, out=out, timeout=timeout)
            except (DtypeError, ShapeError, OutOfBounds):
                if attempt == 3:
                    raise
        raise AssertionError("unreachable")

    def get_view(self, key: Key, like: Like = "numpy", timeout: Optional[float] = None) -> Any:
        """A read-only ferry.StoreView (a numpy array) over the object's bytes where its owner
        keeps them: on one host nothing is copied, whatever the size (across hosts: one read
        into a private copy). The version is pinned while the view, or any array made from it,
        is alive; `with store.get_view(k) as v:` releases it when the block ends. like="torch"
        gives a tensor over the same memory (do not write it; the pin goes with the tensor).
        Raises NotFound when there is no such key."""
        kind = like_name(like)
        if kind not in ("numpy", "torch"):
            raise ValueError("ferry: get_view gives numpy arrays or torch tensors (read-only "
                             "memory cannot go through DLPack): use get(key, like=...) for a "
                             "copy")
        info = _lib.StoreInfo()
        info.size = ctypes.sizeof(info)
        data, v = ctypes.c_void_p(), ctypes.c_void_p()
        with self._lock:
            h = self.handle
            self._pins += 1
        try:
            check(lib.ferry_store_get_view(h, _key(key), byref(data), byref(info), byref(v),
                                           self._t(timeout)))
        except BaseException:
            self._unpin()
            raise
        pin = _Pin(self, v.value, info)
        code, shape = info.desc.dtype, desc_shape(info.desc)
        npdt = NP_DTYPES[code]
        nbytes = info.bytes
        buf = (ctypes.c_uint8 * max(nbytes, 1)).from_address(data.value)
        buf._ferry_pin = pin
        weakref.finalize(buf, pin.release)
        # the array's base is buf itself, and so is that of every array made from it (numpy
        # collapses the chain): release() counts them through buf's references
        arr = StoreView.__new__(StoreView, shape, dtype=npdt, buffer=buf)
        arr.flags.writeable = False
        return arr if kind == "numpy" else from_bits(arr, code, like)

    def get_batch(self, keys: Iterable[Key], like: Like = "numpy",
                  timeout: Optional[float] = None, device: Any = None) -> List[Any]:
        """The objects under keys, in order, with their reads in flight together; None for a
        key that does not exist. Other failures raise. device: as get()'s (each object in a new
        tensor on that CUDA device)."""
        ordinal = None
        if device is not None:
            from .cuda import device_ordinal
            ordinal = device_ordinal(device)
        keys = list(keys)
        infos, results = [], [None] * len(keys)
        items = (_lib.StoreItem * len(keys))()
        live = []
        for i, key in enumerate(keys):
            info = self.stat(key, timeout=timeout)
            if info is None:
                continue
            code = [c for c, (n, _) in DTYPES.items() if n == info["dtype"]][0]
            if ordinal is None:
                arr = np.empty(info["shape"], dtype=DTYPES[code][1])
                dst = arr
            else:
                from .cuda import new_on_device
                arr = new_on_device(info["shape"], code, ordinal, like)
                dst = as_buffer(arr, writable=True)[1]  # torch's stream synchronized
            items[len(live)].key = _key(key)
            items[len(live)].dst = dst.ctypes.data if dst.nbytes else None
            items[len(live)].cap = dst.nbytes
            live.append((i, arr, code))
            infos.append(info)
        if not live:
            return results
        lib.ferry_store_get_batch(self.handle, items, len(live), self._t(timeout))
        for j, (i, arr, code) in enumerate(live):
            st = items[j].status
            if st == -5:  # deleted between stat and read
                continue
            if st < 0:
                # the item's status has no detail of its own; name the key (and its owner)
                from .errors import _BY_CODE, Error
                raise _BY_CODE.get(st, Error)(st, "get_batch '%s' (owner '%s')"
                                              % (keys[i], infos[j]["owner"]))
            results[i] = from_bits(arr, code, like) if ordinal is None else arr
        return results

    # -- keys --------------------------------------------------------------------------------
    def stat(self, key: Key, timeout: Optional[float] = None) -> Optional[Dict[str, Any]]:
        """The object's description as a dict (key, owner, dtype, shape, bytes, generation),
        or None when there is no such key."""
        info = _lib.StoreInfo()
        info.size = ctypes.sizeof(info)
        rc = lib.ferry_store_stat(self.handle, _key(key), byref(info), self._t(timeout))
        if rc == -5:
            return None
        check(rc)
        return _info_dict(info)

    def exists(self, key: Key, timeout: Optional[float] = None) -> bool:
        """True when key exists anywhere in the fleet (one directory lookup, no data read)."""
        return check(lib.ferry_store_exists(self.handle, _key(key), self._t(timeout))) == 1

    def delete(self, key: Key, timeout: Optional[float] = None) -> bool:
        """True when key was deleted, False when there was no such key."""
        k = _key(key)
        rc = lib.ferry_store_delete(self.handle, k, self._t(timeout))
        with self._lock:
            self._published.pop(k, None)
        if rc == -5:
            return False
        check(rc)
        return True

    def delete_batch(self, keys: Iterable[Key], timeout: Optional[float] = None) -> Dict[Key, bool]:
        """{key: True if deleted, False if it did not exist}; other failures raise."""
        return {key: self.delete(key, timeout=timeout) for key in keys}

    def delete_prefix(self, prefix: Key, timeout: Optional[float] = None) -> int:
        """Deletes every key starting with prefix; returns how many."""
        n = ctypes.c_size_t()
        p = _key(prefix)
        check(lib.ferry_store_delete_prefix(self.handle, p, byref(n), self._t(timeout)))
        self._forget(p)
        return n.value

    def delete_prefix_batch(self, prefixes: Iterable[Key],
                            timeout: Optional[float] = None) -> Dict[Key, int]:
        """{prefix: how many keys starting with it were deleted}; failures raise."""
        return {p: self.delete_prefix(p, timeout=timeout) for p in prefixes}

    def _forget(self, prefix: bytes) -> None:
        with self._lock:
            for k in [k for k in self._published if k.startswith(prefix)]:
                del self._published[k]

    def list(self, prefix: Key = "", detail: bool = False,
             timeout: Optional[float] = None) -> List[Any]:
        """The keys starting with prefix, sorted (detail=True: stat() dicts instead)."""
        out = ctypes.POINTER(_lib.StoreInfo)()
        n = ctypes.c_size_t()
        check(lib.ferry_store_list(self.handle, _key(prefix or ""), byref(out), byref(n),
                                   self._t(timeout)))
        try:
            infos = [out[i] for i in range(n.value)]
            res = [_info_dict(x) if detail else x.key.decode(errors="replace") for x in infos]
        finally:
            lib.ferry_store_list_free(out)
        return res

    def clear(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Deletes every object of the fleet: {"success": bool, "cleared": n, "failed": n}
        (and "error" when it failed)."""
        n = ctypes.c_size_t()
        rc = lib.ferry_store_clear(self.handle, byref(n), self._t(timeout))
        self._forget(b"")
        if rc >= 0:
            return {"success": True, "cleared": n.value, "failed": 0}
        err = (lib.ferry_last_error() or b"").decode(errors="replace")
        try:
            left = len(self.list("", timeout=timeout))
        except Exception:
            left = -1
        return {"success": False, "cleared": 0, "failed": left,
                "error": err}
