"""Attention over the paged KV cache (docs/serving.md): torch paths and the decode dispatch.

Shapes, for one attention group's step on one rank:

* `q`: `[T, num_heads, head_dim]`, the step's new tokens, sequence after sequence;
* `key_cache`, `value_cache`: one layer of `PagedKVCache`, `[num_blocks, block_size,
  num_kv_heads, head_dim]`, already holding the new tokens' K and V (write, then attend);
* `block_tables`: int32 `[num_seqs, max_blocks]`, a sequence's blocks in token order, padded
  with any valid block id (padding is never read unmasked);
* `context_lens`: per sequence, its tokens in the cache including this step's.

GQA: query head `h` reads KV head `h // (num_heads // num_kv_heads)`, as transformers'
`repeat_kv` does. Prefill runs on the torch path everywhere for now; decode goes to the triton
kernel on CUDA (`dispatch.paged_decode`, the same rule as shrink/expand).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PagedLayer:
    """One layer of the paged KV cache (`key_cache`, `value_cache`) and the `block_tables` a
    batch reads it through (the shapes above)."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor


def check_inputs(q: torch.Tensor, cache: PagedLayer) -> None:
    """The shapes above, for every path (torch prefill and decode, the triton decode)."""
    key_cache, value_cache, block_tables = cache.key_cache, cache.value_cache, cache.block_tables
    if key_cache.shape != value_cache.shape or key_cache.dim() != 4:
        raise ValueError(f"caches must be [num_blocks, block_size, kv_heads, head_dim], got {tuple(key_cache.shape)}")
    if q.dim() != 3 or q.shape[2] != key_cache.shape[3] or q.shape[1] % key_cache.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} must be [T, heads, {key_cache.shape[3]}] with heads a multiple of the {key_cache.shape[2]} KV heads"
        )
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}")


def gather_kv(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens held in `blocks` of one layer's cache, `[length, kv_heads, head_dim]`."""
    block_size = cache.shape[1]
    used = blocks[: -(-length // block_size)].to(torch.int64)
    return cache[used].flatten(0, 1)[:length]


def prefill(q: torch.Tensor, cache: PagedLayer, query_lens: Sequence[int], context_lens: Sequence[int], scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and themselves.

    Sequence `i` owns the next `query_lens[i]` rows of `q`; they are its last tokens, at
    positions `context_lens[i] - query_lens[i] ...`, and each attends to every token up to its
    own position (so a chunk of a chunked prefill sees all earlier chunks). Returns `q`'s shape.

    Consecutive sequences with the same new and context lengths (the prompts of equal length
    that a batch of requests starts with) share one gather and one SDPA call, each sequence a
    batch entry: SDPA computes every (sequence, head) on its own, so the result is the same as
    one call per sequence, for fewer ops (a 256-row prefill of 8 prompts: 4 calls, not 32).
    """
    check_inputs(q, cache)
    if len(query_lens) != len(context_lens) or sum(query_lens) != q.shape[0]:
        raise ValueError(f"query_lens {list(query_lens)} must cover q's {q.shape[0]} rows, one per context length")
    for index, (new, total) in enumerate(zip(query_lens, context_lens, strict=True)):
        if not 0 <= new <= total:
            raise ValueError(f"sequence {index}: {new} new tokens but a context of {total}")
    out = torch.empty_like(q)
    start = 0
    for first, count in equal_runs(query_lens, context_lens):
        new, total = query_lens[first], context_lens[first]
        rows = new * count
        if new:
            tables = cache.block_tables[first : first + count]
            k, v = gather_many(cache.key_cache, tables, total), gather_many(cache.value_cache, tables, total)
            out[start : start + rows] = _causal(q[start : start + rows].view(count, new, *q.shape[1:]), k, v, scale).flatten(0, 1)
        start += rows
    return out


def equal_runs(query_lens: Sequence[int], context_lens: Sequence[int]) -> list[tuple[int, int]]:
    """(first sequence, count) of each run of consecutive sequences with equal new and context lengths."""
    runs: list[tuple[int, int]] = []
    for index, lengths in enumerate(zip(query_lens, context_lens, strict=True)):
        if runs and (query_lens[runs[-1][0]], context_lens[runs[-1][0]]) == lengths:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs


def gather_many(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of each sequence of `block_tables` (every row at least that
    long), `[num_seqs, length, kv_heads, head_dim]`, by one `index_select` of their blocks."""
    block_size = cache.shape[1]
    used = -(-length // block_size)
    blocks = cache.index_select(0, block_tables[:, :used].reshape(-1))
    return blocks.view(block_tables.shape[0], used * block_size, *cache.shape[2:])[:, :length]


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Sequences' `new` query rows (their last tokens) over their `total` keys, in fp32, as `q`'s
    dtype: `q` `[seqs, new, heads, dk]`, `k` `[seqs, total, kv_heads, dk]`, `v` `[seqs, total,
    kv_heads, dv]`; returns `[seqs, new, heads, dv]`.

    Bottom-right aligned causal mask: query r sits at position total - new + r. (SDPA's is_causal
    aligns top-left, which is only right when nothing is cached.)
    """
    new, total = q.shape[1], k.shape[1]
    positions = torch.arange(total - new, total, device=q.device)
    mask = torch.arange(total, device=q.device)[None, :] <= positions[:, None]
    attended = F.scaled_dot_product_attention(
        _fp32(q.transpose(1, 2)),
        _fp32(k.transpose(1, 2)),
        _fp32(v.transpose(1, 2)),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    out = attended.transpose(1, 2)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def gather_contexts(cache: torch.Tensor, block_tables: torch.Tensor, context_lens: Sequence[int]) -> torch.Tensor:
    """Every listed sequence's cached tokens, sequence after sequence: `[sum(context_lens), *cache.shape[2:]]`."""
    parts = [gather_kv(cache, block_tables[index], total) for index, total in enumerate(context_lens)]
    return torch.cat(parts) if parts else cache.new_zeros((0, *cache.shape[2:]))


def prefill_gathered(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """`prefill` over keys and values already gathered and expanded per sequence (MLA expands its
    cached latent into every head's K and V each step): `keys` `[sum(context_lens), heads, dk]`,
    `values` `[sum(context_lens), heads, dv]` (dv may differ from dk). Returns `[T, heads, dv]`."""
    if len(query_lens) != len(context_lens) or sum(query_lens) != q.shape[0] or sum(context_lens) != keys.shape[0]:
        raise ValueError(
            f"query_lens {list(query_lens)} / context_lens {list(context_lens)} must cover q's "
            f"{q.shape[0]} and the keys' {keys.shape[0]} rows"
        )
    out = q.new_empty((q.shape[0], q.shape[1], values.shape[2]))
    start = first = 0
    for index, (new, total) in enumerate(zip(query_lens, context_lens, strict=True)):
        if not 0 < new <= total:
            raise ValueError(f"sequence {index}: {new} new tokens but a context of {total}")
        out[start : start + new] = _causal(
            q[None, start : start + new], keys[None, first : first + total], values[None, first : first + total], scale
        )[0]
        start, first = start + new, first + total
    return out


def decode_torch(
    q: torch.Tensor, cache: PagedLayer, context_lens: torch.Tensor, scale: float, first_block: int | None = None
) -> torch.Tensor:
    """One query token per sequence (`q` `[num_seqs, heads, head_dim]`) over its whole context.

    Batched over sequences: every context is gathered to the longest one, and the rest masked
    when the lengths differ. Each KV head's group of query heads are its query rows in one SDPA
    call (no repeat of K/V, no causal mask: a decode token sees its whole context). Each context
    length must be at least 1 (the token itself). Computes in fp32.

    `first_block`: given for one sequence whose blocks are `first_block, first_block + 1, ...`
    (`consecutive_blocks`), whose context is then read as a view of the cache instead of a
    gathered copy: the same values in the same order, so the same result.
    """
    check_inputs(q, cache)
    key_cache, value_cache = cache.key_cache, cache.value_cache
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return torch.empty_like(q)
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    lengths = context_lens.tolist()
    longest = max(lengths)
    used = -(-longest // block_size)
    if first_block is not None and num_seqs == 1:
        # A lone decoding sequence (the single stream) usually holds consecutive blocks (the
        # free list is FIFO): two gathers a layer fewer, each a copy of its whole context.
        k = _fp32_heads(key_cache[first_block : first_block + used], 1, longest)
        v = _fp32_heads(value_cache[first_block : first_block + used], 1, longest)
    else:
        # `index_select` over the flat table, not `cache[tables]`: the same copy in a quarter of
        # the time (advanced indexing of a 4-d tensor takes its general path; docs/kernels.md).
        blocks = cache.block_tables[:, :used].reshape(-1)
        k = _fp32_heads(key_cache.index_select(0, blocks), num_seqs, longest)
        v = _fp32_heads(value_cache.index_select(0, blocks), num_seqs, longest)
    mask = None
    if min(lengths) < longest:
        within = torch.arange(longest, device=q.device)[None, :] < context_lens.to(q.device)[:, None]
        mask = within[:, None, None, :]
    grouped = _fp32(q.reshape(num_seqs, kv_heads, num_heads // kv_heads, head_dim))
    attended = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    out = attended.reshape(num_seqs, num_heads, head_dim)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def consecutive_blocks(block_tables: torch.Tensor, context_lens: Sequence[int], block_size: int) -> int | None:
    """The first block of a lone sequence whose used blocks are consecutive (`decode_torch`'s
    `first_block`); None for several sequences, other tables, or tables not on the CPU (the
    triton kernel reads the table itself, and reading it here would wait for the device)."""
    if len(context_lens) != 1 or block_tables.device.type != "cpu" or block_tables.shape[0] != 1:
        return None
    used = -(-context_lens[0] // block_size)
    row = block_tables[0, :used].tolist()
    first = row[0] if row else None
    return first if first is not None and row == list(range(first, first + used)) else None


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """`t` in fp32 (itself when it is already: no op dispatched; these run in every layer)."""
    return t if t.dtype == torch.float32 else t.float()


def _fp32_heads(rows: torch.Tensor, num_seqs: int, longest: int) -> torch.Tensor:
    """Blocks `[num_seqs · blocks, block_size, kv_heads, head_dim]` (a sequence's blocks in
    order) as `[num_seqs, kv_heads, longest, head_dim]` fp32 (a view where the cache is fp32)."""
    per_seq = rows.view(num_seqs, -1, *rows.shape[2:])
    return _fp32(per_seq[:, :longest].transpose(1, 2))
