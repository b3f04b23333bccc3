"""One adapter's failure during a drift check is that adapter's alone: on the real control plane,
with a real agent and the real operator.

A validating webhook that nobody serves makes the API server fail (500) every status write of
one LoraAdapter (``poisoned``), as a struggling admission chain would. The drift check logs that
adapter's failure and goes on: the fleet's other adapter, unloaded from the agent by hand, is put
back; the fleet's status is written; no drift check fails, so none backs off (a failed check
once made the whole fleet wait out the API back-off, and the status of every adapter went stale).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lorafleet.v1 import agent_pb2
from lorafleet_dev.agents import AgentProcess
from tests.kube.harness import ControlPlane
from tests.operator.agents import adapter_manifest, add_agent_pod, agent_spec, apply, fleet_manifest, make_adapter, registry, serving, stub
from tests.operator.conftest import OperatorProcess, start_operator, wait_for

POISONED = "poisoned"
POISON_LABEL = "lorafleet-test/poisoned"


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AgentProcess, Path]]:
    """One agent (tp=1) with room for two adapters, and where its adapters are written."""
    root = tmp_path_factory.mktemp("alone-agent")
    spec, adapters = agent_spec(root, tp=1, dp=1, max_loaded_loras=2, extra_args=("--cache-dir", str(root / "cache")))
    process = AgentProcess("alone-agent", spec, root / "logs")
    with serving([process]):
        yield process, adapters


@contextmanager
def fail_status_writes(cluster: ControlPlane, ns: str) -> Iterator[None]:
    """A validating webhook that nobody serves, for status writes of LoraAdapters labelled
    ``lorafleet-test/poisoned`` in ``ns``: the API server answers them 500 ("failed calling
    webhook"), an error the operator cannot settle by giving up the write, as a struggling
    API server or admission chain would."""
    name = f"lorafleet-test-fail-{ns}"
    webhook = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "fail.lorafleet-test.dev",
                "clientConfig": {"url": "https://127.0.0.1:9/never"},
                "rules": [
                    {
                        "apiGroups": ["lorafleet.dev"],
                        "apiVersions": ["*"],
                        "operations": ["UPDATE"],
                        "resources": ["loraadapters/status"],
                    }
                ],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "objectSelector": {"matchLabels": {POISON_LABEL: "true"}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 2,
            }
        ],
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(webhook))
    try:
        yield
    finally:
        cluster.kubectl("delete", "validatingwebhookconfiguration", name, "--ignore-not-found")


def status_write_fails(cluster: ControlPlane, ns: str) -> bool:
    """Whether the webhook is in force: a status write of the poisoned adapter fails."""
    patch = json.dumps({"status": {"observedGeneration": 0}})
    done = cluster.kubectl(
        "patch", "la", POISONED, "-n", ns, "--subresource=status", "--type=merge", "-p", patch, "--dry-run=server", check=False
    )
    return done.returncode != 0 and "failed calling webhook" in done.stderr


def test_a_drift_check_goes_on_past_one_adapters_failed_status_write(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    agent: tuple[AgentProcess, Path],
    tmp_path: Path,
) -> None:
    ns = kube_namespace
    process, adapters = agent
    add_agent_pod(kube_cluster, ns, process)
    apply(kube_cluster, ns, fleet_manifest())
    # A failed drift check would back off up to a minute: long enough to be seen.
    operator: OperatorProcess = start_operator(kube_cluster, ns, tmp_path, env={"LORAFLEET_TRANSIENT_RETRY_MAX_SECONDS": "60"})
    try:
        poisoned = adapter_manifest(POISONED, make_adapter(adapters / ns, POISONED))
        poisoned["metadata"].setdefault("labels", {})[POISON_LABEL] = "true"
        apply(kube_cluster, ns, adapter_manifest("healthy", make_adapter(adapters / ns, "healthy")), poisoned)
        wait_for(lambda: set(registry(process, ns)) == {f"{ns}.healthy", f"{ns}.{POISONED}"}, 90, "both loaded", operator)
        with fail_status_writes(kube_cluster, ns):
            wait_for(lambda: status_write_fails(kube_cluster, ns), 30, "the webhook in force", operator)
            # A new generation needs a new status, which the API server now fails to write.
            kube_cluster.kubectl("patch", "la", POISONED, "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"replicas": 1}}))
            checks = operator.drift_checks()
            channel, agent_stub = stub(process)
            with channel:
                reply = agent_stub.UnloadAdapter(agent_pb2.UnloadAdapterRequest(name=f"{ns}.healthy"), timeout=10)
            assert reply.success, reply.error_message
            wait_for(lambda: f"{ns}.healthy" in registry(process, ns), 60, "healthy put back by the drift check", operator)
            wait_for(lambda: operator.drift_checks() >= checks + 5, 60, "drift checks going on", operator)
        log = operator.log()
        failed = [line for line in log.splitlines() if "drift check of lorafleet" in line and " failed" in line]
        assert not failed, failed[:3]
        assert f"drift: repair of {ns}/{POISONED} failed" in log
    finally:
        operator.stop()
