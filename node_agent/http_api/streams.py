"""Generations for the event loop: each choice's `Agent.generate` runs on a thread of its own and
hands its tokens to the loop; closing the streams cancels whatever still runs.

`Agent.generate` blocks between tokens (it waits for the engine's steps), so it cannot run on
the loop. One thread per choice is what a gRPC stream costs too (a server thread), and it keeps
the path of a token the same: the engine's step, the agent's generator, then the wire.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from node_agent.agent import Agent
from node_agent.values import GeneratedToken, GenerateParams


@dataclass(frozen=True)
class Event:
    """One step of one choice: a token, or the error that ended the choice."""

    index: int
    token: GeneratedToken | None = None
    error: BaseException | None = None

    @property
    def last(self) -> bool:
        return self.error is not None or (self.token is not None and bool(self.token.finish_reason))


class Choices:
    """The running generations of one request, one per choice, read as batches of events.

    Tokens are handed over in batches: a thread appends to a buffer and wakes the loop only when
    no wake-up is pending, and the loop takes everything buffered at once, so a busy step of
    many choices costs one wake-up and one write, not one per token.
    """

    def __init__(self, agent: Agent, params: Sequence[GenerateParams]) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._lock = threading.Lock()
        self._buffer: list[Event] = []
        self._wake_pending = False
        self._stop = threading.Event()
        self._pending = len(params)  # choices that have not ended
        self._threads = [
            threading.Thread(target=self._run, args=(agent, index, item), name=f"lorafleet-http-{index}", daemon=True)
            for index, item in enumerate(params)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, agent: Agent, index: int, params: GenerateParams) -> None:
        tokens = agent.generate(params, cancelled=self._stop.is_set)
        try:
            for token in tokens:
                self._put(Event(index, token=token))
                if self._stop.is_set():
                    return  # `finally` closes the generator: the agent cancels the sequence
        except Exception as error:
            self._put(Event(index, error=error))
        finally:
            tokens.close()

    def _put(self, event: Event) -> None:
        with self._lock:
            self._buffer.append(event)
            if self._wake_pending:
                return
            self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the loop is closed (the server stopped): nobody reads any more
            self._stop.set()

    async def _take(self) -> list[Event]:
        """Every buffered event, waiting for one if there is none."""
        while True:
            with self._lock:
                events, self._buffer = self._buffer, []
                self._wake_pending = False
                if not events:
                    self._ready.clear()
            if events:
                self._pending -= sum(event.last for event in events)
                return events
            await self._ready.wait()

    async def batches(self) -> AsyncIterator[list[Event]]:
        """Every choice's events in the order they happen, a batch at a time, until each choice
        has ended."""
        while self._pending:
            yield await self._take()

    async def first(self) -> list[Event]:
        """Wait until every choice has produced its first event (a token or its error), so that a
        refusal can still be answered with its HTTP status; returns the events read so far."""
        events: list[Event] = []
        while len({event.index for event in events}) < len(self._threads):
            events += await self._take()
        return events

    def close(self) -> None:
        """Cancel every choice still running (the client went away, or a choice failed)."""
        self._stop.set()
