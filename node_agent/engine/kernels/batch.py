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
        times), else one int64 index tensor on the batch's device.

        Grouped in Python from one `tolist()` of the (host) segments: a compare and a `nonzero`
        per slot cost more, for a decode step's few rows, than the whole loop."""
        runs_of: dict[int, list[slice]] = {}
        for start, length, slot in zip(self.seg_starts.tolist(), self.seg_lens.tolist(), self.seg_slots.tolist(), strict=True):
            if slot >= 0:
                runs_of.setdefault(slot, []).append(slice(start, start + length))
        found: list[tuple[int, Rows]] = []
        for slot in self.active_slots:
            runs = runs_of[slot]
            if len(runs) <= MAX_RUNS_AS_SLICES:
                found.extend((slot, run) for run in runs)
            else:
                rows = [row for run in runs for row in range(run.start, run.stop)]
                found.append((slot, torch.tensor(rows, dtype=torch.int64, device=self.token_slots.device)))
        return tuple(found)

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor) -> LoraBatch:
        """Build the segment view of a [T] slot vector (any integer dtype, any device)."""
        slots = token_slots.to(torch.int32)
        values = slots.tolist()
        # Segments in Python over one host copy: a decode step's batch has a few tokens, and a
        # dozen small tensor ops per step cost more than this loop (a prefill's few hundred too).
        starts = [i for i in range(len(values)) if i == 0 or values[i] != values[i - 1]]
        ends = [*starts[1:], len(values)] if starts else []
        lens = [end - start for start, end in zip(starts, ends, strict=True)]
        seg_slots = [values[start] for start in starts]
        device = slots.device

        def tensor(items: list[int]) -> torch.Tensor:
            return torch.tensor(items, dtype=torch.int32, device=device)

        return cls(
            token_slots=slots,
            seg_starts=tensor(starts),
            seg_lens=tensor(lens),
            seg_slots=tensor(seg_slots),
            max_seg_len=max(lens, default=0),
            active_slots=tuple(sorted({s for s in seg_slots if s >= 0})),
        )
