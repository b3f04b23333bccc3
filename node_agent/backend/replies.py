"""Per-rank replies to control commands, and the one rule that merges them.

Whatever holds adapters on ranks (the builtin engine's rank processes, several stock servers)
answers a load or an unload rank by rank, each reply saying what that rank holds afterwards, so
nobody has to ask the ranks again. `merge_control` makes one result of them by the failure-first
rule (`lorafleet_common.merge`, docs/agent.md "Failure-first results"); `all_or_nothing` is the
load every backend makes: a load that failed on some ranks is unloaded again from all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from lorafleet_common.merge import merge_failure_first
from node_agent.backend.files import FileDigests


@dataclass(frozen=True)
class RankPlace:
    """Where one rank sits: its global rank and its coordinates in the attention groups."""

    rank: int
    attn_dp_rank: int
    attn_tp_rank: int


@dataclass(frozen=True)
class RankReply:
    """One rank's answer: who answered and whether it succeeded."""

    rank: int
    attn_dp_rank: int
    attn_tp_rank: int
    ok: bool
    error: str = ""
    # A failure that asking again soon may cure: the rank could not act now (a stock server
    # down, restarting or busy) rather than refusing what it was asked.
    transient: bool = False


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
class ControlResult:
    """A load or unload on every rank, merged failure-first: `ok` only if every rank succeeded;
    `error` joins the failed ranks' distinct messages; `holds` is what the first rank (on
    success) or the first failed rank holds afterwards; `ranks` has every rank's reply."""

    ok: bool
    error: str
    holds: tuple[str, ...]
    ranks: tuple[ControlReply, ...]
    already_loaded: bool = False  # a load that found the adapter loaded: no rank was asked
    # failed, and every rank that failed could not act now (none refused): worth asking again soon
    transient: bool = False


def merge_control(replies: Sequence[ControlReply], already_loaded: bool = False) -> ControlResult:
    """Merge every rank's control reply into one result (the failure-first rule, once). A
    failure is transient only if every failed rank's is: one refusal makes it permanent."""
    merged = merge_failure_first(replies, lambda r: r.ok, lambda r: r.error)
    transient = not merged.ok and all(r.transient for r in replies if not r.ok)
    return ControlResult(merged.ok, merged.error, merged.reply.holds, tuple(replies), already_loaded, transient)


def rolled_back(result: ControlResult, after: Sequence[ControlReply]) -> ControlResult:
    """A failed load as the ranks end up once it was unloaded again from every rank (`after`:
    their replies to that unload; every rank's holdings are those after it): the ranks that had
    loaded it are reported as failed with a note, so that counting successful ranks gives the
    truth (none holds it); `error` keeps only the ranks' own failures."""
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


def all_or_nothing(load: Callable[[], Sequence[ControlReply]], unload: Callable[[], Sequence[ControlReply]]) -> ControlResult:
    """A load on every rank or on none: `load` asks every rank, their replies merged; if some
    refused and others loaded, `unload` asks every rank to drop it again (ranks that never loaded
    it answer "not loaded") and the result says so (`rolled_back`). The caller holds whatever
    lock keeps other commands from interleaving."""
    result = merge_control(load())
    if not result.ok and any(reply.ok for reply in result.ranks):
        result = rolled_back(result, unload())
    return result


def already_loaded(name: str, ranks: Sequence[tuple[RankPlace, tuple[str, ...]]]) -> ControlResult:
    """The answer to a load of an adapter already loaded, asking no rank: from what each rank
    last said it holds (`ranks`: each rank and its holdings), a rank succeeds if it holds `name`."""
    replies = []
    for place, holds in ranks:
        error = "" if name in holds else f"rank {place.rank} does not hold {name!r}"
        replies.append(ControlReply(place.rank, place.attn_dp_rank, place.attn_tp_rank, not error, error, holds=holds))
    return merge_control(replies, already_loaded=True)
