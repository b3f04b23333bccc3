"""An adapter's `adapter_config.json`: its schema, the features the engine refuses, and the
validated `AdapterConfig` whose fields choose and scale the modules an adapter targets."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Any

import jsonschema

from node_agent.engine.adapters.errors import CONFIG_FILE, AdapterLoadError, shorten
from node_agent.engine.adapters.json_depth import MAX_JSON_DEPTH, nesting_depth
from node_agent.engine.adapters.patterns import ModulePattern, Regex, compile_pattern, layer_index, pattern_value, selects

MAX_CONFIG_BYTES = 1 << 20  # the agent's sources apply the same cap (node_agent.engine.MAX_CONFIG_BYTES)
MAX_PATTERNS = 1024  # keys per rank_pattern / alpha_pattern: each is matched against every module name
MAX_PATTERN_CHARS = 1024

_PATTERN_KEYS = {"type": "string", "maxLength": MAX_PATTERN_CHARS}
_FLAG = {"type": ["boolean", "null"]}
_NAMES = {"type": ["array", "null"], "items": {"type": "string"}}
_NAMES_OR_PATTERN = {"type": ["string", "array", "null"], "maxLength": MAX_PATTERN_CHARS, "items": {"type": "string"}}

# The fields the engine reads (and those it refuses), declared; other PEFT fields are free.
ADAPTER_CONFIG_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "PEFT LoRA adapter_config.json, as the lorafleet engine serves it",
    "type": "object",
    "required": ["r", "lora_alpha"],
    "properties": {
        "peft_type": {"type": ["string", "null"]},
        "r": {"type": "integer", "minimum": 1},
        "lora_alpha": {"type": "number", "exclusiveMinimum": 0},
        "use_rslora": _FLAG,
        "use_dora": _FLAG,
        "fan_in_fan_out": _FLAG,
        "lora_bias": _FLAG,
        "bias": {"type": ["string", "null"]},
        "modules_to_save": _NAMES,
        "target_modules": _NAMES_OR_PATTERN,
        "target_parameters": _NAMES,
        "exclude_modules": _NAMES_OR_PATTERN,
        "layers_to_transform": {"type": ["integer", "array", "null"], "minimum": 0, "items": {"type": "integer", "minimum": 0}},
        "layers_pattern": {"type": ["string", "array", "null"], "maxLength": MAX_PATTERN_CHARS, "items": _PATTERN_KEYS},
        "rank_pattern": {
            "type": ["object", "null"],
            "maxProperties": MAX_PATTERNS,
            "propertyNames": _PATTERN_KEYS,
            "additionalProperties": {"type": "integer", "minimum": 1},
        },
        "alpha_pattern": {
            "type": ["object", "null"],
            "maxProperties": MAX_PATTERNS,
            "propertyNames": _PATTERN_KEYS,
            "additionalProperties": {"type": "number", "exclusiveMinimum": 0},
        },
    },
}
_CONFIG_VALIDATOR = jsonschema.Draft202012Validator(ADAPTER_CONFIG_SCHEMA)
ADAPTER_CONFIG_FIELDS = tuple(ADAPTER_CONFIG_SCHEMA["properties"])  # the top-level fields the engine reads or refuses
# "all-linear" is PEFT's shorthand, expanded against the model (saved adapters list the names).
_ALL_LINEAR = "all-linear"
# The fused 3-D expert weights PEFT's `target_parameters` may put LoRA on.
FUSED_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass(frozen=True)
class AdapterConfig:
    """A validated `adapter_config.json`: the fields the engine uses, patterns compiled for RE2."""

    path: Path
    raw: Mapping[str, Any]
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | None  # list form (PEFT: exact name or dotted suffix)
    target_regex: Regex | None  # string form (PEFT: re.fullmatch against the module name)
    target_parameters: tuple[str, ...]
    parameters_only: bool  # no target_modules, only target_parameters: PEFT targets no module
    exclude_modules: tuple[str, ...] | None  # list form, as target_modules
    exclude_regex: Regex | None  # string form
    layers_to_transform: tuple[int, ...]  # empty: every layer
    layer_patterns: tuple[Regex, ...]  # layers_pattern, each in PEFT's form; empty: the first index
    rank_pattern: tuple[ModulePattern, ...]
    alpha_pattern: tuple[ModulePattern, ...]

    @cached_property
    def matching_key(self) -> tuple[object, ...]:
        """Every field matching reads (all but `path` and `raw`, which only name things in
        messages), patterns as their text: configs with equal keys match one header to equal
        modules (`AdapterBytes.structure`)."""
        return tuple(_key_part(getattr(self, field.name)) for field in fields(self) if field.name not in ("path", "raw"))

    def rank_and_alpha(self, module_name: str) -> tuple[int, float]:
        """r and alpha of one module, with rank_pattern / alpha_pattern applied as PEFT does."""
        rank = pattern_value(self.rank_pattern, module_name)
        alpha = pattern_value(self.alpha_pattern, module_name)
        return int(rank) if rank is not None else self.r, alpha if alpha is not None else self.lora_alpha

    def targets(self, module_name: str) -> bool:
        """Whether PEFT puts LoRA on the module (its `check_target_module_exists`): not excluded by
        `exclude_modules`; then a string `target_modules` fully matches the name, or a list names
        it exactly, or as a dotted suffix (then, when `layers_to_transform` is set, in one of its
        layers, found by `layers_pattern`); "all-linear" selects every module."""
        if selects(self.exclude_modules, self.exclude_regex, module_name):
            return False
        if self.target_modules is None:
            return self.target_regex.fullmatch(module_name) is not None if self.target_regex else not self.parameters_only
        if module_name in self.target_modules:
            return True  # named exactly: layers_to_transform does not apply
        return selects(self.target_modules, None, module_name) and (
            not self.layers_to_transform or layer_index(module_name, self.layer_patterns) in self.layers_to_transform
        )


def _key_part(value: object) -> object:
    """A config field as plain, comparable data: a pattern by its text and value."""
    if isinstance(value, ModulePattern):
        return value.key, value.value
    if isinstance(value, tuple):
        return tuple(_key_part(part) for part in value)
    return value.pattern if hasattr(value, "pattern") else value


def read_adapter_config(path: Path) -> AdapterConfig:
    """Read and validate `adapter_config.json` of an adapter directory; pure, no engine, no model.

    Refuses (AdapterLoadError, naming the field) a config over MAX_CONFIG_BYTES, nested deeper than
    MAX_JSON_DEPTH, not JSON, with NaN/Infinity, not matching ADAPTER_CONFIG_SCHEMA, asking for a
    feature the engine does not serve, or with a pattern RE2 cannot run. Every pattern is compiled
    here, for RE2 (linear-time matching); matching them costs linear time in the module names.
    """
    path = Path(path)
    return config_from_bytes(path, read_config_bytes(path))


def config_from_bytes(path: Path, data: bytes) -> AdapterConfig:
    """`read_adapter_config` on the config file's bytes (`data`, up to one byte over the cap)."""
    raw = _parse_config(path, data)
    _refuse_non_finite_numbers(raw, ())
    error = jsonschema.exceptions.best_match(_CONFIG_VALIDATOR.iter_errors(raw))
    if error is not None:
        message = (
            error.message
            if len(error.message) <= 200
            else (f"{shorten(repr(error.instance), 60)} fails {error.validator} {shorten(repr(error.validator_value), 60)}")
        )
        raise AdapterLoadError(f"{CONFIG_FILE}: {_field(error.absolute_path)}: {shorten(message)}")
    _refuse_unsupported_features(raw)
    targets, excluded, layers = raw.get("target_modules"), raw.get("exclude_modules"), raw.get("layers_to_transform")
    patterns = raw.get("layers_pattern") or ()
    return AdapterConfig(
        path=path,
        raw=raw,
        r=int(raw["r"]),
        lora_alpha=float(raw["lora_alpha"]),
        use_rslora=bool(raw.get("use_rslora")),
        target_modules=tuple(targets) if isinstance(targets, list) else None,
        target_regex=compile_pattern("target_modules", targets, targets) if isinstance(targets, str) and targets != _ALL_LINEAR else None,
        target_parameters=tuple(raw.get("target_parameters") or ()),
        parameters_only=targets is None and bool(raw.get("target_parameters")),
        exclude_modules=tuple(excluded) if isinstance(excluded, list) else None,
        exclude_regex=compile_pattern("exclude_modules", excluded, excluded) if isinstance(excluded, str) else None,
        layers_to_transform=(layers,) if isinstance(layers, int) else tuple(layers or ()),
        layer_patterns=tuple(
            compile_pattern("layers_pattern", pattern, rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.")
            for pattern in ((patterns,) if isinstance(patterns, str) else patterns)
        ),
        rank_pattern=_patterns(raw, "rank_pattern"),
        alpha_pattern=_patterns(raw, "alpha_pattern"),
    )


def read_config_bytes(path: Path) -> bytes:
    """The config file's bytes, up to one over the cap; refuses a missing or unreadable one."""
    if not path.is_dir():
        raise AdapterLoadError(f"adapter directory {path} does not exist")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterLoadError(f"{CONFIG_FILE} not found in {path}")
    try:
        with config_path.open("rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise AdapterLoadError(f"{CONFIG_FILE} in {path} cannot be read: {error}") from error
    return data


def _parse_config(path: Path, data: bytes) -> dict[str, Any]:
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterLoadError(f"{CONFIG_FILE} in {path} is over the {MAX_CONFIG_BYTES}-byte cap")
    try:
        text = data.decode(json.detect_encoding(data), "surrogatepass")  # as json.loads decodes bytes
        if nesting_depth(text) > MAX_JSON_DEPTH:
            raise AdapterLoadError(f"{CONFIG_FILE} in {path} nests more than {MAX_JSON_DEPTH} levels deep (refused before parsing)")
        config = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError, or an integer of over 4300 digits
        if isinstance(error, AdapterLoadError):
            raise
        raise AdapterLoadError(f"{CONFIG_FILE} in {path} is not valid JSON: {shorten(str(error))}") from error
    if not isinstance(config, dict):
        raise AdapterLoadError(f"{CONFIG_FILE} in {path} is not a JSON object")
    return config


def _refuse_non_finite_numbers(value: object, where: tuple[str | int, ...]) -> None:
    """Python's json reads NaN, Infinity and 1e999 as floats: refuse them anywhere, naming the field."""
    if isinstance(value, float) and not math.isfinite(value):
        raise AdapterLoadError(f"{CONFIG_FILE}: {_field(where)} is {value}; numbers must be finite")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**1000:
        raise AdapterLoadError(f"{CONFIG_FILE}: {_field(where)} is too large a number")
    if isinstance(value, dict):
        for key, item in value.items():
            _refuse_non_finite_numbers(item, (*where, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _refuse_non_finite_numbers(item, (*where, index))


def _field(where: Any) -> str:
    """A JSON path as `name['key'][0]`; the document itself is `(top level)`."""
    parts = list(where)
    if not parts:
        return "(top level)"
    head, rest = parts[0], parts[1:]
    return shorten(str(head) + "".join(f"[{part!r}]" for part in rest))


def _refuse_unsupported_features(config: dict[str, Any]) -> None:
    peft_type = str(config.get("peft_type") or "LORA").upper()
    if peft_type != "LORA":
        raise AdapterLoadError(f"peft_type {peft_type} is not supported (LORA only)")
    if config.get("use_dora"):
        raise AdapterLoadError("DoRA adapters (use_dora: true) are not supported")
    if config.get("modules_to_save"):
        raise AdapterLoadError(f"modules_to_save is not supported (adapter sets {shorten(str(config['modules_to_save']))})")
    if (config.get("bias") or "none") != "none" or config.get("lora_bias"):
        raise AdapterLoadError("LoRA bias is not supported (adapter config sets bias/lora_bias)")
    if config.get("fan_in_fan_out"):
        raise AdapterLoadError("fan_in_fan_out adapters (Conv1D models) are not supported")
    # What PEFT's LoraConfig refuses to load.
    for field in ("layers_to_transform", "layers_pattern"):
        if isinstance(config.get("target_modules"), str) and config.get(field) is not None:
            raise AdapterLoadError(f"{CONFIG_FILE}: {field} cannot be used with a string target_modules (PEFT refuses it)")
    if config.get("layers_pattern") and config.get("layers_to_transform") is None:
        raise AdapterLoadError(f"{CONFIG_FILE}: layers_pattern needs layers_to_transform (PEFT refuses it without)")
    # Entries match parameter names by suffix (PEFT may also move a target_modules name here).
    fused_names = {name.rsplit(".", 1)[-1] for name in FUSED_PARAMETERS}
    unknown = sorted(t for t in config.get("target_parameters") or [] if t.rsplit(".", 1)[-1] not in fused_names)
    if unknown:
        raise AdapterLoadError(
            shorten(f"target_parameters {', '.join(unknown)} are not supported (supported: {', '.join(FUSED_PARAMETERS)})")
        )


def _patterns(config: Mapping[str, Any], field: str) -> tuple[ModulePattern, ...]:
    """A rank_pattern / alpha_pattern, in the config's order, each key compiled as PEFT wraps it."""
    return tuple(
        ModulePattern(key, compile_pattern(field, key, rf"(.*\.)?({key})$"), float(value))
        for key, value in (config.get(field) or {}).items()
    )
