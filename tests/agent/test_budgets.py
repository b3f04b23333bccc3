"""Health and inference never queue behind control calls: each class has its own budget; the
inference budget's queue (first come, first served, bounded in length and wait) on its own.

64 loads whose downloads a real loopback HTTP server holds: the downloads bound refuses some,
the control budget others, the rest stay pending; health, Describe, ListAdapters and a Forward
on an already-loaded adapter still answer (the shared tp=2 dp=2 agent, real gRPC on loopback).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet.v1 import agent_pb2 as pb
from node_agent.errors import AgentError, DeadlineExceeded, ShuttingDown, TooManyCalls
from node_agent.server import DEFAULT_MAX_CONTROL_CALLS, INFERENCE_QUEUE_FACTOR, CallBudget, QueueRule, ServerOptions
from tests.agent.helpers import forward, http_server, wait_until

DOWNLOADS = 8  # --max-concurrent-downloads of this test (the default)
NAMES = 2 * DOWNLOADS  # first wave: one load per name; half of them get a download place
QUEUE = QueueRule(3, 60.0, "--max-queued-inference-calls", "--inference-queue-wait-s")


def _sources(shared, monkeypatch, **changes) -> None:
    sources = dataclasses.replace(shared.agent.config.sources, **changes)
    monkeypatch.setattr(shared.agent, "config", dataclasses.replace(shared.agent.config, sources=sources))


def _refusals(futures) -> list[str]:
    """The details of the finished calls; each must be a RESOURCE_EXHAUSTED refusal."""
    details = []
    for future in futures:
        if future.done():
            error = future.exception()
            assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            details.append(error.details())
    return details


def test_health_describe_list_and_forward_answer_while_64_slow_loads_are_pending(shared, stub, monkeypatch):
    assert stub.LoadAdapter(pb.LoadAdapterRequest(name="fast", source_uri=shared.adapters["ad0"].as_uri()), timeout=60).success
    # Held downloads must stay pending for the whole test: no deadline or rate watchdog ends them.
    _sources(shared, monkeypatch, max_concurrent_downloads=DOWNLOADS, download_timeout_s=300, download_min_bytes_per_s=0)
    health = health_pb2_grpc.HealthStub(shared.channel)
    pending: list[grpc.Future] = []
    refused: list[str] = []
    with http_server(shared.root) as http:
        try:
            # Wave 1: a load per name; DOWNLOADS of them hold a download, the others are refused by the bound.
            first = [
                stub.LoadAdapter.future(pb.LoadAdapterRequest(name=f"slow{i}", source_uri=http.url("hold", "ad1")), timeout=300)
                for i in range(NAMES)
            ]
            wait_until(
                lambda: http.holding == DOWNLOADS and sum(f.done() for f in first) == NAMES - DOWNLOADS,
                60,
                "the downloads held and the bound's refusals",
            )
            assert all("--max-concurrent-downloads" in d for d in _refusals(first))
            # Wave 2: more loads of the names being downloaded (whichever wave-1 loads got there
            # first): they wait for their name (holding a control place) until the control budget
            # is used up; beyond it they are refused at once.
            downloading = [f"slow{i}" for i, f in enumerate(first) if not f.done()]
            assert len(downloading) == DOWNLOADS
            waiting = DEFAULT_MAX_CONTROL_CALLS - DOWNLOADS
            second = [
                stub.LoadAdapter.future(
                    pb.LoadAdapterRequest(name=downloading[i % DOWNLOADS], source_uri=http.url("hold", "ad1")), timeout=300
                )
                for i in range(64 - NAMES)
            ]
            wait_until(lambda: sum(f.done() for f in second) == len(second) - waiting, 60, "the control budget's refusals")
            refused = _refusals(second)
            assert all(f"the limit is {DEFAULT_MAX_CONTROL_CALLS} (--max-control-calls)" in d for d in refused), refused[:3]
            pending = [f for f in (*first, *second) if not f.done()]
            assert len(pending) == DEFAULT_MAX_CONTROL_CALLS and http.holding == DOWNLOADS

            # The acceptance criterion: health answers within its 1-s gRPC deadline.
            for service in ("", "lorafleet.v1.NodeAgent"):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert len(stub.Describe(pb.DescribeRequest(), timeout=5).ranks) == 2
            assert [a.name for a in stub.ListAdapters(pb.ListAdaptersRequest(), timeout=5).adapters] == ["fast"]
            assert forward(stub, ([1, 2, 3], "fast"))[0].shape == (3, 256)
            assert not any(f.done() for f in pending), "the loads were pending all along"
        finally:
            http.release.set()
        for future in pending:
            assert future.result(timeout=120).success
    metrics = shared.agent.metrics.registry
    refused_total = metrics.get_sample_value("lorafleet_agent_failures_total", {"operation": "load", "reason": "too_many_calls"})
    assert refused_total is not None and refused_total >= len(refused)


def test_a_budget_without_a_queue_refuses_beyond_its_bound_at_once():
    budget = CallBudget("control", 2, "--max-control-calls")
    budget.acquire()
    budget.acquire()
    with pytest.raises(TooManyCalls, match=r"2 running, the limit is 2 \(--max-control-calls\); retry later"):
        budget.acquire()
    budget.release()
    budget.acquire()


def _queued(budget: CallBudget, admitted: list[int], index: int, **kwargs) -> tuple[threading.Thread, list[BaseException]]:
    """A thread that waits for a place of `budget` (it must queue), notes its index once
    admitted and gives the place back; its refusal, if any, in the returned list."""
    refused: list[BaseException] = []

    def call() -> None:
        try:
            budget.acquire(**kwargs)
        except AgentError as error:
            refused.append(error)
            return
        admitted.append(index)
        budget.release()

    waiting = budget.waiting
    thread = threading.Thread(target=call)
    thread.start()
    wait_until(lambda: budget.waiting == waiting + 1 or refused, what=f"call {index} to queue")
    return thread, refused


def test_queued_calls_are_admitted_first_come_first_served_and_beyond_the_queue_refused():
    budget = CallBudget("inference", 1, "--max-inference-calls", QUEUE)
    budget.acquire()  # the one place, held
    admitted: list[int] = []
    threads = [_queued(budget, admitted, index)[0] for index in range(3)]
    with pytest.raises(TooManyCalls, match=r"3 waiting, the queue's limit is 3 \(--max-queued-inference-calls\)") as refused:
        budget.acquire()
    assert refused.value.reason == "too_many_calls" and "the limit is 1 (--max-inference-calls)" in str(refused.value)
    assert admitted == [] and budget.running == 1
    budget.release()  # handed to the oldest waiter, which hands it on as it ends
    for thread in threads:
        thread.join()
    assert admitted == [0, 1, 2]
    assert (budget.running, budget.waiting) == (0, 0)


def test_a_queued_call_leaves_refused_after_the_queues_wait_or_its_own_deadline_and_never_runs():
    budget = CallBudget("inference", 1, "--max-inference-calls", dataclasses.replace(QUEUE, max_wait_s=0.05))
    budget.acquire()
    with pytest.raises(TooManyCalls, match=r"within 0.05 s \(--inference-queue-wait-s\)") as waited:
        budget.acquire()
    assert waited.value.reason == "queue_timeout"
    with pytest.raises(DeadlineExceeded, match="deadline passed") as late:
        budget.acquire(deadline_s=0.01)
    assert late.value.reason == "deadline_exceeded"
    with pytest.raises(DeadlineExceeded, match="the call ended") as gone:
        budget.acquire(on_end=lambda callback: False)  # gRPC's add_callback of a call that already ended
    assert gone.value.reason == "cancelled"
    assert (budget.running, budget.waiting) == (1, 0)
    budget.release()
    assert budget.running == 0


def test_closing_a_budget_refuses_its_queued_calls_and_keeps_the_running_ones():
    budget = CallBudget("inference", 1, "--max-inference-calls", QUEUE)
    budget.acquire()
    admitted: list[int] = []
    thread, refused = _queued(budget, admitted, 0)
    budget.close()
    thread.join()
    assert admitted == [] and isinstance(refused[0], ShuttingDown)
    with pytest.raises(ShuttingDown):
        budget.acquire()
    assert budget.running == 1
    budget.release()
    assert budget.wait_idle(time.monotonic())


def test_an_async_wait_leaves_the_loop_free_and_a_cancelled_one_leaves_the_queue():
    budget = CallBudget("inference", 1, "--max-inference-calls", QUEUE)

    async def scenario() -> list[str]:
        steps: list[str] = []
        await budget.acquire_async()  # the free place
        first = asyncio.create_task(budget.acquire_async())
        second = asyncio.create_task(budget.acquire_async())
        while budget.waiting < 2:
            await asyncio.sleep(0)  # the loop runs on while both wait
        steps.append("both queued")
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        steps.append(f"cancelled, {budget.waiting} waiting")
        await asyncio.to_thread(budget.release)  # another thread gives the place back
        await second
        steps.append(f"second admitted, {budget.running} running")
        budget.release()
        return steps

    assert asyncio.run(scenario()) == ["both queued", "cancelled, 1 waiting", "second admitted, 1 running"]
    assert (budget.running, budget.waiting) == (0, 0)


def test_the_thread_pool_has_room_for_both_budgets_the_inference_queue_and_the_reserve():
    options = ServerOptions(max_control_calls=3, max_inference_calls=5, reserved_workers=2)
    assert options.inference_queue.size == INFERENCE_QUEUE_FACTOR * 5
    assert options.max_workers == 3 + 5 + INFERENCE_QUEUE_FACTOR * 5 + 2
    assert dataclasses.replace(options, max_queued_inference_calls=0).max_workers == 10


def test_serve_flags_set_the_budgets_and_the_hang_timeout(tmp_path):
    from node_agent.cli import agent_config, build_parser, main, server_options

    model = tmp_path / "model"
    model.mkdir()
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(model),
            "--max-control-calls",
            "4",
            "--max-inference-calls",
            "6",
            "--reserved-workers",
            "3",
            "--engine-hang-timeout-s",
            "20",
            "--exit-linger-s",
            "2",
            "--max-queued-inference-calls",
            "7",
            "--inference-queue-wait-s",
            "1.5",
        ]
    )
    options = server_options(args)
    assert (options.max_control_calls, options.max_inference_calls, options.reserved_workers, options.exit_linger_s) == (4, 6, 3, 2)
    assert (options.inference_queue.size, options.inference_queue.max_wait_s) == (7, 1.5)
    assert agent_config(args).engine_hang_timeout_s == 20
    defaults = build_parser().parse_args(["serve", "--model", str(model)])
    assert server_options(defaults) == ServerOptions(listen="0.0.0.0:50051")
    assert server_options(defaults).inference_queue == QueueRule(
        INFERENCE_QUEUE_FACTOR * 32, 30.0, "--max-queued-inference-calls", "--inference-queue-wait-s"
    )
    for flag, value in (
        ("--max-control-calls", "0"),
        ("--max-inference-calls", "0"),
        ("--reserved-workers", "0"),
        ("--engine-hang-timeout-s", "0"),
        ("--exit-linger-s", "-1"),
        ("--max-queued-inference-calls", "-1"),
        ("--inference-queue-wait-s", "0"),
    ):
        assert main(["serve", "--model", str(model), flag, value]) == 2
