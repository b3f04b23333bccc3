"""The CPU path's shrink/expand equal a per-token reference, a slot's rows become slices, and
the base layers' matmuls over their packed layouts equal `F.linear` (node_agent/engine/kernels/torch_ops.py,
batch.py, dense.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from node_agent.engine.kernels import LoraBatch, cpu_kernels, dense, torch_ops
from tests.kernels.test_lora_kernels import LayerShape, Problem, decode_slots, make_problem, random_y

FP32 = {"rtol": 1e-5, "atol": 1e-5}


def per_token(
    problem: Problem,
    y: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shrink and the expanded `out` computed one token at a time in `dtype`."""
    slots = problem.batch.token_slots.tolist()
    shrunk = torch.zeros(len(problem.a_stacks), len(slots), problem.a_stacks[0].shape[1], dtype=dtype)
    out = problem.out.to(dtype).clone()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        offset = 0
        for i, (a, b) in enumerate(zip(problem.a_stacks, problem.b_stacks, strict=True)):
            shrunk[i, t] = a[slot].to(dtype) @ problem.x[t].to(dtype)
            width = b.shape[1]
            out[t, offset : offset + width] += (b[slot].to(dtype) @ y[i, t].to(dtype)) * float(problem.scales[i, slot])
            offset += width
    return shrunk, out


@pytest.mark.parametrize(
    ("token_slots", "dtype", "slot_ranks", "joined"),
    [
        (decode_slots(8, 8), torch.float32, None, True),  # one row per slot: matrix-vector products
        (list(range(8)), torch.float32, {3: 4}, False),
        ([0, 0, 1, 1, 0, 0, 2, -1, 1], torch.float32, None, True),  # runs of two rows: slices
        (decode_slots(24, 4), torch.float32, {1: 4}, True),  # more than MAX_RUNS_AS_SLICES runs: indices
        ([-1, 2, 2, 0, 3, -1, 1], torch.bfloat16, {3: 8}, False),
    ],
)
def test_shrink_and_expand_equal_a_per_token_reference(
    token_slots: list[int], dtype: torch.dtype, slot_ranks: dict[int, int] | None, joined: bool
) -> None:
    problem = make_problem(
        token_slots, shape=LayerShape(num_slots=max(token_slots) + 1, slot_ranks=slot_ranks), dtype=dtype, out_dtype=dtype
    )
    stacks = torch.cat(problem.a_stacks, dim=1) if joined else None
    a_stacks = [stacks[:, i * 16 : (i + 1) * 16] for i in range(3)] if stacks is not None else problem.a_stacks
    got_y = torch_ops.shrink(problem.x, a_stacks, problem.batch, stacks)
    y = random_y(problem)
    got = problem.out.clone()
    torch_ops.expand(y, problem.b_stacks, problem.scales, problem.batch, got)
    want_y, want = per_token(problem, y)
    tol = FP32 if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-7}
    torch.testing.assert_close(got_y, want_y, **tol)
    torch.testing.assert_close(got.float(), want, **tol)
    untargeted = problem.batch.token_slots < 0
    assert torch.equal(got_y[:, untargeted], torch.zeros_like(got_y[:, untargeted]))
    assert torch.equal(got[untargeted], problem.out[untargeted]), "a token without an adapter is left as it was"


def test_a_slots_rows_are_slices_of_its_runs_up_to_a_limit() -> None:
    batch = LoraBatch.from_token_slots(torch.tensor([1, 0, 1, 1, -1, 0, 2, 2, 1]))
    assert batch.slot_rows == ((0, slice(1, 2)), (0, slice(5, 6)), (1, slice(0, 1)), (1, slice(2, 4)), (1, slice(8, 9)), (2, slice(6, 8)))
    many = LoraBatch.from_token_slots(torch.tensor([0, 1] * 5))  # five runs of slot 0
    (slot0, rows0), (slot1, rows1) = many.slot_rows
    assert (slot0, slot1) == (0, 1)
    assert isinstance(rows0, torch.Tensor) and rows0.tolist() == [0, 2, 4, 6, 8]
    assert isinstance(rows1, torch.Tensor) and rows1.tolist() == [1, 3, 5, 7, 9]


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"), [(0, 24, 16), (1, 24, 16), (3, 40, 67), (8, 5632, 64), (9, 33, 16), (300, 40, 72)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_with_the_packed_copies_equals_f_linear(rows: int, out_features: int, in_features: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    b = torch.randn(out_features, generator=gen) if bias else None
    # A column view: the layers pass slices of wider activations.
    x = torch.randn(rows, in_features + 8, generator=gen)[:, 4 : 4 + in_features]
    packed = dense.pack(weight)
    assert packed is not None and packed.onednn is not None and packed.onednn.is_mkldnn
    assert (packed.few_rows is not None) == (cpu_kernels.library() is not None)
    torch.testing.assert_close(dense.linear(x, weight, packed, b), F.linear(x, weight, b), **FP32)


def test_the_row_count_chooses_the_layout() -> None:
    # Layouts of another weight show which one was read: up to 8 rows the compiled kernel's
    # (where it serves), more rows oneDNN's, and without the kernel one row the plain weight
    # (MKL's GEMV is faster there than oneDNN).
    weight, other = torch.randn(6, 4), torch.randn(6, 4)
    others = dense.pack(other)
    assert others is not None
    few, many = torch.randn(3, 4), torch.randn(9, 4)
    torch.testing.assert_close(dense.linear(many, weight, others), F.linear(many, other), **FP32)
    without_kernel = dense.Packed(None, others.onednn)
    one = torch.randn(1, 4)
    assert torch.equal(dense.linear(one, weight, without_kernel), F.linear(one, weight))
    torch.testing.assert_close(dense.linear(few, weight, without_kernel), F.linear(few, other), **FP32)
    if cpu_kernels.library() is not None:
        for x in (one, few):
            torch.testing.assert_close(dense.linear(x, weight, others), F.linear(x, other), **FP32)


def test_pack_makes_no_copy_of_other_dtypes() -> None:
    """fp32 and the 16-bit dtypes get copies (the 16-bit ones: tests/kernels/test_cpu_kernels_16bit.py)."""
    weight = torch.randn(8, 4, dtype=torch.float64)
    assert dense.pack(weight) is None
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(dense.linear(x, weight, None), F.linear(x, weight))


def joined_views(a_stacks: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stacks copied into one tensor as consecutive row blocks, as `LoraLinear` holds them."""
    joined = torch.cat(a_stacks, dim=1)
    rank = a_stacks[0].shape[1]
    return joined, [joined[:, i * rank : (i + 1) * rank] for i in range(len(a_stacks))]


@pytest.mark.parametrize(
    "token_slots",
    [
        [3],  # one decoding sequence: matrix-vector products
        [2] * 5,  # one adapter for every token (a prefill): no zeroed rows
        [-1, 1, 1, -1],  # one run of an adapter among base tokens
        [0, 1, 0, 2, 1, -1],  # rows of a slot that are not consecutive: gathered and put back
        decode_slots(8, 8),  # the all-slots product
    ],
    ids=["one-row", "one-adapter", "run-among-base", "scattered", "all-slots"],
)
@pytest.mark.parametrize("joined", [True, False], ids=["joined", "separate"])
def test_every_cpu_path_equals_the_float64_reference(token_slots: list[int], joined: bool) -> None:
    problem = make_problem(token_slots, shape=LayerShape(num_slots=8))
    a_joined, a_stacks = joined_views(problem.a_stacks) if joined else (None, problem.a_stacks)
    y = random_y(problem)
    want_y, want = per_token(problem, y, torch.float64)
    got_y = torch_ops.shrink(problem.x, a_stacks, problem.batch, a_joined)
    got = problem.out.clone()
    torch_ops.expand(y, problem.b_stacks, problem.scales, problem.batch, got)
    torch.testing.assert_close(got_y.double(), want_y, **FP32)
    torch.testing.assert_close(got.double(), want, **FP32)
    untargeted = problem.batch.token_slots < 0
    assert torch.equal(got[untargeted], problem.out[untargeted]), "a token without an adapter is left as it was"


def test_scattered_rows_into_a_16_bit_output() -> None:
    # The rows of a slot that are not one run take the gather path, into bf16 as in fp32.
    problem = make_problem([0, 1, 0, -1], shape=LayerShape(num_slots=4), dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    y = random_y(problem)
    _, want = per_token(problem, y, torch.float64)
    got = problem.out.clone()
    torch_ops.expand(y, problem.b_stacks, problem.scales, problem.batch, got)
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=2**-7)


def slot_views(
    a_joined: torch.Tensor, b_stacks: list[torch.Tensor]
) -> tuple[tuple[torch.Tensor, ...], tuple[tuple[torch.Tensor, ...], ...]]:
    """Per-slot views of the joined A and the B stacks, as `LoraLinear.slot_views` makes them."""
    return tuple(a_joined.unbind(0)), tuple(zip(*(b.unbind(0) for b in b_stacks), strict=True))


@pytest.mark.parametrize(
    "token_slots",
    [
        [3],  # one decoding sequence
        [2] * 5,  # one adapter for every token (a prefill)
        [-1, 1, 1, -1],  # one run of an adapter among base tokens
        decode_slots(8, 8),  # eight decoding sequences over eight adapters
        [4, 4, 1, 0, 0, 0, -1, 1, 7],  # runs of one and several rows, a slot twice, base rows
    ],
    ids=["one-row", "one-adapter", "run-among-base", "eight-adapters", "mixed-runs"],
)
@pytest.mark.parametrize("widths", [(40, 8, 8), (24,)], ids=["three-slices", "one-slice"])
def test_add_fp32_equals_shrink_then_expand_to_the_bit(token_slots: list[int], widths: tuple[int, ...]) -> None:
    # The fused pass runs the very products of the two calls, so greedy tokens cannot move.
    problem = make_problem(token_slots, shape=LayerShape(num_slots=8, widths=widths))
    a_joined, a_stacks = joined_views(problem.a_stacks)
    want = problem.out.clone()
    torch_ops.expand(torch_ops.shrink(problem.x, a_stacks, problem.batch, a_joined), problem.b_stacks, problem.scales, problem.batch, want)
    got = problem.out.clone()
    a_slots, b_slots = slot_views(a_joined, problem.b_stacks)
    assert torch_ops.add_fp32(problem.x, got, a_slots, b_slots, problem.scales, problem.batch)
    assert torch.equal(got, want)
    _, reference = per_token(problem, torch_ops.shrink(problem.x, a_stacks, problem.batch, a_joined), torch.float64)
    torch.testing.assert_close(got.double(), reference, **FP32)


@pytest.mark.parametrize(
    ("token_slots", "dtype"),
    [
        (decode_slots(24, 4), torch.float32),  # more than MAX_RUNS_AS_SLICES runs: index rows
        ([0, 1, 1], torch.bfloat16),
    ],
    ids=["index-rows", "bf16"],
)
def test_add_fp32_leaves_other_batches_to_shrink_and_expand(token_slots: list[int], dtype: torch.dtype) -> None:
    problem = make_problem(token_slots, shape=LayerShape(num_slots=4), dtype=dtype, out_dtype=dtype)
    a_joined, _ = joined_views(problem.a_stacks)
    got = problem.out.clone()
    assert not torch_ops.add_fp32(problem.x, got, *slot_views(a_joined, problem.b_stacks), problem.scales, problem.batch)
    assert torch.equal(got, problem.out), "nothing written when the path declines"


def test_segments_and_runs_of_an_empty_batch() -> None:
    batch = LoraBatch.from_token_slots(torch.zeros(0, dtype=torch.int64))
    assert (batch.num_tokens, batch.max_seg_len, batch.active_slots, batch.slot_rows) == (0, 0, (), ())
    assert batch.seg_starts.dtype == batch.seg_lens.dtype == batch.seg_slots.dtype == torch.int32
    assert batch.seg_starts.numel() == 0
