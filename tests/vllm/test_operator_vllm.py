"""End to end over stock vLLM: the real operator (subprocess) and the real API server, with two
agents started as ``lorafleet-agent serve --backend vllm`` over three real vLLM servers.

agent-0 drives one server and holds at most one adapter (``--max-loaded-loras 1``); agent-1
drives two (two ranks) and holds up to four; placement prefers the less loaded agent, so an
adapter with one replica skips agent-0, the less loaded, only because it is full. The servers
and agents are shared by the module (a vLLM server starts in tens of seconds); each test has its
namespace and operator, and unloads what it loaded (the agents outlive the namespaces). Every
server listens on the machine's own address, as pods may not have loopback endpoints.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lorafleet_dev.agents import AgentProcess, AgentSpec, VllmBackend
from lorafleet_dev.node import machine_ip
from lorafleet_dev.vllm_servers import VllmProcess, VllmSettings, start_vllm_servers
from lorafleet_operator.fleet import AgentPod
from lorafleet_operator.resources import FleetSpec
from lorafleet_operator.routing import ADAPTER_LABEL, VLLM_HTTP_PORT_NAME, routed_pods
from lorafleet_operator.status import AgentResult, AgentState
from tests.kube.harness import ControlPlane
from tests.operator.agents import FLEET_LABEL, adapter_manifest, apply, fleet_manifest, phase, status
from tests.operator.conftest import OperatorProcess, start_operator, wait_for
from tests.support.models import make_adapter
from tests.vllm.conftest import installed_vllm_python, tiny_vllm_model

BASE_MODEL = "tiny-llama"


def test_a_vllm_backed_pod_is_routed_to_vllms_own_port() -> None:
    """The slices list a vLLM-backed pod's ``vllm-http`` port beside its gRPC port."""
    pod = AgentPod("a", "ns", "u", {}, True, "10.0.0.1:50051", 0, "10.0.0.1", (("grpc", 50051), (VLLM_HTTP_PORT_NAME, 8000)))
    (routed,) = routed_pods(FleetSpec(), [pod], [AgentResult("a", AgentState.LOADED, 2, 2)])
    assert routed.ports == (("grpc", 50051), ("vllm-http", 8000))


@dataclass(frozen=True)
class VllmAgent:
    """One agent and the servers it drives (rank order)."""

    process: AgentProcess
    servers: tuple[VllmProcess, ...]


@dataclass(frozen=True)
class VllmFleet:
    """The module's agents, the model their servers serve and where adapters live."""

    agents: tuple[VllmAgent, ...]
    model: Path
    adapters: Path

    @property
    def servers(self) -> list[VllmProcess]:
        return [server for agent in self.agents for server in agent.servers]


def _agent(name: str, servers: list[VllmProcess], max_loaded: int, model: Path, root: Path) -> VllmAgent:
    vllm = VllmBackend(tuple(s.url for s in servers), root / f"cache-{name}", max_loras_per_batch=1)
    spec = AgentSpec(
        model_dir=model,
        adapter_roots=(root / "adapters",),
        base_model_name=BASE_MODEL,
        max_loaded_loras=max_loaded,
        host=machine_ip(),
        vllm=vllm,
    )
    return VllmAgent(AgentProcess(name, spec, root / "logs"), tuple(servers))


@pytest.fixture(scope="module")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    python = installed_vllm_python()
    root = tmp_path_factory.mktemp("vllm-operator")
    model = tiny_vllm_model(root)
    (root / "adapters").mkdir()
    host = machine_ip()
    # Each server's capacity is its agent's: agent-0 one adapter, agent-1 four.
    small = VllmSettings(python, model, max_loras=1, max_cpu_loras=1, host=host)
    large = VllmSettings(python, model, max_loras=1, max_cpu_loras=4, host=host)
    servers = [VllmProcess(f"vllm-{i}", settings, i, root / "logs") for i, settings in enumerate((small, large, large))]
    start_vllm_servers(servers)
    agents = (_agent("agent-0", servers[:1], 1, model, root), _agent("agent-1", servers[1:], 4, model, root))
    try:
        for agent in agents:
            agent.process.start()
        for agent in agents:
            agent.process.wait_ready(300)
        yield VllmFleet(agents, model, root / "adapters")
    finally:
        for agent in agents:
            agent.process.stop()
        for server in servers:
            server.kill()


@pytest.fixture
def fleet(kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...], vllm_fleet: VllmFleet) -> VllmFleet:
    """The default LoraFleet with both agents' pods (each with its first server's port as the
    vLLM container's), Ready, in the test namespace."""
    for agent in vllm_fleet.agents:
        process = agent.process
        kube_cluster.create_agent_pod(
            kube_namespace,
            process.name,
            process.port,
            labels={FLEET_LABEL: "default"},
            ip=process.spec.host,
            vllm_port=agent.servers[0].port,
        )
    apply(kube_cluster, kube_namespace, fleet_manifest())
    return vllm_fleet


@pytest.fixture
def operator(kube_cluster: ControlPlane, kube_namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    # A refused load would wait ten minutes before it is tried again: a load that fails because a
    # server is down must be retried on the transient back-off (seconds), never on a refusal's.
    refusals_wait = {"LORAFLEET_FAILED_RETRY_SECONDS": "600", "LORAFLEET_FAILED_RETRY_MAX_SECONDS": "600"}
    proc = start_operator(kube_cluster, kube_namespace, tmp_path, env=refusals_wait)
    try:
        yield proc
        # A failed test leaves its adapters: unloaded while the operator runs, as the agents
        # outlive the namespace and agent-0 has room for one.
        kube_cluster.kubectl("delete", "la", "--all", "-n", kube_namespace, "--wait=true", "--timeout=90s")
    finally:
        proc.stop()


def adapter(fleet: VllmFleet, ns: str, name: str, *, seed: int, replicas: int | None = None) -> dict[str, Any]:
    """A LoraAdapter of a fresh rank-4 PEFT adapter of the servers' model."""
    manifest = adapter_manifest(name, make_adapter(fleet.model, fleet.adapters / ns / name, seed=seed, r=4), base_model=BASE_MODEL)
    if replicas is not None:
        manifest["spec"]["replicas"] = replicas
    return manifest


def per_agent(st: dict[str, Any]) -> dict[str, tuple[str, int, int]]:
    """pod -> (state, ranks loaded, ranks total), from a LoraAdapter's status."""
    return {a["pod"]: (a["state"], a["ranksLoaded"], a["ranksTotal"]) for a in st.get("agents") or []}


def agent_message(cluster: ControlPlane, ns: str, name: str, pod: str) -> str:
    """The message of one agent's entry in a LoraAdapter's status."""
    return next(str(a.get("message", "")) for a in status(cluster, ns, name).get("agents") or [] if a["pod"] == pod)


def holders(fleet: VllmFleet, registry_name: str) -> list[str]:
    """The servers whose own ``/v1/models`` lists the adapter."""
    return [server.name for server in fleet.servers if registry_name in server.adapters()]


def endpoints(cluster: ControlPlane, ns: str, name: str) -> dict[str, dict[str, int]]:
    """pod -> {port name: port} over every EndpointSlice labelled for the adapter."""
    slices = cluster.kubectl_json("get", "endpointslices", "-n", ns, "-l", f"{ADAPTER_LABEL}={name}")["items"]
    return {e["targetRef"]["name"]: {p["name"]: p["port"] for p in s.get("ports") or []} for s in slices for e in s.get("endpoints") or []}


def ready(cluster: ControlPlane, ns: str, name: str, op: OperatorProcess, timeout_s: float = 120) -> dict[str, Any]:
    wait_for(lambda: phase(cluster, ns, name) == "Ready", timeout_s, f"{name} Ready", op)
    return status(cluster, ns, name)


def delete_everywhere(cluster: ControlPlane, fleet: VllmFleet, ns: str, *names: str) -> None:
    """Delete the adapters; none is left on any server."""
    for name in names:
        cluster.kubectl("delete", "la", name, "-n", ns, "--wait=true", "--timeout=90s")
    for name in names:
        assert holders(fleet, f"{ns}.{name}") == []


def test_apply_ready_per_rank_placed_by_capacity_routed_to_vllm_then_unloaded(
    kube_cluster: ControlPlane, kube_namespace: str, fleet: VllmFleet, operator: OperatorProcess
) -> None:
    ns = kube_namespace
    agent0, agent1 = fleet.agents
    apply(kube_cluster, ns, adapter(fleet, ns, "everywhere", seed=1))
    st = ready(kube_cluster, ns, "everywhere", operator)
    # Per-rank truth: a rank is a server.
    assert per_agent(st) == {"agent-0": ("Loaded", 1, 1), "agent-1": ("Loaded", 2, 2)}
    assert (st["agentsSummary"], st["ranksSummary"]) == ("2/2", "3/3")
    assert holders(fleet, f"{ns}.everywhere") == ["vllm-0", "vllm-1", "vllm-2"]
    # Gateways are sent to vLLM's own port (the pod's vllm-http), beside the agent's gRPC.
    want = {agent.process.name: {"grpc": agent.process.port, VLLM_HTTP_PORT_NAME: agent.servers[0].port} for agent in (agent0, agent1)}
    wait_for(lambda: endpoints(kube_cluster, ns, "everywhere") == want, 30, "slices with vLLM's port", operator)

    # agent-0 is full (1 of 1): an adapter with one replica goes to agent-1, where there is room.
    apply(kube_cluster, ns, adapter(fleet, ns, "extra", seed=2, replicas=1))
    assert per_agent(ready(kube_cluster, ns, "extra", operator)) == {"agent-1": ("Loaded", 2, 2)}
    assert holders(fleet, f"{ns}.extra") == ["vllm-1", "vllm-2"]
    wait_for(lambda: endpoints(kube_cluster, ns, "extra") == {"agent-1": want["agent-1"]}, 30, "extra's slices", operator)
    # Now agent-0 is the less loaded (1 against 2): only its capacity keeps the next one off it.
    checks = operator.drift_checks()
    wait_for(lambda: operator.drift_checks() >= checks + 2, 30, "drift checks listing both registries", operator)
    apply(kube_cluster, ns, adapter(fleet, ns, "one", seed=4, replicas=1))
    st = ready(kube_cluster, ns, "one", operator)
    assert per_agent(st) == {"agent-1": ("Loaded", 2, 2)}
    assert st["placement"]["placed"] == ["agent-1"]
    (skip,) = st["placement"]["skipped"]
    assert (skip["pod"], skip["reason"]) == ("agent-0", "Full") and "holds 1 of 1" in skip["message"]
    assert holders(fleet, f"{ns}.one") == ["vllm-1", "vllm-2"]

    delete_everywhere(kube_cluster, fleet, ns, "everywhere", "extra", "one")


def test_a_restarted_vllm_server_is_reloaded_by_drift_repair(
    kube_cluster: ControlPlane, kube_namespace: str, fleet: VllmFleet, operator: OperatorProcess
) -> None:
    ns = kube_namespace
    apply(kube_cluster, ns, adapter(fleet, ns, "kept", seed=3))
    assert per_agent(ready(kube_cluster, ns, "kept", operator)) == {"agent-0": ("Loaded", 1, 1), "agent-1": ("Loaded", 2, 2)}
    lost = fleet.agents[1].servers[1]  # agent-1's rank 1
    lost.kill()
    # The agent reports the rank it lost; the status says so (a reload fails while it is down,
    # and the server being down makes it Unreachable there, not Failed: it is retried soon).
    wait_for(lambda: "server 1 (" in agent_message(kube_cluster, ns, "kept", "agent-1"), 60, "agent-1 to miss server 1", operator)
    wait_for(lambda: per_agent(status(kube_cluster, ns, "kept"))["agent-1"][0] == "Unreachable", 60, "a transient failure", operator)
    st = status(kube_cluster, ns, "kept")
    assert st["phase"] != "Ready" and st["ranksSummary"] != "3/3"

    lost.start().wait_ready()
    wait_for(lambda: f"{ns}.kept" in lost.adapters(), 180, "drift repair to reload the restarted server", operator)
    st = ready(kube_cluster, ns, "kept", operator)
    assert per_agent(st) == {"agent-0": ("Loaded", 1, 1), "agent-1": ("Loaded", 2, 2)}
    assert st["ranksSummary"] == "3/3"
    assert holders(fleet, f"{ns}.kept") == ["vllm-0", "vllm-1", "vllm-2"]

    delete_everywhere(kube_cluster, fleet, ns, "kept")
