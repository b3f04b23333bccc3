"""What goes into and out of the scheduler: its config and refusals, the sequence requests it
takes, the steps it hands the ranks (`ScheduledStep`) and the sequences that finish."""

from __future__ import annotations

from dataclasses import dataclass, field

from node_agent.engine.serving.sampler import FinishReason, SamplingParams, SequenceSampling


class SchedulerError(Exception):
    """A request or step outcome the scheduler refuses (duplicate id, too long for the cache, ...)."""


class QueueFull(SchedulerError):
    """`max_waiting` requests already wait; the caller should retry later (RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Sizes and limits of one engine's scheduler. Token and sequence limits are per step, over
    all DP groups together (every rank's MLP runs on every group's tokens); blocks are per group.
    The limits an engine is configured with have no default here: `EngineConfig` writes them once."""

    num_blocks: int  # per DP group: the minimum the ranks report
    block_size: int
    dp_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_loras_per_batch: int
    max_waiting: int
    prefix_caching: bool
    max_slot_wait_steps: int = 32

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "dp_size", "max_num_seqs", "max_num_batched_tokens", "max_loras_per_batch", "max_waiting"):
            if getattr(self, name) < 1:
                raise SchedulerError(f"SchedulerConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.max_slot_wait_steps < 0:
            raise SchedulerError(f"SchedulerConfig.max_slot_wait_steps must be at least 0, got {self.max_slot_wait_steps}")
        # Every running sequence's decode then fits in every step, so decodes never stall.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise SchedulerError(
                f"SchedulerConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs})"
            )

    @property
    def group_tokens(self) -> int:
        """Tokens of KV one DP group holds."""
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class SequenceRequest:
    """One sequence to generate: `adapter` is the adapter's engine name (None: the base model).
    With `prompt_logits` (a Forward) the prompt is computed, never from a cached prefix, the
    logits of every position are returned, and nothing is sampled: the sequence ends once its
    prompt is in the cache (`params` is unused)."""

    seq_id: int
    adapter: str | None
    prompt: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_logits: bool = False

    def __post_init__(self) -> None:
        if not self.prompt:
            raise SchedulerError(f"SequenceRequest.prompt of sequence {self.seq_id} must hold at least one token")


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's work in a step: what its group's ranks compute and where its KV goes."""

    seq_id: int
    adapter: str | None
    token_ids: tuple[int, ...]  # the tokens this step computes
    position: int  # of token_ids[0]: the tokens already in the cache
    slots: tuple[int, ...]  # the slot of each new token, for PagedKVCache.write
    block_table: tuple[int, ...]
    sampling: SequenceSampling | None  # set when the chunk ends the sequence's tokens: sample the next one
    logits: bool = False  # a Forward's chunk: the ranks return the logits of every one of its tokens

    @property
    def samples(self) -> bool:
        """Whether the step draws this sequence's next token."""
        return self.sampling is not None

    @property
    def context_len(self) -> int:
        """Tokens the sequence attends to in this step, its new ones included."""
        return self.position + len(self.token_ids)


@dataclass(frozen=True)
class ScheduledStep:
    """Every DP group's work in one step (an empty tuple for an idle group, which still joins
    every collective with zero tokens) and the sequences the step preempted."""

    index: int
    groups: tuple[tuple[ScheduledSequence, ...], ...]
    preempted: tuple[int, ...]

    @property
    def sequences(self) -> tuple[ScheduledSequence, ...]:
        """Every group's entries, group by group."""
        return tuple(entry for group in self.groups for entry in group)

    @property
    def num_tokens(self) -> int:
        """New tokens over all groups (at most `max_num_batched_tokens`)."""
        return sum(len(entry.token_ids) for entry in self.sequences)

    @property
    def adapters(self) -> tuple[str, ...]:
        """The distinct adapters the step runs, in order of first appearance (for `pool.prepare`)."""
        return tuple(dict.fromkeys(entry.adapter for entry in self.sequences if entry.adapter is not None))


@dataclass(frozen=True)
class FinishedSequence:
    """A sequence that ended in a step: why (None: a Forward's prompt is computed), and every
    token it generated."""

    seq_id: int
    reason: FinishReason | None
    token_ids: tuple[int, ...]
