"""The base layers' dense matmul: on the CPU, several rows go through oneDNN over a copy of the
weight reordered once at load; one row, and every CUDA matmul, go through `F.linear`.

Why: on the CPU `F.linear` calls MKL, whose GEMM re-packs the whole weight on every call. A
decode step multiplies a few rows (one per running sequence) by every weight, so that packing is
most of its work: on the development CPU 8 rows cost about 2.5x one row, where streaming the
weight once would allow close to 1x. oneDNN over a reordered copy runs 8 rows in about 1.2x the
time of one, but one row more slowly than MKL's GEMV over the plain weight, so both layouts are
kept and the row count chooses (docs/kernels.md, "The CPU path"). The copy doubles the CPU
engine's weight memory; CUDA weights and 16-bit ones get no copy (oneDNN's 16-bit matmul rounds
differently from `F.linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's reordered copy of `weight` ([out, in]) for `linear`, for a CPU fp32 weight;
    None for any other (it needs none)."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.numel() == 0
            or not torch._C._has_mkldnn):
        return None
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x · weightᵀ + bias`; `packed` is what `pack` returned for `weight`."""
    if packed is not None and x.shape[0] > 1:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return out
    return F.linear(x, weight, bias)
