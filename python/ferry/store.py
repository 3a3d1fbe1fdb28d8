"""ferry.Store: the peer-to-peer tensor store (ferry_store_*), with the method names and return
shapes of the p2p-store client engines use for routing replay, so switching is one line."""
import ctypes
import threading
import weakref

import numpy as np

from . import _lib
from ._lib import lib
from .errors import NotFound, check, raise_status
from .tensors import DTYPES, NodeHandle, _ctx_for_store, as_buffer, desc_shape, empty, from_bits

__all__ = ["Store"]

byref = ctypes.byref


_ms = _lib.timeout_ms


def _key(key):
    return _lib.encoded(key, "key")


class _Malloced:
    """Owns a buffer libferry malloc'd (ferry_store_get_alloc) and frees it with the array."""

    def __init__(self, ptr, nbytes):
        self.buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        weakref.finalize(self.buf, _lib.libc.free, ptr)


def _info_dict(info):
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
    timeout: default seconds of each call (None: FERRY_TIMEOUT_MS)."""

    _what = "store"

    def __init__(self, directory=None, name=None, host_directory=False, capacity=0,
                 lease_ms=0, tcp_listen=None, ctx=None, timeout=None, holder=False):
        if ctx is not None:
            self._ctx, self._owns_ctx = ctx, False
        else:
            self._ctx, self._owns_ctx = _ctx_for_store(name, tcp_listen)
        if self._ctx._has_store:
            raise ValueError("ferry: this context already has a store")
        flags = (_lib.STORE_HOST_DIRECTORY if host_directory else 0) | \
                (_lib.STORE_HOLDER if holder else 0)
        opts = _lib.StoreOpts(ctypes.sizeof(_lib.StoreOpts),
                              _lib.encoded(directory, "directory"),
                              int(capacity), int(lease_ms), flags)
        h = ctypes.c_void_p()
        rc = lib.ferry_store_open(self._ctx.handle, byref(opts), byref(h))
        if rc < 0:
            try:
                raise_status(rc)
            finally:
                if self._owns_ctx:
                    self._ctx.close()
        self._h = h.value
        self._ctx._has_store = True
        self._timeout = timeout
        self._lock = threading.Lock()
        self._bufs = {}  # id(array) -> (weakref, layout, byref(desc), pointer): _buffer_of
        if host_directory:
            self.directory = "ferry://" + self._ctx.tcp_address
        else:
            self.directory = directory

    # -- life --------------------------------------------------------------------------------
    def close(self):
        """Removes this node's objects from the fleet and frees its pool. Idempotent."""
        with self._lock:
            h, self._h = getattr(self, "_h", None), None
        if not h:
            return
        lib.ferry_store_close(h)
        self._ctx._has_store = False
        if self._owns_ctx:
            self._ctx.close()

    def _t(self, timeout):
        return _ms(self._timeout if timeout is None else timeout)

    # -- data --------------------------------------------------------------------------------
    def empty(self, shape, dtype, like="numpy"):
        """ferry.empty() in this store's context: a put of it publishes it in place."""
        return empty(shape, dtype, like=like, ctx=self._ctx)

    def put(self, key, value, copy=False, timeout=None):
        """Publishes a numpy array or CPU torch tensor under key, replacing any object of that
        key. Memory from ferry.empty() is published in place (keep it unmodified until the key
        is deleted or replaced); anything else is copied once into this node's pool."""
        desc, ptr, arr = self._buffer_of(value)
        flags = _lib.STORE_PUT_COPY if copy else 0
        check(lib.ferry_store_put(self.handle, _key(key), desc, ptr, flags, self._t(timeout)))
        del arr  # a contiguous copy of value, if as_buffer made one, lives until here

    def _buffer_of(self, value):
        """(byref(desc), data pointer, array to keep alive) for a put of value. A numpy array
        put before (engines reuse their routing buffers) comes from a small cache, checked
        against the same object, shape, strides and dtype: right after the caller filled
        megabytes, as_buffer and .ctypes.data cost ~20 us of cache and TLB misses."""
        cache = self._bufs
        if type(value) is np.ndarray:
            hit = cache.get(id(value))
            if hit is not None and hit[0]() is value and \
                    hit[1] == (value.shape, value.strides, value.dtype):
                return hit[2], hit[3], None
        desc, arr = as_buffer(value)
        ptr = arr.ctypes.data if arr.nbytes else ctypes.addressof(ctypes.c_char())
        if type(value) is np.ndarray and arr is value and arr.nbytes:
            if len(cache) >= 256:
                cache.clear()
            cache[id(value)] = (weakref.ref(value), (value.shape, value.strides, value.dtype),
                                byref(desc), ptr)
        return byref(desc), ptr, arr

    def get(self, key, out=None, like="numpy", timeout=None):
        """The object under key as a new numpy array (like="torch": a torch tensor), or read
        into `out` (a contiguous array/tensor of the object's dtype and shape), which is
        returned. bfloat16 and float8 objects come back as their bits (uint16/uint8) in numpy.
        Raises NotFound when there is no such key."""
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
        npdt = np.dtype(DTYPES[code][1])
        if info.bytes == 0 or not p.value:
            if p.value:
                _lib.libc.free(p.value)
            arr = np.empty(shape, dtype=npdt)
        else:
            owner = _Malloced(p.value, int(info.bytes))
            arr = np.frombuffer(owner.buf, dtype=npdt).reshape(shape)
        return from_bits(arr, code, like)

    def get_batch(self, keys, like="numpy", timeout=None):
        """The objects under keys, in order, with their reads in flight together; None for a
        key that does not exist. Other failures raise."""
        keys = list(keys)
        infos, results = [], [None] * len(keys)
        items = (_lib.StoreItem * len(keys))()
        live = []
        for i, key in enumerate(keys):
            info = self.stat(key, timeout=timeout)
            if info is None:
                continue
            code = [c for c, (n, _) in DTYPES.items() if n == info["dtype"]][0]
            arr = np.empty(info["shape"], dtype=DTYPES[code][1])
            items[len(live)].key = _key(key)
            items[len(live)].dst = arr.ctypes.data if arr.nbytes else None
            items[len(live)].cap = arr.nbytes
            live.append((i, arr, code))
        if not live:
            return results
        lib.ferry_store_get_batch(self.handle, items, len(live), self._t(timeout))
        for j, (i, arr, code) in enumerate(live):
            st = items[j].status
            if st == -5:  # deleted between stat and read
                continue
            if st < 0:
                # the item's status has no detail of its own; name the key
                from .errors import _BY_CODE, Error
                raise _BY_CODE.get(st, Error)(st, "get_batch '%s'" % keys[i])
            results[i] = from_bits(arr, code, like)
        return results

    # -- keys --------------------------------------------------------------------------------
    def stat(self, key, timeout=None):
        """The object's description as a dict (key, owner, dtype, shape, bytes, generation),
        or None when there is no such key."""
        info = _lib.StoreInfo()
        info.size = ctypes.sizeof(info)
        rc = lib.ferry_store_stat(self.handle, _key(key), byref(info), self._t(timeout))
        if rc == -5:
            return None
        check(rc)
        return _info_dict(info)

    def exists(self, key, timeout=None):
        return check(lib.ferry_store_exists(self.handle, _key(key), self._t(timeout))) == 1

    def delete(self, key, timeout=None):
        """True when key was deleted, False when there was no such key."""
        rc = lib.ferry_store_delete(self.handle, _key(key), self._t(timeout))
        if rc == -5:
            return False
        check(rc)
        return True

    def delete_batch(self, keys, timeout=None):
        """{key: True if deleted, False if it did not exist}; other failures raise."""
        return {key: self.delete(key, timeout=timeout) for key in keys}

    def delete_prefix(self, prefix, timeout=None):
        """Deletes every key starting with prefix; returns how many."""
        n = ctypes.c_size_t()
        check(lib.ferry_store_delete_prefix(self.handle, _key(prefix), byref(n),
                                            self._t(timeout)))
        return n.value

    def list(self, prefix="", detail=False, timeout=None):
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

    def clear(self, timeout=None):
        """Deletes every object of the fleet: {"success": bool, "cleared": n, "failed": n}."""
        n = ctypes.c_size_t()
        rc = lib.ferry_store_clear(self.handle, byref(n), self._t(timeout))
        if rc >= 0:
            return {"success": True, "cleared": n.value, "failed": 0}
        err = (lib.ferry_last_error() or b"").decode(errors="replace")
        try:
            left = len(self.list("", timeout=timeout))
        except Exception:
            left = -1
        return {"success": False, "cleared": 0, "failed": left,
                "error": err}
