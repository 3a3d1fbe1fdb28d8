"""ferry.RefitSender / RefitReceiver: dtypes (bfloat16 too), zero copy on both sides, only /
skip-unchanged / cast, a re-sealed plan, errors, the GIL, and receivers in other processes."""
import os
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import ferry

torch = pytest.importorskip("torch")

PYDIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_n = [0]


def unique(tag):
    _n[0] += 1
    return "pyrefit-%d-%s-%d" % (os.getpid(), tag, _n[0])


def state_dict():
    g = torch.Generator().manual_seed(3)
    sd = {
        "f32": torch.randn(16, 8, generator=g),
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "f16": torch.randn(4, 4, generator=g).to(torch.float16),
        "f64": torch.randn(3, generator=g).double(),
        "i64": torch.arange(7, dtype=torch.int64) - 3,
        "i8": torch.arange(-5, 5, dtype=torch.int8),
        "u8": torch.arange(200, 210, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "np_u16": np.arange(12, dtype=np.uint16).reshape(3, 4),
        "np_i32": np.arange(-6, 6, dtype=np.int32),
        "np_f32": np.linspace(0, 1, 9, dtype=np.float32),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous: staged
    }
    return sd


def as_torch(x):
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.view(np.int16) if x.dtype == np.uint16 else x)
    return x


def ptr(x):
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data_ptr()


def same(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.fixture
def pair():
    sd = state_dict()
    name = unique("pair")
    tx = ferry.RefitSender(name, sd, buffer_bytes=4096)
    rx = ferry.RefitReceiver(name, timeout=5)
    yield sd, tx, rx
    rx.close()
    tx.close()


def test_manifest(pair):
    sd, tx, rx = pair
    man = rx.manifest()
    assert [m["name"] for m in man] == list(sd)
    by = {m["name"]: m for m in man}
    assert by["bf16"]["dtype"] == "bfloat16" and by["bf16"]["shape"] == (33,)
    assert by["np_u16"]["dtype"] == "uint16" and by["np_u16"]["nbytes"] == 24
    assert by["scalar"]["shape"] == () and by["strided"]["shape"] == (4, 6)
    assert [m["name"] for m in tx.manifest()] == list(sd)
    assert tx.receivers == 1


def test_flat_views_are_zero_copy_and_follow_pushes(pair):
    sd, tx, rx = pair
    views = rx.tensors()
    ptrs = {k: ptr(v) for k, v in views.items()}
    assert tx.push(1) == 1 and rx.wait(1) == 1 and rx.committed == 1
    for k in sd:
        assert same(views[k], sd[k]), k
    assert views["bf16"].dtype == torch.bfloat16
    # The trainer updates in place; the next push lands in the same memory (no copy on
    # either side: the sender declared the tensors themselves, the views are the buffer).
    sd["f32"].mul_(-2)
    sd["bf16"].add_(1)
    sd["np_i32"][:] += 100
    sd["strided"].add_(3)
    assert tx.push() == 2 and rx.wait() == 2
    for k in sd:
        assert same(views[k], sd[k]), k
    again = rx.tensors()
    assert {k: ptr(v) for k, v in again.items()} == ptrs
    assert {k: ptr(v) for k, v in views.items()} == ptrs
    arrays = rx.tensors(like="numpy")
    assert arrays["bf16"].dtype == np.uint16  # numpy has no bfloat16: its bits
    assert arrays["f32"].ctypes.data == ptrs["f32"]
    assert np.array_equal(arrays["bf16"], sd["bf16"].view(torch.int16).numpy().view(np.uint16))


def test_bind_lands_in_place(pair):
    sd, tx, rx = pair
    dst = {k: (np.zeros_like(v) if isinstance(v, np.ndarray) else torch.zeros_like(v).contiguous())
           for k, v in sd.items()}
    ptrs = {k: ptr(v) for k, v in dst.items()}
    assert rx.bind(dst) == ([], [])
    tx.push(5)
    assert rx.wait(5) == 5
    for k in sd:
        assert same(dst[k], sd[k]), k
        assert ptr(dst[k]) == ptrs[k]


def test_bind_partial_and_errors(pair):
    sd, tx, rx = pair
    with pytest.raises(ferry.NotFound):
        rx.bind({"f32": torch.zeros(16, 8)})  # strict: the others are missing
    missing, unexpected = rx.bind({"f32": torch.zeros(16, 8), "nope": torch.zeros(1)},
                                  strict=False)
    assert "bf16" in missing and unexpected == ["nope"]
    with pytest.raises(ferry.DtypeError) as ei:
        rx.bind({"f32": torch.zeros(16, 8, dtype=torch.float64)}, strict=False)
    assert "f32" in str(ei.value) and ei.value.name == "FERRY_EDTYPE"
    with pytest.raises(ferry.ShapeError) as ei:
        rx.bind({"bf16": torch.zeros(32, dtype=torch.bfloat16)}, strict=False)
    assert "bf16" in str(ei.value) and isinstance(ei.value, ValueError)
    with pytest.raises(ValueError):
        rx.bind({"strided": torch.zeros(6, 4).t()}, strict=False)  # not contiguous
    with pytest.raises(ferry.Timeout) as ei:
        rx.wait(9, timeout=0.05)
    assert isinstance(ei.value, TimeoutError)


def test_only_and_skip_unchanged():
    a = torch.zeros(1024)  # 4 KiB each: every tensor its own bucket
    b = torch.zeros(1024)
    name = unique("only")
    with ferry.RefitSender(name, {"a": a, "b": b}, buffer_bytes=4096) as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        v = rx.tensors()
        tx.push(1)
        rx.wait(1)
        a.fill_(1)
        b.fill_(2)
        tx.push(2, only=["a"])
        assert rx.wait(2) == 2
        assert v["a"].eq(1).all() and v["b"].eq(0).all()  # b's bucket was not sent
        tx.push(3, skip_unchanged=True)
        rx.wait(3)
        assert v["b"].eq(2).all()
        del v


def test_cast_on_the_sender():
    w = torch.randn(64, 32)
    i = torch.arange(10, dtype=torch.int32)
    name = unique("cast")
    with ferry.RefitSender(name, {"w": w, "i": i}, cast="bfloat16") as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        assert {m["name"]: m["dtype"] for m in rx.manifest()} == {"w": "bfloat16", "i": "int32"}
        assert tx.manifest()[0]["wire_dtype"] == "bfloat16"
        dst = {"w": torch.empty(64, 32, dtype=torch.bfloat16),
               "i": torch.empty(10, dtype=torch.int32)}
        rx.bind(dst)
        tx.push(1)
        rx.wait(1)
        assert torch.equal(dst["w"], w.to(torch.bfloat16)) and torch.equal(dst["i"], i)
    name = unique("cast16")
    with ferry.RefitSender(name, {"w": w}, cast={"w": torch.float16}), \
            ferry.RefitReceiver(name, timeout=5) as rx:
        assert rx.manifest()[0]["dtype"] == "float16"


def e4m3(bits):
    """float8_e4m3fn bits -> float32 (numpy has no such dtype)."""
    b = bits.astype(np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    return (sign * v).astype(np.float32)


def test_fp8_cast_carries_its_scale():
    w = torch.randn(32, 16) * 3
    name = unique("fp8")
    with ferry.RefitSender(name, {"w": w, "b": torch.ones(4)}, cast={"w": "float8_e4m3"}) as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        man = {m["name"]: m for m in rx.manifest()}
        assert man["w"]["dtype"] == "float8_e4m3" and man["w"]["nbytes"] == 32 * 16
        scale = man["w"]["scale"]
        assert scale == pytest.approx(float(w.abs().max()) / 448, rel=1e-6)
        assert man["b"]["scale"] == 1.0
        v = rx.tensors(like="numpy")
        tx.push(1)
        rx.wait(1)
        got = e4m3(v["w"]) * scale
        assert np.all(np.abs(got - w.numpy()) <= np.abs(w.numpy()) / 8 + scale * 2.0 ** -9)


def test_resealed_plan():
    sd = {"w": torch.ones(8), "bias": torch.zeros(4, dtype=torch.float32)}
    name = unique("reseal")
    with ferry.RefitSender(name, sd) as tx, ferry.RefitReceiver(name, timeout=5) as rx:
        dst = {"w": torch.zeros(8), "bias": torch.zeros(4)}
        rx.bind(dst)
        tx.push(1)
        rx.wait(1)
        assert tx.update({"w": sd["w"], "bias": sd["bias"]}) is False  # nothing changed
        # Some MoE bias tensors change dtype during training: re-declared, re-sealed.
        sd["bias"] = torch.full((4,), 7, dtype=torch.bfloat16)
        sd["w"].fill_(3)
        with pytest.raises(ferry.DtypeError):  # the receiver refused version 2
            tx.push(2, state_dict=sd)
        with pytest.raises(ferry.Timeout) as ei:
            rx.wait(2, timeout=0.05)
        assert "bias" in str(ei.value)  # the binding that no longer fits is named
        assert rx.committed == 1
        assert {m["name"]: m["dtype"] for m in rx.manifest()}["bias"] == "bfloat16"
        dst["bias"] = torch.zeros(4, dtype=torch.bfloat16)
        rx.bind({"bias": dst["bias"]}, strict=False)
        tx.push(3)
        assert rx.wait(3) == 3
        assert dst["w"].eq(3).all() and torch.equal(dst["bias"], sd["bias"])


def test_receiver_by_address_over_tcp():
    """A receiver on another host attaches by the sender's address; here its tcp part only."""
    sd = {"w": torch.randn(64, 64), "bf": torch.randn(100).to(torch.bfloat16)}
    name = unique("tcp")
    with ferry.RefitSender(name, sd, buffer_bytes=8192, publish=False) as tx:
        tcp = [a for a in tx.address.split(",") if a.startswith("tcp://")][0]
        with ferry.RefitReceiver(tcp, timeout=5) as rx:
            dst = {k: torch.empty_like(v) for k, v in sd.items()}
            rx.bind(dst)
            tx.push(1)
            assert rx.wait(1) == 1
            assert all(torch.equal(dst[k], sd[k]) for k in sd)
    with pytest.raises(ferry.NotFound):  # publish=False: not findable by name
        ferry.RefitReceiver(name, timeout=0.05)


def test_errors():
    with pytest.raises(ferry.NotFound):
        ferry.RefitReceiver(unique("nobody"), timeout=0.1)
    with pytest.raises(ferry.InvalidArgument):
        ferry.RefitSender("bad/name", {"x": torch.zeros(1)})
    with pytest.raises(ferry.ConnectError):
        ferry.RefitReceiver("tcp://127.0.0.1:1", timeout=0.3)
    name = unique("dup")
    with ferry.RefitSender(name, {"x": torch.zeros(1)}):
        with pytest.raises(ferry.AlreadyExists):
            ferry.RefitSender(name, {"x": torch.zeros(1)})
    with pytest.raises(TypeError):
        ferry.RefitSender(unique("c64"), {"x": np.zeros(2, np.complex64)})
    with pytest.raises(ferry.DtypeError):  # ferry has no int32 -> bfloat16 cast
        ferry.RefitSender(unique("nocast"), {"x": torch.zeros(2, dtype=torch.int32)},
                          cast={"x": "bfloat16"})
    # the name is free again after close
    with ferry.RefitSender(name, {"x": torch.zeros(1)}):
        pass


def test_blocking_wait_releases_the_gil():
    name = unique("gil")
    x = torch.zeros(4)
    with ferry.RefitSender(name, {"x": x}) as tx, ferry.RefitReceiver(name, timeout=5) as rx:
        got = []
        views = rx.tensors()  # a version lands only where something is bound
        t = threading.Thread(target=lambda: got.append(rx.wait(1, timeout=30)))
        t.start()
        # Python keeps running in this thread while the other one waits inside ferry: if the
        # wait held the GIL, this loop (and so the push that ends the wait) would never run.
        n = 0
        for _ in range(100000):
            n += 1
        x.fill_(n)
        tx.push(1)
        t.join()
        assert got == [1]
        del views


RECEIVER = r"""
import sys, torch, ferry
rx = ferry.RefitReceiver(sys.argv[1], timeout=10)
views = rx.tensors()
print("attached", flush=True)
for line in sys.stdin:
    v = int(line)
    rx.wait(v, timeout=10)
    # report what arrived: every tensor's bytes, hashed
    h = sum(int(t.view(torch.uint8).double().sum()) * (i + 1) for i, t in enumerate(
        x.reshape(-1).contiguous() for x in views.values()))
    print(v, h, flush=True)
"""


def digest(sd):
    tens = [as_torch(x) for x in sd.values()]
    return sum(int(t.reshape(-1).contiguous().view(torch.uint8).double().sum()) * (i + 1)
               for i, t in enumerate(tens))


def test_receivers_in_other_processes():
    sd = {"emb": torch.randn(300, 16), "bf": torch.randn(1000).to(torch.bfloat16),
          "ids": torch.arange(50, dtype=torch.int64)}
    name = unique("procs")
    env = dict(os.environ, PYTHONPATH=PYDIR)
    with ferry.RefitSender(name, sd, buffer_bytes=8192) as tx:
        kids = [subprocess.Popen([sys.executable, "-c", RECEIVER, name], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for _ in range(2)]
        try:
            for k in kids:
                assert k.stdout.readline().strip() == "attached"
            tx.wait_receivers(2, timeout=10)
            for v in (1, 2, 3):
                for t in sd.values():
                    t.add_(1)
                tx.push(v, timeout=10)
                for k in kids:
                    k.stdin.write("%d\n" % v)
                    k.stdin.flush()
                for k in kids:
                    assert k.stdout.readline().split() == [str(v), str(digest(sd))]
            # A receiver that dies fails the push for itself alone.
            kids[0].kill()
            kids[0].wait()
            for t in sd.values():
                t.add_(1)
            try:
                tx.push(4, timeout=5)
            except ferry.Error as e:  # the dead one is named; it may also be gone already
                assert "refit" in str(e)
            kids[1].stdin.write("4\n")
            kids[1].stdin.flush()
            assert kids[1].stdout.readline().split() == ["4", str(digest(sd))]
        finally:
            for k in kids:
                if k.poll() is None:
                    k.kill()
                k.wait()


STALLER = r"""
import sys, ferry
rx = ferry.RefitReceiver(sys.argv[1], timeout=10)
rx.tensors()
print("attached", flush=True)
for line in sys.stdin:
    if line.startswith("c"):
        print(rx.committed, flush=True)
        continue
    try:
        print("ok", rx.wait(int(line.split()[1]), timeout=5), flush=True)
    except ferry.Error as e:
        print(type(e).__name__, rx.committed, "torn" in str(e), flush=True)
"""


def stop(k):
    """SIGSTOPs child k and returns once every thread of it has stopped. kill() returns
    before that: the signal stops one thread, which then asks the others to stop, and until
    they do (on a loaded machine, until each is scheduled) a receiver's service thread may go
    on reading, acknowledging and committing a push that began meanwhile. waitpid(WUNTRACED)
    reports the child only once the whole group has stopped."""
    os.kill(k.pid, signal.SIGSTOP)
    pid, status = os.waitpid(k.pid, os.WUNTRACED)
    assert pid == k.pid and os.WIFSTOPPED(status), status


def test_stopped_receiver_fails_alone_and_reports_torn_bytes():
    sd = {"emb": torch.randn(3000, 16), "ids": torch.arange(50, dtype=torch.int64)}
    name = unique("stall")
    env = dict(os.environ, PYTHONPATH=PYDIR)
    with ferry.RefitSender(name, sd, buffer_bytes=8192) as tx:
        kids = [subprocess.Popen([sys.executable, "-c", STALLER, name], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for _ in range(2)]

        def ask(k, line):
            k.stdin.write(line + "\n")
            k.stdin.flush()
            return k.stdout.readline().split()

        try:
            for k in kids:
                assert k.stdout.readline().strip() == "attached"
            tx.wait_receivers(2, timeout=10)
            tx.push(1, timeout=10)
            assert [ask(k, "w 1") for k in kids] == [["ok", "1"], ["ok", "1"]]
            stop(kids[0])
            sd["emb"].add_(1)
            with pytest.raises(ferry.Timeout) as e:  # 3 s: the healthy one must ack in time
                tx.push(2, timeout=3)                  # on a loaded 2-core machine too
            # the stopped one alone is named (by its node, the process's: "<host>-<pid>")
            assert re.search(r"-%d\b" % kids[0].pid, str(e.value)), str(e.value)
            assert not re.search(r"-%d\b" % kids[1].pid, str(e.value)), str(e.value)
            assert ask(kids[1], "w 2") == ["ok", "2"]
            assert tx.receivers == 1
            # Version 3 differs from 2: the stopped one still has version 2's first
            # announcements queued on its link (no COMMIT: it acknowledged none of them), and
            # after SIGCONT it reads them from the sender's retained buffer, which holds version
            # 3 by then. Were the bytes equal, its checksums would pass; they differ, so the
            # first bucket that lands fails its checksum and the bytes are torn.
            sd["emb"].add_(1)
            tx.push(3, timeout=3)  # without it
            os.kill(kids[0].pid, signal.SIGCONT)
            tx.wait_receivers(2, timeout=10)  # it attached again
            assert ask(kids[0], "c") == ["0"]  # bytes of 2 landed over 1: no version
            # then it catches up to the latest version (3) from the sender, with no push
            assert ask(kids[0], "w 2") == ["ok", "3"]
            tx.push(4, timeout=10)
            assert [ask(k, "w 4") for k in kids] == [["ok", "4"], ["ok", "4"]]
        finally:
            for k in kids:
                if k.poll() is None:
                    os.kill(k.pid, signal.SIGCONT)
                    k.kill()
                k.wait()


def test_late_joiner_gets_the_latest_version_at_once():
    """A receiver that attaches after a push holds that version without another push: it
    catches up from the sender's retained buffer (not from the trainer's tensors, which moved
    on), and the next push lands as usual."""
    sd = {"w": torch.randn(64, 32), "b": torch.randn(100).to(torch.bfloat16)}
    name = unique("late")
    with ferry.RefitSender(name, sd, buffer_bytes=4096) as tx:
        tx.push(1)  # nobody attached yet
        sent = {k: v.clone() for k, v in sd.items()}
        for t in sd.values():
            t.add_(1)  # the trainer moves on
        with ferry.RefitReceiver(name, timeout=5) as rx:
            views = rx.tensors()
            assert rx.wait(1, timeout=10) == 1 and rx.committed == 1
            assert rx.wait(timeout=1) == 1  # the latest it knows of
            for k in sd:
                assert same(views[k], sent[k]), k
            assert tx.push(2) == 2 and rx.wait(2, timeout=10) == 2
            for k in sd:
                assert same(views[k], sd[k]), k


def test_late_joiner_in_another_process():
    """A receiver process that attaches after versions 1 and 2 reports 2 for wait(1), with no
    further push."""
    sd = {"emb": torch.randn(300, 16), "ids": torch.arange(50, dtype=torch.int64)}
    name = unique("lateproc")
    env = dict(os.environ, PYTHONPATH=PYDIR)
    with ferry.RefitSender(name, sd, buffer_bytes=2048) as tx:
        for v in (1, 2):
            for t in sd.values():
                t.add_(1)
            tx.push(v)
        kid = subprocess.Popen([sys.executable, "-c", RECEIVER, name], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert kid.stdout.readline().strip() == "attached"
            kid.stdin.write("1\n")
            kid.stdin.flush()
            assert kid.stdout.readline().split() == ["1", str(digest(sd))]
            tx.wait_receivers(1, timeout=10)
            for t in sd.values():
                t.add_(1)
            tx.push(3, timeout=10)
            kid.stdin.write("3\n")
            kid.stdin.flush()
            assert kid.stdout.readline().split() == ["3", str(digest(sd))]
        finally:
            kid.kill()
            kid.wait()


def test_wait_before_anything_is_bound_fails_at_once():
    """Issue 31, item 4: a receiver that waits before binding anything is told so at once, in
    both orders (right after a push, and as a late joiner), instead of "committing" a version
    whose bytes are nowhere or timing out with no hint; once bound it gets the version."""
    a = torch.arange(1024, dtype=torch.float32)
    name = unique("unbound")
    with ferry.RefitSender(name, {"a": a}, buffer_bytes=4096) as tx:
        with ferry.RefitReceiver(name, timeout=5) as rx:  # attached, then a push
            tx.push(1)
            with pytest.raises(ferry.StateError, match="nothing is bound"):
                rx.wait(1, timeout=1)
            v = rx.tensors()
            assert rx.wait(1, timeout=5) == 1 and same(v["a"], a)
            del v
        with ferry.RefitReceiver(name, timeout=5) as late:  # a late joiner, version 1 out there
            with pytest.raises(ferry.StateError, match="nothing is bound"):
                late.wait(timeout=1)
            out = {"a": torch.zeros(1024)}
            late.bind(out)
            assert late.wait(1, timeout=5) == 1 and same(out["a"], a)
