"""`helm install` on a real node: real pods, started by a real kubelet through containerd.

The module starts its own control plane listening on the machine's address (pods must reach it),
a real node beside it (lorafleet_dev.node: containerd + runc + CNI bridge, kubelet,
kube-scheduler, kube-proxy, CoreDNS as the cluster's DNS; built by scripts/build-node.sh) and
loads the operator and agent
images built from the repository's Containerfile (lorafleet_dev.images, cached by content; the
agent's dependency layer by the dependency set) into the node's image store, which keeps them
between runs (an unchanged image is not imported again). The chart then runs everything as real pods:
the operator (Deployment -> ReplicaSet -> scheduler -> kubelet -> container, talking to the API
server through the ``kubernetes`` Service with its ServiceAccount token), two agents
(StatefulSet, on the CPU, a tiny synthetic model from a PersistentVolumeClaim — a hostPath
PersistentVolume bound by the controller manager's binder — and adapters from a hostPath volume,
Ready through their gRPC probes) and the uninstall hook Job. One install serves every step, in the order a
user meets them: install, an agent proving only its own pod, an adapter, an agent pod replaced,
Generate through the agents' Service, an upgrade that turns mutual TLS on and moves the model to
the download init container (served over http from this machine), ``helm test`` (its pod finds
the agents by the headless Service's cluster DNS name), uninstall.

A machine where the node cannot start (not root, no overlayfs, binaries not built) fails this
module with the reason; it never skips.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import json
import logging
import re
import secrets
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from lorafleet.v1 import agent_pb2, agent_pb2_grpc
from lorafleet_common.identity import NONCE_BYTES, proof_matches
from lorafleet_dev.dns import find_coredns_bin_dir
from lorafleet_dev.images import BuiltImage, ImageBuilder
from lorafleet_dev.node import RealNode, check_machine, find_node_bin_dir, machine_ip
from lorafleet_dev.pki import Authority, KeyPair
from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from tests.kube.harness import CHECKOUT, ControlPlane, HarnessError

log = logging.getLogger(__name__)

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
    "agent.device": "cpu",
    "agent.gpus": 0,
    "agent.replicas": 2,
    "agent.resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "4Gi"}},
    "agent.extraArgs": ["--cpu-threads=1"],
    "agent.shmSize": "256Mi",
    "agent.tmpSizeLimit": "1Gi",
    "agent.cacheSizeLimit": "1Gi",
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
        node_bin_dir, dns_bin_dir = find_node_bin_dir(CHECKOUT), find_coredns_bin_dir(CHECKOUT)
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
            node = RealNode.start(cluster, node_bin_dir, dns_bin_dir)
            try:
                # Imported unless the node's store (kept between runs) holds them already; a
                # second import of the same archive is always a no-op.
                for image in (operator, agent):
                    node.import_image(image.archive)
                    assert not node.import_image(image.archive), image.name
                    assert image.name in node.images()
                yield RealCluster(cluster, node, operator, agent, data)
            finally:
                left = node.stop()
            # A clean shutdown: no process, mount (snapshot, netns, volume), bridge, cgroup,
            # iptables chain or changed kernel setting of the node stays on the machine.
            assert left == []
    finally:
        shutil.rmtree(data, ignore_errors=True)


class Laps:
    """Logs how long each step of the test took (``--log-cli-level=INFO`` shows them): where
    the test's time goes, for docs/kube-test-harness.md's timings. Nothing is asserted on it."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    def __call__(self, step: str) -> None:
        now = time.monotonic()
        log.info("step %s: %.1fs", step, now - self._last)
        self._last = now


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


@dataclass(frozen=True)
class ClientTls:
    """How a client dials agents serving the chart's TLS: the CA it trusts, its certificate
    (none: it has no client certificate) and the name it verifies (the chart's tls.serverName)."""

    ca: bytes
    client: KeyPair | None
    server_name: str

    def credentials(self) -> grpc.ChannelCredentials:
        key, cert = (self.client.key, self.client.cert) if self.client else (None, None)
        return grpc.ssl_channel_credentials(self.ca, key, cert)


def stub(address: str, tls: ClientTls | None = None) -> tuple[grpc.Channel, agent_pb2_grpc.NodeAgentStub]:
    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, tls.credentials(), options=[("grpc.ssl_target_name_override", tls.server_name)])
    return channel, agent_pb2_grpc.NodeAgentStub(channel)


def registry(address: str, token: str, tls: ClientTls | None = None) -> dict[str, list[int]]:
    """What the agent at ``address`` itself holds (name -> ranks): the truth the status reports."""
    channel, agent = stub(address, tls)
    with channel:
        reply = agent.ListAdapters(agent_pb2.ListAdaptersRequest(), timeout=10, metadata=(("authorization", f"Bearer {token}"),))
    return {a.name: list(a.ranks) for a in reply.adapters}


def generate(address: str, token: str, adapter: str) -> list[int]:
    """Greedy tokens for :data:`PROMPT` from the agent (or Service) at ``address``."""
    channel, agent = stub(address)
    with channel:
        replies = agent.Generate(
            agent_pb2.GenerateRequest(token_ids=PROMPT, adapter=adapter, max_new_tokens=6),
            timeout=60,
            metadata=(("authorization", f"Bearer {token}"),),
        )
        return [r.token_id for r in replies]


def pods(cluster: ControlPlane, ns: str, name: str) -> list[dict[str, Any]]:
    """The pods labelled ``app.kubernetes.io/name=<name>`` (lorafleet-operator, lorafleet-agent)."""
    found = cluster.kubectl_json("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/name={name}")["items"]
    return list(found)


def ready(pod: dict[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return (
        bool(statuses)
        and all(s["ready"] and "running" in s["state"] for s in statuses)
        and pod["metadata"].get("deletionTimestamp") is None
    )


def probe_results(node: RealNode, ns: str, container: str, probe_type: str) -> dict[str, float]:
    """The kubelet's probe counts for the ``container`` containers of ``ns``, by result."""
    counts: dict[str, float] = {}
    for line in node.kubelet_metrics().splitlines():
        if (
            line.startswith("prober_probe_total{")
            and f'namespace="{ns}"' in line
            and f'probe_type="{probe_type}"' in line
            and f'container="{container}"' in line
        ):
            result = line.split('result="', 1)[1].split('"', 1)[0]
            counts[result] = counts.get(result, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def model_archive(model: Path, directory: Path) -> tuple[Path, str]:
    """``tar -C MODEL -czf model.tar.gz .`` (as docs/deploy.md says to make one) and its sha256."""
    archive = directory / "model.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(model, arcname=".")
    archive.chmod(0o644)
    return archive, hashlib.sha256(archive.read_bytes()).hexdigest()


@contextlib.contextmanager
def serving(path: Path, host: str) -> Iterator[tuple[str, list[str]]]:
    """Serve ``path``'s directory over http on ``host`` (this machine's address: the pods reach
    it through their bridge); yields the URL of ``path`` and the paths GET requested so far."""
    requested: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(path.parent), **kwargs)

        def do_GET(self) -> None:
            requested.append(self.path)
            super().do_GET()

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the requests are kept in ``requested``; the log would only be noise

    server = http.server.ThreadingHTTPServer((host, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}/{path.name}", requested
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def tls_secret(name: str, ca: Authority, pair: KeyPair) -> str:
    """The chart's TLS Secret (tls.crt, tls.key, ca.crt), opened to the fleet ``default``."""
    data = {"tls.crt": pair.cert, "tls.key": pair.key, "ca.crt": ca.pem}
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "labels": {"lorafleet.dev/allow-fleet": "default"}},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
        }
    )


def model_claim(cluster: ControlPlane, ns: str, model: Path) -> str:
    """A PersistentVolumeClaim of ``ns`` bound to a hostPath PersistentVolume of the model
    directory (static provisioning: the controller manager's binder binds the pair, the
    scheduler waits for it, the kubelet mounts it). Returns the claim's name."""
    claim = "model"
    cluster.apply(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "List",
                "items": [
                    {
                        "apiVersion": "v1",
                        "kind": "PersistentVolume",
                        "metadata": {"name": f"{ns}-model"},
                        "spec": {
                            "capacity": {"storage": "1Gi"},
                            "accessModes": ["ReadOnlyMany"],
                            "persistentVolumeReclaimPolicy": "Retain",
                            "storageClassName": "",
                            "claimRef": {"namespace": ns, "name": claim},
                            "hostPath": {"path": str(model), "type": "Directory"},
                        },
                    },
                    {
                        "apiVersion": "v1",
                        "kind": "PersistentVolumeClaim",
                        "metadata": {"name": claim, "namespace": ns},
                        "spec": {
                            "accessModes": ["ReadOnlyMany"],
                            "storageClassName": "",
                            "volumeName": f"{ns}-model",
                            "resources": {"requests": {"storage": "1Gi"}},
                        },
                    },
                ],
            }
        ),
        ns,
    )
    return claim


def wrong_token_test_pod(cluster: ControlPlane, ns: str, secret: str) -> dict[str, Any]:
    """The release's own ``helm test`` pod (from ``helm get hooks``) under another name, its
    token from ``secret`` and a 5 s deadline: what the hook does when the token is wrong."""
    hooks = yaml.safe_load_all(cluster.helm("get", "hooks", RELEASE, "--namespace", ns).stdout)
    (pod,) = [h for h in hooks if h and h["kind"] == "Pod" and h["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    pod["metadata"]["name"] += "-wrong-token"
    del pod["metadata"]["annotations"]
    (container,) = pod["spec"]["containers"]
    for env in container["env"]:
        if env["name"] == "TIMEOUT_S":
            env["value"] = "5"
    (auth,) = [v for v in pod["spec"]["volumes"] if v["name"] == "auth"]
    auth["secret"]["secretName"] = secret
    return dict(pod)


def install_args(real: RealCluster, claim: str) -> list[str]:
    """``helm install`` flags: the locally built images (never pulled: there is no registry),
    the model from the claim, the adapters from a hostPath volume, agents sized for this
    machine."""
    op_repo, op_tag = real.operator.name.rsplit(":", 1)
    agent_repo, agent_tag = real.agent.name.rsplit(":", 1)
    values: dict[str, Any] = {
        "image.operator.repository": op_repo,
        "image.operator.tag": op_tag,
        "image.agent.repository": agent_repo,
        "image.agent.tag": agent_tag,
        "image.pullPolicy": "Never",
        "agent.baseModel": BASE_MODEL,
        "agent.model.pvc.claimName": claim,
        "agent.adapterVolume": {"hostPath": {"path": str(real.data / "adapters"), "type": "Directory"}},
        **AGENT_VALUES,
    }
    return [arg for key, value in values.items() for arg in ("--set-json", f"{key}={json.dumps(value)}")]


class Release:
    """The chart installed as ``RELEASE`` in namespace ``ns`` of the real cluster: what every
    step of the test reads, and what a failed wait prints."""

    def __init__(self, real: RealCluster, ns: str) -> None:
        self.real, self.ns = real, ns
        self.cluster, self.node = real.cluster, real.node
        self.lap = Laps()
        #: The adapter's name in each agent's registry.
        self.held = f"{ns}.support"

    def diagnose(self) -> str:
        cluster, node, ns = self.cluster, self.node, self.ns
        listing = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        events = cluster.kubectl("get", "events", "-n", ns, check=False).stdout
        logs = ""
        for name in ("lorafleet-operator", "lorafleet-agent"):
            out = cluster.kubectl(
                "logs", "-n", ns, "-l", f"app.kubernetes.io/name={name}", "--tail=30", "--all-containers", "--prefix", check=False
            )
            logs += f"{name} log:\n{out.stdout or out.stderr}\n"
        return (
            f"pods:\n{listing}\nevents:\n{events[-4000:]}\n{logs}kubelet:\n{node.logs('kubelet', 20)}\ncoredns:\n{node.logs('coredns', 20)}"
        )

    def wait(self, what: str, probe: Callable[[], Any], timeout_s: float) -> Any:
        return wait_for(what, probe, timeout_s, self.diagnose)

    def agent_pods(self) -> list[dict[str, Any]]:
        return pods(self.cluster, self.ns, "lorafleet-agent")

    def adapter_status(self) -> dict[str, Any]:
        obj = self.cluster.kubectl_json("get", "la", "support", "-n", self.ns)
        return dict(obj.get("status") or {})

    def loaded_everywhere(self) -> dict[str, Any]:
        """The adapter's status once it is Ready on both Ready agent pods (else empty)."""
        st = self.adapter_status()
        pods_now = {p["metadata"]["name"]: p for p in self.agent_pods() if ready(p)}
        entries = {a["pod"]: a for a in st.get("agents", [])}
        if st.get("phase") != "Ready" or set(entries) != set(pods_now) or len(pods_now) != 2:
            return {}
        return st


# pytest-timeout counts the module fixture's set-up and tear-down too: on a cold cache that builds
# both images (about 10 minutes on 2 cores: pip downloads and installs 3.4 GB of torch and CUDA
# wheels), imports them (about a minute) and deletes the node's 6 GB of snapshots. The bound
# only catches a hang; every wait inside has its own deadline.
@pytest.mark.timeout(3600)
def test_helm_install_upgrade_uninstall_on_a_real_node(real_cluster: RealCluster) -> None:
    cluster = real_cluster.cluster
    ns = cluster.create_namespace(prefix="real")
    release = Release(real_cluster, ns)
    try:
        claim = install(release)
        operator, agents = check_every_pod_is_real(release)
        token = check_token_and_identity(release, agents)
        check_adapter_ready_on_both_agents(release, agents, token)
        check_replaced_agent_loads_the_adapter_again(release, agents[0], token)
        check_generate_through_the_service(release, token)
        new_agents, ca, server_name = upgrade_to_tls_and_model_download(release)
        check_agents_speak_tls_only(release, new_agents, ClientTls(ca.pem, ca.issue("real-node-test", server=False), server_name), token)
        check_operator_replaced(release, operator["metadata"]["name"])
        check_helm_test(release, new_agents)
        check_uninstall_leaves_nothing(release, claim)
    finally:
        cluster.delete_namespace(ns)
        cluster.kubectl("delete", "pv", f"{ns}-model", "--ignore-not-found", check=False)


def install(release: Release) -> str:
    """``helm install --wait`` with the model from a claim; returns the claim's name."""
    cluster, ns = release.cluster, release.ns
    claim = model_claim(cluster, ns, release.real.data / "model")
    install = cluster.helm(
        "install",
        RELEASE,
        str(CHECKOUT.chart),
        "--namespace",
        ns,
        *install_args(release.real, claim),
        "--wait",
        "--timeout=400s",
        check=False,
        timeout_s=460,
    )
    assert install.returncode == 0, f"{install.stderr}\n{release.diagnose()}"
    release.lap("helm install --wait")
    # The model came from the claim: bound to its volume, mounted by the agents.
    bound = cluster.kubectl_json("get", "pvc", claim, "-n", ns)
    assert bound["status"]["phase"] == "Bound" and bound["spec"]["volumeName"] == f"{ns}-model", bound
    return claim


def check_every_pod_is_real(release: Release) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every pod is real: scheduled onto the node, its containers run by containerd, Ready
    through the kubelet's own probes (the agents' gRPC health probes, counted in its metrics).
    Returns the operator pod and the agent pods, by name."""
    cluster, node, ns = release.cluster, release.node, release.ns
    (operator,) = pods(cluster, ns, "lorafleet-operator")
    agents = sorted(release.agent_pods(), key=lambda p: p["metadata"]["name"])
    assert [p["metadata"]["name"] for p in agents] == [f"{FULLNAME}-agent-0", f"{FULLNAME}-agent-1"]
    for pod in [operator, *agents]:
        assert pod["spec"]["nodeName"] == node.name
        assert pod["status"]["podIP"].startswith("10.89."), pod["status"]
        assert ready(pod), pod["status"]
        for container in pod["status"]["containerStatuses"]:
            assert container["containerID"].removeprefix("containerd://") in node.running_containers()
    for probe in ("Startup", "Readiness"):
        assert probe_results(node, ns, "agent", probe).get("successful", 0) >= 2, probe
    return operator, agents


def check_token_and_identity(release: Release, agents: list[dict[str, Any]]) -> str:
    """The token is required, and each agent proves only its own pod; returns the token."""
    cluster, ns = release.cluster, release.ns
    token = base64.b64decode(cluster.kubectl_json("get", "secret", f"{FULLNAME}-agent-token", "-n", ns)["data"]["token"]).decode()
    # The token is required (auth on by default): a call without it is refused.
    channel, anonymous = stub(f"{agents[0]['status']['podIP']}:{GRPC_PORT}")
    with channel, pytest.raises(grpc.RpcError) as refused:
        anonymous.ListAdapters(agent_pb2.ListAdaptersRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

    # Each agent knows its own pod (the chart's --pod-name from the downward API): an
    # identity challenge for its own pod is answered with the token's proof, one for the
    # other agent's pod is not (a pod relaying challenges to a real agent gets nothing).
    nonce = secrets.token_bytes(NONCE_BYTES)
    own, other = (f"{ns}/{p['metadata']['name']}" for p in agents)
    channel, first = stub(f"{agents[0]['status']['podIP']}:{GRPC_PORT}")
    with channel:
        proofs = {pod: first.ProveIdentity(agent_pb2.ProveIdentityRequest(nonce=nonce, pod=pod), timeout=10).proof for pod in (own, other)}
    assert proof_matches(token, own, nonce, proofs[own]), proofs
    assert proofs[other] == b"", proofs
    release.lap("pods, probes, token, identity")
    return token


def check_adapter_ready_on_both_agents(release: Release, agents: list[dict[str, Any]], token: str) -> None:
    """A LoraAdapter applied with kubectl: Ready, and its per-agent, per-rank status equals
    what each agent pod's registry holds."""
    release.cluster.apply(
        json.dumps(
            {
                "apiVersion": "lorafleet.dev/v1alpha1",
                "kind": "LoraAdapter",
                "metadata": {"name": "support"},
                "spec": {"baseModel": BASE_MODEL, "source": {"uri": f"file://{ADAPTER_ROOT}/support"}, "fleetRef": {"name": "default"}},
            }
        ),
        release.ns,
    )
    st = release.wait("LoraAdapter support Ready on both agents", release.loaded_everywhere, 180)
    assert st["agentsSummary"] == "2/2" and st["ranksSummary"] == "2/2", st
    for pod in agents:
        entry = next(a for a in st["agents"] if a["pod"] == pod["metadata"]["name"])
        assert (entry["state"], entry["ranksLoaded"], entry["ranksTotal"]) == ("Loaded", 1, 1), entry
        assert registry(f"{pod['status']['podIP']}:{GRPC_PORT}", token) == {release.held: [0]}
    release.lap("adapter Ready on both agents")


def check_replaced_agent_loads_the_adapter_again(release: Release, victim: dict[str, Any], token: str) -> None:
    """An agent pod deleted: the StatefulSet makes a new one (same name, new uid), which
    starts empty; the operator's drift check loads the adapter onto it again."""
    release.cluster.kubectl("delete", "pod", victim["metadata"]["name"], "-n", release.ns, "--wait=true")
    release.lap("agent pod deleted")

    def replacement() -> dict[str, Any]:
        for pod in release.agent_pods():
            if pod["metadata"]["name"] == victim["metadata"]["name"] and ready(pod) and pod["metadata"]["uid"] != victim["metadata"]["uid"]:
                return pod
        return {}

    new_agent = release.wait("the StatefulSet's new agent pod Ready", replacement, 300)
    release.lap("replacement agent Ready")
    new_address = f"{new_agent['status']['podIP']}:{GRPC_PORT}"
    release.wait("the adapter back on the new agent pod", lambda: registry(new_address, token) == {release.held: [0]}, 180)
    st = release.wait("LoraAdapter support Ready on both agents again", release.loaded_everywhere, 120)
    assert st["ranksSummary"] == "2/2", st
    release.lap("adapter reloaded onto the replacement")


def check_generate_through_the_service(release: Release, token: str) -> None:
    """Generate through the agents' client Service, its ClusterIP reached from this machine
    through kube-proxy's rules (no kubectl exec, no port-forward): the same greedy tokens as
    each agent pod gives when asked directly."""
    service = release.cluster.kubectl_json("get", "service", f"{FULLNAME}-agent-api", "-n", release.ns)
    cluster_ip = service["spec"]["clusterIP"]
    assert cluster_ip.startswith("10.96."), service["spec"]
    addresses = [f"{p['status']['podIP']}:{GRPC_PORT}" for p in release.agent_pods()]
    for adapter in (release.held, ""):
        direct = [generate(address, token, adapter) for address in addresses]
        assert direct[0] and direct[0] == direct[1], direct
        assert generate(f"{cluster_ip}:{GRPC_PORT}", token, adapter) == direct[0]
    release.lap("Generate through the Service")


def upgrade_to_tls_and_model_download(release: Release) -> tuple[list[dict[str, Any]], Authority, str]:
    """helm upgrade: the operator's log level, mutual TLS on (a throwaway CA; one certificate
    for the agents' server side and the operator's client side, verified under tls.serverName
    since the operator dials pod IPs), and the model from the download init container instead
    of the hostPath (an archive served over http from this machine). The Deployment rolls out
    a new operator pod, the StatefulSet new agents. Returns the new agent pods, the CA and the
    server name."""
    cluster, ns, data = release.cluster, release.ns, release.real.data
    old_agents = {p["metadata"]["uid"] for p in release.agent_pods()}
    ca = Authority("lorafleet-real-node-ca")
    server_name = f"{FULLNAME}-agent.{ns}.svc"
    cluster.apply(tls_secret("agent-tls", ca, ca.issue(server_name, server=True, dns_names=(server_name,), client_too=True)), ns)
    archive, sha = model_archive(data / "model", data)
    with serving(archive, cluster.advertise_ip) as (model_url, requested):
        upgrade = cluster.helm(
            "upgrade",
            RELEASE,
            str(CHECKOUT.chart),
            "--namespace",
            ns,
            "--reuse-values",
            "--set",
            "operator.logLevel=DEBUG",
            "--set",
            "tls.enabled=true",
            "--set",
            "tls.secretName=agent-tls",
            "--set",
            f"tls.serverName={server_name}",
            "--set",
            "agent.model.pvc.claimName=",
            "--set",
            f"agent.model.download.url={model_url}",
            "--set",
            f"agent.model.download.sha256={sha}",
            "--set",
            "agent.model.download.allowHttp=true",
            "--wait",
            "--timeout=480s",
            check=False,
            timeout_s=540,
        )
        assert upgrade.returncode == 0, f"{upgrade.stderr}\n{release.diagnose()}"
        release.lap("helm upgrade --wait (TLS, download)")

        def upgraded() -> list[dict[str, Any]]:
            found = release.agent_pods()
            fresh = [p for p in found if ready(p) and p["metadata"]["uid"] not in old_agents]
            return fresh if len(found) == len(fresh) == 2 else []

        new_agents = release.wait("both agents replaced by the upgrade and Ready", upgraded, 300)
        # Each new pod's model came through its init container: downloaded from here,
        # sha256-checked and unpacked into the emptyDir the agent serves from.
        for pod in new_agents:
            (init,) = pod["status"]["initContainerStatuses"]
            assert (init["name"], init["state"]["terminated"]["exitCode"]) == ("fetch-model", 0), init
            model_volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
            assert "emptyDir" in model_volume and "hostPath" not in model_volume, model_volume
        assert requested.count(f"/{archive.name}") >= 2, requested
    return new_agents, ca, server_name


def check_agents_speak_tls_only(release: Release, new_agents: list[dict[str, Any]], client: ClientTls, token: str) -> None:
    """The agents now speak TLS only and require a client certificate from the CA: the
    operator reloaded the adapter onto the new pods over it (each registry, read with such a
    certificate (`client`), holds it on its rank; the status says Ready on both). A client
    without TLS, or with the CA but no certificate or another CA's, is refused."""
    tls_addresses = [f"{p['status']['podIP']}:{GRPC_PORT}" for p in new_agents]
    for address in tls_addresses:
        release.wait(
            f"the adapter on the upgraded agent {address}",
            lambda address=address: registry(address, token, client) == {release.held: [0]},
            180,
        )
    st = release.wait("LoraAdapter support Ready on both upgraded agents", release.loaded_everywhere, 120)
    assert st["ranksSummary"] == "2/2", st
    stranger = Authority("someone else").issue("real-node-test", server=False)
    for who, tls in (
        ("a plaintext client", None),
        ("a client without a certificate", ClientTls(client.ca, None, client.server_name)),
        ("a client with another CA's certificate", ClientTls(client.ca, stranger, client.server_name)),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            registry(tls_addresses[0], token, tls)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, (who, refused.value)
    release.lap("adapter reloaded over TLS, refusals")


def check_operator_replaced(release: Release, old_pod: str) -> None:
    """The upgrade rolled out one new operator pod (not `old_pod`) with the new log level, and
    the kubelet's own liveness probe of it passes without a restart."""
    cluster, ns = release.cluster, release.ns
    cluster.kubectl("rollout", "status", f"deployment/{FULLNAME}-operator", "-n", ns, "--timeout=120s")

    def replaced() -> list[dict[str, Any]]:
        found = pods(cluster, ns, "lorafleet-operator")
        return found if len(found) == 1 and found[0]["metadata"]["name"] != old_pod else []

    (new_pod,) = release.wait("one operator pod, not the old one", replaced, 120)
    env = {e["name"]: e.get("value") for e in new_pod["spec"]["containers"][0]["env"]}
    assert env["LORAFLEET_LOG_LEVEL"] == "DEBUG"
    assert new_pod["status"]["containerStatuses"][0]["ready"], new_pod["status"]
    assert release.adapter_status()["phase"] == "Ready"
    # The chart's liveness probe, run by the kubelet itself, passes (successes counted in
    # its probe metrics) and never restarted the operator. A failure or two while it starts
    # on a loaded machine is tolerated, as by the probe's own failureThreshold.
    release.wait(
        "a successful liveness probe of the operator",
        lambda: probe_results(release.node, ns, "operator", "Liveness").get("successful", 0) >= 1,
        90,
    )
    (restarted,) = pods(cluster, ns, "lorafleet-operator")
    assert restarted["status"]["containerStatuses"][0]["restartCount"] == 0
    release.lap("new operator pod, liveness")


def check_helm_test(release: Release, new_agents: list[dict[str, Any]]) -> None:
    """helm test: the chart's test pod resolves the agents by the headless Service's cluster
    DNS name (CoreDNS on the node, from the resolv.conf the kubelet wrote) and checks each one
    (health SERVING, Describe over mutual TLS with the token); it needs REPLICAS (2)
    addresses. helm deletes the pod once it has succeeded."""
    cluster, ns = release.cluster, release.ns
    tested = cluster.helm("test", RELEASE, "--namespace", ns, "--timeout=300s", check=False, timeout_s=360)
    assert tested.returncode == 0 and re.search(r"^Phase:\s+Succeeded$", tested.stdout, re.M), (
        f"{tested.stdout}\n{tested.stderr}\n{release.diagnose()}"
    )
    release.lap("helm test")
    # The same pod with a wrong token fails, naming each agent it resolved as refusing it.
    cluster.kubectl("create", "secret", "generic", "wrong-token", "-n", ns, "--from-literal=token=not-the-token")
    wrong = wrong_token_test_pod(cluster, ns, "wrong-token")
    cluster.apply(json.dumps(wrong), ns)
    wrong_name = wrong["metadata"]["name"]

    def finished() -> str:
        phase = cluster.kubectl_json("get", "pod", wrong_name, "-n", ns).get("status", {}).get("phase", "")
        return str(phase) if phase in ("Succeeded", "Failed") else ""

    assert release.wait("the wrong-token test pod to finish", finished, 180) == "Failed"
    refusals = cluster.kubectl("logs", wrong_name, "-n", ns).stdout
    for pod in new_agents:
        assert re.search(rf"^agent {re.escape(pod['status']['podIP'])}: UNAUTHENTICATED", refusals, re.M), refusals
    cluster.kubectl("delete", "pod", wrong_name, "-n", ns, "--wait=true")
    cluster.kubectl("delete", "secret", "wrong-token", "-n", ns)
    release.lap("wrong-token test pod")


#: What ``helm uninstall`` must leave of each kind: the user's own objects only.
UNINSTALLED_KINDS = (
    "loraadapters",
    "lorafleets",
    "deployments",
    "statefulsets",
    "services",
    "jobs",
    "secrets",
    "persistentvolumeclaims",
    "poddisruptionbudgets",
    "roles",
    "rolebindings",
)


def check_uninstall_leaves_nothing(release: Release, claim: str) -> None:
    """helm uninstall: the pre-delete hook Job (a real pod, in-cluster through the kubernetes
    Service) has the operator unload everything (over TLS now); nothing of the release is
    left, nothing is stuck. The TLS Secret is the user's, not the chart's: it stays."""
    cluster, node, ns = release.cluster, release.node, release.ns
    uninstall = cluster.helm("uninstall", RELEASE, "--namespace", ns, "--wait", "--timeout=240s", check=False, timeout_s=300)
    assert uninstall.returncode == 0, f"{uninstall.stderr}\n{release.diagnose()}"
    release.lap("helm uninstall --wait")
    users = {"secrets": ["agent-tls"], "persistentvolumeclaims": [claim]}
    for kind in UNINSTALLED_KINDS:
        left = [i["metadata"]["name"] for i in cluster.kubectl_json("get", kind, "-n", ns)["items"]]
        assert left == users.get(kind, []), f"{kind} left: {left}"
    left_sas = {i["metadata"]["name"] for i in cluster.kubectl_json("get", "serviceaccounts", "-n", ns)["items"]}
    assert left_sas == {"default"}
    release.wait("every pod of the release gone", lambda: not cluster.kubectl_json("get", "pods", "-n", ns)["items"], 180)
    # The hook ran as a real pod on the node (helm deleted its Job once it succeeded).
    started = cluster.kubectl_json("get", "events", "-n", ns, "--field-selector=involvedObject.kind=Pod,reason=Started")
    hook_pods = {e["involvedObject"]["name"] for e in started["items"] if e["involvedObject"]["name"].startswith(f"{FULLNAME}-uninstall-")}
    assert len(hook_pods) == 1, started["items"]
    release.wait("containerd to run no container", lambda: node.running_containers() == [], 60)
    release.lap("nothing of the release left")
