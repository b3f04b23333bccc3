"""What the driver and its ranks say to each other: one command class and one reply class each.

Commands and replies are plain frozen dataclasses, sent over the ranks' transport
(`transport`). A rank always answers a command with that command's reply class (`ok` false and
`error` set when it refused); it never raises to the driver. The replies every backend gives
(`RankReply`, `ControlReply`, the module shapes) and their failure-first merge are the seam's
(`node_agent.backend`); the ones below are the engine's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from node_agent.backend import ModuleShape, RankReply
from node_agent.engine.adapters.files import VerifiedFiles
from node_agent.engine.adapters.plan import ShardPlan
from node_agent.engine.parallel.sharding import LoraSliceLayout, ModuleKey
from node_agent.engine.serving.sampler import TokenLogprobs
from node_agent.engine.serving.scheduling import ScheduledSequence

# -- commands ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Describe:
    """Ask a rank for its LoRA buffer shapes, its device slots and the adapters it holds."""


@dataclass(frozen=True)
class Load:
    """Read this rank's shard of the adapter the driver verified into the pool under `name`:
    from the verified files (`adapter`), by `plan` (the driver planned every rank's read once, from
    the layouts each rank reported at start-up; each rank gets a command with its own plan)."""

    name: str
    adapter: VerifiedFiles
    plan: ShardPlan
    pinned: bool


@dataclass(frozen=True)
class Unload:
    """Drop `name` from the pool (its device slot is zeroed)."""

    name: str


@dataclass(frozen=True)
class Step:
    """One scheduler step (docs/serving.md): the ranks of DP group `g` compute `groups[g]` (an
    empty tuple: the group joins every collective with zero tokens). Each entry carries its new
    token ids, the position of the first, their KV slots, its block table, its adapter's engine
    name and, when the step draws its next token, its sampling row."""

    index: int
    groups: tuple[tuple[ScheduledSequence, ...], ...]


@dataclass(frozen=True)
class Shutdown:
    """Answer once more, then exit."""


Command = Describe | Load | Unload | Step | Shutdown


# -- replies -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadyReply(RankReply):
    """A rank's answer once it started: its LoRA modules' slices, in its order (the driver plans
    every load's per-rank read by them; `peft_adapter.plan_shard`)."""

    lora_layouts: tuple[tuple[ModuleKey, tuple[LoraSliceLayout, ...]], ...] = ()


@dataclass(frozen=True)
class DescribeReply(RankReply):
    """A rank's buffer shapes, which adapter each device slot holds, and the adapters it holds."""

    modules: tuple[ModuleShape, ...] = ()
    resident: tuple[tuple[int, str], ...] = ()  # (slot, adapter) for every occupied slot
    holds: tuple[str, ...] = ()
    kv_blocks: int = 0  # blocks of this rank's paged KV cache
    kv_block_bytes: int = 0  # K and V of one block over every layer
    kv_cache_bytes: int = 0  # the budget the cache was sized from
    slot_decisions: int = 0  # LoRA slot decisions (one per Step) since the rank started
    slot_digest: str = ""  # sha256 over every decision and the slots after it, in order


@dataclass(frozen=True)
class StepReply(RankReply):
    """The tokens a step drew, by sequence id (every rank of a group draws the same; the
    group's attention-TP leader reports them), with their logprobs where asked for, and the
    logits (float32, `[tokens, vocab]`) of each Forward chunk as (sequence id, first position,
    logits)."""

    tokens: tuple[tuple[int, int], ...] = ()
    logprobs: tuple[tuple[int, TokenLogprobs], ...] = ()
    logits: tuple[tuple[int, int, np.ndarray], ...] = field(default=(), compare=False)
