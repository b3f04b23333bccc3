"""The models the CPU serving benchmarks run: the small benchmark model (it fits in cache), and a
~1B-parameter Llama shape (TinyLlama-1.1B's: hidden 2048, 22 layers, GQA 32/4, vocabulary
32,000), so figures are not only those of a model that fits in cache. Random weights, written
here in the dtype asked (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from lorafleet_dev.synthetic import BENCHMARK_MODEL, SyntheticModel, write_model

SHAPES = {
    "benchmark": BENCHMARK_MODEL,
    "1b": SyntheticModel(
        hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32, num_kv_heads=4, head_dim=64, vocab_size=32000
    ),
}


def parameters(shape: SyntheticModel) -> int:
    """The model's parameter count (embedding and LM head included, norms not)."""
    per_layer = sum(out * inp for out, inp in shape.module_shapes().values())
    return shape.num_layers * per_layer + 2 * shape.vocab_size * shape.hidden_size


def write_model_as(out_dir: Path, shape: SyntheticModel, dtype: torch.dtype) -> Path:
    """`write_model`'s model with its files in `dtype` (fp32 is `write_model` itself): a 1B model
    in bf16 is half the bytes to write and to read."""
    if dtype == torch.float32:
        return write_model(out_dir, shape)
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * 0.05).to(dtype)

    tensors = {
        "model.embed_tokens.weight": rand(shape.vocab_size, shape.hidden_size),
        "lm_head.weight": rand(shape.vocab_size, shape.hidden_size),
        "model.norm.weight": torch.ones(shape.hidden_size, dtype=dtype),
    }
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}.{norm}.weight"] = torch.ones(shape.hidden_size, dtype=dtype)
        for module, (out, inp) in shape.module_shapes().items():
            tensors[f"{prefix}.{module}.weight"] = rand(out, inp)
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = {**shape.config(), "torch_dtype": str(dtype).removeprefix("torch.")}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
