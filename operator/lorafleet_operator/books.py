"""The ledgers one operator process keeps about its loads and the agents' registries.

They are caches of what the process did and saw, never the truth (the API server and the
agents are): losing them (a restart) costs at most one extra round of calls.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from lorafleet_common.registry import RegistryEntry
from lorafleet_operator.config import Settings
from lorafleet_operator.crashes import CrashBook
from lorafleet_operator.demand import AdapterScaling
from lorafleet_operator.failures import LoadRetries
from lorafleet_operator.placement import Demand
from lorafleet_operator.reservations import Reservations


@dataclass(frozen=True)
class Listing:
    """One agent's registry as last listed: when it was asked, by which pod life."""

    requested_at: float
    life: tuple[str, int]
    entries: Mapping[str, RegistryEntry]

    @functools.cached_property
    def per_namespace(self) -> collections.Counter[str]:
        """How many names of each namespace (``<namespace>.<name>``) it lists resident: the
        slots each holds there (quotas; one on standby takes no slot), counted once per
        listing, not at every placement."""
        return collections.Counter(name.partition(".")[0] for name, entry in self.entries.items() if "." in name and not entry.standby)


@dataclass
class SentLoads:
    """The loads this process sent to each agent, per registry name: from when a registry
    listing shows what became of them. A deletion unloads only from agents that may hold
    the adapter (:func:`~lorafleet_operator.unloads.may_hold`); an agent whose listing was
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


@dataclass
class Books:
    """Every ledger of the process, obeyed by the handlers and the drift check alike."""

    #: Failed loads per (adapter uid, generation, pod), and when to try again (the back-off).
    failures: LoadRetries
    #: Loads in flight when their agent died or hung, per adapter generation.
    crashes: CrashBook
    #: Every load sent, per agent endpoint and name, and when a listing shows its outcome
    #: (deletions unload only where the adapter may be held).
    sent: SentLoads = field(default_factory=SentLoads)
    #: Loads sent and not yet seen in a registry listing, per agent endpoint (placement).
    reservations: Reservations = field(default_factory=Reservations)
    #: agent endpoint -> its last registry listing (placement in handlers reuses it).
    registries: dict[str, Listing] = field(default_factory=dict)
    #: (namespace, adapter) -> when a handler last finished reconciling it (monotonic): a
    #: drift check whose registry listing is older leaves it alone (``drift.converge_adapter``).
    reconciled: dict[tuple[str, str], float] = field(default_factory=dict)
    #: (namespace, fleet) -> registry name -> what its adapters still waiting for room ask
    #: placement for, so a handler places its adapter after them (renewed by each drift check).
    demands: dict[tuple[str, str], dict[str, Demand]] = field(default_factory=dict)
    #: (namespace, fleet) -> registry name -> its scaling by demand (``spec.scaling``), renewed
    #: by each drift check (:mod:`~lorafleet_operator.scaling`).
    scaling: dict[tuple[str, str], dict[str, AdapterScaling]] = field(default_factory=dict)

    @classmethod
    def empty(cls, settings: Settings) -> Books:
        """Empty books under these settings (the back-off's and the crash budget's)."""
        return cls(LoadRetries(settings), CrashBook(settings.load_crash_budget))
