"""Quotas and fair share (docs/operator.md, Security: "Quotas and fair share"): a LoraFleet's
``spec.quotas`` limits the slots (adapter × agent placements) each namespace holds on its
agents, and guarantees a share (``minSlots``). The CRD's checks, then two tenants on shared agents under a fleet of the operator's
own namespace with a quota: real operator, real API server, two real agents that hold 4
adapters each, tenants as impersonated users with the tenant Role. (The rule as plain
decisions: test_quota_rule.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lorafleet_dev.agents import AgentProcess
from tests.kube.harness import ControlPlane, KubectlError
from tests.operator.agents import (
    adapter_manifest,
    add_agent_pod,
    agent_pair,
    apply,
    fleet_manifest,
    make_adapter,
    registry,
    status,
)
from tests.operator.conftest import OperatorProcess, start_operator, wait_for
from tests.operator.test_tenants import as_tenant, tenant_role

# ---- two tenants on shared agents -------------------------------------------------------

CAPACITY = 4


@pytest.fixture(scope="module")
def four_slot_agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[AgentProcess], Path]]:
    """Two agents that hold at most 4 adapters each (8 slots in all)."""
    with agent_pair(tmp_path_factory.mktemp("quota-agents"), max_loaded_loras=CAPACITY) as pair:
        yield pair


def with_quotas(manifest: dict[str, Any], quotas: dict[str, Any]) -> dict[str, Any]:
    return {**manifest, "spec": {**manifest["spec"], "quotas": quotas}}


def ready_condition(cluster: ControlPlane, ns: str, name: str) -> tuple[str, str]:
    ready = next(c for c in status(cluster, ns, name).get("conditions") or [] if c["type"] == "Ready")
    return ready["reason"], ready["message"]


@pytest.mark.parametrize(
    ("quotas", "message"),
    [
        ({}, "quotas must set a default or name at least one namespace"),
        ({"default": {"maxSlots": -1}}, "should be greater than or equal to 0"),
        ({"namespaces": [{"namespace": "Team_A", "maxSlots": 1}]}, "should match"),
        ({"namespaces": [{"namespace": "a", "maxSlots": 1}, {"namespace": "a", "maxSlots": 2}]}, "Duplicate value"),
        ({"namespaces": [{"namespace": "a", "maxSlots": 1, "minSlots": 2}]}, "minSlots cannot exceed maxSlots"),
        ({"namespaces": [{"namespace": "a", "maxSlots": 1, "minSlots": -1}]}, "should be greater than or equal to 0"),
    ],
)
def test_the_api_server_refuses_a_bad_quota(
    kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...], quotas: dict[str, Any], message: str
) -> None:
    with pytest.raises(KubectlError) as err:
        apply(kube_cluster, kube_namespace, with_quotas(fleet_manifest("bad"), quotas))
    assert message in err.value.stderr


def test_a_tenant_over_its_quota_waits_and_another_tenant_is_placed(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    four_slot_agents: tuple[list[AgentProcess], Path],
    tmp_path: Path,
) -> None:
    """The operator's namespace has the agents' fleet `small` with a default quota of 4 slots;
    tenants a and b have their own fleets `small` over the same agent processes. Tenant a
    applies 6 adapters, each wanting both agents (12 slots): 4 slots are given (2 adapters
    Ready on both agents), the other 4 adapters are Pending `QuotaExceeded` naming the quota.
    Tenant b's own fleet declares a quota of 0 for tenant a, which binds nobody but b. Tenant
    b's adapter then finds room: Ready on both agents. Before quotas, tenant a's first 4
    adapters took all 8 slots and b's stayed Pending `NoRoom`."""
    agents, root = four_slot_agents
    home = kube_namespace
    tenants = [kube_cluster.create_namespace(prefix=f"tenant-{t}") for t in "ab"]
    for ns in (home, *tenants):
        for a in agents:
            add_agent_pod(kube_cluster, ns, a, fleet="small")
    apply(kube_cluster, home, with_quotas(fleet_manifest("small"), {"default": {"maxSlots": 4}}))
    ta, tb = tenants
    for ns in tenants:
        tenant_role(kube_cluster, ns)
    as_tenant(kube_cluster, ta, fleet_manifest("small"))
    as_tenant(kube_cluster, tb, with_quotas(fleet_manifest("small"), {"namespaces": [{"namespace": ta, "maxSlots": 0}]}))
    op: OperatorProcess = start_operator(kube_cluster, home, tmp_path, env={"LORAFLEET_WATCH_NAMESPACES": ",".join((home, *tenants))})
    try:
        names = [f"a{i}" for i in range(6)]
        as_tenant(kube_cluster, ta, *(adapter_manifest(n, make_adapter(root / ta, n, seed=i), fleet="small") for i, n in enumerate(names)))

        def tenant_a_settled() -> bool:
            phases = [status(kube_cluster, ta, n).get("phase") for n in names]
            return phases.count("Ready") == 2 and phases.count("Pending") == 4

        wait_for(tenant_a_settled, 120, "tenant a: 2 adapters Ready, 4 Pending", op)
        assert sum(len(registry(a, ta)) for a in agents) == 4
        waiting = [n for n in names if status(kube_cluster, ta, n)["phase"] == "Pending"]
        quota_message = f"namespace {ta} holds 4 of its 4 slots on LoraFleet {home}/small (spec.quotas.default)"
        assert {ready_condition(kube_cluster, ta, n) for n in waiting} == {("QuotaExceeded", quota_message)}

        as_tenant(kube_cluster, tb, adapter_manifest("b0", make_adapter(root / tb, "b0"), fleet="small"))
        wait_for(lambda: status(kube_cluster, tb, "b0").get("phase") == "Ready", 120, "tenant b's adapter Ready", op)
        assert [list(registry(a, tb)) for a in agents] == [[f"{tb}.b0"], [f"{tb}.b0"]]
        assert status(kube_cluster, tb, "b0")["agentsSummary"] == "2/2"
        assert sum(len(registry(a, ta)) for a in agents) == 4  # tenant a still holds its 4, no more
    finally:
        for ns in tenants:
            kube_cluster.kubectl("delete", "la,lfleet", "--all", "-n", ns, "--wait=true", "--timeout=60s")
            kube_cluster.delete_namespace(ns)
        op.stop()


def test_a_tenants_guaranteed_slot_is_taken_back_from_the_tenant_that_filled_the_fleet(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    four_slot_agents: tuple[list[AgentProcess], Path],
    tmp_path: Path,
) -> None:
    """The operator's fleet `small` guarantees tenant b 1 slot (``minSlots: 1``) and limits
    nobody else. Tenant a's 4 adapters, each on both agents, fill all 8 slots. Tenant b then
    applies one adapter: it waits `AwaitingGuaranteedSlot`, never `NoRoom`, while the drift
    check takes one place back from tenant a's newest adapter (unloaded there; it keeps its
    other place); then it is Ready. Before, it stayed Pending `NoRoom`
    until tenant a deleted adapters."""
    agents, root = four_slot_agents
    home = kube_namespace
    tenants = [kube_cluster.create_namespace(prefix=f"share-{t}") for t in "ab"]
    for ns in (home, *tenants):
        for a in agents:
            add_agent_pod(kube_cluster, ns, a, fleet="small")
    ta, tb = tenants
    apply(kube_cluster, home, with_quotas(fleet_manifest("small"), {"namespaces": [{"namespace": tb, "maxSlots": 8, "minSlots": 1}]}))
    for ns in tenants:
        tenant_role(kube_cluster, ns)
        as_tenant(kube_cluster, ns, fleet_manifest("small"))
    op: OperatorProcess = start_operator(kube_cluster, home, tmp_path, env={"LORAFLEET_WATCH_NAMESPACES": ",".join((home, *tenants))})
    try:
        names = [f"a{i}" for i in range(CAPACITY)]
        for i, n in enumerate(names):  # one by one: creation order says which is the newest
            as_tenant(kube_cluster, ta, adapter_manifest(n, make_adapter(root / ta, n, seed=10 + i), fleet="small"))
            wait_for(lambda n=n: status(kube_cluster, ta, n).get("agentsSummary") == "2/2", 60, f"{n} on both agents", op)
        assert [len(registry(a, ta)) for a in agents] == [CAPACITY, CAPACITY]

        reasons: list[str] = []

        def b_ready() -> bool:
            reasons.append(ready_condition(kube_cluster, tb, "b0")[0] if status(kube_cluster, tb, "b0").get("conditions") else "")
            return status(kube_cluster, tb, "b0").get("phase") == "Ready"

        as_tenant(kube_cluster, tb, adapter_manifest("b0", make_adapter(root / tb, "b0", seed=3), fleet="small"))
        wait_for(b_ready, 120, "tenant b's adapter Ready", op, interval_s=0.05)
        # Pending AwaitingGuaranteedSlot while it waits (the pure tests check that reason); on a
        # quiet machine the take-back can finish before the first poll sees it Pending at all.
        assert "NoRoom" not in reasons and set(reasons) <= {"", "AwaitingGuaranteedSlot", "AllAgentsLoaded"}, reasons
        assert sum(len(registry(a, tb)) for a in agents) == 1
        # The newest of tenant a gave one place back: it keeps the other (b now holds the slot).
        newest = status(kube_cluster, ta, names[-1])
        assert (newest["phase"], newest["placement"]["placedCount"], newest["agentsSummary"]) == ("Ready", 1, "1/1")
        assert all(status(kube_cluster, ta, n)["agentsSummary"] == "2/2" for n in names[:-1])
        assert sum(len(registry(a, ta)) for a in agents) == 2 * CAPACITY - 1
    finally:
        for ns in tenants:
            kube_cluster.kubectl("delete", "la,lfleet", "--all", "-n", ns, "--wait=true", "--timeout=60s")
            kube_cluster.delete_namespace(ns)
        kube_cluster.kubectl("delete", "lfleet", "--all", "-n", home, "--wait=true", "--timeout=60s")
        op.stop()
