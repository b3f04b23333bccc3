"""Retries and status truth: a failing source is asked less and less often (by the
handlers and the drift check alike) and the status says when the next try is; a replace that
fails leaves the status saying what the agents still serve.

Real operator, real API server, the module's two real agents (tests/operator/test_e2e.py's
fixtures), a real HTTP source on loopback.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet.v1 import agent_pb2
from lorafleet_dev.agents import AgentProcess
from tests.agent.helpers import running
from tests.kube.harness import ControlPlane
from tests.operator import test_e2e
from tests.operator.agents import (
    Source,
    adapter_manifest,
    apply,
    corrupt_adapter,
    fleet_manifest,
    make_adapter,
    registry,
    status,
    stub,
)
from tests.operator.conftest import OperatorProcess, start_operator, wait_for

agent_env = test_e2e.agent_env
agents = test_e2e.agents
adapters = test_e2e.adapters
fleet = test_e2e.fleet
wait_phase = test_e2e.wait_phase


def sources(agent: AgentProcess, ns: str) -> dict[str, str]:
    """The agent's registry: this namespace's names and the source each was loaded from."""
    channel, agent_stub = stub(agent)
    with channel:
        reply = agent_stub.ListAdapters(agent_pb2.ListAdaptersRequest(), timeout=10)
    return {a.name: a.source_uri for a in reply.adapters if a.name.startswith(f"{ns}.")}


@pytest.fixture
def source(adapters: Path) -> Iterator[Source]:
    with running(Source(make_adapter(adapters, "served-over-http"))) as server:
        yield server


#: Transient retries from 2 s doubling to 20 s (jittered down by up to half), drift every 1 s.
BACKOFF_ENV = {"LORAFLEET_TRANSIENT_RETRY_SECONDS": "2", "LORAFLEET_TRANSIENT_RETRY_MAX_SECONDS": "20"}


def test_a_source_answering_503_is_asked_less_and_less(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    source: Source,
    tmp_path: Path,
) -> None:
    """Both agents' downloads get 503. Before, every drift check (every second here) loaded
    again on every agent: at least 2 fetches per check. Now each agent's tries wait 1-2 s,
    2-4 s, 4-8 s, ... up to 20 s: over 12 drift checks the source sees fewer than 12
    requests. Meanwhile the status names the failure and the next retry time. When the source
    recovers, the next retry loads it (no spec change needed)."""
    ns = kube_namespace
    op = start_operator(kube_cluster, ns, tmp_path, env=BACKOFF_ENV)
    try:
        manifest = adapter_manifest("remote", Path("/unused"))
        manifest["spec"]["source"]["uri"] = source.url()
        allowed = fleet_manifest()  # the fleet's owner allows the source (spec.sources)
        allowed["spec"]["sources"] = {"allow": [source.url("")]}
        apply(kube_cluster, ns, allowed, manifest)

        def failing_with_a_retry_time() -> bool:
            st = status(kube_cluster, ns, "remote")
            agents_st = st.get("agents") or []
            return (
                len(agents_st) == 2
                and bool(st.get("nextRetryTime"))
                and all(a["state"] == "Unreachable" and "503" in a["message"] and a.get("nextRetryTime") for a in agents_st)
            )

        wait_for(failing_with_a_retry_time, 60, "both agents failing with a retry time", op)
        st = status(kube_cluster, ns, "remote")
        assert st["nextRetryTime"] == min(a["nextRetryTime"] for a in st["agents"])
        assert st["phase"] == "Loading", st

        hits, checks = source.hits, op.drift_checks()
        wait_for(lambda: op.drift_checks() >= checks + 12, 90, "12 drift checks", op)
        assert source.hits - hits < 12, (source.hits - hits, op.log()[-3000:])

        source.failing = False
        st = wait_phase(kube_cluster, ns, "remote", "Ready", op, timeout_s=90)
        assert "nextRetryTime" not in st and all("nextRetryTime" not in a for a in st["agents"])
        for agent in fleet:
            assert set(registry(agent, ns)) == {f"{ns}.remote"}
    finally:
        op.stop()


def test_a_failed_replace_says_the_previous_version_is_still_served(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    fleet: list[AgentProcess],
    adapters: Path,
    operator: OperatorProcess,
) -> None:
    """A Ready adapter's source is changed to one the agents refuse. They keep serving the old
    weights (their registries still list the old source), so the status says so: Degraded,
    Ready False with reason PreviousVersionServed naming the old source, each agent Failed
    with the agent's error, the served source and the next retry time. Before, it was Failed
    0/2 while both agents served the old version. Fixing the spec makes it Ready again."""
    ns = kube_namespace
    good = make_adapter(adapters, "good")
    apply(kube_cluster, ns, adapter_manifest("one", good))
    wait_phase(kube_cluster, ns, "one", "Ready", operator)

    bad = corrupt_adapter(adapters, "bad")
    apply(kube_cluster, ns, adapter_manifest("one", bad))
    wait_for(
        lambda: (
            status(kube_cluster, ns, "one").get("observedGeneration") == 2
            and status(kube_cluster, ns, "one").get("phase") not in ("Loading", "Ready")
        ),
        60,
        "generation 2 handled",
        operator,
    )
    checks = operator.drift_checks()
    wait_for(lambda: operator.drift_checks() >= checks + 3, 60, "drift checks", operator)
    st = status(kube_cluster, ns, "one")
    assert st["phase"] == "Degraded", st
    ready = st["conditions"][0]
    assert (ready["status"], ready["reason"]) == ("False", "PreviousVersionServed"), ready
    assert f"file://{good}" in ready["message"]
    for entry in st["agents"]:
        assert entry["state"] == "Failed" and entry["served"]["uri"] == f"file://{good}", entry
        assert entry["nextRetryTime"] and entry["message"], entry
    assert st["message"], st
    for agent in fleet:  # what the status says is what the agents hold
        assert sources(agent, ns) == {f"{ns}.one": f"file://{good}"}

    fixed = make_adapter(adapters, "fixed", seed=3)
    apply(kube_cluster, ns, adapter_manifest("one", fixed))
    st = wait_phase(kube_cluster, ns, "one", "Ready", operator)
    assert all("served" not in a for a in st["agents"]), st
