"""A rank's read of its planned shard (`read_planned_shard`): the file's bytes straight into one
buffer whose views are the slices' A and B (`AdapterShard`), NaN/Inf refused; and the warm-up
read a rank makes at start-up."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from node_agent.engine.adapters.errors import AdapterLoadError
from node_agent.engine.adapters.header import FILE_DTYPES, FLOAT_DTYPES, TensorEntry, corrupt
from node_agent.engine.adapters.plan import I64, ShardPlan, plan_shard
from node_agent.engine.adapters.spec import AdapterSpec
from node_agent.engine.adapters.targets import ModuleAdapter
from node_agent.engine.model.lora_layers import SliceWeights
from node_agent.engine.parallel.sharding import MODULE_KINDS, LoraSliceLayout, ModuleKey, Span

_SERIAL_ELEMENTS = 16384  # under torch's intra-op grain size (32768): a reduction this size runs on one thread
# Unsigned integers of each float element size: what same-dtype elements are moved as.
_SAME_SIZE_INTS: dict[int, type[np.unsignedinteger[Any]]] = {2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass
class AdapterShard:
    """This rank's part of one adapter, ready to be copied into LoRA slots: one buffer (`flat`)
    and, per slice, where its A and B lie in it (`slices`, in buffer order: the plan's table).

    `weights` makes every slice's A and B as views of the buffer when first asked for, i.e. when
    the pool first copies the adapter into a slot: making the views of a rank's shard is a
    noticeable share of its load's CPU, which a load that never takes a slot (or takes one later)
    does not wait for (docs/engine.md "Measured").
    """

    flat: torch.Tensor
    keys: Sequence[ModuleKey]  # the rank's module keys; `slices` names a module by its position here
    slices: I64  # [n, 6]: module position, slice index, A rows, A columns, B rows, B columns
    scales: npt.NDArray[np.float64]
    nbytes: int

    @cached_property
    def weights(self) -> dict[ModuleKey, list[SliceWeights | None]]:
        """Every module's slices (keyed like CausalLM.lora_modules()), A and B views of `flat`."""
        slices = self.slices.tolist()
        pieces = _pieces(self.flat, slices)
        weights: dict[ModuleKey, list[SliceWeights | None]] = {}
        for index, ((position, slice_index, a_rows, a_cols, b_rows, b_cols), scale) in enumerate(
            zip(slices, self.scales.tolist(), strict=True)
        ):
            key = self.keys[position]
            parts = weights.get(key)
            if parts is None:
                parts = weights[key] = [None] * len(MODULE_KINDS[key[1]].peft_modules)
            parts[slice_index] = SliceWeights(pieces[2 * index].view(a_rows, a_cols), pieces[2 * index + 1].view(b_rows, b_cols), scale)
        return weights


def _pieces(flat: torch.Tensor, slices: Sequence[Sequence[int]]) -> tuple[torch.Tensor, ...]:
    """Every slice's A and B as flat views of the buffer, in buffer order: one split makes them
    all (far cheaper than slicing per slice)."""
    sizes = [size for _, _, a_rows, a_cols, b_rows, b_cols in slices for size in (a_rows * a_cols, b_rows * b_cols)]
    return torch.split(flat, sizes) if sizes else ()


def read_planned_shard(plan: ShardPlan, fd: int, keys: Sequence[ModuleKey], dtype: torch.dtype) -> AdapterShard:
    """Carry out `plan` on the weights file open as `fd`: its bytes go straight into one buffer
    of `dtype` (zeroed when the plan leaves padding; through a staging buffer only for the plan's
    staged blocks), whose views are the slices' A and B (`AdapterShard.weights`); `keys`: the
    rank's module keys, in the plan's order. Refuses a file of another size than planned, one
    that ends early, and NaN/Inf anywhere in the shard."""
    if os.fstat(fd).st_size != plan.file_size:
        raise corrupt("the file changed while it was being read")
    shard = _ShardBuffer(plan.numel, dtype, plan.zeroed)
    scratch = memoryview(bytearray(plan.max_gap))
    target = shard.bytes
    segments = plan.segments.tolist()
    at = 0
    for offset, count, nbytes in plan.calls.tolist():
        buffers = [target[begin : begin + size] if begin >= 0 else scratch[:size] for begin, size in segments[at : at + count]]
        at += count
        if os.preadv(fd, buffers, offset) != nbytes:
            raise corrupt("the file ended early")
    for start, rows, width, code, first_col, cols, stride, offset, dest_cols in plan.staged.tolist():
        shard.stage(fd, StagedBlock(start, rows, width, FILE_DTYPES[code], first_col, cols, stride, offset, dest_cols))
    _refuse_non_finite(shard.flat, plan.slices, plan.tensors)
    return AdapterShard(shard.flat, keys, plan.slices, plan.scales, plan.numel * dtype.itemsize)


def read_adapter_shard(
    spec: AdapterSpec,
    fd: int,
    lora_layouts: Mapping[ModuleKey, tuple[LoraSliceLayout, ...]],
    dtype: torch.dtype,
) -> AdapterShard:
    """Read this rank's slices of every module (per `lora_layouts`) from the weights file open
    as `fd` (the file `spec` describes), padded to max rank: its plan (`plan_shard`), carried
    out here (`read_planned_shard`), as the driver and a rank do it between them.

    The whole shard is one zeroed buffer of `dtype`; every slice's A and B are views of it, and
    the file's bytes are read straight into them (through a one-tensor staging buffer only where
    the file's dtype or column order differs), so memory grows by the shard and little else.
    """
    return read_planned_shard(plan_shard(spec, lora_layouts, dtype), fd, tuple(lora_layouts), dtype)


def warm_up_shard_reads(dtype: torch.dtype) -> AdapterShard:
    """Read a shard of a tiny adapter once, from an anonymous file with tensors of every float
    dtype, into `dtype`; for a rank to call at start-up.

    The first call of each kernel a shard read uses maps that kernel's code into the process:
    file-backed pages that count in its RSS (the fp32 sum of the non-finite check, pages of
    libtorch_cpu.so; the strided numpy copy, pages of numpy's core). Taken here, once, they
    are out of the first load's memory, which then grows by its shard as every later load does
    (docs/engine.md "Measured"). The adapter's bytes are zeros, so the read succeeds; returns
    its shard (8 modules, each one A/B slice of zeros), its slices' views made.
    """
    modules: list[ModuleAdapter] = []
    tensors: dict[str, TensorEntry] = {}
    layouts: dict[ModuleKey, tuple[LoraSliceLayout, ...]] = {}
    start = 0
    for index, file_dtype in enumerate(FLOAT_DTYPES.values()):
        # Per file dtype, two modules of rank 2: A's middle columns with B's whole rows, then A
        # whole with B's every other column (fused experts' stride): every staged path.
        for stride in (1, 2):
            layer = 2 * index + stride - 1
            a_key, b_key = f"{layer}.a", f"{layer}.b"
            for key, shape in ((a_key, (2, 4)), (b_key, (4, 2 * stride))):
                tensors[key] = TensorEntry(file_dtype, shape, start)
                start += shape[0] * shape[1] * file_dtype.itemsize
            modules.append(ModuleAdapter(layer, "o_proj", 0, a_key, b_key, rank=2, scale=1.0, b_col_stride=stride))
            a_in = Span(1, 2) if stride == 1 else Span(0, 4)
            layouts[(layer, "o_proj")] = (LoraSliceLayout("o_proj", Span(0, 2), a_in, Span(0, 4), Span(0, 2)),)
    fd = _anonymous_file()
    try:
        os.write(fd, bytes(start))  # a few hundred bytes: one write (the read checks the size)
        spec = AdapterSpec(Path("warm-up"), tuple(modules), 2, tensors, start)  # its path is never opened
        shard = read_adapter_shard(spec, fd, layouts, dtype)
    finally:
        os.close(fd)
    shard.weights  # noqa: B018 (a cached property: its views made now, as the pool makes them)
    return shard


def _anonymous_file() -> int:
    """A new file with no name: a memfd on Linux (no writable filesystem needed in the rank's
    container), else a temporary file unlinked at once."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("lorafleet-warm-up", os.MFD_CLOEXEC)
    fd, name = tempfile.mkstemp(prefix="lorafleet-warm-up-")
    os.unlink(name)
    return fd


@dataclass(frozen=True)
class StagedBlock:
    """One staged block of a plan (`ShardPlan.staged`): `rows` whole rows of a file tensor
    (`width` wide, of `file_dtype`) at byte `start`, of which `cols` columns (from `first_col`,
    every `col_stride`th) go into the top-left corner of the destination at element `offset`,
    `dest_cols` wide."""

    start: int
    rows: int
    width: int
    file_dtype: torch.dtype
    first_col: int
    cols: int
    col_stride: int
    offset: int
    dest_cols: int


class _ShardBuffer:
    """One rank's shard of one adapter: a buffer of the engine's dtype that file bytes are read
    into, zeroed first only when the reads leave rank padding (`zeroed`): an adapter of the
    engine's max rank fills it whole, and zeroing 2.4 MiB cost a rank about a tenth of its
    load's CPU (docs/engine.md "Measured")."""

    def __init__(self, numel: int, dtype: torch.dtype, zeroed: bool = True) -> None:
        self.dtype = dtype
        # numpy, not torch: its allocations are traced (tracemalloc), and the reads write into its buffer.
        self.raw = (np.zeros if zeroed else np.empty)(numel * dtype.itemsize, dtype=np.uint8)
        self.bytes = self.raw.data
        self.flat = torch.frombuffer(self.raw, dtype=dtype) if numel else torch.zeros(0, dtype=dtype)

    def stage(self, fd: int, block: StagedBlock) -> None:
        """Read the block's whole rows into a staging buffer, then move its columns into the
        top-left corner of its destination."""
        start, rows, width, file_dtype = block.start, block.rows, block.width, block.file_dtype
        first_col, cols, col_stride, offset, dest_cols = block.first_col, block.cols, block.col_stride, block.offset, block.dest_cols
        staged = bytearray(rows * width * file_dtype.itemsize)
        if os.preadv(fd, [staged], start) != len(staged):
            raise corrupt("the file ended early")
        stop = first_col + (cols - 1) * col_stride + 1
        if file_dtype == self.dtype:
            # Nothing to convert: numpy moves the elements as integers of their size (it has no
            # bfloat16), at a fraction of the cost of torch's per-op dispatch.
            as_int = _SAME_SIZE_INTS[self.dtype.itemsize]
            source = np.frombuffer(staged, as_int).reshape(rows, width)
            target = np.frombuffer(self.raw, as_int, rows * dest_cols, offset * self.dtype.itemsize).reshape(rows, dest_cols)
            target[:, :cols] = source[:, first_col:stop:col_stride]
            return
        converted = torch.frombuffer(staged, dtype=file_dtype).view(rows, width)
        view = self.flat[offset : offset + rows * dest_cols].view(rows, dest_cols)
        view[:, :cols].copy_(converted[:, first_col:stop:col_stride])


def _refuse_non_finite(flat: torch.Tensor, slices: I64, names: Sequence[str]) -> None:
    """Refuse NaN/Inf anywhere in the shard, naming the first tensor that has one (`slices`:
    the plan's table of every slice's A and B in buffer order, with their keys in `names`).

    An fp32 sum of the buffer (a fraction of the cost of an elementwise check) is non-finite if
    some value is, or, never for real weights, if the sum overflows; only then is each tensor
    checked, to name it. With more than one torch thread the sum runs in chunks below torch's
    parallel grain size: a parallel reduction waits for a second thread, which on a busy machine
    costs milliseconds. A rank of one thread sums in one op (chunks would only add their
    dispatch cost).
    """
    chunk = _SERIAL_ELEMENTS if torch.get_num_threads() > 1 else max(1, flat.numel())
    sums = [part.sum(dtype=torch.float32) for part in torch.split(flat, chunk)]
    if not sums or math.isfinite(float(torch.stack(sums).sum())):
        return
    for piece, name in zip(_pieces(flat, slices.tolist()), names, strict=True):
        if not torch.isfinite(piece).all():
            raise AdapterLoadError(f"tensor {name} has non-finite values (NaN or Inf)")
