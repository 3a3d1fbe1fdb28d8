"""The Python surface as users meet it: bytes, DLPack, like=, zero-copy views, the p2pstore
drop-in, mq per-topic callbacks and asyncio, errors that say what to pass, docstrings, numpy 2."""
import asyncio
import gc
import inspect
import os
import pydoc
import re
import threading

import numpy as np
import pytest

import ferry
from ferry.p2pstore import P2PClient, P2PConfig

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

PKG = os.path.dirname(os.path.abspath(ferry.__file__))


@pytest.fixture(scope="module")
def store():
    s = ferry.Store(host_directory=True, name="py-api", capacity=64 << 20, timeout=5)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def clean(store):
    yield
    store.clear()


def test_bytes_round_trip(store):
    store.put("b", b"hello")
    assert store.get("b", like=bytes) == b"hello"
    got = store.get("b")
    assert got.dtype == np.uint8 and got.tobytes() == b"hello"
    store.put("b0", b"")
    assert store.get("b0", like=bytes) == b""
    store.put("ba", bytearray(b"xy"))
    store.put("mv", memoryview(b"abcdef")[::2])
    assert store.get("mv", like=bytes) == b"ace"


def test_errors_say_what_to_pass(store):
    for bad, word in (({"a": 1}, "json.dumps"), (np.array(["x"]), "bytes"),
                      (np.array([object()]), "bytes"), ("text", "json.dumps")):
        with pytest.raises(TypeError) as e:
            store.put("bad", bad)
        assert "pass" in str(e.value) and word in str(e.value)
    assert not store.exists("bad")
    with pytest.raises(ValueError) as e:
        store.get("nope", like="pandas")
    assert "from_dlpack" in str(e.value)


class Foreign:
    """A tensor of another framework: only the DLPack protocol (as paddle, jax, cupy)."""

    def __init__(self, arr):
        self.arr = arr

    def __dlpack__(self, stream=None):
        return self.arr.__dlpack__()

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


class FakeGPU(Foreign):
    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA


def test_dlpack_in_without_copy_and_out_to_any_module(store):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    desc, arr = ferry.tensors.as_buffer(Foreign(a))
    assert arr.ctypes.data == a.ctypes.data  # the same memory: no copy
    store.put("dl", Foreign(a))
    assert np.array_equal(store.get("dl"), a)
    assert np.array_equal(store.get("dl", like=np), a)  # any module with from_dlpack
    with pytest.raises(ferry.NotSupported) as e:
        store.put("gpu", FakeGPU(a))
    assert "cpu()" in str(e.value)


@pytest.mark.skipif(torch is None, reason="needs torch (python3-torch)")
def test_torch_through_modules(store):
    t = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    store.put("t", t)
    got = store.get("t", like=torch)
    assert isinstance(got, torch.Tensor) and torch.equal(got, t)
    store.put("np", np.arange(4.0))
    assert torch.equal(store.get("np", like="torch"), torch.arange(4.0, dtype=torch.float64))


def test_view_is_read_only_pinned_and_released(store):
    a = np.arange(1 << 16, dtype=np.int64)
    store.put("v", a)
    v = store.get_view("v")
    assert isinstance(v, ferry.StoreView) and not v.flags.writeable
    assert v.key == "v" and v.owner == "py-api" and v.valid
    assert np.array_equal(v, a)
    with pytest.raises(ValueError):
        v[0] = 1
    store.put("v", np.zeros(3))  # a new version; the pinned one stays intact
    assert np.array_equal(v, a) and v.valid
    part = v[10:20]
    with pytest.raises(BufferError):
        v.release()
    assert np.array_equal(part, a[10:20])
    del part
    v.release()
    v.release()  # idempotent
    assert not v.valid
    with store.get(key="v", view=True) as w:
        assert w.shape == (3,) and w.generation == store.stat("v")["generation"]
    assert not w.valid
    assert type(w + 1) is np.ndarray and isinstance(w.sum(), np.floating)
    with pytest.raises(ferry.NotFound):
        store.get_view("nope")
    assert store._pins == 0


def test_view_pin_goes_with_the_last_array(store):
    store.put("g", np.ones(100))
    v = store.get_view("g")
    assert store._pins == 1
    del v
    gc.collect()
    assert store._pins == 0


def test_in_place_put_holds_memory_until_deleted(store):
    buf = store.empty((1000,), np.int32)
    buf[:] = 7
    store.put("held", buf)
    ref = buf.base
    del buf
    gc.collect()
    assert store._published  # the store keeps it: readers never see freed memory
    assert np.array_equal(store.get("held"), np.full(1000, 7, np.int32))
    store.delete("held")
    assert not store._published
    del ref


def test_delete_prefix_batch(store):
    for k in ("a1", "a2", "b1", "c1"):
        store.put(k, np.zeros(1))
    assert store.delete_prefix_batch(["a", "b", "zz"]) == {"a": 2, "b": 1, "zz": 0}
    assert store.list() == ["c1"]


def test_p2pstore_drop_in(store):
    with pytest.raises(ValueError):
        P2PConfig(metadata_server="http://127.0.0.1:1")
    with pytest.raises(TypeError):
        P2PClient({"metadata_server": store.directory})
    cfg = P2PConfig(metadata_server=store.directory.replace("ferry://", ""), name="py-p2p")
    assert cfg.metadata_server == store.directory
    client = P2PClient(cfg)
    try:
        ids = np.arange(12, dtype=np.int32).reshape(3, 4)
        assert asyncio.run(client.put("r_0", ids)) is True
        assert asyncio.run(client.put("r_1", ids.tobytes())) is True
        assert asyncio.run(client.put("q_0", ids)) is True
        assert np.array_equal(asyncio.run(client.get("r_0")), ids)
        assert asyncio.run(client.get("r_1", like=bytes)) == ids.tobytes()
        assert asyncio.run(client.get("none")) is None
        assert store.stat("r_0")["owner"] == "py-p2p"

        async def more():
            d = await client.delete("q_0")
            missing = await client.delete("q_0")
            batch = await client.delete_batch(["r_0", "x"])
            return d, missing, batch, await client.delete_prefix_batch(["r_"])

        assert asyncio.run(more()) == (True, False, {"r_0": True, "x": False}, {"r_": 1})
        asyncio.run(client.put("c", b"1"))
        assert asyncio.run(client.clear()) == {"success": True, "cleared": 1, "failed": 0}
    finally:
        client.close()


def test_mq_topic_callbacks_once_and_asyncio():
    sub = ferry.MQ(host_directory=True, name="py-api-sub", timeout=10)
    pub = ferry.MQ(sub.directory, name="py-api-pub", timeout=10)
    try:
        got, done = [], threading.Event()
        sub.subscribe("x", lambda t, p, m: (got.append(("x", p, bytes(m))), done.set()))
        sub.subscribe("one", lambda t, p, m: got.append(("one", p, m.tolist())), once=True)
        sub.subscribe("plain")
        for t in ("x", "one", "plain"):
            pub.wait_subscribers(t, 1)
        pub.publish("one", np.arange(3))
        pub.publish("one", np.arange(4))  # after the once-fn: unsubscribed, or left for recv
        pub.publish("plain", b"r")
        pub.publish("x", b"hi")
        # the second "one" message may come before the once-fn's unsubscribe took effect: then
        # it is left for recv, ahead of "plain"
        topic, publisher, payload = sub.recv(timeout=10)
        if topic == "one":
            assert payload.tolist() == [0, 1, 2, 3]
            topic, publisher, payload = sub.recv(timeout=10)
        assert (topic, publisher, bytes(payload)) == ("plain", "py-api-pub", b"r")
        assert done.wait(10)
        assert got[:2] == [("one", "py-api-pub", [0, 1, 2]), ("x", "py-api-pub", b"hi")]
        with pytest.raises(TypeError) as e:
            pub.publish("x", {"a": 1})
        assert "json.dumps" in str(e.value)
        with pytest.raises(TypeError):
            sub.subscribe("y", fn="not callable")

        async def aio():
            asub = ferry.aio.MQ(pub.directory, name="py-api-asub", timeout=10)
            try:
                await asub.subscribe("a")
                await asyncio.get_running_loop().run_in_executor(
                    None, pub.wait_subscribers, "a", 1)
                apub = ferry.aio.MQ.__new__(ferry.aio.MQ)
                apub.sync = pub
                await apub.publish("a", b"async")
                t, p, m = await asub.recv(timeout=10, like=bytes)
                return t, m
            finally:
                await asub.close()

        assert asyncio.run(aio()) == ("a", b"async")
    finally:
        pub.close()
        sub.close()


REMOVED_IN_NUMPY_2 = [r"np\.float_\b", r"np\.complex_\b", r"np\.product\(", r"np\.cumproduct\(",
                      r"np\.alltrue\(", r"np\.sometrue\(", r"np\.row_stack\(", r"np\.trapz\(",
                      r"np\.NaN\b", r"np\.Inf\b", r"np\.NINF\b", r"np\.PINF\b", r"np\.asfarray\(",
                      r"np\.find_common_type\(", r"np\.cast\b", r"\.newbyteorder\(",
                      r"np\.core\.", r"numpy\.core\.", r"np\.unicode_\b", r"np\.string_\b",
                      r"np\.in1d\(", r"copy=False", r"np\.msort\(", r"np\.round_\("]


def test_no_numpy_1_only_api():
    """numpy 2 removed these (and np.array(copy=False) raises where a copy is needed): the
    package must use none of them. (numpy 2 itself is not installable on Debian 12.)"""
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(PKG, f) for f in os.listdir(PKG) if f.endswith(".py")]
    files += [os.path.join(here, f) for f in os.listdir(here) if f.endswith(".py")]
    assert len(files) > 10
    pattern = re.compile("|".join(REMOVED_IN_NUMPY_2))
    hits = []
    for path in files:
        if os.path.basename(path) == os.path.basename(__file__):
            continue
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if pattern.search(line):
                    hits.append("%s:%d: %s" % (path, n, line.strip()))
    assert hits == []


MODULES = ("ferry", "ferry.store", "ferry.mq", "ferry.p2pstore", "ferry.aio", "ferry.tensors",
           "ferry.control", "ferry.refit", "ferry.stats", "ferry.errors")


def _public_api():
    """(name, object) for every public name of ferry.__all__ and of its modules' __all__, and
    every public method and property of those classes (the ones they inherit from ferry's own
    classes too; __init__ counts, for its annotations)."""
    out = []
    for mod_name in MODULES:
        mod = __import__(mod_name, fromlist=["_"])
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.ismodule(obj) or not (inspect.isclass(obj) or callable(obj)):
                continue  # a module (listed above), library_path, DTYPES, STATES
            out.append(("%s.%s" % (mod_name, name), obj))
            if not inspect.isclass(obj):
                continue
            for klass in obj.__mro__:
                if not klass.__module__.startswith("ferry"):
                    continue
                for attr, member in vars(klass).items():
                    if attr.startswith("_") and attr != "__init__":
                        continue
                    if isinstance(member, property):
                        member = member.fget
                    if inspect.isfunction(member):
                        out.append(("%s.%s.%s" % (mod_name, name, attr), member))
    return out


def test_public_api_has_docstrings_and_annotations():
    """help(ferry.X) reads as a reference: every public name has its own docstring (not only
    one it inherits) and full annotations (every parameter but self, and the return)."""
    api = _public_api()
    assert len(api) > 150
    no_doc, no_types = [], []
    for name, obj in api:
        own = vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__
        if not name.endswith(".__init__") and not (own and own.strip()):
            no_doc.append(name)
        if inspect.isclass(obj) and not obj.__module__.startswith("ferry"):
            continue
        func = obj.__init__ if inspect.isclass(obj) else obj
        if not (inspect.isfunction(func) or inspect.ismethod(func)):
            continue  # a class without its own __init__ (an error, a namedtuple)
        sig = inspect.signature(func)
        missing = [p.name for p in sig.parameters.values()
                   if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
        if sig.return_annotation is inspect.Signature.empty:
            missing.append("return")
        if missing:
            no_types.append("%s (%s)" % (name, ", ".join(missing)))
    assert no_doc == [], "no docstring: " + ", ".join(no_doc)
    assert no_types == [], "not annotated: " + ", ".join(no_types)


def test_typed_package():
    assert os.path.exists(os.path.join(PKG, "py.typed"))
    text = pydoc.render_doc(ferry.Store, renderer=pydoc.plaintext)
    # one line per signature up to python 3.12, one line per parameter from 3.13
    flat = re.sub(r"\(\s+", "(", re.sub(r"\s+", " ", re.sub(r"\n\s*\|", "\n", text)))
    for word in ("get_view(self, key: Union[str, bytes]", "Raises NotFound", "class Store"):
        assert word in flat, word
