"""The quotas placement obeys (docs/operator.md, "Quotas and fair share"): one LoraFleet's
``spec.quotas`` as the placement of one namespace's adapters sees it, over the quota's agent
endpoints.

* ``maxSlots``: a new place is given only while the namespace holds fewer slots there.
* ``minSlots`` (a guaranteed share): a namespace with adapters there, placed or waiting for
  room, keeps room for the slots it lacks of its minimum. Another namespace's new place is not
  given when it would leave fewer free slots than those namespaces lack together
  (:meth:`QuotaUse.leaves_room`); and the drift check takes back, from the placing
  namespace's newest adapters, the places the lacking namespaces need, never below the placing
  namespace's own minimum (:meth:`QuotaUse.to_reclaim`). Guarantees whose sum exceeds the
  capacity of the quota's agents are not kept (:meth:`Guarantees.fit`): they could not all be.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class Guarantees:
    """What ``minSlots`` hold back under one quota, from the placing namespace's view:
    ``reserved`` slots other namespaces with adapters there still lack (named in
    ``holders``), ``own`` the placing namespace's minimum, ``total`` the sum of every
    namespace's minimum under the quota."""

    reserved: int = 0
    holders: tuple[str, ...] = ()
    own: int = 0
    total: int = 0

    def fit(self, capacity: int) -> bool:
        """Whether the quota's guarantees can all be kept on agents of this capacity."""
        return self.total <= capacity


class QuotaUse:
    """One quota that binds the namespace being placed: at most ``max_slots`` (None: no
    maximum) of its names on the quota's agent endpoints, ``used`` of them held (or sent) when
    placement began, counted up as places are given (down as they are taken back); and the
    ``guarantees`` other namespaces hold there."""

    def __init__(
        self,
        owner: str,
        field_path: str,
        namespace: str,
        max_slots: int | None,
        endpoints: Collection[str],
        used: int,
        *,
        guarantees: Guarantees = Guarantees(),
    ) -> None:
        self.owner, self.field_path, self.namespace = owner, field_path, namespace
        self.max_slots, self.endpoints, self.used = max_slots, frozenset(endpoints), used
        self.guarantees = guarantees

    def admits(self, endpoint: str) -> bool:
        """Whether one more place on ``endpoint`` stays within the maximum."""
        return endpoint not in self.endpoints or self.max_slots is None or self.used < self.max_slots

    def leaves_room(self, endpoint: str, free: int, capacity: int) -> bool:
        """Whether one more place on ``endpoint`` leaves the room other namespaces'
        guarantees hold back, ``free`` of ``capacity`` slots being free on its endpoints."""
        kept = self.guarantees.reserved and self.guarantees.fit(capacity)
        return endpoint not in self.endpoints or not kept or free - 1 >= self.guarantees.reserved

    def to_reclaim(self, free: int, capacity: int) -> int:
        """How many of the namespace's places to take back for other namespaces' guarantees
        (the drift check): what they lack beyond the free slots, never below its own minimum."""
        if not self.guarantees.reserved or not self.guarantees.fit(capacity):
            return 0
        return max(0, min(self.guarantees.reserved - free, self.used - self.guarantees.own))

    def take(self, endpoint: str) -> None:
        """A new place on ``endpoint`` was given."""
        if endpoint in self.endpoints:
            self.used += 1

    def give_back(self) -> None:
        """A place on one of its endpoints was taken back."""
        self.used -= 1

    def message(self) -> str:
        """The skip message of an agent the maximum keeps the adapter off."""
        return f"namespace {self.namespace} holds {self.used} of its {self.max_slots} slots on LoraFleet {self.owner} ({self.field_path})"

    def guarantee_message(self) -> str:
        """The skip message of an agent other namespaces' guarantees keep the adapter off."""
        holders = ", ".join(self.guarantees.holders)
        return (
            f"LoraFleet {self.owner} keeps {self.guarantees.reserved} slot(s) for the guaranteed share of namespace(s) "
            f"{holders} (spec.quotas.namespaces[].minSlots)"
        )

    def unkept_message(self, capacity: int) -> str:
        """What a full agent's skip adds while the quota's guarantees exceed its capacity."""
        return (
            f"the guaranteed shares on LoraFleet {self.owner} (spec.quotas.namespaces[].minSlots, "
            f"{self.guarantees.total} in all) exceed its agents' {capacity} slots: none is kept"
        )

    def awaited_message(self) -> str:
        """The skip message of a full agent while the namespace lacks its own guarantee."""
        return (
            f"namespace {self.namespace} holds {self.used} of its {self.guarantees.own} guaranteed slots on LoraFleet "
            f"{self.owner} (spec.quotas.namespaces[namespace={self.namespace}].minSlots): taken back from other namespaces"
        )


def over_quota(endpoint: str, quotas: Collection[QuotaUse]) -> QuotaUse | None:
    """The first quota whose maximum a new place on ``endpoint`` would exceed (None: every
    one admits it)."""
    return next((q for q in quotas if not q.admits(endpoint)), None)
