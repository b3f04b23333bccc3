"""AdapterStats on a real agent (tp=1, two sequences per step, real rank process) behind a real
gRPC server on loopback: two adapters' concurrent traffic counted per adapter (tokens, times to
first token), requests running and waiting as the scheduler holds them, and the operator's
client reading the same values."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from lorafleet_operator.agent_client import AgentClients
from lorafleet_operator.agent_values import Credentials
from lorafleet_operator.config import Settings
from node_agent.agent import Agent, AgentConfig
from node_agent.engine import Engine, EngineConfig, Topology
from node_agent.server import AgentServer, ServerOptions, create_server
from node_agent.sources import SourcePolicy
from tests.agent.helpers import generate, make_adapter, make_model, start_agent, wait_until

RUNNING_AT_ONCE = 2  # --max-num-seqs: the third request waits


@dataclass
class Served:
    agent: Agent
    engine: Engine
    server: AgentServer
    stub: agent_pb2_grpc.NodeAgentStub


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("stats")
    model = make_model(base / "model")
    root = base / "adapters"
    for name, seed in (("hot", 1), ("cold", 2)):
        make_adapter(root / name, seed=seed)
    engine_config = EngineConfig(model_dir=model, topology=Topology(1, 1), max_loras_per_batch=2, max_num_seqs=RUNNING_AT_ONCE)
    agent, engine = start_agent(engine_config, AgentConfig(sources=SourcePolicy(adapter_roots=(root,))))
    server = create_server(agent, ServerOptions(listen="127.0.0.1:0"))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = agent_pb2_grpc.NodeAgentStub(channel)
    for name in ("hot", "cold"):
        assert stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source_uri=(root / name).as_uri()), timeout=60).success
    try:
        yield Served(agent, engine, server, stub)
    finally:
        channel.close()
        server.stop(grace=0)
        agent.close()


def by_adapter(reply: pb.AdapterStatsResponse) -> dict[str, pb.AdapterStat]:
    return {stat.adapter: stat for stat in reply.adapters}


def test_concurrent_traffic_of_two_adapters_is_counted_per_adapter(served: Served) -> None:
    calls = [([1, 2, 3], "hot", 6)] * 3 + [([4, 5], "cold", 9)] * 2 + [([7], "", 4)]
    before = time.time()
    with ThreadPoolExecutor(len(calls)) as pool:
        answers = list(pool.map(lambda call: generate(served.stub, *call), calls))
    reply = served.stub.AdapterStats(pb.AdapterStatsRequest(), timeout=30)
    assert before <= reply.taken_at_unix_s <= time.time()
    stats = by_adapter(reply)
    assert list(stats) == ["hot", "cold", ""], "every held adapter in load order, then the base model"
    for adapter, requests in (("hot", 3), ("cold", 2), ("", 1)):
        sent = sum(len(tokens) for (_, name, _), tokens in zip(calls, answers, strict=True) if name == adapter)
        stat = stats[adapter]
        assert (stat.running, stat.waiting) == (0, 0), "every request has ended"
        assert stat.generated_tokens == sent
        assert stat.tokens_per_s == pytest.approx(sent / reply.window_s)
        assert stat.ttft_count == requests
        assert stat.ttft_p50_s > 0 and stat.ttft_mean_s > 0


def test_running_and_waiting_requests_per_adapter(served: Served) -> None:
    """Two streams run (one per adapter); three more wait for a place: the counts say which."""

    def stream(adapter: str) -> Iterator[pb.GenerateResponse]:
        return served.stub.Generate(pb.GenerateRequest(token_ids=[3, 4], adapter=adapter, max_new_tokens=1000), timeout=120)

    first = [stream("hot"), stream("cold")]
    for running in first:
        next(running)
    queued = [stream("hot"), stream("hot"), stream("cold")]
    try:
        wait_until(lambda: served.engine.serving_stats().waiting == 3, what="three requests to wait")
        stats = by_adapter(served.stub.AdapterStats(pb.AdapterStatsRequest(), timeout=30))
        assert {name: (s.running, s.waiting) for name, s in stats.items()} == {"hot": (1, 2), "cold": (1, 1), "": (0, 0)}
    finally:
        for call in first + queued:
            call.cancel()
    wait_until(lambda: not served.engine.adapter_requests(), what="the cancelled requests to end")


def test_the_operator_client_reads_the_same_stats(served: Served) -> None:
    generate(served.stub, [9, 9, 9], "cold", 5)

    async def read():
        clients = AgentClients(Settings())
        try:
            return await clients.adapter_stats(f"127.0.0.1:{served.server.port}", Credentials())
        finally:
            await clients.close()

    demand = asyncio.run(read())
    reply = served.stub.AdapterStats(pb.AdapterStatsRequest(), timeout=30)
    assert list(demand.adapters) == ["hot", "cold", ""]
    assert demand.window_s == reply.window_s
    for name, stat in by_adapter(reply).items():
        seen = demand.adapters[name]
        assert (seen.generated_tokens, seen.ttft_count, seen.running, seen.waiting) == (
            stat.generated_tokens,
            stat.ttft_count,
            stat.running,
            stat.waiting,
        )
    assert demand.adapters["cold"].generated_tokens >= 5
