"""A rank that stalls during a load (test fault hook): health reports the hung engine, and bytes
changed under a stalled rank are caught by each rank's check of the verified files (refused,
rolled back).

The agent (tp=2, dp=2) has rank 1 sleep STALL_S at the start of every load, before it reads any
adapter byte, and an engine hang timeout of HANG_S. A second, single-rank agent shows Describe
answering while the server shuts down and no snapshot left behind by a load that failed oddly.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from node_agent.agent import Agent, AgentConfig
from node_agent.engine import EngineConfig, FaultPlan, Topology
from node_agent.server import AgentServer, ServerOptions, create_server
from node_agent.sources import ADAPTER_WEIGHTS, SourcePolicy
from tests.agent.helpers import LOOPBACK_SOURCES, forward, http_server, make_adapter, make_model, rpc_error, start_agent, wait_until

STALLING_RANK = 1
STALL_S = 4.0
HANG_S = 1.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Stalling:
    agent: Agent
    server: AgentServer
    channel: grpc.Channel
    stub: agent_pb2_grpc.NodeAgentStub
    cache: Path
    adapters: dict[str, Path]


@pytest.fixture(scope="module")
def stalling(tmp_path_factory) -> Iterator[Stalling]:
    base = tmp_path_factory.mktemp("stalling")
    model = make_model(base / "model", tokenizer=False)
    adapters = {name: make_adapter(base / "adapters" / name, seed=seed) for name, seed in (("one", 11), ("two", 12))}
    engine_config = EngineConfig(model_dir=model, topology=Topology(2, 2))
    cache = base / "cache"
    config = AgentConfig(sources=SourcePolicy(adapter_roots=(base / "adapters",), cache_dir=cache), engine_hang_timeout_s=HANG_S)
    agent, _ = start_agent(engine_config, config, FaultPlan(stall_load_on_rank=STALLING_RANK, stall_load_s=STALL_S))
    server = create_server(agent, ServerOptions())
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Stalling(agent, server, channel, agent_pb2_grpc.NodeAgentStub(channel), cache, adapters)
    finally:
        channel.close()
        server.stop(grace=0)
        agent.close()


def health(channel: grpc.Channel) -> int:
    request = health_pb2.HealthCheckRequest(service="lorafleet.v1.NodeAgent")
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=1).status


def test_a_hung_engine_turns_health_not_serving_until_the_command_completes(stalling, caplog):
    caplog.set_level(logging.WARNING, logger="node_agent.server")
    assert health(stalling.channel) == SERVING
    request = pb.LoadAdapterRequest(name="one", source_uri=stalling.adapters["one"].as_uri())
    load = stalling.stub.LoadAdapter.future(request, timeout=120)
    wait_until(lambda: health(stalling.channel) == NOT_SERVING, 30, "health NOT_SERVING while rank 1 stalls")
    reason = stalling.server.not_serving_reason
    assert "load of adapter 'one'" in reason and "--engine-hang-timeout-s" in reason, reason
    assert any("engine hangs" in r.getMessage() and "load of adapter 'one'" in r.getMessage() for r in caplog.records)
    assert len(stalling.stub.Describe(pb.DescribeRequest(), timeout=5).ranks) == 2, "Describe answers while the engine hangs"
    reply = load.result(timeout=120)
    assert reply.success, reply.error_message
    wait_until(lambda: health(stalling.channel) == SERVING, 30, "health SERVING once the load completed")
    # Every rank reports the digest of the verified files it read, as ListAdapters says.
    listed = stalling.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters
    assert [a.name for a in listed] == ["one"]
    assert [r.weights_sha256 for r in reply.rank_results] == [listed[0].sha256] * 2
    assert len({r.config_sha256 for r in reply.rank_results}) == 1 and reply.rank_results[0].config_sha256
    assert stalling.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="one"), timeout=60).success


def test_an_adapter_the_engine_cannot_serve_is_refused_while_another_load_holds_the_engine(stalling):
    """Validation runs once, in the caller's thread, before the engine's command lock."""
    dora = make_adapter(stalling.adapters["one"].parent / "dora", seed=13)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    request = pb.LoadAdapterRequest(name="one", source_uri=stalling.adapters["one"].as_uri())
    load = stalling.stub.LoadAdapter.future(request, timeout=120)
    wait_until(lambda: health(stalling.channel) == NOT_SERVING, 30, "rank 1 stalling in the load of 'one'")
    refused = rpc_error(lambda: stalling.stub.LoadAdapter(pb.LoadAdapterRequest(name="dora", source_uri=dora.as_uri()), timeout=60))
    assert not load.done(), "the refusal came while the other load still held the engine"
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "DoRA" in refused.details(), refused.details()
    assert load.result(timeout=120).success
    assert stalling.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="one"), timeout=60).success
    wait_until(lambda: health(stalling.channel) == SERVING, 30, "health SERVING again")


def test_bytes_changed_between_verification_and_a_ranks_read_refuse_the_load(stalling):
    request = pb.LoadAdapterRequest(name="swapped", source_uri=stalling.adapters["one"].as_uri())
    load = stalling.stub.LoadAdapter.future(request, timeout=120)
    # Rank 0 has read the snapshot; rank 1 sleeps before reading it (the engine counts as hung
    # once HANG_S passed). Replace the snapshot's weights with another adapter's, same shapes:
    # rank 1 would load them without complaint; only its check of the verified files tells.
    wait_until(lambda: health(stalling.channel) == NOT_SERVING, 30, "rank 1 stalling in the load")
    (snapshot,) = stalling.cache.glob("snap-*")
    replacement = snapshot / "replacement"
    shutil.copyfile(stalling.adapters["two"] / ADAPTER_WEIGHTS, replacement)
    os.replace(replacement, snapshot / ADAPTER_WEIGHTS)
    reply = load.result(timeout=120)
    assert not reply.success
    assert f"rank {STALLING_RANK} read other bytes than the agent verified" in reply.error_message, reply.error_message
    assert "adapter_model.safetensors is not the file that was verified" in reply.error_message
    assert [(r.rank, r.success) for r in reply.rank_results] == [(0, False), (1, False)]
    assert "rolled back because the load failed on rank 1" in reply.rank_results[0].error_message
    assert list(reply.loaded_adapters) == []
    # Ask the ranks themselves: none holds it; the name does not route; the snapshot is gone.
    assert [r.holds for r in stalling.agent.engine.holdings()] == [(), ()]
    assert not stalling.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters
    assert rpc_error(lambda: forward(stalling.stub, ([1, 2], "swapped"))).code() == grpc.StatusCode.NOT_FOUND
    assert not snapshot.exists()
    failures = stalling.agent.metrics.registry.get_sample_value(
        "lorafleet_agent_failures_total", {"operation": "load", "reason": "digest_mismatch"}
    )
    assert failures == 1
    wait_until(lambda: health(stalling.channel) == SERVING, 30, "health SERVING again")


# -- a single-rank agent: shutdown, and a load that fails in an unexpected way -----------------------


@dataclass
class Solo:
    agent: Agent
    cache: Path
    root: Path


@pytest.fixture(scope="module")
def solo(tmp_path_factory) -> Iterator[Solo]:
    base = tmp_path_factory.mktemp("solo")
    model = make_model(base / "model", tokenizer=False)
    root = base / "adapters"
    make_adapter(root / "ad", seed=21)
    cache = base / "cache"
    agent = Agent.start(
        EngineConfig(model_dir=model, topology=Topology(1, 1)),
        AgentConfig(sources=SourcePolicy(adapter_roots=(root,), cache_dir=cache, download_min_bytes_per_s=0, **LOOPBACK_SOURCES)),
    )
    try:
        yield Solo(agent, cache, root)
    finally:
        agent.close()


def test_describe_answers_while_the_server_stops_and_new_calls_are_refused(solo):
    server = create_server(solo.agent, ServerOptions(stop_grace_s=60))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = agent_pb2_grpc.NodeAgentStub(channel)
    stopper = threading.Thread(target=server.stop)
    try:
        with http_server(solo.root) as http:
            try:
                held = stub.LoadAdapter.future(pb.LoadAdapterRequest(name="held", source_uri=http.url("hold", "ad")), timeout=120)
                wait_until(lambda: http.holding == 1, 30, "a load held by its download")
                stopper.start()
                wait_until(lambda: health(channel) == NOT_SERVING, 30, "health NOT_SERVING while stopping")
                ranks = stub.Describe(pb.DescribeRequest(), timeout=5).ranks
                assert [(r.rank, r.alive) for r in ranks] == [(0, True)]
                for call in (
                    lambda: stub.LoadAdapter(pb.LoadAdapterRequest(name="late", source_uri=http.url("files", "ad")), timeout=30),
                    lambda: forward(stub, ([1, 2], "")),
                ):
                    error = rpc_error(call)
                    assert error.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in error.details(), error.details()
                assert not held.done() and stopper.is_alive(), "the running load keeps its grace"
            finally:
                http.release.set()
            assert held.result(timeout=60).success, "the running load completes within the grace"
            stopper.join(timeout=60)
            assert not stopper.is_alive()
    finally:
        channel.close()
        if not stopper.is_alive():
            server.stop(grace=0)
    solo.agent.unload("held")


def test_a_load_racing_the_engines_close_leaves_no_download_behind(solo):
    """The engine is closed while a load downloads (the agent shutting down under it): the load
    fails, and its download directory is removed like on every other failure path."""
    with http_server(solo.root) as http:
        errors: list[BaseException] = []

        def load() -> None:
            try:
                solo.agent.load("late", http.url("hold", "ad"))
            except BaseException as error:
                errors.append(error)

        loader = threading.Thread(target=load)
        loader.start()
        try:
            wait_until(lambda: http.holding == 1, 30, "the download held")
            assert len(list(solo.cache.glob("dl-*"))) == 1
            solo.agent.engine.close()
        finally:
            http.release.set()
        loader.join(timeout=60)
    assert errors, "the load cannot succeed on a closed engine"
    assert list(solo.cache.glob("dl-*")) == [], f"a download was left behind after {errors[0]!r}"
