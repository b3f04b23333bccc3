"""The step loop: the one thread that schedules (docs/serving.md), and the requests it serves.

Each step is a single command to the ranks, so loads and unloads interleave with generation at
step boundaries. The scheduler and the requests are guarded by one condition (`_work`); only the
loop schedules. A step's events go to their callers once the next step is on its way to the
ranks (`deliver`), so the callers' threads run while the ranks compute and not against the step
loop for the interpreter lock.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from lorafleet_common.merge import merge_failure_first
from node_agent.backend import AdapterRequests, SequenceInput, ServingStats
from node_agent.engine.driver.errors import EngineError, SequenceAborted
from node_agent.engine.driver.generation import Event, GeneratedStep, Generation, PromptLogits, Request
from node_agent.engine.driver.protocol import StepReply
from node_agent.engine.serving.sampler import SamplingParams, TokenLogprobs
from node_agent.engine.serving.scheduler import Scheduler
from node_agent.engine.serving.scheduling import ScheduledStep, SequenceRequest

log = logging.getLogger(__name__)

Logits = tuple[tuple[int, int, np.ndarray], ...]  # a step's Forward chunks: (sequence id, first position, logits)


@dataclass(frozen=True)
class EngineHooks:
    """What the step loop asks of its engine: run one step on every rank (their replies;
    EngineError if the ranks cannot), the engine's failure (None while it serves), and fail it."""

    run_step: Callable[[ScheduledStep], list[StepReply]]
    failure: Callable[[], str | None]
    fail: Callable[[str], None]


class StepLoop:
    """The scheduler, the requests it serves and the thread that runs their steps on the ranks."""

    def __init__(self, scheduler: Scheduler, engine: EngineHooks) -> None:
        self._scheduler = scheduler
        self._engine = engine
        self._work = threading.Condition()
        self._requests: dict[int, Request] = {}
        self._outbox: list[tuple[Request, Event]] = []
        self._ids = itertools.count()
        self._steps = 0
        self._preemptions = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="lorafleet-steps", daemon=True)
        self._thread.start()

    # -- what callers ask --------------------------------------------------------------------

    def submit(self, tokens: Sequence[int], adapter: str | None, params: SamplingParams) -> Generation:
        """Queue one sequence for generation (QueueFull, SchedulerError, EngineError once stopped)."""
        with self._work:
            self._check_open()
            request = Request(next(self._ids), adapter)
            self._scheduler.submit(SequenceRequest(request.seq_id, adapter, tuple(tokens), params))
            self._requests[request.seq_id] = request
            self._work.notify_all()
        return Generation(request, self.cancel)

    def forward(self, sequences: Sequence[SequenceInput]) -> list[np.ndarray]:
        """Every sequence as a prompt-only request sharing steps with the running generations;
        the logits of each, in order, once the loop ended them all. The batch is submitted
        whole or not at all (QueueFull, SchedulerError: nothing queued), and the scheduler
        admits its sequences in waves."""
        with self._work:
            self._check_open()
            requests = [Request(next(self._ids), sequence.adapter, len(sequence.tokens)) for sequence in sequences]
            self._scheduler.submit_batch(
                [
                    SequenceRequest(request.seq_id, sequence.adapter, tuple(sequence.tokens), prompt_logits=True)
                    for request, sequence in zip(requests, sequences, strict=True)
                ]
            )
            self._requests.update((request.seq_id, request) for request in requests)
            self._work.notify_all()
        out: list[np.ndarray] = []
        for request in requests:
            event = request.events.get()  # the step loop ends every request: logits or an error
            if isinstance(event, BaseException):
                for other in requests:
                    self.cancel(other.seq_id)
                raise event
            assert isinstance(event, PromptLogits)  # a Forward's request gets nothing else
            out.append(event.logits)
        return out

    def cancel(self, seq_id: int) -> bool:
        """Drop a sequence (waiting or running) and free its blocks; False if it had ended."""
        with self._work:
            self._requests.pop(seq_id, None)
            return self._scheduler.cancel(seq_id)

    def abort_adapter(self, name: str) -> None:
        """End every sequence on adapter `name` now (it is being unloaded; the agent drained first)."""
        with self._work:
            victims = [seq_id for seq_id, request in self._requests.items() if request.adapter == name]
            for seq_id in victims:
                self._scheduler.cancel(seq_id)
            self._fail_requests(victims, SequenceAborted(f"adapter {name!r} was unloaded while the sequence ran"))

    def set_pinned(self, pinned: set[str]) -> None:
        """The adapters that keep their device slots (the scheduler counts them in every batch)."""
        with self._work:
            self._scheduler.set_pinned(pinned)

    def stats(self, num_blocks: int) -> ServingStats:
        """The loop's counters and the scheduler's queue, running set and free blocks."""
        with self._work:
            running, waiting = self._scheduler.adapters()
            return ServingStats(
                self._steps,
                self._preemptions,
                num_blocks,
                self._scheduler.free_blocks(),
                self._scheduler.num_running,
                self._scheduler.num_waiting,
                running,
                waiting,
                self._scheduler.config.block_size,
            )

    def adapter_requests(self) -> tuple[AdapterRequests, ...]:
        """The scheduler's running and waiting sequences per adapter."""
        with self._work:
            running, waiting = self._scheduler.adapter_counts()
        return tuple(AdapterRequests(adapter, running[adapter], waiting[adapter]) for adapter in running | waiting)

    def deliver(self) -> None:
        """Hand the callers every event of the last step (once the next is on its way)."""
        with self._work:
            self._deliver()

    def stop(self) -> None:
        """Stop the loop; pending requests fail."""
        with self._work:
            self._stopping = True
            self._work.notify_all()
        self._thread.join()
        with self._work:
            self._fail_requests(list(self._requests), EngineError("engine is not serving: it was closed"))

    # -- the loop ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._stopping:
            raise EngineError("engine is not serving: it was closed")

    def _run(self) -> None:
        try:
            self._steps_until_stopped()
        except Exception as error:  # a bug in the loop: fail loudly, never leave callers waiting
            log.error("the step loop failed", exc_info=True)
            self._engine.fail(f"the step loop failed: {type(error).__name__}: {error}")
            with self._work:
                self._fail_all(EngineError(f"engine is not serving: {self._engine.failure()}"))
        finally:
            with self._work:
                self._deliver()

    def _steps_until_stopped(self) -> None:
        while True:
            with self._work:
                while not self._stopping and not self._scheduler.has_work:
                    self._deliver()
                    self._work.wait()
                if self._stopping:
                    return
                step = self._scheduler.schedule()
                self._preemptions += len(step.preempted)
            tokens: dict[int, int] = {}
            logprobs: dict[int, TokenLogprobs] = {}
            logits: Logits = ()
            error: EngineError | None = None
            if step.num_tokens:
                try:
                    tokens, logprobs, logits = self._step(step)
                except EngineError as failed:
                    error = failed
            with self._work:
                self._deliver()  # a step that failed or ran nothing: the last step's events now
                if error is not None:
                    # Nothing this step wrote is trusted: its sequences end with the error.
                    victims = [entry.seq_id for entry in step.sequences]
                    for seq_id in victims:
                        self._scheduler.cancel(seq_id)
                    self._fail_requests(victims, error)
                    tokens, logits = {}, ()
                self._step_done(step, tokens, logprobs, logits)
                if not step.num_tokens and self._scheduler.has_work:
                    self._work.wait(0.01)  # nothing runnable now (sequences waiting for a slot)
                failure = self._engine.failure()
                if failure is not None:
                    self._fail_all(EngineError(f"engine is not serving: {failure}"))

    def _step(self, step: ScheduledStep) -> tuple[dict[int, int], dict[int, TokenLogprobs], Logits]:
        """Run one step on every rank: the tokens drawn, their logprobs, the Forward chunks' logits."""
        replies = self._engine.run_step(step)
        self._steps += 1
        merged = merge_failure_first(replies, lambda r: r.ok, lambda r: r.error)
        if not merged.ok:
            raise EngineError(merged.error)
        tokens = {seq_id: token for reply in replies for seq_id, token in reply.tokens}
        logprobs = {seq_id: lp for reply in replies for seq_id, lp in reply.logprobs}
        return tokens, logprobs, tuple(chunk for reply in replies for chunk in reply.logits)

    def _step_done(self, step: ScheduledStep, tokens: dict[int, int], logprobs: dict[int, TokenLogprobs], logits: Logits) -> None:
        """Report a step to the scheduler (under `_work`) and put its callers' events in the outbox."""
        for seq_id, position, chunk in logits:
            request = self._requests.get(seq_id)
            if request is not None:  # else cancelled while the step ran
                request.add_logits(position, chunk)
        finished = {f.seq_id: f.reason for f in self._scheduler.on_step_done(step, tokens)}
        outbox = self._outbox
        for seq_id, reason in finished.items():
            request = self._requests.get(seq_id)
            if reason is None and request is not None and request.logits is not None:  # a Forward's end
                outbox.append((request, PromptLogits(request.logits)))
                del self._requests[seq_id]
        for seq_id, token in tokens.items():
            request = self._requests.get(seq_id)
            if request is None:
                continue  # cancelled while the step ran
            reason = finished.get(seq_id)
            outbox.append((request, GeneratedStep(token, logprobs.get(seq_id), reason)))
            if reason is not None:
                del self._requests[seq_id]

    def _fail_all(self, error: EngineError) -> None:
        victims = list(self._requests)
        for seq_id in victims:
            self._scheduler.cancel(seq_id)
        self._fail_requests(victims, error)

    def _fail_requests(self, seq_ids: Sequence[int], error: BaseException) -> None:
        self._deliver()  # a sequence's tokens so far come before its error
        for seq_id in seq_ids:
            request = self._requests.pop(seq_id, None)
            if request is not None:
                request.events.put(error)

    def _deliver(self) -> None:
        """Hand the callers every event of the outbox (called under `_work`, which orders it
        with `_fail_requests`)."""
        outbox, self._outbox = self._outbox, []
        for request, event in outbox:
            request.events.put(event)
