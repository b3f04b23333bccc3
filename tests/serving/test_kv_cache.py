"""The paged KV cache: budget sizing, writes, the block allocator and prefix caching.

The allocator is checked against what it promises: slots inside the sequence's own blocks,
reference counts that add up, every block free after every sequence is released (finish,
cancel and preemption all release through `free`), the same decisions from the same calls in
any process, and cached prefixes shared only for the same adapter and the same tokens.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from node_agent.engine.serving.kv_cache import (
    AdapterKey,
    BlockAllocator,
    KVCacheError,
    KVCacheLayout,
    PagedKVCache,
    budget_from_device_memory,
)

CPU = torch.device("cpu")
REPO_ROOT = Path(__file__).resolve().parents[2]


def layout(**overrides: int) -> KVCacheLayout:
    values = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8, "block_size": 4} | overrides
    return KVCacheLayout(dtype=torch.bfloat16, **values)


def test_blocks_come_from_the_byte_budget() -> None:
    spec = layout()
    assert spec.bytes_per_block == 2 * 3 * 4 * 2 * 8 * 2  # K and V, layers, tokens, heads, dim, bf16
    assert spec.blocks_for_budget(10 * spec.bytes_per_block + spec.bytes_per_block - 1) == 10
    cache = PagedKVCache.from_budget(spec, 10 * spec.bytes_per_block + 5, CPU)
    assert cache.num_blocks == 10 and cache.nbytes == 10 * spec.bytes_per_block
    assert cache.key(2).shape == (10, 4, 2, 8) and cache.value(0).dtype == torch.bfloat16
    # Under KV-head replication a rank holds one head: the same budget holds twice the blocks.
    assert layout(num_kv_heads=1).blocks_for_budget(10 * spec.bytes_per_block) == 20


def test_a_budget_below_one_block_is_refused_with_the_sizes() -> None:
    spec = layout()
    with pytest.raises(
        KVCacheError,
        match=rf"budget of {spec.bytes_per_block - 1} bytes cannot hold one block of "
        rf"{spec.bytes_per_block} bytes \(4 tokens × 3 layers × 2 KV heads",
    ):
        spec.blocks_for_budget(spec.bytes_per_block - 1)


def test_the_device_memory_budget_is_the_allowed_share_minus_what_is_in_use() -> None:
    gib = 1 << 30
    # 80 GiB device, 20 GiB held by the model and the LoRA slots: 0.9 allows 72 GiB, 52 are left.
    assert budget_from_device_memory(60 * gib, 80 * gib, 0.9) == int(0.9 * 80 * gib) - 20 * gib
    assert budget_from_device_memory(80 * gib, 80 * gib, 1.0) == 80 * gib
    # The same budget gives the same blocks as --kv-cache-bytes would.
    spec = layout()
    budget = budget_from_device_memory(10 * spec.bytes_per_block, 10 * spec.bytes_per_block, 0.5)
    assert spec.blocks_for_budget(budget) == 5


@pytest.mark.parametrize(
    ("free", "total", "utilization", "message"),
    [
        (10, 100, 0.5, r"allows 50 of the device's 100 bytes, but 90 are already in use"),
        (50, 100, 0.5, r"nothing is left for the KV cache"),
        (50, 100, 0.0, r"must be in \(0, 1\], got 0.0"),
        (50, 100, 1.5, r"must be in \(0, 1\], got 1.5"),
        (150, 100, 0.5, r"free 150, total 100"),
    ],
)
def test_a_device_memory_budget_that_leaves_nothing_is_refused(free: int, total: int, utilization: float, message: str) -> None:
    with pytest.raises(KVCacheError, match=message):
        budget_from_device_memory(free, total, utilization)


def test_layout_fields_are_validated_by_name() -> None:
    with pytest.raises(KVCacheError, match=r"KVCacheLayout\.num_kv_heads must be at least 1, got 0"):
        layout(num_kv_heads=0)


def test_write_stores_each_token_at_its_slot_in_its_layer_only() -> None:
    cache = PagedKVCache(layout(), 4, CPU)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    slots = torch.tensor([13, 2, 7], dtype=torch.int32)
    cache.write(1, slots, k, v)
    for token, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, 4)
        assert torch.equal(cache.key(1)[block, offset], k[token].to(torch.bfloat16))
        assert torch.equal(cache.value(1)[block, offset], v[token].to(torch.bfloat16))
    assert cache.key(1).count_nonzero() == k.numel()  # nothing else was touched
    assert cache.key(0).count_nonzero() == 0 and cache.value(2).count_nonzero() == 0
    with pytest.raises(KVCacheError, match=r"k, v \[T, 2, 8\]"):
        cache.write(0, slots, k[:, :1], v[:, :1])


def test_append_takes_a_block_at_each_boundary_and_maps_slots_into_it() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    allocator.add(0, None, [1, 2, 3])
    assert allocator.blocks_needed(0, 3) == 1
    assert allocator.append(0, [1, 2, 3]) == [0, 1, 2]
    assert allocator.blocks_needed(0, 1) == 0
    assert allocator.append(0, [4]) == [3]
    allocator.add(1, None, [9])
    assert allocator.append(1, [9]) == [4]  # block 1
    assert allocator.append(0, [5, 6, 7, 8, 9]) == [8, 9, 10, 11, 12]  # blocks 2 and 3
    assert allocator.block_table(0) == (0, 2, 3) and allocator.block_table(1) == (1,)
    assert allocator.num_tokens(0) == 9 and allocator.num_free_blocks == 4


def test_append_refuses_without_a_change_when_blocks_run_out() -> None:
    allocator = BlockAllocator(num_blocks=3, block_size=4)
    allocator.add(0, None, list(range(10)))
    assert allocator.append(0, list(range(10))) is not None
    before = (allocator.block_table(0), allocator.num_tokens(0), allocator.num_free_blocks)
    assert allocator.blocks_needed(0, 3) == 1
    assert allocator.append(0, [1, 2, 3]) is None
    assert (allocator.block_table(0), allocator.num_tokens(0), allocator.num_free_blocks) == before
    assert allocator.append(0, [1, 2]) == [10, 11]  # what still fits is given


def test_unknown_and_duplicate_sequences_are_errors() -> None:
    allocator = BlockAllocator(num_blocks=2, block_size=4)
    allocator.add(3, None, [1])
    with pytest.raises(KVCacheError, match="sequence 3 already has blocks"):
        allocator.add(3, None, [1])
    for call in (lambda: allocator.free(4), lambda: allocator.block_table(4), lambda: allocator.append(4, [1])):
        with pytest.raises(KVCacheError, match="sequence 4 has no blocks"):
            call()
    with pytest.raises(KVCacheError, match="at least one block"):
        BlockAllocator(num_blocks=0, block_size=4)


def prefilled(allocator: BlockAllocator, seq_id: int, adapter: AdapterKey, prompt: list[int]) -> int:
    """Admit, compute and write a whole prompt; returns the cached token count."""
    cached = allocator.add(seq_id, adapter, prompt)
    assert allocator.append(seq_id, prompt[cached:]) is not None
    allocator.mark_written(seq_id)
    return cached


def test_a_written_prefix_is_reused_in_whole_blocks_leaving_the_last_token() -> None:
    allocator = BlockAllocator(num_blocks=16, block_size=4, prefix_caching=True)
    prompt = list(range(100, 110))
    assert prefilled(allocator, 0, "a@1", prompt) == 0
    first = allocator.block_table(0)
    allocator.free(0)
    assert prefilled(allocator, 1, "a@1", prompt) == 8
    assert allocator.block_table(1)[:2] == first[:2]
    # A prompt of exactly two blocks reuses one: its last token must still be computed.
    assert prefilled(allocator, 2, "a@1", prompt[:8]) == 4
    # A longer prompt with the same start reuses the two full blocks; a diverging one only the first.
    assert allocator.add(3, "a@1", [*prompt, 7, 7, 7]) == 8
    assert allocator.add(4, "a@1", [*prompt[:5], 0, *prompt[6:]]) == 4


def test_a_cached_prefix_is_never_shared_across_adapters_or_with_the_base_model() -> None:
    allocator = BlockAllocator(num_blocks=32, block_size=4, prefix_caching=True)
    prompt = list(range(9))
    prefilled(allocator, 0, "a@1", prompt)
    for seq_id, adapter in enumerate([None, "b@1", "a@2", "a@1 ", ""], start=1):
        assert allocator.add(seq_id, adapter, prompt) == 0, adapter
    prefilled(allocator, 10, None, [*prompt, 1])
    assert allocator.add(11, None, prompt) == 8 and allocator.add(12, "a@1", prompt) == 8
    assert set(allocator.block_table(11)).isdisjoint(allocator.block_table(12))


def test_blocks_not_yet_written_are_never_shared() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=4, prefix_caching=True)
    prompt = list(range(9))
    allocator.add(0, None, prompt)
    allocator.append(0, prompt)  # slots handed out, KV not yet written
    assert allocator.add(1, None, prompt) == 0
    allocator.mark_written(0)
    assert allocator.add(2, None, prompt) == 8


def test_shared_blocks_are_reference_counted_then_evicted_oldest_tail_first() -> None:
    allocator = BlockAllocator(num_blocks=6, block_size=2, prefix_caching=True)
    prompt = [5, 6, 7, 8, 9, 10, 11]  # 3 full blocks + 1
    prefilled(allocator, 0, None, prompt)
    assert prefilled(allocator, 1, None, prompt) == 6
    shared = allocator.block_table(0)[:3]
    assert allocator.block_table(1)[:3] == shared
    allocator.free(0)
    assert allocator.num_free_blocks == 2  # block 5 and 0's private tail; the shared ones are held by 1
    allocator.free(1)
    assert allocator.num_free_blocks == 6 and allocator.num_cached_blocks == 3
    # Five new blocks: the 2 uncached ones, then cached ones, last block of the prefix first.
    allocator.add(2, "other", list(range(10)))
    assert allocator.append(2, list(range(10))) is not None
    assert allocator.num_cached_blocks == 1
    assert allocator.add(3, None, prompt) == 2  # only the first block of the prefix survived


def test_a_prefix_computed_twice_at_once_is_cached_once() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=4, prefix_caching=True)
    prompt = list(range(9))
    for seq_id in (0, 1):
        allocator.add(seq_id, None, prompt)
        allocator.append(seq_id, prompt)
    for seq_id in (0, 1):
        allocator.mark_written(seq_id)
    assert allocator.num_cached_blocks == 2
    allocator.free(0)
    allocator.free(1)
    assert allocator.num_free_blocks == 8 and allocator.add(2, None, prompt) == 8


def test_without_prefix_caching_nothing_is_reused() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    prefilled(allocator, 0, None, list(range(9)))
    allocator.free(0)
    assert prefilled(allocator, 1, None, list(range(9))) == 0 and allocator.num_cached_blocks == 0


def run_workload(allocator: BlockAllocator, seed: int, steps: int = 400) -> list[tuple[int, ...]]:
    """Random admissions, chunks, decodes, and releases (finish, cancel, preemption all `free`).

    Prompts come from a few shared stems and adapters so prefixes hit. After every step the
    books must balance. Returns every block table handed out, in order.
    """
    rng = random.Random(seed)
    adapters: list[AdapterKey] = [None, "a@1", "b@1"]
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: dict[int, tuple[list[int], int]] = {}  # seq -> (its tokens, how many have slots)
    tables: list[tuple[int, ...]] = []
    next_id = 0
    for _ in range(steps):
        action = rng.random()
        if action < 0.3 or not live:
            prompt = rng.choice(stems)[: rng.randrange(1, 13)] + [rng.randrange(50) for _ in range(rng.randrange(4))]
            cached = allocator.add(next_id, rng.choice(adapters), prompt)
            assert cached % allocator.block_size == 0 and cached < len(prompt)
            live[next_id] = (prompt, cached)
            next_id += 1
        elif action < 0.8:
            seq = rng.choice(sorted(live))
            tokens, done = live[seq]
            if done == len(tokens):
                tokens.append(rng.randrange(50))  # a decode step: the sampled token
            new = tokens[done : done + rng.randrange(1, 6)]
            slots = allocator.append(seq, new)
            if slots is None:  # out of blocks: preempt it (by recompute, later)
                allocator.free(seq)
                del live[seq]
            else:
                assert all(s // allocator.block_size in allocator.block_table(seq) for s in slots)
                allocator.mark_written(seq)
                live[seq] = (tokens, done + len(new))
                tables.append(allocator.block_table(seq))
        else:
            seq = rng.choice(sorted(live))
            allocator.free(seq)
            del live[seq]
        check_books(allocator, live)
    for seq in sorted(live):
        allocator.free(seq)
    return tables


def check_books(allocator: BlockAllocator, live: dict[int, tuple[list[int], int]]) -> None:
    held = Counter(block for seq in live for block in allocator.block_table(seq))
    for seq, (_, done) in live.items():
        assert allocator.num_tokens(seq) == done
        assert len(allocator.block_table(seq)) == -(-done // allocator.block_size)
    assert allocator.num_free_blocks + len(held) == allocator.num_blocks
    shared = [block for block, count in held.items() if count > 1]
    assert allocator.prefix_caching or not shared  # only cached prefixes are ever shared


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_every_block_is_free_after_a_random_workload(prefix_caching: bool) -> None:
    allocator = BlockAllocator(num_blocks=12, block_size=4, prefix_caching=prefix_caching)
    run_workload(allocator, seed=7)
    assert allocator.num_free_blocks == allocator.num_blocks


def test_the_same_calls_give_the_same_blocks_in_any_process() -> None:
    """Ranks never compute block tables themselves, but the driver's decisions must not depend
    on hash randomisation either: an interpreter with another hash seed agrees with this one."""
    here = run_workload(BlockAllocator(num_blocks=12, block_size=4, prefix_caching=True), seed=3)
    script = (
        "from node_agent.engine.serving.kv_cache import BlockAllocator\n"
        "from tests.serving.test_kv_cache import run_workload\n"
        "print(run_workload(BlockAllocator(num_blocks=12, block_size=4, prefix_caching=True), seed=3))\n"
    )
    other_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONHASHSEED": other_seed},
    )
    assert result.stdout.strip() == str(here)
