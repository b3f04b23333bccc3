"""Writing a LoraAdapter's status, and the Kubernetes Events that go with phase changes.

Status is written only when it differs from what is stored (the drift check runs often, and a
no-op write would still bump resourceVersion and wake every watcher). An Event is posted when
the phase changes: Normal for Ready, Warning for Degraded and Failed; and a Warning
``UnloadIncomplete`` when a deletion had to give up on an agent.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from lorafleet_operator.runtime import Runtime

log = logging.getLogger(__name__)

WARNING_PHASES = frozenset({"Degraded", "Failed"})
#: Event messages are cut to this length (an Event is a notice; the status has the details).
MAX_EVENT_MESSAGE = 1024


def unchanged(previous: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Whether every field of ``status`` already has this value in ``previous``."""
    return all(previous.get(k) == v for k, v in status.items())


def post_phase_event(body: Mapping[str, Any], old_phase: str | None,
                     status: Mapping[str, Any]) -> None:
    """A Kubernetes Event when the phase moved (kopf posts it asynchronously)."""
    phase = status.get("phase")
    if not phase or phase == old_phase:
        return
    ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), None)
    message = f"{old_phase or 'new'} -> {phase}: {ready['message'] if ready else ''}"
    if status.get("message"):
        message += f"; {status['message']}"
    post_event(body, "Warning" if phase in WARNING_PHASES else "Normal", str(phase), message)


def post_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """A Kubernetes Event about this object (kopf posts it asynchronously)."""
    try:
        kopf.event(kopf.Body(_reference(body)), type=type_, reason=reason,
                   message=message[:MAX_EVENT_MESSAGE])
    except LookupError:
        # Outside a running operator (no kopf context: unit use of this module) nothing posts.
        log.debug("no kopf context; event %s not posted", reason)


def _reference(body: Mapping[str, Any]) -> kopf.RawBody:
    """What an Event needs of its object: kind, apiVersion and metadata (name, uid, ...)."""
    return {"apiVersion": body.get("apiVersion", ""), "kind": body.get("kind", ""),
            "metadata": body.get("metadata", {})}


async def publish_status(rt: Runtime, body: Mapping[str, Any],
                         status: Mapping[str, Any]) -> bool:
    """Write ``status`` unless it is already stored; post an Event on a phase change.
    Returns whether anything was written."""
    previous = dict(body.get("status") or {})
    if unchanged(previous, status):
        return False
    meta = body["metadata"]
    written = await rt.kube.patch_adapter_status(meta["namespace"], meta["name"], status)
    if written is not None:
        post_phase_event(body, previous.get("phase"), status)
    return written is not None
