"""Agent discovery: the selector the operator evaluates over the pods it watches selects
exactly the pods the API server selects; endpoints and readiness come from the pod, and the
summary the operator keeps of each pod (its pod index) says the same."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lorafleet_operator.fleet import agent_from_pod, agents_of, pod_summary, selector_matches
from tests.kube.harness import ControlPlane

SELECTORS: list[dict[str, Any]] = [
    {"matchLabels": {"fleet": "a"}},
    {"matchLabels": {"fleet": "a", "zone": "z1"}},
    {"matchExpressions": [{"key": "fleet", "operator": "In", "values": ["a", "b"]}]},
    {"matchExpressions": [{"key": "fleet", "operator": "NotIn", "values": ["a"]}]},
    {"matchExpressions": [{"key": "zone", "operator": "Exists"}]},
    {"matchLabels": {"fleet": "b"},
     "matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]},
]
PODS = {"p-a1": {"fleet": "a", "zone": "z1"}, "p-a2": {"fleet": "a"},
        "p-b1": {"fleet": "b"}, "p-b2": {"fleet": "b", "zone": "z2"}, "p-c": {"other": "x"}}


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


def test_selectors_agree_with_the_api_server(
    kube_cluster: ControlPlane, kube_namespace: str
) -> None:
    for i, (name, labels) in enumerate(PODS.items()):
        kube_cluster.create_agent_pod(kube_namespace, name, 50100 + i, labels=labels)
    pods = kube_cluster.kubectl_json("get", "pods", "-n", kube_namespace)["items"]
    for selector in SELECTORS:
        served = kube_cluster.kubectl_json("get", "pods", "-n", kube_namespace, "-l",
                                           selector_string(selector))["items"]
        by_server = sorted(p["metadata"]["name"] for p in served)
        by_us = sorted(p["metadata"]["name"] for p in pods
                       if selector_matches(selector, p["metadata"]["labels"]))
        assert by_us == by_server, selector
        assert by_server  # every case selects something: the comparison is not vacuous


def test_endpoint_and_readiness_from_the_pod(
    kube_cluster: ControlPlane, kube_namespace: str
) -> None:
    ready = kube_cluster.create_agent_pod(kube_namespace, "agent-0", 50051,
                                          labels={"fleet": "a"})
    assert agent_from_pod(ready).endpoint == "127.0.0.1:50051"
    assert agent_from_pod(ready).dialable
    # Another port name: no endpoint, not dialable.
    assert agent_from_pod(ready, "metrics").endpoint == ""
    not_ready = kube_cluster.create_agent_pod(kube_namespace, "agent-1", 50052, ready=False,
                                              labels={"fleet": "a"})
    agent = agent_from_pod(not_ready)
    assert not agent.ready and not agent.dialable
    restarted = kube_cluster.write_pod_status(kube_namespace, "agent-1", restart_count=2)
    assert agent_from_pod(restarted).restarts == 2 and agent_from_pod(restarted).ready
    agents = agents_of({"selector": {"matchLabels": {"fleet": "a"}}}, [ready, restarted])
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
