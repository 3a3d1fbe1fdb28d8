"""ferry.Store from Python: in-process and across processes, dtypes, zero copy, errors, logging."""
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import ferry

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

PYDIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NP_DTYPES = [np.bool_, np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32,
             np.int64, np.float16, np.float32, np.float64]


@pytest.fixture(scope="module")
def store():
    s = ferry.Store(host_directory=True, name="py-host", capacity=64 << 20, timeout=5)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def clean(store):
    yield
    store.clear()


def sample(dtype, shape=(3, 5, 7)):
    rng = np.random.default_rng(7)
    if dtype is np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", NP_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_round_trip(store, dtype):
    a = sample(dtype)
    store.put("rt", a)
    b = store.get("rt")
    assert b.dtype == a.dtype and b.shape == a.shape
    assert np.array_equal(a, b)
    info = store.stat("rt")
    assert info["shape"] == a.shape and info["bytes"] == a.nbytes and info["owner"] == "py-host"
    out = np.zeros_like(a)
    assert store.get("rt", out=out) is out and np.array_equal(out, a)


def test_scalar_empty_and_noncontiguous(store):
    store.put("scalar", np.float64(2.5))
    assert store.get("scalar").shape == () and store.get("scalar") == 2.5
    store.put("zero", np.zeros((0, 4), np.int32))
    assert store.get("zero").shape == (0, 4)
    a = np.arange(64, dtype=np.int16).reshape(8, 8)
    store.put("t", a.T)  # not contiguous: copied once
    assert np.array_equal(store.get("t"), a.T)
    with pytest.raises(ValueError):
        store.get("t", out=np.zeros((8, 8), np.int16).T)


@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_torch_round_trip(store):
    for dt in (torch.float32, torch.float16, torch.int64, torch.uint8, torch.bool, torch.bfloat16):
        t = (torch.randn(4, 6) * 10).to(dt)
        store.put("tt", t)
        back = store.get("tt", like="torch")
        assert back.dtype == dt and torch.equal(back, t)
    bf = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    store.put("bf", bf)
    bits = store.get("bf")  # numpy has no bfloat16: its bits
    assert bits.dtype == np.uint16
    assert np.array_equal(bits, bf.view(torch.int16).numpy().view(np.uint16))
    assert store.stat("bf")["dtype"] == "bfloat16"
    out = torch.zeros(3, dtype=torch.bfloat16)
    assert store.get("bf", out=out) is out and torch.equal(out, bf)


def test_zero_copy_put_of_ferry_memory(store):
    e = store.empty((1024,), np.float32)
    e[:] = 1.0
    store.put("zc", e)
    # Published in place: the owner's later writes are what a reader sees (the contract says
    # not to do this; here it proves no copy was made).
    e[5] = 42.0
    assert store.get("zc")[5] == 42.0
    c = np.ones(1024, np.float32)
    store.put("copied", c)
    c[5] = 42.0
    assert store.get("copied")[5] == 1.0
    if torch is not None:
        t = store.empty((2, 3), torch.bfloat16, like="torch")
        assert t.dtype == torch.bfloat16 and t.shape == (2, 3)
        t.fill_(1.5)
        store.put("zct", t)
        t[0, 0] = 3.0
        assert store.get("zct", like="torch")[0, 0].item() == 3.0


def test_reput_of_one_array_follows_its_layout(store):
    # Store.put remembers an array it put (engines reuse buffers); a later put of the same
    # object must still describe it as it is now: reshaped in place, strided, or retyped.
    a = store.empty((4, 6), np.uint8)
    a[:] = np.arange(24, dtype=np.uint8).reshape(4, 6)
    store.put("lay", a)
    assert store.stat("lay")["shape"] == (4, 6)
    a.shape = (6, 4)
    store.put("lay", a)
    assert store.stat("lay")["shape"] == (6, 4)
    assert np.array_equal(store.get("lay"), np.arange(24, dtype=np.uint8).reshape(6, 4))
    a.dtype = np.uint16
    store.put("lay", a)
    assert store.stat("lay")["dtype"] == "uint16" and store.stat("lay")["shape"] == (6, 2)
    b = np.arange(12, dtype=np.int32).reshape(3, 4)
    store.put("lay2", b)
    b.strides = (4, 12)  # the same object, now a transposed (non-contiguous) layout
    store.put("lay2", b)
    assert np.array_equal(store.get("lay2"), np.arange(12, dtype=np.int32).reshape(4, 3).T)


def test_reput_keeps_what_it_must(store):
    # A re-put of a cached array takes put's short path; it must still hold ferry memory put in
    # place, hold nothing for a copy (copy=True, or memory that is not ferry's), and refuse a
    # closed store.
    a, plain = store.empty(8, np.uint8), np.zeros(8, np.uint8)
    for _ in range(2):
        store.put("held", a)
        assert store._published.get(b"held") is a
        store.put("held", a, copy=True)
        assert b"held" not in store._published
        store.put("plain", plain)
        assert b"plain" not in store._published
    a[:] = 5
    store.put(b"held", a)
    assert store.get("held").tolist() == [5] * 8
    other = ferry.Store(store.directory, name="py-reput", timeout=5)
    b = other.empty(4, np.uint8)
    other.put("x", b)
    other.close()
    with pytest.raises(ValueError, match="closed"):
        other.put("x", b)


def test_keys(store):
    for i in range(5):
        store.put("req/%d" % i, np.full(3, i, np.uint8))
    store.put("other", np.zeros(1, np.uint8))
    assert store.list("req/") == ["req/%d" % i for i in range(5)]
    assert store.exists("req/1") and not store.exists("nope")
    got = store.get_batch(["req/0", "nope", "req/4"])
    assert got[1] is None and got[0].tolist() == [0] * 3 and got[2].tolist() == [4] * 3
    assert store.delete("req/0") is True and store.delete("req/0") is False
    assert store.delete_batch(["req/1", "nope"]) == {"req/1": True, "nope": False}
    assert store.delete_prefix("req/") == 3
    assert store.list() == ["other"]
    assert store.clear() == {"success": True, "cleared": 1, "failed": 0}
    assert store.list() == []


def test_key_rules_match_c(store):
    """A NUL inside a key used to cut it: put("abc\\x00evil") overwrote "abc". Every key rule is
    the C library's: a control character, an empty key or one over 255 bytes is refused, in
    every call that takes a key (and a topic or name the same way)."""
    store.put("abc", np.full(4, 1, np.uint8))
    for bad in ["abc\x00evil", b"abc\x00", "", "a\x01b", "k" * 256]:
        with pytest.raises(ferry.InvalidArgument):
            store.put(bad, np.zeros(4, np.uint8))
        with pytest.raises(ferry.InvalidArgument):
            store.get(bad)
        with pytest.raises(ferry.InvalidArgument):
            store.delete(bad)
    assert store.get("abc").tolist() == [1] * 4
    store.put("k" * 255, np.zeros(1, np.uint8))  # the longest key
    assert store.exists("k" * 255)
    with pytest.raises(ferry.InvalidArgument, match="NUL"):
        ferry.MQ(store.directory, name="py-nul\x00x")


def test_names_hold_one_rule(store):
    """Issue 32 rows 5, 8, 11: keys and node names (Context, Store) are the C library's one name
    rule: no C0, DEL, C1 (U+0080..U+009F; U+009B is an 8-bit CSI) and no bytes that are not UTF-8.
    The error quotes the name once, escaped: no raw ESC or BEL reaches a terminal through it."""
    for bad in ["a\x9bb", "\x1b[31m", "del\x7f", b"bad\xff", b"\xed\xa0\x80", b"\xc0\xaf"]:
        with pytest.raises(ferry.InvalidArgument):
            store.put(bad, np.zeros(1, np.uint8))
        with pytest.raises(ferry.InvalidArgument):
            store.exists(bad)
    store.put("caf\u00e9/\u65e5\u672c", np.ones(2, np.uint8))  # well-formed UTF-8 is fine
    assert store.get("caf\u00e9/\u65e5\u672c").tolist() == [1, 1]
    with pytest.raises(ferry.InvalidArgument) as ei:
        ferry.Context(name="a\x1b[31m")
    assert "\x1b" not in str(ei.value) and "'a\\x1b[31m'" in str(ei.value)
    with pytest.raises(ferry.InvalidArgument) as ei:
        ferry.Store(store.directory, name="esc\x1b]0;x\x07")
    msg = str(ei.value)
    assert "\x1b" not in msg and "\x07" not in msg
    assert msg.count("esc\\x1b]0;x\\x07") == 1, msg  # not garbled: the name once, escaped
    assert "control character at byte 3" in msg


def test_errors(store):
    with pytest.raises(ferry.NotFound) as ei:
        store.get("missing-key")
    assert "missing-key" in str(ei.value) and ei.value.name == "FERRY_ENOTFOUND"
    assert isinstance(ei.value, ferry.Error) and isinstance(ei.value, KeyError)
    store.put("k", np.zeros((2, 3), np.float32))
    with pytest.raises(ferry.DtypeError):
        store.get("k", out=np.zeros((2, 3), np.int32))
    with pytest.raises(ferry.ShapeError):
        store.get("k", out=np.zeros((3, 2), np.float32))
    with pytest.raises(ferry.InvalidArgument):
        store.put("", np.zeros(1))
    with pytest.raises(TypeError):
        store.put("k", np.zeros(2, np.complex64))
    with pytest.raises(ferry.ConnectError):
        ferry.Store("ferry://127.0.0.1:1", name="py-noconn", timeout=0.5)


def test_two_stores_in_process(store):
    with ferry.Store(store.directory, name="py-second") as other:
        other.put("from-second", np.arange(10, dtype=np.int64))
        assert store.stat("from-second")["owner"] == "py-second"
        assert store.get("from-second").tolist() == list(range(10))
    assert not store.exists("from-second")  # a closed store's objects are removed


def test_unnamed_stores_get_unique_names(store):
    with ferry.Store(store.directory) as a, ferry.Store(store.directory) as b:
        assert a.name != b.name != store.name
        b.put("from-b", np.ones(3))
        assert store.stat("from-b")["owner"] == b.name
        assert a.get("from-b").tolist() == [1.0] * 3


def test_reader_of_freed_memory_is_told_at_once(store):
    """An owner that frees memory it still publishes in place (C code beside this process,
    here through ctypes: ferry.Store itself holds what it put in place, so it cannot): a get,
    a view or a batch raises ferry.Freed naming the owner, at once, where it used to retry
    until its timeout and then blame a replace (ferry.Stale). The timeout is far longer than
    the test needs, so a reader that retried fails with Stale instead."""
    import ctypes
    from ferry._lib import lib
    with ferry.Store(store.directory, name="py-freeing-owner") as owner:
        p = ctypes.c_void_p()
        assert lib.ferry_alloc(owner.context.handle, 4096, ctypes.byref(p)) == 0
        arr = np.frombuffer((ctypes.c_uint8 * 4096).from_address(p.value), np.uint8)
        arr[:] = 7
        owner.put("freed", arr)  # ferry memory: published in place
        assert (store.get("freed") == 7).all()
        del arr
        assert lib.ferry_free(owner.context.handle, p) == 0
        with pytest.raises(ferry.Freed) as e:
            store.get("freed", timeout=60)
        assert "owner 'py-freeing-owner' freed" in str(e.value)
        assert e.value.name == "FERRY_EFREED"
        with pytest.raises(ferry.Freed):
            store.get_view("freed", timeout=60)
        with pytest.raises(ferry.Freed) as e:
            store.get_batch(["freed"], timeout=60)
        assert "owner 'py-freeing-owner'" in str(e.value)
        assert owner.delete("freed")  # the owner can still take the key back
        assert not store.exists("freed")


def test_threads(store):
    import threading
    errors = []

    def worker(t):
        try:
            for i in range(50):
                a = np.full((128, 16), t * 1000 + i, np.int32)
                store.put("th/%d/%d" % (t, i), a)
                assert np.array_equal(store.get("th/%d/%d" % (t, i)), a)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(store.list("th/")) == 200


def test_aio_store(store):
    import asyncio

    async def main():
        async with ferry.aio.Store(store.directory, name="py-aio") as s:
            await asyncio.gather(*(s.put("aio/%d" % i, np.full(8, i, np.int64))
                                   for i in range(16)))
            got = await asyncio.gather(*(s.get("aio/%d" % i) for i in range(16)))
            assert [g[0] for g in got] == list(range(16))
            assert await s.exists("aio/3") and not await s.exists("aio/x")
            assert await s.delete_batch(["aio/0", "aio/x"]) == {"aio/0": True, "aio/x": False}
            assert len(await s.list("aio/")) == 15
            with pytest.raises(ferry.NotFound):
                await s.get("aio/x")
            assert (await s.clear())["cleared"] == 15

    asyncio.run(main())


CHILD = r"""
import sys, numpy as np, ferry
s = ferry.Store(sys.argv[1], name="py-child", timeout=5)
for i in range(20):
    s.put("child/%d" % i, np.full((64, 8), i, np.uint16))
print("done", flush=True)
sys.stdin.readline()
s.close()
"""


def test_across_processes(store):
    env = dict(os.environ, PYTHONPATH=PYDIR)
    child = subprocess.Popen([sys.executable, "-c", CHILD, store.directory], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        # Get while the child puts: each key as soon as it appears.
        deadline = time.monotonic() + 20
        for i in range(20):
            while True:
                try:
                    got = store.get("child/%d" % i)
                    break
                except ferry.NotFound:
                    assert time.monotonic() < deadline, "child never put child/%d" % i
                    time.sleep(0.005)
            assert got.shape == (64, 8) and (got == i).all()
        assert child.stdout.readline().strip() == "done"
        assert store.stat("child/3")["owner"] == "py-child"
        assert len(store.list("child/")) == 20
        child.kill()  # dies without closing: its objects' owner is gone
        child.wait()
        # Its records outlive it until the lease lapses (FERRY_LEASE_MS): PeerGone, no hang.
        # Until this node's link has seen the death (its progress thread reads the closed
        # socket), a get may still copy the intact bytes from the mapped pages: that is allowed.
        t0 = time.monotonic()
        with pytest.raises(ferry.PeerGone):
            while True:
                got = store.get("child/0", timeout=3)
                assert (got == 0).all()
                assert time.monotonic() - t0 < 3, "the owner's death was never noticed"
                time.sleep(0.01)
        assert time.monotonic() - t0 < 4
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        store.delete_prefix("child/")


def test_logging_goes_to_python(store):
    records = []

    class H(logging.Handler):
        def emit(self, record):
            records.append(record)

    h = H(level=logging.DEBUG)
    log = logging.getLogger("ferry")
    old = log.level
    log.addHandler(h)
    log.setLevel(logging.DEBUG)
    ferry.set_log_level("debug")
    try:
        with ferry.Store(store.directory, name="py-logged") as s:
            s.put("lg", np.zeros(4, np.uint8))
            s.get("lg")
    finally:
        ferry.set_log_level("warn")
        log.removeHandler(h)
        log.setLevel(old)
    assert records, "no ferry log line reached logging"
    assert all(r.name == "ferry" for r in records)


def test_default_context_empty_and_gc():
    a = ferry.empty((3, 4), "uint16")  # uninitialised: memory freed before comes back as it was
    assert a.shape == (3, 4) and a.dtype == np.uint16
    a[:] = 9
    ctx = ferry.default_context()
    n = ctx._allocs
    del a
    import gc
    gc.collect()
    assert ctx._allocs == n - 1


def test_engine_buffers_come_back_when_the_trainer_deletes(store):
    """Issue 31: an engine that makes a new buffer per request (store.empty) and puts it in
    place gets the memory of keys another node deleted back for its next buffers (pages still
    mapped on both sides), and the reader always gets the bytes of the key it asked for."""
    with ferry.Store(store.directory, name="py-r3-engine", timeout=10) as eng, \
            ferry.Store(store.directory, name="py-r3-trainer", timeout=10) as tr:
        shape = (4, 1024, 64)  # 256 KiB
        seen = set()
        for i in range(8):
            ids = eng.empty(shape, np.uint8)
            seen.add(ids.ctypes.data)
            ids.fill(i + 1)
            eng.put("r3/%d" % i, ids)
            del ids
            got = tr.get("r3/%d" % i)
            assert got.shape == shape and (got == i + 1).all()
            view = tr.get_view("r3/%d" % i)
            assert (view == i + 1).all()
            view.release()
            assert tr.delete("r3/%d" % i)
        assert len(seen) <= 2, "the engine's buffers were not reused: %d addresses" % len(seen)
        last = eng.empty(shape, np.uint8)  # an engine's next request
        assert last.ctypes.data in seen
        assert not eng._published  # it let go of every deleted key's buffer
