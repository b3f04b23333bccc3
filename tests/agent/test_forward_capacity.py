"""A Forward's size against the engine's waiting queue, through real agents over real gRPC.

A batch within the request-token limit is served whatever its number of sequences: it is one
request to the engine's waiting queue (`max_waiting`), and the scheduler admits its sequences in
waves. A Forward that finds the waiting queue full is refused whole, before anything is queued,
with RESOURCE_EXHAUSTED naming the limit (never INTERNAL).
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from node_agent.agent import AgentConfig
from node_agent.engine import EngineConfig, SamplingParams, Topology
from node_agent.server import ServerOptions, create_server
from node_agent.sources import SourcePolicy
from tests.agent.helpers import forward, logits, make_adapter, make_model, rpc_error, start_agent

SEQUENCES = 4000  # 16,000 tokens: under the agent's 16,384 per request, above the engine's 1,024 waiting requests


def _tokens(index: int) -> list[int]:
    return [1 + index % 250, 1 + index // 250, 7, 9]


def test_4000_sequences_in_one_forward_are_served_in_waves(shared):
    assert shared.agent.config.max_request_tokens >= SEQUENCES * 4
    assert shared.engine.config.max_waiting < SEQUENCES, "premise: more sequences than the engine's waiting queue"
    # 16 MB of logits: more than gRPC's default 4 MB a client receives.
    with grpc.insecure_channel(f"127.0.0.1:{shared.server.port}", options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        request = pb.ForwardRequest(sequences=[pb.Sequence(token_ids=_tokens(index)) for index in range(SEQUENCES)])
        reply = agent_pb2_grpc.NodeAgentStub(channel).Forward(request, timeout=600)
    got = [logits(item) for item in reply.logits]
    assert len(got) == SEQUENCES and all(item.shape == (4, 256) for item in got)
    for index in (0, 1023, 1024, 2999, SEQUENCES - 1):
        np.testing.assert_allclose(got[index], forward(shared.stub, (_tokens(index), ""))[0], rtol=1e-5, atol=1e-5)
    stats = shared.engine.serving_stats()
    assert (stats.waiting, stats.running) == (0, 0)


@pytest.fixture(scope="module")
def small_queue(tmp_path_factory):
    """A tp=1 agent whose engine lets 2 requests wait and has one LoRA slot."""
    base = tmp_path_factory.mktemp("capacity")
    model = make_model(base / "tiny-llama")
    root = base / "adapters"
    make_adapter(root / "pinned", seed=1)
    make_adapter(root / "other", seed=2)
    engine_config = EngineConfig(model_dir=model, topology=Topology(1, 1), max_loras_per_batch=1, max_waiting=2)
    agent, engine = start_agent(engine_config, AgentConfig(agent_id="capacity", sources=SourcePolicy(adapter_roots=(root,))))
    server = create_server(agent, ServerOptions(listen="127.0.0.1:0"))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield agent, engine, root, agent_pb2_grpc.NodeAgentStub(channel)
    finally:
        channel.close()
        server.stop(grace=0)
        agent.close()


def test_a_forward_that_finds_the_waiting_queue_full_is_refused_whole_with_resource_exhausted(small_queue):
    agent, engine, root, stub = small_queue
    assert agent.load("pinned", (root / "pinned").as_uri(), pinned=True).ok
    assert agent.load("other", (root / "other").as_uri()).ok
    other = next(entry.engine_name for entry in agent.registry.entries() if entry.name == "other")
    # The only LoRA slot is pinned: these two wait for one as long as the pin holds, and fill the queue.
    waiting = [engine.submit([1, 2, 3], other, SamplingParams(max_tokens=2)) for _ in range(2)]
    try:
        assert engine.serving_stats().waiting == 2
        for count in (1, 3):
            error = rpc_error(lambda count=count: forward(stub, *[([4, 5, 6], "")] * count))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            assert "2 requests are waiting (max_waiting 2)" in error.details()
            assert dict(error.trailing_metadata())["lorafleet-reason"] == "queue_full"
            assert engine.serving_stats().waiting == 2, "nothing of the refused batch was queued"
    finally:
        for generation in waiting:
            generation.cancel()
    assert [item.shape for item in forward(stub, ([4, 5, 6], ""), ([7], ""))] == [(3, 256), (1, 256)]
