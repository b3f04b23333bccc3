"""hf:// sources against a local server speaking the Hub's file-resolve protocol.

`HubServer` (a thread on 127.0.0.1) answers ``/<org>/<repo>/resolve/<revision>/<path>`` as the
Hub does: a branch resolves to its current commit, named in ``X-Repo-Commit``; the config is
served directly, the weights through a 302 to a second server (`cdn`, another origin, as the
Hub's LFS files go to its CDN). A private repository answers 401 without the right bearer token.
The agent's real source policy and downloader are called in-process; one load goes through a
real `lorafleet-agent serve` process, with its --hub-endpoint flag and the request's token.
"""

from __future__ import annotations

import hashlib
import http.server
import logging
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from node_agent.errors import SourceRefused
from node_agent.sources import ADAPTER_CONFIG, ADAPTER_WEIGHTS, SourceCredential, SourcePolicy, resolve_source
from tests.agent.helpers import LOOPBACK_SOURCES, make_adapter, make_model, running

TOKEN = "hf_tok3n-n3ver-l0gged"
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


@dataclass
class Repo:
    commits: dict[str, Path]  # commit id -> the repository's directory at that commit
    branches: dict[str, str]  # branch -> commit id
    private: bool = False


@dataclass
class Seen:
    """What the servers were asked: (path, Authorization header or None)."""

    hub: list[tuple[str, str | None]] = field(default_factory=list)
    cdn: list[tuple[str, str | None]] = field(default_factory=list)


class CdnServer(http.server.ThreadingHTTPServer):
    """Serves /<commit>/<repo>/<path> of the hub's repositories (another origin than the hub)."""

    daemon_threads = True

    def __init__(self, hub: HubServer) -> None:
        super().__init__(("127.0.0.1", 0), _CdnHandler)
        self.hub = hub


class HubServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _HubHandler)
        self.repos: dict[str, Repo] = {}
        self.seen = Seen()
        self.cdn = CdnServer(self)
        self.no_commit_header = False  # a mirror that names no commit
        self.after_config: list[threading.Event] = []  # set once a config was served (to move a branch)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def file(self, repo: str, commit: str, path: str) -> Path | None:
        directory = self.repos[repo].commits.get(commit)
        target = directory / path if directory is not None else None
        return target if target is not None and target.is_file() else None


class _HubHandler(http.server.BaseHTTPRequestHandler):
    server: HubServer

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.server.seen.hub.append((self.path, self.headers.get("Authorization")))
        org, name, verb, revision, *rest = self.path.lstrip("/").split("/")
        repo = self.server.repos.get(f"{org}/{name}")
        if repo is None or verb != "resolve":
            self.send_error(404)
            return
        if repo.private and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.send_error(401)
            return
        commit = repo.branches.get(revision, revision)
        path = "/".join(rest)
        source = self.server.file(f"{org}/{name}", commit, path)
        if source is None:
            self.send_error(404)
            return
        if path.endswith(ADAPTER_WEIGHTS):
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.server.cdn.server_address[1]}/{commit}/{org}/{name}/{path}")
        else:
            body = source.read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
        if not self.server.no_commit_header:
            self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        if not path.endswith(ADAPTER_WEIGHTS):
            self.wfile.write(body)
            for event in self.server.after_config:
                event.set()


class _CdnHandler(http.server.BaseHTTPRequestHandler):
    server: CdnServer

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.server.hub.seen.cdn.append((self.path, self.headers.get("Authorization")))
        commit, org, name, *rest = self.path.lstrip("/").split("/")
        source = self.server.hub.file(f"{org}/{name}", commit, "/".join(rest))
        if source is None:
            self.send_error(404)
            return
        body = source.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Iterator[HubServer]:
    root = tmp_path_factory.mktemp("hub")
    server = HubServer()
    a, b = make_adapter(root / "a", seed=31), make_adapter(root / "b", seed=32)
    nested = root / "nested"
    make_adapter(nested / "adapters" / "tuned", seed=33)
    server.repos["org/lora"] = Repo({COMMIT_A: a, COMMIT_B: b}, {"main": COMMIT_A})
    server.repos["org/private"] = Repo({COMMIT_A: a}, {"main": COMMIT_A}, private=True)
    server.repos["org/nested"] = Repo({COMMIT_B: nested}, {"main": COMMIT_B})
    with running(server), running(server.cdn):
        yield server


def policy(hub: HubServer, tmp_path: Path, **changes: object) -> SourcePolicy:
    return SourcePolicy(cache_dir=tmp_path / "cache", hub_endpoint=hub.endpoint, **{**LOOPBACK_SOURCES, **changes})


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_hub_repository_is_fetched_at_the_commit_its_branch_names(hub, tmp_path):
    hub.seen.hub.clear()
    source = resolve_source("hf://org/lora", None, policy(hub, tmp_path))
    try:
        want = hub.repos["org/lora"].commits[COMMIT_A]
        assert source.content.weights_sha256 == sha256(want / ADAPTER_WEIGHTS)
        assert source.content.config_sha256 == sha256(want / ADAPTER_CONFIG)
        assert source.revision == COMMIT_A
        assert sorted(p.name for p in source.path.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
        # The config at the branch, the weights at the commit the branch named.
        assert [path for path, _ in hub.seen.hub] == [
            f"/org/lora/resolve/main/{ADAPTER_CONFIG}",
            f"/org/lora/resolve/{COMMIT_A}/{ADAPTER_WEIGHTS}",
        ]
    finally:
        source.discard()


def test_a_branch_that_moves_during_the_download_still_gives_one_commits_files(hub, tmp_path):
    moved = threading.Event()
    hub.after_config.append(moved)

    def move_main() -> None:
        moved.wait(30)
        hub.repos["org/lora"].branches["main"] = COMMIT_B

    mover = threading.Thread(target=move_main)
    mover.start()
    try:
        source = resolve_source("hf://org/lora@main", None, policy(hub, tmp_path))
        mover.join(30)
        assert hub.repos["org/lora"].branches["main"] == COMMIT_B, "premise: main moved after the config was served"
        a = hub.repos["org/lora"].commits[COMMIT_A]
        assert (source.content.weights_sha256, source.content.config_sha256) == (sha256(a / ADAPTER_WEIGHTS), sha256(a / ADAPTER_CONFIG))
        source.discard()
    finally:
        hub.after_config.clear()
        hub.repos["org/lora"].branches["main"] = COMMIT_A


def test_a_commit_revision_and_a_folder_are_fetched_as_named(hub, tmp_path):
    source = resolve_source(f"hf://org/nested@{COMMIT_B}/adapters/tuned", None, policy(hub, tmp_path))
    try:
        want = hub.repos["org/nested"].commits[COMMIT_B] / "adapters" / "tuned"
        assert source.content.weights_sha256 == sha256(want / ADAPTER_WEIGHTS) and source.revision == COMMIT_B
    finally:
        source.discard()


def test_a_private_repository_needs_the_token_which_goes_to_the_hub_only(hub, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(SourceRefused, match="HTTP 401") as refused:
        resolve_source("hf://org/private", None, policy(hub, tmp_path))
    hub.seen.hub.clear()
    hub.seen.cdn.clear()
    source = resolve_source("hf://org/private", None, policy(hub, tmp_path), SourceCredential.bearer(TOKEN))
    source.discard()
    assert [auth for _, auth in hub.seen.hub] == [f"Bearer {TOKEN}"] * 2
    assert [auth for _, auth in hub.seen.cdn] == [None], "never sent on the redirect to the CDN"
    assert TOKEN not in str(refused.value) and TOKEN not in caplog.text


@pytest.mark.parametrize(
    "uri, phrase",
    [
        ("hf://org", "names no repository"),
        ("hf://org/re..po", "names no valid Hub repository"),
        ("hf://org/lora@bad..rev", "is not a branch, tag or commit id"),
        ("hf://org/lora/../private", "'.' and '..' are refused"),
        ("hf://org/lora/%2e%2e/x", "'.' and '..' are refused"),
        ("hf://org/lora?revision=x", "no query or fragment"),
    ],
)
def test_malformed_hub_uris_are_refused_before_any_request(hub, tmp_path, uri, phrase):
    hub.seen.hub.clear()
    with pytest.raises(SourceRefused, match=phrase):
        resolve_source(uri, None, policy(hub, tmp_path))
    assert hub.seen.hub == []


def test_the_hub_endpoint_is_held_to_the_allowed_sources_and_a_mirror_must_name_its_commit(hub, tmp_path):
    elsewhere = policy(hub, tmp_path, allowed_sources=("https://huggingface.co/",))
    with pytest.raises(SourceRefused, match="not under any source prefix") as refused:
        resolve_source("hf://org/lora", None, elsewhere)
    assert refused.value.reason == "source_not_allowed"
    hub.no_commit_header = True
    try:
        with pytest.raises(SourceRefused, match="did not name the commit of revision 'main'") as unpinned:
            resolve_source("hf://org/lora", None, policy(hub, tmp_path))
        assert unpinned.value.reason == "unpinned_revision"
        source = resolve_source(f"hf://org/lora@{COMMIT_B}", None, policy(hub, tmp_path))  # a commit needs no header
        source.discard()
    finally:
        hub.no_commit_header = False
    assert not list((tmp_path / "cache").iterdir()), "refused downloads leave nothing behind"


def test_a_serving_agent_loads_a_private_hub_adapter_with_the_requests_token(hub, tmp_path):
    model = make_model(tmp_path / "model", tokenizer=False)
    command = [
        sys.executable,
        "-m",
        "node_agent.cli",
        "--log-level",
        "INFO",
        "serve",
        "--model",
        str(model),
        "--listen",
        "127.0.0.1:0",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--hub-endpoint",
        hub.endpoint,
        "--allow-source",
        "http://127.0.0.1:*/",
        "--allow-source-network",
        "127.0.0.0/8",
    ]
    log = tmp_path / "agent.log"
    with log.open("w") as out:
        agent = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        while not (match := re.search(r"NodeAgent on \S+ \(port (\d+)\)", log.read_text())):
            assert agent.poll() is None, f"serve exited with {agent.returncode}:\n{log.read_text()}"
            time.sleep(0.2)
        port = int(match.group(1))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            reply = stub.LoadAdapter(pb.LoadAdapterRequest(name="hub", source_uri="hf://org/private", source_token=TOKEN), timeout=120)
            assert reply.success, reply.error_message
            (listed,) = stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters
            assert listed.sha256 == sha256(hub.repos["org/private"].commits[COMMIT_A] / ADAPTER_WEIGHTS)
            assert listed.source_uri == "hf://org/private"
    finally:
        agent.terminate()
        agent.wait(60)
    assert TOKEN not in log.read_text()
