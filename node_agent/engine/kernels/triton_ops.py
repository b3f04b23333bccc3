"""Triton shrink/expand kernels for multi-adapter batches (docs/design.md §5; docs/kernels.md).

Same semantics as `torch_ops`, which stays the oracle. One launch per call covers every segment
and every output slice: the slices' stacks are described by a small int64 table (element offset
from the first stack, slot stride, row stride, width, output column offset per slice), so slices
of unequal width (q/k/v under GQA) need neither a concatenation of the weights nor one launch per
slice.

The kernel functions below are plain Python, wrapped by `triton.jit` lazily, once per
interpreter mode (`triton_launch.jitted`).
"""

# The kernel functions are triton DSL: their pointer and size arguments have no Python type, only
# the constexprs are annotated, so this module allows partly annotated definitions.

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from node_agent.engine.kernels import triton_launch
from node_agent.engine.kernels.batch import LoraBatch


def _shrink_kernel(
    x_ptr,
    a_base_ptr,  # the first A stack; the table locates every slice relative to it
    table_ptr,
    out_ptr,
    seg_starts_ptr,
    seg_lens_ptr,
    seg_slots_ptr,
    K,
    R,
    stride_xm,
    stride_xk,
    stride_os,
    stride_om,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    ALIGN: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """out[slice, t, :R] (+)= x[t] · A_slice[slot]ᵀ for the tokens of one (segment, row block).

    Grid: (segment, row block of BLOCK_M tokens, slice * SPLIT_K + k split).
    """
    seg = tl.program_id(0)
    m_block = tl.program_id(1)
    slice_id = tl.program_id(2) // SPLIT_K
    k_split = tl.program_id(2) % SPLIT_K

    slot = tl.load(seg_slots_ptr + seg)
    seg_len = tl.load(seg_lens_ptr + seg)
    # Untargeted tokens keep the zeros the host allocated; row blocks past this segment's end
    # exist only because the grid is sized by the longest segment.
    if slot < 0 or m_block * BLOCK_M >= seg_len:
        return
    seg_start = tl.load(seg_starts_ptr + seg)

    entry = table_ptr + slice_id * 5
    # ALIGN (elements) is > 1 only when the host checked every offset and stride: with the base
    # pointer's alignment, which the JIT knows, these hints allow 16-byte vector loads of A.
    stack_offset = tl.multiple_of(tl.load(entry + 0), ALIGN)
    slot_stride = tl.multiple_of(tl.load(entry + 1), ALIGN)
    row_stride = tl.multiple_of(tl.load(entry + 2), ALIGN)
    a_ptr = a_base_ptr + (stack_offset + slot.to(tl.int64) * slot_stride)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    rows = (seg_start + offs_m).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    offs_k = tl.arange(0, BLOCK_K)

    x_rows = x_ptr + rows[:, None] * stride_xm
    a_rows = a_ptr + offs_r[None, :].to(tl.int64) * row_stride

    # tl.full, not tl.zeros: tl.zeros is itself a @jit function, fixed to compiled mode when
    # triton was imported without the interpreter, so the interpreter could not call it.
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    k_begin = k_split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_idx = k0 + offs_k
        k_mask = k_idx < k_end
        x_tile = tl.load(x_rows + k_idx[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a_tile = tl.load(a_rows + k_idx[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(x_tile.to(tl.float32), a_tile.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x_tile, a_tile, acc)

    out_ptrs = out_ptr + slice_id * stride_os + rows[:, None] * stride_om + offs_r[None, :]
    out_mask = m_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)


def _expand_kernel(
    y_ptr,
    b_base_ptr,  # the first B stack; the table locates every slice relative to it
    table_ptr,
    scales_ptr,
    out_ptr,
    seg_starts_ptr,
    seg_lens_ptr,
    seg_slots_ptr,
    R,
    n_blocks,
    stride_ys,
    stride_ym,
    stride_yr,
    stride_ss,
    stride_sslot,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ALIGN: tl.constexpr,
    OUT_ALIGN: tl.constexpr,
    DOT_F32: tl.constexpr,
    SPLIT_Y: tl.constexpr,
):
    """out[t, off + n] += scale · y[slice, t] · B_slice[slot, n]ᵀ for one (segment, row block,
    slice, column block).

    Grid: (segment, row block of BLOCK_M tokens, slice * n_blocks + column block), n_blocks
    sized by the widest slice; blocks past a narrower slice's width return at once.
    """
    seg = tl.program_id(0)
    m_block = tl.program_id(1)
    slice_id = tl.program_id(2) // n_blocks
    n_block = tl.program_id(2) % n_blocks

    slot = tl.load(seg_slots_ptr + seg)
    seg_len = tl.load(seg_lens_ptr + seg)
    if slot < 0 or m_block * BLOCK_M >= seg_len:
        return
    entry = table_ptr + slice_id * 5
    # OUT_ALIGN also vouches for the width: a mask constant over a whole vector is what lets the
    # read-modify-write of `out` use 16-byte accesses.
    width = tl.multiple_of(tl.load(entry + 3), OUT_ALIGN)
    if n_block * BLOCK_N >= width:
        return
    seg_start = tl.load(seg_starts_ptr + seg)
    col_offset = tl.multiple_of(tl.load(entry + 4), OUT_ALIGN)

    b_dtype = b_base_ptr.dtype.element_ty
    stack_offset = tl.multiple_of(tl.load(entry + 0), ALIGN)
    slot_stride = tl.multiple_of(tl.load(entry + 1), ALIGN)
    row_stride = tl.multiple_of(tl.load(entry + 2), ALIGN)
    b_ptr = b_base_ptr + (stack_offset + slot.to(tl.int64) * slot_stride)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    rows = (seg_start + offs_m).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width

    y_tile = tl.load(
        y_ptr + slice_id * stride_ys + rows[:, None] * stride_ym + offs_r[None, :] * stride_yr,
        mask=m_mask[:, None] & r_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    b_tile = tl.load(
        b_ptr + offs_n[None, :].to(tl.int64) * row_stride + offs_r[:, None],
        mask=r_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
    if SPLIT_Y:
        # y is fp32 but B is 16-bit: y = hi + lo in B's dtype keeps ~16 mantissa bits of y
        # while both products still run on 16-bit tensor cores (a plain cast keeps only 8).
        y_hi = y_tile.to(b_dtype)
        y_lo = (y_tile - y_hi.to(tl.float32)).to(b_dtype)
        if DOT_F32:
            # The interpreter's 16-bit dot is unreliable (bf16 is stored as raw uint16 there).
            b32 = b_tile.to(tl.float32)
            acc = tl.dot(y_hi.to(tl.float32), b32, input_precision="ieee")
            acc = tl.dot(y_lo.to(tl.float32), b32, acc, input_precision="ieee")
        else:
            acc = tl.dot(y_hi, b_tile)
            acc = tl.dot(y_lo, b_tile, acc)
    else:
        acc = tl.dot(y_tile, b_tile.to(tl.float32), input_precision="ieee")

    scale = tl.load(scales_ptr + slice_id * stride_ss + slot * stride_sslot).to(tl.float32)
    out_ptrs = out_ptr + rows[:, None] * stride_om + (col_offset + offs_n)[None, :] * stride_on
    out_mask = m_mask[:, None] & n_mask[None, :]
    current = tl.load(out_ptrs, mask=out_mask, other=0.0)
    tl.store(out_ptrs, (current.to(tl.float32) + acc * scale).to(out_ptr.dtype.element_ty), mask=out_mask)


def shrink(
    x: torch.Tensor,
    a_stacks: Sequence[torch.Tensor],
    batch: LoraBatch,
    *,
    split_k: int | None = None,
) -> torch.Tensor:
    """See `torch_ops.shrink`: returns fp32 [n_slices, T, R], zero where the slot is −1.

    split_k (tests, tuning) overrides how many programs share one row block's K loop; > 1 makes
    them accumulate with fp32 atomics into the zeroed output.
    """
    triton_launch.check_stacks(a_stacks, "shrink", x.device)
    a_stacks = triton_launch.inner_contiguous(a_stacks)
    num_slices = len(a_stacks)
    rank, in_features = a_stacks[0].shape[1], a_stacks[0].shape[2]
    if any(a.shape[1:] != a_stacks[0].shape[1:] for a in a_stacks):
        raise ValueError("shrink: all A stacks must be [num_slots, R, in] with one R and one in")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"shrink: x must be [T, {in_features}], got {tuple(x.shape)}")
    tokens = x.shape[0]
    triton_launch.check_batch(batch, tokens, x.device)
    out = torch.zeros(num_slices, tokens, rank, dtype=torch.float32, device=x.device)
    if tokens == 0 or not batch.active_slots:
        return out

    block_m = triton_launch.block_m_for(batch.max_seg_len)
    block_r = max(16, triton_launch.next_pow2(rank))
    block_k = triton_launch.shrink_block_k(block_m, block_r, max(x.element_size(), a_stacks[0].element_size()), in_features)
    m_blocks = triton.cdiv(batch.max_seg_len, block_m)
    num_segments = int(batch.seg_starts.shape[0])
    if split_k is None:
        split_k = triton_launch.default_split_k(num_segments * m_blocks * num_slices, in_features, block_k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    split_k = triton.cdiv(in_features, k_per_split)  # never launch splits with no K to do

    table, align = triton_launch.slice_table(a_stacks, x.device)
    kernel = triton_launch.jitted(_shrink_kernel, triton_launch.interpreting())
    grid = (num_segments, m_blocks, num_slices * split_k)
    kernel[grid](
        x,
        a_stacks[0],
        table,
        out,
        batch.seg_starts,
        batch.seg_lens,
        batch.seg_slots,
        in_features,
        rank,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        k_per_split,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        ALIGN=align,
        DOT_F32=triton_launch.dot_f32(x.dtype, a_stacks[0].dtype),
    )
    return out


def expand(
    y: torch.Tensor,
    b_stacks: Sequence[torch.Tensor],
    scales: torch.Tensor,
    batch: LoraBatch,
    out: torch.Tensor,
) -> None:
    """See `torch_ops.expand`: out[:, block_i] += y[i] · B_i[slot]ᵀ · scales[i, slot], in place.

    Accumulates in fp32 and rounds once into `out`'s dtype (fp32, bf16 or fp16).
    """
    triton_launch.check_stacks(b_stacks, "expand", out.device)
    b_stacks = triton_launch.inner_contiguous(b_stacks)
    num_slices = len(b_stacks)
    rank = b_stacks[0].shape[2]
    widths = [b.shape[1] for b in b_stacks]
    if any(b.shape[2] != rank for b in b_stacks):
        raise ValueError("expand: all B stacks must share the rank dim")
    tokens = out.shape[0]
    if y.shape != (num_slices, tokens, rank) or y.device != out.device:
        raise ValueError(f"expand: y must be [{num_slices}, {tokens}, {rank}] on {out.device}, got {tuple(y.shape)}")
    if out.dim() != 2 or out.shape[1] != sum(widths):
        raise ValueError(f"expand: out must be [T, {sum(widths)}], got {tuple(out.shape)}")
    if scales.shape != (num_slices, b_stacks[0].shape[0]):
        raise ValueError(f"expand: scales must be [{num_slices}, {b_stacks[0].shape[0]}], got {tuple(scales.shape)}")
    triton_launch.check_batch(batch, tokens, out.device)
    if tokens == 0 or not batch.active_slots:
        return

    block_r = max(16, triton_launch.next_pow2(rank))
    # The fp32 y tile [BLOCK_M, BLOCK_R] and its two 16-bit halves live in registers: fewer rows
    # and a narrower column block as R grows.
    block_m = min(triton_launch.block_m_for(batch.max_seg_len), 64 if block_r <= 64 else 32)
    block_n = max(16, min(128 if block_r <= 64 else 64, triton_launch.next_pow2(max(widths))))
    n_blocks = triton.cdiv(max(widths), block_n)
    m_blocks = triton.cdiv(batch.max_seg_len, block_m)
    num_segments = int(batch.seg_starts.shape[0])

    table, align = triton_launch.slice_table(b_stacks, out.device)
    b_dtype = b_stacks[0].dtype
    kernel = triton_launch.jitted(_expand_kernel, triton_launch.interpreting())
    grid = (num_segments, m_blocks, num_slices * n_blocks)
    kernel[grid](
        y,
        b_stacks[0],
        table,
        scales,
        out,
        batch.seg_starts,
        batch.seg_lens,
        batch.seg_slots,
        rank,
        n_blocks,
        y.stride(0),
        y.stride(1),
        y.stride(2),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        ALIGN=align,
        OUT_ALIGN=triton_launch.out_align(out, widths),
        DOT_F32=triton_launch.interpreting() or b_dtype not in triton_launch.SIXTEEN_BIT,
        SPLIT_Y=b_dtype in triton_launch.SIXTEEN_BIT,
    )
