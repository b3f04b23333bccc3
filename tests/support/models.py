"""Numeric reference for the engine: tiny random HF models, PEFT adapters, and the oracle.

Everything here is built locally (no hub access): model configs are written by hand, weights are
drawn from seeded generators, adapters are made with PEFT's own `get_peft_model` +
`save_pretrained` (so their files are exactly what PEFT writes), and `reference_logits` runs
HF `transformers` + `peft` on the CPU in fp32, one sequence at a time, without padding.

The bad-adapter factories at the end produce the adapters the engine must refuse
(DESIGN.md §6, issue 2); `BAD_ADAPTERS` maps each case to its factory and the phrase the
engine's `AdapterLoadError` must contain.

Facts about peft 0.21.2 that the engine's loader must match (checked by tests/test_reference.py):

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

import copy
import ctypes
import ctypes.util
import errno
import json
import math
import os
import pickle
import shutil
import struct
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

# Keep the reference quiet and deterministic; never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ALL_MODULES = ATTN_MODULES + MLP_MODULES

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
    "qwen3_moe": dict(head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[1]),
    # Qwen2-MoE: a shared expert with a sigmoid gate beside the routed ones; q/k/v biases.
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, mlp_only_layers=[1]),
}


def _quietly(fn):
    """Silence library deprecation/PEFT notices raised while building fixtures."""

    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)

    return wrapper


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _family(family: str):
    from transformers import (
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
    }
    if family not in families:
        raise ValueError(f"unknown family {family!r}; expected one of {sorted(families)}")
    return families[family]


def _randn(gen: torch.Generator, shape: Sequence[int]) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# Tiny base models
# --------------------------------------------------------------------------------------------


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
    _quiet_transformers()
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
                param.copy_(1.0 + 0.1 * _randn(gen, param.shape))
            elif name.endswith(".bias"):
                param.copy_(0.05 * _randn(gen, param.shape))
            else:
                param.copy_(init_std * _randn(gen, param.shape))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **save_kwargs)
    if not list(out_dir.glob("*.safetensors")):
        raise RuntimeError(f"save_pretrained wrote no safetensors into {out_dir}")
    return out_dir


@_quietly
def load_base_model(model_dir: Path | str):
    """The HF model from `model_dir`, fp32, eval mode, eager attention."""
    _quiet_transformers()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager", local_files_only=True
    )
    return model.eval()


def model_config(model_dir: Path | str) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def checkpoint_files(model_dir: Path | str) -> list[Path]:
    return sorted(Path(model_dir).glob("*.safetensors"))


# --------------------------------------------------------------------------------------------
# PEFT adapters
# --------------------------------------------------------------------------------------------


@_quietly
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
    _quiet_transformers()
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
                param.copy_(a_std * _randn(gen, param.shape))
                n_lora += 1
            elif ".lora_B." in name and name.endswith(".weight"):
                param.copy_(b_std * _randn(gen, param.shape))
                n_lora += 1
            elif ".lora_B." in name and name.endswith(".bias"):
                param.copy_(0.05 * _randn(gen, param.shape))
    if n_lora == 0:
        raise RuntimeError(f"LoraConfig({kwargs}) targeted no module of {model_dir}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    # PEFT also writes a README.md model card; harmless, the engine must ignore it.
    if not (out_dir / ADAPTER_WEIGHTS).is_file() or not (out_dir / ADAPTER_CONFIG).is_file():
        raise RuntimeError(f"PEFT did not write {ADAPTER_CONFIG} + {ADAPTER_WEIGHTS} into {out_dir}")
    return out_dir


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
            for expert in range(experts):
                for name, (out, inp) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                                         "down_proj": (hidden, inter)}.items():
                    key = f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts.{expert}.{name}"
                    tensors[f"{key}.lora_A.weight"] = std * _randn(gen, (r, inp))
                    tensors[f"{key}.lora_B.weight"] = std * _randn(gen, (out, r))
        for name in attention:
            assert name == "q_proj", "only q_proj is generated here"
            key = f"{PEFT_PREFIX}model.layers.{layer}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = std * _randn(gen, (r, hidden))
            tensors[f"{key}.lora_B.weight"] = std * _randn(gen, (heads * head_dim, r))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_tensors(out_dir, tensors)
    _write_config(out_dir, {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": lora_alpha, "use_rslora": use_rslora,
        "target_modules": ["gate_proj", "up_proj", "down_proj", *attention], "bias": "none",
        "lora_dropout": 0.0, "base_model_name_or_path": str(model_dir),
    })
    return out_dir


def adapter_tensors(adapter_dir: Path | str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))


def adapter_config(adapter_dir: Path | str) -> dict[str, Any]:
    return json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())


def lora_key(layer: int, module: str, which: str) -> str:
    """The safetensors key PEFT 0.21 writes, e.g. lora_key(0, "q_proj", "A")."""
    sub = "self_attn" if module in ATTN_MODULES else "mlp"
    return f"{PEFT_PREFIX}model.layers.{layer}.{sub}.{module}.lora_{which}.weight"


def _write_config(adapter_dir: Path, config: dict[str, Any]) -> None:
    (adapter_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_tensors(adapter_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(adapter_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})


# --------------------------------------------------------------------------------------------
# The oracle
# --------------------------------------------------------------------------------------------


def _tokens_and_adapter(seq: Any) -> tuple[list[int], str | None]:
    if isinstance(seq, dict):
        return list(seq["tokens"]), seq.get("adapter")
    if isinstance(seq, (tuple, list)) and len(seq) == 2 and not isinstance(seq[0], int):
        return list(seq[0]), seq[1]
    return list(seq.tokens), seq.adapter


def _file_key(path: Path) -> tuple:
    """Identity of a directory's files, so a rewritten adapter is never served from the cache."""
    key = [str(path.resolve())]
    for f in sorted(path.iterdir()):
        if f.is_file():
            st = f.stat()
            key.append((f.name, st.st_size, st.st_mtime_ns))
    return tuple(key)


_BASE_CACHE: dict[tuple, Any] = {}
_PEFT_CACHE: dict[tuple, Any] = {}


def clear_reference_cache() -> None:
    _BASE_CACHE.clear()
    _PEFT_CACHE.clear()


def _cached_base(model_dir: Path):
    key = _file_key(model_dir)
    if key not in _BASE_CACHE:
        _BASE_CACHE[key] = load_base_model(model_dir)
    return _BASE_CACHE[key]


@_quietly
def _cached_peft(model_dir: Path, adapter_dir: Path):
    from peft import PeftModel

    key = (_file_key(model_dir), _file_key(adapter_dir))
    if key not in _PEFT_CACHE:
        base = copy.deepcopy(_cached_base(model_dir))
        model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=False)
        _PEFT_CACHE[key] = model.eval()
    return _PEFT_CACHE[key]


@torch.no_grad()
def _run(model, tokens: list[int]) -> torch.Tensor:
    if not tokens:
        raise ValueError("empty token list")
    input_ids = torch.tensor([tokens], dtype=torch.long)
    out = model(input_ids=input_ids, use_cache=False)
    return out.logits[0].to(torch.float32).clone()


def reference_logits(
    model_dir: Path | str,
    sequences: Iterable[Any],
    adapters: dict[str, Path | str] | None = None,
) -> list[torch.Tensor]:
    """HF transformers + PEFT logits, fp32 on the CPU, one sequence at a time (no padding).

    `sequences`: items with `.tokens` / `.adapter` (e.g. the engine's SequenceInput), dicts
    {"tokens", "adapter"}, or (tokens, adapter) pairs. `adapter` None -> the plain base model
    (not PEFT-wrapped); otherwise the adapter `adapters[name]`, loaded by
    `PeftModel.from_pretrained` onto its own copy of the base model (adapters never share a model).
    Returns one `[len(tokens), vocab_size]` float32 tensor per sequence.
    """
    model_dir = Path(model_dir)
    adapters = {name: Path(p) for name, p in (adapters or {}).items()}
    results = []
    for seq in sequences:
        tokens, name = _tokens_and_adapter(seq)
        if name is None:
            model = _cached_base(model_dir)
        else:
            if name not in adapters:
                raise KeyError(f"sequence uses adapter {name!r} but adapters has {sorted(adapters)}")
            model = _cached_peft(model_dir, adapters[name])
        results.append(_run(model, tokens))
    return results


@torch.no_grad()
def peft_disabled_logits(model_dir: Path | str, adapter_dir: Path | str, tokens: list[int]) -> torch.Tensor:
    """Logits of the PEFT-wrapped model with its adapter disabled (self-check of the oracle)."""
    model = _cached_peft(Path(model_dir), Path(adapter_dir))
    with model.disable_adapter():
        return _run(model, tokens)


def manual_lora_logits(model_dir: Path | str, adapter_dir: Path | str, tokens: list[int]) -> torch.Tensor:
    """Independent second oracle: merge W += scale * B @ A into a plain HF model by hand.

    Reads the adapter files directly and applies DESIGN.md §3's scale rule (alpha/r, alpha/sqrt(r)
    with rsLoRA, per-module rank/alpha patterns via PEFT's matching rule). Used only to cross-check
    `reference_logits`, so a misread config (rsLoRA, patterns) in either path is caught.
    """
    import re

    cfg = adapter_config(adapter_dir)
    tensors = adapter_tensors(adapter_dir)
    model = copy.deepcopy(_cached_base(Path(model_dir)))

    def pattern_value(patterns: dict[str, Any], module_path: str, default: Any) -> Any:
        for key, value in patterns.items():
            if re.match(rf"(.*\.)?({key})$", module_path):
                return value
        return default

    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module_path = key[len(PEFT_PREFIX) : -len(".lora_A.weight")]
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            r = pattern_value(cfg.get("rank_pattern") or {}, module_path, cfg["r"])
            alpha = pattern_value(cfg.get("alpha_pattern") or {}, module_path, cfg["lora_alpha"])
            if a.shape[0] != r:
                raise AssertionError(f"{key}: rank {a.shape[0]} but config says {r}")
            scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
            modules[module_path].weight += scale * (b.double() @ a.double()).float()
    return _run(model, tokens)


# --------------------------------------------------------------------------------------------
# Bad adapters (refusals). Each factory writes into out_dir and returns it.
# --------------------------------------------------------------------------------------------

# A small valid adapter that the corruption factories start from.
_SEED_KWARGS: dict[str, Any] = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def _good_then(model_dir: Path | str, out_dir: Path | str, seed: int = 0, **kw: Any) -> Path:
    return make_adapter(model_dir, out_dir, seed=seed, **{**_SEED_KWARGS, **kw})


def make_dora_adapter(model_dir, out_dir, seed=0) -> Path:
    return _good_then(model_dir, out_dir, seed, use_dora=True)


def make_modules_to_save_adapter(model_dir, out_dir, seed=0) -> Path:
    return _good_then(model_dir, out_dir, seed, modules_to_save=["lm_head"])


def make_bias_adapter(model_dir, out_dir, seed=0, *, bias: str = "all") -> Path:
    """bias="all" / "lora_only" (PEFT's `bias` option), or bias="lora_bias" (`lora_bias=True`,
    which writes `lora_B.bias` tensors)."""
    if bias == "lora_bias":
        return _good_then(model_dir, out_dir, seed, lora_bias=True)
    return _good_then(model_dir, out_dir, seed, bias=bias)


def make_oversized_rank_adapter(model_dir, out_dir, seed=0, *, r: int = 32, via_rank_pattern: bool = False) -> Path:
    """r above the engine's max_lora_rank (tests use max_lora_rank=16), either as `r` itself or
    only for one module through `rank_pattern` (the rest of the adapter has r=4)."""
    if via_rank_pattern:
        return _good_then(model_dir, out_dir, seed, rank_pattern={"v_proj": r})
    return _good_then(model_dir, out_dir, seed, r=r, lora_alpha=2 * r)


def make_other_base_adapter(model_dir, out_dir, seed=0, *, work_dir: Path | str | None = None) -> Path:
    """An adapter made for a different base model: same family and module names, but a different
    hidden size (and MLP width), so every tensor shape mismatches. `base_model_name_or_path` is
    rewritten to `model_dir`, so only the shapes tell."""
    out_dir = Path(out_dir)
    cfg = model_config(model_dir)
    family = cfg["model_type"]
    other_dir = Path(work_dir) if work_dir is not None else out_dir.parent / (out_dir.name + "-otherbase")
    overrides = dict(
        hidden_size=cfg["hidden_size"] + 32,
        intermediate_size=cfg["intermediate_size"] + 64,
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        vocab_size=cfg["vocab_size"],
    )
    if family == "qwen3":
        overrides["head_dim"] = cfg["head_dim"] + 8
    make_tiny_model(other_dir, family=family, seed=seed + 77, **overrides)
    _good_then(other_dir, out_dir, seed)
    config = adapter_config(out_dir)
    config["base_model_name_or_path"] = str(model_dir)
    _write_config(out_dir, config)
    shutil.rmtree(other_dir)
    return out_dir


def make_unknown_module_adapter(model_dir, out_dir, seed=0, *, variant: str = "name") -> Path:
    """Keys naming modules the model does not have.

    variant="name": q_proj renamed to c_attn (GPT-2's name) in the keys and in target_modules.
    variant="layer": the layer-0 tensors moved to a layer index past the model's last layer.
    """
    out_dir = _good_then(model_dir, out_dir, seed)
    tensors = adapter_tensors(out_dir)
    config = adapter_config(out_dir)
    if variant == "name":
        tensors = {k.replace(".q_proj.", ".c_attn."): v for k, v in tensors.items()}
        config["target_modules"] = sorted({"c_attn" if m == "q_proj" else m for m in config["target_modules"]})
    elif variant == "layer":
        n_layers = model_config(model_dir)["num_hidden_layers"]
        tensors = {k.replace(".layers.0.", f".layers.{n_layers + 5}."): v for k, v in tensors.items()}
    else:
        raise ValueError(variant)
    (out_dir / ADAPTER_WEIGHTS).unlink()
    _write_tensors(out_dir, tensors)
    _write_config(out_dir, config)
    return out_dir


def make_missing_config_adapter(model_dir, out_dir, seed=0) -> Path:
    out_dir = _good_then(model_dir, out_dir, seed)
    (out_dir / ADAPTER_CONFIG).unlink()
    return out_dir


def make_missing_weights_adapter(model_dir, out_dir, seed=0) -> Path:
    out_dir = _good_then(model_dir, out_dir, seed)
    (out_dir / ADAPTER_WEIGHTS).unlink()
    return out_dir


def make_truncated_adapter(model_dir, out_dir, seed=0, *, keep: float | int = 0.5) -> Path:
    """adapter_model.safetensors cut short: `keep` is a fraction of the file or a byte count
    (e.g. 5: not even the 8-byte header length survives)."""
    out_dir = _good_then(model_dir, out_dir, seed)
    path = out_dir / ADAPTER_WEIGHTS
    data = path.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else int(keep)
    if not 0 <= n < len(data):
        raise ValueError(f"keep={keep} does not truncate a {len(data)}-byte file")
    path.write_bytes(data[:n])
    return out_dir


def make_corrupt_header_adapter(model_dir, out_dir, seed=0, *, how: str = "garbage_json") -> Path:
    """adapter_model.safetensors with a broken header.

    how="garbage_json": the JSON header replaced by random bytes of the same length;
    how="huge_length": the 8-byte header length set far beyond the file size;
    how="random": the whole file replaced by random bytes.
    """
    out_dir = _good_then(model_dir, out_dir, seed)
    path = out_dir / ADAPTER_WEIGHTS
    data = bytearray(path.read_bytes())
    gen = torch.Generator().manual_seed(3000 + seed)
    (header_len,) = struct.unpack("<Q", bytes(data[:8]))
    if how == "garbage_json":
        junk = torch.randint(0, 256, (header_len,), generator=gen, dtype=torch.uint8).numpy().tobytes()
        # Make sure it is not accidentally valid JSON: start with a byte JSON never starts with.
        data[8 : 8 + header_len] = b"\xff" + junk[1:]
    elif how == "huge_length":
        data[:8] = struct.pack("<Q", 1 << 40)
    elif how == "random":
        data = bytearray(torch.randint(0, 256, (len(data),), generator=gen, dtype=torch.uint8).numpy().tobytes())
    else:
        raise ValueError(how)
    path.write_bytes(bytes(data))
    return out_dir


def make_nonfinite_adapter(model_dir, out_dir, seed=0, *, value: float = float("nan"), which: str = "B") -> Path:
    """One element of one lora_`which` tensor set to `value` (nan, inf, -inf)."""
    out_dir = _good_then(model_dir, out_dir, seed)
    tensors = adapter_tensors(out_dir)
    n_layers = model_config(model_dir)["num_hidden_layers"]
    key = lora_key(n_layers - 1, "down_proj", which)
    t = tensors[key].clone()
    t.view(-1)[t.numel() // 2] = value
    tensors[key] = t
    _write_tensors(out_dir, tensors)
    return out_dir


def make_pickle_only_adapter(model_dir, out_dir, seed=0) -> Path:
    """adapter_config.json + adapter_model.bin (torch.save of the same state dict), no safetensors."""
    out_dir = _good_then(model_dir, out_dir, seed)
    tensors = adapter_tensors(out_dir)
    (out_dir / ADAPTER_WEIGHTS).unlink()
    torch.save(tensors, out_dir / "adapter_model.bin")
    return out_dir


class _Detonator:
    """Unpickling this calls os.mkdir(marker): a harmless, visible trace that a pickle was run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def make_adapter_with_pickle_decoys(model_dir, out_dir, seed=0, **lora_config_kwargs: Any) -> tuple[Path, list[Path], Path]:
    """A valid adapter (safetensors) plus adapter_model.bin and adapter_model.pt decoys.

    adapter_model.bin is garbage bytes (any reader raises); adapter_model.pt is a pickle whose
    unpickling creates the directory `marker` (returned; it must never exist). A loader that
    never opens pickle files loads this adapter normally. Returns (adapter_dir, decoys, marker).
    """
    out_dir = make_adapter(model_dir, out_dir, seed=seed, **lora_config_kwargs)
    gen = torch.Generator().manual_seed(4000 + seed)
    bin_path = out_dir / "adapter_model.bin"
    bin_path.write_bytes(b"\x80\x02GARBAGE" + torch.randint(0, 256, (4096,), generator=gen, dtype=torch.uint8).numpy().tobytes())
    marker = out_dir.parent / (out_dir.name + ".UNPICKLED")
    pt_path = out_dir / "adapter_model.pt"
    with open(pt_path, "wb") as fh:
        pickle.dump(_Detonator(str(marker)), fh, protocol=2)
    return out_dir, [bin_path, pt_path], marker


# name -> (factory(model_dir, out_dir), phrase the AdapterLoadError message must contain)
BAD_ADAPTERS: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    "dora": (make_dora_adapter, "dora"),
    "modules_to_save": (make_modules_to_save_adapter, "modules_to_save"),
    "bias_all": (lambda m, o: make_bias_adapter(m, o, bias="all"), "bias"),
    "bias_lora_only": (lambda m, o: make_bias_adapter(m, o, bias="lora_only"), "bias"),
    "lora_bias": (lambda m, o: make_bias_adapter(m, o, bias="lora_bias"), "bias"),
    "rank_too_big": (lambda m, o: make_oversized_rank_adapter(m, o, r=32), "exceeds max_lora_rank"),
    "rank_pattern_too_big": (
        lambda m, o: make_oversized_rank_adapter(m, o, r=32, via_rank_pattern=True),
        "exceeds max_lora_rank",
    ),
    "other_base": (make_other_base_adapter, "does not fit the base model"),
    "unknown_module_name": (lambda m, o: make_unknown_module_adapter(m, o, variant="name"), "does not have module"),
    "unknown_module_layer": (lambda m, o: make_unknown_module_adapter(m, o, variant="layer"), "does not have module"),
    "missing_config": (make_missing_config_adapter, "adapter_config.json"),
    "missing_weights": (make_missing_weights_adapter, "adapter_model.safetensors"),
    "truncated_half": (lambda m, o: make_truncated_adapter(m, o, keep=0.5), "corrupt or truncated"),
    "truncated_5_bytes": (lambda m, o: make_truncated_adapter(m, o, keep=5), "corrupt or truncated"),
    "corrupt_header_json": (lambda m, o: make_corrupt_header_adapter(m, o, how="garbage_json"), "corrupt or truncated"),
    "corrupt_header_length": (lambda m, o: make_corrupt_header_adapter(m, o, how="huge_length"), "corrupt or truncated"),
    "corrupt_random_bytes": (lambda m, o: make_corrupt_header_adapter(m, o, how="random"), "corrupt or truncated"),
    "nan": (lambda m, o: make_nonfinite_adapter(m, o, value=float("nan"), which="B"), "non-finite"),
    "inf": (lambda m, o: make_nonfinite_adapter(m, o, value=float("inf"), which="A"), "non-finite"),
    "neg_inf": (lambda m, o: make_nonfinite_adapter(m, o, value=float("-inf"), which="B"), "non-finite"),
    "pickle_only": (make_pickle_only_adapter, "pickle"),
}


# --------------------------------------------------------------------------------------------
# Proof that a file was never opened (Linux inotify, through libc)
# --------------------------------------------------------------------------------------------

_IN_ACCESS = 0x00000001
_IN_OPEN = 0x00000020
_IN_NONBLOCK = 0o4000
_EVENT_HEADER = struct.Struct("iIII")


class FileOpenWatcher:
    """Records every open() of the watched files, by any process on this machine.

        with FileOpenWatcher([p1, p2]) as w:
            ...
        assert not w.opened   # set of watched paths that were opened or read
    """

    def __init__(self, paths: Iterable[Path | str]) -> None:
        self.paths = [Path(p) for p in paths]
        self.opened: set[Path] = set()
        self._fd = -1
        self._wd: dict[int, Path] = {}
        name = ctypes.util.find_library("c")
        self._libc = ctypes.CDLL(name or "libc.so.6", use_errno=True)

    @staticmethod
    def available() -> bool:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            return hasattr(libc, "inotify_init1")
        except OSError:
            return False

    def __enter__(self) -> FileOpenWatcher:
        fd = self._libc.inotify_init1(_IN_NONBLOCK)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._fd = fd
        for p in self.paths:
            wd = self._libc.inotify_add_watch(fd, str(p).encode(), _IN_OPEN | _IN_ACCESS)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch({p}) failed")
            self._wd[wd] = p
        return self

    def poll(self) -> set[Path]:
        while True:
            try:
                buf = os.read(self._fd, 65536)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    break
                raise
            if not buf:
                break
            offset = 0
            while offset + _EVENT_HEADER.size <= len(buf):
                wd, mask, _cookie, length = _EVENT_HEADER.unpack_from(buf, offset)
                offset += _EVENT_HEADER.size + length
                if mask & (_IN_OPEN | _IN_ACCESS) and wd in self._wd:
                    self.opened.add(self._wd[wd])
        return self.opened

    def __exit__(self, *exc: Any) -> None:
        try:
            self.poll()
        finally:
            os.close(self._fd)
            self._fd = -1
