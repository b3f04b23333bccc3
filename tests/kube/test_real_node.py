"""`helm install` on a real node: real pods, started by a real kubelet through containerd.

The module starts its own control plane listening on the machine's address (pods must reach it),
a real node beside it (lorafleet_dev.node: containerd + runc + CNI bridge, kubelet,
kube-scheduler, kube-proxy; built by scripts/build-node.sh) and loads the operator and agent
images built from the repository's Containerfile (lorafleet_dev.images, cached by content; the
agent's dependency layer by the dependency set). The chart then runs everything as real pods:
the operator (Deployment -> ReplicaSet -> scheduler -> kubelet -> container, talking to the API
server through the ``kubernetes`` Service with its ServiceAccount token), two agents
(StatefulSet, on the CPU, a tiny synthetic model and adapter from hostPath volumes, Ready through
their gRPC probes) and the uninstall hook Job. One install serves every step, in the order a
user meets them: install, an adapter, an agent pod replaced, Generate through the agents'
Service, upgrade, uninstall. (``helm test`` is not run here: its pod finds the agents through
cluster DNS, which this node has none of.)

A machine where the node cannot start (not root, no overlayfs, binaries not built) fails this
module with the reason; it never skips.
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from lorafleet.v1 import agent_pb2, agent_pb2_grpc
from lorafleet_dev.images import BuiltImage, ImageBuilder
from lorafleet_dev.node import RealNode, check_machine, find_node_bin_dir, machine_ip
from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from tests.kube.harness import CHECKOUT, ControlPlane, HarnessError

RELEASE = "lf"
FULLNAME = f"{RELEASE}-lorafleet"
BASE_MODEL = "tiny-llama"
SHAPE = SyntheticModel()
#: Where the chart mounts the adapter volume in the agents (agent.adapterRoot's default).
ADAPTER_ROOT = "/var/lib/lorafleet/adapters"
GRPC_PORT = 50051
PROMPT = [1, 5, 9, 17]
#: The agents on a 2-core machine: small requests so both fit beside the operator, one torch
#: thread each, small shared-memory and scratch volumes.
AGENT_VALUES = {
    "agent.device": "cpu", "agent.gpus": 0, "agent.replicas": 2,
    "agent.resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "4Gi"}},
    "agent.extraArgs": ["--cpu-threads=1"],
    "agent.shmSize": "256Mi", "agent.tmpSizeLimit": "1Gi", "agent.cacheSizeLimit": "1Gi",
}


@dataclass(frozen=True)
class RealCluster:
    """The module's control plane, its real node, the images loaded there and the host
    directory (world-readable: the pods run as 65532) holding the model and the adapter."""

    cluster: ControlPlane
    node: RealNode
    operator: BuiltImage
    agent: BuiltImage
    data: Path


@pytest.fixture(scope="module")
def real_cluster(kube_bin_dir: Path) -> Iterator[RealCluster]:
    try:
        check_machine()
        node_bin_dir = find_node_bin_dir(CHECKOUT)
        builder = ImageBuilder(CHECKOUT)
        operator, agent = builder.operator_image(), builder.agent_image()
        ip = machine_ip()
    except HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    data = Path(tempfile.mkdtemp(prefix="lorafleet-real-node-data-", dir="/var/tmp"))
    try:
        write_model(data / "model", SHAPE)
        write_adapter(data / "adapters" / "support", SHAPE, rank=4)
        for path in [data, *data.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        with ControlPlane.start(kube_bin_dir, node_ip=ip) as cluster:
            node = RealNode.start(cluster, node_bin_dir)
            try:
                node.import_image(operator.archive)
                node.import_image(agent.archive)
                yield RealCluster(cluster, node, operator, agent, data)
            finally:
                left = node.stop()
            # A clean shutdown: no process, mount (snapshot, netns, volume), bridge, cgroup,
            # iptables chain or changed kernel setting of the node stays on the machine.
            assert left == []
    finally:
        shutil.rmtree(data, ignore_errors=True)


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


def stub(address: str) -> tuple[grpc.Channel, agent_pb2_grpc.NodeAgentStub]:
    channel = grpc.insecure_channel(address)
    return channel, agent_pb2_grpc.NodeAgentStub(channel)


def registry(address: str, token: str) -> dict[str, list[int]]:
    """What the agent at ``address`` itself holds (name -> ranks): the truth the status reports."""
    channel, agent = stub(address)
    with channel:
        reply = agent.ListAdapters(agent_pb2.ListAdaptersRequest(), timeout=10,
                                   metadata=(("authorization", f"Bearer {token}"),))
    return {a.name: list(a.ranks) for a in reply.adapters}


def generate(address: str, token: str, adapter: str) -> list[int]:
    """Greedy tokens for :data:`PROMPT` from the agent (or Service) at ``address``."""
    channel, agent = stub(address)
    with channel:
        replies = agent.Generate(
            agent_pb2.GenerateRequest(token_ids=PROMPT, adapter=adapter, max_new_tokens=6),
            timeout=60, metadata=(("authorization", f"Bearer {token}"),))
        return [r.token_id for r in replies]


def pods(cluster: ControlPlane, ns: str, name: str) -> list[dict[str, Any]]:
    """The pods labelled ``app.kubernetes.io/name=<name>`` (lorafleet-operator, lorafleet-agent)."""
    found = cluster.kubectl_json("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/name={name}")["items"]
    return list(found)


def ready(pod: dict[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return bool(statuses) and all(s["ready"] and "running" in s["state"] for s in statuses) \
        and pod["metadata"].get("deletionTimestamp") is None


def probe_results(node: RealNode, ns: str, container: str, probe_type: str) -> dict[str, float]:
    """The kubelet's probe counts for the ``container`` containers of ``ns``, by result."""
    counts: dict[str, float] = {}
    for line in node.kubelet_metrics().splitlines():
        if line.startswith("prober_probe_total{") and f'namespace="{ns}"' in line \
                and f'probe_type="{probe_type}"' in line and f'container="{container}"' in line:
            result = line.split('result="', 1)[1].split('"', 1)[0]
            counts[result] = counts.get(result, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def install_args(real: RealCluster) -> list[str]:
    """``helm install`` flags: the locally built images (never pulled: there is no registry),
    the model and the adapters from hostPath volumes, agents sized for this machine."""
    op_repo, op_tag = real.operator.name.rsplit(":", 1)
    agent_repo, agent_tag = real.agent.name.rsplit(":", 1)
    values: dict[str, Any] = {
        "image.operator.repository": op_repo, "image.operator.tag": op_tag,
        "image.agent.repository": agent_repo, "image.agent.tag": agent_tag,
        "image.pullPolicy": "Never",
        "agent.baseModel": BASE_MODEL,
        "agent.model.hostPath.path": str(real.data / "model"),
        "agent.adapterVolume": {"hostPath": {"path": str(real.data / "adapters"), "type": "Directory"}},
        **AGENT_VALUES,
    }
    return [arg for key, value in values.items() for arg in ("--set-json", f"{key}={json.dumps(value)}")]


# pytest-timeout counts the module fixture's set-up and tear-down too: on a cold cache that builds
# both images (about 10 minutes on 2 cores: pip downloads and installs 3.4 GB of torch and CUDA
# wheels), imports them (about a minute) and deletes the node's 6 GB of snapshots. The bound
# only catches a hang; every wait inside has its own deadline.
@pytest.mark.timeout(3600)
def test_helm_install_upgrade_uninstall_on_a_real_node(real_cluster: RealCluster) -> None:
    cluster, node = real_cluster.cluster, real_cluster.node
    ns = cluster.create_namespace(prefix="real")

    def diagnose() -> str:
        listing = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        events = cluster.kubectl("get", "events", "-n", ns, check=False).stdout
        logs = ""
        for name in ("lorafleet-operator", "lorafleet-agent"):
            out = cluster.kubectl("logs", "-n", ns, "-l", f"app.kubernetes.io/name={name}", "--tail=30",
                                  "--all-containers", "--prefix", check=False)
            logs += f"{name} log:\n{out.stdout or out.stderr}\n"
        return f"pods:\n{listing}\nevents:\n{events[-4000:]}\n{logs}kubelet:\n{node.logs('kubelet', 20)}"

    try:
        install = cluster.helm("install", RELEASE, str(CHECKOUT.chart), "--namespace", ns,
                               *install_args(real_cluster), "--wait", "--timeout=400s",
                               check=False, timeout_s=460)
        assert install.returncode == 0, f"{install.stderr}\n{diagnose()}"

        # Every pod is real: scheduled onto the node, its containers run by containerd, Ready
        # through the kubelet's own probes (the agents' gRPC health probes, counted in its metrics).
        (operator,) = pods(cluster, ns, "lorafleet-operator")
        agents = sorted(pods(cluster, ns, "lorafleet-agent"), key=lambda p: p["metadata"]["name"])
        assert [p["metadata"]["name"] for p in agents] == [f"{FULLNAME}-agent-0", f"{FULLNAME}-agent-1"]
        for pod in [operator, *agents]:
            assert pod["spec"]["nodeName"] == node.name
            assert pod["status"]["podIP"].startswith("10.89."), pod["status"]
            assert ready(pod), pod["status"]
            for container in pod["status"]["containerStatuses"]:
                assert container["containerID"].removeprefix("containerd://") in node.running_containers()
        for probe in ("Startup", "Readiness"):
            assert probe_results(node, ns, "agent", probe).get("successful", 0) >= 2, probe

        token = base64.b64decode(cluster.kubectl_json(
            "get", "secret", f"{FULLNAME}-agent-token", "-n", ns)["data"]["token"]).decode()
        # The token is required (auth on by default): a call without it is refused.
        channel, anonymous = stub(f"{agents[0]['status']['podIP']}:{GRPC_PORT}")
        with channel, pytest.raises(grpc.RpcError) as refused:
            anonymous.ListAdapters(agent_pb2.ListAdaptersRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # A LoraAdapter applied with kubectl: Ready, and its per-agent, per-rank status equals
        # what each agent pod's registry holds.
        cluster.apply(json.dumps({
            "apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraAdapter",
            "metadata": {"name": "support"},
            "spec": {"baseModel": BASE_MODEL, "source": {"uri": f"file://{ADAPTER_ROOT}/support"},
                     "fleetRef": {"name": "default"}}}), ns)
        held = f"{ns}.support"

        def adapter_status() -> dict[str, Any]:
            obj = cluster.kubectl_json("get", "la", "support", "-n", ns)
            return dict(obj.get("status") or {})

        def loaded_everywhere() -> dict[str, Any]:
            st = adapter_status()
            pods_now = {p["metadata"]["name"]: p for p in pods(cluster, ns, "lorafleet-agent") if ready(p)}
            entries = {a["pod"]: a for a in st.get("agents", [])}
            if st.get("phase") != "Ready" or set(entries) != set(pods_now) or len(pods_now) != 2:
                return {}
            return st

        st = wait_for("LoraAdapter support Ready on both agents", loaded_everywhere, 180, diagnose)
        assert st["agentsSummary"] == "2/2" and st["ranksSummary"] == "2/2", st
        for pod in agents:
            entry = next(a for a in st["agents"] if a["pod"] == pod["metadata"]["name"])
            assert (entry["state"], entry["ranksLoaded"], entry["ranksTotal"]) == ("Loaded", 1, 1), entry
            assert registry(f"{pod['status']['podIP']}:{GRPC_PORT}", token) == {held: [0]}

        # An agent pod deleted: the StatefulSet makes a new one (same name, new uid), which
        # starts empty; the operator's drift check loads the adapter onto it again.
        victim = agents[0]
        cluster.kubectl("delete", "pod", victim["metadata"]["name"], "-n", ns, "--wait=true")

        def replacement() -> dict[str, Any]:
            for pod in pods(cluster, ns, "lorafleet-agent"):
                if pod["metadata"]["name"] == victim["metadata"]["name"] and ready(pod) \
                        and pod["metadata"]["uid"] != victim["metadata"]["uid"]:
                    return pod
            return {}

        new_agent = wait_for("the StatefulSet's new agent pod Ready", replacement, 300, diagnose)
        new_address = f"{new_agent['status']['podIP']}:{GRPC_PORT}"
        wait_for("the adapter back on the new agent pod", lambda: registry(new_address, token) == {held: [0]},
                 180, diagnose)
        st = wait_for("LoraAdapter support Ready on both agents again", loaded_everywhere, 120, diagnose)
        assert st["ranksSummary"] == "2/2", st

        # Generate through the agents' client Service, its ClusterIP reached from this machine
        # through kube-proxy's rules (no kubectl exec, no port-forward): the same greedy tokens
        # as each agent pod gives when asked directly.
        service = cluster.kubectl_json("get", "service", f"{FULLNAME}-agent-api", "-n", ns)
        cluster_ip = service["spec"]["clusterIP"]
        assert cluster_ip.startswith("10.96."), service["spec"]
        addresses = [f"{p['status']['podIP']}:{GRPC_PORT}" for p in pods(cluster, ns, "lorafleet-agent")]
        for adapter in (held, ""):
            direct = [generate(address, token, adapter) for address in addresses]
            assert direct[0] and direct[0] == direct[1], direct
            assert generate(f"{cluster_ip}:{GRPC_PORT}", token, adapter) == direct[0]

        # helm upgrade changes a value; the Deployment rolls out a new operator pod.
        old_pod = operator["metadata"]["name"]
        upgrade = cluster.helm(
            "upgrade", RELEASE, str(CHECKOUT.chart), "--namespace", ns, "--reuse-values",
            "--set", "operator.logLevel=DEBUG", "--wait", "--timeout=180s",
            check=False, timeout_s=240)
        assert upgrade.returncode == 0, f"{upgrade.stderr}\n{diagnose()}"
        cluster.kubectl("rollout", "status", f"deployment/{FULLNAME}-operator", "-n", ns,
                        "--timeout=120s")

        def replaced() -> list[dict[str, Any]]:
            found = pods(cluster, ns, "lorafleet-operator")
            return found if len(found) == 1 and found[0]["metadata"]["name"] != old_pod else []

        (new_pod,) = wait_for("one operator pod, not the old one", replaced, 120, diagnose)
        env = {e["name"]: e.get("value") for e in new_pod["spec"]["containers"][0]["env"]}
        assert env["LORAFLEET_LOG_LEVEL"] == "DEBUG"
        assert new_pod["status"]["containerStatuses"][0]["ready"], new_pod["status"]
        assert adapter_status()["phase"] == "Ready"
        # The chart's liveness probe, run by the kubelet itself, passes (successes counted in
        # its probe metrics) and never restarted the operator. A failure or two while it starts
        # on a loaded machine is tolerated, as by the probe's own failureThreshold.
        wait_for("a successful liveness probe of the operator",
                 lambda: probe_results(node, ns, "operator", "Liveness").get("successful", 0) >= 1,
                 90, diagnose)
        (restarted,) = pods(cluster, ns, "lorafleet-operator")
        assert restarted["status"]["containerStatuses"][0]["restartCount"] == 0

        # helm uninstall: the pre-delete hook Job (a real pod, in-cluster through the kubernetes
        # Service) has the operator unload everything; nothing is left, nothing is stuck.
        uninstall = cluster.helm("uninstall", RELEASE, "--namespace", ns, "--wait",
                                 "--timeout=240s", check=False, timeout_s=300)
        assert uninstall.returncode == 0, f"{uninstall.stderr}\n{diagnose()}"
        for kind in ("loraadapters", "lorafleets", "deployments", "statefulsets", "services", "jobs",
                     "secrets", "poddisruptionbudgets", "roles", "rolebindings"):
            left = cluster.kubectl_json("get", kind, "-n", ns)["items"]
            assert [i["metadata"]["name"] for i in left] == [], f"{kind} left: {left}"
        left_sas = {i["metadata"]["name"] for i in cluster.kubectl_json("get", "serviceaccounts", "-n", ns)["items"]}
        assert left_sas == {"default"}
        wait_for("every pod of the release gone",
                 lambda: not cluster.kubectl_json("get", "pods", "-n", ns)["items"], 180, diagnose)
        # The hook ran as a real pod on the node (helm deleted its Job once it succeeded).
        started = cluster.kubectl_json("get", "events", "-n", ns,
                                       "--field-selector=involvedObject.kind=Pod,reason=Started")
        hook_pods = {e["involvedObject"]["name"] for e in started["items"]
                     if e["involvedObject"]["name"].startswith(f"{FULLNAME}-uninstall-")}
        assert len(hook_pods) == 1, started["items"]
        wait_for("containerd to run no container", lambda: node.running_containers() == [], 60, diagnose)
    finally:
        cluster.delete_namespace(ns)
