"""The CPU path's two ways to shrink/expand agree, and the base layers' oneDNN matmul equals
`F.linear` (node_agent/engine/kernels/torch_ops.py, dense.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from node_agent.engine.kernels import dense, torch_ops
from tests.kernels.test_lora_kernels import Problem, decode_slots, make_problem, random_y

FP32 = {"rtol": 1e-5, "atol": 1e-5}


def looped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the loop over active slots (the oracle the all-slots product must equal)."""
    monkeypatch.setattr(torch_ops, "multiplies_every_slot", lambda batch, num_slots: False)


@pytest.mark.parametrize(("token_slots", "dtype", "slot_ranks"), [
    (decode_slots(8, 8), torch.float32, None),
    (decode_slots(24, 4), torch.float32, {1: 4}),
    ([-1, 2, 2, 0, 3, -1, 1], torch.bfloat16, {3: 8}),
])
def test_all_slots_product_equals_the_loop(
    monkeypatch: pytest.MonkeyPatch, token_slots: list[int], dtype: torch.dtype, slot_ranks: dict[int, int] | None
) -> None:
    num_slots = max(token_slots) + 1
    problem = make_problem(token_slots, num_slots=num_slots, dtype=dtype, out_dtype=dtype, slot_ranks=slot_ranks)
    assert torch_ops.multiplies_every_slot(problem.batch, num_slots), "the case must take the all-slots product"
    got_y = torch_ops.shrink(problem.x, problem.a_stacks, problem.batch)
    y = random_y(problem)
    got = problem.out.clone()
    torch_ops.expand(y, problem.b_stacks, problem.scales, problem.batch, got)
    with monkeypatch.context() as patch:
        looped(patch)
        want_y = torch_ops.shrink(problem.x, problem.a_stacks, problem.batch)
        want = problem.out.clone()
        torch_ops.expand(y, problem.b_stacks, problem.scales, problem.batch, want)
    torch.testing.assert_close(got_y, want_y, **FP32)
    tol = FP32 if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-7}
    torch.testing.assert_close(got, want, **tol)
    untargeted = problem.batch.token_slots < 0
    assert torch.equal(got_y[:, untargeted], torch.zeros_like(got_y[:, untargeted]))
    assert torch.equal(got[untargeted], problem.out[untargeted]), "a token without an adapter is left as it was"


@pytest.mark.parametrize(("token_slots", "num_slots"), [
    ([0] * 64 + [1] * 64, 4),  # a prefill: long runs of few adapters
    ([0, 1, 0, 1], 8),  # two adapters only
    (list(range(8)) * 32, 8),  # many adapters but many tokens: the product would cost more
])
def test_the_loop_serves_prefills_and_few_adapters(token_slots: list[int], num_slots: int) -> None:
    problem = make_problem(token_slots, num_slots=num_slots)
    assert not torch_ops.multiplies_every_slot(problem.batch, num_slots)


@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(0, 24, 16), (1, 24, 16), (8, 5632, 64), (300, 40, 72)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_with_the_packed_copy_equals_f_linear(rows: int, out_features: int, in_features: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    b = torch.randn(out_features, generator=gen) if bias else None
    # A column view: the layers pass slices of wider activations.
    x = torch.randn(rows, in_features + 8, generator=gen)[:, 4 : 4 + in_features]
    packed = dense.pack(weight)
    assert packed is not None and packed.is_mkldnn and packed.shape == weight.shape
    torch.testing.assert_close(dense.linear(x, weight, packed, b), F.linear(x, weight, b), **FP32)


def test_one_row_reads_the_plain_weight() -> None:
    # Several rows go through the packed copy, one row through the plain weight (MKL's GEMV is
    # faster there): a packed copy of another weight shows which one was read.
    weight, other = torch.randn(6, 4), torch.randn(6, 4)
    x = torch.randn(1, 4)
    assert torch.equal(dense.linear(x, weight, dense.pack(other)), F.linear(x, weight))
    rows = torch.randn(3, 4)
    torch.testing.assert_close(dense.linear(rows, weight, dense.pack(other)), F.linear(rows, other), **FP32)


def test_pack_makes_no_copy_of_other_dtypes() -> None:
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    assert dense.pack(weight) is None
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    assert torch.equal(dense.linear(x, weight, None), F.linear(x, weight))


def float64_reference(problem: Problem, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """shrink's result and `out` after expand of `y`, token by token in float64."""
    slots = problem.batch.token_slots.tolist()
    rank = problem.a_stacks[0].shape[1]
    shrunk = torch.zeros(len(problem.a_stacks), len(slots), rank, dtype=torch.float64)
    out = problem.out.double().clone()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        offset = 0
        for index, (a, b) in enumerate(zip(problem.a_stacks, problem.b_stacks, strict=True)):
            shrunk[index, t] = a[slot].double() @ problem.x[t].double()
            width = b.shape[1]
            out[t, offset : offset + width] += (b[slot].double() @ y[index, t].double()) * float(problem.scales[index, slot])
            offset += width
    return shrunk, out


def joined_views(a_stacks: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stacks copied into one tensor as consecutive row blocks, as `LoraLinear` holds them."""
    joined = torch.cat(a_stacks, dim=1)
    rank = a_stacks[0].shape[1]
    return joined, [joined[:, i * rank : (i + 1) * rank] for i in range(len(a_stacks))]


@pytest.mark.parametrize("token_slots", [
    [3],  # one decoding sequence: matrix-vector products
    [2] * 5,  # one adapter for every token (a prefill): no zeroed rows
    [-1, 1, 1, -1],  # one run of an adapter among base tokens
    [0, 1, 0, 2, 1, -1],  # rows of a slot that are not consecutive: gathered and put back
    decode_slots(8, 8),  # the all-slots product
], ids=["one-row", "one-adapter", "run-among-base", "scattered", "all-slots"])
@pytest.mark.parametrize("joined", [True, False], ids=["joined", "separate"])
def test_every_cpu_path_equals_the_float64_reference(token_slots: list[int], joined: bool) -> None:
    problem = make_problem(token_slots, num_slots=8)
    a_joined, a_stacks = joined_views(problem.a_stacks) if joined else (None, problem.a_stacks)
    y = random_y(problem)
    want_y, want = float64_reference(problem, y)
    got_y = torch_ops.shrink(problem.x, a_stacks, problem.batch, a_joined)
    got = problem.out.clone()
    torch_ops.expand(y, problem.b_stacks, problem.scales, problem.batch, got)
    torch.testing.assert_close(got_y.double(), want_y, **FP32)
    torch.testing.assert_close(got.double(), want, **FP32)
    untargeted = problem.batch.token_slots < 0
    assert torch.equal(got[untargeted], problem.out[untargeted]), "a token without an adapter is left as it was"


def test_scattered_rows_into_a_16_bit_output() -> None:
    # The rows of a slot that are not one run take the gather path, into bf16 as in fp32.
    problem = make_problem([0, 1, 0, -1], num_slots=4, dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    y = random_y(problem)
    _, want = float64_reference(problem, y)
    got = problem.out.clone()
    torch_ops.expand(y, problem.b_stacks, problem.scales, problem.batch, got)
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=2**-7)
