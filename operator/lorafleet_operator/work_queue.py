"""Queues of work per key, drained by a bounded number of workers per key: how the operator's
loads and unloads wait for each agent (``Runtime.loads``, ``AgentClients.unload_each``).

A waiting item is plain data (or a closure) and a future, not a suspended call and its task:
at 1,000 adapters x 64 agents, 64,000 suspended calls held about 400 MiB (docs/operator.md).
A worker may take several waiting items of its key into one send (:class:`BatchQueue`): the
loads of one agent go as one LoadAdapters call, whose per-call cost (the operator's gRPC call,
the agent's server) they then share.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")  #: an item
V = TypeVar("V")


@dataclass(frozen=True)
class _Job(Generic[T, V]):
    """One waiting item of a :class:`BatchQueue`: the item, the future its caller awaits, and
    what undoes its preparations when its caller gives up before it is sent."""

    item: T
    future: asyncio.Future[V]
    dropped: Callable[[], None]


class BatchQueue(Generic[T, V]):
    """Items per key (an agent's endpoint), oldest first, sent by at most ``width`` workers
    per key; each worker takes the oldest waiting item and, behind it, up to ``size`` in all
    that ``joins`` lets go with it (``joins(first, other)``, asked at that moment), and hands
    them to ``send``, which answers one outcome per item in their order.

    A caller that gives up (cancels its future) drops its item while it waits (its
    ``dropped`` runs; it is never sent); once sent, the send is cancelled only when every
    caller of it has given up, as a cancelled call would be (the others still want theirs).
    """

    def __init__(
        self,
        width: int,
        size: int,
        send: Callable[[Sequence[T]], Awaitable[Sequence[V]]],
        joins: Callable[[T, T], bool] = lambda first, other: True,
    ) -> None:
        self._width, self._size, self._send, self._joins = width, max(size, 1), send, joins
        self._waiting: dict[str, collections.deque[_Job[T, V]]] = {}
        self._workers: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # held until done (asyncio's refs are weak)

    def submit(self, key: str, item: T, dropped: Callable[[], None] = lambda: None) -> asyncio.Future[V]:
        """Queue ``item`` behind ``key``'s others; the future of its outcome."""
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, collections.deque()).append(_Job(item, future, dropped))
        workers = self._workers.get(key, 0)
        if workers < self._width:
            self._workers[key] = workers + 1
            task = asyncio.create_task(self._drain(key))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return future

    async def _drain(self, key: str) -> None:
        """One worker of ``key``: the oldest waiting items, one send at a time, until none
        waits. It leaves (its count drops) in the step in which it finds the queue empty, so
        an item queued after that always gets a new worker."""
        queue = self._waiting[key]
        try:
            while queue:
                batch = self._take(queue)
                if batch:
                    await self._run(batch)
        finally:
            self._workers[key] -= 1
            if not self._workers[key] and not queue:
                del self._workers[key], self._waiting[key]

    def _take(self, queue: collections.deque[_Job[T, V]]) -> list[_Job[T, V]]:
        """The oldest live job and those behind it that may join it (up to ``size``); jobs
        whose callers gave up are dropped on the way."""
        batch: list[_Job[T, V]] = []
        while queue and len(batch) < self._size:
            job = queue[0]
            if job.future.done():  # its caller gave up before it was sent
                queue.popleft()
                job.dropped()
            elif not batch or self._joins(batch[0].item, job.item):
                batch.append(queue.popleft())
            else:
                break
        return batch

    async def _run(self, batch: Sequence[_Job[T, V]]) -> None:
        """Send one batch in a task of its own, which its callers' cancels reach once every
        one of them gave up."""
        task = asyncio.ensure_future(self._send([job.item for job in batch]))

        def caller_gave_up(future: asyncio.Future[Any]) -> None:
            if future.cancelled() and all(job.future.done() for job in batch):
                task.cancel()

        for job in batch:
            job.future.add_done_callback(caller_gave_up)
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError:  # the operator stops: nothing will answer the callers
            task.cancel()
            for job in batch:
                job.future.cancel()
            raise
        _settle(batch, task)


def _settle(batch: Sequence[_Job[T, V]], task: asyncio.Future[Sequence[V]]) -> None:
    """Hand a sent batch's outcome to the callers still waiting: cancelled, the send's
    error, or each job's own result."""
    if task.cancelled():
        for job in batch:
            job.future.cancel()
        return
    error = task.exception()
    if error is not None:
        for job in batch:
            if not job.future.done():
                job.future.set_exception(error)
        return
    for job, outcome in zip(batch, task.result(), strict=True):
        if not job.future.done():  # a caller that gave up reads nothing
            job.future.set_result(outcome)


class WorkQueue:
    """Jobs (closures) per key, oldest first, run one at a time by at most ``width`` workers
    per key: a :class:`BatchQueue` whose sends are single jobs."""

    def __init__(self, width: int) -> None:
        self._queue: BatchQueue[Callable[[], Awaitable[Any]], Any] = BatchQueue(width, 1, self._run_one)

    @staticmethod
    async def _run_one(jobs: Sequence[Callable[[], Awaitable[Any]]]) -> list[Any]:
        return [await jobs[0]()]

    def submit(self, key: str, run: Callable[[], Awaitable[V]], dropped: Callable[[], None] = lambda: None) -> asyncio.Future[V]:
        """Queue ``run`` behind ``key``'s other jobs; the future of its outcome."""
        return self._queue.submit(key, run, dropped)
