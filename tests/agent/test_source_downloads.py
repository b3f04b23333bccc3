"""http(s) sources: deadlines, minimum rate, truncation, the concurrency bound, credentials, the cache.

Real loopback HTTP servers (threads on 127.0.0.1) that misbehave on purpose; the policy is
called in-process, and each status code is checked once through the shared agent's gRPC server.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import logging
import os
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from lorafleet.v1 import agent_pb2 as pb
from lorafleet_dev.pki import Authority
from node_agent import errors
from node_agent.engine import FileDigests, FileIdentity, WrittenFiles
from node_agent.errors import SourceRefused, SourceUnavailable
from node_agent.sources import ADAPTER_CONFIG, ADAPTER_WEIGHTS, ResolvedSource, SourcePolicy, resolve_source
from tests.agent.helpers import LOOPBACK_SOURCES, make_adapter, rpc_error, wait_until

SECRET = "s3cr3t-pa55"


class MisbehavingServer(http.server.ThreadingHTTPServer):
    """Serves a directory on 127.0.0.1; the first path segment chooses the behaviour:

    /files/<p>     the file, honestly
    /trickle/<p>   declares the full Content-Length, then sends one byte every `interval_s`
                   (at most `trickle_bytes` bytes, then closes)
    /stall/<p>     declares the full Content-Length, sends nothing until `release` (bounded)
    /short/<p>     declares the full Content-Length, sends half the file and closes
    /hold/<p>      waits for `release` (bounded), then serves the file honestly
    /to-creds/<p>  redirects to http://user:SECRET@127.0.0.1:<port>/files/<p>
    /loop/<p>      redirects to itself
    /chain/<n>/<p> redirects to /chain/<n+1>/<p>: a new URL every time
    """

    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.interval_s = 0.2
        self.trickle_bytes = 20
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.holding = 0
        self.requests: list[str] = []

    def url(self, kind: str, relative: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{kind}/{relative}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: MisbehavingServer

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.server.requests.append(self.path)
        kind, _, relative = self.path.lstrip("/").partition("/")
        if kind == "to-creds":
            self.send_response(302)
            self.send_header("Location", f"http://user:{SECRET}@127.0.0.1:{self.server.server_address[1]}/files/{relative}")
            self.end_headers()
            return
        if kind in ("loop", "chain"):
            hop, _, rest = relative.partition("/")
            self.send_response(302)
            self.send_header("Location", self.path if kind == "loop" else f"/chain/{int(hop) + 1}/{rest}")
            self.end_headers()
            return
        path = self.server.root / relative
        if ".." in relative or not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        if kind == "hold":
            with self.server.lock:
                self.server.holding += 1
            try:
                self.server.release.wait(30)
            finally:
                with self.server.lock:
                    self.server.holding -= 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            if kind == "trickle":
                for byte in data[: self.server.trickle_bytes]:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(self.server.interval_s)
            elif kind == "stall":
                self.wfile.flush()
                self.server.release.wait(30)
            elif kind == "short":
                self.wfile.write(data[: len(data) // 2])
            else:
                self.wfile.write(data)
        except OSError:  # the client gave up
            pass
        self.close_connection = True


@contextmanager
def misbehaving(root: Path, tls: tuple[Path, Path] | None = None) -> Iterator[MisbehavingServer]:
    """The server in a thread; with `tls` (certificate and key files) it speaks https only."""
    server = MisbehavingServer(root)
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()


@pytest.fixture
def served(tmp_path) -> Path:
    make_adapter(tmp_path / "served" / "ad", seed=1)
    # A trickled file must be long enough that it cannot finish before the limits fire.
    config = tmp_path / "served" / "ad" / ADAPTER_CONFIG
    config.write_text(json.dumps({**json.loads(config.read_text()), "padding": "x" * 4096}))
    return tmp_path / "served"


def policy(tmp_path: Path, **kwargs) -> SourcePolicy:
    return SourcePolicy(cache_dir=tmp_path / "cache", **{**LOOPBACK_SOURCES, **kwargs})


def leftovers(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "cache").glob("*")) if (tmp_path / "cache").exists() else []


# -- deadlines and rates -----------------------------------------------------------------------------


def test_a_trickling_server_hits_the_overall_deadline(tmp_path, served):
    with misbehaving(served) as http:
        # Each byte arrives well within the per-operation timeout (30 s); only the overall deadline can fire.
        limits = policy(tmp_path, download_timeout_s=1.5)
        with pytest.raises(SourceUnavailable, match=r"1\.5-s download deadline") as failed:
            resolve_source(http.url("trickle", "ad"), None, limits)
    assert failed.value.reason == "download_failed"
    assert not leftovers(tmp_path)


def test_a_stalled_body_is_ended_by_the_deadline_not_by_the_socket_timeout(tmp_path, served):
    with misbehaving(served) as http:
        limits = policy(tmp_path, download_timeout_s=1.0)  # the socket timeout stays 30 s
        with pytest.raises(SourceUnavailable, match="1-s download deadline"):
            resolve_source(http.url("stall", "ad"), None, limits)
    assert not leftovers(tmp_path)


def test_a_server_under_the_minimum_rate_fails(tmp_path, served):
    with misbehaving(served) as http:
        limits = policy(
            tmp_path, download_timeout_s=60, download_min_bytes_per_s=1000, download_rate_window_s=1.0, download_socket_timeout_s=10
        )
        with pytest.raises(SourceUnavailable, match=r"too slow: .* under the minimum of 1000 bytes/s"):
            resolve_source(http.url("trickle", "ad"), None, limits)
    assert not leftovers(tmp_path)


def test_a_body_shorter_than_its_content_length_is_a_download_failure(tmp_path, served):
    with misbehaving(served) as http, pytest.raises(SourceUnavailable, match=r"the body ended after \d+ of \d+ bytes \(truncated\)"):
        resolve_source(http.url("short", "ad"), None, policy(tmp_path))
    assert not leftovers(tmp_path)


def test_honest_downloads_still_pass_under_the_limits(tmp_path, served):
    with misbehaving(served) as http:
        source = resolve_source(http.url("files", "ad"), None, policy(tmp_path, download_timeout_s=30, download_rate_window_s=1.0))
    assert (source.path / ADAPTER_WEIGHTS).read_bytes() == (served / "ad" / ADAPTER_WEIGHTS).read_bytes()
    # What the engine is told: the digests of the bytes written, and the files' identities after.
    assert source.content == FileDigests(*(sha256_of(source.path / name) for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)))
    assert source.written == WrittenFiles(*(FileIdentity.of(os.stat(source.path / name)) for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)))
    source.discard()


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_https_downloads_verify_the_server_and_obey_the_deadline(tmp_path, served, monkeypatch):
    ca = Authority("lorafleet test CA")
    pair = ca.issue("127.0.0.1", server=True)
    for name, data in (("ca.pem", ca.pem), ("server.pem", pair.cert), ("server.key", pair.key)):
        (tmp_path / name).write_bytes(data)
    with misbehaving(served, tls=(tmp_path / "server.pem", tmp_path / "server.key")) as http:

        def https(kind: str) -> str:
            return http.url(kind, "ad").replace("http://", "https://")

        with pytest.raises(SourceUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            resolve_source(https("files"), None, policy(tmp_path))
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))  # trust the test CA from now on
        source = resolve_source(https("files"), None, policy(tmp_path))
        assert (source.path / ADAPTER_WEIGHTS).read_bytes() == (served / "ad" / ADAPTER_WEIGHTS).read_bytes()
        source.discard()
        with pytest.raises(SourceUnavailable, match=r"1-s download deadline"):
            resolve_source(https("stall"), None, policy(tmp_path, download_timeout_s=1.0))
    assert not leftovers(tmp_path)


# -- the concurrency bound ---------------------------------------------------------------------------


def test_downloads_beyond_the_bound_are_refused_at_once(tmp_path, served):
    limits = policy(tmp_path, max_concurrent_downloads=2)
    results: list[ResolvedSource] = []
    with misbehaving(served) as http:
        threads = [threading.Thread(target=lambda: results.append(resolve_source(http.url("hold", "ad"), None, limits))) for _ in range(2)]
        for thread in threads:
            thread.start()
        wait_until(lambda: http.holding == 2, 30, "two downloads held by the server")
        with pytest.raises(errors.TooManyDownloads, match=r"the limit is 2 \(--max-concurrent-downloads\)") as refused:
            resolve_source(http.url("files", "ad"), None, limits)
        assert refused.value.reason == "too_many_downloads"
        assert len(http.requests) == 2, "the refused download sent no request"
        http.release.set()
        for thread in threads:
            thread.join(timeout=30)
        assert len(results) == 2
        # The places are free again.
        resolve_source(http.url("files", "ad"), None, limits).discard()
    for source in results:
        source.discard()


# -- credentials -------------------------------------------------------------------------------------


def test_credentials_in_urls_are_refused_and_never_repeated(tmp_path, served, caplog):
    caplog.set_level(logging.DEBUG)
    with misbehaving(served) as http:
        port = http.server_address[1]
        for uri in (
            f"http://user:{SECRET}@127.0.0.1:{port}/files/ad",
            f"https://{SECRET}@example.invalid/ad",
            f"file://user:{SECRET}@localhost/adapters/ad",
            f"http://user:{SECRET}?#x@127.0.0.1:{port}/files/ad",
            f"s3://key:{SECRET}@bucket/ad",
        ):
            with pytest.raises(SourceRefused, match="credentials in source URIs are refused") as refused:
                resolve_source(uri, None, policy(tmp_path, adapter_roots=(tmp_path,)))
            assert refused.value.reason == "credentials" and SECRET not in str(refused.value)
        assert not http.requests, "nothing was sent with the credentials"
        with pytest.raises(SourceRefused, match=r"redirect from .* refused: credentials") as redirected:
            resolve_source(http.url("to-creds", "ad"), None, policy(tmp_path))
        assert SECRET not in str(redirected.value)
        with pytest.raises(SourceRefused, match="without query") as queried:
            resolve_source(http.url("files", "ad") + f"?X-Signature={SECRET}", None, policy(tmp_path))
        assert SECRET not in str(queried.value)
    assert SECRET not in caplog.text


def test_a_redirect_loop_is_refused_as_a_loop(tmp_path, served):
    with misbehaving(served) as http:
        with pytest.raises(SourceRefused, match="redirect loop") as looped:
            resolve_source(http.url("loop", "ad"), None, policy(tmp_path))
        config_url = f"{http.url('loop', 'ad')}/{ADAPTER_CONFIG}"
        assert str(looped.value) == (
            f"redirect from {config_url} refused: a redirect loop ({config_url} was redirected to 4 times already)"
        )
        with pytest.raises(SourceRefused, match=r"more than 10 redirects \(the limit\)") as chained:
            resolve_source(http.url("chain", "0/ad"), None, policy(tmp_path))
    assert looped.value.reason == chained.value.reason == "redirect"
    assert not leftovers(tmp_path)


@pytest.mark.parametrize(
    "uri, shown",
    [
        ("file:///adapters/ad", "file:///adapters/ad"),
        ("file:adapters/ad", "file:adapters/ad"),
        ("http://host/a@b/ad", "http://host/a@b/ad"),  # an '@' in the path is no userinfo
        (f"http://user:{SECRET}@host/ad", "http://***@host/ad"),
        (f"http://user:{SECRET}?#@host/ad", "http://***@host/ad"),
        (f"https://host/ad?X-Signature={SECRET}", "https://host/ad?<redacted>"),
        (f"https://host/ad#{SECRET}", "https://host/ad?<redacted>"),
    ],
)
def test_uris_are_redacted_for_messages_and_logs(uri, shown):
    from node_agent.sources import redact_uri

    assert redact_uri(uri) == shown


# -- the cache directory -----------------------------------------------------------------------------


def test_a_cache_directory_that_cannot_be_created_is_unavailable(tmp_path, served):
    (tmp_path / "a-file").write_text("")
    with misbehaving(served) as http, pytest.raises(SourceUnavailable, match=r"cache directory .* is not usable .* --cache-dir"):
        resolve_source(http.url("files", "ad"), None, SourcePolicy(cache_dir=tmp_path / "a-file" / "cache", **LOOPBACK_SOURCES))


@contextmanager
def read_only(directory: Path) -> Iterator[None]:
    directory.chmod(0o500)
    immutable = False
    try:
        probe = directory / ".probe"
        try:
            probe.write_text("")
            probe.unlink()
            writable = True  # root ignores the mode bits: try the immutable attribute
        except OSError:
            writable = False
        if writable and shutil.which("chattr"):
            immutable = subprocess.run(["chattr", "+i", str(directory)], check=False, capture_output=True).returncode == 0
            writable = not immutable
        if writable:
            pytest.skip("cannot make a directory read-only here (root without chattr)")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
        directory.chmod(0o700)


def test_a_read_only_cache_directory_is_unavailable(tmp_path, served):
    cache = tmp_path / "cache"
    cache.mkdir()
    with misbehaving(served) as http, read_only(cache):
        with pytest.raises(SourceUnavailable, match=r"cache directory .* is not usable"):
            resolve_source(http.url("files", "ad"), None, policy(tmp_path))
        # file:// sources are snapshotted into the cache too
        root = served
        with pytest.raises(SourceUnavailable, match=r"cache directory .* is not usable"):
            resolve_source((root / "ad").as_uri(), None, policy(tmp_path, adapter_roots=(root,)))


# -- the status codes through the shared agent ---------------------------------------------------------


def _with_sources(shared, monkeypatch, **changes) -> None:
    sources = dataclasses.replace(shared.agent.config.sources, **changes)
    monkeypatch.setattr(shared.agent, "config", dataclasses.replace(shared.agent.config, sources=sources))


def test_download_failures_reach_clients_as_unavailable_and_the_bound_as_resource_exhausted(shared, stub, monkeypatch):
    _with_sources(shared, monkeypatch, download_timeout_s=1.0, download_min_bytes_per_s=0, max_concurrent_downloads=1)
    with misbehaving(shared.root) as http:
        for kind, phrase in (("stall", "download deadline"), ("short", "truncated")):
            request = pb.LoadAdapterRequest(name="slow", source_uri=http.url(kind, "ad0"))
            error = rpc_error(lambda request=request: stub.LoadAdapter(request, timeout=60))
            assert (kind, error.code(), phrase in error.details()) == (kind, grpc.StatusCode.UNAVAILABLE, True), error.details()
        _with_sources(shared, monkeypatch, max_concurrent_downloads=1)
        held: list[pb.LoadAdapterResponse] = []
        holder = threading.Thread(
            target=lambda: held.append(stub.LoadAdapter(pb.LoadAdapterRequest(name="held", source_uri=http.url("hold", "ad0")), timeout=60))
        )
        holder.start()
        wait_until(lambda: http.holding == 1, 30, "a download held by the server")
        error = rpc_error(lambda: stub.LoadAdapter(pb.LoadAdapterRequest(name="other", source_uri=http.url("files", "ad1")), timeout=60))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-concurrent-downloads" in error.details()
        http.release.set()
        holder.join(timeout=60)
        assert held and held[0].success, "the download within the bound loads"
        error = rpc_error(
            lambda: stub.LoadAdapter(
                pb.LoadAdapterRequest(name="creds", source_uri=f"http://u:{SECRET}@127.0.0.1:{http.server_address[1]}/files/ad0"),
                timeout=60,
            )
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and SECRET not in error.details()
    _with_sources(shared, monkeypatch, cache_dir=Path(os.devnull) / "cache")
    request = pb.LoadAdapterRequest(name="nocache", source_uri=(shared.root / "ad0").as_uri())
    error = rpc_error(lambda: stub.LoadAdapter(request, timeout=60))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "is not usable" in error.details()
    assert len(list(shared.cache.glob("dl-*"))) == 1, "only the loaded download is left (removed when unloaded)"


# -- the command line -------------------------------------------------------------------------------


def test_serve_flags_set_the_download_limits(tmp_path):
    from node_agent.cli import agent_config, build_parser, main

    model = tmp_path / "model"
    model.mkdir()
    defaults = agent_config(build_parser().parse_args(["serve", "--model", str(model)])).sources
    assert defaults == SourcePolicy()
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(model),
            "--download-timeout-s",
            "90",
            "--download-min-bytes-per-s",
            "2048",
            "--max-concurrent-downloads",
            "3",
        ]
    )
    sources = agent_config(args).sources
    assert (sources.download_timeout_s, sources.download_min_bytes_per_s, sources.max_concurrent_downloads) == (90, 2048, 3)
    for flag, value in (("--max-concurrent-downloads", "0"), ("--download-timeout-s", "-1"), ("--download-min-bytes-per-s", "-5")):
        assert main(["serve", "--model", str(model), flag, value]) == 2
