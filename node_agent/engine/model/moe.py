"""Routed experts with expert parallelism and expert LoRA (Qwen-MoE, DeepSeek-V2/V3; docs/design.md §2, §3).

A rank holds only its expert-parallel group's experts (`sharding.local_experts`), each split over
the MoE-TP group like a dense MLP. LoRA buffers are indexed by *local* expert id; a token routed
to an expert held elsewhere (or to id −1) is simply not gathered here, so it reads no weights of
this rank. The block's partial output is reduced once, over the full TP group, by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from node_agent.engine import kernels
from node_agent.engine.model.checkpoint import Checkpoint
from node_agent.engine.model.lora_layers import LoraCapacity, LoraPass, SliceWeights, add_lora, fill_slot
from node_agent.engine.model_config import MoEConfig
from node_agent.engine.parallel.sharding import LoraSliceLayout, ModuleLayout, ParallelStyle, Span, lora_fully_sharded, lora_layout


class ExpertLoraLinear(nn.Module):
    """One projection (gate_up or down) of every local expert, with per-expert LoRA slots."""

    def __init__(
        self,
        layout: ModuleLayout,
        experts: Span,
        group: dist.ProcessGroup | None,
        capacity: LoraCapacity,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.experts = experts
        self.group = group
        self.style = layout.kind.style
        self.lora = lora_layout(layout, capacity.max_rank, capacity.fully_sharded)
        self.gathers_shrink = lora_fully_sharded(layout.shard, capacity.fully_sharded)
        count = experts.width
        self.weight = nn.Parameter(torch.empty(count, *layout.base_shape, dtype=dtype, device=device), requires_grad=False)
        self.a_stacks = [torch.zeros(capacity.slots, count, s.a_rank.width, s.a_in.width, dtype=dtype, device=device) for s in self.lora]
        self.b_stacks = [torch.zeros(capacity.slots, count, s.b_out.width, s.b_rank.width, dtype=dtype, device=device) for s in self.lora]
        self.scales = torch.zeros(len(self.lora), capacity.slots, count, dtype=torch.float32, device=device)

    def load_base(self, checkpoint: Checkpoint, prefix: str) -> None:
        """Read every local expert's slices from per-expert tensors (`{prefix}.{id}.gate_proj...`)."""
        for local, expert in enumerate(range(self.experts.start, self.experts.stop)):
            if self.style is ParallelStyle.COLUMN:
                rows = [checkpoint.read(f"{prefix}.{expert}.{s.peft_module}.weight", rows=s.out) for s in self.layout.slices]
                self.weight[local].copy_(torch.cat(rows))
            else:
                (only,) = self.layout.slices
                self.weight[local].copy_(checkpoint.read(f"{prefix}.{expert}.{only.peft_module}.weight", cols=only.inp))

    def set_expert_slot(self, slot: int, local: int, weights: list[SliceWeights | None]) -> None:
        """Write one adapter's slices of local expert `local` into `slot` (untargeted: zero)."""
        fill_slot([a[slot, local] for a in self.a_stacks], [b[slot, local] for b in self.b_stacks], self.scales[:, slot, local], weights)

    def forward(self, x: torch.Tensor, local: int, batch: kernels.LoraBatch) -> torch.Tensor:
        """This rank's output of local expert `local` for its routed tokens `x` (unreduced)."""
        out = F.linear(x, self.weight[local])
        expert = LoraPass(
            [a[:, local] for a in self.a_stacks],
            [b[:, local] for b in self.b_stacks],
            self.scales[:, :, local],
            self.style,
            self.lora,
            self.gathers_shrink,
            self.group,
        )
        add_lora(x, out, expert, batch)
        return out


class ExpertSlotView:
    """One local expert of an `ExpertLoraLinear`, seen by the pool as a module of its own."""

    def __init__(self, module: ExpertLoraLinear, local: int) -> None:
        self.module = module
        self.local = local

    def set_slot(self, slot: int, weights: list[SliceWeights | None]) -> None:
        """Write one adapter's slices of this expert into `slot`."""
        self.module.set_expert_slot(slot, self.local, weights)

    def clear_slot(self, slot: int) -> None:
        """Zero this expert's part of `slot`."""
        self.module.set_expert_slot(slot, self.local, [None] * len(self.module.lora))

    def lora_slices(self) -> tuple[LoraSliceLayout, ...]:
        """The A/B slices one slot of this expert holds."""
        return self.module.lora

    def slot_shapes(self) -> list[tuple[list[int], list[int]]]:
        """Per slice: the (A, B) shape of this expert's buffers in one slot."""
        return [(list(a.shape[2:]), list(b.shape[2:])) for a, b in zip(self.module.a_stacks, self.module.b_stacks, strict=True)]


@dataclass(frozen=True)
class Routing:
    """How the router picks `top_k` of `num_experts` experts per token (`model_config.ROUTINGS`),
    as each family's transformers router does; `norm_topk_prob`: the chosen weights sum to one.

    * "softmax": top-k of the softmax (Qwen-MoE; DeepSeek-V2 "greedy");
    * "softmax_group_limited": DeepSeek-V2: only experts of the `topk_groups` groups with the
      highest best score compete;
    * "sigmoid_group_limited": DeepSeek-V3: sigmoid scores; groups ranked by the sum of their two
      best bias-corrected scores; experts chosen by bias-corrected score, weighted by the plain one.
    DeepSeek computes the router logits in fp32 (`fp32_logits`) and scales the weights last.
    """

    num_experts: int
    top_k: int
    norm_topk_prob: bool
    kind: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    scaling: float = 1.0
    fp32_logits: bool = False

    @classmethod
    def of(cls, moe: MoEConfig, deepseek: bool) -> Routing:
        """The routing of a model's expert config."""
        return cls(
            moe.num_experts,
            moe.top_k,
            moe.norm_topk_prob,
            moe.routing,
            moe.num_groups,
            moe.topk_groups,
            moe.routed_scaling_factor,
            deepseek,
        )


class SparseMoeBlock(nn.Module):
    """Router (replicated) + this rank's experts; returns the partial output to be reduced."""

    def __init__(
        self, routing: Routing, hidden: int, gate_up: ExpertLoraLinear, down: ExpertLoraLinear, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.routing = routing
        num_experts = routing.num_experts
        self.router = nn.Parameter(torch.zeros(num_experts, hidden, dtype=dtype, device=device), requires_grad=False)
        # DeepSeek-V3's e_score_correction_bias (zero, and unused, for the other routings).
        self.score_bias = nn.Parameter(torch.zeros(num_experts, dtype=dtype, device=device), requires_grad=False)
        self.gate_up = gate_up
        self.down = down

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids and weights per token, as transformers' router of the family computes them."""
        routing = self.routing
        if routing.fp32_logits:
            logits = F.linear(x.float(), self.router.float())
        else:
            logits = F.linear(x, self.router)
        if routing.kind == "sigmoid_group_limited":
            weights, ids = self._sigmoid_group_limited(logits.sigmoid())
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            if routing.kind == "softmax_group_limited":
                best = probs.view(-1, routing.num_groups, probs.shape[-1] // routing.num_groups).amax(dim=-1)
                probs = probs.masked_fill(~self._group_mask(best), 0.0)
            weights, ids = torch.topk(probs, routing.top_k, dim=-1)
            if routing.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if routing.scaling != 1.0:
            weights = weights * routing.scaling
        return ids, weights.to(x.dtype)

    def _sigmoid_group_limited(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3: pick by bias-corrected score inside the best groups, weigh by the score itself."""
        groups = self.routing.num_groups
        choice = scores + self.score_bias.float()
        group_scores = choice.view(-1, groups, choice.shape[-1] // groups).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~self._group_mask(group_scores), float("-inf"))
        ids = torch.topk(choice, self.routing.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.routing.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, ids

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, num_experts] bool: the experts of each token's `topk_groups` best groups."""
        chosen = torch.topk(group_scores, self.routing.topk_groups, dim=-1)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        experts = self.router.shape[0]
        return mask[:, :, None].expand(-1, -1, experts // self.routing.num_groups).reshape(-1, experts)

    def forward(self, x: torch.Tensor, batch: kernels.LoraBatch) -> torch.Tensor:
        """Route `x` and return this rank's partial expert output (reduced by the caller)."""
        ids, weights = self.route(x)
        return self.experts_forward(x, ids, weights, batch)

    def experts_forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, batch: kernels.LoraBatch) -> torch.Tensor:
        """Sum over this rank's experts of weight · expert(x) for the tokens routed to them.

        `ids` may hold experts of other ranks and −1 (no expert); those rows contribute nothing.
        Every rank of a MoE-TP group holds the same experts and sees the same routing, so the
        group's collectives inside the experts line up.
        """
        out = torch.zeros_like(x)
        experts = self.gate_up.experts
        for local, expert in enumerate(range(experts.start, experts.stop)):
            token_idx, k_pos = torch.where(ids == expert)
            if token_idx.numel() == 0:
                continue
            expert_batch = kernels.LoraBatch.from_token_slots(batch.token_slots[token_idx])
            gate, up = self.gate_up(x[token_idx], local, expert_batch).chunk(2, dim=-1)
            hidden = self.down(F.silu(gate) * up, local, expert_batch)
            out.index_add_(0, token_idx, hidden * weights[token_idx, k_pos, None])
        return out
