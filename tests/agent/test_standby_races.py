"""Concurrent on-demand loads on a full agent (real agent, tp=2, real rank processes, four
adapter places) behind a real gRPC server on loopback: every place holds an idle unpinned
adapter, then first requests for more standby adapters than places arrive at once, with an
operator's LoadAdapter of yet another adapter among them.

Each load must take the place it made room for: an eviction and the load after it hold one
place reservation, which every path that checks capacity counts (the operator's load too), so
no load finds its place taken ("max_loaded_loras (4) reached") and every request is answered.

The first load is held at its start on rank 0 (the tests' `FaultPlan`) until the other requests
and the operator's load are in, so that they all decide while places are being freed. The
registry's place accounting is also checked on its own, with a replace in place (vLLM's servers)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from lorafleet.v1 import agent_pb2 as pb
from node_agent.registry import Registry
from tests.agent.helpers import generate, wait_until
from tests.agent.test_registry import entry
from tests.agent.test_standby import PROMPT, RESIDENT, STANDBY, Served, serve

PLACES = 4
ON_DEMAND = 6  # standby adapters requested at once: more than the places
CONCURRENT_LOADS = 2  # --max-concurrent-adapter-loads' default


@pytest.fixture(scope="module")
def crowded(tmp_path_factory) -> Iterator[Served]:
    yield from serve(tmp_path_factory.mktemp("crowded"), deadline_s=300.0, places=PLACES, max_concurrent=CONCURRENT_LOADS)


@pytest.fixture(autouse=True)
def emptied(crowded: Served) -> Iterator[None]:
    yield
    crowded.resume.touch()
    for adapter in crowded.agent.registry.entries():
        crowded.agent.unload(adapter.name)


def _operator_load(agent: Served, name: str) -> pb.LoadAdapterResponse:
    request = pb.LoadAdapterRequest(name=name, source_uri=(agent.root / "ad3").as_uri())
    return agent.stub.LoadAdapter(request, timeout=300)


def _running(agent: Served, budget: str) -> float | None:
    return agent.agent.metrics.registry.get_sample_value("lorafleet_agent_calls_running", {"budget": budget})


def _consistent(agent: Served) -> None:
    """ListAdapters and the ranks agree: the resident adapters are exactly what every rank holds."""
    listed = agent.listed()
    resident = {name for name, (residency, _) in listed.items() if residency == RESIDENT}
    assert all(ranks == (0, 1) for residency, ranks in listed.values() if residency == RESIDENT), listed
    assert all(ranks == () for residency, ranks in listed.values() if residency == STANDBY), listed
    assert agent.held_by_ranks() == {0: resident, 1: resident}
    assert len(resident) <= PLACES


def test_first_requests_beyond_the_places_are_all_answered_beside_an_operator_load(crowded: Served) -> None:
    for i in range(PLACES):
        crowded.load(f"idle{i}", f"ad{i % 3}")  # every place taken by an idle unpinned adapter
    for i in range(ON_DEMAND):
        crowded.load(f"sb{i}", f"ad{i % 3}", standby=True)
    crowded.resume.unlink()  # loads on the ranks wait at their start
    crowded.paused.unlink(missing_ok=True)
    with ThreadPoolExecutor(ON_DEMAND + 1) as pool:
        first = pool.submit(generate, crowded.stub, PROMPT, "sb0", 3)
        wait_until(crowded.paused.exists, what="the first on-demand load to reach the ranks (a place freed for it)")
        others = [pool.submit(generate, crowded.stub, PROMPT, f"sb{i}", 3) for i in range(1, ON_DEMAND)]
        wait_until(lambda: _running(crowded, "inference") == ON_DEMAND, what="every first request in")
        operator = pool.submit(_operator_load, crowded, "operator")
        wait_until(lambda: operator.done() or _running(crowded, "control") == 1, what="the operator's load in")
        crowded.resume.touch()
        answers = [answer.result() for answer in [first, *others]]
        loaded = operator.result()
    assert all(len(tokens) == 3 for tokens in answers), "every first request is answered"
    assert loaded.success or "max_loaded_loras (4) reached" in loaded.error_message, loaded.error_message
    _consistent(crowded)
    listed = crowded.listed()
    assert ("operator" in listed) == loaded.success
    assert {f"sb{i}" for i in range(ON_DEMAND)} <= set(listed), "no standby adapter lost"


def _loads_done(agent: Served) -> float:
    return agent.agent.metrics.registry.get_sample_value("vllm:lora_adapter_load_seconds_count") or 0.0


def test_a_load_just_published_is_not_evicted_before_its_waiters_lease_it(crowded: Served) -> None:
    """Two requests for each of six standby adapters, at once, on four full places and two
    concurrent loads: each adapter is loaded once. Before a load's waiters leased it, it was idle
    and the next load evicted it; its waiters loaded it again, evicting another's, and so on
    (a benchmark counted 852 loads for 12 requests)."""
    for i in range(PLACES):
        crowded.load(f"idle{i}", f"ad{i % 3}")
    for i in range(ON_DEMAND):
        crowded.load(f"sb{i}", f"ad{i % 3}", standby=True)
    before = _loads_done(crowded)
    crowded.resume.unlink()  # every request is in before the first load completes
    crowded.paused.unlink(missing_ok=True)
    with ThreadPoolExecutor(2 * ON_DEMAND) as pool:
        requests = [pool.submit(generate, crowded.stub, PROMPT, f"sb{i % ON_DEMAND}", 3) for i in range(2 * ON_DEMAND)]
        wait_until(lambda: _running(crowded, "inference") == 2 * ON_DEMAND, what="every request in")
        crowded.resume.touch()
        answers = [request.result() for request in requests]
    assert all(len(tokens) == 3 for tokens in answers), "every request is answered"
    assert _loads_done(crowded) - before == ON_DEMAND, "each standby adapter loaded once"
    _consistent(crowded)


def test_an_operator_load_finds_every_place_held_or_reserved_and_is_refused_at_once(crowded: Served) -> None:
    for i in range(PLACES):
        crowded.load(f"idle{i}", f"ad{i % 3}")
    crowded.load("waiting", "ad0", standby=True)
    crowded.resume.unlink()
    crowded.paused.unlink(missing_ok=True)
    with ThreadPoolExecutor(2) as pool:
        request = pool.submit(generate, crowded.stub, PROMPT, "waiting", 3)
        # The on-demand load evicted an idle adapter and holds that place while it loads.
        wait_until(crowded.paused.exists, what="the on-demand load to reach the ranks")
        operator = pool.submit(_operator_load, crowded, "latecomer")
        try:
            wait_until(operator.done, what="the operator's load answered while the ranks are paused (not waiting for them)")
        finally:
            crowded.resume.touch()
        assert len(request.result()) == 3, "the first request is answered"
        refused = operator.result()
    assert not refused.success and "max_loaded_loras (4) reached" in refused.error_message, refused.error_message
    listed = crowded.listed()
    assert "latecomer" not in listed and listed["waiting"] == (RESIDENT, (0, 1))
    _consistent(crowded)


def test_places_held_or_reserved_are_counted_and_a_replace_in_place_takes_its_versions_place() -> None:
    registry = Registry()
    held = [entry(registry, f"held{i}") for i in range(2)]
    for version in held:
        registry.publish(version)
    reserved = registry.reserve_place(3)
    assert reserved is not None and registry.reserve_place(3) is None, "two held and one reserved: full"
    evicted = registry.to_standby(held[0])
    assert evicted is not None and registry.reserve_place(3) is None, "the evicted version's place is its evictor's"
    registry.release_place(reserved)
    again = registry.reserve_place(3)
    assert again is not None, "a released place is free again"
    registry.publish(entry(registry, "loaded"), evicted)  # the evictor's load took the place it made
    assert registry.reserve_place(3) is None
    # A backend that replaces in place (vLLM's servers): the new version of held1 needs no place.
    in_place = registry.reserve_place(3, in_place_of=held[1])
    assert in_place is not None and not in_place.open
    registry.release_place(again)
    assert registry.reserve_place(3) is not None
