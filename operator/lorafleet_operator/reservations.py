"""Loads the operator sent and has not yet seen in a registry listing, counted as held by
placement (:mod:`~lorafleet_operator.placement`'s room) until a listing shows them."""

from __future__ import annotations

import collections.abc
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field


@dataclass
class Reservations:
    """Loads the operator sent and has not yet seen in a registry listing, per agent endpoint.

    A registry listing is a snapshot: a load that finished after it was taken is missing from
    it, and two reconciles deciding at once would both see the same free room. Placement
    therefore counts, besides the listing, every load sent to that endpoint that is still in
    flight, or finished after the listing was requested. A load that failed, or one a later
    listing shows (or shows gone), is forgotten. Times are the caller's monotonic clock."""

    #: endpoint -> registry name -> when the load finished (None: in flight).
    loads: dict[str, dict[str, float | None]] = field(default_factory=dict)
    #: endpoint -> the listing :meth:`held` last read and how many reserved names it lacks,
    #: kept as the books change: counting them at every reconcile was a scan of every load in
    #: flight (a thousand per agent when a thousand adapters are created at once).
    _unlisted: dict[str, tuple[Collection[str], int]] = field(default_factory=dict, repr=False)

    def reserve(self, endpoint: str, name: str) -> None:
        """A load of ``name`` is about to be sent to ``endpoint``."""
        book = self.loads.setdefault(endpoint, {})
        if name not in book:
            self._count(endpoint, name, 1)
        book[name] = None

    def finished(self, endpoint: str, name: str, now: float, *, loaded: bool) -> None:
        """The load ended: held from now on (until a listing says otherwise), or not at all."""
        if loaded:
            self.reserve(endpoint, name)
            self.loads[endpoint][name] = now
        elif name in self.loads.get(endpoint, {}):
            del self.loads[endpoint][name]
            self._count(endpoint, name, -1)

    def listed(self, endpoint: str, requested_at: float) -> None:
        """A registry listing of ``endpoint`` was requested at ``requested_at``: loads that had
        finished before it are known from it (held or gone), so their reservations end."""
        book = self.loads.get(endpoint, {})
        for name, done in list(book.items()):
            if done is not None and done < requested_at:
                del book[name]
                self._count(endpoint, name, -1)

    def held(self, endpoint: str, registry: Collection[str]) -> HeldNames:
        """What the endpoint holds for placement: its listing plus the reserved loads (read
        through, as of now: for a placement made before the books change)."""
        reserved = self.loads.get(endpoint, {})
        known = self._unlisted.get(endpoint)
        if known is None or known[0] is not registry:  # another listing: count once for it
            known = (registry, sum(1 for name in reserved if name not in registry))
            self._unlisted[endpoint] = known
        return HeldNames(registry, reserved.keys(), known[1])

    def _count(self, endpoint: str, name: str, step: int) -> None:
        """A reserved name came (``step`` 1) or went (-1): so did one the listing lacks, unless
        the listing has it."""
        known = self._unlisted.get(endpoint)
        if known is not None and name not in known[0]:
            self._unlisted[endpoint] = (known[0], known[1] + step)


class HeldNames(collections.abc.Set[str]):
    """A listing's names and the reserved loads' together, without copying either (each
    agent's thousand names at every reconcile were copied twice: 1.9 ms per placement of one
    adapter over 64 agents holding 1,000 each, 8.5 ms at 2,000). ``extra``: how many reserved
    names the listing lacks. Read it before the books change."""

    def __init__(self, listed: Collection[str], reserved: Collection[str], extra: int) -> None:
        self._listed, self._reserved, self._extra = listed, reserved, extra

    def __contains__(self, name: object) -> bool:
        return name in self._listed or name in self._reserved

    def __len__(self) -> int:
        return len(self._listed) + self._extra

    def __iter__(self) -> Iterator[str]:
        yield from self._listed
        yield from (name for name in self._reserved if name not in self._listed)
