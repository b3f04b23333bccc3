"""The adapter's safetensors header: parsed and checked as safetensors checks it (float dtypes,
shapes, offsets tiling the data exactly), and `AdapterBytes`, all that validating an adapter
reads of it."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

import torch

from node_agent.engine.adapters.config import MAX_CONFIG_BYTES, AdapterConfig
from node_agent.engine.adapters.errors import WEIGHTS_FILE, AdapterLoadError, shorten
from node_agent.engine.adapters.json_depth import MAX_JSON_DEPTH, nesting_depth

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# safetensors element types a LoRA weight may have; the header's limit is safetensors' own.
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
FILE_DTYPES = tuple(FLOAT_DTYPES.values())  # a staged block names its file dtype by position here
_MAX_HEADER_BYTES = 100_000_000


class TensorEntry(NamedTuple):
    """Where one tensor's data lies in the safetensors file, from its header (a tuple: cheap to build)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file


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


def read_adapter_bytes(config_fd: int, weights_fd: int) -> AdapterBytes:
    """What validation reads, through the adapter's open files (the driver's held descriptors,
    so the bytes are those of the files it verifies). OSError where a descriptor cannot be read."""
    header, file_size = read_header_bytes(weights_fd)
    return AdapterBytes(os.pread(config_fd, MAX_CONFIG_BYTES + 1, 0), header, file_size)


def weights_file(path: Path) -> Path:
    weights = path / WEIGHTS_FILE
    if weights.is_file():
        return weights
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise AdapterLoadError(
            f"{WEIGHTS_FILE} not found in {path}; pickle formats ({', '.join(pickled)}) are refused, convert the adapter to safetensors"
        )
    raise AdapterLoadError(f"{WEIGHTS_FILE} not found in {path}")


def corrupt(reason: str) -> AdapterLoadError:
    return AdapterLoadError(f"{WEIGHTS_FILE} is corrupt or truncated: {reason}")


def read_header_bytes(fd: int) -> tuple[bytes, int]:
    """The weights file's 8-byte header length, then (when that length fits the file) the JSON
    header, read through `fd`; with the file's size. `parse_header` refuses what does not fit."""
    size = os.fstat(fd).st_size
    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8 or _header_length(prefix) > min(_MAX_HEADER_BYTES, size - 8):
        return prefix, size
    return prefix + os.pread(fd, _header_length(prefix), 8), size


def _header_length(prefix: bytes) -> int:
    (length,) = struct.unpack("<Q", prefix[:8])
    return int(length)


def parse_header(header: bytes, size: int) -> dict[str, TensorEntry]:
    """The safetensors header (8-byte little-endian length, then JSON; `read_header_bytes`), checked
    as safetensors does, for a weights file of `size` bytes.

    Returns every tensor's entry. A bad or short file is refused here.
    """
    if len(header) < 8:
        raise corrupt(f"the file has {len(header)} bytes, fewer than the 8-byte header length")
    length = _header_length(header)
    if length > min(_MAX_HEADER_BYTES, size - 8):
        raise corrupt(f"header length {length} does not fit the {size}-byte file")
    try:
        text = header[8:].decode()
        if nesting_depth(text) > MAX_JSON_DEPTH:
            raise corrupt(f"the header nests more than {MAX_JSON_DEPTH} levels deep (refused before parsing)")
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError, or an integer of over 4300 digits
        if isinstance(error, AdapterLoadError):
            raise
        raise corrupt(f"the header is not valid JSON ({shorten(str(error))})") from error
    if not isinstance(raw, dict):
        raise corrupt("the header is not a JSON object")
    data_start = 8 + length
    tensors = {key: _tensor_entry(key, value, data_start) for key, value in raw.items() if key != "__metadata__"}
    # The tensors must tile the data section exactly, in offset order, as safetensors requires.
    end = data_start
    for entry in sorted(tensors.values(), key=lambda e: e.start):
        if entry.start != end:
            raise corrupt("tensor data offsets leave gaps or overlap")
        end += math.prod(entry.shape) * entry.dtype.itemsize
    if end != size:
        raise corrupt(f"the header describes {end} bytes, the file has {size}")
    return tensors


def _tensor_entry(key: str, value: object, data_start: int) -> TensorEntry:
    """One header entry, validated: a float dtype, a shape, offsets that match the shape."""
    if not isinstance(value, dict):
        raise corrupt(f"header entry {key!r} is not an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
        raise corrupt(f"tensor {key!r} has no valid shape")
    if not isinstance(offsets, list) or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int:
        raise corrupt(f"tensor {key!r} has no valid data_offsets")
    torch_dtype = FLOAT_DTYPES.get(dtype) if isinstance(dtype, str) else None
    if torch_dtype is None:
        raise AdapterLoadError(f"{WEIGHTS_FILE}: tensor {key!r} has dtype {dtype!r}; LoRA weights must be one of {', '.join(FLOAT_DTYPES)}")
    if offsets[0] < 0 or offsets[1] - offsets[0] != math.prod(shape) * torch_dtype.itemsize:
        raise corrupt(f"tensor {key!r}: data_offsets {offsets} do not match shape {shape} of {dtype}")
    return TensorEntry(torch_dtype, tuple(shape), data_start + offsets[0])
