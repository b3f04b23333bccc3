"""Liveness: the leader's ``/healthz`` is kopf's own liveness endpoint, and its probe
fails while a fleet's drift loop is wedged, so the kubelet would restart the process; it answers
again once the loop finishes rounds.

The real operator, the real API server, one real agent (tp=1) that the operator dials through
the fault proxy (tests/support/faultproxy.py). What wedges a round is an agent that stops
answering on a connection that is already open: the round's Describe then waits for its whole
call deadline. An endpoint that accepts TCP and never answers does not: a new gRPC connection
that never gets the server's HTTP/2 SETTINGS frame fails within the operator's minimum
reconnect back-off (200 ms, ``agent_client.CHANNEL_OPTIONS``) with UNAVAILABLE, and the round
ends with the agent unreachable.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet_dev.agents import AgentProcess
from tests.kube.harness import ControlPlane, free_port
from tests.operator.agents import FLEET_LABEL, agent_spec, apply, fleet_manifest, serving
from tests.operator.conftest import start_operator, wait_for
from tests.support.faultproxy import FaultProxy

#: ``failures.loop_stall_s`` = 3 x max(drift interval, transient retry cap) + load deadline
#: = 5 s; a stalled Describe waits for the call deadline, far longer.
WEDGE_ENV = {
    "LORAFLEET_DRIFT_INTERVAL_SECONDS": "1",
    "LORAFLEET_TRANSIENT_RETRY_MAX_SECONDS": "1",
    "LORAFLEET_LOAD_DEADLINE_SECONDS": "2",
    "LORAFLEET_CALL_DEADLINE_SECONDS": "300",
}


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """One small serving agent (tp=1, dp=1) for the module."""
    root = tmp_path_factory.mktemp("liveness-agent")
    spec, _ = agent_spec(root, tp=1, dp=1)
    process = AgentProcess("agent-0", spec, root / "logs")
    with serving([process]):
        yield process


def healthz(port: int) -> tuple[int, object]:
    """The liveness endpoint's HTTP status and body (JSON when it is 200)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def test_liveness_fails_while_a_drift_loop_is_wedged_and_recovers(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    agent: AgentProcess,
    tmp_path: Path,
) -> None:
    ns = kube_namespace
    health = free_port()
    with FaultProxy(agent.port) as proxy:
        kube_cluster.create_agent_pod(ns, agent.name, proxy.port, labels={FLEET_LABEL: "default"})
        apply(kube_cluster, ns, fleet_manifest())
        op = start_operator(kube_cluster, ns, tmp_path, env={**WEDGE_ENV, "LORAFLEET_HEALTH_PORT": str(health)})
        try:
            # Healthy: the fleet's loop finishes rounds, over an open connection to the agent.
            wait_for(
                lambda: kube_cluster.kubectl_json("get", "lorafleet", "default", "-n", ns).get("status", {}).get("readyAgents") == 1,
                60,
                "the agent to answer",
                op,
            )
            wait_for(lambda: healthz(health) == (200, {"driftLoops": 1}), 60, "healthz 200", op)

            # The agent stops answering: the next round's Describe waits on the open
            # connection, and the probe fails once no round has finished for loop_stall_s.
            proxy.stall()
            wait_for(lambda: healthz(health)[0] == 500, 60, "healthz to fail", op)
            assert f"drift loops stalled for over 5s: {ns}/default" in op.log()
            assert healthz(health)[0] == 500  # still wedged: the call deadline is far away

            # The agent answers again: the waiting round ends, and so does the failure.
            proxy.pass_through()
            wait_for(lambda: healthz(health) == (200, {"driftLoops": 1}), 60, "healthz 200 again", op)
            assert op.popen.poll() is None  # the probe reports; restarting is the kubelet's
            # The probe's reason is logged once per failed probe; no line per request.
            assert "GET /healthz" not in op.log()
        finally:
            op.stop()
