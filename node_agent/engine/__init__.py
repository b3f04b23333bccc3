"""The sharded multi-LoRA engine a node agent hosts (docs/engine.md): its one public face.

Callers (the agent, the CLI) import only from here. Every command answers with typed per-rank
replies (`node_agent.engine.protocol`); a load or unload answers with one `ControlResult`,
merged failure-first, that carries what every rank holds afterwards.
"""

from node_agent.engine.adapter_files import ContentChanged, FileDigests, FileIdentity, WrittenFiles
from node_agent.engine.engine import (
    Engine,
    EngineConfig,
    EngineError,
    GeneratedStep,
    Generation,
    RankLoadError,
    RankUnloadError,
    RunningCommand,
    SequenceAborted,
    SequenceInput,
    ServingStats,
)
from node_agent.engine.peft_adapter import (
    ADAPTER_CONFIG_FIELDS,
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
    ModuleShape,
    RankReply,
    SliceShape,
)
from node_agent.engine.sampler import FinishReason, SamplingParams, TokenLogprobs
from node_agent.engine.scheduler import QueueFull, SchedulerError
from node_agent.engine.topology import Topology, TopologyError

__all__ = [
    "ADAPTER_CONFIG_FIELDS",
    "MAX_CONFIG_BYTES",
    "AdapterConfig",
    "AdapterLoadError",
    "ContentChanged",
    "ControlReply",
    "ControlResult",
    "DescribeReply",
    "Engine",
    "EngineConfig",
    "EngineError",
    "FileDigests",
    "FileIdentity",
    "FinishReason",
    "GeneratedStep",
    "Generation",
    "ModuleShape",
    "QueueFull",
    "RankLoadError",
    "RankReply",
    "RankUnloadError",
    "RunningCommand",
    "SamplingParams",
    "SchedulerError",
    "SequenceAborted",
    "SequenceInput",
    "ServingStats",
    "SliceShape",
    "TokenLogprobs",
    "Topology",
    "TopologyError",
    "WrittenFiles",
    "read_adapter_config",
    "validate_adapter",
]
