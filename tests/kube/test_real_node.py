"""`helm install` on a real node: real pods, started by a real kubelet through containerd.

The module starts its own control plane listening on the machine's address (pods must reach it),
a real node beside it (lorafleet_dev.node: containerd + runc + CNI bridge, kubelet,
kube-scheduler, kube-proxy; built by scripts/build-node.sh) and loads the operator image built
from the repository's Containerfile (lorafleet_dev.images, cached by content). The chart's
operator then runs as a real pod: Deployment -> ReplicaSet -> scheduler -> kubelet -> container,
talking to the API server through the ``kubernetes`` Service (kube-proxy) with its
ServiceAccount token, and the uninstall hook Job runs as a real pod too.

The node agents are not real pods here: their image needs torch, whose only build on the package
index this machine reaches is the multi-gigabyte CUDA one (docs/kube-test-harness.md, "A real
node"). They run as local processes on the machine's address, described by stand-in Pods
(``agent.enabled=false``), so the operator pod reaches them over the pod network.

A machine where the node cannot start (not root, no overlayfs, binaries not built) fails this
module with the reason; it never skips.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from lorafleet.v1 import agent_pb2, agent_pb2_grpc
from lorafleet_dev.agents import AgentProcess, AgentSpec, start_agents
from lorafleet_dev.images import BuiltImage, ImageBuilder
from lorafleet_dev.node import RealNode, check_machine, find_node_bin_dir, machine_ip
from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from tests.kube.harness import CHECKOUT, ControlPlane, HarnessError

RELEASE = "lf"
BASE_MODEL = "tiny-llama"
SHAPE = SyntheticModel()


@dataclass(frozen=True)
class RealCluster:
    """The module's control plane, its real node and the operator image loaded there."""

    cluster: ControlPlane
    node: RealNode
    image: BuiltImage


@pytest.fixture(scope="module")
def real_cluster(kube_bin_dir: Path) -> Iterator[RealCluster]:
    try:
        check_machine()
        node_bin_dir = find_node_bin_dir(CHECKOUT)
        image = ImageBuilder(CHECKOUT).operator_image()
        ip = machine_ip()
    except HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    with ControlPlane.start(kube_bin_dir, node_ip=ip) as cluster:
        node = RealNode.start(cluster, node_bin_dir)
        try:
            node.import_image(image.archive)
            yield RealCluster(cluster, node, image)
        finally:
            left = node.stop()
        # A clean shutdown: no process, mount (snapshot, netns, volume), bridge, cgroup,
        # iptables chain or changed kernel setting of the node stays on the machine.
        assert left == []


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float, diagnose: Callable[[], str]) -> Any:
    """Poll ``probe`` until it returns something truthy; fail with ``diagnose()`` otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{diagnose()}")
        time.sleep(0.5)


def registry(agent: AgentProcess) -> dict[str, list[int]]:
    """What the agent itself holds (name -> ranks): the truth the operator's status reports."""
    token = agent.spec.extra_args[agent.spec.extra_args.index("--auth-token-file") + 1]
    metadata = (("authorization", f"Bearer {Path(token).read_text().strip()}"),)
    with grpc.insecure_channel(agent.endpoint) as channel:
        reply = agent_pb2_grpc.NodeAgentStub(channel).ListAdapters(
            agent_pb2.ListAdaptersRequest(), timeout=10, metadata=metadata)
    return {a.name: list(a.ranks) for a in reply.adapters}


def operator_pods(cluster: ControlPlane, ns: str) -> list[dict[str, Any]]:
    pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l",
                                "app.kubernetes.io/name=lorafleet-operator")["items"]
    return list(pods)


def probe_results(node: RealNode, ns: str, probe_type: str) -> dict[str, float]:
    """The kubelet's probe counts for the operator containers of ``ns``, by result."""
    counts: dict[str, float] = {}
    for line in node.kubelet_metrics().splitlines():
        if line.startswith("prober_probe_total{") and f'namespace="{ns}"' in line \
                and f'probe_type="{probe_type}"' in line and 'container="operator"' in line:
            result = line.split('result="', 1)[1].split('"', 1)[0]
            counts[result] = counts.get(result, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_helm_install_upgrade_uninstall_on_a_real_node(
    real_cluster: RealCluster, tmp_path: Path
) -> None:
    cluster, node, image = real_cluster.cluster, real_cluster.node, real_cluster.image
    ns = cluster.create_namespace(prefix="real")
    repository, tag = image.name.rsplit(":", 1)

    def diagnose() -> str:
        pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        events = cluster.kubectl("get", "events", "-n", ns, check=False).stdout
        op_log = cluster.kubectl("logs", "-n", ns, "-l", "app.kubernetes.io/name=lorafleet-operator",
                                 "--tail=40", check=False)
        return (f"pods:\n{pods}\nevents:\n{events[-3000:]}\noperator log:\n"
                f"{op_log.stdout or op_log.stderr}\nkubelet:\n{node.logs('kubelet', 20)}")

    install = cluster.helm(
        "install", RELEASE, str(CHECKOUT.chart), "--namespace", ns,
        "--set", f"image.operator.repository={repository}", "--set", f"image.operator.tag={tag}",
        # There is no registry: the image is in containerd already, and must not be pulled.
        "--set", "image.pullPolicy=Never",
        "--set", "agent.enabled=false",
        "--wait", "--timeout=180s", check=False, timeout_s=240)
    assert install.returncode == 0, f"{install.stderr}\n{diagnose()}"

    # The operator is a real pod: scheduled onto the node, its container run by containerd.
    (pod,) = operator_pods(cluster, ns)
    assert pod["spec"]["nodeName"] == node.name
    assert pod["status"]["podIP"].startswith("10.89."), pod["status"]
    (container,) = pod["status"]["containerStatuses"]
    assert container["ready"] and "running" in container["state"], container
    assert container["containerID"].removeprefix("containerd://") in node.running_containers()

    # Two agents (local processes on the machine's address) with the chart's generated token.
    secret = cluster.kubectl_json("get", "secret", f"{RELEASE}-lorafleet-agent-token", "-n", ns)
    token_file = tmp_path / "token"
    token_file.write_bytes(base64.b64decode(secret["data"]["token"]))
    model = write_model(tmp_path / "model", SHAPE)
    adapters = tmp_path / "adapters"
    adapter = write_adapter(adapters / "support", SHAPE, rank=4)
    spec = AgentSpec(model_dir=model, adapter_roots=(adapters,), base_model_name=BASE_MODEL,
                     tp=1, dp=1, host=node.ip,
                     extra_args=("--auth-token-file", str(token_file)))
    agents = start_agents(["agent-0", "agent-1"], spec, tmp_path / "logs")
    try:
        for agent in agents:
            cluster.create_agent_pod(ns, agent.name, agent.port, ip=node.ip,
                                     labels={"app.kubernetes.io/instance": RELEASE})
        cluster.apply(json.dumps({
            "apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraAdapter",
            "metadata": {"name": "support"},
            "spec": {"baseModel": BASE_MODEL, "source": {"uri": f"file://{adapter}"},
                     "fleetRef": {"name": "default"}}}), ns)

        def adapter_status() -> dict[str, Any]:
            obj = cluster.kubectl_json("get", "la", "support", "-n", ns)
            return dict(obj.get("status") or {})

        st = wait_for("LoraAdapter support Ready", lambda: adapter_status().get("phase") == "Ready"
                      and adapter_status(), 120, diagnose)
        assert st["agentsSummary"] == "2/2", st
        for agent in agents:
            assert registry(agent) == {f"{ns}.support": [0]}

        # helm upgrade changes a value; the Deployment rolls out a new operator pod.
        old_pod = pod["metadata"]["name"]
        upgrade = cluster.helm(
            "upgrade", RELEASE, str(CHECKOUT.chart), "--namespace", ns, "--reuse-values",
            "--set", "operator.logLevel=DEBUG", "--wait", "--timeout=180s",
            check=False, timeout_s=240)
        assert upgrade.returncode == 0, f"{upgrade.stderr}\n{diagnose()}"
        cluster.kubectl("rollout", "status", f"deployment/{RELEASE}-lorafleet-operator", "-n", ns,
                        "--timeout=120s")
        def replaced() -> list[dict[str, Any]]:
            pods = operator_pods(cluster, ns)
            return pods if len(pods) == 1 and pods[0]["metadata"]["name"] != old_pod else []

        (new_pod,) = wait_for("one operator pod, not the old one", replaced, 120, diagnose)
        env = {e["name"]: e.get("value") for e in new_pod["spec"]["containers"][0]["env"]}
        assert env["LORAFLEET_LOG_LEVEL"] == "DEBUG"
        assert new_pod["status"]["containerStatuses"][0]["ready"], new_pod["status"]
        assert adapter_status()["phase"] == "Ready"
        # The chart's liveness probe, run by the kubelet itself, passes (successes counted in
        # its probe metrics) and never restarted the operator. A failure or two while it starts
        # on a loaded machine is tolerated, as by the probe's own failureThreshold.
        wait_for("a successful liveness probe of the operator",
                 lambda: probe_results(node, ns, "Liveness").get("successful", 0) >= 1,
                 90, diagnose)
        (restarted,) = operator_pods(cluster, ns)
        assert restarted["status"]["containerStatuses"][0]["restartCount"] == 0

        # helm uninstall: the pre-delete hook Job (a real pod, in-cluster through the kubernetes
        # Service) has the operator unload everything; nothing is left, nothing is stuck.
        uninstall = cluster.helm("uninstall", RELEASE, "--namespace", ns, "--wait",
                                 "--timeout=240s", check=False, timeout_s=300)
        assert uninstall.returncode == 0, f"{uninstall.stderr}\n{diagnose()}"
        for kind in ("loraadapters", "lorafleets", "deployments", "jobs", "secrets"):
            left = cluster.kubectl_json("get", kind, "-n", ns)["items"]
            assert [i["metadata"]["name"] for i in left] == [], f"{kind} left: {left}"
        for agent in agents:
            assert registry(agent) == {}
        wait_for("the operator and hook pods gone", lambda: not operator_pods(cluster, ns) and not [
            p for p in cluster.kubectl_json("get", "pods", "-n", ns)["items"]
            if p["spec"].get("nodeName") == node.name], 120, diagnose)
        stand_ins = {p["metadata"]["name"] for p in cluster.kubectl_json("get", "pods", "-n", ns)["items"]}
        assert stand_ins == {"agent-0", "agent-1"}
        # The hook ran as a real pod on the node (helm deleted its Job once it succeeded).
        started = cluster.kubectl_json("get", "events", "-n", ns,
                                       "--field-selector=involvedObject.kind=Pod,reason=Started")
        hook_pods = {e["involvedObject"]["name"] for e in started["items"]
                     if e["involvedObject"]["name"].startswith(f"{RELEASE}-lorafleet-uninstall-")}
        assert len(hook_pods) == 1, started["items"]
        wait_for("containerd to run no container", lambda: node.running_containers() == [], 60, diagnose)
    finally:
        for agent in agents:
            agent.stop()
        cluster.delete_namespace(ns)
