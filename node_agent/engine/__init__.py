"""The sharded multi-LoRA engine a node agent hosts (DESIGN.md §2–§5)."""

from node_agent.engine.engine import (
    Engine,
    EngineConfig,
    EngineError,
    LoadedAdapter,
    RankLoadError,
    RankUnloadError,
    SequenceInput,
)
from node_agent.engine.peft_adapter import AdapterLoadError
from node_agent.engine.topology import Topology

__all__ = [
    "AdapterLoadError",
    "Engine",
    "EngineConfig",
    "EngineError",
    "LoadedAdapter",
    "RankLoadError",
    "RankUnloadError",
    "SequenceInput",
    "Topology",
]
