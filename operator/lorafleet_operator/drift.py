"""Registry consistency: each fleet's agents hold exactly the adapters its resources want.

A kopf daemon per LoraFleet runs a check every ``drift_interval_s`` (sooner when an agent pod
changes). One check:

1. looks at the fleet afresh (pods, Describe of every ready agent);
2. lists every agent's registry (ListAdapters), **then** lists the LoraAdapters. In this order
   an adapter loaded by a handler meanwhile is either absent from the registry snapshot (and
   loaded again: idempotent) or already has its resource in the list; never unloaded by mistake;
3. decides the replicas of its demand-scaled adapters from their agents' demand
   (:mod:`scaling`), then places this fleet's adapters, oldest first (:mod:`placement`), but
   not those it does not admit nor those whose source credential is refused while no agent
   serves them (Pending with the reason, one adapter's alone: they take no room), and unloads
   managed adapters (``<namespace>.<name>``, see :mod:`names`) that no live resource wants
   there: of this fleet, where placement did not put them (an adapter on standby is wanted on
   every agent of its base model: :mod:`standby`); of any other fleet selecting that pod, with
   its base model;
4. for each LoraAdapter of this fleet, loads it where it is placed and missing (an agent
   restarted; a new agent; room appeared) unless a failure there is still backing off, and
   writes its status and EndpointSlices from what the agents now hold; an adapter its
   handlers have in hand (reconciling it, not yet, or done since step 2's listing, which
   misses those loads) is left to them this round, but while a handler's load runs, its
   status's ``Loaded`` claims that the listing contradicts are corrected (:mod:`claims`);
5. writes the fleet's status (agents, ready agents, members with topology and capacity).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import kopf

from lorafleet_common.registry import RegistryEntry
from lorafleet_operator import metrics, names
from lorafleet_operator.admission import admission
from lorafleet_operator.agent_values import AgentError, AgentInfo
from lorafleet_operator.claims import correct_claims
from lorafleet_operator.config import FLEETS, GROUP, VERSION
from lorafleet_operator.failures import (
    KUBE_API_ERRORS,
    FleetProblem,
    drift_delay,
    kube_reason,
    loop_stall_s,
    retry_after,
    stalled_loops,
)
from lorafleet_operator.fanout import list_registries
from lorafleet_operator.fleet import AgentPod, selector_matches
from lorafleet_operator.loads import adapter_credential, backing_off, condemned, credential_refusal, credential_refusals, load_each
from lorafleet_operator.looks import fleet_view
from lorafleet_operator.placement import Placement
from lorafleet_operator.placing import place_fleet, placed_targets, standby_targets
from lorafleet_operator.publish import publish_fleet_status, publish_status
from lorafleet_operator.resources import AdapterObject, AdapterSpec, FleetObject, adapter_of, fleet_of
from lorafleet_operator.routing import publish_slices
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.scaling import scale_fleet
from lorafleet_operator.sending import error_result
from lorafleet_operator.standby import as_held, same_version
from lorafleet_operator.status import AgentResult, AgentState, Pending, build_status, fleet_status, never_reconciled
from lorafleet_operator.view import FleetView, Registry, Target

log = logging.getLogger("lorafleet.operator.drift")

T = TypeVar("T")


def wanted_on(
    agent: AgentPod,
    info: AgentInfo,
    adapters: Sequence[AdapterObject],
    fleets: Sequence[FleetObject],
    placements: Mapping[str, Placement] | None = None,
) -> set[str]:
    """Registry names any live LoraAdapter wants on this agent (through any fleet selecting it
    that admits it: :func:`~lorafleet_operator.admission.admission`). An adapter that has a
    placement in ``placements`` (this fleet's) is wanted only where it is placed."""
    selecting = {f.name: f.spec for f in fleets if selector_matches(f.spec.selector, agent.labels)}
    wanted = set()
    for a in adapters:
        fleet = a.spec.fleet
        if (
            a.deleting
            or fleet not in selecting
            or a.spec.base_model != info.base_model
            or admission(fleet, selecting[fleet], a.spec) is not None
        ):
            continue
        placement = (placements or {}).get(a.agent_name)
        # On standby, it is wanted on every agent of its base model: resident or not.
        if placement is None or agent.name in placement.placed or a.spec.standby:
            wanted.add(a.agent_name)
    return wanted


def holds(entry: RegistryEntry, spec: AdapterSpec, ranks_total: int) -> bool:
    """Whether a registry entry is this spec (source, sha256 when given, pinning), on every
    rank; anything else is loaded again (replace=True swaps it atomically)."""
    return same_version(entry, spec) and not entry.standby and len(entry.ranks) >= ranks_total


def unwanted(
    view: FleetView,
    registries: Mapping[str, Registry],
    adapters: Sequence[AdapterObject],
    fleets: Sequence[FleetObject],
    placements: Mapping[str, Placement] | None = None,
    busy: frozenset[str] = frozenset(),
) -> list[tuple[AgentPod, str]]:
    """(agent, registry name) of every managed adapter no live resource wants there. An agent
    whose Describe or registry listing failed is left alone: what it holds is unknown; so is
    an adapter in ``busy`` (a handler is placing it right now)."""
    calls: list[tuple[AgentPod, str]] = []
    for agent in view.dialable:
        registry, info = registries.get(agent.name), view.infos.get(agent.name)
        if not isinstance(info, AgentInfo) or registry is None or isinstance(registry, AgentError):
            continue
        wanted = wanted_on(agent, info, adapters, fleets, placements)
        calls.extend(
            (agent, registry_name)
            for registry_name in registry
            if names.is_managed(registry_name, view.namespace) and registry_name not in wanted and registry_name not in busy
        )
    return calls


async def remove_unwanted(
    rt: Runtime,
    view: FleetView,
    registries: Mapping[str, Registry],
    adapters: Sequence[AdapterObject],
    fleets: Sequence[FleetObject],
    placements: Mapping[str, Placement],
) -> int:
    """Unload managed adapters nobody wants (:func:`unwanted`); returns how many were unloaded."""
    busy = frozenset(names.agent_name(ns, name) for (ns, name), lock in rt.locks.adapters.items() if lock.locked())
    calls = unwanted(view, registries, adapters, fleets, placements, busy)
    for agent, registry_name in calls:
        rt.books.reservations.finished(agent.endpoint, registry_name, time.monotonic(), loaded=False)
    answers = await rt.agents.unload_each([(a.endpoint, view.creds, n) for a, n in calls])
    unloaded = 0
    for (agent, registry_name), answer in zip(calls, answers, strict=True):
        if isinstance(answer, AgentError):
            log.warning("drift: unloading %s from %s failed: %s", registry_name, agent.name, answer)
            continue
        metrics.DRIFT_REPAIRS.labels(action="unload").inc()
        log.info("drift: unloaded %s from %s (no resource wants it)", registry_name, agent.name)
        unloaded += answer.success
    return unloaded


def held_or_waiting(rt: Runtime, target: Target, registry: Registry | None, adapter: AdapterObject) -> AgentResult | None:
    """What this agent holds of the adapter when no load is to be sent there now (it holds
    the spec; its Describe or listing failed; the generation is condemned; the last load
    here is backing off); None when it needs a load."""
    if target.error is not None:
        return error_result(target, target.error)
    if registry is None:
        # The agent turned dialable after the registries were listed: nothing is known of it
        # this round (not a failure to classify); the next check lists it.
        return AgentResult(target.agent.name, AgentState.UNREACHABLE, 0, target.ranks_total, "registry not listed yet")
    if isinstance(registry, AgentError):
        return error_result(target, registry)
    entry = registry.get(adapter.agent_name)
    held = None
    if entry is not None and adapter.spec.standby and same_version(entry, adapter.spec):
        held = as_held(target, entry, adapter, registry)
    elif entry is not None and holds(entry, adapter.spec, target.ranks_total):
        held = AgentResult(target.agent.name, AgentState.LOADED, min(len(entry.ranks), target.ranks_total), target.ranks_total)
    if held is not None:
        rt.books.failures.clear(adapter.failure_key(target.agent.name))
        return held
    verdict = condemned(rt, adapter)
    if verdict:  # its loads crashed agents: sent to none until the spec changes
        return AgentResult(target.agent.name, AgentState.FAILED, 0, target.ranks_total, verdict)
    return backing_off(rt, adapter, target)  # the last load here failed, its back-off not passed


async def repair(
    rt: Runtime, view: FleetView, targets: Sequence[Target], registries: Mapping[str, Registry], adapter: AdapterObject
) -> tuple[list[AgentResult], FleetProblem | None]:
    """Each target's result after loading the adapter where it is missing and a load is
    allowed: those loads together through the handlers' path
    (:func:`~lorafleet_operator.loads.load_each`, with the download progress); and the
    credential refusal that is the adapter's status, if any (the Secret is read only when a
    load is due: so at each drift check while it is refused). Where a scale-down leaves it
    resident on a standby target, that target's standby load puts it back on standby in place
    (:mod:`standby`)."""
    known = [held_or_waiting(rt, t, registries.get(t.agent.name), adapter) for t in targets]
    missing = [t for t, result in zip(targets, known, strict=True) if result is None]
    credential = await adapter_credential(rt, view, adapter) if missing else None
    loaded = await load_each(rt, view, missing, adapter, credential) if missing else []
    for result in loaded:
        metrics.DRIFT_REPAIRS.labels(action="load").inc()
        log.info(
            "drift: loaded %s/%s on %s: %s%s",
            adapter.namespace,
            adapter.name,
            result.pod,
            result.state,
            f" ({result.message})" if result.message else "",
        )
    fresh = iter(loaded)
    results = [result if result is not None else next(fresh) for result in known]
    return results, credential_refusal(credential, results)


def handled(rt: Runtime, adapter: AdapterObject, listed_at: float) -> bool:
    """Whether the adapter's handlers have it in hand, so that a check whose registries were
    listed at ``listed_at`` leaves it alone this round: a handler is reconciling it now, has
    not yet (no conditions: its create handler will load it), or finished after the listing
    (which then misses that handler's loads: repairing from it would load them all again)."""
    key = (adapter.namespace, adapter.name)
    return rt.locks.adapter(*key).locked() or never_reconciled(adapter.status) or rt.books.reconciled.get(key, -math.inf) >= listed_at


#: Where each adapter of the fleet goes this round: its placement, or why it goes nowhere (the
#: fleet does not admit it, or its source credential is refused).
Decisions = Mapping[str, Placement | FleetProblem]


async def _converged_status(
    rt: Runtime, view: FleetView, registries: Mapping[str, Registry], adapter: AdapterObject, decisions: Decisions
) -> tuple[dict[str, Any], list[AgentResult]]:
    """The adapter's status after repairing it where it is placed, and the agents' results."""
    placement = decisions[adapter.agent_name]
    if isinstance(placement, FleetProblem):  # placed nowhere: Pending with the reason
        pending = Pending(placement.reason, placement.message)
        return build_status([], generation=adapter.generation, previous=adapter.status, pending=pending), []
    targets = placed_targets(view, placement) + standby_targets(view, placement, adapter)
    results, refusal = await repair(rt, view, targets, registries, adapter)
    if refusal is not None:  # nothing sent, no agent serves it: Pending, not Failed
        pending = Pending(refusal.reason, refusal.message)
        return build_status([], generation=adapter.generation, previous=adapter.status, pending=pending), []
    crashed = condemned(rt, adapter)
    return build_status(results, generation=adapter.generation, previous=adapter.status, crashed=crashed, placement=placement), results


async def converge_adapter(
    rt: Runtime,
    view: FleetView,
    registries: Mapping[str, Registry],
    adapter: AdapterObject,
    decisions: Decisions,
    listed_at: float,
) -> str | None:
    """Repair one adapter where it is placed and write its status and EndpointSlices, unless
    its handlers have it in hand (:func:`handled`; the next check looks again); returns its
    phase (None if skipped). ``listed_at``: when the check's registry listing began."""
    if handled(rt, adapter, listed_at):
        await correct_claims(rt, view, registries, adapter, listed_at)
        return None
    async with rt.locks.adapter(adapter.namespace, adapter.name):
        status, results = await _converged_status(rt, view, registries, adapter, decisions)
        await publish_status(rt, adapter, status)
        # Not new: an adapter without a status is left to its handler (handled).
        await publish_slices(rt, adapter.ref, view.spec, view.agents, results)
    return str(status["phase"])


async def _each_alone(adapters: Sequence[AdapterObject], step: Callable[[AdapterObject], Awaitable[T]], what: str) -> dict[str, T]:
    """`step` of every adapter at once, each failure its adapter's alone: the outcomes of those
    that succeeded, by registry name; a failure (a Kubernetes API error writing its status or
    reading its Secret, an agent call's surprise) is logged with the adapter's name."""
    outcomes = await asyncio.gather(*(step(a) for a in adapters), return_exceptions=True)
    done: dict[str, T] = {}
    for adapter, outcome in zip(adapters, outcomes, strict=True):
        if isinstance(outcome, KUBE_API_ERRORS):
            log.warning("drift: %s of %s/%s failed: Kubernetes API: %s", what, adapter.namespace, adapter.name, kube_reason(outcome))
        elif isinstance(outcome, Exception):
            log.error("drift: %s of %s/%s failed", what, adapter.namespace, adapter.name, exc_info=outcome)
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            done[adapter.agent_name] = outcome
    return done


async def check_fleet(rt: Runtime, fleet: FleetObject) -> None:
    """One registry-consistency check of one fleet (see the module docstring)."""
    started = time.monotonic()
    namespace, name = fleet.namespace, fleet.name
    try:
        view = await fleet_view(rt, namespace, name, fresh=True)
    except FleetProblem as problem:
        await publish_fleet_status(rt, fleet, fleet_status(fleet, None, {}, Pending(problem.reason, problem.message)))
        metrics.DRIFT_CHECKS.inc()
        log.info("drift check of lorafleet %s/%s: %s", namespace, name, problem.message)
        return
    listed_at = time.monotonic()
    registries = await list_registries(rt, view)
    adapters = [adapter_of(a) for a in await rt.kube.list_adapters(namespace)]  # after the registries: see module doc
    fleets = [fleet_of(f) for f in await rt.kube.list_fleets(namespace)]
    mine = [a for a in adapters if not a.deleting and a.spec.fleet == name]
    refused = {a.agent_name: r for a in mine if (r := admission(name, view.spec, a.spec)) is not None}
    credentials = await _each_alone(
        [a for a in mine if a.agent_name not in refused], lambda a: credential_refusals(rt, view, registries, [a]), "source credential"
    )
    for outcome in credentials.values():
        refused.update(outcome)
    # An adapter whose own step failed is left out of this check (it keeps its status; the next
    # check tries again): one object's failure never holds up its fleet's other adapters.
    looked = [a for a in mine if a.agent_name in refused or a.agent_name in credentials]
    await scale_fleet(rt, view, registries, [a for a in looked if a.agent_name not in refused])
    placements = place_fleet(rt, view, registries, [a for a in looked if a.agent_name not in refused], complete=True)
    unloaded = await remove_unwanted(rt, view, registries, adapters, fleets, placements)
    decisions: dict[str, Placement | FleetProblem] = {**placements, **refused}
    converged = await _each_alone(looked, lambda a: converge_adapter(rt, view, registries, a, decisions, listed_at), "repair")
    phases = list(converged.values())
    current = next((f for f in fleets if f.name == name), fleet)
    own = {a.agent_name for a in mine}
    await publish_fleet_status(rt, current, fleet_status(current, view, registries, None, own))
    metrics.DRIFT_CHECKS.inc()
    counts = {p: phases.count(p) for p in sorted({p for p in phases if p})}
    log.debug(
        "drift check of lorafleet %s/%s: %d agents, %d adapters %s, %d unloaded in %.2fs",
        namespace,
        name,
        len(view.agents),
        len(mine),
        counts,
        unloaded,
        time.monotonic() - started,
    )


async def _sleep(stopped: kopf.DaemonStopped, poke: asyncio.Event, seconds: float) -> None:
    """Wait for the interval, a poke, or the daemon's stop, whichever comes first."""
    waiters = [asyncio.ensure_future(stopped.wait(seconds)), asyncio.ensure_future(poke.wait())]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter


@kopf.on.probe(id="driftLoops")
def drift_loops_alive(memo: kopf.Memo, **_: Any) -> int:
    """Liveness (kopf's endpoint, ``LORAFLEET_HEALTH_PORT``): fails while some fleet's drift
    loop has not finished a round for :func:`~lorafleet_operator.failures.loop_stall_s` (a
    wedged reconcile loop), so the kubelet restarts the process; else the number of loops."""
    rt: Runtime = memo["runtime"]
    stalled = stalled_loops(rt.watch.heartbeats, time.monotonic(), rt.settings)
    if stalled:
        raise kopf.PermanentError(f"drift loops stalled for over {loop_stall_s(rt.settings):.0f}s: {', '.join(stalled)}")
    return len(rt.watch.heartbeats)


@kopf.daemon(GROUP, VERSION, FLEETS, cancellation_timeout=10.0)
async def fleet_drift(body: kopf.Body, name: str, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any) -> None:
    """The drift check of one fleet, for as long as the fleet exists."""
    rt: Runtime = memo["runtime"]
    namespace: str = body["metadata"]["namespace"]  # LoraFleet is a namespaced kind
    poke = rt.watch.poke(namespace, name)
    rt.watch.heartbeats[(namespace, name)] = time.monotonic()
    try:
        await _drift_loop(rt, body, poke, stopped)
    finally:
        rt.watch.heartbeats.pop((namespace, name), None)


async def _drift_loop(rt: Runtime, body: kopf.Body, poke: asyncio.Event, stopped: kopf.DaemonStopped) -> None:
    """Drift checks of one fleet until its daemon stops; each finished round is a heartbeat.
    ``body`` is kopf's live view of the fleet: parsed again at each round."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    api_failures = 0  # consecutive checks that failed on the Kubernetes API
    while not stopped:
        poke.clear()
        wait_at_least = 0.0
        try:
            async with rt.locks.fleet(namespace, name):  # never beside the fleet's deletion
                if stopped:
                    break
                await check_fleet(rt, fleet_of(body))
            api_failures = 0
        except KUBE_API_ERRORS as err:  # the API server is down or busy: back off (policy)
            api_failures += 1
            wait_at_least = retry_after(err)
            log.warning(
                "drift check of lorafleet %s/%s failed: Kubernetes API: %s; next in %.1fs",
                namespace,
                name,
                kube_reason(err),
                drift_delay(rt.settings, api_failures, wait_at_least),
            )
        except Exception:
            log.exception("drift check of lorafleet %s/%s failed; next in %.0fs", namespace, name, rt.settings.drift_interval_s)
        rt.watch.heartbeats[(namespace, name)] = time.monotonic()
        delay = drift_delay(rt.settings, api_failures, wait_at_least)
        # While the API fails, a poke (a pod event) does not cut the back-off short.
        await _sleep(stopped, poke if not api_failures else asyncio.Event(), delay)
