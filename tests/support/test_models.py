"""Self-checks of tests/support/models.py: the files have the format the engine's loader is
written against, and they are deterministic. No engine needed."""

from __future__ import annotations

import json
import math

import torch
from safetensors import safe_open

from lorafleet_dev.synthetic import ADAPTER_CONFIG, lora_key
from tests.support.models import adapter_config, adapter_tensors, checkpoint_files, make_adapter, make_tiny_model, model_config


def test_tiny_model_files(llama, qwen3):
    files = checkpoint_files(llama)
    assert len(files) >= 2, files
    assert (llama / "model.safetensors.index.json").is_file()
    keys = set()
    for f in files:
        with safe_open(str(f), "pt") as fh:
            keys |= set(fh.keys())
    assert "lm_head.weight" in keys and "model.embed_tokens.weight" in keys
    cfg = model_config(llama)
    assert cfg["vocab_size"] % 4 != 0 and cfg["tie_word_embeddings"] is False

    qcfg = model_config(qwen3)
    assert qcfg["model_type"] == "qwen3" and qcfg["head_dim"] * qcfg["num_attention_heads"] != qcfg["hidden_size"]
    assert qcfg["num_key_value_heads"] == 1 and qcfg["tie_word_embeddings"] is True
    (qfile,) = checkpoint_files(qwen3)
    with safe_open(str(qfile), "pt") as fh:
        qkeys = set(fh.keys())
        assert "lm_head.weight" not in qkeys  # tied: only the embedding is stored
        assert "model.layers.0.self_attn.q_norm.weight" in qkeys
        assert fh.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [4 * 24, 64]
        assert fh.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [24, 64]
        assert fh.get_tensor("model.embed_tokens.weight").dtype == torch.float32


def test_models_are_deterministic(work, llama):
    again = make_tiny_model(work / "llama-again", "llama", max_shard_size="40KB")
    for a, b in zip(checkpoint_files(llama), checkpoint_files(again), strict=True):
        assert a.read_bytes() == b.read_bytes()


def test_adapter_file_format(llama, work):
    a = make_adapter(llama, work / "fmt", r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"])
    tensors = adapter_tensors(a)
    expected = {lora_key(layer, m, w) for layer in (0, 1) for m in ("q_proj", "down_proj") for w in "AB"}
    assert set(tensors) == expected
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert tensors[lora_key(0, "q_proj", "A")].shape == (8, 64)
    assert tensors[lora_key(0, "q_proj", "B")].shape == (64, 8)
    assert tensors[lora_key(1, "down_proj", "A")].shape == (8, 128)
    assert tensors[lora_key(1, "down_proj", "B")].shape == (64, 8)
    for t in tensors.values():
        assert t.dtype == torch.float32
        assert (t != 0).float().mean() > 0.99  # B was overwritten: PEFT would leave it all zero
    cfg = adapter_config(a)
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and cfg["lora_alpha"] == 16
    assert sorted(cfg["target_modules"]) == ["down_proj", "q_proj"]
    assert cfg["use_rslora"] is False and cfg["use_dora"] is False and cfg["bias"] == "none"
    assert cfg["modules_to_save"] is None and cfg["rank_pattern"] == {} and cfg["alpha_pattern"] == {}
    assert cfg["base_model_name_or_path"] == str(llama)


def test_patterns_are_applied(llama, work):
    cfg = adapter_config(
        make_adapter(
            llama,
            work / "pat",
            target_modules=r".*\.(k_proj|o_proj)$",
            rank_pattern={"o_proj": 4, r"layers\.1\.self_attn\.k_proj": 12},
            alpha_pattern={"k_proj": 3},
        )
    )
    tensors = adapter_tensors(work / "pat")
    assert tensors[lora_key(0, "o_proj", "A")].shape[0] == 4
    assert tensors[lora_key(0, "k_proj", "A")].shape[0] == 8
    assert tensors[lora_key(1, "k_proj", "A")].shape[0] == 12
    assert cfg["target_modules"] == r".*\.(k_proj|o_proj)$"
    assert cfg["alpha_pattern"] == {"k_proj": 3}


def test_config_is_json(llama, work):
    d = make_adapter(llama, work / "json", use_rslora=True, r=4, lora_alpha=8)
    cfg = json.loads((d / ADAPTER_CONFIG).read_text())
    assert cfg["use_rslora"] is True and math.isclose(cfg["lora_alpha"] / math.sqrt(cfg["r"]), 4.0)
