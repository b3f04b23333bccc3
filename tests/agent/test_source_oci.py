"""oci:// sources against a real registry: distribution's ``registry`` (built by
scripts/build-storage.sh) on loopback, artifacts pushed with the real ``oras`` client.

An agent of its own (two ranks) loads an artifact over gRPC; the other cases go through the
agent's real entry point (`resolve_source`). A registry that lies about content is the real
registry behind `Tampering`, a loopback proxy that changes the bytes it passes on. Without the
built binaries these tests fail (they never skip).
"""

from __future__ import annotations

import dataclasses
import http.server
import io
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from lorafleet.v1 import agent_pb2 as pb
from lorafleet_common.wire import REASON_METADATA_KEY
from lorafleet_dev.storage_servers import CONFIG_MEDIA_TYPE, RegistryServer, TokenService, start_registry
from node_agent.errors import AgentError, SourceNotFound
from node_agent.sources import ADAPTER_CONFIG, ADAPTER_WEIGHTS, SourceCredential, SourcePolicy, resolve_source, source_revision
from tests.agent.helpers import make_adapter, rpc_error, running
from tests.agent.storage_agents import ServedAgent, assert_every_rank_read, file_sha256, held, registry_answer, send_body, served_agent

LOGIN = ("puller", "pull-pa55-never-shown")


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    server = start_registry(tmp_path_factory.mktemp("registry"))
    try:
        yield server
    finally:
        server.stop()


def policy(registries: tuple[str, ...], cache: Path, **overrides: Any) -> SourcePolicy:
    """The agent's policy: each registry's team/ repositories allowed, over plain HTTP."""
    allowed = SourcePolicy(
        cache_dir=cache,
        allowed_sources=tuple(f"oci://{registry}/team" for registry in registries),
        allowed_networks=("127.0.0.0/8",),
        oci_plain_http=registries,
    )
    return dataclasses.replace(allowed, **overrides)


@pytest.fixture(scope="module")
def tokens() -> Iterator[TokenService]:
    service = TokenService(*LOGIN)
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def private(tokens: TokenService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    """A registry that takes only its token service's tokens (as Docker Hub, GHCR, Harbor do)."""
    server = start_registry(tmp_path_factory.mktemp("private-registry"), tokens, LOGIN)
    try:
        yield server
    finally:
        server.stop()


def with_token_service(limits: SourcePolicy) -> SourcePolicy:
    """`limits`, and the token service's loopback address allowed as an http(s) source."""
    return dataclasses.replace(limits, allowed_sources=(*limits.allowed_sources, "http://127.0.0.1:*/token"))


@pytest.fixture(scope="module")
def served(registry: RegistryServer, private: RegistryServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedAgent]:
    base = tmp_path_factory.mktemp("oci-agent")
    with served_agent(base, with_token_service(policy((registry.address, private.address), base / "cache"))) as served:
        yield served


def refused(uri: str, limits: SourcePolicy, reason: str) -> AgentError:
    """The agent's refusal of `uri` with `reason`; nothing is left in the cache."""
    with pytest.raises(AgentError) as error:
        resolve_source(uri, None, limits)
    assert error.value.reason == reason, str(error.value)
    assert limits.cache_dir is None or not any(Path(limits.cache_dir).glob("dl-*"))
    return error.value


def test_an_artifact_pushed_with_oras_loads_on_every_rank(registry: RegistryServer, served: ServedAgent, tmp_path: Path) -> None:
    adapter = make_adapter(tmp_path / "ad", seed=21)
    digest = registry.push_adapter("team/lora", "v1", adapter)
    for name, uri in (("by-tag", f"oci://{registry.address}/team/lora:v1"), ("by-digest", f"oci://{registry.address}/team/lora@{digest}")):
        reply = served.stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source_uri=uri), timeout=120)
        assert_every_rank_read(reply, adapter)
    assert held(served.stub) == dict.fromkeys(("by-tag", "by-digest"), file_sha256(adapter / ADAPTER_WEIGHTS))
    for name in ("by-tag", "by-digest"):
        served.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=60)


def test_a_registry_that_wants_a_token_gets_one_for_the_loads_credential(
    private: RegistryServer, tokens: TokenService, served: ServedAgent, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    adapter = make_adapter(tmp_path / "ad", seed=28)
    private.push_adapter("team/secret", "v1", adapter)
    uri = f"oci://{private.address}/team/secret:v1"
    anonymous = rpc_error(lambda: served.stub.LoadAdapter(pb.LoadAdapterRequest(name="private", source_uri=uri), timeout=60))
    assert (REASON_METADATA_KEY, "http_error") in tuple(anonymous.trailing_metadata()) and "HTTP 401" in anonymous.details()
    tokens.seen.clear()
    basic = pb.SourceBasicAuth(username=LOGIN[0], password=LOGIN[1])
    reply = served.stub.LoadAdapter(pb.LoadAdapterRequest(name="private", source_uri=uri, source_basic=basic), timeout=120)
    assert_every_rank_read(reply, adapter)
    # The password went to the token service alone, for a pull token of this repository.
    assert [(query, auth is not None) for query, auth in tokens.seen] == [
        ("scope=repository%3Ateam%2Fsecret%3Apull&service=lorafleet-test-registry", True)
    ]
    assert LOGIN[1] not in caplog.text and LOGIN[1] not in anonymous.details()
    served.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="private"), timeout=60)


def test_a_token_service_the_owner_does_not_allow_is_refused(private: RegistryServer, tokens: TokenService, tmp_path: Path) -> None:
    private.push_adapter("team/secret", "v2", make_adapter(tmp_path / "ad", seed=29))
    tokens.seen.clear()
    with pytest.raises(AgentError) as error:
        resolve_source(
            f"oci://{private.address}/team/secret:v2", None, policy((private.address,), tmp_path / "cache"), SourceCredential.basic(*LOGIN)
        )
    assert error.value.reason == "registry_auth" and tokens.seen == []


def test_a_hostile_repository_over_grpc_loads_nothing(registry: RegistryServer, served: ServedAgent) -> None:
    uri = f"oci://{registry.address}/team/../private/lora:v1"
    error = rpc_error(lambda: served.stub.LoadAdapter(pb.LoadAdapterRequest(name="evil", source_uri=uri), timeout=60))
    assert (REASON_METADATA_KEY, "traversal") in tuple(error.trailing_metadata())
    assert held(served.stub) == {}


def test_a_tag_is_resolved_once_and_the_digest_pins_the_content(registry: RegistryServer, tmp_path: Path) -> None:
    first, second = make_adapter(tmp_path / "a", seed=22), make_adapter(tmp_path / "b", seed=23)
    limits = policy((registry.address,), tmp_path / "cache")
    first_digest = registry.push_adapter("team/moving", "stable", first)
    resolved = resolve_source(f"oci://{registry.address}/team/moving:stable", None, limits)
    assert resolved.revision == first_digest  # what status records and every agent then fetches
    resolved.discard()
    second_digest = registry.push_adapter("team/moving", "stable", second)  # the tag moves
    assert second_digest != first_digest
    pinned = resolve_source(f"oci://{registry.address}/team/moving@{first_digest}", None, limits)
    assert (pinned.revision, pinned.content.weights_sha256) == (first_digest, file_sha256(first / ADAPTER_WEIGHTS))
    pinned.discard()
    moved = resolve_source(f"oci://{registry.address}/team/moving:stable", None, limits)
    assert (moved.revision, moved.content.weights_sha256) == (second_digest, file_sha256(second / ADAPTER_WEIGHTS))
    moved.discard()
    # A load held to the digest the tag was first resolved to (the operator's record): refused,
    # before any layer is fetched; held to the digest it names now, loaded.
    with pytest.raises(AgentError) as error:
        resolve_source(f"oci://{registry.address}/team/moving:stable", None, limits, revision=first_digest)
    assert (error.value.reason, f"names {second_digest} now, not {first_digest}" in str(error.value)) == ("tag_moved", True)
    assert not any(Path(str(limits.cache_dir)).glob("dl-*"))
    resolve_source(f"oci://{registry.address}/team/moving:stable", None, limits, revision=second_digest).discard()


def test_a_digest_the_registry_does_not_hold_is_not_found(registry: RegistryServer, tmp_path: Path) -> None:
    registry.push_adapter("team/lora", "v1", make_adapter(tmp_path / "ad", seed=24))
    with pytest.raises(SourceNotFound):
        resolve_source(f"oci://{registry.address}/team/lora@sha256:{'0' * 64}", None, policy((registry.address,), tmp_path / "cache"))


def test_a_pickle_file_or_a_missing_layer_is_refused(registry: RegistryServer, tmp_path: Path) -> None:
    adapter = make_adapter(tmp_path / "ad", seed=25)
    shutil.copy(adapter / ADAPTER_WEIGHTS, adapter / "adapter_model.bin")
    registry.push_artifact(
        "team/pickled", "v1", adapter, {ADAPTER_CONFIG: CONFIG_MEDIA_TYPE, "adapter_model.bin": "application/octet-stream"}
    )
    registry.push_artifact("team/half", "v1", adapter, {ADAPTER_CONFIG: CONFIG_MEDIA_TYPE})
    limits = policy((registry.address,), tmp_path / "cache")
    assert "pickle" in str(refused(f"oci://{registry.address}/team/pickled:v1", limits, "pickle"))
    assert "exactly two layers" in str(refused(f"oci://{registry.address}/team/half:v1", limits, "bad_manifest"))


def test_a_layer_over_the_cap_is_refused_before_it_is_fetched(registry: RegistryServer, tmp_path: Path) -> None:
    adapter = make_adapter(tmp_path / "ad", seed=26)
    registry.push_adapter("team/large", "v1", adapter)
    cap = (adapter / ADAPTER_WEIGHTS).stat().st_size - 1
    error = refused(
        f"oci://{registry.address}/team/large:v1", policy((registry.address,), tmp_path / "cache", max_download_bytes=cap), "too_large"
    )
    assert f"over the {cap}-byte cap" in str(error)


@pytest.mark.parametrize(
    "repository, reason",
    [
        ("team/../private/lora:v1", "traversal"),
        ("team/%2e%2e/lora:v1", "traversal"),
        ("other/lora:v1", "source_not_allowed"),
        ("team/Lora:v1", "bad_uri"),
        ("team/lora:v1?ns=evil.example", "bad_uri"),
    ],
)
def test_hostile_repository_names_are_refused(registry: RegistryServer, tmp_path: Path, repository: str, reason: str) -> None:
    refused(f"oci://{registry.address}/{repository}", policy((registry.address,), tmp_path / "cache"), reason)


def test_a_link_local_registry_is_refused_by_the_address_rules(tmp_path: Path) -> None:
    limits = policy(("169.254.169.254",), tmp_path / "cache")
    assert "link-local" in str(refused("oci://169.254.169.254/team/lora:v1", limits, "address_refused"))


class Tampering(http.server.ThreadingHTTPServer):
    """Passes GETs on to the real registry and changes what comes back: ``blobs`` flips a byte
    of every blob, ``manifests`` adds a byte to every manifest, ``redirect`` sends every blob
    request to the cloud metadata address."""

    daemon_threads = True

    def __init__(self, registry: RegistryServer, target: str) -> None:
        super().__init__(("127.0.0.1", 0), _TamperingHandler)
        self.registry, self.target = registry, target

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


class _TamperingHandler(http.server.BaseHTTPRequestHandler):
    server: Tampering

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.server.target == "redirect" and "/blobs/" in self.path:
            self.send_response(307)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
            self.end_headers()
            return
        answer = registry_answer(self.server.registry, self)
        if answer is None:
            return
        body, kind = answer
        if f"/{self.server.target}/" in self.path:
            body = body[:-1] + bytes([body[-1] ^ 1]) if self.server.target == "blobs" else body + b"\n"
        send_body(self, body, kind)


@pytest.mark.parametrize("target", ["blobs", "manifests"])
def test_content_that_does_not_match_its_digest_is_refused(registry: RegistryServer, tmp_path: Path, target: str) -> None:
    digest = registry.push_adapter("team/lied", "v1", make_adapter(tmp_path / "ad", seed=27))
    with running(Tampering(registry, target)) as tampering:
        limits = policy((tampering.address,), tmp_path / "cache")
        error = refused(f"oci://{tampering.address}/team/lied@{digest}", limits, "digest_mismatch")
    assert "does not match" in str(error)


def tar_gz(files: dict[str, bytes], links: tuple[str, ...] = ()) -> bytes:
    """A tar+gzip layer holding `files` (member name -> bytes) and symlinks named `links`."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as layer:
        for name, data in files.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            layer.addfile(member, io.BytesIO(data))
        for name in links:
            link = tarfile.TarInfo(name)
            link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
            layer.addfile(link)
    return out.getvalue()


def kaito_files(adapter: Path) -> dict[str, bytes]:
    """The adapter's files where KAITO's adapter images keep them (/data)."""
    return {f"data/{name}": (adapter / name).read_bytes() for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)}


def test_an_image_holding_the_files_loads_on_every_rank(registry: RegistryServer, served: ServedAgent, tmp_path: Path) -> None:
    adapter = make_adapter(tmp_path / "ad", seed=30)
    digest = registry.push_image("team/kaito", "v1", tar_gz({"data/README.md": b"not read", **kaito_files(adapter)}))
    reply = served.stub.LoadAdapter(
        pb.LoadAdapterRequest(name="image", source_uri=f"oci://{registry.address}/team/kaito@{digest}"), timeout=120
    )
    assert_every_rank_read(reply, adapter)
    served.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="image"), timeout=60)


@pytest.mark.parametrize("case", ["pickle", "link", "twice", "missing", "over-cap"])
def test_hostile_images_are_refused(registry: RegistryServer, tmp_path: Path, case: str) -> None:
    adapter = make_adapter(tmp_path / "ad", seed=31)
    files, weights = kaito_files(adapter), (adapter / ADAPTER_WEIGHTS).read_bytes()
    layer, reason, cap = {
        "pickle": (tar_gz({**files, "data/adapter_model.bin": weights}), "pickle", None),
        "link": (
            tar_gz({f"data/{ADAPTER_CONFIG}": files[f"data/{ADAPTER_CONFIG}"]}, links=(f"data/{ADAPTER_WEIGHTS}",)),
            "bad_layer",
            None,
        ),
        "twice": (tar_gz({**files, ADAPTER_WEIGHTS: weights}), "bad_layer", None),
        "missing": (tar_gz({f"data/{ADAPTER_CONFIG}": files[f"data/{ADAPTER_CONFIG}"]}), "bad_manifest", None),
        "over-cap": (tar_gz(files), "too_large", len(weights) - 1),
    }[case]
    digest = registry.push_image("team/hostile", case, layer)
    limits = policy((registry.address,), tmp_path / "cache")
    refused(
        f"oci://{registry.address}/team/hostile@{digest}",
        limits if cap is None else dataclasses.replace(limits, max_download_bytes=cap),
        reason,
    )


@pytest.mark.parametrize("allowed, reason", [((), "source_not_allowed"), (("http://169.254.169.254/",), "address_refused")])
def test_a_blob_redirect_to_a_link_local_address_is_refused(
    registry: RegistryServer, tmp_path: Path, allowed: tuple[str, ...], reason: str
) -> None:
    """A redirect must lie under an http(s) prefix; even one the owner allowed by mistake is
    refused at the connection, by the address rules."""
    digest = registry.push_adapter("team/redirected", "v1", make_adapter(tmp_path / "ad", seed=32))
    with running(Tampering(registry, "redirect")) as tampering:
        limits = policy((tampering.address,), tmp_path / "cache")
        limits = dataclasses.replace(limits, allowed_sources=(*limits.allowed_sources, *allowed))
        refused(f"oci://{tampering.address}/team/redirected@{digest}", limits, reason)


def test_resolve_source_answers_a_tags_digest_from_its_manifest_alone(
    registry: RegistryServer, served: ServedAgent, tmp_path: Path
) -> None:
    """ResolveSource names the digest a tag names now, the one a load then holds the tag to; it
    reads the manifest alone: through a proxy that spoils every blob, the digest still comes
    back (a load through it is refused), and it leaves nothing in the cache."""
    first, second = make_adapter(tmp_path / "a", seed=33), make_adapter(tmp_path / "b", seed=34)
    first_digest = registry.push_adapter("team/resolved", "stable", first)
    uri = f"oci://{registry.address}/team/resolved:stable"
    resolved = served.stub.ResolveSource(pb.ResolveSourceRequest(source_uri=uri), timeout=60)
    assert resolved.source_revision == first_digest
    second_digest = registry.push_adapter("team/resolved", "stable", second)  # the tag moves
    assert served.stub.ResolveSource(pb.ResolveSourceRequest(source_uri=uri), timeout=60).source_revision == second_digest
    load = pb.LoadAdapterRequest(name="moved", source_uri=uri, source_revision=first_digest)
    moved = rpc_error(lambda: served.stub.LoadAdapter(load, timeout=60))
    assert (REASON_METADATA_KEY, "tag_moved") in tuple(moved.trailing_metadata())
    assert "moved" not in held(served.stub)
    with running(Tampering(registry, "blobs")) as tampering:
        limits = policy((tampering.address,), tmp_path / "cache")
        assert source_revision(f"oci://{tampering.address}/team/resolved:stable", limits) == second_digest
        refused(f"oci://{tampering.address}/team/resolved:stable", limits, "digest_mismatch")
    # A layer declared over the cap is refused, as the load would refuse it.
    cap = (second / ADAPTER_WEIGHTS).stat().st_size - 1
    with pytest.raises(AgentError) as error:
        source_revision(uri, policy((registry.address,), tmp_path / "cache", max_download_bytes=cap))
    assert error.value.reason == "too_large", str(error.value)
    assert not any((tmp_path / "cache").glob("dl-*"))


def test_resolve_source_refuses_as_a_load_does(
    registry: RegistryServer, private: RegistryServer, served: ServedAgent, tmp_path: Path
) -> None:
    """The same checks and the same errors as a load: a hostile name, a pickle file in the
    manifest, a registry's refusal without the credential; with it, the digest."""
    traversal = rpc_error(
        lambda: served.stub.ResolveSource(
            pb.ResolveSourceRequest(source_uri=f"oci://{registry.address}/team/../private/lora:v1"), timeout=60
        )
    )
    assert (traversal.code(), (REASON_METADATA_KEY, "traversal") in tuple(traversal.trailing_metadata())) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        True,
    )
    adapter = make_adapter(tmp_path / "ad", seed=35)
    shutil.copy(adapter / ADAPTER_WEIGHTS, adapter / "adapter_model.bin")
    registry.push_artifact(
        "team/pickled-too", "v1", adapter, {ADAPTER_CONFIG: CONFIG_MEDIA_TYPE, "adapter_model.bin": "application/octet-stream"}
    )
    pickled = rpc_error(
        lambda: served.stub.ResolveSource(pb.ResolveSourceRequest(source_uri=f"oci://{registry.address}/team/pickled-too:v1"), timeout=60)
    )
    assert (REASON_METADATA_KEY, "pickle") in tuple(pickled.trailing_metadata())
    digest = private.push_adapter("team/secret", "v3", make_adapter(tmp_path / "private", seed=36))
    request = pb.ResolveSourceRequest(source_uri=f"oci://{private.address}/team/secret:v3")
    anonymous = rpc_error(lambda: served.stub.ResolveSource(request, timeout=60))
    assert (REASON_METADATA_KEY, "http_error") in tuple(anonymous.trailing_metadata()) and "HTTP 401" in anonymous.details()
    request.source_basic.CopyFrom(pb.SourceBasicAuth(username=LOGIN[0], password=LOGIN[1]))
    assert served.stub.ResolveSource(request, timeout=60).source_revision == digest
    assert held(served.stub) == {}
