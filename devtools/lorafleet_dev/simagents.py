"""Simulated node agents, for the fleet-scale benchmark only (benchmarks/bench_fleet_scale.py).

What this is, and is not: one process serving many gRPC endpoints. Each endpoint is the real
``lorafleet.v1.NodeAgent`` server (``node_agent.server``) over the real :class:`Agent` (its
registry, sources, validation, locks and metrics), so every call is checked, serialised per name,
recorded in the registry and answered exactly as by a real agent. What is simulated or cut:

* The backend. The agent drives a :class:`SimulatedBackend` through the seam every backend
  implements (``node_agent.backend.Backend``): no engine, no rank processes, no model weights,
  no LoRA buffers. A simulated rank answers loads and unloads the way a real rank's pool does
  (capacity, duplicates, unknown names) and reports the buffer shapes the sharding rule gives it
  (``dense_module_shapes``). A failing agent refuses every load on one rank, so the operator sees
  a per-rank failure exactly as from a real engine: the ranks' replies are merged failure-first
  and a partial load is rolled back by the seam's ``all_or_nothing``, the function the engine's
  driver uses, under one lock per agent as the driver's. The adapter's files are not parsed or
  verified (no rank reads them). Every reply lists all its rank holds, as a real rank's does;
  ranks that held the same before a load share one tuple after it, made once per load instead
  of once per rank (each up to a thousand names): the simulator shares the machine with the
  operator it measures, so its own CPU per load stays small.
* Sources are read once per process, not once per agent (:class:`SharedSources`, each agent's
  source resolver): the first load of a (URI, sha256) runs the real source check (roots, size
  caps, no pickle, the private copy and its digests) and every simulated agent then loads that
  one checked copy, which none of them removes (it goes when the fleet stops). A real agent
  copies and hashes every source it loads and removes the copy on unload: 64,000 copies at
  1,000 adapters x 64 agents, CPU the simulator would take from the operator it measures. A
  source that changes after its first load is not seen (the benchmark's never change).
* Generate and Forward are refused (``Unsupported``), as is any serving: no scheduler runs.

Nothing else uses it: tests and the demo run real agents (``lorafleet_dev.agents``).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from node_agent.agent import Agent, AgentConfig
from node_agent.backend import (
    AdapterRefused,
    AdapterRequests,
    BackendDescription,
    BackendError,
    Capabilities,
    ControlReply,
    ControlResult,
    FileDigests,
    Health,
    LoadFailed,
    LoadRequest,
    RankHoldings,
    RankPlace,
    Sampling,
    SequenceInput,
    ServingStats,
    TokenStream,
    UnloadFailed,
    Unsupported,
    all_or_nothing,
    already_loaded,
    merge_control,
)
from node_agent.engine import EngineConfig, Topology, dense_module_shapes, engine_description, rank_places
from node_agent.server import AgentServer, ServerOptions, create_server
from node_agent.sources import Credential, DownloadProgress, ResolvedSource, SourcePolicy, resolve_source

log = logging.getLogger(__name__)

#: The rank of a failing agent that refuses every load.
FAILING_RANK = 3
KIND = "lorafleet-simulated"

#: One load's holdings after it, by the tuple held before it: id -> (before, after). Keeping
#: `before` keeps its id unique for the load; ranks that held the same share one `after`, made
#: once per load instead of once per rank (up to a thousand names, eight ranks).
Grown = dict[int, tuple[tuple[str, ...], tuple[str, ...]]]


@dataclass
class SimulatedRank:
    """One rank's pool as far as loads go: the adapters it holds, in load order."""

    place: RankPlace
    max_loaded: int
    fails_loads: bool
    #: Held names in load order (a dict: membership in O(1) with a thousand held).
    held: dict[str, None] = field(default_factory=dict)
    #: `held` as every reply reports it, made again only when it changes.
    holds: tuple[str, ...] = ()

    def load(self, name: str, digests: FileDigests | None, grown: Grown) -> ControlReply:
        """A real rank's reply to a load of `name` whose files the caller verified as `digests`
        (a real rank reports the digests it read). `grown`: this load's holdings made so far,
        shared by the ranks that held the same tuple before it."""
        error = self._load_error(name)
        if not error:
            self.held[name] = None
            made = grown.get(id(self.holds))
            if made is None or made[0] is not self.holds:
                made = grown[id(self.holds)] = (self.holds, (*self.holds, name))
            self.holds = made[1]
        return self._reply(error, digests=None if error else digests)

    def unload(self, name: str) -> ControlReply:
        """A real rank's reply to an unload (the driver's, or its rollback's)."""
        if name not in self.held:
            return self._reply(f"adapter {name!r} is not loaded")
        del self.held[name]
        self.holds = tuple(self.held)
        return self._reply("")

    def _reply(self, error: str, digests: FileDigests | None = None) -> ControlReply:
        place = self.place
        return ControlReply(place.rank, place.attn_dp_rank, place.attn_tp_rank, not error, error, holds=self.holds, digests=digests)

    def _load_error(self, name: str) -> str:
        if self.fails_loads and self.place.rank == FAILING_RANK:
            return f"simulated load failure on rank {self.place.rank}"
        if name in self.held:
            return f"adapter {name!r} is already loaded"
        if len(self.held) >= self.max_loaded:
            return f"max_loaded_loras ({self.max_loaded}) reached; unload an adapter first"
        return ""


class SimulatedBackend:
    """Ranks in this process behind the agent's seam (see the module docstring): loads, unloads
    and listings with every rank's reply; no serving."""

    def __init__(self, config: EngineConfig, fails_loads: bool = False) -> None:
        places = rank_places(config.topology)
        self._ranks = [SimulatedRank(place, config.max_loaded_loras, fails_loads) for place in places]
        self._loaded: set[str] = set()
        self._lock = threading.Lock()  # one command at a time, as the driver's command lock
        self._closed = False
        shapes = (dense_module_shapes(config.model_dir, config.topology, config.max_lora_rank, place.rank) for place in places)
        # What the engine would describe itself as, as a backend that serves nothing.
        description = engine_description(config, tuple(module for rank in shapes for module in rank))
        self._description = replace(description, kind=KIND, capabilities=Capabilities(forward=False, generate=False))

    def describe(self) -> BackendDescription:
        return self._description

    def load(self, request: LoadRequest) -> ControlResult:
        """Every rank's reply merged failure-first; a partial load rolled back (``all_or_nothing``)."""
        name = request.name
        with self._lock:
            if name in self._loaded:
                raise AdapterRefused(f"adapter {name!r} is already loaded")
            grown: Grown = {}
            result = all_or_nothing(
                lambda: [rank.load(name, request.expected, grown) for rank in self._ranks],
                lambda: [rank.unload(name) for rank in self._ranks],
            )
            if not result.ok:
                raise LoadFailed(result)
            self._loaded.add(name)
            return result

    def unload(self, name: str) -> ControlResult:
        with self._lock:
            if name not in self._loaded:
                raise BackendError(f"adapter {name!r} is not loaded")
            result = merge_control([rank.unload(name) for rank in self._ranks])
            self._loaded.discard(name)
        if not result.ok:
            raise UnloadFailed(result)
        return result

    def holding(self, name: str) -> ControlResult:
        with self._lock:
            return already_loaded(name, [(rank.place, rank.holds) for rank in self._ranks])

    def holdings(self) -> list[RankHoldings]:
        with self._lock:
            return [RankHoldings(rank.place.rank, rank.holds) for rank in self._ranks]

    def forward(self, sequences: Sequence[SequenceInput]) -> list[np.ndarray]:
        raise Unsupported("the simulated agents serve no Forward")

    def generate(self, tokens: Sequence[int], adapter: str | None, sampling: Sampling) -> TokenStream:
        raise Unsupported("the simulated agents serve no Generate")

    @property
    def alive(self) -> bool:
        return not self._closed

    def health(self) -> Health:
        alive = not self._closed
        return Health(alive, "" if alive else "closed", None, (alive,) * len(self._ranks))

    def serving_stats(self) -> ServingStats:
        return ServingStats(0, 0, 0, (), 0, 0, frozenset(), frozenset())

    def adapter_requests(self) -> tuple[AdapterRequests, ...]:
        return ()  # the simulated agents serve no requests

    def close(self) -> None:
        self._closed = True


class SharedSources:
    """Every simulated agent's source resolver (``Agent(resolve=...)``), made once per (URI,
    sha256) for the whole process (the module docstring says why and what that leaves out);
    ``close`` removes the checked copies."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="lorafleet-simagents-"))
        self._checked: dict[tuple[str, str | None], ResolvedSource] = {}
        self._locks: dict[tuple[str, str | None], threading.Lock] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def resolve(
        self,
        uri: str,
        expected_sha256: str | None,
        policy: SourcePolicy,
        credential: Credential | None,
        progress: DownloadProgress | None,
        revision: str = "",
    ) -> ResolvedSource:
        """The agent's ``resolve_source``: the real check on the first load of (``uri``,
        ``expected_sha256``), which the agents then share (a copy none of them owns). A load
        with a credential or a revision is checked on its own, as by a real agent (file:// refuses
        a credential)."""
        if credential is not None or revision:
            return resolve_source(uri, expected_sha256, policy, credential, progress, revision)
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
        engine_config = EngineConfig(
            model_dir=spec.model_dir,
            topology=Topology(spec.tp, spec.dp),
            max_lora_rank=spec.max_lora_rank,
            max_loaded_loras=spec.max_loaded_loras,
        )
        try:
            for index in range(count):
                agent = Agent(
                    SimulatedBackend(engine_config, fails_loads=index < failing),
                    AgentConfig(
                        base_model_name=spec.base_model_name,
                        agent_id=f"sim-{index}",
                        sources=SourcePolicy(adapter_roots=(spec.adapter_root,)),
                    ),
                    resolve=self.sources.resolve,
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
