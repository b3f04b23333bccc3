"""Watched namespaces that go away: deleting one completes — the operator, under the
chart's own RBAC, releases its finalizers while the namespace terminates and the agents no
longer hold its adapters — and the operator keeps serving the other namespaces, also after a
restart that still names the deleted one.

Real operator under the chart ServiceAccount's token, real API server with
kube-controller-manager's namespace controller, the module's two real agents (shared agent
processes behind pods of two namespaces).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from lorafleet_dev.agents import AgentProcess
from tests.kube.harness import ControlPlane, free_port
from tests.operator import test_e2e
from tests.operator.agents import (
    adapter_manifest,
    add_agent_pod,
    apply,
    fleet_manifest,
    make_adapter,
    registry,
)
from tests.operator.conftest import (
    CHART,
    OperatorProcess,
    service_account_kubeconfig,
    start_operator,
    wait_for,
)
from tests.operator.test_tenants import as_tenant, tenant_role

agent_env = test_e2e.agent_env
agents = test_e2e.agents
adapters = test_e2e.adapters
fleet = test_e2e.fleet
wait_phase = test_e2e.wait_phase


def install_rbac(cluster: ControlPlane, release_ns: str, watched: list[str]) -> None:
    """The chart's ServiceAccount and RBAC (nothing else), for these watched namespaces."""
    rendered = cluster.helm(
        "template",
        "lf",
        str(CHART),
        "--namespace",
        release_ns,
        "--set",
        "agent.enabled=false",
        "--set",
        "operator.enabled=false",
        "--set",
        "fleet.create=false",
        "--set",
        f"operator.watchNamespaces={{{','.join(watched)}}}",
    ).stdout
    cluster.apply(rendered)


def namespace_exists(cluster: ControlPlane, ns: str) -> bool:
    status, _ = cluster.request("GET", f"/api/v1/namespaces/{ns}")
    return status == 200


def assert_reported_unusable(cluster: ControlPlane, op: OperatorProcess, lease_ns: str, ns: str, problem: str) -> None:
    """The operator reported watched namespace `ns` as `problem`: a log line, the metric, and a
    Warning Event on its Lease."""
    assert f"watched namespace {ns} is {problem}" in op.log()
    assert op.metrics()[f'lorafleet_unusable_namespaces{{namespace="{ns}",problem="{problem}"}}'] == 1
    events = cluster.kubectl_json("get", "events", "-n", lease_ns, "--field-selector", "reason=WatchedNamespaceUnusable")
    assert any(ns in e["message"] and problem in e["message"] and e["involvedObject"]["kind"] == "Lease" for e in events["items"]), events


def test_deleting_a_watched_namespace_completes_and_the_rest_keep_working(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    tmp_path: Path,
) -> None:
    """A tenant's namespace with a fleet (pods for the shared agents) and two Ready adapters is
    deleted. The namespace controller removes the pods, the Secrets and the RoleBindings
    first; before, the operator's requests were then Forbidden and the namespace hung in
    Terminating forever with its adapters still loaded. Now it goes away, the agents no
    longer hold its adapters, the operator's own namespace keeps working, and an operator
    restarted with the deleted namespace still in its list serves the others."""
    home = kube_namespace
    doomed = kube_cluster.create_namespace(prefix="doomed")
    op: OperatorProcess | None = None
    try:
        install_rbac(kube_cluster, home, [home, doomed])
        kubeconfig = service_account_kubeconfig(kube_cluster, home, "lf-lorafleet-operator", tmp_path / "sa.kubeconfig")
        tenant_role(kube_cluster, doomed)
        for agent in fleet:
            add_agent_pod(kube_cluster, doomed, agent)
        apply(kube_cluster, doomed, fleet_manifest())
        env = {"LORAFLEET_WATCH_NAMESPACES": f"{home},{doomed}"}
        op = start_operator(kube_cluster, home, tmp_path, kubeconfig=kubeconfig, env=env)
        as_tenant(kube_cluster, doomed, *(adapter_manifest(n, make_adapter(adapters, n, seed=i)) for i, n in enumerate(("one", "two"))))
        for n in ("one", "two"):
            wait_phase(kube_cluster, doomed, n, "Ready", op)
        for agent in fleet:
            assert set(registry(agent, doomed)) == {f"{doomed}.one", f"{doomed}.two"}

        kube_cluster.delete_namespace(doomed)
        wait_for(lambda: not namespace_exists(kube_cluster, doomed), 120, f"namespace {doomed} to go away", op)
        for agent in fleet:
            assert registry(agent, doomed) == {}

        apply(kube_cluster, home, adapter_manifest("home", make_adapter(adapters, "home")))
        wait_phase(kube_cluster, home, "home", "Ready", op)
        op.stop()
        health = free_port()
        op = start_operator(
            kube_cluster, home, tmp_path, identity="op-1", kubeconfig=kubeconfig, env={**env, "LORAFLEET_HEALTH_PORT": str(health)}
        )
        apply(kube_cluster, home, adapter_manifest("later", make_adapter(adapters, "later")))
        wait_phase(kube_cluster, home, "later", "Ready", op)
        # The deleted namespace is reported (log, metric, a Warning Event on the Lease) ...
        assert_reported_unusable(kube_cluster, op, home, doomed, "missing")
        # ... and kopf's liveness endpoint answers for the running loop (one drift loop).
        with urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=10) as resp:
            assert json.load(resp) == {"driftLoops": 1}
        kube_cluster.kubectl("delete", "la", "--all", "-n", home, "--wait=true", "--timeout=60s")
        for agent in fleet:
            assert registry(agent, home) == {}
    finally:
        if op is not None:
            op.stop()
        kube_cluster.delete_namespace(doomed)
        for kind in ("clusterrole", "clusterrolebinding"):
            kube_cluster.kubectl("delete", kind, f"lf-lorafleet-operator-{home}", "--ignore-not-found")


def test_a_forbidden_namespace_is_skipped_and_the_rest_keep_working(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    tmp_path: Path,
) -> None:
    """The operator is told to watch a namespace its RBAC does not open (the chart's grants
    bound inside its own namespace only). A watch there would be refused forever, and kopf's
    failing watcher used to stop every namespace; now that namespace is reported (log, metric,
    a Warning Event on the Lease) and skipped, and the operator's own namespace works."""
    home = kube_namespace
    closed = kube_cluster.create_namespace(prefix="closed")
    op: OperatorProcess | None = None
    try:
        install_rbac(kube_cluster, home, [home])
        # The cluster-wide grants, but only inside `home`: a RoleBinding to the ClusterRole.
        granted = f"lf-lorafleet-operator-{home}"
        kube_cluster.kubectl("delete", "clusterrolebinding", granted)
        kube_cluster.kubectl(
            "create",
            "rolebinding",
            "lf-home-only",
            "-n",
            home,
            f"--clusterrole={granted}",
            f"--serviceaccount={home}:lf-lorafleet-operator",
        )
        kubeconfig = service_account_kubeconfig(kube_cluster, home, "lf-lorafleet-operator", tmp_path / "sa.kubeconfig")
        op = start_operator(kube_cluster, home, tmp_path, kubeconfig=kubeconfig, env={"LORAFLEET_WATCH_NAMESPACES": f"{home},{closed}"})
        apply(kube_cluster, home, adapter_manifest("open", make_adapter(adapters, "open")))
        wait_phase(kube_cluster, home, "open", "Ready", op)
        assert_reported_unusable(kube_cluster, op, home, closed, "forbidden")
        kube_cluster.kubectl("delete", "la", "--all", "-n", home, "--wait=true", "--timeout=60s")
        for agent in fleet:
            assert registry(agent, home) == {}
    finally:
        if op is not None:
            op.stop()
        kube_cluster.delete_namespace(closed)
