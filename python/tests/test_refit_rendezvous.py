"""The same-host refit rendezvous file (FERRY_CTL_DIR/ferry-refit-NAME) in a directory other users
may write (issue 32 rows 1 and 2, docs/RELIABILITY.md): a link another user planted is never
followed (no file of the victim's is overwritten), and a FIFO, a link or another user's file
under the name is refused at once with ferry.AccessDenied saying what is there, never waited on.
Each case runs under an alarm, so a hang fails it instead of the suite."""
import contextlib
import os
import signal
import subprocess

import numpy as np
import pytest

import ferry

_n = [0]


def unique(tag):
    _n[0] += 1
    return "rdv-%d-%s-%d" % (os.getpid(), tag, _n[0])


@pytest.fixture
def shared(tmp_path, monkeypatch):
    """A world-writable sticky directory (as /dev/shm) as FERRY_CTL_DIR, no directory."""
    d = tmp_path / "shm"
    d.mkdir()
    d.chmod(0o1777)
    monkeypatch.setenv("FERRY_CTL_DIR", str(d))
    monkeypatch.delenv("FERRY_DIRECTORY", raising=False)
    return d


@contextlib.contextmanager
def bounded(seconds):
    """Fails (instead of hanging) when the body takes longer than `seconds`: a hang detector."""
    def hung(*_):
        raise AssertionError("hung for %d s" % seconds)
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def weights():
    return {"w": np.arange(16, dtype=np.float32)}


def test_planted_links_never_followed(shared, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    name = unique("link")
    path = shared / ("ferry-refit-" + name)
    # what the old sender would have opened O_TRUNC: NAME.PID.tmp, for a few pids around ours
    for pid in range(os.getpid() - 2, os.getpid() + 3):
        os.symlink(str(victim), "%s.%d.tmp" % (path, pid))
    with bounded(20):
        with ferry.RefitSender(name, weights()) as tx:
            assert victim.read_bytes() == b"precious\n"
            assert not path.is_symlink() and path.is_file()
            assert path.read_text().split("\n")[:2] == [tx.address, str(os.getpid())]
    assert victim.read_bytes() == b"precious\n"
    assert not path.exists()


def test_link_under_the_name_refused(shared, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("tcp://127.0.0.1:1\n%d\n" % os.getpid())  # looks like a live sender's
    name = unique("name")
    os.symlink(str(victim), str(shared / ("ferry-refit-" + name)))
    with bounded(20):
        with pytest.raises(ferry.AccessDenied, match="symbolic link"):
            ferry.RefitSender(name, weights())
        with pytest.raises(ferry.AccessDenied, match="symbolic link"):
            ferry.RefitReceiver(name, timeout=3)
    assert victim.read_text() == "tcp://127.0.0.1:1\n%d\n" % os.getpid()


def test_planted_fifo_refused_at_once(shared):
    name = unique("fifo")
    os.mkfifo(str(shared / ("ferry-refit-" + name)))
    with bounded(20):  # the old open() blocked for ever, past timeout=3
        with pytest.raises(ferry.AccessDenied, match="FIFO"):
            ferry.RefitReceiver(name, timeout=3)
        with pytest.raises(ferry.AccessDenied, match="FIFO"):
            ferry.RefitSender(name, weights())


def test_other_users_file_refused(shared):
    if os.geteuid() != 0:
        pytest.skip("making a file of another user's needs root (CI runs as root)")
    name = unique("owner")
    path = shared / ("ferry-refit-" + name)
    path.write_text("tcp://127.0.0.1:1\n%d\n" % os.getpid())  # a forged live sender
    os.chown(str(path), 65534, 65534)
    with bounded(20):
        with pytest.raises(ferry.AccessDenied, match="owned by uid 65534"):
            ferry.RefitReceiver(name, timeout=3)
        with pytest.raises(ferry.AccessDenied, match="owned by uid 65534"):
            ferry.RefitSender(name, weights())
    assert path.read_text() == "tcp://127.0.0.1:1\n%d\n" % os.getpid()


def _ferry_cli():
    lib = os.environ.get("FERRY_LIB")
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for d in ([os.path.dirname(lib)] if lib else []) + [os.path.join(here, "build")]:
        if os.access(os.path.join(d, "ferry"), os.X_OK):
            return os.path.join(d, "ferry")
    pytest.skip("no ferry CLI built beside FERRY_LIB or in build/")


def test_gc_skips_planted_files(shared, tmp_path):
    """`ferry gc` skips a FIFO, a link or another user's file named like a rendezvous, saying
    why, instead of hanging on the FIFO; a dead sender's own file is still removed."""
    fifo = shared / ("ferry-refit-" + unique("gcfifo"))
    os.mkfifo(str(fifo))
    victim = tmp_path / "victim"
    victim.write_text("tcp://127.0.0.1:1\n999999999\n")
    link = shared / ("ferry-refit-" + unique("gclink"))
    os.symlink(str(victim), str(link))
    dead = shared / ("ferry-refit-" + unique("gcdead"))
    dead.write_text("tcp://127.0.0.1:1\n999999999\n")  # no such pid
    out = subprocess.run([_ferry_cli(), "gc"], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert "FIFO" in out.stderr and "symbolic link" in out.stderr
    assert "removed %s" % dead in out.stdout
    assert fifo.exists() and link.is_symlink() and victim.exists() and not dead.exists()
