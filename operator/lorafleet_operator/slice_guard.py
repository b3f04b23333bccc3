"""The operator owns its EndpointSlices (docs/operator.md, "Routing trust").

kopf's watch of the watched namespaces' EndpointSlices (``handlers.on_endpoint_slice_event``)
hands every event here, and the slice is judged against what this process last wrote for its
adapter (``Caches.published_slices``):

* one of the adapter's slices, changed or deleted by someone else: the adapter's slices are
  written again as the operator keeps them (a Warning Event ``EndpointSliceRestored``);
* a slice that claims to be lorafleet's (:func:`~lorafleet_operator.routing.claims_lorafleet`)
  and is not one the operator wants: deleted (a Warning Event ``ImpostorEndpointSliceDeleted``);
* a slice that only carries the adapter's label: reported once (``UntrustedEndpointSlice``)
  and left alone, since it may be another controller's.

The judgement runs under the adapter's lock, so a write of this process is seen whole: the
events of its own writes find the slices as written, and do nothing. An adapter this process
has written no slices for (it just started, or its last write failed) is left to its next
reconcile, whose write lists the adapter's slices and does the same.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from lorafleet_operator.failures import KUBE_API_ERRORS, kube_reason
from lorafleet_operator.publish import post_event
from lorafleet_operator.reasons import EventReason
from lorafleet_operator.resources import ObjectRef
from lorafleet_operator.routing import (
    ADAPTER_ANNOTATION,
    ADAPTER_LABEL,
    adapter_label,
    claims_lorafleet,
    restore_slices,
    slice_essence,
    warn_untrusted,
)
from lorafleet_operator.runtime import PublishedSlices, Runtime

log = logging.getLogger(__name__)

#: The tail of the name of every slice the operator writes (``<adapter>-<8 hex digits>``).
_OWN_NAME_TAIL = re.compile(r"-[0-9a-f]{8}")


def _candidates(body: Mapping[str, Any]) -> list[str]:
    """The adapters a slice may be about, most telling first: its name (the operator's are
    ``<adapter>-<digest>``, and nobody can rename a slice), its annotation, its label, its
    LoraAdapter owners."""
    meta = body.get("metadata") or {}
    owners = [str(o.get("name", "")) for o in meta.get("ownerReferences") or [] if o.get("kind") == "LoraAdapter"]
    found = [
        str(meta.get("name", "")).rpartition("-")[0],
        str((meta.get("annotations") or {}).get(ADAPTER_ANNOTATION, "")),
        str((meta.get("labels") or {}).get(ADAPTER_LABEL, "")),
        *owners,
    ]
    return list(dict.fromkeys(c for c in found if c))


async def guard_slice(rt: Runtime, event_type: str | None, body: Mapping[str, Any]) -> None:
    """Judge one watch event of an EndpointSlice (``event_type`` as kopf gives it: ADDED,
    MODIFIED, DELETED, or None for its initial listing) and act on it (module docstring)."""
    meta = body.get("metadata") or {}
    namespace = str(meta.get("namespace", ""))
    deleted = event_type == "DELETED"
    if deleted:
        rt.caches.untrusted_slices.discard(str(meta.get("uid", "")))
    for candidate in _candidates(body):
        key = (namespace, candidate)
        # Only adapters this process knows: a forged label must not make it keep a lock per name.
        if key not in rt.caches.published_slices and key not in rt.locks.adapters:
            continue
        async with rt.locks.adapter(*key):
            published = rt.caches.published_slices.get(key)
            if published is not None:
                await _judge(rt, ObjectRef("LoraAdapter", namespace, candidate, published.uid), published, body, deleted=deleted)
                return


async def _judge(rt: Runtime, ref: ObjectRef, published: PublishedSlices, body: Mapping[str, Any], *, deleted: bool) -> None:
    """Act on one slice event about an adapter whose slices this process wrote."""
    name = str(body["metadata"].get("name", ""))
    wanted = next((s for s in published.slices if s["metadata"]["name"] == name), None)
    if wanted is not None:
        if deleted or slice_essence(body) != slice_essence(wanted):
            await _restore(rt, ref, published, name, "deleted" if deleted else "changed")
    elif deleted:
        return
    elif claims_lorafleet(body):
        await _delete_impostor(rt, ref, body)
    elif (body["metadata"].get("labels") or {}).get(ADAPTER_LABEL) == adapter_label(ref.name):
        warn_untrusted(rt, ref, body)


async def _restore(rt: Runtime, ref: ObjectRef, published: PublishedSlices, name: str, what: str) -> None:
    """Write the adapter's slices again; a Warning Event when something had to change (a late
    event of the operator's own earlier write finds nothing to do, and says nothing)."""
    if not await restore_slices(rt, ref, published):
        return
    message = (
        f"EndpointSlice {name!r} was {what} by someone other than the operator: the adapter's slices are written again as it keeps them"
    )
    log.warning("loraadapter %s/%s: %s", ref.namespace, ref.name, message)
    post_event(ref, "Warning", EventReason.ENDPOINT_SLICE_RESTORED, message)


async def _delete_impostor(rt: Runtime, ref: ObjectRef, body: Mapping[str, Any]) -> None:
    """Delete a slice that claims to be the adapter's and is not one the operator wants. One
    named and owned as the operator names its own is a slice it wrote before and has since
    deleted (this event came late): deleted again quietly."""
    meta = body["metadata"]
    name = str(meta.get("name", ""))
    try:
        await rt.kube.delete_endpoint_slice(ref.namespace, name)
    except KUBE_API_ERRORS as err:
        # The next reconcile lists the adapter's slices and deletes it.
        rt.caches.slices.pop((ref.namespace, ref.name), None)
        log.warning("endpointslice %s/%s not deleted: Kubernetes API: %s", ref.namespace, name, kube_reason(err))
        return
    tail = name.removeprefix(f"{ref.name}")
    if _OWN_NAME_TAIL.fullmatch(tail) and any(o.get("uid") == ref.uid for o in meta.get("ownerReferences") or []):
        log.info("endpointslice %s/%s: an earlier write of the operator, deleted again", ref.namespace, name)
        return
    message = (
        f"EndpointSlice {name!r} claimed to be this adapter's (lorafleet's managed-by label or a LoraAdapter as its "
        "controller) but was not written by the operator: deleted"
    )
    log.warning("loraadapter %s/%s: %s", ref.namespace, ref.name, message)
    post_event(ref, "Warning", EventReason.IMPOSTOR_ENDPOINT_SLICE_DELETED, message)
