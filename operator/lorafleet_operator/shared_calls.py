"""One call in flight per key, its answer shared by every caller that comes while it runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


@dataclass
class SharedCalls(Generic[K, V]):
    """One call in flight per key, its answer shared by every caller that comes while it runs
    (a "single flight"): a thousand reconciles that need the same agent's registry at once
    make one ListAdapters call, not a thousand."""

    running: dict[K, asyncio.Future[V]] = field(default_factory=dict)

    async def get(self, key: K, call: Callable[[], Awaitable[V]]) -> V:
        """The answer of the call in flight for ``key``, or of ``call()`` started now. Its
        error reaches every caller; a caller that gives up (cancelled) does not cancel it for
        the others."""
        future = self.running.get(key)
        if future is None:
            future = asyncio.ensure_future(call())
            self.running[key] = future
            future.add_done_callback(lambda done: self._done(key, done))
        return await asyncio.shield(future)

    def _done(self, key: K, done: asyncio.Future[V]) -> None:
        if self.running.get(key) is done:
            del self.running[key]
        if not done.cancelled():
            done.exception()  # retrieved here: when every caller gave up, nobody else reads it
