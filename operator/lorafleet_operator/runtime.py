"""State one operator process shares between its handlers (handed to them as kopf's ``memo``).

Only caches and coordination live here: the truth is always re-read from the API server and
the agents. Losing all of it (a restart) costs at most one extra round of calls.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from lorafleet_common.registry import RegistryEntry
from lorafleet_operator.agent_client import AgentClients, AgentInfo
from lorafleet_operator.config import Settings
from lorafleet_operator.failures import CrashBook, LoadRetries
from lorafleet_operator.fleet import AgentPod
from lorafleet_operator.kube import Kube
from lorafleet_operator.placement import Demand, Reservations
from lorafleet_operator.work_queue import BatchQueue

if TYPE_CHECKING:  # reconcile builds views with a Runtime in hand: no import cycle at run time
    from lorafleet_operator.reconcile import FleetView, QueuedLoad
    from lorafleet_operator.status import AgentResult


@dataclass(frozen=True)
class Listing:
    """One agent's registry as last listed: when it was asked, by which pod life."""

    requested_at: float
    life: tuple[str, int]
    entries: Mapping[str, RegistryEntry]


@dataclass
class SentLoads:
    """The loads this process sent to each agent, per registry name: from when a registry
    listing shows what became of them. A deletion unloads only from agents that may hold
    the adapter (:func:`~lorafleet_operator.reconcile.may_hold`); an agent whose listing was
    requested after its last load of the name ended, and lacks the name, does not."""

    #: endpoint -> registry name -> when its last load there ended (answered: a listing
    #: requested later shows the outcome), or infinity while it runs or when it ended
    #: unanswered (it may still complete on the agent: no listing settles it).
    ends: dict[str, dict[str, float]] = field(default_factory=dict)

    def sending(self, endpoint: str, name: str) -> None:
        """A load of ``name`` is about to be sent to ``endpoint``."""
        self.ends.setdefault(endpoint, {})[name] = math.inf

    def ended(self, endpoint: str, name: str, now: float, *, answered: bool) -> None:
        """The load ended: the agent answered it (success or refusal), or not."""
        self.ends.setdefault(endpoint, {})[name] = now if answered else math.inf

    def settled_by(self, endpoint: str, name: str, requested_at: float) -> bool:
        """Whether a listing requested at ``requested_at`` shows the outcome of every load of
        ``name`` sent to ``endpoint`` (true when none was sent)."""
        return self.ends.get(endpoint, {}).get(name, -math.inf) < requested_at

    def listed(self, endpoint: str, requested_at: float) -> None:
        """The endpoint's listing requested at ``requested_at`` is its newest: the loads it
        settles need remembering no more (the book holds only what no listing shows yet)."""
        book = self.ends.get(endpoint, {})
        for name, end in list(book.items()):
            if end < requested_at:
                del book[name]

    def forget(self, name: str) -> None:
        """The adapter is gone: its loads need settling no more."""
        for book in self.ends.values():
            book.pop(name, None)


@dataclass(frozen=True)
class FleetAgents:
    """A fleet's agents as last made from kopf's indexes: the fleet's spec and the
    namespace's pod summaries they were made from (the very objects: kopf replaces what
    changes)."""

    spec: Mapping[str, Any]
    pods: tuple[Mapping[str, Any], ...]
    agents: tuple[AgentPod, ...]


K = TypeVar("K")
V = TypeVar("V")


@dataclass
class SharedCalls(Generic[K, V]):
    """One call in flight per key, its answer shared by every caller that comes while it runs
    (a "single flight"): a thousand reconciles that need the same agent's registry at once
    make one ListAdapters call, not a thousand."""

    running: dict[K, asyncio.Future[V]] = field(default_factory=dict)

    async def get(self, key: K, call: Callable[[], Awaitable[V]]) -> V:
        """The answer of the call in flight for ``key``, or of ``call()`` started now. Its
        error reaches every caller; a caller that gives up (cancelled) does not cancel it for
        the others."""
        future = self.running.get(key)
        if future is None:
            future = asyncio.ensure_future(call())
            self.running[key] = future
            future.add_done_callback(lambda done: self._done(key, done))
        return await asyncio.shield(future)

    def _done(self, key: K, done: asyncio.Future[V]) -> None:
        if self.running.get(key) is done:
            del self.running[key]
        if not done.cancelled():
            done.exception()  # retrieved here: when every caller gave up, nobody else reads it


@dataclass
class Runtime:
    """The process's settings, clients, caches and locks (kopf's ``memo["runtime"]``)."""

    settings: Settings
    kube: Kube
    agents: AgentClients
    #: One lock per LoraAdapter: its handlers and the drift check never act on it at once.
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    #: (namespace, adapter) -> when a handler last finished reconciling it (monotonic): a
    #: drift check whose registry listing is older leaves it alone (``drift.converge_adapter``).
    reconciled: dict[tuple[str, str], float] = field(default_factory=dict)
    #: The loads of local sources waiting for each agent endpoint (:func:`~lorafleet_operator.
    #: reconcile.load_each`), at most ``per_agent_concurrency`` calls running per agent, each
    #: carrying up to ``load_batch`` of them (:func:`~lorafleet_operator.reconcile.send_loads`).
    loads: BatchQueue[QueuedLoad, AgentResult] = field(init=False)
    #: Failed loads per (adapter uid, generation, pod), and when to try again (the back-off).
    failures: LoadRetries = field(init=False)
    #: Loads in flight when their agent died or hung, per adapter generation.
    crashes: CrashBook = field(init=False)
    #: (pod uid, restarts, endpoint) -> the agent's Describe.
    describe_cache: dict[tuple[str, int, str], AgentInfo] = field(default_factory=dict)
    #: The same key -> the Describe in flight, shared by the reconciles that need it meanwhile.
    describes: SharedCalls[tuple[str, int, str], AgentInfo] = field(default_factory=SharedCalls)
    #: One lock per LoraFleet: its drift check and its deletion never run at once.
    fleet_locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    #: (namespace, fleet) -> set to run that fleet's drift check now instead of at its interval.
    pokes: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    #: (namespace, fleet) -> the last look at it that had dialable agents: where deletions
    #: unload once its pods, Secrets or the operator's namespaced rights are gone.
    last_views: dict[tuple[str, str], FleetView] = field(default_factory=dict)
    #: agent endpoint -> the lock of its pinned loads (the pin cap is counted under it).
    pin_locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    #: (namespace, fleet) -> when its drift loop last finished a round (monotonic): liveness.
    heartbeats: dict[tuple[str, str], float] = field(default_factory=dict)
    #: namespace -> its pods (:func:`~lorafleet_operator.fleet.pod_summary` of each): kopf's
    #: pod index, live (``handlers.agent_pods``).
    pods: Mapping[str, Iterable[Mapping[str, Any]]] = field(default_factory=dict)
    #: (namespace, fleet) -> that LoraFleet (:func:`~lorafleet_operator.fleet.fleet_summary`):
    #: kopf's fleet index, live (``handlers.lora_fleets``).
    fleets: Mapping[tuple[str, str], Iterable[Mapping[str, Any]]] = field(default_factory=dict)
    #: (namespace, fleet) -> its agents as last made from the indexes
    #: (:func:`~lorafleet_operator.reconcile.fleet_agents`).
    fleet_agents: dict[tuple[str, str], FleetAgents] = field(default_factory=dict)
    #: (namespace, pod) -> (exists, ready, ip, restarts) last seen, to poke only on changes.
    pods_seen: dict[tuple[str, str], tuple[object, ...]] = field(default_factory=dict)
    #: agent endpoint -> its last registry listing (placement in handlers reuses it).
    registries: dict[str, Listing] = field(default_factory=dict)
    #: (agent endpoint, pod life) -> the registry listing in flight there, shared by the
    #: handlers that need one meanwhile.
    listings: SharedCalls[tuple[str, tuple[str, int]], Listing] = field(default_factory=SharedCalls)
    #: Loads sent and not yet seen in a registry listing, per agent endpoint (placement).
    reservations: Reservations = field(default_factory=Reservations)
    #: Every load sent, per agent endpoint and name, and when a listing shows its outcome
    #: (deletions unload only where the adapter may be held).
    sent: SentLoads = field(default_factory=SentLoads)
    #: (namespace, fleet) -> registry name -> what its adapters still waiting for room ask
    #: placement for, so a handler places its adapter after them (renewed by each drift
    #: check).
    demands: dict[tuple[str, str], dict[str, Demand]] = field(default_factory=dict)
    #: (namespace, adapter) -> the EndpointSlices last written for it (a digest): written
    #: again only when they change.
    slices: dict[tuple[str, str], str] = field(default_factory=dict)
    #: (namespace, adapter) -> the adapter's uid and the names of every EndpointSlice it has
    #: since this process last wrote them (that write deleted the others): its deletion
    #: deletes these by name without listing them.
    slice_names: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    #: (kind, namespace, name) -> the digest of the last status patch the API server refused:
    #: the same patch is never sent again.
    refused_status: dict[tuple[str, str, str], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Imported here: reconcile imports this module (the loads' sending is reconcile's).
        from lorafleet_operator.reconcile import loads_join, send_loads

        self.loads = BatchQueue(
            self.settings.per_agent_concurrency,
            self.settings.load_batch,
            functools.partial(send_loads, self),
            functools.partial(loads_join, self),
        )
        self.failures = LoadRetries(self.settings)
        self.crashes = CrashBook(self.settings.load_crash_budget)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        """The adapter's lock, made on first use."""
        return self.locks.setdefault((namespace, name), asyncio.Lock())

    def fleet_lock(self, namespace: str, fleet: str) -> asyncio.Lock:
        """The fleet's lock, made on first use."""
        return self.fleet_locks.setdefault((namespace, fleet), asyncio.Lock())

    def pin_lock(self, endpoint: str) -> asyncio.Lock:
        """The lock under which pinned loads on one agent are counted and sent."""
        return self.pin_locks.setdefault(endpoint, asyncio.Lock())

    def poke(self, namespace: str, fleet: str) -> asyncio.Event:
        """The event that wakes a fleet's drift check early."""
        return self.pokes.setdefault((namespace, fleet), asyncio.Event())
