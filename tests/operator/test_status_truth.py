"""The status never claims what the agents do not hold for longer than a drift interval
(docs/operator.md, "Status semantics"): one tenant's adapters fill every slot of two real
agents while more are applied and deleted, and a monitor compares, over and over, each
adapter's ``status.agents[]`` entries that say ``Loaded`` with what each agent's
``ListAdapters`` reports. A disagreement may last while a status write catches up with an
unload or a load, never beyond a few drift intervals.

Real operator, real API server, two real agents holding at most 4 adapters each.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lorafleet_dev.agents import AgentProcess
from tests.kube.harness import ControlPlane
from tests.operator.agents import (
    adapter_manifest,
    add_agent_pod,
    agent_pair,
    apply,
    fleet_manifest,
    make_adapter,
    registry,
)
from tests.operator.conftest import start_operator, wait_for

DRIFT_INTERVAL_S = 2.0
#: How long a status may claim an adapter an agent does not hold, in drift intervals: the one
#: interval the promise gives, and as many again for a slow check on a busy machine.
BOUND_INTERVALS = 4
CAPACITY = 4


@pytest.fixture(scope="module")
def full_agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[AgentProcess], Path]]:
    """Two agents that hold at most 4 adapters each."""
    with agent_pair(tmp_path_factory.mktemp("truth-agents"), max_loaded_loras=CAPACITY) as pair:
        yield pair


def manifest(root: Path, name: str, seed: int, rng: random.Random) -> dict[str, Any]:
    """An adapter on every agent with room, or on one or two of them."""
    body = adapter_manifest(name, make_adapter(root, name, seed=seed))
    replicas = rng.choice((None, 1, 2))
    return body if replicas is None else {**body, "spec": {**body["spec"], "replicas": replicas}}


@dataclass
class Monitor:
    """Compares the adapters' statuses with the agents' registries until stopped; keeps,
    per (adapter, pod), when the current disagreement began, and the longest one seen."""

    cluster: ControlPlane
    namespace: str
    agents: dict[str, AgentProcess]
    since: dict[tuple[str, str], float] = field(default_factory=dict)
    longest: tuple[float, str] = (0.0, "")
    episodes: int = 0
    rounds: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def claims(self) -> set[tuple[str, str, int]]:
        """(adapter, pod, ranks) of every status entry that says Loaded on every rank."""
        code, body = self.cluster.request("GET", f"/apis/lorafleet.dev/v1alpha1/namespaces/{self.namespace}/loraadapters")
        assert code == 200, body
        return {
            (item["metadata"]["name"], entry["pod"], entry["ranksTotal"])
            for item in body["items"]
            if not item["metadata"].get("deletionTimestamp")
            for entry in (item.get("status") or {}).get("agents") or []
            if entry["state"] == "Loaded" and entry["ranksLoaded"] == entry["ranksTotal"]
        }

    def look(self) -> None:
        claims = self.claims()
        held = {pod: registry(agent, self.namespace) for pod, agent in self.agents.items()}
        now = time.monotonic()
        false = {(name, pod) for name, pod, ranks in claims if len(held.get(pod, {}).get(f"{self.namespace}.{name}", ())) < ranks}
        for key in false - self.since.keys():
            self.since[key] = now
            self.episodes += 1
        for key in self.since.keys() - false:
            self.end(key, now)
        self.rounds += 1

    def end(self, key: tuple[str, str], now: float) -> None:
        lasted = now - self.since.pop(key)
        if lasted > self.longest[0]:
            self.longest = (lasted, f"{key[0]} on {key[1]}")

    def run(self) -> None:
        while not self.stop.is_set():
            self.look()
            time.sleep(0.1)
        now = time.monotonic()
        for key in list(self.since):
            self.end(key, now)


def test_the_status_never_claims_for_long_what_the_agents_do_not_hold_while_one_tenant_fills_every_slot(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    full_agents: tuple[list[AgentProcess], Path],
    tmp_path: Path,
) -> None:
    """Every slot full (each adapter wants both agents; twice as many adapters as fit), then
    churn: one adapter deleted and one applied at a time. The monitor's longest disagreement
    between a `Loaded` entry and the agent's registry stays within a few drift intervals."""
    agents, root = full_agents
    ns = kube_namespace
    for agent in agents:
        add_agent_pod(kube_cluster, ns, agent)
    apply(kube_cluster, ns, fleet_manifest())
    op = start_operator(kube_cluster, ns, tmp_path, env={"LORAFLEET_DRIFT_INTERVAL_SECONDS": str(DRIFT_INTERVAL_S)})
    monitor = Monitor(kube_cluster, ns, {a.name: a for a in agents})
    watcher = threading.Thread(target=monitor.run, daemon=True)
    try:
        rng = random.Random(5)
        live = [f"a{i:03d}" for i in range(2 * CAPACITY)]
        apply(kube_cluster, ns, *(manifest(root / ns, n, i, rng) for i, n in enumerate(live)))
        wait_for(lambda: all(len(registry(a, ns)) == CAPACITY for a in agents), 120, "every slot full", op)
        watcher.start()
        for i in range(len(live), len(live) + 60):
            gone = live.pop(rng.randrange(len(live)))
            kube_cluster.kubectl("delete", "la", gone, "-n", ns, "--wait=false")
            name = f"a{i:03d}"
            apply(kube_cluster, ns, manifest(root / ns, name, i, rng))
            live.append(name)
        # Settle for a few intervals, so that what the churn left is watched too.
        time.sleep(3 * DRIFT_INTERVAL_S)
    finally:
        monitor.stop.set()
        if watcher.is_alive():
            watcher.join(30)
        kube_cluster.kubectl("delete", "la", "--all", "-n", ns, "--wait=true", "--timeout=120s")
        op.stop()
    lasted, what = monitor.longest
    assert monitor.rounds > 20, "the monitor hardly looked"
    assert lasted <= BOUND_INTERVALS * DRIFT_INTERVAL_S, (
        f"{what}: the status said Loaded for {lasted:.1f}s ({lasted / DRIFT_INTERVAL_S:.1f} drift intervals) while the agent "
        f"did not hold it; {monitor.episodes} disagreements in {monitor.rounds} looks"
    )
