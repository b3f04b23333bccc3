"""An adapter's stored ``Loaded`` claims checked against the agents' registries while a
handler has the adapter in hand.

The drift check leaves an adapter whose handler holds its lock to that handler (its loads
must not race the handler's). A handler's load may run long (a slow source), and meanwhile an
agent that held the adapter may restart or lose it: the status would say ``Loaded`` there until
the handler ends. So the drift check still compares such an adapter's ``status.agents[]`` with
the registries it listed and rewrites the entries that claim more than the agent holds (no
load is sent: the next check after the handler's loads puts it back). Only what the agent
stopped holding is corrected (the entry absent, on fewer ranks, or back on standby): a version
the handler is replacing is the handler's to report.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from lorafleet_operator.agent_values import AgentError
from lorafleet_operator.publish import publish_status
from lorafleet_operator.resources import AdapterObject
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.status import AgentResult, AgentState, ServedVersion, build_status
from lorafleet_operator.view import FleetView, Registry

log = logging.getLogger("lorafleet.operator.drift")

#: The message of an entry corrected while a handler's load runs.
LOST = "the agent no longer holds the adapter (it restarted or lost it); loaded again once the load in progress ends"


def stored_results(status: Mapping[str, Any]) -> list[AgentResult]:
    """The stored ``agents[]`` entries as results (what the last status write said)."""
    results = []
    for entry in status.get("agents") or []:
        served = entry.get("served")
        results.append(
            AgentResult(
                entry["pod"],
                AgentState(entry["state"]),
                int(entry["ranksLoaded"]),
                int(entry["ranksTotal"]),
                entry.get("message", ""),
                ServedVersion(served["uri"], served.get("sha256", "")) if served else None,
                entry.get("nextRetryTime", ""),
            )
        )
    return results


def held_now(result: AgentResult, registry: Registry | None, adapter: AdapterObject) -> AgentResult:
    """The result as the listed registry shows it: a ``Loaded`` claim beyond what the agent
    holds (absent, fewer ranks, on standby) is lowered to what it holds; anything else (an
    agent whose listing failed or was not made, any other state) is kept as stored."""
    if result.state is not AgentState.LOADED or not isinstance(registry, Mapping):
        return result
    entry = registry.get(adapter.agent_name)
    if entry is not None and entry.standby and adapter.spec.standby:
        return AgentResult(result.pod, AgentState.STANDBY, 0, result.ranks_total)
    ranks = 0 if entry is None or entry.standby else min(len(entry.ranks), result.ranks_total)
    if ranks >= result.ranks_loaded:
        return result
    return AgentResult(result.pod, AgentState.LOADED, ranks, result.ranks_total, LOST)


def corrected_status(adapter: AdapterObject, registries: Mapping[str, Registry]) -> dict[str, Any] | None:
    """The adapter's status with its false ``Loaded`` claims corrected (phase, counts and
    conditions follow them); None when every claim holds. ``status.placement`` and
    ``status.source`` are left as stored (the merge patch omits them)."""
    stored = stored_results(adapter.status)
    now: Sequence[AgentResult] = [held_now(r, registries.get(r.pod), adapter) for r in stored]
    if list(now) == stored:
        return None
    status = build_status(now, generation=int(adapter.status.get("observedGeneration") or 0), previous=adapter.status)
    status.pop("placement")
    status.pop("source")
    return _with_unlisted(status, adapter.status, stored)


def _with_unlisted(status: dict[str, Any], stored: Mapping[str, Any], listed: Sequence[AgentResult]) -> dict[str, Any]:
    """``status`` with the agents the stored status only counted (beyond the listed cap: not
    failing ones, which are listed first) counted again as they were: nothing says otherwise."""
    unlisted = int(stored.get("agentsNotListed") or 0)
    if not unlisted:
        return status
    ready = int(stored.get("agentsReady") or 0) - sum(r.ok for r in listed)
    ranks_loaded = int(stored.get("ranksLoaded") or 0) - sum(r.ranks_loaded for r in listed)
    ranks_total = int(stored.get("ranksTotal") or 0) - sum(r.ranks_total for r in listed)
    agents_ready, agents_target = status["agentsReady"] + ready, status["agentsTarget"] + unlisted
    ranks = (status["ranksLoaded"] + ranks_loaded, status["ranksTotal"] + ranks_total)
    return {
        **status,
        "agentsNotListed": unlisted,
        "agentsTarget": agents_target,
        "agentsReady": agents_ready,
        "agentsSummary": f"{agents_ready}/{agents_target}",
        "ranksLoaded": ranks[0],
        "ranksTotal": ranks[1],
        "ranksSummary": f"{ranks[0]}/{ranks[1]}",
    }


async def correct_claims(
    rt: Runtime, view: FleetView, registries: Mapping[str, Registry], adapter: AdapterObject, listed_at: float
) -> None:
    """While a handler's loads of the adapter run (its lock held, its last write older than
    the listing), the status's ``Loaded`` claims the registries contradict are corrected
    (:func:`corrected_status`); no load is sent beside the handler's. The check's listing
    may be older than the status (a handler wrote it since): a contradicted claim is
    confirmed by listing that agent again, now, before the status says so."""
    key = (adapter.namespace, adapter.name)
    if not _in_hand(rt, key, listed_at) or corrected_status(adapter, registries) is None:
        return
    suspects = {r.pod for r in stored_results(adapter.status) if held_now(r, registries.get(r.pod), adapter) != r}
    agents = [a for a in view.dialable if a.name in suspects]
    listings = await asyncio.gather(*(_listing(rt, view, a.endpoint) for a in agents))
    fresh = {a.name: r for a, r in zip(agents, listings, strict=True) if r is not None}
    status = corrected_status(adapter, fresh)
    if status is not None and _in_hand(rt, key, listed_at):
        log.info("%s/%s: status corrected, an agent no longer holds it (its handler's load goes on)", *key)
        await publish_status(rt, adapter, status)


async def _listing(rt: Runtime, view: FleetView, endpoint: str) -> Registry | None:
    """The agent's registry now; None when it does not answer (its claims are kept)."""
    try:
        return await rt.agents.list_adapters(endpoint, view.creds)
    except AgentError:
        return None


def _in_hand(rt: Runtime, key: tuple[str, str], listed_at: float) -> bool:
    """Whether a handler is at work on the adapter and has not finished since ``listed_at``."""
    return rt.locks.adapter(*key).locked() and rt.books.reconciled.get(key, -math.inf) < listed_at
