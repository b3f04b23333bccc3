"""Placement as the reconciles use it: the fleet's agents as candidates, each adapter's demand,
the fleet's adapters placed together (oldest first), and the placed agents as load targets.
The rule itself is :mod:`~lorafleet_operator.placement`'s."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from lorafleet_common.registry import RegistryEntry
from lorafleet_operator.agent_values import AgentError, AgentInfo
from lorafleet_operator.placement import Candidate, Demand, Placement, place
from lorafleet_operator.resources import AdapterObject, FleetObject
from lorafleet_operator.runtime import Runtime, fleet_agents
from lorafleet_operator.slot_quotas import Guarantees, QuotaUse
from lorafleet_operator.status import AgentState
from lorafleet_operator.view import FleetView, Registry, Target


def candidates(rt: Runtime, view: FleetView, registries: Mapping[str, Registry]) -> list[Candidate]:
    """The fleet's agents as placement sees them (what each holds: its registry, every
    namespace's names, plus the loads sent there and not yet listed)."""
    chosen = []
    failing = rt.books.failures.failing_pods()
    for agent in view.agents:
        info, registry = view.infos.get(agent.name), registries.get(agent.name)
        if not agent.dialable or not isinstance(info, AgentInfo) or not isinstance(registry, Mapping):
            chosen.append(Candidate(agent.name, agent.endpoint, agent.dialable, known=False))
            continue
        chosen.append(
            Candidate(
                agent.name,
                agent.endpoint,
                True,
                base_model=info.base_model,
                max_lora_rank=info.max_lora_rank,
                max_loaded_loras=info.max_loaded_loras,
                held=rt.books.reservations.held(agent.endpoint, resident(registry)),
                failing=agent.name in failing,
            )
        )
    return chosen


def resident(registry: Mapping[str, RegistryEntry]) -> Mapping[str, RegistryEntry]:
    """The names that take a slot: a standby adapter takes none (the registry itself, not a
    copy, when none is on standby)."""
    if not any(entry.standby for entry in registry.values()):
        return registry
    return {name: entry for name, entry in registry.items() if not entry.standby}


def demand(rt: Runtime, adapter: AdapterObject) -> Demand:
    """What placement needs of one LoraAdapter: its spec's wants (the replicas its demand was
    granted, with ``spec.scaling``), its last placement (the status) and the agents that
    refused this generation (the back-off book)."""
    uid, generation = adapter.generation_key
    refused = frozenset(
        pod
        for (key_uid, key_gen, pod), entry in rt.books.failures.entries.items()
        if key_uid == uid and key_gen == generation and entry.result.state is AgentState.FAILED
    )
    return Demand(
        adapter.agent_name,
        adapter.spec.base_model,
        replicas_of(rt, adapter),
        adapter.spec.rank,
        (adapter.created, adapter.name),
        adapter.placed,
        refused,
    )


def replicas_of(rt: Runtime, adapter: AdapterObject) -> int | None:
    """The replicas placement gives the adapter: ``spec.replicas``, or (``spec.scaling``) those
    the last drift check granted it (:mod:`~lorafleet_operator.scaling`), at least its
    minimum (before any check: the minimum)."""
    scaling = adapter.spec.scaling
    if scaling is None:
        return adapter.spec.replicas
    entry = rt.books.scaling.get((adapter.namespace, adapter.spec.fleet), {}).get(adapter.agent_name)
    granted = entry.granted if entry is not None and entry.uid == adapter.uid else 0
    return max(granted, scaling.min_replicas)


def place_fleet(
    rt: Runtime, view: FleetView, registries: Mapping[str, Registry], adapters: Sequence[AdapterObject], *, complete: bool
) -> dict[str, Placement]:
    """Place these adapters of the fleet in creation order (older adapters take room first).

    ``complete``: ``adapters`` are all of the fleet's live adapters (the drift check).
    Otherwise (a handler) they are placed after the fleet's adapters still waiting for room
    (the book the last drift check and handlers left), so a new adapter cannot take room an
    older one waits for; adapters that have their places need no new room and are not placed
    again. Synchronous: decisions of concurrent reconciles never interleave, and each sees
    the others' loads as reservations."""
    fresh = {d.name: d for d in (demand(rt, a) for a in adapters)}
    book = rt.books.demands.setdefault((view.namespace, view.name), {})
    agents = candidates(rt, view, registries)
    quotas = quota_uses(rt, view.namespace)
    placements = place(agents, fresh.values() if complete else {**book, **fresh}.values(), quotas, reclaim=complete)
    if complete:
        book.clear()
    for name, placement in placements.items():
        if placement.waiting:
            book[name] = fresh.get(name) or book[name]
        else:
            book.pop(name, None)
    return placements


def binding_fleets(rt: Runtime, namespace: str) -> list[FleetObject]:
    """The LoraFleets whose ``spec.quotas`` bind ``namespace``: those of the operator's own
    namespace (the release's, where tenants have no rights), which bind every namespace, and
    the namespace's own fleets (a limit a tenant sets on itself)."""
    owners = {rt.settings.lease_namespace, namespace}
    return [
        fleet for (ns, _), fleets in rt.watch.fleets.items() if ns in owners for fleet in fleets if fleet.spec.quotas and not fleet.deleting
    ]


def quota_uses(rt: Runtime, namespace: str) -> list[QuotaUse]:
    """Every quota that binds ``namespace`` (a maximum for it, or other namespaces'
    guaranteed shares), with the slots it holds under each now: its names on the quota
    fleet's agents in their last listings, plus the loads sent there and not yet listed."""
    uses = []
    for fleet in binding_fleets(rt, namespace):
        quota = fleet.spec.quotas.of(namespace)
        if quota is None and not fleet.spec.quotas.guarantees:
            continue
        endpoints = {a.endpoint for a in fleet_agents(rt, fleet.namespace, fleet.name, fleet.spec) if a.endpoint}
        used = _namespace_slots(rt, endpoints, namespace)
        owner, guarantees = f"{fleet.namespace}/{fleet.name}", _guarantees(rt, fleet, endpoints, namespace)
        if quota is None:
            uses.append(QuotaUse(owner, "spec.quotas", namespace, None, endpoints, used, guarantees=guarantees))
        else:
            uses.append(QuotaUse(owner, quota.field, namespace, quota.max_slots, endpoints, used, guarantees=guarantees))
    return uses


def _guarantees(rt: Runtime, fleet: FleetObject, endpoints: Collection[str], namespace: str) -> Guarantees:
    """What the quota fleet's ``minSlots`` hold back from ``namespace``: the slots each other
    namespace lacks of its minimum on these endpoints, when it has adapters there (placed) or
    waiting for room (in the book of waiting demands)."""
    mins = dict(fleet.spec.quotas.guarantees)
    lacking: dict[str, int] = {}
    for other, minimum in mins.items():
        if other == namespace:
            continue
        used = _namespace_slots(rt, endpoints, other)
        waiting = any(ns == other and book for (ns, _), book in rt.books.demands.items())
        if used < minimum and (used or waiting):
            lacking[other] = minimum - used
    return Guarantees(sum(lacking.values()), tuple(sorted(lacking)), mins.get(namespace, 0), sum(mins.values()))


def _namespace_slots(rt: Runtime, endpoints: Collection[str], namespace: str) -> int:
    """The slots ``namespace`` holds on these endpoints."""
    return sum(_slots_held(rt, endpoint, namespace) for endpoint in endpoints)


def _slots_held(rt: Runtime, endpoint: str, namespace: str) -> int:
    """The namespace's resident names at an endpoint (one on standby takes no slot): in its
    last listing (none before one), and the loads sent there that it lacks."""
    listing = rt.books.registries.get(endpoint)
    listed = listing.entries if listing is not None else {}
    prefix = f"{namespace}."
    sent = sum(1 for name in rt.books.reservations.loads.get(endpoint, {}) if name.startswith(prefix) and name not in listed)
    return (listing.per_namespace[namespace] if listing is not None else 0) + sent


def placed_targets(view: FleetView, placement: Placement) -> list[Target]:
    """The placed agents as load targets (a Ready pod whose Describe failed stays a target
    that does not hold the adapter)."""
    chosen = []
    for agent in view.dialable:
        if agent.name not in placement.placed:
            continue
        info = view.infos.get(agent.name)
        if isinstance(info, AgentInfo):
            chosen.append(Target(agent, info))
        elif isinstance(info, AgentError):
            chosen.append(Target(agent, None, info))
    return chosen


def standby_targets(view: FleetView, placement: Placement, adapter: AdapterObject) -> list[Target]:
    """An adapter on standby (:attr:`~lorafleet_operator.resources.AdapterSpec.standby`): the
    fleet's agents that serve its base model and are not placed, as standby load targets."""
    if not adapter.spec.standby:
        return []
    return [
        Target(agent, info, standby=True)
        for agent in view.dialable
        if agent.name not in placement.placed
        and isinstance(info := view.infos.get(agent.name), AgentInfo)
        and info.base_model == adapter.spec.base_model
    ]
