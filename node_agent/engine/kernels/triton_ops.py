"""Triton shrink/expand kernels for multi-adapter batches (docs/design.md §5; docs/kernels.md).

Same semantics as `torch_ops`, which stays the oracle. One launch per call covers every segment
and every output slice: the slices' stacks are described by a small int64 table (element offset
from the first stack, slot stride, row stride, width, output column offset per slice), so slices
of unequal width (q/k/v under GQA) need neither a concatenation of the weights nor one launch per
slice.

The kernel functions below are plain Python and are wrapped by `triton.jit` lazily, once per
interpreter mode (`TRITON_INTERPRET`). That lets the CPU tests switch the interpreter on per
test without caring whether this module was imported earlier in the process.
"""

# The kernel functions are triton DSL: their pointer and size arguments have no Python type, only
# the constexprs are annotated, so this module allows partly annotated definitions.

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from node_agent.engine.kernels.batch import LoraBatch

log = logging.getLogger(__name__)

# Stack dtypes that take tensor-core dots (and, for B, the split of y into two halves).
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


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


def interpreting() -> bool:
    """Whether triton runs kernels in its CPU interpreter (`TRITON_INTERPRET`), read per call."""
    return bool(triton.knobs.runtime.interpret)


@functools.cache
def _jitted(fn: Callable[..., None], interpret: bool) -> Any:
    """`triton.jit(fn)` decides between compiler and interpreter when it runs, so wrap per mode.

    Returns a JITFunction, or an InterpretedFunction under the interpreter.
    """
    del interpret  # only part of the cache key
    return triton.jit(fn)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _next_pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def _block_m(max_seg_len: int) -> int:
    """Token rows per program: 16 (the smallest dot) for decode, up to 64 for prefill."""
    return min(64, max(16, _next_pow2(max_seg_len)))


def _shrink_block_k(block_m: int, block_r: int, element_size: int, in_features: int) -> int:
    """K tile such that one pipeline stage (x tile + A tile) is at most 32 KiB.

    Three stages then stay under 100 KiB of shared memory for every dtype and tile shape, well
    inside Hopper's 227 KiB, while 16-bit decode tiles still get 256-wide K steps.
    """
    fits = 32768 // ((block_m + block_r) * element_size)
    block_k = 1 << (fits.bit_length() - 1)  # largest power of two <= fits
    return max(16, min(256, block_k, _next_pow2(in_features)))


def _inner_contiguous(stacks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The kernels assume the last dim of every stack is contiguous; copy (rarely) if not."""
    fixed = []
    for stack in stacks:
        if stack.stride(-1) != 1:
            log.debug("LoRA stack %s has a strided last dim; copying it for the kernel", tuple(stack.shape))
        fixed.append(stack if stack.stride(-1) == 1 else stack.contiguous())
    return fixed


def _check_stacks(stacks: Sequence[torch.Tensor], what: str, device: torch.device) -> None:
    if len(stacks) == 0:
        raise ValueError(f"{what}: at least one slice is required")
    first = stacks[0]
    for stack in stacks:
        if stack.dim() != 3:
            raise ValueError(f"{what}: each stack must be [num_slots, rows, cols], got {tuple(stack.shape)}")
        if stack.dtype != first.dtype or stack.device != device or stack.shape[0] != first.shape[0]:
            raise ValueError(f"{what}: slices differ in dtype, device or slot count, or are not on {device}")


def _check_batch(batch: LoraBatch, tokens: int, device: torch.device) -> None:
    if batch.num_tokens != tokens:
        raise ValueError(f"batch has {batch.num_tokens} tokens, the activations {tokens}")
    if batch.seg_slots.device != device:
        raise ValueError(f"batch is on {batch.seg_slots.device}, the activations on {device}")


# Tables of persistent buffers are cached: pool stacks live for the engine's lifetime, and a
# host-to-device copy per layer per step would cost more than the kernel. The key holds every
# value the table is built from, so a hit is correct even if the address was reused.
_TABLE_CACHE: dict[tuple[object, ...], torch.Tensor] = {}
_TABLE_CACHE_LIMIT = 1024


def _slice_table(stacks: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, int]:
    """The per-slice int64 table, and ALIGN: the element multiple every offset/stride shares.

    Row i: (element offset of stack i from stack 0, slot stride, row stride, width, first output
    column); the kernels read it by these literal column numbers (0..4).

    A slice is located by its element offset from the first stack (a real pointer argument)
    rather than by a raw address: the compiler then knows the base's 16-byte alignment and, with
    the ALIGN hint, can issue vector loads; through an integer-to-pointer cast it cannot.
    """
    element = stacks[0].element_size()
    base = stacks[0].data_ptr()
    rows = []
    offset = 0
    for stack in stacks:
        distance = stack.data_ptr() - base
        if distance % element:
            raise ValueError("LoRA stacks must be aligned to their element size")
        width = stack.shape[1]
        rows.append((distance // element, stack.stride(0), stack.stride(1), width, offset))
        offset += width
    vector = max(1, 16 // element)  # elements in one 16-byte load
    aligned = base % 16 == 0 and all(v % vector == 0 for row in rows for v in row[:3])
    key = (device, base, tuple(rows))
    table = _TABLE_CACHE.get(key) if device.type == "cuda" else None
    if table is None:
        table = torch.tensor(rows, dtype=torch.int64).to(device)
        if device.type == "cuda":
            if len(_TABLE_CACHE) >= _TABLE_CACHE_LIMIT:
                _TABLE_CACHE.clear()
            _TABLE_CACHE[key] = table
    return table, vector if aligned else 1


def _out_align(out: torch.Tensor, widths: Sequence[int]) -> int:
    """Element multiple shared by every slice's width and first output column (16-byte access)."""
    vector = max(1, 16 // out.element_size())
    aligned = out.data_ptr() % 16 == 0 and all(width % vector == 0 for width in widths)
    return vector if aligned and out.stride(1) == 1 else 1


def _dot_f32(*dtypes: torch.dtype) -> bool:
    """Use an exact fp32 dot unless both operands share one 16-bit dtype on real hardware.

    fp32 operands must not silently take triton's default tf32 path; the interpreter needs fp32
    because its bf16 dot is wrong.
    """
    same16 = len(set(dtypes)) == 1 and dtypes[0] in _SIXTEEN_BIT
    return interpreting() or not same16


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
    _check_stacks(a_stacks, "shrink", x.device)
    a_stacks = _inner_contiguous(a_stacks)
    num_slices = len(a_stacks)
    rank, in_features = a_stacks[0].shape[1], a_stacks[0].shape[2]
    if any(a.shape[1:] != a_stacks[0].shape[1:] for a in a_stacks):
        raise ValueError("shrink: all A stacks must be [num_slots, R, in] with one R and one in")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"shrink: x must be [T, {in_features}], got {tuple(x.shape)}")
    tokens = x.shape[0]
    _check_batch(batch, tokens, x.device)
    out = torch.zeros(num_slices, tokens, rank, dtype=torch.float32, device=x.device)
    if tokens == 0 or not batch.active_slots:
        return out

    block_m = _block_m(batch.max_seg_len)
    block_r = max(16, _next_pow2(rank))
    block_k = _shrink_block_k(block_m, block_r, max(x.element_size(), a_stacks[0].element_size()), in_features)
    m_blocks = triton.cdiv(batch.max_seg_len, block_m)
    num_segments = int(batch.seg_starts.shape[0])
    if split_k is None:
        split_k = _default_split_k(num_segments * m_blocks * num_slices, in_features, block_k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    split_k = triton.cdiv(in_features, k_per_split)  # never launch splits with no K to do

    table, align = _slice_table(a_stacks, x.device)
    kernel = _jitted(_shrink_kernel, interpreting())
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
        DOT_F32=_dot_f32(x.dtype, a_stacks[0].dtype),
    )
    return out


def _default_split_k(programs: int, in_features: int, block_k: int, device: torch.device) -> int:
    """Split K until there are a few waves of programs (decode has few rows to parallelise over).

    Each split keeps at least two K tiles so the loop still pipelines; the interpreter runs
    programs one by one, so it never splits there by default.
    """
    if device.type != "cuda":
        return 1
    target = 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    max_split = max(1, in_features // (2 * block_k))
    split = 1
    while split * 2 <= max_split and programs * split < target:
        split *= 2
    return split


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
    _check_stacks(b_stacks, "expand", out.device)
    b_stacks = _inner_contiguous(b_stacks)
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
    _check_batch(batch, tokens, out.device)
    if tokens == 0 or not batch.active_slots:
        return

    block_r = max(16, _next_pow2(rank))
    # The fp32 y tile [BLOCK_M, BLOCK_R] and its two 16-bit halves live in registers: fewer rows
    # and a narrower column block as R grows.
    block_m = min(_block_m(batch.max_seg_len), 64 if block_r <= 64 else 32)
    block_n = max(16, min(128 if block_r <= 64 else 64, _next_pow2(max(widths))))
    n_blocks = triton.cdiv(max(widths), block_n)
    m_blocks = triton.cdiv(batch.max_seg_len, block_m)
    num_segments = int(batch.seg_starts.shape[0])

    table, align = _slice_table(b_stacks, out.device)
    b_dtype = b_stacks[0].dtype
    kernel = _jitted(_expand_kernel, interpreting())
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
        OUT_ALIGN=_out_align(out, widths),
        DOT_F32=interpreting() or b_dtype not in _SIXTEEN_BIT,
        SPLIT_Y=b_dtype in _SIXTEEN_BIT,
    )
