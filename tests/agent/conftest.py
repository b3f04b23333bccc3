"""One shared agent (tp=2, dp=2, real rank processes) behind a real gRPC server on loopback.

Tests that need their own engine (fault hook, a killed rank, a separate process) start it in
their own module. Every test leaves the shared agent as it found it: adapters it loaded are
unloaded afterwards (autouse `clean_registry`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from lorafleet.v1 import agent_pb2_grpc
from node_agent.agent import Agent, AgentConfig
from node_agent.engine import Engine, EngineConfig, Topology
from node_agent.server import AgentServer, ServerOptions, create_server
from node_agent.sources import SourcePolicy
from tests.agent.helpers import LOOPBACK_SOURCES, make_adapter, make_model, start_agent

SLOTS = 4


@dataclass
class Shared:
    agent: Agent
    server: AgentServer
    channel: grpc.Channel
    stub: agent_pb2_grpc.NodeAgentStub
    model: Path
    root: Path  # the adapter root
    cache: Path
    adapters: dict[str, Path]  # prepared adapters under `root`, by name
    engine: Engine  # the agent's engine, behind its backend


@pytest.fixture(scope="session")
def shared(tmp_path_factory) -> Iterator[Shared]:
    base = tmp_path_factory.mktemp("agent")
    model = make_model(base / "tiny-llama")
    root = base / "adapters"
    adapters = {f"ad{i}": make_adapter(root / f"ad{i}", seed=100 + i) for i in range(10)}
    cache = base / "cache"
    engine_config = EngineConfig(model_dir=model, topology=Topology(2, 2), max_loras_per_batch=SLOTS, max_loaded_loras=16)
    config = AgentConfig(agent_id="agent-under-test", sources=SourcePolicy(adapter_roots=(root,), cache_dir=cache, **LOOPBACK_SOURCES))
    agent, engine = start_agent(engine_config, config)
    server = create_server(agent, ServerOptions(listen="127.0.0.1:0", metrics_port=0))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Shared(agent, server, channel, agent_pb2_grpc.NodeAgentStub(channel), model, root, cache, adapters, engine)
    finally:
        channel.close()
        server.stop(grace=0)
        agent.close()


@pytest.fixture
def stub(shared: Shared) -> agent_pb2_grpc.NodeAgentStub:
    return shared.stub


@pytest.fixture(autouse=True)
def clean_registry(request) -> Iterator[None]:
    yield
    if "shared" in request.fixturenames:
        agent = request.getfixturevalue("shared").agent
        if agent.alive:
            for entry in agent.registry.entries():
                agent.unload(entry.name)
