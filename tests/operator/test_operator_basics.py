"""The operator against the real API server before any agent is involved: Pending with the
reason, fleet status, finalizer released on delete, events, one log line per reconcile."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from tests.kube.harness import ControlPlane
from tests.operator.conftest import OperatorProcess, start_operator, wait_for


def adapter(name: str, fleet: str = "default", uri: str | None = None) -> str:
    return json.dumps(
        {
            "apiVersion": "lorafleet.dev/v1alpha1",
            "kind": "LoraAdapter",
            "metadata": {"name": name},
            "spec": {"baseModel": "tiny", "source": {"uri": uri or f"file:///adapters/{name}"}, "fleetRef": {"name": fleet}},
        }
    )


def fleet(name: str = "default", selector: dict[str, str] | None = None) -> str:
    return json.dumps(
        {
            "apiVersion": "lorafleet.dev/v1alpha1",
            "kind": "LoraFleet",
            "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": selector or {"lorafleet.dev/fleet": name}}},
        }
    )


def get(cluster: ControlPlane, kind: str, name: str, ns: str) -> dict[str, Any]:
    return dict(cluster.kubectl_json("get", kind, name, "-n", ns))


def test_missing_fleet_then_empty_fleet_then_delete(kube_cluster: ControlPlane, kube_namespace: str, operator: OperatorProcess) -> None:
    ns = kube_namespace
    kube_cluster.apply(adapter("a"), ns)

    def phase_reason() -> tuple[str, str]:
        status = get(kube_cluster, "la", "a", ns).get("status") or {}
        ready = (status.get("conditions") or [{}])[0]
        return status.get("phase", ""), ready.get("reason", "")

    wait_for(lambda: phase_reason() == ("Pending", "FleetNotFound"), 30, "FleetNotFound", operator)
    la = get(kube_cluster, "la", "a", ns)
    assert "lorafleet.dev/unload" in la["metadata"]["finalizers"]
    assert la["status"]["conditions"][0]["type"] == "Ready"

    # The fleet appears (no agent pods): its drift check re-evaluates the adapter.
    kube_cluster.apply(fleet(), ns)
    wait_for(lambda: phase_reason() == ("Pending", "NoTargetAgents"), 30, "NoTargetAgents", operator)
    wait_for(
        lambda: get(kube_cluster, "lfleet", "default", ns).get("status", {}).get("conditions", [{}])[0].get("reason") == "NoAgents",
        30,
        "fleet status",
        operator,
    )
    fleet_status = get(kube_cluster, "lfleet", "default", ns)["status"]
    assert (fleet_status["agents"], fleet_status["readyAgents"]) == (0, 0)

    # Deletion: the finalizer is released (nothing to unload), the object goes.
    kube_cluster.kubectl("delete", "la", "a", "-n", ns, "--wait=true", "--timeout=30s")
    assert kube_cluster.kubectl("get", "la", "-n", ns, "-o", "name").stdout == ""

    log = operator.log()
    assert "reconciled loraadapter" in log and "deleted loraadapter" in log
    # One line per reconcile: the create handler ran once (not a retry loop).
    assert log.count(f"reconciled loraadapter {ns}/a gen=1 trigger=create") == 1
    events = kube_cluster.kubectl_json("get", "events", "-n", ns)["items"]
    assert any(e["reason"] == "Pending" and e["involvedObject"]["name"] == "a" for e in events)


def test_two_replicas_only_the_leader_acts_and_the_other_takes_over(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    tmp_path: Path,
) -> None:
    ns = kube_namespace
    first = start_operator(kube_cluster, ns, tmp_path, identity="op-a")
    second = start_operator(kube_cluster, ns, tmp_path, identity="op-b", wait_leader=False)
    try:
        wait_for(lambda: "waiting for leadership" in second.log(), 30, "op-b to wait", second)
        kube_cluster.apply(adapter("a"), ns)
        wait_for(lambda: "reconciled loraadapter" in first.log(), 30, "op-a to act", first)
        lease = kube_cluster.kubectl_json("get", "lease", "lorafleet-operator", "-n", ns)
        assert lease["spec"]["holderIdentity"] == "op-a"

        first.stop(signal.SIGKILL)  # no release: op-b must wait for the lease to expire
        wait_for(lambda: "became leader" in second.log(), 60, "op-b to take over", second)
        # All op-b logged before it became leader it logged as a follower: all through op-a's
        # reconcile and the lease's expiry, it never acted.
        following = second.log().partition("became leader")[0]
        assert "waiting for leadership" in following
        assert "reconciled loraadapter" not in following
        kube_cluster.apply(adapter("b"), ns)
        wait_for(lambda: f"reconciled loraadapter {ns}/b" in second.log(), 30, "op-b to act", second)
        lease = kube_cluster.kubectl_json("get", "lease", "lorafleet-operator", "-n", ns)
        assert lease["spec"]["holderIdentity"] == "op-b"
        assert lease["spec"]["leaseTransitions"] >= 1
    finally:
        first.stop()
        second.stop()
