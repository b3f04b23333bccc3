"""Standby snapshots in host memory (`node_agent.standby_memory`), on real agents (real rank
processes, two adapter places) behind a real gRPC server on loopback.

A standby load copies the snapshot into the memory directory; once the agent's disk copy is
deleted, the first request still loads it (from memory) and is answered. An adapter evicted back
to standby is copied in too; with a budget for one adapter only the most recently standby-ed
one is in memory, and every one still loads; unloads and replaces remove copies; a copy whose
bytes are not the verified ones is refused; copies of an earlier process are removed at start;
bad flags are usage errors. The memory directory here is a plain directory (the rule does not
depend on tmpfs)."""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from node_agent.agent import Agent, AgentConfig
from node_agent.cli import build_parser
from node_agent.cli.engine_flags import UsageError
from node_agent.cli.serve import agent_config
from node_agent.engine import EngineConfig, Topology
from node_agent.residency import OnDemandSettings
from node_agent.server import AgentServer, ServerOptions, create_server
from node_agent.sources import SourcePolicy
from node_agent.standby_memory import MIB, StandbyMemorySettings
from tests.agent.helpers import generate, make_adapter, make_model, rpc_error, start_agent, wait_until

PLACES = 2
PROMPT = [5, 6, 7, 8]
WEIGHTS = "adapter_model.safetensors"
ADAPTERS = 4


@dataclass
class Served:
    agent: Agent
    server: AgentServer
    stub: agent_pb2_grpc.NodeAgentStub
    root: Path
    memory_dir: Path

    def load(self, name: str, adapter: str, **fields: bool) -> None:
        reply = self.stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source_uri=(self.root / adapter).as_uri(), **fields), timeout=60)
        assert reply.success, reply.error_message

    def snapshot(self, name: str) -> Path:
        """The agent's private disk copy of `name`'s current version."""
        entry = self.agent.registry.get(name)
        assert entry is not None
        return entry.source.path

    def in_memory(self, name: str) -> bool:
        entry = self.agent.registry.get(name)
        return entry is not None and self.agent.on_demand.memory.holds(entry.source)

    def copies(self) -> list[Path]:
        """The copies in the memory directory."""
        return sorted(self.memory_dir.glob("mem-*"))

    def gauge(self, name: str) -> float | None:
        return self.agent.metrics.registry.get_sample_value(name)


def snapshot_bytes(adapter: Path) -> int:
    return sum((adapter / name).stat().st_size for name in (WEIGHTS, "adapter_config.json"))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def serve(base: Path, budget_bytes: int | None) -> Iterator[Served]:
    """An agent with two places whose memory tier holds `budget_bytes` (None: the size of one
    adapter and a half, so two never fit together)."""
    model = make_model(base / "model")
    root = base / "adapters"
    for i in range(ADAPTERS):
        make_adapter(root / f"ad{i}", seed=700 + i)
    memory_dir = base / "memory"
    memory_dir.mkdir()
    (memory_dir / "mem-left-by-an-earlier-agent").mkdir()
    budget = budget_bytes if budget_bytes is not None else snapshot_bytes(root / "ad0") * 3 // 2
    engine_config = EngineConfig(model_dir=model, topology=Topology(1), max_loras_per_batch=PLACES, max_loaded_loras=PLACES)
    config = AgentConfig(
        sources=SourcePolicy(adapter_roots=(root,)),
        on_demand=OnDemandSettings(deadline_s=120.0, memory=StandbyMemorySettings(budget, memory_dir)),
    )
    agent, _ = start_agent(engine_config, config)
    server = create_server(agent, ServerOptions(listen="127.0.0.1:0", metrics_port=0))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Served(agent, server, agent_pb2_grpc.NodeAgentStub(channel), root, memory_dir)
    finally:
        channel.close()
        server.stop(grace=0)
        agent.close()


@pytest.fixture(scope="module")
def roomy(tmp_path_factory) -> Iterator[Served]:
    yield from serve(tmp_path_factory.mktemp("roomy"), budget_bytes=64 * MIB)


@pytest.fixture(scope="module")
def tight(tmp_path_factory) -> Iterator[Served]:
    yield from serve(tmp_path_factory.mktemp("tight"), budget_bytes=None)


@pytest.fixture(autouse=True)
def empty_agents(request) -> Iterator[None]:
    yield
    for name in ("roomy", "tight"):
        if name in request.fixturenames:
            served: Served = request.getfixturevalue(name)
            for entry in served.agent.registry.entries():
                served.agent.unload(entry.name)


def test_the_first_request_loads_a_standby_adapter_from_memory_when_its_disk_copy_is_gone(roomy: Served) -> None:
    roomy.load("reference", "ad0")
    expected = generate(roomy.stub, PROMPT, "reference", 6)
    roomy.agent.unload("reference")
    roomy.load("sb", "ad0", standby=True)
    (copy,) = roomy.copies()
    assert sha256(copy / WEIGHTS) == sha256(roomy.root / "ad0" / WEIGHTS), "the copy holds the verified bytes"
    size = snapshot_bytes(roomy.root / "ad0")
    assert (roomy.gauge("lorafleet_agent_standby_memory_bytes"), roomy.gauge("lorafleet_agent_standby_memory_adapters")) == (size, 1)
    shutil.rmtree(roomy.snapshot("sb"))  # the disk copy is gone: only memory can serve the load
    assert generate(roomy.stub, PROMPT, "sb", 6) == expected
    assert not roomy.agent.registry.get("sb").standby
    assert roomy.copies() == [copy], "kept while the version it was loaded from is resident"


def test_an_adapter_evicted_back_to_standby_is_copied_into_memory(roomy: Served) -> None:
    roomy.load("a", "ad1")  # resident, loaded from disk: no copy
    expected = generate(roomy.stub, PROMPT, "a", 6)
    roomy.load("b", "ad2")
    assert roomy.copies() == []
    roomy.load("c", "ad3", standby=True)
    generate(roomy.stub, PROMPT, "c", 2)  # full: a, the least recently used, goes back to standby
    assert roomy.agent.registry.get("a").standby
    wait_until(lambda: roomy.in_memory("a"), what="a's copy in memory")
    shutil.rmtree(roomy.snapshot("a"))
    assert generate(roomy.stub, PROMPT, "a", 6) == expected, "loaded from memory (b evicted for it)"
    assert roomy.agent.registry.get("b").standby
    wait_until(lambda: roomy.in_memory("b"), what="b's copy in memory")


def test_an_adapter_a_standby_load_puts_back_on_standby_is_copied_into_memory(roomy: Served) -> None:
    roomy.load("d", "ad1")  # resident, loaded from disk: no copy
    expected = generate(roomy.stub, PROMPT, "d", 6)
    assert roomy.copies() == []
    roomy.load("d", "ad1", standby=True)  # the operator's scale-down: back on standby in place
    assert roomy.agent.registry.get("d").standby
    wait_until(lambda: roomy.in_memory("d"), what="d's copy in memory")
    shutil.rmtree(roomy.snapshot("d"))
    assert generate(roomy.stub, PROMPT, "d", 6) == expected, "loaded from memory"


def test_a_budget_for_one_adapter_keeps_the_most_recently_standby_ed_one(tight: Served) -> None:
    budget = tight.agent.on_demand.memory.settings.budget_bytes
    expected = {}
    for name, adapter in (("x", "ad0"), ("y", "ad1")):
        tight.load(name, adapter)
        expected[name] = generate(tight.stub, PROMPT, name, 6)
        tight.agent.unload(name)
    tight.load("x", "ad0", standby=True)
    assert tight.in_memory("x")
    tight.load("y", "ad1", standby=True)
    assert (tight.in_memory("x"), tight.in_memory("y")) == (False, True), "x left memory to make room for y"
    (copy,) = tight.copies()
    assert sha256(copy / WEIGHTS) == sha256(tight.root / "ad1" / WEIGHTS)
    assert tight.gauge("lorafleet_agent_standby_memory_bytes") <= budget
    shutil.rmtree(tight.snapshot("y"))
    assert generate(tight.stub, PROMPT, "y", 6) == expected["y"], "y from memory"
    assert generate(tight.stub, PROMPT, "x", 6) == expected["x"], "x from disk"


def test_unload_and_replace_remove_the_memory_copy(roomy: Served) -> None:
    roomy.load("gone", "ad0", standby=True)
    roomy.load("swapped", "ad1", standby=True)
    assert len(roomy.copies()) == 2
    roomy.agent.unload("gone")
    roomy.load("swapped", "ad2", standby=True, replace=True)
    (copy,) = roomy.copies()
    assert sha256(copy / WEIGHTS) == sha256(roomy.root / "ad2" / WEIGHTS), "only the replacing version's copy"
    roomy.agent.unload("swapped")
    assert roomy.copies() == []
    assert (roomy.gauge("lorafleet_agent_standby_memory_bytes"), roomy.gauge("lorafleet_agent_standby_memory_adapters")) == (0, 0)


def test_bytes_that_are_not_the_verified_ones_never_enter_memory(roomy: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="node_agent.standby_memory")
    roomy.load("changed", "ad1")
    roomy.load("other", "ad2")
    weights = roomy.snapshot("changed") / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")  # the disk copy changes after it was verified
    roomy.load("c", "ad3", standby=True)
    generate(roomy.stub, PROMPT, "c", 2)  # full: "changed", the least recently used, goes back to standby
    assert roomy.agent.registry.get("changed").standby
    wait_until(lambda: any("was not made" in r.getMessage() for r in caplog.records), what="the copy's refusal")
    assert not roomy.in_memory("changed") and len(roomy.copies()) == 1, "only c's copy"
    assert "the agent verified" in caplog.text
    error = rpc_error(lambda: generate(roomy.stub, PROMPT, "changed", 2))
    assert error.code() == grpc.StatusCode.UNAVAILABLE, "the disk copy, kept, is held to the verified digests as before"


def test_copies_of_an_earlier_agent_are_removed_at_start(tight: Served) -> None:
    assert tight.copies() == []


def test_the_memory_flags_become_the_settings_and_are_checked(tmp_path: Path) -> None:
    base = ["serve", "--model", "m"]
    off = agent_config(build_parser().parse_args(base)).on_demand.memory
    assert off == StandbyMemorySettings() and not off.enabled
    flags = ["--standby-memory-mib", "256", "--standby-memory-dir", str(tmp_path / "mem")]
    assert agent_config(build_parser().parse_args(base + flags)).on_demand.memory == StandbyMemorySettings(256 * MIB, tmp_path / "mem")
    with pytest.raises(UsageError, match=r"--standby-memory-mib must be 0 \(off\) or more"):
        agent_config(build_parser().parse_args([*base, "--standby-memory-mib", "-1"]))
    (tmp_path / "a-file").touch()
    with pytest.raises(UsageError, match=r"--standby-memory-dir .*a-file is not usable"):
        agent_config(build_parser().parse_args([*base, "--standby-memory-mib", "1", "--standby-memory-dir", str(tmp_path / "a-file")]))
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--standby-memory-mib", "lots"])
