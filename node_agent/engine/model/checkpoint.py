"""Read a rank's slices of a Hugging Face safetensors checkpoint, never the whole tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from node_agent.engine.parallel.sharding import Span


class CheckpointError(ValueError):
    """The base model checkpoint is missing, incomplete or does not match its config."""


class _TensorSlice(Protocol):
    """What this module uses of a safetensors slice (the library's own stubs are untyped)."""

    def get_shape(self) -> list[int]:
        """The tensor's full shape."""

    def __getitem__(self, index: slice | tuple[slice, slice]) -> torch.Tensor:
        """Read only the indexed part."""


class _SafetensorsFile(Protocol):
    """What this module uses of an open safetensors file."""

    def keys(self) -> list[str]:
        """Names of the file's tensors."""

    def get_slice(self, name: str) -> _TensorSlice:
        """A lazily read view of one tensor."""


class Checkpoint:
    """All `*.safetensors` files of a model directory, addressed by tensor name."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"model directory {model_dir} has no *.safetensors files")
        self._handles: dict[Path, _SafetensorsFile] = {}
        self._file_of: dict[str, Path] = {}
        for path in files:
            try:
                handle: _SafetensorsFile = safe_open(str(path), framework="pt")
            except Exception as error:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read {path.name}: {error}") from error
            self._handles[path] = handle
            self._file_of.update(dict.fromkeys(handle.keys(), path))

    def read(self, key: str, rows: Span | None = None, cols: Span | None = None) -> torch.Tensor:
        """Read `key`, only rows/cols in the given spans; rows past the tensor are zero padding."""
        view = self._slice(key)
        shape = view.get_shape()
        if rows is None:
            rows = Span(0, shape[0])
        real_stop = min(rows.stop, shape[0])
        if len(shape) == 1:
            part = view[rows.start : real_stop]
        elif cols is None:
            part = view[rows.start : real_stop, :]
        else:
            part = view[rows.start : real_stop, cols.start : cols.stop]
        if real_stop - rows.start < rows.width:
            pad = torch.zeros((rows.width - part.shape[0], *part.shape[1:]), dtype=part.dtype)
            part = torch.cat([part, pad])
        return part

    def _slice(self, key: str) -> _TensorSlice:
        path = self._file_of.get(key)
        if path is None:
            raise CheckpointError(f"checkpoint in {self.model_dir} has no tensor {key!r}")
        return self._handles[path].get_slice(key)
