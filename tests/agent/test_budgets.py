"""Health and inference never queue behind control calls: each class has its own budget.

64 loads whose downloads a real loopback HTTP server holds: the downloads bound refuses some,
the control budget others, the rest stay pending; health, Describe, ListAdapters and a Forward
on an already-loaded adapter still answer (the shared tp=2 dp=2 agent, real gRPC on loopback).
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet.v1 import agent_pb2 as pb
from node_agent.errors import TooManyCalls
from node_agent.server import DEFAULT_MAX_CONTROL_CALLS, CallBudget, ServerOptions
from tests.agent.helpers import forward, http_server, wait_until

DOWNLOADS = 8  # --max-concurrent-downloads of this test (the default)
NAMES = 2 * DOWNLOADS  # first wave: one load per name; half of them get a download place


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


def test_the_inference_budget_refuses_beyond_its_bound_at_once():
    budget = CallBudget("inference", 2, "--max-inference-calls")
    budget.acquire()
    budget.acquire()
    with pytest.raises(TooManyCalls, match=r"2 running, the limit is 2 \(--max-inference-calls\)"):
        budget.acquire()
    budget.release()
    budget.acquire()


def test_the_thread_pool_has_room_for_both_budgets_and_the_reserve():
    options = ServerOptions(max_control_calls=3, max_inference_calls=5, reserved_workers=2)
    assert options.max_workers == 10


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
        ]
    )
    options = server_options(args)
    assert (options.max_control_calls, options.max_inference_calls, options.reserved_workers, options.exit_linger_s) == (4, 6, 3, 2)
    assert agent_config(args).engine_hang_timeout_s == 20
    defaults = build_parser().parse_args(["serve", "--model", str(model)])
    assert server_options(defaults) == ServerOptions(listen="0.0.0.0:50051")
    for flag, value in (
        ("--max-control-calls", "0"),
        ("--max-inference-calls", "0"),
        ("--reserved-workers", "0"),
        ("--engine-hang-timeout-s", "0"),
        ("--exit-linger-s", "-1"),
    ):
        assert main(["serve", "--model", str(model), flag, value]) == 2
