"""What Python hands to C (issue 32 row 9, deliverables 6 and 7): every integer is range-checked
against its C type, so one out of range is ferry.InvalidArgument, never a silent wrap
(Piece("w", 1 << 32, 0, 4) bound as dim 0 before, Piece("w", 0, 1 << 64, 4) as rows [0:4));
and a str that UTF-8 cannot hold (a lone surrogate) is ferry.InvalidArgument naming it, not a
raw UnicodeEncodeError."""
import ctypes
import os

import numpy as np
import pytest

import ferry
from ferry import _lib

_n = [0]


def unique(tag):
    _n[0] += 1
    return "cargs-%d-%s-%d" % (os.getpid(), tag, _n[0])


def test_c_int_of():
    assert _lib.c_int_of(5, ctypes.c_int, "x") == 5
    assert _lib.c_int_of(np.int64(7), ctypes.c_uint64, "x") == 7
    assert _lib.c_int_of(2.0, ctypes.c_int, "x") == 2
    assert _lib.c_int_of((1 << 64) - 1, ctypes.c_uint64, "x") == (1 << 64) - 1
    for v, t in [(1 << 31, ctypes.c_int), (-1, ctypes.c_uint64), (1 << 64, ctypes.c_uint64),
                 (-(1 << 63) - 1, ctypes.c_int64), (1 << 32, ctypes.c_uint32), (2.5, ctypes.c_int),
                 (float("inf"), ctypes.c_int), (float("nan"), ctypes.c_int), ("3", ctypes.c_int)]:
        with pytest.raises(ferry.InvalidArgument, match="what"):
            _lib.c_int_of(v, t, "what")
    with pytest.raises(ferry.InvalidArgument, match="0..10"):
        _lib.c_int_of(11, ctypes.c_int, "x", lo=0, hi=10)


def test_timeouts_out_of_range():
    assert _lib.timeout_ms(None) == -1 and _lib.timeout_ms(-3) == 0
    assert _lib.timeout_ms(2147483.647) == 2147483647
    for t in (2147484.0, 1e12, float("inf"), float("nan")):
        with pytest.raises(ferry.InvalidArgument, match="timeout"):
            _lib.timeout_ms(t)


def test_store_and_memory_sizes():
    with ferry.Context(name=unique("ctx")) as ctx:
        for kw in ({"capacity": -1}, {"capacity": 1 << 64}, {"lease_ms": 1 << 31},
                   {"lease_ms": -5}, {"timeout": 1e10}):
            with pytest.raises(ferry.InvalidArgument):
                ferry.Store(host_directory=True, ctx=ctx, **kw)
        with pytest.raises(ferry.InvalidArgument, match="dim 0"):
            ferry.empty((-1, 4), "float32", ctx=ctx)
        with pytest.raises(ferry.InvalidArgument, match="dim 1"):
            ferry.empty((4, 1 << 64), "float32", ctx=ctx)
        with pytest.raises(ferry.InvalidArgument, match="bytes"):
            ferry.empty((1 << 40, 1 << 40), "uint8", ctx=ctx)  # 2^80 bytes: no size_t holds it
        with ferry.Store(host_directory=True, ctx=ctx) as st:
            st.put("k", np.arange(4, dtype=np.float32))
            with pytest.raises(ferry.InvalidArgument, match="timeout"):
                st.get("k", timeout=1e12)
            with pytest.raises(ferry.InvalidArgument, match="timeout"):
                st.put("k", np.arange(4, dtype=np.float32), timeout=float("inf"))
            assert np.array_equal(st.get("k"), np.arange(4, dtype=np.float32))


def test_mq_sizes():
    with ferry.Context(name=unique("mq")) as ctx:
        for kw in ({"queue_bytes": -1}, {"lease_ms": 1 << 40}):
            with pytest.raises(ferry.InvalidArgument):
                ferry.MQ(host_directory=True, ctx=ctx, **kw)
        with ferry.MQ(host_directory=True, ctx=ctx) as mq:
            with pytest.raises(ferry.InvalidArgument):
                mq.loan((-1,))
            with pytest.raises(ferry.InvalidArgument):
                mq.loan((1 << 40, 1 << 40))
            with pytest.raises(ferry.InvalidArgument, match="subscribers"):
                mq.wait_subscribers("t", -1, timeout=0)


def test_control_numbers(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRY_CTL_DIR", str(tmp_path))
    name = unique("cell")
    with pytest.raises(ferry.InvalidArgument, match="nranks"):
        ferry.ControlCell(name, (1 << 32) + 1)  # wrapped to 1 rank before
    with ferry.ControlCell(name, 1):
        with pytest.raises(ferry.InvalidArgument, match="rank"):
            ferry.ControlRank(name, -1)
        with pytest.raises(ferry.InvalidArgument, match="rank"):
            ferry.ControlRank(name, 1 << 32)  # rank 0 before


def test_refit_numbers_and_bogus_pieces(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRY_CTL_DIR", str(tmp_path))
    monkeypatch.delenv("FERRY_DIRECTORY", raising=False)
    sd = {"w": np.arange(32, dtype=np.float32).reshape(8, 4)}
    name = unique("refit")
    with pytest.raises(ferry.InvalidArgument, match="buffer_bytes"):
        ferry.RefitSender(name, sd, buffer_bytes=-1)
    with ferry.RefitSender(name, sd, buffer_bytes=4096) as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        out = np.zeros((4, 4), np.float32)
        with pytest.raises(ferry.InvalidArgument, match="piece dim"):
            rx.bind_shards({"w": (out, [ferry.Piece("w", 1 << 32, 0, 4)])})
        with pytest.raises(ferry.InvalidArgument, match="piece start"):
            rx.bind_shards({"w": (out, [ferry.Piece("w", 0, 1 << 64, 4)])})
        with pytest.raises(ferry.InvalidArgument, match="piece stop"):
            rx.bind_shards({"w": (out, [("w", 0, 0, -(1 << 64) + 4)])})
        assert "w" not in rx._pieces  # nothing was bound
        with pytest.raises(ferry.InvalidArgument, match="version"):
            tx.push(-1)
        with pytest.raises(ferry.InvalidArgument, match="version"):
            rx.wait(1 << 64, timeout=0)
        rx.bind_shards({"w": (out, [ferry.Piece("w", 0, 4, 8)])})
        assert tx.push(1) == 1 and rx.wait(1, timeout=5) == 1
        assert np.array_equal(out, sd["w"][4:])


def test_lone_surrogate_is_invalid_argument():
    bad = "key-\udcff"
    with ferry.Store(host_directory=True, name=unique("sur")) as st:
        for call in (lambda: st.put(bad, np.zeros(2, np.uint8)), lambda: st.get(bad),
                     lambda: st.exists(bad), lambda: st.delete(bad), lambda: st.list(bad)):
            with pytest.raises(ferry.InvalidArgument, match=r"character 4 \('\\udcff'\)"):
                call()
        st.put("ok-\u00e9", np.zeros(2, np.uint8))  # non-ASCII text that UTF-8 holds is fine
        assert st.exists("ok-\u00e9")
    with pytest.raises(ferry.InvalidArgument, match="surrogate"):
        ferry.Context(name="n\ud800")
