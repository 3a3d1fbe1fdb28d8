"""ferry.p2pstore: a drop-in for the p2p-store client (`from p2pstore import P2PClient, P2PConfig`)
that FastDeploy's routing replay uses, over ferry.Store. The one changed line is the import:

    from ferry.p2pstore import P2PClient, P2PConfig        # was: from p2pstore import ...
    client = P2PClient(P2PConfig(metadata_server="zmq://10.0.0.1:5765,10.0.0.1:5766"))
    ok = await client.put("req-42_3", routing_indices)     # True, or False when it failed
    ids = await client.get("req-42_3")                     # numpy array; None: no such key
    await client.delete_batch(["req-42_3"]); await client.clear()
    keys = client.list()                                   # synchronous, as upstream

Transcribed from the upstream client, PyPI package `p2pstore` (no public repository):
p2pstore/client.py (P2PClient, as of the 0.1.15 line: enable_metrics, list(prefix), batch_get),
p2pstore/utils/config.py (P2PConfig, as of the generation with the ZMQ metaserver, whose
zmq://H:P,H:P form FastDeploy's command line passes; the later Redis-only generation adds
redis_* fields parsed from the URL) and p2pstore/utils/metrics.py (MetricsCollector); and from
its caller, FastDeploy's fastdeploy/model_executor/layers/moe/routing_indices_cache.py
(RoutingStoreRDMA, StoreProcess, StoreWrapper) at PaddlePaddle/FastDeploy commit
14471be02ffefde916a54431176f7e307055cec5. Every name, argument and return type of the client
is upstream's (python/tests/test_p2pstore.py checks them against a transcription):

- P2PConfig(metadata_server, local_host="", ..., protocol="rdma", device=..., log_name=None,
  ...), a dataclass with upstream's fields, plus ferry's own (fleet, name, timeout, capacity).
- P2PClient(config, check_metaserver=True, enable_metrics=False); coroutines put -> bool,
  get(key, output_path=None, inplace_tensor=None) -> value or None, exists, delete -> bool,
  delete_batch -> {key: bool}, get_prefix -> {key: entry}, delete_prefix -> bool,
  delete_prefix_batch -> {prefix: bool}, clear -> {"success", "cleared", "failed": [keys]},
  batch_get, batch_get_prefix; synchronous list(prefix=None), list_files(), close(); the
  `metrics` property (None unless enable_metrics) and enable_metrics().
- Failures come back as upstream's do: put False, get None, delete False; only a value that
  is no data at all (a dict, a str) raises TypeError, as upstream's validate_data_type does.

The metadata server is ferry's directory. zmq://H:P[,H:P...] (upstream's form) names ferry
directories at those addresses (`ferry serve --listen H:P`): the client joins the first that
answers (refused or silent past the timeout: the next) and, when a call finds it gone (nothing
answers there any more, ferry.ConnectError), the next one; the values this client had put lived
in the one that failed and are gone with it. A call that is only slow (ferry.Timeout) fails
without moving: a busy peer is no reason to leave the directory. ferry://H:P[,H:P...], a bare H:P, redis://... (one
URL), etcd://H:P[,H:P...] (one etcd cluster, by its members) and None (FERRY_DIRECTORY) work too.
check_metaserver=True raises RuntimeError when none answers, as upstream; with False the
client opens at its first call.

Scope: every key lives in the directory as "FLEET/key", FLEET being P2PConfig(fleet=) or
FERRY_P2P_FLEET (default "p2pstore"). list, get_prefix and clear see this fleet's keys only,
so clear(), which FastDeploy runs at every engine start, removes this job's routing keys and
never another job's that shares the directory. Give each job its own fleet name (the engine
and the trainer that reads its keys the same one). A plain ferry.Store reads the same objects
under "FLEET/key" (P2PClient.scoped(key)).

Accepted and not used (ferry picks its transports itself: shm on one host, tcp or UCX across):
protocol ("rdma" or "tcp"), device, meta_server, persistence_dir, max_retries, retry_interval,
enable_watch, log_name. local_host, when given, is the address this node listens on
(FERRY_TCP_LISTEN); without it ferry listens where the directory can reach it.

Every coroutine runs its ferry call in the loop's default executor (ferry releases the GIL), so
it works from a running loop (FastDeploy's AsyncEventLoopThread) and from asyncio.run alike.
"""
import asyncio
import functools
import logging
import os
import secrets
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from . import _lib
from .errors import ConnectError, Error, NotFound, Timeout
from .store import Store

__all__ = ["P2PConfig", "P2PClient", "MetricsCollector"]

log = logging.getLogger("ferry.p2pstore")

DEFAULT_FLEET = "p2pstore"
_FLEET_MAX = 63


def _fleet_default() -> str:
    """FERRY_P2P_FLEET from ferry's configuration table (the environment), else the default."""
    v = _lib.lib.ferry_config_get(b"FERRY_P2P_FLEET")
    if v is None:  # a libferry without the row: the environment directly
        return os.environ.get("FERRY_P2P_FLEET") or DEFAULT_FLEET
    return v.decode() or DEFAULT_FLEET


def _check_fleet(fleet: str) -> str:
    if not isinstance(fleet, str) or not fleet or len(fleet.encode()) > _FLEET_MAX or \
            "/" in fleet or not fleet.isprintable() or fleet != fleet.strip():
        raise ValueError("ferry.p2pstore: fleet %r: 1..%d printable bytes without '/' or "
                         "surrounding spaces (it scopes this job's keys: FLEET/key)"
                         % (fleet, _FLEET_MAX))
    return fleet


def _split_hosts(rest: str, scheme: str, url: str) -> List[str]:
    parts = [p.strip() for p in rest.split(",")]
    if not parts or any(not p or ":" not in p or "/" in p for p in parts):
        raise ValueError("ferry.p2pstore: metadata_server %r: %s://HOST:PORT[,HOST:PORT...], "
                         "e.g. %s://10.0.0.1:5765,10.0.0.1:5766" % (url, scheme, scheme))
    return ["ferry://" + p for p in parts]


def _directories(url: Optional[str]) -> List[Optional[str]]:
    """The ferry directory URLs a metadata_server names, in the order they are tried."""
    if url is None:
        return [None]  # FERRY_DIRECTORY, read by libferry
    if not isinstance(url, str):
        raise TypeError("ferry.p2pstore: metadata_server must be a str such as "
                        "'zmq://host:5765,host:5766' or 'ferry://host:7700', not %s"
                        % type(url).__name__)
    s = url.strip()
    if "://" not in s:
        return _split_hosts(s, "ferry", url)
    scheme, rest = s.split("://", 1)
    if scheme in ("zmq", "ferry"):
        return _split_hosts(rest, scheme, url)
    if scheme in ("redis", "rediss", "redis+sentinel"):
        return [s]
    if scheme == "redis+cluster":
        raise ValueError("ferry.p2pstore: metadata_server %r: ferry's Redis directory is one "
                         "server, redis:// or rediss://[[USER]:PASSWORD@]HOST[:PORT][/DB], or the "
                         "primary behind Sentinel, redis+sentinel://S1,S2,S3/NAME (no cluster)"
                         % url)
    if scheme == "etcd":
        return [s]  # one etcd cluster: its members are the URL's, libferry moves between them
    raise ValueError("ferry.p2pstore: metadata_server %r: use zmq://HOST:PORT[,HOST:PORT] or "
                     "ferry://HOST:PORT (ferry directories, `ferry serve`), or "
                     "redis://HOST:PORT[/DB]" % url)


def _listen_address(host: str) -> str:
    """local_host as a tcp listen address: HOST:PORT as given, a bare host on any free port."""
    if host.startswith("["):  # [v6] or [v6]:port
        return host if "]:" in host else host + ":0"
    if host.count(":") > 1:  # a bare IPv6 address
        return "[%s]:0" % host
    return host if ":" in host else host + ":0"


@dataclass
class P2PConfig:
    """What a P2PClient connects to: upstream's P2PConfig fields, plus ferry's own.

    metadata_server: zmq://H:P[,H:P] (ferry directories tried in order), ferry://H:P[,H:P],
    H:P, redis://HOST:PORT[/DB], or None (FERRY_DIRECTORY). local_host: the address this node
    listens on (upstream: POD_IP, else 127.0.0.1; ferry listens there only when it is given).
    protocol: "rdma" or "tcp" (ferry chooses its transports itself). fleet: the scope of this
    job's keys (None: FERRY_P2P_FLEET, default "p2pstore"). name: this node's name (unique;
    default <hostname>-<pid>). timeout: seconds of each call (None: FERRY_TIMEOUT_MS).
    capacity: bytes of this node's pool for copied puts (0: FERRY_STORE_CAPACITY)."""

    metadata_server: Optional[str] = None
    local_host: str = ""
    metadata_type: str = ""
    sync_addr: Optional[str] = None
    coord_addr: Optional[str] = None
    etcd_endpoints: Optional[List[str]] = None
    persistence_dir: Optional[str] = None
    protocol: str = "rdma"
    device: str = "mlx5_3"
    meta_server: str = "P2PHANDSHAKE"
    max_retries: int = 3
    retry_interval: int = 5
    log_name: Optional[str] = None
    enable_watch: bool = True
    # ferry's
    fleet: Optional[str] = None
    name: Optional[str] = None
    timeout: Optional[float] = None
    capacity: int = 0
    directories: List[Optional[str]] = field(init=False, default_factory=list)
    tcp_listen: Optional[str] = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.directories = _directories(self.metadata_server)
        url = (self.metadata_server or "").strip()
        self.metadata_type = url.split("://", 1)[0] if "://" in url else "ferry"
        if self.metadata_type == "zmq":  # upstream's two derived addresses, for its readers
            hosts = [d[len("ferry://"):] for d in self.directories]
            self.sync_addr = "tcp://" + hosts[0]
            self.coord_addr = "tcp://" + hosts[-1]
        if self.protocol not in ("rdma", "tcp"):
            raise ValueError("ferry.p2pstore: protocol %r: 'rdma' or 'tcp' (ferry picks its "
                             "transports itself; either is accepted)" % (self.protocol,))
        if self.local_host:
            self.tcp_listen = _listen_address(self.local_host.strip())
        else:
            self.local_host = os.getenv("POD_IP", "").strip() or "127.0.0.1"
        self.fleet = _check_fleet(self.fleet if self.fleet is not None else _fleet_default())


class _OpStats:
    """One operation's counts, bytes and latencies (upstream's OperationStats)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.count = self.success_count = self.failure_count = self.total_bytes = 0
        self.latencies: List[float] = []

    def record(self, success: bool, latency: float, data_size: int = 0) -> None:
        with self.lock:
            self.count += 1
            self.success_count += 1 if success else 0
            self.failure_count += 0 if success else 1
            self.total_bytes += data_size
            self.latencies.append(latency)

    def get_stats(self) -> Dict[str, Any]:
        with self.lock:
            lat = sorted(self.latencies)
            n, total = len(lat), sum(lat)

            def pct(p: float) -> float:
                return lat[min(int(n * p), n - 1)] if n else 0.0
            return {"count": self.count, "success": self.success_count,
                    "failure": self.failure_count,
                    "success_rate": self.success_count / self.count * 100 if self.count else 0.0,
                    "total_bytes": self.total_bytes,
                    "throughput_mbps": self.total_bytes / 2**20 / total if total > 0 else 0.0,
                    "latency_avg": statistics.mean(lat) if n else 0.0,
                    "latency_min": lat[0] if n else 0.0, "latency_max": lat[-1] if n else 0.0,
                    "latency_p50": pct(0.50), "latency_p95": pct(0.95), "latency_p99": pct(0.99)}


class MetricsCollector:
    """Counts and latencies of a client's puts, gets, deletes and clears, as upstream's
    (P2PClient(enable_metrics=True).metrics): get_report(), get_summary(), reset()."""

    OPS = ("put", "get", "delete", "clear")

    def __init__(self, client_id: str = "default") -> None:
        self.client_id = client_id
        self._stats = {op: _OpStats() for op in self.OPS}
        self._start_time = time.time()

    def _record(self, op: str, success: bool, latency: float, data_size: int = 0) -> None:
        self._stats[op].record(success, latency, data_size)

    def record_put(self, success: bool, latency: float, data_size: int = 0, key: str = "") -> None:
        """One put: whether it succeeded, its seconds and bytes."""
        self._record("put", success, latency, data_size)

    def record_get(self, success: bool, latency: float, data_size: int = 0, key: str = "") -> None:
        """One get: whether it found the value, its seconds and bytes."""
        self._record("get", success, latency, data_size)

    def record_delete(self, success: bool, latency: float, key: str = "") -> None:
        """One delete: whether it deleted, its seconds."""
        self._record("delete", success, latency)

    def record_clear(self, success: bool, latency: float, cleared_count: int = 0) -> None:
        """One clear: whether it succeeded, its seconds, how many keys it removed."""
        self._record("clear", success, latency, cleared_count)

    def get_report(self) -> Dict[str, Any]:
        """{client_id, elapsed_seconds, total_operations, operations_per_second, and per
        operation (put, get, delete, clear): count, success, failure, success_rate,
        total_bytes, throughput_mbps, latency_avg/min/max/p50/p95/p99 in seconds}."""
        elapsed = time.time() - self._start_time
        total = sum(s.count for s in self._stats.values())
        report: Dict[str, Any] = {"client_id": self.client_id, "elapsed_seconds": elapsed,
                                  "total_operations": total,
                                  "operations_per_second": total / elapsed if elapsed > 0 else 0}
        report.update({op: s.get_stats() for op, s in self._stats.items()})
        return report

    def get_summary(self) -> str:
        """The report's puts and gets in a few readable lines."""
        r = self.get_report()
        lines = ["=== p2pstore metrics (client=%s) ===" % self.client_id,
                 "elapsed %.2fs | operations %d" % (r["elapsed_seconds"], r["total_operations"])]
        for op in ("put", "get"):
            s = r[op]
            lines.append("%s: %d (ok %d, failed %d), %.2f MB/s, avg %.2f ms, p99 %.2f ms" % (
                op.upper(), s["count"], s["success"], s["failure"], s["throughput_mbps"],
                s["latency_avg"] * 1e3, s["latency_p99"] * 1e3))
        return "\n".join(lines)

    def reset(self) -> None:
        """Zeroes every count and restarts the clock (for the next step)."""
        for s in self._stats.values():
            with s.lock:
                s.reset()
        self._start_time = time.time()

    def get_put_success_rate(self) -> float:
        """Percent of puts that succeeded (0 when none)."""
        return self._stats["put"].get_stats()["success_rate"]

    def get_get_success_rate(self) -> float:
        """Percent of gets that found their value (0 when none)."""
        return self._stats["get"].get_stats()["success_rate"]

    def has_failures(self) -> bool:
        """Whether any operation failed."""
        return any(s.get_stats()["failure"] > 0 for s in self._stats.values())

    def assert_no_failures(self, operation: str = "all") -> None:
        """Raises AssertionError when a put ("put"), a get ("get") or either ("all") failed."""
        for op in ("put", "get"):
            if operation in (op, "all"):
                s = self._stats[op].get_stats()
                if s["failure"]:
                    raise AssertionError("%s failures: %d/%d" % (op.upper(), s["failure"],
                                                                 s["count"]))


def _entry(info: Dict[str, Any], prefix_len: int) -> Dict[str, Any]:
    """Upstream's metadata entry for a key: {"host": owner, "metadata": {...}}."""
    return {"host": info["owner"],
            "metadata": {"object_type": "numpy", "data_size": info["bytes"],
                         "tensor_shape": list(info["shape"]), "tensor_dtype": info["dtype"],
                         "file_key": info["key"][prefix_len:],
                         "generation": info["generation"]}}


class P2PClient:
    """The p2p-store client over a ferry.Store node of the fleet config names.

    Values put from ordinary memory are copied once into this node's pool, so the caller may
    reuse its buffer as soon as put returns; readers anywhere in the fleet read them from here.
    They live until deleted, replaced or cleared, or until this client closes (close(), or
    the process ends)."""

    def __init__(self, config: P2PConfig, check_metaserver: bool = True,
                 enable_metrics: bool = False) -> None:
        if not isinstance(config, P2PConfig):
            raise TypeError("ferry.p2pstore: P2PClient takes a P2PConfig(metadata_server=...), "
                            "not %s" % type(config).__name__)
        self.config = config
        self.client_id = secrets.token_hex(4)
        self._scope = config.fleet + "/"
        self._metrics: Optional[MetricsCollector] = None
        if enable_metrics:
            self.enable_metrics()
        self._lock = threading.RLock()  # re-entrant: _failover opens through store
        self._store: Optional[Store] = None
        self._at = 0  # index in config.directories of the directory in use (or to try first)
        self._closed = False
        try:
            self._open(0)
        except (ConnectError, Timeout) as e:
            if check_metaserver:
                raise RuntimeError("ferry.p2pstore: no metadata server answers at %s: %s"
                                   % (config.metadata_server, e.detail or e)) from e
            log.warning("ferry.p2pstore: %s; opening at the first call", e)

    # -- the directory in use, and the next one when it fails --------------------------------
    def _open(self, start: int) -> Store:
        """Joins the first directory, from index start on (wrapping), that answers."""
        dirs, last = self.config.directories, None
        for i in range(len(dirs)):
            at = (start + i) % len(dirs)
            try:
                store = Store(dirs[at], name=self.config.name, timeout=self.config.timeout,
                              capacity=self.config.capacity, tcp_listen=self.config.tcp_listen)
            except (ConnectError, Timeout) as e:  # refused, or no answer within the timeout
                log.warning("ferry.p2pstore: directory %s does not answer: %s", dirs[at], e)
                last = e
                continue
            self._store, self._at = store, at
            if i:
                log.warning("ferry.p2pstore: using directory %s", dirs[at])
            return store
        assert last is not None
        raise last

    @property
    def store(self) -> Store:
        """The ferry.Store node in use (opened when the client could not open it at start)."""
        with self._lock:
            if self._closed:
                raise ValueError("ferry.p2pstore: the client is closed")
            return self._store or self._open(self._at)

    def _failover(self, failed: Store) -> Store:
        with self._lock:
            if self._store is not failed:  # another call moved on already
                return self.store if self._store is None else self._store
            self._store = None
            try:
                failed.close()
            except Error:
                pass
            return self._open(self._at + 1)

    def _call(self, fn: Callable[[Store], Any]) -> Any:
        """fn(store), again on the next directory when this one does not answer."""
        store = self.store
        try:
            return fn(store)
        except ConnectError as e:
            if len(self.config.directories) < 2:
                raise
            log.warning("ferry.p2pstore: directory %s failed (%s); trying the next",
                        self.config.directories[self._at], e)
            return fn(self._failover(store))

    async def _run(self, fn: Callable[[Store], Any]) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(self._call, fn))

    def scoped(self, key: str) -> str:
        """The key as the directory holds it: "FLEET/key" (what a plain ferry.Store reads)."""
        if not isinstance(key, str):
            raise TypeError("ferry.p2pstore: keys are str, not %s" % type(key).__name__)
        return self._scope + key

    # -- metrics ------------------------------------------------------------------------------
    @property
    def metrics(self) -> Optional[MetricsCollector]:
        """The metrics collector (P2PClient(enable_metrics=True) or enable_metrics()), or None."""
        return self._metrics

    def enable_metrics(self) -> MetricsCollector:
        """Starts collecting metrics (when not already) and returns the collector."""
        if self._metrics is None:
            self._metrics = MetricsCollector(client_id=self.client_id)
        return self._metrics

    # -- data ---------------------------------------------------------------------------------
    async def put(self, key: str, data: Any) -> bool:
        """Publishes data (numpy array, CPU tensor of any framework, or bytes) under key,
        replacing any previous value; True once every node can get it, False when it failed
        (logged). Raises TypeError only for what is no data (a dict, a str)."""
        k, t0 = self.scoped(key), time.perf_counter()
        try:
            await self._run(lambda s: s.put(k, data))
            ok = True
        except (TypeError, BufferError):
            raise
        except (Error, ValueError) as e:
            log.error("ferry.p2pstore: put %r failed: %s", key, e)
            ok = False
        if self._metrics:
            self._metrics.record_put(ok, time.perf_counter() - t0, _nbytes(data), key)
        return ok

    async def get(self, key: str, output_path: Optional[str] = None,
                  inplace_tensor: Any = None, *, like: Any = "numpy") -> Any:
        """The value under key: a numpy array of the dtype and shape put (bytes come back as
        uint8); inplace_tensor: read into that tensor/array of the value's dtype and shape and
        return it; output_path: also write the value's bytes to that file. None when there is
        no such key or the read failed (logged). like= (ferry's): bytes, "torch", or a module
        with from_dlpack instead of numpy."""
        k, t0 = self.scoped(key), time.perf_counter()
        try:
            value = await self._run(lambda s: s.get(k, out=inplace_tensor, like=like))
        except NotFound:
            log.info("ferry.p2pstore: get %r: no such key", key)
            value = None
        except Error as e:
            log.error("ferry.p2pstore: get %r failed: %s", key, e)
            value = None
        if value is not None and output_path:
            _save(value, output_path)
        if self._metrics:
            self._metrics.record_get(value is not None, time.perf_counter() - t0,
                                     _nbytes(value), key)
        return value

    async def exists(self, key: str) -> bool:
        """True when key exists in this fleet (False also when the directory cannot say)."""
        k = self.scoped(key)
        try:
            return bool(await self._run(lambda s: s.exists(k)))
        except Error as e:
            log.error("ferry.p2pstore: exists %r failed: %s", key, e)
            return False

    async def batch_get(self, keys: List[str], concurrency: int = 32) -> Dict[str, Any]:
        """{key: value, or None when missing or failed}, read in one batch."""
        keys = [str(k) for k in keys]
        if not keys:
            return {}
        scoped = [self.scoped(k) for k in keys]
        out: Dict[str, Any] = {k: None for k in keys}
        try:
            values = await self._run(lambda s: s.get_batch(scoped))
            out.update({k: v for k, v in zip(keys, values)})
        except Error:  # one missing key fails the batch: read them one by one
            for k in keys:
                out[k] = await self.get(k)
        return out

    async def batch_get_prefix(self, prefix: str, concurrency: int = 32) -> Dict[str, Any]:
        """{key: value} of every key of this fleet starting with prefix."""
        return await self.batch_get(list(await self.get_prefix(prefix)), concurrency)

    # -- deletes ------------------------------------------------------------------------------
    async def delete(self, key: str) -> bool:
        """True when key was deleted; False when there was no such key or it failed."""
        k, t0 = self.scoped(key), time.perf_counter()
        try:
            ok = bool(await self._run(lambda s: s.delete(k)))
        except Error as e:
            log.error("ferry.p2pstore: delete %r failed: %s", key, e)
            ok = False
        if self._metrics:
            self._metrics.record_delete(ok, time.perf_counter() - t0, key)
        return ok

    async def delete_batch(self, keys: List[str]) -> Dict[str, bool]:
        """{key: True if deleted, False if it did not exist or failed}."""
        return {key: await self.delete(key) for key in keys}

    async def get_prefix(self, prefix: str) -> Dict[str, Dict[str, Any]]:
        """{key: {"host": owner node, "metadata": {object_type, data_size, tensor_shape,
        tensor_dtype, ...}}} of this fleet's keys starting with prefix."""
        p, n = self.scoped(prefix), len(self._scope)
        infos = await self._run(lambda s: s.list(p, detail=True))
        return {i["key"][n:]: _entry(i, n) for i in infos}

    async def delete_prefix(self, prefix: str) -> bool:
        """Deletes this fleet's keys starting with prefix; True unless it failed."""
        p = self.scoped(prefix)
        try:
            n = await self._run(lambda s: s.delete_prefix(p))
        except Error as e:
            log.error("ferry.p2pstore: delete_prefix %r failed: %s", prefix, e)
            return False
        log.info("ferry.p2pstore: delete_prefix %r: %d keys", prefix, n)
        return True

    async def delete_prefix_batch(self, prefixes: List[str]) -> Dict[str, bool]:
        """{prefix: True unless deleting its keys failed}."""
        return {p: await self.delete_prefix(p) for p in prefixes}

    async def clear(self) -> Dict[str, Any]:
        """Deletes every key of this fleet (never another fleet's): {"success": bool,
        "cleared": how many, "failed": [the keys left]}."""
        t0, p = time.perf_counter(), self._scope
        try:
            n = await self._run(lambda s: s.delete_prefix(p))
            result: Dict[str, Any] = {"success": True, "cleared": n, "failed": []}
        except Error as e:
            log.error("ferry.p2pstore: clear failed: %s", e)
            try:
                left = await self._run(lambda s: s.list(p))
            except Error:
                left = []
            result = {"success": False, "cleared": 0, "failed": [k[len(p):] for k in left],
                      "error": str(e)}
        if self._metrics:
            self._metrics.record_clear(result["success"], time.perf_counter() - t0,
                                       result["cleared"])
        return result

    # -- synchronous --------------------------------------------------------------------------
    def list(self, prefix: Optional[str] = None) -> List[str]:
        """This fleet's keys (starting with prefix), sorted."""
        p, n = self.scoped(prefix or ""), len(self._scope)
        return [k[n:] for k in self._call(lambda s: s.list(p))]

    def list_files(self) -> Dict[str, Dict[str, Any]]:
        """{key: {"host": owner node, "metadata": {...}}} of every key of this fleet."""
        p, n = self._scope, len(self._scope)
        return {i["key"][n:]: _entry(i, n) for i in self._call(lambda s: s.list(p, detail=True))}

    def close(self) -> None:
        """Removes this node's values from the fleet and leaves it. Idempotent."""
        with self._lock:
            store, self._store, self._closed = self._store, None, True
        if store is not None:
            store.close()

    def __enter__(self) -> "P2PClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "P2PClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


def _nbytes(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    n = getattr(value, "nbytes", None)
    return int(n) if isinstance(n, int) else 0


def _save(value: Any, path: str) -> None:
    """Writes the value's bytes to path (upstream's get(output_path=))."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value).tobytes()
    else:  # a framework tensor: through numpy
        data = np.ascontiguousarray(np.asarray(value.cpu() if hasattr(value, "cpu")
                                               else value)).tobytes()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)

