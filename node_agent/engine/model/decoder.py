"""The decoder (Llama, Qwen3, Qwen-MoE, DeepSeek-V2/V3) sharded for TP with DP attention (docs/design.md §2).

Per layer: each attention group runs norm → QKV → attention → o_proj on its own tokens
(o_proj reduces inside the attention-TP group only); the groups' hidden states are then
gathered so the MLP runs TP over all ranks on every token; the MLP output is reduced over the
full group and each attention group keeps its own rows.
"""

from __future__ import annotations

import torch
from torch import nn

from node_agent.engine.model.attention import Attention, LatentAttention
from node_agent.engine.model.checkpoint import Checkpoint
from node_agent.engine.model.context import ForwardContext, RankSetup
from node_agent.engine.model.layers import RMSNorm, VocabParallelEmbedding
from node_agent.engine.model.lora_layers import LoraLinear, LoraSlots
from node_agent.engine.model.mlp import MLP, MLP_GROUP, MoE
from node_agent.engine.model.rope import rope_attention_factor, rope_inv_freq
from node_agent.engine.parallel.distributed import all_reduce
from node_agent.engine.parallel.sharding import ModuleKey


class DecoderLayer(nn.Module):
    """One decoder layer: attention per group, then the MLP or expert block over all ranks."""

    def __init__(self, setup: RankSetup, index: int, sparse: bool) -> None:
        super().__init__()
        cfg = setup.cfg
        self.self_attn: Attention | LatentAttention = LatentAttention(setup, index) if cfg.mla else Attention(setup, index)
        self.mlp: MLP | MoE = MoE(setup) if sparse else MLP(setup)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, setup.dtype, setup.device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, setup.dtype, setup.device)
        self.full_group = setup.groups.get(MLP_GROUP)
        self.dp_size = setup.topology.dp_size

    def load_base(self, checkpoint: Checkpoint, prefix: str) -> None:
        """Read this rank's slices of the layer's weights under `prefix` (`model.layers.N`)."""
        self.input_layernorm.weight.copy_(checkpoint.read(f"{prefix}.input_layernorm.weight"))
        self.post_attention_layernorm.weight.copy_(checkpoint.read(f"{prefix}.post_attention_layernorm.weight"))
        self.self_attn.load_base(checkpoint, f"{prefix}.self_attn")
        self.mlp.load_base(checkpoint, f"{prefix}.mlp")

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Attention on this group's rows, the MLP on every group's rows, this group's rows kept."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), ctx)
        mlp_in = self._gather_groups(self.post_attention_layernorm(hidden), ctx)
        mlp_out: torch.Tensor = self.mlp(mlp_in, ctx.mlp_lora)
        return hidden + mlp_out[ctx.group_offset : ctx.group_offset + hidden.shape[0]]

    def _gather_groups(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Every attention group's tokens on every rank, group-major (identity without DP)."""
        if self.dp_size == 1:
            return x
        # One rank per group contributes its rows; a sum over all ranks assembles the batch.
        everything = torch.zeros(ctx.total_tokens, x.shape[1], dtype=x.dtype, device=x.device)
        if ctx.attn_tp_rank == 0:
            everything[ctx.group_offset : ctx.group_offset + x.shape[0]] = x
        return all_reduce(everything, self.full_group)


class CausalLM(nn.Module):
    """The whole model on one rank, built from `setup`."""

    inv_freq: torch.Tensor  # a registered buffer

    def __init__(self, setup: RankSetup) -> None:
        super().__init__()
        self.cfg = cfg = setup.cfg
        dtype, device = setup.dtype, setup.device
        self.embed_tokens = VocabParallelEmbedding(setup, serves_logits=cfg.tie_word_embeddings)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else VocabParallelEmbedding(setup, serves_logits=True)
        sparse = cfg.moe.sparse_layers if cfg.moe else frozenset()
        layers = [DecoderLayer(setup, index, index in sparse) for index in range(cfg.num_layers)]
        self.layers = nn.ModuleList(layers)
        self.decoder_layers = layers  # the same modules, typed (ModuleList items are plain Modules)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)
        self.rope_factor = rope_attention_factor(cfg)

    def lora_modules(self) -> dict[ModuleKey, LoraSlots]:
        """Every LoRA target the pool fills: (layer, kind) for dense modules, (layer, kind,
        global expert id) for each expert held on this rank."""
        found: dict[ModuleKey, LoraSlots] = {}
        for index, layer in enumerate(self.decoder_layers):
            for module in layer.modules():
                if isinstance(module, LoraLinear):
                    found[(index, module.layout.kind.name)] = module
            if isinstance(layer.mlp, MoE):
                for (kind, expert), view in layer.mlp.slot_views().items():
                    found[(index, kind, expert)] = view
        return found

    def load_base(self, checkpoint: Checkpoint) -> None:
        """Read this rank's slices of every base weight."""
        self.embed_tokens.load(checkpoint, "model.embed_tokens.weight")
        if not self.cfg.tie_word_embeddings:
            self.lm_head.load(checkpoint, "lm_head.weight")
        self.norm.weight.copy_(checkpoint.read("model.norm.weight"))
        for index, layer in enumerate(self.decoder_layers):
            layer.load_base(checkpoint, f"model.layers.{index}")

    def rope_tables(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at each token's absolute position (a chunk starts at its cached length)."""
        index = torch.tensor(positions, dtype=torch.float32, device=self.inv_freq.device)
        freqs = index[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.norm.weight.dtype
        if self.rope_factor != 1.0:  # YaRN scales cos and sin in fp32, before the cast
            return (emb.cos() * self.rope_factor).to(dtype), (emb.sin() * self.rope_factor).to(dtype)
        if dtype == torch.float32:
            return emb.cos(), emb.sin()  # no cast to dispatch
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Logits (float32) of this rank's attention group: `[T_group, vocab]`, or only the rows
        `ctx.logit_rows` (the LM head runs on nothing else)."""
        hidden = self.embed_tokens.embed(tokens)
        for layer in self.decoder_layers:
            hidden = layer(hidden, ctx)
        if ctx.logit_rows is not None:
            hidden = hidden[ctx.logit_rows]
        logits = self.lm_head.logits(self.norm(hidden))
        return logits if logits.dtype == torch.float32 else logits.float()
