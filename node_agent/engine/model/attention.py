"""Attention of one group's new tokens over the paged KV cache: `Attention` (Llama, Qwen3,
Qwen-MoE) and `LatentAttention` (MLA: DeepSeek-V2/V3, over a latent cache)."""

from __future__ import annotations

import torch
from torch import nn

from node_agent.engine.kernels import LoraBatch, dispatch, paged_attention
from node_agent.engine.model.checkpoint import Checkpoint
from node_agent.engine.model.context import ForwardContext, RankSetup
from node_agent.engine.model.layers import RMSNorm
from node_agent.engine.model.rope import apply_rope, rotate_pairs
from node_agent.engine.parallel.sharding import attention_heads


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
        cache = paged_attention.PagedLayer(batch.kv.key(self.layer), batch.kv.value(self.layer), batch.block_tables)
        if batch.decode_only:
            out = dispatch.paged_decode(q, cache, batch.context_tensor, self.scale, batch.first_block)
        else:
            out = paged_attention.prefill(q, cache, batch.query_lens, batch.context_lens, self.scale)
        result: torch.Tensor = self.o_proj(out.reshape(tokens, q_width), ctx.attn_lora)
        return result


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
