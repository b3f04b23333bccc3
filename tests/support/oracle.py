"""The numeric oracle: HF `transformers` + `peft` logits on the CPU in fp32.

`reference_logits` runs one sequence at a time, without padding, each adapter loaded by
`PeftModel.from_pretrained` onto its own copy of the base model; models are cached by the
identity of their files. `manual_lora_logits` is an independent second oracle (a hand merge of
W += scale·B·A) that cross-checks the first.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from lorafleet_dev.synthetic import PEFT_PREFIX
from tests.support.models import adapter_config, adapter_tensors, load_base_model, quietly


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


def _cached_base(model_dir: Path):
    key = _file_key(model_dir)
    if key not in _BASE_CACHE:
        _BASE_CACHE[key] = load_base_model(model_dir)
    return _BASE_CACHE[key]


@quietly
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

    Reads the adapter files directly and applies the scale rule of docs/design.md §3 (alpha/r, alpha/sqrt(r)
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
