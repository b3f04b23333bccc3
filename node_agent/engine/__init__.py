"""The sharded multi-LoRA engine a node agent hosts (docs/engine.md): its one public face.

Callers (the agent, the CLI) import only from here. Every command answers with typed per-rank
replies (`node_agent.engine.protocol`); a load or unload answers with one `ControlResult`,
merged failure-first, that carries what every rank holds afterwards.
"""

from node_agent.engine.engine import (
    Engine,
    EngineConfig,
    EngineError,
    RankLoadError,
    RankUnloadError,
    RunningCommand,
    SequenceInput,
)
from node_agent.engine.peft_adapter import (
    MAX_CONFIG_BYTES,
    AdapterConfig,
    AdapterLoadError,
    read_adapter_config,
    validate_adapter,
)
from node_agent.engine.protocol import (
    ControlReply,
    ControlResult,
    DescribeReply,
    FileDigests,
    ModuleShape,
    RankReply,
    SliceShape,
)
from node_agent.engine.topology import Topology, TopologyError

__all__ = [
    "MAX_CONFIG_BYTES",
    "AdapterConfig",
    "AdapterLoadError",
    "ControlReply",
    "ControlResult",
    "DescribeReply",
    "Engine",
    "EngineConfig",
    "EngineError",
    "FileDigests",
    "ModuleShape",
    "RankLoadError",
    "RankReply",
    "RankUnloadError",
    "RunningCommand",
    "SequenceInput",
    "SliceShape",
    "Topology",
    "TopologyError",
    "read_adapter_config",
    "validate_adapter",
]
