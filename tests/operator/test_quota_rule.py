"""The quota rule as plain decisions (placement.py, ``QuotaUse``), the Ready reason it gives, and
``spec.quotas`` read from a LoraFleet; end to end: test_quotas.py."""

from __future__ import annotations

from lorafleet_operator.placement import SkipReason, place
from lorafleet_operator.reasons import Reason
from lorafleet_operator.resources import SlotQuota, fleet_spec_of
from lorafleet_operator.slot_quotas import QuotaUse
from lorafleet_operator.status import build_status
from tests.operator.test_placement import agent, want


def quota(used: int, max_slots: int = 3, endpoints: tuple[str, ...] = ("ep-a0", "ep-a1")) -> QuotaUse:
    return QuotaUse("home/small", "spec.quotas.default", "t", max_slots, endpoints, used)


def test_a_quota_caps_new_places_and_says_which_quota() -> None:
    agents = [agent("a0", cap=8), agent("a1", cap=8)]
    got = place(agents, [want("t.x", order="1"), want("t.y", order="2")], [quota(used=0)])
    assert got["t.x"].placed == ("a0", "a1")
    assert got["t.y"].placed == ("a0",)  # the third slot; the fourth is over the quota
    assert [(s.pod, s.reason) for s in got["t.y"].skipped] == [("a1", SkipReason.QUOTA)]
    assert got["t.y"].waiting  # more room under the quota would be taken
    pending = place(agents, [want("t.z")], [quota(used=3)])["t.z"]
    message = "namespace t holds 3 of its 3 slots on LoraFleet home/small (spec.quotas.default)"
    assert (pending.placed, pending.why_not()) == ((), message)
    ready = build_status([], generation=1, placement=pending)["conditions"][0]
    assert (ready["reason"], ready["message"]) == (Reason.QUOTA_EXCEEDED, message)


def test_a_quota_binds_only_its_agents_and_a_full_agent_stays_no_room() -> None:
    agents = [agent("a0", cap=8), agent("a1", {"x", "y"})]
    got = place(agents, [want("t.n")], [quota(used=5, endpoints=("ep-a0",))])["t.n"]
    assert got.placed == ()
    assert {s.pod: s.reason for s in got.skipped} == {"a0": SkipReason.QUOTA, "a1": SkipReason.FULL}
    assert build_status([], generation=1, placement=got)["conditions"][0]["reason"] == Reason.NO_ROOM


def test_places_held_are_kept_when_a_quota_is_lowered_below_them() -> None:
    """Like a ResourceQuota: a lowered quota refuses new places and evicts nothing."""
    agents = [agent("a0", {"t.x", "t.y"}, cap=8), agent("a1", {"t.x"}, cap=8)]
    demands = [want("t.x", previous=("a0", "a1")), want("t.y", previous=("a0",))]
    got = place(agents, demands, [quota(used=3, max_slots=1)])
    assert (got["t.x"].placed, got["t.y"].placed) == (("a0", "a1"), ("a0",))
    assert [s.reason for s in got["t.y"].skipped] == [SkipReason.QUOTA]


def test_the_spec_names_a_namespace_or_falls_back_to_the_default() -> None:
    spec = fleet_spec_of({"quotas": {"default": {"maxSlots": 2}, "namespaces": [{"namespace": "a", "maxSlots": 5}]}})
    assert spec.quotas.of("a") == SlotQuota(5, "spec.quotas.namespaces[namespace=a]")
    assert spec.quotas.of("b") == SlotQuota(2, "spec.quotas.default")
    assert fleet_spec_of({"quotas": {"namespaces": [{"namespace": "a", "maxSlots": 0}]}}).quotas.of("b") is None
    assert not fleet_spec_of({}).quotas
