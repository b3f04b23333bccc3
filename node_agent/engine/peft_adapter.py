"""Read a PEFT LoRA adapter directory: validate it whole, then read only this rank's slices.

Only `adapter_config.json` and `adapter_model.safetensors` are ever opened; pickle formats
(`.bin`, `.pt`) are refused without being read. Every refusal is an `AdapterLoadError` with one
message naming the problem; nothing is written to the engine until the whole adapter is read.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from node_agent.engine.lora_layers import SliceWeights
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.sharding import (
    MODULE_KINDS,
    PEFT_TO_KIND,
    SHARED_EXPERT_KINDS,
    LoraSliceLayout,
    Span,
    model_kinds,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_MODULE = re.compile(
    r"^model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp|mlp\.shared_expert|mlp\.experts\.(?P<expert>\d+))\.(?P<name>\w+)$"
)
# PEFT `target_parameters` LoRA on the fused 3-D expert weights: nested wrappers add `.base_layer`.
_FUSED_EXPERTS = re.compile(r"^model\.layers\.(?P<layer>\d+)\.mlp\.experts(?:\.base_layer)*$")
FUSED_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class AdapterLoadError(ValueError):
    """An adapter was refused; the message says why. The engine is unchanged."""


@dataclass(frozen=True)
class ModuleAdapter:
    """One targeted module slice (of one expert, for experts): where its tensors are, how it scales.

    PEFT's fused expert LoRA packs all experts in one A [r·E, in] (expert-major rows) and one
    B [out, r·E] (rank-major columns: column j·E + e is rank j of expert e); the offsets and the
    stride below select one expert's part. For every other form they are 0, 0, 0 and 1.
    """

    layer: int
    kind: str  # engine module kind, e.g. "qkv_proj", "experts.down_proj"
    slice_index: int  # which fused slice (q=0, k=1, v=2; gate=0, up=1)
    a_key: str
    b_key: str
    rank: int
    scale: float
    expert: int | None = None  # global expert id
    a_row_offset: int = 0
    b_row_offset: int = 0
    b_col_start: int = 0
    b_col_stride: int = 1

    @property
    def key(self) -> tuple:
        """The engine's key of the module this slice fills (see CausalLM.lora_modules)."""
        return (self.layer, self.kind) if self.expert is None else (self.layer, self.kind, self.expert)


@dataclass(frozen=True)
class AdapterSpec:
    """A validated adapter: its modules and where to read them. No tensor data yet."""

    path: Path
    modules: tuple[ModuleAdapter, ...]
    max_module_rank: int


def read_adapter_spec(path: Path, cfg: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """Validate config and tensor headers against the base model; read no tensor data."""
    path = Path(path)
    config = _read_config(path)
    _refuse_unsupported_features(config)
    weights = _weights_file(path)
    header = _read_header(weights)
    modules = _match_modules(config, header, cfg, max_lora_rank)
    return AdapterSpec(path, tuple(modules), max(m.rank for m in modules))


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise AdapterLoadError(f"adapter directory {path} does not exist")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterLoadError(f"{CONFIG_FILE} not found in {path}")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AdapterLoadError(f"{CONFIG_FILE} in {path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise AdapterLoadError(f"{CONFIG_FILE} in {path} is not a JSON object")
    return config


def _refuse_unsupported_features(config: dict) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterLoadError(f"peft_type {peft_type} is not supported (LORA only)")
    if config.get("use_dora"):
        raise AdapterLoadError("DoRA adapters (use_dora: true) are not supported")
    if config.get("modules_to_save"):
        raise AdapterLoadError(f"modules_to_save is not supported (adapter sets {config['modules_to_save']})")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise AdapterLoadError("LoRA bias is not supported (adapter config sets bias/lora_bias)")
    if config.get("fan_in_fan_out"):
        raise AdapterLoadError("fan_in_fan_out adapters (Conv1D models) are not supported")
    # Entries match parameter names by suffix (PEFT may also move a target_modules name here).
    fused_names = {name.rsplit(".", 1)[-1] for name in FUSED_PARAMETERS}
    unknown = sorted(t for t in config.get("target_parameters") or [] if t.rsplit(".", 1)[-1] not in fused_names)
    if unknown:
        raise AdapterLoadError(
            f"target_parameters {', '.join(unknown)} are not supported (supported: {', '.join(FUSED_PARAMETERS)})"
        )
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise AdapterLoadError(f"{CONFIG_FILE}: {field} must be a positive number, got {value!r}")


def _weights_file(path: Path) -> Path:
    weights = path / WEIGHTS_FILE
    if weights.is_file():
        return weights
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise AdapterLoadError(
            f"{WEIGHTS_FILE} not found in {path}; pickle formats ({', '.join(pickled)}) are refused, "
            "convert the adapter to safetensors"
        )
    raise AdapterLoadError(f"{WEIGHTS_FILE} not found in {path}")


def _read_header(weights: Path) -> dict[str, list[int]]:
    """Tensor shapes from the safetensors header; a bad or short file is refused here."""
    try:
        with safe_open(str(weights), framework="pt") as handle:
            return {key: list(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except Exception as error:  # safetensors raises its own error types
        raise AdapterLoadError(f"{WEIGHTS_FILE} is corrupt or truncated: {error}") from error


def _match_modules(config: dict, header: dict[str, list[int]], cfg: ModelConfig, max_lora_rank: int) -> list[ModuleAdapter]:
    _check_target_names(config, cfg)
    pairs: dict[str, dict[str, str]] = {}
    for key in header:
        match = _KEY.match(key)
        if not match:
            raise AdapterLoadError(f"{WEIGHTS_FILE} has tensor {key!r}, which is not a LoRA A/B weight the engine can serve")
        pairs.setdefault(match["module"], {})[match["ab"]] = key
    if not pairs:
        raise AdapterLoadError(f"{WEIGHTS_FILE} has no LoRA tensors")
    modules = []
    for module_name, keys in sorted(pairs.items()):
        if set(keys) != {"A", "B"}:
            missing = "lora_B" if "A" in keys else "lora_A"
            raise AdapterLoadError(f"module {module_name} has no {missing} tensor in {WEIGHTS_FILE}")
        if _FUSED_EXPERTS.match(module_name):
            modules.extend(_fused_expert_adapters(module_name, keys["A"], keys["B"], header, config, cfg, max_lora_rank))
        else:
            modules.append(_module_adapter(module_name, keys["A"], keys["B"], header, config, cfg, max_lora_rank))
    return modules


def _check_target_names(config: dict, cfg: ModelConfig) -> None:
    targets = config.get("target_modules")
    if isinstance(targets, list):
        kinds = model_kinds(cfg)
        names = {name for (_, name), (kind, _) in PEFT_TO_KIND.items() if kind in kinds}
        unknown = sorted(t for t in targets if t.split(".")[-1] not in names)
        if unknown:
            raise AdapterLoadError(
                f"base model does not have module(s) {', '.join(unknown)} named in target_modules "
                f"(it has {', '.join(sorted(names))})"
            )


def _module_adapter(module_name, a_key, b_key, header, config, cfg: ModelConfig, max_lora_rank) -> ModuleAdapter:
    match = _MODULE.match(module_name)
    layer = int(match["layer"]) if match else -1
    expert = int(match["expert"]) if match and match["expert"] is not None else None
    parent = "mlp.experts" if expert is not None else (match["parent"] if match else "")
    if not match or not _module_exists(cfg, layer, parent, match["name"], expert):
        raise AdapterLoadError(f"base model does not have module {module_name}")
    kind_name, slice_index = PEFT_TO_KIND[(parent, match["name"])]
    out_features, in_features = expected_shape(cfg, match["name"], experts=expert is not None,
                                               shared=parent == "mlp.shared_expert")
    a_shape, b_shape = header[a_key], header[b_key]
    rank = a_shape[0] if len(a_shape) == 2 else -1
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != in_features or b_shape[0] != out_features or b_shape[1] != rank:
        raise AdapterLoadError(
            f"{module_name}: lora_A {a_shape} / lora_B {b_shape} does not fit the base model "
            f"(expected [r, {in_features}] / [{out_features}, r]); is this adapter for another base model?"
        )
    if rank > max_lora_rank:
        raise AdapterLoadError(f"{module_name}: rank {rank} exceeds max_lora_rank {max_lora_rank}")
    configured_rank, alpha = _rank_and_alpha(config, module_name)
    if configured_rank != rank:
        raise AdapterLoadError(
            f"{module_name}: tensors have rank {rank} but {CONFIG_FILE} gives r={configured_rank} for it"
        )
    return ModuleAdapter(layer, kind_name, slice_index, a_key, b_key, rank, _scale(config, alpha, rank), expert)


def _scale(config: dict, alpha: float, rank: int) -> float:
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _module_exists(cfg: ModelConfig, layer: int, parent: str, name: str, expert: int | None) -> bool:
    """Does the base model have this module? MLP modules depend on whether the layer is sparse."""
    if (parent, name) not in PEFT_TO_KIND or not 0 <= layer < cfg.num_layers:
        return False
    kind = PEFT_TO_KIND[(parent, name)][0]
    if kind not in model_kinds(cfg):
        return False
    if parent == "self_attn":
        return True
    if parent == "mlp.experts":
        return _is_sparse(cfg, layer) and expert < cfg.moe.num_experts
    return _is_sparse(cfg, layer) == (kind in SHARED_EXPERT_KINDS)


def _is_sparse(cfg: ModelConfig, layer: int) -> bool:
    return cfg.moe is not None and layer in cfg.moe.sparse_layers


def _fused_expert_adapters(module_name, a_key, b_key, header, config, cfg: ModelConfig, max_lora_rank) -> list[ModuleAdapter]:
    """Split PEFT's `target_parameters` LoRA on the 3-D expert weights into per-expert slices.

    Which parameter a pair adapts is told by its shapes: gate_up_proj maps hidden → 2·I,
    down_proj I → hidden, and the two can never coincide (that would need hidden = I = 2·I).
    """
    layer = int(_FUSED_EXPERTS.match(module_name)["layer"])
    if not _is_sparse(cfg, layer):
        raise AdapterLoadError(f"base model does not have module {module_name} (layer {layer} has no experts)")
    experts, hidden, inter = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    a_shape, b_shape = header[a_key], header[b_key]
    fits = len(a_shape) == 2 and len(b_shape) == 2 and a_shape[0] % experts == 0 and a_shape[0] == b_shape[1]
    projection = {(hidden, 2 * inter): "gate_up_proj", (inter, hidden): "down_proj"}.get(
        (a_shape[1], b_shape[0]) if fits else None
    )
    if projection is None:
        raise AdapterLoadError(
            f"{module_name}: lora_A {a_shape} / lora_B {b_shape} does not fit the base model's experts "
            f"(expected [r*{experts}, {hidden}] / [{2 * inter}, r*{experts}] for gate_up_proj or "
            f"[r*{experts}, {inter}] / [{hidden}, r*{experts}] for down_proj); is this adapter for another base model?"
        )
    rank = a_shape[0] // experts
    parameter_name = f"{module_name.split('.base_layer')[0]}.{projection}"
    if rank > max_lora_rank:
        raise AdapterLoadError(f"{parameter_name}: rank {rank} exceeds max_lora_rank {max_lora_rank}")
    configured_rank, alpha = _rank_and_alpha(config, parameter_name)
    if configured_rank != rank:
        raise AdapterLoadError(f"{parameter_name}: tensors have rank {rank} but {CONFIG_FILE} gives r={configured_rank} for it")
    scale = _scale(config, alpha, rank)
    kind = f"experts.{projection}"
    slices = [(0, 0), (1, inter)] if projection == "gate_up_proj" else [(0, 0)]
    return [
        ModuleAdapter(layer, kind, index, a_key, b_key, rank, scale, expert, a_row_offset=expert * rank,
                      b_row_offset=row_offset, b_col_start=expert, b_col_stride=experts)
        for expert in range(experts)
        for index, row_offset in slices
    ]


def _rank_and_alpha(config: dict, module_name: str) -> tuple[int, float]:
    """r and alpha of one module, with rank_pattern / alpha_pattern applied as PEFT does."""
    rank = config.get("rank_pattern") or {}
    alpha = config.get("alpha_pattern") or {}
    return int(rank.get(_pattern_key(rank, module_name), config["r"])), float(
        alpha.get(_pattern_key(alpha, module_name), config["lora_alpha"])
    )


def _pattern_key(patterns: dict, module_name: str) -> str:
    # PEFT's rule: the first pattern that matches a dotted suffix of the module name wins.
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return pattern
    return module_name


def expected_shape(cfg: ModelConfig, peft_module: str, experts: bool = False, shared: bool = False) -> tuple[int, int]:
    """(out, in) features of an unsharded PEFT target module (of one expert) in the base model."""
    if peft_module == "shared_expert_gate":
        return 1, cfg.hidden_size
    if experts or shared:
        inter = cfg.moe.shared_expert_intermediate_size if shared else cfg.moe.intermediate_size
        return {"gate_proj": (inter, cfg.hidden_size), "up_proj": (inter, cfg.hidden_size),
                "down_proj": (cfg.hidden_size, inter)}[peft_module]
    return {
        "q_proj": (cfg.q_size, cfg.hidden_size),
        "k_proj": (cfg.kv_size, cfg.hidden_size),
        "v_proj": (cfg.kv_size, cfg.hidden_size),
        "o_proj": (cfg.hidden_size, cfg.q_size),
        "gate_proj": (cfg.intermediate_size, cfg.hidden_size),
        "up_proj": (cfg.intermediate_size, cfg.hidden_size),
        "down_proj": (cfg.hidden_size, cfg.intermediate_size),
    }[peft_module]


@dataclass
class AdapterShard:
    """This rank's part of one adapter, ready to be copied into LoRA slots."""

    weights: dict[tuple, list[SliceWeights | None]]  # keyed like CausalLM.lora_modules()
    nbytes: int


def read_adapter_shard(
    spec: AdapterSpec,
    lora_layouts: dict[tuple, tuple[LoraSliceLayout, ...]],
    dtype: torch.dtype,
) -> AdapterShard:
    """Read this rank's slices of every module (per `lora_layouts`), padded to max rank."""
    weights: dict[tuple, list[SliceWeights | None]] = {}
    nbytes = 0
    try:
        handle = safe_open(str(spec.path / WEIGHTS_FILE), framework="pt")
    except Exception as error:
        raise AdapterLoadError(f"{WEIGHTS_FILE} is corrupt or truncated: {error}") from error
    for module in spec.modules:
        layouts = lora_layouts.get(module.key)
        if layouts is None:
            if module.expert is None:
                raise AdapterLoadError(f"engine has no module for {module.a_key}")
            continue  # an expert held by another expert-parallel group
        layout = layouts[module.slice_index]
        a = _read_padded(handle, module.a_key, rows=layout.a_rank, cols=layout.a_in, real_rows=module.rank,
                         row_offset=module.a_row_offset)
        b = _read_padded(handle, module.b_key, rows=layout.b_out, cols=layout.b_rank, real_cols=module.rank,
                         row_offset=module.b_row_offset, col_start=module.b_col_start, col_stride=module.b_col_stride)
        for tensor, key in ((a, module.a_key), (b, module.b_key)):
            if not torch.isfinite(tensor).all():
                raise AdapterLoadError(f"tensor {key} has non-finite values (NaN or Inf)")
        slices = weights.setdefault(module.key, [None] * len(MODULE_KINDS[module.kind].peft_modules))
        slices[module.slice_index] = SliceWeights(a.to(dtype), b.to(dtype), module.scale)
        nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
    return AdapterShard(weights, nbytes)


def _read_padded(handle, key: str, rows: Span, cols: Span, real_rows: int | None = None, real_cols: int | None = None,
                 row_offset: int = 0, col_start: int = 0, col_stride: int = 1) -> torch.Tensor:
    """Read rows×cols of a 2-D tensor, zero-filling the part beyond its real rank.

    Logical row i is file row `row_offset + i`; logical column j is file column
    `col_start + j·col_stride` (how PEFT packs experts into one B).
    """
    out = torch.zeros(rows.width, cols.width, dtype=torch.float32)
    row_stop = min(rows.stop, real_rows) if real_rows is not None else rows.stop
    col_stop = min(cols.stop, real_cols) if real_cols is not None else cols.stop
    if row_stop > rows.start and col_stop > cols.start:
        first = col_start + cols.start * col_stride
        last = col_start + (col_stop - 1) * col_stride
        part = handle.get_slice(key)[row_offset + rows.start : row_offset + row_stop, first : last + 1]
        out[: row_stop - rows.start, : col_stop - cols.start] = part[:, ::col_stride].float()
    return out
