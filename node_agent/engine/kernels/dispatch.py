"""Choose the kernel implementation by device: triton on CUDA, torch elsewhere (on the CPU, a
decode step's few rows through the compiled kernels, `cpu_kernels`, where they serve: its base
matmuls and its LoRA pass).

`LORAFLEET_KERNELS` overrides the choice: `torch` always takes the torch path (and oneDNN and
MKL for the base matmuls); `triton` also runs CPU tensors through triton, which works only under
its interpreter (`TRITON_INTERPRET=1`, what the kernel tests use). Unset (or `auto`) means:
triton for CUDA tensors, the compiled kernels or torch otherwise. The environment is read per
call so tests can flip it; the triton module is imported only when first needed, so the CPU
path never loads triton.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import torch

from node_agent.engine.kernels import cpu_kernels, torch_ops
from node_agent.engine.kernels.batch import LoraBatch

MODE_ENV = "LORAFLEET_KERNELS"
_TRUE = {"1", "true", "on", "yes"}  # what triton itself accepts for TRITON_INTERPRET


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a call on `tensor`'s device goes to the triton kernels."""
    mode = os.environ.get(MODE_ENV, "auto").lower()
    if mode not in ("auto", "torch", "triton"):
        raise ValueError(f"{MODE_ENV} must be auto, torch or triton, not {mode!r}")
    if mode == "torch" or (mode == "auto" and not tensor.is_cuda):
        return False  # decided without reading TRITON_INTERPRET (this runs for every module)
    interpreting = os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE
    if tensor.is_cuda:
        # The interpreter copies each argument to the host separately, which breaks the kernels'
        # offsets between slice stacks; a process that interprets keeps CUDA on the torch path.
        return not interpreting
    if not interpreting:  # mode triton on a CPU tensor
        raise RuntimeError(f"{MODE_ENV}=triton on CPU tensors needs TRITON_INTERPRET=1")
    return True


def compiled_cpu(x: torch.Tensor) -> ctypes.CDLL | None:
    """The compiled CPU kernels for a call on the rows of `x`, where they serve: a decode step's
    few rows (1 to `cpu_kernels.MAX_ROWS`) of fp32 on the CPU, outside autograd, the mode `auto`,
    the kernels built (`cpu_kernels.library`). The one place of that rule, for the base layers'
    matmuls and the LoRA pass alike."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.requires_grad
        or not 0 < x.shape[0] <= cpu_kernels.MAX_ROWS
        or os.environ.get(MODE_ENV, "auto").lower() != "auto"
    ):
        return None
    return cpu_kernels.library()


def add_fp32(
    x: torch.Tensor,
    out: torch.Tensor,
    a_slots: Sequence[torch.Tensor],
    b_slots: Sequence[Sequence[torch.Tensor]],
    scales: torch.Tensor,
    batch: LoraBatch,
    compiled: cpu_kernels.LoraBuffers | None = None,
) -> bool:
    """Shrink and expand in one pass where the CPU serves `x`: up to `cpu_kernels.MAX_ROWS` rows
    through the compiled kernel (given `compiled`, the layer's buffers behind the same per-slot
    views), else `torch_ops.add_fp32`; False, having done nothing, where neither serves (then
    call `shrink` and `expand`)."""
    if use_triton(x):
        return False
    lib = compiled_cpu(x)
    if lib is not None and compiled is not None and cpu_kernels.add_lora_rows(lib, x, out, compiled, batch.token_slots):
        return True
    return torch_ops.add_fp32(x, out, a_slots, b_slots, scales, batch)


def shrink(x: torch.Tensor, a_stacks: list[torch.Tensor], batch: LoraBatch, joined: torch.Tensor | None = None) -> torch.Tensor:
    """See `torch_ops.shrink`; `joined` serves the torch path only (the triton kernel covers
    every slice in one launch already)."""
    if use_triton(x):
        from node_agent.engine.kernels import triton_ops

        return triton_ops.shrink(x, a_stacks, batch)
    return torch_ops.shrink(x, a_stacks, batch, joined)


def expand(
    y: torch.Tensor,
    b_stacks: list[torch.Tensor],
    scales: torch.Tensor,
    batch: LoraBatch,
    out: torch.Tensor,
) -> None:
    """See `torch_ops.expand`."""
    if use_triton(out):
        from node_agent.engine.kernels import triton_ops

        triton_ops.expand(y, b_stacks, scales, batch, out)
        return
    torch_ops.expand(y, b_stacks, scales, batch, out)
