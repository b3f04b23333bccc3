"""Which modules an adapter targets: its tensors matched to the base model's modules (by name,
shape and PEFT's selection rule), each targeted slice a `ModuleAdapter`; anything else refused."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from node_agent.engine.adapters.config import AdapterConfig
from node_agent.engine.adapters.errors import CONFIG_FILE, WEIGHTS_FILE, AdapterLoadError, shorten
from node_agent.engine.adapters.header import TensorEntry
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.sharding import (
    EXPERT_KINDS,
    SPARSE_ONLY_KINDS,
    ModuleKey,
    ModuleLayout,
    model_kinds,
    peft_to_kind,
    unsharded_layout,
)

# Matched with fullmatch, ASCII only: a key with a newline or a non-ASCII digit names no module.
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight", re.ASCII)
_MODULE = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp|mlp\.shared_experts?|mlp\.experts\.(?P<expert>\d+))\.(?P<name>\w+)",
    re.ASCII,
)
# PEFT `target_parameters` LoRA on the fused 3-D expert weights: nested wrappers add `.base_layer`.
_FUSED_EXPERTS = re.compile(r"model\.layers\.(?P<layer>\d+)\.mlp\.experts(?:\.base_layer)*", re.ASCII)
# The config fields that choose which modules get LoRA (PEFT's `check_target_module_exists`).
_SELECTING_FIELDS = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern", "target_parameters")


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
    def key(self) -> ModuleKey:
        """The engine's key of the module this slice fills (see CausalLM.lora_modules)."""
        return (self.layer, self.kind) if self.expert is None else (self.layer, self.kind, self.expert)


@dataclass(frozen=True)
class ModuleMatcher:
    """Matches the header's tensors to the base model's modules, with the shapes the layouts give."""

    config: AdapterConfig
    tensors: Mapping[str, TensorEntry]
    cfg: ModelConfig
    max_lora_rank: int

    @cached_property
    def kinds(self) -> dict[tuple[str, str], tuple[str, int]]:
        """The model's PEFT names -> (kind, slice), built once per adapter, not once per module."""
        return peft_to_kind(self.cfg)

    def modules(self) -> list[ModuleAdapter]:
        """Every targeted module slice of the adapter, validated; refuses anything else."""
        self._check_target_names()
        pairs: dict[str, dict[str, str]] = {}
        for key in self.tensors:
            match = _KEY.fullmatch(key)
            if not match:
                raise AdapterLoadError(f"{WEIGHTS_FILE} has tensor {key!r}, which is not a LoRA A/B weight the engine can serve")
            pairs.setdefault(match["module"], {})[match["ab"]] = key
        if not pairs:
            raise AdapterLoadError(f"{WEIGHTS_FILE} has no LoRA tensors")
        _refuse_same_module_twice(pairs)
        full = {kind: unsharded_layout(self.cfg, kind) for kind in model_kinds(self.cfg)}
        modules = []
        for module_name, keys in sorted(pairs.items()):
            if set(keys) != {"A", "B"}:
                missing = "lora_B" if "A" in keys else "lora_A"
                raise AdapterLoadError(f"module {module_name} has no {missing} tensor in {WEIGHTS_FILE}")
            fused = _FUSED_EXPERTS.fullmatch(module_name)
            if fused:
                _refuse_non_canonical(module_name, fused["layer"])
                modules.extend(self._fused_experts(module_name, int(fused["layer"]), keys["A"], keys["B"], full))
            else:
                modules.append(self._module(module_name, keys["A"], keys["B"], full))
        # Two forms of one module (per-expert and fused, or two fused pairs of one parameter).
        seen: dict[tuple[ModuleKey, int], ModuleAdapter] = {}
        for module in modules:
            first = seen.setdefault((module.key, module.slice_index), module)
            if first is not module:
                raise AdapterLoadError(
                    f"{WEIGHTS_FILE} gives one module twice: {first.a_key} and {module.a_key} both adapt "
                    f"{_describe(module)}; which copy to serve is ambiguous"
                )
        return modules

    def _check_target_names(self) -> None:
        targets = self.config.target_modules
        if targets is not None:
            names = {name for (_, name) in self.kinds}
            unknown = sorted(t for t in targets if t.split(".")[-1] not in names)
            if unknown:
                raise AdapterLoadError(
                    shorten(
                        f"base model does not have module(s) {', '.join(unknown)} named in target_modules "
                        f"(it has {', '.join(sorted(names))})",
                        600,
                    )
                )

    def _module(self, module_name: str, a_key: str, b_key: str, full: Mapping[str, ModuleLayout]) -> ModuleAdapter:
        match = _MODULE.fullmatch(module_name)
        if not match:
            raise AdapterLoadError(f"base model does not have module {module_name}")
        _refuse_non_canonical(module_name, match["layer"], match["expert"])
        if not self.config.targets(module_name):
            selecting = ", ".join(
                f"{field} {shorten(repr(self.config.raw[field]), 120)}"
                for field in _SELECTING_FIELDS
                if self.config.raw.get(field) not in (None, [], "")
            )
            raise AdapterLoadError(
                f"module {module_name} has LoRA tensors, but the config does not select it ({selecting}): PEFT would not apply them"
            )
        layer, name = int(match["layer"]), match["name"]
        expert = int(match["expert"]) if match["expert"] is not None else None
        parent = "mlp.experts" if expert is not None else match["parent"]
        if not _module_exists(self.cfg, self.kinds, layer, parent, name, expert):
            raise AdapterLoadError(f"base model does not have module {module_name}")
        kind_name, slice_index = self.kinds[(parent, name)]
        expected = full[kind_name].slices[slice_index]
        out_features, in_features = expected.out.width, expected.inp.width
        a_shape, b_shape = self.tensors[a_key].shape, self.tensors[b_key].shape
        rank = a_shape[0] if len(a_shape) == 2 else -1
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != in_features or b_shape[0] != out_features or b_shape[1] != rank:
            raise AdapterLoadError(
                f"{module_name}: lora_A {list(a_shape)} / lora_B {list(b_shape)} does not fit the base model "
                f"(expected [r, {in_features}] / [{out_features}, r]); is this adapter for another base model?"
            )
        scale = self._checked_scale(module_name, rank)
        return ModuleAdapter(layer, kind_name, slice_index, a_key, b_key, rank, scale, expert)

    def _fused_experts(self, module_name: str, layer: int, a_key: str, b_key: str, full: Mapping[str, ModuleLayout]) -> list[ModuleAdapter]:
        """Split PEFT's `target_parameters` LoRA on the 3-D expert weights into per-expert slices.

        Which parameter a pair adapts is told by its shapes (in → out of each expert kind's
        unsharded layout: gate_up hidden → 2·I, down I → hidden; they can never coincide).
        """
        if not _is_sparse(self.cfg, layer):
            raise AdapterLoadError(f"base model does not have module {module_name} (layer {layer} has no experts)")
        experts = self.cfg.experts().num_experts
        a_shape, b_shape = self.tensors[a_key].shape, self.tensors[b_key].shape
        fits = len(a_shape) == 2 and len(b_shape) == 2 and a_shape[0] % experts == 0 and a_shape[0] == b_shape[1]
        by_shape = {(full[kind].in_features, full[kind].local_out_width): kind for kind in EXPERT_KINDS}
        kind = by_shape.get((a_shape[1], b_shape[0])) if fits else None
        if kind is None:
            expected = " or ".join(
                f"[r*{experts}, {full[k].in_features}] / [{full[k].local_out_width}, r*{experts}] for {k.split('.', 1)[1]}"
                for k in EXPERT_KINDS
            )
            raise AdapterLoadError(
                f"{module_name}: lora_A {list(a_shape)} / lora_B {list(b_shape)} does not fit the base model's experts "
                f"(expected {expected}); is this adapter for another base model?"
            )
        rank = a_shape[0] // experts
        scale = self._checked_scale(f"{module_name.split('.base_layer', 1)[0]}.{kind.split('.', 1)[1]}", rank)
        # Each slice's rows in the fused B are at its offset in the kind's fused output.
        row_offsets, offset = [], 0
        for part in full[kind].slices:
            row_offsets.append(offset)
            offset += part.out.width
        return [
            ModuleAdapter(
                layer,
                kind,
                index,
                a_key,
                b_key,
                rank,
                scale,
                expert,
                a_row_offset=expert * rank,
                b_row_offset=row_offset,
                b_col_start=expert,
                b_col_stride=experts,
            )
            for expert in range(experts)
            for index, row_offset in enumerate(row_offsets)
        ]

    def _checked_scale(self, module_name: str, rank: int) -> float:
        """The module's scale, after refusing a rank above the engine's or one the config disagrees with."""
        if rank > self.max_lora_rank:
            raise AdapterLoadError(f"{module_name}: rank {rank} exceeds max_lora_rank {self.max_lora_rank}")
        configured_rank, alpha = self.config.rank_and_alpha(module_name)
        if configured_rank != rank:
            raise AdapterLoadError(f"{module_name}: tensors have rank {rank} but {CONFIG_FILE} gives r={configured_rank} for it")
        return alpha / math.sqrt(rank) if self.config.use_rslora else alpha / rank


def _refuse_same_module_twice(pairs: Mapping[str, Mapping[str, str]]) -> None:
    """Refuse two module names that are one module once their indices are read as integers
    (`layers.1` and `layers.01`): the model has one of them, and which copy is served would be undefined."""
    seen: dict[tuple[object, ...], str] = {}
    for module_name, keys in sorted(pairs.items()):
        match = _MODULE.fullmatch(module_name)
        if not match:
            continue
        expert = None if match["expert"] is None else int(match["expert"])
        parent = "mlp.experts" if expert is not None else match["parent"]
        identity = (int(match["layer"]), parent, expert, match["name"])
        key = keys.get("A") or keys["B"]
        first = seen.setdefault(identity, key)
        if first != key:
            raise AdapterLoadError(
                f"{WEIGHTS_FILE} gives one module twice: {first} and {key} both name layer {identity[0]}'s "
                f"{parent}{'' if expert is None else f'.{expert}'}.{match['name']}; which copy to serve is ambiguous"
            )


def _refuse_non_canonical(module_name: str, *indices: str | None) -> None:
    """`layers.01` is no module of the model (PEFT would not apply it): indices are written as the model writes them."""
    for index in indices:
        if index is not None and str(int(index)) != index:
            raise AdapterLoadError(f"base model does not have module {module_name} (index {index} is not written as an integer)")


def _describe(module: ModuleAdapter) -> str:
    expert = "" if module.expert is None else f" expert {module.expert}"
    return f"layer {module.layer}'s {module.kind}{expert} (slice {module.slice_index})"


def _module_exists(
    cfg: ModelConfig, kinds: Mapping[tuple[str, str], tuple[str, int]], layer: int, parent: str, name: str, expert: int | None
) -> bool:
    """Does the base model have this module (`kinds`: its `peft_to_kind`)? MLP modules depend on
    whether the layer is sparse."""
    if (parent, name) not in kinds or not 0 <= layer < cfg.num_layers:
        return False
    kind = kinds[(parent, name)][0]
    if parent == "self_attn":
        return True
    if expert is not None:
        return _is_sparse(cfg, layer) and expert < cfg.experts().num_experts
    return _is_sparse(cfg, layer) == (kind in SPARSE_ONLY_KINDS)


def _is_sparse(cfg: ModelConfig, layer: int) -> bool:
    return cfg.moe is not None and layer in cfg.moe.sparse_layers
