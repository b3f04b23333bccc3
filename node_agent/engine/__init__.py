"""The sharded multi-LoRA engine a node agent hosts (docs/engine.md): its one public face.

Callers (the agent, the CLI) import only from here. Every command answers with typed per-rank
replies (`node_agent.engine.driver.protocol`); a load or unload answers with one `ControlResult`,
merged failure-first, that carries what every rank holds afterwards.
"""

from node_agent.engine.adapters.files import ContentChanged, FileDigests, FileIdentity, WrittenFiles
from node_agent.engine.adapters.peft import (
    ADAPTER_CONFIG_FIELDS,
    MAX_CONFIG_BYTES,
    AdapterConfig,
    AdapterLoadError,
    read_adapter_config,
    validate_adapter,
)
from node_agent.engine.driver.engine import (
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
from node_agent.engine.driver.protocol import (
    ControlReply,
    ControlResult,
    DescribeReply,
    ModuleShape,
    RankReply,
    SliceShape,
)
from node_agent.engine.parallel.topology import Topology, TopologyError
from node_agent.engine.serving.sampler import MAX_LOGPROBS, FinishReason, SamplingParams, TokenLogprobs
from node_agent.engine.serving.scheduler import QueueFull, SchedulerError

__all__ = [
    "ADAPTER_CONFIG_FIELDS",
    "MAX_CONFIG_BYTES",
    "MAX_LOGPROBS",
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
