"""Host-side help for the triton kernels' launches: the interpreter mode and the lazy `triton.jit`
per mode, tile sizes, the argument checks, and the table that locates every slice's stack.

The kernel functions are plain Python wrapped by `triton.jit` lazily, once per interpreter mode
(`TRITON_INTERPRET`): the CPU tests can then switch the interpreter on per test without caring
whether a kernel module was imported earlier in the process.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton

from node_agent.engine.kernels.batch import LoraBatch

log = logging.getLogger(__name__)

# Stack dtypes that take tensor-core dots (and, for B, the split of y into two halves).
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """Whether triton runs kernels in its CPU interpreter (`TRITON_INTERPRET`), read per call."""
    return bool(triton.knobs.runtime.interpret)


@functools.cache
def jitted(fn: Callable[..., None], interpret: bool) -> Any:
    """`triton.jit(fn)` decides between compiler and interpreter when it runs, so wrap per mode.

    Returns a JITFunction, or an InterpretedFunction under the interpreter.
    """
    del interpret  # only part of the cache key
    return triton.jit(fn)


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def next_pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def block_m_for(max_seg_len: int) -> int:
    """Token rows per program: 16 (the smallest dot) for decode, up to 64 for prefill."""
    return min(64, max(16, next_pow2(max_seg_len)))


def shrink_block_k(block_m: int, block_r: int, element_size: int, in_features: int) -> int:
    """K tile such that one pipeline stage (x tile + A tile) is at most 32 KiB.

    Three stages then stay under 100 KiB of shared memory for every dtype and tile shape, well
    inside Hopper's 227 KiB, while 16-bit decode tiles still get 256-wide K steps.
    """
    fits = 32768 // ((block_m + block_r) * element_size)
    block_k = 1 << (fits.bit_length() - 1)  # largest power of two <= fits
    return max(16, min(256, block_k, next_pow2(in_features)))


def inner_contiguous(stacks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The kernels assume the last dim of every stack is contiguous; copy (rarely) if not."""
    fixed = []
    for stack in stacks:
        if stack.stride(-1) != 1:
            log.debug("LoRA stack %s has a strided last dim; copying it for the kernel", tuple(stack.shape))
        fixed.append(stack if stack.stride(-1) == 1 else stack.contiguous())
    return fixed


def check_stacks(stacks: Sequence[torch.Tensor], what: str, device: torch.device) -> None:
    if len(stacks) == 0:
        raise ValueError(f"{what}: at least one slice is required")
    first = stacks[0]
    for stack in stacks:
        if stack.dim() != 3:
            raise ValueError(f"{what}: each stack must be [num_slots, rows, cols], got {tuple(stack.shape)}")
        if stack.dtype != first.dtype or stack.device != device or stack.shape[0] != first.shape[0]:
            raise ValueError(f"{what}: slices differ in dtype, device or slot count, or are not on {device}")


def check_batch(batch: LoraBatch, tokens: int, device: torch.device) -> None:
    if batch.num_tokens != tokens:
        raise ValueError(f"batch has {batch.num_tokens} tokens, the activations {tokens}")
    if batch.seg_slots.device != device:
        raise ValueError(f"batch is on {batch.seg_slots.device}, the activations on {device}")


# Tables of persistent buffers are cached: pool stacks live for the engine's lifetime, and a
# host-to-device copy per layer per step would cost more than the kernel. The key holds every
# value the table is built from, so a hit is correct even if the address was reused.
_TABLE_CACHE: dict[tuple[object, ...], torch.Tensor] = {}
_TABLE_CACHE_LIMIT = 1024


def slice_table(stacks: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, int]:
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


def out_align(out: torch.Tensor, widths: Sequence[int]) -> int:
    """Element multiple shared by every slice's width and first output column (16-byte access)."""
    vector = max(1, 16 // out.element_size())
    aligned = out.data_ptr() % 16 == 0 and all(width % vector == 0 for width in widths)
    return vector if aligned and out.stride(1) == 1 else 1


def dot_f32(*dtypes: torch.dtype) -> bool:
    """Use an exact fp32 dot unless both operands share one 16-bit dtype on real hardware.

    fp32 operands must not silently take triton's default tf32 path; the interpreter needs fp32
    because its bf16 dot is wrong.
    """
    same16 = len(set(dtypes)) == 1 and dtypes[0] in SIXTEEN_BIT
    return interpreting() or not same16


def default_split_k(programs: int, in_features: int, block_k: int, device: torch.device) -> int:
    """Split K until there are a few waves of programs (decode has few rows to parallelise over).

    Each split keeps at least two K tiles so the loop still pipelines; the interpreter runs
    programs one by one, so it never splits there by default.
    """
    if device.type != "cuda":
        return 1
    target = 4 * sm_count(device.index if device.index is not None else torch.cuda.current_device())
    max_split = max(1, in_features // (2 * block_k))
    split = 1
    while split * 2 <= max_split and programs * split < target:
        split *= 2
    return split
