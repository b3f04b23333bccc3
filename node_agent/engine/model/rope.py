"""Rotary position embeddings: the inverse frequencies (with Llama-3 or YaRN scaling), YaRN's
attention factor, and the two rotations (halves, and DeepSeek's interleaved pairs)."""

from __future__ import annotations

import math
from typing import Any

import torch

from node_agent.engine.model_config import ModelConfig, yarn_mscale


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


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout), written out
    de-interleaved as transformers' `apply_rotary_pos_emb_interleave` does. Only dot products of
    rotated queries and keys are used, so the layout of the result is free; x: [T, heads, d]."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * c - odd * s, odd * c + even * s), dim=-1)
