"""Triton shrink/expand against the torch reference (docs/design.md §5).

On the CPU the kernels run under TRITON_INTERPRET=1 (see conftest.py); with a GPU the same cases
also run compiled. Shapes are small because the interpreter executes programs one by one, but
they are chosen to cross every tile edge: K not a multiple of the K tile, slice widths that end
mid column-block, segments longer than one row block, ranks below the tile's rank.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

from node_agent.engine.kernels import dispatch, torch_ops, triton_launch, triton_ops
from node_agent.engine.kernels.batch import LoraBatch

# Tolerance of an fp32 result, and of a result rounded into a 16-bit `out` (half an ulp).
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}
CPU = torch.device("cpu")
OUT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-11}


def out_rtol(dtype: torch.dtype) -> float:
    """Relative tolerance of a value rounded once into `dtype`.

    The interpreter truncates fp32 -> bf16 (compiled kernels round to nearest even), so there a
    bf16 result may be off by up to a whole ulp instead of half.
    """
    if dtype == torch.bfloat16 and triton_launch.interpreting():
        return 2**-7
    return OUT_RTOL[dtype]


@dataclass
class Problem:
    """One layer's LoRA inputs for a batch: activations, buffers, scales and slot mapping."""

    x: torch.Tensor  # [T, K]
    a_stacks: list[torch.Tensor]  # [slots, R, K] per slice
    b_stacks: list[torch.Tensor]  # [slots, width, R] per slice
    scales: torch.Tensor  # [n_slices, slots]
    batch: LoraBatch
    out: torch.Tensor  # [T, Σ width], the base output the deltas are added to


@dataclass(frozen=True)
class LayerShape:
    """The layer a problem's LoRA buffers belong to: input width, one output width per slice,
    max rank and slots; `slot_ranks` gives adapters a rank below `rank`, zero-padded as the pool does."""

    in_features: int = 64
    widths: tuple[int, ...] = (40, 8, 8)
    rank: int = 16
    num_slots: int = 4
    slot_ranks: dict[int, int] | None = None


def make_problem(
    token_slots: list[int],
    *,
    shape: LayerShape = LayerShape(),
    dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
    seed: int = 0,
) -> Problem:
    """Random problem for a layer of `shape`."""
    in_features, widths, rank, num_slots, slot_ranks = shape.in_features, shape.widths, shape.rank, shape.num_slots, shape.slot_ranks
    gen = torch.Generator().manual_seed(seed)
    tokens = len(token_slots)
    # Scaled so y and the deltas are O(1): tolerances then read as relative errors.
    x = torch.randn(tokens, in_features, generator=gen)
    a_stacks = [torch.randn(num_slots, rank, in_features, generator=gen) / in_features**0.5 for _ in widths]
    b_stacks = [torch.randn(num_slots, width, rank, generator=gen) / rank**0.5 for width in widths]
    for slot, true_rank in (slot_ranks or {}).items():
        for a, b in zip(a_stacks, b_stacks, strict=True):
            a[slot, true_rank:] = 0
            b[slot, :, true_rank:] = 0
    scales = torch.rand(len(widths), num_slots, generator=gen) + 0.5
    out = torch.randn(tokens, sum(widths), generator=gen)
    return Problem(
        x=x.to(device, dtype),
        a_stacks=[a.to(device, dtype) for a in a_stacks],
        b_stacks=[b.to(device, dtype) for b in b_stacks],
        scales=scales.to(device),
        batch=LoraBatch.from_token_slots(torch.tensor(token_slots, dtype=torch.int32, device=device)),
        out=out.to(device, out_dtype),
    )


def check_shrink(problem: Problem, **kwargs: int) -> torch.Tensor:
    """Triton shrink equals the torch shrink; rows of untargeted tokens are exactly zero."""
    got = triton_ops.shrink(problem.x, problem.a_stacks, problem.batch, **kwargs)
    want = torch_ops.shrink(problem.x, problem.a_stacks, problem.batch)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, **FP32_TOL)
    untargeted = problem.batch.token_slots < 0
    assert torch.equal(got[:, untargeted], torch.zeros_like(got[:, untargeted]))
    return got


def check_expand(problem: Problem, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton expand equals the torch expand done in fp32, rounded once into `out`'s dtype.

    Rows of untargeted tokens must be bit-identical to what they were.
    """
    out = problem.out if out is None else out
    before = out.clone()
    reference = before.float()
    torch_ops.expand(y, problem.b_stacks, problem.scales, problem.batch, reference)
    triton_ops.expand(y, problem.b_stacks, problem.scales, problem.batch, out)
    # 16-bit B makes the kernel split y into two 16-bit terms: ~2^-16 relative, hence 1e-4.
    atol = 1e-5 if problem.b_stacks[0].dtype == torch.float32 else 1e-4
    torch.testing.assert_close(out.float(), reference, rtol=max(out_rtol(out.dtype), atol), atol=atol)
    untargeted = problem.batch.token_slots < 0
    assert torch.equal(out[untargeted], before[untargeted])
    return out


def random_y(problem: Problem, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rank = problem.b_stacks[0].shape[2]
    y = torch.randn(len(problem.b_stacks), problem.batch.num_tokens, rank, generator=gen)
    return y.to(problem.out.device)


def decode_slots(sequences: int, num_slots: int) -> list[int]:
    """One token per sequence, adapters interleaved, every fifth sequence without an adapter."""
    return [-1 if i % 5 == 4 else (i * 3) % num_slots for i in range(sequences)]


def test_decode_interleaved_adapters_three_unequal_slices(device: torch.device) -> None:
    # Slices q 40 / k 8 / v 8 (GQA): k and v end early inside the one column block.
    problem = make_problem(decode_slots(24, 4), device=device)
    assert problem.batch.max_seg_len == 1 and len(problem.batch.active_slots) == 4
    check_expand(problem, check_shrink(problem))


def test_prefill_long_segments_several_row_and_column_blocks(device: torch.device) -> None:
    # 70- and 37-token segments span two 64-row blocks and one; 160-wide q spans two column
    # blocks while k/v stop in the first; one segment has no adapter.
    slots = [2] * 37 + [-1] * 3 + [0] * 70 + [2] * 5 + [1]
    problem = make_problem(slots, shape=LayerShape(widths=(160, 32, 32), in_features=96), device=device)
    assert problem.batch.max_seg_len == 70
    check_expand(problem, check_shrink(problem))


def test_ranks_below_max_are_zero_padded(device: torch.device) -> None:
    slot_ranks = {0: 4, 1: 8, 3: 1}  # slot 2 uses the full rank 16
    problem = make_problem(decode_slots(10, 4) + [1] * 20 + [3] * 3, shape=LayerShape(slot_ranks=slot_ranks), device=device)
    base = problem.out.clone()
    out = check_expand(problem, check_shrink(problem))
    # The padded result equals the unpadded PEFT math, x Aᵀ Bᵀ scale with A [r, K], B [out, r].
    slots = problem.batch.token_slots
    for slot, true_rank in {**slot_ranks, 2: 16}.items():
        rows = slots == slot
        deltas = [
            problem.x[rows] @ a[slot, :true_rank].t() @ b[slot, :, :true_rank].t() * problem.scales[index, slot]
            for index, (a, b) in enumerate(zip(problem.a_stacks, problem.b_stacks, strict=True))
        ]
        torch.testing.assert_close(out[rows], base[rows] + torch.cat(deltas, dim=1), **FP32_TOL)


def test_tokens_without_adapter_change_nothing(device: torch.device) -> None:
    problem = make_problem([-1] * 9, device=device)
    before = problem.out.clone()
    y = triton_ops.shrink(problem.x, problem.a_stacks, problem.batch)
    assert torch.equal(y, torch.zeros_like(y))
    triton_ops.expand(random_y(problem), problem.b_stacks, problem.scales, problem.batch, problem.out)
    assert torch.equal(problem.out, before)


def test_zero_tokens(device: torch.device) -> None:
    problem = make_problem([], device=device)
    assert problem.batch.num_tokens == 0 and problem.batch.seg_starts.numel() == 0
    y = triton_ops.shrink(problem.x, problem.a_stacks, problem.batch)
    assert y.shape == (3, 0, 16)
    triton_ops.expand(y, problem.b_stacks, problem.scales, problem.batch, problem.out)
    assert problem.out.shape == (0, 56)


def test_empty_segments_are_skipped(device: torch.device) -> None:
    # A segment table with zero-length entries (as a padded, graph-friendly one would have):
    # their slot must not touch the token that happens to sit at their start.
    problem = make_problem([0, 0, 1, 1, 1, -1, 2], device=device)
    i32 = {"dtype": torch.int32, "device": device}
    padded = LoraBatch(
        token_slots=problem.batch.token_slots,
        seg_starts=torch.tensor([0, 0, 2, 5, 5, 6, 7], **i32),
        seg_lens=torch.tensor([0, 2, 3, 0, 1, 1, 0], **i32),
        seg_slots=torch.tensor([3, 0, 1, 3, -1, 2, 1], **i32),
        max_seg_len=3,
        active_slots=(0, 1, 2, 3),
    )
    y = triton_ops.shrink(problem.x, problem.a_stacks, padded)
    torch.testing.assert_close(y, torch_ops.shrink(problem.x, problem.a_stacks, problem.batch), **FP32_TOL)
    reference = problem.out.clone()
    torch_ops.expand(y, problem.b_stacks, problem.scales, problem.batch, reference)
    triton_ops.expand(y, problem.b_stacks, problem.scales, padded, problem.out)
    torch.testing.assert_close(problem.out, reference, **FP32_TOL)


def test_single_slice(device: torch.device) -> None:
    problem = make_problem([1] * 5 + [0] * 2 + [-1], shape=LayerShape(widths=(48,)), device=device)
    check_expand(problem, check_shrink(problem))


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_shrink_split_k_rank_64(device: torch.device, split_k: int) -> None:
    # K = 300 is 4.7 fp32 K tiles of 64 at rank 64: the last split of 1, 2 or 3 ends in a partial
    # tile, and more than one split accumulates through atomics into the zeroed output.
    problem = make_problem([0] * 3 + [2] * 20 + [-1], shape=LayerShape(in_features=300, rank=64), device=device)
    check_shrink(problem, split_k=split_k)


@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16)],
)
def test_16bit_weights_and_outputs(device: torch.device, dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    slots = decode_slots(6, 3) + [2] * 21
    problem = make_problem(slots, shape=LayerShape(widths=(32, 16, 16)), dtype=dtype, out_dtype=out_dtype, device=device)
    check_expand(problem, check_shrink(problem))


def test_strided_views_and_unaligned_column_block(device: torch.device) -> None:
    # The engine passes views: x may be a column slice, and a fully-sharded row-parallel layer
    # expands into `partial[:, start:stop]`, here starting at an odd column.
    problem = make_problem(decode_slots(7, 4) + [3] * 18, shape=LayerShape(widths=(24, 8, 8)), device=device)
    wide_x = torch.zeros(problem.x.shape[0], problem.x.shape[1] + 5, device=device)
    wide_x[:, 3 : 3 + problem.x.shape[1]] = problem.x
    problem.x = wide_x[:, 3 : 3 + problem.x.shape[1]]
    y = check_shrink(problem)
    partial = torch.randn(problem.out.shape[0], problem.out.shape[1] + 7, device=device)
    check_expand(problem, y, out=partial[:, 3 : 3 + problem.out.shape[1]])


def test_shrink_then_expand_end_to_end_bf16(device: torch.device) -> None:
    problem = make_problem(decode_slots(5, 4) + [0] * 30, dtype=torch.bfloat16, out_dtype=torch.bfloat16, device=device)
    reference = problem.out.float()
    torch_ops.expand(
        torch_ops.shrink(problem.x, problem.a_stacks, problem.batch), problem.b_stacks, problem.scales, problem.batch, reference
    )
    y = triton_ops.shrink(problem.x, problem.a_stacks, problem.batch)
    triton_ops.expand(y, problem.b_stacks, problem.scales, problem.batch, problem.out)
    torch.testing.assert_close(problem.out.float(), reference, rtol=out_rtol(torch.bfloat16), atol=1e-4)


class _Spy:
    """Counts calls to a triton_ops function while still running it."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize(
    ("mode", "interpret", "expect_triton"),
    [
        (None, "1", False),  # CPU tensors take the torch path unless asked
        ("auto", None, False),
        ("torch", "1", False),
        ("triton", "1", True),
    ],
)
def test_dispatch_choice_on_cpu(monkeypatch: pytest.MonkeyPatch, mode: str | None, interpret: str | None, expect_triton: bool) -> None:
    for name, value in (("LORAFLEET_KERNELS", mode), ("TRITON_INTERPRET", interpret)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    shrink_spy, expand_spy = _Spy(triton_ops.shrink), _Spy(triton_ops.expand)
    monkeypatch.setattr(triton_ops, "shrink", shrink_spy)
    monkeypatch.setattr(triton_ops, "expand", expand_spy)
    problem = make_problem(decode_slots(6, 4))
    reference = problem.out.clone()
    torch_ops.expand(
        torch_ops.shrink(problem.x, problem.a_stacks, problem.batch), problem.b_stacks, problem.scales, problem.batch, reference
    )
    y = dispatch.shrink(problem.x, problem.a_stacks, problem.batch)
    dispatch.expand(y, problem.b_stacks, problem.scales, problem.batch, problem.out)
    assert (shrink_spy.calls, expand_spy.calls) == ((1, 1) if expect_triton else (0, 0))
    torch.testing.assert_close(problem.out, reference, **FP32_TOL)


def test_dispatch_rejects_triton_on_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAFLEET_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    problem = make_problem([0, 1])
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.shrink(problem.x, problem.a_stacks, problem.batch)
    monkeypatch.setenv("LORAFLEET_KERNELS", "cuda")
    with pytest.raises(ValueError, match="LORAFLEET_KERNELS"):
        dispatch.shrink(problem.x, problem.a_stacks, problem.batch)


class _Launches:
    """Stands in for `triton_launch.jitted`: `kernel[grid](...)` records the launch, runs nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable[..., None], tuple[Any, ...], dict[str, Any]]] = []

    def jitted(self, fn: Callable[..., None], interpret: bool) -> _Launches._Kernel:
        return _Launches._Kernel(self, fn)

    class _Kernel:
        def __init__(self, owner: _Launches, fn: Callable[..., None]) -> None:
            self.owner, self.fn = owner, fn

        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
            return lambda *args, **kwargs: self.owner.calls.append((self.fn, args, kwargs))


def _compile_for_hopper(fn: Callable[..., None], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, int]:
    """Compile one recorded launch for sm_90 with the JIT's own argument specialisation.

    Returns the PTX and the shared memory the kernel needs (bytes).
    """
    names = list(inspect.signature(fn).parameters)
    signature: dict[str, str] = {}
    constexprs: dict[str, object] = {}
    attrs: dict[tuple[int, ...], list[list[object]]] = {}
    for index, (name, value) in enumerate(zip(names, args, strict=False)):
        kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = spec
        elif spec == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    for name, value in kwargs.items():
        signature[name] = "constexpr"
        constexprs[name] = value
    source = ASTSource(fn=triton.jit(fn), signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    return compiled.asm["ptx"], compiled.metadata.shared


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize(
    ("dtype", "slots", "split_k"),
    [(torch.bfloat16, decode_slots(16, 4), 4), (torch.bfloat16, [1] * 100, 1), (torch.float32, [0] * 100, 1)],
    ids=["decode-bf16-split4", "prefill-bf16", "prefill-fp32"],
)
def test_kernels_compile_for_hopper_with_16_byte_accesses(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, slots: list[int], split_k: int
) -> None:
    """The interpreter never compiles: check that the real launches compile for sm_90 (no GPU
    needed), fit its shared memory, use tensor cores for 16-bit inputs and move every tile with
    16-byte accesses."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    launches = _Launches()
    monkeypatch.setattr(triton_launch, "jitted", launches.jitted)
    # An 8B-like qkv slice set at a small K: hidden 512, q 512, k/v 128 under GQA, rank 64.
    problem = make_problem(slots, shape=LayerShape(in_features=512, widths=(512, 128, 128), rank=64), dtype=dtype, out_dtype=dtype)
    y = triton_ops.shrink(problem.x, problem.a_stacks, problem.batch, split_k=split_k)
    triton_ops.expand(y, problem.b_stacks, problem.scales, problem.batch, problem.out)
    assert [fn.__name__ for fn, _, _ in launches.calls] == ["_shrink_kernel", "_expand_kernel"]
    for fn, args, kwargs in launches.calls:
        assert kwargs["ALIGN"] > 1, "aligned buffers must get the alignment hints"
        ptx, shared = _compile_for_hopper(fn, args, kwargs)
        assert shared <= 227 * 1024, f"{fn.__name__}: {shared} bytes of shared memory do not fit sm_90"
        if dtype == torch.bfloat16:
            assert re.search(r"\bmma\.sync|wgmma", ptx), f"{fn.__name__}: no tensor-core instruction"
        narrow = re.findall(r"(?:ld|st)\.global\.(?:b16|b32|f32|u16)\b", ptx)
        wide = re.findall(r"(?:ld|st)\.global(?:\.\w+)*\.v[24]|cp\.async\.cg\.shared\.global", ptx)
        # The only narrow accesses left are the per-program scalars: segment slot, start and
        # length, and the scale (the 64-bit slice-table entries are not counted).
        assert wide and len(narrow) <= 4, f"{fn.__name__}: narrow accesses {narrow}"
