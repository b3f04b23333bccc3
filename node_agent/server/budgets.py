"""Call budgets: how many control or inference calls run at once, and how many may wait.

One rule for both APIs: a call takes a free place at once; when every place is taken it waits in
a bounded FIFO queue for at most the queue's wait (or its own deadline, if sooner), and beyond
the queue it is refused at once. A place given back goes straight to the oldest waiter, so no
newcomer passes the queue. gRPC's threads wait with `acquire`, the HTTP API's event loop with
`acquire_async`, which never blocks the loop; both go through the same `_enter` and `_leave`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from node_agent.errors import AgentError, DeadlineExceeded, ShuttingDown, TooManyCalls


@dataclass(frozen=True)
class QueueRule:
    """How many calls may wait for a place and how long each may wait, and the flags that set them."""

    size: int  # 0: no queue, a call beyond the limit is refused at once
    max_wait_s: float = 0.0
    size_flag: str = ""
    wait_flag: str = ""


NO_QUEUE = QueueRule(0)
DEADLINE_SLACK_S = 0.05


@dataclass(frozen=True)
class _Wait:
    """How long one queued call waits, until when (time.monotonic()), and whether its own
    deadline (not the queue's) set it."""

    seconds: float
    until: float
    by_deadline: bool


class _Waiter:
    """A queued call: `wake` tells it that it was handed a place (`admitted`) or must leave."""

    def __init__(self, wake: Callable[[], object]) -> None:
        self.wake = wake
        self.admitted = False

    def notify(self) -> bool:
        """Wake the call; False if it can never wake (its event loop is closed)."""
        try:
            self.wake()
        except RuntimeError:
            return False
        return True


class CallBudget:
    """At most `limit` calls of one class at once, and at most `queue.size` more waiting (FIFO)."""

    def __init__(self, what: str, limit: int, flag: str, queue: QueueRule = NO_QUEUE) -> None:
        if limit < 1:
            raise ValueError(f"{flag} must be at least 1, got {limit}")
        if queue.size < 0:
            raise ValueError(f"{queue.size_flag} must be 0 or more, got {queue.size}")
        if queue.size and not queue.max_wait_s > 0:
            raise ValueError(f"{queue.wait_flag} must be positive, got {queue.max_wait_s}")
        self.what, self.limit, self.flag, self.queue = what, limit, flag, queue
        self.running = 0
        self._waiters: deque[_Waiter] = deque()
        self._closed = False
        self._idle = threading.Condition()

    @property
    def waiting(self) -> int:
        """Calls waiting in the queue for a place."""
        return len(self._waiters)

    def acquire(self, deadline_s: float | None = None, on_end: Callable[[Callable[[], None]], bool] | None = None) -> None:
        """Take a place for this thread, waiting in the queue if every place is taken.

        `deadline_s`: the seconds the call has left (its own deadline), if any. `on_end`
        registers a callback run when the call ends (gRPC's `context.add_callback`; False if it
        already ended): a call that ends while it waits leaves the queue. Raises `TooManyCalls`
        beyond the queue or after the queue's wait, `DeadlineExceeded` when the call's deadline
        passed or it ended first (it never runs), `ShuttingDown` once the budget is closed.
        """
        woken = threading.Event()
        waiter = self._enter(woken.set)
        if waiter is None:
            return
        wait = self._wait(deadline_s)
        ended = threading.Event()

        def end() -> None:
            ended.set()
            woken.set()

        if on_end is None or on_end(end):
            woken.wait(wait.seconds)
        else:
            ended.set()
        if not self._leave(waiter):
            raise self._refusal(wait, ended.is_set())

    async def acquire_async(self) -> None:
        """`acquire` for a coroutine: the same rule, waiting without blocking its event loop.
        A cancelled wait leaves the queue (or gives back the place handed to it meanwhile)."""
        loop = asyncio.get_running_loop()
        admitted: asyncio.Future[None] = loop.create_future()
        waiter = self._enter(lambda: loop.call_soon_threadsafe(_resolve, admitted))
        if waiter is None:
            return
        wait = self._wait(None)
        try:
            await asyncio.wait_for(admitted, wait.seconds)
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            if self._leave(waiter):
                self.release()
            raise
        if not self._leave(waiter):
            raise self._refusal(wait, ended=False)

    def release(self) -> None:
        """Give a place back: to the oldest waiter, or free (which wakes `wait_idle`)."""
        with self._idle:
            while self._waiters and not self._closed:  # once closed, the woken waiters leave refused
                waiter = self._waiters.popleft()
                waiter.admitted = True
                if waiter.notify():  # else nobody can take the place: the next waiter's
                    return
            self.running -= 1
            self._idle.notify_all()

    def close(self) -> None:
        """Refuse every call from now on (`ShuttingDown`), the queued ones included; the running
        ones keep their places until they end."""
        with self._idle:
            self._closed = True
            for waiter in self._waiters:
                waiter.notify()

    def wait_idle(self, deadline: float) -> bool:
        """Wait until no call of this class runs, or `deadline` (time.monotonic()) passes."""
        with self._idle:
            while self.running:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
            return True

    # -- the rule ----------------------------------------------------------------------------

    def _enter(self, wake: Callable[[], object]) -> _Waiter | None:
        """A free place (None), or a place in the queue; refused beyond the queue or once closed.
        A place given back goes to a waiter first, so a free place means nobody waits."""
        with self._idle:
            if self._closed:
                raise self._closed_refusal()
            if self.running < self.limit:
                self.running += 1
                return None
            if len(self._waiters) >= self.queue.size:
                raise TooManyCalls(self._full_message())
            waiter = _Waiter(wake)
            self._waiters.append(waiter)
            return waiter

    def _leave(self, waiter: _Waiter) -> bool:
        """Whether the waiter was handed a place; if not, it leaves the queue."""
        with self._idle:
            if waiter.admitted:
                return True
            self._waiters.remove(waiter)
            return False

    def _wait(self, deadline_s: float | None) -> _Wait:
        """The queue's wait, or the call's own deadline if sooner."""
        if deadline_s is not None and deadline_s < self.queue.max_wait_s:
            seconds, by_deadline = max(0.0, deadline_s), True
        else:
            seconds, by_deadline = self.queue.max_wait_s, False
        return _Wait(seconds, time.monotonic() + seconds, by_deadline)

    def _refusal(self, wait: _Wait, ended: bool) -> AgentError:
        """Why a queued call leaves without a place (it never ran)."""
        if self._closed:
            return self._closed_refusal()
        # gRPC ends a call whose deadline passed (by its own clock, so within a slack of ours):
        # that is the deadline, not a cancellation.
        if ended and not (wait.by_deadline and time.monotonic() >= wait.until - DEADLINE_SLACK_S):
            return DeadlineExceeded(f"the call ended while it waited for a place among the {self.what} calls; it never ran", "cancelled")
        if wait.by_deadline:
            return DeadlineExceeded(
                f"the call's deadline passed after {wait.seconds:.3g} s waiting for a place among the {self.what} calls "
                f"({self.running} running, the limit is {self.limit} ({self.flag})); it never ran"
            )
        return TooManyCalls(
            f"no place among the {self.what} calls within {self.queue.max_wait_s:g} s ({self.queue.wait_flag}): "
            f"{self.running} running, the limit is {self.limit} ({self.flag}); retry later",
            "queue_timeout",
        )

    def _full_message(self) -> str:
        running = f"too many concurrent {self.what} calls: {self.running} running, the limit is {self.limit} ({self.flag})"
        if not self.queue.size:
            return f"{running}; retry later"
        return f"{running}, and {len(self._waiters)} waiting, the queue's limit is {self.queue.size} ({self.queue.size_flag}); retry later"

    def _closed_refusal(self) -> ShuttingDown:
        return ShuttingDown(f"the agent is shutting down: {self.what} calls are refused")


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # a wait that timed out or was cancelled has cancelled it
        future.set_result(None)
