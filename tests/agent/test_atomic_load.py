"""Atomic loads on an agent whose rank 2 (of tp=4, dp=2) refuses every load (test fault hook).

The model directory has no tokenizer, so this agent also shows Generate on token ids only.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from node_agent.agent import Agent, AgentConfig
from node_agent.engine import EngineConfig, FaultPlan, Topology
from node_agent.server import ServerOptions, create_server
from node_agent.sources import SourcePolicy
from tests.agent.helpers import forward, generate, make_adapter, make_model, rpc_error, start_agent

FAILING_RANK = 2


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> Iterator[tuple[Agent, agent_pb2_grpc.NodeAgentStub, object]]:
    base = tmp_path_factory.mktemp("faulty")
    model = make_model(base / "model", tokenizer=False)
    adapter = make_adapter(base / "adapters" / "ad", seed=5)
    engine_config = EngineConfig(model_dir=model, topology=Topology(4, 2))
    agent, _ = start_agent(
        engine_config, AgentConfig(sources=SourcePolicy(adapter_roots=(base / "adapters",))), FaultPlan(fail_load_on_rank=FAILING_RANK)
    )
    server = create_server(agent, ServerOptions())
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield agent, agent_pb2_grpc.NodeAgentStub(channel), adapter
    finally:
        channel.close()
        server.stop(grace=0)
        agent.close()


def test_a_load_failing_on_one_rank_leaves_no_rank_holding_it(faulty):
    agent, stub, adapter = faulty
    reply = stub.LoadAdapter(pb.LoadAdapterRequest(name="atomic", source_uri=adapter.as_uri()), timeout=120)
    assert not reply.success
    assert reply.error_message == f"injected load failure on rank {FAILING_RANK}"
    assert list(reply.loaded_adapters) == []
    results = [(r.rank, r.attn_dp_rank, r.attn_tp_rank, r.success) for r in reply.rank_results]
    assert results == [(0, 0, 0, False), (1, 0, 1, False), (2, 1, 0, False), (3, 1, 1, False)]
    for result in reply.rank_results:
        expected = "injected load failure" if result.rank == FAILING_RANK else "rolled back because the load failed on rank 2"
        assert expected in result.error_message
    # Ask the ranks themselves, not the registry: none holds anything.
    assert [r.holds for r in agent.engine.holdings()] == [(), (), (), ()]
    assert not stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters
    for call in (lambda: forward(stub, ([1, 2, 3], "atomic")), lambda: generate(stub, [1, 2, 3], "atomic")):
        assert rpc_error(call).code() == grpc.StatusCode.NOT_FOUND
    assert forward(stub, ([1, 2, 3], ""))[0].shape == (3, 256), "the engine still serves"


def test_without_a_tokenizer_generate_takes_token_ids_only(faulty):
    _, stub, _ = faulty
    assert not stub.Describe(pb.DescribeRequest(), timeout=30).has_tokenizer
    replies = list(stub.Generate(pb.GenerateRequest(token_ids=[1, 2, 3], max_new_tokens=3), timeout=60))
    assert len(replies) == 3 and all(r.text == "" for r in replies)
    error = rpc_error(lambda: list(stub.Generate(pb.GenerateRequest(prompt="hello"), timeout=30)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "no tokenizer" in error.details()
