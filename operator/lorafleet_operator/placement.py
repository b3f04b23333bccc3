"""Placement: which agents of a fleet hold each adapter (docs/operator.md, "Placement").

The rule, as pure functions over plain values so that it can be tested without a cluster:

* ``spec.replicas`` unset: every fitting agent with room; N: exactly N agents (fewer when
  fewer fit; none: Pending, with the reason).
* An agent fits an adapter when it is Ready and answered Describe, serves the adapter's base
  model and, when the adapter's rank is known (``spec.rank``), has ``max_lora_rank`` at least
  that. The rank is otherwise known only to the agents, after they read the adapter: an agent
  that refused this generation (a rank above its limit, or any other refusal) is used only
  when no other agent fits and has room.
* Room: an agent holds at most ``max_loaded_loras`` adapters, counting every name in its
  registry (every namespace, pinned or not, hand-loaded too) and the loads the operator has
  sent there and not seen finish (:class:`Reservations`).
* Stable: an adapter stays where it was placed (the status's last placement) and where it is
  held, as long as that agent fits; it is placed anew only where it lacks replicas. New places
  are the least-loaded agents with room (ties by pod name), agents where a load of any adapter
  failed lately (the back-off book) after the others. Agents that come and go without
  holding it never move it.
* Fleet-wide, in creation order: the adapters of a fleet are placed one after the other,
  oldest first, each taking the room it is given; so when room appears, the oldest Pending
  adapter gets it.
* Quotas (:class:`~lorafleet_operator.slot_quotas.QuotaUse`): a place the adapter does not
  hold yet is given only where every quota binding its namespace on that agent has a slot
  left and leaves the room other namespaces' guaranteed shares (``minSlots``) hold back; places
  it holds are kept, so a quota lowered below what a namespace holds refuses new places and
  evicts nothing, but for the drift check's ``reclaim``: the places another namespace's
  guarantee lacks are taken back from the namespace's newest adapters.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from lorafleet_operator.slot_quotas import QuotaUse, over_quota


class SkipReason(enum.StrEnum):
    """Why an agent of the fleet does not hold an adapter."""

    NOT_READY = "NotReady"
    BASE_MODEL = "BaseModel"
    RANK = "RankTooLow"
    REFUSED = "Refused"
    FULL = "Full"
    QUOTA = "QuotaExceeded"
    #: Full, while its namespace's guaranteed share is taken back from other namespaces.
    GUARANTEED = "AwaitingGuaranteedSlot"
    NOT_NEEDED = "ReplicasReached"


@dataclass(frozen=True)
class Candidate:
    """One agent pod of the fleet, as placement sees it."""

    pod: str
    #: Capacity belongs to the agent process: pods of fleets in several namespaces may dial
    #: the same one, so room is counted per endpoint.
    endpoint: str
    #: The pod is Ready and has an endpoint.
    dialable: bool
    #: Describe and ListAdapters answered: base model, limits and ``held`` are known.
    known: bool = True
    base_model: str = ""
    max_lora_rank: int = 0
    max_loaded_loras: int = 0
    #: Registry names the agent holds or is being sent (:meth:`Reservations.held`).
    held: Collection[str] = frozenset()
    #: A load of some adapter failed there lately (the back-off book): new places go to
    #: agents without one first, so an agent that refuses every load, and so holds nothing,
    #: does not look the least loaded to every new adapter.
    failing: bool = False


@dataclass(frozen=True)
class Demand:
    """One adapter to place: its registry name, what it needs, and where it was."""

    name: str
    base_model: str
    #: None: every fitting agent with room.
    replicas: int | None
    #: The adapter's LoRA rank when the spec states it; None when only the agents know it.
    rank: int | None
    #: Creation order: (creationTimestamp, name).
    order: tuple[str, str]
    #: Pods of its last placement (the status), kept first while they fit.
    previous: tuple[str, ...] = ()
    #: Pods that refused this generation: used only when nothing else fits.
    refused: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Skip:
    """An agent of the fleet not chosen for an adapter, and why."""

    pod: str
    reason: SkipReason
    message: str


#: Skips that more room (or a lower quota use) would end.
_ROOM_SKIPS = (SkipReason.FULL, SkipReason.QUOTA, SkipReason.GUARANTEED)


@dataclass(frozen=True)
class Placement:
    """Where one adapter goes: the chosen pods and why each other agent was skipped."""

    name: str
    #: ``spec.replicas`` (None: every fitting agent with room).
    replicas: int | None
    placed: tuple[str, ...]
    skipped: tuple[Skip, ...]
    #: Agents of the fleet considered.
    agents: int

    @property
    def waiting(self) -> bool:
        """Whether it would take more room if some appeared: placed nowhere, on fewer than
        ``replicas``, or (replicas unset) skipped by a full agent or a quota."""
        if self.why_not():
            return True
        return self.replicas is None and any(s.reason in _ROOM_SKIPS for s in self.skipped)

    def why_not(self) -> str:
        """Why the adapter is on no agent, or on fewer than ``replicas``, e.g. "0 of 4 agents
        have room: each holds 32 of 32" ("" when it has every place it asks for)."""
        blocking = [s for s in self.skipped if s.reason is not SkipReason.NOT_NEEDED]
        if self.replicas is not None and len(self.placed) >= self.replicas:
            return ""  # 0 replicas (an adapter on standby everywhere) asks for no place
        if self.placed and self.replicas is None:
            return ""
        if not self.agents:
            return "the fleet has no agent"
        if blocking and all(s.reason in (SkipReason.QUOTA, SkipReason.GUARANTEED) for s in blocking):
            return "; ".join(dict.fromkeys(s.message for s in blocking))
        full = all(s.reason is SkipReason.FULL for s in blocking)
        head = f"{len(self.placed)} of {self.agents} agents " + ("have room" if full else "can hold it")
        if not blocking:
            return head
        if len({s.message for s in blocking}) == 1 and len(blocking) > 1:
            return f"{head}: each {blocking[0].message}"
        return f"{head}: " + "; ".join(f"{s.pod} {s.message}" for s in blocking)


def unfit(agent: Candidate, demand: Demand) -> Skip | None:
    """Why this (known) agent cannot hold the adapter at all (None: it fits; room is
    another matter)."""
    if agent.base_model != demand.base_model:
        return Skip(agent.pod, SkipReason.BASE_MODEL, f"serves base model {agent.base_model!r}")
    if demand.rank is not None and agent.max_lora_rank < demand.rank:
        return Skip(agent.pod, SkipReason.RANK, f"has max_lora_rank {agent.max_lora_rank} < the adapter's rank {demand.rank}")
    return None


def full_message(held: int, cap: int) -> str:
    """The skip message of an agent without room."""
    return f"holds {held} of {cap}"


def _sorted_out(demand: Demand, agents: Sequence[Candidate]) -> tuple[list[Candidate], list[Candidate], list[Skip]]:
    """The agents that fit, those whose fit is unknown now (a Ready pod whose Describe or
    ListAdapters failed), and the skips of the rest."""
    fitting: list[Candidate] = []
    unknown: list[Candidate] = []
    skipped: list[Skip] = []
    for agent in agents:
        if not agent.dialable:
            skipped.append(Skip(agent.pod, SkipReason.NOT_READY, "is not ready"))
        elif not agent.known:
            unknown.append(agent)
        else:
            skip = unfit(agent, demand)
            if skip is None:
                fitting.append(agent)
            else:
                skipped.append(skip)
    return fitting, unknown, skipped


class _Taken:
    """What one endpoint holds while a fleet is placed: what it held before (read through,
    not copied: a thousand names per agent, 64 agents, at every reconcile) and the places
    given since."""

    def __init__(self, before: Collection[str]) -> None:
        self._before = before
        self._added: set[str] = set()
        self._removed: set[str] = set()  # taken back (a guaranteed share of another namespace)

    def __len__(self) -> int:
        return len(self._before) + len(self._added) - len(self._removed)

    def __contains__(self, name: str) -> bool:
        return name in self._added or (name in self._before and name not in self._removed)

    def add(self, name: str) -> None:
        if name in self._removed:
            self._removed.discard(name)
        elif name not in self._before:
            self._added.add(name)

    def remove(self, name: str) -> None:
        if name in self._added:
            self._added.discard(name)
        elif name in self._before:
            self._removed.add(name)


class _Slots:
    """What every endpoint holds while a fleet is placed, and the capacity of those whose
    agent answered (the quotas' free slots are counted over them)."""

    def __init__(self, agents: Sequence[Candidate]) -> None:
        self.held: dict[str, _Taken] = {}
        self.caps: dict[str, int] = {}
        for agent in sorted(agents, key=lambda a: not a.known):
            self.held.setdefault(agent.endpoint, _Taken(agent.held))
            if agent.known:
                self.caps.setdefault(agent.endpoint, agent.max_loaded_loras)

    def of(self, quota: QuotaUse) -> tuple[int, int]:
        """(free slots, capacity) on the quota's endpoints."""
        caps = [(endpoint, cap) for endpoint, cap in self.caps.items() if endpoint in quota.endpoints]
        return sum(max(0, cap - len(self.held[endpoint])) for endpoint, cap in caps), sum(cap for _, cap in caps)

    def reclaim(self, demands: Sequence[Demand], quotas: Sequence[QuotaUse]) -> None:
        """Take back, newest adapter first, the places other namespaces' guarantees lack
        (:meth:`~lorafleet_operator.slot_quotas.QuotaUse.to_reclaim`): they are placed again
        as any new place is, which those guarantees then refuse."""
        for quota in quotas:
            due = quota.to_reclaim(*self.of(quota))
            endpoints = sorted(e for e in self.held if e in quota.endpoints)
            for demand in sorted(demands, key=lambda d: d.order, reverse=True):
                for endpoint in endpoints:
                    if due and demand.name in self.held[endpoint]:
                        self.held[endpoint].remove(demand.name)
                        quota.give_back()
                        due -= 1


class _Room:
    """Room and quotas as one adapter is placed: what each endpoint holds, and the quotas of
    its namespace, counted up at each new place it is given (so its next agent sees it)."""

    def __init__(self, demand: Demand, slots: _Slots, quotas: Sequence[QuotaUse]) -> None:
        self.name, self.slots, self.held, self.quotas = demand.name, slots, slots.held, quotas

    def holds(self, agent: Candidate) -> bool:
        return self.name in self.held[agent.endpoint]

    def has_room(self, agent: Candidate) -> bool:
        return (
            len(self.held[agent.endpoint]) < agent.max_loaded_loras
            and over_quota(agent.endpoint, self.quotas) is None
            and self.guarding(agent.endpoint) is None
        )

    def guarding(self, endpoint: str) -> QuotaUse | None:
        """The first quota whose guaranteed shares of other namespaces a new place on
        ``endpoint`` would cut into (None: none)."""
        # Free slots are counted only where a guarantee holds some back (the common case is none).
        holding = (q for q in self.quotas if q.guarantees.reserved and endpoint in q.endpoints)
        return next((q for q in holding if not q.leaves_room(endpoint, *self.slots.of(q))), None)

    def awaited(self, endpoint: str) -> QuotaUse | None:
        """A quota under which the namespace lacks its own guaranteed share on ``endpoint``."""
        lacking = (q for q in self.quotas if endpoint in q.endpoints and q.used < q.guarantees.own)
        return next((q for q in lacking if q.guarantees.fit(self.slots.of(q)[1])), None)

    def claim(self, agent: Candidate) -> bool:
        """Room and quota for a new place there, taken at once (False: none)."""
        if not self.has_room(agent):
            return False
        for quota in self.quotas:
            quota.take(agent.endpoint)
        return True

    def no_room(self, agent: Candidate) -> Skip:
        """The skip of an agent without room for a new place: full, or over a quota there."""
        holds = len(self.held[agent.endpoint])
        quota = over_quota(agent.endpoint, self.quotas)
        if holds < agent.max_loaded_loras and quota is not None:
            return Skip(agent.pod, SkipReason.QUOTA, quota.message())
        guarding = self.guarding(agent.endpoint)
        if holds < agent.max_loaded_loras and guarding is not None:
            return Skip(agent.pod, SkipReason.QUOTA, guarding.guarantee_message())
        awaited = self.awaited(agent.endpoint)
        if awaited is not None:
            return Skip(agent.pod, SkipReason.GUARANTEED, awaited.awaited_message())
        message = full_message(holds, agent.max_loaded_loras)
        for quota in (q for q in self.quotas if q.guarantees.own and agent.endpoint in q.endpoints):
            _, capacity = self.slots.of(quota)
            if not quota.guarantees.fit(capacity):
                message += f"; {quota.unkept_message(capacity)}"
        return Skip(agent.pod, SkipReason.FULL, message)


def _staying(demand: Demand, fitting: list[Candidate], unknown: list[Candidate], room: _Room, wanted: int) -> list[Candidate]:
    """The agents it stays on: the last placement first (in its order; one it no longer
    holds only with room, taken while fewer than ``wanted`` stay), then other holders by name;
    with ``replicas`` unset, agents that did not answer. An agent that refused this version
    competes with the others, last."""
    by_pod = {a.pod: a for a in fitting + unknown}
    staying: list[Candidate] = []
    for pod in dict.fromkeys(demand.previous):
        agent = by_pod.get(pod)
        if agent is None or pod in demand.refused:
            continue
        if not agent.known or room.holds(agent) or (room.claim(agent) if len(staying) < wanted else room.has_room(agent)):
            staying.append(agent)
    kept = {a.pod for a in staying}
    staying += [a for a in fitting if room.holds(a) and a.pod not in kept and a.pod not in demand.refused]
    if demand.replicas is None:
        staying += [a for a in unknown if a.pod not in kept]
    return staying


def place_one(demand: Demand, agents: Sequence[Candidate], slots: _Slots, quotas: Sequence[QuotaUse] = ()) -> Placement:
    """Place one adapter given what each endpoint holds (``slots``, updated in place with the
    new places, so the next adapter sees the room this one took) and the quotas that bind its
    namespace (counted up likewise).

    An agent whose fit is unknown now (it did not answer) keeps a place it had (it is then
    reported as unreachable, and retried), and with ``replicas`` unset it is a place as
    every Ready agent is today; it is never chosen anew for N replicas."""
    fitting, unknown, skipped = _sorted_out(demand, agents)
    room = _Room(demand, slots, quotas)
    held = slots.held
    wanted = len(fitting) + len(unknown) if demand.replicas is None else demand.replicas
    staying = _staying(demand, fitting, unknown, room, wanted)
    kept = {a.pod for a in staying}
    chosen = staying[:wanted]
    for agent in staying[wanted:]:
        skipped.append(Skip(agent.pod, SkipReason.NOT_NEEDED, f"is not needed: {wanted} replica(s) placed elsewhere"))
    skipped += [Skip(a.pod, SkipReason.NOT_READY, "did not answer") for a in unknown if a.pod not in kept]
    # New places: agents that did not refuse it first, then those with no failed load of any
    # adapter, least loaded first, ties by pod name.
    rest = sorted(
        (a for a in fitting if a.pod not in kept), key=lambda a: (a.pod in demand.refused, a.failing, len(held[a.endpoint]), a.pod)
    )
    for agent in rest:
        if len(chosen) >= wanted:
            # Said by the agent's own state, not by the order it was reached in: a full
            # agent is Full even when the replicas were placed before it.
            could = room.holds(agent) or room.has_room(agent)
            not_needed = Skip(agent.pod, SkipReason.NOT_NEEDED, f"is not needed: {wanted} replica(s) placed")
            skipped.append(not_needed if could else room.no_room(agent))
        elif room.holds(agent) or room.claim(agent):
            chosen.append(agent)
        else:
            skipped.append(room.no_room(agent))
    for agent in chosen:
        if agent.known:
            held[agent.endpoint].add(demand.name)
    # A refused agent that is not chosen says so, whatever else kept it out.
    skipped = [
        Skip(s.pod, SkipReason.REFUSED, "refused this version of the adapter")
        if s.pod in demand.refused and s.reason in (SkipReason.NOT_NEEDED, SkipReason.FULL)
        else s
        for s in skipped
    ]
    return Placement(
        demand.name, demand.replicas, tuple(sorted(a.pod for a in chosen)), tuple(sorted(skipped, key=lambda s: s.pod)), len(agents)
    )


def place(
    agents: Sequence[Candidate], demands: Iterable[Demand], quotas: Sequence[QuotaUse] = (), *, reclaim: bool = False
) -> dict[str, Placement]:
    """Place every adapter of a fleet, oldest first; by registry name. Pods at one endpoint
    (fleets of several namespaces may dial one agent) share its room: what the first of them
    that answered says it holds. ``quotas``: those that bind the fleet's namespace (their
    ``used`` counted up with the places given). ``reclaim`` (``demands`` are all of the
    fleet's adapters: the drift check): places other namespaces' guaranteed shares lack are
    taken back first (:meth:`_Slots.reclaim`)."""
    slots = _Slots(agents)
    ordered = sorted(demands, key=lambda d: d.order)
    if reclaim:
        slots.reclaim(ordered, quotas)
    return {d.name: place_one(d, agents, slots, quotas) for d in ordered}
