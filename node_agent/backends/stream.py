"""A completion streamed from a server, as the seam's `TokenStream`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from node_agent.backend import BackendError, Overloaded, RequestRefused, SequenceAborted
from node_agent.backends.server import CompletionStep, InferenceServer, Refusal, StreamBroken


class ServerStream:
    """The steps of one server's streamed completion. `on_end` runs once, when the stream
    finished, failed or was cancelled (the backend's count of open streams)."""

    def __init__(self, steps: Iterator[CompletionStep], where: str, on_end: Callable[[], None]) -> None:
        self._steps = steps
        self._where = where
        self._on_end = on_end
        self._lock = threading.Lock()
        self._ended = False
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def tokens(self, poll_s: float = 0.1, cancelled: Callable[[], bool] | None = None) -> Iterator[CompletionStep]:
        """Each step as the server sends it. `cancelled` is checked between steps (a blocking
        read cannot be polled: a caller that went away is noticed at the next token)."""
        try:
            for step in self._steps:
                if cancelled is not None and cancelled():
                    self.cancel()
                    return
                yield step
                if step.finish_reason:
                    return
        except StreamBroken as error:
            raise _stream_error(error, self._where) from None
        except (OSError, ValueError) as error:
            raise BackendError(f"{self._where}: the stream broke: {error}") from None
        finally:
            self._end()

    def cancel(self) -> bool:
        """Close the connection, which aborts the request on the server; False if it had ended."""
        with self._lock:
            if self._ended:
                return False
            self._cancelled = True
        self._end()
        return True

    def _end(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        close = getattr(self._steps, "close", None)
        if close is not None:
            # ValueError: the generator runs in another thread; it closes its connection at its next step.
            with contextlib.suppress(ValueError):
                close()
        self._on_end()


def _stream_error(error: StreamBroken, where: str) -> BackendError:
    """A stream's error event as the seam's error: an adapter unloaded under a running request
    (the server no longer knows the model) aborts it."""
    refusal = error.refusal
    if refusal.status == 404:
        return SequenceAborted(f"{where}: {refusal.describe()}")
    return BackendError(f"{where}: {refusal.describe()}")


def refusal_error(server: InferenceServer, refusal: Refusal) -> Exception:
    """A server's refusal of a completion, before its first token, as the seam's error."""
    message = f"server {server.url} refused the request: {refusal.describe()}"
    if refusal.status in (429, 503):
        return Overloaded(message)
    if refusal.status in (400, 422):
        return RequestRefused(message)
    return BackendError(message)
