"""Routing for gateways (operator/lorafleet_operator/routing.py): per LoraAdapter,
EndpointSlices of exactly the pods whose every rank holds it.

The slices as plain values first; then end to end: the real operator, two real agents (tp=2,
dp=2) listening on the machine's own address (the API server refuses loopback addresses in
an EndpointSlice), their pods declaring a gRPC and an HTTP port, the real API server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lorafleet_dev.agents import AgentProcess
from lorafleet_dev.node import machine_ip
from lorafleet_operator.agent_client import AgentClients
from lorafleet_operator.config import Settings
from lorafleet_operator.fleet import DEFAULT_PORT_NAME, AgentPod
from lorafleet_operator.kube import Kube, make_api_client
from lorafleet_operator.resources import FleetSpec, ObjectRef, adapter_of
from lorafleet_operator.routing import (
    ADAPTER_LABEL,
    DEFAULT_HTTP_PORT_NAME,
    DEFAULT_SERVICE,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    SERVICE_NAME_LABEL,
    adapter_label,
    claims_lorafleet,
    desired_slices,
    publish_slices,
    routed_pods,
)
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.status import AgentResult, AgentState
from tests.kube.harness import CHECKOUT, ControlPlane
from tests.operator.agents import (
    FLEET_LABEL,
    adapter_manifest,
    agent_spec,
    apply,
    fleet_manifest,
    make_adapter,
    registry,
    serving,
    status,
)
from tests.operator.conftest import OperatorProcess, wait_for

ADAPTER = ObjectRef("LoraAdapter", "ns", "a", "u-1")
HTTP_PORT = 8000


def pod(name: str, ip: str, grpc: int, *, ready: bool = True, http: bool = True) -> AgentPod:
    ports = (("grpc", grpc),) + ((("http", HTTP_PORT),) if http else ())
    return AgentPod(name, "ns", f"uid-{name}", {}, ready, f"{ip}:{grpc}", 0, ip, ports)


def loaded(name: str, ranks: int = 2) -> AgentResult:
    return AgentResult(name, AgentState.LOADED, ranks, 2)


def test_the_operators_fleet_defaults_are_the_crds() -> None:
    """The LoraFleet CRD is the one source of the fleet's defaults. The API server fills them
    in only inside an object that is there (``spec.routing`` is optional and has no default of
    its own), so the operator's constants stand in for a fleet that leaves the object out:
    they must be the CRD's values, not a second choice of them."""
    doc = yaml.safe_load((CHECKOUT.crds / "lorafleet.dev_lorafleets.yaml").read_text())
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    routing = spec["properties"]["routing"]["properties"]
    assert routing["serviceName"]["default"] == DEFAULT_SERVICE
    assert routing["httpPortName"]["default"] == DEFAULT_HTTP_PORT_NAME
    assert spec["properties"]["grpcPortName"]["default"] == DEFAULT_PORT_NAME


def test_only_pods_that_hold_the_adapter_on_every_rank_are_listed() -> None:
    agents = [
        pod("p0", "10.0.0.1", 50051),
        pod("p1", "10.0.0.2", 50051),
        pod("p2", "10.0.0.3", 50051, ready=False),
        pod("p3", "127.0.0.1", 50051),
        pod("p4", "10.0.0.5", 50051),
    ]
    results = [loaded("p0"), loaded("p1", ranks=1), loaded("p2"), loaded("p3"), AgentResult("p4", AgentState.FAILED, 0, 2, "no")]
    assert [p.pod for p in routed_pods(FleetSpec(), agents, results)] == ["p0"]


def test_one_slice_per_port_set_with_the_labels_and_owner() -> None:
    agents = [pod("p0", "10.0.0.1", 50051), pod("p1", "10.0.0.2", 50051), pod("p2", "10.0.0.3", 50052, http=False)]
    slices = desired_slices(ADAPTER, "svc", routed_pods(FleetSpec(), agents, [loaded(a.name) for a in agents]))
    assert len(slices) == 2
    by_ports = {tuple((p["name"], p["port"]) for p in s["ports"]): s for s in slices}
    both = by_ports[(("grpc", 50051), ("http", HTTP_PORT))]
    assert [e["targetRef"]["name"] for e in both["endpoints"]] == ["p0", "p1"]
    assert [e["targetRef"]["name"] for e in by_ports[(("grpc", 50052),)]["endpoints"]] == ["p2"]
    for s in slices:
        assert s["metadata"]["labels"][SERVICE_NAME_LABEL] == "svc"
        assert s["metadata"]["labels"][ADAPTER_LABEL] == "a"
        assert s["metadata"]["labels"][MANAGED_BY_LABEL] == MANAGED_BY == "operator.lorafleet.dev"
        assert s["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    empty = desired_slices(ADAPTER, "svc", [])
    assert [(s["endpoints"], s["ports"]) for s in empty] == [([], [])]


def test_which_slices_claim_to_be_lorafleets() -> None:
    """lorafleet's managed-by value, or a LoraAdapter as controller, is a claim only the
    operator may make; the adapter's label alone (another manager, a plain owner) is not."""
    (own,) = desired_slices(ADAPTER, "svc", [])
    assert claims_lorafleet(own)
    owner = own["metadata"]["ownerReferences"][0]
    other_labels = {ADAPTER_LABEL: "a", MANAGED_BY_LABEL: "gateway.example.com"}
    assert claims_lorafleet({"metadata": {"labels": other_labels, "ownerReferences": [owner]}})
    assert not claims_lorafleet({"metadata": {"labels": other_labels, "ownerReferences": [{**owner, "controller": False}]}})
    assert not claims_lorafleet({"metadata": {"labels": {ADAPTER_LABEL: "a"}}})
    assert not claims_lorafleet({"metadata": {"ownerReferences": [{**owner, "apiVersion": "example.com/v1"}]}})


def test_a_long_adapter_name_gets_a_label_value_that_fits() -> None:
    long = "a" * 189
    value = adapter_label(long)
    assert len(value) <= 63 and value != adapter_label("a" * 188)
    assert adapter_label("short") == "short"


# ---- end to end -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def routed_agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[AgentProcess], Path]]:
    """Two agents on the machine's own address (pods may not have loopback endpoints)."""
    root = tmp_path_factory.mktemp("routing-agents")
    spec, adapters = agent_spec(root, host=machine_ip())
    agents = [AgentProcess(f"agent-{i}", spec, root / "logs") for i in range(2)]
    with serving(agents):
        yield agents, adapters


def add_pod(cluster: ControlPlane, ns: str, agent: AgentProcess) -> None:
    """The agent's Pod with a gRPC and an HTTP port, Running and Ready at its address."""
    cluster.create_agent_pod(ns, agent.name, agent.port, labels={FLEET_LABEL: "default"}, ip=agent.spec.host, http_port=HTTP_PORT)


def endpoints(cluster: ControlPlane, ns: str, adapter: str) -> dict[str, dict[str, int]]:
    """pod -> {port name: port} over every EndpointSlice labelled for the adapter."""
    slices = cluster.kubectl_json("get", "endpointslices", "-n", ns, "-l", f"{ADAPTER_LABEL}={adapter}")["items"]
    listed: dict[str, dict[str, int]] = {}
    for s in slices:
        assert s["metadata"]["labels"][SERVICE_NAME_LABEL] == DEFAULT_SERVICE  # the default
        for e in s.get("endpoints") or []:
            listed[e["targetRef"]["name"]] = {p["name"]: p["port"] for p in s.get("ports") or []}
    return listed


def with_replicas(manifest: dict[str, Any], replicas: int) -> dict[str, Any]:
    return {**manifest, "spec": {**manifest["spec"], "replicas": replicas}}


def test_endpointslices_follow_placement_and_pods(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    routed_agents: tuple[list[AgentProcess], Path],
    operator: OperatorProcess,
) -> None:
    """Replicas unset: both pods, with their gRPC and HTTP ports; one replica: one pod. The
    pod holding the single replica is deleted: the adapter is placed on the other agent and
    both adapters' slices list only what now holds them. Deleted: its slices are gone. A new
    adapter's slices are created without a list first, and a deletion lists none either."""
    (a0, a1), root = routed_agents
    ns = kube_namespace
    for a in (a0, a1):
        add_pod(kube_cluster, ns, a)
    apply(kube_cluster, ns, fleet_manifest())
    path = make_adapter(root / ns, "w")
    apply(kube_cluster, ns, adapter_manifest("every", path))
    wait_for(lambda: status(kube_cluster, ns, "every").get("phase") == "Ready", 90, "every Ready", operator)
    apply(kube_cluster, ns, with_replicas(adapter_manifest("one", path), 1))
    wait_for(lambda: status(kube_cluster, ns, "one").get("phase") == "Ready", 90, "one Ready", operator)
    ports = {a.name: {"grpc": a.port, "http": HTTP_PORT} for a in (a0, a1)}
    wait_for(lambda: endpoints(kube_cluster, ns, "every") == ports, 30, "every's slices", operator)
    first = status(kube_cluster, ns, "one")["placement"]["placed"]
    assert len(first) == 1
    wait_for(lambda: list(endpoints(kube_cluster, ns, "one")) == first, 30, "one's slices", operator)
    assert slice_lists(operator) == 0  # new adapters' slices are created without a list
    gone, other = (a0, a1) if first == ["agent-0"] else (a1, a0)

    kube_cluster.kubectl("delete", "pod", gone.name, "-n", ns, "--wait=true")
    wait_for(
        lambda: (
            status(kube_cluster, ns, "one")["placement"]["placed"] == [other.name] and status(kube_cluster, ns, "one")["phase"] == "Ready"
        ),
        60,
        "one placed again",
        operator,
    )
    assert f"{ns}.one" in registry(other, ns)
    wait_for(lambda: endpoints(kube_cluster, ns, "one") == {other.name: ports[other.name]}, 30, "one's slices follow", operator)
    wait_for(lambda: endpoints(kube_cluster, ns, "every") == {other.name: ports[other.name]}, 30, "every's slices follow", operator)

    kube_cluster.kubectl("delete", "la", "one", "-n", ns)
    assert kube_cluster.kubectl_json("get", "endpointslices", "-n", ns, "-l", f"{ADAPTER_LABEL}=one")["items"] == []

    # The slices the operator wrote are deleted by name: the deletion lists none.
    lists = slice_lists(operator)
    kube_cluster.kubectl("delete", "la", "every", "-n", ns)
    assert slice_lists(operator) == lists
    assert kube_cluster.kubectl_json("get", "endpointslices", "-n", ns, "-l", f"{ADAPTER_LABEL}=every")["items"] == []
    # The slice watch took none of the operator's own writes for tampering.
    assert "written again" not in operator.log()


def slice_lists(operator: OperatorProcess) -> float:
    """The EndpointSlice LISTs this operator has sent (its ``lorafleet_kube_requests_total``:
    the API server's own counter also counts other clients', e.g. the namespace controller
    emptying an earlier test's namespace)."""
    return operator.metrics().get('lorafleet_kube_requests_total{call="list_namespaced_endpoint_slice"}', 0.0)


def test_a_new_adapters_slice_that_exists_after_all_is_replaced(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
) -> None:
    """A new adapter's slices are created without a list; one that exists already (409) sends
    the write down the listing path, which replaces it. In-process, the real API server, no
    operator watching the namespace."""
    ns = kube_namespace
    apply(kube_cluster, ns, adapter_manifest("fresh", Path("/nowhere")))
    adapter = kube_cluster.kubectl_json("get", "la", "fresh", "-n", ns)
    # The slice it would create, with an endpoint that is not there.
    stale = desired_slices(adapter_of(adapter).ref, DEFAULT_SERVICE, [])[0]
    stale["endpoints"] = [{"addresses": ["10.0.0.9"], "conditions": {"ready": True}}]
    kube_cluster.kubectl("create", "-f", "-", input=json.dumps(stale))
    api = make_api_client(str(kube_cluster.kubeconfig))

    async def publish() -> bool:
        settings = Settings.from_env()
        agents = AgentClients(settings)
        try:
            return await publish_slices(
                Runtime(settings=settings, kube=Kube(api), agents=agents), adapter_of(adapter).ref, FleetSpec(), (), [], new=True
            )
        finally:
            await agents.close()

    try:
        assert asyncio.run(publish())
    finally:
        api.close()
    slices = kube_cluster.kubectl_json("get", "endpointslices", "-n", ns, "-l", f"{ADAPTER_LABEL}=fresh")["items"]
    assert [(s["metadata"]["name"], s.get("endpoints") or []) for s in slices] == [(stale["metadata"]["name"], [])]
