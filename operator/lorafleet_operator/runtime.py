"""State one operator process shares between its handlers (handed to them as kopf's ``memo``).

Grouped by what it is: settings and clients; the locks; the ledgers (:mod:`books`); caches of
what the agents and the API server said; what kopf's watches keep current, with the drift
loops' wake-ups; and the loads waiting per agent. Only caches and coordination live here: the
truth is always re-read from the API server and the agents. Losing all of it (a restart)
costs at most one extra round of calls.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafleet_operator.agent_client import AgentClients
from lorafleet_operator.agent_values import AgentInfo
from lorafleet_operator.books import Books, Listing
from lorafleet_operator.config import Settings
from lorafleet_operator.fleet import AgentPod, agents_of
from lorafleet_operator.kube import Kube
from lorafleet_operator.resources import FleetObject, FleetSpec
from lorafleet_operator.sending import QueuedLoad, loads_join, send_loads
from lorafleet_operator.shared_calls import SharedCalls
from lorafleet_operator.status import AgentResult
from lorafleet_operator.view import FleetView
from lorafleet_operator.work_queue import BatchQueue

#: (namespace, name) of a LoraAdapter or a LoraFleet.
ObjectKey = tuple[str, str]


@dataclass
class Locks:
    """The locks that keep the process's actors on one object apart, each made on first use."""

    #: One per LoraAdapter: its handlers and the drift check never act on it at once.
    adapters: dict[ObjectKey, asyncio.Lock] = field(default_factory=dict)
    #: One per LoraFleet: its drift check and its deletion never run at once.
    fleets: dict[ObjectKey, asyncio.Lock] = field(default_factory=dict)
    #: agent endpoint -> the lock of its pinned loads (the pin cap is counted under it).
    pins: dict[str, asyncio.Lock] = field(default_factory=dict)

    def adapter(self, namespace: str, name: str) -> asyncio.Lock:
        """The adapter's lock."""
        return self.adapters.setdefault((namespace, name), asyncio.Lock())

    def fleet(self, namespace: str, fleet: str) -> asyncio.Lock:
        """The fleet's lock."""
        return self.fleets.setdefault((namespace, fleet), asyncio.Lock())

    def pin(self, endpoint: str) -> asyncio.Lock:
        """The lock under which pinned loads on one agent are counted and sent."""
        return self.pins.setdefault(endpoint, asyncio.Lock())


@dataclass(frozen=True)
class FleetAgents:
    """A fleet's agents as last made from kopf's indexes: the fleet's spec and the
    namespace's pod summaries they were made from (the very objects: kopf replaces what
    changes)."""

    spec: FleetSpec
    pods: tuple[Mapping[str, Any], ...]
    agents: tuple[AgentPod, ...]


@dataclass(frozen=True)
class PublishedSlices:
    """The EndpointSlices this process last wrote for one adapter (of this uid), as written."""

    uid: str
    slices: tuple[Mapping[str, Any], ...]

    def names(self) -> tuple[str, ...]:
        """The slices' names."""
        return tuple(s["metadata"]["name"] for s in self.slices)


#: (pod uid, restarts, endpoint): one life of one agent at one address.
PodLife = tuple[str, int, str]


@dataclass
class Caches:
    """What the agents and the API server last said, kept to ask them less."""

    #: The agent's Describe, per pod life.
    describes_known: dict[PodLife, AgentInfo] = field(default_factory=dict)
    #: The same key -> the Describe in flight, shared by the reconciles that need it meanwhile.
    describes: SharedCalls[PodLife, AgentInfo] = field(default_factory=SharedCalls)
    #: (agent endpoint, pod life) -> the registry listing in flight there, shared by the
    #: handlers that need one meanwhile.
    listings: SharedCalls[tuple[str, tuple[str, int]], Listing] = field(default_factory=SharedCalls)
    #: (namespace, fleet) -> its agents as last made from the indexes
    #: (:func:`~lorafleet_operator.runtime.fleet_agents`).
    fleet_agents: dict[ObjectKey, FleetAgents] = field(default_factory=dict)
    #: (namespace, fleet) -> the last look at it that had dialable agents: where deletions
    #: unload once its pods, Secrets or the operator's namespaced rights are gone.
    last_views: dict[ObjectKey, FleetView] = field(default_factory=dict)
    #: (namespace, adapter) -> the EndpointSlices last written for it (a digest): written
    #: again only when they change.
    slices: dict[ObjectKey, str] = field(default_factory=dict)
    #: (namespace, adapter) -> the EndpointSlices this process last wrote for it (that write
    #: deleted the others): its deletion deletes these by name without listing them, and the
    #: slice watch puts back any that someone else changes or deletes.
    published_slices: dict[ObjectKey, PublishedSlices] = field(default_factory=dict)
    #: uids of EndpointSlices that carry an adapter's label without being lorafleet's, already
    #: reported in a Warning Event (once per slice).
    untrusted_slices: set[str] = field(default_factory=set)
    #: (kind, namespace, name) -> the digest of the last status patch the API server refused:
    #: the same patch is never sent again.
    refused_status: dict[tuple[str, str, str], str] = field(default_factory=dict)


@dataclass
class Watch:
    """What kopf's watches keep current, and the drift loops' wake-ups and heartbeats."""

    #: namespace -> its pods (:func:`~lorafleet_operator.fleet.pod_summary` of each): kopf's
    #: pod index, live (``handlers.agent_pods``).
    pods: Mapping[str, Iterable[Mapping[str, Any]]] = field(default_factory=dict)
    #: (namespace, fleet) -> that LoraFleet, parsed: kopf's fleet index, live
    #: (``handlers.lora_fleets``).
    fleets: Mapping[ObjectKey, Iterable[FleetObject]] = field(default_factory=dict)
    #: (namespace, pod) -> (exists, ready, ip, restarts) last seen, to poke only on changes.
    pods_seen: dict[ObjectKey, tuple[object, ...]] = field(default_factory=dict)
    #: (namespace, fleet) -> set to run that fleet's drift check now instead of at its interval.
    pokes: dict[ObjectKey, asyncio.Event] = field(default_factory=dict)
    #: (namespace, fleet) -> when its drift loop last finished a round (monotonic): liveness.
    heartbeats: dict[ObjectKey, float] = field(default_factory=dict)

    def poke(self, namespace: str, fleet: str) -> asyncio.Event:
        """The event that wakes a fleet's drift check early."""
        return self.pokes.setdefault((namespace, fleet), asyncio.Event())


@dataclass
class Runtime:
    """The process's settings, clients, locks, ledgers and caches (kopf's ``memo["runtime"]``)."""

    settings: Settings
    kube: Kube
    agents: AgentClients
    locks: Locks = field(default_factory=Locks)
    books: Books = field(init=False)
    caches: Caches = field(default_factory=Caches)
    watch: Watch = field(default_factory=Watch)
    #: The loads of local sources waiting for each agent endpoint (:func:`~lorafleet_operator.
    #: loads.load_each`), at most ``per_agent_concurrency`` calls running per agent, each
    #: carrying up to ``load_batch`` of them (:func:`~lorafleet_operator.sending.send_loads`).
    loads: BatchQueue[QueuedLoad, AgentResult] = field(init=False)

    def __post_init__(self) -> None:
        self.books = Books.empty(self.settings)
        self.loads = BatchQueue(
            self.settings.per_agent_concurrency,
            self.settings.load_batch,
            functools.partial(send_loads, self.agents, self.books),
            functools.partial(loads_join, self.books.crashes),
        )


def fleet_agents(rt: Runtime, namespace: str, fleet_name: str, spec: FleetSpec) -> tuple[AgentPod, ...]:
    """The fleet's agents (:func:`~lorafleet_operator.fleet.agents_of`) among kopf's pod
    index, made again only when the fleet's spec or a pod of the namespace changed (kopf
    replaces the objects of what changed: pods are compared by identity). Made at every
    reconcile, they would be a noticeable share of the operator's CPU at scale."""
    pods = tuple(rt.watch.pods.get(namespace, ()))
    known = rt.caches.fleet_agents.get((namespace, fleet_name))
    if (
        known is not None
        and (known.spec is spec or known.spec == spec)
        and len(known.pods) == len(pods)
        and all(a is b for a, b in zip(known.pods, pods, strict=True))
    ):
        return known.agents
    agents = tuple(agents_of(spec, list(pods)))
    rt.caches.fleet_agents[(namespace, fleet_name)] = FleetAgents(spec, pods, agents)
    return agents
