"""ferry.MQ: bytes and tensors (numpy, torch) end to end, order, zero-copy views, the callback
thread, back-pressure naming the full subscriber, a subscriber process killed, errors."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import ferry

PY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def pair():
    pub = ferry.MQ(host_directory=True, name="py-pub")
    sub = ferry.MQ(pub.directory, name="py-sub")
    yield pub, sub
    sub.close()
    pub.close()


def test_bytes_and_tensors(pair):
    pub, sub = pair
    sub.subscribe("t")
    pub.wait_subscribers("t", 1, timeout=10)
    assert pub.subscribers("t") == 1
    assert pub.publish("t", b"hello") == []
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    pub.publish("t", x)
    big = np.random.randint(0, 255, (1024, 1024), dtype=np.uint8)  # over the inline limit
    pub.publish("t", big)
    topic, publisher, p = sub.recv(timeout=10)
    assert (topic, publisher, p) == ("t", "py-pub", b"hello")
    assert type(p) is bytes  # a bytes publish comes back as bytes (issue 35: a memoryview)
    _, _, y = sub.recv(timeout=10)
    assert y.dtype == np.float32 and y.shape == (3, 4) and (y == x).all()
    _, _, z = sub.recv(timeout=10)
    assert z.shape == big.shape and (z == big).all()
    with pytest.raises(ferry.Timeout):
        sub.recv(timeout=0)


def test_order_and_copy(pair):
    pub, sub = pair
    sub.subscribe("seq")
    pub.wait_subscribers("seq", 1, timeout=10)
    for i in range(500):
        pub.publish("seq", np.array([i], dtype=np.int64))
    got = [int(sub.recv(timeout=10, copy=True)[2][0]) for _ in range(500)]
    assert got == list(range(500))


def test_torch(pair):
    torch = pytest.importorskip("torch")
    pub, sub = pair
    sub.subscribe("w")
    pub.wait_subscribers("w", 1, timeout=10)
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    pub.publish("w", t)
    _, _, r = sub.recv(timeout=10, like="torch")
    assert r.dtype == torch.bfloat16 and r.shape == (2, 3) and torch.equal(r, t)


def test_callback_thread(pair):
    pub, sub = pair
    got, threads, done = [], set(), threading.Event()

    def on_message(topic, publisher, payload):
        got.append(bytes(payload))
        threads.add(threading.get_ident())
        if len(got) == 20:
            done.set()

    sub.set_callback(on_message)
    with pytest.raises(ferry.Busy):
        sub.recv(timeout=0)
    sub.subscribe("cb")
    pub.wait_subscribers("cb", 1, timeout=10)
    for i in range(20):
        pub.publish("cb", b"m%d" % i)
    assert done.wait(30)
    assert got == [b"m%d" % i for i in range(20)]
    assert threading.get_ident() not in threads and len(threads) == 1
    sub.set_callback(None)
    pub.publish("cb", b"again")
    assert bytes(sub.recv(timeout=10)[2]) == b"again"


def test_back_pressure_names_the_subscriber():
    pub = ferry.MQ(host_directory=True, name="py-pub2")
    sub = ferry.MQ(pub.directory, name="py-slow", queue_bytes=65536)
    try:
        sub.subscribe("full")
        pub.wait_subscribers("full", 1, timeout=10)
        sent = 0
        with pytest.raises(ferry.Timeout) as e:
            while sent < 10000:
                pub.publish("full", bytes(4096), timeout=0.2)
                sent += 1
        assert "py-slow" in str(e.value)
        for _ in range(sent):  # everything accepted arrives; nothing more
            sub.recv(timeout=10, copy=True)
        with pytest.raises(ferry.Timeout):
            sub.recv(timeout=0.1)
    finally:
        sub.close()
        pub.close()


def test_killed_subscriber_is_dropped():
    pub = ferry.MQ(host_directory=True, name="py-pub3")
    code = textwrap.dedent("""
        import sys; sys.path.insert(0, %r)
        import ferry, time
        mq = ferry.MQ(%r, name="py-victim")
        mq.subscribe("fan")
        print("ready", flush=True)
        time.sleep(60)
    """ % (PY, pub.directory))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=os.environ)
    try:
        assert child.stdout.readline().strip() == b"ready"
        pub.wait_subscribers("fan", 1, timeout=10)
        child.send_signal(signal.SIGKILL)
        child.wait()
        dropped = []
        for _ in range(200):
            dropped += pub.publish("fan", bytes(1000), timeout=10)
            if dropped:
                break
            time.sleep(0.01)
        assert dropped == ["py-victim"]
        assert pub.subscribers("fan") == 0
    finally:
        child.kill()
        child.wait()
        pub.close()


def test_errors():
    with ferry.MQ(host_directory=True, name="py-err") as mq:
        with pytest.raises(ferry.InvalidArgument):
            mq.subscribe("")
        with pytest.raises(ferry.NotFound):
            mq.unsubscribe("never")
        with pytest.raises(ferry.Timeout):
            mq.wait_subscribers("nobody", 1, timeout=0.05)
        assert mq.publish("nobody", b"x") == []  # no subscriber: goes nowhere
        with pytest.raises(TypeError):
            mq.subscribe(3)
    with pytest.raises(ValueError):
        mq.publish("t", b"x")


def test_loan_zero_copy(pair):
    pub, sub = pair
    sub.subscribe("loan")
    pub.wait_subscribers("loan", 1, timeout=10)
    x = pub.loan((512, 256), np.float32)  # 512 KiB: over the inline limit, read in place
    assert x.flags.writeable and x.shape == (512, 256) and x.dtype == np.float32
    x[:] = np.arange(256, dtype=np.float32)
    assert pub.publish_loan("loan", x) == []
    assert not x.flags.writeable  # the mq's again
    with pytest.raises(ValueError):
        pub.publish_loan("loan", x)  # handed back once only
    b = pub.loan(100000)
    b[:] = 3
    pub.publish_loan("loan", b, as_bytes=True)
    unused = pub.loan(64)
    with pytest.raises(ValueError):
        pub.publish_loan("loan", unused[:8])  # a part of a loan is not a loan
    pub.loan_free(unused)
    _, _, y = sub.recv(timeout=10)
    assert y.dtype == np.float32 and y.shape == (512, 256)
    assert (y == np.arange(256, dtype=np.float32)).all()
    _, _, z = sub.recv(timeout=10, like=memoryview)  # the message itself, no copy
    assert isinstance(z, memoryview) and z.readonly and len(z) == 100000
    assert bytes(z[:4]) == b"\x03" * 4
    with pytest.raises(ferry.InvalidArgument):
        pub.loan(0)


def test_close_while_a_payload_is_alive():
    """close() with a received payload still referenced (kept by the caller, or by a traceback)
    used to free the mq under it: freeing the payload later read a freed mutex and hung. The
    C close now waits for the last payload; the payload stays readable meanwhile."""
    import gc
    sub = ferry.MQ(host_directory=True, name="py-close-sub", timeout=10)
    pub = ferry.MQ(sub.directory, name="py-close-pub", timeout=10)
    sub.subscribe("t")
    pub.wait_subscribers("t", 1)
    pub.publish("t", np.arange(1000, dtype=np.int64))
    _, _, kept = sub.recv(timeout=10)
    sub.close()
    assert kept.sum() == sum(range(1000))  # still the message's memory, still mapped
    del kept
    gc.collect()  # the last payload goes: the deferred close runs here, once
    pub.close()


def test_bytes_come_back_as_bytes(pair):
    # recv, like=bytes, a subscribe fn, and like=memoryview for the zero-copy view
    pub, sub = pair
    got, came = [], threading.Event()
    sub.subscribe("fn", fn=lambda t, p, payload: (got.append(payload), came.set()))
    sub.subscribe("b")
    pub.wait_subscribers("b", 1, timeout=10)
    pub.wait_subscribers("fn", 1, timeout=10)
    for payload in (b"one", bytearray(b"two"), memoryview(b"three"), b"four", b""):
        pub.publish("b", payload, timeout=10)
    pub.publish("fn", b"five", timeout=10)
    assert sub.recv(timeout=10)[2] == b"one"
    assert type(sub.recv(timeout=10, like=bytes)[2]) is bytes
    three = sub.recv(timeout=10, copy=True)[2]
    assert type(three) is bytes and three == b"three"
    four = sub.recv(timeout=10, like=memoryview)[2]
    assert isinstance(four, memoryview) and four.readonly and bytes(four) == b"four"
    empty = sub.recv(timeout=10)[2]
    assert type(empty) is bytes and empty == b""
    x = np.arange(6, dtype=np.int16)
    pub.publish("b", x, timeout=10)
    mv = sub.recv(timeout=10, like=memoryview)[2]
    assert isinstance(mv, memoryview) and bytes(mv) == x.tobytes()
    with pytest.raises(ValueError):
        sub.recv(timeout=0, like="nonsense")
    assert came.wait(30)  # the fn runs on the mq's thread
    assert got == [b"five"] and type(got[0]) is bytes
