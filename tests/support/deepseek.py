"""DeepSeek-V2/V3 test inputs: the PEFT target lists of each MLA form and a per-expert adapter.

PEFT's "all-linear" on these models (peft 0.21.2, transformers 5) resolves to the attention only
and moves the router and the MLPs into `target_parameters`, so the adapters here name their
modules explicitly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lorafleet_dev.synthetic import PEFT_PREFIX, write_adapter_config, write_adapter_weights
from tests.support.models import ExpertShape, add_expert_loras, model_config, randn

FUSED_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MLP_MODULES = ["gate_proj", "up_proj", "down_proj"]  # dense layers and the shared experts


def mla_modules(model_dir: Path | str) -> list[str]:
    """Every MLA projection the model has: q_proj, or q_a_proj and q_b_proj; then the KV ones."""
    query = ["q_proj"] if model_config(model_dir).get("q_lora_rank") is None else ["q_a_proj", "q_b_proj"]
    return [*query, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def make_per_expert_adapter(
    model_dir: Path | str, out_dir: Path | str, seed: int = 0, *, r: int = 4, lora_alpha: float = 8, std: float = 0.2
) -> Path:
    """Expert LoRA in the per-expert-module form (`mlp.experts.N.gate_proj`, ...; transformers 4
    checkpoints), written directly in PEFT's key format, plus kv_b_proj on every layer. PEFT
    converts the expert form on load, so it is the reference for it too."""
    config = model_config(model_dir)
    experts, hidden, inter = config["n_routed_experts"], config["hidden_size"], config["moe_intermediate_size"]
    heads, kv_rank = config["num_attention_heads"], config["kv_lora_rank"]
    kv_b_out = heads * (config["qk_nope_head_dim"] + config["v_head_dim"])
    gen = torch.Generator().manual_seed(4000 + seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config["num_hidden_layers"]):
        if layer >= config["first_k_dense_replace"]:
            add_expert_loras(tensors, gen, layer, ExpertShape(experts, hidden, inter), r=r, std=std)
        key = f"{PEFT_PREFIX}model.layers.{layer}.self_attn.kv_b_proj"
        tensors[f"{key}.lora_A.weight"] = std * randn(gen, (r, kv_rank))
        tensors[f"{key}.lora_B.weight"] = std * randn(gen, (kv_b_out, r))
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
            "use_rslora": False,
            "target_modules": [*MLP_MODULES, "kv_b_proj"],
            "bias": "none",
            "lora_dropout": 0.0,
            "base_model_name_or_path": str(model_dir),
        },
    )
    return out_dir
