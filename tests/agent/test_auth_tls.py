"""Bearer tokens, TLS and mutual TLS, and the plaintext health-only listener: extra servers over the
shared agent (no new engine); the engine start-up timeout flag."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from lorafleet_common.identity import NONCE_BYTES, proof_matches
from lorafleet_dev.pki import Authority
from node_agent.auth import TlsFiles
from node_agent.cli import main
from node_agent.server import AgentServer, ServerOptions, create_server
from tests.agent.helpers import make_model, rpc_error

TOKEN = "0123456789abcdef-token"


@contextmanager
def extra_server(shared, **options) -> Iterator[AgentServer]:
    server = create_server(shared.agent, ServerOptions(**options))
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=0)


def every_rpc(stub: agent_pb2_grpc.NodeAgentStub, metadata) -> dict[str, callable]:
    """One call of each NodeAgent method (each valid, so only auth can refuse it)."""
    return {
        "Describe": lambda: stub.Describe(pb.DescribeRequest(), metadata=metadata, timeout=30),
        "ListAdapters": lambda: stub.ListAdapters(pb.ListAdaptersRequest(), metadata=metadata, timeout=30),
        "AdapterStats": lambda: stub.AdapterStats(pb.AdapterStatsRequest(), metadata=metadata, timeout=30),
        "LoadAdapter": lambda: stub.LoadAdapter(pb.LoadAdapterRequest(name="auth", source_uri="s3://x"), metadata=metadata, timeout=30),
        "LoadAdapters": lambda: stub.LoadAdapters(
            pb.LoadAdaptersRequest(loads=[pb.LoadAdapterRequest(name="auth", source_uri="s3://x")]), metadata=metadata, timeout=30
        ),
        "UnloadAdapter": lambda: stub.UnloadAdapter(pb.UnloadAdapterRequest(name="auth"), metadata=metadata, timeout=30),
        "Forward": lambda: stub.Forward(pb.ForwardRequest(sequences=[pb.Sequence(token_ids=[1])]), metadata=metadata, timeout=30),
        "Generate": lambda: list(stub.Generate(pb.GenerateRequest(token_ids=[1], max_new_tokens=1), metadata=metadata, timeout=30)),
    }


@pytest.mark.parametrize(
    "metadata, phrase",
    [
        (None, "missing credentials"),
        ((("authorization", "Bearer wrong"),), "invalid bearer token"),
        ((("authorization", TOKEN),), "invalid bearer token"),
        ((("authorization", f"Basic {TOKEN}"),), "invalid bearer token"),
    ],
    ids=["no-token", "wrong-token", "no-scheme", "basic-scheme"],
)
def test_every_method_but_health_needs_the_bearer_token(shared, metadata, phrase):
    with extra_server(shared, auth_token=TOKEN) as server, grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = agent_pb2_grpc.NodeAgentStub(channel)
        for method, call in every_rpc(stub, metadata).items():
            error = rpc_error(call)
            assert (method, error.code(), phrase in error.details()) == (method, grpc.StatusCode.UNAUTHENTICATED, True)
        with pytest.raises(grpc.RpcError) as refused:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health stays open: kubelet's gRPC probes cannot send metadata.
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING


def test_the_right_token_is_accepted(shared):
    with extra_server(shared, auth_token=TOKEN) as server, grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        calls = every_rpc(agent_pb2_grpc.NodeAgentStub(channel), (("authorization", f"Bearer {TOKEN}"),))
        assert calls["Describe"]().agent_id == "agent-under-test"
        assert len(calls["Forward"]().logits) == 1 and len(calls["Generate"]()) == 1
        assert calls["ListAdapters"]() is not None
        # Past auth, the agent's own answers: an s3 source is refused, an unknown adapter not found.
        assert rpc_error(calls["LoadAdapter"]).code() == grpc.StatusCode.INVALID_ARGUMENT
        assert rpc_error(calls["UnloadAdapter"]).code() == grpc.StatusCode.NOT_FOUND


def test_an_agent_proves_it_holds_the_token_without_being_sent_it(shared):
    """ProveIdentity needs no token (the client asks before it sends one) and answers the MAC of
    the client's pod name and nonce under the token: right for those only; an agent without a
    token has nothing to prove with (an empty proof)."""
    nonce, other = b"\x01" * NONCE_BYTES, b"\x02" * NONCE_BYTES
    with extra_server(shared, auth_token=TOKEN) as server, grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = agent_pb2_grpc.NodeAgentStub(channel)
        proof = stub.ProveIdentity(pb.ProveIdentityRequest(nonce=nonce, pod="ns/agent-0"), timeout=30).proof
        assert proof_matches(TOKEN, "ns/agent-0", nonce, proof)
        assert not proof_matches(TOKEN, "ns/agent-0", other, proof) and not proof_matches(TOKEN, "ns/agent-1", nonce, proof)
        assert not proof_matches("another-token", "ns/agent-0", nonce, proof)
        short = rpc_error(lambda: stub.ProveIdentity(pb.ProveIdentityRequest(nonce=b"x"), timeout=30))
        assert short.code() == grpc.StatusCode.INVALID_ARGUMENT and f"{NONCE_BYTES}-byte" in short.details()
    with extra_server(shared) as server, grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = agent_pb2_grpc.NodeAgentStub(channel)
        assert stub.ProveIdentity(pb.ProveIdentityRequest(nonce=nonce, pod="ns/agent-0"), timeout=30).proof == b""


def test_an_agent_that_knows_its_pod_answers_no_relayed_challenge(shared):
    """With --pod-name, a challenge for another pod (an impostor relaying the operator's nonce to a
    real agent) gets no proof; its own pod's challenge is answered."""
    nonce = b"\x03" * NONCE_BYTES
    with (
        extra_server(shared, auth_token=TOKEN, pod_name="ns/agent-0") as server,
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = agent_pb2_grpc.NodeAgentStub(channel)
        assert stub.ProveIdentity(pb.ProveIdentityRequest(nonce=nonce, pod="ns/impostor"), timeout=30).proof == b""
        own = stub.ProveIdentity(pb.ProveIdentityRequest(nonce=nonce, pod="ns/agent-0"), timeout=30).proof
        assert proof_matches(TOKEN, "ns/agent-0", nonce, own)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path | bytes]:
    directory = tmp_path_factory.mktemp("pki")
    ca, other_ca = Authority("lorafleet test CA"), Authority("someone else")
    server = ca.issue("agent", server=True)
    (directory / "server.crt").write_bytes(server.cert)
    (directory / "server.key").write_bytes(server.key)
    (directory / "ca.crt").write_bytes(ca.pem)
    client, stranger = ca.issue("operator", server=False), other_ca.issue("operator", server=False)
    return {"dir": directory, "ca": ca.pem, "other_ca": other_ca.pem, "client": client, "stranger": stranger}


def describe_over(port: int, credentials: grpc.ChannelCredentials) -> pb.DescribeResponse:
    with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
        return agent_pb2_grpc.NodeAgentStub(channel).Describe(pb.DescribeRequest(), timeout=10)


def test_tls_serves_clients_that_trust_its_ca_only(shared, pki):
    tls = TlsFiles(pki["dir"] / "server.crt", pki["dir"] / "server.key")
    with extra_server(shared, tls=tls) as server:
        assert describe_over(server.port, grpc.ssl_channel_credentials(pki["ca"])).agent_id == "agent-under-test"
        untrusted = grpc.ssl_channel_credentials(pki["other_ca"])
        assert rpc_error(lambda: describe_over(server.port, untrusted)).code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as plain:
            error = rpc_error(lambda: agent_pb2_grpc.NodeAgentStub(plain).Describe(pb.DescribeRequest(), timeout=10))
            assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate_from_the_client_ca(shared, pki):
    tls = TlsFiles(pki["dir"] / "server.crt", pki["dir"] / "server.key", pki["dir"] / "ca.crt")
    with extra_server(shared, tls=tls, auth_token=TOKEN) as server:
        client, stranger = pki["client"], pki["stranger"]
        with_cert = grpc.ssl_channel_credentials(pki["ca"], client.key, client.cert)
        token = grpc.access_token_call_credentials(TOKEN)  # sends "authorization: Bearer <token>"
        assert describe_over(server.port, grpc.composite_channel_credentials(with_cert, token)).agent_id == "agent-under-test"
        assert rpc_error(lambda: describe_over(server.port, with_cert)).code() == grpc.StatusCode.UNAUTHENTICATED
        without_cert = grpc.composite_channel_credentials(grpc.ssl_channel_credentials(pki["ca"]), token)
        assert rpc_error(lambda: describe_over(server.port, without_cert)).code() == grpc.StatusCode.UNAVAILABLE
        foreign = grpc.composite_channel_credentials(grpc.ssl_channel_credentials(pki["ca"], stranger.key, stranger.cert), token)
        assert rpc_error(lambda: describe_over(server.port, foreign)).code() == grpc.StatusCode.UNAVAILABLE


def test_a_plaintext_health_listener_answers_probes_under_mutual_tls_and_serves_nothing_else(shared, pki):
    tls = TlsFiles(pki["dir"] / "server.crt", pki["dir"] / "server.key", pki["dir"] / "ca.crt")
    with extra_server(shared, tls=tls, auth_token=TOKEN, health_listen="127.0.0.1:0") as server:
        assert server.health_port is not None and server.health_port != server.port
        with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as plain:
            # What kubelet's gRPC probe sends: plaintext, no token, the agent's service name.
            health = health_pb2_grpc.HealthStub(plain)
            for service in ("", "lorafleet.v1.NodeAgent"):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = agent_pb2_grpc.NodeAgentStub(plain)
            for method, call in every_rpc(stub, (("authorization", f"Bearer {TOKEN}"),)).items():
                assert (method, rpc_error(call).code()) == (method, grpc.StatusCode.UNIMPLEMENTED)
            with pytest.raises(grpc.RpcError) as no_reflection:
                ProtoReflectionDescriptorDatabase(plain).get_services()
            assert no_reflection.value.code() == grpc.StatusCode.UNIMPLEMENTED
        server.stop(grace=0)
        with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as plain:
            error = rpc_error(lambda: health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5))
            assert error.code() == grpc.StatusCode.UNAVAILABLE, "the health listener stops with the server"


def test_the_engine_start_up_timeout_is_a_flag_and_its_expiry_names_it(tmp_path, capsys):
    model = make_model(tmp_path / "model", tokenizer=False)
    (tmp_path / "in.json").write_text('[{"tokens": [1, 2]}]')
    command = ["forward", "--model", str(model), "--input", str(tmp_path / "in.json"), "--output", str(tmp_path / "out")]
    assert main([*command, "--engine-startup-timeout-s", "0"]) == 2
    assert "--engine-startup-timeout-s must be positive" in capsys.readouterr().err
    # Spawned ranks import torch before they answer: far longer than a millisecond.
    assert main([*command, "--engine-startup-timeout-s", "0.001"]) == 1
    err = capsys.readouterr().err
    assert "start timed out after 0.001s (the engine's start-up timeout, --engine-startup-timeout-s)" in err, err
