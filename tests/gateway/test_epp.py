"""lorafleet behind the Gateway API Inference Extension's real endpoint picker (EPP v1.5.0, built
by scripts/build-epp.sh from its Go module): the session's real control plane holds an
InferencePool whose Pods are three real agents (builtin engine) on loopback addresses of their
own, the EPP scrapes their ``/metrics``, and an ext_proc client stands in for Envoy: it asks the
EPP for an endpoint, then sends the request there with the official ``openai`` client.

Topology: tp=1, dp=1 per agent. The EPP sees a pod as one endpoint whatever its ranks, so more
ranks would test nothing more here and cost three times the processes on a shared 2-core machine;
two device slots per agent (``--max-loras-per-batch`` and ``--max-loaded-loras`` 2) against four
fleet adapters, so serving every adapter everywhere needs loads on first request and evictions.

Placement is driven straight through each agent's gRPC LoadAdapter: every fleet adapter is
resident on some agents and on standby (``standby=true``) on the others, as the operator will
place adapters with ``spec.scaling.minReplicas: 0``. One more adapter, ``gw.solo``, is placed the
way fixed replicas are (pinned on one agent, absent elsewhere): the picker's assumption that any
pod serves any adapter does not hold for it, which the subset hint built from lorafleet's
EndpointSlices repairs.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import openai
import pytest

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from lorafleet_dev.agents import AgentProcess, AgentSpec
from lorafleet_dev.epp import EppProcess, PoolSpec, create_inference_pool, epp_build, install_pool_crds, start_epp, subset_hint
from lorafleet_dev.ext_proc import ExtProcClient, Pick, ProxiedRequest
from lorafleet_dev.processes import HarnessError, free_port
from lorafleet_operator.resources import ObjectRef
from lorafleet_operator.routing import RoutedPod, desired_slices
from tests.agent.helpers import make_adapter, make_model
from tests.kube.harness import ControlPlane

TOKEN = "gateway-test-token"
BASE = "tiny-llama"
SLOTS = 2
AGENTS = {"agent-0": "127.0.0.2", "agent-1": "127.0.0.3", "agent-2": "127.0.0.4"}
FLEET = ("gw.f0", "gw.f1", "gw.f2", "gw.f3")
#: Where each fleet adapter is resident; on every other agent it is on standby.
RESIDENT = {"agent-0": ("gw.f0", "gw.f1"), "agent-1": ("gw.f2",), "agent-2": ()}
HOT = "gw.f2"
SOLO, SOLO_AGENT = "gw.solo", "agent-2"
PROMPT = "w5 w6 w7 w8"


@dataclass
class Gateway:
    """The agents (by pod name), their HTTP port (the pool's target port), the EPP and its client;
    one gRPC channel and one OpenAI client per agent, closed by :meth:`close`."""

    agents: dict[str, AgentProcess]
    http_port: int
    epp: EppProcess
    picker: ExtProcClient
    namespace: str
    channels: dict[str, grpc.Channel] = field(default_factory=dict)
    clients: dict[str, openai.OpenAI] = field(default_factory=dict)

    def agent_at(self, endpoint: str | None) -> str:
        """The pod behind an endpoint the EPP picked (``ip:port``)."""
        assert endpoint is not None, "the EPP picked no endpoint"
        ip, _, port = endpoint.rpartition(":")
        assert int(port) == self.http_port, endpoint
        return next(name for name, address in AGENTS.items() if address == ip)

    def client(self, pod: str) -> openai.OpenAI:
        """The official OpenAI client of one agent's HTTP API."""
        if pod not in self.clients:
            url = f"http://{AGENTS[pod]}:{self.http_port}/v1"
            self.clients[pod] = openai.OpenAI(base_url=url, api_key=TOKEN, max_retries=0, timeout=120)
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
        reply = self.stub(pod).ListAdapters(pb.ListAdaptersRequest(), timeout=30, metadata=_auth())
        return {a.name: a.residency for a in reply.adapters}

    def pick(self, adapter: str, subset: tuple[str, ...] = ()) -> Pick:
        return self.picker.pick(ProxiedRequest({"model": adapter, "prompt": PROMPT, "max_tokens": 4}, subset=subset))


def _auth() -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {TOKEN}"),)


def _load(gateway: Gateway, pod: str, name: str, root: Path, **fields: bool) -> None:
    request = pb.LoadAdapterRequest(name=name, source_uri=(root / name).as_uri(), **fields)
    reply = gateway.stub(pod).LoadAdapter(request, timeout=120, metadata=_auth())
    assert reply.success, f"{pod} {name}: {reply.error_message}"


def _start_agents(base: Path, http_port: int) -> dict[str, AgentProcess]:
    token = base / "token"
    token.write_text(TOKEN)
    root = base / "adapters"
    for seed, name in enumerate((*FLEET, SOLO)):
        make_adapter(root / name, seed=700 + seed)
    spec = AgentSpec(model_dir=make_model(base / BASE), adapter_roots=(root,), base_model_name=BASE, tp=1, dp=1, max_loaded_loras=SLOTS)
    agents = {}
    for name, ip in AGENTS.items():
        flags = ("--http-listen", f"{ip}:{http_port}", "--auth-token-file", str(token), "--max-loras-per-batch", str(SLOTS))
        agents[name] = AgentProcess(name, replace(spec, host=ip, extra_args=flags), base / "logs").start()
    try:
        for agent in agents.values():
            agent.wait_ready()
    except BaseException:
        for agent in agents.values():
            agent.stop()
        raise
    return agents


def _place(gateway: Gateway, root: Path) -> None:
    """Fleet adapters resident where RESIDENT says, standby elsewhere; SOLO pinned on one agent."""
    for pod, resident in RESIDENT.items():
        for name in FLEET:
            _load(gateway, pod, name, root, standby=name not in resident)
    _load(gateway, SOLO_AGENT, SOLO, root, pinned=True)


@pytest.fixture(scope="module")
def gateway(kube_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    try:
        build = epp_build()
    except HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    base = tmp_path_factory.mktemp("gateway")
    install_pool_crds(kube_cluster, build)
    namespace = kube_cluster.create_namespace(prefix="gw")
    http_port = free_port()
    agents = _start_agents(base, http_port)
    epp = gateway = None
    try:
        for name, ip in AGENTS.items():
            kube_cluster.create_agent_pod(namespace, name, http_port, ip=ip, port_name="http")
        pool = PoolSpec(namespace, "lorafleet", {"app.kubernetes.io/name": "lorafleet-agent"}, http_port)
        create_inference_pool(kube_cluster, pool, picker_port=9002)
        epp = start_epp(kube_cluster, build, pool, base / "logs")
        gateway = Gateway(agents, http_port, epp, ExtProcClient(epp.address, build.descriptors), namespace)
        _place(gateway, base / "adapters")
        epp.wait_for_view(
            "the EPP to scrape every agent", lambda views: all(views.get(a) and views[a].max_adapters == SLOTS for a in AGENTS)
        )
        yield gateway
    finally:
        if gateway is not None:
            gateway.close()
        if epp is not None:
            epp.stop()
        for agent in agents.values():
            agent.stop()
        kube_cluster.delete_namespace(namespace)


def _forward(gateway: Gateway, pod: str, adapter: str) -> int:
    """Send the request to the picked agent as the gateway would; the HTTP status it answers."""
    try:
        completion = gateway.client(pod).completions.create(model=adapter, prompt=PROMPT, max_tokens=4)
    except openai.APIStatusError as err:
        return err.status_code
    assert completion.model == adapter, completion
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
            before = gateway.residency(pod).get(adapter, pb.ADAPTER_RESIDENCY_UNSPECIFIED)
            statuses[_forward(gateway, pod, adapter)] += 1
            served[pod, "absent" if before == pb.ADAPTER_RESIDENCY_UNSPECIFIED else pb.AdapterResidency.Name(before)] += 1
    assert statuses == {200: 6 * len(FLEET)}, served
    # Some were loaded on first request, and the picks spread: nothing here pins them.
    assert sum(n for (_, residency), n in served.items() if residency == "ADAPTER_RESIDENCY_STANDBY") >= 1, served
    assert len({pod for pod, _ in served}) >= 2, served


def _keep_busy(gateway: Gateway, pod: str, adapter: str, stop: threading.Event) -> None:
    """Streams for ``adapter`` on ``pod``, one after another until ``stop``: live traffic."""
    client = gateway.client(pod)
    while not stop.is_set():
        with client.completions.create(model=adapter, prompt=PROMPT, max_tokens=1024, stream=True) as stream:
            for _ in stream:
                if stop.is_set():
                    break


def test_requests_for_a_hot_adapter_go_to_its_holder(gateway: Gateway) -> None:
    """While HOT has requests running on agent-1 only (two overlapping streams, so every scrape
    sees it there), the LoRA-affinity scorer sends every new request for it to agent-1, though
    the other agents could load it from standby."""
    stop = threading.Event()
    workers = [threading.Thread(target=_keep_busy, args=(gateway, "agent-1", HOT, stop)) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        gateway.epp.wait_for_view(f"the EPP to see {HOT} running on agent-1", lambda views: HOT in views["agent-1"].running_adapters)
        picks = Counter(gateway.agent_at(gateway.pick(HOT).endpoint) for _ in range(20))
        answered = Counter(_forward(gateway, "agent-1", HOT) for _ in range(2))
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    assert picks == {"agent-1": 20}, picks
    assert answered == {200: 2}


def _solo_hint(gateway: Gateway) -> tuple[str, ...]:
    """The subset hint for SOLO from lorafleet's EndpointSlices: the operator's own
    `desired_slices` over the pods whose agent holds it resident (what its `routed_pods` picks;
    the API server refuses loopback addresses in a slice, so these are built, not stored)."""
    holders = [
        RoutedPod(pod, f"uid-{pod}", AGENTS[pod], (("grpc", agent.port), ("http", gateway.http_port)))
        for pod, agent in gateway.agents.items()
        if gateway.residency(pod).get(SOLO) == pb.ADAPTER_RESIDENCY_RESIDENT
    ]
    slices = desired_slices(ObjectRef("LoraAdapter", gateway.namespace, "solo", "uid-solo"), "lorafleet-adapters", holders)
    return subset_hint(slices)


def _pick_and_forward(gateway: Gateway, adapter: str, hint: tuple[str, ...] = ()) -> tuple[str, int]:
    """Where the EPP sends one request, and what that agent answers."""
    pod = gateway.agent_at(gateway.pick(adapter, hint).endpoint)
    return pod, _forward(gateway, pod, adapter)


def test_subset_hint_from_endpoint_slices_routes_to_holders(gateway: Gateway) -> None:
    """SOLO is placed the fixed-replicas way (on agent-2 only). Without a hint the EPP sends its
    requests anywhere and the agents without it answer 404; with the hint built from its
    EndpointSlices every request goes to agent-2 and is answered."""
    hint = _solo_hint(gateway)
    assert hint == (f"{AGENTS[SOLO_AGENT]}:{gateway.http_port}",)
    unhinted = Counter(_pick_and_forward(gateway, SOLO) for _ in range(12))
    hinted = Counter(_pick_and_forward(gateway, SOLO, hint) for _ in range(12))
    assert hinted == {(SOLO_AGENT, 200): 12}, hinted
    assert all(status == 404 for (pod, status) in unhinted if pod != SOLO_AGENT), unhinted
    assert sum(n for (pod, _), n in unhinted.items() if pod != SOLO_AGENT) >= 1, unhinted
