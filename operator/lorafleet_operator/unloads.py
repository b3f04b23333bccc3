"""Unloads: a deletion's unloads from every agent that may hold the adapter (and, best effort,
from agents whose pods went away since), and their outcomes merged failure-first."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from lorafleet_common.merge import merge_failure_first
from lorafleet_operator.agent_values import AgentError, ControlReply
from lorafleet_operator.failures import AgentFailure, failure_message
from lorafleet_operator.fleet import AgentPod
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.view import FleetView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnloadOutcome:
    """One agent's part of a deletion: done (``failure`` None), or how it failed."""

    pod: str
    failure: AgentFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def message(self) -> str:
        return "" if self.failure is None else failure_message(self.failure, "unload failed")


def unload_message(outcomes: Sequence[UnloadOutcome]) -> str:
    """The agents a deletion could not unload from, and their errors merged failure-first
    (the one rule); "" when every agent is done."""
    if not outcomes:
        return ""
    merged = merge_failure_first(outcomes, ok=lambda o: o.ok, error=lambda o: o.message)
    if merged.ok:
        return ""
    return f"not unloaded from {', '.join(o.pod for o in outcomes if not o.ok)}: {merged.error}"


def may_hold(rt: Runtime, agent: AgentPod, name: str) -> bool:
    """Whether the agent may hold this registry name. It does not when its last registry
    listing, by this pod life, lacks the name and was requested after every load of the name
    this process sent there ended answered (:class:`~lorafleet_operator.books.SentLoads`).
    An agent never listed, listed by another pod life (restarted, replaced), with such a load
    since its listing, or one that may still run there, may hold it."""
    listing = rt.books.registries.get(agent.endpoint)
    if listing is None or listing.life != (agent.uid, agent.restarts) or name in listing.entries:
        return True
    return not rt.books.sent.settled_by(agent.endpoint, name, listing.requested_at)


async def unload_from_holders(rt: Runtime, view: FleetView, agent_name: str) -> list[UnloadOutcome]:
    """Unload from every dialable agent of the fleet that may hold the adapter
    (:func:`may_hold`), whatever its model (the spec may have changed since the load); one
    outcome per agent asked. With ``replicas: 4`` of 64 agents that is about 4 unloads, not
    64. An agent that does not hold it after all counts as done. A stray this misses (a load
    another process sent, one by hand) is a managed name no live resource wants: the drift
    check unloads it. The unloads wait in their agents' queues
    (:meth:`~lorafleet_operator.agent_client.AgentClients.unload_each`), so a thousand
    deletions at once hold a future per agent each, not a suspended call."""
    agents = [a for a in view.dialable if may_hold(rt, a, agent_name)]
    for agent in agents:
        rt.books.reservations.finished(agent.endpoint, agent_name, time.monotonic(), loaded=False)
    unloads = rt.agents.unload_each([(a.endpoint, view.creds, agent_name) for a in agents])
    if departed_holders(rt, view, agent_name):
        answers, _ = await asyncio.gather(unloads, unload_departed(rt, view, agent_name))
    else:  # the common case: no task besides the deletion's own (gather makes one each)
        answers = await unloads
    return [UnloadOutcome(agent.name, unload_failure(answer)) for agent, answer in zip(agents, answers, strict=True)]


def departed_holders(rt: Runtime, view: FleetView, name: str) -> list[str]:
    """Endpoints outside the fleet's dialable agents that may still hold the registry name:
    this process's newest listing there has it, or a load of it sent there is not yet
    settled by a listing. Their pods went away or stopped being ready since; the agent
    processes behind them may still run (a namespace being deleted loses its pods before its
    adapters; agents serving several namespaces keep running)."""
    here = {a.endpoint for a in view.dialable}
    listed = {e for e, listing in rt.books.registries.items() if name in listing.entries}
    sent = {e for e, book in rt.books.sent.ends.items() if name in book}
    return sorted((listed | sent) - here)


async def unload_departed(rt: Runtime, view: FleetView, name: str) -> None:
    """Unload the name from its :func:`departed_holders`, best effort: waited for at most one
    call deadline and never holding the deletion (a pod that is gone may leave an address
    nobody answers at; the queued unloads go on after the wait). A bearer token goes there
    only after a fresh identity proof (:mod:`~lorafleet_operator.identity`), or over the
    fleet's verified TLS: the address may be another pod's by now."""
    endpoints = departed_holders(rt, view, name)
    if not endpoints:
        return
    for endpoint in endpoints:
        # No longer an agent pod this process watches there: the token goes only to an agent
        # that proves again it holds it (a reused IP's new pod gets the challenge, no token).
        rt.agents.identities.forget(endpoint)
    try:
        answers = await asyncio.wait_for(rt.agents.unload_each([(e, view.creds, name) for e in endpoints]), rt.settings.call_deadline_s)
    except TimeoutError:
        log.info(
            "unload of %s from %s (pods gone or not ready): no answer within %.0fs; left to run",
            name,
            ", ".join(endpoints),
            rt.settings.call_deadline_s,
        )
        return
    for endpoint, answer in zip(endpoints, answers, strict=True):
        failure = unload_failure(answer)
        if failure is None:
            log.info("unloaded %s from %s (pod gone or not ready)", name, endpoint)
        else:
            log.info("unload of %s from %s (pod gone or not ready) failed: %s", name, endpoint, failure_message(failure, "unload failed"))


def unload_failure(answer: ControlReply | AgentError) -> AgentFailure | None:
    """How an unload failed (None: done; an agent that does not hold the name counts as
    done)."""
    if isinstance(answer, AgentError):
        return None if answer.code == grpc.StatusCode.NOT_FOUND else answer
    return None if answer.success else answer
