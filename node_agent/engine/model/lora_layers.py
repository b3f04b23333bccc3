"""Sharded linear layers with multi-slot LoRA: one class per parallel style (docs/design.md §3).

Each layer owns its base weight shard and `slots` LoRA buffers per output slice. Shapes come
from `sharding.lora_layout`, the same layout the adapter loader slices with. The per-batch slot
mapping is an argument of `forward`, never state kept between batches, so an idle DP group can
not apply a previous batch's adapters.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from node_agent.engine import kernels
from node_agent.engine.kernels import cpu_kernels, dense
from node_agent.engine.model.checkpoint import Checkpoint
from node_agent.engine.parallel.distributed import all_gather_last_dim, all_reduce
from node_agent.engine.parallel.sharding import LoraSliceLayout, ModuleLayout, ParallelStyle, lora_fully_sharded, lora_layout


@dataclass(frozen=True)
class LoraCapacity:
    """Engine-wide LoRA limits every layer allocates for."""

    max_rank: int
    slots: int
    fully_sharded: bool


@dataclass(frozen=True)
class SliceWeights:
    """One slice of one adapter on one rank, already cut to the layer's buffer shapes."""

    a: torch.Tensor  # [a_rank.width, a_in.width]
    b: torch.Tensor  # [b_out.width, b_rank.width]
    scale: float


class LoraSlots(Protocol):
    """What the pool fills: one module's (or one local expert's) LoRA slots on this rank."""

    def set_slot(self, slot: int, weights: list[SliceWeights | None]) -> None:
        """Write one adapter into `slot`; a slice the adapter does not target becomes zero."""

    def clear_slot(self, slot: int) -> None:
        """Zero a slot."""

    def lora_slices(self) -> tuple[LoraSliceLayout, ...]:
        """The A/B slices one slot holds, as `sharding.lora_layout` gives them."""

    def slot_shapes(self) -> list[tuple[list[int], list[int]]]:
        """Per slice: the (A, B) shape of one slot's buffers."""


def fill_slot(a: list[torch.Tensor], b: list[torch.Tensor], scales: torch.Tensor, weights: list[SliceWeights | None]) -> None:
    """Copy one adapter's slices into one slot's A/B views and scale entries; untargeted ones become zero."""
    for index, part in enumerate(weights):
        if part is None:
            a[index].zero_()
            b[index].zero_()
            scales[index] = 0.0
        else:
            a[index].copy_(part.a)
            b[index].copy_(part.b)
            scales[index] = part.scale


@dataclass(frozen=True)
class LoraPass:
    """What one layer's LoRA pass reads besides its input: every slice's A and B stacks and
    scales, the layer's parallel style, LoRA layout and group; `fully_sharded` is
    `sharding.lora_fully_sharded` of the layer; `a_joined` is `a_stacks` as one tensor when they
    are its row blocks (`kernels.shrink`); `slot_views` the same buffers per slot, for
    `kernels.add_fp32`."""

    a_stacks: list[torch.Tensor]
    b_stacks: list[torch.Tensor]
    scales: torch.Tensor
    style: ParallelStyle
    lora: tuple[LoraSliceLayout, ...]
    fully_sharded: bool
    group: dist.ProcessGroup | None
    a_joined: torch.Tensor | None = None
    slot_views: kernels.SlotViews | None = None


def add_lora(x: torch.Tensor, out: torch.Tensor, layer: LoraPass, batch: kernels.LoraBatch) -> None:
    """Add the LoRA delta of `x` into this rank's (unreduced) base output `out`, in place.

    The one place for the collectives of both LoRA modes (docs/design.md §3), used by dense and
    expert layers alike.
    """
    if not batch.active_slots:
        return  # no token uses an adapter: the delta is zero, and so would every collective's be
    views = layer.slot_views
    if not layer.fully_sharded and views is not None and kernels.add_fp32(x, out, views, layer.scales, batch):
        return  # no collective of its own: the default mode's delta is added before the layer's reduction
    shrunk = kernels.shrink(x, layer.a_stacks, batch, layer.a_joined)
    if layer.fully_sharded and layer.style is ParallelStyle.ROW:
        # Complete the shrink first, then this rank adds only its own block of output columns;
        # the base reduction afterwards assembles the LoRA output with the base.
        all_reduce(shrunk, layer.group)
        block = layer.lora[0].b_out
        kernels.expand(shrunk, layer.b_stacks, layer.scales, batch, out[:, block.start : block.stop])
        return
    if layer.fully_sharded:
        # Column layer: every rank computed r/size rows of the rank dim; assemble the full rank.
        shrunk = all_gather_last_dim(shrunk, layer.group)
    # Row layer, default mode: the delta of a partial input is partial too, added before the
    # layer's one reduction.
    kernels.expand(shrunk, layer.b_stacks, layer.scales, batch, out)


def _b_stack(slots: int, width: int, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One slice's zeroed B stack, `[slots, width, rank]`. On the CPU it is a view of `[slots,
    rank, width]` memory: each slot's B column-major, so the one-row expand (`addmv_`) streams B
    as `rank` runs of `width` floats instead of `width` dot products of `rank` (16) floats,
    which shortens a decode step's LoRA pass (docs/kernels.md, "The CPU path"). CUDA keeps the
    row-major layout the triton kernels read."""
    if device.type == "cpu":
        return torch.zeros(slots, rank, width, dtype=dtype, device=device).transpose(1, 2)
    return torch.zeros(slots, width, rank, dtype=dtype, device=device)


class LoraLinear(nn.Module):
    """Common part: base weight shard, LoRA buffers, slot management."""

    style: ParallelStyle

    def __init__(
        self,
        layout: ModuleLayout,
        group: dist.ProcessGroup | None,
        capacity: LoraCapacity,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.group = group
        self.lora = lora_layout(layout, capacity.max_rank, capacity.fully_sharded)
        self.gathers_shrink = lora_fully_sharded(layout.shard, capacity.fully_sharded)
        out_width, in_width = layout.base_shape
        self.weight = nn.Parameter(torch.empty(out_width, in_width, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_width, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.packed: dense.Packed | None = None  # `dense.pack` of the weight, once loaded
        self.widens = dense.widens(self.weight)
        # Every slice's A as consecutive row blocks of one tensor, so the CPU path's shrink
        # serves all slices (q, k, v; gate, up) with one product (`torch_ops.shrink`'s `joined`).
        self.a_joined = self._joined_a_stacks(capacity.slots, dtype, device)
        starts = list(itertools.accumulate((s.a_rank.width for s in self.lora), initial=0))
        self.a_stacks = [self.a_joined[:, start:stop] for start, stop in itertools.pairwise(starts)]
        self.b_stacks = [_b_stack(capacity.slots, s.b_out.width, s.b_rank.width, dtype, device) for s in self.lora]
        self.scales = torch.zeros(len(self.lora), capacity.slots, dtype=torch.float32, device=device)
        # Views of the same memory: what `set_slot` writes, they show.
        self.slot_views = kernels.SlotViews(
            tuple(self.a_joined.unbind(0)),
            tuple(zip(*(b.unbind(0) for b in self.b_stacks), strict=True)),
            cpu_kernels.lora_buffers(self.a_joined, self.b_stacks, self.scales),
        )
        self.lora_pass = LoraPass(
            self.a_stacks,
            self.b_stacks,
            self.scales,
            self.style,
            self.lora,
            self.gathers_shrink,
            self.group,
            self.a_joined,
            self.slot_views,
        )

    def _joined_a_stacks(self, slots: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`[slots, Σ rank widths, in]`, zeroed: every slice's A stack as its row block. All slices
        of a layer share the input width; the layout checks it."""
        widths = {s.a_in.width for s in self.lora}
        if len(widths) != 1:
            raise ValueError(f"{self.layout.kind.name}: LoRA slices with different input widths {sorted(widths)}")
        return torch.zeros(slots, sum(s.a_rank.width for s in self.lora), widths.pop(), dtype=dtype, device=device)

    def load_base(self, checkpoint: Checkpoint, prefix: str) -> None:
        """Read this rank's slices of the base weight (and bias) under `prefix`, and the
        weight's copy for `dense.linear`."""
        self.read_base(checkpoint, prefix)
        self.packed = dense.pack(self.weight.detach())

    def read_base(self, checkpoint: Checkpoint, prefix: str) -> None:
        """Copy this rank's slices of the base weight (and bias) into `weight` and `bias`."""
        raise NotImplementedError

    def set_slot(self, slot: int, weights: list[SliceWeights | None]) -> None:
        """Write one adapter into `slot`; a slice the adapter does not target becomes zero."""
        fill_slot([a[slot] for a in self.a_stacks], [b[slot] for b in self.b_stacks], self.scales[:, slot], weights)

    def clear_slot(self, slot: int) -> None:
        """Zero a slot, so nothing of the adapter that held it can leak into a later one."""
        self.set_slot(slot, [None] * len(self.lora))

    def lora_slices(self) -> tuple[LoraSliceLayout, ...]:
        """The A/B slices one slot holds."""
        return self.lora

    def add_lora(self, x: torch.Tensor, out: torch.Tensor, batch: kernels.LoraBatch) -> None:
        """Add this layer's LoRA delta of `x` into its unreduced output `out`."""
        add_lora(x, out, self.lora_pass, batch)

    def base_and_lora(self, x: torch.Tensor, batch: kernels.LoraBatch, bias: torch.Tensor | None) -> torch.Tensor:
        """This rank's unreduced output `x · weightᵀ + bias` plus the LoRA delta; in fp32 for a
        layer that `widens` (the caller casts back once, after any reduction)."""
        if self.widens:
            wide, out = dense.linear_widened(x, self.weight, self.packed, bias)
            self.add_lora(wide, out, batch)
            return out
        out = dense.linear(x, self.weight, self.packed, bias)
        self.add_lora(x, out, batch)
        return out

    def slot_shapes(self) -> list[tuple[list[int], list[int]]]:
        """Per slice: the (A, B) shape of one slot's buffers."""
        return [(list(a.shape[1:]), list(b.shape[1:])) for a, b in zip(self.a_stacks, self.b_stacks, strict=True)]


class ColumnParallelLoraLinear(LoraLinear):
    """Output features split over the group (qkv_proj, gate_up_proj); no reduction."""

    style = ParallelStyle.COLUMN

    def read_base(self, checkpoint: Checkpoint, prefix: str) -> None:
        rows = [checkpoint.read(f"{prefix}.{s.peft_module}.weight", rows=s.out) for s in self.layout.slices]
        self.weight.copy_(torch.cat(rows))
        if self.bias is not None:
            self.bias.copy_(torch.cat([checkpoint.read(f"{prefix}.{s.peft_module}.bias", rows=s.out) for s in self.layout.slices]))

    def forward(self, x: torch.Tensor, batch: kernels.LoraBatch) -> torch.Tensor:
        """This rank's output columns, base plus LoRA."""
        out = self.base_and_lora(x, batch, self.bias)
        return out.to(x.dtype) if self.widens else out


class RowParallelLoraLinear(LoraLinear):
    """Input features split over the group (o_proj, down_proj); one reduction over the group."""

    style = ParallelStyle.ROW

    def read_base(self, checkpoint: Checkpoint, prefix: str) -> None:
        (only,) = self.layout.slices
        key = f"{prefix}.{only.peft_module}"
        self.weight.copy_(checkpoint.read(f"{key}.weight", cols=only.inp))
        if self.bias is not None:
            self.bias.copy_(checkpoint.read(f"{key}.bias"))

    def forward(self, x: torch.Tensor, batch: kernels.LoraBatch) -> torch.Tensor:
        """The full output: partial base plus LoRA, reduced once over the layer's group."""
        partial = self.base_and_lora(x, batch, None)
        all_reduce(partial, self.group)
        if self.bias is not None:
            partial += self.bias
        return partial.to(x.dtype) if self.widens else partial


class ReplicatedLoraLinear(ColumnParallelLoraLinear):
    """Held whole by every rank (e.g. the shared-expert gate): a column layer of group size 1."""

    style = ParallelStyle.REPLICATED


LAYER_CLASSES: dict[ParallelStyle, type[LoraLinear]] = {
    ParallelStyle.COLUMN: ColumnParallelLoraLinear,
    ParallelStyle.ROW: RowParallelLoraLinear,
    ParallelStyle.REPLICATED: ReplicatedLoraLinear,
}
