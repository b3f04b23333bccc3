"""Read a rank's slices of a Hugging Face safetensors checkpoint, never the whole tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from node_agent.engine.sharding import Span


class CheckpointError(ValueError):
    """The base model checkpoint is missing, incomplete or does not match its config."""


class Checkpoint:
    """All `*.safetensors` files of a model directory, addressed by tensor name."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"model directory {model_dir} has no *.safetensors files")
        self._handles = {}
        self._file_of: dict[str, Path] = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as error:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read {path.name}: {error}") from error
            self._handles[path] = handle
            for key in handle.keys():
                self._file_of[key] = path

    def has(self, key: str) -> bool:
        return key in self._file_of

    def shape(self, key: str) -> list[int]:
        return list(self._slice(key).get_shape())

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

    def _slice(self, key: str):
        path = self._file_of.get(key)
        if path is None:
            raise CheckpointError(f"checkpoint in {self.model_dir} has no tensor {key!r}")
        return self._handles[path].get_slice(key)

