"""The status stops saying Loaded on an agent that lost the adapter even while a handler's
long load of that adapter runs (docs/operator.md, "Status semantics").

The drift check leaves an adapter whose handler is at work to that handler. Before, a slow
load on one agent (a slow http source) hid an adapter lost meanwhile on another agent for as
long as the load ran: the status said Loaded there. Now the drift check corrects such claims
from the registries it listed, without sending a load beside the handler's.

Real operator, real API server, two real agents, an http source on loopback that holds its
downloads while told to.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lorafleet.v1 import agent_pb2
from lorafleet_dev.agents import AgentProcess
from lorafleet_dev.synthetic import ADAPTER_WEIGHTS
from tests.agent.helpers import running
from tests.kube.harness import ControlPlane
from tests.operator.agents import Source, add_agent_pod, agent_spec, apply, fleet_manifest, make_adapter, registry, serving, status, stub
from tests.operator.conftest import start_operator, wait_for


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[AgentProcess], Path]]:
    """Two agents, each with a download cache of its own (an http source is fetched by each)."""
    root = tmp_path_factory.mktemp("claims-agents")
    spec, adapters = agent_spec(root)
    processes = [
        AgentProcess(f"agent-{i}", dataclasses.replace(spec, extra_args=("--cache-dir", str(root / f"cache-{i}"))), root / "logs")
        for i in range(2)
    ]
    with serving(processes):
        yield processes, adapters


def loaded_claims(cluster: ControlPlane, ns: str, name: str) -> set[str]:
    """The pods whose status entry says Loaded on every rank."""
    return {
        e["pod"] for e in status(cluster, ns, name).get("agents") or [] if e["state"] == "Loaded" and e["ranksLoaded"] == e["ranksTotal"]
    }


def gated_adapter(source: Source, adapter: Path) -> dict[str, Any]:
    """An adapter from the source's held path on one agent; its digest promised (an agent that holds
    it answers a load again without a download)."""
    digest = hashlib.sha256((adapter / ADAPTER_WEIGHTS).read_bytes()).hexdigest()
    return {
        "apiVersion": "lorafleet.dev/v1alpha1",
        "kind": "LoraAdapter",
        "metadata": {"name": "gated"},
        "spec": {
            "baseModel": "tiny-llama",
            "source": {"uri": source.url("hold/gated"), "sha256": digest},
            "fleetRef": {"name": "default"},
            "replicas": 1,
        },
    }


def test_the_status_stops_saying_loaded_where_the_adapter_was_lost_while_a_slow_load_runs(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    agents: tuple[list[AgentProcess], Path],
    tmp_path: Path,
) -> None:
    """The adapter is Ready on one agent (A). The source then holds its downloads and the
    adapter is scaled to 2 replicas: the update handler's load on the other agent (B) waits on
    the source. Meanwhile A's copy is unloaded behind the operator's back. Within a few drift
    checks (the handler's load still waiting) the status no longer says Loaded on A, and no
    load went to A beside the handler's; once the source answers, both agents hold it."""
    processes, root = agents
    ns = kube_namespace
    # Serves at once while `release` is set; clearing it holds the downloads.
    source = Source(make_adapter(root / ns, "gated", seed=7), failing=False, serve_after_release=True)
    source.release.set()
    by_name = {p.name: p for p in processes}
    op = None
    with running(source):
        try:
            for process in processes:
                add_agent_pod(kube_cluster, ns, process)
            fleet = fleet_manifest()
            fleet["spec"]["sources"] = {"allow": [source.url("")]}
            apply(kube_cluster, ns, fleet)
            op = start_operator(kube_cluster, ns, tmp_path, env={"LORAFLEET_LOAD_DEADLINE_SECONDS": "300"})
            apply(kube_cluster, ns, gated_adapter(source, root / ns / "gated"))
            wait_for(lambda: status(kube_cluster, ns, "gated").get("phase") == "Ready", 90, "gated Ready on one agent", op)
            (holder,) = loaded_claims(kube_cluster, ns, "gated")
            (other,) = set(by_name) - {holder}

            source.release.clear()
            kube_cluster.kubectl("patch", "la", "gated", "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"replicas": 2}}))
            wait_for(lambda: source.holding >= 1, 60, f"the load on {other} waiting on the source", op)
            channel, agent_stub = stub(by_name[holder])
            with channel:
                assert agent_stub.UnloadAdapter(agent_pb2.UnloadAdapterRequest(name=f"{ns}.gated"), timeout=10).success
            assert f"{ns}.gated" not in registry(by_name[holder], ns)

            checks = op.drift_checks()
            wait_for(lambda: op.drift_checks() >= checks + 4, 60, "4 drift checks", op)
            assert source.holding >= 1, "the handler's load ended: the check proves nothing"
            assert holder not in loaded_claims(kube_cluster, ns, "gated"), (
                f"the status still says Loaded on {holder}, which no longer holds the adapter: {status(kube_cluster, ns, 'gated')}"
            )
            assert f"{ns}.gated" not in registry(by_name[holder], ns), "a load went to the agent beside the handler's"
            # The conditions say so too, and the handler's download-progress reports (every 2 s while
            # its load runs) write the corrected conditions, never its older copy saying Ready.
            wait_for(lambda: op.drift_checks() >= checks + 6, 60, "2 more drift checks, progress reports among them", op)
            corrected = status(kube_cluster, ns, "gated")
            ready = next(c for c in corrected["conditions"] if c["type"] == "Ready")
            assert corrected["phase"] != "Ready" and ready["status"] != "True", corrected

            source.release.set()
            wait_for(
                lambda: (
                    loaded_claims(kube_cluster, ns, "gated") == set(by_name) and all(f"{ns}.gated" in registry(p, ns) for p in processes)
                ),
                90,
                "gated held and Loaded on both agents",
                op,
            )
            kube_cluster.kubectl("delete", "la", "--all", "-n", ns, "--wait=true", "--timeout=60s")
        finally:
            source.release.set()
            if op is not None:
                op.stop()
