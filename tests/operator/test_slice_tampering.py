"""The operator owns its EndpointSlices (operator/lorafleet_operator/slice_guard.py;
docs/operator.md, "Routing trust").

A tenant allowed to write EndpointSlices in its namespace (an impersonated user bound to the
Role below) tampers with an adapter's routing: adds an endpoint to the operator's slice,
changes its ports and labels, deletes it, creates forged slices with the adapter's labels and
an owner reference to it. The operator repairs its own slices from the watch (no change of
placement comes to trigger a write), deletes a forged slice that claims to be lorafleet's,
and reports one that only carries the adapter's label. The real operator, the real API
server, the two real agents of tests/operator/test_routing.py (on the machine's own address:
the API server refuses loopback addresses in a slice).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lorafleet_dev.agents import AgentProcess
from lorafleet_operator.agent_client import AgentClients
from lorafleet_operator.config import Settings
from lorafleet_operator.kube import Kube, make_api_client
from lorafleet_operator.resources import FleetSpec, adapter_of
from lorafleet_operator.routing import (
    ADAPTER_LABEL,
    DEFAULT_SERVICE,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    SERVICE_NAME_LABEL,
    claims_lorafleet,
    publish_slices,
    slice_essence,
)
from lorafleet_operator.runtime import Runtime
from tests.kube.harness import ControlPlane
from tests.operator import test_routing
from tests.operator.agents import adapter_manifest, apply, fleet_manifest, make_adapter, status
from tests.operator.conftest import OperatorProcess, wait_for

# The two agents on the machine's address (test_routing's module fixture, same definition).
routed_agents = test_routing.routed_agents

TENANT = "mallory"
ADAPTER = "victim"
#: Addresses nothing listens on: where the tenant would send the adapter's traffic.
NOWHERE = ("10.255.255.7", "10.255.255.8", "10.255.255.9")


def slice_writer_role(cluster: ControlPlane, ns: str) -> None:
    """What the hostile review gave its tenant: every verb on EndpointSlices in its namespace
    (and on LoraAdapters, as the tenant Role: to copy an adapter's uid into an owner reference)."""
    verbs = "--verb=get,list,watch,create,update,patch,delete"
    cluster.kubectl(
        "create", "role", "slice-writer", "-n", ns, verbs, "--resource=endpointslices.discovery.k8s.io,loraadapters.lorafleet.dev"
    )
    cluster.kubectl("create", "rolebinding", f"slice-writer-{TENANT}", "-n", ns, "--role=slice-writer", f"--user={TENANT}")
    can = cluster.kubectl("auth", "can-i", "create", "endpointslices.discovery.k8s.io", "-n", ns, as_user=TENANT, check=False)
    assert can.stdout.strip() == "yes"


def slices(cluster: ControlPlane, ns: str, selector: str = f"{ADAPTER_LABEL}={ADAPTER}") -> dict[str, dict[str, Any]]:
    """The namespace's EndpointSlices with these labels, by name."""
    items = cluster.kubectl_json("get", "endpointslices", "-n", ns, "-l", selector)["items"]
    return {s["metadata"]["name"]: s for s in items}


def trusted(cluster: ControlPlane, ns: str) -> dict[str, dict[str, Any]]:
    """The slices a gateway may trust for the adapter (the docs' rule): lorafleet's managed-by
    value, the adapter's label, and the adapter (this uid) as their controller."""
    uid = cluster.kubectl_json("get", "la", ADAPTER, "-n", ns)["metadata"]["uid"]
    found = slices(cluster, ns, f"{ADAPTER_LABEL}={ADAPTER},{MANAGED_BY_LABEL}={MANAGED_BY}")
    return {n: s for n, s in found.items() if any(o.get("controller") and o["uid"] == uid for o in s["metadata"]["ownerReferences"])}


def addresses(found: dict[str, dict[str, Any]]) -> set[str]:
    return {a for s in found.values() for e in s.get("endpoints") or [] for a in e["addresses"]}


def pods(found: dict[str, dict[str, Any]]) -> set[str]:
    return {e["targetRef"]["name"] for s in found.values() for e in s.get("endpoints") or [] if "targetRef" in e}


def events(cluster: ControlPlane, ns: str, reason: str) -> list[dict[str, Any]]:
    """The Events of this reason about the adapter."""
    found = cluster.kubectl_json("get", "events", "-n", ns, "--field-selector", f"reason={reason}")["items"]
    return [e for e in found if e["involvedObject"]["name"] == ADAPTER and e["involvedObject"]["kind"] == "LoraAdapter"]


def as_tenant(cluster: ControlPlane, *args: str, input: str | None = None) -> None:
    cluster.kubectl(*args, input=input, as_user=TENANT)


@dataclass(frozen=True)
class Routed:
    """The adapter Ready on both agents, and the slices the operator wrote for it."""

    cluster: ControlPlane
    ns: str
    operator: OperatorProcess
    written: dict[str, dict[str, Any]]


@pytest.fixture
def routed(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    routed_agents: tuple[list[AgentProcess], Path],
    operator: OperatorProcess,
) -> Iterator[Routed]:
    """Both agents' pods, the fleet and the adapter, Ready on both; its slices as the operator
    wrote them (each carrying lorafleet's managed-by value); the tenant's Role. The adapter is
    deleted afterwards (the agents are the module's)."""
    cluster, ns = kube_cluster, kube_namespace
    agents, root = routed_agents
    for agent in agents:
        test_routing.add_pod(cluster, ns, agent)
    apply(cluster, ns, fleet_manifest(), adapter_manifest(ADAPTER, make_adapter(root / ns, ADAPTER)))
    wait_for(lambda: status(cluster, ns, ADAPTER).get("phase") == "Ready", 90, "the adapter Ready", operator)
    wait_for(lambda: pods(trusted(cluster, ns)) == {a.name for a in agents}, 30, "the operator's slices", operator)
    written = slices(cluster, ns)
    assert written == trusted(cluster, ns), written
    assert addresses(written) == {agents[0].spec.host}
    for s in written.values():
        labels = s["metadata"]["labels"]
        assert labels[MANAGED_BY_LABEL] == MANAGED_BY
        assert labels[SERVICE_NAME_LABEL] == DEFAULT_SERVICE
    slice_writer_role(cluster, ns)
    yield Routed(cluster, ns, operator, written)
    cluster.kubectl("delete", "la", ADAPTER, "-n", ns, "--wait=true", "--timeout=60s")


def restored(cluster: ControlPlane, ns: str, written: dict[str, dict[str, Any]]) -> bool:
    """Every slice the operator wrote is there again as written, and no other slice with the
    adapter's label claims to be lorafleet's."""
    now = {n: s for n, s in slices(cluster, ns).items() if n in written or claims_lorafleet(s)}
    return set(now) == set(written) and all(slice_essence(now[n]) == slice_essence(s) for n, s in written.items())


def test_edits_of_the_operators_slice_are_repaired(routed: Routed) -> None:
    """The tenant adds an endpoint to the operator's slice: taken out again. Then it changes
    the slice's ports and drops its labels (a gateway would lose the adapter): put back."""
    kube_cluster, ns, operator, written = routed.cluster, routed.ns, routed.operator, routed.written
    name = next(iter(written))
    forged = {"addresses": [NOWHERE[0]], "conditions": {"ready": True, "serving": True, "terminating": False}}
    patch = [{"op": "add", "path": "/endpoints/-", "value": forged}]
    as_tenant(kube_cluster, "patch", "endpointslice", name, "-n", ns, "--type=json", "-p", json.dumps(patch))
    wait_for(lambda: restored(kube_cluster, ns, written), 60, "the added endpoint removed", operator)
    assert NOWHERE[0] not in addresses(slices(kube_cluster, ns))

    patch = [
        {"op": "replace", "path": "/ports/0/port", "value": 1},
        {"op": "remove", "path": f"/metadata/labels/{ADAPTER_LABEL.replace('/', '~1')}"},
        {"op": "remove", "path": f"/metadata/labels/{MANAGED_BY_LABEL.replace('/', '~1')}"},
    ]
    as_tenant(kube_cluster, "patch", "endpointslice", name, "-n", ns, "--type=json", "-p", json.dumps(patch))
    wait_for(lambda: restored(kube_cluster, ns, written), 60, "the ports and labels put back", operator)
    wait_for(lambda: len(events(kube_cluster, ns, "EndpointSliceRestored")) >= 1, 60, "a Warning Event EndpointSliceRestored", operator)


def test_a_deleted_slice_is_created_again(routed: Routed) -> None:
    """The tenant deletes the operator's slice: it is created again with the same endpoints,
    without waiting for a change of placement."""
    kube_cluster, ns, operator, written = routed.cluster, routed.ns, routed.operator, routed.written
    for name in written:
        as_tenant(kube_cluster, "delete", "endpointslice", name, "-n", ns)
    wait_for(lambda: restored(kube_cluster, ns, written), 60, "the slice created again", operator)
    assert trusted(kube_cluster, ns).keys() == written.keys()


def test_forged_slices_are_deleted_or_never_trusted(routed: Routed) -> None:
    """Two forged slices with the adapter's labels and an owner reference to it. One copies the
    operator's labels (lorafleet's managed-by value) and names the adapter its controller: it
    claims to be lorafleet's, and is deleted. The other carries the adapter's label but another
    manager and a plain owner reference: it is not lorafleet's and could be another
    controller's, so it stays, reported once in a Warning Event, and is not among the slices a
    gateway may trust; the operator's own slices are untouched."""
    kube_cluster, ns, operator, written = routed.cluster, routed.ns, routed.operator, routed.written
    original = next(iter(written.values()))
    adapter = kube_cluster.kubectl_json("get", "la", ADAPTER, "-n", ns, as_user=TENANT)
    owner = {"apiVersion": adapter["apiVersion"], "kind": "LoraAdapter", "name": ADAPTER, "uid": adapter["metadata"]["uid"]}

    def forged(name: str, labels: dict[str, str], ip: str, *, controller: bool) -> dict[str, Any]:
        return {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": name, "labels": labels, "ownerReferences": [{**owner, "controller": controller}]},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
            "ports": original["ports"],
        }

    impostor = forged("victim-impostor", dict(original["metadata"]["labels"]), NOWHERE[1], controller=True)
    lookalike_labels = {SERVICE_NAME_LABEL: DEFAULT_SERVICE, ADAPTER_LABEL: ADAPTER, MANAGED_BY_LABEL: "gateway.example.com"}
    lookalike = forged("victim-lookalike", lookalike_labels, NOWHERE[2], controller=False)
    for body in (impostor, lookalike):
        as_tenant(kube_cluster, "create", "-n", ns, "-f", "-", input=json.dumps(body))

    wait_for(lambda: "victim-impostor" not in slices(kube_cluster, ns), 60, "the impostor deleted", operator)
    wait_for(lambda: len(events(kube_cluster, ns, "ImpostorEndpointSliceDeleted")) == 1, 60, "its Warning Event", operator)
    wait_for(lambda: len(events(kube_cluster, ns, "UntrustedEndpointSlice")) == 1, 60, "the lookalike reported", operator)
    kept = slices(kube_cluster, ns)
    assert set(kept) == {*written, "victim-lookalike"}
    assert not claims_lorafleet(kept["victim-lookalike"])
    assert "victim-lookalike" in events(kube_cluster, ns, "UntrustedEndpointSlice")[0]["message"]
    assert trusted(kube_cluster, ns).keys() == written.keys()
    assert NOWHERE[2] not in addresses(trusted(kube_cluster, ns))
    assert restored(kube_cluster, ns, written)


def test_a_stored_slice_has_the_essence_of_the_body_written(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
) -> None:
    """The operator compares what it reads with what it wrote by :func:`slice_essence`: the API
    server must store a slice with the essence it was sent, or every event of the operator's
    own writes would look like tampering. In-process, the real API server, no operator."""
    ns = kube_namespace
    apply(kube_cluster, ns, adapter_manifest("kept", Path("/nowhere")))
    adapter = adapter_of(kube_cluster.kubectl_json("get", "la", "kept", "-n", ns))
    api = make_api_client(str(kube_cluster.kubeconfig))
    pods = [test_routing.pod("p0", "10.0.0.1", 50051), test_routing.pod("p1", "10.0.0.2", 50051)]
    results = [test_routing.loaded(p.name) for p in pods]

    async def publish() -> Runtime:
        settings = Settings.from_env()
        agents = AgentClients(settings)
        try:
            rt = Runtime(settings=settings, kube=Kube(api), agents=agents)
            assert await publish_slices(rt, adapter.ref, FleetSpec(), pods, results, new=True)
            return rt
        finally:
            await agents.close()

    try:
        rt = asyncio.run(publish())
    finally:
        api.close()
    (published,) = rt.caches.published_slices.values()
    stored = slices(kube_cluster, ns, f"{ADAPTER_LABEL}=kept")
    assert stored.keys() == set(published.names())
    for body in published.slices:
        assert slice_essence(stored[body["metadata"]["name"]]) == slice_essence(body)
        assert claims_lorafleet(body)
