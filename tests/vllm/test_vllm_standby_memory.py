"""Standby snapshots in host memory with `--backend vllm`: a real stock vLLM server (the CPU
build) loads a standby adapter on its first request from the agent's memory copy, the path the
agent gives it (`lora_path`), once the agent's disk copy is deleted."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from lorafleet_dev.vllm_servers import VllmProcess, VllmSettings, start_vllm_servers
from node_agent.agent import Agent, AgentConfig
from node_agent.backend import Capacity
from node_agent.backends.vllm import vllm_backend
from node_agent.residency import OnDemandSettings
from node_agent.server import ServerOptions, create_server
from node_agent.sources import SourcePolicy
from node_agent.standby_memory import MIB, StandbyMemorySettings
from tests.support.models import make_adapter
from tests.vllm.conftest import MAX_LOADED, MAX_LORAS, installed_vllm_python, tiny_vllm_model

PROMPT = [5, 17, 42, 7]
MAX_RANK = 16


@dataclass
class MemoryFleet:
    agent: Agent
    stub: agent_pb2_grpc.NodeAgentStub
    server: VllmProcess
    model: Path
    base: Path

    def load(self, name: str, adapter: Path, **fields: bool) -> None:
        reply = self.stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source_uri=adapter.as_uri(), **fields), timeout=180)
        assert reply.success, reply.error_message

    def generate(self, adapter: str) -> list[int]:
        return [
            t.token_id for t in self.stub.Generate(pb.GenerateRequest(token_ids=PROMPT, adapter=adapter, max_new_tokens=6), timeout=180)
        ]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MemoryFleet]:
    """One vLLM server driven by an agent whose standby snapshots go to host memory too."""
    python = installed_vllm_python()
    base = tmp_path_factory.mktemp("vllm-memory")
    model = tiny_vllm_model(base)
    server = VllmProcess("vllm-memory", VllmSettings(python, model, MAX_RANK, MAX_LORAS, MAX_LOADED), 0, base)
    start_vllm_servers([server])
    try:
        config = AgentConfig(
            sources=SourcePolicy(adapter_roots=(base,), cache_dir=base / "cache"),
            on_demand=OnDemandSettings(memory=StandbyMemorySettings(64 * MIB, base / "memory")),
        )
        agent = Agent(vllm_backend([server.url], model, Capacity(MAX_RANK, MAX_LORAS, MAX_LOADED)), config)
        grpc_server = create_server(agent, ServerOptions(listen="127.0.0.1:0"))
        grpc_server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}")
        try:
            yield MemoryFleet(agent, agent_pb2_grpc.NodeAgentStub(channel), server, model, base)
        finally:
            channel.close()
            grpc_server.stop(grace=0)
            agent.close()
    finally:
        server.kill()


def test_vllm_loads_a_standby_adapter_from_the_agents_memory_copy(fleet: MemoryFleet) -> None:
    adapter = make_adapter(fleet.model, fleet.base / "adapters" / "a", seed=11, r=8)
    fleet.load("reference", adapter)
    expected = fleet.generate("reference")
    fleet.agent.unload("reference")
    fleet.load("sb", adapter, standby=True)
    (copy,) = sorted((fleet.base / "memory").glob("mem-*"))
    shutil.rmtree(fleet.agent.registry.get("sb").source.path)  # the disk copy is gone: vLLM must read memory
    assert fleet.generate("sb") == expected
    (lora_path,) = fleet.server.adapters().values()
    assert Path(lora_path) == copy, "the server loaded the memory copy's path"
    fleet.agent.unload("sb")
    assert list((fleet.base / "memory").glob("mem-*")) == []
