"""End to end: the real operator (subprocess), the real API server, real node agents
(``lorafleet-agent serve``, tp=2 dp=2 on CPU) on loopback, their Pod objects written by the
harness. Bad specs refused by the API server are tested in tests/kube/test_crds.py.

Two agents are shared by the whole module (starting one costs seconds); tests are isolated by
namespace, because the operator's registry names are ``<namespace>.<name>``. agent-1 accepts
adapters up to rank 8 only, agent-0 up to 16: a rank-16 adapter makes exactly one agent fail.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from lorafleet.v1 import agent_pb2
from lorafleet_dev.agents import AgentProcess, AgentSpec, start_agents
from lorafleet_dev.synthetic import write_model
from tests.kube.harness import ControlPlane
from tests.operator.agents import (
    BASE_MODEL,
    SHAPE,
    adapter_manifest,
    add_agent_pod,
    apply,
    corrupt_adapter,
    fleet_manifest,
    generate,
    make_adapter,
    phase,
    phases,
    registry,
    status,
    stub,
)
from tests.operator.conftest import (
    CHART,
    OperatorProcess,
    service_account_kubeconfig,
    start_operator,
    wait_for,
)

TOKENS = [1, 5, 9, 42]


@dataclass(frozen=True)
class AgentEnv:
    """The module's shared agents, where they read adapters from, and how they were made."""

    agents: list[AgentProcess]
    adapters: Path
    spec: AgentSpec
    root: Path


@pytest.fixture(scope="module")
def agent_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentEnv]:
    root = tmp_path_factory.mktemp("agents")
    model = write_model(root / "model", SHAPE)
    adapters = root / "adapters"
    adapters.mkdir()
    spec = AgentSpec(model_dir=model, adapter_roots=(adapters,), base_model_name=BASE_MODEL)

    # Each agent its own download cache: http(s) sources (loopback servers) are allowed. No
    # minimum download rate: a black-holed test source hangs until the test releases it.
    def downloads(cache: str) -> tuple[str, ...]:
        return ("--cache-dir", str(root / cache), "--download-min-bytes-per-s", "0")

    a0 = AgentProcess("agent-0", AgentSpec(**{**spec.__dict__, "extra_args": downloads("c0")}), root / "logs")
    a1 = AgentProcess("agent-1", AgentSpec(**{**spec.__dict__, "max_lora_rank": 8, "extra_args": downloads("c1")}), root / "logs")
    for agent in (a0, a1):
        agent.start()
    try:
        for agent in (a0, a1):
            agent.wait_ready()
        yield AgentEnv(agents=[a0, a1], adapters=adapters, spec=spec, root=root)
    finally:
        for agent in (a0, a1):
            agent.stop()


@pytest.fixture
def agents(agent_env: AgentEnv) -> list[AgentProcess]:
    """The two shared agents, serving (a test that killed one must have restarted it)."""
    agents = agent_env.agents
    for agent in agents:
        agent.wait_ready(60)
    return agents


@pytest.fixture
def adapters(agent_env: AgentEnv, kube_namespace: str) -> Path:
    """This test's own directory under the agents' adapter root."""
    path = agent_env.adapters / kube_namespace
    path.mkdir()
    return path


@pytest.fixture
def fleet(
    kube_cluster: ControlPlane, kube_namespace: str, agents: list[AgentProcess], lorafleet_crds: tuple[str, ...]
) -> list[AgentProcess]:
    """The default LoraFleet with both agents' pods, Ready, in the test namespace."""
    for agent in agents:
        add_agent_pod(kube_cluster, kube_namespace, agent)
    apply(kube_cluster, kube_namespace, fleet_manifest())
    return agents


def wait_phase(cluster: ControlPlane, ns: str, name: str, want: str, op: OperatorProcess, timeout_s: float = 90) -> dict[str, Any]:
    wait_for(lambda: phase(cluster, ns, name) == want, timeout_s, f"{name} {want}", op)
    return status(cluster, ns, name)


def test_apply_ready_then_delete_unloads_everywhere(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    operator: OperatorProcess,
) -> None:
    ns = kube_namespace
    apply(kube_cluster, ns, adapter_manifest("support", make_adapter(adapters, "support")))
    st = wait_phase(kube_cluster, ns, "support", "Ready", operator)

    assert st["agents"] == [
        {"pod": "agent-0", "state": "Loaded", "ranksLoaded": 2, "ranksTotal": 2, "message": ""},
        {"pod": "agent-1", "state": "Loaded", "ranksLoaded": 2, "ranksTotal": 2, "message": ""},
    ]
    assert (st["agentsSummary"], st["ranksSummary"], st["message"]) == ("2/2", "4/4", "")
    ready = st["conditions"][0]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "AllAgentsLoaded")
    # The status is what the registries say: every rank of both agents holds it.
    for agent in fleet:
        assert registry(agent, ns) == {f"{ns}.support": [0, 1]}
        assert len(generate(agent, f"{ns}.support", TOKENS)) == 4
    table = kube_cluster.kubectl("get", "la", "-n", ns).stdout
    assert "support" in table and "Ready" in table and "2/2" in table and "4/4" in table

    # The fleet's status describes its members.
    wait_for(
        lambda: kube_cluster.kubectl_json("get", "lfleet", "default", "-n", ns)["status"].get("readyAgents") == 2,
        30,
        "fleet status",
        operator,
    )
    members = kube_cluster.kubectl_json("get", "lfleet", "default", "-n", ns)["status"]["members"]
    assert [m["pod"] for m in members] == ["agent-0", "agent-1"]
    assert members[0]["topology"] == {"tpSize": 2, "dpSize": 2, "attnTpSize": 1, "epSize": 1, "moeTpSize": 2}
    assert members[1]["capacity"]["maxLoraRank"] == 8
    assert members[0]["baseModel"] == BASE_MODEL

    kube_cluster.kubectl("delete", "la", "support", "-n", ns, "--wait=true", "--timeout=60s")
    for agent in fleet:
        assert registry(agent, ns) == {}
        with pytest.raises(grpc.RpcError) as err:
            generate(agent, f"{ns}.support", TOKENS)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def fleet_reads(cluster: ControlPlane) -> float:
    """GET requests of LoraFleets the API server has answered since it started (its
    ``apiserver_request_total``; a list or a watch is another verb)."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    return sum(
        float(value)
        for labels, value in re.findall(r"^apiserver_request_total\{([^}]*)\} (\S+)$", text, re.M)
        if 'resource="lorafleets"' in labels and 'verb="GET"' in labels
    )


def test_reconciles_read_the_fleet_from_the_operators_index_not_the_api(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    operator: OperatorProcess,
) -> None:
    """A wave of reconciles and drift checks of a fleet that exists GETs no LoraFleet: each
    look at the fleet reads kopf's fleet index (fed by the watch). Before, every reconcile
    and every drift check sent a GET of it (here 4 creates and at least 3 checks). Nothing
    else in this window GETs a LoraFleet (the test reads only LoraAdapters and metrics)."""
    ns = kube_namespace
    wait_for(lambda: operator.drift_checks() >= 1, 30, "a first drift check", operator)
    before = fleet_reads(kube_cluster)
    names = [f"w{i}" for i in range(4)]
    apply(kube_cluster, ns, *(adapter_manifest(n, make_adapter(adapters, n, seed=i)) for i, n in enumerate(names)))
    wait_for(lambda: phases(kube_cluster, ns) == dict.fromkeys(names, "Ready"), 120, "4 adapters Ready", operator)
    checks = operator.drift_checks()
    wait_for(lambda: operator.drift_checks() >= checks + 3, 60, "3 more drift checks", operator)
    log = operator.log()
    assert all(f"reconciled loraadapter {ns}/{n} gen=1 trigger=create" in log for n in names)
    assert fleet_reads(kube_cluster) - before == 0
    for agent in fleet:
        assert set(registry(agent, ns)) == {f"{ns}.{n}" for n in names}


def unload_calls(agent: AgentProcess, name: str) -> int:
    """UnloadAdapter calls of ``name`` the agent received, whatever their outcome (its call
    log: one line per control call)."""
    return sum(
        1
        for line in agent.log_path.read_text(errors="replace").splitlines()
        if '"call": "unload"' in line and f'"adapter": "{name}"' in line
    )


def test_a_deletion_unloads_only_where_the_adapter_may_be_held(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    operator: OperatorProcess,
) -> None:
    """An adapter with ``replicas: 1`` is deleted: the agent that holds it gets the unload; the
    other, whose registry listing (the operator's, before the load) lacks it and which was
    sent no load of it, gets no UnloadAdapter call at all. Before, every agent of the fleet
    was asked (1,000 adapters x 64 agents: 64,000 unloads with replicas 4). A stray copy
    (as a load cut off and completed later would leave) is unloaded by the drift check: a
    managed name no live LoraAdapter wants."""
    ns = kube_namespace
    source = make_adapter(adapters, "one")
    manifest = adapter_manifest("one", source)
    manifest["spec"]["replicas"] = 1
    apply(kube_cluster, ns, manifest)
    placed = wait_phase(kube_cluster, ns, "one", "Ready", operator)["placement"]["placed"]
    (holder,) = [a for a in fleet if a.name in placed]
    (other,) = [a for a in fleet if a.name not in placed]
    name = f"{ns}.one"
    assert (registry(holder, ns), registry(other, ns)) == ({name: [0, 1]}, {})
    kube_cluster.kubectl("delete", "la", "one", "-n", ns, "--wait=true", "--timeout=60s")
    assert (registry(holder, ns), registry(other, ns)) == ({}, {})
    assert (unload_calls(holder, name), unload_calls(other, name)) == (1, 0)
    assert f"deleted loraadapter {ns}/one: unloaded from 1/1 agents that may hold it (of 2)" in operator.log()

    channel, agent_stub = stub(other)
    with channel:
        reply = agent_stub.LoadAdapter(agent_pb2.LoadAdapterRequest(name=name, source_uri=f"file://{source}"), timeout=60)
    assert reply.success and registry(other, ns) == {name: [0, 1]}
    wait_for(lambda: registry(other, ns) == {}, 60, "the drift check to unload the stray", operator)
    assert f"drift: unloaded {name} from {other.name} (no resource wants it)" in operator.log()


def test_a_deletion_unloads_from_an_agent_whose_pod_went_away(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    operator: OperatorProcess,
) -> None:
    """An adapter Ready on both agents; one agent's pod is deleted while its process keeps
    running (as when a namespace being deleted loses its pods before its adapters, the agents
    serving other namespaces too). Deleting the adapter unloads it from that agent as well.
    Before, the deletion asked only the fleet's agents as they were then, and the departed
    one kept the adapter."""
    ns = kube_namespace
    apply(kube_cluster, ns, adapter_manifest("kept", make_adapter(adapters, "kept")))
    wait_phase(kube_cluster, ns, "kept", "Ready", operator)
    gone, other = fleet
    kube_cluster.kubectl("delete", "pod", gone.name, "-n", ns, "--wait=true")
    wait_for(
        lambda: kube_cluster.kubectl_json("get", "lfleet", "default", "-n", ns)["status"].get("agents") == 1,
        30,
        "the fleet without the pod",
        operator,
    )
    assert registry(gone, ns) == {f"{ns}.kept": [0, 1]}
    kube_cluster.kubectl("delete", "la", "kept", "-n", ns, "--wait=true", "--timeout=60s")
    assert (registry(gone, ns), registry(other, ns)) == ({}, {})
    assert f"unloaded {ns}.kept from {gone.endpoint} (pod gone or not ready)" in operator.log()


def test_bad_adapter_fails_without_hot_loop_and_others_are_unaffected(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    operator: OperatorProcess,
) -> None:
    ns = kube_namespace
    apply(
        kube_cluster,
        ns,
        adapter_manifest("good", make_adapter(adapters, "good")),
        adapter_manifest("bad", corrupt_adapter(adapters, "bad")),
    )
    wait_phase(kube_cluster, ns, "good", "Ready", operator)
    st = wait_phase(kube_cluster, ns, "bad", "Failed", operator)
    # The agents' own words, failure-first merged (both agents say the same: one message).
    assert st["message"] and " | " not in st["message"]
    assert "safetensors" in st["message"].lower() or "header" in st["message"].lower(), st
    assert [a["state"] for a in st["agents"]] == ["Failed", "Failed"]
    assert st["conditions"][0]["reason"] == "LoadFailed"

    # No hot loop: over several drift intervals (1 s each) the operator calls LoadAdapter at
    # most a few times (permanent failures back off from 4 s), and nothing for "good".
    before, checks = operator.agent_calls("LoadAdapter"), operator.drift_checks()
    wait_for(lambda: operator.drift_checks() >= checks + 8, 60, "8 drift checks", operator)
    calls = operator.agent_calls("LoadAdapter") - before
    assert calls <= 4, f"{calls} LoadAdapter calls in 8 drift checks: a retry loop"
    assert operator.log().count(f"reconciled loraadapter {ns}/bad gen=1 trigger=create") == 1
    assert phases(kube_cluster, ns) == {"good": "Ready", "bad": "Failed"}
    for agent in fleet:
        assert set(registry(agent, ns)) == {f"{ns}.good"}
        assert len(generate(agent, f"{ns}.good", TOKENS)) == 4
    events = kube_cluster.kubectl_json("get", "events", "-n", ns)["items"]
    assert any(e["reason"] == "Failed" and e["type"] == "Warning" and e["involvedObject"]["name"] == "bad" for e in events)

    # A spec change (new generation) is retried at once: fixed -> Ready.
    fixed = adapter_manifest("bad", make_adapter(adapters, "bad-fixed"))
    apply(kube_cluster, ns, fixed)
    st = wait_phase(kube_cluster, ns, "bad", "Ready", operator)
    assert st["observedGeneration"] == 2


def test_one_agent_failing_is_degraded_then_fixed(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    operator: OperatorProcess,
) -> None:
    ns = kube_namespace
    big = make_adapter(adapters, "big", rank=16)  # agent-1 takes rank <= 8 only
    apply(kube_cluster, ns, adapter_manifest("big", big))
    st = wait_phase(kube_cluster, ns, "big", "Degraded", operator)
    by_pod = {a["pod"]: a for a in st["agents"]}
    assert by_pod["agent-0"]["state"] == "Loaded" and by_pod["agent-0"]["ranksLoaded"] == 2
    assert by_pod["agent-1"]["state"] == "Failed" and by_pod["agent-1"]["message"]
    assert st["message"] == by_pod["agent-1"]["message"]
    assert (st["agentsSummary"], st["ranksSummary"]) == ("1/2", "2/4")
    ready, degraded = st["conditions"]
    assert ready["reason"] == "PartiallyLoaded" and "agent-1" in ready["message"]
    assert degraded["status"] == "True" and "agent-1" in degraded["message"]
    # The other agent serves it meanwhile.
    assert len(generate(fleet[0], f"{ns}.big", TOKENS)) == 4
    assert f"{ns}.big" not in registry(fleet[1], ns)

    apply(kube_cluster, ns, adapter_manifest("big", make_adapter(adapters, "small", rank=8)))
    st = wait_phase(kube_cluster, ns, "big", "Ready", operator)
    assert (st["agentsSummary"], st["ranksSummary"]) == ("2/2", "4/4")
    for agent in fleet:
        assert registry(agent, ns) == {f"{ns}.big": [0, 1]}


def test_restarted_agent_gets_its_adapters_back(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    operator: OperatorProcess,
) -> None:
    ns = kube_namespace
    apply(kube_cluster, ns, *(adapter_manifest(n, make_adapter(adapters, n, seed=i)) for i, n in enumerate(("one", "two"))))
    for name in ("one", "two"):
        wait_phase(kube_cluster, ns, name, "Ready", operator)
    restarted = fleet[1]
    restarted.kill()  # a crash: the registry lives in memory and is gone
    restarted.start().wait_ready()
    # (It may already be repaired here: the drift check runs every second.)
    kube_cluster.write_pod_status(ns, restarted.name, restart_count=1)  # as a kubelet would
    wait_for(
        lambda: registry(restarted, ns) == {f"{ns}.one": [0, 1], f"{ns}.two": [0, 1]},
        60,
        "the drift check to restore the adapters",
        operator,
    )
    for name in ("one", "two"):
        st = wait_phase(kube_cluster, ns, name, "Ready", operator)
        assert st["ranksSummary"] == "4/4"
    for name in ("one", "two"):  # repaired by the drift check, not by a handler
        assert f"drift: loaded {ns}/{name} on agent-1: Loaded" in operator.log()


def test_new_and_newly_ready_agent_pods_get_every_adapter(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    operator: OperatorProcess,
    agent_env: AgentEnv,
) -> None:
    ns = kube_namespace
    apply(kube_cluster, ns, adapter_manifest("one", make_adapter(adapters, "one")))
    wait_phase(kube_cluster, ns, "one", "Ready", operator)
    (extra,) = start_agents(["agent-2"], agent_env.spec, agent_env.root / "logs")
    try:
        add_agent_pod(kube_cluster, ns, extra, ready=False)  # scheduled, not ready yet
        # Two more completed checks: the second began after the pod existed (a fleet's checks
        # run one at a time), and a not-ready pod is no target.
        checks = operator.drift_checks()
        wait_for(lambda: operator.drift_checks() >= checks + 2, 30, "two drift checks", operator)
        assert status(kube_cluster, ns, "one")["agentsSummary"] == "2/2"
        assert registry(extra, ns) == {}
        kube_cluster.write_pod_status(ns, extra.name, ready=True)
        wait_for(lambda: status(kube_cluster, ns, "one").get("agentsSummary") == "3/3", 60, "the new agent to hold the adapter", operator)
        assert registry(extra, ns) == {f"{ns}.one": [0, 1]}
        assert status(kube_cluster, ns, "one")["ranksSummary"] == "6/6"
        # An agent pod that goes away no longer counts.
        kube_cluster.delete_pod(ns, extra.name)
        wait_for(lambda: status(kube_cluster, ns, "one").get("agentsSummary") == "2/2", 60, "the deleted agent pod to drop out", operator)
        assert phase(kube_cluster, ns, "one") == "Ready"
    finally:
        extra.stop()


def test_operator_restarted_mid_reconcile_converges(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    operator: OperatorProcess,
    tmp_path: Path,
) -> None:
    ns = kube_namespace
    names = [f"r{i:02d}" for i in range(12)]
    apply(kube_cluster, ns, *(adapter_manifest(n, make_adapter(adapters, n, seed=i)) for i, n in enumerate(names)))
    wait_for(lambda: "Ready" in phases(kube_cluster, ns).values(), 60, "a first Ready", operator)
    operator.stop(signal.SIGKILL)  # mid-reconcile: no cleanup, the lease is left held
    at_kill = list(phases(kube_cluster, ns).values())
    second = start_operator(kube_cluster, ns, tmp_path, identity="op-1")
    try:
        wait_for(
            lambda: set(phases(kube_cluster, ns).values()) == {"Ready"},
            120,
            f"all adapters Ready after the restart (at the kill: {at_kill})",
            second,
        )
        want = {f"{ns}.{n}": [0, 1] for n in names}
        for agent in fleet:
            assert registry(agent, ns) == want  # nothing lost, nothing extra, no duplicates
        for name in names:
            st = status(kube_cluster, ns, name)
            assert [a["pod"] for a in st["agents"]] == ["agent-0", "agent-1"]
    finally:
        second.stop()


def test_api_server_restart_is_survived(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    tmp_path: Path,
) -> None:
    """The API server goes away for a while: watches break, writes fail; afterwards the same
    operator process handles new and deleted adapters again. (Its lease outlives the outage
    here; with a shorter one it would exit to be restarted, as the next check shows.)"""
    ns = kube_namespace
    operator = start_operator(kube_cluster, ns, tmp_path, identity="long-lease", env={"LORAFLEET_LEASE_DURATION_SECONDS": "90"})
    short = start_operator(
        kube_cluster, ns, tmp_path, identity="short-lease", wait_leader=False, env={"LORAFLEET_LEASE_NAME": "other-lease"}
    )
    wait_for(lambda: "became leader" in short.log(), 60, "short-lease to lead", short)
    apply(kube_cluster, ns, adapter_manifest("before", make_adapter(adapters, "before")))
    wait_phase(kube_cluster, ns, "before", "Ready", operator)
    kube_cluster.restart_apiserver(downtime_s=3)
    apply(kube_cluster, ns, adapter_manifest("after", make_adapter(adapters, "after")))
    wait_phase(kube_cluster, ns, "after", "Ready", operator, timeout_s=120)
    kube_cluster.kubectl("delete", "la", "before", "-n", ns, "--wait=true", "--timeout=120s")
    for agent in fleet:
        assert registry(agent, ns) == {f"{ns}.after": [0, 1]}
    assert operator.popen.poll() is None
    operator.stop()
    # A leader that cannot renew its (3 s) lease within 2 s stops acting and exits non-zero.
    assert short.stop() == 1 or "lost leadership" in short.log(), short.log()[-2000:]
    assert "lost leadership" in short.log()


def test_fifty_adapters_applied_at_once(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    operator: OperatorProcess,
) -> None:
    ns = kube_namespace
    names = [f"bulk-{i:02d}" for i in range(50)]
    paths = [make_adapter(adapters, n, seed=i) for i, n in enumerate(names)]
    apply(kube_cluster, ns, *(adapter_manifest(n, p) for n, p in zip(names, paths, strict=True)))
    wait_for(lambda: list(phases(kube_cluster, ns).values()).count("Ready") == 50, 300, "50 adapters Ready", operator, interval_s=1.0)
    for agent in fleet:
        assert set(registry(agent, ns)) == {f"{ns}.{n}" for n in names}
    kube_cluster.kubectl("delete", "la", "--all", "-n", ns, "--wait=true", "--timeout=180s")
    for agent in fleet:
        assert registry(agent, ns) == {}


def test_operator_under_the_charts_service_account_with_agent_auth(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    adapters: Path,
    agent_env: AgentEnv,
    tmp_path: Path,
) -> None:
    """The chart's RBAC is enough for the whole job (tests/kube/test_chart.py shows it is no
    broader): the operator runs with the chart ServiceAccount's own token, reads the fleet's
    token Secret — the chart's own, opened to the chart's fleet by its label —, loads on an
    agent that requires that token, and unloads on delete. The Secret's value ends in a
    newline (as `kubectl create secret --from-file` of an edited file stores it): trimmed."""
    ns = kube_namespace
    rendered = kube_cluster.helm(
        "template",
        "lf",
        str(CHART),
        "--namespace",
        ns,
        "--set",
        "agent.enabled=false",
        "--set",
        "operator.enabled=false",
        "--set",
        "fleet.create=false",
    ).stdout
    kube_cluster.apply(rendered, ns)
    kubeconfig = service_account_kubeconfig(kube_cluster, ns, "lf-lorafleet-operator", tmp_path / "sa.kubeconfig")
    token_file = tmp_path / "agent-token"
    token_file.write_text(secrets.token_urlsafe(24))
    (agent,) = start_agents(
        ["agent-auth"],
        AgentSpec(**{**agent_env.spec.__dict__, "extra_args": ("--auth-token-file", str(token_file))}),
        agent_env.root / "logs",
    )
    op = None
    try:
        with pytest.raises(grpc.RpcError) as err:  # the agent really requires the token
            registry(agent)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        chart_secret = kube_cluster.kubectl_json("get", "secret", "lf-lorafleet-agent-token", "-n", ns)
        assert chart_secret["metadata"]["labels"]["lorafleet.dev/allow-fleet"] == "default"
        with_newline = base64.b64encode(token_file.read_bytes() + b"\n").decode()
        kube_cluster.kubectl(
            "patch", "secret", "lf-lorafleet-agent-token", "-n", ns, "--type=merge", "-p", json.dumps({"data": {"token": with_newline}})
        )
        add_agent_pod(kube_cluster, ns, agent)
        fleet_obj = fleet_manifest()
        fleet_obj["spec"]["auth"] = {"tokenSecretRef": {"name": "lf-lorafleet-agent-token"}}
        apply(kube_cluster, ns, fleet_obj, adapter_manifest("support", make_adapter(adapters, "support")))
        op = start_operator(kube_cluster, ns, tmp_path, identity="sa-op", kubeconfig=kubeconfig)
        st = wait_phase(kube_cluster, ns, "support", "Ready", op)
        assert (st["agentsSummary"], st["ranksSummary"]) == ("1/1", "2/2")
        kube_cluster.kubectl("delete", "la", "support", "-n", ns, "--wait=true", "--timeout=60s")
        log = op.log()
        assert "Forbidden" not in log and " 403" not in log, log[-3000:]
        assert "became leader" in log
    finally:
        if op is not None:
            op.stop()
        agent.stop()
    who = kube_cluster.kubectl_json("auth", "whoami", f"--kubeconfig={kubeconfig}")
    assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{ns}:lf-lorafleet-operator"
