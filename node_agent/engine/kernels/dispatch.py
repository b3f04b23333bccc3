"""Choose the kernel implementation by device: triton on CUDA, torch elsewhere."""

from __future__ import annotations

import torch

from node_agent.engine.kernels import torch_ops
from node_agent.engine.kernels.batch import LoraBatch


def shrink(x: torch.Tensor, a_stacks: list[torch.Tensor], batch: LoraBatch) -> torch.Tensor:
    """See `torch_ops.shrink`."""
    return torch_ops.shrink(x, a_stacks, batch)


def expand(
    y: torch.Tensor,
    b_stacks: list[torch.Tensor],
    scales: torch.Tensor,
    batch: LoraBatch,
    out: torch.Tensor,
) -> None:
    """See `torch_ops.expand`."""
    torch_ops.expand(y, b_stacks, scales, batch, out)
