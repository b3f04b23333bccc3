"""The compiled CPU kernels (node_agent/engine/kernels/cpu_kernels.c, .py): the few-row matmul
equals `F.linear` over row counts, column tails, odd inner sizes, bias and threads; the LoRA
rows equal a float64 reference and take a decode step's rows; the library is built once into
the cache directory; without a compiler, or with LORAFLEET_KERNELS=torch, oneDNN, MKL and torch
serve."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from node_agent.engine.kernels import cpu_kernels, dense, dispatch, torch_ops
from tests.kernels.test_lora_kernels import LayerShape, decode_slots, make_problem
from tests.kernels.test_torch_paths import per_token

FP32 = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture
def fresh_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """`library()` forgets this process's kernel and builds into an empty cache directory; the
    process's own comes back afterwards."""
    monkeypatch.setenv("LORAFLEET_CACHE", str(tmp_path))
    cpu_kernels.library.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    cpu_kernels.library.cache_clear()


@pytest.mark.parametrize("rows", range(1, cpu_kernels.MAX_ROWS + 1))
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 1), (31, 2), (32, 7), (33, 64), (100, 129), (1536, 1024)])
def test_the_kernel_equals_f_linear(kernel: ctypes.CDLL, rows: int, out_features: int, in_features: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    bias = torch.randn(out_features, generator=gen)
    # A column view, as the layers pass slices of wider activations.
    x = torch.randn(rows, in_features + 5, generator=gen)[:, 3 : 3 + in_features]
    packed = cpu_kernels.pack(weight)
    assert packed.shape == (-(-out_features // cpu_kernels.BLOCK), in_features, cpu_kernels.BLOCK)
    torch.testing.assert_close(cpu_kernels.gemm(kernel, x, packed, out_features), F.linear(x, weight), **FP32)
    torch.testing.assert_close(cpu_kernels.gemm(kernel, x, packed, out_features, bias), F.linear(x, weight, bias), **FP32)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_split_the_columns_without_changing_a_bit(kernel: ctypes.CDLL, threads: int) -> None:
    gen = torch.Generator().manual_seed(threads)
    weight, x = torch.randn(200, 96, generator=gen), torch.randn(8, 96, generator=gen)
    packed = cpu_kernels.pack(weight)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_kernels.gemm(kernel, x, packed, 200)
        torch.set_num_threads(threads)
        split = cpu_kernels.gemm(kernel, x, packed, 200)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone, split)  # each column's sum runs in one thread, in one order


def test_more_rows_than_the_kernel_takes_is_an_error(kernel: ctypes.CDLL) -> None:
    weight = torch.randn(40, 16)
    with pytest.raises(ValueError, match="1 to 8 rows, not 9"):
        cpu_kernels.gemm(kernel, torch.randn(9, 16), cpu_kernels.pack(weight), 40)


@pytest.mark.parametrize("mismatch", ["inner-size", "columns", "bias"])
def test_sizes_that_do_not_fit_the_packed_weight_are_an_error(kernel: ctypes.CDLL, mismatch: str) -> None:
    # The C code reads what the sizes say: a mismatch must stop before it, not read past a buffer.
    packed = cpu_kernels.pack(torch.randn(40, 16))
    x = torch.randn(2, 17 if mismatch == "inner-size" else 16)
    n = 65 if mismatch == "columns" else 40
    bias = torch.randn(39) if mismatch == "bias" else None
    with pytest.raises(ValueError, match="do not fit a packed weight"):
        cpu_kernels.gemm(kernel, x, packed, n, bias)


def test_the_kernel_is_built_once_into_the_cache_directory(kernel: ctypes.CDLL, fresh_library: Path) -> None:
    assert cpu_kernels.library() is not None
    (built,) = fresh_library.glob("cpu_kernels-*.so")
    stamp = built.stat().st_mtime_ns
    cpu_kernels.library.cache_clear()
    assert cpu_kernels.library() is not None
    assert built.stat().st_mtime_ns == stamp and list(fresh_library.glob("*.tmp")) == []


def test_without_a_compiler_the_dense_layers_keep_onednn(
    fresh_library: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(fresh_library))  # nothing to run there
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        assert cpu_kernels.library() is None
    assert "no C compiler ($CC, cc, gcc or clang) on PATH" in caplog.text
    weight, x = torch.randn(24, 16), torch.randn(4, 16)
    packed = dense.pack(weight)
    assert packed is not None and packed.few_rows is None and packed.onednn is not None
    torch.testing.assert_close(dense.linear(x, weight, packed), F.linear(x, weight), **FP32)


def test_a_failing_compiler_is_reported_in_one_line(
    fresh_library: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    compiler = fresh_library / "cc"
    compiler.write_text("#!/bin/sh\necho 'cpu_kernels.c:1: error: no such intrinsic' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        assert cpu_kernels.library() is None
    assert "cc failed on cpu_kernels.c: cpu_kernels.c:1: error: no such intrinsic" in caplog.text
    assert list(fresh_library.glob("*.so*")) == []  # no library, half-built or not, left behind


def test_the_torch_mode_keeps_the_torch_paths(kernel: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    # Layouts of two weights show which one was read: the kernel's copy is of `other`.
    weight, other, x = torch.randn(24, 16), torch.randn(24, 16), torch.randn(3, 16)
    mixed = dense.Packed(cpu_kernels.pack(other), torch.ops.mkldnn._reorder_linear_weight(weight, None))
    torch.testing.assert_close(dense.linear(x, weight, mixed), F.linear(x, other), **FP32)
    monkeypatch.setenv(dispatch.MODE_ENV, "torch")
    assert dispatch.compiled_cpu(x) is None
    torch.testing.assert_close(dense.linear(x, weight, mixed), F.linear(x, weight), **FP32)


def column_major(b_stacks: list[torch.Tensor]) -> list[torch.Tensor]:
    """`[slots, width, rank]` views of `[slots, rank, width]` memory: the layers' CPU B layout."""
    return [b.transpose(1, 2).contiguous().transpose(1, 2) for b in b_stacks]


@pytest.mark.parametrize(
    "token_slots",
    [
        [3],  # one decoding sequence
        decode_slots(8, 8),  # eight decoding sequences over eight adapters
        [-1, 5, 5, -1, 0],  # base rows among adapters, a slot twice
        [6] * 8,  # one adapter for every row
    ],
    ids=["one-row", "eight-adapters", "base-rows", "one-adapter"],
)
@pytest.mark.parametrize(
    ("widths", "in_features"), [((40, 8, 8), 64), ((17,), 67), ((1024, 256, 256), 1024)], ids=["three-slices", "odd-sizes", "benchmark-qkv"]
)
def test_the_lora_rows_equal_the_float64_reference(
    kernel: ctypes.CDLL, token_slots: list[int], widths: tuple[int, ...], in_features: int
) -> None:
    problem = make_problem(token_slots, shape=LayerShape(num_slots=8, widths=widths, in_features=in_features, slot_ranks={5: 4}))
    a_joined = torch.cat(problem.a_stacks, dim=1)
    shrunk = torch_ops.shrink(problem.x.double(), [a.double() for a in problem.a_stacks], problem.batch)
    _, want = per_token(problem, shrunk.float(), torch.float64)
    got = problem.out.clone()
    buffers = cpu_kernels.lora_buffers(a_joined, column_major(problem.b_stacks), problem.scales)
    assert buffers is not None
    assert cpu_kernels.add_lora_rows(kernel, problem.x, got, buffers, problem.batch.token_slots)
    torch.testing.assert_close(got.double(), want, **FP32)
    untargeted = problem.batch.token_slots < 0
    assert torch.equal(got[untargeted], problem.out[untargeted]), "a row without an adapter is left as it was"


@pytest.mark.parametrize("form", ["row-major-b", "float64", "ranks-unlike-a"])
def test_buffers_in_another_form_are_not_taken(form: str) -> None:
    dtype = torch.float64 if form == "float64" else torch.float32
    problem = make_problem([0, 1, -1], shape=LayerShape(num_slots=4), dtype=dtype, out_dtype=dtype)
    a_joined = torch.cat(problem.a_stacks, dim=1)
    b_stacks = problem.b_stacks if form == "row-major-b" else column_major(problem.b_stacks)
    if form == "ranks-unlike-a":
        a_joined = a_joined[:, :-1].contiguous()
    assert cpu_kernels.lora_buffers(a_joined, b_stacks, problem.scales) is None


def test_rows_in_another_form_are_declined(kernel: ctypes.CDLL) -> None:
    problem = make_problem([0, 1, -1], shape=LayerShape(num_slots=4))
    buffers = cpu_kernels.lora_buffers(torch.cat(problem.a_stacks, dim=1), column_major(problem.b_stacks), problem.scales)
    assert buffers is not None
    wrong = (
        (problem.x.bfloat16(), problem.out.bfloat16(), problem.batch.token_slots),  # another dtype
        (problem.x.t().contiguous().t(), problem.out, problem.batch.token_slots),  # a column-major x
        (problem.x[:, :-1], problem.out, problem.batch.token_slots),  # narrower than A
        (problem.x, problem.out[:, :-1], problem.batch.token_slots),  # narrower than the slices
        (problem.x, problem.out, problem.batch.token_slots[:-1]),  # a slot short
    )
    for x, out, token_slots in wrong:
        got = out.clone()
        assert not cpu_kernels.add_lora_rows(kernel, x, got, buffers, token_slots)
        assert torch.equal(got, out), "nothing written when the kernel declines"


@pytest.mark.parametrize(("rows", "mode", "compiled"), [(8, "auto", True), (9, "auto", False), (3, "torch", False)])
def test_a_decode_steps_rows_take_the_compiled_lora_pass(
    kernel: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch, rows: int, mode: str, compiled: bool
) -> None:
    # The joined buffers the compiled pass reads hold other adapters than the per-slot views the
    # torch pass reads: the result shows which pass ran. Up to MAX_ROWS rows in the default mode
    # take the compiled one; more rows, or LORAFLEET_KERNELS=torch, the torch one.
    monkeypatch.setenv(dispatch.MODE_ENV, mode)
    problem = make_problem(decode_slots(rows, 4), shape=LayerShape(num_slots=4))
    other = make_problem(decode_slots(rows, 4), shape=LayerShape(num_slots=4), seed=1)
    views_joined = torch.cat(problem.a_stacks, dim=1)
    a_slots, b_slots = tuple(views_joined.unbind(0)), tuple(zip(*(b.unbind(0) for b in problem.b_stacks), strict=True))
    got = problem.out.clone()
    buffers = cpu_kernels.lora_buffers(torch.cat(other.a_stacks, dim=1), column_major(other.b_stacks), problem.scales)
    assert dispatch.add_fp32(problem.x, got, dispatch.SlotViews(a_slots, b_slots, buffers), problem.scales, problem.batch)
    source = other if compiled else problem
    shrunk = torch_ops.shrink(problem.x, source.a_stacks, problem.batch)
    want = problem.out.clone()
    torch_ops.expand(shrunk, source.b_stacks, problem.scales, problem.batch, want)
    torch.testing.assert_close(got, want, **FP32)
