"""The specs validated so far (`SpecMemo`): a load of bytes, or of a structure, seen before reuses its spec."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any

from node_agent.engine.adapters.config import config_from_bytes
from node_agent.engine.adapters.header import AdapterBytes
from node_agent.engine.adapters.spec import AdapterSpec, spec_from_bytes
from node_agent.engine.model_config import ModelConfig


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
            config = config_from_bytes(path, data.config)  # config bytes not seen before are always validated
            structure = data.structure(config)
            with self._lock:
                known = self._recall(structure)
            if known is None:
                known = spec_from_bytes(path, data, config, self.cfg, self.max_lora_rank)
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
