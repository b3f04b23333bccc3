"""Faults between the parts, end to end: the real operator, API server, etcd and agents, with
the fault-injection proxy (tests/support/faultproxy.py) between the operator and one agent, the
API server's own mechanisms for 429 and 500, and an etcd restart.

Two agents (tp=2, dp=2, CPU) are shared by the module, each with its own download cache; the
operator reaches agent-0 directly and agent-1 through a proxy (its Pod's gRPC port is the
proxy's). The tests read the truth from the agents directly (ListAdapters, not through the
proxy) and, whatever the fault, end with :func:`wait_converged`: every live LoraAdapter's status
says exactly what each agent's registry holds, and no agent holds a managed adapter that no
LoraAdapter wants. Waits are for conditions (generous deadlines), never fixed sleeps.

* a load during which the agents die (a source that SIGKILLs the agent fetching it) -> the
  adapter is Failed with reason LoadCrashedAgent after the crash budget and never sent again;
  the other adapters come back; a spec change is tried again;
* agent-1 stalls mid-load -> the operator's deadline fires, Degraded naming agent-1, then Ready;
* agent-1 partitioned (black hole) for several drift periods -> no flapping, full repair;
* the API server answers 429, then 500, for a while (the operator reaches it through a proxy
  that is pointed, for the fault, at a small HTTPS front answering those errors) -> the
  operator backs off and loses nothing;
* etcd restarted -> the operator carries on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import http.server
import importlib.metadata
import json
import os
import re
import signal
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from lorafleet_dev.agents import AgentProcess, AgentSpec
from lorafleet_dev.synthetic import write_model
from lorafleet_operator.agent_client import AgentClients
from lorafleet_operator.agent_values import AgentBackend, AgentError, Credentials
from lorafleet_operator.config import Settings
from lorafleet_operator.fleet import AgentPod
from lorafleet_operator.loads import load_each
from lorafleet_operator.resources import AdapterObject, AdapterSpec, FleetSpec, Source
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.status import AgentResult
from lorafleet_operator.unloads import UnloadOutcome, unload_from_holders
from lorafleet_operator.view import FleetView, Target
from tests.kube.harness import ControlPlane
from tests.operator.agents import (
    BASE_MODEL,
    FLEET_LABEL,
    SHAPE,
    adapter_manifest,
    apply,
    corrupt_adapter,
    fleet_manifest,
    make_adapter,
    phase,
    registry,
    status,
)
from tests.operator.conftest import OperatorProcess, start_operator, wait_for
from tests.support.faultproxy import FaultProxy

#: Short deadlines so a stalled or partitioned agent shows within seconds.
FAULT_ENV = {"LORAFLEET_LOAD_DEADLINE_SECONDS": "4", "LORAFLEET_CALL_DEADLINE_SECONDS": "2"}


@dataclass
class FaultEnv:
    agents: list[AgentProcess]
    adapters: Path


@pytest.fixture(scope="module")
def fault_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultEnv]:
    root = tmp_path_factory.mktemp("fault-agents")
    model = write_model(root / "model", SHAPE)
    adapters = root / "adapters"
    adapters.mkdir()
    spec = AgentSpec(model_dir=model, adapter_roots=(adapters,), base_model_name=BASE_MODEL)
    agents = [
        AgentProcess(name, replace(spec, extra_args=("--cache-dir", str(root / name))), root / "logs") for name in ("agent-0", "agent-1")
    ]
    for agent in agents:
        agent.start()
    try:
        for agent in agents:
            agent.wait_ready()
        yield FaultEnv(agents, adapters)
    finally:
        for agent in agents:
            agent.stop()


@dataclass
class Fleet:
    """This test's fleet: agent-0 dialled directly, agent-1 through ``proxy``."""

    ns: str
    agents: list[AgentProcess]
    proxy: FaultProxy
    adapters: Path
    restarts: dict[str, int] = field(default_factory=dict)

    @property
    def by_pod(self) -> dict[str, AgentProcess]:
        return {a.name: a for a in self.agents}


@pytest.fixture
def fleet(kube_cluster: ControlPlane, kube_namespace: str, fault_env: FaultEnv, lorafleet_crds: tuple[str, ...]) -> Iterator[Fleet]:
    agents = fault_env.agents
    for agent in agents:
        agent.wait_ready(120)
    adapters = fault_env.adapters / kube_namespace
    adapters.mkdir()
    with FaultProxy(agents[1].port) as proxy:
        for agent, port in ((agents[0], agents[0].port), (agents[1], proxy.port)):
            kube_cluster.create_agent_pod(kube_namespace, agent.name, port, labels={FLEET_LABEL: "default"})
        apply(kube_cluster, kube_namespace, fleet_manifest())
        yield Fleet(kube_namespace, agents, proxy, adapters)


@pytest.fixture
def operator(kube_cluster: ControlPlane, fleet: Fleet, tmp_path: Path) -> Iterator[OperatorProcess]:
    proc = start_operator(kube_cluster, fleet.ns, tmp_path, env=FAULT_ENV)
    try:
        yield proc
    finally:
        proc.stop()


# ---- the truth, and waiting for the status to say it ---------------------------------------------


def adapters_of(cluster: ControlPlane, ns: str) -> list[dict[str, Any]]:
    return list(cluster.kubectl_json("get", "la", "-n", ns)["items"])


def disagreement(cluster: ControlPlane, fleet: Fleet) -> str:
    """Why the statuses do not (yet) equal the agents' registries ("" when they do)."""
    items = adapters_of(cluster, fleet.ns)
    live = {i["metadata"]["name"]: i for i in items if not i["metadata"].get("deletionTimestamp")}
    wanted = {f"{fleet.ns}.{name}" for name in live}
    registries = {a.name: registry(a, fleet.ns) for a in fleet.agents}
    for pod, held in registries.items():
        if set(held) - wanted:
            return f"{pod} holds {sorted(set(held) - wanted)} that no LoraAdapter wants"
    if len(live) != len(items):
        return f"still deleting {sorted({i['metadata']['name'] for i in items} - set(live))}"
    for name, item in live.items():
        st = item.get("status") or {}
        if st.get("observedGeneration") != item["metadata"]["generation"]:
            return f"{name}: status of generation {st.get('observedGeneration')}"
        entries = {e["pod"]: e for e in st.get("agents") or []}
        for pod, held in registries.items():
            holds = len(held.get(f"{fleet.ns}.{name}", [])) == 2
            entry = entries.get(pod)
            says = bool(entry) and entry["state"] == "Loaded" and entry["ranksLoaded"] == entry["ranksTotal"] == 2
            if holds != says:
                return f"{name} on {pod}: the agent {'holds' if holds else 'lacks'} it, the status says {entry}"
    return ""


def wait_converged(cluster: ControlPlane, fleet: Fleet, op: OperatorProcess, timeout_s: float = 120) -> None:
    last = [""]

    def agreed() -> bool:
        last[0] = disagreement(cluster, fleet)
        return not last[0]

    try:
        wait_for(agreed, timeout_s, "statuses to equal the agents' registries", op)
    except pytest.fail.Exception:
        pytest.fail(f"not converged: {last[0]}\n{op.log()[-3000:]}")


def wait_phase(cluster: ControlPlane, ns: str, name: str, want: str, op: OperatorProcess, timeout_s: float = 90) -> dict[str, Any]:
    wait_for(lambda: phase(cluster, ns, name) == want, timeout_s, f"{name} {want}", op)
    return status(cluster, ns, name)


def make(fleet: Fleet, name: str, seed: int = 0) -> dict[str, Any]:
    return adapter_manifest(name, make_adapter(fleet.adapters, name, seed=seed))


# ---- 1. a load that kills its agents -----------------------------------------------------------


def _port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1], 16)


def socket_owner(client_port: int, server_port: int, agents: list[AgentProcess]) -> AgentProcess:
    """The agent whose process has the TCP connection from ``client_port`` to ``server_port``
    (read from /proc: the socket's inode, then the process holding it)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if _port_of(fields[1]) == client_port and _port_of(fields[2]) == server_port:
                inodes.add(f"socket:[{fields[9]}]")
    for agent in agents:
        pid = agent.popen.pid if agent.popen else -1
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        return agent
    raise LookupError(f"no agent holds the connection from port {client_port}")


class KillingSource:
    """An http:// adapter source whose every request kills the agent that makes it (SIGKILL of
    its process group, as an engine hang ends): a load during which the agent dies."""

    def __init__(self, agents: list[AgentProcess]) -> None:
        self.requests: list[tuple[str, str]] = []  # (path, agent killed)
        source = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                agent = socket_owner(self.client_address[1], source.port, agents)
                source.requests.append((self.path, agent.name))
                agent.kill()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> KillingSource:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def kubelet_step(cluster: ControlPlane, fleet: Fleet, timeout_s: float = 120.0) -> bool:
    """What the kubelets (one per node, each on its own) do for containers that exited: the
    pod turns NotReady at once, its process is started again, and the pod is Ready with one
    more restart once it serves. A container that exits while another restarts turns NotReady
    at once too (a kubelet does not wait for another node's pod), so the operator never sees a
    dead agent Ready with its old restart count. Returns True (for wait_for)."""
    starting: list[AgentProcess] = []
    deadline = time.monotonic() + timeout_s
    while True:
        for agent in fleet.agents:
            if all(a is not agent for a in starting) and agent.popen is not None and agent.popen.poll() is not None:
                cluster.write_pod_status(fleet.ns, agent.name, ready=False, restart_count=fleet.restarts.get(agent.name, 0))
                agent.start()
                starting.append(agent)
        for agent in [a for a in starting if a.serving()]:
            starting.remove(agent)
            fleet.restarts[agent.name] = fleet.restarts.get(agent.name, 0) + 1
            cluster.write_pod_status(fleet.ns, agent.name, ready=True, restart_count=fleet.restarts[agent.name])
        if not starting:
            return True
        if time.monotonic() > deadline:
            raise AssertionError(f"agents not serving after {timeout_s}s: {[a.name for a in starting]}")
        time.sleep(0.2)


def test_a_load_that_kills_its_agents_fails_the_adapter_and_is_not_sent_again(
    kube_cluster: ControlPlane,
    fleet: Fleet,
    operator: OperatorProcess,
) -> None:
    ns = fleet.ns
    apply(kube_cluster, ns, make(fleet, "good"))
    wait_phase(kube_cluster, ns, "good", "Ready", operator)
    with KillingSource(fleet.agents) as source:
        crasher = adapter_manifest("crasher", fleet.adapters)
        crasher["spec"]["source"]["uri"] = f"http://127.0.0.1:{source.port}/crasher"
        allowed = fleet_manifest()  # the fleet's owner allows this source (spec.sources)
        allowed["spec"]["sources"] = {"allow": [f"http://127.0.0.1:{source.port}/"]}
        apply(kube_cluster, ns, allowed, crasher)
        wait_for(
            lambda: kubelet_step(kube_cluster, fleet) and phase(kube_cluster, ns, "crasher") == "Failed",
            240,
            "the crasher to be Failed",
            operator,
            interval_s=0.5,
        )
        st = status(kube_cluster, ns, "crasher")
        ready = st["conditions"][0]
        assert (ready["status"], ready["reason"]) == ("False", "LoadCrashedAgent"), st
        assert "agent-0" in ready["message"] and "agent-1" in ready["message"], ready
        assert "until the spec changes" in ready["message"]
        # (An agent still restarting is Unreachable for a moment: what it holds is unknown.)
        wait_for(
            lambda: (
                kubelet_step(kube_cluster, fleet)
                and [a["state"] for a in status(kube_cluster, ns, "crasher")["agents"]] == ["Failed", "Failed"]
            ),
            60,
            "both agents' entries Failed",
            operator,
        )
        # Each agent died once (the budget is 2 agent processes), during its one fetch.
        assert sorted(agent for _, agent in source.requests) == ["agent-0", "agent-1"], source.requests
        assert fleet.restarts == {"agent-0": 1, "agent-1": 1}
        # The other adapter is back on the restarted agents (drift repair), and the crasher is
        # sent to no agent any more: no fetch, no death, no LoadAdapter over 8 drift checks.
        wait_for(
            lambda: kubelet_step(kube_cluster, fleet) and phase(kube_cluster, ns, "good") == "Ready", 120, "good Ready again", operator
        )
        wait_converged(kube_cluster, fleet, operator)
        calls, checks = operator.agent_calls("LoadAdapter"), operator.drift_checks()
        wait_for(lambda: operator.drift_checks() >= checks + 8, 60, "8 drift checks", operator)
        assert operator.agent_calls("LoadAdapter") == calls
        assert len(source.requests) == 2 and all(a.popen and a.popen.poll() is None for a in fleet.agents)
        assert phase(kube_cluster, ns, "crasher") == "Failed"
        events = kube_cluster.kubectl_json("get", "events", "-n", ns)["items"]
        assert any(e["reason"] == "Failed" and e["involvedObject"]["name"] == "crasher" for e in events)
    # A spec change (new generation) is tried again.
    apply(kube_cluster, ns, adapter_manifest("crasher", make_adapter(fleet.adapters, "fixed")))
    st = wait_phase(kube_cluster, ns, "crasher", "Ready", operator)
    assert st["observedGeneration"] == 2 and st["conditions"][0]["reason"] == "AllAgentsLoaded"
    wait_converged(kube_cluster, fleet, operator)


# ---- 2. an agent that stalls mid-load --------------------------------------------------------


def test_an_agent_stalling_mid_load_is_degraded_then_recovers(
    kube_cluster: ControlPlane,
    fleet: Fleet,
    operator: OperatorProcess,
) -> None:
    ns = fleet.ns
    apply(kube_cluster, ns, make(fleet, "before"))
    wait_phase(kube_cluster, ns, "before", "Ready", operator)
    assert fleet.proxy.forwarded > 0  # the operator really talks to agent-1 through the proxy
    fleet.proxy.stall()
    apply(kube_cluster, ns, make(fleet, "during", seed=1))
    st = wait_phase(kube_cluster, ns, "during", "Degraded", operator, timeout_s=60)
    by_pod = {a["pod"]: a for a in st["agents"]}
    assert by_pod["agent-0"]["state"] == "Loaded"
    assert by_pod["agent-1"]["state"] == "Unreachable", st
    assert "deadline" in by_pod["agent-1"]["message"].lower(), st
    degraded = st["conditions"][1]
    assert (degraded["status"], degraded["reason"]) == ("True", "AgentsFailing")
    assert "agent-1 (Unreachable)" in degraded["message"]
    fleet.proxy.pass_through()
    for name in ("before", "during"):
        wait_phase(kube_cluster, ns, name, "Ready", operator, timeout_s=60)
    wait_converged(kube_cluster, fleet, operator)
    assert "LoadCrashedAgent" not in json.dumps(adapters_of(kube_cluster, ns))


# ---- 3. a partition longer than the drift period -----------------------------------------------


class StatusWatch:
    """Every version of every LoraAdapter's status in a namespace (``kubectl get -w -o json``:
    one JSON object per version, back to back)."""

    def __init__(self, cluster: ControlPlane, ns: str) -> None:
        self.popen = subprocess.Popen(
            [str(cluster.bin_dir / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", "get", "la", "-n", ns, "-w", "-o", "json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.versions: list[tuple[str, str, dict[str, str]]] = []  # (name, phase, {pod: state})
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        decoder, buffer = json.JSONDecoder(), ""
        for line in self.popen.stdout:
            buffer += line
            while buffer.strip():
                try:
                    obj, end = decoder.raw_decode(buffer.lstrip())
                except ValueError:
                    break  # an incomplete object: read on
                buffer = buffer.lstrip()[end:]
                st = obj.get("status") or {}
                self.versions.append((obj["metadata"]["name"], st.get("phase", ""), {a["pod"]: a["state"] for a in st.get("agents") or []}))

    def history(self, name: str) -> list[tuple[str, dict[str, str]]]:
        """(phase, {pod: state}) of each version of ``name``, consecutive repeats dropped."""
        seen: list[tuple[str, dict[str, str]]] = []
        for version, phase_, states in list(self.versions):
            if version == name and (not seen or seen[-1] != (phase_, states)):
                seen.append((phase_, states))
        return seen

    def stop(self) -> None:
        self.popen.send_signal(signal.SIGTERM)
        self.popen.wait(10)


def test_a_partitioned_agent_does_not_flap_and_is_repaired_afterwards(
    kube_cluster: ControlPlane,
    fleet: Fleet,
    operator: OperatorProcess,
) -> None:
    ns = fleet.ns
    apply(kube_cluster, ns, make(fleet, "steady"), make(fleet, "doomed", seed=1))
    for name in ("steady", "doomed"):
        wait_phase(kube_cluster, ns, name, "Ready", operator)
    watch = StatusWatch(kube_cluster, ns)
    try:
        fleet.proxy.blackhole()
        checks = operator.drift_checks()
        # While agent-1 is cut off: one adapter deleted, one created.
        kube_cluster.kubectl("delete", "la", "doomed", "-n", ns, "--wait=false")
        apply(kube_cluster, ns, make(fleet, "newcomer", seed=2))
        wait_phase(kube_cluster, ns, "newcomer", "Degraded", operator, timeout_s=60)
        wait_phase(kube_cluster, ns, "steady", "Degraded", operator, timeout_s=60)
        # Longer than the drift period (1 s): several complete checks during the partition.
        wait_for(lambda: operator.drift_checks() >= checks + 3, 90, "3 drift checks during the partition", operator)
        assert f"{ns}.doomed" in registry(fleet.agents[1], ns)  # not reachable to unload
        fleet.proxy.pass_through()
        wait_converged(kube_cluster, fleet, operator)
        for name in ("steady", "newcomer"):
            wait_phase(kube_cluster, ns, name, "Ready", operator)
        assert registry(fleet.agents[1], ns) == {f"{ns}.steady": [0, 1], f"{ns}.newcomer": [0, 1]}
    finally:
        watch.stop()
    steady = watch.history("steady")
    phases = [p for p, _ in steady]
    # Ready -> Degraded (the partition) -> Ready (repaired): no oscillation in between ...
    assert phases == ["Ready", "Degraded", "Ready"], steady
    # ... and the healthy agent's entry never moved.
    assert all(states.get("agent-0") == "Loaded" for _, states in steady), steady
    newcomer = [states for _, states in watch.history("newcomer") if states]  # after 1st visit
    assert newcomer and all(states.get("agent-0") == "Loaded" for states in newcomer), newcomer


# ---- 3b. deletions: bounded fan-out, failures merged, completion ------------------------------


def test_deletions_with_an_agent_cut_off_complete_with_its_failure_merged(
    kube_cluster: ControlPlane,
    fleet: Fleet,
    operator: OperatorProcess,
) -> None:
    """Adapters deleted together while agent-1 is black-holed: every deletion completes (after
    LORAFLEET_DELETE_RETRIES) with an UnloadIncomplete Event naming agent-1 and its error, merged
    failure-first; agent-0 holds none of them; the drift check unloads agent-1's orphans once it
    answers again."""
    ns = fleet.ns
    doomed = [f"doomed-{i}" for i in range(4)]
    apply(kube_cluster, ns, *(make(fleet, name, seed=i) for i, name in enumerate(doomed)))
    for name in doomed:
        wait_phase(kube_cluster, ns, name, "Ready", operator)
    fleet.proxy.blackhole()
    kube_cluster.kubectl("delete", "la", "--all", "-n", ns, "--wait=false")
    wait_for(lambda: not adapters_of(kube_cluster, ns), 120, "every deletion to complete", operator)
    assert registry(fleet.agents[0], ns) == {}
    assert set(registry(fleet.agents[1], ns)) == {f"{ns}.{name}" for name in doomed}

    def incomplete() -> dict[str, str]:
        events = kube_cluster.kubectl_json("get", "events", "-n", ns, "--field-selector", "reason=UnloadIncomplete")["items"]
        return {e["involvedObject"]["name"]: e["message"] for e in events}

    wait_for(lambda: set(incomplete()) == set(doomed), 30, "an UnloadIncomplete Event each", operator)
    for name, message in incomplete().items():
        assert message.startswith("not unloaded from agent-1: "), (name, message)
        assert "Deadline Exceeded" in message, (name, message)
    fleet.proxy.pass_through()
    wait_converged(kube_cluster, fleet, operator)
    assert registry(fleet.agents[1], ns) == {}


def test_many_deletions_wait_in_each_agents_queue_not_as_suspended_calls(
    fault_env: FaultEnv,
) -> None:
    """500 deletions at once over the two real agents: their unloads wait in each agent's queue
    (a future each), drained by at most per-agent-concurrency workers, so the operator holds
    about one task per deletion, not one suspended call per (deletion, agent) — 64,000 such calls
    (1,000 adapters x 64 agents) held about 400 MiB. Every unload then completes (the agents
    hold none of the names: NOT_FOUND counts as done). Before: 1,000 more tasks."""
    deletions = 500
    settings = Settings()

    async def run() -> tuple[int, list[list[UnloadOutcome]]]:
        # Unloads need no Kubernetes API. No registry listed yet: every agent may hold each.
        rt = Runtime(settings, None, AgentClients(settings))
        pods = tuple(AgentPod(a.name, "t", f"uid-{a.name}", {}, True, a.endpoint, 0) for a in fault_env.agents)
        view = FleetView("t", pods, {}, Credentials(), "default", FleetSpec())
        started = [asyncio.ensure_future(unload_from_holders(rt, view, f"t.a{i:04d}")) for i in range(deletions)]
        for _ in range(3):  # every deletion runs up to its first wait (FIFO scheduling)
            await asyncio.sleep(0)
        tasks = len(asyncio.all_tasks())
        try:
            return tasks, list(await asyncio.gather(*started))
        finally:
            await rt.agents.close()

    tasks, outcomes = asyncio.run(run())
    workers = len(fault_env.agents) * settings.per_agent_concurrency
    # This test, the deletions, the queues' workers, each running unload's task and gRPC's own.
    assert tasks <= 1 + deletions + 3 * workers, tasks
    assert all(o.ok for per_deletion in outcomes for o in per_deletion), outcomes[0]
    assert [[o.pod for o in per] for per in outcomes] == [["agent-0", "agent-1"]] * deletions


def unloads_sent() -> float:
    """UnloadAdapter calls this test process's AgentClients made, whatever their outcome."""
    return sum(
        sample.value
        for metric in REGISTRY.collect()
        if metric.name == "lorafleet_agent_calls"
        for sample in metric.samples
        if sample.name == "lorafleet_agent_calls_total" and sample.labels.get("method") == "UnloadAdapter"
    )


def test_an_unload_still_waiting_is_shared_and_one_asked_after_it_started_is_sent(
    fault_env: FaultEnv,
) -> None:
    """Unloads of one name on one agent asked while one waits in the agent's queue share it:
    one UnloadAdapter, the same answer for every caller (a deletion and the drift check
    unloading the same name). One asked after it started is sent again: the first may have
    reached the agent before a load the second must undo."""
    settings = Settings()
    agent = fault_env.agents[0].endpoint
    fillers = settings.per_agent_concurrency  # they take every worker: the rest wait

    async def run() -> tuple[float, float, list[list[object]]]:
        rt = Runtime(settings, None, AgentClients(settings))
        try:
            before = unloads_sent()
            asked = [(agent, Credentials(), f"t.fill{i}") for i in range(fillers)]
            first = asyncio.ensure_future(rt.agents.unload_each([*asked, (agent, Credentials(), "t.dup")]))
            second = asyncio.ensure_future(rt.agents.unload_each([(agent, Credentials(), "t.dup")] * 2))
            answers = [await first, await second]
            shared = unloads_sent() - before
            answers.append(await rt.agents.unload_each([(agent, Credentials(), "t.dup")]))
            return shared, unloads_sent() - before, answers
        finally:
            await rt.agents.close()

    shared, total, answers = asyncio.run(run())
    assert shared == fillers + 1  # "t.dup" asked three times while it waited: sent once
    assert total == fillers + 2  # asked once more after it ran: sent again
    dup = answers[0][-1]
    assert answers[1] == [dup, dup]  # every caller got the one answer
    assert all(isinstance(a, AgentError) and a.code.name == "NOT_FOUND" for a in answers[2] + [dup])


def test_many_loads_wait_in_each_agents_queue_not_as_suspended_calls(
    fault_env: FaultEnv,
) -> None:
    """100 adapters loaded at once (load_each, as 100 reconciles) on the two real agents: the
    loads of local sources wait in each agent's queue (a future each), run by at most
    per-agent-concurrency workers, so the operator holds about one task per reconcile, not one
    suspended call per (adapter, agent): 1,000 adapters x 64 agents held about 540 MiB that way.
    Every load then completes, outcomes in the targets' order, and each agent holds them all.
    A reconcile cancelled while its loads wait sends none of them, and books none as held.
    Before: 200 more tasks."""
    adapters = 100
    settings = Settings()
    path = make_adapter(fault_env.adapters, "queued")

    def body(i: int) -> AdapterObject:
        return AdapterObject("t", f"q{i:03d}", AdapterSpec("default", "", Source(f"file://{path}")), uid=f"u{i}", generation=1)

    async def run() -> tuple[int, list[list[AgentResult]], int, set[str]]:
        rt = Runtime(settings, None, AgentClients(settings))
        pods = tuple(AgentPod(a.name, "t", f"uid-{a.name}", {}, True, a.endpoint, 0) for a in fault_env.agents)
        infos = {p.name: await rt.agents.describe(p.endpoint, Credentials()) for p in pods}
        view = FleetView("t", pods, infos, Credentials(), "default", FleetSpec())
        targets = [Target(p, infos[p.name]) for p in pods]
        started = [asyncio.ensure_future(load_each(rt, view, targets, body(i), None)) for i in range(adapters)]
        for _ in range(3):  # every reconcile runs up to its first wait (FIFO scheduling)
            await asyncio.sleep(0)
        tasks = len(asyncio.all_tasks())
        cancelled = asyncio.ensure_future(load_each(rt, view, targets, body(adapters), None))
        await asyncio.sleep(0)  # its loads queued behind the 100 others'
        cancelled.cancel()
        try:
            results = list(await asyncio.gather(*started))
            held = {name for p in pods for name in rt.books.reservations.held(p.endpoint, set())}
            unloads = await rt.agents.unload_each([(p.endpoint, Credentials(), f"t.q{i:03d}") for p in pods for i in range(adapters)])
            return tasks, results, sum(1 for u in unloads if isinstance(u, AgentError)), held
        finally:
            await rt.agents.close()

    tasks, results, failed_unloads, held = asyncio.run(run())
    workers = len(fault_env.agents) * settings.per_agent_concurrency
    # This test, the reconciles, the queues' workers, each running load's task and gRPC's own.
    assert tasks <= 1 + adapters + 3 * workers, tasks
    assert [[r.pod for r in per] for per in results] == [["agent-0", "agent-1"]] * adapters
    assert all(r.ok for per in results for r in per), results[0]
    assert failed_unloads == 0
    assert f"t.q{adapters:03d}" not in held, held
    for agent in fault_env.agents:
        assert f"t.q{adapters:03d}" not in registry(agent)


def agent_calls_sent(method: str, code: str | None = None) -> float:
    """Calls of ``method`` this test process's AgentClients made (with status ``code``, or
    whatever their outcome)."""
    return sum(
        sample.value
        for metric in REGISTRY.collect()
        if metric.name == "lorafleet_agent_calls"
        for sample in metric.samples
        if sample.name == "lorafleet_agent_calls_total"
        and sample.labels.get("method") == method
        and code in (None, sample.labels.get("code"))
    )


def test_describe_says_what_serves_the_agent(fault_env: FaultEnv) -> None:
    """The operator reads Describe's backend: the builtin engine, its version, no servers."""

    async def describe() -> AgentBackend:
        clients = AgentClients(Settings())
        try:
            return (await clients.describe(fault_env.agents[0].endpoint, Credentials())).backend
        finally:
            await clients.close()

    assert asyncio.run(describe()) == AgentBackend("lorafleet-engine", importlib.metadata.version("lorafleet"), ())


def queued_body(name: str, path: Path) -> AdapterObject:
    """A LoraAdapter of namespace "t" as load_each reads it."""
    return AdapterObject("t", name, AdapterSpec("default", "", Source(f"file://{path}")), uid=f"uid-{name}", generation=1)


async def load_at_once(rt: Runtime, agent: AgentPod, bodies: list[AdapterObject]) -> list[AgentResult]:
    """``load_each`` of every body on one agent, started together as concurrent reconciles
    are: their loads wait in the agent's queue together."""
    info = await rt.agents.describe(agent.endpoint, Credentials())
    view = FleetView("t", (agent,), {agent.name: info}, Credentials(), "default", FleetSpec())
    started = [asyncio.ensure_future(load_each(rt, view, [Target(agent, info)], b, None)) for b in bodies]
    return [per[0] for per in await asyncio.gather(*started)]


def test_loads_waiting_together_go_in_one_call_and_a_bad_one_fails_alone(
    fault_env: FaultEnv,
) -> None:
    """Ten reconciles at once on agent-0, one adapter's source corrupt: their loads go in
    LoadAdapters calls of up to ``load_batch`` (no LoadAdapter call), each with its own
    outcome and books: the corrupt one Failed with the agent's refusal (its back-off booked,
    not held for placement), the nine others Loaded and held by the agent."""
    settings = Settings()
    agent = fault_env.agents[0]
    pod = AgentPod(agent.name, "t", f"uid-{agent.name}", {}, True, agent.endpoint, 0)
    good = make_adapter(fault_env.adapters, "batched")
    bodies = [queued_body(f"b{i}", good) for i in range(10)]
    bodies[4] = queued_body("b4", corrupt_adapter(fault_env.adapters, "batched-corrupt"))

    async def run() -> tuple[list[AgentResult], float, float, set[str], int]:
        rt = Runtime(settings, None, AgentClients(settings))
        batches, singles = agent_calls_sent("LoadAdapters"), agent_calls_sent("LoadAdapter")
        try:
            results = await load_at_once(rt, pod, bodies)
            held = set(rt.books.reservations.held(agent.endpoint, set()))
            return (
                results,
                agent_calls_sent("LoadAdapters") - batches,
                agent_calls_sent("LoadAdapter") - singles,
                held,
                len(rt.books.failures.entries),
            )
        finally:
            await rt.agents.unload_each([(agent.endpoint, Credentials(), f"t.b{i}") for i in range(10)])
            await rt.agents.close()

    results, batches, singles, held, backing_off = asyncio.run(run())
    assert [r.pod for r in results] == [agent.name] * 10
    assert [r.ok for r in results] == [i != 4 for i in range(10)], results
    assert results[4].state.value == "Failed" and results[4].message, results[4]
    assert (singles, batches) == (0, -(-10 // settings.load_batch)), (singles, batches)
    assert held == {f"t.b{i}" for i in range(10) if i != 4}
    assert backing_off == 1


@contextlib.contextmanager
def older_agent(agent: AgentProcess) -> Iterator[str]:
    """An agent as it was before LoadAdapters: a gRPC server in front of ``agent`` that passes
    every NodeAgent method on to it but that one, which it does not know (UNIMPLEMENTED, as
    any server answers an unknown method). Yields its endpoint."""
    upstream = grpc.insecure_channel(agent.endpoint)
    known = ("Describe", "LoadAdapter", "UnloadAdapter", "ListAdapters", "ProveIdentity")

    def passed_on(method: str) -> grpc.RpcMethodHandler:
        call = upstream.unary_unary(f"/lorafleet.v1.NodeAgent/{method}")

        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            return call(request, metadata=context.invocation_metadata(), timeout=60)

        return grpc.unary_unary_rpc_method_handler(handle)

    server = grpc.server(ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("lorafleet.v1.NodeAgent", {m: passed_on(m) for m in known}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=0)
        upstream.close()


def test_an_agent_without_load_batches_gets_one_call_per_load(fault_env: FaultEnv) -> None:
    """An agent older than LoadAdapters answers it UNIMPLEMENTED: the waiting loads are sent
    one LoadAdapter call each, all Loaded, and that agent is not asked LoadAdapters again."""
    settings = Settings()
    good = make_adapter(fault_env.adapters, "older")
    agent = fault_env.agents[0]

    async def run(endpoint: str) -> tuple[list[AgentResult], list[AgentResult], float, float]:
        rt = Runtime(settings, None, AgentClients(settings))
        pod = AgentPod("older-0", "t", "uid-older", {}, True, endpoint, 0)
        unknown, singles = agent_calls_sent("LoadAdapters"), agent_calls_sent("LoadAdapter")
        try:
            first = await load_at_once(rt, pod, [queued_body(f"o{i}", good) for i in range(5)])
            again = await load_at_once(rt, pod, [queued_body(f"p{i}", good) for i in range(5)])
            return (first, again, agent_calls_sent("LoadAdapters") - unknown, agent_calls_sent("LoadAdapter") - singles)
        finally:
            await rt.agents.unload_each([(endpoint, Credentials(), f"t.{p}{i}") for p in "op" for i in range(5)])
            await rt.agents.close()

    unimplemented = agent_calls_sent("LoadAdapters", "UNIMPLEMENTED")
    with older_agent(agent) as endpoint:
        first, again, batches, singles = asyncio.run(run(endpoint))
    assert all(r.ok for r in first + again), first + again
    assert batches == agent_calls_sent("LoadAdapters", "UNIMPLEMENTED") - unimplemented == 1
    assert singles == 10
    assert not {n for n in registry(agent) if n.startswith(("t.o", "t.p"))}


# ---- 4. the API server answering 429, then 500 --------------------------------------------------


class ErrorFront:
    """An HTTPS server that answers every request with one error status (429 with Retry-After,
    or 500) and a metav1.Status body, as an overloaded or failing API server does. It serves
    the API server's own certificate (valid for 127.0.0.1), so clients trust it as that server.
    The operator reaches the API server through a :class:`FaultProxy`; retargeting the proxy
    here (and resetting its connections, watches included) makes the API server "answer"
    errors; retargeting back ends the fault."""

    def __init__(self, cluster: ControlPlane) -> None:
        self.code = 429
        self.answered = 0
        self.watches: collections.Counter[str] = collections.Counter()  # watch path -> tries
        front = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                front.answered += 1
                path, _, query = self.path.partition("?")
                if "watch=true" in query:
                    front.watches[path] += 1
                reason = "TooManyRequests" if front.code == 429 else "InternalError"
                body = json.dumps(
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "reason": reason,
                        "code": front.code,
                        "message": f"fault injected: {front.code}",
                    }
                ).encode()
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                self.send_response(front.code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if front.code == 429:
                    self.send_header("Retry-After", "1")
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        pki = cluster.work_dir / "pki"
        context.load_cert_chain(pki / "apiserver.crt", pki / "apiserver.key")
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def kubeconfig_via(cluster: ControlPlane, port: int, path: Path) -> Path:
    """The admin kubeconfig, pointed at 127.0.0.1:``port`` instead of the API server."""
    config = json.loads(cluster.kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{port}"
    path.write_text(json.dumps(config))
    return path


def test_api_server_answering_429_then_500_loses_nothing(
    kube_cluster: ControlPlane,
    fleet: Fleet,
    tmp_path: Path,
) -> None:
    ns = fleet.ns
    api_port = int(kube_cluster.server.rsplit(":", 1)[1])
    front = ErrorFront(kube_cluster)
    with FaultProxy(api_port) as api:
        # A lease that outlives the fault (its renewals fail too; a shorter one makes the
        # operator exit to be restarted, as test_e2e's API-server restart shows).
        op = start_operator(
            kube_cluster,
            ns,
            tmp_path,
            identity="api-op",
            kubeconfig=kubeconfig_via(kube_cluster, api.port, tmp_path / "via-proxy.kubeconfig"),
            env={**FAULT_ENV, "LORAFLEET_LEASE_DURATION_SECONDS": "90"},
        )
        try:
            apply(kube_cluster, ns, make(fleet, "old-429"), make(fleet, "old-500", seed=1))
            for name in ("old-429", "old-500"):
                wait_phase(kube_cluster, ns, name, "Ready", op)
            for code in (429, 500):
                front.code = code
                front.watches.clear()
                marker = len(op.log())
                api.retarget(front.port)
                api.reset()  # open connections (watches too) break; new ones meet the errors
                api.pass_through()
                # Meanwhile (the test talks to the API server directly): one new, one deleted.
                apply(kube_cluster, ns, make(fleet, f"new-{code}", seed=code))
                kube_cluster.kubectl("delete", "la", f"old-{code}", "-n", ns, "--wait=false")
                # Longer than kopf would retry on its own (9 attempts, then a watch that fails
                # on a 5xx stops the operator): the policy's retries never give up.
                wait_for(lambda: max(front.watches.values(), default=0) >= 12, 90, f"12 tries of one watch, all answered {code}", op)
                # The drift check backs off (one line per failed check, the wait doubling).
                waits = [
                    float(w)
                    for w in re.findall(
                        rf"drift check of lorafleet {ns}/default failed: Kubernetes API: {code} "
                        r".*; next in ([\d.]+)s",
                        op.log()[marker:],
                    )
                ]
                assert waits and max(waits) > 1.0, op.log()[marker:][-3000:]
                api.retarget(api_port)
                api.reset()
                api.pass_through()
            wait_converged(kube_cluster, fleet, op, timeout_s=180)
            assert sorted(i["metadata"]["name"] for i in adapters_of(kube_cluster, ns)) == ["new-429", "new-500"]
            for name in ("new-429", "new-500"):
                assert phase(kube_cluster, ns, name) == "Ready"
            assert op.popen.poll() is None, op.log()[-3000:]
        finally:
            op.stop()
            front.close()


# ---- 5. an etcd restart ----------------------------------------------------------------------------


def test_an_etcd_restart_is_survived(
    kube_cluster: ControlPlane,
    fleet: Fleet,
    tmp_path: Path,
) -> None:
    ns = fleet.ns
    # A lease that outlives the outage (a shorter one makes the operator exit to be restarted:
    # test_e2e's API-server restart shows that).
    op = start_operator(kube_cluster, ns, tmp_path, identity="etcd-op", env={**FAULT_ENV, "LORAFLEET_LEASE_DURATION_SECONDS": "90"})
    try:
        apply(kube_cluster, ns, make(fleet, "before"), make(fleet, "removed", seed=1))
        for name in ("before", "removed"):
            wait_phase(kube_cluster, ns, name, "Ready", op)
        kube_cluster.restart_etcd(downtime_s=3)
        apply(kube_cluster, ns, make(fleet, "after", seed=2))
        kube_cluster.kubectl("delete", "la", "removed", "-n", ns, "--wait=false")
        wait_phase(kube_cluster, ns, "after", "Ready", op, timeout_s=120)
        wait_converged(kube_cluster, fleet, op, timeout_s=120)
        assert sorted(i["metadata"]["name"] for i in adapters_of(kube_cluster, ns)) == ["after", "before"]
        assert op.popen.poll() is None
    finally:
        op.stop()
