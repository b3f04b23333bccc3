"""The base layers' dense matmul. On the CPU, in fp32, each weight is kept in two more layouts
made once at load: up to 8 rows (a decode step's, one per running sequence) go through the
compiled kernel's (`cpu_kernels`), more rows through oneDNN's reordered copy, and `F.linear` over
the plain weight serves whatever neither takes (one row without the kernel, every CUDA matmul).

Why: a decode step's matmuls are bound by streaming the weight. MKL's GEMV streams it at full
speed for one row, but `F.linear` for several rows re-packs the whole weight on every call
(8 rows about 2.7x one row on the development CPU), and oneDNN over its copy runs 8 rows in
about 1.4x one row's time; the compiled kernel runs 1 to 8 rows in about one row's time
(docs/kernels.md, "The CPU path"). A prefill's many rows are compute-bound, where oneDNN is at
its best. The extra layouts triple the CPU engine's fp32 weight memory (without the kernel:
double); CUDA weights get none.

A 16-bit CPU weight (bf16, fp16) gets the compiled kernel's layout only (doubling its memory):
its layer computes in fp32 (`linear_widened`: the kernel widens the weight as it streams it, so
a decode step reads half fp32's bytes and accumulates as fp32 does); more rows take `F.linear`
in the weight's dtype (oneDNN's 16-bit kernels, fp32 accumulation), widened after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from node_agent.engine.kernels import cpu_kernels, dispatch


@dataclass(frozen=True)
class Packed:
    """A CPU fp32 weight's extra layouts: the compiled kernel's (None where it cannot serve) and
    oneDNN's (None where torch has no oneDNN)."""

    few_rows: torch.Tensor | None
    onednn: torch.Tensor | None


def pack(weight: torch.Tensor) -> Packed | None:
    """The extra layouts of `weight` ([out, in]) for `linear` (a CPU fp32 weight) or
    `linear_widened` (a CPU 16-bit one); None for any other (it needs none)."""
    if weight.device.type != "cpu" or weight.dtype not in cpu_kernels.PACKED_DTYPES or weight.numel() == 0:
        return None
    weight = weight.contiguous()
    few_rows = cpu_kernels.pack(weight) if cpu_kernels.library() is not None else None
    fp32 = weight.dtype == torch.float32
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None) if fp32 and torch._C._has_mkldnn else None
    return Packed(few_rows, onednn) if few_rows is not None or onednn is not None else None


def widens(weight: torch.Tensor) -> bool:
    """Whether a layer of `weight` computes in fp32 (`linear_widened`): a 16-bit weight on the CPU."""
    return weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)


def linear_widened(
    x: torch.Tensor, weight: torch.Tensor, packed: Packed | None, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` in fp32 and `x · weightᵀ + bias` in fp32, for 2-D `x` in `weight`'s 16-bit dtype (a
    `widens` layer): the compiled kernel over `packed` for a decode step's rows, else `F.linear`
    in the 16-bit dtype, widened."""
    wide = x.float()
    lib = dispatch.compiled_cpu(wide)
    if packed is not None and packed.few_rows is not None and lib is not None:
        return wide, cpu_kernels.gemm(lib, wide, packed.few_rows, weight.shape[0], bias)
    return wide, F.linear(x, weight, bias).float()


def linear(x: torch.Tensor, weight: torch.Tensor, packed: Packed | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x · weightᵀ + bias` for 2-D `x`; `packed` is what `pack` returned for `weight`."""
    if packed is not None:
        lib = dispatch.compiled_cpu(x)
        if packed.few_rows is not None and lib is not None:
            return cpu_kernels.gemm(lib, x, packed.few_rows, weight.shape[0], bias)
        if packed.onednn is not None and x.shape[0] > 1:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
            return out
    return F.linear(x, weight, bias)
