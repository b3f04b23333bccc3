"""Bursts of inference queue instead of failing: a second gRPC server over the shared agent (tp=2,
dp=2, real ranks) with an inference budget of 4 places and a bounded queue.

The test itself holds the budget's places (it takes them as a running call would), so the calls
it sends must queue whatever the machine's speed; giving the places back lets the queue run.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from node_agent.server import AgentServer, CallBudget, ServerOptions, create_server
from tests.agent.helpers import forward, logits, wait_until

PLACES = 4
CALLS = 100


@contextmanager
def _serve(shared, **options) -> Iterator[tuple[AgentServer, agent_pb2_grpc.NodeAgentStub, grpc.Channel]]:
    server = create_server(shared.agent, ServerOptions(listen="127.0.0.1:0", max_inference_calls=PLACES, **options))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, agent_pb2_grpc.NodeAgentStub(channel), channel
    finally:
        channel.close()
        server.stop(grace=0)


@pytest.fixture
def queued(shared):
    with _serve(shared, max_queued_inference_calls=CALLS) as served:
        yield served


@pytest.fixture
def short_queue(shared):
    with _serve(shared, max_queued_inference_calls=10) as served:
        yield served


def _hold(budget: CallBudget) -> None:
    for _ in range(PLACES):
        budget.acquire()


def _give_back(budget: CallBudget) -> None:
    for _ in range(PLACES):
        budget.release()


def _tokens(index: int) -> list[int]:
    return [1 + index % 200, 2, 3]


def _forwards(pool: ThreadPoolExecutor, stub, count: int, timeout: float = 300) -> list[Future]:
    def call(index: int) -> np.ndarray:
        request = pb.ForwardRequest(sequences=[pb.Sequence(token_ids=_tokens(index))])
        return logits(stub.Forward(request, timeout=timeout).logits[0])

    return [pool.submit(call, index) for index in range(count)]


def _failures(shared, reason: str) -> float:
    return shared.agent.metrics.registry.get_sample_value("lorafleet_agent_failures_total", {"operation": "forward", "reason": reason}) or 0


def _forward_calls(shared) -> float:
    """Forward calls the agent ran (every outcome): a call refused while queued never counts."""
    samples = shared.agent.metrics.requests.collect()[0].samples
    return sum(s.value for s in samples if s.name.endswith("_total") and s.labels["method"] == "forward")


def _health_serving(channel: grpc.Channel) -> bool:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="lorafleet.v1.NodeAgent"), timeout=30)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_100_concurrent_forwards_over_4_places_all_succeed_through_the_queue(shared, queued):
    server, stub, channel = queued
    budget = server.servicer.budgets["inference"]
    want = forward(shared.stub, *((_tokens(index), "") for index in range(CALLS)))
    metrics = shared.agent.metrics.registry
    _hold(budget)
    with ThreadPoolExecutor(CALLS) as pool:
        try:
            calls = _forwards(pool, stub, CALLS)
            wait_until(lambda: budget.waiting == CALLS, what="every Forward to queue")
            assert metrics.get_sample_value("lorafleet_agent_calls_waiting", {"budget": "inference"}) == CALLS
            assert _health_serving(channel), "health answers while the queue is full"
            assert not any(call.done() for call in calls)
        finally:
            _give_back(budget)
        for index, call in enumerate(calls):
            np.testing.assert_allclose(call.result(), want[index], rtol=1e-5, atol=1e-5)
    assert (budget.running, budget.waiting) == (0, 0)
    assert metrics.get_sample_value("lorafleet_agent_calls_waiting", {"budget": "inference"}) == 0


def test_beyond_the_queue_exactly_the_excess_is_refused_naming_the_flag(shared, short_queue):
    server, stub, channel = short_queue
    budget = server.servicer.budgets["inference"]
    refused_before = _failures(shared, "too_many_calls")
    _hold(budget)
    with ThreadPoolExecutor(CALLS) as pool:
        try:
            calls = _forwards(pool, stub, CALLS)
            wait_until(lambda: sum(call.done() for call in calls) == CALLS - 10, what="the excess to be refused")
            assert budget.waiting == 10
            for call in (call for call in calls if call.done()):
                error = call.exception()
                assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
                assert "10 waiting, the queue's limit is 10 (--max-queued-inference-calls)" in error.details()
                assert "the limit is 4 (--max-inference-calls)" in error.details()
            assert _health_serving(channel)
        finally:
            _give_back(budget)
        waited = [call for call in calls if call.exception() is None]
        assert len(waited) == 10 and all(call.result().shape == (3, 256) for call in waited)
    assert _failures(shared, "too_many_calls") - refused_before == CALLS - 10


def test_a_queued_call_whose_deadline_passes_is_refused_and_never_runs(shared, queued):
    server, stub, _channel = queued
    budget = server.servicer.budgets["inference"]
    ran_before = _forward_calls(shared)
    late_before = _failures(shared, "deadline_exceeded")
    _hold(budget)
    try:
        with ThreadPoolExecutor(1) as pool:
            (call,) = _forwards(pool, stub, 1, timeout=1)
            error = call.exception()
        assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
        wait_until(lambda: budget.waiting == 0, what="the late call to leave the queue")
        wait_until(lambda: _failures(shared, "deadline_exceeded") == late_before + 1, what="the refusal to be counted")
    finally:
        _give_back(budget)
    assert _forward_calls(shared) == ran_before, "the late call never reached the agent"
    assert budget.running == 0


def test_a_queued_call_is_refused_after_the_queues_wait_naming_its_flag(shared):
    with _serve(shared, inference_queue_wait_s=0.2) as (server, stub, _channel):
        budget = server.servicer.budgets["inference"]
        _hold(budget)
        try:
            with pytest.raises(grpc.RpcError) as refused:
                forward(stub, ([1, 2, 3], ""))
        finally:
            _give_back(budget)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "within 0.2 s (--inference-queue-wait-s)" in refused.value.details()
        assert dict(refused.value.trailing_metadata())["lorafleet-reason"] == "queue_timeout"
        assert forward(stub, ([1, 2, 3], ""))[0].shape == (3, 256), "a place is free again"
