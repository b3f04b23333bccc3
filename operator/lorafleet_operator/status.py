"""LoraAdapter status from per-agent results (docs/operator.md, "Status semantics").

Each agent's reply is already merged over its ranks by the agent; here the agents' results are
merged failure-first with the one rule, :func:`lorafleet_common.merge.merge_failure_first`, into
the resource's ``message``, and summarised as ``phase``, totals and conditions. ``phase`` is only a
convenience for ``kubectl get``; the conditions (``Ready`` first) are the truth.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lorafleet_common.merge import merge_failure_first
from lorafleet_operator.placement import Placement

# The caps that keep a LoraAdapter's and a LoraFleet's status bounded however big the fleet
# (the one place for them; tests/operator/test_placement.py checks that the CRDs' maxItems
# and maxLength say the same, and that the largest status they allow stays under
# STATUS_BUDGET). Longer messages are cut and longer lists shortened, never refused.
#: status.message and every condition message.
MAX_MESSAGE = 8192
#: One agent's message (LoraAdapter agents[].message, LoraFleet members[].message).
MAX_AGENT_MESSAGE = 1024
#: Agents listed in a LoraAdapter's agents[] (failing ones first); the rest are counted.
MAX_LISTED_AGENTS = 32
#: Pods listed in status.placement.placed, and skipped agents in .skipped (with a message).
MAX_LISTED_PLACED = 64
MAX_LISTED_SKIPS = 16
MAX_SKIP_MESSAGE = 256
#: Members listed in a LoraFleet's status (not ready ones first); the rest are counted.
MAX_LISTED_MEMBERS = 64
#: The largest status the caps allow stays under this (the whole object: at most 256 KiB).
STATUS_BUDGET = 160 * 1024
#: The Ready condition's reason for a generation whose loads crashed agents (failures.CrashBook).
LOAD_CRASHED_AGENT = "LoadCrashedAgent"
#: The Ready condition's reason when no agent holds the adapter as specified but some still
#: serve a previous version of it (a failed replace: the agents keep the old weights).
PREVIOUS_VERSION_SERVED = "PreviousVersionServed"
#: The Ready condition's reasons when placement found no agent with room (Pending), or fewer
#: than ``spec.replicas`` (Degraded).
NO_ROOM = "NoRoom"
NOT_ENOUGH_ROOM = "NotEnoughRoom"
#: Listing order of agents[]: failing first, so a capped list never hides a failure.
_LISTING_ORDER = {"Failed": 0, "Unreachable": 1, "Loaded": 2}


class Phase(enum.StrEnum):
    PENDING = "Pending"
    LOADING = "Loading"
    READY = "Ready"
    DEGRADED = "Degraded"
    FAILED = "Failed"
    TERMINATING = "Terminating"


class AgentState(enum.StrEnum):
    LOADED = "Loaded"
    FAILED = "Failed"  # the agent refused the adapter (permanent until something changes)
    UNREACHABLE = "Unreachable"  # a transient error: retried with back-off


@dataclass(frozen=True)
class ServedVersion:
    """A version of the adapter an agent holds that is not the one the spec asks for (its
    registry entry's source and digest): what it still serves after a failed replace."""

    uri: str
    sha256: str = ""

    def to_status(self) -> dict[str, str]:
        return {"uri": self.uri, **({"sha256": self.sha256} if self.sha256 else {})}


@dataclass(frozen=True)
class AgentResult:
    """What one target agent holds of one adapter (its reply, merged over its ranks).

    ``served``: a failed agent still holds a previous version (not the spec's). ``next_retry``:
    when the operator tries this agent again (RFC 3339), "" when no retry is scheduled."""

    pod: str
    state: AgentState
    ranks_loaded: int
    ranks_total: int
    message: str = ""
    served: ServedVersion | None = None
    next_retry: str = ""

    @property
    def ok(self) -> bool:
        return self.state is AgentState.LOADED and self.ranks_loaded == self.ranks_total

    @property
    def serving(self) -> bool:
        """Whether the agent serves the adapter at all: this version, or a previous one."""
        return self.ok or self.served is not None

    def to_status(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "pod": self.pod,
            "state": str(self.state),
            "ranksLoaded": self.ranks_loaded,
            "ranksTotal": self.ranks_total,
            "message": self.message[:MAX_AGENT_MESSAGE],
        }
        if self.served is not None:
            entry["served"] = self.served.to_status()
        if self.next_retry:
            entry["nextRetryTime"] = self.next_retry
        return entry


def phase_of(results: Sequence[AgentResult], *, deleting: bool = False) -> Phase:
    """The phase for a set of target-agent results.

    Ready needs every target agent to hold the adapter on every rank. With no target there is
    nothing to be ready on: Pending. Any agent still reachable-but-not-done (or unreachable)
    and no permanent failure yet means Loading; permanent failures give Failed when no agent
    holds the adapter and Degraded when some do, or when some still serve a previous version
    (a failed replace leaves the old weights routed: the status says what the agents serve).
    """
    if deleting:
        return Phase.TERMINATING
    if not results:
        return Phase.PENDING
    loaded = sum(r.ok for r in results)
    if loaded == len(results):
        return Phase.READY
    failed = any(r.state is AgentState.FAILED for r in results)
    if loaded or any(r.serving for r in results):
        return Phase.DEGRADED
    return Phase.FAILED if failed else Phase.LOADING


def merged_message(results: Sequence[AgentResult]) -> str:
    """The failure-first merged message over the agents ("" when all hold the adapter)."""
    if not results:
        return ""
    merged = merge_failure_first(results, ok=lambda r: r.ok, error=lambda r: r.message)
    return merged.error[:MAX_MESSAGE]


def _ready_condition(
    phase: Phase, results: Sequence[AgentResult], pending_reason: str, pending_message: str, crashed: str
) -> tuple[str, str, str]:
    """(status, reason, message) of the Ready condition."""
    loaded = sum(r.ok for r in results)
    failing = [r.pod for r in results if not r.ok]
    if crashed and phase in (Phase.FAILED, Phase.DEGRADED):
        return "False", LOAD_CRASHED_AGENT, crashed
    if phase is Phase.READY:
        return "True", "AllAgentsLoaded", f"{loaded}/{len(results)} agents hold the adapter on every rank"
    if phase is Phase.PENDING:
        return "False", pending_reason, pending_message
    if phase is Phase.TERMINATING:
        return "False", "Terminating", "unloading from every agent"
    not_ok = f"{loaded}/{len(results)} agents hold the adapter; not on {', '.join(failing)}"
    if phase is Phase.LOADING:
        return "Unknown", "Loading", not_ok
    if phase is Phase.DEGRADED and not loaded:
        old = [r for r in results if r.served is not None]
        sources = sorted({r.served.uri for r in old if r.served is not None})
        return (
            "False",
            PREVIOUS_VERSION_SERVED,
            (
                f"no agent holds the adapter as specified; {', '.join(r.pod for r in old)} still "
                f"serve(s) a previous version ({', '.join(sources)}); {not_ok}"
            ),
        )
    if phase is Phase.DEGRADED:
        return "False", "PartiallyLoaded", not_ok
    return "False", "LoadFailed", not_ok


def _degraded_condition(results: Sequence[AgentResult]) -> tuple[str, str, str]:
    failed = [r for r in results if r.state in (AgentState.FAILED, AgentState.UNREACHABLE)]
    if not failed:
        return "False", "NoAgentFailing", "no target agent reports an error"
    names = ", ".join(f"{r.pod} ({r.state})" for r in failed)
    return "True", "AgentsFailing", f"failing on {names}: {merged_message(results)}"[:MAX_MESSAGE]


def condition(
    type_: str, status: str, reason: str, message: str, generation: int, previous: Sequence[Mapping[str, Any]], now: str
) -> dict[str, Any]:
    """One metav1.Condition; lastTransitionTime moves only when the status changes."""
    old = next((c for c in previous if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status else now
    return {
        "type": type_,
        "status": status,
        "reason": reason,
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


def listed(results: Sequence[AgentResult]) -> list[AgentResult]:
    """The agents that agents[] lists: at most :data:`MAX_LISTED_AGENTS`, failing ones
    chosen first (Failed, then Unreachable, then Loaded), shown in pod order."""
    chosen = sorted(results, key=lambda r: (_LISTING_ORDER.get(str(r.state), 3), r.pod))
    return sorted(chosen[:MAX_LISTED_AGENTS], key=lambda r: r.pod)


def placement_status(placement: Placement, previous: Mapping[str, Any]) -> dict[str, Any]:
    """status.placement: where the adapter is placed and why the other agents are not
    (both lists capped; the counts are whole). ``replicas`` is left out when unset, and
    written as None (a merge patch removes it) only when the stored one (``previous``) has it:
    a nested None that is never stored would make every status look changed."""
    skips = sorted(placement.skipped, key=lambda s: (s.reason == "ReplicasReached", s.pod))
    replicas = {"replicas": placement.replicas} if placement.replicas is not None or "replicas" in previous else {}
    return {
        **replicas,
        "placed": list(placement.placed[:MAX_LISTED_PLACED]),
        "placedCount": len(placement.placed),
        "skipped": [{"pod": s.pod, "reason": str(s.reason), "message": s.message[:MAX_SKIP_MESSAGE]} for s in skips[:MAX_LISTED_SKIPS]],
        "skippedCount": len(placement.skipped),
    }


def _placement_outcome(phase: Phase, placement: Placement | None, ready: tuple[str, str, str]) -> tuple[Phase, tuple[str, str, str]]:
    """Phase and Ready condition once placement is known: fewer places than ``replicas``
    asked for make an otherwise Ready adapter Degraded."""
    if placement is None or placement.replicas is None or phase is not Phase.READY:
        return phase, ready
    if len(placement.placed) >= placement.replicas:
        return phase, ready
    return Phase.DEGRADED, ("False", NOT_ENOUGH_ROOM, placement.why_not())


def build_status(
    results: Sequence[AgentResult],
    *,
    generation: int,
    previous: Mapping[str, Any] | None = None,
    deleting: bool = False,
    pending_reason: str = "NoTargetAgents",
    pending_message: str = "no ready agent of the fleet serves this base model",
    crashed: str = "",
    placement: Placement | None = None,
    now: str | None = None,
) -> dict[str, Any]:
    """The whole ``status`` of a LoraAdapter for these per-agent results.

    ``previous`` is the status as stored (for lastTransitionTime). ``crashed``: why this
    generation is sent to no agent (its loads crashed agents); the Ready condition then says
    ``LoadCrashedAgent`` with it. ``placement``: where it was placed (the results are those
    agents'); placed nowhere, it is Pending with the reason. The result is a complete status,
    written with a merge patch; list fields are replaced whole. Every list and message in it
    is capped (the caps above), so its size is bounded whatever the fleet's.
    """
    now = now or now_rfc3339()
    old_conditions = list((previous or {}).get("conditions") or [])
    ordered = sorted(results, key=lambda r: r.pod)
    if placement is not None and not placement.placed and not deleting:
        full = any(s.reason in ("Full", "Refused") for s in placement.skipped)
        pending_reason = NO_ROOM if full else pending_reason
        pending_message = placement.why_not() or pending_message
    phase = phase_of(ordered, deleting=deleting)
    ready = _ready_condition(phase, ordered, pending_reason, pending_message, crashed)
    phase, ready = _placement_outcome(phase, placement, ready)
    degraded = _degraded_condition(ordered)
    agents_ready = sum(r.ok for r in ordered)
    ranks_loaded = sum(r.ranks_loaded for r in ordered)
    ranks_total = sum(r.ranks_total for r in ordered)
    message = merged_message(ordered) or (pending_message if phase is Phase.PENDING else "")
    retries = sorted(r.next_retry for r in ordered if r.next_retry)
    shown = listed(ordered)
    return {
        "phase": str(phase),
        "observedGeneration": generation,
        "message": message[:MAX_MESSAGE],
        "agents": [r.to_status() for r in shown],
        "agentsNotListed": len(ordered) - len(shown),
        "agentsFailed": sum(r.state is AgentState.FAILED for r in ordered),
        "agentsUnreachable": sum(r.state is AgentState.UNREACHABLE for r in ordered),
        "agentsReady": agents_ready,
        "agentsTarget": len(ordered),
        "agentsSummary": f"{agents_ready}/{len(ordered)}",
        "ranksLoaded": ranks_loaded,
        "ranksTotal": ranks_total,
        "ranksSummary": f"{ranks_loaded}/{ranks_total}",
        # The earliest scheduled retry of a failed agent; None removes it (a merge patch).
        "nextRetryTime": retries[0] if retries else None,
        # None removes a stored placement (a merge patch) when there was none to make.
        "placement": (placement_status(placement, (previous or {}).get("placement") or {}) if placement is not None else None),
        "conditions": [
            condition("Ready", *ready, generation, old_conditions, now),
            condition("Degraded", *degraded, generation, old_conditions, now),
        ],
    }


def never_reconciled(status: Mapping[str, Any] | None) -> bool:
    """Whether no handler has visited the adapter yet: its status has no conditions (a
    handler's first write, :func:`initial_status`, gives it some)."""
    return not (status or {}).get("conditions")


def initial_status(generation: int) -> dict[str, Any]:
    """Conditions set on the first visit (there are none yet), before any agent answered:
    Ready is Unknown."""
    now = now_rfc3339()
    return {
        "phase": str(Phase.LOADING),
        "observedGeneration": generation,
        "conditions": [
            condition("Ready", "Unknown", "Reconciling", "asking the fleet's agents", generation, [], now),
            condition("Degraded", "Unknown", "Reconciling", "asking the fleet's agents", generation, [], now),
        ],
    }
