"""ferry.p2pstore as the upstream p2p-store client's drop-in (issue 35 deliverable 4).

The stand-ins below are transcribed from upstream, so that a reader can check them:
- UPSTREAM_CLIENT / UPSTREAM_CONFIG: the PyPI package `p2pstore` (it has no public repository):
  p2pstore/client.py, class P2PClient of the 0.1.15 line (every public method's parameters,
  whether it is a coroutine) and p2pstore/utils/config.py, the @dataclass P2PConfig of the
  generation with the ZMQ metaserver (zmq://H:P,H:P, the form FastDeploy's command line uses):
  its fields and defaults.
- RoutingStoreRDMA, StoreProcess's order of tasks, pad_routing_indices, split_request_id and
  get_needed_clear_ids: FastDeploy's fastdeploy/model_executor/layers/moe/routing_indices_cache.py
  at PaddlePaddle/FastDeploy commit 14471be02ffefde916a54431176f7e307055cec5, the import of
  p2pstore being the one change.
"""
import asyncio
import dataclasses
import inspect
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

import ferry
from ferry.p2pstore import MetricsCollector, P2PClient, P2PConfig

# name -> (parameters after self, with defaults as upstream writes them; coroutine?)
UPSTREAM_CLIENT = {
    "__init__": ("config, check_metaserver=True, enable_metrics=False", False),
    "put": ("key, data", True),
    "get": ("key, output_path=None, inplace_tensor=None", True),
    "exists": ("key", True),
    "delete": ("key", True),
    "delete_batch": ("keys", True),
    "get_prefix": ("prefix", True),
    "delete_prefix": ("prefix", True),
    "delete_prefix_batch": ("prefixes", True),
    "clear": ("", True),
    "batch_get": ("keys, concurrency=32", True),
    "batch_get_prefix": ("prefix, concurrency=32", True),
    "list": ("prefix=None", False),
    "list_files": ("", False),
    "close": ("", False),
    "enable_metrics": ("", False),
}
UPSTREAM_CONFIG = [  # (field, default); metadata_server has none upstream (ferry: None)
    ("metadata_server", None), ("local_host", ""), ("metadata_type", ""), ("sync_addr", None),
    ("coord_addr", None), ("etcd_endpoints", None), ("persistence_dir", None),
    ("protocol", "rdma"), ("device", "mlx5_3"), ("meta_server", "P2PHANDSHAKE"),
    ("max_retries", 3), ("retry_interval", 5), ("log_name", None), ("enable_watch", True),
]


def _params(fn):
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:  # self
        if p.kind is p.KEYWORD_ONLY:
            break  # ferry's own keyword-only extras (get's like=) follow upstream's
        out.append(p.name if p.default is p.empty else "%s=%r" % (p.name, p.default))
    return ", ".join(out)


def test_signatures_are_upstreams():
    for name, (params, coro) in UPSTREAM_CLIENT.items():
        fn = getattr(P2PClient, name)
        assert _params(fn) == params, name
        assert inspect.iscoroutinefunction(fn) == coro, name
    assert isinstance(inspect.getattr_static(P2PClient, "metrics"), property)
    fields = {f.name: f for f in dataclasses.fields(P2PConfig)}
    for name, default in UPSTREAM_CONFIG:
        assert fields[name].init and fields[name].default == default, name
    order = [f.name for f in dataclasses.fields(P2PConfig) if f.init]
    assert order[:len(UPSTREAM_CONFIG)] == [n for n, _ in UPSTREAM_CONFIG]  # positional too


def test_config_urls():
    c = P2PConfig(metadata_server="zmq://10.0.0.1:5765,10.0.0.2:5766", local_host="10.0.0.9",
                  protocol="rdma", device="mlx5_2,mlx5_3")
    assert c.directories == ["ferry://10.0.0.1:5765", "ferry://10.0.0.2:5766"]
    assert (c.metadata_type, c.sync_addr, c.coord_addr) == \
        ("zmq", "tcp://10.0.0.1:5765", "tcp://10.0.0.2:5766")
    assert c.metadata_server == "zmq://10.0.0.1:5765,10.0.0.2:5766"  # kept as given
    assert c.tcp_listen == "10.0.0.9:0"
    assert P2PConfig("zmq://h:1").directories == ["ferry://h:1"]
    assert P2PConfig("h:7700").directories == ["ferry://h:7700"]
    assert P2PConfig("ferry://a:1, b:2").directories == ["ferry://a:1", "ferry://b:2"]
    assert P2PConfig("redis://r:6379/2").directories == ["redis://r:6379/2"]
    for deployed in ("rediss://:pw@r:6380/1?ca=/etc/ca.pem", "redis+sentinel://s1,s2,s3/mymaster"):
        assert P2PConfig(deployed).directories == [deployed]  # libferry reads them (issue 36)
    assert P2PConfig().directories == [None]  # FERRY_DIRECTORY
    assert P2PConfig("h:1", local_host="10.1.1.1:7800").tcp_listen == "10.1.1.1:7800"
    assert P2PConfig("h:1").tcp_listen is None
    assert P2PConfig("h:1", local_host="fd00::5").tcp_listen == "[fd00::5]:0"
    assert P2PConfig("h:1", local_host="[fd00::5]:7").tcp_listen == "[fd00::5]:7"
    assert P2PConfig("etcd://a:2379,b:2379?ns=j").directories == ["etcd://a:2379,b:2379?ns=j"]
    for bad in ("http://h:1", "zmq://h", "zmq://h:1,", "ferry://h:1/x",
                "redis+cluster://h:1,h:2"):
        with pytest.raises(ValueError):
            P2PConfig(metadata_server=bad)
    with pytest.raises(ValueError):
        P2PConfig("h:1", protocol="ib")
    with pytest.raises(TypeError):
        P2PConfig(metadata_server=7700)
    with pytest.raises(TypeError):
        P2PClient({"metadata_server": "h:1"})


def test_fleet_name(monkeypatch):
    monkeypatch.delenv("FERRY_P2P_FLEET", raising=False)
    assert P2PConfig("h:1").fleet == "p2pstore"
    monkeypatch.setenv("FERRY_P2P_FLEET", "job-7")
    assert P2PConfig("h:1").fleet == "job-7"
    assert P2PConfig("h:1", fleet="mine").fleet == "mine"
    for bad in ("", "a/b", " a", "x" * 64, "a\nb"):
        with pytest.raises(ValueError):
            P2PConfig("h:1", fleet=bad)


@pytest.fixture
def directory():
    d = ferry.Store(host_directory=True, name="p2p-dir", timeout=10)
    yield d
    d.close()


def _client(url, fleet, name, **kw):
    return P2PClient(P2PConfig(metadata_server=url, fleet=fleet, name=name, timeout=10), **kw)


def test_calls_and_return_types(directory, tmp_path):
    c = _client(directory.directory, "types", "p2p-types")
    try:
        ids = np.arange(12, dtype=np.int32).reshape(3, 4)

        async def run():
            assert await c.put("r_0", ids) is True
            assert await c.put("r_1", ids.tobytes()) is True
            assert await c.put("q_0", ids) is True
            assert await c.put("k" * 300, ids) is False  # too long a key: False, as upstream
            with pytest.raises(TypeError):
                await c.put("bad", {"a": 1})
            got = await c.get("r_0")
            assert got.dtype == np.int32 and np.array_equal(got, ids)
            assert bytes(await c.get("r_1")) == ids.tobytes()  # bytes: uint8
            assert await c.get("r_1", like=bytes) == ids.tobytes()
            out = np.zeros((3, 4), np.int32)
            assert await c.get("r_0", inplace_tensor=out) is out and np.array_equal(out, ids)
            path = str(tmp_path / "sub" / "r_0.bin")
            assert np.array_equal(await c.get("r_0", output_path=path), ids)
            assert open(path, "rb").read() == ids.tobytes()
            assert await c.get("none") is None
            assert await c.exists("r_0") is True and await c.exists("none") is False
            prefix = await c.get_prefix("r_")
            assert sorted(prefix) == ["r_0", "r_1"]
            assert prefix["r_0"]["host"] == "p2p-types"
            assert prefix["r_0"]["metadata"]["tensor_shape"] == [3, 4]
            assert prefix["r_0"]["metadata"]["data_size"] == 48
            assert (await c.batch_get(["r_0", "none"]))["none"] is None
            assert await c.delete("q_0") is True and await c.delete("q_0") is False
            assert await c.delete_batch(["r_0", "x"]) == {"r_0": True, "x": False}
            assert await c.delete_prefix_batch(["r_", "zz"]) == {"r_": True, "zz": True}
            assert await c.delete_prefix("none") is True

        asyncio.run(run())
        assert c.list() == []  # synchronous, as upstream
        asyncio.run(c.put("c", b"1"))
        assert c.list() == ["c"] and c.list("d") == [] and list(c.list_files()) == ["c"]
        assert directory.list() == ["types/c"] and c.scoped("c") == "types/c"
        assert asyncio.run(c.clear()) == {"success": True, "cleared": 1, "failed": []}
    finally:
        c.close()


def test_metrics(directory):
    c = _client(directory.directory, "metrics", "p2p-metrics")
    try:
        assert c.metrics is None
        m = c.enable_metrics()
        assert isinstance(m, MetricsCollector) and c.metrics is m and c.enable_metrics() is m

        async def run():
            await c.put("a", np.zeros(256, np.uint8))
            await c.get("a")
            await c.get("missing")
            await c.clear()

        asyncio.run(run())
        r = m.get_report()
        assert (r["put"]["count"], r["put"]["total_bytes"]) == (1, 256)
        assert (r["get"]["success"], r["get"]["failure"]) == (1, 1)
        assert r["clear"]["count"] == 1 and m.has_failures() and "PUT" in m.get_summary()
        with pytest.raises(AssertionError):
            m.assert_no_failures("get")
        m.reset()
        assert m.get_report()["total_operations"] == 0
    finally:
        c.close()
    with_metrics = _client(directory.directory, "metrics", "p2p-metrics2", enable_metrics=True)
    assert isinstance(with_metrics.metrics, MetricsCollector)
    with_metrics.close()


def test_clear_removes_only_this_fleets_keys(directory):
    """Two jobs on one directory: job A's engine restarts and clears; job B keeps its keys."""
    a_old = _client(directory.directory, "job-a", "p2p-a-old")
    b = _client(directory.directory, "job-b", "p2p-b")
    try:
        for layer in range(3):  # the same key names in both jobs
            assert asyncio.run(a_old.put("req-0_%d" % layer, np.full(4, layer))) is True
            assert asyncio.run(b.put("req-0_%d" % layer, np.full(4, 10 + layer))) is True
        assert b.list() == a_old.list() == ["req-0_0", "req-0_1", "req-0_2"]
        a_new = _client(directory.directory, "job-a", "p2p-a-new")  # the restarted engine
        try:
            res = asyncio.run(a_new.clear())
            assert res == {"success": True, "cleared": 3, "failed": []}
            assert a_new.list() == [] and a_old.list() == []
            assert b.list() == ["req-0_0", "req-0_1", "req-0_2"]
            assert np.array_equal(asyncio.run(b.get("req-0_2")), np.full(4, 12))
            assert sorted(directory.list()) == ["job-b/req-0_0", "job-b/req-0_1",
                                                "job-b/req-0_2"]
        finally:
            a_new.close()
    finally:
        a_old.close()
        b.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_zmq_url_first_that_answers(directory):
    dead = "127.0.0.1:%d" % _free_port()
    live = directory.directory[len("ferry://"):]
    c = _client("zmq://%s,%s" % (dead, live), "fo", "p2p-fo")
    try:
        assert c.config.directories[c._at] == directory.directory
        assert asyncio.run(c.put("k", np.arange(3))) is True
        assert directory.list() == ["fo/k"]
    finally:
        c.close()
    with pytest.raises(RuntimeError, match="no metadata server answers"):
        _client("zmq://%s" % dead, "fo", "p2p-none")


HOST_DIRECTORY = """
import sys
sys.path.insert(0, sys.argv[1])
import ferry
s = ferry.Store(host_directory=True, name=sys.argv[2], timeout=10)
print(s.directory, flush=True)
sys.stdin.read()  # until the test kills this process
"""


def _directory_process(name):
    """A directory in a process of its own (killed: it is gone, as a crashed `ferry serve`)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(ferry.__file__)))
    p = subprocess.Popen([sys.executable, "-c", HOST_DIRECTORY, here, name],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    url = p.stdout.readline().strip()
    assert url.startswith("ferry://"), url
    return p, url


def test_zmq_url_next_when_it_fails(directory):
    proc, first = _directory_process("p2p-dir-first")
    c = None
    try:
        url = "zmq://%s,%s" % (first[8:], directory.directory[8:])
        c = _client(url, "fo2", "p2p-fo2")
        assert c.config.directories[c._at] == first
        assert asyncio.run(c.put("before", np.arange(2))) is True
        assert c.list() == ["before"] and directory.list() == []
        proc.kill()  # the first directory goes away
        proc.wait()
        assert asyncio.run(c.put("after", np.arange(5))) is True  # on the next one
        assert c.config.directories[c._at] == directory.directory
        assert directory.list() == ["fo2/after"]
        assert np.array_equal(directory.get("fo2/after"), np.arange(5))
        assert c.list() == ["after"]  # what was put in the failed one went with it
    finally:
        if c is not None:
            c.close()
        proc.kill()
        proc.wait()


def test_check_metaserver_false_opens_at_first_call():
    port = _free_port()
    c = _client("zmq://127.0.0.1:%d" % port, "late", "p2p-late", check_metaserver=False)
    try:
        assert asyncio.run(c.put("k", b"x")) is False  # nothing answers yet
        d = ferry.Store(host_directory=True, name="p2p-late-dir", timeout=10,
                        tcp_listen="127.0.0.1:%d" % port)
        try:
            assert asyncio.run(c.put("k", b"x")) is True
            assert d.list() == ["late/k"]
        finally:
            c.close()  # before its directory
            d.close()
    finally:
        c.close()


# ---- FastDeploy's routing replay, as routing_indices_cache.py runs it -----------------------
class RoutingStoreRDMA:
    """FastDeploy's RoutingStoreRDMA (timing and logging left out), `from p2pstore import` being
    `from ferry.p2pstore import`."""

    def __init__(self, routing_replay_config) -> None:
        from ferry.p2pstore import P2PClient, P2PConfig  # was: from p2pstore import ...

        rdma_store_server = routing_replay_config.rdma_store_server
        p2pConfig = P2PConfig(metadata_server=rdma_store_server)
        self.p2p_client = P2PClient(p2pConfig)

    async def put(self, routing_key, routing_indices):
        if len(routing_indices.shape) == 3:
            routing_bytes = routing_indices.tobytes()  # fused put with bytes data
            result = await self.p2p_client.put(routing_key, routing_bytes)
        else:
            result = await self.p2p_client.put(routing_key, routing_indices)
        return result

    async def clear_prefix_batch(self, routing_prefix_key):
        return await self.p2p_client.delete_batch([routing_prefix_key])

    async def clear_store(self):
        return await self.p2p_client.clear()


def pad_routing_indices(routing_indices, max_model_len):
    """StoreProcess.pad_routing_indices: pad the token axis to max_model_len with -1."""
    if routing_indices.ndim == 2:
        pad = np.full((max_model_len - routing_indices.shape[0], routing_indices.shape[1]), -1,
                      dtype=routing_indices.dtype)
        return np.concatenate([routing_indices, pad], axis=0)
    pad = np.full((routing_indices.shape[0], max_model_len - routing_indices.shape[1],
                   routing_indices.shape[2]), -1, dtype=routing_indices.dtype)
    return np.concatenate([routing_indices, pad], axis=1)


def split_request_id(request_id):
    """RoutingReplayManager.split_request_id: "chatcmpl-<rollout id>-<uuid 5 parts>"."""
    chat_type, tmp_str = request_id.split("-", 1)
    assert chat_type == "chatcmpl"
    return tmp_str[::-1].split("-", 5)[-1][::-1]


def get_needed_clear_ids(rollout_id):
    """StoreWrapper.get_needed_clear_ids: the previous turn's id, when there is one."""
    seg, turn, prefix = rollout_id[::-1].split(":", 2)
    turn, seg = int(turn[::-1]), int(seg[::-1])
    return "%s:%d:%d" % (prefix[::-1], turn - 1, seg) if turn > 0 else None


class EventLoopThread(threading.Thread):
    """StoreProcess's AsyncEventLoopThread: coroutines submitted to a loop in another thread."""

    def __init__(self):
        super().__init__(daemon=True)
        self.loop = asyncio.new_event_loop()

    def run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.join()
        self.loop.close()


def routing(req, layers, tokens, top_k, experts=64):
    layer = np.arange(layers)[:, None, None]
    token = np.arange(tokens)[None, :, None]
    k = np.arange(top_k)[None, None, :]
    return ((layer * 131 + token * 7 + k * 13 + req * 29) % experts).astype(np.uint8)


def test_fastdeploy_routing_replay_sequence(directory, monkeypatch):
    """The engine's StoreProcess order: clear_store first, then per request a put per layer
    (only_last_turn: the previous turn's keys deleted with delete_batch), and a fused put; the
    trainer gets every key back; another job's keys on the same directory survive the engine's
    clear at start."""
    monkeypatch.setenv("FERRY_P2P_FLEET", "rl-job-1")
    other = _client(directory.directory, "rl-job-2", "p2p-other-job")
    stale = _client(directory.directory, "rl-job-1", "p2p-stale-engine")
    layers, tokens, top_k, max_model_len = 3, 5, 4, 8
    try:
        assert asyncio.run(other.put("xxx_epoch_1:0:0:0_0", np.zeros(3))) is True
        assert asyncio.run(stale.put("old-run:0:0:0_0", np.zeros(3))) is True

        class Config:  # RoutingReplayConfig's one field RoutingStoreRDMA reads
            rdma_store_server = "zmq://" + directory.directory[len("ferry://"):]

        loop = EventLoopThread()
        loop.start()
        store = RoutingStoreRDMA(Config())
        try:
            assert loop.submit(store.clear_store()).result(30)["success"]
            assert stale.list() == [] and other.list() == ["xxx_epoch_1:0:0:0_0"]
            requests = ["chatcmpl-xxx_epoch_1:%d:%d:0-d9f16c5c-65f6-4815-b44d-14e2c581907c_0"
                        % (gen, turn) for gen in range(2) for turn in range(2)]
            for req, request_id in enumerate(requests):
                rollout_id = split_request_id(request_id)
                batch = routing(req, layers, tokens, top_k)
                futures = []
                for layer in range(layers):  # use_fused_put=False: one key per layer
                    data = pad_routing_indices(batch[layer], max_model_len)
                    futures.append(loop.submit(store.put("%s_%d" % (rollout_id, layer), data)))
                    prev = get_needed_clear_ids(rollout_id)  # only_last_turn
                    if prev is not None:
                        futures.append(loop.submit(
                            store.clear_prefix_batch("%s_%d" % (prev, layer))))
                fused = pad_routing_indices(batch, max_model_len)  # use_fused_put=True
                futures.append(loop.submit(store.put(rollout_id, fused)))
                for f in futures:  # put: True; clear_prefix_batch: {key: True}
                    r = f.result(30)
                    assert r is True or (isinstance(r, dict) and list(r.values()) == [True]), r
        finally:
            loop.stop()

        trainer = _client(directory.directory, "rl-job-1", "p2p-trainer")
        try:
            keys = trainer.list()
            # turn 1 deleted turn 0's per-layer keys; the fused keys stay
            want = ["xxx_epoch_1:%d:0:0" % g for g in range(2)] + \
                ["xxx_epoch_1:%d:1:0%s" % (g, s) for g in range(2)
                 for s in [""] + ["_%d" % layer for layer in range(layers)]]
            assert keys == sorted(want)
            for req, request_id in enumerate(requests):
                rollout_id = split_request_id(request_id)
                batch = routing(req, layers, tokens, top_k)
                if rollout_id.endswith(":1:0"):
                    for layer in range(layers):
                        got = asyncio.run(trainer.get("%s_%d" % (rollout_id, layer)))
                        assert got.dtype == np.uint8 and got.shape == (max_model_len, top_k)
                        assert np.array_equal(got[:tokens], batch[layer])
                        assert (got[tokens:] == 255).all()  # -1 in uint8
                fused = asyncio.run(trainer.get(rollout_id))
                got = np.frombuffer(bytes(fused), np.uint8).reshape(layers, max_model_len, top_k)
                assert np.array_equal(got[:, :tokens], batch)
            assert other.list() == ["xxx_epoch_1:0:0:0_0"]
        finally:
            trainer.close()
        store.p2p_client.close()
    finally:
        other.close()
        stale.close()
