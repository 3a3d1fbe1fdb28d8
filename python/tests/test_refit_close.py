"""A receiver closed on its own service thread: a listener's allocation there runs a garbage
collection whose finalizer closes the receiver (the last reference was a cycle). The close is
handed to a Python thread (it also closes the context that thread serves), and the C side defers
a close from the service thread itself; before, the receiver was freed under its running thread
(a crash). In a child process, so that a crash or a hang fails the test."""
import os
import subprocess
import sys

import pytest

PYDIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import gc, sys, threading, time
import numpy as np
import ferry
gc.disable()  # the collection runs where the listener calls it, on the receiver's thread
name = sys.argv[1]
tx = ferry.RefitSender(name, {"o": np.ones((256, 64), np.float32)}, buffer_bytes=4096)
rx = ferry.RefitReceiver(name, timeout=5)
out = np.zeros((256, 64), np.float32)
rx.bind({"o": out})
class Box:
    pass
b = Box()
b.me, b.rx = b, rx
seen = []
def on_event(ev):
    seen.append(threading.current_thread().name)
    gc.collect()  # finalizes the cycle: RefitReceiver.close on this thread
rx._listen(on_event)
del rx, b
try:
    tx.push(1, timeout=5)
except ferry.Error:
    pass  # the receiver detached while the push ran: not committed by it
deadline = time.monotonic() + 10
while tx.receivers and time.monotonic() < deadline:
    time.sleep(0.01)  # the handed-over close detaches it
assert seen and tx.receivers == 0, (seen, tx.receivers)
tx.push(2, timeout=5)  # the sender goes on
tx.close()
print("ok")
"""


def test_receiver_closed_by_a_finalizer_on_its_own_thread(tmp_path):
    script = tmp_path / "close_on_own_thread.py"
    script.write_text(_CHILD)
    env = dict(os.environ, PYTHONPATH=PYDIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        out = subprocess.run([sys.executable, str(script), "pyclose-%d" % os.getpid()],
                             capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("hung: the receiver's close on its own thread deadlocked")
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode,
                                                               out.stderr[-2000:])
