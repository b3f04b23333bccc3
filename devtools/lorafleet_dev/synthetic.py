"""Random models and adapters in the on-disk formats the engine serves (no hub, no transformers).

For the demo, the benchmarks and the tests that need files of the right shape rather than a
numeric reference. The numeric tests build theirs with transformers + PEFT instead
(``tests/support/models.py``), so that PEFT itself wrote what the engine must match; both use
the PEFT file-format facts below.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

#: The files of a PEFT LoRA adapter directory.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: PEFT's prefix of every adapter weight key (the adapter name itself is stripped).
PEFT_PREFIX = "base_model.model."

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
#: Every LoRA-targetable projection of a dense Llama-family layer.
ALL_MODULES = ATTN_MODULES + MLP_MODULES


def lora_key(layer: int, module: str, which: str) -> str:
    """The safetensors key PEFT writes for a dense layer's module, e.g. lora_key(0, "q_proj", "A")."""
    sub = "self_attn" if module in ATTN_MODULES else "mlp"
    return f"{PEFT_PREFIX}model.layers.{layer}.{sub}.{module}.lora_{which}.weight"


def write_adapter_config(adapter_dir: Path, config: dict[str, Any]) -> None:
    """Write ``adapter_config.json`` as PEFT does (sorted keys)."""
    (adapter_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_adapter_weights(adapter_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``adapter_model.safetensors`` as PEFT does (contiguous tensors, format "pt")."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(adapter_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})


@dataclass(frozen=True)
class SyntheticModel:
    """Shape of a random Llama-family model."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 256
    model_type: str = "llama"

    def config(self) -> dict[str, Any]:
        """The model's ``config.json`` (Hugging Face keys)."""
        return {
            "architectures": ["LlamaForCausalLM" if self.model_type == "llama" else "Qwen3ForCausalLM"],
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each PEFT-targetable module."""
        q, kv, h, i = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.hidden_size, self.intermediate_size
        return {
            "self_attn.q_proj": (q, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q),
            "mlp.gate_proj": (i, h),
            "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i),
        }


# The model every engine/agent benchmark uses: hidden 1024, 4 layers, GQA 16/4 (about 60M params).
BENCHMARK_MODEL = SyntheticModel(
    hidden_size=1024, intermediate_size=2816, num_layers=4, num_heads=16, num_kv_heads=4, head_dim=64, vocab_size=8192
)


def write_model(out_dir: Path, shape: SyntheticModel, seed: int = 0) -> Path:
    """Write config.json + model.safetensors with random weights."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator) * 0.05

    tensors = {
        "model.embed_tokens.weight": rand(shape.vocab_size, shape.hidden_size),
        "lm_head.weight": rand(shape.vocab_size, shape.hidden_size),
        "model.norm.weight": torch.ones(shape.hidden_size),
    }
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(shape.hidden_size)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(shape.hidden_size)
        if shape.model_type == "qwen3":
            tensors[f"{prefix}.self_attn.q_norm.weight"] = torch.ones(shape.head_dim)
            tensors[f"{prefix}.self_attn.k_norm.weight"] = torch.ones(shape.head_dim)
        for module, (out, inp) in shape.module_shapes().items():
            tensors[f"{prefix}.{module}.weight"] = rand(out, inp)
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(shape.config(), indent=2))
    return out_dir


def write_adapter(
    out_dir: Path, shape: SyntheticModel, rank: int = 8, alpha: float = 16.0, seed: int = 0, targets: tuple[str, ...] = ALL_MODULES
) -> Path:
    """Write a PEFT-format LoRA adapter (adapter_config.json + adapter_model.safetensors)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for module, (out, inp) in shape.module_shapes().items():
            name = module.split(".")[-1]
            if name not in targets:
                continue
            tensors[lora_key(layer, name, "A")] = torch.randn(rank, inp, generator=generator) * 0.05
            tensors[lora_key(layer, name, "B")] = torch.randn(out, rank, generator=generator) * 0.05
    write_adapter_weights(out_dir, tensors)
    write_adapter_config(
        out_dir,
        {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": alpha,
            "target_modules": list(targets),
            "bias": "none",
            "use_rslora": False,
            "use_dora": False,
            "task_type": "CAUSAL_LM",
        },
    )
    return out_dir
