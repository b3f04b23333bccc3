"""Adapters the engine must refuse, one factory per defect (docs/design.md §6).

Each factory writes into out_dir and returns it; most start from a small valid PEFT adapter and
then break one thing. `BAD_ADAPTERS` maps each case to its factory and the phrase the engine's
`AdapterLoadError` must contain.
"""

from __future__ import annotations

import json
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


# --- malformed adapter_config.json, duplicate modules, non-float dtypes ---------------
# A separate table from BAD_ADAPTERS (whose self-checks, tests/support/test_bad_adapters.py, are
# per case): each entry is the factory and the phrases (lower case) the refusal must contain.

_REMOVE = object()  # a field value meaning "drop the field"


def make_bad_config_adapter(model_dir, out_dir, seed=0, *, text: str | None = None, **fields: Any) -> Path:
    """The seed adapter with `fields` set in adapter_config.json (`_REMOVE` drops one), written
    with json.dumps (which writes NaN/Infinity literals for non-finite floats); or the whole file
    replaced by `text`, where `{config}` stands for the adapter's own config as JSON."""
    out_dir = _good_then(model_dir, out_dir, seed)
    config = adapter_config(out_dir)
    for key, value in fields.items():
        if value is _REMOVE:
            config.pop(key, None)
        else:
            config[key] = value
    body = json.dumps(config, indent=2, sort_keys=True)
    path = out_dir / ADAPTER_CONFIG
    path.write_text(text.replace("{config}", body) if text is not None else body + "\n")
    return out_dir


def make_nested_config_adapter(model_dir, out_dir, seed=0, *, depth: int = 100_000) -> Path:
    """adapter_config.json with a field nested `depth` levels deep (json.loads recursed into a RecursionError)."""
    out_dir = _good_then(model_dir, out_dir, seed)
    config = json.dumps(adapter_config(out_dir))
    (out_dir / ADAPTER_CONFIG).write_text(config[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}")
    return out_dir


def make_duplicate_module_adapter(model_dir, out_dir, seed=0, *, copy_as: str = "01") -> Path:
    """Layer 1's q_proj pair written a second time as layer `copy_as` (e.g. "01"): one module, two keys."""
    out_dir = _good_then(model_dir, out_dir, seed)
    tensors = adapter_tensors(out_dir)
    for which in ("A", "B"):
        key = lora_key(1, "q_proj", which)
        tensors[key.replace(".layers.1.", f".layers.{copy_as}.")] = tensors[key].clone() * 2
    write_adapter_weights(out_dir, tensors)
    return out_dir


def make_renumbered_module_adapter(model_dir, out_dir, seed=0, *, name_as: str = "00") -> Path:
    """Layer 0's tensors renamed to layer `name_as` ("00": no module of the model is called that)."""
    out_dir = _good_then(model_dir, out_dir, seed)
    tensors = {k.replace(".layers.0.", f".layers.{name_as}."): v for k, v in adapter_tensors(out_dir).items()}
    (out_dir / ADAPTER_WEIGHTS).unlink()
    write_adapter_weights(out_dir, tensors)
    return out_dir


def make_int_dtype_adapter(model_dir, out_dir, seed=0, *, dtype: torch.dtype = torch.int8) -> Path:
    """One lora_B tensor stored as `dtype` (int8, int32, bool: safetensors I8, I32, BOOL)."""
    out_dir = _good_then(model_dir, out_dir, seed)
    tensors = adapter_tensors(out_dir)
    key = lora_key(0, "v_proj", "B")
    tensors[key] = (tensors[key] * 100).to(dtype)
    write_adapter_weights(out_dir, tensors)
    return out_dir


def _config(**fields: Any) -> Callable[[Path, Path], Path]:
    return lambda m, o: make_bad_config_adapter(m, o, **fields)


_CAP = 1 << 20
MALFORMED_ADAPTERS: dict[str, tuple[Callable[[Path, Path], Path], tuple[str, ...]]] = {
    # size and shape of the document
    "config_over_cap": (_config(padding="x" * _CAP), ("over the 1048576-byte cap",)),
    "config_deeply_nested": (make_nested_config_adapter, ("nests more than 64 levels",)),
    "config_not_json_huge_int": (lambda m, o: make_bad_config_adapter(m, o, text='{"r": ' + "9" * 5000 + "}"), ("not valid json",)),
    # types, every field naming itself
    "target_modules_int_entry": (_config(target_modules=["q_proj", 5, "v_proj", "down_proj"]), ("target_modules[1]:", "string")),
    "target_modules_number": (_config(target_modules=5), ("target_modules:",)),
    "rank_pattern_string_value": (_config(rank_pattern={"v_proj": "eight"}), ("rank_pattern['v_proj']:", "integer")),
    "rank_pattern_fraction": (_config(rank_pattern={"v_proj": 4.5}), ("rank_pattern['v_proj']:", "integer")),
    "rank_pattern_list": (_config(rank_pattern=["v_proj"]), ("rank_pattern:",)),
    "r_string": (_config(r="4"), ("adapter_config.json: r:", "integer")),
    "r_bool": (_config(r=True), ("adapter_config.json: r:", "integer")),
    "r_missing": (_config(r=_REMOVE), ("'r' is a required property",)),
    "lora_alpha_string": (_config(lora_alpha="8"), ("lora_alpha:", "number")),
    "use_rslora_string": (_config(use_rslora="yes"), ("use_rslora:", "boolean")),
    "use_dora_string": (_config(use_dora="false"), ("use_dora:", "boolean")),
    "peft_type_number": (_config(peft_type=5), ("peft_type:", "string")),
    "bias_number": (_config(bias=0), ("bias:", "string")),
    "modules_to_save_string": (_config(modules_to_save="lm_head"), ("modules_to_save:", "array")),
    "target_parameters_string": (_config(target_parameters="mlp.experts.down_proj"), ("target_parameters:", "array")),
    "fan_in_fan_out_string": (_config(fan_in_fan_out="no"), ("fan_in_fan_out:", "boolean")),
    # numbers
    "lora_alpha_nan": (_config(lora_alpha=float("nan")), ("lora_alpha is nan", "finite")),
    "lora_alpha_inf": (_config(lora_alpha=float("inf")), ("lora_alpha is inf", "finite")),
    "lora_alpha_neg_inf": (_config(lora_alpha=float("-inf")), ("lora_alpha is -inf", "finite")),
    "lora_alpha_1e999": (
        lambda m, o: make_bad_config_adapter(m, o, text='{"r": 4, "lora_alpha": 1e999, "target_modules": ["q_proj"]}'),
        ("lora_alpha is inf", "finite"),
    ),
    "alpha_pattern_negative": (_config(alpha_pattern={"q_proj": -2}), ("alpha_pattern['q_proj']:",)),
    "alpha_pattern_nan": (_config(alpha_pattern={"q_proj": float("nan")}), ("alpha_pattern['q_proj'] is nan", "finite")),
    "alpha_pattern_inf": (_config(alpha_pattern={"q_proj": float("inf")}), ("alpha_pattern['q_proj'] is inf", "finite")),
    "r_zero": (_config(r=0), ("adapter_config.json: r:", "minimum")),
    "r_negative": (_config(r=-4), ("adapter_config.json: r:", "minimum")),
    "r_fraction": (_config(r=4.5), ("adapter_config.json: r:", "integer")),
    "rank_pattern_zero": (_config(rank_pattern={"v_proj": 0}), ("rank_pattern['v_proj']:", "minimum")),
    "rank_pattern_negative": (_config(rank_pattern={"v_proj": -4}), ("rank_pattern['v_proj']:", "minimum")),
    # patterns: refused by RE2 (linear time), by Python's re (PEFT's engine), or read differently by the two
    "rank_pattern_backreference": (_config(rank_pattern={r"(v)\1?_proj": 4}), ("rank_pattern", "re2", "(v)")),
    "alpha_pattern_lookahead": (_config(alpha_pattern={r"(?=q)q_proj": 2}), ("alpha_pattern", "re2", "(?=q)")),
    "target_modules_lookbehind": (_config(target_modules=r".*(?<=self_attn\.)(q|v)_proj|.*down_proj"), ("target_modules", "re2")),
    "rank_pattern_not_a_regex": (_config(rank_pattern={"(v_proj": 4}), ("rank_pattern", "not a valid regular expression")),
    "rank_pattern_posix_class": (_config(rank_pattern={"[[:alpha:]]_proj": 4}), ("rank_pattern", "mean different things")),
    "rank_pattern_key_too_long": (_config(rank_pattern={"v_proj|" * 200 + "v_proj": 4}), ("rank_pattern:", "fails maxlength 1024")),
    # target_modules as a regex selects modules as PEFT does (re.fullmatch): tensors it does not select are refused
    "target_modules_regex_unselected": (_config(target_modules=r".*\.(q_proj|v_proj)"), ("does not select", "down_proj")),
    # ... and as a list (names or dotted suffixes): PEFT leaves tensors of modules it does not name unapplied
    "target_modules_list_unselected": (_config(target_modules=["q_proj", "self_attn.v_proj"]), ("does not select", "down_proj")),
    # ... and with exclude_modules or layers_to_transform, which PEFT applies before and after the names
    "exclude_modules_selected": (_config(exclude_modules=["mlp.down_proj"]), ("does not select", "down_proj", "exclude_modules")),
    "layers_to_transform_unselected": (_config(layers_to_transform=[0]), ("does not select", "layers.1.", "layers_to_transform [0]")),
    # the same module twice, or a module the model does not have under an integer's other spelling
    "duplicate_module_layer_01": (
        make_duplicate_module_adapter,
        ("twice", "model.layers.01.self_attn.q_proj.lora_a", "model.layers.1.self_attn.q_proj.lora_a"),
    ),
    "renumbered_module_layer_00": (make_renumbered_module_adapter, ("does not have module", "layers.00")),
    # non-float tensor dtypes
    "dtype_int8": (lambda m, o: make_int_dtype_adapter(m, o, dtype=torch.int8), ("has dtype 'i8'",)),
    "dtype_int32": (lambda m, o: make_int_dtype_adapter(m, o, dtype=torch.int32), ("has dtype 'i32'",)),
    "dtype_bool": (lambda m, o: make_int_dtype_adapter(m, o, dtype=torch.bool), ("has dtype 'bool'",)),
}


def make_catastrophic_pattern_adapter(model_dir, out_dir, clean_dir, seed=0) -> tuple[Path, Path]:
    """The seed adapter (written also, untouched, to `clean_dir`) with patterns Python's re
    backtracks on exponentially for every module name, none of which changes what is served:
    `([\\w.]+)+x` as a rank_pattern and alpha_pattern key (it matches no module name), and a string
    target_modules whose first alternative is that pattern and whose second selects the seed's
    modules. PEFT itself would hang on it, so the reference is `clean_dir`. Returns both directories."""
    clean_dir = _good_then(model_dir, clean_dir, seed)
    out_dir = Path(out_dir)
    shutil.copytree(clean_dir, out_dir)
    config = adapter_config(out_dir)
    evil = r"([\w.]+)+x"
    config["rank_pattern"] = {evil: 16, **(config.get("rank_pattern") or {})}
    config["alpha_pattern"] = {evil: 1000.0, **(config.get("alpha_pattern") or {})}
    config["target_modules"] = rf"({evil})|.*\.({'|'.join(sorted(config['target_modules']))})"
    write_adapter_config(out_dir, config)
    return out_dir, clean_dir


def make_nested_header_adapter(model_dir, out_dir, seed=0, *, depth: int = 100_000) -> Path:
    """adapter_model.safetensors whose JSON header nests `depth` levels deep (in `__metadata__`)."""
    out_dir = _good_then(model_dir, out_dir, seed)
    path = out_dir / ADAPTER_WEIGHTS
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    text = json.dumps(header)[:-1] + ', "__metadata__": {"deep": ' + "[" * depth + "]" * depth + "}}"
    path.write_bytes(struct.pack("<Q", len(text)) + text.encode() + data[8 + length :])
    return out_dir


MALFORMED_ADAPTERS["header_deeply_nested"] = (make_nested_header_adapter, ("corrupt or truncated", "nests more than 64 levels"))
