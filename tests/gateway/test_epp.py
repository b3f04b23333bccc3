"""lorafleet behind the Gateway API Inference Extension's real endpoint picker (EPP v1.5.0, built
by scripts/build-epp.sh from its Go module), with lorafleet's operator placing the adapters: the
session's real control plane holds a LoraFleet, its LoraAdapters and an InferencePool whose Pods
are three real agents (builtin engine), each on an address of its own (198.18.38.x on ``lo``,
:mod:`lorafleet_dev.addresses`: the API server refuses loopback addresses in EndpointSlices).
The real operator places the adapters and writes their EndpointSlices, the EPP scrapes the
agents' ``/metrics``, and an ext_proc client stands in for Envoy: it asks the EPP for an
endpoint, then sends the request there with the official ``openai`` client.

Topology: tp=1, dp=1 per agent. The EPP sees a pod as one endpoint whatever its ranks, so more
ranks would test nothing more here and cost three times the processes on a shared 2-core machine;
two device slots per agent (``--max-loras-per-batch`` and ``--max-loaded-loras`` 2) against four
fleet adapters, so serving every adapter everywhere needs loads on first request and evictions.

Placement is the operator's: the four fleet adapters have ``spec.scaling.minReplicas: 0``, so
they start on standby on every agent; a first request loads one where the EPP sent it, and once
an adapter has had requests the operator grants it one resident replica (its demand is far
below the target of 1000 per replica, which still recommends one). One more adapter, ``solo``, has
fixed ``replicas: 1`` (pinned): on one agent, absent elsewhere. The picker's assumption that
any pod serves any adapter does not hold for it, which the subset hint repairs: the test reads
the adapter's EndpointSlices back from the API server (the union of the slices labelled with it
and managed by lorafleet) and builds the hint from them.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from lorafleet_dev.addresses import local_addresses
from lorafleet_dev.agents import AgentProcess, AgentSpec
from lorafleet_dev.epp import (
    EppProcess,
    PoolSpec,
    adapter_slices,
    create_inference_pool,
    epp_build,
    install_pool_crds,
    start_epp,
    subset_hint,
)
from lorafleet_dev.ext_proc import ExtProcClient, Pick, ProxiedRequest
from lorafleet_dev.processes import HarnessError, free_port
from tests.agent.helpers import make_adapter, make_model
from tests.kube.harness import ControlPlane
from tests.operator.agents import FLEET_LABEL, adapter_manifest, apply, fleet_manifest, status
from tests.operator.conftest import OperatorProcess, start_operator, wait_for

BASE = "tiny-llama"
SLOTS = 2
AGENTS = {"agent-0": "198.18.38.10", "agent-1": "198.18.38.11", "agent-2": "198.18.38.12"}
POOL_SELECTOR = {"app.kubernetes.io/name": "lorafleet-agent"}
#: LoraAdapter names; the agents (and requests) name them "<namespace>.<name>".
FLEET = ("f0", "f1", "f2", "f3")
HOT, SOLO = "f2", "solo"
#: On standby everywhere; resident where a request loaded it, and on one agent once it has had
#: demand (any demand under 1000 per replica recommends one replica). The scale-down window
#: outlasts the test: nothing is put back on standby while requests are measured.
STANDBY_SCALING = {
    "minReplicas": 0,
    "maxReplicas": len(AGENTS),
    "target": {"perReplica": 1000},
    "behavior": {"scaleDown": {"stabilizationWindowSeconds": 3600}},
}
PROMPT = "w5 w6 w7 w8"


@dataclass
class Gateway:
    """The agents (by pod name), their HTTP port (the pool's target port), the EPP and its client,
    the control plane and the test namespace; one gRPC channel and one OpenAI client per agent,
    closed by :meth:`close`."""

    agents: dict[str, AgentProcess]
    http_port: int
    epp: EppProcess
    picker: ExtProcClient
    cluster: ControlPlane
    namespace: str
    channels: dict[str, grpc.Channel] = field(default_factory=dict)
    clients: dict[str, openai.OpenAI] = field(default_factory=dict)

    def model(self, adapter: str) -> str:
        """The name a request gives for a LoraAdapter of the test namespace."""
        return f"{self.namespace}.{adapter}"

    def agent_at(self, endpoint: str | None) -> str:
        """The pod behind an endpoint the EPP picked (``ip:port``)."""
        assert endpoint is not None, "the EPP picked no endpoint"
        ip, _, port = endpoint.rpartition(":")
        assert int(port) == self.http_port, endpoint
        return next(name for name, address in AGENTS.items() if address == ip)

    def client(self, pod: str) -> openai.OpenAI:
        """The official OpenAI client of one agent's HTTP API (the agents take no token)."""
        if pod not in self.clients:
            url = f"http://{AGENTS[pod]}:{self.http_port}/v1"
            self.clients[pod] = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        return self.clients[pod]

    def stub(self, pod: str) -> agent_pb2_grpc.NodeAgentStub:
        if pod not in self.channels:
            self.channels[pod] = grpc.insecure_channel(self.agents[pod].endpoint)
        return agent_pb2_grpc.NodeAgentStub(self.channels[pod])

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        for channel in self.channels.values():
            channel.close()
        self.picker.close()

    def residency(self, pod: str) -> dict[str, int]:
        """Adapter name -> residency, as the agent's ListAdapters says."""
        reply = self.stub(pod).ListAdapters(pb.ListAdaptersRequest(), timeout=30)
        return {a.name: a.residency for a in reply.adapters}

    def states(self, adapter: str) -> dict[str, str]:
        """Pod -> the adapter's state there, as the operator's status says."""
        return {a["pod"]: a["state"] for a in status(self.cluster, self.namespace, adapter).get("agents") or []}

    def hint(self, adapter: str) -> tuple[str, ...]:
        """The subset hint a gateway builds for the adapter from its EndpointSlices on the API server."""
        return subset_hint(adapter_slices(self.cluster, self.namespace, adapter))

    def pick(self, adapter: str, subset: tuple[str, ...] = ()) -> Pick:
        body = {"model": self.model(adapter), "prompt": PROMPT, "max_tokens": 4}
        return self.picker.pick(ProxiedRequest(body, subset=subset))


def _start_agents(base: Path, http_port: int) -> dict[str, AgentProcess]:
    """The three agents, each on its address, every adapter's source under one root."""
    root = base / "adapters"
    for seed, name in enumerate((*FLEET, SOLO)):
        make_adapter(root / name, seed=700 + seed)
    spec = AgentSpec(model_dir=make_model(base / BASE), adapter_roots=(root,), base_model_name=BASE, tp=1, dp=1, max_loaded_loras=SLOTS)
    agents = {}
    for name, ip in AGENTS.items():
        flags = ("--http-listen", f"{ip}:{http_port}", "--max-loras-per-batch", str(SLOTS))
        agents[name] = AgentProcess(name, replace(spec, host=ip, extra_args=flags), base / "logs").start()
    try:
        for agent in agents.values():
            agent.wait_ready()
    except BaseException:
        for agent in agents.values():
            agent.stop()
        raise
    return agents


@contextlib.contextmanager
def _serving(base: Path, http_port: int) -> Iterator[dict[str, AgentProcess]]:
    agents = _start_agents(base, http_port)
    try:
        yield agents
    finally:
        for agent in agents.values():
            agent.stop()


def _add_pod(cluster: ControlPlane, namespace: str, agent: AgentProcess, http_port: int) -> None:
    """The agent's Pod: in the fleet and the pool, its gRPC and HTTP ports, Ready at its address."""
    labels = {**POOL_SELECTOR, FLEET_LABEL: "default"}
    cluster.create_agent_pod(namespace, agent.name, agent.port, labels=labels, ip=agent.spec.host, http_port=http_port)


def _manifests(root: Path) -> list[dict[str, Any]]:
    """The fleet (pinning allowed), the fleet adapters on standby, and SOLO on one agent, pinned."""
    fleet = fleet_manifest()
    manifests = [{**fleet, "spec": {**fleet["spec"], "pinning": {"allowed": True}}}]
    for name in FLEET:
        body = adapter_manifest(name, root / name, base_model=BASE)
        manifests.append({**body, "spec": {**body["spec"], "scaling": STANDBY_SCALING}})
    solo = adapter_manifest(SOLO, root / SOLO, base_model=BASE)
    return [*manifests, {**solo, "spec": {**solo["spec"], "replicas": 1, "pinned": True}}]


@contextlib.contextmanager
def _operating(cluster: ControlPlane, namespace: str, root: Path, work_dir: Path) -> Iterator[OperatorProcess]:
    """The fleet and its adapters, the operator placing them; on the way out the adapters
    deleted (their finalizers are the operator's) and the operator stopped."""
    apply(cluster, namespace, *_manifests(root))
    operator = start_operator(cluster, namespace, work_dir)
    try:
        yield operator
    finally:
        cluster.kubectl("delete", "la", "--all", "-n", namespace, "--wait=true", "--timeout=60s")
        operator.stop()


def _placed(gateway: Gateway) -> bool:
    """The operator's placement is done and published: every fleet adapter Standby on every
    agent and routed to all of them, SOLO Loaded on one agent and routed there alone."""
    everywhere = tuple(sorted(f"{ip}:{gateway.http_port}" for ip in AGENTS.values()))
    for name in FLEET:
        if gateway.states(name) != dict.fromkeys(AGENTS, "Standby") or gateway.hint(name) != everywhere:
            return False
    solo = [pod for pod, state in gateway.states(SOLO).items() if state == "Loaded"]
    return len(solo) == 1 and gateway.hint(SOLO) == (f"{AGENTS[solo[0]]}:{gateway.http_port}",)


@pytest.fixture(scope="module")
def gateway(kube_cluster: ControlPlane, lorafleet_crds: tuple[str, ...], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    try:
        build = epp_build()
    except HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    base = tmp_path_factory.mktemp("gateway")
    install_pool_crds(kube_cluster, build)
    namespace = kube_cluster.create_namespace(prefix="gw")
    http_port = free_port()
    with contextlib.ExitStack() as stack:
        stack.callback(kube_cluster.delete_namespace, namespace)
        stack.enter_context(local_addresses(tuple(AGENTS.values())))
        agents = stack.enter_context(_serving(base, http_port))
        for agent in agents.values():
            _add_pod(kube_cluster, namespace, agent, http_port)
        operator = stack.enter_context(_operating(kube_cluster, namespace, base / "adapters", base / "logs"))
        pool = PoolSpec(namespace, "lorafleet", POOL_SELECTOR, http_port)
        create_inference_pool(kube_cluster, pool, picker_port=9002)
        epp = start_epp(kube_cluster, build, pool, base / "logs")
        stack.callback(epp.stop)
        gateway = Gateway(agents, http_port, epp, ExtProcClient(epp.address, build.descriptors), kube_cluster, namespace)
        stack.callback(gateway.close)
        wait_for(lambda: _placed(gateway), 180, "the operator to place every adapter and publish its slices", operator)
        epp.wait_for_view(
            "the EPP to scrape every agent", lambda views: all(views.get(a) and views[a].max_adapters == SLOTS for a in AGENTS)
        )
        yield gateway


def _forward(gateway: Gateway, pod: str, adapter: str) -> int:
    """Send the request to the picked agent as the gateway would; the HTTP status it answers."""
    try:
        completion = gateway.client(pod).completions.create(model=gateway.model(adapter), prompt=PROMPT, max_tokens=4)
    except openai.APIStatusError as err:
        return err.status_code
    assert completion.model == gateway.model(adapter), completion
    return 200


def test_every_fleet_request_is_answered_by_the_picked_agent(gateway: Gateway) -> None:
    """Requests for the fleet's adapters, idle (every agent scores the same for them), go where
    the EPP picks; each is answered there, from a resident adapter or one loaded on first
    request (evicting an idle one: two slots, four adapters), never 404."""
    statuses: Counter[int] = Counter()
    served: Counter[tuple[str, str]] = Counter()  # (pod, the adapter's residency there before the request)
    for _ in range(6):
        for adapter in FLEET:
            pod = gateway.agent_at(gateway.pick(adapter).endpoint)
            before = gateway.residency(pod).get(gateway.model(adapter), pb.ADAPTER_RESIDENCY_UNSPECIFIED)
            statuses[_forward(gateway, pod, adapter)] += 1
            served[pod, "absent" if before == pb.ADAPTER_RESIDENCY_UNSPECIFIED else pb.AdapterResidency.Name(before)] += 1
    print(f"fleet requests: {dict(statuses)}; served by (pod, residency before): {dict(served)}")
    assert statuses == {200: 6 * len(FLEET)}, served
    # Some were loaded on first request, and the picks spread: nothing here pins them.
    assert sum(n for (_, residency), n in served.items() if residency == "ADAPTER_RESIDENCY_STANDBY") >= 1, served
    assert len({pod for pod, _ in served}) >= 2, served


def _keep_busy(gateway: Gateway, pod: str, adapter: str, stop: threading.Event) -> None:
    """Streams for ``adapter`` on ``pod``, one after another until ``stop``: live traffic."""
    client = gateway.client(pod)
    while not stop.is_set():
        with client.completions.create(model=gateway.model(adapter), prompt=PROMPT, max_tokens=1024, stream=True) as stream:
            for _ in stream:
                if stop.is_set():
                    break


def test_requests_for_a_hot_adapter_go_to_its_holder(gateway: Gateway) -> None:
    """While HOT has requests running on agent-1 only (two overlapping streams, so every scrape
    sees it there; agent-1 holds it resident), the LoRA-affinity scorer sends every new request
    for it to agent-1, though the other agents could load it from standby."""
    stop = threading.Event()
    workers = [threading.Thread(target=_keep_busy, args=(gateway, "agent-1", HOT, stop)) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        gateway.epp.wait_for_view(
            f"the EPP to see {HOT} running on agent-1", lambda views: gateway.model(HOT) in views["agent-1"].running_adapters
        )
        holders = [pod for pod in AGENTS if gateway.residency(pod).get(gateway.model(HOT)) == pb.ADAPTER_RESIDENCY_RESIDENT]
        picks = Counter(gateway.agent_at(gateway.pick(HOT).endpoint) for _ in range(20))
        answered = Counter(_forward(gateway, "agent-1", HOT) for _ in range(2))
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    print(f"hot adapter picks: {dict(picks)} (resident on {holders})")
    assert "agent-1" in holders, holders
    assert picks == {"agent-1": 20}, picks
    assert answered == {200: 2}


def _pick_and_forward(gateway: Gateway, adapter: str, hint: tuple[str, ...] = ()) -> tuple[str, int]:
    """Where the EPP sends one request, and what that agent answers."""
    pod = gateway.agent_at(gateway.pick(adapter, hint).endpoint)
    return pod, _forward(gateway, pod, adapter)


def _unhinted(gateway: Gateway, adapter: str, holder: str) -> Counter[tuple[str, int]]:
    """Requests for ``adapter`` sent without a hint, until three went elsewhere than ``holder``
    (the picks among equal pods are the EPP's random choice, and an agent's leftover load can
    tilt them: a count, not a clock, bounds the tries)."""
    sent: Counter[tuple[str, int]] = Counter()
    for _ in range(48):
        pod, answer = _pick_and_forward(gateway, adapter)
        sent[pod, answer] += 1
        if sum(n for (other, _), n in sent.items() if other != holder) == 3:
            break
    return sent


def test_subset_hint_from_endpoint_slices_routes_to_holders(gateway: Gateway) -> None:
    """SOLO is placed by fixed replicas, on one agent. Without a hint the EPP sends its requests
    anywhere and the agents without it answer 404; with the hint built from the EndpointSlices
    the operator wrote (read back from the API server) every request goes to its agent and is
    answered. The fleet adapters' slices list every agent (on standby there with room), and
    requests hinted with them are answered too."""
    solo_agents = [pod for pod, state in gateway.states(SOLO).items() if state == "Loaded"]
    assert len(solo_agents) == 1, solo_agents
    hint = gateway.hint(SOLO)
    assert hint == (f"{AGENTS[solo_agents[0]]}:{gateway.http_port}",)
    unhinted = _unhinted(gateway, SOLO, solo_agents[0])
    hinted = Counter(_pick_and_forward(gateway, SOLO, hint) for _ in range(12))
    fleet_hints = {name: gateway.hint(name) for name in FLEET}
    fleet_hinted = Counter(_pick_and_forward(gateway, name, fleet_hints[name])[1] for name in FLEET)
    print(f"solo on {solo_agents[0]}: unhinted {dict(unhinted)}; hinted {dict(hinted)}; fleet hinted {dict(fleet_hinted)}")
    assert hinted == {(solo_agents[0], 200): 12}, hinted
    assert all(status == 404 for (pod, status) in unhinted if pod != solo_agents[0]), unhinted
    assert sum(n for (pod, _), n in unhinted.items() if pod != solo_agents[0]) >= 1, unhinted
    everywhere = tuple(sorted(f"{ip}:{gateway.http_port}" for ip in AGENTS.values()))
    assert fleet_hints == dict.fromkeys(FLEET, everywhere), fleet_hints
    assert fleet_hinted == {200: len(FLEET)}, fleet_hinted
