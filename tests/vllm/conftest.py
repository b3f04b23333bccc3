"""Real stock vLLM servers (the CPU build `scripts/build-vllm.sh` installs) and an agent over
them (`--backend vllm`'s backend behind the real gRPC server), shared by a test module.

Two servers, one thread each, serve a tiny fp32 Llama without a tokenizer. Server 0 takes
adapters up to rank 16 (the agent's --max-lora-rank), server 1 only up to rank 8: a rank-16
adapter passes the agent's validation and is then refused by server 1 alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from lorafleet.v1 import agent_pb2_grpc
from lorafleet_dev.vllm_servers import VllmProcess, VllmSettings, start_vllm_servers, vllm_python
from node_agent.agent import Agent, AgentConfig
from node_agent.backend import Capacity
from node_agent.backends.vllm import vllm_backend
from node_agent.server import AgentServer, ServerOptions, create_server
from node_agent.sources import SourcePolicy
from tests.support.models import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
#: The servers' --max-lora-rank, rank order; the agent's is the first.
SERVER_MAX_RANKS = (16, 8)
MAX_LORAS = 2
MAX_LOADED = 4


def installed_vllm_python() -> str:
    """The vLLM environment's python (installed by scripts/test.sh; skips if it is not)."""
    python = vllm_python(REPO)
    if python is None:
        pytest.skip("stock vLLM is not installed (scripts/build-vllm.sh)")
    return python


def tiny_vllm_model(base: Path) -> Path:
    """The tiny Llama the servers serve: head_dim 32, as vLLM's CPU attention has no head_dim 16."""
    return make_tiny_model(base / "tiny-llama", head_dim=32)


@dataclass
class Fleet:
    """The agent, its gRPC stub, the servers it drives, the model and where adapters live."""

    agent: Agent
    server: AgentServer
    stub: agent_pb2_grpc.NodeAgentStub
    servers: list[VllmProcess]
    model: Path
    root: Path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    python = installed_vllm_python()
    base = tmp_path_factory.mktemp("vllm")
    model = tiny_vllm_model(base)
    root = base / "adapters"
    root.mkdir()
    servers = [
        VllmProcess(f"vllm-{core}", VllmSettings(python, model, max_rank, MAX_LORAS, MAX_LOADED), core, base)
        for core, max_rank in enumerate(SERVER_MAX_RANKS)
    ]
    start_vllm_servers(servers)
    try:
        backend = vllm_backend([s.url for s in servers], model, Capacity(SERVER_MAX_RANKS[0], MAX_LORAS, MAX_LOADED))
        config = AgentConfig(agent_id="vllm-agent", sources=SourcePolicy(adapter_roots=(root,), cache_dir=base / "cache"))
        agent = Agent(backend, config)
        server = create_server(agent, ServerOptions(listen="127.0.0.1:0"))
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            yield Fleet(agent, server, agent_pb2_grpc.NodeAgentStub(channel), servers, model, root)
        finally:
            channel.close()
            server.stop(grace=0)
            agent.close()
    finally:
        for server in servers:
            server.kill()
