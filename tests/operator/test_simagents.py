"""The fleet-scale benchmark's simulated agents (lorafleet_dev.simagents) answer as the real
agent does over the same simulated ranks: the same load, unload and listing replies (the
per-rank holdings in public names, failure-first merges, rollbacks), while a source is checked
and copied once for all agents instead of once per agent. In-process: the real Agent and
registry, the real source check (once); no cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet_dev.simagents import SharedSources, SimulatedAgent, SimulatedEngine
from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from node_agent.agent import Agent, AgentConfig
from node_agent.engine import ControlResult, EngineConfig
from node_agent.engine.topology import Topology
from node_agent.sources import SourcePolicy

SHAPE = SyntheticModel()


@pytest.fixture
def fleet_dir(tmp_path: Path) -> Path:
    write_model(tmp_path / "model", SHAPE)
    for i in range(3):
        write_adapter(tmp_path / "adapters" / f"a{i}", SHAPE, rank=8, seed=i)
    return tmp_path


@pytest.fixture
def shared(fleet_dir: Path) -> Iterator[SharedSources]:
    sources = SharedSources()
    sources.install()
    try:
        yield sources
    finally:
        sources.close()


def _agent(cls: type[Agent], root: Path, *, failing: bool = False) -> Agent:
    """An agent over simulated ranks: the real Agent, or the simulator's."""
    config = EngineConfig(model_dir=root / "model", topology=Topology(8, 2), max_lora_rank=16, max_loaded_loras=64)
    policy = SourcePolicy(adapter_roots=(root / "adapters",))
    return cls(SimulatedEngine(config, fails_loads=failing), AgentConfig(base_model_name="tiny", agent_id="sim",
                                                                        sources=policy))


def _reply(result: ControlResult) -> tuple[object, ...]:
    """What a LoadAdapter/UnloadAdapter reply carries, and each rank's holdings."""
    return (result.ok, result.error, result.holds, result.already_loaded,
            tuple((r.rank, r.ok, r.error, r.holds, r.digests) for r in result.ranks))


def _uri(root: Path, i: int) -> str:
    return f"file://{root / 'adapters' / f'a{i}'}"


def test_replies_are_the_real_agents(fleet_dir: Path, shared: SharedSources) -> None:
    real = _agent(Agent, fleet_dir)
    sim = _agent(SimulatedAgent, fleet_dir)
    try:
        steps = [("load", "ns.a0", 0), ("load", "ns.a1", 1), ("load", "ns.a0", 0), ("load", "ns.a0", 2),
                 ("unload", "ns.a1", 0), ("load", "ns.a2", 2)]
        for what, name, source in steps:
            if what == "load":
                answers = [agent.load(name, _uri(fleet_dir, source), replace_existing=True) for agent in (real, sim)]
            else:
                answers = [agent.unload(name) for agent in (real, sim)]
            assert _reply(answers[1]) == _reply(answers[0]), (what, name)
        assert sim.list_adapters() == real.list_adapters()
        assert [e.name for e in sim.list_adapters()] == ["ns.a0", "ns.a2"]
    finally:
        real.close()
        sim.close()


def test_a_failing_agents_refusal_is_the_real_agents(fleet_dir: Path, shared: SharedSources) -> None:
    real = _agent(Agent, fleet_dir, failing=True)
    sim = _agent(SimulatedAgent, fleet_dir, failing=True)
    try:
        answers = [agent.load("ns.a0", _uri(fleet_dir, 0)) for agent in (real, sim)]
        assert not answers[1].ok and "simulated load failure on rank 3" in answers[1].error
        assert _reply(answers[1]) == _reply(answers[0])
        assert sim.list_adapters() == real.list_adapters() == []
    finally:
        real.close()
        sim.close()


def test_a_source_is_checked_and_copied_once_for_every_agent(fleet_dir: Path, shared: SharedSources) -> None:
    agents = [_agent(SimulatedAgent, fleet_dir) for _ in range(4)]
    try:
        for agent in agents:
            assert agent.load("ns.a0", _uri(fleet_dir, 0)).ok
        copies = list(shared.dir.iterdir())
        assert len(copies) == 1
        held = {entry.source.path for agent in agents for entry in agent.registry.entries()}
        assert held == {copies[0]}
        for agent in agents:
            assert agent.unload("ns.a0").ok
        assert (copies[0] / "adapter_model.safetensors").exists()  # none of them owns it
    finally:
        for agent in agents:
            agent.close()
