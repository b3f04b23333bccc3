"""Reference torch implementation of shrink/expand; the CPU path and the kernels' oracle.

Two ways to the same result, chosen per batch by `multiplies_every_slot`: a loop over the
batch's active slots (a few small ops per slot and slice), or, for a few tokens over many
adapters (a decode step), one matrix product of every token with every slot's weights per slice,
keeping each token's own slot. The second does more arithmetic but far fewer ops, which is what
a decode step on the CPU pays for (docs/kernels.md).

A decode step runs these for every module of every layer, so each op counts: a layer passes its
A stacks `joined` when they are consecutive row blocks of one tensor (`LoraLinear` allocates
them so), and then one product serves every slice (q, k and v share one shrink, as vLLM's packed
modules do); a slot's consecutive rows are a slice, not a gather; a single row takes a
matrix-vector product; and an fp32 expand adds its scaled product in place (`addmm_`).
"""

from __future__ import annotations

import torch

from node_agent.engine.kernels.batch import LoraBatch, Rows

# The all-slots product costs tokens × slots; the loop costs ops per active slot. Measured on the
# development CPU (rank 16, hidden 1024, 8 slots): the product wins from 3 active slots while
# tokens × slots stays under about 128 per active slot (docs/kernels.md).
_MIN_ACTIVE = 3
_TOKEN_SLOTS_PER_ACTIVE = 128


def multiplies_every_slot(batch: LoraBatch, num_slots: int) -> bool:
    """Whether `batch` takes the all-slots product (else the loop over its active slots)."""
    active = len(batch.active_slots)
    return active >= _MIN_ACTIVE and batch.num_tokens * num_slots <= _TOKEN_SLOTS_PER_ACTIVE * active


def shrink(x: torch.Tensor, a_stacks: list[torch.Tensor], batch: LoraBatch,
           joined: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] · A[slot]ᵀ for each slice: returns [n_slices, T, R] (zero where slot is −1).

    a_stacks: one [num_slots, R, in] tensor per output slice, all with the same R; `joined`,
    when given, is the same stacks as one [num_slots, n_slices · R, in] tensor (slice i its rows
    i·R ... (i+1)·R). Accumulates in fp32 and returns fp32 (possibly a strided view).
    """
    num_slots, rank, _ = a_stacks[0].shape
    count, tokens = len(a_stacks), x.shape[0]
    if joined is None and count == 1:
        joined = a_stacks[0]
    if multiplies_every_slot(batch, num_slots):
        return _shrink_every_slot(x, a_stacks, batch, joined)
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


def _shrink_every_slot(x: torch.Tensor, a_stacks: list[torch.Tensor], batch: LoraBatch,
                       joined: torch.Tensor | None) -> torch.Tensor:
    num_slots, rank, _ = a_stacks[0].shape
    own, xs = batch.own_slots, x.float()
    if joined is not None:
        width = joined.shape[1]
        every = xs @ joined.float().reshape(num_slots * width, -1).t()
        picked = every.view(-1, num_slots, width)[own.rows, own.slots] * own.keep[:, None]
        return picked.view(-1, len(a_stacks), rank).transpose(0, 1)
    out = torch.empty(len(a_stacks), x.shape[0], rank, dtype=torch.float32, device=x.device)
    for index, a in enumerate(a_stacks):
        every = xs @ a.float().reshape(num_slots * rank, -1).t()
        out[index] = every.view(-1, num_slots, rank)[own.rows, own.slots] * own.keep[:, None]
    return out


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
    num_slots = b_stacks[0].shape[0]
    if multiplies_every_slot(batch, num_slots):
        _expand_every_slot(y, b_stacks, scales, batch, out)
        return
    for slot, rows in batch.slot_rows:
        factors = scales[:, slot].tolist()
        offset = 0
        for index, b in enumerate(b_stacks):
            width = b.shape[1]
            target = out[:, offset : offset + width]
            if isinstance(rows, slice) and out.dtype == torch.float32 and b.dtype == torch.float32:
                # In place, one op: out += scale · (y Bᵀ).
                target[rows].addmm_(y[index, rows], b[slot].t(), alpha=factors[index])
            else:
                delta = (y[index, rows] @ b[slot].float().t()) * factors[index]
                target.index_put_((_indices(rows, out.device),), delta.to(out.dtype), accumulate=True)
            offset += width


def _indices(rows: Rows, device: torch.device) -> torch.Tensor:
    if isinstance(rows, slice):
        return torch.arange(rows.start, rows.stop, device=device)
    return rows


def _expand_every_slot(y: torch.Tensor, b_stacks: list[torch.Tensor], scales: torch.Tensor, batch: LoraBatch,
                       out: torch.Tensor) -> None:
    num_slots, own, offset = b_stacks[0].shape[0], batch.own_slots, 0
    for index, b in enumerate(b_stacks):
        width, rank = b.shape[1], b.shape[2]
        every = y[index] @ b.float().reshape(num_slots * width, rank).t()
        scale = scales[index].float()[own.slots] * own.keep
        delta = every.view(-1, num_slots, width)[own.rows, own.slots] * scale[:, None]
        out[:, offset : offset + width] += delta.to(out.dtype)
        offset += width
