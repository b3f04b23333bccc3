"""s3:// sources signed with the pod's web identity, against a real S3 store with STS: SeaweedFS
(built by scripts/build-seaweedfs.sh) trusting a token issuer this test serves itself (OpenID
discovery and the JWKS of a key it generates), for one role that reads one bucket.

The agent holds no keys: it exchanges the projected token (a file it reads at each exchange) at
the store's STS (AssumeRoleWithWebIdentity) and signs its GETs with the temporary credentials.
A token signed by another key, an expired one or another subject's is refused by STS, with
nothing loaded and the token shown nowhere. Without the built binary these tests fail (they
never skip).
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from lorafleet.v1 import agent_pb2 as pb
from lorafleet_dev.storage_servers import S3Keys, S3Server
from lorafleet_dev.web_identity_servers import ROLE_ARN, OidcIssuer, start_sts_store
from node_agent.cli.main import build_parser, main
from node_agent.cli.serve import agent_config
from node_agent.errors import AgentError
from node_agent.sources import ADAPTER_WEIGHTS, SourcePolicy, WebIdentity, WebIdentityCredentials, resolve_source
from tests.agent.helpers import make_adapter
from tests.agent.storage_agents import assert_every_rank_read, file_sha256, held, served_agent

KEYS = S3Keys("LORAFLEETADMINKEY", "admin-s3cr3t-never-shown")
BUCKET = "adapters"
LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)


@pytest.fixture(scope="module")
def issuer() -> Iterator[OidcIssuer]:
    server = OidcIssuer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def store(issuer: OidcIssuer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_sts_store(tmp_path_factory.mktemp("sts"), KEYS, issuer, BUCKET)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def adapter_uri(store: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """An adapter in the bucket the role may read, and its directory."""
    adapter = make_adapter(tmp_path_factory.mktemp("adapter") / "ad", seed=21)
    store.put_adapter(BUCKET, "team/loras/ad-21", adapter)
    return f"s3://{BUCKET}/team/loras/ad-21", adapter


def identity(store: S3Server, token_file: Path) -> WebIdentityCredentials:
    """The agent's web identity: the token file, the role, the store's STS (on loopback)."""
    return WebIdentityCredentials(WebIdentity(token_file, ROLE_ARN, store.endpoint, networks=LOOPBACK))


def policy(store: S3Server, cache: Path, web_identity: WebIdentityCredentials | None) -> SourcePolicy:
    """The agent's policy: the store, the bucket's team/ prefix, no keys of its own."""
    return SourcePolicy(
        cache_dir=cache,
        allowed_sources=(f"s3://{BUCKET}/team",),
        allowed_networks=("127.0.0.0/8",),
        s3_endpoint=store.endpoint,
        s3_web_identity=web_identity,
    )


def token_file(path: Path, token: str) -> Path:
    path.write_text(token + "\n")
    return path


def refused(uri: str, limits: SourcePolicy, reason: str) -> AgentError:
    """The agent's refusal of `uri` with `reason`; nothing is left in the cache."""
    with pytest.raises(AgentError) as error:
        resolve_source(uri, None, limits)
    assert error.value.reason == reason, str(error.value)
    assert not any(Path(str(limits.cache_dir)).glob("dl-*"))
    return error.value


def test_an_adapter_loads_with_the_pods_web_identity(
    store: S3Server, issuer: OidcIssuer, adapter_uri: tuple[str, Path], tmp_path: Path
) -> None:
    uri, adapter = adapter_uri
    # Without keys or an identity the store refuses: what the identity brings is the only key.
    refused(uri, policy(store, tmp_path / "cache", None), "http_error")
    web_identity = identity(store, token_file(tmp_path / "token", issuer.token()))
    with served_agent(tmp_path / "agent", policy(store, tmp_path / "agent-cache", web_identity)) as served:
        # The operator's resolution before its loads signs its HEADs with the same identity.
        resolved = served.stub.ResolveSource(pb.ResolveSourceRequest(source_uri=uri), timeout=60)
        reply = served.stub.LoadAdapter(pb.LoadAdapterRequest(name="by-identity", source_uri=uri), timeout=120)
        assert_every_rank_read(reply, adapter)
        assert held(served.stub) == {"by-identity": file_sha256(adapter / ADAPTER_WEIGHTS)}
        assert resolved.source_revision and resolved.source_revision == reply.source_revision
    # The store checked the token against the keys the issuer publishes.
    assert "/keys" in issuer.seen


def test_credentials_are_kept_until_near_expiry_and_the_token_file_is_read_again(
    store: S3Server, issuer: OidcIssuer, adapter_uri: tuple[str, Path], tmp_path: Path
) -> None:
    uri, _ = adapter_uri
    later = [0.0]  # how far the agent's clock is moved on (the store's credentials last an hour)
    path = token_file(tmp_path / "token", issuer.token())
    web_identity = WebIdentityCredentials(
        WebIdentity(path, ROLE_ARN, store.endpoint, networks=LOOPBACK), clock=lambda: time.time() + later[0]
    )
    first = web_identity.current()
    # A rotated token in the file is not read while the credentials hold ...
    token_file(path, issuer.token(key=ec.generate_private_key(ec.SECP256R1())))
    assert web_identity.current() is first
    resolve_source(uri, None, policy(store, tmp_path / "cache", web_identity)).discard()
    # ... and is read when they are renewed: this one is refused, and no credential is kept.
    later[0] = 86400.0
    with pytest.raises(AgentError) as error:
        web_identity.current()
    assert error.value.reason == "web_identity", str(error.value)
    token_file(path, issuer.token())
    assert web_identity.current() != first


# What STS answers each token it does not trust (SeaweedFS's codes, AWS's names).
REFUSALS = {
    "another key": "HTTP 400 InvalidParameterValue",
    "expired": "HTTP 400 ExpiredTokenException",
    "another subject": "HTTP 403 AccessDenied",
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_token_sts_does_not_trust_is_refused_and_nothing_loads(
    store: S3Server, issuer: OidcIssuer, adapter_uri: tuple[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    caplog.set_level(logging.DEBUG)
    token = {
        "another key": lambda: issuer.token(key=ec.generate_private_key(ec.SECP256R1())),
        "expired": lambda: issuer.token(expires_in_s=-120),
        "another subject": lambda: issuer.token("system:serviceaccount:team-b:intruder"),
    }[case]()
    limits = policy(store, tmp_path / "cache", identity(store, token_file(tmp_path / "token", token)))
    error = refused(adapter_uri[0], limits, "web_identity")
    assert str(error).endswith(f"refused the pod's web identity for {ROLE_ARN}: {REFUSALS[case]}")
    for text in (str(error), caplog.text, repr(limits)):
        assert token not in text and token.rpartition(".")[2] not in text


def test_an_unreadable_token_file_and_a_link_local_sts_are_refused(store: S3Server, adapter_uri: tuple[str, Path], tmp_path: Path) -> None:
    error = refused(adapter_uri[0], policy(store, tmp_path / "cache", identity(store, tmp_path / "absent")), "web_identity")
    assert "token file" in str(error)
    metadata = WebIdentityCredentials(WebIdentity(token_file(tmp_path / "token", "t0ken"), ROLE_ARN, "http://169.254.169.254"))
    assert "link-local" in str(refused(adapter_uri[0], policy(store, tmp_path / "cache", metadata), "address_refused"))


def test_the_serve_flags_take_the_pods_identity_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ROLE_SESSION_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "token"))
    monkeypatch.setenv("AWS_ROLE_ARN", ROLE_ARN)
    flags = ["serve", "--model", str(model), "--s3-endpoint", "https://s3.eu-west-1.amazonaws.com", "--s3-region", "eu-west-1"]
    sources = agent_config(build_parser().parse_args([*flags, "--s3-web-identity"])).sources
    assert isinstance(sources.s3_web_identity, WebIdentityCredentials)
    assert sources.s3_web_identity.identity == WebIdentity(tmp_path / "token", ROLE_ARN, "https://sts.eu-west-1.amazonaws.com")
    assert agent_config(build_parser().parse_args(flags)).sources.s3_web_identity is None  # off unless asked for
    private = agent_config(
        build_parser().parse_args(
            [*flags, "--s3-web-identity", "--s3-sts-endpoint", "https://sts.internal", "--allow-source-network", "10.0.0.0/8"]
        )
    ).sources.s3_web_identity
    assert isinstance(private, WebIdentityCredentials)
    assert (private.identity.sts_endpoint, private.identity.networks) == ("https://sts.internal", (ipaddress.ip_network("10.0.0.0/8"),))
    assert main([*flags, "--s3-web-identity", "--s3-sts-endpoint", "ftp://sts.internal"]) == 2
    assert main([*flags, "--s3-sts-endpoint", "https://sts.internal"]) == 2  # without --s3-web-identity
    assert main(["serve", "--model", str(model), "--s3-web-identity"]) == 2  # without a store
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEYS.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", KEYS.secret_access_key)
    assert main([*flags, "--s3-web-identity"]) == 2  # two credentials
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.delenv("AWS_ROLE_ARN")
    assert main([*flags, "--s3-web-identity"]) == 2  # the pod was given no role
