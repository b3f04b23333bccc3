"""The drift check's decisions as plain functions of what it saw: whether an agent's registry
entry is the adapter's spec (``holds``), which names live resources want on an agent
(``wanted_on``), which managed names it unloads (``unwanted``), and what a fleet admits
(pinning, http(s) source prefixes: ``admission``, ``pin_cap``), which adapters it leaves to
their handlers (``handled``), and which agents a deletion unloads from (``may_hold``,
``departed_holders``). No cluster, no agents."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import grpc

from lorafleet_common.registry import RegistryEntry
from lorafleet_operator.admission import admission
from lorafleet_operator.agent_client import AgentClients
from lorafleet_operator.agent_values import AgentError, AgentInfo, Credentials
from lorafleet_operator.books import Listing
from lorafleet_operator.config import Settings
from lorafleet_operator.drift import Registry, handled, holds, unwanted, wanted_on
from lorafleet_operator.fleet import AgentPod
from lorafleet_operator.pinning import pin_cap
from lorafleet_operator.resources import AdapterObject, FleetObject, FleetSpec, adapter_of, adapter_spec_of, fleet_of, fleet_spec_of
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.unloads import departed_holders, may_hold
from lorafleet_operator.view import FleetView

NS = "team"
SPEC: dict[str, Any] = {"baseModel": "tiny", "source": {"uri": "file:///a/one", "sha256": "ab"}, "fleetRef": {"name": "default"}}


def parsed(adapters: list[dict[str, Any]], fleets: list[dict[str, Any]]) -> tuple[list[AdapterObject], list[FleetObject]]:
    """The bodies as the drift check parses what it lists."""
    return [adapter_of(a) for a in adapters], [fleet_of(f) for f in fleets]


def entry(
    name: str = "team.one", uri: str = "file:///a/one", sha256: str = "ab", pinned: bool = False, ranks: tuple[int, ...] = (0, 1)
) -> RegistryEntry:
    return RegistryEntry(name, uri, sha256, pinned, ranks)


def test_holds_only_the_same_source_sha_and_pinning_on_every_rank() -> None:
    assert holds(entry(), adapter_spec_of(SPEC), ranks_total=2)
    assert not holds(entry(ranks=(0,)), adapter_spec_of(SPEC), ranks_total=2)  # a rank lost it
    assert not holds(entry(uri="file:///a/two"), adapter_spec_of(SPEC), ranks_total=2)  # the spec moved on
    assert not holds(entry(sha256="cd"), adapter_spec_of(SPEC), ranks_total=2)
    assert not holds(entry(pinned=True), adapter_spec_of(SPEC), ranks_total=2)
    assert holds(entry(pinned=True), adapter_spec_of({**SPEC, "pinned": True}), ranks_total=2)
    # Without a sha256 in the spec, any digest the agent computed will do.
    without_sha = {**SPEC, "source": {"uri": "file:///a/one"}}
    assert holds(entry(sha256="whatever"), adapter_spec_of(without_sha), ranks_total=2)


def pod(name: str, labels: dict[str, str] | None = None, ready: bool = True) -> AgentPod:
    return AgentPod(
        name=name,
        namespace=NS,
        uid=f"uid-{name}",
        labels=labels if labels is not None else {"fleet": "default"},
        ready=ready,
        endpoint=f"10.0.0.{len(name)}:50051",
        restarts=0,
    )


def info(base_model: str = "tiny") -> AgentInfo:
    return AgentInfo(
        base_model=base_model,
        tp_size=2,
        dp_size=2,
        attn_tp_size=1,
        ep_size=1,
        moe_tp_size=2,
        max_lora_rank=16,
        max_loras_per_batch=4,
        max_loaded_loras=8,
    )


def fleet(name: str, selector: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": NS}, "spec": {"selector": selector}}


def adapter(name: str, fleet_name: str = "default", base_model: str = "tiny", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": NS}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {**SPEC, "baseModel": base_model, "fleetRef": {"name": fleet_name}}}


FLEETS = [fleet("default", {"matchLabels": {"fleet": "default"}}), fleet("other", {"matchLabels": {"fleet": "other"}})]


def test_wanted_on_an_agent_live_resources_of_fleets_selecting_it_and_its_model() -> None:
    adapters = [
        adapter("one"),
        adapter("two"),
        adapter("gone", deleting=True),  # being deleted: nobody wants it any more
        adapter("elsewhere", fleet_name="other"),  # its fleet does not select the pod
        adapter("bigger", base_model="big"),  # another base model
        adapter("stray", fleet_name="missing"),
    ]  # no such fleet
    assert wanted_on(pod("agent-0"), info(), *parsed(adapters, FLEETS)) == {"team.one", "team.two"}
    # A pod both fleets select serves both fleets' adapters.
    both = pod("agent-0", {"fleet": "default", "also": "x"})
    fleets = [*FLEETS, fleet("also", {"matchLabels": {"also": "x"}})]
    assert "team.also-one" in wanted_on(both, info(), *parsed([*adapters, adapter("also-one", "also")], fleets))
    assert wanted_on(pod("agent-0"), info("big"), *parsed(adapters, FLEETS)) == {"team.bigger"}


def view(*agents: AgentPod, infos: dict[str, AgentInfo | AgentError] | None = None) -> FleetView:
    infos = infos if infos is not None else {a.name: info() for a in agents}
    return FleetView(NS, agents, infos, Credentials())


def test_unwanted_is_every_managed_name_no_live_resource_wants() -> None:
    a0, a1 = pod("agent-0"), pod("agent-1")
    registries: dict[str, Registry] = {
        "agent-0": {n: entry(n) for n in ("team.one", "team.old", "support", "other-ns.one")},
        "agent-1": {n: entry(n) for n in ("team.one", "team.gone")},
    }
    adapters = [adapter("one"), adapter("gone", deleting=True)]
    decided = unwanted(view(a0, a1), registries, *parsed(adapters, FLEETS))
    # Hand-loaded names ("support") and other namespaces' names are never touched.
    assert [(a.name, n) for a, n in decided] == [("agent-0", "team.old"), ("agent-1", "team.gone")]


def test_unwanted_leaves_agents_alone_whose_state_is_unknown() -> None:
    a0, a1, a2, a3 = pod("agent-0"), pod("agent-1"), pod("agent-2"), pod("agent-3", ready=False)
    down = AgentError(grpc.StatusCode.UNAVAILABLE, "connection refused")
    registries: dict[str, Registry] = {
        "agent-0": down,  # ListAdapters failed
        "agent-1": {"team.old": entry("team.old")},  # Describe failed: its model is unknown
        # agent-2 turned Ready after the registries were listed: no registry yet
        "agent-3": {"team.old": entry("team.old")},  # not Ready: not dialled at all
    }
    fleet_view = view(a0, a1, a2, a3, infos={"agent-0": info(), "agent-1": down, "agent-2": info()})
    assert unwanted(fleet_view, registries, *parsed([], FLEETS)) == []


def test_the_fleet_admits_pins_and_http_sources_only_as_its_owner_allows() -> None:
    pinned = {**SPEC, "pinned": True}
    remote = {**SPEC, "source": {"uri": "https://models.example/team/a"}}
    refused = admission("default", fleet_spec_of({}), adapter_spec_of(pinned))
    assert refused is not None and refused.reason == "PinningNotAllowed"
    assert admission("default", fleet_spec_of({"pinning": {"allowed": True}}), adapter_spec_of(pinned)) is None
    assert admission("default", fleet_spec_of({}), adapter_spec_of(SPEC)) is None  # file:// is the agents' adapter roots' job
    refused = admission("default", fleet_spec_of({}), adapter_spec_of(remote))
    assert refused is not None and refused.reason == "SourceNotAllowed"
    allow = {"sources": {"allow": ["https://models.example/team/"]}}
    assert admission("default", fleet_spec_of(allow), adapter_spec_of(remote)) is None
    # A prefix is a plain prefix: another path, or a longer host name, is not under it.
    other = {**SPEC, "source": {"uri": "https://models.example/other/a"}}
    longer = {**SPEC, "source": {"uri": "https://models.example.evil/team/a"}}
    assert admission("default", fleet_spec_of(allow), adapter_spec_of(other)) is not None
    assert admission("default", fleet_spec_of(allow), adapter_spec_of(longer)) is not None
    # An adapter the fleet does not admit is not wanted: the drift check unloads it.
    fleets = [{**FLEETS[0], "spec": {**FLEETS[0]["spec"]}}, FLEETS[1]]
    one_pinned = {**adapter("one"), "spec": {**adapter("one")["spec"], "pinned": True}}
    assert wanted_on(pod("agent-0"), info(), *parsed([one_pinned, adapter("two")], fleets)) == {"team.two"}
    fleets[0]["spec"]["pinning"] = {"allowed": True}
    assert wanted_on(pod("agent-0"), info(), *parsed([one_pinned], fleets)) == {"team.one"}


def test_pinning_leaves_one_device_slot_for_unpinned_traffic() -> None:
    assert pin_cap(info()) == 3  # max_loras_per_batch 4


def test_a_deletion_skips_only_agents_known_not_to_hold_the_adapter() -> None:
    """An agent is skipped only when its last listing, by the same pod life, lacks the name
    and was requested after every load of the name sent there ended answered. Anything less
    known (never listed, restarted, a load since, one in flight or unanswered) is unloaded."""
    settings = Settings()
    rt = Runtime(settings, None, AgentClients(settings))
    a0 = pod("agent-0")
    name, ep = "team.one", a0.endpoint
    assert may_hold(rt, a0, name)  # never listed

    def listed(at: float, *held: str, restarts: int = 0) -> None:
        rt.books.registries[ep] = Listing(at, (a0.uid, restarts), {n: entry(n) for n in held})

    listed(10.0, "team.other")
    assert not may_hold(rt, a0, name)  # listed without it, nothing sent: skipped
    listed(10.0, name)
    assert may_hold(rt, a0, name)
    listed(10.0, restarts=1)  # another life of the pod listed: not this one
    assert may_hold(rt, a0, name)
    listed(10.0)
    rt.books.sent.sending(ep, name)
    assert may_hold(rt, a0, name)  # in flight
    rt.books.sent.ended(ep, name, 12.0, answered=True)
    assert may_hold(rt, a0, name)  # ended after the listing was requested
    listed(13.0)
    assert not may_hold(rt, a0, name)  # a later listing shows the (refused) load's outcome
    rt.books.sent.listed(ep, 13.0)  # ... so the book forgets it
    assert rt.books.sent.ends[ep] == {}
    rt.books.sent.sending(ep, name)
    rt.books.sent.ended(ep, name, 14.0, answered=False)  # cut off: it may still complete there
    listed(20.0)
    rt.books.sent.listed(ep, 20.0)  # no listing settles it
    assert may_hold(rt, a0, name)
    rt.books.sent.forget(name)  # the adapter's deletion is done
    assert not may_hold(rt, a0, name)
    assert may_hold(rt, pod("agent-10"), name)  # another endpoint: never listed


def test_a_deletion_also_unloads_where_an_agent_outside_the_fleet_may_hold_it() -> None:
    """Endpoints that are no longer dialable agents of the fleet (pod gone or not ready) are
    unloaded from when this process's newest listing there has the name, or a load of it sent
    there is not settled; agents of the fleet are :func:`may_hold`'s, never listed twice."""
    settings = Settings()
    rt = Runtime(settings, None, AgentClients(settings))
    here = AgentPod(name="agent-0", namespace=NS, uid="u0", labels={}, ready=True, endpoint="10.0.0.1:50051", restarts=0)
    view = FleetView(NS, (here,), {}, Credentials(), "default", FleetSpec())
    name = "team.one"
    assert departed_holders(rt, view, name) == []
    rt.books.registries[here.endpoint] = Listing(1.0, ("u0", 0), {name: entry(name)})
    rt.books.registries["10.0.0.2:50051"] = Listing(1.0, ("u1", 0), {name: entry(name)})
    rt.books.registries["10.0.0.3:50051"] = Listing(1.0, ("u2", 0), {"team.other": entry("team.other")})
    rt.books.sent.sending("10.0.0.4:50051", name)
    assert departed_holders(rt, view, name) == ["10.0.0.2:50051", "10.0.0.4:50051"]
    assert departed_holders(rt, view, "team.other") == ["10.0.0.3:50051"]
    not_ready = FleetView(NS, (dataclasses.replace(here, ready=False),), {}, Credentials(), "default", FleetSpec())
    assert departed_holders(rt, not_ready, name) == ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.4:50051"]


def test_the_check_leaves_an_adapter_to_its_handlers_while_they_have_it_in_hand() -> None:
    """A check converges an adapter only when no handler is reconciling it, its create handler
    has run (it has conditions), and no handler finished it after the check's registries were
    listed: such a listing misses that handler's loads, and converging from it loaded them
    all again (at fleet scale, a third of the loads were sent twice)."""
    settings = Settings()
    rt = Runtime(settings, None, AgentClients(settings))
    seen = {**adapter("one"), "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert not handled(rt, adapter_of(seen), listed_at=10.0)  # no handler of this process touched it
    assert handled(rt, adapter_of(adapter("one")), listed_at=10.0)  # never reconciled: its handler loads it
    rt.books.reconciled[(NS, "one")] = 9.5
    assert not handled(rt, adapter_of(seen), listed_at=10.0)  # done before the listing: the listing shows it
    rt.books.reconciled[(NS, "one")] = 10.5
    assert handled(rt, adapter_of(seen), listed_at=10.0)  # done after it: left to the next check
    assert not handled(rt, adapter_of(seen), listed_at=11.0)

    async def while_locked() -> bool:
        async with rt.locks.adapter(NS, "one"):
            return handled(rt, adapter_of(seen), listed_at=11.0)

    assert asyncio.run(while_locked())  # a handler is reconciling it now
