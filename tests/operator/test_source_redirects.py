"""A source whose server redirects to the cloud metadata address (169.254.169.254) is refused at
the agent, and the refusal reaches the adapter's status: http(s), oci:// (a registry's blob
redirected, as registries send blobs to storage) and s3:// sources, on the real control plane
with a real agent (tp=2), the real operator, a real S3 store (versitygw) and a real registry
(distribution's, artifacts pushed by the real ``oras``) behind a hostile front on loopback.

The front plays the attacker: it passes every request on to the store or the registry, except
those for a source named ``redirected...``, answered with a 307 to the metadata address. The
agent's owner allowed ``http://169.254.169.254/latest/`` by mistake, so such a redirect passes
the prefix rule and meets the address rule, which refuses link-local addresses whatever the
prefixes say; a redirect elsewhere on that host is refused by the prefix rule first. The other
adapters of the same apply, read through the same front, go Ready on every rank.
"""

from __future__ import annotations

import http.client
import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lorafleet_dev.agents import AgentProcess, AgentSpec
from lorafleet_dev.storage_servers import RegistryServer, S3Keys, S3Server, start_registry, start_s3_server
from lorafleet_dev.synthetic import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_model
from tests.agent.helpers import running
from tests.kube.harness import ControlPlane
from tests.operator.agents import BASE_MODEL, SHAPE, adapter_manifest, add_agent_pod, apply, fleet_manifest, make_adapter, registry, status
from tests.operator.conftest import OperatorProcess, wait_for

KEYS = S3Keys("LORAFLEETREDIRECTKEY", "redirect-s3cr3t-never-shown")
BUCKET = "adapters"
METADATA = "169.254.169.254"
#: An --allow-source prefix the agent's owner should never have given: only the address rule is left.
MISTAKE = f"http://{METADATA}/latest/"
#: Where a source named ``redirected-elsewhere`` is sent: on the metadata host, outside every prefix.
ELSEWHERE = f"http://{METADATA}/computeMetadata/v1/"


class HostileFront(http.server.ThreadingHTTPServer):
    """Passes GETs and HEADs on to the registry (``/v2/``) or the S3 store (anything else),
    headers and all (the store checks a signature over the front's ``Host``), and answers a
    request for a source named ``redirected`` (but a registry's manifest) with a 307 to the
    metadata address: under ``/latest/`` or, for ``redirected-elsewhere``, outside it. Records
    the paths it redirected."""

    daemon_threads = True

    def __init__(self, s3_port: int, registry_port: int) -> None:
        super().__init__(("127.0.0.1", 0), _FrontHandler)
        self.s3_port, self.registry_port = s3_port, registry_port
        self.redirected: list[str] = []
        self.lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}"


def redirect_target(path: str) -> str | None:
    """Where the front sends a request for `path` (None: on to the store or the registry)."""
    if "redirected" not in path or "/manifests/" in path:
        return None
    return ELSEWHERE if "elsewhere" in path else f"{MISTAKE}meta-data/"


class _FrontHandler(http.server.BaseHTTPRequestHandler):
    server: HostileFront

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        target = redirect_target(self.path)
        if target is not None:
            with self.server.lock:
                self.server.redirected.append(self.path)
            self.send_response(307)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        port = self.server.registry_port if self.path.startswith("/v2/") else self.server.s3_port
        upstream = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            upstream.request(self.command, self.path, headers=dict(self.headers.items()))
            answer = upstream.getresponse()
            body = answer.read()
        finally:
            upstream.close()
        # A HEAD's answer keeps the store's Content-Length; a GET's says what is sent.
        dropped = ("connection", "transfer-encoding") + (("content-length",) if self.command == "GET" else ())
        self.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in dropped:
                self.send_header(name, value)
        if self.command == "GET":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)


@dataclass(frozen=True)
class Stores:
    """The real store and registry, the front before them, and the agent that reads through it."""

    s3: S3Server
    oci: RegistryServer  # oras pushes to it directly, not through the front
    front: HostileFront
    agent: AgentProcess
    work: Path


def front_agent_spec(root: Path, front: HostileFront) -> AgentSpec:
    """An agent (tp=2) whose S3 endpoint, registry and http prefix are the front's, loopback
    allowed, and the metadata host's ``/latest/`` allowed by mistake; the store's keys its own."""
    return AgentSpec(
        model_dir=write_model(root / "model", SHAPE),
        adapter_roots=(),
        base_model_name=BASE_MODEL,
        tp=2,
        dp=1,
        max_loaded_loras=8,
        extra_args=(
            *("--cache-dir", str(root / "cache"), "--s3-endpoint", front.endpoint, "--oci-plain-http", front.address),
            *("--allow-source", f"s3://{BUCKET}/team", "--allow-source", f"oci://{front.address}/team"),
            *("--allow-source", f"{front.endpoint}/http/", "--allow-source", MISTAKE, "--allow-source-network", "127.0.0.0/8"),
        ),
        env=(("AWS_ACCESS_KEY_ID", KEYS.access_key_id), ("AWS_SECRET_ACCESS_KEY", KEYS.secret_access_key)),
    )


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stores]:
    root = tmp_path_factory.mktemp("source-redirects")
    s3 = start_s3_server(root / "s3", KEYS)
    oci = start_registry(root / "registry")
    try:
        s3.create_bucket(BUCKET)
        with running(HostileFront(s3.port, oci.port)) as front:
            agent = AgentProcess("redirect-agent", front_agent_spec(root, front), root / "logs")
            agent.start()
            try:
                agent.wait_ready()
                yield Stores(s3, oci, front, agent, root)
            finally:
                agent.stop()
    finally:
        oci.stop()
        s3.stop()


def source(name: str, uri: str) -> dict[str, Any]:
    manifest = adapter_manifest(name, Path("/unused"))
    manifest["spec"]["source"] = {"uri": uri}
    return manifest


@pytest.fixture
def fleet(kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...], stores: Stores) -> str:
    """The test's namespace with the agent's pod and a fleet allowing the front's bucket,
    registry and http prefixes (never the metadata address)."""
    add_agent_pod(kube_cluster, kube_namespace, stores.agent)
    fleet = fleet_manifest()
    front = stores.front
    fleet["spec"]["sources"] = {"allow": [f"s3://{BUCKET}/team", f"oci://{front.address}/team", f"{front.endpoint}/http/"]}
    apply(kube_cluster, kube_namespace, fleet)
    return kube_namespace


def test_redirects_to_the_metadata_address_are_refused_in_status_and_the_others_load(
    kube_cluster: ControlPlane, fleet: str, stores: Stores, operator: OperatorProcess
) -> None:
    ns, front = fleet, stores.front
    digests: dict[str, str] = {}
    for name, seed in (("good", 81), ("redirected", 82)):
        adapter = make_adapter(stores.work / ns, name, seed=seed)
        stores.s3.put_adapter(BUCKET, f"team/{ns}/{name}", adapter)
        digests[name] = stores.oci.push_adapter(f"team/{ns}-{name}", "v1", adapter)
    apply(
        kube_cluster,
        ns,
        source("s3-good", f"s3://{BUCKET}/team/{ns}/good"),
        source("oci-good", f"oci://{front.address}/team/{ns}-good:v1"),
        source("s3-redirected", f"s3://{BUCKET}/team/{ns}/redirected"),
        source("oci-redirected", f"oci://{front.address}/team/{ns}-redirected:v1"),
        source("http-redirected", f"{front.endpoint}/http/redirected/"),
        source("http-elsewhere", f"{front.endpoint}/http/redirected-elsewhere/"),
    )
    hostile = ("s3-redirected", "oci-redirected", "http-redirected", "http-elsewhere")
    wanted = {"s3-good": "Ready", "oci-good": "Ready"} | dict.fromkeys(hostile, "Failed")
    wait_for(lambda: all(status(kube_cluster, ns, n).get("phase") == p for n, p in wanted.items()), 120, f"phases {wanted}", operator)
    st = {name: status(kube_cluster, ns, name) for name in wanted}

    for name in ("s3-redirected", "oci-redirected", "http-redirected"):
        assert f"the host {METADATA!r} resolves only to addresses downloads may not connect to" in st[name]["message"], st[name]
        assert "link-local" in st[name]["message"], st[name]
    assert "redirect from" in st["http-elsewhere"]["message"], st["http-elsewhere"]
    assert "is not under any source prefix this agent allows" in st["http-elsewhere"]["message"], st["http-elsewhere"]
    # Nothing the redirect led to is recorded: the oci:// tag may be held to the digest its
    # manifest (not redirected) resolved to, never to anything else.
    assert all("source" not in st[name] for name in ("s3-redirected", "http-redirected", "http-elsewhere")), st
    assert st["oci-redirected"].get("source", {}).get("revision", digests["redirected"]) == digests["redirected"], st["oci-redirected"]
    # Each refusal followed the front's redirect of the source's first file; the weights of
    # the s3 and http sources were never asked for.
    with front.lock:
        redirected = set(front.redirected)
    first = {f"/{BUCKET}/team/{ns}/redirected/", "/http/redirected/", "/http/redirected-elsewhere/"}
    assert {f"{prefix}{ADAPTER_CONFIG}" for prefix in first} <= redirected, redirected
    assert not any(f"{prefix}{ADAPTER_WEIGHTS}" in redirected for prefix in first), redirected
    assert any(path.startswith(f"/v2/team/{ns}-redirected/blobs/") for path in redirected), redirected

    for name in ("s3-good", "oci-good"):
        assert (st[name]["agentsSummary"], st[name]["ranksSummary"]) == ("1/1", "2/2"), st[name]
    held = registry(stores.agent, ns)
    assert held == {f"{ns}.s3-good": [0, 1], f"{ns}.oci-good": [0, 1]}, held
