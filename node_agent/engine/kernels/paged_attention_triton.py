"""Triton paged-decode attention (docs/serving.md): `paged_attention.decode_torch`'s semantics.

One program per (sequence, KV head) computes all query heads of that KV head's GQA group, so
each K/V tile is loaded once for the whole group. It walks the context in tiles of `BLOCK_N`
tokens; each token's page comes from the block table (`position // page_size`), so a tile may
span pages and the page size need not be a power of two or a tile multiple. Softmax is online
(running max and sum in fp32, exp2 with the scale folded in). The group's heads are padded to
16 rows, the smallest `tl.dot`.

No split of the context over programs yet (flash-decoding): with few sequences and long contexts
a GPU would be under-occupied; that comes with GPU measurements.

As in `triton_ops`, the kernel is plain Python wrapped by `triton.jit` lazily, once per
interpreter mode (`triton_launch.jitted`), so the CPU tests can switch `TRITON_INTERPRET` per
test. Its runtime arguments are annotated `tl.tensor` (what they are inside the kernel; triton's
specialisation ignores the annotation, and the compiler can resolve it), which keeps the module
under mypy's strict rules.
"""

import torch
import triton.language as tl

from node_agent.engine.kernels import paged_attention, triton_launch

_LOG2E = 1.4426950408889634
# Row max and sum through `tl.reduce` with triton's own combine functions, not `tl.max` /
# `tl.sum`: those are @jit helpers, fixed to compiled mode when triton was imported without the
# interpreter (like `tl.zeros`), while the interpreter's `tl.reduce` recognises these two.
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


def _paged_decode_kernel(
    q_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    block_tables_ptr: tl.tensor,
    context_lens_ptr: tl.tensor,
    out_ptr: tl.tensor,
    qk_scale: tl.tensor,  # softmax scale × log2(e)
    stride_qs: tl.tensor,
    stride_qh: tl.tensor,
    stride_kb: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    stride_vb: tl.tensor,
    stride_vt: tl.tensor,
    stride_vh: tl.tensor,
    stride_bt: tl.tensor,
    stride_os: tl.tensor,
    stride_oh: tl.tensor,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
) -> None:
    """out[seq, heads of kv_head] = softmax(q kᵀ · scale) v over the sequence's context.

    Grid: (sequence, KV head).
    """
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = (kv_head * GROUP + offs_g).to(tl.int64)
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    # tl.full, not tl.zeros: tl.zeros is a @jit helper fixed to compiled mode when triton was
    # imported without the interpreter (see triton_ops).
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_G,), 0.0, tl.float32)
    acc = tl.full((BLOCK_G, BLOCK_D), 0.0, tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    for start in range(0, context_len, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < context_len
        page = tl.load(table + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        within = (pos % PAGE_SIZE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_head + (page * stride_kb + within * stride_kt)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_head + (page * stride_vb + within * stride_vt)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(n_mask[None, :], scores * qk_scale, float("-inf"))
        # Every tile holds at least one real token, so m_new is finite and alpha is exp2(-inf) = 0
        # only on the first tile.
        m_new = tl.maximum(m_i, tl.reduce(scores, 1, _MAX))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / l_i[:, None]
    out_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def decode(
    q: torch.Tensor, cache: paged_attention.PagedLayer, context_lens: torch.Tensor, scale: float, *, block_n: int = 64
) -> torch.Tensor:
    """See `paged_attention.decode_torch`. `block_n` (tests, tuning): context tokens per tile, a
    power of two ≥ 16. Accumulates in fp32 and rounds once into `q`'s dtype."""
    paged_attention.check_inputs(q, cache)
    key_cache, value_cache, block_tables = cache.key_cache, cache.value_cache, cache.block_tables
    num_seqs, num_heads, head_dim = q.shape
    page_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
            f"must have one row per sequence ({num_seqs})"
        )
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two of at least 16, got {block_n}")
    # The kernel addresses head_dim (and a block table row) with unit stride.
    q, key_cache, value_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, key_cache, value_cache))
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    same16 = q.dtype == key_cache.dtype == value_cache.dtype and q.dtype in triton_launch.SIXTEEN_BIT
    kernel = triton_launch.jitted(_paged_decode_kernel, triton_launch.interpreting())
    kernel[(num_seqs, kv_heads)](
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        out,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_G=max(16, triton_launch.next_pow2(num_heads // kv_heads)),
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton_launch.next_pow2(head_dim)),
        # The interpreter's 16-bit dot is wrong (bf16 is held as raw uint16 there); fp32 operands
        # must not take triton's default tf32.
        DOT_F32=triton_launch.interpreting() or not same16,
    )
    return out
