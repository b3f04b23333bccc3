"""The scheduler's working state (docs/serving.md): its view of each live sequence, and the step
it is building."""

from __future__ import annotations

from dataclasses import dataclass, field

from node_agent.engine.serving.scheduling import SequenceRequest


@dataclass
class LiveSequence:
    """The scheduler's view of one live sequence. Its tokens in the cache are its allocator's
    `num_tokens` while it runs; none while it waits."""

    request: SequenceRequest
    seed: int
    tokens: list[int]  # the prompt, then every generated token
    since: int  # the first step it waited for (submission or preemption)
    batch: int  # the submission it came with (a Forward's sequences share one): `max_waiting` counts these
    group: int | None = None  # chosen at its first admission, kept for its life

    @property
    def seq_id(self) -> int:
        return self.request.seq_id

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)


@dataclass
class StepPlan:
    """A step being built: the token budget left and each scheduled sequence's chunk."""

    budget: int
    chunks: dict[int, tuple[LiveSequence, int, list[int]]] = field(default_factory=dict)  # id → (seq, position, slots)
    preempted: list[int] = field(default_factory=list)
    deferred: dict[int, int] = field(default_factory=dict)  # group → blocks its running prefills still need

    def add(self, seq: LiveSequence, position: int, slots: list[int]) -> None:
        """Schedule tokens of a sequence; more of one already scheduled continue its chunk."""
        self.budget -= len(slots)
        earlier = self.chunks.get(seq.seq_id)
        if earlier is not None:
            position, slots = earlier[1], earlier[2] + slots
        self.chunks[seq.seq_id] = (seq, position, slots)

    def drop(self, seq_id: int) -> None:
        """Take a preempted sequence's chunk back out of the step."""
        chunk = self.chunks.pop(seq_id, None)
        if chunk is not None:
            self.budget += len(chunk[2])
