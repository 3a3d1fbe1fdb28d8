"""ferry.p2pstore: a drop-in for the p2p-store client that FastDeploy's RoutingStoreRDMA uses
(`from p2pstore import P2PClient, P2PConfig`), over ferry.Store.

    from ferry.p2pstore import P2PClient, P2PConfig        # the one changed import
    client = P2PClient(P2PConfig(metadata_server="ferry://trainer:7700"))
    await client.put("req-42_3", routing_indices)          # numpy array, CPU tensor, or bytes
    ids = await client.get("req-42_3")                     # numpy array (None: no such key)
    await client.delete("req-42_3"); await client.delete_batch(["req-42_3"])
    await client.delete_prefix_batch(["req-42"]); await client.clear()

Every data method is a coroutine, run in the loop's default executor (ferry releases the GIL),
so it works from a running loop and from `asyncio.run(client.get(k))` alike. The metadata
server is ferry's directory: ferry://HOST:PORT (`ferry serve`, or a process that opened a
Store with host_directory=True), redis://HOST:PORT[/DB], or a bare HOST:PORT (ferry://).
"""
import asyncio
import functools
from typing import Any, Dict, Iterable, List, Optional

from .store import Store
from .tensors import Like

__all__ = ["P2PConfig", "P2PClient"]


class P2PConfig:
    """What a P2PClient connects to.

    metadata_server: the directory URL (ferry://HOST:PORT, redis://HOST:PORT[/DB], or HOST:PORT
    meaning ferry://); None: FERRY_DIRECTORY. name: this node's name in the fleet (unique;
    default <hostname>-<pid>). timeout: seconds of each call (None: FERRY_TIMEOUT_MS).
    capacity: bytes of this node's pool for copied puts (0: FERRY_STORE_CAPACITY)."""

    def __init__(self, metadata_server: Optional[str] = None, name: Optional[str] = None,
                 timeout: Optional[float] = None, capacity: int = 0) -> None:
        if metadata_server is not None and not isinstance(metadata_server, str):
            raise TypeError("ferry.p2pstore: metadata_server must be a str such as "
                            "'ferry://host:7700', not %s" % type(metadata_server).__name__)
        if metadata_server and "://" not in metadata_server:
            metadata_server = "ferry://" + metadata_server
        if metadata_server and metadata_server.split("://", 1)[0] not in ("ferry", "redis"):
            raise ValueError("ferry.p2pstore: metadata_server %r: ferry's directory is "
                             "ferry://HOST:PORT (`ferry serve`) or redis://HOST:PORT[/DB]"
                             % metadata_server)
        self.metadata_server = metadata_server
        self.name = name
        self.timeout = timeout
        self.capacity = capacity

    def __repr__(self) -> str:
        return "P2PConfig(metadata_server=%r, name=%r)" % (self.metadata_server, self.name)


class P2PClient:
    """The p2p-store client's methods as coroutines over a ferry.Store node (opened at once).

    Values put from ordinary memory are copied once into this node's pool, so the caller may
    reuse its buffer as soon as put returns; readers anywhere in the fleet read them from here.
    They live until deleted or until this client closes (close(), or the process ends)."""

    def __init__(self, config: Optional[P2PConfig] = None) -> None:
        config = config or P2PConfig()
        if not isinstance(config, P2PConfig):
            raise TypeError("ferry.p2pstore: P2PClient takes a P2PConfig(metadata_server=...), "
                            "not %s" % type(config).__name__)
        self.config = config
        self.store = Store(config.metadata_server, name=config.name, timeout=config.timeout,
                           capacity=config.capacity)

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(fn, *args, **kwargs))

    async def put(self, key: str, value: Any) -> bool:
        """Publishes value (numpy array, CPU tensor of any framework, or bytes) under key,
        replacing any previous one; True once every node can get it. Raises on failure."""
        await self._run(self.store.put, key, value)
        return True

    async def get(self, key: str, like: Like = "numpy") -> Any:
        """The value under key, copied: a numpy array (a value put as bytes comes back as
        uint8; like=bytes gives bytes, like="torch" or any module with from_dlpack that
        framework's tensor); None when there is no such key."""
        from .errors import NotFound
        try:
            return await self._run(self.store.get, key, like=like)
        except NotFound:
            return None

    async def delete(self, key: str) -> bool:
        """True when key was deleted, False when there was no such key."""
        return await self._run(self.store.delete, key)

    async def delete_batch(self, keys: Iterable[str]) -> Dict[str, bool]:
        """{key: True if deleted, False if it did not exist}."""
        return await self._run(self.store.delete_batch, list(keys))

    async def delete_prefix_batch(self, prefixes: Iterable[str]) -> Dict[str, int]:
        """{prefix: how many keys starting with it were deleted}."""
        return await self._run(self.store.delete_prefix_batch, list(prefixes))

    async def clear(self) -> Dict[str, Any]:
        """Deletes every object of the fleet: {"success": bool, "cleared": n, "failed": n}."""
        return await self._run(self.store.clear)

    async def exists(self, key: str) -> bool:
        """True when key exists anywhere in the fleet."""
        return await self._run(self.store.exists, key)

    async def list(self, prefix: str = "") -> List[str]:
        """The keys starting with prefix, sorted."""
        return await self._run(self.store.list, prefix)

    def close(self) -> None:
        """Removes this node's values from the fleet and leaves it. Idempotent."""
        self.store.close()

    def __enter__(self) -> "P2PClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "P2PClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()
