"""Attention over the paged KV cache against plain dense causal attention on the same K/V.

The reference is an explicit float64 softmax over the whole sequence (GQA by repeating KV heads,
as transformers does); the torch paths must match it for every new token, with the sequence's
K/V scattered over non-contiguous blocks. The triton decode kernel is then checked against the
torch decode path (under `TRITON_INTERPRET=1` on the CPU) over block sizes, GQA ratios and
ragged lengths.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from node_agent.engine.kernels import dispatch, paged_attention, paged_attention_triton, triton_launch
from node_agent.engine.kernels.paged_attention import PagedLayer
from node_agent.engine.serving.kv_cache import BlockAllocator, KVCacheLayout, PagedKVCache
from tests.kernels.test_lora_kernels import _compile_for_hopper

CPU = torch.device("cpu")
SCALE = 0.3  # not 1/sqrt(head_dim): the scale is a parameter, not assumed
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of all L tokens over themselves, `[L, heads, D]`, in float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    length = q.shape[0]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


@dataclass
class PagedProblem:
    """Sequences whose full Q/K/V are known, with K/V stored in a paged cache."""

    q: list[torch.Tensor]  # per sequence [L, heads, D]
    k: list[torch.Tensor]  # per sequence [L, kv_heads, D]
    v: list[torch.Tensor]
    cache: PagedKVCache
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with block 0

    def reference(self, index: int) -> torch.Tensor:
        return dense_attention(self.q[index], self.k[index], self.v[index], SCALE)

    def layer(self, tables: torch.Tensor | None = None) -> PagedLayer:
        """Layer 1 of the cache, read through `tables` (default: the problem's block tables)."""
        return PagedLayer(self.cache.key(1), self.cache.value(1), self.block_tables if tables is None else tables)


def make_problem(
    lengths: list[int],
    *,
    block_size: int,
    group: int,
    kv_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
    seed: int = 0,
) -> PagedProblem:
    """Random sequences written through `PagedKVCache.write` into shuffled, interleaved blocks."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-length // block_size) for length in lengths]
    num_blocks = sum(per_seq) + 3  # spare blocks never used: a wrong table would read them
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, taken = [], 0
    for count in per_seq:
        tables.append(order[taken : taken + count])
        taken += count
    width = max(per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    layout = KVCacheLayout(num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype)
    cache = PagedKVCache(layout, num_blocks, device)
    # Garbage in every slot first: only the slots a sequence owns may influence its output.
    for tensor in (cache.key(1), cache.value(1)):
        tensor.copy_(torch.randn(tensor.shape, generator=gen) * 100)
    qs, ks, vs = [], [], []
    for length, table in zip(lengths, tables, strict=True):
        q = torch.randn(length, kv_heads * group, head_dim, generator=gen).to(device, dtype)
        k = torch.randn(length, kv_heads, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(length, kv_heads, head_dim, generator=gen).to(device, dtype)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)], device=device)
        cache.write(1, slots, k, v)
        qs.append(q)
        ks.append(k)
        vs.append(v)
    return PagedProblem(qs, ks, vs, cache, block_tables)


def ragged_lengths(block_size: int) -> list[int]:
    """1, block − 1, block, block + 1 and several blocks (with a partial last one)."""
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2]


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_matches_dense_causal(block_size: int, group: int) -> None:
    lengths = [5, block_size, 2 * block_size + 3, 3 * block_size + 1]
    # New tokens per sequence: a whole prompt, one token, a chunk after a cached block, a chunk
    # starting mid-block. The rest of each sequence is its cached prefix.
    query_lens = [5, 1, block_size + 3, block_size + 2]
    problem = make_problem(lengths, block_size=block_size, group=group)
    q = torch.cat([qs[-n:] for qs, n in zip(problem.q, query_lens, strict=True)])
    out = paged_attention.prefill(q, problem.layer(), query_lens, lengths, SCALE)
    rows = out.split(query_lens)
    for index, n in enumerate(query_lens):
        torch.testing.assert_close(rows[index].double(), problem.reference(index)[-n:], **FP32_TOL)


def test_prefill_of_equal_lengths_is_one_attention_call_with_the_same_result() -> None:
    """Consecutive sequences with the same new and context lengths (a batch of equal prompts)
    share one SDPA call, and each gets exactly what a call of its own gives (bit for bit)."""
    lengths = [16, 16, 16, 9, 20, 20]
    query_lens = [16, 16, 16, 9, 4, 4]  # three whole prompts, one more, two chunks after a cache
    problem = make_problem(lengths, block_size=8, group=2)
    q = torch.cat([qs[-n:] for qs, n in zip(problem.q, query_lens, strict=True)])
    counter = OpCounter()
    with counter:
        out = paged_attention.prefill(q, problem.layer(), query_lens, lengths, SCALE)
    assert counter.ops["aten._scaled_dot_product_flash_attention_for_cpu.default"] == 3  # runs of 3, 1 and 2
    for index, (rows, n) in enumerate(zip(out.split(query_lens), query_lens, strict=True)):
        alone = paged_attention.prefill(
            problem.q[index][-n:],
            problem.layer(problem.block_tables[index : index + 1]),
            [n],
            [lengths[index]],
            SCALE,
        )
        assert torch.equal(rows, alone)
        torch.testing.assert_close(rows.double(), problem.reference(index)[-n:], **FP32_TOL)


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_torch_matches_dense(block_size: int, group: int) -> None:
    lengths = ragged_lengths(block_size)
    problem = make_problem(lengths, block_size=block_size, group=group)
    q = torch.stack([qs[-1] for qs in problem.q])
    context_lens = torch.tensor(lengths, dtype=torch.int32)
    out = paged_attention.decode_torch(q, problem.layer(), context_lens, SCALE)
    for index in range(len(lengths)):
        torch.testing.assert_close(out[index].double(), problem.reference(index)[-1], **FP32_TOL)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 50])
def test_a_lone_sequence_on_consecutive_blocks_reads_them_as_a_view(length: int) -> None:
    # The single stream's decode: no gather, and the very same result as the gathered path.
    block_size, used = 16, -(-length // 16)
    layout = KVCacheLayout(num_layers=1, num_kv_heads=2, head_dim=16, block_size=block_size, dtype=torch.float32)
    cache = PagedKVCache(layout, used + 6, CPU)
    gen = torch.Generator().manual_seed(length)
    for tensor in (cache.key(0), cache.value(0)):
        tensor.copy_(torch.randn(tensor.shape, generator=gen))
    first = 3
    table = torch.tensor([list(range(first, first + used))], dtype=torch.int32)
    assert paged_attention.consecutive_blocks(table, [length], block_size) == first
    q = torch.randn(1, 4, 16, generator=gen)
    lens = torch.tensor([length], dtype=torch.int32)
    gathered = paged_attention.decode_torch(q, PagedLayer(cache.key(0), cache.value(0), table), lens, SCALE)
    viewed = paged_attention.decode_torch(q, PagedLayer(cache.key(0), cache.value(0), table), lens, SCALE, first)
    assert torch.equal(viewed, gathered)
    k = cache.key(0)[first : first + used].flatten(0, 1)[:length]
    v = cache.value(0)[first : first + used].flatten(0, 1)[:length]
    want = dense_attention(torch.cat([torch.zeros(length - 1, 4, 16), q]), k, v, SCALE)[-1]
    torch.testing.assert_close(viewed[0].double(), want, **FP32_TOL)


@pytest.mark.parametrize(
    ("tables", "lengths"),
    [
        ([[3, 5]], [20]),  # a gap
        ([[4, 3]], [20]),  # descending
        ([[0, 1], [2, 3]], [20, 20]),  # two sequences: gathered
        ([[7, 8, 0]], [20]),  # consecutive over the blocks in use; the padding is not read
    ],
    ids=["gap", "descending", "two-sequences", "padded"],
)
def test_which_block_tables_count_as_consecutive(tables: list[list[int]], lengths: list[int]) -> None:
    got = paged_attention.consecutive_blocks(torch.tensor(tables, dtype=torch.int32), lengths, 16)
    assert got == (7 if tables == [[7, 8, 0]] else None)


def test_chunked_prefill_and_decode_through_the_allocator_equal_one_dense_pass() -> None:
    """Two sequences prefilled in interleaved chunks, then decoded, with the allocator choosing
    every slot: each new token's output equals the dense causal output at its position."""
    block_size = 4  # 4 query heads over 2 KV heads: GQA 2
    allocator = BlockAllocator(num_blocks=16, block_size=block_size)
    layout = KVCacheLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=block_size, dtype=torch.float32)
    cache = PagedKVCache(layout, allocator.num_blocks, CPU)
    gen = torch.Generator().manual_seed(3)
    full = {
        seq: (torch.randn(length, 4, 8, generator=gen), torch.randn(length, 2, 8, generator=gen), torch.randn(length, 2, 8, generator=gen))
        for seq, length in ((0, 13), (1, 9))
    }
    for seq in full:
        allocator.add(seq, None, list(range(len(full[seq][0]))))
    # Steps of (sequence, new tokens): chunked prefills interleaved, then one-token decodes.
    steps = [[(0, 6), (1, 3)], [(0, 1), (1, 5)], [(0, 4)], [(0, 1), (1, 1)], [(0, 1)]]
    outputs: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for step in steps:
        queries, query_lens, context_lens, tables = [], [], [], []
        for seq, new in step:
            q, k, v = full[seq]
            start = allocator.num_tokens(seq)
            slots = allocator.append(seq, list(range(start, start + new)))
            assert slots is not None
            cache.write(0, torch.tensor(slots), k[start : start + new], v[start : start + new])
            queries.append(q[start : start + new])
            query_lens.append(new)
            context_lens.append(start + new)
            tables.append(list(allocator.block_table(seq)))
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        out = paged_attention.prefill(
            torch.cat(queries), PagedLayer(cache.key(0), cache.value(0), block_tables), query_lens, context_lens, SCALE
        )
        for (seq, _), rows in zip(step, out.split(query_lens), strict=True):
            outputs[seq].append(rows)
        if all(new == 1 for _, new in step):
            decoded = paged_attention.decode_torch(
                torch.cat(queries), PagedLayer(cache.key(0), cache.value(0), block_tables), torch.tensor(context_lens), SCALE
            )
            torch.testing.assert_close(decoded, out, **FP32_TOL)
    # Blocks interleave between the sequences, so the tables are not contiguous ranges.
    assert allocator.block_table(0) != tuple(range(len(allocator.block_table(0))))
    for seq, (q, k, v) in full.items():
        torch.testing.assert_close(torch.cat(outputs[seq]).double(), dense_attention(q, k, v, SCALE), **FP32_TOL)


def test_prefill_rejects_inconsistent_lengths() -> None:
    problem = make_problem([4], block_size=4, group=1)
    with pytest.raises(ValueError, match="query_lens"):
        paged_attention.prefill(problem.q[0], problem.layer(), [3], [4], SCALE)
    with pytest.raises(ValueError, match="new tokens but a context of 3"):
        paged_attention.prefill(problem.q[0], problem.layer(), [4], [3], SCALE)


def run_triton_decode(problem: PagedProblem, lengths: list[int], **kwargs: int) -> None:
    """Triton decode equals the torch decode (itself checked against dense attention above)."""
    q = torch.stack([qs[-1] for qs in problem.q])
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
    args = (q, problem.layer(), context_lens, SCALE)
    got = paged_attention_triton.decode(*args, **kwargs)
    want = paged_attention.decode_torch(*args)
    assert got.dtype == q.dtype and got.shape == q.shape
    if q.dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOL)
    else:
        # 16-bit K/V: the compiled kernel's P·V runs P in 16 bits; the interpreter truncates the
        # output to bf16 instead of rounding. Both stay within a few 16-bit ulps of the fp32 path.
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_triton_decode_matches_torch(device: torch.device, block_size: int, group: int) -> None:
    lengths = ragged_lengths(block_size)
    problem = make_problem(lengths, block_size=block_size, group=group, device=device)
    run_triton_decode(problem, lengths)


def test_triton_decode_several_tiles_odd_page_and_head_dim(device: torch.device) -> None:
    # 16-token tiles over contexts up to 4 tiles: the online softmax crosses tiles; pages of 6
    # tokens do not divide a tile, and head_dim 24 is padded to a 32-wide tile.
    lengths = [1, 15, 16, 17, 50, 64]
    problem = make_problem(lengths, block_size=6, group=3, kv_heads=1, head_dim=24, device=device, seed=5)
    run_triton_decode(problem, lengths, block_n=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_decode_16bit(device: torch.device, dtype: torch.dtype) -> None:
    lengths = [3, 16, 33]
    problem = make_problem(lengths, block_size=16, group=2, dtype=dtype, device=device)
    run_triton_decode(problem, lengths)


def test_triton_decode_no_sequences(device: torch.device) -> None:
    problem = make_problem([4], block_size=4, group=2, device=device)
    empty = paged_attention_triton.decode(
        torch.empty(0, 4, 16, device=device),
        problem.layer(torch.empty(0, 1, dtype=torch.int32, device=device)),
        torch.empty(0, dtype=torch.int32, device=device),
        SCALE,
    )
    assert empty.shape == (0, 4, 16)


def test_torch_paths_with_no_tokens() -> None:
    """An attention group with no sequences still runs the step (DP attention), with zero rows."""
    problem = make_problem([4], block_size=4, group=2)
    q = torch.empty(0, 4, 16)
    no_tables = torch.empty(0, 1, dtype=torch.int32)
    assert paged_attention.prefill(q, problem.layer(no_tables), [], [], SCALE).shape == q.shape
    decoded = paged_attention.decode_torch(q, problem.layer(no_tables), torch.empty(0, dtype=torch.int32), SCALE)
    assert decoded.shape == q.shape


@pytest.mark.parametrize(("mode", "interpret", "expect_triton"), [(None, None, False), ("triton", "1", True)])
def test_decode_dispatch_on_cpu(monkeypatch: pytest.MonkeyPatch, mode: str | None, interpret: str | None, expect_triton: bool) -> None:
    for name, value in (("LORAFLEET_KERNELS", mode), ("TRITON_INTERPRET", interpret)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    calls: list[int] = []
    triton_decode = paged_attention_triton.decode

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return triton_decode(*args, **kwargs)

    monkeypatch.setattr(paged_attention_triton, "decode", spy)
    lengths = [2, 9]
    problem = make_problem(lengths, block_size=4, group=2)
    q = torch.stack([qs[-1] for qs in problem.q])
    out = dispatch.paged_decode(q, problem.layer(), torch.tensor(lengths, dtype=torch.int32), SCALE)
    assert len(calls) == (1 if expect_triton else 0)
    for index in range(len(lengths)):
        torch.testing.assert_close(out[index].double(), problem.reference(index)[-1], **FP32_TOL)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_triton_decode_compiles_for_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter never compiles: the bf16 launch of an 8B-like shape (head_dim 128, GQA 4)
    compiles for sm_90 (no GPU needed), fits shared memory, uses tensor cores and vector loads."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    launches: list[tuple[tuple[object, ...], dict[str, object]]] = []

    class Recorder:
        def __getitem__(self, grid: tuple[int, ...]) -> object:
            return lambda *args, **kwargs: launches.append((args, kwargs))

    monkeypatch.setattr(triton_launch, "jitted", lambda fn, interpret: Recorder())
    problem = make_problem([40], block_size=16, group=4, kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    q = problem.q[0][-1:]
    paged_attention_triton.decode(q, problem.layer(), torch.tensor([40], dtype=torch.int32), SCALE)
    ((args, kwargs),) = launches
    ptx, shared = _compile_for_hopper(paged_attention_triton._paged_decode_kernel, args, kwargs)
    assert shared <= 227 * 1024
    assert "mma" in ptx
    # K/V rows move as 16-byte loads; the only narrow load left is the context length (a scalar).
    assert re.search(r"ld\.global(?:\.\w+)*\.v4", ptx)
    assert len(re.findall(r"ld\.global\.(?:b16|b32|f32|u16)\b", ptx)) <= 2
