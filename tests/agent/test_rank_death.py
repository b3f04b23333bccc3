"""A rank that dies: health NOT_SERVING, fast UNAVAILABLE errors, and `serve` exits non-zero."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from node_agent.agent import AgentConfig
from node_agent.engine import EngineConfig, FaultPlan, Topology
from node_agent.server import ServerOptions, create_server
from node_agent.sources import SourcePolicy
from tests.agent.helpers import make_adapter, make_model, rpc_error, start_agent, wait_until


def health_status(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="lorafleet.v1.NodeAgent"), timeout=10).status


def test_a_killed_rank_turns_health_not_serving_and_calls_fail_fast(tmp_path):
    model = make_model(tmp_path / "model", tokenizer=False)
    agent, engine = start_agent(EngineConfig(model_dir=model, topology=Topology(2, 2)), AgentConfig())
    server = create_server(agent, ServerOptions())
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = agent_pb2_grpc.NodeAgentStub(channel)
    try:
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        os.kill(engine.pids[1], signal.SIGKILL)
        wait_until(lambda: health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING, 30, "NOT_SERVING")
        assert server.wait() is True, "wait() ends with the engine's death"
        calls = {
            "Forward": lambda: stub.Forward(pb.ForwardRequest(sequences=[pb.Sequence(token_ids=[1, 2])]), timeout=60),
            "Generate": lambda: list(stub.Generate(pb.GenerateRequest(token_ids=[1, 2]), timeout=60)),
            "LoadAdapter": lambda: stub.LoadAdapter(pb.LoadAdapterRequest(name="x", source_uri="file:///x"), timeout=60),
            "UnloadAdapter": lambda: stub.UnloadAdapter(pb.UnloadAdapterRequest(name="x"), timeout=60),
            "ListAdapters": lambda: stub.ListAdapters(pb.ListAdaptersRequest(), timeout=60),
        }
        # UNAVAILABLE at once, not DEADLINE_EXCEEDED after the calls' 60 s (a gloo timeout is minutes).
        for method, call in calls.items():
            error = rpc_error(call)
            assert (method, error.code()) == (method, grpc.StatusCode.UNAVAILABLE), error.details()
            assert "engine is not serving" in error.details() and "restarts" in error.details()
        # Describe still answers, so an operator can see which rank died.
        ranks = stub.Describe(pb.DescribeRequest(), timeout=30).ranks
        assert [(r.rank, r.alive) for r in ranks] == [(0, True), (1, False)]
    finally:
        channel.close()
        server.stop(grace=0)
        agent.close()


def test_a_rank_that_dies_after_answering_a_load_fails_the_load(tmp_path):
    """Rank 1 loads and answers; it is killed while rank 0 is paused in the same load. Its answer
    died with it: the load fails at once, naming the rank, without waiting for rank 0, and
    nothing is published."""
    model = make_model(tmp_path / "model", tokenizer=False)
    adapter = make_adapter(tmp_path / "adapters" / "ad", seed=1)
    markers, resume = tmp_path / "markers", tmp_path / "resume-rank0"
    markers.mkdir()
    faults = FaultPlan(pause_load_on_rank=0, resume_file=resume, markers_dir=markers)
    config = AgentConfig(sources=SourcePolicy(adapter_roots=(tmp_path / "adapters",), cache_dir=tmp_path / "cache"))
    agent, engine = start_agent(EngineConfig(model_dir=model, topology=Topology(2, 2)), config, faults)
    server = create_server(agent, ServerOptions())
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = agent_pb2_grpc.NodeAgentStub(channel)
    try:
        load = stub.LoadAdapter.future(pb.LoadAdapterRequest(name="a", source_uri=adapter.as_uri()), timeout=120)
        wait_until((markers / "rank0-paused").exists, 60, "rank 0 paused in the load")
        wait_until((markers / "rank1-load").exists, 60, "rank 1's answer to the load")
        kill_and_wait(engine.pids[1])
        wait_until(load.done, 60, "the load to fail while rank 0 is still paused")
        assert not (markers / "rank0-load").exists(), "rank 0 never answered"
        error = rpc_error(load.result)
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        assert "rank 1 exited during load" in error.details(), error.details()
        wait_until(lambda: health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING, 30, "NOT_SERVING")
        assert agent.registry.get("a") is None and not agent.registry.entries()
        assert list((tmp_path / "cache").glob("snap-*")) == [], "the load's snapshot is removed"
        assert "rank 1 exited during load" in agent.failure()
    finally:
        resume.touch()
        channel.close()
        server.stop(grace=0)
        agent.close()


def kill_and_wait(pid: int) -> None:
    """SIGKILL `pid` and wait until it has exited as its parent sees it: every thread gone, its
    pipes closed. A killed process's /proc state reads Z while its other threads still exit; a
    pidfd becomes readable only once the whole process has exited, and reaps nothing."""
    pidfd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        readable, _, _ = select.select([pidfd], [], [], 60)
        assert readable, f"process {pid} did not exit after SIGKILL"
    finally:
        os.close(pidfd)


def test_a_stop_requested_before_the_watcher_saw_a_rank_die_still_reports_the_death(tmp_path):
    model = make_model(tmp_path / "model", tokenizer=False)
    agent, engine = start_agent(EngineConfig(model_dir=model, topology=Topology(1, 1)), AgentConfig())
    server = create_server(agent, ServerOptions(health_poll_s=3600))  # the health watcher never looks
    server.start()
    try:
        os.kill(engine.pids[0], signal.SIGKILL)
        wait_until(lambda: not agent.alive, 30, "the rank's death")
        server.request_stop()  # what SIGTERM does in `serve`
        assert server.wait() is True, "serve must exit non-zero so the pod restarts"
    finally:
        server.stop(grace=0)
        agent.close()


def rank_pids(parent: int) -> list[int]:
    """The engine's rank processes: the agent's children started by multiprocessing spawn."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == parent and b"spawn_main" in cmdline:
            pids.append(int(stat.parent.name))
    return sorted(pids)


def start_serve(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    """`lorafleet-agent serve` on a free port (--listen 127.0.0.1:0); returns the process and the
    port it logged."""
    log_path = tmp_path / "agent.log"
    executable = Path(sys.executable).parent / "lorafleet-agent"  # the installed console script
    command = [str(executable), "--log-level", "INFO", "serve", "--listen", "127.0.0.1:0", *extra]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log_path.open("w"))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        match = re.search(r"serving lorafleet\.v1\.NodeAgent on \S+ \(port (\d+)\)", log_path.read_text())
        if match:
            return process, int(match.group(1))
        if process.poll() is not None:
            raise AssertionError(f"serve exited with {process.returncode}:\n{log_path.read_text()}")
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"serve did not start:\n{log_path.read_text()}")


def test_serve_exits_non_zero_when_a_rank_dies(tmp_path):
    model = make_model(tmp_path / "model", tokenizer=False)
    adapter = make_adapter(tmp_path / "adapters" / "ad", seed=1)
    (tmp_path / "token").write_text("s3cret\n")
    process, port = start_serve(
        tmp_path,
        "--model",
        str(model),
        "--tp",
        "2",
        "--dp",
        "2",
        "--base-model-name",
        "llama-test",
        "--adapter-root",
        str(tmp_path / "adapters"),
        "--auth-token-file",
        str(tmp_path / "token"),
        "--exit-linger-s",
        "0",
    )  # the linger is the next test's; here it would only add 5 s
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = agent_pb2_grpc.NodeAgentStub(channel)
        token = (("authorization", "Bearer s3cret"),)
        assert stub.Describe(pb.DescribeRequest(), metadata=token, timeout=30).base_model.name == "llama-test"
        assert stub.LoadAdapter(pb.LoadAdapterRequest(name="a", source_uri=adapter.as_uri()), metadata=token, timeout=60).success
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        pids = rank_pids(process.pid)
        assert len(pids) == 2, pids
        os.kill(pids[0], signal.SIGKILL)
        assert process.wait(timeout=60) != 0
        log = (tmp_path / "agent.log").read_text()
        assert "exiting so the pod restarts" in log
        channel.close()
    finally:
        if process.poll() is None:
            process.kill()


def test_serve_keeps_answering_describe_after_a_rank_died_until_it_exits(tmp_path):
    """Describe answers from what the agent knows (the dead rank alive=false) while `serve`
    lingers after the engine's death; SIGTERM ends the linger, and the exit is still non-zero."""
    model = make_model(tmp_path / "model", tokenizer=False)
    process, port = start_serve(tmp_path, "--model", str(model), "--tp", "2", "--dp", "2", "--exit-linger-s", "120")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = agent_pb2_grpc.NodeAgentStub(channel)
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        pids = rank_pids(process.pid)
        assert len(pids) == 2, pids
        os.kill(pids[1], signal.SIGKILL)
        wait_until(lambda: health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING, 30, "NOT_SERVING")
        time.sleep(1.5)  # well past the moment the watcher saw the death (it polls every 0.25 s)
        for _ in range(3):
            ranks = stub.Describe(pb.DescribeRequest(), timeout=10).ranks
            assert [(r.rank, r.alive) for r in ranks] == [(0, True), (1, False)]
        error = rpc_error(lambda: stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10))
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "engine is not serving" in error.details()
        assert process.poll() is None, "serve lingers"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 1
        assert "exiting so the pod restarts" in (tmp_path / "agent.log").read_text()
    finally:
        channel.close()
        if process.poll() is None:
            process.kill()


def test_serve_stops_cleanly_on_sigterm(tmp_path):
    model = make_model(tmp_path / "model", tokenizer=False)
    process, _port = start_serve(tmp_path, "--model", str(model))
    try:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert "stopped" in (tmp_path / "agent.log").read_text()
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert"),
        (["--auth-token-file", "missing"], "is not a readable file"),
        (["--auth-token-file", "empty"], "is empty"),
        (["--adapter-root", "nowhere"], "is not a directory"),
    ],
)
def test_serve_refuses_bad_flags_before_starting_an_engine(tmp_path, flags, message, capsys):
    from node_agent.cli import main

    (tmp_path / "cert.pem").write_text("x")
    (tmp_path / "ca.pem").write_text("x")
    (tmp_path / "empty").write_text("\n")
    flags = [str(tmp_path / f) if not f.startswith("--") else f for f in flags]
    assert main(["serve", "--model", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err
