"""Routing for gateways: per LoraAdapter, EndpointSlices listing exactly the agent pods whose
every rank holds it (docs/operator.md, "Routing"), with their gRPC port, the agent's HTTP port
and, for a vLLM-backed agent, vLLM's own port.

Each slice carries ``kubernetes.io/service-name`` (the fleet's ``spec.routing.serviceName``,
by default the chart's selector-less adapter Service), ``lorafleet.dev/adapter`` and
``endpointslice.kubernetes.io/managed-by: operator.lorafleet.dev``, and is owned by the
LoraAdapter (its controller reference: garbage-collected with it; deleted explicitly too).
A slice that claims to be lorafleet's (that managed-by value, or a LoraAdapter as its
controller) but is not one the operator wants is deleted; one that only carries the adapter's
label is never lorafleet's and is reported (:func:`warn_untrusted`), not deleted: it may be
another controller's (docs/operator.md, "Routing trust"). All endpoints of one
slice share its ports, so pods whose gRPC/HTTP port numbers differ go into separate slices
(one per port set and address family, at most :data:`MAX_ENDPOINTS` endpoints each): a
reader takes the union of the slices with the adapter's label. With no pod holding the
adapter one empty slice remains, so "no endpoint" is distinguishable from "not published".
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from lorafleet_operator.config import GROUP, VERSION
from lorafleet_operator.failures import KUBE_API_ERRORS, kube_reason
from lorafleet_operator.fleet import DEFAULT_PORT_NAME, AgentPod
from lorafleet_operator.publish import REFUSED_CODES, post_event
from lorafleet_operator.reasons import EventReason
from lorafleet_operator.resources import FleetSpec, ObjectRef
from lorafleet_operator.runtime import PublishedSlices, Runtime
from lorafleet_operator.status import AgentResult

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
#: The managed-by value of the operator's slices: a domain-qualified name, as Kubernetes' own
#: controllers use (``endpointslice-controller.k8s.io``); a label value may hold no "/".
MANAGED_BY = "operator.lorafleet.dev"
#: The adapter's name (shortened with a digest when over a label value's 63 characters; the
#: full name is in :data:`ADAPTER_ANNOTATION`).
ADAPTER_LABEL = "lorafleet.dev/adapter"
ADAPTER_ANNOTATION = "lorafleet.dev/adapter-name"
#: The Service the slices belong to when the fleet names none: the chart's selector-less
#: adapter Service of a release named "lorafleet". Not the agents' own Service: it has a
#: selector, and its DNS name would list the slices' pods again. The LoraFleet CRD's default
#: is the source: the API server fills it in only when ``spec.routing`` is there, so this and
#: :data:`DEFAULT_HTTP_PORT_NAME` stand in when it is left out, with the CRD's values
#: (tests/operator/test_routing.py compares them).
DEFAULT_SERVICE = "lorafleet-adapters"
DEFAULT_HTTP_PORT_NAME = "http"
#: The port of the vLLM container in a vLLM-backed agent pod (the chart's name; docs/vllm.md):
#: gateways and OpenAI clients talk to vLLM's own port, so a slice lists it under this name.
VLLM_HTTP_PORT_NAME = "vllm-http"
#: Endpoints per slice (the EndpointSlice controller's default).
MAX_ENDPOINTS = 100


@dataclass(frozen=True)
class RoutedPod:
    """One pod that serves the adapter: where to reach it."""

    pod: str
    uid: str
    ip: str
    #: (slice port name, port): "grpc", "http" when the pod has the agent's HTTP API port, and
    #: "vllm-http" when it has a vLLM server's.
    ports: tuple[tuple[str, int], ...]


def _digest(value: object, size: int = 10) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:size]


def adapter_label(name: str) -> str:
    """The ``lorafleet.dev/adapter`` value of an adapter (label values have at most 63
    characters; a longer name is cut and made unique with a digest)."""
    return name if len(name) <= 63 else f"{name[:52]}-{_digest(name)}"


def _routable(ip: str) -> bool:
    """Whether an address may be listed: the API server refuses loopback addresses in
    EndpointSlices (only a local test harness gives pods one; nothing else could reach it)."""
    try:
        return not ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def routed_pods(fleet_spec: FleetSpec, agents: Sequence[AgentPod], results: Sequence[AgentResult]) -> list[RoutedPod]:
    """The Ready agent pods that can serve the adapter now, with their ports: those that hold
    it on every rank, or on standby with room to load it (:attr:`AgentResult.serves_now`)."""
    holding = {r.pod for r in results if r.serves_now}
    grpc_name = fleet_spec.grpc_port_name or DEFAULT_PORT_NAME
    http_name = fleet_spec.http_port_name or DEFAULT_HTTP_PORT_NAME
    chosen = []
    for agent in agents:
        ports = dict(agent.ports)
        if agent.name not in holding or not agent.dialable or not _routable(agent.ip) or grpc_name not in ports:
            continue
        routed = [("grpc", ports[grpc_name])]
        if http_name in ports:
            routed.append(("http", ports[http_name]))
        if VLLM_HTTP_PORT_NAME in ports:
            routed.append((VLLM_HTTP_PORT_NAME, ports[VLLM_HTTP_PORT_NAME]))
        chosen.append(RoutedPod(agent.name, agent.uid, agent.ip, tuple(routed)))
    return sorted(chosen, key=lambda p: p.pod)


def desired_slices(adapter: ObjectRef, service: str, pods: Sequence[RoutedPod]) -> list[dict[str, Any]]:
    """The EndpointSlices of one adapter: one per (address family, port set), each at most
    :data:`MAX_ENDPOINTS` endpoints; one empty slice when no pod holds it."""
    groups: dict[tuple[str, tuple[tuple[str, int], ...]], list[RoutedPod]] = {}
    for pod in pods:
        groups.setdefault(("IPv6" if ":" in pod.ip else "IPv4", pod.ports), []).append(pod)
    if not groups:
        groups[("IPv4", ())] = []
    slices = []
    for (family, ports), members in sorted(groups.items()):
        chunks = [members[i : i + MAX_ENDPOINTS] for i in range(0, len(members), MAX_ENDPOINTS)]
        for index, chunk in enumerate(chunks or [[]]):
            slices.append(_slice(adapter, service, family, ports, chunk, index))
    return slices


def _slice(
    adapter: ObjectRef, service: str, family: str, ports: tuple[tuple[str, int], ...], pods: Sequence[RoutedPod], index: int
) -> dict[str, Any]:
    name = f"{adapter.name}-{_digest([family, ports, index], 8)}"
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": adapter.namespace,
            "labels": {SERVICE_NAME_LABEL: service, MANAGED_BY_LABEL: MANAGED_BY, ADAPTER_LABEL: adapter_label(adapter.name)},
            "annotations": {ADAPTER_ANNOTATION: adapter.name},
            "ownerReferences": [
                {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LoraAdapter", "name": adapter.name, "uid": adapter.uid, "controller": True}
            ],
        },
        "addressType": family,
        "endpoints": [
            {
                "addresses": [p.ip],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "targetRef": {"kind": "Pod", "namespace": adapter.namespace, "name": p.pod, "uid": p.uid},
            }
            for p in pods
        ],
        "ports": [{"name": n, "port": port, "protocol": "TCP"} for n, port in ports],
    }


def _selector(name: str) -> str:
    """Every slice with the adapter's label, whoever wrote it: the operator's, impostors that
    claim to be (deleted), and others (reported)."""
    return f"{ADAPTER_LABEL}={adapter_label(name)}"


def claims_lorafleet(slice_: Mapping[str, Any]) -> bool:
    """Whether a slice claims to be the operator's: lorafleet's managed-by value, or a
    LoraAdapter as its controller. Only the operator may make either claim, so a slice that
    makes one and is not one the operator wants is an impostor (or its own stale write)."""
    meta = slice_.get("metadata") or {}
    if (meta.get("labels") or {}).get(MANAGED_BY_LABEL) == MANAGED_BY:
        return True
    return any(
        o.get("controller") and o.get("kind") == "LoraAdapter" and str(o.get("apiVersion", "")).startswith(f"{GROUP}/")
        for o in meta.get("ownerReferences") or []
    )


def slice_essence(slice_: Mapping[str, Any]) -> str:
    """A digest of what a slice says (labels, annotations, owners, finalizers, addresses,
    endpoints, ports), without what the API server keeps about it (resourceVersion, uid,
    timestamps, managed fields): a stored slice has the essence of the body written."""
    meta = slice_.get("metadata") or {}
    return _digest(
        [
            meta.get("labels") or {},
            meta.get("annotations") or {},
            meta.get("ownerReferences") or [],
            meta.get("finalizers") or [],
            slice_.get("addressType"),
            slice_.get("endpoints") or [],
            slice_.get("ports") or [],
        ]
    )


def warn_untrusted(rt: Runtime, adapter: ObjectRef, slice_: Mapping[str, Any]) -> None:
    """Report, once per slice, a slice that carries the adapter's label but does not claim to
    be lorafleet's: no gateway may route by it. It is left in place (it may be another
    controller's, e.g. mirrored from someone's Endpoints, which would write it again)."""
    meta = slice_.get("metadata") or {}
    uid = str(meta.get("uid", ""))
    if uid in rt.caches.untrusted_slices:
        return
    rt.caches.untrusted_slices.add(uid)
    manager = (meta.get("labels") or {}).get(MANAGED_BY_LABEL)
    message = (
        f"EndpointSlice {meta.get('name')!r} carries {ADAPTER_LABEL}={adapter_label(adapter.name)} but is not lorafleet's "
        f"({MANAGED_BY_LABEL}: {manager or 'none'}; not written by the operator): gateways must not route by it; left in place"
    )
    log.warning("loraadapter %s/%s: %s", adapter.namespace, adapter.name, message)
    post_event(adapter, "Warning", EventReason.UNTRUSTED_ENDPOINT_SLICE, message)


async def publish_slices(
    rt: Runtime,
    adapter: ObjectRef,
    fleet_spec: FleetSpec,
    agents: Sequence[AgentPod],
    results: Sequence[AgentResult],
    *,
    new: bool = False,
) -> bool:
    """Make the adapter's EndpointSlices list exactly the pods that hold it; only when they
    changed since this process last wrote them. Returns whether anything was written. A
    transient API error is logged and left to the next reconcile; slices the API server
    refuses for what they are are logged and not sent again until they change. ``new``: the
    adapter had no status when its reconcile began, so no process has written slices for it
    (every reconcile writes the status before its slices): they are created without a list
    first (:func:`_write`)."""
    service = fleet_spec.service_name or DEFAULT_SERVICE
    wanted = desired_slices(adapter, service, routed_pods(fleet_spec, agents, results))
    key, digest = (adapter.namespace, adapter.name), _digest([adapter.uid, wanted])
    if rt.caches.slices.get(key) == digest:
        return False
    try:
        await _write(rt, adapter, wanted, new=new)
    except ApiException as err:
        if err.status not in REFUSED_CODES:
            return _not_written(adapter, err)
        # Refused for what it is: the same slices are not sent again (a change is).
        rt.caches.slices[key] = digest
        log.error(
            "endpointslices of loraadapter %s/%s refused by the API server: %s %s: %s",
            adapter.namespace,
            adapter.name,
            err.status,
            err.reason,
            (err.body or "")[:512],
        )
        return False
    except KUBE_API_ERRORS as err:
        return _not_written(adapter, err)
    rt.caches.slices[key] = digest
    rt.caches.published_slices[key] = PublishedSlices(adapter.uid, tuple(wanted))
    log.info(
        "endpointslices of loraadapter %s/%s: %d pod(s) in %d slice(s)",
        adapter.namespace,
        adapter.name,
        sum(len(s["endpoints"]) for s in wanted),
        len(wanted),
    )
    return True


def _not_written(ref: ObjectRef, err: BaseException) -> bool:
    log.warning(
        "endpointslices of loraadapter %s/%s not written: Kubernetes API: %s; again at the next reconcile",
        ref.namespace,
        ref.name,
        kube_reason(err),
    )
    return False


async def _write(rt: Runtime, ref: ObjectRef, wanted: Sequence[Mapping[str, Any]], *, new: bool = False) -> int:
    """Create or replace the wanted slices, and delete the others that claim to be the
    adapter's (:func:`claims_lorafleet`); report those that only carry its label. A ``new``
    adapter's are created straight away: a thousand adapters created at once were a LIST
    each, filtered by label over every slice of the namespace; one that exists after all
    (409 Conflict) sends the write down the listing path. Returns how many slices it
    created, replaced or deleted (none: they were as wanted already)."""
    # Until this write completes the adapter's slices are not known by name.
    known = rt.caches.published_slices.pop((ref.namespace, ref.name), None)
    if new and known is None and await _created(rt, ref, wanted):
        return len(wanted)
    existing = {s["metadata"]["name"]: s for s in await rt.kube.list_endpoint_slices(ref.namespace, _selector(ref.name))}
    changed = 0
    for slice_ in wanted:
        name = slice_["metadata"]["name"]
        old = existing.pop(name, None)
        if old is None:
            await _create_or_replace(rt, ref.namespace, slice_)
        elif slice_essence(old) != slice_essence(slice_):
            current = {**slice_, "metadata": {**slice_["metadata"], "resourceVersion": old["metadata"]["resourceVersion"]}}
            await rt.kube.replace_endpoint_slice(ref.namespace, name, current)
        else:
            continue
        changed += 1
    for name, other in existing.items():
        if claims_lorafleet(other):
            await rt.kube.delete_endpoint_slice(ref.namespace, name)
            changed += 1
        else:
            warn_untrusted(rt, ref, other)
    return changed


async def _create_or_replace(rt: Runtime, namespace: str, slice_: Mapping[str, Any]) -> None:
    """Create a slice the listing did not show; one of that name that exists after all (its
    labels were taken off, so the label selector missed it) is replaced unconditionally."""
    try:
        await rt.kube.create_endpoint_slice(namespace, slice_)
    except ApiException as err:
        if err.status != 409:
            raise
        await rt.kube.replace_endpoint_slice(namespace, slice_["metadata"]["name"], slice_)


async def restore_slices(rt: Runtime, ref: ObjectRef, published: PublishedSlices) -> int:
    """Write the adapter's slices as this process last wrote them again (someone else changed
    or deleted one); returns how many it had to create, replace or delete (none: the event
    that called for it was late, they are as kept). On an API error they are left to the next
    reconcile, which then writes whatever it finds changed."""
    key = (ref.namespace, ref.name)
    try:
        changed = await _write(rt, ref, published.slices)
    except KUBE_API_ERRORS as err:
        rt.caches.slices.pop(key, None)
        _not_written(ref, err)
        return 0
    rt.caches.published_slices[key] = published
    return changed


async def _created(rt: Runtime, ref: ObjectRef, wanted: Sequence[Mapping[str, Any]]) -> bool:
    """Create every wanted slice; False at the first that already exists (409), which leaves
    the rest to the listing write."""
    for slice_ in wanted:
        try:
            await rt.kube.create_endpoint_slice(ref.namespace, slice_)
        except ApiException as err:
            if err.status != 409:
                raise
            return False
    return True


async def remove_slices(rt: Runtime, namespace: str, name: str, uid: str) -> int:
    """Delete a deleted adapter's EndpointSlices (the owner reference would let the garbage
    collector do it too, later); returns how many were asked to go. Those this process wrote
    last are deleted by name (one request each, none to list them: a thousand deletions at once
    were a LIST each more on the API server); otherwise (written by an earlier process, or a
    write that did not complete) they are listed first."""
    rt.caches.slices.pop((namespace, name), None)
    known = rt.caches.published_slices.pop((namespace, name), None)
    if known is not None and known.uid == uid:
        names = list(known.names())
    else:
        listed = await rt.kube.list_endpoint_slices(namespace, _selector(name))
        names = [s["metadata"]["name"] for s in listed if any(o.get("uid") == uid for o in s["metadata"].get("ownerReferences") or [])]
    for slice_name in names:
        await rt.kube.delete_endpoint_slice(namespace, slice_name)
    return len(names)
