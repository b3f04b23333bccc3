"""lorafleet's agent over two real vLLM servers (`--backend vllm`): all-or-nothing loads with
every server's reply, hot replace in place, unloads, the servers' model lists as the truth
(a restarted server's losses), validation before vLLM, and Generate through vLLM equal to
transformers + PEFT."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from node_agent.backend import Sampling
from node_agent.backends.server import CompletionStep, Refusal
from node_agent.backends.vllm import VllmServer
from node_agent.backends.vllm.refusals import classify
from node_agent.cli.main import main
from tests.agent.helpers import wait_until
from tests.support.bad_adapters import make_other_base_adapter, make_oversized_rank_adapter, make_unknown_module_adapter
from tests.support.models import make_adapter
from tests.support.oracle import reference_logits
from tests.vllm.conftest import Fleet

PROMPT = [5, 17, 42, 7]
NEW_TOKENS = 6


def served(url: str) -> dict[str, str]:
    """What a server lists: each adapter's id and path, from its /v1/models (parent = the base)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as answer:
        entries = json.load(answer)["data"]
    base = next(entry["id"] for entry in entries if entry["parent"] is None)
    return {entry["id"]: entry["root"] for entry in entries if entry["parent"] == base}


def greedy_oracle(model: Path, adapter: Path | None, tokens: list[int], n: int) -> list[int]:
    """transformers + PEFT's greedy continuation of `tokens`, one token at a time (`adapter`
    None: the base model alone)."""
    out: list[int] = []
    adapters = {} if adapter is None else {"a": adapter}
    for _ in range(n):
        (logits,) = reference_logits(model, [(tokens + out, None if adapter is None else "a")], adapters)
        out.append(int(logits[-1].argmax()))
    return out


def server_tokens(url: str, model: str, new_tokens: int = NEW_TOKENS) -> list[int]:
    steps = VllmServer(url).complete(model, PROMPT, Sampling(max_tokens=new_tokens))
    assert not isinstance(steps, Refusal), steps
    return [step.token_id for step in steps if isinstance(step, CompletionStep)]


def load(fleet: Fleet, name: str, directory: Path, **kwargs: object) -> pb.LoadAdapterResponse:
    return fleet.stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source_uri=f"file://{directory}", **kwargs), timeout=180)


def listed_ranks(fleet: Fleet) -> dict[str, list[int]]:
    return {a.name: list(a.ranks) for a in fleet.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters}


def test_describe_says_the_servers_capacity(fleet: Fleet) -> None:
    description = fleet.stub.Describe(pb.DescribeRequest(), timeout=30)
    assert [rank.rank for rank in description.ranks] == [0, 1]
    assert all(rank.alive for rank in description.ranks)
    assert description.capacity.max_lora_rank == 16
    assert fleet.agent.backend.kind == "vllm"
    assert fleet.agent.backend.version == "vllm 0.32.0"
    assert not fleet.agent.backend.capabilities.pinning
    backend = description.backend
    assert (backend.kind, backend.version) == ("vllm", "vllm 0.32.0")
    assert list(backend.endpoints) == [server.url for server in fleet.servers]


def test_load_lists_on_both_and_generates_like_peft(fleet: Fleet) -> None:
    adapter = make_adapter(fleet.model, fleet.root / "a1", seed=1, r=8)
    reply = load(fleet, "a1", adapter)
    assert reply.success, reply.error_message
    assert [(r.rank, r.success) for r in reply.rank_results] == [(0, True), (1, True)]
    assert list(reply.loaded_adapters) == ["a1"]
    assert listed_ranks(fleet) == {"a1": [0, 1]}
    paths = [served(server.url).get("a1") for server in fleet.servers]
    assert paths[0] is not None and paths[0] == paths[1]  # the agent's verified snapshot, not the source
    assert Path(paths[0]).parent != adapter.parent

    expected = greedy_oracle(fleet.model, adapter, PROMPT, NEW_TOKENS)
    for server in fleet.servers:
        assert server_tokens(server.url, "a1") == expected
    for _ in fleet.servers:  # round robin: one Generate through each server
        request = pb.GenerateRequest(token_ids=PROMPT, adapter="a1", max_new_tokens=NEW_TOKENS, logprobs=2)
        steps = list(fleet.stub.Generate(request, timeout=120))
        assert [step.token_id for step in steps] == expected
        assert all(step.top_logprobs[0].token_id == step.token_id and len(step.top_logprobs) == 2 for step in steps)
        assert steps[-1].finish == pb.FINISH_REASON_LENGTH and steps[-1].usage.completion_tokens == NEW_TOKENS

    base = greedy_oracle(fleet.model, None, PROMPT, NEW_TOKENS)
    assert base != expected
    for _ in fleet.servers:  # the base model, by the id each server lists for it
        request = pb.GenerateRequest(token_ids=PROMPT, max_new_tokens=NEW_TOKENS)
        assert [step.token_id for step in fleet.stub.Generate(request, timeout=120)] == base

    unloaded = fleet.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a1"), timeout=60)
    assert unloaded.success, unloaded.error_message
    assert all("a1" not in served(server.url) for server in fleet.servers)
    assert listed_ranks(fleet) == {}


def test_adapter_stats_count_requests_sent_straight_to_the_servers(fleet: Fleet) -> None:
    """Gateways route to vLLM's own ports: AdapterStats counts those requests too, from each
    server's /metrics (vllm:num_requests_running and vllm:lora_requests_info)."""
    assert load(fleet, "direct", make_adapter(fleet.model, fleet.root / "direct", seed=5, r=8)).success
    try:
        per_server = (4, 2)
        seen: list[int] = []
        urls = [server.url for server, count in zip(fleet.servers, per_server, strict=True) for _ in range(count)]
        with ThreadPoolExecutor(len(urls)) as pool:
            streams = [pool.submit(server_tokens, url, "direct", 250) for url in urls]
            while not all(stream.done() for stream in streams) and sum(per_server) not in seen:
                stats = {stat.adapter: stat for stat in fleet.agent.adapter_stats().adapters}
                seen.append(stats["direct"].running if "direct" in stats else 0)
            assert all(len(stream.result()) == 250 for stream in streams)
        # The agent's own streams are none of these: before, it counted 0. How many are seen at
        # once depends on the machine (on a quiet one a server may finish its streams before the
        # other starts; on a loaded one a server's /metrics may miss the 2-s read), so the check is
        # that requests straight to the servers are counted at all, and never more than were sent.
        assert 0 < max(seen) <= sum(per_server), f"the requests straight to vLLM counted while they ran: {seen}"

        def direct_requests() -> tuple[int, int]:
            stats = {stat.adapter: stat for stat in fleet.agent.adapter_stats().adapters}
            return stats["direct"].running, stats["direct"].waiting

        wait_until(lambda: direct_requests() == (0, 0), what="no request of the adapter left once they all ended")
    finally:  # a failure here leaves the next tests the fleet as they expect it
        assert fleet.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="direct"), timeout=60).success


def test_a_load_one_server_refuses_leaves_neither_holding_it(fleet: Fleet) -> None:
    adapter = make_adapter(fleet.model, fleet.root / "wide", seed=2, r=16)  # server 1 takes rank 8 at most
    reply = load(fleet, "wide", adapter)
    assert not reply.success
    ranks = {r.rank: r for r in reply.rank_results}
    assert not ranks[1].success and "server 1" in ranks[1].error_message
    assert "permanent: 500 InternalServerError" in ranks[1].error_message
    assert "greater than max_lora_rank 8" in ranks[1].error_message
    assert not ranks[0].success and "rolled back" in ranks[0].error_message
    assert all("wide" not in served(server.url) for server in fleet.servers)
    assert listed_ranks(fleet) == {}


def test_hot_replace_in_place_then_unload(fleet: Fleet) -> None:
    first = make_adapter(fleet.model, fleet.root / "hot-1", seed=3, r=4)
    second = make_adapter(fleet.model, fleet.root / "hot-2", seed=4, r=8)
    assert load(fleet, "hot", first).success
    before = served(fleet.servers[0].url)["hot"]
    reply = load(fleet, "hot", second, replace=True)
    assert reply.success, reply.error_message
    after = [served(server.url)["hot"] for server in fleet.servers]
    assert after[0] == after[1] != before  # the same name, the new version's snapshot
    assert listed_ranks(fleet) == {"hot": [0, 1]}
    expected = greedy_oracle(fleet.model, second, PROMPT, NEW_TOKENS)
    assert [server_tokens(server.url, "hot") for server in fleet.servers] == [expected, expected]

    assert fleet.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="hot"), timeout=60).success
    assert all("hot" not in served(server.url) for server in fleet.servers)


@pytest.mark.parametrize(
    "make",
    [
        lambda model, out: make_oversized_rank_adapter(model, out, r=32),
        make_unknown_module_adapter,
        make_other_base_adapter,
    ],
    ids=["rank-over-max", "unknown-module", "other-base"],
)
def test_a_hostile_adapter_never_reaches_vllm(fleet: Fleet, make, request: pytest.FixtureRequest) -> None:
    name = f"hostile-{request.node.callspec.id}"
    adapter = make(fleet.model, fleet.root / name)
    with pytest.raises(grpc.RpcError) as refused:
        load(fleet, name, adapter)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for server in fleet.servers:
        assert name not in served(server.url)
        assert name not in server.log_path.read_text(errors="replace")  # vLLM was never asked


def test_pinning_and_forward_are_refused_as_unsupported(fleet: Fleet) -> None:
    adapter = make_adapter(fleet.model, fleet.root / "pin", seed=5, r=4)
    with pytest.raises(grpc.RpcError) as pinned:
        load(fleet, "pin", adapter, pinned=True)
    assert pinned.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "cannot pin" in (pinned.value.details() or "")
    with pytest.raises(grpc.RpcError) as forward:
        fleet.stub.Forward(pb.ForwardRequest(sequences=[pb.Sequence(token_ids=PROMPT)]), timeout=30)
    assert forward.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert listed_ranks(fleet) == {}


def start_serve(fleet: Fleet, tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """`lorafleet-agent serve --backend vllm` over the fleet's servers; its process and port."""
    log_path = tmp_path / "agent.log"
    endpoints = [flag for server in fleet.servers for flag in ("--vllm-endpoint", server.url)]
    command = [
        str(Path(sys.executable).parent / "lorafleet-agent"), "--log-level", "INFO", "serve", "--listen", "127.0.0.1:0",
        "--backend", "vllm", *endpoints, "--model", str(fleet.model), "--max-lora-rank", "16",
        "--cache-dir", str(tmp_path / "cache"), "--adapter-root", str(fleet.root),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log_path.open("w"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        match = re.search(r"serving lorafleet\.v1\.NodeAgent on \S+ \(port (\d+)\)", log_path.read_text())
        if match:
            return process, int(match.group(1))
        assert process.poll() is None, log_path.read_text()
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"serve did not start:\n{log_path.read_text()}")


def test_serve_with_the_vllm_backend(fleet: Fleet, tmp_path: Path) -> None:
    adapter = make_adapter(fleet.model, fleet.root / "by-cli", seed=8, r=4)
    process, port = start_serve(fleet, tmp_path)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            request = pb.LoadAdapterRequest(name="by-cli", source_uri=f"file://{adapter}")
            assert stub.LoadAdapter(request, timeout=120).success
            assert [list(a.ranks) for a in stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters] == [[0, 1]]
            assert all(served(server.url)["by-cli"].startswith(str(tmp_path / "cache")) for server in fleet.servers)
            assert stub.UnloadAdapter(pb.UnloadAdapterRequest(name="by-cli"), timeout=60).success
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "needs at least one --vllm-endpoint"),
        (["--vllm-endpoint", "http://127.0.0.1:1"], "needs --cache-dir"),
        (["--vllm-endpoint", "https://x/v1", "--cache-dir", "."], "a vLLM endpoint is http://HOST:PORT"),
    ],
)
def test_serve_refuses_an_incomplete_vllm_backend(
    tmp_path: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--model", str(tmp_path), "--backend", "vllm", *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_restarted_server_reports_what_it_lost(fleet: Fleet) -> None:
    adapter = make_adapter(fleet.model, fleet.root / "kept", seed=6, r=4)
    assert load(fleet, "kept", adapter).success
    lost = fleet.servers[1]
    lost.kill()
    assert listed_ranks(fleet) == {"kept": [0]}
    # A load while a server is down: refused by it as transient, rolled back on the other.
    other = make_adapter(fleet.model, fleet.root / "other", seed=7, r=4)
    reply = load(fleet, "other", other)
    assert not reply.success
    down = {r.rank: r.error_message for r in reply.rank_results}[1]
    assert "server 1" in down and "transient: Unreachable" in down
    assert "other" not in served(fleet.servers[0].url)

    lost.start()
    lost.wait_ready()
    assert listed_ranks(fleet) == {"kept": [0]}  # the restarted server lost it
    assert "kept" not in served(lost.url)
    expected = greedy_oracle(fleet.model, adapter, PROMPT, NEW_TOKENS)
    for _ in fleet.servers:  # Generate goes to the server that still holds it
        request = pb.GenerateRequest(token_ids=PROMPT, adapter="kept", max_new_tokens=NEW_TOKENS)
        assert [step.token_id for step in fleet.stub.Generate(request, timeout=120)] == expected
    # Unloading it: the server that lost it answers 404, which counts as gone.
    assert fleet.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="kept"), timeout=60).success
    assert all("kept" not in served(server.url) for server in fleet.servers)


# vLLM 0.32.0's answers, captured from the servers above; each is also met live by the tests
# above (the rank refusal, a server down, an unload of what a server lost).
RANK_REFUSAL = (
    b'{"error":{"message":"Call to add_lora method failed: Worker failed with error \'LoRA rank 16 is greater than '
    b'max_lora_rank 8.\', please check the stack trace above for the root cause","type":"InternalServerError",'
    b'"param":null,"code":500}}'
)
UNLOAD_UNKNOWN = b'{"error":{"message":"The lora adapter \'zz\' cannot be found.","type":"NotFoundError","param":null,"code":404}}'


def test_vllm_error_bodies_are_classified() -> None:
    refused = classify(500, RANK_REFUSAL)
    assert refused.permanent and refused.error_type == "InternalServerError" and "max_lora_rank 8" in refused.message
    unknown = classify(404, UNLOAD_UNKNOWN)
    assert unknown.permanent and unknown.error_type == "NotFoundError"
