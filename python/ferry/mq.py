"""ferry.MQ: reliable publish/subscribe between the nodes of a fleet (ferry_mq_*, docs/MQ.md).

    with ferry.MQ(host_directory=True, name="learner") as mq:    # or MQ("ferry://host:7700")
        mq.subscribe("rollouts")
        topic, publisher, batch = mq.recv(timeout=10)           # numpy array, no copy
    with ferry.MQ(directory, name="actor-3") as mq:
        mq.wait_subscribers("rollouts", 1)
        mq.publish("rollouts", np.zeros((64, 4096), np.int32))  # dtype and shape travel along
        x = mq.loan((64, 4096), np.int32)                        # zero copy: build it in shm
        x[:] = 7
        mq.publish_loan("rollouts", x)                           # x is the mq's again

Messages are delivered to every subscriber, in order per publisher, and never dropped: a
publish to a subscriber whose queue is full waits, then raises ferry.Timeout naming it. Arrays
and tensors arrive with their dtype and shape; bytes arrive as bytes (a copy; like=memoryview:
a read-only view of the message, no copy). Received arrays (and memoryviews) are views of the
message's memory (the link's buffer, or the publisher's shared memory for large messages on one
host): the message is freed, and its credit returned to the publisher, when the last view of it
goes away (or at once with copy=True).
"""
import ctypes
import logging
import math
import queue
import re
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

from . import _lib
from ._lib import lib
from .errors import Busy, Timeout, check, raise_status
from .tensors import (DTYPES, Context, Like, NodeHandle, _ctx_for, _torch, as_buffer, from_bits,
                      like_name)

Handler = Callable[[str, str, Any], Any]

__all__ = ["MQ"]

MQ_HOST_DIRECTORY = 1
TOPIC_MAX = 128

c_int, c_uint32, c_uint64, c_size_t = ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_size_t
c_char_p, c_void_p, POINTER, byref = ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER, ctypes.byref


# The C structs and callback type this module passes (declared, with every prototype, in _lib)
MQOpts, Msg, MSG_FN = _lib.MQOpts, _lib.MQMsg, _lib.MQ_MSG_FN

_msg_free = lib.ferry_mq_msg_free


_ms = _lib.timeout_ms


def _topic(topic: Union[str, bytes]) -> Optional[bytes]:
    return _lib.encoded(topic, "topic")


class _Held:
    """Keeps one received message alive while views of its payload exist, and its MQ open:
    the C library frees a message into its mq, so MQ.close() waits for the last one."""

    def __init__(self, msg: Any, nbytes: int, owner: "MQ") -> None:
        self.buf = (ctypes.c_uint8 * max(nbytes, 1)).from_address(msg.contents.data or 0) \
            if msg.contents.data else (ctypes.c_uint8 * 1)()
        owner._hold()
        weakref.finalize(self.buf, _release, msg, owner)


def _release(msg: Any, owner: "MQ") -> None:
    _msg_free(msg)
    owner._unhold()


def _check_like(like: Any) -> str:
    """like_name(like), and "memoryview" for memoryview (a view of the message, no copy)."""
    return "memoryview" if like is memoryview or like == "memoryview" else like_name(like)


def _payload(msg: Any, like: Like, copy: bool, owner: "MQ",
             device: Optional[int] = None) -> Tuple[str, str, Any]:
    """(topic, publisher, payload) of a received message; takes ownership of msg. device: a CUDA
    ordinal: the payload is copied into a new tensor there (bytes as uint8), and the message is
    freed once that copy is done. A bytes message is bytes (copied out, the message freed at
    once), unless like=memoryview: a read-only view of the message (issue 35: it was always a
    memoryview, so a bytes publish did not come back as bytes)."""
    view = _check_like(like) == "memoryview"
    if device is None and not copy and not view and not msg.contents.is_tensor:
        copy = True
    topic, publisher, is_tensor, arr, code = _decode(msg, copy and device is None, owner)
    if device is not None:
        from .cuda import host_to_new_device
        return topic, publisher, host_to_new_device(np.asarray(arr), code if is_tensor else 2,
                                                    device, "numpy" if view else like)
    if not is_tensor:
        return topic, publisher, memoryview(arr) if view else bytes(arr)
    if view:
        return topic, publisher, memoryview(arr)
    return topic, publisher, from_bits(arr, code, like)


def _decode(msg: Any, copy: bool, owner: "MQ") -> Tuple[str, str, bool, Any, int]:
    """(topic, publisher, is_tensor, payload, dtype code): a tensor's payload is a numpy array of
    its bits, bytes' a read-only memoryview (copy: bytes); views keep the message alive."""
    m = msg.contents
    topic = m.topic.decode(errors="replace")
    publisher = m.publisher.decode(errors="replace")
    n = int(m.len)
    if copy or n == 0:
        raw = ctypes.string_at(m.data, n) if n else b""
        is_tensor, desc = m.is_tensor, m.desc
        shape = tuple(int(desc.shape[i]) for i in range(desc.ndim))
        code = int(desc.dtype)
        _msg_free(msg)
        if not is_tensor:
            return topic, publisher, False, raw, 0
        arr = np.frombuffer(bytearray(raw), dtype=DTYPES[code][1]).reshape(shape)
        return topic, publisher, True, arr, code
    held = _Held(msg, n, owner)
    arr = np.frombuffer(held.buf, dtype=np.uint8, count=n)  # keeps held.buf (and msg) alive
    if not m.is_tensor:
        arr.flags.writeable = False
        return topic, publisher, False, memoryview(arr), 0
    code = int(m.desc.dtype)
    shape = tuple(int(m.desc.shape[i]) for i in range(m.desc.ndim))
    return topic, publisher, True, arr.view(DTYPES[code][1]).reshape(shape), code


class MQ(NodeHandle):
    """A node's mq: publish and subscribe on topics.

    directory: the fleet's directory URL (ferry://HOST:PORT or redis://...); None:
    FERRY_DIRECTORY. host_directory=True runs the embedded directory in this node (peers reach
    it at `mq.directory`). name: this node's name (unique in the fleet; how subscribers see
    this publisher). queue_bytes: credit granted to each publisher (0: FERRY_MQ_QUEUE_BYTES).
    lease_ms: the directory lease (0: FERRY_LEASE_MS). transports, tcp_listen: the new
    context's (None: FERRY_TRANSPORTS, FERRY_TCP_LISTEN). ctx: an open ferry.Context to use
    (one mq per context); by default the process's default context, the node its store and
    refit receiver share (ferry.default_context), else (it has an mq already, or name,
    tcp_listen or transports ask for another node) a new one, closed with the mq.
    timeout: default seconds of each call (None: FERRY_TIMEOUT_MS)."""

    _what = "mq"

    def __init__(self, directory: Optional[str] = None, name: Optional[str] = None,
                 host_directory: bool = False, queue_bytes: int = 0, lease_ms: int = 0,
                 transports: Optional[str] = None, tcp_listen: Optional[str] = None,
                 ctx: Optional[Context] = None, timeout: Optional[float] = None) -> None:
        queue_bytes = _lib.c_int_of(queue_bytes, c_uint64, "queue_bytes")  # before any ctx
        lease_ms = _lib.c_int_of(lease_ms, c_int, "lease_ms", lo=0)
        _ms(timeout)  # the default timeout too
        if ctx is not None:
            # the C library refuses a second mq on one context (FERRY_EBUSY, saying so)
            self._ctx, self._owns_ctx, self._claimed = ctx, False, ctx._claim("mq")
        else:
            self._ctx, self._owns_ctx = _ctx_for("mq", name, tcp_listen, transports)
            self._claimed = True
        opts = MQOpts(ctypes.sizeof(MQOpts), _lib.encoded(directory, "directory"),
                      queue_bytes, lease_ms, MQ_HOST_DIRECTORY if host_directory else 0)
        h = c_void_p()
        rc = lib.ferry_mq_open(self._ctx.handle, byref(opts), byref(h))
        if rc < 0:
            try:
                raise_status(rc)
            finally:
                self._release_ctx()
        self._h = h.value
        self._lock = threading.RLock()  # re-entrant: messages' finalizers _unhold (ferry.tensors)
        self._held = 0  # received messages still viewed (_Held)
        self._closing = None  # the handle close() left for the last of them
        self._timeout = timeout
        self._callback = None
        self._general: Optional[Tuple[Handler, Like, bool]] = None  # set_callback's fn
        self._topic_fns: Dict[str, List[List[Any]]] = {}  # topic -> [[fn, once, like, copy]]
        self._pending: "queue.Queue[Any]" = queue.Queue()  # messages for recv() meanwhile
        self._loans = {}  # address -> bytes lent
        self.directory = "ferry://" + self._ctx.tcp_address if host_directory else directory

    # -- life --------------------------------------------------------------------------------
    def close(self) -> None:
        """Leaves the fleet (publishers drop this node, subscribers forget it). The handle is
        unusable from here on; while views of received messages are still alive (a payload
        kept, a traceback holding one), the C close waits for the last of them to go, so they
        stay readable and nothing is freed under them."""
        with self._lock:
            h, self._h = getattr(self, "_h", None), None
            if h and self._held:
                self._closing = h
                h = None
        if h:
            self._close_now(h)

    def _hold(self) -> None:
        with self._lock:
            self._held += 1

    def _unhold(self) -> None:
        with self._lock:
            self._held -= 1
            h = self._closing if self._held == 0 else None
            if h:
                self._closing = None
        if h:
            self._close_now(h)

    def _close_now(self, h: Any) -> None:
        lib.ferry_mq_close(h)
        self._callback = None
        self._topic_fns = {}
        self._general = None
        while True:  # messages taken for recv() that nobody read
            try:
                _msg_free(self._pending.get_nowait())
            except queue.Empty:
                break
        self._loans = {}  # the pool is gone with the mq
        self._release_ctx()

    def _release_ctx(self) -> None:
        if self._claimed:
            self._claimed = False
            self._ctx._release("mq")
        if self._owns_ctx:
            self._ctx.close()

    def _t(self, timeout: Optional[float]) -> int:
        return _ms(self._timeout if timeout is None else timeout)

    # -- topics ------------------------------------------------------------------------------
    def subscribe(self, topic: str, fn: Optional[Handler] = None, once: bool = False,
                  like: Like = "numpy", copy: bool = False,
                  timeout: Optional[float] = None) -> None:
        """Subscribes this node to topic: every publisher of it sends here from now on.

        fn: call fn(topic, publisher, payload) for each message of this topic (as DI-engine's
        subscribe(topic, fn, is_once) or pyzmq's on_recv), on the mq's background thread
        (one thread: calls never overlap); once=True: for the next message only, then the
        topic is unsubscribed. Several fns on one topic are called in order, with one payload
        (in the form the first one asked for). Without fn,
        messages of topic go to set_callback's fn or to recv(). like/copy: the payload's form,
        as in recv(). An exception in fn is logged to the "ferry" logger."""
        if fn is not None and not callable(fn):
            raise TypeError("ferry: fn must be callable fn(topic, publisher, payload), not %s"
                            % type(fn).__name__)
        _check_like(like)
        t = _topic(topic)
        if fn is not None:
            with self._lock:
                self._topic_fns.setdefault(t.decode(), []).append([fn, once, like, copy])
            self._install()
        check(lib.ferry_mq_subscribe(self.handle, t, self._t(timeout)))

    def unsubscribe(self, topic: str, timeout: Optional[float] = None) -> None:
        """Stops receiving topic: publishers drop this node, and the topic's fns (subscribe's
        fn) are forgotten."""
        t = _topic(topic)
        with self._lock:
            had = self._topic_fns.pop(t.decode(), None)
        if had:
            self._install()
        check(lib.ferry_mq_unsubscribe(self.handle, t, self._t(timeout)))

    def wait_subscribers(self, topic: str, n: int = 1, timeout: Optional[float] = None) -> None:
        """Waits (no polling) until n subscribers of topic are known; raises ferry.Timeout."""
        check(lib.ferry_mq_wait_subscribers(self.handle, _topic(topic),
                                            _lib.c_int_of(n, c_size_t, "subscribers"),
                                            self._t(timeout)))

    def subscribers(self, topic: str) -> int:
        """How many subscribers of topic this node knows now (0 for a topic it never
        published; wait_subscribers waits for a number)."""
        return int(lib.ferry_mq_subscribers(self.handle, _topic(topic)))

    # -- messages ----------------------------------------------------------------------------
    def publish(self, topic: str, payload: Any, timeout: Optional[float] = None) -> List[str]:
        """Sends payload to every subscriber of topic: bytes-like (bytes, bytearray,
        memoryview) as bytes, a numpy array or CPU tensor (torch, or anything with __dlpack__)
        as a tensor (dtype and shape travel along; read in place, copied once; a CUDA tensor,
        torch or __cuda_array_interface__, is read from the device after its producer's stream
        is synchronized, and the call returns once its bytes are copied). Anything else
        (a dict, a str) raises TypeError saying how to serialize it. Returns the names of
        subscribers found dead and dropped (the others got the message); raises ferry.Timeout
        when a subscriber's queue stayed full (then nobody got it)."""
        if isinstance(payload, str):
            raise TypeError("ferry: publish takes bytes or arrays, not str: pass "
                            "payload.encode()")
        t = _topic(topic)
        h = self.handle
        if isinstance(payload, (bytes, bytearray, memoryview)):
            mv = memoryview(payload).cast("B")
            buf = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes else None
            ptr = buf.ctypes.data if buf is not None else None
            rc = lib.ferry_mq_publish(h, t, ptr, mv.nbytes, self._t(timeout))
        else:
            desc, arr = as_buffer(payload)
            rc = lib.ferry_mq_publish_tensor(h, t, byref(desc), arr.ctypes.data if arr.size else None,
                                             self._t(timeout))
        return self._publish_result(rc)

    def _publish_result(self, rc: int) -> List[str]:
        if rc == -9:  # FERRY_EPEER: delivered to every live subscriber; some were dropped
            detail = (lib.ferry_last_error() or b"").decode(errors="replace")
            names = detail.split(" subscriber", 1)[-1].split(" gone")[0]  # "s 'a', 'b'"
            return re.findall(r"'([^']*)'", names) or [detail]
        check(rc)
        return []

    def loan(self, shape: Union[int, Iterable[int]], dtype: Any = np.uint8,
             timeout: Optional[float] = None) -> np.ndarray:
        """A writable numpy array of shape and dtype lent from this publisher's shared-memory
        pool (ferry_mq_loan; waits for room, raises ferry.Timeout). Build the message in it,
        then publish_loan(topic, array) sends it without a copy; or loan_free(array)."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        nbytes = _lib.c_int_of(math.prod(shape) * dtype.itemsize if min(shape, default=0) >= 0
                               else -1, c_size_t, "loan bytes of shape %s" % (shape,))
        ptr = c_void_p()
        check(lib.ferry_mq_loan(self.handle, nbytes, byref(ptr), self._t(timeout)))
        buf = (ctypes.c_uint8 * nbytes).from_address(ptr.value)
        arr = np.frombuffer(buf, dtype=np.uint8).view(dtype).reshape(shape)
        with self._lock:
            self._loans[ptr.value] = nbytes
        return arr

    def _take_loan(self, arr: np.ndarray) -> int:
        ptr = arr.ctypes.data if isinstance(arr, np.ndarray) else None
        with self._lock:
            nbytes = self._loans.pop(ptr, None)
        if nbytes is None or arr.nbytes != nbytes:
            if nbytes is not None:
                with self._lock:
                    self._loans[ptr] = nbytes
            raise ValueError("ferry.MQ: not an array returned by loan() (whole), or already "
                             "published or freed")
        arr.flags.writeable = False  # the mq's again: reused once subscribers are done
        return ptr

    def publish_loan(self, topic: str, arr: np.ndarray, as_bytes: bool = False,
                     timeout: Optional[float] = None) -> List[str]:
        """Publishes an array from loan() without copying it: subscribers on this host read it
        in place. As a tensor (dtype and shape travel along), or as bytes with as_bytes=True.
        Whatever happens the array is the mq's again: do not use it afterwards. Returns and
        raises as publish()."""
        t = _topic(topic)
        ptr = self._take_loan(arr)
        desc = None if as_bytes else byref(as_buffer(arr)[0])
        return self._publish_result(
            lib.ferry_mq_publish_loan(self.handle, t, desc, ptr, arr.nbytes, self._t(timeout)))

    def loan_free(self, arr: np.ndarray) -> None:
        """Gives back an array from loan() unpublished."""
        lib.ferry_mq_loan_free(self.handle, self._take_loan(arr))

    def recv(self, timeout: Optional[float] = None, like: Like = "numpy",
             copy: bool = False, device: Any = None) -> Tuple[str, str, Any]:
        """The next message as (topic, publisher, payload); raises ferry.Timeout. payload is a
        numpy array (like="torch": a tensor; like=<module with from_dlpack>: that framework's)
        for tensors, bytes for bytes; like=memoryview: a read-only memoryview of either. Arrays
        and memoryviews are views of the message (copy=True: copies, and the message is freed
        at once); bytes are a copy. Messages of topics that have a subscribe() fn never come
        here.

        device: "cpu" (default) or a CUDA device ("cuda:N", N, a torch.device): the payload is
        copied into a new tensor there (bytes as uint8): a torch CUDA tensor when torch
        (imported) has CUDA, else a ferry.DeviceArray; the copy is complete on return (ready
        on every stream) and the message is freed."""
        if _check_like(like) == "torch" and device is None:
            _torch(need=True)
        ordinal = None
        if device is not None:
            from .cuda import device_ordinal
            ordinal = device_ordinal(device)
        if ordinal is not None:
            from .cuda import _require_driver
            _require_driver("recv(device=%r)" % (device,))  # before a message is taken
        if self._general is not None:
            raise Busy(-17, "recv: a callback is installed (set_callback(None) first); "
                       "messages go to it")
        if self._callback is not None:  # the dispatcher takes messages: read what it left
            t = self._timeout if timeout is None else timeout
            try:
                msg = self._pending.get(timeout=t) if t is None or t > 0 else \
                    self._pending.get_nowait()
            except queue.Empty:
                raise Timeout(-4, "recv: no message in %g s" % t) from None
            return _payload(msg, like, copy, self, ordinal)
        try:
            msg = self._pending.get_nowait()  # left from a dispatcher since removed
            return _payload(msg, like, copy, self, ordinal)
        except queue.Empty:
            pass
        out = POINTER(Msg)()
        check(lib.ferry_mq_recv(self.handle, byref(out), self._t(timeout)))
        return _payload(out, like, copy, self, ordinal)

    def set_callback(self, fn: Optional[Handler], like: Like = "numpy",
                     copy: bool = False) -> None:
        """Calls fn(topic, publisher, payload) for every message of a topic without its own
        subscribe() fn, instead of recv, on the mq's background thread (one thread: calls
        never overlap). fn=None goes back to recv. An exception in fn is logged to the
        "ferry" logger and the message dropped."""
        _check_like(like)
        with self._lock:
            self._general = None if fn is None else (fn, like, copy)
        self._install()

    def _install(self) -> None:
        """Installs the dispatcher while any fn is registered, removes it when none is."""
        with self._lock:
            want = bool(self._topic_fns) or self._general is not None
        if not want:
            if self._callback is not None:
                check(lib.ferry_mq_set_callback(self.handle, MSG_FN(), None))
                self._callback = None
            return
        if self._callback is not None:
            return
        log = logging.getLogger("ferry")

        def dispatch(mq: Any, msg: Any, arg: Any) -> None:
            try:
                m = ctypes.cast(msg, POINTER(Msg))  # ours now: kept past this call if queued
                topic = m.contents.topic.decode(errors="replace")
                unsub = False
                with self._lock:
                    fns = list(self._topic_fns.get(topic, ()))
                    if fns:
                        keep = [e for e in fns if not e[1]]
                        if keep:
                            self._topic_fns[topic] = keep
                        else:
                            del self._topic_fns[topic]
                            unsub = True
                    general = self._general
                if fns:
                    if unsub:
                        threading.Thread(target=self._after_once, args=(topic,),
                                         daemon=True).start()
                    payload = _payload(m, fns[0][2], fns[0][3], self)  # one payload for all its fns
                    for fn, _, _, _ in fns:
                        try:
                            fn(*payload)
                        except Exception:
                            log.exception("ferry.MQ callback for %r failed", topic)
                elif general is not None:
                    general[0](*_payload(m, general[1], general[2], self))
                else:
                    self._pending.put(m)
            except Exception:
                log.exception("ferry.MQ callback failed")

        cb = MSG_FN(dispatch)
        check(lib.ferry_mq_set_callback(self.handle, cb, None))
        self._callback = cb  # C holds it until replaced: keep it alive

    def _after_once(self, topic: str) -> None:
        # a once-fn fired: the topic is unsubscribed (not from the callback thread, which
        # must not wait on the network) unless another fn was added meanwhile
        with self._lock:
            if topic in self._topic_fns or not self._h:
                return
        try:
            lib.ferry_mq_unsubscribe(self._h, topic.encode(), self._t(None))
            self._install()
        except Exception:
            pass
