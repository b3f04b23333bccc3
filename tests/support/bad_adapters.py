"""Adapters the engine must refuse, one factory per defect (docs/design.md §6).

Each factory writes into out_dir and returns it; most start from a small valid PEFT adapter and
then break one thing. `BAD_ADAPTERS` maps each case to its factory and the phrase the engine's
`AdapterLoadError` must contain.
"""

from __future__ import annotations

import os
import pickle
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lorafleet_dev.synthetic import ADAPTER_CONFIG, ADAPTER_WEIGHTS, lora_key, write_adapter_config, write_adapter_weights
from tests.support.models import adapter_config, adapter_tensors, make_adapter, make_tiny_model, model_config

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
    write_adapter_config(out_dir, config)
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
    write_adapter_weights(out_dir, tensors)
    write_adapter_config(out_dir, config)
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
    write_adapter_weights(out_dir, tensors)
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
