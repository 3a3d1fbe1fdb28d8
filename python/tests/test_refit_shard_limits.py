"""What a sender takes from one receiver's shard declarations is bounded (src/refit/shard.h:
FR_REFIT_VIEW_RUNS_MAX runs, FR_REFIT_VIEW_OVERLAP times the model's bytes, a target table of
FR_REFIT_TABLE_BYTES_MAX): past them the binding fails with a clear error at that receiver, which
then reads whole buckets; the sender and its other receivers go on."""
import os
import re

import numpy as np
import pytest

import ferry

_n = [0]
SHARD_H = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "refit",
                       "shard.h")


def limit(name):
    """A limit as shard.h defines it (an integer expression of literals and shifts)."""
    with open(SHARD_H) as f:
        m = re.search(r"#define %s (.+?)(?:/\*|$)" % name, f.read(), re.M)
    return int(eval(re.sub(r"(\d+)u\b", r"\1", m.group(1)), {}))


def unique(tag):
    _n[0] += 1
    return "pylimits-%d-%s-%d" % (os.getpid(), tag, _n[0])


def test_too_many_runs_is_refused_and_the_sender_goes_on():
    runs = limit("FR_REFIT_VIEW_RUNS_MAX")
    rows = runs // 2 + 1  # two column slices of every row: one run per row each, past the limit
    g = np.random.default_rng(1)
    sd = {"t": g.integers(-100, 100, (rows, 2), dtype=np.int8),
          "w": g.standard_normal((64, 32)).astype(np.float32)}
    name = unique("runs")
    with ferry.RefitSender(name, sd, buffer_bytes=1 << 20) as tx:
        with ferry.RefitReceiver(name, timeout=5) as bad:
            out = np.zeros((2 * rows, 1), np.int8)
            with pytest.raises(ferry.CapacityExceeded, match="refused target 'cols'.*runs"):
                bad.bind_shards({"cols": (out, [("t", 1, 0, 1), ("t", 1, 1, 2)])})
        with ferry.RefitReceiver(name, timeout=5) as good:
            w = np.zeros((64, 16), np.float32)
            good.bind_shards({"w": (w, [("w", 1, 0, 16)])})
            tx.push(1)
            assert good.wait(1, timeout=10) == 1
            assert np.array_equal(w, sd["w"][:, 0:16])
            assert good.bytes_read == w.nbytes  # its own view, untouched by the refusal


def test_too_many_bytes_is_refused_and_that_receiver_reads_whole_buckets():
    overlap = limit("FR_REFIT_VIEW_OVERLAP")
    g = np.random.default_rng(2)
    sd = {"w": g.standard_normal((64, 32)).astype(np.float32),
          "p": g.standard_normal((8,)).astype(np.float32)}
    name = unique("bytes")
    with ferry.RefitSender(name, sd, buffer_bytes=4096) as tx, \
            ferry.RefitReceiver(name, timeout=5) as many, \
            ferry.RefitReceiver(name, timeout=5) as one:
        copies = [np.zeros_like(sd["w"]) for _ in range(overlap + 1)]
        for i, c in enumerate(copies[:-1]):  # the whole of w, `overlap` times: taken
            many.bind_shards({"copy%d" % i: (c, [("w", 0, 0, 64)])})
        with pytest.raises(ferry.CapacityExceeded, match="refused target 'last'"):
            many.bind_shards({"last": (copies[-1], [("w", 0, 0, 64)])})
        w = np.zeros((64, 16), np.float32)
        one.bind_shards({"w": (w, [("w", 1, 16, 32)])})
        tx.push(1)
        assert many.wait(1, timeout=10) == 1 and one.wait(1, timeout=10) == 1
        for c in copies:  # every target filled, from whole buckets
            assert np.array_equal(c, sd["w"])
        assert many.bytes_read >= sum(a.nbytes for a in sd.values())
        assert np.array_equal(w, sd["w"][:, 16:32]) and one.bytes_read == w.nbytes
