"""Per-token adapter slots grouped into segments, the one input every kernel reads."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# The rows of one slot: a slice when they are one run of consecutive tokens, else their indices.
Rows = slice | torch.Tensor


@dataclass(frozen=True)
class OwnSlots:
    """Each token's row, its own slot (0 for "no adapter") and 1.0, or 0.0 for "no adapter"."""

    rows: torch.Tensor
    slots: torch.Tensor
    keep: torch.Tensor


@dataclass(frozen=True)
class LoraBatch:
    """Which LoRA slot each token of a batch uses; −1 means "no adapter".

    Segments are maximal runs of consecutive tokens with the same slot; kernels parallelise over
    them. An empty batch (an idle DP group) has zero tokens and zero segments.

    `slot_rows` and `own_slots` are the torch path's views of the same batch, computed once
    and shared by every module of a step (a step's batch is the same for all its layers).
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
        """Per active slot (ascending), the rows that use it: a slice when they are consecutive,
        else an int64 index tensor on the batch's device."""
        cpu = self.token_slots.cpu()
        found: list[tuple[int, Rows]] = []
        for slot in self.active_slots:
            rows = torch.nonzero(cpu == slot).flatten()
            first, last = int(rows[0]), int(rows[-1])
            if last - first + 1 == rows.shape[0]:
                found.append((slot, slice(first, last + 1)))
            else:
                found.append((slot, rows.to(self.token_slots.device)))
        return tuple(found)

    @functools.cached_property
    def own_slots(self) -> OwnSlots:
        """Each token's own slot, for the all-slots product (`torch_ops`)."""
        slots = self.token_slots
        return OwnSlots(torch.arange(self.num_tokens, device=slots.device), slots.long().clamp(min=0),
                        (slots >= 0).float())

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
