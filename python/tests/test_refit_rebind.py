"""Binding anew after a commit: a destination bound since the last commit never holds a version the
sender sends with buckets flagged unchanged (it skips what it believes this receiver holds), so
that version is refused there and the next wait catches it up; a shard target bound again under
the same name and memory but with other pieces is such a new destination too."""
import os

import numpy as np
import pytest

import ferry

_n = [0]


def unique(tag):
    _n[0] += 1
    return "pyrebind-%d-%s-%d" % (os.getpid(), tag, _n[0])


def model():
    g = np.random.default_rng(7)
    return {"o": g.standard_normal((32, 64)).astype(np.float32),
            "p": g.standard_normal((64,)).astype(np.float32)}


def push_unchanged(tx, version):
    """A skip_unchanged push of the same weights: the receiver that bound anew does not commit it
    (the sender says so), the version is still pushed."""
    with pytest.raises(ferry.StateError, match="not committed"):
        tx.push(version, skip_unchanged=True)


@pytest.mark.parametrize("mode", ["plain", "shards"])
def test_destination_bound_after_commit_is_caught_up(mode):
    sd = model()
    name = unique(mode)
    with ferry.RefitSender(name, sd, buffer_bytes=4096) as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        p = np.zeros(64, np.float32)
        if mode == "plain":
            out, want = np.zeros((32, 64), np.float32), sd["o"]
            rebind = lambda o: rx.bind({"o": o, "p": p})
        else:
            out, want = np.zeros((32, 16), np.float32), sd["o"][:, 0:16]
            rebind = lambda o: rx.bind_shards({"o": (o, [("o", 1, 0, 16)])})
        rebind(out)
        tx.push(1)
        assert rx.wait(1, timeout=5) == 1 and np.array_equal(out, want)
        fresh = np.zeros_like(out)
        rebind(fresh)  # nothing asks for a catch-up before the push: committed is not read
        push_unchanged(tx, 2)
        assert rx.wait(2, timeout=5) == 2  # caught up: every byte read
        assert np.array_equal(fresh, want)


def test_shard_bound_again_with_other_pieces_is_new():
    sd = model()
    name = unique("pieces")
    with ferry.RefitSender(name, sd, buffer_bytes=4096) as tx, \
            ferry.RefitReceiver(name, timeout=5) as rx:
        out = np.zeros((32, 16), np.float32)
        rx.bind_shards({"o": (out, [("o", 1, 16, 32)])})
        tx.push(1)
        assert rx.wait(1, timeout=5) == 1 and np.array_equal(out, sd["o"][:, 16:32])
        rx.bind_shards({"o": (out, [("o", 1, 0, 16)])})  # same name and memory, another slice
        assert rx.committed == 0  # the memory holds the old slice: no version
        rx.wait(1, timeout=5)  # caught up to the version the new slice missed
        assert np.array_equal(out, sd["o"][:, 0:16])
        tx.push(2, skip_unchanged=True)
        assert rx.wait(2, timeout=5) == 2
        assert np.array_equal(out, sd["o"][:, 0:16])
