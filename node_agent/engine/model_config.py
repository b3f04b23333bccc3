"""The base model's shape, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "llama": "Llama",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE",
    "qwen2_moe": "Qwen2-MoE",
    "deepseek_v2": "DeepSeek-V2",
    "deepseek_v3": "DeepSeek-V3",
}
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe")
MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")
# How a router turns its logits into top-k experts (transformers' routers, one per family).
ROUTINGS = ("softmax", "softmax_group_limited", "sigmoid_group_limited")


class ModelConfigError(ValueError):
    """The model directory cannot be served (missing files, unsupported architecture)."""


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts of a Qwen-MoE model, and its optional shared expert (Qwen2-MoE has one)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    norm_topk_prob: bool
    sparse_layers: frozenset[int]  # layers whose MLP is the expert block
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate; DeepSeek's shared experts have none
    routing: str = "softmax"  # one of ROUTINGS
    num_groups: int = 1  # expert groups of group-limited routing
    topk_groups: int = 1  # groups a token may choose experts from
    routed_scaling_factor: float = 1.0

    @classmethod
    def from_dict(cls, raw: dict[str, Any], num_layers: int) -> MoEConfig | None:
        """The routed experts of a parsed `config.json`, or None for a model without them."""
        # transformers 5 writes num_local_experts; checkpoints made with transformers 4 say num_experts.
        experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        if experts == 0:
            return None
        dense_only = set(raw.get("mlp_only_layers") or [])
        step = int(raw.get("decoder_sparse_step") or 1)
        sparse = frozenset(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)
        return cls(
            experts,
            int(raw["num_experts_per_tok"]),
            int(raw["moe_intermediate_size"]),
            bool(raw.get("norm_topk_prob", False)),
            sparse,
            int(raw.get("shared_expert_intermediate_size") or 0),
        )

    @classmethod
    def from_deepseek(cls, raw: dict[str, Any], num_layers: int) -> MoEConfig:
        """DeepSeek-V2/V3 experts: layers from `first_k_dense_replace` on are sparse, with
        `n_shared_experts` ungated shared experts and the family's router."""
        if raw["model_type"] == "deepseek_v3":
            routing = "sigmoid_group_limited"
        else:
            method = raw.get("topk_method") or "greedy"
            if method not in ("greedy", "group_limited_greedy"):
                raise ModelConfigError(f"topk_method {method!r} is not supported (greedy, group_limited_greedy)")
            routing = "softmax" if method == "greedy" else "softmax_group_limited"
        experts = int(raw["n_routed_experts"])
        groups = int(raw.get("n_group") or 1) if routing != "softmax" else 1
        if experts % groups:
            raise ModelConfigError(f"n_routed_experts {experts} is not divisible by n_group {groups}")
        first_sparse = int(raw.get("first_k_dense_replace") or 0)
        inter = int(raw["moe_intermediate_size"])
        return cls(
            experts,
            int(raw["num_experts_per_tok"]),
            inter,
            # transformers' V2 router never renormalises its top-k weights.
            routing == "sigmoid_group_limited" and bool(raw.get("norm_topk_prob", False)),
            frozenset(range(first_sparse, num_layers)),
            inter * int(raw.get("n_shared_experts") or 0),
            shared_expert_gated=False,
            routing=routing,
            num_groups=groups,
            topk_groups=int(raw.get("topk_group") or 1) if routing != "softmax" else 1,
            routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        )


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): the projections' widths and the softmax scale."""

    q_lora_rank: int | None  # None: one q_proj; else q_a_proj → q_a_layernorm → q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # RoPE over interleaved pairs (x0, x1), (x2, x3), ... (V2 always)
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys: the un-rotated part, then the rotated one."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What the KV cache holds per token: the normalised latent, then the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any], rope_scaling: dict[str, Any] | None) -> MLAConfig:
        """The MLA widths of a parsed DeepSeek `config.json`, and its softmax scale as transformers
        computes it (qk_head_dim^-0.5, times mscale² under YaRN with `mscale_all_dim`)."""
        nope, rope = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
        scale = (nope + rope) ** -0.5
        if rope_scaling and rope_scaling.get("mscale_all_dim"):
            mscale = yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
            scale = scale * mscale * mscale
        q_rank = raw.get("q_lora_rank")
        return cls(
            None if q_rank is None else int(q_rank),
            int(raw["kv_lora_rank"]),
            nope,
            rope,
            int(raw["v_head_dim"]),
            raw["model_type"] == "deepseek_v2" or bool(raw.get("rope_interleave", True)),
            scale,
        )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor` (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about a dense decoder-only model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None  # DeepSeek's latent attention instead of q/k/v heads
    max_position_embeddings: int = 0

    @property
    def q_size(self) -> int:
        """Output features of q_proj (never assumed equal to hidden_size)."""
        if self.mla is not None:
            return self.num_heads * self.mla.qk_head_dim
        return self.num_heads * self.head_dim

    @property
    def attn_out_size(self) -> int:
        """Input features of o_proj: every head's value width."""
        if self.mla is not None:
            return self.num_heads * self.mla.v_head_dim
        return self.q_size

    def latent(self) -> MLAConfig:
        """The MLA config; asking a model without latent attention for it is a programming error."""
        if self.mla is None:
            raise ModelConfigError(f"model_type {self.model_type!r} has no latent attention")
        return self.mla

    def experts(self) -> MoEConfig:
        """The routed-expert config; asking a dense model for it is a programming error."""
        if self.moe is None:
            raise ModelConfigError(f"model_type {self.model_type!r} has no routed experts")
        return self.moe

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        """Read and check `model_dir/config.json`."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"model directory {model_dir} has no config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ModelConfigError(f"{path} is not valid JSON: {error}") from error
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from the parsed `config.json`, refusing what the engine does not implement."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
        if raw.get("use_sliding_window"):
            raise ModelConfigError("sliding-window attention (use_sliding_window: true) is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act {raw.get('hidden_act')!r} is not supported (silu only)")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope_theta, rope_scaling = _rope(raw)
        layers = int(raw["num_hidden_layers"])
        deepseek = model_type in MLA_ARCHITECTURES
        if deepseek and int(raw.get("num_key_value_heads") or heads) != heads:
            raise ModelConfigError(
                f"num_key_value_heads {raw.get('num_key_value_heads')} differs from num_attention_heads "
                f"{heads}: MLA expands its latent to every head"
            )
        moe = None
        if model_type in MOE_ARCHITECTURES:
            moe = MoEConfig.from_dict(raw, layers)
        elif deepseek:
            moe = MoEConfig.from_deepseek(raw, layers)
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            # Never derive head_dim from hidden/heads when the config says otherwise (Qwen3).
            # DeepSeek: the rotary width, which is all RoPE reads.
            head_dim=int(raw["qk_rope_head_dim"] if deepseek else raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2-family configs call the q/k/v bias "qkv_bias".
            attention_bias=bool(raw.get("attention_bias", raw.get("qkv_bias", False))),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            moe=moe,
            mla=MLAConfig.from_dict(raw, rope_scaling) if deepseek else None,
            max_position_embeddings=int(raw.get("max_position_embeddings") or 0),
        )


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE theta and scaling from either the transformers-5 or the transformers-4 layout."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return theta, (dict(params) if rope_type != "default" else None)
