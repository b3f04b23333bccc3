"""Source credentials (bearer and basic) on http(s) sources: sent to the source's own URLs only,
never across a redirect, never shown; values that cannot be a header refused without showing them.

Two real HTTP servers on loopback: `Private` answers 401 unless the request carries the expected
Authorization header, and redirects ``/moved/...`` to `Other` (another origin), which records
the headers it was sent. The agent's real downloader is called in-process; one load goes through
a real gRPC server with the request's basic credential.
"""

from __future__ import annotations

import base64
import http.server
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from lorafleet.v1 import agent_pb2 as pb
from node_agent.errors import InvalidRequest, SourceRefused
from node_agent.sources import SourceCredential, SourcePolicy, resolve_source
from tests.agent.helpers import LOOPBACK_SOURCES, make_adapter, rpc_error, running

TOKEN = "src-t0ken-never-shown"
USER, PASSWORD = "reader", "pa55-never-shown"
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


class Recorder(http.server.ThreadingHTTPServer):
    """Serves `root`'s files under any prefix; `/moved/<p>` redirects to `target` (another
    server) when set; answers 401 to a request without `expected` Authorization (if set)."""

    daemon_threads = True

    def __init__(self, root: Path, expected: set[str] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root, self.expected = root, expected
        self.target: Recorder | None = None
        self.seen: list[tuple[str, str | None]] = []

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{path}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Recorder

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        auth = self.headers.get("Authorization")
        self.server.seen.append((self.path, auth))
        kind, _, relative = self.path.lstrip("/").partition("/")
        if self.server.expected is not None and auth not in self.server.expected:
            self.send_error(401)
            return
        if kind == "moved" and self.server.target is not None:
            self.send_response(302)
            self.send_header("Location", self.server.target.url(f"files/{relative}"))
            self.end_headers()
            return
        data = (self.server.root / relative).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[tuple[Recorder, Recorder]]:
    root = tmp_path_factory.mktemp("credentials")
    make_adapter(root / "ad", seed=41)
    private, other = Recorder(root, {f"Bearer {TOKEN}", BASIC}), Recorder(root)
    private.target = other
    with running(private), running(other):
        yield private, other


def policy(tmp_path: Path) -> SourcePolicy:
    return SourcePolicy(cache_dir=tmp_path / "cache", **LOOPBACK_SOURCES)


@pytest.mark.parametrize(
    "credential, header",
    [(SourceCredential.bearer(TOKEN), f"Bearer {TOKEN}"), (SourceCredential.basic(USER, PASSWORD), BASIC)],
    ids=["bearer", "basic"],
)
def test_a_credential_goes_to_the_sources_own_urls_and_never_across_a_redirect(servers, tmp_path, caplog, credential, header):
    caplog.set_level(logging.DEBUG)
    private, other = servers
    private.seen.clear()
    other.seen.clear()
    with pytest.raises(SourceRefused, match="HTTP 401") as without:
        resolve_source(private.url("files/ad"), None, policy(tmp_path))
    resolve_source(private.url("files/ad"), None, policy(tmp_path), credential).discard()
    assert [auth for path, auth in private.seen if auth] == [header] * 2
    # The weights file moved to another origin: the credential stays behind.
    resolve_source(private.url("moved/ad"), None, policy(tmp_path), credential).discard()
    assert [auth for _, auth in other.seen] == [None, None], other.seen
    assert repr(credential).endswith("***)") and TOKEN not in repr(credential) and PASSWORD not in repr(credential)
    for secret in (TOKEN, PASSWORD, BASIC.split()[1]):
        assert secret not in caplog.text and secret not in str(without.value)


@pytest.mark.parametrize(
    "make, phrase",
    [
        (lambda: SourceCredential.bearer("abc\x07" + TOKEN), "the source token cannot be sent as a header value"),
        (lambda: SourceCredential.bearer(""), "the source token is empty"),
        (lambda: SourceCredential.basic("a:b", PASSWORD), "cannot contain ':'"),
        (lambda: SourceCredential.basic(USER, PASSWORD + "\n"), "the source password cannot be sent as a header value"),
    ],
)
def test_a_credential_that_cannot_be_a_header_is_refused_without_showing_it(make, phrase):
    with pytest.raises(InvalidRequest, match=phrase) as refused:
        make()
    assert TOKEN not in str(refused.value) and PASSWORD not in str(refused.value)


def test_a_file_source_takes_no_credential(tmp_path):
    adapter = make_adapter(tmp_path / "root" / "ad", seed=42)
    with pytest.raises(SourceRefused, match="file:// sources take no credential"):
        resolve_source(adapter.as_uri(), None, SourcePolicy(adapter_roots=(tmp_path / "root",)), SourceCredential.bearer(TOKEN))


def test_a_load_with_basic_credentials_over_grpc(shared, servers):
    """LoadAdapterRequest.source_basic reaches the download; two kinds of credential together
    (token and basic, basic and an S3 key) are refused."""
    private, _ = servers
    private.seen.clear()
    basic = pb.SourceBasicAuth(username=USER, password=PASSWORD)
    both = rpc_error(
        lambda: shared.stub.LoadAdapter(
            pb.LoadAdapterRequest(name="cred", source_uri=private.url("files/ad"), source_token=TOKEN, source_basic=basic), timeout=60
        )
    )
    assert both.code() == grpc.StatusCode.INVALID_ARGUMENT and "not several" in both.details()
    s3 = pb.SourceS3Credential(access_key_id="AKIDEXAMPLE", secret_access_key=PASSWORD)
    both = rpc_error(
        lambda: shared.stub.LoadAdapter(
            pb.LoadAdapterRequest(name="cred", source_uri="s3://b/x", source_basic=basic, source_s3=s3), timeout=60
        )
    )
    assert both.code() == grpc.StatusCode.INVALID_ARGUMENT and "not several" in both.details()
    assert private.seen == []
    reply = shared.stub.LoadAdapter(pb.LoadAdapterRequest(name="cred", source_uri=private.url("files/ad"), source_basic=basic), timeout=120)
    assert reply.success, reply.error_message
    assert [auth for _, auth in private.seen] == [BASIC] * 2
    shared.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="cred"), timeout=60)
