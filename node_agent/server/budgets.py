"""Call budgets: how many control or inference calls run at once; one more is refused, never queued."""

from __future__ import annotations

import threading
import time

from node_agent.errors import TooManyCalls


class CallBudget:
    """At most `limit` calls of one class at once; one more is refused at once, never queued."""

    def __init__(self, what: str, limit: int, flag: str) -> None:
        if limit < 1:
            raise ValueError(f"{flag} must be at least 1, got {limit}")
        self.what, self.limit, self.flag = what, limit, flag
        self.running = 0
        self._idle = threading.Condition()

    def acquire(self) -> None:
        """Take a place, or raise `TooManyCalls` at once (no waiting)."""
        with self._idle:
            if self.running >= self.limit:
                raise TooManyCalls(
                    f"too many concurrent {self.what} calls: {self.running} running, the limit is {self.limit} ({self.flag}); retry later"
                )
            self.running += 1

    def release(self) -> None:
        """Give a place back; wakes `wait_idle`."""
        with self._idle:
            self.running -= 1
            self._idle.notify_all()

    def wait_idle(self, deadline: float) -> bool:
        """Wait until no call of this class runs, or `deadline` (time.monotonic()) passes."""
        with self._idle:
            while self.running:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
            return True
