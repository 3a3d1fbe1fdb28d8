"""Refit senders by name across C and Python: with a directory (`ferry serve` on loopback, as
FERRY_DIRECTORY) a Python receiver finds a C sender and a C receiver (tests/refit_peer.c, which
calls ferry_refit_opts.publish and ferry_refit_receiver_open with a bare name) finds a Python
sender, over each route; one name has one live sender whichever language holds it; with no
directory configured Python falls back to the same-host file in FERRY_CTL_DIR."""
import os
import socket
import subprocess

import numpy as np
import pytest

import ferry

torch = pytest.importorskip("torch")

PY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_n = [0]


def unique(tag):
    _n[0] += 1
    return "pyname-%d-%s-%d" % (os.getpid(), tag, _n[0])


def built(*rel):
    """A program of this build: beside FERRY_LIB (make test) or under build/."""
    lib = os.environ.get("FERRY_LIB")
    for d in ([os.path.dirname(lib)] if lib else []) + [os.path.join(os.path.dirname(PY), "build")]:
        p = os.path.join(d, *rel)
        if os.access(p, os.X_OK):
            return p
    pytest.skip("no %s built beside FERRY_LIB or in build/" % os.path.join(*rel))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def directory(monkeypatch):
    """`ferry serve` hosting the directory on a free loopback port; FERRY_DIRECTORY names it
    here and in every process started from here."""
    url = "ferry://127.0.0.1:%d" % free_port()
    env = dict(os.environ, FERRY_DIRECTORY=url)
    serve = subprocess.Popen([built("ferry"), "serve", "--name", unique("dir")], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = serve.stdout.readline()
        assert line.startswith("ready"), line
        monkeypatch.setenv("FERRY_DIRECTORY", url)
        yield url
    finally:
        serve.kill()
        serve.wait()


def values(v):
    """What refit_peer sends and checks for version v."""
    w = (v + np.arange(64 * 48, dtype=np.float32) / 4).astype(np.float32).reshape(64, 48)
    ids = v * 1000 + np.arange(100, dtype=np.int64)
    return {"w": torch.from_numpy(w), "ids": torch.from_numpy(ids)}


class Peer:
    """tests/refit_peer: one line in, one line out."""

    def __init__(self, *args, env=None):
        self.p = subprocess.Popen([built("tests", "refit_peer")] + list(args), text=True,
                                  env=dict(os.environ, **(env or {})), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def line(self):
        return self.p.stdout.readline().strip()

    def ask(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.line()

    def close(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def test_python_receiver_finds_a_c_sender(directory):
    name = unique("csend")
    peer = Peer("send", name)
    try:
        assert peer.line() == "ready"
        with ferry.RefitReceiver(name, timeout=10) as rx:  # looked up in the directory
            views = rx.tensors()
            assert peer.ask("receivers 1") == "ok 1"
            for v, route in ((1, "auto"), (2, "direct"), (3, "chain")):
                assert peer.ask("push %d %s" % (v, route)) == "pushed %d 0" % v
                assert rx.wait(v, timeout=10) == v
                for k, t in values(v).items():
                    assert torch.equal(views[k], t), (v, k)
            # and loads as it lands: a C sender's buckets, Python's updates()
            it = rx.updates(4, timeout=10)
            assert peer.ask("push 4 auto") == "pushed 4 0"
            got = dict(it)
            assert it.version == 4 and sorted(got) == ["ids", "w"]
            for k, t in values(4).items():
                assert torch.equal(got[k], t), k
    finally:
        peer.close()


def test_c_receiver_finds_a_python_sender(directory):
    name = unique("pysend")
    sd = values(0)
    with ferry.RefitSender(name, sd) as tx:
        assert tx.directory == directory
        assert not os.path.exists(ferry.refit.refit_address(name))  # no same-host file
        # the C receiver reads over tcp only, as one on another host would
        peer = Peer("recv", name, env={"FERRY_TRANSPORTS": "tcp"})
        try:
            assert peer.line() == "attached"
            tx.wait_receivers(1, timeout=10)
            for v, route in ((1, "direct"), (2, "chain"), (3, "auto")):
                for k, t in values(v).items():
                    sd[k].copy_(t)
                assert tx.push(v, route=route, timeout=10) == v
                assert peer.ask("wait %d" % v) == "got %d ok" % v
        finally:
            peer.close()


def test_one_live_sender_per_name_across_languages(directory):
    name = unique("dup")
    with ferry.RefitSender(name, values(1)):
        peer = Peer("send", name)
        try:
            assert peer.p.wait(timeout=30) != 0  # the C sender cannot take the name
            assert "refit:" in peer.p.stderr.read()
        finally:
            peer.close()
        with pytest.raises(ferry.AlreadyExists):
            ferry.RefitSender(name, values(1))
    peer = Peer("send", name)  # the name is free again once the Python sender closed
    try:
        assert peer.line() == "ready"
        with pytest.raises(ferry.AlreadyExists):
            ferry.RefitSender(name, values(1))
    finally:
        peer.close()


def test_python_sender_and_receiver_in_the_directory(directory):
    """Python on both sides: by name through the directory, the receiver started first (it
    waits for the name to appear) in another process over tcp only."""
    name = unique("both")
    code = ("import sys, ferry\n"
            "rx = ferry.RefitReceiver(sys.argv[1], timeout=20)\n"
            "views = rx.tensors()\n"
            "print('attached', flush=True)\n"
            "print(rx.wait(1, timeout=20), float(views['w'].sum()), flush=True)\n")
    env = dict(os.environ, PYTHONPATH=PY, FERRY_TRANSPORTS="tcp")
    kid = subprocess.Popen([os.environ.get("PYTHON", __import__("sys").executable), "-c", code,
                            name], env=env, stdout=subprocess.PIPE, text=True)
    try:
        sd = values(1)
        with ferry.RefitSender(name, sd) as tx:
            assert kid.stdout.readline().strip() == "attached"
            tx.wait_receivers(1, timeout=20)
            tx.push(1, timeout=10)
            assert kid.stdout.readline().split() == ["1", repr(float(sd["w"].sum()))]
    finally:
        kid.kill()
        kid.wait()


def test_without_a_directory_the_same_host_file(monkeypatch):
    monkeypatch.delenv("FERRY_DIRECTORY", raising=False)
    name = unique("file")
    with ferry.RefitSender(name, values(1)) as tx:
        assert tx.directory is None
        path = ferry.refit.refit_address(name)
        assert open(path).read().split("\n")[0] == tx.address
        with ferry.RefitReceiver(name, timeout=5) as rx:
            views = rx.tensors()
            tx.push(1)
            assert rx.wait(1, timeout=10) == 1 and torch.equal(views["w"], values(1)["w"])
    assert not os.path.exists(path)
