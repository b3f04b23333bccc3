"""A queue of jobs per key, run by a bounded number of workers per key: how the operator's
loads and unloads wait for each agent (``Runtime.loads``, ``AgentClients.unload_each``).

A waiting job is a closure and a future, not a suspended call and its task: at 1,000 adapters
x 64 agents, 64,000 suspended calls held about 400 MiB (docs/operator.md).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

V = TypeVar("V")


@dataclass(frozen=True)
class _Job(Generic[V]):
    """One waiting job of a :class:`WorkQueue`: what runs it, the future its caller awaits,
    and what undoes its preparations when its caller gives up before it starts."""

    run: Callable[[], Awaitable[V]]
    future: asyncio.Future[V]
    dropped: Callable[[], None]


class WorkQueue:
    """Jobs per key (an agent's endpoint), oldest first, run by at most ``width`` workers per
    key; a waiting job is a closure and a future (the module docstring says why).

    A caller that gives up (cancels its future) cancels its job: one still waiting never runs
    (its ``dropped`` runs instead), one running is cancelled, as a cancelled call would be.
    """

    def __init__(self, width: int) -> None:
        self._width = width
        self._waiting: dict[str, collections.deque[_Job[Any]]] = {}
        self._workers: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # held until done (asyncio's refs are weak)

    def submit(self, key: str, run: Callable[[], Awaitable[V]],
               dropped: Callable[[], None] = lambda: None) -> asyncio.Future[V]:
        """Queue ``run`` behind ``key``'s other jobs; the future of its outcome."""
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, collections.deque()).append(_Job(run, future, dropped))
        workers = self._workers.get(key, 0)
        if workers < self._width:
            self._workers[key] = workers + 1
            task = asyncio.create_task(self._drain(key))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return future

    async def _drain(self, key: str) -> None:
        """One worker of ``key``: the oldest waiting job, one at a time, until none waits. It
        leaves (its count drops) in the step in which it finds the queue empty, so a job
        queued after that always gets a new worker."""
        queue = self._waiting[key]
        try:
            while queue:
                job = queue.popleft()
                if job.future.done():  # its caller gave up before it started
                    job.dropped()
                    continue
                await self._run(job)
        finally:
            self._workers[key] -= 1
            if not self._workers[key] and not queue:
                del self._workers[key], self._waiting[key]

    @staticmethod
    async def _run(job: _Job[Any]) -> None:
        """Run one job in a task of its own, which its caller's cancel reaches."""
        task = asyncio.ensure_future(job.run())

        def caller_gave_up(future: asyncio.Future[Any]) -> None:
            if future.cancelled():
                task.cancel()

        job.future.add_done_callback(caller_gave_up)
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError:  # the operator stops: nothing will answer the caller
            task.cancel()
            job.future.cancel()
            raise
        if job.future.done():  # cancelled by its caller: nobody reads the outcome
            if not task.cancelled():
                task.exception()  # retrieved, so asyncio does not warn
        elif task.cancelled():
            job.future.cancel()
        elif (error := task.exception()) is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(task.result())
