"""Simulated node agents, for the fleet-scale benchmark only (benchmarks/bench_fleet_scale.py).

What this is, and is not: one process serving many gRPC endpoints. Each endpoint is the real
``lorafleet.v1.NodeAgent`` server (``node_agent.server``) over the real :class:`Agent` (its
registry, sources, validation, locks and metrics) and the real engine driver
(:class:`Engine`: the adapter verified once, the command lock, the failure-first merge of every
rank's reply, the rollback of a partial load). Only the ranks are simulated: no rank processes,
no model weights, no LoRA buffers. A simulated rank answers each command in-process the way a
real rank's pool does (capacity, duplicates, unknown names) and reports the buffer shapes the
sharding rule gives it. A failing agent refuses every load on one rank, so the operator sees a
per-rank failure exactly as from a real engine. Generate and Forward are not simulated.

Nothing else uses it: tests and the demo run real agents (``lorafleet_dev.agents``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

from node_agent.agent import Agent, AgentConfig
from node_agent.engine import ControlReply, DescribeReply, Engine, EngineConfig, ModuleShape, RankReply, SliceShape
from node_agent.engine.engine import R
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.protocol import Command, Describe, Load, Unload
from node_agent.engine.sharding import lora_layout, model_kinds, module_layout
from node_agent.engine.topology import Topology
from node_agent.server import AgentServer, ServerOptions, create_server
from node_agent.sources import SourcePolicy

log = logging.getLogger(__name__)

#: The rank of a failing agent that refuses every load.
FAILING_RANK = 3


@dataclass
class SimulatedRank:
    """One rank's pool as far as loads go: the adapters it holds, in load order."""

    rank: int
    attn_dp_rank: int
    attn_tp_rank: int
    modules: tuple[ModuleShape, ...]
    max_loaded: int
    fails_loads: bool
    holds: list[str] = field(default_factory=list)

    def answer(self, command: Command) -> RankReply:
        """The reply a real rank gives to `command` (loads and unloads change `holds`)."""
        head = (self.rank, self.attn_dp_rank, self.attn_tp_rank)
        match command:
            case Describe():
                return DescribeReply(*head, True, modules=self.modules, holds=tuple(self.holds), kv_blocks=1024,
                                     kv_block_bytes=4096, kv_cache_bytes=1024 * 4096,
                                     slot_digest=hashlib.sha256().hexdigest())
            case Load():
                error = self._load_error(command.name)
                if not error:
                    self.holds.append(command.name)
                return ControlReply(*head, not error, error, holds=tuple(self.holds),
                                    digests=None if error else command.adapter.digests)
            case Unload():
                if command.name not in self.holds:
                    return ControlReply(*head, False, f"adapter {command.name!r} is not loaded", holds=tuple(self.holds))
                self.holds.remove(command.name)
                return ControlReply(*head, True, holds=tuple(self.holds))
            case _:
                return RankReply(*head, True)

    def _load_error(self, name: str) -> str:
        if self.fails_loads and self.rank == FAILING_RANK:
            return f"simulated load failure on rank {self.rank}"
        if name in self.holds:
            return f"adapter {name!r} is already loaded"
        if len(self.holds) >= self.max_loaded:
            return f"max_loaded_loras ({self.max_loaded}) reached; unload an adapter first"
        return ""


class SimulatedEngine(Engine):
    """The real driver over in-process simulated ranks (see the module docstring)."""

    def __init__(self, config: EngineConfig, fails_loads: bool = False) -> None:
        self._fails_loads = fails_loads
        super().__init__(config)

    def _start(self) -> None:
        cfg, topology = self.model_config, self.config.topology
        self._ranks = [self._rank(cfg, topology, rank) for rank in range(topology.tp_size)]

    def _rank(self, cfg: ModelConfig, topology: Topology, rank: int) -> SimulatedRank:
        coords = topology.coords(rank)
        modules = []
        for layer in range(cfg.num_layers):
            for kind in model_kinds(cfg):
                slices = lora_layout(module_layout(cfg, topology, rank, kind), self.config.max_lora_rank,
                                     topology.fully_sharded_loras)
                shapes = tuple(SliceShape((s.a_rank.width, s.a_in.width), (s.b_out.width, s.b_rank.width)) for s in slices)
                modules.append(ModuleShape(f"layers.{layer}.{kind}", rank, shapes))
        return SimulatedRank(rank, coords.attn_dp_rank, coords.attn_tp_rank, tuple(modules),
                             self.config.max_loaded_loras, self._fails_loads)

    def _broadcast(self, command: Command, kind: type[R]) -> list[R]:
        with self._lock:
            replies = [rank.answer(command) for rank in self._ranks]
        return [reply for reply in replies if isinstance(reply, kind)]

    @property
    def alive(self) -> bool:
        return self.failure is None

    @property
    def pids(self) -> list[int]:
        return []

    def close(self) -> None:
        self._stop_step_loop()


@dataclass(frozen=True)
class SimulatedFleetSpec:
    """What every simulated agent serves."""

    model_dir: Path
    adapter_root: Path
    base_model_name: str
    tp: int = 8
    dp: int = 2
    max_lora_rank: int = 16
    max_loaded_loras: int = 2048


class SimulatedFleet:
    """`count` simulated agents in this process, each a real gRPC server on 127.0.0.1."""

    def __init__(self, spec: SimulatedFleetSpec, count: int, failing: int = 0) -> None:
        self.servers: list[AgentServer] = []
        engine_config = EngineConfig(model_dir=spec.model_dir, topology=Topology(spec.tp, spec.dp),
                                     max_lora_rank=spec.max_lora_rank, max_loaded_loras=spec.max_loaded_loras)
        try:
            for index in range(count):
                agent = Agent(SimulatedEngine(engine_config, fails_loads=index < failing),
                              AgentConfig(base_model_name=spec.base_model_name, agent_id=f"sim-{index}",
                                          sources=SourcePolicy(adapter_roots=(spec.adapter_root,))))
                server = create_server(agent, ServerOptions(listen="127.0.0.1:0"))
                server.start()
                self.servers.append(server)
        except BaseException:
            self.stop()
            raise
        log.info("%d simulated agents (%d failing every load) on ports %s", count, failing, self.ports)

    @property
    def ports(self) -> list[int]:
        """Each agent's gRPC port, in agent order."""
        return [server.port for server in self.servers]

    def stop(self) -> None:
        """Stop every server and its agent."""
        for server in self.servers:
            server.stop()
        self.servers = []


def main(argv: list[str] | None = None) -> None:
    """``python -m lorafleet_dev.simagents``: serve a simulated fleet until SIGTERM or SIGINT;
    the agents' ports go to ``--ports-file`` (JSON) once all serve."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="model directory (config.json, tokenizer)")
    parser.add_argument("--adapter-root", type=Path, required=True, help="where file:// adapters may come from")
    parser.add_argument("--base-model-name", required=True)
    parser.add_argument("--count", type=int, default=64, help="agents (default 64)")
    parser.add_argument("--failing", type=int, default=0, help="of them, agents that refuse every load on one rank")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--ports-file", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="simagents %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    spec = SimulatedFleetSpec(args.model, args.adapter_root, args.base_model_name, tp=args.tp, dp=args.dp)
    fleet = SimulatedFleet(spec, args.count, args.failing)
    try:
        partial = args.ports_file.with_suffix(".partial")
        partial.write_text(json.dumps(fleet.ports))
        partial.rename(args.ports_file)
        stop.wait()
    finally:
        fleet.stop()


if __name__ == "__main__":
    main()
