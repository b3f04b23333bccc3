"""Helpers for end-to-end tests: adapters on disk, agent pods, and direct gRPC checks of what
the agents hold (the registries are the truth the operator's status must equal)."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from lorafleet.v1 import agent_pb2, agent_pb2_grpc
from lorafleet_dev.agents import AgentProcess, AgentSpec
from lorafleet_dev.synthetic import ADAPTER_WEIGHTS, SyntheticModel, write_adapter, write_model
from tests.kube.harness import ControlPlane

SHAPE = SyntheticModel()
BASE_MODEL = "tiny-llama"
FLEET_LABEL = "lorafleet.dev/fleet"


def agent_spec(root: Path, **settings: Any) -> tuple[AgentSpec, Path]:
    """The tiny model under `root`, an empty adapter root beside it, and an agent spec serving
    them (with `settings` of AgentSpec); returns the spec and the adapter root."""
    adapters = root / "adapters"
    adapters.mkdir()
    spec = AgentSpec(model_dir=write_model(root / "model", SHAPE), adapter_roots=(adapters,), base_model_name=BASE_MODEL, **settings)
    return spec, adapters


@contextlib.contextmanager
def agent_pair(root: Path, **settings: Any) -> Iterator[tuple[list[AgentProcess], Path]]:
    """Two agents (agent-0, agent-1) of one spec (`agent_spec`), serving; and their adapter root."""
    spec, adapters = agent_spec(root, **settings)
    agents = [AgentProcess("agent-0", spec, root / "logs"), AgentProcess("agent-1", spec, root / "logs")]
    with serving(agents):
        yield agents, adapters


@contextlib.contextmanager
def serving(agents: Sequence[AgentProcess]) -> Iterator[None]:
    """Start these agents, wait until every one serves, and stop them all on the way out."""
    for agent in agents:
        agent.start()
    try:
        for agent in agents:
            agent.wait_ready()
        yield
    finally:
        for agent in agents:
            agent.stop()


def make_adapter(root: Path, name: str, *, rank: int = 4, seed: int = 0) -> Path:
    return write_adapter(root / name, SHAPE, rank=rank, seed=seed)


def corrupt_adapter(root: Path, name: str) -> Path:
    """A PEFT directory whose weights file is not safetensors at all."""
    path = make_adapter(root, name)
    (path / ADAPTER_WEIGHTS).write_bytes(b"\x00garbage, not safetensors" * 8)
    return path


def adapter_manifest(name: str, path: Path, *, fleet: str = "default", base_model: str = BASE_MODEL) -> dict[str, Any]:
    return {
        "apiVersion": "lorafleet.dev/v1alpha1",
        "kind": "LoraAdapter",
        "metadata": {"name": name},
        "spec": {"baseModel": base_model, "source": {"uri": f"file://{path}"}, "fleetRef": {"name": fleet}},
    }


def fleet_manifest(name: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "lorafleet.dev/v1alpha1",
        "kind": "LoraFleet",
        "metadata": {"name": name},
        "spec": {"selector": {"matchLabels": {FLEET_LABEL: name}}, "grpcPortName": "grpc"},
    }


def apply(cluster: ControlPlane, ns: str, *objects: dict[str, Any]) -> None:
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}), ns)


def add_agent_pod(cluster: ControlPlane, ns: str, agent: AgentProcess, *, ready: bool = True, fleet: str = "default") -> None:
    cluster.create_agent_pod(ns, agent.name, agent.port, labels={FLEET_LABEL: fleet}, ready=ready)


def stub(agent: AgentProcess) -> tuple[grpc.Channel, agent_pb2_grpc.NodeAgentStub]:
    channel = grpc.insecure_channel(agent.endpoint)
    return channel, agent_pb2_grpc.NodeAgentStub(channel)


def registry(agent: AgentProcess, ns: str | None = None) -> dict[str, list[int]]:
    """The agent's registry (name -> ranks), optionally only this namespace's managed names."""
    channel, agent_stub = stub(agent)
    with channel:
        reply = agent_stub.ListAdapters(agent_pb2.ListAdaptersRequest(), timeout=10)
    names = [a.name for a in reply.adapters]
    assert len(names) == len(set(names)), f"duplicate registry entries: {names}"
    return {a.name: list(a.ranks) for a in reply.adapters if ns is None or a.name.startswith(f"{ns}.")}


def generate(agent: AgentProcess, adapter: str, tokens: list[int], n: int = 4) -> list[int]:
    """Greedy tokens from the agent with ``adapter`` (raises grpc.RpcError if not routable)."""
    channel, agent_stub = stub(agent)
    with channel:
        replies = agent_stub.Generate(agent_pb2.GenerateRequest(token_ids=tokens, adapter=adapter, max_new_tokens=n), timeout=30)
        return [r.token_id for r in replies]


def status(cluster: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    obj = cluster.kubectl_json("get", "la", name, "-n", ns)
    return dict(obj.get("status") or {})


def phase(cluster: ControlPlane, ns: str, name: str) -> str:
    return str(status(cluster, ns, name).get("phase", ""))


def phases(cluster: ControlPlane, ns: str) -> dict[str, str]:
    items = cluster.kubectl_json("get", "la", "-n", ns)["items"]
    return {i["metadata"]["name"]: (i.get("status") or {}).get("phase", "") for i in items}


class Source(http.server.ThreadingHTTPServer):
    """An adapter's files over HTTP on loopback (any path ending in a file name of ``root``);
    answers 503 to everything while ``failing``. Counts every request (``hits``, ``paths``).
    A request whose path starts with ``/hold/`` answers nothing until ``release`` is set (at
    most 120 s), counted in ``holding`` meanwhile; then 503 (a black-holed download) or, with
    ``serve_after_release``, the file (a slow source: set ``release`` to let requests through,
    clear it to hold them)."""

    daemon_threads = True

    def __init__(self, root: Path, *, failing: bool = True, serve_after_release: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), _SourceHandler)
        self.root = root
        self.failing = failing
        self.serve_after_release = serve_after_release
        self.hits = 0
        self.paths: list[str] = []
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.holding = 0

    def url(self, path: str = "adapter") -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{path}"


class _SourceHandler(http.server.BaseHTTPRequestHandler):
    server: Source

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        with self.server.lock:
            self.server.hits += 1
            self.server.paths.append(self.path)
        if self.path.startswith("/hold/"):
            with self.server.lock:
                self.server.holding += 1
            try:
                self.server.release.wait(120)
            finally:
                with self.server.lock:
                    self.server.holding -= 1
            if not self.server.serve_after_release:
                self.send_error(503)
                return
        path = self.server.root / self.path.rpartition("/")[2]
        if self.server.failing or not path.is_file():
            self.send_error(503 if self.server.failing else 404)
            return
        data = path.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
