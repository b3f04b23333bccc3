"""The fleet-scale benchmark's simulated agents (lorafleet_dev.simagents): the real Agent over
simulated ranks answers loads, unloads and listings with every rank's holdings in public names,
merges failures first and rolls a partial load back, while a source is checked and copied once
for all agents instead of once per agent. In-process: the real Agent and registry, the real
source check (once); no cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet_dev.simagents import SharedSources, SimulatedBackend
from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from node_agent.agent import Agent, AgentConfig
from node_agent.engine import EngineConfig, Topology
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
    try:
        yield sources
    finally:
        sources.close()


def _agent(root: Path, shared: SharedSources, *, failing: bool = False) -> Agent:
    """The real agent over simulated ranks, as the simulator serves it."""
    config = EngineConfig(model_dir=root / "model", topology=Topology(8, 2), max_lora_rank=16, max_loaded_loras=64)
    policy = SourcePolicy(adapter_roots=(root / "adapters",))
    return Agent(
        SimulatedBackend(config, fails_loads=failing),
        AgentConfig(base_model_name="tiny", agent_id="sim", sources=policy),
        resolve=shared.resolve,
    )


def _uri(root: Path, i: int) -> str:
    return f"file://{root / 'adapters' / f'a{i}'}"


def test_replies_list_every_ranks_holdings_in_public_names(fleet_dir: Path, shared: SharedSources) -> None:
    agent = _agent(fleet_dir, shared)
    try:
        assert agent.load("ns.a0", _uri(fleet_dir, 0)).ok and agent.load("ns.a1", _uri(fleet_dir, 1)).ok
        replaced = agent.load("ns.a0", _uri(fleet_dir, 2), replace_existing=True)
        # Both versions of ns.a0 were held when the reply was made: one public name.
        assert replaced.ok and replaced.holds == ("ns.a0", "ns.a1")
        assert [r.holds for r in replaced.ranks] == [("ns.a0", "ns.a1")] * 8
        unloaded = agent.unload("ns.a1")
        assert unloaded.ok and [r.holds for r in unloaded.ranks] == [("ns.a0",)] * 8
        assert [(e.name, e.ranks) for e in agent.list_adapters()] == [("ns.a0", tuple(range(8)))]
    finally:
        agent.close()


def test_a_failing_agent_refuses_on_one_rank_and_rolls_the_others_back(fleet_dir: Path, shared: SharedSources) -> None:
    agent = _agent(fleet_dir, shared, failing=True)
    try:
        result = agent.load("ns.a0", _uri(fleet_dir, 0))
        assert not result.ok and "simulated load failure on rank 3" in result.error
        assert [r.ok for r in result.ranks] == [False] * 8 and all(r.holds == () for r in result.ranks)
        assert agent.list_adapters() == []
    finally:
        agent.close()


def test_a_source_is_checked_and_copied_once_for_every_agent(fleet_dir: Path, shared: SharedSources) -> None:
    agents = [_agent(fleet_dir, shared) for _ in range(4)]
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
