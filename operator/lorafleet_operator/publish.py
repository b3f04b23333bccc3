"""Writing a LoraAdapter's status, and the Kubernetes Events that go with phase changes.

Status is written only when it differs from what is stored (the drift check runs often, and a
no-op write would still bump resourceVersion and wake every watcher). An Event is posted when
the phase changes: Normal for Ready, Warning for Degraded and Failed; and a Warning
``UnloadIncomplete`` when a deletion had to give up on an agent.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from lorafleet_operator import metrics
from lorafleet_operator.reasons import EventReason
from lorafleet_operator.resources import AdapterObject, FleetObject, ObjectRef
from lorafleet_operator.runtime import Runtime

log = logging.getLogger(__name__)

WARNING_PHASES = frozenset({"Degraded", "Failed"})
#: Event messages are cut to this length (an Event is a notice; the status has the details).
MAX_EVENT_MESSAGE = 1024


def unchanged(previous: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Whether every field of ``status`` already has this value in ``previous``."""
    return all(previous.get(k) == v for k, v in status.items())


def post_phase_event(ref: ObjectRef, old_phase: str | None, status: Mapping[str, Any]) -> None:
    """A Kubernetes Event when the phase moved (kopf posts it asynchronously)."""
    phase = status.get("phase")
    if not phase or phase == old_phase:
        return
    ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), None)
    message = f"{old_phase or 'new'} -> {phase}: {ready['message'] if ready else ''}"
    if status.get("message"):
        message += f"; {status['message']}"
    post_event(ref, "Warning" if phase in WARNING_PHASES else "Normal", str(phase), message)


def post_event(ref: ObjectRef, type_: str, reason: str, message: str) -> None:
    """A Kubernetes Event about this object (kopf posts it asynchronously)."""
    try:
        kopf.event(kopf.Body(ref.to_reference()), type=type_, reason=reason, message=message[:MAX_EVENT_MESSAGE])
    except LookupError:
        # Outside a running operator (no kopf context: unit use of this module) nothing posts.
        log.debug("no kopf context; event %s not posted", reason)


#: API answers that refuse a patch for what it is (schema or size), not for the moment:
#: 400 Bad Request, 413 Request Entity Too Large, 422 Invalid. Sending it again cannot help.
REFUSED_CODES = frozenset({400, 413, 422})


async def _patch_once(
    rt: Runtime,
    ref: ObjectRef,
    status: Mapping[str, Any],
    patch: Callable[[str, str, Mapping[str, Any]], Awaitable[dict[str, Any] | None]],
) -> bool:
    """Send a status patch unless the API server already refused this very patch; a refusal
    is reported (log line, Warning Event, ``lorafleet_status_refused_total``) and
    remembered, so the same patch is never sent again (a different status is). Returns
    whether the status was written."""
    key = (ref.kind, ref.namespace, ref.name)
    digest = hashlib.sha256(json.dumps(status, sort_keys=True, default=str).encode()).hexdigest()
    refused = rt.caches.refused_status
    if refused.get(key) == digest:
        return False
    try:
        written = await patch(ref.namespace, ref.name, status)
    except ApiException as err:
        if err.status not in REFUSED_CODES:
            raise
        refused[key] = digest
        metrics.STATUS_REFUSED.labels(kind=ref.kind).inc()
        reason = f"{err.status} {err.reason}: {(err.body or '')[: MAX_EVENT_MESSAGE // 2]}"
        log.error(
            "status of %s %s/%s refused by the API server (%s); this status is not sent again",
            ref.kind,
            ref.namespace,
            ref.name,
            reason,
        )
        await _report_refusal(rt, ref, reason)
        return False
    refused.pop(key, None)
    return written is not None


async def _report_refusal(rt: Runtime, ref: ObjectRef, reason: str) -> None:
    """A Warning Event ``StatusRefused`` on the object (best effort: the log line stays)."""
    reference = ref.to_reference()
    involved = {"apiVersion": reference["apiVersion"], "kind": ref.kind, "name": ref.name, "uid": ref.uid}
    try:
        await rt.kube.post_event(
            ref.namespace,
            involved,
            "Warning",
            EventReason.STATUS_REFUSED,
            f"the API server refused the status update: {reason}"[:MAX_EVENT_MESSAGE],
        )
    except ApiException as err:
        log.warning("event StatusRefused not posted: %s %s", err.status, err.reason)


async def publish_status(rt: Runtime, adapter: AdapterObject, status: Mapping[str, Any]) -> bool:
    """Write a LoraAdapter's ``status`` unless it is already stored (or this very patch was
    refused before); post an Event on a phase change. Returns whether anything was written."""
    if unchanged(adapter.status, status):
        return False
    written = await _patch_once(rt, adapter.ref, status, rt.kube.patch_adapter_status)
    if written:
        post_phase_event(adapter.ref, adapter.status.get("phase"), status)
    return written


async def publish_fleet_status(rt: Runtime, fleet: FleetObject, status: Mapping[str, Any]) -> bool:
    """Write a LoraFleet's ``status`` unless it is already stored, or refused before."""
    if unchanged(fleet.status, status):
        return False
    return await _patch_once(rt, fleet.ref, status, rt.kube.patch_fleet_status)
