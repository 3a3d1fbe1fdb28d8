"""A clean exit leaves nothing behind (issue 35): a script that ends with a refit sender still
open after asyncio.run(tx.push_async(1)), and an engine whose cell's ranks run in daemon threads,
exit 0 with FERRY_CTL_DIR empty and no /dev/shm entry of theirs. Before the fix the sender's
rendezvous file (ferry-refit-NAME) and the cell (ferry-ctl-NAME, then shown as stale) stayed."""
import os
import subprocess
import sys

PYDIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PUSH_ASYNC = r"""
import asyncio, sys
import numpy as np
import ferry
tx = ferry.RefitSender(sys.argv[1], {"w": np.arange(1000, dtype=np.float32)})
assert asyncio.run(tx.push_async(1)) == 1
print("pushed", flush=True)
"""

DAEMON_RANKS = r"""
import sys, threading
import ferry
name = sys.argv[1]
cell = ferry.ControlCell(name, 2)

def serve(rank):
    r = ferry.ControlRank(name, rank)
    while True:
        try:
            r.step(timeout=0.05)
        except ferry.Timeout:
            pass

for i in range(2):
    threading.Thread(target=serve, args=(i,), daemon=True).start()
c = ferry.Control(name)
assert c.wait_ranks(timeout=30) == 2
c.request("clear", 30)
c.request("update", 30)
print("served", flush=True)
"""


def run_script(code, name, ctl_dir):
    env = dict(os.environ, FERRY_CTL_DIR=str(ctl_dir))
    if os.environ.get("FERRY_TEST_INSTALLED") != "1":
        env["PYTHONPATH"] = PYDIR
    return subprocess.run([sys.executable, "-c", code, name], env=env, capture_output=True,
                          text=True, timeout=120)


def left_behind(name, ctl_dir):
    shm = [e for e in os.listdir("/dev/shm") if name in e] if os.path.isdir("/dev/shm") else []
    return sorted(os.listdir(ctl_dir)) + shm


def test_push_async_at_top_level_leaves_nothing(tmp_path):
    name = "exitclean-push-%d" % os.getpid()
    out = run_script(PUSH_ASYNC, name, tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "pushed", out.stderr
    assert left_behind(name, tmp_path) == []


def test_daemon_rank_threads_leave_no_cell(tmp_path):
    name = "exitclean-ctl-%d" % os.getpid()
    out = run_script(DAEMON_RANKS, name, tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "served", out.stderr
    assert left_behind(name, tmp_path) == []
