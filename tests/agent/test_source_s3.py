"""s3:// sources against a real S3 server: versitygw (built by scripts/build-storage.sh) over a
temporary directory, objects put through the S3 API (signed PUTs).

An agent of its own (two ranks) loads an adapter from the store over gRPC; the hostile cases go
through the agent's real entry point (`resolve_source`) and each is refused with its reason,
with nothing left in the cache. Without the built binaries these tests fail (they never skip).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lorafleet.v1 import agent_pb2 as pb
from lorafleet_common.wire import REASON_METADATA_KEY
from lorafleet_dev.storage_servers import S3Keys, S3Server, start_s3_server
from node_agent.cli.main import build_parser, main
from node_agent.cli.serve import agent_config
from node_agent.errors import AgentError, SourceRefused
from node_agent.sources import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    Credential,
    S3Credential,
    SourceCredential,
    SourcePolicy,
    resolve_source,
    source_revision,
)
from tests.agent.helpers import make_adapter, rpc_error
from tests.agent.storage_agents import ServedAgent, assert_every_rank_read, file_sha256, held, served_agent

KEYS = S3Keys("LORAFLEETTESTKEY", "s3cr3t-never-shown")
BUCKET = "adapters"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_s3_server(tmp_path_factory.mktemp("s3"), KEYS)
    try:
        server.create_bucket(BUCKET)
        yield server
    finally:
        server.stop()


def policy(store: S3Server, cache: Path, **overrides: Any) -> SourcePolicy:
    """The agent's policy: the store as its endpoint, the bucket's team/ prefix allowed."""
    allowed = SourcePolicy(
        cache_dir=cache,
        allowed_sources=(f"s3://{BUCKET}/team",),
        allowed_networks=("127.0.0.0/8",),
        s3_endpoint=store.endpoint,
        s3_credential=S3Credential(KEYS.access_key_id, KEYS.secret_access_key),
    )
    return dataclasses.replace(allowed, **overrides)


@pytest.fixture(scope="module")
def served(store: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedAgent]:
    base = tmp_path_factory.mktemp("s3-agent")
    with served_agent(base, policy(store, base / "cache")) as served:
        yield served


def refused(uri: str, limits: SourcePolicy, reason: str, credential: Credential | None = None, sha256: str | None = None) -> AgentError:
    """The agent's refusal of `uri` with `reason`; nothing is left in the cache."""
    with pytest.raises(AgentError) as error:
        resolve_source(uri, sha256, limits, credential)
    assert error.value.reason == reason, str(error.value)
    assert limits.cache_dir is None or not any(Path(limits.cache_dir).glob("dl-*"))
    return error.value


def test_an_adapter_loads_from_the_store_on_every_rank(store: S3Server, served: ServedAgent, tmp_path: Path) -> None:
    adapter = make_adapter(tmp_path / "ad", seed=7)
    store.put_adapter(BUCKET, "team/loras/ad-7", adapter)
    reply = served.stub.LoadAdapter(pb.LoadAdapterRequest(name="from-s3", source_uri=f"s3://{BUCKET}/team/loras/ad-7"), timeout=120)
    assert_every_rank_read(reply, adapter)
    assert held(served.stub) == {"from-s3": file_sha256(adapter / ADAPTER_WEIGHTS)}
    served.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="from-s3"), timeout=60)


def test_each_objects_etag_is_recorded_and_new_content_is_a_new_revision(store: S3Server, tmp_path: Path) -> None:
    first, second = make_adapter(tmp_path / "a", seed=8), make_adapter(tmp_path / "b", seed=9)
    limits = policy(store, tmp_path / "cache")
    etags = store.put_adapter(BUCKET, "team/moving", first)
    source = resolve_source(f"s3://{BUCKET}/team/moving", file_sha256(first / ADAPTER_WEIGHTS), limits)
    assert source.revision == f"{ADAPTER_CONFIG} etag {etags[ADAPTER_CONFIG]}; {ADAPTER_WEIGHTS} etag {etags[ADAPTER_WEIGHTS]}"
    source.discard()
    new_etags = store.put_adapter(BUCKET, "team/moving", second)
    assert new_etags[ADAPTER_WEIGHTS] != etags[ADAPTER_WEIGHTS]
    again = resolve_source(f"s3://{BUCKET}/team/moving", None, limits)
    assert (again.content.weights_sha256, again.revision.endswith(new_etags[ADAPTER_WEIGHTS])) == (
        file_sha256(second / ADAPTER_WEIGHTS),
        True,
    )
    again.discard()
    # A load held to the first revision (the operator's record) is refused, its copy removed.
    with pytest.raises(AgentError) as error:
        resolve_source(f"s3://{BUCKET}/team/moving", None, limits, revision=source.revision)
    assert error.value.reason == "source_changed", str(error.value)
    assert not any(Path(str(limits.cache_dir)).glob("dl-*"))
    # The request's sha256 still holds the store to the content the caller expects.
    refused(f"s3://{BUCKET}/team/moving", limits, "sha256_mismatch", sha256=file_sha256(first / ADAPTER_WEIGHTS))


def test_without_the_right_key_the_store_refuses_and_no_secret_is_shown(
    store: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    store.put_adapter(BUCKET, "team/private", make_adapter(tmp_path / "ad", seed=10))
    uri = f"s3://{BUCKET}/team/private"
    anonymous = refused(uri, policy(store, tmp_path / "cache", s3_credential=None), "http_error")
    wrong = refused(uri, policy(store, tmp_path / "cache", s3_credential=S3Credential(KEYS.access_key_id, "not-the-secret")), "http_error")
    assert "HTTP 403" in str(anonymous) and "HTTP 403" in str(wrong)
    # A load's own credential wins over the agent's.
    resolve_source(
        uri, None, policy(store, tmp_path / "cache", s3_credential=None), S3Credential(KEYS.access_key_id, KEYS.secret_access_key)
    ).discard()
    credential = S3Credential(KEYS.access_key_id, KEYS.secret_access_key, "session-t0ken")
    assert KEYS.secret_access_key not in repr(credential) and "session-t0ken" not in repr(credential)
    for text in (caplog.text, str(anonymous), str(wrong), repr(policy(store, tmp_path))):
        assert KEYS.secret_access_key not in text and "not-the-secret" not in text


@pytest.mark.parametrize(
    "uri, reason",
    [
        (f"s3://{BUCKET}/team/../secret", "traversal"),
        (f"s3://{BUCKET}/team/%2e%2e/secret", "traversal"),
        (f"s3://{BUCKET}/team/x%2F..%2F..%2Fsecret", "traversal"),
        ("s3://127.0.0.1:1/adapters/team/x", "endpoint"),  # an endpoint in the URI, never used
        (f"s3://{BUCKET}/team/x?endpoint=http://127.0.0.1:1", "bad_uri"),
        (f"s3://{BUCKET}/other/x", "source_not_allowed"),
        ("s3://other-bucket/team/x", "source_not_allowed"),
    ],
)
def test_hostile_uris_are_refused_before_any_request(store: S3Server, tmp_path: Path, uri: str, reason: str) -> None:
    refused(uri, policy(store, tmp_path / "cache"), reason)


def test_a_hostile_uri_over_grpc_loads_nothing(served: ServedAgent) -> None:
    error = rpc_error(
        lambda: served.stub.LoadAdapter(pb.LoadAdapterRequest(name="evil", source_uri=f"s3://{BUCKET}/team/../x"), timeout=60)
    )
    assert "'.' and '..' segments are refused in S3 keys" in error.details()
    assert (REASON_METADATA_KEY, "traversal") in tuple(error.trailing_metadata())
    assert held(served.stub) == {}


def test_an_object_over_the_cap_is_refused(store: S3Server, tmp_path: Path) -> None:
    adapter = make_adapter(tmp_path / "ad", seed=11)
    store.put_adapter(BUCKET, "team/large", adapter)
    cap = (adapter / ADAPTER_WEIGHTS).stat().st_size - 1
    error = refused(f"s3://{BUCKET}/team/large", policy(store, tmp_path / "cache", max_download_bytes=cap), "too_large")
    assert f"over the {cap}-byte cap" in str(error)


def test_a_missing_object_is_not_found(store: S3Server, tmp_path: Path) -> None:
    store.put_object(BUCKET, f"team/half/{ADAPTER_CONFIG}", (make_adapter(tmp_path / "ad", seed=12) / ADAPTER_CONFIG).read_bytes())
    refused(f"s3://{BUCKET}/team/half", policy(store, tmp_path / "cache"), "source_not_found")


def test_a_link_local_endpoint_is_refused_by_the_address_rules(store: S3Server, tmp_path: Path) -> None:
    limits = policy(store, tmp_path / "cache", s3_endpoint="http://169.254.169.254")
    assert "link-local" in str(refused(f"s3://{BUCKET}/team/x", limits, "address_refused"))


def test_an_agent_without_an_endpoint_refuses_s3(tmp_path: Path) -> None:
    limits = SourcePolicy(cache_dir=tmp_path / "cache", allowed_sources=(f"s3://{BUCKET}/team",))
    refused(f"s3://{BUCKET}/team/x", limits, "no_s3_endpoint")


def test_each_scheme_takes_its_own_kind_of_credential(store: S3Server, tmp_path: Path) -> None:
    refused(f"s3://{BUCKET}/team/x", policy(store, tmp_path / "cache"), "credentials", SourceCredential.bearer("t0ken"))
    s3 = S3Credential(KEYS.access_key_id, KEYS.secret_access_key)
    limits = SourcePolicy(cache_dir=tmp_path / "cache", allowed_sources=("http://127.0.0.1:*/",))
    with pytest.raises(SourceRefused, match="http:// sources take a token or a user and password"):
        resolve_source("http://127.0.0.1:1/x", None, limits, s3)


def test_the_serve_flags_set_the_store_and_read_the_key_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"
    model.mkdir()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEYS.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", KEYS.secret_access_key)
    flags = ["serve", "--model", str(model), "--s3-endpoint", "http://10.0.0.5:9000", "--s3-region", "eu-west-1"]
    flags += [
        "--allow-source",
        f"s3://{BUCKET}/team",
        "--allow-source",
        "oci://Registry.example/team",
        "--oci-plain-http",
        "registry.example",
    ]
    sources = agent_config(build_parser().parse_args(flags)).sources
    assert (sources.s3_endpoint, sources.s3_region, sources.oci_plain_http) == ("http://10.0.0.5:9000", "eu-west-1", ("registry.example",))
    assert sources.s3_credential == S3Credential(KEYS.access_key_id, KEYS.secret_access_key)
    assert [(p.scheme, p.location, p.path) for p in sources.storage_prefixes] == [
        ("s3", BUCKET, "team"),
        ("oci", "registry.example", "team"),
    ]
    for flag, value in (("--allow-source", "s3://x/"), ("--allow-source", "oci://reg/../x"), ("--s3-endpoint", "ftp://x/")):
        assert main(["serve", "--model", str(model), flag, value]) == 2
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert main([*flags]) == 2  # a key without its secret


def test_resolve_source_answers_each_objects_etag_from_a_head(store: S3Server, served: ServedAgent, tmp_path: Path) -> None:
    """ResolveSource names the revision a load of the same objects records (their ETags, read
    by signed HEADs), which a load then holds the store to: loaded while it is true, refused
    (source_changed) once an object is overwritten."""
    first, second = make_adapter(tmp_path / "a", seed=13), make_adapter(tmp_path / "b", seed=14)
    etags = store.put_adapter(BUCKET, "team/resolved", first)
    uri = f"s3://{BUCKET}/team/resolved"
    revision = served.stub.ResolveSource(pb.ResolveSourceRequest(source_uri=uri), timeout=60).source_revision
    assert revision == f"{ADAPTER_CONFIG} etag {etags[ADAPTER_CONFIG]}; {ADAPTER_WEIGHTS} etag {etags[ADAPTER_WEIGHTS]}"
    reply = served.stub.LoadAdapter(pb.LoadAdapterRequest(name="resolved", source_uri=uri, source_revision=revision), timeout=120)
    assert_every_rank_read(reply, first)
    assert reply.source_revision == revision
    store.put_adapter(BUCKET, "team/resolved", second)
    assert served.stub.ResolveSource(pb.ResolveSourceRequest(source_uri=uri), timeout=60).source_revision != revision
    changed = pb.LoadAdapterRequest(name="changed", source_uri=uri, source_revision=revision)
    assert (REASON_METADATA_KEY, "source_changed") in tuple(
        rpc_error(lambda: served.stub.LoadAdapter(changed, timeout=120)).trailing_metadata()
    )
    assert held(served.stub) == {"resolved": file_sha256(first / ADAPTER_WEIGHTS)}
    served.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="resolved"), timeout=60)


@pytest.mark.parametrize(
    "request_, reason",
    [
        (pb.ResolveSourceRequest(source_uri=f"s3://{BUCKET}/team/../x"), "traversal"),
        (pb.ResolveSourceRequest(source_uri=f"s3://{BUCKET}/other/x"), "source_not_allowed"),
        (pb.ResolveSourceRequest(source_uri=f"s3://{BUCKET}/team/x", source_token="t0ken"), "credentials"),
        (pb.ResolveSourceRequest(source_uri=f"s3://{BUCKET}/team/nothing-here"), "source_not_found"),
        (pb.ResolveSourceRequest(source_uri="ftp://example.com/x"), "scheme"),
    ],
)
def test_resolve_source_refuses_as_a_load_does(served: ServedAgent, request_: pb.ResolveSourceRequest, reason: str) -> None:
    """The same checks and errors as a load's: traversal, a prefix not allowed, the wrong kind
    of credential, a missing object, a scheme no load takes."""
    error = rpc_error(lambda: served.stub.ResolveSource(request_, timeout=60))
    assert (REASON_METADATA_KEY, reason) in tuple(error.trailing_metadata()), error.details()


def test_resolve_source_with_a_wrong_key_is_refused_and_other_schemes_name_no_revision(
    store: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    store.put_adapter(BUCKET, "team/keyed", make_adapter(tmp_path / "ad", seed=15))
    wrong = S3Credential(KEYS.access_key_id, "not-the-s3cr3t")
    with pytest.raises(AgentError) as error:
        source_revision(f"s3://{BUCKET}/team/keyed", policy(store, tmp_path / "cache"), wrong)
    assert error.value.reason == "http_error" and "HTTP 403" in str(error.value)
    assert "not-the-s3cr3t" not in caplog.text and KEYS.secret_access_key not in caplog.text
    assert source_revision("https://example.com/adapter", policy(store, tmp_path / "cache")) == ""
    assert not any((tmp_path / "cache").glob("dl-*"))
