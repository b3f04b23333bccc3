"""The operator's per-agent queue of waiting loads and unloads (work_queue.WorkQueue): jobs of
one key run oldest first, at most ``width`` at once, other keys apart; a job's error reaches its caller;
a caller that gives up drops its job while it waits (its ``dropped`` runs, the job never does)
and cancels it while it runs; the operator stopping cancels the callers' futures. Its batching
core (work_queue.BatchQueue, the loads' queue): a worker sends the oldest waiting item with
those behind it that may join it, up to the size; a sent batch is cancelled only when every
one of its callers gave up."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import pytest

from lorafleet_operator.work_queue import BatchQueue, WorkQueue


class Jobs:
    """Jobs that record when they start and end, each waiting until released."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.ended: list[str] = []
        self.cancelled: list[str] = []
        self.release = asyncio.Event()

    def job(self, name: str, error: Exception | None = None) -> Callable[[], Awaitable[str]]:
        async def run() -> str:
            self.started.append(name)
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.append(name)
                raise
            self.ended.append(name)
            if error is not None:
                raise error
            return f"{name} done"

        return run


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_jobs_of_a_key_run_oldest_first_at_most_width_at_once_other_keys_apart() -> None:
    async def run() -> None:
        queue, jobs = WorkQueue(2), Jobs()
        futures = [queue.submit("a", jobs.job(f"a{i}")) for i in range(5)]
        futures.append(queue.submit("b", jobs.job("b0")))
        await settle()
        assert jobs.started == ["a0", "a1", "b0"]  # two of a's at once; b's not behind them
        jobs.release.set()
        assert await asyncio.gather(*futures) == [f"a{i} done" for i in range(5)] + ["b0 done"]
        assert jobs.started == ["a0", "a1", "b0", "a2", "a3", "a4"]
        assert not asyncio.all_tasks() - {asyncio.current_task()}  # the workers left

    asyncio.run(run())


def test_a_jobs_error_reaches_its_caller_only() -> None:
    async def run() -> None:
        queue, jobs = WorkQueue(1), Jobs()
        failing = queue.submit("a", jobs.job("a0", RuntimeError("refused")))
        fine = queue.submit("a", jobs.job("a1"))
        jobs.release.set()
        with pytest.raises(RuntimeError, match="refused"):
            await failing
        assert await fine == "a1 done"

    asyncio.run(run())


def test_a_caller_giving_up_drops_its_waiting_job_and_cancels_its_running_one() -> None:
    async def run() -> None:
        queue, jobs, dropped = WorkQueue(1), Jobs(), []
        running = queue.submit("a", jobs.job("a0"))
        waiting = queue.submit("a", jobs.job("a1"), lambda: dropped.append("a1"))
        after = queue.submit("a", jobs.job("a2"))
        await settle()
        waiting.cancel()
        running.cancel()
        await settle()
        assert jobs.cancelled == ["a0"]
        assert dropped == ["a1"]
        assert jobs.started == ["a0", "a2"]  # a1 never ran; the next one did
        jobs.release.set()
        assert await after == "a2 done"

    asyncio.run(run())


def test_the_operator_stopping_cancels_the_callers_futures() -> None:
    async def run() -> None:
        queue, jobs = WorkQueue(1), Jobs()
        running = queue.submit("a", jobs.job("a0"))
        await settle()
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()  # as asyncio.run does to a stopping operator's tasks
        await settle()
        assert running.cancelled()
        assert jobs.cancelled == ["a0"]

    asyncio.run(run())


class Sends:
    """A BatchQueue's sends, recorded; each waits until released and answers its items."""

    def __init__(self) -> None:
        self.sent: list[list[str]] = []
        self.cancelled: list[list[str]] = []
        self.release = asyncio.Event()

    async def send(self, items: Sequence[str]) -> list[str]:
        self.sent.append(list(items))
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(list(items))
            raise
        return [f"{item} done" for item in items]


def test_a_worker_sends_the_waiting_items_that_join_the_oldest_up_to_the_size() -> None:
    async def run() -> None:
        sends = Sends()
        # Items join the oldest only when of its kind (the first letter), as loads with other
        # credentials or to load alone do not.
        queue: BatchQueue[str, str] = BatchQueue(1, 3, sends.send, lambda a, b: a[0] == b[0])
        futures = [queue.submit("agent", item) for item in ("a0", "a1", "b0", "a2", "a3", "a4", "a5")]
        sends.release.set()
        assert await asyncio.gather(*futures) == [f"{i} done" for i in ("a0", "a1", "b0", "a2", "a3", "a4", "a5")]
        # Oldest first; a batch ends at the first item that may not join it, or at the size.
        assert sends.sent == [["a0", "a1"], ["b0"], ["a2", "a3", "a4"], ["a5"]]

    asyncio.run(run())


def test_a_sent_batch_is_cancelled_only_when_every_caller_gave_up() -> None:
    async def run() -> None:
        sends = Sends()
        queue: BatchQueue[str, str] = BatchQueue(1, 4, sends.send)
        first, second = queue.submit("agent", "x"), queue.submit("agent", "y")
        await settle()
        assert sends.sent == [["x", "y"]]
        first.cancel()
        await settle()
        assert not sends.cancelled  # "y" still wants its outcome
        sends.release.set()
        assert await second == "y done"
        third, fourth = queue.submit("agent", "z"), queue.submit("agent", "w")
        sends.release.clear()
        await settle()
        third.cancel()
        fourth.cancel()
        await settle()
        assert sends.cancelled == [["z", "w"]]

    asyncio.run(run())
