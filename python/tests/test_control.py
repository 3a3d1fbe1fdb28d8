"""ferry.Control / ControlRank / ControlCell: the lifecycle with ranks in threads and in other
processes, status, every error a request can raise, and the refit commit as the update step."""
import os
import subprocess
import sys
import threading

import pytest

import ferry

PYDIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_n = [0]


def unique(tag):
    _n[0] += 1
    return "pyctl-%d-%s-%d" % (os.getpid(), tag, _n[0])


class Ranks:
    """R ranks of a cell, each stepping in its own thread until stopped."""

    def __init__(self, name, n, **handlers):
        self.ranks = [ferry.ControlRank(name, i) for i in range(n)]
        self.handled = [[] for _ in range(n)]
        self.handlers = handlers
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _loop(self, i):
        r = self.ranks[i]
        h = {k: (lambda f=f: f(i)) for k, f in self.handlers.items() if k != "abort"}
        while not self.stop.is_set():
            try:
                self.handled[i].append(r.step(timeout=0.05, **h))
            except ferry.Timeout:
                pass

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join()
        for r in self.ranks:
            r.close()


def test_lifecycle_and_status():
    name = unique("life")
    cleared = []
    with ferry.ControlCell(name, 3) as cell, ferry.Control(name) as c:
        assert cell.incarnation == 1
        ranks = Ranks(name, 3, clear=cleared.append)
        try:
            st = c.status()
            assert st["nranks"] == 3 and st["state"] == "serving" and st["seq"] == 0
            assert st["engine_alive"] and st["engine_pid"] == os.getpid()
            assert st["cmd"] == "none" and not st["in_flight"]
            c.request("clear", timeout=10)
            assert sorted(cleared) == [0, 1, 2]
            st = c.status()
            assert (st["state"], st["seq"], st["cmd"], st["agreed"]) == ("cleared", 1, "clear",
                                                                         True)
            assert [r["state"] for r in st["ranks"]] == ["cleared"] * 3
            c.request("clear", timeout=10)  # while cleared: done at once, nothing issued
            assert c.status()["seq"] == 1
            c.request("update", timeout=10)
            st = c.status()
            assert st["state"] == "serving" and st["seq"] == 2 and st["cmd"] == "update"
        finally:
            ranks.close()
        assert [c.cmd for c in ranks.handled[0]] == ["clear", "update"]
        assert ranks.handled[0][0].seq == 1


def test_request_errors():
    name = unique("errs")
    with pytest.raises(ferry.NotFound):
        ferry.Control(name)
    with pytest.raises(ferry.NotFound):
        ferry.ControlRank(name, 0)
    with ferry.ControlCell(name, 2):
        with pytest.raises(ferry.AlreadyExists):
            ferry.ControlCell(name, 2)
        with pytest.raises(ferry.OutOfBounds):
            ferry.ControlRank(name, 2)
        c = ferry.Control(name)
        with pytest.raises(ferry.InvalidArgument):
            c.request("explode")
        with pytest.raises(ferry.PeerGone):  # no rank attached yet
            c.request("clear", timeout=1)
        r0 = ferry.ControlRank(name, 0)
        with pytest.raises(ferry.Busy):  # a live process holds rank 0
            ferry.ControlRank(name, 0)
        r1 = ferry.ControlRank(name, 1)
        with pytest.raises(ferry.StateError) as ei:  # update needs every rank cleared
            c.request("update", timeout=1)
        assert "clear it first" in str(ei.value) and ei.value.name == "FERRY_ESTATE"
        # Nobody steps: the request times out, the command stays issued.
        with pytest.raises(ferry.Timeout):
            c.request("clear", timeout=0.05)
        with pytest.raises(ferry.Busy):  # in flight
            c.request("clear", timeout=0.05)
        assert c.status(ranks=False)["in_flight"]
        assert r0.wait(0).cmd == "clear" and r1.wait(0).cmd == "clear"
        with pytest.raises(ferry.StateError):
            r0.ack("serving")  # clear cannot end serving
        with pytest.raises(ferry.Timeout):
            r0.wait(0)  # nothing newer
        r0.ack()
        r1.ack(error=ferry.ChecksumError(-22, "bad bytes"))
        st = c.status()
        assert st["state"] == "failed" and st["ranks"][1]["message"] == "bad bytes"
        assert st["ranks"][1]["error"] == -22
        r0.close()
        r1.close()
        with pytest.raises(ferry.PeerGone):  # ranks detached
            c.request("clear", timeout=1)
        c.close()


def test_failing_rank_raises_its_error():
    name = unique("fail")

    def update(i):
        if i == 1:
            raise ferry.ChecksumError(-22, "bucket 3")

    with ferry.ControlCell(name, 2), ferry.Control(name) as c:
        ranks = Ranks(name, 2, update=update)
        try:
            c.request("clear", 10)
            with pytest.raises(ferry.ChecksumError) as ei:
                c.request("update", 10)
            assert "rank 1" in str(ei.value)
            st = c.status()
            assert st["ranks"][0]["state"] == "serving" and st["ranks"][1]["state"] == "failed"
            assert st["ranks"][1]["message"] == "bucket 3"
            c.request("clear", 10)  # the way back from failed
            assert c.status()["state"] == "cleared"
        finally:
            ranks.close()


def test_python_exception_in_a_handler():
    name = unique("exc")
    with ferry.ControlCell(name, 1), ferry.Control(name) as c:
        ranks = Ranks(name, 1, clear=lambda i: {}["missing"])
        try:
            with pytest.raises(ferry.Error) as ei:
                c.request("clear", 10)
            assert "KeyError" in str(ei.value)
        finally:
            ranks.close()


def test_rank_that_starts_cleared():
    name = unique("empty")
    with ferry.ControlCell(name, 1), ferry.Control(name) as c:
        r = ferry.ControlRank(name, 0, initial_state="cleared")
        assert c.status()["state"] == "cleared"
        with pytest.raises(ferry.InvalidArgument):
            ferry.ControlRank(name, 0, initial_state="sleepy")
        loaded = []
        t = threading.Thread(target=lambda: r.step(timeout=10, update=lambda: loaded.append(1)))
        t.start()
        c.request("update", 10)  # an engine that starts empty loads its first weights
        t.join()
        assert loaded == [1] and c.status()["state"] == "serving" and r.state == "serving"
        r.close()


def test_abort_supersedes():
    name = unique("abort")
    with ferry.ControlCell(name, 1), ferry.Control(name) as c:
        r = ferry.ControlRank(name, 0)
        with pytest.raises(ferry.Timeout):
            c.request("clear", 0.05)
        assert r.wait(0).cmd == "clear"  # taken, never acked (the rank is stuck in it)
        done = []
        t = threading.Thread(target=lambda: done.append(c.request("abort", 10)))
        t.start()
        cmd = r.step(timeout=10, abort=lambda: "serving")
        t.join()
        assert cmd.cmd == "abort" and done == [None]
        assert c.status()["state"] == "serving"
        r.close()


RANK = r"""
import sys, ferry
r = ferry.ControlRank(sys.argv[1], int(sys.argv[2]))
print("ready", flush=True)
while True:
    try:
        cmd = r.step(timeout=0.2, clear=lambda: print("clear", flush=True),
                     update=lambda: print("update", flush=True))
    except ferry.Timeout:
        continue
"""

ENGINE = r"""
import sys, ferry
cell = ferry.ControlCell(sys.argv[1], 1)
print(cell.incarnation, flush=True)
sys.stdin.readline()
"""


def spawn(code, *args):
    env = dict(os.environ, PYTHONPATH=PYDIR)
    return subprocess.Popen([sys.executable, "-c", code] + list(args), env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_ranks_in_other_processes_and_a_dead_rank():
    name = unique("procs")
    with ferry.ControlCell(name, 2), ferry.Control(name) as c:
        kids = [spawn(RANK, name, str(i)) for i in range(2)]
        try:
            for k in kids:
                assert k.stdout.readline().strip() == "ready"
            c.request("clear", 10)
            for k in kids:
                assert k.stdout.readline().strip() == "clear"
            c.request("update", 10)
            for k in kids:
                assert k.stdout.readline().strip() == "update"
            st = c.status()
            assert st["state"] == "serving"
            assert sorted(r["pid"] for r in st["ranks"]) == sorted(k.pid for k in kids)
            kids[1].kill()
            kids[1].wait()
            with pytest.raises(ferry.PeerGone) as ei:
                c.request("clear", 10)
            assert "rank 1" in str(ei.value)
        finally:
            for k in kids:
                if k.poll() is None:
                    k.kill()
                k.wait()


def test_dead_engine_is_stale_and_replaced():
    name = unique("stale")
    eng = spawn(ENGINE, name)
    try:
        assert eng.stdout.readline().strip() == "1"
        c = ferry.Control(name)
    finally:
        eng.kill()
        eng.wait()
    assert not c.status(ranks=False)["engine_alive"]
    with pytest.raises(ferry.Stale):
        c.request("clear", 1)
    with ferry.ControlCell(name, 1) as cell:  # the next incarnation replaces it
        assert cell.incarnation == 2
        with pytest.raises(ferry.Stale):
            c.request("clear", 1)
    c.close()


def test_refit_commit_ends_updating():
    """The update handler is the refit receiver's commit: serving only with verified weights."""
    torch = pytest.importorskip("torch")
    name = unique("refit")
    w = torch.zeros(256)
    with ferry.ControlCell(name, 1), ferry.Control(name) as c, \
            ferry.RefitSender(name, {"w": w}) as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        dst = {"w": torch.empty(256)}
        rx.bind(dst)
        ranks = Ranks(name, 1, update=lambda i: rx.wait(1, timeout=10))
        try:
            c.request("clear", 10)
            w.fill_(4)
            tx.push(1)
            c.request("update", 10)
            assert dst["w"].eq(4).all() and rx.committed == 1
        finally:
            ranks.close()


def test_wait_ranks():
    # A request right after the ranks' threads start used to fail "rank 1 is not attached";
    # wait_ranks waits for them, and says which are missing when they do not come.
    name = unique("wait")
    with ferry.ControlCell(name, 2), ferry.Control(name) as c:
        with pytest.raises(ferry.Timeout) as ei:
            c.wait_ranks(timeout=0)
        assert "0 of 2 ranks attached" in str(ei.value) and "missing: 0, 1" in str(ei.value)
        with pytest.raises(ferry.InvalidArgument):
            c.wait_ranks(3, timeout=0)
        r0 = ferry.ControlRank(name, 0)
        try:
            assert c.wait_ranks(1, timeout=0) == 1
            with pytest.raises(ferry.Timeout) as ei:
                c.wait_ranks(timeout=0)
            assert "missing: 1" in str(ei.value)
        finally:
            r0.close()
        assert c.wait_ranks(0, timeout=0) == 0
        stop = threading.Event()

        def serve(i):  # each rank attaches on its own thread, as an engine's ranks do
            with ferry.ControlRank(name, i) as r:
                while not stop.is_set():
                    try:
                        r.step(timeout=0.05)
                    except ferry.Timeout:
                        pass

        threads = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        try:
            assert c.wait_ranks(timeout=30) == 2
            c.request("clear", 30)
            assert c.status()["state"] == "cleared"
        finally:
            stop.set()
            for t in threads:
                t.join()
