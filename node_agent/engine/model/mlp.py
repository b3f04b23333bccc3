"""The MLP side of a layer: the gated MLP, the expert block (`MoE`, over `moe.SparseMoeBlock`) and Qwen2-MoE's gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from node_agent.engine.kernels import LoraBatch
from node_agent.engine.model.checkpoint import Checkpoint
from node_agent.engine.model.context import RankSetup
from node_agent.engine.model.moe import ExpertLoraLinear, ExpertSlotView, Routing, SparseMoeBlock
from node_agent.engine.model_config import MLA_ARCHITECTURES
from node_agent.engine.parallel.distributed import all_reduce
from node_agent.engine.parallel.sharding import EXPERT_KINDS, MODULE_KINDS, local_experts, module_layout

# The MLP side of every layer (dense MLP, the expert block's one reduction, the DP-attention
# gather before it) runs over the dense MLP's group.
MLP_GROUP = MODULE_KINDS["down_proj"].group


class MLP(nn.Module):
    """Gated MLP, TP over all ranks; `prefix` names the module kinds ("" dense, "shared_expert.")."""

    def __init__(self, setup: RankSetup, prefix: str = "") -> None:
        super().__init__()
        self.gate_up_proj = setup.lora_linear(f"{prefix}gate_up_proj", setup.cfg.mlp_bias)
        self.down_proj = setup.lora_linear(f"{prefix}down_proj", setup.cfg.mlp_bias)

    def forward(self, x: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """The MLP of every token, reduced over the full group by down_proj."""
        gate, up = self.gate_up_proj(x, batch).chunk(2, dim=-1)
        result: torch.Tensor = self.down_proj(F.silu(gate) * up, batch)
        return result

    def load_base(self, checkpoint: Checkpoint, prefix: str) -> None:
        """Read this rank's slices of the MLP weights under `prefix`."""
        self.gate_up_proj.load_base(checkpoint, prefix)
        self.down_proj.load_base(checkpoint, prefix)


class MoE(nn.Module):
    """The expert block of a layer: this rank's experts, then one reduction over the full group."""

    def __init__(self, setup: RankSetup) -> None:
        super().__init__()
        cfg, moe = setup.cfg, setup.cfg.experts()
        experts = local_experts(cfg, setup.topology, setup.rank)
        gate_up, down = (
            ExpertLoraLinear(
                module_layout(cfg, setup.topology, setup.rank, kind),
                experts,
                setup.groups.get(MODULE_KINDS[kind].group),
                setup.capacity,
                setup.dtype,
                setup.device,
            )
            for kind in EXPERT_KINDS
        )
        self.deepseek = cfg.model_type in MLA_ARCHITECTURES
        self.block = SparseMoeBlock(Routing.of(moe, self.deepseek), cfg.hidden_size, gate_up, down, setup.dtype, setup.device)
        self.full_group = setup.groups.get(MLP_GROUP)
        self.shared_expert: SharedExpert | MLP | None = None
        if moe.shared_expert_intermediate_size:
            # Qwen2-MoE's one gated shared expert, or DeepSeek's ungated shared experts (one MLP).
            self.shared_expert = SharedExpert(setup) if moe.shared_expert_gated else MLP(setup, prefix="shared_experts.")

    def forward(self, x: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """Routed experts (one reduction over the full group) plus the shared expert, if any."""
        out = all_reduce(self.block(x, batch), self.full_group)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x, batch)
        return out

    def load_base(self, checkpoint: Checkpoint, prefix: str) -> None:
        """Read the router, this rank's experts and the shared expert under `prefix` (`model.layers.N.mlp`)."""
        self.block.router.copy_(checkpoint.read(f"{prefix}.gate.weight"))
        if self.block.routing.kind == "sigmoid_group_limited":
            self.block.score_bias.copy_(checkpoint.read(f"{prefix}.gate.e_score_correction_bias"))
        self.block.gate_up.load_base(checkpoint, f"{prefix}.experts")
        self.block.down.load_base(checkpoint, f"{prefix}.experts")
        if isinstance(self.shared_expert, SharedExpert):
            self.shared_expert.load_base(checkpoint, prefix)
        elif self.shared_expert is not None:
            self.shared_expert.load_base(checkpoint, f"{prefix}.shared_experts")

    def slot_views(self) -> dict[tuple[str, int], ExpertSlotView]:
        """One pool-facing view per (expert kind, global expert id) held here."""
        views = {}
        for kind, module in zip(EXPERT_KINDS, (self.block.gate_up, self.block.down), strict=True):
            for local, expert in enumerate(range(module.experts.start, module.experts.stop)):
                views[(kind, expert)] = ExpertSlotView(module, local)
        return views


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a full-TP MLP scaled per token by its replicated gate."""

    def __init__(self, setup: RankSetup) -> None:
        super().__init__()
        self.mlp = MLP(setup, prefix="shared_expert.")
        self.gate = setup.lora_linear("shared_expert_gate", False)

    def forward(self, x: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """sigmoid(gate(x)) · mlp(x); the MLP reduces inside its own down_proj (a full-TP row layer)."""
        gate: torch.Tensor = self.gate(x, batch)
        expert: torch.Tensor = self.mlp(x, batch)
        return torch.sigmoid(gate) * expert

    def load_base(self, checkpoint: Checkpoint, prefix: str) -> None:
        """Read the shared expert and its gate under `prefix` (`model.layers.N.mlp`)."""
        self.mlp.load_base(checkpoint, f"{prefix}.shared_expert")
        self.gate.load_base(checkpoint, prefix)
