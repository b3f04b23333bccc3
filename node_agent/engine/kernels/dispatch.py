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
from dataclasses import dataclass

import torch

from node_agent.engine.kernels import cpu_kernels, paged_attention, torch_ops
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


def compiled_cpu(x: torch.Tensor, any_rows: bool = False) -> ctypes.CDLL | None:
    """The compiled CPU kernels for a call on the rows of `x`, where they serve: a decode step's
    few rows (1 to `cpu_kernels.MAX_ROWS`; any number with `any_rows`) of fp32 on the CPU,
    outside autograd, the mode `auto`, the kernels built (`cpu_kernels.library`). The one place
    of that rule, for the base layers' matmuls and the LoRA pass alike."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.requires_grad
        or x.shape[0] < 1
        or (not any_rows and x.shape[0] > cpu_kernels.MAX_ROWS)
        or os.environ.get(MODE_ENV, "auto").lower() != "auto"
    ):
        return None
    return cpu_kernels.library()


@dataclass(frozen=True)
class SlotViews:
    """A layer's LoRA buffers as views per slot, made once: `a[s]` slot `s`'s joined A
    `[Σ rank widths, in]`, `b[s][i]` its B of slice `i`; `compiled` the same buffers as the
    compiled CPU kernel reads them, None where it cannot (`add_fp32`)."""

    a: tuple[torch.Tensor, ...]
    b: tuple[tuple[torch.Tensor, ...], ...]
    compiled: cpu_kernels.LoraBuffers | None


def add_fp32(x: torch.Tensor, out: torch.Tensor, views: SlotViews, scales: torch.Tensor, batch: LoraBatch) -> bool:
    """Shrink and expand in one pass where the CPU serves `x`: up to `cpu_kernels.MAX_ROWS` rows
    through the compiled kernel (given `views.compiled`, the layer's buffers behind the same
    per-slot views), else `torch_ops.add_fp32`; False, having done nothing, where neither serves
    (then call `shrink` and `expand`). 16-bit buffers (a 16-bit layer's, with `x` and `out`
    widened) take the compiled kernel for any number of rows: torch has no 16-bit pass as fast
    (it would widen every slot's A and B per module)."""
    if use_triton(x):
        return False
    sixteen_bit = views.compiled is not None and views.compiled.a_joined.dtype != torch.float32
    lib = compiled_cpu(x, any_rows=sixteen_bit)
    if lib is not None and views.compiled is not None and cpu_kernels.add_lora_rows(lib, x, out, views.compiled, batch.token_slots):
        return True
    return torch_ops.add_fp32(x, out, views.a, views.b, scales, batch)


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


def paged_decode(
    q: torch.Tensor, cache: paged_attention.PagedLayer, context_lens: torch.Tensor, scale: float, first_block: int | None = None
) -> torch.Tensor:
    """`paged_attention.decode_torch`'s result: the triton kernel on CUDA, the torch path
    elsewhere (which takes `first_block`, see there)."""
    if use_triton(q):
        from node_agent.engine.kernels import paged_attention_triton

        return paged_attention_triton.decode(q, cache, context_lens, scale)
    return paged_attention.decode_torch(q, cache, context_lens, scale, first_block)
