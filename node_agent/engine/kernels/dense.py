"""The base layers' dense matmul: on the CPU through oneDNN, with each weight reordered once.

Why not `F.linear` everywhere: on the CPU it calls MKL's fp32 GEMM, which re-packs the whole
weight on every call. A decode step multiplies a few rows (one per running sequence) by every
weight, so that packing is most of the work: on the development CPU 8 rows cost about 3× one
row, where streaming the weight once would allow close to 1×. oneDNN's matmul over a weight
reordered once, at load, runs 8 rows in about 1.8× one row and prompts (hundreds of rows) no
slower (docs/serving.md, "Measured"). CUDA tensors, other dtypes and torch builds without oneDNN
keep `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# fp32 only: oneDNN's bf16/fp16 matmul rounds differently from `F.linear`'s, and the CPU engine
# computes in fp32 (the reference the tests compare with).
_PACKED_DTYPES = (torch.float32,)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in]) in the layout `linear` reads fastest: oneDNN's, for a CPU fp32
    weight; otherwise `weight` itself."""
    if (weight.device.type != "cpu" or weight.dtype not in _PACKED_DTYPES or weight.numel() == 0
            or not torch._C._has_mkldnn):
        return weight
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x · weightᵀ + bias`, for a weight as `pack` returned it."""
    if weight.is_mkldnn:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out
    return F.linear(x, weight, bias)
