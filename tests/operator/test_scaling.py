"""Scaling by demand (docs/scaling.md): ``spec.scaling`` on LoraAdapter, the operator sampling
its agents' demand (AdapterStats) at each drift check, and the replicas following it through
placement. Real operator, real API server, two real agents (tp=2, dp=2), traffic from
concurrent Generate calls straight to the agents.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from lorafleet.v1 import agent_pb2
from lorafleet_dev.agents import AgentProcess
from lorafleet_dev.node import machine_ip
from tests.agent.helpers import Polled
from tests.kube.harness import ControlPlane, KubectlError
from tests.operator.agents import (
    adapter_manifest,
    agent_spec,
    apply,
    fleet_manifest,
    make_adapter,
    registry,
    serving,
    status,
    stub,
)
from tests.operator.conftest import OperatorProcess, start_operator, wait_for
from tests.operator.test_routing import add_pod, endpoints

#: Short windows so that the test is quick (the spec's own fields, not the defaults).
SCALING = {
    "minReplicas": 1,
    "maxReplicas": 2,
    "target": {"metric": "Requests", "perReplica": 1},
    "behavior": {
        "scaleDown": {"stabilizationWindowSeconds": 3},
        "scaleUp": {"replicas": 1, "periodSeconds": 1},
        "demandSmoothingSeconds": 0,
    },
}


STANDBY = {**SCALING, "minReplicas": 0}
STANDBY_STATE = agent_pb2.ADAPTER_RESIDENCY_STANDBY


@pytest.fixture(scope="module")
def routed_agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[AgentProcess], Path]]:
    """Two agents (tp=2, dp=2) on the machine's own address (EndpointSlices refuse loopback)."""
    root = tmp_path_factory.mktemp("standby-agents")
    spec, adapters = agent_spec(root, host=machine_ip(), max_loaded_loras=4)
    agents = [AgentProcess(f"agent-{i}", spec, root / "logs") for i in range(2)]
    with serving(agents):
        yield agents, adapters


def scaled(name: str, path: Path, scaling: dict[str, Any]) -> dict[str, Any]:
    body = adapter_manifest(name, path)
    return {**body, "spec": {**body["spec"], "scaling": scaling}}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"replicas": 2}, "spec.replicas and spec.scaling are exclusive"),
        ({"scaling": {**SCALING, "minReplicas": 3}}, "minReplicas must be at most maxReplicas"),
        ({"scaling": {**SCALING, "target": {"perReplica": 0}}}, "perReplica"),
        ({"scaling": {**SCALING, "target": {"metric": "Watts", "perReplica": 1}}}, "Unsupported value"),
    ],
)
def test_the_api_server_refuses_a_bad_scaling_spec(
    kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...], tmp_path: Path, extra: dict[str, Any], message: str
) -> None:
    body = scaled("bad", tmp_path, SCALING)
    with pytest.raises(KubectlError) as err:
        apply(kube_cluster, kube_namespace, {**body, "spec": {**body["spec"], **extra}})
    assert message in err.value.stderr


def test_the_defaults_are_written_into_the_spec(
    kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...], tmp_path: Path
) -> None:
    apply(kube_cluster, kube_namespace, scaled("plain", tmp_path, {"maxReplicas": 3, "target": {"perReplica": 4}}))
    spec = kube_cluster.kubectl_json("get", "la", "plain", "-n", kube_namespace)["spec"]["scaling"]
    assert spec == {
        "minReplicas": 1,
        "maxReplicas": 3,
        "target": {"metric": "Requests", "perReplica": 4},
        "behavior": {
            "scaleDown": {"stabilizationWindowSeconds": 300},
            "scaleUp": {"replicas": 4, "periodSeconds": 15},
            "demandSmoothingSeconds": 150,
        },
    }


class Traffic:
    """Concurrent Generate calls for one adapter, each to the agents that hold it, in turn,
    until stopped; counts the answers and the refusals."""

    def __init__(self, agents: list[AgentProcess], adapter: str, streams: int) -> None:
        self.agents, self.adapter = agents, adapter
        self.stop = threading.Event()
        self.answered = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(streams)]

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()

    def _run(self, index: int) -> None:
        turn = index
        while not self.stop.is_set():
            agent = self.agents[turn % len(self.agents)]
            turn += 1
            if self.adapter not in registry(agent):
                continue
            channel, agent_stub = stub(agent)
            with channel:
                request = agent_pb2.GenerateRequest(token_ids=[1, 2, 3], adapter=self.adapter, max_new_tokens=48)
                try:
                    for _ in agent_stub.Generate(request, timeout=60):
                        pass
                except grpc.RpcError:
                    continue  # unloaded by a scale-down meanwhile: the next turn finds another
            with self.lock:
                self.answered += 1


@contextlib.contextmanager
def operating(cluster: ControlPlane, ns: str, agents: list[AgentProcess], work_dir: Path) -> Iterator[OperatorProcess]:
    """The agents' pods (at their addresses), the fleet, and the operator; on the way out the
    adapters deleted (unloaded from the shared agents) and the operator stopped."""
    for agent in agents:
        add_pod(cluster, ns, agent)
    apply(cluster, ns, fleet_manifest())
    op = start_operator(cluster, ns, work_dir)
    try:
        yield op
    finally:
        cluster.kubectl("delete", "la", "--all", "-n", ns, "--wait=true", "--timeout=60s")
        op.stop()


def holders(agents: list[AgentProcess], name: str) -> list[str]:
    return [a.name for a in agents if name in registry(a)]


def events(cluster: ControlPlane, ns: str, reason: str) -> list[str]:
    items = cluster.kubectl_json("get", "events", "-n", ns, "--field-selector", f"reason={reason}")["items"]
    return [str(e.get("message", "")) for e in items]


def test_replicas_follow_the_traffic_up_and_back_down(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    routed_agents: tuple[list[AgentProcess], Path],
    tmp_path: Path,
) -> None:
    """An adapter with ``minReplicas: 1, maxReplicas: 2`` at 1 request per replica is placed on
    one agent; three concurrent streams of Generate calls scale it to both agents (an Event
    ``ScaledUp``, ``status.scaling``, the decisions' counter); when the traffic stops it
    goes back to one agent once the 3-second window has passed (``ScaledDown``), and stays
    there. Its EndpointSlice follows: one pod, two, one."""
    agents, root = routed_agents
    ns = kube_namespace
    name = f"{ns}.hot"
    with operating(kube_cluster, ns, agents, tmp_path) as op:
        apply(kube_cluster, ns, scaled("hot", make_adapter(root / ns, "hot"), SCALING))
        wait_for(lambda: status(kube_cluster, ns, "hot").get("phase") == "Ready", 120, "the adapter Ready", op)
        wait_for(lambda: (status(kube_cluster, ns, "hot").get("scaling") or {}).get("desiredReplicas") == 1, 60, "a first decision", op)
        assert len(holders(agents, name)) == 1  # the minimum, no traffic yet
        assert status(kube_cluster, ns, "hot")["scaling"]["demand"] == "0"
        wait_for(lambda: set(endpoints(kube_cluster, ns, "hot")) == set(holders(agents, name)), 60, "the slice lists its agent", op)

        with Traffic(agents, name, streams=3) as traffic:
            wait_for(lambda: len(holders(agents, name)) == 2, 120, "both agents hold the adapter under load", op)
            scaling = status(kube_cluster, ns, "hot")["scaling"]
            assert scaling["desiredReplicas"] == 2
            assert scaling["lastDecision"]["reason"] in ("ScaledUp", "ScaleUpLimited")
            assert (scaling["lastDecision"]["from"], scaling["lastDecision"]["to"]) == (1, 2)
            wait_for(lambda: traffic.answered >= 3, 120, "answers under load", op)
            wait_for(lambda: len(endpoints(kube_cluster, ns, "hot")) == 2, 60, "the slice lists both agents", op)
        assert any("1 → 2" in message for message in events(kube_cluster, ns, "ScaledUp"))
        assert op.metrics().get('lorafleet_scaling_decisions_total{direction="up"}', 0) >= 1

        wait_for(lambda: len(holders(agents, name)) == 1, 120, "back to one agent after the window", op)
        scaling = status(kube_cluster, ns, "hot")["scaling"]
        assert (scaling["desiredReplicas"], scaling["lastDecision"]["reason"]) == (1, "ScaledDown")
        wait_for(lambda: any("2 → 1" in m for m in events(kube_cluster, ns, "ScaledDown")), 30, "the ScaledDown Event", op)
        assert op.metrics()[f'lorafleet_adapter_desired_replicas{{adapter="hot",namespace="{ns}"}}'] == 1
        # Steady at the minimum: later checks move nothing.
        wait_for(checks_past(op, 3), 60, "three more drift checks", op)
        assert len(holders(agents, name)) == 1
        assert set(endpoints(kube_cluster, ns, "hot")) == set(holders(agents, name))
        assert op.metrics().get('lorafleet_scaling_decisions_total{direction="down"}', 0) == 1


# ---- standby: minReplicas 0 -----------------------------------------------------------------


def residency(agent: AgentProcess, name: str) -> str:
    """The adapter's residency as the agent's ListAdapters says: Standby, Resident, or ""."""
    channel, agent_stub = stub(agent)
    with channel:
        reply = agent_stub.ListAdapters(agent_pb2.ListAdaptersRequest(), timeout=10)
    entry = next((a for a in reply.adapters if a.name == name), None)
    return "" if entry is None else "Standby" if entry.residency == STANDBY_STATE else "Resident"


def states(cluster: ControlPlane, ns: str, name: str) -> dict[str, str]:
    return {a["pod"]: a["state"] for a in status(cluster, ns, name).get("agents") or []}


def test_on_standby_the_first_request_loads_it_and_scale_down_puts_it_back(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    routed_agents: tuple[list[AgentProcess], Path],
    tmp_path: Path,
) -> None:
    """``minReplicas: 0``: the adapter is on standby on both agents (no slot taken), Ready,
    each agent says Standby in the status, and both pods are in its EndpointSlice (room to
    load). The first request to one agent loads it there and is answered (its latency in the
    log); the drift check neither unloads it nor forces it anywhere. Traffic on both agents
    scales it to 2; when the traffic stops, after the window it is put back on standby on
    both (desired 0) in place: listed by both agents in every ListAdapters meanwhile, never
    unloaded; still routed, and a request is answered again."""
    agents, root = routed_agents
    ns = kube_namespace
    name = f"{ns}.cold"
    pods = {a.name for a in agents}
    with operating(kube_cluster, ns, agents, tmp_path) as op:
        apply(kube_cluster, ns, scaled("cold", make_adapter(root / ns, "cold"), STANDBY))
        wait_for(lambda: states(kube_cluster, ns, "cold") == dict.fromkeys(pods, "Standby"), 120, "Standby on both agents", op)
        assert [residency(a, name) for a in agents] == ["Standby", "Standby"]
        assert status(kube_cluster, ns, "cold")["phase"] == "Ready"
        wait_for(lambda: set(endpoints(kube_cluster, ns, "cold")) == pods, 60, "both pods routed while on standby", op)

        started = time.monotonic()
        channel, agent_stub = stub(agents[0])
        with channel:
            request = agent_pb2.GenerateRequest(token_ids=[1, 2, 3], adapter=name, max_new_tokens=4)
            answer = [r.token_id for r in agent_stub.Generate(request, timeout=120)]
        print(f"first request on standby: answered in {time.monotonic() - started:.2f} s (its load included)")
        assert len(answer) == 4
        assert [residency(a, name) for a in agents] == ["Resident", "Standby"]
        checks = op.drift_checks()
        wait_for(lambda: op.drift_checks() >= checks + 2, 60, "two drift checks", op)
        assert [residency(a, name) for a in agents] == ["Resident", "Standby"]  # neither stray nor forced

        unloads = op.agent_calls("UnloadAdapter")
        with Polled(lambda: [a.name for a in agents if name not in registry(a)]) as listings:
            with Traffic(agents, name, streams=3):
                wait_for(
                    lambda: (status(kube_cluster, ns, "cold").get("scaling") or {}).get("desiredReplicas") == 2, 120, "scaled to 2", op
                )
                wait_for(lambda: [residency(a, name) for a in agents] == ["Resident", "Resident"], 120, "resident on both", op)
            wait_for(lambda: [residency(a, name) for a in agents] == ["Standby", "Standby"], 120, "back on standby on both", op)
        # Put back on standby in place, not unloaded: both agents listed it in every
        # ListAdapters through the scale-up and the scale-down (an unload, then a standby load,
        # left a moment in which the agent did not know it and a request there got 404).
        assert [pod for absent in listings.results for pod in absent] == []
        assert op.agent_calls("UnloadAdapter") == unloads
        scaling = status(kube_cluster, ns, "cold")["scaling"]
        assert (scaling["desiredReplicas"], scaling["lastDecision"]["to"]) == (0, 0)
        wait_for(lambda: states(kube_cluster, ns, "cold") == dict.fromkeys(pods, "Standby"), 60, "the status says Standby", op)
        assert set(endpoints(kube_cluster, ns, "cold")) == pods
        channel, agent_stub = stub(agents[1])
        with channel:
            assert len([r.token_id for r in agent_stub.Generate(request, timeout=120)]) == 4


def checks_past(op: OperatorProcess, more: int) -> Callable[[], bool]:
    """A predicate: ``more`` drift checks finished since now."""
    target = op.drift_checks() + more
    return lambda: op.drift_checks() >= target


def loads_sent(op: OperatorProcess) -> float:
    return op.agent_calls("LoadAdapter") + op.agent_calls("LoadAdapters")


def test_oscillating_traffic_inside_the_window_moves_nothing(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    routed_agents: tuple[list[AgentProcess], Path],
    tmp_path: Path,
) -> None:
    """Scaled to 2 by traffic, an adapter whose traffic stops and starts again, each pause
    far shorter than its 60-second window, keeps its 2 agents: no ScaledDown, not one load
    sent, both agents holding it throughout (counted on their ListAdapters)."""
    agents, root = routed_agents
    ns = kube_namespace
    name = f"{ns}.osc"
    steady = {**SCALING, "behavior": {**SCALING["behavior"], "scaleDown": {"stabilizationWindowSeconds": 60}}}
    with operating(kube_cluster, ns, agents, tmp_path) as op:
        apply(kube_cluster, ns, scaled("osc", make_adapter(root / ns, "osc"), steady))
        wait_for(lambda: status(kube_cluster, ns, "osc").get("phase") == "Ready", 120, "the adapter Ready", op)
        with Traffic(agents, name, streams=3):
            wait_for(lambda: len(holders(agents, name)) == 2, 120, "both agents hold it under load", op)
        loads, downs = loads_sent(op), op.metrics().get('lorafleet_scaling_decisions_total{direction="down"}', 0)
        held = []
        for _ in range(4):  # pauses of about 1 s, then traffic again until a drift check saw it
            time.sleep(1)
            held.append(len(holders(agents, name)))
            with Traffic(agents, name, streams=3):
                wait_for(checks_past(op, 2), 60, "two drift checks under traffic", op)
            held.append(len(holders(agents, name)))
        assert held == [2] * 8
        assert loads_sent(op) == loads
        assert op.metrics().get('lorafleet_scaling_decisions_total{direction="down"}', 0) == downs
        assert status(kube_cluster, ns, "osc")["scaling"]["desiredReplicas"] == 2


def test_standby_adapters_beyond_the_slots_answer_every_request(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    routed_agents: tuple[list[AgentProcess], Path],
    tmp_path: Path,
) -> None:
    """Six standby adapters on agents of 4 slots each (demand kept far below one replica, so
    the operator sends no resident load): two concurrent requests for each in turn, twice
    round, on one agent, are every one answered (the agent loads each on its first request,
    evicting the least recently used idle one when full, and the second request waits for
    that load); the operator forces none back and unloads none; each agent holds at most its
    4 resident. (Concurrent first requests of different adapters on a full agent are the
    agent's own test: tests/agent/test_standby_races.py.)"""
    agents, root = routed_agents
    ns = kube_namespace
    names = [f"s{i}" for i in range(6)]
    quiet = {**STANDBY, "target": {"perReplica": 1000}}
    with operating(kube_cluster, ns, agents, tmp_path) as op:
        apply(kube_cluster, ns, *(scaled(n, make_adapter(root / ns, n, seed=i), quiet) for i, n in enumerate(names)))
        wait_for(lambda: all(status(kube_cluster, ns, n).get("phase") == "Ready" for n in names), 120, "all Ready on standby", op)
        loads = loads_sent(op)
        answered: list[str] = []
        failed: list[str] = []

        def ask(adapter: str) -> None:
            channel, agent_stub = stub(agents[0])
            with channel:
                request = agent_pb2.GenerateRequest(token_ids=[1, 2, 3], adapter=f"{ns}.{adapter}", max_new_tokens=4)
                try:
                    replies = list(agent_stub.Generate(request, timeout=120))
                except grpc.RpcError as err:
                    failed.append(f"{adapter}: {err.code()} {err.details()}")
                    return
            (answered if len(replies) == 4 else failed).append(adapter)

        for adapter in names * 2:
            pair = [threading.Thread(target=ask, args=(adapter,)) for _ in range(2)]
            for thread in pair:
                thread.start()
            for thread in pair:
                thread.join()
        assert not failed and sorted(answered) == sorted(names * 4)
        wait_for(checks_past(op, 3), 60, "three drift checks", op)
        assert loads_sent(op) == loads  # nothing forced back into a slot
        for agent in agents:
            held = [residency(agent, f"{ns}.{n}") for n in names]
            assert "" not in held, held  # none unloaded
            assert held.count("Resident") <= 4, held
        assert [residency(agents[0], f"{ns}.{n}") for n in names].count("Resident") == 4
