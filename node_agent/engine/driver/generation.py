"""A sequence submitted to the engine as its caller sees it: a queue of events the step loop
fills (`Request`), and the running generation handed to the caller (`Generation`)."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from node_agent.engine.serving.sampler import FinishReason, TokenLogprobs


@dataclass(frozen=True)
class GeneratedStep:
    """One token of a generation, its logprobs if asked for, and why the sequence ended (None
    until its last token)."""

    token_id: int
    logprobs: TokenLogprobs | None
    finish: FinishReason | None

    @property
    def finish_reason(self) -> str:
        """`finish` as the seam names it: "" until the last token, then "stop" or "length"."""
        return "" if self.finish is None else self.finish.value


@dataclass(frozen=True)
class PromptLogits:
    """The end of a Forward's sequence: the logits of every position."""

    logits: np.ndarray


@dataclass(frozen=True)
class Cancelled:
    """Wakes a reader blocked on a generation that `cancel` ended from another thread."""


Event = GeneratedStep | PromptLogits | Cancelled | BaseException


class Request:
    """A submitted sequence as its caller sees it: a queue of steps, then an end. A Forward's
    sequence gathers its chunks' logits in `logits` and ends with one `PromptLogits`."""

    def __init__(self, seq_id: int, adapter: str | None, prompt_len: int = 0) -> None:
        self.seq_id = seq_id
        self.adapter = adapter
        self.prompt_len = prompt_len  # a Forward's: the rows of its logits
        # SimpleQueue: its put and get are C calls, where queue.Queue runs Python code and
        # allocates a lock per wait (the step loop puts one event per sequence and step).
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.logits: np.ndarray | None = None

    def add_logits(self, position: int, chunk: np.ndarray) -> None:
        """A Forward chunk's logits, at its positions (a chunk recomputed after a preemption
        overwrites the same rows)."""
        if self.logits is None:
            self.logits = np.empty((self.prompt_len, chunk.shape[1]), dtype=np.float32)
        self.logits[position : position + chunk.shape[0]] = chunk


class Generation:
    """A running `Engine.submit`: iterate `tokens()` for its steps; `cancel()` frees its blocks."""

    def __init__(self, request: Request, drop: Callable[[int], bool]) -> None:
        self._request = request
        self._drop = drop  # the step loop's cancel of a sequence id
        self.done = False
        self.cancelled = False  # ended by `cancel` (the caller went away), not by a finish

    @property
    def seq_id(self) -> int:
        return self._request.seq_id

    def tokens(self, poll_s: float = 0.1, cancelled: Callable[[], bool] | None = None) -> Iterator[GeneratedStep]:
        """Each generated token as its step completes; the last carries its finish reason. An
        engine failure (or the adapter unloaded under it) raises EngineError. With `cancelled`,
        checked every `poll_s` while waiting, the sequence is cancelled and the iteration ends.
        Without it the wait blocks until the next event: the reading thread is woken only when
        there is one (`cancel` from another thread puts one too), not every `poll_s`."""
        events = self._request.events
        while not self.done:
            if cancelled is None:
                event = events.get()
            else:
                try:
                    event = events.get(timeout=poll_s)
                except queue.Empty:
                    if cancelled():
                        self.cancel()
                        return
                    continue
            if isinstance(event, Cancelled):
                return
            if isinstance(event, BaseException):
                self.done = True
                raise event
            assert isinstance(event, GeneratedStep)  # a Generation is never a Forward
            if event.finish is not None:
                self.done = True
            yield event

    def cancel(self) -> bool:
        """Drop the sequence now (waiting or running) and free its blocks; False if it had ended."""
        dropped = self._drop(self._request.seq_id)
        self.cancelled = self.cancelled or (dropped and not self.done)
        self.done = True
        self._request.events.put(Cancelled())  # a reader blocked in tokens() returns
        return dropped
