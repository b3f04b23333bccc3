"""Every NodeAgent RPC against the shared agent (tp=2, dp=2) over a real loopback server."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import socket
import subprocess
import sys
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from lorafleet.v1 import agent_pb2 as pb
from lorafleet_common.wire import REASON_METADATA_KEY
from lorafleet_dev.processes import free_port
from node_agent.cli import start_servers
from node_agent.http_api import HttpOptions
from node_agent.server import ServerOptions, create_server
from tests.agent.conftest import SLOTS
from tests.agent.helpers import SHAPE, WORDS, forward, generate, make_adapter, make_nan_adapter, rpc_error

PROMPT = [1, 2, 3, 255, 0, 17]


def load(stub, name: str, path, **kwargs) -> pb.LoadAdapterResponse:
    return stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source_uri=path.as_uri(), **kwargs), timeout=60)


def test_describe_reports_identity_model_topology_capacity_ranks_and_buffer_shapes(shared, stub):
    reply = stub.Describe(pb.DescribeRequest(), timeout=30)
    assert reply.agent_id == "agent-under-test"
    assert reply.base_model.name == "tiny-llama"  # default: the model directory's name
    assert reply.base_model.config_sha256 == hashlib.sha256((shared.model / "config.json").read_bytes()).hexdigest()
    topology = reply.topology
    sizes = (topology.tp_size, topology.dp_size, topology.attn_tp_size, topology.ep_size, topology.moe_tp_size)
    assert sizes == (2, 2, 1, 1, 2) and not topology.fully_sharded_loras
    assert (reply.capacity.max_lora_rank, reply.capacity.max_loras_per_batch, reply.capacity.max_loaded_loras) == (16, SLOTS, 16)
    assert [(r.rank, r.attn_dp_rank, r.attn_tp_rank, r.alive) for r in reply.ranks] == [(0, 0, 0, True), (1, 1, 0, True)]
    assert reply.has_tokenizer
    backend = reply.backend
    assert (backend.kind, backend.version) == ("lorafleet-engine", importlib.metadata.version("lorafleet"))
    assert list(backend.endpoints) == [], "the builtin engine's ranks are the agent's own processes"
    shapes = {(m.module, m.rank): [(list(s.lora_a_shape), list(s.lora_b_shape)) for s in m.slices] for m in reply.modules}
    assert len(shapes) == SHAPE.num_layers * 4 * 2, "one entry per (module, rank)"
    # dp=2: attention is TP over one rank per group (whole q/k/v/o); the MLP is TP over both ranks.
    q, kv, inter, r = SHAPE.num_heads * SHAPE.head_dim, SHAPE.num_kv_heads * SHAPE.head_dim, SHAPE.intermediate_size, 16
    for rank in (0, 1):
        assert shapes[("layers.0.qkv_proj", rank)] == [([r, 64], [q, r]), ([r, 64], [kv, r]), ([r, 64], [kv, r])]
        assert shapes[("layers.1.gate_up_proj", rank)] == [([r, 64], [inter // 2, r])] * 2
        assert shapes[("layers.1.down_proj", rank)] == [([r, inter // 2], [64, r])]


def test_load_list_forward_unload_round_trip(shared, stub):
    path = shared.adapters["ad0"]
    reply = load(stub, "support", path)
    assert reply.success and reply.error_message == "" and not reply.already_loaded
    assert list(reply.loaded_adapters) == ["support"]
    assert [(r.rank, r.attn_dp_rank, r.attn_tp_rank, r.success, r.error_message) for r in reply.rank_results] == [
        (0, 0, 0, True, ""),
        (1, 1, 0, True, ""),
    ]

    (info,) = stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters
    assert (info.name, info.source_uri, info.pinned, list(info.ranks)) == ("support", path.as_uri(), False, [0, 1])
    assert info.sha256 == hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()

    with_adapter, base = forward(stub, (PROMPT, "support"), (PROMPT, ""))
    assert with_adapter.shape == base.shape == (len(PROMPT), SHAPE.vocab_size)
    assert not np.allclose(with_adapter, base), "the adapter must change the logits"
    # The base output alone, in a batch of the same rows as after the unload: on the CPU the row
    # count chooses the matmul (dense.linear), so only equal batches compare to the bit.
    (base_alone,) = forward(stub, (PROMPT, ""))
    np.testing.assert_allclose(base_alone, base, rtol=1e-5, atol=1e-5)

    reply = stub.UnloadAdapter(pb.UnloadAdapterRequest(name="support"), timeout=60)
    assert reply.success and list(reply.loaded_adapters) == [] and [r.success for r in reply.rank_results] == [True, True]
    assert not stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters
    error = rpc_error(lambda: forward(stub, (PROMPT, "support")))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "not loaded" in error.details()
    assert np.array_equal(forward(stub, (PROMPT, ""))[0], base_alone), "unloading never changes the base output"


def test_forward_logits_equal_the_forward_command(shared, stub, tmp_path):
    load(stub, "sql", shared.adapters["ad1"])
    sequences = [(PROMPT, "sql"), ([5, 6, 7, 8], ""), ([9, 10], "sql")]
    (tmp_path / "in.json").write_text(json.dumps([{"tokens": t, "adapter": a or None} for t, a in sequences]))
    command = [
        sys.executable,
        "-m",
        "node_agent.cli",
        "forward",
        "--model",
        str(shared.model),
        "--tp",
        "2",
        "--dp",
        "2",
        "--max-loaded-loras",
        "16",
        "--adapter",
        f"sql={shared.adapters['ad1']}",
        "--input",
        str(tmp_path / "in.json"),
        "--output",
        str(tmp_path / "out.safetensors"),
    ]
    subprocess.run(command, check=True, timeout=300, capture_output=True)
    from safetensors.numpy import load_file

    expected = load_file(str(tmp_path / "out.safetensors"))
    got = forward(stub, *sequences)
    for index, logits in enumerate(got):
        np.testing.assert_array_equal(logits, expected[f"logits.{index}"], err_msg=f"sequence {index}")


def test_generate_is_greedy_over_forward_and_streams_text(shared, stub):
    load(stub, "gen", shared.adapters["ad2"])
    replies = list(stub.Generate(pb.GenerateRequest(token_ids=PROMPT, adapter="gen", max_new_tokens=6), timeout=120))
    tokens = [r.token_id for r in replies]
    sequence = list(PROMPT)
    for token in tokens:  # each token is the argmax of a full forward over everything before it
        assert token == int(np.argmax(forward(stub, (sequence, "gen"))[0][-1]))
        sequence.append(token)
    assert [r.finish_reason for r in replies] == [""] * 5 + ["length"]
    assert "".join(r.text for r in replies) == " ".join(WORDS[t] for t in tokens)
    assert tokens != generate(stub, PROMPT, "", 6), "the adapter must change what is generated"


def test_generate_accepts_a_text_prompt_and_stops_at_stop_tokens(stub):
    by_ids = generate(stub, PROMPT, "", 8)
    prompt = " ".join(WORDS[t] for t in PROMPT)
    by_text = [r.token_id for r in stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=8), timeout=120)]
    assert by_text == by_ids
    stop = by_ids[2]
    replies = list(stub.Generate(pb.GenerateRequest(token_ids=PROMPT, max_new_tokens=8, stop_token_ids=[stop]), timeout=120))
    first = by_ids.index(stop)
    assert [r.token_id for r in replies] == by_ids[: first + 1]
    assert replies[-1].finish_reason == "stop"


@pytest.mark.parametrize(
    "request_, code, phrase",
    [
        (pb.GenerateRequest(token_ids=[1], prompt="w1"), grpc.StatusCode.INVALID_ARGUMENT, "not both"),
        (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "token_ids or a prompt"),
        (pb.GenerateRequest(token_ids=[1], max_new_tokens=5000), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        (pb.GenerateRequest(token_ids=[1], max_new_tokens=-1), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        (pb.GenerateRequest(token_ids=[SHAPE.vocab_size]), grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
        (pb.GenerateRequest(token_ids=[1], adapter="missing"), grpc.StatusCode.NOT_FOUND, "'missing' is not loaded"),
    ],
    ids=["ids-and-prompt", "empty", "too-many-tokens", "negative-tokens", "out-of-vocab", "unknown-adapter"],
)
def test_generate_refusals(stub, request_, code, phrase):
    error = rpc_error(lambda: list(stub.Generate(request_, timeout=30)))
    assert error.code() == code and phrase in error.details()


def test_forward_refusals(shared, stub):
    cases = [
        (pb.ForwardRequest(), grpc.StatusCode.INVALID_ARGUMENT, "at least one sequence"),
        (pb.ForwardRequest(sequences=[pb.Sequence()]), grpc.StatusCode.INVALID_ARGUMENT, "has no tokens"),
        (pb.ForwardRequest(sequences=[pb.Sequence(token_ids=[1, -1])]), grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
        (pb.ForwardRequest(sequences=[pb.Sequence(token_ids=[1], adapter="nope")]), grpc.StatusCode.NOT_FOUND, "'nope' is not loaded"),
    ]
    for request, code, phrase in cases:
        error = rpc_error(lambda request=request: stub.Forward(request, timeout=30))
        assert (error.code(), phrase in error.details()) == (code, True), error.details()
    names = [f"slot{i}" for i in range(SLOTS + 1)]
    for i, name in enumerate(names):
        assert load(stub, name, shared.adapters[f"ad{i}"]).success
    error = rpc_error(lambda: forward(stub, *[([1, 2], name) for name in names]))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "LoRA slots" in error.details()
    assert len(forward(stub, *[([1, 2], name) for name in names[:SLOTS]])) == SLOTS


def test_pinned_adapters_hold_slots_for_batches(shared, stub):
    assert load(stub, "pinned", shared.adapters["ad0"], pinned=True).success
    assert stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters[0].pinned
    others = [f"other{i}" for i in range(SLOTS)]
    for i, name in enumerate(others):
        assert load(stub, name, shared.adapters[f"ad{i + 1}"]).success
    error = rpc_error(lambda: forward(stub, *[([1, 2], name) for name in others]))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "1 pinned" in error.details()
    assert len(forward(stub, *[([1, 2], name) for name in others[: SLOTS - 1]] + [([3], "pinned")])) == SLOTS


def test_a_load_every_rank_refuses_reports_each_rank_and_changes_nothing(shared, stub):
    bad = make_nan_adapter(shared.root / "nan-a", seed=7)
    reply = load(stub, "nan-a", bad)
    assert not reply.success
    assert reply.error_message.count("non-finite") == 1, "the same message from both ranks appears once"
    assert [(r.rank, r.success, "non-finite" in r.error_message) for r in reply.rank_results] == [(0, False, True), (1, False, True)]
    assert list(reply.loaded_adapters) == []
    assert not stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters
    assert rpc_error(lambda: forward(stub, (PROMPT, "nan-a"))).code() == grpc.StatusCode.NOT_FOUND


def test_an_adapter_the_engine_cannot_serve_is_refused_once_before_any_rank(shared, stub):
    bad = make_adapter(shared.root / "dora", seed=7)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    error = rpc_error(lambda: load(stub, "dora", bad))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().count("DoRA") == 1 and "rank" not in error.details(), error.details()
    assert not stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters
    assert rpc_error(lambda: forward(stub, (PROMPT, "dora"))).code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("name", ["", "../x", "a/b", "-lead", "x" * 254])
def test_invalid_adapter_names_are_refused(shared, stub, name):
    error = rpc_error(lambda: stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source_uri=shared.adapters["ad0"].as_uri()), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "invalid adapter name" in error.details()


def test_unloading_an_unknown_adapter_is_not_found(stub):
    error = rpc_error(lambda: stub.UnloadAdapter(pb.UnloadAdapterRequest(name="never"), timeout=30))
    assert error.code() == grpc.StatusCode.NOT_FOUND


def test_every_refusal_carries_the_agents_reason_as_trailing_metadata(shared, stub):
    """The operator tells an agent's own answer from a crash by this mark (docs/operator.md)."""
    unknown = rpc_error(lambda: stub.UnloadAdapter(pb.UnloadAdapterRequest(name="never"), timeout=30))
    request = pb.LoadAdapterRequest(name="../x", source_uri=shared.adapters["ad0"].as_uri())
    bad_name = rpc_error(lambda: stub.LoadAdapter(request, timeout=30))
    assert (REASON_METADATA_KEY, "not_found") in tuple(unknown.trailing_metadata())
    assert (REASON_METADATA_KEY, "invalid_request") in tuple(bad_name.trailing_metadata())


def test_health_is_serving_for_the_server_and_the_service(shared):
    health = health_pb2_grpc.HealthStub(shared.channel)
    for service in ("", "lorafleet.v1.NodeAgent"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == health_pb2.HealthCheckResponse.SERVING


def test_a_metrics_port_taken_fails_the_start_before_health_says_serving(shared):
    """The metrics port is bound before the gRPC server starts: a conflict fails the start while
    nothing answers on the gRPC port (no SERVING that a probe could see before the exit)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = create_server(shared.agent, ServerOptions(listen="127.0.0.1:0", metrics_port=taken.getsockname()[1]))
        try:
            with pytest.raises(OSError, match="in use"):
                server.start()
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                # The port is bound but never served: the call waits out its deadline.
                error = rpc_error(lambda: health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1))
            assert error.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
        finally:
            server.stop(grace=0)


def test_a_taken_http_port_fails_the_start_before_anything_serves(shared):
    """`start_servers` binds the HTTP API before gRPC serves: when its port is taken the start
    fails naming the flag, gRPC never answered (no SERVING a probe could have seen), and the
    metrics port was never opened."""
    with socket.socket() as taken, socket.socket() as probe:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        probe.bind(("127.0.0.1", 0))
        grpc_port, metrics_port = probe.getsockname()[1], free_port()
        probe.close()
        options = ServerOptions(listen=f"127.0.0.1:{grpc_port}", metrics_port=metrics_port)
        with pytest.raises(OSError, match="--http-listen"):
            start_servers(shared.agent, options, HttpOptions(listen=f"127.0.0.1:{taken.getsockname()[1]}"))
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        error = rpc_error(lambda: health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1))
    assert error.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    with socket.socket() as again:
        again.bind(("127.0.0.1", metrics_port))  # raises if the metrics endpoint had been opened


def test_reflection_lists_the_services(shared):
    database = ProtoReflectionDescriptorDatabase(shared.channel)
    assert {"lorafleet.v1.NodeAgent", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(database.get_services())
    assert database.FindFileContainingSymbol("lorafleet.v1.NodeAgent").name == "lorafleet/v1/agent.proto"


def test_metrics_and_one_structured_log_line_per_control_call(shared, stub, caplog):
    caplog.set_level(logging.INFO, logger="lorafleet.agent.calls")
    load(stub, "observed", shared.adapters["ad3"])
    rpc_error(lambda: stub.UnloadAdapter(pb.UnloadAdapterRequest(name="never-loaded"), timeout=30))
    stub.UnloadAdapter(pb.UnloadAdapterRequest(name="observed"), timeout=30)
    forward(stub, (PROMPT, ""))
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "lorafleet.agent.calls"]
    assert [(line["call"], line["adapter"], line["outcome"]) for line in lines] == [
        ("load", "observed", "ok"),
        ("unload", "never-loaded", "not_found"),
        ("unload", "observed", "ok"),
    ]
    assert all(isinstance(line["duration_ms"], float) for line in lines)
    assert lines[0]["source"] == shared.adapters["ad3"].as_uri() and "is not loaded" in lines[1]["error"]

    text = urllib.request.urlopen(f"http://127.0.0.1:{shared.server.metrics_port}/metrics", timeout=10).read().decode()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and not line.startswith("#")}
    assert samples['lorafleet_agent_adapter_load_seconds_count{outcome="ok"}'] >= 1
    assert samples['lorafleet_agent_adapter_unload_seconds_count{outcome="ok"}'] >= 1
    assert samples['lorafleet_agent_failures_total{operation="unload",reason="not_found"}'] >= 1
    assert samples['lorafleet_agent_inference_requests_total{method="forward",outcome="ok"}'] >= 1
    assert samples['lorafleet_agent_inference_seconds_count{method="forward"}'] >= 1
    assert samples["lorafleet_agent_loaded_adapters"] == 0
    assert samples["lorafleet_agent_engine_up"] == 1
