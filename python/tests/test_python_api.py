"""The Python surface as users meet it: bytes, DLPack, like=, zero-copy views, mq per-topic
callbacks and asyncio, errors that say what to pass, docstrings, numpy 2 (the p2pstore drop-in:
test_p2pstore.py)."""
import ast
import asyncio
import gc
import inspect
import os
import pydoc
import re
import textwrap
import threading

import numpy as np
import pytest

import ferry

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
                      (np.array([object()]), "bytes"), ("text", "x.encode()"),
                      ([1, 2, 3], "np.asarray(x"), ([{"a": 1}], "json.dumps"),
                      (np.ones(2, np.complex64), "x.view(np.float32)")):
        with pytest.raises(TypeError) as e:
            store.put("bad", bad)
        assert "pass" in str(e.value) and word in str(e.value), str(e.value)
    assert not store.exists("bad")
    with pytest.raises(ValueError) as e:
        store.get("nope", like="pandas")
    assert "from_dlpack" in str(e.value)
    with pytest.raises(TypeError) as e:  # a wrong dtype object: the supported ones are named
        ferry.empty(3, np.complex64)
    assert "pass one of bool, uint8" in str(e.value) and "bfloat16" in str(e.value)
    with pytest.raises(TypeError) as e:
        ferry.empty(3, "complex")
    assert "pass one of" in str(e.value)
    with pytest.raises(TypeError) as e:  # a key that is neither str nor bytes
        store.put(42, np.zeros(1))
    assert "pass str(42)" in str(e.value)
    store.put(b"k", np.arange(4))  # bytes and str name the same key
    assert np.array_equal(store.get("k"), np.arange(4)) and store.list() == ["k"]
    out = np.zeros((4, 2), np.int64)
    with pytest.raises(ValueError) as e:  # written in place: a contiguous copy would not do
        store.get("k", out=out[:, 0])
    assert "np.empty(shape, dtype)" in str(e.value)
    out = np.zeros(4, np.int64)
    out.flags.writeable = False
    with pytest.raises(ValueError) as e:
        store.get("k", out=out)
    assert "read-only" in str(e.value) and "np.empty_like" in str(e.value)


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


# numpy 2 removed these from the main namespace (numpy/_expired_attrs_2_0.py and the 2.0
# migration guide's "removed members"), or deprecated them in 2.0 for removal (in1d, trapz,
# row_stack): code that uses them fails, or warns, under numpy 2.
REMOVED_IN_NUMPY_2 = {
    "float_", "complex_", "longfloat", "singlecomplex", "cfloat", "longcomplex", "clongfloat",
    "string_", "unicode_", "Inf", "Infinity", "NaN", "infty", "NINF", "PINF", "NZERO", "PZERO",
    "product", "cumproduct", "alltrue", "sometrue", "msort", "round_", "asfarray", "cast",
    "find_common_type", "mat", "row_stack", "in1d", "trapz", "issctype", "maximum_sctype",
    "obj2sctype", "sctype2char", "sctypeDict", "sctypes", "issubsctype", "issubclass_",
    "set_string_function", "safe_eval", "compat", "deprecate", "deprecate_with_doc", "disp",
    "recfromcsv", "recfromtxt", "geterrobj", "seterrobj", "source", "lookfor", "who",
    "fastCopyAndTranspose", "set_numeric_ops", "add_newdoc", "add_docstring", "add_newdoc_ufunc",
    "tracemalloc_domain", "get_array_wrap", "DataSource", "nbytes", "byte_bounds",
    "compare_chararrays", "chararray", "format_parser", "who", "core",
}
# ndarray methods numpy 2 removed (np.ptp the function stays).
REMOVED_NDARRAY_METHODS = {"newbyteorder", "itemset", "ptp"}


def numpy_2_problems(source, filename="<source>"):
    """What in a module's source numpy 2 removed or changed: np.X of a removed member (whatever
    numpy is imported as), `from numpy import X`, numpy.core, the removed ndarray methods,
    np.array(..., copy=False) (an error in numpy 2 where a copy is needed: np.asarray is the
    portable form), and __array__ / __array_wrap__ methods without the arguments numpy 2
    passes (copy; return_scalar)."""
    tree = ast.parse(source, filename)
    aliases = {"numpy"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "numpy"}
    found = []

    def at(node, what):
        found.append("%s:%d: %s" % (filename, node.lineno, what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            is_np = isinstance(node.value, ast.Name) and node.value.id in aliases
            if is_np and node.attr in REMOVED_IN_NUMPY_2:
                at(node, "np.%s" % node.attr)
            elif not is_np and node.attr in REMOVED_NDARRAY_METHODS:
                at(node, "ndarray.%s" % node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "numpy":
            if node.module.startswith("numpy.core"):
                at(node, "from %s import" % node.module)
            for a in node.names:
                if node.module == "numpy" and a.name in REMOVED_IN_NUMPY_2:
                    at(node, "from numpy import %s" % a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("numpy.core"):
                    at(node, "import %s" % a.name)
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "array" and \
                    isinstance(f.value, ast.Name) and f.value.id in aliases:
                for k in node.keywords:
                    if k.arg == "copy" and isinstance(k.value, ast.Constant) and \
                            k.value.value is False:
                        at(node, "np.array(copy=False)")
        elif isinstance(node, ast.FunctionDef) and node.name in ("__array__", "__array_wrap__"):
            names = [a.arg for a in node.args.args + node.args.kwonlyargs]
            ok = node.args.kwarg is not None or (
                "copy" in names if node.name == "__array__"
                else node.args.vararg is not None or len(node.args.args) >= 4)
            if not ok:
                at(node, "%s without numpy 2's arguments" % node.name)
    return found


def test_numpy_2_checker_finds_what_it_looks_for():
    bad = textwrap.dedent("""
        import numpy as xp
        from numpy import float_
        from numpy.core.multiarray import normalize_axis_index
        import numpy.core
        a = xp.product([1]) + xp.NaN + xp.in1d([1], [1]).sum()
        b = a.newbyteorder() + xp.ptp(a) + a.ptp()
        c = xp.array(a, copy=False)
        d = xp.asarray(a)
        class T:
            def __array__(self, dtype=None):
                pass
            def __array_wrap__(self, out, context=None):
                pass
        """)
    found = [f.split(": ", 1)[1] for f in numpy_2_problems(bad)]
    assert found.count("np.product") == 1 and "np.NaN" in found and "np.in1d" in found
    assert "from numpy import float_" in found and "import numpy.core" in found
    assert "from numpy.core.multiarray import" in found
    assert found.count("ndarray.newbyteorder") == 1 and found.count("ndarray.ptp") == 1
    assert found.count("np.array(copy=False)") == 1
    assert "__array__ without numpy 2's arguments" in found
    assert "__array_wrap__ without numpy 2's arguments" in found
    assert len(found) == 11, found


def test_no_api_numpy_2_removed():
    """The package, its tests and the examples use nothing numpy 2 removed (make test runs on
    Debian 12's numpy 1.24; python/README.md says where the suite ran under numpy 2)."""
    here = os.path.dirname(os.path.abspath(__file__))
    examples = os.path.join(os.path.dirname(os.path.dirname(here)), "examples")
    dirs = [PKG, here] + ([examples] if os.path.isdir(examples) else [])
    files = [os.path.join(d, f) for d in dirs for f in sorted(os.listdir(d)) if f.endswith(".py")]
    assert len(files) > 15
    problems = []
    for path in files:
        with open(path) as f:
            problems += numpy_2_problems(f.read(), path)
    assert problems == []


MODULES = ("ferry", "ferry.store", "ferry.mq", "ferry.p2pstore", "ferry.aio", "ferry.tensors",
           "ferry.control", "ferry.refit", "ferry.stats", "ferry.errors", "ferry.cuda")


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
