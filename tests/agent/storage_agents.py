"""An agent of its own for the storage-source tests (s3://, oci://): tp=2 over real rank
processes behind a real gRPC server on loopback, with the source policy the test module
chooses (the shared agent's is fixed), and the per-rank truth of a load."""

from __future__ import annotations

import hashlib
import http.server
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from lorafleet_dev.storage_servers import RegistryServer
from node_agent.agent import Agent, AgentConfig
from node_agent.engine import EngineConfig, Topology
from node_agent.server import ServerOptions, create_server
from node_agent.sources import ADAPTER_CONFIG, ADAPTER_WEIGHTS, SourcePolicy
from tests.agent.helpers import make_model, start_agent


@dataclass
class ServedAgent:
    agent: Agent
    stub: agent_pb2_grpc.NodeAgentStub


@contextmanager
def served_agent(base: Path, sources: SourcePolicy) -> Iterator[ServedAgent]:
    """An agent (two tensor-parallel ranks) over a tiny model, serving gRPC on 127.0.0.1."""
    engine_config = EngineConfig(model_dir=make_model(base / "model"), topology=Topology(2, 1), max_loras_per_batch=2, max_loaded_loras=4)
    agent, _ = start_agent(engine_config, AgentConfig(agent_id="storage-agent", sources=sources))
    server = create_server(agent, ServerOptions(listen="127.0.0.1:0"))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield ServedAgent(agent, agent_pb2_grpc.NodeAgentStub(channel))
    finally:
        channel.close()
        server.stop(grace=0)
        agent.close()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_every_rank_read(reply: pb.LoadAdapterResponse, adapter: Path) -> None:
    """The load succeeded, and every rank read exactly the bytes of `adapter`'s two files."""
    assert reply.success, reply.error_message
    expected = (file_sha256(adapter / ADAPTER_WEIGHTS), file_sha256(adapter / ADAPTER_CONFIG))
    assert len(reply.rank_results) == 2
    assert [(r.success, r.weights_sha256, r.config_sha256) for r in reply.rank_results] == [(True, *expected)] * 2


def held(stub: agent_pb2_grpc.NodeAgentStub) -> dict[str, str]:
    """The agent's adapters: name -> sha256 of the weights it loaded."""
    return {info.name: info.sha256 for info in stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters}


def registry_answer(registry: RegistryServer, handler: http.server.BaseHTTPRequestHandler) -> tuple[bytes, str] | None:
    """The registry's answer to the GET `handler` received (its body and Content-Type), for a
    loopback proxy in front of it; None once the registry's error status is sent on instead."""
    request = urllib.request.Request(f"http://{registry.address}{handler.path}", headers={"Accept": handler.headers.get("Accept", "*/*")})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.read(), answer.headers.get("Content-Type", "application/octet-stream")
    except urllib.error.HTTPError as error:
        handler.send_error(error.code)
        return None


def send_body(handler: http.server.BaseHTTPRequestHandler, body: bytes, kind: str) -> None:
    """A 200 answer with `body` of media type `kind`."""
    handler.send_response(200)
    handler.send_header("Content-Type", kind)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
