"""The loads in flight on one agent: shared or exclusive, each learning which others
overlapped it (so a death during a load can be attributed: :mod:`~lorafleet_operator.crashes`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator


class LoadGate:
    """The loads in flight on one agent. A call of loads enters shared (any number at once)
    or exclusive (alone: it waits until no load runs, and none starts while it runs or waits).
    Each call learns which other loads overlapped it, so a death can be attributed."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._running: dict[int, tuple[tuple[str, ...], set[str]]] = {}
        self._exclusive = False
        self._exclusive_waiting = 0
        self._tokens = itertools.count()

    @contextlib.asynccontextmanager
    async def enter(self, names: tuple[str, ...], *, exclusive: bool) -> AsyncIterator[set[str]]:
        """Run one call loading ``names``; yields the names of the other calls' loads that
        overlap it (filled in while it runs)."""
        async with self._cond:
            if exclusive:
                self._exclusive_waiting += 1
                try:
                    await self._cond.wait_for(lambda: not self._running and not self._exclusive)
                finally:
                    self._exclusive_waiting -= 1
                self._exclusive = True
            else:
                await self._cond.wait_for(lambda: not self._exclusive and not self._exclusive_waiting)
            overlap = {other for others, _ in self._running.values() for other in others}
            for _, overlapping in self._running.values():
                overlapping.update(names)
            token = next(self._tokens)
            self._running[token] = (names, overlap)
        try:
            yield overlap
        finally:
            async with self._cond:
                del self._running[token]
                if exclusive:
                    self._exclusive = False
                self._cond.notify_all()
