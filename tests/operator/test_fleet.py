"""Agent discovery: the selector the operator evaluates over the pods it watches selects
exactly the pods the API server selects; endpoints and readiness come from the pod, and the
summary the operator keeps of each pod (its pod index) says the same. A look at a fleet reads
the LoraFleet from the operator's fleet index, and asks the API server only for a fleet the
index lacks."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from lorafleet_operator.agent_client import AgentClients
from lorafleet_operator.config import Settings
from lorafleet_operator.failures import FleetProblem
from lorafleet_operator.fleet import (
    agent_from_pod,
    agents_of,
    pod_summary,
    selector_matches,
)
from lorafleet_operator.kube import Kube, make_api_client
from lorafleet_operator.looks import fleet_view
from lorafleet_operator.resources import fleet_of, fleet_spec_of
from lorafleet_operator.runtime import Runtime, fleet_agents
from tests.kube.harness import ControlPlane
from tests.operator.agents import apply, fleet_manifest

SELECTORS: list[dict[str, Any]] = [
    {"matchLabels": {"fleet": "a"}},
    {"matchLabels": {"fleet": "a", "zone": "z1"}},
    {"matchExpressions": [{"key": "fleet", "operator": "In", "values": ["a", "b"]}]},
    {"matchExpressions": [{"key": "fleet", "operator": "NotIn", "values": ["a"]}]},
    {"matchExpressions": [{"key": "zone", "operator": "Exists"}]},
    {"matchLabels": {"fleet": "b"}, "matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]},
]
PODS = {
    "p-a1": {"fleet": "a", "zone": "z1"},
    "p-a2": {"fleet": "a"},
    "p-b1": {"fleet": "b"},
    "p-b2": {"fleet": "b", "zone": "z2"},
    "p-c": {"other": "x"},
}


def selector_string(selector: Mapping[str, Any]) -> str:
    """A metav1.LabelSelector as the ``labelSelector`` query string the API server takes
    (how this test asks the server; the operator evaluates selectors itself)."""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In":
            parts.append(f"{key} in ({','.join(values)})")
        elif op == "NotIn":
            parts.append(f"{key} notin ({','.join(values)})")
        elif op == "Exists":
            parts.append(key)
        elif op == "DoesNotExist":
            parts.append(f"!{key}")
        else:
            raise ValueError(f"unknown selector operator {op!r}")
    return ",".join(parts)


def test_selectors_agree_with_the_api_server(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    for i, (name, labels) in enumerate(PODS.items()):
        kube_cluster.create_agent_pod(kube_namespace, name, 50100 + i, labels=labels)
    pods = kube_cluster.kubectl_json("get", "pods", "-n", kube_namespace)["items"]
    for selector in SELECTORS:
        served = kube_cluster.kubectl_json("get", "pods", "-n", kube_namespace, "-l", selector_string(selector))["items"]
        by_server = sorted(p["metadata"]["name"] for p in served)
        by_us = sorted(p["metadata"]["name"] for p in pods if selector_matches(selector, p["metadata"]["labels"]))
        assert by_us == by_server, selector
        assert by_server  # every case selects something: the comparison is not vacuous


def test_endpoint_and_readiness_from_the_pod(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    ready = kube_cluster.create_agent_pod(kube_namespace, "agent-0", 50051, labels={"fleet": "a"})
    assert agent_from_pod(ready).endpoint == "127.0.0.1:50051"
    assert agent_from_pod(ready).dialable
    # Another port name: no endpoint, not dialable.
    assert agent_from_pod(ready, "metrics").endpoint == ""
    not_ready = kube_cluster.create_agent_pod(kube_namespace, "agent-1", 50052, ready=False, labels={"fleet": "a"})
    agent = agent_from_pod(not_ready)
    assert not agent.ready and not agent.dialable
    restarted = kube_cluster.write_pod_status(kube_namespace, "agent-1", restart_count=2)
    assert agent_from_pod(restarted).restarts == 2 and agent_from_pod(restarted).ready
    agents = agents_of(fleet_spec_of({"selector": {"matchLabels": {"fleet": "a"}}}), [ready, restarted])
    assert [a.name for a in agents] == ["agent-0", "agent-1"]
    # What the operator's pod index keeps of each pod describes the same agent.
    deleting = kube_cluster.kubectl_json("get", "pod", "agent-0", "-n", kube_namespace)
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    for pod in (ready, not_ready, restarted, deleting):
        for port_name in ("grpc", "metrics"):
            assert agent_from_pod(pod_summary(pod), port_name) == agent_from_pod(pod, port_name)
    assert not agent_from_pod(pod_summary(deleting)).ready


def test_empty_selector_selects_nothing() -> None:
    assert not selector_matches({}, {"a": "b"})


def runtime(cluster: ControlPlane | None) -> Runtime:
    """A Runtime on the real API server (None: no Kubernetes API at all, so a look that asked
    it would fail)."""
    settings = Settings()
    kube = Kube(make_api_client(str(cluster.kubeconfig))) if cluster is not None else None
    return Runtime(settings, kube, AgentClients(settings))


def test_a_look_at_a_fleet_reads_the_fleet_index_without_a_request() -> None:
    """The index's fleet is the one looked at (its spec: here a selector matching one pod of
    the pod index); being deleted there is FleetDeleted. No Kubernetes API is reachable."""
    rt = runtime(None)
    fleet = fleet_manifest("f")
    fleet["metadata"].update(namespace="ns", uid="u-1", generation=3)
    rt.watch.fleets = {("ns", "f"): [fleet_of({**fleet, "status": {"agents": 9}})]}
    rt.watch.pods = {"ns": [{"metadata": {"name": "p", "namespace": "ns", "uid": "p-1", "labels": {"lorafleet.dev/fleet": "f"}}}]}
    view = asyncio.run(fleet_view(rt, "ns", "f"))
    assert (view.name, [a.name for a in view.agents]) == ("f", ["p"])
    assert view.spec == fleet_spec_of(fleet["spec"])
    deleting = {**fleet, "metadata": {**fleet["metadata"], "deletionTimestamp": "2026-12-02T00:00:00Z"}}
    rt.watch.fleets = {("ns", "f"): [fleet_of(deleting)]}
    with pytest.raises(FleetProblem) as refused:
        asyncio.run(fleet_view(rt, "ns", "f"))
    assert refused.value.reason == "FleetDeleted"
    assert asyncio.run(fleet_view(rt, "ns", "f", terminating_ok=True)).name == "f"


def test_a_fleets_agents_are_made_again_only_when_its_spec_or_a_pod_changed() -> None:
    """kopf replaces the index objects of what changed: the agents made from them are reused
    while the fleet's spec and the namespace's pod summaries are the same objects, and made
    again when one is replaced (a pod turned ready, one more pod, another selector)."""
    rt = runtime(None)
    spec = fleet_spec_of(fleet_manifest("f")["spec"])

    def pod(name: str, ready: bool) -> dict[str, Any]:
        return pod_summary(
            {
                "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "labels": {"lorafleet.dev/fleet": "f"}},
                "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]},
            }
        )

    rt.watch.pods = {"ns": [pod("a", False), pod("b", True)]}
    first = fleet_agents(rt, "ns", "f", spec)
    assert fleet_agents(rt, "ns", "f", spec) is first
    assert [a.ready for a in first] == [False, True]
    rt.watch.pods = {"ns": [pod("a", True), list(rt.watch.pods["ns"])[1]]}
    assert [a.ready for a in fleet_agents(rt, "ns", "f", spec)] == [True, True]
    rt.watch.pods = {"ns": [*rt.watch.pods["ns"], pod("c", True)]}
    assert [a.name for a in fleet_agents(rt, "ns", "f", spec)] == ["a", "b", "c"]
    other = fleet_spec_of({**fleet_manifest("f")["spec"], "selector": {"matchLabels": {"lorafleet.dev/fleet": "g"}}})
    assert fleet_agents(rt, "ns", "f", other) == ()


def test_a_fleet_the_index_lacks_is_asked_for(kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...]) -> None:
    """A fleet created a moment ago, not yet in the index (its watch event still coming), is
    found on the API server; one the API server lacks too is FleetNotFound, as before."""
    apply(kube_cluster, kube_namespace, fleet_manifest("new"))
    rt = runtime(kube_cluster)
    assert asyncio.run(fleet_view(rt, kube_namespace, "new")).name == "new"
    with pytest.raises(FleetProblem) as missing:
        asyncio.run(fleet_view(rt, kube_namespace, "absent"))
    assert missing.value.reason == "FleetNotFound"
