"""A validated adapter, `AdapterSpec`: its config and safetensors header checked against the
base model, every targeted module found, no tensor data read (pickle formats, `.bin` and `.pt`,
are refused without being read)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from node_agent.engine.adapters.config import AdapterConfig, config_from_bytes, read_config_bytes
from node_agent.engine.adapters.errors import WEIGHTS_FILE, AdapterLoadError
from node_agent.engine.adapters.header import AdapterBytes, TensorEntry, parse_header, read_header_bytes, weights_file
from node_agent.engine.adapters.targets import ModuleAdapter, ModuleMatcher
from node_agent.engine.model_config import ModelConfig


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


def read_adapter_spec(path: Path, cfg: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """Validate config and tensor headers against the base model; read no tensor data."""
    path = Path(path)
    config_bytes = read_config_bytes(path)
    config = config_from_bytes(path, config_bytes)
    weights = weights_file(path)
    try:
        with weights.open("rb") as handle:
            header, file_size = read_header_bytes(handle.fileno())
    except OSError as error:
        raise AdapterLoadError(f"{WEIGHTS_FILE} cannot be read: {error}") from error
    return spec_from_bytes(path, AdapterBytes(config_bytes, header, file_size), config, cfg, max_lora_rank)


def spec_from_bytes(path: Path, data: AdapterBytes, config: AdapterConfig, cfg: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """The spec of the adapter whose bytes are `data` (its config already parsed from them as
    `config`), for the base model `cfg`: header parsed, modules matched."""
    tensors = parse_header(data.header, data.file_size)
    modules = ModuleMatcher(config, tensors, cfg, max_lora_rank).modules()
    return AdapterSpec(path, tuple(modules), max(m.rank for m in modules), tensors, data.file_size, data.structure(config))


def validate_adapter(path: Path, model_dir: Path, max_lora_rank: int) -> AdapterSpec:
    """Everything `read_adapter_spec` checks (config, header, every module and its patterns),
    for the base model in `model_dir`, in the caller's process: what the agent can run on its
    snapshot before the engine's command lock. Reads no tensor data."""
    return read_adapter_spec(path, ModelConfig.from_dir(model_dir), max_lora_rank)
