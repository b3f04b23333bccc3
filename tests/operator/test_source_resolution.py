"""An oci:// tag resolved once, before the loads, on the real control plane: two real agents read
a real registry (distribution's, artifacts pushed by the real ``oras``) through a loopback proxy
that passes the first manifest request and holds every later one until the test lets them go.

With the resolution, the first manifest request is the operator's ResolveSource: the digest is in
``status.source`` while both agents' loads still wait, and when the tag moves before they go on,
each load is refused (``tag_moved``): no agent holds the new content. Without it, the first
agent's load resolved the tag itself and the second, held, loaded what the tag named later: two
digests in one fleet. A source refused at resolution is the adapter's status, and no load is sent.
An agent busy for control calls, asked first, passes the resolution to the next.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from lorafleet.v1 import agent_pb2
from lorafleet_dev.agents import AgentProcess, AgentSpec
from lorafleet_dev.storage_servers import CONFIG_MEDIA_TYPE, RegistryServer, start_registry
from lorafleet_dev.synthetic import ADAPTER_WEIGHTS, write_model
from tests.agent.storage_agents import registry_answer, send_body
from tests.kube.harness import ControlPlane
from tests.operator.agents import (
    BASE_MODEL,
    SHAPE,
    Source,
    adapter_manifest,
    add_agent_pod,
    apply,
    fleet_manifest,
    make_adapter,
    serving,
    status,
    stub,
)
from tests.operator.conftest import OperatorProcess, wait_for


class HeldManifests(http.server.ThreadingHTTPServer):
    """Passes GETs on to the registry; manifest requests after the first ``passes`` wait until
    ``release`` is set (at most 120 s), counted in ``holding`` meanwhile."""

    daemon_threads = True

    def __init__(self, registry: RegistryServer, passes: int = 1) -> None:
        super().__init__(("127.0.0.1", 0), _HeldManifestsHandler)
        self.registry, self.passes = registry, passes
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.manifests = 0
        self.holding = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def wait_turn(self) -> None:
        """A manifest request's turn: at once for the first ``passes``, else after ``release``."""
        with self.lock:
            self.manifests += 1
            if self.manifests <= self.passes:
                return
            self.holding += 1
        try:
            self.release.wait(120)
        finally:
            with self.lock:
                self.holding -= 1


class _HeldManifestsHandler(http.server.BaseHTTPRequestHandler):
    server: HeldManifests

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if "/manifests/" in self.path:
            self.server.wait_turn()
        answer = registry_answer(self.server.registry, self)
        if answer is not None:
            send_body(self, *answer)


@dataclass(frozen=True)
class Fleet:
    """The registry, the proxy in front of it, and two agents that read it through the proxy."""

    registry: RegistryServer
    proxy: HeldManifests
    agents: list[AgentProcess]
    work: Path


@contextlib.contextmanager
def _started_fleet(work: Path, first_agent_args: tuple[str, ...] = ()) -> Iterator[Fleet]:
    """The registry, its proxy and two agents serving (agent-0 with ``first_agent_args`` more)."""
    registry = start_registry(work / "registry")
    proxy = HeldManifests(registry)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    model = write_model(work / "model", SHAPE)
    extra = {"agent-0": first_agent_args, "agent-1": ()}
    agents = [AgentProcess(name, _agent_spec(model, work / name, proxy.address, *args), work / "logs") for name, args in extra.items()]
    try:
        with serving(agents):
            yield Fleet(registry, proxy, agents, work)
    finally:
        proxy.release.set()
        proxy.shutdown()
        proxy.server_close()
        registry.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with _started_fleet(tmp_path) as started:
        yield started


@dataclass(frozen=True)
class BusyFirst:
    """A fleet whose agent-0 (the first asked: agents are in name order) runs one control call
    at a time, and an http source that holds the downloads agent-0 may make from it (503 once
    released: the held load fails and gives its place back)."""

    fleet: Fleet
    source: Source


@pytest.fixture
def busy_first(tmp_path: Path) -> Iterator[BusyFirst]:
    source = Source(tmp_path)
    threading.Thread(target=source.serve_forever, daemon=True).start()
    try:
        with _started_fleet(tmp_path, ("--max-control-calls", "1", "--allow-source", source.url("hold/"))) as started:
            yield BusyFirst(started, source)
    finally:
        source.release.set()
        source.shutdown()
        source.server_close()


def _agent_spec(model: Path, root: Path, registry: str, *more_args: str) -> AgentSpec:
    """An agent of the tiny model reading the registry's ``team`` repositories over plain HTTP."""
    return AgentSpec(
        model_dir=model,
        adapter_roots=(),
        base_model_name=BASE_MODEL,
        tp=1,
        dp=1,
        extra_args=(
            *("--cache-dir", str(root / "cache"), "--allow-source", f"oci://{registry}/team"),
            *("--oci-plain-http", registry, "--allow-source-network", "127.0.0.0/8", *more_args),
        ),
    )


def _held_weights(agent: AgentProcess, name: str) -> str:
    """The sha256 of the weights the agent holds under ``name`` ("" when it holds none)."""
    channel, agent_stub = stub(agent)
    with channel:
        reply = agent_stub.ListAdapters(agent_pb2.ListAdaptersRequest(), timeout=10)
    return next((a.sha256 for a in reply.adapters if a.name == name), "")


def _fleet_for(cluster: ControlPlane, ns: str, fleet: Fleet) -> None:
    for agent in fleet.agents:
        add_agent_pod(cluster, ns, agent)
    manifest = fleet_manifest()
    manifest["spec"]["sources"] = {"allow": [f"oci://{fleet.proxy.address}/team"]}
    apply(cluster, ns, manifest)


def test_a_tag_moved_after_resolution_is_refused_on_every_later_load(
    kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...], fleet: Fleet, operator: OperatorProcess
) -> None:
    ns = kube_namespace
    _fleet_for(kube_cluster, ns, fleet)
    first, second = make_adapter(fleet.work, "first", seed=41), make_adapter(fleet.work, "second", seed=42)
    first_digest = fleet.registry.push_adapter(f"team/{ns}-moving", "stable", first)
    uri = f"oci://{fleet.proxy.address}/team/{ns}-moving:stable"
    manifest = adapter_manifest("moving", Path("/unused"))
    manifest["spec"]["source"] = {"uri": uri}
    apply(kube_cluster, ns, manifest)

    # The first manifest request passed; the loads that came after it wait at the proxy.
    wait_for(lambda: fleet.proxy.holding >= 1, 120, "a load to wait at the registry", operator)
    recorded_while_held = status(kube_cluster, ns, "moving").get("source")
    held_while_recorded = [_held_weights(agent, f"{ns}.moving") for agent in fleet.agents]
    second_digest = fleet.registry.push_adapter(f"team/{ns}-moving", "stable", second)  # the tag moves
    fleet.proxy.release.set()

    def settled() -> bool:
        agents = status(kube_cluster, ns, "moving").get("agents") or []
        return len(agents) == 2 and all(a.get("state") in ("Loaded", "Failed") for a in agents)

    wait_for(settled, 120, "both agents' loads to end", operator)
    weights = {agent.name: _held_weights(agent, f"{ns}.moving") for agent in fleet.agents}
    second_weights = _sha256(second / ADAPTER_WEIGHTS)
    assert second_weights not in weights.values(), f"an agent loaded what the tag named after it was resolved: {weights}"
    st = status(kube_cluster, ns, "moving")
    assert st.get("source") == {"uri": uri, "revision": first_digest}, st
    assert recorded_while_held == {"uri": uri, "revision": first_digest}, "status.source was not recorded before the loads"
    assert held_while_recorded == ["", ""]
    for agent in st["agents"]:
        if agent["state"] == "Failed":
            assert f"names {second_digest} now, not {first_digest}" in agent["message"], agent
    assert st["phase"] == "Failed" and set(weights.values()) == {""}, (st["phase"], weights)


def test_a_source_refused_at_resolution_is_the_status_and_no_load_is_sent(
    kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...], fleet: Fleet, operator: OperatorProcess
) -> None:
    """The adapter is Ready from a good artifact; its spec then names one with a pickle file.
    The refusal at resolution is every agent's result, no load is sent, and the status says
    which version the agents still serve (the earlier URI's), as a refused load's would."""
    ns = kube_namespace
    fleet.proxy.passes = 1000  # nothing held
    _fleet_for(kube_cluster, ns, fleet)
    good_uri = f"oci://{fleet.proxy.address}/team/{ns}-good:v1"
    fleet.registry.push_adapter(f"team/{ns}-good", "v1", make_adapter(fleet.work, "good", seed=44))
    manifest = adapter_manifest("pickled", Path("/unused"))
    manifest["spec"]["source"] = {"uri": good_uri}
    apply(kube_cluster, ns, manifest)
    wait_for(lambda: status(kube_cluster, ns, "pickled").get("phase") == "Ready", 120, "the good version Ready", operator)
    loads_before = operator.agent_calls("LoadAdapter") + operator.agent_calls("LoadAdapters")

    adapter = make_adapter(fleet.work, "pickled", seed=43)
    (adapter / "adapter_model.bin").write_bytes((adapter / ADAPTER_WEIGHTS).read_bytes())
    fleet.registry.push_artifact(
        f"team/{ns}-pickled", "v1", adapter, {"adapter_config.json": CONFIG_MEDIA_TYPE, "adapter_model.bin": "application/octet-stream"}
    )
    manifest["spec"]["source"] = {"uri": f"oci://{fleet.proxy.address}/team/{ns}-pickled:v1"}
    apply(kube_cluster, ns, manifest)

    wait_for(
        lambda: all("pickle" in a.get("message", "") for a in status(kube_cluster, ns, "pickled").get("agents") or [{}]),
        120,
        "the refusal in every agent's result",
        operator,
    )
    st = status(kube_cluster, ns, "pickled")
    assert [a["state"] for a in st["agents"]] == ["Failed", "Failed"], st
    assert all("holds a pickle file" in a["message"] for a in st["agents"]), st
    assert [a.get("served", {}).get("uri") for a in st["agents"]] == [good_uri, good_uri], st
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "PreviousVersionServed" and good_uri in ready["message"], ready
    assert st["source"]["uri"] == good_uri, "the refused URI recorded no revision"
    assert operator.agent_calls("LoadAdapter") + operator.agent_calls("LoadAdapters") == loads_before
    assert operator.agent_calls("ResolveSource") >= 2


def test_an_agent_busy_for_control_calls_passes_the_resolution_to_the_next(
    kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...], busy_first: BusyFirst, operator: OperatorProcess
) -> None:
    """agent-0, asked first, has its one control place taken (a load held at the source), so it
    refuses the ResolveSource with RESOURCE_EXHAUSTED: agent-1 is asked and answers, the digest
    is recorded, and agent-1 loads it while agent-0 is still busy. Once the place is free,
    agent-0's load (retried on the transient back-off) loads the recorded digest too."""
    ns, fleet = kube_namespace, busy_first.fleet
    fleet.proxy.passes = 1000  # nothing held at the registry
    holder = threading.Thread(target=_load_held, args=(fleet.agents[0], busy_first.source.url("hold/side")), daemon=True)
    holder.start()
    wait_for(lambda: busy_first.source.holding >= 1, 120, "agent-0's control place taken by a held load", operator)
    _fleet_for(kube_cluster, ns, fleet)
    adapter = make_adapter(fleet.work, "passed", seed=45)
    digest = fleet.registry.push_adapter(f"team/{ns}-passed", "v1", adapter)
    uri = f"oci://{fleet.proxy.address}/team/{ns}-passed:v1"
    manifest = adapter_manifest("passed", Path("/unused"))
    manifest["spec"]["source"] = {"uri": uri}
    apply(kube_cluster, ns, manifest)

    def states() -> dict[str, str]:
        return {a["pod"]: a.get("state", "") for a in status(kube_cluster, ns, "passed").get("agents") or []}

    wait_for(lambda: states().get("agent-0") not in (None, "Pending", "Loading"), 120, "agent-0's first result", operator)
    st = status(kube_cluster, ns, "passed")
    assert st.get("source") == {"uri": uri, "revision": digest}, f"the resolution was not passed on to agent-1: {st}"
    busy = next(a for a in st["agents"] if a["pod"] == "agent-0")
    assert busy["state"] != "Loaded" and "too many concurrent control calls" in busy["message"], busy
    assert busy_first.source.holding >= 1, "agent-0's place was freed before its first result"
    assert _resolutions(operator, "RESOURCE_EXHAUSTED") >= 1 and _resolutions(operator, "OK") == 1

    busy_first.source.release.set()
    holder.join(120)
    wait_for(lambda: set(states().values()) == {"Loaded"} and len(states()) == 2, 120, "both agents Loaded", operator)
    st = status(kube_cluster, ns, "passed")
    assert st.get("source") == {"uri": uri, "revision": digest}, st
    weights = _sha256(adapter / ADAPTER_WEIGHTS)
    assert [_held_weights(agent, f"{ns}.passed") for agent in fleet.agents] == [weights, weights]
    assert _resolutions(operator, "OK") == 1, "the recorded digest was resolved again"


def _load_held(agent: AgentProcess, uri: str) -> None:
    """A LoadAdapter straight to the agent of a source that holds it (its failure once the
    source lets go is expected: only the control place it held matters)."""
    channel, agent_stub = stub(agent)
    with channel, contextlib.suppress(grpc.RpcError):
        agent_stub.LoadAdapter(agent_pb2.LoadAdapterRequest(name="side.held", source_uri=uri, sha256="0" * 64), timeout=180)


def _resolutions(operator: OperatorProcess, code: str) -> float:
    """The operator's ResolveSource calls that ended with this status code."""
    return sum(
        v
        for k, v in operator.metrics().items()
        if k.startswith("lorafleet_agent_calls_total{") and 'method="ResolveSource"' in k and f'code="{code}"' in k
    )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
