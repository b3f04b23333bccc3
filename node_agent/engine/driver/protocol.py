"""What the driver and its ranks say to each other: one command class and one reply class each.

Commands and replies are plain frozen dataclasses, pickled over each rank's pipe. A rank always
answers a command with that command's reply class (`ok` false and `error` set when it refused);
it never raises to the driver. Control replies carry what the rank holds afterwards, so nobody
has to ask the ranks again after a load or an unload.

`merge_control` is the one place where the ranks' control replies become one result, by the
failure-first rule (`lorafleet_common.merge`, docs/agent.md "Failure-first results").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from lorafleet_common.merge import merge_failure_first
from node_agent.engine.adapters.files import FileDigests, VerifiedFiles
from node_agent.engine.adapters.peft import ShardPlan
from node_agent.engine.parallel.sharding import LoraSliceLayout, ModuleKey
from node_agent.engine.serving.sampler import TokenLogprobs
from node_agent.engine.serving.scheduler import ScheduledSequence

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
class RankReply:
    """One rank's answer: who answered and whether it succeeded (startup and shutdown replies)."""

    rank: int
    attn_dp_rank: int
    attn_tp_rank: int
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class ReadyReply(RankReply):
    """A rank's answer once it started: its LoRA modules' slices, in its order (the driver plans
    every load's per-rank read by them; `peft_adapter.plan_shard`)."""

    lora_layouts: tuple[tuple[ModuleKey, tuple[LoraSliceLayout, ...]], ...] = ()


@dataclass(frozen=True)
class ControlReply(RankReply):
    """A rank's answer to a load or an unload, with the adapters it holds afterwards (load order)."""

    holds: tuple[str, ...] = ()
    shard_bytes: int = 0  # a load: the size of this rank's shard of the adapter
    peak_rss_growth_bytes: int = 0  # a load: how much this rank's peak memory grew while loading
    # a successful load: the sha256 of the verified files this rank read (None when the caller
    # verified no digests, and on failure)
    digests: FileDigests | None = None
    read_other_bytes: bool = False  # a load refused because the files were not the verified ones


@dataclass(frozen=True)
class SliceShape:
    """Per-slot shapes of one fused slice's LoRA buffers (qkv has three slices, gate_up two)."""

    lora_a: tuple[int, ...]
    lora_b: tuple[int, ...]


@dataclass(frozen=True)
class ModuleShape:
    """One LoRA module's per-slot buffer shapes on one rank ("layers.L.kind", "layers.L.experts.E.proj")."""

    module: str
    rank: int
    slices: tuple[SliceShape, ...]


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


# -- the merged result of a control command ------------------------------------------------------


@dataclass(frozen=True)
class ControlResult:
    """A load or unload on every rank, merged failure-first: `ok` only if every rank succeeded;
    `error` joins the failed ranks' distinct messages; `holds` is what the first rank (on
    success) or the first failed rank holds afterwards; `ranks` has every rank's reply."""

    ok: bool
    error: str
    holds: tuple[str, ...]
    ranks: tuple[ControlReply, ...]
    already_loaded: bool = False  # a load that found the adapter loaded: no rank was asked


def merge_control(replies: Sequence[ControlReply], already_loaded: bool = False) -> ControlResult:
    """Merge every rank's control reply into one result (the failure-first rule, once)."""
    merged = merge_failure_first(replies, lambda r: r.ok, lambda r: r.error)
    return ControlResult(merged.ok, merged.error, merged.reply.holds, tuple(replies), already_loaded)


def rolled_back(result: ControlResult, after: Sequence[ControlReply]) -> ControlResult:
    """A failed load as the ranks end up once the driver unloaded it again from every rank
    (`after`: their replies to that unload; every rank's holdings are those after it): the ranks
    that had loaded it are reported as failed with a note, so that counting successful ranks
    gives the truth (none holds it); `error` keeps only the ranks' own failures."""
    failed = ", ".join(str(r.rank) for r in result.ranks if not r.ok)
    note = f"loaded, then rolled back because the load failed on rank {failed}"
    ranks = tuple(
        replace(reply, holds=later.holds) if not reply.ok else replace(reply, ok=False, error=note, holds=later.holds)
        for reply, later in zip(result.ranks, after, strict=True)
    )
    # A rank that failed after loading (it read other bytes) held the adapter until the rollback:
    # every rank's holdings are those after it.
    first_failed = next(reply for reply in result.ranks if not reply.ok)
    return replace(result, ranks=ranks, holds=ranks[result.ranks.index(first_failed)].holds)
