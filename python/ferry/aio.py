"""ferry.aio.Store: ferry.Store with every method a coroutine.

Each call runs in the event loop's default executor; ferry releases the GIL while it waits, so
many gets and puts are in flight together while the loop keeps running."""
import asyncio
import functools

from . import store as _store

__all__ = ["Store"]

_METHODS = ("put", "get", "get_batch", "delete", "delete_batch", "delete_prefix", "list",
            "exists", "clear", "stat")


class Store:
    """Same arguments as ferry.Store; opening and closing block briefly (use `async with`)."""

    def __init__(self, *args, **kwargs):
        self.sync = _store.Store(*args, **kwargs)

    @property
    def directory(self):
        return self.sync.directory

    @property
    def name(self):
        return self.sync.name

    def empty(self, shape, dtype, like="numpy"):
        return self.sync.empty(shape, dtype, like=like)

    async def close(self):
        await asyncio.get_running_loop().run_in_executor(None, self.sync.close)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


def _wrap(name):
    method = getattr(_store.Store, name)

    @functools.wraps(method)
    async def call(self, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(method, self.sync, *args,
                                                                  **kwargs))
    return call


for _name in _METHODS:
    setattr(Store, _name, _wrap(_name))
