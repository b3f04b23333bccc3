"""Simulated node agents, for the fleet-scale benchmark only (benchmarks/bench_fleet_scale.py).

What this is, and is not: one process serving many gRPC endpoints. Each endpoint is the real
``lorafleet.v1.NodeAgent`` server (``node_agent.server``) over the real :class:`Agent` (its
registry, sources, validation, locks and metrics), so every call is checked, serialised per name,
recorded in the registry and answered exactly as by a real agent. What is simulated or cut:

* No engine. No rank processes, no model weights, no LoRA buffers. A simulated rank answers each
  command in-process the way a real rank's pool does (capacity, duplicates, unknown names) and
  reports the buffer shapes the sharding rule gives it. A failing agent refuses every load on one
  rank, so the operator sees a per-rank failure exactly as from a real engine: the ranks' replies
  are merged failure-first by the real ``merge_control`` and a partial load is rolled back by the
  real driver's rollback. The adapter's files are not parsed or verified by an engine driver
  (no rank reads them). Every reply lists all its rank holds, as a real rank's does; ranks that
  held the same before a load share one tuple after it, made once per load instead of once per
  rank (eight tuples of up to a thousand names; about 1.5 of 26 CPU-seconds for 64,000 loads).
* Sources are read once per process, not once per agent (:class:`SharedSources`): the first
  load of a (URI, sha256) runs the real source check (roots, size caps, no pickle, the private
  copy and its digests) and every simulated agent then loads that one checked copy, which none
  of them removes (it goes when the fleet stops). A real agent copies and hashes every source it
  loads and removes the copy on unload: on this machine's disk about 2 ms of CPU per copy and
  its removal, 64,000 of them at 1,000 adapters x 64 agents. A source that changes after its first
  load is not seen (the benchmark's never change).
* Generate and Forward are not simulated.

Nothing else uses it: tests and the demo run real agents (``lorafleet_dev.agents``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import signal
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import node_agent.agent
from node_agent.agent import Agent, AgentConfig
from node_agent.engine import (
    AdapterLoadError,
    ControlReply,
    ControlResult,
    DescribeReply,
    Engine,
    EngineConfig,
    FileDigests,
    ModuleShape,
    RankLoadError,
    RankReply,
    SliceShape,
    WrittenFiles,
)
from node_agent.engine.driver.engine import R
from node_agent.engine.driver.protocol import Command, Describe, Unload, merge_control
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.sharding import lora_layout, model_kinds, module_layout
from node_agent.engine.parallel.topology import Topology
from node_agent.server import AgentServer, ServerOptions, create_server
from node_agent.sources import DownloadProgress, ResolvedSource, SourceCredential, SourcePolicy, resolve_source

log = logging.getLogger(__name__)

#: The rank of a failing agent that refuses every load.
FAILING_RANK = 3
#: The name under which ``node_agent.agent`` calls its source check (``Agent.load``), replaced
#: in this process only by :class:`SharedSources`.
_SOURCE_CHECK = "resolve_source"


#: One load's holdings after it, by the tuple held before it: id -> (before, after). Keeping
#: `before` keeps its id unique for the load; ranks that held the same share one `after`, made
#: once per load instead of once per rank (up to a thousand names, eight ranks).
Grown = dict[int, tuple[tuple[str, ...], tuple[str, ...]]]


@dataclass
class SimulatedRank:
    """One rank's pool as far as loads go: the adapters it holds, in load order."""

    rank: int
    attn_dp_rank: int
    attn_tp_rank: int
    modules: tuple[ModuleShape, ...]
    max_loaded: int
    fails_loads: bool
    #: Held names in load order (a dict: membership in O(1) with a thousand held).
    held: dict[str, None] = field(default_factory=dict)
    #: `held` as every reply reports it, made again only when it changes.
    holds: tuple[str, ...] = ()

    def answer(self, command: Command) -> RankReply:
        """The reply a real rank gives to a command of the real driver (Describe, Unload, the
        rollback's Unload); loads come through :meth:`load`."""
        head = (self.rank, self.attn_dp_rank, self.attn_tp_rank)
        match command:
            case Describe():
                return DescribeReply(
                    *head,
                    True,
                    modules=self.modules,
                    holds=self.holds,
                    kv_blocks=1024,
                    kv_block_bytes=4096,
                    kv_cache_bytes=1024 * 4096,
                    slot_digest=hashlib.sha256().hexdigest(),
                )
            case Unload():
                if command.name not in self.held:
                    return ControlReply(*head, False, f"adapter {command.name!r} is not loaded", holds=self.holds)
                del self.held[command.name]
                self.holds = tuple(self.held)
                return ControlReply(*head, True, holds=self.holds)
            case _:
                return RankReply(*head, True)

    def load(self, name: str, digests: FileDigests | None, grown: Grown) -> ControlReply:
        """A real rank's reply to a load of `name` whose files the caller verified as `digests`
        (a real rank reports the digests the driver confirmed). `grown`: this load's holdings
        made so far, shared by the ranks that held the same tuple before it."""
        error = self._load_error(name)
        if not error:
            self.held[name] = None
            made = grown.get(id(self.holds))
            if made is None or made[0] is not self.holds:
                made = grown[id(self.holds)] = (self.holds, (*self.holds, name))
            self.holds = made[1]
        return ControlReply(
            self.rank, self.attn_dp_rank, self.attn_tp_rank, not error, error, holds=self.holds, digests=None if error else digests
        )

    def _load_error(self, name: str) -> str:
        if self.fails_loads and self.rank == FAILING_RANK:
            return f"simulated load failure on rank {self.rank}"
        if name in self.held:
            return f"adapter {name!r} is already loaded"
        if len(self.held) >= self.max_loaded:
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
                slices = lora_layout(module_layout(cfg, topology, rank, kind), self.config.max_lora_rank, topology.fully_sharded_loras)
                shapes = tuple(SliceShape((s.a_rank.width, s.a_in.width), (s.b_out.width, s.b_rank.width)) for s in slices)
                modules.append(ModuleShape(f"layers.{layer}.{kind}", rank, shapes))
        return SimulatedRank(
            rank, coords.attn_dp_rank, coords.attn_tp_rank, tuple(modules), self.config.max_loaded_loras, self._fails_loads
        )

    def load_adapter(
        self, name: str, path: Path, pinned: bool = False, expected: FileDigests | None = None, written: WrittenFiles | None = None
    ) -> ControlResult:
        """The driver's load without its file checks (no rank reads the files): under the
        command lock, every rank's reply merged failure-first, a partial load rolled back by
        the real driver's rollback (``RankLoadError`` carries every rank's answer)."""
        with self._lock:
            if name in self.adapters:
                raise AdapterLoadError(f"adapter {name!r} is already loaded")
            grown: Grown = {}
            replies = [rank.load(name, expected, grown) for rank in self._ranks]
            self._record(replies)
            result = merge_control(replies)
            if not result.ok:
                if any(reply.ok for reply in result.ranks):
                    result = self._roll_back(name, result)
                raise RankLoadError(result)
            self.adapters.add(name)
            if pinned:
                self._pinned.add(name)
                with self._work:
                    self._scheduler.set_pinned(self._pinned)
            return result

    def _broadcast(self, command: Command | Sequence[Command], kind: type[R]) -> list[R]:
        # One command for every rank, or one per rank (the driver's per-rank commands).
        commands = list(command) if isinstance(command, Sequence) else [command] * len(self._ranks)
        with self._lock:
            replies = [rank.answer(each) for rank, each in zip(self._ranks, commands, strict=True)]
        return [reply for reply in replies if isinstance(reply, kind)]

    @property
    def alive(self) -> bool:
        return self.failure is None

    @property
    def pids(self) -> list[int]:
        return []

    def close(self) -> None:
        self._stop_step_loop()


class SharedSources:
    """Every simulated agent's source check, made once per (URI, sha256) for the whole process
    (the module docstring says why and what that leaves out). ``install`` makes it the agents'
    source check; ``close`` puts the real one back and removes the checked copies."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="lorafleet-simagents-"))
        self._checked: dict[tuple[str, str | None], ResolvedSource] = {}
        self._locks: dict[tuple[str, str | None], threading.Lock] = {}
        self._lock = threading.Lock()

    def install(self) -> None:
        setattr(node_agent.agent, _SOURCE_CHECK, self.resolve)

    def close(self) -> None:
        setattr(node_agent.agent, _SOURCE_CHECK, resolve_source)
        shutil.rmtree(self.dir, ignore_errors=True)

    def resolve(
        self,
        uri: str,
        expected_sha256: str | None,
        policy: SourcePolicy,
        credential: SourceCredential | None = None,
        progress: DownloadProgress | None = None,
    ) -> ResolvedSource:
        """The agent's ``resolve_source``: the real check on the first load of (``uri``,
        ``expected_sha256``), which the agents then share (a copy none of them owns). A load
        with a credential is checked on its own, as by a real agent (file:// refuses it)."""
        if credential is not None:
            return resolve_source(uri, expected_sha256, policy, credential, progress)
        key = (uri, expected_sha256)
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:  # the first load of a source checks it; the others wait for that copy
            checked = self._checked.get(key)
            if checked is None:
                checked = resolve_source(uri, expected_sha256, replace(policy, cache_dir=self.dir), None, progress)
                self._checked[key] = checked
        return replace(checked, owned=False, downloaded=False)


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
        self.sources = SharedSources()
        self.sources.install()
        engine_config = EngineConfig(
            model_dir=spec.model_dir,
            topology=Topology(spec.tp, spec.dp),
            max_lora_rank=spec.max_lora_rank,
            max_loaded_loras=spec.max_loaded_loras,
        )
        try:
            for index in range(count):
                agent = Agent(
                    SimulatedEngine(engine_config, fails_loads=index < failing),
                    AgentConfig(
                        base_model_name=spec.base_model_name,
                        agent_id=f"sim-{index}",
                        sources=SourcePolicy(adapter_roots=(spec.adapter_root,)),
                    ),
                )
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
        self.sources.close()


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
