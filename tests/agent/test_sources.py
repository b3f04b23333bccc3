"""Adapter sources: every refusal through the real server, then the policy's details in-process."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from pathlib import Path

import grpc
import pytest

from lorafleet.v1 import agent_pb2 as pb
from node_agent.engine import FileDigests, FileIdentity, WrittenFiles
from node_agent.errors import SourceNotFound, SourceRefused, SourceUnavailable
from node_agent.sources import SourcePolicy, clean_cache, parse_sha256, resolve_source
from tests.agent.helpers import LOOPBACK_SOURCES, http_server, make_adapter, rpc_error

CAP = 256 * 1024  # the download cap of the policy-level tests


@pytest.fixture(scope="module")
def hostile(shared, tmp_path_factory):
    """Adapters and links that must be refused, inside and outside the shared agent's root."""
    root, outside = shared.root, tmp_path_factory.mktemp("outside")
    good = shared.adapters["ad0"]
    make_adapter(outside / "elsewhere", seed=3)
    if not (root / "escape").exists():
        (root / "escape").symlink_to(outside / "elsewhere", target_is_directory=True)
        partial = root / "partial-escape"
        partial.mkdir()
        shutil.copy(good / "adapter_config.json", partial)
        (partial / "adapter_model.safetensors").symlink_to(outside / "elsewhere" / "adapter_model.safetensors")
        pickled = root / "pickled"
        pickled.mkdir()
        shutil.copy(good / "adapter_config.json", pickled)
        (pickled / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle: must never be opened
        big = root / "big"
        big.mkdir()
        shutil.copy(good / "adapter_config.json", big)
        (big / "adapter_model.safetensors").write_bytes(os.urandom(2 * CAP))
    return outside


def cases(root: Path, outside: Path, http) -> list[tuple[str, str, grpc.StatusCode, str]]:
    """(id, URI, status, phrase) for every refused source."""
    good = f"{root}/ad0"
    return [
        ("scheme-gs", "gs://bucket/ad0", grpc.StatusCode.INVALID_ARGUMENT, "scheme 'gs' is refused"),
        ("s3-not-allowed", "s3://bucket/ad0", grpc.StatusCode.INVALID_ARGUMENT, "is not under any prefix this agent allows"),
        ("scheme-ftp", "ftp://127.0.0.1/ad0", grpc.StatusCode.INVALID_ARGUMENT, "scheme 'ftp' is refused"),
        ("scheme-none", "ad0", grpc.StatusCode.INVALID_ARGUMENT, "scheme '(none)' is refused"),
        ("relative", "file:adapters/ad0", grpc.StatusCode.INVALID_ARGUMENT, "relative path refused"),
        ("relative-host", "file://adapters/ad0", grpc.StatusCode.INVALID_ARGUMENT, "relative path refused"),
        ("dotdot", f"file://{root}/ad1/../ad0", grpc.StatusCode.INVALID_ARGUMENT, "'..' is refused"),
        ("dotdot-encoded", f"file://{root}/%2e%2e/{root.name}/ad0", grpc.StatusCode.INVALID_ARGUMENT, "'..' is refused"),
        ("outside-roots", f"file://{outside}/elsewhere", grpc.StatusCode.INVALID_ARGUMENT, "outside the adapter roots"),
        ("symlink-escape", f"file://{root}/escape", grpc.StatusCode.INVALID_ARGUMENT, "symlink"),
        ("file-symlink-escape", f"file://{root}/partial-escape", grpc.StatusCode.INVALID_ARGUMENT, "symlink"),
        ("missing", f"file://{root}/nothing-here", grpc.StatusCode.NOT_FOUND, "does not exist"),
        ("pickle-only", f"file://{root}/pickled", grpc.StatusCode.NOT_FOUND, "only safetensors"),
        ("file-sha256", f"file://{good}", grpc.StatusCode.INVALID_ARGUMENT, "sha256 mismatch"),
        ("http-sha256", http.url("files", "ad0"), grpc.StatusCode.INVALID_ARGUMENT, "sha256 mismatch"),
        ("http-oversize", http.url("files", "big"), grpc.StatusCode.INVALID_ARGUMENT, "cap"),
        ("http-oversize-no-length", http.url("stream", "big"), grpc.StatusCode.INVALID_ARGUMENT, "cap"),
        ("http-404", http.url("files", "nothing-here"), grpc.StatusCode.NOT_FOUND, "HTTP 404"),
        ("http-500", http.url("fail", "ad0"), grpc.StatusCode.UNAVAILABLE, "HTTP 500"),
        ("http-redirect-to-file", http.url("to-file", "ad0"), grpc.StatusCode.INVALID_ARGUMENT, "redirect from"),
        ("http-query", http.url("files", "ad0") + "?token=x", grpc.StatusCode.INVALID_ARGUMENT, "without query"),
        ("bad-sha256", f"file://{good}", grpc.StatusCode.INVALID_ARGUMENT, "64 hex digits"),
    ]


def test_every_refused_source_is_refused_with_a_clear_status_and_leaves_nothing(shared, stub, hostile, monkeypatch):
    # The shared agent's download cap, lowered for this test (the files here are KiB).
    policy = shared.agent.config.sources
    lowered = dataclasses.replace(policy, max_download_bytes=CAP)
    monkeypatch.setattr(shared.agent, "config", _with_sources(shared.agent.config, lowered))
    with http_server(shared.root) as http:
        for case_id, uri, code, phrase in cases(shared.root, hostile, http):
            sha = {"file-sha256": "0" * 64, "http-sha256": "f" * 64, "bad-sha256": "abc"}.get(case_id, "")
            request = pb.LoadAdapterRequest(name="src", source_uri=uri, sha256=sha)
            error = rpc_error(lambda request=request: stub.LoadAdapter(request, timeout=60))
            assert (case_id, error.code(), phrase in error.details()) == (case_id, code, True), error.details()
    assert not stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters
    assert not list(shared.cache.glob("dl-*")), "refused downloads leave nothing in the cache"


def _with_sources(config, sources):
    import dataclasses

    return dataclasses.replace(config, sources=sources)


def test_http_sources_load_from_a_directory_url(shared, stub):
    digest = hashlib.sha256((shared.adapters["ad1"] / "adapter_model.safetensors").read_bytes()).hexdigest()
    with http_server(shared.root) as http:
        reply = stub.LoadAdapter(pb.LoadAdapterRequest(name="web", source_uri=http.url("files", "ad1/"), sha256=digest), timeout=60)
    assert reply.success
    assert len(list(shared.cache.glob("dl-*"))) == 1
    stub.UnloadAdapter(pb.UnloadAdapterRequest(name="web"), timeout=60)
    assert not list(shared.cache.glob("dl-*")), "an unloaded download is removed from the cache"


# -- the policy in-process -----------------------------------------------------------------------


def test_symlinks_that_stay_inside_a_root_are_followed(tmp_path):
    # Kubernetes volumes are symlink farms (..data -> ..2026_11_30...): the root itself may be a link.
    real = tmp_path / "volume" / "..2026"
    make_adapter(real / "ad", seed=1)
    (tmp_path / "volume" / "..data").symlink_to(real, target_is_directory=True)
    root = tmp_path / "root-link"
    root.symlink_to(tmp_path / "volume" / "..data", target_is_directory=True)
    (real / "alias").symlink_to(real / "ad", target_is_directory=True)
    source = resolve_source((root / "alias").as_uri(), None, SourcePolicy(adapter_roots=(root,), cache_dir=tmp_path / "cache"))
    # The ranks get a private snapshot of the checked bytes, never the live directory.
    assert source.path.parent == tmp_path / "cache" and source.owned and not source.downloaded
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (source.path / name).read_bytes() == (real / "ad" / name).read_bytes()
    # What the engine is told: the digests of the bytes written, and the files' identities after.
    files = [source.path / name for name in ("adapter_model.safetensors", "adapter_config.json")]
    assert source.content == FileDigests(*(hashlib.sha256(file.read_bytes()).hexdigest() for file in files))
    assert source.written == WrittenFiles(*(FileIdentity.of(os.stat(file)) for file in files))


def test_file_sources_need_an_adapter_root_and_http_sources_a_cache(tmp_path):
    adapter = make_adapter(tmp_path / "ad", seed=1)
    with pytest.raises(SourceRefused, match="no --adapter-root") as refused:
        resolve_source(adapter.as_uri(), None, SourcePolicy())
    assert refused.value.reason == "outside_roots"
    with pytest.raises(SourceRefused, match=r"allows no http\(s\) sources.*--allow-source PREFIX") as refused:
        resolve_source("https://example.invalid/ad", None, SourcePolicy())
    assert refused.value.reason == "source_not_allowed"
    with pytest.raises(SourceRefused, match="no --cache-dir"):
        resolve_source("https://example.invalid/ad", None, SourcePolicy(allowed_sources=("https://example.invalid/",)))


def test_a_root_prefix_is_not_a_root(tmp_path):
    make_adapter(tmp_path / "adapters-evil" / "ad", seed=1)
    (tmp_path / "adapters").mkdir()
    with pytest.raises(SourceRefused, match="outside the adapter roots"):
        resolve_source((tmp_path / "adapters-evil" / "ad").as_uri(), None, SourcePolicy(adapter_roots=(tmp_path / "adapters",)))


def test_unreachable_servers_are_unavailable_and_leave_no_download(tmp_path):
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    policy = SourcePolicy(cache_dir=tmp_path / "cache", download_timeout_s=5, **LOOPBACK_SOURCES)
    with pytest.raises(SourceUnavailable, match="failed"):
        resolve_source(f"http://127.0.0.1:{port}/ad", None, policy)
    assert not list((tmp_path / "cache").iterdir())


def test_downloads_are_private_copies_and_stale_ones_are_cleaned(tmp_path):
    make_adapter(tmp_path / "served" / "ad", seed=1)
    policy = SourcePolicy(cache_dir=tmp_path / "cache", **LOOPBACK_SOURCES)
    with http_server(tmp_path / "served") as http:
        first = resolve_source(http.url("files", "ad"), None, policy)
        second = resolve_source(http.url("files", "ad"), None, policy)
    assert first.path != second.path and first.content == second.content and first.downloaded
    first.discard()
    assert not first.path.exists() and second.path.exists()
    clean_cache(policy.cache_dir)
    assert not second.path.exists()


def test_redirects_are_followed_only_to_http(tmp_path):
    make_adapter(tmp_path / "served" / "ad", seed=1)
    policy = SourcePolicy(cache_dir=tmp_path / "cache", **LOOPBACK_SOURCES)
    with http_server(tmp_path / "served") as http:
        assert resolve_source(http.url("moved", "ad"), None, policy).content.weights_sha256
        for kind in ("to-ftp", "to-file"):
            with pytest.raises(SourceRefused, match="redirect from") as refused:
                resolve_source(http.url(kind, "ad"), None, policy)
            assert refused.value.reason == "redirect"


def test_missing_files_under_a_root_are_not_found(tmp_path):
    (tmp_path / "root" / "empty").mkdir(parents=True)
    with pytest.raises(SourceNotFound, match=r"adapter_config\.json not found"):
        resolve_source((tmp_path / "root" / "empty").as_uri(), None, SourcePolicy(adapter_roots=(tmp_path / "root",)))


@pytest.mark.parametrize("value, expected", [("", None), ("A" * 64, "a" * 64), (" " + "0" * 64 + "\n", "0" * 64)])
def test_sha256_values_are_normalised(value, expected):
    assert parse_sha256(value) == expected
