"""LoraAdapter status building: phases, failure-first merging, conditions — and the API
server's own schema (with its CEL rules) accepting every status the operator can build."""

from __future__ import annotations

import asyncio
import json

import pytest

from lorafleet_operator.kube import Kube, make_api_client
from lorafleet_operator.reasons import Reason
from lorafleet_operator.status import (
    AgentResult,
    AgentState,
    Pending,
    Phase,
    ServedVersion,
    build_status,
    initial_status,
    merged_message,
    phase_of,
)
from tests.kube.harness import ControlPlane

LOADED = AgentResult("agent-0", AgentState.LOADED, 2, 2)
LOADED_1 = AgentResult("agent-1", AgentState.LOADED, 2, 2)
FAILED_1 = AgentResult("agent-1", AgentState.FAILED, 0, 2, "sha256 mismatch")
FAILED_0 = AgentResult("agent-0", AgentState.FAILED, 0, 2, "sha256 mismatch")
DOWN_1 = AgentResult("agent-1", AgentState.UNREACHABLE, 0, 2, "connection refused")
OLD = ServedVersion("file:///adapters/old", "a" * 64)
#: A replace refused on agent-0, which still serves the previous version; retried later.
STALE_0 = AgentResult("agent-0", AgentState.FAILED, 0, 2, "sha256 mismatch", served=OLD, next_retry="2026-01-01T00:05:00Z")
STALE_1 = AgentResult("agent-1", AgentState.UNREACHABLE, 0, 2, "HTTP 503", served=OLD, next_retry="2026-01-01T00:00:04Z")


@pytest.mark.parametrize(
    ("results", "phase"),
    [
        ([], Phase.PENDING),
        ([LOADED, LOADED_1], Phase.READY),
        ([LOADED, FAILED_1], Phase.DEGRADED),
        ([LOADED, DOWN_1], Phase.DEGRADED),
        ([FAILED_0, FAILED_1], Phase.FAILED),
        ([FAILED_0, DOWN_1], Phase.FAILED),
        # A failed replace: the previous version is still served, so the adapter is not Failed.
        ([STALE_0, FAILED_1], Phase.DEGRADED),
        ([STALE_0, STALE_1], Phase.DEGRADED),
        ([AgentResult("agent-0", AgentState.UNREACHABLE, 0, 2, "x")], Phase.LOADING),
        # Loaded on only some ranks is not loaded.
        ([AgentResult("agent-0", AgentState.LOADED, 1, 2)], Phase.LOADING),
    ],
)
def test_phase(results: list[AgentResult], phase: Phase) -> None:
    assert phase_of(results) is phase
    assert phase_of(results, deleting=True) is Phase.TERMINATING


def test_message_is_failure_first_over_agents() -> None:
    """Distinct agent errors in order of appearance, joined with ' | ' (the one rule)."""
    other = AgentResult("agent-2", AgentState.FAILED, 0, 2, "rank 1: out of memory")
    assert merged_message([LOADED, FAILED_1, FAILED_0, other]) == "sha256 mismatch | rank 1: out of memory"
    assert merged_message([LOADED, LOADED_1]) == ""


def test_status_totals_agents_and_conditions() -> None:
    status = build_status([FAILED_1, LOADED], generation=3, now="2026-01-01T00:00:00Z")
    assert status["phase"] == "Degraded"
    assert [a["pod"] for a in status["agents"]] == ["agent-0", "agent-1"]
    assert status["agents"][1] == {"pod": "agent-1", "state": "Failed", "ranksLoaded": 0, "ranksTotal": 2, "message": "sha256 mismatch"}
    assert (status["agentsSummary"], status["ranksSummary"]) == ("1/2", "2/4")
    assert status["message"] == "sha256 mismatch"
    ready, degraded = status["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "PartiallyLoaded")
    assert "agent-1" in ready["message"]  # names the failing agent
    assert (degraded["type"], degraded["status"]) == ("Degraded", "True")
    assert "agent-1 (Failed)" in degraded["message"]
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])


def test_a_failed_replace_says_what_the_agents_still_serve() -> None:
    """No agent holds the new version, both still serve the old one: Degraded, Ready False
    with reason PreviousVersionServed naming the old source; each agent's entry carries the
    served source and digest and its next retry; the status the earliest retry."""
    status = build_status([STALE_1, STALE_0], generation=2, now="2026-01-01T00:00:00Z")
    assert status["phase"] == "Degraded"
    ready = status["conditions"][0]
    assert (ready["status"], ready["reason"]) == ("False", Reason.PREVIOUS_VERSION_SERVED)
    assert "agent-0, agent-1 still serve(s) a previous version (file:///adapters/old)" in ready["message"]
    assert status["agents"][0]["served"] == {"uri": "file:///adapters/old", "sha256": "a" * 64}
    assert [a["nextRetryTime"] for a in status["agents"]] == ["2026-01-01T00:05:00Z", "2026-01-01T00:00:04Z"]
    assert status["nextRetryTime"] == "2026-01-01T00:00:04Z"
    assert build_status([LOADED], generation=2)["nextRetryTime"] is None


def test_last_transition_time_kept_while_status_unchanged() -> None:
    first = build_status([LOADED], generation=1, now="2026-01-01T00:00:00Z")
    again = build_status([LOADED], generation=2, previous=first, now="2026-01-01T00:05:00Z")
    assert again["conditions"][0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert again["conditions"][0]["observedGeneration"] == 2
    flipped = build_status([FAILED_0], generation=2, previous=again, now="2026-01-01T00:09:00Z")
    assert flipped["conditions"][0]["lastTransitionTime"] == "2026-01-01T00:09:00Z"
    # Degraded was False before and is True now: it moved too; Ready False->False would not.
    assert flipped["conditions"][1]["lastTransitionTime"] == "2026-01-01T00:09:00Z"


def test_pending_explains_why() -> None:
    status = build_status([], generation=1, pending=Pending("FleetNotFound", "LoraFleet 'x' not found in ns"))
    assert status["phase"] == "Pending"
    assert status["message"] == "LoraFleet 'x' not found in ns"
    assert status["conditions"][0]["reason"] == "FleetNotFound"
    assert (status["agentsSummary"], status["ranksSummary"]) == ("0/0", "0/0")


ADAPTER = {
    "apiVersion": "lorafleet.dev/v1alpha1",
    "kind": "LoraAdapter",
    "metadata": {"name": "a"},
    "spec": {"baseModel": "tiny", "source": {"uri": "file:///adapters/a"}, "fleetRef": {"name": "default"}},
}


def test_every_status_is_accepted_by_the_api_server(
    kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...]
) -> None:
    """Each phase's status passes the CRD schema and its CEL rules, through the status
    subresource, with the operator's own client code; and is read back unchanged."""
    kube_cluster.apply(json.dumps(ADAPTER), kube_namespace)
    kube = Kube(make_api_client(str(kube_cluster.kubeconfig)))
    long_message = "x" * 50000  # longer than the CRD allows: must be cut, not refused
    cases = [
        initial_status(1),
        build_status([], generation=1),
        build_status([LOADED, LOADED_1], generation=1),
        build_status([LOADED, FAILED_1], generation=1),
        build_status([FAILED_0, DOWN_1], generation=1),
        build_status([AgentResult("agent-0", AgentState.FAILED, 0, 2, long_message)], generation=1),
        build_status([STALE_0, STALE_1], generation=1),
        build_status([LOADED], generation=1, deleting=True),
    ]
    for status in cases:
        stored = asyncio.run(kube.patch_adapter_status(kube_namespace, "a", status))
        assert stored is not None
        for key, value in status.items():
            assert stored["status"].get(key) == value, key  # None: removed (merge patch)
    table = kube_cluster.kubectl("get", "la", "a", "-n", kube_namespace).stdout
    assert "Terminating" in table
    # The agents[] list is atomic: the status write's managedFields name the list, not each
    # listed pod (a keyed list would add an entry per pod to every write and watch event).
    many = build_status([AgentResult(f"agent-{i}", AgentState.LOADED, 2, 2) for i in range(32)], generation=1)
    asyncio.run(kube.patch_adapter_status(kube_namespace, "a", many))
    stored = kube_cluster.kubectl_json("get", "la", "a", "-n", kube_namespace, "--show-managed-fields", "-o", "json")
    fields = json.dumps([m["fieldsV1"] for m in stored["metadata"]["managedFields"] if m.get("subresource") == "status"])
    assert '"f:agents": {}' in fields and "agent-3" not in fields, fields


def test_inconsistent_summary_is_refused_by_the_api_server(
    kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...]
) -> None:
    """The CEL rule the status is written against can fail: the test above can fail too."""
    from kubernetes.client.exceptions import ApiException

    kube_cluster.apply(json.dumps(ADAPTER), kube_namespace)
    kube = Kube(make_api_client(str(kube_cluster.kubeconfig)))
    status = build_status([LOADED], generation=1)
    status["agentsSummary"] = "2/1"
    with pytest.raises(ApiException) as err:
        asyncio.run(kube.patch_adapter_status(kube_namespace, "a", status))
    assert "agentsSummary must equal" in str(err.value.body)


def test_a_progress_message_never_writes_over_a_newer_condition(
    kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...]
) -> None:
    """The download progress replaces only the Ready condition's message, guarded by the message
    it read: a status another writer stored since (a drift check's correction) is left as it is,
    and the progress written over the message it read keeps every other field."""
    from lorafleet_operator.progress import ready_message_at

    kube_cluster.apply(json.dumps(ADAPTER), kube_namespace)
    kube = Kube(make_api_client(str(kube_cluster.kubeconfig)))
    asyncio.run(kube.patch_adapter_status(kube_namespace, "a", build_status([], generation=1)))
    read = ready_message_at(asyncio.run(kube.get_adapter(kube_namespace, "a")))
    assert read is not None
    corrected = build_status([LOADED, FAILED_1], generation=1)
    asyncio.run(kube.patch_adapter_status(kube_namespace, "a", corrected))
    assert not asyncio.run(kube.replace_condition_message(kube_namespace, "a", read, "Loading: 1 of 2 MiB"))
    stored = asyncio.run(kube.get_adapter(kube_namespace, "a"))
    assert stored is not None and stored["status"]["conditions"] == corrected["conditions"]
    now = ready_message_at(stored)
    assert now is not None and now.message != read.message
    assert asyncio.run(kube.replace_condition_message(kube_namespace, "a", now, "Loading: 1 of 2 MiB"))
    after = asyncio.run(kube.get_adapter(kube_namespace, "a"))
    assert after is not None
    ready = after["status"]["conditions"][now.index]
    expected = corrected["conditions"][now.index]
    assert ready == {**expected, "message": "Loading: 1 of 2 MiB"}
    assert asyncio.run(kube.get_adapter(kube_namespace, "missing")) is None
