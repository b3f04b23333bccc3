"""Read a PEFT LoRA adapter directory: validate it whole, then read only this rank's slices.

Only `adapter_config.json` and `adapter_model.safetensors` are ever opened; pickle formats
(`.bin`, `.pt`) are refused without being read. Every refusal is an `AdapterLoadError` with one
message naming the problem; nothing is written to the engine until the whole adapter is read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import tempfile
import threading
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jsonschema
import numpy as np
import numpy.typing as npt
import re2
import torch

from node_agent.engine.model.lora_layers import SliceWeights
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.sharding import (
    EXPERT_KINDS,
    MODULE_KINDS,
    SPARSE_ONLY_KINDS,
    LoraSliceLayout,
    ModuleKey,
    ModuleLayout,
    Span,
    model_kinds,
    peft_to_kind,
    unsharded_layout,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# Matched with fullmatch, ASCII only: a key with a newline or a non-ASCII digit names no module.
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight", re.ASCII)
_MODULE = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp|mlp\.shared_experts?|mlp\.experts\.(?P<expert>\d+))\.(?P<name>\w+)",
    re.ASCII,
)
# PEFT `target_parameters` LoRA on the fused 3-D expert weights: nested wrappers add `.base_layer`.
_FUSED_EXPERTS = re.compile(r"model\.layers\.(?P<layer>\d+)\.mlp\.experts(?:\.base_layer)*", re.ASCII)
FUSED_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# safetensors element types a LoRA weight may have; the header's limit is safetensors' own.
_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_MAX_HEADER_BYTES = 100_000_000
_SERIAL_ELEMENTS = 16384  # under torch's intra-op grain size (32768): a reduction this size runs on one thread
# Unsigned integers of each float element size: what same-dtype elements are moved as.
_SAME_SIZE_INTS: dict[int, type[np.unsignedinteger[Any]]] = {2: np.uint16, 4: np.uint32, 8: np.uint64}


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
    def key(self) -> ModuleKey:
        """The engine's key of the module this slice fills (see CausalLM.lora_modules)."""
        return (self.layer, self.kind) if self.expert is None else (self.layer, self.kind, self.expert)


class TensorEntry(NamedTuple):
    """Where one tensor's data lies in the safetensors file, from its header (a tuple: cheap to build)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file


@dataclass(frozen=True)
class AdapterSpec:
    """A validated adapter: its modules and where to read them. No tensor data yet."""

    path: Path
    modules: tuple[ModuleAdapter, ...]
    max_module_rank: int
    tensors: Mapping[str, TensorEntry]  # the parsed safetensors header, read once
    file_size: int  # of the weights file when its header was read
    # AdapterBytes.structure of what it was parsed from: equal for every adapter whose spec is
    # equal ("": made by hand, never memoized)
    content: str = ""


@dataclass(frozen=True)
class AdapterBytes:
    """All that validating an adapter reads of it: the config file (up to one byte over its cap),
    the weights file's header (its 8-byte length, then the JSON when that length fits the file)
    and the weights file's size. The spec is a function of these bytes, the base model and the
    max rank alone, and of the config only through what matching reads of it: equal bytes, or
    an equal `structure`, give an equal spec (`SpecMemo`)."""

    config: bytes
    header: bytes
    file_size: int

    @cached_property
    def digest(self) -> str:
        """sha256 over the three, each delimited (the header by its own length prefix)."""
        digest = hashlib.sha256(len(self.config).to_bytes(8, "little"))
        for part in (self.config, self.header, self.file_size.to_bytes(8, "little")):
            digest.update(part)
        return digest.hexdigest()

    def structure(self, config: AdapterConfig) -> str:
        """sha256 over what the spec is a function of besides the model: the header, the file size
        and the config's `matching_key` (the config parsed from these bytes). Configs that differ
        in fields the engine does not read (`revision`, `base_model_name_or_path`, `peft_version`
        ...) give one structure for one header."""
        key = repr(config.matching_key).encode()
        digest = hashlib.sha256(len(key).to_bytes(8, "little"))
        for part in (key, self.header, self.file_size.to_bytes(8, "little")):
            digest.update(part)
        return digest.hexdigest()


def read_adapter_spec(path: Path, cfg: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """Validate config and tensor headers against the base model; read no tensor data."""
    path = Path(path)
    config_bytes = _config_bytes(path)
    config = _config_from_bytes(path, config_bytes)
    weights = _weights_file(path)
    try:
        with weights.open("rb") as handle:
            header, file_size = _header_bytes(handle.fileno())
    except OSError as error:
        raise AdapterLoadError(f"{WEIGHTS_FILE} cannot be read: {error}") from error
    return _spec(path, AdapterBytes(config_bytes, header, file_size), config, cfg, max_lora_rank)


def read_adapter_bytes(config_fd: int, weights_fd: int) -> AdapterBytes:
    """What validation reads, through the adapter's open files (the driver's held descriptors,
    so the bytes are those of the files it verifies). OSError where a descriptor cannot be read."""
    header, file_size = _header_bytes(weights_fd)
    return AdapterBytes(os.pread(config_fd, MAX_CONFIG_BYTES + 1, 0), header, file_size)


def _spec(path: Path, data: AdapterBytes, config: AdapterConfig, cfg: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    tensors = _parse_header(data.header, data.file_size)
    modules = _Matcher(config, tensors, cfg, max_lora_rank).modules()
    return AdapterSpec(path, tuple(modules), max(m.rank for m in modules), tensors, data.file_size, data.structure(config))


class SpecMemo:
    """The specs validated so far for one base model and max rank, on two levels (least recently
    used dropped beyond `limit` on each): by the bytes they were parsed from
    (`AdapterBytes.digest`), which skips every check, and by their structure
    (`AdapterBytes.structure`), which skips the header parse and the matching once the config
    itself is validated. Adapters trained by one recipe have byte-equal headers (the same
    tensors, shapes and offsets) and configs that are byte-equal or differ only in fields the
    engine does not read, so a load of any of them after the first reuses the first one's spec
    (docs/engine.md "Measured"). A refusal is never stored, so it is made again, with its
    message, every time."""

    def __init__(self, cfg: ModelConfig, max_lora_rank: int, limit: int = 64) -> None:
        self.cfg, self.max_lora_rank, self.limit = cfg, max_lora_rank, limit
        self._specs: OrderedDict[str, AdapterSpec] = OrderedDict()  # by structure
        self._structures: OrderedDict[str, str] = OrderedDict()  # bytes digest -> structure
        self._lock = threading.Lock()  # loads are validated before the engine's command lock

    def spec(self, path: Path, data: AdapterBytes) -> AdapterSpec:
        """The spec of the adapter in `path` whose bytes are `data` (AdapterLoadError if refused)."""
        with self._lock:
            known = self._recall(self._structures.get(data.digest))
            if known is not None:
                self._structures.move_to_end(data.digest)
        if known is None:
            config = _config_from_bytes(path, data.config)  # config bytes not seen before are always validated
            structure = data.structure(config)
            with self._lock:
                known = self._recall(structure)
            if known is None:
                known = _spec(path, data, config, self.cfg, self.max_lora_rank)
            with self._lock:
                self._remember(self._specs, structure, known)
                self._remember(self._structures, data.digest, structure)
        return known if known.path == path else replace(known, path=Path(path))

    def _recall(self, structure: str | None) -> AdapterSpec | None:
        known = self._specs.get(structure) if structure is not None else None
        if known is not None:
            self._specs.move_to_end(known.content)
        return known

    def _remember(self, memo: OrderedDict[str, Any], key: str, value: Any) -> None:
        memo[key] = value
        memo.move_to_end(key)
        while len(memo) > self.limit:
            memo.popitem(last=False)


def validate_adapter(path: Path, model_dir: Path, max_lora_rank: int) -> AdapterSpec:
    """Everything `read_adapter_spec` checks (config, header, every module and its patterns),
    for the base model in `model_dir`, in the caller's process: what the agent can run on its
    snapshot before the engine's command lock. Reads no tensor data."""
    return read_adapter_spec(path, ModelConfig.from_dir(model_dir), max_lora_rank)


# --- adapter_config.json -------------------------------------------------------------------------

MAX_CONFIG_BYTES = 1 << 20  # the agent's sources apply the same cap (node_agent.engine.MAX_CONFIG_BYTES)
MAX_JSON_DEPTH = 64  # PEFT's configs nest 3 deep; json.loads recurses, so deeper is refused before parsing
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
# The config fields that choose which modules get LoRA (PEFT's `check_target_module_exists`).
_SELECTING_FIELDS = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern", "target_parameters")
# Where PEFT reads a module's layer index without `layers_pattern`: the first numbered segment.
_FIRST_INDEX = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.", re.ASCII)


class _Match(Protocol):
    """A match of a `_Regex`."""

    def group(self, name: str, /) -> str | Any: ...


class _Regex(Protocol):
    """A compiled RE2 pattern (google-re2 ships no type information)."""

    pattern: str

    def match(self, text: str) -> _Match | None: ...

    def fullmatch(self, text: str) -> object | None: ...


@dataclass(frozen=True)
class ModulePattern:
    """One `rank_pattern` / `alpha_pattern` entry: PEFT's key, compiled for RE2, and its value."""

    key: str
    regex: _Regex
    value: float


@dataclass(frozen=True)
class AdapterConfig:
    """A validated `adapter_config.json`: the fields the engine uses, patterns compiled for RE2."""

    path: Path
    raw: Mapping[str, Any]
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | None  # list form (PEFT: exact name or dotted suffix)
    target_regex: _Regex | None  # string form (PEFT: re.fullmatch against the module name)
    target_parameters: tuple[str, ...]
    parameters_only: bool  # no target_modules, only target_parameters: PEFT targets no module
    exclude_modules: tuple[str, ...] | None  # list form, as target_modules
    exclude_regex: _Regex | None  # string form
    layers_to_transform: tuple[int, ...]  # empty: every layer
    layer_patterns: tuple[_Regex, ...]  # layers_pattern, each in PEFT's form; empty: the first index
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
        rank = _pattern_value(self.rank_pattern, module_name)
        alpha = _pattern_value(self.alpha_pattern, module_name)
        return int(rank) if rank is not None else self.r, alpha if alpha is not None else self.lora_alpha

    def targets(self, module_name: str) -> bool:
        """Whether PEFT puts LoRA on the module (its `check_target_module_exists`): not excluded by
        `exclude_modules`; then a string `target_modules` fully matches the name, or a list names
        it exactly, or as a dotted suffix (then, when `layers_to_transform` is set, in one of its
        layers, found by `layers_pattern`); "all-linear" selects every module."""
        if _selects(self.exclude_modules, self.exclude_regex, module_name):
            return False
        if self.target_modules is None:
            return self.target_regex.fullmatch(module_name) is not None if self.target_regex else not self.parameters_only
        if module_name in self.target_modules:
            return True  # named exactly: layers_to_transform does not apply
        return _selects(self.target_modules, None, module_name) and (
            not self.layers_to_transform or _layer_index(module_name, self.layer_patterns) in self.layers_to_transform
        )


def _selects(names: tuple[str, ...] | None, regex: _Regex | None, module_name: str) -> bool:
    """PEFT's rule for a list of names (exact, or a dotted suffix) or a pattern (full match)."""
    if regex is not None:
        return regex.fullmatch(module_name) is not None
    return names is not None and (module_name in names or any(module_name.endswith(f".{n}") for n in names))


def _layer_index(module_name: str, patterns: tuple[_Regex, ...]) -> int | None:
    """The layer index PEFT reads from a module name: after the first pattern that matches, or
    the first numbered segment without patterns."""
    for pattern in patterns or (_FIRST_INDEX,):
        match = pattern.match(module_name)
        if match is not None:
            return int(match.group("idx"))
    return None


def _key_part(value: object) -> object:
    """A config field as plain, comparable data: a pattern by its text and value."""
    if isinstance(value, ModulePattern):
        return value.key, value.value
    if isinstance(value, tuple):
        return tuple(_key_part(part) for part in value)
    return value.pattern if hasattr(value, "pattern") else value


def _pattern_value(patterns: tuple[ModulePattern, ...], module_name: str) -> float | None:
    # PEFT's rule (get_pattern_key): the first key, in the config's order, whose
    # `(.*\.)?(key)$` matches the module name from its start wins.
    for pattern in patterns:
        if pattern.regex.match(module_name) is not None:
            return pattern.value
    return None


def read_adapter_config(path: Path) -> AdapterConfig:
    """Read and validate `adapter_config.json` of an adapter directory; pure, no engine, no model.

    Refuses (AdapterLoadError, naming the field) a config over MAX_CONFIG_BYTES, nested deeper than
    MAX_JSON_DEPTH, not JSON, with NaN/Infinity, not matching ADAPTER_CONFIG_SCHEMA, asking for a
    feature the engine does not serve, or with a pattern RE2 cannot run. Every pattern is compiled
    here, for RE2 (linear-time matching); matching them costs linear time in the module names.
    """
    path = Path(path)
    return _config_from_bytes(path, _config_bytes(path))


def _config_from_bytes(path: Path, data: bytes) -> AdapterConfig:
    """`read_adapter_config` on the config file's bytes (`data`, up to one byte over the cap)."""
    raw = _parse_config(path, data)
    _refuse_non_finite_numbers(raw, ())
    error = jsonschema.exceptions.best_match(_CONFIG_VALIDATOR.iter_errors(raw))
    if error is not None:
        message = (
            error.message
            if len(error.message) <= 200
            else (f"{_shorten(repr(error.instance), 60)} fails {error.validator} {_shorten(repr(error.validator_value), 60)}")
        )
        raise AdapterLoadError(f"{CONFIG_FILE}: {_field(error.absolute_path)}: {_shorten(message)}")
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
        target_regex=_compile("target_modules", targets, targets) if isinstance(targets, str) and targets != _ALL_LINEAR else None,
        target_parameters=tuple(raw.get("target_parameters") or ()),
        parameters_only=targets is None and bool(raw.get("target_parameters")),
        exclude_modules=tuple(excluded) if isinstance(excluded, list) else None,
        exclude_regex=_compile("exclude_modules", excluded, excluded) if isinstance(excluded, str) else None,
        layers_to_transform=(layers,) if isinstance(layers, int) else tuple(layers or ()),
        layer_patterns=tuple(
            _compile("layers_pattern", pattern, rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.")
            for pattern in ((patterns,) if isinstance(patterns, str) else patterns)
        ),
        rank_pattern=_patterns(raw, "rank_pattern"),
        alpha_pattern=_patterns(raw, "alpha_pattern"),
    )


def _config_bytes(path: Path) -> bytes:
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
        if _nesting_depth(text) > MAX_JSON_DEPTH:
            raise AdapterLoadError(f"{CONFIG_FILE} in {path} nests more than {MAX_JSON_DEPTH} levels deep (refused before parsing)")
        config = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError, or an integer of over 4300 digits
        if isinstance(error, AdapterLoadError):
            raise
        raise AdapterLoadError(f"{CONFIG_FILE} in {path} is not valid JSON: {_shorten(str(error))}") from error
    if not isinstance(config, dict):
        raise AdapterLoadError(f"{CONFIG_FILE} in {path} is not a JSON object")
    return config


# Every byte but the four brackets (UTF-8 never puts a bracket byte inside another character).
_NOT_BRACKET_BYTES = bytes(b for b in range(256) if b not in b"[]{}")


def _nesting_depth(text: str) -> int:
    """How deep arrays and objects nest in a JSON text, by linear scans (strings skipped); the
    count stops, returning MAX_JSON_DEPTH + 1, once that depth is reached.

    Escaped backslashes, then escaped quotes, are dropped (escapes pair from the left, as JSON
    reads them), so every quote left delimits a string and the text outside strings is every
    other piece between quotes. Only C-level string operations touch the whole text (a regex
    substitution per string cost most of a load's validation on a safetensors header).
    """
    unescaped = text.replace("\\\\", "").replace('\\"', "")
    outside = "".join(unescaped.split('"')[::2])
    brackets = outside.encode("utf-8", "surrogatepass").translate(None, _NOT_BRACKET_BYTES)
    depth = deepest = 0
    for byte in brackets:
        depth += 1 if byte in b"[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > MAX_JSON_DEPTH:
                return deepest  # enough to refuse: the rest is not scanned
    return deepest


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
    return _shorten(str(head) + "".join(f"[{part!r}]" for part in rest))


def _shorten(text: str, limit: int = 300) -> str:
    """One line, at most `limit` characters (a message quotes the offending value)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _refuse_unsupported_features(config: dict[str, Any]) -> None:
    peft_type = str(config.get("peft_type") or "LORA").upper()
    if peft_type != "LORA":
        raise AdapterLoadError(f"peft_type {peft_type} is not supported (LORA only)")
    if config.get("use_dora"):
        raise AdapterLoadError("DoRA adapters (use_dora: true) are not supported")
    if config.get("modules_to_save"):
        raise AdapterLoadError(f"modules_to_save is not supported (adapter sets {_shorten(str(config['modules_to_save']))})")
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
            _shorten(f"target_parameters {', '.join(unknown)} are not supported (supported: {', '.join(FUSED_PARAMETERS)})")
        )


def _patterns(config: Mapping[str, Any], field: str) -> tuple[ModulePattern, ...]:
    """A rank_pattern / alpha_pattern, in the config's order, each key compiled as PEFT wraps it."""
    return tuple(
        ModulePattern(key, _compile(field, key, rf"(.*\.)?({key})$"), float(value)) for key, value in (config.get(field) or {}).items()
    )


_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is reported in the AdapterLoadError, not on stderr
# Both engines accept these, with different meanings: Python reads `{,n}` as a repetition and
# `[[:digit:]]` as a set of characters, RE2 as a literal and as a POSIX class.
_AMBIGUOUS = re.compile(r"\{,\d*\}|\[:")


def _compile(field: str, key: str, pattern: str) -> _Regex:
    """`pattern` (PEFT's form of `key`) for RE2, refused unless Python's re, PEFT's engine, reads it alike."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Possible nested set": `[:` is refused below anyway
            re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as error:
        raise AdapterLoadError(
            f"{CONFIG_FILE}: {field} {_shorten(repr(key), 120)} is not a valid regular expression ({_shorten(str(error), 120)})"
        ) from None
    if _AMBIGUOUS.search(key):
        raise AdapterLoadError(
            f"{CONFIG_FILE}: {field} {_shorten(repr(key), 120)} is refused: `{{,n}}` and `[:` mean different things "
            "in Python's re and in RE2, the engine's linear-time matcher"
        )
    try:
        regex: _Regex = re2.compile(pattern, options=_RE2_OPTIONS)
    except re2.error as error:
        reason = error.args[0].decode(errors="replace") if error.args and isinstance(error.args[0], bytes) else str(error)
        raise AdapterLoadError(
            f"{CONFIG_FILE}: {field} {_shorten(repr(key), 120)} is not supported by RE2, the engine's linear-time "
            f"matcher (no backreferences, lookaround, possessive or atomic groups): {_shorten(reason, 120)}"
        ) from None
    return regex


def _weights_file(path: Path) -> Path:
    weights = path / WEIGHTS_FILE
    if weights.is_file():
        return weights
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise AdapterLoadError(
            f"{WEIGHTS_FILE} not found in {path}; pickle formats ({', '.join(pickled)}) are refused, convert the adapter to safetensors"
        )
    raise AdapterLoadError(f"{WEIGHTS_FILE} not found in {path}")


def _corrupt(reason: str) -> AdapterLoadError:
    return AdapterLoadError(f"{WEIGHTS_FILE} is corrupt or truncated: {reason}")


def _header_bytes(fd: int) -> tuple[bytes, int]:
    """The weights file's 8-byte header length, then (when that length fits the file) the JSON
    header, read through `fd`; with the file's size. `_parse_header` refuses what does not fit."""
    size = os.fstat(fd).st_size
    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8 or _header_length(prefix) > min(_MAX_HEADER_BYTES, size - 8):
        return prefix, size
    return prefix + os.pread(fd, _header_length(prefix), 8), size


def _header_length(prefix: bytes) -> int:
    (length,) = struct.unpack("<Q", prefix[:8])
    return int(length)


def _parse_header(header: bytes, size: int) -> dict[str, TensorEntry]:
    """The safetensors header (8-byte little-endian length, then JSON; `_header_bytes`), checked
    as safetensors does, for a weights file of `size` bytes.

    Returns every tensor's entry. A bad or short file is refused here.
    """
    if len(header) < 8:
        raise _corrupt(f"the file has {len(header)} bytes, fewer than the 8-byte header length")
    length = _header_length(header)
    if length > min(_MAX_HEADER_BYTES, size - 8):
        raise _corrupt(f"header length {length} does not fit the {size}-byte file")
    try:
        text = header[8:].decode()
        if _nesting_depth(text) > MAX_JSON_DEPTH:
            raise _corrupt(f"the header nests more than {MAX_JSON_DEPTH} levels deep (refused before parsing)")
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError, or an integer of over 4300 digits
        if isinstance(error, AdapterLoadError):
            raise
        raise _corrupt(f"the header is not valid JSON ({_shorten(str(error))})") from error
    if not isinstance(raw, dict):
        raise _corrupt("the header is not a JSON object")
    data_start = 8 + length
    tensors = {key: _tensor_entry(key, value, data_start) for key, value in raw.items() if key != "__metadata__"}
    # The tensors must tile the data section exactly, in offset order, as safetensors requires.
    end = data_start
    for entry in sorted(tensors.values(), key=lambda e: e.start):
        if entry.start != end:
            raise _corrupt("tensor data offsets leave gaps or overlap")
        end += math.prod(entry.shape) * entry.dtype.itemsize
    if end != size:
        raise _corrupt(f"the header describes {end} bytes, the file has {size}")
    return tensors


def _tensor_entry(key: str, value: object, data_start: int) -> TensorEntry:
    """One header entry, validated: a float dtype, a shape, offsets that match the shape."""
    if not isinstance(value, dict):
        raise _corrupt(f"header entry {key!r} is not an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
        raise _corrupt(f"tensor {key!r} has no valid shape")
    if not isinstance(offsets, list) or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int:
        raise _corrupt(f"tensor {key!r} has no valid data_offsets")
    torch_dtype = _FLOAT_DTYPES.get(dtype) if isinstance(dtype, str) else None
    if torch_dtype is None:
        raise AdapterLoadError(
            f"{WEIGHTS_FILE}: tensor {key!r} has dtype {dtype!r}; LoRA weights must be one of {', '.join(_FLOAT_DTYPES)}"
        )
    if offsets[0] < 0 or offsets[1] - offsets[0] != math.prod(shape) * torch_dtype.itemsize:
        raise _corrupt(f"tensor {key!r}: data_offsets {offsets} do not match shape {shape} of {dtype}")
    return TensorEntry(torch_dtype, tuple(shape), data_start + offsets[0])


@dataclass(frozen=True)
class _Matcher:
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
                    _shorten(
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
                f"{field} {_shorten(repr(self.config.raw[field]), 120)}"
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


@dataclass
class AdapterShard:
    """This rank's part of one adapter, ready to be copied into LoRA slots: one buffer (`flat`)
    and, per slice, where its A and B lie in it (`slices`, in buffer order: the plan's table).

    `weights` makes every slice's A and B as views of the buffer when first asked for, i.e. when
    the pool first copies the adapter into a slot: the 56 views of a tp=4 rank's shard cost about
    a seventh of its load's CPU, which a load that never takes a slot (or takes one later) does
    not wait for (docs/engine.md "Measured").
    """

    flat: torch.Tensor
    keys: Sequence[ModuleKey]  # the rank's module keys; `slices` names a module by its position here
    slices: _I64  # [n, 6]: module position, slice index, A rows, A columns, B rows, B columns
    scales: npt.NDArray[np.float64]
    nbytes: int

    @cached_property
    def weights(self) -> dict[ModuleKey, list[SliceWeights | None]]:
        """Every module's slices (keyed like CausalLM.lora_modules()), A and B views of `flat`."""
        slices = self.slices.tolist()
        pieces = _pieces(self.flat, slices)
        weights: dict[ModuleKey, list[SliceWeights | None]] = {}
        for index, ((position, slice_index, a_rows, a_cols, b_rows, b_cols), scale) in enumerate(
            zip(slices, self.scales.tolist(), strict=True)
        ):
            key = self.keys[position]
            parts = weights.get(key)
            if parts is None:
                parts = weights[key] = [None] * len(MODULE_KINDS[key[1]].peft_modules)
            parts[slice_index] = SliceWeights(pieces[2 * index].view(a_rows, a_cols), pieces[2 * index + 1].view(b_rows, b_cols), scale)
        return weights


def _pieces(flat: torch.Tensor, slices: Sequence[Sequence[int]]) -> tuple[torch.Tensor, ...]:
    """Every slice's A and B as flat views of the buffer, in buffer order: one split makes them
    all (far cheaper than slicing per slice)."""
    sizes = [size for _, _, a_rows, a_cols, b_rows, b_cols in slices for size in (a_rows * a_cols, b_rows * b_cols)]
    return torch.split(flat, sizes) if sizes else ()


# A row's run of columns shorter than this is not read on its own (one iovec per tiny run costs
# more than the copy): the block's whole rows are staged and numpy moves the columns.
_DIRECT_RUN_BYTES = 512
# Runs this close in the file share one preadv, the bytes between them read into a scratch
# buffer: copying 32 KiB from the page cache costs about what one more system call does.
_MAX_GAP_BYTES = 32 << 10
_RUNS_PER_CALL = 500  # with a gap segment before each run, under IOV_MAX (1024) iovecs per preadv
_FILE_DTYPES = tuple(_FLOAT_DTYPES.values())  # a staged block names its file dtype by position here
_I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class ShardPlan:
    """How one rank reads its shard of one adapter into one buffer: computed by the driver from
    the verified spec and that rank's layouts (`plan_shard`), carried out by the rank
    (`read_planned_shard`). Flat integer arrays: a rank unpickles nothing per module.

    `calls` [c, 3]: one preadv each (file offset, segments, bytes), over the next `segments`
    [s, 2] (byte offset in the buffer, or -1 for a gap read into scratch; bytes). `staged` [m, 9]:
    the blocks read through a staging buffer (another file dtype, strided or short column runs):
    file offset of the first row, rows, row width, file dtype (index in `_FILE_DTYPES`), first
    column, columns, column stride, element offset in the buffer, destination columns.
    `slices` [n, 6], in buffer order (each slice's A then its B): the module's position in the
    rank's layouts, the slice index, A rows and columns, B rows and columns; `scales` [n];
    `tensors`: each slice's A and B keys (to name a non-finite one).
    """

    numel: int  # elements of the engine's dtype in the buffer
    zeroed: bool  # the reads leave part of the buffer unwritten (rank padding): it starts zeroed
    file_size: int  # of the weights file the spec describes
    max_gap: int  # bytes of the scratch buffer
    calls: _I64
    segments: _I64
    staged: _I64
    slices: _I64
    scales: npt.NDArray[np.float64]
    tensors: tuple[str, ...]

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        # One bytes object (made once per plan; the engine remembers plans): pickling a Load
        # copies it, unpickling makes views into it, instead of six arrays and a string each.
        blob = self.__dict__.get("_blob")
        if blob is None:
            counts = np.array(
                [
                    self.numel,
                    self.zeroed,
                    self.file_size,
                    self.max_gap,
                    len(self.calls),
                    len(self.segments),
                    len(self.staged),
                    len(self.slices),
                ],
                dtype=np.int64,
            )
            arrays = (counts, self.calls, self.segments, self.staged, self.slices, self.scales)
            # Keys never hold a newline (`_KEY` refuses one), so they travel joined by one.
            blob = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays) + "\n".join(self.tensors).encode()
            object.__setattr__(self, "_blob", blob)
        return _plan_from_blob, (blob,)


def _plan_from_blob(blob: bytes) -> ShardPlan:
    """A `ShardPlan` from its pickled form (`ShardPlan.__reduce__`): read-only views into `blob`."""
    numel, zeroed, file_size, max_gap, calls, segments, staged, slices = np.frombuffer(blob, np.int64, 8).tolist()
    at = 64

    def table(rows: int, width: int) -> _I64:
        nonlocal at
        at += rows * width * 8
        return np.frombuffer(blob, np.int64, rows * width, at - rows * width * 8).reshape(rows, width)

    tables = table(calls, 3), table(segments, 2), table(staged, 9), table(slices, 6)
    scales = np.frombuffer(blob, np.float64, slices, at)
    names = blob[at + 8 * slices :].decode()
    return ShardPlan(numel, bool(zeroed), file_size, max_gap, *tables, scales, tuple(names.split("\n")) if names else ())


_LAYOUT_FIELDS = 8  # per slice: a_rank start, stop; a_in start, width; b_out start, width; b_rank start, stop
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_FILE_DTYPES)}


class ShardPlanner:
    """Plans every rank's read of an adapter at once, from the layouts each rank's model has
    (`lora_slices()`, as `sharding.lora_layout` gives them): numpy over ranks × modules, so the
    driver's cost barely grows with the ranks. One planner per engine; `plans(spec)` per load,
    remembered by the spec's content (the last `limit`; equal content, equal spec, equal plans).

    Per slice of a module a rank holds, A's real rank rows and B's real rank columns are read
    into the slice's place in one zeroed buffer of `dtype`, padded to max rank (padding stays
    zero): whole rows as one run, column slices as one run per row, and through a staging buffer
    what must be converted, gathered with a stride, or is too short a run to read by itself.
    """

    def __init__(
        self, rank_layouts: Sequence[Mapping[ModuleKey, tuple[LoraSliceLayout, ...]]], dtype: torch.dtype, limit: int = 64
    ) -> None:
        self.dtype, self.limit = dtype, limit
        self._planned: OrderedDict[str, tuple[ShardPlan, ...]] = OrderedDict()
        self._lock = threading.Lock()  # loads are planned before the engine's command lock
        self.positions = [{key: index for index, key in enumerate(layouts)} for layouts in rank_layouts]
        width = max((len(lays) for layouts in rank_layouts for lays in layouts.values()), default=1)
        rows = [
            [
                (s.a_rank.start, s.a_rank.stop, s.a_in.start, s.a_in.width, s.b_out.start, s.b_out.width, s.b_rank.start, s.b_rank.stop)
                for s in lays
            ]
            + [(0,) * _LAYOUT_FIELDS] * (width - len(lays))
            for layouts in rank_layouts
            for lays in layouts.values()
        ]
        self.table = np.array(rows, dtype=np.int64).reshape(-1, width, _LAYOUT_FIELDS)  # every rank's, one after another
        self.bases = np.cumsum([0] + [len(layouts) for layouts in rank_layouts[:-1]], dtype=np.int64)

    def plans(self, spec: AdapterSpec) -> tuple[ShardPlan, ...]:
        """Every rank's plan of `spec` (rank order). Refuses a module no rank layout has
        (experts are held by their expert-parallel group only)."""
        with self._lock:
            known = self._planned.get(spec.content) if spec.content else None
            if known is not None:
                self._planned.move_to_end(spec.content)
                return known
        plans = self._plan(spec)
        if spec.content:
            with self._lock:
                self._planned[spec.content] = plans
                while len(self._planned) > self.limit:
                    self._planned.popitem(last=False)
        return plans

    def _plan(self, spec: AdapterSpec) -> tuple[ShardPlan, ...]:
        modules, ranks, count = spec.modules, len(self.positions), len(spec.modules)
        if not ranks:
            return ()
        keys = [module.key for module in modules]
        pos = np.array([[positions.get(key, -1) for key in keys] for positions in self.positions], dtype=np.int64).reshape(ranks, count)
        held = pos >= 0
        for module, column in zip(modules, held.T, strict=True):
            if module.expert is None and not column.all():
                raise AdapterLoadError(f"engine has no module for {module.a_key}")
        columns = (
            np.array(
                [
                    (
                        m.slice_index,
                        m.rank,
                        m.a_row_offset,
                        m.b_row_offset,
                        m.b_col_start,
                        m.b_col_stride,
                        a.start,
                        a.shape[1],
                        a.dtype.itemsize,
                        _DTYPE_CODES[a.dtype],
                        b.start,
                        b.shape[1],
                        b.dtype.itemsize,
                        _DTYPE_CODES[b.dtype],
                    )
                    for m in modules
                    for a, b in ((spec.tensors[m.a_key], spec.tensors[m.b_key]),)
                ],
                dtype=np.int64,
            )
            .reshape(count, 14)
            .T
        )
        slice_index, rank, a_row_offset, b_row_offset, b_col_start, b_stride = columns[:6]
        layout = self.table[np.where(held, self.bases[:, None] + pos, 0), slice_index[None, :]]  # [ranks, modules, 8]
        a_rs, a_re, a_is, a_iw, b_os, b_ow, b_rs, b_re = np.moveaxis(layout, 2, 0)
        a_rows, b_cols = a_re - a_rs, b_re - b_rs
        # Every block as [ranks, modules, 2] (A, B), then flat: A's real rank rows, B's rows of
        # the rank's output and the real rank columns (with the fused experts' stride).
        blocks = _Blocks(
            first_row=np.stack((a_row_offset + a_rs, b_row_offset + b_os), axis=2),
            rows=np.stack((np.minimum(a_re, rank) - a_rs, b_ow), axis=2),
            first_col=np.stack((a_is, b_col_start + b_rs * b_stride), axis=2),
            cols=np.stack((a_iw, np.minimum(b_re, rank) - b_rs), axis=2),
            stride=np.stack((np.ones_like(a_is), np.broadcast_to(b_stride, a_is.shape)), axis=2),
            dest_cols=np.stack((a_iw, b_cols), axis=2),
            tensor=np.broadcast_to(np.stack((columns[6:10], columns[10:14]), axis=2)[:, None], (4, ranks, count, 2)),
        )
        sizes = np.where(held[:, :, None], np.stack((a_rows * a_iw, b_ow * b_cols), axis=2), 0).reshape(ranks, 2 * count)
        ends = np.cumsum(sizes, axis=1)
        runs, staged = blocks.runs((ends - sizes).reshape(-1), np.repeat(held.reshape(-1), 2), ranks, _DTYPE_CODES.get(self.dtype, -1))
        calls, segments, max_gaps, call_of_rank, segment_of_rank = runs.calls(ranks)
        staged_rows, staged_rank = staged
        slices = np.stack((pos, np.broadcast_to(slice_index, pos.shape), a_rows, a_iw, b_ow, b_cols), axis=2)
        scales = np.array([module.scale for module in modules], dtype=np.float64)
        every_name = tuple(key for module in modules for key in (module.a_key, module.b_key))
        # Bytes the reads write into each rank's buffer (direct segments, staged blocks' columns).
        direct = np.concatenate(([0], np.cumsum(np.where(segments[:, 0] >= 0, segments[:, 1], 0)))).astype(np.int64)
        written = direct[segment_of_rank[1:]] - direct[segment_of_rank[:-1]]
        np.add.at(written, staged_rank, staged_rows[:, 1] * staged_rows[:, 5] * self.dtype.itemsize)
        plans = []
        for r in range(ranks):
            mine = held[r]
            names = (
                every_name
                if mine.all()
                else tuple(key for module, kept in zip(modules, mine.tolist(), strict=True) if kept for key in (module.a_key, module.b_key))
            )
            numel = int(ends[r, -1]) if count else 0
            plans.append(
                ShardPlan(
                    numel,
                    bool(written[r] < numel * self.dtype.itemsize),
                    spec.file_size,
                    int(max_gaps[r]),
                    calls[call_of_rank[r] : call_of_rank[r + 1]],
                    segments[segment_of_rank[r] : segment_of_rank[r + 1]],
                    staged_rows[staged_rank == r],
                    slices[r][mine],
                    scales[mine],
                    names,
                )
            )
        return tuple(plans)


@dataclass(frozen=True)
class _Blocks:
    """Blocks of file tensors to read (flattened over ranks, modules, A/B): `rows` rows from
    `first_row`, `cols` columns `first_col, first_col + stride, ...`, into the top-left corner of
    a destination `dest_cols` wide; `tensor`: each block's tensor (file offset, row width,
    itemsize, dtype code)."""

    first_row: _I64
    rows: _I64
    first_col: _I64
    cols: _I64
    stride: _I64
    dest_cols: _I64
    tensor: _I64

    def runs(self, offset: _I64, held: npt.NDArray[np.bool_], ranks: int, engine_code: int) -> tuple[_Runs, tuple[_I64, _I64]]:
        """The direct runs (whole rows: one per block; column slices of long enough rows: one
        per row) and the staged blocks' rows with their ranks; `offset`: each block's element
        offset in its rank's buffer."""
        first_row, rows, first_col, cols, stride, dest_cols = (
            a.reshape(-1) for a in (self.first_row, self.rows, self.first_col, self.cols, self.stride, self.dest_cols)
        )
        start, width, size, code = (a.reshape(-1) for a in self.tensor)
        rank_of = np.repeat(np.arange(ranks), len(rows) // max(ranks, 1))
        valid = held & (rows > 0) & (cols > 0)
        same = valid & (code == engine_code) & ((stride == 1) | (cols == 1))
        whole = same & (first_col == 0) & (cols == width) & (width == dest_cols)
        per_row = same & ~whole & (cols * size >= _DIRECT_RUN_BYTES)
        staged = valid & ~whole & ~per_row
        row_start = start + first_row * width * size
        w, p = np.flatnonzero(whole), np.flatnonzero(per_row)
        reps = rows[p]
        block = np.repeat(p, reps)
        row = np.arange(len(block)) - np.repeat(np.cumsum(reps) - reps, reps)
        runs = _Runs(
            files=np.concatenate((row_start[w], row_start[block] + (row * width[block] + first_col[block]) * size[block])),
            lengths=np.concatenate((rows[w] * width[w] * size[w], cols[block] * size[block])),
            targets=np.concatenate((offset[w], offset[block] + row * dest_cols[block])) * np.concatenate((size[w], size[block])),
            ranks=np.concatenate((rank_of[w], rank_of[block])),
        )
        rows_staged = np.stack((row_start, rows, width, code, first_col, cols, stride, offset, dest_cols), axis=1)[staged]
        return runs, (rows_staged, rank_of[staged])


@dataclass(frozen=True)
class _Runs:
    """Direct runs: (file offset, bytes, byte offset in the buffer) of each rank."""

    files: _I64
    lengths: _I64
    targets: _I64
    ranks: _I64

    def calls(self, ranks: int) -> tuple[_I64, _I64, _I64, _I64, _I64]:
        """The runs of each rank in file order, joined into preadv calls: runs at most
        `_MAX_GAP_BYTES` apart share one, the gap read into scratch. Returns the calls, their
        segments, each rank's largest gap, and where each rank's calls and segments begin
        (`ranks + 1` bounds each)."""
        order = np.lexsort((self.files, self.ranks))
        files, lengths, targets, run_rank = self.files[order], self.lengths[order], self.targets[order], self.ranks[order]
        count = len(files)
        ends = files + lengths
        gaps = np.concatenate(([0], files[1:] - ends[:-1])).astype(np.int64)
        rank_start = np.searchsorted(run_rank, run_rank)  # each run's rank's first run
        starts = (
            (np.arange(count) == rank_start)
            | (gaps < 0)
            | (gaps > _MAX_GAP_BYTES)
            | ((np.arange(count) - rank_start) % _RUNS_PER_CALL == 0)
        )
        gapped = ~starts & (gaps > 0)
        where = np.arange(count) + np.cumsum(gapped)  # each run's segment
        segments = np.empty((count + int(gapped.sum()), 2), dtype=np.int64)
        segments[where, 0], segments[where, 1] = targets, lengths
        segments[where[gapped] - 1, 0], segments[where[gapped] - 1, 1] = -1, gaps[gapped]
        first = np.flatnonzero(starts)
        last = np.concatenate((first[1:], [count] if count else [])).astype(np.int64) - 1
        calls = np.stack(
            (files[first], np.diff(np.concatenate((where[first], [len(segments)]))).astype(np.int64), ends[last] - files[first]), axis=1
        ).reshape(-1, 3)
        bounds = np.arange(ranks + 1)
        call_of_rank = np.searchsorted(run_rank[first], bounds)
        segment_of_rank = np.concatenate((where[first], [len(segments)]))[call_of_rank]
        max_gaps = np.zeros(ranks, dtype=np.int64)
        np.maximum.at(max_gaps, run_rank[gapped], gaps[gapped])
        return calls, segments, max_gaps, call_of_rank, segment_of_rank


def plan_shard(spec: AdapterSpec, lora_layouts: Mapping[ModuleKey, tuple[LoraSliceLayout, ...]], dtype: torch.dtype) -> ShardPlan:
    """The read plan of one rank's slices of every module (`lora_layouts`: the rank's
    `lora_slices()`), as `ShardPlanner` makes it for every rank of an engine."""
    return ShardPlanner([lora_layouts], dtype).plans(spec)[0]


def read_planned_shard(plan: ShardPlan, fd: int, keys: Sequence[ModuleKey], dtype: torch.dtype) -> AdapterShard:
    """Carry out `plan` on the weights file open as `fd`: its bytes go straight into one buffer
    of `dtype` (zeroed when the plan leaves padding; through a staging buffer only for the plan's
    staged blocks), whose views are the slices' A and B (`AdapterShard.weights`); `keys`: the
    rank's module keys, in the plan's order. Refuses a file of another size than planned, one
    that ends early, and NaN/Inf anywhere in the shard."""
    if os.fstat(fd).st_size != plan.file_size:
        raise _corrupt("the file changed while it was being read")
    shard = _ShardBuffer(plan.numel, dtype, plan.zeroed)
    scratch = memoryview(bytearray(plan.max_gap))
    target = shard.bytes
    segments = plan.segments.tolist()
    at = 0
    for offset, count, nbytes in plan.calls.tolist():
        buffers = [target[begin : begin + size] if begin >= 0 else scratch[:size] for begin, size in segments[at : at + count]]
        at += count
        if os.preadv(fd, buffers, offset) != nbytes:
            raise _corrupt("the file ended early")
    for start, rows, width, code, first_col, cols, stride, offset, dest_cols in plan.staged.tolist():
        shard.stage(fd, start, rows, width, _FILE_DTYPES[code], first_col, cols, stride, offset, dest_cols)
    _refuse_non_finite(shard.flat, plan.slices, plan.tensors)
    return AdapterShard(shard.flat, keys, plan.slices, plan.scales, plan.numel * dtype.itemsize)


def read_adapter_shard(
    spec: AdapterSpec,
    fd: int,
    lora_layouts: Mapping[ModuleKey, tuple[LoraSliceLayout, ...]],
    dtype: torch.dtype,
) -> AdapterShard:
    """Read this rank's slices of every module (per `lora_layouts`) from the weights file open
    as `fd` (the file `spec` describes), padded to max rank: its plan (`plan_shard`), carried
    out here (`read_planned_shard`), as the driver and a rank do it between them.

    The whole shard is one zeroed buffer of `dtype`; every slice's A and B are views of it, and
    the file's bytes are read straight into them (through a one-tensor staging buffer only where
    the file's dtype or column order differs), so memory grows by the shard and little else.
    """
    return read_planned_shard(plan_shard(spec, lora_layouts, dtype), fd, tuple(lora_layouts), dtype)


def warm_up_shard_reads(dtype: torch.dtype) -> AdapterShard:
    """Read a shard of a tiny adapter once, from an anonymous file with tensors of every float
    dtype, into `dtype`; for a rank to call at start-up.

    The first call of each kernel a shard read uses maps that kernel's code into the process:
    file-backed pages that count in its RSS (the fp32 sum of the non-finite check about 1.4 MiB
    of libtorch_cpu.so, the strided numpy copy 128 KiB of numpy's core). Taken here, once, they
    are out of the first load's memory, which then grows by its shard as every later load does
    (docs/engine.md "Measured"). The adapter's bytes are zeros, so the read succeeds; returns
    its shard (8 modules, each one A/B slice of zeros), its slices' views made.
    """
    modules: list[ModuleAdapter] = []
    tensors: dict[str, TensorEntry] = {}
    layouts: dict[ModuleKey, tuple[LoraSliceLayout, ...]] = {}
    start = 0
    for index, file_dtype in enumerate(_FLOAT_DTYPES.values()):
        # Per file dtype, two modules of rank 2: A's middle columns with B's whole rows, then A
        # whole with B's every other column (fused experts' stride): every staged path.
        for stride in (1, 2):
            layer = 2 * index + stride - 1
            a_key, b_key = f"{layer}.a", f"{layer}.b"
            for key, shape in ((a_key, (2, 4)), (b_key, (4, 2 * stride))):
                tensors[key] = TensorEntry(file_dtype, shape, start)
                start += shape[0] * shape[1] * file_dtype.itemsize
            modules.append(ModuleAdapter(layer, "o_proj", 0, a_key, b_key, rank=2, scale=1.0, b_col_stride=stride))
            a_in = Span(1, 2) if stride == 1 else Span(0, 4)
            layouts[(layer, "o_proj")] = (LoraSliceLayout("o_proj", Span(0, 2), a_in, Span(0, 4), Span(0, 2)),)
    fd = _anonymous_file()
    try:
        os.write(fd, bytes(start))  # a few hundred bytes: one write (the read checks the size)
        spec = AdapterSpec(Path("warm-up"), tuple(modules), 2, tensors, start)  # its path is never opened
        shard = read_adapter_shard(spec, fd, layouts, dtype)
    finally:
        os.close(fd)
    shard.weights  # noqa: B018 (a cached property: its views made now, as the pool makes them)
    return shard


def _anonymous_file() -> int:
    """A new file with no name: a memfd on Linux (no writable filesystem needed in the rank's
    container), else a temporary file unlinked at once."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("lorafleet-warm-up", os.MFD_CLOEXEC)
    fd, name = tempfile.mkstemp(prefix="lorafleet-warm-up-")
    os.unlink(name)
    return fd


def _layouts_of(module: ModuleAdapter, lora_layouts: Mapping[ModuleKey, tuple[LoraSliceLayout, ...]]) -> tuple[LoraSliceLayout, ...] | None:
    """The rank's layouts of a module; None for an expert held by another expert-parallel group."""
    layouts = lora_layouts.get(module.key)
    if layouts is None and module.expert is None:
        raise AdapterLoadError(f"engine has no module for {module.a_key}")
    return layouts


class _ShardBuffer:
    """One rank's shard of one adapter: a buffer of the engine's dtype that file bytes are read
    into, zeroed first only when the reads leave rank padding (`zeroed`): an adapter of the
    engine's max rank fills it whole, and zeroing 2.4 MiB cost a rank about a tenth of its
    load's CPU (docs/engine.md "Measured")."""

    def __init__(self, numel: int, dtype: torch.dtype, zeroed: bool = True) -> None:
        self.dtype = dtype
        # numpy, not torch: its allocations are traced (tracemalloc), and the reads write into its buffer.
        self.raw = (np.zeros if zeroed else np.empty)(numel * dtype.itemsize, dtype=np.uint8)
        self.bytes = self.raw.data
        self.flat = torch.frombuffer(self.raw, dtype=dtype) if numel else torch.zeros(0, dtype=dtype)

    def stage(
        self,
        fd: int,
        start: int,
        rows: int,
        width: int,
        file_dtype: torch.dtype,
        first_col: int,
        cols: int,
        col_stride: int,
        offset: int,
        dest_cols: int,
    ) -> None:
        """Read `rows` whole rows of a file tensor (`width` wide) at `start` into a staging
        buffer, then move `cols` columns of them (from `first_col`, every `col_stride`th) into
        the top-left corner of the destination at element `offset`, `dest_cols` wide."""
        staged = bytearray(rows * width * file_dtype.itemsize)
        if os.preadv(fd, [staged], start) != len(staged):
            raise _corrupt("the file ended early")
        stop = first_col + (cols - 1) * col_stride + 1
        if file_dtype == self.dtype:
            # Nothing to convert: numpy moves the elements as integers of their size (it has no
            # bfloat16), at a fraction of the cost of torch's per-op dispatch.
            as_int = _SAME_SIZE_INTS[self.dtype.itemsize]
            source = np.frombuffer(staged, as_int).reshape(rows, width)
            target = np.frombuffer(self.raw, as_int, rows * dest_cols, offset * self.dtype.itemsize).reshape(rows, dest_cols)
            target[:, :cols] = source[:, first_col:stop:col_stride]
            return
        converted = torch.frombuffer(staged, dtype=file_dtype).view(rows, width)
        view = self.flat[offset : offset + rows * dest_cols].view(rows, dest_cols)
        view[:, :cols].copy_(converted[:, first_col:stop:col_stride])


def _refuse_non_finite(flat: torch.Tensor, slices: _I64, names: Sequence[str]) -> None:
    """Refuse NaN/Inf anywhere in the shard, naming the first tensor that has one (`slices`:
    the plan's table of every slice's A and B in buffer order, with their keys in `names`).

    An fp32 sum of the buffer (a fraction of the cost of an elementwise check) is non-finite if
    some value is, or, never for real weights, if the sum overflows; only then is each tensor
    checked, to name it. With more than one torch thread the sum runs in chunks below torch's
    parallel grain size: a parallel reduction waits for a second thread, which on a busy machine
    costs milliseconds. A rank of one thread sums in one op (the chunks' dispatch cost it about
    0.2 ms per 2.4-MiB shard).
    """
    chunk = _SERIAL_ELEMENTS if torch.get_num_threads() > 1 else max(1, flat.numel())
    sums = [part.sum(dtype=torch.float32) for part in torch.split(flat, chunk)]
    if not sums or math.isfinite(float(torch.stack(sums).sum())):
        return
    for piece, name in zip(_pieces(flat, slices.tolist()), names, strict=True):
        if not torch.isfinite(piece).all():
            raise AdapterLoadError(f"tensor {name} has non-finite values (NaN or Inf)")
