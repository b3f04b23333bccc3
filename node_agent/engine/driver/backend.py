"""The builtin engine behind the agent's seam (`node_agent.backend.Backend`).

`Engine` speaks the engine's own vocabulary (torch tensors, `SamplingParams`, the loader's and
the scheduler's refusals); `EngineBackend` answers in the seam's, so the agent knows no engine.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from node_agent.backend import (
    AdapterRefused,
    AdapterRequests,
    BackendDescription,
    Capacity,
    ControlResult,
    Health,
    LoadRequest,
    ModuleShape,
    Overloaded,
    RankHoldings,
    RankLayout,
    RankPlace,
    RequestRefused,
    Sampling,
    SequenceInput,
    ServingStats,
    SnapshotChanged,
)
from node_agent.engine.adapters.errors import AdapterLoadError
from node_agent.engine.adapters.files import ContentChanged
from node_agent.engine.driver.config import EngineConfig
from node_agent.engine.driver.engine import Engine
from node_agent.engine.driver.errors import RankLoadError
from node_agent.engine.driver.faults import FaultPlan
from node_agent.engine.driver.generation import Generation
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.topology import Topology
from node_agent.engine.serving.sampler import SamplingParams
from node_agent.engine.serving.scheduling import QueueFull, SchedulerError

KIND = "lorafleet-engine"


class EngineBackend:
    """An `Engine` as a `Backend`: every capability, the engine's ranks as the seam's ranks."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def start(cls, config: EngineConfig, faults: FaultPlan | None = None) -> EngineBackend:
        """Start an engine (its ranks) and serve it; `faults` only from tests."""
        return cls(Engine(config, faults))

    def describe(self) -> BackendDescription:
        """The engine's topology and capacity, and every rank's LoRA buffer shapes (asked now)."""
        return engine_description(self.engine.config, tuple(module for reply in self.engine.describe() for module in reply.modules))

    def load(self, request: LoadRequest) -> ControlResult:
        """`Engine.load_adapter`, its refusals in the seam's terms."""
        try:
            return self.engine.load_adapter(request.name, request.path, request.pinned, request.expected, request.written)
        except RankLoadError:
            raise  # already the seam's LoadFailed
        except ContentChanged as error:
            raise SnapshotChanged(str(error)) from None
        except AdapterLoadError as error:
            raise AdapterRefused(str(error)) from None

    def unload(self, name: str) -> ControlResult:
        return self.engine.unload_adapter(name)

    def holding(self, name: str) -> ControlResult:
        return self.engine.holding(name)

    def holdings(self) -> list[RankHoldings]:
        return [RankHoldings(reply.rank, reply.holds) for reply in self.engine.describe()]

    def forward(self, sequences: Sequence[SequenceInput]) -> list[np.ndarray]:
        try:
            return [logits.numpy() for logits in self.engine.forward(sequences)]
        except QueueFull as error:
            raise Overloaded(str(error)) from None
        except SchedulerError as error:
            raise RequestRefused(str(error)) from None

    def generate(self, tokens: Sequence[int], adapter: str | None, sampling: Sampling) -> Generation:
        try:
            params = SamplingParams(**asdict(sampling))
        except ValueError as error:
            raise RequestRefused(str(error)) from None
        try:
            return self.engine.submit(tokens, adapter, params)
        except QueueFull as error:
            raise Overloaded(str(error)) from None
        except SchedulerError as error:
            raise RequestRefused(str(error)) from None

    @property
    def alive(self) -> bool:
        return self.engine.alive

    def health(self) -> Health:
        alive = self.engine.alive
        failure = "" if alive else self.engine.failure or "a rank process exited"
        return Health(alive, failure, self.engine.running, _ranks_running(self.engine.pids, self.engine.config.topology.tp_size, alive))

    def serving_stats(self) -> ServingStats:
        return self.engine.serving_stats()

    def adapter_requests(self) -> tuple[AdapterRequests, ...]:
        return self.engine.adapter_requests()

    def close(self) -> None:
        self.engine.close()


def engine_description(config: EngineConfig, modules: tuple[ModuleShape, ...]) -> BackendDescription:
    """What an engine of `config` describes itself as, with its ranks' buffer shapes `modules`."""
    topology = config.topology
    return BackendDescription(
        kind=KIND,
        version=importlib.metadata.version("lorafleet"),
        model_dir=Path(config.model_dir),
        vocab_size=ModelConfig.from_dir(config.model_dir).vocab_size,
        layout=RankLayout(
            topology.tp_size, topology.dp_size, topology.attn_tp_size, topology.ep_size, topology.moe_tp_size, topology.fully_sharded_loras
        ),
        ranks=rank_places(topology),
        capacity=Capacity(config.max_lora_rank, config.max_loras_per_batch, config.max_loaded_loras),
        modules=modules,
    )


def rank_places(topology: Topology) -> tuple[RankPlace, ...]:
    """Every rank's place in the attention groups, rank order."""
    return tuple(RankPlace(c.rank, c.attn_dp_rank, c.attn_tp_rank) for c in map(topology.coords, range(topology.tp_size)))


def _ranks_running(pids: list[int], tp_size: int, engine_alive: bool) -> tuple[bool, ...]:
    """Whether each rank process runs, from /proc (an exited, unreaped zombie does not); without
    /proc (not Linux) every rank gets the engine's overall liveness."""
    if len(pids) != tp_size:
        return (False,) * tp_size  # the engine was closed
    if not Path("/proc/self/stat").exists():
        return (engine_alive,) * tp_size
    running = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            running.append(False)
            continue
        running.append(stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X"))
    return tuple(running)
