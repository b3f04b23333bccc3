"""The base model's shape, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {"llama": "Llama", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE"}
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


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
        return cls(experts, int(raw["num_experts_per_tok"]), int(raw["moe_intermediate_size"]),
                   bool(raw.get("norm_topk_prob", False)), sparse, int(raw.get("shared_expert_intermediate_size") or 0))


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

    @property
    def q_size(self) -> int:
        """Output features of q_proj (never assumed equal to hidden_size)."""
        return self.num_heads * self.head_dim

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
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
            )
        if raw.get("use_sliding_window"):
            raise ModelConfigError("sliding-window attention (use_sliding_window: true) is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act {raw.get('hidden_act')!r} is not supported (silu only)")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope_theta, rope_scaling = _rope(raw)
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            # Never derive head_dim from hidden/heads when the config says otherwise (Qwen3).
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2-family configs call the q/k/v bias "qkv_bias".
            attention_bias=bool(raw.get("attention_bias", raw.get("qkv_bias", False))),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            moe=MoEConfig.from_dict(raw, int(raw["num_hidden_layers"])) if model_type in MOE_ARCHITECTURES else None,
        )


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE theta and scaling from either the transformers-5 or the transformers-4 layout."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return theta, (dict(params) if rope_type != "default" else None)
