"""Reference torch implementation of shrink/expand; the CPU path and the kernels' oracle.

A loop over the batch's active slots: per slot, its rows (`LoraBatch.slot_rows`) and a small
product per slice. A decode step runs this for every module of every layer, so each op counts:
a layer passes its A stacks `joined` when they are consecutive row blocks of one tensor
(`LoraLinear` allocates them so), and then one product serves every slice (q, k and v share one
shrink, as vLLM's packed modules do); a slot's consecutive rows are a slice, not a gather; a
single row takes a matrix-vector product, written straight into its row of the result; and an
fp32 expand adds its scaled product in place (`addmm_` / `addmv_`).

A decode step of a few sequences over many adapters reads each slot's A and B once this way.
Why no all-slots product (every token times every slot's A, then B, keeping each token's own
slot: fewer ops, up to `slots` times the arithmetic): it wins only while the adapters stay in
cache, and between two steps the base weights evict them; then the loop is faster for a decode
step's few tokens over many adapters (docs/kernels.md, "The CPU path").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from node_agent.engine.kernels.batch import LoraBatch, Rows


def shrink(x: torch.Tensor, a_stacks: list[torch.Tensor], batch: LoraBatch, joined: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] · A[slot]ᵀ for each slice: returns [n_slices, T, R] (zero where slot is −1).

    a_stacks: one [num_slots, R, in] tensor per output slice, all with the same R; `joined`,
    when given, is the same stacks as one [num_slots, n_slices · R, in] tensor (slice i its rows
    i·R ... (i+1)·R). Accumulates in fp32 and returns fp32 (possibly a strided view).
    """
    rank = a_stacks[0].shape[1]
    count, tokens = len(a_stacks), x.shape[0]
    if joined is None and count == 1:
        joined = a_stacks[0]
    if joined is None:
        out = torch.zeros(count, tokens, rank, dtype=torch.float32, device=x.device)
        for slot, rows in batch.slot_rows:
            xs = x[rows].float()
            for index, a in enumerate(a_stacks):
                out[index, rows] = xs @ a[slot].float().t()
        return out
    slot_rows = batch.slot_rows
    if len(slot_rows) == 1 and _covers(slot_rows[0][1], tokens):  # one adapter for every token: no zeroed rows
        flat = _rows_times(x, joined[slot_rows[0][0]])
    else:
        flat = torch.zeros(tokens, count * rank, dtype=torch.float32, device=x.device)
        for slot, rows in batch.slot_rows:
            if isinstance(rows, slice) and rows.stop - rows.start == 1 and x.dtype == joined.dtype == torch.float32:
                torch.mv(joined[slot], x[rows.start], out=flat[rows.start])  # straight into its row
            else:
                _put(flat, rows, _rows_times(x[rows], joined[slot]))
    return flat.view(tokens, count, rank).transpose(0, 1)


def _rows_times(xs: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """fp32 `xs [t, in] · aᵀ` for one slot's `a [R', in]`; one row as a matrix-vector product."""
    if xs.shape[0] == 1:
        return torch.mv(a.float(), xs[0].float())[None]
    return xs.float() @ a.float().t()


def _covers(rows: Rows, tokens: int) -> bool:
    return isinstance(rows, slice) and rows.start == 0 and rows.stop == tokens


def _put(out: torch.Tensor, rows: Rows, values: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = values
    else:
        out.index_copy_(0, rows, values)


def expand(
    y: torch.Tensor,
    b_stacks: list[torch.Tensor],
    scales: torch.Tensor,
    batch: LoraBatch,
    out: torch.Tensor,
) -> None:
    """Add y[i] · B_i[slot]ᵀ · scale[i, slot] into consecutive column blocks of `out`, in place.

    y: [n_slices, T, R]; b_stacks: one [num_slots, width_i, R] per slice; scales: [n_slices,
    num_slots]; out: [T, Σ width_i]. Tokens whose slot is −1 are left untouched.
    """
    by_slice = scales.tolist()  # one read of every slot's scales, not one per slot
    for slot, rows in batch.slot_rows:
        factors = [row[slot] for row in by_slice]
        offset = 0
        for index, b in enumerate(b_stacks):
            width = b.shape[1]
            target = out[:, offset : offset + width]
            if isinstance(rows, slice) and out.dtype == torch.float32 and b.dtype == torch.float32:
                # In place, one op: out += scale · (y Bᵀ); one row by a matrix-vector product,
                # which streams B where a one-row matrix product packs it first.
                if rows.stop - rows.start == 1:
                    target[rows.start].addmv_(b[slot], y[index, rows.start], alpha=factors[index])
                else:
                    target[rows].addmm_(y[index, rows], b[slot].t(), alpha=factors[index])
            else:
                delta = (y[index, rows] @ b[slot].float().t()) * factors[index]
                target.index_put_((_indices(rows, out.device),), delta.to(out.dtype), accumulate=True)
            offset += width


def _indices(rows: Rows, device: torch.device) -> torch.Tensor:
    if isinstance(rows, slice):
        return torch.arange(rows.start, rows.stop, device=device)
    return rows


def add_fp32(
    x: torch.Tensor,
    out: torch.Tensor,
    a_slots: Sequence[torch.Tensor],
    b_slots: Sequence[Sequence[torch.Tensor]],
    scales: torch.Tensor,
    batch: LoraBatch,
) -> bool:
    """`expand(shrink(x), ...)` into `out` in one pass over the batch's slot runs, for fp32 `x`,
    `out`, A and B; the same products as the two calls, so the same result to the bit.

    `a_slots[s]`: slot `s`'s joined A `[n_slices · R, in]`; `b_slots[s][i]`: its B of slice `i`
    `[width_i, R]` (per-slot views the layer makes once). Returns False, having done nothing,
    for batches this path does not serve (a slot's rows as an index tensor; any other dtype).

    Why: a decode step runs this for every module of every layer, and for one row per slot the
    two-call form spent more on indexing (a slot's A, a row of x, of the shrink's output, of y
    per slice, of out per slice: about 40 view ops per slot and layer) than on its
    matrix-vector products. Here a slot's row takes one `mv` and one `addmv_` per slice, over
    views split off once.
    """
    runs = batch.slot_rows
    if any(not isinstance(rows, slice) for _, rows in runs) or not (
        x.dtype == out.dtype == a_slots[0].dtype == b_slots[0][0].dtype == torch.float32
    ):
        return False
    factors = scales.tolist()  # one read of every slot's scales: factors[slice][slot]
    widths = [b.shape[0] for b in b_slots[0]]
    ranks = [b.shape[1] for b in b_slots[0]]
    # Rows of x and out as views made by one op each when every row is a one-row run (a decode
    # batch). A prefill's runs take row slices instead: unbinding its hundreds of rows per module
    # cost more than its LoRA products (8,000 views in a 256-row prefill over 8 adapters).
    x_rows, out_rows = (x.unbind(0), out.unbind(0)) if 1 < len(runs) == x.shape[0] else (x, out)
    # Shrink every run, then expand slice by slice: runs come in ascending slot order, so each
    # stack (A, then each slice's B) is read front to back, one stream for the prefetcher
    # instead of a jump between stacks per slot. (`split_with_sizes`: the C++ method, not the
    # Python of `Tensor.split`.)
    # A module of one slice (o_proj, down_proj) needs no split: its run's rows are its targets.
    whole = len(widths) == 1
    parts: list[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], bool]] = []
    for slot, rows in runs:
        assert isinstance(rows, slice)  # checked above
        if rows.stop - rows.start == 1:
            y, target = torch.mv(a_slots[slot], x_rows[rows.start]), out_rows[rows.start]
            parts.append(((target,), (y,), True) if whole else (target.split_with_sizes(widths), y.split_with_sizes(ranks), True))
        else:
            y, target = x[rows] @ a_slots[slot].t(), out[rows]
            parts.append(
                ((target,), (y,), False) if whole else (target.split_with_sizes(widths, dim=1), y.split_with_sizes(ranks, dim=1), False)
            )
    for index in range(len(widths)):
        for (slot, _), (targets, ys, one_row) in zip(runs, parts, strict=True):
            b, factor = b_slots[slot][index], factors[index][slot]
            if one_row:
                targets[index].addmv_(b, ys[index], alpha=factor)
            else:
                targets[index].addmm_(ys[index], b.t(), alpha=factor)
    return True
