"""Server-side request forgery through http(s) sources: the allowlist, the address
checks on every DNS answer and redirect hop, and messages that never repeat fetched content.

Real HTTP servers on loopback (127.0.0.1 and 127.0.0.2, both on `lo`); only addresses of this
machine are ever put in a URL, so even a regression sends nothing off it (the link-local, private
and multicast classes are checked on the classifier alone). The policy is called in-process; the leak of a downloaded config's
content into a LoadAdapter reply is checked through the shared agent's gRPC server.
"""

from __future__ import annotations

import dataclasses
import http.server
import ipaddress
import json
import shutil
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from lorafleet.v1 import agent_pb2 as pb
from node_agent.errors import SourceRefused, SourceUnavailable
from node_agent.sources import ADAPTER_CONFIG, ADAPTER_WEIGHTS, SourcePolicy, SourcePrefix, resolve_source
from node_agent.sources.connections import address_class
from tests.agent.helpers import make_adapter, running

SECRET = "SECRET-4f1d-from-the-metadata-service"


class _Server(http.server.ThreadingHTTPServer):
    """Serves `routes` (path -> (status, headers, body)) on `host`; records every request path."""

    daemon_threads = True

    def __init__(self, host: str, routes: dict[str, tuple[int, dict[str, str], bytes]]) -> None:
        super().__init__((host, 0), _Handler)
        self.routes = routes
        self.requests: list[str] = []

    @property
    def port(self) -> int:
        return int(self.server_address[1])


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.server.requests.append(self.path)
        status, headers, body = self.server.routes.get(self.path, (404, {}, b""))
        if status == 403:
            self.send_response(403, f"Forbidden {SECRET}")  # a reason phrase of the server's own
        else:
            self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


@contextmanager
def serving(host: str, routes: dict[str, tuple[int, dict[str, str], bytes]] | None = None) -> Iterator[_Server]:
    with running(_Server(host, routes if routes is not None else {})) as server:
        yield server


@pytest.fixture
def adapter(tmp_path) -> Path:
    return make_adapter(tmp_path / "adapter", seed=3)


def adapter_routes(adapter: Path, base: str = "/ad") -> dict[str, tuple[int, dict[str, str], bytes]]:
    return {f"{base}/{name}": (200, {}, (adapter / name).read_bytes()) for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)}


def policy(tmp_path: Path, sources: tuple[str, ...] = (), networks: tuple[str, ...] = ()) -> SourcePolicy:
    return SourcePolicy(cache_dir=tmp_path / "cache", allowed_sources=sources, allowed_networks=networks)


def refused(uri: str, limits: SourcePolicy, reason: str) -> str:
    with pytest.raises(SourceRefused) as error:
        resolve_source(uri, None, limits)
    assert error.value.reason == reason, str(error.value)
    return str(error.value)


def leftovers(tmp_path: Path) -> list[Path]:
    cache = tmp_path / "cache"
    return list(cache.iterdir()) if cache.exists() else []


# -- the allowlist -----------------------------------------------------------------------------------


def test_http_sources_are_refused_until_the_agent_allows_a_prefix(tmp_path, adapter):
    with serving("127.0.0.1", adapter_routes(adapter)) as server:
        url = f"http://127.0.0.1:{server.port}/ad"
        message = refused(url, policy(tmp_path, networks=("127.0.0.0/8",)), "source_not_allowed")
        assert "--allow-source PREFIX" in message and "allows no http(s) sources" in message
        for sources in (
            (f"http://127.0.0.1:{server.port}/other/",),  # another path
            (f"http://127.0.0.1:{server.port}/a",),  # /a does not cover /ad
            (f"https://127.0.0.1:{server.port}/",),  # another scheme
            ("http://127.0.0.1/",),  # no port: port 80 only
            (f"http://localhost:{server.port}/",),
        ):  # another name for the same address
            message = refused(url, policy(tmp_path, sources, ("127.0.0.0/8",)), "source_not_allowed")
            assert "not under any source prefix this agent allows (--allow-source)" in message
        for sneaky in (
            f"http://127.0.0.1:{server.port}/ok/../ad",
            f"http://127.0.0.1:{server.port}/ok/%2e%2e/ad",
            f"http://127.0.0.1:{server.port}/ok/..%2fad",
        ):
            refused(sneaky, policy(tmp_path, (f"http://127.0.0.1:{server.port}/ok/",), ("127.0.0.0/8",)), "traversal")
        assert server.requests == [], "nothing was fetched from a source that is not allowed"
        for sources in ((f"http://127.0.0.1:{server.port}/ad",), (f"HTTP://127.0.0.1:{server.port}/",), ("http://127.0.0.1:*/",)):
            resolve_source(url, None, policy(tmp_path, sources, ("127.0.0.1/32",))).discard()
    assert not leftovers(tmp_path)


def test_source_prefixes_are_checked_when_configured():
    assert SourcePrefix.parse("https://HuggingFace.co") == SourcePrefix("https", "huggingface.co", 443, "/")
    assert SourcePrefix.parse("http://models.internal.example:8080/org") == SourcePrefix("http", "models.internal.example", 8080, "/org")
    org = SourcePrefix.parse("https://h.example/org")
    assert org.covers("https", "h.example", 443, "/org/x") and org.covers("https", "h.example", 443, "/org")
    assert not org.covers("https", "h.example", 443, "/organisation/x") and not org.covers("https", "h.example", 8443, "/org/x")
    for bad in (
        "ftp://h.example/",
        "https:///x",
        "h.example",
        "https://u:p@h.example/",
        "https://h.example/?q=1",
        "https://h.example/a/../b",
        "https://h.example:99999/",
    ):
        with pytest.raises(ValueError, match="--allow-source"):
            SourcePrefix.parse(bad)
    with pytest.raises(ValueError, match="--allow-source-network"):
        SourcePolicy(allowed_networks=("not-a-network",))


def test_serve_flags_set_the_allowlist(tmp_path):
    from node_agent.cli import agent_config, build_parser, main

    model = tmp_path / "model"
    model.mkdir()
    defaults = agent_config(build_parser().parse_args(["serve", "--model", str(model)])).sources
    assert (defaults.allowed_sources, defaults.allowed_networks) == ((), ())
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(model),
            "--allow-source",
            "https://huggingface.co/",
            "--allow-source",
            "https://models.internal.example/",
            "--allow-source-network",
            "10.0.0.0/8",
        ]
    )
    sources = agent_config(args).sources
    assert sources.allowed_sources == ("https://huggingface.co/", "https://models.internal.example/")
    assert sources.allowed_networks == ("10.0.0.0/8",)
    for flag, value in (("--allow-source", "ftp://x/"), ("--allow-source", "https://u:p@x/"), ("--allow-source-network", "10.0.0.0/33")):
        assert main(["serve", "--model", str(model), flag, value]) == 2


# -- addresses: every DNS answer, every hop -----------------------------------------------------------


# Addresses on this machine (a regression would connect to them, never off the machine).
@pytest.mark.parametrize(
    "address, kind",
    [
        ("127.0.0.1", "loopback"),
        ("127.0.0.2", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
    ],
)
def test_local_addresses_are_never_connected_to(tmp_path, address, kind):
    host = f"[{address}]" if ":" in address else address
    uri = f"http://{host}:9/latest/meta-data/iam/security-credentials"
    message = refused(uri, policy(tmp_path, (f"http://{host}:9/",)), "address_refused")
    assert kind in message and "--allow-source-network" in message
    assert not leftovers(tmp_path)


# Addresses off this machine: the classification alone (the test must send nothing there, even
# against code without the check); `connect_checked` refuses every address it classifies.
@pytest.mark.parametrize(
    "address, kind",
    [
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fc00::1", "private"),
        ("fd12:3456::1", "private"),
        ("100.64.0.1", "shared"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("240.0.0.1", "private"),
        ("fec0::1", "site-local"),
        ("8.8.8.8", None),
        ("2606:4700::1111", None),
    ],
)
def test_non_public_addresses_are_classified(address, kind):
    found = address_class(ipaddress.ip_address(address))
    assert (found is None) if kind is None else (found is not None and found.startswith(kind)), found


def test_allowed_networks_open_exactly_those_addresses(tmp_path, adapter):
    with serving("127.0.0.1", adapter_routes(adapter)) as server:
        url = f"http://127.0.0.1:{server.port}/ad"
        allowed = (f"http://127.0.0.1:{server.port}/",)
        for networks in ((), ("127.0.0.2/32",), ("10.0.0.0/8",), ("::1/128",)):
            refused(url, policy(tmp_path, allowed, networks), "address_refused")
        assert server.requests == [], "no connection was made to a refused address"
        resolve_source(url, None, policy(tmp_path, allowed, ("127.0.0.1/32",))).discard()
        # 0.0.0.0 reaches the loopback server on Linux: it is refused as unspecified, not as loopback
        unspecified = f"http://0.0.0.0:{server.port}/ad"
        refused(unspecified, policy(tmp_path, (f"http://0.0.0.0:{server.port}/",), ("127.0.0.0/8",)), "address_refused")
        assert len(server.requests) == 2


def test_a_name_resolving_to_a_loopback_address_is_refused(tmp_path, adapter):
    assert {info[4][0] for info in socket.getaddrinfo("localhost", 80, 0, socket.SOCK_STREAM)} <= {"127.0.0.1", "::1"}
    with serving("127.0.0.1", adapter_routes(adapter)) as server:
        url = f"http://localhost:{server.port}/ad"
        allowed = (f"http://localhost:{server.port}/",)  # the name is allowed, its answer is not
        message = refused(url, policy(tmp_path, allowed), "address_refused")
        assert "'localhost' resolves only to addresses downloads may not connect to (loopback)" in message
        assert "127.0.0.1" not in message, "the address a name resolves to is logged, not told to the requester"
        assert server.requests == []
        source = resolve_source(url, None, policy(tmp_path, allowed, ("127.0.0.1/32",)))  # the Host header keeps the name
        assert (source.path / ADAPTER_WEIGHTS).read_bytes() == (adapter / ADAPTER_WEIGHTS).read_bytes()
        source.discard()


def test_every_redirect_hop_is_checked(tmp_path, adapter):
    with (
        serving(
            "127.0.0.2", {"/latest/meta-data/ad/" + ADAPTER_CONFIG: (200, {}, json.dumps({"AccessKeyId": SECRET}).encode())}
        ) as metadata,
        serving("127.0.0.1", adapter_routes(adapter)) as allowed,
    ):
        inner = f"http://127.0.0.2:{metadata.port}/latest/meta-data/ad/{ADAPTER_CONFIG}"
        allowed.routes[f"/to-metadata/{ADAPTER_CONFIG}"] = (302, {"Location": inner}, b"")
        allowed.routes[f"/to-unlisted/{ADAPTER_CONFIG}"] = (302, {"Location": f"http://localhost:{metadata.port}/{SECRET}"}, b"")
        allowed.routes[f"/to-dots/{ADAPTER_CONFIG}"] = (302, {"Location": f"http://127.0.0.1:{allowed.port}/ok/%2e%2e/{SECRET}"}, b"")
        allowed.routes[f"/moved/{ADAPTER_CONFIG}"] = (302, {"Location": f"/ad/{ADAPTER_CONFIG}"}, b"")
        allowed.routes[f"/moved/{ADAPTER_WEIGHTS}"] = (301, {"Location": f"/ad/{ADAPTER_WEIGHTS}"}, b"")
        base = f"http://127.0.0.1:{allowed.port}"
        # Both hosts listed, only the first one's address allowed: the hop to 127.0.0.2 is refused at connect.
        limits = policy(tmp_path, (f"{base}/", f"http://127.0.0.2:{metadata.port}/"), ("127.0.0.1/32",))
        refused(f"{base}/to-metadata", limits, "address_refused")
        message = refused(f"{base}/to-unlisted", limits, "source_not_allowed")
        assert message.startswith(f"redirect from {base}/to-unlisted/{ADAPTER_CONFIG} refused: the target is not under")
        assert refused(f"{base}/to-dots", dataclasses.replace(limits, allowed_sources=(f"{base}/to-dots/", f"{base}/ok/")), "traversal")
        assert metadata.requests == [], "the metadata-like server was never reached"
        resolve_source(f"{base}/moved", None, limits).discard()  # a redirect within the allowed prefix is followed
        assert SECRET not in message
    assert not leftovers(tmp_path)


# -- messages never repeat fetched content -------------------------------------------------------------


HOSTILE_CONFIGS = {
    "peft-type": {"peft_type": SECRET},
    "modules-to-save": {"modules_to_save": [SECRET]},
    "target-parameters": {"target_parameters": [SECRET]},
    "rank-pattern": {"rank_pattern": {f"({SECRET}": 4}},
    "wrong-type": {"r": SECRET},
    "nested-nan": {"alpha_pattern": {SECRET: float("nan")}},
    "exclude-modules": {"exclude_modules": f"({SECRET}"},
    "layers-pattern": {"layers_pattern": [f"({SECRET}"], "layers_to_transform": [0]},
}


@pytest.mark.parametrize("case", sorted(HOSTILE_CONFIGS))
def test_a_refused_downloaded_config_is_named_by_field_never_quoted(tmp_path, adapter, case):
    config = {**json.loads((adapter / ADAPTER_CONFIG).read_text()), **HOSTILE_CONFIGS[case]}
    routes = adapter_routes(adapter)
    routes[f"/ad/{ADAPTER_CONFIG}"] = (200, {}, json.dumps(config).encode())
    with serving("127.0.0.1", routes) as server:
        message = refused(
            f"http://127.0.0.1:{server.port}/ad", policy(tmp_path, ("http://127.0.0.1:*/",), ("127.0.0.1/32",)), "bad_adapter_config"
        )
    field = next(iter(HOSTILE_CONFIGS[case]))
    assert f"its field {field!r} is invalid or not supported" in message
    assert SECRET.lower() not in message.lower() and SECRET[:12].lower() not in message.lower()
    assert ADAPTER_WEIGHTS not in server.requests[-1], "the weights are not fetched after the config is refused"
    assert not leftovers(tmp_path)


def test_other_fetched_content_is_never_repeated(tmp_path, adapter):
    routes = {
        f"/not-json/{ADAPTER_CONFIG}": (200, {}, f"<html>{SECRET}</html>".encode()),
        f"/text-weights/{ADAPTER_CONFIG}": routes_config(adapter),
        f"/text-weights/{ADAPTER_WEIGHTS}": (200, {}, f"{SECRET} {SECRET}".encode()),
        f"/forbidden/{ADAPTER_CONFIG}": (403, {}, SECRET.encode()),
    }
    with serving("127.0.0.1", routes) as server:
        limits = policy(tmp_path, ("http://127.0.0.1:*/",), ("127.0.0.1/32",))
        base = f"http://127.0.0.1:{server.port}"
        for kind, reason in (("not-json", "bad_adapter_config"), ("text-weights", "bad_adapter_weights"), ("forbidden", "http_error")):
            message = refused(f"{base}/{kind}", limits, reason)
            assert SECRET not in message, message
        assert "HTTP 403 Forbidden" in refused(f"{base}/forbidden", limits, "http_error")
    # A service that does not speak HTTP answers with its banner: only the kind of failure is told.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)

        def banner() -> None:
            for _ in range(2):
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(4096)
                    conn.sendall(f"-ERR {SECRET}\r\n".encode())

        thread = threading.Thread(target=banner, daemon=True)
        thread.start()
        with pytest.raises(SourceUnavailable) as error:
            resolve_source(f"http://127.0.0.1:{listener.getsockname()[1]}/ad", None, limits)
        assert "the reply is not valid HTTP" in str(error.value) and SECRET not in str(error.value)
        listener.shutdown(socket.SHUT_RDWR)
        thread.join(timeout=10)
    assert not leftovers(tmp_path)


def routes_config(adapter: Path) -> tuple[int, dict[str, str], bytes]:
    return 200, {}, (adapter / ADAPTER_CONFIG).read_bytes()


def test_a_load_never_reflects_a_downloaded_config_into_the_reply(shared, stub, tmp_path):
    served = tmp_path / "served"
    leaky = served / "leaky"
    shutil.copytree(shared.adapters["ad0"], leaky)
    config = json.loads((leaky / ADAPTER_CONFIG).read_text())
    (leaky / ADAPTER_CONFIG).write_text(json.dumps({**config, "peft_type": SECRET}))
    routes = adapter_routes(leaky, "/leaky")
    with serving("127.0.0.1", routes) as server:
        request = pb.LoadAdapterRequest(name="leaky", source_uri=f"http://127.0.0.1:{server.port}/leaky")
        try:  # before the fix the ranks refused it (success false), quoting the value in error_message
            reply = stub.LoadAdapter(request, timeout=60)
            told, code = reply.error_message, None
        except grpc.RpcError as error:
            told, code = error.details(), error.code()
    assert SECRET.lower() not in told.lower(), told
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "its field 'peft_type' is invalid or not supported" in told
