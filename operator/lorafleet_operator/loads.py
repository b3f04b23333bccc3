"""Loads: an adapter placed and loaded on every placed agent at once (the handlers' path, and
the drift check's repairs), each load sent unless the policy holds it back (a condemned
generation, a back-off, a refused credential); local sources wait in their agent's queue,
remote and pinned ones are calls of their own."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from lorafleet_operator import progress, sources
from lorafleet_operator.agent_values import SourceCredential
from lorafleet_operator.crashes import crash_verdict, incarnation
from lorafleet_operator.credentials import source_credential
from lorafleet_operator.failures import FleetProblem
from lorafleet_operator.fanout import list_registries
from lorafleet_operator.fleet_secrets import opened_secret
from lorafleet_operator.pinning import load_pinned
from lorafleet_operator.placement import Placement
from lorafleet_operator.placing import place_fleet, placed_targets, standby_targets
from lorafleet_operator.resources import AdapterObject
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.sending import QueuedLoad, book_never_sent, book_sending, error_result, load_one
from lorafleet_operator.source_resolution import held_to, resolve_once
from lorafleet_operator.source_revisions import recorded_source
from lorafleet_operator.status import AgentResult, AgentState
from lorafleet_operator.view import FleetView, Registry, Target

#: An adapter's source credential as read for its loads: the value, none named, or why the
#: operator will not send it (:func:`adapter_credential`).
CredentialOutcome = SourceCredential | FleetProblem | None


def condemned(rt: Runtime, adapter: AdapterObject) -> str:
    """Why this adapter generation is sent to no agent ("" while it may be loaded)."""
    return crash_verdict(rt.books.crashes, adapter.generation_key, adapter.status)


def backing_off(rt: Runtime, adapter: AdapterObject, target: Target) -> AgentResult | None:
    """The last failed load's result on this target while its back-off has not passed (the
    one rule for handlers and the drift check alike); None when a load is due."""
    entry = rt.books.failures.waiting(adapter.failure_key(target.agent.name), incarnation(target.agent))
    return entry.result if entry is not None else None


def retry_due_in(rt: Runtime, adapter: AdapterObject, results: Sequence[AgentResult]) -> float | None:
    """Seconds until the first failed agent of this adapter is due again (the back-off)."""
    return rt.books.failures.due_in(adapter.failure_key(r.pod) for r in results if not r.ok)


async def adapter_credential(rt: Runtime, view: FleetView, adapter: AdapterObject) -> CredentialOutcome:
    """The adapter's source credential (:mod:`~lorafleet_operator.credentials`), read once
    for all of its loads of this look; the refusal when the operator will not send it (a
    Secret not opened to the fleet, its own agent Secret, ...): nothing is sent then, and
    nothing booked, so the next look reads the Secret again."""
    try:
        return await source_credential(
            adapter.spec.source, view.name, view.spec, lambda name, keys: opened_secret(rt.kube, view.namespace, view.name, name, keys)
        )
    except FleetProblem as problem:
        return problem


def credential_refusal(credential: CredentialOutcome, results: Sequence[AgentResult]) -> FleetProblem | None:
    """The credential refusal that is the adapter's status: refused while no agent serves
    it. The adapter is then Pending with the refusal's reason (``SecretNotOpened``: its
    message says what the Secret's owner does), not Failed: no agent refused anything."""
    if isinstance(credential, FleetProblem) and not any(r.serving for r in results):
        return credential
    return None


def served_anywhere(registries: Mapping[str, Registry], adapter: AdapterObject) -> bool:
    """Whether some agent's listed registry holds the adapter (any version of it)."""
    return any(isinstance(r, Mapping) and adapter.agent_name in r for r in registries.values())


async def credential_refusals(
    rt: Runtime, view: FleetView, registries: Mapping[str, Registry], adapters: Sequence[AdapterObject]
) -> dict[str, FleetProblem]:
    """The adapters (by registry name) whose source credential is refused while no agent
    serves them: they are placed nowhere and take no room (nothing will be sent), and are
    Pending with the refusal's reason. The Secret is read only for adapters that name one
    and are served nowhere, the ones a load is due for."""
    due = [a for a in adapters if a.spec.source.credentials is not None and not served_anywhere(registries, a)]
    outcomes = await asyncio.gather(*(adapter_credential(rt, view, a) for a in due))
    return {a.agent_name: o for a, o in zip(due, outcomes, strict=True) if isinstance(o, FleetProblem)}


def unsent(rt: Runtime, target: Target, adapter: AdapterObject, credential: CredentialOutcome) -> AgentResult | None:
    """The result of a load that is not sent, None when it is to be sent: the generation is
    condemned, the agent's Describe failed, its last failure there is backing off, or the
    ``credential`` is refused (nothing sent: not booked)."""
    verdict = condemned(rt, adapter)
    if verdict:
        return AgentResult(target.agent.name, AgentState.FAILED, 0, target.ranks_total, verdict)
    if target.error is not None:
        return error_result(target, target.error)
    waiting = backing_off(rt, adapter, target)
    if waiting is not None:
        return waiting
    if isinstance(credential, FleetProblem):
        return AgentResult(target.agent.name, AgentState.FAILED, 0, target.ranks_total, credential.message)
    return None


async def place_and_load(rt: Runtime, view: FleetView, adapter: AdapterObject) -> tuple[Placement, list[AgentResult]]:
    """Place the adapter (with the fleet's others, oldest first) and load it on every placed
    agent at once (:func:`load_each`); one result per placed agent. With ``replicas``, the
    places of agents that refused it go to other agents at once, in a second round (placement
    keeps a refusing agent only when nothing else fits), not at the next drift check. Raises
    the credential's refusal when no agent serves the adapter (:func:`credential_refusal`):
    before placing it when none holds it at all, so that it takes no room."""
    registries = await list_registries(rt, view, fresh=False)
    name = adapter.agent_name
    credential = await adapter_credential(rt, view, adapter)
    if isinstance(credential, FleetProblem) and not served_anywhere(registries, adapter):
        raise credential
    placement = place_fleet(rt, view, registries, [adapter], complete=False)[name]
    results = await load_each(rt, view, placed_targets(view, placement) + standby_targets(view, placement, adapter), adapter, credential)
    if placement.replicas is not None and any(r.state is AgentState.FAILED for r in results):
        # Placed where it was just placed (stable), less the agents that refused it; held to
        # the source's record the first round made (never resolved twice).
        held = adapter.with_status({**adapter.status, "source": recorded_source((r.source for r in results), adapter.status)})
        placed = held.with_status({**held.status, "placement": {"placed": list(placement.placed)}})
        again = place_fleet(rt, view, registries, [placed], complete=False)[name]
        new = [t for t in placed_targets(view, again) if t.agent.name not in placement.placed]
        if new:
            done = {r.pod: r for r in results}
            done.update((r.pod, r) for r in await load_each(rt, view, new, held, credential))
            placement = again
            results = [done[t.agent.name] for t in placed_targets(view, again)]
    refusal = credential_refusal(credential, results)
    if refusal is not None:
        raise refusal
    return placement, results


async def load_each(
    rt: Runtime, view: FleetView, targets: Sequence[Target], adapter: AdapterObject, credential: CredentialOutcome
) -> list[AgentResult]:
    """Load on every target at once (replace=True: the spec is the truth for managed names),
    unless a target's load is not to be sent (:func:`unsent`), their download progress in the
    Ready condition while the loads run (:func:`progress.reporting`): the one path of the
    handlers' loads and the drift check's repairs. A load of a local source waits in its
    agent's queue (``rt.loads``: a future, not a suspended call); a remote one (bounded per
    agent and namespace, apart) and a pinned one (under the agent's pin lock) are calls of
    their own. Outcomes in the targets' order; a failed load the agent answered also says
    which version the agent still serves. An s3:// or oci:// source not yet resolved is
    resolved first, by one agent, and recorded (:func:`source_resolution.resolve_once`): the
    loads are held to it, and each result carries it; a refusal there is every due load's
    result, none sent."""
    held_back = {t.agent.name: r for t in targets if (r := unsent(rt, t, adapter, credential)) is not None}
    due = [t for t in targets if t.agent.name not in held_back]
    resolution = await resolve_once(rt, view, due, adapter, None if isinstance(credential, FleetProblem) else credential)
    if resolution.unsent is not None:  # one result for each due target: none is sent
        results_by_pod = {**held_back, **{r.pod: r for r in resolution.unsent}}
        return [results_by_pod[t.agent.name] for t in targets]
    results = await _send_each(rt, view, targets, resolution.adapter, credential)
    return [held_to(r, resolution.source) for r in results]


async def _send_each(
    rt: Runtime, view: FleetView, targets: Sequence[Target], adapter: AdapterObject, credential: CredentialOutcome
) -> list[AgentResult]:
    """Every target's load sent at once (or its result when none is sent), with their download
    progress; their outcomes in the targets' order."""
    async with progress.reporting(rt, view, targets, adapter):
        pending = [_start_load(rt, view, t, adapter, credential) for t in targets]
        futures = [p for p in pending if isinstance(p, asyncio.Future)]
        try:
            if futures:
                await asyncio.wait(futures)
        except asyncio.CancelledError:  # as gather would: the loads go with their caller
            for future in futures:
                future.cancel()
            raise
        for future in futures:
            future.exception()  # every one retrieved: the first error is raised below
        return [p if isinstance(p, AgentResult) else p.result() for p in pending]


def _start_load(
    rt: Runtime, view: FleetView, target: Target, adapter: AdapterObject, credential: CredentialOutcome
) -> AgentResult | asyncio.Future[AgentResult]:
    """One target's load, started: its result when none is sent, else its future."""
    result = unsent(rt, target, adapter, credential)
    if result is not None:
        return result
    assert not isinstance(credential, FleetProblem)  # unsent() answered for a refusal
    if adapter.spec.pinned:
        return asyncio.ensure_future(load_pinned(rt, view, target, adapter, credential))
    book_sending(rt.books, target, adapter)
    if sources.is_remote(adapter.spec.source.uri):
        return asyncio.ensure_future(load_one(rt.agents, rt.books, view, target, adapter, credential))
    return rt.loads.submit(
        target.agent.endpoint, QueuedLoad(view, target, adapter, credential), lambda: book_never_sent(rt.books, target, adapter)
    )
