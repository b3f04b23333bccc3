"""Tiny random Hugging Face models and PEFT adapters, built locally (no hub access).

Model configs are written by hand and weights drawn from seeded generators; adapters are made
with PEFT's own `get_peft_model` + `save_pretrained`, so their files are exactly what PEFT
writes. These are the numeric reference's inputs (:mod:`tests.support.oracle`); tests that only
need files of the right shape use :mod:`lorafleet_dev.synthetic`, which writes them without
transformers. Both share the PEFT file-format names (`ADAPTER_CONFIG`, `lora_key`, ...).

Facts about peft 0.21.2 that the engine's loader must match (checked by the tests in tests/support/):

* weight keys: ``base_model.model.<module path>.lora_A.weight`` ``[r, in]`` and
  ``...lora_B.weight`` ``[out, r]``, e.g.
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (the adapter name is
  stripped). DoRA adds ``...lora_magnitude_vector`` ``[out]``; ``lora_bias=True`` adds
  ``...lora_B.bias`` ``[out]``; ``modules_to_save=["lm_head"]`` adds
  ``base_model.model.lm_head.weight``.
* ``adapter_config.json``: ``peft_type`` "LORA", ``r``, ``lora_alpha``, ``use_rslora``,
  ``target_modules`` (list, or a regex string that PEFT ``re.fullmatch``-es against the module
  path; "all-linear" is stored as the list of full module paths it resolved to, e.g.
  "model.layers.0.mlp.down_proj", in no particular order), ``rank_pattern`` /
  ``alpha_pattern`` (dicts whose keys are regexes matched as ``re.match(rf"(.*\\.)?({key})$",
  module_path)`` with module_path like ``model.layers.1.self_attn.k_proj``; the first matching key
  in dict order wins and ``save_pretrained`` writes the dicts with sorted keys),
  ``layers_to_transform``, ``use_dora``, ``bias``, ``lora_bias``, ``modules_to_save``,
  ``base_model_name_or_path``, ``peft_version``.
* scale per module = ``alpha_m / r_m`` (``alpha_m / sqrt(r_m)`` with ``use_rslora``), where
  ``r_m`` / ``alpha_m`` come from the patterns when a key matches, else ``r`` / ``lora_alpha``.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from lorafleet_dev.synthetic import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    ALL_MODULES,
    PEFT_PREFIX,
    write_adapter_config,
    write_adapter_weights,
)

# Keep the reference quiet and deterministic; never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

_BASE_DEFAULTS: dict[str, Any] = dict(
    vocab_size=250,  # not divisible by 4 (nor by 3), on purpose
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
# Qwen3: head_dim given explicitly and != hidden / heads (4 * 24 = 96 != 64).
# Qwen3-MoE: 4 routed experts, top-2, layer 0 sparse, layer 1 dense (mlp_only_layers).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": dict(head_dim=24),
    "qwen3_moe": dict(
        head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]
    ),
    # Qwen2-MoE: a shared expert with a sigmoid gate beside the routed ones; q/k/v biases.
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1]
    ),
    # DeepSeek-V2: MLA without q_lora_rank (v_head_dim 10 != qk_head_dim 12), YaRN with both
    # mscales (so cos/sin and the softmax scale are both rescaled); layer 0 dense, layer 1 four
    # routed experts (softmax top-2, scaled) beside one shared expert.
    "deepseek_v2": dict(
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=10,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=64,
            mscale=1.0,
            mscale_all_dim=0.8,
            beta_fast=32,
            beta_slow=1,
        ),
    ),
    # DeepSeek-V3: q_a_proj → q_a_layernorm → q_b_proj; sigmoid routing over 8 experts in 4
    # groups (2 chosen) with e_score_correction_bias, renormalised and scaled by 2.5.
    "deepseek_v3": dict(
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=10,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
}


def quietly(fn):
    """Silence library deprecation/PEFT notices raised while building fixtures."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)

    return wrapper


def quiet_transformers() -> None:
    """Keep transformers' logging and progress bars out of the test output."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _family(family: str):
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    families = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
        "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
        "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
    }
    if family not in families:
        raise ValueError(f"unknown family {family!r}; expected one of {sorted(families)}")
    return families[family]


def randn(gen: torch.Generator, shape: Sequence[int]) -> torch.Tensor:
    """Seeded N(0, 1) float32 values of ``shape``."""
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32)


def make_tiny_model(
    out_dir: Path | str,
    family: str = "llama",
    seed: int = 0,
    *,
    init_std: float = 0.1,
    max_shard_size: int | str | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random `family` causal LM (config.json + safetensors, fp32) to `out_dir`.

    `overrides` go to the HF config (num_key_value_heads, head_dim, tie_word_embeddings,
    attention_bias, num_hidden_layers, ...). `max_shard_size` (e.g. "40KB") splits the
    checkpoint into several files with a `model.safetensors.index.json`.

    Weights: every matrix ~ N(0, init_std); RMSNorm weights ~ 1 + N(0, 0.1) (so a wrong norm
    is visible); biases ~ N(0, 0.05).
    """
    quiet_transformers()
    config_cls, model_cls = _family(family)
    kwargs = {**_BASE_DEFAULTS, **_FAMILY_DEFAULTS[family], **overrides}
    config = config_cls(**kwargs)
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        # named_parameters() lists a tied weight once; sort for a stable draw order.
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * randn(gen, param.shape))
            elif name.endswith(".bias"):
                param.copy_(0.05 * randn(gen, param.shape))
            else:
                param.copy_(init_std * randn(gen, param.shape))
        # DeepSeek-V3's router bias is a buffer (zero at init): drawn too, so routing reads it.
        for name, buffer in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * randn(gen, buffer.shape))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **save_kwargs)
    if not list(out_dir.glob("*.safetensors")):
        raise RuntimeError(f"save_pretrained wrote no safetensors into {out_dir}")
    return out_dir


@quietly
def load_base_model(model_dir: Path | str):
    """The HF model from `model_dir`, fp32, eval mode, eager attention."""
    quiet_transformers()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager", local_files_only=True)
    return model.eval()


def model_config(model_dir: Path | str) -> dict[str, Any]:
    """The model's config.json."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def checkpoint_files(model_dir: Path | str) -> list[Path]:
    """The model's safetensors files, sorted."""
    return sorted(Path(model_dir).glob("*.safetensors"))


@quietly
def make_adapter(
    model_dir: Path | str,
    out_dir: Path | str,
    seed: int = 0,
    *,
    a_std: float = 0.1,
    b_std: float = 0.1,
    **lora_config_kwargs: Any,
) -> Path:
    """A PEFT LoRA adapter for the model in `model_dir`, written by PEFT's `save_pretrained`.

    `lora_config_kwargs` go to `peft.LoraConfig` (r, lora_alpha, target_modules, use_rslora,
    rank_pattern, alpha_pattern, layers_to_transform, use_dora, bias, lora_bias,
    modules_to_save, ...). Defaults: r=8, lora_alpha=16, all seven projections, no dropout.
    Both lora_A and lora_B are overwritten with seeded N(0, a_std) / N(0, b_std) values (PEFT
    initialises B to zero, which would make every adapter a no-op).
    """
    quiet_transformers()
    from peft import LoraConfig, get_peft_model

    kwargs: dict[str, Any] = dict(r=8, lora_alpha=16, target_modules=list(ALL_MODULES), lora_dropout=0.0)
    kwargs.update(lora_config_kwargs)
    base = load_base_model(model_dir)
    peft_model = get_peft_model(base, LoraConfig(**kwargs))
    gen = torch.Generator().manual_seed(2000 + seed)
    n_lora = 0
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters(), key=lambda kv: kv[0]):
            if ".lora_A." in name and name.endswith(".weight"):
                param.copy_(a_std * randn(gen, param.shape))
                n_lora += 1
            elif ".lora_B." in name and name.endswith(".weight"):
                param.copy_(b_std * randn(gen, param.shape))
                n_lora += 1
            elif ".lora_B." in name and name.endswith(".bias"):
                param.copy_(0.05 * randn(gen, param.shape))
    if n_lora == 0:
        raise RuntimeError(f"LoraConfig({kwargs}) targeted no module of {model_dir}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    # PEFT also writes a README.md model card; harmless, the engine must ignore it.
    if not (out_dir / ADAPTER_WEIGHTS).is_file() or not (out_dir / ADAPTER_CONFIG).is_file():
        raise RuntimeError(f"PEFT did not write {ADAPTER_CONFIG} + {ADAPTER_WEIGHTS} into {out_dir}")
    return out_dir


@dataclass(frozen=True)
class ExpertShape:
    """A MoE layer's routed experts as an expert LoRA sees them: how many, and each one's sizes."""

    experts: int
    hidden: int
    inter: int  # the intermediate size of one expert


def add_expert_loras(tensors: dict[str, torch.Tensor], gen: torch.Generator, layer: int, shape: ExpertShape, *, r: int, std: float) -> None:
    """Random per-expert PEFT LoRA (gate, up and down of every expert of `layer`) into `tensors`."""
    hidden, inter = shape.hidden, shape.inter
    for expert in range(shape.experts):
        for name, (out, inp) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}.items():
            key = f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts.{expert}.{name}"
            tensors[f"{key}.lora_A.weight"] = std * randn(gen, (r, inp))
            tensors[f"{key}.lora_B.weight"] = std * randn(gen, (out, r))


def make_per_expert_adapter(
    model_dir: Path | str,
    out_dir: Path | str,
    seed: int = 0,
    *,
    r: int = 4,
    lora_alpha: float = 8,
    use_rslora: bool = False,
    std: float = 0.2,
    attention: tuple[str, ...] = ("q_proj",),
) -> Path:
    """An expert LoRA in the per-expert-module form (`mlp.experts.N.gate_proj`, ...).

    That is what PEFT wrote for MoE models of transformers 4, whose experts were separate
    modules; transformers 5 fuses them, so the file is written here directly, in PEFT's key
    format. PEFT 0.21 converts it on load (`PeftModel.from_pretrained`), which makes PEFT itself
    the reference for this form too. Every sparse layer's experts get gate/up/down adapters;
    `attention` modules get ordinary ones.
    """
    config = model_config(model_dir)
    experts, hidden = config["num_local_experts"], config["hidden_size"]
    inter, dense = config["moe_intermediate_size"], set(config.get("mlp_only_layers") or [])
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    gen = torch.Generator().manual_seed(3000 + seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config["num_hidden_layers"]):
        if layer not in dense:
            add_expert_loras(tensors, gen, layer, ExpertShape(experts, hidden, inter), r=r, std=std)
        for name in attention:
            assert name == "q_proj", "only q_proj is generated here"
            key = f"{PEFT_PREFIX}model.layers.{layer}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = std * randn(gen, (r, hidden))
            tensors[f"{key}.lora_B.weight"] = std * randn(gen, (heads * head_dim, r))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_adapter_weights(out_dir, tensors)
    write_adapter_config(
        out_dir,
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": r,
            "lora_alpha": lora_alpha,
            "use_rslora": use_rslora,
            "target_modules": ["gate_proj", "up_proj", "down_proj", *attention],
            "bias": "none",
            "lora_dropout": 0.0,
            "base_model_name_or_path": str(model_dir),
        },
    )
    return out_dir


def adapter_tensors(adapter_dir: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor of the adapter's weights file."""
    return load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))


def adapter_config(adapter_dir: Path | str) -> dict[str, Any]:
    """The adapter's adapter_config.json."""
    return json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
