"""Standby adapters and their load on first request, on real agents (tp=2, real rank processes,
two adapter places) behind a real gRPC server on loopback: the registry lists them standby, the
first request loads them, concurrent first requests share one load, a full agent evicts the
least recently used idle unpinned adapter (never a pinned one, never one serving a request),
a request that cannot be served within the on-demand deadline is refused naming it, and a
standby load of a resident adapter puts it back on standby in place (listed throughout, its
requests answered): at once when it is idle, else once its requests end, the load answering
without waiting for them (a batch's later loads neither), a resident load or an unload of it
meanwhile cancelling that.

Loads on the ranks can be held at their start (the tests' `FaultPlan`: rank 0 waits while the
resume file is missing), so a test knows the requests overlap one load."""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from node_agent.agent import Agent, AgentConfig
from node_agent.engine import EngineConfig, FaultPlan, Topology
from node_agent.residency import OnDemandSettings
from node_agent.server import AgentServer, ServerOptions, create_server
from node_agent.sources import SourcePolicy
from node_agent.values import GenerateParams
from tests.agent.helpers import Polled, forward, generate, make_adapter, make_model, rpc_error, start_agent, wait_until

PLACES = 2  # --max-loaded-loras: adapters the ranks hold at once
PROMPT = [5, 6, 7, 8]
LONG = 100_000  # tokens of a stream that runs until the test cancels it
STANDBY, RESIDENT = pb.ADAPTER_RESIDENCY_STANDBY, pb.ADAPTER_RESIDENCY_RESIDENT


@dataclass
class Served:
    agent: Agent
    server: AgentServer
    stub: agent_pb2_grpc.NodeAgentStub
    root: Path
    resume: Path  # while missing, every load on the ranks waits at its start
    paused: Path  # exists once rank 0 has paused at the start of a load (delete it to see the next)

    def load(self, name: str, adapter: str, **fields: bool) -> pb.LoadAdapterResponse:
        reply = self.stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source_uri=(self.root / adapter).as_uri(), **fields), timeout=60)
        assert reply.success, reply.error_message
        return reply

    def listed(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """name -> (residency, ranks) as ListAdapters says."""
        return {a.name: (a.residency, tuple(a.ranks)) for a in self.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters}

    def held_by_ranks(self) -> dict[int, set[str]]:
        """What each rank holds, in public names, as the ranks say."""
        return {h.rank: {self.agent.adapter_name(n) for n in h.holds} for h in self.agent.engine.holdings()}


def serve(base: Path, deadline_s: float, places: int = PLACES, max_concurrent: int = 1, drain_timeout_s: float = 30.0) -> Iterator[Served]:
    """An agent with `places` adapter places and up to `max_concurrent` on-demand loads at once."""
    model = make_model(base / "model")
    root = base / "adapters"
    for i in range(4):
        make_adapter(root / f"ad{i}", seed=400 + i)
    resume = base / "resume"
    resume.touch()
    engine_config = EngineConfig(model_dir=model, topology=Topology(2, 1), max_loras_per_batch=places, max_loaded_loras=places)
    config = AgentConfig(
        sources=SourcePolicy(adapter_roots=(root,)),
        on_demand=OnDemandSettings(max_concurrent=max_concurrent, deadline_s=deadline_s),
        # long enough that a stream still runs when a request for another adapter gives up
        max_new_tokens=LONG,
        max_request_tokens=2 * LONG,
        drain_timeout_s=drain_timeout_s,
    )
    markers = base / "markers"
    markers.mkdir()
    agent, _ = start_agent(engine_config, config, FaultPlan(pause_load_on_rank=0, resume_file=resume, markers_dir=markers))
    server = create_server(agent, ServerOptions(listen="127.0.0.1:0", metrics_port=0))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Served(agent, server, agent_pb2_grpc.NodeAgentStub(channel), root, resume, markers / "rank0-paused")
    finally:
        resume.touch()
        channel.close()
        server.stop(grace=0)
        agent.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    """An agent whose drain timeout is an hour: no load call may wait for a request to end (one
    that did would miss its 60-s deadline)."""
    yield from serve(tmp_path_factory.mktemp("standby"), deadline_s=120.0, drain_timeout_s=3600.0)


@pytest.fixture(scope="module")
def impatient(tmp_path_factory) -> Iterator[Served]:
    """An agent whose on-demand loads give up after 2 s, and whose drains too."""
    yield from serve(tmp_path_factory.mktemp("impatient"), deadline_s=2.0, drain_timeout_s=2.0)


def _emptied(agent: Served) -> None:
    agent.resume.touch()
    for entry in agent.agent.registry.entries():
        agent.agent.unload(entry.name)


@pytest.fixture(autouse=True)
def empty_agents(request) -> Iterator[None]:
    yield
    for name in ("served", "impatient"):
        if name in request.fixturenames:
            _emptied(request.getfixturevalue(name))


def test_a_standby_adapter_is_listed_and_its_first_request_loads_it(served: Served) -> None:
    served.load("reference", "ad0")
    expected = generate(served.stub, PROMPT, "reference", 6)
    served.agent.unload("reference")
    assert served.load("sb", "ad0", standby=True).residency == STANDBY, "the reply says where the load left it"
    assert served.listed() == {"sb": (STANDBY, ())}
    assert served.held_by_ranks() == {0: set(), 1: set()}, "no rank holds a standby adapter"
    assert generate(served.stub, PROMPT, "sb", 6) == expected, "the first request is answered, with the adapter's tokens"
    assert served.listed() == {"sb": (RESIDENT, (0, 1))}
    assert served.held_by_ranks() == {0: {"sb"}, 1: {"sb"}}


def test_the_first_forward_naming_a_standby_adapter_loads_it(served: Served) -> None:
    served.load("reference", "ad3")
    expected = forward(served.stub, (PROMPT, "reference"))[0]
    served.agent.unload("reference")
    served.load("sb-forward", "ad3", standby=True)
    np.testing.assert_array_equal(forward(served.stub, (PROMPT, "sb-forward"))[0], expected)
    assert served.listed() == {"sb-forward": (RESIDENT, (0, 1))}


def test_eight_concurrent_first_requests_wait_on_one_load(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="node_agent.residency")
    served.load("burst", "ad1", standby=True)
    served.resume.unlink()  # the load, once started, waits at its start on rank 0
    running = {"budget": "inference"}
    with ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(generate, served.stub, PROMPT, "burst", 5) for _ in range(8)]
        wait_until(lambda: served.agent.metrics.registry.get_sample_value("lorafleet_agent_calls_running", running) == 8, what="8 requests")
        assert served.agent.registry.get("burst").standby, "premise: the load has not completed while they all wait"
        served.resume.touch()
        tokens = [answer.result() for answer in answers]
    assert len(tokens) == 8 and all(t == tokens[0] and len(t) == 5 for t in tokens), "every request answered, alike"
    loads = [r for r in caplog.records if r.getMessage().startswith("adapter burst loaded on first request")]
    assert len(loads) == 1, "one load for all eight"


def test_a_full_agent_evicts_the_least_recently_used_idle_unpinned_adapter(served: Served) -> None:
    served.load("pinned", "ad0", pinned=True)
    served.load("a", "ad1", standby=True)
    served.load("b", "ad2", standby=True)
    generate(served.stub, PROMPT, "a", 2)  # a resident: both places taken (pinned, a)
    assert served.listed() == {"pinned": (RESIDENT, (0, 1)), "a": (RESIDENT, (0, 1)), "b": (STANDBY, ())}
    generate(served.stub, PROMPT, "b", 2)  # full: a is evicted, never the pinned one
    assert served.listed() == {"pinned": (RESIDENT, (0, 1)), "a": (STANDBY, ()), "b": (RESIDENT, (0, 1))}
    assert served.held_by_ranks() == {0: {"pinned", "b"}, 1: {"pinned", "b"}}
    generate(served.stub, PROMPT, "a", 2)  # and back: the evicted adapter's snapshot was kept
    assert served.listed() == {"pinned": (RESIDENT, (0, 1)), "a": (RESIDENT, (0, 1)), "b": (STANDBY, ())}
    assert served.held_by_ranks() == {0: {"pinned", "a"}, 1: {"pinned", "a"}}


def test_the_least_recently_used_one_goes_first(served: Served) -> None:
    for name, adapter in (("x", "ad1"), ("y", "ad2"), ("z", "ad3")):
        served.load(name, adapter, standby=True)
    generate(served.stub, PROMPT, "x", 2)
    generate(served.stub, PROMPT, "y", 2)
    generate(served.stub, PROMPT, "x", 2)  # y is now the least recently used
    generate(served.stub, PROMPT, "z", 2)
    assert served.listed() == {"x": (RESIDENT, (0, 1)), "y": (STANDBY, ()), "z": (RESIDENT, (0, 1))}


def test_a_load_that_misses_the_deadline_is_refused_naming_it(impatient: Served) -> None:
    impatient.load("slow", "ad0", standby=True)
    impatient.resume.unlink()
    error = rpc_error(lambda: generate(impatient.stub, PROMPT, "slow", 2))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "2-s deadline (--adapter-load-deadline-s)" in error.details()
    impatient.resume.touch()
    wait_until(lambda: impatient.listed() == {"slow": (RESIDENT, (0, 1))}, what="the load to complete")


def test_no_evictable_adapter_is_refused_after_the_deadline(impatient: Served) -> None:
    impatient.load("pinned", "ad0", pinned=True)
    impatient.load("busy", "ad1")
    impatient.load("waiting", "ad2", standby=True)
    stream = impatient.stub.Generate(pb.GenerateRequest(token_ids=PROMPT, adapter="busy", max_new_tokens=LONG), timeout=120)
    next(stream)  # busy serves a request: it cannot be evicted
    try:
        error = rpc_error(lambda: generate(impatient.stub, PROMPT, "waiting", 2))
    finally:
        stream.cancel()
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "none could be evicted" in error.details() and "--adapter-load-deadline-s" in error.details()
    assert impatient.listed() == {"pinned": (RESIDENT, (0, 1)), "busy": (RESIDENT, (0, 1)), "waiting": (STANDBY, ())}


def test_a_standby_load_cannot_be_pinned(served: Served) -> None:
    error = rpc_error(lambda: served.load("both", "ad0", standby=True, pinned=True))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "cannot be pinned" in error.details()


def in_flight(served: Served, adapter: str, tokens: int) -> Generator[int, None, None]:
    """A Generate of the agent itself, started: its first token taken, its lease held until the
    rest is read or the generator closed (the engine runs it meanwhile)."""
    stream = (
        token.token_id for token in served.agent.generate(GenerateParams(token_ids=tuple(PROMPT), adapter=adapter, max_new_tokens=tokens))
    )
    first = next(stream)
    return (token for part in ([first], stream) for token in part)


def leases(served: Served, name: str) -> int:
    """Requests leasing the current version of `name` now."""
    return served.agent.registry.in_flight(served.agent.registry.get(name).engine_name)


def put_back_while_busy(served: Served, name: str, adapter: str) -> None:
    """Load `name` resident, ask for it on standby while a request leases it, end the request,
    and wait until it is on standby (by then the demotion worker has looked at every pending
    demotion since that request ended)."""
    served.load(name, adapter)
    flight = in_flight(served, name, 2)
    try:
        served.load(name, adapter, standby=True)
        assert leases(served, name) == 1, "premise: the standby load answered while the request runs"
        list(flight)
    finally:
        flight.close()
    wait_until(lambda: served.listed().get(name) == (STANDBY, ()), what=f"{name} on standby once its request ended")


def test_a_busy_adapters_standby_load_answers_at_once_and_puts_it_on_standby_once_idle(served: Served) -> None:
    """The operator's scale-down: a standby load of a resident adapter's content. A request in
    flight leases it, so the load answers at once, resident (it never waits for the request: the
    agent's drain timeout is an hour here, and a call that waited would miss its 60-s deadline);
    requests meanwhile are answered by the resident version, and once the one in flight ends
    the adapter goes on standby by itself, its place freed. It is listed in every ListAdapters
    throughout, and the next request loads it again."""
    served.load("demoted", "ad1")
    expected = generate(served.stub, PROMPT, "demoted", 6)
    flight = in_flight(served, "demoted", 6)
    with Polled(lambda: served.listed().get("demoted", ("absent",))[0]) as listings:
        try:
            reply = served.load("demoted", "ad1", standby=True)
            assert leases(served, "demoted") == 1, "the load answered while the request was in flight"
            assert "demoted" in reply.loaded_adapters, "it answers what the ranks hold: resident"
            assert reply.residency == RESIDENT, "and says so, for the operator's status"
            assert served.listed()["demoted"] == (RESIDENT, (0, 1))
            assert generate(served.stub, PROMPT, "demoted", 6) == expected, "a request while the demotion is pending is answered"
            assert list(flight) == expected, "the request in flight finishes normally"
        finally:
            flight.close()
        wait_until(lambda: served.listed() == {"demoted": (STANDBY, ())}, what="the adapter on standby once its request ended")
    assert served.held_by_ranks() == {0: set(), 1: set()}, "its place is freed"
    assert "absent" not in listings.results, "listed in every ListAdapters"
    assert listings.results[0] == RESIDENT and listings.results[-1] == STANDBY
    assert generate(served.stub, PROMPT, "demoted", 6) == expected, "the next request loads it again"
    assert served.listed() == {"demoted": (RESIDENT, (0, 1))}


def test_a_busy_adapters_demotion_does_not_hold_up_the_rest_of_a_load_batch(served: Served) -> None:
    """LoadAdapters runs its loads one after another: a busy adapter's standby load first never
    makes the next load wait for that adapter's request."""
    served.load("first", "ad1")
    flight = in_flight(served, "first", 4)
    try:
        reply = served.stub.LoadAdapters(
            pb.LoadAdaptersRequest(
                loads=[
                    pb.LoadAdapterRequest(name="first", source_uri=(served.root / "ad1").as_uri(), standby=True),
                    pb.LoadAdapterRequest(name="second", source_uri=(served.root / "ad2").as_uri()),
                ]
            ),
            timeout=60,
        )
        assert [outcome.reply.success for outcome in reply.outcomes] == [True, True]
        assert [outcome.reply.residency for outcome in reply.outcomes] == [RESIDENT, RESIDENT], "each load says where it left its adapter"
        assert leases(served, "first") == 1, "the batch completed while the first adapter was still busy"
        assert served.listed() == {"first": (RESIDENT, (0, 1)), "second": (RESIDENT, (0, 1))}
        list(flight)
    finally:
        flight.close()
    wait_until(lambda: served.listed()["first"] == (STANDBY, ()), what="the first adapter on standby once its request ended")
    assert served.held_by_ranks() == {0: {"second"}, 1: {"second"}}


def test_a_resident_load_during_a_pending_demotion_cancels_it(served: Served) -> None:
    """A plain LoadAdapter (resident) after a standby one whose demotion still waits for a
    request wins: the adapter stays resident after the request ends. Both loads promise the
    digest, as the operator's do (no fetch: the very version the demotion waits for stays
    routable)."""
    served.load("kept", "ad1")
    digest = served.agent.registry.get("kept").source.content.weights_sha256
    flight = in_flight(served, "kept", 4)

    def load(standby: bool) -> pb.LoadAdapterResponse:
        request = pb.LoadAdapterRequest(name="kept", source_uri=(served.root / "ad1").as_uri(), sha256=digest, standby=standby)
        return served.stub.LoadAdapter(request, timeout=60)

    try:
        assert load(standby=True).success
        assert leases(served, "kept") == 1, "premise: the demotion is pending"
        reply = load(standby=False)
        assert reply.success and "kept" in reply.loaded_adapters
        list(flight)
    finally:
        flight.close()
    assert leases(served, "kept") == 0, "premise: its request has ended"
    put_back_while_busy(served, "witness", "ad2")  # the worker has looked at every pending demotion since
    assert served.listed() == {"kept": (RESIDENT, (0, 1)), "witness": (STANDBY, ())}
    assert served.held_by_ranks() == {0: {"kept"}, 1: {"kept"}}


def test_an_unload_during_a_pending_demotion_unloads_cleanly(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    """An UnloadAdapter while a demotion waits for the adapter's request drains and unloads it as
    usual; the pending demotion is dropped and never touches the name's next version."""
    served.load("gone", "ad1")
    flight = in_flight(served, "gone", 4)
    with ThreadPoolExecutor(1) as pool:
        try:
            served.load("gone", "ad1", standby=True)
            assert leases(served, "gone") == 1, "premise: the demotion is pending"
            unloading = pool.submit(served.stub.UnloadAdapter, pb.UnloadAdapterRequest(name="gone"), timeout=60)
            wait_until(lambda: "gone" not in served.listed(), what="the unload to stop routing it")
            list(flight)
        finally:
            flight.close()
        assert unloading.result().success
    assert served.listed() == {}
    assert served.held_by_ranks() == {0: set(), 1: set()}
    served.load("gone", "ad1")  # its next version, resident
    put_back_while_busy(served, "witness", "ad2")
    assert served.listed() == {"gone": (RESIDENT, (0, 1)), "witness": (STANDBY, ())}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "nothing failed"


def test_a_pending_demotion_outlasts_the_drain_timeout(impatient: Served) -> None:
    """A demotion has no deadline: an adapter still busy after the drain timeout (2 s here) goes
    on standby once its request ends, without being asked again."""
    impatient.load("busy", "ad1")
    expected = generate(impatient.stub, PROMPT, "busy", 4)
    flight = in_flight(impatient, "busy", 4)
    try:
        reply = impatient.load("busy", "ad1", standby=True)
        assert "busy" in reply.loaded_adapters and all(rank.success for rank in reply.rank_results)
        impatient.load("slow", "ad0", standby=True)
        impatient.resume.unlink()
        error = rpc_error(lambda: generate(impatient.stub, PROMPT, "slow", 2))
        assert "2-s deadline" in error.details(), "premise: 2 s (the drain timeout) have passed since the standby load"
        impatient.resume.touch()
        assert impatient.listed()["busy"] == (RESIDENT, (0, 1))
        assert list(flight) == expected, "the request finishes normally"
    finally:
        flight.close()
    wait_until(lambda: impatient.listed().get("busy") == (STANDBY, ()), what="the adapter on standby once its request ended")


def test_a_standby_load_never_puts_a_pinned_adapter_on_standby(served: Served) -> None:
    """Pinning keeps an adapter resident: a standby load (never pinned) of a pinned adapter's
    content is a pinning conflict, and the adapter stays as it was."""
    served.load("kept", "ad0", pinned=True)
    error = rpc_error(lambda: served.load("kept", "ad0", standby=True))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "pinned=True" in error.details()
    assert served.listed() == {"kept": (RESIDENT, (0, 1))}
