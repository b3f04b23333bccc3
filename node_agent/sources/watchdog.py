"""One download's overall deadline, minimum transfer rate and cancellation, enforced by shutting
its sockets down.

Socket timeouts bound single operations only; a server that trickles a byte now and then never
trips them. The watchdog thread ticks, and once the deadline passes, fewer than the minimum
bytes per second arrived over the last window, or the load's call was cancelled (its client's
deadline passed, or it cancelled), it records why and shuts down every socket of the download,
which ends the blocked read at once.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from collections.abc import Callable

from node_agent.errors import LoadCancelled, SourceUnavailable
from node_agent.sources.policy import SourcePolicy


class Watchdog:
    """Enforces one source's overall deadline and minimum rate, and stops it once `cancelled()`
    (asked at every tick) is true (a context: its thread runs inside)."""

    def __init__(self, policy: SourcePolicy, cancelled: Callable[[], bool] = lambda: False) -> None:
        self.deadline_s = policy.download_timeout_s
        self.min_rate = policy.download_min_bytes_per_s
        self.window_s = policy.download_rate_window_s
        self.cancelled = cancelled
        self.started = time.monotonic()
        self.received = 0
        self.failure: str | None = None
        self.stopped = False  # the failure is the call's cancellation
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="download-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def track(self, sock: socket.socket) -> None:
        """A socket of this download: shut down when the download fails (at once if it has)."""
        with self._lock:
            self._sockets.append(sock)
            if self.failure is not None:
                _shutdown(sock)

    def count(self, n: int) -> None:
        """Bytes received."""
        with self._lock:
            self.received += n

    def check(self, shown: str) -> None:
        """SourceUnavailable when the download broke the deadline or the minimum rate (also
        just before the watchdog's own tick would have noticed); LoadCancelled once stopped."""
        failure = self.failure
        if failure is None and time.monotonic() - self.started >= self.deadline_s:
            failure = f"did not finish within the {self.deadline_s:g}-s download deadline"
        if failure is not None:
            raise (LoadCancelled if self.stopped else SourceUnavailable)(f"download of {shown} {failure}")

    def _run(self) -> None:
        tick = min(0.25, self.window_s / 4)
        samples: collections.deque[tuple[float, int]] = collections.deque([(self.started, 0)])
        while not self._done.wait(tick):
            now = time.monotonic()
            with self._lock:
                received = self.received
            samples.append((now, received))
            while len(samples) > 1 and now - samples[1][0] >= self.window_s:
                samples.popleft()
            if self.cancelled():
                self._fire("was stopped: its load's call was cancelled (the client's deadline passed, or it cancelled)", stopped=True)
            elif now - self.started >= self.deadline_s:
                self._fire(f"did not finish within the {self.deadline_s:g}-s download deadline ({received} bytes received)")
            elif now - samples[0][0] >= self.window_s:
                rate = (received - samples[0][1]) / (now - samples[0][0])
                if rate < self.min_rate:
                    self._fire(
                        f"is too slow: {rate:.0f} bytes/s over the last {now - samples[0][0]:.1f} s, "
                        f"under the minimum of {self.min_rate} bytes/s"
                    )
            if self.failure is not None:
                return

    def _fire(self, why: str, stopped: bool = False) -> None:
        with self._lock:
            self.stopped = stopped  # before the failure: whoever sees the failure sees its kind
            self.failure = why
            for sock in self._sockets:
                _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    # the plain socket's shutdown, also for TLS sockets (it ends a read blocked in another thread)
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
