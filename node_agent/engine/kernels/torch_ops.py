"""Reference torch implementation of shrink/expand; the CPU path and the kernels' oracle.

Two ways to the same result, chosen per batch by `multiplies_every_slot`: a loop over the
batch's active slots (a few small ops per slot and slice), or, for a few tokens over many
adapters (a decode step), one matrix product of every token with every slot's weights per slice,
keeping each token's own slot. The second does more arithmetic but far fewer ops, which is what
a decode step on the CPU pays for (docs/kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from node_agent.engine.kernels.batch import LoraBatch

# The all-slots product costs tokens × slots; the loop costs ops per active slot. Measured on the
# development CPU (rank 16, hidden 1024, 8 slots): the product wins from 3 active slots while
# tokens × slots stays under about 128 per active slot (docs/kernels.md).
_MIN_ACTIVE = 3
_TOKEN_SLOTS_PER_ACTIVE = 128


def multiplies_every_slot(batch: LoraBatch, num_slots: int) -> bool:
    """Whether `batch` takes the all-slots product (else the loop over its active slots)."""
    active = len(batch.active_slots)
    return active >= _MIN_ACTIVE and batch.num_tokens * num_slots <= _TOKEN_SLOTS_PER_ACTIVE * active


def shrink(x: torch.Tensor, a_stacks: list[torch.Tensor], batch: LoraBatch) -> torch.Tensor:
    """x [T, in] · A[slot]ᵀ for each slice: returns [n_slices, T, R] (zero where slot is −1).

    a_stacks: one [num_slots, R, in] tensor per output slice, all with the same R.
    Accumulates in fp32 and returns fp32.
    """
    num_slots, rank, _ = a_stacks[0].shape
    out = torch.zeros(len(a_stacks), x.shape[0], rank, dtype=torch.float32, device=x.device)
    if multiplies_every_slot(batch, num_slots):
        own = _own_slots(batch)
        xs = x.float()
        for index, a in enumerate(a_stacks):
            every = xs @ a.float().reshape(num_slots * rank, -1).t()
            out[index] = every.view(-1, num_slots, rank)[own.rows, own.slots] * own.keep[:, None]
        return out
    for slot in batch.active_slots:
        rows = batch.token_slots == slot
        xs = x[rows].float()
        for index, a in enumerate(a_stacks):
            out[index, rows] = xs @ a[slot].float().t()
    return out


def expand(
    y: torch.Tensor,
    b_stacks: list[torch.Tensor],
    scales: torch.Tensor,
    batch: LoraBatch,
    out: torch.Tensor,
) -> None:
    """Add y[i] · B_i[slot]ᵀ · scale[i, slot] into consecutive column blocks of `out`, in place.

    y: [n_slices, T, R]; b_stacks: one [num_slots, width_i, R] per slice; scales: [n_slices,
    num_slots]; out: [T, Σ width_i]. Tokens whose slot is −1 are left untouched.
    """
    num_slots = b_stacks[0].shape[0]
    if multiplies_every_slot(batch, num_slots):
        own = _own_slots(batch)
        offset = 0
        for index, b in enumerate(b_stacks):
            width, rank = b.shape[1], b.shape[2]
            every = y[index] @ b.float().reshape(num_slots * width, rank).t()
            scale = scales[index].float()[own.slots] * own.keep
            delta = every.view(-1, num_slots, width)[own.rows, own.slots] * scale[:, None]
            out[:, offset : offset + width] += delta.to(out.dtype)
            offset += width
        return
    for slot in batch.active_slots:
        rows = batch.token_slots == slot
        offset = 0
        for index, b in enumerate(b_stacks):
            width = b.shape[1]
            delta = (y[index, rows] @ b[slot].float().t()) * scales[index, slot].float()
            out[rows, offset : offset + width] += delta.to(out.dtype)
            offset += width


@dataclass(frozen=True)
class _OwnSlots:
    """Each token's row, its own slot (0 for "no adapter") and 1.0, or 0.0 for "no adapter"."""

    rows: torch.Tensor
    slots: torch.Tensor
    keep: torch.Tensor


def _own_slots(batch: LoraBatch) -> _OwnSlots:
    slots = batch.token_slots
    return _OwnSlots(torch.arange(batch.num_tokens, device=slots.device), slots.long().clamp(min=0),
                     (slots >= 0).float())
