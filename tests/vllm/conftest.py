"""Real stock vLLM servers (the CPU build `scripts/build-vllm.sh` installs) and an agent over
them (`--backend vllm`'s backend behind the real gRPC server), shared by a test module.

Two servers, one thread each, serve a tiny fp32 Llama without a tokenizer. Server 0 takes
adapters up to rank 16 (the agent's --max-lora-rank), server 1 only up to rank 8: a rank-16
adapter passes the agent's validation and is then refused by server 1 alone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from lorafleet.v1 import agent_pb2_grpc
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
STARTUP_TIMEOUT_S = 600


def vllm_python() -> str:
    """The vLLM environment's python (installed by scripts/test.sh; skips if it is not)."""
    found = subprocess.run(
        ["bash", str(REPO / "scripts/build-vllm.sh"), "--print-python", "--no-build"], capture_output=True, text=True, check=False
    )
    if found.returncode != 0:
        pytest.skip("stock vLLM is not installed (scripts/build-vllm.sh)")
    return found.stdout.strip()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class VllmProcess:
    """One vLLM OpenAI server process (its own process group: the engine core and worker too)."""

    python: str
    model: Path
    port: int
    max_lora_rank: int
    core: int
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core % (os.cpu_count() or 1)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        }
        command = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", "256", "--skip-tokenizer-init",
            "--enable-lora", "--max-loras", str(MAX_LORAS), "--max-lora-rank", str(self.max_lora_rank),
            "--max-cpu-loras", str(MAX_LOADED), "--kv-cache-memory-bytes", str(64 << 20),
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None and self.process.poll() is None, f"vLLM exited; see {self.log}"
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"vLLM did not start in {STARTUP_TIMEOUT_S} s; see {self.log}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None


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
    python = vllm_python()
    base = tmp_path_factory.mktemp("vllm")
    model = make_tiny_model(base / "tiny-llama", head_dim=32)  # vLLM's CPU attention has no head_dim 16
    root = base / "adapters"
    root.mkdir()
    servers = [
        VllmProcess(python, model, free_port(), max_rank, core, base / f"vllm-{core}.log") for core, max_rank in enumerate(SERVER_MAX_RANKS)
    ]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
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
