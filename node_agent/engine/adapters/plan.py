"""How each rank reads its shard of an adapter (`ShardPlan`), planned by the driver for every
rank at once (`ShardPlanner`): flat integer tables of preadv calls and staged blocks."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from node_agent.engine.adapters.errors import AdapterLoadError
from node_agent.engine.adapters.header import FILE_DTYPES
from node_agent.engine.adapters.spec import AdapterSpec
from node_agent.engine.parallel.sharding import LoraSliceLayout, ModuleKey

# A row's run of columns shorter than this is not read on its own (one iovec per tiny run costs
# more than the copy): the block's whole rows are staged and numpy moves the columns.
_DIRECT_RUN_BYTES = 512
# Runs this close in the file share one preadv, the bytes between them read into a scratch
# buffer: copying 32 KiB from the page cache costs about what one more system call does.
_MAX_GAP_BYTES = 32 << 10
_RUNS_PER_CALL = 500  # with a gap segment before each run, under IOV_MAX (1024) iovecs per preadv
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class ShardPlan:
    """How one rank reads its shard of one adapter into one buffer: computed by the driver from
    the verified spec and that rank's layouts (`plan_shard`), carried out by the rank
    (`read_planned_shard`). Flat integer arrays: a rank unpickles nothing per module.

    `calls` [c, 3]: one preadv each (file offset, segments, bytes), over the next `segments`
    [s, 2] (byte offset in the buffer, or -1 for a gap read into scratch; bytes). `staged` [m, 9]:
    the blocks read through a staging buffer (another file dtype, strided or short column runs):
    file offset of the first row, rows, row width, file dtype (index in `FILE_DTYPES`), first
    column, columns, column stride, element offset in the buffer, destination columns.
    `slices` [n, 6], in buffer order (each slice's A then its B): the module's position in the
    rank's layouts, the slice index, A rows and columns, B rows and columns; `scales` [n];
    `tensors`: each slice's A and B keys (to name a non-finite one).
    """

    numel: int  # elements of the engine's dtype in the buffer
    zeroed: bool  # the reads leave part of the buffer unwritten (rank padding): it starts zeroed
    file_size: int  # of the weights file the spec describes
    max_gap: int  # bytes of the scratch buffer
    calls: I64
    segments: I64
    staged: I64
    slices: I64
    scales: npt.NDArray[np.float64]
    tensors: tuple[str, ...]

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        # One bytes object (made once per plan; the engine remembers plans): pickling a Load
        # copies it, unpickling makes views into it, instead of six arrays and a string each.
        blob = self.__dict__.get("_blob")
        if blob is None:
            counts = np.array(
                [
                    self.numel,
                    self.zeroed,
                    self.file_size,
                    self.max_gap,
                    len(self.calls),
                    len(self.segments),
                    len(self.staged),
                    len(self.slices),
                ],
                dtype=np.int64,
            )
            arrays = (counts, self.calls, self.segments, self.staged, self.slices, self.scales)
            # Keys never hold a newline (`targets` refuses one), so they travel joined by one.
            blob = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays) + "\n".join(self.tensors).encode()
            object.__setattr__(self, "_blob", blob)
        return _plan_from_blob, (blob,)


def _plan_from_blob(blob: bytes) -> ShardPlan:
    """A `ShardPlan` from its pickled form (`ShardPlan.__reduce__`): read-only views into `blob`."""
    numel, zeroed, file_size, max_gap, calls, segments, staged, slices = np.frombuffer(blob, np.int64, 8).tolist()
    at = 64

    def table(rows: int, width: int) -> I64:
        nonlocal at
        at += rows * width * 8
        return np.frombuffer(blob, np.int64, rows * width, at - rows * width * 8).reshape(rows, width)

    tables = table(calls, 3), table(segments, 2), table(staged, 9), table(slices, 6)
    scales = np.frombuffer(blob, np.float64, slices, at)
    names = blob[at + 8 * slices :].decode()
    return ShardPlan(numel, bool(zeroed), file_size, max_gap, *tables, scales, tuple(names.split("\n")) if names else ())


_LAYOUT_FIELDS = 8  # per slice: a_rank start, stop; a_in start, width; b_out start, width; b_rank start, stop
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(FILE_DTYPES)}


class ShardPlanner:
    """Plans every rank's read of an adapter at once, from the layouts each rank's model has
    (`lora_slices()`, as `sharding.lora_layout` gives them): numpy over ranks × modules, so the
    driver's cost barely grows with the ranks. One planner per engine; `plans(spec)` per load,
    remembered by the spec's content (the last `limit`; equal content, equal spec, equal plans).

    Per slice of a module a rank holds, A's real rank rows and B's real rank columns are read
    into the slice's place in one zeroed buffer of `dtype`, padded to max rank (padding stays
    zero): whole rows as one run, column slices as one run per row, and through a staging buffer
    what must be converted, gathered with a stride, or is too short a run to read by itself.
    """

    def __init__(
        self, rank_layouts: Sequence[Mapping[ModuleKey, tuple[LoraSliceLayout, ...]]], dtype: torch.dtype, limit: int = 64
    ) -> None:
        self.dtype, self.limit = dtype, limit
        self._planned: OrderedDict[str, tuple[ShardPlan, ...]] = OrderedDict()
        self._lock = threading.Lock()  # loads are planned before the engine's command lock
        self.positions = [{key: index for index, key in enumerate(layouts)} for layouts in rank_layouts]
        width = max((len(lays) for layouts in rank_layouts for lays in layouts.values()), default=1)
        rows = [
            [
                (s.a_rank.start, s.a_rank.stop, s.a_in.start, s.a_in.width, s.b_out.start, s.b_out.width, s.b_rank.start, s.b_rank.stop)
                for s in lays
            ]
            + [(0,) * _LAYOUT_FIELDS] * (width - len(lays))
            for layouts in rank_layouts
            for lays in layouts.values()
        ]
        self.table = np.array(rows, dtype=np.int64).reshape(-1, width, _LAYOUT_FIELDS)  # every rank's, one after another
        self.bases = np.cumsum([0] + [len(layouts) for layouts in rank_layouts[:-1]], dtype=np.int64)

    def plans(self, spec: AdapterSpec) -> tuple[ShardPlan, ...]:
        """Every rank's plan of `spec` (rank order). Refuses a module no rank layout has
        (experts are held by their expert-parallel group only)."""
        with self._lock:
            known = self._planned.get(spec.content) if spec.content else None
            if known is not None:
                self._planned.move_to_end(spec.content)
                return known
        plans = self._plan(spec)
        if spec.content:
            with self._lock:
                self._planned[spec.content] = plans
                while len(self._planned) > self.limit:
                    self._planned.popitem(last=False)
        return plans

    def _plan(self, spec: AdapterSpec) -> tuple[ShardPlan, ...]:
        modules, ranks, count = spec.modules, len(self.positions), len(spec.modules)
        if not ranks:
            return ()
        keys = [module.key for module in modules]
        pos = np.array([[positions.get(key, -1) for key in keys] for positions in self.positions], dtype=np.int64).reshape(ranks, count)
        held = pos >= 0
        for module, column in zip(modules, held.T, strict=True):
            if module.expert is None and not column.all():
                raise AdapterLoadError(f"engine has no module for {module.a_key}")
        columns = (
            np.array(
                [
                    (
                        m.slice_index,
                        m.rank,
                        m.a_row_offset,
                        m.b_row_offset,
                        m.b_col_start,
                        m.b_col_stride,
                        a.start,
                        a.shape[1],
                        a.dtype.itemsize,
                        _DTYPE_CODES[a.dtype],
                        b.start,
                        b.shape[1],
                        b.dtype.itemsize,
                        _DTYPE_CODES[b.dtype],
                    )
                    for m in modules
                    for a, b in ((spec.tensors[m.a_key], spec.tensors[m.b_key]),)
                ],
                dtype=np.int64,
            )
            .reshape(count, 14)
            .T
        )
        slice_index, rank, a_row_offset, b_row_offset, b_col_start, b_stride = columns[:6]
        layout = self.table[np.where(held, self.bases[:, None] + pos, 0), slice_index[None, :]]  # [ranks, modules, 8]
        a_rs, a_re, a_is, a_iw, b_os, b_ow, b_rs, b_re = np.moveaxis(layout, 2, 0)
        a_rows, b_cols = a_re - a_rs, b_re - b_rs
        # Every block as [ranks, modules, 2] (A, B), then flat: A's real rank rows, B's rows of
        # the rank's output and the real rank columns (with the fused experts' stride).
        blocks = _Blocks(
            first_row=np.stack((a_row_offset + a_rs, b_row_offset + b_os), axis=2),
            rows=np.stack((np.minimum(a_re, rank) - a_rs, b_ow), axis=2),
            first_col=np.stack((a_is, b_col_start + b_rs * b_stride), axis=2),
            cols=np.stack((a_iw, np.minimum(b_re, rank) - b_rs), axis=2),
            stride=np.stack((np.ones_like(a_is), np.broadcast_to(b_stride, a_is.shape)), axis=2),
            dest_cols=np.stack((a_iw, b_cols), axis=2),
            tensor=np.broadcast_to(np.stack((columns[6:10], columns[10:14]), axis=2)[:, None], (4, ranks, count, 2)),
        )
        sizes = np.where(held[:, :, None], np.stack((a_rows * a_iw, b_ow * b_cols), axis=2), 0).reshape(ranks, 2 * count)
        ends = np.cumsum(sizes, axis=1)
        runs, staged = blocks.runs((ends - sizes).reshape(-1), np.repeat(held.reshape(-1), 2), ranks, _DTYPE_CODES.get(self.dtype, -1))
        calls, segments, max_gaps, call_of_rank, segment_of_rank = runs.calls(ranks)
        staged_rows, staged_rank = staged
        slices = np.stack((pos, np.broadcast_to(slice_index, pos.shape), a_rows, a_iw, b_ow, b_cols), axis=2)
        scales = np.array([module.scale for module in modules], dtype=np.float64)
        every_name = tuple(key for module in modules for key in (module.a_key, module.b_key))
        # Bytes the reads write into each rank's buffer (direct segments, staged blocks' columns).
        direct = np.concatenate(([0], np.cumsum(np.where(segments[:, 0] >= 0, segments[:, 1], 0)))).astype(np.int64)
        written = direct[segment_of_rank[1:]] - direct[segment_of_rank[:-1]]
        np.add.at(written, staged_rank, staged_rows[:, 1] * staged_rows[:, 5] * self.dtype.itemsize)
        plans = []
        for r in range(ranks):
            mine = held[r]
            names = (
                every_name
                if mine.all()
                else tuple(key for module, kept in zip(modules, mine.tolist(), strict=True) if kept for key in (module.a_key, module.b_key))
            )
            numel = int(ends[r, -1]) if count else 0
            plans.append(
                ShardPlan(
                    numel,
                    bool(written[r] < numel * self.dtype.itemsize),
                    spec.file_size,
                    int(max_gaps[r]),
                    calls[call_of_rank[r] : call_of_rank[r + 1]],
                    segments[segment_of_rank[r] : segment_of_rank[r + 1]],
                    staged_rows[staged_rank == r],
                    slices[r][mine],
                    scales[mine],
                    names,
                )
            )
        return tuple(plans)


@dataclass(frozen=True)
class _Blocks:
    """Blocks of file tensors to read (flattened over ranks, modules, A/B): `rows` rows from
    `first_row`, `cols` columns `first_col, first_col + stride, ...`, into the top-left corner of
    a destination `dest_cols` wide; `tensor`: each block's tensor (file offset, row width,
    itemsize, dtype code)."""

    first_row: I64
    rows: I64
    first_col: I64
    cols: I64
    stride: I64
    dest_cols: I64
    tensor: I64

    def runs(self, offset: I64, held: npt.NDArray[np.bool_], ranks: int, engine_code: int) -> tuple[_Runs, tuple[I64, I64]]:
        """The direct runs (whole rows: one per block; column slices of long enough rows: one
        per row) and the staged blocks' rows with their ranks; `offset`: each block's element
        offset in its rank's buffer."""
        first_row, rows, first_col, cols, stride, dest_cols = (
            a.reshape(-1) for a in (self.first_row, self.rows, self.first_col, self.cols, self.stride, self.dest_cols)
        )
        start, width, size, code = (a.reshape(-1) for a in self.tensor)
        rank_of = np.repeat(np.arange(ranks), len(rows) // max(ranks, 1))
        valid = held & (rows > 0) & (cols > 0)
        same = valid & (code == engine_code) & ((stride == 1) | (cols == 1))
        whole = same & (first_col == 0) & (cols == width) & (width == dest_cols)
        per_row = same & ~whole & (cols * size >= _DIRECT_RUN_BYTES)
        staged = valid & ~whole & ~per_row
        row_start = start + first_row * width * size
        w, p = np.flatnonzero(whole), np.flatnonzero(per_row)
        reps = rows[p]
        block = np.repeat(p, reps)
        row = np.arange(len(block)) - np.repeat(np.cumsum(reps) - reps, reps)
        runs = _Runs(
            files=np.concatenate((row_start[w], row_start[block] + (row * width[block] + first_col[block]) * size[block])),
            lengths=np.concatenate((rows[w] * width[w] * size[w], cols[block] * size[block])),
            targets=np.concatenate((offset[w], offset[block] + row * dest_cols[block])) * np.concatenate((size[w], size[block])),
            ranks=np.concatenate((rank_of[w], rank_of[block])),
        )
        rows_staged = np.stack((row_start, rows, width, code, first_col, cols, stride, offset, dest_cols), axis=1)[staged]
        return runs, (rows_staged, rank_of[staged])


@dataclass(frozen=True)
class _Runs:
    """Direct runs: (file offset, bytes, byte offset in the buffer) of each rank."""

    files: I64
    lengths: I64
    targets: I64
    ranks: I64

    def calls(self, ranks: int) -> tuple[I64, I64, I64, I64, I64]:
        """The runs of each rank in file order, joined into preadv calls: runs at most
        `_MAX_GAP_BYTES` apart share one, the gap read into scratch. Returns the calls, their
        segments, each rank's largest gap, and where each rank's calls and segments begin
        (`ranks + 1` bounds each)."""
        order = np.lexsort((self.files, self.ranks))
        files, lengths, targets, run_rank = self.files[order], self.lengths[order], self.targets[order], self.ranks[order]
        count = len(files)
        ends = files + lengths
        gaps = np.concatenate(([0], files[1:] - ends[:-1])).astype(np.int64)
        rank_start = np.searchsorted(run_rank, run_rank)  # each run's rank's first run
        starts = (
            (np.arange(count) == rank_start)
            | (gaps < 0)
            | (gaps > _MAX_GAP_BYTES)
            | ((np.arange(count) - rank_start) % _RUNS_PER_CALL == 0)
        )
        gapped = ~starts & (gaps > 0)
        where = np.arange(count) + np.cumsum(gapped)  # each run's segment
        segments = np.empty((count + int(gapped.sum()), 2), dtype=np.int64)
        segments[where, 0], segments[where, 1] = targets, lengths
        segments[where[gapped] - 1, 0], segments[where[gapped] - 1, 1] = -1, gaps[gapped]
        first = np.flatnonzero(starts)
        last = np.concatenate((first[1:], [count] if count else [])).astype(np.int64) - 1
        calls = np.stack(
            (files[first], np.diff(np.concatenate((where[first], [len(segments)]))).astype(np.int64), ends[last] - files[first]), axis=1
        ).reshape(-1, 3)
        bounds = np.arange(ranks + 1)
        call_of_rank = np.searchsorted(run_rank[first], bounds)
        segment_of_rank = np.concatenate((where[first], [len(segments)]))[call_of_rank]
        max_gaps = np.zeros(ranks, dtype=np.int64)
        np.maximum.at(max_gaps, run_rank[gapped], gaps[gapped])
        return calls, segments, max_gaps, call_of_rank, segment_of_rank


def plan_shard(spec: AdapterSpec, lora_layouts: Mapping[ModuleKey, tuple[LoraSliceLayout, ...]], dtype: torch.dtype) -> ShardPlan:
    """The read plan of one rank's slices of every module (`lora_layouts`: the rank's
    `lora_slices()`), as `ShardPlanner` makes it for every rank of an engine."""
    return ShardPlanner([lora_layouts], dtype).plans(spec)[0]
