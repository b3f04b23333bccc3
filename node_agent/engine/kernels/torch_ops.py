"""Reference torch implementation of shrink/expand; the CPU path and the kernels' oracle."""

from __future__ import annotations

import torch

from node_agent.engine.kernels.batch import LoraBatch


def shrink(x: torch.Tensor, a_stacks: list[torch.Tensor], batch: LoraBatch) -> torch.Tensor:
    """x [T, in] · A[slot]ᵀ for each slice: returns [n_slices, T, R] (zero where slot is −1).

    a_stacks: one [num_slots, R, in] tensor per output slice, all with the same R.
    Accumulates in fp32 and returns fp32.
    """
    rank = a_stacks[0].shape[1]
    out = torch.zeros(len(a_stacks), x.shape[0], rank, dtype=torch.float32, device=x.device)
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
    for slot in batch.active_slots:
        rows = batch.token_slots == slot
        offset = 0
        for index, b in enumerate(b_stacks):
            width = b.shape[1]
            delta = (y[index, rows] @ b[slot].float().t()) * scales[index, slot].float()
            out[rows, offset : offset + width] += delta.to(out.dtype)
            offset += width
