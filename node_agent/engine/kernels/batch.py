"""Per-token adapter slots grouped into segments, the one input every kernel reads."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# The rows of one slot: a slice when they are one run of consecutive tokens, else their indices.
Rows = slice | torch.Tensor

# A slot whose rows form at most this many runs of consecutive tokens gets one slice per run
# (the rows of a few decoding sequences): slices cost no gather or scatter, and a one-row slice
# takes a matrix-vector product (docs/kernels.md, "The CPU path").
MAX_RUNS_AS_SLICES = 4


@dataclass(frozen=True)
class LoraBatch:
    """Which LoRA slot each token of a batch uses; −1 means "no adapter".

    Segments are maximal runs of consecutive tokens with the same slot; kernels parallelise over
    them. An empty batch (an idle DP group) has zero tokens and zero segments.

    `slot_rows` is the torch path's view of the same batch, computed once and shared by every
    module of a step (a step's batch is the same for all its layers).
    """

    token_slots: torch.Tensor  # [T] int32
    seg_starts: torch.Tensor  # [S] int32
    seg_lens: torch.Tensor  # [S] int32
    seg_slots: torch.Tensor  # [S] int32, −1 allowed
    max_seg_len: int
    active_slots: tuple[int, ...]  # distinct slots ≥ 0, ascending

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch."""
        return int(self.token_slots.shape[0])

    @functools.cached_property
    def slot_rows(self) -> tuple[tuple[int, Rows], ...]:
        """Per active slot (ascending), the rows that use it: one slice per run of consecutive
        rows when there are at most `MAX_RUNS_AS_SLICES` runs (a slot may then appear several
        times), else one int64 index tensor on the batch's device."""
        cpu = self.token_slots.cpu()
        found: list[tuple[int, Rows]] = []
        for slot in self.active_slots:
            rows = torch.nonzero(cpu == slot).flatten()
            runs = _runs(rows.tolist())
            if len(runs) <= MAX_RUNS_AS_SLICES:
                found.extend((slot, run) for run in runs)
            else:
                found.append((slot, rows.to(self.token_slots.device)))
        return tuple(found)

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor) -> LoraBatch:
        """Build the segment view of a [T] slot vector (any integer dtype, any device)."""
        slots = token_slots.to(torch.int32)
        total = int(slots.shape[0])
        if total == 0:
            empty = torch.zeros(0, dtype=torch.int32, device=slots.device)
            return cls(slots, empty, empty, empty, 0, ())
        cpu = slots.cpu()
        change = torch.ones(total, dtype=torch.bool)
        change[1:] = cpu[1:] != cpu[:-1]
        starts = torch.nonzero(change).flatten().to(torch.int32)
        ends = torch.cat([starts[1:], torch.tensor([total], dtype=torch.int32)])
        lens = ends - starts
        seg_slots = cpu[starts.long()]
        active = tuple(sorted({int(s) for s in seg_slots.tolist() if s >= 0}))
        device = slots.device
        return cls(
            token_slots=slots,
            seg_starts=starts.to(device),
            seg_lens=lens.to(device),
            seg_slots=seg_slots.to(device),
            max_seg_len=int(lens.max()),
            active_slots=active,
        )


def _runs(rows: list[int]) -> list[slice]:
    """Ascending row numbers as slices of consecutive rows."""
    runs: list[slice] = []
    start = previous = rows[0]
    for row in rows[1:]:
        if row != previous + 1:
            runs.append(slice(start, previous + 1))
            start = row
        previous = row
    runs.append(slice(start, previous + 1))
    return runs
