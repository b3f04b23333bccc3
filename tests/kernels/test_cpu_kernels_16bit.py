"""The compiled CPU kernels over 16-bit weights (bf16, fp16), and the 16-bit CPU layers on them
(docs/kernels.md, "16-bit weights on the CPU").

A 16-bit weight widens to fp32 exactly, so the kernels over a 16-bit weight or LoRA buffer must
give, to the bit, what the fp32 kernels give over its widened copy: the same arithmetic on the
same values, over half the bytes. A 16-bit layer (`dense.linear_widened`) then computes in fp32
and rounds once, for a decode step's rows (the kernel) and a prefill's (`F.linear` in 16 bits).
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from node_agent.engine.kernels import cpu_kernels, dense, dispatch
from tests.kernels.test_cpu_kernels import column_major
from tests.kernels.test_lora_kernels import LayerShape, decode_slots, make_problem

HALVES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, cpu_kernels.MAX_ROWS])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 1), (33, 64), (100, 129), (1536, 1024)])
def test_a_16_bit_weight_gives_the_fp32_kernels_result_to_the_bit(
    kernel: ctypes.CDLL, dtype: torch.dtype, rows: int, out_features: int, in_features: int
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features + 5, generator=gen)[:, 3 : 3 + in_features]
    packed = cpu_kernels.pack(weight)
    assert packed.dtype == dtype
    wide = cpu_kernels.pack(weight.float())
    for b in (None, bias):
        got = cpu_kernels.gemm(kernel, x, packed, out_features, b)
        assert torch.equal(got, cpu_kernels.gemm(kernel, x, wide, out_features, None if b is None else b.float()))
        torch.testing.assert_close(got, F.linear(x, weight.float(), None if b is None else b.float()), rtol=1e-5, atol=1e-5)


def test_16_bit_rows_are_an_error(kernel: ctypes.CDLL) -> None:
    weight = torch.randn(8, 16).bfloat16()
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.gemm(kernel, torch.randn(2, 16).bfloat16(), cpu_kernels.pack(weight), 8)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("token_slots", [[3], decode_slots(8, 8), [-1, 5, 5, -1, 0]], ids=["one-row", "eight-adapters", "base-rows"])
@pytest.mark.parametrize(("widths", "in_features"), [((40, 8, 8), 64), ((17,), 67), ((1024, 256, 256), 1024)])
def test_16_bit_lora_buffers_give_the_fp32_kernels_result_to_the_bit(
    kernel: ctypes.CDLL, dtype: torch.dtype, token_slots: list[int], widths: tuple[int, ...], in_features: int
) -> None:
    problem = make_problem(token_slots, shape=LayerShape(num_slots=8, widths=widths, in_features=in_features, slot_ranks={5: 4}))
    a_half = torch.cat(problem.a_stacks, dim=1).to(dtype)
    b_half = [b.to(dtype) for b in column_major(problem.b_stacks)]
    half = cpu_kernels.lora_buffers(a_half, b_half, problem.scales)
    wide = cpu_kernels.lora_buffers(a_half.float(), [b.float() for b in b_half], problem.scales)
    assert half is not None and wide is not None
    got, want = problem.out.clone(), problem.out.clone()
    assert cpu_kernels.add_lora_rows(kernel, problem.x, got, half, problem.batch.token_slots)
    assert cpu_kernels.add_lora_rows(kernel, problem.x, want, wide, problem.batch.token_slots)
    assert torch.equal(got, want)


def test_buffers_of_mixed_dtypes_are_not_taken() -> None:
    problem = make_problem([0, 1], shape=LayerShape(num_slots=4))
    b_stacks = column_major(problem.b_stacks)
    assert cpu_kernels.lora_buffers(torch.cat(problem.a_stacks, dim=1).bfloat16(), b_stacks, problem.scales) is None


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("rows", [1, cpu_kernels.MAX_ROWS, cpu_kernels.MAX_ROWS + 1, 40])
def test_a_16_bit_layer_computes_in_fp32_and_its_caller_rounds_once(
    kernel: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, rows: int
) -> None:
    """Decode rows take the kernel (fp32 over the widened weight); more rows, or the torch mode,
    take `F.linear` in 16 bits (fp32 accumulation, rounded once), widened: either way the
    result, rounded to the layer's dtype, is within one rounding of the fp32 product's."""
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 160, generator=gen) / 160**0.5).to(dtype)
    x = torch.randn(rows, 160, generator=gen).to(dtype)
    assert dense.widens(weight) and not dense.widens(weight.float())
    packed = dense.pack(weight)
    assert packed is not None and packed.few_rows is not None and packed.onednn is None
    exact = F.linear(x.double(), weight.double())
    for mode in ("auto", "torch"):
        monkeypatch.setenv(dispatch.MODE_ENV, mode)
        wide, out = dense.linear_widened(x, weight, packed)
        assert wide.dtype == out.dtype == torch.float32 and torch.equal(wide, x.float())
        if mode == "auto" and rows <= cpu_kernels.MAX_ROWS:
            torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.to(dtype).double(), exact, rtol=2**-7 if dtype == torch.bfloat16 else 2**-10, atol=1e-3)


@pytest.mark.parametrize("rows", [8, 40])
def test_a_prefills_rows_over_16_bit_buffers_take_the_compiled_lora_pass(kernel: ctypes.CDLL, rows: int) -> None:
    """torch has no one-pass LoRA over 16-bit buffers (it would widen every slot's A and B per
    module), so a 16-bit layer's LoRA takes the compiled pass for a prefill's rows too."""
    problem = make_problem(decode_slots(rows, 4), shape=LayerShape(num_slots=4))
    a_half = torch.cat(problem.a_stacks, dim=1).bfloat16()
    b_half = [b.bfloat16() for b in column_major(problem.b_stacks)]
    a_slots, b_slots = tuple(a_half.unbind(0)), tuple(zip(*(b.unbind(0) for b in b_half), strict=True))
    views = dispatch.SlotViews(a_slots, b_slots, cpu_kernels.lora_buffers(a_half, b_half, problem.scales))
    got = problem.out.clone()
    assert dispatch.add_fp32(problem.x, got, views, problem.scales, problem.batch)
    want = problem.out.clone()
    wide = cpu_kernels.lora_buffers(a_half.float(), [b.float() for b in b_half], problem.scales)
    assert wide is not None and cpu_kernels.add_lora_rows(kernel, problem.x, want, wide, problem.batch.token_slots)
    assert torch.equal(got, want)
