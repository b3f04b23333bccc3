"""Placement (operator/lorafleet_operator/placement.py) and bounded status.

The rule as plain decisions first (no cluster); then the caps against the CRDs, the largest
status the operator can build against the real API server, a refused status patch sent only
once; then end to end: the real operator, real agents (tp=2, dp=2, at most 2 adapters each;
agent-1 allows rank 8 only), the real API server.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from lorafleet_common.registry import RegistryEntry
from lorafleet_dev.agents import AgentProcess
from lorafleet_dev.node import machine_ip
from lorafleet_operator.agent_client import AgentClients
from lorafleet_operator.agent_values import AgentBackend, AgentInfo, Credentials
from lorafleet_operator.books import Listing
from lorafleet_operator.conditions import MAX_MESSAGE
from lorafleet_operator.config import Settings
from lorafleet_operator.drift import handled, unwanted
from lorafleet_operator.fleet import AgentPod
from lorafleet_operator.handlers import reconcile_adapter
from lorafleet_operator.kube import Kube, make_api_client
from lorafleet_operator.placement import Candidate, Demand, SkipReason, place
from lorafleet_operator.publish import publish_status
from lorafleet_operator.reasons import Reason
from lorafleet_operator.reservations import Reservations
from lorafleet_operator.resources import adapter_of, fleet_of, fleet_spec_of
from lorafleet_operator.routing import ADAPTER_LABEL
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.slot_quotas import Guarantees, QuotaUse
from lorafleet_operator.status import (
    MAX_AGENT_MESSAGE,
    MAX_BACKEND_KIND,
    MAX_BACKEND_VERSION,
    MAX_LISTED_AGENTS,
    MAX_LISTED_MEMBERS,
    MAX_LISTED_PLACED,
    MAX_LISTED_SKIPS,
    MAX_SKIP_MESSAGE,
    STATUS_BUDGET,
    AgentResult,
    AgentState,
    ServedVersion,
    build_status,
    fleet_status,
    member,
)
from lorafleet_operator.view import FleetView, Registry
from tests.kube.harness import CHECKOUT, ControlPlane
from tests.operator.agents import (
    FLEET_LABEL,
    adapter_manifest,
    agent_spec,
    apply,
    fleet_manifest,
    make_adapter,
    registry,
    serving,
    status,
)
from tests.operator.conftest import OperatorProcess, wait_for

# ---- the rule, as plain decisions -------------------------------------------------------


def agent(
    pod: str,
    held: set[str] | None = None,
    *,
    cap: int = 2,
    rank: int = 16,
    model: str = "m",
    dialable: bool = True,
    known: bool = True,
    failing: bool = False,
) -> Candidate:
    return Candidate(
        pod,
        f"ep-{pod}",
        dialable,
        known=known,
        base_model=model,
        max_lora_rank=rank,
        max_loaded_loras=cap,
        held=frozenset(held or ()),
        failing=failing,
    )


def want(
    name: str,
    *,
    replicas: int | None = None,
    rank: int | None = None,
    order: str = "",
    previous: tuple[str, ...] = (),
    refused: frozenset[str] = frozenset(),
) -> Demand:
    return Demand(name, "m", replicas, rank, (order or name, name), previous, refused)


def test_unset_replicas_is_every_fitting_agent_with_room() -> None:
    got = place([agent("a0"), agent("a1"), agent("a2", model="other"), agent("a3", {"x", "y"})], [want("n")])["n"]
    assert got.placed == ("a0", "a1")
    assert {s.pod: s.reason for s in got.skipped} == {"a2": SkipReason.BASE_MODEL, "a3": SkipReason.FULL}
    assert got.why_not() == ""  # replicas unset: every agent with room is all it asks for


def test_replicas_go_to_the_least_loaded_agents_and_never_exceed_n() -> None:
    agents = [agent("a0", {"x"}, cap=4), agent("a1", cap=4), agent("a2", {"x", "y"}, cap=4)]
    got = place(agents, [want("n", replicas=2)])["n"]
    assert got.placed == ("a0", "a1")
    assert [(s.pod, s.reason) for s in got.skipped] == [("a2", SkipReason.NOT_NEEDED)]


def test_an_agent_left_out_says_full_when_it_is_full_whatever_order_it_was_reached_in() -> None:
    """A full agent that failed a load sorts after the others; once the replicas are placed
    it is still skipped as Full, not as ReplicasReached (found flaky in the vLLM operator test:
    the reason depended on whether an earlier load there had failed)."""
    agents = [agent("a0", {"x"}, cap=1, failing=True), agent("a1", {"x", "y"}, cap=4), agent("a2", cap=4, failing=True)]
    got = place(agents, [want("n", replicas=1)])["n"]
    assert got.placed == ("a1",)
    assert [(s.pod, s.reason) for s in got.skipped] == [("a0", SkipReason.FULL), ("a2", SkipReason.NOT_NEEDED)]
    assert not got.waiting  # its one replica is placed: a full agent elsewhere is no reason to wait


def test_agents_with_failed_loads_get_new_adapters_only_after_the_others() -> None:
    """An agent that refuses every load holds nothing, so it is the least loaded: without the
    back-off book's word it would be every new adapter's first choice (found at fleet scale:
    replicas 4 with 6 of 64 agents refusing left 40 of 200 adapters Failed)."""
    agents = [
        agent("bad0", cap=8, failing=True),
        agent("bad1", cap=8, failing=True),
        agent("ok0", {"x", "y"}, cap=8),
        agent("ok1", {"x"}, cap=8),
    ]
    got = place(agents, [want("n", replicas=2)])["n"]
    assert got.placed == ("ok0", "ok1")
    # Still chosen when the others cannot take it (full), and with replicas unset.
    full = [agent("bad0", failing=True), agent("ok0", {"x", "y"})]
    assert place(full, [want("n", replicas=1)])["n"].placed == ("bad0",)
    assert place(agents, [want("n")])["n"].placed == ("bad0", "bad1", "ok0", "ok1")


def test_spread_over_a_fleet_in_creation_order() -> None:
    """Four single-replica adapters on two empty agents: two each, the oldest first."""
    got = place([agent("a0", cap=8), agent("a1", cap=8)], [want(f"n{i}", replicas=1, order=str(i)) for i in range(4)])
    assert [got[f"n{i}"].placed for i in range(4)] == [("a0",), ("a1",), ("a0",), ("a1",)]


def test_stable_agents_that_come_and_go_never_move_an_adapter() -> None:
    before = [agent("a0", {"n"}, cap=8), agent("a1", cap=8)]
    first = place(before, [want("n", replicas=1)])["n"]
    assert first.placed == ("a0",)
    # An empty agent appears (and would be the least loaded), another goes away: no move.
    after = [*before, agent("a2", cap=8), agent("a3", dialable=False)]
    again = place(after, [want("n", replicas=1, previous=first.placed)])["n"]
    assert again.placed == ("a0",)


def test_placed_again_when_its_agent_stops_being_ready() -> None:
    got = place([agent("a0", {"n"}, dialable=False), agent("a1")], [want("n", replicas=1, previous=("a0",))])["n"]
    assert got.placed == ("a1",)
    assert [(s.pod, s.reason) for s in got.skipped] == [("a0", SkipReason.NOT_READY)]


def test_an_agent_that_did_not_answer_keeps_its_place_but_gets_no_new_one() -> None:
    silent = agent("a0", known=False)
    assert place([silent, agent("a1")], [want("n", replicas=1, previous=("a0",))])["n"].placed == ("a0",)
    assert place([silent, agent("a1")], [want("n", replicas=1)])["n"].placed == ("a1",)
    # With replicas unset it is a place, as every Ready agent is (retried while silent).
    assert place([silent, agent("a1")], [want("n")])["n"].placed == ("a0", "a1")


def test_rank_known_from_the_spec_skips_agents_with_a_lower_limit() -> None:
    got = place([agent("a0", rank=8), agent("a1", {"x"}, rank=16)], [want("n", replicas=1, rank=16)])["n"]
    assert got.placed == ("a1",)
    assert got.skipped[0].message == "has max_lora_rank 8 < the adapter's rank 16"


def test_an_agent_that_refused_is_used_only_when_nothing_else_fits() -> None:
    """The rank unknown: the agent that refused this version gives its place to another."""
    refused = frozenset({"a0"})
    got = place([agent("a0"), agent("a1", {"x"})], [want("n", replicas=1, previous=("a0",), refused=refused)])["n"]
    assert got.placed == ("a1",)
    assert [(s.pod, s.reason) for s in got.skipped] == [("a0", SkipReason.REFUSED)]
    alone = place([agent("a0"), agent("a1", {"x", "y"})], [want("n", replicas=1, previous=("a0",), refused=refused)])["n"]
    assert alone.placed == ("a0",)  # nothing else has room: it stays (Failed, retried)


def test_fits_nowhere_says_why_and_the_oldest_gets_the_room_first() -> None:
    full = [agent(f"a{i}", {f"x{j}" for j in range(32)}, cap=32) for i in range(4)]
    pending = place(full, [want("n", replicas=1)])["n"]
    assert pending.placed == ()
    assert pending.why_not() == "0 of 4 agents have room: each holds 32 of 32"
    one_free = [replace(full[0], held=frozenset(f"x{j}" for j in range(31))), *full[1:]]
    got = place(one_free, [want("newer", replicas=1, order="2"), want("older", replicas=1, order="1")])
    assert (got["older"].placed, got["newer"].placed) == (("a0",), ())
    mixed = place([agent("a0", {"x", "y"}), agent("a1", rank=8)], [want("n", replicas=1, rank=16)])["n"]
    assert mixed.why_not() == ("0 of 2 agents can hold it: a0 holds 2 of 2; a1 has max_lora_rank 8 < the adapter's rank 16")


def test_reservations_count_loads_until_a_later_listing_has_them() -> None:
    book = Reservations()
    book.reserve("ep", "n")
    assert book.held("ep", {"x"}) == {"x", "n"}  # in flight: counted
    assert len(book.held("ep", {"x", "n"})) == 2  # listed and in flight: counted once
    book.listed("ep", requested_at=5.0)
    assert "n" in book.held("ep", ())  # still in flight: a listing cannot know it
    book.finished("ep", "n", 10.0, loaded=True)
    book.listed("ep", requested_at=9.0)  # requested before the load ended: may lack it
    assert "n" in book.held("ep", ())
    book.listed("ep", requested_at=11.0)  # after: the listing itself says
    assert book.held("ep", ()) == set()
    book.reserve("ep", "m")
    book.finished("ep", "m", 12.0, loaded=False)
    assert book.held("ep", ()) == set()


def test_what_reservations_hold_counts_each_name_once_as_listings_and_books_change() -> None:
    """The size placement reads is kept as loads are reserved, end and are listed (not counted
    anew at every placement): after any sequence it is the size of listing and loads together."""
    rng = random.Random(7)
    book, names = Reservations(), [f"n{i}" for i in range(12)]
    listings = [frozenset(rng.sample(names, k)) for k in (0, 3, 6, 9)]
    listing, clock = listings[0], 0.0
    for _ in range(2000):
        clock += 1.0
        step, name = rng.randrange(5), rng.choice(names)
        if step == 0:
            book.reserve("ep", name)
        elif step in (1, 2):
            book.finished("ep", name, clock, loaded=step == 1)
        elif step == 3:
            book.listed("ep", requested_at=clock - rng.randrange(4))
        else:
            listing = rng.choice(listings)
        held = book.held("ep", listing)
        assert len(held) == len(set(held)) == len(listing | set(book.loads.get("ep", {})))


# ---- bounded status ---------------------------------------------------------------------


def test_adapters_on_standby_take_no_slot_of_their_namespaces_quota() -> None:
    """An adapter on standby (``minReplicas: 0``) is held on disk, in no slot: a quota counts
    only its namespace's resident adapters. Two on standby and one resident under
    ``maxSlots: 2`` still leave a slot for a new place (before, the listing counted 3 of 2)."""

    def entry(name: str, standby: bool = False) -> RegistryEntry:
        return RegistryEntry(name, f"file:///{name}", "ab", False, () if standby else (0,), standby)

    entries = [entry("t.idle-1", standby=True), entry("t.idle-2", standby=True), entry("t.busy"), entry("u.other")]
    listing = Listing(1.0, ("u1", 0), {e.name: e for e in entries})
    assert listing.per_namespace == {"t": 1, "u": 1}
    quota = QuotaUse("home/small", "spec.quotas.default", "t", 2, ("ep-a0",), listing.per_namespace["t"])
    got = place([agent("a0", {"t.busy", "u.other"}, cap=8)], [want("t.new")], [quota])["t.new"]
    assert got.placed == ("a0",)


def guaranteed(namespace: str, used: int, guarantees: Guarantees, endpoints: tuple[str, ...] = ("ep-a0",)) -> QuotaUse:
    """A quota of LoraFleet home/small with no maximum for ``namespace``, only guarantees."""
    return QuotaUse("home/small", "spec.quotas", namespace, None, endpoints, used, guarantees=guarantees)


def test_a_guaranteed_share_keeps_room_from_other_namespaces_new_places() -> None:
    """Namespace b has an adapter waiting and lacks its 1 guaranteed slot: a's new adapter is
    not given the last free slot (QuotaExceeded, naming the guarantee); without the
    guarantee it is."""
    agents = [agent("a0", {"a.old"}, cap=2)]
    keeps = Guarantees(reserved=1, holders=("b",), total=1)
    got = place(agents, [want("a.new")], [guaranteed("a", 1, keeps)])["a.new"]
    message = "LoraFleet home/small keeps 1 slot(s) for the guaranteed share of namespace(s) b (spec.quotas.namespaces[].minSlots)"
    assert (got.placed, [(s.reason, s.message) for s in got.skipped]) == ((), [(SkipReason.QUOTA, message)])
    ready = build_status([], generation=1, placement=got)["conditions"][0]
    assert (ready["reason"], ready["message"]) == (Reason.QUOTA_EXCEEDED, message)
    assert place(agents, [want("a.new")], [guaranteed("a", 1, Guarantees())])["a.new"].placed == ("a0",)


def test_the_drift_check_takes_a_guaranteed_slot_back_from_the_newest_adapter_never_below_its_own_share() -> None:
    """a's two adapters fill a0 while b lacks its guaranteed slot: the drift check (reclaim)
    takes the place of a's newest adapter back; a handler's placement (no reclaim) keeps
    both; a namespace at its own guarantee gives nothing back."""
    agents = [agent("a0", {"a.1", "a.2"}, cap=2)]
    demands = [want("a.1", order="1", previous=("a0",)), want("a.2", order="2", previous=("a0",))]
    keeps = Guarantees(reserved=1, holders=("b",), total=1)
    got = place(agents, demands, [guaranteed("a", 2, keeps)], reclaim=True)
    assert (got["a.1"].placed, got["a.2"].placed) == (("a0",), ())
    assert [s.reason for s in got["a.2"].skipped] == [SkipReason.QUOTA] and got["a.2"].waiting
    kept = place(agents, demands, [guaranteed("a", 2, keeps)])
    assert (kept["a.1"].placed, kept["a.2"].placed) == (("a0",), ("a0",))
    own = Guarantees(reserved=1, holders=("b",), own=2, total=3)
    mine = place([agent("a0", {"a.1", "a.2"}, cap=4)], demands, [guaranteed("a", 2, own)], reclaim=True)
    assert (mine["a.1"].placed, mine["a.2"].placed) == (("a0",), ("a0",))


def test_an_adapter_whose_guaranteed_share_is_taken_back_awaits_it_never_no_room() -> None:
    """b lacks its guaranteed slot and every agent is full: Pending AwaitingGuaranteedSlot
    (naming the quota), never NoRoom. Guarantees beyond the agents' capacity are not kept:
    NoRoom, and the skip says why."""
    agents = [agent("a0", {"a.1", "a.2"}, cap=2)]
    got = place(agents, [want("b.x")], [guaranteed("b", 0, Guarantees(own=1, total=1))])["b.x"]
    assert [s.reason for s in got.skipped] == [SkipReason.GUARANTEED]
    ready = build_status([], generation=1, placement=got)["conditions"][0]
    assert ready["reason"] == Reason.AWAITING_GUARANTEED_SLOT
    assert ready["message"] == (
        "namespace b holds 0 of its 1 guaranteed slots on LoraFleet home/small "
        "(spec.quotas.namespaces[namespace=b].minSlots): taken back from other namespaces"
    )
    over = place(agents, [want("b.x")], [guaranteed("b", 0, Guarantees(own=1, total=3))])["b.x"]
    assert [s.reason for s in over.skipped] == [SkipReason.FULL]
    assert "(spec.quotas.namespaces[].minSlots, 3 in all) exceed its agents' 2 slots: none is kept" in over.skipped[0].message
    assert build_status([], generation=1, placement=over)["conditions"][0]["reason"] == Reason.NO_ROOM
    unkept = Guarantees(reserved=1, holders=("b",), total=3)
    assert place([agent("a0", {"a.1"}, cap=2)], [want("a.new")], [guaranteed("a", 1, unkept)])["a.new"].placed == ("a0",)


def test_min_slots_are_read_from_the_spec() -> None:
    spec = fleet_spec_of({"quotas": {"namespaces": [{"namespace": "a", "maxSlots": 4, "minSlots": 2}, {"namespace": "b", "maxSlots": 1}]}})
    assert spec.quotas.guarantees == (("a", 2),)


def _schema(crd: str) -> dict[str, Any]:
    doc = yaml.safe_load((CHECKOUT.crds / crd).read_text())
    props: dict[str, Any] = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    return props


def test_the_crds_caps_are_the_operators() -> None:
    """One place for the caps (status.py); the CRDs say the same numbers."""
    adapter = _schema("lorafleet.dev_loraadapters.yaml")["status"]["properties"]
    agents = adapter["agents"]
    placement = adapter["placement"]["properties"]
    conditions = adapter["conditions"]["items"]["properties"]
    assert adapter["message"]["maxLength"] == MAX_MESSAGE
    assert conditions["message"]["maxLength"] == MAX_MESSAGE
    assert agents["maxItems"] == MAX_LISTED_AGENTS
    assert agents["items"]["properties"]["message"]["maxLength"] == MAX_AGENT_MESSAGE
    assert placement["placed"]["maxItems"] == MAX_LISTED_PLACED
    assert placement["skipped"]["maxItems"] == MAX_LISTED_SKIPS
    assert placement["skipped"]["items"]["properties"]["message"]["maxLength"] == MAX_SKIP_MESSAGE
    fleet = _schema("lorafleet.dev_lorafleets.yaml")["status"]["properties"]
    assert fleet["members"]["maxItems"] == MAX_LISTED_MEMBERS
    assert fleet["members"]["items"]["properties"]["message"]["maxLength"] == MAX_AGENT_MESSAGE
    backend = fleet["members"]["items"]["properties"]["backend"]["properties"]
    assert (backend["kind"]["maxLength"], backend["version"]["maxLength"]) == (MAX_BACKEND_KIND, MAX_BACKEND_VERSION)
    assert fleet["conditions"]["items"]["properties"]["message"]["maxLength"] == MAX_MESSAGE


def _lists(schema: dict[str, Any], path: str = "status") -> list[tuple[str, dict[str, Any]]]:
    """Every array in a schema, by its dotted path."""
    found = [(path, schema)] if schema.get("type") == "array" else []
    for name, sub in (schema.get("properties") or {}).items():
        found += _lists(sub, f"{path}.{name}")
    return found + (_lists(schema["items"], f"{path}[]") if "items" in schema else [])


def test_the_status_lists_are_atomic_but_conditions() -> None:
    """Only the operator writes status, a whole list at a time: a list keyed per entry (map)
    would cost an entry per item in managedFields at every write and watch event; conditions
    keep the Kubernetes convention (a map by type)."""
    for crd in ("lorafleet.dev_loraadapters.yaml", "lorafleet.dev_lorafleets.yaml"):
        lists = _lists(_schema(crd)["status"])
        assert lists, crd
        for path, schema in lists:
            expected = "map" if path == "status.conditions" else "atomic"
            assert schema.get("x-kubernetes-list-type") == expected, (crd, path)


def test_a_big_fleets_status_lists_its_members_capped_not_ready_first() -> None:
    """LoraFleet: at most MAX_LISTED_MEMBERS members, those not ready chosen first; the rest
    counted (membersNotListed); agents and readyAgents count every pod."""
    info = AgentInfo("m", 2, 2, 1, 1, 2, 16, 4, 32)
    pods = [AgentPod(f"p{i:03d}", "ns", f"u{i}", {}, i % 10 != 0, f"10.0.0.1:{i + 1}", 0) for i in range(200)]
    view = FleetView("ns", tuple(pods), {p.name: info for p in pods if p.dialable}, Credentials(), "f")
    fleet = fleet_of({"metadata": {"name": "f", "generation": 1}})
    got = fleet_status(fleet, view, {p.name: {} for p in pods}, None)
    assert (got["agents"], got["readyAgents"]) == (200, 180)
    assert len(got["members"]) == MAX_LISTED_MEMBERS
    assert got["membersNotListed"] == 200 - MAX_LISTED_MEMBERS
    assert sum(not m["ready"] for m in got["members"]) == 20  # every failing one is listed
    assert [m["pod"] for m in got["members"]] == sorted(m["pod"] for m in got["members"])


def test_a_member_says_what_serves_its_agent() -> None:
    """members[].backend: the kind and version the agent's Describe says, cut to the CRD's caps;
    none for an agent older than that field."""
    pod = AgentPod("p", "ns", "u", {}, True, "10.0.0.1:1", 0)
    vllm = AgentInfo("m", 2, 2, 1, 1, 1, 16, 4, 32, AgentBackend("vllm", "v" * 300, ("http://127.0.0.1:8000", "http://127.0.0.1:8001")))
    assert member(pod, vllm, None)["backend"] == {"kind": "vllm", "version": "v" * MAX_BACKEND_VERSION}
    assert "backend" not in member(pod, AgentInfo("m", 2, 2, 1, 1, 2, 16, 4, 32), None)


def test_the_drift_check_unloads_an_adapter_only_where_placement_dropped_it() -> None:
    """Replicas lowered from 2 to 1: the agent it is no longer placed on unloads it; another
    fleet's adapter (no placement here) is still wanted wherever its fleet selects."""
    info = AgentInfo("m", 2, 2, 1, 1, 2, 16, 4, 32)
    pods = [AgentPod(f"agent-{i}", "ns", f"u{i}", {"f": "1"}, True, f"10.0.0.1:{i + 1}", 0) for i in range(2)]
    view = FleetView("ns", tuple(pods), {p.name: info for p in pods}, Credentials(), "f")
    spec = {"baseModel": "m", "source": {"uri": "file:///a"}}
    adapters = [
        adapter_of({"metadata": {"namespace": "ns", "name": n}, "spec": {**spec, "fleetRef": {"name": f}}})
        for n, f in (("mine", "f"), ("theirs", "g"))
    ]
    fleets = [fleet_of({"metadata": {"name": f}, "spec": {"selector": {"matchLabels": {"f": "1"}}}}) for f in ("f", "g")]
    registries: dict[str, Registry] = {
        p.name: {n: RegistryEntry(n, "file:///a", "", False, (0, 1)) for n in ("ns.mine", "ns.theirs")} for p in pods
    }
    candidates = [agent(p.name, {"ns.mine", "ns.theirs"}, cap=4) for p in pods]
    placements = place([replace(c, base_model="m") for c in candidates], [want("ns.mine", replicas=1, previous=("agent-1",))])
    assert placements["ns.mine"].placed == ("agent-1",)
    assert [(a.name, n) for a, n in unwanted(view, registries, adapters, fleets, placements)] == [("agent-0", "ns.mine")]
    assert (
        unwanted(view, registries, adapters, fleets, placements, busy=frozenset({"ns.mine"})) == []
    )  # a handler is placing it: left alone


def largest_status() -> dict[str, Any]:
    """The biggest status the operator builds: 2,000 placed agents with 253-character names,
    every one failing with a long message and still serving a previous version at a
    2,048-character source, and 2,000 more skipped."""
    pods = [f"{i:04d}-" + "p" * 248 for i in range(4000)]
    old = ServedVersion("file:///" + "u" * 2040, "a" * 64)
    results = [
        AgentResult(p, AgentState.FAILED, 0, 8, f"{p}: " + "e" * 20000, served=old, next_retry="2026-01-01T00:00:00Z") for p in pods[:2000]
    ]
    placement = place(
        [agent(p, {f"x{j}" for j in range(2)} if i >= 2000 else set(), cap=2) for i, p in enumerate(pods)], [want("n", replicas=2000)]
    )["n"]
    return build_status(results, generation=1, placement=placement, crashed="c" * 50000)


def test_the_largest_status_stays_in_its_budget_and_the_api_server_takes_it(
    kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...]
) -> None:
    status_ = largest_status()
    assert len(status_["agents"]) == MAX_LISTED_AGENTS
    assert status_["agentsNotListed"] == 2000 - MAX_LISTED_AGENTS
    assert status_["agentsFailed"] == 2000
    assert status_["placement"]["placedCount"] == 2000
    assert status_["placement"]["skippedCount"] == 2000
    assert len(json.dumps(status_)) <= STATUS_BUDGET
    apply(kube_cluster, kube_namespace, adapter_manifest("big", Path("/adapters/big")))
    kube = Kube(make_api_client(str(kube_cluster.kubeconfig)))
    asyncio.run(kube.patch_adapter_status(kube_namespace, "big", status_))
    stored = kube_cluster.kubectl("get", "la", "big", "-n", kube_namespace, "-o", "json").stdout
    assert len(stored) <= 256 * 1024
    assert json.loads(stored)["status"]["agentsNotListed"] == 2000 - MAX_LISTED_AGENTS


def test_a_refused_status_patch_is_reported_and_never_sent_again(
    kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...]
) -> None:
    """A status the API server refuses (here: a summary its CEL rule rejects) is logged,
    posted as a Warning Event and remembered: the same patch again is not sent (the refusal
    counter would count a second refusal); a different status is."""
    apply(kube_cluster, kube_namespace, adapter_manifest("a", Path("/adapters/a")))
    body = kube_cluster.kubectl_json("get", "la", "a", "-n", kube_namespace)
    settings = Settings()
    rt = Runtime(settings, Kube(make_api_client(str(kube_cluster.kubeconfig))), AgentClients(settings))
    bad = {**build_status([], generation=1), "agentsSummary": "9/9"}

    def refusals() -> float:
        value = REGISTRY.get_sample_value("lorafleet_status_refused_total", {"kind": "LoraAdapter"})
        return value or 0.0

    before = refusals()
    assert asyncio.run(publish_status(rt, adapter_of(body), bad)) is False
    assert refusals() == before + 1
    assert asyncio.run(publish_status(rt, adapter_of(body), bad)) is False
    assert refusals() == before + 1  # not sent again
    events = kube_cluster.kubectl_json("get", "events", "-n", kube_namespace)["items"]
    assert [e["reason"] for e in events] == ["StatusRefused"]
    assert "agentsSummary must equal" in events[0]["message"]
    assert asyncio.run(publish_status(rt, adapter_of(body), build_status([], generation=1))) is True


def test_a_placed_status_read_back_is_not_written_again(
    kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...]
) -> None:
    """The drift check rebuilds every status each round: one the API server stores must
    compare equal when rebuilt (a merge patch drops nested None values), or it would be
    written every round. Replicas unset, then set, then unset again (removed)."""
    apply(kube_cluster, kube_namespace, adapter_manifest("a", Path("/adapters/a")))
    settings = Settings()
    rt = Runtime(settings, Kube(make_api_client(str(kube_cluster.kubeconfig))), AgentClients(settings))
    results = [AgentResult("a0", AgentState.LOADED, 2, 2)]
    for replicas in (None, 1, None):
        placement = place([agent("a0")], [want("n", replicas=replicas)])["n"]
        for written in (True, False):
            body = kube_cluster.kubectl_json("get", "la", "a", "-n", kube_namespace)
            stored = body.get("status") or {}
            new = build_status(results, generation=1, previous=stored, placement=placement, now="2026-01-01T00:00:00Z")
            assert asyncio.run(publish_status(rt, adapter_of(body), new)) is written, (replicas, written)
        stored = kube_cluster.kubectl_json("get", "la", "a", "-n", kube_namespace)["status"]
        assert stored["placement"].get("replicas") == replicas


def test_a_reconcile_marks_the_adapter_for_drift_checks_listed_before_it_ended(
    kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...]
) -> None:
    """The handler's reconcile, run in-process against the API server (its fleet missing, so
    Pending), records when it finished: a drift check whose registries were listed before
    that leaves the adapter alone (its listing misses the handler's work), a later one does
    not. Without the record a check converged from the stale listing and loaded everything
    again (docs/operator.md, drift)."""
    apply(kube_cluster, kube_namespace, adapter_manifest("a", Path("/adapters/a")))
    settings = Settings()
    rt = Runtime(settings, Kube(make_api_client(str(kube_cluster.kubeconfig))), AgentClients(settings))
    body = kube_cluster.kubectl_json("get", "la", "a", "-n", kube_namespace)
    listed_before = time.monotonic()
    asyncio.run(reconcile_adapter(rt, body, "create"))
    listed_after = time.monotonic()
    stored = kube_cluster.kubectl_json("get", "la", "a", "-n", kube_namespace)
    assert stored["status"]["phase"] == "Pending"
    assert handled(rt, adapter_of(stored), listed_at=listed_before)
    assert not handled(rt, adapter_of(stored), listed_at=listed_after)


# ---- end to end -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[AgentProcess], Path]]:
    """Two agents that hold at most 2 adapters each; agent-1 allows rank 8 only. On the
    machine's own address: the API server refuses loopback endpoints in EndpointSlices."""
    root = tmp_path_factory.mktemp("placement-agents")
    spec, adapters = agent_spec(root, max_loaded_loras=2, host=machine_ip())
    agents = [AgentProcess("agent-0", spec, root / "logs"), AgentProcess("agent-1", replace(spec, max_lora_rank=8), root / "logs")]
    with serving(agents):
        yield agents, adapters


def add_pod(cluster: ControlPlane, ns: str, agent: AgentProcess) -> None:
    """The agent's Pod of the default fleet, Ready at the agent's address."""
    cluster.create_agent_pod(ns, agent.name, agent.port, labels={FLEET_LABEL: "default"}, ip=agent.spec.host)


def placed(cluster: ControlPlane, ns: str, name: str) -> list[str]:
    return list((status(cluster, ns, name).get("placement") or {}).get("placed") or [])


def with_replicas(manifest: dict[str, Any], replicas: int | None = None, rank: int | None = None) -> dict[str, Any]:
    extra = {k: v for k, v in (("replicas", replicas), ("rank", rank)) if v is not None}
    return {**manifest, "spec": {**manifest["spec"], **extra}}


def test_replicas_capacity_rank_pending_and_room_in_creation_order(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    small_agents: tuple[list[AgentProcess], Path],
    operator: OperatorProcess,
) -> None:
    (a0, a1), root = small_agents
    ns = kube_namespace
    for a in (a0, a1):
        add_pod(kube_cluster, ns, a)
    apply(kube_cluster, ns, fleet_manifest())
    path = make_adapter(root / ns, "w", rank=4)
    big = make_adapter(root / ns, "big", rank=16)

    def ready(name: str) -> bool:
        return status(kube_cluster, ns, name).get("phase") == "Ready"

    def held() -> tuple[set[str], set[str]]:
        return (set(registry(a0, ns)), set(registry(a1, ns)))

    # Rank 16 stated in the spec: only agent-0 allows it, although both are empty.
    apply(kube_cluster, ns, with_replicas(adapter_manifest("rank16", big), 1, rank=16))
    wait_for(lambda: ready("rank16"), 90, "rank16 Ready", operator)
    assert placed(kube_cluster, ns, "rank16") == ["agent-0"]
    skipped = status(kube_cluster, ns, "rank16")["placement"]["skipped"]
    assert [(s["pod"], s["reason"]) for s in skipped] == [("agent-1", "RankTooLow")]
    # Two replicas: both agents. agent-0 is then full (2 of 2).
    apply(kube_cluster, ns, with_replicas(adapter_manifest("two", path), 2))
    wait_for(lambda: ready("two"), 90, "two Ready", operator)
    assert sorted(placed(kube_cluster, ns, "two")) == ["agent-0", "agent-1"]
    # Replicas unset: the agent with room only; agent-0 is skipped as full.
    apply(kube_cluster, ns, adapter_manifest("every", path))
    wait_for(lambda: ready("every"), 90, "every Ready", operator)
    assert placed(kube_cluster, ns, "every") == ["agent-1"]
    assert held() == ({f"{ns}.rank16", f"{ns}.two"}, {f"{ns}.two", f"{ns}.every"})
    # Full everywhere: Pending with the reason, loaded nowhere (not failing on every agent).
    # Named so that the name order is the reverse of the creation order (the tie-break of
    # creationTimestamp, which has whole seconds: the newer is made a second later).
    apply(kube_cluster, ns, with_replicas(adapter_manifest("z-older", path), 1))
    wait_for(lambda: status(kube_cluster, ns, "z-older").get("phase") == "Pending", 60, "z-older Pending", operator)
    time.sleep(1.1)
    apply(kube_cluster, ns, with_replicas(adapter_manifest("a-newer", path), 1))
    wait_for(lambda: status(kube_cluster, ns, "a-newer").get("phase") == "Pending", 60, "a-newer Pending", operator)
    ready_condition = status(kube_cluster, ns, "z-older")["conditions"][0]
    assert (ready_condition["reason"], ready_condition["message"]) == ("NoRoom", "0 of 2 agents have room: each holds 2 of 2")
    assert held() == ({f"{ns}.rank16", f"{ns}.two"}, {f"{ns}.two", f"{ns}.every"})
    # Room appears on agent-1: the older of the two Pending adapters takes it.
    kube_cluster.kubectl("delete", "la", "every", "-n", ns)
    wait_for(lambda: ready("z-older"), 90, "z-older Ready once room appeared", operator)
    assert placed(kube_cluster, ns, "z-older") == ["agent-1"]
    assert status(kube_cluster, ns, "a-newer")["phase"] == "Pending"
    assert held() == ({f"{ns}.rank16", f"{ns}.two"}, {f"{ns}.two", f"{ns}.z-older"})
    # Leave the module's agents empty for the next test.
    kube_cluster.kubectl("delete", "la", "--all", "-n", ns)
    wait_for(lambda: held() == (set(), set()), 60, "agents emptied", operator)


def test_replicas_changed_on_a_ready_adapter_are_honoured(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    small_agents: tuple[list[AgentProcess], Path],
    operator: OperatorProcess,
) -> None:
    """spec.replicas of a Ready adapter goes 2 -> 1 -> 2: each time the placement,
    the agents' registries (unloaded from the dropped agent, loaded again on it) and the
    adapter's EndpointSlices follow, and the adapter stays Ready throughout what it says."""
    (a0, a1), root = small_agents
    ns = kube_namespace
    for a in (a0, a1):
        add_pod(kube_cluster, ns, a)
    apply(kube_cluster, ns, fleet_manifest())
    manifest = adapter_manifest("r", make_adapter(root / ns, "r"))

    def follows(pods: list[str]) -> bool:
        """Ready, placed on exactly `pods`, held by them only, routed to them only."""
        st = status(kube_cluster, ns, "r")
        return (
            st.get("phase") == "Ready"
            and placed(kube_cluster, ns, "r") == pods
            and [a.name for a in (a0, a1) if registry(a, ns) == {f"{ns}.r": [0, 1]}] == pods
            and sorted(routed(kube_cluster, ns, "r")) == pods
        )

    for replicas, pods in ((2, ["agent-0", "agent-1"]), (1, ["agent-0"]), (2, ["agent-0", "agent-1"])):
        apply(kube_cluster, ns, with_replicas(manifest, replicas))
        wait_for(functools.partial(follows, pods), 90, f"replicas {replicas} on {pods}", operator)
        st = status(kube_cluster, ns, "r")
        assert st["placement"]["replicas"] == replicas
        assert (st["agentsSummary"], st["observedGeneration"]) == (
            f"{len(pods)}/{len(pods)}",
            kube_cluster.kubectl_json("get", "la", "r", "-n", ns)["metadata"]["generation"],
        )
        if replicas == 1:  # the kept agent is the first of the last placement
            assert [(s["pod"], s["reason"]) for s in st["placement"]["skipped"]] == [("agent-1", "ReplicasReached")]
            assert registry(a1, ns) == {}
    kube_cluster.kubectl("delete", "la", "--all", "-n", ns)
    wait_for(lambda: not registry(a0, ns) and not registry(a1, ns), 60, "agents emptied", operator)


def test_a_refused_place_goes_to_another_agent_in_the_same_reconcile(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    small_agents: tuple[list[AgentProcess], Path],
    operator: OperatorProcess,
) -> None:
    """Rank 16, not stated in the spec, one replica: placement picks agent-1 (the least
    loaded), which refuses it (max_lora_rank 8); the handler gives the place to agent-0 in the
    same reconcile, so the adapter goes Ready without ever being Failed (no Failed Event).
    Fails with an operator that moves the place only at the next drift check, after writing
    Failed."""
    (a0, a1), root = small_agents
    ns = kube_namespace
    for a in (a0, a1):
        add_pod(kube_cluster, ns, a)
    apply(kube_cluster, ns, fleet_manifest())

    def ready(name: str) -> bool:
        return status(kube_cluster, ns, name).get("phase") == "Ready"

    def reasons() -> list[str]:
        events = kube_cluster.kubectl_json("get", "events", "-n", ns)["items"]
        return [e["reason"] for e in events if e["involvedObject"]["name"] == "big"]

    # agent-0 holds one adapter first (ties go by pod name), so agent-1 is the least loaded.
    apply(kube_cluster, ns, with_replicas(adapter_manifest("first", make_adapter(root / ns, "first")), 1))
    wait_for(lambda: ready("first"), 90, "first Ready", operator)
    assert placed(kube_cluster, ns, "first") == ["agent-0"]
    apply(kube_cluster, ns, with_replicas(adapter_manifest("big", make_adapter(root / ns, "big", rank=16)), 1))
    wait_for(lambda: ready("big") and "Ready" in reasons(), 90, "big Ready", operator)
    st = status(kube_cluster, ns, "big")
    assert placed(kube_cluster, ns, "big") == ["agent-0"]
    assert [(s["pod"], s["reason"]) for s in st["placement"]["skipped"]] == [("agent-1", "Refused")]
    assert (set(registry(a0, ns)), registry(a1, ns)) == ({f"{ns}.first", f"{ns}.big"}, {})
    assert "Failed" not in reasons(), reasons()
    kube_cluster.kubectl("delete", "la", "--all", "-n", ns)
    wait_for(lambda: not registry(a0, ns) and not registry(a1, ns), 60, "agents emptied", operator)


def routed(cluster: ControlPlane, ns: str, adapter: str) -> list[str]:
    """The pods listed by the adapter's EndpointSlices (docs/operator.md, Routing)."""
    slices = cluster.kubectl_json("get", "endpointslices", "-n", ns, "-l", f"{ADAPTER_LABEL}={adapter}")["items"]
    return [e["targetRef"]["name"] for s in slices for e in s.get("endpoints") or []]
