"""RefitSender.push_iter (issue 35 deliverable 3): versions pushed from an iterable of transient
tensors under a memory cap. One and two receivers get every byte; the tensors the iterable made
are let go as their buckets go (the most alive at once stays near the cap, far below the model);
a tensor bigger than the cap goes alone; the plan is made once and reused; a changed shape,
dtype or name set raises naming the tensor, and the next push_iter plans anew; an iterable that
raises mid-way leaves no receiver reporting that version and the sender usable; a sender killed
between parts leaves its receiver torn (committed 0), and the next whole version commits."""
import gc
import os
import signal
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest

import ferry
from ferry.refit.stream import PlanChanged

PYDIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_n = [0]


def unique(tag):
    _n[0] += 1
    return "pystream-%d-%s-%d" % (os.getpid(), tag, _n[0])


NAMES = ["layer.%d.%s" % (i, k) for i in range(30) for k in ("w", "b", "n")]


def shape_of(i):
    return (1 + i % 4, 40 + (i * 97) % 700)


def dtype_of(i):
    return (np.float32, np.int64, np.float16, np.uint8)[i % 4]


def tensor(i, version):
    """Tensor i of `version`: new memory, values that differ per version."""
    shape, dt = shape_of(i), dtype_of(i)
    n = shape[0] * shape[1]
    return ((np.arange(n, dtype=np.int64) * 7 + i * 13 + version * 101) % 251).astype(
        dt).reshape(shape)


MODEL_BYTES = sum(tensor(i, 0).nbytes for i in range(len(NAMES)))
BIGGEST = max(tensor(i, 0).nbytes for i in range(len(NAMES)))


class Live:
    """Counts the bytes of the yielded tensors still alive (weakref finalizers)."""

    def __init__(self):
        self.now = self.most = 0

    def gone(self, n):
        self.now -= n

    def made(self, t):
        self.now += t.nbytes
        self.most = max(self.most, self.now)
        weakref.finalize(t, self.gone, t.nbytes)


def weights(version, live=None, fail_at=None, change=None):
    """The generator a trainer hands over: each tensor made as it is asked for, and dropped by
    the generator once yielded."""
    for i, name in enumerate(NAMES):
        if fail_at is not None and i == fail_at:
            raise RuntimeError("the trainer's gather failed at %s" % name)
        t = tensor(i, version)
        if change and name in change:
            t = change[name](t)
            if t is None:
                continue
        if live is not None:
            live.made(t)
        yield name, t
        del t


def settled(tx, version, n=1):
    """Waits until the sender counts n receivers holding `version` (a late joiner's catch-up is
    over there too: one still catching up when a push begins is left out of it, by design)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        have = [m["value"] for m in ferry.stats(tx._ctx)
                if m["name"] == "ferry_refit_receiver_committed_version"]
        if len(have) == n and all(v == version for v in have):
            return
        time.sleep(0.01)
    raise AssertionError("receivers of %s did not settle on version %d" % (tx.name, version))


def expected(version):
    return {name: tensor(i, version) for i, name in enumerate(NAMES)}


def assert_holds(views, version):
    for name, want in expected(version).items():
        got = np.asarray(views[name])
        assert got.shape == want.shape and got.tobytes() == want.tobytes(), name


def test_push_iter_to_one_and_two_receivers():
    cap = 16 << 10
    assert MODEL_BYTES > 8 * cap
    name = unique("two")
    with ferry.RefitSender(name, stream_cap=cap) as tx:
        assert tx.push_iter(1, weights(1)) == 1  # plans: staged whole, pushed to nobody
        plan = tx._plan
        with ferry.RefitReceiver(name, timeout=5) as rx1:
            v1 = rx1.tensors(like="numpy")
            assert rx1.wait(1, timeout=10) == 1  # caught up from the retained copy
            assert_holds(v1, 1)
            settled(tx, 1)
            live = Live()
            assert tx.push_iter(2, weights(2, live), timeout=10) == 2
            assert rx1.committed == 2
            assert_holds(v1, 2)
            assert tx.stream_info["parts"] >= 4
            # the tensors went as their buckets went: never the model, about the cap at most
            # (a part goes once half the cap came since the last; the tensors that share a
            # bucket with the next one stay until it goes)
            bound = 2 * cap + 2 * BIGGEST
            assert bound < MODEL_BYTES / 2
            assert live.most <= bound, (live.most, cap)
            assert tx.stream_info["held_max"] <= bound
            gc.collect()
            assert live.now == 0  # nothing held after the push
            with ferry.RefitReceiver(name, timeout=5) as rx2:
                v2 = rx2.tensors(like="numpy")
                assert rx2.wait(2, timeout=10) == 2
                settled(tx, 2, n=2)
                for v in (3, 4):
                    assert tx.push_iter(None, weights(v), timeout=10) == v
                    for rx, views in ((rx1, v1), (rx2, v2)):
                        assert rx.wait(v, timeout=10) == v
                        assert_holds(views, v)
        assert tx._plan is plan  # made by the first push_iter, reused since


def test_plan_from_metadata_streams_the_first_version():
    """plan() from shapes and dtypes alone: receivers attach and bind before any version, and
    the first push_iter streams under the cap like the later ones (nothing staged whole)."""
    cap = 16 << 10
    name = unique("meta")
    meta = [(n, (shape_of(i), dtype_of(i)) if i % 2 else tensor(i, 0))
            for i, n in enumerate(NAMES)]
    with ferry.RefitSender(name, stream_cap=cap) as tx:
        tx.plan(iter(meta))
        assert [m["name"] for m in tx.manifest()] == NAMES
        with ferry.RefitReceiver(name, timeout=5) as rx:
            engine = {n: np.zeros_like(t) for n, t in expected(0).items()}
            rx.bind(engine)
            assert rx.committed == 0
            settled(tx, 0)
            for v in (1, 2):
                live = Live()
                assert tx.push_iter(v, weights(v, live), timeout=10) == v
                assert rx.wait(v, timeout=10) == v
                assert_holds(engine, v)
                assert tx.stream_info["parts"] >= 4
                assert live.most <= 2 * cap + 2 * BIGGEST < MODEL_BYTES / 2
        with pytest.raises(ferry.InvalidArgument, match="once"):
            tx.plan(iter(meta))


def test_cap_smaller_than_a_tensor():
    """A tensor bigger than the cap is sent in a part of its own (with what shares its
    buckets): the version lands whole."""
    cap = 2048
    assert BIGGEST > 4 * cap
    name = unique("small")
    with ferry.RefitSender(name, stream_cap=cap) as tx:
        tx.push_iter(1, weights(1))
        with ferry.RefitReceiver(name, timeout=5) as rx:
            views = rx.tensors(like="numpy")
            rx.wait(1, timeout=10)
            tx.push_iter(2, weights(2), timeout=10)
            assert rx.wait(2, timeout=10) == 2
            assert_holds(views, 2)
            assert tx.stream_info["parts"] > len(NAMES) // 4
    with pytest.raises(ferry.InvalidArgument, match="half the cap"):
        ferry.RefitSender(unique("bad"), stream_cap=cap, buffer_bytes=cap)


def test_iterable_raising_mid_way():
    name = unique("raise")
    with ferry.RefitSender(name, stream_cap=32 << 10) as tx:
        tx.push_iter(1, weights(1))
        with ferry.RefitReceiver(name, timeout=5) as rx:
            views = rx.tensors(like="numpy")
            rx.wait(1, timeout=10)
            settled(tx, 1)
            with pytest.raises(RuntimeError, match="gather failed"):
                tx.push_iter(2, weights(2, fail_at=len(NAMES) // 2), timeout=10)
            assert rx.committed == 0  # parts of 2 landed over 1: no version, never 2
            with pytest.raises(ferry.Error):
                rx.wait(2, timeout=0.5)
            with pytest.raises(ferry.InvalidArgument, match="not after"):
                tx.push_iter(2, weights(2))  # a version begun spends its number
            assert tx.push_iter(None, weights(3), timeout=10) == 3  # and the sender goes on
            assert rx.wait(3, timeout=10) == 3
            assert_holds(views, 3)


def test_changed_shape_dtype_or_names():
    name = unique("changed")
    reshape = {NAMES[45]: lambda t: t.reshape(-1)}
    with ferry.RefitSender(name, stream_cap=32 << 10) as tx:
        tx.push_iter(1, weights(1))
        plan = tx._plan
        with ferry.RefitReceiver(name, timeout=5) as rx:
            rx.tensors(like="numpy")
            rx.wait(1, timeout=10)
            settled(tx, 1)
            for change in (reshape, {NAMES[45]: lambda t: t.astype(np.float64)},
                           {NAMES[45]: lambda t: None}):
                v = tx.version + 1
                with pytest.raises(PlanChanged, match=NAMES[45].replace(".", r"\.")):
                    tx.push_iter(v, weights(v, change=change), timeout=10)
                assert tx._plan is None and tx.version == v  # the version was spent
                assert rx.committed == 0  # parts of it landed: torn, never v
                tx.push_iter(None, weights(v + 1), timeout=10)  # plans anew (the same set)
                assert tx._plan is not plan
                plan = tx._plan
                assert rx.wait(v + 1, timeout=10) == v + 1
                settled(tx, v + 1)
        # a new shape is taken by the plan made after it raised; receivers see it
        v = tx.version + 1
        with pytest.raises(PlanChanged):
            tx.push_iter(v, weights(v, change=reshape))
        tx.push_iter(v + 1, weights(v + 1, change=reshape))
        with ferry.RefitReceiver(name, timeout=5) as rx2:
            views = rx2.tensors(like="numpy")
            assert rx2.wait(v + 1, timeout=10) == v + 1
            assert np.asarray(views[NAMES[45]]).shape == (tensor(45, 0).size,)
        # a plan only grows: a name missing when it plans again raises, saying so
        with pytest.raises(PlanChanged):
            tx.push_iter(None, weights(9, change={NAMES[45]: lambda t: None}))
        with pytest.raises(PlanChanged, match="only grows"):
            tx.push_iter(None, weights(9, change={NAMES[45]: lambda t: None}))


def test_streaming_and_declared_senders_keep_to_their_calls():
    name = unique("calls")
    with ferry.RefitSender(name, stream_cap=1 << 20) as tx:
        with pytest.raises(ferry.StateError, match="push_iter"):
            tx.push(1)
    with ferry.RefitSender(unique("declared"), {"w": np.zeros(4, np.float32)}) as tx:
        with pytest.raises(ferry.StateError, match="push\\(\\)"):
            tx.push_iter(1, iter([("w", np.zeros(4, np.float32))]))


KILLED = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[2])
import ferry
from test_refit_stream import weights, settled, NAMES
tx = ferry.RefitSender(sys.argv[1], stream_cap=32 << 10)
tx.push_iter(1, weights(1))
print("ready", flush=True)
sys.stdin.readline()
settled(tx, 1)  # the receiver caught up: it is in version 2
def dying():
    for i, (name, t) in enumerate(weights(2)):
        if i == len(NAMES) // 2:  # parts of version 2 went already
            os.kill(os.getpid(), signal.SIGKILL)
        yield name, t
tx.push_iter(2, dying(), timeout=10)
"""


def test_sender_killed_between_parts():
    name = unique("killed")
    env = dict(os.environ, PYTHONPATH=PYDIR)
    kid = subprocess.Popen([sys.executable, "-c", KILLED, name, os.path.dirname(
        os.path.abspath(__file__))], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        assert kid.stdout.readline().strip() == "ready"
        engine = {n: np.zeros_like(t) for n, t in expected(1).items()}
        rx = ferry.RefitReceiver(name, timeout=5)
        rx.bind(engine)
        assert rx.wait(1, timeout=10) == 1
        assert_holds(engine, 1)
        kid.stdin.write("go\n")
        kid.stdin.flush()
        assert kid.wait(timeout=30) == -signal.SIGKILL
        with pytest.raises(ferry.PeerGone):
            rx.wait(2, timeout=10)
        assert rx.committed == 0  # version 2's first parts landed over 1: neither is reported
        rx.close()
        # the trainer comes back: its next version, whole, lands in the same tensors
        with ferry.RefitSender(name, stream_cap=32 << 10) as tx:
            tx.push_iter(3, weights(3))
            with ferry.RefitReceiver(name, timeout=5) as rx:
                rx.bind(engine)
                assert rx.wait(3, timeout=10) == 3
                assert_holds(engine, 3)
    finally:
        if kid.poll() is None:
            kid.kill()
        kid.wait()
