"""ferry.aio.Store and ferry.aio.MQ: ferry.Store and ferry.MQ with their blocking methods as
coroutines (as zmq.asyncio is to pyzmq).

Each call runs in the event loop's default executor; ferry releases the GIL while it waits, so
many gets, puts, publishes and recvs are in flight together while the loop keeps running. A
cancelled coroutine stops waiting at once; the call itself ends by its timeout."""
import asyncio
import functools
from typing import Any

from . import mq as _mq
from . import store as _store

__all__ = ["Store", "MQ"]

_METHODS = ("put", "get", "get_view", "get_batch", "delete", "delete_batch", "delete_prefix",
            "delete_prefix_batch", "list", "exists", "clear", "stat")
_MQ_METHODS = ("publish", "publish_loan", "recv", "subscribe", "unsubscribe",
               "wait_subscribers")


class Store:
    """Same arguments as ferry.Store; opening and closing block briefly (use `async with`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sync = _store.Store(*args, **kwargs)

    @property
    def directory(self) -> str:
        """The directory URL peers use (as ferry.Store.directory)."""
        return self.sync.directory

    @property
    def name(self) -> str:
        """This node's name."""
        return self.sync.name

    def empty(self, shape: Any, dtype: Any, like: Any = "numpy") -> Any:
        """ferry.Store.empty (not blocking)."""
        return self.sync.empty(shape, dtype, like=like)

    async def close(self) -> None:
        """ferry.Store.close, off the loop."""
        await asyncio.get_running_loop().run_in_executor(None, self.sync.close)

    async def __aenter__(self) -> "Store":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class MQ:
    """Same arguments as ferry.MQ; publish, recv, subscribe, unsubscribe, wait_subscribers and
    publish_loan are coroutines; loan, loan_free, set_callback and subscribers are not."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sync = _mq.MQ(*args, **kwargs)

    @property
    def directory(self) -> str:
        """The directory URL peers use (as ferry.MQ.directory)."""
        return self.sync.directory

    @property
    def name(self) -> str:
        """This node's name."""
        return self.sync.name

    def loan(self, *args: Any, **kwargs: Any) -> Any:
        """ferry.MQ.loan."""
        return self.sync.loan(*args, **kwargs)

    def loan_free(self, arr: Any) -> None:
        """ferry.MQ.loan_free."""
        self.sync.loan_free(arr)

    def set_callback(self, *args: Any, **kwargs: Any) -> None:
        """ferry.MQ.set_callback."""
        self.sync.set_callback(*args, **kwargs)

    def subscribers(self, topic: str) -> int:
        """ferry.MQ.subscribers."""
        return self.sync.subscribers(topic)

    async def close(self) -> None:
        """ferry.MQ.close, off the loop."""
        await asyncio.get_running_loop().run_in_executor(None, self.sync.close)

    async def __aenter__(self) -> "MQ":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _wrap(name: str, cls: Any = _store.Store) -> Any:
    method = getattr(cls, name)

    @functools.wraps(method)
    async def call(self, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(method, self.sync, *args,
                                                                  **kwargs))
    return call


for _name in _METHODS:
    setattr(Store, _name, _wrap(_name))
for _name in _MQ_METHODS:
    setattr(MQ, _name, _wrap(_name, _mq.MQ))
