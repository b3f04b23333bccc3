"""Shared pieces of the engine acceptance tests: models, adapters, token draws, comparison.

Models and adapters are made once per test session (tiny; seconds) in a temporary directory
(the `artifacts` fixture in conftest.py) and shared by test_equivalence.py and test_refusals.py.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import support as R

ATOL = 1e-4
RTOL = 1e-4

# name -> (family, overrides for make_tiny_model)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # untied, kv=2, checkpoint split into many files (multi-file reading)
    "llama": ("llama", dict(max_shard_size="40KB")),
    # one KV head: replicated over attention-TP 2 and 4; tied embeddings; one file
    "llama_kv1_tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True, seed=1)),
    # head_dim 24 * 4 heads = 96 != hidden 64; q/k norms; tied; multi-file
    "qwen3_tied": ("qwen3", dict(head_dim=24, tie_word_embeddings=True, max_shard_size="40KB", seed=2)),
    # head_dim 32 * 4 = 128 != 64; one KV head; three layers; untied
    "qwen3_kv1": ("qwen3", dict(head_dim=32, num_key_value_heads=1, num_hidden_layers=3, seed=3)),
}


def standard_adapters(n_layers: int) -> dict[str, dict[str, Any]]:
    """Adapters for engines with max_lora_rank=16 (name -> LoraConfig kwargs + seed)."""
    return {
        "all_list": dict(seed=11, r=8, lora_alpha=16, target_modules=list(R.ALL_MODULES)),
        # partial QKV (k slice zero); rank 2 < max, and < tp=4 (fully-sharded padding)
        "qv_r2": dict(seed=12, r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
        # row-parallel only; rank == max_lora_rank
        "down_r16": dict(seed=13, r=16, lora_alpha=8, target_modules=["down_proj"]),
        "rslora_all_linear": dict(seed=14, r=8, lora_alpha=16, use_rslora=True, target_modules="all-linear"),
        "patterns_regex": dict(
            seed=15,
            r=8,
            lora_alpha=16,
            target_modules=r".*\.(k_proj|o_proj|gate_proj|up_proj)$",
            rank_pattern={"o_proj": 4, r"layers\.1\.mlp\.gate_proj": 12},
            alpha_pattern={"k_proj": 3, "up_proj": 40},
        ),
        "layers_subset": dict(
            seed=16,
            r=6,
            lora_alpha=12,
            target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"],
            layers_to_transform=[n_layers - 1],
        ),
        "rslora_patterns": dict(
            seed=17,
            r=4,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["q_proj", "v_proj", "down_proj"],
            rank_pattern={"down_proj": 16},
            alpha_pattern={"q_proj": 2},
        ),
        # used as a same-name replacement of "all_list": different weights, fewer targets
        "replacement": dict(seed=18, r=4, lora_alpha=4, target_modules=["up_proj", "v_proj"]),
    }


def small_adapters(n_layers: int) -> dict[str, dict[str, Any]]:
    """Adapters for engines with max_lora_rank=4 (fully sharded at tp=4: one rank row per rank)."""
    return {
        "all_r4": dict(seed=21, r=4, lora_alpha=8, target_modules=list(R.ALL_MODULES)),
        "qkv_r1_rs": dict(seed=22, r=1, lora_alpha=2, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj"]),
        "mlp_r2": dict(seed=23, r=2, lora_alpha=3, target_modules=["gate_proj", "up_proj", "down_proj"]),
        "o_r3_layer0": dict(seed=24, r=3, lora_alpha=6, target_modules=["o_proj"], layers_to_transform=[0]),
        "replacement": dict(seed=25, r=2, lora_alpha=2, target_modules=["up_proj", "v_proj"]),
    }


ADAPTER_SETS = {"standard": standard_adapters, "small": small_adapters}


class Artifacts:
    """Lazily built models and adapters, cached for the session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._models: dict[str, Path] = {}
        self._adapters: dict[tuple[str, str, str], Path] = {}

    def model(self, name: str) -> Path:
        if name not in self._models:
            family, overrides = MODELS[name]
            overrides = dict(overrides)
            seed = overrides.pop("seed", 0)
            self._models[name] = R.make_tiny_model(self.root / "models" / name, family, seed=seed, **overrides)
        return self._models[name]

    def n_layers(self, model: str) -> int:
        return R.model_config(self.model(model))["num_hidden_layers"]

    def adapter(self, model: str, adapter_set: str, name: str) -> Path:
        key = (model, adapter_set, name)
        if key not in self._adapters:
            kwargs = dict(ADAPTER_SETS[adapter_set](self.n_layers(model))[name])
            seed = kwargs.pop("seed")
            out = self.root / "adapters" / model / adapter_set / name
            self._adapters[key] = R.make_adapter(self.model(model), out, seed=seed, **kwargs)
        return self._adapters[key]

    def adapters(self, model: str, adapter_set: str) -> dict[str, Path]:
        names = ADAPTER_SETS[adapter_set](self.n_layers(model))
        return {name: self.adapter(model, adapter_set, name) for name in names}


def read_shard(spec: Any, layouts: Any, dtype: torch.dtype = torch.float32) -> Any:
    """One rank's loader on `spec`'s weights file, opened here as a rank opens it."""
    from node_agent.engine.adapters.errors import WEIGHTS_FILE
    from node_agent.engine.adapters.reads import read_adapter_shard

    with (spec.path / WEIGHTS_FILE).open("rb") as weights:
        return read_adapter_shard(spec, weights.fileno(), layouts, dtype)


def engine_api():
    """The engine's public API; a missing or broken engine fails the tests (never skips them)."""
    try:
        return importlib.import_module("node_agent.engine")
    except Exception as exc:
        pytest.fail(f"node_agent.engine is not importable: {type(exc).__name__}: {exc}", pytrace=False)


def draw_tokens(seed: int, length: int, vocab: int) -> list[int]:
    """Deterministic token ids; every draw includes the last vocabulary id (padding bugs at the
    end of a vocabulary not divisible by tp) and, from length 3, id 0."""
    gen = torch.Generator().manual_seed(5000 + seed)
    tokens = torch.randint(0, vocab, (length,), generator=gen).tolist()
    tokens[length // 2] = vocab - 1
    if length >= 3:
        tokens[0] = 0
    return tokens


@dataclass
class Seq:
    tokens: list[int]
    adapter: str | None

    def label(self, index: int) -> str:
        return f"seq {index} (adapter={self.adapter}, len={len(self.tokens)})"


@dataclass
class Mismatches:
    lines: list[str] = field(default_factory=list)

    def fail_if_any(self, what: str) -> None:
        if self.lines:
            pytest.fail(f"{what}: {len(self.lines)} mismatch(es)\n  " + "\n  ".join(self.lines), pytrace=False)


def compare(got: Any, want: list[torch.Tensor], seqs: list[Seq], *, atol: float = ATOL, rtol: float = RTOL) -> Mismatches:
    """Compare the engine's logits to the reference, sequence by sequence, collecting every
    mismatch with its max abs diff (so one failure report shows the whole picture)."""
    out = Mismatches()
    if not isinstance(got, (list, tuple)) or len(got) != len(want):
        length = len(got) if hasattr(got, "__len__") else "?"
        out.lines.append(f"engine returned {type(got).__name__} of length {length}, want list of {len(want)}")
        return out
    for i, (g, w, s) in enumerate(zip(got, want, seqs, strict=True)):
        if not isinstance(g, torch.Tensor):
            out.lines.append(f"{s.label(i)}: got {type(g).__name__}, want torch.Tensor")
            continue
        if g.dtype != torch.float32 or tuple(g.shape) != tuple(w.shape):
            out.lines.append(f"{s.label(i)}: got {g.dtype} {tuple(g.shape)}, want float32 {tuple(w.shape)}")
            continue
        try:
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol)
        except AssertionError:
            diff = (g - w).abs()
            finite = bool(torch.isfinite(g).all())
            worst = int(diff.nan_to_num(float("inf")).flatten().argmax())
            row, col = divmod(worst, w.shape[1])
            out.lines.append(
                f"{s.label(i)}: max abs diff {diff.max().item():.3e} at token {row} vocab {col}"
                f" (ref logit scale {w.abs().max().item():.2f}; finite={finite}; rows off: "
                f"{[r for r in range(w.shape[0]) if not torch.allclose(g[r], w[r], atol=atol, rtol=rtol)]})"
            )
    return out
