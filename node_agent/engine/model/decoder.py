"""The decoder (Llama, Qwen3, Qwen-MoE, DeepSeek-V2/V3) sharded for TP with DP attention (docs/design.md §2).

Per layer: each attention group runs norm → QKV → attention → o_proj on its own tokens
(o_proj reduces inside the attention-TP group only); the groups' hidden states are then
gathered so the MLP runs TP over all ranks on every token; the MLP output is reduced over the
full group and each attention group keeps its own rows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from node_agent.engine.kernels import LoraBatch, dense, paged_attention
from node_agent.engine.model.checkpoint import Checkpoint
from node_agent.engine.model.lora_layers import LAYER_CLASSES, LoraCapacity, LoraLinear, LoraSlots
from node_agent.engine.model.moe import ExpertLoraLinear, ExpertSlotView, Routing, SparseMoeBlock
from node_agent.engine.model_config import MLA_ARCHITECTURES, ModelConfig, yarn_mscale
from node_agent.engine.parallel.distributed import ProcessGroups, all_gather_last_dim, all_reduce
from node_agent.engine.parallel.sharding import (
    EXPERT_KINDS,
    MODULE_KINDS,
    ModuleKey,
    attention_heads,
    local_experts,
    module_layout,
    vocab_span,
)
from node_agent.engine.parallel.topology import Topology
from node_agent.engine.serving.kv_cache import PagedKVCache

# The MLP side of every layer (dense MLP, the expert block's one reduction, the DP-attention
# gather before it) runs over the dense MLP's group.
MLP_GROUP = MODULE_KINDS["down_proj"].group


@dataclass(frozen=True)
class RankSetup:
    """What every module of one rank is built from."""

    cfg: ModelConfig
    topology: Topology
    rank: int
    groups: ProcessGroups
    capacity: LoraCapacity
    dtype: torch.dtype
    device: torch.device

    def lora_linear(self, kind_name: str, bias: bool) -> LoraLinear:
        """The LoRA layer of module kind `kind_name`, built with its kind's group and layout."""
        kind = MODULE_KINDS[kind_name]
        layout = module_layout(self.cfg, self.topology, self.rank, kind_name)
        return LAYER_CLASSES[kind.style](layout, self.groups.get(kind.group), self.capacity, bias, self.dtype, self.device)


@dataclass
class AttentionBatch:
    """Where this group's new tokens sit in the paged KV cache (docs/serving.md).

    Sequence `i` computes its last `query_lens[i]` of `context_lens[i]` tokens; its new tokens'
    K/V go to `slot_mapping` and it attends through row `i` of `block_tables`.
    """

    kv: PagedKVCache
    slot_mapping: torch.Tensor  # [T_group] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_lens: list[int]
    context_lens: list[int]

    @property
    def decode_only(self) -> bool:
        """Every sequence computes one token (a batched decode)."""
        return bool(self.query_lens) and all(n == 1 for n in self.query_lens)

    @functools.cached_property
    def first_block(self) -> int | None:
        """For a lone sequence whose blocks are consecutive, its first block (the decode then reads
        its context as a view of the cache; `paged_attention.consecutive_blocks`), found once for
        every layer."""
        return paged_attention.consecutive_blocks(self.block_tables, self.context_lens, self.kv.layout.block_size)

    @functools.cached_property
    def context_tensor(self) -> torch.Tensor:
        """`context_lens` as an int32 tensor on the cache's device, made once for every layer."""
        return torch.tensor(self.context_lens, dtype=torch.int32, device=self.slot_mapping.device)


def block_table_tensor(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """int32 `[num_seqs, max_blocks]`, short rows padded with block 0 (never read unmasked)."""
    width = max((len(t) for t in tables), default=0) or 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device).reshape(-1, width)


@dataclass
class ForwardContext:
    """Everything one forward needs to know about the batch, as seen from one rank."""

    group_token_counts: list[int]  # tokens of every attention group
    attn_dp_rank: int
    attn_tp_rank: int
    attn_lora: LoraBatch  # slots of this group's tokens
    mlp_lora: LoraBatch  # slots of all tokens, group-major order
    cos: torch.Tensor  # [T_group, head_dim], at each token's absolute position
    sin: torch.Tensor
    attention: AttentionBatch
    logit_rows: torch.Tensor | None = None  # rows of this group's tokens that need logits (None: all)

    @property
    def group_offset(self) -> int:
        return sum(self.group_token_counts[: self.attn_dp_rank])

    @property
    def total_tokens(self) -> int:
        return sum(self.group_token_counts)


class RMSNorm(nn.Module):
    """RMS normalisation with a learned weight, as transformers computes it."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised `x` in its own dtype."""
        if x.dtype == torch.float32:
            # The same arithmetic in one fused op (nine of these run in every step).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and cast back before the weight, as transformers does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama-3 or YaRN scaling when the config asks for it."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        return _yarn_inv_freq(cfg, scaling, inv_freq)
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_factor(cfg: ModelConfig, scaling: dict[str, Any]) -> float:
    """YaRN's stretch factor; without one, max_position_embeddings over the original (DeepSeek-V3)."""
    factor = scaling.get("factor")
    if factor is None:
        return cfg.max_position_embeddings / float(scaling["original_max_position_embeddings"])
    return float(factor)


def _yarn_inv_freq(cfg: ModelConfig, scaling: dict[str, Any], extrapolation: torch.Tensor) -> torch.Tensor:
    """YaRN: interpolated frequencies below the correction range, extrapolated above, a linear ramp
    between (transformers' `_compute_yarn_parameters`)."""
    dim, base = cfg.head_dim, cfg.rope_theta
    factor = _yarn_factor(cfg, scaling)
    old_context = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each frequency extrapolated
    interpolation = 1.0 / (factor * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return interpolation * (1 - keep) + extrapolation * keep


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor YaRN multiplies cos and sin by (1 for every other RoPE)."""
    scaling = cfg.rope_scaling
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(cfg, scaling)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The RoPE partner of each feature: (-second half, first half)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class VocabParallelEmbedding(nn.Module):
    """Rows of the (padded) vocabulary split over the attention-TP group; `serves_logits`: it is
    (also) the LM head, whose weight gets `dense.pack`'s copy."""

    def __init__(self, setup: RankSetup, serves_logits: bool) -> None:
        super().__init__()
        self.serves_logits = serves_logits
        self.packed: dense.Packed | None = None
        cfg = setup.cfg
        self.span = vocab_span(cfg, setup.topology, setup.rank)
        self.vocab_size = cfg.vocab_size
        self.group = setup.groups.get(MODULE_KINDS["vocab"].group)
        self.weight = nn.Parameter(
            torch.zeros(self.span.width, cfg.hidden_size, dtype=setup.dtype, device=setup.device), requires_grad=False
        )

    def load(self, checkpoint: Checkpoint, key: str) -> None:
        """Read this rank's rows of the embedding (or LM head) `key`."""
        self.weight.copy_(checkpoint.read(key, rows=self.span))
        if self.serves_logits:
            self.packed = dense.pack(self.weight.detach())

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings of `tokens`: each rank looks up its rows, a sum over the group assembles them."""
        if self.group is None:  # one rank holds every row
            return F.embedding(tokens, self.weight)
        local = tokens - self.span.start
        mine = (local >= 0) & (local < self.span.width)
        out = F.embedding(local.clamp(0, self.span.width - 1), self.weight) * mine[:, None].to(self.weight.dtype)
        return all_reduce(out, self.group)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: this rank's vocabulary columns, gathered over the group, padding dropped."""
        local = dense.linear(hidden, self.weight, self.packed)
        return all_gather_last_dim(local, self.group)[:, : self.vocab_size]


class Attention(nn.Module):
    """This rank's heads of one attention group: qkv_proj → attention → o_proj (reduced in the group)."""

    def __init__(self, setup: RankSetup, layer: int) -> None:
        super().__init__()
        cfg = setup.cfg
        self.layer = layer  # which of the KV cache's layers is this one's
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = setup.lora_linear("qkv_proj", cfg.attention_bias)
        self.o_proj = setup.lora_linear("o_proj", False)
        heads = attention_heads(cfg, setup.topology, setup.rank)
        self.head_dim = cfg.head_dim
        self.num_heads = heads.q.width
        self.num_kv_heads = heads.kv.width
        # Qwen3 normalises each query and key head.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, setup.dtype, setup.device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, setup.dtype, setup.device) if cfg.qk_norm else None

    def load_base(self, checkpoint: Checkpoint, prefix: str) -> None:
        """Read this rank's slices of the attention weights under `prefix` (`model.layers.N.self_attn`)."""
        self.qkv_proj.load_base(checkpoint, prefix)
        self.o_proj.load_base(checkpoint, prefix)
        for name, norm in (("q_norm", self.q_norm), ("k_norm", self.k_norm)):
            if norm is not None:
                norm.weight.copy_(checkpoint.read(f"{prefix}.{name}.weight"))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Attention of this group's new tokens over the paged KV cache (causal, each sequence on
        its own), o_proj reduced in the group."""
        tokens = x.shape[0]
        qkv = self.qkv_proj(x, ctx.attn_lora)
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = apply_rope(self.q_norm(q.reshape(tokens, self.num_heads, self.head_dim)), ctx.cos, ctx.sin)
            k = apply_rope(self.k_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim)), ctx.cos, ctx.sin)
        else:
            # q and k are adjacent in qkv: one rotation serves both heads' sets.
            heads = qkv[:, : q_width + kv_width].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = torch.split(apply_rope(heads, ctx.cos, ctx.sin), [self.num_heads, self.num_kv_heads], dim=1)
        batch = ctx.attention
        # Write, then attend: every new token sees itself and all before it in its sequence.
        batch.kv.write(self.layer, batch.slot_mapping, k, v)
        key, value = batch.kv.key(self.layer), batch.kv.value(self.layer)
        if batch.decode_only:
            out = paged_attention.decode(q, key, value, batch.block_tables, batch.context_tensor, self.scale, batch.first_block)
        else:
            out = paged_attention.prefill(q, key, value, batch.block_tables, batch.query_lens, batch.context_lens, self.scale)
        result: torch.Tensor = self.o_proj(out.reshape(tokens, q_width), ctx.attn_lora)
        return result


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout), written out
    de-interleaved as transformers' `apply_rotary_pos_emb_interleave` does. Only dot products of
    rotated queries and keys are used, so the layout of the result is free; x: [T, heads, d]."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * c - odd * s, odd * c + even * s), dim=-1)


class LatentAttention(nn.Module):
    """MLA (DeepSeek-V2/V3) on this rank's heads of one attention group (docs/engine.md).

    q from q_proj, or q_a_proj → q_a_layernorm → q_b_proj; the latent from kv_a_proj_with_mqa
    (normalised part, then the shared rotary key) is what the KV cache holds, once per token. Each
    step expands the cached latents of the group's sequences through kv_b_proj into this rank's
    heads' keys and values, with each sequence's own adapter, so LoRA on kv_b_proj is exact.
    """

    def __init__(self, setup: RankSetup, layer: int) -> None:
        super().__init__()
        cfg = setup.cfg
        self.mla = mla = cfg.latent()
        self.layer = layer
        self.num_heads = attention_heads(cfg, setup.topology, setup.rank).q.width
        bias = cfg.attention_bias
        # q_proj, or q_b_proj after q_a_proj → q_a_layernorm (the pool finds each by its kind).
        self.q_up = setup.lora_linear("q_proj" if mla.q_lora_rank is None else "q_b_proj", False)
        self.q_down = setup.lora_linear("q_a_proj", bias) if mla.q_lora_rank is not None else None
        # transformers builds both latent norms with the default eps, not rms_norm_eps.
        self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6, setup.dtype, setup.device) if mla.q_lora_rank is not None else None
        self.kv_a_proj_with_mqa = setup.lora_linear("kv_a_proj_with_mqa", bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6, setup.dtype, setup.device)
        self.kv_b_proj = setup.lora_linear("kv_b_proj", False)
        self.o_proj = setup.lora_linear("o_proj", bias)

    def load_base(self, checkpoint: Checkpoint, prefix: str) -> None:
        """Read this rank's slices of the MLA weights under `prefix` (`model.layers.N.self_attn`)."""
        for module in (self.q_down, self.q_up, self.kv_a_proj_with_mqa, self.kv_b_proj, self.o_proj):
            if module is not None:
                module.load_base(checkpoint, prefix)
        for name, norm in (("q_a_layernorm", self.q_a_layernorm), ("kv_a_layernorm", self.kv_a_layernorm)):
            if norm is not None:
                norm.weight.copy_(checkpoint.read(f"{prefix}.{name}.weight"))

    def _rope(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.mla.rope_interleave:
            return rotate_pairs(x, ctx.cos, ctx.sin)
        return apply_rope(x, ctx.cos, ctx.sin)

    def _queries(self, x: torch.Tensor, lora: LoraBatch) -> torch.Tensor:
        if self.q_down is not None and self.q_a_layernorm is not None:
            x = self.q_a_layernorm(self.q_down(x, lora))
        q: torch.Tensor = self.q_up(x, lora)
        return q

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Attention of this group's new tokens over their sequences' cached latents, o_proj reduced in the group."""
        mla, tokens, heads = self.mla, x.shape[0], self.num_heads
        q = self._queries(x, ctx.attn_lora).reshape(tokens, heads, mla.qk_head_dim)
        q_nope, q_rot = torch.split(q, [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        compressed: torch.Tensor = self.kv_a_proj_with_mqa(x, ctx.attn_lora)
        latent, k_rot = torch.split(compressed, [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        k_rot = self._rope(k_rot[:, None, :], ctx)[:, 0]
        batch = ctx.attention
        # Write, then attend: every new token sees itself and all before it in its sequence.
        batch.kv.write_latent(self.layer, batch.slot_mapping, torch.cat((self.kv_a_layernorm(latent), k_rot), dim=-1))
        rows = [index for index, new in enumerate(batch.query_lens) if new > 0]
        query_lens = [batch.query_lens[i] for i in rows]
        context_lens = [batch.context_lens[i] for i in rows]
        cached = paged_attention.gather_contexts(batch.kv.latent(self.layer), batch.block_tables[rows], context_lens)[:, 0]
        keys, values = self._expand(cached, self._context_lora(ctx.attn_lora, query_lens, context_lens))
        queries = torch.cat((q_nope, self._rope(q_rot, ctx)), dim=-1)
        out = paged_attention.prefill_gathered(queries, keys, values, query_lens, context_lens, mla.softmax_scale)
        result: torch.Tensor = self.o_proj(out.reshape(tokens, heads * mla.v_head_dim), ctx.attn_lora)
        return result

    def _expand(self, cached: torch.Tensor, lora: LoraBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents `[L, latent_dim]` → this rank's heads' keys `[L, heads, qk_head_dim]` and values."""
        mla, length = self.mla, cached.shape[0]
        latent, k_rot = torch.split(cached, [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv: torch.Tensor = self.kv_b_proj(latent, lora)
        per_head = kv.reshape(length, self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, values = torch.split(per_head, [mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        keys = torch.cat((k_nope, k_rot[:, None, :].expand(-1, self.num_heads, -1)), dim=-1)
        return keys, values

    @staticmethod
    def _context_lora(lora: LoraBatch, query_lens: list[int], context_lens: list[int]) -> LoraBatch:
        """Each cached token's slot: its sequence's (every token of a sequence has the same adapter,
        and a cached prefix is only ever shared with the same adapter)."""
        device = lora.token_slots.device
        firsts = torch.tensor([0, *query_lens[:-1]], dtype=torch.int64, device=device).cumsum(0)[: len(query_lens)]
        counts = torch.tensor(context_lens, dtype=torch.int64, device=device)
        return LoraBatch.from_token_slots(torch.repeat_interleave(lora.token_slots[firsts], counts))


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
        self.block = SparseMoeBlock(
            moe.num_experts,
            moe.top_k,
            moe.norm_topk_prob,
            cfg.hidden_size,
            gate_up,
            down,
            setup.dtype,
            setup.device,
            Routing.of(moe, self.deepseek),
        )
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
    """The whole model on one rank."""

    inv_freq: torch.Tensor  # a registered buffer

    def __init__(
        self,
        cfg: ModelConfig,
        topology: Topology,
        rank: int,
        groups: ProcessGroups,
        capacity: LoraCapacity,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        setup = RankSetup(cfg, topology, rank, groups, capacity, dtype, device)
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
