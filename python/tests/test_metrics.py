"""Metrics: ferry.stats() moves with puts, gets and publishes; `ferry serve --http` and
FERRY_METRICS_LISTEN serve /metrics, /healthz and /readyz, and what /metrics serves parses with
the Prometheus client's own parser (python3-prometheus-client) with the values that moved."""
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import ferry

PY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
parser = pytest.importorskip("prometheus_client.parser")


def ferry_cli():
    lib = os.environ.get("FERRY_LIB")
    for d in ([os.path.dirname(lib)] if lib else []) + [os.path.join(os.path.dirname(PY), "build")]:
        if os.access(os.path.join(d, "ferry"), os.X_OK):
            return os.path.join(d, "ferry")
    pytest.skip("no ferry command built beside FERRY_LIB or in build/")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample(stats, name, **labels):
    """The value of the one sample of `name` whose labels include `labels`."""
    found = [m for m in stats if m["name"] == name and labels.items() <= m["labels"].items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def scrape(url):
    """GET url: (status, body); the families parsed by the Prometheus parser for /metrics."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def parsed(text):
    """{(name, frozenset(labels)): value} of every sample, via prometheus_client's parser."""
    out = {}
    for fam in parser.text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples, name, **labels):
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def served(base, want):
    """serve's ferry_store_served_gets_total once it reaches `want` (receipts arrive after the
    getter exits: polled, with a deadline), else its last value."""
    got = None
    for _ in range(500):
        got = value(parsed(scrape(base + "/metrics")[1]), "ferry_store_served_gets_total",
                    node="py-serve")
        if got >= want:
            break
        time.sleep(0.02)
    return got


def test_stats_move_with_puts_gets_and_publishes():
    store = ferry.Store(host_directory=True, name="py-metrics")
    pub = ferry.MQ(store.directory, name="py-metrics-mq", ctx=store._ctx)
    sub = ferry.MQ(store.directory, name="py-metrics-sub")
    try:
        before = ferry.stats(store)
        assert sample(before, "ferry_store_puts_total")["value"] == 0
        a = np.arange(1000, dtype=np.float32)
        store.put("m/a", a)
        store.put("m/b", a[:10])
        assert np.array_equal(store.get("m/a"), a)
        with pytest.raises(ferry.NotFound):
            store.get("m/missing")
        sub.subscribe("mt")
        pub.wait_subscribers("mt", 1, timeout=10)
        for i in range(5):
            pub.publish("mt", bytes(100 + i), timeout=10)
        for _ in range(5):
            sub.recv(timeout=10)
        after = ferry.stats(store)
        assert sample(after, "ferry_store_puts_total")["value"] == 2
        assert sample(after, "ferry_store_put_bytes_total")["value"] == a.nbytes + 40
        assert sample(after, "ferry_store_gets_total")["value"] == 2
        assert sample(after, "ferry_store_get_errors_total")["value"] == 1
        # its own get of its own object: served by it, counted at once (no receipt)
        assert sample(after, "ferry_store_served_gets_total")["value"] == 1
        assert sample(after, "ferry_store_served_bytes_total")["value"] == a.nbytes
        assert sample(after, "ferry_store_objects")["value"] == 2
        assert sample(after, "ferry_store_held_bytes")["value"] == a.nbytes + 40
        h = sample(after, "ferry_store_put_duration_seconds")
        assert h["kind"] == "histogram" and h["count"] == 2 and h["value"] > 0
        assert h["buckets"][-1] == (float("inf"), 2)
        assert all(x[1] <= y[1] for x, y in zip(h["buckets"], h["buckets"][1:]))
        assert sample(after, "ferry_mq_published_total", topic="mt")["value"] == 5
        assert sample(after, "ferry_mq_published_bytes_total", topic="mt")["value"] == 510
        got = ferry.stats(sub)
        assert sample(got, "ferry_mq_received_total", topic="mt")["value"] == 5
        assert sample(got, "ferry_mq_queue_messages")["value"] == 0
        sent = sum(m["value"] for m in after if m["name"] == "ferry_link_sent_bytes_total")
        assert sent > 0
        assert all(m["labels"]["node"] == "py-metrics" for m in after)
        assert ferry.readiness(store) == "ready"
        text = ferry.prometheus(store)
        assert value(parsed(text), "ferry_store_objects", node="py-metrics") == 2
    finally:
        sub.close()
        pub.close()
        store.close()


def test_serve_http_metrics_health_and_readiness(tmp_path):
    cli = ferry_cli()
    env = dict(os.environ, FERRY_DIRECTORY="ferry://127.0.0.1:%d" % free_port())
    serve = subprocess.Popen([cli, "serve", "--name", "py-serve", "--http", "127.0.0.1:0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        line = serve.stdout.readline()
        m = re.search(r"metrics (http://127\.0\.0\.1:\d+)/metrics", line)
        assert m, line
        base = m.group(1)
        code, text = scrape(base + "/metrics")
        assert code == 200
        first = parsed(text)
        assert value(first, "ferry_store_objects", node="py-serve") == 0
        blob = tmp_path / "blob.bin"
        blob.write_bytes(os.urandom(50000))
        subprocess.run([cli, "put", "k1", str(blob)], env=env, check=True, timeout=60)
        subprocess.run([cli, "get", "k1", str(tmp_path / "out.bin")], env=env, check=True,
                       timeout=60)
        code, text = scrape(base + "/metrics")
        assert code == 200
        then = parsed(text)
        assert value(then, "ferry_store_objects", node="py-serve") == 1
        assert value(then, "ferry_store_held_bytes", node="py-serve") == 50000
        opened = sum(v for (n, ls), v in then.items() if n == "ferry_links_opened_total")
        assert opened > sum(v for (n, ls), v in first.items() if n == "ferry_links_opened_total")
        frames = [sum(v for (n, ls), v in x.items() if n == "ferry_link_received_frames_total")
                  for x in (first, then)]
        assert frames[1] > frames[0]  # the put's and get's calls (its bytes may go by shm)
        assert "# TYPE ferry_store_get_duration_seconds histogram" in text
        # the put it holds for the client counts as its put (issue 35: it stayed 0); a get reads
        # its memory without it and counts in the getter's gets_total, and here in
        # served_gets_total once the getter's read receipt comes (sent as `ferry get` exits)
        assert value(then, "ferry_store_puts_total", node="py-serve") == 1
        assert value(then, "ferry_store_put_bytes_total", node="py-serve") == 50000
        assert value(then, "ferry_store_gets_total", node="py-serve") == 0
        assert served(base, 1) == 1
        for _ in range(2):
            subprocess.run([cli, "get", "k1", str(tmp_path / "out.bin")], env=env, check=True,
                           timeout=60)
        assert served(base, 3) == 3
        later = parsed(scrape(base + "/metrics")[1])
        assert value(later, "ferry_store_served_bytes_total", node="py-serve") == 3 * 50000
        assert value(later, "ferry_store_gets_total", node="py-serve") == 0
        assert value(then, "ferry_build_info", node="py-serve", version=ferry.__version__) == 1
        assert value(then, "process_resident_memory_bytes", node="py-serve") > 1 << 20
        assert value(then, "process_virtual_memory_bytes", node="py-serve") > 1 << 20
        assert value(then, "process_cpu_seconds_total", node="py-serve") > 0
        assert value(then, "process_open_fds", node="py-serve") >= 3
        assert value(then, "process_max_fds", node="py-serve") >= 64
        started = value(then, "process_start_time_seconds", node="py-serve")
        assert abs(started - os.stat("/proc/%d" % serve.pid).st_mtime) < 120
        assert scrape(base + "/healthz") == (200, "ok\n")
        assert scrape(base + "/readyz") == (200, "ready\n")
        assert scrape(base + "/nope")[0] == 404
    finally:
        serve.terminate()
        serve.wait(timeout=30)


def serve_ready(cli, env):
    """A `ferry serve` without --http: (process, its ready line, its stderr's first line)."""
    env = {k: v for k, v in env.items() if k != "FERRY_METRICS_LISTEN"}
    serve = subprocess.Popen([cli, "serve", "--name", "py-serve-port"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env, text=True)
    return serve, serve.stdout.readline()


def test_serve_default_http_port_is_stable():
    # 127.0.0.1 and the port after the directory's: the same address at every restart (issue 35:
    # it was a free port, a new one each time); when taken, a free one with a warning
    cli = ferry_cli()
    while True:
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
                break
            except OSError:
                continue
    env = dict(os.environ, FERRY_DIRECTORY="ferry://127.0.0.1:%d" % port)
    for _ in range(2):  # a restart serves at the same address
        serve, line = serve_ready(cli, env)
        try:
            assert "metrics http://127.0.0.1:%d/metrics" % (port + 1) in line, line
            assert scrape("http://127.0.0.1:%d/healthz" % (port + 1)) == (200, "ok\n")
        finally:
            serve.terminate()
            serve.wait(timeout=30)
    with socket.socket() as taken:  # (SO_REUSEADDR: the scrapes' connections in TIME_WAIT)
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        serve, line = serve_ready(cli, env)
        try:
            m = re.search(r"metrics http://127\.0\.0\.1:(\d+)/metrics", line)
            assert m and int(m.group(1)) != port + 1, line
            assert scrape("http://127.0.0.1:%s/healthz" % m.group(1)) == (200, "ok\n")
        finally:
            serve.terminate()
            _, err = serve.communicate(timeout=30)
        assert "cannot listen on 127.0.0.1:%d" % (port + 1) in err, err


def test_metrics_listen_env_serves_any_process():
    port = free_port()
    code = textwrap.dedent("""
        import sys; sys.path.insert(0, %r)
        import ferry
        mq = ferry.MQ(host_directory=True, name="py-env-mq")
        sub = ferry.MQ(mq.directory, name="py-env-sub")
        sub.subscribe("env-topic")
        mq.wait_subscribers("env-topic", 1, timeout=10)
        for _ in range(3):
            mq.publish("env-topic", b"x" * 64, timeout=10)
        print("ready", flush=True)
        sys.stdin.readline()
        sub.close(); mq.close()
    """ % PY)
    env = dict(os.environ, FERRY_METRICS_LISTEN="127.0.0.1:%d" % port)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout.readline().strip() == b"ready"
        status, text = scrape("http://127.0.0.1:%d/metrics" % port)
        assert status == 200
        samples = parsed(text)
        assert value(samples, "ferry_mq_published_total", topic="env-topic") == 3
        assert value(samples, "ferry_mq_published_bytes_total", topic="env-topic") == 192
        assert scrape("http://127.0.0.1:%d/readyz" % port)[0] == 200
    finally:
        child.stdin.write(b"\n")
        child.stdin.close()
        child.wait(timeout=30)


def test_metrics_listen_refuses_bad_addresses():
    for bad in ("nonsense", "127.0.0.1:99999", "0.0.0.0:0"):
        code = "import sys; sys.path.insert(0, %r)\nimport ferry\nferry.Context()\n" % PY
        env = dict(os.environ, FERRY_METRICS_LISTEN=bad)
        env.pop("FERRY_TOKEN", None)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode != 0, bad
        assert "metrics" in r.stderr, r.stderr


REFIT_CONTROL_CHILD = """
import sys, threading
sys.path.insert(0, %(py)r)
import numpy as np
import ferry

# The sender's context opens first: it serves FERRY_METRICS_LISTEN (the receivers' find the port
# taken and leave it to it). Sizes are multiples of the wire alignment: a push's bytes are theirs.
sd = {"w": np.arange(2048, dtype=np.float32), "b": np.arange(512, dtype=np.int64)}
tx = ferry.RefitSender(%(refit)r, sd, buffer_bytes=4096)
rx = [ferry.RefitReceiver(%(refit)r, timeout=10) for _ in range(2)]
for r in rx:
    r.tensors()  # a version lands only where something is bound
tx.wait_receivers(2, timeout=10)
for v in (3, 7):
    tx.push(v, timeout=10)
    for r in rx:
        assert r.wait(v, timeout=10) == v

# Two ranks; rank 1 fails the first update only.
cell = ferry.ControlCell(%(cell)r, 2)
ranks = [ferry.ControlRank(%(cell)r, i) for i in range(2)]
stop = threading.Event()
failed = []

def update(i):
    if i == 1 and not failed:
        failed.append(1)
        raise ferry.ChecksumError(-22, "bad bucket")

def loop(i):
    while not stop.is_set():
        try:
            ranks[i].step(update=lambda: update(i), timeout=0.05)
        except ferry.Timeout:
            pass

threads = [threading.Thread(target=loop, args=(i,)) for i in range(2)]
for t in threads:
    t.start()
ctl = ferry.Control(%(cell)r)
ctl.request("clear", timeout=10)
try:
    ctl.request("update", timeout=10)
    raise SystemExit("the update should have failed")
except ferry.ChecksumError:
    pass
ctl.request("clear", timeout=10)
ctl.request("update", timeout=10)
try:
    ctl.request("update", timeout=10)  # refused: not cleared; nothing issued
    raise SystemExit("the second update should have been refused")
except ferry.StateError:
    pass
print("ready", flush=True)
sys.stdin.readline()
stop.set()
for t in threads:
    t.join()
for r in ranks:
    r.close()
ctl.close(); cell.close()
for r in rx:
    r.close()
tx.close()
"""


def test_refit_and_control_metrics_are_the_real_values(tmp_path):
    """A process that pushed two refit versions to two receivers and ran control requests
    (succeeded, failed on a rank, refused) serves, at /metrics, the version each receiver
    committed, the pushes, their bytes, and the requests by command and outcome, as counted
    here, read back through the Prometheus client's parser."""
    port = free_port()
    refit, cell = "pym-refit-%d" % os.getpid(), "pym-cell-%d" % os.getpid()
    code = REFIT_CONTROL_CHILD % {"py": PY, "refit": refit, "cell": cell}
    env = dict(os.environ, FERRY_METRICS_LISTEN="127.0.0.1:%d" % port,
               FERRY_CTL_DIR=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout.readline().strip() == b"ready"
        status, text = scrape("http://127.0.0.1:%d/metrics" % port)
        assert status == 200
        samples = parsed(text)
        # refit: two pushes, both committed by both receivers, each of every byte
        assert value(samples, "ferry_refit_pushes_total", sender=refit) == 2
        assert value(samples, "ferry_refit_push_failures_total", sender=refit) == 0
        assert value(samples, "ferry_refit_push_bytes_total", sender=refit) == 2 * (8192 + 4096)
        assert value(samples, "ferry_refit_version", sender=refit) == 7
        assert value(samples, "ferry_refit_receivers", sender=refit) == 2
        committed = {dict(ls)["receiver"]: v for (n, ls), v in samples.items()
                     if n == "ferry_refit_receiver_committed_version"}
        assert len(committed) == 2 and set(committed.values()) == {7}, committed
        failures = [v for (n, ls), v in samples.items()
                    if n == "ferry_refit_receiver_failures_total"]
        assert failures == [0, 0]
        assert value(samples, "ferry_refit_push_duration_seconds_count", sender=refit) == 2
        # control: what was sent, by command and outcome
        assert value(samples, "ferry_control_requests_total", command="clear",
                     outcome="FERRY_OK") == 2
        assert value(samples, "ferry_control_requests_total", command="update",
                     outcome="FERRY_OK") == 1
        assert value(samples, "ferry_control_requests_total", command="update",
                     outcome="FERRY_ECHECKSUM") == 1
        assert value(samples, "ferry_control_requests_total", command="update",
                     outcome="FERRY_ESTATE") == 1
        assert value(samples, "ferry_control_requests_total", command="abort",
                     outcome="FERRY_OK") == 0
        assert value(samples, "ferry_control_request_duration_seconds_count",
                     command="clear") == 2
        assert value(samples, "ferry_control_request_duration_seconds_count",
                     command="update") == 3
    finally:
        child.stdin.write(b"\n")
        child.stdin.close()
        assert child.wait(timeout=60) == 0
