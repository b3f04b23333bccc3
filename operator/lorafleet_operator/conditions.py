"""metav1.Condition as every lorafleet status writes it, and times as Kubernetes writes them."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

#: status.message and every condition message are cut to this (the CRDs' maxLength agrees).
MAX_MESSAGE = 8192


def condition(
    type_: str, status: str, reason: str, message: str, *, generation: int, previous: Sequence[Mapping[str, Any]], now: str
) -> dict[str, Any]:
    """One metav1.Condition; lastTransitionTime moves only when the status changes."""
    old = next((c for c in previous if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status else now
    return {
        "type": type_,
        "status": status,
        "reason": str(reason),
        "message": message[:MAX_MESSAGE],
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def now_rfc3339() -> str:
    """The current time the way Kubernetes writes it (seconds, UTC, Z)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339(timestamp: float) -> str:
    """A Unix time the way Kubernetes writes it, rounded up to the second (a retry is never
    shown earlier than it is due)."""
    return dt.datetime.fromtimestamp(-(-timestamp // 1), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
