"""One default-context policy for every handle (issue 33 deliverable 6): a Store, an MQ and a
RefitReceiver opened without ctx= share the process's default context, so the process is one
node (one directory node, one set of transport threads). A second handle of a kind the default
holds already (the C library allows one store, one mq, one refit receiver per context) gets a
context of its own, named after the default's, closed with it; once the first closes, the
default takes that kind again. RefitSender keeps a context of its own: its receivers learn that
it closed only when its links die (ferry/refit/sender.py)."""
import os
import subprocess
import sys

PY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import sys
sys.path.insert(0, %(py)r)
import gc
import numpy as np
import ferry

d = ferry.default_context()
s = ferry.Store(host_directory=True)
mq = ferry.MQ(s.directory)
tx = ferry.RefitSender(%(name)r, {"w": np.arange(256, dtype=np.float32)})
rx = ferry.RefitReceiver(%(name)r, timeout=10)
assert s.context is d and mq.context is d and rx._ctx is d, "not one node"
assert tx._ctx is not d
assert not s._owns_ctx and not mq._owns_ctx and not rx._owns_ctx

# the receiver on the shared context works, and its close tells the sender
out = rx.tensors()
tx.push(1, timeout=10)
assert rx.wait(1, timeout=10) == 1 and np.array_equal(out["w"], np.arange(256))

# a second of a kind: a context of its own, numbered after the default's name
mq2 = ferry.MQ(s.directory)
rx2 = ferry.RefitReceiver(%(name)r, timeout=10)
assert mq2.context is not d and mq2._owns_ctx and mq2.name.startswith(d.name + "-"), mq2.name
assert rx2._ctx is not d and rx2._owns_ctx and rx2._ctx.name != mq2.name
tx.wait_receivers(2, timeout=10)
own = mq2.context
mq2.close()
rx2.close()
try:
    own.handle
    raise AssertionError("the second mq's own context outlived it")
except ValueError:
    pass

# closed, the first hands its kind back to the default; the default stays open
del out  # views of the flat buffer keep the receiver open
gc.collect()
mq.close()
rx.close()
mq3 = ferry.MQ(s.directory)
rx3 = ferry.RefitReceiver(%(name)r, timeout=10)
assert mq3.context is d, "the mq's kind was not handed back"
assert rx3._ctx is d, "the receiver's kind was not handed back"
assert d.handle
mq3.close(); rx3.close(); tx.close(); s.close()
print("ok")
"""


def test_one_node_per_process(tmp_path):
    env = dict(os.environ, FERRY_CTL_DIR=str(tmp_path))
    env.pop("FERRY_DIRECTORY", None)  # the sender publishes in FERRY_CTL_DIR
    code = CHILD % {"py": PY, "name": "dflt-%d" % os.getpid()}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
