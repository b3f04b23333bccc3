"""Agent discovery: the pods a LoraFleet selects, ready or not, and where to dial them.

A pod is an agent of a fleet when the fleet's label selector matches it; its endpoint is the pod
IP and the container port named ``spec.grpcPortName``. Readiness is the kubelet's (the pod's
Ready condition, which the chart ties to the agent's gRPC health); the operator never loads on a
pod that is not Ready, and a pod that is gone no longer counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lorafleet_operator.resources import FleetSpec

#: The LoraFleet CRD's default of ``spec.grpcPortName`` (its source; tests/operator/test_routing.py
#: compares), for fleet specs that did not come through the API server.
DEFAULT_PORT_NAME = "grpc"


@dataclass(frozen=True)
class AgentPod:
    """One agent pod as the API server describes it."""

    name: str
    namespace: str
    uid: str
    labels: Mapping[str, str]
    ready: bool
    #: "ip:port", or "" when the pod has no IP yet or lacks the named port.
    endpoint: str
    #: Sum of container restarts: an increase means the agent lost its in-memory registry.
    restarts: int
    #: The pod's IP ("" before it has one) and its named container ports (for routing).
    ip: str = ""
    ports: tuple[tuple[str, int], ...] = ()

    @property
    def dialable(self) -> bool:
        return self.ready and bool(self.endpoint)


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a metav1.LabelSelector selects these labels (same semantics as the API server).

    The operator selects a fleet's agents among the pods it watches (its pod index) with it,
    never with a list call per reconcile.
    """
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    # An empty selector selects nothing here (the CRD refuses one anyway).
    return bool(selector.get("matchLabels") or selector.get("matchExpressions"))


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _endpoint(pod: Mapping[str, Any], port_name: str) -> str:
    ip = (pod.get("status") or {}).get("podIP") or ""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == port_name and ip:
                host = f"[{ip}]" if ":" in ip else ip
                return f"{host}:{port['containerPort']}"
    return ""


def _ports(pod: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
    return tuple(
        sorted(
            (str(port["name"]), int(port["containerPort"]))
            for container in (pod.get("spec") or {}).get("containers") or []
            for port in container.get("ports") or []
            if port.get("name")
        )
    )


def pod_summary(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a Pod object that :func:`agents_of` reads (same shape, the rest dropped):
    what the operator keeps of every pod it watches (its pod index), instead of listing a
    fleet's pods at each reconcile."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    return {
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "labels", "deletionTimestamp") if k in meta},
        "status": {
            "phase": status.get("phase"),
            "podIP": status.get("podIP"),
            "conditions": [{"type": c.get("type"), "status": c.get("status")} for c in status.get("conditions") or []],
            "containerStatuses": [{"restartCount": s.get("restartCount", 0)} for s in status.get("containerStatuses") or []],
        },
        "spec": {
            "containers": [
                {"ports": [{"name": port.get("name"), "containerPort": port.get("containerPort")} for port in c.get("ports") or []]}
                for c in (pod.get("spec") or {}).get("containers") or []
            ]
        },
    }


def agent_from_pod(pod: Mapping[str, Any], port_name: str = DEFAULT_PORT_NAME) -> AgentPod:
    """An AgentPod from a Pod object (as a dict, the API server's JSON)."""
    meta = pod.get("metadata") or {}
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return AgentPod(
        name=meta["name"],
        namespace=meta.get("namespace", ""),
        uid=meta.get("uid", ""),
        labels=dict(meta.get("labels") or {}),
        ready=_pod_ready(pod),
        endpoint=_endpoint(pod, port_name),
        restarts=sum(int(s.get("restartCount", 0)) for s in statuses),
        ip=(pod.get("status") or {}).get("podIP") or "",
        ports=_ports(pod),
    )


def agents_of(fleet_spec: FleetSpec, pods: Sequence[Mapping[str, Any]]) -> list[AgentPod]:
    """The fleet's agents among ``pods`` (already filtered by namespace), sorted by name."""
    selector = fleet_spec.selector
    port_name = fleet_spec.grpc_port_name or DEFAULT_PORT_NAME
    chosen = [agent_from_pod(p, port_name) for p in pods if selector_matches(selector, (p.get("metadata") or {}).get("labels") or {})]
    return sorted(chosen, key=lambda a: a.name)
