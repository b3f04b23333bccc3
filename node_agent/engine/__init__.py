"""The sharded multi-LoRA engine a node agent hosts (docs/engine.md): its one public face.

Callers (the agent, the CLI) import only from here. `EngineBackend` is the engine behind the
agent's seam (`node_agent.backend`); every command answers with typed per-rank replies (the
seam's, re-exported here); a load or unload answers with one `ControlResult`, merged
failure-first, that carries what every rank holds afterwards.
"""

from node_agent.backend import (
    ControlReply,
    ControlResult,
    FileDigests,
    FileIdentity,
    ModuleShape,
    RankReply,
    RunningCommand,
    SequenceInput,
    ServingStats,
    SliceShape,
    WrittenFiles,
)
from node_agent.engine.adapters.config import ADAPTER_CONFIG_FIELDS, MAX_CONFIG_BYTES, AdapterConfig, read_adapter_config
from node_agent.engine.adapters.errors import AdapterLoadError
from node_agent.engine.adapters.files import ContentChanged
from node_agent.engine.adapters.json_depth import MAX_JSON_DEPTH, nesting_depth
from node_agent.engine.adapters.spec import validate_adapter
from node_agent.engine.driver.backend import EngineBackend, engine_description, rank_places
from node_agent.engine.driver.config import EngineConfig
from node_agent.engine.driver.engine import Engine
from node_agent.engine.driver.errors import EngineError, RankLoadError, RankUnloadError, SequenceAborted
from node_agent.engine.driver.faults import FaultPlan
from node_agent.engine.driver.generation import GeneratedStep, Generation
from node_agent.engine.driver.protocol import DescribeReply
from node_agent.engine.driver.shapes import dense_module_shapes
from node_agent.engine.parallel.topology import Topology, TopologyError
from node_agent.engine.serving.sampler import MAX_LOGPROBS, FinishReason, SamplingParams, TokenLogprobs
from node_agent.engine.serving.scheduling import QueueFull, SchedulerError

__all__ = [
    "ADAPTER_CONFIG_FIELDS",
    "MAX_CONFIG_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_LOGPROBS",
    "AdapterConfig",
    "AdapterLoadError",
    "ContentChanged",
    "ControlReply",
    "ControlResult",
    "DescribeReply",
    "Engine",
    "EngineBackend",
    "EngineConfig",
    "EngineError",
    "FaultPlan",
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
    "dense_module_shapes",
    "engine_description",
    "nesting_depth",
    "rank_places",
    "read_adapter_config",
    "validate_adapter",
]
