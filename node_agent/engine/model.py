"""Dense decoder (Llama and Qwen3 families) sharded for TP with DP attention (DESIGN.md §2).

Per layer: each attention group runs norm → QKV → attention → o_proj on its own tokens
(o_proj reduces inside the attention-TP group only); the groups' hidden states are then
gathered so the MLP runs TP over all ranks on every token; the MLP output is reduced over the
full group and each attention group keeps its own rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from node_agent.engine.checkpoint import Checkpoint
from node_agent.engine.distributed import ProcessGroups, all_gather_last_dim, all_reduce
from node_agent.engine.kernels import LoraBatch
from node_agent.engine.lora_layers import LAYER_CLASSES, LoraCapacity, LoraLinear
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.moe import ExpertLoraLinear, ExpertSlotView, SparseMoeBlock
from node_agent.engine.sharding import (
    MODULE_KINDS,
    ShardGroup,
    effective_shard,
    kv_heads_on_rank,
    local_experts,
    module_layout,
    vocab_span,
)
from node_agent.engine.topology import Topology

# Embedding and LM head work on one attention group's tokens, so they shard like attention.
VOCAB_GROUP = ShardGroup.ATTN_TP


@dataclass
class ForwardContext:
    """Everything one forward needs to know about the batch, as seen from one rank."""

    seq_lens: list[int]  # this attention group's sequences, in order
    group_token_counts: list[int]  # tokens of every attention group
    attn_dp_rank: int
    attn_tp_rank: int
    attn_lora: LoraBatch  # slots of this group's tokens
    mlp_lora: LoraBatch  # slots of all tokens, group-major order
    cos: torch.Tensor  # [T_group, head_dim]
    sin: torch.Tensor

    @property
    def group_offset(self) -> int:
        return sum(self.group_token_counts[: self.attn_dp_rank])

    @property
    def total_tokens(self) -> int:
        return sum(self.group_token_counts)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as transformers does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama-3 scaling when the config asks for it."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class VocabParallelEmbedding(nn.Module):
    """Rows of the (padded) vocabulary split over the attention-TP group."""

    def __init__(self, cfg: ModelConfig, topology: Topology, rank: int, groups: ProcessGroups, dtype, device) -> None:
        super().__init__()
        shard = effective_shard(topology, rank, VOCAB_GROUP)
        self.span = vocab_span(cfg.vocab_size, shard)
        self.vocab_size = cfg.vocab_size
        self.group = groups.get(VOCAB_GROUP)
        self.weight = nn.Parameter(torch.zeros(self.span.width, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False)

    def load(self, checkpoint: Checkpoint, key: str) -> None:
        self.weight.copy_(checkpoint.read(key, rows=self.span))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.span.start
        mine = (local >= 0) & (local < self.span.width)
        out = F.embedding(local.clamp(0, self.span.width - 1), self.weight) * mine[:, None].to(self.weight.dtype)
        return all_reduce(out, self.group)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: this rank's vocabulary columns, gathered over the group, padding dropped."""
        local = F.linear(hidden, self.weight)
        return all_gather_last_dim(local, self.group)[:, : self.vocab_size]


class Attention(nn.Module):
    def __init__(self, cfg, topology, rank, groups, capacity, dtype, device) -> None:
        super().__init__()
        self.qkv_proj = _lora_linear(cfg, topology, rank, groups, capacity, "qkv_proj", cfg.attention_bias, dtype, device)
        self.o_proj = _lora_linear(cfg, topology, rank, groups, capacity, "o_proj", False, dtype, device)
        shard = self.qkv_proj.layout.shard
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_heads // shard.size
        self.num_kv_heads = kv_heads_on_rank(cfg, shard).width
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x, ctx.attn_lora)
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        out = torch.empty(tokens, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        start = 0
        for length in ctx.seq_lens:
            end = start + length
            # [heads, T, d]; GQA by repeating KV heads up to the local query heads.
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            repeat = self.num_heads // self.num_kv_heads
            ks, vs = ks.repeat_interleave(repeat, dim=0), vs.repeat_interleave(repeat, dim=0)
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
            start = end
        return self.o_proj(out.reshape(tokens, q_width), ctx.attn_lora)


class MLP(nn.Module):
    """Gated MLP, TP over all ranks; `prefix` names the module kinds ("" dense, "shared_expert.")."""

    def __init__(self, cfg, topology, rank, groups, capacity, dtype, device, prefix: str = "") -> None:
        super().__init__()
        self.gate_up_proj = _lora_linear(cfg, topology, rank, groups, capacity, f"{prefix}gate_up_proj", cfg.mlp_bias, dtype, device)
        self.down_proj = _lora_linear(cfg, topology, rank, groups, capacity, f"{prefix}down_proj", cfg.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, batch).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up, batch)

    def load_base(self, checkpoint: Checkpoint, prefix: str) -> None:
        self.gate_up_proj.load_base(checkpoint, prefix)
        self.down_proj.load_base(checkpoint, prefix)


class MoE(nn.Module):
    """The expert block of a layer: this rank's experts, then one reduction over the full group."""

    def __init__(self, cfg, topology, rank, groups, capacity, dtype, device) -> None:
        super().__init__()
        experts = local_experts(cfg, topology, rank)
        moe_group = groups.get(ShardGroup.MOE_TP)
        projections = [
            ExpertLoraLinear(module_layout(cfg, topology, rank, kind), experts, moe_group, capacity, dtype, device)
            for kind in ("experts.gate_up_proj", "experts.down_proj")
        ]
        self.block = SparseMoeBlock(cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.norm_topk_prob, cfg.hidden_size,
                                    *projections, dtype, device)
        self.full_group = groups.get(ShardGroup.FULL_TP)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, topology, rank, groups, capacity, dtype, device, prefix="shared_expert.")
            self.shared_expert_gate = _lora_linear(cfg, topology, rank, groups, capacity, "shared_expert_gate", False, dtype, device)

    def forward(self, x: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        out = all_reduce(self.block(x, batch), self.full_group)
        if self.shared_expert is not None:
            # The shared expert reduces inside its own down_proj (a full-TP row layer).
            out = out + torch.sigmoid(self.shared_expert_gate(x, batch)) * self.shared_expert(x, batch)
        return out

    def load_base(self, checkpoint: Checkpoint, prefix: str) -> None:
        self.block.router.copy_(checkpoint.read(f"{prefix}.gate.weight"))
        self.block.gate_up.load_base(checkpoint, f"{prefix}.experts")
        self.block.down.load_base(checkpoint, f"{prefix}.experts")
        if self.shared_expert is not None:
            self.shared_expert.load_base(checkpoint, f"{prefix}.shared_expert")
            self.shared_expert_gate.load_base(checkpoint, prefix)

    def slot_views(self) -> dict[tuple[str, int], ExpertSlotView]:
        """One pool-facing view per (expert kind, global expert id) held here."""
        views = {}
        for kind, module in (("experts.gate_up_proj", self.block.gate_up), ("experts.down_proj", self.block.down)):
            for local, expert in enumerate(range(module.experts.start, module.experts.stop)):
                views[(kind, expert)] = ExpertSlotView(module, local)
        return views


class DecoderLayer(nn.Module):
    def __init__(self, cfg, topology, rank, groups, capacity, dtype, device, sparse: bool) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, topology, rank, groups, capacity, dtype, device)
        mlp_class = MoE if sparse else MLP
        self.mlp = mlp_class(cfg, topology, rank, groups, capacity, dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.full_group = groups.get(ShardGroup.FULL_TP)
        self.dp_size = topology.dp_size

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), ctx)
        mlp_in = self._gather_groups(self.post_attention_layernorm(hidden), ctx)
        mlp_out = self.mlp(mlp_in, ctx.mlp_lora)
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
    """The whole model on one rank."""

    def __init__(self, cfg: ModelConfig, topology: Topology, rank: int, groups: ProcessGroups,
                 capacity: LoraCapacity, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg, topology, rank, groups, dtype, device)
        self.lm_head = (
            self.embed_tokens if cfg.tie_word_embeddings
            else VocabParallelEmbedding(cfg, topology, rank, groups, dtype, device)
        )
        sparse = cfg.moe.sparse_layers if cfg.moe else frozenset()
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, topology, rank, groups, capacity, dtype, device, index in sparse)
            for index in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)

    def lora_modules(self) -> dict[tuple, LoraLinear | ExpertSlotView]:
        """Every LoRA target the pool fills: (layer, kind) for dense modules, (layer, kind,
        global expert id) for each expert held on this rank."""
        found: dict[tuple, LoraLinear | ExpertSlotView] = {}
        for index, layer in enumerate(self.layers):
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
        for index, layer in enumerate(self.layers):
            prefix = f"model.layers.{index}"
            layer.input_layernorm.weight.copy_(checkpoint.read(f"{prefix}.input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(checkpoint.read(f"{prefix}.post_attention_layernorm.weight"))
            layer.self_attn.qkv_proj.load_base(checkpoint, f"{prefix}.self_attn")
            layer.self_attn.o_proj.load_base(checkpoint, f"{prefix}.self_attn")
            if layer.self_attn.q_norm is not None:
                layer.self_attn.q_norm.weight.copy_(checkpoint.read(f"{prefix}.self_attn.q_norm.weight"))
                layer.self_attn.k_norm.weight.copy_(checkpoint.read(f"{prefix}.self_attn.k_norm.weight"))
            layer.mlp.load_base(checkpoint, f"{prefix}.mlp")

    def rope_tables(self, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions 0..len-1 of each sequence, concatenated."""
        positions = torch.cat([torch.arange(n, device=self.inv_freq.device) for n in seq_lens]) if seq_lens else (
            torch.zeros(0, device=self.inv_freq.device)
        )
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.norm.weight.dtype
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Logits [T_group, vocab] for this rank's attention group (float32)."""
        hidden = self.embed_tokens.embed(tokens)
        for layer in self.layers:
            hidden = layer(hidden, ctx)
        return self.lm_head.logits(self.norm(hidden)).float()


def _lora_linear(cfg, topology, rank, groups, capacity, kind_name, bias, dtype, device) -> LoraLinear:
    kind = MODULE_KINDS[kind_name]
    layout = module_layout(cfg, topology, rank, kind_name)
    return LAYER_CLASSES[kind.style](layout, groups.get(kind.group), capacity, bias, dtype, device)
