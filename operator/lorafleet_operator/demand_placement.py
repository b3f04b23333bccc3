"""Demand placement (docs/scaling.md): which agents hold each demand-scaled adapter, given the
replicas :mod:`~lorafleet_operator.demand` decided, as a pure function over plain values.

* Fit and room are placement's own rules (:func:`~lorafleet_operator.placement.unfit`: base
  model, rank; room: ``max_loaded_loras``, counting every name an agent holds that this
  placement does not manage, pinned or hand-loaded, as taken).
* Sticky: an adapter stays on every agent that holds it and still fits, up to its replicas;
  a scale-down drops the replicas lowest in its rendezvous order; agents that come and go never
  move an adapter that needs no move.
* New replicas go by rendezvous (highest-random-weight) hashing: the fitting agent with room
  that ranks highest for that adapter, so every decision maker agrees without coordination.
* Scarcity: replicas are granted by demand per replica, highest first (the k-th replica of an
  adapter is worth ``demand / k``); an adapter below its minimum comes first. With no room, a
  replica evicts the least-worth replica of another adapter above its minimum, only when it is
  worth ``eviction_margin`` times more (so two adapters of about equal demand never trade a
  slot back and forth). Pinned replicas are never evicted; a replica under its adapter's
  minimum only when an agent's capacity no longer holds what it has, and the decision says so.

Every adapter gets a :class:`PlacementDecision` (from → to replicas, and why), for Events and
status.
"""

from __future__ import annotations

import enum
import hashlib
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lorafleet_operator.placement import Candidate, Demand, unfit


@dataclass(frozen=True)
class SlotAgent:
    """One agent as demand placement sees it: placement's view of it (``held``: every name in
    its registry, what it holds now) and the managed adapters pinned on it."""

    candidate: Candidate
    #: Pinned replicas hold their slot: never evicted, never scaled away.
    pinned: frozenset[str] = frozenset()

    @property
    def pod(self) -> str:
        """The agent's pod name."""
        return self.candidate.pod


@dataclass(frozen=True)
class AdapterNeed:
    """One demand-scaled adapter: what it needs of an agent, its demand, and its replicas."""

    name: str
    base_model: str
    #: The adapter's LoRA rank when known (None: any agent's limit is taken to fit).
    rank: int | None
    #: Smoothed demand (the unit of its target per replica); orders replicas under scarcity.
    demand: float
    min_replicas: int
    #: Desired replicas (:func:`lorafleet_operator.demand.decide`).
    replicas: int


@dataclass(frozen=True)
class PlacementTuning:
    """How reluctant placement is to evict: a replica evicts another only when worth this many
    times more (>= 1)."""

    eviction_margin: float = 2.0

    def __post_init__(self) -> None:
        if not self.eviction_margin >= 1:
            raise ValueError(f"the eviction margin must be at least 1, not {self.eviction_margin}")


class PlacementReason(enum.StrEnum):
    """Why an adapter holds the replicas it does after placement."""

    KEPT = "Kept"
    SCALED_UP = "ScaledUp"
    SCALED_DOWN = "ScaledDown"
    NO_ROOM = "NoRoom"
    NO_FIT = "NoFittingAgent"
    EVICTED = "Evicted"
    BELOW_MINIMUM = "BelowMinimum"


@dataclass(frozen=True)
class PlacementDecision:
    """One adapter's placement: from → to replicas and why."""

    adapter: str
    from_replicas: int
    to_replicas: int
    reason: PlacementReason
    message: str


@dataclass(frozen=True)
class Move:
    """One load or unload of an adapter on an agent pod."""

    adapter: str
    pod: str


@dataclass(frozen=True)
class DemandPlacement:
    """The placement: the pods of each adapter (sorted), the loads and unloads that make it, and
    a decision per adapter."""

    placed: dict[str, tuple[str, ...]]
    loads: tuple[Move, ...]
    unloads: tuple[Move, ...]
    decisions: tuple[PlacementDecision, ...]


def rendezvous_score(adapter: str, pod: str) -> int:
    """The adapter's highest-random-weight score on a pod: the same everywhere, every time."""
    return int.from_bytes(hashlib.blake2b(f"{adapter}\0{pod}".encode(), digest_size=8).digest(), "big")


def rendezvous_order(adapter: str, pods: Iterable[str]) -> list[str]:
    """``pods`` in the adapter's rendezvous order, highest score first."""
    return sorted(pods, key=lambda pod: (-rendezvous_score(adapter, pod), pod))


def fits(agent: SlotAgent, need: AdapterNeed) -> bool:
    """Whether the agent can hold the adapter at all (ready, known, base model, rank)."""
    candidate = agent.candidate
    if not (candidate.dialable and candidate.known):
        return False
    return unfit(candidate, Demand(need.name, need.base_model, None, need.rank, ("", need.name))) is None


class _Book:
    """The placement being built: each pod's managed replicas, its room, and what happened to
    each adapter (for its decision)."""

    def __init__(self, agents: Sequence[SlotAgent], needs: Sequence[AdapterNeed], margin: float) -> None:
        self.margin = margin
        managed = {n.name for n in needs}
        self.agents = {a.pod: a for a in agents}
        self.needs = {n.name: n for n in needs}
        self.current = {n.name: {a.pod for a in agents if a.candidate.known and n.name in a.candidate.held} for n in needs}
        self.held: dict[str, set[str]] = {a.pod: set() for a in agents}
        self.fixed = {a.pod: sum(1 for name in a.candidate.held if name not in managed) for a in agents}
        self.evicted_by: dict[str, list[str]] = {n.name: [] for n in needs}
        self.forced: set[str] = set()

    def room(self, pod: str) -> int:
        return self.agents[pod].candidate.max_loaded_loras - self.fixed[pod] - len(self.held[pod])

    def count(self, name: str) -> int:
        return sum(1 for names in self.held.values() if name in names)

    def worth(self, name: str, replicas: int) -> float:
        """What the ``replicas``-th replica of an adapter is worth."""
        return self.needs[name].demand / max(replicas, 1)

    def pinned(self, name: str, pod: str) -> bool:
        return name in self.agents[pod].pinned


def _keep(book: _Book) -> None:
    """Each adapter stays where it is and fits: pinned replicas first, then in rendezvous
    order, up to its replicas (pinned ones always)."""
    for need in book.needs.values():
        fitting = [pod for pod in book.current[need.name] if fits(book.agents[pod], need)]
        order = sorted(rendezvous_order(need.name, fitting), key=lambda pod: not book.pinned(need.name, pod))
        for pod in order:
            if book.count(need.name) < need.replicas or book.pinned(need.name, pod):
                book.held[pod].add(need.name)


def _relieve(book: _Book) -> None:
    """An agent that holds more than its capacity (it shrank, or names it holds that this
    placement does not manage grew) sheds its least-worth unpinned replicas, below their
    adapters' minimum only when nothing else is left."""
    for pod in sorted(book.held):
        while book.room(pod) < 0:
            names = [n for n in book.held[pod] if not book.pinned(n, pod)]
            if not names:
                break
            key = {n: (book.count(n) <= book.needs[n].min_replicas, book.worth(n, book.count(n)), n) for n in names}
            victim = min(names, key=key.__getitem__)
            if key[victim][0]:
                book.forced.add(victim)
            book.held[pod].discard(victim)


def _victim(book: _Book, need: AdapterNeed, pods: Sequence[str], worth: float, below_min: bool) -> tuple[str, str] | None:
    """The least-worth replica on one of ``pods`` that this new replica (worth ``worth``) may
    evict: unpinned, of an adapter above its minimum, worth ``margin`` times less (any worth,
    when the new replica is below its own minimum)."""
    best: tuple[float, int, str, str] | None = None
    for rank, pod in enumerate(pods):
        for name in book.held[pod]:
            count = book.count(name)
            if name == need.name or book.pinned(name, pod) or count <= book.needs[name].min_replicas:
                continue
            victim_worth = book.worth(name, count)
            candidate = (victim_worth, rank, name, pod)
            if (below_min or victim_worth * book.margin < worth) and (best is None or candidate < best):
                best = candidate
    return None if best is None else (best[2], best[3])


def _grow(book: _Book) -> set[str]:
    """Grant missing replicas by worth (below-minimum first); returns the adapters left short
    for want of room. It ends: an eviction either lowers the summed shortfall below minimums
    (its victim stays at or above its own) or, at a margin >= 1, raises the summed worth of
    the placed replicas, and neither is ever undone."""
    short: set[str] = set()
    queue = [(_priority(book, n.name), n.name) for n in book.needs.values() if book.count(n.name) < n.replicas]
    heapq.heapify(queue)
    while queue:
        priority, name = heapq.heappop(queue)
        need = book.needs[name]
        count = book.count(name)
        if count >= need.replicas:
            continue
        if priority != _priority(book, name):  # it lost a replica since it was queued
            heapq.heappush(queue, (_priority(book, name), name))
            continue
        pods = rendezvous_order(name, [p for p, a in book.agents.items() if name not in book.held[p] and fits(a, need)])
        free = [p for p in pods if book.room(p) > 0]
        if free:
            book.held[free[0]].add(name)
        else:
            victim = _victim(book, need, pods, book.worth(name, count + 1), count < need.min_replicas)
            if victim is None:
                short.add(name)
                continue
            book.held[victim[1]].discard(victim[0])
            book.evicted_by[victim[0]].append(name)
            book.held[victim[1]].add(name)
            # The evicted adapter may still find room elsewhere, or a replica worth less.
            heapq.heappush(queue, (_priority(book, victim[0]), victim[0]))
        if book.count(name) < need.replicas:
            heapq.heappush(queue, (_priority(book, name), name))
    return short


def _priority(book: _Book, name: str) -> tuple[bool, float]:
    """Heap order of an adapter's next replica: below its minimum first, then most worth."""
    count = book.count(name)
    return (count >= book.needs[name].min_replicas, -book.worth(name, count + 1))


def _decide(book: _Book, need: AdapterNeed, short: set[str]) -> PlacementDecision:
    """The adapter's decision from what happened to it."""
    before, after = len(book.current[need.name]), book.count(need.name)
    fitting = any(fits(a, need) for a in book.agents.values())
    if need.name in book.forced:
        reason, why = PlacementReason.BELOW_MINIMUM, f"below its minimum {need.min_replicas}: the agents' capacity forces it"
    elif book.evicted_by[need.name]:
        takers = ", ".join(sorted(set(book.evicted_by[need.name])))
        reason, why = PlacementReason.EVICTED, f"slots taken by higher demand per replica ({takers})"
    elif after < need.replicas and not fitting:
        reason, why = PlacementReason.NO_FIT, "no ready agent fits it (base model, rank)"
    elif after < need.replicas and need.name in short:
        reason, why = PlacementReason.NO_ROOM, f"{after} of {need.replicas} wanted: no agent has room at its demand per replica"
    elif after > before:
        reason, why = PlacementReason.SCALED_UP, f"{need.replicas} wanted"
    elif after < before:
        reason, why = PlacementReason.SCALED_DOWN, f"{need.replicas} wanted"
    else:
        reason, why = PlacementReason.KEPT, f"{after} replica(s) kept where they are"
    return PlacementDecision(need.name, before, after, reason, f"{before} → {after}: {why}")


def place_by_demand(agents: Sequence[SlotAgent], needs: Sequence[AdapterNeed], tuning: PlacementTuning | None = None) -> DemandPlacement:
    """Place every demand-scaled adapter of a fleet on its agents (pods distinct; an adapter's
    current replicas are the agents whose ``held`` names it)."""
    names = [n.name for n in needs]
    if len(set(names)) != len(names):
        raise ValueError("each adapter must be given once")
    if len({a.pod for a in agents}) != len(agents):
        raise ValueError("each agent pod must be given once")
    book = _Book(agents, needs, (tuning or PlacementTuning()).eviction_margin)
    _keep(book)
    _relieve(book)
    short = _grow(book)
    placed = {n.name: tuple(sorted(p for p, held in book.held.items() if n.name in held)) for n in needs}
    loads = tuple(Move(n, p) for n in sorted(names) for p in placed[n] if p not in book.current[n])
    unloads = tuple(Move(n, p) for n in sorted(names) for p in sorted(book.current[n]) if p not in placed[n])
    decisions = tuple(_decide(book, book.needs[n], short) for n in sorted(names))
    return DemandPlacement(placed, loads, unloads, decisions)
