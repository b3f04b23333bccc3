"""Download progress: while a load's source downloads, ListAdapters shows how many bytes
arrived of the sizes the server declared; the entry goes when the download ends.

A real HTTP server on loopback serves the config whole, then the weights' headers (with their
Content-Length) and the first half of the body, and holds the rest until the test releases it.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet.v1 import agent_pb2 as pb
from node_agent.sources import ADAPTER_CONFIG, ADAPTER_WEIGHTS, DownloadProgress, SourcePolicy, resolve_source
from tests.agent.helpers import LOOPBACK_SOURCES, make_adapter, running, wait_until


class HalfThenHold(http.server.ThreadingHTTPServer):
    """Serves `root`; a weights file in two halves, the second once `release` is set."""

    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.release = threading.Event()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{path}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: HalfThenHold

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        data = (self.server.root / self.path.lstrip("/")).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not self.path.endswith(ADAPTER_WEIGHTS):
            self.wfile.write(data)
            return
        self.wfile.write(data[: len(data) // 2])
        self.wfile.flush()
        self.server.release.wait(120)
        self.wfile.write(data[len(data) // 2 :])


@pytest.fixture
def server(tmp_path) -> Iterator[tuple[HalfThenHold, Path]]:
    adapter = make_adapter(tmp_path / "files" / "ad", seed=61)
    with running(HalfThenHold(tmp_path / "files")) as half:
        try:
            yield half, adapter
        finally:
            half.release.set()


def test_a_download_counts_what_arrived_of_what_the_server_declared(server, tmp_path):
    half, adapter = server
    config, weights = (adapter / ADAPTER_CONFIG).stat().st_size, (adapter / ADAPTER_WEIGHTS).stat().st_size
    progress = DownloadProgress()
    policy = SourcePolicy(cache_dir=tmp_path / "cache", download_min_bytes_per_s=0, **LOOPBACK_SOURCES)
    done: list[object] = []
    loader = threading.Thread(target=lambda: done.append(resolve_source(half.url("ad"), None, policy, progress=progress)))
    loader.start()
    wait_until(lambda: progress.snapshot()[0] >= config + weights // 2)
    assert progress.snapshot() == (config + weights // 2, config + weights), "the rest is held back"
    half.release.set()
    loader.join()
    assert progress.snapshot() == (config + weights, config + weights)
    done[0].discard()


def test_list_adapters_shows_a_running_download_until_it_ends(shared, server):
    half, adapter = server
    config, weights = (adapter / ADAPTER_CONFIG).stat().st_size, (adapter / ADAPTER_WEIGHTS).stat().st_size

    def held() -> list[pb.DownloadProgress]:
        shown = list(shared.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).downloading)
        return shown if shown and shown[0].bytes_done == config + weights // 2 else []

    replies: list[pb.LoadAdapterResponse] = []
    loader = threading.Thread(
        target=lambda: replies.append(
            shared.stub.LoadAdapter(pb.LoadAdapterRequest(name="progress", source_uri=half.url("ad")), timeout=120)
        )
    )
    loader.start()
    try:
        wait_until(lambda: bool(held()), what="the download held halfway")
        (shown,) = held()
        assert (shown.name, shown.bytes_total) == ("progress", config + weights)
    finally:
        half.release.set()
        loader.join()
    assert replies[0].success, replies[0].error_message
    listed = shared.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30)
    assert list(listed.downloading) == [] and "progress" in [a.name for a in listed.adapters]
    shared.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="progress"), timeout=60)
