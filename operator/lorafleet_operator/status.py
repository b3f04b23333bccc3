"""LoraAdapter status from per-agent results (docs/operator.md, "Status semantics"), and
LoraFleet status from a look at the fleet.

Each agent's reply is already merged over its ranks by the agent; here the agents' results are
merged failure-first with the one rule, :func:`lorafleet_common.merge.merge_failure_first`, into
the resource's ``message``, and summarised as ``phase``, totals and conditions. ``phase`` is only a
convenience for ``kubectl get``; the conditions (``Ready`` first) are the truth.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lorafleet_common.merge import merge_failure_first
from lorafleet_operator.agent_values import AgentError, AgentInfo, SourceRevision
from lorafleet_operator.conditions import MAX_MESSAGE, condition, now_rfc3339
from lorafleet_operator.fleet import AgentPod
from lorafleet_operator.placement import Placement, SkipReason
from lorafleet_operator.reasons import Reason
from lorafleet_operator.resources import FleetObject
from lorafleet_operator.source_revisions import recorded_source
from lorafleet_operator.view import FleetView, Registry

# The caps that keep a LoraAdapter's and a LoraFleet's status bounded however big the fleet
# (the one place for them; tests/operator/test_placement.py checks that the CRDs' maxItems
# and maxLength say the same, and that the largest status they allow stays under
# STATUS_BUDGET). Longer messages are cut and longer lists shortened, never refused.
#: status.message and every condition message: :data:`~lorafleet_operator.conditions.MAX_MESSAGE`.
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
#: A member's backend kind and version, as its agent reports them (members[].backend).
MAX_BACKEND_KIND = 63
MAX_BACKEND_VERSION = 253
#: The largest status the caps allow stays under this (the whole object: at most 256 KiB).
STATUS_BUDGET = 160 * 1024
#: Listing order of agents[]: failing first, so a capped list never hides a failure.
_LISTING_ORDER = {"Failed": 0, "Unreachable": 1, "Loaded": 2}


@dataclass(frozen=True)
class Pending:
    """Why an adapter is on no agent (the Ready condition's reason and message), or why a
    fleet cannot be used."""

    reason: str = Reason.NO_TARGET_AGENTS
    message: str = "no ready agent of the fleet serves this base model"


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
    STANDBY = "Standby"  # held verified on disk, loaded to a slot by its first request


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
    source: SourceRevision | None = None  # what a load sent now resolved its source to, or was held to
    #: On standby: whether its first request can load it now (a free slot there, or a resident
    #: adapter the agent may evict); routing lists the pod only then.
    loadable: bool = True

    @property
    def ok(self) -> bool:
        """It holds this version as wanted: on every rank, or on standby."""
        return (self.state is AgentState.LOADED and self.ranks_loaded == self.ranks_total) or self.state is AgentState.STANDBY

    @property
    def serves_now(self) -> bool:
        """Whether a request for the adapter sent there now is served: held on every rank,
        or on standby with room to load it (routing's rule)."""
        return self.ok and (self.state is AgentState.LOADED or self.loadable)

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


def _ready_condition(phase: Phase, results: Sequence[AgentResult], pending: Pending, crashed: str) -> tuple[str, str, str]:
    """(status, reason, message) of the Ready condition."""
    loaded = sum(r.ok for r in results)
    failing = [r.pod for r in results if not r.ok]
    if crashed and phase in (Phase.FAILED, Phase.DEGRADED):
        return "False", Reason.LOAD_CRASHED_AGENT, crashed
    if phase is Phase.READY:
        return "True", Reason.ALL_AGENTS_LOADED, f"{loaded}/{len(results)} agents hold the adapter on every rank"
    if phase is Phase.PENDING:
        return "False", pending.reason, pending.message
    if phase is Phase.TERMINATING:
        return "False", Reason.TERMINATING, "unloading from every agent"
    not_ok = f"{loaded}/{len(results)} agents hold the adapter; not on {', '.join(failing)}"
    if phase is Phase.LOADING:
        return "Unknown", Reason.LOADING, not_ok
    if phase is Phase.DEGRADED and not loaded:
        old = [r for r in results if r.served is not None]
        sources = sorted({r.served.uri for r in old if r.served is not None})
        return (
            "False",
            Reason.PREVIOUS_VERSION_SERVED,
            (
                f"no agent holds the adapter as specified; {', '.join(r.pod for r in old)} still "
                f"serve(s) a previous version ({', '.join(sources)}); {not_ok}"
            ),
        )
    if phase is Phase.DEGRADED:
        return "False", Reason.PARTIALLY_LOADED, not_ok
    return "False", Reason.LOAD_FAILED, not_ok


def _degraded_condition(results: Sequence[AgentResult]) -> tuple[str, str, str]:
    failed = [r for r in results if r.state in (AgentState.FAILED, AgentState.UNREACHABLE)]
    if not failed:
        return "False", Reason.NO_AGENT_FAILING, "no target agent reports an error"
    names = ", ".join(f"{r.pod} ({r.state})" for r in failed)
    return "True", Reason.AGENTS_FAILING, f"failing on {names}: {merged_message(results)}"[:MAX_MESSAGE]


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
    skips = sorted(placement.skipped, key=lambda s: (s.reason is SkipReason.NOT_NEEDED, s.pod))
    replicas = {"replicas": placement.replicas} if placement.replicas is not None or "replicas" in previous else {}
    return {
        **replicas,
        "placed": list(placement.placed[:MAX_LISTED_PLACED]),
        "placedCount": len(placement.placed),
        "skipped": [{"pod": s.pod, "reason": str(s.reason), "message": s.message[:MAX_SKIP_MESSAGE]} for s in skips[:MAX_LISTED_SKIPS]],
        "skippedCount": len(placement.skipped),
    }


def _unplaced_reason(placement: Placement, otherwise: str) -> str:
    """The Ready reason of an adapter placed nowhere: over its namespace's quota wherever it
    would fit (``QuotaExceeded``), waiting for its namespace's guaranteed share
    (``AwaitingGuaranteedSlot``), without room (``NoRoom``), or ``otherwise``."""
    blocking = [s.reason for s in placement.skipped if s.reason is not SkipReason.NOT_NEEDED]
    if blocking and all(r is SkipReason.QUOTA for r in blocking):
        return Reason.QUOTA_EXCEEDED
    if SkipReason.GUARANTEED in blocking:
        return Reason.AWAITING_GUARANTEED_SLOT
    if any(r in (SkipReason.FULL, SkipReason.REFUSED, SkipReason.QUOTA) for r in blocking):
        return Reason.NO_ROOM
    return otherwise


def _placement_outcome(phase: Phase, placement: Placement | None, ready: tuple[str, str, str]) -> tuple[Phase, tuple[str, str, str]]:
    """Phase and Ready condition once placement is known: fewer places than ``replicas``
    asked for make an otherwise Ready adapter Degraded."""
    if placement is None or placement.replicas is None or phase is not Phase.READY:
        return phase, ready
    if len(placement.placed) >= placement.replicas:
        return phase, ready
    return Phase.DEGRADED, ("False", Reason.NOT_ENOUGH_ROOM, placement.why_not())


def build_status(
    results: Sequence[AgentResult],
    *,
    generation: int,
    previous: Mapping[str, Any] | None = None,
    deleting: bool = False,
    pending: Pending = Pending(),
    crashed: str = "",
    placement: Placement | None = None,
    now: str | None = None,
) -> dict[str, Any]:
    """The whole ``status`` of a LoraAdapter for these per-agent results.

    ``previous`` is the status as stored (for lastTransitionTime). ``crashed``: why this
    generation is sent to no agent (its loads crashed agents); the Ready condition then says
    ``LoadCrashedAgent`` with it. ``placement``: where it was placed (the results are those
    agents'); placed nowhere, it is Pending with the reason (else ``pending``'s). The result is a complete status,
    written with a merge patch; list fields are replaced whole. Every list and message in it
    is capped (the caps above), so its size is bounded whatever the fleet's.
    """
    now = now or now_rfc3339()
    old_conditions = list((previous or {}).get("conditions") or [])
    ordered = sorted(results, key=lambda r: r.pod)
    if placement is not None and not placement.placed and not deleting and not results:
        pending = Pending(_unplaced_reason(placement, pending.reason), placement.why_not() or pending.message)
    phase = phase_of(ordered, deleting=deleting)
    ready = _ready_condition(phase, ordered, pending, crashed)
    phase, ready = _placement_outcome(phase, placement, ready)
    degraded = _degraded_condition(ordered)
    agents_ready = sum(r.ok for r in ordered)
    ranks_loaded = sum(r.ranks_loaded for r in ordered)
    ranks_total = sum(r.ranks_total for r in ordered)
    message = merged_message(ordered) or (pending.message if phase is Phase.PENDING else "")
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
        "source": recorded_source((r.source for r in ordered), previous),
        "conditions": [
            condition("Ready", *ready, generation=generation, previous=old_conditions, now=now),
            condition("Degraded", *degraded, generation=generation, previous=old_conditions, now=now),
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
            condition("Ready", "Unknown", Reason.RECONCILING, "asking the fleet's agents", generation=generation, previous=[], now=now),
            condition("Degraded", "Unknown", Reason.RECONCILING, "asking the fleet's agents", generation=generation, previous=[], now=now),
        ],
    }


def member(
    agent: AgentPod, info: AgentInfo | AgentError | None, registry: Registry | None, own: set[str] | frozenset[str] = frozenset()
) -> dict[str, Any]:
    """One LoraFleet status.members entry. ``capacity.loadedLoras`` counts only ``own``, the
    registry names of this fleet's adapters: agents may be shared by fleets of several
    namespaces, and a fleet's status must not tell its readers how busy the others are."""
    entry: dict[str, Any] = {"pod": agent.name, "endpoint": agent.endpoint, "ready": agent.dialable and isinstance(info, AgentInfo)}
    if isinstance(info, AgentInfo):
        entry["baseModel"] = info.base_model
        entry["topology"] = {
            "tpSize": info.tp_size,
            "dpSize": info.dp_size,
            "attnTpSize": info.attn_tp_size,
            "epSize": info.ep_size,
            "moeTpSize": info.moe_tp_size,
        }
        entry["capacity"] = {
            "maxLoadedLoras": info.max_loaded_loras,
            "maxLorasPerBatch": info.max_loras_per_batch,
            "maxLoraRank": info.max_lora_rank,
        }
        if isinstance(registry, Mapping):
            entry["capacity"]["loadedLoras"] = sum(1 for n in registry if n in own)
        if info.backend.kind:  # an agent older than Describe's backend says none
            entry["backend"] = {"kind": info.backend.kind[:MAX_BACKEND_KIND], "version": info.backend.version[:MAX_BACKEND_VERSION]}
        entry["message"] = ""
    elif isinstance(info, AgentError):
        entry["message"] = info.message[:MAX_AGENT_MESSAGE]
    else:
        entry["message"] = "pod not ready" if not agent.ready else "pod has no IP or gRPC port"
    return entry


def fleet_status(
    fleet: FleetObject,
    view: FleetView | None,
    registries: Mapping[str, Registry],
    unusable: Pending | None,
    own: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """LoraFleet status: agents found, how many answer, each member's topology and capacity
    (``own``: the registry names of this fleet's adapters, the only ones counted); without a
    view, the Ready condition says why the fleet is ``unusable``."""
    previous = list(fleet.status.get("conditions") or [])
    generation, now = fleet.generation, now_rfc3339()
    if view is None:
        assert unusable is not None
        ready = condition("Ready", "False", unusable.reason, unusable.message, generation=generation, previous=previous, now=now)
        return {"observedGeneration": generation, "conditions": [ready]}
    members = [member(a, view.infos.get(a.name), registries.get(a.name), own) for a in view.agents]
    ready_agents = sum(1 for m in members if m["ready"])
    answering = f"{ready_agents}/{len(members)} agents answer"
    if not members:
        state = ("False", Reason.NO_AGENTS, "the selector matches no pod")
    elif ready_agents == len(members):
        state = ("True", Reason.ALL_AGENTS_READY, answering)
    else:
        state = ("False", Reason.AGENTS_NOT_READY, answering)
    # At most MAX_LISTED_MEMBERS, those not ready chosen first; the rest only counted.
    shown = sorted(sorted(members, key=lambda m: (m["ready"], m["pod"]))[:MAX_LISTED_MEMBERS], key=lambda m: m["pod"])
    return {
        "observedGeneration": generation,
        "agents": len(members),
        "readyAgents": ready_agents,
        "members": shown,
        "membersNotListed": len(members) - len(shown),
        "conditions": [condition("Ready", *state, generation=generation, previous=previous, now=now)],
    }
