"""Tenants on the operator: the operator is no confused deputy for Secrets, a bad
token is refused once and clearly, a fleet's status shows only its own load on shared agents,
and deleting a LoraFleet unloads its adapters.

Real operator, real API server, the module's two real agents (tests/operator/test_e2e.py's
fixtures); tenants are impersonated users (``kubectl --as``) bound to the tenant Role below,
which may do everything with LoraAdapters and LoraFleets in their namespace and nothing with
Secrets.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from lorafleet_dev.agents import AgentProcess
from tests.kube.harness import ControlPlane, free_port
from tests.operator import test_e2e
from tests.operator.agents import (
    Source,
    adapter_manifest,
    add_agent_pod,
    apply,
    fleet_manifest,
    make_adapter,
    phase,
    registry,
    status,
)
from tests.operator.conftest import OperatorProcess, start_operator, wait_for

# The module's agents and per-test fixtures, shared with test_e2e (same definitions).
agent_env = test_e2e.agent_env
agents = test_e2e.agents
adapters = test_e2e.adapters
fleet = test_e2e.fleet
wait_phase = test_e2e.wait_phase

TENANT = "alice"


def tenant_role(cluster: ControlPlane, ns: str, user: str = TENANT) -> None:
    """The documented tenant Role (docs/operator.md, Security): LoraAdapters and LoraFleets in
    their own namespace, reading pods and events; no Secrets."""
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "lorafleet-tenant"},
        "rules": [
            {
                "apiGroups": ["lorafleet.dev"],
                "resources": ["loraadapters", "lorafleets"],
                "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
            },
            {"apiGroups": [""], "resources": ["pods", "events"], "verbs": ["get", "list", "watch"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": f"lorafleet-tenant-{user}"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "lorafleet-tenant"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": [role, binding]}), ns)
    can = cluster.kubectl("auth", "can-i", "get", "secrets", "-n", ns, as_user=user, check=False)
    assert can.stdout.strip() == "no"


def as_tenant(cluster: ControlPlane, ns: str, *objects: dict[str, Any], user: str = TENANT) -> None:
    cluster.kubectl(
        "apply",
        "--validate=strict",
        "-n",
        ns,
        "-f",
        "-",
        as_user=user,
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}),
    )


def secret(name: str, data: dict[str, bytes], labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": labels or {}},
        "type": "Opaque",
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
    }


@dataclass
class Workload:
    """Another workload's gRPC server (not an agent): records every call's method and metadata,
    answers UNIMPLEMENTED."""

    port: int
    calls: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tokens(self) -> list[str]:
        with self.lock:
            return [md.get("authorization", "") for _, md in self.calls]


@pytest.fixture
def workload() -> Iterator[Workload]:
    seen = Workload(free_port())

    class Record(grpc.GenericRpcHandler):
        def service(self, details: grpc.HandlerCallDetails) -> None:
            metadata = {k: v if isinstance(v, str) else v.decode() for k, v in details.invocation_metadata}
            with seen.lock:
                seen.calls.append((details.method, metadata))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[Record()])
    server.add_insecure_port(f"127.0.0.1:{seen.port}")
    server.start()
    try:
        yield seen
    finally:
        server.stop(0)


def ready_condition(cluster: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    conditions = status(cluster, ns, name).get("conditions") or [{}]
    return dict(conditions[0])


def test_secrets_must_be_opened_and_refusals_reveal_nothing(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    workload: Workload,
    operator: OperatorProcess,
) -> None:
    """A tenant who cannot read Secrets names one in a LoraFleet whose selector matches another
    workload's pod. Whether the Secret is missing, exists unopened, or is opened but lacks the
    key, the adapters are Pending with one and the same message (names aside), and the workload
    receives nothing. Once the Secret's owner opens it to that fleet, the token is sent."""
    ns = kube_namespace
    tenant_role(kube_cluster, ns)
    kube_cluster.create_agent_pod(ns, "database", workload.port, labels={"app": "db"})
    kube_cluster.apply(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "List",
                "items": [
                    secret("db-password", {"password": b"hunter2"}),
                    secret("opened-other-key", {"other": b"s3cret"}, {"lorafleet.dev/allow-fleet": "true"}),
                ],
            }
        ),
        ns,
    )
    cases = {"f-missing": "no-such-secret", "f-unopened": "db-password", "f-nokey": "opened-other-key"}
    objects: list[dict[str, Any]] = []
    for fleet_name, secret_name in cases.items():
        fleet_obj = fleet_manifest(fleet_name)
        fleet_obj["spec"]["selector"] = {"matchLabels": {"app": "db"}}
        fleet_obj["spec"]["auth"] = {"tokenSecretRef": {"name": secret_name, "key": "password"}}
        objects += [fleet_obj, adapter_manifest(f"a-{fleet_name}", Path("/nowhere"), fleet=fleet_name)]
    as_tenant(kube_cluster, ns, *objects)

    for fleet_name in cases:
        wait_for(
            lambda f=fleet_name: ready_condition(kube_cluster, ns, f"a-{f}").get("reason") not in (None, "Reconciling"),
            60,
            f"a-{fleet_name} handled",
            operator,
        )
    checks = operator.drift_checks()
    wait_for(lambda: operator.drift_checks() >= checks + 6, 60, "drift checks", operator)
    assert workload.calls == [], workload.calls  # the password went nowhere
    for fleet_name in cases:
        assert ready_condition(kube_cluster, ns, f"a-{fleet_name}")["reason"] == "SecretNotOpened"

    def shown(fleet_name: str) -> tuple[str, str, str]:
        """What the tenant sees (adapter status, its Ready condition, the fleet's Ready
        condition), the names it wrote itself replaced."""
        st = kube_cluster.kubectl_json("get", "la", f"a-{fleet_name}", "-n", ns, as_user=TENANT)
        fl = kube_cluster.kubectl_json("get", "lfleet", fleet_name, "-n", ns, as_user=TENANT)
        texts = (st["status"]["message"], st["status"]["conditions"][0]["message"], fl["status"]["conditions"][0]["message"])
        a, b, c = (t.replace(repr(fleet_name), "F").replace(repr(cases[fleet_name]), "S") for t in texts)
        return a, b, c

    seen = {f: shown(f) for f in cases}
    assert len(set(seen.values())) == 1, seen
    text = " ".join(seen["f-missing"]).lower()
    for leak in ("not found", "404", "403", "forbidden", "lacks", "other", "exist"):
        assert leak not in text, (leak, text)
    assert phase(kube_cluster, ns, "a-f-unopened") == "Pending"

    # The Secret's owner opens it to this one fleet: now (and only now) the operator would send
    # the token, but first asks the pod to prove it is an agent holding it (the
    # identity check): the database cannot, and still receives nothing.
    kube_cluster.kubectl("label", "secret", "db-password", "-n", ns, "lorafleet.dev/allow-fleet=f-unopened")
    wait_for(lambda: workload.calls, 60, "the opened fleet's pod asked to prove it is an agent", operator)
    assert {method for method, _ in workload.calls} == {"/lorafleet.v1.NodeAgent/ProveIdentity"}
    assert set(workload.tokens()) == {""}
    assert ready_condition(kube_cluster, ns, "a-f-nokey")["reason"] == "SecretNotOpened"


def test_token_with_a_control_character_is_refused_once(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    operator: OperatorProcess,
) -> None:
    """A token Secret whose value holds a control character inside: the adapter is Pending with
    reason InvalidToken and a message that does not show the value; no "Illegal header value"
    traceback, no retry loop (one reconcile), over several drift checks."""
    ns = kube_namespace
    kube_cluster.apply(json.dumps(secret("bad-token", {"token": b"abc\x07def\n"}, {"lorafleet.dev/allow-fleet": "true"})), ns)
    fleet_obj = fleet_manifest("default")
    fleet_obj["spec"]["auth"] = {"tokenSecretRef": {"name": "bad-token"}}
    apply(kube_cluster, ns, fleet_obj, adapter_manifest("one", make_adapter(adapters, "one")))
    wait_for(lambda: ready_condition(kube_cluster, ns, "one").get("reason") == "InvalidToken", 60, "InvalidToken", operator)
    checks = operator.drift_checks()
    wait_for(lambda: operator.drift_checks() >= checks + 5, 60, "drift checks", operator)
    st = status(kube_cluster, ns, "one")
    assert st["phase"] == "Pending"
    assert "control or non-ASCII" in st["message"] and "abc" not in st["message"], st
    log = operator.log()
    assert "Illegal header value" not in log and "Traceback" not in log, log[-3000:]
    assert log.count(f"reconciled loraadapter {ns}/one gen=1") == 1
    for agent in fleet:
        assert registry(agent, ns) == {}


def test_fleet_status_counts_only_its_own_adapters(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    tmp_path: Path,
) -> None:
    """Two tenants' fleets share the same two agents (one namespace each). bob loads three
    adapters; alice's fleet status says her agents hold one (hers), not four."""
    ns_a = kube_namespace
    ns_b = kube_cluster.create_namespace(prefix="bob")
    op = None
    try:
        tenant_role(kube_cluster, ns_a, "alice")
        tenant_role(kube_cluster, ns_b, "bob")
        for agent in fleet:
            add_agent_pod(kube_cluster, ns_b, agent)
        apply(kube_cluster, ns_b, fleet_manifest())
        op = start_operator(kube_cluster, ns_a, tmp_path, env={"LORAFLEET_WATCH_NAMESPACES": f"{ns_a},{ns_b}"})
        as_tenant(kube_cluster, ns_a, adapter_manifest("mine", make_adapter(adapters, "mine")), user="alice")
        as_tenant(
            kube_cluster,
            ns_b,
            *(adapter_manifest(n, make_adapter(adapters, n, seed=i)) for i, n in enumerate(("b1", "b2", "b3"))),
            user="bob",
        )
        wait_phase(kube_cluster, ns_a, "mine", "Ready", op)
        for n in ("b1", "b2", "b3"):
            wait_phase(kube_cluster, ns_b, n, "Ready", op)
        for agent in fleet:  # the agents really are shared
            assert len(registry(agent, ns_a)) == 1 and len(registry(agent, ns_b)) == 3

        def loaded(ns: str, user: str) -> list[int]:
            fl = kube_cluster.kubectl_json("get", "lfleet", "default", "-n", ns, as_user=user)
            return [m["capacity"]["loadedLoras"] for m in fl["status"]["members"]]

        checks = op.drift_checks()
        wait_for(lambda: op.drift_checks() >= checks + 4, 60, "drift checks", op)
        wait_for(lambda: loaded(ns_a, "alice") == [1, 1] and loaded(ns_b, "bob") == [3, 3], 30, "each fleet's own count", op)
        kube_cluster.kubectl("delete", "la", "--all", "-n", ns_b, "--wait=true", "--timeout=60s")
    finally:
        if op is not None:
            op.stop()
        kube_cluster.delete_namespace(ns_b)


def test_deleting_a_fleet_unloads_its_adapters(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    operator: OperatorProcess,
) -> None:
    """The tenant deletes a LoraFleet with two Ready adapters: the fleet's finalizer holds it
    until both are unloaded from every agent; both are then Pending with reason FleetDeleted.
    Deleting them afterwards completes (nothing left to unload)."""
    ns = kube_namespace
    tenant_role(kube_cluster, ns)
    as_tenant(kube_cluster, ns, *(adapter_manifest(n, make_adapter(adapters, n, seed=i)) for i, n in enumerate(("one", "two"))))
    for n in ("one", "two"):
        wait_phase(kube_cluster, ns, n, "Ready", operator)
    for agent in fleet:
        assert set(registry(agent, ns)) == {f"{ns}.one", f"{ns}.two"}
    kube_cluster.kubectl("delete", "lfleet", "default", "-n", ns, "--wait=true", "--timeout=60s", as_user=TENANT)
    for agent in fleet:
        assert registry(agent, ns) == {}
    for n in ("one", "two"):
        st = wait_phase(kube_cluster, ns, n, "Pending", operator, timeout_s=30)
        assert st["conditions"][0]["reason"] == "FleetDeleted", st
        assert (st["agentsSummary"], st["ranksSummary"]) == ("0/0", "0/0")
    assert f"deleted lorafleet {ns}/default: 2 adapters unloaded from 2 agents" in operator.log()
    # Still nothing loaded a while later (drift interval: 1 s), and the adapters delete cleanly.
    time.sleep(3)
    for agent in fleet:
        assert registry(agent, ns) == {}
    kube_cluster.kubectl("delete", "la", "--all", "-n", ns, "--wait=true", "--timeout=60s", as_user=TENANT)


def test_pinning_is_the_fleet_owners_grant_and_capped_per_agent(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    operator: OperatorProcess,
) -> None:
    """A tenant who may create LoraAdapters (not fleets) asks for a pinned adapter: the fleet
    does not allow pinning, so it is Pending PinningNotAllowed and no agent holds it. Once the
    fleet's owner allows pinning it is loaded pinned. The agents have 4 device slots
    (max_loras_per_batch): at most 3 adapters are pinned on each, so a fourth pinned adapter
    is refused on every agent with the cap in the message, and an unpinned one still loads."""
    ns = kube_namespace
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "adapter-creator"},
        "rules": [
            {
                "apiGroups": ["lorafleet.dev"],
                "resources": ["loraadapters"],
                "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
            }
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "adapter-creator-bob"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "adapter-creator"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "bob"}],
    }
    kube_cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": [role, binding]}), ns)

    def pinned(name: str, seed: int) -> dict[str, Any]:
        manifest = adapter_manifest(name, make_adapter(adapters, name, seed=seed))
        manifest["spec"]["pinned"] = True
        return manifest

    as_tenant(kube_cluster, ns, pinned("p1", 1), user="bob")
    wait_for(lambda: ready_condition(kube_cluster, ns, "p1").get("reason") == "PinningNotAllowed", 60, "p1 refused", operator)
    assert "spec.pinning.allowed" in status(kube_cluster, ns, "p1")["message"]
    for agent in fleet:
        assert registry(agent, ns) == {}
    with pytest.raises(Exception, match="forbidden"):  # bob cannot grant it himself
        kube_cluster.kubectl(
            "patch", "lfleet", "default", "-n", ns, "--type=merge", "-p", '{"spec": {"pinning": {"allowed": true}}}', as_user="bob"
        )

    kube_cluster.kubectl("patch", "lfleet", "default", "-n", ns, "--type=merge", "-p", '{"spec": {"pinning": {"allowed": true}}}')
    wait_phase(kube_cluster, ns, "p1", "Ready", operator)
    as_tenant(kube_cluster, ns, pinned("p2", 2), pinned("p3", 3), user="bob")
    for n in ("p2", "p3"):
        wait_phase(kube_cluster, ns, n, "Ready", operator)
    as_tenant(kube_cluster, ns, pinned("p4", 4), adapter_manifest("free", make_adapter(adapters, "free", seed=5)), user="bob")
    st = wait_phase(kube_cluster, ns, "p4", "Failed", operator)
    assert {a["state"] for a in st["agents"]} == {"Failed"}, st
    assert "at most 3 may be pinned (max_loras_per_batch 4" in st["message"], st
    wait_phase(kube_cluster, ns, "free", "Ready", operator)
    for agent in fleet:
        assert set(registry(agent, ns)) == {f"{ns}.{n}" for n in ("p1", "p2", "p3", "free")}
    # Leave the shared agents without pins for the module's other tests.
    kube_cluster.kubectl("delete", "la", "--all", "-n", ns, "--wait=true", "--timeout=60s")
    for agent in fleet:
        assert registry(agent, ns) == {}


def test_http_sources_only_under_the_fleets_allowed_prefixes(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    operator: OperatorProcess,
) -> None:
    """The agents would fetch any loopback URL (their --allow-source), but the fleet's owner
    allows only one prefix: an adapter under it is loaded, one elsewhere (another path on the
    same server) is Pending SourceNotAllowed and never fetched. A fleet without prefixes
    refuses every http(s) source."""
    ns = kube_namespace
    tenant_role(kube_cluster, ns)
    source = Source(make_adapter(adapters, "remote"))
    source.failing = False
    thread = threading.Thread(target=source.serve_forever, daemon=True)
    thread.start()
    try:

        def remote(name: str, path: str) -> dict[str, Any]:
            manifest = adapter_manifest(name, Path("/unused"))
            manifest["spec"]["source"]["uri"] = source.url(path)
            return manifest

        as_tenant(kube_cluster, ns, remote("early", "allowed/early"))
        wait_for(lambda: ready_condition(kube_cluster, ns, "early").get("reason") == "SourceNotAllowed", 60, "early refused", operator)
        kube_cluster.kubectl(
            "patch",
            "lfleet",
            "default",
            "-n",
            ns,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"sources": {"allow": [source.url("allowed/")]}}}),
        )
        wait_phase(kube_cluster, ns, "early", "Ready", operator)
        as_tenant(kube_cluster, ns, remote("elsewhere", "internal/metadata"))
        wait_for(
            lambda: ready_condition(kube_cluster, ns, "elsewhere").get("reason") == "SourceNotAllowed", 60, "elsewhere refused", operator
        )
        checks = operator.drift_checks()
        wait_for(lambda: operator.drift_checks() >= checks + 3, 60, "drift checks", operator)
        assert [p for p in source.paths if not p.startswith("/allowed/")] == [], source.paths
        st = status(kube_cluster, ns, "elsewhere")
        assert st["phase"] == "Pending" and "spec.sources.allow" in st["message"], st
        for agent in fleet:
            assert set(registry(agent, ns)) == {f"{ns}.early"}
        kube_cluster.kubectl("delete", "la", "--all", "-n", ns, "--wait=true", "--timeout=60s")
    finally:
        source.shutdown()
        source.server_close()


def test_one_tenants_slow_downloads_do_not_hold_the_calls_another_needs(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    tmp_path: Path,
) -> None:
    """alice's four adapters come from a source that never answers. Before, their loads took
    the operator's four call slots on each agent, and bob's unrelated adapter (another
    namespace, same agents) waited until they timed out. Now remote loads have their own
    bound per agent and namespace (2): bob's adapter is Ready while alice's downloads still
    hang, and each agent sees at most 2 of them at once."""
    ns_a = kube_namespace
    ns_b = kube_cluster.create_namespace(prefix="bob")
    source = Source(make_adapter(adapters, "remote"))
    thread = threading.Thread(target=source.serve_forever, daemon=True)
    thread.start()
    op = None
    try:
        for agent in fleet:
            add_agent_pod(kube_cluster, ns_b, agent)
        apply(kube_cluster, ns_b, fleet_manifest())
        kube_cluster.kubectl(
            "patch",
            "lfleet",
            "default",
            "-n",
            ns_a,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"sources": {"allow": [source.url("hold/")]}}}),
        )
        op = start_operator(
            kube_cluster,
            ns_a,
            tmp_path,
            env={
                "LORAFLEET_WATCH_NAMESPACES": f"{ns_a},{ns_b}",
                # Longer than the test: the hanging loads keep hanging.
                "LORAFLEET_LOAD_DEADLINE_SECONDS": "300",
            },
        )
        slow = []
        for i in range(4):
            manifest = adapter_manifest(f"slow-{i}", Path("/unused"))
            manifest["spec"]["source"]["uri"] = source.url(f"hold/slow-{i}")
            slow.append(manifest)
        apply(kube_cluster, ns_a, *slow)
        wait_for(lambda: source.holding == 4, 60, "2 hanging downloads per agent", op)
        apply(kube_cluster, ns_b, adapter_manifest("quick", make_adapter(adapters, "quick")))
        wait_phase(kube_cluster, ns_b, "quick", "Ready", op, timeout_s=40)
        assert source.holding == 4  # alice's downloads still hang, and no more than 2 per agent
        kube_cluster.kubectl("delete", "la", "--all", "-n", ns_b, "--wait=true", "--timeout=60s")
    finally:
        source.release.set()
        if op is not None:
            op.stop()
        source.shutdown()
        source.server_close()
        kube_cluster.delete_namespace(ns_b)
